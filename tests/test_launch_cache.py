"""Replayed launches (``mate_cupy._launch_cache``) against the full path, on the CPU.

``bench.host_overhead_cpu.FakeCuda`` replaces the device: fake torch CUDA tensors (metadata
and an address), CuPy arrays over invented addresses, kernels that log the bytes of every
kernel parameter. Each case calls an op twice with fresh inputs of one signature (the
second call replays) and once more with replay off; the replayed launches must equal the
full path's byte for byte once addresses are named (input name, result, or scratch in
order of appearance). Calls that must not replay (staging copies, device work outside
the recorded launches, changed knobs) are checked to take the full path.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch = pytest.importorskip("torch")

import mate_cupy as mc  # noqa: E402
from mate_cupy import _launch_cache as lc  # noqa: E402

pytestmark = pytest.mark.torch

BF16, F16, F32, I32, I64 = torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64


@pytest.fixture
def fc(monkeypatch):
    from bench.host_overhead_cpu import FakeCuda

    was = lc.ENABLED
    lc.set_enabled(True)
    with FakeCuda() as f:
        f.replays = 0
        real = lc.replay

        def counting(recipe, ptrs, first):
            f.replays += 1
            return real(recipe, ptrs, first)

        monkeypatch.setattr(lc, "replay", counting)
        yield f
    lc.set_enabled(was)


def _flatten(obj, out):
    if isinstance(obj, (tuple, list)):
        for o in obj:
            _flatten(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _flatten(o, out)
    elif hasattr(obj, "qo_lens") and hasattr(obj, "seqused_k"):  # MsaRuntimeMetadata
        for name in ("qo_lens", "kv_lens", "qo_offset", "cu_seqlens_q", "cu_seqlens_k", "seqused_k",
                     "page_table", "kv_page_indptr"):
            _flatten(getattr(obj, name), out)
    elif obj is not None and (hasattr(obj, "data_ptr") or hasattr(obj, "data")):
        out.append(obj)


def _ptr(x):
    return x.data_ptr() if hasattr(x, "data_ptr") else x.data.ptr


def _named(fc, log, inputs, result):
    """Launch log with every device address replaced by a name."""
    names = {}
    arrays = []
    _flatten(inputs, arrays)
    for i, a in enumerate(arrays):
        names.setdefault(_ptr(a), f"in{i}")
    res = []
    _flatten(result, res)
    for i, a in enumerate(res):
        names.setdefault(_ptr(a), f"out{i}")
    anon = {}
    lo, hi = 0x7F00_0000_0000, fc.addr.next
    named = []
    for name, grid, block, smem, params in log:
        ps = []
        for b in params:
            v = int.from_bytes(b, "little") if len(b) == 8 else None
            if v is not None and lo <= v < hi:
                if v in names:
                    ps.append(names[v])
                else:
                    ps.append(anon.setdefault(v, f"anon{len(anon)}"))
            else:
                ps.append(b)
        named.append((name, grid, block, smem, tuple(ps)))
    return named


def _result_shape(result):
    """Structure of a result: types, shapes and dtypes (allocated results differ in address only)."""
    if isinstance(result, (tuple, list)):
        return tuple(_result_shape(r) for r in result)
    if result is None:
        return None
    return (type(result).__name__, tuple(result.shape), str(result.dtype))


def check_replay(fc, fn, make, *, replays=True):
    """fn(inputs) on fresh inputs: record, replay, then the full path; compare the launches."""
    lc.clear()
    a, b = make(), make()
    fc.log.clear()
    res_a = fn(a)
    log_a = _named(fc, list(fc.log), a, res_a)
    before = fc.replays
    fc.log.clear()
    res_b = fn(b)
    log_b = _named(fc, list(fc.log), b, res_b)
    assert fc.replays - before == (1 if replays else 0)
    lc.set_enabled(False)
    try:
        fc.log.clear()
        res_full = fn(b)
        log_full = _named(fc, list(fc.log), b, res_full)
    finally:
        lc.set_enabled(True)
    assert log_b == log_full
    assert log_a == log_full
    assert _result_shape(res_b) == _result_shape(res_full)
    return log_full, res_b


# ----------------------------------------------------------------------------- KDA decode

DEC = dict(B=6, T=1, H=2, HV=4, K=128, V=128)


def decode_maker(fc, *, T=1, varlen=False, v_first=True, state_dtype=F32, slots="1d", accepted=False,
                 out=True, dt_bias=F32, a_log=True, per_channel=False, dtype=BF16, state=True, cupy_first=False,
                 opts=None):
    B, H, HV, K, V = DEC["B"], DEC["H"], DEC["HV"], DEC["K"], DEC["V"]
    N = B
    if varlen:
        B, N = 1, 3
    P = N * max(T, 2) + 3

    def arr(shape, dt):
        if cupy_first:
            return fc.cupy(shape, {BF16: torch_np("bfloat16"), F16: np.float16, F32: np.float32, I32: np.int32,
                                   I64: np.int64}[dt])
        return fc.tensor(shape, dt)

    def make():
        x = dict(q=arr((B, T, H, K), dtype), k=arr((B, T, H, K), dtype), v=arr((B, T, HV, V), dtype),
                 a=arr((B, T, HV, K), dtype), b=arr((B, T, HV, V) if per_channel else (B, T, HV), dtype),
                 A_log=arr((HV,), F32) if a_log else None, dt_bias=arr((HV, K), dt_bias) if dt_bias else None,
                 state=(arr((P, HV, V, K) if v_first else (P, HV, K, V), state_dtype) if state else None),
                 cu_seqlens=arr((N + 1,), I32) if varlen else None,
                 state_indices=(None if slots == "none" else arr((N,), I32) if slots == "1d" else arr((N, T), I64)),
                 num_accepted_tokens=arr((N,), I32) if accepted else None,
                 output=arr((B, T, HV, V), dtype) if out else None)
        return x

    kw = dict(state_v_first=v_first, use_lower_bound=True, apply_beta_sigmoid=True,
              inplace_final_state=state and slots != "none" and (T == 1 or slots == "2d"),
              state_dtype=None if state else "bfloat16", use_initial_state=state)
    kw.update(opts or {})

    def fn(x):
        return mc.gated_delta_rule_decode(x["q"], x["k"], x["v"], x["state"], x["A_log"], x["a"], x["dt_bias"],
                                          x["num_accepted_tokens"], x["cu_seqlens"], x["b"],
                                          state_indices=x["state_indices"], output=x["output"], **kw)

    return fn, make


def torch_np(name):
    from mate_cupy._interop import as_dtype

    return as_dtype(name)


DECODE_CASES = {
    "inplace_prealloc": {},
    "alloc_output": dict(out=False),
    "kfirst_bf16_state": dict(v_first=False, state_dtype=BF16),
    "multi_token_2d_slots": dict(T=3, slots="2d"),
    "speculative": dict(T=3, slots="2d", accepted=True),
    "varlen": dict(varlen=True, T=4, slots="2d"),
    "dt_bias_bf16": dict(dt_bias=BF16),
    "no_gate_params": dict(dt_bias=None, a_log=False),
    "beta_per_channel_f16": dict(per_channel=True, dtype=F16),
    "store_final": dict(slots="none", opts=dict(store_final_state=True, inplace_final_state=False)),
    "no_state_bf16_scratch": dict(state=False, slots="none"),
    "cupy_arrays": dict(cupy_first=True),
    "scale_and_bound": dict(opts=dict(scale=0.25, lower_bound=-3.0, use_qk_l2norm=False)),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_replay_matches_full_path(fc, name):
    fn, make = decode_maker(fc, **DECODE_CASES[name])
    log, res = check_replay(fc, fn, make)
    assert len(log) == 1


def test_decode_replay_returns_the_callers_objects(fc):
    fn, make = decode_maker(fc)
    fn(make())
    x = make()
    out, final = fn(x)
    assert fc.replays == 1 and out is x["output"] and final is x["state"]


def test_decode_packed_projection_views_replay(fc):
    """q/k/v as views of one fused projection (strided, last dim contiguous): no copy, replayed."""
    fn, make = decode_maker(fc, T=2, slots="2d")
    B, T, H, HV, K = 6, 2, 2, 4, 128
    row = (2 * H + HV) * K

    def packed():
        x = make()
        base = fc.tensor((B, T, row), BF16).data_ptr()
        st = (T * row, row, K, 1)
        x["q"] = FakeTensor((B, T, H, K), BF16, base, stride=st)
        x["k"] = FakeTensor((B, T, H, K), BF16, base + 2 * H * K, stride=st)
        x["v"] = FakeTensor((B, T, HV, K), BF16, base + 4 * H * K, stride=st)
        return x

    from bench.host_overhead_cpu import FakeTensor

    log, _ = check_replay(fc, fn, packed)
    assert len(log) == 1
    strides = [int.from_bytes(b, "little") for b in log[0][4][14:23]]  # q, k, v (batch, token, head)
    assert strides == [T * row, row, K] * 3


def test_decode_staging_is_not_replayed(fc):
    """A q whose last dim is not contiguous is copied first: such calls take the full path."""
    fn, make = decode_maker(fc)
    B, T, H, K = 6, 1, 2, 128

    def strided():
        x = make()
        x["q"] = fc.tensor((B, T, H, K), BF16, stride=(T * H * 2 * K, H * 2 * K, 2 * K, 2))
        return x

    import cupy

    calls = []
    orig = cupy.ascontiguousarray
    try:
        cupy.ascontiguousarray = lambda a, dtype=None: calls.append(a) or fc.cupy(a.shape, a.dtype)
        fn(strided())
        fn(strided())
    finally:
        cupy.ascontiguousarray = orig
    assert fc.replays == 0 and len(calls) == 2


def test_decode_misaligned_pool_still_refused(fc):
    fn, make = decode_maker(fc)
    fn(make())
    x = make()
    x["state"] = fc.tensor(tuple(x["state"].shape), F32, misalign=4)
    with pytest.raises(ValueError, match="16-byte aligned"):
        fn(x)
    assert fc.replays == 0


def test_decode_errors_are_not_cached(fc):
    fn, make = decode_maker(fc)
    x = make()
    x["a"] = fc.tensor((6, 1, 4, 64), BF16)
    for _ in range(2):
        with pytest.raises(ValueError, match="a must have shape"):
            fn(x)
    assert fc.replays == 0


def test_decode_vfirst_warps_knob_is_part_of_the_key(fc, monkeypatch):
    from mate_cupy.kda import decode_kernels as dk

    fn, make = decode_maker(fc)
    fn(make())
    monkeypatch.setattr(dk, "VFIRST_WARPS", 2)
    fc.log.clear()
    fn(make())
    assert fc.replays == 0 and fc.log[0][2] == (64,)


def test_decode_unhashable_or_mutable_options_take_the_full_path(fc):
    fn0, make = decode_maker(fc)
    x = make()
    scale = torch.tensor(0.5)

    def fn(x):
        return mc.gated_delta_rule_decode(x["q"], x["k"], x["v"], x["state"], x["A_log"], x["a"], x["dt_bias"], None,
                                          None, x["b"], state_indices=x["state_indices"], output=x["output"],
                                          scale=scale, inplace_final_state=True)

    fn(x)
    fn(make())
    assert fc.replays == 0


# ----------------------------------------------------------------------------- MSA


def _meta(fc, bs, table_cols=None):
    return mc.MsaRuntimeMetadata(
        qo_lens=fc.tensor((bs,), I32), kv_lens=fc.tensor((bs,), I32), qo_offset=fc.tensor((bs,), I32),
        cu_seqlens_q=fc.tensor((bs + 1,), I32), cu_seqlens_k=fc.tensor((bs + 1,), I32),
        seqused_k=fc.tensor((bs,), I32),
        page_table=fc.tensor((bs, table_cols), I32) if table_cols else None,
        kv_page_indptr=None if table_cols else fc.tensor((bs + 1,), I32))


def test_msa_static_paged_decode(fc):
    bs, L, page, hq, hkv, d = 16, 2048, 64, 32, 8, 128
    n_pages = bs * L // page
    plan = mc.msa_plan(bs, 1, L, hq, total_seqlen_k=n_pages * page, num_kv_heads=hkv, page_size=page)

    def make():
        return dict(q=fc.tensor((bs, hq, d), BF16), k=fc.tensor((n_pages, page, hkv, d), BF16),
                    v=fc.tensor((n_pages, page, hkv, d), BF16), out=fc.tensor((bs, hq, d), BF16),
                    idx=fc.tensor((n_pages,), I32), meta=_meta(fc, bs))

    def fn(x):
        return mc.msa(x["q"], x["k"], x["v"], plan, kv_indices=x["idx"], out=x["out"], runtime_metadata=x["meta"])

    log, res = check_replay(fc, fn, make)
    assert len(log) >= 1


def test_msa_static_page_table_hnd_alloc_out_and_lse(fc):
    bs, L, page, hq, hkv, d = 4, 1024, 16, 16, 2, 64
    n_pages = bs * L // page
    plan = mc.msa_plan(bs, 1, L, hq, total_seqlen_k=n_pages * page, num_kv_heads=hkv, page_size=page)

    def make():
        return dict(q=fc.tensor((bs, hq, d), F16), k=fc.tensor((n_pages, hkv, page, d), F16),
                    v=fc.tensor((n_pages, hkv, page, d), F16), lse=fc.tensor((bs, hq), F32),
                    meta=_meta(fc, bs, table_cols=L // page))

    def fn(x):
        return mc.msa(x["q"], x["k"], x["v"], plan, lse=x["lse"], runtime_metadata=x["meta"])

    check_replay(fc, fn, make)


def test_msa_eager_dense_prefill_alloc(fc):
    qo, kv = np.array([40, 7, 100], np.int32), np.array([64, 7, 300], np.int32)
    plan = mc.msa_plan_from_lengths(qo, kv, 8, 2)
    hq, hkv, d = 8, 2, 128

    def make():
        return dict(q=fc.tensor((int(qo.sum()), hq, d), BF16), k=fc.tensor((int(kv.sum()), hkv, d), BF16),
                    v=fc.tensor((int(kv.sum()), hkv, d), BF16))

    def fn(x):
        return mc.msa(x["q"], x["k"], x["v"], plan)

    log, res = check_replay(fc, fn, make)
    assert res[1] is None


def test_msa_eager_paged_decode_with_plan_vectors(fc):
    bs, L, page, hq, hkv, d = 64, 8192, 64, 64, 8, 128
    n_pages = bs * L // page
    plan = mc.msa_plan_from_lengths(np.ones(bs, np.int32), np.full(bs, L, np.int32), hq, hkv, page_size=page)

    def make():
        return dict(q=fc.tensor((bs, hq, d), BF16), k=fc.tensor((n_pages, page, hkv, d), BF16),
                    v=fc.tensor((n_pages, page, hkv, d), BF16), out=fc.tensor((bs, hq, d), BF16),
                    idx=fc.tensor((n_pages,), I32))

    def fn(x):
        return mc.msa(x["q"], x["k"], x["v"], plan, kv_indices=x["idx"], out=x["out"])

    check_replay(fc, fn, make)


def test_msa_sparse_decode_split_kv_lse_and_workspace(fc):
    sb, sL, hq, hkv, topk, d = 4, 32768, 64, 4, 16, 128
    pages = sb * sL // 128
    plan = mc.msa_plan(sb, 1, sL, hq, total_seqlen_k=pages * 128, num_kv_heads=hkv, page_size=128,
                       kv_block_num=topk, sparse_kernel_mode="decode")

    def make():
        return dict(q=fc.tensor((sb, hq, d), BF16), k=fc.tensor((pages, 128, hkv, d), BF16),
                    v=fc.tensor((pages, 128, hkv, d), BF16), idx=fc.tensor((pages,), I32),
                    kbi=fc.tensor((sb, hkv, topk), I32), meta=_meta(fc, sb))

    def fn(x):
        return mc.sparse_decode_atten_func(x["q"], x["k"], x["v"], plan, kv_indices=x["idx"],
                                           kv_block_indexes=x["kbi"], runtime_metadata=x["meta"],
                                           return_softmax_lse=True)

    log, res = check_replay(fc, fn, make)
    assert len(log) == 2, "split-KV: forward and merge kernels"
    assert any(p.startswith("anon") for p in log[0][4] if isinstance(p, str)), "workspace address"


def test_msa_sparse_prefill_gather_tile_replays_its_five_launches(fc, monkeypatch):
    """The gather tile (MATE_CUPY_ATTN_SPARSE_TILE=gather): count, scan, scatter, attention and
    merge launches, replayed with the cached workspace and counters at the same addresses."""
    from mate_cupy.msa import gather_kernels as gk

    monkeypatch.setenv("MATE_CUPY_ATTN_SPARSE_TILE", "gather")
    S, hq, hkv, topk, d = 512, 64, 4, 16, 128
    pages = S // 128
    plan = mc.sparse_msa_plan(np.array([S], np.int32), np.array([S], np.int32), hq, hkv, page_size=128,
                              kv_block_num=topk, causal=True)

    def make():
        return dict(q=fc.tensor((S, hq, d), BF16), k=fc.tensor((pages, 128, hkv, d), BF16),
                    v=fc.tensor((pages, 128, hkv, d), BF16), idx=fc.tensor((pages,), I32),
                    kbi=fc.tensor((S, hkv, topk), I32), out=fc.tensor((S, hq, d), BF16))

    def fn(x):
        return mc.sparse_msa(x["q"], x["k"], x["v"], plan, kv_indices=x["idx"], kv_block_indexes=x["kbi"],
                             out=x["out"])

    log, _ = check_replay(fc, fn, make)
    assert [entry[0].rsplit(":", 1)[-1] for entry in log] == list(gk.KERNELS)


def test_msa_maxscore_and_attention_in_one_call(fc):
    bs, L, hq, hkv, d = 3, 1024, 8, 8, 128
    pages = bs * L // 128
    plan = mc.msa_plan(bs, 4, L, hq, total_seqlen_k=pages * 128, num_kv_heads=hkv, page_size=128,
                       output_maxscore=True)

    def make():
        return dict(q=fc.tensor((bs * 4, hq, d), BF16), k=fc.tensor((pages, 128, hkv, d), BF16),
                    v=fc.tensor((pages, 128, hkv, d), BF16), idx=fc.tensor((pages,), I32), meta=_meta(fc, bs))

    def fn(x):
        return mc.msa(x["q"], x["k"], x["v"], plan, kv_indices=x["idx"], runtime_metadata=x["meta"])

    log, res = check_replay(fc, fn, make)
    assert len(log) >= 2 and res[1] is not None


def test_msa_offsets_override_int_is_not_replayed(fc):
    """An int q_offset_override is expanded on the device per call: never replayed."""
    qo, kv = np.array([1, 1], np.int32), np.array([64, 32], np.int32)
    plan = mc.msa_plan_from_lengths(qo, kv, 4, 4)
    import cupy

    made = []
    orig = cupy.full
    try:
        cupy.full = lambda shape, value, dtype=None: made.append(value) or fc.cupy((shape,), dtype)
        for _ in range(2):
            mc.msa(fc.tensor((2, 4, 64), BF16), fc.tensor((96, 4, 64), BF16), fc.tensor((96, 4, 64), BF16), plan,
                   q_offset_override=5)
    finally:
        cupy.full = orig
    assert fc.replays == 0 and made == [5, 5]


def test_msa_env_knob_is_part_of_the_key(fc, monkeypatch):
    qo, kv = np.array([64], np.int32), np.array([64], np.int32)
    plan = mc.msa_plan_from_lengths(qo, kv, 4, 4)

    def call():
        mc.msa(fc.tensor((64, 4, 64), BF16), fc.tensor((64, 4, 64), BF16), fc.tensor((64, 4, 64), BF16), plan)

    call()
    monkeypatch.setenv("MATE_CUPY_ATTN_PREFILL_TILE", "prefill")
    call()
    assert fc.replays == 0
    call()
    assert fc.replays == 1


def test_msa_plans_are_keyed_by_identity(fc):
    qo, kv = np.array([1, 1], np.int32), np.array([64, 32], np.int32)
    p1 = mc.msa_plan_from_lengths(qo, kv, 4, 4)
    p2 = mc.msa_plan_from_lengths(qo, kv, 4, 4)

    def call(plan):
        mc.msa(fc.tensor((2, 4, 64), BF16), fc.tensor((96, 4, 64), BF16), fc.tensor((96, 4, 64), BF16), plan)

    call(p1)
    call(p2)
    assert fc.replays == 0
    call(p1)
    assert fc.replays == 1


# ----------------------------------------------------------------------------- top-k


@pytest.mark.parametrize("prealloc", [True, False])
@pytest.mark.parametrize("positions", [False, True])
def test_topk_replay_matches_full_path(fc, prealloc, positions):
    def make():
        return dict(s=fc.tensor((5, 4, 700), F32), o=fc.tensor((5, 4, 16), I32) if prealloc else None,
                    p=fc.tensor((5,), I64) if positions else None)

    def fn(x):
        return mc.sparse_topk_select(x["s"], 16, output=x["o"], force_begin_blocks=1, force_end_blocks=2,
                                     query_positions=x["p"])

    log, res = check_replay(fc, fn, make)
    assert len(log) == 1


def test_topk_misaligned_scores_pick_their_own_variant(fc):
    """The 16-byte alignment of the scores picks the vector width: it is part of the signature."""
    fn = lambda s: mc.sparse_topk_select(s, 8)  # noqa: E731
    fn(fc.tensor((3, 2, 512), F32))
    aligned = fc.log[-1][0]
    fn(fc.tensor((3, 2, 512), F32, misalign=4))
    assert fc.replays == 0 and fc.log[-1][0] != aligned
    fn(fc.tensor((3, 2, 512), F32))
    assert fc.replays == 1 and fc.log[-1][0] == aligned


def test_cache_is_bounded_and_clearable(fc, monkeypatch):
    monkeypatch.setattr(lc, "MAX_ENTRIES", 3)
    for n in range(1, 6):
        mc.sparse_topk_select(fc.tensor((n, 2, 512), F32), 8)
    from mate_cupy.msa import topk as topk_mod

    assert 1 <= len(topk_mod._RECIPES) <= 3
    lc.clear()
    assert len(topk_mod._RECIPES) == 0


def test_plain_options():
    assert lc.plain((None, True, 3, 0.5, "x", b"x", np.float32(1), np.dtype(np.int32), np.float32, torch.float32))
    assert not lc.plain((torch.tensor(1.0),))
    assert not lc.plain(([1],))


def test_signature_refuses_host_and_unknown_arrays():
    assert lc.signature((np.zeros(3),)) == (None, None)
    key, ptrs = lc.signature((torch.zeros(3), None))
    assert key[1] is None and ptrs[1] == 0 and key[0][3] == torch.device("cpu")


# ----------------------------------------------------------------------------- chunk_kda


def chunk_maker(fc, *, varlen=False, packed3d=False, out=True, final=True, alloc_final=False, dtype=BF16):
    T, H, HV, K = 200, 2, 4, 128
    N = 3 if varlen else 1

    def make():
        lead = () if packed3d else (1,)
        return dict(q=fc.tensor(lead + (T, H, K), dtype), k=fc.tensor(lead + (T, H, K), dtype),
                    v=fc.tensor(lead + (T, HV, K), dtype), g=fc.tensor(lead + (T, HV, K), dtype),
                    beta=fc.tensor(lead + (T, HV), dtype), A_log=fc.tensor((HV,), F32),
                    dt_bias=fc.tensor((HV, K), F32), cu=fc.tensor((N + 1,), I32) if varlen else None,
                    init=fc.tensor((N, HV, K, K), F32),
                    out=fc.tensor(lead + (T, HV, K), dtype) if out else None,
                    fs=fc.tensor((N, HV, K, K), F32) if final and not alloc_final else None)

    def fn(x):
        return mc.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["init"],
                            output_final_state=final, cu_seqlens=x["cu"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                            output=x["out"], final_state=x["fs"])

    return fn, make


def test_chunk_is_not_replayed_while_its_launcher_does_not_record(fc):
    from mate_cupy.kda import chunk_kernels as ck

    if ck.launch is lc.launch:
        pytest.skip("the chunk launcher records its launches")
    fn, make = chunk_maker(fc)
    fn(make())
    fn(make())
    assert fc.replays == 0


@pytest.mark.parametrize("cfg", [dict(), dict(varlen=True), dict(varlen=True, packed3d=True, out=False),
                                 dict(alloc_final=True), dict(final=False, out=False)])
def test_chunk_replay_with_a_recording_launcher(fc, monkeypatch, cfg):
    """The chunk launcher recording its launches and noting its scratch (workspace, offsets):
    replay equals the full path."""
    import cupy

    from mate_cupy.kda import chunk_kernels as ck

    monkeypatch.setattr(ck, "launch", lc.launch)
    fake_empty = cupy.empty

    def empty(shape, dtype=float, order="C"):
        a = fake_empty(shape, dtype)
        lc.note_alloc("scratch", a)  # what run_chunk_workspace / launch_offsets would note
        return a

    monkeypatch.setattr(cupy, "empty", empty)
    fn, make = chunk_maker(fc, **cfg)
    log, res = check_replay(fc, fn, make)
    assert len(log) == (3 if cfg.get("varlen") else 2)
