"""``build_page_table_from_flat_kv_indices``: flat (CSR) page ids to a padded page table.

Path: :func:`validate_page_table` -> :class:`PageTableProblem` -> the reference (host
arrays) or :func:`mate_cupy.util_ops.launch_build_page_table` (CUDA arrays).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._logging import mate_api
from ..checks import check_given
from ..reference import msa as ref
from ..runtime.interop import INT32, INT64, Arg, Call, dtype_name, to_host

__all__ = ["PageTableProblem", "build_page_table_from_flat_kv_indices", "validate_page_table"]


@dataclass(frozen=True, eq=False)
class PageTableProblem:
    """A validated build: ``batch`` requests, ``kv_lens`` and ``page_start`` (host int64
    ``[batch]`` / ``[batch + 1]``: lengths and the exclusive prefix of their page counts),
    a ``[batch, max_pages]`` result."""

    batch: int
    max_pages: int
    page_size: int
    kv_lens: np.ndarray
    page_start: np.ndarray


def validate_page_table(kv_indices: Arg, kv_lens, page_size: int) -> PageTableProblem:
    """Every condition of :func:`build_page_table_from_flat_kv_indices`, for host and CUDA
    ``kv_indices`` alike (``kv_lens`` is read on the host)."""
    page_size = int(page_size)
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if kv_indices.ndim != 1:
        raise ValueError(f"kv_indices must be a 1D array, got shape {kv_indices.shape}")
    if kv_indices.dtype.kind not in "iu":
        raise TypeError(f"kv_indices must be an integer array, got {dtype_name(kv_indices.dtype)}")
    lens = np.asarray(to_host(kv_lens, "kv_lens"))
    if lens.ndim != 1:
        raise ValueError(f"kv_lens must be a 1D array, got shape {lens.shape}")
    if lens.dtype.kind not in "iu":
        raise TypeError(f"kv_lens must be an integer array, got {dtype_name(lens.dtype)}")
    lens = lens.astype(np.int64)
    if np.any(lens < 0):
        raise ValueError(f"kv_lens must be non-negative, got {lens.tolist()}")
    counts = -(-lens // page_size)
    page_start = np.zeros(lens.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=page_start[1:])
    total = int(page_start[-1])
    if kv_indices.shape[0] != total:
        raise ValueError(
            f"kv_indices does not match the page count implied by kv_lens: {kv_indices.shape[0]} vs {total}"
        )
    return PageTableProblem(int(lens.shape[0]), int(counts.max(initial=0)), page_size, lens, page_start)


@mate_api
def build_page_table_from_flat_kv_indices(kv_indices, kv_lens, page_size: int):
    """``[B, max_pages]`` int32 page table from flat page ids.

    ``kv_indices [sum_b ceil(kv_lens[b] / page_size)]``: integer page ids, request-major
    (a list, or any 1-D integer array, strided allowed). ``kv_lens [B]``: non-negative
    integers, read on the host (this builder is an eager helper; a CUDA ``kv_lens`` is
    copied to the host). ``page_size > 0``. Row ``b`` holds request ``b``'s pages (ids
    converted to int32), then zeros; ``max_pages = max_b ceil(kv_lens[b] / page_size)``.
    Result on ``kv_indices``' device, in its framework (CUDA: on the caller's stream).
    """
    check_given("build_page_table_from_flat_kv_indices", kv_indices=kv_indices, kv_lens=kv_lens)
    if isinstance(kv_indices, (list, tuple)):
        kv_indices = np.asarray(kv_indices, dtype=np.int64)
    call = Call(kv_indices=kv_indices)
    idx = call["kv_indices"]
    problem = validate_page_table(idx, kv_lens, page_size)
    if not call.is_cuda:
        return call.export(ref.page_table_from_csr(idx.data, problem.kv_lens, problem.page_size), dtype=INT32)
    from ..util_ops import launch_build_page_table

    table = call.new("page_table", (problem.batch, problem.max_pages), INT32)
    if problem.batch and problem.max_pages:
        from cupy.cuda import runtime

        start = call.new("page_start", (problem.batch + 1,), INT64)
        with call.device_scope():
            stream = call.stream_ptr
            runtime.memcpyAsync(start.ptr, problem.page_start.ctypes.data, problem.page_start.nbytes,
                                runtime.memcpyHostToDevice, stream)
            launch_build_page_table(idx, start, table, stream)
    return table.obj
