"""Float64 NumPy references for MSA (docs/semantics.md, sections 2-5).

Readable, exact, and shared by the NumPy execution path of the public API and by
every GPU test. Inputs may be any host array (NumPy, ``ml_dtypes`` bfloat16/fp8,
torch CPU, or a CuPy array, which is copied to the host); floating inputs are
upcast to float64 before any arithmetic, so fp8/bf16 values are used exactly.
Results are float64 (attention, max score) or int32 (indices); callers round them to
the output dtype.

Notation: ``Hq`` query heads, ``Hkv`` KV heads, ``r = Hq // Hkv`` (query head ``h``
reads KV head ``h // r``), ``D`` head dim. Request ``b`` owns query rows
``cu_seqlens_q[b] .. cu_seqlens_q[b] + qo_lens[b]`` (``qo_lens`` defaults to the
differences of ``cu_seqlens_q``) and has ``kv_lens[b]`` keys. Query ``i`` of request
``b`` sits at absolute position ``p = qo_offset[b] + i`` (default offset
``kv_lens[b] - qo_lens[b]``, bottom-right alignment); with ``causal`` it attends keys
``j <= p``, always ``j < kv_lens[b]``. Rows owned by no request, and queries with no
admissible key, get ``out = 0`` and ``lse = -inf`` (never NaN).

Index safety (the rule the CUDA kernels follow too): a page id outside
``[0, num_pages)`` (including ``-1`` and ids past a page table's width) makes the keys of
that page inadmissible; a sparse block id outside ``[0, ceil(kv_len / 128))`` is
skipped. Nothing is ever dereferenced out of bounds.

Paged caches: ``kv_layout="NHD"`` is ``[num_pages, page_size, Hkv, D]``, ``"HND"`` is
``[num_pages, Hkv, page_size, D]``; key ``j`` of request ``b`` lives in page
``page_table[b, j // page_size]``, slot ``j % page_size``.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np

from ..runtime.interop import to_host

BLOCK = 128  # keys per max-score / sparse block
_CHUNK_ELEMS = 1 << 22  # score elements per query chunk (bounds memory on long sequences)

__all__ = [
    "BLOCK",
    "block_max_score",
    "block_softmax_mass",
    "dense_attention",
    "page_table_from_csr",
    "page_table_from_indptr",
    "paged_attention",
    "paged_block_max_score",
    "sparse_attention",
    "topk_select",
]


# ----------------------------------------------------------------------------- helpers


def _f64(x, name: str) -> np.ndarray:
    a = to_host(x, name)
    return np.asarray(a).astype(np.float64)


def _ints(x, name: str) -> np.ndarray:
    a = np.asarray(to_host(x, name))
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got {a.dtype}")
    return a.astype(np.int64)


def _vector(x, name: str, length: Optional[int] = None) -> np.ndarray:
    a = _ints(x, name)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1D, got shape {a.shape}")
    if length is not None and a.shape[0] != length:
        raise ValueError(f"{name} must have length {length}, got {a.shape[0]}")
    return a


def _ceil_div(a, b):
    return -(-a // b)


def _rows(cu_seqlens_q, qo_lens, total_q: int):
    """Per-request (start, length) of query rows, checked against ``total_q``."""
    cu = _vector(cu_seqlens_q, "cu_seqlens_q")
    if cu.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have length batch + 1 >= 1")
    batch = cu.shape[0] - 1
    lens = np.diff(cu) if qo_lens is None else _vector(qo_lens, "qo_lens", batch)
    starts = cu[:-1]
    if np.any(lens < 0) or np.any(starts < 0) or np.any(starts + lens > total_q):
        raise ValueError(
            f"query rows out of range: cu_seqlens_q={cu.tolist()}, qo_lens={lens.tolist()}, "
            f"total_q={total_q}"
        )
    return starts, lens


def _offsets(qo_offset, qo_lens: np.ndarray, kv_lens: np.ndarray) -> np.ndarray:
    if qo_offset is None:
        return kv_lens - qo_lens
    if isinstance(qo_offset, (int, np.integer)):
        return np.full(qo_lens.shape, int(qo_offset), dtype=np.int64)
    return _vector(qo_offset, "qo_offset", qo_lens.shape[0])


def _heads(q: np.ndarray, k: np.ndarray, k_name: str, head_axis: int) -> tuple[int, int, int]:
    hq, hkv = q.shape[1], k.shape[head_axis]
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"Hq ({hq}) must be a positive multiple of Hkv ({hkv}) of {k_name}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dim mismatch: q {q.shape[-1]} vs {k_name} {k.shape[-1]}")
    return hq, hkv, hq // hkv


def _nhd(cache: np.ndarray, kv_layout: str, name: str) -> np.ndarray:
    """Paged cache as ``[num_pages, page_size, Hkv, D]``."""
    if cache.ndim != 4:
        raise ValueError(f"{name} must be a 4D paged cache, got shape {cache.shape}")
    if kv_layout == "NHD":
        return cache
    if kv_layout == "HND":
        return cache.transpose(0, 2, 1, 3)
    raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")


def _gather_pages(cache: np.ndarray, page_ids: np.ndarray, n_keys: int):
    """Keys ``[n_keys, Hkv, D]`` of one request and their admissibility ``[n_keys]``."""
    num_pages, page_size = cache.shape[0], cache.shape[1]
    valid = (page_ids >= 0) & (page_ids < num_pages)
    if num_pages == 0:
        keys = np.zeros((page_ids.shape[0] * page_size,) + cache.shape[2:])[:n_keys]
    else:
        keys = cache[np.where(valid, page_ids, 0)].reshape((-1,) + cache.shape[2:])[:n_keys]
    key_ok = np.repeat(valid, page_size)[:n_keys]
    return keys, key_ok


def _request_pages(page_table: np.ndarray, b: int, n_keys: int, page_size: int) -> np.ndarray:
    """Page ids of request ``b`` covering ``n_keys`` keys; ids past the table width are -1."""
    n_pages = _ceil_div(n_keys, page_size)
    ids = np.full(n_pages, -1, dtype=np.int64)
    width = min(n_pages, page_table.shape[1])
    ids[:width] = page_table[b, :width]
    return ids


def _scores(q, kt, c0, c1, hkv, r):
    """Logits of query rows ``c0:c1`` as ``[Hkv, n, r, Lk]`` (one batched GEMM per KV head)."""
    n, d = c1 - c0, q.shape[2]
    qc = q[c0:c1].reshape(n, hkv, r, d).transpose(1, 0, 2, 3).reshape(hkv, n * r, d)
    return (qc @ kt).reshape(hkv, n, r, kt.shape[2])


def _attend(q, k, v, pos, causal, scale, v_scale, out, lse, weights: Optional[Callable] = None):
    """Softmax attention of one request, written into ``out [Lq, Hq, D]`` / ``lse [Lq, Hq]``.

    ``q [Lq, Hq, D]``, ``k, v [Lk, Hkv, D]`` float64; ``pos [Lq]`` absolute positions;
    ``scale`` multiplies the logits; ``weights(c0, c1)`` gives key multiplicities for
    query rows ``c0:c1`` broadcastable to ``[n, Hkv, Lk]`` (0 = not admissible), or None.
    """
    lq, hq, d = q.shape
    lk, hkv = k.shape[0], k.shape[1]
    if lq == 0 or lk == 0:
        return
    r = hq // hkv
    kt = np.ascontiguousarray(k.transpose(1, 2, 0))  # [Hkv, D, Lk]
    vt = np.ascontiguousarray(v.transpose(1, 0, 2))  # [Hkv, Lk, D]
    step = max(1, _CHUNK_ELEMS // max(1, hq * lk))
    j = np.arange(lk)
    for c0 in range(0, lq, step):
        c1 = min(lq, c0 + step)
        n = c1 - c0
        s = _scores(q, kt, c0, c1, hkv, r) * scale  # [Hkv, n, r, Lk]
        live = np.ones((1, n, 1, lk), dtype=bool)
        if causal:
            live = live & (j[None, None, None, :] <= pos[None, c0:c1, None, None])
        w = None
        if weights is not None:
            w = np.broadcast_to(weights(c0, c1), (n, hkv, lk)).transpose(1, 0, 2)[:, :, None, :]
            live = live & (w > 0)
        s = np.where(live, s, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(s - m)  # exp(-inf) = 0 for keys that are not admissible
        if w is not None:
            e *= w
        den = e.sum(axis=-1)  # [Hkv, n, r]
        num = (e.reshape(hkv, n * r, lk) @ vt).reshape(hkv, n, r, d)
        ok = den > 0
        safe = np.where(ok, den, 1.0)
        o = np.where(ok[..., None], num / safe[..., None], 0.0) * v_scale
        l = np.where(ok, m[..., 0] + np.log(safe), -np.inf)
        out[c0:c1] = o.transpose(1, 0, 2, 3).reshape(n, hq, d)
        lse[c0:c1] = l.transpose(1, 0, 2).reshape(n, hq)


def _block_scores(q, k, pos, causal, key_ok, n_tiles, scale=1.0):
    """``q . k * scale`` of one request in query chunks, inadmissible keys ``-inf``: yields
    ``(c0, c1, s)`` with ``s [Hkv, c1 - c0, Hq / Hkv, nb, 128]`` (``nb`` blocks of keys)."""
    lq, hq, d = q.shape
    lk, hkv = k.shape[0], k.shape[1]
    if lq == 0 or lk == 0:
        return
    r = hq // hkv
    nb = _ceil_div(lk, BLOCK)
    if nb > n_tiles:
        raise ValueError(f"max_k_tiles={n_tiles} is smaller than the {nb} blocks of {lk} keys")
    kt = np.zeros((hkv, d, nb * BLOCK))
    kt[:, :, :lk] = k.transpose(1, 2, 0)
    j = np.arange(nb * BLOCK)
    step = max(1, _CHUNK_ELEMS // max(1, hq * nb * BLOCK))
    for c0 in range(0, lq, step):
        c1 = min(lq, c0 + step)
        n = c1 - c0
        s = _scores(q, kt, c0, c1, hkv, r)  # [Hkv, n, r, nb * 128]
        if scale != 1.0:
            s *= scale
        live = np.broadcast_to(j < lk, (n, nb * BLOCK))
        if causal:
            live = live & (j[None, :] <= pos[c0:c1, None])
        if key_ok is not None:
            live = live & np.pad(key_ok, (0, nb * BLOCK - lk))[None, :]
        yield c0, c1, np.where(live[None, :, None, :], s, -np.inf).reshape(hkv, n, r, nb, BLOCK)


def _per_query(blk):
    """``[Hkv, n, r, nb]`` -> ``[n, Hq, nb]`` (head ``g * r + i`` of KV head ``g``)."""
    hkv, n, r, nb = blk.shape
    return blk.transpose(1, 0, 2, 3).reshape(n, hkv * r, nb)


def _block_max(q, k, pos, causal, key_ok, n_tiles):
    """Raw-dot-product max per 128-key block: ``[Lq, Hq, n_tiles]`` (-inf where empty)."""
    res = np.full((q.shape[0], q.shape[1], n_tiles), -np.inf)
    for c0, c1, s in _block_scores(q, k, pos, causal, key_ok, n_tiles):
        res[c0:c1, :, :s.shape[3]] = _per_query(s.max(axis=-1))
    return res


def _block_mass(q, k, pos, causal, scale, n_tiles):
    """Softmax probability summed per 128-key block: ``[Lq, Hq, n_tiles]`` (0 where empty)."""
    res = np.zeros((q.shape[0], q.shape[1], n_tiles))
    for c0, c1, s in _block_scores(q, k, pos, causal, None, n_tiles, scale):
        m = s.max(axis=(-2, -1), keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        blk = np.exp(np.subtract(s, m, out=s), out=s).sum(axis=-1)  # 0 for keys that are not admissible
        den = blk.sum(axis=-1, keepdims=True)
        blk = np.where(den > 0, blk / np.where(den > 0, den, 1.0), 0.0)  # no admissible key: 0
        res[c0:c1, :, :s.shape[3]] = _per_query(blk)
    return res


def _resolve_scale(sm_scale, d: int) -> float:
    return 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)


# ----------------------------------------------------------------------------- attention


def dense_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, qo_offset=None, causal=True, sm_scale=None,
                    *, qo_lens=None, kv_lens=None, k_scale=1.0, v_scale=1.0):
    """Varlen attention over packed K/V.

    q ``[total_q, Hq, D]``; k, v ``[total_k, Hkv, D]``; ``cu_seqlens_q``/``cu_seqlens_k``
    ``[B+1]``: request ``b`` reads key rows ``cu_seqlens_k[b] .. + kv_lens[b]``
    (``kv_lens`` defaults to the differences of ``cu_seqlens_k``).
    ``s = q.k * k_scale * sm_scale``, ``out = v_scale * softmax(s) @ v``.
    Returns ``(out [total_q, Hq, D], lse [total_q, Hq])`` float64, natural-log LSE.
    """
    q, k, v = _f64(q, "q"), _f64(k, "k"), _f64(v, "v")
    total_q, hq, d = q.shape
    _heads(q, k, "k", 1)
    starts, qlens = _rows(cu_seqlens_q, qo_lens, total_q)
    cuk = _vector(cu_seqlens_k, "cu_seqlens_k", starts.shape[0] + 1)
    klens = np.diff(cuk) if kv_lens is None else _vector(kv_lens, "kv_lens", starts.shape[0])
    if np.any(klens < 0) or np.any(cuk[:-1] < 0) or np.any(cuk[:-1] + klens > k.shape[0]):
        raise ValueError(f"key rows out of range: cu_seqlens_k={cuk.tolist()}, total_k={k.shape[0]}")
    offs = _offsets(qo_offset, qlens, klens)
    scale = _resolve_scale(sm_scale, d) * float(k_scale)
    out = np.zeros((total_q, hq, d))
    lse = np.full((total_q, hq), -np.inf)
    for b in range(starts.shape[0]):
        s0, n, k0, nk = starts[b], qlens[b], cuk[b], klens[b]
        _attend(q[s0:s0 + n], k[k0:k0 + nk], v[k0:k0 + nk], offs[b] + np.arange(n), causal, scale,
                float(v_scale), out[s0:s0 + n], lse[s0:s0 + n])
    return out, lse


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, kv_lens, page_table, qo_offset=None, causal=True,
                    sm_scale=None, kv_layout="NHD", *, qo_lens=None, k_scale=1.0, v_scale=1.0):
    """Attention over a paged KV cache through ``page_table [B, max_pages]``.

    ``k_cache, v_cache``: ``[num_pages, page_size, Hkv, D]`` (NHD) or
    ``[num_pages, Hkv, page_size, D]`` (HND). Invalid page ids make their keys
    inadmissible. Returns ``(out [total_q, Hq, D], lse [total_q, Hq])`` float64.
    """
    q = _f64(q, "q")
    kc = _nhd(_f64(k_cache, "k_cache"), kv_layout, "k_cache")
    vc = _nhd(_f64(v_cache, "v_cache"), kv_layout, "v_cache")
    total_q, hq, d = q.shape
    _heads(q, kc, "k_cache", 2)
    starts, qlens = _rows(cu_seqlens_q, qo_lens, total_q)
    klens = _vector(kv_lens, "kv_lens", starts.shape[0])
    table = _ints(page_table, "page_table")
    if table.ndim != 2 or table.shape[0] != starts.shape[0]:
        raise ValueError(f"page_table must have shape [B={starts.shape[0]}, max_pages], got {table.shape}")
    if np.any(klens < 0):
        raise ValueError(f"kv_lens must be non-negative, got {klens.tolist()}")
    offs = _offsets(qo_offset, qlens, klens)
    scale = _resolve_scale(sm_scale, d) * float(k_scale)
    out = np.zeros((total_q, hq, d))
    lse = np.full((total_q, hq), -np.inf)
    page_size = kc.shape[1]
    for b in range(starts.shape[0]):
        s0, n, nk = starts[b], qlens[b], int(klens[b])
        ids = _request_pages(table, b, nk, page_size)
        keys, ok = _gather_pages(kc, ids, nk)
        vals, _ = _gather_pages(vc, ids, nk)
        _attend(q[s0:s0 + n], keys, vals, offs[b] + np.arange(n), causal, scale, float(v_scale),
                out[s0:s0 + n], lse[s0:s0 + n], weights=lambda c0, c1, ok=ok: ok[None, None, :])
    return out, lse


def sparse_attention(q, k_cache, v_cache, cu_seqlens_q, kv_lens, page_table, kv_block_indexes, qo_offset=None,
                     causal=True, sm_scale=None, k_scale=1.0, v_scale=1.0, kv_layout="NHD", *, qo_lens=None):
    """Block-sparse attention (docs/semantics.md, section 5): each query attends the listed 128-key blocks.

    ``kv_block_indexes [total_q, Hkv or Hq, W]`` int: block ids per query and KV head
    (given per query head, head ``g * r`` stands for KV head ``g``); ``-1`` and ids
    outside ``[0, ceil(kv_len / 128))`` are skipped; an id listed twice counts twice.
    Block ``s`` of request ``b`` is page ``page_table[b, s]`` (page size 128).
    fp8 scaling: ``s = q.k * k_scale * sm_scale``, ``out = v_scale * softmax(s) @ v``.
    Returns ``(out [total_q, Hq, D], lse [total_q, Hq])`` float64.
    """
    q = _f64(q, "q")
    kc = _nhd(_f64(k_cache, "k_cache"), kv_layout, "k_cache")
    vc = _nhd(_f64(v_cache, "v_cache"), kv_layout, "v_cache")
    total_q, hq, d = q.shape
    _, hkv, r = _heads(q, kc, "k_cache", 2)
    if kc.shape[1] != BLOCK:
        raise ValueError(f"sparse attention needs page_size {BLOCK}, got {kc.shape[1]}")
    starts, qlens = _rows(cu_seqlens_q, qo_lens, total_q)
    klens = _vector(kv_lens, "kv_lens", starts.shape[0])
    if np.any(klens < 0):
        raise ValueError(f"kv_lens must be non-negative, got {klens.tolist()}")
    table = _ints(page_table, "page_table")
    if table.ndim != 2 or table.shape[0] != starts.shape[0]:
        raise ValueError(f"page_table must have shape [B={starts.shape[0]}, max_pages], got {table.shape}")
    idx = _ints(kv_block_indexes, "kv_block_indexes")
    if idx.ndim != 3 or idx.shape[0] != total_q or idx.shape[1] not in (hkv, hq):
        raise ValueError(
            f"kv_block_indexes must have shape [total_q={total_q}, Hkv={hkv} or Hq={hq}, W], got {idx.shape}"
        )
    if idx.shape[1] != hkv:
        idx = idx[:, ::r, :]
    offs = _offsets(qo_offset, qlens, klens)
    scale = _resolve_scale(sm_scale, d) * float(k_scale)
    out = np.zeros((total_q, hq, d))
    lse = np.full((total_q, hq), -np.inf)
    for b in range(starts.shape[0]):
        s0, n, nk = starts[b], qlens[b], int(klens[b])
        nb = _ceil_div(nk, BLOCK)
        ids = _request_pages(table, b, nk, BLOCK)
        keys, ok = _gather_pages(kc, ids, nk)
        vals, _ = _gather_pages(vc, ids, nk)
        rows = idx[s0:s0 + n]  # [n, Hkv, W]

        def weights(c0, c1, rows=rows, ok=ok, nb=nb, nk=nk):
            sel = rows[c0:c1]
            mult = np.zeros((c1 - c0, hkv, nb + 1))
            tgt = np.where((sel >= 0) & (sel < nb), sel, nb)  # skipped ids land in a spill slot
            np.add.at(mult, (np.arange(c1 - c0)[:, None, None], np.arange(hkv)[None, :, None], tgt), 1.0)
            key_block = np.arange(nk) // BLOCK
            return mult[:, :, key_block] * ok[None, None, :]

        _attend(q[s0:s0 + n], keys, vals, offs[b] + np.arange(n), causal, scale, float(v_scale),
                out[s0:s0 + n], lse[s0:s0 + n], weights=weights)
    return out, lse


# ----------------------------------------------------------------------------- max score


def block_max_score(q, k, cu_seqlens_q, cu_seqlens_k, qo_offset=None, causal=True, max_k_tiles=None,
                    *, qo_lens=None, kv_lens=None, k_scale=1.0):
    """Per-128-key-block max of raw ``q . k`` times ``k_scale`` (docs/semantics.md, section 3), dense K.

    q ``[total_q, Hq, D]``, k ``[total_k, Hkv, D]``. Returns float64
    ``[total_q, Hq, NT]``, ``NT = max_k_tiles`` (default ``ceil(max kv_len / 128)``);
    blocks with no admissible key, and tiles past a request's blocks, are ``-inf``.
    ``k_scale`` (positive; the float8 max score's per-tensor scale, 1 for 16-bit inputs)
    multiplies the float64 block maxima.
    """
    q, k = _f64(q, "q"), _f64(k, "k")
    requests, nt = _dense_requests(q, k, cu_seqlens_q, cu_seqlens_k, qo_offset, max_k_tiles, qo_lens, kv_lens)
    res = np.full(q.shape[:2] + (nt,), -np.inf)
    for rows, keys, pos in requests:
        res[rows] = _block_max(q[rows], k[keys], pos, causal, None, nt)
    return _scaled(res, k_scale)


def _scaled(res: np.ndarray, k_scale) -> np.ndarray:
    k_scale = float(k_scale)
    if not (k_scale > 0.0 and np.isfinite(k_scale)):
        raise ValueError(f"k_scale must be positive and finite, got {k_scale}")
    if k_scale != 1.0:
        res *= k_scale
    return res


def _dense_requests(q, k, cu_seqlens_q, cu_seqlens_k, qo_offset, max_k_tiles, qo_lens, kv_lens) -> tuple:
    """Checked dense varlen requests: ``([(q rows, k rows, query positions)], NT)``, rows as
    slices; ``NT = max_k_tiles`` or ``ceil(max kv_len / 128)``."""
    _heads(q, k, "k", 1)
    starts, qlens = _rows(cu_seqlens_q, qo_lens, q.shape[0])
    cuk = _vector(cu_seqlens_k, "cu_seqlens_k", starts.shape[0] + 1)
    klens = np.diff(cuk) if kv_lens is None else _vector(kv_lens, "kv_lens", starts.shape[0])
    if np.any(klens < 0) or np.any(cuk[:-1] < 0) or np.any(cuk[:-1] + klens > k.shape[0]):
        raise ValueError(f"key rows out of range: cu_seqlens_k={cuk.tolist()}, total_k={k.shape[0]}")
    offs = _offsets(qo_offset, qlens, klens)
    nt = int(_ceil_div(int(klens.max(initial=0)), BLOCK)) if max_k_tiles is None else int(max_k_tiles)
    requests = [(slice(starts[b], starts[b] + qlens[b]), slice(cuk[b], cuk[b] + klens[b]),
                 offs[b] + np.arange(qlens[b])) for b in range(starts.shape[0])]
    return requests, nt


def block_softmax_mass(q, k, cu_seqlens_q, cu_seqlens_k, *, causal=True, sm_scale=None, qo_offset=None,
                       kv_lens=None, qo_lens=None, max_k_tiles=None):
    """Share of each query's dense softmax mass in each 128-key block, dense K.

    The attention of :func:`dense_attention` (same masks: bottom-right aligned causal
    positions, ``qo_offset``, ``kv_lens``; ``sm_scale`` default ``D ** -0.5``), with the
    probabilities of block ``t`` (keys ``128 t .. 128 t + 127`` of the request) summed:
    ``mass[i, h, t] = sum_{j in block t} softmax_j(q_i . k_j * sm_scale)``. A row sums to 1
    when the query attends any key and is 0 otherwise; blocks with no admissible key, and
    tiles past a request's blocks, are 0. The recall of a block selection
    ``sel [total_q, Hq, W]`` (e.g. from ``sparse_topk_select``) is
    ``sum_w mass[i, h, sel[i, h, w]]`` over its valid ids.

    q ``[total_q, Hq, D]``, k ``[total_k, Hkv, D]`` (``Hq % Hkv == 0``), any float dtype
    (computed in float64); ``cu_seqlens_q``/``cu_seqlens_k`` ``[B+1]``. Returns float64
    ``[total_q, Hq, NT]``, ``NT = max_k_tiles`` (default ``ceil(max kv_len / 128)``, the
    width of the max score).
    """
    q, k = _f64(q, "q"), _f64(k, "k")
    requests, nt = _dense_requests(q, k, cu_seqlens_q, cu_seqlens_k, qo_offset, max_k_tiles, qo_lens, kv_lens)
    scale = _resolve_scale(sm_scale, q.shape[2])
    res = np.zeros(q.shape[:2] + (nt,))
    for rows, keys, pos in requests:
        res[rows] = _block_mass(q[rows], k[keys], pos, causal, scale, nt)
    return res


def paged_block_max_score(q, k_cache, cu_seqlens_q, kv_lens, page_table, qo_offset=None, causal=True,
                          max_k_tiles=None, kv_layout="NHD", *, qo_lens=None, k_scale=1.0):
    """:func:`block_max_score` over a paged cache (any page size; invalid pages inadmissible)."""
    q = _f64(q, "q")
    kc = _nhd(_f64(k_cache, "k_cache"), kv_layout, "k_cache")
    total_q, hq, _ = q.shape
    _heads(q, kc, "k_cache", 2)
    starts, qlens = _rows(cu_seqlens_q, qo_lens, total_q)
    klens = _vector(kv_lens, "kv_lens", starts.shape[0])
    if np.any(klens < 0):
        raise ValueError(f"kv_lens must be non-negative, got {klens.tolist()}")
    table = _ints(page_table, "page_table")
    if table.ndim != 2 or table.shape[0] != starts.shape[0]:
        raise ValueError(f"page_table must have shape [B={starts.shape[0]}, max_pages], got {table.shape}")
    offs = _offsets(qo_offset, qlens, klens)
    nt = int(_ceil_div(int(klens.max(initial=0)), BLOCK)) if max_k_tiles is None else int(max_k_tiles)
    res = np.full((total_q, hq, nt), -np.inf)
    for b in range(starts.shape[0]):
        s0, n, nk = starts[b], qlens[b], int(klens[b])
        keys, ok = _gather_pages(kc, _request_pages(table, b, nk, kc.shape[1]), nk)
        res[s0:s0 + n] = _block_max(q[s0:s0 + n], keys, offs[b] + np.arange(n), causal, ok, nt)
    return _scaled(res, k_scale)


# ----------------------------------------------------------------------------- selection


def topk_select(max_score, topk, num_valid_pages=None, force_begin_blocks=0, force_end_blocks=0,
                force_blocks_count_in_topk=True, query_positions=None):
    """Top-k block selection (docs/semantics.md, section 4), exact.

    ``max_score [total_q, Hq, NT]``. Per row: valid blocks ``[0, V_i)`` with
    ``V = num_valid_pages or NT`` and, given ``query_positions`` (absolute positions),
    ``V_i = clamp(min(V, floor(pos_i / 128) + 1), 0)``. The first ``force_begin_blocks``
    and last ``force_end_blocks`` valid blocks are always chosen; the remaining
    ``W - |forced|`` slots go to the highest scores (ties: lower index; NaN below every
    number, -inf included). ``W = topk`` if ``force_blocks_count_in_topk`` else
    ``topk + begin + end``. Returns int32 ``[total_q, Hq, W]``: ids ascending, then -1.
    """
    with np.errstate(invalid="ignore"):  # NaN scores are valid input (they rank last)
        ms = np.asarray(to_host(max_score, "max_score")).astype(np.float64)
    if ms.ndim != 3:
        raise ValueError(f"max_score must have shape [total_q, Hq, NT], got {ms.shape}")
    total_q, hq, nt = ms.shape
    begin, end, topk = int(force_begin_blocks), int(force_end_blocks), int(topk)
    width = topk if force_blocks_count_in_topk else topk + begin + end
    valid = np.full(total_q, nt if num_valid_pages is None else int(num_valid_pages), dtype=np.int64)
    if query_positions is not None:
        qp = _vector(query_positions, "query_positions", total_q)
        valid = np.clip(np.minimum(valid, np.floor_divide(qp, BLOCK) + 1), 0, None)
    valid = np.minimum(valid, nt)[:, None, None]  # [total_q, 1, 1]
    blk = np.arange(nt)[None, None, :]
    forced = (blk < np.minimum(begin, valid)) | ((blk >= valid - end) & (blk < valid))
    # Class 0: forced, 1: competing valid block, 2: not valid. Within class 1 the best
    # score first (NaN after every number), then the lower index.
    cls = np.where(blk >= valid, 2, np.where(forced, 0, 1))
    cls = np.broadcast_to(cls, ms.shape)
    nan = np.isnan(ms)
    key = np.where(nan, 0.0, -ms)
    order = np.lexsort((np.broadcast_to(blk, ms.shape), key, nan, cls), axis=-1)
    take = order[..., :width]
    taken_cls = np.take_along_axis(cls, take, axis=-1)
    take = np.where(taken_cls == 2, np.iinfo(np.int64).max, take)
    take = np.sort(take, axis=-1)
    out = np.where(take == np.iinfo(np.int64).max, -1, take)
    if out.shape[-1] < width:  # fewer blocks than slots
        pad = np.full(out.shape[:-1] + (width - out.shape[-1],), -1)
        out = np.concatenate([out, pad], axis=-1)
    return out.astype(np.int32)


# ----------------------------------------------------------------------------- page tables


def page_table_from_csr(kv_indices, kv_lens, page_size):
    """Flat page ids (request-major) to an int32 table ``[B, max_pages]``, zero padded; ids
    beyond int32 saturate to its range (they stay outside every cache).

    Request ``b`` owns ``ceil(kv_lens[b] / page_size)`` consecutive entries of
    ``kv_indices``; their total must equal ``len(kv_indices)``.
    """
    page_size = int(page_size)
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    idx = _vector(kv_indices, "kv_indices")
    lens = _vector(kv_lens, "kv_lens")
    counts = _ceil_div(lens, page_size)
    total = int(counts.sum())
    if idx.shape[0] != total:
        raise ValueError(
            f"kv_indices does not match the page count implied by kv_lens: {idx.shape[0]} vs {total}"
        )
    idx = np.clip(idx, -2**31, 2**31 - 1)
    table = np.zeros((lens.shape[0], int(counts.max(initial=0))), dtype=np.int32)
    start = 0
    for b, c in enumerate(counts.tolist()):
        if c > 0:
            table[b, :c] = idx[start:start + c]
        start += max(c, 0)
    return table


def page_table_from_indptr(kv_indices, kv_page_indptr, width=None):
    """CSR (``kv_indices`` + ``kv_page_indptr [B+1]``) to an int32 table ``[B, width]``.

    Row ``b`` holds ``kv_indices[indptr[b]:indptr[b+1]]`` followed by ``-1`` (no page);
    ranges outside ``kv_indices`` are treated as no page.
    """
    idx = _vector(kv_indices, "kv_indices")
    ptr = _vector(kv_page_indptr, "kv_page_indptr")
    batch = max(ptr.shape[0] - 1, 0)
    counts = np.maximum(np.diff(ptr), 0) if batch else np.zeros(0, dtype=np.int64)
    w = int(counts.max(initial=0)) if width is None else int(width)
    table = np.full((batch, w), -1, dtype=np.int32)
    for b in range(batch):
        lo = int(ptr[b])
        for s in range(min(int(counts[b]), w)):
            if 0 <= lo + s < idx.shape[0]:
                table[b, s] = idx[lo + s]
    return table
