"""Register split of the warp-specialised attention tile: dense and paged prefill per split.

    PYTHONPATH=. python bench/sweeps/ws_registers.py OUTDIR
    PYTHONPATH=. python bench/sweeps/ws_registers.py --build CUBIN_DIR   (compile the variants ahead)

The tile's producer and consumer warpgroups run with (producer, consumer) registers per
thread after ``setmaxnreg`` (``attention_launch.WS_REGISTERS``). For each split of
:data:`SPLITS` this registers the variant with those registers (bf16, D 128) and times our
dense prefill and our paged prefill (random page order, CSR ``kv_indices``) through the
public ``msa`` call with that variant in place of the configured one, timed by
``bench.timing.Timer`` over two rotated input sets (``bench_attention.paged_prefill_inputs``
and ``time_prefill``).
Writes ``OUTDIR/ws_registers.json``.
"""
from __future__ import annotations

import json
import sys
from unittest import mock
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

D = 128
SPLITS = ((40, 232), (56, 224), (72, 208), (88, 200))
# (batch, seqlen, page size, Hq, Hkv), causal
CASES = ((4, 8192, 64, 64, 8), (1, 8192, 16, 64, 8))


def variant(kv: int, producer: int, consumer: int):
    """The bf16 D 128 ``ws2n128s3`` variant of KV mode ``kv`` with the given registers."""
    from mate_cupy.jit import register
    from mate_cupy.jit.registry import SM90A
    from mate_cupy.msa import attention_launch as al

    base = al.SPECS[(D, al.DTYPE_BF16, al.WS_TILE, kv)]
    defines = dict(base.defines)
    defines.update(ATT_WS_PRODUCER_REGS=producer, ATT_WS_CONSUMER_REGS=consumer)
    return register(base.source, base.kernels, only_arch=SM90A, **defines)


def build(cubin_dir: str) -> None:
    from mate_cupy.jit import compiler
    from mate_cupy.msa import attention_launch as al

    specs = [variant(kv, p, c) for kv in (al.KV_DENSE, al.KV_PAGED) for p, c in SPLITS]
    for r in compiler.compile_all("sm_90a", jobs=2, specs=specs, cubin_dir=cubin_dir):
        print(r["name"], "error" if "error" in r else "ok")


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
        for kv in (al.KV_DENSE, al.KV_PAGED):
            for p, c in SPLITS:
                key = (D, al.DTYPE_BF16, al.WS_TILE, kv)
                with ba.launch_patch(mock.patch.dict(al.SPECS, {key: variant(kv, p, c)})):
                    ms = ba.time_prefill(sets, outs, batch, s, hq, hkv, page=page if kv == al.KV_PAGED else 0)
                rec = {"case": f"B{batch} S{s} page{page} Hq{hq} Hkv{hkv} causal",
                       "kv": "dense" if kv == al.KV_DENSE else "paged", "registers": [p, c], "ms": ms,
                       "tflops": flops / ms * 1e-9}
                records.append(rec)
                print(rec, flush=True)
        del sets, outs
    (out_path / "ws_registers.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "records": records}, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "--build":
        build(sys.argv[2])
    else:
        main(sys.argv[1])
