"""The public MSA ops on CUDA arrays against the float64 references (``-m gpu``).

Outputs are poisoned with NaN (indices with a sentinel) before every launch, so any
element a kernel fails to write shows up. Static plans are also captured in a CUDA
graph: a host read or an allocation during execution would break the capture.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_rel, side_stream, to_f64
from msa_cases import BF16, FP8, make_problem, offsets_of, random_selection

import mate_cupy as mc
from mate_cupy.reference import msa as R

pytestmark = pytest.mark.gpu

TOL_OUT = {BF16: 1e-2, np.dtype(np.float16): 5e-3}
TOL_FP8 = 4e-2


def dev(x):
    """Host array -> CUDA array (CuPy; fp8 goes through torch, which CuPy cannot hold)."""
    import cupy

    x = np.asarray(x)
    if x.dtype == FP8:
        import torch

        return torch.from_dlpack(cupy.asarray(x.view(np.uint8))).view(torch.float8_e4m3fn)
    try:
        return cupy.asarray(x)
    except Exception:
        if x.dtype != BF16:
            raise
        return mc.cast(cupy.asarray(x.astype(np.float32)), "bfloat16")  # exact: bf16 -> f32 -> bf16


def poisoned(shape, dtype):
    import cupy

    a = cupy.empty(shape, dtype=dtype)
    a.fill(-12345 if np.dtype(dtype).kind in "iu" else np.nan)
    return a


def dense_ref(p, qo_offset=None, causal=True):
    return R.dense_attention(p.q, p.k, p.v, p.cu_q, p.cu_k, qo_offset=offsets_of(p, qo_offset), causal=causal)


def masked_ref(p, sel, k_scale=1.0, v_scale=1.0):
    return R.sparse_attention(p.q, p.k_cache, p.v_cache, p.cu_q, p.kv, p.page_table, sel, k_scale=k_scale,
                              v_scale=v_scale, kv_layout=p.layout)


def check(out, lse, ref, dtype, what):
    tol = TOL_FP8 if np.dtype(dtype) == FP8 else TOL_OUT[np.dtype(dtype)]
    assert_rel(out, ref[0], tol, f"{what} out")
    if lse is not None:
        assert_rel(lse, ref[1], 1e-4, f"{what} lse")


# ----------------------------------------------------------------------------- dense and paged


@pytest.mark.parametrize("dtype", [BF16, np.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hq, hkv, d", [(4, 4, 64), (8, 1, 128), (16, 1, 128), (8, 2, 256)],
                         ids=["gqa1-d64", "gqa8-d128", "gqa16-d128", "gqa4-d256"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_dense(rng, dtype, hq, hkv, d, causal):
    p = make_problem(rng, [3, 0, 200, 1, 77], [300, 9, 200, 0, 1000], hq, hkv, d, dtype=dtype)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, hq, hkv, causal=causal, split_prefill_decode=False, device=0)
    out, lse = poisoned(p.q.shape, dtype), poisoned((p.total_q, hq), np.float32)
    res, _ = mc.msa(dev(p.q), dev(p.k), dev(p.v), info, out=out, lse=lse)
    assert res is out
    check(out, lse, dense_ref(p, causal=causal), dtype, "dense")


def test_dense_offsets_and_mixed_split(rng):
    p = make_problem(rng, [1, 2, 300, 5], [64, 500, 300, 40], 8, 1, 128)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1, output_maxscore=True, device=0)
    assert info[0]
    offs = np.array([3, -10, 100, 60], np.int32)
    out, ms = mc.msa(dev(p.q), dev(p.k), dev(p.v), info, q_offset_override=dev(offs))
    check(out, None, dense_ref(p, offs), BF16, "mixed dense")
    assert_rel(ms, R.block_max_score(p.q, p.k, p.cu_q, p.cu_k, qo_offset=offs, max_k_tiles=ms.shape[2]), 1e-5)


@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("source", ["kv_indices", "page_table"])
def test_paged(rng, page_size, layout, source):
    p = make_problem(rng, [1, 4, 0, 130, 1], [300, 4, 17, 130, 2000], 8, 1, 128, page_size=page_size,
                     layout=layout)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1, page_size=page_size, split_prefill_decode=False,
                                    device=0)
    kw = {"kv_indices": dev(p.kv_indices)} if source == "kv_indices" else {"page_table": dev(p.page_table)}
    out, lse = poisoned(p.q.shape, BF16), poisoned((p.total_q, 8), np.float32)
    mc.msa(dev(p.q), dev(p.k_cache), dev(p.v_cache), info, out=out, lse=lse, **kw)
    check(out, lse, dense_ref(p), BF16, f"paged {page_size} {layout}")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_max_score_paged(rng, layout):
    p = make_problem(rng, [3, 20, 1], [300, 129, 5000], 16, 2, 128, page_size=128, layout=layout)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 16, 2, page_size=128, output_maxscore=True, device=0)
    ms = poisoned((p.total_q, 16, 40), np.float32)
    out, res = mc.msa(dev(p.q), dev(p.k_cache), dev(p.v_cache), info, kv_indices=dev(p.kv_indices), max_score=ms,
                      output_o=False)
    assert out is None and res is ms
    assert_rel(ms, R.block_max_score(p.q, p.k, p.cu_q, p.cu_k, max_k_tiles=40), 1e-5, "paged max score")


# ----------------------------------------------------------------------------- sparse


@pytest.mark.parametrize("hq", [8, 16], ids=["gqa8", "gqa16"])
@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "fp8"])
def test_sparse_prefill(rng, hq, dtype):
    p = make_problem(rng, [40, 0, 300], [300, 10, 3000], hq, 1, 128, dtype=dtype, page_size=128)
    info = mc.sparse_msa_plan(p.qo, p.kv, hq, 1, page_size=128, kv_block_num=16, force_begin_blocks=1,
                              force_end_blocks=2, use_fp8_kvcache=dtype == FP8, device=0)
    sel = random_selection(rng, p, 16)
    scales = dict(k_scale=0.5, v_scale=1.5) if dtype == FP8 else {}
    out, lse = poisoned(p.q.shape, BF16), poisoned((p.total_q, hq), np.float32)
    mc.sparse_msa(dev(p.q), dev(p.k_cache), dev(p.v_cache), info, kv_indices=dev(p.kv_indices),
                  kv_block_indexes=dev(sel), out=out, lse=lse, **scales)
    check(out, lse, masked_ref(p, sel, **scales), dtype, "sparse prefill")


def test_sparse_prefill_plan_selects_the_gather_tile(rng, monkeypatch):
    """A plan's prefill_tile="gather" runs the block-stationary kernels (MiniMax-M3's 16
    query heads per KV head, the default); prefill_tile="query" runs the query tiles."""
    from mate_cupy.msa import gather_launch

    calls = []
    real = gather_launch.run_gather
    monkeypatch.setattr(gather_launch, "run_gather", lambda **kw: (calls.append(1), real(**kw)))
    p = make_problem(rng, [40, 0, 300], [300, 10, 3000], 64, 4, 128, page_size=128)
    sel = random_selection(rng, p, 16)
    ran = []
    for tile in ("gather", "query"):
        info = mc.sparse_msa_plan(p.qo, p.kv, 64, 4, page_size=128, kv_block_num=16, prefill_tile=tile, device=0)
        out, lse = poisoned(p.q.shape, BF16), poisoned((p.total_q, 64), np.float32)
        mc.sparse_msa(dev(p.q), dev(p.k_cache), dev(p.v_cache), info, kv_indices=dev(p.kv_indices),
                      kv_block_indexes=dev(sel), out=out, lse=lse)
        check(out, lse, masked_ref(p, sel), BF16, f"sparse prefill, tile {tile}")
        ran.append(len(calls))
    assert ran == [1, 1]  # the gather kernels ran for the "gather" plan only


@pytest.mark.parametrize("per_q_head", [False, True], ids=["per-kv-head", "per-q-head"])
def test_sparse_decode(rng, per_q_head):
    p = make_problem(rng, [1, 4, 1, 2], [129, 7000, 1, 300], 16, 2, 128, page_size=128)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 16, 2, page_size=128, kv_block_num=8, device=0)
    assert info[3].mode == "sparse_decode"
    sel = random_selection(rng, p, 8)
    arg = np.repeat(sel, 8, axis=1) if per_q_head else sel
    out, lse = mc.sparse_decode_atten_func(dev(p.q), dev(p.k_cache), dev(p.v_cache), info,
                                           page_table=dev(p.page_table), kv_block_indexes=dev(arg),
                                           return_softmax_lse=True)
    check(out, lse, masked_ref(p, sel), BF16, "sparse decode")


def test_sparse_mixed_plan(rng):
    p = make_problem(rng, [1, 3, 100, 2], [300, 129, 900, 200], 8, 1, 128, page_size=128)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1, page_size=128, kv_block_num=4, device=0)
    assert info[0]
    sel = random_selection(rng, p, 4)
    out, _ = mc.msa(dev(p.q), dev(p.k_cache), dev(p.v_cache), info, kv_indices=dev(p.kv_indices),
                    kv_block_indexes=dev(sel))
    check(out, None, masked_ref(p, sel), BF16, "mixed sparse")


# ----------------------------------------------------------------------------- selection and tables


@pytest.mark.parametrize("nt", [7, 300, 2000])
@pytest.mark.parametrize("kw", [dict(), dict(force_begin_blocks=1, force_end_blocks=2),
                                dict(force_begin_blocks=2, force_end_blocks=2, force_blocks_count_in_topk=False),
                                dict(num_valid_pages=5), dict(qpos=True, force_begin_blocks=1)],
                         ids=["plain", "forced", "forced-extra", "identity", "query-positions"])
def test_topk_select(rng, nt, kw):
    kw = dict(kw)
    ms = np.round(rng.standard_normal((33, 4, nt)) * 2).astype(np.float32) / 2
    ms[rng.random(ms.shape) < 0.05] = np.nan
    ms[rng.random(ms.shape) < 0.05] = -np.inf
    qpos = None
    if kw.pop("qpos", False):
        qpos = rng.integers(-100, nt * 128, size=33).astype(np.int64)
        kw["query_positions"] = dev(qpos)
    if kw.get("num_valid_pages", 0) > nt:
        kw["num_valid_pages"] = nt
    width = 16 + (0 if kw.get("force_blocks_count_in_topk", True) else
                  kw.get("force_begin_blocks", 0) + kw.get("force_end_blocks", 0))
    out = poisoned((33, 4, width), np.int32)
    res = mc.sparse_topk_select(dev(ms), 16, output=out, **kw)
    assert res is out
    ref_kw = {k: v for k, v in kw.items() if k != "query_positions"}
    np.testing.assert_array_equal(out.get(), R.topk_select(ms, 16, query_positions=qpos, **ref_kw))


def test_page_table_builder(rng):
    lens = np.array([0, 17, 300, 64], np.int32)
    ids = rng.permutation(100)[: int((-(-lens // 16)).sum())].astype(np.int32)
    table = mc.build_page_table_from_flat_kv_indices(dev(ids), dev(lens), 16)
    np.testing.assert_array_equal(table.get(), R.page_table_from_csr(ids, lens, 16))
    wide = ids.astype(np.int64)
    wide[::3] += 2**32  # beyond int32: saturates (never wraps onto the low bits)
    wide[1::5] -= 2**40
    table = mc.build_page_table_from_flat_kv_indices(dev(wide), dev(lens), 16)
    want = R.page_table_from_csr(wide, lens, 16)
    assert (want == 2**31 - 1).any() and (want == -(2**31)).any()
    np.testing.assert_array_equal(table.get(), want)


# ----------------------------------------------------------------------------- static plans and capture


def _metadata(p, **extra):
    return mc.MsaRuntimeMetadata(
        qo_lens=dev(p.qo), kv_lens=dev(p.kv), qo_offset=dev((p.kv - p.qo).astype(np.int32)),
        cu_seqlens_q=dev(p.cu_q), cu_seqlens_k=dev(p.cu_k), seqused_k=dev(p.kv), **extra)


def test_static_dense_graph_capture(rng):
    p = make_problem(rng, [3, 50, 1], [100, 50, 700], 8, 1, 128)
    info = mc.msa_plan(3, 64, 1024, 8, num_kv_heads=1, total_seqlen_k=2048)
    q, k, v, md = dev(p.q), dev(p.k), dev(p.v), _metadata(p)
    out, lse = poisoned(p.q.shape, BF16), poisoned((p.total_q, 8), np.float32)
    stream = side_stream()
    with stream:
        mc.msa(q, k, v, info, runtime_metadata=md, out=out, lse=lse)  # warm-up: compiles kernels
        out.fill(np.nan)
        stream.begin_capture()
        mc.msa(q, k, v, info, runtime_metadata=md, out=out, lse=lse)
        graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()
    check(out, lse, dense_ref(p), BF16, "captured static dense")


def test_static_sparse_decode_graph_capture(rng):
    p = make_problem(rng, [1, 1, 1], [300, 129, 4000], 16, 1, 128, page_size=128)
    info = mc.msa_plan(3, 1, 4096, 16, num_kv_heads=1, page_size=128, kv_block_num=8, total_seqlen_k=8192)
    table = np.zeros((3, 32), np.int32)
    table[:, : p.page_table.shape[1]] = np.where(p.page_table >= 0, p.page_table, 0)
    sel = random_selection(rng, p, 8)
    args = (dev(p.q), dev(p.k_cache), dev(p.v_cache), info)
    kw = dict(kv_block_indexes=dev(sel), runtime_metadata=_metadata(p, page_table=dev(table)),
              out=poisoned(p.q.shape, BF16))
    stream = side_stream()
    with stream:
        mc.sparse_decode_atten_func(*args, **kw)
        kw["out"].fill(np.nan)
        stream.begin_capture()
        mc.sparse_decode_atten_func(*args, **kw)
        graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()
    check(kw["out"], None, masked_ref(p, sel), BF16, "captured static sparse decode")


# ----------------------------------------------------------------------------- frameworks and devices


def test_torch_cuda_in_torch_out(rng):
    import torch

    p = make_problem(rng, [5, 40], [100, 40], 8, 1, 128)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1, device=0)
    t = [torch.from_dlpack(dev(x)) for x in (p.q, p.k, p.v)]
    out, _ = mc.msa(*t, info)
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.bfloat16
    assert_rel(to_f64(out), dense_ref(p)[0], 1e-2)


def test_layouts_the_kernels_cannot_read_are_copied(rng):
    """Strided head dims, rows not 16-byte multiples and unaligned data give the contiguous
    call's output bit for bit (read from a copy); a second call with the same layout and
    outputs takes the validated path again (launches prepared from the first would read the
    caller's array)."""
    import torch

    p = make_problem(rng, [5, 40], [100, 40], 8, 1, 128)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1, device=0)
    q, k, v = (torch.from_dlpack(dev(x)) for x in (p.q, p.k, p.v))
    want, _ = mc.msa(q, k, v, info)
    check(want, None, dense_ref(p), BF16, "contiguous")

    def padded(x, width, step=1):
        big = torch.zeros(x.shape[:-1] + (width,), dtype=x.dtype, device=x.device)
        big[..., :x.shape[-1] * step:step] = x
        return big[..., :x.shape[-1] * step:step]

    flat = torch.zeros(q.numel() + 8, dtype=q.dtype, device=q.device)
    unaligned = flat[1:1 + q.numel()].view(q.shape)  # 2 bytes past a 16-byte boundary
    unaligned.copy_(q)
    cases = (("strided head dim", padded(q, 256, 2), k), ("260-byte rows", padded(q, 130), k),
             ("272-byte rows (read in place)", padded(q, 136), k), ("unaligned q", unaligned, k),
             ("strided k", q, padded(k, 256, 2)))
    for what, qq, kk in cases:
        out = torch.full(p.q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        for _ in range(2):
            out.fill_(float("nan"))
            mc.msa(qq, kk, v, info, out=out)
            assert torch.equal(out.view(torch.int16), want.view(torch.int16)), what
    # a paged HND cache (k and v one strided array: one copy), with max scores of strided q
    p = make_problem(rng, [3, 130], [300, 500], 8, 1, 128, page_size=128, layout="HND")
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1, page_size=128, output_maxscore=True, device=0)
    q, kc, vc, idx = (torch.from_dlpack(dev(x)) for x in (p.q, p.k_cache, p.v_cache, p.kv_indices))
    want_o, want_ms = mc.msa(q, kc, vc, info, kv_indices=idx)
    kv = torch.stack([kc, vc], dim=-1)  # [P, Hkv, page, D, 2]: k and v with an element stride of 2
    got_o, got_ms = mc.msa(padded(q, 256, 2), kv[..., 0], kv[..., 1], info, kv_indices=idx)
    assert torch.equal(got_o.view(torch.int16), want_o.view(torch.int16))
    assert torch.equal(got_ms, want_ms)
    _, ms_only = mc.msa(padded(q, 130), kv[..., 0], kv[..., 0], info, kv_indices=idx, output_o=False)
    assert torch.equal(ms_only, want_ms)
    same_o, _ = mc.msa(q, kc, kc, info, kv_indices=idx)  # k given as v: one copy serves both
    got_o, _ = mc.msa(q, kv[..., 0], kv[..., 0], info, kv_indices=idx)
    assert torch.equal(got_o.view(torch.int16), same_o.view(torch.int16))
    check(want_o, None, dense_ref(p), BF16, "paged HND")


def test_host_index_array_with_cuda_q_is_refused(rng):
    p = make_problem(rng, [2], [40], 8, 1, 128, page_size=16)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1, page_size=16, device=0)
    with pytest.raises(ValueError, match="share one device"):
        mc.msa(dev(p.q), dev(p.k_cache), dev(p.v_cache), info, kv_indices=p.kv_indices)


# ----------------------------------------------------------------------------- plans on the device


def test_eager_plan_must_be_uploaded(rng):
    p = make_problem(rng, [3, 40], [100, 40], 8, 1, 128)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1, device="cpu")  # a host-only plan: nothing uploaded
    q, k, v = dev(p.q), dev(p.k), dev(p.v)
    with pytest.raises(ValueError, match="upload"):
        mc.msa(q, k, v, info)
    assert mc.upload_plan(info) is info and info[3].device_vectors.device == 0
    out, _ = mc.msa(q, k, v, info)
    check(out, None, dense_ref(p), BF16, "uploaded later")
    built = mc.msa_plan_from_lengths(p.qo, p.kv, 8, 1)  # device None on a GPU machine: uploaded when built
    assert built[3].device_vectors is not None
    mixed = mc.msa_plan_from_lengths([1, 200], [50, 200], 8, 1, device="cpu")
    assert mixed[0] and mixed[3].device_vectors is None and mixed[4].device_vectors is None
    mc.upload_plan(mixed)
    assert mixed[3].device_vectors is not None and mixed[4].device_vectors is not None


def test_cuda_lengths_upload_the_plan_at_build(rng):
    import cupy

    p = make_problem(rng, [3, 40], [100, 40], 8, 1, 128)
    qo, kv = cupy.asarray(p.qo), cupy.asarray(p.kv)
    stream = side_stream()
    info = mc.msa_plan_from_lengths(qo, kv, 8, 1, stream=stream)
    stream.synchronize()
    vec = info[3].device_vectors
    assert vec is not None and vec.device == 0
    np.testing.assert_array_equal(vec.cu_seqlens_q.data.get(), p.cu_q)
    np.testing.assert_array_equal(vec.qo_offset.data.get(), p.kv - p.qo)
    out, _ = mc.msa(dev(p.q), dev(p.k), dev(p.v), info)
    check(out, None, dense_ref(p), BF16, "CUDA lengths")


def _split_decode_case(rng):
    """Paged decode that the configuration splits over the keys (so it needs a workspace)."""
    p = make_problem(rng, [1, 1], [6000, 3000], 16, 2, 128, page_size=64)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 16, 2, page_size=64, device=0)
    return p, info


def test_plan_owned_workspace_is_sized_by_the_plan_and_reused(rng):
    p, info = _split_decode_case(rng)
    plan = info[3]
    need = plan.workspace_bytes(128, "bfloat16")
    assert need > 0 and plan.workspace is None
    args = (dev(p.q), dev(p.k_cache), dev(p.v_cache), info)
    out, _ = mc.msa(*args, kv_indices=dev(p.kv_indices))
    ws = plan.workspace
    assert ws is not None and ws.nbytes == need
    out2, _ = mc.msa(*args, kv_indices=dev(p.kv_indices))
    assert plan.workspace is ws  # reused, never regrown
    check(out2, None, dense_ref(p), BF16, "plan workspace")


def test_caller_workspace(rng):
    import cupy

    p, info = _split_decode_case(rng)
    need = info[3].workspace_bytes(128, "bfloat16")
    args = (dev(p.q), dev(p.k_cache), dev(p.v_cache), info)
    for ws in (mc.Workspace(need), cupy.zeros(need, dtype=np.uint8), cupy.zeros(-(-need // 4), dtype=np.float32)):
        out, _ = mc.msa(*args, kv_indices=dev(p.kv_indices), workspace=ws)
        check(out, None, dense_ref(p), BF16, f"caller workspace {type(ws).__name__}")
    assert info[3].workspace is None  # the plan allocated nothing
    with pytest.raises(ValueError, match="workspace"):
        mc.msa(*args, kv_indices=dev(p.kv_indices), workspace=mc.Workspace(need - 1))
    with pytest.raises(ValueError, match="workspace"):
        mc.msa(*args, kv_indices=dev(p.kv_indices), workspace=np.zeros(need, np.uint8))


def test_upload_with_head_dim_allocates_the_workspace(rng):
    p, info = _split_decode_case(rng)
    info[3].upload(head_dim=128, dtype="bfloat16")
    ws = info[3].workspace
    assert ws is not None and ws.nbytes == info[3].workspace_bytes(128, "bfloat16")
    mc.msa(dev(p.q), dev(p.k_cache), dev(p.v_cache), info, kv_indices=dev(p.kv_indices))
    assert info[3].workspace is ws


@pytest.mark.parametrize("case, exc", [("head-dim-96", NotImplementedError), ("float32", TypeError)])
def test_cuda_refusals_match_the_host_ones(rng, case, exc):
    d = 96 if case == "head-dim-96" else 128
    dtype = {"float32": np.float32}.get(case, BF16)
    p = make_problem(rng, [3, 9], [20, 9], 8, 2, d, dtype=dtype)
    for arrays, info in (((p.q, p.k, p.v), mc.msa_plan_from_lengths(p.qo, p.kv, 8, 2)),
                         ((dev(p.q), dev(p.k), dev(p.v)), mc.msa_plan_from_lengths(p.qo, p.kv, 8, 2, device=0))):
        with pytest.raises(exc):
            mc.msa(*arrays, info)


# ----------------------------------------------------------------------------- capture without warm-up


_CAPTURE = r'''
import numpy as np, torch, sys
sys.path.insert(0, {tests!r})
import mate_cupy as mc
from msa_cases import make_problem
from mate_cupy.reference import msa as R
from helpers import rel_err

rng = np.random.default_rng(7)
p = make_problem(rng, [1, 1, 1], [6000, 3000, 129], 16, 2, 128, page_size=64)
dev = torch.device("cuda", 0)
bf = lambda x: torch.from_numpy(np.asarray(x, np.float32)).to(dev, torch.bfloat16)
q, kc, vc = bf(p.q), bf(p.k_cache), bf(p.v_cache)
idx = torch.from_numpy(p.kv_indices).to(dev)
out = torch.full(tuple(p.q.shape), float("nan"), device=dev, dtype=torch.bfloat16)
lse = torch.full((p.total_q, 16), float("nan"), device=dev, dtype=torch.float32)
if {static}:
    info = mc.msa_plan(3, 1, 6016, 16, num_kv_heads=2, page_size=64, total_seqlen_k=kc.shape[0] * 64)
    info[3].upload(0, head_dim=128, dtype=torch.bfloat16)  # the plan's workspace and kernels
    z = lambda a: torch.from_numpy(np.asarray(a, np.int32)).to(dev)
    md = mc.MsaRuntimeMetadata(qo_lens=z(p.qo), kv_lens=z(p.kv), qo_offset=z(p.kv - p.qo), cu_seqlens_q=z(p.cu_q),
                               cu_seqlens_k=z(p.cu_k), seqused_k=z(p.kv),
                               kv_page_indptr=z(np.concatenate([[0], np.cumsum(-(-p.kv // 64))])))
    kw = dict(runtime_metadata=md)
    assert info[3].workspace is not None
else:
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 16, 2, page_size=64, device=0)  # uploaded at build
    kw = dict(workspace=mc.Workspace(info[3].workspace_bytes(128, torch.bfloat16)))
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):  # no warm-up: the first call ever is captured
    mc.msa(q, kc, vc, info, kv_indices=idx, out=out, lse=lse, **kw)
graph.replay()
torch.cuda.synchronize()
ref = R.paged_attention(p.q, p.k_cache, p.v_cache, p.cu_q, p.kv, p.page_table, qo_offset=p.kv - p.qo)
err = rel_err(out.float().cpu().numpy(), ref[0])
lerr = float(np.max(np.abs(lse.cpu().numpy() - ref[1])))
assert err < 1e-2 and lerr < 1e-3, (err, lerr)
print("CAPTURED-OK")
'''


@pytest.mark.torch
@pytest.mark.parametrize("static", [False, True], ids=["eager-uploaded-at-build", "static-uploaded"])
def test_first_call_captured_in_torch_graph_in_a_fresh_process(static):
    """Outputs and workspace preallocated, plan uploaded before: the very first call of a
    fresh process (kernels not yet loaded) is captured in a torch.cuda.graph."""
    import os
    import subprocess
    import sys

    code = _CAPTURE.format(tests=os.path.dirname(__file__), static=static)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0 and "CAPTURED-OK" in res.stdout, res.stdout + res.stderr
