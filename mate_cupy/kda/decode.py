"""``gated_delta_rule_decode``: argument checks, then the float64 reference (host) or the
decode kernel (CUDA).

The public function lives in :mod:`mate_cupy.kda_interface`; this module does the work.
Checks follow the order and exception types of the API it reproduces, extended with the
checks a kernel needs (``b`` shape, k/v/a/b dtypes, ``cu_seqlens`` dtype, varlen batch of
1, ``num_accepted_tokens`` dtype). Host inputs also get their index *values* checked
(offsets, slot range, accepted counts); CUDA inputs are not read on the host, and the
kernel treats an out-of-range slot as padding.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import _launch_cache as lc
from .._interop import BFLOAT16, FLOAT16, FLOAT32, Call, as_dtype, dtype_name
from ..reference.kda import kda_decode
from .common import HALF_DTYPES, INDEX_DTYPES, CudaOut, cuda_contiguous, load_launcher, names

STATE_DTYPES = (FLOAT32, BFLOAT16)
GATE_DTYPES = (FLOAT16, BFLOAT16, FLOAT32)
OUTPUT_DTYPES = (FLOAT16, BFLOAT16, FLOAT32)
DT_BIAS_DTYPES = (FLOAT32, BFLOAT16)


@dataclass
class DecodeArgs:
    """Validated, resolved ``gated_delta_rule_decode`` options and shapes (filled by :func:`validate`)."""

    state_v_first: bool = True
    varlen: bool = False
    use_initial_state: bool = True
    use_qk_l2norm: bool = True
    lower_bound: float = -5.0
    use_gate_in_kernel: bool = True
    use_lower_bound: bool = False
    apply_beta_sigmoid: bool = False
    allow_neg_eigval: bool = False
    store_final_state: bool = False
    inplace: bool = False
    state_dtype: Optional[np.dtype] = None
    B: int = 0
    T: int = 0
    H: int = 0
    K: int = 0
    HV: int = 0
    V: int = 0
    N: int = 0  # sequences: B, or len(cu_seqlens) - 1
    out_dtype: Optional[np.dtype] = None
    final_shape: tuple = ()  # [N, HV, V, K] (K-first: [N, HV, K, V])
    scale: float = 0.0


def _resolve_state_dtype(state_dtype, call: Call):
    if state_dtype is None:
        st = call["state"]
        return FLOAT32 if st is None else st.dtype
    try:
        dt = as_dtype(state_dtype)
    except (TypeError, ValueError, KeyError):
        raise ValueError(f"state_dtype must be float32 or bfloat16, got {state_dtype!r}") from None
    return dt


def validate(q, k, v, state, A_log, a, dt_bias, num_accepted_tokens, cu_seqlens, b, state_indices, scale,
             output, use_qk_l2norm, lower_bound, use_gate_in_kernel, use_lower_bound, apply_beta_sigmoid,
             allow_neg_eigval, use_initial_state, state_v_first, is_varlen, store_final_state,
             inplace_final_state, state_dtype):
    """Check every argument; return ``(call, DecodeArgs)``. Raises before any launch."""
    r = DecodeArgs()
    r.state_v_first = True if state_v_first is None else bool(state_v_first)
    r.varlen = (cu_seqlens is not None) if is_varlen is None else bool(is_varlen)
    r.use_initial_state = True if use_initial_state is None else bool(use_initial_state)
    r.use_qk_l2norm = True if use_qk_l2norm is None else bool(use_qk_l2norm)
    r.lower_bound = -5.0 if lower_bound is None else float(lower_bound)
    r.use_gate_in_kernel = True if use_gate_in_kernel is None else bool(use_gate_in_kernel)
    r.use_lower_bound = bool(use_lower_bound)
    r.apply_beta_sigmoid = bool(apply_beta_sigmoid)
    r.allow_neg_eigval = bool(allow_neg_eigval)
    r.store_final_state = bool(store_final_state)
    r.inplace = bool(inplace_final_state)

    call = Call(q=q, k=k, v=v, a=a, b=b, state=state, A_log=A_log, dt_bias=dt_bias,
                num_accepted_tokens=num_accepted_tokens,
                cu_seqlens=cu_seqlens if r.varlen else None,
                state_indices=state_indices, output=output)
    r.state_dtype = _resolve_state_dtype(state_dtype, call)
    if r.state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be {names(STATE_DTYPES)}, got {dtype_name(r.state_dtype)}")

    qa, ka, va, aa, ba = (call[n] for n in ("q", "k", "v", "a", "b"))
    la, da, oa = call["A_log"], call["dt_bias"], call["output"]
    if qa.ndim != 4 or ka.ndim != 4 or va.ndim != 4:
        raise ValueError(
            "q, k and v must each have shape [B, T, H, D] or [1, total_tokens, H, D], got "
            f"q {qa.shape}, k {ka.shape}, v {va.shape}"
        )
    if aa.ndim != 4:
        raise ValueError(f"a must have shape [B, T, HV, K], got {aa.shape}")
    if la is not None and la.ndim != 1:
        raise ValueError(f"A_log must have shape [HV], got {la.shape}")
    if da is not None and da.ndim != 2:
        raise ValueError(f"dt_bias must have shape [HV, K] when provided, got {da.shape}")
    B, T, H, K = qa.shape
    HV, V = va.shape[2], va.shape[3]
    if ka.shape != qa.shape:
        raise ValueError(f"k must match q's shape [B, T, H, K] = {qa.shape}, got {ka.shape}")
    if va.shape[:2] != (B, T):
        raise ValueError(f"v must match q in the batch/time dims {(B, T)}, got v {va.shape}")
    if HV % H != 0:
        raise ValueError(f"HV must be divisible by H, got HV={HV}, H={H}")
    if aa.shape != (B, T, HV, K):
        raise ValueError(f"a must have shape [B, T, HV, K] = {(B, T, HV, K)}, got {aa.shape}")
    if la is not None and la.size != HV:
        raise ValueError(f"A_log must have {HV} elements (HV), got {la.size}")
    if da is not None and da.shape != (HV, K):
        raise ValueError(f"dt_bias must have shape [HV, K] = {(HV, K)} when provided, got {da.shape}")
    if qa.dtype not in HALF_DTYPES:
        raise NotImplementedError(f"q/k/v dtype must be {names(HALF_DTYPES)}, got {dtype_name(qa.dtype)}")
    if la is not None and la.dtype != FLOAT32:
        raise ValueError(f"A_log must be float32, got {dtype_name(la.dtype)}")
    if da is not None and da.dtype not in DT_BIAS_DTYPES:
        raise ValueError(f"dt_bias must be {names(DT_BIAS_DTYPES)} when provided, got {dtype_name(da.dtype)}")
    if oa is not None:
        if oa.shape != (B, T, HV, V):
            raise ValueError(f"output must have shape [B, T, HV, V] = {(B, T, HV, V)}, got {oa.shape}")
        if oa.dtype not in OUTPUT_DTYPES:
            raise NotImplementedError(f"output dtype must be {names(OUTPUT_DTYPES)}, got {dtype_name(oa.dtype)}")
    for x in (ka, va):
        if x.dtype != qa.dtype:
            raise TypeError(f"{x.name} must have q's dtype {dtype_name(qa.dtype)}, got {dtype_name(x.dtype)}")
    if aa.dtype not in GATE_DTYPES:
        raise TypeError(f"a must be {names(GATE_DTYPES)}, got {dtype_name(aa.dtype)}")
    if ba.shape not in ((B, T, HV), (B, T, HV, V)):
        raise ValueError(
            f"b must have shape [B, T, HV] = {(B, T, HV)} or [B, T, HV, V] = {(B, T, HV, V)}, got {ba.shape}"
        )
    if ba.dtype not in GATE_DTYPES:
        raise TypeError(f"b must be {names(GATE_DTYPES)}, got {dtype_name(ba.dtype)}")

    ca = call["cu_seqlens"]
    if r.varlen:
        if ca is None or ca.ndim != 1:
            raise ValueError(
                "cu_seqlens must be a 1D array [N+1] when is_varlen=True, got "
                f"{'None' if ca is None else ca.shape}"
            )
        if ca.dtype not in INDEX_DTYPES:
            raise TypeError(f"cu_seqlens must have dtype {names(INDEX_DTYPES)}, got {dtype_name(ca.dtype)}")
        if ca.shape[0] < 1:
            raise ValueError("cu_seqlens must have at least one entry ([N+1])")
        if B != 1:
            raise ValueError(f"varlen inputs must be packed as [1, total_tokens, ...], got q {qa.shape}")
        N = ca.shape[0] - 1
    else:
        N = B

    na = call["num_accepted_tokens"]
    if na is not None and (na.ndim != 1 or na.shape[0] != N):
        raise ValueError(f"num_accepted_tokens must have shape [B={N}], got {na.shape}")
    if na is not None and na.dtype not in INDEX_DTYPES:
        raise ValueError(f"num_accepted_tokens must have dtype {names(INDEX_DTYPES)}, got {dtype_name(na.dtype)}")

    sa = call["state_indices"]
    if sa is not None:
        if sa.ndim not in (1, 2):
            raise ValueError(f"state_indices must have shape [B] or [B, T], got {sa.shape}")
        if sa.dtype not in INDEX_DTYPES:
            raise ValueError(f"state_indices must have dtype {names(INDEX_DTYPES)}, got {dtype_name(sa.dtype)}")
        if sa.shape[0] != N:
            raise ValueError(f"state_indices first dimension must be {N}, got {sa.shape[0]}")
        if sa.ndim == 1 and (na is not None or (r.inplace and (r.varlen or T > 1))):
            raise ValueError(
                "1D state_indices only support non-speculative single-token in-place decode; use "
                "[B, T] state_indices for speculative, multi-token, or varlen in-place decode"
            )
        if sa.ndim == 2:
            if sa.shape[1] < 1:
                raise ValueError("state_indices must contain at least one column")
            if not r.varlen and (r.inplace or na is not None) and sa.shape[1] < T:
                raise ValueError(
                    f"state_indices needs at least {T} columns for fixed multi-token in-place or "
                    f"speculative decode, got {sa.shape[1]}"
                )
    if na is not None and sa is None:
        raise ValueError("num_accepted_tokens requires [B, T] state_indices (slot per draft token)")

    st = call["state"]
    if r.use_initial_state and st is None:
        raise ValueError("state must be provided when use_initial_state=True")
    if r.inplace and st is None:
        raise ValueError("state must be provided when inplace_final_state=True")
    tail = (HV, V, K) if r.state_v_first else (HV, K, V)
    if st is not None:
        if st.dtype not in STATE_DTYPES:
            raise ValueError(f"state must have dtype {names(STATE_DTYPES)}, got {dtype_name(st.dtype)}")
        if st.dtype != r.state_dtype:
            raise ValueError(f"state has dtype {dtype_name(st.dtype)}, but state_dtype={dtype_name(r.state_dtype)}")
        if st.ndim != 4 or st.shape[1:] != tail:
            raise ValueError(
                "state must have shape [pool, HV, V, K] for V-first or [pool, HV, K, V] for K-first; "
                f"expected trailing dimensions {tail}, got {st.shape}"
            )
        if sa is None and st.shape[0] < N:
            raise ValueError(f"state pool must contain at least {N} slots, got {st.shape[0]}")
        if sa is not None and st.shape[0] == 0:
            raise ValueError("state pool must contain at least one slot")

    r.B, r.T, r.H, r.K, r.HV, r.V, r.N = B, T, H, K, HV, V, N
    r.out_dtype = qa.dtype if oa is None else oa.dtype
    r.final_shape = (N,) + tail
    r.scale = K ** -0.5 if scale is None else float(scale)
    return call, r


# Array arguments in signature order (replayed launches, see ``mate_cupy._launch_cache``).
_ARRAYS = ("q", "k", "v", "state", "A_log", "a", "dt_bias", "num_accepted_tokens", "cu_seqlens", "b",
           "state_indices", "output")
_RECIPES = lc.new_cache()
_launcher = None  # decode_kernels, once loaded (its tuning knobs are part of the key)
_KNOBS = ("VFIRST_WARPS", "VFIRST_PREFETCH", "VFIRST_ROWS", "VFIRST_BULK")


def _launcher_knobs() -> tuple:
    """The decode launcher's module-level tuning knobs (None before it is loaded)."""
    return tuple(getattr(_launcher, n, None) for n in _KNOBS)


def decode(q, k, v, state, A_log, a, dt_bias, num_accepted_tokens, cu_seqlens, b, state_indices, scale, output,
           use_qk_l2norm, lower_bound, use_gate_in_kernel, use_lower_bound, apply_beta_sigmoid, allow_neg_eigval,
           use_initial_state, state_v_first, is_varlen, store_final_state, inplace_final_state, state_dtype):
    """``gated_delta_rule_decode``: a recorded launch when this signature ran before, else
    :func:`validate` + :func:`run` (recorded for the next call)."""
    key = None
    if lc.ENABLED:
        opts = (scale, use_qk_l2norm, lower_bound, use_gate_in_kernel, use_lower_bound, apply_beta_sigmoid,
                allow_neg_eigval, use_initial_state, state_v_first, is_varlen, store_final_state,
                inplace_final_state, state_dtype) + _launcher_knobs()
        if lc.plain(opts):
            sig, ptrs = lc.signature((q, k, v, state, A_log, a, dt_bias, num_accepted_tokens, cu_seqlens, b,
                                      state_indices, output))
            if sig is not None:
                key = (opts, sig)
                recipe = _RECIPES.get(key)
                if recipe is not None:
                    allocs = lc.replay(recipe, ptrs, q)
                    out = output if output is not None else allocs["out"]
                    if inplace_final_state:
                        return out, state
                    if store_final_state:
                        return out, allocs["final"]
                    return out, None
    rec = lc.Recorder(_ARRAYS) if key is not None else None
    with lc.recording(rec):
        call, r = validate(q, k, v, state, A_log, a, dt_bias, num_accepted_tokens, cu_seqlens, b, state_indices,
                           scale, output, use_qk_l2norm, lower_bound, use_gate_in_kernel, use_lower_bound,
                           apply_beta_sigmoid, allow_neg_eigval, use_initial_state, state_v_first, is_varlen,
                           store_final_state, inplace_final_state, state_dtype)
        if rec is not None:
            for name in _ARRAYS:
                rec.arg(name, call.data(name))
        result = run(call, r, output, state)
    if rec is not None:
        lc.store(_RECIPES, (key[0][:-len(_KNOBS)] + _launcher_knobs(), key[1]), rec, call)
    return result


def run(call: Call, r: DecodeArgs, output, state):
    """Compute; return ``(output, final_state or None)`` in the caller's framework.

    The final state is the ``state`` pool object itself when ``inplace_final_state``, a new
    array ``[N, HV, V, K]`` (K-first: ``[N, HV, K, V]``) of the state dtype when
    ``store_final_state``, else None.
    """
    if call.is_cuda:
        out_arr, fs_arr = _run_cuda(call, r)
    else:
        out_arr, fs_arr = _run_host(call, r)
    out_obj = output if output is not None else call.export(out_arr)
    if r.inplace:
        return out_obj, state
    if r.store_final_state:
        return out_obj, call.export(fs_arr)
    return out_obj, None


def _options(r: DecodeArgs) -> dict:
    return dict(
        scale=r.scale, lower_bound=r.lower_bound, use_qk_l2norm=r.use_qk_l2norm,
        use_gate_in_kernel=r.use_gate_in_kernel, use_lower_bound=r.use_lower_bound,
        apply_beta_sigmoid=r.apply_beta_sigmoid, allow_neg_eigval=r.allow_neg_eigval,
        use_initial_state=r.use_initial_state, state_v_first=r.state_v_first,
        inplace_final_state=r.inplace,
    )


def _run_host(call: Call, r: DecodeArgs):
    d = call.data
    out64, pool_after, final64 = kda_decode(
        d("q"), d("k"), d("v"), d("state"), d("A_log"), d("a"), d("dt_bias"), d("num_accepted_tokens"),
        d("cu_seqlens"), d("b"), state_indices=d("state_indices"), is_varlen=r.varlen,
        store_final_state=r.store_final_state, state_dtype=r.state_dtype, **_options(r),
    )  # raises ValueError on bad offsets / slots before anything is written
    out = d("output")
    if out is not None:
        out[...] = out64.astype(r.out_dtype)
    else:
        out = out64.astype(r.out_dtype)
    if pool_after is not None:
        d("state")[...] = pool_after.astype(r.state_dtype)
    fs = final64.astype(r.state_dtype) if final64 is not None else None
    return out, fs


_INT32_MAX = 2**31 - 1


def _token_operand(x):
    """q/k/v/a/b as the kernel takes them: any non-negative element strides that fit in 32
    bits with a contiguous last dim (e.g. views of a fused projection) as they are, else a
    contiguous copy."""
    if x.flags.c_contiguous:
        return x
    item = x.itemsize
    st = x.strides
    if (all(0 <= s <= _INT32_MAX * item and s % item == 0 for s in st)
            and (x.ndim != 4 or x.shape[3] <= 1 or st[3] == item)):
        return x
    return cuda_contiguous(x)


def _run_cuda(call: Call, r: DecodeArgs):
    global _launcher
    run_decode = load_launcher("decode_kernels", "run_decode", "gated_delta_rule_decode")
    if _launcher is None:
        _launcher = sys.modules.get(run_decode.__module__)
    d = call.data
    with call.launch_scope():
        q, k, v, a, b = (_token_operand(d(n)) for n in ("q", "k", "v", "a", "b"))
        out = CudaOut(call, d("output"), (r.B, r.T, r.HV, r.V), r.out_dtype)
        if d("output") is None:
            lc.note_alloc("out", out.buf)
        state = None
        if r.use_initial_state or r.inplace:
            st = d("state")
            state = CudaOut(call, st, st.shape, r.state_dtype, initial=True)
        fs = CudaOut(call, None, r.final_shape, r.state_dtype) if (r.store_final_state and not r.inplace) else None
        final_buf = None if fs is None else fs.buf
        if fs is not None:
            lc.note_alloc("final", final_buf)
        if state is None and final_buf is None and r.state_dtype != FLOAT32:
            # The launcher takes the state dtype from its state buffers; with none, hand it a
            # scratch final state so a bf16 state is still rounded after every token.
            final_buf = call.empty(r.final_shape, r.state_dtype)
            lc.note_alloc("scratch", final_buf)
        # dt_bias is float32 or bfloat16 (validated): the kernel reads either as it is.
        run_decode(
            q=q, k=k, v=v, a=a, b=b, A_log=cuda_contiguous(d("A_log")), dt_bias=cuda_contiguous(d("dt_bias")),
            state=None if state is None else state.buf,
            state_indices=cuda_contiguous(d("state_indices")),
            num_accepted_tokens=cuda_contiguous(d("num_accepted_tokens")),
            cu_seqlens=cuda_contiguous(d("cu_seqlens")),
            out=out.buf, final_state=final_buf,
            stream=call.stream, **_options(r),
        )
        out.finish()
        if state is not None and r.inplace:
            state.finish()
    return out.buf, None if fs is None else fs.buf
