"""Pieces shared by the two KDA ops: dtype sets, varlen views, bit-exact CUDA staging copies.

Nothing here imports CuPy at module level; CUDA helpers import it when called.
"""
from __future__ import annotations

import numpy as np

from ..runtime.interop import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, INT32, INT64, dtype_name

HALF_DTYPES = (FLOAT16, BFLOAT16)
INDEX_DTYPES = (INT32, INT64)
FLOAT_DTYPES = (FLOAT16, BFLOAT16, FLOAT32, FLOAT64)


def names(dtypes) -> str:
    return " or ".join(dtype_name(d) for d in dtypes)


def with_batch(x, add: bool):
    """``x[None]`` (a view, any strides) when ``add``, else ``x``."""
    return x[None] if add else x


# ----------------------------------------------------------------------------- CUDA staging


def _same_size_uint(dtype: np.dtype):
    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]


def cuda_contiguous(x):
    """A C-contiguous CuPy array with ``x``'s values (``x`` itself when already contiguous).

    The copy goes through a same-size integer view, so it works for every dtype
    (bfloat16 included) and preserves bits exactly.
    """
    if x is None or x.flags.c_contiguous:
        return x
    import cupy

    return cupy.ascontiguousarray(x.view(_same_size_uint(x.dtype))).view(x.dtype)


def cuda_copy_into(dst, src) -> None:
    """``dst[...] = src`` bit-exactly (same dtype and shape; any strides)."""
    u = _same_size_uint(dst.dtype)
    dst.view(u)[...] = src.view(u)
