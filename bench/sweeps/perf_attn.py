"""Sweep of the MSA attention prefill tiles on one GPU (H200): which tile should be the default.

    PYTHONPATH=. python bench/sweeps/perf_attn.py OUTDIR

Candidates (``mate_cupy.msa.attention_kernels.PREFILL_TILES``), chosen per call with
``run_attention(prefill_tile=...)``:

* ``prefill``   current default: mma.sync, 128 rows (4 warps x 2 m-tiles), 64 keys/tile, 2 stages
* ``mma256`` / ``mma256s4``: mma.sync, 256 rows (8 warps x 2 m-tiles), 3 / 4 stages, block-sparse only
* ``wg2n128s2`` warpgroup MMA (sm_90a), 2 warpgroups = 128 rows, 128 keys/tile, 2 stages
* ``wg2n64s3`` / ``wg2n64s2`` / ``wg3n64s3``: 128 or 192 rows, 64 keys/tile, 3 or 2 stages
* ``wg2n64s3r`` / ``wg2n64s4r`` / ``wg2n128s3r``: "rotated": warpgroup 1 runs one phase behind
  warpgroup 0 (softmax + P V of the previous tile, then Q K^T of this one), so one warpgroup's
  softmax overlaps the other's MMAs (FA3's ping-pong without extra barriers); dense only for n128

Phases:

1. Build the cubins of every variant used (in parallel, into a temporary directory).
2. Smoke test in a child process (time-boxed, so a hang cannot take the sweep with it):
   every wgmma / 256-row tile against the float64 NumPy references on small problems
   (dense varlen causal/full, GQA 1/8/16, D 64/128, fp16/bf16, offsets, paged with
   invalid pages, block-sparse per-token and tile-shared lists). Only tiles that pass
   are timed.
3. Timing, bf16 D128, CUDA events on the default stream, 2 input sets in rotation,
   warm-up then the median of N calls: dense causal B1 S8192 Hq64 Hkv8, B1 S32768 Hq64
   Hkv4, B16 S1024 Hq64 Hkv8 (with SDPA flash and cuDNN in the same process); sparse
   prefill S32768 Hq64 Hkv4 16 blocks (tile-shared and per-token selection); sparse
   decode B64 x 128K keys Hq64 Hkv4 16 blocks vs our dense paged decode over the same
   lengths. Each candidate's output is compared with the baseline tile's output
   (``err_vs_base``, whole tensor) and the baseline with a float32 reference on sampled
   rows (``err_ref``).

Writes ``OUTDIR/perf_attn.json`` and prints a table (last lines).
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

NAME = "perf_attn"
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository's bench package
    sys.path.insert(0, str(ROOT))
from bench.sweeps._shared import build_cubins, run_smoke_child, TorchCtx  # noqa: E402
WG = ["wg2n128s2", "wg3n64s3", "wg2n128s3r", "wg1n64s2"]
WG_DENSE_ONLY = ["wg2n128s3r"]
DENSE_TILES = ["prefill"] + WG
MMA256 = ["mma256"]
SPARSE_TILES = ["prefill"] + MMA256 + [t for t in WG if t not in WG_DENSE_ONLY]
SMOKE_TIMEOUT_S = 30
D = 128


# --------------------------------------------------------------------------- phase 1: cubins

def _specs():
    from mate_cupy.msa import attention_kernels as ak

    keys = [(128, 1, "prefill", 0), (128, 1, "prefill", 2), (128, 1, "decode", 1), (128, 1, "decode", 2),
            (128, 1, "mma256", 2), (128, 0, "mma256", 2)]
    for t in WG:
        keys += [(128, 1, t, 0), (128, 1, t, 1), (64, 0, t, 0), (64, 1, t, 0), (128, 0, t, 0)]
        if t not in WG_DENSE_ONLY:
            keys += [(128, 1, t, 2), (128, 0, t, 2)]
    return [ak.attention_spec(*k) for k in keys]


# --------------------------------------------------------------------------- phase 2: smoke (child)

def smoke(status_path: str) -> None:
    """Child process: every candidate tile on small problems vs the float64 references."""
    sys.path.insert(0, str(ROOT / "tests"))
    import numpy as np
    import cupy
    from msa_cases import BF16, make_problem, random_selection

    from mate_cupy.msa import attention_kernels as ak
    from mate_cupy.reference import msa as R

    F16 = np.dtype(np.float16)
    tol = {BF16: 1e-2, F16: 5e-3}
    rng = np.random.default_rng(7)

    def cp(x):
        return cupy.asarray(np.asarray(x))

    def launch(p, tile, *, causal=True, offs=None, kvl=None, source="dense", sel=None, table=None):
        offs = (p.kv - p.qo) if offs is None else np.asarray(offs)
        kvl = p.kv if kvl is None else np.asarray(kvl)
        out = cupy.asarray(np.full(p.q.shape, np.nan, np.float32).astype(p.q.dtype))
        lse = cupy.full((p.total_q, p.hq), np.nan, np.float32)
        kw = dict(cu_seqlens_q=cp(p.cu_q), qo_lens=cp(p.qo), kv_lens=cp(kvl.astype(np.int32)),
                  qo_offset=cp(offs.astype(np.int32)), max_seqlen_q=int(p.qo.max()),
                  max_seqlen_k=int(kvl.max()), causal=causal, sm_scale=1.0 / math.sqrt(p.q.shape[2]),
                  prefill_tile=tile)
        if source == "dense":
            k, v = cp(p.k), cp(p.v)
            kw.update(cu_seqlens_k=cp(p.cu_k), page_size=0)
        else:
            k, v = cp(p.k_cache), cp(p.v_cache)
            kw.update(page_size=p.page_size, kv_layout=p.layout,
                      page_table=cp(p.page_table if table is None else table))
        if sel is not None:
            kw.update(kv_block_indexes=cp(sel))
        ak.run_attention(cp(p.q), k, v, out, lse, **kw)
        cupy.cuda.get_current_stream().synchronize()
        return out.get().astype(np.float64), lse.get().astype(np.float64)

    def check(got, ref, dtype, what):
        o, l = got
        ro, rl = ref
        fin = np.isfinite(ro)
        if not np.array_equal(np.isfinite(o), fin):
            return f"{what}: non-finite outputs"
        err = float(np.linalg.norm(o[fin] - ro[fin]) / max(np.linalg.norm(ro[fin]), 1e-30))
        if err > tol[dtype]:
            return f"{what}: err {err:.2e}"
        lf = np.isfinite(rl)
        if not np.array_equal(np.isfinite(l), lf) or (lf.any() and np.max(np.abs(l[lf] - rl[lf])) > 1e-3):
            return f"{what}: lse"
        return None

    # Problems and their float64 references, built once and shared by every tile:
    # (name, problem, launch keywords, reference, dtype, sparse?)
    QO, KV = [1, 0, 77, 300, 5, 130], [1, 9, 77, 420, 0, 100]
    probs = []
    for hq, hkv, d, dt, causal in [(32, 4, 128, BF16, True), (4, 4, 64, F16, False), (32, 2, 128, BF16, True),
                                   (32, 4, 64, BF16, True), (32, 4, 128, F16, False)]:
        p = make_problem(rng, QO, KV, hq, hkv, d, dtype=dt)
        ref = R.dense_attention(p.q, p.k, p.v, p.cu_q, p.cu_k, qo_offset=p.kv - p.qo, causal=causal)
        probs.append((f"dense r{hq // hkv} d{d} {dt} causal={causal}", p, dict(causal=causal), ref, dt, False))
    p = make_problem(rng, [40, 200, 3], [300, 200, 50], 16, 2, 128)
    offs, kvl = np.array([-10, 0, 700]), np.array([250, 199, 50], np.int32)
    ref = R.dense_attention(p.q, p.k, p.v, p.cu_q, p.cu_k, qo_offset=offs, causal=True, kv_lens=kvl)
    probs.append(("dense offsets", p, dict(offs=offs, kvl=kvl), ref, BF16, False))
    p = make_problem(rng, [1, 90, 0, 200], [700, 90, 33, 450], 16, 2, 128, page_size=64, layout="HND")
    table = p.page_table.copy()
    table[3, 1] = p.k_cache.shape[0] + 5
    ref = R.paged_attention(p.q, p.k_cache, p.v_cache, p.cu_q, p.kv, table, qo_offset=p.kv - p.qo,
                            causal=True, kv_layout=p.layout)
    probs.append(("paged invalid page", p, dict(source="table", table=table), ref, BF16, False))
    for hq, hkv, dt in [(32, 2, BF16), (32, 4, F16)]:
        p = make_problem(rng, [200, 1, 40], [800, 129, 40], hq, hkv, 128, dtype=dt, page_size=128)
        sel = random_selection(rng, p, 16)
        ref = R.sparse_attention(p.q, p.k_cache, p.v_cache, p.cu_q, p.kv, p.page_table, sel,
                                 qo_offset=p.kv - p.qo, kv_layout=p.layout)
        probs.append((f"sparse per-token r{hq // hkv} {dt}", p, dict(source="table", sel=sel), ref, dt, True))
    p = make_problem(rng, [256], [1536], 32, 2, 128, page_size=128)
    sel = np.full((256, 2, 16), -1, np.int32)
    for t in range(2):
        for h in range(2):
            reach = (1536 - 256 + 128 * t) // 128 + 1
            n = min(16, reach)
            sel[128 * t:128 * (t + 1), h, :n] = rng.choice(reach, size=n, replace=False)
    ref = R.sparse_attention(p.q, p.k_cache, p.v_cache, p.cu_q, p.kv, p.page_table, sel,
                             qo_offset=p.kv - p.qo, kv_layout=p.layout)
    probs.append(("sparse tile-shared", p, dict(source="table", sel=sel), ref, BF16, True))

    def diagnose(tile):
        """Where a failing tile goes wrong: error per 8-dim output chunk and per 8-row group
        of one request (group 1, 128 queries x 128 keys, full attention, D 128), and whether
        a single 16-key tile already fails."""
        diag = {}
        for name, lq, lk in (("q128k128", 128, 128), ("q64k16", 64, 16)):
            p = make_problem(rng, [lq], [lk], 1, 1, 128)
            o, _ = launch(p, tile, causal=False)
            ro, _ = R.dense_attention(p.q, p.k, p.v, p.cu_q, p.cu_k, qo_offset=p.kv - p.qo, causal=False)
            e = np.abs(np.nan_to_num(o[:, 0], nan=1e9) - ro[:, 0])
            nrm = np.abs(ro[:, 0]).mean() + 1e-30
            diag[name] = {"dim_chunks": [round(float(e[:, 8 * c:8 * c + 8].mean() / nrm), 3) for c in range(16)],
                          "row_groups": [round(float(e[8 * r:8 * r + 8].mean() / nrm), 3) for r in range(lq // 8)],
                          "nan": int(np.isnan(o).sum())}
        return diag

    status = {}
    for tile in WG + MMA256:
        status[tile] = "running"
        Path(status_path).write_text(json.dumps(status))
        fails = []
        try:
            for name, p, kw, ref, dt, sparse in probs:
                if (sparse or tile not in MMA256) and not (sparse and tile in WG_DENSE_ONLY):
                    f = check(launch(p, tile, **kw), ref, dt, name)
                    if f:
                        fails.append(f)
            status[tile] = "ok" if not fails else "wrong: " + "; ".join(fails)
            if fails and tile not in MMA256:
                status[tile + ".diagnosis"] = json.dumps(diagnose(tile))
        except Exception as e:  # a launch error poisons the context: stop here
            status[tile] = f"error: {type(e).__name__}: {str(e)[:300]}"
            Path(status_path).write_text(json.dumps(status))
            return
        Path(status_path).write_text(json.dumps(status))


# --------------------------------------------------------------------------- phase 3: timing

class Ctx(TorchCtx):
    def randn(self, shape, gen):
        return self.torch.randn(shape, generator=gen, device=self.dev, dtype=self.torch.bfloat16)


def _rel(out, ref) -> float:
    import torch

    o, r = out.float(), ref.float()
    fin = torch.isfinite(r)
    if not torch.equal(torch.isfinite(o), fin):
        return math.inf
    den = float(torch.linalg.vector_norm(r[fin]))
    return float(torch.linalg.vector_norm((o - r)[fin])) / max(den, 1e-30)


def _lens(ctx, vals):
    return ctx.torch.tensor(vals, dtype=ctx.torch.int32, device=ctx.dev)


def dense_case(ctx, ok_tiles, b, s, hq, hkv, iters):
    torch = ctx.torch
    from bench.checks import attention_rows, sample_rows
    from mate_cupy.msa import attention_kernels as ak

    g = torch.Generator(device=ctx.dev).manual_seed(1)
    sets = [dict(q=ctx.randn((b * s, hq, D), g), k=ctx.randn((b * s, hkv, D), g), v=ctx.randn((b * s, hkv, D), g))
            for _ in range(2)]
    cu = _lens(ctx, [i * s for i in range(b + 1)])
    lens = _lens(ctx, [s] * b)
    zero = _lens(ctx, [0] * b)
    flops = 2.0 * b * hq * s * s * D
    res = {"flops": flops}
    outs = {}
    cx = [{n: ctx.cp(x[n]) for n in ("q", "k", "v")} for x in sets]
    ints = dict(cu_seqlens_q=ctx.cp(cu), qo_lens=ctx.cp(lens), kv_lens=ctx.cp(lens), qo_offset=ctx.cp(zero),
                cu_seqlens_k=ctx.cp(cu))
    for tile in [t for t in DENSE_TILES if t == "prefill" or t in ok_tiles]:
        out = [torch.empty_like(x["q"]) for x in sets]
        cout = [ctx.cp(o) for o in out]

        def run(i, tile=tile, cout=cout):
            x = cx[i]
            ak.run_attention(x["q"], x["k"], x["v"], cout[i], None, **ints, max_seqlen_q=s, max_seqlen_k=s,
                             causal=True, sm_scale=D ** -0.5, stream=ctx.stream, prefill_tile=tile)
        try:
            ms = ctx.time(run, 2, 2, iters)
            outs[tile] = out[(iters - 1) % 2]  # the last call's output (set (iters - 1) % 2)
            res[tile] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
        except Exception as e:
            res[tile] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    idx = (iters - 1) % 2
    if "prefill" in outs:
        base = outs["prefill"]
        x = sets[idx]
        rows = sample_rows(b * s, 16, ctx.dev)
        bi, pos = rows // s, rows % s
        k = x["k"].view(b, s, hkv, D)[bi]
        v = x["v"].view(b, s, hkv, D)[bi]
        ref = attention_rows(x["q"][rows], k, v, pos, torch.full_like(pos, s), True, D ** -0.5)
        res["prefill"]["err_ref"] = float(f"{_rel(base[rows], ref):.2e}")
        for t, o in outs.items():
            res[t]["err_vs_base"] = float(f"{_rel(o, base):.2e}")
    for backend in ("flash", "cudnn"):
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            kind = SDPBackend.FLASH_ATTENTION if backend == "flash" else SDPBackend.CUDNN_ATTENTION
            views = [(x["q"].view(b, s, hq, D).transpose(1, 2), x["k"].view(b, s, hkv, D).transpose(1, 2),
                      x["v"].view(b, s, hkv, D).transpose(1, 2)) for x in sets]

            def run_sdpa(i, views=views, kind=kind):
                with sdpa_kernel([kind]):
                    torch.nn.functional.scaled_dot_product_attention(*views[i], is_causal=True, enable_gqa=True)
            ms = ctx.time(run_sdpa, 2, 2, iters)
            res["sdpa_" + backend] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
        except Exception as e:
            res["sdpa_" + backend] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    del sets, outs
    return res


def sparse_case(ctx, ok_tiles, s, hq, hkv, topk, per_token, iters):
    torch = ctx.torch
    import numpy as np

    from bench.bench_attention import select_blocks
    from bench.checks import attention_rows, sample_rows
    from bench.models import sparse_attention_flops
    from mate_cupy.msa import attention_kernels as ak

    blk = 128
    nb = -(-s // blk)
    g = torch.Generator(device=ctx.dev).manual_seed(3)
    sets = []
    for _ in range(2):
        perm = torch.randperm(nb, generator=g, device=ctx.dev).to(torch.int32)
        if per_token:
            ids = select_blocks(torch.arange(s, device=ctx.dev) // blk, hkv, nb, topk, g)
        else:
            tiles = select_blocks(torch.arange(nb, device=ctx.dev), hkv, nb, topk, g)
            ids = tiles[torch.arange(s, device=ctx.dev) // blk].contiguous()
        sets.append(dict(q=ctx.randn((s, hq, D), g), kc=ctx.randn((nb, blk, hkv, D), g),
                         vc=ctx.randn((nb, blk, hkv, D), g), perm=perm, ids=ids))
    flops = sparse_attention_flops(sets[0]["ids"].cpu().numpy(), np.arange(s), s, hq, D)
    cu = _lens(ctx, [0, s])
    lens = _lens(ctx, [s])
    zero = _lens(ctx, [0])
    indptr = _lens(ctx, [0, nb])
    res = {"flops": flops}
    outs = {}
    cx = [{n: ctx.cp(x[n]) for n in ("q", "kc", "vc", "perm", "ids")} for x in sets]
    ints = dict(cu_seqlens_q=ctx.cp(cu), qo_lens=ctx.cp(lens), kv_lens=ctx.cp(lens), qo_offset=ctx.cp(zero),
                kv_page_indptr=ctx.cp(indptr))
    for tile in [t for t in SPARSE_TILES if t == "prefill" or t in ok_tiles]:
        out = [torch.empty_like(x["q"]) for x in sets]
        cout = [ctx.cp(o) for o in out]

        def run(i, tile=tile, cout=cout):
            x = cx[i]
            ak.run_attention(x["q"], x["kc"], x["vc"], cout[i], None, **ints, kv_indices=x["perm"], page_size=blk,
                             kv_block_indexes=x["ids"], max_seqlen_q=s, max_seqlen_k=s, causal=True,
                             sm_scale=D ** -0.5, stream=ctx.stream, prefill_tile=tile)
        try:
            ms = ctx.time(run, 2, 2, iters)
            outs[tile] = out[(iters - 1) % 2]
            res[tile] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
        except Exception as e:
            res[tile] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    if "prefill" in outs:
        x = sets[(iters - 1) % 2]
        base = outs["prefill"]
        rows = sample_rows(s, 12, ctx.dev)
        p = x["perm"].long()
        k = x["kc"][p].reshape(nb * blk, hkv, D)[:s]
        v = x["vc"][p].reshape(nb * blk, hkv, D)[:s]
        r = hq // hkv
        ids = x["ids"][rows].long()
        off = torch.arange(blk, device=ctx.dev)
        parts = []
        for gi in range(hkv):
            bl = ids[:, gi, :]
            pos = (bl[:, :, None] * blk + off).reshape(len(rows), -1)
            pos = torch.where((bl[:, :, None] >= 0).expand(-1, -1, blk).reshape(len(rows), -1), pos,
                              torch.full_like(pos, -1))
            safe = pos.clamp(0, s - 1)
            parts.append(attention_rows(x["q"][rows, gi * r:(gi + 1) * r], k[safe, gi][:, :, None, :],
                                        v[safe, gi][:, :, None, :], rows, torch.full_like(rows, s), True,
                                        D ** -0.5, key_pos=pos))
        res["prefill"]["err_ref"] = float(f"{_rel(base[rows], torch.cat(parts, dim=1)):.2e}")
        for t, o in outs.items():
            res[t]["err_vs_base"] = float(f"{_rel(o, base):.2e}")
    del sets, outs
    return res


def sparse_decode_case(ctx, batch, L, hq, hkv, topk, iters):
    """Our block-sparse decode (16 blocks) vs our dense paged decode over the same lengths."""
    torch = ctx.torch
    from bench.checks import attention_rows
    from mate_cupy.msa import attention_kernels as ak

    blk = 128
    ppr = L // blk
    g = torch.Generator(device=ctx.dev).manual_seed(5)
    kc = ctx.randn((batch * ppr, blk, hkv, D), g)
    vc = ctx.randn((batch * ppr, blk, hkv, D), g)
    table = torch.randperm(batch * ppr, generator=g, device=ctx.dev).to(torch.int32).view(batch, ppr)
    keys = torch.rand(batch, hkv, ppr, generator=g, device=ctx.dev)
    keys[:, :, 0] = -1.0
    keys[:, :, ppr - 1] = -1.0
    ids = keys.topk(topk, dim=-1, largest=False).indices.sort(-1).values.to(torch.int32).contiguous()
    q = [ctx.randn((batch, hq, D), g) for _ in range(2)]
    out = [torch.empty_like(x) for x in q]
    cu = _lens(ctx, list(range(batch + 1)))
    ones = _lens(ctx, [1] * batch)
    lens = _lens(ctx, [L] * batch)
    offs = _lens(ctx, [L - 1] * batch)
    res = {}

    cq, cout = [ctx.cp(x) for x in q], [ctx.cp(x) for x in out]
    ckc, cvc, cids = ctx.cp(kc), ctx.cp(vc), ctx.cp(ids)
    ints = dict(cu_seqlens_q=ctx.cp(cu), qo_lens=ctx.cp(ones), kv_lens=ctx.cp(lens), qo_offset=ctx.cp(offs),
                page_table=ctx.cp(table))

    def call(i, sparse):
        ak.run_attention(cq[i], ckc, cvc, cout[i], None, **ints, page_size=blk,
                         kv_block_indexes=cids if sparse else None, sparse_decode=sparse,
                         max_seqlen_q=1, max_seqlen_k=L, causal=True, sm_scale=D ** -0.5, stream=ctx.stream)
    for name, sparse in (("sparse_decode", True), ("dense_paged_decode", False)):
        try:
            ms = ctx.time(lambda i, sp=sparse: call(i, sp), 2, 3, iters)
            nbytes = 2.0 * batch * hkv * D * 2 * (topk * blk if sparse else L)
            res[name] = {"ms": round(ms, 4), "tbps": round(nbytes / ms / 1e9, 2)}
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    try:  # sampled check of the sparse output against a float32 reference
        call(0, True)
        torch.cuda.synchronize()
        rows = torch.tensor([0, batch // 2, batch - 1], device=ctx.dev)
        r = hq // hkv
        parts = []
        off = torch.arange(blk, device=ctx.dev)
        for gi in range(hkv):
            bl = ids[rows, gi, :].long()                                   # [R, topk]
            pages = torch.gather(table[rows].long(), 1, bl)                # [R, topk]
            kk = kc[pages][:, :, :, gi].reshape(len(rows), topk * blk, 1, D)
            vv = vc[pages][:, :, :, gi].reshape(len(rows), topk * blk, 1, D)
            pos = (bl[:, :, None] * blk + off).reshape(len(rows), -1)
            parts.append(attention_rows(q[0][rows, gi * r:(gi + 1) * r], kk, vv, torch.full_like(rows, L - 1),
                                        torch.full_like(rows, L), True, D ** -0.5, key_pos=pos))
        res["sparse_decode"]["err_ref"] = float(f"{_rel(out[0][rows], torch.cat(parts, dim=1)):.2e}")
    except Exception as e:
        res["sparse_decode_check"] = f"{type(e).__name__}: {str(e)[:200]}"
    if "ms" in res.get("sparse_decode", {}) and "ms" in res.get("dense_paged_decode", {}):
        res["speedup"] = round(res["dense_paged_decode"]["ms"] / res["sparse_decode"]["ms"], 2)
    del kc, vc
    return res


# --------------------------------------------------------------------------- main

def main(argv) -> int:
    if len(argv) >= 2 and argv[0] == "--smoke":
        smoke(argv[1])
        return 0
    if not argv:
        print(__doc__)
        return 2
    outdir = Path(argv[0])
    outdir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    report = {"name": NAME}
    cubins = tempfile.mkdtemp(prefix="mate_attn_cubins_")
    report["build"] = build_cubins(_specs(), cubins)
    os.environ["MATE_CUPY_CUBIN_DIR"] = cubins
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    report["smoke"] = run_smoke_child(__file__, env, SMOKE_TIMEOUT_S, WG + MMA256)
    ok = {t for t, st in report["smoke"]["status"].items() if st == "ok" and not t.endswith(".diagnosis")}

    import torch

    ctx = Ctx()
    report["device"] = torch.cuda.get_device_name()
    cases = report["cases"] = {}
    plan = [
        ("dense B1 S8192 Hq64 Hkv8", lambda: dense_case(ctx, ok, 1, 8192, 64, 8, 12)),
        ("dense B16 S1024 Hq64 Hkv8", lambda: dense_case(ctx, ok, 16, 1024, 64, 8, 20)),
        ("dense B1 S32768 Hq64 Hkv4", lambda: dense_case(ctx, ok, 1, 32768, 64, 4, 4)),
        ("sparse S32768 Hq64 Hkv4 top16 tile-shared", lambda: sparse_case(ctx, ok, 32768, 64, 4, 16, False, 6)),
        ("sparse S32768 Hq64 Hkv4 top16 per-token", lambda: sparse_case(ctx, ok, 32768, 64, 4, 16, True, 4)),
        ("sparse decode B64 L131072 Hq64 Hkv4 top16", lambda: sparse_decode_case(ctx, 64, 131072, 64, 4, 16, 8)),
    ]
    for name, fn in plan:
        t0 = time.perf_counter()
        try:
            cases[name] = fn()
        except Exception as e:
            cases[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        cases[name]["wall_s"] = round(time.perf_counter() - t0, 1)
        torch.cuda.empty_cache()
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    (outdir / f"{NAME}.json").write_text(json.dumps(report, indent=1))
    _print(report)
    return 0


def _print(report) -> None:
    print(f"[{NAME}] build {report['build']['modules']} modules in {report['build']['seconds']} s, "
          f"errors {len(report['build']['errors'])}; smoke {report['smoke']['seconds']} s rc={report['smoke']['rc']}")
    for t, st in report["smoke"]["status"].items():
        print(f"  smoke {t:10s} {st[:150] if not t.endswith('.diagnosis') else st[:600]}")
    if report["smoke"].get("tail"):
        print("  smoke tail: " + report["smoke"]["tail"][-600:].replace("\n", " | "))
    print(f"{'case':44s} {'impl':18s} {'ms':>9s} {'TF/s|TB/s':>9s} {'x base':>7s} {'err_vs_base':>11s} {'err_ref':>8s}")
    for cname, c in report["cases"].items():
        base = c.get("prefill", {}).get("ms") or c.get("dense_paged_decode", {}).get("ms")
        for impl, r in c.items():
            if not isinstance(r, dict):
                continue
            if "error" in r:
                print(f"{cname:44s} {impl:18s} ERROR {r['error'][:80]}")
                continue
            ms = r.get("ms")
            rate = r.get("tflops", r.get("tbps", ""))
            xb = f"{base / ms:.2f}" if base and ms else ""
            print(f"{cname:44s} {impl:18s} {ms:9.4f} {rate!s:>9s} {xb:>7s} {r.get('err_vs_base', '')!s:>11s} "
                  f"{r.get('err_ref', '')!s:>8s}")
        if "speedup" in c:
            print(f"{cname:44s} {'dense/sparse':18s} {c['speedup']:>9}x")
    print(f"[{NAME}] wall {report['wall_s']} s")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
