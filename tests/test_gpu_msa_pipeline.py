"""The MSA pipeline (index max score -> top-k -> sparse attention) on the kernels (``-m gpu``).

Each pass is checked against the float64 references: the block maxima of the index
branch (the plan's ``max_score`` buffer) within float32 accumulation error and with the
same ``-inf`` pattern, the selection exactly against the reference top-k of those maxima,
and the attention against the float64 sparse attention over that selection. Outputs are
poisoned with NaN, selections with a sentinel. Speculative decoding (2 to 8 queries per
request, each with its own list) runs through the sparse decode path, eager and captured.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_rel, side_stream, to_f64
from msa_cases import BF16, FP8, make_problem
from test_msa_gpu import dev, masked_ref, poisoned
from test_msa_pipeline import fp8_index, index_branch

import mate_cupy as mc
from mate_cupy.reference import msa as R

pytestmark = pytest.mark.gpu


def _positions(p):
    off = (p.kv - p.qo).astype(np.int64)
    return np.concatenate([np.minimum(off[b] + np.arange(p.qo[b]), p.kv[b] - 1) for b in range(len(p.qo))])


def _check_passes(p, iq, ik, plan, out, *, topk, begin, end, what):
    """Max scores (one window), selection, attention of one pipeline run against the references."""
    assert len(plan.windows) == 1
    ms = plan.max_score[: p.total_q].get()
    ref_ms = R.block_max_score(iq, ik, p.cu_q, p.cu_k, causal=True, max_k_tiles=plan.max_k_tiles)
    np.testing.assert_array_equal(np.isneginf(ms), np.isneginf(ref_ms), err_msg=f"{what}: -inf pattern")
    fin = np.isfinite(ref_ms)
    bound = 2e-5 * np.abs(to_f64(iq)).max() * np.abs(to_f64(ik)).max() * iq.shape[2]
    assert np.abs(ms[fin] - ref_ms[fin]).max() <= bound, what
    sel = plan.selection.get()
    ref_sel = R.topk_select(ms, topk, force_begin_blocks=begin, force_end_blocks=end, query_positions=_positions(p))
    np.testing.assert_array_equal(sel, ref_sel, err_msg=f"{what}: selection")
    ref = masked_ref(p, sel)
    assert_rel(out, ref[0], 1e-2, f"{what}: out")


@pytest.mark.parametrize("case,qo,kv,hq,hkv,tile", [
    ("prefill-r8", [300, 129], [1000, 129], 16, 2, None),
    ("mixed-r8", [1, 3, 2, 200], [700, 129, 1, 900], 16, 2, None),
    ("decode-r16", [1, 4, 1], [5000, 300, 129], 16, 1, None),
    ("prefill-r16-gather", [700, 3], [1500, 3], 16, 1, "gather"),
    ("prefill-r16-query-tile", [700, 3], [1500, 3], 16, 1, None),
], ids=lambda x: x if isinstance(x, str) else None)
def test_pipeline_against_references(rng, case, qo, kv, hq, hkv, tile):
    p = make_problem(rng, qo, kv, hq, hkv, 128, page_size=128)
    iq, ik, icache = index_branch(rng, p, d_index=128)
    plan = mc.sparse_pipeline_plan(p.qo, p.kv, hq, hkv, topk=4, force_begin_blocks=1, force_end_blocks=1,
                                   prefill_tile=tile, device=0, head_dim=128, dtype=BF16)
    plan.selection.fill(-7)
    out = poisoned(p.q.shape, BF16)
    res = mc.sparse_attention_pipeline(dev(p.q), dev(p.k_cache), dev(p.v_cache), dev(iq), dev(icache), plan,
                                       kv_indices=dev(p.kv_indices), out=out)
    assert res is out
    _check_passes(p, iq, ik, plan, out, topk=4, begin=1, end=1, what=case)


def test_pipeline_windows_equal_one_window(rng):
    p = make_problem(rng, [2, 600, 300], [300, 2000, 700], 16, 1, 128, page_size=128)
    iq, _, icache = index_branch(rng, p, d_index=128)
    args = (dev(p.q), dev(p.k_cache), dev(p.v_cache), dev(iq), dev(icache))
    nt = -(-2000 // 128)
    results = []
    for budget in (None, 128 * nt * 4):
        kw = {} if budget is None else {"max_score_bytes": budget}
        plan = mc.sparse_pipeline_plan(p.qo, p.kv, 16, 1, topk=8, force_end_blocks=1, device=0, **kw)
        out = poisoned(p.q.shape, BF16)
        mc.sparse_attention_pipeline(*args, plan, kv_indices=dev(p.kv_indices), out=out)
        results.append((len(plan.windows), plan.selection.get(), out.get()))
    assert results[0][0] == 1 and results[1][0] == -(-p.total_q // 128)
    np.testing.assert_array_equal(results[0][1], results[1][1])
    np.testing.assert_array_equal(results[0][2].view(np.uint16), results[1][2].view(np.uint16))


def _torch(x):
    """Host array -> torch CUDA tensor (bf16 and fp8 through their bits)."""
    import torch

    x = np.ascontiguousarray(x)
    if x.dtype == BF16:
        return torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16)
    if x.dtype == FP8:
        return torch.from_numpy(x.view(np.uint8)).cuda().view(torch.float8_e4m3fn)
    return torch.from_numpy(x).cuda()


def _agreement(sel_a, sel_b) -> float:
    """Mean over rows of the share of ``sel_a``'s valid block ids that ``sel_b`` holds too."""
    fracs = []
    for a, b in zip(sel_a.reshape(-1, sel_a.shape[-1]), sel_b.reshape(-1, sel_b.shape[-1])):
        sa = set(a[a >= 0].tolist())
        if sa:
            fracs.append(len(sa & set(b[b >= 0].tolist())) / len(sa))
    return float(np.mean(fracs))


def test_fp8_index_decode_pipeline(rng):
    """A decode pipeline (1 and 4 queries per request) with the index branch in float8 e4m3 (the
    bf16 index rounded) and index_scale: max scores = index_scale x the float64 block maxima of the
    fp8 values, selection exact on them, attention over it; the top-16 agrees with the bf16
    index's on the same inputs (bench/fp8_index_agreement.py measures how much)."""
    import torch

    qo = [1, 1, 1, 4, 1, 4, 1, 1]
    kv = [30000, 5000, 129, 9000 + 4, 1, 20000, 7000, 300]
    p = make_problem(rng, qo, kv, 16, 2, 128, page_size=128)
    iq, ik, icache = index_branch(rng, p, d_index=128)
    iq8, ik8, icache8 = fp8_index(iq, ik, icache)
    scale = 0.125
    main = (_torch(p.q), _torch(p.k_cache), _torch(p.v_cache))
    ids = _torch(p.kv_indices)
    sels = {}
    for name, (q_i, k_i) in (("fp8", (iq8, icache8)), ("bf16", (iq, icache))):
        plan = mc.sparse_pipeline_plan(p.qo, p.kv, 16, 2, topk=16, force_begin_blocks=1, force_end_blocks=1,
                                       device=0, head_dim=128, dtype=BF16)
        assert len(plan.windows) == 1 and plan.attention[3].mode == "sparse_decode"
        plan.selection.fill(-7)
        plan.max_score.fill(np.nan)
        out = torch.full(p.q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        res = mc.sparse_attention_pipeline(*main, _torch(q_i), _torch(k_i), plan, kv_indices=ids, out=out,
                                           index_scale=scale)
        assert res is out
        torch.cuda.synchronize()
        ms = plan.max_score[: p.total_q].get()
        if name == "fp8":
            ref_ms = R.block_max_score(iq8, ik8, p.cu_q, p.cu_k, causal=True, max_k_tiles=plan.max_k_tiles,
                                       k_scale=scale)
            bound = 2e-5 * scale * np.abs(to_f64(iq8)).max() * np.abs(to_f64(ik8)).max() * 128
        else:  # 16-bit index inputs ignore index_scale
            ref_ms = R.block_max_score(iq, ik, p.cu_q, p.cu_k, causal=True, max_k_tiles=plan.max_k_tiles)
            bound = 2e-5 * np.abs(to_f64(iq)).max() * np.abs(to_f64(ik)).max() * 128
        np.testing.assert_array_equal(np.isneginf(ms), np.isneginf(ref_ms), err_msg=f"{name}: -inf pattern")
        fin = np.isfinite(ref_ms)
        assert np.abs(ms[fin] - ref_ms[fin]).max() <= bound, name
        sel = plan.selection.get()
        ref_sel = R.topk_select(ms, 16, force_begin_blocks=1, force_end_blocks=1, query_positions=_positions(p))
        np.testing.assert_array_equal(sel, ref_sel, err_msg=f"{name}: selection")
        assert_rel(out, masked_ref(p, sel)[0], 1e-2, f"{name} index: out")
        sels[name] = sel
    agree = _agreement(sels["bf16"], sels["fp8"])
    print(f"fp8 index top-16 agreement with the bf16 index (random data): {agree:.4f}")
    assert agree >= 0.75, agree


@pytest.mark.parametrize("spec", [2, 4, 8])
def test_speculative_decode_per_token_lists(rng, spec):
    """``spec`` draft tokens per request, each with its own causal top-k list, through the sparse
    decode path: eager plan, then a static plan captured in a CUDA graph."""
    qo = [spec, spec, spec, spec]
    kv = [5000 + spec, 300, 129 + spec, 1000]
    p = make_problem(rng, qo, kv, 16, 1, 128, page_size=128)
    iq, ik, icache = index_branch(rng, p, d_index=128)
    plan = mc.sparse_pipeline_plan(p.qo, p.kv, 16, 1, topk=8, force_begin_blocks=1, force_end_blocks=2, device=0,
                                   head_dim=128, dtype=BF16)
    assert plan.attention[3].mode == "sparse_decode"
    out = poisoned(p.q.shape, BF16)
    mc.sparse_attention_pipeline(dev(p.q), dev(p.k_cache), dev(p.v_cache), dev(iq), dev(icache), plan,
                                 kv_indices=dev(p.kv_indices), out=out)
    _check_passes(p, iq, ik, plan, out, topk=8, begin=1, end=2, what=f"speculative {spec}")
    # the draft tokens of one request select different blocks (per-token lists)
    sel = plan.selection.get()
    assert any(not np.array_equal(sel[0], sel[i]) for i in range(1, spec))

    # the same lists through a static plan, captured
    static = mc.msa_plan(4, spec, 8192, 16, num_kv_heads=1, page_size=128, kv_block_num=8, force_begin_blocks=1,
                         force_end_blocks=2, total_seqlen_k=4 * 8192)
    assert static[3].mode == "sparse_decode"
    table = np.zeros((4, 64), np.int32)
    table[:, : p.page_table.shape[1]] = np.where(p.page_table >= 0, p.page_table, 0)
    t = lambda x: dev(np.asarray(x, np.int32))  # noqa: E731
    md = mc.MsaRuntimeMetadata(qo_lens=t(p.qo), kv_lens=t(p.kv), qo_offset=t(p.kv - p.qo), cu_seqlens_q=t(p.cu_q),
                               cu_seqlens_k=t(p.cu_k), seqused_k=t(p.kv), page_table=t(table))
    mc.upload_plan(static, 0, head_dim=128, dtype=BF16)
    q, kc, vc, selc = dev(p.q), dev(p.k_cache), dev(p.v_cache), dev(sel)
    out2 = poisoned(p.q.shape, BF16)
    stream = side_stream()
    with stream:
        stream.begin_capture()
        mc.sparse_decode_atten_func(q, kc, vc, static, kv_block_indexes=selc, runtime_metadata=md, out=out2)
        graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()
    assert_rel(out2, masked_ref(p, sel)[0], 1e-2, f"speculative {spec}, captured static plan")


def test_static_pipeline_one_graph_serves_steps_of_changing_lengths(rng):
    """A static pipeline plan, its first call captured in a CUDA graph, replayed for a second
    step whose lengths, pages and inputs were written into the same device buffers."""
    import cupy

    spec, batch, max_k = 4, 4, 8192
    plan = mc.sparse_pipeline_static_plan(batch, spec, max_k, 16, 1, total_seqlen_k=batch * max_k, topk=8,
                                          force_begin_blocks=1, force_end_blocks=2, device=0, head_dim=128,
                                          dtype=BF16)
    assert plan.is_static and plan.attention[3].mode == "sparse_decode"
    steps = [make_problem(rng, [spec] * batch, kv, 16, 1, 128, page_size=128, extra_pages=0)
             for kv in ([5000, 300, 129, 1000], [4000, 7000, 2, 640])]
    steps = [(p,) + index_branch(rng, p, d_index=128) for p in steps]
    n_pages = max(p.k_cache.shape[0] for p, *_ in steps)

    def pool(x):  # a device cache of n_pages pages holding x in its first pages
        a = cupy.zeros((n_pages,) + x.shape[1:], dtype=x.dtype)
        a[: x.shape[0]] = dev(x)
        return a

    p, iq, _, icache = steps[0]
    bufs = dict(q=dev(p.q), iq=dev(iq), k=pool(p.k_cache), v=pool(p.v_cache), ik=pool(icache))
    t = lambda x: dev(np.asarray(x, np.int32))  # noqa: E731

    def metadata(p):
        table = np.zeros((batch, max_k // 128), np.int32)
        table[:, : p.page_table.shape[1]] = np.where(p.page_table >= 0, p.page_table, 0)
        return dict(qo_lens=t(p.qo), kv_lens=t(p.kv), qo_offset=t(p.kv - p.qo), cu_seqlens_q=t(p.cu_q),
                    cu_seqlens_k=t(p.cu_k), seqused_k=t(p.kv), page_table=t(table))

    md_arrays = metadata(p)
    md = mc.MsaRuntimeMetadata(**md_arrays)
    out = poisoned(p.q.shape, BF16)
    stream = side_stream()
    with stream:
        stream.begin_capture()
        mc.sparse_attention_pipeline(bufs["q"], bufs["k"], bufs["v"], bufs["iq"], bufs["ik"], plan,
                                     runtime_metadata=md, out=out)
        graph = stream.end_capture()
    for step, (p, iq, ik, icache) in enumerate(steps):
        if step:
            for name, arr in metadata(p).items():
                md_arrays[name][...] = arr
            bufs["q"][...] = dev(p.q)
            bufs["iq"][...] = dev(iq)
            bufs["k"][: p.k_cache.shape[0]] = dev(p.k_cache)
            bufs["v"][: p.v_cache.shape[0]] = dev(p.v_cache)
            bufs["ik"][: icache.shape[0]] = dev(icache)
        out.fill(np.nan)
        plan.selection.fill(-7)
        cupy.cuda.Device().synchronize()  # the copies ran on the null stream; the graph on a non-blocking one
        with stream:
            graph.launch(stream)
        stream.synchronize()
        _check_passes(p, iq, ik, plan, out, topk=8, begin=1, end=2, what=f"static pipeline, step {step}")


@pytest.mark.parametrize("causal", [True, False])
def test_query_positions_kernel_matches_the_plan_positions(rng, causal):
    """Positions from device lengths equal plan_query_positions; rows of no request get -1."""
    import cupy

    from mate_cupy.util_ops import launch_query_positions

    qo = rng.integers(0, 40, size=37).astype(np.int32)
    kv = (qo + rng.integers(0, 3000, size=37)).astype(np.int32)
    kv[3] = 0
    info = mc.msa_plan_from_lengths(qo, kv, 8, 1, causal=causal, device="cpu")
    ref = mc.plan_query_positions(info)
    total = int(qo.sum()) + 50  # 50 rows owned by no request
    cu = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    pos = cupy.full(total, 12345, dtype=cupy.int64)
    vec = [dev(x) for x in (cu, qo, kv, (kv - qo).astype(np.int32))]
    launch_query_positions(*(int(x.data.ptr) for x in vec), len(qo), total, causal, int(pos.data.ptr),
                           cupy.cuda.get_current_stream().ptr)
    got = pos.get()
    np.testing.assert_array_equal(got[: len(ref)], ref)
    assert (got[len(ref):] == -1).all()
