"""The MSA pipeline as one call: index max score -> top-k block selection -> block-sparse attention.

A pipeline plan holds everything the three passes need and owns their buffers: the sparse
attention plan, the max-score plan(s) of the index branch, the query positions of the
selection, the ``max_score`` buffer and the ``[total_q, Hkv, W]`` selection.
:func:`sparse_attention_pipeline` runs the passes on the caller's stream; with preallocated
``out`` (and ``lse``) it allocates nothing and reads nothing back, so a CUDA graph captures it.

* :func:`sparse_pipeline_plan` (eager, from concrete lengths; prefill, decode or mixed
  batches): the index branch's scores are materialised one query window at a time, a
  window holding at most ``max_score_bytes`` of float32 block maxima
  (``rows * Hkv * ceil(max_kv / 128) * 4``), so the buffers stay bounded at any sequence
  length (a 1M-token prefill with 4 index heads takes 8192-row windows at the default 1 GiB).
* :func:`sparse_pipeline_static_plan` (capacities; lengths and pages come with each call as
  :class:`~mate_cupy.MsaRuntimeMetadata`, so one captured graph serves every step of a
  serving loop): one window over the plan's capacity; the query positions are computed on
  the device from the metadata.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .._logging import mate_api
from ..checks import check_given, int_arg
from ..runtime.interop import FP8_E4M3, Call, as_dtype
from .execute import check_fp8_max_score, finish, start
from ..util_ops import launch_query_positions
from .ops import msa
from .plan import (
    SPARSE_BLOCK_SIZE,
    MsaPlanInfo,
    _int32_vector,
    device_index,
    msa_plan,
    msa_plan_from_lengths,
    normalize_qo_offset,
    resolve_heads,
    selected_block_count,
    stream_address,
    unpack_plan_info,
    upload_plan,
)
from .topk import plan_query_positions, sparse_topk_select

__all__ = ["SparsePipelinePlan", "sparse_attention_pipeline", "sparse_pipeline_plan", "sparse_pipeline_static_plan"]

#: default bound of one window's float32 block maxima (bytes)
MAX_SCORE_BYTES = 1 << 30

_PLAN_HOOKS: list = []


def add_pipeline_plan_hook(hook) -> None:
    """Call ``hook(plan)`` for every pipeline plan built from now on (integrations register
    plans there, outside any tracing framework). Hooks must not raise."""
    if hook not in _PLAN_HOOKS:
        _PLAN_HOOKS.append(hook)


def _built(plan: "SparsePipelinePlan") -> "SparsePipelinePlan":
    for hook in _PLAN_HOOKS:
        hook(plan)
    return plan


@dataclass(frozen=True)
class IndexWindow:
    """Query rows ``[row_begin, row_end)`` of the batch and the max-score plan that scores them
    (each request's rows clipped to the window, its offset moved to the window's first row)."""

    row_begin: int
    row_end: int
    plan: MsaPlanInfo


@dataclass(eq=False)
class SparsePipelinePlan:
    """An MSA pipeline: the plans of its three passes and the buffers it owns.

    ``attention``: the sparse plan (``sparse_prefill``, ``sparse_decode`` or mixed) of the
    main attention, ``num_qo_heads`` over ``num_kv_heads``. ``windows``: the index branch's
    max-score plans (``num_kv_heads`` index heads over ``num_index_kv_heads``, page size 128),
    one per query window of at most ``window_rows`` rows (static plans: one window over the
    capacity). ``is_static``: lengths come with each call (``runtime_metadata``) and
    ``total_q`` is the row capacity. ``positions`` (int64 ``[total_q]``), ``max_score``
    (float32 ``[window_rows, Hkv, max_k_tiles]``) and ``selection`` (int32 ``[total_q, Hkv,
    W]``, the last run's block lists, readable after it) live on ``device`` (CuPy arrays) or
    on the host (NumPy) for host plans. Memory is freed with the plan.
    """

    attention: MsaPlanInfo
    windows: tuple
    num_qo_heads: int
    num_kv_heads: int
    num_index_kv_heads: int
    topk: int
    force_begin_blocks: int
    force_end_blocks: int
    force_blocks_count_in_topk: bool
    device: Optional[int]
    is_static: bool
    causal: bool
    positions: Any = field(repr=False)
    max_score: Any = field(repr=False)
    selection: Any = field(repr=False)

    @property
    def total_q(self) -> int:
        """Query rows (static plans: the row capacity ``batch_size * max_seqlen_q``)."""
        return int(self.positions.shape[0])

    @property
    def window_rows(self) -> int:
        """Rows of one query window (the ``max_score`` buffer's)."""
        return int(self.max_score.shape[0])

    @property
    def max_k_tiles(self) -> int:
        """``ceil(max kv_len / 128)``: blocks per row of ``max_score``."""
        return int(self.max_score.shape[2])

    @property
    def width(self) -> int:
        """``W``: block ids per (query, index head) in :attr:`selection`."""
        return int(self.selection.shape[2])

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the buffers the plan owns (positions, one window's max scores, selection)."""
        return int(self.positions.nbytes + self.max_score.nbytes + self.selection.nbytes)


def _windows(qo: np.ndarray, kv: np.ndarray, offsets: np.ndarray, window_rows: int) -> list:
    """Per window ``(row_begin, row_end, qo_lens, qo_offset)``: each request's rows clipped to the
    window, its offset moved to its first row inside it."""
    cu = np.concatenate([[0], np.cumsum(qo, dtype=np.int64)])
    total = int(cu[-1])
    out = []
    for a in range(0, max(total, 1), window_rows):
        b = min(a + window_rows, total)
        lo = np.clip(cu[:-1], a, b)
        hi = np.clip(cu[1:], a, b)
        skipped = np.clip(a - cu[:-1], 0, qo)  # rows of each request before the window
        out.append((a, b, (hi - lo).astype(np.int32), (offsets.astype(np.int64) + skipped).astype(np.int32)))
    return out


def _new_array(device: Optional[int], shape: tuple, dtype, host: Optional[np.ndarray] = None):
    if device is None:
        return np.empty(shape, dtype) if host is None else host
    import cupy

    with cupy.cuda.Device(device):
        if host is None:
            return cupy.empty(shape, dtype)
        arr = cupy.asarray(host)
        cupy.cuda.get_current_stream().synchronize()  # ready for any stream
        return arr


def _pipeline_args(num_qo_heads, num_kv_heads, num_index_kv_heads, topk, force_begin_blocks, force_end_blocks,
                   max_score_bytes, head_dim, dtype) -> tuple:
    """The pipeline planners' scalar arguments, checked: ``(Hq, Hkv, index Hkv, topk, begin, end,
    max_score_bytes, head_dim, dtype)``; ``num_kv_heads`` None or non-positive means ``Hq``."""
    hq, hkv = resolve_heads(num_qo_heads, num_kv_heads)
    return (hq, hkv, int_arg("num_index_kv_heads", num_index_kv_heads, lo=1), int_arg("topk", topk),
            int_arg("force_begin_blocks", force_begin_blocks, lo=0), int_arg("force_end_blocks", force_end_blocks, lo=0),
            int_arg("max_score_bytes", max_score_bytes, lo=1, hi=None), int_arg("head_dim", head_dim, lo=1),
            as_dtype(dtype, "dtype"))


@mate_api
def sparse_pipeline_plan(qo_segment_lens, kv_segment_lens, num_qo_heads: int, num_kv_heads: Optional[int] = None,
                         *, num_index_kv_heads: int = 1, topk: int = 16,
                         force_begin_blocks: int = 0, force_end_blocks: int = 0,
                         force_blocks_count_in_topk: bool = True, qo_offset=None, causal: bool = True,
                         split_prefill_decode: bool = True, prefill_tile: Optional[str] = "gather",
                         max_score_bytes: int = MAX_SCORE_BYTES, head_dim: int = 128, dtype="bfloat16",
                         device=None, stream=None) -> SparsePipelinePlan:
    """Plan the MSA pipeline of one batch from concrete lengths (read once on the host).

    ``qo_segment_lens``, ``kv_segment_lens``: ``[B]`` whole numbers; decode-sized requests
    (``qo_len <= 32``) first when ``split_prefill_decode`` mixes them with prefills.
    ``num_qo_heads``/``num_kv_heads``: the main attention's heads (Hq/Hkv 8 or 16, head dim
    128, page size 128). The index branch has ``num_kv_heads`` query heads (index head ``h``
    selects the blocks of KV head ``h``) over ``num_index_kv_heads`` index KV heads.
    ``topk`` (4, 8, 16, 32, 64) and the forced blocks as in
    :func:`~mate_cupy.sparse_topk_select`. ``qo_offset``, ``causal``, ``prefill_tile`` as in
    :func:`~mate_cupy.msa_plan_from_lengths`. ``max_score_bytes`` bounds one window's
    float32 block maxima (``ValueError`` if not positive). ``head_dim``/``dtype`` (q's
    dtype) size the attention workspace and load the kernels when the plan is uploaded.
    ``device``: None (CuPy's current GPU when the process sees one, else a host plan), an
    int / ``"cuda:N"`` / torch or CuPy device, or ``"cpu"``; ``stream``: where the uploads
    are ordered (None: the device's current CuPy stream, then synchronised).
    """
    from .plan import _current_cuda_device

    qo = _int32_vector("qo_segment_lens", qo_segment_lens)
    kv = _int32_vector("kv_segment_lens", kv_segment_lens)
    (num_qo_heads, num_kv_heads, num_index_kv_heads, topk, force_begin_blocks, force_end_blocks, max_score_bytes,
     head_dim, dtype) = _pipeline_args(num_qo_heads, num_kv_heads, num_index_kv_heads, topk, force_begin_blocks,
                                       force_end_blocks, max_score_bytes, head_dim, dtype)
    stream_address(stream)  # (checked even for a host plan)
    dev = _current_cuda_device() if device is None else device_index(device)  # None: a host plan
    attention = msa_plan_from_lengths(
        qo, kv, num_qo_heads, num_kv_heads, qo_offset=qo_offset, split_prefill_decode=split_prefill_decode,
        page_size=SPARSE_BLOCK_SIZE, kv_block_num=int(topk), force_begin_blocks=force_begin_blocks,
        force_end_blocks=force_end_blocks, force_blocks_count_in_topk=force_blocks_count_in_topk, causal=causal,
        prefill_tile=prefill_tile, device="cpu")
    width = selected_block_count(int(topk), int(force_begin_blocks), int(force_end_blocks),
                                 bool(force_blocks_count_in_topk))
    offsets = normalize_qo_offset(qo, kv, qo_offset)
    total_q = int(qo.astype(np.int64).sum())
    nt = max(1, -(-int(kv.max(initial=0)) // SPARSE_BLOCK_SIZE))
    row_bytes = num_kv_heads * nt * 4
    window_rows = max(1, min(max(total_q, 1), int(max_score_bytes) // row_bytes))
    windows = []
    for a, b, wqo, woff in _windows(qo, kv, offsets, window_rows):
        wplan = msa_plan_from_lengths(wqo, kv, num_kv_heads, int(num_index_kv_heads), qo_offset=woff,
                                      split_prefill_decode=False, page_size=SPARSE_BLOCK_SIZE,
                                      output_maxscore=True, causal=causal, device="cpu")
        windows.append(IndexWindow(a, b, wplan))
    plan = SparsePipelinePlan(
        attention=attention, windows=tuple(windows), num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        num_index_kv_heads=int(num_index_kv_heads), topk=int(topk),
        force_begin_blocks=int(force_begin_blocks), force_end_blocks=int(force_end_blocks),
        force_blocks_count_in_topk=bool(force_blocks_count_in_topk), device=dev, is_static=False,
        causal=bool(causal),
        positions=_new_array(dev, (total_q,), np.int64, plan_query_positions(attention)),
        max_score=_new_array(dev, (window_rows, num_kv_heads, nt), np.float32),
        selection=_new_array(dev, (total_q, num_kv_heads, width), np.int32))
    if dev is not None:
        upload_plan(attention, dev, stream, head_dim=int(head_dim), dtype=as_dtype(dtype))
        for w in windows:
            upload_plan(w.plan, dev, stream)
    return _built(plan)


@mate_api
def sparse_pipeline_static_plan(batch_size: int, max_seqlen_q: int, max_seqlen_k: int, num_qo_heads: int,
                                num_kv_heads: Optional[int] = None, *, total_seqlen_k: Optional[int] = None,
                                num_index_kv_heads: int = 1, topk: int = 16, force_begin_blocks: int = 0,
                                force_end_blocks: int = 0, force_blocks_count_in_topk: bool = True,
                                causal: bool = True, prefill_tile: Optional[str] = "gather",
                                max_score_bytes: int = MAX_SCORE_BYTES, head_dim: int = 128, dtype="bfloat16",
                                device=None) -> SparsePipelinePlan:
    """Plan the MSA pipeline from capacities (CUDA-graph safe across steps, like ``msa_plan``).

    ``batch_size`` requests of at most ``max_seqlen_q`` queries over at most ``max_seqlen_k``
    keys (``total_seqlen_k``: the K token capacity, default ``max_seqlen_k``); the mode
    follows ``max_seqlen_q`` (sparse decode up to 32 queries per request: decode and
    speculative decoding). Every call passes :class:`~mate_cupy.MsaRuntimeMetadata` (with
    ``seqused_k`` and ``page_table`` or ``kv_page_indptr``). One window covers the capacity
    ``batch_size * max_seqlen_q`` rows: its block maxima must fit ``max_score_bytes``
    (``ValueError`` otherwise: plan long prefills with :func:`sparse_pipeline_plan`). Other
    arguments as in :func:`sparse_pipeline_plan`. Needs a CUDA device (``"cpu"`` is a
    ``ValueError``): the buffers and the attention workspace are allocated here.
    """
    from .plan import _current_cuda_device

    (num_qo_heads, num_kv_heads, num_index_kv_heads, topk, force_begin_blocks, force_end_blocks, max_score_bytes,
     head_dim, dtype) = _pipeline_args(num_qo_heads, num_kv_heads, num_index_kv_heads, topk, force_begin_blocks,
                                       force_end_blocks, max_score_bytes, head_dim, dtype)
    dev = _current_cuda_device() if device is None else device_index(device)
    if dev is None:
        raise ValueError("sparse_pipeline_static_plan needs a CUDA device (static plans run on the kernels)")
    common = dict(total_seqlen_k=total_seqlen_k, page_size=SPARSE_BLOCK_SIZE, causal=causal)
    attention = msa_plan(batch_size, max_seqlen_q, max_seqlen_k, num_qo_heads, num_kv_heads=num_kv_heads,
                         kv_block_num=int(topk), force_begin_blocks=force_begin_blocks,
                         force_end_blocks=force_end_blocks, force_blocks_count_in_topk=force_blocks_count_in_topk,
                         prefill_tile=prefill_tile, **common)
    index = msa_plan(batch_size, max_seqlen_q, max_seqlen_k, num_kv_heads, num_kv_heads=int(num_index_kv_heads),
                     output_maxscore=True, **common)
    total_q = int(batch_size) * int(max_seqlen_q)
    nt = -(-int(max_seqlen_k) // SPARSE_BLOCK_SIZE)
    need = total_q * num_kv_heads * nt * 4
    if need > int(max_score_bytes):
        raise ValueError(f"the static pipeline's block maxima take {need} bytes ({total_q} rows x {num_kv_heads} "
                         f"heads x {nt} blocks x 4) > max_score_bytes={max_score_bytes}: plan long prefills with "
                         "sparse_pipeline_plan (query windows) or raise max_score_bytes")
    plan = SparsePipelinePlan(
        attention=attention, windows=(IndexWindow(0, total_q, index),), num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads, num_index_kv_heads=int(num_index_kv_heads), topk=int(topk),
        force_begin_blocks=int(force_begin_blocks), force_end_blocks=int(force_end_blocks),
        force_blocks_count_in_topk=bool(force_blocks_count_in_topk), device=dev, is_static=True,
        causal=bool(causal),
        positions=_new_array(dev, (total_q,), np.int64),
        max_score=_new_array(dev, (total_q, num_kv_heads, nt), np.float32),
        selection=_new_array(dev, (total_q, num_kv_heads, attention[3].selected_block_count), np.int32))
    upload_plan(attention, dev, None, head_dim=int(head_dim), dtype=as_dtype(dtype))
    return _built(plan)


@mate_api
def sparse_attention_pipeline(q, k, v, index_q, index_k, plan: SparsePipelinePlan, *, kv_indices=None,
                              runtime_metadata=None, out=None, lse=None, sm_scale: Optional[float] = None,
                              k_scale: float = 1.0, v_scale: float = 1.0, index_scale: float = 1.0, workspace=None):
    """Index max score -> top-k block selection -> block-sparse attention, on one plan.

    q ``[total_q, Hq, 128]`` (fp16, bf16 or fp8); k, v paged ``[P, 128, Hkv, 128]`` (or
    ``[P, Hkv, 128, 128]``); ``index_q [total_q, Hkv, Di]`` and ``index_k [P, 128, Hik, Di]``
    (or ``[P, Hik, 128, Di]``), the index branch over the same pages: fp16/bf16, or float8
    e4m3 (CUDA inputs: compute capability 8.9+ while every window's ``max_seqlen_q * Hkv /
    Hik <= 32``, 16 at ``Di`` 256, 9.0 for more rows: ``NotImplementedError`` otherwise,
    before any launch) with ``index_scale`` (positive, finite) the max-score pass's ``k_scale``: the
    plan's max scores are ``index_scale * max(index_q . index_k)`` (a per-tensor index q
    scale is folded in: MiniMax's Q8KV8 index passes ``q_scale * k_scale``; the selection
    depends only on their order; 16-bit index inputs ignore it);
    ``kv_indices``: int32 flat page ids of every request (CSR by ``ceil(kv_len / 128)``),
    shared by both caches; static plans take the pages from ``runtime_metadata``
    (``page_table``, or ``kv_page_indptr`` with ``kv_indices``). ``runtime_metadata``:
    required by static plans (:func:`sparse_pipeline_static_plan`), refused by eager ones.
    Per window of :attr:`SparsePipelinePlan.window_rows` query rows, the block maxima of
    the index branch (``msa(..., output_o=False)``) go into the plan's ``max_score`` buffer
    and its top-k block lists into ``plan.selection`` (query positions from the plan, or
    from the metadata on the device for static plans, so causal rows select only blocks
    they can attend and the forced end blocks are each query's own); then ``msa`` attends
    the selected blocks. ``out``/``lse`` (preallocated, written in place), ``sm_scale``,
    ``k_scale``/``v_scale`` (fp8) and ``workspace`` as in :func:`~mate_cupy.msa`. Returns
    ``out`` ``[total_q, Hq, 128]``.
    """
    check_given("sparse_attention_pipeline", q=q, k=k, v=v, index_q=index_q, index_k=index_k)
    if not isinstance(plan, SparsePipelinePlan):
        raise TypeError(f"plan must be a SparsePipelinePlan (sparse_pipeline_plan), got {type(plan).__name__}")
    rows = _leading_dim(q, "q")
    if plan.is_static:
        if runtime_metadata is None:
            raise ValueError("a static pipeline plan (sparse_pipeline_static_plan) needs runtime_metadata")
        if rows > plan.total_q:
            raise ValueError(f"q has {rows} rows, more than the plan's capacity {plan.total_q} "
                             "(batch_size * max_seqlen_q)")
    else:
        if runtime_metadata is not None:
            raise ValueError("runtime_metadata goes with static pipeline plans (sparse_pipeline_static_plan); "
                             "an eager pipeline plan holds its lengths")
        if rows != plan.total_q:
            raise ValueError(f"q must have the plan's {plan.total_q} rows (sum of qo_segment_lens), got {rows}")
    n = _leading_dim(index_q, "index_q")
    if n != rows:
        raise ValueError(f"index_q must have q's {rows} rows, got {n}")
    # The attention pass is validated (or its prepared launch found) before anything launches: its
    # block lists are the plan's selection buffer, which the passes below fill (no value is read).
    attention = start("sparse_attention_pipeline", unpack_plan_info(plan.attention), q, k, v, kv_indices,
                      plan.selection[:rows], None, out, lse, None, None, sm_scale, k_scale, v_scale,
                      runtime_metadata, True, False, False, False, workspace)
    # The selection pass takes the plan's buffers first, so it would launch on CuPy's current
    # stream: make that the caller's (q's framework's current stream) for every pass.
    call = Call(q=q)
    iq = call.add("index_q", index_q)
    if iq.dtype == FP8_E4M3:  # every window's limits before the first launch
        for w in plan.windows:
            check_fp8_max_score("sparse_attention_pipeline", unpack_plan_info(w.plan)[3], plan.num_kv_heads,
                                iq.shape[2], iq.device)
    with call.launch_scope():
        if plan.is_static:
            md = runtime_metadata
            w = IndexWindow(0, rows, plan.windows[0].plan)  # q's rows of the capacity
            index_window(plan, w, index_q, index_k, kv_indices=kv_indices, runtime_metadata=md,
                         index_scale=index_scale)  # validates the metadata
            lens = Call(cu=md.cu_seqlens_q, qo=md.qo_lens, kv=md.seqused_k, off=md.qo_offset)
            launch_query_positions(lens["cu"].ptr, lens["qo"].ptr, lens["kv"].ptr, lens["off"].ptr,
                                   int(lens["qo"].shape[0]), rows, plan.causal, _address(plan.positions),
                                   call.stream_ptr)
            select_window(plan, w)
        else:
            for w in plan.windows:
                if w.row_end > w.row_begin:
                    index_window(plan, w, index_q, index_k, kv_indices=kv_indices, index_scale=index_scale)
                    select_window(plan, w)
        res, _, _ = finish(attention)
    return res


def index_window(plan: SparsePipelinePlan, window: IndexWindow, index_q, index_k, *, kv_indices=None,
                 runtime_metadata=None, index_scale: float = 1.0):
    """The index branch's block maxima of one query window into the plan's ``max_score``
    buffer (``msa(..., output_o=False)``; static plans: with ``runtime_metadata``); returns the
    window's rows of it. Launches on ``index_q``'s framework's current stream."""
    scores = plan.max_score[: window.row_end - window.row_begin]
    try:
        msa(index_q[window.row_begin:window.row_end], index_k, index_k, window.plan, kv_indices=kv_indices,
            runtime_metadata=runtime_metadata, max_score=scores, k_scale=index_scale, output_o=False)
    except (TypeError, ValueError, NotImplementedError) as e:  # name the pipeline's arguments
        raise type(e)(f"the index branch (index_q and index_k, as msa's q and k/v; index_scale as k_scale): "
                      f"{e}") from e
    return scores


def select_window(plan: SparsePipelinePlan, window: IndexWindow):
    """Top-k block lists of one window's scores (the plan's ``max_score`` buffer, as
    :func:`index_window` left it) into the window's rows of ``plan.selection``, with the
    plan's query positions. Launches on CuPy's current stream (the plan's buffers come
    first): :func:`sparse_attention_pipeline` sets it to the caller's."""
    rows = slice(window.row_begin, window.row_end)
    sparse_topk_select(plan.max_score[: window.row_end - window.row_begin], plan.topk, output=plan.selection[rows],
                       query_positions=plan.positions[rows], force_begin_blocks=plan.force_begin_blocks,
                       force_end_blocks=plan.force_end_blocks,
                       force_blocks_count_in_topk=plan.force_blocks_count_in_topk)


def _address(arr) -> int:
    """Device address of a plan-owned CuPy buffer."""
    return int(arr.data.ptr)


def _leading_dim(arr, name: str) -> int:
    shape = getattr(arr, "shape", None)
    if shape is None or len(shape) != 3:
        raise ValueError(f"{name} must be a 3-D array [total_q, heads, head_dim], got shape {shape}")
    return int(shape[0])
