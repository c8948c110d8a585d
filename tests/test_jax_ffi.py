"""The XLA FFI targets on CPU: every op under ``jax.jit`` equals the eager NumPy call.

The CPU targets run the same ctypes handler as the CUDA ones (call-frame parsing,
attributes, operands, results, aliasing, errors), with the float64 references writing into
XLA's result buffers; so each jitted result must equal the eager NumPy result bit for bit.
"""
from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from msa_cases import BF16, make_problem, random_selection  # noqa: E402
from test_kda_reference import kda_inputs  # noqa: E402

import mate_cupy as mc  # noqa: E402
from mate_cupy.integrations import jax_ffi as jf  # noqa: E402

F32 = np.dtype(np.float32)


def _cpu(x):
    return None if x is None else jax.device_put(x, jax.devices("cpu")[0])


def _enable_x64():
    """int64 JAX arrays (query positions): ``jax.enable_x64`` where it exists, else the experimental one."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64

    return enable_x64()


def _same(jitted, eager):
    assert np.asarray(jitted).dtype == np.asarray(eager).dtype
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(eager))


def test_cast(rng):
    x = (rng.standard_normal((33, 70)) * 40).astype(np.float32)
    for dst, scale in (("bfloat16", 1.0), ("float8_e4m3fn", 0.5), ("float16", 3.0)):
        got = jax.jit(lambda a, d=dst, s=scale: jf.cast(a, d, s))(_cpu(x))
        _same(got, mc.cast(x, dst, scale))
    xb = x.astype(BF16)
    _same(jax.jit(lambda a: jf.cast(a, jnp.float32))(_cpu(xb)), mc.cast(xb, "float32"))


def test_sparse_topk_select(rng):
    scores = rng.standard_normal((20, 4, 37)).astype(np.float32)
    f = jax.jit(lambda s: jf.sparse_topk_select(s, 8, num_valid_pages=30, force_begin_blocks=1,
                                                force_end_blocks=2))
    _same(f(_cpu(scores)), mc.sparse_topk_select(scores, 8, num_valid_pages=30, force_begin_blocks=1,
                                                   force_end_blocks=2))
    pos = rng.integers(0, 37 * 128, 20).astype(np.int64)
    with _enable_x64():
        g = jax.jit(lambda s, p: jf.sparse_topk_select(s, 4, force_blocks_count_in_topk=False, force_end_blocks=1,
                                                       query_positions=p))
        got = g(_cpu(scores), _cpu(pos))
    _same(got, mc.sparse_topk_select(scores, 4, force_blocks_count_in_topk=False, force_end_blocks=1,
                                     query_positions=pos))


def test_msa_dense_eager_and_mixed_plans(rng):
    p = make_problem(rng, [3, 200, 5], [300, 200, 40], 8, 2, 64)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 2, output_maxscore=True, device="cpu")
    assert info[0]  # decode requests first, then a prefill request: two plans, two handles
    f = jax.jit(lambda q, k, v: jf.msa(q, k, v, info, sm_scale=0.11, return_lse=True))
    out, ms, lse = f(_cpu(p.q), _cpu(p.k), _cpu(p.v))
    lse_ref = np.empty((p.total_q, 8), np.float32)
    out_ref, ms_ref = mc.msa(p.q, p.k, p.v, info, sm_scale=0.11, lse=lse_ref)
    _same(out, out_ref)
    _same(ms, ms_ref)
    _same(lse, lse_ref)
    g = jax.jit(lambda q, k, v, off: jf.msa(q, k, v, info, q_offset_override=off, output_maxscore=False))
    off = np.array([10, 0, 7], np.int32)
    out2, none = g(_cpu(p.q), _cpu(p.k), _cpu(p.v), _cpu(off))
    assert none is None
    _same(out2, mc.msa(p.q, p.k, p.v, info, q_offset_override=off, output_maxscore=False)[0])


def test_msa_paged_static_plan_with_runtime_metadata(rng):
    p = make_problem(rng, [1, 1, 1], [130, 1, 256], 8, 1, 64, page_size=128)
    info = mc.msa_plan(3, 1, 256, 8, num_kv_heads=1, page_size=128, total_seqlen_k=1024)
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    cu = lambda x: i32(np.concatenate([[0], np.cumsum(x)]))  # noqa: E731
    host = dict(qo_lens=i32(p.qo), kv_lens=i32(p.kv), qo_offset=i32(p.kv - p.qo), cu_seqlens_q=cu(p.qo),
                cu_seqlens_k=cu(p.kv), seqused_k=i32(p.kv), kv_page_indptr=cu(-(-p.kv // 128)))

    def layer(q, k, v, idx, md):
        return jf.msa(q, k, v, info, kv_indices=idx, runtime_metadata=mc.MsaRuntimeMetadata(**md))[0]

    got = jax.jit(layer)(_cpu(p.q), _cpu(p.k_cache), _cpu(p.v_cache), _cpu(p.kv_indices),
                         {n: _cpu(a) for n, a in host.items()})
    ref, _ = mc.msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices,
                    runtime_metadata=mc.MsaRuntimeMetadata(**host))
    _same(got, ref)


def test_sparse_msa_and_sparse_decode(rng):
    p = make_problem(rng, [40, 70], [300, 500], 8, 1, 128, page_size=128)
    info = mc.sparse_msa_plan(p.qo, p.kv, 8, 1, page_size=128, kv_block_num=4, force_begin_blocks=1, device="cpu")
    sel = random_selection(rng, p, 4)
    f = jax.jit(lambda q, k, v, idx, s: jf.sparse_msa(q, k, v, info, kv_indices=idx, kv_block_indexes=s,
                                                      output_maxscore=True, return_lse=True))
    out, ms, lse = f(*map(_cpu, (p.q, p.k_cache, p.v_cache, p.kv_indices, sel)))
    lse_ref = np.empty((p.total_q, 8), np.float32)
    out_ref, ms_ref = mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices,
                                    kv_block_indexes=sel, output_maxscore=True, lse=lse_ref)
    _same(out, out_ref)
    _same(ms, ms_ref)
    _same(lse, lse_ref)

    d = make_problem(rng, [1, 4, 1], [129, 700, 1], 16, 2, 128, page_size=128)
    dinfo = mc.msa_plan_from_lengths(d.qo, d.kv, 16, 2, page_size=128, kv_block_num=8, device="cpu")
    dsel = random_selection(rng, d, 8)
    g = jax.jit(lambda q, k, v, t, s: jf.sparse_decode_atten_func(q, k, v, dinfo, page_table=t, kv_block_indexes=s,
                                                                  return_softmax_lse=True))
    out, lse = g(*map(_cpu, (d.q, d.k_cache, d.v_cache, d.page_table, dsel)))
    out_ref, lse_ref = mc.sparse_decode_atten_func(d.q, d.k_cache, d.v_cache, dinfo, page_table=d.page_table,
                                                   kv_block_indexes=dsel, return_softmax_lse=True)
    _same(out, out_ref)
    _same(lse, lse_ref)


def test_sparse_attention_pipeline_eager_plan(rng):
    from test_msa_pipeline import index_branch

    p = make_problem(rng, [1, 2, 300], [300, 129, 900], 16, 2, 128, page_size=128)
    iq, _, icache = index_branch(rng, p)
    kw = dict(topk=4, force_begin_blocks=1, force_end_blocks=1, device="cpu")
    plan = mc.sparse_pipeline_plan(p.qo, p.kv, 16, 2, max_score_bytes=128 * 8 * 2 * 4, **kw)  # 3 windows
    assert len(plan.windows) == 3
    lse_ref = np.empty((p.total_q, 16), np.float32)
    out_ref = mc.sparse_attention_pipeline(p.q, p.k_cache, p.v_cache, iq, icache, plan, kv_indices=p.kv_indices,
                                           lse=lse_ref)
    with _enable_x64():
        f = jax.jit(lambda q, k, v, a, b, idx: jf.sparse_attention_pipeline(q, k, v, a, b, plan, kv_indices=idx,
                                                                            return_lse=True))
        out, lse = f(*map(_cpu, (p.q, p.k_cache, p.v_cache, iq, icache, p.kv_indices)))
    _same(out, out_ref)
    _same(lse, lse_ref)
    with pytest.raises(TypeError, match="jax_enable_x64"):
        jf.sparse_attention_pipeline(*map(_cpu, (p.q, p.k_cache, p.v_cache, iq, icache)), plan,
                                     kv_indices=_cpu(p.kv_indices))


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_chunk_kda(rng, varlen):
    x = kda_inputs(rng, 2, 20, 1, 2, gate_params=True, state=np.float32, lens=[7, 0, 13] if varlen else None)
    names = sorted(x)

    def layer(*arrays):
        return jf.chunk_kda(**dict(zip(names, arrays)), output_final_state=True, scale=0.07)

    out, fs = jax.jit(layer)(*(_cpu(x[n]) for n in names))
    out_ref, fs_ref = mc.chunk_kda(**x, output_final_state=True, scale=0.07)
    _same(out, out_ref)
    _same(fs, fs_ref)
    only = jax.jit(lambda *a: jf.chunk_kda(**dict(zip(names, a)), lower_bound=-2.0))(*(_cpu(x[n]) for n in names))
    _same(only, mc.chunk_kda(**x, lower_bound=-2.0))


def _decode_inputs(rng, B=3, T=2, H=1, HV=2, P=6):
    K = V = 128
    return dict(
        q=rng.standard_normal((B, T, H, K)).astype(BF16), k=rng.standard_normal((B, T, H, K)).astype(BF16),
        v=rng.standard_normal((B, T, HV, V)).astype(BF16), a=rng.standard_normal((B, T, HV, K)).astype(BF16),
        b=rng.standard_normal((B, T, HV)).astype(BF16), A_log=rng.uniform(-1, 1, HV).astype(np.float32),
        dt_bias=rng.standard_normal((HV, K)).astype(np.float32),
        state=(0.1 * rng.standard_normal((P, HV, V, K))).astype(np.float32),
        state_indices=np.array([4, -1, 1], np.int32),
    )


def test_gated_delta_rule_decode_inplace_pool_is_aliased_and_donated(rng):
    x = _decode_inputs(rng, T=1)
    pool0 = x["state"].copy()

    def step(pool, q, k, v, a, b, A_log, dt_bias, idx):
        return jf.gated_delta_rule_decode(q, k, v, pool, A_log, a, dt_bias, None, None, b, state_indices=idx,
                                          apply_beta_sigmoid=True, inplace_final_state=True)

    f = jax.jit(step, donate_argnums=0)
    assert "output_operand_alias" in f.lower(pool0, *(x[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias",
                                                                     "state_indices"))).as_text()
    pool_in = jax.jit(lambda p: p * 1)(_cpu(pool0))  # a buffer XLA owns (a device_put may borrow NumPy's)
    ptr = pool_in.unsafe_buffer_pointer()
    out, pool = f(pool_in, *(_cpu(x[n]) for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state_indices")))
    assert pool.unsafe_buffer_pointer() == ptr  # donated and aliased: updated where it lies, no copy
    ref_pool = pool0.copy()
    out_ref, same_pool = mc.gated_delta_rule_decode(x["q"], x["k"], x["v"], ref_pool, x["A_log"], x["a"],
                                                    x["dt_bias"], None, None, x["b"],
                                                    state_indices=x["state_indices"], apply_beta_sigmoid=True,
                                                    inplace_final_state=True)
    assert same_pool is ref_pool
    _same(out, out_ref)
    _same(pool, ref_pool)
    assert not np.array_equal(ref_pool[4], pool0[4]) and np.array_equal(ref_pool[0], pool0[0])


def test_gated_delta_rule_decode_store_final_state(rng):
    x = _decode_inputs(rng)
    x["state"] = x["state"].astype(BF16)
    names = ("q", "k", "v", "state", "A_log", "a", "dt_bias", "b", "state_indices")

    def step(q, k, v, state, A_log, a, dt_bias, b, idx):  # noqa: N803
        return jf.gated_delta_rule_decode(q, k, v, state, A_log, a, dt_bias, None, None, b, state_indices=idx,
                                          store_final_state=True, state_dtype="bfloat16", output_dtype="float32",
                                          use_lower_bound=True, lower_bound=-3.0)

    out, fs = jax.jit(step)(*(_cpu(x[n]) for n in names))
    out_ref, fs_ref = mc.gated_delta_rule_decode(
        x["q"], x["k"], x["v"], x["state"], x["A_log"], x["a"], x["dt_bias"], None, None, x["b"],
        state_indices=x["state_indices"], store_final_state=True, state_dtype="bfloat16",
        output=np.empty(x["v"].shape, F32), use_lower_bound=True, lower_bound=-3.0)
    _same(out, out_ref)
    _same(fs, fs_ref)


def test_errors_are_clear(rng):
    x = _decode_inputs(rng)
    q32 = x["q"].astype(np.float32)
    f = jax.jit(lambda q, k, v, a, b: jf.gated_delta_rule_decode(q, k, v, None, None, a, None, None, None, b,
                                                                 use_initial_state=False))
    with pytest.raises(Exception, match=r"mate_cupy\.gated_delta_rule_decode: NotImplementedError"):
        np.asarray(f(*(_cpu(a) for a in (q32, x["k"], x["v"], x["a"], x["b"])))[0])
    with pytest.raises(ValueError, match="topk"):
        jf.sparse_topk_select(jnp.zeros((2, 2, 8), jnp.float32), 5)
    with pytest.raises(ValueError, match=r"shape \[B, T, H, D\]"):
        jf.gated_delta_rule_decode(jnp.zeros((2, 128)), x["k"], x["v"], None, None, x["a"], None, None, None, x["b"])


def test_plan_registry_is_weak(rng):
    p = make_problem(rng, [4], [40], 4, 4, 64)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 4, 4, device="cpu")
    f = jax.jit(lambda q, k, v: jf.msa(q, k, v, info)[0])
    _same(f(_cpu(p.q), _cpu(p.k), _cpu(p.v)), mc.msa(p.q, p.k, p.v, info)[0])
    handle = jf._PLAN_HANDLES[info[3]]
    assert jf._PLANS[handle] is info[3]
    del info, f
    gc.collect()
    assert handle not in jf._PLANS  # the registry holds no reference: freed with the plan

    info = mc.msa_plan_from_lengths(p.qo, p.kv, 4, 4, device="cpu")
    g = jax.jit(lambda q, k, v: jf.msa(q, k, v, info)[0])
    compiled = g.lower(_cpu(p.q), _cpu(p.k), _cpu(p.v)).compile()
    del info, g
    gc.collect()
    with pytest.raises(Exception, match="plan that has been freed"):
        np.asarray(compiled(_cpu(p.q), _cpu(p.k), _cpu(p.v)))


def test_import_without_jax_is_a_clear_error():
    code = ("import sys; sys.modules['jax'] = None\n"
            "try:\n    import mate_cupy.integrations.jax_ffi\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "needs JAX" in out


# ----------------------------------------------------------------------------- CUDA handler, stub device
# The CUDA handler run on a call frame built over NumPy memory in XLA's C layout
# (bench/framework_overhead.py SyntheticFrame) with the stub device of bench/host_overhead.py:
# device queries, module loading and cuLaunchKernel replaced, every launch recorded.


def _bench():
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench import framework_overhead as fo
    from bench import host_overhead as ho

    return fo, ho


@pytest.fixture
def stub_cuda(monkeypatch):
    """The stub device (bench/host_overhead.py) for the CUDA handler: XLA buffers on device 0
    over host memory; CuPy's device scopes are no-ops and its current stream is XLA's."""
    pytest.importorskip("cupy")
    pytest.importorskip("torch")
    from mate_cupy.kda import decode
    from mate_cupy.runtime.memo import BoundedMemo

    fo, ho = _bench()
    rec = ho.install_stub_device(monkeypatch.setattr)
    fo.install_stub_jax(monkeypatch.setattr)
    monkeypatch.setattr(jf, "PREPARED_CALLS", BoundedMemo(256))
    monkeypatch.setattr(decode, "_PREPARED", BoundedMemo(256))
    monkeypatch.setattr(decode, "_PROBLEMS", BoundedMemo(256))
    return rec


def _decode_frame(x, **options):
    return _bench()[0].decode_frame(x, **options)


def test_cuda_handler_prepared_call_launches_what_the_public_function_launches(stub_cuda, monkeypatch, rng):
    x = _decode_inputs(rng, T=1)
    frame = _decode_frame(x, apply_beta_sigmoid=True, lower_bound=-3.5)
    handle = lambda: jf._handle("gated_delta_rule_decode", jf._run_decode, jf._prepare_decode, True,  # noqa: E731
                                frame.address)
    miss = stub_cuda.record(handle)  # validates, prepares, launches the prepared launch
    assert len(jf.PREPARED_CALLS) == 1
    hit = stub_cuda.record(handle)  # the prepared launch only
    assert not frame.errors
    assert miss and hit == miss and all(r[4] == _bench()[1].STUB_STREAM for r in hit)
    # The public function on the same buffers (the unprepared launcher, CuPy's stream = XLA's).
    args, rets, attrs, _ = _frame_buffers(frame)
    plain = stub_cuda.record(lambda: jf._run_decode(args, rets, attrs, True))
    assert plain == miss


def test_cuda_handler_refusals_are_not_stored_and_the_memo_is_bounded(stub_cuda, monkeypatch, rng):
    from mate_cupy.runtime.memo import BoundedMemo

    x = _decode_inputs(rng, T=1)
    bad = _decode_frame({**x, "q": x["q"].astype(np.float32)})  # q must be fp16/bf16
    for _ in range(2):  # refused every time, before any launch, nothing stored
        assert stub_cuda.record(lambda: jf._handle("gated_delta_rule_decode", jf._run_decode,
                                                       jf._prepare_decode, True, bad.address)) == []
        assert len(jf.PREPARED_CALLS) == 0
    assert len(bad.errors) == 2 and bad.errors[0][0] == jf._ERR_UNIMPLEMENTED
    assert bad.errors[0][1].startswith("mate_cupy.gated_delta_rule_decode: NotImplementedError")

    monkeypatch.setattr(jf, "PREPARED_CALLS", BoundedMemo(2))
    for scale in (0.1, 0.2, 0.3):  # three static descriptions, three keys
        f = _decode_frame(x, scale=scale)
        jf._handle("gated_delta_rule_decode", jf._run_decode, jf._prepare_decode, True, f.address)
        assert not f.errors
    assert len(jf.PREPARED_CALLS) == 2


def _frame_buffers(frame):
    import ctypes

    head = jf._FRAME.unpack(ctypes.string_at(frame.address, jf._FRAME.size))
    operands, results, attrs = jf._decode_spec(jf._spec_bytes(head))
    dev = (jf._dl.KDL_CUDA, 0)
    return (jf._buffers(head[jf._F_ARGS], head[jf._F_ARG_ITEMS], operands, dev, "operands"),
            jf._buffers(head[jf._F_RETS], head[jf._F_RET_ITEMS], results, dev, "results"), attrs,
            [o[0] for o in operands] + [r[0] for r in results])


@pytest.mark.parametrize("store_final_state", [False, True])
def test_cuda_handler_prepares_only_calls_that_allocate_nothing(stub_cuda, monkeypatch, rng, store_final_state):
    x = _decode_inputs(rng, T=1)
    fo, ho = _bench()
    spec, operands, results, _ = fo.staged_spec(jf.gated_delta_rule_decode, *(x[n] for n in (
        "q", "k", "v", "state", "A_log", "a", "dt_bias")), None, None, x["b"], state_indices=x["state_indices"],
        store_final_state=store_final_state)
    arrays = {**x, "output": np.zeros(x["v"].shape, BF16), "final_state": np.zeros((3, 2, 128, 128), np.float32)}
    frame = fo.SyntheticFrame([x[n] for n in operands], [arrays[n] for n in results], spec, ho.STUB_STREAM)
    prepared = jf._prepare_decode(*_frame_buffers(frame))
    if store_final_state:  # the public function allocates the final state: the validated path every time
        assert prepared is None
        return
    handle = lambda: jf._handle("gated_delta_rule_decode", jf._run_decode, jf._prepare_decode, True,  # noqa: E731
                                frame.address)
    miss, hit = stub_cuda.record(handle), stub_cuda.record(handle)
    assert not frame.errors and miss and hit == miss
    assert len(jf.PREPARED_CALLS) == 1  # the pool only read, the output XLA's


def _msa_stub_case(static: bool):
    """An MSA paged decode on the stub device (bench/host_overhead.py shapes, B1 8192 keys):
    ``(plan, operands by name for jf.msa, its keyword arguments)`` as NumPy arrays."""
    fo, ho = _bench()
    L, page, hq, hkv, d = 8192, 64, 8, 1, 128  # noqa: N806
    n_pages = L // page
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, hq, d)).astype(BF16)
    kc = np.zeros((n_pages, page, hkv, d), BF16)
    kv_indices = rng.permutation(n_pages).astype(np.int32)
    if static:
        plan = mc.msa_plan(1, 1, L, hq, total_seqlen_k=L, num_kv_heads=hkv, page_size=page)
        one, kv = np.ones(1, np.int32), np.full(1, L, np.int32)
        md = mc.MsaRuntimeMetadata(qo_lens=one, kv_lens=kv, qo_offset=kv - one,
                                   cu_seqlens_q=np.array([0, 1], np.int32), cu_seqlens_k=np.array([0, L], np.int32),
                                   seqused_k=kv.copy(), kv_page_indptr=np.array([0, n_pages], np.int32))
    else:
        plan = mc.msa_plan_from_lengths(np.ones(1, np.int32), np.full(1, L, np.int32), hq, hkv, page_size=page)
        md = None
    ho.stub_upload(plan)
    return plan, (q, kc, kc.copy()), dict(kv_indices=kv_indices, runtime_metadata=md)


@pytest.mark.parametrize("static", [True, False])
def test_cuda_handler_prepared_msa_launches_what_the_public_function_launches(stub_cuda, static):
    fo, ho = _bench()
    plan, qkv, kw = _msa_stub_case(static)
    frame = fo.msa_frame(*qkv, plan, **kw)
    handle = lambda: jf._handle("msa", jf._run_msa, jf._prepare_msa, True, frame.address)  # noqa: E731
    miss = stub_cuda.record(handle)
    hit = stub_cuda.record(handle)
    assert not frame.errors, frame.errors
    entries = list(jf.PREPARED_CALLS._items.values())
    assert len(entries) == 1 and isinstance(entries[0], jf.PreparedPlanCall)
    assert miss and hit == miss and all(r[4] == ho.STUB_STREAM for r in hit)
    args, rets, attrs, _ = _frame_buffers(frame)
    assert stub_cuda.record(lambda: jf._run_msa(args, rets, attrs, True)) == miss
    # the plan drops its prepared calls (as on a new upload): the next execution prepares again
    from mate_cupy.msa.plan import unpack_plan_info

    held = unpack_plan_info(plan)[3].prepared_calls
    held.clear()
    assert stub_cuda.record(handle) == miss and len(held) == 1
