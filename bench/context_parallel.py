"""Context-parallel prefill (mate_cupy.distributed) on 1, 2, 4, 8 GPUs: time per layer,
scaling efficiency and bytes moved per layer.

    python bench/context_parallel.py OUTDIR                        # world sizes 1,2,4,8 that fit the GPUs
    python bench/context_parallel.py OUTDIR --world 1              # one GPU
    python bench/context_parallel.py OUTDIR --world 2 --device cpu # gloo smoke run, tiny shapes

For each world size ``W`` the script starts ``W`` processes (one per GPU, a ``file://``
rendezvous in OUTDIR; NCCL on GPUs with NVLink SHARP / multicast off, gloo on CPU). Each
rank builds its own shard (random bf16) and times, per layer:

* ``msa sparse``: :func:`~mate_cupy.distributed.cp_sparse_attention`: all-gather of K, V
  and the index keys, then the MSA pipeline (index max score, top-16, block-sparse
  attention) of its two zig-zag chunks;
* ``msa dense``: :func:`~mate_cupy.distributed.cp_dense_attention` (causal, over the
  gathered K/V) at ``--dense-seq-len`` tokens (dense attention grows as T^2);
* ``kda``: :func:`~mate_cupy.distributed.cp_chunk_kda` over contiguous segments;
* ``gather``: the K/V/index all-gathers alone (what the sparse layer moves).

A layer's time is the slowest rank's (CUDA events, or wall clock on CPU), median over
``--samples`` calls after one warm-up. Scaling efficiency is ``t(1) / (W t(W))`` against
the world-size-1 row of the same run. Bytes are per rank and layer, received:
``(W - 1) / W * T * (2 * Hkv * D + Hik * Di) * 2`` for MSA (bf16 K, V and index keys),
``(W - 1) * 2 * B * HV * 128 * 128 * 4`` for KDA (the float32 segment maps).
Writes OUTDIR/results.json (one record per op and world size) and OUTDIR/results.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# MiniMax-M3-like MSA (Hq64 Hkv4 D128, index 4 heads over 1 KV head D128, top-16 with the
# first and each query's own block forced) and a Kimi-Linear-like KDA layer (H = HV = 32).
SHAPES = {
    "cuda": dict(seq_len=1 << 20, dense_seq_len=1 << 17, hq=64, hkv=4, hik=1, di=128, topk=16, begin=1, end=1,
                 kda_heads=32),
    "cpu": dict(seq_len=1024, dense_seq_len=256, hq=16, hkv=1, hik=1, di=64, topk=4, begin=1, end=1, kda_heads=2),
}
D = 128


def _bytes_msa(s: dict, seq_len: int, world: int, index: bool) -> int:
    per_token = 2 * s["hkv"] * D + (s["hik"] * s["di"] if index else 0)
    return int((world - 1) * seq_len * per_token * 2 // world)


def _bytes_kda(s: dict, world: int) -> int:
    return (world - 1) * 2 * 1 * s["kda_heads"] * D * D * 4


# ----------------------------------------------------------------------------- one rank


def _rank_main(a) -> None:
    import torch
    import torch.distributed as dist

    from mate_cupy import distributed as cp

    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(a.rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=a.init, rank=a.rank, world_size=a.world,
                            **({"device_id": dev} if cuda else {}))
    s = dict(SHAPES[a.device])
    if a.seq_len:
        s["seq_len"] = a.seq_len
    if a.dense_seq_len:
        s["dense_seq_len"] = a.dense_seq_len
    W, r = a.world, a.rank
    g = torch.Generator(device=dev).manual_seed(1000 + r)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.bfloat16)

    def timed(fn) -> float:
        """Median over samples of the slowest rank's time (ms) of ``fn()``."""
        fn()  # warm-up (first-call compilation, plan uploads)
        times = []
        for _ in range(a.samples):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
                ms = e0.elapsed_time(e1)
            else:
                t0 = time.perf_counter()
                fn()
                ms = (time.perf_counter() - t0) * 1e3
            t = torch.tensor([ms], dtype=torch.float64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(float(t.item()))
        return statistics.median(times)

    rows = []
    ops = a.ops.split(",")
    if "sparse" in ops or "gather" in ops:
        T = s["seq_len"]
        plan = cp.cp_attention_plan(T, s["hq"], s["hkv"], num_index_kv_heads=s["hik"], topk=s["topk"],
                                    force_begin_blocks=s["begin"], force_end_blocks=s["end"], device=dev)
        n = plan.local_len
        q, k, v = randn(n, s["hq"], D), randn(n, s["hkv"], D), randn(n, s["hkv"], D)
        iq, ik = randn(n, s["hkv"], s["di"]), randn(n, s["hik"], s["di"])
        out = torch.empty_like(q)
        if "sparse" in ops:
            ms = timed(lambda: cp.cp_sparse_attention(q, k, v, iq, ik, plan, out=out))
            rows.append(dict(op="msa sparse", seq_len=T, ms=ms, bytes=_bytes_msa(s, T, W, True)))
        if "gather" in ops and W > 1:
            def gather():
                for x in (k, v, ik):
                    buf = torch.empty((W * n,) + tuple(x.shape[1:]), dtype=x.dtype, device=dev)
                    cp._all_gather_single(buf.view(-1).view(torch.uint8), x.view(-1).view(torch.uint8))
            ms = timed(gather)
            rows.append(dict(op="gather k/v/index", seq_len=T, ms=ms, bytes=_bytes_msa(s, T, W, True)))
        del plan, q, k, v, iq, ik, out
    if "dense" in ops:
        T = s["dense_seq_len"]
        plan = cp.cp_attention_plan(T, s["hq"], s["hkv"], sparse=False, device=dev)
        n = plan.local_len
        q, k, v = randn(n, s["hq"], D), randn(n, s["hkv"], D), randn(n, s["hkv"], D)
        out = torch.empty_like(q)
        ms = timed(lambda: cp.cp_dense_attention(q, k, v, plan, out=out))
        rows.append(dict(op="msa dense", seq_len=T, ms=ms, bytes=_bytes_msa(s, T, W, False)))
        del plan, q, k, v, out
    if "kda" in ops:
        T = s["seq_len"]
        h = s["kda_heads"]
        A_log = torch.zeros(h, dtype=torch.float32, device=dev)
        dt_bias = torch.zeros(h, D, dtype=torch.float32, device=dev)
        # equal segments; then rank 0 three times the others' (it runs one pass, they three)
        for op, t_r in (("kda", T // W), ("kda 3:1:..:1", (3 if r == 0 else 1) * (T // (W + 2)))):
            if op != "kda" and W == 1:
                continue
            x = dict(q=randn(1, t_r, h, D), k=randn(1, t_r, h, D), v=randn(1, t_r, h, D),
                     g=randn(1, t_r, h, D), beta=randn(1, t_r, h))
            ms = timed(lambda: cp.cp_chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=A_log,
                                               dt_bias=dt_bias, output_final_state=True))
            rows.append(dict(op=op, seq_len=T, ms=ms, bytes=_bytes_kda(s, W)))
            del x
    if r == 0:
        name = torch.cuda.get_device_name(dev) if cuda else "cpu"
        for row in rows:
            row.update(world=W, device=name)
        Path(a.out, f"world{W}.json").write_text(json.dumps(rows, indent=1))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the launcher


def _launch(world: int, a, out: Path) -> list:
    rdv = out / f"rendezvous{world}"
    if rdv.exists():
        rdv.unlink()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **NCCL_ENV)
    if a.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, __file__, str(out), "--_rank", "0", "--world", str(world), "--device", a.device,
           "--init", f"file://{rdv}", "--samples", str(a.samples), "--ops", a.ops]
    if a.seq_len:
        cmd += ["--seq-len", str(a.seq_len)]
    if a.dense_seq_len:
        cmd += ["--dense-seq-len", str(a.dense_seq_len)]
    procs = []
    for r in range(world):
        c = list(cmd)
        c[c.index("--_rank") + 1] = str(r)
        procs.append(subprocess.Popen(c, env=env))
    deadline = time.monotonic() + a.timeout
    ok = True
    for p in procs:
        try:
            ok &= p.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
        except subprocess.TimeoutExpired:
            ok = False
            break
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    path = out / f"world{world}.json"
    if not ok or not path.exists():
        print(f"world size {world}: failed or timed out", file=sys.stderr)
        return []
    return json.loads(path.read_text())


def _report(rows: list) -> str:
    base = {(x["op"], x["seq_len"]): x["ms"] for x in rows if x["world"] == 1}
    for (op, n), ms in list(base.items()):
        if op == "kda":
            base[("kda 3:1:..:1", n)] = ms  # the same work on one GPU
    lines = ["| op | tokens | ranks | ms per layer | speed-up | scaling efficiency | MB received per rank |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for x in sorted(rows, key=lambda x: (x["op"], x["world"])):
        t1 = base.get((x["op"], x["seq_len"]))
        sp = f"{t1 / x['ms']:.2f}x" if t1 and x["op"] != "gather k/v/index" else ""
        eff = f"{t1 / (x['world'] * x['ms']):.0%}" if t1 and x["op"] != "gather k/v/index" else ""
        x["speedup"] = t1 / x["ms"] if sp else None
        x["efficiency"] = t1 / (x["world"] * x["ms"]) if eff else None
        lines.append(f"| {x['op']} | {x['seq_len']} | {x['world']} | {x['ms']:.2f} | {sp} | {eff} | "
                     f"{x['bytes'] / 1e6:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--world", default=None, help="world sizes, comma separated (default: 1,2,4,8 up to the GPUs)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--seq-len", type=int, default=None, help="MSA sparse / KDA tokens (default 1M on CUDA)")
    ap.add_argument("--dense-seq-len", type=int, default=None, help="MSA dense tokens (default 128K on CUDA)")
    ap.add_argument("--ops", default="sparse,gather,dense,kda")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per world size")
    ap.add_argument("--_rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--init", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    if a._rank is not None:
        a.rank, a.out = a._rank, str(out)
        a.world = int(a.world)
        _rank_main(a)
        return 0
    if a.world is None:
        if a.device == "cuda":
            import torch

            n = torch.cuda.device_count()
            worlds = [w for w in (1, 2, 4, 8) if w <= n]
        else:
            worlds = [1, 2]
    else:
        worlds = [int(w) for w in str(a.world).split(",")]
    rows = []
    for w in worlds:
        rows += _launch(w, a, out)
    md = _report(rows)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "results.md").write_text(md)
    print(md)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
