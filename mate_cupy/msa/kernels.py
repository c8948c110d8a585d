"""Lazy access to the MSA CUDA launchers (``attention_kernels``, ``index_kernels``).

The launchers are imported only on the CUDA path. A launcher that does not exist yet
raises ``NotImplementedError`` naming it, before anything is launched: CUDA inputs are
never copied to the host to run a reference instead.
"""
from __future__ import annotations

import importlib

__all__ = ["attention_launcher", "max_score_launcher", "topk_launcher"]


def _launcher(module: str, func: str, what: str):
    full = f"mate_cupy.msa.{module}"
    try:
        mod = importlib.import_module(full)
    except ModuleNotFoundError as exc:
        if exc.name != full:
            raise
        mod = None
    fn = getattr(mod, func, None) if mod is not None else None
    if fn is None:
        raise NotImplementedError(
            f"{what} on CUDA needs the kernel launcher {full}.{func}, which is not available in this build"
        )
    return fn


def attention_launcher():
    """``run_attention`` (dense, paged and block-sparse forward)."""
    return _launcher("attention_kernels", "run_attention", "MSA attention")


def max_score_launcher():
    """``run_max_score`` (per-128-key-block max score)."""
    return _launcher("index_kernels", "run_max_score", "MSA block max score")


def topk_launcher():
    """``run_topk_select`` (top-k block selection)."""
    return _launcher("index_kernels", "run_topk_select", "sparse_topk_select")
