"""cast and the util.cu launchers on the CPU: host behaviour, one validation for host and
CUDA inputs, parameter tables against the kernel signatures, packed launches."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import mate_cupy as mc
from mate_cupy import util_ops
from mate_cupy.runtime.interop import BFLOAT16, FLOAT16, FLOAT32, FP8_E4M3, Arg, wrap

from helpers import kernel_params

SRC = util_ops.__file__.rsplit("/", 1)[0] + "/cuda_src/util.cu"


def _on_cuda(a):
    """The same array described as if it lived on cuda:0 (validation reads only metadata)."""
    return None if a is None else Arg(a.name, a.obj, a.dtype, "cupy", 0, a.shape, a.strides, a.ptr, data=a.data)


# ---------------------------------------------------------------------------- cast on the host


@pytest.mark.parametrize("src", ["float32", "float16", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("dst", ["float32", "float16", "bfloat16", "float8_e4m3fn"])
def test_cast_host_matches_float32_rounding(rng, src, dst):
    x = (rng.standard_normal(100) * 40).astype(np.float32).astype(np.dtype(getattr(ml_dtypes, src, src)))
    for scale in (1.0, 0.5, 3.0):
        y = mc.cast(x, dst, scale=scale)
        want = x.astype(np.float32) * np.float32(scale)
        if dst == "float8_e4m3fn":
            want = np.clip(want, -448.0, 448.0)
        want = want.astype(y.dtype)
        assert y.dtype == want.dtype and y.shape == x.shape
        np.testing.assert_array_equal(y.astype(np.float64), want.astype(np.float64))


def test_cast_host_out_and_saturation():
    x = np.array([1e6, -1e6, np.nan, 3.0], np.float32)
    out = np.empty(4, FP8_E4M3)
    assert mc.cast(x, "float8_e4m3fn", out=out) is out
    got = out.astype(np.float32)
    assert got[0] == 448.0 and got[1] == -448.0 and np.isnan(got[2]) and got[3] == 3.0


@pytest.mark.torch
def test_cast_host_torch_in_torch_out():
    import torch

    y = mc.cast(torch.arange(6, dtype=torch.float32).reshape(2, 3), "bfloat16", scale=2.0)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    assert y.float().tolist() == [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]


CAST_ERRORS = [
    ("x-float64", lambda: (np.zeros(8), "float32", None), TypeError),
    ("x-int32", lambda: (np.zeros(8, np.int32), "float32", None), TypeError),
    ("dtype-float64", lambda: (np.zeros(8, np.float32), "float64", None), TypeError),
    ("dtype-unknown", lambda: (np.zeros(8, np.float32), "float7", None), TypeError),
    ("x-strided", lambda: (np.zeros(16, np.float32)[::2], "float16", None), ValueError),
    ("out-dtype", lambda: (np.zeros(8, np.float32), "float16", np.zeros(8, np.float32)), TypeError),
    ("out-shape", lambda: (np.zeros(8, np.float32), "float16", np.zeros(9, np.float16)), ValueError),
    ("out-strided", lambda: (np.zeros(8, np.float32), "float16", np.zeros(16, np.float16)[::2]), ValueError),
    ("dtype-none", lambda: (np.zeros(8, np.float32), None, None), TypeError),
]


@pytest.mark.parametrize("make, exc", [pytest.param(m, e, id=i) for i, m, e in CAST_ERRORS])
def test_cast_refusals_are_the_same_for_host_and_cuda_inputs(make, exc):
    x, dtype, out = make()
    with pytest.raises(exc):
        mc.cast(x, dtype, out=out)
    messages = []
    for device_arg in (lambda a: a, _on_cuda):
        o = None if out is None else device_arg(wrap("out", out))
        with pytest.raises(exc) as info:
            util_ops.validate_cast(device_arg(wrap("x", x)), dtype, 1.0, o)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


# ---------------------------------------------------------------------------- launchers vs util.cu


@pytest.mark.parametrize("kernel,params", [("cast_kernel", util_ops.CAST_PARAMS),
                                           ("build_page_table_kernel", util_ops.PAGE_TABLE_PARAMS),
                                           ("query_positions_kernel", util_ops.POSITIONS_PARAMS)])
def test_launcher_parameters_match_kernel_signature(kernel, params):
    from pathlib import Path

    assert kernel_params(Path(SRC), kernel) == list(params.params)


def _recording(monkeypatch):
    launches = []
    monkeypatch.setattr(util_ops, "launch", lambda kern, grid, block, params, values, shared_mem=0, stream=0:
                        launches.append((kern, tuple(grid), tuple(block), params, tuple(values), stream)))
    monkeypatch.setattr(util_ops, "get_kernel", lambda spec, kernel=None, device_id=None:
                        spec.kernels[0] if kernel is None else kernel)
    return launches


def test_launch_cast_packs_its_launch(monkeypatch):
    launches = _recording(monkeypatch)
    x, out = wrap("x", np.zeros((3, 1000), BFLOAT16)), wrap("out", np.zeros((3, 1000), FP8_E4M3))
    problem = util_ops.validate_cast(x, "float8_e4m3fn", 0.25, out)
    util_ops.launch_cast(problem, x, out, 99)
    (kern, grid, block, params, values, stream), = launches
    assert kern == "cast_kernel<bf16_t, fp8_t>" and grid == (-(-3000 // 2048),) and block == (256,) and stream == 99
    params.pack(values)
    assert values[2:] == (3000, 0.25)
    util_ops.launch_cast(util_ops.validate_cast(x, "bfloat16", 2.0, None), x, out, 0)
    assert launches[-1][0] == "cast_kernel<bf16_t, bf16_t>"  # same dtype, scaled: the kernel


def test_every_cast_pair_and_index_dtype_is_registered():
    assert set(util_ops.CAST_SPECS) == {(a, b) for a in util_ops.CAST_DTYPES for b in util_ops.CAST_DTYPES}
    assert set(util_ops.PAGE_TABLE_SPEC.kernels) == set(util_ops.PAGE_TABLE_KERNELS.values())
    ints = {np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64)}
    assert set(util_ops.PAGE_TABLE_KERNELS) == ints
    assert {FLOAT32, FLOAT16, BFLOAT16, FP8_E4M3} == set(util_ops.CAST_DTYPES)


def test_launch_build_page_table_packs_its_launch(monkeypatch):
    launches = _recording(monkeypatch)
    idx = wrap("kv_indices", np.arange(20, dtype=np.int64)[::2])
    start = wrap("page_start", np.array([0, 4, 4, 10], np.int64))
    table = wrap("page_table", np.zeros((3, 6), np.int32))
    util_ops.launch_build_page_table(idx, start, table, 5)
    (kern, grid, block, params, values, stream), = launches
    assert kern == "build_page_table_kernel<long long>" and grid == (3,) and block == (256,) and stream == 5
    params.pack(values)
    assert values[1] == 2 and values[4] == 6  # element stride of the strided ids, max_pages
    util_ops.launch_build_page_table(idx, start, wrap("t", np.zeros((3, 0), np.int32)), 5)
    assert len(launches) == 1  # nothing to write: no launch


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_cast_refuses_cuda_inputs_like_host_inputs():
    from test_gpu_index import _to_device

    for name, make, exc in CAST_ERRORS:
        x, dtype, out = make()
        if x.dtype.kind == "V" or (out is not None and out.dtype.kind == "V"):
            continue
        with pytest.raises(exc) as host:
            mc.cast(x, dtype, out=out)
        with pytest.raises(exc) as dev:
            mc.cast(_to_device(x), dtype, out=_to_device(out))
        assert str(dev.value) == str(host.value), name


@pytest.mark.gpu
@pytest.mark.parametrize("src", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("dst", ["float32", "float16", "bfloat16"])
def test_cast_cuda_matches_host_unaligned_and_scaled(rng, src, dst):
    """Views starting off the 8-element boundary take the scalar path; same-dtype casts
    with a scale run the kernel, without one a copy."""
    import cupy

    host = (rng.standard_normal(5003) * 30).astype(np.float32).astype(np.dtype(getattr(ml_dtypes, src, src)))
    dev = mc.cast(cupy.asarray(host.astype(np.float32)), src)
    for lo in (0, 1, 3):
        for scale in (1.0, 0.75):
            got = mc.cast(dev[lo:], dst, scale=scale)
            want = mc.cast(host[lo:], dst, scale=scale)
            np.testing.assert_array_equal(got.get().astype(np.float64), want.astype(np.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int16, np.uint32])
def test_page_table_cuda_any_index_dtype_and_stride(rng, dtype):
    import cupy

    lens = np.array([0, 17, 300, 64, 1], np.int32)
    n = int((-(-lens // 16)).sum())
    ids = rng.permutation(1000)[: 2 * n].astype(dtype)
    want = mc.build_page_table_from_flat_kv_indices(ids[::2], lens, 16)
    for kv_lens in (lens, cupy.asarray(lens)):
        got = mc.build_page_table_from_flat_kv_indices(cupy.asarray(ids)[::2], kv_lens, 16)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got.get(), want)


def test_cast_scale_must_be_a_finite_number():
    x = np.ones(8, np.float32)
    for bad, exc in ((float("nan"), ValueError), (float("inf"), ValueError), (10**400, ValueError), ("2", TypeError)):
        with pytest.raises(exc, match="scale"):
            mc.cast(x, "bfloat16", scale=bad)
