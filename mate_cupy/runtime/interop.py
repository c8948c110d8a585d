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
from typing import Optional

import ml_dtypes
import numpy as np

from . import dlpack as _dlpack

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


def as_dtype(dt, name: str = "dtype") -> np.dtype:
    """Normalise a dtype given as NumPy dtype, name, or torch/jax dtype object (``TypeError``
    naming the argument ``name`` for anything else, None included)."""
    if isinstance(dt, np.dtype):
        return dt
    if isinstance(dt, str) and dt in _DTYPE_NAMES:
        return _DTYPE_NAMES[dt]
    if dt is not None and not isinstance(dt, str):
        key = str(dt).replace("torch.", "").replace("jax.numpy.", "").replace("dtype(", "").strip("')\"")
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        try:
            return np.dtype(dt)
        except TypeError:
            pass
    raise TypeError(f"{name} must be a dtype (a NumPy, torch or JAX dtype, or one of "
                    f"{', '.join(sorted(_DTYPE_NAMES))}), got {dt!r}")


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


class Arg:
    """Backend-neutral view of one caller array, described without copying.

    ``shape``, ``dtype`` (logical: ``float8_e4m3fn`` stays fp8), ``device`` (-1 for host
    memory), ``ptr`` (address of element 0) and ``strides`` (in elements) are read once
    from the producer. ``data`` is the zero-copy backend array (NumPy on the host; CuPy on
    CUDA, fp8 viewed as ``uint8``), built on first use: launchers that take addresses and
    strides never build it.
    """

    __slots__ = ("name", "obj", "dtype", "framework", "device", "shape", "strides", "ptr", "_data", "_make")

    def __init__(self, name, obj, dtype, framework, device, shape, strides, ptr, data=None, make=None):
        self.name, self.obj, self.dtype, self.framework, self.device = name, obj, dtype, framework, device
        self.shape, self.strides, self.ptr, self._data, self._make = shape, strides, ptr, data, make

    @property
    def data(self):
        d = self._data
        if d is None:
            d = self._data = _cupy_view(self) if self._make is None else self._make()
        return d

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_cuda(self) -> bool:
        return self.device >= 0

    @property
    def size(self) -> int:
        n = 1
        for x in self.shape:
            n *= x
        return n

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def is_contiguous(self) -> bool:
        """C-contiguous (dimensions of extent 1 may have any stride; empty arrays are)."""
        if 0 in self.shape:
            return True
        acc = 1
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1 and s != acc:
                return False
            acc *= n
        return True

    def describe(self) -> str:
        where = "cpu" if self.device < 0 else f"cuda:{self.device}"
        return f"{self.name}: shape={self.shape}, dtype={dtype_name(self.dtype)}, device={where}"


_TORCH_RAW_STREAM: list = []


def _torch_stream_getter():
    """``device -> cudaStream_t`` of torch's current stream, chosen once per process.

    The public ``torch.cuda.current_stream(device).cuda_stream`` builds a Stream object per
    call (about 2.4 us on an H200 host, a tenth of a small decode step's host budget);
    ``torch._C._cuda_getCurrentRawStream`` returns the same handle in about 0.1 us. The
    private function is used only when it exists and agrees with the public API on the
    current device; otherwise the public API is.
    """
    import torch

    public = lambda device: int(torch.cuda.current_stream(device).cuda_stream)  # noqa: E731
    raw = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
    getter = public
    if callable(raw):
        try:
            dev = torch.cuda.current_device()
            if int(raw(dev)) == public(dev):
                getter = raw
        except Exception:  # noqa: BLE001 - any failure of the private API: keep the public one
            getter = public
    _TORCH_RAW_STREAM.append(getter)
    return getter


class _ExportedWhenRead(Arg):
    """A host result for a framework whose import copies (JAX): ``obj`` exports the
    filled array when read (ops read it once, to return it). ``_make`` holds the Call."""

    __slots__ = ()

    @property
    def obj(self):
        return self._make.export(self._data, dtype=self.dtype)

    @obj.setter
    def obj(self, value):  # set by Arg.__init__ (None); the result is the exported array
        pass


def _torch_stream_ptr(device: int) -> int:
    getter = _TORCH_RAW_STREAM[0] if _TORCH_RAW_STREAM else _torch_stream_getter()
    return int(getter(device))


def _cupy_stream_ptr() -> int:
    import cupy

    return int(cupy.cuda.get_current_stream().ptr)


def _numpy_arg(name: str, a: np.ndarray) -> Arg:
    item = a.dtype.itemsize
    return Arg(name, a, a.dtype, "numpy", -1, a.shape, tuple(s // item for s in a.strides),
               a.__array_interface__["data"][0] if a.size else 0, data=a)


_TORCH_TYPES: set = set()


def wrap(name: str, obj) -> Arg:
    """Wrap one array (NumPy, CuPy, torch, JAX, any DLPack producer) zero-copy."""
    if type(obj) in _TORCH_TYPES and obj.get_device() >= 0:
        return _wrap_torch_cuda(name, obj)  # raw addresses: no DLPack export, requires_grad does not matter
    fw = framework_of(obj)
    if fw == "numpy":
        if obj.dtype.kind == "V" and obj.dtype not in (BFLOAT16, FP8_E4M3):
            raise TypeError(f"{name}: unsupported NumPy dtype {obj.dtype}")
        return _numpy_arg(name, obj)
    if not hasattr(obj, "__dlpack__"):
        raise TypeError(
            f"{name} must be an array implementing DLPack (NumPy, CuPy, torch, JAX), "
            f"got {type(obj).__name__}"
        )
    if fw == "cupy":
        dt = obj.dtype
        item = dt.itemsize
        return Arg(name, obj, dt, fw, int(obj.device.id), obj.shape, tuple(s // item for s in obj.strides),
                   int(obj.data.ptr), data=obj)
    if fw == "torch":
        import torch

        if type(obj) in (torch.Tensor, torch.nn.Parameter):
            _TORCH_TYPES.add(type(obj))
        if obj.is_cuda:
            return _wrap_torch_cuda(name, obj)
        if obj.requires_grad:
            obj = obj.detach()  # DLPack refuses tensors that require grad; the memory is the same
    dev_type, dev_id = _dlpack.device_of(obj)
    if dev_type in _dlpack._HOST_DEVICE_TYPES:
        desc = _dlpack.describe(obj, stream=None)
        return _host_arg(name, obj, fw, desc)
    if dev_type not in _dlpack._CUDA_DEVICE_TYPES:
        raise ValueError(f"{name}: unsupported device type {dev_type} (expected CPU or CUDA)")
    # A CUDA producer other than torch and CuPy: its capsule is synchronised to CuPy's
    # current stream of that device, on which the call launches.
    import cupy

    with cupy.cuda.Device(dev_id):
        stream = _cupy_stream_ptr()
    desc = _dlpack.describe(obj, stream=stream)
    return Arg(name, obj, desc.dtype, fw, desc.device_id, desc.shape, desc.strides, desc.ptr,
               make=lambda: _dlpack.cupy_view(desc, obj))


def torch_cuda_addresses(arrays: tuple) -> Optional[tuple]:
    """``(metadata, addresses)`` of ``arrays`` when each is a torch CUDA tensor or None; None
    when any is something else (or a tensor type not yet seen by :func:`wrap`).

    ``metadata`` holds per array what :meth:`Call.signature` holds (device, dtype, shape,
    strides in elements, address modulo 16; None for None), read with one attribute pass
    per tensor; ``addresses`` the data addresses (0 for None). A key for memos of calls
    whose validation reads nothing else of the arrays. The strides of a C-contiguous
    tensor are held as ``True``: they are fixed by the shape up to dimensions of extent 1,
    whose strides no kernel multiplies by a non-zero index.
    """
    types = _TORCH_TYPES
    meta, ptrs = [], []
    add_meta, add_ptr = meta.append, ptrs.append
    for t in arrays:
        if t is None:
            add_meta(None)
            add_ptr(0)
        elif t.__class__ in types:
            p = t.data_ptr()
            add_meta((t.get_device(), t.dtype, t.shape, t.is_contiguous() or t.stride(), p & 15))
            add_ptr(p)
        else:
            return None
    return tuple(meta), tuple(ptrs)


def current_device() -> int:
    """CuPy's current CUDA device (``runtime.getDevice``)."""
    return (_GET_DEVICE[0] if _GET_DEVICE else _bind_get_device())()


def torch_stream_ptr(device: int) -> int:
    """torch's current stream of ``device`` (see :attr:`Call.stream_ptr`)."""
    return _torch_stream_ptr(device)


def _host_arg(name: str, obj, fw: str, desc) -> Arg:
    data = _dlpack.numpy_view(desc, obj)
    return Arg(name, obj, desc.dtype, fw, -1, desc.shape, desc.strides, desc.ptr, data=data)


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


def _wrap_torch_cuda(name: str, t) -> Arg:
    """torch CUDA tensors: the facts the DLPack capsule would give, read from the tensor's
    public attributes (a few microseconds instead of tens); the CuPy view is built lazily."""
    dtype = (_TORCH_DTYPES or _torch_dtype_map()).get(t.dtype)
    if dtype is None:
        raise TypeError(f"{name}: unsupported torch dtype {t.dtype}")
    return Arg(name, t, dtype, "torch", t.get_device(), tuple(t.shape), t.stride(), t.data_ptr())


def _cupy_view(arg: "Arg"):
    """The zero-copy CuPy view of a torch CUDA tensor's ``Arg`` (fp8 as uint8)."""
    import cupy as cp

    t, dtype, shape, strides, dev = arg.obj, arg.dtype, arg.shape, arg.strides, arg.device
    item = dtype.itemsize
    view_dtype = _U8 if dtype is FP8_E4M3 else dtype
    span = 0 if 0 in shape else (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * item
    mem = cp.cuda.UnownedMemory(t.data_ptr(), span or 1, t, dev)
    return cp.ndarray(shape, dtype=view_dtype, memptr=cp.cuda.MemoryPointer(mem, 0),
                      strides=tuple(s * item for s in strides))


_U8 = np.dtype(np.uint8)
_FROM_DTYPE: dict = {}


def _torch_from_dtype() -> dict:
    """NumPy/ml_dtypes dtype -> torch dtype."""
    if not _FROM_DTYPE:
        _FROM_DTYPE.update({v: k for k, v in _torch_dtype_map().items()})
    return _FROM_DTYPE


class _StreamHandle:
    """Minimal object implementing the CUDA stream protocol for CuPy."""

    def __init__(self, ptr: int):
        self._ptr = ptr

    def __cuda_stream__(self):
        return (0, self._ptr)


def external_stream(ptr: int):
    """A CuPy stream object wrapping a raw ``cudaStream_t`` (for CuPy work on a torch stream)."""
    import cupy

    if ptr == 0:
        return cupy.cuda.Stream.null
    return cupy.cuda.Stream.from_external(_StreamHandle(ptr))


_NO_SCOPE = contextlib.nullcontext()
_GET_DEVICE: list = []


def _bind_get_device():
    """CuPy's ``runtime.getDevice`` (bound on first use: importing mate_cupy imports no CuPy)."""
    if not _GET_DEVICE:
        from cupy.cuda import runtime

        _GET_DEVICE.append(runtime.getDevice)
    return _GET_DEVICE[0]


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
        self._stream_ptr = None
        #: ``(key, addresses)`` under which an op stores the launch it prepares from this
        #: call (set by validations that prepare launches; None otherwise).
        self.prepared = None
        for name, obj in arrays.items():
            if obj is not None:
                self.add(name, obj)

    def add(self, name: str, obj) -> Optional[Arg]:
        """Wrap one more array (or None) into the call; checks the device."""
        if obj is None:
            return None
        # torch CUDA tensors (the serving hot path) inline; everything else through wrap().
        # (Raw addresses need no DLPack export, so requires_grad does not matter here.)
        if type(obj) in _TORCH_TYPES:
            dev = obj.get_device()  # -1 on the host
            dtype = _TORCH_DTYPES.get(obj.dtype)
            if dev >= 0 and dtype is not None and (dev == self.device or self.device is None):
                if self.device is None:
                    self.device, self.framework, self._first = dev, "torch", name
                arg = self.args[name] = Arg(name, obj, dtype, "torch", dev, tuple(obj.shape), obj.stride(),
                                            obj.data_ptr())
                return arg
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
    def stream_ptr(self) -> int:
        """Address of the caller's current CUDA stream (torch's for torch inputs, else CuPy's)."""
        ptr = self._stream_ptr
        if ptr is None:
            if self.framework == "torch":
                ptr = _torch_stream_ptr(self.device)
            else:
                import cupy

                with cupy.cuda.Device(self.device):
                    ptr = _cupy_stream_ptr()
            self._stream_ptr = ptr
        return ptr

    def new(self, name: str, shape, dtype) -> Arg:
        """A new uninitialised result array on this call's device, in the caller's framework
        where it can allocate (torch: ``torch.empty``, so graph captures use torch's pool;
        otherwise CuPy's pool on the caller's stream; host: NumPy). ``Arg.obj`` is what the
        op returns."""
        dtype = as_dtype(dtype)
        shape = tuple(int(x) for x in shape)
        if self.is_cuda and self.framework == "torch":
            import torch

            inv = _torch_from_dtype()
            t = torch.empty(shape, dtype=inv[dtype], device=torch.device("cuda", self.device))
            return _wrap_torch_cuda(name, t)
        if self.is_cuda:
            data = self.empty(shape, dtype)
            arg = Arg(name, None, dtype, "cupy", self.device, shape,
                      tuple(s // data.itemsize for s in data.strides), int(data.data.ptr), data=data)
            arg.obj = self.export(data, dtype=dtype)
            return arg
        a = np.empty(shape, dtype=dtype)
        if self.framework == "jax":  # JAX copies host arrays: export once the op has written it
            item = a.dtype.itemsize
            return _ExportedWhenRead(name, None, dtype, "numpy", -1, shape, tuple(x // item for x in a.strides),
                                     a.__array_interface__["data"][0] if a.size else 0, data=a, make=self)
        arg = _numpy_arg(name, a)
        arg.obj = self.export(a, dtype=dtype)
        return arg

    @property
    def stream(self):
        """Caller's current stream as a CuPy stream (a context manager); host: no-op."""
        if not self.is_cuda:
            return contextlib.nullcontext()
        if self._stream is None:
            if self.framework == "torch":
                self._stream = external_stream(self.stream_ptr)
            else:
                import cupy

                with cupy.cuda.Device(self.device):
                    self._stream = cupy.cuda.get_current_stream()
        return self._stream

    def device_scope(self):
        """Context: CuPy's current device set to this call's device (no-op on host and when
        the device is current already)."""
        if not self.is_cuda or current_device() == self.device:
            return _NO_SCOPE
        import cupy

        return cupy.cuda.Device(self.device)

    def signature(self) -> tuple:
        """What validation reads of the arrays: per array its name, dtype, shape, strides
        and address modulo 16 (the largest alignment a kernel needs), and the device. Two
        calls with equal signatures and equal options validate to the same problem."""
        return (self.device,) + tuple((a.name, a.dtype, a.shape, a.strides, a.ptr & 15) for a in self.args.values())

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
