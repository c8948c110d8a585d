"""Public MSA (MiniMax Sparse Attention) API.

Plans (:mod:`mate_cupy.msa.plan`), attention ops (:mod:`mate_cupy.msa.ops`), top-k block
selection (:mod:`mate_cupy.msa.topk`), the page-table builder
(:mod:`mate_cupy.msa.page_table`) and :class:`Workspace` (caller-owned scratch memory).
Every function takes any DLPack array: CUDA arrays run the kernels, NumPy arrays the
float64 references (:mod:`mate_cupy.reference.msa`), refused for the same conditions.
"""
from .msa.ops import msa, sparse_decode_atten_func, sparse_msa, sparse_msa_plan
from .msa.page_table import build_page_table_from_flat_kv_indices
from .msa.pipeline import (
    SparsePipelinePlan,
    sparse_attention_pipeline,
    sparse_pipeline_plan,
    sparse_pipeline_static_plan,
)
from .msa.plan import (
    MsaDecodePlan,
    MsaPlan,
    MsaPlanInfo,
    MsaPrefillPlan,
    MsaRuntimeMetadata,
    msa_plan,
    msa_plan_from_lengths,
    upload_plan,
)
from .msa.topk import plan_query_positions, sparse_topk_select
from .runtime.workspace import Workspace

# The eager planner under the underscored name some callers import.
_msa_plan_from_lengths = msa_plan_from_lengths

__all__ = [
    "MsaDecodePlan",
    "MsaPlan",
    "MsaPlanInfo",
    "MsaPrefillPlan",
    "MsaRuntimeMetadata",
    "SparsePipelinePlan",
    "Workspace",
    "build_page_table_from_flat_kv_indices",
    "msa",
    "msa_plan",
    "msa_plan_from_lengths",
    "plan_query_positions",
    "sparse_attention_pipeline",
    "sparse_decode_atten_func",
    "sparse_msa",
    "sparse_msa_plan",
    "sparse_pipeline_plan",
    "sparse_pipeline_static_plan",
    "sparse_topk_select",
    "upload_plan",
]
