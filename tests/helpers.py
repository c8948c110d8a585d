"""Test helpers: error norms, poisoning, conversions."""
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
