"""Launcher of the KDA chunked prefill kernels (``cuda_src/kda_chunk.cu``).

``run_chunk`` is the CUDA path of ``chunk_kda``. Two kernels per call (plus a small
prefix kernel for varlen); see ``docs/kda_chunk.md`` for the algorithm:

1. ``kda_chunk_prepare_kernel``: one CTA per (64-token chunk, value head), fully
   parallel. Writes a workspace slot per (chunk, value head).
2. ``kda_chunk_recurrence_kernel``: one CTA per (sequence, value head, V slice),
   sequential over the chunks, state in float32 registers.

The workspace (66,048 bytes per chunk and value head: about 0.5 of the bytes of q, k,
v and g together) is allocated per call from CuPy's memory pool on the caller's
stream. Everything else is launched without host synchronisation: varlen chunk
offsets are computed on the device.
"""
from __future__ import annotations

import os

import numpy as np

from .._device import device_info
from .._interop import BFLOAT16, FLOAT16, FLOAT32, INT32, INT64, dtype_name
from .._launch_cache import launch, note_alloc
from ..jit import get_kernel, register

CHUNK = 64
HEAD_DIM = 128
SLOT_BYTES = 66048  # Qs, Kt, Kb [64, 128] + T, Aqk [64, 64] in the input dtype, egl [128] f32
_SLOT_PARTS = {  # name: (byte offset, shape, dtype or None for the input dtype)
    "Qs": (0, (CHUNK, HEAD_DIM), None),
    "Kt": (16384, (CHUNK, HEAD_DIM), None),
    "Kb": (32768, (CHUNK, HEAD_DIM), None),
    "T": (49152, (CHUNK, CHUNK), None),
    "Aqk": (57344, (CHUNK, CHUNK), None),
    "egl": (65536, (HEAD_DIM,), FLOAT32),
}
PREPARE_THREADS = 256
PREPARE_SMEM = 2 * 64 * 144 * 2 + 64 * 144 * 4 + 3 * 64 * 4 + 128 * 4 + 16  # 75,024 bytes: three CTAs per SM
PREPARE_BASELINE_SMEM = 2 * 64 * 136 * 2 + 64 * 132 * 4 + 64 * 136 * 2 + 3 * 64 * 4 + 16  # 86,800 bytes
PREPARE_VARIANTS = ("default", "baseline")  # MATE_CUPY_KDA_CHUNK_PREPARE (tuning / comparison)
RECURRENCE_WARPS = (1, 2, 4, 8)  # V slice = 16 * warps rows of the state per CTA

_CTYPE = {FLOAT16: "half_t", BFLOAT16: "bf16_t"}
OFFSETS_KERNEL = "kda_chunk_offsets_kernel"


def _prepare_name(ct: str, variant: str = "default") -> str:
    stem = "kda_chunk_prepare_baseline_kernel" if variant == "baseline" else "kda_chunk_prepare_kernel"
    return f"{stem}<{ct}>"


def _recurrence_name(ct: str, nw: int) -> str:
    return f"kda_chunk_recurrence_kernel<{ct}, {nw}>"


# NVRTC modules: per input dtype one with the offsets and prepare kernels, and one per
# recurrence width, so a first call compiles only the two it launches (~1.5 s each).
PREPARE_SPECS = {dt: register("kda_chunk.cu", (OFFSETS_KERNEL, _prepare_name(ct))) for dt, ct in _CTYPE.items()}
# The previous phase-1 formulation, kept so one build can compare both (MATE_CUPY_KDA_CHUNK_PREPARE=baseline).
PREPARE_BASELINE_SPECS = {dt: register("kda_chunk.cu", (_prepare_name(ct, "baseline"),)) for dt, ct in _CTYPE.items()}
RECURRENCE_SPECS = {
    (dt, nw): register("kda_chunk.cu", (_recurrence_name(ct, nw),)) for dt, ct in _CTYPE.items() for nw in RECURRENCE_WARPS
}


def recurrence_smem(nw: int) -> int:
    """Shared memory of the recurrence kernel with ``nw`` warps (two pipeline stages)."""
    bv = 16 * nw
    stage = 3 * 64 * 136 * 2 + 2 * 64 * 72 * 2 + HEAD_DIM * 4 + 64 * (bv + 8) * 2
    return 2 * stage


def num_chunk_slots(batch: int, seqlen: int, num_seqs: int, varlen: bool) -> int:
    """Workspace chunk slots: exact for dense input, an upper bound for varlen."""
    if varlen:
        return (seqlen + (CHUNK - 1) * num_seqs) // CHUNK
    return batch * ((seqlen + CHUNK - 1) // CHUNK)


# Relative per-chunk latency of a recurrence CTA by warp count (one CTA per SM: the
# stage buffers take ~150-180 KB). Used to trade V slices (more CTAs) against waves.
# Every warp does the same 232 MMAs per chunk whatever the width, so 1, 2 and 4 warps
# (one warp per SM sub-partition) take about the same time per chunk; narrower CTAs only
# add copy instructions per thread and L2 traffic (each CTA reads the whole slot). 8
# warps put two warps on each sub-partition: tensor-bound, ~1.6x.
# Fitted to the H200 sweep (bench/sweeps/perf_kda.py, phase-2 time per width at H16/H32/H64/H96
# and varlen 8x1024): 2-warp CTAs are ~13% faster per wave than 4-warp ones, 8-warp ~1.6x slower.
_WARP_COST = {1: 1.05, 2: 0.87, 4: 1.0, 8: 1.6}
_carveout_set: set = set()  # ids of prepare kernels whose carveout preference is set (RawKernel takes no attributes)


def _sm_count() -> int:
    return device_info()[0]


def recurrence_warps(num_units: int, sm_count: int) -> int:
    """Warps per recurrence CTA for ``num_units`` = sequences x value heads.

    ``MATE_CUPY_KDA_CHUNK_WARPS`` (1, 2, 4 or 8) overrides the choice.
    """
    env = os.environ.get("MATE_CUPY_KDA_CHUNK_WARPS")
    if env:
        nw = int(env)
        if nw not in RECURRENCE_WARPS:
            raise ValueError(f"MATE_CUPY_KDA_CHUNK_WARPS must be one of {RECURRENCE_WARPS}, got {env!r}")
        return nw
    best, best_cost = 8, None
    for nw in (8, 4, 2, 1):
        ctas = num_units * (8 // nw)
        cost = -(-ctas // max(1, sm_count)) * _WARP_COST[nw]
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = nw, cost
    return best


def prepare_variant() -> str:
    """Phase-1 kernel: ``MATE_CUPY_KDA_CHUNK_PREPARE`` = default | baseline (for tuning)."""
    env = os.environ.get("MATE_CUPY_KDA_CHUNK_PREPARE") or "default"
    if env not in PREPARE_VARIANTS:
        raise ValueError(f"MATE_CUPY_KDA_CHUNK_PREPARE must be one of {PREPARE_VARIANTS}, got {env!r}")
    return env


def _ptr(x):
    return np.uintp(0) if x is None else x


def _aligned(x, nbytes: int) -> bool:
    return x.data.ptr % nbytes == 0


def _input16(x, name: str):
    """A 16-byte aligned C-contiguous view (a copy only when the caller's is misaligned)."""
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous, got strides {x.strides}")
    return x if _aligned(x, 16) else x.copy()


def _state_kind(x, name: str) -> int:
    if x is None:
        return 0
    if x.dtype == FLOAT32:
        kind, align = 1, 8
    elif x.dtype == BFLOAT16:
        kind, align = 2, 4
    else:
        raise TypeError(f"{name} must be float32 or bfloat16, got {dtype_name(x.dtype)}")
    if not x.flags.c_contiguous or not _aligned(x, align):
        raise ValueError(f"{name} must be C-contiguous and {align}-byte aligned")
    return kind


def _check_inputs(q, k, v, g, beta, A_log, dt_bias, initial_state, final_state, cu_seqlens, out):
    if q.dtype not in _CTYPE:
        raise TypeError(f"q must be float16 or bfloat16, got {dtype_name(q.dtype)}")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta), ("out", out)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {dtype_name(q.dtype)}, got {dtype_name(x.dtype)}")
    if q.ndim != 4 or q.shape[-1] != HEAD_DIM or k.shape != q.shape:
        raise ValueError(f"q, k must be [B, T, H, {HEAD_DIM}] of one shape, got q={q.shape}, k={k.shape}")
    B, T, H, _ = q.shape
    if v.ndim != 4 or v.shape[:2] != (B, T) or v.shape[3] != HEAD_DIM or g.shape != v.shape:
        raise ValueError(f"v, g must be [B, T, HV, {HEAD_DIM}] matching q, got v={v.shape}, g={g.shape}")
    HV = v.shape[2]
    if H == 0 or HV % H != 0:
        raise ValueError(f"HV must be a positive multiple of H, got H={H}, HV={HV}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = {(B, T, HV)}, got {beta.shape}")
    if out.shape != v.shape or not out.flags.c_contiguous or not _aligned(out, 4):
        raise ValueError(f"out must be a C-contiguous 4-byte aligned {v.shape} array, got {out.shape}")
    if not beta.flags.c_contiguous:
        raise ValueError("beta must be C-contiguous")
    if (A_log is None) != (dt_bias is None):
        raise ValueError("A_log and dt_bias must be given together")
    if A_log is not None:
        if A_log.dtype != FLOAT32 or A_log.size != HV or not A_log.flags.c_contiguous:
            raise ValueError(f"A_log must be a contiguous float32 array of {HV} elements")
        if dt_bias.dtype != FLOAT32 or dt_bias.size != HV * HEAD_DIM or not dt_bias.flags.c_contiguous:
            raise ValueError(f"dt_bias must be a contiguous float32 array of {HV * HEAD_DIM} elements")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"varlen input needs B == 1, got B={B}")
        if cu_seqlens.ndim != 1 or cu_seqlens.size < 1 or cu_seqlens.dtype not in (INT32, INT64):
            raise ValueError("cu_seqlens must be a 1-D int32/int64 array of N + 1 offsets")
        if not cu_seqlens.flags.c_contiguous:
            raise ValueError("cu_seqlens must be contiguous")
        N = cu_seqlens.size - 1
    else:
        N = B
    for name, s in (("initial_state", initial_state), ("final_state", final_state)):
        if s is not None and s.shape != (N, HV, HEAD_DIM, HEAD_DIM):
            raise ValueError(f"{name} must be [N, HV, V, K] = {(N, HV, HEAD_DIM, HEAD_DIM)}, got {s.shape}")
    return B, T, H, HV, N


def launch_prepare(*, q, k, g, beta, A_log, dt_bias, cu_seqlens, chunk_offsets, workspace, num_slots, num_seqs,
                   scale, lower_bound, use_qk_l2norm, variant=None, stream=None) -> None:
    """Phase 1 into ``workspace`` (uint8, ``num_slots * HV * SLOT_BYTES`` bytes)."""
    B, T, H, _ = q.shape
    HV = g.shape[2]
    if num_slots == 0 or HV == 0:
        return
    varlen = cu_seqlens is not None
    variant = variant or prepare_variant()
    specs, smem = (PREPARE_BASELINE_SPECS, PREPARE_BASELINE_SMEM) if variant == "baseline" else (PREPARE_SPECS, PREPARE_SMEM)
    kern = get_kernel(specs[q.dtype], _prepare_name(_CTYPE[q.dtype], variant))
    if id(kern) not in _carveout_set:  # several CTAs of 75-87 KB per SM need the full carveout
        kern.preferred_shared_memory_carveout = 100
        _carveout_set.add(id(kern))
    args = (
        q, k, g, beta, _ptr(A_log), _ptr(dt_bias), _ptr(cu_seqlens),
        np.int32(varlen and cu_seqlens.dtype == INT64), _ptr(chunk_offsets), workspace,
        np.int32(num_seqs), np.int64(0 if varlen else T), np.int64(B * T), np.int32(H), np.int32(HV),
        np.float32(scale), np.float32(lower_bound), np.int32(bool(use_qk_l2norm)), np.int32(A_log is not None),
    )
    launch(kern, (num_slots, HV), (PREPARE_THREADS,), args, shared_mem=smem, stream=stream)


def launch_recurrence(*, v, workspace, out, initial_state, final_state, cu_seqlens, chunk_offsets, num_slots,
                      num_seqs, warps=None, stream=None) -> None:
    """Phase 2: outputs and final states from the workspace."""
    B, T, HV, _ = v.shape
    if num_seqs == 0 or HV == 0:
        return
    if T == 0 and final_state is None:
        return
    varlen = cu_seqlens is not None
    nw = warps or recurrence_warps(num_seqs * HV, _sm_count())
    kern = get_kernel(RECURRENCE_SPECS[(v.dtype, nw)], _recurrence_name(_CTYPE[v.dtype], nw))
    args = (
        v, workspace, out,
        _ptr(initial_state), np.int32(_state_kind(initial_state, "initial_state")),
        _ptr(final_state), np.int32(_state_kind(final_state, "final_state")),
        _ptr(cu_seqlens), np.int32(varlen and cu_seqlens.dtype == INT64), _ptr(chunk_offsets),
        np.int32(num_slots), np.int64(0 if varlen else T), np.int64(B * T), np.int32(HV),
    )
    grid = (num_seqs * (HEAD_DIM // (16 * nw)), HV)
    launch(kern, grid, (32 * nw,), args, shared_mem=recurrence_smem(nw), stream=stream)


def launch_offsets(cu_seqlens, num_seqs: int, total_rows: int, dtype, stream=None):
    """Device int32 [N + 1]: the first chunk slot of every sequence (varlen)."""
    import cupy

    offsets = cupy.empty(num_seqs + 1, dtype=np.int32)
    note_alloc("chunk_offsets", offsets)
    kern = get_kernel(PREPARE_SPECS[dtype], OFFSETS_KERNEL)
    launch(kern, (1,), (1024,),
           (cu_seqlens, np.int32(cu_seqlens.dtype == INT64), np.int32(num_seqs), np.int64(total_rows), offsets),
           stream=stream)
    return offsets


def workspace_views(workspace, num_slots: int, num_heads: int, dtype) -> dict:
    """Copies of the workspace parts, ``{name: [num_slots, HV, ...]}`` (for tests)."""
    ws = workspace.reshape(num_slots, num_heads, SLOT_BYTES)
    views = {}
    for name, (off, shape, dt) in _SLOT_PARTS.items():
        dt = dtype if dt is None else dt
        nbytes = int(np.prod(shape)) * dt.itemsize
        views[name] = ws[:, :, off:off + nbytes].copy().view(dt).reshape((num_slots, num_heads) + shape)
    return views


def run_chunk(*, q, k, v, g, beta, A_log, dt_bias, initial_state, final_state, cu_seqlens, out, scale,
              lower_bound, use_qk_l2norm, stream=None) -> None:
    """KDA chunked forward on CUDA arrays (CuPy), launched on ``stream``.

    q, k [B, T, H, 128]; v, g [B, T, HV, 128]; beta [B, T, HV] (logits); all f16 or
    bf16, C-contiguous (q, k, v, g are copied if not 16-byte aligned). Varlen: B == 1
    and ``cu_seqlens`` [N + 1] int32/int64 (device). ``initial_state`` /
    ``final_state``: [N, HV, V=128, K=128] float32 or bfloat16, or None. ``A_log`` [HV]
    and ``dt_bias`` [HV * 128] float32 (both or neither). ``out`` [B, T, HV, 128] in
    q's dtype. Allocates the per-call workspace (and for varlen an int32 [N + 1]
    offset table) on the current stream; no host synchronisation.
    """
    run_chunk_workspace(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                        final_state=final_state, cu_seqlens=cu_seqlens, out=out, scale=scale,
                        lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm, stream=stream)


def run_chunk_workspace(*, q, k, v, g, beta, A_log, dt_bias, initial_state, final_state, cu_seqlens, out, scale,
                        lower_bound, use_qk_l2norm, stream=None):
    """``run_chunk`` that also returns ``(workspace, num_slots)`` (see ``workspace_views``)."""
    B, T, H, HV, N = _check_inputs(q, k, v, g, beta, A_log, dt_bias, initial_state, final_state, cu_seqlens, out)
    import cupy

    q, k, v, g = (_input16(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"), (g, "g")))
    varlen = cu_seqlens is not None
    num_slots = num_chunk_slots(B, T, N, varlen) if N > 0 else 0
    workspace = cupy.empty(max(1, num_slots * HV * SLOT_BYTES), dtype=np.uint8)
    note_alloc("workspace", workspace)
    offsets = launch_offsets(cu_seqlens, N, B * T, q.dtype, stream) if varlen and N > 0 else None
    launch_prepare(q=q, k=k, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
                   chunk_offsets=offsets, workspace=workspace, num_slots=num_slots, num_seqs=N, scale=scale,
                   lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm, stream=stream)
    launch_recurrence(v=v, workspace=workspace, out=out, initial_state=initial_state, final_state=final_state,
                      cu_seqlens=cu_seqlens, chunk_offsets=offsets, num_slots=num_slots, num_seqs=N,
                      stream=stream)
    return workspace, num_slots
