"""Execution of MSA plans: operand checks, the decode+prefill split, dispatch per part.

:func:`run_plan` is the one engine behind ``msa``, ``sparse_msa`` and
``sparse_decode_atten_func``. It validates everything first (every part of a mixed
plan, both passes), then runs: NumPy inputs through the float64 references
(:mod:`mate_cupy.reference.msa`), CUDA inputs through the launchers
(:mod:`mate_cupy.msa.kernels`).

Layouts: ``q [total_q, Hq, D]``; dense ``k, v [total_k, Hkv, D]``; paged ``k, v``
``[num_pages, page_size, Hkv, D]`` (NHD) or ``[num_pages, Hkv, page_size, D]`` (HND),
passed to the kernels as they are (no copy); ``out [total_q, Hq, D]`` (q's dtype,
bfloat16 for fp8); ``lse [total_q, Hq]`` float32; ``max_score [total_q, Hq, NT]`` float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from .. import _launch_cache as lc
from .._interop import BFLOAT16, FLOAT16, FLOAT32, FP8_E4M3, INT32, Call, dtype_name
from ..reference import msa as ref
from . import kernels
from .plan import SPARSE_BLOCK_SIZE, MsaPlan, MsaRuntimeMetadata, max_k_tiles, plan_page_width
from .runtime import Lengths, resolve_lengths

__all__ = ["run_plan"]

FWD_DTYPES = (FLOAT16, BFLOAT16, FP8_E4M3)
SPARSE_GQA_RATIOS = (8, 16)
SPARSE_HEAD_DIM = 128


# ----------------------------------------------------------------------------- small helpers


def _as_array(obj):
    """Python lists/tuples become host arrays; arrays pass through."""
    if isinstance(obj, (list, tuple)):
        return np.asarray(obj)
    return obj


def _host(a) -> Optional[np.ndarray]:
    if a is None:
        return None
    if isinstance(a, np.ndarray):
        return a
    return a.get()  # CuPy: explicit device-to-host copy (checked mode / eager host data only)


def _int32(call: Call, a):
    """Backend int array -> contiguous int32 (no copy when it already is)."""
    if a is None:
        return None
    if a.dtype == np.int32 and a.flags.c_contiguous:
        return a
    if call.is_cuda:
        import cupy

        with call.launch_scope():
            return cupy.ascontiguousarray(a, dtype=cupy.int32)
    return np.ascontiguousarray(a, dtype=np.int32)


def _ceil_div(a, b):
    return -(-a // b)


def _kv_layout(call: Call, name: str, plan: MsaPlan) -> str:
    """Detect the paged layout of ``name``: NHD ``[P, page, Hkv, D]`` or HND ``[P, Hkv, page, D]``."""
    arg = call[name]
    if arg.ndim != 4:
        raise ValueError(f"{name} must be a 4D paged tensor, got shape {arg.shape}")
    _, a, b, _ = arg.shape
    if a == plan.page_size and b == plan.num_kv_heads:
        return "NHD"  # also the choice when page_size == num_kv_heads
    if a == plan.num_kv_heads and b == plan.page_size:
        return "HND"
    raise ValueError(
        f"{name} must use [pages, page, H, D] (NHD) or [pages, H, page, D] (HND) layout with "
        f"page={plan.page_size}, H={plan.num_kv_heads}, got shape {arg.shape}"
    )


# ----------------------------------------------------------------------------- operands


@dataclass
class _Ctx:
    """Checked, call-wide facts."""

    call: Call
    dtype: np.dtype
    out_dtype: np.dtype
    is_fp8: bool
    kv_layout: Optional[str]
    sm_scale: float
    k_scale: float
    v_scale: float
    runtime_metadata: Any
    check: bool


@dataclass
class _Part:
    """Arrays of one plan of the call (row/page slices of the call's arrays for mixed plans)."""

    plan: MsaPlan
    q: Any
    k: Any
    v: Any
    out: Any = None
    lse: Any = None
    max_score: Any = None
    kv_indices: Any = None
    page_table: Any = None
    kv_block_indexes: Any = None
    q_offset_override: Any = None


def _check_qkv(call: Call, plans: list, sparse_attention: bool) -> tuple:
    """q/k/v ranks, dtypes, head counts; returns ``(dtype, kv_layout)``."""
    first = plans[0]
    q, k, v = call["q"], call["k"], call["v"]
    if q.ndim != 3:
        raise ValueError(f"q must have shape [total_q, Hq, D], got {q.shape}")
    if sparse_attention or call.is_cuda:
        allowed = FWD_DTYPES
    else:
        allowed = FWD_DTYPES + (FLOAT32,)  # float32 runs on the host reference path only
    if q.dtype not in allowed:
        names = ", ".join(dtype_name(d) for d in allowed)
        where_ = "" if sparse_attention or not call.is_cuda else " on CUDA"
        raise TypeError(f"MSA forward supports {names}{where_}; got q dtype {dtype_name(q.dtype)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            "q, k, and v must share the same dtype, got "
            f"{dtype_name(q.dtype)}, {dtype_name(k.dtype)}, {dtype_name(v.dtype)}"
        )
    if q.shape[1] != first.num_qo_heads:
        raise ValueError(f"q head count {q.shape[1]} does not match plan.num_qo_heads {first.num_qo_heads}")
    d = q.shape[2]
    if first.mode == "dense":
        layout = None
        for name in ("k", "v"):
            a = call[name]
            if a.ndim != 3:
                raise ValueError(f"{name} must have shape [total_k, Hkv, D] for a dense plan, got {a.shape}")
            if a.shape[1] != first.num_kv_heads:
                raise ValueError(
                    f"{name} head count {a.shape[1]} does not match plan.num_kv_heads {first.num_kv_heads}"
                )
    else:
        layout = _kv_layout(call, "k", first)
        if _kv_layout(call, "v", first) != layout:
            raise ValueError(f"k and v must use the same paged layout, got shapes {k.shape} and {v.shape}")
    for name in ("k", "v"):
        if call[name].shape[-1] != d:
            raise ValueError(f"{name} head dim {call[name].shape[-1]} does not match q head dim {d}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    return q.dtype, layout


def _check_output(call: Call, name: str, shape: tuple, dtype: np.dtype, layout: str):
    arg = call[name]
    if arg.dtype != dtype:
        raise TypeError(f"{name} must be {dtype_name(dtype)}, got {dtype_name(arg.dtype)}")
    if arg.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {layout} = {tuple(shape)}, got {arg.shape}")
    if not arg.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return arg.data


def _check_max_score_buffer(call: Call, total_q: int, hq: int, nt: int):
    arg = call["max_score"]
    if arg.dtype != FLOAT32:
        raise TypeError(f"max_score must be float32, got {dtype_name(arg.dtype)}")
    if arg.ndim != 3 or arg.shape[:2] != (total_q, hq) or arg.shape[2] < nt:
        raise ValueError(
            f"max_score must have shape [total_q, Hq, max_k_tiles] = ({total_q}, {hq}, {nt}) "
            f"(a wider last dim is allowed), got {arg.shape}"
        )
    if not arg.is_contiguous():
        raise ValueError("max_score must be contiguous")
    return arg.data


def _check_block_indexes(call: Call, plan: MsaPlan, total_q: int):
    """``kv_block_indexes [total_q, Hkv or Hq, W]`` int32 -> backend ``[total_q, Hkv, W]``."""
    arg = call["kv_block_indexes"]
    hq, hkv = plan.num_qo_heads, plan.num_kv_heads
    if arg.dtype != INT32:
        raise TypeError(f"kv_block_indexes must be int32, got {dtype_name(arg.dtype)}")
    if arg.ndim != 3:
        raise ValueError(f"kv_block_indexes must have shape [total_q, Hkv or Hq, topK], got {arg.shape}")
    if arg.shape[0] != total_q:
        raise ValueError(f"kv_block_indexes total_q dimension mismatch: {arg.shape[0]} vs {total_q}")
    width = plan.selected_block_count
    if plan.kv_block_num > 0 and arg.shape[2] != width:
        raise ValueError(f"kv_block_indexes selected-block width mismatch: {arg.shape[2]} vs {width}")
    data = arg.data
    if arg.shape[1] == hkv:
        pass
    elif arg.shape[1] == hq:
        data = data[:, :: hq // hkv, :]
    else:
        raise ValueError(
            "kv_block_indexes head dimension must match num_kv_heads or num_qo_heads, "
            f"got {arg.shape[1]}, num_kv_heads={hkv}, num_qo_heads={hq}"
        )
    return _int32(call, data)


def _check_sparse_plan(ctx: _Ctx, plan: MsaPlan, q_shape: tuple) -> None:
    """The sparse forward's limits (the seed's): one KV split, D = 128, Hq/Hkv in {8, 16}."""
    if plan.num_kv_splits > 1:
        raise ValueError(f"MSA forward currently requires num_kv_splits <= 1, got {plan.num_kv_splits}")
    if q_shape[2] != SPARSE_HEAD_DIM:
        raise ValueError(f"q must have shape [total_q, Hq, {SPARSE_HEAD_DIM}] for sparse MSA, got {q_shape}")
    ratio = plan.num_qo_heads // plan.num_kv_heads
    if ratio not in SPARSE_GQA_RATIOS:
        raise ValueError(f"sparse MSA forward requires a Hq/Hkv ratio in {SPARSE_GQA_RATIOS}, got {ratio}")
    if plan.page_size != SPARSE_BLOCK_SIZE or plan.sparse_block_size != SPARSE_BLOCK_SIZE:
        raise ValueError(f"MSA forward currently requires page/block size {SPARSE_BLOCK_SIZE}")


# ----------------------------------------------------------------------------- per-part pieces


def _offsets(ctx: _Ctx, plan: MsaPlan, lens: Lengths, override):
    """The per-request offsets of this call: runtime/plan offsets, or ``q_offset_override``."""
    if override is None:
        return lens.qo_offset
    if ctx.runtime_metadata is not None:
        raise ValueError("q_offset_override cannot be combined with runtime_metadata.qo_offset")
    call, batch = ctx.call, plan.batch_size
    if isinstance(override, (int, np.integer)):
        if call.is_cuda:
            import cupy

            with call.launch_scope():
                return cupy.full(batch, int(override), dtype=cupy.int32)
        return np.full(batch, int(override), dtype=np.int32)
    if override.dtype.kind not in "iu":
        raise TypeError(f"q_offset_override must be an int or an integer array, got dtype {override.dtype}")
    if override.ndim != 1:
        raise ValueError(f"qo_offset must be a 1D tensor, got shape {tuple(override.shape)}")
    if override.shape[0] != batch:
        raise ValueError(
            f"qo_offset must have the same shape as qo_segment_lens, got {tuple(override.shape)} vs ({batch},)"
        )
    return _int32(call, override)


def _page_source(ctx: _Ctx, part: _Part, lens: Lengths, *, what: str, exact_count: bool):
    """Page indirection for a paged/sparse part: ``(page_table, kv_indices, kv_page_indptr)``."""
    call, plan = ctx.call, part.plan
    table = part.page_table
    if lens.page_table is not None:
        if table is not None:
            raise ValueError("page_table argument and runtime_metadata.page_table are mutually exclusive")
        return lens.page_table, None, None
    if table is not None:
        if table.dtype.kind not in "iu":
            raise TypeError(f"page_table must be an integer array, got dtype {table.dtype}")
        if table.ndim != 2:
            raise ValueError(f"page_table must be rank 2 [B, max_pages], got shape {tuple(table.shape)}")
        if table.shape[0] != plan.batch_size:
            raise ValueError(f"page_table must have {plan.batch_size} rows (one per request), got {table.shape[0]}")
        return _int32(call, table), None, None
    kv_indices = part.kv_indices
    if kv_indices is None:
        raise ValueError(f"{what} requires kv_indices or page_table")
    if kv_indices.dtype.kind not in "iu":
        raise TypeError(f"kv_indices must be an integer array, got dtype {kv_indices.dtype}")
    if kv_indices.ndim != 1:
        raise ValueError(f"kv_indices must be a 1D tensor, got shape {tuple(kv_indices.shape)}")
    kv_indices = _int32(call, kv_indices)
    indptr = lens.kv_page_indptr
    if indptr is None:
        if plan.is_sparse or what.startswith("paged MSA maxscore"):
            raise ValueError(f"{what} plan is missing kv_page_indptr (pass runtime_metadata.kv_page_indptr)")
        # Paged attention with runtime lengths and no CSR offsets: derive them (allocates).
        xp = call.xp
        with call.launch_scope():
            counts = (lens.kv_lens.astype(xp.int64) + plan.page_size - 1) // plan.page_size
            indptr = xp.zeros(plan.batch_size + 1, dtype=xp.int32)
            if plan.batch_size:
                indptr[1:] = xp.cumsum(counts).astype(xp.int32)
    # Count checks where the lengths are host data already (never a device read here).
    if not lens.from_runtime:
        kv_host, indptr_host = plan.kv_lens, plan.kv_page_indptr
    elif not call.is_cuda:
        kv_host, indptr_host = lens.kv_lens, indptr
    else:
        kv_host = indptr_host = None
    if kv_host is not None:
        n = int(kv_indices.shape[0])
        if exact_count:
            total = int(_ceil_div(np.asarray(kv_host, dtype=np.int64), plan.page_size).sum())
            if n != total:
                raise ValueError(f"kv_indices does not match the page count implied by kv_lens: {n} vs {total}")
        needed = int(indptr_host[-1]) if plan.batch_size else 0
        if n < needed:
            raise ValueError(f"kv_indices has {n} entries but kv_page_indptr addresses {needed}")
    return None, kv_indices, indptr


def _table_host(table, kv_indices, indptr) -> np.ndarray:
    if table is not None:
        return _host(table)
    return ref.page_table_from_indptr(_host(kv_indices), _host(indptr))


def _check_pages(ctx: _Ctx, part: _Part, lens: Lengths, table, kv_indices, indptr, kbi) -> None:
    """``check_input_valid=True``: read indices to the host and refuse any invalid one."""
    plan, call = part.plan, ctx.call
    qo, kv = _host(lens.qo_lens).astype(np.int64), _host(lens.kv_lens).astype(np.int64)
    cu_q = _host(lens.cu_seqlens_q).astype(np.int64)
    if np.any(qo < 0) or np.any(kv < 0):
        raise ValueError(f"lengths must be non-negative, got qo_lens={qo.tolist()}, kv_lens={kv.tolist()}")
    total_q = part.q.shape[0]
    if np.any(cu_q[:-1] < 0) or np.any(cu_q[:-1] + qo > total_q):
        raise ValueError(f"cu_seqlens_q/qo_lens address rows outside q (total_q={total_q})")
    if plan.mode == "dense":
        cu_k = _host(lens.cu_seqlens_k).astype(np.int64)
        if np.any(cu_k[:-1] < 0) or np.any(cu_k[:-1] + kv > part.k.shape[0]):
            raise ValueError(f"cu_seqlens_k/kv_lens address rows outside k (total_k={part.k.shape[0]})")
        return
    num_pages = int(part.k.shape[0])
    if table is None:
        ptr = _host(indptr).astype(np.int64)
        if np.any(np.diff(ptr) < 0) or ptr[0] < 0 or ptr[-1] > kv_indices.shape[0]:
            raise ValueError(f"kv_page_indptr is not a valid CSR offset vector into {kv_indices.shape[0]} kv_indices")
    tbl = _table_host(table, kv_indices, indptr)
    need = _ceil_div(kv, plan.page_size)
    if tbl.shape[1] < int(need.max(initial=0)):
        raise ValueError(f"the page table has {tbl.shape[1]} columns but a request needs {int(need.max())} pages")
    sel = None if kbi is None else _host(kbi)
    for b in range(plan.batch_size):
        if kbi is None:
            used = np.arange(need[b])
        else:
            rows = sel[cu_q[b]:cu_q[b] + qo[b]]
            bad = (rows != -1) & ((rows < 0) | (rows >= need[b]))
            if np.any(bad):
                raise ValueError(
                    f"kv_block_indexes of request {b} hold block id {int(rows[bad][0])} outside "
                    f"[0, {int(need[b])}) (kv_len {int(kv[b])}); -1 marks an unused slot"
                )
            srt = np.sort(rows, axis=-1)
            dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] != -1)
            if np.any(dup):
                raise ValueError(f"kv_block_indexes of request {b} list block {int(srt[..., 1:][dup][0])} twice in a row")
            used = np.unique(rows[rows >= 0])
        pages = tbl[b, used]
        if np.any((pages < 0) | (pages >= num_pages)):
            raise ValueError(f"request {b} uses page id {int(pages[(pages < 0) | (pages >= num_pages)][0])} "
                             f"outside the cache of {num_pages} pages")


# ----------------------------------------------------------------------------- jobs


def _prepare_attention(ctx: _Ctx, part: _Part) -> Callable[[], None]:
    call, plan = ctx.call, part.plan
    lens = resolve_lengths(plan, ctx.runtime_metadata, call)
    offsets = _offsets(ctx, plan, lens, part.q_offset_override)
    if plan.mode in ("dense", "paged") and (ctx.k_scale != 1.0 or ctx.v_scale != 1.0):
        raise ValueError("k_scale/v_scale are currently supported only by sparse MSA")
    table = kv_indices = indptr = kbi = None
    if plan.mode == "paged":
        table, kv_indices, indptr = _page_source(ctx, part, lens, what="paged MSA execution",
                                                 exact_count=True)
    elif plan.is_sparse:
        if part.kv_indices is None and part.page_table is None and lens.page_table is None:
            raise ValueError("sparse MSA forward requires kv_indices or page_table")
        if part.kv_block_indexes is None:
            raise ValueError("sparse MSA forward requires kv_block_indexes")
        _check_sparse_plan(ctx, plan, part.q.shape)
        table, kv_indices, indptr = _page_source(ctx, part, lens, what="paged MSA forward", exact_count=False)
        kbi = part.kv_block_indexes
    elif part.page_table is not None and lens.page_table is not None:
        raise ValueError("page_table argument and runtime_metadata.page_table are mutually exclusive")
    if ctx.check:
        _check_pages(ctx, part, lens, table, kv_indices, indptr, kbi)
    scales = (ctx.k_scale, ctx.v_scale) if (plan.is_sparse and ctx.is_fp8) else (1.0, 1.0)

    if not call.is_cuda:
        def run_host() -> None:
            eff = lens.effective_kv_lens()
            common = dict(qo_offset=offsets, causal=plan.causal, sm_scale=ctx.sm_scale, qo_lens=lens.qo_lens)
            if plan.mode == "dense":
                o, l = ref.dense_attention(part.q, part.k, part.v, lens.cu_seqlens_q, lens.cu_seqlens_k,
                                           kv_lens=eff, **common)
            else:
                tbl = _table_host(table, kv_indices, indptr)
                if plan.mode == "paged":
                    o, l = ref.paged_attention(part.q, part.k, part.v, lens.cu_seqlens_q, eff, tbl,
                                               kv_layout=ctx.kv_layout, **common)
                else:
                    o, l = ref.sparse_attention(part.q, part.k, part.v, lens.cu_seqlens_q, eff, tbl, kbi,
                                                k_scale=scales[0], v_scale=scales[1], kv_layout=ctx.kv_layout,
                                                **common)
            part.out[...] = o.astype(ctx.out_dtype)
            if part.lse is not None:
                part.lse[...] = l.astype(np.float32)

        return run_host

    launch = kernels.attention_launcher()

    def run_cuda() -> None:
        with call.launch_scope():
            launch(
                part.q, part.k, part.v, part.out, part.lse,
                cu_seqlens_q=lens.cu_seqlens_q, qo_lens=lens.qo_lens,
                kv_lens=lens.kv_lens if lens.seqused_k is None else lens.seqused_k,
                qo_offset=offsets,
                cu_seqlens_k=lens.cu_seqlens_k if plan.mode == "dense" else None,
                page_table=table, kv_indices=kv_indices, kv_page_indptr=indptr,
                kv_layout=ctx.kv_layout or "NHD",
                page_size=0 if plan.mode == "dense" else plan.page_size,
                kv_block_indexes=kbi,
                max_seqlen_q=plan.prefill_plan.max_seqlen_q, max_seqlen_k=plan.prefill_plan.max_seqlen_k,
                causal=plan.causal, sm_scale=ctx.sm_scale, k_scale=scales[0], v_scale=scales[1],
                is_fp8=ctx.is_fp8, num_kv_splits=plan.num_kv_splits,
                sparse_decode=plan.mode == "sparse_decode", workspace=None, stream=call.stream,
                prefill_tile=plan.prefill_tile,
            )

    return run_cuda


def _prepare_max_score(ctx: _Ctx, part: _Part) -> Callable[[], None]:
    call, plan = ctx.call, part.plan
    lens = resolve_lengths(plan, ctx.runtime_metadata, call)
    offsets = _offsets(ctx, plan, lens, part.q_offset_override)
    table = kv_indices = indptr = None
    if plan.mode != "dense":
        if lens.page_table is not None:
            if part.page_table is not None:
                raise ValueError("page_table argument and runtime_metadata.page_table are mutually exclusive")
            table = lens.page_table
        elif part.page_table is not None:
            md = ctx.runtime_metadata
            if md is not None and md.kv_page_indptr is not None:
                raise ValueError("2-D page_table cannot be combined with kv_page_indptr")
            table = _max_score_table(part)
        else:
            table, kv_indices, indptr = _page_source(ctx, part, lens, what="paged MSA maxscore",
                                                     exact_count=False)
    elif part.page_table is not None and lens.page_table is not None:
        raise ValueError("page_table argument and runtime_metadata.page_table are mutually exclusive")
    if ctx.check:
        _check_pages(ctx, part, lens, table, kv_indices, indptr, None)

    if not call.is_cuda:
        def run_host() -> None:
            eff = lens.effective_kv_lens()
            nt = part.max_score.shape[2]
            common = dict(qo_offset=offsets, causal=plan.causal, max_k_tiles=nt, qo_lens=lens.qo_lens)
            if plan.mode == "dense":
                ms = ref.block_max_score(part.q, part.k, lens.cu_seqlens_q, lens.cu_seqlens_k, kv_lens=eff, **common)
            else:
                ms = ref.paged_block_max_score(part.q, part.k, lens.cu_seqlens_q, eff,
                                               _table_host(table, kv_indices, indptr), kv_layout=ctx.kv_layout,
                                               **common)
            part.max_score[...] = ms.astype(np.float32)

        return run_host

    launch = kernels.max_score_launcher()

    def run_cuda() -> None:
        with call.launch_scope():
            launch(
                part.q, part.k, part.max_score,
                cu_seqlens_q=lens.cu_seqlens_q, qo_lens=lens.qo_lens,
                kv_lens=lens.kv_lens if lens.seqused_k is None else lens.seqused_k,
                qo_offset=offsets,
                cu_seqlens_k=lens.cu_seqlens_k if plan.mode == "dense" else None,
                page_table=table, kv_indices=kv_indices, kv_page_indptr=indptr,
                kv_layout=ctx.kv_layout or "NHD",
                page_size=0 if plan.mode == "dense" else plan.page_size,
                max_seqlen_q=plan.prefill_plan.max_seqlen_q, causal=plan.causal, stream=call.stream,
            )

    return run_cuda


def _max_score_table(part: _Part):
    """The ``page_table`` argument of a max-score pass: int32 ``[B, ceil(max_seqlen_k / page_size)]``."""
    plan = part.plan
    data = part.page_table
    if data.dtype != np.int32 or data.ndim != 2:
        raise TypeError(
            "runtime page_table must be a contiguous rank-2 int32 tensor [B, max_pages], got "
            f"dtype={data.dtype}, shape={tuple(data.shape)}"
        )
    expected = (plan.batch_size, plan_page_width(plan))
    if tuple(data.shape) != expected:
        raise ValueError(f"runtime page_table must have shape {expected}, got {tuple(data.shape)}")
    if not data.flags.c_contiguous:
        raise ValueError("runtime page_table must be contiguous")
    return data


# ----------------------------------------------------------------------------- the engine


def _split_rows(a, n: int):
    return (None, None) if a is None else (a[:n], a[n:])


# Array arguments in signature order (replayed launches, see ``mate_cupy._launch_cache``).
_ARRAYS = ("q", "k", "v", "out", "lse", "max_score", "kv_indices", "page_table", "kv_block_indexes",
           "q_offset_override", "md.qo_lens", "md.kv_lens", "md.qo_offset", "md.cu_seqlens_q", "md.cu_seqlens_k",
           "md.seqused_k", "md.page_table", "md.kv_page_indptr")
_NO_METADATA = (None,) * 8
# Launcher knobs read from the environment at every launch: part of the signature.
_ENV_KNOBS = lc.env_keys("MATE_CUPY_ATTN_PREFILL_TILE", "MATE_CUPY_ATTN_SPARSE_TILE")
_RECIPES = lc.new_cache()


def run_plan(info: tuple, q, k, v, *, kv_indices=None, kv_block_indexes=None, q_offset_override=None, out=None,
             lse=None, max_score=None, page_table=None, sm_scale=None, k_scale=1.0, v_scale=1.0,
             runtime_metadata=None, output_o=True, output_maxscore=False, want_lse=False,
             check_input_valid=False):
    """Validate and run one MSA call; returns ``(out, lse, max_score)`` in the caller's framework.

    ``info`` is an unpacked plan info ``(mixed, split, batch, plan, prefill_plan)``.
    ``out``/``lse`` are produced when ``output_o`` (``lse`` when given or ``want_lse``),
    ``max_score`` when ``output_maxscore``. Preallocated arrays are written in place and
    returned as the same objects. A call whose signature ran before replays its recorded
    launches (plans are keyed by identity: a plan is not changed after it is built).
    """
    key = None
    md = runtime_metadata
    if lc.ENABLED and not check_input_valid and (md is None or type(md) is MsaRuntimeMetadata):
        mixed, split, _, first, second = info
        ov, ov_array = q_offset_override, None
        if ov is not None and not isinstance(ov, (int, np.integer)):
            ov, ov_array = "array", ov
        opts = (id(first), id(second), mixed, split, sm_scale, k_scale, v_scale, output_o, output_maxscore,
                want_lse, ov, md is None) + lc.env_state(_ENV_KNOBS)
        if lc.plain(opts):
            arrays = (q, k, v, out, lse, max_score, kv_indices, page_table, kv_block_indexes, ov_array) + (
                _NO_METADATA if md is None else
                (md.qo_lens, md.kv_lens, md.qo_offset, md.cu_seqlens_q, md.cu_seqlens_k, md.seqused_k,
                 md.page_table, md.kv_page_indptr))
            sig, ptrs = lc.signature(arrays)
            if sig is not None:
                key = (opts, sig)
                recipe = _RECIPES.get(key)
                if recipe is not None:
                    allocs = lc.replay(recipe, ptrs, q)
                    res_o = res_lse = res_ms = None
                    if output_o:
                        res_o = out if out is not None else allocs["out"]
                        if lse is not None:
                            res_lse = lse
                        elif want_lse:
                            res_lse = allocs["lse"]
                    if output_maxscore:
                        res_ms = max_score if max_score is not None else allocs["max_score"]
                    return res_o, res_lse, res_ms
    rec = lc.Recorder(_ARRAYS) if key is not None else None
    with lc.recording(rec):
        call, result = _run_plan_full(info, q, k, v, kv_indices=kv_indices, kv_block_indexes=kv_block_indexes,
                                      q_offset_override=q_offset_override, out=out, lse=lse, max_score=max_score,
                                      page_table=page_table, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale,
                                      runtime_metadata=runtime_metadata, output_o=output_o,
                                      output_maxscore=output_maxscore, want_lse=want_lse,
                                      check_input_valid=check_input_valid)
    if rec is not None:
        lc.store(_RECIPES, key, rec, call, keep=(info[3], info[4]))
    return result


def _run_plan_full(info: tuple, q, k, v, *, kv_indices, kv_block_indexes, q_offset_override, out, lse, max_score,
                   page_table, sm_scale, k_scale, v_scale, runtime_metadata, output_o, output_maxscore, want_lse,
                   check_input_valid):
    """:func:`run_plan` without replay: returns ``(call, (out, lse, max_score))``."""
    mixed, split, _, first, second = info
    plans = [first, second] if mixed else [first]
    call = Call(q=q, k=k, v=v)
    for name, obj in (("out", out if output_o else None), ("lse", lse if output_o else None),
                      ("max_score", max_score if output_maxscore else None),
                      ("kv_indices", _as_array(kv_indices)), ("page_table", _as_array(page_table)),
                      ("kv_block_indexes", _as_array(kv_block_indexes))):
        call.add(name, obj)
    override = q_offset_override
    if override is not None and not isinstance(override, (int, np.integer)):
        override = call.add("q_offset_override", _as_array(override)).data
    for name, arg in call.args.items():
        lc.note_arg(name, arg.data)

    any_sparse = any(p.is_sparse for p in plans)
    if kv_block_indexes is not None and not any_sparse and output_o:
        raise ValueError(
            f"kv_block_indexes needs a sparse plan (kv_block_num > 0), got plan mode {first.mode!r}"
        )
    dtype, layout = _check_qkv(call, plans, sparse_attention=any_sparse and output_o)
    qa = call["q"]
    total_q, hq, d = qa.shape
    is_fp8 = dtype == FP8_E4M3
    ctx = _Ctx(call=call, dtype=dtype, out_dtype=BFLOAT16 if is_fp8 else dtype, is_fp8=is_fp8, kv_layout=layout,
               sm_scale=1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale),
               k_scale=float(k_scale), v_scale=float(v_scale), runtime_metadata=runtime_metadata,
               check=bool(check_input_valid))
    if runtime_metadata is None and not first.is_static:
        expected_q = sum(int(np.asarray(p.qo_lens, dtype=np.int64).sum()) for p in plans)
        if total_q != expected_q:
            raise ValueError(f"q has {total_q} rows but the plan's qo lengths sum to {expected_q}")
        if first.mode == "dense":
            expected_k = sum(p.prefill_plan.total_seqlen_k for p in plans)
            if call["k"].shape[0] < expected_k:
                raise ValueError(f"k has {call['k'].shape[0]} rows but the plan's kv lengths sum to {expected_k}")

    # Outputs (validated, or allocated on q's device).
    out_data = lse_data = ms_data = None
    if output_o:
        if out is not None:
            out_data = _check_output(call, "out", qa.shape, ctx.out_dtype, "[total_q, Hq, D]")
        else:
            out_data = call.empty(qa.shape, ctx.out_dtype)
            lc.note_alloc("out", out_data)
        if lse is not None:
            lse_data = _check_output(call, "lse", (total_q, hq), FLOAT32, "[total_q, Hq]")
        elif want_lse:
            lse_data = call.empty((total_q, hq), FLOAT32)
            lc.note_alloc("lse", lse_data)
    if output_maxscore:
        nt = max(max_k_tiles(p) for p in plans)
        if max_score is not None:
            ms_data = _check_max_score_buffer(call, total_q, hq, nt)
        else:
            ms_data = call.empty((total_q, hq, nt), FLOAT32)
            lc.note_alloc("max_score", ms_data)
    kbi = None
    if any_sparse and output_o and kv_block_indexes is not None:
        kbi = _check_block_indexes(call, first, total_q)

    # Parts: one per plan; a mixed plan splits rows, KV rows (dense) or flat page ids (paged).
    whole = _Part(plan=first, q=qa.data, k=call["k"].data, v=call["v"].data, out=out_data, lse=lse_data,
                  max_score=ms_data, kv_indices=call.data("kv_indices"), page_table=call.data("page_table"),
                  kv_block_indexes=kbi, q_offset_override=override)
    if not mixed:
        parts = [whole]
    else:
        parts = _split_mixed(whole, first, second, split)

    jobs = []
    for part in parts:
        if output_o:
            jobs.append(_prepare_attention(ctx, part))
        if output_maxscore:
            jobs.append(_prepare_max_score(ctx, part))
    for job in jobs:
        job()

    def give(obj, data, dt):
        if data is None:
            return None
        return obj if obj is not None else call.export(data, dtype=dt)

    return call, (give(out, out_data, ctx.out_dtype), give(lse, lse_data, FLOAT32), give(max_score, ms_data, FLOAT32))


def _split_mixed(whole: _Part, first: MsaPlan, second: MsaPlan, split: int) -> list:
    """Decode part (requests ``[0, split)``) and prefill part of a mixed plan."""
    q_split = int(np.asarray(first.qo_lens, dtype=np.int64).sum())
    override = whole.q_offset_override
    if override is not None and not isinstance(override, (int, np.integer)):
        batch = first.batch_size + second.batch_size
        if override.ndim != 1 or override.shape[0] != batch:
            raise ValueError(
                f"qo_offset must have the same shape as qo_segment_lens, got {tuple(override.shape)} vs ({batch},)"
            )
        ov = (override[:split], override[split:])
    else:
        ov = (override, override)
    if first.mode == "dense":
        kv_split = int(np.asarray(first.kv_lens, dtype=np.int64).sum())
        ks, vs = (whole.k[:kv_split], whole.k[kv_split:]), (whole.v[:kv_split], whole.v[kv_split:])
        idx = (None, None)
    else:
        ks, vs = (whole.k, whole.k), (whole.v, whole.v)  # one shared page pool
        page_split = int(first.kv_page_indptr[-1]) if first.batch_size else 0
        idx = _split_rows(whole.kv_indices, page_split)
    qs = _split_rows(whole.q, q_split)
    outs, lses, mss = (_split_rows(a, q_split) for a in (whole.out, whole.lse, whole.max_score))
    kbis = _split_rows(whole.kv_block_indexes, q_split)
    tables = _split_rows(whole.page_table, split)
    return [
        _Part(plan=p, q=qs[i], k=ks[i], v=vs[i], out=outs[i], lse=lses[i], max_score=mss[i], kv_indices=idx[i],
              page_table=tables[i], kv_block_indexes=kbis[i], q_offset_override=ov[i])
        for i, p in enumerate((first, second))
    ]
