"""The gather tile's launcher (``mate_cupy.msa.gather_launch``) on the CPU.

Parameter lists against the ``.cu`` signatures, the launch sequence of ``run_gather``
(recorded, nothing launched), the workspace bound, and the row-window arithmetic: a
Python model of the kernels' key and span formulas checked against the host bounds on
random request layouts.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from mate_cupy.msa import gather_launch as gl
from helpers import kernel_params

SRC = Path(gl.__file__).resolve().parent.parent / "cuda_src" / gl.SOURCE
GIB = 1 << 30
M3 = dict(num_heads_kv=4, width=16)


# ============================================================================ parameter lists


def _c_params(kernel: str) -> list:
    """(name, kind) of each parameter of ``kernel`` in attention_gather.cu (the geometry macro expanded)."""
    return kernel_params(SRC, kernel, macros=("GATHER_GEOMETRY_ARGS",))


@pytest.mark.parametrize("kernel", gl.KERNELS)
def test_kernel_params_match_the_source(kernel):
    assert list(gl.PARAMS[kernel].params) == _c_params(kernel)


# ============================================================================ the launch sequence


class _Arr:
    """An Arg stand-in: an address and a shape."""

    def __init__(self, ptr, *shape):
        self.ptr, self.shape = ptr, shape


def _call(monkeypatch, *, total_q, hkv, width, batch, max_q, max_k, nbytes=None, lse=True, csr=False):
    launches, memsets = [], []
    monkeypatch.setattr(gl, "get_kernel", lambda spec, name: name)
    monkeypatch.setattr(gl, "launch", lambda kern, grid, block, params, values, shared_mem=0, stream=0:
                        launches.append((kern, tuple(grid), tuple(block), params, tuple(values), shared_mem, stream)))
    import cupy.cuda.runtime as rt

    monkeypatch.setattr(rt, "memsetAsync", lambda ptr, value, size, stream: memsets.append((ptr, value, size, stream)))
    need = gl.workspace_bytes(total_q=total_q, num_heads_kv=hkv, width=width, batch=batch, max_seqlen_q=max_q,
                              max_seqlen_k=max_k)
    hq = 16 * hkv
    gl.run_gather(q=_Arr(0x1000, total_q, hq, 128), k=_Arr(0x2000, 9, 128, hkv, 128),
                  v=_Arr(0x3000, 9, 128, hkv, 128), out=_Arr(0x4000, total_q, hq, 128),
                  lse=_Arr(0x5000, total_q, hq) if lse else None, cu_seqlens_q=_Arr(0x6000, batch + 1),
                  qo_lens=_Arr(0x7000, batch), kv_lens=_Arr(0x8000, batch), qo_offset=_Arr(0x9000, batch),
                  page_list=_Arr(0xA000, batch * 9) if csr else _Arr(0xA000, batch, 9),
                  page_indptr=_Arr(0xB000, batch + 1) if csr else None, page_list_len=batch * 9 if csr else 9,
                  kv_block_indexes=_Arr(0xC000, total_q, hkv, width), q_strides=(hq * 128, 128),
                  k_strides=(128 * hkv * 128, hkv * 128, 128), v_strides=(128 * hkv * 128, 128, 128 * 128),
                  out_strides=(hq * 256, 128), kv_extent=9, num_heads_kv=hkv, batch=batch, max_seqlen_q=max_q,
                  max_seqlen_k=max_k, causal=True, scale_log2=0.25, dtype_code=1, num_sms=132,
                  workspace_ptr=1 << 40, workspace_nbytes=need if nbytes is None else nbytes, stream=0xABC)
    return launches, memsets, need


def test_run_gather_launches_five_kernels_per_row_window(monkeypatch):
    total_q, hkv, width = 3 * gl.window_rows(**M3) + 5, 4, 16
    launches, memsets, need = _call(monkeypatch, total_q=total_q, hkv=hkv, width=width, batch=3,
                                    max_q=total_q - 10, max_k=total_q)
    b = gl.gather_bounds(total_q, hkv, width, 3, total_q - 10, total_q)
    assert b.nbytes == need and b.windows == 4 and b.rows == gl.window_rows(**M3)
    windows = gl.row_windows(total_q, b.rows)
    assert [x[0] for x in launches] == list(gl.KERNELS) * len(windows)
    lay = {name: (off, size) for name, off, size in b.parts}
    ws = 1 << 40
    # one memset per call: the key range and the counts
    assert memsets == [(ws + lay["counters"][0], 0, lay["counters"][1], 0xABC)]
    assert lay["counters"][1] == 16 + b.keys * 4
    for n, (rb, re_) in enumerate(windows):
        group = launches[5 * n:5 * n + 5]
        for kern, grid, block, params, values, smem, stream in group:
            assert params is gl.PARAMS[kern] and stream == 0xABC
            params.pack(values)  # every value packs as its kind
            named = dict(zip(params.names, values))
            if "row_begin" in named:
                assert (named["row_begin"], named["row_end"]) == (rb, re_)
                assert named["wins"] == b.wins and named["nb_max"] == b.nb_max and named["total_q"] == total_q
                assert named["block_lists"] == 0xC000 and named["page_indptr"] == 0
        count, scan, scatter, attn, merge = group
        assert count[1] == scatter[1] == b.entry_grid and count[2] == scatter[2] == (256,)
        assert scan[1] == (1,) and scan[2] == (1024,)
        sv = dict(zip(gl.SCAN_PARAMS.names, scan[4]))
        assert (sv["n_keys"], sv["max_items"], sv["max_pairs"]) == (b.keys, b.max_items, b.max_pairs)
        assert sv["counts"] == ws + lay["counters"][0] + 16 and sv["key_range"] == ws + lay["counters"][0]
        assert attn[1] == (min(132, b.max_items),) and attn[2] == (128 * gl.WGS,) and attn[5] == gl.ATTN_SMEM
        av = dict(zip(gl.ATTN_PARAMS.names, attn[4]))
        assert av["work_counter"] == av["n_items"] + 4 == ws + lay["n_items"][0] + 4
        assert av["part_o"] == ws + lay["part_o"][0] and av["part_lse"] == ws + lay["part_lse"][0]
        assert av["max_items"] == b.max_items and av["scale_log2"] == 0.25
        assert (av["v_page_stride"], av["v_slot_stride"], av["v_head_stride"]) == (128 * hkv * 128, 128, 128 * 128)
        assert merge[1] == b.merge_grid == (min(total_q - 10, b.rows), hkv, 3) and merge[2] == (128,)
        mv = dict(zip(gl.MERGE_PARAMS.names, merge[4]))
        assert (mv["out"], mv["lse"], mv["out_tok_stride"]) == (0x4000, 0x5000, 16 * hkv * 256)


def test_run_gather_lse_none_csr_and_one_window(monkeypatch):
    launches, memsets, _ = _call(monkeypatch, total_q=300, hkv=2, width=24, batch=2, max_q=200, max_k=900,
                                 lse=False, csr=True)
    assert [x[0] for x in launches] == list(gl.KERNELS) and len(memsets) == 1
    merge = dict(zip(gl.MERGE_PARAMS.names, launches[4][4]))
    assert merge["lse"] == 0 and (merge["row_begin"], merge["row_end"]) == (0, 300)
    assert merge["page_indptr"] == 0xB000 and merge["page_list_len"] == 18


def test_run_gather_refuses_a_small_workspace(monkeypatch):
    with pytest.raises(ValueError, match="workspace must hold at least"):
        _call(monkeypatch, total_q=300, hkv=2, width=24, batch=2, max_q=200, max_k=900, nbytes=1000)


# ============================================================================ workspace bound


@pytest.mark.parametrize("total_q", [32768, 131072, 1 << 20])
def test_workspace_is_bounded_for_minimax_m3(total_q):
    args = dict(total_q=total_q, batch=1, max_seqlen_q=total_q, max_seqlen_k=total_q, **M3)
    assert gl.applies(cc=90, dtype_code=1, head_dim=128, group=16, page_size=128, sparse_decode=False, **args)
    ws = gl.workspace_bytes(**args)
    assert ws <= 2 * GIB
    assert ws <= gl.PARTIAL_BUDGET + 32 * (1 << 20)
    b = gl.gather_bounds(total_q, 4, 16, 1, total_q, total_q)
    assert b.windows == math.ceil(total_q / gl.window_rows(**M3))


def test_workspace_is_bounded_wherever_the_tile_applies():
    rng = np.random.default_rng(0)
    worst = 0
    for _ in range(3000):
        hkv, width = int(rng.integers(1, 9)), int(rng.integers(1, 65))
        batch = int(rng.choice([1, 2, 7, 64, 1000, 65535]))
        max_q = int(rng.choice([1, 100, 2048, 5000, 32768, 1 << 20]))
        total_q = int(rng.integers(max_q, max_q * min(batch, 4) + 1))
        max_k = int(rng.choice([1, 129, 32768, 1 << 20, 1 << 23]))
        args = dict(total_q=total_q, num_heads_kv=hkv, width=width, batch=batch, max_seqlen_q=max_q,
                    max_seqlen_k=max_k)
        if gl.applies(cc=90, dtype_code=0, head_dim=128, group=16, page_size=128, sparse_decode=False, **args):
            worst = max(worst, gl.workspace_bytes(**args))
    assert 0 < worst <= 2 * GIB


def test_workspace_bytes_grows_with_every_argument():
    """A workspace sized for the largest call of a plan serves every smaller one."""
    rng = np.random.default_rng(1)
    names = ("total_q", "batch", "max_seqlen_q", "max_seqlen_k")
    for _ in range(500):
        hkv, width = int(rng.integers(1, 9)), int(rng.integers(1, 65))
        big = {n: int(rng.integers(1, 40000)) for n in names}
        small = {n: int(rng.integers(1, big[n] + 1)) for n in names}
        for n in names:
            lo = dict(big, **{n: small[n]})
            assert gl.workspace_bytes(num_heads_kv=hkv, width=width, **lo) <= \
                gl.workspace_bytes(num_heads_kv=hkv, width=width, **big)


def test_workspace_layout():
    b = gl.gather_bounds(1000, 4, 16, 3, 700, 5000, 512)
    assert [n for n, _, _ in b.parts] == ["part_o", "part_lse", "counters", "cursors", "items", "n_items",
                                          "pair_tok", "pair_slot"]
    ends = [(off, off + size) for _, off, size in b.parts]
    assert all(off % gl.ALIGN == 0 for off, _ in ends)
    assert all(a[1] <= c[0] for a, c in zip(ends, ends[1:])) and ends[-1][1] <= b.nbytes
    sizes = {n: size for n, _, size in b.parts}
    assert sizes["part_o"] == 512 * 4 * 16 * 16 * 128 * 2 and sizes["part_lse"] == 512 * 4 * 16 * 16 * 4
    assert sizes["pair_tok"] == sizes["pair_slot"] == b.max_pairs * 4 == 512 * 4 * 16 * 4
    assert sizes["items"] == b.max_items * 12 and sizes["cursors"] == b.keys * 4


# ============================================================================ window arithmetic


def test_window_rows():
    assert gl.window_rows(4, 16) * 4 * 16 * gl.PARTIAL_BYTES <= gl.PARTIAL_BUDGET
    assert gl.window_rows(4, 16) % gl.WIN_ALIGN == 0 and gl.window_rows(4, 16) >= 3 * gl.MIN_WIN
    assert gl.window_rows(4, 16, budget=(gl.WIN_ALIGN + 5) * 64 * gl.PARTIAL_BYTES) == gl.WIN_ALIGN
    assert gl.window_rows(8, 64) % gl.ROW_ALIGN == 0 and gl.window_rows(8, 64) >= gl.MIN_WINDOW_ROWS
    assert gl.window_rows(8, 64, budget=255 * 512 * gl.PARTIAL_BYTES) == 0


@pytest.mark.parametrize("total_q,rows", [(1, 1), (10, 3), (4096, 4096), (4097, 4096), (100000, 7168)])
def test_row_windows_cover_the_rows_in_order(total_q, rows):
    w = gl.row_windows(total_q, rows)
    assert w[0][0] == 0 and w[-1][1] == total_q and len(w) == math.ceil(total_q / rows)
    assert all(a[1] == c[0] for a, c in zip(w, w[1:])) and all(0 < e - s <= rows for s, e in w)


def _model_window(cu, qo, kv, qoff, lists, nb_req, b, rb, re_, max_q, causal=True):
    """The count kernel's entries of row window [rb, re_) as the .cu computes them:
    {key: pairs}, and the key range each request reports."""
    batch, hkv, width = len(qo), lists.shape[1], lists.shape[2]
    n_rows, lists = lists.shape[0], lists.tolist()
    counts, ranges = {}, []
    for r in range(batch):
        start, lq = int(cu[r]), int(qo[r])
        lq = 0 if start < 0 or start > n_rows else max(0, min(lq, n_rows - start))
        if lq <= 0:
            continue
        i0, i1 = max(0, rb - start), min(lq, max_q, re_ - start)
        if i1 <= i0:
            continue
        assert i1 - i0 <= b.merge_grid[0] and (i1 - i0) * hkv * width <= b.entry_grid[0] * 256
        first = r * b.wins * hkv * b.nb_max
        end = first + ((i1 - 1) // b.win - i0 // b.win + 1) * hkv * b.nb_max
        ranges.append((first, end))
        for i in range(i0, i1):
            tok = start + i
            limit = min(kv[r], max(0, qoff[r] + i + 1)) if causal else kv[r]
            for kvh in range(hkv):
                row = lists[tok][kvh]
                for j in range(width):
                    s = int(row[j])
                    if s < 0 or s >= nb_req[r] or s * 128 >= limit or s in row[:j]:
                        continue
                    w_local = i // b.win - i0 // b.win
                    assert 0 <= w_local < b.wins
                    key = ((r * b.wins + w_local) * hkv + kvh) * b.nb_max + s
                    assert first <= key < end <= b.keys
                    counts[key] = counts.get(key, 0) + 1
    return counts, ranges


@pytest.mark.parametrize("seed", range(6))
def test_row_window_keys_pairs_and_items_stay_within_the_bounds(seed):
    """Random varlen batches (empty requests, kv longer than q, max_q below a request's
    length) with small row windows: every valid entry lands in exactly one window, its key
    and pair count within that window's bounds, its partial row within the window."""
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 6))
    qo = rng.integers(0, 3000, batch)
    qo[rng.random(batch) < 0.2] = 0
    kv = qo + rng.integers(0, 600, batch)
    cu = np.concatenate([[0], np.cumsum(qo)])
    total_q = int(cu[-1])
    if total_q == 0:
        return
    qoff = kv - qo
    max_q = int(qo.max()) if seed % 3 else max(1, int(qo.max()) - 700)
    max_k = int(kv.max())
    hkv, width = int(rng.integers(1, 3)), int(rng.integers(1, 6))
    nb_req = np.minimum(-(-kv // 128), 9999)
    lists = rng.integers(-2, max(1, -(-max_k // 128)) + 2, (total_q, hkv, width))
    rows = int(rng.choice([256, 1000, 2048, 2500]))
    b = gl.gather_bounds(total_q, hkv, width, batch, max_q, max_k, rows)
    assert b.rows == min(rows, total_q)
    seen = 0
    for rb, re_ in gl.row_windows(total_q, b.rows):
        counts, ranges = _model_window(cu, qo, kv, qoff, lists, nb_req, b, rb, re_, max_q)
        pairs = sum(counts.values())
        assert pairs <= b.max_pairs
        items = sum(-(-c // gl.CAP) for c in counts.values())
        assert items <= b.max_items
        seen += pairs
    full = gl.gather_bounds(total_q, hkv, width, batch, max_q, max_k, total_q)
    assert full.windows == 1
    counts, _ = _model_window(cu, qo, kv, qoff, lists, nb_req, full, 0, total_q, max_q)
    assert seen == sum(counts.values())  # the windows together take every entry once


@pytest.mark.parametrize("win", [2048, 3072, 7168])
def test_query_windows_per_row_window(win):
    # a row window of R rows meets at most (R - 1) // win + 2 query windows of a request
    for rows in (1, 255, 2048, 2049, 6144, 7168):
        for start in range(0, 3 * win, 389):
            for rb in range(0, 3 * win, 263):
                t = np.arange(max(rb, start), rb + rows)
                assert np.unique((t - start) // win).size <= (rows - 1) // win + 2


def test_query_window_choice():
    full = gl.window_rows(4, 16)  # MiniMax-M3: Hkv 4, 16 blocks per query
    assert full == 7168
    # ~KEY_SHARE queries per (window, KV head, block): 2048 at 256 blocks, capped by the row window
    assert gl.query_window(full, 16, 256) == 2048
    assert gl.query_window(full, 16, 1024) == full and gl.query_window(full, 16, 8192) == full
    assert gl.query_window(full, 16, 384) == 3072
    for rows in (0, 256, 1000, 1024, 5000, 7168, 1 << 16):
        for width in (1, 16, 64, 128):
            for nb in (1, 100, 256, 4096, 1 << 15):
                w = gl.query_window(rows, width, nb)
                assert w >= gl.MIN_WIN and w % gl.WIN_ALIGN == 0 and w <= max(gl.MIN_WIN, rows)
    # wins follows the chosen window; the key arrays are sized for MIN_WIN (the most keys)
    b = gl.gather_bounds(100000, 4, 16, 1, 100000, 100000, 7168)
    assert b.win == gl.query_window(7168, 16, b.nb_max) == 7168 and b.wins == 2
    assert b.keys == 5 * 4 * b.nb_max
    b = gl.gather_bounds(32768, 4, 16, 1, 32768, 32768)
    assert (b.win, b.wins, b.keys) == (2048, 5, 5 * 4 * 256)
    assert gl.gather_bounds(100000, 4, 16, 1, 1000, 100000, 7168).wins == 1  # short requests


def test_applies():
    base = dict(cc=90, dtype_code=1, head_dim=128, group=16, page_size=128, sparse_decode=False, batch=1,
                max_seqlen_q=32768, max_seqlen_k=32768, num_heads_kv=4, total_q=32768, width=16)
    assert gl.applies(**base)
    assert gl.applies(**{**base, "dtype_code": 0, "width": 128, "num_heads_kv": 8})
    assert gl.applies(**{**base, "total_q": 1 << 22, "max_seqlen_q": 1 << 22, "max_seqlen_k": 1 << 22})
    for change in (dict(cc=80), dict(dtype_code=2), dict(head_dim=64), dict(group=8), dict(page_size=64),
                   dict(sparse_decode=True), dict(batch=0), dict(batch=65536), dict(width=129), dict(width=0),
                   dict(batch=4096, max_seqlen_k=1 << 20), dict(num_heads_kv=16, width=128), dict(total_q=0)):
        assert not gl.applies(**{**base, **change}), change
