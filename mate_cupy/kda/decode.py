"""``gated_delta_rule_decode``: :func:`validate` -> :class:`DecodeProblem` -> the float64
reference (host arrays, :func:`run`) or the decode kernel (CUDA arrays,
:func:`mate_cupy.kda.decode_launch.run`).

Every condition is checked once, in :func:`validate`, before anything runs. The checks
follow the documented order and exception types (docs/api.md), plus the ones a kernel needs:
``b`` shape, k/v/a/b dtypes, ``cu_seqlens`` dtype, varlen batch of 1,
``num_accepted_tokens`` dtype, and the kernels' contract, refused on both paths with
``NotImplementedError``: K = 128, a K-first V that is a whole number of 16-byte state
chunks, sizes within the kernels' 32-bit indexing. CUDA arrays also get their memory
checked (a pool the kernel reads or writes must be 16-byte aligned) and their layout
recorded (element strides of q/k/v/a/b; arrays the kernel cannot index are staged
through contiguous copies). Host inputs also get their index *values* checked by the
reference (offsets, slot range, accepted counts); CUDA inputs are not read on the host,
and the kernel treats an out-of-range slot as padding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..checks import check_given, finite_arg
from ..reference.kda import kda_decode
from ..runtime.interop import (BFLOAT16, FLOAT16, FLOAT32, Call, as_dtype, current_device, dtype_name,
                               torch_cuda_addresses)
from ..runtime.memo import BoundedMemo
from . import decode_launch
from .common import HALF_DTYPES, INDEX_DTYPES, names
from .decode_launch import K_DIM, MIN_V_SLICE, STATE_CHUNK_BYTES

STATE_DTYPES = (FLOAT32, BFLOAT16)
GATE_DTYPES = (FLOAT16, BFLOAT16, FLOAT32)
OUTPUT_DTYPES = (FLOAT16, BFLOAT16, FLOAT32)
DT_BIAS_DTYPES = (FLOAT32, BFLOAT16)
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class DecodeProblem:
    """One validated ``gated_delta_rule_decode`` call: everything but the arrays' addresses.

    Shapes: q/k ``[B, T, H, K]``, v/output ``[B, T, HV, V]``, state pool ``[pool_size, HV,
    V, K]`` (``state_v_first``) or ``[pool_size, HV, K, V]``; ``N`` sequences (B, or
    ``len(cu_seqlens) - 1`` when ``varlen``, then B = 1 and T = total tokens).
    ``slot_columns``: 0 without ``state_indices``, -1 for ``[N]``, C for ``[N, C]``.
    ``accepted_dtype`` is None without ``num_accepted_tokens``; ``dt_bias_dtype`` None
    without ``dt_bias``. CUDA only (empty on host): ``token_strides``, the element strides
    (batch, token, head) the kernel indexes q, k, v, a, b with, and ``staged``, the arrays
    the launcher copies to contiguous buffers.
    """

    device: int  # CUDA ordinal; -1: host arrays (the float64 reference)
    B: int
    T: int
    H: int
    K: int
    HV: int
    V: int
    N: int
    qkv_dtype: np.dtype
    a_dtype: np.dtype
    b_dtype: np.dtype
    dt_bias_dtype: Optional[np.dtype]
    out_dtype: np.dtype
    state_dtype: np.dtype
    state_v_first: bool
    pool_size: int  # 0 without a state
    has_A_log: bool
    beta_per_channel: bool
    varlen: bool
    cu_seqlens_dtype: Optional[np.dtype]
    slot_columns: int
    index_dtype: Optional[np.dtype]
    accepted_dtype: Optional[np.dtype]
    use_qk_l2norm: bool
    use_gate_in_kernel: bool
    use_lower_bound: bool
    apply_beta_sigmoid: bool
    allow_neg_eigval: bool
    use_initial_state: bool
    inplace_final_state: bool
    store_final_state: bool
    scale: float
    lower_bound: float
    token_strides: tuple
    staged: tuple

    @property
    def final_shape(self) -> tuple:
        """Shape of a returned final state: ``[N, HV, V, K]`` (K-first ``[N, HV, K, V]``)."""
        tail = (self.HV, self.V, self.K) if self.state_v_first else (self.HV, self.K, self.V)
        return (self.N,) + tail


def _resolve_state_dtype(state_dtype, st):
    if state_dtype is None:
        return FLOAT32 if st is None else st.dtype
    try:
        return as_dtype(state_dtype)
    except (TypeError, ValueError, KeyError):
        raise ValueError(f"state_dtype must be float32 or bfloat16, got {state_dtype!r}") from None


def validate(*, q, k, v, state, A_log, a, dt_bias, num_accepted_tokens, cu_seqlens, b, state_indices, scale,
             output, use_qk_l2norm, lower_bound, use_gate_in_kernel, use_lower_bound, apply_beta_sigmoid,
             allow_neg_eigval, use_initial_state, state_v_first, is_varlen, store_final_state,
             inplace_final_state, state_dtype):
    """Check every argument of ``gated_delta_rule_decode`` (its arguments, as keywords; None
    for an option means its default); return ``(call, DecodeProblem)``. Raises before
    anything runs. A CUDA call whose array metadata and options equal an earlier call's
    reuses that call's problem (:mod:`mate_cupy.runtime.memo`)."""
    varlen = (cu_seqlens is not None) if is_varlen is None else bool(is_varlen)
    options = (scale, use_qk_l2norm, lower_bound, use_gate_in_kernel, use_lower_bound, apply_beta_sigmoid,
               allow_neg_eigval, use_initial_state, state_v_first, varlen, store_final_state, inplace_final_state,
               state_dtype)
    # torch CUDA tensors: the launch prepared by an earlier call with equal metadata and options.
    found = prepared_key = None
    if output is not None and (inplace_final_state or not store_final_state):
        found = torch_cuda_addresses((q, k, v, a, b, A_log, dt_bias, state, state_indices, num_accepted_tokens,
                                      cu_seqlens if varlen else None, output))
    if found is not None and _PLAIN.issuperset(map(type, options[:-1])):
        prepared_key = (found[0], options)
        try:
            entry = _PREPARED.get(prepared_key)
        except TypeError:  # an unhashable state_dtype: nothing to reuse
            entry = prepared_key = None
        if entry is False:  # calls with this key take the validated path (decode_launch.prepare)
            prepared_key = None
        elif entry is not None and current_device() == entry.device:
            return PreparedCall(entry, found[1], output, state), entry.problem
    check_given("gated_delta_rule_decode", q=q, k=k, v=v, a=a, b=b)
    call = Call(q=q, k=k, v=v, a=a, b=b, state=state, A_log=A_log, dt_bias=dt_bias,
                num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens if varlen else None,
                state_indices=state_indices, output=output)
    if call.device is None or call.device < 0:
        return call, _check(call, *options)
    if prepared_key is not None:
        call.prepared = (prepared_key, found[1])
    key = (call.signature(), options)
    try:
        problem = _PROBLEMS.get(key)
    except TypeError:  # an unhashable option (say, a 0-d array as scale): nothing to reuse
        return call, _check(call, *options)
    if problem is None:
        problem = _check(call, *options)
        _PROBLEMS.put(key, problem)
    return call, problem


class PreparedCall:
    """A CUDA call whose launch an earlier call with equal array metadata and options
    prepared (:data:`_PREPARED`): the entry, this call's array addresses (the order of
    :data:`decode_launch.PREPARED_ARRAYS`), and the objects it returns."""

    __slots__ = ("entry", "addresses", "output", "state")

    def __init__(self, entry, addresses, output, state):
        self.entry, self.addresses, self.output, self.state = entry, addresses, output, state


_PROBLEMS = BoundedMemo(256)
_PLAIN = frozenset((type(None), bool, int, float))  # option types a prepared launch is keyed on (immutable)
#: Prepared launches (decode_launch.PreparedDecode) of torch CUDA calls with given outputs, by
#: their arrays' metadata (runtime.interop.torch_cuda_addresses) and options; False for keys
#: whose calls take the validated path (a staged copy: decode_launch.prepare).
_PREPARED = BoundedMemo(256)


def _check(call, scale, use_qk_l2norm, lower_bound, use_gate_in_kernel, use_lower_bound, apply_beta_sigmoid,
           allow_neg_eigval, use_initial_state, state_v_first, varlen, store_final_state, inplace_final_state,
           state_dtype) -> "DecodeProblem":
    """The checks of :func:`validate` on the wrapped arrays of ``call``: its problem, or an exception."""
    v_first = True if state_v_first is None else bool(state_v_first)
    initial = True if use_initial_state is None else bool(use_initial_state)
    inplace = bool(inplace_final_state)
    args = call.args
    st = args.get("state")
    sdt = _resolve_state_dtype(state_dtype, st)
    if sdt not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be {names(STATE_DTYPES)}, got {dtype_name(sdt)}")

    qa, ka, va, aa, ba = args["q"], args["k"], args["v"], args["a"], args["b"]
    la, da, oa = args.get("A_log"), args.get("dt_bias"), args.get("output")
    if len(qa.shape) != 4 or len(ka.shape) != 4 or len(va.shape) != 4:
        raise ValueError(
            "q, k and v must each have shape [B, T, H, D] or [1, total_tokens, H, D], got "
            f"q {qa.shape}, k {ka.shape}, v {va.shape}"
        )
    if len(aa.shape) != 4:
        raise ValueError(f"a must have shape [B, T, HV, K], got {aa.shape}")
    if la is not None and len(la.shape) != 1:
        raise ValueError(f"A_log must have shape [HV], got {la.shape}")
    if da is not None and len(da.shape) != 2:
        raise ValueError(f"dt_bias must have shape [HV, K] when provided, got {da.shape}")
    B, T, H, K = qa.shape
    HV, V = va.shape[2], va.shape[3]
    if ka.shape != qa.shape:
        raise ValueError(f"k must match q's shape [B, T, H, K] = {qa.shape}, got {ka.shape}")
    if va.shape[:2] != (B, T):
        raise ValueError(f"v must match q in the batch/time dims {(B, T)}, got v {va.shape}")
    if H == 0 or HV % H != 0:
        raise ValueError(f"HV must be divisible by H, got HV={HV}, H={H}")
    if aa.shape != (B, T, HV, K):
        raise ValueError(f"a must have shape [B, T, HV, K] = {(B, T, HV, K)}, got {aa.shape}")
    if la is not None and la.shape[0] != HV:
        raise ValueError(f"A_log must have {HV} elements (HV), got {la.shape[0]}")
    if da is not None and da.shape != (HV, K):
        raise ValueError(f"dt_bias must have shape [HV, K] = {(HV, K)} when provided, got {da.shape}")
    qdt = qa.dtype
    if qdt not in HALF_DTYPES:
        raise NotImplementedError(f"q/k/v dtype must be {names(HALF_DTYPES)}, got {dtype_name(qdt)}")
    if la is not None and la.dtype != FLOAT32:
        raise ValueError(f"A_log must be float32, got {dtype_name(la.dtype)}")
    if da is not None and da.dtype not in DT_BIAS_DTYPES:
        raise ValueError(f"dt_bias must be {names(DT_BIAS_DTYPES)} when provided, got {dtype_name(da.dtype)}")
    if oa is not None:
        if oa.shape != (B, T, HV, V):
            raise ValueError(f"output must have shape [B, T, HV, V] = {(B, T, HV, V)}, got {oa.shape}")
        if oa.dtype not in OUTPUT_DTYPES:
            raise NotImplementedError(f"output dtype must be {names(OUTPUT_DTYPES)}, got {dtype_name(oa.dtype)}")
    if ka.dtype != qdt or va.dtype != qdt:
        x = ka if ka.dtype != qdt else va
        raise TypeError(f"{x.name} must have q's dtype {dtype_name(qdt)}, got {dtype_name(x.dtype)}")
    if aa.dtype not in GATE_DTYPES:
        raise TypeError(f"a must be {names(GATE_DTYPES)}, got {dtype_name(aa.dtype)}")
    per_channel = len(ba.shape) == 4
    if ba.shape != ((B, T, HV, V) if per_channel else (B, T, HV)):
        raise ValueError(
            f"b must have shape [B, T, HV] = {(B, T, HV)} or [B, T, HV, V] = {(B, T, HV, V)}, got {ba.shape}"
        )
    if ba.dtype not in GATE_DTYPES:
        raise TypeError(f"b must be {names(GATE_DTYPES)}, got {dtype_name(ba.dtype)}")

    ca = args.get("cu_seqlens")
    if varlen:
        if ca is None or len(ca.shape) != 1:
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

    na = args.get("num_accepted_tokens")
    if na is not None:
        if len(na.shape) != 1 or na.shape[0] != N:
            raise ValueError(f"num_accepted_tokens must have shape [B={N}], got {na.shape}")
        if na.dtype not in INDEX_DTYPES:
            raise ValueError(
                f"num_accepted_tokens must have dtype {names(INDEX_DTYPES)}, got {dtype_name(na.dtype)}")

    sa = args.get("state_indices")
    slot_columns = 0
    if sa is not None:
        if len(sa.shape) not in (1, 2):
            raise ValueError(f"state_indices must have shape [B] or [B, T], got {sa.shape}")
        if sa.dtype not in INDEX_DTYPES:
            raise ValueError(f"state_indices must have dtype {names(INDEX_DTYPES)}, got {dtype_name(sa.dtype)}")
        if sa.shape[0] != N:
            raise ValueError(f"state_indices first dimension must be {N}, got {sa.shape[0]}")
        if len(sa.shape) == 1:
            if na is not None or (inplace and (varlen or T > 1)):
                raise ValueError(
                    "1D state_indices only support non-speculative single-token in-place decode; use "
                    "[B, T] state_indices for speculative, multi-token, or varlen in-place decode"
                )
            slot_columns = -1
        else:
            slot_columns = sa.shape[1]
            if slot_columns < 1:
                raise ValueError("state_indices must contain at least one column")
            if not varlen and (inplace or na is not None) and slot_columns < T:
                raise ValueError(
                    f"state_indices needs at least {T} columns for fixed multi-token in-place or "
                    f"speculative decode, got {slot_columns}"
                )
    if na is not None and sa is None:
        raise ValueError("num_accepted_tokens requires [B, T] state_indices (slot per draft token)")

    if initial and st is None:
        raise ValueError("state must be provided when use_initial_state=True")
    if inplace and st is None:
        raise ValueError("state must be provided when inplace_final_state=True")
    pool_size = 0
    if st is not None:
        tail = (HV, V, K) if v_first else (HV, K, V)
        if st.dtype not in STATE_DTYPES:
            raise ValueError(f"state must have dtype {names(STATE_DTYPES)}, got {dtype_name(st.dtype)}")
        if st.dtype != sdt:
            raise ValueError(f"state has dtype {dtype_name(st.dtype)}, but state_dtype={dtype_name(sdt)}")
        if len(st.shape) != 4 or st.shape[1:] != tail:
            raise ValueError(
                "state must have shape [pool, HV, V, K] for V-first or [pool, HV, K, V] for K-first; "
                f"expected 4 dimensions [pool, {', '.join(map(str, tail))}], got {st.shape}"
            )
        pool_size = st.shape[0]
        if sa is None and pool_size < N:
            raise ValueError(f"state pool must contain at least {N} slots, got {pool_size}")
        if sa is not None and pool_size == 0:
            raise ValueError("state pool must contain at least one slot")

    # The kernels' contract (both paths).
    if K != K_DIM:
        raise NotImplementedError(f"gated_delta_rule_decode needs K = {K_DIM} (the q/k head dim), got K = {K}")
    chunk = STATE_CHUNK_BYTES // sdt.itemsize
    if not v_first and V % chunk:
        raise NotImplementedError(
            f"a K-first {dtype_name(sdt)} state needs V to be a multiple of {chunk}, got V = {V}"
        )
    if T * HV * max(K, V) > _INT32_MAX or N * HV * -(-V // MIN_V_SLICE) > _INT32_MAX:
        raise NotImplementedError(
            f"shapes too large for the decode kernels' 32-bit indexing: T = {T}, HV = {HV}, V = {V}, N = {N}"
        )

    token_strides = staged = ()
    if call.device >= 0:
        token_strides, staged = _cuda_layout(args, T, H, HV, V, initial or inplace)

    return DecodeProblem(  # the fields in order
        call.device, B, T, H, K, HV, V, N, qdt, aa.dtype, ba.dtype, None if da is None else da.dtype,
        qdt if oa is None else oa.dtype, sdt, v_first, pool_size, la is not None, per_channel, varlen,
        None if ca is None else ca.dtype, slot_columns, None if sa is None else sa.dtype,
        None if na is None else na.dtype,
        True if use_qk_l2norm is None else bool(use_qk_l2norm),
        True if use_gate_in_kernel is None else bool(use_gate_in_kernel),
        bool(use_lower_bound), bool(apply_beta_sigmoid), bool(allow_neg_eigval), initial, inplace,
        bool(store_final_state), K ** -0.5 if scale is None else finite_arg("scale", scale),
        -5.0 if lower_bound is None else finite_arg("lower_bound", lower_bound), token_strides, staged,
    )


def _cuda_layout(args: dict, T: int, H: int, HV: int, V: int, uses_pool: bool) -> tuple:
    """``(token_strides, staged)`` of CUDA arrays (see :class:`DecodeProblem`).

    q/k/v/a/b are indexed with any non-negative 32-bit element strides and a contiguous
    last dimension (views of a fused projection stay as they are), else staged; A_log,
    dt_bias, the index arrays and the output must be contiguous, else staged; so must the
    pool when the kernel reads or writes it, and then a contiguous pool must also be
    16-byte aligned (``ValueError``). Each array's strides are first compared with those
    of a C-contiguous array of its shape (the common case).
    """
    K = K_DIM
    hk, hvk, hvv = H * K, HV * K, HV * V
    qk = (T * hk, hk, K, 1)
    vo = (T * hvv, hvv, V, 1)
    strides = []
    staged = []
    for name, dense in (("q", qk), ("k", qk), ("v", vo), ("a", (T * hvk, hvk, K, 1)),
                        ("b", vo if len(args["b"].shape) == 4 else (T * HV, HV, 1))):
        x = args[name]
        st = x.strides
        if st == dense:
            strides += dense[:3]
            continue
        sb, stt, sh = st[0], st[1], st[2]
        if (0 <= sb <= _INT32_MAX and 0 <= stt <= _INT32_MAX and 0 <= sh <= _INT32_MAX
                and (len(st) == 3 or st[3] == 1 or x.shape[3] <= 1)):
            strides += (sb, stt, sh)
            continue
        if not x.is_contiguous():  # (a contiguous array may have any stride on extent-1 dims)
            staged.append(name)
        strides += dense[:3]
    for name in ("A_log", "dt_bias", "state_indices", "num_accepted_tokens", "cu_seqlens"):
        x = args.get(name)
        if x is not None:
            st = x.strides
            if not (st[-1] == 1 and (len(st) == 1 or st[0] == x.shape[1])) and not x.is_contiguous():
                staged.append(name)
    out = args.get("output")
    if out is not None and out.strides != vo and not out.is_contiguous():
        staged.append("output")
    if uses_pool:
        st = args["state"]
        if st.strides != (hvv * K, V * K, st.shape[3], 1) and not st.is_contiguous():
            staged.append("state")
        elif st.ptr % 16:
            raise ValueError(
                f"state must be 16-byte aligned (the kernel moves the state in 16-byte chunks), "
                f"got address {st.ptr:#x}"
            )
    return tuple(strides), tuple(staged)


def run(call: Call, problem: DecodeProblem):
    """Compute ``problem`` on ``call``'s arrays; return ``(output, final_state or None)`` in
    the caller's framework: the ``state`` pool itself when ``inplace_final_state``, a new
    array (:attr:`DecodeProblem.final_shape`, the state dtype) when ``store_final_state``."""
    if call.__class__ is PreparedCall:
        call.entry.run(call.addresses)
        return call.output, call.state if problem.inplace_final_state else None
    if problem.device >= 0:
        prepared = call.prepared
        if prepared is not None:
            entry = decode_launch.prepare(call, problem)
            _PREPARED.put(prepared[0], False if entry is None else entry)
            if entry is not None:
                with call.device_scope():
                    entry.run(prepared[1])
                return call["output"].obj, call["state"].obj if problem.inplace_final_state else None
        return decode_launch.run(call, problem)
    p = problem
    d = call.data
    out64, pool_after, final64 = kda_decode(
        d("q"), d("k"), d("v"), d("state"), d("A_log"), d("a"), d("dt_bias"), d("num_accepted_tokens"),
        d("cu_seqlens"), d("b"), state_indices=d("state_indices"), is_varlen=p.varlen,
        store_final_state=p.store_final_state, state_dtype=p.state_dtype, scale=p.scale,
        lower_bound=p.lower_bound, use_qk_l2norm=p.use_qk_l2norm, use_gate_in_kernel=p.use_gate_in_kernel,
        use_lower_bound=p.use_lower_bound, apply_beta_sigmoid=p.apply_beta_sigmoid,
        allow_neg_eigval=p.allow_neg_eigval, use_initial_state=p.use_initial_state,
        state_v_first=p.state_v_first, inplace_final_state=p.inplace_final_state,
    )  # raises ValueError on bad offsets / slots before anything is written
    out = call["output"]
    if out is not None:
        out.data[...] = out64.astype(p.out_dtype)
        out_obj = out.obj
    else:
        out_obj = call.export(out64.astype(p.out_dtype))
    if p.inplace_final_state:
        st = call["state"]
        st.data[...] = pool_after.astype(p.state_dtype)
        return out_obj, st.obj
    if p.store_final_state:
        return out_obj, call.export(final64.astype(p.state_dtype))
    return out_obj, None
