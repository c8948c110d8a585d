"""Sweep of the MSA index kernels on one GPU (H200): top-k selection and block max score.

    PYTHONPATH=. python bench/sweeps/perf_index.py OUTDIR

Candidates, chosen per call through the launchers' tuning arguments:

* top-k (``index_kernels._launch_topk(algo=, npt=)``):
  ``block``     the previous kernels (a warp per row up to 1024 scores, else a CTA per row)
  ``stream8/16/32``  the streaming warp-per-row kernel, chunks of 32 * NPT scores
* max score (``index_kernels.run_max_score(variant=(nwarps, stages, mma))``):
  ``mma w8 s2/s3``, ``mma w4 s3``  mma.sync, 16 rows per warp, 128 / 64 packed rows, 2 / 3 K stages
  ``mma32 w4 s3/s2``  mma.sync, 32 rows per warp (half the shared-memory reads per MMA), 128 rows
  ``wgmma w8 s2/s3``, ``wgmma w4 s2``  warpgroup MMA (sm_90a), Q and K from shared memory

Phases:

1. Build the cubins of every variant used (NVRTC, in parallel) into a temporary
   directory (``MATE_CUPY_CUBIN_DIR``), so no compile lands in a timed region.
2. Smoke test in a child process (time-boxed: a hang or a CUDA fault cannot take the
   sweep with it): every max-score variant against the float64 reference on small
   problems (dense varlen causal/full with offsets, decode-like key splits, GQA 1/2/4/8,
   bf16 D128 and fp16 D64, paged with an invalid page) and every top-k kernel against the
   exact reference (random, tied, NaN, causal-tail rows). Only passing variants are timed.
3. Timing (CUDA events, 2 input sets in rotation, warm-up then the median of N calls).
   Top-k k=16: [8192, 64, 1024], [64, 64, 8192], [4096, 8, 8192] (begin 1, end 2, causal
   positions) and the rows crossover at NT 8192 (256 .. 2048 rows); torch.topk beside.
   Max score, bf16 D128 causal: S8192 Hq64 Hkv8; Hq4 Hkv1 8192 queries at the end of
   131072 keys; our dense attention (msa) on the same shapes for the 0.6x target.
   Every top-k candidate's ids must equal the reference kernel's (both are exact); every
   max-score candidate is compared with the mma w8 s2 output (-inf pattern exact,
   values to 1e-5 relative).

Writes ``OUTDIR/perf_index.json`` and prints a table (last lines).
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

NAME = "perf_index"
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository's bench package
    sys.path.insert(0, str(ROOT))
from bench.sweeps._shared import build_cubins, run_smoke_child, TorchCtx  # noqa: E402
SMOKE_TIMEOUT_S = 25
MS_VARIANTS = {  # label -> (nwarps, stages, mma)
    "mma w8 s2": (8, 2, "mma"), "mma w8 s3": (8, 3, "mma"), "mma w4 s3": (4, 3, "mma"),
    "mma32 w4 s3": (4, 3, "mma32"), "mma32 w4 s2": (4, 2, "mma32"),
    "wgmma w8 s2": (8, 2, "wgmma"), "wgmma w8 s3": (8, 3, "wgmma"), "wgmma w4 s2": (4, 2, "wgmma"),
}
MS_REF = "mma w8 s2"
TOPK_PATHS = {"block": ("block", None), "stream8": ("stream", 8), "stream16": ("stream", 16),
              "stream32": ("stream", 32)}


# --------------------------------------------------------------------------- phase 1: cubins

def _specs():
    import numpy as np
    from mate_cupy._interop import BFLOAT16, FLOAT16
    from mate_cupy.msa import index_kernels as ik

    specs = list(ik.STREAM_SPECS.values())
    specs += [ik.TOPK_SPECS[k] for k in ((1, 8, 4, False), (1, 32, 4, False), (8, 32, 4, False))]
    for dt, d in ((BFLOAT16, 128), (FLOAT16, 64)):
        for cfg in MS_VARIANTS.values():
            specs.append(ik.MAX_SCORE_SPECS[(np.dtype(dt), d) + cfg])
    try:  # the dense attention baseline (bf16 D128, default prefill tile), so it does not JIT in phase 3
        from mate_cupy.msa import attention_kernels as ak

        tile = ak.choose_prefill_tile(None, head_dim=128, dtype_code=1, sparse=False, cc=90)  # 1: bf16
        specs.append(ak.attention_spec(128, 1, tile, 0))
    except Exception:  # (their API moved: the baseline compiles on first use instead)
        pass
    return specs


# --------------------------------------------------------------------------- phase 2: smoke (child)

def smoke(status_path: str) -> None:
    """Child process: every candidate on small problems vs the float64 references."""
    sys.path.insert(0, str(ROOT / "tests"))
    import cupy
    import numpy as np

    from mate_cupy.msa import index_kernels as ik
    from mate_cupy.reference import msa as R
    from test_gpu_index import BF16, F16, _check_max_score, _dev, _meta, _positions, _rand, _scores
    from test_index_emu import SPECIAL_KINDS, special_rows

    rng = np.random.default_rng(11)
    status: dict = {}

    def save():
        Path(status_path).write_text(json.dumps(status))

    def dv(a):
        return None if a is None else cupy.asarray(a)

    def max_score(q, k, nt, qo, kv, off, cu_q, variant, **kw):
        ms = cupy.full((q.shape[0], q.shape[1], nt), np.nan, dtype=cupy.float32)
        ik.run_max_score(_dev(q), _dev(k), ms, cu_seqlens_q=dv(cu_q), qo_lens=dv(qo), kv_lens=dv(kv), qo_offset=dv(off),
                         max_seqlen_q=int(qo.max(initial=0)), variant=variant,
                         **{n: v if isinstance(v, (bool, int, str)) else dv(v) for n, v in kw.items()})
        cupy.cuda.get_current_stream().synchronize()
        return ms.get()

    problems = []
    for hq, hkv, d, dt, causal in [(8, 1, 128, BF16, True), (8, 2, 64, F16, False), (4, 4, 128, BF16, False),
                                   (16, 4, 128, BF16, True)]:
        for qo, kv, offs in (([96, 37, 1], [300, 700, 129], [200, 600, 128]), ([1, 1, 1], [1, 1500, 257], None)):
            qo, kv = np.array(qo, np.int32), np.array(kv, np.int32)
            cu_q, cu_k, off = _meta(qo, kv, None if offs is None else np.array(offs, np.int32))
            q = _rand(rng, (int(cu_q[-1]), hq, d), dt)
            k = _rand(rng, (int(cu_k[-1]), hkv, d), dt)
            nt = -(-int(kv.max()) // 128) + 1
            want = R.block_max_score(q, k, cu_q, cu_k, qo_offset=off, causal=causal, max_k_tiles=nt, qo_lens=qo,
                                     kv_lens=kv)
            problems.append((f"dense hq{hq} hkv{hkv} d{d} {dt} causal={causal} q{qo.tolist()}", q, k, nt, qo, kv, off,
                             cu_q, dict(cu_seqlens_k=cu_k, causal=causal), want, k))
    # paged (page 64, HND) with an invalid page id
    qo, kv = np.array([37, 130], np.int32), np.array([300, 200], np.int32)
    cu_q, _, off = _meta(qo, kv, None)
    counts = -(-kv // 64)
    pages = rng.permutation(int(counts.sum()) + 2).astype(np.int32)
    table = np.full((2, int(counts.max()) + 1), -1, np.int32)
    at = 0
    for b in range(2):
        table[b, :counts[b]] = pages[at:at + counts[b]]
        at += counts[b]
    table[1, 1] = 999
    kc = _rand(rng, (int(pages.max()) + 1, 4, 64, 128), BF16)
    q = _rand(rng, (int(cu_q[-1]), 8, 128), BF16)
    want = R.paged_block_max_score(q, kc, cu_q, kv, table, qo_offset=off, causal=True, max_k_tiles=4, kv_layout="HND",
                                   qo_lens=qo)
    problems.append(("paged HND invalid page", q, kc, 4, qo, kv, off, cu_q,
                     dict(page_table=table, page_size=64, kv_layout="HND", causal=True), want,
                     kc.transpose(0, 2, 1, 3).reshape(-1, 128)))

    # top-k first, then max score with the wgmma variants last (a fault stops the child)
    rows = []
    for nt in (40, 1000, 1024, 8192):
        ms = np.stack([_scores(rng, (2, nt), "normal"), _scores(rng, (2, nt), "causal"), _scores(rng, (2, nt), "ties")]
                      + [special_rows(rng, 2, nt, 16, kd) for kd in SPECIAL_KINDS])
        rows.append(ms)
    for label, (algo, npt) in TOPK_PATHS.items():
        status["topk " + label] = "running"
        save()
        fails = []
        try:
            for ms in rows:
                qp = _positions(rng, ms.shape[0], ms.shape[2])
                for topk, b, e, qpos in ((16, 0, 0, None), (16, 1, 2, qp)):
                    want = R.topk_select(ms, topk, None, b, e, True, qpos)
                    out = cupy.full(want.shape, -7, cupy.int32)
                    ik._launch_topk(cupy.asarray(ms), out, topk=topk, num_valid_pages=None, force_begin_blocks=b,
                                    force_end_blocks=e, force_blocks_count_in_topk=True,
                                    query_positions=dv(qpos), stream=None, algo=algo, npt=npt)
                    if not np.array_equal(out.get(), want):
                        fails.append(f"nt={ms.shape[2]} begin={b} end={e}")
        except Exception as e:  # a launch error poisons the context: stop here
            status["topk " + label] = f"error: {type(e).__name__}: {str(e)[:300]}"
            save()
            return
        status["topk " + label] = "ok" if not fails else "wrong: " + ", ".join(fails[:4])
        save()

    for label, variant in MS_VARIANTS.items():
        status["max score " + label] = "running"
        save()
        fails = []
        try:
            for name, q, k, nt, qo, kv, off, cu_q, kw, want, krows in problems:
                got = max_score(q, k, nt, qo, kv, off, cu_q, variant, **kw)
                try:
                    _check_max_score(got, want, q, krows, name)
                except AssertionError as e:
                    fails.append(str(e)[:200])
        except Exception as e:  # a launch error poisons the context: stop here
            status["max score " + label] = f"error: {type(e).__name__}: {str(e)[:300]}"
            save()
            return
        status["max score " + label] = "ok" if not fails else "wrong: " + " | ".join(fails[:3])
        save()


# --------------------------------------------------------------------------- phase 3: timing

def time_topk(ctx, ok: dict, records: list) -> None:
    torch = ctx.torch
    from mate_cupy.msa import index_kernels as ik

    g = torch.Generator(device=ctx.dev).manual_seed(3)
    cases = [("[8192, 64, 1024]", (8192, 64, 1024), 0, 0, False, 1), ("[64, 64, 8192]", (64, 64, 8192), 0, 0, False, 2),
             ("[4096, 8, 8192] b1 e2 causal", (4096, 8, 8192), 1, 2, True, 2)]
    cases += [(f"[{r}, 1, 8192] rows", (r, 1, 8192), 0, 0, False, 2) for r in (256, 512, 1024, 2048)]
    for name, shape, begin, end, causal, nsets in cases:
        rows, heads, nt = shape
        xs = [torch.randn(shape, generator=g, device=ctx.dev, dtype=torch.float32) for _ in range(nsets)]
        qp = None
        if causal:
            pos = torch.randint(0, nt * 128, (rows,), generator=g, device=ctx.dev, dtype=torch.int64)
            for x in xs:  # blocks past each query's position are -inf, as a causal pass leaves them
                x.masked_fill_(torch.arange(nt, device=ctx.dev)[None, None, :] > (pos // 128)[:, None, None],
                               float("-inf"))
            qp = ctx.cp(pos)
        width = 16  # (count_in_topk: the forced blocks take slots of the 16)
        outs = {}
        rec = {"case": name, "bytes": rows * heads * nt * 4, "ms": {}, "check": {}}
        for label, (algo, npt) in TOPK_PATHS.items():
            if ok.get("topk " + label) != "ok":
                rec["ms"][label] = None
                continue
            out = [torch.empty((rows, heads, width), dtype=torch.int32, device=ctx.dev) for _ in range(nsets)]
            outc = [ctx.cp(o) for o in out]
            xc = [ctx.cp(x) for x in xs]

            def run(i, algo=algo, npt=npt, outc=outc, xc=xc):
                ik._launch_topk(xc[i], outc[i], topk=16, num_valid_pages=None, force_begin_blocks=begin,
                                force_end_blocks=end, force_blocks_count_in_topk=True, query_positions=qp,
                                stream=ctx.stream, algo=algo, npt=npt)

            try:
                rec["ms"][label] = round(ctx.time(run, nsets), 5)
                outs[label] = out[0]
            except Exception as e:
                rec["ms"][label] = f"error: {type(e).__name__}: {str(e)[:200]}"
        base = outs.get("block")
        for label, o in outs.items():
            rec["check"][label] = None if base is None else int((o != base).any(dim=-1).sum().item())
        if not causal:
            vals = torch.empty((rows, heads, 16), device=ctx.dev)
            idx = torch.empty((rows, heads, 16), device=ctx.dev, dtype=torch.int64)
            rec["ms"]["torch.topk"] = round(ctx.time(lambda i: torch.topk(xs[i], 16, dim=-1, out=(vals, idx)), nsets), 5)
        records.append(rec)
        del xs
        torch.cuda.empty_cache()


def time_max_score(ctx, ok: dict, records: list, t_start: float, budget_s: float) -> None:
    torch = ctx.torch
    from mate_cupy.msa import index_kernels as ik

    g = torch.Generator(device=ctx.dev).manual_seed(5)
    for name, sq, sk, hq, hkv in (("S8192 Hq64 Hkv8 causal", 8192, 8192, 64, 8),
                                  ("Hq4 Hkv1 8192 q over 131072 k", 8192, 131072, 4, 1)):
        nt = math.ceil(sk / 128)
        qs = [torch.randn((sq, hq, 128), generator=g, device=ctx.dev, dtype=torch.bfloat16) for _ in range(2)]
        ks = [torch.randn((sk, hkv, 128), generator=g, device=ctx.dev, dtype=torch.bfloat16) for _ in range(2)]
        i32 = dict(dtype=torch.int32, device=ctx.dev)
        meta = dict(cu_seqlens_q=ctx.cp(torch.tensor([0, sq], **i32)), qo_lens=ctx.cp(torch.tensor([sq], **i32)),
                    kv_lens=ctx.cp(torch.tensor([sk], **i32)), qo_offset=ctx.cp(torch.tensor([sk - sq], **i32)),
                    cu_seqlens_k=ctx.cp(torch.tensor([0, sk], **i32)), max_seqlen_q=sq, causal=True)
        flops = 2.0 * hq * 128 * (sq * sk - sq * (sq - 1) / 2)  # causal, bottom-right
        rec = {"case": name, "flops": flops, "ms": {}, "check": {}}
        outs = {}
        for label, variant in MS_VARIANTS.items():
            if ok.get("max score " + label) != "ok":
                rec["ms"][label] = None
                continue
            out = [torch.empty((sq, hq, nt), dtype=torch.float32, device=ctx.dev) for _ in range(2)]
            qc, kc, oc = [ctx.cp(x) for x in qs], [ctx.cp(x) for x in ks], [ctx.cp(x) for x in out]

            def run(i, variant=variant, qc=qc, kc=kc, oc=oc):
                ik.run_max_score(qc[i], kc[i], oc[i], stream=ctx.stream, variant=variant, **meta)

            try:
                rec["ms"][label] = round(ctx.time(run, 2, iters=10), 4)
                outs[label] = out[0]
            except Exception as e:
                rec["ms"][label] = f"error: {type(e).__name__}: {str(e)[:200]}"
        base = outs.get(MS_REF)
        for label, o in outs.items():
            if base is None:
                rec["check"][label] = None
                continue
            fin = torch.isfinite(base)
            same_inf = bool(torch.equal(fin, torch.isfinite(o)))
            err = ((o[fin] - base[fin]).norm() / base[fin].norm().clamp_min(1e-30)).item() if fin.any() else 0.0
            rec["check"][label] = {"same_inf_pattern": same_inf, "rel_err_vs_base": float(f"{err:.2e}")}
        # our dense attention on the same shape (the 0.6x target's baseline)
        if time.perf_counter() - t_start < budget_s:
            try:
                import mate_cupy

                plan = mate_cupy.msa_plan_from_lengths(torch.tensor([sq], dtype=torch.int32),
                                                       torch.tensor([sk], dtype=torch.int32), hq, hkv, causal=True)
                vs = [torch.randn((sk, hkv, 128), generator=g, device=ctx.dev, dtype=torch.bfloat16) for _ in range(2)]
                outo = [torch.empty_like(x) for x in qs]
                mate_cupy.msa(qs[0], ks[0], vs[0], plan, out=outo[0])  # compile outside the timing
                rec["ms"]["attention (msa)"] = round(
                    ctx.time(lambda i: mate_cupy.msa(qs[i], ks[i], vs[i], plan, out=outo[i]), 2, iters=8), 4)
                del vs, outo
            except Exception as e:
                rec["ms"]["attention (msa)"] = f"error: {type(e).__name__}: {str(e)[:200]}"
        records.append(rec)
        del qs, ks, outs
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- main

def main(outdir: str) -> None:
    t0 = time.perf_counter()
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"name": NAME}
    with tempfile.TemporaryDirectory() as cubins:
        result["build"] = build_cubins(_specs(), cubins)
        os.environ["MATE_CUPY_CUBIN_DIR"] = cubins
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        result["smoke"] = run_smoke_child(
            __file__, env, SMOKE_TIMEOUT_S, ["max score " + v for v in MS_VARIANTS] + ["topk " + t for t in TOPK_PATHS])
        ok = result["smoke"]["status"]
        ctx = TorchCtx()
        records: list = []
        try:
            time_topk(ctx, ok, records)
        except Exception as e:
            records.append({"case": "topk", "error": f"{type(e).__name__}: {str(e)[:300]}"})
        try:
            time_max_score(ctx, ok, records, t0, budget_s=45.0)
        except Exception as e:
            records.append({"case": "max score", "error": f"{type(e).__name__}: {str(e)[:300]}"})
        result["timing"] = records
    result["seconds"] = round(time.perf_counter() - t0, 1)
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=1))

    print(f"== {NAME}: build {result['build']['seconds']} s ({len(result['build']['errors'])} errors), "
          f"smoke {result['smoke']['seconds']} s rc={result['smoke']['rc']}, total {result['seconds']} s")
    for k, v in ok.items():
        if v != "ok":
            print(f"   smoke {k}: {v[:160]}")
    for rec in records:
        if "error" in rec:
            print(f"   {rec['case']}: {rec['error']}")
            continue
        cells = []
        for label, ms in rec["ms"].items():
            if not isinstance(ms, float):
                cells.append(f"{label}={ms if ms is None else 'ERR'}")
                continue
            extra = ""
            if "bytes" in rec:
                extra = f" {rec['bytes'] / ms / 1e9:.2f}TB/s"
            elif "flops" in rec and label != "attention (msa)":
                extra = f" {rec['flops'] / ms / 1e9:.0f}TF"
            chk = rec["check"].get(label)
            if isinstance(chk, int) and chk:
                extra += f" MISMATCH{chk}"
            if isinstance(chk, dict) and (not chk["same_inf_pattern"] or chk["rel_err_vs_base"] > 1e-5):
                extra += f" DIFF{chk}"
            cells.append(f"{label}={ms:.4f}{extra}")
        print(f"   {rec['case']}: " + " | ".join(cells))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--smoke":
        smoke(sys.argv[2])
    elif len(sys.argv) == 2:
        main(sys.argv[1])
    else:
        print(__doc__)
        sys.exit(2)
