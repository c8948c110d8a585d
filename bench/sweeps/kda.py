"""KDA tuning sweep: chunk_kda phase times and V-split widths, decode CTA shapes.

Usage (GPU machine, repository root)::

    PYTHONPATH=. python bench/sweeps/kda.py OUTDIR

Writes ``OUTDIR/kda.json`` and prints a compact table (last lines). Runs in well under a
minute on an H200 (most of it NVRTC compiles, done in parallel worker processes first).

What it measures (CUDA events around single launches, a spin kernel in front so host time
is not counted; median of several samples after warm-up; decode from CUDA-graph replays):

* chunk_kda, bf16, K = V = 128, gate/l2norm/beta in kernel, f32 final state, shapes of the
  issue (B1 T8192 H64 / H96, B1 T32768 H32, varlen 8 x 1024 H64) plus B1 T8192 H16:
  - ``total``: ``run_chunk`` as shipped (default phase-1 kernel, heuristic V split);
  - ``prep[default|baseline]``: phase 1 alone, the rewritten kernel and the previous one;
  - ``rec[nw]``: phase 2 alone for every width nw = 1, 2, 4, 8 (V slice 16 nw rows,
    N * HV * 128 / (16 nw) CTAs); ``heur`` is the width the launcher picks.
  Checks: outputs of the first 32 tokens of every sequence against an fp32 recurrent
  reference (``err``); default vs baseline phase 1, whole output (``d_base``); every width
  bitwise equal to the heuristic one (``bitwise``).
* gated_delta_rule_decode, fp32 pool [P, HV=32, V, K] in place, H16, bf16 inputs, B 32 /
  256 / 1024: V-first CTA width (1, 2, 4 warps) x prefetch loop (off / on); ``default`` is
  the launcher's choice. Per-call kernel time from graph replays of 16 rotated calls.
  Checks: out and updated state against an fp32 torch step (``err``), bitwise equality
  with the 4-warp non-prefetch kernel.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

K = V = 128
LOWER_BOUND = -5.0

CHUNK_SHAPES = [  # (label, sequence lengths, H = HV, varlen)
    ("B1 T8192 H64", [8192], 64, False),
    ("B1 T32768 H32", [32768], 32, False),
    ("B1 T8192 H96", [8192], 96, False),
    ("varlen 8x1024 H64", [1024] * 8, 64, True),
    ("B1 T8192 H16", [8192], 16, False),
]
DECODE_BATCHES = (32, 256, 1024)
DECODE_HV, DECODE_H = 32, 16
DECODE_VARIANTS = [(w, pf) for w in (1, 2, 4) for pf in (False, True)] + [(None, None)]


# ----------------------------------------------------------------------------- compile

def _compile_worker(key):
    from mate_cupy.jit.compiler import get_module
    from mate_cupy.kda import chunk_kernels as ck, decode_kernels as dk
    import numpy as np
    from mate_cupy._interop import BFLOAT16

    kind, arg = key
    spec = {"prep": lambda: ck.PREPARE_SPECS[BFLOAT16], "base": lambda: ck.PREPARE_BASELINE_SPECS[BFLOAT16],
            "rec": lambda: ck.RECURRENCE_SPECS[(BFLOAT16, arg)],
            "dec": lambda: dk.SPECS[(np.dtype(np.float32), True)]}[kind]()
    t0 = time.perf_counter()
    get_module(spec)
    return key, time.perf_counter() - t0


def precompile() -> float:
    """Compile every module the sweep launches, in parallel (CuPy's disk cache keeps them)."""
    import multiprocessing as mp

    keys = [("prep", 0), ("base", 0), ("dec", 0)] + [("rec", nw) for nw in (1, 2, 4, 8)]
    t0 = time.perf_counter()
    try:
        with ProcessPoolExecutor(len(keys), mp_context=mp.get_context("spawn")) as pool:
            list(pool.map(_compile_worker, keys))
    except Exception as e:  # fall back to compiling on first use in this process
        print(f"parallel precompile failed ({type(e).__name__}: {e}); compiling in process", flush=True)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- timing

_SPIN = None


def _spin(us: float = 1000.0) -> None:
    """Occupy the stream for ~us so the events below bracket GPU time, not host time."""
    global _SPIN
    import cupy as cp
    import numpy as np

    if _SPIN is None:
        _SPIN = cp.RawKernel(r'''
extern "C" __global__ void sweep_spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}''', "sweep_spin")
    _SPIN((1,), (1,), (np.int64(int(us * 1.98e3)),))


def time_ms(fn, warmup: int = 2, samples: int = 7) -> float:
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
    """Median per-call ms of a CUDA graph holding ``calls`` (callables launching on the current stream)."""
    import cupy as cp

    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for c in calls:  # warm (compile, smem opt-in) outside the capture
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


# ----------------------------------------------------------------------------- chunk

def chunk_shape(label, seqs, heads, varlen) -> dict:
    import cupy as cp
    import numpy as np
    import torch

    from bench.checks import kda_prefix, rel_err
    from mate_cupy.kda import chunk_kernels as ck

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(8)
    total, n = int(sum(seqs)), len(seqs)
    rnd = lambda *s: torch.randn(s, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)  # noqa: E731
    q, k, v, gg = rnd(1, total, heads, K), rnd(1, total, heads, K), rnd(1, total, heads, V), rnd(1, total, heads, K)
    beta = rnd(1, total, heads)
    a_log = torch.log(torch.empty(heads, device=dev).uniform_(1.0, 16.0, generator=g))
    dt_bias = torch.randn(heads * K, generator=g, device=dev) * 0.5
    cu_t = torch.tensor([0] + list(np.cumsum(seqs)), dtype=torch.int32, device=dev) if varlen else None
    X = {name: cp.from_dlpack(t) for name, t in
         dict(q=q, k=k, v=v, g=gg, beta=beta, A_log=a_log, dt_bias=dt_bias).items()}
    cu = cp.from_dlpack(cu_t) if varlen else None
    out = cp.empty_like(X["v"])
    fs = cp.empty((n, heads, V, K), dtype=cp.float32)
    B, T = (1, total)
    slots = ck.num_chunk_slots(B, T, n, varlen)
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
    r = {"case": label, "seqs": seqs, "H": heads, "HV": heads, "heuristic_nw": heur}
    r["total_ms"] = time_ms(full)
    r["prep_ms"] = {vnt: time_ms(prep(vnt)) for vnt in ck.PREPARE_VARIANTS}
    # checks: baseline phase 1 output, then the default one (left in ws for the widths)
    prep("baseline")()
    rec(heur)()
    out_base = torch.from_dlpack(out).clone()
    prep("default")()
    ws_default = ck.workspace_views(ws, slots, heads, X["q"].dtype)
    prep("baseline")()
    ws_base = ck.workspace_views(ws, slots, heads, X["q"].dtype)
    r["ws_rel_default_vs_baseline"] = {
        name: rel_err(torch.from_dlpack(ws_default[name]).float(), torch.from_dlpack(ws_base[name]).float())
        for name in ("Qs", "Kt", "Kb", "T", "Aqk", "egl")}
    del ws_default, ws_base
    prep("default")()
    rec(heur)()
    cp.cuda.Device().synchronize()
    out_ref_nw = torch.from_dlpack(out).clone()
    fs_ref_nw = torch.from_dlpack(fs).clone()
    r["rec_ms"], r["bitwise_vs_heuristic"] = {}, {}
    for nw in ck.RECURRENCE_WARPS:
        r["rec_ms"][nw] = time_ms(rec(nw))
        rec(nw)()
        cp.cuda.Device().synchronize()
        r["bitwise_vs_heuristic"][nw] = bool(torch.equal(torch.from_dlpack(out), out_ref_nw)
                                             and torch.equal(torch.from_dlpack(fs), fs_ref_nw))
    starts = cu_t[:-1].long() if varlen else torch.zeros(1, dtype=torch.long, device=dev)
    steps = min(32, min(seqs))
    ref = kda_prefix(q[0], k[0], v[0], gg[0], beta[0], a_log, dt_bias.view(heads, K), starts, steps, LOWER_BOUND,
                     scale)
    rows = starts[:, None] + torch.arange(steps, device=dev)[None, :]
    r["err_prefix"] = rel_err(out_ref_nw[0][rows], ref)
    r["rel_default_vs_baseline_out"] = rel_err(out_ref_nw, out_base)
    best = min(r["rec_ms"], key=r["rec_ms"].get)
    r["best_nw"] = best
    r["best_total_est_ms"] = r["prep_ms"]["default"] + r["rec_ms"][best]
    return r


# ----------------------------------------------------------------------------- decode

def decode_batch(batch: int) -> dict:
    import cupy as cp
    import torch

    from bench.checks import kda_step, rel_err
    from mate_cupy.kda import decode_kernels as dk

    dev = "cuda"
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
    pool = cp.from_dlpack(pool0.clone())
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
    res = {"B": batch, "HV": hv, "H": h, "state_bytes": 2 * batch * hv * V * K * 4, "variants": []}
    base_out = base_state = None
    saved = (dk.VFIRST_WARPS, dk.VFIRST_PREFETCH)
    try:
        for w, pf in DECODE_VARIANTS:
            dk.VFIRST_WARPS, dk.VFIRST_PREFETCH = w, pf
            p = cp.from_dlpack(pool0.clone())
            call(0, p)
            cp.cuda.Device().synchronize()
            o_t = torch.from_dlpack(outs[0]).clone()
            st = torch.from_dlpack(p)[idx0].clone()
            if (w, pf) == (4, False):
                base_out, base_state = o_t, st
            rec = {"warps": w, "prefetch": pf, "err": max(rel_err(o_t[:, 0], o_ref), rel_err(st, s_ref))}
            ms = graph_ms([lambda i=i: call(i % nsets, pool) for i in range(16)])
            rec["us"] = ms * 1e3
            rec["tbps"] = res["state_bytes"] / (ms * 1e-3) / 1e12
            rec["_out"], rec["_state"] = o_t, st
            res["variants"].append(rec)
    finally:
        dk.VFIRST_WARPS, dk.VFIRST_PREFETCH = saved
    for rec in res["variants"]:
        rec["bitwise_vs_w4"] = bool(base_out is not None and torch.equal(rec.pop("_out"), base_out)
                                    and torch.equal(rec.pop("_state"), base_state))
        rec.pop("_out", None), rec.pop("_state", None)
    import numpy as np

    threads, _, _, grid, _, _, prefetch = dk.launch_shape(batch * hv, V, 1, np.float32, True)
    res["default_choice"] = {"warps": threads // 32, "prefetch": prefetch, "grid": grid}
    return res


# ----------------------------------------------------------------------------- main

def main(outdir: str) -> int:
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    t_comp = precompile()
    import cupy as cp
    import torch

    results = {"device": torch.cuda.get_device_name(), "compile_s": t_comp, "chunk": [], "decode": [], "errors": []}
    for label, seqs, heads, varlen in CHUNK_SHAPES:
        try:
            results["chunk"].append(chunk_shape(label, seqs, heads, varlen))
        except Exception as e:  # keep the rest of the sweep
            results["errors"].append(f"chunk {label}: {type(e).__name__}: {e}")
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    for b in DECODE_BATCHES:
        try:
            results["decode"].append(decode_batch(b))
        except Exception as e:
            results["errors"].append(f"decode B{b}: {type(e).__name__}: {e}")
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    results["wall_s"] = time.perf_counter() - t_start
    (out / "kda.json").write_text(json.dumps(results, indent=1, default=str))

    print(f"\n== kda sweep ({results['device']}, compile {t_comp:.1f} s, wall {results['wall_s']:.1f} s)")
    print("chunk (ms): total = run_chunk as shipped; prep default/baseline; rec[nw] phase 2 per width; "
          "heur = launcher's width; err = first 32 tokens vs fp32; dBase = default vs baseline output")
    for r in results["chunk"]:
        recs = " ".join(f"{nw}:{ms:.3f}" for nw, ms in r["rec_ms"].items())
        bw = "ok" if all(r["bitwise_vs_heuristic"].values()) else f"DIFF {r['bitwise_vs_heuristic']}"
        print(f"{r['case']:18s} total {r['total_ms']:.3f} | prep {r['prep_ms']['default']:.3f} / "
              f"{r['prep_ms']['baseline']:.3f} | rec {recs} | heur {r['heuristic_nw']} best {r['best_nw']} | "
              f"err {r['err_prefix']:.1e} dBase {r['rel_default_vs_baseline_out']:.1e} bitwise {bw}")
    print("decode (us per call, CUDA graph; TB/s of state): w = warps per CTA, pf = prefetch loop")
    for d in results["decode"]:
        cells = " ".join(
            f"{'dflt' if v['warps'] is None else 'w%d%s' % (v['warps'], 'pf' if v['prefetch'] else '')}:"
            f"{v['us']:.1f}/{v['tbps']:.2f}{'' if v['bitwise_vs_w4'] else '!'}" for v in d["variants"])
        errs = max(v["err"] for v in d["variants"])
        print(f"B{d['B']:<5d} {cells} | max err {errs:.1e} | default {d['default_choice']}")
    for e in results["errors"]:
        print("ERROR", e)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
