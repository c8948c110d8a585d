"""Launcher of the KDA decode kernels (``cuda_src/kda_decode.cu``): :func:`run_decode`.

Compile-time variants: state dtype (float32 / bfloat16) x state layout (V-first
``[P, HV, V, K]`` / K-first ``[P, HV, K, V]``): four kernels, all registered here. Every
other choice (q/k/v/a/b/dt_bias/output dtypes, gate and beta modes, L2 norm, slot mode,
varlen, token count) is a runtime argument: it only changes the per-token prologue,
which runs once per CTA outside the state loop.

Work split (see ``docs/kda_decode.md``): one CTA per (sequence, value head, V-slice).
V-first slices are ``nwarps * 16`` rows, ``nwarps`` in {1, 2, 4} picked so that small
batches still put work on every SM, staged by one bulk copy on sm_90; K-first slices are
128 bytes of each K row (32 fp32 or 64 bf16 columns).
"""
from __future__ import annotations

import numpy as np

from .._device import device_info
from .._interop import BFLOAT16, FLOAT16, FLOAT32, INT32, INT64, dtype_name
from .._launch_cache import launch as record_launch
from ..jit import get_kernel, register

_SOURCE = "kda_decode.cu"
_STATE_CTYPE = {FLOAT32: "float", BFLOAT16: "__nv_bfloat16"}

#: (state dtype, rows per lane) -> V-first variant; rows 4 (64 state floats per lane, 128
#: registers) or 2 (32 floats, 96 registers: more CTAs per SM).
VFIRST_SPECS = {
    (dt, rows): register(_SOURCE, f"kda_decode::kda_decode_vfirst_kernel<{ctype}, {rows}>")
    for dt, ctype in _STATE_CTYPE.items()
    for rows in (4, 2)
}
#: (state dtype, state_v_first) -> the default registered variant of that layout.
SPECS = {
    **{(dt, True): VFIRST_SPECS[(dt, 4)] for dt in _STATE_CTYPE},
    **{(dt, False): register(_SOURCE, f"kda_decode::kda_decode_kfirst_kernel<{ctype}>")
       for dt, ctype in _STATE_CTYPE.items()},
}

K_DIM = 128  # the kernels' q/k head dim (one state row)
MAX_CHUNK = 8  # tokens prepared per prologue (kMaxChunk in the kernel)
VFIRST_WARP_CHOICES = (4, 2, 1)
#: Override of the V-first warps per CTA (1, 2, 4 or 8) for tuning; None = heuristic.
VFIRST_WARPS = None
#: V-first CTAs that loop over work units with the next unit's state copied in ahead
#: (two stage buffers): True / False for tuning; None = heuristic (``vfirst_prefetch``).
VFIRST_PREFETCH = None
#: Override of the V-first rows per lane (4 or 2) for tuning; None = heuristic.
VFIRST_ROWS = None
#: Override of the V-first bulk-copy staging (sm_90+, whole slices) for tuning; None = heuristic.
VFIRST_BULK = None
_REGS_PER_THREAD = {4: 128, 2: 96}  # __maxnreg__ of the V-first kernel
_SMEM_PER_SM = 228 * 1024  # sm_90: per SM, 1 KB of it reserved per CTA
#: K-first CTA shape per state dtype: (threads, V columns per CTA).
KFIRST_SHAPE = {FLOAT32: (64, 32), BFLOAT16: (128, 64)}

# Option flags and dtype codes: the enums of kda_decode.cu.
F_VARLEN, F_L2NORM, F_GATE_IN_KERNEL, F_LOWER_BOUND = 1 << 0, 1 << 1, 1 << 2, 1 << 3
F_BETA_SIGMOID, F_NEG_EIGVAL, F_INITIAL_STATE, F_INPLACE = 1 << 4, 1 << 5, 1 << 6, 1 << 7
F_BETA_PER_CHANNEL, F_IDX64, F_ACCEPTED64, F_CU64, F_HAS_ACCEPTED = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
F_PREFETCH, F_BULK = 1 << 13, 1 << 14
_DT_CODE = {FLOAT32: 0, FLOAT16: 1, BFLOAT16: 2}
_DT_SHIFT = {"q": 0, "k": 2, "v": 4, "a": 6, "b": 8, "dt_bias": 10, "out": 12}
_NO_POOL = np.iinfo(np.int64).max
_INT32_MAX = np.iinfo(np.int32).max

def _sm_count() -> int:
    return device_info()[0]


def _launch(kernel, grid: int, threads: int, args: tuple, smem: int, stream) -> None:
    """Launch (noted for replay, see ``mate_cupy._launch_cache``); ``jit.launch`` opts into
    dynamic shared memory above 48 KiB once per kernel."""
    record_launch(kernel, (grid,), (threads,), args, shared_mem=smem, stream=stream)


def _smem_bytes(stage_bytes: int, tc: int, vs: int, red_floats: int) -> int:
    """Dynamic shared memory of one CTA (the layout of ``carve_smem`` in the kernel)."""
    return (stage_bytes + ((tc + 1) // 2) * 16 + ((tc + 3) // 4) * 16 + 3 * tc * K_DIM * 4
            + 2 * tc * vs * 4 + red_floats * 4)


def vfirst_rows() -> int:
    """State rows per lane of the V-first kernel (4 or 2)."""
    return 4 if VFIRST_ROWS is None else int(VFIRST_ROWS)


def vfirst_warps(n_heads: int, V: int, sm_count: int, rows: int = 4) -> int:
    """Warps per V-first CTA: 4 when that still gives >= 16 CTAs per SM, else 2 when that
    gives >= 4 per SM, else 1 (H200 sweep: at B32 x HV32 two-warp CTAs are 4-6% faster)."""
    if VFIRST_WARPS is not None:
        return int(VFIRST_WARPS)

    def ctas(w):
        return n_heads * -(-V // (4 * rows * w))

    if ctas(4) >= 16 * sm_count:
        return 4
    if ctas(2) >= 4 * sm_count:
        return 2
    return 1


def vfirst_bulk(V: int, vs: int, prefetch: bool) -> bool:
    """Stage each slice with one bulk copy (sm_90+, one unit per CTA, whole slices): 1-4%
    faster than per-lane cp.async at every batch of the H200 sweep."""
    if prefetch or V % vs:
        return False
    want = bool(VFIRST_BULK) if VFIRST_BULK is not None else True
    return want and _cc_major() >= 9


def _cc_major() -> int:
    return device_info()[1] // 10


def vfirst_resident_ctas(threads: int, smem: int, rows: int = 4) -> int:
    """V-first CTAs one SM holds at once (registers, shared memory, the 32-CTA limit)."""
    by_regs = 65536 // (_REGS_PER_THREAD[rows] * threads)
    by_smem = _SMEM_PER_SM // (smem + 1024)
    return max(1, min(32, by_regs, by_smem))


def vfirst_prefetch(units: int, resident: int) -> bool:
    """Loop CTAs over units with a prefetched stage when there are more units than resident CTAs."""
    if VFIRST_PREFETCH is not None:
        return bool(VFIRST_PREFETCH)
    return False


def launch_shape(n_heads: int, V: int, T: int, state_dtype, v_first: bool) -> tuple:
    """``(threads, VS, n_splits, grid, tc, smem bytes, prefetch)`` of one launch over
    ``n_heads`` = N * HV states of ``T`` tokens (raises if the grid does not fit)."""
    elem = np.dtype(state_dtype).itemsize
    rows = vfirst_rows()
    if v_first:
        warps = vfirst_warps(n_heads, V, _sm_count(), rows)
        vs = 4 * rows * warps
        threads, red = 32 * warps, 0
    else:
        threads, vs = KFIRST_SHAPE[np.dtype(state_dtype)]
        red = 2 * (threads // 32) * 2 * vs
    n_splits = -(-V // vs)
    grid = n_heads * n_splits
    if grid > _INT32_MAX:
        raise ValueError(f"too many CTAs ({grid}) for one launch")
    tc = max(1, min(T, MAX_CHUNK))
    smem = _smem_bytes(vs * K_DIM * elem, tc, vs, red)
    prefetch = False
    if v_first:
        smem2 = _smem_bytes(2 * vs * K_DIM * elem, tc, vs, red)
        resident = vfirst_resident_ctas(threads, smem2, rows) * _sm_count()
        if grid > resident and vfirst_prefetch(grid, resident):
            prefetch, grid, smem = True, resident, smem2
    return threads, vs, n_splits, grid, tc, smem, prefetch


def _strides3(x, name: str) -> tuple:
    """Element strides of the first three dims; the fourth (if any) must be contiguous."""
    item = x.dtype.itemsize
    st = [s // item for s in x.strides]
    if any(s % item for s in x.strides):
        raise ValueError(f"{name} strides {x.strides} are not multiples of its item size {item}")
    if x.ndim == 4 and x.shape[3] > 1 and st[3] != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(st)} (elements)")
    out = tuple(st[:3]) + (0,) * (3 - min(3, x.ndim))
    if any(abs(s) > _INT32_MAX for s in out):
        raise ValueError(f"{name} strides {tuple(st)} (elements) do not fit in 32 bits")
    return out


def _dtype_code(x, name: str, allowed) -> int:
    if x.dtype not in allowed:
        raise TypeError(
            f"{name} must be {' or '.join(dtype_name(d) for d in allowed)}, got {dtype_name(x.dtype)}"
        )
    return _DT_CODE[np.dtype(x.dtype)]


def _index_array(x, name: str):
    if x is None:
        return None
    if x.dtype not in (INT32, INT64):
        raise TypeError(f"{name} must be int32 or int64, got {dtype_name(x.dtype)}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be contiguous")
    return x


def _check_state_buffer(x, name: str, tail: tuple):
    if x.dtype not in _STATE_CTYPE:
        raise TypeError(f"{name} must be float32 or bfloat16, got {dtype_name(x.dtype)}")
    if x.ndim != 4 or tuple(x.shape[1:]) != tail:
        raise ValueError(f"{name} must have trailing dimensions {tail}, got shape {tuple(x.shape)}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if x.data.ptr % 16:
        raise ValueError(f"{name} must be 16-byte aligned (the kernel moves the state in 16-byte chunks)")


def run_decode(*, q, k, v, a, b, A_log, dt_bias, state, state_indices, num_accepted_tokens,
               cu_seqlens, out, final_state, scale, lower_bound, use_qk_l2norm,
               use_gate_in_kernel, use_lower_bound, apply_beta_sigmoid, allow_neg_eigval,
               use_initial_state, state_v_first, inplace_final_state, stream=None) -> None:
    """Launch the decode kernel on CuPy arrays (validated by the interface).

    q, k ``[B, T, H, K]`` fp16/bf16 (K = 128); v ``[B, T, HV, V]`` fp16/bf16; a ``[B, T, HV, K]``
    fp16/bf16/fp32; b ``[B, T, HV]`` or ``[B, T, HV, V]`` fp16/bf16/fp32 (any strides with a
    contiguous last dim). Varlen: ``B == 1`` and ``cu_seqlens [N+1]``. A_log ``[HV]`` fp32,
    dt_bias ``[HV, K]`` (or ``[HV*K]``) fp32/bf16 contiguous, or None. state: pool
    ``[P, HV, V, K]`` (V-first) or ``[P, HV, K, V]``, fp32/bf16, C-contiguous and 16-byte
    aligned, or None; state_indices ``[N]`` / ``[N, C]``, num_accepted_tokens ``[N]``
    (int32/int64, contiguous) or None; out ``[B, T, HV, V]`` fp16/bf16/fp32 C-contiguous;
    final_state ``[N, HV, V, K]`` (K-first ``[N, HV, K, V]``) in the state dtype, or None.
    Writes ``out`` (every element), the pool when ``inplace_final_state`` and
    ``final_state`` when given. Allocates nothing and never synchronises.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != K_DIM:
        raise NotImplementedError(f"gated_delta_rule_decode kernels need K = {K_DIM}, got q/k head dim {K}")
    varlen = cu_seqlens is not None
    N = cu_seqlens.shape[0] - 1 if varlen else B
    state_dtype = state.dtype if state is not None else (final_state.dtype if final_state is not None else FLOAT32)
    tail = (HV, V, K) if state_v_first else (HV, K, V)
    if (use_initial_state or inplace_final_state) and state is None:
        raise ValueError("state must be given when use_initial_state or inplace_final_state is set")
    for name, x in (("state", state), ("final_state", final_state)):
        if x is not None:
            _check_state_buffer(x, name, tail)
            if x.dtype != state_dtype:
                raise TypeError(f"final_state must have the state's dtype {dtype_name(state_dtype)}, "
                                f"got {dtype_name(x.dtype)}")
    if final_state is not None and final_state.shape[0] != N:
        raise ValueError(f"final_state must have {N} sequences, got shape {tuple(final_state.shape)}")
    elem = np.dtype(state_dtype).itemsize
    if not state_v_first and V % (16 // elem):
        raise NotImplementedError(
            f"K-first {dtype_name(state_dtype)} state needs V to be a multiple of {16 // elem}, got V = {V}"
        )
    if out.shape != (B, T, HV, V) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous [B, T, HV, V] = {(B, T, HV, V)} array, got {tuple(out.shape)}")
    if a.shape != (B, T, HV, K):
        raise ValueError(f"a must have shape {(B, T, HV, K)}, got {tuple(a.shape)}")
    per_channel = b.ndim == 4
    if b.shape != ((B, T, HV, V) if per_channel else (B, T, HV)):
        raise ValueError(f"b must have shape {(B, T, HV)} or {(B, T, HV, V)}, got {tuple(b.shape)}")
    if HV % H:
        raise ValueError(f"HV ({HV}) must be a multiple of H ({H})")

    half = (FLOAT16, BFLOAT16)
    floats = (FLOAT16, BFLOAT16, FLOAT32)
    dtypes = (_dtype_code(q, "q", half) << _DT_SHIFT["q"] | _dtype_code(k, "k", half) << _DT_SHIFT["k"]
              | _dtype_code(v, "v", half) << _DT_SHIFT["v"] | _dtype_code(a, "a", floats) << _DT_SHIFT["a"]
              | _dtype_code(b, "b", floats) << _DT_SHIFT["b"] | _dtype_code(out, "out", floats) << _DT_SHIFT["out"])
    if dt_bias is not None:
        dtypes |= _dtype_code(dt_bias, "dt_bias", (FLOAT32, BFLOAT16)) << _DT_SHIFT["dt_bias"]
        if dt_bias.size != HV * K or not dt_bias.flags.c_contiguous:
            raise ValueError(f"dt_bias must be a contiguous [HV, K] = {(HV, K)} array, got {tuple(dt_bias.shape)}")
    if A_log is not None and (A_log.dtype != FLOAT32 or A_log.size != HV or not A_log.flags.c_contiguous):
        raise ValueError(f"A_log must be a contiguous float32 [HV] = [{HV}] array, got "
                         f"{dtype_name(A_log.dtype)} {tuple(A_log.shape)}")

    state_indices = _index_array(state_indices, "state_indices")
    num_accepted_tokens = _index_array(num_accepted_tokens, "num_accepted_tokens")
    cu_seqlens = _index_array(cu_seqlens, "cu_seqlens")
    flags = 0
    if varlen:
        flags |= F_VARLEN | (F_CU64 if cu_seqlens.dtype == INT64 else 0)
        if B != 1:
            raise ValueError(f"varlen inputs must be packed as [1, total_tokens, ...], got q {tuple(q.shape)}")
    if use_qk_l2norm:
        flags |= F_L2NORM
    if use_gate_in_kernel:
        flags |= F_GATE_IN_KERNEL
    if use_lower_bound:
        flags |= F_LOWER_BOUND
    if apply_beta_sigmoid:
        flags |= F_BETA_SIGMOID
    if allow_neg_eigval:
        flags |= F_NEG_EIGVAL
    if use_initial_state:
        flags |= F_INITIAL_STATE
    if inplace_final_state:
        flags |= F_INPLACE
    if per_channel:
        flags |= F_BETA_PER_CHANNEL
    idx_cols = 0
    if state_indices is not None:
        if state_indices.shape[0] != N or state_indices.ndim not in (1, 2):
            raise ValueError(f"state_indices must have shape [{N}] or [{N}, C], got {tuple(state_indices.shape)}")
        idx_cols = -1 if state_indices.ndim == 1 else int(state_indices.shape[1])
        if idx_cols == 0:
            raise ValueError("state_indices must have at least one column")
        flags |= F_IDX64 if state_indices.dtype == INT64 else 0
    if num_accepted_tokens is not None:
        if num_accepted_tokens.shape != (N,):
            raise ValueError(f"num_accepted_tokens must have shape [{N}], got {tuple(num_accepted_tokens.shape)}")
        if idx_cols > 0:  # only meaningful with a slot per token
            flags |= F_HAS_ACCEPTED | (F_ACCEPTED64 if num_accepted_tokens.dtype == INT64 else 0)

    if N == 0 or HV == 0 or V == 0:
        return
    if T > _INT32_MAX or V * K * HV > _INT32_MAX:
        raise ValueError(f"too many tokens or state elements per slot: T = {T}, HV*V*K = {HV * V * K}")

    threads, vs, n_splits, grid, tc, smem, prefetch = launch_shape(N * HV, V, T, state_dtype, state_v_first)
    if prefetch:
        flags |= F_PREFETCH
    rows = vfirst_rows() if state_v_first else 0
    if state_v_first and vfirst_bulk(V, vs, prefetch):
        flags |= F_BULK

    null = np.uintp(0)
    qs, ks, vst, ast, bst = (_strides3(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"), (a, "a"), (b, "b")))
    args = (
        q, k, v, a, b,
        null if A_log is None else A_log,
        null if dt_bias is None else dt_bias,
        null if state is None else state,
        null if state_indices is None else state_indices,
        null if num_accepted_tokens is None or idx_cols <= 0 else num_accepted_tokens,
        null if cu_seqlens is None else cu_seqlens,
        out,
        null if final_state is None else final_state,
        np.int64(_NO_POOL if state is None else state.shape[0]),
        *(np.int32(s) for s in qs + ks + vst + ast + bst),
        np.int32(N), np.int32(T), np.int32(H), np.int32(HV), np.int32(V), np.int32(idx_cols),
        np.int32(flags), np.int32(dtypes), np.float32(scale), np.float32(lower_bound),
        np.int32(n_splits), np.int32(tc),
    )
    spec = VFIRST_SPECS[(np.dtype(state_dtype), rows)] if state_v_first else SPECS[(np.dtype(state_dtype), False)]
    kernel = get_kernel(spec)
    _launch(kernel, grid, threads, args, smem, stream)
