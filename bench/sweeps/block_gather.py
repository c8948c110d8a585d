"""Prototype timing of the block-stationary decomposition for per-token block lists.

    PYTHONPATH=. python bench/sweeps/block_gather.py OUTDIR [--s 32768] [--chunk 1024] [--cap 64]

The benchmark's per-token case (``bench/bench_attention.py``: S 32768, Hq 64, Hkv 4, D 128,
bf16, causal, 16 blocks per query and KV head: block 0, the query's own block, 14 random
earlier ones; paged KV with page = block = 128 keys in random page order). Pair lists are
built on the host here (NumPy): per KV head the (query, slot) pairs of every block, ordered
by query chunk (``--chunk`` queries, so their Q rows stay in L2), then block, split into CTAs
of at most ``--cap`` queries. ``bench/sweeps/block_gather.cu`` computes each pair's normalised
O (fp16) and lse, then merges the slots per query. Times both kernels (CUDA events, median)
beside ``mate_cupy.sparse_msa`` on the same inputs, and compares the outputs.

Writes ``OUTDIR/block_gather.json``. Not a library path (see docs/attention.md).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HQ, HKV, D, BLOCK, TOPK = 64, 4, 128, 128, 16


def build_lists(ids, chunk: int, cap: int):
    """ids int32 [S, Hkv, 16] (host) -> cta_info [C, 4] (kvh, block, begin, end), pair_q, pair_slot."""
    import numpy as np

    S, hkv, k = ids.shape
    nb = (S + BLOCK - 1) // BLOCK
    q_all, j_all, b_all, h_all = [], [], [], []
    qpos = np.arange(S)[:, None]
    for h in range(hkv):
        b = ids[:, h, :]
        ok = (b >= 0) & (b < nb) & (b * BLOCK <= qpos)
        qi, ji = np.nonzero(ok)
        q_all.append(qi); j_all.append(ji); b_all.append(b[qi, ji]); h_all.append(np.full(qi.size, h))
    qi, ji, bi, hi = (np.concatenate(x).astype(np.int64) for x in (q_all, j_all, b_all, h_all))
    order = np.lexsort((qi, bi, hi, qi // chunk))  # chunk, then KV head, then block, then query
    qi, ji, bi, hi = qi[order], ji[order], bi[order], hi[order]
    key = ((qi // chunk) * hkv + hi) * nb + bi
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    ends = np.r_[starts[1:], key.size]
    info = []
    for s0, e0 in zip(starts, ends):
        for a in range(s0, e0, cap):
            info.append((hi[s0], bi[s0], a, min(e0, a + cap)))
    return (np.asarray(info, dtype=np.int32), qi.astype(np.int32), ji.astype(np.int32), int(qi.size))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--s", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--cap", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--wgs", type=int, default=3, help="warpgroups per CTA")
    ap.add_argument("--qbuf", type=int, default=2, help="Q tiles per warpgroup (2: double-buffered gather)")
    ap.add_argument("--minb", type=int, default=1, help="__launch_bounds__ min blocks per SM")
    args = ap.parse_args()
    import cupy as cp
    import numpy as np
    import torch

    from bench import ours
    from bench.bench_attention import select_blocks
    from mate_cupy.jit.compiler import compile_options
    from mate_cupy.jit.sources import SRC_DIR

    S = args.s
    nb = (S + BLOCK - 1) // BLOCK
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(3)
    q = torch.randn((S, HQ, D), generator=g, device=dev).to(torch.bfloat16)
    kc = torch.randn((nb, BLOCK, HKV, D), generator=g, device=dev).to(torch.bfloat16)
    vc = torch.randn((nb, BLOCK, HKV, D), generator=g, device=dev).to(torch.bfloat16)
    perm = torch.randperm(nb, generator=g, device=dev).to(torch.int32)
    ids = select_blocks(torch.arange(S, device=dev) // BLOCK, HKV, nb, TOPK, g)
    t0 = time.perf_counter()
    info, pq, pslot, pairs = build_lists(ids.cpu().numpy(), args.chunk, args.cap)
    host_s = time.perf_counter() - t0

    src = (Path(__file__).with_suffix(".cu")).read_text()
    opts = tuple(compile_options("sm_90a")) + (f"-I{SRC_DIR}", f"-DBG_WGS={args.wgs}", f"-DBG_QBUF={args.qbuf}",
                                                 f"-DBG_MINB={args.minb}")
    mod = cp.RawModule(code=src, options=opts)
    attn, merge = mod.get_function("block_gather_attn"), mod.get_function("block_gather_merge")
    smem = 2 * BLOCK * D * 2 + args.wgs * args.qbuf * 64 * D * 2 + 1024
    attn.max_dynamic_shared_size_bytes = smem

    C = lambda t: cp.from_dlpack(t)  # noqa: E731
    info_d, pq_d, ps_d = cp.asarray(info), cp.asarray(pq), cp.asarray(pslot)
    part_o = cp.empty((S, HKV, TOPK, 16, D), dtype=cp.float16)
    part_lse = cp.empty((S, HKV, TOPK, 16), dtype=cp.float32)
    out = torch.empty_like(q)
    scale_log2 = float(D ** -0.5 * 1.4426950408889634)
    n_ctas = int(info.shape[0])

    def run_attn():
        attn((n_ctas,), (128 * args.wgs,), (C(q), C(kc), C(vc), C(perm), info_d, pq_d, ps_d, part_o, part_lse, np.int32(S),
                                  np.int32(HKV), np.int32(n_ctas), np.float32(scale_log2)), shared_mem=smem)

    def run_merge():
        merge((S, HKV), (128,), (part_o, part_lse, C(ids), C(out), np.int32(S), np.int32(HKV), np.int32(nb)))

    plan = ours.sparse_plan([S], [S], HQ, HKV, page_size=BLOCK, kv_block_num=TOPK, causal=True)
    ref_out = torch.empty_like(q)

    def run_ours():
        ours.sparse_msa(q, kc, vc, plan, kv_indices=perm, kv_block_indexes=ids, out=ref_out)

    def timed(fn):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(args.reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        return statistics.median(ts)

    res = {"S": S, "Hq": HQ, "Hkv": HKV, "D": D, "topk": TOPK, "pairs": pairs, "ctas": n_ctas,
           "chunk": args.chunk, "cap": args.cap, "wgs": args.wgs, "qbuf": args.qbuf, "minb": args.minb, "host_list_build_s": round(host_s, 3),
           "workspace_bytes": int(part_o.nbytes + part_lse.nbytes)}
    res["attn_ms"] = timed(run_attn)
    res["merge_ms"] = timed(run_merge)
    res["total_ms"] = timed(lambda: (run_attn(), run_merge()))
    res["sparse_msa_ms"] = timed(run_ours)
    run_attn(); run_merge(); run_ours()
    torch.cuda.synchronize()
    diff = (out.float() - ref_out.float()).norm() / ref_out.float().norm()
    res["rel_err_vs_sparse_msa"] = float(diff)
    res["max_abs_diff"] = float((out.float() - ref_out.float()).abs().max())
    useful = pairs * 16 * BLOCK * D * 4
    res["useful_tflops_at_total"] = useful / (res["total_ms"] * 1e-3) / 1e12
    print(json.dumps(res, indent=1))
    Path(args.outdir).mkdir(parents=True, exist_ok=True)
    (Path(args.outdir) / "block_gather.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
