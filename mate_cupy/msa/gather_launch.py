"""Launcher of the block-stationary sparse prefill, the prefill tile ``"gather"``
(``cuda_src/attention_gather.cu``; design in docs/gather.md).

For block lists chosen per query token (MSA's top-k selection): every (request, query
window, KV head, block) gathers the queries that listed the block, so each K/V block is
loaded once per window and every MMA row is a query that picked the block; the partial
outputs per (query, KV head, list slot) are then merged. A plan selects it
(``prefill_tile="gather"``); it applies on sm_90 to fp16/bf16, head dim 128, 16 query
heads per KV head, page size 128, prefill (not ``sparse_decode``).

The flattened query rows are processed in row windows of :func:`window_rows` rows, five
launches per window on the caller's stream, so the workspace holds one window's partials
(at most :data:`PARTIAL_BUDGET` bytes) plus counters and pair lists bounded by the same
rows: :func:`workspace_bytes` does not grow with the total length beyond one window.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..jit import KernelParams, address, get_kernel, launch, register
from ..jit.registry import SM90A

GATHER_TILE = "gather"
SOURCE = "attention_gather.cu"
KERNELS = ("msa_gather_count_kernel", "msa_gather_scan_kernel", "msa_gather_scatter_kernel",
           "msa_gather_attn_kernel", "msa_gather_merge_kernel")
MIN_WIN = 2048  # queries per query window of a request at least (:func:`query_window`)
WIN_ALIGN = 1024  # query windows and full row windows are multiples of this many queries
#: queries per key (query window, KV head, block) that :func:`query_window` aims for on average
KEY_SHARE = 128
CAP = 512  # queries per work item (kCap)
#: dtype code (0 fp16, 1 bf16) -> registered variant
SPECS = {code: register(SOURCE, KERNELS, only_arch=SM90A, GATHER_DTYPE=code, GATHER_CAP=CAP)
         for code in (0, 1)}
WGS = 3  # warpgroups of the attention kernel (kWGs)
D, BLOCK, GROUP = 128, 128, 16
ATTN_SMEM = 2 * BLOCK * D * 2 + 2 * WGS * 64 * D * 2 + 1024
MAX_KEYS = 1 << 20  # keys (request x query window x KV head x block) of one row window: one scan CTA
MAX_WIDTH = 128  # list slots per (query, KV head) the merge handles (kMaxWidth)
MAX_GRID_YZ = 65535
#: bytes of the partials of one (query, KV head, list slot): fp16 O / l and the lse of 16 heads
PARTIAL_BYTES = GROUP * D * 2 + GROUP * 4
#: bytes of one row window's partials at most (the rest of the workspace is a few MB)
PARTIAL_BUDGET = 15 << 27  # 1.875 GiB
MIN_WINDOW_ROWS = 256  # below this many rows per window the gather tile does not apply
ROW_ALIGN = 256
ALIGN = 256

_GEOMETRY = (("block_lists", "ptr"), ("cu_seqlens_q", "ptr"), ("qo_lens", "ptr"), ("kv_lens", "ptr"),
             ("qo_offset", "ptr"), ("page_list", "ptr"), ("page_indptr", "ptr"), ("page_list_len", "i32"),
             ("kv_extent", "i32"), ("total_q", "i32"), ("hkv", "i32"), ("width", "i32"), ("causal", "i32"),
             ("max_q", "i32"), ("win", "i32"), ("wins", "i32"), ("nb_max", "i32"), ("row_begin", "i32"), ("row_end", "i32"))
COUNT_PARAMS = KernelParams(_GEOMETRY + (("counts", "ptr"), ("key_range", "ptr")))
SCAN_PARAMS = KernelParams((("counts", "ptr"), ("key_range", "ptr"), ("cursors", "ptr"), ("items", "ptr"),
                            ("n_items", "ptr"), ("n_keys", "i32"), ("max_items", "i32"), ("max_pairs", "i32")))
SCATTER_PARAMS = KernelParams(_GEOMETRY + (("cursors", "ptr"), ("pair_tok", "ptr"), ("pair_slot", "ptr"),
                                           ("max_pairs", "i32")))
ATTN_PARAMS = KernelParams(_GEOMETRY + (
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("q_tok_stride", "i64"), ("q_head_stride", "i64"),
    ("k_page_stride", "i64"), ("k_slot_stride", "i64"), ("k_head_stride", "i64"), ("v_page_stride", "i64"),
    ("v_slot_stride", "i64"), ("v_head_stride", "i64"), ("items", "ptr"), ("n_items", "ptr"),
    ("work_counter", "ptr"), ("max_items", "i32"), ("pair_tok", "ptr"), ("pair_slot", "ptr"), ("part_o", "ptr"),
    ("part_lse", "ptr"), ("scale_log2", "f32")))
MERGE_PARAMS = KernelParams(_GEOMETRY + (("part_o", "ptr"), ("part_lse", "ptr"), ("out", "ptr"), ("lse", "ptr"),
                                         ("out_tok_stride", "i64"), ("out_head_stride", "i64")))
#: kernel name -> its parameter list
PARAMS = dict(zip(KERNELS, (COUNT_PARAMS, SCAN_PARAMS, SCATTER_PARAMS, ATTN_PARAMS, MERGE_PARAMS)))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def window_rows(num_heads_kv: int, width: int, budget: int = PARTIAL_BUDGET) -> int:
    """Rows of a full row window: the most whose partials fit ``budget`` bytes, rounded down to
    a multiple of :data:`WIN_ALIGN` when at least that many fit, else to a multiple of
    :data:`ROW_ALIGN` (0 when not even that many fit)."""
    rows = budget // (num_heads_kv * width * PARTIAL_BYTES)
    align = WIN_ALIGN if rows >= WIN_ALIGN else ROW_ALIGN
    return rows // align * align


def query_window(full_rows: int, width: int, nb_max: int) -> int:
    """Queries per query window of a request: a key (query window, KV head, block) is loaded
    once per window, so the window aims at :data:`KEY_SHARE` queries per key on average
    (``win * width / nb_max``: ``width`` blocks per query spread over ``nb_max``), in multiples
    of :data:`WIN_ALIGN`, at least :data:`MIN_WIN` (the window's Q rows stay in L2) and at most
    a full row window (``full_rows``; then a batch-1 request's query windows are its row
    windows)."""
    want = _cdiv(_cdiv(KEY_SHARE * nb_max, max(1, width)), WIN_ALIGN) * WIN_ALIGN
    return max(MIN_WIN, min(want, full_rows // WIN_ALIGN * WIN_ALIGN))


def row_windows(total_q: int, rows: int) -> tuple:
    """The row windows ``((row_begin, row_end), ...)`` covering ``[0, total_q)``, ``rows`` each
    (the last one shorter)."""
    return tuple((b, min(b + rows, total_q)) for b in range(0, total_q, rows))


@dataclass(frozen=True)
class GatherBounds:
    """Sizes of one call, every one bounded by one row window's rows.

    ``rows`` rows per window (``windows`` of them); query windows of ``win`` queries, of which
    one row window touches at most ``wins`` per request; ``keys`` bounds the key space
    ``batch x wins x hkv x nb_max`` for any window of at least :data:`MIN_WIN` queries (so the
    workspace does not depend on ``win``); ``max_pairs`` valid
    entries and ``max_items`` work items of a window; ``parts`` the workspace layout
    ``((name, byte offset, bytes), ...)`` (offsets 256-aligned), ``nbytes`` its total.
    """

    rows: int
    windows: int
    win: int
    wins: int
    nb_max: int
    keys: int
    max_pairs: int
    max_items: int
    entry_grid: tuple  # count / scatter: (entry CTAs per request, batch)
    merge_grid: tuple  # (queries per request, KV heads, batch)
    parts: tuple
    nbytes: int


@lru_cache(maxsize=256)
def gather_bounds(total_q: int, num_heads_kv: int, width: int, batch: int, max_seqlen_q: int,
                  max_seqlen_k: int, rows: int | None = None) -> GatherBounds:
    """The :class:`GatherBounds` of a call, with row windows of ``rows`` rows
    (default :func:`window_rows`; fewer when ``total_q`` is smaller)."""
    hkv = int(num_heads_kv)
    full = window_rows(hkv, width) if rows is None else int(rows)
    rows = max(1, min(int(total_q), full))
    q_rows = max(1, min(int(max_seqlen_q), rows))  # queries of one request in one window
    nb_max = max(1, _cdiv(max_seqlen_k, BLOCK))
    win = query_window(full, width, nb_max)

    def wins_of(w):  # query windows of w queries of a request that one row window touches
        return max(1, min(_cdiv(max_seqlen_q, w), (rows - 1) // w + 2))

    wins = wins_of(win)
    keys = batch * wins_of(MIN_WIN) * hkv * nb_max  # non-increasing in win: sized for MIN_WIN
    max_pairs = min(rows, batch * max_seqlen_q) * hkv * width
    max_items = max(1, min(_cdiv(max_pairs, CAP) + min(keys, max_pairs), 2**31 - 1))
    slots = rows * hkv * width * GROUP
    sizes = (("part_o", slots * D * 2), ("part_lse", slots * 4),
             ("counters", 16 + keys * 4),  # key_range [2] (+ pad), then counts [keys]: zeroed per call
             ("cursors", keys * 4), ("items", max_items * 12), ("n_items", 12),
             ("pair_tok", max_pairs * 4), ("pair_slot", max_pairs * 4))
    parts, off = [], 0
    for name, size in sizes:
        parts.append((name, off, size))
        off += _cdiv(size, ALIGN) * ALIGN
    return GatherBounds(rows=rows, windows=_cdiv(total_q, rows), win=win, wins=wins, nb_max=nb_max, keys=keys,
                        max_pairs=max_pairs, max_items=max_items,
                        entry_grid=(_cdiv(q_rows * hkv * width, 256), batch), merge_grid=(q_rows, hkv, batch),
                        parts=tuple(parts), nbytes=off)


def applies(*, cc: int, dtype_code: int, head_dim: int, group: int, page_size: int, sparse_decode: bool,
            batch: int, max_seqlen_q: int, max_seqlen_k: int, num_heads_kv: int, total_q: int,
            width: int) -> bool:
    """Whether the gather tile runs this call (else the default tile does)."""
    if cc != 90 or dtype_code not in (0, 1) or head_dim != D or group != GROUP or page_size != BLOCK:
        return False
    if sparse_decode or not 0 < batch <= MAX_GRID_YZ or max_seqlen_q <= 0 or total_q <= 0:
        return False
    if not 0 < width <= MAX_WIDTH or not 0 < num_heads_kv <= MAX_GRID_YZ:
        return False
    if window_rows(num_heads_kv, width) < MIN_WINDOW_ROWS:
        return False
    return gather_bounds(total_q, num_heads_kv, width, batch, max_seqlen_q, max_seqlen_k).keys <= MAX_KEYS


def workspace_bytes(*, total_q: int, num_heads_kv: int, width: int, batch: int, max_seqlen_q: int,
                    max_seqlen_k: int) -> int:
    """Bytes of the workspace :func:`run_gather` needs (non-decreasing in every argument;
    at most :data:`PARTIAL_BUDGET` plus a few MB wherever :func:`applies` holds)."""
    return gather_bounds(total_q, num_heads_kv, width, batch, max_seqlen_q, max_seqlen_k).nbytes


def run_gather(*, q, k, v, out, lse, cu_seqlens_q, qo_lens, kv_lens, qo_offset, page_list, page_indptr,
               page_list_len: int, kv_block_indexes, q_strides, k_strides, v_strides, out_strides,
               kv_extent: int, num_heads_kv: int, batch: int, max_seqlen_q: int, max_seqlen_k: int,
               causal: bool, scale_log2: float, dtype_code: int, num_sms: int, workspace_ptr: int,
               workspace_nbytes: int, stream: int) -> None:
    """Launch the gather kernels on ``stream`` (arguments checked by the caller): zero the
    counters, then per row window count, scan, scatter, attend and merge.

    q [total_q, Hq, 128] (strides ``q_strides`` (token, head) in elements); k/v paged, page
    size 128, strides (page, slot, head); out [total_q, Hq, 128] (``out_strides``); lse
    [total_q, Hq] float32 or None; kv_block_indexes [total_q, Hkv, W] int32 contiguous;
    page_list a page table [B, page_list_len] (``page_indptr`` None) or CSR ids with
    ``page_indptr`` [B + 1]. Array arguments are ``Arg``s (or anything with ``.ptr``).
    ``workspace_ptr``: at least :func:`workspace_bytes` bytes, 16-byte aligned, any content
    (its counters are zeroed here, on ``stream``). No allocation, no host read of device data.
    """
    from cupy.cuda import runtime

    total_q, hkv, width = int(q.shape[0]), int(num_heads_kv), int(kv_block_indexes.shape[2])
    b = gather_bounds(total_q, hkv, width, int(batch), int(max_seqlen_q), int(max_seqlen_k))
    if workspace_nbytes < b.nbytes:
        raise ValueError(f"workspace must hold at least {b.nbytes} bytes for the gather tile, got {workspace_nbytes}")
    ws = int(workspace_ptr)
    # (in the order of GatherBounds.parts)
    part_o, part_lse, counters, cursors, items, n_items, pair_tok, pair_slot = (ws + off for _, off, _ in b.parts)
    counters_bytes = b.parts[2][2]
    key_range, counts = counters, counters + 16
    work_counter = n_items + 4  # n_items[1]
    geo = (address(kv_block_indexes), address(cu_seqlens_q), address(qo_lens), address(kv_lens),
           address(qo_offset), address(page_list), address(page_indptr), int(page_list_len), int(kv_extent),
           total_q, hkv, width, 1 if causal else 0, int(max_seqlen_q), b.win, b.wins, b.nb_max)
    count_tail = (counts, key_range)
    scan_values = (counts, key_range, cursors, items, n_items, b.keys, b.max_items, b.max_pairs)
    scatter_tail = (cursors, pair_tok, pair_slot, b.max_pairs)
    attn_tail = (address(q), address(k), address(v), int(q_strides[0]), int(q_strides[1]), int(k_strides[0]),
                 int(k_strides[1]), int(k_strides[2]), int(v_strides[0]), int(v_strides[1]), int(v_strides[2]),
                 items, n_items, work_counter, b.max_items, pair_tok, pair_slot, part_o, part_lse, float(scale_log2))
    merge_tail = (part_o, part_lse, address(out), address(lse), int(out_strides[0]), int(out_strides[1]))
    spec = SPECS[int(dtype_code)]
    count_k, scan_k, scatter_k, attn_k, merge_k = (get_kernel(spec, name) for name in KERNELS)
    attn_grid = (max(1, min(b.max_items, int(num_sms))),)  # persistent: one CTA per SM

    runtime.memsetAsync(counters, 0, counters_bytes, stream)
    for row_begin, row_end in row_windows(total_q, b.rows):
        g = geo + (row_begin, row_end)
        launch(count_k, b.entry_grid, (256,), COUNT_PARAMS, g + count_tail, stream=stream)
        launch(scan_k, (1,), (1024,), SCAN_PARAMS, scan_values, stream=stream)
        launch(scatter_k, b.entry_grid, (256,), SCATTER_PARAMS, g + scatter_tail, stream=stream)
        launch(attn_k, attn_grid, (128 * WGS,), ATTN_PARAMS, g + attn_tail, shared_mem=ATTN_SMEM, stream=stream)
        launch(merge_k, b.merge_grid, (128,), MERGE_PARAMS, g + merge_tail, stream=stream)
