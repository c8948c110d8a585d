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

import mate_cupy  # noqa: E402
from mate_cupy.jit import address  # noqa: E402
from mate_cupy.kda import chunk as ch  # noqa: E402
from mate_cupy.kda import chunk_launch as cl  # noqa: E402

SHAPES = ((8192, 64), (32768, 32), (8192, 96))  # (T, H = HV)


def timeit(fn, reps=30, warm=5) -> float:
    """Median ms of ``reps`` synchronised calls after ``warm`` warm-ups (CUDA events)."""
    for _ in range(warm):
        fn()
    stream = cp.cuda.get_current_stream()
    times = []
    for _ in range(reps):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        fn()
        e1.record(stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1))
    return float(np.median(times))


def case(T: int, H: int, outdir: Path, tag: str, save: bool) -> dict:
    HV = H
    rng = np.random.default_rng(1)

    def bf16(*shape):
        return cp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(cl.BFLOAT16))

    q, k, v, g, beta = bf16(1, T, H, 128), bf16(1, T, H, 128), bf16(1, T, HV, 128), bf16(1, T, HV, 128), bf16(1, T, HV)
    rs = cp.random.RandomState(1)
    A_log = rs.uniform(0, 1, HV).astype(cp.float32)
    dt_bias = (rs.standard_normal((HV, 128)) * 0.5).astype(cp.float32)
    out, fs = cp.empty_like(v), cp.empty((1, HV, 128, 128), cp.float32)
    ws = cp.empty((mate_cupy.chunk_kda_workspace_bytes(1, T, HV),), cp.uint8)
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, use_qk_l2norm_in_kernel=True,
              output_final_state=True, output=out, final_state=fs, workspace=ws)

    def public():
        mate_cupy.chunk_kda(q, k, v, g, beta, **kw)

    t_public = timeit(public)
    _, p, _ = ch.validate(q=q, k=k, v=v, g=g, beta=beta, scale=None, initial_state=None, output_final_state=True,
                          cu_seqlens=None, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                          use_qk_l2norm_in_kernel=True, output=out, final_state=fs, workspace=ws)
    c = ch.select_config(p, cp.cuda.Device().attributes["MultiProcessorCount"], 90)
    a = address
    inputs = dict(q=a(q), k=a(k), g=a(g), beta=a(beta), A_log=a(A_log), dt_bias=a(dt_bias), ws=a(ws))
    main = cp.cuda.get_current_stream()
    t_prep = timeit(lambda: cl.launch_prepare_segment(p, 0, T, stream=main.ptr, **inputs))
    t_rec = timeit(lambda: cl.launch_recurrence_segment(p, c, 0, T, v=a(v), out=a(out), ws=a(ws), state_in=0,
                                                        state_in_kind=0, state_out=a(fs), state_out_kind=1,
                                                        stream=main.ptr))
    if save:
        public()
        cp.cuda.Device().synchronize()
        np.save(outdir / f"out_{tag}_T{T}_H{H}.npy", cp.asnumpy(out.astype(cp.float32)))
        np.save(outdir / f"fs_{tag}_T{T}_H{H}.npy", cp.asnumpy(fs))
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
