"""Pieces shared by the two KDA ops: dtype sets, varlen views, launcher loading, CUDA staging.

Nothing here imports CuPy at module level; CUDA helpers import it when called.
"""
from __future__ import annotations

import importlib

import numpy as np

from ..runtime.interop import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, INT32, INT64, Arg, dtype_name

HALF_DTYPES = (FLOAT16, BFLOAT16)
INDEX_DTYPES = (INT32, INT64)
FLOAT_DTYPES = (FLOAT16, BFLOAT16, FLOAT32, FLOAT64)


def names(dtypes) -> str:
    return " or ".join(dtype_name(d) for d in dtypes)


def with_batch(x, add: bool):
    """``x[None]`` (a view, any strides) when ``add``, else ``x``."""
    return x[None] if add else x


def load_launcher(module: str, func: str, op: str):
    """The CUDA launcher ``mate_cupy.kda.<module>.<func>``, or ``NotImplementedError``.

    Only a missing module or function is turned into ``NotImplementedError``; any other
    import error of an existing launcher module propagates.
    """
    full = f"mate_cupy.kda.{module}"
    try:
        mod = importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name not in (full, "mate_cupy.kda"):
            raise
        mod = None
    fn = getattr(mod, func, None) if mod is not None else None
    if fn is None:
        raise NotImplementedError(
            f"{op} on CUDA arrays needs the kernel launcher {full}.{func}, which is not "
            "available in this build; pass NumPy arrays to run the float64 reference"
        )
    return fn


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


def cuda_float32(arg: Arg):
    """``arg``'s CuPy data as a contiguous float32 array (a cast kernel for fp16/bf16/fp64)."""
    if arg is None:
        return None
    x = cuda_contiguous(arg.data)
    if arg.dtype == FLOAT32:
        return x
    if arg.dtype in (FLOAT64, FLOAT16):
        return x.astype(np.float32)
    from ..util_ops import cast

    return cast(x, FLOAT32)


class CudaOut:
    """A kernel output buffer over a caller's preallocated array (or a new one).

    ``buf`` is what the kernel writes: the caller's array when it is C-contiguous, else a
    contiguous temporary that :meth:`finish` copies back into the caller's array.
    ``initial=True`` also copies the caller's values into the temporary (in-place state).
    """

    def __init__(self, call, caller_view, shape, dtype, *, initial: bool = False):
        self.view = caller_view
        if caller_view is None:
            self.buf = call.empty(shape, dtype)
        elif caller_view.flags.c_contiguous:
            self.buf = caller_view
        else:
            self.buf = cuda_contiguous(caller_view) if initial else call.empty(shape, dtype)

    def finish(self) -> None:
        if self.view is not None and self.buf is not self.view:
            cuda_copy_into(self.view, self.buf)
