"""The float8 and bf16 prefill max score under sustained load, with the board's clocks and power:
each pass runs back to back (20 calls per synchronisation) for ``--seconds`` while
``nvidia-smi`` samples ``clocks.sm``, ``power.draw``, ``clocks_throttle_reasons.active`` and
``temperature.gpu`` about every 50 ms; phases bf16, float8, bf16, float8. The case is the
benchmark's ``max score fp8`` one (Sq 8192, Sk 131072, Hq 4, Hkv 1, D 128, causal; q and k
float8 e4m3 at per-tensor scales 0.05 and 0.03).

    PYTHONPATH=. python bench/sweeps/max_score_power.py OUTDIR [--seconds 3]

Writes ``OUTDIR/max_score_power.json``: per phase the ms per call, the call count, and the
samples (the first quarter of each phase is the ramp and is left out of the medians).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench import ours  # noqa: E402
from bench.bench_index import _e4m3  # noqa: E402

SQ, SK, HQ, HKV, D = 8192, 131072, 4, 1, 128
Q_SCALE, K_SCALE = 0.05, 0.03
QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active,temperature.gpu"


def _sampler(samples: list, stop: threading.Event) -> None:
    while not stop.is_set():
        r = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True)
        fields = r.stdout.strip().split(", ")
        if len(fields) == 4:
            samples.append(fields)
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(9)
    q = torch.randn((SQ, HQ, D), generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn((SK, HKV, D), generator=g, device="cuda").to(torch.bfloat16)
    q8, k8 = _e4m3(q, Q_SCALE), _e4m3(k, K_SCALE)
    plan = ours.eager_plan([SQ], [SK], HQ, HKV, causal=True)
    out = torch.empty((SQ, HQ, -(-SK // 128)), dtype=torch.float32, device="cuda")

    def call(fp8: bool) -> None:
        if fp8:
            ours.msa(q8, k8, k8, plan, max_score=out, output_o=False, k_scale=Q_SCALE * K_SCALE)
        else:
            ours.msa(q, k, k, plan, max_score=out, output_o=False)

    phases = {}
    for name, fp8 in (("bf16", False), ("fp8", True), ("bf16_2", False), ("fp8_2", True)):
        for _ in range(3):
            call(fp8)
        torch.cuda.synchronize()
        samples: list = []
        stop = threading.Event()
        th = threading.Thread(target=_sampler, args=(samples, stop))
        th.start()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n, t0 = 0, time.time()
        e0.record()
        while time.time() - t0 < args.seconds:
            for _ in range(20):
                call(fp8)
            n += 20
            torch.cuda.synchronize()
        e1.record()
        torch.cuda.synchronize()
        stop.set()
        th.join()
        steady = samples[len(samples) // 4:]
        phases[name] = {
            "ms_per_call": e0.elapsed_time(e1) / n, "calls": n,
            "sm_clock_mhz_median": statistics.median(float(s[0]) for s in steady) if steady else None,
            "power_w_median": statistics.median(float(s[1]) for s in steady) if steady else None,
            "throttle_reasons": sorted({s[2] for s in steady}), "samples": samples,
        }
        print(name, round(phases[name]["ms_per_call"], 4), phases[name]["sm_clock_mhz_median"],
              phases[name]["power_w_median"], phases[name]["throttle_reasons"], flush=True)
    Path(args.outdir).mkdir(parents=True, exist_ok=True)
    res = {"gpu": torch.cuda.get_device_name(), "case": f"Sq{SQ} Sk{SK} Hq{HQ} Hkv{HKV} D{D} causal",
           "seconds": args.seconds, "phases": phases}
    (Path(args.outdir) / "max_score_power.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
