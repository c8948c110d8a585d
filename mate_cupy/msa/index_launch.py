"""Variants, configuration and launchers of the MSA index kernels (``cuda_src/msa_index.cu``).

* :func:`run_max_score`: per-128-key-block max of raw ``q . k`` (docs/semantics.md, section 3) for the
  MSA engine's ``output_maxscore`` pass. The caller validates (see its docstring);
  :func:`select_max_score_config` picks the kernel.
* :func:`launch_topk`: exact top-k block selection (docs/semantics.md, section 4) for
  ``sparse_topk_select`` (``mate_cupy.msa.topk``), which validates into a
  :class:`~mate_cupy.msa.topk.TopkProblem`; :func:`select_topk_config` picks the kernel.

Launchers take :class:`~mate_cupy.runtime.interop.Arg` views (or addresses) and a stream
address, launch through :func:`mate_cupy.jit.launch`, never synchronise and never
allocate. Every variant the choices can pick is registered at import (``compile_all``
builds them without a GPU) and none other. Design: ``docs/index_kernels.md``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ..jit import KernelParams, get_kernel, launch, register
from ..jit.registry import SM90A
from ..runtime.device import device_info
from ..runtime.interop import BFLOAT16, FLOAT16, FP8_E4M3, dtype_name

if TYPE_CHECKING:
    from ..runtime.interop import Arg
    from .topk import TopkProblem

__all__ = [
    "DECODE_CONFIGS", "FP8_DECODE_MAX_ROWS", "FP8_PREFILL_CONFIGS", "FP8_WS_CONFIG", "MAX_SCORE_CONFIGS",
    "MaxScoreConfig", "WS_CONFIG",
    "decode_splits", "TopkConfig", "block_topk_config", "launch_topk", "max_score_smem_bytes",
    "max_score_splits", "run_max_score", "select_max_score_config", "select_topk_config", "stream_topk_config",
]

SOURCE = "msa_index.cu"
BLOCK = 128                 # keys per max-score block
MAX_SCORE_HEAD_DIMS = (64, 128, 256)
_CTYPE = {FLOAT16: "half_t", BFLOAT16: "bf16_t", FP8_E4M3: "fp8_t"}
_MS_STASH = 16              # kMsStash

# ----------------------------------------------------------------------------- kernel parameters

MAX_SCORE_PARAMS = KernelParams((
    ("q", "ptr"), ("kc", "ptr"), ("max_score", "ptr"), ("cu_seqlens_q", "ptr"), ("qo_lens", "ptr"),
    ("kv_lens", "ptr"), ("qo_offset", "ptr"), ("cu_seqlens_k", "ptr"), ("page_table", "ptr"),
    ("kv_indices", "ptr"), ("kv_page_indptr", "ptr"), ("kv_mode", "i32"), ("q_stride_tok", "i64"),
    ("q_stride_head", "i64"), ("k_stride_outer", "i64"), ("k_stride_slot", "i64"), ("k_stride_head", "i64"),
    ("total_q", "i64"), ("k_extent", "i64"), ("page_shift", "i32"), ("page_table_cols", "i32"),
    ("num_kv_indices", "i64"), ("batch", "i32"), ("num_m_tiles", "i32"), ("num_heads_q", "i32"),
    ("num_heads_kv", "i32"), ("nt", "i32"), ("causal", "i32"), ("tiles_per_split", "i32"), ("score_scale", "f32"),
))
_TOPK_COMMON = (
    ("scores", "ptr"), ("out", "ptr"), ("num_rows", "i64"), ("num_heads", "i32"), ("nt", "i32"), ("width", "i32"),
    ("num_valid_pages", "i32"), ("force_begin", "i32"), ("force_end", "i32"), ("query_positions", "ptr"),
)
TOPK_PARAMS = KernelParams(_TOPK_COMMON + (("cand_cap", "i32"),))   # msa_topk_select_kernel
STREAM_PARAMS = KernelParams(_TOPK_COMMON)                          # msa_topk_stream_kernel

# ----------------------------------------------------------------------------- max score


@dataclass(frozen=True)
class MaxScoreConfig:
    """One max-score kernel variant.

    ``mma``: ``"decode"`` (``msa_decode_max_score_kernel``: 4 independent warps per CTA,
    each streaming its own K blocks through a private cp.async ring; keys are the MMA's M,
    ``8 * row_blocks`` packed rows its N, Q in registers), ``"mma_sync"``
    (``msa_block_max_score_kernel``: each warp holds 16 rows of Q in registers; three K
    stages) or ``"wgmma"`` (``msa_max_score_ws_kernel``, sm_90a: a producer warpgroup
    streaming K tiles through an mbarrier ring, two consumer warpgroups of wgmma, each
    loading its Q rows into registers once and running wgmma with A in registers, so the
    tensor cores read only K from shared memory; 256 rows per CTA, 128 when a key row
    exceeds 256 bytes).
    ``num_warps``: warps per CTA. ``row_blocks`` (decode only): n-blocks of 8 packed rows.
    """

    mma: str
    num_warps: int
    row_blocks: int = 0

    @property
    def decode(self) -> bool:
        return self.mma == "decode"

    def stages(self, d: int = 128, elem_bytes: int = 2) -> int:
        """K stages: per warp (sub-tiles of 32 keys) for decode, per CTA (128 keys) otherwise
        (wgmma: as many as fit beside Q and the stash, at most 8; MaxScoreWsTile::STAGES)."""
        if self.decode:
            return 6 if d * elem_bytes <= 128 else 3   # DecodeTile::WS
        if self.mma == "wgmma":
            row, bm = _srb(d, elem_bytes), self.rows_per_cta(d, elem_bytes)
            free = _WS_SMEM_LIMIT - _WS_ALIGN - bm * (row + 4 * (_MS_STASH + 1))
            return min(8, free // (BLOCK * row + BLOCK + 16))
        return 3

    def rows_per_cta(self, d: int = 128, elem_bytes: int = 2) -> int:
        """Packed rows per CTA (the wgmma kernel's depend on the key row's bytes)."""
        if self.decode:
            return 8 * self.row_blocks
        if self.mma == "wgmma":   # MaxScoreWsTile::BM: consumer warpgroups of 1 or 2 64-row halves
            return (self.num_warps // 4 - 1) * 64 * (2 if _srb(d, elem_bytes) <= 256 else 1)
        return 16 * self.num_warps


_WS_SMEM_LIMIT = 227 * 1024   # MaxScoreWsTile::SMEM_LIMIT
_WS_ALIGN = 1024              # MaxScoreWsTile::ALIGN_SLACK


def _srb(d: int, elem_bytes: int) -> int:
    """Bytes of a key row in the wgmma kernel's shared memory (whole 128-byte column-block rows)."""
    return -(-d * elem_bytes // 128) * 128


DECODE_CONFIGS = tuple(MaxScoreConfig("decode", 4, nb) for nb in (1, 2, 4))
# msa_max_score_ws_kernel (3 warpgroups, Q in registers as wgmma A fragments): the choice for
# 16-bit above 64 rows on sm_90 and for float8 prefill.
WS_CONFIG = MaxScoreConfig("wgmma", 12)
MAX_SCORE_CONFIGS = DECODE_CONFIGS + (MaxScoreConfig("mma_sync", 4), MaxScoreConfig("mma_sync", 8), WS_CONFIG)
DECODE_MAX_ROWS = DECODE_CONFIGS[-1].rows_per_cta()   # packed rows the decode kernel takes (32)
DECODE_SUB_KEYS = 32        # kDecSubKeys


def _max_score_name(dtype, d: int, cfg: MaxScoreConfig) -> str:
    if cfg.decode:
        return f"msa_decode_max_score_kernel<{_CTYPE[dtype]}, {d}, {cfg.row_blocks}>"
    if cfg.mma == "wgmma":
        return f"msa_max_score_ws_kernel<{_CTYPE[dtype]}, {d}>"
    return f"msa_block_max_score_kernel<{_CTYPE[dtype]}, {d}, {cfg.num_warps}>"


MAX_SCORE_SPECS = {
    (dt, d, cfg): register(SOURCE, _max_score_name(dt, d, cfg),
                            only_arch=SM90A if cfg.mma == "wgmma" else "")
    for dt in (FLOAT16, BFLOAT16)
    for d in MAX_SCORE_HEAD_DIMS
    for cfg in MAX_SCORE_CONFIGS
}
# fp8 e4m3 q and k: the decode kernel (mma.sync k32, sm_89+) up to 16 rows for D 256 (32 rows
# of D 256 spill on sm_90, where fp8 mma.sync runs as f16 MMAs on converted values), and more
# rows on sm_90a only, by the warp-specialised wgmma kernel (m64n128k32).
MAX_SCORE_SPECS.update({
    (FP8_E4M3, d, cfg): register(SOURCE, _max_score_name(FP8_E4M3, d, cfg), min_sm=89)
    for d in MAX_SCORE_HEAD_DIMS
    for cfg in DECODE_CONFIGS
    if d < 256 or cfg.row_blocks <= 2
})
# float8 rows of at most 128 bytes (D 64, 128): three consumer warpgroups of 64-key units
# (MaxScoreWsTile::NARROW); D 256: the 16-bit prefill kernel's two.
FP8_WS_CONFIG = MaxScoreConfig("wgmma", 16)
FP8_PREFILL_CONFIGS = {d: FP8_WS_CONFIG if _srb(d, 1) <= 128 else WS_CONFIG for d in MAX_SCORE_HEAD_DIMS}
MAX_SCORE_SPECS.update({
    (FP8_E4M3, d, cfg): register(SOURCE, _max_score_name(FP8_E4M3, d, cfg), only_arch=SM90A)
    for d, cfg in FP8_PREFILL_CONFIGS.items()
})
# Packed rows per request the fp8 decode kernel holds, per head dim (32; 16 at D 256); more
# rows take the wgmma variant (compute capability 9.0).
FP8_DECODE_MAX_ROWS = {d: max(cfg.rows_per_cta() for (dt, dd, cfg) in MAX_SCORE_SPECS
                              if dt == FP8_E4M3 and dd == d and cfg.decode) for d in MAX_SCORE_HEAD_DIMS}
FP8_PREFILL_SM = 90   # the compute capability the fp8 prefill variant is built for (sm_90a)


def select_max_score_config(rows: int, compute_capability: int, *, fp8: bool = False,
                            head_dim: int = 128) -> MaxScoreConfig:
    """The kernel for requests of up to ``rows = max_seqlen_q * Hq / Hkv`` packed rows.

    Decode-shaped requests (``rows <= 32``: a few queries, memory bound on K) take the
    decode kernel with the fewest 8-row n-blocks holding them; up to 64 rows 4 warps of
    mma.sync (64-row CTAs); above, the warp-specialised wgmma kernel on sm_90, 8 warps of
    mma.sync elsewhere. ``fp8`` (e4m3 q and k): the decode kernel up to
    ``FP8_DECODE_MAX_ROWS[head_dim]`` rows, else the wgmma kernel (registered for sm_90a
    only: callers refuse other devices). The wgmma kernel is :data:`WS_CONFIG` (float8:
    :data:`FP8_PREFILL_CONFIGS`)."""
    if fp8:
        if rows <= FP8_DECODE_MAX_ROWS[head_dim]:
            return next(c for c in DECODE_CONFIGS if c.rows_per_cta() >= rows)
        return FP8_PREFILL_CONFIGS[head_dim]
    if rows <= DECODE_MAX_ROWS:
        return next(c for c in DECODE_CONFIGS if c.rows_per_cta() >= rows)
    if rows <= 64:
        return MAX_SCORE_CONFIGS[3]
    return WS_CONFIG if compute_capability == 90 else MAX_SCORE_CONFIGS[4]


def max_score_smem_bytes(d: int, config: MaxScoreConfig, elem_bytes: int = 2) -> int:
    """Dynamic shared memory of a max-score variant (mirrors ``MaxScoreTile`` / ``DecodeTile``)."""
    if config.decode:
        ws = config.stages(d, elem_bytes)
        return config.num_warps * ws * (DECODE_SUB_KEYS * d * elem_bytes + 4)
    stages = config.stages(d, elem_bytes)
    bm = config.rows_per_cta(d, elem_bytes)
    stash = bm * (_MS_STASH + 1) * 4
    if config.mma == "wgmma":   # K stages, Q, stash, key flags, mbarriers, alignment slack
        row = _srb(d, elem_bytes)
        return stages * BLOCK * row + bm * row + stash + stages * (BLOCK + 16) + _WS_ALIGN
    return stages * BLOCK * d * elem_bytes + stash + stages * BLOCK


def max_score_ctas_per_sm(d: int, config: MaxScoreConfig, elem_bytes: int = 2) -> int:
    """CTAs per SM the launch bounds promise: two for D <= 128 (decode: keys of at most
    256 bytes), else one; the wgmma kernel one."""
    if config.decode:
        return 2 if d * elem_bytes <= 256 else 1
    if config.mma == "wgmma":
        return 1
    return 2 if d <= 128 else 1


SPLIT_RAMP_TILES = 2   # a CTA's start and finish (Q load, pipeline fill and drain), in key tiles
SPLIT_EXTRA_WAVES = 8  # wave counts tried beyond the fewest


def _least_time_splits(ctas: int, nt: int, slots: int, candidates, cap: int, cta_time) -> tuple:
    """``(splits, tiles_per_split)``: the count among ``candidates`` (those in ``[1, cap]``)
    whose ``ctas * splits`` CTAs, ``slots`` resident at once, finish soonest: waves x
    ``cta_time(tiles_per_split)``; each count is first evened out (``ceil(nt / per)`` ranges of
    ``per`` blocks); ties go to fewer splits."""
    best = None
    for s in candidates:
        if not 1 <= s <= cap:
            continue
        per = -(-nt // s)
        s = -(-nt // per)
        cost = (-(-ctas * s // slots) * cta_time(per), s)
        if best is None or cost < best[0]:
            best = (cost, s, per)
    return best[1], best[2]


@functools.lru_cache(maxsize=1024)
def max_score_splits(ctas: int, nt: int, slots: int, min_tiles: int = 4) -> tuple:
    """``(splits, tiles_per_split)``: cut the ``nt`` output blocks of each of ``ctas`` (rows,
    head) tiles into key ranges, one CTA each, so that the last CTA is done soonest
    (:func:`_least_time_splits`): a CTA takes ``tiles + SPLIT_RAMP_TILES`` tile times, and the
    candidates are, for the fewest waves and ``SPLIT_EXTRA_WAVES`` more, the largest count that
    fits that many waves. At least ``min_tiles`` blocks per split. Block maxima need no merge,
    so a split only narrows a CTA's block range."""
    if ctas <= 0:
        return 1, nt
    cap = max(1, min(nt // min_tiles, 65535))
    first = -(-ctas // slots)
    candidates = {min(cap, max(1, w * slots // ctas)) for w in range(first, first + SPLIT_EXTRA_WAVES + 1)}
    return _least_time_splits(ctas, nt, slots, candidates, cap, lambda per: per + SPLIT_RAMP_TILES)


DECODE_MIN_TILES = 8        # blocks per decode CTA at least: two per warp
_DECODE_MAX_WAVES = 16
_DECODE_WARPS = 4           # kDecWarps


@functools.lru_cache(maxsize=1024)
def decode_splits(units: int, nt: int, slots: int, min_tiles: int = DECODE_MIN_TILES) -> tuple:
    """``(splits, tiles_per_split)`` for the decode kernel: ``units`` (request, KV head)
    pairs, each's ``nt`` blocks cut into ``splits`` equal ranges, one CTA each, ``slots``
    CTAs resident at once. Picks the split minimising waves x blocks per warp (the time of
    the slowest SM when every request is ``nt`` blocks long; a CTA's time is its busiest
    warp's, ``ceil(blocks / 4)``) over the splits that fill
    whole waves (``floor(w slots / units)`` for ``w`` waves), with at least ``min_tiles``
    blocks per CTA; ties go to fewer CTAs."""
    cap = max(1, min(nt // min_tiles, (2 ** 31 - 1) // max(units, 1)))
    candidates = {1, cap} | {w * slots // units for w in range(1, _DECODE_MAX_WAVES + 1)}
    return _least_time_splits(units, nt, slots, candidates, cap, lambda per: -(-per // _DECODE_WARPS))


def run_max_score(q: Arg, k: Arg, max_score: Arg, *, cu_seqlens_q: Arg, qo_lens: Arg, kv_lens: Arg,
                  qo_offset: Arg, cu_seqlens_k: Optional[Arg] = None, page_table: Optional[Arg] = None,
                  kv_indices: Optional[Arg] = None, kv_page_indptr: Optional[Arg] = None, kv_layout: str = "NHD",
                  page_size: int = 0, max_seqlen_q: int, causal: bool, stream: int,
                  config: Optional[MaxScoreConfig] = None, score_scale: float = 1.0) -> None:
    """``max_score[i, h, t] = score_scale * max`` of ``q[i, h] . k[j, h // r]`` over the admissible keys ``j`` of block ``t``.

    Signature::

        run_max_score(q: Arg, k: Arg, max_score: Arg, *, cu_seqlens_q: Arg, qo_lens: Arg,
                      kv_lens: Arg, qo_offset: Arg, cu_seqlens_k: Arg | None = None,
                      page_table: Arg | None = None, kv_indices: Arg | None = None,
                      kv_page_indptr: Arg | None = None, kv_layout: str = "NHD",
                      page_size: int = 0, max_seqlen_q: int, causal: bool, stream: int,
                      config: MaxScoreConfig | None = None, score_scale: float = 1.0) -> None

    Arrays are :class:`~mate_cupy.runtime.interop.Arg` views (``.ptr``, ``.shape``,
    ``.strides`` in elements, logical ``.dtype``); ``stream`` is a ``cudaStream_t``
    address. Keys: dense ``k [total_k, Hkv, D]`` when ``page_size == 0`` (request ``b``'s
    key ``j`` is row ``cu_seqlens_k[b] + j``), else paged ``[P, page_size, Hkv, D]`` (NHD)
    or ``[P, Hkv, page_size, D]`` (HND) through ``page_table`` (used when given) or
    ``kv_indices`` + ``kv_page_indptr``. Every element of the rows of each request's
    ``qo_lens[b]`` queries is written: ``-inf`` where a block has no admissible key and for
    ``t >= ceil(kv_len / 128)``; other rows are not touched. Keys of page ids outside
    ``[0, P)``, past the table width or outside the CSR range, and dense rows outside
    ``k``, are not admissible. ``config`` overrides :func:`select_max_score_config` (one
    of :data:`MAX_SCORE_CONFIGS`; the tests run each; a decode config must hold
    ``max_seqlen_q * Hq / Hkv`` rows).

    The caller guarantees (nothing here checks it):

    * the current CUDA device is the arrays' device and ``stream`` belongs to it;
    * ``q``: ``[total_q, Hq, D]``, float16 or bfloat16, ``D`` in {64, 128, 256},
      ``q.strides[2] == 1``, ``q.strides[0]`` and ``q.strides[1]`` multiples of 16 bytes,
      ``q.ptr`` 16-byte aligned; or float8 e4m3 (``max_seqlen_q * Hq / Hkv <=
      FP8_DECODE_MAX_ROWS[D]`` (32, 16 for D 256): the decode kernel, compute capability 8.9
      or newer; more rows: the wgmma variant, compute capability 9.0 only) with
      ``score_scale`` the product of the per-tensor q and k scales;
    * ``k``: ``q``'s dtype, the rank and shape above for its mode with head dim ``D``,
      ``k.strides[-1] == 1``, the other strides multiples of 16 bytes, ``k.ptr`` 16-byte
      aligned;
    * ``score_scale``: positive and finite (raw dot products times it; 1 for 16-bit inputs);
    * ``Hkv >= 1`` divides ``Hq``, ``Hkv <= 65535``;
    * ``max_score``: float32 ``[total_q, Hq, NT]`` C-contiguous (``NT >= 0``);
    * int32 contiguous vectors ``qo_lens``, ``kv_lens``, ``qo_offset`` ``[B]`` (``B`` is
      ``qo_lens.shape[0]``), ``cu_seqlens_q [B + 1]``; dense: ``cu_seqlens_k`` int32
      ``[B + 1]``;
    * paged: ``page_size`` a power of two, ``kv_layout`` ``"NHD"`` or ``"HND"``, and either
      ``page_table`` int32 C-contiguous ``[>= B, max_pages]`` or ``kv_indices`` int32
      contiguous 1-D with ``kv_page_indptr`` int32 ``[B + 1]``;
    * ``max_seqlen_q >= qo_lens[b]`` for every request (queries past it may be left unwritten);
    * ``max_seqlen_q * Hq / Hkv < 2**31`` and ``ceil(max_seqlen_q * Hq / Hkv / 16) * B < 2**31``.
    """
    total_q, hq, d = q.shape
    nt = max_score.shape[2]
    batch = qo_lens.shape[0]
    ks = k.strides
    page_shift = pt_cols = n_idx = 0
    if page_size <= 0:
        kv_mode, hkv = 0, k.shape[1]
        k_outer, k_slot, k_head, k_extent = ks[0], 0, ks[1], k.shape[0]
        page_table = kv_indices = kv_page_indptr = None
    else:
        page_shift = int(page_size).bit_length() - 1
        if kv_layout == "NHD":
            hkv, k_outer, k_slot, k_head = k.shape[2], ks[0], ks[1], ks[2]
        else:
            hkv, k_outer, k_slot, k_head = k.shape[1], ks[0], ks[2], ks[1]
        k_extent = k.shape[0]
        cu_seqlens_k = None
        if page_table is not None:
            kv_mode, pt_cols = 1, page_table.shape[1]
            kv_indices = kv_page_indptr = None
        else:
            kv_mode, n_idx = 2, kv_indices.shape[0]
    r = hq // hkv
    rows = int(max_seqlen_q) * r
    if batch == 0 or rows <= 0 or total_q == 0 or nt == 0:
        return
    sm_count, cc = device_info(q.device)
    cfg = select_max_score_config(rows, cc, fp8=q.dtype == FP8_E4M3, head_dim=d) if config is None else config
    if cfg.decode and rows > cfg.rows_per_cta():
        raise ValueError(f"config {cfg} holds {cfg.rows_per_cta()} packed rows, got max_seqlen_q * Hq / Hkv = {rows}")
    if (q.dtype, d, cfg) not in MAX_SCORE_SPECS:
        raise ValueError(f"max score: no {dtype_name(q.dtype)} variant {cfg} for D {d} ({rows} packed rows per "
                         f"request; float8 runs the decode kernel up to max_seqlen_q * Hq / Hkv <= "
                         f"{DECODE_MAX_ROWS} (16 for D 256), else the wgmma kernel)")
    kernel = get_kernel(MAX_SCORE_SPECS[(q.dtype, d, cfg)])
    smem = max_score_smem_bytes(d, cfg, q.dtype.itemsize)
    if cfg.decode:
        m_tiles = 1
        slots = sm_count * max_score_ctas_per_sm(d, cfg, q.dtype.itemsize)
        splits, tiles_per_split = decode_splits(batch * hkv, nt, slots)
        grid = (batch * splits, hkv)
    else:
        m_tiles = -(-rows // cfg.rows_per_cta(d, q.dtype.itemsize))
        slots = sm_count * max_score_ctas_per_sm(d, cfg, q.dtype.itemsize)
        splits, tiles_per_split = max_score_splits(m_tiles * batch * hkv, nt, slots)
        grid = (m_tiles * batch, hkv, splits)
    qs = q.strides
    launch(kernel, grid, (32 * cfg.num_warps,), MAX_SCORE_PARAMS,
           (q, k, max_score, cu_seqlens_q, qo_lens, kv_lens, qo_offset, cu_seqlens_k, page_table, kv_indices,
            kv_page_indptr, kv_mode, qs[0], qs[1], k_outer, k_slot, k_head, total_q, k_extent, page_shift, pt_cols,
            n_idx, batch, m_tiles, hq, hkv, nt, 1 if causal else 0, tiles_per_split, float(score_scale)),
           shared_mem=smem, stream=stream)


# ----------------------------------------------------------------------------- top-k select

_TOPK_ROWS_PER_WARP_CTA = 8    # kTopkRowsPerWarpCta
_TOPK_WARP_CANDIDATES = 256    # kTopkWarpCandidates
_TOPK_CTA_CANDIDATES = 2048    # kTopkCtaCandidates
_TOPK_CTA_WARPS = (2, 4, 8, 12)
_TOPK_CTA_NPT = 32
STREAM_NPT = (8, 16, 32)
STREAM_MAX_SLOTS = 16          # the choice's limit; the streaming kernel itself is exact for K <= 32
STREAM_KERNEL_MAX_SLOTS = 32
STREAM_MIN_ROWS = 1024         # rows of more than 1024 scores: below this many rows a CTA per row wins


@dataclass(frozen=True)
class TopkConfig:
    """One top-k kernel launch shape.

    ``kernel``: ``"stream"`` (``msa_topk_stream_kernel``: a warp per row reads its row in
    chunks of ``32 * scores_per_thread``; ``K <= 32`` free slots) or ``"block"``
    (``msa_topk_select_kernel``: ``warps_per_row == 1``, a warp per row, 8 rows per CTA,
    ``NT <= 32 * scores_per_thread``; else a CTA of ``warps_per_row`` warps per row).
    ``vector_width`` 4: 16-byte loads (``NT % 4 == 0`` and 16-byte aligned scores).
    ``top2`` (block): the lower bound takes each thread's two largest keys (always for
    warp rows). ``candidate_capacity`` (block): candidates kept in shared memory before
    the register path (256 for warp rows, 2048 for CTA rows; 0 forces the register
    path). Streaming configs have ``warps_per_row == 1``, ``top2 False``,
    ``candidate_capacity 0``.
    """

    kernel: str
    scores_per_thread: int
    vector_width: int
    warps_per_row: int
    top2: bool
    candidate_capacity: int

    @property
    def rows_per_cta(self) -> int:
        if self.kernel == "stream":
            return 4 if self.scores_per_thread > 16 else 8   # StreamRows<NPT>::kPerCta
        return _TOPK_ROWS_PER_WARP_CTA if self.warps_per_row == 1 else 1


def _block_variants():
    out = [(1, npt, True) for npt in (8, 32)]
    for nw in _TOPK_CTA_WARPS:
        out += [(nw, _TOPK_CTA_NPT, top2) for top2 in ((False, True) if 2 * 64 > 32 * nw else (False,))]
    return out


TOPK_SPECS = {
    (nw, npt, vec, top2): register(SOURCE, f"msa_topk_select_kernel<{nw}, {npt}, {vec}, {'true' if top2 else 'false'}>")
    for nw, npt, top2 in _block_variants()
    for vec in (1, 4)
}
STREAM_SPECS = {(npt, vec): register(SOURCE, f"msa_topk_stream_kernel<{npt}, {vec}>")
                for npt in STREAM_NPT for vec in (1, 4)}


def stream_topk_config(problem: TopkProblem) -> TopkConfig:
    """The streaming kernel for ``problem``: one chunk of NPT 32 when ``256 < NT <= 1024``
    (24 warps per SM), chunks of 512 (NPT 16: 64 registers, 32 warps per SM) for
    ``256 < NT <= 512`` and longer rows, NPT 8 below."""
    nt = problem.max_k_tiles
    npt = 8 if nt <= 256 else (32 if 512 < nt <= 1024 else 16)
    return TopkConfig("stream", npt, 4 if problem.scores_aligned else 1, 1, False, 0)


def block_topk_config(problem: TopkProblem) -> TopkConfig:
    """The warp / CTA kernel for ``problem``: a warp per row (NPT 8 up to NT 256, 32 up to
    1024), else the fewest CTA warps of {2, 4, 8, 12} holding the row at 32 scores per
    thread; top-2 bound when ``2 K`` exceeds the group; full candidate capacity."""
    nt = problem.max_k_tiles
    if nt <= 1024:
        nw, npt, top2 = 1, 8 if nt <= 256 else 32, True
    else:
        need = -(-nt // (32 * _TOPK_CTA_NPT))
        nw = next(w for w in _TOPK_CTA_WARPS if w >= need)
        npt, top2 = _TOPK_CTA_NPT, 2 * problem.free_slots > 32 * nw
    return TopkConfig("block", npt, 4 if problem.scores_aligned else 1, nw, top2,
                      _TOPK_WARP_CANDIDATES if nw == 1 else _TOPK_CTA_CANDIDATES)


def select_topk_config(problem: TopkProblem) -> TopkConfig:
    """The kernel for ``problem`` (device-independent): streaming for ``K <= 16`` free
    slots when ``NT <= 1024`` or there are at least ``STREAM_MIN_ROWS`` rows, else the
    warp / CTA kernel. Rows whose valid blocks all fit (``V_i <= W``) are written by
    either kernel without reading scores."""
    if problem.free_slots <= STREAM_MAX_SLOTS and (problem.max_k_tiles <= 1024 or problem.rows >= STREAM_MIN_ROWS):
        return stream_topk_config(problem)
    return block_topk_config(problem)


def launch_topk(problem: TopkProblem, config: TopkConfig, max_score, out, query_positions, stream: int) -> None:
    """Select into ``out`` on ``stream`` (an address) with the kernel ``config`` names.

    ``max_score`` (float32 ``[total_q, Hq, NT]`` C-contiguous), ``out`` (int32
    ``[total_q, Hq, W]`` C-contiguous) and ``query_positions`` (int64 ``[total_q]`` or
    None) are :class:`~mate_cupy.runtime.interop.Arg` views or addresses as
    :func:`~mate_cupy.msa.topk.validate_topk` accepted them for ``problem``; the current
    device is theirs. A ``"stream"`` config needs ``problem.free_slots <= 32``.
    """
    rows = problem.rows
    if rows == 0:
        return
    values = (max_score, out, rows, problem.num_qo_heads, problem.max_k_tiles, problem.width,
              problem.num_valid_pages, problem.force_begin_blocks, problem.force_end_blocks, query_positions)
    rpc = config.rows_per_cta
    if config.kernel == "stream":
        kernel = get_kernel(STREAM_SPECS[(config.scores_per_thread, config.vector_width)])
        launch(kernel, (-(-rows // rpc),), (32 * rpc,), STREAM_PARAMS, values, stream=stream)
        return
    kernel = get_kernel(TOPK_SPECS[(config.warps_per_row, config.scores_per_thread, config.vector_width,
                                    config.top2)])
    block = 32 * (rpc if config.warps_per_row == 1 else config.warps_per_row)
    launch(kernel, (-(-rows // rpc),), (block,), TOPK_PARAMS, values + (config.candidate_capacity,), stream=stream)
