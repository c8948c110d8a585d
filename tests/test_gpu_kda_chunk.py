"""chunk_kda CUDA kernels (cuda_src/kda_chunk.cu) against the float64 recurrence.

CPU tests: a float32 NumPy model of the kernels' exact decomposition (chunk 64, 16-row
sub-blocks, tf32 products for Aqk/Akk, operand rounding to the input dtype where the
kernels round) is compared with ``kda_recurrent``; its error sets the GPU tolerances.
GPU tests: the public ``chunk_kda`` and the launcher against ``kda_recurrent`` on fresh
random inputs with NaN-poisoned outputs, plus the phase-1 workspace against the model.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from helpers import to_f64
from mate_cupy.kda import chunk_kernels as ck
from mate_cupy.reference.kda import kda_recurrent

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
K = 128
C = 64
LOG2E = np.float32(1.4426950408889634)

# Normalised error bounds, ~3x what the float32 model of the kernels measures against the
# float64 recurrence (test_model_error_budget): bf16 ~3.3e-3, fp16 ~5e-4.
TOL = {BF16: 1e-2, F16: 2.5e-3}
STATE_TOL = {BF16: 1e-2, F16: 2.5e-3}


def rel(a, b) -> float:
    a, b = to_f64(a), to_f64(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    if not np.isfinite(a).all():
        return float("inf")
    den = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (den if den > 0 else 1.0))


# ----------------------------------------------------------------------------- inputs


def make_inputs(rng, B, T, H, HV, dtype=BF16, gate_params=True, lens=None, state=None, extreme=False):
    """Realistic chunk_kda inputs: q, k, v ~ N(0, 1), beta logits ~ N(0, 1); gates either
    raw inputs for A_log/dt_bias or log decays (mostly mild); ``extreme`` adds decays of
    -30 and -100 (the element-wise diagonal-block path)."""
    if lens is not None:
        B, T = 1, int(sum(lens))
    x = dict(
        q=rng.standard_normal((B, T, H, K)).astype(dtype),
        k=rng.standard_normal((B, T, H, K)).astype(dtype),
        v=rng.standard_normal((B, T, HV, K)).astype(dtype),
        beta=rng.standard_normal((B, T, HV)).astype(dtype),
    )
    if gate_params:
        x["g"] = rng.standard_normal((B, T, HV, K)).astype(dtype)
        x["A_log"] = rng.uniform(-1.0, 1.0, HV).astype(np.float32)
        x["dt_bias"] = (0.5 * rng.standard_normal((HV, K))).astype(np.float32)
    else:
        g = -np.logaddexp(0.0, -(rng.standard_normal((B, T, HV, K)) + 2.0))  # logsigmoid, in (-inf, 0)
        if extreme:
            g[rng.random((B, T, HV)) < 0.1] = -30.0
            g[rng.random((B, T, HV)) < 0.05] = -100.0
        x["g"] = g.astype(dtype)
    N = B
    if lens is not None:
        x["cu_seqlens"] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        N = len(lens)
    if state is not None:
        x["initial_state"] = (0.5 * rng.standard_normal((N, HV, K, K))).astype(state)
    return x


# ----------------------------------------------------------------------------- float32 model


def _round(x, dtype):
    return np.asarray(x, np.float32).astype(dtype).astype(np.float32)


_TINY = np.float32(np.finfo(np.float32).tiny)


def _ex2(x):
    """2^x in float32 as the kernels' ``ex2.approx.ftz``: subnormal results flush to zero
    (e.g. ``egl`` of a chunk whose decays sum below 2^-126 is exactly 0 on the GPU)."""
    with np.errstate(over="ignore", under="ignore"):
        y = np.exp2(np.asarray(x, np.float32))
    return np.where(y < _TINY, np.float32(0), y).astype(np.float32)


def _tf32(x):
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def model_chunk(q, k, v, g, beta, *, scale, S, A_log=None, dt_bias=None, lower_bound=-5.0, l2=True, op=BF16,
                diag_span_limit=60.0, offdiag_ref="mid", record=None):
    """The kernels' computation for one value head of one sequence, in float32.

    q, k, v, g [T, 128] float32 (values of the input dtype), beta [T] logits, S [V, K]
    float32 (updated in place). ``record`` collects the phase-1 workspace per chunk.
    ``offdiag_ref``: "mid" (kda_chunk_prepare_kernel) or "above" (the baseline kernel).
    Returns o [T, 128] float32 (before the final rounding to the output dtype).
    """
    T = q.shape[0]
    o = np.zeros((T, K), np.float32)
    tril, stril = np.tril(np.ones((16, 16), bool)), np.tril(np.ones((16, 16), bool), -1)
    for c0 in range(0, T, C):
        L = min(C, T - c0)
        pad = lambda x: np.concatenate([x[c0:c0 + L], np.zeros((C - L,) + x.shape[1:], np.float32)])  # noqa: E731
        qc, kc, vc, gin = pad(q), pad(k), pad(v), pad(g)
        b = np.zeros(C, np.float32)
        b[:L] = 1 / (1 + np.exp(-beta[c0:c0 + L].astype(np.float32)))
        ones = np.ones(C, np.float32)
        qn = 1 / np.sqrt((qc * qc).sum(1) + np.float32(1e-6)) if l2 else ones
        kn = 1 / np.sqrt((kc * kc).sum(1) + np.float32(1e-6)) if l2 else ones
        if A_log is not None:
            xg = np.float32(np.exp(np.float32(A_log))) * (gin + dt_bias[None, :])
            gk = (np.float32(lower_bound) / (1 + np.exp(-xg))).astype(np.float32)
        else:
            gk = gin.copy()
        gk[L:] = 0
        gc = np.cumsum(gk, axis=0, dtype=np.float32) * LOG2E  # log2 units
        qq, kk = qc * qn[:, None].astype(np.float32), kc * kn[:, None].astype(np.float32)
        Qs = _round(qq * _ex2(gc) * np.float32(scale), op)
        Kt = _round(kk * _ex2(gc), op)
        Kb = _round(kk * _ex2(gc[-1][None, :] - gc), op)
        egl = _ex2(gc[-1])
        Aqk = np.zeros((C, C), np.float32)
        Akk = np.zeros((C, C), np.float32)
        for I in range(4):
            rows = slice(16 * I, 16 * I + 16)
            m = gc[16 * I + 7][None, :]
            fast = np.abs(gc[rows] - m).max() / LOG2E <= diag_span_limit
            # Reference of the off-diagonal blocks J < I: the kernel's (see kda_chunk.cu P2b)
            # takes the mid row m when the diagonal block is on the fast path, else the row
            # above the block; the baseline kernel always the row above.
            if I > 0:
                ref = m if (fast and offdiag_ref == "mid") else gc[16 * I - 1][None, :]
                rq, rk = _tf32(qq[rows] * _ex2(gc[rows] - ref)), _tf32(kk[rows] * _ex2(gc[rows] - ref))
                for J in range(I):
                    cols = slice(16 * J, 16 * J + 16)
                    cb = _tf32(kk[cols] * _ex2(ref - gc[cols]))
                    Aqk[rows, cols] = rq @ cb.T
                    Akk[rows, cols] = rk @ cb.T
            if not fast:  # element-wise path
                d = gc[rows][:, None, :] - gc[rows][None, :, :]
                e = _ex2(np.where(tril[:, :, None], d, -np.inf))
                aq = (qq[rows][:, None, :] * kk[rows][None, :, :] * e).sum(-1)
                ak = (kk[rows][:, None, :] * kk[rows][None, :, :] * e).sum(-1)
            else:
                with np.errstate(over="ignore", invalid="ignore"):
                    cb = _tf32(kk[rows] * _ex2(m - gc[rows]))
                    aq = _tf32(qq[rows] * _ex2(gc[rows] - m)) @ cb.T
                    ak = _tf32(kk[rows] * _ex2(gc[rows] - m)) @ cb.T
            Aqk[rows, rows] = np.where(tril, aq, 0)
            Akk[rows, rows] = np.where(stril, ak, 0)
        Aqk = _round(Aqk * np.float32(scale), op)
        Akk = Akk * b[:, None]
        Lm = np.linalg.inv(np.eye(C) + Akk).astype(np.float32)
        Tm = _round(np.tril(Lm) * b[None, :], op)
        Sb = _round(S, op)
        X = Kt @ Sb.T
        O = Qs @ Sb.T
        U = _round(Tm @ _round(vc - X, op), op)
        O = O + Aqk @ U
        o[c0:c0 + L] = O[:L]
        S *= egl[None, :]
        S += U.T @ Kb
        if record is not None:
            record.append(dict(Qs=Qs, Kt=Kt, Kb=Kb, T=Tm, Aqk=Aqk, egl=egl))
    return o


def model_chunk_kda(x, *, op, scale=K ** -0.5, lower_bound=-5.0, l2=True, record=None, **kw):
    """``model_chunk`` over every sequence and value head of chunk_kda inputs ``x``."""
    f32 = lambda a: None if a is None else np.asarray(a, np.float32)  # noqa: E731
    q, k, v, g, beta = (f32(x[n]) for n in ("q", "k", "v", "g", "beta"))
    A_log, dt_bias = f32(x.get("A_log")), f32(x.get("dt_bias"))
    B, T, H, _ = q.shape
    HV = v.shape[2]
    cu = x.get("cu_seqlens")
    seqs = [(0, int(cu[n]), int(cu[n + 1])) for n in range(len(cu) - 1)] if cu is not None else [(b, 0, T) for b in range(B)]
    N = len(seqs)
    S0 = x.get("initial_state")
    S = np.zeros((N, HV, K, K), np.float32) if S0 is None else f32(S0).copy()
    o = np.zeros(v.shape, np.float32)
    for n, (b, bos, eos) in enumerate(seqs):
        for hv in range(HV):
            h = hv // (HV // H)
            o[b, bos:eos, hv] = model_chunk(
                q[b, bos:eos, h], k[b, bos:eos, h], v[b, bos:eos, hv], g[b, bos:eos, hv], beta[b, bos:eos, hv],
                scale=scale, S=S[n, hv], A_log=None if A_log is None else A_log[hv],
                dt_bias=None if dt_bias is None else dt_bias[hv], lower_bound=lower_bound, l2=l2, op=op,
                record=None if record is None else record.setdefault((n, hv), []), **kw)
    return o, S


def reference(x, **kw):
    keys = ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens", "A_log", "dt_bias")
    return kda_recurrent(**{k_: x.get(k_) for k_ in keys}, **kw)


# ----------------------------------------------------------------------------- CPU: the model


MODEL_CASES = [
    pytest.param(BF16, dict(B=1, T=200, H=1, HV=2, gate_params=True, state=F32), id="bf16-gate-state"),
    pytest.param(BF16, dict(B=1, T=0, H=1, HV=2, lens=[1, 63, 64, 65], gate_params=False), id="bf16-lens"),
    pytest.param(BF16, dict(B=1, T=300, H=1, HV=1, gate_params=False, extreme=True, state=F32), id="bf16-extreme"),
    pytest.param(F16, dict(B=1, T=130, H=1, HV=2, gate_params=True, state=F32), id="fp16-gate"),
    pytest.param(F16, dict(B=1, T=200, H=1, HV=1, gate_params=False, extreme=True), id="fp16-extreme"),
]


@pytest.mark.parametrize("dtype, kw", MODEL_CASES)
def test_model_error_budget(rng, dtype, kw):
    """The kernels' float32 decomposition stays within a third of the GPU tolerances."""
    x = make_inputs(rng, dtype=dtype, **kw)
    o_ref, s_ref = reference(x)
    o, s = model_chunk_kda(x, op=dtype)
    assert rel(_round(o, dtype), o_ref) < TOL[dtype] / 2.5
    assert rel(s, s_ref) < STATE_TOL[dtype] / 2.5


def test_model_long_sequence_is_stable(rng):
    """T = 4096 with gate parameters: the error does not grow along the sequence."""
    x = make_inputs(rng, 1, 4096, 1, 1, gate_params=True, state=F32)
    o_ref, _ = reference(x)
    o, _ = model_chunk_kda(x, op=BF16)
    head, tail = rel(o[:, :512], o_ref[:, :512]), rel(o[:, -512:], o_ref[:, -512:])
    assert tail < TOL[BF16] / 2.5 and tail < 2 * head


def test_model_elementwise_diagonal_matches_fast_path(rng):
    """The element-wise diagonal blocks (large gate spans) agree with the tensor-core path."""
    x = make_inputs(rng, 1, 130, 1, 1, gate_params=True, state=F32)
    o_fast, s_fast = model_chunk_kda(x, op=BF16)
    o_slow, s_slow = model_chunk_kda(x, op=BF16, diag_span_limit=-1.0)
    assert rel(o_slow, o_fast) < 2e-3 and rel(s_slow, s_fast) < 2e-3


# ----------------------------------------------------------------------------- CPU: launcher helpers


def test_recurrence_warps_heuristic(monkeypatch):
    monkeypatch.delenv("MATE_CUPY_KDA_CHUNK_WARPS", raising=False)
    assert ck.recurrence_warps(64, 132) == 4      # B1 H64: 128 CTAs
    assert ck.recurrence_warps(96, 132) == 8      # B1 H96: one wave of 96 CTAs
    assert ck.recurrence_warps(32, 132) == 2      # B1 H32: 128 two-warp CTAs (fastest in the H200 sweep)
    assert ck.recurrence_warps(512, 132) == 8     # varlen 8 x H64
    monkeypatch.setenv("MATE_CUPY_KDA_CHUNK_WARPS", "1")
    assert ck.recurrence_warps(512, 132) == 1
    monkeypatch.setenv("MATE_CUPY_KDA_CHUNK_WARPS", "3")
    with pytest.raises(ValueError, match="MATE_CUPY_KDA_CHUNK_WARPS"):
        ck.recurrence_warps(64, 132)


def test_varlen_slot_bound(rng):
    for _ in range(50):
        lens = rng.integers(0, 300, rng.integers(1, 20))
        need = int(sum((n + C - 1) // C for n in lens))
        assert need <= ck.num_chunk_slots(1, int(lens.sum()), len(lens), True)
    assert ck.num_chunk_slots(3, 65, 3, False) == 6


def test_smem_fits():
    per_sm = 228 * 1024  # H100/H200: 228 KB per SM, 1 KB reserved per CTA, 227 KB per CTA at most
    assert 3 * (ck.PREPARE_SMEM + 1024) <= per_sm  # three prepare CTAs per SM
    assert 2 * (ck.PREPARE_BASELINE_SMEM + 1024) <= per_sm
    assert all(ck.recurrence_smem(nw) <= 227 * 1024 for nw in ck.RECURRENCE_WARPS)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_kernels_compile_without_spills(dtype):
    from mate_cupy.jit import compile_variant

    specs = [ck.PREPARE_SPECS[dtype], ck.PREPARE_BASELINE_SPECS[dtype]]
    specs += [ck.RECURRENCE_SPECS[(dtype, nw)] for nw in ck.RECURRENCE_WARPS]
    for spec in specs:
        log = compile_variant(spec, "sm_90a", ptxas_verbose=True)["log"]
        entries = log.count("Compiling entry function")
        assert entries >= len(spec.kernels)
        assert log.count("0 bytes spill stores, 0 bytes spill loads") == entries, log


# ----------------------------------------------------------------------------- GPU


def _dev(x):
    import cupy

    return {k_: (cupy.asarray(v_) if isinstance(v_, np.ndarray) else v_) for k_, v_ in x.items()}


def _nan(shape, dtype):
    import cupy

    a = cupy.empty(shape, dtype=dtype)
    a.fill(np.nan)
    return a


def _run_public(x, state_out=None, **kw):
    """chunk_kda on device copies of ``x`` with NaN-poisoned preallocated outputs."""
    from mate_cupy import chunk_kda

    d = _dev(x)
    out = _nan(x["v"].shape, x["v"].dtype)
    N = len(x["cu_seqlens"]) - 1 if "cu_seqlens" in x else x["q"].shape[0]
    fs = None if state_out is None else _nan((N, x["v"].shape[2], K, K), state_out)
    res = chunk_kda(**d, output=out, output_final_state=fs is not None, final_state=fs, **kw)
    if fs is not None:
        assert res[0] is out and res[1] is fs
    return out, fs


GPU_CASES = [
    # dtype, B, T, H, HV, gate params, initial state, final state
    pytest.param(BF16, 2, 1, 1, 1, True, F32, F32, id="bf16-T1-gate-f32"),
    pytest.param(BF16, 1, 63, 2, 4, False, None, F32, id="bf16-T63-gva2-nostate"),
    pytest.param(BF16, 2, 64, 2, 2, True, BF16, BF16, id="bf16-T64-bf16state"),
    pytest.param(BF16, 1, 65, 1, 4, True, F32, None, id="bf16-T65-gva4-nofinal"),
    pytest.param(BF16, 1, 1000, 2, 4, True, F32, F32, id="bf16-T1000-gva2"),
    pytest.param(BF16, 3, 1000, 2, 2, False, BF16, BF16, id="bf16-T1000-logdecay"),
    pytest.param(F16, 2, 1000, 4, 4, False, F32, F32, id="fp16-T1000-logdecay"),
    pytest.param(F16, 1, 65, 1, 2, True, None, None, id="fp16-T65-gate"),
    pytest.param(F16, 1, 200, 1, 4, True, F16, F16, id="fp16-T200-fp16state"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, B, T, H, HV, gate, s_in, s_out", GPU_CASES)
def test_chunk_matches_recurrence(rng, dtype, B, T, H, HV, gate, s_in, s_out):
    x = make_inputs(rng, B, T, H, HV, dtype=dtype, gate_params=gate, state=s_in)
    o_ref, s_ref = reference(x)
    out, fs = _run_public(x, state_out=s_out)
    assert rel(out, o_ref) < TOL[dtype]
    if s_out is not None:
        assert rel(fs, s_ref) < STATE_TOL[dtype]


@pytest.mark.gpu
def test_chunk_without_l2norm_and_custom_scale(rng):
    x = make_inputs(rng, 1, 300, 2, 2, gate_params=True, state=F32)
    for n in ("q", "k"):
        x[n] = (x[n].astype(np.float32) / 11.3).astype(BF16)
    o_ref, s_ref = reference(x, use_qk_l2norm=False, scale=0.3, lower_bound=-2.0)
    out, fs = _run_public(x, state_out=F32, use_qk_l2norm_in_kernel=False, scale=0.3, lower_bound=-2.0)
    assert rel(out, o_ref) < TOL[BF16]
    assert rel(fs, s_ref) < STATE_TOL[BF16]


@pytest.mark.gpu
@pytest.mark.parametrize("cu_dtype", [np.int32, np.int64], ids=["cu32", "cu64"])
@pytest.mark.parametrize("state", [F32, BF16], ids=["f32", "bf16"])
def test_chunk_varlen_uneven_and_empty(rng, cu_dtype, state):
    lens = [1, 0, 63, 64, 65, 1000, 0, 130]
    x = make_inputs(rng, 0, 0, 2, 4, gate_params=True, lens=lens, state=state)
    x["cu_seqlens"] = x["cu_seqlens"].astype(cu_dtype)
    o_ref, s_ref = reference(x)
    out, fs = _run_public(x, state_out=state)
    assert rel(out, o_ref) < TOL[BF16]
    assert rel(fs, s_ref) < STATE_TOL[BF16]
    # empty sequences keep their initial state exactly
    for n in (1, 6):
        np.testing.assert_array_equal(to_f64(fs[n]), to_f64(x["initial_state"][n]))


@pytest.mark.gpu
def test_chunk_varlen_many_sequences(rng):
    """More sequences than one offsets-kernel tile (1024), lengths 0..70."""
    lens = rng.integers(0, 70, 1500)
    x = make_inputs(rng, 0, 0, 1, 1, gate_params=False, lens=list(lens), state=F32)
    o_ref, s_ref = reference(x)
    out, fs = _run_public(x, state_out=F32)
    assert rel(out, o_ref) < TOL[BF16]
    assert rel(fs, s_ref) < STATE_TOL[BF16]


@pytest.mark.gpu
def test_chunk_extreme_gates_elementwise_diagonal(rng):
    x = make_inputs(rng, 2, 500, 1, 2, gate_params=False, extreme=True, state=F32)
    o_ref, s_ref = reference(x)
    out, fs = _run_public(x, state_out=F32)
    assert rel(out, o_ref) < TOL[BF16]
    assert rel(fs, s_ref) < STATE_TOL[BF16]


@pytest.mark.gpu
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "logdecay"])
def test_chunk_long_sequence_stable(rng, gate):
    """T = 16384 (256 chunks): error within bounds and not growing along the sequence."""
    x = make_inputs(rng, 1, 16384, 1, 1, gate_params=gate, state=F32)
    o_ref, s_ref = reference(x)
    out, fs = _run_public(x, state_out=F32)
    o = to_f64(out)
    assert rel(o, o_ref) < TOL[BF16]
    assert rel(o[:, -1024:], o_ref[:, -1024:]) < TOL[BF16]
    assert rel(fs, s_ref) < STATE_TOL[BF16]


@pytest.mark.gpu
@pytest.mark.parametrize("nw", ck.RECURRENCE_WARPS)
def test_chunk_every_recurrence_width(rng, monkeypatch, nw):
    """Every V-slice width gives bitwise the same result (warps never share data)."""
    x = make_inputs(rng, 1, 300, 1, 2, gate_params=True, state=F32)
    monkeypatch.setenv("MATE_CUPY_KDA_CHUNK_WARPS", "8")
    base, base_s = _run_public(x, state_out=F32)
    monkeypatch.setenv("MATE_CUPY_KDA_CHUNK_WARPS", str(nw))
    out, fs = _run_public(x, state_out=F32)
    np.testing.assert_array_equal(to_f64(out), to_f64(base))
    np.testing.assert_array_equal(to_f64(fs), to_f64(base_s))
    o_ref, _ = reference(x)
    assert rel(out, o_ref) < TOL[BF16]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ck.PREPARE_VARIANTS)
@pytest.mark.parametrize("gates", ["gate", "extreme"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_chunk_workspace_matches_model(rng, monkeypatch, dtype, gates, variant):
    """Phase 1 alone: every workspace part of every (chunk, head) against the model
    (``extreme``: decays of -30 / -100 put diagonal blocks on the element-wise path)."""
    import cupy

    monkeypatch.setenv("MATE_CUPY_KDA_CHUNK_PREPARE", variant)
    lens = [70, 1, 128]
    x = make_inputs(rng, 0, 0, 1, 2, dtype=dtype, gate_params=gates == "gate", extreme=gates == "extreme", lens=lens,
                    state=F32)
    d = _dev(x)
    out = _nan(x["v"].shape, dtype)
    ws, slots = ck.run_chunk_workspace(
        q=d["q"], k=d["k"], v=d["v"], g=d["g"], beta=d["beta"], A_log=d.get("A_log"),
        dt_bias=None if "dt_bias" not in d else d["dt_bias"].reshape(-1), initial_state=d["initial_state"],
        final_state=None, cu_seqlens=d["cu_seqlens"], out=out, scale=K ** -0.5, lower_bound=-5.0,
        use_qk_l2norm=True)
    cupy.cuda.Device().synchronize()
    parts = ck.workspace_views(ws, slots, 2, dtype)
    rec: dict = {}
    model_chunk_kda(x, op=dtype, record=rec, offdiag_ref="above" if variant == "baseline" else "mid")
    slot = 0
    for n, ln in enumerate(lens):
        nch = (ln + C - 1) // C
        for hv in range(2):
            for c in range(nch):
                m = rec[(n, hv)][c]
                for name in ("Qs", "Kt", "Kb", "T", "Aqk"):
                    got = to_f64(parts[name][slot + c, hv])
                    assert rel(got, m[name]) < 5e-3, (n, hv, c, name, rel(got, m[name]))
                # egl = 2^gl per channel (ex2.approx: ~2^-22 relative; results below 2^-126
                # flush to zero, so values near that edge may differ by a few 1e-38). gl is a
                # float32 sum of up to 64 gates: |gl| ~ 100 carries ~1e-5 absolute rounding, which
                # 2^gl turns into ~1e-5 relative, hence rtol 5e-5.
                np.testing.assert_allclose(to_f64(parts["egl"][slot + c, hv]), to_f64(m["egl"]), rtol=5e-5,
                                           atol=1e-37, err_msg=str((n, hv, c)))
        slot += nch


@pytest.mark.gpu
def test_chunk_baseline_prepare_matches_recurrence(rng, monkeypatch):
    """The baseline phase-1 kernel (kept for comparison) still gives correct outputs."""
    monkeypatch.setenv("MATE_CUPY_KDA_CHUNK_PREPARE", "baseline")
    x = make_inputs(rng, 0, 0, 2, 4, gate_params=True, lens=[1, 200, 64, 0, 333], state=F32)
    o_ref, s_ref = reference(x)
    out, fs = _run_public(x, state_out=F32)
    assert rel(out, o_ref) < TOL[BF16]
    assert rel(fs, s_ref) < STATE_TOL[BF16]


@pytest.mark.gpu
def test_chunk_final_state_continues_in_decode(rng):
    """Prefill T0 tokens, then decode 3 with the returned state == prefill of T0 + 3."""
    from mate_cupy import chunk_kda, gated_delta_rule_decode

    T0, T1, H, HV = 200, 3, 2, 4
    x = make_inputs(rng, 2, T0 + T1, H, HV, gate_params=True, state=F32)
    d = _dev(x)
    head = {k_: (v_[:, :T0] if k_ in ("q", "k", "v", "g", "beta") else v_) for k_, v_ in d.items()}
    _, state = chunk_kda(**head, output_final_state=True)
    out_full, state_full = chunk_kda(**d, output_final_state=True)
    out_dec, state_dec = gated_delta_rule_decode(
        q=d["q"][:, T0:], k=d["k"][:, T0:], v=d["v"][:, T0:], state=state, A_log=d["A_log"],
        a=d["g"][:, T0:], dt_bias=d["dt_bias"], num_accepted_tokens=None, cu_seqlens=None, b=d["beta"][:, T0:],
        use_lower_bound=True, lower_bound=-5.0, apply_beta_sigmoid=True, store_final_state=True)
    assert rel(out_dec, out_full[:, T0:]) < TOL[BF16]
    assert rel(state_dec, state_full) < STATE_TOL[BF16]


@pytest.mark.gpu
def test_chunk_malformed_cu_seqlens_stays_in_bounds(rng):
    """Offsets past the end or decreasing are clamped: no write outside ``out``."""
    import cupy

    x = make_inputs(rng, 0, 0, 1, 1, gate_params=False, lens=[100, 200])
    d = _dev(x)
    S = x["q"].shape[1]
    guard = _nan((1, S + 256, 1, K), BF16)
    out = guard[:, 128:128 + S]
    # past the end, huge, decreasing/negative, valid, overlapping (more chunks than slots)
    for cu in ([0, 250, 100], [0, 10 ** 6, 2 ** 31 - 1], [5, -3, 40], [0, 300, 300], [0, 300, 0, 300]):
        cu = cupy.asarray(np.asarray(cu, np.int64))
        fs = _nan((len(cu) - 1, 1, K, K), F32)
        ck.run_chunk(q=d["q"], k=d["k"], v=d["v"], g=d["g"], beta=d["beta"], A_log=None, dt_bias=None,
                     initial_state=None, final_state=fs, cu_seqlens=cu, out=out, scale=K ** -0.5,
                     lower_bound=-5.0, use_qk_l2norm=True)
        cupy.cuda.Device().synchronize()
        g_host = to_f64(guard)
        assert np.isnan(g_host[:, :128]).all() and np.isnan(g_host[:, 128 + S:]).all()
        assert np.isfinite(to_f64(fs)).all()


@pytest.mark.gpu
def test_chunk_varlen_no_sequences_writes_nothing(rng):
    """cu_seqlens = [0] with rows present: nothing to compute, nothing written."""
    import cupy

    x = make_inputs(rng, 1, 100, 1, 1, gate_params=False)
    d = _dev(x)
    out = _nan(x["v"].shape, BF16)
    ck.run_chunk(q=d["q"], k=d["k"], v=d["v"], g=d["g"], beta=d["beta"], A_log=None, dt_bias=None,
                 initial_state=None, final_state=None, cu_seqlens=cupy.zeros(1, np.int32), out=out,
                 scale=K ** -0.5, lower_bound=-5.0, use_qk_l2norm=True)
    cupy.cuda.Device().synchronize()
    assert np.isnan(to_f64(out)).all()


# ----------------------------------------------------------------------------- CPU: launcher dry run


def _kernel_params(name: str) -> list:
    """Parameter kinds of ``__global__`` kernel ``name`` in kda_chunk.cu: ptr, i32, i64, f32."""
    import re
    from pathlib import Path

    src = (Path(ck.__file__).resolve().parent.parent / "cuda_src" / "kda_chunk.cu").read_text()
    m = re.search(r"__global__ void (?:__launch_bounds__\([^)]*\) )?" + name + r"\(", src)
    assert m, name
    depth, i = 1, m.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(src[i], 0)
        i += 1
    kinds = []
    for p in src[m.end():i - 1].split(","):
        p = " ".join(p.split())
        kinds.append("ptr" if "*" in p else "i64" if "long long" in p else "i32" if p.startswith("int ") else
                     "f32" if p.startswith("float ") else p)
    return kinds


class _FakeDev:
    """Stands in for a CuPy array in the launcher (no GPU here)."""

    def __init__(self, shape, dtype, ptr=4096):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.ndim, self.size = len(self.shape), int(np.prod(self.shape))
        self.flags = type("F", (), {"c_contiguous": True})()
        self.data = type("D", (), {"ptr": ptr})()

    def reshape(self, *shape):
        return _FakeDev(shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape, self.dtype)

    def copy(self):
        return _FakeDev(self.shape, self.dtype)


class _FakeKernel:
    __slots__ = ("name", "preferred_shared_memory_carveout")

    def __init__(self, name):
        self.name = name


def _arg_kind(a):
    if isinstance(a, (_FakeDev, np.uintp)):
        return "ptr"
    return {np.int32: "i32", np.int64: "i64", np.float32: "f32"}.get(type(a), repr(type(a)))


@pytest.mark.parametrize("varlen, gate, s_in, s_out", [
    (False, True, F32, F32), (True, False, None, BF16), (True, True, BF16, None), (False, False, None, None)])
def test_launcher_dry_run(monkeypatch, varlen, gate, s_in, s_out):
    import cupy

    launches = []
    monkeypatch.setattr(ck, "get_kernel", lambda spec, name: _FakeKernel(name))
    monkeypatch.setattr(ck, "launch", lambda k, grid, block, args, shared_mem=0, stream=None:
                        launches.append((k.name, tuple(grid), tuple(block), args, shared_mem)))
    monkeypatch.setattr(ck, "_sm_count", lambda: 132)
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=None: _FakeDev(np.atleast_1d(shape), dtype))
    monkeypatch.delenv("MATE_CUPY_KDA_CHUNK_WARPS", raising=False)
    B, T, H, HV = (1, 1000, 2, 64) if varlen else (2, 130, 2, 4)
    N = 3 if varlen else B
    a = dict(q=_FakeDev((B, T, H, K), BF16), k=_FakeDev((B, T, H, K), BF16), v=_FakeDev((B, T, HV, K), BF16),
             g=_FakeDev((B, T, HV, K), BF16), beta=_FakeDev((B, T, HV), BF16),
             A_log=_FakeDev((HV,), F32) if gate else None, dt_bias=_FakeDev((HV * K,), F32) if gate else None,
             initial_state=None if s_in is None else _FakeDev((N, HV, K, K), s_in),
             final_state=None if s_out is None else _FakeDev((N, HV, K, K), s_out),
             cu_seqlens=_FakeDev((N + 1,), np.int64) if varlen else None, out=_FakeDev((B, T, HV, K), BF16))
    ck.run_chunk(**a, scale=0.1, lower_bound=-5.0, use_qk_l2norm=True)
    names = [n.split("<")[0] for n, *_ in launches]
    assert names == (["kda_chunk_offsets_kernel"] if varlen else []) + ["kda_chunk_prepare_kernel",
                                                                       "kda_chunk_recurrence_kernel"]
    for name, grid, block, args, smem in launches:
        base = name.split("<")[0]
        assert [_arg_kind(x) for x in args] == _kernel_params(base), name
        if base == "kda_chunk_prepare_kernel":
            assert grid == (ck.num_chunk_slots(B, T, N, varlen), HV) and block == (ck.PREPARE_THREADS,)
            assert smem == ck.PREPARE_SMEM
        if base == "kda_chunk_recurrence_kernel":
            nw = int(name.split(",")[1].strip(" >"))
            assert nw == ck.recurrence_warps(N * HV, 132)
            assert grid == (N * 128 // (16 * nw), HV) and block == (32 * nw,) and smem == ck.recurrence_smem(nw)
            kinds = (args[4], args[6])
            assert kinds == (np.int32({None: 0, F32: 1, BF16: 2}[s_in]), np.int32({None: 0, F32: 1, BF16: 2}[s_out]))


# ----------------------------------------------------------------------------- CPU: the kernel source, emulated

EMU_CASES = [
    pytest.param(dict(B=2, T=65, H=1, HV=2, gate_params=True, state=F32), dict(nw=4, s_out=F32), id="dense-gate"),
    pytest.param(dict(B=0, T=0, H=1, HV=2, gate_params=False, extreme=True, lens=[70, 0, 1, 129], state=BF16),
                 dict(nw=2, s_out=BF16, lazy=1, cu64=True), id="varlen-extreme-lazy"),
    pytest.param(dict(B=1, T=64, H=1, HV=4, dtype=F16, gate_params=True), dict(nw=8, s_out=None, l2=False),
                 id="fp16-gva4-nol2"),
    pytest.param(dict(B=1, T=100, H=1, HV=1, gate_params=False, extreme=True, state=F32), dict(nw=1, s_out=F32),
                 id="extreme-nw1"),
    pytest.param(dict(B=0, T=0, H=1, HV=2, gate_params=True, lens=[30, 64, 97], state=F32),
                 dict(nw=2, s_out=F32, baseline=1), id="baseline-prepare"),
]


@pytest.fixture(scope="module")
def kda_emulator(tmp_path_factory):
    """The CPU SIMT emulator (tests/kda_chunk_emu) built around cuda_src/kda_chunk.cu."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    from mate_cupy.jit.compiler import cuda_include_dirs

    if shutil.which("g++") is None or not cuda_include_dirs():
        pytest.skip("needs g++ and the CUDA fp16/bf16 headers")
    emu = Path(__file__).resolve().parent / "kda_chunk_emu"
    src = (Path(ck.__file__).resolve().parent.parent / "cuda_src" / "kda_chunk.cu").read_text()
    for inc in ('#include "common/dtype.cuh"', '#include "common/mma.cuh"', '#include "common/kda_chunk_ops.cuh"'):
        assert inc in src
        src = src.replace(inc, "")
    decl = "extern __shared__ __align__(16) unsigned char smem[];"
    assert src.count(decl) == 3  # prepare, baseline prepare, recurrence
    d = tmp_path_factory.mktemp("kda_emu")
    (d / "kda_chunk_emu.inc").write_text(src.replace(decl, "unsigned char* smem = emu::dyn_smem();"))
    flags = ["-O1", "-g", "-fsanitize=address,undefined"] if os.environ.get("MATE_CUPY_EMU_SANITIZE") else ["-O2"]
    exe = d / "driver"
    cmd = ["g++", "-std=c++20", *flags, f"-I{emu}", f"-I{emu.parent / 'cuda_emu'}", f"-I{d}",
           *(f"-I{i}" for i in cuda_include_dirs()),
           str(emu / "driver.cpp"), "-o", str(exe), "-lpthread"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return exe


@pytest.mark.slow
@pytest.mark.parametrize("kw, run", EMU_CASES)
def test_kernel_source_emulated_matches_model(rng, tmp_path, kda_emulator, kw, run):
    """cuda_src/kda_chunk.cu itself, run on the CPU emulator: outputs, final states and
    every workspace part agree with the float32 model (indexing, fragments, masks, bounds)."""
    import os
    import subprocess

    dtype = kw.get("dtype", BF16)
    x = make_inputs(rng, **kw)
    l2 = run.get("l2", True)
    if not l2:
        for n in ("q", "k"):
            x[n] = (x[n].astype(np.float32) / 11.3).astype(dtype)
    varlen = "cu_seqlens" in x
    B, T, H, _ = x["q"].shape
    HV = x["v"].shape[2]
    N = len(x["cu_seqlens"]) - 1 if varlen else B
    if varlen and run.get("cu64"):
        x["cu_seqlens"] = x["cu_seqlens"].astype(np.int64)
    for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "initial_state"):
        if x.get(name) is not None:
            np.ascontiguousarray(x[name]).tofile(tmp_path / f"{name.replace('cu_seqlens', 'cu').replace('initial_state', 'h0')}.bin")
    kind = {None: 0, F32: 1, BF16: 2}
    s_in = None if x.get("initial_state") is None else x["initial_state"].dtype
    s_out = run.get("s_out")
    scale = K ** -0.5
    (tmp_path / "params.txt").write_text(
        f"{B} {T} {H} {HV} {N} {int(varlen)} {int(dtype == BF16)} {int('A_log' in x)} {int(l2)} {scale} -5.0 "
        f"{kind[s_in]} {kind[s_out]} {int(varlen and x['cu_seqlens'].dtype == np.int64)} {run['nw']} {run.get('lazy', 0)} "
        f"{run.get('baseline', 0)}\n")
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0")  # the driver leaves its buffers to process exit
    r = subprocess.run([str(kda_emulator), str(tmp_path)], capture_output=True, text=True, timeout=1800, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    rec: dict = {}
    o_model, s_model = model_chunk_kda(x, op=dtype, l2=l2, record=rec,
                                       offdiag_ref="above" if run.get("baseline") else "mid")
    out = np.fromfile(tmp_path / "out.bin", dtype=dtype).reshape(x["v"].shape)
    assert rel(out, _round(o_model, dtype)) < 2e-3
    if s_out is not None:
        fs = np.fromfile(tmp_path / "ht.bin", dtype=s_out).reshape(N, HV, K, K)
        assert rel(fs, _round(s_model, s_out)) < 2e-3
    ws = np.fromfile(tmp_path / "ws.bin", dtype=np.uint8)
    lens = np.diff(x["cu_seqlens"]) if varlen else [T] * B
    parts = {"Qs": (0, (C, K), dtype), "Kt": (16384, (C, K), dtype), "Kb": (32768, (C, K), dtype),
             "T": (49152, (C, C), dtype), "Aqk": (57344, (C, C), dtype), "egl": (65536, (K,), F32)}
    slot = 0
    for n, ln in enumerate(lens):
        nch = (int(ln) + C - 1) // C
        for hv in range(HV):
            for c in range(nch):
                blob = ws[((slot + c) * HV + hv) * ck.SLOT_BYTES:][:ck.SLOT_BYTES]
                for name, (off, shape, dt) in parts.items():
                    got = blob[off:off + int(np.prod(shape)) * dt.itemsize].view(dt).reshape(shape)
                    assert rel(got, rec[(n, hv)][c][name]) < 5e-3, (n, hv, c, name)
        slot += nch
