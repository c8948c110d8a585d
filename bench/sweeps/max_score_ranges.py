"""Max score at long context with each CTA's key range capped: the index branch's prefill
(bf16, Hq 4 over Hkv 1, D 128) with the launcher's split count (``model``: ``max_score_splits``)
against split counts that bound every CTA's key range to ``cap`` tiles of 128 keys,
alternating, three rounds (each timed by ``bench.timing.Timer``, about 60 ms per sample).

    PYTHONPATH=. python bench/sweeps/max_score_ranges.py OUTDIR [--caps 1024,512,256,128] [--only REGEX]

Cases:

* ``pipe S``: the MSA pipeline's index stage (``bench_pipeline._plan``, page-128 index cache in
  shuffled page order, CSR ids) through ``pipeline.index_window``: every query window of the
  causal prefill at S 32768 and 131072, the last and a middle 8192-row window at S 1048576;
* ``dense Sq x Sk``: dense K through an eager causal plan, the queries at the end of the keys.

Every split count gives the same output (checked bit for bit on the first round). Writes
``OUTDIR/max_score_ranges.json``: per case and rule the ms per call of every round, the
splits, and TFLOP/s (2 D FLOPs per admissible (query head, key) pair).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench import ours  # noqa: E402
from bench.bench_pipeline import _plan  # noqa: E402
from bench.timing import Timer, TimingConfig  # noqa: E402

il = importlib.import_module("mate_cupy.msa.index_launch")
MODEL = il.max_score_splits
HQ, D, BLOCK = 4, 128, 128


def capped(cap: int):
    """The launcher's split count, raised so that no CTA's key range exceeds ``cap`` tiles."""
    def rule(ctas, nt, slots, min_tiles=4):
        s, per = MODEL(ctas, nt, slots, min_tiles)
        if per > cap:
            per = cap
            s = -(-nt // per)
        return s, per
    return rule


def pairs(row_begin: int, row_end: int, offset: int) -> int:
    """Admissible (query, key) pairs of causal queries ``[row_begin, row_end)`` at ``offset``."""
    a, b = row_begin + offset, row_end + offset
    return (b * (b + 1) - a * (a + 1)) // 2


def pipe_case(s: int, which: str):
    g = torch.Generator(device="cuda").manual_seed(0)
    n_pages = math.ceil(s / BLOCK)
    iq = torch.randn((s, HQ, D), generator=g, device="cuda", dtype=torch.bfloat16)
    ik = torch.randn((n_pages, BLOCK, 1, D), generator=g, device="cuda", dtype=torch.bfloat16)
    ids = torch.randperm(n_pages, generator=g, device="cuda").to(torch.int32)
    plan = _plan(1, s, s, 64, HQ)
    from mate_cupy.msa.pipeline import index_window
    ws = list(plan.windows)
    if which != "all":
        ws = [ws[-1] if which == "last" else ws[len(ws) // 2]]

    def call():
        for w in ws:
            out = index_window(plan, w, iq, ik, kv_indices=ids)
        return out  # (the plan's CuPy buffer)

    name = f"pipe S{s}" + (f" ({len(ws)} windows)" if which == "all" else
                           f" {which} window rows {ws[0].row_begin}-{ws[0].row_end}")
    return name, call, HQ * sum(pairs(w.row_begin, w.row_end, 0) for w in ws) * 2 * D


def dense_case(sq: int, sk: int):
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn((sq, HQ, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn((sk, 1, D), generator=g, device="cuda", dtype=torch.bfloat16)
    plan = ours.eager_plan([sq], [sk], HQ, 1, causal=True)
    buf = torch.empty((sq, HQ, math.ceil(sk / BLOCK)), dtype=torch.float32, device="cuda")

    def call():
        ours.msa(q, k, k, plan, max_score=buf, output_o=False)
        return buf

    return f"dense {sq} x {sk}", call, HQ * pairs(0, sq, sk - sq) * 2 * D


CASES = [("pipe", 32768, "all"), ("pipe", 131072, "all"), ("pipe", 1048576, "last"),
         ("pipe", 1048576, "mid"), ("dense", 8192, 131072), ("dense", 131072, 131072)]


def main(argv) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--caps", default="1024,512,256,128")
    ap.add_argument("--only", default="")
    a = ap.parse_args(argv)
    outdir = Path(a.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    rules = [("model", MODEL)] + [(f"cap{c}", capped(int(c))) for c in a.caps.split(",") if c]
    timer = Timer(TimingConfig(warmup=2, samples=1, min_samples=1, min_sample_ms=60.0))
    out = []
    for kind, x, y in CASES:
        name, call, flops = pipe_case(x, y) if kind == "pipe" else dense_case(x, y)
        if a.only and not re.search(a.only, name):
            continue
        chosen = {}
        res = {}
        ref = None
        for rnd in range(3):
            for rname, rule in rules:
                il.max_score_splits = rule
                try:
                    seen = []
                    orig = il.launch

                    def spy(kernel, grid, *args, **kw):
                        seen.append(tuple(grid))
                        return orig(kernel, grid, *args, **kw)

                    il.launch = spy
                    try:
                        call()
                    finally:
                        il.launch = orig
                    chosen[rname] = seen[-1][2] if seen and len(seen[-1]) > 2 else 1
                    if rnd == 0:
                        got = torch.nan_to_num(torch.as_tensor(call(), device="cuda"), neginf=-1e30).clone()
                        ref = got if ref is None else ref
                        assert torch.equal(got, ref), f"{name} {rname}: outputs differ"
                        del got
                    ms = timer.time(lambda i: call(), 1)["ms"]
                finally:
                    il.max_score_splits = MODEL
                res.setdefault(rname, []).append(round(ms, 4))
        row = {"case": name, "gflop": round(flops / 1e9, 1), "splits": chosen, "ms": res,
               "tflops": {r: round(flops / (min(v) * 1e-3) / 1e12, 1) for r, v in res.items()}}
        out.append(row)
        print(json.dumps(row), flush=True)
        (outdir / "max_score_ranges.json").write_text(json.dumps(out, indent=1))
        del ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
