"""KDA decode (V-first pools) with two- and four-warp CTAs, CUDA-graph replay.

    PYTHONPATH=. python bench/sweeps/kda_decode_grid.py OUTDIR [TAG] [--tree DIR] [--rows S:B:T,...]
        [--variants default,w1,w2,w4]

Case: HV 32, H 16, K = V = 128, fp16 q/k/v/a/b (the bf16 inputs' kernel path), gate
``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``, q/k L2 norm and beta sigmoid in kernel, a pool of 4 * B slots updated in
place through 4 rotated slot permutations (each graph replays 4 calls, one per
permutation). Rows: fp32 and bf16 pools at B 32 / 256 / 1024 (T = 1, ``[B]`` slots) and
speculative verify (T = 4, ``[B, 4]`` slots and accepted counts) at B 64 / 256.

Launches per row: ``select_config``'s (``default``), and ``decode_launch.select_config``
replaced by one-, two- and four-warp CTAs (``w1``, ``w2``, ``w4``; ``--variants`` picks, by
default ``default,w2,w4``). ``--rows`` replaces the rows (state dtype, B, T; T > 1 with
``[B, T]`` slots). Beside them a device-to-device copy of
the state bytes one call moves (read + written). ``--tree DIR`` imports ``mate_cupy`` from DIR
(another checkout's package) instead of this one, for A/B runs of two trees on the same inputs. Writes
``OUTDIR/kda_decode_grid_TAG.json``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import mate_cupy as m  # noqa: E402
from mate_cupy.kda import decode_launch as dl  # noqa: E402

HV, H, K = 32, 16, 128
NSETS = 4


def variant(warps: int):
    """A ``select_config`` replacement: V-first ``warps``-warp CTAs (``decode_config``)."""
    return lambda problem, sm_count, cc: dl.decode_config(problem, cc, warps)


def make_case(B: int, T: int, state_dtype: str, seed: int = 0):
    rs = cp.random.RandomState(seed)
    h = lambda *s: rs.standard_normal(s, dtype=cp.float32).astype(cp.float16)  # noqa: E731  (bf16's kernel path)
    q, k, v, a, b = h(B, T, H, K), h(B, T, H, K), h(B, T, HV, K), h(B, T, HV, K), h(B, T, HV)
    A_log = rs.standard_normal(HV, dtype=cp.float32) * 0.5
    dt_bias = rs.standard_normal((HV, K), dtype=cp.float32) * 0.5
    P = NSETS * B * T
    pool = (rs.standard_normal((P, HV, K, K), dtype=cp.float32) * 0.1)
    if state_dtype == "bfloat16":
        import ml_dtypes

        pool = cp.asarray(cp.asnumpy(pool).astype(ml_dtypes.bfloat16).view(np.uint16)).view(ml_dtypes.bfloat16)
    perms = [cp.asarray(np.random.default_rng(i).permutation(P)[:B * T].astype(np.int32)) for i in range(NSETS)]
    if T > 1:
        idx = [p.reshape(B, T) for p in perms]
        acc = cp.asarray(np.random.default_rng(9).integers(1, T + 1, size=B).astype(np.int32))
    else:
        idx, acc = perms, None
    outs = [cp.empty((B, T, HV, K), dtype=q.dtype) for _ in range(NSETS)]

    def step(i):
        m.gated_delta_rule_decode(q, k, v, pool, A_log, a, dt_bias, acc, None, b, state_indices=idx[i],
                                  output=outs[i], use_lower_bound=True, apply_beta_sigmoid=True,
                                  inplace_final_state=True, state_v_first=True)

    itemsize = 4 if state_dtype == "float32" else 2
    state_bytes = (1 + T) * B * HV * K * K * itemsize  # one read, one write per token
    return step, state_bytes


def graph_us(step, reps: int = 20) -> float:
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for i in range(NSETS):
            step(i)
        s.begin_capture()
        for i in range(NSETS):
            step(i)
        g = s.end_capture()
        for _ in range(3):
            g.launch()
        times = []
        for _ in range(5):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            for _ in range(reps):
                g.launch()
            e1.record()
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / reps / NSETS)
    return float(np.median(times))


def copy_us(nbytes: int, reps: int = 20) -> float:
    """Device-to-device copy of nbytes / 2 (read + written = nbytes)."""
    half = nbytes // 2
    src, dst = cp.empty(half, dtype=cp.uint8), cp.empty(half, dtype=cp.uint8)
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(3):
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, half, 3, 0)
    e0.record()
    for _ in range(reps):
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, half, 3, 0)
    e1.record()
    e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) * 1e3 / reps


VARIANTS = {
    "default": None,
    "w1": variant(1),
    "w2": variant(2),
    "w4": variant(4),
}
DEFAULT_VARIANTS = ("default", "w2", "w4")
ROWS = [("float32", 32, 1), ("float32", 256, 1), ("float32", 1024, 1), ("bfloat16", 32, 1),
        ("bfloat16", 256, 1), ("bfloat16", 1024, 1), ("float32", 64, 4), ("float32", 256, 4)]


def use_tree(tree: str) -> None:
    """Rebind ``m`` and ``dl`` to the ``mate_cupy`` package of the checkout at ``tree``."""
    global m, dl
    for name in [n for n in sys.modules if n == "mate_cupy" or n.startswith("mate_cupy.")]:
        del sys.modules[name]
    sys.path.insert(0, str(Path(tree).resolve()))
    import mate_cupy
    from mate_cupy.kda import decode_launch

    m, dl = mate_cupy, decode_launch


def main(argv) -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("tag", nargs="?", default="run")
    ap.add_argument("--tree", default=None)
    ap.add_argument("--rows", default=None, help="rows as STATE:B:T,... (default: ROWS)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="of " + ", ".join(VARIANTS))
    a = ap.parse_args(argv)
    rows = ROWS if a.rows is None else [(s, int(b), int(t)) for s, b, t in (r.split(":") for r in a.rows.split(","))]
    variants = {n: VARIANTS[n] for n in a.variants.split(",")}
    outdir = Path(a.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    if a.tree:
        use_tree(a.tree)
    select = dl.select_config
    results = []
    for sdt, B, T in rows:
        step, nbytes = make_case(B, T, sdt)
        row = dict(state=sdt, B=B, T=T, bytes=nbytes, copy_us=copy_us(nbytes), tree=m.__file__)
        for name, cfg in variants.items():
            dl.select_config = select if cfg is None else cfg
            try:
                us = graph_us(step)
            finally:
                dl.select_config = select
            row[name] = us
        row["best"] = min(variants, key=lambda n: row[n])
        results.append(row)
        print(f"{sdt:8s} B{B:<5d} T{T} copy {row['copy_us']:8.1f} us ({nbytes / row['copy_us'] / 1e6:.2f} TB/s) | "
              + " ".join(f"{n} {row[n]:.1f} ({nbytes / row[n] / 1e6:.2f})" for n in variants), flush=True)
    (outdir / f"kda_decode_grid_{a.tag}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
