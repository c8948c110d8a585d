"""``sparse_topk_select``: per query and head, the 128-key blocks to attend.

Path: :func:`validate_topk` -> :class:`TopkProblem` -> the float64 reference (host
arrays) or :func:`~mate_cupy.msa.index_launch.select_topk_config` ->
:func:`~mate_cupy.msa.index_launch.launch_topk` on the caller's stream (CUDA arrays).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .._logging import mate_api
from ..checks import check_contiguous, check_dtype, check_given, int_arg
from ..reference import msa as ref
from ..runtime.interop import FLOAT32, INT32, INT64, Arg, Call
from . import index_launch
from .plan import MAX_K_TILES, selected_block_count, unpack_plan_info

__all__ = ["TopkProblem", "plan_query_positions", "sparse_topk_select", "validate_topk"]


@dataclass(frozen=True)
class TopkProblem:
    """A validated selection: ``max_score [total_q, num_qo_heads, max_k_tiles]`` into
    ``[total_q, num_qo_heads, width]``.

    ``num_valid_pages``: ``V`` (``max_k_tiles`` when not given). ``scores_aligned``:
    ``max_k_tiles % 4 == 0`` and ``max_score`` 16-byte aligned (16-byte loads).
    ``device``: -1 for host arrays.
    """

    total_q: int
    num_qo_heads: int
    max_k_tiles: int
    topk: int
    width: int
    num_valid_pages: int
    force_begin_blocks: int
    force_end_blocks: int
    force_blocks_count_in_topk: bool
    has_query_positions: bool
    scores_aligned: bool
    device: int

    @property
    def rows(self) -> int:
        """Selection rows: ``total_q * num_qo_heads``."""
        return self.total_q * self.num_qo_heads

    @property
    def free_slots(self) -> int:
        """``K = W - begin - end``: the blocks chosen by score."""
        return self.width - self.force_begin_blocks - self.force_end_blocks


def validate_topk(max_score: Arg, topk: int, num_valid_pages: Optional[int], output: Optional[Arg],
                  force_begin_blocks: int, force_end_blocks: int, force_blocks_count_in_topk: bool,
                  query_positions: Optional[Arg]) -> TopkProblem:
    """Every condition of :func:`sparse_topk_select`, for host and CUDA arrays alike.

    ``TypeError`` for dtypes, ``ValueError`` for shapes, values and layouts (devices are
    checked by :class:`~mate_cupy.runtime.interop.Call`)."""
    check_dtype(max_score, (FLOAT32,))
    if max_score.ndim != 3:
        raise ValueError(f"max_score must have shape [total_q, num_qo_heads, max_k_tiles], got {max_score.shape}")
    check_contiguous(max_score)
    total_q, num_qo_heads, nt = (int(x) for x in max_score.shape)
    if num_qo_heads <= 0 or nt <= 0:
        raise ValueError(f"max_score must have positive num_qo_heads and max_k_tiles, got {max_score.shape}")
    if nt >= MAX_K_TILES:
        raise ValueError(f"sparse_topk_select supports max_k_tiles < {MAX_K_TILES}, got {nt}")
    if query_positions is not None:
        check_dtype(query_positions, (INT64,))
        if query_positions.shape != (total_q,):
            raise ValueError(
                f"query_positions must have shape [total_q] = ({total_q},), got {query_positions.shape}"
            )
        check_contiguous(query_positions)
    if num_valid_pages is None:
        valid_pages = nt
    else:
        valid_pages = int_arg("num_valid_pages", num_valid_pages, lo=None)
        if valid_pages <= 0 or valid_pages > nt:
            raise ValueError(f"num_valid_pages must be in (0, max_k_tiles={nt}], got {valid_pages}")
    topk = int_arg("topk", topk, lo=None)
    begin = int_arg("force_begin_blocks", force_begin_blocks, lo=None)
    end = int_arg("force_end_blocks", force_end_blocks, lo=None)
    count_in_topk = bool(force_blocks_count_in_topk)
    width = selected_block_count(topk, begin, end, count_in_topk)
    if output is not None:
        check_dtype(output, (INT32,))
        expected = (total_q, num_qo_heads, width)
        if output.shape != expected:
            raise ValueError(f"output must have shape [total_q, num_qo_heads, W] = {expected}, got {output.shape}")
        check_contiguous(output)
    return TopkProblem(total_q, num_qo_heads, nt, int(topk), width, valid_pages, begin, end, count_in_topk,
                       query_positions is not None, nt % 4 == 0 and max_score.ptr % 16 == 0, max_score.device)


def _as_array(obj):
    return np.asarray(obj) if isinstance(obj, (list, tuple)) else obj


def plan_query_positions(plan_info) -> np.ndarray:
    """The key position each query row of an eager plan may attend up to: host int64
    ``[total_q]``, rows in the plan's order (a mixed plan's first part, then its second).

    Causal parts: ``min(qo_offset[b] + i, kv_lens[b] - 1)`` for query ``i`` of request
    ``b``; non-causal parts: ``kv_lens[b] - 1``. With these as ``query_positions``, every
    row's valid blocks are the blocks it can attend (none for a request without keys).
    Static plans carry no lengths (``ValueError``).
    """
    mixed, _, _, first, second = unpack_plan_info(plan_info)
    pieces = []
    for plan in (first, second) if mixed else (first,):
        if plan.is_static:
            raise ValueError("plan_info is a static plan: its lengths are runtime data, so the query positions "
                             "cannot be derived; pass query_positions (int64 [total_q]) instead")
        qo = np.asarray(plan.qo_lens, dtype=np.int64)
        kv = np.asarray(plan.kv_lens, dtype=np.int64)
        off = np.asarray(plan.qo_offset, dtype=np.int64)
        req = np.repeat(np.arange(qo.shape[0]), qo)
        first_row = np.concatenate([[0], np.cumsum(qo)[:-1]]) if qo.shape[0] else qo
        last_key = kv[req] - 1
        if plan.causal:
            i = np.arange(req.shape[0]) - first_row[req]
            pieces.append(np.minimum(off[req] + i, last_key))
        else:
            pieces.append(last_key)
    return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)


def _positions_of(plan_info, call: Call):
    """:func:`plan_query_positions` on ``call``'s device, kept on the plan's first part (an
    eager plan's lengths never change), one array per device."""
    first = unpack_plan_info(plan_info)[3]
    cache = first.topk_query_positions
    key = (bool(unpack_plan_info(plan_info)[0]), call.device)
    pos = cache.get(key)
    if pos is None:
        pos = plan_query_positions(plan_info)
        if call.is_cuda:
            import cupy

            with call.launch_scope():
                pos = cupy.asarray(pos)
        cache[key] = pos
    return pos


@mate_api
def sparse_topk_select(max_score, topk: int, num_valid_pages: Optional[int] = None, output=None,
                       force_begin_blocks: int = 0, force_end_blocks: int = 0,
                       force_blocks_count_in_topk: bool = True, query_positions=None, plan_info=None):
    """Select the blocks each query attends from its block max scores.

    ``max_score [total_q, Hq, NT]`` float32 contiguous (``0 < NT < 12288``); ``topk`` in
    {4, 8, 16, 32, 64}. Valid blocks: ``[0, V_i)`` with ``V = num_valid_pages`` (default
    ``NT``, else in ``(0, NT]``) and, given ``query_positions`` (int64 ``[total_q]``
    contiguous, absolute positions), ``V_i = clamp(min(V, pos_i // 128 + 1), 0)``. The first
    ``force_begin_blocks`` and last ``force_end_blocks`` valid blocks are always chosen;
    the other slots take the highest scores (ties: lower index; NaN ranks below every
    number). Width ``W = topk`` when ``force_blocks_count_in_topk`` (then ``begin + end
    <= topk``) else ``topk + begin + end``; ``W <= 64``.

    ``plan_info``: an eager plan of the call whose scores these are; the positions are then
    derived from its lengths (:func:`plan_query_positions`), so a causal prefill never
    selects blocks past a query's position, and the forced end blocks are each query's
    last attendable blocks. Without it or ``query_positions`` every row has the same ``V``
    valid blocks. Give one of the two, not both (``ValueError``).

    Returns int32 ``[total_q, Hq, W]`` in ``max_score``'s framework (``output``, int32
    contiguous, written in place and returned when given): chosen block ids ascending,
    then ``-1``. CUDA arrays run on the caller's current stream.
    """
    check_given("sparse_topk_select", max_score=max_score)
    call = Call(max_score=max_score, output=_as_array(output))
    if plan_info is not None:
        if query_positions is not None:
            raise ValueError("give query_positions or plan_info, not both")
        query_positions = _positions_of(plan_info, call)
    call.add("query_positions", _as_array(query_positions))
    problem = validate_topk(call["max_score"], topk, num_valid_pages, call["output"], force_begin_blocks,
                            force_end_blocks, force_blocks_count_in_topk, call["query_positions"])
    out = call["output"]
    if out is None:
        out = call.new("output", (problem.total_q, problem.num_qo_heads, problem.width), INT32)
    if problem.total_q == 0:
        return output if output is not None else out.obj
    qp = call["query_positions"]
    if not call.is_cuda:
        out.data[...] = ref.topk_select(call["max_score"].data, problem.topk, problem.num_valid_pages,
                                        problem.force_begin_blocks, problem.force_end_blocks,
                                        problem.force_blocks_count_in_topk, None if qp is None else qp.data)
        return output if output is not None else out.obj  # read after the write (JAX copies)
    with call.device_scope():
        index_launch.launch_topk(problem, index_launch.select_topk_config(problem), call["max_score"], out, qp,
                                 call.stream_ptr)
    return output if output is not None else out.obj
