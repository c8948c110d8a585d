"""``gated_delta_rule_decode`` on host arrays.

Every result is checked against a driver written here that runs the recurrent reference
(``kda_recurrent``) one token at a time, with its own gate/beta formulas (SPEC 8) and its
own slot bookkeeping (SPEC 8a): state pools, ``[B]`` and ``[B, T]`` slots, padding,
speculative decoding, varlen, in-place and returned final states, both state layouts,
fp32 and bf16 states. Then every refused input (the kernels' contract refused for host
inputs too), the CUDA path's validation on stand-in torch CUDA tensors (metadata and an
address, no memory: no GPU needed), the launch configuration, and the launcher's
parameter list against the kernel source.
"""
from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from mate_cupy import gated_delta_rule_decode
from mate_cupy.reference.kda import kda_decode, kda_recurrent
from test_kda_reference import rel
from helpers import fake_cuda, kernel_params

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


def f64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


# ----------------------------------------------------------------------------- the driver


def _gate(a, A_log, dt_bias, use_gate_in_kernel, use_lower_bound, lower_bound):
    a = f64(a)
    if not use_gate_in_kernel:
        return a
    HV = a.shape[-2]
    x = a + (0.0 if dt_bias is None else f64(dt_bias))
    eA = np.exp(np.zeros(HV) if A_log is None else f64(A_log))[:, None]
    if use_lower_bound:
        return lower_bound / (1.0 + np.exp(-eA * x))
    return -eA * np.log1p(np.exp(x))


def _beta(b, apply_beta_sigmoid, allow_neg_eigval):
    b = f64(b)
    if apply_beta_sigmoid:
        b = 1.0 / (1.0 + np.exp(-b))
    return 2.0 * b if allow_neg_eigval else b


def drive(q, k, v, state, A_log, a, dt_bias, num_accepted_tokens, cu_seqlens, b, state_indices=None, scale=None,
          use_qk_l2norm=True, lower_bound=-5.0, use_gate_in_kernel=True, use_lower_bound=False,
          apply_beta_sigmoid=False, allow_neg_eigval=False, use_initial_state=True, state_v_first=True,
          store_final_state=False, inplace_final_state=False, state_dtype=None):
    """(out, pool_after, final) by running kda_recurrent token by token."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    gk = _gate(a, A_log, dt_bias, use_gate_in_kernel, use_lower_bound, lower_bound)
    be = _beta(b, apply_beta_sigmoid, allow_neg_eigval)
    sdt = np.dtype(state_dtype) if state_dtype is not None else (state.dtype if state is not None else F32)
    pool = None
    if state is not None:
        pool = f64(state)
        if not state_v_first:
            pool = pool.swapaxes(-1, -2).copy()
    if cu_seqlens is None:
        seqs = [(n, 0, T) for n in range(B)]
    else:
        seqs = [(0, int(cu_seqlens[n]), int(cu_seqlens[n + 1])) for n in range(len(cu_seqlens) - 1)]
    si = state_indices
    out = np.zeros((B, T, HV, V))
    after = pool.copy() if inplace_final_state else None
    final = np.zeros((len(seqs), HV, V, K))
    for n, (row, bos, eos) in enumerate(seqs):
        per_token = si is not None and si.ndim == 2
        if si is None:
            read = n
        elif not per_token:
            read = int(si[n])
        elif num_accepted_tokens is not None:
            read = int(si[n, int(num_accepted_tokens[n]) - 1])
        else:
            read = int(si[n, 0])
        if read < 0:
            continue
        S = pool[read].copy() if use_initial_state else np.zeros((HV, V, K))
        for i, t in enumerate(range(bos, eos)):
            slot = int(si[n, i]) if per_token and i < si.shape[1] else None
            if slot is not None and slot < 0:
                continue
            sl = (slice(row, row + 1), slice(t, t + 1))
            o, S1 = kda_recurrent(q[sl], k[sl], v[sl], gk[sl], be[sl], scale=scale, initial_state=S[None],
                                  use_qk_l2norm=use_qk_l2norm, beta_sigmoid=False)
            out[row, t] = o[0, 0]
            S = S1[0]
            if sdt == BF16:
                S = S.astype(np.float32).astype(BF16).astype(np.float64)
            if inplace_final_state and per_token and slot is not None:  # tokens past column C: stored nowhere
                after[slot] = S
        if inplace_final_state and not per_token and eos > bos:
            after[read] = S
        final[n] = S
    if not state_v_first:
        final = final.swapaxes(-1, -2)
        if after is not None:
            after = after.swapaxes(-1, -2)
    return out, after, (final if store_final_state and not inplace_final_state else None)


# ----------------------------------------------------------------------------- inputs


def decode_inputs(rng, B, T, H=2, HV=4, K=128, V=16, P=None, dtype=BF16, state_dtype=F32, state_v_first=True,
                  per_channel_beta=False, gate_params=True, lens=None):
    if lens is not None:
        B, T = 1, int(sum(lens))
    N = B if lens is None else len(lens)
    P = N if P is None else P
    shape = (P, HV, V, K) if state_v_first else (P, HV, K, V)
    x = dict(
        q=rng.standard_normal((B, T, H, K)).astype(dtype),
        k=rng.standard_normal((B, T, H, K)).astype(dtype),
        v=rng.standard_normal((B, T, HV, V)).astype(dtype),
        state=(0.5 * rng.standard_normal(shape)).astype(state_dtype),
        A_log=rng.uniform(-1, 1, HV).astype(np.float32) if gate_params else None,
        a=rng.standard_normal((B, T, HV, K)).astype(dtype),
        dt_bias=rng.standard_normal((HV, K)).astype(np.float32) if gate_params else None,
        num_accepted_tokens=None,
        cu_seqlens=None if lens is None else np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
        b=rng.uniform(-2, 2, (B, T, HV, V) if per_channel_beta else (B, T, HV)).astype(dtype),
    )
    return x


def check(x, opts, out_tol=1e-2):
    """Run the public op, the float64 reference and the driver on the same inputs; compare all."""
    pool0 = None if x["state"] is None else x["state"].copy()
    ref_out, ref_pool, ref_final = kda_decode(**x, **opts)
    drv_out, drv_pool, drv_final = drive(**{**x, "state": pool0}, **opts)
    bf16_state = (opts.get("state_dtype") or (x["state"].dtype if x["state"] is not None else F32)) == BF16
    st_tol = 1e-6 if bf16_state else 1e-12  # bf16 rounding may flip on float64 noise
    assert rel(ref_out, drv_out) < 1e-10
    if drv_pool is not None:
        assert rel(ref_pool, drv_pool) < st_tol
    else:
        assert ref_pool is None
    if drv_final is not None:
        assert rel(ref_final, drv_final) < st_tol
    else:
        assert ref_final is None

    out, fin = gated_delta_rule_decode(**x, **opts)
    assert out.shape == drv_out.shape and out.dtype == x["q"].dtype
    assert rel(out, drv_out) < out_tol
    padded = np.all(drv_out == 0, axis=(-1, -2))
    assert np.all(np.asarray(out, np.float64)[padded] == 0)
    sdt = np.dtype(opts.get("state_dtype") or (x["state"].dtype if x["state"] is not None else F32))
    tol = 1e-6 if sdt == F32 else 1e-2
    if opts.get("inplace_final_state"):
        assert fin is x["state"]
        assert rel(x["state"], drv_pool) < tol
        if sdt == BF16:  # the pool holds exactly the per-token-rounded states
            assert rel(x["state"], ref_pool) < 1e-6
    elif opts.get("store_final_state"):
        assert fin.dtype == sdt and fin.shape == drv_final.shape
        assert rel(fin, drv_final) < tol
        if pool0 is not None:
            np.testing.assert_array_equal(x["state"], pool0)  # not written
    else:
        assert fin is None
        if pool0 is not None:
            np.testing.assert_array_equal(x["state"], pool0)
    return out, fin, drv_out


# ----------------------------------------------------------------------------- flags

GATES = {
    "nogate": dict(use_gate_in_kernel=False),
    "softplus": dict(),
    "softplus-noparams": dict(_no_params=True),
    "lowerbound": dict(use_lower_bound=True, lower_bound=-3.0),
    "lowerbound-default": dict(use_lower_bound=True),
}
BETAS = {
    "raw": dict(),
    "sigmoid": dict(apply_beta_sigmoid=True),
    "negeig": dict(allow_neg_eigval=True),
    "sigmoid-negeig": dict(apply_beta_sigmoid=True, allow_neg_eigval=True),
}


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("beta", list(BETAS))
@pytest.mark.parametrize("l2", [True, False], ids=["l2", "nol2"])
@pytest.mark.parametrize("v_first", [True, False], ids=["vfirst", "kfirst"])
@pytest.mark.parametrize("sdt", [F32, BF16], ids=["f32state", "bf16state"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["headbeta", "channelbeta"])
def test_flags_match_token_by_token_driver(rng, gate, beta, l2, v_first, sdt, per_channel):
    opts = dict(GATES[gate])
    no_params = opts.pop("_no_params", False)
    opts.update(BETAS[beta])
    opts.update(use_qk_l2norm=l2, state_v_first=v_first, store_final_state=True)
    x = decode_inputs(rng, 3, 2, state_dtype=sdt, state_v_first=v_first, per_channel_beta=per_channel,
                      gate_params=not no_params)
    if not l2:
        x["q"] = (x["q"].astype(np.float32) / 6).astype(BF16)
        x["k"] = (x["k"].astype(np.float32) / 6).astype(BF16)
    check(x, opts)


# ----------------------------------------------------------------------------- slots

SLOT_CASES = {
    # name: (decode_inputs kwargs, state_indices builder, num_accepted, options)
    "none-store": (dict(B=3, T=3), None, None, dict(store_final_state=True)),
    "none-inplace-multitoken": (dict(B=3, T=3, P=5), None, None, dict(inplace_final_state=True)),
    "none-no-final": (dict(B=2, T=2), None, None, dict()),
    "1d-inplace-padding": (dict(B=4, T=1, P=6), lambda: np.array([5, -1, 0, 2], np.int32), None,
                           dict(inplace_final_state=True)),
    "1d-store-multitoken": (dict(B=3, T=4, P=4), lambda: np.array([3, 1, -1], np.int64), None,
                            dict(store_final_state=True)),
    "2d-inplace-token-padding": (dict(B=3, T=4, P=12),
                                 lambda: np.array([[0, 1, -1, 2], [-1, 4, 5, 6], [7, 8, 9, -1]], np.int32), None,
                                 dict(inplace_final_state=True)),
    "2d-store-extra-columns": (dict(B=2, T=2, P=8), lambda: np.array([[3, -1, 5], [6, 7, -1]], np.int32), None,
                               dict(store_final_state=True)),
    "2d-store-fewer-columns": (dict(B=2, T=3, P=4), lambda: np.array([[1], [2]], np.int32), None,
                               dict(store_final_state=True)),
    "2d-spec-inplace": (dict(B=3, T=3, P=12), lambda: np.array([[0, 1, 2], [3, 4, 5], [6, 7, 8]], np.int32),
                        lambda: np.array([2, 1, 3], np.int32), dict(inplace_final_state=True)),
    "2d-spec-padded-read": (dict(B=2, T=2, P=6), lambda: np.array([[0, -1], [2, 3]], np.int32),
                            lambda: np.array([2, 1], np.int64), dict(inplace_final_state=True)),
    "2d-spec-store": (dict(B=2, T=3, P=6), lambda: np.array([[0, 1, 2], [3, 4, 5]], np.int64),
                      lambda: np.array([3, 2], np.int32), dict(store_final_state=True)),
    "varlen-2d-inplace": (dict(B=0, T=0, lens=[1, 3, 0, 2], P=12),
                          lambda: np.array([[0, -1, -1], [1, 2, 3], [4, 5, 6], [-1, 8, 9]], np.int32), None,
                          dict(inplace_final_state=True)),
    "varlen-2d-spec": (dict(B=0, T=0, lens=[2, 3], P=8), lambda: np.array([[0, 1, 2], [3, 4, 5]], np.int32),
                       lambda: np.array([1, 3], np.int32), dict(inplace_final_state=True)),
    "varlen-none-store": (dict(B=0, T=0, lens=[3, 0, 4]), None, None, dict(store_final_state=True)),
    "varlen-1d-store": (dict(B=0, T=0, lens=[2, 2], P=3), lambda: np.array([2, 0], np.int32), None,
                        dict(store_final_state=True)),
    "no-initial-state-inplace": (dict(B=2, T=2, P=4), lambda: np.array([[1, 2], [3, 0]], np.int32), None,
                                 dict(use_initial_state=False, inplace_final_state=True)),
    "no-initial-state-store": (dict(B=2, T=2), None, None, dict(use_initial_state=False, store_final_state=True)),
}


@pytest.mark.parametrize("sdt", [F32, BF16], ids=["f32state", "bf16state"])
@pytest.mark.parametrize("v_first", [True, False], ids=["vfirst", "kfirst"])
@pytest.mark.parametrize("case", list(SLOT_CASES))
def test_slots_match_token_by_token_driver(rng, case, sdt, v_first):
    kw, si, na, opts = SLOT_CASES[case]
    x = decode_inputs(rng, **kw, state_dtype=sdt, state_v_first=v_first)
    x["num_accepted_tokens"] = None if na is None else na()
    opts = dict(opts, state_indices=None if si is None else si(), state_v_first=v_first,
                apply_beta_sigmoid=True)
    check(x, opts)


def test_padding_sequences_and_tokens_write_nothing(rng):
    x = decode_inputs(rng, 3, 3, P=10)
    si = np.array([[0, -1, 1], [-1, 2, 3], [4, 5, 6]], np.int32)
    pool0 = x["state"].copy()
    out, fin = gated_delta_rule_decode(**x, state_indices=si, inplace_final_state=True)
    assert fin is x["state"]
    assert np.all(np.asarray(out[1], np.float32) == 0)  # read slot -1: whole sequence padding
    assert np.all(np.asarray(out[0, 1], np.float32) == 0)  # token padding
    untouched = [7, 8, 9]  # never named by a written slot (2, 3 belong to the padded sequence)
    np.testing.assert_array_equal(x["state"][untouched], pool0[untouched])
    np.testing.assert_array_equal(x["state"][[2, 3]], pool0[[2, 3]])
    assert not np.array_equal(x["state"][1], pool0[1])


def test_spec_reads_accepted_slot(rng):
    """num_accepted_tokens = m reads state_indices[n, m-1]: same as decoding from that slot."""
    x = decode_inputs(rng, 1, 2, P=4)
    si = np.array([[2, 3]], np.int32)
    y = {**x, "state": x["state"].copy()}
    x["num_accepted_tokens"] = np.array([2], np.int32)
    out_a, _ = gated_delta_rule_decode(**x, state_indices=si, store_final_state=True)
    out_b, _ = gated_delta_rule_decode(**{**y, "state": y["state"][3:4]}, store_final_state=True)
    assert np.abs(np.asarray(out_a, np.float32)).max() > 0
    np.testing.assert_array_equal(out_a, out_b)


def test_repeated_single_token_equals_multi_token(rng):
    """T tokens in one call == T single-token in-place calls (fp32 and bf16 pools)."""
    for sdt in (F32, BF16):
        x = decode_inputs(rng, 2, 4, P=2, state_dtype=sdt)
        pool = x["state"].copy()
        out_multi, fin = gated_delta_rule_decode(**x, inplace_final_state=True)
        for t in range(4):
            step = {key: (val[:, t:t + 1] if key in ("q", "k", "v", "a", "b") else val) for key, val in x.items()}
            step["state"] = pool
            out_t, _ = gated_delta_rule_decode(**step, state_indices=np.arange(2, dtype=np.int32),
                                               inplace_final_state=True)
            assert rel(out_t, out_multi[:, t:t + 1]) < 1e-2
        assert rel(pool, fin) < (1e-6 if sdt == F32 else 1e-2)


def test_defaults(rng):
    x = decode_inputs(rng, 2, 1)
    o1, f1 = gated_delta_rule_decode(**x, store_final_state=True)
    o2, f2 = gated_delta_rule_decode(
        **x, store_final_state=True, scale=128 ** -0.5, use_qk_l2norm=True, lower_bound=-5.0,
        use_gate_in_kernel=True, use_lower_bound=False, apply_beta_sigmoid=False, allow_neg_eigval=False,
        use_initial_state=True, state_v_first=True, is_varlen=False, state_dtype=np.float32)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(f1, f2)
    # lower_bound=None means -5.0 (not 0.0)
    o3, _ = gated_delta_rule_decode(**x, use_lower_bound=True)
    o4, _ = gated_delta_rule_decode(**x, use_lower_bound=True, lower_bound=-5.0)
    o5, _ = gated_delta_rule_decode(**x, use_lower_bound=True, lower_bound=0.0)
    np.testing.assert_array_equal(o3, o4)
    assert not np.array_equal(o3, o5)


def test_returns(rng):
    x = decode_inputs(rng, 2, 1, P=3, state_v_first=False)
    out, fin = gated_delta_rule_decode(**x, state_v_first=False)
    assert fin is None and out.shape == (2, 1, 4, 16)
    out, fin = gated_delta_rule_decode(**x, state_v_first=False, store_final_state=True)
    assert fin.shape == (2, 4, 128, 16) and fin.dtype == F32  # K-first [N, HV, K, V]
    pre = np.full((2, 1, 4, 16), np.nan, np.float32)
    out, fin = gated_delta_rule_decode(**x, state_v_first=False, output=pre, inplace_final_state=True,
                                       store_final_state=True)
    assert out is pre and fin is x["state"] and np.isfinite(pre).all()


def test_state_none_without_initial_state(rng):
    x = decode_inputs(rng, 2, 2)
    x["state"] = None
    out, fin = gated_delta_rule_decode(**x, use_initial_state=False, store_final_state=True, state_dtype="bfloat16")
    assert fin.dtype == BF16 and fin.shape == (2, 4, 16, 128)
    _, _, drv = drive(**x, use_initial_state=False, store_final_state=True, state_dtype=BF16)
    assert rel(fin, drv) < 1e-2
    out2, fin2 = gated_delta_rule_decode(**x, use_initial_state=False, state_dtype=BF16)
    assert fin2 is None
    np.testing.assert_array_equal(out, out2)


@pytest.mark.torch
def test_torch_cpu_and_torch_state_dtype(rng):
    import torch

    x = decode_inputs(rng, 2, 2, P=3, state_dtype=BF16)
    si = np.array([[2, 0], [1, -1]], np.int32)
    ref_out, ref_pool, _ = kda_decode(**x, state_indices=si, inplace_final_state=True)

    def tt(a):
        if a is None:
            return None
        if a.dtype == BF16:
            return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(a.copy())

    xt = {key: tt(val) for key, val in x.items()}
    out, fin = gated_delta_rule_decode(**xt, state_indices=torch.from_numpy(si), inplace_final_state=True,
                                       state_dtype=torch.bfloat16)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert fin is xt["state"]
    assert rel(out.float().numpy(), ref_out) < 1e-2
    np.testing.assert_array_equal(fin.float().numpy(), ref_pool)


def test_non_contiguous_pool_and_inputs(rng):
    x = decode_inputs(rng, 2, 2, P=4)
    big = np.zeros((8,) + x["state"].shape[1:], np.float32)
    big[::2] = x["state"]
    view = big[::2]
    si = np.array([[3, 1], [0, 2]], np.int32)
    ref_out, ref_pool, _ = kda_decode(**x, state_indices=si, inplace_final_state=True)
    qv = np.repeat(x["q"], 2, axis=1)[:, ::2]
    out, fin = gated_delta_rule_decode(**{**x, "state": view, "q": qv}, state_indices=si, inplace_final_state=True)
    assert fin is view
    assert rel(view, ref_pool) < 1e-6 and np.all(big[1::2] == 0)
    assert rel(out, ref_out) < 1e-2


# ----------------------------------------------------------------------------- refused inputs


def _base(rng, **kw):
    return decode_inputs(rng, 2, 2, P=4, **kw)


def _bad(name, mutate, exc, **opts):
    return pytest.param(mutate, opts, exc, id=name)


ERRORS = [
    _bad("state_dtype-f16", lambda x: x, ValueError, state_dtype=np.float16),
    _bad("state_dtype-bogus", lambda x: x, ValueError, state_dtype="int4"),
    _bad("state-f16", lambda x: {**x, "state": x["state"].astype(np.float16)}, ValueError),
    _bad("q-3d", lambda x: {**x, "q": x["q"][0]}, ValueError),
    _bad("v-3d", lambda x: {**x, "v": x["v"][0]}, ValueError),
    _bad("a-3d", lambda x: {**x, "a": x["a"][0]}, ValueError),
    _bad("A_log-2d", lambda x: {**x, "A_log": x["A_log"][None]}, ValueError),
    _bad("dt_bias-1d", lambda x: {**x, "dt_bias": x["dt_bias"].reshape(-1)}, ValueError),
    _bad("k-shape", lambda x: {**x, "k": x["k"][:, :1]}, ValueError),
    _bad("v-batch", lambda x: {**x, "v": x["v"][:1]}, ValueError),
    _bad("gva-not-divisible", lambda x: {**x, "q": np.repeat(x["q"], 3, 2)[:, :, :3],
                                         "k": np.repeat(x["k"], 3, 2)[:, :, :3]}, ValueError),
    _bad("a-shape", lambda x: {**x, "a": x["a"][..., :8]}, ValueError),
    _bad("A_log-numel", lambda x: {**x, "A_log": x["A_log"][:3]}, ValueError),
    _bad("dt_bias-shape", lambda x: {**x, "dt_bias": x["dt_bias"][:, :8]}, ValueError),
    _bad("q-float32", lambda x: {**x, "q": x["q"].astype(np.float32)}, NotImplementedError),
    _bad("A_log-f16", lambda x: {**x, "A_log": x["A_log"].astype(np.float16)}, ValueError),
    _bad("dt_bias-f16", lambda x: {**x, "dt_bias": x["dt_bias"].astype(np.float16)}, ValueError),
    _bad("output-shape", lambda x: x, ValueError, output=np.empty((2, 2, 4, 8), np.float32)),
    _bad("output-f64", lambda x: x, NotImplementedError, output=np.empty((2, 2, 4, 16), np.float64)),
    _bad("k-dtype", lambda x: {**x, "k": x["k"].astype(np.float16)}, TypeError),
    _bad("a-int", lambda x: {**x, "a": x["a"].astype(np.int32)}, TypeError),
    _bad("b-shape", lambda x: {**x, "b": x["b"][..., :1]}, ValueError),
    _bad("varlen-no-cu_seqlens", lambda x: x, ValueError, is_varlen=True),
    _bad("cu_seqlens-2d", lambda x: {**x, "q": x["q"][:1], "k": x["k"][:1], "v": x["v"][:1], "a": x["a"][:1],
                                     "b": x["b"][:1], "cu_seqlens": np.array([[0, 2]], np.int32)}, ValueError),
    _bad("cu_seqlens-float", lambda x: {**x, "cu_seqlens": np.array([0.0, 1.0])}, TypeError),
    _bad("varlen-batch-2", lambda x: {**x, "cu_seqlens": np.array([0, 1, 2], np.int32)}, ValueError),
    _bad("cu_seqlens-values", lambda x: {**x, "q": x["q"][:1], "k": x["k"][:1], "v": x["v"][:1], "a": x["a"][:1],
                                         "b": x["b"][:1], "cu_seqlens": np.array([0, 3], np.int32)}, ValueError),
    _bad("num_accepted-shape", lambda x: {**x, "num_accepted_tokens": np.array([1, 1, 1], np.int32)}, ValueError,
         state_indices=np.array([[0, 1], [2, 3]], np.int32)),
    _bad("num_accepted-without-indices", lambda x: {**x, "num_accepted_tokens": np.array([1, 1], np.int32)},
         ValueError),
    _bad("num_accepted-zero", lambda x: {**x, "num_accepted_tokens": np.array([0, 1], np.int32)}, ValueError,
         state_indices=np.array([[0, 1], [2, 3]], np.int32)),
    _bad("num_accepted-too-large", lambda x: {**x, "num_accepted_tokens": np.array([3, 1], np.int32)}, ValueError,
         state_indices=np.array([[0, 1], [2, 3]], np.int32)),
    _bad("state_indices-3d", lambda x: x, ValueError, state_indices=np.zeros((2, 2, 1), np.int32)),
    _bad("state_indices-float", lambda x: x, ValueError, state_indices=np.zeros(2, np.float32)),
    _bad("state_indices-batch", lambda x: x, ValueError, state_indices=np.zeros(3, np.int32)),
    _bad("state_indices-1d-spec", lambda x: {**x, "num_accepted_tokens": np.array([1, 1], np.int32)}, ValueError,
         state_indices=np.zeros(2, np.int32)),
    _bad("state_indices-1d-inplace-multitoken", lambda x: x, ValueError, state_indices=np.array([0, 1], np.int32),
         inplace_final_state=True),
    _bad("state_indices-1d-inplace-varlen", lambda x: {**x, "q": x["q"][:1], "k": x["k"][:1], "v": x["v"][:1],
                                                       "a": x["a"][:1], "b": x["b"][:1],
                                                       "cu_seqlens": np.array([0, 1], np.int32)},
         ValueError, state_indices=np.array([0], np.int32), inplace_final_state=True),
    _bad("state_indices-no-columns", lambda x: x, ValueError, state_indices=np.zeros((2, 0), np.int32)),
    _bad("state_indices-few-columns-inplace", lambda x: x, ValueError, state_indices=np.zeros((2, 1), np.int32),
         inplace_final_state=True),
    _bad("state_indices-few-columns-spec", lambda x: {**x, "num_accepted_tokens": np.array([1, 1], np.int32)},
         ValueError, state_indices=np.zeros((2, 1), np.int32)),
    _bad("varlen-few-columns-inplace", lambda x: {**x, "q": x["q"][:1], "k": x["k"][:1], "v": x["v"][:1],
                                                  "a": x["a"][:1], "b": x["b"][:1],
                                                  "cu_seqlens": np.array([0, 2], np.int32)},
         ValueError, state_indices=np.zeros((1, 1), np.int32), inplace_final_state=True),
    _bad("slot-out-of-range", lambda x: x, ValueError, state_indices=np.array([0, 4], np.int32)),
    _bad("token-slot-out-of-range", lambda x: x, ValueError, state_indices=np.array([[0, 1], [2, 9]], np.int32),
         inplace_final_state=True),
    _bad("token-slot-out-of-range-store", lambda x: x, ValueError,
         state_indices=np.array([[0, 1], [2, 4]], np.int32), store_final_state=True),
    _bad("no-state", lambda x: {**x, "state": None}, ValueError),
    _bad("no-state-inplace", lambda x: {**x, "state": None}, ValueError, use_initial_state=False,
         inplace_final_state=True),
    _bad("state-vs-state_dtype", lambda x: x, ValueError, state_dtype="bfloat16"),
    _bad("state-layout", lambda x: x, ValueError, state_v_first=False),
    _bad("state-3d", lambda x: {**x, "state": x["state"][0]}, ValueError),
    _bad("pool-too-small", lambda x: {**x, "state": x["state"][:1]}, ValueError),
    _bad("pool-empty-with-indices", lambda x: {**x, "state": x["state"][:0]}, ValueError,
         state_indices=np.array([-1, -1], np.int32)),
    _bad("q-not-array", lambda x: {**x, "q": "q"}, TypeError),
    _bad("scale-nan", lambda x: x, ValueError, scale=float("nan")),
    _bad("scale-inf", lambda x: x, ValueError, scale=float("inf")),
    _bad("lower-bound-nan", lambda x: x, ValueError, lower_bound=float("nan")),
    _bad("H-zero", lambda x: {**x, "q": x["q"][:, :, :0], "k": x["k"][:, :, :0]}, ValueError),
    # The kernels' contract, refused for host inputs as for CUDA ones.
    _bad("K-64", lambda x: {**x, "q": x["q"][..., :64], "k": x["k"][..., :64], "a": x["a"][..., :64],
                            "dt_bias": x["dt_bias"][:, :64], "state": x["state"][..., :64]}, NotImplementedError),
]


@pytest.mark.parametrize("mutate,opts,exc", ERRORS)
def test_refused_inputs(rng, mutate, opts, exc):
    x = mutate(_base(rng))
    pool0 = None if x["state"] is None else np.array(x["state"], copy=True)
    with pytest.raises(exc):
        gated_delta_rule_decode(**x, **opts)
    if pool0 is not None:
        np.testing.assert_array_equal(x["state"], pool0)  # refused before any write


def test_error_messages_name_the_argument(rng):
    x = _base(rng)
    with pytest.raises(ValueError, match="state_indices"):
        gated_delta_rule_decode(**x, state_indices=np.zeros((2, 1), np.int32), inplace_final_state=True)
    with pytest.raises(ValueError, match="A_log"):
        gated_delta_rule_decode(**{**x, "A_log": x["A_log"].astype(np.float16)})
    with pytest.raises(ValueError, match="slot"):
        gated_delta_rule_decode(**x, state_indices=np.array([0, 7], np.int32))


def test_unused_state_is_not_read_but_checked(rng):
    """use_initial_state=False without in-place: the pool is ignored (zeros start) yet still validated."""
    x = _base(rng)
    a1, _ = gated_delta_rule_decode(**x, use_initial_state=False)
    a2, _ = gated_delta_rule_decode(**{**x, "state": None}, use_initial_state=False)
    np.testing.assert_array_equal(a1, a2)
    with pytest.raises(ValueError):
        gated_delta_rule_decode(**{**x, "state": x["state"][..., :8]}, use_initial_state=False)


def test_all_boolean_flag_combinations_run(rng):
    """Every combination of the boolean options runs and agrees with the driver (small sizes)."""
    names = ["use_qk_l2norm", "use_gate_in_kernel", "use_lower_bound", "apply_beta_sigmoid", "allow_neg_eigval",
             "use_initial_state", "state_v_first"]
    for values in itertools.product([False, True], repeat=len(names)):
        opts = dict(zip(names, values))
        x = decode_inputs(rng, 2, 2, H=1, HV=2, V=4, state_v_first=opts["state_v_first"])
        x["q"] = (x["q"].astype(np.float32) / 3).astype(BF16)
        x["k"] = (x["k"].astype(np.float32) / 3).astype(BF16)
        check(x, dict(opts, store_final_state=True))


def test_is_varlen_flag(rng):
    """is_varlen=False ignores a given cu_seqlens; is_varlen=None follows its presence."""
    x = decode_inputs(rng, 1, 5, P=2, lens=None)
    base, _ = gated_delta_rule_decode(**x, store_final_state=True)
    cu = np.array([0, 2, 5], np.int32)
    same, _ = gated_delta_rule_decode(**{**x, "cu_seqlens": cu}, is_varlen=False, store_final_state=True)
    np.testing.assert_array_equal(base, same)
    split, fin = gated_delta_rule_decode(**{**x, "cu_seqlens": cu}, store_final_state=True)
    assert fin.shape[0] == 2
    ref, _, ref_fin = kda_decode(**{**x, "cu_seqlens": cu}, store_final_state=True)
    assert rel(split, ref) < 1e-2 and rel(fin, ref_fin) < 1e-6
    assert not np.array_equal(split[:, 2:], base[:, 2:])  # sequence 1 restarts from slot 1


# ----------------------------------------------------------------------------- the kernels' contract, both paths

I32_MAX = 2**31 - 1


def _huge(shape, dtype):
    """A read-only array of ``shape`` over one element (zero strides): big shapes, no memory."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, (0,) * len(shape), writeable=False)


def _contract_case(name):
    """Inputs (NumPy) of a request only the kernels' contract refuses."""
    rng = np.random.default_rng(0)
    if name == "K-64":
        return decode_inputs(rng, 2, 1, K=64), {}
    if name == "kfirst-f32-V6":
        return decode_inputs(rng, 2, 1, V=6, state_v_first=False), dict(state_v_first=False)
    if name == "kfirst-bf16-V12":
        return (decode_inputs(rng, 2, 1, V=12, state_v_first=False, state_dtype=BF16), dict(state_v_first=False))
    if name == "tokens-32bit":  # T * HV * K = 2**31
        T, HV = 2**24, 1
        x = dict(q=_huge((1, T, 1, 128), BF16), k=_huge((1, T, 1, 128), BF16), v=_huge((1, T, HV, 16), BF16),
                 state=np.zeros((1, HV, 16, 128), np.float32), A_log=None, a=_huge((1, T, HV, 128), BF16),
                 dt_bias=None, num_accepted_tokens=None, cu_seqlens=None, b=_huge((1, T, HV), BF16))
        return x, {}
    if name == "grid-32bit":  # N * HV * ceil(V / 16) = 2**31
        N, V = 2**27, 256
        x = dict(q=_huge((N, 1, 1, 128), BF16), k=_huge((N, 1, 1, 128), BF16), v=_huge((N, 1, 1, V), BF16),
                 state=_huge((N, 1, V, 128), np.float32), A_log=None, a=_huge((N, 1, 1, 128), BF16),
                 dt_bias=None, num_accepted_tokens=None, cu_seqlens=None, b=_huge((N, 1, 1), BF16))
        return x, {}
    raise KeyError(name)


CONTRACT = ["K-64", "kfirst-f32-V6", "kfirst-bf16-V12", "tokens-32bit", "grid-32bit"]


@pytest.mark.parametrize("name", CONTRACT)
def test_kernel_contract_is_refused_for_host_inputs(name):
    x, opts = _contract_case(name)
    with pytest.raises(NotImplementedError):
        gated_delta_rule_decode(**x, **opts)


@pytest.mark.torch
@pytest.mark.parametrize("name", CONTRACT)
def test_kernel_contract_is_refused_for_cuda_inputs(name):
    """The same requests on (stand-in) CUDA tensors: the same exception from validation."""
    x, opts = _contract_case(name)
    with pytest.raises(NotImplementedError):
        _validate(**{n: fake_cuda(a) for n, a in x.items()}, **opts)


def test_kernel_contract_edges_are_accepted(rng):
    """K-first V multiples of 4 (fp32) / 8 (bf16) run; V-first takes any V."""
    for V, sdt, v_first in ((4, F32, False), (8, BF16, False), (6, F32, True), (5, BF16, True)):
        x = decode_inputs(rng, 2, 1, V=V, state_dtype=sdt, state_v_first=v_first)
        check(x, dict(state_v_first=v_first, store_final_state=True))


# ----------------------------------------------------------------------------- the CUDA path's validation (no GPU)


_PUBLIC_DEFAULTS = dict(state_indices=None, scale=None, output=None, use_qk_l2norm=None, lower_bound=None,
                        use_gate_in_kernel=None, use_lower_bound=None, apply_beta_sigmoid=None,
                        allow_neg_eigval=None, use_initial_state=None, state_v_first=None, is_varlen=None,
                        store_final_state=False, inplace_final_state=False, state_dtype=None)


def _validate(**kw):
    from mate_cupy.kda import decode

    return decode.validate(**{**_PUBLIC_DEFAULTS, **kw})


def _cuda_inputs(rng, B=3, T=1, P=5, **kw):
    x = decode_inputs(rng, B, T, P=P, **kw)
    return {n: fake_cuda(a) for n, a in x.items()}


@pytest.mark.torch
def test_validate_signature_matches_the_public_function():
    import inspect

    from mate_cupy.kda import decode

    public = inspect.signature(gated_delta_rule_decode).parameters
    assert list(inspect.signature(decode.validate).parameters) == list(public)
    assert {n: p.default for n, p in public.items() if p.default is not inspect.Parameter.empty} == _PUBLIC_DEFAULTS


@pytest.mark.torch
def test_cuda_problem_and_kernel_arguments(rng):
    """Contiguous CUDA inputs: nothing staged, contiguous strides; the packed arguments."""
    from mate_cupy.kda import decode_launch as dl

    x = _cuda_inputs(rng, B=3, T=2, P=8)
    si = fake_cuda(np.zeros((3, 2), np.int64))
    out = fake_cuda(np.zeros((3, 2, 4, 16), np.float32))
    call, p = _validate(**x, state_indices=si, output=out, inplace_final_state=True, use_lower_bound=True)
    assert p.device == 0 and (p.B, p.T, p.H, p.K, p.HV, p.V, p.N) == (3, 2, 2, 128, 4, 16, 3)
    assert p.staged == () and p.slot_columns == 2 and p.pool_size == 8 and p.index_dtype == np.int64
    assert p.token_strides == (2 * 2 * 128, 2 * 128, 128) * 2 + (2 * 4 * 16, 4 * 16, 16) + (2 * 4 * 128, 4 * 128, 128) \
        + (2 * 4, 4, 1)
    assert p.out_dtype == F32 and p.qkv_dtype == BF16 and p.dt_bias_dtype == F32 and p.has_A_log
    assert p.scale == 128 ** -0.5 and p.lower_bound == -5.0
    hash(p)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.T = 3
    assert _validate(**x, state_indices=si, output=out, inplace_final_state=True, use_lower_bound=True)[1] == p

    cfg = dl.select_config(p, 132, 90)
    ptrs = {name: arg.ptr for name, arg in call.args.items()}
    values = dl.kernel_values(p, cfg, ptrs)
    assert len(dl.PARAMS.pack(values)) == 8 * 14 + 4 * 27  # 13 pointers + pool_size, 27 four-byte values
    named = dict(zip(dl.PARAMS.names, values))
    assert named["q"] == x["q"].data_ptr() and named["out"] == out.data_ptr() and named["final_state"] == 0
    assert named["state"] == x["state"].data_ptr() and named["pool_size"] == 8
    assert (named["N"], named["T"], named["H"], named["HV"], named["V"], named["idx_cols"]) == (3, 2, 2, 4, 16, 2)
    flags = named["flags"]
    for bit in (dl.F_L2NORM, dl.F_GATE_IN_KERNEL, dl.F_LOWER_BOUND, dl.F_INITIAL_STATE, dl.F_INPLACE, dl.F_IDX64,
                dl.F_BULK):
        assert flags & bit
    for bit in (dl.F_VARLEN, dl.F_BETA_SIGMOID, dl.F_NEG_EIGVAL, dl.F_BETA_PER_CHANNEL, dl.F_HAS_ACCEPTED):
        assert not flags & bit
    # q/k/v bf16 (2), a bf16, b bf16, dt_bias float32 (0), out float32 (0)
    assert named["dtypes"] == 2 | 2 << 2 | 2 << 4 | 2 << 6 | 2 << 8
    assert (named["n_splits"], named["tc"]) == (cfg.n_splits, 2) and cfg.grid == 3 * 4 * cfg.n_splits


@pytest.mark.torch
def test_cuda_without_pool_use_passes_no_pool(rng):
    from mate_cupy.kda import decode_launch as dl

    x = _cuda_inputs(rng)
    x["state"] = fake_cuda(np.zeros((5, 4, 16, 128), np.float32), misalign=4)  # not read: not checked
    call, p = _validate(**x, use_initial_state=False, store_final_state=True)
    ptrs = {n: a.ptr for n, a in call.args.items()}
    ptrs.update(output=0x1000, final_state=0x2000)  # results allocated by the launcher
    named = dict(zip(dl.PARAMS.names, dl.kernel_values(p, dl.select_config(p, 132, 90), ptrs)))
    assert named["state"] == 0 and named["pool_size"] == dl.NO_POOL and p.staged == ()
    assert named["final_state"] == 0x2000 and p.final_shape == (3, 4, 16, 128)


@pytest.mark.torch
def test_cuda_strided_views_are_indexed_not_staged(rng):
    """q/k/v views of one packed projection keep their strides; an extent-1 dim may have any stride."""
    B, T, H, HV, K, V = 3, 2, 2, 4, 128, 16
    x = _cuda_inputs(rng, B=B, T=T)
    row = H * K * 2 + HV * V
    x["q"] = fake_cuda(np.zeros((B, T, H, K), BF16), stride=(T * row, row, K, 1))
    x["k"] = fake_cuda(np.zeros((B, T, H, K), BF16), stride=(T * row, row, K, 1))
    x["v"] = fake_cuda(np.zeros((B, T, HV, V), BF16), stride=(T * row, row, V, 1))
    x["b"] = fake_cuda(np.zeros((B, T, HV), BF16), stride=(T * 2 * HV, 2 * HV, 2))  # no contiguous dim needed
    _, p = _validate(**x)
    assert p.staged == ()
    assert p.token_strides[:9] == (T * row, row, K) * 2 + (T * row, row, V)
    assert p.token_strides[12:] == (T * 2 * HV, 2 * HV, 2)
    x1 = _cuda_inputs(rng, B=1, T=1)
    x1["q"] = fake_cuda(np.zeros((1, 1, H, K), BF16), stride=(-5, 2**40, K, 1))  # contiguous: extent-1 dims
    _, p1 = _validate(**x1)
    assert p1.staged == () and p1.token_strides[:3] == (H * K, H * K, K)


@pytest.mark.torch
def test_cuda_layouts_the_kernel_cannot_index_are_staged(rng):
    x = _cuda_inputs(rng, B=3, T=1, P=5)
    x["q"] = fake_cuda(np.zeros((3, 1, 2, 128), BF16), stride=(512, 512, 1, 2))  # last dim not contiguous
    x["a"] = fake_cuda(np.zeros((3, 1, 4, 128), BF16), stride=(-512, 512, 128, 1))  # negative stride
    x["A_log"] = fake_cuda(np.zeros(4, np.float32), stride=(2,))
    x["state"] = fake_cuda(np.zeros((5, 4, 16, 128), np.float32), stride=(2 * 4 * 16 * 128, 16 * 128, 128, 1))
    out = fake_cuda(np.zeros((3, 1, 4, 16), BF16), stride=(128, 64, 16, 1))
    si = fake_cuda(np.zeros(3, np.int32), stride=(2,))
    _, p = _validate(**x, output=out, state_indices=si, inplace_final_state=True)
    assert set(p.staged) == {"q", "a", "A_log", "state_indices", "output", "state"}
    assert p.token_strides[:3] == (256, 256, 128) and p.token_strides[9:12] == (512, 512, 128)
    _, p2 = _validate(**x, output=out, state_indices=si, use_initial_state=False)  # the pool is not used
    assert "state" not in p2.staged


@pytest.mark.torch
def test_cuda_misaligned_pool_is_refused(rng):
    """Alignment is a fact of CUDA memory (host inputs have no such condition)."""
    x = _cuda_inputs(rng)
    x["state"] = fake_cuda(np.zeros((5, 4, 16, 128), np.float32), misalign=4)
    with pytest.raises(ValueError, match="16-byte aligned"):
        _validate(**x)
    with pytest.raises(ValueError, match="16-byte aligned"):
        _validate(**x, use_initial_state=False, inplace_final_state=True)
    _validate(**x, use_initial_state=False)  # not read nor written: not checked


@pytest.mark.torch
def test_cuda_and_host_inputs_are_refused_alike(rng):
    """Every refusal of the host table raises the same exception type for CUDA inputs,
    except the value checks of host index arrays (CUDA indices are not read on the host)."""
    value_checks = {"cu_seqlens-values", "num_accepted-zero", "num_accepted-too-large", "slot-out-of-range",
                    "token-slot-out-of-range", "token-slot-out-of-range-store", "varlen-few-columns-inplace"}
    for case in ERRORS:
        if case.id in value_checks:
            continue
        mutate, opts, exc = case.values
        x = mutate(_base(rng))
        fx = {n: (fake_cuda(a) if isinstance(a, np.ndarray) else a) for n, a in x.items()}
        fo = {n: (fake_cuda(a) if isinstance(a, np.ndarray) else a) for n, a in opts.items()}
        with pytest.raises(exc):
            _validate(**fx, **fo)


# ----------------------------------------------------------------------------- launch configuration


def _problem(rng, B=32, HV=32, H=16, V=128, T=1, sdt=F32, v_first=True, token_slots=False):
    """The problem of a CUDA call of these sizes (stand-in tensors, no memory); with
    ``token_slots`` in place with ``[B, T]`` slots (a state written per token)."""
    K = 128

    def t(*shape, dtype=BF16):
        return fake_cuda(_huge(shape, dtype), stride=tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape))))

    P = B * T if token_slots else B
    x = dict(q=t(B, T, H, K), k=t(B, T, H, K), v=t(B, T, HV, V), a=t(B, T, HV, K), b=t(B, T, HV),
             state=t(P, HV, V, K, dtype=sdt) if v_first else t(P, HV, K, V, dtype=sdt),
             A_log=t(HV, dtype=F32), dt_bias=t(HV, K, dtype=F32), num_accepted_tokens=None, cu_seqlens=None)
    if token_slots:
        x.update(state_indices=t(B, T, dtype=np.dtype(np.int32)), inplace_final_state=True)
    return _validate(**x, state_v_first=v_first)[1]


@pytest.mark.torch
def test_vfirst_warps_fill_the_gpu(rng):
    from mate_cupy.kda.decode_launch import select_config, vfirst_warps

    assert vfirst_warps(256 * 32, 128, 132, 16) == 4  # large batch: 4-warp CTAs
    assert vfirst_warps(64 * 32, 128, 132, 16) == 4  # 4096 CTAs >= 16 per SM
    assert vfirst_warps(32 * 32, 128, 132, 16) == 2  # B32: 2048 four-warp CTAs would be < 16 per SM
    assert vfirst_warps(8 * 32, 128, 132, 16) == 2
    assert vfirst_warps(1 * 32, 128, 132, 16) == 2  # B = 1: two warps run the prologue's two tasks side by side
    assert vfirst_warps(64 * 32, 128, 132, 32) == 2  # bf16 rows: 2048 four-warp CTAs < 16 per SM
    assert vfirst_warps(256 * 32, 128, 132, 32) == 4
    cfg = select_config(_problem(rng, B=32), 132, 90)
    assert (cfg.warps, cfg.threads, cfg.v_slice, cfg.n_splits, cfg.grid) == (2, 64, 32, 4, 32 * 32 * 4)
    assert cfg.spec.kernels == ("kda_decode::kda_decode_vfirst_kernel<float>",)
    cfg = select_config(_problem(rng, B=256, sdt=BF16), 132, 90)  # 8 bf16 rows per lane: 32 per warp
    assert (cfg.warps, cfg.threads, cfg.v_slice, cfg.n_splits, cfg.grid) == (4, 128, 128, 1, 256 * 32)
    assert cfg.spec.kernels == ("kda_decode::kda_decode_vfirst_kernel<__nv_bfloat16>",)


@pytest.mark.torch
def test_vfirst_warps_take_four_warps_for_several_tokens(rng):
    """Several tokens per sequence: four-warp CTAs at every batch (the prologue's tasks per
    token spread over four warps); one token keeps the 16-per-SM rule, never one warp."""
    from mate_cupy.kda.decode_launch import select_config, tokens_per_sequence, vfirst_warps

    assert tokens_per_sequence(_problem(rng, B=4, T=4)) == 4.0
    assert vfirst_warps(48 * 32, 128, 132, 32) == 2  # bf16 B48, one token: 1536 four-warp CTAs < 16 per SM
    assert vfirst_warps(48 * 32, 128, 132, 32, 2) == 4
    assert vfirst_warps(1 * 32, 128, 132, 16, 4) == 4  # fp32 B1, four tokens: 64 four-warp CTAs
    assert vfirst_warps(1 * 32, 128, 132, 32) == 2
    assert vfirst_warps(8 * 32, 128, 132, 32, 1.5) == 2  # (varlen: fewer than two tokens per sequence)
    assert vfirst_warps(3 * 4, 16, 132, 16, 2) == 1  # V = 16: one warp holds every row
    assert vfirst_warps(3 * 4, 64, 132, 32, 2) == 2
    assert select_config(_problem(rng, B=64, T=4, sdt=BF16, token_slots=True), 132, 90).warps == 4
    assert select_config(_problem(rng, B=2, T=2, sdt=BF16), 132, 90).warps == 4
    assert select_config(_problem(rng, B=64, T=1, sdt=BF16), 132, 90).warps == 2
    assert select_config(_problem(rng, B=1, T=1), 132, 90).warps == 2


@pytest.mark.torch
def test_vfirst_bulk_staging_only_for_whole_slices_on_sm90(rng):
    from mate_cupy.kda.decode_launch import F_BULK, select_config

    p = _problem(rng, B=2, HV=4, H=2, V=128)
    assert select_config(p, 132, 90).bulk_stage and select_config(p, 132, 90).option_flags & F_BULK
    assert not select_config(p, 132, 80).bulk_stage  # no bulk copies before sm_90
    p40 = _problem(rng, B=2, HV=4, H=2, V=40)  # a partial last slice
    cfg = select_config(p40, 132, 90)
    assert cfg.v_slice == 32 and cfg.n_splits == 2 and not cfg.bulk_stage and not cfg.option_flags & F_BULK
    assert not select_config(_problem(rng, v_first=False), 132, 90).bulk_stage  # K-first: cp.async


@pytest.mark.torch
def test_programmatic_launch_from_sm90(rng):
    from mate_cupy.kda.decode_launch import select_config

    for v_first in (True, False):
        p = _problem(rng, v_first=v_first)
        assert select_config(p, 132, 90).programmatic and select_config(p, 132, 100).programmatic
        assert not select_config(p, 108, 80).programmatic and not select_config(p, 128, 89).programmatic


@pytest.mark.torch
def test_kfirst_shape_tokens_and_shared_memory(rng):
    from mate_cupy.kda.decode_launch import K_DIM, MAX_CHUNK, select_config, smem_bytes

    for sdt, threads, cols in ((F32, 64, 32), (BF16, 128, 64)):
        cfg = select_config(_problem(rng, B=4, V=128, T=3, sdt=sdt, v_first=False), 132, 90)
        assert (cfg.threads, cfg.v_slice, cfg.n_splits, cfg.token_chunk) == (threads, cols, 128 // cols, 3)
        red = 2 * (threads // 32) * 2 * cols
        assert cfg.smem == smem_bytes(cols * K_DIM * sdt.itemsize, 3, cols, red)
        assert cfg.spec.kernels[0].startswith("kda_decode::kda_decode_kfirst_kernel<")
    cfg = select_config(_problem(rng, B=256, T=12), 132, 90)
    assert cfg.token_chunk == MAX_CHUNK and cfg.warps == 4 and cfg.smem <= 227 * 1024
    assert select_config(_problem(rng, B=0), 132, 90).grid == 0  # nothing to launch


@pytest.mark.torch
def test_select_config_is_a_pure_function_of_the_problem(rng):
    from mate_cupy.kda.decode_launch import select_config

    p, q = _problem(rng, B=8), _problem(rng, B=8)
    assert p == q and hash(p) == hash(q)
    assert select_config(p, 132, 90) is select_config(dataclasses.replace(q), 132, 90)
    assert select_config(p, 132, 90) != select_config(p, 16, 90)  # fewer SMs: smaller CTAs fill them


# ----------------------------------------------------------------------------- the launcher against the kernel source


def _source_params(kernel: str) -> list:
    """(name, kind) of each parameter of ``kernel`` in kda_decode.cu."""
    from mate_cupy.kda import decode_launch as dl

    src = Path(dl.__file__).resolve().parent.parent / "cuda_src" / dl.SOURCE
    return kernel_params(src, kernel, macros=("KDA_DECODE_KERNEL_ARGS",))


def test_kernel_params_match_the_source():
    from mate_cupy.kda import decode_launch as dl

    assert set(dl.KERNEL_PARAMS) == {"kda_decode_vfirst_kernel", "kda_decode_kfirst_kernel"}
    for kernel, params in dl.KERNEL_PARAMS.items():
        assert _source_params(kernel) == list(params.params), kernel


def test_bulk_barrier_init_is_ordered_by_a_cta_barrier():
    """The V-first kernel's mbarrier init (a warp-wide instruction) is separated from its
    first use, thread 0's arrive in bulk_load, by a CTA barrier (docs/kda_decode.md,
    "Shared-memory ordering"): program order alone leaves racecheck a hazard."""
    from mate_cupy.kda import decode_launch as dl

    src = (Path(dl.__file__).resolve().parent.parent / "cuda_src" / dl.SOURCE).read_text()
    body = src[src.index("kda_decode_vfirst_kernel(KDA_DECODE_KERNEL_ARGS)"):]
    body = body[:body.index("kda_decode_kfirst_kernel")]
    init, sync, use = (body.index(s) for s in ("mbarrier_init_one(&bulk_bar)", "if (bulk) __syncthreads();",
                                               "bulk_load("))
    assert init < sync < use


def test_decode_variants_registered():
    from mate_cupy.jit import registered
    from mate_cupy.kda import decode_launch as dl

    decode = sorted(k for s in registered() if s.source == dl.SOURCE for k in s.kernels)
    assert decode == sorted(f"kda_decode::kda_decode_{layout}_kernel<{t}>" for layout in ("vfirst", "kfirst")
                            for t in ("float", "__nv_bfloat16"))
    assert set(dl.SPECS) == {(dt, v) for dt in (F32, BF16) for v in (True, False)}


@pytest.mark.slow
def test_vfirst_kernel_spills():
    """ptxas (sm_90a, 128 registers): the fp32 V-first kernel does not spill; the bf16 one
    spills no more than the addresses docs/kda_decode.md ("Pipeline inside a CTA") accounts
    for (60 bytes stored, 44 loaded; with the lane offset held across the token loop and
    reloaded before each token's stores it loaded 68)."""
    import re

    from mate_cupy.jit import compile_variant
    from mate_cupy.kda import decode_launch as dl

    for dt, (max_st, max_ld) in ((F32, (0, 0)), (BF16, (64, 48))):
        log = compile_variant(dl.SPECS[(dt, True)], "sm_90a", ptxas_verbose=True)["log"]
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        assert len(spills) == 1, log
        st, ld = map(int, spills[0])
        assert st <= max_st and ld <= max_ld, (dt, st, ld)


def test_cuda_problems_are_reused_only_for_equal_signatures(rng, monkeypatch):
    """CUDA calls (host arrays posing as device 0 here) reuse the problem of an earlier call
    with equal array metadata and options; anything validation reads that differs gives
    a fresh check, and a refused call is refused every time."""
    from mate_cupy.kda import decode
    from mate_cupy.runtime import interop

    real_wrap = interop.wrap

    def on_device0(name, obj):
        arg = real_wrap(name, obj)
        arg.device = 0
        return arg

    monkeypatch.setattr(interop, "wrap", on_device0)
    monkeypatch.setattr(decode, "_PROBLEMS", decode.BoundedMemo(8))
    x = _base(rng)
    opts = dict(scale=None, output=None, use_qk_l2norm=None, lower_bound=None, use_gate_in_kernel=None,
                use_lower_bound=None, apply_beta_sigmoid=None, allow_neg_eigval=None, use_initial_state=None,
                state_v_first=None, is_varlen=None, store_final_state=False, inplace_final_state=False,
                state_dtype=None, state_indices=None)
    opts = {n: v for n, v in opts.items() if n not in x}
    _, p1 = decode.validate(**x, **opts)
    _, p2 = decode.validate(**{n: None if a is None else a.copy() for n, a in x.items()}, **opts)
    assert p1.device == 0 and p2 is p1 and len(decode._PROBLEMS) == 1
    _, p3 = decode.validate(**x, **{**opts, "scale": 0.5})
    assert p3 is not p1 and p3.scale == 0.5
    q_strided = np.repeat(x["q"], 2, axis=-1)[..., ::2]  # same values, every other element
    _, p4 = decode.validate(**{**x, "q": q_strided}, **opts)
    assert p4 is not p1 and "q" in p4.staged and "q" not in p1.staged
    bad = {**x, "A_log": x["A_log"].astype(np.float16)}
    for _ in range(2):
        with pytest.raises(ValueError, match="A_log"):
            decode.validate(**bad, **opts)
    assert len(decode._PROBLEMS) == 3
