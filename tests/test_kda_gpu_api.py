"""KDA public ops on CUDA arrays: the interface's plumbing around the kernels.

CuPy and torch inputs, varlen 3-D views, non-contiguous inputs and outputs, preallocated
and poisoned outputs, in-place pools, every result against the float64 references.
Skipped while a kernel launcher is not in the build (the op raises NotImplementedError).
"""
from __future__ import annotations

import numpy as np
import pytest

from mate_cupy import chunk_kda, gated_delta_rule_decode
from mate_cupy.reference.kda import kda_decode, kda_recurrent
from test_kda_reference import BF16, kda_inputs, rel

pytestmark = pytest.mark.gpu
F32 = np.dtype(np.float32)


def _call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        if "launcher" in str(e):
            pytest.skip(str(e))
        raise


def _dev(x):
    import cupy

    return {key: (cupy.asarray(val) if isinstance(val, np.ndarray) else val) for key, val in x.items()}


def _host(a):
    return np.asarray(a.get() if hasattr(a, "get") else a)


def _nan(shape, dtype):
    """A NaN-poisoned device array (made on the host: every dtype, bf16 included)."""
    import cupy

    return cupy.asarray(np.full(shape, np.nan, dtype=np.float32).astype(dtype))


# ----------------------------------------------------------------------------- chunk_kda


@pytest.mark.parametrize("layout", ["dense", "varlen3d", "varlen4d"])
@pytest.mark.parametrize("gate_params", [False, True], ids=["logdecay", "gateparams"])
@pytest.mark.parametrize("state", [None, F32, BF16], ids=["nostate", "state-f32", "state-bf16"])
def test_chunk_cupy_matches_reference(rng, layout, gate_params, state):
    if layout == "dense":
        x = kda_inputs(rng, 2, 200, 2, 4, gate_params=gate_params, state=state)
    else:
        x = kda_inputs(rng, 0, 0, 1, 2, gate_params=gate_params, state=state, lens=[1, 0, 64, 65, 130, 7])
        if layout == "varlen3d":
            for key in ("q", "k", "v", "g", "beta"):
                x[key] = x[key][0]
    o_ref, fs_ref = kda_recurrent(**x)
    d = _dev(x)
    N, HV = fs_ref.shape[:2]
    sdt = state if state is not None else BF16
    out = _nan(x["v"].shape, BF16)
    fs = _nan((N, HV, 128, 128), sdt)
    o, f = _call(chunk_kda, **d, output_final_state=True, output=out, final_state=fs)
    assert o is out and f is fs
    assert rel(_host(o), o_ref) < 1e-2
    # The chunk kernel feeds the tensor cores bf16 operands (as fla does): the final state carries
    # bf16-level error even when stored in float32.
    assert rel(_host(f), fs_ref) < 1e-2
    # allocated outputs: same values, shapes and dtypes
    o2, f2 = _call(chunk_kda, **d, output_final_state=True)
    assert o2.shape == x["v"].shape and o2.dtype == BF16 and f2.dtype == sdt
    np.testing.assert_array_equal(_host(o2), _host(o))


def test_chunk_non_contiguous_inputs_and_output(rng):
    import cupy

    x = kda_inputs(rng, 2, 100, 2, 4, gate_params=True, state=F32)
    d = _dev(x)
    ref, _ = _call(chunk_kda, **d, output_final_state=True)
    strided = {key: cupy.asarray(np.repeat(x[key], 2, axis=1))[:, ::2] for key in ("q", "k", "v", "g", "beta")}
    assert not strided["q"].flags.c_contiguous
    big = _nan((2, 100, 8, 128), BF16)
    out = big[:, :, ::2]
    o = _call(chunk_kda, **dict(d, **strided), output=out)
    assert o is out
    np.testing.assert_array_equal(_host(out), _host(ref))
    assert np.isnan(_host(big[:, :, 1::2]).astype(np.float32)).all()  # nothing written outside the view


@pytest.mark.torch
def test_chunk_torch_side_stream(rng):
    import torch

    x = kda_inputs(rng, 1, 150, 1, 2, gate_params=True, state=F32)
    o_ref, fs_ref = kda_recurrent(**x)

    def tt(a):
        t = torch.from_numpy(np.asarray(a, np.float32) if a.dtype == BF16 else a).cuda()
        return t.to(torch.bfloat16) if a.dtype == BF16 else t

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        xt = {key: tt(val) for key, val in x.items()}
        o, f = _call(chunk_kda, **xt, output_final_state=True)
    s.synchronize()
    assert isinstance(o, torch.Tensor) and o.is_cuda and o.dtype == torch.bfloat16
    assert rel(o.float().cpu().numpy(), o_ref) < 1e-2
    assert rel(f.cpu().numpy(), fs_ref) < 1e-2


# ----------------------------------------------------------------------------- decode


def _decode_inputs(rng, B, T, P, sdt=F32, v_first=True, per_channel=False, lens=None):
    from test_kda_decode import decode_inputs

    return decode_inputs(rng, B, T, H=2, HV=4, K=128, V=128, P=P, state_dtype=sdt, state_v_first=v_first,
                         per_channel_beta=per_channel, lens=lens)


DECODE_CASES = {
    "single-token-1d-padding": (dict(B=4, T=1, P=6), np.array([5, -1, 0, 2], np.int32), None,
                                dict(inplace_final_state=True)),
    "none-store": (dict(B=3, T=1, P=3), None, None, dict(store_final_state=True)),
    "2d-multitoken-padding": (dict(B=3, T=4, P=12),
                              np.array([[0, 1, -1, 2], [-1, 4, 5, 6], [7, 8, 9, 10]], np.int32), None,
                              dict(inplace_final_state=True)),
    "2d-spec": (dict(B=3, T=3, P=9), np.arange(9, dtype=np.int32).reshape(3, 3), np.array([2, 1, 3], np.int32),
                dict(inplace_final_state=True)),
    "varlen-2d": (dict(B=0, T=0, lens=[1, 3, 0, 2], P=12),
                  np.array([[0, -1, -1], [1, 2, 3], [4, 5, 6], [-1, 8, 9]], np.int32), None,
                  dict(inplace_final_state=True)),
    "no-initial-state": (dict(B=2, T=2, P=2), None, None, dict(use_initial_state=False, store_final_state=True)),
}
FLAGS = {
    "default": dict(),
    "lowerbound-sigmoid": dict(use_lower_bound=True, apply_beta_sigmoid=True),
    "nogate-negeig": dict(use_gate_in_kernel=False, allow_neg_eigval=True, apply_beta_sigmoid=True),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("sdt", [F32, BF16], ids=["f32state", "bf16state"])
@pytest.mark.parametrize("v_first", [True, False], ids=["vfirst", "kfirst"])
def test_decode_cupy_matches_reference(rng, case, flags, sdt, v_first):
    kw, si, na, opts = DECODE_CASES[case]
    x = _decode_inputs(rng, sdt=sdt, v_first=v_first, **kw)
    x["num_accepted_tokens"] = na
    opts = dict(opts, **FLAGS[flags], state_indices=si, state_v_first=v_first)
    ref_out, ref_pool, ref_final = kda_decode(**x, **opts)
    d = _dev(x)
    if si is not None:
        opts["state_indices"] = _dev({"s": si})["s"]
    out = _nan(ref_out.shape, BF16)
    o, f = _call(gated_delta_rule_decode, **d, **opts, output=out)
    assert o is out
    assert rel(_host(o), ref_out) < 1e-2
    padded = np.all(ref_out == 0, axis=(-1, -2))
    assert np.all(_host(o).astype(np.float32)[padded] == 0)
    tol = 1e-4 if sdt == F32 else 2e-2
    if opts.get("inplace_final_state"):
        assert f is d["state"]
        assert rel(_host(f), ref_pool) < tol
    else:
        assert f.dtype == sdt and f.shape == ref_final.shape
        assert rel(_host(f), ref_final) < tol
        np.testing.assert_array_equal(_host(d["state"]), x["state"])  # pool not written


def test_decode_per_channel_beta_and_f32_output(rng):
    x = _decode_inputs(rng, 2, 2, 2, per_channel=True)
    ref_out, _, ref_final = kda_decode(**x, store_final_state=True, apply_beta_sigmoid=True)
    out = _nan(ref_out.shape, F32)
    o, f = _call(gated_delta_rule_decode, **_dev(x), store_final_state=True, apply_beta_sigmoid=True, output=out)
    assert rel(_host(o), ref_out) < 1e-4 and rel(_host(f), ref_final) < 1e-4


def test_decode_non_contiguous_pool(rng):
    import cupy

    x = _decode_inputs(rng, 2, 2, 4)
    si = np.array([[3, 1], [0, 2]], np.int32)
    _, ref_pool, _ = kda_decode(**x, state_indices=si, inplace_final_state=True)
    d = _dev(x)
    big = cupy.zeros((8,) + x["state"].shape[1:], np.float32)
    big[::2] = d["state"]
    view = big[::2]
    _, f = _call(gated_delta_rule_decode, **dict(d, state=view), state_indices=cupy.asarray(si),
                 inplace_final_state=True)
    assert f is view
    assert rel(_host(view), ref_pool) < 1e-4
    assert float(cupy.abs(big[1::2]).max()) == 0.0


def test_decode_out_of_range_slots_are_padding(rng):
    """CUDA inputs are not read on the host: the kernel must skip slots outside the pool."""
    import cupy

    x = _decode_inputs(rng, 3, 1, 4)
    d = _dev(x)
    si = cupy.asarray(np.array([99, 1, 4], np.int32))
    o, f = _call(gated_delta_rule_decode, **d, state_indices=si, inplace_final_state=True)
    oh = _host(o).astype(np.float32)
    assert np.all(oh[0] == 0) and np.all(oh[2] == 0) and np.abs(oh[1]).max() > 0
    pool = _host(f)
    for s in (0, 2, 3):
        np.testing.assert_array_equal(pool[s], x["state"][s])


@pytest.mark.parametrize("state", [None, np.float16, F32], ids=["nostate", "state-f16", "state-f32"])
def test_chunk_fp16_inputs_and_fp16_state(rng, state):
    """fp16 q allows fp16 states (the default final-state dtype for fp16 q is fp16)."""
    x = kda_inputs(rng, 2, 90, 2, 2, dtype=np.float16, gate_params=True, state=state)
    o_ref, fs_ref = kda_recurrent(**x)
    o, f = _call(chunk_kda, **_dev(x), output_final_state=True)
    assert o.dtype == np.float16 and f.dtype == (np.float16 if state is None else state)
    assert rel(_host(o), o_ref) < 5e-3
    assert rel(_host(f), fs_ref) < 5e-3  # fp16 tensor-core operands


def test_decode_bf16_state_without_state_buffers(rng):
    """No pool read, none stored, state_dtype=bf16: multi-token outputs still see the per-token rounding."""
    x = _decode_inputs(rng, 2, 4, 2, sdt=BF16)
    ref_out, _, _ = kda_decode(**x, use_initial_state=False)
    d = _dev(x)
    o1, f1 = _call(gated_delta_rule_decode, **d, use_initial_state=False)
    o2, _ = _call(gated_delta_rule_decode, **dict(d, state=None), use_initial_state=False, state_dtype="bfloat16")
    assert f1 is None
    assert rel(_host(o1), ref_out) < 1e-2
    np.testing.assert_array_equal(_host(o1), _host(o2))
