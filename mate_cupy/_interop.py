"""DLPack in, caller's framework out: the one interop layer every op uses.

A public op wraps its array arguments in a :class:`Call`::

    call = Call(q=q, k=k, v=v, out=out)       # None entries are allowed
    call["q"].data      # numpy.ndarray (host) or cupy.ndarray (CUDA), zero-copy
    call["q"].dtype     # logical dtype: float16, bfloat16, float8_e4m3fn, ...
    call.is_cuda        # which path runs: CUDA kernels or float64 references
    with call.stream:   # the caller's current stream (torch's for torch inputs)
        ...launch...
    return call.export(result)   # back in the framework of the first array

CUDA fp8 arrays are viewed as ``uint8`` by CuPy (``Arg.data``) while
``Arg.dtype`` keeps ``float8_e4m3fn``; host fp8 uses ``ml_dtypes``. Arrays of one
call must share one device (a ``ValueError`` names the offenders); frameworks
may be mixed, and results follow the first array's framework.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional

import ml_dtypes
import numpy as np

from . import _dlpack

FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FP8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FLOAT32 = np.dtype(np.float32)
FLOAT64 = np.dtype(np.float64)
INT32 = np.dtype(np.int32)
INT64 = np.dtype(np.int64)

_DTYPE_NAMES = {
    "float16": FLOAT16, "half": FLOAT16, "bfloat16": BFLOAT16, "float8_e4m3fn": FP8_E4M3,
    "float32": FLOAT32, "float": FLOAT32, "float64": FLOAT64, "int32": INT32, "int64": INT64,
    "uint8": np.dtype(np.uint8), "bool": np.dtype(np.bool_),
}


def dtype_name(dt) -> str:
    """Readable name of a dtype (``bfloat16``, ``float8_e4m3fn``, ...)."""
    return np.dtype(dt).name


def as_dtype(dt) -> np.dtype:
    """Normalise a dtype given as NumPy dtype, name, or torch/jax dtype object."""
    if isinstance(dt, np.dtype):
        return dt
    if isinstance(dt, str):
        return _DTYPE_NAMES[dt]
    name = str(dt).replace("torch.", "").replace("jax.numpy.", "").replace("dtype(", "").strip("')\"")
    if name in _DTYPE_NAMES:
        return _DTYPE_NAMES[name]
    return np.dtype(dt)


def framework_of(obj) -> str:
    """'numpy', 'cupy', 'torch', 'jax', or 'dlpack' (any other producer)."""
    mod = type(obj).__module__.split(".")[0]
    if isinstance(obj, np.ndarray):
        return "numpy"
    if mod in ("cupy", "torch"):
        return mod
    if mod in ("jax", "jaxlib"):
        return "jax"
    return "dlpack"


def is_array(obj) -> bool:
    return isinstance(obj, np.ndarray) or hasattr(obj, "__dlpack__")


@dataclass
class Arg:
    """Backend-neutral view of one caller array."""

    name: str
    obj: Any
    data: Any  # numpy.ndarray or cupy.ndarray
    dtype: np.dtype
    framework: str
    device: int  # -1 for host memory

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def is_cuda(self) -> bool:
        return self.device >= 0

    @property
    def size(self) -> int:
        return int(self.data.size)

    def is_contiguous(self) -> bool:
        return bool(self.data.flags.c_contiguous)

    def describe(self) -> str:
        where = "cpu" if self.device < 0 else f"cuda:{self.device}"
        return f"{self.name}: shape={self.shape}, dtype={dtype_name(self.dtype)}, device={where}"


def _torch_stream_ptr(device: int) -> int:
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


def _cupy_stream_ptr() -> int:
    import cupy

    return int(cupy.cuda.get_current_stream().ptr)


def wrap(name: str, obj) -> Arg:
    """Wrap one array (NumPy, CuPy, torch, JAX, any DLPack producer) zero-copy."""
    fw = framework_of(obj)
    if fw == "numpy":
        if obj.dtype.kind == "V" and obj.dtype not in (BFLOAT16, FP8_E4M3):
            raise TypeError(f"{name}: unsupported NumPy dtype {obj.dtype}")
        return Arg(name, obj, obj, obj.dtype, fw, -1)
    if not hasattr(obj, "__dlpack__"):
        raise TypeError(
            f"{name} must be an array implementing DLPack (NumPy, CuPy, torch, JAX), "
            f"got {type(obj).__name__}"
        )
    if fw == "cupy":
        dt = obj.dtype
        return Arg(name, obj, obj, FP8_E4M3 if dt == FP8_E4M3 else dt, fw, int(obj.device.id))
    if fw == "torch":
        if obj.requires_grad:
            obj = obj.detach()  # DLPack refuses tensors that require grad; the memory is the same
        if obj.is_cuda:
            return _wrap_torch_cuda(name, obj)
    dev_type, dev_id = _dlpack.device_of(obj)
    if dev_type in _dlpack._HOST_DEVICE_TYPES:
        desc = _dlpack.describe(obj, stream=None)
        return Arg(name, obj, _dlpack.numpy_view(desc, obj), desc.dtype, fw, -1)
    if dev_type not in _dlpack._CUDA_DEVICE_TYPES:
        raise ValueError(f"{name}: unsupported device type {dev_type} (expected CPU or CUDA)")
    # CUDA producer. torch: we launch on torch's current stream, so no
    # cross-stream sync is requested (-1). Others: sync to CuPy's current stream.
    if fw == "torch":
        stream = -1
    else:
        import cupy

        with cupy.cuda.Device(dev_id):
            stream = _cupy_stream_ptr()
    desc = _dlpack.describe(obj, stream=stream)
    return Arg(name, obj, _dlpack.cupy_view(desc, obj), desc.dtype, fw, desc.device_id)


_TORCH_DTYPES: dict = {}


def _torch_dtype_map() -> dict:
    if not _TORCH_DTYPES:
        import torch

        _TORCH_DTYPES.update({
            torch.float16: FLOAT16, torch.bfloat16: BFLOAT16, torch.float8_e4m3fn: FP8_E4M3,
            torch.float32: FLOAT32, torch.float64: FLOAT64, torch.int32: INT32, torch.int64: INT64,
            torch.uint8: np.dtype(np.uint8), torch.int8: np.dtype(np.int8), torch.bool: np.dtype(np.bool_),
            torch.int16: np.dtype(np.int16),
        })
    return _TORCH_DTYPES


_cupy_mod = None


def _cupy():
    global _cupy_mod
    if _cupy_mod is None:
        import cupy

        _cupy_mod = cupy
    return _cupy_mod


def _wrap_torch_cuda(name: str, t) -> Arg:
    """Fast path for torch CUDA tensors: the same zero-copy view the DLPack capsule gives,
    built from the tensor's attributes (a few microseconds instead of tens)."""
    dtype = (_TORCH_DTYPES or _torch_dtype_map()).get(t.dtype)
    if dtype is None:
        raise TypeError(f"{name}: unsupported torch dtype {t.dtype}")
    cp = _cupy()
    dev = t.device.index
    item = dtype.itemsize
    view_dtype = _U8 if dtype is FP8_E4M3 else dtype
    shape = tuple(t.shape)
    if t.is_contiguous():
        span, strides = t.numel() * item, None
    else:
        st = t.stride()
        span = 0 if 0 in shape else (sum((n - 1) * s for n, s in zip(shape, st)) + 1) * item
        strides = tuple(s * item for s in st)
    mem = cp.cuda.UnownedMemory(t.data_ptr(), span or 1, t, dev)
    data = cp.ndarray(shape, dtype=view_dtype, memptr=cp.cuda.MemoryPointer(mem, 0), strides=strides)
    return Arg(name, t, data, dtype, "torch", dev)


_U8 = np.dtype(np.uint8)


class _StreamHandle:
    """Minimal object implementing the CUDA stream protocol for CuPy."""

    def __init__(self, ptr: int):
        self._ptr = ptr

    def __cuda_stream__(self):
        return (0, self._ptr)


_stream_cache: dict = {}


def external_stream(ptr: int):
    """A CuPy stream object wrapping a raw ``cudaStream_t`` (cached per pointer)."""
    import cupy

    s = _stream_cache.get(ptr)
    if s is None:
        if ptr == 0:
            s = cupy.cuda.Stream.null
        else:
            s = cupy.cuda.Stream.from_external(_StreamHandle(ptr))
        if len(_stream_cache) > 64:
            _stream_cache.clear()
        _stream_cache[ptr] = s
    return s


class Call:
    """The arrays of one public call: one device, one result framework, one stream.

    ``Call(q=q, k=k, out=None)`` wraps every non-None argument in an :class:`Arg`
    (in keyword order; the first array decides the result framework) and checks
    that they share one device.
    """

    def __init__(self, **arrays):
        self.args: dict[str, Arg] = {}
        self.framework: Optional[str] = None
        self.device: Optional[int] = None
        self._first: Optional[str] = None
        self._stream = None
        for name, obj in arrays.items():
            self.add(name, obj)

    def add(self, name: str, obj) -> Optional[Arg]:
        """Wrap one more array (or None) into the call; checks the device."""
        if obj is None:
            return None
        arg = wrap(name, obj)
        if self.device is None:
            self.device, self.framework, self._first = arg.device, arg.framework, name
        elif arg.device != self.device:
            where = lambda d: "cpu" if d < 0 else f"cuda:{d}"  # noqa: E731
            raise ValueError(
                f"{name} is on {where(arg.device)} but {self._first} is on "
                f"{where(self.device)}: all arrays of one call must share one device"
            )
        self.args[name] = arg
        return arg

    def __getitem__(self, name: str) -> Optional[Arg]:
        return self.args.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self.args

    def data(self, name: str):
        a = self.args.get(name)
        return None if a is None else a.data

    @property
    def is_cuda(self) -> bool:
        return self.device is not None and self.device >= 0

    @property
    def xp(self):
        if self.is_cuda:
            import cupy

            return cupy
        return np

    @property
    def stream(self):
        """Caller's current stream as a CuPy stream (a context manager); host: no-op."""
        if not self.is_cuda:
            return contextlib.nullcontext()
        if self._stream is None:
            if self.framework == "torch":
                self._stream = external_stream(_torch_stream_ptr(self.device))
            else:
                import cupy

                with cupy.cuda.Device(self.device):
                    self._stream = cupy.cuda.get_current_stream()
        return self._stream

    def device_scope(self):
        """Context: CuPy's current device set to this call's device (no-op on host)."""
        if not self.is_cuda:
            return contextlib.nullcontext()
        import cupy

        return cupy.cuda.Device(self.device)

    @contextlib.contextmanager
    def launch_scope(self):
        """Device and stream of this call, for launches and allocations."""
        with self.device_scope(), self.stream:
            yield

    def empty(self, shape, dtype):
        """New uninitialised backend array on this call's device (fp8: uint8 on CUDA)."""
        dtype = as_dtype(dtype)
        if self.is_cuda:
            import cupy

            if dtype == FP8_E4M3:
                dtype = np.dtype(np.uint8)
            with self.device_scope(), self.stream:
                return cupy.empty(shape, dtype=dtype)
        return np.empty(shape, dtype=dtype)

    def export(self, arr, dtype=None):
        """Give a backend array back in the caller's framework, zero-copy.

        ``dtype`` names the logical dtype (needed for fp8 arrays held as uint8).
        """
        if arr is None:
            return None
        return export(arr, self.framework or "numpy", dtype=dtype, call=self)


def _np_int_view(arr: np.ndarray) -> np.ndarray:
    return arr.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[arr.dtype.itemsize])


def export(arr, framework: str, *, dtype=None, call: Optional[Call] = None):
    """Convert a NumPy/CuPy array to ``framework`` without copying where possible."""
    logical = as_dtype(dtype) if dtype is not None else np.dtype(arr.dtype)
    is_host = isinstance(arr, np.ndarray)
    if framework in ("numpy", "dlpack"):
        if is_host:
            return arr.view(logical) if arr.dtype != logical else arr
        return arr  # CUDA result for a generic producer: CuPy array
    if framework == "cupy":
        return arr
    if framework == "torch":
        import torch

        tdt = {FP8_E4M3: torch.float8_e4m3fn, BFLOAT16: torch.bfloat16}.get(logical)
        if is_host:
            if tdt is not None:
                return torch.from_numpy(_np_int_view(arr)).view(tdt)
            return torch.from_numpy(arr)
        ctx = call.stream if call is not None else contextlib.nullcontext()
        with ctx:
            if logical == FP8_E4M3:
                return torch.from_dlpack(arr.view(np.uint8)).view(torch.float8_e4m3fn)
            return torch.from_dlpack(arr)
    if framework == "jax":
        import jax
        import jax.numpy as jnp

        if is_host:
            return jnp.asarray(arr.view(logical) if arr.dtype != logical else arr)
        if logical == FP8_E4M3:
            return jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(arr.view(np.uint8)), jnp.float8_e4m3fn)
        return jax.dlpack.from_dlpack(arr)
    raise ValueError(f"unknown framework {framework!r}")


def to_host(obj, name: str = "array") -> np.ndarray:
    """Read any array to a host NumPy array (a device-to-host copy for CUDA memory).

    Used by eager planners, which read lengths once on the host by contract.
    Plain Python sequences and scalars are accepted too.
    """
    if obj is None:
        return None
    if isinstance(obj, np.ndarray):
        return obj
    if isinstance(obj, (list, tuple, int, np.integer)):
        return np.asarray(obj)
    arg = wrap(name, obj)
    if arg.is_cuda:
        out = arg.data.get()
        return out.view(arg.dtype) if out.dtype != arg.dtype else out
    return arg.data
