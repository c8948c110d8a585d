"""The float64 MSA references against independent formulations.

Independent checks: one global masked softmax over the full ``[total_q, Hq, total_k]``
score matrix (no per-request loop), a scalar triple loop for tiny shapes, brute-force
block maxima, and paged/sparse layouts built by scattering dense K/V into shuffled pages.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from mate_cupy.reference import msa as R

BLOCK = 128


# ----------------------------------------------------------------------------- independent formulations


def global_attention(q, k, v, cu_q, cu_k, offsets, causal, scale, allowed=None, v_scale=1.0):
    """Softmax over one global score matrix; ``allowed [total_q, Hq, total_k]`` extra mask."""
    total_q, hq, d = q.shape
    total_k, hkv, _ = k.shape
    r = hq // hkv
    kk = np.repeat(k, r, axis=1)  # [total_k, Hq, D]
    vv = np.repeat(v, r, axis=1)
    s = np.einsum("qhd,khd->qhk", q, kk) * scale
    mask = np.zeros((total_q, total_k), dtype=bool)
    for b in range(len(cu_q) - 1):
        rows = np.arange(cu_q[b], cu_q[b + 1])
        keys = np.arange(cu_k[b], cu_k[b + 1])
        pos = offsets[b] + np.arange(len(rows))
        m = np.ones((len(rows), len(keys)), dtype=bool)
        if causal:
            m &= (keys - cu_k[b])[None, :] <= pos[:, None]
        mask[np.ix_(rows, keys)] = m
    mask = np.broadcast_to(mask[:, None, :], s.shape)
    if allowed is not None:
        mask = mask & allowed
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    empty = ~np.isfinite(m)
    p = np.where(mask, np.exp(s - np.where(empty, 0, m)), 0.0)
    den = p.sum(-1)
    out = np.einsum("qhk,khd->qhd", p, vv) / np.where(den > 0, den, 1)[..., None] * v_scale
    lse = np.where(den > 0, np.log(np.where(den > 0, den, 1)) + np.where(empty, 0, m)[..., 0], -np.inf)
    return out, lse


def loop_attention(q, k, v, cu_q, cu_k, offsets, causal, scale):
    """Scalar loops (tiny shapes only)."""
    total_q, hq, d = q.shape
    r = hq // k.shape[1]
    out = np.zeros_like(q)
    lse = np.full((total_q, hq), -np.inf)
    for b in range(len(cu_q) - 1):
        for i in range(cu_q[b + 1] - cu_q[b]):
            row, pos = cu_q[b] + i, offsets[b] + i
            for h in range(hq):
                logits, vals = [], []
                for j in range(cu_k[b + 1] - cu_k[b]):
                    if causal and j > pos:
                        continue
                    logits.append(sum(q[row, h, t] * k[cu_k[b] + j, h // r, t] for t in range(d)) * scale)
                    vals.append(v[cu_k[b] + j, h // r])
                if logits:
                    mx = max(logits)
                    w = [math.exp(x - mx) for x in logits]
                    out[row, h] = sum(wi * vi for wi, vi in zip(w, vals)) / sum(w)
                    lse[row, h] = mx + math.log(sum(w))
    return out, lse


def brute_block_max(q, k, cu_q, cu_k, offsets, causal, nt):
    total_q, hq, _ = q.shape
    r = hq // k.shape[1]
    res = np.full((total_q, hq, nt), -np.inf)
    for b in range(len(cu_q) - 1):
        for i in range(cu_q[b + 1] - cu_q[b]):
            row, pos = cu_q[b] + i, offsets[b] + i
            for j in range(cu_k[b + 1] - cu_k[b]):
                if causal and j > pos:
                    continue
                dots = q[row] @ k[cu_k[b] + j].T  # [Hq, Hkv]
                for h in range(hq):
                    res[row, h, j // BLOCK] = max(res[row, h, j // BLOCK], dots[h, h // r])
    return res


def scatter_to_pages(rng, k, cu_k, page_size, layout="NHD", extra_pages=3):
    """Dense ``[total_k, Hkv, D]`` -> shuffled page pool, page table, flat CSR ids."""
    kv_lens = np.diff(cu_k)
    counts = -(-kv_lens // page_size)
    n_pages = int(counts.sum()) + extra_pages
    perm = rng.permutation(n_pages)
    pool = rng.standard_normal((n_pages, page_size) + k.shape[1:])
    table = np.full((len(kv_lens), max(int(counts.max(initial=0)), 1)), -7, dtype=np.int32)
    flat, nxt = [], 0
    for b, c in enumerate(counts):
        for s in range(c):
            pid = perm[nxt]
            nxt += 1
            table[b, s] = pid
            flat.append(pid)
            lo = cu_k[b] + s * page_size
            hi = min(cu_k[b] + kv_lens[b], lo + page_size)
            pool[pid, : hi - lo] = k[lo:hi]
    if layout == "HND":
        pool = np.ascontiguousarray(pool.transpose(0, 2, 1, 3))
    return pool, table, np.asarray(flat, dtype=np.int32)


def pages_like(x, cu_k, table, pool_shape, layout="NHD"):
    """Place ``x [total_k, Hkv, D]`` with an existing page table (V beside K)."""
    page_size = pool_shape[1] if layout == "NHD" else pool_shape[2]
    pool = np.zeros(pool_shape)
    view = pool if layout == "NHD" else pool.transpose(0, 2, 1, 3)
    for b in range(len(cu_k) - 1):
        n = cu_k[b + 1] - cu_k[b]
        for s in range(-(-n // page_size)):
            lo, hi = cu_k[b] + s * page_size, min(cu_k[b + 1], cu_k[b] + (s + 1) * page_size)
            view[table[b, s], : hi - lo] = x[lo:hi]
    return pool


def make_batch(rng, qo, kv, hq, hkv, d, dtype=np.float64):
    cu_q = np.concatenate([[0], np.cumsum(qo)]).astype(np.int64)
    cu_k = np.concatenate([[0], np.cumsum(kv)]).astype(np.int64)
    q = rng.standard_normal((cu_q[-1], hq, d)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], hkv, d)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], hkv, d)).astype(dtype)
    return q, k, v, cu_q, cu_k


def f64(x):
    return np.asarray(x).astype(np.float64)


def assert_same(out, lse, ref_out, ref_lse, tol=1e-10):
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    np.testing.assert_allclose(out, ref_out, rtol=tol, atol=tol)
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=tol, atol=tol)


BATCHES = [
    pytest.param([5, 0, 130, 1], [300, 17, 130, 0], id="mixed-with-empty"),
    pytest.param([129], [257], id="not-multiple-of-128"),
    pytest.param([1, 1, 1], [1, 128, 385], id="decode"),
]


# ----------------------------------------------------------------------------- dense


@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 1), (16, 1)], ids=["gqa1", "gqa8", "gqa16"])
@pytest.mark.parametrize("qo, kv", BATCHES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_dense_matches_global_softmax(rng, qo, kv, hq, hkv, causal):
    q, k, v, cu_q, cu_k = make_batch(rng, qo, kv, hq, hkv, 32)
    out, lse = R.dense_attention(q, k, v, cu_q, cu_k, causal=causal)
    offs = np.asarray(kv) - np.asarray(qo)
    ref = global_attention(q, k, v, cu_q, cu_k, offs, causal, 32 ** -0.5)
    assert_same(out, lse, *ref)


@pytest.mark.parametrize("offsets", [[0, 3], [-4, 100], [7, -1]], ids=["zero", "neg-and-past-end", "mixed"])
def test_dense_offsets_and_scale(rng, offsets):
    q, k, v, cu_q, cu_k = make_batch(rng, [6, 9], [8, 20], 4, 2, 16)
    out, lse = R.dense_attention(q, k, v, cu_q, cu_k, qo_offset=np.array(offsets), sm_scale=0.3)
    ref = global_attention(q, k, v, cu_q, cu_k, np.array(offsets), True, 0.3)
    assert_same(out, lse, *ref)


def test_dense_matches_scalar_loop(rng):
    q, k, v, cu_q, cu_k = make_batch(rng, [3, 0, 4], [5, 2, 3], 4, 2, 4)
    offs = np.array([1, 0, -2])
    out, lse = R.dense_attention(q, k, v, cu_q, cu_k, qo_offset=offs)
    assert_same(out, lse, *loop_attention(q, k, v, cu_q, cu_k, offs, True, 0.5))


def test_empty_rows_are_zero_and_minus_inf(rng):
    q, k, v, cu_q, cu_k = make_batch(rng, [4, 3], [0, 5], 2, 1, 8)
    out, lse = R.dense_attention(q, k, v, cu_q, cu_k, qo_offset=np.array([0, -2]))
    assert np.all(out[:4] == 0) and np.all(lse[:4] == -np.inf)  # no keys
    assert np.all(out[4:6] == 0) and np.all(lse[4:6] == -np.inf)  # positions -2, -1
    assert np.all(np.isfinite(lse[6]))
    assert not np.isnan(out).any()


def test_dense_long_sequence_is_chunked_exactly(rng, monkeypatch):
    q, k, v, cu_q, cu_k = make_batch(rng, [300], [300], 2, 1, 8)
    full = R.dense_attention(q, k, v, cu_q, cu_k)
    monkeypatch.setattr(R, "_CHUNK_ELEMS", 1000)
    chunked = R.dense_attention(q, k, v, cu_q, cu_k)
    # Same arithmetic, different BLAS blocking: equal to the last few ulps.
    np.testing.assert_allclose(full[0], chunked[0], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(full[1], chunked[1], rtol=1e-12, atol=1e-15)


def test_low_precision_inputs_are_used_exactly(rng):
    for dt in (ml_dtypes.bfloat16, np.float16, ml_dtypes.float8_e4m3fn):
        q, k, v, cu_q, cu_k = make_batch(rng, [5], [9], 4, 2, 16, dtype=dt)
        out, lse = R.dense_attention(q, k, v, cu_q, cu_k)
        ref = global_attention(f64(q), f64(k), f64(v), cu_q, cu_k, [4], True, 0.25)
        assert_same(out, lse, *ref)


# ----------------------------------------------------------------------------- paged


@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("hq, hkv", [(2, 2), (8, 1), (16, 1)], ids=["gqa1", "gqa8", "gqa16"])
def test_paged_equals_dense(rng, page_size, layout, hq, hkv):
    qo, kv = [3, 0, 70, 1], [200, 33, 70, 0]
    q, k, v, cu_q, cu_k = make_batch(rng, qo, kv, hq, hkv, 16)
    kc, table, flat = scatter_to_pages(rng, k, cu_k, page_size, layout)
    vc = pages_like(v, cu_k, table, kc.shape, layout)
    offs = np.array([200, -1, 5, 0])
    ref = R.dense_attention(q, k, v, cu_q, cu_k, qo_offset=offs)
    out, lse = R.paged_attention(q, kc, vc, cu_q, np.array(kv), table, qo_offset=offs, kv_layout=layout)
    assert_same(out, lse, *ref)
    # the flat CSR form gives the same table (zero padded)
    t2 = R.page_table_from_csr(flat, np.array(kv), page_size)
    out2, lse2 = R.paged_attention(q, kc, vc, cu_q, np.array(kv), t2, qo_offset=offs, kv_layout=layout)
    assert_same(out2, lse2, *ref)


def test_invalid_pages_make_keys_inadmissible(rng):
    q, k, v, cu_q, cu_k = make_batch(rng, [2], [40], 2, 1, 8)
    kc, table, _ = scatter_to_pages(rng, k, cu_k, 16)
    vc = pages_like(v, cu_k, table, kc.shape)
    bad = table.copy()
    bad[0, 1] = 10_000  # keys 16..31 vanish
    out, lse = R.paged_attention(q, kc, vc, cu_q, np.array([40]), bad, causal=False)
    allowed = np.ones((2, 2, 40), dtype=bool)
    allowed[:, :, 16:32] = False
    ref = global_attention(q, k, v, cu_q, cu_k, [38], False, 8 ** -0.5, allowed=allowed)
    assert_same(out, lse, *ref)
    narrow = table[:, :2]  # the third page lies past the table width
    out, lse = R.paged_attention(q, kc, vc, cu_q, np.array([40]), narrow, causal=False)
    allowed = np.ones((2, 2, 40), dtype=bool)
    allowed[:, :, 32:] = False
    assert_same(out, lse, *global_attention(q, k, v, cu_q, cu_k, [38], False, 8 ** -0.5, allowed=allowed))


# ----------------------------------------------------------------------------- block max score


@pytest.mark.parametrize("hq, hkv", [(2, 2), (8, 1), (16, 2)], ids=["gqa1", "gqa8", "gqa8-2kv"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_block_max_score_brute_force(rng, hq, hkv, causal):
    qo, kv = [3, 0, 40, 2], [300, 9, 40, 0]
    q, k, _, cu_q, cu_k = make_batch(rng, qo, kv, hq, hkv, 16)
    offs = np.array([297, 9, 0, -1])
    ms = R.block_max_score(q, k, cu_q, cu_k, qo_offset=offs, causal=causal)
    assert ms.shape == (sum(qo), hq, 3)
    np.testing.assert_allclose(ms, brute_block_max(q, k, cu_q, cu_k, offs, causal, 3), rtol=1e-12)
    wide = R.block_max_score(q, k, cu_q, cu_k, qo_offset=offs, causal=causal, max_k_tiles=5)
    np.testing.assert_array_equal(wide[..., :3], ms)
    assert np.all(wide[..., 3:] == -np.inf)


@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_block_max_score_equals_dense(rng, page_size, layout):
    qo, kv = [2, 130], [260, 130]
    q, k, _, cu_q, cu_k = make_batch(rng, qo, kv, 8, 1, 16)
    kc, table, _ = scatter_to_pages(rng, k, cu_k, page_size, layout)
    ref = R.block_max_score(q, k, cu_q, cu_k)
    got = R.paged_block_max_score(q, kc, cu_q, np.array(kv), table, kv_layout=layout)
    np.testing.assert_array_equal(got, ref)


# ----------------------------------------------------------------------------- sparse


def random_selection(rng, total_q, heads, nblocks_per_row, width):
    """Unique ascending block ids per row, then -1 (``nblocks_per_row[i]`` candidates)."""
    sel = np.full((total_q, heads, width), -1, dtype=np.int32)
    for i in range(total_q):
        for h in range(heads):
            n = int(nblocks_per_row[i])
            c = min(n, int(rng.integers(0, width + 1)))
            sel[i, h, :c] = np.sort(rng.choice(n, size=c, replace=False)) if c else []
    return sel


def sparse_allowed(sel_kv, cu_q, cu_k, r, total_k):
    """``[total_q, Hq, total_k]`` mask of keys whose 128-key block is listed for the row."""
    total_q, hkv, _ = sel_kv.shape
    allowed = np.zeros((total_q, hkv * r, total_k), dtype=bool)
    for b in range(len(cu_q) - 1):
        for i in range(cu_q[b], cu_q[b + 1]):
            for g in range(hkv):
                for s in sel_kv[i, g]:
                    if s < 0:
                        continue
                    lo, hi = cu_k[b] + s * BLOCK, min(cu_k[b + 1], cu_k[b] + (s + 1) * BLOCK)
                    allowed[i, g * r:(g + 1) * r, lo:hi] = True
    return allowed


@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 1), (16, 1)], ids=["gqa1", "gqa8", "gqa16"])
@pytest.mark.parametrize("per_q_head", [False, True], ids=["per-kv-head", "per-q-head"])
def test_sparse_matches_masked_global_softmax(rng, hq, hkv, per_q_head):
    qo, kv = [3, 40, 1, 0], [700, 300, 129, 50]
    q, k, v, cu_q, cu_k = make_batch(rng, qo, kv, hq, hkv, 16)
    kc, table, _ = scatter_to_pages(rng, k, cu_k, BLOCK)
    vc = pages_like(v, cu_k, table, kc.shape)
    offs = np.asarray(kv) - np.asarray(qo)
    nblocks = np.concatenate([np.full(n, -(-kl // BLOCK)) for n, kl in zip(qo, kv)])
    sel = random_selection(rng, sum(qo), hkv, nblocks, 8)
    r = hq // hkv
    arg = np.repeat(sel, r, axis=1) if per_q_head else sel
    if per_q_head:  # only head g*r matters: scribble on the others
        for g in range(hkv):
            arg[:, g * r + 1:(g + 1) * r] = 99
    out, lse = R.sparse_attention(q, kc, vc, cu_q, np.array(kv), table, arg)
    ref = global_attention(q, k, v, cu_q, cu_k, offs, True, 16 ** -0.5,
                           allowed=sparse_allowed(sel, cu_q, cu_k, r, cu_k[-1]))
    assert_same(out, lse, *ref)


def test_sparse_all_blocks_equals_paged_and_skips_bad_ids(rng):
    qo, kv = [5, 2], [300, 129]
    q, k, v, cu_q, cu_k = make_batch(rng, qo, kv, 8, 1, 16)
    kc, table, _ = scatter_to_pages(rng, k, cu_k, BLOCK, extra_pages=0)
    vc = pages_like(v, cu_k, table, kc.shape)
    sel = np.full((7, 1, 8), -1, dtype=np.int32)
    sel[:5, 0, :3] = [0, 1, 2]
    sel[5:, 0, :2] = [1, 0]  # unsorted is fine
    sel[:5, 0, 3:5] = [3, 57]  # ids past the request's blocks are skipped
    sel[5:, 0, 2] = -5  # other negatives are skipped too
    ref = R.paged_attention(q, kc, vc, cu_q, np.array(kv), table)
    got = R.sparse_attention(q, kc, vc, cu_q, np.array(kv), table, sel)
    assert_same(*got, *ref)


def test_sparse_fp8_scaling(rng):
    qo, kv = [4], [260]
    q, k, v, cu_q, cu_k = make_batch(rng, qo, kv, 8, 1, 32, dtype=ml_dtypes.float8_e4m3fn)
    kc, table, _ = scatter_to_pages(rng, f64(k), cu_k, BLOCK, extra_pages=0)
    vc = pages_like(f64(v), cu_k, table, kc.shape)
    kc8, vc8 = kc.astype(ml_dtypes.float8_e4m3fn), vc.astype(ml_dtypes.float8_e4m3fn)
    sel = np.tile(np.array([0, 2, -1, -1], np.int32), (4, 1, 1))
    out, lse = R.sparse_attention(q, kc8, vc8, cu_q, np.array(kv), table, sel, k_scale=0.5, v_scale=3.0,
                                  sm_scale=0.1)
    # independent: scale q.k by k_scale * sm_scale, multiply the output by v_scale
    k_keys = np.concatenate([f64(kc8)[table[0, s]] for s in range(3)])[:260]
    v_keys = np.concatenate([f64(vc8)[table[0, s]] for s in range(3)])[:260]
    allowed = np.zeros((4, 8, 260), dtype=bool)
    allowed[:, :, 0:128] = True
    allowed[:, :, 256:260] = True
    ref = global_attention(f64(q), k_keys, v_keys, cu_q, np.array([0, 260]), [256], True, 0.05,
                           allowed=allowed, v_scale=3.0)
    assert_same(out, lse, *ref)


def test_sparse_duplicate_ids_count_twice(rng):
    q, k, v, cu_q, cu_k = make_batch(rng, [1], [256], 8, 1, 8)
    kc, table, _ = scatter_to_pages(rng, k, cu_k, BLOCK, extra_pages=0)
    vc = pages_like(v, cu_k, table, kc.shape)
    once = R.sparse_attention(q, kc, vc, cu_q, [256], table, np.array([[[0, 1, -1, -1]]], np.int32))
    twice = R.sparse_attention(q, kc, vc, cu_q, [256], table, np.array([[[0, 1, 1, -1]]], np.int32))
    assert not np.allclose(once[0], twice[0])
    # counting block 1 twice == adding log 2 to its logits
    assert np.all(twice[1] > once[1])


# ----------------------------------------------------------------------------- page tables


def test_page_table_from_csr_and_indptr():
    table = R.page_table_from_csr(np.array([7, 8, 9]), np.array([20, 0, 1]), 16)
    np.testing.assert_array_equal(table, [[7, 8], [0, 0], [9, 0]])
    assert table.dtype == np.int32
    with pytest.raises(ValueError):
        R.page_table_from_csr(np.array([7, 8, 9, 4]), np.array([20, 0, 1]), 16)
    t2 = R.page_table_from_indptr(np.array([7, 8, 9, 4]), np.array([0, 2, 2, 3]))
    np.testing.assert_array_equal(t2, [[7, 8], [-1, -1], [9, -1]])


# ----------------------------------------------------------------------------- block softmax mass


def brute_block_mass(q, k, cu_q, cu_k, offsets, causal, scale, n_tiles):
    """Per query, head and key: one masked softmax over the request's keys, summed per block."""
    total_q, hq, _ = q.shape
    r = hq // k.shape[1]
    mass = np.zeros((total_q, hq, n_tiles))
    for b in range(len(cu_q) - 1):
        for i in range(cu_q[b + 1] - cu_q[b]):
            pos = offsets[b] + i
            for h in range(hq):
                js = [j for j in range(cu_k[b + 1] - cu_k[b]) if not causal or j <= pos]
                if not js:
                    continue
                s = np.array([q[cu_q[b] + i, h] @ k[cu_k[b] + j, h // r] * scale for j in js])
                p = np.exp(s - s.max())
                p /= p.sum()
                for j, pj in zip(js, p):
                    mass[cu_q[b] + i, h, j // BLOCK] += pj
    return mass


@pytest.mark.parametrize("hq, hkv", [(2, 2), (8, 1), (4, 2)], ids=["gqa1", "gqa8", "gqa2-2kv"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_block_softmax_mass_brute_force(rng, hq, hkv, causal):
    qo, kv = [3, 0, 5, 2], [300, 9, 140, 0]
    q, k, _, cu_q, cu_k = make_batch(rng, qo, kv, hq, hkv, 8)
    q = q * 2.0  # peaked softmax: the blocks differ
    offs = np.array([297, 9, 130, -1])
    mass = R.block_softmax_mass(q, k, cu_q, cu_k, qo_offset=offs, causal=causal, sm_scale=0.7)
    assert mass.shape == (sum(qo), hq, 3) and mass.dtype == np.float64
    np.testing.assert_allclose(mass, brute_block_mass(q, k, cu_q, cu_k, offs, causal, 0.7, 3), rtol=1e-12, atol=1e-15)


def test_block_softmax_mass_rows_sum_to_one_and_causal_zeros(rng):
    qo, kv = [260, 4], [600, 3]
    q, k, _, cu_q, cu_k = make_batch(rng, qo, kv, 8, 1, 16, dtype=ml_dtypes.bfloat16)
    mass = R.block_softmax_mass(q, k, cu_q, cu_k)  # bottom-right aligned: offsets 340, -1
    assert mass.shape == (264, 8, 5)
    pos = np.concatenate([340 + np.arange(260), -1 + np.arange(4)])
    attends = pos >= 0
    np.testing.assert_allclose(mass[attends].sum(-1), 1.0, rtol=0, atol=1e-12)
    assert np.all(mass[~attends] == 0)  # position -1: no admissible key
    assert np.all(mass >= 0)
    future = np.arange(5)[None, :] > (pos[:260] // BLOCK)[:, None]  # [260, 5]: blocks past the position
    assert future.any() and np.all(mass[:260].transpose(0, 2, 1)[future] == 0)
    assert np.all(mass[:260, :, :(340 // BLOCK) + 1] > 0)  # every visible block has mass
    assert np.all(mass[260:, :, 1:] == 0)  # request 1 has one block of 3 keys
    wide = R.block_softmax_mass(q, k, cu_q, cu_k, max_k_tiles=7)
    np.testing.assert_array_equal(wide[..., :5], mass)
    assert np.all(wide[..., 5:] == 0)
    full = R.block_softmax_mass(q, k, cu_q, cu_k, causal=False)
    np.testing.assert_allclose(full.sum(-1), 1.0, rtol=0, atol=1e-12)
    assert np.all(full[:260] > 0)


def test_block_softmax_mass_is_recall_of_a_selection(rng):
    q, k, v, cu_q, cu_k = make_batch(rng, [200], [520], 8, 1, 16)
    mass = R.block_softmax_mass(q, k, cu_q, cu_k, sm_scale=0.5)
    ms = R.block_max_score(q, k, cu_q, cu_k)
    sel = R.topk_select(ms, 4, query_positions=320 + np.arange(200))
    recall = np.where(sel >= 0, np.take_along_axis(mass, np.maximum(sel, 0), axis=-1), 0).sum(-1)
    assert np.all((recall > 0) & (recall <= 1 + 1e-12))
    every = R.topk_select(ms, 8, query_positions=320 + np.arange(200))  # 5 blocks: all of them
    recall_all = np.where(every >= 0, np.take_along_axis(mass, np.maximum(every, 0), axis=-1), 0).sum(-1)
    np.testing.assert_allclose(recall_all, 1.0, rtol=0, atol=1e-12)
