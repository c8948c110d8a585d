"""Replayed launches on the GPU: a replayed call writes exactly what the full path writes.

Each test runs an op once with replay off (the full path, checked against the references
by the op's own GPU tests), then twice with replay on (record, replay) on fresh inputs of
the same signature and NaN-poisoned outputs; the replayed results must equal the full
path's bit for bit. Also: torch callers on a side stream, CUDA-graph capture of a
replayed call, allocated results, the decode kernels' own reference check after replay.
"""
from __future__ import annotations

import ml_dtypes
from dataclasses import replace

import numpy as np
import pytest

from mate_cupy import _launch_cache as lc

pytestmark = pytest.mark.gpu
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def replays(monkeypatch):
    """Counts replayed calls; replay on for the test, recipes cleared before and after."""
    count = [0]
    real = lc.replay

    def counting(recipe, ptrs, first):
        count[0] += 1
        return real(recipe, ptrs, first)

    monkeypatch.setattr(lc, "replay", counting)
    was = lc.ENABLED
    lc.set_enabled(True)
    lc.clear()
    yield count
    lc.clear()
    lc.set_enabled(was)


def _dev(x):
    import cupy

    if x.dtype == BF16:
        return cupy.asarray(np.ascontiguousarray(x).view(np.uint16)).view(BF16)
    return cupy.asarray(x)


def _host(x):
    import cupy

    if x.dtype == BF16:
        return cupy.asnumpy(cupy.ascontiguousarray(x).view(np.uint16))
    return cupy.asnumpy(x)


def _nan(shape, dtype):
    import cupy

    if np.dtype(dtype) == BF16:
        return cupy.full(shape, 0x7FC0, dtype=np.uint16).view(BF16)
    if np.dtype(dtype).kind == "i":
        return cupy.full(shape, -7, dtype=dtype)
    return cupy.full(shape, np.nan, dtype=dtype)


def _same(ref_host, b):
    b = _host(b)
    assert ref_host.shape == b.shape
    assert np.array_equal(ref_host.view(np.uint8), b.view(np.uint8)), "replayed result differs from the full path"


def _full_then_replay(replays, fn, make, outputs):
    """``fn(inputs)`` full path, then record + replay on fresh inputs; compare ``outputs(inputs, result)``."""
    lc.set_enabled(False)
    x0 = make()
    ref = [_host(o) for o in outputs(x0, fn(x0))]
    lc.set_enabled(True)
    fn(make())
    before = replays[0]
    x1 = make()
    got = outputs(x1, fn(x1))
    assert replays[0] == before + 1, "the second call of a signature should replay"
    assert len(got) == len(ref)
    for a, b in zip(ref, got):
        _same(a, b)
    return x1


# ----------------------------------------------------------------------------- KDA decode


@pytest.mark.parametrize("name", ["t1_f32_vfirst", "t4_spec", "varlen_2d_kfirst_bf16", "dt_bias_bf16",
                                  "beta_per_channel", "store_not_inplace", "zero_init_store", "varlen_store"])
def test_decode_replay_matches_reference(replays, rng, name):
    """The decode GPU tests' cases, run twice: the replayed call meets the reference too."""
    import test_gpu_kda_decode as T

    if name not in T.CASES:
        pytest.skip(f"no decode case {name}")
    c = T.CASES[name]
    prep = T.build_case(c, rng)
    for preallocate in (True, True, False, False):
        if prep.pool0 is not None:
            prep.args["state"] = prep.pool0.copy()
        out, pool, final = T._run_case(c, prep, preallocate=preallocate)
        # Without a preallocated output the op returns q's dtype: judge it by that dtype.
        T.check_results(c if preallocate else replace(c, out_dtype=None), prep, out, pool, final)
    assert replays[0] >= 2


def test_decode_replay_equals_full_path(replays, rng):
    import cupy

    import mate_cupy as m

    B, H, HV, K = 8, 2, 4, 128
    r = lambda *s: (rng.standard_normal(s) * 0.5).astype(BF16)  # noqa: E731
    host = dict(q=r(B, 1, H, K), k=r(B, 1, H, K), v=r(B, 1, HV, K), a=r(B, 1, HV, K), b=r(B, 1, HV))
    pool = (rng.standard_normal((2 * B, HV, K, K)) * 0.05).astype(np.float32)
    a_log = rng.random(HV).astype(np.float32)
    idx = rng.permutation(2 * B)[:B].astype(np.int32)

    def make():
        x = {n: _dev(v) for n, v in host.items()}
        x.update(pool=cupy.asarray(pool), out=_nan((B, 1, HV, K), BF16))
        return x

    def fn(x):
        return m.gated_delta_rule_decode(x["q"], x["k"], x["v"], x["pool"], _dev(a_log), x["a"], None, None, None,
                                         x["b"], state_indices=_dev(idx), output=x["out"], inplace_final_state=True,
                                         apply_beta_sigmoid=True)

    _full_then_replay(replays, fn, make, lambda x, res: [x["out"], x["pool"]])


@pytest.mark.torch
def test_decode_torch_side_stream_and_graph_capture(replays, rng):
    """torch callers: replay launches on torch's current stream and can be captured."""
    import torch

    import mate_cupy as m

    B, H, HV, K = 4, 2, 2, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    rn = lambda *s: torch.randn(s, generator=g, device="cuda").to(torch.bfloat16)  # noqa: E731
    q, k, v, a, b = rn(B, 1, H, K), rn(B, 1, H, K), rn(B, 1, HV, K), rn(B, 1, HV, K), rn(B, 1, HV)
    pool0 = torch.randn((B, HV, K, K), generator=g, device="cuda") * 0.05

    def step(pool, out):
        return m.gated_delta_rule_decode(q, k, v, pool, None, a, None, None, None, b, output=out,
                                         inplace_final_state=True, apply_beta_sigmoid=True)

    lc.set_enabled(False)
    ref_pool = pool0.clone()
    ref_out = step(ref_pool, None)[0]
    lc.set_enabled(True)
    step(pool0.clone(), torch.empty_like(ref_out))  # records (preallocated output)
    step(pool0.clone(), None)  # records (allocated output)
    n0 = replays[0]
    s = torch.cuda.Stream()
    pool = pool0.clone()
    with torch.cuda.stream(s):
        out = torch.full((B, 1, HV, K), float("nan"), device="cuda", dtype=torch.bfloat16)
        res, fin = step(pool, out)
    s.synchronize()
    assert res is out and fin is pool and replays[0] == n0 + 1
    assert torch.equal(out, ref_out) and torch.equal(pool, ref_pool)
    alloc_out, _ = step(pool0.clone(), None)
    assert alloc_out.dtype == torch.bfloat16 and alloc_out.shape == (B, 1, HV, K) and alloc_out.is_cuda
    assert torch.equal(alloc_out, ref_out)
    # CUDA graph of a replayed call.
    pool = pool0.clone()
    out = torch.full((B, 1, HV, K), float("nan"), device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(pool, out)
    pool.copy_(pool0)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref_out) and torch.equal(pool, ref_pool)


# ----------------------------------------------------------------------------- MSA


def _paged_inputs(rng, kv_lens, page, hq, hkv, d, *, nhd=True):
    import cupy

    bs = len(kv_lens)
    counts = [-(-int(n) // page) for n in kv_lens]
    n_pages = sum(counts) + 3
    shape = (n_pages, page, hkv, d) if nhd else (n_pages, hkv, page, d)
    kc = (rng.standard_normal(shape) * 0.5).astype(BF16)
    vc = rng.standard_normal(shape).astype(BF16)
    idx = rng.permutation(n_pages)[: sum(counts)].astype(np.int32)
    qo = np.ones(bs, np.int32)
    kv = np.asarray(kv_lens, np.int32)
    cum = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int32)  # noqa: E731
    meta = dict(qo_lens=qo, kv_lens=kv, qo_offset=kv - qo, cu_seqlens_q=cum(qo), cu_seqlens_k=cum(kv),
                seqused_k=kv.copy(), kv_page_indptr=cum(counts))
    q = (rng.standard_normal((bs, hq, d)) * 0.5).astype(BF16)
    return dict(q=q, k=kc, v=vc, idx=idx, n_pages=n_pages), meta, cupy


@pytest.mark.parametrize("static", [True, False])
def test_msa_paged_decode_replay(replays, rng, static):
    import mate_cupy as m

    kv_lens, page, hq, hkv, d = [300, 17, 64, 1], 16, 8, 2, 128
    h, meta, cupy = _paged_inputs(rng, kv_lens, page, hq, hkv, d)
    bs = len(kv_lens)
    if static:
        plan = m.msa_plan(bs, 1, max(kv_lens), hq, total_seqlen_k=h["n_pages"] * page, num_kv_heads=hkv,
                          page_size=page)
    else:
        plan = m.msa_plan_from_lengths(meta["qo_lens"], meta["kv_lens"], hq, hkv, page_size=page)
    k, v = _dev(h["k"]), _dev(h["v"])

    def make():
        md = m.MsaRuntimeMetadata(**{n: cupy.asarray(x) for n, x in meta.items()}) if static else None
        return dict(q=_dev(h["q"]), idx=cupy.asarray(h["idx"]), md=md, out=_nan((bs, hq, d), BF16),
                    lse=_nan((bs, hq), np.float32))

    def fn(x):
        return m.msa(x["q"], k, v, plan, kv_indices=x["idx"], out=x["out"], lse=x["lse"], runtime_metadata=x["md"])

    _full_then_replay(replays, fn, make, lambda x, res: [x["out"], x["lse"]])


def test_msa_sparse_decode_split_kv_replay(replays, rng):
    """Block-sparse decode with few CTAs: split-KV forward + merge and the cached workspace."""
    import mate_cupy as m

    kv_lens, hq, hkv, d, topk = [4096, 3000], 16, 1, 128, 4
    h, meta, cupy = _paged_inputs(rng, kv_lens, 128, hq, hkv, d)
    bs = len(kv_lens)
    plan = m.msa_plan(bs, 1, max(kv_lens), hq, total_seqlen_k=h["n_pages"] * 128, num_kv_heads=hkv, page_size=128,
                      kv_block_num=topk, sparse_kernel_mode="decode")
    kbi = np.stack([np.sort(rng.permutation(-(-n // 128))[:topk]) for n in kv_lens]).astype(np.int32)[:, None, :]
    k, v = _dev(h["k"]), _dev(h["v"])

    def make():
        md = m.MsaRuntimeMetadata(**{n: cupy.asarray(x) for n, x in meta.items()})
        return dict(q=_dev(h["q"]), idx=cupy.asarray(h["idx"]), kbi=cupy.asarray(kbi), md=md)

    def fn(x):
        return m.sparse_decode_atten_func(x["q"], k, v, plan, kv_indices=x["idx"], kv_block_indexes=x["kbi"],
                                          runtime_metadata=x["md"], return_softmax_lse=True)

    _full_then_replay(replays, fn, make, lambda x, res: list(res))


def test_msa_dense_prefill_with_max_score_replay(replays, rng):
    import mate_cupy as m

    qo, kv, hq, hkv, d = np.array([40, 7, 100], np.int32), np.array([64, 7, 300], np.int32), 8, 2, 128
    plan = m.msa_plan_from_lengths(qo, kv, hq, hkv, output_maxscore=True)
    q = (rng.standard_normal((int(qo.sum()), hq, d)) * 0.5).astype(BF16)
    kk = (rng.standard_normal((int(kv.sum()), hkv, d)) * 0.5).astype(BF16)
    vv = rng.standard_normal((int(kv.sum()), hkv, d)).astype(BF16)
    k, v = _dev(kk), _dev(vv)

    def make():
        return dict(q=_dev(q))

    def fn(x):
        return m.msa(x["q"], k, v, plan)

    _full_then_replay(replays, fn, make, lambda x, res: [r for r in res if r is not None])


# ----------------------------------------------------------------------------- top-k


@pytest.mark.parametrize("prealloc", [True, False])
def test_topk_replay(replays, rng, prealloc):
    import cupy

    import mate_cupy as m

    scores = rng.standard_normal((6, 4, 700)).astype(np.float32)
    pos = (rng.integers(0, 700 * 128, size=6)).astype(np.int64)

    def make():
        return dict(s=cupy.asarray(scores), p=cupy.asarray(pos), o=_nan((6, 4, 16), np.int32) if prealloc else None)

    def fn(x):
        return m.sparse_topk_select(x["s"], 16, output=x["o"], force_begin_blocks=1, force_end_blocks=1,
                                    query_positions=x["p"])

    _full_then_replay(replays, fn, make, lambda x, res: [res])


def test_replay_off_switch(replays, rng):
    import cupy

    import mate_cupy as m

    s = cupy.asarray(rng.standard_normal((2, 2, 300)).astype(np.float32))
    lc.set_enabled(False)
    m.sparse_topk_select(s, 8)
    m.sparse_topk_select(s, 8)
    assert replays[0] == 0
