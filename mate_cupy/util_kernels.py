"""Utility kernels (``cuda_src/util.cu``): dtype casts and the page-table builder.

``cast`` is public (``mate_cupy.cast``); ``build_page_table_cuda`` backs
``build_page_table_from_flat_kv_indices`` for CUDA arrays.
"""
from __future__ import annotations

import numpy as np

from ._interop import BFLOAT16, FLOAT16, FLOAT32, FP8_E4M3, Call, as_dtype, dtype_name
from ._logging import mate_api
from .jit import get_kernel, launch, register

_CTYPE = {FLOAT32: "float", FLOAT16: "half_t", BFLOAT16: "bf16_t", FP8_E4M3: "fp8_t"}
_CAST_TYPES = (FLOAT32, FLOAT16, BFLOAT16, FP8_E4M3)

CAST_SPECS = {
    (a, b): register("util.cu", f"cast_kernel<{_CTYPE[a]}, {_CTYPE[b]}>")
    for a in _CAST_TYPES
    for b in _CAST_TYPES
    if a != b
}
PAGE_TABLE_SPEC = register("util.cu", "build_page_table_kernel")


def _cast_reference(x: np.ndarray, dtype: np.dtype, scale: float) -> np.ndarray:
    y = x.astype(np.float32) * np.float32(scale)
    if dtype == FP8_E4M3:
        lim = float(ml_fp8_max())
        y = np.where(np.isnan(y), y, np.clip(y, -lim, lim))
    return y.astype(dtype)


def ml_fp8_max() -> float:
    return 448.0


@mate_api
def cast(x, dtype, scale: float = 1.0, out=None):
    """``out = dtype(x * scale)`` elementwise (fp8 e4m3 saturates to +-448).

    x: any contiguous array of float32/float16/bfloat16/float8_e4m3fn.
    dtype: target, one of the same four. Returns the caller's framework.
    """
    call = Call(x=x, out=out)
    src = call["x"].dtype
    dst = as_dtype(dtype)
    if src not in _CAST_TYPES or dst not in _CAST_TYPES:
        raise TypeError(
            f"cast supports float32/float16/bfloat16/float8_e4m3fn, got x={dtype_name(src)} -> {dtype_name(dst)}"
        )
    if not call["x"].is_contiguous():
        raise ValueError("x must be contiguous")
    if out is not None:
        o = call["out"]
        if o.dtype != dst or o.shape != call["x"].shape or not o.is_contiguous():
            raise ValueError(
                f"out must be a contiguous {dtype_name(dst)} array of shape {call['x'].shape}, got {o.describe()}"
            )
    if not call.is_cuda:
        y = _cast_reference(call["x"].data, dst, scale)
        if out is not None:
            call["out"].data[...] = y
            return out
        return call.export(y)
    y = call["out"].data if out is not None else call.empty(call["x"].shape, dst)
    n = call["x"].size
    if src == dst:
        with call.launch_scope():
            y[...] = call["x"].data
    elif n:
        with call.launch_scope():
            k = get_kernel(CAST_SPECS[(src, dst)])
            threads = 256
            blocks = (n + threads * 8 - 1) // (threads * 8)
            launch(k, (blocks,), (threads,), (call["x"].data, y, np.int64(n), np.float32(scale)),
                   stream=call.stream)
    return out if out is not None else call.export(y, dtype=dst)


def build_page_table_cuda(call: Call, kv_indices, kv_lens, batch: int, max_pages: int, page_size: int):
    """Launch the builder: ``kv_indices``/``kv_lens`` int32 CuPy arrays -> [batch, max_pages]."""
    import cupy

    with call.launch_scope():
        table = cupy.empty((batch, max_pages), dtype=np.int32)
        if batch and max_pages:
            launch(get_kernel(PAGE_TABLE_SPEC), (batch,), (256,),
                   (kv_indices, kv_lens, table, np.int32(batch), np.int32(max_pages), np.int32(page_size)),
                   stream=call.stream)
    return table
