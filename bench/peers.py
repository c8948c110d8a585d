"""The torch peers: SDPA (flash / cuDNN backends) and FlexAttention with a block mask.

Peers read the same input memory as our kernels wherever their layout allows:
our varlen ``[total, H, D]`` buffers are viewed as ``[B, H, S, D]`` (a strided
BSHD view, the way SDPA is called from a model's projections), so no copy is
timed. Where a peer needs another layout (contiguous KV for SDPA decode, linear
KV for Flex), the copy is made once, outside the timed region.
"""
from __future__ import annotations

import math

from .harness import Bound

_FLEX = {}


def sdpa_build(backend: str, batch: int, sq: int, sk: int, hq: int, hkv: int, d: int, *, causal: bool,
               kv_view=None):
    """Impl builder for ``torch.nn.functional.scaled_dot_product_attention``.

    backend: "flash" or "cudnn". Inputs: set["q"] [B*Sq, Hq, D]; K/V from
    ``kv_view(set) -> (k [B, Sk, Hkv, D], v)`` (default: set["k"], set["v"] as
    [B*Sk, Hkv, D]). Tried in order, the first the backend accepts is timed:
    strided BSHD views with ``enable_gqa``; contiguous [B, H, S, D] copies with
    ``enable_gqa``; contiguous copies with K/V expanded to Hq heads. Copies are
    made once, outside the timed region, and named in the record's note.
    Output compared as [B*Sq, Hq, D].
    """

    def build(inputs):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kind = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
        r = hq // hkv

        def views(s):
            q = s["q"].view(batch, sq, hq, d).transpose(1, 2)
            if kv_view is None:
                k = s["k"].view(batch, sk, hkv, d)
                v = s["v"].view(batch, sk, hkv, d)
            else:
                k, v = kv_view(s)
            return q, k.transpose(1, 2), v.transpose(1, 2)

        layouts = [
            ("strided BSHD views", lambda s: views(s), hq != hkv),
            ("contiguous [B, H, S, D] copies", lambda s: tuple(t.contiguous() for t in views(s)), hq != hkv),
            ("contiguous copies, K/V expanded to Hq heads",
             lambda s: (lambda q, k, v: (q.contiguous(), k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)))(
                 *views(s)), False),
        ]
        refusals = []
        sets = None
        with sdpa_kernel([kind]):
            for what, make, gqa in layouts:
                first = make(inputs[0])
                try:
                    F.scaled_dot_product_attention(*first, is_causal=causal, enable_gqa=gqa)
                except RuntimeError as e:
                    refusals.append(f"{what}: {' '.join(str(e).split())[:160]}")
                    continue
                sets = [first] + [make(s) for s in inputs[1:]]
                break
        if sets is None:
            reasons = {r.split(": ", 1)[1] for r in refusals}
            if len(reasons) == 1:
                raise RuntimeError(f"SDPA {backend} refused every layout: {reasons.pop()}")
            raise RuntimeError(f"SDPA {backend} refused every layout: " + " | ".join(refusals))
        note = None
        if refusals:
            note = f"SDPA {backend} timed on {what} (made outside the timed region); refused: " + " | ".join(refusals)

        def run(i):
            q, k, v = sets[i]
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        def result(o):
            return o.transpose(1, 2).reshape(batch * sq, hq, d)

        return Bound(run, result=result, context=lambda: sdpa_kernel([kind]), note=note)

    return build


def flex_fn(device: str):
    """``flex_attention``, compiled once per process on CUDA (eager on the CPU smoke run)."""
    fn = _FLEX.get(device)
    if fn is None:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        fn = torch.compile(flex_attention, dynamic=False) if device == "cuda" else flex_attention
        _FLEX[device] = fn
    return fn


def tile_block_mask(tile_ids, hq: int, n_blocks: int, block: int = 128):
    """FlexAttention ``BlockMask`` for tile-shared sparse causal attention.

    tile_ids: int [n_tiles, Hkv, W] sorted block ids per 128-query tile and KV
    head (-1 padding); tile ``t`` always lists its diagonal block ``t``. The
    diagonal block is a partial block (causal ``mask_mod``); every other listed
    block is a full block (no mask evaluation), as a careful Flex user writes it.
    The ``mask_mod`` also encodes the selection (a [Hkv, n_tiles, n_blocks]
    bitmap): Flex's semantics are the mask_mod's (eager Flex evaluates it
    everywhere); the compiled kernel evaluates it on the diagonal blocks only.
    """
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    n_tiles, hkv, w = tile_ids.shape
    r = hq // hkv
    dev = tile_ids.device
    sel = tile_ids.permute(1, 0, 2).repeat_interleave(r, dim=0).to(torch.int64)  # [Hq, n_tiles, W]
    t = torch.arange(n_tiles, device=dev)
    diag_listed = (sel == t[None, :, None]).any(-1)
    partial_num = diag_listed.to(torch.int32)
    partial_idx = torch.zeros(hq, n_tiles, n_blocks, dtype=torch.int32, device=dev)
    partial_idx[:, :, 0] = t.to(torch.int32)[None, :]
    full = (sel >= 0) & (sel != t[None, :, None]) & (sel < t[None, :, None])
    big = n_blocks + 1
    srt = torch.where(full, sel, torch.full_like(sel, big)).sort(-1).values
    srt = torch.where(srt == big, torch.zeros_like(srt), srt).to(torch.int32)
    full_idx = torch.zeros(hq, n_tiles, n_blocks, dtype=torch.int32, device=dev)
    full_idx[:, :, :w] = srt
    full_num = full.sum(-1).to(torch.int32)
    ids = tile_ids.to(torch.int64)
    bitmap = torch.zeros(hkv, n_tiles, n_blocks + 1, dtype=torch.bool, device=dev)
    bitmap.scatter_(2, torch.where(ids >= 0, ids, torch.full_like(ids, n_blocks)).permute(1, 0, 2), True)
    bitmap = bitmap[:, :, :n_blocks].contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return bitmap[h // r, q_idx // block, kv_idx // block] & (q_idx >= kv_idx)

    return BlockMask.from_kv_blocks(partial_num[None], partial_idx[None], full_num[None], full_idx[None],
                                    BLOCK_SIZE=block, mask_mod=mask_mod)


def token_block_mask(token_ids, hq: int, n_blocks: int, block: int = 128):
    """FlexAttention ``BlockMask`` + ``mask_mod`` for per-token block selection.

    token_ids: int [S, Hkv, W] per query token. Each 128-query tile visits the
    union of its tokens' blocks (all partial); ``mask_mod`` reads a per-token
    [Hkv, S, n_blocks] bitmap. This is the costly case (Flex has no per-token form).
    """
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    s_len, hkv, w = token_ids.shape
    r = hq // hkv
    n_tiles = math.ceil(s_len / block)
    dev = token_ids.device
    ids = token_ids.to(torch.int64)
    bitmap = torch.zeros(hkv, s_len, n_blocks + 1, dtype=torch.bool, device=dev)
    safe = torch.where(ids >= 0, ids, torch.full_like(ids, n_blocks))  # -1 -> spare column
    bitmap.scatter_(2, safe.permute(1, 0, 2), True)
    bitmap = bitmap[:, :, :n_blocks].contiguous()
    pad = n_tiles * block - s_len
    bm = torch.nn.functional.pad(bitmap, (0, 0, 0, pad)) if pad else bitmap
    union = bm.view(hkv, n_tiles, block, n_blocks).any(2).repeat_interleave(r, dim=0)  # [Hq, n_tiles, n_blocks]
    num = union.sum(-1).to(torch.int32)
    idx = torch.sort(union.to(torch.int8), dim=-1, descending=True, stable=True).indices.to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return bitmap[h // r, q_idx, kv_idx // block] & (q_idx >= kv_idx)

    return BlockMask.from_kv_blocks(num[None], idx[None], BLOCK_SIZE=block, mask_mod=mask_mod)


def flex_build(device: str, s_len: int, hq: int, hkv: int, d: int, *, mask_from_set, kv_view):
    """Impl builder for FlexAttention on one sequence: q set["q"] [S, Hq, D]; K/V from
    ``kv_view(set)`` as [S, Hkv, D]; the block mask from ``mask_from_set(set)``
    (built once, outside the timed region)."""

    def build(inputs):
        flex = flex_fn(device)
        sets = []
        for s in inputs:
            k, v = kv_view(s)
            sets.append((s["q"].view(1, s_len, hq, d).transpose(1, 2), k.view(1, s_len, hkv, d).transpose(1, 2),
                         v.view(1, s_len, hkv, d).transpose(1, 2), mask_from_set(s)))

        def run(i):
            q, k, v, bm = sets[i]
            return flex(q, k, v, block_mask=bm, enable_gqa=hq != hkv)

        def result(o):
            return o.transpose(1, 2).reshape(s_len, hq, d)

        return Bound(run, result=result)

    return build
