"""Wall time of our first ``chunk_kda`` call in a fresh process (run by bench_kda.py).

Prints one JSON line: ``{"first_call_ms": .., "second_call_ms": ..}``. The first
call includes NVRTC compilation unless CuPy's kernel disk cache (``CUPY_CACHE_DIR``)
already holds the variant; imports and input creation are not timed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=64)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch

    import mate_cupy

    dev = "cuda"
    t, h, d = args.tokens, args.heads, 128
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.randn(shape, generator=g, device=dev).to(torch.bfloat16)

    q, k, v, gate, beta = rnd(1, t, h, d), rnd(1, t, h, d), rnd(1, t, h, d), rnd(1, t, h, d), rnd(1, t, h)
    a_log = torch.log(torch.empty(h, device=dev).uniform_(1.0, 16.0, generator=g))
    dt_bias = torch.randn(h * d, generator=g, device=dev) * 0.5
    out = torch.empty_like(v)
    final = torch.empty((1, h, d, d), dtype=torch.float32, device=dev)

    def call():
        mate_cupy.chunk_kda(q, k, v, gate, beta, A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0,
                            use_qk_l2norm_in_kernel=True, output_final_state=True, output=out, final_state=final)

    torch.cuda.synchronize()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"first_call_ms": times[0], "second_call_ms": times[1]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
