"""``python -m mate_cupy demo``: one small MSA pipeline and one KDA prefill + decode.

On a GPU the inputs are CuPy arrays (the CUDA kernels run) and each result is
compared with the NumPy float64 reference path; without one, the reference path runs.
"""
from __future__ import annotations

import time

import ml_dtypes
import numpy as np


def _backend(force_cpu: bool):
    if force_cpu:
        return None
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:
        pass
    return None


def _rel(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    fin = np.isfinite(b)
    den = np.linalg.norm(b[fin])
    return float(np.linalg.norm((a - b)[fin]) / den) if den else 0.0


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def _msa_demo(xp, rng, where: str) -> None:
    import mate_cupy as mc

    bf16 = ml_dtypes.bfloat16
    qo = np.array([1, 300], np.int32)
    kv = np.array([700, 1100], np.int32)
    hq, hkv, d = 16, 2, 128
    q = rng.standard_normal((int(qo.sum()), hq, d)).astype(bf16)
    k = rng.standard_normal((int(kv.sum()), hkv, d)).astype(bf16)
    v = rng.standard_normal((int(kv.sum()), hkv, d)).astype(bf16)
    plan = mc.msa_plan_from_lengths(qo, kv, hq, hkv, split_prefill_decode=False, output_maxscore=True,
                                    device=None if xp is None else xp.cuda.Device().id)  # uploaded when built
    args = [q, k, v] if xp is None else [xp.asarray(a) for a in (q, k, v)]
    (out, max_score), ms = _timed(lambda: mc.msa(*args, plan))
    sel, ms2 = _timed(lambda: mc.sparse_topk_select(max_score, 4, force_begin_blocks=1, force_end_blocks=1))
    print(f"  msa dense causal GQA {hq}/{hkv} D{d}, lengths q={qo.tolist()} k={kv.tolist()}: "
          f"out {tuple(out.shape)}, max_score {tuple(max_score.shape)} [{where}, {ms:.1f} ms]")
    print(f"  sparse_topk_select topk=4 +1 begin +1 end: ids {tuple(sel.shape)}, "
          f"last query head 0 -> {_host(sel)[-1, 0].tolist()} [{where}, {ms2:.1f} ms]")
    if xp is not None:
        ref_out, ref_ms = mc.msa(q, k, v, plan)
        print(f"    vs float64 reference: out rel err {_rel(_host(out).astype(np.float64), ref_out.astype(np.float64)):.2e}, "
              f"max_score rel err {_rel(_host(max_score), ref_ms):.2e}")


def _kda_demo(xp, rng, where: str) -> None:
    import mate_cupy as mc

    bf16 = ml_dtypes.bfloat16
    b, t, h, hv, d = 2, 100, 2, 4, 128
    q = rng.standard_normal((b, t, h, d)).astype(bf16)
    k = rng.standard_normal((b, t, h, d)).astype(bf16)
    v = rng.standard_normal((b, t, hv, d)).astype(bf16)
    g = rng.standard_normal((b, t, hv, d)).astype(bf16)
    beta = rng.standard_normal((b, t, hv)).astype(bf16)
    a_log = rng.uniform(-1, 0.5, hv).astype(np.float32)
    dt_bias = rng.standard_normal((hv, d)).astype(np.float32) * 0.1
    host = (q, k, v, g, beta, a_log, dt_bias)
    dev = host if xp is None else tuple(xp.asarray(a) for a in host)
    (o, state), ms = _timed(lambda: mc.chunk_kda(*dev[:5], initial_state=None, output_final_state=True,
                                                 A_log=dev[5], dt_bias=dev[6]))
    state = state.astype(np.float32) if xp is None else state.astype(xp.float32)
    print(f"  chunk_kda B{b} T{t} H{h} HV{hv} D{d}, gate in kernel: o {tuple(o.shape)}, "
          f"final state {tuple(state.shape)} V-first [{where}, {ms:.1f} ms]")
    q1 = rng.standard_normal((b, 1, h, d)).astype(bf16)
    k1 = rng.standard_normal((b, 1, h, d)).astype(bf16)
    v1 = rng.standard_normal((b, 1, hv, d)).astype(bf16)
    a1 = rng.standard_normal((b, 1, hv, d)).astype(bf16)
    b1 = rng.standard_normal((b, 1, hv)).astype(bf16)
    step = (q1, k1, v1, a1, b1)
    sdev = step if xp is None else tuple(xp.asarray(a) for a in step)
    (o1, _), ms = _timed(lambda: mc.gated_delta_rule_decode(
        sdev[0], sdev[1], sdev[2], state, dev[5], sdev[3], dev[6], None, None, sdev[4],
        use_lower_bound=True, apply_beta_sigmoid=True, inplace_final_state=True))
    print(f"  gated_delta_rule_decode of the next token from that state, in place: o {tuple(o1.shape)} "
          f"[{where}, {ms:.1f} ms]")


def run_demo(force_cpu: bool = False) -> int:
    xp = _backend(force_cpu)
    if xp is None:
        where = "NumPy float64 reference path"
    else:
        from .cli import gpu_info

        name, arch = gpu_info()
        where = f"CUDA on {name} ({arch})"
    print(f"mate_cupy demo: running on the {where}")
    rng = np.random.default_rng(0)
    status = 0
    for title, fn in (("MSA", _msa_demo), ("KDA", _kda_demo)):
        print(title)
        try:
            fn(xp, rng, "GPU" if xp is not None else "CPU reference")
        except NotImplementedError as e:
            print(f"  not available on this path yet: {e}")
        except Exception as e:  # report and continue with the next family
            print(f"  FAILED: {type(e).__name__}: {e}")
            status = 1
    return status
