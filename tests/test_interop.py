"""Interop layer on the host: NumPy and torch CPU arrays, dtypes, errors."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mate_cupy.runtime import interop as _interop
from mate_cupy.runtime.interop import BFLOAT16, FP8_E4M3, Call, as_dtype, export, to_host, wrap

TORCH_DTYPES = ["bfloat16", "float16", "float8_e4m3fn", "float32", "int32", "int64"]


def test_numpy_is_passed_through(rng):
    x = rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16)
    a = wrap("x", x)
    assert a.data is x and a.dtype == BFLOAT16 and a.device == -1 and a.framework == "numpy"
    assert not a.is_cuda and a.shape == (3, 5)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float8_e4m3fn", "float32", "int32", "int64"])
def test_as_dtype_names(name):
    assert as_dtype(name).name == name
    assert as_dtype(np.dtype(as_dtype(name))) == as_dtype(name)


def test_non_array_rejected():
    with pytest.raises(TypeError, match="x must be an array implementing DLPack"):
        wrap("x", [1.0, 2.0])
    with pytest.raises(TypeError, match="y must be an array"):
        Call(x=np.zeros(2), y="not an array")


def test_call_framework_follows_first_array(rng):
    call = Call(a=None, b=np.ones(3, np.float32), c=np.zeros(3, np.int32))
    assert call.framework == "numpy" and not call.is_cuda and call.xp is np
    assert call["a"] is None and call["b"].dtype == np.float32
    out = call.export(np.arange(3, dtype=np.float32))
    assert isinstance(out, np.ndarray)


def test_export_fp8_host_view(rng):
    x = rng.standard_normal(8).astype(ml_dtypes.float8_e4m3fn)
    as_u8 = x.view(np.uint8)
    back = export(as_u8, "numpy", dtype=FP8_E4M3)
    assert back.dtype == FP8_E4M3 and np.array_equal(back.view(np.uint8), as_u8)


def test_to_host_accepts_lists_and_arrays():
    assert to_host([1, 2, 3]).tolist() == [1, 2, 3]
    x = np.arange(4, dtype=np.int32)
    assert to_host(x) is x
    assert to_host(None) is None


@pytest.mark.torch
@pytest.mark.parametrize("name", TORCH_DTYPES)
def test_torch_cpu_round_trip_zero_copy(name, rng):
    import torch

    tdt = getattr(torch, name)
    t = torch.from_numpy(rng.standard_normal((4, 6)).astype(np.float32) * 4).to(tdt)
    a = wrap("t", t)
    assert a.framework == "torch" and a.device == -1
    assert a.dtype == as_dtype(name)
    assert a.data.ctypes.data == t.data_ptr()  # zero-copy view
    np.testing.assert_array_equal(a.data.astype(np.float64), t.double().numpy())
    back = export(a.data, "torch", dtype=a.dtype)
    assert back.dtype == tdt and back.data_ptr() == t.data_ptr()
    assert torch.equal(back, t)


@pytest.mark.torch
def test_torch_strided_view_and_grad(rng):
    import torch

    base = torch.randn(4, 6, requires_grad=True)
    t = base[:, ::2]
    a = wrap("t", t)
    assert not a.is_contiguous()
    np.testing.assert_array_equal(a.data, t.detach().numpy())
    assert a.data.strides == (24, 8)


@pytest.mark.torch
def test_torch_results_come_back_as_torch(rng):
    import torch

    call = Call(q=torch.zeros(2, dtype=torch.bfloat16), k=np.zeros(2, np.float32))
    assert call.framework == "torch"
    y = call.export(np.ones(3, dtype=ml_dtypes.bfloat16))
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    assert y.float().tolist() == [1.0, 1.0, 1.0]


@pytest.mark.torch
def test_torch_mixed_host_frameworks_share_device():
    import torch

    call = Call(a=np.zeros(2, np.float32), b=torch.zeros(2))
    assert call.device == -1 and call.framework == "numpy"


def test_mixed_devices_error_names_arguments(monkeypatch):
    """A CUDA array next to a host array raises ValueError naming both (no GPU needed)."""

    class FakeCuda:
        pass

    def fake_wrap(name, obj):
        if isinstance(obj, FakeCuda):
            return _interop.Arg(name, obj, np.dtype(np.float32), "dlpack", 0, (2,), (1,), 0)
        return real_wrap(name, obj)

    real_wrap = _interop.wrap
    monkeypatch.setattr(_interop, "wrap", fake_wrap)
    with pytest.raises(ValueError, match=r"k is on cuda:0 but q is on cpu"):
        Call(q=np.zeros(2, np.float32), k=FakeCuda())


def test_arg_describes_without_a_backend_view(rng):
    x = rng.standard_normal((4, 6)).astype(np.float32)[:, ::2]
    a = wrap("x", x)
    assert a.shape == (4, 3) and a.strides == (6, 2) and a.ptr == x.ctypes.data
    assert not a.is_contiguous() and a.size == 12 and a.nbytes == 48
    assert wrap("y", np.zeros((3, 1, 5), np.float16)).is_contiguous()


def test_call_new_allocates_in_the_callers_framework():
    call = Call(q=np.zeros(3, np.float32))
    out = call.new("out", (2, 3), BFLOAT16)
    assert isinstance(out.obj, np.ndarray) and out.obj.dtype == BFLOAT16 and out.shape == (2, 3)
    assert out.data is out.obj and out.ptr == out.obj.ctypes.data


class _FakeStream:
    def __init__(self, ptr):
        self.cuda_stream = ptr


def _fake_torch(raw):
    """A stand-in ``torch`` module: public ``cuda.current_stream`` gives stream 0x1000 + device;
    ``_C._cuda_getCurrentRawStream`` is ``raw`` (absent when None)."""
    import types

    cuda = types.SimpleNamespace(current_stream=lambda device=None: _FakeStream(0x1000 + (device or 0)),
                                 current_device=lambda: 0)
    c = types.SimpleNamespace() if raw is None else types.SimpleNamespace(_cuda_getCurrentRawStream=raw)
    return types.SimpleNamespace(cuda=cuda, _C=c)


@pytest.mark.parametrize("raw, uses_raw", [
    (lambda device: 0x1000 + device, True),     # agrees with the public API: the fast private function
    (lambda device: 0x2000, False),             # disagrees: the public API
    (None, False),                              # absent: the public API
    (lambda device: 1 / 0, False),              # raises: the public API
], ids=["agrees", "disagrees", "absent", "raises"])
def test_torch_stream_getter_prefers_a_verified_raw_function(monkeypatch, raw, uses_raw):
    import sys

    monkeypatch.setitem(sys.modules, "torch", _fake_torch(raw))
    monkeypatch.setattr(_interop, "_TORCH_RAW_STREAM", [])
    assert _interop._torch_stream_ptr(3) == 0x1003  # the current stream's handle, either way
    assert (_interop._TORCH_RAW_STREAM[0] is raw) == uses_raw
    assert _interop._torch_stream_ptr(2) == 0x1002


def test_call_signature_names_what_validation_reads(rng):
    a = rng.standard_normal((4, 6)).astype(np.float32)
    c1, c2 = Call(q=a, k=a[:, ::2]), Call(q=a.copy(), k=a[:, ::2].copy())
    s1, s2 = c1.signature(), c2.signature()
    assert s1[0] == -1 and [x[0] for x in s1[1:]] == ["q", "k"]
    assert s1[1][1:4] == (np.dtype(np.float32), (4, 6), (6, 1)) and s1[2][2:4] == ((4, 3), (6, 2))
    assert s2[2][3] == (3, 1)  # the contiguous copy differs in strides
    assert s1 != s2 and Call(q=a, k=a[:, ::2]).signature() == s1


def test_bounded_memo_drops_the_oldest():
    from mate_cupy.runtime.memo import BoundedMemo

    m = BoundedMemo(2)
    m.put("a", 1)
    m.put("b", 2)
    m.put("a", 3)  # an update does not evict
    assert len(m) == 2 and m.get("a") == 3
    m.put("c", 4)
    assert m.get("a") is None and m.get("b") == 2 and m.get("c") == 4 and len(m) == 2


def test_jax_host_results_hold_the_written_values(rng):
    """JAX copies host arrays on import, so results allocated for JAX inputs are exported
    after the op writes them (eager calls on JAX CPU arrays equal the NumPy calls)."""
    jnp = pytest.importorskip("jax.numpy")
    import mate_cupy as mc

    scores = rng.standard_normal((6, 4, 64)).astype(np.float32)
    want = mc.sparse_topk_select(scores, 8)
    got = mc.sparse_topk_select(jnp.asarray(scores), 8)
    assert type(got).__module__.startswith("jax") and np.array_equal(np.asarray(got), want)
    x = rng.standard_normal((5, 7)).astype(np.float32)
    assert np.array_equal(np.asarray(mc.cast(jnp.asarray(x), "bfloat16")).astype(np.float32),
                          mc.cast(x, "bfloat16").astype(np.float32))
