"""The public MSA ops on host arrays, end to end, against the float64 references.

Paged and sparse results are checked against the *dense* reference of the same keys
(scattered into shuffled pages), so the paged/sparse host paths are verified by a
different code path than the one they run.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import assert_rel
from msa_cases import BF16, FP8, make_problem, offsets_of, random_selection

import mate_cupy as mc
from mate_cupy.reference import msa as R
from mate_cupy.msa import execute

TOL = {np.dtype(np.float16): 2e-3, BF16: 8e-3, np.dtype(np.float32): 1e-6}


def dense_ref(p, qo_offset=None, causal=True, sm_scale=None, kv_lens=None):
    return R.dense_attention(p.q, p.k, p.v, p.cu_q, p.cu_k, qo_offset=offsets_of(p, qo_offset), causal=causal,
                             sm_scale=sm_scale, kv_lens=kv_lens)


def check(out, lse, ref, dtype, what=""):
    tol = TOL.get(np.dtype(dtype), 8e-3)
    assert np.asarray(out).dtype == (BF16 if np.dtype(dtype) == FP8 else np.dtype(dtype))
    assert_rel(out, ref[0], tol, f"{what} out")
    if lse is not None:
        assert lse.dtype == np.float32
        assert_rel(lse, ref[1], 1e-6, f"{what} lse")


# ----------------------------------------------------------------------------- dense


@pytest.mark.parametrize("dtype", [BF16, np.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 1), (16, 1)], ids=["gqa1", "gqa8", "gqa16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_dense(rng, dtype, hq, hkv, causal):
    p = make_problem(rng, [3, 0, 70, 1], [200, 9, 70, 0], hq, hkv, 64, dtype=dtype)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, hq, hkv, causal=causal)
    lse = np.full((p.total_q, hq), np.nan, np.float32)
    out, ms = mc.msa(p.q, p.k, p.v, info, lse=lse)
    assert ms is None
    check(out, lse, dense_ref(p, causal=causal), dtype)
    assert np.all(lse[3:3] == lse[3:3]) and np.all(lse[-1] == -np.inf)  # the empty request's row


def test_dense_offsets_scale_and_preallocated_out(rng):
    p = make_problem(rng, [5, 9, 2], [8, 20, 30], 8, 2, 64)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 2, qo_offset=np.array([0, -3, 40]))
    out = np.full(p.q.shape, np.nan, BF16)
    res, _ = mc.msa(p.q, p.k, p.v, info, out=out, sm_scale=0.2)
    assert res is out
    check(out, None, dense_ref(p, [0, -3, 40], sm_scale=0.2), BF16)
    # per-call override: int and array
    res, _ = mc.msa(p.q, p.k, p.v, info, q_offset_override=4)
    check(res, None, dense_ref(p, 4), BF16)
    res, _ = mc.msa(p.q, p.k, p.v, info, q_offset_override=np.array([1, 2, 3]))
    check(res, None, dense_ref(p, [1, 2, 3]), BF16)


def test_plan_object_accepted_directly(rng):
    p = make_problem(rng, [4], [9], 2, 1, 64)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 2, 1)
    out, _ = mc.msa(p.q, p.k, p.v, info[3])
    check(out, None, dense_ref(p), BF16)


# ----------------------------------------------------------------------------- paged


@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("source", ["kv_indices", "page_table"])
def test_paged(rng, page_size, layout, source):
    p = make_problem(rng, [1, 4, 0, 30], [300, 4, 17, 30], 8, 1, 64, page_size=page_size, layout=layout)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1, page_size=page_size)
    assert info[3].mode == "paged"
    kw = {"kv_indices": p.kv_indices} if source == "kv_indices" else {"page_table": p.page_table}
    lse = np.empty((p.total_q, 8), np.float32)
    out, _ = mc.msa(p.q, p.k_cache, p.v_cache, info, lse=lse, **kw)
    check(out, lse, dense_ref(p), BF16, f"paged {page_size} {layout}")


def test_paged_ambiguous_layout_is_hnd(rng):
    """page_size == Hkv: the shape fits both layouts; it is read as HND, as the reproduced API reads it."""
    p = make_problem(rng, [2], [40], 16, 16, 64, page_size=16, layout="HND")
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 16, 16, page_size=16)
    out, _ = mc.msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices)
    check(out, None, dense_ref(p), BF16)


# ----------------------------------------------------------------------------- max score


def test_max_score_dense_and_output_o_false(rng):
    p = make_problem(rng, [3, 40, 1], [300, 40, 129], 8, 1, 64)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1, output_maxscore=True)
    out, ms = mc.msa(p.q, p.k, p.v, info)
    ref_ms = R.block_max_score(p.q, p.k, p.cu_q, p.cu_k)
    assert ms.shape == (p.total_q, 8, 3) and ms.dtype == np.float32
    assert_rel(ms, ref_ms, 1e-6, "max_score")
    check(out, None, dense_ref(p), BF16)
    out, ms2 = mc.msa(p.q, p.k, p.v, info, output_o=False)
    assert out is None
    np.testing.assert_array_equal(ms2, ms)
    buf = np.full((p.total_q, 8, 3), np.nan, np.float32)
    out, res = mc.msa(p.q, p.k, p.v, mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1), max_score=buf)
    assert res is buf and out is not None
    np.testing.assert_array_equal(buf, ms)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("source", ["kv_indices", "page_table"])
def test_max_score_paged(rng, layout, source):
    p = make_problem(rng, [3, 20], [300, 129], 16, 2, 64, page_size=128, layout=layout)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 16, 2, page_size=128)
    kw = {"kv_indices": p.kv_indices} if source == "kv_indices" else {"page_table": p.page_table}
    _, ms = mc.msa(p.q, p.k_cache, p.v_cache, info, output_maxscore=True, output_o=False, **kw)
    assert_rel(ms, R.block_max_score(p.q, p.k, p.cu_q, p.cu_k), 1e-6, "paged max_score")


# ----------------------------------------------------------------------------- mixed plans


def test_mixed_dense(rng):
    qo, kv = [1, 3, 200, 2], [50, 300, 260, 9]
    p = make_problem(rng, qo, kv, 8, 2, 64)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 2, output_maxscore=True)
    assert info[0] and info[1] == 2
    lse = np.empty((p.total_q, 8), np.float32)
    out = np.empty(p.q.shape, BF16)
    res, ms = mc.msa(p.q, p.k, p.v, info, out=out, lse=lse)
    assert res is out
    check(out, lse, dense_ref(p), BF16, "mixed")
    assert ms.shape == (p.total_q, 8, 3)
    assert_rel(ms, R.block_max_score(p.q, p.k, p.cu_q, p.cu_k, max_k_tiles=3), 1e-6, "mixed max_score")
    offs = np.array([7, 0, -5, 100])
    res, _ = mc.msa(p.q, p.k, p.v, info, q_offset_override=offs, output_maxscore=False)
    check(res, None, dense_ref(p, offs), BF16, "mixed override")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_mixed_paged_shared_pool(rng, layout):
    qo, kv = [2, 1, 150], [90, 33, 200]
    p = make_problem(rng, qo, kv, 4, 4, 64, page_size=16, layout=layout)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 4, 4, page_size=16)
    assert info[0] and info[1] == 2
    out, _ = mc.msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices)
    check(out, None, dense_ref(p), BF16, "mixed paged")
    out, _ = mc.msa(p.q, p.k_cache, p.v_cache, info, page_table=p.page_table)
    check(out, None, dense_ref(p), BF16, "mixed paged table")


# ----------------------------------------------------------------------------- sparse


def sparse_ref(p, sel, qo_offset=None, k_scale=1.0, v_scale=1.0, sm_scale=None):
    return R.sparse_attention(p.q, p.k_cache, p.v_cache, p.cu_q, p.kv, p.page_table, sel,
                              qo_offset=offsets_of(p, qo_offset), k_scale=k_scale, v_scale=v_scale,
                              sm_scale=sm_scale, kv_layout=p.layout)


def masked_dense_ref(p, sel):
    """Dense attention where each row only sees its listed blocks (independent of the paged path)."""
    hq, hkv = p.hq, p.hkv
    r = hq // hkv
    out = np.zeros(p.q.shape)
    lse = np.full((p.total_q, hq), -np.inf)
    q, k, v = (np.asarray(x).astype(np.float64) for x in (p.q, p.k, p.v))
    for b in range(len(p.qo)):
        keys = np.arange(p.kv[b])
        for i in range(p.qo[b]):
            row, pos = p.cu_q[b] + i, p.kv[b] - p.qo[b] + i
            for h in range(hq):
                blocks = sel[row, h // r] if sel.shape[1] == hkv else sel[row, (h // r) * r]
                ok = np.isin(keys // 128, blocks[blocks >= 0]) & (keys <= pos)
                if not ok.any():
                    continue
                s = (k[p.cu_k[b] + keys[ok], h // r] @ q[row, h]) / np.sqrt(q.shape[-1])
                m = s.max()
                w = np.exp(s - m)
                out[row, h] = w @ v[p.cu_k[b] + keys[ok], h // r] / w.sum()
                lse[row, h] = m + np.log(w.sum())
    return out, lse


@pytest.mark.parametrize("hq", [8, 16], ids=["gqa8", "gqa16"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_sparse_msa_prefill(rng, hq, layout):
    p = make_problem(rng, [40, 0, 70], [300, 10, 500], hq, 1, 128, page_size=128, layout=layout)
    info = mc.sparse_msa_plan(p.qo, p.kv, hq, 1, page_size=128, kv_block_num=4, force_begin_blocks=1)
    sel = random_selection(rng, p, 4)
    lse = np.empty((p.total_q, hq), np.float32)
    out, ms = mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices, kv_block_indexes=sel,
                            lse=lse)
    assert ms is None
    ref = masked_dense_ref(p, sel)
    check(out, lse, ref, BF16, "sparse prefill")
    assert_rel(R.sparse_attention(p.q, p.k_cache, p.v_cache, p.cu_q, p.kv, p.page_table, sel,
                                  kv_layout=layout)[0], ref[0], 1e-12)


def test_sparse_pipeline_max_score_topk_attention(rng):
    """Proxy max score -> sparse_topk_select -> sparse_msa, as a serving stack runs it."""
    p = make_problem(rng, [64, 100], [700, 1000], 8, 1, 128, page_size=128)
    dense_info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1, page_size=128, output_maxscore=True)
    _, ms = mc.msa(p.q, p.k_cache, p.v_cache, dense_info, kv_indices=p.kv_indices, output_o=False)
    qpos = np.concatenate([np.arange(n) + (kv - n) for n, kv in zip(p.qo, p.kv)]).astype(np.int64)
    sel_q = mc.sparse_topk_select(ms, 4, force_begin_blocks=1, force_end_blocks=1, query_positions=qpos)
    sel = np.ascontiguousarray(sel_q[:, ::8, :])
    info = mc.sparse_msa_plan(p.qo, p.kv, 8, 1, page_size=128, kv_block_num=4, force_begin_blocks=1,
                              force_end_blocks=1)
    out, _ = mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices, kv_block_indexes=sel_q,
                           check_input_valid=True)
    check(out, None, masked_dense_ref(p, sel), BF16, "pipeline")


def test_sparse_fp8_scales_and_bf16_output(rng):
    p = make_problem(rng, [40], [400], 8, 1, 128, dtype=FP8, page_size=128)
    info = mc.sparse_msa_plan(p.qo, p.kv, 8, 1, page_size=128, kv_block_num=4, use_fp8_kvcache=True)
    sel = random_selection(rng, p, 4)
    out, _ = mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices, kv_block_indexes=sel,
                           k_scale=0.25, v_scale=2.0)
    assert out.dtype == BF16
    ref = sparse_ref(p, sel, k_scale=0.25, v_scale=2.0)
    assert_rel(out, ref[0], 8e-3, "fp8 sparse")
    # the scales enter exactly as k_scale * sm_scale on the logits and v_scale on the output
    unscaled = sparse_ref(p, sel, sm_scale=0.25 / np.sqrt(128))
    assert_rel(out, unscaled[0] * 2.0, 8e-3)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="v_scale must be finite"):
            mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices, kv_block_indexes=sel,
                          k_scale=0.25, v_scale=bad)


def test_sparse_bf16_ignores_scales(rng):
    p = make_problem(rng, [40], [300], 8, 1, 128, page_size=128)
    info = mc.sparse_msa_plan(p.qo, p.kv, 8, 1, page_size=128, kv_block_num=4)
    sel = random_selection(rng, p, 4)
    a, _ = mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices, kv_block_indexes=sel)
    b, _ = mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices, kv_block_indexes=sel,
                         k_scale=3.0, v_scale=5.0)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("per_q_head", [False, True], ids=["per-kv-head", "per-q-head"])
def test_sparse_decode(rng, per_q_head):
    p = make_problem(rng, [1, 4, 1], [129, 700, 1], 16, 2, 128, page_size=128)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 16, 2, page_size=128, kv_block_num=8)
    assert info[3].mode == "sparse_decode" and not info[0]
    sel = random_selection(rng, p, 8)
    arg = np.repeat(sel, 8, axis=1) if per_q_head else sel
    out, lse = mc.sparse_decode_atten_func(p.q, p.k_cache, p.v_cache, info, page_table=p.page_table,
                                           kv_block_indexes=arg, return_softmax_lse=True)
    check(out, lse, masked_dense_ref(p, sel), BF16, "sparse decode")
    only = mc.sparse_decode_atten_func(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices,
                                       kv_block_indexes=arg)
    np.testing.assert_array_equal(only, out)


def test_sparse_max_score_and_output_o_false(rng):
    p = make_problem(rng, [40, 50], [300, 400], 8, 1, 128, page_size=128)
    info = mc.sparse_msa_plan(p.qo, p.kv, 8, 1, page_size=128, kv_block_num=4)
    sel = random_selection(rng, p, 4)
    out, ms = mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices, kv_block_indexes=sel,
                            output_maxscore=True)
    assert_rel(ms, R.block_max_score(p.q, p.k, p.cu_q, p.cu_k), 1e-6, "sparse-plan max score")
    check(out, None, masked_dense_ref(p, sel), BF16)
    none, ms2 = mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices, output_o=False,
                              output_maxscore=True)
    assert none is None
    np.testing.assert_array_equal(ms2, ms)
    dinfo = mc.msa_plan_from_lengths([1, 1], [300, 400], 8, 1, page_size=128, kv_block_num=4)
    pd = make_problem(rng, [1, 1], [300, 400], 8, 1, 128, page_size=128)
    res = mc.sparse_decode_atten_func(pd.q, pd.k_cache, pd.v_cache, dinfo, kv_indices=pd.kv_indices,
                                      kv_block_indexes=random_selection(rng, pd, 4), output_maxscore=True,
                                      return_softmax_lse=True)
    assert len(res) == 3
    assert_rel(res[2], R.block_max_score(pd.q, pd.k, pd.cu_q, pd.cu_k), 1e-6)


def test_sparse_with_mixed_plan(rng):
    qo, kv = [1, 2, 40, 3], [300, 129, 500, 200]
    p = make_problem(rng, qo, kv, 8, 1, 128, page_size=128)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1, page_size=128, kv_block_num=4, force_end_blocks=1)
    assert info[0] and info[1] == 2 and info[3].mode == "sparse_decode" and info[4].mode == "sparse_prefill"
    sel = random_selection(rng, p, 4)
    lse = np.empty((p.total_q, 8), np.float32)
    out, _ = mc.msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices, kv_block_indexes=sel, lse=lse)
    check(out, lse, masked_dense_ref(p, sel), BF16, "mixed sparse")


# ----------------------------------------------------------------------------- checked and unchecked indices


def test_checked_mode_refuses_bad_blocks_and_pages(rng):
    p = make_problem(rng, [40], [300], 8, 1, 128, page_size=128)
    info = mc.sparse_msa_plan(p.qo, p.kv, 8, 1, page_size=128, kv_block_num=4)
    sel = random_selection(rng, p, 4)
    common = dict(kv_indices=p.kv_indices)
    bad = sel.copy()
    bad[0, 0, 3] = 3  # block 3 does not exist for 300 keys
    with pytest.raises(ValueError, match="block id"):
        mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_block_indexes=bad, check_input_valid=True, **common)
    out_bad, _ = mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_block_indexes=bad, **common)
    clean = bad.copy()
    clean[0, 0, 3] = -1
    out_clean, _ = mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_block_indexes=clean, **common)
    np.testing.assert_array_equal(out_bad, out_clean)  # unchecked: skipped
    dup = np.full_like(sel, -1)
    dup[:, :, :2] = 0
    with pytest.raises(ValueError, match="twice"):
        mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_block_indexes=dup, check_input_valid=True, **common)
    pages = p.kv_indices.copy()
    pages[1] = 10_000
    full = np.tile(np.array([0, 1, 2, -1], np.int32), (40, 1, 1))
    with pytest.raises(ValueError, match="page id"):
        mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_block_indexes=full, kv_indices=pages,
                      check_input_valid=True)


def test_wide_page_ids_and_offsets_saturate(rng):
    """int64 page ids and offsets beyond int32 saturate (a page id stays outside the cache: refused
    when checked, its keys inadmissible otherwise) instead of wrapping onto valid values."""
    p = make_problem(rng, [2], [48], 4, 4, 64, page_size=16)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 4, 4, page_size=16)
    pages = p.kv_indices.astype(np.int64)
    pages[1] += 2**32
    with pytest.raises(ValueError, match="page id 2147483647 outside the cache"):
        mc.msa(p.q, p.k_cache, p.v_cache, info, kv_indices=pages, check_input_valid=True)
    out, _ = mc.msa(p.q, p.k_cache, p.v_cache, info, kv_indices=pages)
    ref = R.dense_attention(p.q, np.delete(p.k, range(16, 32), 0), np.delete(p.v, range(16, 32), 0),
                            p.cu_q, [0, 32], qo_offset=[30])
    assert_rel(out, ref[0], 8e-3)
    table = p.page_table.astype(np.int64)
    table[0, 1] -= 2**40
    out, _ = mc.msa(p.q, p.k_cache, p.v_cache, info, page_table=table)
    assert_rel(out, ref[0], 8e-3)
    q = make_problem(rng, [3, 2], [8, 20], 4, 2, 64)
    dinfo = mc.msa_plan_from_lengths(q.qo, q.kv, 4, 2)
    with pytest.raises(ValueError, match=r"q_offset_override must be in \[-2147483648, 2147483647\]"):
        mc.msa(q.q, q.k, q.v, dinfo, q_offset_override=2**40)
    res, _ = mc.msa(q.q, q.k, q.v, dinfo, q_offset_override=np.array([2**40, -(2**40)], np.int64))
    check(res, None, dense_ref(q, [2**31 - 1, -(2**31)]), BF16)


def test_paged_bad_page_skipped_unchecked_refused_checked(rng):
    p = make_problem(rng, [2], [48], 4, 4, 64, page_size=16)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 4, 4, page_size=16)
    pages = p.kv_indices.copy()
    pages[1] = -3
    with pytest.raises(ValueError):
        mc.msa(p.q, p.k_cache, p.v_cache, info, kv_indices=pages, check_input_valid=True)
    out, _ = mc.msa(p.q, p.k_cache, p.v_cache, info, kv_indices=pages)
    ref = R.dense_attention(p.q, np.delete(p.k, range(16, 32), 0), np.delete(p.v, range(16, 32), 0),
                            p.cu_q, [0, 32], qo_offset=[30])  # keys 16..31 vanish (compacted positions shift by 16)
    assert_rel(out, ref[0], 8e-3)


# ----------------------------------------------------------------------------- runtime metadata and static plans


def metadata(p, *, offsets=None, seqused=None, **extra):
    offs = (p.kv - p.qo) if offsets is None else np.asarray(offsets)
    return mc.MsaRuntimeMetadata(
        qo_lens=p.qo.astype(np.int32), kv_lens=p.kv.astype(np.int32), qo_offset=offs.astype(np.int32),
        cu_seqlens_q=p.cu_q.astype(np.int32), cu_seqlens_k=p.cu_k.astype(np.int32),
        seqused_k=(p.kv if seqused is None else np.asarray(seqused)).astype(np.int32), **extra)


def test_static_dense_equals_eager(rng):
    p = make_problem(rng, [3, 0, 50], [100, 7, 50], 8, 2, 64)
    info = mc.msa_plan(3, 64, 128, 8, num_kv_heads=2, total_seqlen_k=256, output_maxscore=True)
    lse = np.empty((p.total_q, 8), np.float32)
    out, ms = mc.msa(p.q, p.k, p.v, info, runtime_metadata=metadata(p, offsets=[97, 7, 1]), lse=lse)
    check(out, lse, dense_ref(p, [97, 7, 1]), BF16, "static dense")
    assert ms.shape == (p.total_q, 8, 1)  # sized from the plan's max_seqlen_k capacity
    assert_rel(ms, R.block_max_score(p.q, p.k, p.cu_q, p.cu_k, qo_offset=[97, 7, 1]), 1e-6)


def test_seqused_k_limits_the_keys(rng):
    p = make_problem(rng, [4, 4], [50, 60], 4, 4, 64)
    info = mc.msa_plan(2, 4, 64, 4, causal=False, total_seqlen_k=110)
    out, _ = mc.msa(p.q, p.k, p.v, info, runtime_metadata=metadata(p, seqused=[10, 60]))
    check(out, None, dense_ref(p, causal=False, kv_lens=np.array([10, 60])), BF16, "seqused_k")


def test_checked_mode_refuses_runtime_lengths_the_kernels_do_not_cover(rng):
    """``check_input_valid``: seqused_k above kv_lens (the kernels take seqused_k as the key
    count) and lengths above a static plan's maxima (its launch geometry) are refused."""
    p = make_problem(rng, [4, 4], [50, 60], 4, 4, 64)
    info = mc.msa_plan(2, 4, 64, 4, causal=False, total_seqlen_k=110)
    with pytest.raises(ValueError, match=r"seqused_k must lie in \[0, kv_lens\].*\[51, 60\]"):
        mc.msa(p.q, p.k, p.v, info, runtime_metadata=metadata(p, seqused=[51, 60]), check_input_valid=True)
    small = mc.msa_plan(2, 3, 64, 4, causal=False, total_seqlen_k=110)
    with pytest.raises(ValueError, match="max_seqlen_q=3"):
        mc.msa(p.q, p.k, p.v, small, runtime_metadata=metadata(p), check_input_valid=True)
    short = mc.msa_plan(2, 4, 55, 4, causal=False, total_seqlen_k=110)
    with pytest.raises(ValueError, match="max_seqlen_k=55"):
        mc.msa(p.q, p.k, p.v, short, runtime_metadata=metadata(p), check_input_valid=True)
    out, _ = mc.msa(p.q, p.k, p.v, info, runtime_metadata=metadata(p, seqused=[10, 60]), check_input_valid=True)
    check(out, None, dense_ref(p, causal=False, kv_lens=np.array([10, 60])), BF16, "checked seqused_k")


@pytest.mark.parametrize("source", ["page_table", "kv_page_indptr"])
def test_static_paged(rng, source):
    p = make_problem(rng, [1, 1, 1], [130, 1, 256], 8, 1, 64, page_size=128)
    info = mc.msa_plan(3, 1, 256, 8, num_kv_heads=1, page_size=128, total_seqlen_k=1024)
    assert info[3].mode == "paged"
    if source == "page_table":
        table = np.zeros((3, 2), np.int32)
        table[:, :] = np.where(p.page_table[:, :2] >= 0, p.page_table[:, :2], 0)
        md, kw = metadata(p, page_table=table), {}
    else:
        indptr = np.concatenate([[0], np.cumsum(-(-p.kv // 128))]).astype(np.int32)
        md, kw = metadata(p, kv_page_indptr=indptr), {"kv_indices": p.kv_indices}
    out, _ = mc.msa(p.q, p.k_cache, p.v_cache, info, runtime_metadata=md, **kw)
    check(out, None, dense_ref(p), BF16, "static paged")


def test_static_sparse_decode(rng):
    p = make_problem(rng, [1, 1], [300, 129], 16, 1, 128, page_size=128)
    info = mc.msa_plan(2, 1, 384, 16, num_kv_heads=1, page_size=128, kv_block_num=4, total_seqlen_k=1024)
    assert info[3].mode == "sparse_decode"
    table = np.where(p.page_table[:, :3] >= 0, p.page_table[:, :3], 0).astype(np.int32)
    table = np.pad(table, ((0, 0), (0, 3 - table.shape[1])))
    sel = random_selection(rng, p, 4)
    out = mc.sparse_decode_atten_func(p.q, p.k_cache, p.v_cache, info, kv_block_indexes=sel,
                                      runtime_metadata=metadata(p, page_table=table))
    check(out, None, masked_dense_ref(p, sel), BF16, "static sparse decode")


def test_eager_plan_with_runtime_metadata(rng):
    p = make_problem(rng, [3, 5], [20, 9], 4, 2, 64)
    info = mc.msa_plan_from_lengths([1, 1], [1, 1], 4, 2)  # runtime lengths replace the plan's
    md = mc.MsaRuntimeMetadata(qo_lens=p.qo, kv_lens=p.kv, qo_offset=(p.kv - p.qo).astype(np.int32))
    out, _ = mc.msa(p.q, p.k, p.v, info, runtime_metadata=md)
    check(out, None, dense_ref(p), BF16, "eager + metadata")


def _static_case(rng):
    p = make_problem(rng, [2, 3], [10, 20], 4, 4, 64)
    info = mc.msa_plan(2, 4, 32, 4, total_seqlen_k=64)
    return p, info


def _bad_md(p, **change):
    md = metadata(p)
    for k, v in change.items():
        setattr(md, k, v)
    return md


METADATA_ERRORS = [
    ("missing-metadata", lambda p: None, {}, ValueError),
    ("not-metadata", lambda p: {"qo_lens": p.qo}, {}, TypeError),
    ("list-vector", lambda p: _bad_md(p, qo_lens=[2, 3]), {}, TypeError),
    ("int64-vector", lambda p: _bad_md(p, kv_lens=p.kv.astype(np.int64)), {}, TypeError),
    ("rank-2-vector", lambda p: _bad_md(p, qo_offset=np.zeros((2, 1), np.int32)), {}, TypeError),
    ("short-vector", lambda p: _bad_md(p, qo_lens=np.zeros(1, np.int32)), {}, ValueError),
    ("strided-vector", lambda p: _bad_md(p, kv_lens=np.zeros(4, np.int32)[::2]), {}, ValueError),
    ("missing-cu-q", lambda p: _bad_md(p, cu_seqlens_q=None), {}, ValueError),
    ("missing-cu-k", lambda p: _bad_md(p, cu_seqlens_k=None), {}, ValueError),
    ("missing-seqused", lambda p: _bad_md(p, seqused_k=None), {}, ValueError),
    ("cu-wrong-length", lambda p: _bad_md(p, cu_seqlens_q=np.zeros(2, np.int32)), {}, ValueError),
    ("page-table-shape", lambda p: _bad_md(p, page_table=np.zeros((2, 5), np.int32)), {}, ValueError),
    ("page-table-int64", lambda p: _bad_md(p, page_table=np.zeros((2, 1), np.int64)), {}, TypeError),
    ("page-table-and-indptr", lambda p: _bad_md(p, page_table=np.zeros((2, 1), np.int32),
                                               kv_page_indptr=np.zeros(3, np.int32)), {}, ValueError),
    ("override-with-metadata", lambda p: metadata(p), {"q_offset_override": 3}, ValueError),
]


@pytest.mark.parametrize("make_md, kw, exc", [pytest.param(m, k, e, id=i) for i, m, k, e in METADATA_ERRORS])
def test_runtime_metadata_refusals(rng, make_md, kw, exc):
    p, info = _static_case(rng)
    with pytest.raises(exc):
        mc.msa(p.q, p.k, p.v, info, runtime_metadata=make_md(p), **kw)


def test_mixed_plan_with_metadata_not_implemented(rng):
    p = make_problem(rng, [1, 200], [10, 200], 4, 4, 64)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 4)
    with pytest.raises(NotImplementedError):
        mc.msa(p.q, p.k, p.v, info, runtime_metadata=metadata(p))


# ----------------------------------------------------------------------------- refusals of the ops


@pytest.fixture
def sparse_setup(rng):
    p = make_problem(rng, [40], [300], 8, 1, 128, page_size=128)
    info = mc.sparse_msa_plan(p.qo, p.kv, 8, 1, page_size=128, kv_block_num=4)
    sel = random_selection(rng, p, 4)
    return p, info, sel


def _sparse_call(p, plan_info, sel, **over):
    args = dict(q=p.q, k=p.k_cache, v=p.v_cache, info=plan_info)
    kw = dict(kv_indices=p.kv_indices, kv_block_indexes=sel)
    for key, val in over.items():
        (args if key in args else kw)[key] = val
    kw = {k: v for k, v in kw.items() if v is not _DROP}
    return mc.sparse_msa(args["q"], args["k"], args["v"], args["info"], **kw)


_DROP = object()

SPARSE_ERRORS = [
    ("no-block-indexes", lambda p, i, s: dict(kv_block_indexes=_DROP), ValueError),
    ("no-pages", lambda p, i, s: dict(kv_indices=_DROP), ValueError),
    ("unknown-keyword", lambda p, i, s: dict(page_table=p.page_table), TypeError),
    ("float32", lambda p, i, s: dict(q=p.q.astype(np.float32), k=p.k_cache.astype(np.float32),
                                     v=p.v_cache.astype(np.float32)), TypeError),
    ("dtype-mismatch", lambda p, i, s: dict(q=p.q.astype(np.float16)), TypeError),
    ("head-dim-64", lambda p, i, s: dict(q=p.q[..., :64].copy(), k=p.k_cache[..., :64].copy(),
                                         v=p.v_cache[..., :64].copy()), ValueError),
    ("gqa-ratio-4", lambda p, i, s: dict(info=mc.sparse_msa_plan(p.qo, p.kv, 8, 2, page_size=128, kv_block_num=4),
                                         k=np.repeat(p.k_cache, 2, 2), v=np.repeat(p.v_cache, 2, 2),
                                         kv_block_indexes=np.repeat(s, 2, 1)), ValueError),
    ("q-heads-mismatch", lambda p, i, s: dict(q=np.repeat(p.q, 2, 1)), ValueError),
    ("width-mismatch", lambda p, i, s: dict(kv_block_indexes=np.zeros((40, 1, 8), np.int32)), ValueError),
    ("indexes-int64", lambda p, i, s: dict(kv_block_indexes=s.astype(np.int64)), TypeError),
    ("indexes-rank-2", lambda p, i, s: dict(kv_block_indexes=s[:, 0, :].copy()), ValueError),
    ("indexes-rows", lambda p, i, s: dict(kv_block_indexes=s[:5].copy()), ValueError),
    ("indexes-heads", lambda p, i, s: dict(kv_block_indexes=np.repeat(s, 3, 1)), ValueError),
    ("dense-k", lambda p, i, s: dict(k=p.k, v=p.v), ValueError),
    ("k-layout", lambda p, i, s: dict(k=p.k_cache[:, :64].copy(), v=p.v_cache[:, :64].copy()), ValueError),
    ("kv-indices-2d", lambda p, i, s: dict(kv_indices=p.kv_indices[None, :]), ValueError),
    ("kv-splits", lambda p, i, s: dict(info=mc.sparse_msa_plan(p.qo, p.kv, 8, 1, page_size=128, kv_block_num=4,
                                                               num_kv_splits=2)), ValueError),
    ("decode-plan", lambda p, i, s: dict(info=mc.msa_plan_from_lengths([1] * 40, [300] * 40, 8, 1, page_size=128,
                                                                       kv_block_num=4)), ValueError),
    ("dense-plan", lambda p, i, s: dict(info=mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1)), ValueError),
    ("mixed-plan", lambda p, i, s: dict(info=mc.msa_plan_from_lengths([1, 39], [10, 290], 8, 1, page_size=128,
                                                                      kv_block_num=4)), ValueError),
    ("bad-plan-info", lambda p, i, s: dict(info=(1, 2)), TypeError),
    ("out-dtype", lambda p, i, s: dict(out=np.zeros(p.q.shape, np.float16)), TypeError),
    ("out-shape", lambda p, i, s: dict(out=np.zeros((40, 8, 64), BF16)), ValueError),
    ("lse-dtype", lambda p, i, s: dict(lse=np.zeros((40, 8), np.float64)), TypeError),
    ("lse-shape", lambda p, i, s: dict(lse=np.zeros((40, 4), np.float32)), ValueError),
    ("max-score-shape", lambda p, i, s: dict(max_score=np.zeros((40, 8, 1), np.float32)), ValueError),
    ("override-length", lambda p, i, s: dict(q_offset_override=np.array([1, 2])), ValueError),
]


@pytest.mark.parametrize("change, exc", [pytest.param(c, e, id=i) for i, c, e in SPARSE_ERRORS])
def test_sparse_msa_refusals(sparse_setup, change, exc):
    p, info, sel = sparse_setup
    with pytest.raises(exc):
        _sparse_call(p, info, sel, **change(p, info, sel))


def test_positional_rules(sparse_setup):
    p, info, sel = sparse_setup
    for fn in (mc.sparse_msa, mc.sparse_decode_atten_func):
        with pytest.raises(TypeError):
            fn(p.q, p.k_cache, p.v_cache)
        with pytest.raises(TypeError):
            fn(p.q, p.k_cache, p.v_cache, info, p.kv_indices)
    with pytest.raises(TypeError):
        mc.sparse_decode_atten_func(p.q, p.k_cache, p.v_cache, info, bogus=1)
    with pytest.raises(ValueError):  # a prefill plan
        mc.sparse_decode_atten_func(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices, kv_block_indexes=sel)
    with pytest.raises(ValueError):
        mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices, output_o=False)


@pytest.fixture
def dense_setup(rng):
    p = make_problem(rng, [3, 5], [20, 9], 4, 2, 64)
    return p, mc.msa_plan_from_lengths(p.qo, p.kv, 4, 2)


MSA_ERRORS = [
    ("unknown-keyword", lambda p: dict(bogus=1), TypeError),
    ("nothing-to-compute", lambda p: dict(output_o=False), ValueError),
    ("k-scale-dense", lambda p: dict(k_scale=2.0), ValueError),
    ("v-scale-dense", lambda p: dict(v_scale=0.5), ValueError),
    ("q-rows", lambda p: dict(q=p.q[:-1]), ValueError),
    ("k-rows", lambda p: dict(k=p.k[:-1], v=p.v[:-1]), ValueError),
    ("q-rank", lambda p: dict(q=p.q[None]), ValueError),
    ("k-heads", lambda p: dict(k=np.repeat(p.k, 2, 1), v=np.repeat(p.v, 2, 1)), ValueError),
    ("kv-shape", lambda p: dict(v=p.v[:-1]), ValueError),
    ("head-dim", lambda p: dict(k=p.k[..., :16].copy(), v=p.v[..., :16].copy()), ValueError),
    ("float64", lambda p: dict(q=p.q.astype(np.float64), k=p.k.astype(np.float64), v=p.v.astype(np.float64)),
     TypeError),
    ("block-indexes-dense-plan", lambda p: dict(kv_block_indexes=np.zeros((8, 2, 4), np.int32)), ValueError),
    ("override-length", lambda p: dict(q_offset_override=np.array([1, 2, 3])), ValueError),
    ("override-float", lambda p: dict(q_offset_override=np.array([1.0, 2.0])), TypeError),
    ("max-score-dtype", lambda p: dict(max_score=np.zeros((8, 4, 1), np.float64)), TypeError),
    ("not-an-array", lambda p: dict(q="q"), TypeError),
]


@pytest.mark.parametrize("change, exc", [pytest.param(c, e, id=i) for i, c, e in MSA_ERRORS])
def test_msa_refusals(dense_setup, change, exc):
    p, info = dense_setup
    args = dict(q=p.q, k=p.k, v=p.v)
    kw = change(p)
    for name in ("q", "k", "v"):
        if name in kw:
            args[name] = kw.pop(name)
    with pytest.raises(exc):
        mc.msa(args["q"], args["k"], args["v"], info, **kw)


def test_paged_refusals(rng):
    p = make_problem(rng, [2, 3], [40, 129], 8, 1, 64, page_size=128)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1, page_size=128)
    with pytest.raises(ValueError, match="kv_indices or page_table"):
        mc.msa(p.q, p.k_cache, p.v_cache, info)
    with pytest.raises(ValueError, match="page count"):
        mc.msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices[:-1])
    with pytest.raises(ValueError):  # max-score page table must be [B, ceil(max_seqlen_k / 128)]
        mc.msa(p.q, p.k_cache, p.v_cache, info, page_table=p.page_table[:, :1], output_maxscore=True)
    with pytest.raises(TypeError):
        mc.msa(p.q, p.k_cache, p.v_cache, info, page_table=p.page_table.astype(np.int64), output_maxscore=True)
    with pytest.raises(ValueError):  # static plan without CSR offsets
        static = mc.msa_plan(2, 4, 256, 8, num_kv_heads=1, page_size=128, output_maxscore=True)
        mc.msa(p.q, p.k_cache, p.v_cache, static, kv_indices=p.kv_indices, runtime_metadata=metadata(p),
               output_o=False)


# ----------------------------------------------------------------------------- frameworks


@pytest.mark.torch
def test_torch_cpu_tensors(rng):
    import torch

    p = make_problem(rng, [3, 40], [100, 40], 8, 1, 64)
    info = mc.msa_plan_from_lengths(torch.from_numpy(p.qo), torch.from_numpy(p.kv), 8, 1)
    tq = torch.from_numpy(p.q.astype(np.float32)).to(torch.bfloat16)
    tk = torch.from_numpy(p.k.astype(np.float32)).to(torch.bfloat16)
    tv = torch.from_numpy(p.v.astype(np.float32)).to(torch.bfloat16)
    out_t = torch.full(tuple(p.q.shape), float("nan"), dtype=torch.bfloat16)
    lse_t = torch.empty((p.total_q, 8), dtype=torch.float32)
    res, _ = mc.msa(tq, tk, tv, info, out=out_t, lse=lse_t)
    assert res is out_t
    ref = dense_ref(p)
    assert_rel(res.float().numpy(), ref[0], 8e-3, "torch out")
    assert_rel(lse_t.numpy(), ref[1], 1e-6, "torch lse")
    res2, _ = mc.msa(tq, tk, tv, info)
    assert isinstance(res2, torch.Tensor) and res2.dtype == torch.bfloat16
    assert torch.equal(res2, out_t)


@pytest.mark.torch
def test_torch_cpu_fp8_sparse(rng):
    import torch

    p = make_problem(rng, [40], [300], 8, 1, 128, dtype=FP8, page_size=128)
    info = mc.sparse_msa_plan(p.qo, p.kv, 8, 1, page_size=128, kv_block_num=4)
    sel = random_selection(rng, p, 4)

    def t(x):
        return torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn)

    out, _ = mc.sparse_msa(t(p.q), t(p.k_cache), t(p.v_cache), info, kv_indices=torch.from_numpy(p.kv_indices),
                           kv_block_indexes=torch.from_numpy(sel), k_scale=0.5, v_scale=2.0)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert_rel(out.float().numpy(), sparse_ref(p, sel, k_scale=0.5, v_scale=2.0)[0], 8e-3, "torch fp8")


def test_page_indirection_conflicts(rng):
    p = make_problem(rng, [1, 1], [130, 200], 8, 1, 128, page_size=128)
    static = mc.msa_plan(2, 1, 256, 8, num_kv_heads=1, page_size=128, output_maxscore=True, total_seqlen_k=1024)
    table = np.where(p.page_table >= 0, p.page_table, 0).astype(np.int32)
    indptr = np.array([0, 2, 4], np.int32)
    with pytest.raises(ValueError, match="mutually exclusive"):  # argument and runtime page tables
        mc.msa(p.q, p.k_cache, p.v_cache, static, page_table=table,
               runtime_metadata=metadata(p, page_table=table))
    with pytest.raises(ValueError, match="kv_page_indptr"):  # max score: 2-D table with CSR offsets
        mc.msa(p.q, p.k_cache, p.v_cache, static, page_table=table, output_o=False,
               runtime_metadata=metadata(p, kv_page_indptr=indptr))
    eager = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1, page_size=128)
    with pytest.raises(ValueError, match="kv_indices"):  # max score without pages
        mc.msa(p.q, p.k_cache, p.v_cache, eager, output_maxscore=True, output_o=False)
    sparse = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1, page_size=128, kv_block_num=4)
    sel = random_selection(rng, p, 4)
    with pytest.raises(ValueError, match="rank 2"):
        mc.sparse_decode_atten_func(p.q, p.k_cache, p.v_cache, sparse, page_table=p.kv_indices,
                                    kv_block_indexes=sel)
    mixed = mc.msa_plan_from_lengths([1, 40], [130, 200], 8, 1, page_size=128, kv_block_num=4)
    with pytest.raises(ValueError, match="pure sparse-decode"):
        mc.sparse_decode_atten_func(p.q, p.k_cache, p.v_cache, mixed, kv_indices=p.kv_indices,
                                    kv_block_indexes=sel)
    # the static plan with both forms resolved runs, and matches the dense reference
    out, ms = mc.msa(p.q, p.k_cache, p.v_cache, static, runtime_metadata=metadata(p, page_table=table))
    check(out, None, dense_ref(p), BF16, "static paged table")
    assert_rel(ms, R.block_max_score(p.q, p.k, p.cu_q, p.cu_k), 1e-6)


def test_no_output_requested_is_value_and_not_implemented_error(sparse_setup):
    p, info, sel = sparse_setup
    for call in (lambda: mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices,
                                       kv_block_indexes=sel, output_o=False),
                 lambda: mc.msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices, output_o=False)):
        with pytest.raises(ValueError):
            call()
        with pytest.raises(NotImplementedError):
            call()


def test_empty_page_pool(rng):
    p = make_problem(rng, [2, 1], [0, 0], 4, 4, 64, page_size=16)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 4, 4, page_size=16)
    empty = p.k_cache[:0]
    out, _ = mc.msa(p.q, empty, empty, info, kv_indices=np.zeros(0, np.int32))
    assert np.all(np.asarray(out, dtype=np.float64) == 0)


# ----------------------------------------------------------------------------- the kernels' limits, on host inputs too


def _dense_call(p, info=None, **kw):
    info = mc.msa_plan_from_lengths(p.qo, p.kv, p.hq, p.hkv) if info is None else info
    return mc.msa(kw.pop("q", p.q), kw.pop("k", p.k), kw.pop("v", p.v), info, **kw)


HOST_LIMITS = [
    ("head-dim-96", dict(d=96), {}, NotImplementedError),
    ("head-dim-32", dict(d=32), {}, NotImplementedError),
    ("head-dim-512", dict(d=512), {}, NotImplementedError),
    ("float32", dict(dtype=np.float32), {}, TypeError),
    ("float32-max-score", dict(dtype=np.float32), {"output_maxscore": True, "output_o": False}, TypeError),
    ("fp8-max-score-zero-k-scale", dict(dtype=FP8), {"output_maxscore": True, "output_o": False, "k_scale": 0.0},
     NotImplementedError),
    ("max-score-head-dim-96", dict(d=96), {"output_maxscore": True, "output_o": False}, NotImplementedError),
    ("zero-scale", {}, {"sm_scale": 0.0}, NotImplementedError),
    ("negative-scale", {}, {"sm_scale": -0.1}, NotImplementedError),
    ("nan-scale", {}, {"sm_scale": float("nan")}, NotImplementedError),
]


@pytest.mark.parametrize("make, kw, exc", [pytest.param(m, k, e, id=i) for i, m, k, e in HOST_LIMITS])
def test_kernel_limits_refused_for_host_inputs(rng, make, kw, exc):
    spec = dict(d=64, dtype=BF16)
    spec.update(make)
    p = make_problem(rng, [3, 5], [20, 9], 8, 2, spec["d"], dtype=spec["dtype"])
    with pytest.raises(exc):
        _dense_call(p, **kw)


def test_fp8_dense_attention_runs_on_host(rng):
    p = make_problem(rng, [3, 5], [20, 9], 8, 2, 64, dtype=FP8)
    out, _ = _dense_call(p)
    assert out.dtype == BF16
    assert_rel(out, dense_ref(p)[0], 8e-3, "fp8 dense")


def test_layouts_the_kernels_cannot_read_are_copied(rng, monkeypatch):
    """q, k, v with a strided head dim, rows not 16-byte multiples or unaligned data are read
    from a contiguous copy (the caller's arrays are left as they are)."""
    p = make_problem(rng, [3, 5], [20, 9], 8, 2, 64)
    ref = dense_ref(p)
    wide = np.zeros((p.total_q, 8, 128), BF16)
    wide[..., ::2] = p.q
    out, _ = _dense_call(p, q=wide[..., ::2])
    check(out, None, ref, BF16, "strided head dim")
    padded = np.zeros((p.total_q, 8, 68), BF16)  # rows of 136 bytes: not 16-byte multiples
    padded[..., :64] = p.q
    out, _ = _dense_call(p, q=padded[..., :64])
    check(out, None, ref, BF16, "136-byte rows")
    raw = np.zeros(p.q.size * 2 + 8, np.uint8)[1:1 + p.q.size * 2].view(BF16).reshape(p.q.shape)
    raw[...] = p.q
    out, _ = _dense_call(p, q=raw)
    check(out, None, ref, BF16, "unaligned q")
    kt = np.zeros((p.k.shape[0], 2, 64, 2), BF16)
    kt[..., 0] = p.k
    out, _ = _dense_call(p, k=kt[..., 0])
    check(out, None, ref, BF16, "strided k")
    copies = []
    real = execute._rows_of_chunks
    monkeypatch.setattr(execute, "_rows_of_chunks", lambda call, arg: copies.append(arg.name) or real(call, arg))
    same, _ = _dense_call(p, k=kt[..., 0], v=kt[..., 0])
    want, _ = _dense_call(p, v=p.k)
    assert copies.count("k") == 1 and "v" not in copies and copies.count("q") == 0
    np.testing.assert_array_equal(same.view(np.uint16), want.view(np.uint16))


def test_layout_limits_refused_for_host_inputs(rng):
    p = make_problem(rng, [3, 5], [20, 9], 8, 2, 64)
    out_raw = np.zeros(p.q.size * 2 + 8, np.uint8)[2:2 + p.q.size * 2].view(BF16).reshape(p.q.shape)
    with pytest.raises(ValueError, match="out: the data must be 16-byte aligned"):
        _dense_call(p, out=out_raw)
    ok = np.zeros((p.total_q, 8, 72), BF16)  # 144-byte rows: fine
    ok[..., :64] = p.q
    out, _ = _dense_call(p, q=ok[..., :64])
    check(out, None, dense_ref(p), BF16, "padded q rows")


def test_sparse_limits_refused_for_host_inputs(rng):
    p = make_problem(rng, [40], [300], 32, 8, 128, page_size=128)  # Hq/Hkv 4
    info = mc.sparse_msa_plan(p.qo, p.kv, 32, 8, page_size=128, kv_block_num=4)
    sel = random_selection(rng, p, 4)
    with pytest.raises(ValueError, match="Hq/Hkv"):
        mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices, kv_block_indexes=sel)
    p = make_problem(rng, [40], [300], 8, 1, 256, page_size=128)
    info = mc.sparse_msa_plan(p.qo, p.kv, 8, 1, page_size=128, kv_block_num=4)
    with pytest.raises(ValueError, match="head dim 128"):
        mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices,
                      kv_block_indexes=random_selection(rng, p, 4))


def test_workspace_is_not_used_by_host_inputs(rng):
    p = make_problem(rng, [3, 5], [20, 9], 8, 2, 64)
    a, _ = _dense_call(p)
    b, _ = _dense_call(p, workspace=np.zeros(16, np.uint8))
    np.testing.assert_array_equal(a, b)


def test_sparse_context_limit_is_refused_for_host_inputs(rng):
    from mate_cupy.msa.execute import SPARSE_MAX_SEQLEN_K

    p = make_problem(rng, [40], [300], 8, 1, 128, page_size=128)
    info = mc.sparse_msa_plan(p.qo, [SPARSE_MAX_SEQLEN_K + 1], 8, 1, page_size=128, kv_block_num=4)
    with pytest.raises(NotImplementedError, match="max_seqlen_k"):
        mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices,
                      kv_block_indexes=random_selection(rng, p, 4))


def test_repeated_calls_reuse_the_frozen_problem(rng):
    p = make_problem(rng, [3, 5], [20, 9], 8, 2, 64)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 2)
    a, _ = _dense_call(p, info=info)
    first = info[3].last_call[1]
    b, _ = _dense_call(p, info=info)
    assert info[3].last_call[1] is first  # the same call shape: the same frozen problem
    np.testing.assert_array_equal(a, b)
    _dense_call(p, info=info, sm_scale=0.1)
    assert info[3].last_call[1] is not first and info[3].last_call[1].sm_scale == 0.1


# ----------------------------------------------------------------------------- float8 max scores


FP8_MS_CASES = [  # (qo, kv, Hq, Hkv, D, page_size, layout, pages): decode (<= 32 packed rows) and prefill shapes
    ([1, 1, 1], [300, 1, 129], 8, 1, 128, 0, "", ""),
    ([4, 2, 0, 3], [700, 129, 5, 1000], 16, 2, 64, 64, "NHD", "table"),
    ([32, 1], [400, 90], 4, 4, 128, 128, "HND", "csr"),
    ([2, 1], [300, 1000], 16, 2, 256, 32, "NHD", "csr"),
    ([40, 3], [300, 700], 8, 1, 128, 0, "", ""),             # 320 packed rows
    ([33], [400], 4, 4, 64, 128, "NHD", "table"),            # 33
    ([17, 5], [1000, 200], 8, 8, 256, 64, "HND", "csr"),     # 17 at D 256
]


@pytest.mark.parametrize("case", range(len(FP8_MS_CASES)))
def test_fp8_max_score_on_host_is_k_scale_times_the_block_max(rng, case):
    """fp8 q and k: ``max_score = k_scale * max_j q . k_j`` in float64, stored as float32."""
    qo, kv, hq, hkv, d, page, layout, pages = FP8_MS_CASES[case]
    p = make_problem(rng, qo, kv, hq, hkv, d, dtype=FP8, page_size=page, layout=layout or "NHD")
    k_scale = 0.37
    if page == 0:
        info = mc.msa_plan_from_lengths(p.qo, p.kv, hq, hkv, causal=True)
        _, ms = mc.msa(p.q, p.k, p.v, info, output_o=False, output_maxscore=True, k_scale=k_scale, v_scale=5.0)
        want = R.block_max_score(p.q, p.k, p.cu_q, p.cu_k) * k_scale
    else:
        info = mc.msa_plan_from_lengths(p.qo, p.kv, hq, hkv, page_size=page, causal=True)
        where = dict(page_table=p.page_table) if pages == "table" else dict(kv_indices=p.kv_indices)
        _, ms = mc.msa(p.q, p.k_cache, p.v_cache, info, output_o=False, output_maxscore=True, k_scale=k_scale,
                       **where)
        want = R.paged_block_max_score(p.q, p.k_cache, p.cu_q, p.kv, p.page_table, kv_layout=layout) * k_scale
    assert ms.dtype == np.float32
    np.testing.assert_array_equal(ms, want.astype(np.float32))
    assert np.isfinite(ms).any() and np.isneginf(ms).any()
    # the reference's own k_scale argument is the same product
    if page == 0:
        np.testing.assert_array_equal(R.block_max_score(p.q, p.k, p.cu_q, p.cu_k, k_scale=k_scale), want)


def test_fp8_max_score_with_fp8_sparse_attention_shares_k_scale(rng):
    """sparse_decode_atten_func: the fp8 attention and its max score take the same k_scale."""
    p = make_problem(rng, [1, 2, 1], [700, 300, 129], 16, 2, 128, dtype=FP8, page_size=128)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 16, 2, page_size=128, kv_block_num=4, use_fp8_kvcache=True)
    assert info[3].mode == "sparse_decode"
    sel = random_selection(rng, p, 4)
    out, ms = mc.sparse_decode_atten_func(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices,
                                          kv_block_indexes=sel, k_scale=0.5, v_scale=1.5, output_maxscore=True)
    want = R.paged_block_max_score(p.q, p.k_cache, p.cu_q, p.kv, p.page_table, k_scale=0.5)
    np.testing.assert_array_equal(ms, want.astype(np.float32))
    ref_out, _ = R.sparse_attention(p.q, p.k_cache, p.v_cache, p.cu_q, p.kv, p.page_table, sel, k_scale=0.5,
                                    v_scale=1.5)
    assert_rel(out, ref_out, 8e-3, "fp8 sparse decode out")
    prefill_info = mc.sparse_msa_plan(p.qo, p.kv, 16, 2, page_size=128, kv_block_num=4)  # 16 packed rows
    _, ms_only = mc.sparse_msa(p.q, p.k_cache, p.v_cache, prefill_info, kv_indices=p.kv_indices, k_scale=0.5,
                               output_o=False, output_maxscore=True)
    np.testing.assert_array_equal(ms_only, ms)


def test_16bit_max_score_ignores_k_scale(rng):
    p = make_problem(rng, [2, 1], [300, 129], 8, 2, 64)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 2)
    _, a = mc.msa(p.q, p.k, p.v, info, output_o=False, output_maxscore=True)
    _, b = mc.msa(p.q, p.k, p.v, info, output_o=False, output_maxscore=True, k_scale=3.0)
    np.testing.assert_array_equal(a, b)


STANDIN_STREAM = 0x5000


def _cuda_standin(name, a):
    """An Arg describing host array ``a`` as a cuda:0 array: validation reads only metadata."""
    from mate_cupy.runtime import interop

    a = np.asarray(a) if isinstance(a, (list, tuple)) else a
    if not isinstance(a, np.ndarray):
        return interop.wrap(name, a)
    item = a.dtype.itemsize
    return interop.Arg(name, a, a.dtype, "cupy", 0, a.shape, tuple(s // item for s in a.strides),
                       a.__array_interface__["data"][0], data=a)


@pytest.fixture
def cuda_standins(monkeypatch):
    """msa's validation sees NumPy arrays as cuda:0 arrays of a device of compute capability
    ``cuda_standins.cc`` (9.0 unless a test changes it)."""
    from mate_cupy.msa import execute
    from mate_cupy.runtime import interop

    class StandinCall(interop.Call):
        def add(self, name, obj):
            if obj is None:
                return None
            arg = self.args[name] = _cuda_standin(name, obj)
            if self.device is None:
                self.device, self.framework, self._first = arg.device, arg.framework, name
            return arg

    state = type("State", (), {"cc": 90})()
    monkeypatch.setattr(execute, "Call", StandinCall)
    monkeypatch.setattr(execute, "device_info", lambda device=None: (132, state.cc))
    return state


FP8_MS_REFUSALS = [  # (qo, Hq, Hkv, D, kw): bad scale, decode- and prefill-shaped
    ("zero-k-scale-prefill", [40, 3], 8, 1, 128, {"k_scale": 0.0}),
    ("negative-k-scale", [2], 8, 1, 128, {"k_scale": -1.0}),
    ("nan-k-scale", [2], 8, 1, 128, {"k_scale": float("nan")}),
]


def _fp8_ms_call(rng, qo, hq, hkv, d, kw, plan_kw=None):
    p = make_problem(rng, qo, [300] * len(qo), hq, hkv, d, dtype=FP8, page_size=128)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, hq, hkv, page_size=128, **(plan_kw or {}))
    return lambda: mc.msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices, output_o=False,
                          output_maxscore=True, **kw)


@pytest.mark.parametrize("qo, hq, hkv, d, kw", [pytest.param(*c[1:], id=c[0]) for c in FP8_MS_REFUSALS])
def test_fp8_max_score_refusals_are_the_same_for_host_and_cuda_inputs(rng, request, qo, hq, hkv, d, kw):
    """NotImplementedError with the same message for NumPy inputs and their CUDA description."""
    call = _fp8_ms_call(rng, qo, hq, hkv, d, kw)
    with pytest.raises(NotImplementedError) as host:
        call()
    request.getfixturevalue("cuda_standins")
    with pytest.raises(NotImplementedError) as cuda:
        call()
    assert str(host.value) == str(cuda.value)
    assert "k_scale" in str(host.value)


FP8_PREFILL_SHAPES = [  # (qo, Hq, Hkv, D): more packed rows than the decode kernel holds
    ("prefill-rows", [40, 3], 8, 1, 128),
    ("33-rows", [33], 4, 4, 64),
    ("d256-17-rows", [17], 8, 8, 256),
]


@pytest.mark.parametrize("cc", [89, 100, 120])
@pytest.mark.parametrize("qo, hq, hkv, d", [pytest.param(*c[1:], id=c[0]) for c in FP8_PREFILL_SHAPES])
def test_fp8_prefill_max_score_needs_sm90_on_cuda_inputs(rng, cuda_standins, cc, qo, hq, hkv, d):
    """Above the decode kernel's rows the fp8 max score runs the sm_90a wgmma kernel only."""
    cuda_standins.cc = cc
    with pytest.raises(NotImplementedError, match=r"runs the wgmma kernel, compute capability 9\.0 only"):
        _fp8_ms_call(rng, qo, hq, hkv, d, {})()


@pytest.mark.parametrize("qo, hq, hkv, d", [pytest.param(*c[1:], id=c[0]) for c in FP8_PREFILL_SHAPES])
def test_fp8_prefill_max_score_is_admitted_on_sm90(rng, cuda_standins, qo, hq, hkv, d):
    """The same shapes pass the float8 check on compute capability 9.0 and on host inputs (which
    run: test_fp8_max_score_on_host_is_k_scale_times_the_block_max)."""
    from mate_cupy.msa import execute
    from mate_cupy.msa.plan import unpack_plan_info

    info = mc.msa_plan_from_lengths(np.array(qo, np.int32), np.full(len(qo), 300, np.int32), hq, hkv, page_size=128)
    plan = unpack_plan_info(info)[3]
    assert plan.prefill_plan.max_seqlen_q * hq // hkv > execute.FP8_MAX_SCORE_ROWS[d]
    for device in (0, -1):
        execute.check_fp8_max_score("msa", plan, hq, d, device)
    cuda_standins.cc = 89
    with pytest.raises(NotImplementedError, match="wgmma"):
        execute.check_fp8_max_score("msa", plan, hq, d, 0)
    execute.check_fp8_max_score("msa", plan, hq, d, -1)


def test_fp8_max_score_refused_below_sm89_on_cuda_inputs(rng, cuda_standins):
    cuda_standins.cc = 80
    with pytest.raises(NotImplementedError, match="compute capability 8.9"):
        _fp8_ms_call(rng, [1, 2], 8, 1, 128, {})()


def test_fp8_max_score_refusal_covers_each_part_of_a_mixed_plan(rng, cuda_standins):
    """A mixed plan's prefill part is prefill-shaped: on a device without the wgmma kernel it is
    refused before its decode part runs."""
    cuda_standins.cc = 89
    p = make_problem(rng, [1, 40], [300, 300], 8, 1, 128, dtype=FP8, page_size=128)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1, page_size=128, kv_block_num=4)
    assert info[0]
    ms = np.full((p.total_q, 8, 3), np.nan, np.float32)
    with pytest.raises(NotImplementedError, match="wgmma kernel"):
        mc.msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices, output_o=False, max_score=ms)
    assert np.isnan(ms).all()
