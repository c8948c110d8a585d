"""Tensor maps: the 128-byte descriptors of the tensor memory accelerator (TMA).

A :class:`TensorMap` describes a tiled view of a global array: its dimensions and byte
strides (innermost first), the box one load copies, and the shared-memory swizzle. Its
:meth:`~TensorMap.encode` asks the CUDA driver (``cuTensorMapEncodeTiled``) for the
descriptor bytes, which a kernel takes by value as a ``const __grid_constant__ TensorMap``
parameter (kind ``"map"`` of :class:`mate_cupy.jit.KernelParams`). ``address`` is an integer,
or a :class:`mate_cupy.jit.Source` in a prepared launch (encoded at each run with the call's
address). Encoding reads nothing on the device and allocates nothing there.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

__all__ = ["MAP_BYTES", "NO_MAP", "TensorMap", "TensorMapError", "DTYPE_FLOAT16", "DTYPE_BFLOAT16"]

MAP_BYTES = 128
NO_MAP = bytes(MAP_BYTES)  # the value of a map parameter a launch does not use

# CUtensorMapDataType, CUtensorMapSwizzle, CUtensorMapL2promotion (cuda.h)
DTYPE_FLOAT16, DTYPE_BFLOAT16 = 6, 9
SWIZZLE_128B = 3
L2_PROMOTION_256B = 3


class TensorMapError(RuntimeError):
    """The driver refused a tensor map (its CUresult and the map)."""


@dataclass(frozen=True)
class TensorMap:
    """A tiled tensor map of ``len(dims)`` (1-5) dimensions, innermost first.

    ``dims``: elements per dimension (each >= 1); ``strides``: bytes between consecutive
    indices of dims 1.. (multiples of 16); ``box``: elements one load copies per dimension
    (``box[0] * element bytes <= 128`` with the 128-byte swizzle); out-of-range box elements
    read as zero.
    """

    address: object
    dtype: int
    dims: tuple
    strides: tuple
    box: tuple
    swizzle: int = SWIZZLE_128B

    def encode(self, address: int | None = None) -> bytes:
        """The descriptor bytes for the data at ``address`` (default: ``self.address``)."""
        return ctypes.string_at(self._encode_scratch(address), MAP_BYTES)

    def encode_into(self, dest: int, address: int | None = None) -> None:
        """Write the descriptor for the data at ``address`` to the host memory at ``dest``."""
        ctypes.memmove(dest, self._encode_scratch(address), MAP_BYTES)

    def _encode_scratch(self, address) -> int:
        """Encode into this thread's scratch at a 64-byte aligned address (the driver's
        requirement); that address."""
        addr = self.address if address is None else address
        if not isinstance(addr, int):
            raise TypeError(f"a tensor map needs an integer address, got {addr!r}")
        buf = _scratch()
        at = ctypes.addressof(buf) + (-ctypes.addressof(buf) % 64)
        rank = len(self.dims)
        u64s, u32s = ctypes.c_uint64 * rank, ctypes.c_uint32 * rank
        rc = _encode_tiled()(at, self.dtype, rank, addr, u64s(*self.dims),
                             (ctypes.c_uint64 * max(1, rank - 1))(*self.strides), u32s(*self.box),
                             u32s(*([1] * rank)), 0, self.swizzle, L2_PROMOTION_256B, 0)
        if rc != 0:
            raise TensorMapError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for {self}")
        return at


_TLS = threading.local()
_ENCODE = []


def _scratch():
    buf = getattr(_TLS, "buf", None)
    if buf is None:
        buf = _TLS.buf = ctypes.create_string_buffer(MAP_BYTES + 64)
    return buf


def _encode_tiled():
    """``cuTensorMapEncodeTiled`` of the CUDA driver (bound on first use)."""
    if not _ENCODE:
        from ..runtime.device import _driver

        lib = _driver()
        if not lib:
            raise TensorMapError("tensor maps need the CUDA driver (libcuda), which is not loaded")
        fn = lib.cuTensorMapEncodeTiled
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                       ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        _ENCODE.append(fn)
    return _ENCODE[0]
