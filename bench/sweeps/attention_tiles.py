"""Query tiles of the attention forward side by side: dense, paged and block-sparse prefill per
tile.

    PYTHONPATH=. python bench/sweeps/attention_tiles.py OUTDIR

For each case, the public ``msa`` call on an eager plan with each registered query tile
forced (the configuration's tile choice replaced before the plan is built), timed by
``bench.timing.Timer`` over two rotated input sets (``bench_attention.paged_prefill_inputs``
and ``time_prefill``);
our dense prefill (its default tile) on the same
values laid out contiguously is the baseline of the paged rows, and every paged output and
every dense output of a forced warp-specialised tile is compared with it (relative error). The block-sparse rows time ``sparse_msa`` with
the query tiles (``prefill_tile="query"``) on the benchmark's inputs (``bench_attention``'s
sparse case, S32768 Hq64 Hkv4 top 16, lists shared per 128-query tile or chosen per token),
outputs compared with the first tile's. Writes ``OUTDIR/attention_tiles.json`` and prints a
table.
"""
from __future__ import annotations

import json
import sys
from unittest import mock
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

D = 128
# (batch, seqlen, page size, Hq, Hkv, causal)
CASES = ((4, 8192, 64, 64, 8, True), (16, 1024, 64, 64, 8, True), (16, 1024, 64, 64, 8, False),
         (8, 2048, 64, 64, 8, True), (4, 4096, 64, 64, 8, True),
         (1, 8192, 16, 64, 8, True), (1, 8192, 256, 64, 8, False), (1, 32768, 64, 64, 4, True))


def _tiles(al, kv: int) -> list:
    """The registered prefill query tiles of KV mode ``kv`` (bf16, D 128)."""
    return [t for t in al.TILES if t != "decode" and (D, al.DTYPE_BF16, t, kv) in al.SPECS]


def _forced(al, tile: str):
    """The block with ``tile`` as the configuration's tile choice (``bench_attention.launch_patch``)."""
    from bench import bench_attention as ba

    return ba.launch_patch(mock.patch.object(al, "choose_tile", lambda p, cc: tile))


def main(outdir: str) -> None:
    import torch

    from bench import bench_attention as ba
    from bench import ours
    from bench.models import attention_flops
    from bench.timing import Timer, TimingConfig
    from mate_cupy.msa import attention_launch as al

    out_path = Path(outdir)
    out_path.mkdir(parents=True, exist_ok=True)
    records = []
    for batch, s, page, hq, hkv, causal in CASES:
        sets = ba.paged_prefill_inputs("cuda", 2, batch, s, page, hq, hkv)
        flops = attention_flops(batch, hq, s, s, D, causal)
        name = f"B{batch} S{s} page{page} Hq{hq} Hkv{hkv} " + ("causal" if causal else "non-causal")

        outs = [torch.empty_like(x["q"]) for x in sets]
        dense_ms = ba.time_prefill(sets, outs, batch, s, hq, hkv, causal=causal)
        ref = outs[0].float()
        rec = {"case": name, "tflops_dense": flops / dense_ms * 1e-9, "dense_ms": dense_ms, "tiles": {},
               "dense_tiles": {}}
        for tile in _tiles(al, al.KV_DENSE):
            if tile == "prefill":  # (the mma.sync tile: GPUs without the warpgroup tiles)
                continue
            douts = [torch.full_like(x["q"], float("nan")) for x in sets]
            with _forced(al, tile):
                ms = ba.time_prefill(sets, douts, batch, s, hq, hkv, causal=causal)
            err = float(((douts[0].float() - ref).norm() / ref.norm()).item())
            rec["dense_tiles"][tile] = {"ms": ms, "tflops": flops / ms * 1e-9, "rel_err": err}
        for tile in _tiles(al, al.KV_PAGED):
            pouts = [torch.full_like(x["q"], float("nan")) for x in sets]
            with _forced(al, tile):
                ms = ba.time_prefill(sets, pouts, batch, s, hq, hkv, page=page, causal=causal)
            err = float(((pouts[0].float() - ref).norm() / ref.norm()).item())
            rec["tiles"][tile] = {"ms": ms, "tflops": flops / ms * 1e-9, "vs_dense": dense_ms / ms, "rel_err": err}
        records.append(rec)
        print(f"{name}: dense {dense_ms:.3f} ms ({rec['tflops_dense']:.0f} TF/s); " + "; ".join(
            f"dense {t} {r['ms']:.3f} ms err {r['rel_err']:.1e}" for t, r in rec["dense_tiles"].items()) + "; " + "; ".join(
            f"{t} {r['ms']:.3f} ms {r['vs_dense']:.2f}x err {r['rel_err']:.1e}" for t, r in rec["tiles"].items()),
            flush=True)
        del sets, outs
    cfg = SimpleNamespace(device="cuda", flex_per_token=False, size="full")
    for per_token in (False, True):
        case = ba.sparse_case(cfg, 32768, 64, 4, 16, per_token=per_token, target=None)
        sets = case.make_inputs(2)
        flops = case.flops
        rec = {"case": case.name, "tiles": {}}
        ref = None
        for tile in _tiles(al, al.KV_SPARSE):
            pouts = [torch.full_like(x["q"], float("nan")) for x in sets]
            with _forced(al, tile):
                plan = ours.sparse_plan([32768], [32768], 64, 4, page_size=128, kv_block_num=16, causal=True,
                                        prefill_tile="query")

                def run(i):
                    return ours.sparse_msa(sets[i]["q"], sets[i]["k_cache"], sets[i]["v_cache"], plan,
                                           kv_indices=sets[i]["kv_indices"],
                                           kv_block_indexes=sets[i]["kv_block_indexes"], out=pouts[i])

                ms = Timer(TimingConfig()).time(run, len(sets))["ms"]
            o = pouts[0].float()
            err = 0.0 if ref is None else float(((o - ref).norm() / ref.norm()).item())
            ref = o if ref is None else ref
            rec["tiles"][tile] = {"ms": ms, "rel_err_vs_first": err, "nan": bool(torch.isnan(o).any().item())}
            if flops:
                rec["tiles"][tile]["tflops"] = flops / ms * 1e-9
        records.append(rec)
        print(f"{case.name}: " + "; ".join(f"{t} {r['ms']:.3f} ms err {r['rel_err_vs_first']:.1e} nan {r['nan']}"
                                           for t, r in rec["tiles"].items()), flush=True)
        del sets
    (out_path / "attention_tiles.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "records": records}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
