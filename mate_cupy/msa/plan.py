"""MSA plans: dataclasses, the eager planner (concrete lengths) and the static planner.

A plan fixes everything about an MSA call that does not depend on the arrays: the mode
(``dense``, ``paged``, ``sparse_prefill``, ``sparse_decode``), head counts, page and block
sizes, the sparse selection width, the per-request lengths and the options.

* :func:`msa_plan_from_lengths` (eager) reads the lengths once on the host and stores
  them as host NumPy int32 vectors. Requests with ``qo_len > 128`` (``> 32`` when sparse)
  start the prefill part; when decode requests precede them the batch is split into
  ``(True, split, batch_size, decode_plan, prefill_plan)``.
* :func:`msa_plan` (static, CUDA-graph safe) never sees lengths: it keeps capacities only,
  and every call supplies :class:`MsaRuntimeMetadata`.

Device side (FlashInfer's plan/run convention): an eager plan runs on CUDA once its vectors
are on that device. They are uploaded when the plan is built if a device is known (CUDA
lengths, or ``device=``), or by :meth:`MsaPlan.upload` / :func:`upload_plan`; a call never
copies them. A plan also owns its scratch memory (:meth:`MsaPlan.workspace_bytes`), unless
the call passes ``workspace=``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import numpy as np

from .._logging import mate_api
from ..checks import INT32_MAX, int_arg
from ..runtime.device import cuda_present
from ..runtime.interop import as_dtype, to_host, wrap
from ..runtime.memo import BoundedMemo

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
    "upload_plan",
]

MsaPlanMode = Literal["dense", "paged", "sparse_prefill", "sparse_decode"]

SPARSE_BLOCK_SIZE = 128
# Top-k sizes the selection kernel takes (the output width stays <= 64).
SUPPORTED_SPARSE_TOPK = (4, 8, 16, 32, 64)
SPARSE_TOPK_MAX_OUTPUT_BLOCKS = 64
MAX_K_TILES = 12288  # sparse_topk_select needs max_k_tiles < MAX_K_TILES
GATHER_TILE = "gather"  # block lists chosen per query token (the default)
QUERY_TILE = "query"  # block lists shared by the queries of a 128-query tile
PREFILL_TILES = (GATHER_TILE, QUERY_TILE)
PREPARED_CALLS = 16  # prepared calls a plan holds (execute.PreparedCall)
_VECTORS = ("qo_lens", "kv_lens", "qo_offset", "cu_seqlens_q", "cu_seqlens_k", "kv_page_indptr")


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


class DeviceVectors:
    """An eager plan's int32 vectors on one CUDA device: one buffer, an ``Arg`` view per vector.

    Attributes ``qo_lens``, ``kv_lens``, ``qo_offset`` ``[B]``, ``cu_seqlens_q``,
    ``cu_seqlens_k`` ``[B+1]``, ``kv_page_indptr`` ``[B+1]`` (None for dense plans).
    """

    __slots__ = ("device", "buffer", "lengths") + _VECTORS

    def __init__(self, plan: "MsaPlan", device: int, stream) -> None:
        import cupy

        self.lengths = None  # the plan's runtime.Lengths on this device, made at first use
        host = [plan.host_vector(name) for name in _VECTORS]
        flat = np.concatenate([h for h in host if h is not None]).astype(np.int32)
        self.device = device
        self.buffer = cupy.empty(max(1, flat.shape[0]), dtype=cupy.int32)
        if flat.shape[0]:
            self.buffer[: flat.shape[0]].set(flat, stream=stream)
        off = 0
        for name, h in zip(_VECTORS, host):
            if h is None:
                setattr(self, name, None)
                continue
            setattr(self, name, wrap(name, self.buffer[off:off + h.shape[0]]))
            off += h.shape[0]


@dataclass(eq=False)
class MsaPlan:
    """One executable MSA plan (one part of a plan info).

    ``qo_lens``, ``kv_lens``, ``qo_offset`` are host int32 ``[B]``; ``kv_page_indptr``
    host int32 ``[B+1]`` (pages of each request, paged modes) or None. For static plans
    (``is_static=True``) these vectors are zero placeholders: execution requires
    :class:`MsaRuntimeMetadata`. ``prefill_tile``: the block-sparse prefill kernels,
    ``"gather"`` (block lists chosen per query token, MSA's selection; where it applies) or
    ``"query"`` (lists shared by each 128-query tile), docs/attention.md.
    ``usable_sm_count``: SMs the launch configuration plans for (None: the device's).
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
    prefill_tile: str = GATHER_TILE
    usable_sm_count: Optional[int] = None
    # Device copies of the vectors (eager plans, after upload) and the plan-owned workspace.
    device_vectors: Optional[DeviceVectors] = field(default=None, init=False, repr=False)
    workspace: Optional[Any] = field(default=None, init=False, repr=False)
    # The last call's frozen problem, attention problem, configuration and loaded kernels (a
    # call with the same shapes, dtypes, options and device reuses them instead of rebuilding).
    last_attention: Optional[tuple] = field(default=None, init=False, repr=False)
    last_call: Optional[tuple] = field(default=None, init=False, repr=False)
    # Prepared launches of CUDA calls by their array metadata and options (execute.PreparedCall):
    # bounded, the oldest dropped first; freed with the plan.
    prepared_calls: BoundedMemo = field(default_factory=lambda: BoundedMemo(PREPARED_CALLS), init=False,
                                        repr=False)
    # sparse_topk_select(plan_info=...)'s query positions (int64 [total_q]) by (mixed, device):
    # an eager plan's lengths never change; at most one array per device; freed with the plan.
    topk_query_positions: dict = field(default_factory=dict, init=False, repr=False)

    @functools.cached_property
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

    @functools.cached_property
    def total_q(self) -> int:
        """Query rows of the plan: ``sum(qo_lens)`` (eager), ``batch_size * max_seqlen_q`` (static)."""
        if self.is_static:
            return self.batch_size * self.prefill_plan.max_seqlen_q
        return int(self.prefill_plan.cu_seqlens_q[-1])

    def host_vector(self, name: str) -> Optional[np.ndarray]:
        """Host int32 vector by name: qo_lens, kv_lens, qo_offset, kv_page_indptr, cu_seqlens_q/k."""
        if name not in _VECTORS:
            raise ValueError(f"host_vector name must be one of {', '.join(_VECTORS)}, got {name!r}")
        if name in ("cu_seqlens_q", "cu_seqlens_k"):
            return getattr(self.prefill_plan, name)
        return getattr(self, name)

    def upload(self, device=None, stream=None, head_dim: Optional[int] = None, dtype=None) -> "MsaPlan":
        """Prepare the plan on a CUDA device; returns the plan.

        Copies an eager plan's vectors to ``device`` (None: the current CUDA device; an int,
        ``"cuda[:N]"``, a torch/CuPy device) on ``stream`` (an address, a CuPy or torch
        stream; None: the device's current CuPy stream, then synchronised, so the vectors
        are ready for any stream; with a stream given the copies are only ordered on it).
        With ``head_dim`` and ``dtype`` (q's dtype) it also allocates the plan's workspace
        (:meth:`workspace_bytes`) and loads the kernels the plan will launch, so a first
        call (or a graph capture) allocates and compiles nothing. Static plans copy nothing.
        A plan lives on one device: uploading to another replaces the copies.
        """
        prepare([self], device, stream, head_dim, dtype)
        return self

    def workspace_bytes(self, head_dim: int = 128, dtype="bfloat16", *, device=None,
                        total_q: Optional[int] = None) -> int:
        """Scratch bytes an attention call of this plan takes (split-KV partials, gather lists).

        ``dtype``: q's dtype (NumPy/torch dtype or name); ``device``: the GPU whose SM count
        and compute capability the configuration uses (default: the uploaded device, else
        the current one); ``total_q``: q's rows (default :attr:`total_q`).
        """
        from .execute import attention_workspace_bytes

        return attention_workspace_bytes(self, int(head_dim), as_dtype(dtype), _resolve_device(self, device),
                                         self.total_q if total_q is None else int(total_q))


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


# ----------------------------------------------------------------------------- devices and upload


def device_index(device) -> Optional[int]:
    """CUDA device ordinal of ``device`` (None: the current one); None for ``"cpu"``.

    Accepts ints, ``"cuda"``, ``"cuda:N"``, ``"cpu"``, torch devices and CuPy devices.
    """
    if device is None:
        if not cuda_present():
            raise ValueError("no CUDA device is visible to this process")
        import cupy

        return int(cupy.cuda.Device().id)
    if isinstance(device, (int, np.integer)) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"device must be a non-negative CUDA ordinal, got {int(device)}")
        return int(device)
    kind = getattr(device, "type", None)
    if kind is not None and not isinstance(device, str):  # torch.device
        if kind == "cpu":
            return None
        if kind != "cuda":
            raise ValueError(f"device must be a CUDA device or 'cpu', got {device!r}")
        return device_index(device.index)
    ident = getattr(device, "id", None)
    if isinstance(ident, int):  # cupy.cuda.Device
        return ident
    if isinstance(device, str):
        text = device.strip().lower()
        if text == "cpu":
            return None
        if text == "cuda":
            return device_index(None)
        if text.startswith("cuda:") and text[5:].isdigit():
            return int(text[5:])
    raise ValueError(f"device must be None, an int, 'cpu', 'cuda' or 'cuda:N' (or a torch/CuPy device), "
                     f"got {device!r}")


def stream_address(stream) -> Optional[int]:
    """The ``cudaStream_t`` address of ``stream``: an int, a CuPy stream, a torch stream, or None."""
    if stream is None:
        return None
    if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool):
        return int(stream)
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    raise TypeError(f"stream must be None, an address, or a CuPy/torch CUDA stream, got {type(stream).__name__}")


def _resolve_device(plan: MsaPlan, device) -> int:
    if device is not None:
        dev = device_index(device)
        if dev is None:
            raise ValueError("workspace_bytes needs a CUDA device (the configuration depends on it), got 'cpu'")
        return dev
    if plan.device_vectors is not None:
        return plan.device_vectors.device
    return device_index(None)


def prepare(plans: list, device, stream, head_dim, dtype) -> None:
    """Upload ``plans`` (the parts of one plan info) to ``device``; with ``head_dim`` and
    ``dtype`` also size their workspace (owned by the first part) and load their kernels."""
    import cupy

    from ..runtime.interop import external_stream

    ptr = stream_address(stream)
    if head_dim is not None:
        head_dim = int_arg("head_dim", head_dim, lo=1)
    if dtype is not None:
        dtype = as_dtype(dtype)
    dev = device_index(device)
    if dev is None:
        raise ValueError("upload needs a CUDA device, got 'cpu'")
    with cupy.cuda.Device(dev):
        s = cupy.cuda.get_current_stream() if ptr is None else external_stream(ptr)
        with s:
            for plan in plans:
                if not plan.is_static:
                    plan.prepared_calls.clear()  # (they hold the vectors they launch with)
                    plan.device_vectors = DeviceVectors(plan, dev, s)
            if head_dim is not None and dtype is not None:
                from .execute import prepare_workspace

                prepare_workspace(plans, head_dim, dtype, dev)
        if ptr is None:
            s.synchronize()


@mate_api
def upload_plan(plan_info, device=None, stream=None, head_dim: Optional[int] = None, dtype=None):
    """:meth:`MsaPlan.upload` for a plan or a planner's 5-tuple (both parts of a mixed plan,
    whose workspace the first part owns); returns ``plan_info``."""
    mixed, _, _, first, second = unpack_plan_info(plan_info)
    prepare([first, second] if mixed else [first], device, stream, head_dim, dtype)
    return plan_info


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
    if arr.dtype.kind not in "iubf":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "f":  # accepted when every value is a whole number, never truncated
        arr = arr.astype(np.float64)  # (the int32 range check below in float64: exact)
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if np.any(bad):
            raise ValueError(f"{name} must hold whole numbers, got {float(arr[bad][0])} at index {int(np.argmax(bad))}")
    if arr.size and (arr.min() < -2**31 or arr.max() > 2**31 - 1):
        raise ValueError(f"{name} values must fit in int32, got a range of [{arr.min()}, {arr.max()}]")
    return arr.astype(np.int32)


def _cuda_device_of(values) -> Optional[int]:
    """The CUDA device of an array argument, None for host arrays and lists."""
    if isinstance(values, (np.ndarray, list, tuple, int, np.integer)) or values is None:
        return None
    arg = wrap("lengths", values)
    return arg.device if arg.is_cuda else None


def _current_cuda_device() -> Optional[int]:
    """CuPy's current device when this process sees a GPU, else None (host-only plans)."""
    return device_index(None) if cuda_present() else None


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
        return np.full(qo_lens.shape, int_arg("qo_offset", qo_offset, lo=-2**31), dtype=np.int32)
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
    """The plan mode of checked options (:func:`_check_options`)."""
    if kv_block_num > 0:
        if sparse_kernel_mode == "prefill":
            return "sparse_prefill"
        if sparse_kernel_mode == "decode":
            return "sparse_decode"
        return "sparse_prefill" if max_qo_len > prefill_qlen_threshold(True) else "sparse_decode"
    return "paged" if page_size > 0 else "dense"


def _check_options(*, page_size: int, sparse_block_size: int, output_maxscore: bool, kv_block_num: int,
                   force_begin_blocks: int, force_end_blocks: int, force_blocks_count_in_topk: bool,
                   sparse_kernel_mode: str, prefill_tile) -> None:
    """The plan options every planner shares, each checked once."""
    if page_size > 0 and page_size & (page_size - 1):
        raise NotImplementedError(f"page_size must be a power of two, got {page_size}")
    if kv_block_num > 0:
        if page_size <= 0:
            raise ValueError("sparse MSA planning requires page_size > 0")
        if sparse_kernel_mode not in ("auto", "prefill", "decode"):
            raise ValueError(
                f"sparse_kernel_mode must be one of 'auto', 'prefill', or 'decode', got {sparse_kernel_mode!r}"
            )
        if page_size != sparse_block_size:
            raise ValueError(
                "paged sparse MSA requires page_size == sparse_block_size, got "
                f"page_size={page_size} and sparse_block_size={sparse_block_size}"
            )
        if sparse_block_size != SPARSE_BLOCK_SIZE:
            raise ValueError(
                f"sparse MSA planning currently requires sparse_block_size == {SPARSE_BLOCK_SIZE}, "
                f"got {sparse_block_size}"
            )
        selected_block_count(kv_block_num, force_begin_blocks, force_end_blocks, force_blocks_count_in_topk)
    elif force_begin_blocks or force_end_blocks:
        raise ValueError("forced sparse blocks require kv_block_num to select sparse execution")
    if output_maxscore and page_size > 0 and page_size != SPARSE_BLOCK_SIZE:
        raise ValueError(
            "paged MSA maxscore requires page_size == maxscore/sparse block size == "
            f"{SPARSE_BLOCK_SIZE}, got {page_size}"
        )
    if prefill_tile is not None and (not isinstance(prefill_tile, str) or prefill_tile not in PREFILL_TILES):
        raise ValueError(f"prefill_tile must be {GATHER_TILE!r} (the default; None means it) or {QUERY_TILE!r}, "
                         f"got {prefill_tile!r}")


def resolve_heads(num_qo_heads, num_kv_heads, *, nonpositive_kv_heads_mean_hq: bool = True) -> tuple:
    """``(Hq, Hkv)`` of the planners' arguments: ints, ``num_kv_heads`` None meaning ``Hq``, and
    non-positive too in the eager planners (the static planner refuses it, as the reproduced
    API does); ``Hq`` positive and a multiple of ``Hkv``."""
    hq = int_arg("num_qo_heads", num_qo_heads)
    hkv = None if num_kv_heads is None else int_arg("num_kv_heads", num_kv_heads, lo=-2**31)
    if hkv is None or (hkv <= 0 and nonpositive_kv_heads_mean_hq):
        hkv = hq
    _heads(hq, hkv)
    return hq, hkv


def _heads(num_qo_heads: int, num_kv_heads: int) -> None:
    if num_qo_heads <= 0 or num_kv_heads <= 0:
        raise ValueError(f"num_qo_heads and num_kv_heads must be positive, got {num_qo_heads} and {num_kv_heads}")
    if num_qo_heads % num_kv_heads != 0:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be divisible by num_kv_heads ({num_kv_heads})")


def _build_single_plan(qo_lens, kv_lens, qo_offset, *, num_qo_heads, num_kv_heads, num_kv_splits, page_size,
                       sparse_block_size, output_maxscore, kv_block_num, force_begin_blocks, force_end_blocks,
                       force_blocks_count_in_topk, causal, sparse_kernel_mode, use_fp8_kvcache,
                       prefill_tile, usable_sm_count) -> MsaPlan:
    prefill = MsaPrefillPlan(
        cu_seqlens_q=_cu_seqlens(qo_lens),
        cu_seqlens_k=_cu_seqlens(kv_lens),
        total_seqlen_k=int(kv_lens.sum(dtype=np.int64)),
        max_seqlen_q=int(qo_lens.max()) if qo_lens.shape[0] else 0,
        max_seqlen_k=int(kv_lens.max()) if kv_lens.shape[0] else 0,
    )
    mode = _resolve_mode(prefill.max_seqlen_q, page_size, kv_block_num, sparse_kernel_mode)
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
        prefill_tile=GATHER_TILE if prefill_tile is None else prefill_tile,
        usable_sm_count=usable_sm_count,
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
def msa_plan_from_lengths(qo_segment_lens, kv_segment_lens, num_qo_heads: int, num_kv_heads: Optional[int] = None,
                          *, qo_offset=None, split_prefill_decode: bool = True, num_kv_splits: int = -1,
                          page_size: int = -1, sparse_block_size: int = SPARSE_BLOCK_SIZE,
                          output_maxscore: bool = False, kv_block_num: int = -1, force_begin_blocks: int = 0,
                          force_end_blocks: int = 0, force_blocks_count_in_topk: bool = True,
                          usable_SM_count: Optional[int] = None, causal: bool = True,  # noqa: N803
                          sparse_kernel_mode: str = "auto", use_fp8_kvcache: bool = False, device=None,
                          stream=None, prefill_tile: Optional[str] = GATHER_TILE) -> MsaPlanInfo:
    """Build an eager execution plan from concrete sequence lengths (read once on the host).

    ``qo_segment_lens``, ``kv_segment_lens``: ``[B]`` integer arrays (any framework, or lists).
    ``num_kv_heads`` None or ``<= 0``: ``num_qo_heads``. ``qo_offset``: None (bottom-right,
    ``kv_len - qo_len``), an int, or ``[B]``. ``num_kv_splits``: ``<= 0`` automatic split-KV,
    ``1`` none, ``n`` forced. ``page_size``: ``> 0`` a paged cache (a power of two).
    ``kv_block_num``: ``> 0`` block-sparse with that top-k (4, 8, 16, 32, 64); the forced
    blocks and ``force_blocks_count_in_topk`` set the width ``W`` of ``kv_block_indexes``.
    ``sparse_kernel_mode``: ``"auto"`` (prefill when a request has more than 32 queries),
    ``"prefill"`` or ``"decode"``. ``usable_SM_count``: SMs the launch configuration plans
    for (default: the device's). ``device``/``stream``: where the plan's vectors are uploaded
    when it is built: None uploads to the lengths' device when they are CUDA arrays, else to
    CuPy's current device when the process sees a GPU (no GPU: a host-only plan);
    ``"cpu"`` keeps the plan on the host (upload later with :meth:`MsaPlan.upload`). ``prefill_tile``:
    ``"gather"`` (default; None means it: block lists chosen per query token) or ``"query"``
    (lists shared by each 128-query tile) for block-sparse prefill.

    Returns ``(False, 0, B, plan, None)``, or ``(True, split, B, decode_plan, prefill_plan)``
    when ``split_prefill_decode`` and requests ``[0, split)`` are decode-sized while request
    ``split`` is the first with ``qo_len > 128`` (``> 32`` when sparse).
    """
    stream_address(stream)  # (checked even when nothing is uploaded)
    if device is not None:
        upload_to = device_index(device)
    else:
        upload_to = _cuda_device_of(qo_segment_lens)
        if upload_to is None:
            upload_to = _cuda_device_of(kv_segment_lens)
        if upload_to is None:
            upload_to = _current_cuda_device()
    qo_lens = _int32_vector("qo_segment_lens", qo_segment_lens)
    kv_lens = _int32_vector("kv_segment_lens", kv_segment_lens)
    if qo_lens.shape != kv_lens.shape:
        raise ValueError(
            "qo_segment_lens and kv_segment_lens must have the same shape, got "
            f"{tuple(qo_lens.shape)} vs {tuple(kv_lens.shape)}"
        )
    num_qo_heads, num_kv_heads = resolve_heads(num_qo_heads, num_kv_heads)
    opts = dict(num_kv_splits=int_arg("num_kv_splits", num_kv_splits, lo=-2**31),
                page_size=int_arg("page_size", page_size, lo=-2**31),
                sparse_block_size=int_arg("sparse_block_size", sparse_block_size, lo=-2**31),
                output_maxscore=bool(output_maxscore), kv_block_num=int_arg("kv_block_num", kv_block_num, lo=-2**31),
                force_begin_blocks=int_arg("force_begin_blocks", force_begin_blocks, lo=-2**31),
                force_end_blocks=int_arg("force_end_blocks", force_end_blocks, lo=-2**31),
                force_blocks_count_in_topk=bool(force_blocks_count_in_topk), causal=bool(causal),
                sparse_kernel_mode=str(sparse_kernel_mode), use_fp8_kvcache=bool(use_fp8_kvcache),
                prefill_tile=prefill_tile,
                usable_sm_count=None if usable_SM_count is None else int_arg("usable_SM_count", usable_SM_count, lo=1))
    _check_options(**{k: opts[k] for k in ("page_size", "sparse_block_size", "output_maxscore", "kv_block_num",
                                           "force_begin_blocks", "force_end_blocks", "force_blocks_count_in_topk",
                                           "sparse_kernel_mode", "prefill_tile")})
    if np.any(qo_lens < 0) or np.any(kv_lens < 0):
        raise ValueError(
            f"sequence lengths must be non-negative, got qo_segment_lens={qo_lens.tolist()}, "
            f"kv_segment_lens={kv_lens.tolist()}"
        )
    for name, lens in (("qo_segment_lens", qo_lens), ("kv_segment_lens", kv_lens)):
        total = int(lens.sum(dtype=np.int64))
        if total > INT32_MAX:
            raise ValueError(f"the sum of {name} must fit in int32 (the plan's cumulative offsets), got {total}")
    offsets = normalize_qo_offset(qo_lens, kv_lens, qo_offset)

    batch_size = int(qo_lens.shape[0])
    threshold = prefill_qlen_threshold(opts["kv_block_num"] > 0)
    split = 0
    if split_prefill_decode and batch_size > 0 and int(qo_lens.max()) > threshold:
        split = int(np.flatnonzero(qo_lens > threshold)[0])
    common = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, **opts)
    if split > 0:
        decode = _build_single_plan(qo_lens[:split], kv_lens[:split], offsets[:split], **common)
        prefill = _build_single_plan(qo_lens[split:], kv_lens[split:], offsets[split:], **common)
        info = (True, split, batch_size, decode, prefill)
    else:
        info = (False, 0, batch_size, _build_single_plan(qo_lens, kv_lens, offsets, **common), None)
    if upload_to is not None:
        prepare([p for p in info[3:] if p is not None], upload_to, stream, None, None)
    return _built(info)


@mate_api
def msa_plan(batch_size: int, max_seqlen_q: int, max_seqlen_k: int, num_qo_heads: int, *,
             total_seqlen_k: Optional[int] = None, num_kv_heads: Optional[int] = None, num_kv_splits: int = -1,
             page_size: int = -1, sparse_block_size: int = SPARSE_BLOCK_SIZE, output_maxscore: bool = False,
             kv_block_num: int = -1, force_begin_blocks: int = 0, force_end_blocks: int = 0,
             force_blocks_count_in_topk: bool = True, causal: bool = True, sparse_kernel_mode: str = "auto",
             use_fp8_kvcache: bool = False, prefill_tile: Optional[str] = GATHER_TILE) -> MsaPlanInfo:
    """Build a capture-safe MSA plan from capacities; never inspects live lengths.

    ``max_seqlen_q``/``max_seqlen_k`` fix the launch geometry (and the max-score width
    ``ceil(max_seqlen_k / 128)``); ``total_seqlen_k`` (default ``max_seqlen_k``) is the
    physical K token capacity. The mode follows ``max_seqlen_q`` as in the eager planner.
    Per-request lengths and page indirection are given at run time through
    :class:`MsaRuntimeMetadata`; other options as in :func:`msa_plan_from_lengths`. The
    plan owns its workspace (:meth:`MsaPlan.upload` with ``head_dim``/``dtype`` allocates it
    ahead of a capture). Returns ``(False, 0, batch_size, plan, None)``.
    """
    batch_size = int_arg("batch_size", batch_size, lo=0)
    max_seqlen_q = int_arg("max_seqlen_q", max_seqlen_q, lo=-2**31)
    max_seqlen_k = int_arg("max_seqlen_k", max_seqlen_k, lo=-2**31)
    total_seqlen_k = max_seqlen_k if total_seqlen_k is None else int_arg("total_seqlen_k", total_seqlen_k, lo=-2**31)
    num_qo_heads, num_kv_heads = resolve_heads(num_qo_heads, num_kv_heads, nonpositive_kv_heads_mean_hq=False)
    page_size = int_arg("page_size", page_size, lo=-2**31)
    sparse_block_size = int_arg("sparse_block_size", sparse_block_size, lo=-2**31)
    kv_block_num = int_arg("kv_block_num", kv_block_num, lo=-2**31)
    begin = int_arg("force_begin_blocks", force_begin_blocks, lo=-2**31)
    end = int_arg("force_end_blocks", force_end_blocks, lo=-2**31)
    num_kv_splits = int_arg("num_kv_splits", num_kv_splits, lo=-2**31)
    count_in_topk, output_maxscore = bool(force_blocks_count_in_topk), bool(output_maxscore)
    sparse_kernel_mode = str(sparse_kernel_mode)
    if batch_size * max(max_seqlen_q, 0) > INT32_MAX:
        raise ValueError(f"batch_size * max_seqlen_q (the plan's query rows) must fit in int32, got "
                         f"{batch_size} * {max_seqlen_q}")
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
    _check_options(page_size=page_size, sparse_block_size=sparse_block_size, output_maxscore=output_maxscore,
                   kv_block_num=kv_block_num, force_begin_blocks=begin, force_end_blocks=end,
                   force_blocks_count_in_topk=count_in_topk, sparse_kernel_mode=sparse_kernel_mode,
                   prefill_tile=prefill_tile)
    mode = _resolve_mode(max_seqlen_q, page_size, kv_block_num, sparse_kernel_mode)

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
        num_kv_splits=num_kv_splits,
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
        prefill_tile=GATHER_TILE if prefill_tile is None else prefill_tile,
    )
    return _built((False, 0, batch_size, plan, None))


_PLAN_HOOKS: list = []


def add_plan_hook(hook) -> None:
    """Call ``hook(plan_info)`` for every plan the planners build from now on (integrations
    register plans there, outside any tracing framework). Hooks must not raise."""
    if hook not in _PLAN_HOOKS:
        _PLAN_HOOKS.append(hook)


def _built(info: tuple) -> tuple:
    for hook in _PLAN_HOOKS:
        hook(info)
    return info


def plan_page_width(plan: MsaPlan) -> int:
    """Columns of a page table covering ``max_seqlen_k`` keys (128-key pages for dense plans)."""
    size = plan.page_size if plan.page_size > 0 else SPARSE_BLOCK_SIZE
    return int(_ceil_div(plan.prefill_plan.max_seqlen_k, size))


def max_k_tiles(plan: MsaPlan) -> int:
    """Max-score width ``ceil(max_seqlen_k / 128)``."""
    return int(_ceil_div(plan.prefill_plan.max_seqlen_k, SPARSE_BLOCK_SIZE))
