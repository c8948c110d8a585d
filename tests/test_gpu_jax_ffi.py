"""The XLA FFI targets on a GPU: every op under ``jax.jit`` on JAX CUDA arrays.

Each jitted result is compared with the eager call of the same public function on the same
JAX CUDA arrays (the same kernels, on CuPy's stream) and with the eager NumPy call (the
float64 reference). Outputs are XLA's buffers; the state pool is donated and updated in
place.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for CuPy's pool (plans, scratch)
jax = pytest.importorskip("jax")
from helpers import assert_rel  # noqa: E402
from msa_cases import BF16, make_problem, random_selection  # noqa: E402
from test_kda_reference import kda_inputs  # noqa: E402

import mate_cupy as mc  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def jf():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip("JAX sees no GPU")
    from mate_cupy.integrations import jax_ffi

    return jax_ffi


def _gpu(x):
    return None if x is None else jax.device_put(x, jax.devices("gpu")[0])


def _close(jitted, eager, reference, tol, what):
    """jit == eager on the GPU (same kernels, tight), and both near the float64 reference."""
    assert isinstance(jitted, jax.Array) and jitted.devices() == {jax.devices("gpu")[0]}
    assert np.asarray(jitted).dtype == np.asarray(reference).dtype
    assert_rel(np.asarray(jitted), np.asarray(eager), 1e-6, f"{what} jit vs eager")
    assert_rel(np.asarray(jitted), np.asarray(reference), tol, f"{what} jit vs reference")


def test_cast_and_topk(jf, rng):
    x = (rng.standard_normal((1000, 130)) * 40).astype(np.float32)
    for dst in ("bfloat16", "float8_e4m3fn"):
        got = jax.jit(lambda a, d=dst: jf.cast(a, d, 0.5))(_gpu(x))
        np.testing.assert_array_equal(np.asarray(got), mc.cast(x, dst, 0.5))
    scores = rng.standard_normal((64, 8, 1000)).astype(np.float32)
    got = jax.jit(lambda s: jf.sparse_topk_select(s, 16, force_begin_blocks=1))(_gpu(scores))
    np.testing.assert_array_equal(np.asarray(got), mc.sparse_topk_select(scores, 16, force_begin_blocks=1))


def test_msa_dense_and_paged(jf, rng):
    p = make_problem(rng, [3, 200], [300, 200], 16, 2, 128)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 16, 2, output_maxscore=True, device=0)
    mc.upload_plan(info, device=0, head_dim=128, dtype=BF16)
    q, k, v = _gpu(p.q), _gpu(p.k), _gpu(p.v)
    out, ms, lse = jax.jit(lambda q, k, v: jf.msa(q, k, v, info, return_lse=True))(q, k, v)
    eager, eager_ms = mc.msa(q, k, v, info)
    host_info = mc.msa_plan_from_lengths(p.qo, p.kv, 16, 2, output_maxscore=True, device="cpu")
    lse_ref = np.empty((p.total_q, 16), np.float32)
    ref, ref_ms = mc.msa(p.q, p.k, p.v, host_info, lse=lse_ref)
    _close(out, eager, ref, 8e-3, "dense out")
    _close(ms, eager_ms, ref_ms, 1e-5, "dense max score")
    assert_rel(np.asarray(lse), lse_ref, 1e-5, "dense lse")

    pp = make_problem(rng, [1] * 4, [1000, 37, 4096, 129], 16, 2, 128, page_size=64)
    pinfo = mc.msa_plan_from_lengths(pp.qo, pp.kv, 16, 2, page_size=64, device=0)
    mc.upload_plan(pinfo, device=0, head_dim=128, dtype=BF16)
    args = tuple(map(_gpu, (pp.q, pp.k_cache, pp.v_cache, pp.kv_indices)))
    out = jax.jit(lambda q, k, v, i: jf.msa(q, k, v, pinfo, kv_indices=i)[0])(*args)
    eager = mc.msa(*args[:3], pinfo, kv_indices=args[3])[0]
    ref = mc.msa(pp.q, pp.k_cache, pp.v_cache, mc.msa_plan_from_lengths(pp.qo, pp.kv, 16, 2, page_size=64,
                                                                         device="cpu"), kv_indices=pp.kv_indices)[0]
    _close(out, eager, ref, 8e-3, "paged out")


def test_sparse_msa_and_decode(jf, rng):
    p = make_problem(rng, [300], [1500], 16, 1, 128, page_size=128)
    kw = dict(page_size=128, kv_block_num=16)
    info = mc.sparse_msa_plan(p.qo, p.kv, 16, 1, device=0, **kw)
    mc.upload_plan(info, device=0, head_dim=128, dtype=BF16)
    sel = random_selection(rng, p, 16)
    args = tuple(map(_gpu, (p.q, p.k_cache, p.v_cache, p.kv_indices, sel)))
    out = jax.jit(lambda q, k, v, i, s: jf.sparse_msa(q, k, v, info, kv_indices=i, kv_block_indexes=s)[0])(*args)
    eager = mc.sparse_msa(*args[:3], info, kv_indices=args[3], kv_block_indexes=args[4])[0]
    ref = mc.sparse_msa(p.q, p.k_cache, p.v_cache, mc.sparse_msa_plan(p.qo, p.kv, 16, 1, device="cpu", **kw),
                        kv_indices=p.kv_indices, kv_block_indexes=sel)[0]
    _close(out, eager, ref, 8e-3, "sparse prefill")

    d = make_problem(rng, [1] * 3, [5000, 129, 7000], 16, 2, 128, page_size=128)
    dinfo = mc.msa_plan_from_lengths(d.qo, d.kv, 16, 2, device=0, **kw)
    mc.upload_plan(dinfo, device=0, head_dim=128, dtype=BF16)
    dsel = random_selection(rng, d, 16)
    args = tuple(map(_gpu, (d.q, d.k_cache, d.v_cache, d.page_table, dsel)))
    out = jax.jit(lambda q, k, v, t, s: jf.sparse_decode_atten_func(q, k, v, dinfo, page_table=t,
                                                                    kv_block_indexes=s))(*args)
    eager = mc.sparse_decode_atten_func(*args[:3], dinfo, page_table=args[3], kv_block_indexes=args[4])
    ref = mc.sparse_decode_atten_func(d.q, d.k_cache, d.v_cache,
                                      mc.msa_plan_from_lengths(d.qo, d.kv, 16, 2, device="cpu", **kw),
                                      page_table=d.page_table, kv_block_indexes=dsel)
    _close(out, eager, ref, 8e-3, "sparse decode")


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_chunk_kda(jf, rng, varlen):
    x = kda_inputs(rng, 2, 150, 2, 4, gate_params=True, state=np.float32, lens=[70, 0, 230] if varlen else None)
    names = sorted(x)
    dev = [_gpu(x[n]) for n in names]
    out, fs = jax.jit(lambda *a: jf.chunk_kda(**dict(zip(names, a)), output_final_state=True))(*dev)
    eager, eager_fs = mc.chunk_kda(**dict(zip(names, dev)), output_final_state=True)
    ref, ref_fs = mc.chunk_kda(**x, output_final_state=True)
    _close(out, eager, ref, 2e-2, "chunk output")
    _close(fs, eager_fs, ref_fs, 2e-2, "chunk final state")


def test_gated_delta_rule_decode_inplace_pool_under_jit(jf, rng):
    B, H, HV, K = 8, 2, 4, 128
    r = lambda *s: rng.standard_normal(s).astype(BF16)  # noqa: E731
    q, k, v, a, b = r(B, 1, H, K), r(B, 1, H, K), r(B, 1, HV, K), r(B, 1, HV, K), r(B, 1, HV)
    A_log = rng.uniform(-1, 1, HV).astype(np.float32)
    pool0 = (0.05 * rng.standard_normal((16, HV, K, K))).astype(np.float32)
    idx = rng.permutation(16)[:B].astype(np.int32)
    idx[3] = -1  # padding

    def step(pool, q, k, v, a, b, A_log, idx):  # noqa: N803
        return jf.gated_delta_rule_decode(q, k, v, pool, A_log, a, None, None, None, b, state_indices=idx,
                                          inplace_final_state=True)

    f = jax.jit(step, donate_argnums=0)
    pool_in = _gpu(pool0)
    ptr = pool_in.unsafe_buffer_pointer()
    dev = tuple(map(_gpu, (q, k, v, a, b, A_log, idx)))
    out, pool = f(pool_in, *dev)
    assert pool.unsafe_buffer_pointer() == ptr
    eager_pool = _gpu(pool0)
    eager_out, _ = mc.gated_delta_rule_decode(*dev[:3], eager_pool, dev[5], dev[3], None, None, None, dev[4],
                                              state_indices=dev[6], inplace_final_state=True)
    ref_pool = pool0.copy()
    ref_out, _ = mc.gated_delta_rule_decode(q, k, v, ref_pool, A_log, a, None, None, None, b, state_indices=idx,
                                            inplace_final_state=True)
    _close(out, eager_out, ref_out, 1e-2, "decode output")
    _close(pool, eager_pool, ref_pool, 1e-3, "decode pool")
    # a second step on the returned pool, stored as a new final state as well
    g = jax.jit(lambda pool, q, k, v, a, b, A_log, idx: jf.gated_delta_rule_decode(  # noqa: N803
        q, k, v, pool, A_log, a, None, None, None, b, state_indices=idx, store_final_state=True))
    out2, fs = g(pool, *dev)
    ref_out2, ref_fs = mc.gated_delta_rule_decode(q, k, v, ref_pool, A_log, a, None, None, None, b,
                                                  state_indices=idx, store_final_state=True)
    assert_rel(np.asarray(out2), ref_out2, 1e-2, "second step output")
    assert_rel(np.asarray(fs)[idx >= 0], ref_fs[idx >= 0], 1e-3, "second step final state")


def test_gated_delta_rule_decode_steps_run_the_prepared_launch(jf, rng):
    """Jitted decode steps on fresh inputs (new buffers every step, one static description):
    the first execution validates and prepares, the others run the prepared launch
    (``jax_ffi.PREPARED_CALLS``); every step equals the float64 reference chain."""
    B, H, HV, K = 4, 2, 4, 128
    A_log = rng.uniform(-1, 1, HV).astype(np.float32)
    ref_pool = (0.05 * rng.standard_normal((8, HV, K, K))).astype(np.float32)
    idx = np.array([5, 0, -1, 2], np.int32)

    def step(pool, q, k, v, a, b, A_log, idx):  # noqa: N803
        return jf.gated_delta_rule_decode(q, k, v, pool, A_log, a, None, None, None, b, state_indices=idx,
                                          use_lower_bound=True, apply_beta_sigmoid=True, inplace_final_state=True)

    f = jax.jit(step, donate_argnums=0)
    jf.PREPARED_CALLS.clear()
    pool = _gpu(ref_pool)
    for it in range(4):
        r = lambda *s: rng.standard_normal(s).astype(BF16)  # noqa: E731
        q, k, v, a, b = r(B, 1, H, K), r(B, 1, H, K), r(B, 1, HV, K), r(B, 1, HV, K), r(B, 1, HV)
        out, pool = f(pool, *map(_gpu, (q, k, v, a, b, A_log, idx)))
        ref_out, _ = mc.gated_delta_rule_decode(q, k, v, ref_pool, A_log, a, None, None, None, b, state_indices=idx,
                                                use_lower_bound=True, apply_beta_sigmoid=True,
                                                inplace_final_state=True)
        assert_rel(np.asarray(out), ref_out, 1e-2, f"step {it} output")
        assert_rel(np.asarray(pool), ref_pool, 1e-3, f"step {it} pool")
    entries = list(jf.PREPARED_CALLS._items.values())
    assert len(entries) == 1 and isinstance(entries[0], jf.PreparedFfiCall)


def test_msa_static_plan_steps_run_the_prepared_launches(jf, rng):
    """Jitted paged decode steps with a static plan and new runtime metadata each step: the
    first execution validates and prepares (the launches held by the plan), the others run
    them; every step equals the float64 reference of its own lengths."""
    n_pages = 96
    info = mc.msa_plan(3, 1, 4096, 8, num_kv_heads=2, page_size=64, total_seqlen_k=n_pages * 64)
    mc.upload_plan(info, device=0, head_dim=128, dtype=jax.numpy.bfloat16)

    @jax.jit
    def attend(q, k, v, idx, qo, kv, off, cu_q, cu_k, used, indptr):
        md = mc.MsaRuntimeMetadata(qo, kv, off, cu_q, cu_k, used, kv_page_indptr=indptr)
        return jf.msa(q, k, v, info, kv_indices=idx, runtime_metadata=md)[0]

    jf.PREPARED_CALLS.clear()
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    cu = lambda x: i32(np.concatenate([[0], np.cumsum(x)]))  # noqa: E731
    for kv in ([1000, 37, 4096], [4096, 1000, 64], [2048, 2048, 1025]):  # 81 pages each: one trace
        p = make_problem(rng, [1, 1, 1], kv, 8, 2, 128, page_size=64, extra_pages=n_pages - 81)
        idx = p.kv_indices
        host = dict(qo_lens=i32(p.qo), kv_lens=i32(p.kv), qo_offset=i32(p.kv - p.qo), cu_seqlens_q=cu(p.qo),
                    cu_seqlens_k=cu(p.kv), seqused_k=i32(p.kv), kv_page_indptr=cu(-(-p.kv // 64)))
        got = attend(*map(_gpu, (p.q, p.k_cache, p.v_cache, idx)), *(_gpu(host[f]) for f in (
            "qo_lens", "kv_lens", "qo_offset", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "kv_page_indptr")))
        ref, _ = mc.msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices,
                        runtime_metadata=mc.MsaRuntimeMetadata(**host))
        assert_rel(np.asarray(got), ref, 2e-2, f"kv lens {kv}")
    entries = list(jf.PREPARED_CALLS._items.values())
    assert len(entries) == 1 and isinstance(entries[0], jf.PreparedPlanCall)
