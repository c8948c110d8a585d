"""FLOP and byte models used to turn times into TFLOP/s and TB/s.

Every function is plain Python / NumPy (no GPU) so the models are unit-tested
on the CPU. Conventions (also in bench/README.md):

* Attention counts 4 * D FLOPs per attended (query, key) pair and query head
  (2 * D for ``q . k``, 2 * D for ``p * v``). Causal attention with ``Sq`` queries
  aligned to the end of ``Sk`` keys attends ``Sq * Sk - Sq^2 / 2`` pairs (the
  continuous model: ``S^2 / 2`` when ``Sq == Sk``, i.e. ``2 * B * Hq * S^2 * D``
  FLOPs, the figure FlashAttention and the peers' notes use).
* Block max score computes only ``q . k``: 2 * D FLOPs per pair.
* Memory-bound ops count the bytes they must move once (decode: K and V read
  once; top-k: the scores read once; KDA decode: the state read and written).
"""
from __future__ import annotations

import numpy as np

BLOCK = 128  # MSA key block (max-score tile, sparse block)


def causal_pairs(sq: int, sk: int) -> float:
    """(query, key) pairs of bottom-right-aligned causal attention (continuous model)."""
    sq, sk = float(sq), float(sk)
    if sq <= sk:
        return sq * sk - sq * sq / 2.0
    # more queries than keys: the first sq - sk queries see nothing
    return sk * sk / 2.0


def attention_pairs(sq: int, sk: int, causal: bool) -> float:
    return causal_pairs(sq, sk) if causal else float(sq) * float(sk)


def attention_flops(batch: int, hq: int, sq: int, sk: int, d: int, causal: bool) -> float:
    """Forward attention FLOPs: 4 * D per attended pair and query head."""
    return 4.0 * batch * hq * d * attention_pairs(sq, sk, causal)


def max_score_flops(batch: int, hq: int, sq: int, sk: int, d: int, causal: bool) -> float:
    """Block max score FLOPs: the ``q . k`` half of attention (2 * D per pair)."""
    return 2.0 * batch * hq * d * attention_pairs(sq, sk, causal)


def kv_bytes(batch: int, seqlen_k: int, hkv: int, d: int, elem_bytes: int = 2) -> float:
    """Bytes of K and V read once (decode's memory model)."""
    return 2.0 * batch * seqlen_k * hkv * d * elem_bytes


def sparse_pairs(block_ids: np.ndarray, q_pos: np.ndarray, kv_len: int, block: int = BLOCK) -> int:
    """Attended (query, key) pairs of block-sparse causal attention, per KV head.

    block_ids: int [total_q, Hkv, W], block ids (``-1`` = unused slot), no duplicates.
    q_pos: int [total_q], absolute position of each query; a query at ``p``
    attends key ``j`` of a listed block when ``j <= p`` and ``j < kv_len``.
    Returns the sum over queries and KV heads (multiply by the GQA ratio for
    query heads).
    """
    ids = np.asarray(block_ids, dtype=np.int64)
    pos = np.asarray(q_pos, dtype=np.int64)
    if ids.ndim != 3 or pos.shape != (ids.shape[0],):
        raise ValueError(f"block_ids must be [total_q, Hkv, W] and q_pos [total_q], got {ids.shape}, {pos.shape}")
    end = np.minimum(pos + 1, kv_len)[:, None, None]  # exclusive bound of admissible keys
    start = ids * block
    n = np.clip(end - start, 0, block)
    n = np.where(ids >= 0, n, 0)
    return int(n.sum())


def sparse_attention_flops(block_ids: np.ndarray, q_pos: np.ndarray, kv_len: int, hq: int, d: int) -> float:
    """4 * D FLOPs per attended pair and query head (``hq / Hkv`` query heads per KV head)."""
    hkv = int(np.asarray(block_ids).shape[1])
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"hq={hq} must be a multiple of Hkv={hkv}")
    return 4.0 * d * (hq // hkv) * sparse_pairs(block_ids, q_pos, kv_len)


def topk_bytes(rows: int, n: int, elem_bytes: int = 4) -> float:
    """Top-k selection reads the scores once."""
    return float(rows) * n * elem_bytes


def kda_decode_bytes(batch: int, hv: int, k: int = 128, v: int = 128, state_bytes: int = 4) -> float:
    """One decode step reads and writes each sequence's [HV, V, K] state once."""
    return 2.0 * batch * hv * k * v * state_bytes


def kda_chunk_flops(tokens: int, hv: int, k: int = 128, v: int = 128, chunk: int = 64) -> float:
    """Chunked KDA forward FLOPs (chunk size C), per token and value head::

        intra-chunk  Aqk, Akk (q k^T, k k^T)      2 * C * K * 2
                     w = A (beta k), u = A (beta v) 2 * C * (K + V)
                     o += Aqk v_new                2 * C * V
        inter-chunk  v_new = u - w S^T             2 * K * V
                     S += k^T v_new                2 * K * V
                     o  = q S^T                    2 * K * V

    = 2 C (3 K + 2 V) + 6 K V (gates, norms and the triangular solve are
    ignored). A model, not a count of what any kernel issues: fla publishes only
    times, so this puts both implementations on one FLOP scale.
    """
    per_token = 2.0 * chunk * (3 * k + 2 * v) + 6.0 * k * v
    return per_token * tokens * hv


def tflops(flops: float | None, ms: float | None) -> float | None:
    if not flops or not ms or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def tbps(nbytes: float | None, ms: float | None) -> float | None:
    if not nbytes or not ms or ms <= 0:
        return None
    return nbytes / (ms * 1e-3) / 1e12
