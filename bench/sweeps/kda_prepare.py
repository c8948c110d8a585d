"""chunk_kda's two kernels timed apart, for comparing prepare-kernel changes across trees.

    PYTHONPATH=. python bench/sweeps/kda_prepare.py OUTDIR TAG [--save-outputs]

B1 bf16 inputs with gate parameters at T8192 H64, T32768 H32 and T8192 H96 (HV = H). Times
(CUDA events, median of 30 synchronised calls after 5 warm-ups): the public ``chunk_kda``
call, the prepare kernel alone and the recurrence kernel alone over the whole sequence
(``chunk_launch.launch_prepare_segment`` / ``launch_recurrence_segment``, as
``bench/sweeps/kda_overlap.py``). Writes ``OUTDIR/kda_prepare_TAG.json``; with
``--save-outputs`` also each shape's output and final state as ``.npy`` (same seed in every
tree), so two trees' results can be compared.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from bench.sweeps.kda_overlap import long_sequence, timeit  # noqa: E402

SHAPES = ((8192, 64), (32768, 32), (8192, 96))  # (T, H = HV)


def case(T: int, H: int, outdir: Path, tag: str, save: bool) -> dict:
    x = long_sequence(T, H)
    stream = cp.cuda.get_current_stream().ptr
    t_public = timeit(x.public, reps=30, warm=5)
    t_prep = timeit(lambda: x.prepare(0, T, stream), reps=30, warm=5)
    t_rec = timeit(lambda: x.recurrence(0, T, stream, True, True), reps=30, warm=5)
    if save:
        x.public()
        cp.cuda.Device().synchronize()
        np.save(outdir / f"out_{tag}_T{T}_H{H}.npy", cp.asnumpy(x.out.astype(cp.float32)))
        np.save(outdir / f"fs_{tag}_T{T}_H{H}.npy", cp.asnumpy(x.fs))
    r = dict(tag=tag, T=T, H=H, public=t_public, prep=t_prep, rec=t_rec)
    print(json.dumps(r), flush=True)
    return r


def main(argv) -> None:
    outdir, tag = Path(argv[0]), argv[1]
    outdir.mkdir(parents=True, exist_ok=True)
    results = [case(T, H, outdir, tag, "--save-outputs" in argv) for T, H in SHAPES]
    (outdir / f"kda_prepare_{tag}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
