"""``sparse_pipeline_plan`` / ``sparse_attention_pipeline``: the MSA pipeline in one call.

Host arrays run every pass on the float64 references; the result must equal an
independent composition (block max score of the index branch, rounded to float32 as the
op stores it -> exact top-k with the plan's query positions -> block-sparse attention).
The GPU file runs the same checks on the kernels.
"""
from __future__ import annotations

import numpy as np
import pytest
from msa_cases import BF16, FP8, make_problem

import mate_cupy as mc
from mate_cupy.reference import msa as R


def index_branch(rng, p, d_index=64):
    """Index q ``[total_q, Hkv, Di]`` and an index K cache ``[P, 128, 1, Di]`` on p's page ids."""
    iq = rng.standard_normal((p.total_q, p.hkv, d_index)).astype(BF16)
    ik = rng.standard_normal((int(p.cu_k[-1]), 1, d_index)).astype(BF16)
    cache = rng.standard_normal((p.k_cache.shape[0], 128, 1, d_index)).astype(BF16)
    for b in range(len(p.kv)):
        for s in range(-(-int(p.kv[b]) // 128)):
            lo = p.cu_k[b] + 128 * s
            hi = min(p.cu_k[b + 1], lo + 128)
            cache[p.page_table[b, s], : hi - lo] = ik[lo:hi]
    return iq, ik, cache


def expected(p, iq, ik, *, topk, begin, end, index_scale=1.0):
    """The pipeline composed from the references, positions computed here."""
    off = (p.kv - p.qo).astype(np.int64)
    pos = np.concatenate([np.minimum(off[b] + np.arange(p.qo[b]), p.kv[b] - 1) for b in range(len(p.qo))])
    nt = -(-int(p.kv.max()) // 128)
    ms = R.block_max_score(iq, ik, p.cu_q, p.cu_k, causal=True, max_k_tiles=nt, k_scale=index_scale)
    ms = ms.astype(np.float32)
    sel = R.topk_select(ms, topk, force_begin_blocks=begin, force_end_blocks=end, query_positions=pos)
    out, lse = R.sparse_attention(p.q, p.k_cache, p.v_cache, p.cu_q, p.kv, p.page_table, sel)
    return sel, out, lse


CASES = {
    "prefill": ([300, 129], [1000, 129]),
    "mixed": ([1, 3, 2, 200], [700, 129, 1, 900]),
    "decode": ([1, 4, 1], [2000, 300, 129]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_equals_composed_references(rng, case):
    qo, kv = CASES[case]
    p = make_problem(rng, qo, kv, 16, 2, 128, page_size=128)
    iq, ik, icache = index_branch(rng, p)
    plan = mc.sparse_pipeline_plan(p.qo, p.kv, 16, 2, topk=4, force_begin_blocks=1, force_end_blocks=1,
                                   device="cpu")
    assert plan.attention[0] == (case == "mixed")
    out = np.full(p.q.shape, np.nan, dtype=BF16)
    lse = np.full((p.total_q, 16), np.nan, dtype=np.float32)
    res = mc.sparse_attention_pipeline(p.q, p.k_cache, p.v_cache, iq, icache, plan, kv_indices=p.kv_indices,
                                       out=out, lse=lse)
    assert res is out
    sel, ref_out, ref_lse = expected(p, iq, ik, topk=4, begin=1, end=1)
    np.testing.assert_array_equal(plan.selection, sel)
    np.testing.assert_allclose(out.astype(np.float64), ref_out.astype(BF16).astype(np.float64), rtol=0, atol=0)
    np.testing.assert_allclose(lse, ref_lse.astype(np.float32), rtol=1e-6)


def test_windows_bound_the_scores_and_change_nothing(rng):
    p = make_problem(rng, [1, 450, 300], [300, 1000, 700], 8, 1, 128, page_size=128)
    iq, ik, icache = index_branch(rng, p)
    whole = mc.sparse_pipeline_plan(p.qo, p.kv, 8, 1, topk=4, force_end_blocks=1, device="cpu")
    nt = -(-1000 // 128)
    small = mc.sparse_pipeline_plan(p.qo, p.kv, 8, 1, topk=4, force_end_blocks=1, device="cpu",
                                    max_score_bytes=100 * nt * 4)
    assert len(whole.windows) == 1 and whole.window_rows == p.total_q
    assert small.window_rows == 100 and len(small.windows) == -(-p.total_q // 100)
    assert small.max_score.shape == (100, 1, nt)
    assert small.buffer_bytes < whole.buffer_bytes
    outs = []
    for plan in (whole, small):
        outs.append(mc.sparse_attention_pipeline(p.q, p.k_cache, p.v_cache, iq, icache, plan,
                                                 kv_indices=p.kv_indices))
    np.testing.assert_array_equal(small.selection, whole.selection)
    np.testing.assert_array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))
    sel, ref_out, _ = expected(p, iq, ik, topk=4, begin=0, end=1)
    np.testing.assert_array_equal(small.selection, sel)


def test_window_plans_clip_requests_and_move_offsets():
    plan = mc.sparse_pipeline_plan([3, 5, 0, 4], [10, 200, 7, 300], 8, 1, topk=4, device="cpu",
                                   max_score_bytes=5 * 3 * 4)  # 5 rows of 3 tiles
    assert plan.window_rows == 5
    got = [(w.row_begin, w.row_end, w.plan[3].qo_lens.tolist(), w.plan[3].qo_offset.tolist()) for w in plan.windows]
    # request offsets kv - qo: 7, 195, 7, 296
    assert got == [(0, 5, [3, 2, 0, 0], [7, 195, 7, 296]),
                   (5, 10, [0, 3, 0, 2], [10, 197, 7, 296]),
                   (10, 12, [0, 0, 0, 2], [10, 200, 7, 298])]


def test_refusals(rng):
    p = make_problem(rng, [200], [400], 8, 1, 128, page_size=128)
    iq, _, icache = index_branch(rng, p)
    plan = mc.sparse_pipeline_plan(p.qo, p.kv, 8, 1, topk=4, device="cpu")
    with pytest.raises(TypeError, match="SparsePipelinePlan"):
        mc.sparse_attention_pipeline(p.q, p.k_cache, p.v_cache, iq, icache, plan.attention,
                                     kv_indices=p.kv_indices)
    with pytest.raises(ValueError, match="index_q must have q's 200 rows"):
        mc.sparse_attention_pipeline(p.q, p.k_cache, p.v_cache, iq[:10], icache, plan, kv_indices=p.kv_indices)
    with pytest.raises(ValueError, match="plan's 200 rows"):
        mc.sparse_attention_pipeline(p.q[:10], p.k_cache, p.v_cache, iq[:10], icache, plan,
                                     kv_indices=p.kv_indices)
    with pytest.raises(ValueError, match="max_score_bytes"):
        mc.sparse_pipeline_plan(p.qo, p.kv, 8, 1, topk=4, device="cpu", max_score_bytes=0)
    with pytest.raises(ValueError):
        mc.sparse_pipeline_plan(p.qo, p.kv, 8, 1, topk=5, device="cpu")
    plan.max_score[...] = np.nan  # the attention pass's refusal comes before the index pass writes it
    with pytest.raises(TypeError, match="q, k, and v must share the same dtype"):
        mc.sparse_attention_pipeline(p.q, p.k_cache.astype(np.float16), p.v_cache, iq, icache, plan,
                                     kv_indices=p.kv_indices)
    assert np.isnan(plan.max_score).all()
    with pytest.raises(TypeError, match="the index branch .*index_q and index_k"):
        mc.sparse_attention_pipeline(p.q, p.k_cache, p.v_cache, iq.astype(np.float16), icache, plan,
                                     kv_indices=p.kv_indices)
    with pytest.raises(ValueError, match="the index branch .*head count"):
        mc.sparse_attention_pipeline(p.q, p.k_cache, p.v_cache, np.concatenate([iq, iq], 1), icache, plan,
                                     kv_indices=p.kv_indices)
    with pytest.raises(ValueError, match=r"num_index_kv_heads must be in \[1, "):
        mc.sparse_pipeline_plan(p.qo, p.kv, 8, 1, num_index_kv_heads=0, topk=4, device="cpu")
    with pytest.raises(ValueError, match="topk must be a whole number, got 4.5"):
        mc.sparse_pipeline_plan(p.qo, p.kv, 8, 1, topk=4.5, device="cpu")
    with pytest.raises(TypeError, match="dtype"):
        mc.sparse_pipeline_plan(p.qo, p.kv, 8, 1, topk=4, device="cpu", dtype="bogus")
    with pytest.raises(TypeError, match="stream"):
        mc.sparse_pipeline_plan(p.qo, p.kv, 8, 1, topk=4, device="cpu", stream="x")


def test_static_plan_needs_a_gpu_and_metadata():
    with pytest.raises(ValueError, match="CUDA device"):
        mc.sparse_pipeline_static_plan(2, 4, 1024, 16, 1, device="cpu")


def fp8_index(iq, ik, icache):
    """The bf16 index branch rounded to float8 e4m3 (the values the fp8 index scores)."""
    return tuple(x.astype(np.float32).astype(FP8) for x in (iq, ik, icache))


@pytest.mark.parametrize("qo, kv", [([1, 4, 2, 1], [2000, 300, 129, 700]),   # decode
                                     ([40, 3, 1], [700, 300, 129])])          # prefill (wgmma on sm_90a)
def test_fp8_index_pipeline_equals_composed_references(rng, qo, kv):
    """fp8 index_q/index_k with index_scale: the plan's max scores are index_scale times the block
    maxima of the fp8 values; selection and attention as the composed references."""
    p = make_problem(rng, qo, kv, 16, 2, 128, page_size=128)
    iq8, ik8, icache8 = fp8_index(*index_branch(rng, p))
    plan = mc.sparse_pipeline_plan(p.qo, p.kv, 16, 2, num_index_kv_heads=1, topk=4, force_end_blocks=1,
                                   device="cpu")
    out = mc.sparse_attention_pipeline(p.q, p.k_cache, p.v_cache, iq8, icache8, plan, kv_indices=p.kv_indices,
                                       index_scale=0.125)
    sel, ref_out, _ = expected(p, iq8, ik8, topk=4, begin=0, end=1, index_scale=0.125)
    want_ms = R.block_max_score(iq8, ik8, p.cu_q, p.cu_k, causal=True, max_k_tiles=plan.max_k_tiles, k_scale=0.125)
    np.testing.assert_array_equal(plan.max_score[: p.total_q], want_ms.astype(np.float32))
    np.testing.assert_array_equal(plan.selection, sel)
    np.testing.assert_array_equal(out.view(np.uint16), ref_out.astype(BF16).view(np.uint16))
    # the scale changes the stored maxima, not the selection
    unscaled = mc.sparse_pipeline_plan(p.qo, p.kv, 16, 2, topk=4, force_end_blocks=1, device="cpu")
    mc.sparse_attention_pipeline(p.q, p.k_cache, p.v_cache, iq8, icache8, unscaled, kv_indices=p.kv_indices)
    np.testing.assert_array_equal(unscaled.selection, plan.selection)


@pytest.mark.parametrize("qo, kv, budget", [([1, 40], [300, 700], None),       # a prefill request
                                            ([1] * 9 + [20], [300] * 10, 10 * 2 * 3 * 4)])  # 10-row windows
def test_fp8_index_prefill_pipeline_is_refused_before_any_pass(rng, monkeypatch, qo, kv, budget):
    """More than 16 packed index rows per request (D 256) in any window on a device without the
    wgmma kernel (here compute capability 8.9): NotImplementedError before the first window runs
    (the plan's buffers and out untouched)."""
    from mate_cupy.msa import execute, pipeline

    check = pipeline.check_fp8_max_score
    monkeypatch.setattr(execute, "device_info", lambda device=None: (132, 89))
    monkeypatch.setattr(pipeline, "check_fp8_max_score", lambda fn, plan, hq, d, device: check(fn, plan, hq, d, 0))
    p = make_problem(rng, qo, kv, 16, 2, 128, page_size=128)
    iq8, _, icache8 = fp8_index(*index_branch(rng, p, d_index=256))  # D 256: 16 packed rows at most
    kw = {} if budget is None else {"max_score_bytes": budget}
    plan = mc.sparse_pipeline_plan(p.qo, p.kv, 16, 2, topk=4, device="cpu", **kw)
    if budget is not None:  # the first window (one query per request) alone would run
        assert plan.window_rows == 10 and len(plan.windows) == 3
    plan.selection.fill(-7)
    out = np.full(p.q.shape, np.nan, BF16)
    with pytest.raises(NotImplementedError, match="wgmma kernel, compute capability 9.0 only"):
        mc.sparse_attention_pipeline(p.q, p.k_cache, p.v_cache, iq8, icache8, plan, kv_indices=p.kv_indices,
                                     out=out)
    assert (plan.selection == -7).all() and np.isnan(out.astype(np.float32)).all()
