"""Launchers for the MSA index kernels (``cuda_src/msa_index.cu``).

* :func:`run_max_score`: per-128-key-block max of raw ``q . k`` (SPEC section 3),
  dense or paged K, causal with per-request offsets, GQA, D in {64, 128, 256},
  float16/bfloat16 inputs, float32 ``max_score [total_q, Hq, NT]``.
* :func:`run_topk_select`: exact top-k block selection (SPEC section 4) over
  ``max_score [total_q, Hq, NT]`` into int32 ``[total_q, Hq, W]``.

Both take CuPy arrays already validated by the interface, launch on ``stream``
(the caller's), never synchronise and never allocate. Variants are registered at
import so ``compile_all`` builds every one of them without a GPU. Design notes:
``docs/index_kernels.md``.
"""
from __future__ import annotations

import math

import numpy as np

from .._device import device_info
from .._interop import BFLOAT16, FLOAT16, FLOAT32, INT32, INT64, dtype_name
from .._launch_cache import launch
from ..jit import get_kernel, register

SOURCE = "msa_index.cu"
BLOCK = 128            # keys per max-score block
MAX_TILES = 12288      # NT < MAX_TILES
MAX_WIDTH = 64         # W <= MAX_WIDTH

# ----------------------------------------------------------------------------- variants

_CTYPE = {FLOAT16: "half_t", BFLOAT16: "bf16_t"}
MAX_SCORE_HEAD_DIMS = (64, 128, 256)
_MS_WARPS = (4, 8)
MMA_KINDS = ("mma", "wgmma", "mma32")   # kMmaSync, kWgmma, kMmaSync32 (mma.sync, 32 rows per warp)

# Top-k: (warps per row, scores per thread). One warp per row up to NT 1024, a CTA beyond.
_TOPK_WARP_SHAPES = ((1, 8), (1, 32))
_TOPK_CTA_WARPS = (2, 4, 8, 12)
_TOPK_NPT = 32
_TOPK_WARP_CANDIDATES = 256   # kTopkWarpCandidates
_TOPK_CTA_CANDIDATES = 2048   # kTopkCtaCandidates
_TOPK_ROWS_PER_WARP_CTA = 8   # kTopkRowsPerWarpCta
_MS_STASH = 16                 # kMsStash

# Streaming top-k (one warp per row, chunks of 32 * NPT scores), k <= STREAM_MAX_SLOTS.
STREAM_NPT = (8, 16, 32)
STREAM_MAX_SLOTS = 16          # auto choice; the kernel itself is exact for k <= 32
STREAM_KERNEL_MAX_SLOTS = 32
STREAM_MIN_ROWS = 1024         # rows of more than 1024 scores: below this many rows a CTA per row wins


def _b(x: bool) -> str:
    return "true" if x else "false"


def _topk_name(nw: int, npt: int, vec: int, top2: bool) -> str:
    return f"msa_topk_select_kernel<{nw}, {npt}, {vec}, {_b(top2)}>"


def _stream_name(npt: int, vec: int) -> str:
    return f"msa_topk_stream_kernel<{npt}, {vec}>"


def stream_rows_per_cta(npt: int) -> int:
    """Rows (warps) per CTA of ``msa_topk_stream_kernel`` (mirrors ``StreamRows``)."""
    return 4 if npt > 16 else 8


def _max_score_name(dtype, d: int, nwarps: int, stages: int, mma: str) -> str:
    return f"msa_block_max_score_kernel<{_CTYPE[dtype]}, {d}, {nwarps}, {stages}, {MMA_KINDS.index(mma)}>"


TOPK_SPECS = {}
for _nw, _npt in _TOPK_WARP_SHAPES + tuple((w, _TOPK_NPT) for w in _TOPK_CTA_WARPS):
    for _vec in (1, 4):
        for _top2 in ((False, True) if 2 * MAX_WIDTH > 32 * _nw else (False,)):
            TOPK_SPECS[(_nw, _npt, _vec, _top2)] = register(SOURCE, _topk_name(_nw, _npt, _vec, _top2))

STREAM_SPECS = {(npt, vec): register(SOURCE, _stream_name(npt, vec)) for npt in STREAM_NPT for vec in (1, 4)}

def _max_score_configs(d: int):
    """``(nwarps, stages, mma)`` variants built for head dim ``d``."""
    out = [(nw, st, "mma") for nw in _MS_WARPS for st in (2, 3)]
    out += [(nw, 2, "wgmma") for nw in _MS_WARPS]
    if d <= 128:
        out.append((8, 3, "wgmma"))
        out += [(4, 2, "mma32"), (4, 3, "mma32")]  # (Q of 32 rows in registers: D <= 128)
    return out


MAX_SCORE_SPECS = {
    (dt, d) + cfg: register(SOURCE, _max_score_name(dt, d, *cfg), min_sm=90 if cfg[2] == "wgmma" else 80)
    for dt in (FLOAT16, BFLOAT16)
    for d in MAX_SCORE_HEAD_DIMS
    for cfg in _max_score_configs(d)
}


def max_score_smem_bytes(d: int, nwarps: int, stages: int = 2, mma: str = "mma", elem_bytes: int = 2) -> int:
    """Dynamic shared memory of ``msa_block_max_score_kernel`` (mirrors ``MaxScoreTile``)."""
    bm = (32 if mma == "mma32" else 16) * nwarps
    k_tile = BLOCK * d * elem_bytes
    k_bytes = stages * k_tile
    q_bytes = bm * d * elem_bytes
    stash = bm * (_MS_STASH + 1) * 4
    if mma == "wgmma":
        end = k_bytes + q_bytes + stash
    elif stages == 3:
        end = k_bytes + stash
    else:
        end = k_bytes + max(q_bytes, stash)
    return end + stages * BLOCK + (1024 if mma == "wgmma" else 0)


# Default max-score MMA path for requests of more than 64 packed rows: "mma" (mma.sync, 16
# rows per warp, 8 warps), "mma32" (32 rows per warp, 4 warps; D <= 128) or "wgmma" (sm_90
# only, 8 warps). The others fall back to "mma" where they do not apply.
MAX_SCORE_DEFAULT_MMA = "wgmma"  # H200 sweep: 1.45 ms vs 2.08 (mma w8 s3) at S8192 Hq64 Hkv8


def max_score_variant(rows: int, d: int, cc=None) -> tuple:
    """Default ``(nwarps, stages, mma)`` for requests of up to ``rows`` packed rows.

    4 warps of mma.sync (64 rows per CTA) when ``rows <= 64`` (decode-like batches), else
    ``MAX_SCORE_DEFAULT_MMA``; a three-stage K ring for mma.sync, two for wgmma.
    ``cc``: compute capability as an int (e.g. 90), or a callable giving it (only asked
    when wgmma is the default)."""
    if rows <= 64:
        return 4, 3, "mma"
    kind = MAX_SCORE_DEFAULT_MMA
    if kind == "wgmma" and (cc() if callable(cc) else cc) != 90:
        kind = "mma"
    if kind == "mma32" and d > 128:
        kind = "mma"
    return {"mma": (8, 3, "mma"), "mma32": (4, 3, "mma32"), "wgmma": (8, 2, "wgmma")}[kind]


def topk_variant(nt: int, slots: int, vec_ok: bool) -> tuple:
    """``(warps per row, scores per thread, vector width, top2)`` for rows of ``nt`` scores.

    ``slots`` is the number of freely chosen blocks ``K = W - begin - end``; ``top2``
    (two maxima per thread for the lower bound) is used when ``2 K`` exceeds the
    group size, so the bound stays tight.
    """
    if nt <= 256:
        nw, npt = 1, 8
    elif nt <= 1024:
        nw, npt = 1, 32
    else:
        need = math.ceil(nt / (32 * _TOPK_NPT))
        nw = next(w for w in _TOPK_CTA_WARPS if w >= need)
        npt = _TOPK_NPT
    top2 = 2 * slots > 32 * nw
    return nw, npt, 4 if vec_ok else 1, top2


def stream_npt(nt: int) -> int:
    """Scores per lane per chunk of the streaming kernel for rows of ``nt`` scores: one
    chunk when ``nt <= 1024`` (NPT 32 runs 24 warps per SM), else chunks of 512 (NPT 16:
    64 registers, 32 warps per SM, so 4224 rows run in one wave on 132 SMs)."""
    if nt <= 256:
        return 8
    if nt <= 512 or nt > 1024:
        return 16
    return 32


def topk_algorithm(rows: int, nt: int, slots: int) -> str:
    """``"stream"`` (one warp per row, streaming) or ``"block"`` (``msa_topk_select_kernel``:
    a warp per row up to 1024 scores, else a CTA per row)."""
    if slots > STREAM_MAX_SLOTS:
        return "block"
    if nt <= 1024 or rows >= STREAM_MIN_ROWS:
        return "stream"
    return "block"


def max_score_splits(ctas: int, nt: int, sm_count: int, min_tiles: int = 4) -> tuple:
    """``(splits, tiles_per_split)``: spread the ``nt`` output blocks of each (rows, head)
    tile over several CTAs when ``ctas`` alone cannot fill the GPU (decode-like batches).
    Block maxima need no merge, so a split only narrows a CTA's block range."""
    target = 4 * sm_count
    splits = 1
    if 0 < ctas < target:
        splits = max(1, min(-(-target // ctas), nt // min_tiles, 65535))
    per = -(-nt // splits)
    return -(-nt // per), per


def _device_info() -> tuple:
    """(SM count, compute capability as an int, e.g. 90) of the current device."""
    return device_info()


def _sm_count() -> int:
    return _device_info()[0]


def _compute_capability() -> int:
    return _device_info()[1]


# ----------------------------------------------------------------------------- helpers


def _elem_strides(a) -> tuple:
    return tuple(s // a.itemsize for s in a.strides)


def _need_int32(name: str, a, length=None) -> None:
    if a is None:
        return
    if np.dtype(a.dtype) != INT32:
        raise TypeError(f"{name} must be int32, got {dtype_name(a.dtype)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be contiguous")
    if length is not None and (a.ndim != 1 or a.shape[0] < length):
        raise ValueError(f"{name} must be a vector of at least {length} entries, got shape {tuple(a.shape)}")


def _ptr(a):
    return np.uintp(0) if a is None else a


# ----------------------------------------------------------------------------- max score


def run_max_score(q, k, max_score, *, cu_seqlens_q, qo_lens, kv_lens, qo_offset,
                  cu_seqlens_k=None, page_table=None, kv_indices=None, kv_page_indptr=None,
                  kv_layout="NHD", page_size=0, max_seqlen_q, causal, stream=None, variant=None) -> None:
    """``max_score[i, h, t] = max`` of ``q[i, h] . k[j, h // r]`` over admissible keys of block ``t``.

    q ``[total_q, Hq, D]`` float16/bfloat16, D in {64, 128, 256}, D contiguous and
    16-byte aligned rows. k: dense ``[total_k, Hkv, D]`` (``page_size == 0``,
    ``cu_seqlens_k [B+1]``) or paged ``[P, page_size, Hkv, D]`` (NHD) /
    ``[P, Hkv, page_size, D]`` (HND) through ``page_table [B, max_pages]`` or
    ``kv_indices`` + ``kv_page_indptr [B+1]``; page_size a power of two.
    max_score float32 ``[total_q, Hq, NT]`` contiguous: every element of the rows of
    the first ``max_seqlen_q`` queries of each request is written (``-inf`` where a
    block has no admissible key, and for ``t >= ceil(kv_len / 128)``). Keys of page
    ids outside ``[0, P)`` or past the table are not admissible. int32 metadata
    vectors ``[B]``: ``qo_lens``, ``kv_lens``, ``qo_offset``; ``cu_seqlens_q [B+1]``.
    ``variant``: ``(nwarps, stages, mma)`` to override :func:`max_score_variant` (tuning).
    """
    qdt = np.dtype(q.dtype)
    if qdt not in _CTYPE:
        raise TypeError(f"max score needs float16 or bfloat16 q, got {dtype_name(qdt)}")
    if np.dtype(k.dtype) != qdt:
        raise TypeError(f"k must have q's dtype {dtype_name(qdt)}, got {dtype_name(k.dtype)}")
    if q.ndim != 3:
        raise ValueError(f"q must be [total_q, Hq, D], got shape {tuple(q.shape)}")
    total_q, hq, d = (int(x) for x in q.shape)
    if d not in MAX_SCORE_HEAD_DIMS:
        raise NotImplementedError(f"max score supports head dims {MAX_SCORE_HEAD_DIMS}, got D={d}")
    if np.dtype(max_score.dtype) != FLOAT32 or max_score.ndim != 3 or tuple(max_score.shape[:2]) != (total_q, hq):
        raise ValueError(
            f"max_score must be float32 [total_q={total_q}, Hq={hq}, NT], got "
            f"{dtype_name(max_score.dtype)} {tuple(max_score.shape)}"
        )
    if not max_score.flags.c_contiguous:
        raise ValueError("max_score must be contiguous")
    nt = int(max_score.shape[2])
    batch = int(qo_lens.shape[0])
    for name, a, n in (("cu_seqlens_q", cu_seqlens_q, batch + 1), ("qo_lens", qo_lens, batch),
                       ("kv_lens", kv_lens, batch), ("qo_offset", qo_offset, batch)):
        if a is None:
            raise ValueError(f"{name} is required")
        _need_int32(name, a, n)

    qs = _elem_strides(q)
    if qs[2] != 1 or qs[0] % 8 or qs[1] % 8 or q.data.ptr % 16:
        raise ValueError(f"q needs contiguous, 16-byte aligned rows of D elements; strides {q.strides}")
    ks = _elem_strides(k)
    if ks[-1] != 1 or any(s % 8 for s in ks[:-1]) or k.data.ptr % 16:
        raise ValueError(f"k needs contiguous, 16-byte aligned rows of D elements; strides {k.strides}")

    page_size = int(page_size)
    page_shift, pt_cols, n_idx = 0, 0, 0
    if page_size <= 0:
        if k.ndim != 3 or int(k.shape[2]) != d:
            raise ValueError(f"dense k must be [total_k, Hkv, D={d}], got shape {tuple(k.shape)}")
        _need_int32("cu_seqlens_k", cu_seqlens_k, batch + 1)
        if cu_seqlens_k is None:
            raise ValueError("dense k needs cu_seqlens_k")
        kv_mode, hkv = 0, int(k.shape[1])
        k_outer, k_slot, k_head, k_extent = ks[0], 0, ks[1], int(k.shape[0])
    else:
        if page_size & (page_size - 1):
            raise NotImplementedError(f"max score needs a power-of-two page_size, got {page_size}")
        page_shift = page_size.bit_length() - 1
        if k.ndim != 4 or int(k.shape[3]) != d:
            raise ValueError(f"paged k must be 4D with head dim {d}, got shape {tuple(k.shape)}")
        if kv_layout == "NHD":
            if int(k.shape[1]) != page_size:
                raise ValueError(f"NHD k must be [P, page_size={page_size}, Hkv, D], got {tuple(k.shape)}")
            hkv, k_outer, k_slot, k_head = int(k.shape[2]), ks[0], ks[1], ks[2]
        elif kv_layout == "HND":
            if int(k.shape[2]) != page_size:
                raise ValueError(f"HND k must be [P, Hkv, page_size={page_size}, D], got {tuple(k.shape)}")
            hkv, k_outer, k_slot, k_head = int(k.shape[1]), ks[0], ks[2], ks[1]
        else:
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        k_extent = int(k.shape[0])
        if page_table is not None:
            kv_mode = 1
            if np.dtype(page_table.dtype) != INT32 or page_table.ndim != 2 or int(page_table.shape[0]) < batch:
                raise ValueError(f"page_table must be int32 [B={batch}, max_pages], got {tuple(page_table.shape)}")
            if not page_table.flags.c_contiguous:
                raise ValueError("page_table must be contiguous")
            pt_cols = int(page_table.shape[1])
        elif kv_indices is not None and kv_page_indptr is not None:
            kv_mode = 2
            _need_int32("kv_indices", kv_indices)
            _need_int32("kv_page_indptr", kv_page_indptr, batch + 1)
            n_idx = int(kv_indices.size)
        else:
            raise ValueError("paged k needs page_table, or kv_indices with kv_page_indptr")
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"Hq ({hq}) must be a positive multiple of Hkv ({hkv})")
    if hkv > 65535:
        raise ValueError(f"at most 65535 KV heads, got {hkv}")
    r = hq // hkv

    rows = int(max_seqlen_q) * r
    if batch == 0 or rows <= 0 or total_q == 0:
        return
    if rows >= 2**31:
        raise ValueError(f"max_seqlen_q * (Hq / Hkv) must be < 2^31, got {rows}")
    nwarps, stages, mma = max_score_variant(rows, d, _compute_capability) if variant is None else tuple(variant)
    if (qdt, d, nwarps, stages, mma) not in MAX_SCORE_SPECS:
        raise ValueError(f"no max score variant (nwarps, stages, mma) = {(nwarps, stages, mma)} for D={d}")
    bm = 16 * nwarps
    m_tiles = -(-rows // bm)
    if m_tiles * batch >= 2**31:
        raise ValueError("too many query tiles for one launch")
    splits, tiles_per_split = max_score_splits(m_tiles * batch * hkv, nt, _sm_count())
    kernel = get_kernel(MAX_SCORE_SPECS[(qdt, d, nwarps, stages, mma)])
    args = (
        q, k, max_score, cu_seqlens_q, qo_lens, kv_lens, qo_offset,
        _ptr(cu_seqlens_k if kv_mode == 0 else None), _ptr(page_table if kv_mode == 1 else None),
        _ptr(kv_indices if kv_mode == 2 else None), _ptr(kv_page_indptr if kv_mode == 2 else None),
        np.int32(kv_mode), np.int64(qs[0]), np.int64(qs[1]), np.int64(k_outer), np.int64(k_slot),
        np.int64(k_head), np.int64(total_q), np.int64(k_extent), np.int32(page_shift), np.int32(pt_cols),
        np.int64(n_idx), np.int32(batch), np.int32(m_tiles), np.int32(hq), np.int32(hkv), np.int32(nt),
        np.int32(1 if causal else 0), np.int32(tiles_per_split),
    )
    launch(kernel, (m_tiles * batch, hkv, splits), (32 * nwarps,), args,
           shared_mem=max_score_smem_bytes(d, nwarps, stages, mma, q.itemsize), stream=stream)


# ----------------------------------------------------------------------------- top-k select


def selected_width(topk: int, force_begin_blocks: int, force_end_blocks: int,
                   force_blocks_count_in_topk: bool) -> int:
    """Output width W of a selection."""
    return int(topk) if force_blocks_count_in_topk else int(topk) + int(force_begin_blocks) + int(force_end_blocks)


def run_topk_select(max_score, out, *, topk, num_valid_pages, force_begin_blocks,
                    force_end_blocks, force_blocks_count_in_topk, query_positions=None,
                    stream=None) -> None:
    """Exact top-k block selection, SPEC section 4.

    max_score float32 ``[total_q, Hq, NT]`` contiguous, ``NT < 12288``; out int32
    ``[total_q, Hq, W]`` contiguous with ``W = topk`` (count_in_topk) or
    ``topk + begin + end``, ``W <= 64``; query_positions int64 ``[total_q]`` or None;
    ``num_valid_pages`` in ``(0, NT]`` or None (= NT). Every element of ``out`` is
    written: block ids ascending, then ``-1``.
    """
    _launch_topk(max_score, out, topk=topk, num_valid_pages=num_valid_pages,
                 force_begin_blocks=force_begin_blocks, force_end_blocks=force_end_blocks,
                 force_blocks_count_in_topk=force_blocks_count_in_topk,
                 query_positions=query_positions, stream=stream, candidate_capacity=None)


def _launch_topk(max_score, out, *, topk, num_valid_pages, force_begin_blocks, force_end_blocks,
                 force_blocks_count_in_topk, query_positions, stream, candidate_capacity=None,
                 algo=None, npt=None):
    """:func:`run_topk_select` with the kernel choice exposed (tests and tuning sweeps).

    ``algo``: ``None`` (:func:`topk_algorithm`), ``"stream"`` (``k <= 32``) or ``"block"``.
    ``candidate_capacity`` (block kernels): 0 forces the register path that handles heavy
    ties. ``npt`` (stream kernel): scores per lane per chunk, one of ``STREAM_NPT``.
    """
    if np.dtype(max_score.dtype) != FLOAT32 or max_score.ndim != 3:
        raise ValueError(f"max_score must be float32 [total_q, Hq, NT], got "
                         f"{dtype_name(max_score.dtype)} {tuple(max_score.shape)}")
    if not max_score.flags.c_contiguous:
        raise ValueError("max_score must be contiguous")
    total_q, hq, nt = (int(x) for x in max_score.shape)
    if nt <= 0 or nt >= MAX_TILES:
        raise ValueError(f"max_score needs 0 < NT < {MAX_TILES}, got NT={nt}")
    topk, begin, end = int(topk), int(force_begin_blocks), int(force_end_blocks)
    if topk <= 0 or begin < 0 or end < 0:
        raise ValueError(f"topk must be positive and forced counts non-negative, got {topk}, {begin}, {end}")
    if force_blocks_count_in_topk and begin + end > topk:
        raise ValueError(f"force_begin_blocks + force_end_blocks ({begin} + {end}) exceeds topk {topk}")
    width = selected_width(topk, begin, end, force_blocks_count_in_topk)
    if width > MAX_WIDTH:
        raise ValueError(f"selection width {width} exceeds {MAX_WIDTH}")
    if np.dtype(out.dtype) != INT32 or tuple(out.shape) != (total_q, hq, width) or not out.flags.c_contiguous:
        raise ValueError(f"out must be contiguous int32 {(total_q, hq, width)}, got "
                         f"{dtype_name(out.dtype)} {tuple(out.shape)}")
    valid = nt if num_valid_pages is None else int(num_valid_pages)
    if valid <= 0 or valid > nt:
        raise ValueError(f"num_valid_pages must be in (0, NT={nt}], got {valid}")
    if query_positions is not None:
        if np.dtype(query_positions.dtype) != INT64 or tuple(query_positions.shape) != (total_q,):
            raise ValueError(f"query_positions must be int64 [total_q={total_q}], got "
                             f"{dtype_name(query_positions.dtype)} {tuple(query_positions.shape)}")
        if not query_positions.flags.c_contiguous:
            raise ValueError("query_positions must be contiguous")
    rows = total_q * hq
    if rows == 0:
        return
    slots = width - begin - end
    vec_ok = nt % 4 == 0 and max_score.data.ptr % 16 == 0
    if algo is None:
        algo = "block" if candidate_capacity is not None else topk_algorithm(rows, nt, slots)
    if algo == "stream":
        if slots > STREAM_KERNEL_MAX_SLOTS:
            raise ValueError(f"the streaming top-k kernel takes at most {STREAM_KERNEL_MAX_SLOTS} free slots, "
                             f"got {slots}")
        snpt = stream_npt(nt) if npt is None else int(npt)
        if snpt not in STREAM_NPT:
            raise ValueError(f"npt must be one of {STREAM_NPT}, got {npt}")
        rpc = stream_rows_per_cta(snpt)
        kernel = get_kernel(STREAM_SPECS[(snpt, 4 if vec_ok else 1)])
        launch(kernel, (-(-rows // rpc),), (32 * rpc,),
               (max_score, out, np.int64(rows), np.int32(hq), np.int32(nt), np.int32(width), np.int32(valid),
                np.int32(begin), np.int32(end), _ptr(query_positions)),
               stream=stream)
        return
    if algo != "block":
        raise ValueError(f"algo must be None, 'stream' or 'block', got {algo!r}")
    nw, npt, vec, top2 = topk_variant(nt, slots, vec_ok)
    cap = (_TOPK_WARP_CANDIDATES if nw == 1 else _TOPK_CTA_CANDIDATES) if candidate_capacity is None \
        else int(candidate_capacity)
    kernel = get_kernel(TOPK_SPECS[(nw, npt, vec, top2)])
    if nw == 1:
        grid, block = -(-rows // _TOPK_ROWS_PER_WARP_CTA), 32 * _TOPK_ROWS_PER_WARP_CTA
    else:
        grid, block = rows, 32 * nw
    launch(kernel, (grid,), (block,),
           (max_score, out, np.int64(rows), np.int32(hq), np.int32(nt), np.int32(width), np.int32(valid),
            np.int32(begin), np.int32(end), _ptr(query_positions), np.int32(cap)),
           stream=stream)
