"""Interop and the loader on a GPU: zero-copy DLPack, streams, the cast kernel."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mate_cupy.runtime.interop import BFLOAT16, FP8_E4M3, Call, wrap

pytestmark = pytest.mark.gpu

CAST_CASES = [
    ("float32", "bfloat16"), ("float32", "float16"), ("float32", "float8_e4m3fn"),
    ("bfloat16", "float32"), ("bfloat16", "float8_e4m3fn"), ("float8_e4m3fn", "bfloat16"),
    ("float16", "float8_e4m3fn"), ("float8_e4m3fn", "float32"), ("half", "bfloat16"),
]


@pytest.mark.torch
@pytest.mark.parametrize("name", ["bfloat16", "float16", "float8_e4m3fn", "float32", "int32", "int64"])
def test_torch_cuda_zero_copy(name):
    import torch

    t = (torch.randn(64, 33, device="cuda") * 4).to(getattr(torch, name))
    a = wrap("t", t)
    assert a.is_cuda and a.framework == "torch" and a.device == t.device.index
    assert a.data.data.ptr == t.data_ptr()
    assert a.dtype.name == name
    if name == "float8_e4m3fn":
        assert a.data.dtype == np.uint8
        np.testing.assert_array_equal(a.data.get(), t.view(torch.uint8).cpu().numpy())
    else:
        np.testing.assert_array_equal(a.data.get().astype(np.float64), t.double().cpu().numpy())
    back = Call(t=t).export(a.data, dtype=a.dtype)
    assert isinstance(back, torch.Tensor) and back.dtype == t.dtype and back.data_ptr() == t.data_ptr()


def test_cupy_passthrough():
    import cupy

    x = cupy.arange(10, dtype=cupy.float32)
    a = wrap("x", x)
    assert a.data is x and a.is_cuda and a.framework == "cupy"


def test_jax_bf16_zero_copy():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    x = jnp.arange(256, dtype=jnp.bfloat16).reshape(16, 16)
    a = wrap("x", x)
    assert a.is_cuda and a.dtype == BFLOAT16 and a.framework == "jax"
    assert a.data.data.ptr == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(a.data.get().astype(np.float32), np.asarray(x, dtype=np.float32))
    import mate_cupy as m

    y = m.cast(x, "float32")
    assert isinstance(y, jax.Array) and y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x, dtype=np.float32))


@pytest.mark.parametrize("src,dst", CAST_CASES)
def test_cast_kernel_matches_reference(src, dst, rng):
    import cupy

    import mate_cupy as m
    from mate_cupy.runtime.interop import as_dtype

    n = 4096 * 3 + 5  # vector body and a scalar tail
    host = (rng.standard_normal(n) * 50).astype(np.float32).astype(as_dtype(src))
    dev = cupy.asarray(host.view(np.uint8)) if as_dtype(src) == FP8_E4M3 else cupy.asarray(host)
    if as_dtype(src) == FP8_E4M3:
        import torch

        dev = torch.from_dlpack(dev).view(torch.float8_e4m3fn)
    out = m.cast(dev, dst)
    ref = m.cast(host, dst)
    if hasattr(out, "data_ptr"):  # torch result (fp8 input came from torch)
        import torch

        got = out.cpu()
        got = got.view(torch.uint8).numpy() if got.dtype == torch.float8_e4m3fn else got.float().numpy()
    else:
        got = out.get()
    if as_dtype(dst) == FP8_E4M3:
        np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))
    else:
        np.testing.assert_array_equal(got.astype(np.float64), ref.astype(np.float64))


@pytest.mark.torch
def test_cast_runs_on_torch_side_stream():
    import torch

    import mate_cupy as m

    side = torch.cuda.Stream()
    x = torch.randn(1 << 22, device="cuda")
    out = torch.empty(1 << 22, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)  # keep the side stream busy: a launch elsewhere would overtake it
        y = m.cast(x, "bfloat16", out=out)
        z = out.float() * 2  # ordered after the cast only if the cast is on this stream
    side.synchronize()
    assert y is out
    torch.testing.assert_close(z, x.to(torch.bfloat16).float() * 2)


@pytest.mark.torch
def test_fp8_result_comes_back_as_torch_fp8():
    import torch

    import mate_cupy as m

    x = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    y = m.cast(x, "float8_e4m3fn")
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float8_e4m3fn and y.is_cuda
    torch.testing.assert_close(y.float(), x.float().to(torch.float8_e4m3fn).float())


def test_mixed_host_and_device_rejected():
    import cupy

    import mate_cupy as m

    with pytest.raises(ValueError, match="out is on cpu but x is on cuda:0"):
        m.cast(cupy.ones(8, cupy.float32), "bfloat16", out=np.empty(8, ml_dtypes.bfloat16))


def test_loader_caches_modules():
    from mate_cupy.jit import get_kernel
    from mate_cupy.util_ops import PAGE_TABLE_SPEC

    assert get_kernel(PAGE_TABLE_SPEC) is get_kernel(PAGE_TABLE_SPEC)
