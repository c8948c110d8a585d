"""MSA attention cases: dense prefill (causal and not), paged prefill and decode, block-sparse prefill and decode.

Peers: torch SDPA (flash and cuDNN backends) for dense and decode (decode on a
contiguous copy of the paged KV), FlexAttention with a block mask for sparse prefill;
paged prefill and block-sparse decode are compared with our own dense attention over the
same lengths.
All bf16, D = 128; sparse rows at MiniMax-M3's shapes (Hq 64, Hkv 4, 16 blocks of 128).
"""
from __future__ import annotations

import contextlib
import math

from . import ours
from .checks import attention_rows, rel_err, sample_rows
from .harness import Bound, Case, Impl, sized
from .models import BLOCK, attention_flops, kv_bytes, sparse_attention_flops
from .peers import flex_build, sdpa_build, tile_block_mask, token_block_mask
from .report import Target

D = 128


def _gen(device, seed):
    import torch

    return torch.Generator(device=device).manual_seed(seed)


def _randn(shape, gen, device, scale=1.0):
    import torch

    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if scale != 1.0:
        x *= scale
    return x.to(torch.bfloat16)


def _linear_pages(cache, pages, length: int):
    """[B, length, Hkv, D] copy of a paged cache ``[P, page, Hkv, D]`` read through the page ids
    ``pages`` ([B, pages per request], any integer dtype): the contiguous K or V a dense peer takes."""
    b, n = pages.shape
    return cache[pages.long()].reshape(b, n * cache.shape[1], *cache.shape[2:])[:, :length]


def _checker(ref_fn, what: str):
    """Case check: every impl's output on the sampled rows against ``ref_fn(inp) -> (rows, ref)``."""

    def check(results, inp):
        rows, ref = ref_fn(inp)
        return {name: {"err": rel_err(out[rows], ref), "err_vs": what} for name, out in results.items()
                if out is not None}

    return check


# --------------------------------------------------------------------------- dense prefill

def _dense_prefill_build(batch: int, s: int, hq: int, hkv: int, causal: bool):
    """Impl builder: our dense prefill (eager plan, ``out=``) on set["q"], set["k"], set["v"]
    ([B*S, H, D])."""

    def build(inputs):
        import torch

        plan = ours.eager_plan([s] * batch, [s] * batch, hq, hkv, causal=causal)
        outs = [torch.empty_like(x["q"]) for x in inputs]

        def run(i):
            x = inputs[i]
            return ours.first(ours.msa(x["q"], x["k"], x["v"], plan, out=outs[i]))

        return Bound(run)

    return build


def _dense_prefill_ref(dev, batch: int, s: int, hkv: int, causal: bool, n_rows: int):
    """Case reference: fp32 attention of ``n_rows`` sampled query rows over set["k"], set["v"]."""
    scale = D ** -0.5

    def ref(inp):
        import torch

        rows = sample_rows(batch * s, n_rows, dev)
        b, pos = rows // s, rows % s
        if batch == 1:
            k, v = inp["k"], inp["v"]
        else:
            k = inp["k"].view(batch, s, hkv, D)[b]
            v = inp["v"].view(batch, s, hkv, D)[b]
        return rows, attention_rows(inp["q"][rows], k, v, pos, torch.full_like(pos, s), causal, scale)

    return ref


def dense_case(cfg, batch: int, s: int, hq: int, hkv: int, *, target: Target | None, causal: bool = True) -> Case:
    """Dense prefill, ``batch`` sequences of ``s`` tokens (packed [B*S, H, D]), beside SDPA's
    flash and cuDNN backends; the baseline is cuDNN, the strongest peer on Hopper."""
    dev = cfg.device

    def make_inputs(n):
        g = _gen(dev, 1)
        return [{"q": _randn((batch * s, hq, D), g, dev), "k": _randn((batch * s, hkv, D), g, dev),
                 "v": _randn((batch * s, hkv, D), g, dev)} for _ in range(n)]

    ref = _dense_prefill_ref(dev, batch, s, hkv, causal, 48 if s * batch <= 65536 else 24)
    return Case(
        op="msa dense prefill", name=f"B{batch} S{s} Hq{hq} Hkv{hkv} " + ("causal" if causal else "non-causal"),
        make_inputs=make_inputs, set_bytes=2.0 * batch * s * (hq + 2 * hkv) * D,
        impls=[
            Impl("mate_cupy", "ours", _dense_prefill_build(batch, s, hq, hkv, causal)),
            Impl("sdpa_flash", "peer", sdpa_build("flash", batch, s, s, hq, hkv, D, causal=causal),
                 family="sdpa_flash"),
            Impl("sdpa_cudnn", "peer", sdpa_build("cudnn", batch, s, s, hq, hkv, D, causal=causal),
                 family="sdpa_cudnn"),
        ],
        metric="tflops", flops=attention_flops(batch, hq, s, s, D, causal), baseline="sdpa_cudnn", target=target,
        check=_checker(ref, "fp32 reference on sampled query rows"), tol=2e-2,
        params=dict(B=batch, S=s, Hq=hq, Hkv=hkv, D=D, causal=causal, dtype="bfloat16"),
    )


# --------------------------------------------------------------------------- paged prefill

def paged_prefill_inputs(dev, n: int, batch: int, s: int, page: int, hq: int, hkv: int) -> list:
    """``n`` input sets of a paged prefill of ``batch`` sequences of ``s`` tokens: "q"
    [B*S, Hq, D]; "k_cache", "v_cache" [pages, page, Hkv, D] with the pages in random order,
    their CSR "kv_indices" (int32); and "k", "v" [B*S, Hkv, D], the same values laid out
    contiguously (the dense baselines' operands)."""
    import torch

    ppr = math.ceil(s / page)
    n_pages = batch * ppr
    g = _gen(dev, 5)
    sets = []
    for _ in range(n):
        perm = torch.randperm(n_pages, generator=g, device=dev).to(torch.int32)
        x = {"q": _randn((batch * s, hq, D), g, dev), "k_cache": _randn((n_pages, page, hkv, D), g, dev),
             "v_cache": _randn((n_pages, page, hkv, D), g, dev), "kv_indices": perm}
        pt = perm.view(batch, ppr)
        x["k"] = _linear_pages(x["k_cache"], pt, s).reshape(batch * s, hkv, D)
        x["v"] = _linear_pages(x["v_cache"], pt, s).reshape(batch * s, hkv, D)
        sets.append(x)
    return sets


@contextlib.contextmanager
def launch_patch(patcher):
    """Run the block under ``patcher`` (a ``unittest.mock`` patcher of
    ``mate_cupy.msa.attention_launch``: a launch choice or a registered variant), with
    ``select_config``'s memo cleared on entry and exit, so plans built inside take the patched
    configuration and plans built after it the configured one (the sweeps' override)."""
    from mate_cupy.msa import attention_launch as al

    with patcher:
        al.select_config.cache_clear()
        try:
            yield
        finally:
            al.select_config.cache_clear()


def time_prefill(sets: list, outs: list, batch: int, s: int, hq: int, hkv: int, *, page: int = 0,
                 causal: bool = True) -> float:
    """Median ms per call of our prefill over ``sets`` of :func:`paged_prefill_inputs`: the
    public ``msa`` call on an eager plan built now (so it takes the current configuration),
    dense on "k"/"v" or, with ``page``, paged on the caches, writing ``outs[i]``; timed by
    ``bench.timing.Timer`` as ``bench/run.py`` times (the sweeps' measurement)."""
    from .timing import Timer, TimingConfig

    if page:
        plan = ours.eager_plan([s] * batch, [s] * batch, hq, hkv, page_size=page, causal=causal)

        def run(i):
            return ours.msa(sets[i]["q"], sets[i]["k_cache"], sets[i]["v_cache"], plan,
                            kv_indices=sets[i]["kv_indices"], out=outs[i])
    else:
        plan = ours.eager_plan([s] * batch, [s] * batch, hq, hkv, causal=causal)

        def run(i):
            return ours.msa(sets[i]["q"], sets[i]["k"], sets[i]["v"], plan, out=outs[i])

    return Timer(TimingConfig()).time(run, len(sets))["ms"]


def paged_prefill_case(cfg, batch: int, s: int, page: int, hq: int, hkv: int, *, target: Target | None) -> Case:
    """Causal prefill of ``batch`` sequences of ``s`` tokens whose K/V sit in a paged cache
    ([pages, page, Hkv, D], pages in random order, CSR ``kv_indices``), beside our dense
    prefill and cuDNN on the same values laid out contiguously (copies made untimed)."""
    dev = cfg.device

    def make_inputs(n):
        return paged_prefill_inputs(dev, n, batch, s, page, hq, hkv)

    def paged_build(inputs):
        import torch

        plan = ours.eager_plan([s] * batch, [s] * batch, hq, hkv, page_size=page, causal=True)
        outs = [torch.empty_like(x["q"]) for x in inputs]

        def run(i):
            x = inputs[i]
            return ours.first(ours.msa(x["q"], x["k_cache"], x["v_cache"], plan, kv_indices=x["kv_indices"],
                                       out=outs[i]))

        return Bound(run)

    ref = _dense_prefill_ref(dev, batch, s, hkv, True, 24)
    return Case(
        op="msa paged prefill", name=f"B{batch} S{s} page{page} Hq{hq} Hkv{hkv} causal",
        make_inputs=make_inputs, set_bytes=2.0 * batch * s * (hq + 4 * hkv) * D,
        impls=[
            Impl("mate_cupy", "ours", paged_build),
            Impl("mate_cupy.dense", "baseline", _dense_prefill_build(batch, s, hq, hkv, True)),
            Impl("sdpa_cudnn", "peer", sdpa_build("cudnn", batch, s, s, hq, hkv, D, causal=True),
                 family="sdpa_cudnn"),
        ],
        metric="tflops", flops=attention_flops(batch, hq, s, s, D, True), baseline="mate_cupy.dense",
        target=target, check=_checker(ref, "fp32 reference on sampled query rows"), tol=2e-2,
        params=dict(B=batch, S=s, page_size=page, Hq=hq, Hkv=hkv, D=D, causal=True, dtype="bfloat16",
                    kv_indices="random page order"),
    )


# --------------------------------------------------------------------------- paged decode

def _paged_decode_eager(inputs, batch: int, seqlen: int, hq: int, hkv: int, page: int) -> Bound:
    """Our dense paged decode through an eager plan (one query per request, CSR kv_indices)."""
    import torch

    plan = ours.eager_plan([1] * batch, [seqlen] * batch, hq, hkv, page_size=page, causal=True)
    outs = [torch.empty_like(x["q"]) for x in inputs]

    def run(i):
        x = inputs[i]
        return ours.first(ours.msa(x["q"], x["k_cache"], x["v_cache"], plan, kv_indices=x["kv_indices"],
                                   out=outs[i]))

    return Bound(run)


def decode_case(cfg, batch: int, seqlen: int, page: int, hq: int, hkv: int, *, target: Target | None) -> Case:
    dev = cfg.device
    scale = D ** -0.5
    pages_per_req = math.ceil(seqlen / page)
    n_pages = batch * pages_per_req

    def make_inputs(n):
        import torch

        g = _gen(dev, 2)
        sets = []
        for _ in range(n):
            perm = torch.randperm(n_pages, generator=g, device=dev).to(torch.int32)
            sets.append({"q": _randn((batch, hq, D), g, dev),
                         "k_cache": _randn((n_pages, page, hkv, D), g, dev),
                         "v_cache": _randn((n_pages, page, hkv, D), g, dev),
                         "page_table": perm.view(batch, pages_per_req), "kv_indices": perm})
        return sets

    def contiguous_kv(x):
        """[B, L, Hkv, D] copies of the paged K/V for SDPA (made once per set, untimed)."""
        if "k_lin" not in x:
            x["k_lin"] = _linear_pages(x["k_cache"], x["page_table"], seqlen)
            x["v_lin"] = _linear_pages(x["v_cache"], x["page_table"], seqlen)
        return x["k_lin"], x["v_lin"]

    def ours_eager(inputs):
        return _paged_decode_eager(inputs, batch, seqlen, hq, hkv, page)

    def ours_static(inputs):
        import torch

        plan = ours.static_paged_plan(batch, 1, seqlen, hq, hkv, total_k=n_pages * page, page_size=page)
        meta = ours.runtime_metadata([1] * batch, [seqlen] * batch, causal=True, page_size=page,
                                     device=inputs[0]["q"].device)
        outs = [torch.empty_like(x["q"]) for x in inputs]

        def run(i):
            x = inputs[i]
            return ours.first(ours.msa(x["q"], x["k_cache"], x["v_cache"], plan, kv_indices=x["kv_indices"],
                                       out=outs[i], runtime_metadata=meta))

        return Bound(run)

    def ref(inp):
        import torch

        rows = sample_rows(batch, 8, dev)
        k, v = contiguous_kv(inp)
        pos = torch.full_like(rows, seqlen - 1)
        return rows, attention_rows(inp["q"][rows], k[rows], v[rows], pos, torch.full_like(rows, seqlen), True,
                                    scale)

    return Case(
        op="msa paged decode", name=f"B{batch} L{seqlen} page{page} Hq{hq} Hkv{hkv}",
        make_inputs=make_inputs, set_bytes=kv_bytes(batch, seqlen, hkv, D),
        impls=[
            Impl("mate_cupy", "ours", ours_eager),
            Impl("mate_cupy.static", "ours", ours_static, capture_safe=True),
            Impl("sdpa_flash", "peer", sdpa_build("flash", batch, 1, seqlen, hq, hkv, D, causal=False,
                                                  kv_view=contiguous_kv), family="sdpa_flash", capture_safe=True),
            Impl("sdpa_cudnn", "peer", sdpa_build("cudnn", batch, 1, seqlen, hq, hkv, D, causal=False,
                                                  kv_view=contiguous_kv), family="sdpa_cudnn", capture_safe=True),
        ],
        metric="tbps", bytes=kv_bytes(batch, seqlen, hkv, D), baseline="sdpa_cudnn", target=target,
        check=_checker(ref, "fp32 reference on sampled requests"), tol=2e-2,
        params=dict(B=batch, L=seqlen, page_size=page, Hq=hq, Hkv=hkv, D=D, dtype="bfloat16",
                    peer_kv="contiguous copy"),
    )


# --------------------------------------------------------------------------- block-sparse prefill

def select_blocks(last_block, hkv: int, n_blocks: int, topk: int, gen):
    """Random causal block selection like MSA's: block 0 and the query's own block
    ``last_block`` are always chosen, ``topk - 2`` more at random from the blocks
    between (all of them when fewer). Returns int32 [R, Hkv, topk], ascending, -1 padded."""
    import torch

    dev = last_block.device
    t = last_block.to(torch.int64)
    r = t.numel()
    keys = torch.rand(r, hkv, n_blocks, generator=gen, device=dev)
    b = torch.arange(n_blocks, device=dev)
    middle = (b[None, None, :] >= 1) & (b[None, None, :] < t[:, None, None])
    keys = keys.masked_fill(~middle, 2.0)
    m = max(0, min(topk - 2, n_blocks))
    picks = keys.topk(m, dim=-1, largest=False)
    mid = torch.where(picks.values < 1.5, picks.indices, torch.full_like(picks.indices, -1))
    first = torch.zeros(r, hkv, 1, dtype=torch.int64, device=dev)
    last = torch.where(t > 0, t, torch.full_like(t, -1))[:, None, None].expand(r, hkv, 1)
    ids = torch.cat([first, last, mid], dim=-1)
    big = n_blocks + 1
    ids = torch.where(ids < 0, torch.full_like(ids, big), ids).sort(-1).values
    ids = torch.where(ids == big, torch.full_like(ids, -1), ids)
    return ids[..., :topk].to(torch.int32).contiguous()


# The GPU whose FlexAttention per-token time (``flex_note_ms``) the per-token case reports when
# ``--flex-per-token`` is off; on any other GPU the row has no Flex entry.
FLEX_PER_TOKEN_GPU = "H200"


def _on_gpu(cfg, name: str) -> bool:
    import torch

    return str(cfg.device) != "cpu" and torch.cuda.is_available() and name in torch.cuda.get_device_name()


def sparse_case(cfg, s: int, hq: int, hkv: int, topk: int, *, per_token: bool, target: Target | None,
                flex_note_ms: float | None = None) -> Case:
    dev = cfg.device
    scale = D ** -0.5
    n_blocks = math.ceil(s / BLOCK)

    def make_inputs(n):
        import torch

        g = _gen(dev, 3)
        sets = []
        for _ in range(n):
            perm = torch.randperm(n_blocks, generator=g, device=dev).to(torch.int32)
            if per_token:
                own = torch.arange(s, device=dev) // BLOCK
                ids = select_blocks(own, hkv, n_blocks, topk, g)
                tiles = None
            else:
                tiles = select_blocks(torch.arange(n_blocks, device=dev), hkv, n_blocks, topk, g)
                ids = tiles[torch.arange(s, device=dev) // BLOCK].contiguous()
            sets.append({"q": _randn((s, hq, D), g, dev),
                         "k_cache": _randn((n_blocks, BLOCK, hkv, D), g, dev),
                         "v_cache": _randn((n_blocks, BLOCK, hkv, D), g, dev),
                         "kv_indices": perm, "kv_block_indexes": ids, "tile_ids": tiles})
        return sets

    def linear_kv(x):
        if "k_lin" not in x:
            p = x["kv_indices"].long()
            x["k_lin"] = x["k_cache"][p].reshape(n_blocks * BLOCK, hkv, D)[:s]
            x["v_lin"] = x["v_cache"][p].reshape(n_blocks * BLOCK, hkv, D)[:s]
        return x["k_lin"], x["v_lin"]

    def ours_build(inputs, tile="query"):
        import torch

        plan = ours.sparse_plan([s], [s], hq, hkv, page_size=BLOCK, kv_block_num=topk, causal=True,
                                prefill_tile=tile)
        outs = [torch.empty_like(x["q"]) for x in inputs]

        def run(i):
            x = inputs[i]
            return ours.first(ours.sparse_msa(x["q"], x["k_cache"], x["v_cache"], plan, kv_indices=x["kv_indices"],
                                              kv_block_indexes=x["kv_block_indexes"], out=outs[i]))

        return Bound(run)

    def gather_build(inputs):
        """Per-token lists: the plan's default tile."""
        return ours_build(inputs, tile=None)

    if per_token:
        mask = lambda x: token_block_mask(x["kv_block_indexes"], hq, n_blocks)  # noqa: E731
    else:
        mask = lambda x: tile_block_mask(x["tile_ids"], hq, n_blocks)  # noqa: E731
    flex = Impl("flex", "peer", flex_build(dev, s, hq, hkv, D, mask_from_set=mask, kv_view=linear_kv),
                family="flex")
    if per_token:
        flex.samples = 3
        if not cfg.flex_per_token:
            if flex_note_ms is None or not _on_gpu(cfg, FLEX_PER_TOKEN_GPU):
                flex = None
            else:
                flex.fixed = {"ms": flex_note_ms,
                              "note": f"FlexAttention per-token selection: {flex_note_ms} ms per call measured on "
                                      f"an {FLEX_PER_TOKEN_GPU} (bench/results/2026-11-30-H200-e/), not re-run; "
                                      "--flex-per-token times it"}

    def ref(inp):
        import torch

        rows = sample_rows(s, 24, dev)
        k, v = linear_kv(inp)
        r = hq // hkv
        outs = []
        ids = inp["kv_block_indexes"][rows].to(torch.int64)  # [R, Hkv, W]
        off = torch.arange(BLOCK, device=k.device)
        for gi in range(hkv):
            blk = ids[:, gi, :]                                           # [R, W]
            pos = (blk[:, :, None] * BLOCK + off).reshape(len(rows), -1)  # [R, W*128]
            pos = torch.where((blk[:, :, None] >= 0).expand(-1, -1, BLOCK).reshape(len(rows), -1), pos,
                              torch.full_like(pos, -1))
            safe = pos.clamp(0, s - 1)
            kk, vv = k[safe, gi][:, :, None, :], v[safe, gi][:, :, None, :]
            outs.append(attention_rows(inp["q"][rows, gi * r:(gi + 1) * r], kk, vv, rows, torch.full_like(rows, s),
                                       True, scale, key_pos=pos))
        return rows, torch.cat(outs, dim=1)

    def flops_of(x):
        import numpy as np

        return sparse_attention_flops(x["kv_block_indexes"].cpu().numpy(), np.arange(s), s, hq, D)

    case = Case(
        op="msa sparse prefill",
        name=f"S{s} Hq{hq} Hkv{hkv} top{topk} " + ("per-token blocks" if per_token else "tile-shared blocks"),
        make_inputs=make_inputs, set_bytes=2.0 * s * hq * D + 4.0 * s * hkv * D,
        impls=([Impl("mate_cupy", "ours", gather_build), Impl("mate_cupy.query_tile", "peer", ours_build)]
               if per_token else [Impl("mate_cupy", "ours", ours_build)]) + ([flex] if flex is not None else []),
        metric="tflops", flops=None, baseline="flex" if flex is not None else None, target=target,
        check=_checker(ref, "fp32 reference on sampled query rows"), tol=2e-2,
        params=dict(S=s, Hq=hq, Hkv=hkv, D=D, topk=topk, block=BLOCK, per_token=per_token, causal=True,
                    dtype="bfloat16"),
    )
    _attach_flops(case, flops_of)
    return case


# --------------------------------------------------------------------------- block-sparse decode

def sparse_decode_case(cfg, batch: int, seqlen: int, hq: int, hkv: int, topk: int, *,
                       target: Target | None) -> Case:
    """One new token per request over ``seqlen`` cached keys; each (request, KV head) lists
    ``topk`` blocks of 128: block 0, the last block and random ones between. Ours (sparse,
    ``sparse_decode_atten_func``) against our dense paged decode (``msa``) over the full
    lengths, both on the same page-128 cache."""
    dev = cfg.device
    scale = D ** -0.5
    pages_per_req = math.ceil(seqlen / BLOCK)
    n_pages = batch * pages_per_req
    last = (seqlen - 1) // BLOCK

    def make_inputs(n):
        import torch

        g = _gen(dev, 4)
        sets = []
        for _ in range(n):
            perm = torch.randperm(n_pages, generator=g, device=dev).to(torch.int32)
            keys = torch.rand(batch, hkv, pages_per_req, generator=g, device=dev)
            keys[:, :, last + 1:] = 3.0  # never past the request
            keys[:, :, 0] = -1.0         # forced: the first block and the query's own block
            keys[:, :, last] = -1.0
            ids = keys.topk(min(topk, last + 1), dim=-1, largest=False).indices.sort(-1).values.to(torch.int32)
            sets.append({"q": _randn((batch, hq, D), g, dev),
                         "k_cache": _randn((n_pages, BLOCK, hkv, D), g, dev),
                         "v_cache": _randn((n_pages, BLOCK, hkv, D), g, dev),
                         "kv_indices": perm, "kv_block_indexes": ids.contiguous()})
        return sets

    def ours_sparse(inputs):
        import torch

        plan = ours.eager_plan([1] * batch, [seqlen] * batch, hq, hkv, page_size=BLOCK, kv_block_num=topk,
                               causal=True)
        outs = [torch.empty_like(x["q"]) for x in inputs]

        def run(i):
            x = inputs[i]
            return ours.first(ours.api().sparse_decode_atten_func(
                x["q"], x["k_cache"], x["v_cache"], plan, kv_indices=x["kv_indices"],
                kv_block_indexes=x["kv_block_indexes"], out=outs[i]))

        return Bound(run)

    def ours_dense(inputs):
        return _paged_decode_eager(inputs, batch, seqlen, hq, hkv, BLOCK)

    def check(results, inp):
        import torch

        rows = sample_rows(batch, 4, dev)
        table = inp["kv_indices"].view(batch, pages_per_req)[rows].long()   # [R, pages]
        pos = torch.full_like(rows, seqlen - 1)
        r = hq // hkv
        off = torch.arange(BLOCK, device=dev)
        out = {}
        for name, o in results.items():
            parts = []
            for gi in range(hkv):
                if name == "mate_cupy":  # the listed blocks only
                    bl = inp["kv_block_indexes"][rows, gi].long()           # [R, W]
                    pages = torch.gather(table, 1, bl)
                    kp = (bl[:, :, None] * BLOCK + off).reshape(len(rows), -1)
                else:                    # every key
                    pages = table
                    kp = torch.arange(pages_per_req * BLOCK, device=dev)[None].expand(len(rows), -1)
                kk = inp["k_cache"][pages][:, :, :, gi].reshape(len(rows), -1, 1, D)
                vv = inp["v_cache"][pages][:, :, :, gi].reshape(len(rows), -1, 1, D)
                parts.append(attention_rows(inp["q"][rows, gi * r:(gi + 1) * r], kk, vv, pos,
                                            torch.full_like(rows, seqlen), True, scale, key_pos=kp))
            what = "listed blocks" if name == "mate_cupy" else "all keys"
            out[name] = {"err": rel_err(o[rows], torch.cat(parts, dim=1)),
                         "err_vs": f"fp32 reference on sampled requests ({what})"}
        return out

    sparse_bytes = 2.0 * batch * hkv * min(topk, last + 1) * BLOCK * D * 2
    return Case(
        op="msa sparse decode", name=f"B{batch} L{seqlen} Hq{hq} Hkv{hkv} top{topk}",
        make_inputs=make_inputs, set_bytes=kv_bytes(batch, seqlen, hkv, D),
        impls=[
            Impl("mate_cupy", "ours", ours_sparse, capture_safe=False, bytes=sparse_bytes),
            # our own dense decode is the yardstick here, so it is filed as the case's peer
            Impl("mate_cupy.dense", "peer", ours_dense, bytes=kv_bytes(batch, seqlen, hkv, D)),
        ],
        metric="tbps", bytes=sparse_bytes, baseline="mate_cupy.dense", target=target,
        check=check, tol=2e-2, max_sets=1,
        params=dict(B=batch, L=seqlen, Hq=hq, Hkv=hkv, D=D, topk=topk, block=BLOCK, dtype="bfloat16",
                    baseline_note="our dense paged decode over the same lengths"),
    )


def _attach_flops(case: Case, flops_of):
    """Sparse FLOPs depend on the drawn selection: count them on the first input set."""
    make = case.make_inputs

    def make_inputs(n):
        sets = make(n)
        case.flops = flops_of(sets[0])
        return sets

    case.make_inputs = make_inputs


# --------------------------------------------------------------------------- the list

def cases(cfg) -> list:
    cudnn = Target("speedup", 1.0, "sdpa_cudnn")
    out = []
    b, s, hq, hkv = sized(cfg, (1, 8192, 64, 8), (1, 2048, 64, 8), (1, 256, 8, 2))
    out.append(dense_case(cfg, b, s, hq, hkv, target=cudnn))
    if cfg.size != "tiny":
        b, s, hq, hkv = sized(cfg, (1, 32768, 64, 4), (1, 4096, 64, 4), None)
        out.append(dense_case(cfg, b, s, hq, hkv, target=cudnn))
    b, s, hq, hkv = sized(cfg, (16, 1024, 64, 8), (4, 1024, 64, 8), (2, 128, 8, 2))
    out.append(dense_case(cfg, b, s, hq, hkv, target=Target("speedup", 0.9, "sdpa_cudnn")))
    b, s, hq, hkv = sized(cfg, (1, 8192, 64, 8), (1, 2048, 64, 8), (1, 256, 8, 2))
    out.append(dense_case(cfg, b, s, hq, hkv, target=cudnn, causal=False))
    b, s, page, hq, hkv = sized(cfg, (4, 8192, 64, 64, 8), (2, 2048, 64, 64, 8), (2, 200, 64, 8, 2))
    out.append(paged_prefill_case(cfg, b, s, page, hq, hkv, target=Target("speedup", 0.95, "mate_cupy.dense")))
    b, L, page, hq, hkv = sized(cfg, (64, 8192, 64, 64, 8), (16, 2048, 64, 64, 8), (2, 256, 64, 8, 2))
    out.append(decode_case(cfg, b, L, page, hq, hkv, target=Target("tbps", 3.0)))
    s, hq, hkv, topk = sized(cfg, (32768, 64, 4, 16), (8192, 64, 4, 16), (1024, 16, 1, 4))
    out.append(sparse_case(cfg, s, hq, hkv, topk, per_token=False, target=Target("speedup", 1.6, "flex")))
    out.append(sparse_case(cfg, s, hq, hkv, topk, per_token=True,
                           target=Target("ms", 5.0) if cfg.size == "full" else None,
                           flex_note_ms=219.0 if cfg.size == "full" else None))
    b, L, hq, hkv, topk = sized(cfg, (64, 131072, 64, 4, 16), (16, 32768, 64, 4, 16), (2, 2048, 16, 1, 4))
    out.append(sparse_decode_case(cfg, b, L, hq, hkv, topk, target=Target("speedup", 10.0, "mate_cupy.dense")))
    return out
