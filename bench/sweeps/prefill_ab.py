"""One side of an A/B timing of the warp-specialised prefill tile between two working trees.

    PYTHONPATH=. python bench/sweeps/prefill_ab.py OUTDIR LABEL [REPS]

Run it from each tree in turn (A, B, A, B: the clocks drift within a session): it times our
dense causal B16 S1024, B1 S8192 causal and non-causal (Hq64 Hkv8), paged B4 S8192 page 64
(``bench_attention.paged_prefill_inputs`` and ``time_prefill``) and the bench's tile-shared
and per-token block-sparse S32768 cases (``bench_attention.sparse_case``; per-token on the
``gather`` tile), REPS times each (default 3), and appends one JSON line per case, labelled
LABEL, to ``OUTDIR/prefill_ab.jsonl``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# (batch, seqlen, Hq, Hkv, causal, page size: 0 dense)
CASES = ((16, 1024, 64, 8, True, 0), (1, 8192, 64, 8, True, 0), (1, 8192, 64, 8, False, 0), (4, 8192, 64, 8, True, 64))


def main(outdir: str, label: str, reps: int = 3) -> None:
    import torch

    from bench import bench_attention as ba
    from bench.timing import Timer, TimingConfig

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for batch, s, hq, hkv, causal, page in CASES:
        sets = ba.paged_prefill_inputs("cuda", 2, batch, s, page or 64, hq, hkv)
        outs = [torch.empty_like(x["q"]) for x in sets]
        ms = [ba.time_prefill(sets, outs, batch, s, hq, hkv, page=page, causal=causal) for _ in range(reps)]
        lines.append({"label": label, "case": f"B{batch} S{s} Hq{hq} Hkv{hkv} causal={causal} page={page}", "ms": ms})
        del sets, outs
    cfg = SimpleNamespace(device=torch.device("cuda"), flex_per_token=False, size="full")
    for per_token, name in ((False, "tile-shared"), (True, "per-token")):
        case = ba.sparse_case(cfg, 32768, 64, 4, 16, per_token=per_token, target=None)
        bound = case.impls[0].build(case.make_inputs(2))
        ms = [Timer(TimingConfig()).time(bound.run, 2)["ms"] for _ in range(reps)]
        lines.append({"label": label, "case": f"sparse {name} S32768 Hq64 Hkv4 top16", "ms": ms})
        del bound, case
    with open(out / "prefill_ab.jsonl", "a") as f:
        for line in lines:
            print(json.dumps(line), flush=True)
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], *(int(x) for x in sys.argv[3:4]))
