"""Segment transitions of the KDA state and their combine (intra-sequence parallelism).

A stretch of tokens (a *segment*) of one sequence maps the state entering it to the state
leaving it by an affine map of the ``[V, K]`` state (docs/kda_chunk.md, "Intra-sequence
parallelism")::

    S_out = S_in @ M + C          M [K, K], C [V, K]  (per value head)

``M`` and ``C`` depend only on the segment's own tokens, so segments are computed
independently (on one GPU or across GPUs); the *combine* then walks the segments in order
from the sequence's initial state. These two functions are the whole contract between the
segment producers and the combine; the float64 reference is
:func:`mate_cupy.reference.kda.kda_segment_combine`, the segmented algorithm end to end
:func:`mate_cupy.reference.kda.kda_segmented`.
"""
from __future__ import annotations

import numpy as np

from ..reference.kda import kda_segment_combine
from ..runtime.interop import framework_of

__all__ = ["compose_transitions", "combine_segments"]


def _library(x):
    """The array library of ``x`` (numpy, cupy or torch) for stacking and zeros."""
    fw = framework_of(x)
    if fw == "numpy":
        return np
    if fw == "cupy":
        import cupy

        return cupy
    if fw == "torch":
        import torch

        return torch
    raise TypeError(f"expected a NumPy, CuPy or torch array, got {type(x).__name__}")


def compose_transitions(first, second):
    """The map of segment ``first`` followed by segment ``second``, each ``(M, C)``:
    ``(M1 @ M2, C1 @ M2 + C2)``. Associative, so any grouping (a tree over GPUs, a scan)
    gives the same map up to rounding."""
    (M1, C1), (M2, C2) = first, second
    return M1 @ M2, C1 @ M2 + C2


def combine_segments(M, C, initial_state=None):
    """Entry states of consecutive segments: ``out[0] = initial_state`` (zeros when None),
    ``out[s + 1] = out[s] @ M[s] + C[s]``; ``out[nseg]`` is the final state.

    ``M [nseg, ..., K, K]``, ``C [nseg, ..., V, K]``, ``initial_state [..., V, K]`` (``...``:
    batch axes such as heads, the same for all three). NumPy inputs run the float64
    reference; CuPy and torch arrays are combined on their device in their dtype (one
    batched matrix product per segment). Returns ``[nseg + 1, ..., V, K]``.
    """
    if isinstance(M, np.ndarray) and isinstance(C, np.ndarray) and (
            initial_state is None or isinstance(initial_state, np.ndarray)):
        return kda_segment_combine(M, C, initial_state)
    lib = _library(C)
    if M.ndim < 3 or C.ndim != M.ndim or M.shape[0] != C.shape[0] or tuple(M.shape[1:-2]) != tuple(C.shape[1:-2]) \
            or M.shape[-1] != M.shape[-2] or C.shape[-1] != M.shape[-1]:
        raise ValueError(f"M must be [nseg, ..., K, K] and C [nseg, ..., V, K] with equal nseg and batch axes, "
                         f"got M {tuple(M.shape)}, C {tuple(C.shape)}")
    if initial_state is None:  # zeros of C's dtype and device (an empty sum when there is no segment)
        S = lib.zeros_like(C[0]) if M.shape[0] else C.sum(0)
    else:
        S = initial_state
    if tuple(S.shape) != tuple(C.shape[1:]):
        raise ValueError(f"initial_state must have shape {tuple(C.shape[1:])}, got {tuple(S.shape)}")
    out = [S]
    for s in range(M.shape[0]):
        S = S @ M[s] + C[s]
        out.append(S)
    return lib.stack(out)
