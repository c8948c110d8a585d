"""Intra-sequence parallelism of chunk_kda: segment transitions and their combine.

The segmented float64 reference (``kda_segmented``: per-segment affine maps
``S_out = S_in @ M + C`` from the chunk form, a sequential combine, outputs recomputed per
segment from the true entry state) must reproduce the token-by-token definition
(``kda_recurrent``) for segment boundaries anywhere, chunk-aligned or not; the combine
(``mate_cupy.kda.segments``) must agree with its float64 reference on every array library
it accepts, and composing maps must be associative.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mate_cupy.kda.segments import combine_segments, compose_transitions
from mate_cupy.reference.kda import kda_recurrent, kda_segment_combine, kda_segmented

BF16 = np.dtype(ml_dtypes.bfloat16)


def _inputs(rng, lens, H, HV, K, V, *, gate_params, state, varlen):
    if varlen:
        B, T = 1, int(sum(lens))
    else:
        B, T = len(lens), lens[0]
    x = dict(q=rng.standard_normal((B, T, H, K)), k=rng.standard_normal((B, T, H, K)),
             v=rng.standard_normal((B, T, HV, V)), beta=rng.standard_normal((B, T, HV)))
    if gate_params:
        x["g"] = rng.standard_normal((B, T, HV, K))
        x["A_log"] = rng.uniform(-1.0, 1.0, HV).astype(np.float32)
        x["dt_bias"] = rng.standard_normal((HV, K)).astype(np.float32)
    else:  # log decay, mild to strong per head
        x["g"] = -np.abs(rng.standard_normal((B, T, HV, K))) * rng.uniform(0.01, 1.0, (1, 1, HV, 1))
    N = B
    if varlen:
        x["cu_seqlens"] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        N = len(lens)
    if state is not None:
        x["initial_state"] = (0.5 * rng.standard_normal((N, HV, V, K))).astype(state)
    return x


def _close(a, b, tol=1e-10):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(1.0, float(np.abs(b).max()) if b.size else 1.0)
    assert np.abs(a - b).max(initial=0.0) <= tol * scale


@pytest.mark.parametrize("length", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("gva", [1, 2, 4])
@pytest.mark.parametrize("state", [None, np.float32, BF16], ids=["nostate", "f32", "bf16"])
def test_segmented_matches_recurrent(rng, length, gva, state):
    """Segments of 1, 37, 64 and 100 tokens (boundaries inside chunks and on them)."""
    H = 1 if gva == 4 else 2
    x = _inputs(rng, [length], H, H * gva, 16, 24, gate_params=length % 2 == 1, state=state, varlen=False)
    o_ref, s_ref = kda_recurrent(**x)
    for seg in (1, 37, 64, 100):
        if seg == 1 and length == 1000:
            continue  # 1000 one-token segments: slow, and covered by the shorter lengths
        o, s = kda_segmented(**x, segment_len=seg)
        _close(o, o_ref)
        _close(s, s_ref)


def test_segmented_varlen_full_head_dim(rng):
    """Packed sequences (one empty) at K = V = 128 with gate parameters and a bf16 state."""
    lens = [70, 0, 1, 200]
    x = _inputs(rng, lens, 2, 4, 128, 128, gate_params=True, state=BF16, varlen=True)
    o_ref, s_ref = kda_recurrent(**x)
    o, s, tr = kda_segmented(**x, segment_len=90, return_transitions=True)
    _close(o, o_ref)
    _close(s, s_ref)
    assert [t[0].shape[0] for t in tr] == [1, 0, 1, 3]  # segments per sequence
    for n, (M, C, entry) in enumerate(tr):
        np.testing.assert_array_equal(entry[0], np.asarray(x["initial_state"][n], np.float64))
        _close(entry[-1], s_ref[n])


def test_transition_is_the_map_of_the_segment(rng):
    """M and C of a segment, applied to any entry state, give the recurrent state after it."""
    x = _inputs(rng, [150], 1, 2, 16, 8, gate_params=False, state=None, varlen=False)
    _, _, tr = kda_segmented(**x, segment_len=150, return_transitions=True)
    M, C, _ = tr[0]
    for _ in range(2):
        S0 = rng.standard_normal((1, 2, 8, 16))
        _, s_ref = kda_recurrent(**dict(x, initial_state=S0))
        _close(S0[0] @ M[0] + C[0], s_ref[0])


def test_chunk_transition_matrix_is_decay_minus_low_rank(rng):
    """A single chunk's M: diag(exp(G_C)) minus a rank <= 64 term (W^T Kb)."""
    x = _inputs(rng, [64], 1, 1, 128, 8, gate_params=False, state=None, varlen=False)
    _, _, tr = kda_segmented(**x, segment_len=64, return_transitions=True)
    M = tr[0][0][0, 0]
    from mate_cupy.reference.kda import kda_chunk_gate

    decay = np.exp(kda_chunk_gate(np.asarray(x["g"], np.float64))[0, :, 0].sum(0))
    low = np.diag(decay) - M
    assert np.linalg.matrix_rank(low, tol=1e-9 * np.abs(low).max()) <= 64


def _maps(rng, nseg, batch=(3,), K=16, V=8):
    M = rng.standard_normal((nseg,) + batch + (K, K)) * 0.3
    C = rng.standard_normal((nseg,) + batch + (V, K))
    S0 = rng.standard_normal(batch + (V, K))
    return M, C, S0


def test_combine_reference_definition(rng):
    M, C, S0 = _maps(rng, 5)
    out = kda_segment_combine(M, C, S0)
    assert out.shape == (6, 3, 8, 16)
    S = S0.copy()
    np.testing.assert_array_equal(out[0], S0)
    for s in range(5):
        S = S @ M[s] + C[s]
        _close(out[s + 1], S, 1e-14)
    zero = kda_segment_combine(M, C)
    np.testing.assert_array_equal(zero[0], 0.0)
    assert kda_segment_combine(M[:0], C[:0], S0).shape == (1, 3, 8, 16)


def test_combine_refuses_mismatched_shapes(rng):
    M, C, S0 = _maps(rng, 3)
    with pytest.raises(ValueError, match="M must be"):
        combine_segments(M[:2], C, S0)
    with pytest.raises(ValueError, match="M must be"):
        combine_segments(M[..., :8], C, S0)
    with pytest.raises(ValueError, match="initial_state"):
        combine_segments(M, C, S0[0])


def test_compose_is_associative_and_matches_the_combine(rng):
    """A tree over segments (as across GPUs) gives the combine's final state."""
    M, C, S0 = _maps(rng, 8)
    maps = [(M[s], C[s]) for s in range(8)]
    while len(maps) > 1:  # pairwise tree
        maps = [compose_transitions(maps[i], maps[i + 1]) for i in range(0, len(maps), 2)]
    Mt, Ct = maps[0]
    _close(S0 @ Mt + Ct, combine_segments(M, C, S0)[-1], 1e-12)
    left = compose_transitions(compose_transitions((M[0], C[0]), (M[1], C[1])), (M[2], C[2]))
    right = compose_transitions((M[0], C[0]), compose_transitions((M[1], C[1]), (M[2], C[2])))
    _close(left[0], right[0], 1e-13)
    _close(left[1], right[1], 1e-13)


@pytest.mark.torch
def test_combine_on_torch_matches_the_reference(rng):
    torch = pytest.importorskip("torch")
    M, C, S0 = _maps(rng, 4)
    ref = kda_segment_combine(M, C, S0)
    t = lambda a: torch.from_numpy(a.astype(np.float32))  # noqa: E731
    out = combine_segments(t(M), t(C), t(S0))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and tuple(out.shape) == ref.shape
    _close(out.numpy(), ref, 1e-5)
    z = combine_segments(t(M), t(C))
    assert float(z[0].abs().max()) == 0.0
    assert tuple(combine_segments(t(M)[:0], t(C)[:0]).shape) == (1, 3, 8, 16)
