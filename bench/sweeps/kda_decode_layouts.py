"""KDA decode beside fla's ``fused_recurrent_kda_fwd`` in both state layouts and three timings.

    PYTHONPATH=.:<fla site> python bench/sweeps/kda_decode_layouts.py OUTDIR [B ...]

Case: HV 32, H 16, K = V = 128, fp32 state pool of 4 * B slots updated in place, T = 1,
bf16 q/k/v/a/b, gate ``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``, q/k L2 norm and
beta sigmoid in kernel (the bench's KDA decode case), for B in 32 / 256 / 1024 by default.
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

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.timing import Timer, TimingConfig  # noqa: E402

HV, H, K, V = 32, 16, 128, 128
NSETS = 4
LOWER_BOUND = -5.0


def latency_us(run, n: int = 60) -> float:
    import torch

    torch.cuda.synchronize()
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        run(i % NSETS)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def batch_rows(B: int, fla, timer) -> list:
    import torch

    import mate_cupy

    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)

    pool_slots = B * NSETS  # each input set updates its own slots
    perm = torch.randperm(pool_slots, generator=g, device="cuda").to(torch.int32)
    a_log = torch.log(torch.empty(HV, device="cuda").uniform_(1, 16, generator=g))
    dt_bias = torch.randn(HV, K, device="cuda") * 0.5
    sets = [dict(q=rnd(B, 1, H, K), k=rnd(B, 1, H, K), v=rnd(B, 1, HV, V), a=rnd(B, 1, HV, K), b=rnd(B, 1, HV),
                 idx=perm[i * B:(i + 1) * B].contiguous(),
                 ident=torch.arange(i * B, (i + 1) * B, device="cuda", dtype=torch.int32),
                 out=torch.empty(B, 1, HV, V, device="cuda", dtype=torch.bfloat16)) for i in range(NSETS)]
    state_bytes = 2 * B * HV * V * K * 4
    rows = []
    for v_first in (True, False):
        pool = torch.randn((pool_slots, HV, V, K) if v_first else (pool_slots, HV, K, V), generator=g,
                           device="cuda") * 0.05
        for slots in ("idx", "ident"):
            def ours(i, pool=pool, v_first=v_first, slots=slots):
                x = sets[i]
                mate_cupy.gated_delta_rule_decode(
                    x["q"], x["k"], x["v"], pool, a_log, x["a"], dt_bias, None, None, x["b"], state_indices=x[slots],
                    output=x["out"], use_qk_l2norm=True, lower_bound=LOWER_BOUND, use_gate_in_kernel=True,
                    use_lower_bound=True, apply_beta_sigmoid=True, inplace_final_state=True, state_v_first=v_first)

            def peer(i, pool=pool, v_first=v_first, slots=slots):
                x = sets[i]
                fla(q=x["q"], k=x["k"], v=x["v"], g=x["a"], beta=x["b"], A_log=a_log, dt_bias=dt_bias,
                    initial_state=pool, scale=None, output_final_state=False, inplace_final_state=True,
                    state_v_first=v_first, ssm_state_indices=x[slots], use_qk_l2norm_in_kernel=True,
                    use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND, out=x["out"])

            for name, fn in (("mate_cupy", ours), ("fla", peer)):
                row = dict(B=B, layout="V-first" if v_first else "K-first", slots=slots, impl=name)
                if fn is peer and fla is None:
                    row["error"] = "fla not importable"
                else:
                    try:
                        row.update(graph_us=timer.time_graph(fn, NSETS)["ms_graph"] * 1e3,
                                   plain_us=timer.time(fn, NSETS)["ms"] * 1e3, latency_us=latency_us(fn))
                        row["tbps_graph"] = state_bytes / (row["graph_us"] * 1e-6) / 1e12
                    except Exception as e:  # reported, the sweep goes on
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(json.dumps(row), flush=True)
                rows.append(row)
        del pool
        torch.cuda.empty_cache()
    src = torch.randn((pool_slots, HV, V, K), device="cuda")
    dst = torch.empty_like(src)

    def copy(i):
        j = (i + 1) % NSETS
        dst[i * B:(i + 1) * B].copy_(src[j * B:(j + 1) * B])

    row = dict(B=B, impl="copy", graph_us=timer.time_graph(copy, NSETS)["ms_graph"] * 1e3)
    row["tbps_graph"] = state_bytes / (row["graph_us"] * 1e-6) / 1e12
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

    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla
    except Exception as e:  # the peer is optional
        print(f"fla not importable ({type(e).__name__}: {e})")
        fla = None
    timer = Timer(TimingConfig())
    rows = []
    for B in batches:
        rows += batch_rows(B, fla, timer)
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
