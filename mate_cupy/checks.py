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

import math
import operator
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


def check_contiguous(arg: Arg) -> None:
    """``ValueError`` unless ``arg`` is C-contiguous."""
    if not arg.is_contiguous():
        raise ValueError(f"{arg.name} must be contiguous (C order), got strides {arg.data.strides}")


INT32_MAX = 2**31 - 1


class ArgumentTypeError(TypeError, ValueError):
    """A scalar argument of the wrong kind (a string, a bool, a non-number): a ``TypeError``,
    and a ``ValueError`` too, the type the reproduced API's ``int(x)`` / ``float(x)``
    conversions raise for such values, so callers catching either keep working."""


def int_arg(name: str, value, *, lo: Optional[int] = None, hi: Optional[int] = INT32_MAX) -> int:
    """An integer argument: a Python or NumPy int (anything with ``__index__``) or a float
    holding a whole number; ``ArgumentTypeError`` for a bool, a string or another object,
    ``ValueError`` for a fractional or non-finite float and outside ``[lo, hi]`` (default:
    at most int32). Never truncates."""
    if isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be an int, got bool {value}")
    try:
        v = operator.index(value)
    except TypeError:
        if not isinstance(value, (float, np.floating)):
            raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
        if not math.isfinite(value) or value != math.floor(value):
            raise ValueError(f"{name} must be a whole number, got {value!r}") from None
        v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name} must be in [{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}], got {v}")
    return v


def finite_arg(name: str, value) -> float:
    """A finite real argument (anything ``float()`` takes but a bool or a string:
    ``ArgumentTypeError`` otherwise; ``ValueError`` for NaN or infinity)."""
    if isinstance(value, (bool, np.bool_, str, bytes)):
        raise ArgumentTypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        v = float(value)
    except OverflowError:
        v = math.inf
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"{name} must be a real number, got {type(value).__name__}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def check_given(fn: str, **arrays) -> None:
    """``TypeError`` naming the first required array argument given as None."""
    for name, obj in arrays.items():
        if obj is None:
            raise TypeError(f"{fn}: {name} is required (an array), got None")
