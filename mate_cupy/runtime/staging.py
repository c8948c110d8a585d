"""Bit-exact copies of CUDA arrays into layouts the kernels read (staging).

The copies go through a same-size unsigned-integer view, so they work for every dtype
(bfloat16 and fp8 held as uint8 included) and preserve bits exactly. CuPy is imported by
the callers' arrays only; nothing here imports it at module level.
"""
from __future__ import annotations

import numpy as np

__all__ = ["cuda_contiguous", "cuda_copy_into"]


def _same_size_uint(dtype: np.dtype):
    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]


def cuda_contiguous(x):
    """A C-contiguous CuPy array with ``x``'s values (``x`` itself when already contiguous)."""
    if x is None or x.flags.c_contiguous:
        return x
    import cupy

    return cupy.ascontiguousarray(x.view(_same_size_uint(x.dtype))).view(x.dtype)


def cuda_copy_into(dst, src) -> None:
    """``dst[...] = src`` bit-exactly (same itemsize and shape; any strides) on CuPy's current stream."""
    u = _same_size_uint(dst.dtype)
    dst.view(u)[...] = src.view(u)
