"""CUDA-graph capture of public calls without a warm-up call, one case per process.

``python tests/capture_cases.py CASE`` builds torch CUDA inputs, prepares what the case
needs (plans uploaded with their dtypes, so their kernels are loaded and their workspace
allocated; outputs preallocated), then captures the call in ``torch.cuda.graph`` as the
process's first launch of that op, replays the graph and checks that it wrote the same
values as an eager call. Prints ``OK CASE`` on success; ``tests/test_gpu_capture.py``
runs every case in a fresh interpreter.
"""
from __future__ import annotations

import sys

import numpy as np


def _setup():
    import torch

    torch.manual_seed(0)
    return torch


def _rn(torch, *shape, dtype=None, scale=1.0):
    dtype = dtype or torch.bfloat16
    return (torch.randn(shape, device="cuda") * scale).to(dtype)


def _paged(torch, qo, kv, hq, hkv, d=128, page=128):
    qo, kv = np.asarray(qo, np.int32), np.asarray(kv, np.int32)
    pages = -(-kv // page)
    n_pages = int(pages.sum()) + 2
    perm = torch.randperm(n_pages, device="cuda").to(torch.int32)
    kv_indices = perm[: int(pages.sum())].contiguous()
    cache_k = _rn(torch, n_pages, page, hkv, d)
    cache_v = _rn(torch, n_pages, page, hkv, d)
    q = _rn(torch, int(qo.sum()), hq, d)
    return qo, kv, q, cache_k, cache_v, kv_indices


def _selection(torch, total_q, hkv, width, n_blocks):
    sel = torch.full((total_q, hkv, width), -1, dtype=torch.int32, device="cuda")
    sel[:, :, 0] = 0
    if n_blocks > 1:
        sel[:, :, 1] = n_blocks - 1
    return sel


def _runtime(torch, mc, qo, kv, page=None, pages_per_req=None):
    t = lambda x: torch.as_tensor(np.asarray(x, np.int32), device="cuda")  # noqa: E731
    cu = lambda x: t(np.concatenate([[0], np.cumsum(x)]))  # noqa: E731
    extra = {}
    if page is not None:
        extra["kv_page_indptr"] = cu(-(-np.asarray(kv) // page))
    return mc.MsaRuntimeMetadata(qo_lens=t(qo), kv_lens=t(kv), qo_offset=t(np.asarray(kv) - np.asarray(qo)),
                                 cu_seqlens_q=cu(qo), cu_seqlens_k=cu(kv), seqused_k=t(kv), **extra)


def case_fns(torch, mc):
    """name -> () -> (call, outputs): ``call()`` runs the op, writing ``outputs`` in place."""
    bf16 = torch.bfloat16
    cases = {}

    def dense_eager():
        qo, kv, hq, hkv = [3, 200], [300, 200], 16, 2
        q, k, v = _rn(torch, sum(qo), hq, 128), _rn(torch, sum(kv), hkv, 128), _rn(torch, sum(kv), hkv, 128)
        info = mc.msa_plan_from_lengths(np.array(qo), np.array(kv), hq, hkv, device=0)
        mc.upload_plan(info, device=0, head_dim=128, dtype=bf16)
        out = torch.empty_like(q)
        return (lambda: mc.msa(q, k, v, info, out=out)), [out]

    def paged_eager():
        qo, kv, q, ck, cv, idx = _paged(torch, [1] * 4, [1000, 37, 4096, 129], 16, 2, page=64)
        info = mc.msa_plan_from_lengths(qo, kv, 16, 2, page_size=64, device=0)
        mc.upload_plan(info, device=0, head_dim=128, dtype=bf16)
        out = torch.empty_like(q)
        return (lambda: mc.msa(q, ck, cv, info, kv_indices=idx, out=out)), [out]

    def paged_static():
        qo, kv, q, ck, cv, idx = _paged(torch, [1] * 4, [1000, 37, 4096, 129], 16, 2, page=64)
        info = mc.msa_plan(4, 1, 4096, 16, num_kv_heads=2, page_size=64, total_seqlen_k=ck.shape[0] * 64)
        mc.upload_plan(info, device=0, head_dim=128, dtype=bf16)
        md = _runtime(torch, mc, qo, kv, page=64)
        out = torch.empty_like(q)
        return (lambda: mc.msa(q, ck, cv, info, kv_indices=idx, out=out, runtime_metadata=md)), [out]

    def max_score_eager():
        qo, kv, hq, hkv = [300], [1000], 4, 1
        q, k = _rn(torch, sum(qo), hq, 128), _rn(torch, sum(kv), hkv, 128)
        info = mc.msa_plan_from_lengths(np.array(qo), np.array(kv), hq, hkv, device=0)
        mc.upload_plan(info, device=0, head_dim=128, dtype=bf16)
        ms = torch.empty((sum(qo), hq, 8), dtype=torch.float32, device="cuda")
        return (lambda: mc.msa(q, k, k, info, max_score=ms, output_o=False)), [ms]

    def sparse_prefill_eager(tile):
        def build():
            qo, kv, q, ck, cv, idx = _paged(torch, [700], [1500], 64, 4)
            info = mc.sparse_msa_plan(qo, kv, 64, 4, page_size=128, kv_block_num=16, device=0, prefill_tile=tile)
            mc.upload_plan(info, device=0, head_dim=128, dtype=bf16)
            sel = _selection(torch, q.shape[0], 4, 16, 12)
            out = torch.empty_like(q)
            return (lambda: mc.sparse_msa(q, ck, cv, info, kv_indices=idx, kv_block_indexes=sel, out=out)), [out]
        return build

    def sparse_prefill_static():
        qo, kv, q, ck, cv, idx = _paged(torch, [700], [1500], 64, 4)
        info = mc.msa_plan(1, 700, 1500, 64, num_kv_heads=4, page_size=128, kv_block_num=16,
                           total_seqlen_k=ck.shape[0] * 128, sparse_kernel_mode="prefill")
        mc.upload_plan(info, device=0, head_dim=128, dtype=bf16)
        md = _runtime(torch, mc, qo, kv, page=128)
        sel = _selection(torch, q.shape[0], 4, 16, 12)
        out = torch.empty_like(q)
        return (lambda: mc.sparse_msa(q, ck, cv, info, kv_indices=idx, kv_block_indexes=sel, out=out,
                                      runtime_metadata=md)), [out]

    def sparse_decode_eager():
        qo, kv, q, ck, cv, idx = _paged(torch, [1] * 3, [5000, 129, 70000], 64, 4)
        info = mc.msa_plan_from_lengths(qo, kv, 64, 4, page_size=128, kv_block_num=16, device=0)
        mc.upload_plan(info, device=0, head_dim=128, dtype=bf16)
        sel = _selection(torch, 3, 4, 16, 2)
        out = torch.empty_like(q)
        return (lambda: mc.sparse_decode_atten_func(q, ck, cv, info, kv_indices=idx, kv_block_indexes=sel,
                                                    out=out)), [out]

    def sparse_decode_static():
        qo, kv, q, ck, cv, idx = _paged(torch, [1] * 3, [5000, 129, 70000], 64, 4)
        info = mc.msa_plan(3, 1, 70000, 64, num_kv_heads=4, page_size=128, kv_block_num=16,
                           total_seqlen_k=ck.shape[0] * 128)
        mc.upload_plan(info, device=0, head_dim=128, dtype=bf16)
        md = _runtime(torch, mc, qo, kv, page=128)
        sel = _selection(torch, 3, 4, 16, 2)
        out = torch.empty_like(q)
        return (lambda: mc.sparse_decode_atten_func(q, ck, cv, info, kv_indices=idx, kv_block_indexes=sel,
                                                    out=out, runtime_metadata=md)), [out]

    def topk():
        scores = torch.randn((64, 8, 1000), device="cuda")
        sel = torch.empty((64, 8, 16), dtype=torch.int32, device="cuda")
        return (lambda: mc.sparse_topk_select(scores, 16, output=sel, force_begin_blocks=1)), [sel]

    def kda_decode():
        b, h, hv, k = 8, 2, 4, 128
        pool = torch.randn((16, hv, k, k), device="cuda") * 0.05
        idx = torch.arange(b, dtype=torch.int32, device="cuda")
        q, kk, v, a = _rn(torch, b, 1, h, k), _rn(torch, b, 1, h, k), _rn(torch, b, 1, hv, k), _rn(torch, b, 1, hv, k)
        beta = _rn(torch, b, 1, hv)
        A_log = torch.rand(hv, device="cuda")
        out = torch.empty((b, 1, hv, k), dtype=bf16, device="cuda")
        snapshot = pool.clone()

        def call():
            pool.copy_(snapshot)
            return mc.gated_delta_rule_decode(q, kk, v, pool, A_log, a, None, None, None, beta, state_indices=idx,
                                              output=out, inplace_final_state=True)
        return call, [out, pool]

    def chunk():
        t, h, hv = 300, 2, 4
        q, k, v = _rn(torch, 1, t, h, 128), _rn(torch, 1, t, h, 128), _rn(torch, 1, t, hv, 128)
        g = -torch.rand((1, t, hv, 128), device="cuda").to(bf16) * 0.1
        beta = _rn(torch, 1, t, hv)
        out = torch.empty_like(v)
        fs = torch.empty((1, hv, 128, 128), dtype=torch.float32, device="cuda")
        ws = mc.Workspace(mc.chunk_kda_workspace_bytes(1, t, hv), device=0)
        return (lambda: mc.chunk_kda(q, k, v, g, beta, output_final_state=True, output=out, final_state=fs,
                                     workspace=ws)), [out, fs]

    def pipeline():
        qo, kv, q, ck, cv, idx = _paged(torch, [1, 2, 300], [700, 129, 1000], 16, 1)
        plan = mc.sparse_pipeline_plan(qo, kv, 16, 1, topk=4, force_begin_blocks=1, force_end_blocks=1, device=0,
                                       head_dim=128, dtype=bf16)
        iq = _rn(torch, int(qo.sum()), 1, 128)
        ik = _rn(torch, ck.shape[0], 128, 1, 128)
        out = torch.empty_like(q)
        return (lambda: mc.sparse_attention_pipeline(q, ck, cv, iq, ik, plan, kv_indices=idx, out=out)), [out]

    def pipeline_static():
        qo, kv, q, ck, cv, idx = _paged(torch, [4, 4, 4], [5000, 129, 900], 16, 1)
        plan = mc.sparse_pipeline_static_plan(3, 4, 8192, 16, 1, total_seqlen_k=3 * 8192, topk=4,
                                              force_begin_blocks=1, force_end_blocks=1, device=0, head_dim=128,
                                              dtype=bf16)
        md = _runtime(torch, mc, qo, kv, page=128)
        iq = _rn(torch, int(qo.sum()), 1, 128)
        ik = _rn(torch, ck.shape[0], 128, 1, 128)
        out = torch.empty_like(q)
        return (lambda: mc.sparse_attention_pipeline(q, ck, cv, iq, ik, plan, kv_indices=idx, runtime_metadata=md,
                                                     out=out)), [out]

    def cast():
        x = torch.randn((1000, 128), device="cuda")
        out = torch.empty((1000, 128), dtype=bf16, device="cuda")
        return (lambda: mc.cast(x, "bfloat16", out=out)), [out]

    cases.update({
        "msa_dense_eager": dense_eager, "msa_paged_eager": paged_eager, "msa_paged_static": paged_static,
        "msa_max_score_eager": max_score_eager, "sparse_msa_eager": sparse_prefill_eager("query"),
        "sparse_msa_gather_eager": sparse_prefill_eager("gather"), "sparse_msa_static": sparse_prefill_static,
        "sparse_decode_eager": sparse_decode_eager, "sparse_decode_static": sparse_decode_static,
        "sparse_topk_select": topk, "gated_delta_rule_decode": kda_decode, "chunk_kda": chunk, "cast": cast,
        "sparse_attention_pipeline": pipeline, "sparse_attention_pipeline_static": pipeline_static,
    })
    return cases


CASES = ("msa_dense_eager", "msa_paged_eager", "msa_paged_static", "msa_max_score_eager", "sparse_msa_eager",
         "sparse_msa_gather_eager", "sparse_msa_static", "sparse_decode_eager", "sparse_decode_static",
         "sparse_topk_select", "gated_delta_rule_decode", "chunk_kda", "cast", "sparse_attention_pipeline",
         "sparse_attention_pipeline_static")


def main(name: str) -> int:
    torch = _setup()
    import mate_cupy as mc

    call, outputs = case_fns(torch, mc)[name]()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the op's first launch in this process
        call()
    for o in outputs:
        o.fill_(float("nan")) if o.dtype.is_floating_point else o.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    captured = [o.clone() for o in outputs]
    for o in outputs:
        o.fill_(float("nan")) if o.dtype.is_floating_point else o.fill_(-7)
    call()  # eager
    torch.cuda.synchronize()
    for i, (c, e) in enumerate(zip(captured, outputs)):
        if c.dtype.is_floating_point:
            same = torch.equal(torch.nan_to_num(c.float(), nan=1e30), torch.nan_to_num(e.float(), nan=1e30))
            finite = bool(torch.isfinite(e.float()).any())
        else:
            same, finite = torch.equal(c, e), bool((e != -7).any())
        if not same or not finite:
            print(f"FAIL {name}: output {i} differs between the graph replay and the eager call "
                  f"(or was not written)")
            return 1
    print(f"OK {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
