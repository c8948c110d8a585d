"""MSA plans: dataclasses, the eager planner (concrete lengths) and the static planner.

A plan fixes everything about an MSA call that does not depend on the arrays:
the mode (``dense``, ``paged``, ``sparse_prefill``, ``sparse_decode``), head counts,
page and block sizes, sparse selection width and the per-request lengths.

* :func:`msa_plan_from_lengths` (eager) reads the lengths once on the host and
  stores them as host NumPy int32 arrays. Requests with ``qo_len > 128`` (``> 32`` when
  sparse) start the prefill part; when decode requests precede them the batch is split
  into ``(True, split, batch_size, decode_plan, prefill_plan)``.
* :func:`msa_plan` (static, CUDA-graph safe) never sees lengths: it keeps capacities
  only, and every call must supply :class:`MsaRuntimeMetadata`.

Eager plans executed on CUDA copy their vectors to the device once per device (cached
on the plan); static plans never copy anything.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import numpy as np

from .._interop import to_host
from .._logging import mate_api

__all__ = [
    "MAX_K_TILES",
    "SPARSE_BLOCK_SIZE",
    "SPARSE_TOPK_MAX_OUTPUT_BLOCKS",
    "SUPPORTED_SPARSE_TOPK",
    "MsaDecodePlan",
    "MsaPlan",
    "MsaPlanInfo",
    "MsaPlanMode",
    "MsaPrefillPlan",
    "MsaRuntimeMetadata",
    "msa_plan",
    "msa_plan_from_lengths",
    "prefill_qlen_threshold",
    "selected_block_count",
    "unpack_plan_info",
]

MsaPlanMode = Literal["dense", "paged", "sparse_prefill", "sparse_decode"]

SPARSE_BLOCK_SIZE = 128
# The seed supports 4, 8 and 16; 32 and 64 are an extension (the output width stays <= 64).
SUPPORTED_SPARSE_TOPK = (4, 8, 16, 32, 64)
SPARSE_TOPK_MAX_OUTPUT_BLOCKS = 64
MAX_K_TILES = 12288  # sparse_topk_select needs max_k_tiles < MAX_K_TILES


# ----------------------------------------------------------------------------- dataclasses


@dataclass(eq=False)
class MsaPrefillPlan:
    """Varlen geometry: ``cu_seqlens_q``/``cu_seqlens_k`` int32 ``[B+1]`` and maxima."""

    cu_seqlens_q: Any
    cu_seqlens_k: Any
    total_seqlen_k: int
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(eq=False)
class MsaDecodePlan:
    """Paged-decode geometry: ``cache_seqlens`` int32 ``[B]`` (KV lengths)."""

    cache_seqlens: Any
    page_size: int
    sparse_block_size: int
    scheduler_metadata: Optional[Any] = None


@dataclass(eq=False)
class MsaPlan:
    """One executable MSA plan.

    ``qo_lens``, ``kv_lens``, ``qo_offset`` are host int32 ``[B]``; ``kv_page_indptr``
    host int32 ``[B+1]`` (pages of each request, paged modes) or None. For static plans
    (``is_static=True``) these vectors are zero placeholders: execution requires
    :class:`MsaRuntimeMetadata`.
    """

    batch_size: int
    qo_lens: Any
    kv_lens: Any
    qo_offset: Any
    kv_page_indptr: Optional[Any]
    num_qo_heads: int
    num_kv_heads: int
    page_size: int
    sparse_block_size: int
    num_kv_splits: int
    kv_block_num: int
    force_begin_blocks: int
    force_end_blocks: int
    force_blocks_count_in_topk: bool
    causal: bool
    output_maxscore: bool
    sparse_kernel_mode: str
    use_fp8_kvcache: bool
    mode: MsaPlanMode
    prefill_plan: MsaPrefillPlan
    decode_plan: Optional[MsaDecodePlan] = None
    is_static: bool = False
    # Prefill tile of the attention kernels (a mate_cupy option, docs/attention.md): None
    # (the environment's, else the default) or a name of ``prefill_tile_names()``.
    prefill_tile: Optional[str] = None
    # Device copies of the host vectors, per (device id, field name); eager plans only.
    _device_cache: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def selected_block_count(self) -> int:
        """Width ``W`` of ``kv_block_indexes`` for sparse plans (``kv_block_num`` otherwise)."""
        if self.kv_block_num <= 0:
            return self.kv_block_num
        return selected_block_count(
            self.kv_block_num, self.force_begin_blocks, self.force_end_blocks, self.force_blocks_count_in_topk
        )

    @property
    def is_sparse(self) -> bool:
        return self.mode in ("sparse_prefill", "sparse_decode")

    def host_vector(self, name: str) -> Optional[np.ndarray]:
        """Host int32 vector by name: qo_lens, kv_lens, qo_offset, kv_page_indptr, cu_seqlens_q/k."""
        if name in ("cu_seqlens_q", "cu_seqlens_k"):
            return getattr(self.prefill_plan, name)
        return getattr(self, name)

    def device_vector(self, name: str, device: int):
        """Device copy of :meth:`host_vector`, made once per device and then reused.

        Call inside the caller's device/stream scope. The first call on a device copies
        every vector of the plan and synchronises that stream once, so the copies are
        complete for any stream that uses them later. Never used for static plans.
        """
        key = (int(device), name)
        if key not in self._device_cache:
            import cupy

            for field_name in ("qo_lens", "kv_lens", "qo_offset", "kv_page_indptr", "cu_seqlens_q", "cu_seqlens_k"):
                host = self.host_vector(field_name)
                self._device_cache[(int(device), field_name)] = (
                    None if host is None else cupy.asarray(np.ascontiguousarray(host, dtype=np.int32))
                )
            cupy.cuda.get_current_stream().synchronize()
        return self._device_cache[key]


# (has_mixed_prefill, split, batch_size, plan or decode part, None or prefill part)
MsaPlanInfo = tuple[bool, int, int, MsaPlan, Optional[MsaPlan]]


@dataclass(eq=False)
class MsaRuntimeMetadata:
    """Per-call lengths for static plans (and optionally eager ones), on q's device.

    All int32, contiguous, on the device of ``q``; they are used as given (no copy and
    no host read): ``qo_lens``, ``kv_lens``, ``qo_offset`` ``[B]``; ``cu_seqlens_q``,
    ``cu_seqlens_k`` ``[B+1]`` (required for static plans); ``seqused_k`` ``[B]`` keys each
    request reads (required for static plans; ``<= kv_lens``); optional ``page_table``
    ``[B, ceil(max_seqlen_k / page_size)]`` or ``kv_page_indptr`` ``[B+1]`` (CSR page
    offsets into ``kv_indices``), mutually exclusive.
    """

    qo_lens: Any
    kv_lens: Any
    qo_offset: Any
    cu_seqlens_q: Optional[Any] = None
    cu_seqlens_k: Optional[Any] = None
    seqused_k: Optional[Any] = None
    page_table: Optional[Any] = None
    kv_page_indptr: Optional[Any] = None


# ----------------------------------------------------------------------------- helpers


def prefill_qlen_threshold(sparse: bool) -> int:
    """Requests with more queries than this belong to the prefill part."""
    return 32 if sparse else 128


def _ceil_div(x, y):
    return -(-x // y)


def _int32_vector(name: str, values) -> np.ndarray:
    """Any array/list -> host int32 1D (``ValueError`` if not 1D)."""
    if values is None:
        raise TypeError(f"{name} must be a 1D array of lengths, got None")
    arr = np.asarray(to_host(values, name))
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1D tensor, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iub" and arr.dtype.kind != "f":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int32)


def _cu_seqlens(lengths: np.ndarray) -> np.ndarray:
    cu = np.zeros(lengths.shape[0] + 1, dtype=np.int32)
    if lengths.shape[0]:
        cu[1:] = np.cumsum(lengths, dtype=np.int64).astype(np.int32)
    return cu


def _page_counts(kv_lens: np.ndarray, page_size: int) -> np.ndarray:
    return _ceil_div(kv_lens.astype(np.int64), int(page_size)).astype(np.int32)


def normalize_qo_offset(qo_lens: np.ndarray, kv_lens: np.ndarray, qo_offset) -> np.ndarray:
    """Host int32 ``[B]`` offsets: default ``kv_lens - qo_lens``; an int for every request."""
    if qo_offset is None:
        return (kv_lens.astype(np.int64) - qo_lens).astype(np.int32)
    if isinstance(qo_offset, (int, np.integer)):
        return np.full(qo_lens.shape, int(qo_offset), dtype=np.int32)
    offset = _int32_vector("qo_offset", qo_offset)
    if offset.shape != qo_lens.shape:
        raise ValueError(
            "qo_offset must have the same shape as qo_segment_lens, got "
            f"{tuple(offset.shape)} vs {tuple(qo_lens.shape)}"
        )
    return offset


def selected_block_count(topk: int, force_begin_blocks: int, force_end_blocks: int,
                         force_blocks_count_in_topk: bool) -> int:
    """Width ``W`` of a sparse selection; validates ``topk`` and the forced blocks."""
    topk, begin, end = int(topk), int(force_begin_blocks), int(force_end_blocks)
    if topk not in SUPPORTED_SPARSE_TOPK:
        raise ValueError(f"sparse selection only supports topk in {SUPPORTED_SPARSE_TOPK}, got {topk}")
    if begin < 0 or end < 0:
        raise ValueError(
            f"force_begin_blocks and force_end_blocks must be non-negative, got {begin}, {end}"
        )
    if force_blocks_count_in_topk and begin + end > topk:
        raise ValueError(
            "force_begin_blocks + force_end_blocks must not exceed topk when "
            f"force_blocks_count_in_topk=True, got {begin} + {end} > {topk}"
        )
    width = topk if force_blocks_count_in_topk else topk + begin + end
    if width > SPARSE_TOPK_MAX_OUTPUT_BLOCKS:
        raise ValueError(
            f"sparse selection output width must not exceed {SPARSE_TOPK_MAX_OUTPUT_BLOCKS}, got {width}"
        )
    return width


def _resolve_mode(max_qo_len: int, page_size: int, kv_block_num: int, sparse_kernel_mode: str) -> str:
    if kv_block_num > 0:
        if page_size <= 0:
            raise ValueError("sparse MSA planning requires page_size > 0")
        if sparse_kernel_mode not in ("auto", "prefill", "decode"):
            raise ValueError(
                "sparse_kernel_mode must be one of 'auto', 'prefill', or 'decode', "
                f"got {sparse_kernel_mode!r}"
            )
        if sparse_kernel_mode == "prefill":
            return "sparse_prefill"
        if sparse_kernel_mode == "decode":
            return "sparse_decode"
        return "sparse_prefill" if max_qo_len > prefill_qlen_threshold(True) else "sparse_decode"
    return "paged" if page_size > 0 else "dense"


def _check_mode_geometry(mode: str, page_size: int, sparse_block_size: int, output_maxscore: bool) -> None:
    if mode in ("sparse_prefill", "sparse_decode"):
        if page_size != sparse_block_size:
            raise ValueError(
                "paged sparse MSA requires page_size == sparse_block_size, got "
                f"page_size={page_size} and sparse_block_size={sparse_block_size}"
            )
        if sparse_block_size != SPARSE_BLOCK_SIZE:
            raise ValueError(
                "sparse MSA planning currently requires sparse_block_size == "
                f"{SPARSE_BLOCK_SIZE}, got {sparse_block_size}"
            )
    if output_maxscore and page_size > 0 and page_size != SPARSE_BLOCK_SIZE:
        raise ValueError(
            "paged MSA maxscore requires page_size == maxscore/sparse block size == "
            f"{SPARSE_BLOCK_SIZE}, got {page_size}"
        )


def _check_sparse_options(kv_block_num, force_begin_blocks, force_end_blocks, force_blocks_count_in_topk):
    if kv_block_num > 0:
        selected_block_count(kv_block_num, force_begin_blocks, force_end_blocks, force_blocks_count_in_topk)
    elif force_begin_blocks or force_end_blocks:
        raise ValueError("forced sparse blocks require kv_block_num to select sparse execution")


def prefill_tile_names() -> tuple:
    """Names a plan's ``prefill_tile`` accepts: the query tiles and ``"gather"``."""
    from .attention_kernels import PREFILL_TILES
    from .gather_kernels import GATHER_TILE

    return tuple(PREFILL_TILES) + (GATHER_TILE,)


def _check_prefill_tile(prefill_tile) -> Optional[str]:
    if prefill_tile is None:
        return None
    names = prefill_tile_names()
    if not isinstance(prefill_tile, str) or prefill_tile not in names:
        raise ValueError(f"prefill_tile must be None or one of {', '.join(names)}; got {prefill_tile!r}")
    return prefill_tile


def _build_single_plan(qo_lens, kv_lens, qo_offset, *, num_qo_heads, num_kv_heads, num_kv_splits, page_size,
                       sparse_block_size, output_maxscore, kv_block_num, force_begin_blocks, force_end_blocks,
                       force_blocks_count_in_topk, causal, sparse_kernel_mode, use_fp8_kvcache,
                       prefill_tile) -> MsaPlan:
    prefill = MsaPrefillPlan(
        cu_seqlens_q=_cu_seqlens(qo_lens),
        cu_seqlens_k=_cu_seqlens(kv_lens),
        total_seqlen_k=int(kv_lens.sum(dtype=np.int64)),
        max_seqlen_q=int(qo_lens.max()) if qo_lens.shape[0] else 0,
        max_seqlen_k=int(kv_lens.max()) if kv_lens.shape[0] else 0,
    )
    mode = _resolve_mode(prefill.max_seqlen_q, page_size, kv_block_num, sparse_kernel_mode)
    _check_mode_geometry(mode, page_size, sparse_block_size, output_maxscore)
    decode = None
    if mode in ("paged", "sparse_decode"):
        decode = MsaDecodePlan(cache_seqlens=kv_lens.copy(), page_size=page_size,
                               sparse_block_size=sparse_block_size)
    return MsaPlan(
        batch_size=int(qo_lens.shape[0]),
        qo_lens=qo_lens.copy(),
        kv_lens=kv_lens.copy(),
        qo_offset=qo_offset.copy(),
        kv_page_indptr=_cu_seqlens(_page_counts(kv_lens, page_size)) if page_size > 0 else None,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        sparse_block_size=sparse_block_size,
        num_kv_splits=num_kv_splits,
        kv_block_num=kv_block_num,
        force_begin_blocks=force_begin_blocks,
        force_end_blocks=force_end_blocks,
        force_blocks_count_in_topk=force_blocks_count_in_topk,
        causal=causal,
        output_maxscore=output_maxscore,
        sparse_kernel_mode=sparse_kernel_mode,
        use_fp8_kvcache=use_fp8_kvcache,
        mode=mode,
        prefill_plan=prefill,
        decode_plan=decode,
        prefill_tile=prefill_tile,
    )


def unpack_plan_info(plan_info) -> tuple:
    """``MsaPlan`` or the planners' 5-tuple -> ``(mixed, split, batch, first_plan, prefill_plan)``."""
    if isinstance(plan_info, MsaPlan):
        return (False, 0, plan_info.batch_size, plan_info, None)
    if isinstance(plan_info, tuple) and len(plan_info) == 5 and isinstance(plan_info[3], MsaPlan):
        if plan_info[0] and not isinstance(plan_info[4], MsaPlan):
            raise TypeError("a mixed MSA plan_info must carry the prefill MsaPlan as its fifth element")
        return plan_info
    raise TypeError("plan_info must be a MsaPlan or an MSA-compatible 5-tuple returned by msa_plan")


# ----------------------------------------------------------------------------- planners


@mate_api
def msa_plan_from_lengths(qo_segment_lens, kv_segment_lens, *args, qo_offset=None,
                          split_prefill_decode: bool = True, **kwargs) -> MsaPlanInfo:
    """Build an eager execution plan from concrete sequence lengths (read once on the host).

    ``qo_segment_lens``, ``kv_segment_lens``: ``[B]`` integer arrays (any framework, or
    lists). Positional ``num_qo_heads`` and optional ``num_kv_heads`` (or keywords).
    Keywords: ``num_kv_splits=-1``, ``page_size=-1`` (``> 0``: paged KV), ``sparse_block_size=128``,
    ``output_maxscore=False``, ``kv_block_num=-1`` (``> 0``: sparse, the top-k),
    ``force_begin_blocks=0``, ``force_end_blocks=0``, ``force_blocks_count_in_topk=True``,
    ``causal=True``, ``sparse_kernel_mode='auto'``, ``use_fp8_kvcache=False`` (``usable_SM_count``,
    ``device``, ``stream`` are accepted and ignored); ``prefill_tile=None`` (mate_cupy: the
    attention kernels' prefill tile, e.g. ``"gather"`` for block lists chosen per query
    token, see :func:`prefill_tile_names`; None takes ``MATE_CUPY_ATTN_PREFILL_TILE`` /
    ``MATE_CUPY_ATTN_SPARSE_TILE``, else the default). ``qo_offset``: None (bottom-right),
    an int, or ``[B]``.

    Returns ``(False, 0, B, plan, None)``, or ``(True, split, B, decode_plan, prefill_plan)``
    when ``split_prefill_decode`` and requests ``[0, split)`` are decode-sized while request
    ``split`` is the first with ``qo_len > 128`` (``> 32`` when sparse).
    """
    qo_lens = _int32_vector("qo_segment_lens", qo_segment_lens)
    kv_lens = _int32_vector("kv_segment_lens", kv_segment_lens)
    if qo_lens.shape != kv_lens.shape:
        raise ValueError(
            "qo_segment_lens and kv_segment_lens must have the same shape, got "
            f"{tuple(qo_lens.shape)} vs {tuple(kv_lens.shape)}"
        )
    if len(args) > 2:
        raise TypeError(
            "the eager MSA planner accepts num_qo_heads and optional num_kv_heads as "
            f"positional planner arguments, got {len(args)}"
        )
    if args:
        num_qo_heads = int(args[0])
    else:
        if "num_qo_heads" not in kwargs:
            raise TypeError(
                "the eager MSA planner requires num_qo_heads as the first positional "
                "argument or as a num_qo_heads keyword argument"
            )
        num_qo_heads = int(kwargs.pop("num_qo_heads"))
    num_kv_heads = int(args[1]) if len(args) == 2 else int(kwargs.pop("num_kv_heads", num_qo_heads))
    if num_qo_heads <= 0:
        raise ValueError(f"num_qo_heads must be positive, got {num_qo_heads}")
    if num_kv_heads <= 0:
        num_kv_heads = num_qo_heads
    if num_qo_heads % num_kv_heads != 0:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be divisible by num_kv_heads ({num_kv_heads})")

    opts = dict(
        num_kv_splits=int(kwargs.pop("num_kv_splits", -1)),
        page_size=int(kwargs.pop("page_size", -1)),
        sparse_block_size=int(kwargs.pop("sparse_block_size", SPARSE_BLOCK_SIZE)),
        output_maxscore=bool(kwargs.pop("output_maxscore", False)),
        kv_block_num=int(kwargs.pop("kv_block_num", -1)),
        force_begin_blocks=int(kwargs.pop("force_begin_blocks", 0)),
        force_end_blocks=int(kwargs.pop("force_end_blocks", 0)),
        force_blocks_count_in_topk=bool(kwargs.pop("force_blocks_count_in_topk", True)),
    )
    kwargs.pop("usable_SM_count", None)
    opts["causal"] = bool(kwargs.pop("causal", True))
    opts["sparse_kernel_mode"] = str(kwargs.pop("sparse_kernel_mode", "auto"))
    opts["use_fp8_kvcache"] = bool(kwargs.pop("use_fp8_kvcache", False))
    opts["prefill_tile"] = _check_prefill_tile(kwargs.pop("prefill_tile", None))
    kwargs.pop("device", None)
    kwargs.pop("stream", None)
    if kwargs:
        raise TypeError(f"the eager MSA planner got unexpected keyword arguments: {', '.join(sorted(kwargs))}")
    if np.any(qo_lens < 0) or np.any(kv_lens < 0):
        raise ValueError(
            f"sequence lengths must be non-negative, got qo_segment_lens={qo_lens.tolist()}, "
            f"kv_segment_lens={kv_lens.tolist()}"
        )
    offsets = normalize_qo_offset(qo_lens, kv_lens, qo_offset)

    batch_size = int(qo_lens.shape[0])
    sparse = opts["kv_block_num"] > 0
    _check_sparse_options(opts["kv_block_num"], opts["force_begin_blocks"], opts["force_end_blocks"],
                          opts["force_blocks_count_in_topk"])
    threshold = prefill_qlen_threshold(sparse)
    split = 0
    if split_prefill_decode and batch_size > 0 and int(qo_lens.max()) > threshold:
        split = int(np.flatnonzero(qo_lens > threshold)[0])
    common = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, **opts)
    if split > 0:
        decode = _build_single_plan(qo_lens[:split], kv_lens[:split], offsets[:split], **common)
        prefill = _build_single_plan(qo_lens[split:], kv_lens[split:], offsets[split:], **common)
        return (True, split, batch_size, decode, prefill)
    plan = _build_single_plan(qo_lens, kv_lens, offsets, **common)
    return (False, 0, batch_size, plan, None)


@mate_api
def msa_plan(batch_size: int, max_seqlen_q: int, max_seqlen_k: int, num_qo_heads: int, *,
             total_seqlen_k: Optional[int] = None, num_kv_heads: Optional[int] = None, num_kv_splits: int = -1,
             page_size: int = -1, sparse_block_size: int = SPARSE_BLOCK_SIZE, output_maxscore: bool = False,
             kv_block_num: int = -1, force_begin_blocks: int = 0, force_end_blocks: int = 0,
             force_blocks_count_in_topk: bool = True, causal: bool = True, sparse_kernel_mode: str = "auto",
             use_fp8_kvcache: bool = False, prefill_tile: Optional[str] = None) -> MsaPlanInfo:
    """Build a capture-safe MSA plan from capacities; never inspects live lengths.

    ``max_seqlen_q``/``max_seqlen_k`` fix the launch geometry (and the max-score width
    ``ceil(max_seqlen_k / 128)``); ``total_seqlen_k`` (default ``max_seqlen_k``) is the
    physical K token capacity. The mode follows ``max_seqlen_q`` as in the eager planner.
    Per-request lengths and page indirection are given at run time through
    :class:`MsaRuntimeMetadata`. ``prefill_tile`` as in :func:`msa_plan_from_lengths`.
    Returns ``(False, 0, batch_size, plan, None)``.
    """
    batch_size = int(batch_size)
    max_seqlen_q = int(max_seqlen_q)
    max_seqlen_k = int(max_seqlen_k)
    total_seqlen_k = max_seqlen_k if total_seqlen_k is None else int(total_seqlen_k)
    num_qo_heads = int(num_qo_heads)
    num_kv_heads = num_qo_heads if num_kv_heads is None else int(num_kv_heads)
    if num_qo_heads <= 0 or num_kv_heads <= 0:
        raise ValueError(
            f"num_qo_heads and num_kv_heads must be positive, got {num_qo_heads} and {num_kv_heads}"
        )
    if num_qo_heads % num_kv_heads != 0:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    page_size, sparse_block_size = int(page_size), int(sparse_block_size)
    kv_block_num, begin, end = int(kv_block_num), int(force_begin_blocks), int(force_end_blocks)
    count_in_topk, output_maxscore = bool(force_blocks_count_in_topk), bool(output_maxscore)
    sparse_kernel_mode = str(sparse_kernel_mode)
    prefill_tile = _check_prefill_tile(prefill_tile)
    if batch_size < 0:
        raise ValueError(f"batch_size must be non-negative, got {batch_size}")
    if max_seqlen_q <= 0 or max_seqlen_k <= 0:
        raise ValueError(
            "static MSA planning requires positive max_seqlen_q/max_seqlen_k, "
            f"got {max_seqlen_q} and {max_seqlen_k}"
        )
    if total_seqlen_k <= 0:
        raise ValueError(f"static MSA planning requires positive total_seqlen_k, got {total_seqlen_k}")
    if total_seqlen_k < max_seqlen_k:
        raise ValueError(
            f"static MSA total_seqlen_k must cover max_seqlen_k, got {total_seqlen_k} < {max_seqlen_k}"
        )
    mode = _resolve_mode(max_seqlen_q, page_size, kv_block_num, sparse_kernel_mode)
    _check_mode_geometry(mode, page_size, sparse_block_size, output_maxscore)
    _check_sparse_options(kv_block_num, begin, end, count_in_topk)

    zeros = np.zeros(batch_size, dtype=np.int32)
    prefill = MsaPrefillPlan(
        cu_seqlens_q=np.zeros(batch_size + 1, dtype=np.int32),
        cu_seqlens_k=np.zeros(batch_size + 1, dtype=np.int32),
        total_seqlen_k=total_seqlen_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
    )
    decode = None
    if mode in ("paged", "sparse_decode"):
        decode = MsaDecodePlan(cache_seqlens=zeros.copy(), page_size=page_size, sparse_block_size=sparse_block_size)
    plan = MsaPlan(
        batch_size=batch_size,
        qo_lens=zeros.copy(),
        kv_lens=zeros.copy(),
        qo_offset=zeros.copy(),
        kv_page_indptr=None,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        sparse_block_size=sparse_block_size,
        num_kv_splits=int(num_kv_splits),
        kv_block_num=kv_block_num,
        force_begin_blocks=begin,
        force_end_blocks=end,
        force_blocks_count_in_topk=count_in_topk,
        causal=bool(causal),
        output_maxscore=output_maxscore,
        sparse_kernel_mode=sparse_kernel_mode,
        use_fp8_kvcache=bool(use_fp8_kvcache),
        mode=mode,
        prefill_plan=prefill,
        decode_plan=decode,
        is_static=True,
        prefill_tile=prefill_tile,
    )
    return (False, 0, batch_size, plan, None)


def plan_page_width(plan: MsaPlan) -> int:
    """Columns of a page table covering ``max_seqlen_k`` keys (128-key pages for dense plans)."""
    size = plan.page_size if plan.page_size > 0 else SPARSE_BLOCK_SIZE
    return int(_ceil_div(plan.prefill_plan.max_seqlen_k, size))


def max_k_tiles(plan: MsaPlan) -> int:
    """Max-score width ``ceil(max_seqlen_k / 128)``."""
    return int(_ceil_div(plan.prefill_plan.max_seqlen_k, SPARSE_BLOCK_SIZE))

