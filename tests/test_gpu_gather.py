"""The gather prefill tile (``prefill_tile="gather"``) over several row windows, through
the public API, against the float64 reference (``-m gpu``).

Every case spans more than one row window (``gather_launch.window_rows``), with requests
that straddle window boundaries; outputs are poisoned before every call and each plan runs
twice, so counters left in the workspace by one call cannot leak into the next. The
launches are recorded to check that the gather kernels ran, once per window.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import assert_rel, rel_err, to_f64
from msa_cases import BF16, make_problem, random_selection
from test_gpu_attention import _corrupt
from test_msa_gpu import dev, poisoned

import mate_cupy as mc
from mate_cupy.msa import gather_launch as gl
from mate_cupy.reference import msa as R

pytestmark = pytest.mark.gpu

F16 = np.dtype(np.float16)
TOL = {BF16: 1e-2, F16: 5e-3}
LSE_TOL = 1e-4


def _spy(monkeypatch):
    """Names of the gather kernels launched."""
    names = []
    real = gl.launch

    def spy(kernel, grid, block, params, values, shared_mem=0, stream=0):
        names.append(kernel.name)
        real(kernel, grid, block, params, values, shared_mem=shared_mem, stream=stream)

    monkeypatch.setattr(gl, "launch", spy)
    return names


def _windows(p, width):
    rows = min(p.total_q, gl.window_rows(p.hkv, width))
    return math.ceil(p.total_q / rows)


def _run(p, sel, *, tile="gather", causal=True, with_lse=True):
    hq = p.q.shape[1]
    info = mc.sparse_msa_plan(p.qo, p.kv, hq, p.hkv, page_size=128, kv_block_num=sel.shape[2], causal=causal,
                              prefill_tile=tile, device=0)
    outs = []
    for _ in range(2):  # the second call reuses the plan's workspace
        out = poisoned(p.q.shape, p.q.dtype)
        lse = poisoned((p.total_q, hq), np.float32) if with_lse else None
        mc.sparse_msa(dev(p.q), dev(p.k_cache), dev(p.v_cache), info, kv_indices=dev(p.kv_indices),
                      kv_block_indexes=dev(sel), out=out, lse=lse)
        outs.append((out, lse))
    return outs


def _ref(p, sel, causal=True):
    return R.sparse_attention(p.q, p.k_cache, p.v_cache, p.cu_q, p.kv, p.page_table, sel, causal=causal,
                              kv_layout=p.layout)


def _check(outs, ref, dtype, what):
    for n, (out, lse) in enumerate(outs):
        assert_rel(out, ref[0], TOL[np.dtype(dtype)], f"{what} call {n} out")
        if lse is not None:
            assert_rel(lse, ref[1], LSE_TOL, f"{what} call {n} lse")


def test_minimax_m3_shape_two_row_windows(rng, monkeypatch):
    """Hq 64, Hkv 4, 16 blocks per query (MiniMax-M3): two requests, the second straddling
    the row-window boundary; block 0 in every list, so its queries split into several items."""
    rows = gl.window_rows(4, 16)
    p = make_problem(rng, [rows - 3100, 3600], [rows - 3000, 3800], 64, 4, 128, page_size=128)
    sel = random_selection(rng, p, 16)
    sel[:, :, 0] = 0  # (ascending lists: slot 0 holds the smallest id, so this adds no repeat)
    names = _spy(monkeypatch)
    outs = _run(p, sel)
    assert _windows(p, 16) == 2
    assert names == list(gl.KERNELS) * 2 * 2  # two windows, two calls
    _check(outs, _ref(p, sel), BF16, "gather M3 two windows")


@pytest.mark.parametrize("dtype,with_lse", [(BF16, True), (F16, False)], ids=["bf16", "fp16-no-lse"])
def test_many_row_windows_varlen_invalid_ids(rng, monkeypatch, dtype, with_lse):
    """Hkv 8, 64 slots (a window of a few hundred rows): an empty request, a single token,
    requests across several windows, ids that are -1, past the request, far out of range or negative."""
    p = make_problem(rng, [700, 1, 2500, 0, 900], [900, 1, 2600, 5, 1000], 128, 8, 128, dtype=dtype,
                     page_size=128)
    sel = _corrupt(rng, random_selection(rng, p, 64), p)
    names = _spy(monkeypatch)
    outs = _run(p, sel, with_lse=with_lse)
    n_win = _windows(p, 64)
    assert n_win >= 4
    assert names == list(gl.KERNELS) * n_win * 2
    _check(outs, _ref(p, sel), dtype, f"gather {n_win} windows")


def test_non_causal_row_windows(rng, monkeypatch):
    p = make_problem(rng, [2100, 600], [2300, 700], 128, 8, 128, page_size=128, layout="HND")
    sel = random_selection(rng, p, 32)
    names = _spy(monkeypatch)
    outs = _run(p, sel, causal=False)
    n_win = _windows(p, 32)
    assert n_win >= 2 and names == list(gl.KERNELS) * n_win * 2
    _check(outs, _ref(p, sel, causal=False), BF16, "gather non-causal")


def test_repeated_ids_match_the_query_tile(rng, monkeypatch):
    """A block listed twice (invalid input) counts once, as in the query-tile kernel."""
    p = make_problem(rng, [1000, 700], [1200, 700], 128, 8, 128, page_size=128)
    sel = random_selection(rng, p, 64)
    sel[::7, :, 1] = sel[::7, :, 0]
    names = _spy(monkeypatch)
    (out_g, lse_g), _ = _run(p, sel)
    assert names
    (out_d, lse_d), _ = _run(p, sel, tile="query")
    assert rel_err(to_f64(out_g), to_f64(out_d)) <= TOL[BF16]
    lse_g, lse_d = to_f64(lse_g), to_f64(lse_d)
    fin = np.isfinite(lse_d)
    assert np.array_equal(np.isfinite(lse_g), fin) and np.max(np.abs(lse_g[fin] - lse_d[fin])) <= 1e-3


def test_query_window_size_does_not_change_the_output(rng):
    """A request longer than a row window under non-default query windows (3072 and 7168
    queries; the default here is 2048): the output and lse are bitwise those of the default
    window (each (query, slot) partial is computed by the same instructions whatever work item
    holds it), which match the reference."""
    p = make_problem(rng, [9000, 1500], [9100, 1600], 64, 4, 128, page_size=128)
    sel = random_selection(rng, p, 16)
    sel[:, :, 0] = 0
    assert gl.gather_bounds(p.total_q, 4, 16, 2, 9000, 9100).win == 2048
    base = _run(p, sel)
    real = gl.query_window
    for win in (3072, 7168):
        gl.query_window = lambda full_rows, width, nb_max, win=win: win
        gl.gather_bounds.cache_clear()
        try:
            assert gl.gather_bounds(p.total_q, 4, 16, 2, 9000, 9100).win == win
            outs = _run(p, sel)
        finally:
            gl.query_window = real
            gl.gather_bounds.cache_clear()
        for (o, l), (ob, lb) in zip(outs, base):
            assert np.array_equal(to_f64(o), to_f64(ob)) and np.array_equal(to_f64(l), to_f64(lb)), win
    _check(base, _ref(p, sel), BF16, "gather, default query window")
