"""Context parallelism on torch.distributed: one long prefill split across ranks (GPUs).

Collectives are torch.distributed's (NCCL between GPUs, gloo on CPU); this module moves no
data of its own. It needs PyTorch and is not imported by ``import mate_cupy``.

* :func:`merge_state`: two attention partials over disjoint key sets -> the partial over
  their union (natural-log LSE, the library's convention).
* MSA: :func:`cp_attention_plan` once per batch, then per layer :func:`cp_sparse_attention`
  (the index / top-k / block-sparse pipeline) or :func:`cp_dense_attention`. Queries are
  sharded zig-zag (rank ``r`` holds chunks ``r`` and ``2W - 1 - r`` of ``2W``); each rank
  all-gathers the K/V (and index keys) of every rank into one buffer that *is* the paged
  cache of the whole sequence (the plan's page ids translate the zig-zag order), then
  runs the single-GPU ops on its two query chunks as two requests.
* KDA: :func:`cp_chunk_kda`: contiguous segments; each rank computes its segment's affine
  state map ``S_out = S_in @ M + C``, one all-gather of the maps, the combine
  (:func:`mate_cupy.kda.segments.combine_segments`) gives each rank its entry state, and
  the rank recomputes its outputs from it.

docs/distributed.md holds the design, the bytes each collective moves and the limits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover - exercised in a subprocess without torch
    raise ImportError("mate_cupy.distributed needs PyTorch (torch.distributed for the collectives); "
                      "install torch>=2.4 or use mate_cupy without context parallelism") from exc

from .kda.segments import combine_segments
from .kda_interface import chunk_kda
from .msa.pipeline import SparsePipelinePlan, sparse_attention_pipeline, sparse_pipeline_plan
from .msa.plan import SPARSE_BLOCK_SIZE, msa_plan_from_lengths, upload_plan
from .msa.ops import msa
from .runtime.interop import as_dtype, framework_of

__all__ = [
    "ContextParallelPlan",
    "cp_attention_plan",
    "cp_chunk_kda",
    "cp_dense_attention",
    "cp_sparse_attention",
    "merge_state",
    "zigzag_ranges",
    "zigzag_shard",
    "zigzag_unshard",
]

# torch >= 2.13 names the single-tensor all-gather all_gather_single; older releases
# all_gather_into_tensor (same arguments).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ----------------------------------------------------------------------------- merge_state


def _array_library(x, name: str) -> str:
    fw = framework_of(x)
    if fw not in ("numpy", "cupy", "torch"):
        raise TypeError(f"{name} must be a NumPy array, a CuPy array or a torch tensor, got {type(x).__name__}")
    return fw


def _is_float(x) -> bool:
    if isinstance(x, torch.Tensor):
        return x.dtype.is_floating_point
    try:
        return np.issubdtype(np.dtype(x.dtype), np.floating) or np.dtype(x.dtype).name in ("bfloat16", "float16")
    except TypeError:
        return False


def merge_state(o_a, lse_a, o_b, lse_b):
    """Merge two attention partials of the same queries over disjoint key sets.

    ``o_a, o_b [N, H, D]`` (normalised partial outputs), ``lse_a, lse_b [N, H]`` (their
    natural-log log-sum-exp, the ``lse`` of :func:`mate_cupy.msa`). Returns ``(o, lse)``:
    ``lse = log(exp(lse_a) + exp(lse_b))`` and
    ``o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b``, the attention over the union of
    the key sets. A partial with ``lse = -inf`` (no key) has weight 0 and its ``o`` is
    never read (it may hold anything, NaN included); both empty give ``o = 0``,
    ``lse = -inf``. NumPy inputs are merged in float64, CuPy and torch arrays on their
    device in float32 (float64 for float64 inputs). ``o`` comes back in ``o_a``'s dtype,
    ``lse`` in ``lse_a``'s.
    """
    libs = {_array_library(a, n) for a, n in ((o_a, "o_a"), (lse_a, "lse_a"), (o_b, "o_b"), (lse_b, "lse_b"))}
    if len(libs) != 1:
        raise TypeError(f"o_a, lse_a, o_b, lse_b must come from one array library, got {sorted(libs)}")
    lib = libs.pop()
    if len(o_a.shape) != 3 or tuple(o_b.shape) != tuple(o_a.shape):
        raise ValueError(f"o_a and o_b must be [N, H, D] of one shape, got {tuple(o_a.shape)} and {tuple(o_b.shape)}")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(lse.shape) != tuple(o_a.shape[:2]):
            raise ValueError(f"{name} must have shape {tuple(o_a.shape[:2])} ([N, H] of o_a), got {tuple(lse.shape)}")
    for name, arr in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        if not _is_float(arr):
            raise TypeError(f"{name} must be a floating-point array, got {arr.dtype}")
    if o_b.dtype != o_a.dtype:
        raise TypeError(f"o_b must have o_a's dtype {o_a.dtype}, got {o_b.dtype}")
    if lib == "torch":
        for name, arr in (("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
            if arr.device != o_a.device:
                raise ValueError(f"{name} must be on o_a's device {o_a.device}, got {arr.device}")
        return _merge_torch(o_a, lse_a, o_b, lse_b)
    if lib == "numpy":
        return _merge_xp(np, np.float64, o_a, lse_a, o_b, lse_b)
    import cupy

    work = cupy.float64 if o_a.dtype == np.float64 else cupy.float32
    return _merge_xp(cupy, work, o_a, lse_a, o_b, lse_b)


def _merge_xp(xp, work, o_a, lse_a, o_b, lse_b):
    la, lb = lse_a.astype(work), lse_b.astype(work)
    m = xp.maximum(la, lb)
    m = xp.where(xp.isneginf(m), work(0), m)  # both empty: exp(-inf - 0) = 0, no inf - inf
    with np.errstate(divide="ignore", invalid="ignore"):
        ea, eb = xp.exp(la - m), xp.exp(lb - m)
        s = ea + eb
        lse = m + xp.log(s)  # log(0) = -inf when both are empty
        pos = s > 0
        wa = xp.where(pos, ea / xp.where(pos, s, work(1)), work(0))[..., None]
        wb = xp.where(pos, eb / xp.where(pos, s, work(1)), work(0))[..., None]
    o = xp.where(wa > 0, wa * o_a.astype(work), work(0)) + xp.where(wb > 0, wb * o_b.astype(work), work(0))
    return o.astype(o_a.dtype), lse.astype(lse_a.dtype)


def _merge_torch(o_a, lse_a, o_b, lse_b):
    work = torch.float64 if o_a.dtype == torch.float64 else torch.float32
    la, lb = lse_a.to(work), lse_b.to(work)
    m = torch.maximum(la, lb)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    ea, eb = torch.exp(la - m), torch.exp(lb - m)
    s = ea + eb
    lse = m + torch.log(s)
    pos = s > 0
    safe = torch.where(pos, s, torch.ones_like(s))
    wa = torch.where(pos, ea / safe, torch.zeros_like(s))[..., None]
    wb = torch.where(pos, eb / safe, torch.zeros_like(s))[..., None]
    zero = torch.zeros((), dtype=work, device=o_a.device)
    o = torch.where(wa > 0, wa * o_a.to(work), zero) + torch.where(wb > 0, wb * o_b.to(work), zero)
    return o.to(o_a.dtype), lse.to(lse_a.dtype)


# ----------------------------------------------------------------------------- zig-zag sharding


def _check_zigzag(seq_len: int, world_size: int, rank: int) -> int:
    seq_len, world_size, rank = int(seq_len), int(world_size), int(rank)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if seq_len <= 0 or seq_len % (2 * world_size):
        raise ValueError(f"seq_len must be a positive multiple of 2 * world_size = {2 * world_size} "
                         f"(2W equal chunks), got {seq_len}")
    return seq_len // (2 * world_size)


def zigzag_ranges(seq_len: int, world_size: int, rank: int) -> tuple:
    """The token ranges ``((a0, b0), (a1, b1))`` rank ``rank`` holds: chunks ``rank`` and
    ``2 * world_size - 1 - rank`` of ``2 * world_size`` equal chunks (causal load balance:
    every rank gets one early and one late chunk)."""
    c = _check_zigzag(seq_len, world_size, rank)
    j = 2 * int(world_size) - 1 - int(rank)
    return (int(rank) * c, (int(rank) + 1) * c), (j * c, (j + 1) * c)


def zigzag_shard(x, world_size: int, rank: int, dim: int = 0):
    """The rows of the whole sequence ``x`` (a torch tensor; tokens along ``dim``) that rank
    ``rank`` holds: its two zig-zag chunks, concatenated (a new tensor)."""
    (a0, b0), (a1, b1) = zigzag_ranges(x.shape[dim], world_size, rank)
    return torch.cat([x.narrow(dim, a0, b0 - a0), x.narrow(dim, a1, b1 - a1)], dim=dim)


def zigzag_unshard(parts, dim: int = 0):
    """Inverse of :func:`zigzag_shard`: ``parts[r]`` is rank ``r``'s shard; returns the whole
    sequence in token order."""
    world = len(parts)
    if world == 0:
        raise ValueError("parts must hold one shard per rank, got none")
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))], dim=dim)


# ----------------------------------------------------------------------------- MSA


def _group_rank_size(group) -> tuple:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group first")
    return dist.get_rank(group), dist.get_world_size(group)


def _torch_device(device) -> "torch.device":
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CUDA device or 'cpu', got {device}")
    return dev


@dataclass(frozen=True, eq=False)
class ContextParallelPlan:
    """One rank's plan of a zig-zag context-parallel MSA prefill (:func:`cp_attention_plan`).

    ``seq_len`` tokens in ``2 * world_size`` chunks of ``chunk_len``; this rank holds chunks
    ``rank`` and ``2 * world_size - 1 - rank`` (:attr:`ranges`), its queries are two requests
    over the gathered keys. ``page_size``: the pages the gathered buffer is cut into (128
    for sparse plans); ``kv_indices`` (int32 on ``device``) maps each request's logical
    pages to the gathered buffer's rank-major rows. ``attention`` is the
    :class:`~mate_cupy.SparsePipelinePlan` (``sparse=True``) or the paged ``MsaPlanInfo``.
    """

    sparse: bool
    seq_len: int
    world_size: int
    rank: int
    chunk_len: int
    page_size: int
    num_qo_heads: int
    num_kv_heads: int
    num_index_kv_heads: int
    device: Any
    attention: Any
    kv_indices: Any

    @property
    def ranges(self) -> tuple:
        """``((a0, b0), (a1, b1))``: the token ranges of this rank's queries."""
        return zigzag_ranges(self.seq_len, self.world_size, self.rank)

    @property
    def local_len(self) -> int:
        """Query (and K/V) rows this rank holds: ``2 * chunk_len``."""
        return 2 * self.chunk_len


def _zigzag_page_ids(seq_len: int, world_size: int, page_size: int) -> np.ndarray:
    """Physical page of each logical page of the sequence in the rank-major gathered buffer
    (rank ``s`` contributes chunk ``s`` then chunk ``2W - 1 - s``)."""
    c = seq_len // (2 * world_size)
    per = c // page_size
    out = np.empty(seq_len // page_size, np.int64)
    for j in range(2 * world_size):
        s, half = (j, 0) if j < world_size else (2 * world_size - 1 - j, 1)
        first = (s * 2 * c + half * c) // page_size
        out[j * per:(j + 1) * per] = np.arange(first, first + per)
    return out


def cp_attention_plan(seq_len: int, num_qo_heads: int, num_kv_heads: Optional[int] = None, *, group=None,
                      sparse: bool = True, num_index_kv_heads: int = 1, topk: int = 16,
                      force_begin_blocks: int = 0, force_end_blocks: int = 0,
                      force_blocks_count_in_topk: bool = True, prefill_tile: Optional[str] = "gather",
                      max_score_bytes: int = 1 << 30, head_dim: int = 128, dtype="bfloat16",
                      device=None) -> ContextParallelPlan:
    """Plan this rank's part of a causal context-parallel MSA prefill of ``seq_len`` tokens.

    ``seq_len``: a multiple of ``2 * W`` (``W`` = ``group``'s size; ``2 * W * 128`` for
    sparse plans, whose pages are 128 keys). ``group``: the context-parallel process group
    (None: the default group). ``sparse=True`` plans the MSA pipeline
    (:func:`~mate_cupy.sparse_pipeline_plan` with ``num_index_kv_heads``, ``topk``, the
    forced blocks, ``prefill_tile`` and ``max_score_bytes``); ``sparse=False`` a causal
    paged plan for :func:`cp_dense_attention`. ``head_dim``, ``dtype``: q's, for the
    workspace and kernels prepared at upload. ``device``: the torch device of the rank's
    tensors (None: torch's current CUDA device, else CPU, the reference path). Lengths are
    host integers: building the plan reads nothing from a device and calls no collective.
    """
    rank, world = _group_rank_size(group)
    c = _check_zigzag(seq_len, world, rank)
    num_qo_heads = int(num_qo_heads)
    num_kv_heads = num_qo_heads if num_kv_heads is None or int(num_kv_heads) <= 0 else int(num_kv_heads)
    dev = _torch_device(device)
    plan_device = "cpu" if dev.type == "cpu" else dev.index
    if sparse:
        if c % SPARSE_BLOCK_SIZE:
            raise ValueError(f"sparse context parallelism needs chunks of a multiple of {SPARSE_BLOCK_SIZE} tokens: "
                             f"seq_len must be a multiple of 2 * world_size * {SPARSE_BLOCK_SIZE} = "
                             f"{2 * world * SPARSE_BLOCK_SIZE}, got {seq_len}")
        page = SPARSE_BLOCK_SIZE
    else:
        page = min(c & -c, SPARSE_BLOCK_SIZE)  # the largest power of two dividing the chunk, at most 128
    (a0, b0), (a1, b1) = zigzag_ranges(seq_len, world, rank)
    qo, kv, off = [c, c], [b0, b1], [a0, a1]
    if sparse:
        attention = sparse_pipeline_plan(
            qo, kv, num_qo_heads, num_kv_heads, num_index_kv_heads=int(num_index_kv_heads), topk=int(topk),
            force_begin_blocks=force_begin_blocks, force_end_blocks=force_end_blocks,
            force_blocks_count_in_topk=force_blocks_count_in_topk, qo_offset=off, causal=True,
            split_prefill_decode=False, prefill_tile=prefill_tile, max_score_bytes=max_score_bytes,
            head_dim=int(head_dim), dtype=dtype, device=plan_device)
    else:
        attention = msa_plan_from_lengths(qo, kv, num_qo_heads, num_kv_heads, qo_offset=off, page_size=page,
                                          split_prefill_decode=False, causal=True, device="cpu")
        if dev.type == "cuda":
            upload_plan(attention, dev.index, None, head_dim=int(head_dim), dtype=as_dtype(dtype))
    ids = _zigzag_page_ids(int(seq_len), world, page)
    flat = np.concatenate([ids[:b0 // page], ids[:b1 // page]]).astype(np.int32)
    kv_indices = torch.from_numpy(flat).to(dev)
    return ContextParallelPlan(sparse=bool(sparse), seq_len=int(seq_len), world_size=world, rank=rank, chunk_len=c,
                               page_size=page, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                               num_index_kv_heads=int(num_index_kv_heads), device=dev, attention=attention,
                               kv_indices=kv_indices)


def _check_plan(plan, sparse: bool, group):
    if not isinstance(plan, ContextParallelPlan):
        raise TypeError(f"plan must be a ContextParallelPlan (cp_attention_plan), got {type(plan).__name__}")
    if plan.sparse != sparse:
        need = "a sparse plan (sparse=True)" if sparse else "a dense plan (sparse=False)"
        raise ValueError(f"plan must be {need}")
    rank, world = _group_rank_size(group)
    if (rank, world) != (plan.rank, plan.world_size):
        raise ValueError(f"group has rank {rank} of {world}, the plan was built for rank {plan.rank} "
                         f"of {plan.world_size}")


def _check_local(plan, name: str, x, heads: Optional[int]):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch tensor, got {type(x).__name__}")
    if x.dim() != 3 or x.shape[0] != plan.local_len or (heads is not None and x.shape[1] != heads):
        want = f"[{plan.local_len}, {heads if heads is not None else 'H'}, D]"
        raise ValueError(f"{name} must be {want} (this rank's two zig-zag chunks), got {tuple(x.shape)}")
    if x.device != plan.device:
        raise ValueError(f"{name} must be on the plan's device {plan.device}, got {x.device}")


def _gather_pages(plan, x, group):
    """All-gather every rank's ``[2c, H, D]`` rows into pages ``[W * 2c / page, page, H, D]``
    (rank-major; the plan's ``kv_indices`` address it). Returns ``(cache, work)``: the pages
    as NHD, or as the HND view ``[P, H, page, D]`` of the same memory when ``page == H`` (a
    shape that fits both layouts is read as HND)."""
    x = x.contiguous()
    world, n, h, d = plan.world_size, x.shape[0], x.shape[1], x.shape[2]
    if world == 1:  # the rank's rows are the whole sequence in order: its own pages
        full, work = x.view(n // plan.page_size, plan.page_size, h, d), None
    else:
        full = torch.empty((world * n // plan.page_size, plan.page_size, h, d), dtype=x.dtype, device=x.device)
        # Moved as bytes: every backend carries every dtype (fp8 and bf16 included).
        work = _all_gather_single(full.view(-1).view(torch.uint8), x.view(-1).view(torch.uint8), group=group,
                                  async_op=True)
    return (full.permute(0, 2, 1, 3) if plan.page_size == h else full), work


def cp_sparse_attention(q_local, k_local, v_local, index_q_local, index_k_local, plan: ContextParallelPlan, *,
                        group=None, out=None, lse=None, sm_scale: Optional[float] = None, k_scale: float = 1.0,
                        v_scale: float = 1.0):
    """One layer of context-parallel MSA prefill on this rank (sparse plan).

    The rank's rows (its two zig-zag chunks, ``2 * plan.chunk_len`` tokens): ``q_local
    [2c, Hq, 128]``, ``k_local, v_local [2c, Hkv, 128]`` (fp16, bf16 or fp8),
    ``index_q_local [2c, Hkv, Di]``, ``index_k_local [2c, Hik, Di]`` (fp16/bf16), torch
    tensors on the plan's device. The K/V and index keys of all ranks are all-gathered
    (``group``, the plan's) into the paged caches of the whole sequence, then
    :func:`~mate_cupy.sparse_attention_pipeline` runs this rank's queries: index max score,
    top-k selection (query positions are global, so each query selects among the blocks
    it can attend), block-sparse attention. ``out``/``lse`` (preallocated, written in
    place), ``sm_scale``, ``k_scale``/``v_scale`` as in :func:`~mate_cupy.msa`. Returns
    ``out [2c, Hq, 128]``: row ``i`` is the attention output of this rank's query ``i``.
    """
    _check_plan(plan, True, group)
    _check_local(plan, "q_local", q_local, plan.num_qo_heads)
    _check_local(plan, "k_local", k_local, plan.num_kv_heads)
    _check_local(plan, "v_local", v_local, plan.num_kv_heads)
    _check_local(plan, "index_q_local", index_q_local, plan.num_kv_heads)
    _check_local(plan, "index_k_local", index_k_local, plan.num_index_kv_heads)
    kc, wk = _gather_pages(plan, k_local, group)
    vc, wv = _gather_pages(plan, v_local, group)
    ic, wi = _gather_pages(plan, index_k_local, group)
    for w in (wk, wv, wi):
        if w is not None:
            w.wait()
    return sparse_attention_pipeline(q_local, kc, vc, index_q_local, ic, plan.attention, kv_indices=plan.kv_indices,
                                     out=out, lse=lse, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)


def cp_dense_attention(q_local, k_local, v_local, plan: ContextParallelPlan, *, group=None, out=None, lse=None,
                       sm_scale: Optional[float] = None):
    """One layer of context-parallel causal dense attention on this rank (dense plan).

    ``q_local [2c, Hq, D]``, ``k_local, v_local [2c, Hkv, D]`` (fp16, bf16 or fp8; D 64, 128
    or 256): this rank's two zig-zag chunks. K/V of all ranks are all-gathered into a paged
    cache of the whole sequence and :func:`~mate_cupy.msa` attends this rank's queries
    causally over it. ``out``, ``lse`` (float32 ``[2c, Hq]``, natural log), ``sm_scale`` as
    in :func:`~mate_cupy.msa`. Returns ``(out, lse)`` (``lse`` None unless given).
    """
    _check_plan(plan, False, group)
    _check_local(plan, "q_local", q_local, plan.num_qo_heads)
    _check_local(plan, "k_local", k_local, plan.num_kv_heads)
    _check_local(plan, "v_local", v_local, plan.num_kv_heads)
    kc, wk = _gather_pages(plan, k_local, group)
    vc, wv = _gather_pages(plan, v_local, group)
    for w in (wk, wv):
        if w is not None:
            w.wait()
    res, _ = msa(q_local, kc, vc, plan.attention, kv_indices=plan.kv_indices, out=out, lse=lse, sm_scale=sm_scale,
                 output_maxscore=False)
    return res, lse


# ----------------------------------------------------------------------------- KDA


def cp_chunk_kda(q, k, v, g, beta, *, group=None, scale: Optional[float] = None, initial_state=None,
                 output_final_state: bool = False, A_log=None, dt_bias=None, lower_bound: float = -5.0,
                 use_qk_l2norm_in_kernel: bool = True):
    """Context-parallel :func:`~mate_cupy.chunk_kda` over contiguous token segments.

    Rank ``r`` of ``group`` passes segment ``r`` of each of the ``B`` sequences: ``q, k
    [B, T_r, H, 128]``, ``v, g [B, T_r, HV, 128]``, ``beta [B, T_r, HV]`` (torch tensors,
    one device; ``T_r`` may differ between ranks, ``B``, ``H``, ``HV`` and dtypes may
    not). ``initial_state [B, HV, 128, 128]`` (V-first) is the sequences' initial state,
    read on rank 0 only. ``scale``, ``A_log``, ``dt_bias``, ``lower_bound``,
    ``use_qk_l2norm_in_kernel`` as in :func:`~mate_cupy.chunk_kda`, the same on every rank.

    Rank 0 runs its segment from the initial state; every other rank computes its
    segment's map ``S_out = S_in @ M + C`` with two ``chunk_kda`` passes (``M``: identity
    state and ``v = 0``; ``C``: zero state and the real ``v``); one all-gather of the
    float32 ``(M, C)`` (rank 0 sends its exit state as ``C``); the combine (float64, on
    the device) gives the rank's entry state, from which it computes its outputs. Returns this rank's outputs
    (v's shape, q's dtype), or ``(output, final_state)`` with ``output_final_state``:
    the float32 ``[B, HV, 128, 128]`` state after the whole sequences on the last rank,
    None on the others.
    """
    rank, world = _group_rank_size(group)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor, got {type(x).__name__}")
    if q.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q and v must be [B, T, heads, 128] (dense layout; varlen is not context-parallel), "
                         f"got q {tuple(q.shape)}, v {tuple(v.shape)}")
    B, T, HV, V = int(v.shape[0]), int(v.shape[1]), int(v.shape[2]), int(v.shape[3])
    K = int(q.shape[3])
    if K != V:
        raise ValueError(f"the segment maps need K == V (128), got K {K}, V {V}")
    gate = dict(scale=scale, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    dev = v.device
    f32 = dict(dtype=torch.float32, device=dev)
    out = torch.empty_like(v)
    if rank == 0:
        if initial_state is None:
            init = torch.zeros((B, HV, V, K), **f32)
        else:
            if not isinstance(initial_state, torch.Tensor):
                raise TypeError(f"initial_state must be a torch tensor, got {type(initial_state).__name__}")
            if tuple(initial_state.shape) != (B, HV, V, K):
                raise ValueError(f"initial_state must be [{B}, {HV}, {V}, {K}], got {tuple(initial_state.shape)}")
            init = initial_state.to(**f32)
        if T:
            out, exit_state = chunk_kda(q, k, v, g, beta, initial_state=init, output_final_state=True, output=out,
                                        **gate)
        else:
            exit_state = init
        M = torch.zeros((B, HV, K, K), **f32)  # not read: the combine starts from S = 0
        C = exit_state
    elif T:
        _, C = chunk_kda(q, k, v, g, beta, initial_state=torch.zeros((B, HV, V, K), **f32), output_final_state=True,
                         output=out, **gate)
        eye = torch.eye(K, **f32).expand(B, HV, K, K).contiguous()
        _, M = chunk_kda(q, k, torch.zeros_like(v), g, beta, initial_state=eye, output_final_state=True, output=out,
                         **gate)
    else:  # an empty segment maps every state to itself
        M = torch.eye(K, **f32).expand(B, HV, K, K).contiguous()
        C = torch.zeros((B, HV, V, K), **f32)
    if world == 1:
        return (out, C) if output_final_state else out
    maps = torch.stack([M, C]).contiguous()
    allmaps = torch.empty((world,) + tuple(maps.shape), **f32)
    _all_gather_single(allmaps.view(-1), maps.view(-1), group=group)  # flat: every backend's layout
    if rank == 0:
        final = None
    else:
        # float64 on the device: exact enough for any number of ranks, and never TF32
        # (an engine may have enabled TF32 matmuls globally)
        entry = combine_segments(allmaps[:rank, 0].double(), allmaps[:rank, 1].double())[-1].float()
        if T:
            res = chunk_kda(q, k, v, g, beta, initial_state=entry, output_final_state=output_final_state,
                            output=out, **gate)
            out, final = res if output_final_state else (res, None)
        else:
            final = entry
    if not output_final_state:
        return out
    return out, (final if rank == world - 1 else None)
