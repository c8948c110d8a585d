"""Per-call length metadata of one MSA plan: the plan's own vectors or ``MsaRuntimeMetadata``.

:func:`resolve_lengths` is the part of the MSA validation that checks and collects the
length vectors of one plan for one call, as :class:`~mate_cupy.runtime.interop.Arg` views
on the call's device. Runtime metadata is used exactly as given: its checks read only
dtype, rank, shape, device and contiguity, never the values, so static plans make no host
read and no copy. Eager plans without metadata use their host vectors (host path) or
their uploaded device vectors (CUDA path; never copied during a call).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..checks import where
from ..runtime.interop import INT32, Arg, Call, dtype_name, is_array, wrap
from .plan import MsaPlan, MsaRuntimeMetadata, plan_page_width

__all__ = ["Lengths", "resolve_lengths", "runtime_page_table"]


class Lengths:
    """Length vectors of one plan for one call (int32 ``Arg`` views on the call's device).

    ``seqused_k`` is None when each request reads all of its ``kv_lens`` keys;
    ``page_table``/``kv_page_indptr`` are the runtime page indirection (or the eager
    plan's CSR offsets), None when absent. ``from_runtime``: the vectors came from
    :class:`MsaRuntimeMetadata` (their values are not known on the host).
    """

    __slots__ = ("qo_lens", "kv_lens", "qo_offset", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table",
                 "kv_page_indptr", "from_runtime")

    def __init__(self, qo_lens, kv_lens, qo_offset, cu_seqlens_q, cu_seqlens_k, seqused_k=None, page_table=None,
                 kv_page_indptr=None, from_runtime=False):
        self.qo_lens, self.kv_lens, self.qo_offset = qo_lens, kv_lens, qo_offset
        self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_k = cu_seqlens_q, cu_seqlens_k, seqused_k
        self.page_table, self.kv_page_indptr, self.from_runtime = page_table, kv_page_indptr, from_runtime

    @property
    def keys_read(self) -> Arg:
        """The per-request key counts the kernels take: ``seqused_k`` when given, else ``kv_lens``."""
        return self.kv_lens if self.seqused_k is None else self.seqused_k

    def effective_kv_lens(self) -> np.ndarray:
        """Keys each request may read: ``min(kv_lens, seqused_k)`` (host arrays only)."""
        if self.seqused_k is None:
            return self.kv_lens.data
        return np.minimum(self.kv_lens.data, self.seqused_k.data)


def _runtime_array(name: str, obj, *, ndim: int, layout: str) -> Arg:
    if not is_array(obj):
        raise TypeError(f"runtime {name} must be an array (NumPy, CuPy, torch, JAX), got {type(obj).__name__}")
    arg = wrap(f"runtime {name}", obj)
    if arg.dtype != INT32 or arg.ndim != ndim:
        raise TypeError(
            f"runtime {name} must be a contiguous rank-{ndim} int32 tensor {layout}, got "
            f"dtype={dtype_name(arg.dtype)}, shape={arg.shape}"
        )
    return arg


def _check_placement(name: str, arg: Arg, device: int) -> None:
    if arg.device != device:
        raise ValueError(
            f"runtime {name} must be on {where(device)}, got {where(arg.device)}; "
            "mate_cupy does not copy static-plan metadata during execution"
        )
    if not arg.is_contiguous():
        raise ValueError(f"runtime {name} must be contiguous")


def _runtime_vector(name: str, obj, *, length: int, device: int) -> Arg:
    arg = _runtime_array(name, obj, ndim=1, layout=f"[{length}]")
    if arg.shape[0] != length:
        raise ValueError(f"runtime {name} must have length {length}, got {arg.shape[0]}")
    _check_placement(name, arg, device)
    return arg


def runtime_page_table(name: str, obj, *, batch_size: int, max_pages: int, device: int) -> Arg:
    """A ``[B, max_pages]`` int32 page table checked like runtime metadata."""
    arg = _runtime_array(name, obj, ndim=2, layout="[B, max_pages]")
    expected = (int(batch_size), int(max_pages))
    if arg.shape != expected:
        raise ValueError(f"runtime {name} must have shape {expected}, got {arg.shape}")
    _check_placement(name, arg, device)
    return arg


def _cu(call: Call, lengths: Arg) -> Arg:
    """Exclusive prefix sum ``[B+1]`` int32 of ``lengths`` (allocates: eager convenience only)."""
    n = lengths.shape[0]
    if call.is_cuda:
        import cupy

        with call.launch_scope():
            cu = cupy.zeros(n + 1, dtype=cupy.int32)
            if n:
                cupy.cumsum(lengths.data, dtype=cupy.int32, out=cu[1:])
    else:
        cu = np.zeros(n + 1, dtype=np.int32)
        if n:
            cu[1:] = np.cumsum(lengths.data, dtype=np.int64)
    return wrap("cu_seqlens", cu)


def not_uploaded(fn: str, device: int) -> ValueError:
    return ValueError(
        f"{fn}: the eager plan's vectors are not on cuda:{device}; plans never copy them during a call. "
        f"Build the plan with device=... (or CUDA lengths), or call plan.upload(device={device}) / "
        f"mate_cupy.upload_plan(plan_info, device={device}) first"
    )


def _plan_vectors(fn: str, plan: MsaPlan, call: Call):
    vec = plan.device_vectors
    if vec is None or vec.device != call.device:
        raise not_uploaded(fn, call.device)
    return vec


def resolve_lengths(fn: str, plan: MsaPlan, runtime_metadata: Optional[MsaRuntimeMetadata], call: Call) -> Lengths:
    """Length vectors for ``plan`` on ``call``'s device (no host read of device data)."""
    if runtime_metadata is None:
        if plan.is_static:
            raise ValueError(
                "static MSA plans require runtime_metadata with device-resident "
                "qo_lens, kv_lens, qo_offset, and cumulative lengths"
            )
        if call.is_cuda:
            v = _plan_vectors(fn, plan, call)
            if v.lengths is None:
                v.lengths = Lengths(v.qo_lens, v.kv_lens, v.qo_offset, v.cu_seqlens_q, v.cu_seqlens_k,
                                    kv_page_indptr=v.kv_page_indptr)
            return v.lengths
        host = {name: plan.host_vector(name) for name in
                ("qo_lens", "kv_lens", "qo_offset", "cu_seqlens_q", "cu_seqlens_k", "kv_page_indptr")}
        return Lengths(**{name: None if h is None else wrap(name, h) for name, h in host.items()})
    if not isinstance(runtime_metadata, MsaRuntimeMetadata):
        raise TypeError(
            f"runtime_metadata must be an MsaRuntimeMetadata instance, got {type(runtime_metadata).__name__}"
        )
    md, batch, device = runtime_metadata, plan.batch_size, call.device
    qo_lens = _runtime_vector("qo_lens", md.qo_lens, length=batch, device=device)
    kv_lens = _runtime_vector("kv_lens", md.kv_lens, length=batch, device=device)
    qo_offset = _runtime_vector("qo_offset", md.qo_offset, length=batch, device=device)
    if plan.is_static and md.cu_seqlens_q is None:
        raise ValueError(
            "static MSA runtime_metadata requires cu_seqlens_q to avoid allocating cumulative lengths during execution"
        )
    if plan.is_static and md.cu_seqlens_k is None:
        raise ValueError(
            "static MSA runtime_metadata requires cu_seqlens_k to avoid allocating cumulative lengths during execution"
        )
    if plan.is_static and md.seqused_k is None:
        raise ValueError(
            "static MSA runtime_metadata requires seqused_k to avoid deriving per-request lengths during execution"
        )
    cu_q = (_cu(call, qo_lens) if md.cu_seqlens_q is None
            else _runtime_vector("cu_seqlens_q", md.cu_seqlens_q, length=batch + 1, device=device))
    cu_k = (_cu(call, kv_lens) if md.cu_seqlens_k is None
            else _runtime_vector("cu_seqlens_k", md.cu_seqlens_k, length=batch + 1, device=device))
    seqused = None if md.seqused_k is None else _runtime_vector("seqused_k", md.seqused_k, length=batch,
                                                                 device=device)
    table = indptr = None
    if md.page_table is not None:
        if md.kv_page_indptr is not None:
            raise ValueError("runtime_metadata.page_table and kv_page_indptr are mutually exclusive")
        table = runtime_page_table("page_table", md.page_table, batch_size=batch, max_pages=plan_page_width(plan),
                                   device=device)
    elif md.kv_page_indptr is not None:
        indptr = _runtime_vector("kv_page_indptr", md.kv_page_indptr, length=batch + 1, device=device)
    elif plan.kv_page_indptr is not None and not plan.is_static:
        indptr = (_plan_vectors(fn, plan, call).kv_page_indptr if call.is_cuda
                  else wrap("kv_page_indptr", plan.kv_page_indptr))
    return Lengths(qo_lens, kv_lens, qo_offset, cu_q, cu_k, seqused_k=seqused, page_table=table,
                   kv_page_indptr=indptr, from_runtime=True)
