"""Per-token sparse prefill at MiniMax-M3's shapes: the `gather` tile's time per call and a
checksum of its output, for A/B runs of two trees.

    PYTHONPATH=. python bench/sweeps/per_token_prefill.py OUTDIR TAG [--tree DIR] [--reps N] [S ...]

Hq 64, Hkv 4, D 128, bf16, page 128, 16 blocks per query token (block 0, the query's own
block and 14 random earlier ones, ``bench_attention.select_blocks``), fixed seed; ``sparse_msa``
with a ``sparse_plan`` of the plan's default tile. ``--tree DIR`` imports ``mate_cupy`` from
DIR (another checkout's package) instead of this one, so two trees run the same inputs; the
checksum (sum of |out| in fp32) shows whether their outputs agree. Times: CUDA events over N
back-to-back calls after N warm-up calls. Appends one JSON line per S to ``OUTDIR/TAG.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("tag")
    ap.add_argument("--tree", default=None)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("seqlens", nargs="*", type=int, default=[32768])
    a = ap.parse_intermixed_args(argv)  # sequence lengths may follow the options
    sys.path.insert(0, str(ROOT))
    if a.tree:
        sys.path.insert(0, str(Path(a.tree).resolve()))
    import torch

    import mate_cupy
    from bench import ours
    from bench.bench_attention import select_blocks

    out_dir = Path(a.outdir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hq, hkv, d, topk = 64, 4, 128, 16
    for s in a.seqlens:
        n_blocks = math.ceil(s / 128)
        g = torch.Generator(device="cuda").manual_seed(3)
        ids = select_blocks(torch.arange(s, device="cuda") // 128, hkv, n_blocks, topk, g)
        q = torch.randn((s, hq, d), generator=g, device="cuda").to(torch.bfloat16)
        kc = torch.randn((n_blocks, 128, hkv, d), generator=g, device="cuda").to(torch.bfloat16)
        vc = torch.randn((n_blocks, 128, hkv, d), generator=g, device="cuda").to(torch.bfloat16)
        perm = torch.randperm(n_blocks, generator=g, device="cuda").to(torch.int32)
        plan = ours.sparse_plan([s], [s], hq, hkv, page_size=128, kv_block_num=topk, causal=True)
        out = torch.empty_like(q)

        def run():
            ours.sparse_msa(q, kc, vc, plan, kv_indices=perm, kv_block_indexes=ids, out=out)

        for _ in range(a.reps):
            run()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(a.reps):
            run()
        e1.record()
        e1.synchronize()
        rec = {"tag": a.tag, "tree": mate_cupy.__file__, "S": s, "ms": e0.elapsed_time(e1) / a.reps,
               "checksum": out.float().abs().sum().item()}
        print(json.dumps(rec), flush=True)
        with open(out_dir / f"{a.tag}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        del q, kc, vc, out, plan
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
