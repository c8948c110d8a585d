"""Utility ops and their launchers (kernels in ``cuda_src/util.cu``).

* :func:`cast` (public, ``mate_cupy.cast``): ``dtype(x * scale)`` elementwise.
* :func:`launch_build_page_table`: the CUDA half of
  ``build_page_table_from_flat_kv_indices`` (``mate_cupy.msa.page_table``).
* :func:`launch_query_positions`: each query row's last attendable key position from
  device-resident lengths (the static MSA pipeline's selection, ``mate_cupy.msa.pipeline``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ._logging import mate_api
from .checks import check_contiguous, check_dtype, check_given, finite_arg
from .jit import KernelParams, get_kernel, launch, register
from .runtime.interop import BFLOAT16, FLOAT16, FLOAT32, FP8_E4M3, Arg, Call, as_dtype, dtype_name

__all__ = ["CastProblem", "cast", "launch_build_page_table", "launch_query_positions", "validate_cast"]

SOURCE = "util.cu"
_CTYPE = {FLOAT32: "float", FLOAT16: "half_t", BFLOAT16: "bf16_t", FP8_E4M3: "fp8_t"}
CAST_DTYPES = (FLOAT32, FLOAT16, BFLOAT16, FP8_E4M3)
FP8_MAX = 448.0

CAST_PARAMS = KernelParams((("in", "ptr"), ("out", "ptr"), ("n", "i64"), ("scale", "f32")))
CAST_SPECS = {(a, b): register(SOURCE, f"cast_kernel<{_CTYPE[a]}, {_CTYPE[b]}>")
              for a in CAST_DTYPES for b in CAST_DTYPES}
_CAST_THREADS = 256
_CAST_PER_THREAD = 8    # kVec

# build_page_table_kernel<I>: one module exporting the builder for every integer index dtype.
_INDEX_CTYPE = {
    np.dtype(np.int32): "int", np.dtype(np.int64): "long long", np.dtype(np.int8): "signed char",
    np.dtype(np.uint8): "unsigned char", np.dtype(np.int16): "short", np.dtype(np.uint16): "unsigned short",
    np.dtype(np.uint32): "unsigned int", np.dtype(np.uint64): "unsigned long long",
}
PAGE_TABLE_KERNELS = {dt: f"build_page_table_kernel<{c}>" for dt, c in _INDEX_CTYPE.items()}
PAGE_TABLE_SPEC = register(SOURCE, tuple(PAGE_TABLE_KERNELS.values()))
PAGE_TABLE_PARAMS = KernelParams((("kv_indices", "ptr"), ("kv_indices_stride", "i64"), ("page_start", "ptr"),
                                  ("page_table", "ptr"), ("max_pages", "i32")))
_PAGE_TABLE_THREADS = 256

POSITIONS_SPEC = register(SOURCE, "query_positions_kernel")
POSITIONS_PARAMS = KernelParams((("cu_seqlens_q", "ptr"), ("qo_lens", "ptr"), ("kv_lens", "ptr"), ("qo_offset", "ptr"),
                                 ("batch", "i32"), ("total_q", "i32"), ("causal", "i32"), ("positions", "ptr")))
_POSITIONS_THREADS = 256
_POSITIONS_MAX_BLOCKS = 1024


# ----------------------------------------------------------------------------- cast


@dataclass(frozen=True)
class CastProblem:
    """``x`` (``src``, contiguous, ``shape``) to ``dst``, multiplied by ``scale``."""

    src: np.dtype
    dst: np.dtype
    shape: tuple
    size: int
    scale: float
    device: int


def validate_cast(x: Arg, dtype, scale: float, out: Optional[Arg]) -> CastProblem:
    """Every condition of :func:`cast`, for host and CUDA arrays alike."""
    try:
        dst = as_dtype(dtype)
    except (KeyError, TypeError):
        raise TypeError(f"dtype must be one of float32/float16/bfloat16/float8_e4m3fn, got {dtype!r}") from None
    if dst not in CAST_DTYPES:
        raise TypeError(f"dtype must be one of float32/float16/bfloat16/float8_e4m3fn, got {dtype_name(dst)}")
    check_dtype(x, CAST_DTYPES)
    check_contiguous(x)
    if out is not None:
        check_dtype(out, (dst,))
        if out.shape != x.shape:
            raise ValueError(f"out must have x's shape {x.shape}, got {out.shape}")
        check_contiguous(out)
    return CastProblem(x.dtype, dst, tuple(x.shape), x.size, finite_arg("scale", scale), x.device)


def _cast_reference(x: np.ndarray, dtype: np.dtype, scale: float) -> np.ndarray:
    y = x.astype(np.float32) * np.float32(scale)
    if dtype == FP8_E4M3:
        y = np.where(np.isnan(y), y, np.clip(y, -FP8_MAX, FP8_MAX))
    return y.astype(dtype)


def launch_cast(problem: CastProblem, x, out, stream: int) -> None:
    """``out = dst(x * scale)`` on ``stream`` (an address); ``x``/``out`` Args or addresses
    of contiguous arrays of ``problem.size`` elements on the current device. A copy of
    the same dtype with ``scale == 1`` is a device-to-device ``cudaMemcpyAsync``."""
    n = problem.size
    if n == 0:
        return
    if problem.src == problem.dst and problem.scale == 1.0:
        from cupy.cuda import runtime

        runtime.memcpyAsync(out.ptr, x.ptr, n * problem.src.itemsize, runtime.memcpyDeviceToDevice, stream)
        return
    per_block = _CAST_THREADS * _CAST_PER_THREAD
    launch(get_kernel(CAST_SPECS[(problem.src, problem.dst)]), (-(-n // per_block),), (_CAST_THREADS,),
           CAST_PARAMS, (x, out, n, problem.scale), stream=stream)


@mate_api
def cast(x, dtype, scale: float = 1.0, out=None):
    """``dtype(x * scale)`` elementwise; fp8 e4m3 saturates to +-448 (NaN stays NaN).

    ``x``: a contiguous array of float32/float16/bfloat16/float8_e4m3fn. ``dtype``: one of
    the same four (NumPy dtype, name, or framework dtype). ``out``: optional contiguous
    array of ``dtype`` and ``x``'s shape, written and returned. Returns a new array in
    ``x``'s framework otherwise. CUDA arrays run on the caller's current stream.
    """
    check_given("cast", x=x)
    call = Call(x=x, out=out)
    problem = validate_cast(call["x"], dtype, scale, call["out"])
    if not call.is_cuda:
        y = _cast_reference(call["x"].data, problem.dst, problem.scale)
        if out is not None:
            call["out"].data[...] = y
            return out
        return call.export(y, dtype=problem.dst)
    dst = call["out"] if out is not None else call.new("out", problem.shape, problem.dst)
    with call.device_scope():
        launch_cast(problem, call["x"], dst, call.stream_ptr)
    return out if out is not None else dst.obj


# ----------------------------------------------------------------------------- page table


def launch_build_page_table(kv_indices: Arg, page_start: Arg, page_table: Arg, stream: int) -> None:
    """``page_table [B, max_pages]`` int32 (C-contiguous) from ``kv_indices`` (1-D, any
    integer dtype of ``PAGE_TABLE_KERNELS``, any stride) and ``page_start`` (int64
    ``[B + 1]``, the exclusive prefix sum of the requests' page counts, each at most
    ``max_pages``): row ``b`` holds request ``b``'s page ids, then zeros. On ``stream``
    (an address) of the current device."""
    batch, max_pages = page_table.shape
    if batch == 0 or max_pages == 0:
        return
    launch(get_kernel(PAGE_TABLE_SPEC, PAGE_TABLE_KERNELS[kv_indices.dtype]), (batch,), (_PAGE_TABLE_THREADS,),
           PAGE_TABLE_PARAMS, (kv_indices, kv_indices.strides[0], page_start, page_table, max_pages), stream=stream)


# ----------------------------------------------------------------------------- query positions


def launch_query_positions(cu_seqlens_q: int, qo_lens: int, kv_lens: int, qo_offset: int, batch: int,
                           total_q: int, causal: bool, positions: int, stream: int) -> None:
    """``positions [total_q]`` int64 from the int32 device vectors ``cu_seqlens_q [batch + 1]``,
    ``qo_lens``, ``kv_lens`` (the keys each request reads), ``qo_offset [batch]`` (all
    addresses): causal rows ``min(qo_offset[b] + t, kv_lens[b] - 1)``, non-causal rows
    ``kv_lens[b] - 1``, rows of no request -1. On ``stream`` of the current device."""
    if total_q <= 0:
        return
    blocks = min(_POSITIONS_MAX_BLOCKS, -(-total_q // _POSITIONS_THREADS))
    launch(get_kernel(POSITIONS_SPEC, "query_positions_kernel"), (blocks,), (_POSITIONS_THREADS,), POSITIONS_PARAMS,
           (cu_seqlens_q, qo_lens, kv_lens, qo_offset, batch, total_q, int(bool(causal)), positions), stream=stream)
