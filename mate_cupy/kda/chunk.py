"""``chunk_kda``: argument checks, then the float64 reference (host) or the chunk kernel (CUDA).

The public function lives in :mod:`mate_cupy.kda_interface`; this module does the work.
Checks follow the order and exception types of the API it reproduces, extended so that
every shape the kernel relies on is checked (states, gate parameters, ``cu_seqlens``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from .. import _launch_cache as lc
from .._interop import FLOAT16, FLOAT32, Call, dtype_name
from ..reference.kda import kda_recurrent, sequence_bounds
from ..util_kernels import cast
from .common import (
    FLOAT_DTYPES,
    HALF_DTYPES,
    INDEX_DTYPES,
    CudaOut,
    cuda_contiguous,
    cuda_float32,
    load_launcher,
    names,
    with_batch,
)

HEAD_DIM = 128


def _shape4(arg, varlen: bool) -> tuple:
    """Shape of a q/k/v/g argument as ``[B, T, H, 128]`` (varlen ``[S, H, D]`` gets B = 1)."""
    name, shape = arg.name, arg.shape
    if not varlen:
        if arg.ndim != 4:
            raise ValueError(f"{name} must be a 4D array [B, T, H, {HEAD_DIM}], got shape {shape}")
        return shape
    if arg.ndim == 3:
        return (1,) + shape
    if arg.ndim == 4:
        if shape[0] != 1:
            raise ValueError(
                f"{name}.shape[0] must be 1 when cu_seqlens is given (flatten variable-length "
                f"input as [S, H, {HEAD_DIM}] or [1, S, H, {HEAD_DIM}]), got shape {shape}"
            )
        return shape
    raise ValueError(
        f"{name} must be [S, H, {HEAD_DIM}] or [1, S, H, {HEAD_DIM}] when cu_seqlens is given, got shape {shape}"
    )


def _check_state_dtype(arg, q_dtype) -> None:
    if arg.dtype not in (q_dtype, FLOAT32):
        raise TypeError(
            f"{arg.name} must have dtype {dtype_name(q_dtype)} (q's dtype) or float32, got {dtype_name(arg.dtype)}"
        )


@dataclass(frozen=True)
class ChunkArgs:
    """Validated ``chunk_kda`` arguments (shapes in batched 4-D form)."""

    varlen: bool
    squeeze: bool  # q was given 3-D ([S, H, 128]): the allocated output is returned 3-D
    B: int
    T: int
    H: int
    HV: int
    N: int  # sequences: B, or len(cu_seqlens) - 1
    vshape: tuple  # [B, T, HV, 128]
    state_shape: tuple  # [N, HV, 128, 128]
    dtype: np.dtype  # q's dtype (inputs and output)
    state_dtype: np.dtype  # final_state's, else initial_state's, else q's
    output_final_state: bool
    scale: float
    lower_bound: float
    use_qk_l2norm: bool


def validate(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, A_log, dt_bias,
             lower_bound, use_qk_l2norm_in_kernel, output, final_state):
    """Check every argument; return ``(call, ChunkArgs)``. Raises before any launch."""
    output_final_state = bool(output_final_state)
    call = Call(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                A_log=A_log, dt_bias=dt_bias, output=output,
                final_state=final_state if output_final_state else None)
    varlen = cu_seqlens is not None
    qa, ka, va, ga, ba = (call[n] for n in ("q", "k", "v", "g", "beta"))
    qs, ks, vs, gs = (_shape4(a, varlen) for a in (qa, ka, va, ga))
    bs = (1,) + ba.shape if (varlen and ba.ndim == 2) else ba.shape

    for a, s in ((qa, qs), (ka, ks), (va, vs), (ga, gs)):
        if s[-1] != HEAD_DIM:
            raise ValueError(f"chunk_kda requires head dim {HEAD_DIM}: {a.name} has shape {a.shape}")
    if ks != qs:
        raise ValueError(f"k must have the same shape as q {qs}, got {ks}")
    if qs[:2] != vs[:2] or qs[:2] != gs[:2]:
        raise ValueError(f"q, v and g must have matching [B, T] dimensions, got q {qs}, v {vs}, g {gs}")
    if gs != vs:
        raise ValueError(f"g must have the same shape as v {vs}, got {gs}")
    B, T, H, K = qs
    HV = vs[2]
    if HV % H != 0:
        raise ValueError(f"the v/g head count must be a multiple of the q/k head count, got HV={HV}, H={H}")
    if tuple(bs) != vs[:3]:
        raise ValueError(f"beta must have shape [B, T, HV] = {vs[:3]}, got {ba.shape}")
    if qa.dtype not in HALF_DTYPES:
        raise TypeError(f"chunk_kda supports q of dtype {names(HALF_DTYPES)}, got {dtype_name(qa.dtype)}")
    for a in (ka, va, ga, ba):
        if a.dtype != qa.dtype:
            raise TypeError(f"{a.name} must have q's dtype {dtype_name(qa.dtype)}, got {dtype_name(a.dtype)}")
    if (A_log is None) != (dt_bias is None):
        raise ValueError("A_log and dt_bias must be provided together (both or neither)")
    if A_log is not None:
        la, da = call["A_log"], call["dt_bias"]
        if la.shape != (HV,):
            raise ValueError(f"A_log must have shape [HV] = ({HV},), got {la.shape}")
        if da.shape not in ((HV, K), (HV * K,)):
            raise ValueError(f"dt_bias must have shape [HV, {K}] = {(HV, K)} or [HV*{K}] = ({HV * K},), got {da.shape}")
        for a in (la, da):
            if a.dtype not in FLOAT_DTYPES:
                raise TypeError(f"{a.name} must be a floating array (float32 preferred), got {dtype_name(a.dtype)}")
    ia = call["initial_state"]
    if ia is not None:
        _check_state_dtype(ia, qa.dtype)
    ca = call["cu_seqlens"]
    if ca is not None:
        if ca.dtype not in INDEX_DTYPES:
            raise TypeError(f"cu_seqlens must have dtype {names(INDEX_DTYPES)}, got {dtype_name(ca.dtype)}")
        if ca.ndim != 1 or ca.shape[0] < 1:
            raise ValueError(f"cu_seqlens must be a 1D array [N+1], got shape {ca.shape}")
    N = ca.shape[0] - 1 if varlen else B
    state_shape = (N, HV, HEAD_DIM, HEAD_DIM)
    if ia is not None and ia.shape != state_shape:
        raise ValueError(f"initial_state must have shape [N, HV, V, K] = {state_shape}, got {ia.shape}")

    squeeze = varlen and qa.ndim == 3
    oa = call["output"]
    if oa is not None:
        os_ = (1,) + oa.shape if (squeeze and oa.ndim == 3) else oa.shape
        if tuple(os_) != vs:
            raise ValueError(f"output must have the shape of v {va.shape}, got {oa.shape}")
        if oa.dtype != qa.dtype:
            raise TypeError(f"output must have q's dtype {dtype_name(qa.dtype)}, got {dtype_name(oa.dtype)}")
    fa = call["final_state"]
    if fa is not None:
        _check_state_dtype(fa, qa.dtype)
        if fa.shape != state_shape:
            raise ValueError(f"final_state must have shape [N, HV, V, K] = {state_shape}, got {fa.shape}")
        if ia is not None and ia.dtype != fa.dtype:
            raise TypeError(
                f"initial_state and final_state must have the same dtype, got "
                f"{dtype_name(ia.dtype)} and {dtype_name(fa.dtype)}"
            )

    return call, ChunkArgs(
        varlen=varlen, squeeze=squeeze, B=B, T=T, H=H, HV=HV, N=N, vshape=vs, state_shape=state_shape,
        dtype=qa.dtype,
        state_dtype=fa.dtype if fa is not None else ia.dtype if ia is not None else qa.dtype,
        output_final_state=output_final_state,
        scale=HEAD_DIM ** -0.5 if scale is None else float(scale),
        lower_bound=float(lower_bound),
        use_qk_l2norm=bool(use_qk_l2norm_in_kernel),
    )


# Array arguments in signature order (replayed launches, see ``mate_cupy._launch_cache``).
_ARRAYS = ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens", "A_log", "dt_bias", "output", "final_state")
# Launcher knobs read from the environment at every launch: part of the signature.
_ENV_KNOBS = lc.env_keys("MATE_CUPY_KDA_CHUNK_WARPS", "MATE_CUPY_KDA_CHUNK_PREPARE")
_RECIPES = lc.new_cache()


def chunk(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, A_log, dt_bias, lower_bound,
          use_qk_l2norm_in_kernel, output, final_state):
    """``chunk_kda``: a recorded launch sequence when this signature ran before, else
    :func:`validate` + :func:`run` (recorded for the next call when the launcher notes its
    launches and its per-call scratch, see ``mate_cupy._launch_cache``)."""
    key = None
    if lc.ENABLED:
        opts = (scale, output_final_state, lower_bound, use_qk_l2norm_in_kernel) + lc.env_state(_ENV_KNOBS)
        if lc.plain(opts):
            sig, ptrs = lc.signature((q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, output,
                                      final_state))
            if sig is not None:
                key = (opts, sig)
                recipe = _RECIPES.get(key)
                if recipe is not None:
                    allocs = lc.replay(recipe, ptrs, q)
                    out = output
                    if out is None:
                        out = allocs["out"]
                        if cu_seqlens is not None and q.ndim == 3:
                            out = out[0]
                    if not output_final_state:
                        return out
                    return out, (final_state if final_state is not None else allocs["final"])
    rec = lc.Recorder(_ARRAYS) if key is not None else None
    with lc.recording(rec):
        call, args = validate(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, A_log,
                              dt_bias, lower_bound, use_qk_l2norm_in_kernel, output, final_state)
        if rec is not None:
            for name in _ARRAYS:
                rec.arg(name, call.data(name))
        result = run(call, args, output, final_state if args.output_final_state else None)
    if rec is not None and _launcher_records():
        if args.N > 0 and args.HV > 0 and args.T > 0 and not rec.launches:
            rec.ok = False  # work was launched, none of it noted
        lc.store(_RECIPES, key, rec, call)
    return result


def _launcher_records() -> bool:
    """Whether the chunk launcher launches through the recording ``_launch_cache.launch``."""
    mod = sys.modules.get("mate_cupy.kda.chunk_kernels")
    return mod is not None and getattr(mod, "launch", None) is lc.launch


def run(call: Call, a: ChunkArgs, output, final_state):
    """Compute and return ``output`` or ``(output, final_state)`` in the caller's framework."""
    if call.is_cuda:
        out_arr, fs_arr = _run_cuda(call, a)
    else:
        out_arr, fs_arr = _run_host(call, a)
    out_obj = output if output is not None else call.export(out_arr)
    if not a.output_final_state:
        return out_obj
    fs_obj = final_state if final_state is not None else call.export(fs_arr)
    return out_obj, fs_obj


def _batched(call: Call, a: ChunkArgs, name: str, packed_ndim: int):
    """The data of ``name`` with a batch axis: packed varlen arrays get ``[None]`` (a view)."""
    x = call.data(name)
    y = with_batch(x, a.varlen and x.ndim == packed_ndim)
    if y is not x:
        lc.note_arg(name, y)  # same address as the argument
    return y


def _run_host(call: Call, a: ChunkArgs):
    d = call.data
    if a.varlen:
        sequence_bounds(d("cu_seqlens"), a.T)  # ValueError on bad offsets, before any write
    o, fs_ref = kda_recurrent(
        *(_batched(call, a, n, 3) for n in ("q", "k", "v", "g")), _batched(call, a, "beta", 2),
        scale=a.scale, initial_state=d("initial_state"), cu_seqlens=d("cu_seqlens"),
        A_log=d("A_log"), dt_bias=d("dt_bias"), lower_bound=a.lower_bound, use_qk_l2norm=a.use_qk_l2norm,
    )
    out = d("output")
    if out is not None:
        out[...] = o.reshape(out.shape).astype(a.dtype)
    else:
        out = o.astype(a.dtype)
        if a.squeeze:
            out = out[0]
    fs = None
    if a.output_final_state:
        fs = d("final_state")
        if fs is not None:
            fs[...] = fs_ref.astype(a.state_dtype)
        else:
            fs = fs_ref.astype(a.state_dtype)
    return out, fs


def _run_cuda(call: Call, a: ChunkArgs):
    run_chunk = load_launcher("chunk_kernels", "run_chunk", "chunk_kda")
    d = call.data
    with call.launch_scope():
        q, k, v, g = (cuda_contiguous(_batched(call, a, n, 3)) for n in ("q", "k", "v", "g"))
        beta = cuda_contiguous(_batched(call, a, "beta", 2))
        A_log = cuda_float32(call["A_log"])
        dt_bias = cuda_float32(call["dt_bias"])
        if dt_bias is not None:
            flat = dt_bias.reshape(a.HV * HEAD_DIM)
            if dt_bias is d("dt_bias"):
                lc.note_arg("dt_bias", flat)  # a view of the argument, not a cast copy
            dt_bias = flat
        out_view = d("output")
        if out_view is not None and out_view.ndim == 3:
            out_view = out_view[None]
            lc.note_arg("output", out_view)
        out = CudaOut(call, out_view, a.vshape, a.dtype)
        if out_view is None:
            lc.note_alloc("out", out.buf)
        fs = None
        if a.output_final_state:
            fs = CudaOut(call, d("final_state"), a.state_shape, a.state_dtype)
            if d("final_state") is None:
                lc.note_alloc("final", fs.buf)
        init = cuda_contiguous(d("initial_state"))
        fs_buf = None if fs is None else fs.buf
        half_state = a.state_dtype == FLOAT16
        if half_state:
            lc.refuse()  # casts around the launches
            # The kernel keeps float32/bfloat16 states; an fp16 state (fp16 q) is widened to
            # float32 on the way in and rounded once on the way out, as SPEC 7 states.
            init = None if init is None else cast(init, FLOAT32)
            fs_buf = None if fs is None else call.empty(a.state_shape, FLOAT32)
        run_chunk(
            q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
            initial_state=init, final_state=fs_buf,
            cu_seqlens=cuda_contiguous(d("cu_seqlens")),
            out=out.buf, scale=a.scale, lower_bound=a.lower_bound, use_qk_l2norm=a.use_qk_l2norm,
            stream=call.stream,
        )
        if half_state and fs is not None:
            cast(fs_buf, FLOAT16, out=fs.buf)
        out.finish()
        if fs is not None:
            fs.finish()
    out_arr = out.buf[0] if a.squeeze else out.buf
    return out_arr, None if fs is None else fs.buf
