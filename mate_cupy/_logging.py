"""API logging: ``MATE_CUPY_LOGLEVEL`` (0 off, 1 names, 3 shapes/dtypes/devices/plans).

The level is read when a function is decorated; at level 0 the decorator
returns the function unchanged, so logging costs nothing when off.
``set_log_level`` changes the level of functions decorated afterwards and of the
wrappers already installed (levels >= 1).
"""
from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger("mate_cupy")

_level = int(os.environ.get("MATE_CUPY_LOGLEVEL", "0") or 0)


def get_log_level() -> int:
    """The API logging level (0 off, 1 call names, 3 also shapes, dtypes, devices and plans)."""
    return _level


def set_log_level(level: int) -> None:
    """Set the API logging level (see :func:`get_log_level`); logs go to the ``mate_cupy`` logger."""
    global _level
    _level = int(level)
    if _level > 0 and not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[mate_cupy] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)


def _describe(value) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        dev = getattr(value, "device", "cpu")
        return f"{type(value).__module__.split('.')[0]}[{tuple(shape)}, {value.dtype}, {dev}]"
    mode = getattr(value, "mode", None)
    if mode is not None and hasattr(value, "batch_size"):
        return f"MsaPlan(mode={mode}, batch={value.batch_size}, static={getattr(value, 'is_static', False)})"
    if isinstance(value, tuple) and len(value) == 5 and hasattr(value[3], "mode"):
        return f"MsaPlanInfo(mixed={value[0]}, split={value[1]}, {_describe(value[3])})"
    if isinstance(value, (int, float, bool, str)) or value is None:
        return repr(value)
    return type(value).__name__


def mate_api(fn):
    """Decorate a public function with call logging (free at level 0)."""
    if _level <= 0:
        fn.__mate_api__ = True
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _level >= 3:
            parts = [_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()]
            logger.info("%s(%s)", fn.__qualname__, ", ".join(parts))
        elif _level >= 1:
            logger.info("%s", fn.__qualname__)
        return fn(*args, **kwargs)

    wrapper.__mate_api__ = True
    return wrapper


if _level > 0:
    set_log_level(_level)
