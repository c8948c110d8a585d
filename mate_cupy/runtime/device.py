"""Properties of CUDA devices, read once per device, and capture-tolerant module loading."""
from __future__ import annotations

import contextlib
import ctypes
import functools

_INFO: dict = {}


@functools.lru_cache(maxsize=1)
def cuda_present() -> bool:
    """Whether this process sees a CUDA device (False without CuPy, a driver or a device)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def device_info(device: int | None = None) -> tuple:
    """(multiprocessor count, compute capability major * 10 + minor) of ``device`` (default: current)."""
    import cupy

    dev = cupy.cuda.Device().id if device is None else int(device)
    info = _INFO.get(dev)
    if info is None:
        props = cupy.cuda.runtime.getDeviceProperties(dev)
        info = _INFO[dev] = (int(props["multiProcessorCount"]), int(props["major"]) * 10 + int(props["minor"]))
    return info


_CU_STREAM_CAPTURE_MODE_RELAXED = 2
_libcuda = None


def _driver():
    global _libcuda
    if _libcuda is None:
        try:
            _libcuda = ctypes.CDLL("libcuda.so.1")
        except OSError:
            _libcuda = False
    return _libcuda


@contextlib.contextmanager
def capture_tolerant():
    """This thread in CUDA's relaxed stream-capture mode (``cuThreadExchangeStreamCaptureMode``).

    Module loading is refused while another stream of the process captures in global mode
    (torch.cuda.graph's default); in relaxed mode the loading thread may do it. Outside a
    capture the mode changes nothing.
    """
    lib = _driver()
    if not lib:
        yield
        return
    mode = ctypes.c_int(_CU_STREAM_CAPTURE_MODE_RELAXED)
    lib.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))
    try:
        yield
    finally:
        lib.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))
