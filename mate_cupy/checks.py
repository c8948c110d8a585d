"""Shared argument checks with uniform messages.

Every check raises before any launch and names the argument, what was expected and
what was received. Conventions:

* wrong dtype, wrong rank of an index vector, or a non-array object: ``TypeError``;
* wrong shape, size, value, device or memory layout: ``ValueError``;
* a valid request that this build does not run: ``NotImplementedError``.

The checks take :class:`mate_cupy.runtime.interop.Arg` views (``call["q"]``) or plain
Python values; none of them reads device memory.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import numpy as np

from .runtime.interop import Arg, dtype_name


def where(device: int) -> str:
    """``cpu`` or ``cuda:N`` for an :class:`Arg` device id."""
    return "cpu" if device < 0 else f"cuda:{device}"


def _names(dtypes: Iterable) -> str:
    return "/".join(dtype_name(d) for d in dtypes)


def check_dtype(arg: Arg, allowed: Sequence, what: Optional[str] = None) -> None:
    """``TypeError`` unless ``arg.dtype`` is one of ``allowed``."""
    if arg.dtype not in tuple(np.dtype(d) for d in allowed):
        raise TypeError(
            f"{arg.name} must be {what or _names(allowed)}, got {dtype_name(arg.dtype)}"
        )


def check_ndim(arg: Arg, ndim: int, layout: str, *, exc=ValueError) -> None:
    """``arg`` must have rank ``ndim``; ``layout`` spells the expected shape (``[total_q, Hq, D]``)."""
    if arg.ndim != ndim:
        raise exc(f"{arg.name} must have shape {layout}, got {arg.shape}")


def check_shape(arg: Arg, expected: tuple, layout: str = "") -> None:
    """``ValueError`` unless ``arg.shape == expected``."""
    if tuple(arg.shape) != tuple(int(x) for x in expected):
        lay = f"{layout} = " if layout else ""
        raise ValueError(f"{arg.name} must have shape {lay}{tuple(expected)}, got {arg.shape}")


def check_contiguous(arg: Arg) -> None:
    """``ValueError`` unless ``arg`` is C-contiguous."""
    if not arg.is_contiguous():
        raise ValueError(f"{arg.name} must be contiguous (C order), got strides {arg.data.strides}")


def check_device(arg: Arg, device: int, ref_name: str) -> None:
    """``ValueError`` unless ``arg`` lives on ``device`` (the device of ``ref_name``)."""
    if arg.device != device:
        raise ValueError(
            f"{arg.name} must be on the same device as {ref_name} ({where(device)}), "
            f"got {where(arg.device)}"
        )


def check_int_vector(arg: Arg, length: Optional[int] = None) -> None:
    """A rank-1 integer array (``TypeError`` for the dtype, ``ValueError`` for rank/length)."""
    if arg.dtype.kind not in "iu":
        raise TypeError(f"{arg.name} must be an integer array, got {dtype_name(arg.dtype)}")
    if arg.ndim != 1:
        raise ValueError(f"{arg.name} must be a 1D array, got shape {arg.shape}")
    if length is not None and arg.shape[0] != int(length):
        raise ValueError(f"{arg.name} must have length {int(length)}, got {arg.shape[0]}")


def check_in_range(name: str, value: int, lo: Optional[int] = None, hi: Optional[int] = None) -> None:
    """``ValueError`` unless ``lo <= value <= hi`` (either bound may be omitted)."""
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        lo_s = "-inf" if lo is None else str(lo)
        hi_s = "inf" if hi is None else str(hi)
        raise ValueError(f"{name} must be in [{lo_s}, {hi_s}], got {value}")


def check_positive(name: str, value: int) -> None:
    """``ValueError`` unless ``value > 0``."""
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
