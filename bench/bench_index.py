"""MSA index cases (issue 5): top-k block selection and per-block max scores.

* ``sparse_topk_select`` vs ``torch.topk`` (k = 16 over the last dim of fp32 scores).
* Block max score (``msa(..., max_score=..., output_o=False)``) beside our own dense
  attention on the same shape: the target is GEMM speed, 600 TFLOP/s counting 2 D FLOPs
  per admissible (query, key) pair.
* Block max score with float8 e4m3 q and k (per-tensor scales) against the same pass in
  bfloat16 (target 1.7x): causal prefill (the sm_90a wgmma m64n128k32 kernel) and decode.
* Block max score at decode (the M3 index branch: Hq 4 over Hkv 1, D 128, paged K, one
  query per request): B8 over 1M keys and B64 over 128K keys, TB/s of K read against
  the measured copy ceiling (target 4.0 TB/s).
"""
from __future__ import annotations

import math

from . import ours
from .bench_attention import D, _gen, _randn
from .checks import attention_rows, block_max_rows, rel_err, sample_rows, topk_mismatch
from .harness import Bound, Case, Impl, sized
from .models import BLOCK, attention_flops, max_score_flops, topk_bytes
from .report import Target


def topk_case(cfg, rows: int, heads: int, n: int, k: int, *, target: Target | None) -> Case:
    dev = cfg.device

    def make_inputs(nsets):
        import torch

        g = _gen(dev, 5)
        return [{"x": torch.randn((rows, heads, n), generator=g, device=dev, dtype=torch.float32)}
                for _ in range(nsets)]

    def ours_build(inputs):
        import torch

        outs = [torch.empty((rows, heads, k), dtype=torch.int32, device=x["x"].device) for x in inputs]

        def run(i):
            return ours.sparse_topk_select(inputs[i]["x"], k, output=outs[i])

        return Bound(run)

    def torch_build(inputs):
        import torch

        vals = [torch.empty((rows, heads, k), dtype=torch.float32, device=x["x"].device) for x in inputs]
        idx = [torch.empty((rows, heads, k), dtype=torch.int64, device=x["x"].device) for x in inputs]

        def run(i):
            return torch.topk(inputs[i]["x"], k, dim=-1, out=(vals[i], idx[i]))

        return Bound(run, result=lambda out: out[1])

    def check(results, inp):
        import torch

        ref = torch.topk(inp["x"], k, dim=-1).indices
        return {name: {"err": topk_mismatch(out, ref), "err_vs": "fraction of rows whose id set differs from torch.topk"}
                for name, out in results.items()}

    return Case(
        op="msa topk select", name=f"[{rows}, {heads}, {n}] fp32 k{k}",
        make_inputs=make_inputs, set_bytes=topk_bytes(rows * heads, n),
        impls=[Impl("mate_cupy", "ours", ours_build, capture_safe=True),
               Impl("torch.topk", "peer", torch_build, family="torch_topk", capture_safe=True)],
        metric="tbps", bytes=topk_bytes(rows * heads, n), baseline="torch.topk", target=target,
        check=check, tol=1e-4, params=dict(shape=[rows, heads, n], k=k, dtype="float32"),
    )


def max_score_case(cfg, sq: int, sk: int, hq: int, hkv: int, *, target: Target | None) -> Case:
    """One request: ``sq`` queries at the end of ``sk`` keys (causal, bottom-right)."""
    dev = cfg.device
    off = sk - sq
    n_tiles = math.ceil(sk / BLOCK)
    scale = D ** -0.5

    def make_inputs(n):
        g = _gen(dev, 6)
        return [{"q": _randn((sq, hq, D), g, dev), "k": _randn((sk, hkv, D), g, dev),
                 "v": _randn((sk, hkv, D), g, dev)} for _ in range(n)]

    def ours_max_score(inputs):
        import torch

        plan = ours.eager_plan([sq], [sk], hq, hkv, causal=True)
        bufs = [torch.empty((sq, hq, n_tiles), dtype=torch.float32, device=x["q"].device) for x in inputs]

        def run(i):
            x = inputs[i]
            res = ours.msa(x["q"], x["k"], x["v"], plan, max_score=bufs[i], output_o=False)
            return res[1] if isinstance(res, (tuple, list)) else res

        return Bound(run)

    def ours_attention(inputs):
        import torch

        plan = ours.eager_plan([sq], [sk], hq, hkv, causal=True)
        outs = [torch.empty_like(x["q"]) for x in inputs]

        def run(i):
            x = inputs[i]
            return ours.first(ours.msa(x["q"], x["k"], x["v"], plan, out=outs[i]))

        return Bound(run)

    def check(results, inp):
        import torch

        rows = sample_rows(sq, 32, dev)
        pos = rows + off
        q = inp["q"][rows]
        out = {}
        if "mate_cupy" in results:
            ref = block_max_rows(q, inp["k"], pos, sk, True, n_tiles)
            out["mate_cupy"] = {"err": rel_err(results["mate_cupy"][rows], ref),
                                "err_vs": "fp32 block max of q.k on sampled rows (-inf pattern must match)"}
        if "mate_cupy.msa" in results:
            ref = attention_rows(q, inp["k"], inp["v"], pos, torch.full_like(pos, sk), True, scale)
            out["mate_cupy.msa"] = {"err": rel_err(results["mate_cupy.msa"][rows], ref),
                                    "err_vs": "fp32 reference on sampled query rows"}
        return out

    return Case(
        op="msa max score", name=f"Sq{sq} Sk{sk} Hq{hq} Hkv{hkv} causal",
        make_inputs=make_inputs, set_bytes=2.0 * (sq * hq + 2 * sk * hkv) * D,
        impls=[Impl("mate_cupy", "ours", ours_max_score, flops=max_score_flops(1, hq, sq, sk, D, True)),
               Impl("mate_cupy.msa", "baseline", ours_attention, flops=attention_flops(1, hq, sq, sk, D, True))],
        metric="tflops", baseline="mate_cupy.msa", target=target, check=check, tol=2e-2,
        params=dict(Sq=sq, Sk=sk, qo_offset=off, Hq=hq, Hkv=hkv, D=D, causal=True, dtype="bfloat16",
                    max_k_tiles=n_tiles),
    )


def _e4m3(x, scale: float):
    """``x / scale`` rounded to float8 e4m3 (a per-tensor scale, as MiniMax's Q8KV8 index)."""
    import torch

    return (x.float() / scale).to(torch.float8_e4m3fn)


def fp8_max_score_case(cfg, sq: int, sk: int, hq: int, hkv: int, *, target: Target | None) -> Case:
    """The prefill max score with float8 e4m3 q and k (per-tensor scales, MiniMax's Q8KV8:
    ``msa(..., k_scale=q_scale * k_scale)``) against the same ``msa`` pass in bfloat16. One
    request: ``sq`` queries at the end of ``sk`` keys (causal, bottom-right), dense K."""
    dev = cfg.device
    off = sk - sq
    n_tiles = math.ceil(sk / BLOCK)
    q_scale, k_scale = 0.05, 0.03

    def make_inputs(n):
        g = _gen(dev, 9)
        sets = []
        for _ in range(n):
            q, k = _randn((sq, hq, D), g, dev), _randn((sk, hkv, D), g, dev)
            sets.append({"q": q, "k": k, "q8": _e4m3(q, q_scale), "k8": _e4m3(k, k_scale)})
        return sets

    def launcher(fp8: bool):
        def build(inputs):
            import torch

            plan = ours.eager_plan([sq], [sk], hq, hkv, causal=True)
            bufs = [torch.empty((sq, hq, n_tiles), dtype=torch.float32, device=x["q"].device) for x in inputs]
            qk = ("q8", "k8") if fp8 else ("q", "k")
            kw = dict(k_scale=q_scale * k_scale) if fp8 else {}

            def run(i):
                x = inputs[i]   # V is not read without output_o: K stands in for it
                ours.msa(x[qk[0]], x[qk[1]], x[qk[1]], plan, max_score=bufs[i], output_o=False, **kw)
                return bufs[i]

            return Bound(run)
        return build

    def check(results, inp):
        rows = sample_rows(sq, 32, dev)
        pos = rows + off
        out = {}
        for name, (qk, kk, scale) in (("mate_cupy.fp8", ("q8", "k8", q_scale * k_scale)),
                                      ("mate_cupy.bf16", ("q", "k", 1.0))):
            if name in results:
                ref = block_max_rows(inp[qk][rows].float(), inp[kk].float(), pos, sk, True, n_tiles) * scale
                out[name] = {"err": rel_err(results[name][rows], ref),
                             "err_vs": "fp32 block max of the (fp8) values on sampled rows (-inf pattern must match)"}
        return out

    flops = max_score_flops(1, hq, sq, sk, D, True)
    return Case(
        op="msa max score fp8", name=f"Sq{sq} Sk{sk} Hq{hq} Hkv{hkv} causal",
        make_inputs=make_inputs, set_bytes=3.0 * (sq * hq + sk * hkv) * D,
        impls=[Impl("mate_cupy.fp8", "ours", launcher(True), flops=flops),
               Impl("mate_cupy.bf16", "baseline", launcher(False), flops=flops)],
        metric="tflops", baseline="mate_cupy.bf16", target=target, check=check, tol=2e-2,
        params=dict(Sq=sq, Sk=sk, qo_offset=off, Hq=hq, Hkv=hkv, D=D, causal=True, dtype="float8_e4m3fn",
                    q_scale=q_scale, k_scale=k_scale, max_k_tiles=n_tiles),
    )


def decode_max_score_case(cfg, batch: int, seqlen: int, hq: int, hkv: int, page: int, *,
                          target: Target | None) -> Case:
    """The index branch at decode: one query per request over ``seqlen`` paged keys (NHD,
    random page order, CSR ``kv_indices``), max score only. Memory bound: bytes = the K
    cache read once; the ceiling column is the fraction of the measured copy bandwidth."""
    dev = cfg.device
    ppr = math.ceil(seqlen / page)
    n_pages = batch * ppr
    n_tiles = math.ceil(seqlen / BLOCK)
    k_bytes = 2.0 * batch * seqlen * hkv * D

    def make_inputs(n):
        import torch

        g = _gen(dev, 7)
        return [{"q": _randn((batch, hq, D), g, dev), "k_cache": _randn((n_pages, page, hkv, D), g, dev),
                 "kv_indices": torch.randperm(n_pages, generator=g, device=dev).to(torch.int32)} for _ in range(n)]

    def ours_max_score(inputs):
        import torch

        plan = ours.eager_plan([1] * batch, [seqlen] * batch, hq, hkv, page_size=page, causal=True)
        bufs = [torch.empty((batch, hq, n_tiles), dtype=torch.float32, device=x["q"].device) for x in inputs]

        def run(i):
            x = inputs[i]   # V is not read without output_o: K stands in for it
            res = ours.msa(x["q"], x["k_cache"], x["k_cache"], plan, kv_indices=x["kv_indices"], max_score=bufs[i],
                           output_o=False)
            return res[1] if isinstance(res, (tuple, list)) else res

        return Bound(run)

    def check(results, inp):
        if "mate_cupy" not in results:
            return {}
        import torch

        reqs = sample_rows(batch, 3, dev)
        errs = []
        for b in reqs.tolist():
            pages = inp["kv_indices"][b * ppr:(b + 1) * ppr].long()
            keys = inp["k_cache"][pages].reshape(ppr * page, hkv, D)[:seqlen]
            ref = block_max_rows(inp["q"][b:b + 1], keys, torch.full((1,), seqlen - 1, device=keys.device), seqlen,
                                 True, n_tiles)
            errs.append(rel_err(results["mate_cupy"][b:b + 1], ref))
        return {"mate_cupy": {"err": max(errs), "err_vs": "fp32 block max of q.k on sampled requests"}}

    return Case(
        op="msa max score decode", name=f"B{batch} L{seqlen} page{page} Hq{hq} Hkv{hkv} NHD",
        make_inputs=make_inputs, set_bytes=k_bytes,
        impls=[Impl("mate_cupy", "ours", ours_max_score, capture_safe=False)],
        metric="tbps", bytes=k_bytes, target=target, check=check, tol=2e-2,
        params=dict(B=batch, L=seqlen, page_size=page, Hq=hq, Hkv=hkv, D=D, dtype="bfloat16", layout="NHD",
                    bytes="K read once"),
    )


def fp8_decode_max_score_case(cfg, batch: int, seqlen: int, hq: int, hkv: int, page: int, *,
                              target: Target | None) -> Case:
    """The decode max score with float8 e4m3 q and k (per-tensor scales) against the same
    launch in bfloat16, both through ``index_launch.run_max_score`` (the kernel alone, no
    plan). Paged NHD, CSR ``kv_indices``, one query per request; bytes = the K cache each
    reads."""
    dev = cfg.device
    ppr = math.ceil(seqlen / page)
    n_pages = batch * ppr
    n_tiles = math.ceil(seqlen / BLOCK)
    q_scale, k_scale = 0.05, 0.03

    def make_inputs(n):
        import torch

        g = _gen(dev, 8)
        sets = []
        for _ in range(n):
            q = _randn((batch, hq, D), g, dev)
            k = _randn((n_pages, page, hkv, D), g, dev)
            sets.append({"q": q, "k_cache": k, "q8": _e4m3(q, q_scale), "k8": _e4m3(k, k_scale),
                         "kv_indices": torch.randperm(n_pages, generator=g, device=dev).to(torch.int32)})
        return sets

    def launcher(fp8: bool):
        def build(inputs):
            import torch

            from mate_cupy.msa import index_launch as il
            from mate_cupy.runtime.interop import wrap

            i32 = dict(dtype=torch.int32, device=dev)
            meta = {"cu_seqlens_q": torch.arange(batch + 1, **i32), "qo_lens": torch.ones(batch, **i32),
                    "kv_lens": torch.full((batch,), seqlen, **i32),
                    "qo_offset": torch.full((batch,), seqlen - 1, **i32),
                    "kv_page_indptr": torch.arange(batch + 1, **i32) * ppr}
            metas = {n: wrap(n, t) for n, t in meta.items()}
            bufs = [torch.empty((batch, hq, n_tiles), dtype=torch.float32, device=dev) for _ in inputs]
            args = [(wrap("q", x["q8" if fp8 else "q"]), wrap("k", x["k8" if fp8 else "k_cache"]),
                     wrap("max_score", bufs[i]), wrap("kv_indices", x["kv_indices"])) for i, x in enumerate(inputs)]
            scale = q_scale * k_scale if fp8 else 1.0

            def run(i):
                q, k, ms, idx = args[i]
                il.run_max_score(q, k, ms, kv_indices=idx, page_size=page, max_seqlen_q=1, causal=True,
                                 stream=torch.cuda.current_stream().cuda_stream, score_scale=scale, **metas)
                return bufs[i]

            run.keep = meta   # the metadata tensors live as long as the launch
            return Bound(run)
        return build

    def check(results, inp):
        import torch

        out = {}
        reqs = sample_rows(batch, 2, dev)
        for name, (qk, kk, scale) in (("mate_cupy.fp8", ("q8", "k8", q_scale * k_scale)),
                                      ("mate_cupy.bf16", ("q", "k_cache", 1.0))):
            if name not in results:
                continue
            errs = []
            for b in reqs.tolist():
                pages = inp["kv_indices"][b * ppr:(b + 1) * ppr].long()
                keys = inp[kk][pages].float().reshape(ppr * page, hkv, D)[:seqlen]
                ref = block_max_rows(inp[qk][b:b + 1].float(), keys, torch.full((1,), seqlen - 1, device=keys.device),
                                     seqlen, True, n_tiles) * scale
                errs.append(rel_err(results[name][b:b + 1], ref))
            out[name] = {"err": max(errs), "err_vs": "fp32 block max of the (fp8) values on sampled requests"}
        return out

    k_bytes = 2.0 * batch * seqlen * hkv * D
    return Case(
        op="msa max score decode fp8", name=f"B{batch} L{seqlen} page{page} Hq{hq} Hkv{hkv} NHD",
        make_inputs=make_inputs, set_bytes=1.5 * k_bytes,
        impls=[Impl("mate_cupy.fp8", "ours", launcher(True), bytes=k_bytes / 2),
               Impl("mate_cupy.bf16", "baseline", launcher(False), bytes=k_bytes)],
        metric="tbps", bytes=k_bytes / 2, baseline="mate_cupy.bf16", target=target, check=check, tol=2e-2,
        params=dict(B=batch, L=seqlen, page_size=page, Hq=hq, Hkv=hkv, D=D, dtype="float8_e4m3fn",
                    q_scale=q_scale, k_scale=k_scale, bytes="K read once"),
    )


def cases(cfg) -> list:
    five = Target("speedup", 5.0, "torch.topk")
    ratio = Target("tflops", 600.0)  # max score at GEMM speed (2 D FLOPs per admissible pair)
    out = []
    r, h, n = sized(cfg, (8192, 64, 1024), (2048, 64, 1024), (64, 4, 256))
    out.append(topk_case(cfg, r, h, n, 16, target=five))
    r, h, n = sized(cfg, (64, 64, 8192), (64, 64, 8192), (8, 4, 1024))
    out.append(topk_case(cfg, r, h, n, 16, target=five))
    sq, sk, hq, hkv = sized(cfg, (8192, 8192, 64, 8), (2048, 2048, 64, 8), (256, 256, 8, 2))
    out.append(max_score_case(cfg, sq, sk, hq, hkv, target=ratio))
    sq, sk, hq, hkv = sized(cfg, (8192, 131072, 4, 1), (2048, 32768, 4, 1), (128, 1024, 4, 1))
    out.append(max_score_case(cfg, sq, sk, hq, hkv, target=ratio))
    four = Target("tbps", 4.0)
    for full, quick, tiny in (((8, 1 << 20), (8, 1 << 18), (2, 4096)), ((64, 1 << 17), (64, 1 << 15), (4, 2048))):
        b, sk = sized(cfg, full, quick, tiny)
        out.append(decode_max_score_case(cfg, b, sk, 4, 1, 128, target=four))
    if cfg.device != "cpu":   # float8: CUDA arrays only (the fp8 prefill kernel: sm_90a)
        sq, sk, hq, hkv = sized(cfg, (8192, 131072, 4, 1), (2048, 32768, 4, 1), (128, 1024, 4, 1))
        out.append(fp8_max_score_case(cfg, sq, sk, hq, hkv, target=Target("speedup", 1.7, "mate_cupy.bf16")))
        b, sk = sized(cfg, (8, 1 << 20), (8, 1 << 18), (2, 4096))
        out.append(fp8_decode_max_score_case(cfg, b, sk, 4, 1, 128, target=Target("speedup", 1.7, "mate_cupy.bf16")))
    return out
