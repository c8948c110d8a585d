"""chunk_kda on one long sequence: prepare and recurrence launched back to back against
overlapped in time segments, with several segment layouts.

    PYTHONPATH=. python bench/sweeps/kda_overlap.py OUTDIR

B1 bf16 inputs with gate parameters at T32768 H32, T65536 H16 and T16384 H32 (HV = H). Times
(CUDA events, median of 20-30 calls after 3 warm-ups, each call synchronised): the public
``chunk_kda`` call, the prepare kernel alone and the recurrence kernel alone over the whole
sequence, then the segmented overlap as ``mate_cupy.kda.chunk_launch`` runs it (each
segment's prepare on the current stream, its recurrence on a highest-priority side stream
after an event, the float32 state carried in place) with even segments (4, 6, 8, 10, 12, 16)
and with first and/or last segments of 1/8, 1/4 or 1/2 the size of the others (4, 8, 12
segments). Every layout's output and final state are compared bitwise with the public
call's. Writes ``OUTDIR/kda_overlap.json``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import mate_cupy  # noqa: E402
from mate_cupy.jit import address  # noqa: E402
from mate_cupy.kda import chunk as ch  # noqa: E402
from mate_cupy.kda import chunk_launch as cl  # noqa: E402

SHAPES = ((32768, 32), (65536, 16), (16384, 32))  # (T, H = HV)


def timeit(fn, reps=20, warm=3) -> float:
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


def layouts(T: int) -> dict:
    """Segment token bounds by name: even, short first and last (edge), short first, short last."""
    chunks = -(-T // 64)

    def bounds(weights):
        total, acc, b = sum(weights), 0.0, [0]
        for w in weights[:-1]:
            acc += w
            b.append(min(T, round(chunks * acc / total) * 64))
        return b + [T]

    out = {f"even{n}": bounds([1] * n) for n in (4, 6, 8, 10, 12, 16)}
    for n in (4, 8, 12):
        for e in (0.125, 0.25, 0.5):
            out[f"edge{n}_{e}"] = bounds([e] + [1] * (n - 2) + [e])
        out[f"first{n}_0.25"] = bounds([0.25] + [1] * (n - 1))
        out[f"last{n}_0.25"] = bounds([1] * (n - 1) + [0.25])
    return out


def long_sequence(T: int, H: int) -> SimpleNamespace:
    """One B1 bf16 problem of ``T`` tokens and ``H = HV`` heads with gate parameters (seed 1)
    and its launchers: ``public()`` (the ``chunk_kda`` call), ``prepare(t0, length, stream)``
    and ``recurrence(t0, length, stream, first, last)`` (the segment launchers, the float32
    state carried through ``carry`` between segments), with ``out``, ``fs`` and the config."""
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

    _, p, _ = ch.validate(q=q, k=k, v=v, g=g, beta=beta, scale=None, initial_state=None, output_final_state=True,
                          cu_seqlens=None, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                          use_qk_l2norm_in_kernel=True, output=out, final_state=fs, workspace=ws)
    c = ch.select_config(p, cp.cuda.Device().attributes["MultiProcessorCount"], 90)
    carry = cp.empty((1, HV, 128, 128), cp.float32)
    a = address
    inputs = dict(q=a(q), k=a(k), g=a(g), beta=a(beta), A_log=a(A_log), dt_bias=a(dt_bias), ws=a(ws))

    def prepare(t0, length, stream):
        cl.launch_prepare_segment(p, t0, length, stream=stream, **inputs)

    def recurrence(t0, length, stream, first, last):
        cl.launch_recurrence_segment(p, c, t0, length, v=a(v), out=a(out), ws=a(ws),
                                     state_in=0 if first else a(carry), state_in_kind=0 if first else 1,
                                     state_out=a(fs) if last else a(carry), state_out_kind=1, stream=stream)

    return SimpleNamespace(public=public, prepare=prepare, recurrence=recurrence, out=out, fs=fs, config=c)


def case(T: int, H: int) -> dict:
    x = long_sequence(T, H)
    public, prepare, recurrence, out, fs = x.public, x.prepare, x.recurrence, x.out, x.fs
    t_public = timeit(public)
    public()
    cp.cuda.Device().synchronize()
    out_ref, fs_ref = out.copy(), fs.copy()
    nw = x.config.recurrence_warps
    main = cp.cuda.get_current_stream()
    t_prep = timeit(lambda: prepare(0, T, main.ptr))
    t_rec = timeit(lambda: recurrence(0, T, main.ptr, True, True))
    log(f"T{T} H{H} nw{nw}: public {t_public:.3f} prep {t_prep:.3f} rec {t_rec:.3f} sum {t_prep + t_rec:.3f}")
    r = dict(T=T, H=H, nw=nw, public=t_public, prep=t_prep, rec=t_rec, split={})
    side = cp.cuda.Stream(non_blocking=True, priority=-5)
    events = [cp.cuda.Event(disable_timing=True) for _ in range(32)]
    for name, bnd in layouts(T).items():
        nseg = len(bnd) - 1
        if any(bnd[i + 1] <= bnd[i] for i in range(nseg)):
            continue

        def run(bnd=bnd, nseg=nseg):
            for s in range(nseg):
                t0, length = bnd[s], bnd[s + 1] - bnd[s]
                prepare(t0, length, main.ptr)
                events[s].record(main)
                side.wait_event(events[s])
                recurrence(t0, length, side.ptr, s == 0, s == nseg - 1)
            events[31].record(side)
            main.wait_event(events[31])

        out.view(cp.uint16).fill(0x7FC0)
        fs.fill(np.nan)
        run()
        cp.cuda.Device().synchronize()
        same = bool((out.view(cp.uint16) == out_ref.view(cp.uint16)).all()) and bool((fs == fs_ref).all())
        t = timeit(run, reps=30)
        r["split"][name] = dict(ms=t, bitwise=same, bounds=bnd)
        log(f"  {name}: {t:.3f} ms  x{(t_prep + t_rec) / t:.3f} vs prep+rec  bitwise={same}")
    return r


def log(*args) -> None:
    print(*args, flush=True)


def main(outdir: str) -> None:
    results = [case(T, H) for T, H in SHAPES]
    Path(outdir).mkdir(parents=True, exist_ok=True)
    (Path(outdir) / "kda_overlap.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
