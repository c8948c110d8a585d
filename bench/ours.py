"""How the bench calls mate_cupy: through the public API only, with torch CUDA tensors.

Results come back as torch tensors and launch on torch's current stream, so
torch CUDA events (and CUDA-graph capture) see our kernels. Plans are built
outside the timed region; outputs are preallocated where the API allows.
"""
from __future__ import annotations


def api():
    import mate_cupy

    return mate_cupy


def _lookup(name: str, *aliases: str):
    mc = api()
    for n in (name, *aliases):
        fn = getattr(mc, n, None)
        if fn is not None:
            return fn
    raise AttributeError(f"mate_cupy has no public {name!r} yet")


def _lens(values):
    import torch

    return torch.tensor(list(values), dtype=torch.int32)


def _upload_to() -> dict:
    """Eager plans are uploaded when built, to torch's current CUDA device (none on the CPU smoke run)."""
    import torch

    return {"device": torch.cuda.current_device()} if torch.cuda.is_available() else {}


def eager_plan(qo_lens, kv_lens, hq: int, hkv: int, **kw):
    """Plan from concrete lengths (host int32 tensors), e.g. ``page_size=64`` or sparse options."""
    fn = _lookup("msa_plan_from_lengths", "_msa_plan_from_lengths")
    return fn(_lens(qo_lens), _lens(kv_lens), hq, hkv, **_upload_to(), **kw)


def sparse_plan(qo_lens, kv_lens, hq: int, hkv: int, **kw):
    return _lookup("sparse_msa_plan")(_lens(qo_lens), _lens(kv_lens), hq, hkv, **_upload_to(), **kw)


def static_paged_plan(batch: int, max_q: int, max_k: int, hq: int, hkv: int, *, total_k: int, page_size: int,
                      causal: bool = True):
    return _lookup("msa_plan")(batch, max_q, max_k, hq, total_seqlen_k=total_k, num_kv_heads=hkv,
                               page_size=page_size, causal=causal)


def runtime_metadata(qo_lens, kv_lens, *, causal: bool, page_size: int, device):
    """Device-resident ``MsaRuntimeMetadata`` for a static plan (CSR page indices, pages in order)."""
    import torch

    qo = _lens(qo_lens).to(device)
    kv = _lens(kv_lens).to(device)
    off = kv - qo
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    cu_q = torch.cat([zero, torch.cumsum(qo, 0, dtype=torch.int32)])
    cu_k = torch.cat([zero, torch.cumsum(kv, 0, dtype=torch.int32)])
    seqused = torch.minimum(kv, torch.clamp(qo + off, min=0)) if causal else kv.clone()
    pages = (kv + page_size - 1) // page_size
    indptr = torch.cat([zero, torch.cumsum(pages, 0, dtype=torch.int32)])
    Meta = _lookup("MsaRuntimeMetadata")
    return Meta(qo_lens=qo, kv_lens=kv, qo_offset=off, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                seqused_k=seqused, kv_page_indptr=indptr)


def msa(*args, **kw):
    return _lookup("msa")(*args, **kw)


def sparse_msa(*args, **kw):
    return _lookup("sparse_msa")(*args, **kw)


def sparse_topk_select(*args, **kw):
    return _lookup("sparse_topk_select")(*args, **kw)


def chunk_kda(*args, **kw):
    return _lookup("chunk_kda")(*args, **kw)


def gated_delta_rule_decode(*args, **kw):
    return _lookup("gated_delta_rule_decode")(*args, **kw)


def first(x):
    """Our ops return ``(out, extra)`` tuples; the bench compares ``out``."""
    return x[0] if isinstance(x, (tuple, list)) else x
