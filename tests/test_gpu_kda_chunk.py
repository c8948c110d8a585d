"""chunk_kda CUDA kernels (cuda_src/kda_chunk.cu) against the float64 recurrence.

CPU tests: a float32 NumPy model of the kernels' exact decomposition (chunk 64, 16-row
sub-blocks, tf32 products for Aqk/Akk, operand rounding to the input dtype where the
kernels round) is compared with ``kda_recurrent``; its error sets the GPU tolerances.
CPU tests of the launcher: parameter tables against the kernel signatures in the source,
the configuration choice, and launch dry runs on CUDA stand-ins (NumPy arrays described as
CUDA arrays). GPU tests: the public ``chunk_kda`` against ``kda_recurrent`` on fresh random
inputs with NaN-poisoned outputs, every recurrence width, the phase-1 workspace (read from a
caller's workspace) against the model, and caller workspace + preallocated outputs (no
allocation, graph capture) against the default call.
"""
from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from helpers import kernel_params, side_stream, to_f64, torch_side_stream
from mate_cupy.kda import chunk as ch
from mate_cupy.jit import address
from mate_cupy.kda import chunk_launch as cl
from mate_cupy.reference.kda import kda_recurrent
from test_kda_chunk import STREAM, StandinCall, cuda_standins, standin_workspace, validate_args  # noqa: F401

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
K = 128
C = 64
LOG2E = np.float32(1.4426950408889634)
SRC = Path(cl.__file__).resolve().parent.parent / "cuda_src" / "kda_chunk.cu"
# Workspace slot parts (kda_chunk.cu kWs*): byte offset, shape, dtype (None: the input dtype).
SLOT_PARTS = {"Qs": (0, (C, K), None), "Kt": (16384, (C, K), None), "Kb": (32768, (C, K), None),
              "T": (49152, (C, C), None), "Aqk": (57344, (C, C), None), "egl": (65536, (K,), F32)}


# T and Aqk: the 16x16 blocks on and below the diagonal.
BLOCK_LOWER = np.kron(np.tril(np.ones((C // 16, C // 16), bool)), np.ones((16, 16), bool))


def tile_rows(raw, cols):
    """A [64][cols] 16-bit tile from its slot bytes (``raw``: uint8, 128 * cols bytes), stored
    as the wgmma recurrence's shared-memory image (kda_chunk.cu ``SlotTile``): column blocks
    of 64 values (8 KB), 16-byte chunk c of row r of a block at r * 128 + ((c ^ r % 8) * 16)."""
    blocks = raw.reshape(cols // 64, C, 8, 16)  # [block][row][stored chunk][byte]
    r = np.arange(C)[:, None]
    logical = blocks[:, r, np.arange(8)[None, :] ^ (r % 8)]  # [block][row][chunk][byte]
    return np.ascontiguousarray(logical.transpose(1, 0, 2, 3)).reshape(C, cols * 2)


def slot_part(blob, name, dtype):
    """Part ``name`` of one workspace slot (``blob``: its SLOT_BYTES bytes, uint8, host), in
    logical [row][column] order; T and Aqk must hold zeros above the diagonal blocks."""
    off, shape, dt = SLOT_PARTS[name]
    dt = dtype if dt is None else dt
    raw = blob[off:off + int(np.prod(shape)) * dt.itemsize]
    if name == "egl":
        return raw.view(dt).reshape(shape)
    part = tile_rows(raw, shape[1]).view(dt).reshape(shape)
    if name in ("T", "Aqk"):
        assert not part.view(np.uint16)[~BLOCK_LOWER].any(), f"{name}: nonzero above the diagonal blocks"
    return part

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
                diag_span_limit=60.0, record=None):
    """The kernels' computation for one value head of one sequence, in float32.

    q, k, v, g [T, 128] float32 (values of the input dtype), beta [T] logits, S [V, K]
    float32 (updated in place). ``record`` collects the phase-1 workspace per chunk.
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
            # Reference of the off-diagonal blocks J < I (kda_chunk.cu P2b): the mid row m when
            # the diagonal block is on the fast path, else the row above the block. The tf32
            # operands are the raw rows; the l2 scales multiply the products.
            sq, sk = qn[rows, None].astype(np.float32), kn[rows, None].astype(np.float32)
            if I > 0:
                ref = m if fast else gc[16 * I - 1][None, :]
                rq, rk = _tf32(qc[rows] * _ex2(gc[rows] - ref)), _tf32(kc[rows] * _ex2(gc[rows] - ref))
                for J in range(I):
                    cols = slice(16 * J, 16 * J + 16)
                    cb = _tf32(kc[cols] * _ex2(ref - gc[cols]))
                    knj = kn[None, cols].astype(np.float32)
                    Aqk[rows, cols] = (rq @ cb.T) * sq * knj
                    Akk[rows, cols] = (rk @ cb.T) * sk * knj
            if not fast:  # element-wise path
                d = gc[rows][:, None, :] - gc[rows][None, :, :]
                e = _ex2(np.where(tril[:, :, None], d, -np.inf))
                aq = (qq[rows][:, None, :] * kk[rows][None, :, :] * e).sum(-1)
                ak = (kk[rows][:, None, :] * kk[rows][None, :, :] * e).sum(-1)
            else:
                with np.errstate(over="ignore", invalid="ignore"):
                    cb = _tf32(kc[rows] * _ex2(m - gc[rows]))
                    knj = kn[None, rows].astype(np.float32)
                    aq = (_tf32(qc[rows] * _ex2(gc[rows] - m)) @ cb.T) * sq * knj
                    ak = (_tf32(kc[rows] * _ex2(gc[rows] - m)) @ cb.T) * sk * knj
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


# ----------------------------------------------------------------------------- CPU: launcher and configuration


def c_params(kernel: str) -> list:
    """``(name, kind)`` of each parameter of the ``__global__`` kernel ``kernel`` in kda_chunk.cu."""
    return kernel_params(SRC, kernel)


@pytest.mark.parametrize("kernel, params", [("kda_chunk_offsets_kernel", cl.OFFSETS_PARAMS),
                                            ("kda_chunk_prepare_kernel", cl.PREPARE_PARAMS),
                                            ("kda_chunk_recurrence_kernel", cl.RECURRENCE_PARAMS),
                                            ("kda_chunk_recurrence_wgmma_kernel", cl.RECURRENCE_PARAMS)])
def test_kernel_params_match_source(kernel, params):
    assert c_params(kernel) == list(params.params)


def test_registered_variants_are_the_launched_kernels():
    from mate_cupy.jit import registered

    src = SRC.read_text()
    assert sorted(re.findall(r"__global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(", src)) == sorted(
        ["kda_chunk_offsets_kernel", "kda_chunk_prepare_kernel", "kda_chunk_recurrence_kernel",
         "kda_chunk_recurrence_wgmma_kernel"])
    specs = [sp for sp in registered() if sp.source == "kda_chunk.cu"]
    launched = {cl.OFFSETS_KERNEL, *cl.PREPARE_KERNEL.values(), *cl.RECURRENCE_KERNEL.values(),
                *cl.WGMMA_RECURRENCE_KERNEL.values()}
    assert {k_ for sp in specs for k_ in sp.kernels} == launched
    assert len(specs) == 2 + 2 * len(cl.RECURRENCE_WARPS) + 2 * len(cl.WGMMA_RECURRENCE_WARPS)
    # the wgmma kernels build for sm_90a only, which is what select_config picks them for
    assert {sp.only_arch for sp in cl.WGMMA_RECURRENCE_SPECS.values()} == {"sm_90a"}
    assert ch.WGMMA_RECURRENCE_CC == (90,)


def test_layout_constants_match_source():
    src = SRC.read_text()
    const = {m.group(1): int(m.group(2)) for m in re.finditer(r"constexpr int (k\w+) = (\d+);", src)}
    assert const["kWsSlotBytes"] == cl.SLOT_BYTES and const["kC"] == cl.CHUNK and const["kD"] == cl.HEAD_DIM
    assert const["kPrepThreads"] == cl.PREPARE_THREADS
    assert f"static_assert(kPrepSmemBytes == {cl.PREPARE_SMEM}," in src
    for name, ws_const in (("Qs", "kWsQs"), ("Kt", "kWsKt"), ("Kb", "kWsKb"), ("T", "kWsT"), ("Aqk", "kWsAqk"),
                           ("egl", "kWsEgl")):
        assert SLOT_PARTS[name][0] == const[ws_const], name
    assert cl.SLOT_BYTES % 256 == 0  # the varlen offsets table after the slots stays aligned
    assert const["kWgV"] == cl.WGMMA_STAGE_V  # the wgmma stage: tiles, egl, then the V slice


def test_recurrence_warps_heuristic():
    wg = dict(widths=cl.WGMMA_RECURRENCE_WARPS, warp_cost=ch.WGMMA_WARP_COST)
    assert ch.recurrence_warps(64, 132, **wg) == 4   # wgmma, B1 H64: 128 one-warpgroup CTAs
    assert ch.recurrence_warps(32, 132, **wg) == 4   # B1 H32: 64 CTAs
    assert ch.recurrence_warps(96, 132, **wg) == 8   # B1 H96: one wave of 96 two-warpgroup CTAs
    assert ch.recurrence_warps(512, 132, **wg) == 8  # varlen 8 x H64
    assert ch.recurrence_warps(64, 132) == 4      # mma.sync, B1 H64: 128 CTAs
    assert ch.recurrence_warps(96, 132) == 8      # B1 H96: one wave of 96 CTAs
    assert ch.recurrence_warps(32, 132) == 2      # B1 H32: 128 two-warp CTAs (fastest in the H200 sweep)
    assert ch.recurrence_warps(512, 132) == 8     # varlen 8 x H64
    assert ch.recurrence_warps(512, 108, (1, 2, 4)) == 4  # sm_80: no 8-warp CTAs


def test_recurrence_widths_fit_the_device():
    assert ch.recurrence_widths(90) == ch.recurrence_widths(100) == (1, 2, 4, 8)
    assert ch.recurrence_widths(80) == (1, 2, 4)  # 163 KB per block: the 8-warp CTA needs 173 KB
    assert ch.recurrence_widths(86) == ch.recurrence_widths(75) == ()
    for cc, limit in ch.MAX_SMEM_PER_BLOCK.items():
        assert all(cl.recurrence_smem(nw) <= limit for nw in ch.recurrence_widths(cc))


def test_varlen_slot_bound(rng):
    for _ in range(50):
        lens = rng.integers(0, 300, rng.integers(1, 20))
        need = int(sum((n + C - 1) // C for n in lens))
        assert need <= cl.num_chunk_slots(1, int(lens.sum()), len(lens), True)
    assert cl.num_chunk_slots(3, 65, 3, False) == 6


def test_smem_fits():
    per_sm = 228 * 1024  # H100/H200: 228 KB per SM, 1 KB reserved per CTA, 227 KB per CTA at most
    assert 3 * (cl.PREPARE_SMEM + 1024) <= per_sm  # three prepare CTAs per SM
    assert all(cl.recurrence_smem(nw) <= 227 * 1024 for nw in cl.RECURRENCE_WARPS)
    # wgmma stages: four 1024-aligned tiles of 64 x 128 / 64 x 64, egl and the V slice; + 1 KB alignment
    assert cl.recurrence_smem(4, wgmma=True) == 2 * 75776 + 1024
    assert cl.recurrence_smem(8, wgmma=True) == 2 * 83968 + 1024 <= ch.MAX_SMEM_PER_BLOCK[90]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_kernels_compile_without_spills(dtype, arch):
    from mate_cupy.jit import compile_variant

    specs = [cl.PREPARE_SPECS[dtype]] + [cl.RECURRENCE_SPECS[(dtype, nw)] for nw in cl.RECURRENCE_WARPS]
    if arch == "sm_90a":
        specs += [cl.WGMMA_RECURRENCE_SPECS[(dtype, nw)] for nw in cl.WGMMA_RECURRENCE_WARPS]
    for spec in specs:
        log = compile_variant(spec, arch, ptxas_verbose=True)["log"]
        entries = log.count("Compiling entry function")
        assert entries >= len(spec.kernels)
        assert log.count("0 bytes spill stores, 0 bytes spill loads") == entries, log
        assert "wgmma.mma_async instructions are serialized" not in log, log


def test_select_config(rng, cuda_standins):
    x = make_inputs(rng, 0, 0, 2, 96, gate_params=True, lens=[1000, 3, 0])
    _, p, _ = ch.validate(**validate_args(x))
    cfg = ch.select_config(p, 132, 90)
    assert ch.select_config(p, 132, 90) is cfg  # pure, cached by the frozen problem
    # sm_90: the wgmma recurrence, 3 waves of 288 two-warpgroup CTAs
    assert cfg.recurrence_wgmma and cfg.recurrence_warps == 8
    assert cfg.num_slots == (1003 + 63 * 3) // 64 and cfg.prepare_grid == (cfg.num_slots, 96)
    assert cfg.recurrence_grid == (3 * 1, 96) and cfg.recurrence_smem == cl.recurrence_smem(8, wgmma=True)
    assert ch.select_config(p, 132, 100) == ch.chunk_config(p, 8)  # sm_100: mma.sync, 8 warps
    with pytest.raises(ValueError, match="no wgmma recurrence kernel of 2 warps"):
        ch.chunk_config(p, 2, wgmma=True)
    assert cfg.tail_at == cfg.num_slots * 96 * cl.SLOT_BYTES
    assert cfg.launch_offsets and cfg.launch_prepare and cfg.launch_recurrence
    a100 = ch.select_config(p, 108, 80)  # A100: mma.sync; 8-warp CTAs do not fit
    assert a100.recurrence_warps == 4 and not a100.recurrence_wgmma
    # nothing to run: no sequences, or no tokens and no final state
    _, p0, _ = ch.validate(**validate_args(make_inputs(rng, 0, 0, 1, 1, lens=[])))
    assert not ch.select_config(p0, 132, 90).launches_any
    _, p1, _ = ch.validate(**validate_args(make_inputs(rng, 2, 0, 1, 1)))
    c1 = ch.select_config(p1, 132, 90)
    assert not c1.launches_any
    _, p2, _ = ch.validate(**validate_args(dict(make_inputs(rng, 2, 0, 1, 1), output_final_state=True)))
    c2 = ch.select_config(p2, 132, 90)
    assert c2.launch_recurrence and not c2.launch_prepare and not c2.launch_offsets


def test_pipeline_segments_choice(rng, cuda_standins):
    """One dense sequence of 128+ chunks whose recurrence CTAs leave half the SMs free is
    split into segments of 64+ chunks (at most 8); every other problem runs unsplit."""
    def config(B, T, HV, lens=None, sm=132, cc=90):
        x = make_inputs(rng, B, T, 1, HV, gate_params=False, lens=lens)
        return ch.select_config(ch.validate(**validate_args(x))[1], sm, cc)

    c = config(1, 32768, 32)  # 32 heads x 2 four-warp CTAs = 64 <= 132 / 2
    assert c.recurrence_warps == 4 and c.pipeline_segments == 8
    assert c.tail_at == 512 * 32 * cl.SLOT_BYTES
    assert config(1, 8192, 2).pipeline_segments == 2  # 128 chunks
    assert config(1, 8191, 2).pipeline_segments == 2  # 128 chunks, the last partial
    assert config(1, 8128, 2).pipeline_segments == 1  # 127 chunks
    assert config(1, 12800, 2).pipeline_segments == 3
    assert config(1, 8192, 64).pipeline_segments == 1  # 128 CTAs: no SMs left for the prepare
    assert config(1, 8192, 64, sm=264).pipeline_segments == 2
    assert config(2, 8192, 2).pipeline_segments == 1  # two sequences
    assert config(1, 0, 2, lens=[8192]).pipeline_segments == 1  # varlen
    assert config(1, 8192, 2, cc=80).pipeline_segments == 2  # the mma.sync recurrence alike
    _, p, _ = ch.validate(**validate_args(make_inputs(rng, 1, 8192, 1, 2, gate_params=False)))
    assert ch.chunk_config(p, 4, True, segments=8).pipeline_segments == 8
    for bad in (0, 9):
        with pytest.raises(ValueError, match="pipelined segments"):
            ch.chunk_config(p, 4, True, segments=bad)
    _, p2, _ = ch.validate(**validate_args(make_inputs(rng, 2, 8192, 1, 2, gate_params=False)))
    with pytest.raises(ValueError, match="one dense sequence"):
        ch.chunk_config(p2, 4, True, segments=2)


@pytest.mark.parametrize("T", [8128, 8191, 8192, 20000, 32768])
@pytest.mark.parametrize("segments", [2, 3, 8])
def test_segment_bounds(T, segments):
    b = cl.segment_bounds(T, segments)
    assert len(b) == segments + 1 and b[0] == 0 and b[-1] == T
    assert all(x % cl.CHUNK == 0 for x in b[:-1])
    sizes = np.diff(b)
    assert (sizes > 0).all() and sizes.max() - sizes.min() <= 2 * cl.CHUNK


def test_workspace_holds_the_carry():
    """The carried state (float32 [HV, 128, 128]) follows the slots of one dense sequence of
    128+ chunks; the size still grows with every argument."""
    from mate_cupy import chunk_kda_workspace_bytes as wb

    assert wb(1, 8192, 4) == 128 * 4 * cl.SLOT_BYTES + 4 * 128 * 128 * 4
    assert wb(1, 8128, 4) == 127 * 4 * cl.SLOT_BYTES
    assert wb(2, 8192, 4) == 256 * 4 * cl.SLOT_BYTES
    assert wb(1, 8192, 4, num_seqs=1) == ((8192 + 63) // 64) * 4 * cl.SLOT_BYTES + 8
    for T in (8127, 8128, 8191, 8192, 8193):
        assert wb(1, T, 4) <= wb(1, T + 1, 4) <= wb(2, T + 1, 4) and wb(1, T, 4) <= wb(1, T, 5)


class _FakeKernel:
    def __init__(self, name):
        self.name = name
        self.raw = type("Raw", (), {})()


@pytest.fixture
def launches(monkeypatch, cuda_standins):
    """Launches of the chunk launcher, recorded instead of run: (kernel, grid, block, params,
    values, shared memory, stream); kernels are stand-ins named like the real ones."""
    rec = []
    monkeypatch.setattr(cl, "get_kernel", lambda spec, name, device_id=None: _FakeKernel(name))
    monkeypatch.setattr(cl, "launch", lambda kern, grid, block, params, values, shared_mem=0, stream=0:
                        rec.append((kern, tuple(grid), tuple(block), params, tuple(values), shared_mem, stream)))
    cl.prepare_kernel.cache_clear()
    yield rec
    cl.prepare_kernel.cache_clear()


def _ptr(a):
    return a.__array_interface__["data"][0]


DRY_CASES = [
    # varlen, gate params, initial state, final state, preallocated output/final state/workspace
    pytest.param(False, True, F32, F32, True, id="dense-gate-f32-prealloc"),
    pytest.param(True, False, None, BF16, True, id="varlen-bf16-final-prealloc"),
    pytest.param(True, True, BF16, None, False, id="varlen-gate-bf16-init-alloc"),
    pytest.param(False, False, None, None, False, id="dense-nostate-alloc"),
]


@pytest.mark.parametrize("varlen, gate, s_in, s_out, prealloc", DRY_CASES)
def test_launcher_dry_run(rng, launches, varlen, gate, s_in, s_out, prealloc):
    """Every launch: the kernel's parameter table and values that pack into it, grids,
    blocks, shared memory, the caller's stream, the caller's addresses, and no allocation
    when the caller gives outputs and workspace."""
    lens = [1000, 3, 0] if varlen else None
    x = make_inputs(rng, 2, 130, 2, 4, gate_params=gate, lens=lens, state=s_in)
    if varlen:
        x["cu_seqlens"] = x["cu_seqlens"].astype(np.int64)
    B, T, H, _ = x["q"].shape
    HV, N = 4, (3 if varlen else 2)
    kw = dict(x, output_final_state=s_out is not None)
    if prealloc:
        kw["output"] = np.full(x["v"].shape, np.nan, BF16)
        kw["final_state"] = np.full((N, HV, K, K), np.nan, s_out) if s_out is not None else None
        kw["workspace"] = standin_workspace(ch.chunk_kda_workspace_bytes(B, T, HV, N if varlen else None))
    res = ch.chunk_kda(**validate_args(kw))
    out = res[0] if s_out is not None else res
    assert StandinCall.allocations == ([] if prealloc else
                                       ["output"] + (["final_state"] if s_out is not None else []) + ["workspace"])
    if prealloc:
        assert out is kw["output"] and (s_out is None or res[1] is kw["final_state"])
    cfg = ch.select_config(ch.validate(**validate_args(kw))[1], 132, 90)
    names = [kern.name.split("<")[0] for kern, *_ in launches]
    assert names == (["kda_chunk_offsets_kernel"] if varlen else []) + ["kda_chunk_prepare_kernel",
                                                                       "kda_chunk_recurrence_wgmma_kernel"]
    table = {"kda_chunk_offsets_kernel": cl.OFFSETS_PARAMS, "kda_chunk_prepare_kernel": cl.PREPARE_PARAMS,
             "kda_chunk_recurrence_wgmma_kernel": cl.RECURRENCE_PARAMS}
    ws = None
    for kern, grid, block, params, values, smem, stream in launches:
        base = kern.name.split("<")[0]
        assert params is table[base] and stream == STREAM
        params.pack(values)  # count and types fit the kernel's parameter list
        v = dict(zip(params.names, values))
        if base == "kda_chunk_offsets_kernel":
            assert grid == (1,) and block == (1024,) and v["cu_is_64"] == 1 and v["num_seqs"] == N
        if base == "kda_chunk_prepare_kernel":
            ws = v["ws"]
            assert grid == (cl.num_chunk_slots(B, T, N, varlen), HV) and block == (cl.PREPARE_THREADS,)
            assert smem == cl.PREPARE_SMEM and v["has_gate"] == int(gate) and v["seq_len_dense"] == (0 if varlen else T)
            assert address(v["q"]) == _ptr(x["q"]) and address(v["beta"]) == _ptr(x["beta"])
            assert v["H"] == H and v["HV"] == HV and v["total_rows"] == B * T
        if base == "kda_chunk_recurrence_wgmma_kernel":  # the sm_90 stand-in device
            nw = int(kern.name.split(",")[1].strip(" >"))
            assert nw == cfg.recurrence_warps == ch.recurrence_warps(N * HV, 132, cl.WGMMA_RECURRENCE_WARPS,
                                                                     ch.WGMMA_WARP_COST)
            assert grid == (N * 128 // (16 * nw), HV) and block == (32 * nw,)
            assert smem == cl.recurrence_smem(nw, wgmma=True)
            kind = {None: 0, F32: 1, BF16: 2}
            assert (v["state_in_kind"], v["state_out_kind"]) == (kind[s_in], kind[s_out])
            assert v["ws"] == ws and v["num_slots"] == cfg.num_slots
            if prealloc:
                assert address(v["out"]) == _ptr(kw["output"])
        if varlen:
            table_at = v["offsets" if base == "kda_chunk_offsets_kernel" else "chunk_offsets"]
            assert table_at == ws_base(launches) + cfg.tail_at
    if prealloc:
        assert ws == _ptr(kw["workspace"])


def test_launcher_dry_run_pipelined(rng, launches, monkeypatch):
    """One long sequence in segments: each segment's prepare on the caller's stream, its
    recurrence on the side stream after an event edge from the caller's stream, the state
    carried in float32 through the workspace tail; the caller's stream joins at the end."""
    class FakeSide:
        ptr = 0x6000

        def wait_for(self, stream, i):
            launches.append(("wait_for", stream, i))

        def join(self, stream):
            launches.append(("join", stream))

    monkeypatch.setattr(cl, "side_stream", lambda device: FakeSide())
    T, HV, H = 8192 + 37, 4, 2
    x = make_inputs(rng, 1, T, H, HV, gate_params=True, state=BF16)
    ws = standin_workspace(ch.chunk_kda_workspace_bytes(1, T, HV))
    kw = dict(x, output_final_state=True, output=np.full(x["v"].shape, np.nan, BF16),
              final_state=np.full((1, HV, K, K), np.nan, BF16), workspace=ws)
    ch.chunk_kda(**validate_args(kw))
    cfg = ch.select_config(ch.validate(**validate_args(kw))[1], 132, 90)
    assert cfg.pipeline_segments == 2 and StandinCall.allocations == []
    bounds = cl.segment_bounds(T, 2)
    kinds = [r[0] if isinstance(r[0], str) else r[0].name.split("<")[0] for r in launches]
    assert kinds == ["kda_chunk_prepare_kernel", "wait_for", "kda_chunk_recurrence_wgmma_kernel"] * 2 + ["join"]
    assert [r[1:] for r in launches if r[0] == "wait_for"] == [(STREAM, 0), (STREAM, 1)]
    assert launches[-1] == ("join", STREAM)
    base, carry = _ptr(ws), _ptr(ws) + cfg.tail_at
    assert cfg.tail_at == 129 * HV * cl.SLOT_BYTES
    recs = [r for r in launches if not isinstance(r[0], str)]
    for s in range(2):
        (pk, pgrid, _, pparams, pvals, _, pstream), (rk, rgrid, _, rparams, rvals, _, rstream) = recs[2 * s:2 * s + 2]
        pparams.pack(pvals)
        rparams.pack(rvals)
        pv, rv = dict(zip(pparams.names, pvals)), dict(zip(rparams.names, rvals))
        t0, length = bounds[s], bounds[s + 1] - bounds[s]
        wseg = base + t0 // 64 * HV * cl.SLOT_BYTES
        assert pstream == STREAM and rstream == FakeSide.ptr
        assert pgrid == (-(-length // 64), HV) and rgrid == cfg.recurrence_grid
        assert pv["ws"] == rv["ws"] == wseg and pv["seq_len_dense"] == pv["total_rows"] == length
        assert pv["q"] == _ptr(x["q"]) + t0 * H * K * 2 and pv["beta"] == _ptr(x["beta"]) + t0 * HV * 2
        assert pv["g"] == _ptr(x["g"]) + t0 * HV * K * 2 and pv["cu_seqlens"] == 0 and pv["num_seqs"] == 1
        assert rv["v"] == _ptr(x["v"]) + t0 * HV * K * 2 and rv["out"] == _ptr(kw["output"]) + t0 * HV * K * 2
        assert rv["num_slots"] == -(-length // 64) and rv["seq_len_dense"] == length
        if s == 0:
            assert (address(rv["state_in"]), rv["state_in_kind"]) == (_ptr(x["initial_state"]), cl.STATE_BFLOAT16)
            assert (rv["state_out"], rv["state_out_kind"]) == (carry, cl.STATE_FLOAT32)
        else:
            assert (rv["state_in"], rv["state_in_kind"]) == (carry, cl.STATE_FLOAT32)
            assert (address(rv["state_out"]), rv["state_out_kind"]) == (_ptr(kw["final_state"]), cl.STATE_BFLOAT16)


@pytest.mark.parametrize("case", ["no-tokens", "no-sequences", "no-sequences-with-rows", "no-heads"])
def test_launcher_dry_run_nothing_to_do(rng, launches, case):
    """No launch, no kernel load, no workspace when there is nothing to compute."""
    x = {"no-tokens": lambda: make_inputs(rng, 2, 0, 1, 2),
         "no-sequences": lambda: make_inputs(rng, 0, 0, 1, 2, lens=[]),
         "no-sequences-with-rows": lambda: dict(make_inputs(rng, 1, 100, 1, 2, gate_params=False),
                                                cu_seqlens=np.zeros(1, np.int32)),
         "no-heads": lambda: dict(make_inputs(rng, 2, 5, 1, 2, gate_params=False), v=np.zeros((2, 5, 0, K), BF16),
                                  g=np.zeros((2, 5, 0, K), BF16), beta=np.zeros((2, 5, 0), BF16))}[case]()
    out = ch.chunk_kda(**validate_args(x))
    assert out.shape == x["v"].shape and launches == [] and StandinCall.allocations == ["output"]


def ws_base(launches):
    prep = next(r for r in launches if r[0].name.startswith("kda_chunk_prepare_kernel"))
    return dict(zip(prep[3].names, prep[4]))["ws"]


def test_launcher_dry_run_staging(rng, launches):
    """Arrays the problem stages are copied (values kept) before the launches and staged
    results copied back after; fp16 states go through float32."""
    x = make_inputs(rng, 2, 70, 1, 2, dtype=F16, gate_params=True, state=F16)
    nc = lambda a: np.repeat(a, 2, axis=1)[:, ::2]  # noqa: E731
    q = nc(x["q"])
    out = np.full((2, 140, 2, K), np.nan, F16)[:, ::2]
    fs = np.full((2, 2, K, K), np.nan, F16)
    A_log = x["A_log"].astype(np.float64)
    dt_bias = x["dt_bias"].astype(BF16)
    ws = standin_workspace(ch.chunk_kda_workspace_bytes(2, 70, 2))
    ch.chunk_kda(**validate_args(dict(x, q=q, A_log=A_log, dt_bias=dt_bias, output=out, output_final_state=True,
                                      final_state=fs, workspace=ws)))
    assert sorted(StandinCall.allocations) == sorted(["q", "A_log", "dt_bias", "initial_state", "output_staged",
                                                      "final_state_f32"])
    prep = next(r for r in launches if r[0].name.startswith("kda_chunk_prepare_kernel"))
    v = dict(zip(prep[3].names, prep[4]))
    assert np.array_equal(v["q"].data, q) and v["q"].data.flags.c_contiguous
    assert v["A_log"].data.dtype == F32 and np.array_equal(v["A_log"].data, A_log.astype(F32))
    assert v["dt_bias"].data.dtype == F32 and np.array_equal(v["dt_bias"].data, dt_bias.astype(F32))
    rec = next(r for r in launches if r[0].name.startswith("kda_chunk_recurrence_wgmma_kernel"))
    r = dict(zip(rec[3].names, rec[4]))
    assert r["state_in_kind"] == r["state_out_kind"] == 1
    assert np.array_equal(r["state_in"].data, x["initial_state"].astype(F32))
    # the stand-in kernels wrote nothing: the zeros of the staged results were copied back
    assert (out == 0).all() and (fs == 0).all()


# ----------------------------------------------------------------------------- GPU


def _dev(x):
    import cupy

    return {k_: (cupy.asarray(v_) if isinstance(v_, np.ndarray) else v_) for k_, v_ in x.items()}


def _nan(shape, dtype):
    import cupy

    a = cupy.empty(shape, dtype=dtype)
    a.fill(np.nan)
    return a


def _num_seqs(x):
    return len(x["cu_seqlens"]) - 1 if "cu_seqlens" in x else x["q"].shape[0]


def _run_public(x, state_out=None, **kw):
    """chunk_kda on device copies of ``x`` with NaN-poisoned preallocated outputs."""
    from mate_cupy import chunk_kda

    d = _dev(x)
    out = _nan(x["v"].shape, x["v"].dtype)
    fs = None if state_out is None else _nan((_num_seqs(x), x["v"].shape[2], K, K), state_out)
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


def _run_width(x, warps, wgmma=False):
    """The CUDA path with ``warps`` warps per recurrence CTA of the wgmma or the mma.sync
    kernel (the configuration made by hand)."""
    d = _dev(x)
    out = _nan(x["v"].shape, x["v"].dtype)
    fs = _nan((_num_seqs(x), x["v"].shape[2], K, K), F32)
    call, p, ws = ch.validate(**validate_args(dict(d, output=out, output_final_state=True, final_state=fs)))
    ch.run_cuda(call, p, ch.chunk_config(p, warps, wgmma), ws)
    return out, fs


RECURRENCE_KERNELS = ([pytest.param(nw, False, id=f"mma-{nw}w") for nw in cl.RECURRENCE_WARPS]
                      + [pytest.param(nw, True, id=f"wgmma-{nw}w") for nw in cl.WGMMA_RECURRENCE_WARPS])


def _skip_unless_runs(nw, wgmma):
    from mate_cupy.runtime.device import device_info

    cc = device_info()[1]
    if wgmma and cc != 90:
        pytest.skip("the wgmma recurrence is built for sm_90a only")
    if not wgmma and nw not in ch.recurrence_widths(cc):
        pytest.skip(f"{nw}-warp recurrence CTAs do not fit this device's shared memory")


@pytest.mark.gpu
@pytest.mark.parametrize("nw, wgmma", RECURRENCE_KERNELS)
def test_chunk_every_recurrence_width(rng, nw, wgmma):
    """Every V-slice width of a recurrence kernel gives bitwise the same result (warps and
    warpgroups never share data), and each kernel matches the float64 recurrence."""
    _skip_unless_runs(nw, wgmma)
    x = make_inputs(rng, 0, 0, 1, 2, gate_params=True, lens=[300, 1, 64, 0, 129], state=F32)
    base, base_s = _run_width(x, cl.WGMMA_RECURRENCE_WARPS[0] if wgmma else 1, wgmma)
    out, fs = _run_width(x, nw, wgmma)
    np.testing.assert_array_equal(to_f64(out), to_f64(base))
    np.testing.assert_array_equal(to_f64(fs), to_f64(base_s))
    o_ref, s_ref = reference(x)
    assert rel(out, o_ref) < TOL[BF16]
    assert rel(fs, s_ref) < STATE_TOL[BF16]
    np.testing.assert_array_equal(to_f64(fs[3]), to_f64(x["initial_state"][3]))  # the empty sequence


WGMMA_EDGE_CASES = [
    # dtype, B, T, H, HV, gate params, initial state, final state, varlen lengths
    pytest.param(BF16, 3, 1, 1, 2, True, F32, F32, None, id="bf16-T1"),
    pytest.param(BF16, 1, 63, 1, 4, False, BF16, BF16, None, id="bf16-T63-gva4"),
    pytest.param(F16, 2, 65, 2, 4, True, F32, F32, None, id="fp16-T65-gva2"),
    pytest.param(BF16, 1, 257, 2, 6, True, None, F32, None, id="bf16-T257-gva3"),
    pytest.param(F16, 1, 0, 1, 2, True, F16, F16, [0, 1, 0, 63, 64, 65, 0, 193], id="fp16-varlen-empties"),
    pytest.param(BF16, 1, 0, 2, 4, False, F32, F32, [129, 0, 2, 700], id="bf16-varlen-logdecay"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("nw", cl.WGMMA_RECURRENCE_WARPS, ids=lambda nw: f"{nw}w")
@pytest.mark.parametrize("dtype, B, T, H, HV, gate, s_in, s_out, lens", WGMMA_EDGE_CASES)
def test_chunk_wgmma_recurrence_edges(rng, nw, dtype, B, T, H, HV, gate, s_in, s_out, lens):
    """The wgmma recurrence at both widths on chunk tails (1, 63, 65, 64 k + 1 tokens), empty
    sequences, GVA, every state dtype: against the float64 recurrence, NaN-poisoned outputs."""
    _skip_unless_runs(nw, True)
    x = make_inputs(rng, B, T, H, HV, dtype=dtype, gate_params=gate, lens=lens, state=s_in)
    o_ref, s_ref = reference(x)
    d = _dev(x)
    out = _nan(x["v"].shape, dtype)
    fs = _nan((_num_seqs(x), HV, K, K), s_out)
    call, p, ws = ch.validate(**validate_args(dict(d, output=out, output_final_state=True, final_state=fs)))
    ch.run_cuda(call, p, ch.chunk_config(p, nw, wgmma=True), ws)
    assert rel(out, o_ref) < TOL[dtype]
    assert rel(fs, s_ref) < STATE_TOL[dtype]
    for n, ln in enumerate(lens or []):
        if ln == 0 and s_in is not None:  # empty sequences keep their initial state (rounded once)
            np.testing.assert_array_equal(to_f64(fs[n]), to_f64(x["initial_state"][n].astype(s_out)))


@pytest.mark.gpu
def test_chunk_runs_the_wgmma_recurrence_on_sm90(rng):
    """On an H100/H200 the public path (the GPU tests above) runs the wgmma recurrence."""
    from mate_cupy.runtime.device import device_info

    sm_count, cc = device_info()
    if cc != 90:
        pytest.skip("not an sm_90 device")
    x = make_inputs(rng, 1, 100, 1, 2)
    _, p, _ = ch.validate(**validate_args(_dev(x)))
    assert ch.select_config(p, sm_count, cc).recurrence_wgmma


@pytest.mark.gpu
@pytest.mark.parametrize("T, segments, s_in, s_out", [
    pytest.param(8192 + 37, 2, F32, F32, id="T8229-2seg-f32"),
    pytest.param(12800, 3, BF16, BF16, id="T12800-3seg-bf16"),
    pytest.param(8192, 8, None, None, id="T8192-8seg-nostate"),
])
def test_chunk_pipelined_equals_unsplit(rng, T, segments, s_in, s_out):
    """Prepare and recurrence overlapped in segments give bitwise the unsplit result (the
    state crosses segments in float32), at every recurrence kernel this device runs; the
    float64 recurrence agrees on the first tokens. NaN-poisoned outputs."""
    from mate_cupy.runtime.device import device_info

    sm_count, cc = device_info()
    x = make_inputs(rng, 1, T, 1, 2, gate_params=True, state=s_in)
    d = _dev(x)

    def run(segments):
        out = _nan(x["v"].shape, BF16)
        fs = None if s_out is None else _nan((1, 2, K, K), s_out)
        call, p, ws = ch.validate(**validate_args(dict(d, output=out, output_final_state=s_out is not None,
                                                       final_state=fs)))
        base = ch.select_config(p, sm_count, cc)
        ch.run_cuda(call, p, ch.chunk_config(p, base.recurrence_warps, base.recurrence_wgmma, segments), ws)
        return out, fs

    out1, fs1 = run(1)
    out, fs = run(segments)
    np.testing.assert_array_equal(to_f64(out), to_f64(out1))
    assert not np.isnan(to_f64(out)).any()
    if s_out is not None:
        np.testing.assert_array_equal(to_f64(fs), to_f64(fs1))
    head = {n: (a[:, :200] if n in ("q", "k", "v", "g", "beta") else a) for n, a in x.items()}
    o_ref, _ = reference(head)
    assert rel(to_f64(out)[:, :200], o_ref) < TOL[BF16]


@pytest.mark.gpu
def test_chunk_pipelined_in_cuda_graph_and_torch_stream(rng):
    """The overlapped path (side stream, event edges) captured into a CUDA graph and replayed,
    and run on a torch stream: the eager result, bitwise."""
    import cupy

    from mate_cupy import chunk_kda

    x = make_inputs(rng, 1, 8192, 1, 2, gate_params=True, state=F32)
    d = _dev(x)
    _, p, _ = ch.validate(**validate_args(d))
    from mate_cupy.runtime.device import device_info

    assert ch.select_config(p, *device_info()).pipeline_segments == 2
    want, want_s = chunk_kda(**d, output_final_state=True)
    out, fs = _nan(x["v"].shape, BF16), _nan((1, 2, K, K), F32)
    ws = cupy.empty(ch.chunk_kda_workspace_bytes(1, 8192, 2), np.uint8)
    stream = side_stream()
    with stream:
        chunk_kda(**d, output_final_state=True, output=out, final_state=fs, workspace=ws)  # warm
        out.fill(0)
        stream.begin_capture()
        chunk_kda(**d, output_final_state=True, output=out, final_state=fs, workspace=ws)
        graph = stream.end_capture()
        out[...] = _nan(x["v"].shape, BF16)
        fs[...] = _nan((1, 2, K, K), F32)
        graph.launch()
    stream.synchronize()
    np.testing.assert_array_equal(to_f64(out), to_f64(want))
    np.testing.assert_array_equal(to_f64(fs), to_f64(want_s))
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        return
    t = {k_: (torch.from_dlpack(v_) if isinstance(v_, cupy.ndarray) else v_) for k_, v_ in d.items()}
    ts = torch_side_stream()
    with torch.cuda.stream(ts):
        o_t, s_t = chunk_kda(**t, output_final_state=True)
    ts.synchronize()
    np.testing.assert_array_equal(to_f64(cupy.from_dlpack(o_t)), to_f64(want))
    np.testing.assert_array_equal(to_f64(cupy.from_dlpack(s_t)), to_f64(want_s))


@pytest.mark.gpu
@pytest.mark.parametrize("gates", ["gate", "extreme"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_chunk_workspace_matches_model(rng, dtype, gates):
    """Phase 1, read from the caller's workspace: every part of every (chunk, head) against
    the model (``extreme``: decays of -30 / -100 put diagonal blocks on the element-wise path)."""
    import cupy

    from mate_cupy import chunk_kda, chunk_kda_workspace_bytes

    lens = [70, 1, 128]
    x = make_inputs(rng, 0, 0, 1, 2, dtype=dtype, gate_params=gates == "gate", extreme=gates == "extreme", lens=lens,
                    state=F32)
    ws = cupy.empty(chunk_kda_workspace_bytes(1, sum(lens), 2, num_seqs=len(lens)), np.uint8)
    chunk_kda(**_dev(x), workspace=ws)
    blob = ws.get()
    rec: dict = {}
    model_chunk_kda(x, op=dtype, record=rec)
    slot = 0
    for n, ln in enumerate(lens):
        nch = (ln + C - 1) // C
        for hv in range(2):
            for c in range(nch):
                part = blob[((slot + c) * 2 + hv) * cl.SLOT_BYTES:][:cl.SLOT_BYTES]
                m = rec[(n, hv)][c]
                for name in ("Qs", "Kt", "Kb", "T", "Aqk"):
                    got = to_f64(slot_part(part, name, dtype))
                    assert rel(got, m[name]) < 5e-3, (n, hv, c, name, rel(got, m[name]))
                # egl = 2^gl per channel (ex2.approx: ~2^-22 relative; results below 2^-126
                # flush to zero, so values near that edge may differ by a few 1e-38). gl is a
                # float32 sum of up to 64 gates: |gl| ~ 100 carries ~1e-5 absolute rounding, which
                # 2^gl turns into ~1e-5 relative, hence rtol 5e-5.
                np.testing.assert_allclose(to_f64(slot_part(part, "egl", dtype)), to_f64(m["egl"]), rtol=5e-5,
                                           atol=1e-37, err_msg=str((n, hv, c)))
        slot += nch
    # the varlen chunk-offsets table follows the slots
    offsets_at = cl.workspace_layout(1, sum(lens), 2, len(lens), True)[1]
    np.testing.assert_array_equal(blob[offsets_at:offsets_at + 16].view(np.int32), [0, 2, 3, 5])


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_chunk_caller_workspace_and_outputs_equal_default(rng, layout):
    """A call with the caller's workspace and preallocated outputs gives the default call's
    bits, allocates nothing (CuPy's allocator refuses during the call) and captures into a
    CUDA graph in global capture mode (no synchronisation, no allocation)."""
    import cupy

    from mate_cupy import chunk_kda, chunk_kda_workspace_bytes
    from mate_cupy.runtime.workspace import Workspace

    if layout == "dense":
        x = make_inputs(rng, 2, 300, 2, 4, gate_params=True, state=F32)
        state, need = F32, chunk_kda_workspace_bytes(2, 300, 4)
    else:
        lens = [1, 0, 130, 64, 257]
        x = make_inputs(rng, 0, 0, 2, 4, gate_params=False, lens=lens, state=BF16)
        state, need = BF16, chunk_kda_workspace_bytes(1, sum(lens), 4, num_seqs=len(lens))
    d = _dev(x)
    ref_out, ref_fs = chunk_kda(**d, output_final_state=True)
    shape_fs = (_num_seqs(x), 4, K, K)

    ws = Workspace(need)
    out, fs = _nan(x["v"].shape, BF16), _nan(shape_fs, state)
    chunk_kda(**d, output_final_state=True, output=out, final_state=fs, workspace=ws)  # loads the kernels
    out.fill(np.nan)
    fs.fill(np.nan)
    pool = cupy.get_default_memory_pool()

    def refuse(nbytes):
        raise AssertionError(f"chunk_kda allocated {nbytes} bytes")

    cupy.cuda.set_allocator(refuse)
    try:
        res = chunk_kda(**d, output_final_state=True, output=out, final_state=fs, workspace=ws)
    finally:
        cupy.cuda.set_allocator(pool.malloc)
    assert res[0] is out and res[1] is fs
    np.testing.assert_array_equal(to_f64(out), to_f64(ref_out))
    np.testing.assert_array_equal(to_f64(fs), to_f64(ref_fs))

    ws_array = cupy.empty(need, np.uint8)  # any contiguous CUDA array serves as well
    out2, fs2 = _nan(x["v"].shape, BF16), _nan(shape_fs, state)
    stream = side_stream()
    with stream:
        stream.begin_capture(cupy.cuda.runtime.streamCaptureModeGlobal)
        try:
            chunk_kda(**d, output_final_state=True, output=out2, final_state=fs2, workspace=ws_array)
        finally:
            graph = stream.end_capture()
    graph.launch(stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(to_f64(out2), to_f64(ref_out))
    np.testing.assert_array_equal(to_f64(fs2), to_f64(ref_fs))


@pytest.mark.gpu
def test_chunk_staged_layouts_equal_direct(rng):
    """Non-contiguous and misaligned arrays, float64/bfloat16 gate parameters: the same bits
    as contiguous, aligned, float32 ones (the staging copies are exact)."""
    import cupy

    from mate_cupy import chunk_kda

    x = make_inputs(rng, 2, 150, 1, 2, gate_params=True, state=F32)
    x["dt_bias"] = x["dt_bias"].astype(BF16).astype(F32)  # exactly representable in bf16
    d = _dev(x)
    ref_out, ref_fs = chunk_kda(**d, output_final_state=True)

    def odd(a):  # same values, contiguous, one element off 16-byte alignment
        flat = cupy.empty(a.size + 8, a.dtype)
        v = flat[1:1 + a.size].reshape(a.shape)
        v[...] = a
        return v

    nc = lambda a: cupy.repeat(a, 2, axis=1)[:, ::2]  # noqa: E731
    y = dict(d, q=nc(d["q"]), k=odd(d["k"]), v=odd(d["v"]), g=nc(d["g"]), beta=nc(d["beta"]),
             A_log=d["A_log"].astype(np.float64), dt_bias=cupy.asarray(x["dt_bias"].astype(BF16)),
             initial_state=odd(d["initial_state"]))
    out = odd(_nan(x["v"].shape, BF16))
    fs = _nan((2, 2, K, 2 * K), F32)[..., ::2]
    res = chunk_kda(**y, output_final_state=True, output=out, final_state=fs)
    assert res[0] is out and res[1] is fs
    np.testing.assert_array_equal(to_f64(out), to_f64(ref_out))
    np.testing.assert_array_equal(to_f64(fs), to_f64(ref_fs))


@pytest.mark.gpu
def test_chunk_torch_tensors(rng):
    """torch CUDA tensors: results in torch, on torch's current stream, allocated by torch."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    from mate_cupy import chunk_kda

    x = make_inputs(rng, 0, 0, 1, 2, gate_params=True, lens=[100, 3], state=F32)
    ref_out, ref_fs = chunk_kda(**_dev(x), output_final_state=True)
    t = {k_: torch.from_dlpack(v_) for k_, v_ in _dev(x).items()}
    stream = torch_side_stream()
    with torch.cuda.stream(stream):
        out, fs = chunk_kda(**t, output_final_state=True)
    stream.synchronize()
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and fs.dtype == torch.float32
    np.testing.assert_array_equal(to_f64(out.float().cpu().numpy()), to_f64(ref_out))
    np.testing.assert_array_equal(fs.cpu().numpy(), to_f64(ref_fs).astype(np.float32))


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
    """Offsets past the end or decreasing are clamped: no write outside ``output``."""
    import cupy

    from mate_cupy import chunk_kda

    x = make_inputs(rng, 0, 0, 1, 1, gate_params=False, lens=[100, 200])
    d = _dev(x)
    S = x["q"].shape[1]
    guard = _nan((1, S + 256, 1, K), BF16)
    out = guard[:, 128:128 + S]  # contiguous and aligned: the kernels write into guard directly
    # past the end, huge, decreasing/negative, valid, overlapping (more chunks than slots)
    for cu in ([0, 250, 100], [0, 10 ** 6, 2 ** 31 - 1], [5, -3, 40], [0, 300, 300], [0, 300, 0, 300]):
        cu = cupy.asarray(np.asarray(cu, np.int64))
        fs = _nan((len(cu) - 1, 1, K, K), F32)
        chunk_kda(**dict(d, cu_seqlens=cu), output=out, output_final_state=True, final_state=fs)
        cupy.cuda.Device().synchronize()
        g_host = to_f64(guard)
        assert np.isnan(g_host[:, :128]).all() and np.isnan(g_host[:, 128 + S:]).all()
        assert np.isfinite(to_f64(fs)).all()


@pytest.mark.gpu
def test_chunk_varlen_no_sequences_writes_nothing(rng):
    """cu_seqlens = [0] with rows present: nothing to compute, nothing written."""
    import cupy

    from mate_cupy import chunk_kda

    x = make_inputs(rng, 1, 100, 1, 1, gate_params=False)
    d = _dev(x)
    out = _nan(x["v"].shape, BF16)
    assert chunk_kda(**dict(d, cu_seqlens=cupy.zeros(1, np.int32)), output=out) is out
    cupy.cuda.Device().synchronize()
    assert np.isnan(to_f64(out)).all()


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
                 dict(nw=2, s_out=F32), id="varlen-gate-nw2"),
    # the sm_90a wgmma recurrence: one and two warpgroups, chunk tails, empty sequences, GVA
    pytest.param(dict(B=2, T=129, H=1, HV=2, gate_params=True, state=F32), dict(nw=4, s_out=F32, wgmma=True),
                 id="wgmma4-dense-gate-T129"),
    pytest.param(dict(B=0, T=0, H=1, HV=2, gate_params=True, lens=[1, 0, 63, 65], state=BF16),
                 dict(nw=8, s_out=BF16, lazy=1, wgmma=True), id="wgmma8-varlen-tails-lazy"),
    pytest.param(dict(B=1, T=64, H=1, HV=4, dtype=F16, gate_params=False, extreme=True, state=F32),
                 dict(nw=4, s_out=F32, wgmma=True), id="wgmma4-fp16-gva4-extreme"),
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
    src = SRC.read_text()
    for inc in ('#include "common/dtype.cuh"', '#include "common/mma.cuh"', '#include "common/kda_chunk_ops.cuh"',
                '#include "common/attention_wgmma.cuh"', '#include "common/bulk_copy.cuh"'):
        assert inc in src
        src = src.replace(inc, "")
    decl = "extern __shared__ __align__(16) unsigned char smem[];"
    assert src.count(decl) == 2  # prepare, recurrence
    src = src.replace(decl, "unsigned char* smem = emu::dyn_smem();")
    decl = "extern __shared__ __align__(1024) unsigned char smem_raw[];"
    assert src.count(decl) == 1  # wgmma recurrence
    d = tmp_path_factory.mktemp("kda_emu")
    (d / "kda_chunk_emu.inc").write_text(src.replace(decl, "unsigned char* smem_raw = emu::dyn_smem();"))
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
        f"{kind[s_in]} {kind[s_out]} {int(varlen and x['cu_seqlens'].dtype == np.int64)} {run['nw']} "
        f"{run.get('lazy', 0)} {int(run.get('wgmma', False))}\n")
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0")  # the driver leaves its buffers to process exit
    r = subprocess.run([str(kda_emulator), str(tmp_path)], capture_output=True, text=True, timeout=1800, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    rec: dict = {}
    o_model, s_model = model_chunk_kda(x, op=dtype, l2=l2, record=rec)
    out = np.fromfile(tmp_path / "out.bin", dtype=dtype).reshape(x["v"].shape)
    assert rel(out, _round(o_model, dtype)) < 2e-3
    o_ref, s_ref = reference(x, use_qk_l2norm=l2)  # and the float64 recurrence, to the GPU tolerances
    assert rel(out, o_ref) < TOL[dtype]
    if s_out is not None:
        fs = np.fromfile(tmp_path / "ht.bin", dtype=s_out).reshape(N, HV, K, K)
        assert rel(fs, _round(s_model, s_out)) < 2e-3
        assert rel(fs, s_ref) < STATE_TOL[dtype]
    ws = np.fromfile(tmp_path / "ws.bin", dtype=np.uint8)
    lens = np.diff(x["cu_seqlens"]) if varlen else [T] * B
    slot = 0
    for n, ln in enumerate(lens):
        nch = (int(ln) + C - 1) // C
        for hv in range(HV):
            for c in range(nch):
                blob = ws[((slot + c) * HV + hv) * cl.SLOT_BYTES:][:cl.SLOT_BYTES]
                for name in SLOT_PARTS:
                    assert rel(slot_part(blob, name, dtype), rec[(n, hv)][c][name]) < 5e-3, (n, hv, c, name)
        slot += nch


# ----------------------------------------------------------------------------- GPU: segments through the public op


@pytest.mark.gpu
@pytest.mark.parametrize("bounds", [(0, 256, 448, 700), (0, 1, 200, 450, 700)], ids=["aligned", "inside-chunks"])
def test_segments_through_chunk_kda_match_the_whole_sequence(rng, bounds):
    """The segment maps computed by the chunk kernels themselves (C: the segment from a zero
    state; M: the segment with v = 0 from the identity state, K = V = 128), joined by
    ``combine_segments`` on the device, then each segment's outputs from its entry state:
    the whole sequence's outputs and final state (docs/kda_chunk.md, "Intra-sequence
    parallelism")."""
    import cupy

    from mate_cupy import chunk_kda
    from mate_cupy.kda.segments import combine_segments

    x = make_inputs(rng, 1, bounds[-1], 1, 4, gate_params=True, state=F32)  # GVA 4; a 1-token segment
    o_ref, s_ref = reference(x)
    d = _dev(x)
    HV = x["v"].shape[2]
    gate = dict(A_log=d["A_log"], dt_bias=d["dt_bias"])
    eye = cupy.broadcast_to(cupy.eye(K, dtype=cupy.float32), (1, HV, K, K)).copy()
    Ms, Cs = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        sl = lambda n: d[n][:, a:b]  # noqa: E731
        _, c = chunk_kda(sl("q"), sl("k"), sl("v"), sl("g"), sl("beta"), output_final_state=True, **gate)
        _, m = chunk_kda(sl("q"), sl("k"), cupy.zeros_like(sl("v")), sl("g"), sl("beta"), initial_state=eye,
                         output_final_state=True, **gate)
        Ms.append(m[0])
        Cs.append(c[0])
    entry = combine_segments(cupy.stack(Ms), cupy.stack(Cs), d["initial_state"][0])
    assert entry.shape == (len(bounds), HV, K, K)
    outs = []
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        sl = lambda n: d[n][:, a:b]  # noqa: E731
        o = chunk_kda(sl("q"), sl("k"), sl("v"), sl("g"), sl("beta"), initial_state=entry[s][None], **gate)
        outs.append(o)
    out = cupy.concatenate(outs, axis=1)
    assert rel(out, o_ref) < TOL[BF16]
    assert rel(entry[-1][None], s_ref) < STATE_TOL[BF16]
