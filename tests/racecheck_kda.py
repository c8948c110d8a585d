"""Run every KDA kernel once on small inputs, for compute-sanitizer (needs a CUDA GPU).

    compute-sanitizer --tool racecheck --racecheck-report all python tests/racecheck_kda.py
    compute-sanitizer --tool racecheck --racecheck-report all python tests/racecheck_kda.py decode-vfirst-t1

Cases (all by default, or the names given): single-token in-place decode on V-first fp32
and bf16 pools (the bulk-copy staging on sm_90, one-warp CTAs), K-first pools, a 12-token
decode (two prologue chunks, the state parked in shared memory between them), [N, C]
slots with accepted counts, and chunk_kda dense and varlen with mild and extreme gates
(the prepare kernel's element-wise diagonal blocks). Each case checks its output against
the float64 reference, so a run that completes also ran the kernels it names.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

K = 128


def _decode(rs, *, B, T, H, HV, state_dtype, v_first=True, slots="n", varlen=False):
    import cupy as cp

    import mate_cupy as m

    f16 = lambda *s: rs.standard_normal(s).astype(np.float16)  # noqa: E731
    q, k, v, a = f16(B, T, H, K), f16(B, T, H, K), f16(B, T, HV, K), f16(B, T, HV, K)
    b = f16(B, T, HV)
    A_log = (rs.standard_normal(HV) * 0.5).astype(np.float32)
    dt_bias = (rs.standard_normal((HV, K)) * 0.5).astype(np.float32)
    P = B * max(T, 1) + 3
    pool = (rs.standard_normal((P, HV, K, K)) * 0.1).astype(np.float32)
    if state_dtype == "bfloat16":
        import ml_dtypes

        pool = pool.astype(ml_dtypes.bfloat16)
    kw = dict(use_lower_bound=True, apply_beta_sigmoid=True, inplace_final_state=True, state_v_first=v_first)
    if slots == "n":
        idx, acc = rs.permutation(P)[:B].astype(np.int32), None
    else:  # [N, C]: slot per token, initial state from column acc - 1 ("nc") or 0 ("nc0")
        idx = rs.permutation(P)[:B * T].reshape(B, T).astype(np.int32)
        acc = rs.integers(1, T + 1, size=B).astype(np.int32) if slots == "nc" else None
    args = [q, k, v, pool, A_log, a, dt_bias, acc, None, b]
    dev = [None if x is None else cp.asarray(x) for x in args]  # before the host call updates pool in place
    ref_out, ref_pool = m.gated_delta_rule_decode(*args, state_indices=idx, **kw)
    out, _ = m.gated_delta_rule_decode(*dev, state_indices=cp.asarray(idx), **kw)
    cp.cuda.Device().synchronize()
    err = np.abs(cp.asnumpy(out).astype(np.float64) - np.asarray(ref_out, np.float64)).max()
    scale = np.abs(np.asarray(ref_out, np.float64)).max()
    assert err <= 2e-2 * scale + 1e-3, (err, scale)


def _chunk(rs, *, lens, HV, extreme):
    import cupy as cp

    import mate_cupy as m

    S = int(sum(lens))
    bf = lambda *s: rs.standard_normal(s).astype(np.float16)  # noqa: E731
    q, k, v = bf(1, S, HV, K), bf(1, S, HV, K), bf(1, S, HV, K)
    g = (-(rs.random((1, S, HV, K)) * (12.0 if extreme else 0.3))).astype(np.float16)
    beta = bf(1, S, HV)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    h0 = (rs.standard_normal((len(lens), HV, K, K)) * 0.1).astype(np.float32)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu)
    ref_o, ref_s = m.chunk_kda(q, k, v, g, beta, **kw)
    dev = {n: cp.asarray(x) for n, x in kw.items() if not isinstance(x, bool)}
    o, s = m.chunk_kda(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(g), cp.asarray(beta),
                       output_final_state=True, **dev)
    cp.cuda.Device().synchronize()
    r = np.linalg.norm(cp.asnumpy(o).astype(np.float64) - ref_o) / np.linalg.norm(ref_o)
    assert r < 1e-2, r


CASES = {
    "decode-vfirst-t1": lambda rs: _decode(rs, B=1, T=1, H=4, HV=8, state_dtype="float32"),
    "decode-vfirst-t1-b8": lambda rs: _decode(rs, B=8, T=1, H=4, HV=8, state_dtype="float32"),
    "decode-vfirst-t1-bf16": lambda rs: _decode(rs, B=2, T=1, H=4, HV=8, state_dtype="bfloat16"),
    "decode-vfirst-t12": lambda rs: _decode(rs, B=2, T=12, H=2, HV=4, state_dtype="float32", slots="nc0"),
    "decode-vfirst-t12-bf16": lambda rs: _decode(rs, B=2, T=12, H=2, HV=4, state_dtype="bfloat16", slots="nc0"),
    "decode-vfirst-spec": lambda rs: _decode(rs, B=3, T=4, H=2, HV=4, state_dtype="float32", slots="nc"),
    "decode-kfirst-t1": lambda rs: _decode(rs, B=2, T=1, H=4, HV=8, state_dtype="float32", v_first=False),
    "decode-kfirst-t12-bf16": lambda rs: _decode(rs, B=2, T=12, H=2, HV=4, state_dtype="bfloat16", v_first=False,
                                                slots="nc0"),
    "chunk-mild": lambda rs: _chunk(rs, lens=[70, 1, 64], HV=2, extreme=False),
    "chunk-extreme": lambda rs: _chunk(rs, lens=[130, 5], HV=2, extreme=True),
}


def main(argv) -> int:
    names = argv or list(CASES)
    for name in names:
        CASES[name](np.random.default_rng(0))
        print(f"{name}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
