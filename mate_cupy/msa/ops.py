"""Public MSA attention ops: ``msa``, ``sparse_msa``, ``sparse_decode_atten_func``, ``sparse_msa_plan``.

Argument names, defaults, keyword handling and refusals follow the seed API; the work
is done by :func:`mate_cupy.msa.execute.run_plan`. Beyond the seed: sparse execution
with mixed decode+prefill plans, max scores from sparse and mixed plans, and
``output_o=False`` everywhere (see ``docs/semantics.md``).
"""
from __future__ import annotations

from .._logging import mate_api
from .execute import run_plan
from .plan import msa_plan_from_lengths, unpack_plan_info

__all__ = ["NoOutputRequestedError", "msa", "sparse_decode_atten_func", "sparse_msa", "sparse_msa_plan"]


class NoOutputRequestedError(ValueError, NotImplementedError):
    """``output_o=False`` without a max-score request: nothing to compute.

    A ``ValueError`` (what ``msa`` raises for it in the seed API) that is also a
    ``NotImplementedError`` (what the seed's ``sparse_msa``/``sparse_decode_atten_func``
    raise for any ``output_o=False``), so callers written against either keep working.
    """


def _nothing_requested(fn: str):
    return NoOutputRequestedError(f"{fn} requires output_o=True or output_maxscore=True")


def _pure_plan(fn: str, plan_info, mode: str):
    """The unpacked ``plan_info`` of a single (not mixed) plan of ``mode``, else ValueError."""
    info = unpack_plan_info(plan_info)
    mixed, _, _, plan, extra = info
    if mixed or extra is not None:
        raise ValueError(f"{fn} expects a pure {mode.replace('_', '-')} plan")
    if plan.mode != mode:
        raise ValueError(f"{fn} expects plan.mode == {mode!r}, got {plan.mode!r}")
    return info


def _unexpected(fn: str, kwargs: dict) -> None:
    if kwargs:
        raise TypeError(f"{fn} got unexpected keyword arguments: {', '.join(sorted(kwargs))}")


def _positional(fn: str, args: tuple):
    if len(args) < 4:
        raise TypeError(f"{fn} requires q, k, v, and plan_info")
    if len(args) > 4:
        raise TypeError(f"{fn} accepts at most q, k, v, plan_info as positional arguments")
    return args


@mate_api
def msa(q, k, v, plan_info, kv_indices=None, kv_block_indexes=None, q_offset_override=None, out=None,
        max_score=None, **kwargs):
    """MiniMax Sparse Attention through a plan: dense, paged or block-sparse, plus block max scores.

    q ``[total_q, Hq, D]``; dense plans: k, v ``[total_k, Hkv, D]``; paged and sparse plans:
    k, v ``[num_pages, page_size, Hkv, D]`` (or ``[num_pages, Hkv, page_size, D]``) with
    ``kv_indices`` (flat page ids, CSR by the plan's page counts) or ``page_table=[B, max_pages]``.
    Sparse plans need ``kv_block_indexes [total_q, Hkv or Hq, W]`` int32.
    Keywords: ``sm_scale`` (default ``D ** -0.5``), ``lse`` (preallocated float32
    ``[total_q, Hq]``, filled in every mode), ``k_scale``/``v_scale`` (fp8 sparse only),
    ``runtime_metadata`` (required by static plans), ``page_table``, ``output_o=True``,
    ``output_maxscore`` (default: the plan's), ``check_input_valid=False``.

    Returns ``(out, max_score)``: ``out [total_q, Hq, D]`` in q's dtype (bfloat16 for fp8) or
    None when ``output_o=False``; ``max_score [total_q, Hq, ceil(max_seqlen_k / 128)]``
    float32 or None.
    """
    mixed, _, _, first, _ = info = unpack_plan_info(plan_info)
    sm_scale = kwargs.pop("sm_scale", None)
    lse = kwargs.pop("lse", None)
    k_scale = float(kwargs.pop("k_scale", 1.0))
    v_scale = float(kwargs.pop("v_scale", 1.0))
    runtime_metadata = kwargs.pop("runtime_metadata", None)
    page_table = kwargs.pop("page_table", None)
    output_o = bool(kwargs.pop("output_o", True))
    output_maxscore = bool(kwargs.pop("output_maxscore", first.output_maxscore)) or max_score is not None
    check = bool(kwargs.pop("check_input_valid", False))
    _unexpected("msa", kwargs)
    if not output_o and not output_maxscore:
        raise _nothing_requested("msa")
    if mixed and runtime_metadata is not None:
        raise NotImplementedError("runtime_metadata is not supported with mixed prefill/decode plans")
    out, _, ms = run_plan(info, q, k, v, kv_indices=kv_indices, kv_block_indexes=kv_block_indexes,
                          q_offset_override=q_offset_override, out=out, lse=lse, max_score=max_score,
                          page_table=page_table, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale,
                          runtime_metadata=runtime_metadata, output_o=output_o, output_maxscore=output_maxscore,
                          check_input_valid=check)
    return out, ms


@mate_api
def sparse_msa_plan(*args, **kwargs):
    """Eager plan for a pure sparse-prefill batch (``sparse_kernel_mode='prefill'``, no split).

    Same arguments as :func:`msa_plan_from_lengths` (``kv_block_num`` is required for a
    sparse plan; ``page_size`` must be 128). Returns ``(False, 0, B, plan, None)``.
    """
    kwargs.setdefault("split_prefill_decode", False)
    kwargs["sparse_kernel_mode"] = "prefill"
    info = msa_plan_from_lengths(*args, **kwargs)
    _pure_plan("sparse_msa_plan", info, "sparse_prefill")
    return info


@mate_api
def sparse_msa(*args, **kwargs):
    """Block-sparse prefill attention: ``sparse_msa(q, k, v, plan_info, *, kv_block_indexes, ...)``.

    ``plan_info`` from :func:`sparse_msa_plan` (or any ``sparse_prefill`` plan).
    q ``[total_q, Hq, 128]`` (Hq/Hkv 8 or 16), paged k, v with page size 128,
    ``kv_indices`` or ``runtime_metadata.page_table``, ``kv_block_indexes
    [total_q, Hkv or Hq, W]`` int32 (-1 = unused). Keywords: ``out``, ``lse``,
    ``max_score``, ``sm_scale``, ``k_scale``, ``v_scale`` (fp8), ``runtime_metadata``,
    ``output_maxscore=False``, ``output_o=True``, ``q_offset_override``, ``check_input_valid``.
    Returns ``(out, max_score)`` (``max_score`` None unless requested).
    """
    q, k, v, plan_info = _positional("sparse_msa", args)
    out = kwargs.pop("out", None)
    lse = kwargs.pop("lse", None)
    max_score = kwargs.pop("max_score", None)
    sm_scale = kwargs.pop("sm_scale", None)
    k_scale = float(kwargs.pop("k_scale", 1.0))
    v_scale = float(kwargs.pop("v_scale", 1.0))
    runtime_metadata = kwargs.pop("runtime_metadata", None)
    kv_indices = kwargs.pop("kv_indices", None)
    output_maxscore = bool(kwargs.pop("output_maxscore", False)) or max_score is not None
    output_o = bool(kwargs.pop("output_o", True))
    kv_block_indexes = kwargs.pop("kv_block_indexes", None)
    q_offset_override = kwargs.pop("q_offset_override", None)
    check = bool(kwargs.pop("check_input_valid", False))
    _unexpected("sparse_msa", kwargs)
    if not output_o and not output_maxscore:
        raise _nothing_requested("sparse_msa")
    if output_o and kv_block_indexes is None:
        raise ValueError("sparse_msa requires kv_block_indexes")
    info = _pure_plan("sparse_msa", plan_info, "sparse_prefill")
    out, _, ms = run_plan(info, q, k, v, kv_indices=kv_indices, kv_block_indexes=kv_block_indexes,
                          q_offset_override=q_offset_override, out=out, lse=lse, max_score=max_score,
                          sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, runtime_metadata=runtime_metadata,
                          output_o=output_o, output_maxscore=output_maxscore, check_input_valid=check)
    return out, ms


@mate_api
def sparse_decode_atten_func(*args, **kwargs):
    """Block-sparse decode attention: ``sparse_decode_atten_func(q, k, v, plan_info, **kw)``.

    ``plan_info``: a ``sparse_decode`` plan (``kv_block_num > 0``, ``max qo_len <= 32`` or
    ``sparse_kernel_mode='decode'``). Operands as in :func:`sparse_msa`, plus ``page_table``.
    Returns ``out``; ``(out, lse)`` with ``return_softmax_lse=True``; the max score is
    appended (``(out, max_score)`` or ``(out, lse, max_score)``) when ``output_maxscore``
    or ``max_score`` is given.
    """
    q, k, v, plan_info = _positional("sparse_decode_atten_func", args)
    out = kwargs.pop("out", None)
    lse = kwargs.pop("lse", None)
    max_score = kwargs.pop("max_score", None)
    sm_scale = kwargs.pop("sm_scale", None)
    k_scale = float(kwargs.pop("k_scale", 1.0))
    v_scale = float(kwargs.pop("v_scale", 1.0))
    runtime_metadata = kwargs.pop("runtime_metadata", None)
    kv_indices = kwargs.pop("kv_indices", None)
    page_table = kwargs.pop("page_table", None)
    kv_block_indexes = kwargs.pop("kv_block_indexes", None)
    q_offset_override = kwargs.pop("q_offset_override", None)
    output_maxscore = bool(kwargs.pop("output_maxscore", False)) or max_score is not None
    output_o = bool(kwargs.pop("output_o", True))
    return_softmax_lse = bool(kwargs.pop("return_softmax_lse", False))
    check = bool(kwargs.pop("check_input_valid", False))
    _unexpected("sparse_decode_atten_func", kwargs)
    if not output_o and not output_maxscore:
        raise _nothing_requested("sparse_decode_atten_func")
    info = _pure_plan("sparse_decode_atten_func", plan_info, "sparse_decode")
    out, lse_out, ms = run_plan(info, q, k, v, kv_indices=kv_indices, kv_block_indexes=kv_block_indexes,
                                q_offset_override=q_offset_override, out=out, lse=lse, max_score=max_score,
                                page_table=page_table, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale,
                                runtime_metadata=runtime_metadata, output_o=output_o,
                                output_maxscore=output_maxscore, want_lse=return_softmax_lse,
                                check_input_valid=check)
    result = (out, lse_out) if return_softmax_lse else (out,)
    if output_maxscore:
        result = result + (ms,)
    return result[0] if len(result) == 1 else result
