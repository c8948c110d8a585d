"""Read DLPack capsules directly (ctypes), for dtypes CuPy/NumPy refuse.

CuPy refuses DLPack dtype code 10 (float8_e4m3fn) and NumPy refuses bfloat16;
both are common in attention kernels. ``describe(obj, stream)`` asks the
producer for a capsule, reads pointer, device, shape, strides and dtype out of
the ``DLTensor`` and leaves the capsule unconsumed (its destructor hands the
reference back to the producer). The caller keeps ``obj`` alive for as long as
views of its memory exist.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import ml_dtypes
import numpy as np

# DLDeviceType
KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3
KDL_CUDA_MANAGED = 13

_HOST_DEVICE_TYPES = (KDL_CPU, KDL_CUDA_HOST)
_CUDA_DEVICE_TYPES = (KDL_CUDA, KDL_CUDA_MANAGED)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype = ctypes.c_char_p
_get_name.argtypes = [ctypes.py_object]

# (code, bits) -> numpy dtype. Code 10 is kDLFloat8_e4m3fn (DLPack 1.1).
_DTYPES = {
    (0, 8): np.dtype(np.int8),
    (0, 16): np.dtype(np.int16),
    (0, 32): np.dtype(np.int32),
    (0, 64): np.dtype(np.int64),
    (1, 8): np.dtype(np.uint8),
    (1, 16): np.dtype(np.uint16),
    (1, 32): np.dtype(np.uint32),
    (1, 64): np.dtype(np.uint64),
    (2, 16): np.dtype(np.float16),
    (2, 32): np.dtype(np.float32),
    (2, 64): np.dtype(np.float64),
    (4, 16): np.dtype(ml_dtypes.bfloat16),
    (6, 8): np.dtype(np.bool_),
    (10, 8): np.dtype(ml_dtypes.float8_e4m3fn),
}


@dataclass(frozen=True)
class DLDescription:
    """What a DLPack capsule says about an array (strides in elements)."""

    ptr: int
    device_type: int
    device_id: int
    shape: tuple
    strides: tuple
    dtype: np.dtype

    @property
    def is_cuda(self) -> bool:
        return self.device_type in _CUDA_DEVICE_TYPES

    @property
    def nbytes_span(self) -> int:
        """Bytes from ``ptr`` to one past the last element (0 for empty arrays)."""
        if any(s == 0 for s in self.shape):
            return 0
        last = sum((n - 1) * st for n, st in zip(self.shape, self.strides))
        return (last + 1) * self.dtype.itemsize


def _read_tensor(t: _DLTensor) -> DLDescription:
    code, bits, lanes = t.dtype.code, t.dtype.bits, t.dtype.lanes
    if lanes != 1 or (code, bits) not in _DTYPES:
        raise TypeError(f"unsupported DLPack dtype (code={code}, bits={bits}, lanes={lanes})")
    dtype = _DTYPES[(code, bits)]
    ndim = t.ndim
    shape = tuple(int(t.shape[i]) for i in range(ndim))
    if t.strides:
        strides = tuple(int(t.strides[i]) for i in range(ndim))
    else:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= max(n, 1)
        strides = tuple(reversed(strides))
    return DLDescription(
        ptr=int(t.data or 0) + int(t.byte_offset),
        device_type=int(t.device.device_type),
        device_id=int(t.device.device_id),
        shape=shape,
        strides=strides,
        dtype=dtype,
    )


def describe_capsule(capsule) -> DLDescription:
    """Read a ``dltensor`` or ``dltensor_versioned`` capsule without consuming it."""
    name = _get_name(capsule)
    ptr = _get_pointer(capsule, name)
    if name == b"dltensor":
        return _read_tensor(_DLManagedTensor.from_address(ptr).dl_tensor)
    if name == b"dltensor_versioned":
        return _read_tensor(_DLManagedTensorVersioned.from_address(ptr).dl_tensor)
    raise TypeError(f"not an unconsumed DLPack capsule (name {name!r})")


def describe(obj, stream=None) -> DLDescription:
    """Ask ``obj`` for a capsule (``__dlpack__(stream=stream)``) and read it."""
    try:
        capsule = obj.__dlpack__(stream=stream)
    except TypeError:
        capsule = obj.__dlpack__()
    return describe_capsule(capsule)


def device_of(obj) -> tuple[int, int]:
    """``(device_type, device_id)`` of any DLPack producer."""
    dev = obj.__dlpack_device__()
    return int(dev[0]), int(dev[1])


class _HostBuffer:
    """Owner object exposing foreign host memory to NumPy, keeping the producer alive."""

    def __init__(self, desc: DLDescription, owner):
        self._owner = owner
        size = desc.dtype.itemsize
        self.__array_interface__ = {
            "data": (desc.ptr, False),
            "shape": desc.shape,
            "strides": tuple(s * size for s in desc.strides),
            "typestr": f"|u{size}" if size == 1 else f"<u{size}",
            "version": 3,
        }


def numpy_view(desc: DLDescription, owner) -> np.ndarray:
    """Zero-copy NumPy view of host memory described by ``desc``."""
    raw = np.asarray(_HostBuffer(desc, owner))
    return raw.view(desc.dtype)


def cupy_view(desc: DLDescription, owner):
    """Zero-copy CuPy view of device memory; fp8 is viewed as ``uint8``."""
    import cupy

    dtype = desc.dtype
    if dtype == np.dtype(ml_dtypes.float8_e4m3fn):
        dtype = np.dtype(np.uint8)
    mem = cupy.cuda.UnownedMemory(desc.ptr, max(desc.nbytes_span, 1), owner, desc.device_id)
    memptr = cupy.cuda.MemoryPointer(mem, 0)
    strides = tuple(s * dtype.itemsize for s in desc.strides)
    return cupy.ndarray(desc.shape, dtype=dtype, memptr=memptr, strides=strides)
