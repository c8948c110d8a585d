"""``build_page_table_from_flat_kv_indices``: flat (CSR) page ids to a padded page table."""
from __future__ import annotations

import numpy as np

from .._interop import INT32, Call, dtype_name, to_host
from .._logging import mate_api
from ..reference import msa as ref

__all__ = ["build_page_table_from_flat_kv_indices"]


@mate_api
def build_page_table_from_flat_kv_indices(kv_indices, kv_lens, page_size: int):
    """``[B, max_pages]`` int32 page table from flat page ids.

    ``kv_indices [sum_b ceil(kv_lens[b] / page_size)]`` integer page ids, request-major;
    ``kv_lens [B]`` integer (read on the host: this builder is an eager helper). Row ``b``
    holds request ``b``'s pages, then zeros. Result on ``kv_indices``' device and framework.
    """
    page_size = int(page_size)
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if isinstance(kv_indices, (list, tuple)):
        kv_indices = np.asarray(kv_indices, dtype=np.int64)
    call = Call(kv_indices=kv_indices)
    idx = call["kv_indices"]
    if idx.ndim != 1:
        raise ValueError(f"kv_indices must be a 1D tensor, got shape {idx.shape}")
    if idx.dtype.kind not in "iu":
        raise TypeError(f"kv_indices must be an integer array, got {dtype_name(idx.dtype)}")
    lens = np.asarray(to_host(kv_lens, "kv_lens"))
    if lens.ndim != 1:
        raise ValueError(f"kv_lens must be a 1D tensor, got shape {lens.shape}")
    if lens.dtype.kind not in "iu":
        raise TypeError(f"kv_lens must be an integer array, got {lens.dtype}")
    if np.any(lens < 0):
        raise ValueError(f"kv_lens must be non-negative, got {lens.tolist()}")
    counts = -(-lens.astype(np.int64) // page_size)
    total = int(counts.sum())
    if idx.shape[0] != total:
        raise ValueError(f"kv_indices does not match the page count implied by kv_lens: {idx.shape[0]} vs {total}")
    if not call.is_cuda:
        return call.export(ref.page_table_from_csr(idx.data, lens, page_size), dtype=INT32)
    import cupy

    from ..util_kernels import build_page_table_cuda

    with call.launch_scope():
        dev_idx = cupy.ascontiguousarray(idx.data, dtype=cupy.int32)
        dev_lens = cupy.asarray(lens.astype(np.int32))
    table = build_page_table_cuda(call, dev_idx, dev_lens, int(lens.shape[0]), int(counts.max(initial=0)), page_size)
    return call.export(table, dtype=INT32)
