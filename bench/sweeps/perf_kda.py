"""KDA tuning sweep on one GPU (H200): chunk_kda phase times and V-split widths, decode CTA shapes.

    PYTHONPATH=. python bench/sweeps/perf_kda.py OUTDIR [chunk] [decode]

(timing parts: both by default)

Candidates (all in one build, chosen per call):

* chunk_kda phase 1 (``MATE_CUPY_KDA_CHUNK_PREPARE``): ``default`` (kda_chunk_prepare_kernel,
  rewritten) and ``baseline`` (kda_chunk_prepare_baseline_kernel, the previous one).
* chunk_kda phase 2 width (``MATE_CUPY_KDA_CHUNK_WARPS`` / ``launch_recurrence(warps=)``):
  1, 2, 4, 8 warps per CTA, V slice of 16 x warps rows of the state.
* decode, V-first (``decode_kernels.VFIRST_WARPS`` x ``VFIRST_ROWS`` x ``VFIRST_BULK`` x
  ``VFIRST_PREFETCH``): warps per CTA x state rows per lane (4: 128 registers, 2: 96) x the
  slice staged by per-lane cp.async or one bulk copy x one CTA per work unit / CTAs
  looping over units with the next state prefetched. Beside them, the bandwidth ceiling of
  the same bytes: an in-place elementwise update of the same pool rows and a
  device-to-device copy of the same size.

Phases:

1. Cubins of every module used (NVRTC, in parallel) into a temporary
   ``MATE_CUPY_CUBIN_DIR``, so no compile lands in a timed region.
2. Smoke (child process, time-boxed: a hang or a CUDA fault cannot take the sweep with it):
   every candidate on small problems against the float64 references of ``tests/`` (chunk:
   dense GVA with gate parameters and f32 states; varlen with empty / short / uneven
   sequences and extreme decays (element-wise diagonal blocks), bf16 states; decode: four
   grid cases, the prefetch loop with one assumed SM so CTAs run many units). Only passing
   candidates are timed.
3. Timing (children, CUDA events, a spin kernel queued first so host time is not counted,
   median of 7 after warm-up; decode: CUDA-graph replays of 16 rotated calls):
   * chunk, bf16, K = V = 128, gate/l2norm/beta in kernel, f32 final state: B1 T8192 H64,
     B1 T32768 H32, B1 T8192 H96, varlen 8 x 1024 H64, B1 T8192 H16 (HV = H).
     ``total`` = ``run_chunk`` as shipped; ``prep`` = phase 1 per kernel; ``rec[nw]`` = phase
     2 per width (``heur`` = the launcher's width). Checks: first 32 tokens of every
     sequence vs an fp32 recurrence (``err``), default vs baseline phase 1 over the whole
     output (``dBase``) and per workspace part, every width bitwise equal to ``heur``.
   * decode, fp32 pool [P, HV=32, V, K] in place, H16, bf16 inputs, B 32 / 256 / 1024:
     us per call and TB/s of state (read + write) per candidate; err vs an fp32 torch
     step; ``!`` marks a result not bitwise equal to the 4-warp one-unit-per-CTA kernel.

Writes ``OUTDIR/perf_kda.json`` and prints a table (last lines).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NAME = "perf_kda"
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository's bench package
    sys.path.insert(0, str(ROOT))
from bench.sweeps._shared import build_cubins  # noqa: E402
DEVICE = "cuda"  # torch device of the inputs
TIMEOUT_S = {"smoke": 25, "chunk": 35, "decode": 40}
BUDGET_S = 90.0
K = V = 128
LOWER_BOUND = -5.0
NWS = (1, 2, 4, 8)
PREPS = ("default", "baseline")
CHUNK_SHAPES = [  # (label, sequence lengths, H = HV, varlen)
    ("B1 T8192 H64", [8192], 64, False),
    ("B1 T32768 H32", [32768], 32, False),
    ("B1 T8192 H96", [8192], 96, False),
    ("varlen 8x1024 H64", [1024] * 8, 64, True),
    ("B1 T8192 H16", [8192], 16, False),
]
DECODE_BATCHES = (32, 256, 1024)
DECODE_HV, DECODE_H = 32, 16
# (warps, prefetch, rows per lane, bulk)
DECODE_VARIANTS = ([(w, False, 4, bk) for w in (1, 2, 4) for bk in (False, True)] + [(2, True, 4, False)]
                   + [(w, False, 2, bk) for w in (2, 4, 8) for bk in (False, True)])
_BASE_VARIANT = (4, False, 4, False)


def _dlabel(w, pf, rows=4, bulk=False) -> str:
    if w is None:
        return "default"
    return f"w{w}{'r2' if rows == 2 else ''}{'pf' if pf else ''}{'b' if bulk else ''}"


def _set_knobs(dk, v) -> None:
    w, pf, rows, bulk = v if v is not None else (None, None, None, None)
    dk.VFIRST_WARPS, dk.VFIRST_PREFETCH, dk.VFIRST_ROWS, dk.VFIRST_BULK = w, pf, rows, bulk


# --------------------------------------------------------------------------- phase 1: cubins

def _specs():
    from mate_cupy._interop import BFLOAT16
    from mate_cupy.kda import chunk_kernels as ck, decode_kernels as dk

    specs = [ck.PREPARE_SPECS[BFLOAT16], ck.PREPARE_BASELINE_SPECS[BFLOAT16]]
    specs += [ck.RECURRENCE_SPECS[(BFLOAT16, nw)] for nw in NWS]
    specs += list(dk.VFIRST_SPECS.values())
    return specs


# --------------------------------------------------------------------------- timing helpers

_SPIN = None


def _spin(us: float = 1000.0) -> None:
    """Occupy the stream for ~us so the events that follow bracket GPU time, not host time."""
    global _SPIN
    import cupy as cp
    import numpy as np

    if _SPIN is None:
        _SPIN = cp.RawKernel(r'''
extern "C" __global__ void sweep_spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}''', "sweep_spin")
    _SPIN((1,), (1,), (np.int64(int(us * 2.0e3)),))


def time_ms(fn, warmup: int = 2, samples: int = 7) -> float:
    """Median ms of one ``fn()`` (launches on the null stream)."""
    import cupy as cp

    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(samples):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        _spin()
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1))
    return statistics.median(ts)


def graph_ms(calls, replays: int = 5) -> float:
    """Median ms per call of a CUDA graph of ``calls`` (callables launching on the current stream)."""
    import cupy as cp

    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for c in calls:  # warm outside the capture
            c()
        s.synchronize()
        s.begin_capture()
        for c in calls:
            c()
        g = s.end_capture()
        g.launch()
        s.synchronize()
        ts = []
        for _ in range(replays):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            g.launch()
            e1.record(s)
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) / len(calls))
    return statistics.median(ts)


def _usable(ok: dict, label: str) -> bool:
    """Timed unless the smoke test found it wrong (FAIL) or the smoke process died on it;
    untested candidates and Python errors of the smoke code are timed anyway."""
    st = ok.get(label, "untested")
    return not (st.startswith("FAIL") or st == "untested/crashed")


def _free() -> None:
    try:
        import cupy as cp
        import torch

        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    except Exception:
        pass


def _save(path: str, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=1, default=str))


# --------------------------------------------------------------------------- phase 2: smoke (child)

def part_smoke(path: str) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import cupy as cp
    import numpy as np

    import test_gpu_kda_chunk as TC
    import test_gpu_kda_decode as TD
    from mate_cupy import _launch_cache as lc
    from mate_cupy.kda import decode_kernels as dk

    status: dict = {}
    rng = np.random.default_rng(5)
    problems = [
        ("dense", TC.make_inputs(rng, 2, 300, 2, 4, gate_params=True, state=TC.F32), TC.F32),
        ("varlen", TC.make_inputs(rng, 0, 0, 1, 2, gate_params=False, extreme=True, lens=[1, 0, 200, 64, 65, 130],
                                  state=TC.BF16), TC.BF16),
    ]
    refs = [TC.reference(x) for _, x, _ in problems]
    for prep in PREPS:
        for nw in NWS:
            label = f"chunk prep={prep} nw={nw}"
            status[label] = "running"
            _save(path, status)
            os.environ["MATE_CUPY_KDA_CHUNK_PREPARE"] = prep
            os.environ["MATE_CUPY_KDA_CHUNK_WARPS"] = str(nw)
            try:
                errs = []
                for (name, x, sdt), (o_ref, s_ref) in zip(problems, refs):
                    out, fs = TC._run_public(x, state_out=sdt)
                    cp.cuda.Device().synchronize()
                    errs.append((name, TC.rel(out, o_ref), TC.rel(fs, s_ref)))
                bad = [e for e in errs if not (e[1] < TC.TOL[TC.BF16] and e[2] < TC.STATE_TOL[TC.BF16])]
                status[label] = "ok" if not bad else f"FAIL {bad}"
            except Exception as e:  # not a wrong result: reported, still timed
                status[label] = f"error {type(e).__name__}: {str(e)[:300]}"
    os.environ.pop("MATE_CUPY_KDA_CHUNK_PREPARE", None)
    os.environ.pop("MATE_CUPY_KDA_CHUNK_WARPS", None)
    _save(path, status)

    cases = ["t1_f32_vfirst", "t4_spec", "varlen_2d", "t12_chunked_prologue"]
    for var in DECODE_VARIANTS:
        w, pf = var[:2]
        label = f"decode {_dlabel(*var)}"
        status[label] = "running"
        _save(path, status)
        _set_knobs(dk, var)
        sm = dk._sm_count
        if pf:
            dk._sm_count = lambda: 1  # few resident CTAs: every CTA loops over many units
        lc.clear()  # the public API replays recorded launches; these knobs are not in their key
        try:
            for name in cases:
                c = TD.CASES[name]
                prep = TD.build_case(c, rng)
                out, pool, final = TD._run_case(c, prep, preallocate=True)
                TD.check_results(c, prep, out, pool, final)
            status[label] = "ok"
        except AssertionError as e:
            status[label] = f"FAIL {str(e)[:300]}"
        except Exception as e:  # not a wrong result: reported, still timed
            status[label] = f"error {type(e).__name__}: {str(e)[:300]}"
        finally:
            dk._sm_count = sm
            _set_knobs(dk, None)
            lc.clear()
        _save(path, status)


# --------------------------------------------------------------------------- phase 3: chunk timing (child)

def chunk_shape(label, seqs, heads, varlen, ok) -> dict:
    import cupy as cp
    import numpy as np
    import torch

    from bench.checks import kda_prefix, rel_err
    from mate_cupy.kda import chunk_kernels as ck

    dev = DEVICE
    g = torch.Generator(device=dev).manual_seed(8)
    total, n = int(sum(seqs)), len(seqs)
    rnd = lambda *s: torch.randn(s, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)  # noqa: E731
    q, k, v, gg = rnd(1, total, heads, K), rnd(1, total, heads, K), rnd(1, total, heads, V), rnd(1, total, heads, K)
    beta = rnd(1, total, heads)
    a_log = torch.log(torch.empty(heads, device=dev).uniform_(1.0, 16.0, generator=g))
    dt_bias = torch.randn(heads * K, generator=g, device=dev) * 0.5
    cu_t = torch.tensor([0] + np.cumsum(seqs).tolist(), dtype=torch.int32, device=dev) if varlen else None
    X = {name: cp.from_dlpack(t) for name, t in
         dict(q=q, k=k, v=v, g=gg, beta=beta, A_log=a_log, dt_bias=dt_bias).items()}
    cu = cp.from_dlpack(cu_t) if varlen else None
    out = cp.empty_like(X["v"])
    fs = cp.empty((n, heads, V, K), dtype=cp.float32)
    slots = ck.num_chunk_slots(1, total, n, varlen)
    ws = cp.empty(slots * heads * ck.SLOT_BYTES, dtype=cp.uint8)
    offsets = ck.launch_offsets(cu, n, total, X["q"].dtype) if varlen else None
    common = dict(cu_seqlens=cu, chunk_offsets=offsets, num_slots=slots, num_seqs=n)
    scale = K ** -0.5

    def prep(variant):
        return lambda: ck.launch_prepare(q=X["q"], k=X["k"], g=X["g"], beta=X["beta"], A_log=X["A_log"],
                                         dt_bias=X["dt_bias"], workspace=ws, scale=scale, lower_bound=LOWER_BOUND,
                                         use_qk_l2norm=True, variant=variant, **common)

    def rec(nw):
        return lambda: ck.launch_recurrence(v=X["v"], workspace=ws, out=out, initial_state=None, final_state=fs,
                                            warps=nw, **common)

    def full():
        ck.run_chunk(q=X["q"], k=X["k"], v=X["v"], g=X["g"], beta=X["beta"], A_log=X["A_log"], dt_bias=X["dt_bias"],
                     initial_state=None, final_state=fs, cu_seqlens=cu, out=out, scale=scale,
                     lower_bound=LOWER_BOUND, use_qk_l2norm=True)

    heur = ck.recurrence_warps(n * heads, ck._sm_count())
    preps = [p for p in PREPS if all(_usable(ok, f"chunk prep={p} nw={nw}") for nw in NWS)]
    nws = [nw for nw in NWS if _usable(ok, f"chunk prep=default nw={nw}")]
    r = {"case": label, "seqs": seqs, "H": heads, "HV": heads, "heuristic_nw": heur}
    if "default" in preps and heur in nws:
        r["total_ms"] = time_ms(full)
    r["prep_ms"] = {p: time_ms(prep(p)) for p in preps}
    r["rec_ms"], r["bitwise_vs_heuristic"] = {}, {}
    if "default" not in preps or heur not in nws:
        return r
    if "baseline" in preps:  # baseline phase 1 output and workspace, for comparison
        prep("baseline")()
        rec(heur)()
        out_base = torch.from_dlpack(out).clone()
        ws_base = ck.workspace_views(ws, slots, heads, X["q"].dtype)
        prep("default")()
        ws_default = ck.workspace_views(ws, slots, heads, X["q"].dtype)
        r["ws_rel_default_vs_baseline"] = {
            name: rel_err(torch.from_dlpack(ws_default[name]).float(), torch.from_dlpack(ws_base[name]).float())
            for name in ("Qs", "Kt", "Kb", "T", "Aqk", "egl")}
        del ws_default, ws_base
    prep("default")()
    rec(heur)()
    cp.cuda.Device().synchronize()
    out_heur = torch.from_dlpack(out).clone()
    fs_heur = torch.from_dlpack(fs).clone()
    for nw in nws:
        r["rec_ms"][nw] = time_ms(rec(nw))
        rec(nw)()
        cp.cuda.Device().synchronize()
        r["bitwise_vs_heuristic"][nw] = bool(torch.equal(torch.from_dlpack(out), out_heur)
                                             and torch.equal(torch.from_dlpack(fs), fs_heur))
    starts = cu_t[:-1].long() if varlen else torch.zeros(1, dtype=torch.long, device=dev)
    steps = min(32, min(seqs))
    ref = kda_prefix(q[0], k[0], v[0], gg[0], beta[0], a_log, dt_bias.view(heads, K), starts, steps, LOWER_BOUND,
                     scale)
    rows = starts[:, None] + torch.arange(steps, device=dev)[None, :]
    r["err_prefix"] = rel_err(out_heur[0][rows], ref)
    if "baseline" in preps:
        r["rel_default_vs_baseline_out"] = rel_err(out_heur, out_base)
    best = min(r["rec_ms"], key=r["rec_ms"].get)
    r["best_nw"] = best
    r["best_total_est_ms"] = r["prep_ms"]["default"] + r["rec_ms"][best]
    return r


def part_chunk(path: str, ok: dict) -> None:
    res: list = []
    for label, seqs, heads, varlen in CHUNK_SHAPES:
        try:
            res.append(chunk_shape(label, seqs, heads, varlen, ok))
        except Exception as e:
            res.append({"case": label, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        _save(path, res)
        _free()


# --------------------------------------------------------------------------- phase 3: decode timing (child)

def decode_batch(batch: int, ok: dict) -> dict:
    import cupy as cp
    import numpy as np
    import torch

    from bench.checks import kda_step, rel_err
    from mate_cupy.kda import decode_kernels as dk

    dev = DEVICE
    g = torch.Generator(device=dev).manual_seed(7)
    hv, h, nsets = DECODE_HV, DECODE_H, 4
    rnd = lambda *s: torch.randn(s, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)  # noqa: E731
    pool0 = torch.randn((batch * nsets, hv, V, K), generator=g, device=dev) * 0.05
    perm = torch.randperm(batch * nsets, generator=g, device=dev).to(torch.int32)
    a_log = torch.log(torch.empty(hv, device=dev).uniform_(1.0, 16.0, generator=g))
    dt_bias = (torch.randn(hv * K, generator=g, device=dev) * 0.5).view(hv, K)
    sets = [dict(q=rnd(batch, 1, h, K), k=rnd(batch, 1, h, K), v=rnd(batch, 1, hv, V), a=rnd(batch, 1, hv, K),
                 b=rnd(batch, 1, hv), idx=perm[i * batch:(i + 1) * batch].contiguous()) for i in range(nsets)]
    C = [{n: cp.from_dlpack(t) for n, t in s.items()} for s in sets]
    A_log, dtb = cp.from_dlpack(a_log), cp.from_dlpack(dt_bias)
    pool_t = pool0.clone()
    pool = cp.from_dlpack(pool_t)
    outs = [cp.empty_like(c["v"]) for c in C]

    def call(i, p):
        c = C[i]
        dk.run_decode(q=c["q"], k=c["k"], v=c["v"], a=c["a"], b=c["b"], A_log=A_log, dt_bias=dtb, state=p,
                      state_indices=c["idx"], num_accepted_tokens=None, cu_seqlens=None, out=outs[i],
                      final_state=None, scale=K ** -0.5, lower_bound=LOWER_BOUND, use_qk_l2norm=True,
                      use_gate_in_kernel=True, use_lower_bound=True, apply_beta_sigmoid=True, allow_neg_eigval=False,
                      use_initial_state=True, state_v_first=True, inplace_final_state=True)

    s0 = sets[0]
    idx0 = s0["idx"].long()
    o_ref, s_ref = kda_step(pool0[idx0], s0["q"][:, 0], s0["k"][:, 0], s0["v"][:, 0], s0["a"][:, 0], s0["b"][:, 0],
                            a_log, dt_bias, LOWER_BOUND, K ** -0.5)
    res = {"B": batch, "HV": hv, "H": h, "state_bytes": 2 * batch * hv * V * K * 4, "variants": {}}
    threads, _, _, grid, _, _, prefetch = dk.launch_shape(batch * hv, V, 1, np.float32, True)
    res["default_choice"] = {"warps": threads // 32, "prefetch": prefetch, "grid": grid}
    base = None
    variants = [v for v in DECODE_VARIANTS if _usable(ok, f"decode {_dlabel(*v)}")]
    variants.sort(key=lambda x: x != _BASE_VARIANT)  # the bitwise baseline first
    # Ceiling of the same bytes: in place x = 0.5 x + 1 on the rotated pool rows, and a copy.
    import cupy as cp
    upd = cp.ElementwiseKernel("", "float32 x", "x = 0.5f * x + 1.0f", "sweep_inplace_update")
    blk = [pool[i * batch:(i + 1) * batch] for i in range(nsets)]
    dst = cp.empty_like(blk[0])
    res["ceiling"] = {}
    for name, fn in (("inplace_update", lambda i: upd(blk[i])),
                     ("copy", lambda i: dst.__setitem__(Ellipsis, blk[i]))):
        ms = graph_ms([lambda i=i: fn(i % nsets) for i in range(16)])
        res["ceiling"][name] = {"us": ms * 1e3, "tbps": res["state_bytes"] / (ms * 1e-3) / 1e12}
    dst = None  # freed before the kernels are timed
    try:
        for var in variants + [None]:
            _set_knobs(dk, var)
            w, pf = (var or (None, None))[:2]
            p_t = pool0.clone()
            call(0, cp.from_dlpack(p_t))
            cp.cuda.Device().synchronize()
            o_t = torch.from_dlpack(outs[0])[:, 0].clone()
            st = p_t[idx0]
            if var == _BASE_VARIANT:
                base = (o_t, st)
            ms = graph_ms([lambda i=i: call(i % nsets, pool) for i in range(16)])
            res["variants"][_dlabel(*var) if var else "default"] = {
                "warps": w, "prefetch": pf, "rows": (var or (0, 0, None))[2], "bulk": (var or (0, 0, 0, None))[3],
                "us": ms * 1e3, "tbps": res["state_bytes"] / (ms * 1e-3) / 1e12,
                "err": max(rel_err(o_t, o_ref), rel_err(st, s_ref)),
                "bitwise_vs_w4": None if base is None else bool(torch.equal(o_t, base[0]) and torch.equal(st, base[1]))}
            del p_t
    finally:
        _set_knobs(dk, None)
    return res


def part_decode(path: str, ok: dict) -> None:
    res: list = []
    for b in DECODE_BATCHES:
        try:
            res.append(decode_batch(b, ok))
        except Exception as e:
            res.append({"B": b, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        _save(path, res)
        _free()


# --------------------------------------------------------------------------- main

def _run_part(part: str, outdir: Path, env, t0: float):
    path = outdir / f"{NAME}.{part}.json"
    if path.exists():
        path.unlink()
    left = BUDGET_S - (time.perf_counter() - t0)
    timeout = min(TIMEOUT_S[part], left)
    t1 = time.perf_counter()
    if timeout < 3:
        return None, {"rc": "skipped (time budget)", "seconds": 0.0, "tail": ""}
    try:
        proc = subprocess.run([sys.executable, __file__, "--part", part, str(outdir)], env=env, cwd=str(ROOT),
                              timeout=timeout, capture_output=True, text=True)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        rc, tail = "timeout", ""
    data = json.loads(path.read_text()) if path.exists() else None
    return data, {"rc": rc, "seconds": round(time.perf_counter() - t1, 1), "tail": tail if rc != 0 else ""}


def main(outdir: str, parts=("chunk", "decode")) -> None:
    t0 = time.perf_counter()
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"name": NAME}
    with tempfile.TemporaryDirectory() as cubins:
        result["build"] = build_cubins(_specs(), cubins)
        env = dict(os.environ, MATE_CUPY_CUBIN_DIR=cubins,
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        for var in ("MATE_CUPY_KDA_CHUNK_PREPARE", "MATE_CUPY_KDA_CHUNK_WARPS"):
            env.pop(var, None)
        smoke, result["smoke_run"] = _run_part("smoke", out, env, t0)
        smoke = smoke or {}
        for label in [f"chunk prep={p} nw={nw}" for p in PREPS for nw in NWS] + \
                     [f"decode {_dlabel(*v)}" for v in DECODE_VARIANTS]:
            if smoke.get(label) in (None, "running"):
                smoke[label] = "untested/crashed" if smoke.get(label) == "running" else "untested"
        result["smoke"] = smoke
        (out / f"{NAME}.smoke.json").write_text(json.dumps(smoke))
        for part in ("chunk", "decode"):
            if part in parts:
                result[part], result[f"{part}_run"] = _run_part(part, out, env, t0)
            else:
                result[part], result[f"{part}_run"] = None, {"rc": "not run", "seconds": 0.0, "tail": ""}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=1, default=str))
    report(result)


def report(result: dict) -> None:
    smoke = result["smoke"]
    print(f"\n== {NAME}: build {result['build']['seconds']} s ({len(result['build']['errors'])} errors), "
          f"total {result['seconds']} s")
    for e in result["build"]["errors"]:
        print("   build error:", e[:300])
    for part in ("smoke", "chunk", "decode"):
        run = result[f"{part}_run"]
        print(f"   {part}: rc={run['rc']} {run['seconds']} s" + (f"  tail: {run['tail'][-300:]!r}" if run["tail"] else ""))
    for k, v in smoke.items():
        if v != "ok":
            print(f"   smoke {k}: {str(v)[:200]}")
    print("chunk ms: total (shipped) | prep default/baseline | rec nw:ms (phase 2 per width) | heur/best width | "
          "err (first 32 tokens vs fp32), dBase (default vs baseline phase 1, whole output), bitwise widths")
    for r in result["chunk"] or []:
        if "error" in r:
            print(f"   {r['case']}: ERROR {r['error']}")
            continue
        recs = " ".join(f"{nw}:{ms:.3f}" for nw, ms in r["rec_ms"].items())
        bw = "ok" if all(r["bitwise_vs_heuristic"].values()) else f"DIFF {r['bitwise_vs_heuristic']}"
        pm = " / ".join(f"{r['prep_ms'][p]:.3f}" if p in r["prep_ms"] else "-" for p in PREPS)
        print(f"   {r['case']:18s} total {r.get('total_ms', float('nan')):.3f} | prep {pm} | rec {recs} | "
              f"heur {r['heuristic_nw']} best {r.get('best_nw')} | err {r.get('err_prefix', float('nan')):.1e} "
              f"dBase {r.get('rel_default_vs_baseline_out', float('nan')):.1e} bitwise {bw}")
    print("decode us/call (graph) / TB/s of state: wN = warps per CTA, r2 = 2 rows per lane, pf = prefetch loop, "
          "b = bulk-copy staging, ! = not bitwise equal to w4")
    for d in result["decode"] or []:
        if "error" in d:
            print(f"   B{d['B']}: ERROR {d['error']}")
            continue
        cells = " ".join(f"{lab}:{v['us']:.1f}/{v['tbps']:.2f}{'' if v['bitwise_vs_w4'] in (True, None) else '!'}"
                         for lab, v in d["variants"].items())
        errs = max((v["err"] for v in d["variants"].values()), default=float("nan"))
        ceil = " ".join(f"{n}:{v['us']:.1f}/{v['tbps']:.2f}" for n, v in d.get("ceiling", {}).items())
        print(f"   B{d['B']:<5d} {cells} | max err {errs:.1e} | default {d['default_choice']} | ceiling {ceil}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--part":
        part, outdir = sys.argv[2], Path(sys.argv[3])
        ok = {}
        if part != "smoke" and (outdir / f"{NAME}.smoke.json").exists():
            ok = json.loads((outdir / f"{NAME}.smoke.json").read_text())
        path = str(outdir / f"{NAME}.{part}.json")
        {"smoke": lambda: part_smoke(path), "chunk": lambda: part_chunk(path, ok),
         "decode": lambda: part_decode(path, ok)}[part]()
    elif len(sys.argv) >= 2 and set(sys.argv[2:]) <= {"chunk", "decode"}:
        main(sys.argv[1], tuple(sys.argv[2:]) or ("chunk", "decode"))
    else:
        print(__doc__)
        sys.exit(2)
