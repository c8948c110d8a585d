"""The contract between the two KDA ops: prefill then decode equals one recurrence.

``chunk_kda``'s final state (V-first ``[N, HV, V, K]``) continues in
``gated_delta_rule_decode`` with the default state arguments (V-first, slot ``n`` for
sequence ``n``, default scale and L2 norm). The gate/beta options that reproduce
``chunk_kda``'s formulas: with ``A_log``/``dt_bias`` -> ``use_lower_bound=True`` and the same
``lower_bound``; without -> ``use_gate_in_kernel=False`` (``a`` is the log decay); beta logits ->
``apply_beta_sigmoid=True``.
"""
from __future__ import annotations

import numpy as np
import pytest

from mate_cupy import chunk_kda, gated_delta_rule_decode
from mate_cupy.reference.kda import kda_recurrent
from test_kda_reference import BF16, kda_inputs, rel

F32 = np.dtype(np.float32)
TOKEN_KEYS = ("q", "k", "v", "g", "beta")


def _decode_opts(x, lower_bound):
    if "A_log" in x:
        return dict(use_lower_bound=True, lower_bound=lower_bound, apply_beta_sigmoid=True)
    return dict(use_gate_in_kernel=False, apply_beta_sigmoid=True)


def _decode_call(x, sl, state, opts, **kw):
    return gated_delta_rule_decode(
        x["q"][:, sl], x["k"][:, sl], x["v"][:, sl], state, x.get("A_log"), x["g"][:, sl], x.get("dt_bias"),
        None, None, x["beta"][:, sl], **opts, **kw)


@pytest.mark.parametrize("gate_params", [True, False], ids=["gateparams", "logdecay"])
@pytest.mark.parametrize("state", [None, F32, BF16], ids=["nostate", "state-f32", "state-bf16"])
@pytest.mark.parametrize("mode", ["token-by-token", "multi-token"])
def test_prefill_then_decode_equals_recurrence(rng, gate_params, state, mode):
    B, T, n, H, HV = 2, 70, 3, 2, 4
    lb = -4.0
    x = kda_inputs(rng, B, T + n, H, HV, gate_params=gate_params, state=state)
    init = x.pop("initial_state", None)
    o_ref, fs_ref = kda_recurrent(**x, initial_state=init, lower_bound=lb)

    pre = {key: (val[:, :T] if key in TOKEN_KEYS else val) for key, val in x.items()}
    o_pre, fs = chunk_kda(**pre, initial_state=init, lower_bound=lb, output_final_state=True)
    sdt = F32 if state is None else np.dtype(state)
    if state is None:
        fs = fs.astype(np.float32)  # q's dtype (bf16) by default; decode here with an fp32 pool
    assert fs.shape == (B, HV, 128, 128)
    assert rel(o_pre, o_ref[:, :T]) < 1e-2

    opts = _decode_opts(x, lb)
    outs = []
    if mode == "token-by-token":
        for j in range(n):
            out, pool = _decode_call(x, slice(T + j, T + j + 1), fs, opts, inplace_final_state=True)
            assert pool is fs
            outs.append(out)
        out = np.concatenate(outs, axis=1)
        final = fs
    else:
        out, final = _decode_call(x, slice(T, T + n), fs, opts, store_final_state=True)
    assert rel(out, o_ref[:, T:]) < 1e-2
    state_tol = 1e-5 if state == F32 else 2e-2  # a bf16 prefill state (the default) is rounded once
    assert final.dtype == sdt
    assert rel(final, fs_ref) < state_tol


def test_prefill_then_decode_default_gate_formula_differs(rng):
    """Sanity: decode's default gate (-exp(A) softplus) is not chunk_kda's bounded gate."""
    x = kda_inputs(rng, 1, 5, 1, 2, gate_params=True)
    pre = {key: (val[:, :4] if key in TOKEN_KEYS else val) for key, val in x.items()}
    _, fs = chunk_kda(**pre, output_final_state=True, initial_state=np.zeros((1, 2, 128, 128), np.float32))
    o_ref, _ = kda_recurrent(**x)
    good, _ = _decode_call(x, slice(4, 5), fs.copy(), _decode_opts(x, -5.0))
    other, _ = _decode_call(x, slice(4, 5), fs.copy(), dict(apply_beta_sigmoid=True))
    assert rel(good, o_ref[:, 4:]) < 1e-2
    assert rel(other, o_ref[:, 4:]) > 1e-2


def test_varlen_prefill_then_pooled_decode(rng):
    """Varlen prefill, final states copied into a larger pool, decode with [B] slots in place."""
    lens = [5, 0, 70]
    n = 2
    x = kda_inputs(rng, 0, 0, 1, 2, gate_params=True, lens=lens, state=F32)
    init = x.pop("initial_state")
    _, fs = chunk_kda(**x, initial_state=init, output_final_state=True)
    assert fs.dtype == F32 and fs.shape == (3, 2, 128, 128)

    cu = x["cu_seqlens"]
    nxt = kda_inputs(rng, 3, n, 1, 2, gate_params=True)  # the next n tokens of each sequence
    nxt["A_log"], nxt["dt_bias"] = x["A_log"], x["dt_bias"]
    slots = np.array([6, 1, 3], np.int32)
    pool = np.zeros((8, 2, 128, 128), np.float32)
    pool[slots] = fs
    outs = []
    for j in range(n):
        out, p = _decode_call(nxt, slice(j, j + 1), pool, _decode_opts(nxt, -5.0), state_indices=slots,
                              inplace_final_state=True)
        assert p is pool
        outs.append(out)
    out = np.concatenate(outs, axis=1)
    for s, L in enumerate(lens):
        seq = {key: np.concatenate([x[key][:, cu[s]:cu[s + 1]], nxt[key][s:s + 1]], axis=1) for key in TOKEN_KEYS}
        o_ref, fs_ref = kda_recurrent(**seq, initial_state=init[s:s + 1], A_log=x["A_log"], dt_bias=x["dt_bias"])
        assert rel(out[s], o_ref[0, L:]) < 1e-2
        assert rel(pool[slots[s]], fs_ref[0]) < 1e-5
    untouched = [0, 2, 4, 5, 7]
    assert np.all(pool[untouched] == 0)
