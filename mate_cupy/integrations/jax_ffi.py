"""Every public op under ``jax.jit``, through XLA's typed FFI (``jax.ffi``).

Each op is one FFI target, ``mate_cupy_<op>``, registered for the platforms ``"CUDA"`` and
``"cpu"``. The handler is a Python ``ctypes`` callback: it reads XLA's call frame
(``xla/ffi/api/c_api.h``: buffers, attributes, the stream), exposes each buffer as a
DLPack array, and runs the public mate_cupy function on it with the results' buffers as
its ``out=`` arguments:

* CUDA: the kernels launch on XLA's stream (CuPy's current stream is set to it for the
  call), on the device XLA runs the computation on;
* cpu: the buffers are host memory, and the float64 references run and store into them.

A call's static parameters (flags, scales, sizes, plan handles) and its operands' and
results' names, dtypes and shapes form one JSON string attribute, its description; device
metadata (lengths, page tables, slots) are operands; a CUDA execution whose description,
device and buffer alignment repeat runs the launches prepared by the first one
(:data:`PREPARED_CALLS`: KDA decode steps, one-part MSA calls with the output given); the
KDA decode state pool updated in place is an operand aliased to a result
(``input_output_aliases``). MSA plans are passed as integer
handles into a registry of weak references: a plan stays usable by a compiled function
for as long as the caller keeps the plan alive (``docs/frameworks.md``, JAX).

Importing this module imports JAX and registers the targets; ``import mate_cupy`` does
neither.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import operator
import struct
import threading
import weakref
from typing import Callable, Optional

try:
    import jax
    import jax.ffi
except ImportError as exc:  # pragma: no cover - exercised only without JAX
    raise ImportError(
        "mate_cupy.integrations.jax_ffi needs JAX: pip install jax (CPU) or 'jax[cuda13]' (GPU)"
    ) from exc

import numpy as np

from .. import kda_interface, msa_interface, util_ops
from ..kda.chunk import chunk_kda_workspace_bytes
from ..msa import execute as _execute
from ..msa.ops import NoOutputRequestedError, _pure_plan
from ..msa.plan import MsaPlan, MsaRuntimeMetadata, max_k_tiles, selected_block_count, unpack_plan_info
from ..runtime import dlpack as _dl
from ..kda import decode as _kda_decode
from ..kda import decode_launch as _kda_decode_launch
from ..runtime.interop import (BFLOAT16, FLOAT32, FP8_E4M3, INT32, as_dtype, current_device, external_stream,
                               wrap)
from ..runtime.memo import BoundedMemo

__all__ = [
    "XlaBuffer",
    "cast",
    "chunk_kda",
    "gated_delta_rule_decode",
    "msa",
    "sparse_attention_pipeline",
    "sparse_decode_atten_func",
    "sparse_msa",
    "sparse_topk_select",
    "target_name",
]

# ----------------------------------------------------------------------------- XLA FFI C API (c_api.h)

_EXTENSION_METADATA = 1
_STAGE_EXECUTE = 3
_ERR_INVALID_ARGUMENT = 3
_ERR_UNIMPLEMENTED = 12
_ERR_INTERNAL = 13
_ATTR_STRING = 4
# The API version a handler reports in the metadata handshake (the oldest typed-FFI
# version whose call frame carries everything this handler reads).
_HANDLER_API_VERSION = (0, 1)


class _ExtensionBase(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int), ("next", ctypes.c_void_p)]


class _ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("major_version", ctypes.c_int), ("minor_version", ctypes.c_int)]


class _Metadata(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", _ApiVersion), ("traits", ctypes.c_uint32)]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("extension_base", _ExtensionBase), ("metadata", ctypes.POINTER(_Metadata))]


class _Buffer(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p), ("dtype", ctypes.c_int),
                ("data", ctypes.c_void_p), ("rank", ctypes.c_int64), ("dims", ctypes.POINTER(ctypes.c_int64))]


class _BufferList(ctypes.Structure):
    """``XLA_FFI_Args`` and ``XLA_FFI_Rets`` (same layout; every entry is a buffer here)."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p), ("size", ctypes.c_int64),
                ("types", ctypes.POINTER(ctypes.c_int)), ("items", ctypes.POINTER(ctypes.POINTER(_Buffer)))]


class _ByteSpan(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Attrs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p), ("size", ctypes.c_int64),
                ("types", ctypes.POINTER(ctypes.c_int)), ("names", ctypes.POINTER(ctypes.POINTER(_ByteSpan))),
                ("attrs", ctypes.POINTER(ctypes.c_void_p))]


class _Api(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("api_version", _ApiVersion), ("internal_api", ctypes.c_void_p)] + [
        (name, ctypes.c_void_p) for name in (
            "error_create", "error_get_message", "error_destroy", "handler_register", "stream_get",
            "type_register", "execution_context_get", "state_set", "state_get", "device_memory_allocate",
            "device_memory_free", "thread_pool_schedule", "thread_pool_num_threads", "future_create",
            "future_set_available", "future_set_error", "run_id_get", "device_ordinal_get")]


class _CallFrame(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.POINTER(_ExtensionBase)),
                ("api", ctypes.POINTER(_Api)), ("ctx", ctypes.c_void_p), ("stage", ctypes.c_int),
                ("args", _BufferList), ("rets", _BufferList), ("attrs", _Attrs), ("future", ctypes.c_void_p)]


class _ErrorCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("message", ctypes.c_char_p), ("errc", ctypes.c_int)]


class _StreamGetArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p), ("ctx", ctypes.c_void_p),
                ("stream", ctypes.c_void_p)]


class _DeviceOrdinalGetArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p), ("ctx", ctypes.c_void_p),
                ("device_ordinal", ctypes.c_int32)]


_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)  # (XLA_FFI_CallFrame*)
_ERROR_CREATE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_ErrorCreateArgs))
_STREAM_GET = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_StreamGetArgs))
_DEVICE_ORDINAL_GET = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_DeviceOrdinalGetArgs))

# XLA_FFI_DataType -> (DLPack type code, bits)
_DL_TYPES = {
    1: (6, 8), 2: (0, 8), 3: (0, 16), 4: (0, 32), 5: (0, 64), 6: (1, 8), 7: (1, 16), 8: (1, 32), 9: (1, 64),
    10: (2, 16), 11: (2, 32), 12: (2, 64), 16: (4, 16), 20: (10, 8),
}
# XLA_FFI_DataType -> the NumPy dtype name of the arrays it holds
_DTYPE_NAMES = {1: "bool", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "uint8", 7: "uint16", 8: "uint32",
                9: "uint64", 10: "float16", 11: "float32", 12: "float64", 16: "bfloat16", 20: "float8_e4m3fn"}
# The call frame as raw fields (little-endian x86-64/aarch64 layout of _CallFrame): struct_size,
# extension_start, api, ctx, stage; args (struct_size, extension_start, size, types, items);
# rets (same); attrs (struct_size, extension_start, size, types, names, attrs); future.
_FRAME = struct.Struct("<QQQQi4x" + "QQqQQ" * 2 + "QQqQQQ" + "Q")
_F_EXT, _F_API, _F_CTX, _F_STAGE = 1, 2, 3, 4
_F_ARGS, _F_ARG_ITEMS, _F_RETS, _F_RET_ITEMS = 7, 9, 12, 14
_F_ATTRS, _F_ATTR_TYPES, _F_ATTR_VALUES = 17, 18, 20
assert _FRAME.size == ctypes.sizeof(_CallFrame)
_SPAN = struct.Struct("<QQ")
_BUFFER_DATA = _Buffer.data.offset
_U64 = ctypes.c_uint64.from_address
_I32 = ctypes.c_int32.from_address
#: The one attribute of every call: the JSON of its static description (:func:`_spec`).
SPEC_ATTRIBUTE = "mate_cupy_call"


def _spec_bytes(head: tuple) -> bytes:
    """The bytes of the call's one string attribute (its static description)."""
    if head[_F_ATTRS] != 1 or _I32(head[_F_ATTR_TYPES]).value != _ATTR_STRING:
        raise TypeError(f"expected one string attribute {SPEC_ATTRIBUTE!r} (a call staged by this module)")
    ptr, size = _SPAN.unpack(ctypes.string_at(_U64(head[_F_ATTR_VALUES]).value, _SPAN.size))
    return ctypes.string_at(ptr, size)


def _addresses(count: int, items: int) -> tuple:
    """The data addresses of ``count`` buffers (the ``items`` array of an args/rets list)."""
    if not count:
        return ()
    return tuple(_U64(b + _BUFFER_DATA).value for b in struct.unpack(f"<{count}Q", ctypes.string_at(items, 8 * count)))


# A private prototype: ``ctypes.pythonapi.PyCapsule_New`` is shared, and others set its argtypes.
_CAPSULE_NEW = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
_CAPSULE_NAME = b"dltensor"


class XlaBuffer:
    """One XLA buffer as a DLPack producer (row-major, no copy), valid during the handler call.

    ``__dlpack__`` returns a capsule over a ``DLManagedTensor`` this object owns; consumers
    that only read the capsule (mate_cupy's reader) leave it unconsumed.
    """

    __slots__ = ("_tensor", "_dims", "_device")

    def __init__(self, buf: _Buffer, device: tuple) -> None:
        code_bits = _DL_TYPES.get(buf.dtype)
        if code_bits is None:
            raise TypeError(f"unsupported XLA buffer dtype {buf.dtype}")
        rank = int(buf.rank)
        self._dims = (ctypes.c_int64 * max(rank, 1))(*(buf.dims[i] for i in range(rank)))
        self._device = device
        t = _dl._DLManagedTensor()
        t.dl_tensor.data = buf.data
        t.dl_tensor.device.device_type, t.dl_tensor.device.device_id = device
        t.dl_tensor.ndim = rank
        t.dl_tensor.dtype.code, t.dl_tensor.dtype.bits, t.dl_tensor.dtype.lanes = code_bits[0], code_bits[1], 1
        t.dl_tensor.shape = self._dims
        self._tensor = t

    def __dlpack_device__(self) -> tuple:
        return self._device

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        del stream, max_version, dl_device, copy
        return _CAPSULE_NEW(ctypes.addressof(self._tensor), _CAPSULE_NAME, None)


def _buffers(count: int, items: int, declared: list, device: tuple, what: str) -> dict:
    """The ``count`` buffers of an args/rets list as :class:`XlaBuffer` by name, each checked
    against its declared ``[name, dtype, shape]`` (what the call was staged with)."""
    if count != len(declared):
        raise ValueError(f"expected {len(declared)} {what} ({', '.join(d[0] for d in declared)}), XLA passed {count}")
    ptrs = struct.unpack(f"<{count}Q", ctypes.string_at(items, 8 * count)) if count else ()
    out = {}
    for (name, dtype, shape), ptr in zip(declared, ptrs):
        buf = _Buffer.from_address(ptr)
        dims = [buf.dims[i] for i in range(buf.rank)]
        if _DTYPE_NAMES.get(buf.dtype) != dtype or dims != shape:
            raise ValueError(f"{what[:-1]} {name}: XLA passed a {_DTYPE_NAMES.get(buf.dtype, buf.dtype)} {dims} "
                             f"buffer for the declared {dtype} {shape}")
        out[name] = XlaBuffer(buf, device)
    return out


def _stream(api: int, ctx: int) -> int:
    args = _StreamGetArgs(ctypes.sizeof(_StreamGetArgs), None, ctx, None)
    _check(_STREAM_GET(_U64(api + _Api.stream_get.offset).value)(ctypes.byref(args)), "XLA_FFI_Stream_Get")
    return int(args.stream or 0)


def _device_ordinal(api: int, ctx: int) -> int:
    if _U64(api).value < _Api.device_ordinal_get.offset + ctypes.sizeof(ctypes.c_void_p):
        raise RuntimeError("this XLA's FFI API has no XLA_FFI_DeviceOrdinal_Get; JAX >= 0.5 is needed")
    args = _DeviceOrdinalGetArgs(ctypes.sizeof(_DeviceOrdinalGetArgs), None, ctx, 0)
    fn = _DEVICE_ORDINAL_GET(_U64(api + _Api.device_ordinal_get.offset).value)
    _check(fn(ctypes.byref(args)), "XLA_FFI_DeviceOrdinal_Get")
    return int(args.device_ordinal)


def _check(error, what: str) -> None:
    if error:  # an XLA_FFI_Error*: hand it back to XLA unchanged
        raise _XlaError(error, what)


class _XlaError(Exception):
    """An error XLA's API returned, passed back to XLA as it is."""

    def __init__(self, error: int, what: str) -> None:
        super().__init__(f"{what} failed")
        self.error = error


def _error(api: int, op: str, exc: BaseException) -> int:
    if isinstance(exc, _XlaError):
        return exc.error
    if isinstance(exc, NotImplementedError):
        code = _ERR_UNIMPLEMENTED
    elif isinstance(exc, (ValueError, TypeError, KeyError)):
        code = _ERR_INVALID_ARGUMENT
    else:
        code = _ERR_INTERNAL
    message = f"mate_cupy.{op}: {type(exc).__name__}: {exc}".encode()
    args = _ErrorCreateArgs(ctypes.sizeof(_ErrorCreateArgs), None, message, code)
    return _ERROR_CREATE(_U64(api + _Api.error_create.offset).value)(ctypes.byref(args))


# ----------------------------------------------------------------------------- targets

_LOCK = threading.Lock()  # XLA may call handlers from several threads; plans cache per-call state
_Runner = Callable[[dict, dict, dict, bool], None]
_CALLBACKS: list = []  # the ctypes callbacks must outlive every compiled use
#: Prepared launches of CUDA calls (:class:`PreparedFfiCall`), by op, the call's static
#: description, device and the addresses' alignment; False for keys whose calls take the
#: validated path every time. At most 256 entries, the oldest dropped first.
PREPARED_CALLS = BoundedMemo(256)


def target_name(op: str) -> str:
    """The FFI target name of ``op`` (``"mate_cupy_msa"``, ...)."""
    return f"mate_cupy_{op}"


class PreparedFfiCall:
    """The launch of a validated CUDA call, for later executions with the same key: the
    :class:`~mate_cupy.jit.PreparedLaunch` (None when there is nothing to launch) and the
    pick of its addresses from the call's ``operand addresses + result addresses + (0,)``."""

    __slots__ = ("launch", "pick")

    def __init__(self, launch, positions: tuple):
        self.launch = launch
        self.pick = operator.itemgetter(*positions)

    def run(self, addresses: tuple, stream: int) -> bool:
        """Launch on ``stream``; True (always ready)."""
        if self.launch is not None:
            self.launch.run(self.pick(addresses), stream)
        return True


class PreparedPlanCall:
    """A validated CUDA MSA call's launches, held by its plan (``MsaPlan.prepared_calls``, under
    ``token``: freed with the plan, dropped when the plan re-uploads or grows its workspace);
    this entry holds a weak reference to the plan and the pick of the launches' addresses
    (``msa.execute`` order) from ``operand addresses + result addresses + (0,)``."""

    __slots__ = ("plan", "token", "pick")

    def __init__(self, plan, token, positions: tuple):
        self.plan, self.token = weakref.ref(plan), token
        self.pick = operator.itemgetter(*positions)

    def run(self, addresses: tuple, stream: int) -> bool:
        """Launch on ``stream`` when the plan still holds the launches and the state they use;
        False otherwise (nothing launched: the call is prepared again)."""
        plan = self.plan()
        entry = None if plan is None else plan.prepared_calls.get(self.token)
        if not entry or not entry.ready(plan):
            return False
        picked = self.pick(addresses)
        for launch in entry.launches:
            launch.run(picked, stream)
        return True


_THREAD = threading.local()  # the device whose context this thread made current (``_on_device``)


def _set_device(ordinal: int) -> None:
    from cupy.cuda import runtime

    runtime.setDevice(ordinal)


def _on_device(ordinal: int) -> bool:
    """Whether ``ordinal`` is this thread's current CUDA device, so that a prepared launch
    (``cuLaunchKernel`` on the current context) can run; the first time on a thread its
    primary context is made current (``cudaSetDevice``), as the validated path does."""
    if current_device() != ordinal:
        return False
    if getattr(_THREAD, "device", None) != ordinal:
        _set_device(ordinal)
        _THREAD.device = ordinal
    return True


def _cuda_scope(ordinal: int, stream: int):
    """The CUDA device ``ordinal`` and CuPy's current stream set to XLA's ``stream``."""
    import cupy

    scope = contextlib.ExitStack()
    scope.enter_context(cupy.cuda.Device(ordinal))
    scope.enter_context(external_stream(stream))
    return scope


def _handle(op: str, runner: _Runner, preparer, cuda: bool, frame: int) -> Optional[int]:
    head = _FRAME.unpack(ctypes.string_at(frame, _FRAME.size))
    if head[_F_EXT]:
        ext = _ExtensionBase.from_address(head[_F_EXT])
        if ext.type == _EXTENSION_METADATA:  # registration-time handshake
            md = _MetadataExtension.from_address(head[_F_EXT]).metadata.contents
            md.api_version.major_version, md.api_version.minor_version = _HANDLER_API_VERSION
            md.traits = 0  # not command-buffer compatible: the handler runs at every execution
            return None
    if head[_F_STAGE] != _STAGE_EXECUTE:
        return None
    try:
        spec = _spec_bytes(head)
        with _LOCK:
            if not cuda:
                operands, results, attrs = _decode_spec(spec)
                device = (_dl.KDL_CPU, 0)
                runner(_buffers(head[_F_ARGS], head[_F_ARG_ITEMS], operands, device, "operands"),
                       _buffers(head[_F_RETS], head[_F_RET_ITEMS], results, device, "results"), attrs, False)
                return None
            api, ctx = head[_F_API], head[_F_CTX]
            ordinal, stream = _device_ordinal(api, ctx), _stream(api, ctx)
            addresses = (_addresses(head[_F_ARGS], head[_F_ARG_ITEMS])
                         + _addresses(head[_F_RETS], head[_F_RET_ITEMS]) + (0,))
            key = entry = None
            if preparer is not None:
                key = (op, spec, ordinal, tuple([a & 15 for a in addresses]))
                entry = PREPARED_CALLS.get(key)
                # a prepared call: addresses and stream only
                if entry and _on_device(ordinal) and entry.run(addresses, stream):
                    return None
            operands, results, attrs = _decode_spec(spec)
            device = (_dl.KDL_CUDA, ordinal)
            args = _buffers(head[_F_ARGS], head[_F_ARG_ITEMS], operands, device, "operands")
            rets = _buffers(head[_F_RETS], head[_F_RET_ITEMS], results, device, "results")
            with _cuda_scope(ordinal, stream):
                if key is not None and entry is not False:  # validates (raises before anything is stored)
                    entry = preparer(args, rets, attrs, [n for n, _, _ in operands] + [n for n, _, _ in results])
                    PREPARED_CALLS.put(key, entry if entry is not None else False)
                if not (entry and entry.run(addresses, stream)):
                    runner(args, rets, attrs, True)
        return None
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to XLA as an error
        return _error(head[_F_API], op, exc)


def _register(op: str, runner: _Runner, preparer=None) -> None:
    for platform, cuda in (("cpu", False), ("CUDA", True)):
        callback = _HANDLER(lambda frame, c=cuda: _handle(op, runner, preparer, c, frame))
        _CALLBACKS.append(callback)
        capsule = jax.ffi.pycapsule(ctypes.cast(callback, ctypes.c_void_p).value)
        jax.ffi.register_ffi_target(target_name(op), capsule, platform=platform)


def _attr(value):
    """A static parameter as it is stored in the call's description: bools and integers as
    ints, strings as they are, everything else as a float (its exact ``repr``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        return int(value)
    return float(value)


def _spec(operands: list, results: list, attrs: dict) -> str:
    """The static description of a call (the one attribute :data:`SPEC_ATTRIBUTE`): JSON of
    ``[[name, dtype, shape], ...]`` of the operands and of the results, and the attributes
    (name -> int, float or str). Equal descriptions mean equal buffers' shapes and dtypes
    and equal options, so it keys the prepared calls."""
    return json.dumps({"operands": operands, "results": results, "attrs": attrs}, sort_keys=True,
                      separators=(",", ":"), allow_nan=True)


_SPECS = BoundedMemo(256)  # spec bytes -> decoded (operands, results, attrs); read only


def _decode_spec(spec: bytes) -> tuple:
    """``(operands, results, attrs)`` of a call's description (a fresh ``attrs`` dict)."""
    decoded = _SPECS.get(spec)
    if decoded is None:
        d = json.loads(spec)
        decoded = ([tuple(x) for x in d["operands"]], [tuple(x) for x in d["results"]], d["attrs"])
        _SPECS.put(spec, decoded)
    return decoded[0], decoded[1], dict(decoded[2])


def _call(op: str, operands: dict, results: list, attrs: dict, aliases: Optional[dict] = None) -> list:
    """Stage one ``ffi_call`` of ``op``: ``operands`` name -> array or None (left out),
    ``results`` ``[(name, shape, dtype)]``, ``attrs`` name -> value (None left out),
    ``aliases`` operand name -> result name. Returns the results in order."""
    names = [n for n, x in operands.items() if x is not None]
    out_names = [r[0] for r in results]
    io = {names.index(i): out_names.index(o) for i, o in (aliases or {}).items()}
    fn = jax.ffi.ffi_call(target_name(op), [jax.ShapeDtypeStruct(tuple(s), np.dtype(d)) for _, s, d in results],
                          input_output_aliases=io or None, vmap_method="sequential")
    spec = _spec([[n, np.dtype(operands[n].dtype).name, [int(x) for x in operands[n].shape]] for n in names],
                 [[n, np.dtype(d).name, [int(x) for x in s]] for n, s, d in results],
                 {k: _attr(v) for k, v in attrs.items() if v is not None})
    return list(fn(*(operands[n] for n in names), **{SPEC_ATTRIBUTE: spec}))


def _flag(attrs: dict, name: str) -> Optional[bool]:
    value = attrs.get(name)
    return None if value is None else bool(value)


def _copy_result(dst: XlaBuffer, src, cuda: bool) -> None:
    """Store a new array the op returned into XLA's result buffer (same shape and dtype)."""
    d, s = wrap("result", dst), wrap("result", src)
    if not cuda:
        d.data[...] = s.data
        return
    import cupy

    c = cupy.ascontiguousarray(s.data)
    cupy.cuda.runtime.memcpyAsync(d.ptr, c.data.ptr, d.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice,
                                  cupy.cuda.get_current_stream().ptr)


# ----------------------------------------------------------------------------- cast and top-k


def _run_cast(args: dict, rets: dict, attrs: dict, cuda: bool) -> None:
    util_ops.cast(args["x"], attrs["dtype"], attrs["scale"], out=rets["out"])


def cast(x, dtype, scale: float = 1.0):
    """:func:`mate_cupy.cast` under ``jax.jit``: ``dtype(x * scale)`` of the same shape.

    ``x``: float32/float16/bfloat16/float8_e4m3fn; ``dtype`` one of those (name, NumPy or
    JAX dtype). Returns a new JAX array.
    """
    dst = as_dtype(dtype)
    return _call("cast", {"x": x}, [("out", x.shape, dst)], {"dtype": dst.name, "scale": float(scale)})[0]


def _run_topk(args: dict, rets: dict, attrs: dict, cuda: bool) -> None:
    msa_interface.sparse_topk_select(
        args["max_score"], attrs["topk"], attrs.get("num_valid_pages"), output=rets["output"],
        force_begin_blocks=attrs["force_begin_blocks"], force_end_blocks=attrs["force_end_blocks"],
        force_blocks_count_in_topk=bool(attrs["force_blocks_count_in_topk"]),
        query_positions=args.get("query_positions"))


def sparse_topk_select(max_score, topk: int, num_valid_pages: Optional[int] = None, force_begin_blocks: int = 0,
                       force_end_blocks: int = 0, force_blocks_count_in_topk: bool = True, query_positions=None):
    """:func:`mate_cupy.sparse_topk_select` under ``jax.jit``.

    ``max_score [total_q, Hq, NT]`` float32; ``query_positions`` int64 ``[total_q]`` or None
    (int64 arrays need ``jax_enable_x64``). Returns int32 ``[total_q, Hq, W]``.
    """
    if len(max_score.shape) != 3:
        raise ValueError(f"max_score must have shape [total_q, num_qo_heads, max_k_tiles], got {max_score.shape}")
    width = selected_block_count(int(topk), int(force_begin_blocks), int(force_end_blocks),
                                 bool(force_blocks_count_in_topk))
    return _call("sparse_topk_select", {"max_score": max_score, "query_positions": query_positions},
                 [("output", (*max_score.shape[:2], width), INT32)],
                 {"topk": int(topk), "num_valid_pages": num_valid_pages, "force_begin_blocks": force_begin_blocks,
                  "force_end_blocks": force_end_blocks, "force_blocks_count_in_topk": force_blocks_count_in_topk})[0]


# ----------------------------------------------------------------------------- MSA plans

_PLAN_HANDLES: "weakref.WeakKeyDictionary[MsaPlan, int]" = weakref.WeakKeyDictionary()
_PLANS: "weakref.WeakValueDictionary[int, MsaPlan]" = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count(1)
_MD_FIELDS = ("qo_lens", "kv_lens", "qo_offset", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table",
              "kv_page_indptr")


def _plan_handle(plan: MsaPlan) -> int:
    """The registry handle of ``plan`` (one per plan object, never reused)."""
    with _LOCK:
        handle = _PLAN_HANDLES.get(plan)
        if handle is None:
            handle = next(_NEXT_HANDLE)
            _PLAN_HANDLES[plan] = handle
            _PLANS[handle] = plan
        return handle


def _plan_attrs(info: tuple) -> dict:
    mixed, split, batch, first, second = info
    return {"plan_mixed": bool(mixed), "plan_split": int(split), "plan_batch": int(batch),
            "plan": _plan_handle(first), "plan_prefill": _plan_handle(second) if second is not None else 0}


def _lookup_plan(handle: int) -> MsaPlan:
    plan = _PLANS.get(handle)
    if plan is None:
        raise ValueError(f"MSA plan handle {handle} refers to a plan that has been freed: keep the plan object "
                         "alive for as long as a function compiled with it runs")
    return plan


def _plan_info(attrs: dict) -> tuple:
    second = attrs["plan_prefill"]
    return (bool(attrs["plan_mixed"]), attrs["plan_split"], attrs["plan_batch"], _lookup_plan(attrs["plan"]),
            _lookup_plan(second) if second else None)


def _static_offset(q_offset_override) -> bool:
    """None or an int (an attribute); anything else is a ``[B]`` operand."""
    return q_offset_override is None or (isinstance(q_offset_override, (int, np.integer))
                                         and not isinstance(q_offset_override, bool))


def _msa_operands(q, k, v, kv_indices, kv_block_indexes, q_offset_override, page_table, runtime_metadata) -> dict:
    ops = {"q": q, "k": k, "v": v, "kv_indices": kv_indices, "kv_block_indexes": kv_block_indexes,
           "page_table": page_table,
           "q_offset_override": None if _static_offset(q_offset_override) else q_offset_override}
    if runtime_metadata is not None:
        if not isinstance(runtime_metadata, MsaRuntimeMetadata):
            raise TypeError(f"runtime_metadata must be a MsaRuntimeMetadata, got {type(runtime_metadata).__name__}")
        ops.update({f"md_{f}": getattr(runtime_metadata, f) for f in _MD_FIELDS})
    return ops


def _msa_results(info: tuple, q, output_o: bool, output_maxscore: bool, want_lse: bool) -> list:
    if len(q.shape) != 3:
        raise ValueError(f"q must have shape [total_q, Hq, D], got {q.shape}")
    total_q, hq = q.shape[:2]
    res = []
    if output_o:
        res.append(("out", q.shape, BFLOAT16 if np.dtype(q.dtype) == FP8_E4M3 else q.dtype))
        if want_lse:
            res.append(("lse", (total_q, hq), FLOAT32))
    if output_maxscore:
        nt = max(max_k_tiles(p) for p in info[3:] if p is not None)
        res.append(("max_score", (total_q, hq, nt), FLOAT32))
    return res


def _msa_attrs(fn: str, info: tuple, q_offset_override, sm_scale, k_scale, v_scale, output_o: bool,
               output_maxscore: bool) -> dict:
    return {"fn": fn, **_plan_attrs(info), "sm_scale": sm_scale, "k_scale": float(k_scale),
            "v_scale": float(v_scale), "output_o": bool(output_o), "output_maxscore": bool(output_maxscore),
            "q_offset": q_offset_override if _static_offset(q_offset_override) else None}


def _run_msa(args: dict, rets: dict, attrs: dict, cuda: bool) -> None:
    md = None
    if "md_qo_lens" in args:
        md = MsaRuntimeMetadata(**{f: args.get(f"md_{f}") for f in _MD_FIELDS})
    offset = args.get("q_offset_override", attrs.get("q_offset"))
    common = dict(out=rets.get("out"), lse=rets.get("lse"), max_score=rets.get("max_score"),
                  sm_scale=attrs.get("sm_scale"), k_scale=attrs["k_scale"], v_scale=attrs["v_scale"],
                  runtime_metadata=md, output_o=bool(attrs["output_o"]),
                  output_maxscore=bool(attrs["output_maxscore"]), kv_block_indexes=args.get("kv_block_indexes"),
                  q_offset_override=offset, kv_indices=args.get("kv_indices"))
    info, fn = _plan_info(attrs), attrs["fn"]
    q, k, v = args["q"], args["k"], args["v"]
    if fn == "msa":
        msa_interface.msa(q, k, v, info, page_table=args.get("page_table"), **common)
    elif fn == "sparse_msa":
        msa_interface.sparse_msa(q, k, v, info, **common)
    else:
        msa_interface.sparse_decode_atten_func(q, k, v, info, page_table=args.get("page_table"),
                                               return_softmax_lse="lse" in rets, **common)


def _prepare_msa(args: dict, rets: dict, attrs: dict, names: list) -> Optional[PreparedPlanCall]:
    """The prepared launches of a CUDA MSA call that ``msa.execute.run`` would prepare for
    torch tensors (one plan part, the output given, no max score, no ``q_offset_override``),
    validated as the public function validates them (``msa.execute.validate``, the launches
    of ``msa.execute.prepare_call``), held by the plan; else None."""
    info, fn = _plan_info(attrs), attrs["fn"]
    if (info[0] or not attrs["output_o"] or attrs["output_maxscore"] or "q_offset_override" in args
            or attrs.get("q_offset") is not None):
        return None
    if fn != "msa":
        info = _pure_plan(fn, info, "sparse_prefill" if fn == "sparse_msa" else "sparse_decode")
    md = None
    if "md_qo_lens" in args:
        md = MsaRuntimeMetadata(**{f: args.get(f"md_{f}") for f in _MD_FIELDS})
    want_lse = fn == "sparse_decode_atten_func" and "lse" in rets
    prob, ops = _execute.validate(
        fn, info, args["q"], args["k"], args["v"], args.get("kv_indices"), args.get("kv_block_indexes"), None,
        rets["out"], rets.get("lse"), None, None if fn == "sparse_msa" else args.get("page_table"),
        attrs.get("sm_scale"), attrs["k_scale"], attrs["v_scale"], md, True, False, want_lse, False, None)
    if not prob.is_cuda:
        return None
    entry = _execute.prepare_call(prob, ops, md)
    if entry is None:
        return None
    plan, token = info[3], object()
    plan.prepared_calls.put(token, entry)
    where: dict = {}
    for i, n in enumerate(names):
        where.setdefault(n, i)
    zero = len(names)
    order = _execute._CALL_ARRAYS + (tuple(f"md_{f}" for f in _execute._METADATA) if md is not None else ())
    return PreparedPlanCall(plan, token, tuple(where.get(n, zero) for n in order))


def msa(q, k, v, plan_info, kv_indices=None, kv_block_indexes=None, q_offset_override=None, *,
        sm_scale: Optional[float] = None, k_scale: float = 1.0, v_scale: float = 1.0, runtime_metadata=None,
        page_table=None, output_o: bool = True, output_maxscore: Optional[bool] = None, return_lse: bool = False):
    """:func:`mate_cupy.msa` under ``jax.jit``.

    Arrays as in :func:`mate_cupy.msa` (``q [total_q, Hq, D]``, dense or paged k/v, int32
    ``kv_indices``/``page_table``/``kv_block_indexes``); ``plan_info`` an eager or static
    plan (uploaded to the GPU for CUDA arrays), held by handle; ``runtime_metadata`` a
    :class:`~mate_cupy.MsaRuntimeMetadata` of JAX arrays; ``q_offset_override`` an int
    (an attribute) or ``[B]`` int32 array (an operand). Returns ``(out, max_score)``
    (``out [total_q, Hq, D]`` in q's dtype, bfloat16 for fp8, or None with
    ``output_o=False``; ``max_score [total_q, Hq, ceil(max_seqlen_k / 128)]`` float32 or
    None), plus ``lse [total_q, Hq]`` float32 last with ``return_lse=True``.
    """
    info = unpack_plan_info(plan_info)
    ms = info[3].output_maxscore if output_maxscore is None else bool(output_maxscore)
    if not output_o and not ms:
        raise NoOutputRequestedError("msa requires output_o=True or output_maxscore=True")
    res = _call("msa", _msa_operands(q, k, v, kv_indices, kv_block_indexes, q_offset_override, page_table,
                                     runtime_metadata),
                _msa_results(info, q, output_o, ms, return_lse),
                _msa_attrs("msa", info, q_offset_override, sm_scale, k_scale, v_scale, output_o, ms))
    out = res.pop(0) if output_o else None
    lse = res.pop(0) if output_o and return_lse else None
    max_score = res.pop(0) if ms else None
    return (out, max_score, lse) if return_lse else (out, max_score)


def sparse_msa(q, k, v, plan_info, *, sm_scale: Optional[float] = None, k_scale: float = 1.0, v_scale: float = 1.0,
               runtime_metadata=None, kv_indices=None, output_maxscore: bool = False, output_o: bool = True,
               kv_block_indexes=None, q_offset_override=None, return_lse: bool = False):
    """:func:`mate_cupy.sparse_msa` under ``jax.jit`` (a ``sparse_prefill`` plan).

    Arrays and options as in :func:`msa`; ``kv_block_indexes [total_q, Hkv or Hq, W]``
    int32 is required unless ``output_o=False``. Returns ``(out, max_score)``, plus ``lse``
    last with ``return_lse=True``.
    """
    info = unpack_plan_info(plan_info)
    if not output_o and not output_maxscore:
        raise NoOutputRequestedError("sparse_msa requires output_o=True or output_maxscore=True")
    if output_o and kv_block_indexes is None:
        raise ValueError("sparse_msa requires kv_block_indexes")
    res = _call("sparse_msa", _msa_operands(q, k, v, kv_indices, kv_block_indexes, q_offset_override, None,
                                            runtime_metadata),
                _msa_results(info, q, output_o, output_maxscore, return_lse),
                _msa_attrs("sparse_msa", info, q_offset_override, sm_scale, k_scale, v_scale, output_o,
                           output_maxscore))
    out = res.pop(0) if output_o else None
    lse = res.pop(0) if output_o and return_lse else None
    max_score = res.pop(0) if output_maxscore else None
    return (out, max_score, lse) if return_lse else (out, max_score)


def sparse_decode_atten_func(q, k, v, plan_info, *, sm_scale: Optional[float] = None, k_scale: float = 1.0,
                             v_scale: float = 1.0, runtime_metadata=None, kv_indices=None, page_table=None,
                             kv_block_indexes=None, q_offset_override=None, output_maxscore: bool = False,
                             output_o: bool = True, return_softmax_lse: bool = False):
    """:func:`mate_cupy.sparse_decode_atten_func` under ``jax.jit`` (a ``sparse_decode`` plan).

    Arrays and options as in :func:`msa`. Returns what the eager function returns:
    ``out``; ``(out, lse)`` with ``return_softmax_lse``; the max score appended when
    ``output_maxscore``.
    """
    info = unpack_plan_info(plan_info)
    if not output_o and not output_maxscore:
        raise NoOutputRequestedError("sparse_decode_atten_func requires output_o=True or output_maxscore=True")
    res = _call("sparse_decode_atten_func",
                _msa_operands(q, k, v, kv_indices, kv_block_indexes, q_offset_override, page_table,
                              runtime_metadata),
                _msa_results(info, q, output_o, output_maxscore, return_softmax_lse),
                _msa_attrs("sparse_decode_atten_func", info, q_offset_override, sm_scale, k_scale, v_scale,
                           output_o, output_maxscore))
    out = res.pop(0) if output_o else None
    lse = res.pop(0) if output_o and return_softmax_lse else None
    if not return_softmax_lse and not output_maxscore:
        return out
    result = (out, lse) if return_softmax_lse else (out,)
    return result + (res.pop(0),) if output_maxscore else result


# ----------------------------------------------------------------------------- KDA


def _run_chunk(args: dict, rets: dict, attrs: dict, cuda: bool) -> None:
    kda_interface.chunk_kda(
        args["q"], args["k"], args["v"], args["g"], args["beta"], scale=attrs.get("scale"),
        initial_state=args.get("initial_state"), output_final_state="final_state" in rets,
        cu_seqlens=args.get("cu_seqlens"), A_log=args.get("A_log"), dt_bias=args.get("dt_bias"),
        lower_bound=attrs["lower_bound"], use_qk_l2norm_in_kernel=bool(attrs["use_qk_l2norm_in_kernel"]),
        output=rets["output"], final_state=rets.get("final_state"), workspace=rets["workspace"] if cuda else None)


def chunk_kda(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None, output_final_state: bool = False,
              cu_seqlens=None, A_log=None, dt_bias=None, lower_bound: float = -5.0,  # noqa: N803
              use_qk_l2norm_in_kernel: bool = True, final_state_dtype=None):
    """:func:`mate_cupy.chunk_kda` under ``jax.jit``.

    Shapes and dtypes as in :func:`mate_cupy.chunk_kda` (q, k ``[B, T, H, 128]`` or varlen
    ``[S, H, 128]``/``[1, S, H, 128]`` with ``cu_seqlens [N+1]``). ``final_state_dtype``:
    float32 or q's dtype (default ``initial_state``'s, else q's). The kernels' scratch is
    an extra XLA result (``chunk_kda_workspace_bytes`` bytes) dropped on return. Returns
    ``output`` (v's shape, q's dtype) or ``(output, final_state [N, HV, 128, 128])``.
    """
    if len(q.shape) not in (3, 4) or len(v.shape) not in (3, 4):
        raise ValueError(f"q and v must have shape [B, T, H, 128] or [S, H, 128], got q {q.shape}, v {v.shape}")
    hv = int(v.shape[-2])
    if cu_seqlens is not None:
        n = int(cu_seqlens.shape[0]) - 1
        ws = chunk_kda_workspace_bytes(1, int(q.shape[-3]), hv, max(n, 0))
    else:
        n = int(q.shape[0])
        ws = chunk_kda_workspace_bytes(n, int(q.shape[1]), hv)
    results = [("output", v.shape, q.dtype), ("workspace", (max(ws, 1),), np.uint8)]
    if output_final_state:
        sdt = as_dtype(final_state_dtype) if final_state_dtype is not None else np.dtype(
            (initial_state if initial_state is not None else q).dtype)
        results.append(("final_state", (n, hv, 128, 128), sdt))
    res = _call("chunk_kda", {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state,
                              "cu_seqlens": cu_seqlens, "A_log": A_log, "dt_bias": dt_bias}, results,
                {"scale": scale, "lower_bound": float(lower_bound),
                 "use_qk_l2norm_in_kernel": bool(use_qk_l2norm_in_kernel)})
    return (res[0], res[2]) if output_final_state else res[0]


_DECODE_FLAGS = ("use_qk_l2norm", "use_gate_in_kernel", "use_lower_bound", "apply_beta_sigmoid", "allow_neg_eigval",
                 "use_initial_state", "state_v_first", "is_varlen")


def _decode_arguments(args: dict, rets: dict, attrs: dict) -> dict:
    """The public function's arguments of a decode call (buffers and attributes)."""
    return dict(q=args["q"], k=args["k"], v=args["v"], state=args.get("state"), A_log=args.get("A_log"), a=args["a"],
                dt_bias=args.get("dt_bias"), num_accepted_tokens=args.get("num_accepted_tokens"),
                cu_seqlens=args.get("cu_seqlens"), b=args["b"], state_indices=args.get("state_indices"),
                scale=attrs.get("scale"), output=rets["output"], lower_bound=attrs.get("lower_bound"),
                store_final_state="final_state" in rets, inplace_final_state="state" in rets,
                state_dtype=attrs.get("state_dtype"), **{f: _flag(attrs, f) for f in _DECODE_FLAGS})


def _run_decode(args: dict, rets: dict, attrs: dict, cuda: bool) -> None:
    # in place: the "state" result is aliased to the state operand (the same buffer)
    _, final = kda_interface.gated_delta_rule_decode(**_decode_arguments(args, rets, attrs))
    if "final_state" in rets:
        _copy_result(rets["final_state"], final, cuda)


def _prepare_decode(args: dict, rets: dict, attrs: dict, names: list) -> Optional[PreparedFfiCall]:
    """The prepared launch of a CUDA decode call that allocates nothing (the validation and
    launch of the public function: ``kda.decode.validate``, ``decode_launch.prepared_launch``),
    else None. ``names``: the operands' then the results' names, in address order."""
    call, problem = _kda_decode.validate(**_decode_arguments(args, rets, attrs))
    if problem.device < 0 or not _kda_decode_launch.preparable(call, problem):
        return None
    zero = len(names)  # the (0,) after the call's addresses: arrays the call does not have
    where: dict = {}
    for i, n in enumerate(names):
        where.setdefault(n, i)  # the state operand, not the result aliased to it (the same buffer)
    positions = tuple(where[n] if n in call.args else zero for n in _kda_decode_launch.PREPARED_ARRAYS)
    return PreparedFfiCall(_kda_decode_launch.prepared_launch(problem, call.args), positions)


def gated_delta_rule_decode(q, k, v, state, A_log, a, dt_bias, num_accepted_tokens, cu_seqlens, b,  # noqa: N803
                            state_indices=None, scale: Optional[float] = None, use_qk_l2norm: Optional[bool] = None,
                            lower_bound: Optional[float] = None, use_gate_in_kernel: Optional[bool] = None,
                            use_lower_bound: Optional[bool] = None, apply_beta_sigmoid: Optional[bool] = None,
                            allow_neg_eigval: Optional[bool] = None, use_initial_state: Optional[bool] = None,
                            state_v_first: Optional[bool] = None, is_varlen: Optional[bool] = None,
                            store_final_state: bool = False, inplace_final_state: bool = False, state_dtype=None,
                            output_dtype=None):
    """:func:`mate_cupy.gated_delta_rule_decode` under ``jax.jit``.

    Arrays and options as in :func:`mate_cupy.gated_delta_rule_decode` (q, k ``[B, T, H,
    128]``, v ``[B, T, HV, V]``, state pool ``[P, HV, V, K]`` or K-first; slots, offsets and
    accepted counts as operands). ``output_dtype``: float16/bfloat16/float32 (default q's).
    With ``inplace_final_state`` the pool is an operand aliased to a result: the call
    returns the updated pool as a new JAX array over the same buffer when the caller
    donates ``state`` (``jax.jit(..., donate_argnums=...)``; otherwise XLA copies it first).

    Returns ``(output [B, T, HV, V], final_state)``: the updated pool when in place, a new
    ``[N, HV, V, K]`` (K-first ``[N, HV, K, V]``) state with ``store_final_state``, else None.
    """
    if len(q.shape) != 4 or len(v.shape) != 4:
        raise ValueError(f"q and v must have shape [B, T, H, D], got q {q.shape}, v {v.shape}")
    results = [("output", v.shape, as_dtype(output_dtype) if output_dtype is not None else q.dtype)]
    aliases = {}
    if inplace_final_state:
        if state is None:
            raise ValueError("gated_delta_rule_decode with inplace_final_state=True requires a state pool")
        results.append(("state", state.shape, state.dtype))
        aliases["state"] = "state"
    elif store_final_state:
        varlen = cu_seqlens is not None if is_varlen is None else bool(is_varlen)
        if varlen and cu_seqlens is None:
            raise ValueError("gated_delta_rule_decode with is_varlen=True requires cu_seqlens")
        n = int(cu_seqlens.shape[0]) - 1 if varlen else int(q.shape[0])
        hv, vd, kd = int(v.shape[2]), int(v.shape[3]), int(q.shape[3])
        tail = (hv, vd, kd) if state_v_first is None or state_v_first else (hv, kd, vd)
        sdt = as_dtype(state_dtype) if state_dtype is not None else (
            np.dtype(state.dtype) if state is not None else FLOAT32)
        results.append(("final_state", (n, *tail), sdt))
    attrs = {"scale": scale, "lower_bound": lower_bound,
             "state_dtype": None if state_dtype is None else as_dtype(state_dtype).name,
             **{f: val for f, val in zip(_DECODE_FLAGS, (use_qk_l2norm, use_gate_in_kernel, use_lower_bound,
                                                            apply_beta_sigmoid, allow_neg_eigval, use_initial_state,
                                                            state_v_first, is_varlen))}}
    res = _call("gated_delta_rule_decode",
                {"q": q, "k": k, "v": v, "state": state, "A_log": A_log, "a": a, "dt_bias": dt_bias,
                 "num_accepted_tokens": num_accepted_tokens, "cu_seqlens": cu_seqlens, "b": b,
                 "state_indices": state_indices}, results, attrs, aliases)
    return res[0], (res[1] if len(res) > 1 else None)


for _op, _runner in (("cast", _run_cast), ("sparse_topk_select", _run_topk), ("msa", _run_msa),
                     ("sparse_msa", _run_msa), ("sparse_decode_atten_func", _run_msa), ("chunk_kda", _run_chunk),
                     ("gated_delta_rule_decode", _run_decode)):
    _register(_op, _runner, _prepare_decode if _op == "gated_delta_rule_decode" else _prepare_msa
              if _op in ("msa", "sparse_msa", "sparse_decode_atten_func") else None)


def sparse_attention_pipeline(q, k, v, index_q, index_k, plan, *, kv_indices, sm_scale: Optional[float] = None,
                              k_scale: float = 1.0, v_scale: float = 1.0, index_scale: float = 1.0,
                              return_lse: bool = False):
    """:func:`mate_cupy.sparse_attention_pipeline` under ``jax.jit``, for eager pipeline plans.

    The passes are staged with this module's ops, window by window of the plan: the index
    branch's block maxima (:func:`msa` with ``output_o=False``), the top-k selection with
    the plan's query positions (int64: needs ``jax_enable_x64``), then :func:`msa` over the
    selection. The plan's buffers are not used: XLA allocates the intermediates. Returns
    ``out`` (``(out, lse)`` with ``return_lse``). Static pipeline plans are a ``ValueError``
    (their positions come from device metadata; compose the passes with ``msa`` and
    ``sparse_topk_select`` instead).
    """
    import jax.numpy as jnp

    from ..msa.pipeline import SparsePipelinePlan
    from ..msa.topk import plan_query_positions

    if not isinstance(plan, SparsePipelinePlan):
        raise TypeError(f"plan must be a SparsePipelinePlan (sparse_pipeline_plan), got {type(plan).__name__}")
    if plan.is_static:
        raise ValueError("jax_ffi.sparse_attention_pipeline takes eager pipeline plans (sparse_pipeline_plan)")
    if not jax.config.jax_enable_x64:
        raise TypeError("jax_ffi.sparse_attention_pipeline needs jax_enable_x64: the selection's query positions "
                        "are int64")
    positions = plan_query_positions(plan.attention)  # host int64, as the plan's own buffer holds
    parts = []
    for w in plan.windows:
        if w.row_end == w.row_begin:
            continue
        _, scores = msa(index_q[w.row_begin:w.row_end], index_k, index_k, w.plan, kv_indices=kv_indices,
                        k_scale=index_scale, output_o=False, output_maxscore=True)
        parts.append(sparse_topk_select(scores, plan.topk, force_begin_blocks=plan.force_begin_blocks,
                                        force_end_blocks=plan.force_end_blocks,
                                        force_blocks_count_in_topk=plan.force_blocks_count_in_topk,
                                        query_positions=jnp.asarray(positions[w.row_begin:w.row_end])))
    selection = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
    res = msa(q, k, v, plan.attention, kv_indices=kv_indices, kv_block_indexes=selection, sm_scale=sm_scale,
              k_scale=k_scale, v_scale=v_scale, output_maxscore=False, return_lse=return_lse)
    return (res[0], res[-1]) if return_lse else res[0]
