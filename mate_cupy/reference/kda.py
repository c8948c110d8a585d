"""Float64 NumPy references for KDA (Kimi Delta Attention).

Three functions, all float64, all on host arrays (any DLPack array is read to the host):

* :func:`kda_recurrent`: the definition (docs/semantics.md, section 7), token by token.
* :func:`kda_chunked`: the same result in chunked WY/UT form (chunk 64), written as the
  blueprint of the CUDA chunk kernel; agrees with :func:`kda_recurrent` to rounding.
* :func:`kda_decode`: the serving step of ``gated_delta_rule_decode`` (docs/semantics.md, section 8)
  with state pools, slot indices, padding, speculative decoding and bf16 state rounding.

Layouts. ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, gate ``g``/``a`` ``[B, T, HV, K]``,
``beta [B, T, HV]`` (decode also ``[B, T, HV, V]``). Varlen: ``cu_seqlens [N+1]`` with
inputs ``[1, S, ...]`` or ``[S, ...]``. Value head ``hv`` reads q/k head ``hv // (HV // H)``.
States are ``[N, HV, V, K]`` ("V-first": ``S @ k`` is a matrix-vector product over K);
the decode pool may be K-first ``[P, HV, K, V]``.

Per token (state ``S [V, K]`` of one value head)::

    S = S * exp(gk)[None, :]
    S = S + b * (v - S @ k)[:, None] * k[None, :]
    o = (S @ q) * scale
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import ml_dtypes
import numpy as np

from ..runtime.interop import to_host

__all__ = [
    "kda_recurrent",
    "kda_chunked",
    "kda_decode",
    "kda_segmented",
    "kda_segment_combine",
    "kda_chunk_gate",
    "kda_decode_gate",
    "kda_decode_beta",
    "l2norm",
    "sigmoid",
    "softplus",
    "sequence_bounds",
    "round_bf16",
]

L2NORM_EPS = 1e-6
CHUNK_SIZE = 64


# ----------------------------------------------------------------------------- helpers


def _f64(x, name: str = "array") -> Optional[np.ndarray]:
    if x is None:
        return None
    return np.asarray(to_host(x, name)).astype(np.float64)


def _int_host(x, name: str) -> Optional[np.ndarray]:
    if x is None:
        return None
    a = np.asarray(to_host(x, name))
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype}")
    return a.astype(np.int64)


def l2norm(x: np.ndarray, eps: float = L2NORM_EPS) -> np.ndarray:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Overflow-free logistic function."""
    return np.exp(-np.logaddexp(0.0, -x))


def softplus(x: np.ndarray) -> np.ndarray:
    """Overflow-free ``log(1 + exp(x))``."""
    return np.logaddexp(0.0, x)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (nearest even) and widen back to float64."""
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def sequence_bounds(cu_seqlens, total: int, name: str = "cu_seqlens") -> List[Tuple[int, int]]:
    """Validate ``cu_seqlens`` against ``total`` packed tokens; return ``[(bos, eos)]``.

    Requires a 1-D integer array with ``cu[0] == 0``, non-decreasing entries and
    ``cu[-1] == total`` (``ValueError`` otherwise).
    """
    cu = _int_host(cu_seqlens, name)
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must be a 1-D array [N+1] with N >= 0, got shape {tuple(cu.shape)}")
    if cu[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(cu[0])}")
    if np.any(np.diff(cu) < 0):
        raise ValueError(f"{name} must be non-decreasing, got {cu.tolist()}")
    if cu[-1] != total:
        raise ValueError(
            f"{name}[-1] must equal the number of packed tokens ({total}), got {int(cu[-1])}"
        )
    return [(int(cu[i]), int(cu[i + 1])) for i in range(cu.shape[0] - 1)]


def _batched(x: Optional[np.ndarray], varlen: bool, tail: int) -> Optional[np.ndarray]:
    """Give a packed varlen array (``tail`` trailing dims after the token axis) a batch axis."""
    if x is None:
        return None
    if varlen and x.ndim == tail + 1:
        return x[None]
    return x


def _sequences(B: int, T: int, cu_seqlens) -> List[Tuple[int, int, int]]:
    """``[(batch row, bos, eos)]`` of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    if B != 1:
        raise ValueError(f"varlen inputs must have a batch dimension of 1, got {B}")
    return [(0, bos, eos) for bos, eos in sequence_bounds(cu_seqlens, T)]


def _expand_heads(x: np.ndarray, HV: int) -> np.ndarray:
    """``[..., H, D] -> [..., HV, D]``: value head ``hv`` reads head ``hv // (HV // H)``."""
    H = x.shape[-2]
    if HV % H:
        raise ValueError(f"the number of value heads ({HV}) must be a multiple of q/k heads ({H})")
    return np.repeat(x, HV // H, axis=-2)


def kda_chunk_gate(g: np.ndarray, A_log=None, dt_bias=None, lower_bound: float = -5.0) -> np.ndarray:
    """Per-channel log decay of ``chunk_kda`` (docs/semantics.md, section 7), ``g [..., HV, K]``.

    With ``A_log [HV]`` and ``dt_bias [HV, K]`` (or ``[HV*K]``):
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``; without them ``g`` itself.
    """
    g = _f64(g, "g")
    if A_log is None and dt_bias is None:
        return g
    if A_log is None or dt_bias is None:
        raise ValueError("A_log and dt_bias must be provided together")
    HV, K = g.shape[-2], g.shape[-1]
    A = _f64(A_log, "A_log").reshape(HV)
    bias = _f64(dt_bias, "dt_bias").reshape(HV, K)
    return float(lower_bound) * sigmoid(np.exp(A)[:, None] * (g + bias))


def kda_decode_gate(a: np.ndarray, A_log=None, dt_bias=None, *, use_gate_in_kernel: bool = True,
                    use_lower_bound: bool = False, lower_bound: float = -5.0) -> np.ndarray:
    """Per-channel log decay of ``gated_delta_rule_decode`` (docs/semantics.md, section 8), ``a [..., HV, K]``.

    ``x = a + dt_bias`` (no bias when None), ``A = A_log[hv]`` (0 when None);
    ``lower_bound * sigmoid(exp(A) * x)`` with ``use_lower_bound``, else
    ``-exp(A) * softplus(x)``; ``a`` itself when ``use_gate_in_kernel`` is False.
    """
    a = _f64(a, "a")
    if not use_gate_in_kernel:
        return a
    HV, K = a.shape[-2], a.shape[-1]
    x = a if dt_bias is None else a + _f64(dt_bias, "dt_bias").reshape(HV, K)
    A = np.zeros(HV) if A_log is None else _f64(A_log, "A_log").reshape(HV)
    eA = np.exp(A)[:, None]
    if use_lower_bound:
        return float(lower_bound) * sigmoid(eA * x)
    return -eA * softplus(x)


def kda_decode_beta(b: np.ndarray, *, apply_beta_sigmoid: bool = False, allow_neg_eigval: bool = False) -> np.ndarray:
    """Update strength of the decode step: ``b``, ``sigmoid(b)`` if asked, then doubled if asked."""
    b = _f64(b, "b")
    if apply_beta_sigmoid:
        b = sigmoid(b)
    if allow_neg_eigval:
        b = 2.0 * b
    return b


def _delta_step(S, q, k, v, gk, beta, scale):
    """One token for all heads (and any leading batch axes). ``S [..., HV, V, K]``,
    ``q, k, gk [..., HV, K]``, ``v [..., HV, V]``, ``beta [..., HV, 1]`` or ``[..., HV, V]``.
    Updates ``S`` in place (callers pass a state they own) and returns ``(S, o [..., HV, V])``."""
    S *= np.exp(gk)[..., None, :]
    S += (beta * (v - (S @ k[..., None])[..., 0]))[..., :, None] * k[..., None, :]
    return S, (S @ q[..., None])[..., 0] * scale


class _ChunkInputs:
    """Normalised ``chunk_kda``-style inputs: batched 4-D, float64, heads expanded."""

    def __init__(self, q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias,
                 lower_bound, use_qk_l2norm, beta_sigmoid=True):
        varlen = cu_seqlens is not None
        v64 = _f64(v, "v")
        self.out_shape = v64.shape
        beta = _f64(beta, "beta")
        per_channel = beta.ndim == v64.ndim  # [.., HV, V] per value channel, else [.., HV]
        q = _batched(_f64(q, "q"), varlen, 2)
        k = _batched(_f64(k, "k"), varlen, 2)
        v64 = _batched(v64, varlen, 2)
        g = _batched(_f64(g, "g"), varlen, 2)
        beta = _batched(beta, varlen, 2 if per_channel else 1)
        B, T, HV, V = v64.shape
        K = q.shape[-1]
        if (q.shape[:2] != (B, T) or k.shape != q.shape or g.shape != (B, T, HV, K)
                or beta.shape != ((B, T, HV, V) if per_channel else (B, T, HV))):
            raise ValueError(
                f"inconsistent shapes: q {q.shape}, k {k.shape}, v {v64.shape}, g {g.shape}, beta {beta.shape}"
            )
        if use_qk_l2norm:
            q, k = l2norm(q), l2norm(k)
        self.q = _expand_heads(q, HV)
        self.k = _expand_heads(k, HV)
        self.v = v64
        self.gk = kda_chunk_gate(g, A_log, dt_bias, lower_bound)
        self.beta = sigmoid(beta) if beta_sigmoid else beta
        self.per_channel_beta = beta.ndim == 4
        if not self.per_channel_beta:
            self.beta = self.beta[..., None]  # [B, T, HV, 1]
        self.scale = K ** -0.5 if scale is None else float(scale)
        self.seqs = _sequences(B, T, cu_seqlens)
        N = len(self.seqs)
        if initial_state is None:
            self.S0 = np.zeros((N, HV, V, K))
        else:
            self.S0 = _f64(initial_state, "initial_state")
            if self.S0.shape != (N, HV, V, K):
                raise ValueError(f"initial_state must have shape {(N, HV, V, K)} ([N, HV, V, K]), got {self.S0.shape}")
        self.B, self.T, self.HV, self.V, self.K = B, T, HV, V, K


# ----------------------------------------------------------------------------- chunk_kda


def kda_recurrent(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, A_log=None,
                  dt_bias=None, lower_bound: float = -5.0, use_qk_l2norm: bool = True, *,
                  beta_sigmoid: bool = True):
    """Token-by-token float64 reference of ``chunk_kda`` (the definition, docs/semantics.md section 7).

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]`` (raw gate input when
    ``A_log``/``dt_bias`` are given, else the log-space decay); beta ``[B, T, HV]`` logits.
    Varlen: ``cu_seqlens [N+1]`` and ``[1, S, ...]`` or ``[S, ...]`` inputs.
    initial_state ``[N, HV, V, K]`` (any float dtype, widened) or None (zeros).
    Extensions (not in ``chunk_kda``): ``beta_sigmoid=False`` takes ``beta`` as the update
    strength itself, and ``beta [B, T, HV, V]`` gives one strength per value channel.
    Returns ``(o, final_state)``: o float64 shaped like ``v``, final_state float64 ``[N, HV, V, K]``.
    """
    x = _ChunkInputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias,
                     lower_bound, use_qk_l2norm, beta_sigmoid)
    o = np.zeros((x.B, x.T, x.HV, x.V))
    if cu_seqlens is None:  # equal lengths: all sequences advance together
        S = x.S0.copy()
        for t in range(x.T):
            S, o[:, t] = _delta_step(S, x.q[:, t], x.k[:, t], x.v[:, t], x.gk[:, t], x.beta[:, t], x.scale)
        return o.reshape(x.out_shape), S
    final = np.empty_like(x.S0)
    for n, (b, bos, eos) in enumerate(x.seqs):
        S = x.S0[n].copy()
        for t in range(bos, eos):
            S, o[b, t] = _delta_step(S, x.q[b, t], x.k[b, t], x.v[b, t], x.gk[b, t], x.beta[b, t], x.scale)
        final[n] = S
    return o.reshape(x.out_shape), final


def _unit_lower_inverse(A: np.ndarray) -> np.ndarray:
    """``(I + A)^-1`` for strictly lower triangular ``A [..., C, C]`` by forward substitution.

    Row ``i`` of ``T = (I + A)^-1``: ``T[i, :i] = -sum_{j<i} A[i, j] T[j, :i]``, ``T[i, i] = 1``.
    """
    C = A.shape[-1]
    T = np.zeros_like(A)
    T[..., np.arange(C), np.arange(C)] = 1.0
    for i in range(1, C):
        T[..., i, :i] = -np.einsum("...j,...jc->...c", A[..., i, :i], T[..., :i, :i])
    return T


def _chunk_forward(q, k, v, gk, beta, S, scale):
    """One chunk of one sequence, all heads. The math of the CUDA chunk kernel.

    q, k, gk ``[HV, C, K]``; v ``[HV, C, V]``; beta ``[HV, C]``; S ``[HV, V, K]`` (state
    entering the chunk). Returns ``(o [HV, C, V], S_out [HV, V, K])``.
    """
    C = q.shape[1]
    G = np.cumsum(gk, axis=1)  # [HV, C, K] in-chunk cumulative log decay, G_i = sum_{s<=i} gk_s
    # Relative decays exp(G_i - G_j) for i >= j (0 above the diagonal). Never exp(-G) alone:
    # exp(-G_j) overflows for long chunks with strong decay, the difference does not.
    lower = np.tril(np.ones((C, C), dtype=bool))
    diff = np.where(lower[None, :, :, None], G[:, :, None, :] - G[:, None, :, :], -np.inf)
    decay = np.exp(diff)  # [HV, C(i), C(j), K]
    strict = np.tril(np.ones((C, C)), -1)
    # A_kk[i, j] = beta_i * sum_k k_i k_j exp(G_i - G_j), strictly lower.
    A_kk = np.einsum("hik,hijk->hij", k, decay * k[:, None, :, :]) * beta[:, :, None] * strict
    # A_qk[i, j] = sum_k q_i k_j exp(G_i - G_j), lower including the diagonal.
    A_qk = np.einsum("hik,hijk->hij", q, decay * k[:, None, :, :])
    Tinv = _unit_lower_inverse(A_kk)  # (I + A_kk)^-1, unit lower triangular
    eG = np.exp(G)
    W = Tinv @ (beta[:, :, None] * k * eG)  # [HV, C, K]
    U = Tinv @ (beta[:, :, None] * v)  # [HV, C, V]
    St = np.swapaxes(S, 1, 2)  # [HV, K, V]
    delta = U - W @ St  # [HV, C, V]: the corrected values (v - S_{i-1} decayed @ k_i) * beta_i
    o = scale * ((q * eG) @ St + A_qk @ delta)
    G_last = G[:, -1, :]  # [HV, K]
    S_out = S * np.exp(G_last)[:, None, :] + np.swapaxes(delta, 1, 2) @ (k * np.exp(G_last[:, None, :] - G))
    return o, S_out


def kda_chunked(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, A_log=None,
                dt_bias=None, lower_bound: float = -5.0, use_qk_l2norm: bool = True,
                chunk_size: int = CHUNK_SIZE, *, beta_sigmoid: bool = True):
    r"""Chunked (WY/UT) float64 reference of ``chunk_kda``; the blueprint of the CUDA kernel.

    Same arguments and results as :func:`kda_recurrent` (``beta`` per head only), plus
    ``chunk_size`` (64).

    Per sequence and value head, the tokens are cut into chunks of ``C`` tokens (the last
    may be shorter). For a chunk entering with state ``S0 [V, K]`` (notation: rows are
    tokens, ``K_c [C, K]``, ``Q_c``, ``V_c [C, V]``, ``beta [C]``, products ``*`` per element):

    1. Gate and in-chunk cumulative decay: ``gk_i`` (docs/semantics.md, section 7), ``G_i = sum_{s<=i} gk_s``.
    2. Strictly lower ``A_kk[i, j] = beta_i * sum_k k_i[k] k_j[k] exp(G_i[k] - G_j[k])``
       and lower (with diagonal) ``A_qk[i, j] = sum_k q_i[k] k_j[k] exp(G_i[k] - G_j[k])``.
    3. UT transform: ``T = (I + A_kk)^-1`` (unit lower triangular, forward substitution).
    4. WY factors: ``W = T @ (beta * K_c * exp(G))`` ``[C, K]``, ``U = T @ (beta * V_c)``
       ``[C, V]``.
    5. Corrected values ``D = U - W @ S0^T`` ``[C, V]`` (row ``i`` is
       ``beta_i (v_i - S_{i-1} diag(exp(gk_i)) k_i)``).
    6. Output ``O = scale * ((Q_c * exp(G)) @ S0^T + A_qk @ D)``.
    7. State passing ``S = S0 * exp(G_C)[None, :] + D^T @ (K_c * exp(G_C - G))``.

    Derivation: ``S_i = S0 diag(exp G_i) + sum_{j<=i} d_j (k_j * exp(G_i - G_j))^T`` solves the
    recurrence when ``d_i + beta_i sum_{j<i} (k_i * exp G_i) . (k_j * exp -G_j) d_j =
    beta_i (v_i - S0 (k_i * exp G_i))``, i.e. ``(I + A_kk) D = diag(beta) (V_c - (K_c * exp G) S0^T)``.

    Numerics: only relative decays ``exp(G_i - G_j)`` with ``i >= j`` (<= 1 for a decaying
    gate) and ``exp(G_i)``, ``exp(G_C - G_j)`` (<= 1) appear, so nothing overflows in float64.
    A float32 kernel must not factor ``exp(G_i - G_j) = exp(G_i) * exp(-G_j)`` over a whole
    chunk: with ``gk >= lower_bound = -5`` a 64-token chunk reaches ``exp(320)``, far past
    float32's ``exp(88)``. Factor around a reference token ``r`` between ``j`` and ``i``
    (``exp(G_i - G_r) * exp(G_r - G_j)``, both <= 1), e.g. the first token of the 16-row
    sub-block holding ``i``, and compute the diagonal 16x16 blocks pairwise.
    """
    C = int(chunk_size)
    if C < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    x = _ChunkInputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias,
                     lower_bound, use_qk_l2norm, beta_sigmoid)
    if x.per_channel_beta:
        raise ValueError("kda_chunked takes beta per head [B, T, HV]; use kda_recurrent for [B, T, HV, V]")
    beta1 = x.beta[..., 0]
    o = np.zeros((x.B, x.T, x.HV, x.V))
    final = np.empty_like(x.S0)
    for n, (b, bos, eos) in enumerate(x.seqs):
        S = x.S0[n].copy()
        for c0 in range(bos, eos, C):
            sl = slice(c0, min(c0 + C, eos))
            heads_first = lambda a: np.swapaxes(a[b, sl], 0, 1)  # noqa: E731  [C, HV, ...] -> [HV, C, ...]
            oc, S = _chunk_forward(heads_first(x.q), heads_first(x.k), heads_first(x.v),
                                   heads_first(x.gk), heads_first(beta1), S, x.scale)
            o[b, sl] = np.swapaxes(oc, 0, 1)
        final[n] = S
    return o.reshape(x.out_shape), final


# ----------------------------------------------------------------------------- segments


def _chunk_transition(k, v, gk, beta):
    """Affine map of one chunk (all heads): ``S_out = S_in @ M + Cc``.

    k, gk ``[HV, C, K]``; v ``[HV, C, V]``; beta ``[HV, C]``. From :func:`_chunk_forward`:
    ``S_out = S diag(e^{G_C}) + D^T Kb`` with ``D = U - W S^T``, so
    ``M = diag(e^{G_C}) - W^T Kb`` ``[HV, K, K]`` and ``Cc = U^T Kb`` ``[HV, V, K]``.
    """
    C = k.shape[1]
    G = np.cumsum(gk, axis=1)
    lower = np.tril(np.ones((C, C), dtype=bool))
    diff = np.where(lower[None, :, :, None], G[:, :, None, :] - G[:, None, :, :], -np.inf)
    strict = np.tril(np.ones((C, C)), -1)
    A_kk = np.einsum("hik,hijk->hij", k, np.exp(diff) * k[:, None, :, :]) * beta[:, :, None] * strict
    Tinv = _unit_lower_inverse(A_kk)
    W = Tinv @ (beta[:, :, None] * k * np.exp(G))  # [HV, C, K]
    U = Tinv @ (beta[:, :, None] * v)  # [HV, C, V]
    G_last = G[:, -1, :]
    Kb = k * np.exp(G_last[:, None, :] - G)  # [HV, C, K]
    M = np.exp(G_last)[:, :, None] * np.eye(k.shape[2]) - np.swapaxes(W, 1, 2) @ Kb
    return M, np.swapaxes(U, 1, 2) @ Kb


def kda_segment_combine(M, C, initial_state=None):
    """Float64 reference of the segment combine (docs/kda_chunk.md, "Intra-sequence parallelism").

    Segment ``s`` of a sequence maps the state entering it to the state leaving it by
    ``S_{s+1} = S_s @ M[s] + C[s]`` (``S [..., V, K]``, ``M [nseg, ..., K, K]``,
    ``C [nseg, ..., V, K]``; ``...`` any batch axes, e.g. heads). Returns the entry states
    ``[nseg + 1, ..., V, K]``: ``out[0]`` is ``initial_state`` (zeros when None), ``out[s]``
    the state entering segment ``s``, ``out[nseg]`` the final state.
    """
    M = _f64(M, "M")
    C = _f64(C, "C")
    if M.ndim < 3 or C.ndim != M.ndim or M.shape[0] != C.shape[0] or M.shape[1:-2] != C.shape[1:-2] \
            or M.shape[-1] != M.shape[-2] or C.shape[-1] != M.shape[-1]:
        raise ValueError(f"M must be [nseg, ..., K, K] and C [nseg, ..., V, K] with equal nseg and batch axes, "
                         f"got M {M.shape}, C {C.shape}")
    S = np.zeros(C.shape[1:]) if initial_state is None else _f64(initial_state, "initial_state").copy()
    if S.shape != C.shape[1:]:
        raise ValueError(f"initial_state must have shape {C.shape[1:]}, got {S.shape}")
    out = np.empty((M.shape[0] + 1,) + S.shape)
    out[0] = S
    for s in range(M.shape[0]):
        out[s + 1] = out[s] @ M[s] + C[s]
    return out


def kda_segmented(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, A_log=None,
                  dt_bias=None, lower_bound: float = -5.0, use_qk_l2norm: bool = True, *,
                  segment_len: int, chunk_size: int = CHUNK_SIZE, return_transitions: bool = False):
    r"""Segmented (intra-sequence parallel) float64 reference of ``chunk_kda``.

    Same arguments and results as :func:`kda_recurrent` (``beta`` per head), plus
    ``segment_len``: each sequence is cut into segments of ``segment_len`` tokens (the last
    may be shorter; boundaries need not fall on chunk boundaries), and ``chunk_size``: the
    chunk grid of :func:`kda_chunked`, restarted at every segment start. Three steps:

    1. **Transitions** (independent per segment): the segment's affine map
       ``S_out = S_in @ M_seg + C_seg``, composed from its chunks' maps
       ``(M_c, C_c)`` (:func:`_chunk_transition`): ``M_seg = M_1 M_2 ... M_n``,
       ``C_seg = (..((C_1 M_2 + C_2) M_3 + C_3) ..) M_n + C_n``.
    2. **Combine** (sequential over segments, :func:`kda_segment_combine`):
       ``S_0 = initial_state``, ``S_{s+1} = S_s @ M_seg[s] + C_seg[s]``.
    3. **Outputs** (independent per segment): the chunked forward of each segment from its
       true entry state ``S_s``.

    With ``return_transitions`` also returns, per sequence, ``(M [nseg, HV, K, K],
    C [nseg, HV, V, K], entry states [nseg + 1, HV, V, K])``.
    """
    Cn, L = int(chunk_size), int(segment_len)
    if Cn < 1 or L < 1:
        raise ValueError(f"chunk_size and segment_len must be >= 1, got {chunk_size}, {segment_len}")
    x = _ChunkInputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias,
                     lower_bound, use_qk_l2norm)
    if x.per_channel_beta:
        raise ValueError("kda_segmented takes beta per head [B, T, HV]: a per-channel beta has no "
                         "right-multiplying transition")
    beta1 = x.beta[..., 0]
    o = np.zeros((x.B, x.T, x.HV, x.V))
    final = np.empty_like(x.S0)
    transitions = []
    eye = np.broadcast_to(np.eye(x.K), (x.HV, x.K, x.K))
    for n, (b, bos, eos) in enumerate(x.seqs):
        segs = [(s0, min(s0 + L, eos)) for s0 in range(bos, eos, L)]
        hf = lambda a, sl: np.swapaxes(a[b, sl], 0, 1)  # noqa: E731  [C, HV, ...] -> [HV, C, ...]
        Ms = np.empty((len(segs), x.HV, x.K, x.K))
        Cs = np.empty((len(segs), x.HV, x.V, x.K))
        for i, (s0, s1) in enumerate(segs):  # 1. transitions, independent per segment
            M, Cm = eye.copy(), np.zeros((x.HV, x.V, x.K))
            for c0 in range(s0, s1, Cn):
                sl = slice(c0, min(c0 + Cn, s1))
                Mc, Cc = _chunk_transition(hf(x.k, sl), hf(x.v, sl), hf(x.gk, sl), hf(beta1, sl))
                M, Cm = M @ Mc, Cm @ Mc + Cc
            Ms[i], Cs[i] = M, Cm
        entry = kda_segment_combine(Ms, Cs, x.S0[n])  # 2. combine, sequential
        for i, (s0, s1) in enumerate(segs):  # 3. outputs, independent per segment
            S = entry[i].copy()
            for c0 in range(s0, s1, Cn):
                sl = slice(c0, min(c0 + Cn, s1))
                oc, S = _chunk_forward(hf(x.q, sl), hf(x.k, sl), hf(x.v, sl), hf(x.gk, sl), hf(beta1, sl), S,
                                       x.scale)
                o[b, sl] = np.swapaxes(oc, 0, 1)
        final[n] = entry[-1]
        transitions.append((Ms, Cs, entry))
    o = o.reshape(x.out_shape)
    return (o, final, transitions) if return_transitions else (o, final)


# ----------------------------------------------------------------------------- decode


def kda_decode(q, k, v, state, A_log, a, dt_bias, num_accepted_tokens, cu_seqlens, b, *,
               state_indices=None, scale=None, use_qk_l2norm=None, lower_bound=None,
               use_gate_in_kernel=None, use_lower_bound=None, apply_beta_sigmoid=None,
               allow_neg_eigval=None, use_initial_state=None, state_v_first=None, is_varlen=None,
               store_final_state: bool = False, inplace_final_state: bool = False, state_dtype=None):
    """Float64 reference of ``gated_delta_rule_decode`` (docs/semantics.md, section 8).

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; a ``[B, T, HV, K]``; b ``[B, T, HV]`` or
    ``[B, T, HV, V]``; varlen: ``B == 1`` and ``cu_seqlens [N+1]``. state: pool
    ``[P, HV, V, K]`` (``state_v_first``) or ``[P, HV, K, V]``, or None. state_indices
    None, ``[N]`` or ``[N, C]``; num_accepted_tokens ``[N]`` or None. Options take the
    public defaults when None (lower_bound -5.0, scale ``K**-0.5``, use_qk_l2norm True,
    use_gate_in_kernel True, use_initial_state True, state_v_first True, the rest False).
    ``state_dtype`` (default: state's dtype, else float32) decides the rounding: a
    bfloat16 state is rounded after every token (outputs use the unrounded state).

    Slots (docs/semantics.md, section 8): the initial state of sequence ``n`` comes from slot ``n`` (no
    indices), ``state_indices[n]`` (``[N]``), ``state_indices[n, num_accepted_tokens[n]-1]``
    (speculative) or ``state_indices[n, 0]`` (``[N, C]``). A negative read slot makes the
    sequence padding (zero output, no state read or written, zero final state). With
    ``[N, C]`` indices a negative ``state_indices[n, t]`` makes token ``t`` padding (zero
    output, state carried unchanged, nothing stored). In place: ``[N, C]`` writes the state
    after token ``t`` to ``state_indices[n, t]``; otherwise the state after the last token
    goes to the read slot. Empty sequences store nothing in place.

    Returns ``(out, pool_after, final_state)``: out float64 ``[B, T, HV, V]``; pool_after
    float64 copy of the pool after the in-place writes (None unless
    ``inplace_final_state``); final_state float64 ``[N, HV, V, K]`` (K-first when
    ``state_v_first`` is False) when ``store_final_state`` and not in place, else None.
    Slots at or past the pool size (the read slot, and with ``[N, C]`` indices the slot of
    every token of a non-padding sequence) raise ``ValueError``.
    """
    from ..runtime.interop import BFLOAT16, FLOAT32, as_dtype

    use_qk_l2norm = True if use_qk_l2norm is None else bool(use_qk_l2norm)
    lower_bound = -5.0 if lower_bound is None else float(lower_bound)
    use_gate_in_kernel = True if use_gate_in_kernel is None else bool(use_gate_in_kernel)
    use_lower_bound = bool(use_lower_bound)
    use_initial_state = True if use_initial_state is None else bool(use_initial_state)
    state_v_first = True if state_v_first is None else bool(state_v_first)
    varlen = (cu_seqlens is not None) if is_varlen is None else bool(is_varlen)
    if state_dtype is None:
        state_dtype = FLOAT32 if state is None else as_dtype(getattr(state, "dtype", FLOAT32))
    bf16_state = as_dtype(state_dtype) == BFLOAT16

    q64, k64, v64 = _f64(q, "q"), _f64(k, "k"), _f64(v, "v")
    B, T, H, K = q64.shape
    HV, V = v64.shape[2], v64.shape[3]
    if use_qk_l2norm:
        q64, k64 = l2norm(q64), l2norm(k64)
    qe, ke = _expand_heads(q64, HV), _expand_heads(k64, HV)
    gk = kda_decode_gate(a, A_log, dt_bias, use_gate_in_kernel=use_gate_in_kernel,
                         use_lower_bound=use_lower_bound, lower_bound=lower_bound)
    beta = kda_decode_beta(b, apply_beta_sigmoid=bool(apply_beta_sigmoid), allow_neg_eigval=bool(allow_neg_eigval))
    if beta.ndim == 3:
        beta = beta[..., None]  # [B, T, HV, 1]
    scale = K ** -0.5 if scale is None else float(scale)

    if varlen:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens must be given when is_varlen=True")
        seqs = _sequences(B, T, cu_seqlens)
    else:
        seqs = [(n, 0, T) for n in range(B)]
    N = len(seqs)

    pool = None
    if state is not None:
        pool = _f64(state, "state")
        if not state_v_first:
            pool = np.swapaxes(pool, -1, -2)  # work in V-first [P, HV, V, K]
        pool = np.array(pool)
    if (use_initial_state or inplace_final_state) and pool is None:
        raise ValueError("state must be provided when use_initial_state or inplace_final_state is set")
    P = None if pool is None else pool.shape[0]

    si = _int_host(state_indices, "state_indices")
    na = _int_host(num_accepted_tokens, "num_accepted_tokens")
    if na is not None and (si is None or si.ndim != 2):
        raise ValueError("num_accepted_tokens requires [N, C] state_indices")

    def check_slot(slot: int, what: str) -> None:
        if P is not None and slot >= P:
            raise ValueError(f"{what} = {slot} is out of range for a state pool of {P} slots")

    # Resolve every sequence's read slot and per-token slots before touching any state.
    plans = []
    for n, (row, bos, eos) in enumerate(seqs):
        L = eos - bos
        token_slots = None
        if si is None:
            read = n
        elif si.ndim == 1:
            read = int(si[n])
        else:
            C = si.shape[1]
            if na is not None:
                if not 1 <= na[n] <= C:
                    raise ValueError(
                        f"num_accepted_tokens[{n}] = {int(na[n])} must be in [1, {C}] (state_indices columns)"
                    )
                read = int(si[n, na[n] - 1])
            else:
                read = int(si[n, 0])
            if (inplace_final_state or na is not None) and L > C:
                raise ValueError(
                    f"state_indices has {C} columns but sequence {n} has {L} tokens "
                    "(in-place or speculative decode needs one slot per token)"
                )
            token_slots = [int(si[n, t]) if t < C else None for t in range(L)]
        if read >= 0:
            check_slot(read, f"state slot of sequence {n}")
            if token_slots is not None:
                for t, s in enumerate(token_slots):
                    if s is not None and s >= 0:
                        check_slot(s, f"state_indices[{n}, {t}]")
        plans.append((row, bos, eos, read, token_slots))

    out = np.zeros((B, T, HV, V))
    pool_after = pool.copy() if (inplace_final_state and pool is not None) else None
    want_final = store_final_state and not inplace_final_state
    final = np.zeros((N, HV, V, K)) if want_final else None

    for n, (row, bos, eos, read, token_slots) in enumerate(plans):
        if read < 0:
            continue  # padding sequence: zero output, no state traffic, zero final state
        S = pool[read].copy() if use_initial_state else np.zeros((HV, V, K))
        for i, t in enumerate(range(bos, eos)):
            slot = None if token_slots is None else token_slots[i]
            if slot is not None and slot < 0:
                continue  # padding token: zero output, state carried unchanged
            S, out[row, t] = _delta_step(S, qe[row, t], ke[row, t], v64[row, t], gk[row, t], beta[row, t], scale)
            if bf16_state:
                S = round_bf16(S)
            if inplace_final_state and token_slots is not None and slot is not None:
                pool_after[slot] = S
        if inplace_final_state and token_slots is None and eos > bos:
            pool_after[read] = S
        if want_final:
            final[n] = S

    if not state_v_first:
        if pool_after is not None:
            pool_after = np.ascontiguousarray(np.swapaxes(pool_after, -1, -2))
        if final is not None:
            final = np.ascontiguousarray(np.swapaxes(final, -1, -2))
    return out, pool_after, final
