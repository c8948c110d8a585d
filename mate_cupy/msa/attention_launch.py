"""Configuration and launch of the MSA attention kernels (``cuda_src/attention_fwd.cu``).

Three steps, each a plain function of what the one before produced:

* :class:`AttentionProblem` (frozen): everything about one attention pass that the launch
  configuration depends on (KV mode, batch, heads, head dim, dtype, capacities, the
  plan's options). Built by the MSA validation (``mate_cupy.msa.execute``).
* :func:`select_config` (pure, cached): ``(problem, sm_count, cc) -> AttentionConfig``:
  the tile, grid, split-KV factor, shared memory and workspace bytes.
* :func:`run_attention`: packs the kernel parameters (:data:`FWD_PARAMS`,
  :data:`MERGE_PARAMS`) and launches on the caller's stream. It checks nothing (the
  validation did), reads no device data and allocates nothing.

Tiles (one ``msa_attention_fwd_kernel`` specialised by macros; docs/attention.md has the
shapes and the measurements behind each choice):

* ``decode``: 16 packed rows, the keys of a tile split over 4 warps. Dense/paged calls
  with ``max_seqlen_q * group <= 16``; block-sparse decode plans.
* ``prefill``: mma.sync, 128 rows (64 for D 256). Every prefill call the warp-specialised
  tiles do not cover (fp8, D 256, GPUs other than sm_90).
* ``ws2n128s3``: warp-specialised (sm_90a, fp16/bf16, D 64/128): a producer warpgroup
  streams K/V through a three-stage mbarrier ring, two consumer warpgroups of 64 rows
  overlap the next tile's ``Q K^T`` with the softmax (``attention/mainloop_sm90.cuh``):
  dense and paged prefill, and block-sparse prefill on the query tiles where the CTA's lists
  and block-union scratch leave room for the third stage.
* ``ws2n128s2``: the same with two stages: the other block-sparse prefills on the query
  tiles.
* ``gather``: the block-stationary kernels of :mod:`mate_cupy.msa.gather_launch`, taken
  when the plan asks for it (``prefill_tile="gather"``) and they apply to the problem.

Only the variants :func:`select_config` can pick are registered (``compile_all`` builds
exactly those).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

from ..jit import KernelParams, get_kernel, launch, load, register
from ..jit.registry import SM90A, KernelSpec
from ..jit.tensor_map import DTYPE_BFLOAT16, DTYPE_FLOAT16, NO_MAP, TensorMap
from . import gather_launch

SOURCE = "attention_fwd.cu"
KERNELS = ("msa_attention_fwd_kernel", "msa_attention_merge_kernel")
KV_DENSE, KV_PAGED, KV_SPARSE = 0, 1, 2
DTYPE_FP16, DTYPE_BF16, DTYPE_E4M3 = 0, 1, 2
SPARSE_BLOCK = 128
MAX_SPLITS = 128
MAX_GRID_YZ = 65535
SMEM_LIMIT = 227 * 1024  # per-block opt-in limit on sm_80 / sm_90
SMEM_PER_SM = 228 * 1024
# L2 of the GPUs the warp-specialised tile runs on (H100, H200): the K/V one L2 section of
# the persistent tile's work items may take (l2_section).
L2_BYTES = 50 * 1024 * 1024
WG_PAD = 1024  # extra shared bytes of a warp-specialised tile: the kernel aligns its tiles to 1024 bytes
GATHER = "gather"


@dataclass(frozen=True)
class TileShape:
    """One CTA shape: ``warps_m x warps_n`` warps, ``mtiles`` 16-row m-tiles per warp,
    ``block_n`` keys per K/V tile (split over ``warps_n``), a ``stages``-deep cp.async ring.
    ``producer``: warp-specialised (sm_90a, warpgroup MMAs), one more warpgroup that only
    loads K/V."""

    name: str
    warps_m: int
    mtiles: int
    warps_n: int
    block_n: int
    stages: int
    min_blocks: int
    producer: bool = False

    @property
    def rows(self) -> int:
        return self.warps_m * self.mtiles * 16

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n + (128 if self.producer else 0)


WS_TILE = "ws2n128s3"
WS_SPARSE_TILE = "ws2n128s2"  # block-sparse lists too long for a third stage
# Warp-specialised tiles: name -> stages (two consumer warpgroups, 128 keys per tile).
WS_TILES = {WS_TILE: 3, WS_SPARSE_TILE: 2}
# Registers per thread of a warp-specialised tile's (producer, consumer) warpgroups after
# setmaxnreg, per KV mode (128 * producer + 256 * consumer <= 168 * 384, the CTA's registers
# at launch, which setmaxnreg only moves between the warpgroups): the fewest producer
# registers that compile without spills. Dense and paged: one TMA-issuing producer warp;
# block-sparse: the union build and warp 0's loads spill under 64.
WS_REGISTERS = {KV_DENSE: (40, 232), KV_PAGED: (40, 232), KV_SPARSE: (64, 216)}
# Paged K/V arrive by TMA boxes of whole pages from this page size on (smaller pages by cp.async).
WS_MIN_BOX_PAGE = 8
TILES = ("decode", "prefill") + tuple(WS_TILES)


def tile_shape(name: str, head_dim: int, dtype_code: int) -> TileShape:
    """The CTA shape of tile ``name``. e4m3 needs 32 keys per warp (k32 PV mma)."""
    fp8 = dtype_code == DTYPE_E4M3
    if name == "prefill":
        if head_dim == 64:
            return TileShape(name, 4, 2, 1, 128, 2, 2)
        if head_dim == 128:
            return TileShape(name, 4, 2, 1, 64, 2, 2)
        return TileShape(name, 4, 1, 1, 32, 2, 2)
    if name in WS_TILES:
        return TileShape(name, 8, 1, 1, 128, WS_TILES[name], 1, producer=True)
    if name == "decode":
        if head_dim == 64:
            return TileShape(name, 1, 1, 4, 128, 3, 2)
        if head_dim == 128:
            return TileShape(name, 1, 1, 4, 128 if fp8 else 64, 3, 2)
        return TileShape(name, 1, 1, 4, 128 if fp8 else 64, 2, 1)
    raise KeyError(name)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def ws_bar_bytes(stages: int, kv: int) -> int:
    """Shared bytes of a warp-specialised tile's mbarriers, work item, per-stage K metadata
    and union warp totals (``ws_bar_bytes`` of ``attention/mainloop_sm90.cuh``)."""
    meta = stages * 128 if kv == KV_PAGED else 4 * stages if kv == KV_SPARSE else 0
    return 4 * stages * 8 + 16 + 80 + meta + 16


def _row_bytes(head_dim: int, dtype_code: int) -> int:
    """Bytes of one Q/K/V row."""
    return head_dim * (1 if dtype_code == DTYPE_E4M3 else 2)


def smem_layout(shape: TileShape, head_dim: int, dtype_code: int, kv: int = KV_DENSE) -> dict:
    """Fixed shared-memory layout, mirrored by the kernel (checked by its static_assert)."""
    row_bytes = _row_bytes(head_dim, dtype_code)
    q_bytes = shape.rows * row_bytes
    stage_bytes = 2 * shape.block_n * row_bytes
    epi_bytes = shape.warps_n * shape.rows * (head_dim + 8) * 4 + 3 * shape.warps_n * shape.rows * 4
    region = _round_up(max(shape.stages * stage_bytes, epi_bytes), 128)
    # (a warp-specialised tile keeps its mbarriers, work item and stage metadata there instead)
    flags = _round_up(ws_bar_bytes(shape.stages, kv) if shape.producer else shape.stages * shape.block_n, 128)
    return {"q": q_bytes, "region": region, "flags": flags, "fixed": q_bytes + region + flags,
            "union_blocks": (region // 8) * 32}


def sparse_smem_bytes(nq_cap: int, width: int, union_words: int = 0) -> tuple:
    """(bytes, qmask_words) of the per-CTA block lists of the block-sparse variants. A
    warp-specialised tile (``union_words > 0``) double-buffers the membership words and has
    its own union scratch: a bitmap and prefix sums of ``union_words`` words each."""
    list_cap = nq_cap * width
    qwords = max(1, (list_cap + 31) // 32)
    if union_words:
        return 4 * (2 * list_cap + 2 * nq_cap * qwords + 2 * union_words), qwords
    return 4 * (2 * list_cap + nq_cap * qwords), qwords


def union_words(max_seqlen_k: int) -> int:
    """Words of a warp-specialised tile's union bitmap: one bit per 128-key block of the
    longest request."""
    return -(-max(1, max_seqlen_k) // (SPARSE_BLOCK * 32))


# ----------------------------------------------------------------------------- variants


def _reachable():
    """(head_dim, dtype_code, tile, kv_mode) of every variant :func:`select_config` can pick."""
    out = []
    for kv in (KV_DENSE, KV_PAGED, KV_SPARSE):
        for d in ((128,) if kv == KV_SPARSE else (64, 128, 256)):
            for code in (DTYPE_FP16, DTYPE_BF16, DTYPE_E4M3):
                out += [(d, code, "decode", kv), (d, code, "prefill", kv)]
                if code == DTYPE_E4M3:
                    continue
                if kv == KV_SPARSE:
                    out += [(d, code, WS_TILE, kv), (d, code, WS_SPARSE_TILE, kv)]
                elif d in (64, 128):
                    out.append((d, code, WS_TILE, kv))
    return out


def _register(d: int, code: int, tile: str, kv: int) -> KernelSpec:
    shape = tile_shape(tile, d, code)
    min_sm = 90 if shape.producer else (89 if code == DTYPE_E4M3 else 80)
    regs = {}
    if shape.producer:
        regs = dict(zip(("ATT_WS_PRODUCER_REGS", "ATT_WS_CONSUMER_REGS"), WS_REGISTERS[kv]))
    return register(SOURCE, KERNELS, min_sm=min_sm, only_arch=SM90A if shape.producer else "", ATT_HEAD_DIM=d,
                    ATT_DTYPE=code, ATT_WARPS_M=shape.warps_m, ATT_MTILES=shape.mtiles, ATT_WARPS_N=shape.warps_n,
                    ATT_BLOCK_N=shape.block_n, ATT_STAGES=shape.stages, ATT_KV=kv, ATT_MIN_BLOCKS=shape.min_blocks,
                    ATT_WS=int(shape.producer), ATT_SMEM_FIXED=smem_layout(shape, d, code, kv)["fixed"], **regs)


#: (head_dim, dtype_code, tile, kv_mode) -> registered variant
SPECS = {key: _register(*key) for key in _reachable()}

# msa_attention_fwd_kernel's and msa_attention_merge_kernel's parameters, in order
# (checked against the source by the CPU tests).
FWD_PARAMS = KernelParams((
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("out", "ptr"), ("lse", "ptr"), ("ws_o", "ptr"),
    ("ws_lse", "ptr"), ("cu_seqlens_q", "ptr"), ("qo_lens", "ptr"), ("kv_lens", "ptr"), ("qo_offset", "ptr"),
    ("cu_seqlens_k", "ptr"), ("page_list", "ptr"), ("page_indptr", "ptr"), ("block_lists", "ptr"),
    ("q_tok_stride", "i64"), ("q_head_stride", "i64"), ("out_tok_stride", "i64"), ("out_head_stride", "i64"),
    ("k_page_stride", "i64"), ("k_slot_stride", "i64"), ("k_head_stride", "i64"),
    ("v_page_stride", "i64"), ("v_slot_stride", "i64"), ("v_head_stride", "i64"),
    ("total_q", "i32"), ("kv_extent", "i32"), ("num_heads_q", "i32"), ("num_heads_kv", "i32"), ("group", "i32"),
    ("causal", "i32"), ("page_size_log2", "i32"), ("page_list_len", "i32"), ("list_width", "i32"),
    ("nq_cap", "i32"), ("qmask_words", "i32"), ("union_words", "i32"), ("num_splits", "i32"),
    ("row_tiles", "i32"), ("batch", "i32"), ("l2_section", "i32"), ("scale_log2", "f32"), ("out_scale", "f32"),
    ("q_map", "map"), ("k_map", "map"), ("v_map", "map"),
))
MERGE_PARAMS = KernelParams((
    ("ws_o", "ptr"), ("ws_lse", "ptr"), ("out", "ptr"), ("lse", "ptr"), ("cu_seqlens_q", "ptr"),
    ("qo_lens", "ptr"), ("total_q", "i32"), ("num_heads_q", "i32"), ("num_splits", "i32"),
    ("out_tok_stride", "i64"), ("out_head_stride", "i64"),
))


# ----------------------------------------------------------------------------- problem and configuration


@dataclass(frozen=True)
class AttentionProblem:
    """One attention pass, as far as its configuration is concerned.

    ``kv_mode``: :data:`KV_DENSE`, :data:`KV_PAGED` or :data:`KV_SPARSE`; ``page_size`` 0
    for dense KV (a power of two otherwise, 128 when sparse); ``list_width`` the ``W`` of
    ``kv_block_indexes [total_q, Hkv, W]`` (0 unless sparse); ``dtype_code`` 0 fp16,
    1 bf16, 2 e4m3; ``num_kv_splits <= 0`` lets the configuration choose; ``gather``: the
    plan asks for the block-stationary tile.
    """

    kv_mode: int
    batch: int
    total_q: int
    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    dtype_code: int
    max_seqlen_q: int
    max_seqlen_k: int
    page_size: int
    list_width: int
    causal: bool
    sparse_decode: bool
    num_kv_splits: int
    gather: bool

    @property
    def group(self) -> int:
        return self.num_heads_q // self.num_heads_kv


@dataclass(frozen=True)
class AttentionConfig:
    """How one :class:`AttentionProblem` runs on one GPU.

    ``tile`` names the kernel shape (:data:`TILES`, or ``"gather"``; ``""`` when there is
    nothing to compute); ``grid``/``threads``/``shared_mem``/``page_size_log2`` launch the
    forward kernel; ``splits > 1`` adds the merge kernel on ``merge_grid``;
    ``workspace_bytes`` is the scratch the launch takes (split-KV partials or the gather
    tile's lists and partials). ``row_tiles``: the query row tiles per (request, KV head); a
    persistent tile's ``grid`` is ``(CTAs, 1, 1)`` over ``row_tiles x batch x (Hkv * splits)``
    work items, walked in L2 sections of ``l2_section`` (request, KV head, split) triples
    (:func:`l2_section`). ``nq_cap``, ``qmask_words``, ``union_words``: the block-sparse lists' shared
    memory (queries per CTA, membership words per query, union bitmap words).
    """

    tile: str
    spec: Optional[KernelSpec]
    grid: tuple
    threads: int
    shared_mem: int
    splits: int
    nq_cap: int
    qmask_words: int
    workspace_bytes: int
    num_sms: int
    page_size_log2: int = -1
    merge_grid: tuple = (0, 0)
    row_tiles: int = 0
    union_words: int = 0
    l2_section: int = 0


NOTHING = AttentionConfig("", None, (0, 0, 0), 0, 0, 1, 0, 0, 0, 0)


def choose_splits(ctas: int, max_tiles: int, num_sms: int, ctas_per_sm: int) -> int:
    """Split-KV factor: 1 when the grid already fills the GPU, else the smallest factor within
    85% of the best wave efficiency (FlashAttention-2's rule), at most ``max_tiles // 2``."""
    slots = max(1, num_sms * ctas_per_sm)
    if ctas <= 0 or ctas >= 0.8 * slots:
        return 1
    max_s = max(1, min(MAX_SPLITS, max_tiles // 2 if max_tiles >= 4 else 1))
    effs = []
    for s in range(1, max_s + 1):
        waves = ctas * s / slots
        effs.append(waves / math.ceil(waves))
    best = max(effs)
    for s, e in enumerate(effs, start=1):
        if e >= 0.85 * best:
            return s
    return 1


def split_workspace_bytes(total_q: int, num_heads_q: int, head_dim: int, splits: int) -> int:
    """Bytes of the split-KV partials: O ``[splits, total_q * Hq, D]`` and LSE, float32."""
    if splits <= 1:
        return 0
    return int(splits) * int(total_q) * int(num_heads_q) * (int(head_dim) + 1) * 4


def _gather_applies(p: AttentionProblem, cc: int) -> bool:
    return p.gather and p.kv_mode == KV_SPARSE and gather_launch.applies(
        cc=cc, dtype_code=p.dtype_code, head_dim=p.head_dim, group=p.group, page_size=p.page_size,
        sparse_decode=p.sparse_decode, batch=p.batch, max_seqlen_q=p.max_seqlen_q,
        max_seqlen_k=max(1, p.max_seqlen_k), num_heads_kv=p.num_heads_kv, total_q=p.total_q, width=p.list_width)


def choose_tile(p: AttentionProblem, cc: int) -> str:
    """The tile of ``p`` on a GPU of compute capability ``cc`` (see the module docstring)."""
    if p.kv_mode == KV_SPARSE:
        if p.sparse_decode:
            return "decode"
        if _gather_applies(p, cc):
            return GATHER
    elif p.max_seqlen_q * p.group <= 16:
        return "decode"
    if cc != 90 or p.dtype_code == DTYPE_E4M3 or p.head_dim not in (64, 128):
        return "prefill"
    if p.kv_mode == KV_SPARSE:
        # three stages where the lists and the union scratch leave room for them, else two
        for tile in (WS_TILE, WS_SPARSE_TILE):
            if _smem_bytes(p, tile_shape(tile, p.head_dim, p.dtype_code))[0] <= SMEM_LIMIT:
                return tile
        return "prefill"
    return WS_TILE


def _smem_bytes(p: AttentionProblem, shape: TileShape) -> tuple:
    """(dynamic shared bytes, nq_cap, qmask_words, union_words) of ``p`` on ``shape``."""
    smem = smem_layout(shape, p.head_dim, p.dtype_code, p.kv_mode)["fixed"] + (WG_PAD if shape.producer else 0)
    nq_cap = qwords = words = 0
    if p.kv_mode == KV_SPARSE:
        nq_cap = min((shape.rows - 1) // p.group + 2, max(1, p.max_seqlen_q))
        words = union_words(p.max_seqlen_k) if shape.producer else 0
        extra, qwords = sparse_smem_bytes(nq_cap, p.list_width, words)
        smem += extra
    return smem, nq_cap, qwords, words


def l2_section(p: AttentionProblem, splits: int) -> int:
    """(request, KV head, split) triples whose K and V fit in :data:`L2_BYTES` together, a
    power of two (at least 1, at most all of them): the persistent tile walks all row tiles
    of one such section, heaviest first, before the next, so each K/V tile is read from
    memory about once however many row tiles share it (FlashAttention-3's L2 swizzle)."""
    keys = -(-max(1, p.max_seqlen_k) // splits)
    kv_bytes = 2 * keys * _row_bytes(p.head_dim, p.dtype_code)
    fit = max(1, L2_BYTES // kv_bytes)
    return min(1 << (fit.bit_length() - 1), p.batch * p.num_heads_kv * splits)


def tile_config(p: AttentionProblem, tile: str, sm_count: int) -> AttentionConfig:
    """The launch configuration of ``p`` with the query tile ``tile`` (a name of :data:`TILES`)."""
    shape = tile_shape(tile, p.head_dim, p.dtype_code)
    smem, nq_cap, qwords, words = _smem_bytes(p, shape)
    group = p.group
    packed = p.max_seqlen_q * group
    row_tiles = max(1, -(-packed // shape.rows))
    max_seqlen_k = max(1, p.max_seqlen_k)
    if p.kv_mode == KV_SPARSE:
        n_blocks = -(-max_seqlen_k // SPARSE_BLOCK)
        max_tiles = min(nq_cap * p.list_width, n_blocks) * (SPARSE_BLOCK // shape.block_n)
    else:
        max_tiles = -(-max_seqlen_k // shape.block_n)
    ctas = row_tiles * p.batch * p.num_heads_kv
    per_sm = max(1, min(shape.min_blocks, SMEM_PER_SM // (smem + 1024)))
    if p.num_kv_splits > 0:
        splits = min(p.num_kv_splits, MAX_SPLITS)
    else:
        splits = choose_splits(ctas, max_tiles, sm_count, per_sm)
    splits = max(1, min(splits, max(1, max_tiles), MAX_GRID_YZ // p.num_heads_kv))
    grid = (row_tiles, p.batch, p.num_heads_kv * splits)
    if shape.producer:  # persistent: at most one wave of CTAs walks the work items
        grid = (min(row_tiles * p.batch * p.num_heads_kv * splits, sm_count * per_sm), 1, 1)
    return AttentionConfig(
        tile=tile, spec=SPECS[(p.head_dim, p.dtype_code, tile, p.kv_mode)],
        grid=grid, row_tiles=row_tiles, threads=shape.threads, shared_mem=smem,
        splits=splits, nq_cap=nq_cap, qmask_words=qwords, union_words=words,
        l2_section=l2_section(p, splits) if shape.producer else 0,
        workspace_bytes=split_workspace_bytes(p.total_q, p.num_heads_q, p.head_dim, splits), num_sms=sm_count,
        page_size_log2=p.page_size.bit_length() - 1 if p.kv_mode != KV_DENSE else -1,
        merge_grid=(-(-p.max_seqlen_q * p.num_heads_q // 4), p.batch))


@functools.lru_cache(maxsize=4096)
def select_config(problem: AttentionProblem, sm_count: int, cc: int) -> AttentionConfig:
    """The configuration of ``problem`` on a GPU with ``sm_count`` SMs of compute capability
    ``cc`` (e.g. 90). Pure: the same inputs give the same launches."""
    p = problem
    if p.batch == 0 or p.total_q == 0 or p.max_seqlen_q <= 0:
        return NOTHING
    tile = choose_tile(p, cc)
    if tile == GATHER:
        need = gather_launch.workspace_bytes(total_q=p.total_q, num_heads_kv=p.num_heads_kv, width=p.list_width,
                                             batch=p.batch, max_seqlen_q=p.max_seqlen_q,
                                             max_seqlen_k=max(1, p.max_seqlen_k))
        return AttentionConfig(GATHER, None, (0, 0, 0), 0, 0, 1, 0, 0, need, sm_count)
    return tile_config(p, tile, sm_count)


def config_specs(config: AttentionConfig, dtype_code: int) -> tuple:
    """The kernel variants ``config`` launches (for loading them ahead of a first call)."""
    if config.tile == GATHER:
        return (gather_launch.SPECS[dtype_code],)
    return () if config.spec is None else (config.spec,)


def config_kernels(config: AttentionConfig, device: int) -> tuple:
    """The loaded ``(forward, merge)`` kernels of a query-tile ``config`` on ``device``
    (merge None without split-KV); ``(None, None)`` for the gather tile or an empty config."""
    if config.spec is None:
        return (None, None)
    merge = get_kernel(config.spec, KERNELS[1], device) if config.splits > 1 else None
    return (get_kernel(config.spec, KERNELS[0], device), merge)


def load_config(config: AttentionConfig, dtype_code: int, device: int) -> None:
    """Compile and load the kernels of ``config`` on ``device``."""
    for spec in config_specs(config, dtype_code):
        load(spec, device)


# ----------------------------------------------------------------------------- launch


def run_attention(problem: AttentionProblem, config: AttentionConfig, arrays: tuple, lengths: tuple, pages: tuple,
                  layout: tuple, scales: tuple, workspace: int, device: int, stream: int,
                  kernels: Optional[tuple] = None) -> None:
    """Launch ``problem`` as ``config`` says, on the stream address ``stream``.

    Arrays are ``Arg`` views (``.ptr``, ``.shape``) or None:

    * ``arrays = (q, k, v, out, lse)``: q ``[total_q, Hq, D]``, k/v dense ``[total_k, Hkv, D]``
      or paged, out like q, lse ``[total_q, Hq]`` float32 or None;
    * ``lengths = (cu_seqlens_q, qo_lens, kv_lens, qo_offset, cu_seqlens_k)`` int32
      (``cu_seqlens_k`` None unless dense; ``kv_lens`` the keys each request reads);
    * ``pages = (page_list, page_indptr, page_list_len, block_lists)``: a page table
      ``[B, page_list_len]`` (``page_indptr`` None) or CSR ids with ``page_indptr [B+1]``
      (paged/sparse), ``block_lists`` ``[total_q, Hkv, W]`` int32 (sparse); None for dense;
    * ``layout = (q_strides, out_strides, k_strides, v_strides, kv_extent)``: (token, head)
      strides of q and out, (page, slot, head) strides of k and v in elements (dense:
      ``(0, token, head)``), the rows or pages of k;
    * ``scales = (scale_log2, out_scale)``: ``sm_scale * log2(e)`` (times ``k_scale`` for
      e4m3) and ``v_scale`` for e4m3, else 1.

    ``workspace``: the address of at least ``config.workspace_bytes`` bytes (16-byte
    aligned), 0 when none is needed. ``kernels``: the loaded ``(forward, merge)`` kernels of
    ``config`` on ``device`` (:func:`config_kernels`), looked up when None. The current
    CUDA device must be ``device``.
    """
    p = problem
    tile = config.tile
    if tile == "":
        return
    q, k, v, out, lse = arrays
    cu_seqlens_q, qo_lens, kv_lens, qo_offset, cu_seqlens_k = lengths
    page_list, page_indptr, page_list_len, block_lists = pages
    q_strides, out_strides, k_strides, v_strides, kv_extent = layout
    scale_log2, out_scale = scales
    if tile == GATHER:
        gather_launch.run_gather(
            q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q, qo_lens=qo_lens, kv_lens=kv_lens,
            qo_offset=qo_offset, page_list=page_list, page_indptr=page_indptr, page_list_len=page_list_len,
            kv_block_indexes=block_lists, q_strides=q_strides, k_strides=k_strides, v_strides=v_strides,
            out_strides=out_strides, kv_extent=kv_extent, num_heads_kv=p.num_heads_kv, batch=p.batch,
            max_seqlen_q=p.max_seqlen_q, max_seqlen_k=max(1, p.max_seqlen_k), causal=p.causal,
            scale_log2=scale_log2, dtype_code=p.dtype_code, num_sms=config.num_sms, workspace_ptr=workspace,
            workspace_nbytes=config.workspace_bytes, stream=stream)
        return
    for kernel, grid, block, params, values, smem in attention_launches(
            p, config, arrays, lengths, pages, layout, scales, workspace,
            config_kernels(config, device) if kernels is None else kernels):
        launch(kernel, grid, block, params, values, shared_mem=smem, stream=stream)


def _map_strides(dims: tuple, strides: tuple, element: int) -> tuple:
    """Byte strides of dims 1.. of a tensor map; a dimension of one index (whose stride the
    validation leaves free) takes the packed stride, a multiple of 16 like the others."""
    out, packed = [], dims[0] * element
    for n, s in zip(dims[1:], strides):
        out.append(s * element if n > 1 else -(-packed // 16) * 16)
        packed = out[-1] * n
    return tuple(out)


def tensor_maps(p: AttentionProblem, config: AttentionConfig, q, k, v, q_strides: tuple, k_strides: tuple,
                v_strides: tuple, kv_extent: int) -> tuple:
    """The ``(q_map, k_map, v_map)`` parameters of a launch (``attention/mainloop_sm90.cuh``).

    The warp-specialised tiles load K/V by boxes of (64 columns, 1 head, 128 keys) of dense
    ``[kv_extent, Hkv, D]``, or of (64 columns, 1 head, min(page, 128) slots, 1 page) of the
    cache's ``(D, Hkv, page, pages)`` view (NHD or HND strides) for pages of at least
    :data:`WS_MIN_BOX_PAGE` keys (block-sparse: pages of 128), and Q by boxes of (64 columns,
    group heads, 128 / group queries) of ``[total_q, Hq, D]`` where the group divides 128.
    Every other launch or operand takes none (:data:`NO_MAP`). ``q``, ``k``, ``v``: addresses
    (or prepared-launch sources); strides in elements as :func:`run_attention`'s ``layout``."""
    if config.tile not in WS_TILES:
        return NO_MAP, NO_MAP, NO_MAP
    dtype = DTYPE_BFLOAT16 if p.dtype_code == DTYPE_BF16 else DTYPE_FLOAT16
    d, shape = p.head_dim, tile_shape(config.tile, p.head_dim, p.dtype_code)
    q_map = NO_MAP
    if shape.rows % p.group == 0:
        dims = (d, p.num_heads_q, p.total_q)
        q_map = TensorMap(q, dtype, dims, _map_strides(dims, (q_strides[1], q_strides[0]), 2),
                          (64, p.group, shape.rows // p.group))
    if kv_extent <= 0 or (p.kv_mode == KV_PAGED and p.page_size < WS_MIN_BOX_PAGE):
        return q_map, NO_MAP, NO_MAP
    # dims after the columns, with the positions of their strides in (page, slot, head)
    if p.kv_mode == KV_DENSE:
        dims, order, box = (d, p.num_heads_kv, kv_extent), (2, 1), (64, 1, shape.block_n)
    else:
        dims, order = (d, p.num_heads_kv, p.page_size, kv_extent), (2, 1, 0)
        box = (64, 1, min(p.page_size, shape.block_n), 1)
    k_map, v_map = (TensorMap(a, dtype, dims, _map_strides(dims, tuple(s[i] for i in order), 2), box)
                    for a, s in ((k, k_strides), (v, v_strides)))
    return q_map, k_map, v_map


def attention_launches(problem: AttentionProblem, config: AttentionConfig, arrays: tuple, lengths: tuple,
                       pages: tuple, layout: tuple, scales: tuple, workspace: int, kernels: tuple) -> tuple:
    """The launches of a query-tile ``config`` (not the gather tile): ``(kernel, grid, block,
    params, values, shared_mem)`` each, arguments as :func:`run_attention` (``kernels`` the
    loaded pair). Pointer values are the operands' ``.ptr`` (an address, or a
    :class:`mate_cupy.jit.Source` for a prepared launch); every other value follows from
    the arguments."""
    p = problem
    q, k, v, out, lse = arrays
    cu_seqlens_q, qo_lens, kv_lens, qo_offset, cu_seqlens_k = lengths
    page_list, page_indptr, page_list_len, block_lists = pages
    q_strides, out_strides, k_strides, v_strides, kv_extent = layout
    scale_log2, out_scale = scales
    ws_o = ws_lse = 0
    splits = config.splits
    if splits > 1:
        ws_o = workspace
        ws_lse = workspace + splits * p.total_q * p.num_heads_q * p.head_dim * 4
    fwd, merge = kernels
    lse_ptr = 0 if lse is None else lse.ptr
    out_ptr = out.ptr
    cu_q, qo = cu_seqlens_q.ptr, qo_lens.ptr
    launches = ((fwd, config.grid, (config.threads,), FWD_PARAMS, (
        q.ptr, k.ptr, v.ptr, out_ptr, lse_ptr, ws_o, ws_lse, cu_q, qo, kv_lens.ptr, qo_offset.ptr,
        0 if cu_seqlens_k is None else cu_seqlens_k.ptr, 0 if page_list is None else page_list.ptr,
        0 if page_indptr is None else page_indptr.ptr, 0 if block_lists is None else block_lists.ptr,
        q_strides[0], q_strides[1], out_strides[0], out_strides[1], k_strides[0], k_strides[1], k_strides[2],
        v_strides[0], v_strides[1], v_strides[2], p.total_q, kv_extent, p.num_heads_q, p.num_heads_kv, p.group,
        int(p.causal), config.page_size_log2, page_list_len, p.list_width, config.nq_cap, config.qmask_words,
        config.union_words, splits, config.row_tiles, p.batch, config.l2_section, scale_log2, out_scale,
        *tensor_maps(p, config, q.ptr, k.ptr, v.ptr, q_strides, k_strides, v_strides, kv_extent),
    ), config.shared_mem),)
    if splits > 1:
        launches += ((merge, config.merge_grid, (128,), MERGE_PARAMS, (
            ws_o, ws_lse, out_ptr, lse_ptr, cu_q, qo, p.total_q, p.num_heads_q, splits, out_strides[0],
            out_strides[1],
        ), 0),)
    return launches
