"""How much the float8 index's top-16 block selection agrees with the bf16 index's.

MiniMax's Q8KV8 index scores blocks with float8 e4m3 q and k. This script draws an index
branch in bfloat16, rounds it to e4m3 (the same values, quantised once more), runs the
block max score (``msa(..., output_o=False)``; fp8 with a ``k_scale``) and the exact top-16
selection (``sparse_topk_select`` with the plan's query positions, no forced blocks) for
both, and reports per case the mean fraction of the bf16 selection's blocks that the fp8
selection also holds (both select the same number of blocks per row) and the fraction of
rows whose two sets are equal.

Cases (decode: one query per request, and 4-token speculative steps): ``random``, i.i.d.
normal q and k (block maxima close together: the hardest case for a coarser type), and
``structured``, where each request has 16 blocks holding keys aligned with its queries
(the regime a trained index works in). On a GPU the kernels run (torch CUDA tensors);
without one, the float64 references of the same values.

    python bench/fp8_index_agreement.py OUTDIR      # prints a table, writes OUTDIR/fp8_index_agreement.json
"""
from __future__ import annotations

import json
import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mate_cupy as mc  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
BLOCK, TOPK, D = 128, 16, 128
INDEX_HEADS, INDEX_KV_HEADS = 4, 1   # MiniMax-M3: one index query head per KV head (Hkv 4) over 1
K_SCALE = 0.05                        # any positive scale: the order, hence the selection, is unchanged


def _case(rng, kind: str, qo: int, batch: int, kv_len: int) -> dict:
    """bf16 index q ``[B * qo, 4, D]`` and an index cache ``[P, 128, 1, D]`` (pages shuffled)."""
    pages = -(-kv_len // BLOCK)
    n_pages = batch * pages
    q = rng.standard_normal((batch * qo, INDEX_HEADS, D))
    k = rng.standard_normal((n_pages, BLOCK, INDEX_KV_HEADS, D))
    ids = rng.permutation(n_pages).astype(np.int32)
    if kind == "structured":
        for b in range(batch):  # queries near a direction u; 4 keys of each of 16 blocks along it
            u = rng.standard_normal(D)
            q[b * qo:(b + 1) * qo] = u + 0.3 * q[b * qo:(b + 1) * qo]
            own = ids[b * pages:(b + 1) * pages]
            for blk in rng.choice(pages - 1, size=TOPK, replace=False):   # before the queries' own block
                slots = rng.choice(BLOCK, size=4, replace=False)
                k[own[blk], slots, 0] = 0.3 * k[own[blk], slots, 0] + rng.uniform(0.4, 0.8) * u
    return {"q": q.astype(np.float32).astype(BF16), "k": k.astype(np.float32).astype(BF16), "ids": ids,
            "qo": [qo] * batch, "kv": [kv_len] * batch}


def _to_device(a):
    import torch

    if a.dtype == BF16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).cuda().view(torch.bfloat16)
    if a.dtype == FP8:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).cuda().view(torch.float8_e4m3fn)
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def _select(x: dict, dtype, gpu: bool) -> np.ndarray:
    """The top-16 block lists ``[rows, 4, 16]`` of the index branch in ``dtype``."""
    q, k = (x["q"], x["k"]) if dtype == BF16 else (x["q"].astype(np.float32).astype(FP8),
                                                     x["k"].astype(np.float32).astype(FP8))
    plan = mc.msa_plan_from_lengths(x["qo"], x["kv"], INDEX_HEADS, INDEX_KV_HEADS, page_size=BLOCK,
                                    output_maxscore=True, device=0 if gpu else "cpu")
    args = (_to_device(q), _to_device(k), _to_device(x["ids"])) if gpu else (q, k, x["ids"])
    _, ms = mc.msa(args[0], args[1], args[1], plan, kv_indices=args[2], output_o=False,
                   k_scale=K_SCALE if dtype == FP8 else 1.0)
    sel = mc.sparse_topk_select(ms, TOPK, plan_info=plan)
    return sel.cpu().numpy() if gpu else np.asarray(sel)


def agreement(sel_a: np.ndarray, sel_b: np.ndarray) -> tuple:
    """(mean over rows of |A & B| / |A|, fraction of rows with A == B); -1 ids ignored, rows
    with no valid id skipped."""
    fracs, same = [], []
    for a, b in zip(sel_a.reshape(-1, sel_a.shape[-1]), sel_b.reshape(-1, sel_b.shape[-1])):
        sa, sb = set(a[a >= 0].tolist()), set(b[b >= 0].tolist())
        if sa:
            fracs.append(len(sa & sb) / len(sa))
            same.append(sa == sb)
    return float(np.mean(fracs)), float(np.mean(same))


def main(outdir: str) -> list:
    gpu = False
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        pass
    rng = np.random.default_rng(2026)
    batch, kv_len = (8, 65536) if gpu else (4, 16384)
    rows = []
    for kind in ("random", "structured"):
        for qo in (1, 4):
            x = _case(rng, kind, qo, batch, kv_len)
            frac, same = agreement(_select(x, BF16, gpu), _select(x, FP8, gpu))
            rows.append(dict(case=kind, queries_per_request=qo, batch=batch, kv_len=kv_len, topk=TOPK,
                             index_heads=INDEX_HEADS, index_kv_heads=INDEX_KV_HEADS, head_dim=D,
                             agreement=round(frac, 4), identical_rows=round(same, 4),
                             path="kernels" if gpu else "float64 references"))
    print(f"{'case':<11} {'qo':>3} {'B':>3} {'kv_len':>7}  top-16 agreement  identical rows")
    for r in rows:
        print(f"{r['case']:<11} {r['queries_per_request']:>3} {r['batch']:>3} {r['kv_len']:>7}  "
              f"{r['agreement']:>16.4f}  {r['identical_rows']:>14.4f}")
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "fp8_index_agreement.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python bench/fp8_index_agreement.py OUTDIR")
    main(sys.argv[1])
