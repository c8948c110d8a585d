"""``gated_delta_rule_decode`` on the GPU against the float64 reference ``kda_decode``.

Every case draws fresh random inputs, poisons the output with NaN, runs the CUDA kernel
through the public API on CuPy arrays and checks:

* the output against the reference (relative RMS error per the output/state dtype;
  padding rows exactly zero, nothing left NaN);
* in place: every pool slot the reference writes, within tolerance, and every other slot
  (spare slots, slots of padding sequences and tokens) bit-identical to before;
* ``store_final_state``: the returned state against the reference.

Out-of-pool slots are padding for the kernel; the reference (which raises on them) runs
on indices where those slots read as -1, which is the same contract.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

import ml_dtypes
import numpy as np
import pytest

from helpers import rel_err, side_stream, torch_side_stream
from mate_cupy.reference.kda import kda_decode

K = 128
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


@dataclass(frozen=True)
class Case:
    """One decode configuration. Defaults: single-token serving step, fp32 pool in place."""

    B: int = 4  # sequences (dense); ignored when `lens` is given
    T: int = 1
    H: int = 2
    HV: int = 4
    V: int = 128
    dtype: str = "bfloat16"  # q, k, v
    a_dtype: Optional[str] = None  # default q's dtype
    b_dtype: Optional[str] = None
    out_dtype: Optional[str] = None  # preallocated output dtype; None: allocated by the API (q's dtype)
    state_dtype: str = "float32"
    v_first: bool = True
    beta_per_channel: bool = False
    gate_in_kernel: bool = True
    lower_bound: bool = False
    A_log: bool = True
    dt_bias: bool = True
    dt_bias_dtype: str = "float32"
    l2norm: bool = True
    beta_sigmoid: bool = True
    neg_eig: bool = False
    initial_state: bool = True
    inplace: bool = True
    store_final: bool = False
    slots: str = "1d"  # none | 1d | 2d | spec
    extra_cols: int = 0  # [N, C] with C = tokens + extra_cols
    lens: Optional[Tuple[int, ...]] = None  # varlen sequence lengths
    pad_seq: bool = False  # some sequences get a negative read slot
    pad_tok: bool = False  # some tokens get a negative slot ([N, C] only)
    oob: bool = False  # some slots past the pool
    idx64: bool = False
    spare: int = 3  # pool slots nobody uses (must stay bit-identical)
    scale: Optional[float] = None


@dataclass
class Prepared:
    args: dict  # positional-ish arguments of gated_delta_rule_decode (NumPy)
    kwargs: dict  # keyword options
    out_shape: tuple
    out_dtype: np.dtype
    ref_out: np.ndarray
    ref_pool: Optional[np.ndarray]  # pool after in-place writes (float64), or None
    ref_final: Optional[np.ndarray]
    pool0: Optional[np.ndarray]  # the pool before the call (state dtype)


def _rand(rng, shape, dtype, scale=1.0, loc=0.0):
    return (rng.standard_normal(shape) * scale + loc).astype(DTYPES[dtype])


def build_case(c: Case, rng) -> Prepared:
    """Random inputs for case ``c`` and the reference results."""
    varlen = c.lens is not None
    if varlen:
        N, total = len(c.lens), int(sum(c.lens))
        B, T = 1, total
        cu = np.concatenate([[0], np.cumsum(c.lens)]).astype(np.int32)
        tokens = max(c.lens) if c.lens else 0
    else:
        N, B, T = c.B, c.B, c.T
        cu = None
        tokens = T
    H, HV, V = c.H, c.HV, c.V
    qk_scale = 1.0 if c.l2norm else K ** -0.5  # keep |k| ~ 1 without the norm (a stable recurrence)
    q = _rand(rng, (B, T, H, K), c.dtype, qk_scale)
    k = _rand(rng, (B, T, H, K), c.dtype, qk_scale)
    v = _rand(rng, (B, T, HV, V), c.dtype)
    a_dt = c.a_dtype or c.dtype
    if c.gate_in_kernel:
        a = _rand(rng, (B, T, HV, K), a_dt)
    else:  # a is the log decay itself: negative, moderate
        a = (-np.abs(rng.standard_normal((B, T, HV, K))) * 0.3).astype(DTYPES[a_dt])
    b_dt = c.b_dtype or c.dtype
    b_shape = (B, T, HV, V) if c.beta_per_channel else (B, T, HV)
    b = _rand(rng, b_shape, b_dt) if c.beta_sigmoid else rng.uniform(0.0, 1.0, b_shape).astype(DTYPES[b_dt])
    A_log = (rng.standard_normal(HV) * 0.5).astype(np.float32) if c.A_log else None
    dt_bias = _rand(rng, (HV, K), c.dt_bias_dtype, 0.5) if c.dt_bias else None

    # Slots.
    C = tokens + c.extra_cols
    if c.slots == "none":
        used, P = N, N + c.spare
    elif c.slots == "1d":
        used = N
    else:
        used = N * max(C, 1)
    if c.slots != "none":
        P = used + c.spare
    perm = rng.permutation(P)
    si = na = None
    idx_dt = np.int64 if c.idx64 else np.int32
    if c.slots == "1d":
        si = perm[:N].astype(idx_dt)
    elif c.slots in ("2d", "spec"):
        si = perm[: N * C].reshape(N, C).astype(idx_dt)
    if c.slots == "spec":
        na = rng.integers(1, C + 1, size=N).astype(idx_dt)
    read_col = None
    if c.slots in ("2d", "spec"):
        read_col = (na - 1) if na is not None else np.zeros(N, dtype=np.int64)
    # Padding / out-of-range slots, and the reference's view of them (-1).
    si_ref = None if si is None else si.copy()
    if c.pad_seq and si is not None:
        for n in range(0, N, 3):  # sequences 0, 3, ...
            if si.ndim == 1:
                si[n] = si_ref[n] = -1
            else:
                si[n, read_col[n]] = si_ref[n, read_col[n]] = -1
    if c.pad_tok and si is not None and si.ndim == 2 and C > 1:
        for n in range(1, N, 2):
            t = int(rng.integers(0, C))
            if t != read_col[n]:
                si[n, t] = si_ref[n, t] = -1
    if c.oob and si is not None:
        n = N - 1
        if si.ndim == 1:
            si[n] = P + 7
            si_ref[n] = -1
        else:
            si[n, read_col[n]] = P + 7  # the read slot: the whole sequence is padding
            si_ref[n, read_col[n]] = -1
            if N > 1 and C > 1 and c.inplace:
                m = N - 2
                t = (int(read_col[m]) + 1) % C
                si[m, t] = P + 11  # an in-place write slot: that token is padding
                si_ref[m, t] = -1
    pool = None
    if c.initial_state or c.inplace:
        shape = (P, HV, V, K) if c.v_first else (P, HV, K, V)
        pool = _rand(rng, shape, c.state_dtype, 0.5)
    out_dtype = DTYPES[c.out_dtype] if c.out_dtype else DTYPES[c.dtype]

    args = dict(q=q, k=k, v=v, state=pool, A_log=A_log, a=a, dt_bias=dt_bias, num_accepted_tokens=na,
                cu_seqlens=cu, b=b)
    kwargs = dict(state_indices=si, scale=c.scale, use_qk_l2norm=c.l2norm, lower_bound=-5.0 if c.lower_bound else None,
                  use_gate_in_kernel=c.gate_in_kernel, use_lower_bound=c.lower_bound,
                  apply_beta_sigmoid=c.beta_sigmoid, allow_neg_eigval=c.neg_eig,
                  use_initial_state=c.initial_state, state_v_first=c.v_first,
                  store_final_state=c.store_final, inplace_final_state=c.inplace,
                  state_dtype=c.state_dtype)
    ref_args = dict(args)
    ref_kwargs = dict(kwargs, state_indices=si_ref)
    ref_out, ref_pool, ref_final = kda_decode(**ref_args, **ref_kwargs)
    return Prepared(args, kwargs, (B, T, HV, V), out_dtype, ref_out, ref_pool, ref_final,
                    None if pool is None else pool.copy())


def tolerances(c: Case) -> Tuple[float, float]:
    """(output, state) relative RMS tolerances."""
    out = {"float32": 2e-4, "float16": 1e-3, "bfloat16": 5e-3}[c.out_dtype or c.dtype]
    state = 2e-4 if c.state_dtype == "float32" else 5e-3
    return out, state


def check_results(c: Case, prep: Prepared, out, pool_after, final) -> None:
    """Compare host copies of the kernel's results with the reference."""
    out_tol, state_tol = tolerances(c)
    out = np.asarray(out).astype(np.float64)
    assert not np.isnan(out).any(), "output elements left unwritten (NaN)"
    zero_rows = np.all(prep.ref_out == 0, axis=-1)
    assert np.all(out[zero_rows] == 0), "padding outputs must be exactly zero"
    e = rel_err(out, prep.ref_out)
    assert e <= out_tol, f"output relative error {e:.3e} > {out_tol:.1e}"
    if c.inplace:
        pool0 = prep.pool0
        ref = prep.ref_pool
        written = np.array([not np.array_equal(ref[p], pool0[p].astype(np.float64)) for p in range(pool0.shape[0])])
        untouched = ~written
        got = np.asarray(pool_after)
        u = untouched.nonzero()[0]
        assert np.array_equal(got[u].view(np.uint8), pool0[u].view(np.uint8)), (
            f"pool slots {u[[not np.array_equal(got[i].view(np.uint8), pool0[i].view(np.uint8)) for i in u]].tolist()} "
            "must be untouched")
        w = written.nonzero()[0]
        if len(w):
            e = rel_err(got[w].astype(np.float64), ref[w])
            assert e <= state_tol, f"pool (slots {w.tolist()}) relative error {e:.3e} > {state_tol:.1e}"
    if c.store_final and not c.inplace:
        got = np.asarray(final).astype(np.float64)
        e = rel_err(got, prep.ref_final)
        assert e <= state_tol, f"final state relative error {e:.3e} > {state_tol:.1e}"
        zero_seq = np.all(prep.ref_final == 0, axis=(1, 2, 3))
        assert np.all(got[zero_seq] == 0), "padding sequences must have a zero final state"


# ------------------------------------------------------------------ the case grid

_BASE = Case()
CASES = {
    # single-token serving (1-D slots, in place), every layout / state dtype
    "t1_f32_vfirst": _BASE,
    "t1_bf16_vfirst": replace(_BASE, state_dtype="bfloat16"),
    "t1_f32_kfirst": replace(_BASE, v_first=False),
    "t1_bf16_kfirst": replace(_BASE, state_dtype="bfloat16", v_first=False),
    "t1_fp16_inputs": replace(_BASE, dtype="float16"),
    "t1_large_batch": replace(_BASE, B=70, HV=8, H=2),
    "t1_gva4": replace(_BASE, H=1, HV=4),
    "t1_gva1": replace(_BASE, H=4, HV=4),
    "t1_gva2_kfirst": replace(_BASE, H=3, HV=6, v_first=False),
    "t1_pad_oob": replace(_BASE, B=7, pad_seq=True, oob=True),
    "t1_pad_oob_kfirst_bf16": replace(_BASE, B=7, pad_seq=True, oob=True, v_first=False, state_dtype="bfloat16"),
    "t1_idx64": replace(_BASE, idx64=True, pad_seq=True),
    "t1_no_slots": replace(_BASE, slots="none"),
    # outputs and input dtypes
    "out_f32": replace(_BASE, out_dtype="float32"),
    "out_f16_kfirst": replace(_BASE, out_dtype="float16", v_first=False),
    "out_bf16_prealloc": replace(_BASE, out_dtype="bfloat16"),
    "a_f32_b_f32": replace(_BASE, a_dtype="float32", b_dtype="float32", out_dtype="float32"),
    "a_f16_b_bf16": replace(_BASE, a_dtype="float16", b_dtype="bfloat16", dtype="bfloat16"),
    "dt_bias_bf16": replace(_BASE, dt_bias_dtype="bfloat16"),
    # gate and beta modes
    "gate_lower_bound": replace(_BASE, lower_bound=True),
    "gate_no_A_log": replace(_BASE, A_log=False),
    "gate_no_dt_bias": replace(_BASE, dt_bias=False),
    "gate_no_params_lb": replace(_BASE, A_log=False, dt_bias=False, lower_bound=True),
    "gate_off": replace(_BASE, gate_in_kernel=False, out_dtype="float32"),
    "gate_off_kfirst": replace(_BASE, gate_in_kernel=False, v_first=False),
    "beta_raw": replace(_BASE, beta_sigmoid=False, out_dtype="float32"),
    "beta_neg_eig": replace(_BASE, neg_eig=True),
    "beta_raw_neg_eig_kfirst": replace(_BASE, beta_sigmoid=False, neg_eig=True, v_first=False),
    "beta_per_channel": replace(_BASE, beta_per_channel=True, out_dtype="float32"),
    "beta_per_channel_kfirst_bf16": replace(_BASE, beta_per_channel=True, v_first=False, state_dtype="bfloat16"),
    "no_l2norm": replace(_BASE, l2norm=False, out_dtype="float32"),
    "no_l2norm_kfirst": replace(_BASE, l2norm=False, v_first=False),
    "scale_custom": replace(_BASE, scale=0.3, out_dtype="float32"),
    # state sources and sinks
    "zero_init_store": replace(_BASE, initial_state=False, inplace=False, store_final=True, slots="none"),
    "zero_init_inplace": replace(_BASE, initial_state=False),
    "store_not_inplace": replace(_BASE, inplace=False, store_final=True),
    "store_not_inplace_kfirst_bf16": replace(_BASE, inplace=False, store_final=True, v_first=False,
                                             state_dtype="bfloat16", pad_seq=True),
    "outputs_only": replace(_BASE, inplace=False),
    # multi-token, [B, T] slots (a state per token), speculative verification
    "t2_2d": replace(_BASE, T=2, slots="2d"),
    "t4_2d_bf16": replace(_BASE, T=4, slots="2d", state_dtype="bfloat16"),
    "t8_2d_kfirst": replace(_BASE, T=8, slots="2d", v_first=False),
    "t8_2d_kfirst_bf16": replace(_BASE, T=8, slots="2d", v_first=False, state_dtype="bfloat16"),
    "t4_2d_pad_tok": replace(_BASE, B=6, T=4, slots="2d", pad_tok=True, pad_seq=True, oob=True),
    "t4_2d_pad_tok_kfirst": replace(_BASE, B=6, T=4, slots="2d", pad_tok=True, pad_seq=True, oob=True,
                                    v_first=False),
    "t4_spec": replace(_BASE, B=5, T=4, slots="spec"),
    "t8_spec_bf16": replace(_BASE, B=5, T=8, slots="spec", state_dtype="bfloat16", extra_cols=1),
    "t4_spec_kfirst_pad": replace(_BASE, B=6, T=4, slots="spec", v_first=False, pad_seq=True, oob=True),
    "t3_spec_store": replace(_BASE, B=3, T=3, slots="spec", inplace=False, store_final=True),
    "t8_none_inplace": replace(_BASE, T=8, slots="none"),
    "t8_1d_store": replace(_BASE, T=8, slots="1d", inplace=False, store_final=True),
    "t8_gva4_per_channel": replace(_BASE, T=8, H=1, HV=4, slots="2d", beta_per_channel=True),
    "t12_chunked_prologue": replace(_BASE, B=2, T=12, slots="none"),
    "t12_chunked_kfirst_bf16": replace(_BASE, B=2, T=12, slots="2d", v_first=False, state_dtype="bfloat16"),
    # varlen (uneven lengths, empty sequences)
    "varlen_none": replace(_BASE, lens=(3, 0, 1, 5, 2), slots="none"),
    "varlen_2d": replace(_BASE, lens=(3, 0, 1, 5, 2), slots="2d"),
    "varlen_2d_kfirst_bf16": replace(_BASE, lens=(4, 1, 0, 2), slots="2d", v_first=False, state_dtype="bfloat16"),
    "varlen_spec_pad": replace(_BASE, lens=(4, 4, 2, 3, 1), slots="spec", pad_seq=True, pad_tok=True),
    "varlen_store": replace(_BASE, lens=(2, 0, 7), slots="1d", inplace=False, store_final=True),
    "varlen_long": replace(_BASE, lens=(17, 9, 1), slots="none"),
    "varlen_zero_init": replace(_BASE, lens=(2, 0, 3), slots="none", initial_state=False),
    # V not a multiple of the CTA slice
    "v_odd_vfirst": replace(_BASE, V=40, pad_seq=True),
    "v48_vfirst_bf16_pad": replace(_BASE, B=9, V=48, state_dtype="bfloat16", pad_seq=True, oob=True),
    "v_odd_vfirst_t4": replace(_BASE, V=72, T=4, slots="2d", state_dtype="bfloat16"),
    "v_odd_vfirst_spec_pad": replace(_BASE, B=6, V=40, T=4, slots="spec", pad_seq=True, oob=True),
    "v_odd_vfirst_varlen_zero_init": replace(_BASE, V=24, lens=(3, 0, 9), slots="none", initial_state=False),
    "v_odd_vfirst_store_bf16": replace(_BASE, V=56, inplace=False, store_final=True, state_dtype="bfloat16",
                                       pad_seq=True),
    "v_odd_vfirst_gate_off_per_channel": replace(_BASE, V=40, gate_in_kernel=False, beta_per_channel=True,
                                                 out_dtype="float32"),
    "v_odd_kfirst": replace(_BASE, V=40, v_first=False),
    "v_odd_kfirst_bf16": replace(_BASE, V=72, v_first=False, state_dtype="bfloat16", T=2, slots="2d"),
}


# ------------------------------------------------------------------ GPU tests


def _cupy():
    import cupy

    return cupy


def _to_device(x):
    """Host array -> CuPy (16-bit floats travel as their bits)."""
    if x is None:
        return None
    cp = _cupy()
    if x.dtype.itemsize == 2 and x.dtype.kind != "i":
        return cp.asarray(np.ascontiguousarray(x).view(np.uint16)).view(x.dtype)
    return cp.asarray(x)


def _to_host(x):
    if x is None:
        return None
    cp = _cupy()
    if x.dtype.itemsize == 2 and x.dtype.kind != "i":
        return cp.asnumpy(cp.ascontiguousarray(x).view(np.uint16)).view(x.dtype)
    return cp.asnumpy(x)


def _poisoned(shape, dtype):
    """A CuPy array full of NaN (unwritten elements show up in the checks)."""
    cp = _cupy()
    dtype = np.dtype(dtype)
    if dtype == DTYPES["bfloat16"]:
        return cp.full(shape, 0x7FC0, dtype=np.uint16).view(dtype)
    return cp.full(shape, np.nan, dtype=dtype)


def _run_case(c: Case, prep: Prepared, preallocate: bool):
    import mate_cupy as m

    args = {name: _to_device(x) for name, x in prep.args.items()}
    kwargs = dict(prep.kwargs)
    kwargs["state_indices"] = _to_device(kwargs["state_indices"])
    out = None
    if preallocate:
        out = _poisoned(prep.out_shape, prep.out_dtype)
        kwargs["output"] = out
    res_out, res_final = m.gated_delta_rule_decode(**args, **kwargs)
    if preallocate:
        assert res_out is out
    if c.inplace:
        assert res_final is args["state"]
    elif c.store_final:
        assert res_final is not None
    else:
        assert res_final is None
    pool = args["state"]
    return _to_host(res_out), _to_host(pool), None if c.inplace else _to_host(res_final)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_decode_matches_reference(name, rng):
    c = CASES[name]
    prep = build_case(c, rng)
    out, pool, final = _run_case(c, prep, preallocate=True)  # NaN-poisoned output
    check_results(c, prep, out, pool, final)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["t1_f32_vfirst", "t4_spec", "varlen_2d_kfirst_bf16"])
def test_decode_allocated_output(name, rng):
    c = CASES[name]
    prep = build_case(c, rng)
    out, pool, final = _run_case(c, prep, preallocate=False)
    assert out.dtype == np.dtype(DTYPES[c.dtype]) and out.shape == prep.out_shape
    check_results(c, prep, out, pool, final)


def _token_steps(prep, device_args: dict) -> list:
    """The arguments of one single-token call per token of ``prep`` (q, k, v, a, b sliced to
    that token and copied to the device; the others, the pool among them, shared)."""
    return [{n: (_to_device(np.ascontiguousarray(prep.args[n][:, t:t + 1])) if n in ("q", "k", "v", "a", "b")
                 else x) for n, x in device_args.items()} for t in range(prep.args["q"].shape[1])]


@pytest.mark.gpu
def test_decode_twice_equals_two_tokens(rng):
    """Two single-token in-place steps == one two-token step (the recurrence is carried)."""
    import mate_cupy as m

    cp = _cupy()
    c = replace(_BASE, T=2, slots="none", out_dtype="float32")
    prep = build_case(c, rng)
    a = {n: _to_device(x) for n, x in prep.args.items()}
    kw = dict(prep.kwargs, state_indices=None)
    outs = []
    for step in _token_steps(prep, a):
        o = _poisoned((c.B, 1, c.HV, c.V), np.float32)
        m.gated_delta_rule_decode(**step, **kw, output=o)
        outs.append(cp.asnumpy(o))
    got = np.concatenate(outs, axis=1)
    assert rel_err(got, prep.ref_out) <= 2e-4
    assert rel_err(cp.asnumpy(a["state"])[: c.B].astype(np.float64), prep.ref_pool[: c.B]) <= 2e-4


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
def test_decode_back_to_back_steps(graph, rng):
    """Twelve single-token in-place steps queued back to back on one stream with no host
    synchronisation (on sm_90 each a programmatic launch, scheduled while the step before it
    finishes), plain or captured in one CUDA graph == one twelve-token step."""
    import mate_cupy as m

    cp = _cupy()
    c = replace(_BASE, B=32, T=12, H=16, HV=32, slots="none", out_dtype="float32")  # 4096 CTAs a step
    prep = build_case(c, rng)
    a = {n: _to_device(x) for n, x in prep.args.items()}
    kw = dict(prep.kwargs, state_indices=None)
    steps = _token_steps(prep, a)
    outs = [_poisoned((c.B, 1, c.HV, c.V), np.float32) for _ in range(c.T)]
    pool0 = a["state"].copy()
    stream = side_stream()
    with stream:
        if graph:
            m.gated_delta_rule_decode(**steps[0], **kw, output=outs[0])  # compile and load the module
            a["state"][...] = pool0
            outs[0].fill(np.nan)
            stream.begin_capture()
        for t in range(c.T):
            m.gated_delta_rule_decode(**steps[t], **kw, output=outs[t])
        if graph:
            stream.end_capture().launch()
    stream.synchronize()
    got = np.concatenate([cp.asnumpy(o) for o in outs], axis=1)
    assert rel_err(got, prep.ref_out) <= 2e-4
    assert rel_err(cp.asnumpy(a["state"])[: c.B].astype(np.float64), prep.ref_pool[: c.B]) <= 2e-4


@pytest.mark.gpu
def test_decode_strided_inputs(rng):
    """q/k/v views of one packed projection (non-contiguous) give the same result."""
    import mate_cupy as m

    cp = _cupy()
    c = replace(_BASE, B=3, T=2, slots="none", out_dtype="float32")
    prep = build_case(c, rng)
    q, k, v = prep.args["q"], prep.args["k"], prep.args["v"]
    B, T, H, _ = q.shape
    packed = _to_device(np.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1))
    qs = packed[..., : H * K].reshape(B, T, H, K)
    ks = packed[..., H * K: 2 * H * K].reshape(B, T, H, K)
    vs = packed[..., 2 * H * K:].reshape(B, T, c.HV, c.V)
    assert not qs.flags.c_contiguous
    args = {n: _to_device(x) for n, x in prep.args.items()}
    args.update(q=qs, k=ks, v=vs)
    o = _poisoned((B, T, c.HV, c.V), np.float32)
    m.gated_delta_rule_decode(**args, **dict(prep.kwargs, state_indices=None), output=o)
    assert rel_err(cp.asnumpy(o), prep.ref_out) <= 2e-4


@pytest.mark.gpu
@pytest.mark.parametrize("v_first", [True, False], ids=["vfirst", "kfirst"])
def test_decode_staged_operands(v_first, rng):
    """Layouts the kernel cannot index (q with a strided last dim; A_log, dt_bias, slots and
    output with gaps between elements; a pool with gaps between slots) go through contiguous
    copies: same results, the caller's output and pool written, their gaps untouched."""
    import mate_cupy as m

    cp = _cupy()
    c = replace(_BASE, B=3, T=2, slots="2d", out_dtype="float32", v_first=v_first)
    prep = build_case(c, rng)
    args = {n: _to_device(x) for n, x in prep.args.items()}

    def spread(x, axis=-1):  # the same values with a zero after each element of `axis`
        u = x.view(np.uint16) if x.dtype.itemsize == 2 else x  # 16-bit floats through their bits
        shape = list(u.shape)
        shape[axis] *= 2
        big = cp.zeros(shape, dtype=u.dtype)
        idx = [slice(None)] * u.ndim
        idx[axis] = slice(None, None, 2)
        big[tuple(idx)] = u
        return big[tuple(idx)].view(x.dtype), big

    args["q"], _ = spread(args["q"])
    args["A_log"], _ = spread(args["A_log"])
    args["dt_bias"], _ = spread(args["dt_bias"])
    pool, pool_big = spread(args["state"], axis=0)
    args["state"] = pool
    si, _ = spread(_to_device(prep.kwargs["state_indices"]))
    out, out_big = spread(_poisoned(prep.out_shape, np.float32), axis=1)
    for x in (args["q"], args["A_log"], args["dt_bias"], pool, si, out):
        assert not x.flags.c_contiguous
    res, fin = m.gated_delta_rule_decode(**args, **dict(prep.kwargs, state_indices=si), output=out)
    assert res is out and fin is pool
    check_results(c, prep, _to_host(out), _to_host(pool), None)
    assert float(cp.abs(pool_big[1::2]).max()) == 0.0  # the gaps are not written
    assert float(cp.abs(out_big[:, 1::2]).max()) == 0.0


@pytest.mark.gpu
def test_decode_preallocated_call_allocates_nothing(rng):
    """Contiguous inputs and a preallocated output: no device allocation (CuPy's allocator
    refuses every request during the call), in place and with [N, C] slots."""
    import mate_cupy as m

    cp = _cupy()
    for c in (replace(_BASE, B=8, out_dtype="float32"), replace(_BASE, B=4, T=3, slots="spec", v_first=False)):
        prep = build_case(c, rng)
        args = {n: _to_device(x) for n, x in prep.args.items()}
        kw = dict(prep.kwargs, state_indices=_to_device(prep.kwargs["state_indices"]))
        out = _poisoned(prep.out_shape, prep.out_dtype)
        pool0 = args["state"].copy()
        m.gated_delta_rule_decode(**args, **kw, output=out)  # warm-up: compile and load the module
        args["state"][...] = pool0
        out.fill(np.nan)
        cp.cuda.Device().synchronize()

        def refuse(nbytes):
            raise AssertionError(f"gated_delta_rule_decode allocated {nbytes} bytes")

        with cp.cuda.using_allocator(refuse):
            m.gated_delta_rule_decode(**args, **kw, output=out)
        check_results(c, prep, _to_host(out), _to_host(args["state"]), None)


@pytest.mark.gpu
def test_decode_misaligned_pool_is_refused(rng):
    import mate_cupy as m

    cp = _cupy()
    c = replace(_BASE, B=2, slots="none")
    prep = build_case(c, rng)
    pool = prep.args["state"]
    flat = cp.zeros(pool.size + 1, dtype=np.float32)
    bad = flat[1:].reshape(pool.shape)  # contiguous, 4 bytes off a 16-byte boundary
    bad[...] = _to_device(pool)
    args = {n: _to_device(x) for n, x in prep.args.items()}
    args["state"] = bad
    with pytest.raises(ValueError, match="16-byte aligned"):
        m.gated_delta_rule_decode(**args, **dict(prep.kwargs, state_indices=None))
    assert np.array_equal(_to_host(bad), pool)


@pytest.mark.gpu
@pytest.mark.torch
def test_decode_torch_tensors_on_side_stream(rng):
    """torch inputs: zero-copy, launched on torch's current stream, torch results."""
    import torch

    import mate_cupy as m

    c = replace(_BASE, B=4, T=1, out_dtype="float32")
    prep = build_case(c, rng)

    def to_t(x):
        if x is None:
            return None
        if x.dtype == DTYPES["bfloat16"]:
            return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16).cuda()
        return torch.from_numpy(np.ascontiguousarray(x)).cuda()

    args = {n: to_t(x) for n, x in prep.args.items()}
    si = to_t(prep.kwargs["state_indices"])
    s = torch_side_stream()
    with torch.cuda.stream(s):
        out = torch.full((c.B, 1, c.HV, c.V), float("nan"), device="cuda", dtype=torch.float32)
        res, final = m.gated_delta_rule_decode(**args, **dict(prep.kwargs, state_indices=si), output=out)
    s.synchronize()
    assert res is out and final is args["state"]
    assert rel_err(out.cpu().numpy(), prep.ref_out) <= 2e-4
    check_results(c, prep, out.cpu().numpy(), args["state"].cpu().numpy(), None)


@pytest.mark.gpu
def test_decode_cuda_graph_capture(rng):
    """A preallocated in-place step can be captured in a CUDA graph and replayed."""
    import mate_cupy as m

    c = replace(_BASE, B=8, T=1, out_dtype="float32")
    prep = build_case(c, rng)
    args = {n: _to_device(x) for n, x in prep.args.items()}
    kw = dict(prep.kwargs, state_indices=_to_device(prep.kwargs["state_indices"]))
    out = _poisoned(prep.out_shape, np.float32)
    pool0 = args["state"].copy()
    stream = side_stream()
    with stream:
        m.gated_delta_rule_decode(**args, **kw, output=out)  # warm-up: compile and load the module
        args["state"][...] = pool0
        out.fill(np.nan)
        stream.begin_capture()
        m.gated_delta_rule_decode(**args, **kw, output=out)
        graph = stream.end_capture()
        graph.launch()
    stream.synchronize()
    check_results(c, prep, _to_host(out), _to_host(args["state"]), None)


@pytest.mark.gpu
def test_prefill_then_decode(rng):
    """chunk_kda over a prompt, then one decode step == the recurrence over prompt + 1."""
    import mate_cupy as m
    from mate_cupy.reference.kda import kda_recurrent

    cp = _cupy()
    B, T, H, HV = 2, 33, 2, 4
    q = _rand(rng, (B, T + 1, H, K), "bfloat16")
    k = _rand(rng, (B, T + 1, H, K), "bfloat16")
    v = _rand(rng, (B, T + 1, HV, K), "bfloat16")
    g = _rand(rng, (B, T + 1, HV, K), "bfloat16")
    beta = _rand(rng, (B, T + 1, HV), "bfloat16")
    A_log = (rng.standard_normal(HV) * 0.5).astype(np.float32)
    dt_bias = (rng.standard_normal((HV, K)) * 0.5).astype(np.float32)
    ref_o, ref_S = kda_recurrent(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    d = _to_device
    try:
        _, S = m.chunk_kda(d(q[:, :T]), d(k[:, :T]), d(v[:, :T]), d(g[:, :T]), d(beta[:, :T]),
                           initial_state=cp.zeros((B, HV, K, K), dtype=np.float32), output_final_state=True,
                           A_log=d(A_log), dt_bias=d(dt_bias), lower_bound=-5.0)
    except NotImplementedError:
        pytest.skip("chunk_kda has no CUDA kernel in this build yet")
    out = _poisoned((B, 1, HV, K), np.float32)
    _, S_after = m.gated_delta_rule_decode(
        d(q[:, T:]), d(k[:, T:]), d(v[:, T:]), S, d(A_log), d(g[:, T:]), d(dt_bias), None, None, d(beta[:, T:]),
        output=out, use_lower_bound=True, lower_bound=-5.0, apply_beta_sigmoid=True, inplace_final_state=True)
    assert rel_err(cp.asnumpy(out), ref_o[:, T:]) <= 5e-3
    assert rel_err(cp.asnumpy(S_after).astype(np.float64), ref_S) <= 5e-3


# ------------------------------------------------------------------ CPU: the grid's reference side


@pytest.mark.parametrize("name", ["t4_spec_kfirst_pad", "varlen_spec_pad", "t4_2d_pad_tok", "t1_pad_oob"])
def test_case_builder_reference_runs(name, rng):
    """The grid's reference side (slot adjustment included) runs on the host."""
    prep = build_case(CASES[name], rng)
    assert np.isfinite(prep.ref_out).all()
