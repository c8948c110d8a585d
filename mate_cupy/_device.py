"""Cached properties of the current CUDA device, read once per device id.

``device_info()`` -> ``(SM count, compute capability as an int, e.g. 90)``. Launchers call
it through their own ``_sm_count`` / ``_device_info`` wrappers, which tests replace.
"""
from __future__ import annotations

_INFO: dict = {}


def device_info() -> tuple:
    """(multiprocessor count, compute capability major * 10 + minor) of the current device."""
    import cupy

    dev = cupy.cuda.Device().id
    info = _INFO.get(dev)
    if info is None:
        props = cupy.cuda.runtime.getDeviceProperties(dev)
        info = _INFO[dev] = (int(props["multiProcessorCount"]), int(props["major"]) * 10 + int(props["minor"]))
    return info
