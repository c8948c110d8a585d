"""``chunk_kda`` on host arrays: results against the float64 references, output/state dtype
rules, preallocated outputs, varlen layouts, frameworks, and every refused input."""
from __future__ import annotations

import numpy as np
import pytest

import mate_cupy
from mate_cupy import chunk_kda
from mate_cupy.kda.common import load_launcher
from mate_cupy.reference.kda import kda_chunked, kda_recurrent
from test_kda_reference import BF16, kda_inputs, rel

F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
TOL = {BF16: 1e-2, F16: 5e-3}


def _ref_kwargs(x):
    return {key: val for key, val in x.items() if key != "output_final_state"}


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("layout", ["dense", "varlen4d", "varlen3d"])
@pytest.mark.parametrize("gate_params", [False, True], ids=["logdecay", "gateparams"])
@pytest.mark.parametrize("state", [None, "f32", "qdtype"])
def test_matches_references(rng, dtype, layout, gate_params, state):
    state_dt = {None: None, "f32": F32, "qdtype": dtype}[state]
    if layout == "dense":
        x = kda_inputs(rng, 2, 77, 2, 4, dtype=dtype, gate_params=gate_params, state=state_dt)
    else:
        x = kda_inputs(rng, 0, 0, 1, 2, dtype=dtype, gate_params=gate_params, state=state_dt, lens=[13, 0, 64, 66])
        if layout == "varlen3d":
            for key in ("q", "k", "v", "g", "beta"):
                x[key] = x[key][0]
    o, fs = chunk_kda(**x, output_final_state=True)
    o_ref, fs_ref = kda_recurrent(**x)
    o_chk, fs_chk = kda_chunked(**x)
    assert isinstance(o, np.ndarray) and o.dtype == dtype and o.shape == x["v"].shape
    assert fs.dtype == (state_dt if state_dt is not None else dtype)
    assert fs.shape == fs_ref.shape
    assert rel(o, o_ref) < TOL[dtype] and rel(o, o_chk) < TOL[dtype]
    state_tol = 1e-6 if fs.dtype == F32 else TOL[dtype]
    assert rel(fs, fs_ref) < state_tol and rel(fs, fs_chk) < state_tol
    # stored values are the float64 results rounded once
    np.testing.assert_array_equal(o, o_ref.astype(dtype))
    np.testing.assert_array_equal(fs, fs_ref.astype(fs.dtype))


def test_returns_output_only_by_default(rng):
    x = kda_inputs(rng, 1, 5, 1, 1)
    o = chunk_kda(**x)
    assert isinstance(o, np.ndarray) and o.shape == x["v"].shape


def test_defaults_scale_lower_bound_l2norm(rng):
    x = kda_inputs(rng, 1, 20, 2, 2, gate_params=True)
    o1 = chunk_kda(**x)
    o2 = chunk_kda(**x, scale=128 ** -0.5, lower_bound=-5.0, use_qk_l2norm_in_kernel=True)
    np.testing.assert_array_equal(o1, o2)
    o3 = chunk_kda(**x, lower_bound=-2.0)
    assert not np.array_equal(o1, o3)
    o4 = chunk_kda(**x, scale=0.25, use_qk_l2norm_in_kernel=False)
    ref, _ = kda_recurrent(**x, scale=0.25, use_qk_l2norm=False)
    assert rel(o4, ref) < 1e-2


def test_final_state_dtype_rules(rng):
    x = kda_inputs(rng, 2, 9, 1, 2)
    _, fs = chunk_kda(**x, output_final_state=True)
    assert fs.dtype == BF16  # q's dtype without states
    pre = np.full((2, 2, 128, 128), np.nan, np.float32)
    _, fs2 = chunk_kda(**x, output_final_state=True, final_state=pre)
    assert fs2 is pre and np.isfinite(pre).all()
    init = (0.1 * rng.standard_normal((2, 2, 128, 128))).astype(np.float32)
    _, fs3 = chunk_kda(**x, output_final_state=True, initial_state=init)
    assert fs3.dtype == F32
    _, ref = kda_recurrent(**x, initial_state=init)
    assert rel(fs3, ref) < 1e-6


def test_preallocated_output_and_state_written_in_place(rng):
    x = kda_inputs(rng, 2, 40, 2, 4, gate_params=True, state=np.float32)
    out = np.full(x["v"].shape, np.nan, BF16)
    fs = np.full((2, 4, 128, 128), np.nan, np.float32)
    o, f = chunk_kda(**x, output_final_state=True, output=out, final_state=fs)
    assert o is out and f is fs
    o_ref, fs_ref = kda_recurrent(**x)
    np.testing.assert_array_equal(out, o_ref.astype(BF16))
    assert rel(fs, fs_ref) < 1e-6


def test_final_state_ignored_without_output_final_state(rng):
    x = kda_inputs(rng, 1, 4, 1, 1)
    fs = np.full((1, 1, 128, 128), 7.0, np.float32)
    res = chunk_kda(**x, final_state=fs)
    assert isinstance(res, np.ndarray)
    assert (fs == 7.0).all()


def test_varlen_shapes(rng):
    x = kda_inputs(rng, 0, 0, 1, 2, lens=[3, 5])
    x3 = dict(x, q=x["q"][0], k=x["k"][0], v=x["v"][0], g=x["g"][0], beta=x["beta"][0])
    o3, fs3 = chunk_kda(**x3, output_final_state=True)
    o4, fs4 = chunk_kda(**x, output_final_state=True)
    assert o3.shape == (8, 2, 128) and o4.shape == (1, 8, 2, 128) and fs3.shape == (2, 2, 128, 128)
    np.testing.assert_array_equal(o3, o4[0])
    np.testing.assert_array_equal(fs3, fs4)
    # beta packed 2-D with 4-D q, and a 3-D preallocated output for 3-D q
    o5 = chunk_kda(**dict(x, beta=x["beta"][0]))
    np.testing.assert_array_equal(o5, o4)
    out = np.empty((8, 2, 128), BF16)
    assert chunk_kda(**x3, output=out) is out
    np.testing.assert_array_equal(out, o3)


def test_empty_sequences_keep_state(rng):
    init = (0.3 * rng.standard_normal((3, 2, 128, 128))).astype(np.float32)
    x = kda_inputs(rng, 0, 0, 2, 2, lens=[0, 4, 0])
    o, fs = chunk_kda(**x, initial_state=init, output_final_state=True)
    np.testing.assert_array_equal(fs[0], init[0])
    np.testing.assert_array_equal(fs[2], init[2])
    assert not np.array_equal(fs[1], init[1])
    # a dense batch with T = 0
    y = kda_inputs(rng, 2, 0, 1, 1)
    o, fs = chunk_kda(**y, initial_state=init[:2, :1], output_final_state=True)
    assert o.shape == (2, 0, 1, 128)
    np.testing.assert_array_equal(fs, init[:2, :1])
    # no sequences at all
    z = kda_inputs(rng, 0, 0, 1, 1, lens=[])
    o, fs = chunk_kda(**z, output_final_state=True)
    assert o.shape == (1, 0, 1, 128) and fs.shape == (0, 1, 128, 128)


def test_dt_bias_flat_and_non_f32_gate_params(rng):
    x = kda_inputs(rng, 1, 10, 1, 2, gate_params=True)
    o1 = chunk_kda(**x)
    o2 = chunk_kda(**dict(x, dt_bias=x["dt_bias"].reshape(-1)))
    np.testing.assert_array_equal(o1, o2)
    o3 = chunk_kda(**dict(x, A_log=x["A_log"].astype(np.float64), dt_bias=x["dt_bias"].astype(BF16)))
    ref, _ = kda_recurrent(**dict(x, dt_bias=x["dt_bias"].astype(BF16)))
    np.testing.assert_array_equal(o3, ref.astype(BF16))


def test_non_contiguous_inputs(rng):
    x = kda_inputs(rng, 2, 12, 2, 2, gate_params=True)
    big = {key: np.repeat(x[key], 2, axis=1)[:, ::2] for key in ("q", "k", "v", "g", "beta")}
    assert not big["q"].flags.c_contiguous
    np.testing.assert_array_equal(chunk_kda(**dict(x, **big)), chunk_kda(**x))


def test_int64_cu_seqlens(rng):
    x = kda_inputs(rng, 0, 0, 1, 1, lens=[2, 3])
    o1 = chunk_kda(**x)
    o2 = chunk_kda(**dict(x, cu_seqlens=x["cu_seqlens"].astype(np.int64)))
    np.testing.assert_array_equal(o1, o2)


@pytest.mark.torch
def test_torch_cpu_tensors(rng):
    import torch

    x = kda_inputs(rng, 1, 30, 1, 2, gate_params=True, state=np.float32)
    o_np, fs_np = chunk_kda(**x, output_final_state=True)

    def tt(a):
        t = torch.from_numpy(np.asarray(a, np.float32) if a.dtype == BF16 else a)
        return t.to(torch.bfloat16) if a.dtype == BF16 else t

    xt = {key: tt(val) for key, val in x.items()}
    o, fs = chunk_kda(**xt, output_final_state=True)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and fs.dtype == torch.float32
    np.testing.assert_array_equal(o.float().numpy(), o_np.astype(np.float32))
    np.testing.assert_array_equal(fs.numpy(), fs_np)
    out = torch.full(o.shape, float("nan"), dtype=torch.bfloat16)
    assert chunk_kda(**xt, output=out) is out
    assert torch.equal(out, o)


def test_package_exports():
    assert mate_cupy.chunk_kda is chunk_kda
    assert "chunk_kda" in mate_cupy.__all__ and "gated_delta_rule_decode" in mate_cupy.__all__
    assert getattr(chunk_kda, "__mate_api__", False)


def test_missing_launcher_is_not_implemented():
    with pytest.raises(NotImplementedError, match="no_such_launcher"):
        load_launcher("no_such_launcher", "run", "chunk_kda")
    with pytest.raises(NotImplementedError, match="run_nothing"):
        load_launcher("common", "run_nothing", "chunk_kda")


# ----------------------------------------------------------------------------- refused inputs


def _base(rng, varlen=False):
    if varlen:
        x = kda_inputs(rng, 0, 0, 1, 2, lens=[2, 3], gate_params=True)
    else:
        x = kda_inputs(rng, 2, 3, 1, 2, gate_params=True)
    return x


def _drop(d, *keys):
    return {k: v for k, v in d.items() if k not in keys}


BF = BF16
ERRORS = [
    # (id, varlen base, mutation(x, rng) -> kwargs, exception)
    ("dense-q-3d", False, lambda x: dict(x, q=x["q"][0]), ValueError),
    ("varlen-q-batch2", True, lambda x: dict(x, q=np.concatenate([x["q"], x["q"]])), ValueError),
    ("varlen-q-2d", True, lambda x: dict(x, q=x["q"][0, :, 0]), ValueError),
    ("varlen-q-5d", True, lambda x: dict(x, q=x["q"][None]), ValueError),
    ("head-dim-64", False, lambda x: dict(x, q=x["q"][..., :64], k=x["k"][..., :64]), ValueError),
    ("v-head-dim-64", False, lambda x: dict(x, v=x["v"][..., :64]), ValueError),
    ("k-shape", False, lambda x: dict(x, k=x["k"][:, :2]), ValueError),
    ("v-time", False, lambda x: dict(x, v=x["v"][:, :2], g=x["g"][:, :2], beta=x["beta"][:, :2]), ValueError),
    ("g-heads", False, lambda x: dict(x, g=np.concatenate([x["g"], x["g"]], axis=2)), ValueError),
    ("gva-not-divisible", False,
     lambda x: dict(x, q=np.repeat(x["q"], 3, 2), k=np.repeat(x["k"], 3, 2)), ValueError),
    ("beta-shape", False, lambda x: dict(x, beta=x["beta"][..., :1]), ValueError),
    ("beta-per-channel", False, lambda x: dict(x, beta=x["v"]), ValueError),
    ("q-float32", False, lambda x: dict(x, q=x["q"].astype(np.float32)), TypeError),
    ("k-dtype", False, lambda x: dict(x, k=x["k"].astype(np.float16)), TypeError),
    ("v-dtype", False, lambda x: dict(x, v=x["v"].astype(np.float16)), TypeError),
    ("g-dtype", False, lambda x: dict(x, g=x["g"].astype(np.float32)), TypeError),
    ("beta-dtype", False, lambda x: dict(x, beta=x["beta"].astype(np.float32)), TypeError),
    ("A_log-alone", False, lambda x: _drop(x, "dt_bias"), ValueError),
    ("dt_bias-alone", False, lambda x: _drop(x, "A_log"), ValueError),
    ("A_log-shape", False, lambda x: dict(x, A_log=x["A_log"][:1]), ValueError),
    ("dt_bias-shape", False, lambda x: dict(x, dt_bias=x["dt_bias"][:, :64]), ValueError),
    ("A_log-int", False, lambda x: dict(x, A_log=np.zeros(2, np.int32)), TypeError),
    ("initial-state-f16", False,
     lambda x: dict(x, initial_state=np.zeros((2, 2, 128, 128), np.float16)), TypeError),
    ("initial-state-shape", False,
     lambda x: dict(x, initial_state=np.zeros((2, 2, 128, 64), np.float32)), ValueError),
    ("initial-state-count", False,
     lambda x: dict(x, initial_state=np.zeros((3, 2, 128, 128), np.float32)), ValueError),
    ("cu_seqlens-float", True, lambda x: dict(x, cu_seqlens=x["cu_seqlens"].astype(np.float32)), TypeError),
    ("cu_seqlens-2d", True, lambda x: dict(x, cu_seqlens=x["cu_seqlens"][None]), ValueError),
    ("cu_seqlens-start", True, lambda x: dict(x, cu_seqlens=np.array([1, 2, 5], np.int32)), ValueError),
    ("cu_seqlens-decreasing", True, lambda x: dict(x, cu_seqlens=np.array([0, 4, 3, 5], np.int32)), ValueError),
    ("cu_seqlens-too-long", True, lambda x: dict(x, cu_seqlens=np.array([0, 2, 6], np.int32)), ValueError),
    ("cu_seqlens-short", True, lambda x: dict(x, cu_seqlens=np.array([0, 2, 4], np.int32)), ValueError),
    ("output-shape", False, lambda x: dict(x, output=np.empty((2, 3, 2, 64), BF)), ValueError),
    ("output-dtype", False, lambda x: dict(x, output=np.empty((2, 3, 2, 128), np.float32)), TypeError),
    ("final-state-f16", False,
     lambda x: dict(x, output_final_state=True, final_state=np.zeros((2, 2, 128, 128), np.float16)), TypeError),
    ("final-state-shape", False,
     lambda x: dict(x, output_final_state=True, final_state=np.zeros((1, 2, 128, 128), np.float32)), ValueError),
    ("state-dtypes-differ", False,
     lambda x: dict(x, output_final_state=True, initial_state=np.zeros((2, 2, 128, 128), BF),
                    final_state=np.zeros((2, 2, 128, 128), np.float32)), TypeError),
    ("q-not-array", False, lambda x: dict(x, q=[[1.0]]), TypeError),
]


@pytest.mark.parametrize("varlen,mutate,exc", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_refused_inputs(rng, varlen, mutate, exc):
    x = mutate(_base(rng, varlen))
    with pytest.raises(exc):
        chunk_kda(**x)


def test_error_messages_name_the_argument(rng):
    x = _base(rng)
    with pytest.raises(TypeError, match="beta"):
        chunk_kda(**dict(x, beta=x["beta"].astype(np.float32)))
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(**dict(x, initial_state=np.zeros((2, 2, 128, 64), np.float32)))
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda(**dict(_base(rng, True), cu_seqlens=np.array([0, 2, 6], np.int32)))


def test_refusal_leaves_preallocated_arrays_untouched(rng):
    x = _base(rng, True)
    out = np.full((1, 5, 2, 128), 3.0, BF16)
    with pytest.raises(ValueError):
        chunk_kda(**dict(x, cu_seqlens=np.array([0, 2, 6], np.int32)), output=out)
    assert (out.astype(np.float32) == 3.0).all()
