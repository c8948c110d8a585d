"""chunk_kda's two phases timed apart: the prepare kernel alone, the recurrence kernel alone
and the public call, for the tree on PYTHONPATH.

    PYTHONPATH=. python bench/sweeps/kda_phases.py OUTDIR LABEL
    PYTHONPATH=. python bench/sweeps/kda_phases.py --once T H   (one prepare, three recurrences:
                                                                  for a profiler)

B1 bf16 inputs with gate parameters (``kda_overlap.long_sequence``) at T32768 H32, T8192 H64,
T8192 H96 and T16384 H32; CUDA events, median of 30 synchronised calls after 3 warm-ups.
Appends one JSON record per shape to ``OUTDIR/kda_phases.jsonl`` (``label``, ``T``, ``H``,
``nw``: recurrence warps, ``segs``: overlap segments of the public call, ``public``, ``prep``,
``rec`` in ms).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy as cp  # noqa: E402

from bench.sweeps.kda_overlap import long_sequence, timeit  # noqa: E402

SHAPES = ((32768, 32), (8192, 64), (8192, 96), (16384, 32))


def once(T: int, H: int) -> None:
    x = long_sequence(T, H)
    stream = cp.cuda.get_current_stream().ptr
    x.prepare(0, T, stream)
    for _ in range(3):
        x.recurrence(0, T, stream, True, True)
    cp.cuda.Device().synchronize()


def main(outdir: str, label: str) -> None:
    records = []
    for T, H in SHAPES:
        x = long_sequence(T, H)
        stream = cp.cuda.get_current_stream().ptr
        r = dict(label=label, T=T, H=H, nw=x.config.recurrence_warps, segs=x.config.pipeline_segments,
                 public=timeit(x.public, reps=30),
                 prep=timeit(lambda: x.prepare(0, T, stream), reps=30),
                 rec=timeit(lambda: x.recurrence(0, T, stream, True, True), reps=30))
        print(json.dumps(r), flush=True)
        records.append(r)
    Path(outdir).mkdir(parents=True, exist_ok=True)
    with open(Path(outdir) / "kda_phases.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    if sys.argv[1] == "--once":
        once(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main(sys.argv[1], sys.argv[2])
