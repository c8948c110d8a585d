"""Device scratch memory with an owner: :class:`Workspace`.

Kernels that need scratch (split-KV partial outputs, the per-token sparse prefill's
partials and pair lists) take it from a workspace the caller holds, FlashInfer's
``float_workspace_buffer`` convention, or from the one a plan owns. Memory is freed when
its owner is; nothing is cached by the library across calls.
"""
from __future__ import annotations

from ..checks import int_arg
from .device import cuda_present
from .interop import Arg, wrap

__all__ = ["Workspace", "as_workspace"]

ALIGN = 256


class Workspace:
    """``nbytes`` of device memory on ``device`` (default: the current one), 256-byte aligned.

    Allocated from CuPy's memory pool on creation and returned to it when the object is
    freed. ``ptr`` is its address.
    """

    def __init__(self, nbytes: int, device: int | None = None):
        nbytes = int_arg("nbytes", nbytes, lo=0, hi=None)
        if device is not None:
            device = int_arg("device", device, lo=0)
        if not cuda_present():
            raise ValueError("Workspace needs a CUDA device; none is visible to this process")
        import cupy

        dev = cupy.cuda.Device().id if device is None else device
        with cupy.cuda.Device(dev):
            self.buffer = cupy.empty(max(nbytes, 1), dtype="uint8")
        self.nbytes = nbytes
        self.device = dev
        self.ptr = int(self.buffer.data.ptr)

    def __repr__(self) -> str:
        return f"Workspace({self.nbytes} bytes, cuda:{self.device})"


class _CallerBuffer:
    """A caller's contiguous CUDA array used as a workspace (kept alive by ``obj``)."""

    def __init__(self, arg: Arg):
        self.obj = arg.obj
        self.nbytes = arg.nbytes
        self.device = arg.device
        self.ptr = arg.ptr


def as_workspace(obj, need: int, device: int, name: str = "workspace"):
    """``obj`` (a :class:`Workspace` or a contiguous CUDA array) checked for ``need`` bytes on ``device``.

    Raises ``ValueError`` naming ``name`` when it is smaller, on another device, not
    contiguous or not 16-byte aligned.
    """
    if isinstance(obj, Workspace):
        ws = obj
    else:
        arg = wrap(name, obj)
        if not arg.is_cuda or not arg.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CUDA array or a mate_cupy.Workspace, got {arg.describe()}")
        ws = _CallerBuffer(arg)
    if ws.device != device:
        raise ValueError(f"{name} must be on cuda:{device}, got cuda:{ws.device}")
    if ws.nbytes < need:
        raise ValueError(f"{name} must hold at least {need} bytes, got {ws.nbytes}")
    if ws.ptr % 16:
        raise ValueError(f"{name} must be 16-byte aligned, got address {ws.ptr:#x}")
    return ws
