"""Wall time of our first KDA call in a fresh process (run by bench_kda.py).

``--op chunk``: ``chunk_kda`` (bf16, gate parameters, l2norm, fp32 final state);
``--op decode``: one in-place ``gated_delta_rule_decode`` step over a V-first fp32 pool
(``--state-dtype bfloat16`` for a bf16 pool); ``--op decode-spec``: the same with
``[N, 4]`` slots and accepted counts. Prints one JSON line:
``{"op": .., "first_call_ms": .., "second_call_ms": ..}``. The first call includes NVRTC
compilation unless CuPy's kernel disk cache (``CUPY_CACHE_DIR``) already holds the
variant; imports and input creation are not timed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

OPS = ("chunk", "decode", "decode-spec")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--op", choices=OPS, default="chunk")
    ap.add_argument("--tokens", type=int, default=1024, help="chunk: sequence length")
    ap.add_argument("--heads", type=int, default=64, help="value heads (= q/k heads for chunk, 2x for decode)")
    ap.add_argument("--batch", type=int, default=32, help="decode: sequences")
    ap.add_argument("--state-dtype", default="float32", choices=("float32", "bfloat16"), help="decode pool")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch

    import mate_cupy

    dev = "cuda"
    d = 128
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.randn(shape, generator=g, device=dev).to(torch.bfloat16)

    h = args.heads
    a_log = torch.log(torch.empty(h, device=dev).uniform_(1.0, 16.0, generator=g))
    dt_bias = torch.randn(h * d, generator=g, device=dev) * 0.5
    if args.op == "chunk":
        t = args.tokens
        q, k, v, gate, beta = rnd(1, t, h, d), rnd(1, t, h, d), rnd(1, t, h, d), rnd(1, t, h, d), rnd(1, t, h)
        out = torch.empty_like(v)
        final = torch.empty((1, h, d, d), dtype=torch.float32, device=dev)

        def call():
            mate_cupy.chunk_kda(q, k, v, gate, beta, A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0,
                                use_qk_l2norm_in_kernel=True, output_final_state=True, output=out,
                                final_state=final)
    else:
        b, t = args.batch, (4 if args.op == "decode-spec" else 1)
        hq = max(1, h // 2)
        q, k, v, a, beta = rnd(b, t, hq, d), rnd(b, t, hq, d), rnd(b, t, h, d), rnd(b, t, h, d), rnd(b, t, h)
        pool = (torch.randn((b * t, h, d, d), generator=g, device=dev) * 0.05).to(getattr(torch, args.state_dtype))
        perm = torch.randperm(b * t, device=dev, generator=g).to(torch.int32)
        idx = perm[:b] if t == 1 else perm.view(b, t)
        acc = None if t == 1 else torch.full((b,), t, dtype=torch.int32, device=dev)
        out = torch.empty_like(v)

        def call():
            mate_cupy.gated_delta_rule_decode(q, k, v, pool, a_log, a, dt_bias.view(h, d), acc, None, beta,
                                              state_indices=idx, output=out, use_lower_bound=True,
                                              apply_beta_sigmoid=True, inplace_final_state=True)

    torch.cuda.synchronize()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"op": args.op, "first_call_ms": times[0], "second_call_ms": times[1]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
