"""The MSA pipeline at long context: index max score -> top-k -> sparse attention, beside dense.

MiniMax-M3 shapes: main attention Hq64 Hkv4 D128 bf16 over a page-128 cache; the index
branch has 4 query heads (one per KV head) over 1 index KV head, D128; top-16 blocks with
block 0 and each query's own block forced. Rows per case:

* ``mate_cupy``: ``sparse_attention_pipeline`` (the whole pipeline, one plan);
* ``mate_cupy.index``, ``mate_cupy.select``, ``mate_cupy.attend``: its three stages alone,
  on the same plan (filed as peers: parts of ours, not yardsticks);
* ``mate_cupy.fp8_index``: the whole pipeline with the index branch in float8
  e4m3 (the bf16 index inputs rounded; ``index_scale`` 1), the MiniMax Q8KV8 index; how
  much its top-16 agrees with the bf16 index's is measured by
  ``bench/fp8_index_agreement.py``;
* the baseline: dense causal cuDNN (prefill; at 1M tokens one call, wall clock) or our
  dense paged decode over the same cache (decode).
"""
from __future__ import annotations

import math

from . import ours
from .bench_attention import D, _gen, _linear_pages, _paged_decode_eager, _randn
from .checks import attention_rows, rel_err, sample_rows
from .harness import Bound, Case, Impl, sized
from .models import BLOCK, attention_flops, kv_bytes, max_score_flops
from .peers import sdpa_build
from .report import Target

TOPK, BEGIN, END = 16, 1, 1


def _inputs(dev, batch: int, qo: int, kv: int, hq: int, hkv: int, seed: int) -> dict:
    """q and index q for ``batch`` requests of ``qo`` queries at the end of ``kv`` keys; the paged
    main and index caches (page 128, pages shuffled, request-major CSR ids)."""
    import torch

    g = _gen(dev, seed)
    pages = math.ceil(kv / BLOCK)
    n_pages = batch * pages
    return {"q": _randn((batch * qo, hq, D), g, dev), "index_q": _randn((batch * qo, hkv, D), g, dev),
            "k_cache": _randn((n_pages, BLOCK, hkv, D), g, dev), "v_cache": _randn((n_pages, BLOCK, hkv, D), g, dev),
            "index_k": _randn((n_pages, BLOCK, 1, D), g, dev),
            "kv_indices": torch.randperm(n_pages, generator=g, device=dev).to(torch.int32)}


def _plan(batch: int, qo: int, kv: int, hq: int, hkv: int):
    import torch

    return ours.api().sparse_pipeline_plan(
        [qo] * batch, [kv] * batch, hq, hkv, topk=TOPK, force_begin_blocks=BEGIN, force_end_blocks=END,
        prefill_tile="gather" if qo > 32 else None, device=torch.cuda.current_device() if torch.cuda.is_available()
        else "cpu", head_dim=D, dtype=torch.bfloat16)


def _builders(batch: int, qo: int, kv: int, hq: int, hkv: int):
    """Bound builders of the whole pipeline and of each stage (each with its own plan)."""
    mc = ours.api

    def whole(inputs):
        import torch

        plan = _plan(batch, qo, kv, hq, hkv)
        outs = [torch.empty_like(x["q"]) for x in inputs]

        def run(i):
            x = inputs[i]
            return mc().sparse_attention_pipeline(x["q"], x["k_cache"], x["v_cache"], x["index_q"], x["index_k"],
                                                  plan, kv_indices=x["kv_indices"], out=outs[i])

        return Bound(run)

    def index(inputs):
        from mate_cupy.msa.pipeline import index_window

        plan = _plan(batch, qo, kv, hq, hkv)

        def run(i):
            x = inputs[i]
            for w in plan.windows:
                index_window(plan, w, x["index_q"], x["index_k"], kv_indices=x["kv_indices"])
            return plan.max_score

        return Bound(run, result=lambda o: None)

    def run_once(inputs):
        """A plan whose buffers hold one run's scores and selection (what the later stages read)."""
        plan = _plan(batch, qo, kv, hq, hkv)
        x = inputs[0]
        mc().sparse_attention_pipeline(x["q"], x["k_cache"], x["v_cache"], x["index_q"], x["index_k"], plan,
                                       kv_indices=x["kv_indices"])
        return plan

    def select(inputs):
        from mate_cupy.msa.pipeline import select_window
        from mate_cupy.runtime.interop import Call

        plan = run_once(inputs)

        def run(i):
            with Call(q=inputs[i]["q"]).launch_scope():  # the caller's stream, as the pipeline
                for w in plan.windows:
                    select_window(plan, w)
            return plan.selection

        return Bound(run, result=lambda o: None)

    def attend(inputs):
        import torch

        plan = run_once(inputs)
        outs = [torch.empty_like(x["q"]) for x in inputs]

        def run(i):
            x = inputs[i]
            return mc().msa(x["q"], x["k_cache"], x["v_cache"], plan.attention, kv_indices=x["kv_indices"],
                            kv_block_indexes=plan.selection, out=outs[i])[0]

        return Bound(run, result=lambda o: None)

    return whole, index, select, attend


def _fp8_index_builder(batch: int, qo: int, kv: int, hq: int, hkv: int):
    """The whole pipeline on the inputs' float8 index copies (``index_q8``, ``index_k8``)."""

    def whole_fp8(inputs):
        import torch

        plan = _plan(batch, qo, kv, hq, hkv)
        outs = [torch.empty_like(x["q"]) for x in inputs]

        def run(i):
            x = inputs[i]
            return ours.api().sparse_attention_pipeline(x["q"], x["k_cache"], x["v_cache"], x["index_q8"],
                                                        x["index_k8"], plan, kv_indices=x["kv_indices"],
                                                        out=outs[i], index_scale=1.0)

        return Bound(run, result=lambda o: None)

    return whole_fp8


def _with_fp8_index(x: dict) -> dict:
    import torch

    x["index_q8"] = x["index_q"].to(torch.float8_e4m3fn)
    x["index_k8"] = x["index_k"].to(torch.float8_e4m3fn)
    return x


def _check(batch: int, qo: int, kv: int, hq: int, hkv: int):
    """The pipeline's output on sampled rows against fp32 attention over the blocks a fresh plan
    selects for the same inputs (the selection and scores are checked exactly in tests/)."""
    scale = D ** -0.5
    pages = math.ceil(kv / BLOCK)

    def check(results, inp):
        import torch

        if "mate_cupy" not in results:
            return {}
        plan = _plan(batch, qo, kv, hq, hkv)
        ours.api().sparse_attention_pipeline(inp["q"], inp["k_cache"], inp["v_cache"], inp["index_q"],
                                             inp["index_k"], plan, kv_indices=inp["kv_indices"])
        sel = torch.as_tensor(plan.selection, device=inp["q"].device).long()
        rows = sample_rows(batch * qo, 16, inp["q"].device)
        req = rows // qo
        pos = (kv - qo) + rows % qo
        table = inp["kv_indices"].view(batch, pages).long()[req]  # [R, pages]
        r = hq // hkv
        off = torch.arange(BLOCK, device=rows.device)
        parts = []
        for gi in range(hkv):
            bl = sel[rows, gi]                                            # [R, W]
            ok = bl >= 0
            page = torch.gather(table, 1, bl.clamp(min=0))
            kp = torch.where(ok[:, :, None], bl[:, :, None] * BLOCK + off, torch.full_like(bl[:, :, None], -1))
            kk = inp["k_cache"][page][:, :, :, gi].reshape(len(rows), -1, 1, D)
            vv = inp["v_cache"][page][:, :, :, gi].reshape(len(rows), -1, 1, D)
            parts.append(attention_rows(inp["q"][rows, gi * r:(gi + 1) * r], kk, vv, pos,
                                        torch.full_like(rows, kv), True, scale, key_pos=kp.reshape(len(rows), -1)))
        return {"mate_cupy": {"err": rel_err(results["mate_cupy"][rows], torch.cat(parts, dim=1)),
                              "err_vs": "fp32 attention over the selected blocks, sampled rows"}}

    return check


def prefill_case(cfg, s: int, hq: int, hkv: int, *, target: Target | None) -> Case:
    dev = cfg.device
    whole, index, select, attend = _builders(1, s, s, hq, hkv)

    def make_inputs(n):
        return [_with_fp8_index(_inputs(dev, 1, s, s, hq, hkv, 11 + i)) for i in range(n)]

    def linear_kv(x):
        p = x["kv_indices"].view(1, -1)
        return _linear_pages(x["k_cache"], p, s), _linear_pages(x["v_cache"], p, s)

    cudnn = Impl("sdpa_cudnn", "peer", sdpa_build("cudnn", 1, s, s, hq, hkv, D, causal=True, kv_view=linear_kv),
                 family="sdpa_cudnn", once=s > 262144, flops=attention_flops(1, hq, s, s, D, True))
    return Case(
        op="msa pipeline prefill", name=f"S{s} Hq{hq} Hkv{hkv} index Hq{hkv} Hkv1 top{TOPK}",
        make_inputs=make_inputs, set_bytes=2.0 * s * (hq + hkv) * D + 6.0 * s * hkv * D,
        impls=[Impl("mate_cupy", "ours", whole),
               Impl("mate_cupy.index", "peer", index, flops=max_score_flops(1, hkv, s, s, D, True)),
               Impl("mate_cupy.select", "peer", select), Impl("mate_cupy.attend", "peer", attend),
               Impl("mate_cupy.fp8_index", "peer", _fp8_index_builder(1, s, s, hq, hkv)), cudnn],
        metric="tflops", flops=None, baseline="sdpa_cudnn", target=target,
        check=_check(1, s, s, hq, hkv), tol=2e-2, max_sets=1,
        params=dict(S=s, Hq=hq, Hkv=hkv, D=D, index_heads=hkv, index_kv_heads=1, topk=TOPK,
                    force_begin_blocks=BEGIN, force_end_blocks=END, dtype="bfloat16",
                    flops_note="TFLOP/s only where a model applies: the index pass (2 D per causal pair of the "
                               "index heads) and dense cuDNN"),
    )


def decode_case(cfg, batch: int, seqlen: int, hq: int, hkv: int, *, target: Target | None) -> Case:
    dev = cfg.device
    whole, index, select, attend = _builders(batch, 1, seqlen, hq, hkv)

    def make_inputs(n):
        return [_with_fp8_index(_inputs(dev, batch, 1, seqlen, hq, hkv, 21 + i)) for i in range(n)]

    def dense(inputs):
        return _paged_decode_eager(inputs, batch, seqlen, hq, hkv, BLOCK)

    index_bytes = float(batch) * seqlen * D * 2
    return Case(
        op="msa pipeline decode", name=f"B{batch} L{seqlen} Hq{hq} Hkv{hkv} index Hq{hkv} Hkv1 top{TOPK}",
        make_inputs=make_inputs, set_bytes=kv_bytes(batch, seqlen, hkv, D),
        impls=[Impl("mate_cupy", "ours", whole), Impl("mate_cupy.index", "peer", index, bytes=index_bytes),
               Impl("mate_cupy.select", "peer", select), Impl("mate_cupy.attend", "peer", attend),
               Impl("mate_cupy.fp8_index", "peer", _fp8_index_builder(batch, 1, seqlen, hq, hkv)),
               Impl("mate_cupy.dense", "peer", dense, bytes=kv_bytes(batch, seqlen, hkv, D))],
        metric="tbps", bytes=None, baseline="mate_cupy.dense", target=target,
        check=_check(batch, 1, seqlen, hq, hkv), tol=2e-2, max_sets=1,
        params=dict(B=batch, L=seqlen, Hq=hq, Hkv=hkv, D=D, index_heads=hkv, index_kv_heads=1, topk=TOPK,
                    force_begin_blocks=BEGIN, force_end_blocks=END, dtype="bfloat16",
                    bytes_note="TB/s of the index pass: the index cache read once; of the dense row: K and V"),
    )


def cases(cfg) -> list:
    out = []
    for full, target in ((32768, 5.0), (131072, 14.0), (1048576, 25.0)):
        s = sized(cfg, full, full // 8, 512)
        if cfg.size == "tiny" and full > 32768:
            continue
        if cfg.size == "quick" and full > 131072:
            continue
        out.append(prefill_case(cfg, s, 64, 4, target=Target("speedup", target, "sdpa_cudnn")
                                if cfg.size == "full" else None))
    for (b, L), target in (((8, 1048576), 8.0), ((64, 131072), None)):
        b, L = sized(cfg, (b, L), (b, L // 8), (2, 2048))
        if cfg.size == "tiny" and target is None:
            continue
        out.append(decode_case(cfg, b, L, 64, 4, target=Target("speedup", target, "mate_cupy.dense")
                               if target and cfg.size == "full" else None))
    return out
