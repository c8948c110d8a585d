"""Launchers of the MSA attention kernels (``cuda_src/attention_fwd.cu``).

:func:`run_attention` runs dense, paged and block-sparse attention forward on
CuPy arrays (signature in ``docs/design.md``, "Kernel entry points"). It only
checks what memory safety needs (shapes, dtypes, strides, alignment), picks a
compiled variant and a launch geometry from host-known sizes, and launches on
the given stream. It never reads device data and never allocates, except the
split-KV workspace (allocated once per device and size class when the caller
passes none, then reused; see :func:`split_workspace_bytes`).

Variants (all registered at import, so ``compile_all`` builds them):
``ATT_HEAD_DIM`` in {64, 128, 256} x ``ATT_DTYPE`` (fp16, bf16, e4m3) x tile
shape ("prefill": 64/128-row mma.sync tiles; "decode": 16-row tiles with the keys of a
tile split over 4 warps; "mma256*": 256-row mma.sync tiles for block-sparse prefill;
"wg*": warpgroup-MMA tiles, sm_90a, fp16/bf16, D 64/128) x ``ATT_KV`` (dense key
range, paged key range, or the union of the selected 128-key blocks). Causality,
paging, page size, KV layout and strides are runtime arguments. Design notes:
``docs/attention.md``.

The prefill tile can be chosen per plan (``msa_plan_from_lengths(..., prefill_tile=...)``,
``msa_plan``, ``sparse_msa_plan``), per call (``run_attention(prefill_tile=...)``) or per
process through ``MATE_CUPY_ATTN_PREFILL_TILE`` (dense/paged) and
``MATE_CUPY_ATTN_SPARSE_TILE`` (block-sparse prefill), read at every call when the plan
names none; a tile that does not apply to the call (head dim, dtype, GPU) falls back to
the default.
Block-sparse prefill also takes ``"gather"``: the block-stationary kernels of
``cuda_src/attention_gather.cu`` (:mod:`mate_cupy.msa.gather_kernels`), for block lists
chosen per query token.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .._device import device_info
from .._interop import BFLOAT16, FLOAT16, FLOAT32, INT32
from .._launch_cache import launch, note_const
from ..jit import get_kernel, register
from . import gather_kernels

SOURCE = "attention_fwd.cu"
KERNELS = ("msa_attention_fwd_kernel", "msa_attention_merge_kernel")
HEAD_DIMS = (64, 128, 256)
DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float8_e4m3fn": 2}
SPARSE_BLOCK = 128
MAX_SPLITS = 128
SMEM_LIMIT = 227 * 1024  # per-block opt-in limit on sm_80 / sm_90
SMEM_PER_SM = 228 * 1024


@dataclass(frozen=True)
class TileConfig:
    """One CTA shape: warps_m x warps_n warps, mtiles 16-row tiles per warp,
    block_n keys per K/V tile (split over warps_n), `stages`-deep cp.async ring."""

    kind: str
    warps_m: int
    mtiles: int
    warps_n: int
    block_n: int
    stages: int
    min_blocks: int
    wgmma: bool = False
    name: str = ""
    rotated: bool = False

    @property
    def rows(self) -> int:
        return self.warps_m * self.mtiles * 16

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n


# Warpgroup-MMA prefill tiles: name -> (warpgroups, keys per tile, stages, rotated). Each
# warpgroup owns 64 rows (one 16-row m-tile per warp); one CTA per SM (two for wg1n64s2).
# "Rotated" tiles run warpgroup 1 one phase behind warpgroup 0, so one's softmax overlaps
# the other's MMAs. The tiles kept after the H200 sweep (bench/sweeps/perf_attn.py;
# docs/attention.md has the table): wg3n64s3 led dense prefill overall, wg2n128s2
# block-sparse prefill, wg2n128s3r the long causal S8192 case. wg1n64s2 (one warpgroup, two
# CTAs per SM, no barrier shared between warpgroups) is 6% faster than wg2n128s2 on
# per-token block lists and 11% slower on lists shared by a query tile; the launcher cannot
# tell the two apart, so it is opt-in (``prefill_tile`` / ``MATE_CUPY_ATTN_SPARSE_TILE``).
# wg2n64s3, wg2n64s2, wg2n64s3r and wg2n64s4r were slower everywhere.
WG_TILES = {"wg2n128s2": (2, 128, 2, False), "wg3n64s3": (3, 64, 3, False), "wg2n128s3r": (2, 128, 3, True),
            "wg1n64s2": (1, 64, 2, False)}
WG_DENSE_ONLY = ("wg2n128s3r",)  # its 3 x 64 KB ring leaves no room for the sparse block lists
# mma.sync 256-row tiles for block-sparse prefill: name -> stages (deeper rings keep more
# K/V bytes in flight: one CTA per SM).
MMA256_TILES = {"mma256": 3}
PREFILL_TILES = ("prefill",) + tuple(MMA256_TILES) + tuple(WG_TILES)
WG_PAD = 1024  # extra shared bytes of a wgmma tile: the kernel aligns its tiles to 1024 bytes


def tile_applies(name: str, head_dim: int, dtype_code: int, sparse: bool, cc: int = 90) -> bool:
    """Whether the prefill tile ``name`` exists for this head dim / dtype / KV mode / GPU."""
    if name == "prefill":
        return True
    if name in MMA256_TILES:
        return sparse and head_dim in (64, 128)
    if name in WG_TILES:
        return cc == 90 and dtype_code in (0, 1) and head_dim in (64, 128) and not (sparse and name in WG_DENSE_ONLY)
    return False


def tile_config(kind: str, head_dim: int, dtype_code: int) -> TileConfig:
    """The tile shape of a variant. e4m3 needs 32 keys per warp (k32 PV mma)."""
    fp8 = dtype_code == 2
    if kind == "prefill":
        if head_dim == 64:
            return TileConfig(kind, 4, 2, 1, 128, 2, 2, name=kind)
        if head_dim == 128:
            return TileConfig(kind, 4, 2, 1, 64, 2, 2, name=kind)
        return TileConfig(kind, 4, 1, 1, 32, 2, 2, name=kind)
    if kind in MMA256_TILES:  # 8 warps x 2 m-tiles: 16 queries of a 16-head group share each block load
        return TileConfig("prefill", 8, 2, 1, 128 if head_dim == 64 else 64, MMA256_TILES[kind], 1, name=kind)
    if kind in WG_TILES:
        wgs, bn, stages, rot = WG_TILES[kind]
        return TileConfig("prefill", 4 * wgs, 1, 1, bn, stages, 1, wgmma=True, name=kind, rotated=rot)
    if kind == "decode":
        if head_dim == 64:
            return TileConfig(kind, 1, 1, 4, 128, 3, 2, name=kind)
        if head_dim == 128:
            return TileConfig(kind, 1, 1, 4, 128 if fp8 else 64, 3, 2, name=kind)
        return TileConfig(kind, 1, 1, 4, 128 if fp8 else 64, 2, 1, name=kind)
    raise ValueError(f"unknown tile kind {kind!r}")


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def smem_layout(cfg: TileConfig, head_dim: int, dtype_code: int) -> dict:
    """Fixed shared-memory layout, mirrored by the kernel (checked by static_assert)."""
    row_bytes = head_dim * (1 if dtype_code == 2 else 2)
    q_bytes = cfg.rows * row_bytes
    stage_bytes = 2 * cfg.block_n * row_bytes
    epi_bytes = cfg.warps_n * cfg.rows * (head_dim + 8) * 4 + 3 * cfg.warps_n * cfg.rows * 4
    region = _round_up(max(cfg.stages * stage_bytes, epi_bytes), 128)
    flags = _round_up(cfg.stages * cfg.block_n, 128)
    return {"q": q_bytes, "region": region, "flags": flags, "fixed": q_bytes + region + flags,
            "union_blocks": (region // 8) * 32}


def sparse_smem_bytes(nq_cap: int, width: int) -> tuple:
    """(bytes, qmask_words) of the per-CTA block lists of the sparse variant."""
    list_cap = nq_cap * width
    qwords = max(1, (list_cap + 31) // 32)
    return 4 * (2 * list_cap + nq_cap * qwords), qwords


_SPECS: dict = {}


def _register_all() -> None:
    for d in HEAD_DIMS:
        for code in DTYPE_CODES.values():
            for kind in ("decode",) + PREFILL_TILES:
                cfg = tile_config(kind, d, code)
                lay = smem_layout(cfg, d, code)
                for kv in (0, 1, 2):
                    if kind != "decode" and not tile_applies(kind, d, code, kv == 2):
                        continue
                    min_sm = 90 if cfg.wgmma else (89 if code == 2 else 80)
                    _SPECS[(d, code, kind, kv)] = register(
                        SOURCE, KERNELS, min_sm=min_sm, ATT_HEAD_DIM=d, ATT_DTYPE=code, ATT_WARPS_M=cfg.warps_m,
                        ATT_MTILES=cfg.mtiles, ATT_WARPS_N=cfg.warps_n, ATT_BLOCK_N=cfg.block_n,
                        ATT_STAGES=cfg.stages, ATT_KV=kv, ATT_MIN_BLOCKS=cfg.min_blocks,
                        ATT_WGMMA=int(cfg.wgmma), ATT_WG_ROT=int(cfg.rotated), ATT_SMEM_FIXED=lay["fixed"])


_register_all()


KV_DENSE, KV_PAGED, KV_SPARSE = 0, 1, 2


def attention_spec(head_dim: int, dtype_code: int, kind: str, kv_mode: int):
    """The registered variant; kv_mode 0 dense, 1 paged, 2 block-sparse."""
    return _SPECS[(head_dim, dtype_code, kind, int(kv_mode))]


# Order and C types of msa_attention_fwd_kernel's parameters (checked against
# the source by the CPU tests).
FWD_PARAMS = (
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("out", "ptr"), ("lse", "ptr"), ("ws_o", "ptr"),
    ("ws_lse", "ptr"), ("cu_seqlens_q", "ptr"), ("qo_lens", "ptr"), ("kv_lens", "ptr"), ("qo_offset", "ptr"),
    ("cu_seqlens_k", "ptr"), ("page_list", "ptr"), ("page_indptr", "ptr"), ("block_lists", "ptr"),
    ("q_tok_stride", "i64"), ("q_head_stride", "i64"), ("out_tok_stride", "i64"), ("out_head_stride", "i64"),
    ("k_page_stride", "i64"), ("k_slot_stride", "i64"), ("k_head_stride", "i64"),
    ("v_page_stride", "i64"), ("v_slot_stride", "i64"), ("v_head_stride", "i64"),
    ("total_q", "i32"), ("kv_extent", "i32"), ("num_heads_q", "i32"), ("num_heads_kv", "i32"), ("group", "i32"),
    ("causal", "i32"), ("page_size_log2", "i32"), ("page_list_len", "i32"), ("list_width", "i32"),
    ("nq_cap", "i32"), ("qmask_words", "i32"), ("num_splits", "i32"), ("scale_log2", "f32"),
    ("out_scale", "f32"),
)
MERGE_PARAMS = (
    ("ws_o", "ptr"), ("ws_lse", "ptr"), ("out", "ptr"), ("lse", "ptr"), ("cu_seqlens_q", "ptr"),
    ("qo_lens", "ptr"), ("total_q", "i32"), ("num_heads_q", "i32"), ("num_splits", "i32"),
    ("out_tok_stride", "i64"), ("out_head_stride", "i64"),
)
_CAST = {"i32": np.int32, "i64": np.int64, "f32": np.float32}


def _pack_args(params, values: dict) -> tuple:
    out = []
    for name, kind in params:
        x = values[name]
        if kind == "ptr":
            out.append(np.uintp(0) if x is None else x)
        else:
            out.append(_CAST[kind](x))
    return tuple(out)


# ---------------------------------------------------------------- geometry


@dataclass(frozen=True)
class LaunchGeometry:
    """Host-side launch decisions (no device data involved)."""

    kind: str
    cfg: TileConfig
    grid: tuple
    splits: int
    smem: int
    nq_cap: int
    qmask_words: int


def _device_info() -> tuple:
    """(SM count, compute capability as an int, e.g. 90) of the current device."""
    return device_info()


def _sm_count() -> int:
    return _device_info()[0]


def choose_splits(ctas: int, max_tiles: int, num_sms: int, ctas_per_sm: int) -> int:
    """Split-KV factor: 1 when the grid already fills the GPU, else the smallest
    factor within 85% of the best wave efficiency (FlashAttention-2's rule)."""
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


# Prefill tiles used when the caller names none (see the module docstring).
DEFAULT_PREFILL_TILE = "wg3n64s3"  # falls back to "prefill" (mma.sync) off sm_90 / fp8 / D=256
DEFAULT_SPARSE_TILE = "wg2n128s2"
ENV_PREFILL_TILE = "MATE_CUPY_ATTN_PREFILL_TILE"
ENV_SPARSE_TILE = "MATE_CUPY_ATTN_SPARSE_TILE"


def choose_prefill_tile(requested, *, head_dim: int, dtype_code: int, sparse: bool, cc: int) -> str:
    """The prefill tile of a call: ``requested`` when it applies, else the default."""
    if requested is not None and requested not in PREFILL_TILES:
        raise ValueError(f"unknown attention prefill tile {requested!r} (known: {', '.join(PREFILL_TILES)})")
    for name in (requested, DEFAULT_SPARSE_TILE if sparse else DEFAULT_PREFILL_TILE):
        if name is not None and tile_applies(name, head_dim, dtype_code, sparse, cc):
            return name
    return "prefill"


def launch_geometry(*, batch: int, num_heads_kv: int, group: int, head_dim: int, dtype_code: int,
                    max_seqlen_q: int, max_seqlen_k: int, sparse: bool, sparse_decode: bool,
                    list_width: int, num_kv_splits: int, num_sms: int, prefill_tile=None,
                    cc: int = 90) -> LaunchGeometry:
    """Tile shape, grid, split factor and shared memory for one call (pure host logic)."""
    packed = max_seqlen_q * group
    if sparse:
        kind = "decode" if (sparse_decode or group < 8) else "prefill"
    else:
        kind = "decode" if packed <= 16 else "prefill"
    if kind == "prefill":
        kind = choose_prefill_tile(prefill_tile, head_dim=head_dim, dtype_code=dtype_code, sparse=sparse, cc=cc)
    cfg = tile_config(kind, head_dim, dtype_code)
    lay = smem_layout(cfg, head_dim, dtype_code)
    smem = lay["fixed"] + (WG_PAD if cfg.wgmma else 0)
    nq_cap, qwords = 0, 0
    row_tiles = max(1, -(-packed // cfg.rows))
    if sparse:
        nq_cap = min((cfg.rows - 1) // group + 2, max(1, max_seqlen_q))
        extra, qwords = sparse_smem_bytes(nq_cap, list_width)
        smem += extra
        n_blocks = -(-max_seqlen_k // SPARSE_BLOCK)
        if n_blocks > lay["union_blocks"]:
            raise NotImplementedError(
                f"sparse attention supports max_seqlen_k up to {lay['union_blocks'] * SPARSE_BLOCK} keys, "
                f"got {max_seqlen_k}")
        max_tiles = min(nq_cap * list_width, n_blocks) * (SPARSE_BLOCK // cfg.block_n)
    else:
        max_tiles = -(-max_seqlen_k // cfg.block_n)
    if smem > SMEM_LIMIT:
        raise NotImplementedError(
            f"attention tile needs {smem} bytes of shared memory (limit {SMEM_LIMIT}); "
            f"reduce the sparse list width ({list_width})")
    ctas = row_tiles * batch * num_heads_kv
    per_sm = max(1, min(cfg.min_blocks, SMEM_PER_SM // (smem + 1024)))
    if num_kv_splits is not None and int(num_kv_splits) > 0:
        splits = min(int(num_kv_splits), MAX_SPLITS)
    else:
        splits = choose_splits(ctas, max_tiles, num_sms, per_sm)
    splits = max(1, min(splits, max(1, max_tiles)))
    grid = (row_tiles, batch, num_heads_kv * splits)
    return LaunchGeometry(kind, cfg, grid, splits, smem, nq_cap, qwords)


def split_workspace_bytes(total_q: int, num_heads_q: int, head_dim: int, splits: int) -> int:
    """Bytes of the split-KV workspace: partial O [splits, total_q*Hq, D] and LSE, float32."""
    if splits <= 1:
        return 0
    return int(splits) * int(total_q) * int(num_heads_q) * (int(head_dim) + 1) * 4


_WORKSPACES: dict = {}


def _checked_workspace(workspace, need: int):
    """The caller's workspace (checked: contiguous, 16-byte aligned, >= ``need`` bytes) or
    the cached one."""
    if workspace is None:
        return _cached_workspace(need)
    if workspace.nbytes < need or not workspace.flags.c_contiguous or workspace.data.ptr % 16:
        raise ValueError(f"workspace must be a contiguous 16-byte aligned array of at least {need} bytes, "
                         f"got {workspace.nbytes} bytes")
    return workspace


def _is_cached(workspace) -> bool:
    """Whether ``workspace`` is one of the cached buffers (they outlive recorded launches)."""
    return any(workspace is b for bufs in _WORKSPACES.values() for b in bufs)


def _cached_workspace(nbytes: int):
    """Per-device split workspace, grown geometrically and never freed while cached.

    Allocated on the first split-KV call of a size class, so a warm-up call before a
    CUDA-graph capture makes the captured call allocation-free. Calls on concurrent
    streams of one device share it: such callers pass their own ``workspace``.
    """
    import cupy

    dev = cupy.cuda.Device().id
    bufs = _WORKSPACES.setdefault(dev, [])
    if bufs and bufs[-1].nbytes >= nbytes:
        return bufs[-1]
    size = max(nbytes, 2 * bufs[-1].nbytes if bufs else 0, 1 << 20)
    buf = cupy.empty(size, dtype=np.uint8)
    bufs.append(buf)  # older buffers stay alive: queued kernels may still use them
    return buf


# ---------------------------------------------------------------- checks


def _dt(a) -> np.dtype:
    return np.dtype(a.dtype)


def _elem_strides(a, name: str) -> tuple:
    """Strides in elements; the last dim must be contiguous and rows 16-byte aligned."""
    item = a.dtype.itemsize
    if a.strides[-1] != item:
        raise ValueError(f"{name}: the head dimension must be contiguous (strides {a.strides}, itemsize {item})")
    for i, s in enumerate(a.strides[:-1]):
        if a.shape[i] > 1 and s % 16:
            raise ValueError(f"{name}: stride {s} bytes of dim {i} is not a multiple of 16 (strides {a.strides})")
    if a.size and a.data.ptr % 16:
        raise ValueError(f"{name}: data pointer is not 16-byte aligned")
    return tuple(s // item for s in a.strides)


def _int_vector(a, name: str, min_len: int):
    if a is None:
        raise ValueError(f"{name} is required")
    if _dt(a) != INT32 or a.ndim != 1 or not a.flags.c_contiguous:
        raise TypeError(f"{name} must be a contiguous 1-D int32 array, got dtype={a.dtype}, shape={a.shape}")
    if a.shape[0] < min_len:
        raise ValueError(f"{name} must have at least {min_len} entries, got {a.shape[0]}")
    return a


# ---------------------------------------------------------------- entry point


def run_attention(q, k, v, out, lse, *, cu_seqlens_q, qo_lens, kv_lens, qo_offset,
                  cu_seqlens_k=None, page_table=None, kv_indices=None, kv_page_indptr=None,
                  kv_layout="NHD", page_size=0, kv_block_indexes=None,
                  max_seqlen_q, max_seqlen_k, causal, sm_scale,
                  k_scale=1.0, v_scale=1.0, is_fp8=False,
                  num_kv_splits=-1, sparse_decode=False, workspace=None, stream=None,
                  prefill_tile=None) -> None:
    """Attention forward on CuPy arrays (dense, paged or block-sparse KV).

    q [total_q, Hq, D]; k, v dense [total_k, Hkv, D] (``page_size=0``) or paged
    ``"NHD"`` [pages, page_size, Hkv, D] / ``"HND"`` [pages, Hkv, page_size, D];
    fp16/bf16, or uint8 views of e4m3 with ``is_fp8``. out [total_q, Hq, D] in q's
    dtype (bf16 for e4m3); lse [total_q, Hq] float32 or None. Index arrays int32.
    Sparse: ``kv_block_indexes`` [total_q, Hkv, W] lists 128-key blocks (page size
    128); -1 and out-of-range ids are skipped. Rows of q that belong to no request,
    or lie past ``max_seqlen_q`` of their request, are not written. ``prefill_tile``
    names the prefill tile (``PREFILL_TILES``; default from the environment, see the
    module docstring).
    """
    import cupy

    sparse = kv_block_indexes is not None
    dense = not page_size or page_size <= 0
    if q.ndim != 3:
        raise ValueError(f"q must be [total_q, Hq, D], got shape {q.shape}")
    total_q, hq, d = map(int, q.shape)
    if d not in HEAD_DIMS:
        raise NotImplementedError(f"head dim {d} is not supported (supported: {HEAD_DIMS})")
    qdt = _dt(q)
    if is_fp8:
        if qdt != np.uint8:
            raise TypeError(f"is_fp8 expects uint8 views of float8_e4m3fn for q/k/v, got q dtype {q.dtype}")
        code, out_dt = 2, BFLOAT16
    elif qdt == FLOAT16:
        code, out_dt = 0, FLOAT16
    elif qdt == BFLOAT16:
        code, out_dt = 1, BFLOAT16
    else:
        raise TypeError(f"q must be float16, bfloat16 or float8_e4m3fn, got {q.dtype}")
    if _dt(k) != qdt or _dt(v) != qdt:
        raise TypeError(f"k and v must have q's dtype {q.dtype}, got {k.dtype} and {v.dtype}")
    if out is None or _dt(out) != out_dt or tuple(out.shape) != (total_q, hq, d):
        raise ValueError(f"out must be a {np.dtype(out_dt).name} array of shape {(total_q, hq, d)}, "
                         f"got {None if out is None else (out.dtype, out.shape)}")
    if lse is not None and (_dt(lse) != FLOAT32 or tuple(lse.shape) != (total_q, hq)
                            or not lse.flags.c_contiguous):
        raise ValueError(f"lse must be a contiguous float32 array of shape {(total_q, hq)}, "
                         f"got {lse.dtype} {lse.shape}")

    log2e = 1.4426950408889634
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    scale_log2 = float(sm_scale) * log2e * (float(k_scale) if is_fp8 else 1.0)
    if not (scale_log2 > 0.0 and math.isfinite(scale_log2)):
        raise NotImplementedError(
            f"the attention kernels need a positive finite softmax scale, got sm_scale={sm_scale}"
            + (f", k_scale={k_scale}" if is_fp8 else ""))

    # ---- KV geometry ----
    if dense:
        if sparse:
            raise ValueError("block-sparse attention needs a paged cache (page_size 128)")
        if k.ndim != 3 or k.shape != v.shape or k.shape[2] != d:
            raise ValueError(f"dense k/v must be [total_k, Hkv, {d}] of one shape, got {k.shape} and {v.shape}")
        hkv = int(k.shape[1])
        ks, vs = _elem_strides(k, "k"), _elem_strides(v, "v")
        k_strides = (0, ks[0], ks[1])
        v_strides = (0, vs[0], vs[1])
        kv_extent = int(k.shape[0])
        page_log2 = -1
    else:
        ps = int(page_size)
        if ps & (ps - 1):
            raise NotImplementedError(f"page_size must be a power of two, got {ps}")
        if sparse and ps != SPARSE_BLOCK:
            raise ValueError(f"block-sparse attention needs page_size == {SPARSE_BLOCK}, got {ps}")
        if k.ndim != 4 or k.shape != v.shape or k.shape[3] != d:
            raise ValueError(f"paged k/v must be 4-D [pages, ..., {d}] of one shape, got {k.shape} and {v.shape}")
        ks, vs = _elem_strides(k, "k"), _elem_strides(v, "v")
        if kv_layout == "NHD":
            if k.shape[1] != ps:
                raise ValueError(f"NHD k/v must be [pages, {ps}, Hkv, {d}], got {k.shape}")
            hkv = int(k.shape[2])
            k_strides, v_strides = (ks[0], ks[1], ks[2]), (vs[0], vs[1], vs[2])
        elif kv_layout == "HND":
            if k.shape[2] != ps:
                raise ValueError(f"HND k/v must be [pages, Hkv, {ps}, {d}], got {k.shape}")
            hkv = int(k.shape[1])
            k_strides, v_strides = (ks[0], ks[2], ks[1]), (vs[0], vs[2], vs[1])
        else:
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        kv_extent = int(k.shape[0])
        page_log2 = ps.bit_length() - 1
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"Hq ({hq}) must be a positive multiple of Hkv ({hkv})")
    group = hq // hkv
    qs = _elem_strides(q, "q")
    os_ = _elem_strides(out, "out")

    batch = int(qo_lens.shape[0]) if qo_lens is not None else 0
    _int_vector(qo_lens, "qo_lens", 0)
    _int_vector(cu_seqlens_q, "cu_seqlens_q", batch + 1)
    _int_vector(kv_lens, "kv_lens", batch)
    _int_vector(qo_offset, "qo_offset", batch)
    page_list, page_indptr, page_list_len = None, None, 0
    if dense:
        _int_vector(cu_seqlens_k, "cu_seqlens_k", batch + 1)
    elif page_table is not None:
        if kv_indices is not None:
            raise ValueError("page_table and kv_indices are mutually exclusive")
        if _dt(page_table) != INT32 or page_table.ndim != 2 or not page_table.flags.c_contiguous:
            raise TypeError(f"page_table must be a contiguous 2-D int32 array, got {page_table.dtype} "
                            f"{page_table.shape}")
        if page_table.shape[0] < batch:
            raise ValueError(f"page_table has {page_table.shape[0]} rows for {batch} requests")
        page_list, page_list_len = page_table, int(page_table.shape[1])
    else:
        _int_vector(kv_indices, "kv_indices", 0)
        _int_vector(kv_page_indptr, "kv_page_indptr", batch + 1)
        page_list, page_indptr, page_list_len = kv_indices, kv_page_indptr, int(kv_indices.shape[0])
    width = 0
    if sparse:
        kbi = kv_block_indexes
        if _dt(kbi) != INT32 or kbi.ndim != 3 or not kbi.flags.c_contiguous:
            raise TypeError(f"kv_block_indexes must be a contiguous 3-D int32 array, got {kbi.dtype} {kbi.shape}")
        if tuple(kbi.shape[:2]) != (total_q, hkv):
            raise ValueError(f"kv_block_indexes must be [{total_q}, {hkv}, W], got {kbi.shape}")
        width = int(kbi.shape[2])
        if width <= 0:
            raise ValueError("kv_block_indexes must have a positive last dimension")
    if total_q * hq >= 2**31 or kv_extent >= 2**31:
        raise NotImplementedError("total_q * Hq and the KV extent must stay below 2**31")

    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    if batch == 0 or total_q == 0 or max_seqlen_q <= 0:
        return
    if prefill_tile is None:
        prefill_tile = os.environ.get(ENV_SPARSE_TILE if sparse else ENV_PREFILL_TILE) or None
    num_sms, cc = _device_info()
    if prefill_tile == gather_kernels.GATHER_TILE:
        if sparse and gather_kernels.applies(
                cc=cc, dtype_code=code, head_dim=d, group=group, page_size=0 if dense else int(page_size),
                sparse_decode=bool(sparse_decode), batch=batch, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max(1, max_seqlen_k), num_heads_kv=hkv, total_q=total_q, width=width):
            need = gather_kernels.workspace_bytes(total_q=total_q, num_heads_kv=hkv, width=width, batch=batch,
                                                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max(1, max_seqlen_k))
            workspace = _checked_workspace(workspace, need)
            gather_kernels.run_gather(
                q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q, qo_lens=qo_lens, kv_lens=kv_lens,
                qo_offset=qo_offset, page_list=page_list, page_indptr=page_indptr, page_list_len=page_list_len,
                kv_block_indexes=kv_block_indexes, q_strides=qs, k_strides=k_strides, v_strides=v_strides,
                out_strides=os_, kv_extent=kv_extent, num_heads_kv=hkv, batch=batch, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max(1, max_seqlen_k), causal=causal, scale_log2=scale_log2, dtype_code=code,
                num_sms=num_sms, workspace=workspace.view(np.uint8).reshape(-1), workspace_cached=_is_cached(workspace),
                stream=cupy.cuda.get_current_stream() if stream is None else stream)
            return
        prefill_tile = None  # (the gather tile does not apply: the default one runs)
    geo = launch_geometry(batch=batch, num_heads_kv=hkv, group=group, head_dim=d, dtype_code=code,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max(1, max_seqlen_k), sparse=sparse,
                          sparse_decode=bool(sparse_decode), list_width=width,
                          num_kv_splits=num_kv_splits, num_sms=num_sms, prefill_tile=prefill_tile, cc=cc)
    if geo.grid[1] > 65535 or geo.grid[2] > 65535:
        raise NotImplementedError(f"grid {geo.grid} exceeds the CUDA limits (batch and Hkv*splits <= 65535)")

    ws_o = ws_lse = None
    if geo.splits > 1:
        need = split_workspace_bytes(total_q, hq, d, geo.splits)
        workspace = _checked_workspace(workspace, need)
        flat = workspace.view(np.uint8).reshape(-1)
        n_o = geo.splits * total_q * hq * d * 4
        ws_o = flat[:n_o].view(np.float32)
        ws_lse = flat[n_o:need].view(np.float32)
        if _is_cached(workspace):
            note_const(ws_o, ws_lse)  # a cached workspace outlives recorded launches (replay)

    out_scale = float(v_scale) if is_fp8 else 1.0
    spec = attention_spec(d, code, geo.cfg.name, KV_SPARSE if sparse else (KV_DENSE if dense else KV_PAGED))
    values = dict(
        q=q, k=k, v=v, out=out, lse=lse, ws_o=ws_o, ws_lse=ws_lse, cu_seqlens_q=cu_seqlens_q, qo_lens=qo_lens,
        kv_lens=kv_lens, qo_offset=qo_offset, cu_seqlens_k=cu_seqlens_k if dense else None, page_list=page_list,
        page_indptr=page_indptr, block_lists=kv_block_indexes if sparse else None,
        q_tok_stride=qs[0], q_head_stride=qs[1], out_tok_stride=os_[0], out_head_stride=os_[1],
        k_page_stride=k_strides[0], k_slot_stride=k_strides[1], k_head_stride=k_strides[2],
        v_page_stride=v_strides[0], v_slot_stride=v_strides[1], v_head_stride=v_strides[2],
        total_q=total_q, kv_extent=kv_extent, num_heads_q=hq, num_heads_kv=hkv, group=group,
        causal=1 if causal else 0, page_size_log2=page_log2, page_list_len=page_list_len, list_width=width,
        nq_cap=geo.nq_cap, qmask_words=geo.qmask_words, num_splits=geo.splits, scale_log2=scale_log2,
        out_scale=out_scale,
    )
    stream = cupy.cuda.get_current_stream() if stream is None else stream
    fwd = get_kernel(spec, KERNELS[0])
    launch(fwd, geo.grid, (geo.cfg.threads,), _pack_args(FWD_PARAMS, values), shared_mem=geo.smem, stream=stream)
    if geo.splits > 1:
        merge = get_kernel(spec, KERNELS[1])
        rows = max_seqlen_q * hq
        mvalues = dict(ws_o=ws_o, ws_lse=ws_lse, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q, qo_lens=qo_lens,
                       total_q=total_q, num_heads_q=hq, num_splits=geo.splits, out_tok_stride=os_[0],
                       out_head_stride=os_[1])
        launch(merge, (-(-rows // 4), batch), (128,), _pack_args(MERGE_PARAMS, mvalues), stream=stream)
