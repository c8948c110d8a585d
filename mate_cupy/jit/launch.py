"""Kernel launches through the CUDA driver with typed, packed parameters.

A :class:`KernelParams` is a kernel's parameter list, ``(("q", "ptr"), ("total_q", "i32"),
...)`` in declaration order (the CPU tests check each list against its ``.cu`` signature).
:func:`launch` packs one call's values into a C buffer with one ``struct`` call and hands
``cuLaunchKernel`` pointers into it: no per-argument conversion objects, no allocation on
the device, and nothing cached across calls beyond the per-thread packing buffer of each
parameter list. A programmatic launch (``programmatic=True``) goes through
``cuLaunchKernelEx`` with programmatic stream serialization allowed (sm_90+): the kernel may
be scheduled while the previous kernel on the stream finishes, and waits for it on the device.

Pointer values are integers (addresses), ``None`` (a null pointer), or any object with an
integer ``ptr`` attribute (:class:`mate_cupy.runtime.interop.Arg`); CuPy arrays are
accepted too (``.data.ptr``).
"""
from __future__ import annotations

import ctypes
import operator
import struct
import threading

from .tensor_map import MAP_BYTES, TensorMap

__all__ = ["KernelParams", "PreparedLaunch", "Source", "address", "launch"]

_FORMAT = {"ptr": "Q", "i32": "i", "u32": "I", "i64": "q", "f32": "f", "map": f"{MAP_BYTES}s"}
_SIZE = {"ptr": 8, "i32": 4, "u32": 4, "i64": 8, "f32": 4, "map": MAP_BYTES}


def address(x) -> int:
    """The device address a pointer parameter takes from ``x`` (0 for None)."""
    if x is None:
        return 0
    if isinstance(x, int):
        return x
    p = getattr(x, "ptr", None)
    if isinstance(p, int):
        return p
    return int(x.data.ptr)  # a CuPy array


class KernelParams:
    """The parameter list of one kernel: ``((name, kind), ...)``, kind in ptr/i32/u32/i64/f32/map
    (map: a 128-byte tensor map, the value a :class:`~mate_cupy.jit.tensor_map.TensorMap` or its
    encoded bytes)."""

    __slots__ = ("params", "names", "kinds", "_struct", "_offsets", "_ptr_pos", "_map_pos", "_tls")

    def __init__(self, params):
        self.params = tuple((str(n), str(k)) for n, k in params)
        self.names = tuple(n for n, _ in self.params)
        self.kinds = tuple(k for _, k in self.params)
        fmt, offsets, off = "<", [], 0
        for kind in self.kinds:
            size = _SIZE[kind]
            pad = -off % size
            fmt += "x" * pad
            off += pad
            offsets.append(off)
            fmt += _FORMAT[kind]
            off += size
        self._struct = struct.Struct(fmt)
        self._offsets = tuple(offsets)
        self._ptr_pos = tuple(i for i, k in enumerate(self.kinds) if k == "ptr")
        self._map_pos = tuple(i for i, k in enumerate(self.kinds) if k == "map")
        self._tls = threading.local()

    def __len__(self) -> int:
        return len(self.params)

    def _buffers(self):
        tls = self._tls
        bufs = getattr(tls, "bufs", None)
        if bufs is None:
            bufs = tls.bufs = self.new_buffers()
        return bufs

    def new_buffers(self) -> tuple:
        """A parameter buffer and its ``void**`` table: ``(buffer, table, table address)``."""
        data = ctypes.create_string_buffer(max(1, self._struct.size))
        base = ctypes.addressof(data)
        table = (ctypes.c_void_p * max(1, len(self._offsets)))(*[base + o for o in self._offsets])
        return data, table, ctypes.addressof(table)

    def pack(self, values) -> bytes:
        """The packed parameter bytes of ``values`` (in parameter order): for tests."""
        return self._struct.pack(*self._normalise(values))

    def _normalise(self, values) -> list:
        vals = list(values)
        if len(vals) != len(self.kinds):
            raise TypeError(f"kernel takes {len(self.kinds)} parameters ({', '.join(self.names)}), got {len(vals)}")
        for i in self._ptr_pos:
            v = vals[i]
            if not isinstance(v, int):
                vals[i] = address(v)
        for i in self._map_pos:
            if isinstance(vals[i], TensorMap):
                vals[i] = vals[i].encode()
        return vals

    def fill(self, values) -> int:
        """Pack ``values`` into this thread's buffer; returns the ``void**`` table address."""
        data, _, table_addr = self._buffers()
        try:  # the launchers pass plain integers and floats: pack them as they are
            self._struct.pack_into(data, 0, *values)
        except (struct.error, TypeError):  # arrays in pointer slots, maps to encode, or a wrong count
            self._struct.pack_into(data, 0, *self._normalise(values))
        return table_addr


_launch_kernel = None
_launch_kernel_programmatic = None

#: ``CUlaunchAttribute`` {id, padding to 8 bytes, the 64-byte value union}: the attribute
#: ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` (6) with the value 1.
_PROGRAMMATIC_ATTRIBUTE = struct.pack("<i4xi60x", 6, 1)
#: ``CUlaunchConfig`` {gridDim x/y/z, blockDim x/y/z, sharedMemBytes, hStream, attrs, numAttrs}.
_LAUNCH_CONFIG = struct.Struct("<7I4xQQI4x")


def _driver_launch():
    global _launch_kernel
    if _launch_kernel is None:
        from cupy.cuda import driver

        _launch_kernel = driver.launchKernel
    return _launch_kernel


def programmatic_launcher(launch_kernel_ex):
    """A function with ``cuLaunchKernel``'s arguments that launches through
    ``launch_kernel_ex`` (``cuLaunchKernelEx``) with programmatic stream serialization
    allowed: the kernel may start before the previous kernel on the stream has completed,
    and must wait for it (``griddepcontrol.wait``) before touching memory. One launch
    configuration per thread, packed at each launch."""
    tls = threading.local()

    def launch_programmatic(f, gx, gy, gz, bx, by, bz, smem, stream, table, extra):
        bufs = getattr(tls, "bufs", None)
        if bufs is None:
            attr = ctypes.create_string_buffer(_PROGRAMMATIC_ATTRIBUTE, len(_PROGRAMMATIC_ATTRIBUTE))
            cfg = ctypes.create_string_buffer(_LAUNCH_CONFIG.size)
            bufs = tls.bufs = (cfg, ctypes.addressof(cfg), attr, ctypes.addressof(attr))
        cfg, cfg_address, _, attr_address = bufs
        _LAUNCH_CONFIG.pack_into(cfg, 0, gx, gy, gz, bx, by, bz, smem, stream, attr_address, 1)
        rc = launch_kernel_ex(cfg_address, f, table, extra or None)
        if rc != 0:
            from cupy.cuda import driver

            raise driver.CUDADriverError(rc)

    return launch_programmatic


def _driver_launch_programmatic():
    global _launch_kernel_programmatic
    if _launch_kernel_programmatic is None:
        from ..runtime.device import _driver

        lib = _driver()
        if not lib:
            raise RuntimeError("programmatic launches need the CUDA driver (libcuda), which is not loaded")
        fn = lib.cuLaunchKernelEx
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _launch_kernel_programmatic = programmatic_launcher(fn)
    return _launch_kernel_programmatic


def _launcher(programmatic: bool):
    """The driver launch function: ``cuLaunchKernel``, or the programmatic ``cuLaunchKernelEx``
    (looked up at each launch, so a stand-in set on the module takes effect)."""
    if programmatic:
        return _launch_kernel_programmatic or _driver_launch_programmatic()
    return _launch_kernel or _driver_launch()


def launch(kernel, grid, block, params: KernelParams, values, *, shared_mem: int = 0, stream: int = 0,
           programmatic: bool = False) -> None:
    """Launch ``kernel`` (a :class:`mate_cupy.jit.compiler.Kernel`) on the stream address ``stream``.

    ``grid`` and ``block`` are 1-3 integers; ``values`` follow ``params``. Dynamic shared
    memory above 48 KiB is opted into once per kernel and size. ``programmatic``: a
    programmatic dependent launch (sm_90+), for kernels that call ``grid_dependency_sync``
    (``cuda_src/common/grid_dependency.cuh``) before their first global memory access.
    """
    launch_kernel = _launcher(programmatic)
    if shared_mem > 48 * 1024:
        kernel.reserve_shared_memory(shared_mem)
    g = tuple(grid) + (1, 1)
    b = tuple(block) + (1, 1)
    table = params.fill(values)
    launch_kernel(kernel.ptr, g[0], g[1], g[2], b[0], b[1], b[2], int(shared_mem), int(stream), table, 0)


class Source:
    """A pointer argument taken from a call's array: position ``index`` in the tuple of
    addresses the call passes to :meth:`PreparedLaunch.run`. ``ptr`` is the marker itself, so
    a launcher that reads ``arg.ptr`` of its operands puts the marker in the slot."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = int(index)

    @property
    def ptr(self) -> "Source":
        return self

    def __repr__(self) -> str:
        return f"Source({self.index})"


class PreparedLaunch:
    """One kernel launch with every argument fixed but the addresses of a call's arrays.

    ``values`` follow ``params``; a :class:`Source` in a pointer slot stands for
    ``addresses[source.index]`` of each :meth:`run`, and a tensor map on a source's address is
    encoded again when a run's address differs from the one it holds; every other value is
    fixed. Each thread
    that runs the launch holds its own parameter buffer with the fixed values packed once;
    a run packs only the span of parameters from the first to the last source (one C-level
    pick from ``addresses + fixed values`` and one ``struct`` call) and calls
    ``cuLaunchKernel`` (``cuLaunchKernelEx`` when ``programmatic``): the launch :func:`launch`
    makes with the same values, without recomputing anything from the call.
    """

    __slots__ = ("kernel", "grid", "block", "params", "shared_mem", "programmatic", "n_addresses", "_fixed",
                 "_pick", "_span", "_span_offset", "_span_pick", "_maps", "_tls")

    def __init__(self, kernel, grid, block, params: KernelParams, values, *, shared_mem: int = 0, n_addresses: int,
                 programmatic: bool = False):
        values = tuple(values)
        if len(values) != len(params.kinds):
            raise TypeError(f"kernel takes {len(params.kinds)} parameters, got {len(values)}")
        self.kernel, self.params, self.shared_mem = kernel, params, int(shared_mem)
        self.programmatic = bool(programmatic)
        self.grid = (tuple(int(x) for x in grid) + (1, 1))[:3]
        self.block = (tuple(int(x) for x in block) + (1, 1))[:3]
        self.n_addresses = n = int(n_addresses)
        fixed, picks, sourced, maps = [], [], [], []
        for i, v in enumerate(values):
            kind = params.kinds[i]
            if v.__class__ is Source:
                if kind != "ptr" or not 0 <= v.index < n:
                    raise ValueError(f"parameter {params.names[i]}: a source must fill a pointer slot in [0, {n})")
                fixed.append(0)
                picks.append(v.index)
                sourced.append(i)
            elif kind == "map" and isinstance(v, TensorMap):
                if v.address.__class__ is Source:  # encoded at each run with the call's address
                    if not 0 <= v.address.index < n:
                        raise ValueError(f"parameter {params.names[i]}: a map's source must be in [0, {n})")
                    maps.append((i, v))
                    fixed.append(bytes(MAP_BYTES))
                else:
                    fixed.append(v.encode())
                picks.append(n + i)
            else:
                fixed.append(address(v) if kind == "ptr" else v)
                picks.append(n + i)
        self._fixed = tuple(fixed)
        params._struct.pack(*self._fixed)  # every fixed value packs (refused here, not at a launch)
        self._pick = _itemgetter(picks)
        # The packed span [first source, last source]: its layout from the parameter offsets.
        lo, hi = (sourced[0], sourced[-1]) if sourced else (0, -1)
        fmt, end = "<", params._offsets[lo] if sourced else 0
        for i in range(lo, hi + 1):
            fmt += "x" * (params._offsets[i] - end) + _FORMAT[params.kinds[i]]
            end = params._offsets[i] + _SIZE[params.kinds[i]]
        self._span, self._span_offset = struct.Struct(fmt), (params._offsets[lo] if sourced else 0)
        self._span_pick = _itemgetter(picks[lo:hi + 1]) if sourced else (lambda t: ())
        # Maps on a call's address: (parameter, map, offset, inside the packed span)
        self._maps = tuple((i, m, params._offsets[i], lo <= i <= hi) for i, m in maps)
        self._tls = threading.local()
        if self.shared_mem > 48 * 1024:
            kernel.reserve_shared_memory(self.shared_mem)

    def values(self, addresses: tuple) -> tuple:
        """The kernel arguments of a call with ``addresses`` (``n_addresses`` integers)."""
        vals = self._pick(addresses + self._fixed)
        if self._maps:
            vals = list(vals)
            for i, m, _, _ in self._maps:
                vals[i] = m.encode(addresses[m.address.index])
            vals = tuple(vals)
        return vals

    def _buffers(self):
        """This thread's ``(buffer, table, table address)`` with the fixed values packed."""
        bufs = self._tls.bufs = self.params.new_buffers()
        self.params._struct.pack_into(bufs[0], 0, *self._fixed)
        self._tls.map_addresses = [None] * len(self._maps)  # the address each map slot holds
        return bufs

    def run(self, addresses: tuple, stream: int) -> None:
        """Launch on the stream address ``stream`` with the call's ``addresses``."""
        bufs = getattr(self._tls, "bufs", None) or self._buffers()
        self._span.pack_into(bufs[0], self._span_offset, *self._span_pick(addresses + self._fixed))
        if self._maps:
            held, base = self._tls.map_addresses, ctypes.addressof(bufs[0])
            for j, (_, m, offset, inside) in enumerate(self._maps):
                a = addresses[m.address.index]
                if inside or held[j] != a:
                    m.encode_into(base + offset, a)
                    held[j] = a
        g, b = self.grid, self.block
        _launcher(self.programmatic)(self.kernel.ptr, g[0], g[1], g[2], b[0], b[1], b[2], self.shared_mem, stream,
                                     bufs[2], 0)


def _itemgetter(picks):
    """``t -> tuple(t[i] for i in picks)`` as one C-level call (a tuple for one pick too)."""
    return operator.itemgetter(*picks) if len(picks) > 1 else (lambda t, i=picks[0]: (t[i],))
