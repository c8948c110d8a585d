"""``torch.library`` custom ops: mate_cupy under ``torch.compile`` and CUDA graphs.

Importing this module registers the ops ``torch.ops.mate_cupy.<name>``: ``msa``,
``sparse_msa``, ``sparse_decode_atten_func``, ``sparse_topk_select`` and
``sparse_topk_select_out`` (writes ``output``), ``chunk_kda``, ``gated_delta_rule_decode``,
``gated_delta_rule_decode_inplace`` (writes the state pool), ``cast`` and ``cast_out``
(writes ``out``), and ``build_page_table_from_flat_kv_indices``. Each calls the public function of
the same name (CUDA tensors run the kernels on torch's current stream, CPU tensors the
float64 references) and has a fake implementation giving its output shapes and dtypes.

Schema conventions (``docs/frameworks.md``):

* Outputs the caller preallocates (``out``, ``lse``, ``max_score``, ``output``,
  ``final_state``) and a ``workspace`` are optional arguments the op mutates; outputs it
  allocates are returned. A returned zero-element tensor (q's dtype) stands for an output
  the op did not allocate (given by the caller, or not requested). Single-result ops
  come as a functional op and an ``_out`` op that returns nothing, so no op both mutates
  an argument and returns a lone tensor.
* An MSA plan is passed as an int handle (:func:`register_plan`) plus, for static plans,
  the :class:`~mate_cupy.MsaRuntimeMetadata` tensors as tensor arguments (``rt_*``), so
  CUDA-graph replays read the metadata of each call.

The functions of this module take the public functions' arguments (plans and runtime
metadata as objects, tensors only) and call the ops; they are what compiled code calls.
"""
import inspect
import itertools
import weakref
from typing import Optional

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised without torch installed
    raise ImportError(
        "mate_cupy.integrations.torch_ops needs PyTorch: pip install 'mate_cupy[torch]' (torch >= 2.4)"
    ) from exc

from ..kda_interface import chunk_kda as _chunk_kda
from ..kda_interface import gated_delta_rule_decode as _decode
from ..msa.ops import msa as _msa
from ..msa.ops import sparse_decode_atten_func as _sparse_decode
from ..msa.ops import sparse_msa as _sparse_msa
from ..msa.page_table import build_page_table_from_flat_kv_indices as _page_table
from ..msa.pipeline import SparsePipelinePlan, add_pipeline_plan_hook
from ..msa.pipeline import sparse_attention_pipeline as _pipeline
from ..msa.plan import MsaRuntimeMetadata, add_plan_hook, max_k_tiles, selected_block_count, unpack_plan_info
from ..msa.topk import sparse_topk_select as _topk
from ..util_ops import cast as _cast

__all__ = [
    "build_page_table_from_flat_kv_indices",
    "cast",
    "chunk_kda",
    "gated_delta_rule_decode",
    "msa",
    "register_plan",
    "register_pipeline_plan",
    "sparse_attention_pipeline",
    "sparse_decode_atten_func",
    "sparse_msa",
    "sparse_topk_select",
]

Tensor = torch.Tensor
MAX_LIVE_PLANS = 65536

# ----------------------------------------------------------------------------- operator definition

_LIB = torch.library.Library("mate_cupy", "FRAGMENT")


class _Op:
    """One operator ``mate_cupy::<name>``: its schema inferred from the implementation's
    annotations (``torch.library.infer_schema``, the schema ``torch.library.custom_op`` would
    define), the implementation registered for every backend (``CompositeExplicitAutograd``:
    CPU tensors run the references, CUDA tensors the kernels) and a fake implementation
    (:meth:`register_fake`).

    Why not ``torch.library.custom_op``: it adds Python dispatch layers (an autograd and an
    ``ADInplaceOrView`` kernel, a per-device-type dispatch) that cost several times the
    eager call on a decode step. Here an eager call goes from the dispatcher straight to
    the implementation, which bumps the version counters of the arguments it wrote (what
    the ``ADInplaceOrView`` kernel does). The ops are forward-only: no autograd formula.
    """

    __slots__ = ("name", "mutated")

    def __init__(self, name: str, fn, mutates_args: tuple):
        self.name = name
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        params = list(inspect.signature(fn).parameters)
        self.mutated = tuple(params.index(m) for m in mutates_args)
        _LIB.impl(name, self._impl(fn, self.mutated), "CompositeExplicitAutograd")

    @staticmethod
    def _impl(fn, mutated: tuple):
        if not mutated:
            return fn
        bump = torch.autograd.graph.increment_version

        def impl(*args, **kwargs):
            result = fn(*args, **kwargs)
            written = [args[i] for i in mutated if args[i] is not None]
            if written:
                bump(written)
            return result

        return impl

    def register_fake(self, fake):
        torch.library.register_fake(f"mate_cupy::{self.name}", fake, lib=_LIB)
        return fake


def _op(name: str, mutates_args):
    """Define ``mate_cupy::<name>`` from the decorated implementation (see :class:`_Op`)."""
    return lambda fn: _Op(name, fn, tuple(mutates_args))


# ----------------------------------------------------------------------------- plan handles

# handle -> (mixed, split, batch, weakref to the first part, the second part or None). An
# entry lives as long as its first part (weakref.finalize); handles are never reused, so a
# handle baked into a compiled graph names one plan object or none.
_PLANS: dict = {}
_HANDLES = itertools.count(1)


def _handle_attr(mixed: bool) -> str:
    return "_torch_op_mixed_handle" if mixed else "_torch_op_handle"


def register_plan(plan_info) -> int:
    """The op handle of ``plan_info`` (an ``MsaPlan`` or a planner's 5-tuple): an int, the same
    for every call with this plan, stored on the plan and freed with it.

    The wrappers of this module call it; under ``torch.compile`` it runs at trace time and
    the handle becomes a graph constant (Dynamo guards on the plan object). At most
    :data:`MAX_LIVE_PLANS` plans are registered at once (``RuntimeError`` beyond).
    """
    mixed, split, batch, first, second = unpack_plan_info(plan_info)
    return _register(bool(mixed), int(split), int(batch), first, second if mixed else None)


def _new_handle(registry: dict, owner, attr: str, entry, what: str) -> int:
    """A fresh handle for ``entry`` in ``registry``, dropped when ``owner`` is collected and
    stored on it as ``attr``."""
    if len(registry) >= MAX_LIVE_PLANS:
        raise RuntimeError(f"more than {MAX_LIVE_PLANS} {what} registered for torch ops are alive")
    handle = next(_HANDLES)
    registry[handle] = entry
    weakref.finalize(owner, registry.pop, handle, None)
    setattr(owner, attr, handle)
    return handle


@torch.compiler.assume_constant_result
def _register(mixed: bool, split: int, batch: int, first, second) -> int:
    attr = _handle_attr(mixed)
    handle = first.__dict__.get(attr)
    if handle is not None and handle in _PLANS and _PLANS[handle][3]() is first:
        return handle  # (a copy of a registered plan carries the attribute, not the entry)
    return _new_handle(_PLANS, first, attr, (mixed, split, batch, weakref.ref(first), second), "MSA plans")


# Plans built from now on are registered when built: under torch.compile their handle is
# then a plain attribute read (no registration traced; older Dynamo cannot trace it).
add_plan_hook(register_plan)


def _plan_info(handle: int) -> tuple:
    entry = _PLANS.get(handle)
    first = None if entry is None else entry[3]()
    if first is None:
        raise ValueError(f"no live MSA plan has handle {handle} (see mate_cupy.integrations.torch_ops.register_plan)")
    return (entry[0], entry[1], entry[2], first, entry[4])


def _plan(plan_info) -> tuple:
    """``(handle, parts)`` of a plan info (under Dynamo the handle is a constant of the traced plan)."""
    mixed, split, batch, first, second = unpack_plan_info(plan_info)
    # A registered plan carries its handle: a plain attribute read, which Dynamo folds into a
    # constant without tracing the registration.
    handle = getattr(first, _handle_attr(bool(mixed)), None)
    if handle is not None and not torch.compiler.is_compiling():
        entry = _PLANS.get(handle)
        if entry is None or entry[3]() is not first:  # a copy of a registered plan: register it anew
            handle = None
    if handle is None:
        handle = _register(bool(mixed), int(split), int(batch), first, second if mixed else None)
    return handle, ((first, second) if mixed else (first,))


def _runtime(runtime_metadata: Optional[MsaRuntimeMetadata]) -> tuple:
    """The 8 ``rt_*`` tensor arguments of a runtime metadata object (all None without one)."""
    md = runtime_metadata
    if md is None:
        return (None,) * 8
    return (md.qo_lens, md.kv_lens, md.qo_offset, md.cu_seqlens_q, md.cu_seqlens_k, md.seqused_k, md.page_table,
            md.kv_page_indptr)


def _metadata(rt_qo_lens, rt_kv_lens, rt_qo_offset, rt_cu_seqlens_q, rt_cu_seqlens_k, rt_seqused_k,
              rt_page_table, rt_kv_page_indptr) -> Optional[MsaRuntimeMetadata]:
    if rt_qo_lens is None and rt_kv_lens is None and rt_qo_offset is None:
        return None
    return MsaRuntimeMetadata(rt_qo_lens, rt_kv_lens, rt_qo_offset, rt_cu_seqlens_q, rt_cu_seqlens_k, rt_seqused_k,
                              rt_page_table, rt_kv_page_indptr)


def _offset(q_offset_override) -> tuple:
    """``(tensor, int)`` schema arguments of an int or tensor ``q_offset_override``."""
    if q_offset_override is None or isinstance(q_offset_override, Tensor):
        return q_offset_override, None
    return None, int(q_offset_override)


def _none(like: Tensor) -> Tensor:
    """The zero-element tensor an op returns for an output it did not allocate."""
    return like.new_empty((0,))


def _new_max_score(q: Tensor, width: int) -> Tensor:
    return torch.empty((q.shape[0], q.shape[1], width), dtype=torch.float32, device=q.device)


def _out_dtype(q: Tensor) -> torch.dtype:
    return torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype


def _max_score_width(parts: tuple, output_maxscore: bool, max_score) -> int:
    return max(max_k_tiles(p) for p in parts) if output_maxscore and max_score is None else 0


# ----------------------------------------------------------------------------- MSA attention

_MSA_MUTATES = ("out", "lse", "max_score", "workspace")


@_op("msa", mutates_args=_MSA_MUTATES)
def _msa_op(q: Tensor, k: Tensor, v: Tensor, plan: int, kv_indices: Optional[Tensor],
            kv_block_indexes: Optional[Tensor], q_offset_override: Optional[Tensor],
            q_offset_value: Optional[int], out: Optional[Tensor], lse: Optional[Tensor],
            max_score: Optional[Tensor], page_table: Optional[Tensor],
            rt_qo_lens: Optional[Tensor], rt_kv_lens: Optional[Tensor],
            rt_qo_offset: Optional[Tensor], rt_cu_seqlens_q: Optional[Tensor],
            rt_cu_seqlens_k: Optional[Tensor], rt_seqused_k: Optional[Tensor],
            rt_page_table: Optional[Tensor], rt_kv_page_indptr: Optional[Tensor],
            sm_scale: Optional[float], k_scale: float, v_scale: float, output_o: bool,
            output_maxscore: bool, max_score_width: int, check_input_valid: bool,
            workspace: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`mate_cupy.msa`; returns ``(out, max_score)`` as allocated (``max_score
    [total_q, Hq, max_score_width]`` float32 when requested and not given)."""
    ms = _new_max_score(q, max_score_width) if output_maxscore and max_score is None else max_score
    res_o, _ = _msa(q, k, v, _plan_info(plan), kv_indices, kv_block_indexes,
                    q_offset_override if q_offset_value is None else q_offset_value, out, ms, sm_scale=sm_scale,
                    lse=lse, k_scale=k_scale, v_scale=v_scale,
                    runtime_metadata=_metadata(rt_qo_lens, rt_kv_lens, rt_qo_offset, rt_cu_seqlens_q,
                                               rt_cu_seqlens_k, rt_seqused_k, rt_page_table, rt_kv_page_indptr),
                    page_table=page_table, output_o=output_o, output_maxscore=output_maxscore,
                    check_input_valid=check_input_valid, workspace=workspace)
    return (res_o if output_o and out is None else _none(q),
            ms if output_maxscore and max_score is None else _none(q))


@_msa_op.register_fake
def _msa_fake(q, k, v, plan, kv_indices=None, kv_block_indexes=None, q_offset_override=None, q_offset_value=None,
              out=None, lse=None, max_score=None, page_table=None, rt_qo_lens=None, rt_kv_lens=None,
              rt_qo_offset=None, rt_cu_seqlens_q=None, rt_cu_seqlens_k=None, rt_seqused_k=None, rt_page_table=None,
              rt_kv_page_indptr=None, sm_scale=None, k_scale=1.0, v_scale=1.0, output_o=True, output_maxscore=False,
              max_score_width=0, check_input_valid=False, workspace=None):
    return (q.new_empty(q.shape, dtype=_out_dtype(q)) if output_o and out is None else _none(q),
            _new_max_score(q, max_score_width) if output_maxscore and max_score is None else _none(q))


def msa(q: Tensor, k: Tensor, v: Tensor, plan_info, kv_indices: Optional[Tensor] = None,
        kv_block_indexes: Optional[Tensor] = None, q_offset_override=None, out: Optional[Tensor] = None,
        max_score: Optional[Tensor] = None, *, sm_scale: Optional[float] = None, lse: Optional[Tensor] = None,
        k_scale: float = 1.0, v_scale: float = 1.0, runtime_metadata: Optional[MsaRuntimeMetadata] = None,
        page_table: Optional[Tensor] = None, output_o: bool = True, output_maxscore: Optional[bool] = None,
        check_input_valid: bool = False, workspace: Optional[Tensor] = None):
    """:func:`mate_cupy.msa` through ``torch.ops.mate_cupy.msa`` (arguments and results as there;
    arrays are torch tensors, ``q_offset_override`` an int or a tensor, ``workspace`` a tensor)."""
    handle, parts = _plan(plan_info)
    maxscore = (parts[0].output_maxscore if output_maxscore is None else bool(output_maxscore)) or max_score is not None
    off_t, off_i = _offset(q_offset_override)
    res_o, res_ms = torch.ops.mate_cupy.msa(
        q, k, v, handle, kv_indices, kv_block_indexes, off_t, off_i, out, lse, max_score, page_table,
        *_runtime(runtime_metadata), sm_scale, k_scale, v_scale, output_o, maxscore,
        _max_score_width(parts, maxscore, max_score), check_input_valid, workspace)
    return ((out if out is not None else res_o) if output_o else None,
            (max_score if max_score is not None else res_ms) if maxscore else None)


@_op("sparse_msa", mutates_args=_MSA_MUTATES)
def _sparse_msa_op(q: Tensor, k: Tensor, v: Tensor, plan: int, kv_indices: Optional[Tensor],
                   kv_block_indexes: Optional[Tensor], q_offset_override: Optional[Tensor],
                   q_offset_value: Optional[int], out: Optional[Tensor], lse: Optional[Tensor],
                   max_score: Optional[Tensor], rt_qo_lens: Optional[Tensor],
                   rt_kv_lens: Optional[Tensor], rt_qo_offset: Optional[Tensor],
                   rt_cu_seqlens_q: Optional[Tensor], rt_cu_seqlens_k: Optional[Tensor],
                   rt_seqused_k: Optional[Tensor], rt_page_table: Optional[Tensor],
                   rt_kv_page_indptr: Optional[Tensor], sm_scale: Optional[float],
                   k_scale: float, v_scale: float, output_o: bool, output_maxscore: bool,
                   max_score_width: int, check_input_valid: bool,
                   workspace: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`mate_cupy.sparse_msa`; returns ``(out, max_score)`` as allocated."""
    ms = _new_max_score(q, max_score_width) if output_maxscore and max_score is None else max_score
    res_o, _ = _sparse_msa(
        q, k, v, _plan_info(plan), out=out, lse=lse, max_score=ms, sm_scale=sm_scale, k_scale=k_scale,
        v_scale=v_scale, runtime_metadata=_metadata(rt_qo_lens, rt_kv_lens, rt_qo_offset, rt_cu_seqlens_q,
                                                    rt_cu_seqlens_k, rt_seqused_k, rt_page_table, rt_kv_page_indptr),
        kv_indices=kv_indices, output_maxscore=output_maxscore, output_o=output_o, kv_block_indexes=kv_block_indexes,
        q_offset_override=q_offset_override if q_offset_value is None else q_offset_value,
        check_input_valid=check_input_valid, workspace=workspace)
    return (res_o if output_o and out is None else _none(q),
            ms if output_maxscore and max_score is None else _none(q))


@_sparse_msa_op.register_fake
def _sparse_msa_fake(q, k, v, plan, kv_indices=None, kv_block_indexes=None, q_offset_override=None,
                     q_offset_value=None, out=None, lse=None, max_score=None, rt_qo_lens=None, rt_kv_lens=None,
                     rt_qo_offset=None, rt_cu_seqlens_q=None, rt_cu_seqlens_k=None, rt_seqused_k=None,
                     rt_page_table=None, rt_kv_page_indptr=None, sm_scale=None, k_scale=1.0, v_scale=1.0,
                     output_o=True, output_maxscore=False, max_score_width=0, check_input_valid=False,
                     workspace=None):
    return (q.new_empty(q.shape, dtype=_out_dtype(q)) if output_o and out is None else _none(q),
            _new_max_score(q, max_score_width) if output_maxscore and max_score is None else _none(q))


def sparse_msa(q: Tensor, k: Tensor, v: Tensor, plan_info, *, out: Optional[Tensor] = None,
               lse: Optional[Tensor] = None, max_score: Optional[Tensor] = None, sm_scale: Optional[float] = None,
               k_scale: float = 1.0, v_scale: float = 1.0, runtime_metadata: Optional[MsaRuntimeMetadata] = None,
               kv_indices: Optional[Tensor] = None, output_maxscore: bool = False, output_o: bool = True,
               kv_block_indexes: Optional[Tensor] = None, q_offset_override=None, check_input_valid: bool = False,
               workspace: Optional[Tensor] = None):
    """:func:`mate_cupy.sparse_msa` through ``torch.ops.mate_cupy.sparse_msa``; returns ``(out, max_score)``."""
    handle, parts = _plan(plan_info)
    maxscore = bool(output_maxscore) or max_score is not None
    off_t, off_i = _offset(q_offset_override)
    res_o, res_ms = torch.ops.mate_cupy.sparse_msa(
        q, k, v, handle, kv_indices, kv_block_indexes, off_t, off_i, out, lse, max_score,
        *_runtime(runtime_metadata), sm_scale, k_scale, v_scale, output_o, maxscore,
        _max_score_width(parts, maxscore, max_score), check_input_valid, workspace)
    return ((out if out is not None else res_o) if output_o else None,
            (max_score if max_score is not None else res_ms) if maxscore else None)


@_op("sparse_decode_atten_func", mutates_args=_MSA_MUTATES)
def _sparse_decode_op(q: Tensor, k: Tensor, v: Tensor, plan: int, kv_indices: Optional[Tensor],
                      kv_block_indexes: Optional[Tensor], q_offset_override: Optional[Tensor],
                      q_offset_value: Optional[int], out: Optional[Tensor],
                      lse: Optional[Tensor], max_score: Optional[Tensor],
                      page_table: Optional[Tensor], rt_qo_lens: Optional[Tensor],
                      rt_kv_lens: Optional[Tensor], rt_qo_offset: Optional[Tensor],
                      rt_cu_seqlens_q: Optional[Tensor], rt_cu_seqlens_k: Optional[Tensor],
                      rt_seqused_k: Optional[Tensor], rt_page_table: Optional[Tensor],
                      rt_kv_page_indptr: Optional[Tensor], sm_scale: Optional[float],
                      k_scale: float, v_scale: float, output_o: bool,
                      output_maxscore: bool, max_score_width: int, return_softmax_lse: bool,
                      check_input_valid: bool,
                      workspace: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`mate_cupy.sparse_decode_atten_func`; returns ``(out, lse, max_score)`` as allocated
    (``lse [total_q, Hq]`` float32 when ``return_softmax_lse`` and not given)."""
    ms = _new_max_score(q, max_score_width) if output_maxscore and max_score is None else max_score
    res = _sparse_decode(
        q, k, v, _plan_info(plan), out=out, lse=lse, max_score=ms, sm_scale=sm_scale, k_scale=k_scale,
        v_scale=v_scale, runtime_metadata=_metadata(rt_qo_lens, rt_kv_lens, rt_qo_offset, rt_cu_seqlens_q,
                                                    rt_cu_seqlens_k, rt_seqused_k, rt_page_table, rt_kv_page_indptr),
        kv_indices=kv_indices, page_table=page_table, kv_block_indexes=kv_block_indexes,
        q_offset_override=q_offset_override if q_offset_value is None else q_offset_value,
        output_maxscore=output_maxscore, output_o=output_o, return_softmax_lse=return_softmax_lse,
        check_input_valid=check_input_valid, workspace=workspace)
    res_o = res[0] if isinstance(res, tuple) else res
    return (res_o if output_o and out is None else _none(q),
            res[1] if output_o and return_softmax_lse and lse is None else _none(q),
            ms if output_maxscore and max_score is None else _none(q))


@_sparse_decode_op.register_fake
def _sparse_decode_fake(q, k, v, plan, kv_indices=None, kv_block_indexes=None, q_offset_override=None,
                        q_offset_value=None, out=None, lse=None, max_score=None, page_table=None, rt_qo_lens=None,
                        rt_kv_lens=None, rt_qo_offset=None, rt_cu_seqlens_q=None, rt_cu_seqlens_k=None,
                        rt_seqused_k=None, rt_page_table=None, rt_kv_page_indptr=None, sm_scale=None, k_scale=1.0,
                        v_scale=1.0, output_o=True, output_maxscore=False, max_score_width=0,
                        return_softmax_lse=False, check_input_valid=False, workspace=None):
    new_lse = output_o and return_softmax_lse and lse is None
    return (q.new_empty(q.shape, dtype=_out_dtype(q)) if output_o and out is None else _none(q),
            q.new_empty(q.shape[:2], dtype=torch.float32) if new_lse else _none(q),
            _new_max_score(q, max_score_width) if output_maxscore and max_score is None else _none(q))


def sparse_decode_atten_func(q: Tensor, k: Tensor, v: Tensor, plan_info, *, out: Optional[Tensor] = None,
                             lse: Optional[Tensor] = None, max_score: Optional[Tensor] = None,
                             sm_scale: Optional[float] = None, k_scale: float = 1.0, v_scale: float = 1.0,
                             runtime_metadata: Optional[MsaRuntimeMetadata] = None,
                             kv_indices: Optional[Tensor] = None, page_table: Optional[Tensor] = None,
                             kv_block_indexes: Optional[Tensor] = None, q_offset_override=None,
                             output_maxscore: bool = False, output_o: bool = True, return_softmax_lse: bool = False,
                             check_input_valid: bool = False, workspace: Optional[Tensor] = None):
    """:func:`mate_cupy.sparse_decode_atten_func` through its op; returns what it returns
    (``out``, ``(out, lse)``, with the max score appended when requested)."""
    handle, parts = _plan(plan_info)
    maxscore = bool(output_maxscore) or max_score is not None
    off_t, off_i = _offset(q_offset_override)
    res_o, res_lse, res_ms = torch.ops.mate_cupy.sparse_decode_atten_func(
        q, k, v, handle, kv_indices, kv_block_indexes, off_t, off_i, out, lse, max_score, page_table,
        *_runtime(runtime_metadata), sm_scale, k_scale, v_scale, output_o, maxscore,
        _max_score_width(parts, maxscore, max_score), return_softmax_lse, check_input_valid, workspace)
    o = (out if out is not None else res_o) if output_o else None
    if not return_softmax_lse and not maxscore:
        return o
    result = (o, (lse if lse is not None else res_lse) if output_o else None) if return_softmax_lse else (o,)
    return result + ((max_score if max_score is not None else res_ms),) if maxscore else result


# ----------------------------------------------------------------------------- MSA helpers


# ----------------------------------------------------------------------------- the MSA pipeline

# handle -> weakref to a SparsePipelinePlan (as _PLANS, for pipeline plans).
_PIPELINES: dict = {}
_PIPELINE_ATTR = "_torch_op_handle"


def register_pipeline_plan(plan: SparsePipelinePlan) -> int:
    """The op handle of a pipeline plan: an int, stored on the plan and freed with it (as
    :func:`register_plan`; plans built after this module is imported are registered when
    built)."""
    return _register_pipeline(plan)


@torch.compiler.assume_constant_result
def _register_pipeline(plan) -> int:
    handle = plan.__dict__.get(_PIPELINE_ATTR)
    if handle is not None and handle in _PIPELINES and _PIPELINES[handle]() is plan:
        return handle
    return _new_handle(_PIPELINES, plan, _PIPELINE_ATTR, weakref.ref(plan), "pipeline plans")


add_pipeline_plan_hook(register_pipeline_plan)


def _pipeline_handle(plan) -> int:
    if not isinstance(plan, SparsePipelinePlan):
        raise TypeError(f"plan must be a SparsePipelinePlan (sparse_pipeline_plan), got {type(plan).__name__}")
    handle = getattr(plan, _PIPELINE_ATTR, None)
    if handle is not None and not torch.compiler.is_compiling():
        ref = _PIPELINES.get(handle)
        if ref is None or ref() is not plan:
            handle = None
    return _register_pipeline(plan) if handle is None else handle


@_op("sparse_attention_pipeline", mutates_args=("out", "lse", "workspace"))
def _pipeline_op(q: Tensor, k: Tensor, v: Tensor, index_q: Tensor, index_k: Tensor, plan: int,
                 kv_indices: Optional[Tensor], out: Tensor, lse: Optional[Tensor], rt_qo_lens: Optional[Tensor],
                 rt_kv_lens: Optional[Tensor], rt_qo_offset: Optional[Tensor], rt_cu_seqlens_q: Optional[Tensor],
                 rt_cu_seqlens_k: Optional[Tensor], rt_seqused_k: Optional[Tensor], rt_page_table: Optional[Tensor],
                 rt_kv_page_indptr: Optional[Tensor], sm_scale: Optional[float], k_scale: float, v_scale: float,
                 index_scale: float, workspace: Optional[Tensor]) -> None:
    """:func:`mate_cupy.sparse_attention_pipeline` writing ``out`` (and ``lse``); the plan's own
    buffers (max scores, selection) are the plan's state, not the op's outputs."""
    ref = _PIPELINES.get(plan)
    pipeline = None if ref is None else ref()
    if pipeline is None:
        raise ValueError(f"no live pipeline plan has handle {plan} (see register_pipeline_plan)")
    _pipeline(q, k, v, index_q, index_k, pipeline, kv_indices=kv_indices,
              runtime_metadata=_metadata(rt_qo_lens, rt_kv_lens, rt_qo_offset, rt_cu_seqlens_q, rt_cu_seqlens_k,
                                         rt_seqused_k, rt_page_table, rt_kv_page_indptr),
              out=out, lse=lse, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, index_scale=index_scale,
              workspace=workspace)


@_pipeline_op.register_fake
def _pipeline_fake(q, k, v, index_q, index_k, plan, kv_indices, out, lse, rt_qo_lens, rt_kv_lens, rt_qo_offset,
                   rt_cu_seqlens_q, rt_cu_seqlens_k, rt_seqused_k, rt_page_table, rt_kv_page_indptr, sm_scale,
                   k_scale, v_scale, index_scale, workspace):
    return None


def sparse_attention_pipeline(q: Tensor, k: Tensor, v: Tensor, index_q: Tensor, index_k: Tensor,
                              plan: SparsePipelinePlan, *, kv_indices: Optional[Tensor] = None,
                              runtime_metadata: Optional[MsaRuntimeMetadata] = None, out: Optional[Tensor] = None,
                              lse: Optional[Tensor] = None, sm_scale: Optional[float] = None, k_scale: float = 1.0,
                              v_scale: float = 1.0, index_scale: float = 1.0,
                              workspace: Optional[Tensor] = None) -> Tensor:
    """:func:`mate_cupy.sparse_attention_pipeline` through ``torch.ops.mate_cupy.sparse_attention_pipeline``
    (same arguments and result; ``out`` is allocated here when not given)."""
    if out is None:
        out = q.new_empty(q.shape, dtype=_out_dtype(q))
    torch.ops.mate_cupy.sparse_attention_pipeline(
        q, k, v, index_q, index_k, _pipeline_handle(plan), kv_indices, out, lse, *_runtime(runtime_metadata),
        sm_scale, k_scale, v_scale, index_scale, workspace)
    return out


@_op("sparse_topk_select", mutates_args=())
def _topk_op(max_score: Tensor, topk: int, num_valid_pages: Optional[int], force_begin_blocks: int,
             force_end_blocks: int, force_blocks_count_in_topk: bool, query_positions: Optional[Tensor]) -> Tensor:
    """:func:`mate_cupy.sparse_topk_select` into a new int32 ``[total_q, Hq, W]`` selection."""
    return _topk(max_score, topk, num_valid_pages, None, force_begin_blocks, force_end_blocks,
                 force_blocks_count_in_topk, query_positions)


@_topk_op.register_fake
def _topk_fake(max_score, topk, num_valid_pages, force_begin_blocks, force_end_blocks, force_blocks_count_in_topk,
               query_positions):
    width = selected_block_count(topk, force_begin_blocks, force_end_blocks, force_blocks_count_in_topk)
    return max_score.new_empty((max_score.shape[0], max_score.shape[1], width), dtype=torch.int32)


@_op("sparse_topk_select_out", mutates_args=("output",))
def _topk_out_op(max_score: Tensor, topk: int, num_valid_pages: Optional[int], output: Tensor,
                 force_begin_blocks: int, force_end_blocks: int, force_blocks_count_in_topk: bool,
                 query_positions: Optional[Tensor]) -> None:
    """:func:`mate_cupy.sparse_topk_select` into ``output`` (written in place)."""
    _topk(max_score, topk, num_valid_pages, output, force_begin_blocks, force_end_blocks,
          force_blocks_count_in_topk, query_positions)


@_topk_out_op.register_fake
def _topk_out_fake(max_score, topk, num_valid_pages, output, force_begin_blocks, force_end_blocks,
                   force_blocks_count_in_topk, query_positions):
    return None


def sparse_topk_select(max_score: Tensor, topk: int, num_valid_pages: Optional[int] = None,
                       output: Optional[Tensor] = None, force_begin_blocks: int = 0, force_end_blocks: int = 0,
                       force_blocks_count_in_topk: bool = True, query_positions: Optional[Tensor] = None) -> Tensor:
    """:func:`mate_cupy.sparse_topk_select` through its ops (same arguments and result):
    ``sparse_topk_select`` allocates, ``sparse_topk_select_out`` writes ``output``."""
    if output is None:
        return torch.ops.mate_cupy.sparse_topk_select(max_score, topk, num_valid_pages, force_begin_blocks,
                                                      force_end_blocks, force_blocks_count_in_topk, query_positions)
    torch.ops.mate_cupy.sparse_topk_select_out(max_score, topk, num_valid_pages, output, force_begin_blocks,
                                               force_end_blocks, force_blocks_count_in_topk, query_positions)
    return output


@_op("build_page_table_from_flat_kv_indices", mutates_args=())
def _page_table_op(kv_indices: Tensor, kv_lens: Tensor, page_size: int) -> Tensor:
    """:func:`mate_cupy.build_page_table_from_flat_kv_indices` (reads ``kv_lens`` on the host:
    not for CUDA-graph capture)."""
    return _page_table(kv_indices, kv_lens, page_size)


@_page_table_op.register_fake
def _page_table_fake(kv_indices, kv_lens, page_size):
    max_pages = torch.library.get_ctx().new_dynamic_size()
    return kv_indices.new_empty((kv_lens.shape[0], max_pages), dtype=torch.int32)


def build_page_table_from_flat_kv_indices(kv_indices: Tensor, kv_lens: Tensor, page_size: int) -> Tensor:
    """:func:`mate_cupy.build_page_table_from_flat_kv_indices` through its op (tensors only);
    the result's width is data-dependent (an unbacked size under ``torch.compile``)."""
    return torch.ops.mate_cupy.build_page_table_from_flat_kv_indices(kv_indices, kv_lens, page_size)


# ----------------------------------------------------------------------------- cast


@_op("cast", mutates_args=())
def _cast_op(x: Tensor, dtype: torch.dtype, scale: float) -> Tensor:
    """:func:`mate_cupy.cast` into a new tensor of ``dtype``."""
    return _cast(x, dtype, scale, None)


@_cast_op.register_fake
def _cast_fake(x, dtype, scale):
    return x.new_empty(x.shape, dtype=dtype)


@_op("cast_out", mutates_args=("out",))
def _cast_out_op(x: Tensor, dtype: torch.dtype, scale: float, out: Tensor) -> None:
    """:func:`mate_cupy.cast` into ``out`` (written in place)."""
    _cast(x, dtype, scale, out)


@_cast_out_op.register_fake
def _cast_out_fake(x, dtype, scale, out):
    return None


def cast(x: Tensor, dtype: torch.dtype, scale: float = 1.0, out: Optional[Tensor] = None) -> Tensor:
    """:func:`mate_cupy.cast` through its ops (``dtype`` a torch dtype): ``cast`` allocates,
    ``cast_out`` writes ``out``."""
    if out is None:
        return torch.ops.mate_cupy.cast(x, dtype, scale)
    torch.ops.mate_cupy.cast_out(x, dtype, scale, out)
    return out


# ----------------------------------------------------------------------------- KDA


@_op("chunk_kda", mutates_args=("output", "final_state", "workspace"))
def _chunk_kda_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                  initial_state: Optional[Tensor], output_final_state: bool,
                  cu_seqlens: Optional[Tensor], A_log: Optional[Tensor],  # noqa: N803
                  dt_bias: Optional[Tensor], lower_bound: float, use_qk_l2norm_in_kernel: bool,
                  output: Optional[Tensor], final_state: Optional[Tensor],
                  workspace: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`mate_cupy.chunk_kda`; returns ``(output, final_state)`` as allocated."""
    res = _chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, A_log, dt_bias,
                     lower_bound, use_qk_l2norm_in_kernel, output, final_state, workspace)
    o, fs = res if output_final_state else (res, None)
    return (o if output is None else _none(q),
            fs if output_final_state and final_state is None else _none(q))


@_chunk_kda_op.register_fake
def _chunk_kda_fake(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                    A_log=None, dt_bias=None, lower_bound=-5.0, use_qk_l2norm_in_kernel=True,  # noqa: N803
                    output=None, final_state=None, workspace=None):
    if output is not None:
        o = _none(q)
    elif q.dim() == 3:
        o = q.new_empty(v.shape[-3:])
    else:
        o = q.new_empty(v.shape if v.dim() == 4 else (1,) + tuple(v.shape))
    if not output_final_state or final_state is not None:
        return o, _none(q)
    n = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]
    dtype = initial_state.dtype if initial_state is not None else q.dtype
    return o, q.new_empty((n, v.shape[-2], v.shape[-1], q.shape[-1]), dtype=dtype)


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float] = None,
              initial_state: Optional[Tensor] = None, output_final_state: bool = False,
              cu_seqlens: Optional[Tensor] = None, A_log: Optional[Tensor] = None,  # noqa: N803
              dt_bias: Optional[Tensor] = None, lower_bound: float = -5.0, use_qk_l2norm_in_kernel: bool = True,
              output: Optional[Tensor] = None, final_state: Optional[Tensor] = None,
              workspace: Optional[Tensor] = None):
    """:func:`mate_cupy.chunk_kda` through ``torch.ops.mate_cupy.chunk_kda`` (same arguments and
    results; ``workspace`` a tensor)."""
    o, fs = torch.ops.mate_cupy.chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                          A_log, dt_bias, lower_bound, use_qk_l2norm_in_kernel, output,
                                          final_state, workspace)
    o = output if output is not None else o
    if not output_final_state:
        return o
    return o, (final_state if final_state is not None else fs)


def _decode_fake_output(q, v, output):
    if output is not None:
        return _none(q)
    return q.new_empty(tuple(v.shape))


@_op("gated_delta_rule_decode", mutates_args=("output",))
def _decode_op(q: Tensor, k: Tensor, v: Tensor, state: Optional[Tensor], A_log: Optional[Tensor],  # noqa: N803
               a: Tensor, dt_bias: Optional[Tensor], num_accepted_tokens: Optional[Tensor],
               cu_seqlens: Optional[Tensor], b: Tensor, state_indices: Optional[Tensor],
               scale: Optional[float], output: Optional[Tensor], use_qk_l2norm: Optional[bool],
               lower_bound: Optional[float], use_gate_in_kernel: Optional[bool],
               use_lower_bound: Optional[bool], apply_beta_sigmoid: Optional[bool],
               allow_neg_eigval: Optional[bool], use_initial_state: Optional[bool],
               state_v_first: Optional[bool], is_varlen: Optional[bool],
               store_final_state: bool, state_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    """:func:`mate_cupy.gated_delta_rule_decode` with ``inplace_final_state=False`` (``state`` is
    only read); returns ``(output, final_state)`` as allocated."""
    o, fs = _decode(q, k, v, state, A_log, a, dt_bias, num_accepted_tokens, cu_seqlens, b, state_indices, scale,
                    output, use_qk_l2norm, lower_bound, use_gate_in_kernel, use_lower_bound, apply_beta_sigmoid,
                    allow_neg_eigval, use_initial_state, state_v_first, is_varlen, store_final_state, False,
                    state_dtype)
    return (o if output is None else _none(q)), (fs if store_final_state else _none(q))


@_decode_op.register_fake
def _decode_fake(q, k, v, state, A_log, a, dt_bias, num_accepted_tokens, cu_seqlens, b,  # noqa: N803
                 state_indices=None, scale=None, output=None, use_qk_l2norm=None, lower_bound=None,
                 use_gate_in_kernel=None, use_lower_bound=None, apply_beta_sigmoid=None, allow_neg_eigval=None,
                 use_initial_state=None, state_v_first=None, is_varlen=None, store_final_state=False,
                 state_dtype=None):
    o = _decode_fake_output(q, v, output)
    if not store_final_state:
        return o, _none(q)
    varlen = cu_seqlens is not None if is_varlen is None else is_varlen
    n = cu_seqlens.shape[0] - 1 if varlen else q.shape[0]
    kd, vd = q.shape[-1], v.shape[-1]
    tail = (vd, kd) if state_v_first is None or state_v_first else (kd, vd)
    dtype = state_dtype if state_dtype is not None else state.dtype if state is not None else torch.float32
    return o, q.new_empty((n, v.shape[2]) + tail, dtype=dtype)


@_op("gated_delta_rule_decode_inplace", mutates_args=("state", "output"))
def _decode_inplace_op(q: Tensor, k: Tensor, v: Tensor, state: Tensor, A_log: Optional[Tensor],  # noqa: N803
                       a: Tensor, dt_bias: Optional[Tensor], num_accepted_tokens: Optional[Tensor],
                       cu_seqlens: Optional[Tensor], b: Tensor, state_indices: Optional[Tensor],
                       scale: Optional[float], output: Optional[Tensor],
                       use_qk_l2norm: Optional[bool], lower_bound: Optional[float],
                       use_gate_in_kernel: Optional[bool], use_lower_bound: Optional[bool],
                       apply_beta_sigmoid: Optional[bool], allow_neg_eigval: Optional[bool],
                       use_initial_state: Optional[bool], state_v_first: Optional[bool],
                       is_varlen: Optional[bool], store_final_state: bool,
                       state_dtype: Optional[torch.dtype]) -> Tensor:
    """:func:`mate_cupy.gated_delta_rule_decode` with ``inplace_final_state=True``: writes the
    ``state`` pool; returns the output it allocated."""
    o, _ = _decode(q, k, v, state, A_log, a, dt_bias, num_accepted_tokens, cu_seqlens, b, state_indices, scale,
                   output, use_qk_l2norm, lower_bound, use_gate_in_kernel, use_lower_bound, apply_beta_sigmoid,
                   allow_neg_eigval, use_initial_state, state_v_first, is_varlen, store_final_state, True,
                   state_dtype)
    return o if output is None else _none(q)


@_decode_inplace_op.register_fake
def _decode_inplace_fake(q, k, v, state, A_log, a, dt_bias, num_accepted_tokens, cu_seqlens, b,  # noqa: N803
                         state_indices=None, scale=None, output=None, use_qk_l2norm=None, lower_bound=None,
                         use_gate_in_kernel=None, use_lower_bound=None, apply_beta_sigmoid=None,
                         allow_neg_eigval=None, use_initial_state=None, state_v_first=None, is_varlen=None,
                         store_final_state=False, state_dtype=None):
    return _decode_fake_output(q, v, output)


def gated_delta_rule_decode(q: Tensor, k: Tensor, v: Tensor, state: Optional[Tensor], A_log: Optional[Tensor],  # noqa: N803
                            a: Tensor, dt_bias: Optional[Tensor], num_accepted_tokens: Optional[Tensor],
                            cu_seqlens: Optional[Tensor], b: Tensor, state_indices: Optional[Tensor] = None,
                            scale: Optional[float] = None, output: Optional[Tensor] = None,
                            use_qk_l2norm: Optional[bool] = None, lower_bound: Optional[float] = None,
                            use_gate_in_kernel: Optional[bool] = None, use_lower_bound: Optional[bool] = None,
                            apply_beta_sigmoid: Optional[bool] = None, allow_neg_eigval: Optional[bool] = None,
                            use_initial_state: Optional[bool] = None, state_v_first: Optional[bool] = None,
                            is_varlen: Optional[bool] = None, store_final_state: bool = False,
                            inplace_final_state: bool = False, state_dtype: Optional[torch.dtype] = None):
    """:func:`mate_cupy.gated_delta_rule_decode` through ``torch.ops.mate_cupy.gated_delta_rule_decode``
    (``..._inplace`` when ``inplace_final_state``, which writes ``state``); returns
    ``(output, final_state)`` as the public function does (the pool itself when in place)."""
    if inplace_final_state:
        o = torch.ops.mate_cupy.gated_delta_rule_decode_inplace(
            q, k, v, state, A_log, a, dt_bias, num_accepted_tokens, cu_seqlens, b, state_indices, scale, output,
            use_qk_l2norm, lower_bound, use_gate_in_kernel, use_lower_bound, apply_beta_sigmoid, allow_neg_eigval,
            use_initial_state, state_v_first, is_varlen, store_final_state, state_dtype)
        return (output if output is not None else o), state
    o, fs = torch.ops.mate_cupy.gated_delta_rule_decode(
        q, k, v, state, A_log, a, dt_bias, num_accepted_tokens, cu_seqlens, b, state_indices, scale, output,
        use_qk_l2norm, lower_bound, use_gate_in_kernel, use_lower_bound, apply_beta_sigmoid, allow_neg_eigval,
        use_initial_state, state_v_first, is_varlen, store_final_state, state_dtype)
    return (output if output is not None else o), (fs if store_final_state else None)
