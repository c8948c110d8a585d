"""The float64 KDA references checked against each other and against hand-written loops.

Before any kernel is trusted: the token-by-token definition (``kda_recurrent``) matches a
scalar loop written here from SPEC 7, and the chunked WY/UT form (``kda_chunked``, the
kernel blueprint) matches ``kda_recurrent`` on dense and varlen inputs, GVA ratios 1/2/4,
with and without gate parameters and with fp32/bf16 initial states.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from mate_cupy.reference.kda import (
    kda_chunk_gate,
    kda_chunked,
    kda_decode_beta,
    kda_decode_gate,
    kda_recurrent,
    round_bf16,
    sequence_bounds,
)

BF16 = np.dtype(ml_dtypes.bfloat16)


# ----------------------------------------------------------------------------- input builders


def kda_inputs(rng, B, T, H, HV, K=128, V=128, dtype=BF16, gate_params=False, lens=None, state=None):
    """Random chunk_kda inputs (dense ``[B, T, ...]`` or packed varlen ``[1, S, ...]`` from ``lens``).

    Returns a dict of keyword arguments for ``chunk_kda`` / ``kda_recurrent``.
    """
    if lens is not None:
        B, T = 1, int(sum(lens))
    x = dict(
        q=rng.standard_normal((B, T, H, K)).astype(dtype),
        k=rng.standard_normal((B, T, H, K)).astype(dtype),
        v=rng.standard_normal((B, T, HV, V)).astype(dtype),
        beta=rng.standard_normal((B, T, HV)).astype(dtype),
    )
    if gate_params:
        x["g"] = rng.standard_normal((B, T, HV, K)).astype(dtype)
        x["A_log"] = rng.uniform(-1.0, 1.0, HV).astype(np.float32)
        x["dt_bias"] = rng.standard_normal((HV, K)).astype(np.float32)
    else:  # log-space decay, mostly mild, some strong
        x["g"] = (-np.abs(rng.standard_normal((B, T, HV, K))) * rng.uniform(0.01, 1.0, (1, 1, HV, 1))).astype(dtype)
    N = B
    if lens is not None:
        x["cu_seqlens"] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        N = len(lens)
    if state is not None:
        x["initial_state"] = (0.5 * rng.standard_normal((N, HV, V, K))).astype(state)
    return x


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    den = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (den if den > 0 else 1.0))


# ----------------------------------------------------------------------------- definition


def _scalar_loop(q, k, v, g, beta, scale, S0, A_log=None, dt_bias=None, lower_bound=-5.0, l2=True):
    """SPEC 7 written with Python loops over every index (tiny sizes only). Dense inputs."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    r = HV // H
    o = np.zeros((B, T, HV, V))
    S = np.array(S0, np.float64)
    for b in range(B):
        for hv in range(HV):
            h = hv // r
            for t in range(T):
                qt, kt = q[b, t, h].copy(), k[b, t, h].copy()
                if l2:
                    qt /= math.sqrt(sum(x * x for x in qt) + 1e-6)
                    kt /= math.sqrt(sum(x * x for x in kt) + 1e-6)
                gk = np.empty(K)
                for c in range(K):
                    if A_log is None:
                        gk[c] = g[b, t, hv, c]
                    else:
                        z = math.exp(A_log[hv]) * (g[b, t, hv, c] + dt_bias[hv, c])
                        gk[c] = lower_bound / (1.0 + math.exp(-z))
                bt = 1.0 / (1.0 + math.exp(-beta[b, t, hv]))
                for i in range(V):
                    for c in range(K):
                        S[b, hv, i, c] *= math.exp(gk[c])
                for i in range(V):
                    err = v[b, t, hv, i] - sum(S[b, hv, i, c] * kt[c] for c in range(K))
                    for c in range(K):
                        S[b, hv, i, c] += bt * err * kt[c]
                for i in range(V):
                    o[b, t, hv, i] = scale * sum(S[b, hv, i, c] * qt[c] for c in range(K))
    return o, S


@pytest.mark.parametrize("gate_params", [False, True], ids=["logdecay", "gateparams"])
@pytest.mark.parametrize("l2", [True, False], ids=["l2", "nol2"])
def test_recurrent_matches_scalar_loop(rng, gate_params, l2):
    B, T, H, HV, K, V = 2, 5, 1, 2, 4, 3
    x = kda_inputs(rng, B, T, H, HV, K, V, dtype=np.float64, gate_params=gate_params, state=np.float64)
    o, S = kda_recurrent(**x, scale=0.7, use_qk_l2norm=l2)
    o2, S2 = _scalar_loop(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.7, x["initial_state"],
                          x.get("A_log"), x.get("dt_bias"), l2=l2)
    np.testing.assert_allclose(o, o2, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(S, S2, rtol=1e-12, atol=1e-12)


def test_single_token_closed_form(rng):
    """From a zero state one token gives S = b v k^T and o = b v (k.q) scale."""
    x = kda_inputs(rng, 1, 1, 1, 1, 8, 8, dtype=np.float64)
    o, S = kda_recurrent(**x, use_qk_l2norm=False)
    b = 1.0 / (1.0 + np.exp(-x["beta"][0, 0, 0]))
    qv, kv, vv = x["q"][0, 0, 0], x["k"][0, 0, 0], x["v"][0, 0, 0]
    np.testing.assert_allclose(S[0, 0], b * np.outer(vv, kv), rtol=1e-13)
    np.testing.assert_allclose(o[0, 0, 0], b * vv * (kv @ qv) * 8 ** -0.5, rtol=1e-13)


def test_default_scale_and_lower_bound(rng):
    x = kda_inputs(rng, 1, 6, 2, 2, 16, 16, dtype=np.float64, gate_params=True)
    o1, s1 = kda_recurrent(**x)
    o2, s2 = kda_recurrent(**x, scale=16 ** -0.5, lower_bound=-5.0)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(s1, s2)


def test_gate_formulas():
    g = np.array([[[-1.0, 0.5], [2.0, -3.0]]])  # [1, HV=2, K=2]
    A_log = np.array([0.3, -0.2], np.float32)
    dt = np.array([[0.1, -0.1], [0.0, 0.5]], np.float32)
    z = np.exp(A_log.astype(np.float64))[:, None] * (g + dt.astype(np.float64))
    np.testing.assert_allclose(kda_chunk_gate(g, A_log, dt, -4.0), -4.0 / (1 + np.exp(-z)), rtol=1e-14)
    np.testing.assert_array_equal(kda_chunk_gate(g), g)
    np.testing.assert_allclose(
        kda_decode_gate(g, A_log, dt), -np.exp(A_log.astype(np.float64))[:, None] * np.log1p(np.exp(g + dt)), rtol=1e-14
    )
    np.testing.assert_allclose(kda_decode_gate(g, None, None), -np.log1p(np.exp(g)), rtol=1e-14)
    np.testing.assert_allclose(kda_decode_gate(g, A_log, dt, use_lower_bound=True), -5.0 / (1 + np.exp(-z)), rtol=1e-14)
    np.testing.assert_array_equal(kda_decode_gate(g, A_log, dt, use_gate_in_kernel=False), g)
    b = np.array([-1.0, 0.0, 2.0])
    np.testing.assert_allclose(kda_decode_beta(b, apply_beta_sigmoid=True), 1 / (1 + np.exp(-b)))
    np.testing.assert_allclose(kda_decode_beta(b, allow_neg_eigval=True), 2 * b)
    np.testing.assert_allclose(kda_decode_beta(b, apply_beta_sigmoid=True, allow_neg_eigval=True), 2 / (1 + np.exp(-b)))
    with pytest.raises(ValueError):
        kda_chunk_gate(g, A_log, None)


def test_round_bf16_is_nearest_even():
    x = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5e-3, 3.0e38])
    r = round_bf16(x)
    assert r[0] == 1.0 and r[1] == 1.0 and r[2] == 1.0 + 2 ** -6
    np.testing.assert_array_equal(r, x.astype(np.float32).astype(BF16).astype(np.float64))


def test_sequence_bounds_checks():
    assert sequence_bounds(np.array([0, 3, 3, 7]), 7) == [(0, 3), (3, 3), (3, 7)]
    assert sequence_bounds(np.array([0]), 0) == []
    for bad in ([1, 3], [0, 4, 2, 7], [0, 3, 6]):
        with pytest.raises(ValueError):
            sequence_bounds(np.array(bad), 7)
    with pytest.raises(ValueError):
        sequence_bounds(np.zeros((2, 2), np.int32), 0)


# ----------------------------------------------------------------------------- recurrent vs chunked

CASES = [
    pytest.param(dict(B=2, T=150, H=2, HV=2), id="dense-T150-gva1"),
    pytest.param(dict(B=1, T=129, H=2, HV=4), id="dense-T129-gva2"),
    pytest.param(dict(B=2, T=64, H=1, HV=4), id="dense-T64-gva4"),
    pytest.param(dict(B=3, T=1, H=2, HV=4), id="dense-T1"),
    pytest.param(dict(lens=[0, 1, 63, 64, 65, 130, 7], H=2, HV=2), id="varlen-uneven-gva1"),
    pytest.param(dict(lens=[200, 0, 33], H=1, HV=2), id="varlen-gva2"),
    pytest.param(dict(lens=[5, 128, 0], H=1, HV=4), id="varlen-gva4"),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("gate_params", [False, True], ids=["logdecay", "gateparams"])
@pytest.mark.parametrize("state", [None, np.float32, BF16], ids=["nostate", "state-f32", "state-bf16"])
def test_chunked_matches_recurrent(rng, case, gate_params, state):
    case = dict(case)
    lens = case.pop("lens", None)
    B, T = case.pop("B", 1), case.pop("T", 0)
    x = kda_inputs(rng, B, T, case["H"], case["HV"], gate_params=gate_params, lens=lens, state=state)
    o1, s1 = kda_recurrent(**x)
    o2, s2 = kda_chunked(**x)
    assert o1.shape == x["v"].shape and s1.shape == s2.shape
    assert rel(o2, o1) < 1e-12, rel(o2, o1)
    assert rel(s2, s1) < 1e-12, rel(s2, s1)
    assert np.isfinite(o2).all() and np.isfinite(s2).all()


@pytest.mark.parametrize("chunk_size", [1, 16, 37, 64])
@pytest.mark.parametrize("l2", [True, False], ids=["l2", "nol2"])
def test_chunked_any_chunk_size(rng, chunk_size, l2):
    x = kda_inputs(rng, 2, 100, 2, 4, 32, 16, dtype=np.float64, state=np.float64)
    if not l2:
        x["k"] = x["k"] / np.sqrt(32)  # keep the un-normalised recurrence contractive
    o1, s1 = kda_recurrent(**x, use_qk_l2norm=l2)
    o2, s2 = kda_chunked(**x, use_qk_l2norm=l2, chunk_size=chunk_size)
    assert rel(o2, o1) < 1e-11 and rel(s2, s1) < 1e-11


def test_chunked_strong_decay_does_not_overflow(rng):
    """exp(-G) over a 64-token chunk at -30 per token is exp(1920): must never be formed."""
    x = kda_inputs(rng, 1, 130, 1, 2, 64, 64, dtype=np.float64, state=np.float64)
    x["g"] = np.full_like(x["g"], -30.0)
    x["g"][..., ::3] = -1e-3  # some channels barely decay
    with np.errstate(over="raise", invalid="raise"):
        o2, s2 = kda_chunked(**x)
    o1, s1 = kda_recurrent(**x)
    assert np.isfinite(o2).all()
    assert rel(o2, o1) < 1e-12 and rel(s2, s1) < 1e-12


def test_lower_bound_gate_long_sequence(rng):
    """The bounded gate at its floor (-5 per token) over 300 tokens stays exact in float64."""
    x = kda_inputs(rng, 1, 300, 2, 2, gate_params=True, dtype=np.float64)
    x["A_log"] = np.full(2, 3.0, np.float32)  # exp(A) * (g + bias) large: gate near lower_bound
    o1, s1 = kda_recurrent(**x)
    o2, s2 = kda_chunked(**x)
    assert rel(o2, o1) < 1e-12 and rel(s2, s1) < 1e-12


def test_varlen_equals_separate_dense_runs(rng):
    lens = [3, 0, 70, 64]
    x = kda_inputs(rng, 0, 0, 2, 4, gate_params=True, lens=lens, state=np.float32)
    o, s = kda_chunked(**x)
    cu = x["cu_seqlens"]
    for n, L in enumerate(lens):
        sl = slice(cu[n], cu[n + 1])
        part = {key: x[key][:, sl] for key in ("q", "k", "v", "g", "beta")}
        on, sn = kda_recurrent(**part, initial_state=x["initial_state"][n:n + 1], A_log=x["A_log"],
                               dt_bias=x["dt_bias"])
        assert rel(o[:, sl], on) < 1e-12
        assert rel(s[n], sn[0]) < 1e-12
    np.testing.assert_array_equal(s[1], x["initial_state"][1].astype(np.float64))  # empty: unchanged


def test_packed_3d_varlen_layout(rng):
    x = kda_inputs(rng, 0, 0, 1, 2, 16, 16, lens=[4, 9])
    o4, s4 = kda_recurrent(**x)
    x3 = {key: (val[0] if key in ("q", "k", "v", "g", "beta") else val) for key, val in x.items()}
    o3, s3 = kda_chunked(**x3)
    assert o3.shape == x3["v"].shape
    assert rel(o3, o4[0]) < 1e-12 and rel(s3, s4) < 1e-12


def test_per_channel_beta_and_raw_beta(rng):
    """The decode extensions of kda_recurrent: per-channel beta equals per-head when constant."""
    x = kda_inputs(rng, 2, 5, 1, 2, 8, 4, dtype=np.float64)
    b = 1 / (1 + np.exp(-x["beta"]))
    o1, s1 = kda_recurrent(**x)
    o2, s2 = kda_recurrent(**{**x, "beta": b}, beta_sigmoid=False)
    o3, s3 = kda_recurrent(**{**x, "beta": np.repeat(b[..., None], 4, -1)}, beta_sigmoid=False)
    assert rel(o2, o1) < 1e-14 and rel(o3, o1) < 1e-14 and rel(s3, s1) < 1e-14
    with pytest.raises(ValueError):
        kda_chunked(**{**x, "beta": np.repeat(b[..., None], 4, -1)}, beta_sigmoid=False)
