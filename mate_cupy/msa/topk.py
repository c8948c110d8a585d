"""``sparse_topk_select``: per query and head, the 128-key blocks to attend (SPEC section 4)."""
from __future__ import annotations

import numpy as np

from .. import _launch_cache as lc
from .._interop import FLOAT32, INT32, INT64, Call, dtype_name, wrap
from .._logging import mate_api
from .._validate import where
from ..reference import msa as ref
from . import kernels
from .plan import MAX_K_TILES, selected_block_count

__all__ = ["sparse_topk_select"]


def _as_array(obj):
    return np.asarray(obj) if isinstance(obj, (list, tuple)) else obj


@mate_api
def sparse_topk_select(max_score, topk: int, num_valid_pages=None, output=None, force_begin_blocks: int = 0,
                       force_end_blocks: int = 0, force_blocks_count_in_topk: bool = True, query_positions=None):
    """Select the blocks each query attends from its block max scores.

    ``max_score [total_q, Hq, NT]`` float32 contiguous (``NT < 12288``); ``topk`` in
    {4, 8, 16, 32, 64}. Valid blocks: ``[0, V_i)`` with ``V = num_valid_pages`` (default
    ``NT``) and, given ``query_positions`` (int64 ``[total_q]``, absolute positions),
    ``V_i = clamp(min(V, pos_i // 128 + 1), 0)``. The first ``force_begin_blocks`` and last
    ``force_end_blocks`` valid blocks are always chosen; the other slots take the highest
    scores (ties: lower index; NaN ranks below every number). Width ``W = topk`` when
    ``force_blocks_count_in_topk`` else ``topk + begin + end`` (``W <= 64``).

    Returns int32 ``[total_q, Hq, W]`` (``output`` written in place when given): chosen
    block ids ascending, then ``-1``.
    """
    key = None
    if lc.ENABLED:
        opts = (topk, num_valid_pages, force_begin_blocks, force_end_blocks, force_blocks_count_in_topk)
        if lc.plain(opts):
            sig, ptrs = lc.signature((max_score, output, query_positions))
            if sig is not None:
                key = (opts, sig)
                recipe = _RECIPES.get(key)
                if recipe is not None:
                    allocs = lc.replay(recipe, ptrs, max_score)
                    return output if output is not None else allocs["output"]
    rec = lc.Recorder(_ARRAYS) if key is not None else None
    with lc.recording(rec):
        call, result = _select(max_score, topk, num_valid_pages, output, force_begin_blocks, force_end_blocks,
                               force_blocks_count_in_topk, query_positions)
    if rec is not None:
        lc.store(_RECIPES, key, rec, call)
    return result


# Array arguments in signature order (replayed launches, see ``mate_cupy._launch_cache``).
_ARRAYS = ("max_score", "output", "query_positions")
_RECIPES = lc.new_cache()


def _select(max_score, topk, num_valid_pages, output, force_begin_blocks, force_end_blocks,
            force_blocks_count_in_topk, query_positions):
    """:func:`sparse_topk_select` without replay: returns ``(call, result)``."""
    call = Call(max_score=max_score)
    ms = call["max_score"]
    if ms.dtype != FLOAT32:
        raise TypeError(f"max_score must be float32, got {dtype_name(ms.dtype)}")
    if ms.ndim != 3:
        raise ValueError(f"max_score must have shape [total_q, num_qo_heads, max_k_tiles], got {ms.shape}")
    if not ms.is_contiguous():
        raise ValueError("max_score must be contiguous")
    lc.note_arg("max_score", ms.data)
    topk = int(topk)
    total_q, num_qo_heads, nt = ms.shape
    if num_qo_heads <= 0 or nt <= 0:
        raise ValueError(f"max_score must have positive num_qo_heads and max_k_tiles, got {ms.shape}")
    if nt >= MAX_K_TILES:
        raise ValueError(f"sparse_topk_select supports max_k_tiles < {MAX_K_TILES}, got {nt}")
    qp = None
    if query_positions is not None:
        qp = wrap("query_positions", _as_array(query_positions))
        if qp.dtype != INT64:
            raise TypeError(f"query_positions must be int64, got {dtype_name(qp.dtype)}")
        if qp.ndim != 1 or qp.shape[0] != total_q:
            raise ValueError(f"query_positions must have shape [total_q], got {qp.shape} for total_q={total_q}")
        if not qp.is_contiguous():
            raise ValueError("query_positions must be contiguous")
        lc.note_arg("query_positions", qp.data)
        if qp.device != ms.device:
            raise ValueError(
                f"query_positions must be on the same device as max_score ({where(ms.device)}), got {where(qp.device)}"
            )
    if num_valid_pages is None:
        valid_pages = nt
    else:
        valid_pages = int(num_valid_pages)
        if valid_pages <= 0 or valid_pages > nt:
            raise ValueError(f"num_valid_pages must be in (0, max_k_tiles], got {valid_pages} for max_k_tiles={nt}")
    begin, end = int(force_begin_blocks), int(force_end_blocks)
    count_in_topk = bool(force_blocks_count_in_topk)
    width = selected_block_count(topk, begin, end, count_in_topk)
    expected = (total_q, num_qo_heads, width)
    if output is None:
        out = call.empty(expected, INT32)
        lc.note_alloc("output", out)
    else:
        o = wrap("output", _as_array(output))
        if o.dtype != INT32:
            raise TypeError(f"output must be int32, got {dtype_name(o.dtype)}")
        if o.shape != expected:
            raise ValueError(f"output shape must be {expected}, got {o.shape}")
        if not o.is_contiguous():
            raise ValueError("output must be contiguous")
        if o.device != ms.device:
            raise ValueError(f"output must be on the same device as max_score ({where(ms.device)}), got {where(o.device)}")
        out = o.data
        lc.note_arg("output", out)
    result = output if output is not None else call.export(out, dtype=INT32)
    if total_q == 0:
        return call, result

    if not call.is_cuda:
        out[...] = ref.topk_select(ms.data, topk, valid_pages, begin, end, count_in_topk,
                                   None if qp is None else qp.data)
        return call, result
    if qp is None and valid_pages <= width:
        # Identity: every valid block fits; no scores need reading.
        import cupy

        lc.refuse()  # CuPy element-wise kernels, not recorded launches
        with call.launch_scope():
            ids = cupy.arange(width, dtype=cupy.int32)
            out[...] = cupy.where(ids < valid_pages, ids, -1)[None, None, :]
        return call, result
    launch = kernels.topk_launcher()
    with call.launch_scope():
        launch(ms.data, out, topk=topk, num_valid_pages=valid_pages, force_begin_blocks=begin,
               force_end_blocks=end, force_blocks_count_in_topk=count_in_topk,
               query_positions=None if qp is None else qp.data, stream=call.stream)
    return call, result
