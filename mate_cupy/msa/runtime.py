"""Per-call length metadata of one MSA plan: the plan's own vectors or ``MsaRuntimeMetadata``.

:func:`resolve_lengths` returns backend arrays on the call's device (NumPy on the host,
CuPy on CUDA). Runtime metadata is used exactly as given: its checks read only dtype,
rank, shape, device and contiguity, never the values, so static plans make no host read
and no copy. Eager plans without metadata use their host vectors (host path) or the
device copies cached on the plan (CUDA path).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .. import _launch_cache as lc
from .._interop import INT32, Call, dtype_name, is_array, wrap
from .._validate import where
from .plan import MsaPlan, MsaRuntimeMetadata, plan_page_width

__all__ = ["Lengths", "resolve_lengths", "runtime_page_table"]


@dataclass
class Lengths:
    """Length vectors of one plan for one call (int32 backend arrays on the call's device).

    ``seqused_k`` is None when each request reads all of its ``kv_lens`` keys (the
    causal mask then limits what is admissible); ``page_table``/``kv_page_indptr`` are the
    runtime page indirection (or the eager plan's CSR offsets), None when absent.
    """

    qo_lens: Any
    kv_lens: Any
    qo_offset: Any
    cu_seqlens_q: Any
    cu_seqlens_k: Any
    seqused_k: Optional[Any] = None
    page_table: Optional[Any] = None
    kv_page_indptr: Optional[Any] = None
    from_runtime: bool = False

    def effective_kv_lens(self):
        """Keys each request may read: ``min(kv_lens, seqused_k)`` (host arrays only)."""
        if self.seqused_k is None:
            return self.kv_lens
        return np.minimum(self.kv_lens, self.seqused_k)


def _runtime_array(name: str, obj, *, ndim: int, layout: str, device: int):
    if not is_array(obj):
        raise TypeError(
            f"runtime {name} must be an array (NumPy, CuPy, torch, JAX), got {type(obj).__name__}"
        )
    arg = wrap(f"runtime {name}", obj)
    if arg.dtype != INT32 or arg.ndim != ndim:
        raise TypeError(
            f"runtime {name} must be a contiguous rank-{ndim} int32 tensor {layout}, got "
            f"dtype={dtype_name(arg.dtype)}, shape={arg.shape}"
        )
    return arg


def _check_placement(name: str, arg, device: int) -> None:
    if arg.device != device:
        raise ValueError(
            f"runtime {name} must be on {where(device)}, got {where(arg.device)}; "
            "mate_cupy does not copy static-plan metadata during execution"
        )
    if not arg.is_contiguous():
        raise ValueError(f"runtime {name} must be contiguous")


def _runtime_vector(name: str, obj, *, length: int, device: int):
    arg = _runtime_array(name, obj, ndim=1, layout=f"[{length}]", device=device)
    if arg.shape[0] != length:
        raise ValueError(f"runtime {name} must have length {length}, got {arg.shape[0]}")
    _check_placement(name, arg, device)
    lc.note_arg("md." + name, arg.data)
    return arg.data


def runtime_page_table(name: str, obj, *, batch_size: int, max_pages: int, device: int):
    """A caller's ``[B, max_pages]`` int32 page table checked like runtime metadata."""
    arg = _runtime_array(name, obj, ndim=2, layout="[B, max_pages]", device=device)
    expected = (int(batch_size), int(max_pages))
    if arg.shape != expected:
        raise ValueError(f"runtime {name} must have shape {expected}, got {arg.shape}")
    _check_placement(name, arg, device)
    lc.note_arg("md." + name, arg.data)
    return arg.data


def _cu(lengths, is_cuda: bool):
    """Exclusive prefix sum ``[B+1]`` int32 (allocates; eager convenience only)."""
    if is_cuda:
        import cupy

        cu = cupy.zeros(lengths.shape[0] + 1, dtype=cupy.int32)
        if lengths.shape[0]:
            cupy.cumsum(lengths, dtype=cupy.int32, out=cu[1:])
        return cu
    cu = np.zeros(lengths.shape[0] + 1, dtype=np.int32)
    if lengths.shape[0]:
        cu[1:] = np.cumsum(lengths, dtype=np.int64)
    return cu


def _plan_vector(plan: MsaPlan, name: str, call: Call):
    if call.is_cuda:
        with call.launch_scope():
            vec = plan.device_vector(name, call.device)
        lc.note_const(vec)  # cached on the plan, which a recorded launch keeps alive
        return vec
    return plan.host_vector(name)


def resolve_lengths(plan: MsaPlan, runtime_metadata: Optional[MsaRuntimeMetadata], call: Call) -> Lengths:
    """Length vectors for ``plan`` on ``call``'s device (no host read of device data)."""
    if runtime_metadata is None:
        if plan.is_static:
            raise ValueError(
                "static MSA plans require runtime_metadata with device-resident "
                "qo_lens, kv_lens, qo_offset, and cumulative lengths"
            )
        return Lengths(
            qo_lens=_plan_vector(plan, "qo_lens", call),
            kv_lens=_plan_vector(plan, "kv_lens", call),
            qo_offset=_plan_vector(plan, "qo_offset", call),
            cu_seqlens_q=_plan_vector(plan, "cu_seqlens_q", call),
            cu_seqlens_k=_plan_vector(plan, "cu_seqlens_k", call),
            kv_page_indptr=_plan_vector(plan, "kv_page_indptr", call) if plan.kv_page_indptr is not None else None,
        )
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
    with call.launch_scope():
        cu_q = (_cu(qo_lens, call.is_cuda) if md.cu_seqlens_q is None
                else _runtime_vector("cu_seqlens_q", md.cu_seqlens_q, length=batch + 1, device=device))
        cu_k = (_cu(kv_lens, call.is_cuda) if md.cu_seqlens_k is None
                else _runtime_vector("cu_seqlens_k", md.cu_seqlens_k, length=batch + 1, device=device))
    if md.kv_page_indptr is not None:
        indptr = _runtime_vector("kv_page_indptr", md.kv_page_indptr, length=batch + 1, device=device)
    elif plan.kv_page_indptr is not None and not plan.is_static:
        indptr = _plan_vector(plan, "kv_page_indptr", call)
    else:
        indptr = None
    if md.seqused_k is None:
        if plan.is_static:
            raise ValueError(
                "static MSA runtime_metadata requires seqused_k to avoid deriving per-request "
                "lengths during execution"
            )
        seqused = None
    else:
        seqused = _runtime_vector("seqused_k", md.seqused_k, length=batch, device=device)
    table = None
    if md.page_table is not None:
        table = runtime_page_table("page_table", md.page_table, batch_size=batch,
                                   max_pages=plan_page_width(plan), device=device)
        if md.kv_page_indptr is not None:
            raise ValueError("runtime_metadata.page_table and kv_page_indptr are mutually exclusive")
        indptr = None
    return Lengths(qo_lens=qo_lens, kv_lens=kv_lens, qo_offset=qo_offset, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                   seqused_k=seqused, page_table=table, kv_page_indptr=indptr, from_runtime=True)
