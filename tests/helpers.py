"""Test helpers: error norms, poisoning, conversions, signed inputs."""
from __future__ import annotations

import numpy as np


def to_f64(x) -> np.ndarray:
    """Any array (NumPy, CuPy, torch, bf16/fp8 included) -> float64 NumPy."""
    if hasattr(x, "get"):  # CuPy
        x = x.get()
    if type(x).__module__.split(".")[0] == "torch":
        import torch

        x = x.detach().cpu()
        if x.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float16):
            x = x.float()
        x = x.numpy()
    return np.asarray(x).astype(np.float64)


def signed_rows(x, signs) -> np.ndarray:
    """``|x|`` times ``signs`` along axis 0 (one sign, or signed factor, per row), in x's dtype."""
    a = np.abs(np.asarray(x).astype(np.float32)) * np.asarray(signs).reshape((-1,) + (1,) * (np.ndim(x) - 1))
    return a.astype(np.asarray(x).dtype)


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| over finite-reference entries; inf if out has NaN where ref is finite."""
    out, ref = to_f64(out), to_f64(ref)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    finite = np.isfinite(ref)
    if not np.array_equal(np.isfinite(out), finite):
        return float("inf")
    if not np.array_equal(out[~finite], ref[~finite]):
        return float("inf")
    num = np.linalg.norm(out[finite] - ref[finite])
    den = np.linalg.norm(ref[finite])
    return float(num / den) if den > 0 else float(num)


def assert_rel(out, ref, tol: float, what: str = "") -> None:
    e = rel_err(out, ref)
    assert e <= tol, f"{what} relative error {e:.3e} > {tol:.1e}"


def poison_like(xp, shape, dtype):
    """An array filled with NaN (floats) or a sentinel (ints) to catch unwritten elements."""
    a = xp.empty(shape, dtype=dtype)
    if np.dtype(dtype).kind in "iu":
        a.fill(-12345)
    else:
        a.fill(np.nan)
    return a


def side_stream():
    """A new non-blocking CuPy stream whose work starts after everything queued so far on the
    current stream. Inputs made on the legacy default stream (copies, fills) are not ordered
    before a non-blocking stream's work by CUDA itself; this event wait orders them."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(cupy.cuda.get_current_stream().record())
    return stream


def torch_side_stream():
    """A new torch CUDA stream (non-blocking) whose work starts after everything queued so far
    on torch's current stream (the legacy default stream, where CuPy's inputs were made too)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    return stream


def kernel_params(source, kernel: str, macros=()) -> list:
    """``(name, kind)`` of each parameter of ``kernel`` as declared in the ``.cu`` file ``source``.

    ``macros`` names ``#define``d parameter lists used in the declaration (expanded first).
    Kinds as in :class:`mate_cupy.jit.KernelParams`: ptr, i64, u32, i32, f32, map.
    """
    import re
    from pathlib import Path

    text = Path(source).read_text()
    m = re.search(r"\b" + re.escape(kernel) + r"\s*\(([^;{]*?)\)\s*\{", text, re.S)
    assert m, f"{kernel} not declared in {source}"
    decls = m.group(1)
    for name in macros:
        body = re.search(r"#define " + name + r"\b(.*?)\n\n", text, re.S)
        assert body, f"macro {name} not defined in {source}"
        decls = decls.replace(name, body.group(1).replace("\\\n", " "))
    params = []
    for decl in decls.split(","):
        decl = " ".join(decl.replace("__restrict__", "").replace("const ", "").split())
        name = decl.split()[-1].lstrip("*")
        if decl.startswith("__grid_constant__ TensorMap "):
            kind = "map"
        elif "*" in decl:
            kind = "ptr"
        elif decl.startswith("long long"):
            kind = "i64"
        elif decl.startswith("unsigned"):
            kind = "u32"
        elif decl.startswith("int"):
            kind = "i32"
        elif decl.startswith("float"):
            kind = "f32"
        else:
            raise AssertionError(f"{kernel}: parameter type of {decl!r}")
        params.append((name, kind))
    return params


# ----------------------------------------------------------------------------- stand-in CUDA tensors


class FakeCudaTensor:
    """A torch CUDA tensor as mate_cupy's interop reads it: dtype, shape, strides, address."""

    __slots__ = ("dtype", "shape", "_stride", "_ptr")
    is_cuda = True
    requires_grad = False

    def __init__(self, shape, dtype, ptr, stride):
        import torch

        self.shape, self.dtype, self._ptr, self._stride = torch.Size(shape), dtype, int(ptr), tuple(stride)

    def stride(self):
        return self._stride

    def data_ptr(self):
        return self._ptr

    def get_device(self):
        return 0

    def __dlpack__(self, stream=None):  # marks an array; never called on the validated path
        raise RuntimeError("a stand-in tensor has no memory")


FakeCudaTensor.__module__ = "torch.fake"  # interop reads the framework from the top-level module
_NEXT_ADDRESS = [0x7F00_0000_0000]


def fake_cuda(x, stride=None, misalign=0, address=None):
    """A stand-in CUDA tensor with ``x``'s shape, dtype and (element) strides at ``address``
    (default: a fresh address 4 GiB past the last one, plus ``misalign`` bytes)."""
    import ml_dtypes
    import torch

    if x is None:
        return None
    tdt = {np.dtype(np.float32): torch.float32, np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
           np.dtype(np.float16): torch.float16, np.dtype(np.float64): torch.float64,
           np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}[x.dtype]
    if address is None:
        address = _NEXT_ADDRESS[0] + misalign
        _NEXT_ADDRESS[0] += 1 << 32
    if stride is None:
        stride = tuple(s // x.itemsize for s in x.strides)
    return FakeCudaTensor(x.shape, tdt, address, stride)


def emulator_or_skip(build, *args, **kwargs):
    """``build(*args, **kwargs)`` (a CPU emulator's build function); the calling test skips
    where g++ or the CUDA fp16/bf16 headers are missing."""
    import pytest

    try:
        return build(*args, **kwargs)
    except RuntimeError as e:
        if "needs g++" in str(e):
            pytest.skip(str(e))
        raise
