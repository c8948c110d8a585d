"""KDA decode beside fla's ``fused_recurrent_kda_fwd`` in both state layouts and three timings.

    PYTHONPATH=.:<fla site> python bench/sweeps/kda_decode_layouts.py OUTDIR [B ...]

Case: HV 32, H 16, K = V = 128, fp32 state pool of 4 * B slots updated in place, T = 1,
bf16 q/k/v/a/b, gate ``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``, q/k L2 norm and
beta sigmoid in kernel: the bench's KDA decode case (``bench_kda.decode_case`` with its
layout and slot-order options), for B in 32 / 256 / 1024 by default.
Per (B, layout, slot indices, implementation):

* ``graph_us``: CUDA-graph replay of 32 rotated calls (GPU time per call);
* ``plain_us``: back-to-back plain calls between events (host launch cost included when it
  exceeds the kernel); both from ``bench.timing.Timer`` as in ``bench/run.py``;
* ``latency_us``: one call followed by a synchronisation, wall clock (median of 60).

Layouts: V-first ``[P, HV, V, K]`` (fla ``state_v_first=True``) and K-first
``[P, HV, K, V]`` (fla's default). Slot indices: a random permutation of the pool (``idx``)
or the identity (``ident``). Beside them, a device-to-device copy of the same bytes
(``copy``, graph replay). Writes ``OUTDIR/kda_decode_layouts.json`` and ``.md``.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.bench_kda import K, V, decode_case  # noqa: E402
from bench.fla_peer import FlaSession  # noqa: E402
from bench.harness import BenchConfig  # noqa: E402
from bench.timing import Timer, TimingConfig  # noqa: E402

HV, H = 32, 16
NSETS = 4  # input sets rotated through (each updates its own B slots of the pool)


def latency_us(timer, run, n: int = 60) -> float:
    """Median wall-clock microseconds of one call followed by a synchronisation."""
    return statistics.median(timer.wall(lambda i=i: run(i % NSETS))[1] for i in range(n)) * 1e6


def batch_rows(B: int, session, timer) -> list:
    """Rows of one batch size: the bench's KDA decode case (``bench_kda.decode_case``) in
    both layouts and slot orders, each implementation timed three ways, then a copy."""
    import torch

    cfg = BenchConfig()
    rows = []
    for v_first in (True, False):
        for identity in (False, True):
            case = decode_case(cfg, B, HV, H, session=session, target=None, v_first=v_first,
                               identity_slots=identity)
            inputs = case.make_inputs(NSETS)
            for impl in case.impls:
                row = dict(B=B, layout="V-first" if v_first else "K-first", slots="ident" if identity else "idx",
                           impl=impl.name)
                try:
                    with impl.guard() if impl.guard else contextlib.nullcontext():
                        run = impl.build(inputs).run
                        run(0)
                    row.update(graph_us=timer.time_graph(run, NSETS)["ms_graph"] * 1e3,
                               plain_us=timer.time(run, NSETS)["ms"] * 1e3, latency_us=latency_us(timer, run))
                    row["tbps_graph"] = case.bytes / (row["graph_us"] * 1e-6) / 1e12
                except Exception as e:  # reported (fla not importable, ...), the sweep goes on
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(json.dumps(row), flush=True)
                rows.append(row)
            del inputs
            torch.cuda.empty_cache()
    src = torch.randn((B * NSETS, HV, V, K), device="cuda")
    dst = torch.empty_like(src)

    def copy(i):
        j = (i + 1) % NSETS
        dst[i * B:(i + 1) * B].copy_(src[j * B:(j + 1) * B])

    row = dict(B=B, impl="copy", graph_us=timer.time_graph(copy, NSETS)["ms_graph"] * 1e3)
    row["tbps_graph"] = case.bytes / (row["graph_us"] * 1e-6) / 1e12
    print(json.dumps(row), flush=True)
    rows.append(row)
    src = dst = None  # freed before the next batch size
    torch.cuda.empty_cache()
    return rows


def markdown(rows: list) -> str:
    out = ["| B | layout | slots | impl | graph us | plain us | latency us | TB/s (graph) | ours / fla (graph, plain, latency) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    fla = {(r["B"], r.get("layout"), r.get("slots")): r for r in rows if r["impl"] == "fla" and "graph_us" in r}
    for r in rows:
        if "error" in r:
            out.append(f"| {r['B']} | {r.get('layout', '')} | {r.get('slots', '')} | {r['impl']} | {r['error']} | | | | |")
            continue
        ratio = ""
        peer = fla.get((r["B"], r.get("layout"), r.get("slots")))
        if r["impl"] == "mate_cupy" and peer:
            ratio = " / ".join(f"{peer[k] / r[k]:.2f}x" for k in ("graph_us", "plain_us", "latency_us"))
        plain, lat = (f"{r[k]:.1f}" if k in r else "-" for k in ("plain_us", "latency_us"))
        out.append(f"| {r['B']} | {r.get('layout', '-')} | {r.get('slots', '-')} | {r['impl']} | {r['graph_us']:.1f} | "
                   f"{plain} | {lat} | {r['tbps_graph']:.2f} | {ratio} |")
    return "\n".join(out) + "\n"


def main(outdir: str, batches) -> None:
    import torch

    session = FlaSession(budget_s=300.0, configs_dir=None)
    timer = Timer(TimingConfig())
    rows = []
    for B in batches:
        rows += batch_rows(B, session, timer)
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), commit=os.environ.get("MATE_CUPY_COMMIT"),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    (out / "kda_decode_layouts.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    (out / "kda_decode_layouts.md").write_text(
        f"KDA decode beside fla, {meta['gpu']}, commit {meta['commit']}, {meta['date']}\n\n" + markdown(rows))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    main(sys.argv[1], [int(b) for b in sys.argv[2:]] or [32, 256, 1024])
