"""Multi-process cases of mate_cupy.distributed: inputs, the launcher and the rank worker.

``launch(world, out_dir, backend, device)`` starts ``world`` processes of this file (one
per rank, a ``file://`` rendezvous in ``out_dir``, a hard time limit); each rank builds
the same whole-sequence inputs (:func:`msa_inputs`, :func:`kda_inputs`), takes its shard,
runs the context-parallel ops and saves its results to ``out_dir/rank{r}.npz``. The tests
compare those with a single-process run of the whole problem.

NCCL runs keep NVLink SHARP / multicast off (``NCCL_ENV``), as every NCCL use of the
project does.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# MSA sparse: Hq/Hkv 16 (the gather tile on sm_90), one index KV head of dim 64, 8 blocks of
# 128 keys, top-4 with a forced first and last block (chunks of 256 tokens at W = 2, 128 at W = 4).
SPARSE = dict(seq_len=1024, hq=16, hkv=1, hik=1, di=64, topk=4, begin=1, end=1)
# MSA dense: GQA 2, D 64, chunks of 192, 96 and 48 tokens (W = 1, 2, 4): pages of 64, 32, 16.
DENSE = dict(seq_len=384, hq=4, hkv=2, d=64)
# KDA: two sequences, GVA 2, uneven segments (an empty one and a one-token one at W = 4).
KDA_SEGMENTS = {1: [230], 2: [100, 130], 4: [64, 1, 0, 165]}
KDA = dict(batch=2, h=1, hv=2)


def _bf16(rng, shape, scale=1.0):
    import torch

    return (torch.from_numpy(rng.standard_normal(shape) * scale)).to(torch.bfloat16)


def msa_inputs(kind: str):
    """Whole-sequence torch CPU bf16 tensors of the sparse or dense MSA case."""
    rng = np.random.default_rng(1234 if kind == "sparse" else 4321)
    if kind == "sparse":
        c = SPARSE
        T = c["seq_len"]
        return dict(q=_bf16(rng, (T, c["hq"], 128)), k=_bf16(rng, (T, c["hkv"], 128)),
                    v=_bf16(rng, (T, c["hkv"], 128)), index_q=_bf16(rng, (T, c["hkv"], c["di"])),
                    index_k=_bf16(rng, (T, c["hik"], c["di"])))
    c = DENSE
    T = c["seq_len"]
    return dict(q=_bf16(rng, (T, c["hq"], c["d"])), k=_bf16(rng, (T, c["hkv"], c["d"])),
                v=_bf16(rng, (T, c["hkv"], c["d"])))


def kda_inputs(gate: bool):
    """Whole-sequence KDA inputs (torch CPU bf16; gate parameters float32, an initial state
    float32) of ``sum(KDA_SEGMENTS[1])`` tokens."""
    import torch

    rng = np.random.default_rng(99 if gate else 98)
    B, H, HV, T = KDA["batch"], KDA["h"], KDA["hv"], sum(KDA_SEGMENTS[1])
    # Mild decay and small update strengths, so the state entering a segment still shapes
    # its outputs a hundred tokens in (the test checks that it does).
    x = dict(q=_bf16(rng, (B, T, H, 128)), k=_bf16(rng, (B, T, H, 128)), v=_bf16(rng, (B, T, HV, 128)),
             beta=(_bf16(rng, (B, T, HV)) - 2.0).to(torch.bfloat16))
    if gate:
        x["g"] = _bf16(rng, (B, T, HV, 128))
        x["A_log"] = torch.from_numpy(rng.uniform(-1.0, 0.0, HV).astype(np.float32))
        x["dt_bias"] = torch.from_numpy((rng.standard_normal((HV, 128)) - 3.0).astype(np.float32))
        x["lower_bound"] = -1.0
        x["initial_state"] = torch.from_numpy((0.5 * rng.standard_normal((B, HV, 128, 128))).astype(np.float32))
    else:
        x["g"] = (-torch.from_numpy(np.abs(rng.standard_normal((B, T, HV, 128)))) * 0.02).to(torch.bfloat16)
    return x


def segment_bounds(world: int) -> list:
    lens = KDA_SEGMENTS[world]
    return list(np.concatenate([[0], np.cumsum(lens)]).astype(int))


def _to_np(x):
    import torch

    return x.detach().to("cpu", torch.float32).numpy()


def run_rank(rank: int, world: int, device) -> dict:
    """This rank's results of every case (float32 NumPy)."""
    import torch

    from mate_cupy import distributed as D

    res = {}
    dev = torch.device(device)
    # MSA sparse
    x = msa_inputs("sparse")
    s = SPARSE
    plan = D.cp_attention_plan(s["seq_len"], s["hq"], s["hkv"], num_index_kv_heads=s["hik"], topk=s["topk"],
                               force_begin_blocks=s["begin"], force_end_blocks=s["end"], device=dev)
    loc = {n: D.zigzag_shard(t, world, rank).to(dev) for n, t in x.items()}
    out = torch.full_like(loc["q"], float("nan"))
    D.cp_sparse_attention(loc["q"], loc["k"], loc["v"], loc["index_q"], loc["index_k"], plan, out=out)
    res["sparse_out"] = _to_np(out)
    res["sparse_selection"] = np.asarray(plan.attention.selection.get() if hasattr(plan.attention.selection, "get")
                                         else plan.attention.selection)
    # MSA dense
    x = msa_inputs("dense")
    plan = D.cp_attention_plan(DENSE["seq_len"], DENSE["hq"], DENSE["hkv"], sparse=False, device=dev)
    loc = {n: D.zigzag_shard(t, world, rank).to(dev) for n, t in x.items()}
    out = torch.full_like(loc["q"], float("nan"))
    lse = torch.full(loc["q"].shape[:2], float("nan"), dtype=torch.float32, device=dev)
    D.cp_dense_attention(loc["q"], loc["k"], loc["v"], plan, out=out, lse=lse)
    res["dense_out"], res["dense_lse"] = _to_np(out), _to_np(lse)
    # KDA
    bounds = segment_bounds(world)
    a, b = bounds[rank], bounds[rank + 1]
    for gate in (True, False):
        x = kda_inputs(gate)
        seg = {n: (t[:, a:b].to(dev) if n in ("q", "k", "v", "g", "beta") else t.to(dev) if n != "lower_bound" else t)
               for n, t in x.items()}
        if rank != 0:
            seg.pop("initial_state", None)  # read on rank 0 only
        o, fs = D.cp_chunk_kda(seg.pop("q"), seg.pop("k"), seg.pop("v"), seg.pop("g"), seg.pop("beta"),
                               output_final_state=True, **seg)
        tag = "kda_gate" if gate else "kda_plain"
        res[tag + "_out"] = _to_np(o)
        if fs is not None:
            res[tag + "_final"] = _to_np(fs)
    return res


# ----------------------------------------------------------------------------- the single-process run


def rel_err(a, b) -> float:
    """Largest absolute difference over the largest magnitude of ``b`` (finite entries)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert np.isfinite(a).all()
    scale = float(np.abs(b).max(initial=0.0))
    return float(np.abs(a - b).max(initial=0.0) / (scale if scale > 0 else 1.0))


def single_process() -> dict:
    """The whole problem in one process on CPU (the float64 references)."""
    import torch

    from mate_cupy import chunk_kda, msa, msa_plan_from_lengths, sparse_attention_pipeline, sparse_pipeline_plan

    out = {}
    x = msa_inputs("sparse")
    s = SPARSE
    T = s["seq_len"]
    plan = sparse_pipeline_plan([T], [T], s["hq"], s["hkv"], num_index_kv_heads=s["hik"], topk=s["topk"],
                                force_begin_blocks=s["begin"], force_end_blocks=s["end"], device="cpu")
    pages = lambda t: t.reshape(T // 128, 128, t.shape[1], t.shape[2])  # noqa: E731
    o = sparse_attention_pipeline(x["q"], pages(x["k"]), pages(x["v"]), x["index_q"], pages(x["index_k"]), plan,
                                  kv_indices=np.arange(T // 128, dtype=np.int32))
    out["sparse_out"] = o.float().numpy()
    out["sparse_selection"] = np.asarray(plan.selection).copy()
    x = msa_inputs("dense")
    T = DENSE["seq_len"]
    plan = msa_plan_from_lengths([T], [T], DENSE["hq"], DENSE["hkv"], causal=True, device="cpu")
    lse = torch.empty(T, DENSE["hq"])
    o, _ = msa(x["q"], x["k"], x["v"], plan, lse=lse)
    out["dense_out"], out["dense_lse"] = o.float().numpy(), lse.numpy()
    for gate in (True, False):
        x = kda_inputs(gate)
        if "initial_state" not in x:  # a float32 final state, as cp_chunk_kda returns
            x["initial_state"] = torch.zeros(x["v"].shape[0], x["v"].shape[2], 128, 128)
        o, fs = chunk_kda(x.pop("q"), x.pop("k"), x.pop("v"), x.pop("g"), x.pop("beta"), output_final_state=True,
                          **x)
        tag = "kda_gate" if gate else "kda_plain"
        out[tag + "_out"], out[tag + "_final"] = o.float().numpy(), fs.float().numpy()
    return out


def segment_alone(gate: bool, a: int, b: int):
    """Tokens [a, b) of the KDA case run from a zero state (None for an empty segment)."""
    from mate_cupy import chunk_kda

    if b <= a:
        return None
    x = kda_inputs(gate)
    x.pop("initial_state", None)
    seg = {n: x.pop(n)[:, a:b] for n in ("q", "k", "v", "g", "beta")}
    return chunk_kda(seg["q"], seg["k"], seg["v"], seg["g"], seg["beta"], **x).float().numpy()


def check_ranks(ranks, world, single, *, msa_tol=1e-2, lse_tol=1e-2, kda_tol=1e-2, state_tol=1e-4,
                exact_selection=True):
    """Each rank's results against the single-process ones (:func:`single_process`).

    ``exact_selection``: every query's top-k blocks must be the single process's (host
    runs: the same float64 scores). Otherwise (float32 scores on a GPU against float64)
    at least 99% of the queries must select the same blocks, and the sparse outputs are
    compared on those queries.
    """
    from mate_cupy.distributed import zigzag_ranges

    def mine(key, seq_len, r):
        (a0, b0), (a1, b1) = zigzag_ranges(seq_len, world, r)
        return np.concatenate([single[key][a0:b0], single[key][a1:b1]])

    for r in range(world):
        sel, ref_sel = ranks[r]["sparse_selection"], mine("sparse_selection", SPARSE["seq_len"], r)
        same = (sel == ref_sel).reshape(sel.shape[0], -1).all(axis=1)
        if exact_selection:
            assert same.all(), f"rank {r}: {int((~same).sum())} queries select other blocks"
        else:
            assert same.mean() >= 0.99, f"rank {r}: {int((~same).sum())} queries select other blocks"
        err = rel_err(ranks[r]["sparse_out"][same], mine("sparse_out", SPARSE["seq_len"], r)[same])
        assert err < msa_tol, ("sparse_out", r, err)
        err = rel_err(ranks[r]["dense_out"], mine("dense_out", DENSE["seq_len"], r))
        assert err < msa_tol, ("dense_out", r, err)
        err = rel_err(ranks[r]["dense_lse"], mine("dense_lse", DENSE["seq_len"], r))
        assert err < lse_tol, ("dense_lse", r, err)
    bounds = segment_bounds(world)
    for tag in ("kda_gate", "kda_plain"):
        for r in range(world):
            err = rel_err(ranks[r][tag + "_out"], single[tag + "_out"][:, bounds[r]:bounds[r + 1]])
            assert err < kda_tol, (tag, r, err)
        assert all(tag + "_final" not in ranks[r] for r in range(world - 1))
        # the entry state matters: rank 1's segment run from a zero state is far off
        alone = segment_alone(tag == "kda_gate", bounds[1], bounds[2]) if world > 1 else None
        if alone is not None:
            assert rel_err(ranks[1][tag + "_out"], alone) > 0.3, tag
        err = rel_err(ranks[-1][tag + "_final"], single[tag + "_final"])
        assert err < state_tol, (tag, "final", err)


def launch(world: int, out_dir, *, backend: str = "gloo", device: str = "cpu", timeout: float = 240.0) -> list:
    """Run :func:`run_rank` on ``world`` processes; returns the ranks' result dicts. Raises
    ``RuntimeError`` with the ranks' output when one fails or the time limit passes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rdv = out_dir / "rendezvous"
    if rdv.exists():
        rdv.unlink()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", **NCCL_ENV)
    procs, logs = [], []
    for r in range(world):
        log = open(out_dir / f"rank{r}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--rank", str(r), "--world", str(world), "--init", f"file://{rdv}",
             "--backend", backend, "--device", device, "--out", str(out_dir)], env=env, stdout=log,
            stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    failed = None
    try:
        for r, p in enumerate(procs):
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed = f"rank {r} passed the {timeout:.0f} s limit"
                break
            if rc != 0:
                failed = f"rank {r} exited with {rc}"
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if failed:
        text = "\n".join(f"--- rank {r}\n" + (out_dir / f"rank{r}.log").read_text()[-3000:] for r in range(world))
        raise RuntimeError(f"{failed}\n{text}")
    return [dict(np.load(out_dir / f"rank{r}.npz")) for r in range(world)]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    device = a.device
    if device == "cuda":
        torch.cuda.set_device(0)  # one GPU shared by every rank (gloo), or world size 1
        device = "cuda:0"
    dist.init_process_group(a.backend, init_method=a.init, rank=a.rank, world_size=a.world)
    try:
        res = run_rank(a.rank, a.world, device)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    np.savez(Path(a.out) / f"rank{a.rank}.npz", **res)


if __name__ == "__main__":
    main()
