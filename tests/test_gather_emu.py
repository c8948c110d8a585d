"""The per-token gather tile's own source (cuda_src/attention_gather.cu: the count, scan,
scatter, attention and merge kernels) on the CPU SIMT emulator (tests/gather_emu) through the
real launcher (``gather_launch.run_gather``), against the float64 reference.

Small requests (lengths off the block, a one-token request, a request without queries),
repeated and out-of-range block ids, causal and not, page tables and CSR page lists, several
row windows (the window forced small), lists of 40 slots, lists as dense as a top-k selection's,
a workspace of garbage and an output poisoned with NaN.
The attention kernel's three warpgroups and its work counter run as real threads (a launch's
CTAs one after another, and in one test several at once), with cp.async
copies landing at issue or at the retiring wait. Set
MATE_CUPY_EMU_SANITIZE=1 to build the emulator with ASan/UBSan.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from helpers import assert_rel, emulator_or_skip, poison_like
from msa_cases import BF16, make_problem, offsets_of, random_selection
from mate_cupy.msa import gather_launch as gl
from mate_cupy.reference import msa as R

F16 = np.dtype(np.float16)
TOL = {BF16: 1e-2, F16: 5e-3}
LSE_TOL = 1e-4


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    """dtype -> (harness module, executable, work folder); built on first use."""
    from gather_emu import harness

    d = tmp_path_factory.mktemp("gather_emu")
    built = {}

    def get(dtype):
        code = 0 if np.dtype(dtype) == F16 else 1
        if code not in built:
            built[code] = emulator_or_skip(harness.build, d, code)
        return harness, built[code], d / "work"

    return get


def _run(emu, p, sel, *, causal=True, with_lse=True, csr=False, rows=None, monkeypatch=None, lazy=False):
    harness, exe, work = emu(p.q.dtype)
    total_q, hq, d = p.q.shape
    hkv, width, batch = p.hkv, sel.shape[2], len(p.qo)
    if rows is not None:  # row windows of `rows` rows (gather_bounds' default: window_rows)
        monkeypatch.setattr(gl, "window_rows", lambda h, w, budget=gl.PARTIAL_BUDGET: rows)
        gl.gather_bounds.cache_clear()
    out = poison_like(np, p.q.shape, p.q.dtype)
    lse = poison_like(np, (total_q, hq), np.float32) if with_lse else None
    if csr:
        counts = np.array([(p.page_table[b] >= 0).sum() for b in range(batch)])
        page_list, indptr = p.kv_indices.copy(), np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    else:
        page_list, indptr = p.page_table.copy(), None
    arrays = dict(q=p.q, k=p.k_cache, v=p.v_cache, out=out, lse=lse, cu_seqlens_q=p.cu_q, qo_lens=p.qo,
                  kv_lens=p.kv, qo_offset=(p.kv - p.qo).astype(np.int32), page_list=page_list,
                  page_indptr=indptr, kv_block_indexes=np.ascontiguousarray(sel))
    max_q, max_k = int(p.qo.max()), int(p.kv.max())
    need = gl.workspace_bytes(total_q=total_q, num_heads_kv=hkv, width=width, batch=batch, max_seqlen_q=max_q,
                              max_seqlen_k=max_k)
    workspace = np.random.default_rng(1).integers(0, 256, need, dtype=np.uint8)  # any content on entry
    try:
        launches = harness.run_gather(
            exe, work, arrays, workspace, page_list_len=page_list.shape[-1] if not csr else page_list.shape[0],
            q_strides=(hq * d, d), k_strides=(128 * hkv * d, hkv * d, d), v_strides=(128 * hkv * d, hkv * d, d),
            out_strides=(hq * d, d), kv_extent=p.k_cache.shape[0], num_heads_kv=hkv, batch=batch,
            max_seqlen_q=max_q, max_seqlen_k=max_k, causal=causal, scale_log2=d ** -0.5 * math.log2(math.e),
            dtype_code=0 if p.q.dtype == F16 else 1, num_sms=2, lazy_cp_async=lazy)
    finally:
        if rows is not None:
            monkeypatch.undo()
            gl.gather_bounds.cache_clear()
    return out, lse, launches


def _once(sel):
    """``sel`` with every repeat of an id in its row replaced by -1 (the kernels attend a block
    listed twice once; the reference would count it twice: docs/semantics.md)."""
    out = sel.copy()
    for row in out.reshape(-1, sel.shape[-1]):
        seen = set()
        for j, s in enumerate(row):
            if s in seen:
                row[j] = -1
            seen.add(s)
    return out


def _check(p, sel, out, lse, causal, what):
    ref = R.sparse_attention(p.q, p.k_cache, p.v_cache, p.cu_q, p.kv, p.page_table, _once(sel), causal=causal)
    assert not np.isnan(out.astype(np.float32)).any(), f"{what}: unwritten output"
    assert_rel(out, ref[0], TOL[np.dtype(p.q.dtype)], f"{what} out")
    if lse is not None:
        fin = np.isfinite(ref[1])
        assert np.array_equal(fin, np.isfinite(lse)), f"{what}: lse finite where the reference is"
        assert_rel(lse[fin], ref[1][fin], LSE_TOL, f"{what} lse")


@pytest.mark.slow
@pytest.mark.parametrize("dtype,lazy", [(BF16, False), (F16, False), (BF16, True)], ids=["bf16", "fp16", "bf16-lazy"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gather_tile_emulated(emu, rng, dtype, lazy, causal):
    """(lazy: cp.async copies land, and wgmma reads its shared operands and writes its
    accumulators, at the wait that retires their group, exposing a missing wait.)"""
    p = make_problem(rng, [37, 1, 0, 70], [300, 129, 5, 600], 16, 1, 128, dtype=dtype, page_size=128)
    sel = random_selection(rng, p, 4)
    sel[::5, :, -1] = sel[::5, :, 0]  # a repeated id: attended once
    sel[3::7, :, 1] = 57               # past the request
    sel[4::9, :, 2] = -3
    out, lse, launches = _run(emu, p, sel, causal=causal, lazy=lazy)
    assert launches == 5  # one row window
    _check(p, sel, out, lse, causal, f"{np.dtype(dtype).name} causal={causal}")


@pytest.mark.slow
def test_gather_tile_emulated_row_windows_csr_two_heads(emu, rng, monkeypatch):
    """Two KV heads (Hq 32), CSR page lists, no lse, row windows of 48 rows (requests straddle them)."""
    p = make_problem(rng, [60, 2, 41], [400, 200, 41], 32, 2, 128, page_size=128)
    sel = random_selection(rng, p, 6)
    out, lse, launches = _run(emu, p, sel, with_lse=False, csr=True, rows=48, monkeypatch=monkeypatch)
    assert launches == 5 * math.ceil(p.total_q / 48)
    _check(p, sel, out, None, True, "row windows")


@pytest.mark.slow
def test_gather_tile_emulated_row_windows_are_bitwise_equal(emu, rng, monkeypatch):
    """Every row-window size gives bitwise the output of one window (docs/gather.md)."""
    p = make_problem(rng, [50, 30], [260, 500], 16, 1, 128, page_size=128)
    sel = random_selection(rng, p, 5)
    one = _run(emu, p, sel)
    for rows in (32, 56):
        out, lse, launches = _run(emu, p, sel, rows=rows, monkeypatch=monkeypatch)
        assert launches == 5 * math.ceil(p.total_q / rows)
        assert np.array_equal(out.view(np.uint16), one[0].view(np.uint16)), f"rows {rows}: out"
        assert np.array_equal(lse.view(np.uint32), one[1].view(np.uint32)), f"rows {rows}: lse"
    _check(p, sel, one[0], one[1], True, "one window")


@pytest.mark.slow
def test_gather_tile_emulated_wide_lists(emu, rng):
    """Lists of 40 slots (up to 40 valid blocks a query), shuffled so that valid slots follow
    padding, and a repeated id."""
    p = make_problem(rng, [9, 3], [6000, 5200], 16, 1, 128, page_size=128)
    sel = random_selection(rng, p, 40)
    sel = np.take_along_axis(sel, rng.permuted(np.tile(np.arange(40), (p.total_q, 1, 1)), axis=2), axis=2)
    sel[::4, :, 7] = sel[::4, :, 30]  # a repeated id: attended once
    out, lse, launches = _run(emu, p, sel)
    assert launches == len(gl.KERNELS)
    assert ((sel >= 0).sum(axis=2) > 32).any(), "some row lists more than 32 valid blocks"
    _check(p, sel, out, lse, True, "wide lists")


@pytest.mark.slow
def test_gather_tile_emulated_dense_lists(emu, rng):
    """Lists as a top-k selection fills them (the reference top-4 of random scores with block 0
    and the query's own block forced): every query's entries valid, so a window's pairs come
    close to the workspace's pair bound (``max_pairs``), which a shifted pair offset would
    overrun; a long request beside a 3-token one."""
    p = make_problem(rng, [700, 3], [1500, 3], 16, 1, 128, page_size=128)
    offs = offsets_of(p)
    positions = np.concatenate([offs[b] + np.arange(p.qo[b]) for b in range(len(p.qo))])
    scores = rng.random((p.total_q, p.hkv, -(-int(p.kv.max()) // 128)))
    sel = R.topk_select(scores, 4, force_begin_blocks=1, force_end_blocks=1, query_positions=positions)
    out, lse, launches = _run(emu, p, sel)
    assert launches == len(gl.KERNELS)
    b = gl.gather_bounds(p.total_q, p.hkv, sel.shape[2], len(p.qo), int(p.qo.max()), int(p.kv.max()))
    assert (sel >= 0).sum() > 0.99 * b.max_pairs
    _check(p, sel, out, lse, True, "dense lists")


@pytest.mark.slow
def test_gather_tile_emulated_concurrent_ctas_are_bitwise_equal(emu, rng, monkeypatch):
    """Four CTAs of each launch at once (the count and scatter kernels' atomics, the attention
    kernel's work counter then interleave, so pairs land in other orders and items hold other
    queries), over three row windows and a varlen batch: bitwise the output of CTAs run one
    after another."""
    p = make_problem(rng, [50, 1, 30], [260, 40, 500], 16, 1, 128, page_size=128)
    sel = random_selection(rng, p, 5)
    one = _run(emu, p, sel, rows=32, monkeypatch=monkeypatch)
    monkeypatch.setenv("EMU_CONCURRENT_BLOCKS", "4")
    out, lse, _ = _run(emu, p, sel, rows=32, monkeypatch=monkeypatch)
    assert np.array_equal(out.view(np.uint16), one[0].view(np.uint16)), "out"
    assert np.array_equal(lse.view(np.uint32), one[1].view(np.uint32)), "lse"
    _check(p, sel, out, lse, True, "concurrent CTAs")
