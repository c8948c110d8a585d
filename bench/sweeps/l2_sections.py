"""L2 sections of the persistent warp-specialised attention tile: dense and paged prefill per
L2 budget.

    PYTHONPATH=. python bench/sweeps/l2_sections.py OUTDIR

The tile walks its work items in sections of (request, KV head, split) triples whose K/V
fit in ``attention_launch.L2_BYTES`` together (``l2_section``). For each budget of
:data:`BUDGETS` (``None``: one section of every triple, row tiles outermost) this sets the
budget and times our dense prefill and our paged prefill (random page order, CSR
``kv_indices``) on two rotated input sets (``bench_attention.paged_prefill_inputs`` and
``time_prefill``). Writes ``OUTDIR/l2_sections.json``.
"""
from __future__ import annotations

import json
import sys
from unittest import mock
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

D = 128
MIB = 1 << 20
BUDGETS = (None, 50 * MIB, 25 * MIB, 12 * MIB, 4 * MIB)
# (batch, seqlen, page size, Hq, Hkv), causal
CASES = ((16, 1024, 64, 64, 8), (4, 8192, 64, 64, 8), (1, 8192, 64, 64, 8), (1, 32768, 64, 64, 4))


def main(outdir: str) -> None:
    import torch

    from bench import bench_attention as ba
    from bench.models import attention_flops
    from mate_cupy.msa import attention_launch as al

    out_path = Path(outdir)
    out_path.mkdir(parents=True, exist_ok=True)
    records = []
    for batch, s, page, hq, hkv in CASES:
        sets = ba.paged_prefill_inputs("cuda", 2, batch, s, page, hq, hkv)
        flops = attention_flops(batch, hq, s, s, D, True)
        outs = [torch.empty_like(x["q"]) for x in sets]
        for kv in ("dense", "paged"):
            for budget in BUDGETS:
                with ba.launch_patch(mock.patch.object(al, "L2_BYTES", 1 << 62 if budget is None else budget)):
                    ms = ba.time_prefill(sets, outs, batch, s, hq, hkv, page=page if kv == "paged" else 0)
                rec = {"case": f"B{batch} S{s} page{page} Hq{hq} Hkv{hkv} causal", "kv": kv,
                       "l2_budget_mib": None if budget is None else budget / MIB, "ms": ms,
                       "tflops": flops / ms * 1e-9}
                records.append(rec)
                print(rec, flush=True)
        del sets, outs
    (out_path / "l2_sections.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "records": records}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
