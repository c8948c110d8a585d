"""Replayed launches: the steady-state host path of the public CUDA ops.

A public op's first CUDA call with a given *signature* runs the full path (every
argument check, the array wrapping, the launches) while a :class:`Recorder` notes each
kernel launch and where each of its pointers came from: an array argument of the call,
an array the op allocated for its result, or a persistent buffer (an eager plan's
device vectors, the split-KV workspace). The resulting :class:`Recipe` is cached under
the signature. A later call with the same signature skips the checks and the wrapping:
it reads the arrays' addresses, allocates the result arrays the op would allocate, and
replays the launches with the new addresses on the caller's current stream.

Signature: the op's plain options (None/bool/int/float/str/dtype values; any other
object disables replay for that call) and, per array argument, its dtype, shape,
strides, device and address modulo 16. Every check of the full path reads only these
(on the CUDA path no check reads device memory), so a signature that passed once passes
again; a call that raised is never recorded. Calls that stage data (copies of
non-contiguous inputs, casts, index conversions, derived vectors) are never recorded:
their launches take arrays that are neither arguments, results nor persistent buffers,
which the recorder refuses. Paths that do device work outside the recorded launches
call :func:`refuse`.

Only torch CUDA tensors and CuPy arrays are described; NumPy (host reference path), JAX
and other DLPack producers always take the full path.

Controls: ``MATE_CUPY_LAUNCH_CACHE=0`` disables replay (read at import);
:func:`set_enabled` and :func:`clear` at run time. A launcher knob that is not part of
a signature (a module constant or an environment variable read at launch time) is
frozen into the recipes recorded before it changed: call :func:`clear` after changing one.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from . import _interop
from .jit import launch as _jit_launch

__all__ = ["ENABLED", "MAX_ENTRIES", "Recipe", "Recorder", "clear", "launch", "note_alloc", "note_arg",
           "note_const", "plain", "recording", "refuse", "replay", "set_enabled", "signature", "store"]

ENABLED = os.environ.get("MATE_CUPY_LAUNCH_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")
MAX_ENTRIES = 512  # per op; a full cache is emptied (shapes of one model are few)

_CACHES: list = []  # every op's recipe dict, for clear()


def new_cache() -> dict:
    """A recipe dict for one op, emptied by :func:`clear`."""
    d: dict = {}
    _CACHES.append(d)
    return d


def clear() -> None:
    """Forget every recorded recipe (the next call of each signature runs the full path)."""
    for d in _CACHES:
        d.clear()


def set_enabled(flag: bool) -> None:
    """Turn replay on or off for this process (off also clears the recipes)."""
    global ENABLED
    ENABLED = bool(flag)
    if not ENABLED:
        clear()


# ----------------------------------------------------------------------------- signatures

_PLAIN = {type(None), bool, int, float, str, bytes}


def plain(values: tuple) -> bool:
    """True when every option value is immutable and compares by value (usable in a key)."""
    if _PLAIN.issuperset(map(type, values)):
        return True
    for v in values:
        t = type(v)
        if t in _PLAIN:
            continue
        if isinstance(v, (np.dtype, np.generic, type)) or t.__module__ == "torch" and t.__name__ == "dtype":
            _PLAIN.add(t)  # dtype objects, NumPy scalars and classes (np.float32) are immutable
            continue
        return False
    return True


_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_ENCODE = getattr(os.environ, "encodekey", None)


def env_keys(*names: str) -> tuple:
    """Keys for :func:`env_state` (environment variables a launcher reads at launch time)."""
    if _ENV_DATA is not None and _ENV_ENCODE is not None:
        return tuple(_ENV_ENCODE(n) for n in names)
    return names


def env_state(keys: tuple) -> tuple:
    """Current values of the environment variables ``keys`` (from :func:`env_keys`), for a key."""
    if _ENV_DATA is not None and _ENV_ENCODE is not None:
        return tuple(map(_ENV_DATA.get, keys))
    return tuple(map(os.environ.get, keys))


# Array kinds by exact type: 1 torch tensor, 2 CuPy array, 0 anything else.
_KIND: dict = {type(None): 0}


def _classify(tp) -> int:
    kind = 0
    mod = tp.__module__.split(".")[0]
    if mod == "torch":
        import torch

        if tp in (torch.Tensor, torch.nn.Parameter):
            kind = 1
    elif mod == "cupy":
        import cupy

        if tp is cupy.ndarray:
            kind = 2
    _KIND[tp] = kind
    return kind


def register_tensor_type(tp, kind: int) -> None:
    """Describe arrays of exact type ``tp`` as torch (1) or CuPy (2) arrays (test doubles)."""
    _KIND[tp] = int(kind)


def signature(arrays: tuple):
    """``(key, ptrs)`` of the array arguments of one call, or ``(None, None)``.

    ``key`` holds one description per argument (None for None): torch ``(dtype, shape,
    stride, device, address % 16)``, CuPy ``(dtype, shape, strides, device id, address %
    16)``; ``ptrs`` the addresses (0 for None). ``(None, None)`` when an argument is
    neither a torch tensor nor a CuPy array (the full path handles it).
    """
    key = []
    ptrs = []
    kinds = _KIND
    try:
        for x in arrays:
            if x is None:
                key.append(None)
                ptrs.append(0)
                continue
            tp = type(x)
            kind = kinds.get(tp)
            if kind is None:
                kind = _classify(tp)
            if kind == 1:
                p = x.data_ptr()
                key.append((x.dtype, x.shape, x.stride(), x.device, p & 15))
            elif kind == 2:
                mem = x.data
                p = mem.ptr
                key.append((x.dtype, x.shape, x.strides, mem.device_id, p & 15))
            else:
                return None, None
            ptrs.append(p)
    except Exception:  # sparse/meta tensors and the like: the full path reports them
        return None, None
    return tuple(key), ptrs


# ----------------------------------------------------------------------------- recording

_tls = threading.local()


class Recorder:
    """What one full-path call launched, and where each launch pointer came from.

    ``names`` are the call's array arguments in signature order; pointer slot ``i`` is
    ``names[i]``, slots after them are the arrays the op allocated (in allocation order).
    """

    __slots__ = ("names", "slots", "consts", "allocs", "launches", "ok", "keep")

    def __init__(self, names: tuple):
        self.names = names
        self.slots: dict = {}  # id(backend array) -> argument slot
        self.consts: dict = {}  # id(backend array) -> persistent array
        self.allocs: list = []  # (name, backend array)
        self.launches: list = []
        self.ok = True
        self.keep: list = []  # everything whose id() is used, alive until the recipe is built

    def arg(self, name: str, data) -> None:
        """``data`` (the backend view of argument ``name``) is launched as that argument."""
        if data is None:
            return
        if name not in self.names:
            self.ok = False  # not an argument of the signature: its address could not be refilled
            return
        slot = self.names.index(name)
        prev = self.slots.get(id(data))
        if prev is not None and prev != slot:
            self.ok = False  # one object stands for two arguments: slots would be ambiguous
        self.slots[id(data)] = slot
        self.keep.append(data)

    def alloc(self, name: str, data) -> None:
        """``data`` was allocated by the op (a result, or per-call scratch)."""
        self.allocs.append((name, data))
        self.keep.append(data)

    def const(self, data) -> None:
        """``data`` outlives the recipe (plan device vectors, cached workspaces)."""
        if data is not None:
            self.consts[id(data)] = data

    def launched(self, kernel, grid, block, args, shared_mem: int) -> None:
        self.launches.append((kernel, tuple(grid), tuple(block), tuple(args), int(shared_mem)))

    def recipe(self, device: int, torch_result: bool, keep: tuple = ()):
        """The :class:`Recipe` of this call, or None when it cannot be replayed."""
        if not self.ok:
            return None
        import cupy
        from cupy._core._scalar import CScalar
        from cupy.cuda.function import CIntptr, CPointer

        n = len(self.names)
        alloc_slot = {id(a): n + j for j, (_, a) in enumerate(self.allocs)}
        allocs = []
        for name, a in self.allocs:
            if not isinstance(a, cupy.ndarray) or not a.flags.c_contiguous:
                return None
            allocs.append((name, tuple(a.shape), np.dtype(a.dtype)))
        launches = []
        for kernel, grid, block, args, smem in self.launches:
            tmpl, fills = [], []
            for pos, a in enumerate(args):
                if isinstance(a, cupy.ndarray):
                    slot = self.slots.get(id(a))
                    if slot is None:
                        slot = alloc_slot.get(id(a))
                    if slot is not None:
                        fills.append((pos, slot))
                        tmpl.append(None)
                    elif id(a) in self.consts:
                        tmpl.append(CIntptr(a.data.ptr))
                    else:
                        return None  # a staged copy or scratch the recorder was not told about
                elif a is None:
                    tmpl.append(CIntptr(0))
                elif isinstance(a, CPointer):
                    tmpl.append(a)
                elif isinstance(a, (np.generic, bool, int, float)):
                    tmpl.append(CScalar(a))  # what CuPy makes of it at every launch
                else:
                    return None
            launches.append((kernel, grid, block, tuple(tmpl), tuple(fills), smem))
        consts = tuple(self.consts.values())
        return Recipe(tuple(launches), tuple(allocs), int(device), bool(torch_result), consts + tuple(keep))


class recording:
    """``with recording(rec):`` makes ``rec`` this thread's recorder (None: no recording)."""

    __slots__ = ("rec", "prev")

    def __init__(self, rec):
        self.rec = rec

    def __enter__(self):
        self.prev = getattr(_tls, "rec", None)
        _tls.rec = self.rec
        return self.rec

    def __exit__(self, *exc):
        _tls.rec = self.prev
        return False


def _current():
    return getattr(_tls, "rec", None)


def note_arg(name: str, data) -> None:
    """Tell the active recorder (if any) that ``data`` is argument ``name``'s backend view."""
    rec = getattr(_tls, "rec", None)
    if rec is not None:
        rec.arg(name, data)


def note_alloc(name: str, data) -> None:
    """Tell the active recorder that the op allocated ``data`` (re-allocated at replay)."""
    rec = getattr(_tls, "rec", None)
    if rec is not None:
        rec.alloc(name, data)


def note_const(*arrays) -> None:
    """Tell the active recorder that ``arrays`` outlive any recipe (their addresses are kept)."""
    rec = getattr(_tls, "rec", None)
    if rec is not None:
        for a in arrays:
            rec.const(a)


def refuse() -> None:
    """The current call did device work outside the recorded launches: do not replay it."""
    rec = getattr(_tls, "rec", None)
    if rec is not None:
        rec.ok = False


def launch(kernel, grid, block, args, *, shared_mem: int = 0, stream=None) -> None:
    """:func:`mate_cupy.jit.launch`, noted by the active recorder (launchers use this)."""
    _jit_launch(kernel, grid, block, args, shared_mem=shared_mem, stream=stream)
    rec = getattr(_tls, "rec", None)
    if rec is not None:
        rec.launched(kernel, grid, block, args, shared_mem)


def store(cache: dict, key, rec: Recorder, call, keep: tuple = ()) -> None:
    """Cache the recipe of a finished full-path call (CUDA calls that can be replayed only)."""
    if rec is None or not call.is_cuda or call.framework not in ("torch", "cupy"):
        return
    recipe = rec.recipe(call.device, call.framework == "torch", keep)
    if recipe is None:
        return
    if len(cache) >= MAX_ENTRIES:
        cache.clear()
    cache[key] = recipe


# ----------------------------------------------------------------------------- replay


class Recipe:
    """Launches of one signature: ``(kernel, grid, block, template, fills, smem)`` each.

    ``template`` holds the kernel parameters that do not change (CuPy ``CScalar`` /
    ``CIntptr`` objects) and None where ``fills`` puts ``(position, pointer slot)``.
    ``allocs``: ``(name, shape, dtype)`` of the arrays the op allocates per call.
    """

    __slots__ = ("launches", "allocs", "device", "torch", "keep")

    def __init__(self, launches, allocs, device, torch, keep):
        self.launches, self.allocs, self.device, self.torch, self.keep = launches, allocs, device, torch, keep


_CIntptr = None
_TORCH_DTYPES: dict = {}
_get_device = None
_raw_stream = None


def _current_device() -> int:
    global _get_device
    if _get_device is None:
        from cupy.cuda import runtime

        _get_device = runtime.getDevice
    return _get_device()


def _torch_stream(device: int):
    """torch's current stream on ``device`` as a CuPy stream (what ``Call.stream`` gives)."""
    global _raw_stream
    if _raw_stream is None:
        import torch

        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _interop._torch_stream_ptr
    return _interop.external_stream(int(_raw_stream(device)))


def _alloc(first, torch_result: bool, shape: tuple, dtype):
    """A new C-contiguous result array in the first argument's framework: ``(array, address)``."""
    if torch_result:
        import torch

        tdt = _TORCH_DTYPES.get(dtype)
        if tdt is None:
            for t, d in _interop._torch_dtype_map().items():
                _TORCH_DTYPES.setdefault(d, t)
            tdt = _TORCH_DTYPES[dtype]
        t = torch.empty(shape, dtype=tdt, device=first.device)
        return t, t.data_ptr()
    import cupy

    a = cupy.empty(shape, dtype=dtype)
    return a, a.data.ptr


def replay(recipe: Recipe, ptrs: list, first):
    """Run ``recipe`` with the call's addresses ``ptrs``; returns ``{name: allocated array}``.

    ``first`` is the call's first array (its framework and device receive the results).
    """
    dev = recipe.device
    if _current_device() != dev:
        import cupy

        with cupy.cuda.Device(dev):
            return _replay(recipe, ptrs, first)
    return _replay(recipe, ptrs, first)


def _replay(recipe: Recipe, ptrs: list, first):
    global _CIntptr
    if _CIntptr is None:
        from cupy.cuda.function import CIntptr

        _CIntptr = CIntptr
    mk = _CIntptr
    out = None
    if recipe.allocs:
        out = {}
        for name, shape, dtype in recipe.allocs:
            arr, p = _alloc(first, recipe.torch, shape, dtype)
            out[name] = arr
            ptrs.append(p)
    stream = _torch_stream(recipe.device) if recipe.torch else None
    for kernel, grid, block, tmpl, fills, smem in recipe.launches:
        args = list(tmpl)
        for pos, slot in fills:
            args[pos] = mk(ptrs[slot])
        _jit_launch(kernel, grid, block, args, shared_mem=smem, stream=stream)
    return out
