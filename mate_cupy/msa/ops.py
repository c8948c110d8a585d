"""Public MSA attention ops: ``msa``, ``sparse_msa``, ``sparse_decode_atten_func``, ``sparse_msa_plan``.

Argument names, defaults and return values are those of docs/api.md; each op is one call of
:func:`mate_cupy.msa.execute.run` (one validation, then the host references or the CUDA
launchers). They also run sparse execution with mixed decode+prefill plans, max scores
from sparse and mixed plans, ``output_o=False`` everywhere, and a caller ``workspace``
(see ``docs/semantics.md``).
"""
from __future__ import annotations

from typing import Optional

from .._logging import mate_api
from .execute import run
from .plan import SPARSE_BLOCK_SIZE, msa_plan_from_lengths, unpack_plan_info

__all__ = ["NoOutputRequestedError", "msa", "sparse_decode_atten_func", "sparse_msa", "sparse_msa_plan"]


class NoOutputRequestedError(ValueError, NotImplementedError):
    """``output_o=False`` without a max-score request: nothing to compute.

    Both a ``ValueError`` (the type ``msa`` raises for it) and a
    ``NotImplementedError`` (the type ``sparse_msa``/``sparse_decode_atten_func`` raise for
    any ``output_o=False``), so callers catching either keep working.
    """


def _nothing_requested(fn: str):
    return NoOutputRequestedError(f"{fn} requires output_o=True or output_maxscore=True")


def _pure_plan(fn: str, plan_info, mode: str) -> tuple:
    """The unpacked ``plan_info`` of a single (not mixed) plan of ``mode``, else ValueError."""
    info = unpack_plan_info(plan_info)
    mixed, _, _, plan, extra = info
    if mixed or extra is not None:
        raise ValueError(f"{fn} expects a pure {mode.replace('_', '-')} plan")
    if plan.mode != mode:
        raise ValueError(f"{fn} expects plan.mode == {mode!r}, got {plan.mode!r}")
    return info


@mate_api
def msa(q, k, v, plan_info, kv_indices=None, kv_block_indexes=None, q_offset_override=None, out=None,
        max_score=None, *, sm_scale: Optional[float] = None, lse=None, k_scale: float = 1.0, v_scale: float = 1.0,
        runtime_metadata=None, page_table=None, output_o: bool = True, output_maxscore: Optional[bool] = None,
        check_input_valid: bool = False, workspace=None):
    """MiniMax Sparse Attention through a plan: dense, paged or block-sparse, plus block max scores.

    q ``[total_q, Hq, D]`` (fp16, bf16 or fp8; D 64, 128 or 256, 128 when sparse); dense plans:
    k, v ``[total_k, Hkv, D]``; paged and sparse plans: k, v ``[num_pages, page_size, Hkv, D]``
    (or ``[num_pages, Hkv, page_size, D]``) with ``kv_indices`` (flat page ids, CSR by the
    plan's page counts) or ``page_table [B, max_pages]``. Sparse plans need
    ``kv_block_indexes [total_q, Hkv or Hq, W]`` int32. q, k, v are read in place when their
    head dim is contiguous and their other strides and data 16-byte aligned, else from a
    contiguous copy made on each call. ``q_offset_override``: an int or
    ``[B]`` (eager plans). ``sm_scale`` (default ``D ** -0.5``); ``lse`` (preallocated float32
    ``[total_q, Hq]``, filled in every mode); ``k_scale``/``v_scale`` (fp8 sparse attention;
    an fp8 max score of any plan is ``k_scale`` times the block max: sm_89+ up to
    ``max_seqlen_q * Hq / Hkv <= 32`` packed rows, 16 at D 256, sm_90 only above);
    ``runtime_metadata`` (required by static plans); ``output_o``; ``output_maxscore``
    (default: the plan's; a given ``max_score`` implies it); ``check_input_valid`` (read the
    indices on the host and refuse invalid ones: a synchronisation on CUDA); ``workspace``
    (a ``mate_cupy.Workspace`` or contiguous CUDA array of at least
    ``plan.workspace_bytes(D, q.dtype)`` bytes; default: the plan's own).

    Returns ``(out, max_score)``: ``out [total_q, Hq, D]`` in q's dtype (bfloat16 for fp8) or
    None when ``output_o=False``; ``max_score [total_q, Hq, ceil(max_seqlen_k / 128)]``
    float32 or None.
    """
    info = unpack_plan_info(plan_info)
    if output_maxscore is None:
        output_maxscore = info[3].output_maxscore
    output_maxscore = bool(output_maxscore) or max_score is not None
    if not output_o and not output_maxscore:
        raise _nothing_requested("msa")
    res_o, _, res_ms = run("msa", info, q, k, v, kv_indices, kv_block_indexes, q_offset_override, out, lse,
                           max_score, page_table, sm_scale, k_scale, v_scale, runtime_metadata, bool(output_o),
                           output_maxscore, False, bool(check_input_valid), workspace)
    return res_o, res_ms


@mate_api
def sparse_msa_plan(qo_segment_lens, kv_segment_lens, num_qo_heads: int, num_kv_heads: Optional[int] = None, *,
                    qo_offset=None, split_prefill_decode: bool = False, num_kv_splits: int = -1,
                    page_size: int = -1, sparse_block_size: int = SPARSE_BLOCK_SIZE, output_maxscore: bool = False,
                    kv_block_num: int = -1, force_begin_blocks: int = 0, force_end_blocks: int = 0,
                    force_blocks_count_in_topk: bool = True, usable_SM_count: Optional[int] = None,  # noqa: N803
                    causal: bool = True, sparse_kernel_mode: str = "prefill", use_fp8_kvcache: bool = False,
                    device=None, stream=None, prefill_tile: Optional[str] = "gather"):
    """Eager plan for a pure sparse-prefill batch.

    Arguments as :func:`~mate_cupy.msa.plan.msa_plan_from_lengths` (``kv_block_num`` is
    required, ``page_size`` must be 128); the plan is always ``sparse_prefill``
    (``sparse_kernel_mode`` is accepted and not used) and ``split_prefill_decode`` defaults
    to False (True with a decode-sized first request is a ``ValueError``).
    Returns ``(False, 0, B, plan, None)``.
    """
    del sparse_kernel_mode
    info = msa_plan_from_lengths(
        qo_segment_lens, kv_segment_lens, num_qo_heads, num_kv_heads, qo_offset=qo_offset,
        split_prefill_decode=split_prefill_decode, num_kv_splits=num_kv_splits, page_size=page_size,
        sparse_block_size=sparse_block_size, output_maxscore=output_maxscore, kv_block_num=kv_block_num,
        force_begin_blocks=force_begin_blocks, force_end_blocks=force_end_blocks,
        force_blocks_count_in_topk=force_blocks_count_in_topk, usable_SM_count=usable_SM_count, causal=causal,
        sparse_kernel_mode="prefill", use_fp8_kvcache=use_fp8_kvcache, device=device, stream=stream,
        prefill_tile=prefill_tile)
    _pure_plan("sparse_msa_plan", info, "sparse_prefill")
    return info


@mate_api
def sparse_msa(q, k, v, plan_info, *, out=None, lse=None, max_score=None, sm_scale: Optional[float] = None,
               k_scale: float = 1.0, v_scale: float = 1.0, runtime_metadata=None, kv_indices=None,
               output_maxscore: bool = False, output_o: bool = True, kv_block_indexes=None, q_offset_override=None,
               check_input_valid: bool = False, workspace=None):
    """Block-sparse prefill attention.

    ``plan_info`` from :func:`sparse_msa_plan` (or any ``sparse_prefill`` plan).
    q ``[total_q, Hq, 128]`` (Hq/Hkv 8 or 16), paged k, v with page size 128,
    ``kv_indices`` or ``runtime_metadata.page_table``, ``kv_block_indexes
    [total_q, Hkv or Hq, W]`` int32 (-1 = unused; required unless ``output_o=False``).
    Other keywords as in :func:`msa` (``output_maxscore`` defaults to False here).
    Returns ``(out, max_score)`` (``max_score`` None unless requested).
    """
    output_maxscore = bool(output_maxscore) or max_score is not None
    if not output_o and not output_maxscore:
        raise _nothing_requested("sparse_msa")
    if output_o and kv_block_indexes is None:
        raise ValueError("sparse_msa requires kv_block_indexes")
    info = _pure_plan("sparse_msa", plan_info, "sparse_prefill")
    res_o, _, res_ms = run("sparse_msa", info, q, k, v, kv_indices, kv_block_indexes, q_offset_override, out, lse,
                           max_score, None, sm_scale, k_scale, v_scale, runtime_metadata, bool(output_o),
                           output_maxscore, False, bool(check_input_valid), workspace)
    return res_o, res_ms


@mate_api
def sparse_decode_atten_func(q, k, v, plan_info, *, out=None, lse=None, max_score=None,
                             sm_scale: Optional[float] = None, k_scale: float = 1.0, v_scale: float = 1.0,
                             runtime_metadata=None, kv_indices=None, page_table=None, kv_block_indexes=None,
                             q_offset_override=None, output_maxscore: bool = False, output_o: bool = True,
                             return_softmax_lse: bool = False, check_input_valid: bool = False, workspace=None):
    """Block-sparse decode attention.

    ``plan_info``: a ``sparse_decode`` plan (``kv_block_num > 0``, ``max qo_len <= 32`` or
    ``sparse_kernel_mode='decode'``). Operands as in :func:`sparse_msa`, plus ``page_table``.
    Returns ``out``; ``(out, lse)`` with ``return_softmax_lse=True``; the max score is
    appended (``(out, max_score)`` or ``(out, lse, max_score)``) when ``output_maxscore``
    or ``max_score`` is given.
    """
    output_maxscore = bool(output_maxscore) or max_score is not None
    if not output_o and not output_maxscore:
        raise _nothing_requested("sparse_decode_atten_func")
    info = _pure_plan("sparse_decode_atten_func", plan_info, "sparse_decode")
    res_o, res_lse, res_ms = run(
        "sparse_decode_atten_func", info, q, k, v, kv_indices, kv_block_indexes, q_offset_override, out, lse,
        max_score, page_table, sm_scale, k_scale, v_scale, runtime_metadata, bool(output_o), output_maxscore,
        bool(return_softmax_lse), bool(check_input_valid), workspace)
    if not return_softmax_lse and not output_maxscore:
        return res_o
    result = (res_o, res_lse) if return_softmax_lse else (res_o,)
    return result + (res_ms,) if output_maxscore else result
