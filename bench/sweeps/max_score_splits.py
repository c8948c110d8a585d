"""Max score (bf16 and float8 q/k, dense K, causal, queries at the end of the keys) with the
key-range split count of ``max_score_splits`` against a fill of at least four waves of CTAs
(``ceil(4 * SMs / ctas)`` splits), alternating, three rounds.

    PYTHONPATH=. python bench/sweeps/max_score_splits.py OUTDIR

Cases (queries, keys, Hq, Hkv): long keys with 128, 32 and 16 row tiles of 256 packed rows,
a 262144-key case, and the causal S8192 Hq64 Hkv8 case (2048 row tiles: one split either way).
Both split counts give the same output (checked bit for bit on the first round). Writes
``OUTDIR/max_score_splits_ab.json`` (ms per call, per round).
"""
from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench import ours  # noqa: E402

il = importlib.import_module("mate_cupy.msa.index_launch")
CHOSEN = il.max_score_splits
CASES = [(8192, 131072, 4, 1), (2048, 131072, 4, 1), (1024, 32768, 4, 1), (8192, 8192, 64, 8), (4096, 262144, 4, 1)]


def four_waves(ctas: int, nt: int, slots: int, min_tiles: int = 4) -> tuple:
    """At least four waves of CTAs: ``ceil(4 slots / ctas)`` splits when the row tiles give fewer."""
    splits = 1
    if 0 < ctas < 4 * slots:
        splits = max(1, min(-(-4 * slots // ctas), nt // min_tiles, 65535))
    per = -(-nt // splits)
    return -(-nt // per), per


def main(argv) -> None:
    outdir = Path(argv[0])
    outdir.mkdir(parents=True, exist_ok=True)
    out = []
    for sq, sk, hq, hkv in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn((sq, hq, 128), generator=g, device="cuda", dtype=torch.bfloat16)
        k = torch.randn((sk, hkv, 128), generator=g, device="cuda", dtype=torch.bfloat16)
        q8, k8 = (q.float() / 0.05).to(torch.float8_e4m3fn), (k.float() / 0.03).to(torch.float8_e4m3fn)
        plan = ours.eager_plan([sq], [sk], hq, hkv, causal=True)
        buf = torch.empty((sq, hq, math.ceil(sk / 128)), dtype=torch.float32, device="cuda")
        res = {}
        for dt in ("bf16", "fp8"):
            qq, kk, kw = (q, k, {}) if dt == "bf16" else (q8, k8, dict(k_scale=0.05 * 0.03))
            ref = None
            for rnd in range(3):
                for name, rule in (("four_waves", four_waves), ("chosen", CHOSEN)):
                    il.max_score_splits = rule
                    try:
                        def call():
                            ours.msa(qq, kk, kk, plan, max_score=buf, output_o=False, **kw)
                        for _ in range(3):
                            call()
                        torch.cuda.synchronize()
                        if rnd == 0:
                            got = torch.nan_to_num(buf, neginf=-1e30).clone()
                            ref = got if ref is None else ref
                            assert torch.equal(got, ref), f"{dt} {name}: outputs differ"
                        reps = max(5, int(20e-3 / max(1e-5, sq * hq * sk * 128 * 2 / 700e12)))
                        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
                        e0.record()
                        for _ in range(reps):
                            call()
                        e1.record()
                        e1.synchronize()
                    finally:
                        il.max_score_splits = CHOSEN
                    res.setdefault(f"{dt}_{name}", []).append(round(e0.elapsed_time(e1) / reps, 4))
        row = dict(sq=sq, sk=sk, hq=hq, hkv=hkv, **res)
        out.append(row)
        print(row, flush=True)
    (outdir / "max_score_splits_ab.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
