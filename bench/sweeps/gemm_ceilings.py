"""Dense GEMM rates of the device through torch (cuBLAS): float8 e4m3 ``torch._scaled_mm`` and
bfloat16 ``matmul`` at 8192^3, and the float8 product of the max-score long-key case's shape
(8192 x 131072 x 128, bf16 out). The float8 rate is the ceiling the float8 index pass is
compared with.

    python bench/sweeps/gemm_ceilings.py OUTDIR      (writes OUTDIR/gemm_ceilings.json)

CUDA events, median of 20 calls after 3 warm-ups.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def timed(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(n):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[n // 2]


def main(outdir: str) -> None:
    one = torch.tensor(1.0, device="cuda")
    out = {}
    for name, (m, n, k) in (("fp8_scaled_mm_8192", (8192, 8192, 8192)),
                            ("fp8_scaled_mm_8192x131072x128", (8192, 131072, 128))):
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()
        ms = timed(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        out[name] = dict(ms=ms, tflops=2 * m * n * k / ms / 1e9)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = timed(lambda: a @ b)
    out["bf16_mm_8192"] = dict(ms=ms, tflops=2 * 8192 ** 3 / ms / 1e9)
    print(json.dumps(out, indent=1))
    Path(outdir).mkdir(parents=True, exist_ok=True)
    (Path(outdir) / "gemm_ceilings.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
