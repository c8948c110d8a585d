"""MSA calls: the one validation, the frozen problem, and its host or CUDA run.

Every MSA op (``msa``, ``sparse_msa``, ``sparse_decode_atten_func``) is one :func:`run`:

* :func:`validate` checks every condition of the call once, before anything runs, for
  NumPy and CUDA inputs alike (the kernels' limits included), and returns a frozen
  :class:`MsaProblem` (one :class:`PartProblem` per plan part: mixed plans have two) and
  the call's operands (``Arg`` views; no CuPy array is built for CUDA inputs), with each
  CUDA part's :func:`mate_cupy.msa.attention_launch.select_config` result (pure, cached)
  and loaded kernels, remembered on the plan for the next call of the same shape.
* then outputs that were not given are allocated in the caller's framework, and the
  launchers run on the caller's stream (CUDA) or the float64 references
  (:mod:`mate_cupy.reference.msa`) fill them (NumPy).

Layouts: ``q [total_q, Hq, D]``; dense ``k, v [total_k, Hkv, D]``; paged ``k, v``
``[num_pages, page_size, Hkv, D]`` (NHD) or ``[num_pages, Hkv, page_size, D]`` (HND), used
as they are when the kernels can read them by 16-byte chunks (else a contiguous copy); ``out [total_q, Hq, D]`` (q's dtype, bfloat16 for fp8);
``lse [total_q, Hq]`` float32; ``max_score [total_q, Hq, NT]`` float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..checks import check_given, int_arg
from ..reference import msa as ref
from ..runtime.device import device_info
from ..jit import PreparedLaunch, Source
from ..runtime.interop import (BFLOAT16, FLOAT16, FLOAT32, FP8_E4M3, INT32, Arg, Call, current_device, dtype_name,
                               torch_cuda_addresses, torch_stream_ptr, wrap)
from ..runtime.staging import cuda_copy_into
from ..runtime.workspace import Workspace, as_workspace
from . import attention_launch as al
from . import index_launch
from .plan import MsaPlan, MsaRuntimeMetadata, max_k_tiles, plan_page_width
from .runtime import Lengths, resolve_lengths

__all__ = ["MsaProblem", "PartProblem", "attention_workspace_bytes", "check_fp8_max_score", "finish",
           "prepare_workspace", "run", "start", "validate"]

# The contract of the kernels, refused alike for host inputs.
ATTENTION_DTYPES = (FLOAT16, BFLOAT16, FP8_E4M3)
MAX_SCORE_DTYPES = (FLOAT16, BFLOAT16, FP8_E4M3)
HEAD_DIMS = (64, 128, 256)
SPARSE_HEAD_DIM = 128
SPARSE_GQA_RATIOS = (8, 16)
SPARSE_MAX_SEQLEN_K = 1 << 25  # the block union of one CTA (every sparse tile holds more)
MAX_BATCH = 65535  # grid y of the attention kernels
MAX_KV_HEADS = 65535  # grid y of the max-score kernels
INDEX_LIMIT = 2**31  # total_q * Hq, KV rows/pages, max_seqlen_q * group: int32 indices
# float8 max scores: the decode kernel up to FP8_MAX_SCORE_ROWS[D] packed rows per request
# (max_seqlen_q * Hq / Hkv) from compute capability 8.9, the wgmma kernel above on 9.0 only,
# as registered in index_launch.
FP8_MAX_SCORE_ROWS = index_launch.FP8_DECODE_MAX_ROWS
FP8_MAX_SCORE_MIN_SM = min(s.min_sm for (dt, _, _), s in index_launch.MAX_SCORE_SPECS.items() if dt == FP8_E4M3)
DTYPE_CODES = {FLOAT16: al.DTYPE_FP16, BFLOAT16: al.DTYPE_BF16, FP8_E4M3: al.DTYPE_E4M3}
LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------- the problem


@dataclass(frozen=True)
class PartProblem:
    """One plan part of a call: the q rows it owns, its attention pass (None when the call
    asks for no output), its page source (``"dense"``, ``"table"``, ``"csr"``) per pass."""

    plan: MsaPlan
    rows: tuple
    attention: Optional[al.AttentionProblem]
    attention_pages: str
    max_score_pages: str


@dataclass(frozen=True)
class MsaProblem:
    """A validated MSA call: dtypes, layout, scales, outputs and the parts.

    ``kv_layout`` is ``"NHD"``/``"HND"`` for paged caches, ``""`` for dense K/V;
    ``k_scale``/``v_scale`` are the effective scales (the call's for fp8 sparse, else 1);
    ``scale_log2 = sm_scale * log2(e) * k_scale`` and ``v_scale`` are what the kernels take;
    ``max_score_scale`` multiplies the block maxima (the call's ``k_scale`` for fp8, else 1);
    ``max_k_tiles`` the max-score width a call allocates.
    """

    fn: str
    is_cuda: bool
    device: int
    dtype: np.dtype
    out_dtype: np.dtype
    head_dim: int
    kv_layout: str
    sm_scale: float
    k_scale: float
    v_scale: float
    scale_log2: float
    max_score_scale: float
    output_o: bool
    output_maxscore: bool
    want_lse: bool
    check_input_valid: bool
    max_k_tiles: int
    parts: tuple


class _PartOperands:
    """Arrays of one part (row/page slices of the call's arrays for mixed plans)."""

    __slots__ = ("q", "k", "v", "lens", "offsets", "att_pages", "ms_pages", "kbi")

    def __init__(self, q, k, v, lens, offsets, att_pages, ms_pages, kbi):
        self.q, self.k, self.v, self.lens, self.offsets = q, k, v, lens, offsets
        self.att_pages, self.ms_pages, self.kbi = att_pages, ms_pages, kbi


class _Operands:
    """The call's arrays: ``Call``, outputs (None until allocated), parts, the parts' launches
    (``(AttentionConfig, kernels)`` on CUDA), workspace."""

    __slots__ = ("call", "out", "lse", "max_score", "parts", "configs", "workspace", "k_strides", "v_strides",
                 "kv_extent", "q_strides")

    def __init__(self, call):
        self.call = call
        self.out = self.lse = self.max_score = self.workspace = None
        self.parts = self.configs = ()


# A page source: (page_list, page_indptr, page_list_len); (None, None, 0) for dense K/V.
_NO_PAGES = (None, None, 0)


# ----------------------------------------------------------------------------- small helpers


def _as_array(obj):
    """Python lists/tuples become host arrays; arrays pass through."""
    if isinstance(obj, (list, tuple)):
        return np.asarray(obj)
    return obj


def _ceil_div(a, b):
    return -(-a // b)


def _rows(arg: Optional[Arg], start: int, stop: int) -> Optional[Arg]:
    """Rows ``[start, stop)`` of ``arg`` as an ``Arg`` (a view: the address moves, nothing is built)."""
    if arg is None or (start == 0 and stop == arg.shape[0]):
        return arg
    ptr = arg.ptr + start * arg.strides[0] * arg.dtype.itemsize if stop > start else arg.ptr
    shape = (stop - start,) + tuple(arg.shape[1:])
    if arg.is_cuda:
        return Arg(arg.name, arg.obj, arg.dtype, arg.framework, arg.device, shape, arg.strides, ptr,
                   make=lambda: arg.data[start:stop])
    return Arg(arg.name, arg.obj, arg.dtype, arg.framework, arg.device, shape, arg.strides, ptr,
               data=arg.data[start:stop])


def _int32(call: Call, arg: Arg, name: str) -> Arg:
    """``arg`` as a contiguous int32 array (a converted copy when it is not one already).

    Wider integers saturate to the int32 range, so an id or offset outside it stays outside
    (never wraps onto a valid page or block)."""
    if arg.dtype == INT32 and arg.is_contiguous():
        return arg
    if call.is_cuda:
        import cupy as xp
    else:
        xp = np
    with call.launch_scope():
        data = arg.data
        if arg.dtype.itemsize > 4 or arg.dtype == np.uint32:
            data = xp.minimum(data, 2**31 - 1) if arg.dtype.kind == "u" else xp.clip(data, -2**31, 2**31 - 1)
        return wrap(name, xp.ascontiguousarray(data, dtype=np.int32))


def _host(arg: Optional[Arg]) -> Optional[np.ndarray]:
    """Host copy of an index array (a device-to-host copy on CUDA: checked mode only)."""
    if arg is None:
        return None
    data = arg.data
    return data if isinstance(data, np.ndarray) else data.get()


def _rows_of_chunks(call: Call, arg: Arg) -> Arg:
    """``arg`` itself when the kernels can read it by 16-byte chunks of its rows (head dim
    contiguous, strides and data 16-byte aligned), else a contiguous copy: on CUDA a new
    array in the caller's framework (torch's allocator for torch tensors, so a capture keeps
    it in its pool), copied bit for bit on the call's stream. The copy is not one of
    ``call``'s arrays, so a call that reads one is never prepared (its launches would read
    the caller's array)."""
    item = arg.dtype.itemsize
    if (arg.strides[-1] == 1 or arg.shape[-1] <= 1) and not (arg.size and arg.ptr % 16) and all(
            arg.shape[i] <= 1 or (s * item) % 16 == 0 for i, s in enumerate(arg.strides[:-1])):
        return arg
    if not call.is_cuda:
        return wrap(arg.name, np.array(arg.data, copy=True, order="C"))
    if call.framework == "torch":
        copy = call.new(arg.name, arg.shape, arg.dtype)
        dst = copy.data
    else:  # CuPy's pool on the caller's stream (fp8 held as uint8), never exported
        dst = call.empty(arg.shape, arg.dtype)
        copy = Arg(arg.name, dst, arg.dtype, "cupy", arg.device, tuple(arg.shape),
                   tuple(x // item for x in dst.strides), int(dst.data.ptr), data=dst)
    with call.launch_scope():
        cuda_copy_into(dst, arg.data)
    return copy


def _kv_layout(arg: Arg, plan: MsaPlan) -> str:
    """NHD ``[P, page, Hkv, D]`` or HND ``[P, Hkv, page, D]`` (HND when page_size == Hkv)."""
    if arg.ndim != 4:
        raise ValueError(f"{arg.name} must be a 4D paged tensor, got shape {arg.shape}")
    _, a, b, _ = arg.shape
    if a == plan.num_kv_heads and b == plan.page_size:
        return "HND"
    if a == plan.page_size and b == plan.num_kv_heads:
        return "NHD"
    raise ValueError(
        f"{arg.name} must use [pages, page, H, D] (NHD) or [pages, H, page, D] (HND) layout with "
        f"page={plan.page_size}, H={plan.num_kv_heads}, got shape {arg.shape}"
    )


def _check_output(arg: Arg, shape: tuple, dtype, layout: str) -> None:
    if arg.dtype != dtype:
        raise TypeError(f"{arg.name} must be {dtype_name(dtype)}, got {dtype_name(arg.dtype)}")
    if arg.shape != tuple(shape):
        raise ValueError(f"{arg.name} must have shape {layout} = {tuple(shape)}, got {arg.shape}")
    if not arg.is_contiguous():
        raise ValueError(f"{arg.name} must be contiguous")


def attention_problem(plan: MsaPlan, total_q: int, head_dim: int, dtype_code: int) -> al.AttentionProblem:
    """The attention pass of ``plan`` for ``total_q`` query rows of ``head_dim`` and ``dtype_code``."""
    pf = plan.prefill_plan
    if plan.is_sparse:
        kv_mode, page_size, width = al.KV_SPARSE, plan.page_size, plan.selected_block_count
    elif plan.mode == "paged":
        kv_mode, page_size, width = al.KV_PAGED, plan.page_size, 0
    else:
        kv_mode, page_size, width = al.KV_DENSE, 0, 0
    return al.AttentionProblem(kv_mode, plan.batch_size, total_q, plan.num_qo_heads, plan.num_kv_heads, head_dim,
                               dtype_code, pf.max_seqlen_q, pf.max_seqlen_k, page_size, width, plan.causal,
                               plan.mode == "sparse_decode", plan.num_kv_splits, plan.prefill_tile == "gather")


def _part_attention(plan: MsaPlan, total_q: int, head_dim: int, dtype_code: int, device: int) -> tuple:
    """``(AttentionProblem, launch)`` of a plan part for this call, remembered on the plan for
    the next call of the same shape and device. ``launch`` is ``(AttentionConfig, kernels)``
    on CUDA (the kernels loaded on first use), None on the host."""
    key = (total_q, head_dim, dtype_code, device)
    last = plan.last_attention
    if last is not None and last[0] == key:
        return last[1], last[2]
    problem = attention_problem(plan, total_q, head_dim, dtype_code)
    launch = None
    if device >= 0:
        config = al.select_config(problem, *_sm_count(plan, device))
        launch = (config, al.config_kernels(config, device))
    plan.last_attention = (key, problem, launch)
    return problem, launch


def _sm_count(plan: MsaPlan, device: int) -> tuple:
    sm, cc = device_info(device)
    if plan.usable_sm_count is not None:
        sm = min(sm, plan.usable_sm_count)
    return sm, cc


def _check_head_dim_and_dtype(fn: str, sparse: bool, head_dim: int, dtype, *, attention: bool,
                              max_score: bool) -> None:
    """The head dims and dtypes the kernels run (q's; k and v match it)."""
    if attention and dtype not in ATTENTION_DTYPES:
        raise TypeError(f"{fn}: MSA attention supports float16, bfloat16 and float8_e4m3fn; "
                        f"got q dtype {dtype_name(dtype)}")
    if max_score and dtype not in MAX_SCORE_DTYPES:
        raise TypeError(f"{fn}: the MSA block max score supports float16, bfloat16 and float8_e4m3fn; "
                        f"got q dtype {dtype_name(dtype)}")
    if attention and sparse and head_dim != SPARSE_HEAD_DIM:
        raise ValueError(f"{fn}: sparse MSA needs head dim {SPARSE_HEAD_DIM}, got {head_dim}")
    if head_dim not in HEAD_DIMS:
        raise NotImplementedError(f"{fn}: MSA kernels support head dims {HEAD_DIMS}, got {head_dim}")


def check_fp8_max_score(fn: str, plan: MsaPlan, hq: int, head_dim: int, device: int) -> None:
    """The float8 max score's device limits for ``plan``'s requests (CUDA inputs,
    ``NotImplementedError``; host inputs run the float64 reference at any shape): compute
    capability 8.9 or newer, and 9.0 exactly (the wgmma kernel) above the decode kernel's
    ``max_seqlen_q * Hq / Hkv <= FP8_MAX_SCORE_ROWS[D]`` packed rows (32; 16 at D 256)."""
    if device < 0:
        return
    cc = device_info(device)[1]
    if cc < FP8_MAX_SCORE_MIN_SM:
        raise NotImplementedError(f"{fn}: the float8 max score needs compute capability "
                                  f"{FP8_MAX_SCORE_MIN_SM // 10}.{FP8_MAX_SCORE_MIN_SM % 10} or newer, "
                                  f"got {cc // 10}.{cc % 10} (cuda:{device})")
    rows = plan.prefill_plan.max_seqlen_q * (hq // plan.num_kv_heads)
    limit = FP8_MAX_SCORE_ROWS[head_dim]
    if rows > limit and cc != index_launch.FP8_PREFILL_SM:
        sm = index_launch.FP8_PREFILL_SM
        raise NotImplementedError(
            f"{fn}: a float8 max score of more than {limit} packed rows per request at head dim {head_dim} "
            f"(max_seqlen_q * Hq / Hkv = {plan.prefill_plan.max_seqlen_q} * {hq} / {plan.num_kv_heads} = {rows}) "
            f"runs the wgmma kernel, compute capability {sm // 10}.{sm % 10} only; got {cc // 10}.{cc % 10} "
            f"(cuda:{device}); use float16/bfloat16 index inputs there")


def attention_workspace_bytes(plan: MsaPlan, head_dim: int, dtype, device: int, total_q: int) -> int:
    """Workspace bytes of ``plan``'s attention pass (``MsaPlan.workspace_bytes``)."""
    _check_head_dim_and_dtype("workspace_bytes", plan.is_sparse, head_dim, dtype, attention=True, max_score=False)
    sm, cc = _sm_count(plan, device)
    return al.select_config(attention_problem(plan, total_q, head_dim, DTYPE_CODES[dtype]), sm, cc).workspace_bytes


def prepare_workspace(plans: list, head_dim: int, dtype, device: int) -> None:
    """Allocate the workspace of a plan info's parts (owned by the first) and load their kernels."""
    bound = 0
    for plan in plans:
        _check_head_dim_and_dtype("upload", plan.is_sparse, head_dim, dtype, attention=True, max_score=False)
        sm, cc = _sm_count(plan, device)
        config = al.select_config(attention_problem(plan, plan.total_q, head_dim, DTYPE_CODES[dtype]), sm, cc)
        bound = max(bound, config.workspace_bytes)
        al.load_config(config, DTYPE_CODES[dtype], device)
    owner = plans[0]
    ws = owner.workspace
    if bound and (ws is None or ws.device != device or ws.nbytes < bound):
        owner.prepared_calls.clear()  # (they hold the workspace they launch with)
        owner.workspace = Workspace(bound, device)


def _plan_workspace(prob: "MsaProblem", need: int, call: Call) -> Workspace:
    """The plan-owned workspace of a call that passed none: reused, allocated on first need."""
    owner = prob.parts[0].plan
    ws = owner.workspace
    if ws is not None and ws.device == call.device and ws.nbytes >= need:
        return ws
    bound = 0
    for part in prob.parts:
        plan = part.plan
        sm, cc = _sm_count(plan, call.device)
        cap = attention_problem(plan, plan.total_q, prob.head_dim, part.attention.dtype_code)
        bound = max(bound, al.select_config(cap, sm, cc).workspace_bytes)
    if need > bound:
        raise ValueError(
            f"{prob.fn}: this call needs {need} bytes of workspace, more than the plan's bound of {bound} "
            "(q has more rows than the plan's capacity); pass workspace= (a mate_cupy.Workspace or a "
            "contiguous CUDA array)"
        )
    with call.launch_scope():
        owner.prepared_calls.clear()  # (they hold the workspace they launch with)
        owner.workspace = Workspace(bound, call.device)
    return owner.workspace


# ----------------------------------------------------------------------------- per-part checks


def _offsets(call: Call, plan: MsaPlan, lens: Lengths, override, runtime_metadata) -> Arg:
    """The per-request offsets of this call: runtime/plan offsets, or ``q_offset_override``."""
    if override is None:
        return lens.qo_offset
    if runtime_metadata is not None:
        raise ValueError("q_offset_override cannot be combined with runtime_metadata.qo_offset")
    batch = plan.batch_size
    if isinstance(override, (int, np.integer)):
        value = int_arg("q_offset_override", override, lo=-2**31)
        if call.is_cuda:
            import cupy

            with call.launch_scope():
                return wrap("q_offset_override", cupy.full(batch, value, dtype=cupy.int32))
        return wrap("q_offset_override", np.full(batch, value, dtype=np.int32))
    return _int32(call, override, "q_offset_override")


def _check_override(override: Arg, batch: int) -> None:
    if override.dtype.kind not in "iu":
        raise TypeError(f"q_offset_override must be an int or an integer array, got dtype {dtype_name(override.dtype)}")
    if override.ndim != 1 or override.shape[0] != batch:
        raise ValueError(f"q_offset_override must be an int or a [B] = ({batch},) array, got shape {override.shape}")


def _index_vector(call: Call, arg: Arg, name: str) -> Arg:
    if arg.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {dtype_name(arg.dtype)}")
    if arg.ndim != 1:
        raise ValueError(f"{name} must be a 1D tensor, got shape {arg.shape}")
    return arg if arg.dtype == INT32 and arg.strides == (1,) else _int32(call, arg, name)


def _attention_pages(fn: str, call: Call, plan: MsaPlan, lens: Lengths, table: Optional[Arg],
                     kv_indices: Optional[Arg]) -> tuple:
    """Page source of the attention pass of a paged or sparse part (checked)."""
    if lens.page_table is not None:
        if table is not None:
            raise ValueError("page_table argument and runtime_metadata.page_table are mutually exclusive")
        return lens.page_table, None, lens.page_table.shape[1]
    if table is not None:
        if table.dtype.kind not in "iu":
            raise TypeError(f"page_table must be an integer array, got dtype {dtype_name(table.dtype)}")
        if table.ndim != 2:
            raise ValueError(f"page_table must be rank 2 [B, max_pages], got shape {table.shape}")
        if table.shape[0] != plan.batch_size:
            raise ValueError(f"page_table must have {plan.batch_size} rows (one per request), got {table.shape[0]}")
        if table.dtype != INT32 or table.strides != (table.shape[1], 1):
            table = _int32(call, table, "page_table")
        return table, None, table.shape[1]
    if kv_indices is None:
        what = "sparse MSA forward" if plan.is_sparse else "paged MSA execution"
        raise ValueError(f"{what} requires kv_indices or page_table")
    what = "paged MSA forward" if plan.is_sparse else "paged MSA execution"
    return _csr_pages(call, plan, lens, kv_indices, what=what, exact_count=not plan.is_sparse)


def _csr_pages(call: Call, plan: MsaPlan, lens: Lengths, kv_indices: Arg, *, what: str,
               exact_count: bool) -> tuple:
    kv_indices = _index_vector(call, kv_indices, "kv_indices")
    indptr = lens.kv_page_indptr
    if indptr is None:
        if plan.is_sparse or what.startswith("paged MSA maxscore"):
            raise ValueError(f"{what} plan is missing kv_page_indptr (pass runtime_metadata.kv_page_indptr)")
        # Paged attention with runtime lengths and no CSR offsets: derived here (allocates).
        counts_to = plan.page_size
        if call.is_cuda:
            import cupy

            with call.launch_scope():
                counts = (lens.kv_lens.data.astype(cupy.int64) + counts_to - 1) // counts_to
                data = cupy.zeros(plan.batch_size + 1, dtype=cupy.int32)
                if plan.batch_size:
                    data[1:] = cupy.cumsum(counts).astype(cupy.int32)
        else:
            counts = (lens.kv_lens.data.astype(np.int64) + counts_to - 1) // counts_to
            data = np.zeros(plan.batch_size + 1, dtype=np.int32)
            if plan.batch_size:
                data[1:] = np.cumsum(counts)
        indptr = wrap("kv_page_indptr", data)
    # Count checks where the lengths are host data already (never a device read here).
    n = kv_indices.shape[0]
    if not lens.from_runtime:  # the plan's CSR offsets: the page counts of its kv_lens
        total = needed = int(plan.kv_page_indptr[-1])
    elif not call.is_cuda:
        total = int(_ceil_div(lens.kv_lens.data.astype(np.int64), plan.page_size).sum())
        needed = int(indptr.data[-1]) if plan.batch_size else 0
    else:
        total = needed = None
    if total is not None:
        if exact_count and n != total:
            raise ValueError(f"kv_indices does not match the page count implied by kv_lens: {n} vs {total}")
        if n < needed:
            raise ValueError(f"kv_indices has {n} entries but kv_page_indptr addresses {needed}")
    return kv_indices, indptr, kv_indices.shape[0]


def _max_score_pages(fn: str, call: Call, plan: MsaPlan, lens: Lengths, table: Optional[Arg],
                     kv_indices: Optional[Arg], runtime_metadata) -> tuple:
    """Page source of the max-score pass of a paged or sparse part (checked)."""
    if lens.page_table is not None:
        if table is not None:
            raise ValueError("page_table argument and runtime_metadata.page_table are mutually exclusive")
        return lens.page_table, None, lens.page_table.shape[1]
    if table is not None:
        if runtime_metadata is not None and runtime_metadata.kv_page_indptr is not None:
            raise ValueError("2-D page_table cannot be combined with kv_page_indptr")
        if table.dtype != INT32 or table.ndim != 2:
            raise TypeError(
                "runtime page_table must be a contiguous rank-2 int32 tensor [B, max_pages], got "
                f"dtype={dtype_name(table.dtype)}, shape={table.shape}"
            )
        expected = (plan.batch_size, plan_page_width(plan))
        if table.shape != expected:
            raise ValueError(f"runtime page_table must have shape {expected}, got {table.shape}")
        if not table.is_contiguous():
            raise ValueError("runtime page_table must be contiguous")
        return table, None, table.shape[1]
    if kv_indices is None:
        raise ValueError("paged MSA maxscore requires page_table or kv_indices")
    return _csr_pages(call, plan, lens, kv_indices, what="paged MSA maxscore", exact_count=False)


def _check_block_indexes(call: Call, arg: Arg, plan: MsaPlan, total_q: int) -> Arg:
    """``kv_block_indexes [total_q, Hkv or Hq, W]`` int32 -> contiguous ``[total_q, Hkv, W]``."""
    hq, hkv = plan.num_qo_heads, plan.num_kv_heads
    if arg.dtype != INT32:
        raise TypeError(f"kv_block_indexes must be int32, got {dtype_name(arg.dtype)}")
    if arg.ndim != 3:
        raise ValueError(f"kv_block_indexes must have shape [total_q, Hkv or Hq, topK], got {arg.shape}")
    if arg.shape[0] != total_q:
        raise ValueError(f"kv_block_indexes total_q dimension mismatch: {arg.shape[0]} vs {total_q}")
    width = plan.selected_block_count
    if arg.shape[2] != width:
        raise ValueError(f"kv_block_indexes selected-block width mismatch: {arg.shape[2]} vs {width}")
    if arg.shape[1] == hkv:
        return arg if arg.strides == (hkv * width, width, 1) else _int32(call, arg, "kv_block_indexes")
    if arg.shape[1] != hq:
        raise ValueError(
            "kv_block_indexes head dimension must match num_kv_heads or num_qo_heads, "
            f"got {arg.shape[1]}, num_kv_heads={hkv}, num_qo_heads={hq}"
        )
    # Per query head: head g * r stands for KV head g (a strided copy).
    if call.is_cuda:
        import cupy

        with call.launch_scope():
            data = cupy.ascontiguousarray(arg.data[:, :: hq // hkv, :])
    else:
        data = np.ascontiguousarray(arg.data[:, :: hq // hkv, :])
    return wrap("kv_block_indexes", data)


def _check_pages(plan: MsaPlan, q: Arg, k: Arg, lens: Lengths, pages: tuple, kbi: Optional[Arg]) -> None:
    """``check_input_valid=True``: read the indices to the host and refuse any invalid one."""
    qo, kv = _host(lens.qo_lens).astype(np.int64), _host(lens.kv_lens).astype(np.int64)
    cu_q = _host(lens.cu_seqlens_q).astype(np.int64)
    if np.any(qo < 0) or np.any(kv < 0):
        raise ValueError(f"lengths must be non-negative, got qo_lens={qo.tolist()}, kv_lens={kv.tolist()}")
    if lens.seqused_k is not None:
        used = _host(lens.seqused_k).astype(np.int64)
        if np.any(used < 0) or np.any(used > kv):
            raise ValueError(f"runtime_metadata.seqused_k must lie in [0, kv_lens], got seqused_k={used.tolist()}, "
                             f"kv_lens={kv.tolist()}")
    if plan.is_static:  # the launch geometry and the table width follow the plan's maxima
        pp = plan.prefill_plan
        if np.any(qo > pp.max_seqlen_q) or np.any(kv > pp.max_seqlen_k):
            raise ValueError(f"runtime lengths exceed the static plan's max_seqlen_q={pp.max_seqlen_q} / "
                             f"max_seqlen_k={pp.max_seqlen_k}: qo_lens={qo.tolist()}, kv_lens={kv.tolist()}")
    total_q = q.shape[0]
    if np.any(cu_q[:-1] < 0) or np.any(cu_q[:-1] + qo > total_q):
        raise ValueError(f"cu_seqlens_q/qo_lens address rows outside q (total_q={total_q})")
    if plan.mode == "dense":
        cu_k = _host(lens.cu_seqlens_k).astype(np.int64)
        if np.any(cu_k[:-1] < 0) or np.any(cu_k[:-1] + kv > k.shape[0]):
            raise ValueError(f"cu_seqlens_k/kv_lens address rows outside k (total_k={k.shape[0]})")
        return
    page_list, indptr, _ = pages
    num_pages = int(k.shape[0])
    if indptr is not None:
        ptr = _host(indptr).astype(np.int64)
        n = page_list.shape[0]
        if np.any(np.diff(ptr) < 0) or ptr[0] < 0 or ptr[-1] > n:
            raise ValueError(f"kv_page_indptr is not a valid CSR offset vector into {n} kv_indices")
        tbl = ref.page_table_from_indptr(_host(page_list), ptr)
    else:
        tbl = _host(page_list)
    need = _ceil_div(kv, plan.page_size)
    if tbl.shape[1] < int(need.max(initial=0)):
        raise ValueError(f"the page table has {tbl.shape[1]} columns but a request needs {int(need.max())} pages")
    sel = None if kbi is None else _host(kbi)
    for b in range(plan.batch_size):
        if sel is None:
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
        ids = tbl[b, used]
        if np.any((ids < 0) | (ids >= num_pages)):
            raise ValueError(f"request {b} uses page id {int(ids[(ids < 0) | (ids >= num_pages)][0])} "
                             f"outside the cache of {num_pages} pages")


# ----------------------------------------------------------------------------- the validation


def validate(fn: str, info: tuple, q, k, v, kv_indices=None, kv_block_indexes=None, q_offset_override=None,
             out=None, lse=None, max_score=None, page_table=None, sm_scale=None, k_scale=1.0, v_scale=1.0,
             runtime_metadata=None, output_o=True, output_maxscore=False, want_lse=False, check_input_valid=False,
             workspace=None) -> tuple:
    """Check one MSA call; returns ``(MsaProblem, operands)``. Raises before anything runs.

    ``info`` is an unpacked plan info ``(mixed, split, batch, plan, prefill_plan)``. ``out`` and
    ``lse`` are used when ``output_o``, ``max_score`` when ``output_maxscore``; ``want_lse``
    asks for an ``lse`` result without a preallocated one. (The common single-plan call is
    kept to few Python-level calls: the per-call cost is part of the contract.)
    """
    mixed, split, _, first, second = info
    plans = (first, second) if mixed else (first,)
    if mixed and runtime_metadata is not None:
        raise NotImplementedError("runtime_metadata is not supported with mixed prefill/decode plans")
    check_given(fn, q=q, k=k, v=v)
    call = Call(q=q, k=k, v=v)
    add = call.add
    out_a = add("out", out) if output_o and out is not None else None
    lse_a = add("lse", lse) if output_o and lse is not None else None
    ms_a = add("max_score", max_score) if output_maxscore and max_score is not None else None
    seq = (list, tuple)  # Python sequences are host arrays
    idx_a = None if kv_indices is None else add(
        "kv_indices", np.asarray(kv_indices) if kv_indices.__class__ in seq else kv_indices)
    table_a = None if page_table is None else add(
        "page_table", np.asarray(page_table) if page_table.__class__ in seq else page_table)
    kbi_a = None if kv_block_indexes is None else add(
        "kv_block_indexes", np.asarray(kv_block_indexes) if kv_block_indexes.__class__ in seq else kv_block_indexes)
    override = q_offset_override
    if override is not None and not isinstance(override, (int, np.integer)):
        override = add("q_offset_override", _as_array(override))

    any_sparse = first.is_sparse
    if kbi_a is not None and not any_sparse and output_o:
        raise ValueError(f"kv_block_indexes needs a sparse plan (kv_block_num > 0), got plan mode {first.mode!r}")
    args = call.args
    qa, ka, va = args["q"], args["k"], args["v"]
    qshape = qa.shape
    if len(qshape) != 3:
        raise ValueError(f"q must have shape [total_q, Hq, D], got {qshape}")
    total_q, hq, d = qshape
    dtype = qa.dtype
    if not ((not output_o or dtype in ATTENTION_DTYPES) and (not output_maxscore or dtype in MAX_SCORE_DTYPES)
            and (not (output_o and any_sparse) or d == SPARSE_HEAD_DIM) and d in HEAD_DIMS):
        _check_head_dim_and_dtype(fn, any_sparse, d, dtype, attention=output_o, max_score=output_maxscore)
    if ka.dtype != dtype or va.dtype != dtype:
        raise TypeError(
            "q, k, and v must share the same dtype, got "
            f"{dtype_name(dtype)}, {dtype_name(ka.dtype)}, {dtype_name(va.dtype)}"
        )
    if hq != first.num_qo_heads:
        raise ValueError(f"q head count {hq} does not match plan.num_qo_heads {first.num_qo_heads}")
    kshape = ka.shape
    if first.mode == "dense":
        layout = ""
        for a in (ka, va):
            if a.ndim != 3:
                raise ValueError(f"{a.name} must have shape [total_k, Hkv, D] for a dense plan, got {a.shape}")
            if a.shape[1] != first.num_kv_heads:
                raise ValueError(f"{a.name} head count {a.shape[1]} does not match plan.num_kv_heads "
                                 f"{first.num_kv_heads}")
    else:
        layout = _kv_layout(ka, first)
        if va.shape != kshape:
            if _kv_layout(va, first) != layout:
                raise ValueError(f"k and v must use the same paged layout, got shapes {kshape} and {va.shape}")
    if kshape[-1] != d or va.shape[-1] != d:
        a = ka if kshape[-1] != d else va
        raise ValueError(f"{a.name} head dim {a.shape[-1]} does not match q head dim {d}")
    if kshape != va.shape:
        raise ValueError(f"k and v must have the same shape, got {kshape} and {va.shape}")
    # Rows of 16-byte chunks: head dim contiguous, strides and data 16-byte aligned; other
    # layouts are read from a contiguous copy.
    m = 16 // dtype.itemsize
    qs, ks, vs = qa.strides, ka.strides, va.strides
    if qs[2] != 1 or qs[0] % m or qs[1] % m or qa.ptr % 16:
        qa = _rows_of_chunks(call, qa)
        qs = qa.strides
    if ks[-1] != 1 or ks[0] % m or ks[1] % m or ks[-2] % m or ka.ptr % 16:
        same = va.ptr == ka.ptr and va.strides == ks  # (k and v one array: one copy)
        ka = _rows_of_chunks(call, ka)
        ks = ka.strides
        if same:
            va, vs = ka, ks
    if output_o and (vs[-1] != 1 or vs[0] % m or vs[1] % m or vs[-2] % m or va.ptr % 16):  # (max scores read no v)
        va = _rows_of_chunks(call, va)
        vs = va.strides
    kv_extent = kshape[0]
    if total_q * hq >= INDEX_LIMIT or kv_extent >= INDEX_LIMIT:
        raise NotImplementedError(f"{fn}: total_q * Hq and the KV rows/pages must stay below 2**31, got "
                                  f"{total_q * hq} and {kv_extent}")
    for plan in plans:
        if plan.batch_size > MAX_BATCH:
            raise NotImplementedError(f"{fn}: at most {MAX_BATCH} requests per plan part, got {plan.batch_size}")
        if output_maxscore:
            rows = plan.prefill_plan.max_seqlen_q * (hq // plan.num_kv_heads)
            if plan.num_kv_heads > MAX_KV_HEADS or rows >= INDEX_LIMIT or _ceil_div(rows, 16) * plan.batch_size \
                    >= INDEX_LIMIT:
                raise NotImplementedError(f"{fn}: the max score needs Hkv <= {MAX_KV_HEADS}, max_seqlen_q * Hq / "
                                          "Hkv < 2**31 and ceil(max_seqlen_q * Hq / Hkv / 16) * B < 2**31")
            if dtype == FP8_E4M3:
                check_fp8_max_score(fn, plan, hq, d, call.device)

    # Scales (the kernels take sm_scale * log2(e), times k_scale for fp8).
    is_fp8 = dtype == FP8_E4M3
    sm = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    k_scale, v_scale = float(k_scale), float(v_scale)
    if output_o and (k_scale != 1.0 or v_scale != 1.0) and not any_sparse:
        raise ValueError("k_scale/v_scale are currently supported only by sparse MSA")
    ms_scale = k_scale if is_fp8 and output_maxscore else 1.0
    if not (ms_scale > 0.0 and ms_scale != math.inf):
        raise NotImplementedError(f"{fn}: the float8 max score needs a positive finite k_scale, got {k_scale}")
    fp8_scales = is_fp8 and any_sparse
    if not fp8_scales:
        k_scale = v_scale = 1.0
    scale_log2 = sm * LOG2E * k_scale
    if output_o and not math.isfinite(v_scale):
        raise ValueError(f"{fn}: v_scale must be finite, got {v_scale}")
    if output_o and not (scale_log2 > 0.0 and scale_log2 != math.inf):
        raise NotImplementedError(
            f"{fn}: the attention kernels need a positive finite softmax scale, got sm_scale={sm}"
            + (f", k_scale={k_scale}" if fp8_scales else ""))

    if runtime_metadata is None and not first.is_static:
        expected_q = first.total_q + (second.total_q if mixed else 0)
        if total_q != expected_q:
            raise ValueError(f"q has {total_q} rows but the plan's qo lengths sum to {expected_q}")
        if first.mode == "dense":
            expected_k = first.prefill_plan.total_seqlen_k + (second.prefill_plan.total_seqlen_k if mixed else 0)
            if kv_extent < expected_k:
                raise ValueError(f"k has {kv_extent} rows but the plan's kv lengths sum to {expected_k}")

    out_dtype = BFLOAT16 if is_fp8 else dtype
    nt = max(max_k_tiles(p) for p in plans) if output_maxscore else 0
    if out_a is not None:
        if out_a.dtype != out_dtype or out_a.shape != qshape or (out_a.strides != (hq * d, d, 1)
                                                                and not out_a.is_contiguous()):
            _check_output(out_a, qshape, out_dtype, "[total_q, Hq, D]")
        if out_a.size and out_a.ptr % 16:  # the kernels store 16-byte chunks of its rows
            raise ValueError(f"out: the data must be 16-byte aligned, got address {out_a.ptr:#x}")
    if lse_a is not None:
        if lse_a.dtype != FLOAT32 or lse_a.shape != (total_q, hq) or (lse_a.strides != (hq, 1)
                                                                     and not lse_a.is_contiguous()):
            _check_output(lse_a, (total_q, hq), FLOAT32, "[total_q, Hq]")
    if ms_a is not None:
        if ms_a.dtype != FLOAT32:
            raise TypeError(f"max_score must be float32, got {dtype_name(ms_a.dtype)}")
        if ms_a.ndim != 3 or ms_a.shape[:2] != (total_q, hq) or ms_a.shape[2] < nt:
            raise ValueError(
                f"max_score must have shape [total_q, Hq, max_k_tiles] = ({total_q}, {hq}, {nt}) "
                f"(a wider last dim is allowed), got {ms_a.shape}"
            )
        if not ms_a.is_contiguous():
            raise ValueError("max_score must be contiguous")
    kbi = None
    if any_sparse and output_o and kbi_a is not None:
        kbi = _check_block_indexes(call, kbi_a, first, total_q)
    if override.__class__ is Arg:
        _check_override(override, first.batch_size + (second.batch_size if mixed else 0))

    # Parts: one per plan; a mixed plan splits rows, KV rows (dense) or flat page ids (paged).
    if mixed:
        q_split = first.total_q
        row_ranges = ((0, q_split), (q_split, total_q))
        if first.mode == "dense":
            kv_split = int(first.prefill_plan.total_seqlen_k)
            kv_ranges = ((0, kv_split), (kv_split, kv_extent))
        else:
            kv_ranges = ((0, kv_extent), (0, kv_extent))  # one shared page pool
        page_split = int(first.kv_page_indptr[-1]) if first.kv_page_indptr is not None and first.batch_size else 0
        idx_parts = ((None, None) if idx_a is None
                     else (_rows(idx_a, 0, page_split), _rows(idx_a, page_split, idx_a.shape[0])))
        table_parts = ((None, None) if table_a is None
                       else (_rows(table_a, 0, split), _rows(table_a, split, table_a.shape[0])))
        ov_parts = ((_rows(override, 0, split), _rows(override, split, override.shape[0]))
                    if override.__class__ is Arg else (override, override))
    else:
        row_ranges, kv_ranges = ((0, total_q),), ((0, kv_extent),)
        idx_parts, table_parts, ov_parts = (idx_a,), (table_a,), (override,)

    parts, operands, configs = [], [], []
    for i, plan in enumerate(plans):
        r0, r1 = row_ranges[i]
        k0, k1 = kv_ranges[i]
        vec = plan.device_vectors
        if runtime_metadata is None and vec is not None and vec.device == call.device and vec.lengths is not None:
            lens = vec.lengths  # an uploaded eager plan on its device
        else:
            lens = resolve_lengths(fn, plan, runtime_metadata, call)
        offsets = lens.qo_offset if ov_parts[i] is None else _offsets(call, plan, lens, ov_parts[i],
                                                                      runtime_metadata)
        part_kbi = kbi if not mixed else _rows(kbi, r0, r1)
        table_i, idx_i = table_parts[i], idx_parts[i]
        att_pages = ms_pages = _NO_PAGES
        att_src = ms_src = "dense"
        attention = None
        if output_o:
            if plan.mode == "dense":
                if table_i is not None and lens.page_table is not None:
                    raise ValueError("page_table argument and runtime_metadata.page_table are mutually exclusive")
            else:
                if plan.is_sparse:
                    _check_sparse_part(fn, plan, lens, table_i, idx_i, part_kbi)
                att_pages = _attention_pages(fn, call, plan, lens, table_i, idx_i)
                att_src = "table" if att_pages[1] is None else "csr"
            attention, launch = _part_attention(plan, r1 - r0, d, DTYPE_CODES[dtype], call.device)
            configs.append(launch)
        if output_maxscore:
            if plan.mode == "dense":
                if table_i is not None and lens.page_table is not None:
                    raise ValueError("page_table argument and runtime_metadata.page_table are mutually exclusive")
            else:
                ms_pages = _max_score_pages(fn, call, plan, lens, table_i, idx_i, runtime_metadata)
                ms_src = "table" if ms_pages[1] is None else "csr"
        if mixed:
            q_part, k_part, v_part = _rows(qa, r0, r1), _rows(ka, k0, k1), _rows(va, k0, k1)
        else:
            q_part, k_part, v_part = qa, ka, va
        if check_input_valid:
            if output_o:
                _check_pages(plan, q_part, k_part, lens, att_pages, part_kbi if plan.is_sparse else None)
            if output_maxscore and (not output_o or ms_pages is not att_pages):
                _check_pages(plan, q_part, k_part, lens, ms_pages, None)
        parts.append((plan, row_ranges[i], attention, att_src, ms_src))
        operands.append(_PartOperands(q_part, k_part, v_part, lens, offsets, att_pages, ms_pages, part_kbi))

    key = (fn, call.device, dtype, qshape, layout, sm, k_scale, v_scale, ms_scale, bool(output_o),
           bool(output_maxscore), bool(want_lse), bool(check_input_valid), nt, parts)
    last = first.last_call
    if last is not None and last[0] == key:
        prob = last[1]
    else:
        prob = MsaProblem(
            fn=fn, is_cuda=call.device >= 0, device=call.device, dtype=dtype, out_dtype=out_dtype, head_dim=d,
            kv_layout=layout, sm_scale=sm, k_scale=k_scale, v_scale=v_scale, scale_log2=scale_log2,
            max_score_scale=ms_scale,
            output_o=bool(output_o), output_maxscore=bool(output_maxscore), want_lse=bool(want_lse),
            check_input_valid=bool(check_input_valid), max_k_tiles=nt,
            parts=tuple(PartProblem(*part) for part in parts))
        first.last_call = (key, prob)
    ops = _Operands(call)
    ops.out, ops.lse, ops.max_score = out_a, lse_a, ms_a
    ops.parts, ops.configs = operands, configs
    ops.q_strides, ops.k_strides, ops.v_strides, ops.kv_extent = qs, ks, vs, kv_extent
    ops.workspace = workspace
    return prob, ops


def _check_sparse_part(fn: str, plan: MsaPlan, lens: Lengths, table, idx, kbi) -> None:
    """The sparse attention pass's own conditions."""
    if idx is None and table is None and lens.page_table is None:
        raise ValueError("sparse MSA forward requires kv_indices or page_table")
    if kbi is None:
        raise ValueError("sparse MSA forward requires kv_block_indexes")
    if plan.num_kv_splits > 1:
        raise ValueError(f"MSA forward currently requires num_kv_splits <= 1, got {plan.num_kv_splits}")
    ratio = plan.num_qo_heads // plan.num_kv_heads
    if ratio not in SPARSE_GQA_RATIOS:
        raise ValueError(f"sparse MSA forward requires a Hq/Hkv ratio in {SPARSE_GQA_RATIOS}, got {ratio}")
    if plan.prefill_plan.max_seqlen_k > SPARSE_MAX_SEQLEN_K:
        raise NotImplementedError(f"{fn}: sparse attention supports max_seqlen_k up to {SPARSE_MAX_SEQLEN_K}, "
                                  f"got {plan.prefill_plan.max_seqlen_k}")


# ----------------------------------------------------------------------------- running


class StartedCall:
    """A call between :func:`start` and :func:`finish`: its ready prepared launch and the
    addresses to run it with, or its validated problem and operands (and the key under
    which :func:`finish` stores the launch it prepares)."""

    __slots__ = ("prepared", "addresses", "out", "lse", "prob", "ops", "key", "runtime_metadata")

    def __init__(self, prepared=None, addresses=None, out=None, lse=None, prob=None, ops=None, key=None,
                 runtime_metadata=None):
        self.prepared, self.addresses, self.out, self.lse = prepared, addresses, out, lse
        self.prob, self.ops, self.key, self.runtime_metadata = prob, ops, key, runtime_metadata


def _lookup_prepared(fn, info, q, k, v, kv_indices, kv_block_indexes, q_offset_override, out, lse, page_table,
                     sm_scale, k_scale, v_scale, runtime_metadata, output_o, output_maxscore, want_lse,
                     check_input_valid, workspace) -> tuple:
    """``(entry, key)``: the plan's ready :class:`PreparedCall` for this call (or None) and the
    call's key (``(key, addresses)``; None when the call is not preparable or its key holds
    False: calls with it take the validated path, :func:`_prepare`)."""
    if not (output_o and not output_maxscore and not check_input_valid and q_offset_override is None
            and workspace is None and out is not None and not info[0] and (lse is not None or not want_lse)):
        return None, None
    key = _prepared_key(fn, q, k, v, out, lse, kv_indices, page_table, kv_block_indexes, runtime_metadata,
                        sm_scale, k_scale, v_scale, want_lse)
    if key is None:
        return None, None
    entry = info[3].prepared_calls.get(key[0])
    if entry is False:
        return None, None
    return (entry if entry is not None and entry.ready(info[3]) else None), key


def run(fn: str, info: tuple, q, k, v, kv_indices, kv_block_indexes, q_offset_override, out, lse, max_score,
        page_table, sm_scale, k_scale, v_scale, runtime_metadata, output_o, output_maxscore, want_lse,
        check_input_valid, workspace):
    """Validate and run one MSA call (arguments as :func:`validate`, all given); returns
    ``(out, lse, max_score)`` in the caller's framework. Preallocated arrays are written in
    place and returned as the same objects.

    A CUDA call of one plan part with torch tensors, given outputs and the plan's workspace
    (:func:`_prepared_key`) runs the :class:`PreparedCall` its plan holds for calls with
    equal array metadata and options, made by the first such call after its validation
    (False is held for keys whose calls take the validated path, :func:`_prepare`).
    """
    entry, key = _lookup_prepared(fn, info, q, k, v, kv_indices, kv_block_indexes, q_offset_override, out, lse,
                                  page_table, sm_scale, k_scale, v_scale, runtime_metadata, output_o,
                                  output_maxscore, want_lse, check_input_valid, workspace)
    if entry is not None:
        entry.run(key[1])
        return out, lse, None
    prob, ops = validate(fn, info, q, k, v, kv_indices, kv_block_indexes, q_offset_override, out, lse, max_score,
                         page_table, sm_scale, k_scale, v_scale, runtime_metadata, output_o, output_maxscore,
                         want_lse, check_input_valid, workspace)
    return _finish_validated(prob, ops, key, runtime_metadata)


def start(fn: str, info: tuple, q, k, v, kv_indices, kv_block_indexes, q_offset_override, out, lse, max_score,
          page_table, sm_scale, k_scale, v_scale, runtime_metadata, output_o, output_maxscore, want_lse,
          check_input_valid, workspace) -> StartedCall:
    """:func:`run` up to its first launch (arguments as :func:`run`): the ready prepared
    launch, else the validation; :func:`finish` runs the rest. For callers that launch other
    work between the two (the MSA pipeline)."""
    entry, key = _lookup_prepared(fn, info, q, k, v, kv_indices, kv_block_indexes, q_offset_override, out, lse,
                                  page_table, sm_scale, k_scale, v_scale, runtime_metadata, output_o,
                                  output_maxscore, want_lse, check_input_valid, workspace)
    if entry is not None:
        return StartedCall(prepared=entry, addresses=key[1], out=out, lse=lse)
    prob, ops = validate(fn, info, q, k, v, kv_indices, kv_block_indexes, q_offset_override, out, lse, max_score,
                         page_table, sm_scale, k_scale, v_scale, runtime_metadata, output_o, output_maxscore,
                         want_lse, check_input_valid, workspace)
    return StartedCall(prob=prob, ops=ops, key=key, runtime_metadata=runtime_metadata)


def finish(started: StartedCall) -> tuple:
    """Run a :func:`start`-ed call; returns ``(out, lse, max_score)`` as :func:`run` does."""
    if started.prepared is not None:
        started.prepared.run(started.addresses)
        return started.out, started.lse, None
    return _finish_validated(started.prob, started.ops, started.key, started.runtime_metadata)


def _finish_validated(prob: MsaProblem, ops: _Operands, key, runtime_metadata) -> tuple:
    """Allocate the outputs not given, then launch (CUDA; preparing the launch under ``key``)
    or run the references (host)."""
    call = ops.call
    plan = prob.parts[0].plan
    if prob.output_o:
        if ops.out is None:
            ops.out = call.new("out", call.args["q"].shape, prob.out_dtype)
        if ops.lse is None and prob.want_lse:
            ops.lse = call.new("lse", call.args["q"].shape[:2], FLOAT32)
    if prob.output_maxscore and ops.max_score is None:
        total_q, hq = call.args["q"].shape[:2]
        ops.max_score = call.new("max_score", (total_q, hq, prob.max_k_tiles), FLOAT32)
    if prob.is_cuda:
        entry = None if key is None else _prepare(prob, ops, runtime_metadata)
        if key is not None:
            plan.prepared_calls.put(key[0], False if entry is None else entry)
        if entry is None:
            _run_cuda(prob, ops)
        else:
            with call.device_scope():
                entry.run(key[1])
    else:
        _run_host(prob, ops)
    out = ops.out.obj if prob.output_o else None
    lse = ops.lse.obj if prob.output_o and ops.lse is not None else None
    ms = ops.max_score.obj if prob.output_maxscore else None
    return out, lse, ms


# ----------------------------------------------------------------------------- prepared calls

#: Positions of a prepared call's arrays in its address tuple (runtime metadata from 8 on).
_CALL_ARRAYS = ("q", "k", "v", "out", "lse", "kv_indices", "page_table", "kv_block_indexes")
_PLAIN = frozenset((type(None), bool, int, float))  # scale types a key holds (immutable values)
_METADATA = ("qo_lens", "kv_lens", "qo_offset", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table",
             "kv_page_indptr")


def _prepared_key(fn, q, k, v, out, lse, kv_indices, page_table, kv_block_indexes, md, sm_scale, k_scale, v_scale,
                  want_lse) -> Optional[tuple]:
    """``(key, addresses)`` of a call a :class:`PreparedCall` may run: every array a torch CUDA
    tensor (or None); the key holds what validation reads of them (their metadata) and the
    options. None for any other call, or a scale that is not a plain Python value."""
    if not (sm_scale.__class__ in _PLAIN and k_scale.__class__ in _PLAIN and v_scale.__class__ in _PLAIN):
        return None
    if md is None:
        found = torch_cuda_addresses((q, k, v, out, lse, kv_indices, page_table, kv_block_indexes))
    elif md.__class__ is MsaRuntimeMetadata:
        found = torch_cuda_addresses((q, k, v, out, lse, kv_indices, page_table, kv_block_indexes, md.qo_lens,
                                      md.kv_lens, md.qo_offset, md.cu_seqlens_q, md.cu_seqlens_k, md.seqused_k,
                                      md.page_table, md.kv_page_indptr))
    else:
        return None
    if found is None:
        return None
    return (fn, found[0], sm_scale, k_scale, v_scale, want_lse), found[1]


class PreparedCall:
    """The launches of a validated single-part CUDA call, for later calls with equal array
    metadata and options (the key of :func:`_prepared_key`): everything but the arrays'
    addresses is fixed, so a later call checks the plan state they depend on and launches.

    Held by the plan (``MsaPlan.prepared_calls``, bounded) and freed with it. ``vectors`` and
    ``workspace`` are the plan's uploaded vectors and workspace whose addresses the launches
    hold (None when they use none): a later call runs only while the plan still holds the
    same objects, on the same current device.
    """

    __slots__ = ("device", "vectors", "workspace", "launches")

    def __init__(self, device: int, vectors, workspace, launches: tuple):
        self.device, self.vectors, self.workspace, self.launches = device, vectors, workspace, launches

    def ready(self, plan: MsaPlan) -> bool:
        return ((self.vectors is None or plan.device_vectors is self.vectors)
                and (self.workspace is None or plan.workspace is self.workspace)
                and current_device() == self.device)

    def run(self, addresses: tuple) -> None:
        stream = torch_stream_ptr(self.device)
        for launch in self.launches:
            launch.run(addresses, stream)


class _NotPreparable(Exception):
    pass


def _prepare(prob: MsaProblem, ops: _Operands, md) -> Optional[PreparedCall]:
    """The :class:`PreparedCall` of a validated torch call (``_prepared_key`` found its
    arrays), else None (:func:`prepare_call`)."""
    return prepare_call(prob, ops, md) if ops.call.framework == "torch" else None


def prepare_call(prob: MsaProblem, ops: _Operands, md) -> Optional[PreparedCall]:
    """The :class:`PreparedCall` of a validated CUDA call (``validate``'s result; ``md`` its
    runtime metadata), its addresses in the order of ``_CALL_ARRAYS`` then ``_METADATA``; None
    when its launches use anything but the call's arrays, the plan's uploaded vectors and
    workspace, and values fixed by the arrays' metadata and the options (more than one plan
    part, no output, max scores, a staged copy, the gather tile)."""
    if len(prob.parts) != 1 or not prob.output_o or prob.output_maxscore:
        return None
    part, pa = prob.parts[0], ops.parts[0]
    config, kernels = ops.configs[0]
    if config.tile == al.GATHER:
        return None
    plan, call = part.plan, ops.call
    sources = {}
    for i, name in enumerate(_CALL_ARRAYS):
        arg = call.args.get(name)
        if arg is not None:
            sources[id(arg)] = Source(i)
    if md is not None:
        lens = pa.lens
        for i, name in enumerate(_METADATA):
            if getattr(md, name) is not None:
                sources[id(getattr(lens, name))] = Source(len(_CALL_ARRAYS) + i)
    vec = plan.device_vectors if not plan.is_static else None
    fixed = set() if vec is None else {id(getattr(vec, name)) for name in vec.__slots__ if name not in
                                       ("device", "buffer", "lengths") and getattr(vec, name) is not None}

    def source(arg):
        if arg is None or isinstance(arg, int):
            return arg
        src = sources.get(id(arg))
        if src is not None:
            return src
        if id(arg) in fixed:
            return arg
        raise _NotPreparable

    try:
        ws_ptr = _workspace_ptr(prob, ops)
        args = _attention_arguments(prob, ops, 0, ws_ptr)
        arrays, lengths, pages = (tuple(source(a) for a in group) for group in args[2:5])
    except _NotPreparable:
        return None
    n = len(_CALL_ARRAYS) + (0 if md is None else len(_METADATA))
    launches = () if config.tile == "" else tuple(
        PreparedLaunch(kernel, grid, block, params, values, shared_mem=smem, n_addresses=n)
        for kernel, grid, block, params, values, smem in al.attention_launches(
            args[0], config, arrays, lengths, pages, args[5], args[6], ws_ptr, kernels))
    return PreparedCall(call.device, vec if any(id(a) in fixed for a in lengths + pages if a is not None) else None,
                        plan.workspace if ws_ptr else None, launches)


def _workspace_ptr(prob: MsaProblem, ops: _Operands) -> int:
    """Address of the attention passes' workspace (0 when they need none)."""
    launches = ops.configs
    need = launches[0][0].workspace_bytes if len(launches) == 1 else max(c.workspace_bytes for c, _ in launches)
    if not need:
        return 0
    ws, device = ops.workspace, ops.call.device
    if ws is None:
        ws = _plan_workspace(prob, need, ops.call)
    elif ws.__class__ is not Workspace or ws.nbytes < need or ws.device != device:
        ws = as_workspace(ws, need, device)
    return ws.ptr


def _attention_arguments(prob: MsaProblem, ops: _Operands, i: int, ws_ptr: int) -> tuple:
    """``run_attention``'s arguments for part ``i`` (but the device and stream): ``(problem,
    config, arrays, lengths, pages, layout, scales, workspace, kernels)``."""
    part, pa = prob.parts[i], ops.parts[i]
    layout = prob.kv_layout
    ks, vs = ops.k_strides, ops.v_strides
    if layout == "":
        k_strides, v_strides = (0, ks[0], ks[1]), (0, vs[0], vs[1])
    elif layout == "NHD":
        k_strides, v_strides = ks[:3], vs[:3]
    else:
        k_strides, v_strides = (ks[0], ks[2], ks[1]), (vs[0], vs[2], vs[1])
    out, lse = ops.out, ops.lse
    if len(prob.parts) > 1:
        r0, r1 = part.rows
        out, lse = _rows(out, r0, r1), _rows(lse, r0, r1)
    lens = pa.lens
    config, kernels = ops.configs[i]
    return (part.attention, config, (pa.q, pa.k, pa.v, out, lse),
            (lens.cu_seqlens_q, lens.qo_lens, lens.kv_lens if lens.seqused_k is None else lens.seqused_k,
             pa.offsets, lens.cu_seqlens_k if part.plan.mode == "dense" else None), pa.att_pages + (pa.kbi,),
            (ops.q_strides, ops.out.strides, k_strides, v_strides, pa.k.shape[0]), (prob.scale_log2, prob.v_scale),
            ws_ptr, kernels)


def _run_cuda(prob: MsaProblem, ops: _Operands) -> None:
    call = ops.call
    stream, device = call.stream_ptr, call.device
    ws_ptr = _workspace_ptr(prob, ops) if prob.output_o else 0
    switch = current_device() != device
    if switch:
        scope = call.device_scope()
        scope.__enter__()
    try:
        for i, part in enumerate(prob.parts):
            pa = ops.parts[i]
            r0, r1 = part.rows
            lens = pa.lens
            dense = part.plan.mode == "dense"
            if prob.output_o:
                args = _attention_arguments(prob, ops, i, ws_ptr)
                al.run_attention(*args[:8], device, stream, args[8])
            if prob.output_maxscore:
                table = indices = indptr = None
                if part.max_score_pages == "table":
                    table = pa.ms_pages[0]
                elif part.max_score_pages == "csr":
                    indices, indptr = pa.ms_pages[0], pa.ms_pages[1]
                index_launch.run_max_score(
                    pa.q, pa.k, _rows(ops.max_score, r0, r1), cu_seqlens_q=lens.cu_seqlens_q,
                    qo_lens=lens.qo_lens, kv_lens=lens.keys_read, qo_offset=pa.offsets,
                    cu_seqlens_k=lens.cu_seqlens_k if dense else None, page_table=table, kv_indices=indices,
                    kv_page_indptr=indptr, kv_layout=prob.kv_layout or "NHD",
                    page_size=0 if dense else part.plan.page_size,
                    max_seqlen_q=part.plan.prefill_plan.max_seqlen_q, causal=part.plan.causal, stream=stream,
                    score_scale=prob.max_score_scale)
    finally:
        if switch:
            scope.__exit__(None, None, None)


def _table_host(pages: tuple) -> np.ndarray:
    page_list, indptr, _ = pages
    if indptr is None:
        return page_list.data
    return ref.page_table_from_indptr(page_list.data, indptr.data)


def _run_host(prob: MsaProblem, ops: _Operands) -> None:
    for part, pa in zip(prob.parts, ops.parts):
        plan, lens = part.plan, pa.lens
        r0, r1 = part.rows
        q, k, v = pa.q.data, pa.k.data, pa.v.data
        eff = lens.effective_kv_lens()
        qo_lens, cu_q, offsets = lens.qo_lens.data, lens.cu_seqlens_q.data, pa.offsets.data
        if prob.output_o:
            common = dict(qo_offset=offsets, causal=plan.causal, sm_scale=prob.sm_scale, qo_lens=qo_lens)
            if plan.mode == "dense":
                o, l = ref.dense_attention(q, k, v, cu_q, lens.cu_seqlens_k.data, kv_lens=eff, **common)
            elif plan.mode == "paged":
                o, l = ref.paged_attention(q, k, v, cu_q, eff, _table_host(pa.att_pages), kv_layout=prob.kv_layout,
                                           **common)
            else:
                o, l = ref.sparse_attention(q, k, v, cu_q, eff, _table_host(pa.att_pages), pa.kbi.data,
                                            k_scale=prob.k_scale, v_scale=prob.v_scale, kv_layout=prob.kv_layout,
                                            **common)
            ops.out.data[r0:r1] = o.astype(prob.out_dtype)
            if ops.lse is not None:
                ops.lse.data[r0:r1] = l.astype(np.float32)
        if prob.output_maxscore:
            ms = ops.max_score.data[r0:r1]
            common = dict(qo_offset=offsets, causal=plan.causal, max_k_tiles=ms.shape[2], qo_lens=qo_lens,
                          k_scale=prob.max_score_scale)
            if plan.mode == "dense":
                res = ref.block_max_score(q, k, cu_q, lens.cu_seqlens_k.data, kv_lens=eff, **common)
            else:
                res = ref.paged_block_max_score(q, k, cu_q, eff, _table_host(pa.ms_pages), kv_layout=prob.kv_layout,
                                                **common)
            ms[...] = res.astype(np.float32)
