"""Random MSA problems shared by the CPU and GPU tests (host NumPy arrays).

A :class:`Problem` keeps the dense K/V of every request next to a shuffled page pool
holding the same keys, so each paged/sparse result can be checked against the dense
float64 reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import ml_dtypes
import numpy as np

BLOCK = 128
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


@dataclass
class Problem:
    qo: np.ndarray
    kv: np.ndarray
    q: np.ndarray  # [total_q, Hq, D]
    k: np.ndarray  # [total_k, Hkv, D] dense
    v: np.ndarray
    cu_q: np.ndarray
    cu_k: np.ndarray
    page_size: int = 0
    layout: str = "NHD"
    k_cache: Optional[np.ndarray] = None
    v_cache: Optional[np.ndarray] = None
    page_table: Optional[np.ndarray] = None  # [B, max_pages] int32, -1 padded
    kv_indices: Optional[np.ndarray] = None  # flat CSR page ids, int32

    @property
    def hq(self) -> int:
        return self.q.shape[1]

    @property
    def hkv(self) -> int:
        return self.k.shape[1]

    @property
    def total_q(self) -> int:
        return self.q.shape[0]


def make_problem(rng, qo, kv, hq, hkv, d, dtype=BF16, page_size=0, layout="NHD", extra_pages=2) -> Problem:
    qo, kv = np.asarray(qo, np.int32), np.asarray(kv, np.int32)
    cu_q = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    scale = 1.0 if dtype != FP8 else 2.0
    q = (rng.standard_normal((int(cu_q[-1]), hq, d)) * scale).astype(dtype)
    k = (rng.standard_normal((int(cu_k[-1]), hkv, d)) * scale).astype(dtype)
    v = (rng.standard_normal((int(cu_k[-1]), hkv, d)) * scale).astype(dtype)
    p = Problem(qo, kv, q, k, v, cu_q, cu_k)
    if page_size:
        paginate(rng, p, page_size, layout, extra_pages)
    return p


def paginate(rng, p: Problem, page_size: int, layout: str = "NHD", extra_pages: int = 2) -> None:
    counts = -(-p.kv.astype(np.int64) // page_size)
    n_pages = int(counts.sum()) + extra_pages
    perm = rng.permutation(n_pages).astype(np.int32)
    shape = (n_pages, page_size, p.hkv, p.k.shape[2])
    kc = (rng.standard_normal(shape)).astype(p.k.dtype)  # garbage in unused slots
    vc = (rng.standard_normal(shape)).astype(p.k.dtype)
    table = np.full((len(p.kv), max(int(counts.max(initial=0)), 1)), -1, dtype=np.int32)
    flat, nxt = [], 0
    for b, c in enumerate(counts):
        for s in range(int(c)):
            pid = perm[nxt]
            nxt += 1
            table[b, s] = pid
            flat.append(pid)
            lo = p.cu_k[b] + s * page_size
            hi = min(p.cu_k[b + 1], lo + page_size)
            kc[pid, : hi - lo] = p.k[lo:hi]
            vc[pid, : hi - lo] = p.v[lo:hi]
    if layout == "HND":
        kc, vc = np.ascontiguousarray(kc.transpose(0, 2, 1, 3)), np.ascontiguousarray(vc.transpose(0, 2, 1, 3))
    p.page_size, p.layout = page_size, layout
    p.k_cache, p.v_cache = kc, vc
    p.page_table, p.kv_indices = table, np.asarray(flat, dtype=np.int32)


def random_selection(rng, p: Problem, width: int, heads: Optional[int] = None, offsets=None) -> np.ndarray:
    """Unique block ids per (query, head) row, ascending, -1 padded; causal-valid blocks only."""
    heads = p.hkv if heads is None else heads
    offs = (p.kv - p.qo) if offsets is None else np.asarray(offsets)
    sel = np.full((p.total_q, heads, width), -1, dtype=np.int32)
    for b in range(len(p.qo)):
        nblk = -(-int(p.kv[b]) // BLOCK)
        for i in range(int(p.qo[b])):
            row = p.cu_q[b] + i
            reach = min(nblk, max(0, (int(offs[b]) + i) // BLOCK + 1))
            for h in range(heads):
                c = min(reach, int(rng.integers(0, width + 1)))
                if c:
                    sel[row, h, :c] = np.sort(rng.choice(reach, size=c, replace=False))
    return sel


def offsets_of(p: Problem, qo_offset=None) -> np.ndarray:
    if qo_offset is None:
        return (p.kv - p.qo).astype(np.int64)
    if isinstance(qo_offset, (int, np.integer)):
        return np.full(len(p.qo), int(qo_offset))
    return np.asarray(qo_offset, dtype=np.int64)
