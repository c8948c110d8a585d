"""MSA planners: modes, the decode+prefill split, plan fields, static plans, every refusal."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mate_cupy as mc
from mate_cupy import msa_interface
from mate_cupy.msa.plan import selected_block_count

SPARSE = dict(page_size=128, kv_block_num=8)


def _plan(qo, kv, *args, **kw):
    return mc.msa_plan_from_lengths(np.asarray(qo), np.asarray(kv), *args, **kw)


# ----------------------------------------------------------------------------- eager plans


def test_dense_plan_fields():
    info = _plan([3, 0, 7], [10, 5, 7], 8, 2)
    assert info[:3] == (False, 0, 3) and info[4] is None
    p = info[3]
    assert p.mode == "dense" and not p.is_static and p.decode_plan is None and p.kv_page_indptr is None
    assert (p.batch_size, p.num_qo_heads, p.num_kv_heads, p.page_size) == (3, 8, 2, -1)
    np.testing.assert_array_equal(p.qo_lens, [3, 0, 7])
    np.testing.assert_array_equal(p.kv_lens, [10, 5, 7])
    np.testing.assert_array_equal(p.qo_offset, [7, 5, 0])
    assert p.qo_lens.dtype == np.int32 and p.qo_offset.dtype == np.int32
    np.testing.assert_array_equal(p.prefill_plan.cu_seqlens_q, [0, 3, 3, 10])
    np.testing.assert_array_equal(p.prefill_plan.cu_seqlens_k, [0, 10, 15, 22])
    assert (p.prefill_plan.max_seqlen_q, p.prefill_plan.max_seqlen_k, p.prefill_plan.total_seqlen_k) == (7, 10, 22)
    assert p.selected_block_count == -1
    assert (p.num_kv_splits, p.kv_block_num, p.causal, p.output_maxscore, p.use_fp8_kvcache) == (-1, -1, True, False, False)
    assert p.sparse_kernel_mode == "auto" and p.sparse_block_size == 128


def test_paged_plan_fields():
    p = _plan([1, 2], [33, 0], 4, page_size=16)[3]
    assert p.mode == "paged"
    np.testing.assert_array_equal(p.kv_page_indptr, [0, 3, 3])
    assert p.decode_plan.page_size == 16 and p.decode_plan.sparse_block_size == 128
    np.testing.assert_array_equal(p.decode_plan.cache_seqlens, [33, 0])
    assert p.decode_plan.scheduler_metadata is None
    assert p.num_kv_heads == 4  # default: num_qo_heads


@pytest.mark.parametrize(
    "qo, kw, mode",
    [
        pytest.param([33], {}, "sparse_prefill", id="auto-prefill-33"),
        pytest.param([32], {}, "sparse_decode", id="auto-decode-32"),
        pytest.param([1], {"sparse_kernel_mode": "prefill"}, "sparse_prefill", id="forced-prefill"),
        pytest.param([300], {"sparse_kernel_mode": "decode"}, "sparse_decode", id="forced-decode"),
    ],
)
def test_sparse_modes(qo, kw, mode):
    info = _plan(qo, [1000], 16, 2, split_prefill_decode=False, **SPARSE, **kw)
    p = info[3]
    assert p.mode == mode and p.selected_block_count == 8
    assert (p.decode_plan is not None) == (mode == "sparse_decode")
    np.testing.assert_array_equal(p.kv_page_indptr, [0, 8])


@pytest.mark.parametrize(
    "topk, begin, end, in_topk, width",
    [(4, 0, 0, True, 4), (8, 1, 2, True, 8), (16, 1, 1, False, 18), (16, 8, 8, True, 16),
     (32, 0, 0, True, 32), (64, 0, 0, True, 64), (16, 20, 20, False, 56)],
    ids=lambda x: str(x),
)
def test_selected_block_count(topk, begin, end, in_topk, width):
    assert selected_block_count(topk, begin, end, in_topk) == width
    p = _plan([1], [1000], 8, 1, page_size=128, kv_block_num=topk, force_begin_blocks=begin,
              force_end_blocks=end, force_blocks_count_in_topk=in_topk)[3]
    assert p.selected_block_count == width


# ----------------------------------------------------------------------------- the split


@pytest.mark.parametrize(
    "qo, sparse, split",
    [
        pytest.param([1, 1, 200, 3], False, 2, id="dense-decode-first"),
        pytest.param([1, 129], False, 1, id="dense-129-is-prefill"),
        pytest.param([1, 128], False, 0, id="dense-128-is-decode"),
        pytest.param([200, 1], False, 0, id="prefill-first-no-split"),
        pytest.param([5, 5, 5], False, 0, id="all-decode"),
        pytest.param([1, 33], True, 1, id="sparse-33-is-prefill"),
        pytest.param([1, 32], True, 0, id="sparse-32-is-decode"),
        pytest.param([2, 4, 40, 1, 100], True, 2, id="sparse-later-decode-stays-in-prefill"),
    ],
)
def test_mixed_split(qo, sparse, split):
    kv = [q + 300 for q in qo]
    kw = dict(SPARSE) if sparse else {}
    info = _plan(qo, kv, 16, 2, **kw)
    mixed, got_split, batch, first, second = info
    assert batch == len(qo)
    assert got_split == split and mixed == (split > 0)
    if not mixed:
        assert second is None and first.batch_size == len(qo)
        return
    assert first.batch_size == split and second.batch_size == len(qo) - split
    np.testing.assert_array_equal(first.qo_lens, qo[:split])
    np.testing.assert_array_equal(second.qo_lens, qo[split:])
    np.testing.assert_array_equal(second.kv_lens, kv[split:])
    np.testing.assert_array_equal(second.prefill_plan.cu_seqlens_q, np.cumsum([0] + qo[split:]))
    if sparse:
        assert first.mode == "sparse_decode" and second.mode == "sparse_prefill"
    else:
        assert first.mode == second.mode == "dense"


def test_split_disabled_and_offsets_split():
    info = _plan([1, 300], [10, 300], 4, split_prefill_decode=False)
    assert info[0] is False and info[3].batch_size == 2
    info = _plan([1, 300], [10, 400], 4, qo_offset=np.array([4, 50]))
    np.testing.assert_array_equal(info[3].qo_offset, [4])
    np.testing.assert_array_equal(info[4].qo_offset, [50])
    info = _plan([1, 300], [10, 400], 4, qo_offset=3)
    np.testing.assert_array_equal(info[4].qo_offset, [3])


def test_mixed_paged_indptr_per_part():
    _, _, _, d, p = _plan([1, 2, 300], [100, 17, 300], 4, page_size=16)
    np.testing.assert_array_equal(d.kv_page_indptr, [0, 7, 9])
    np.testing.assert_array_equal(p.kv_page_indptr, [0, 19])
    assert d.mode == p.mode == "paged"


def test_empty_batch():
    info = _plan(np.zeros(0, np.int32), np.zeros(0, np.int32), 4)
    assert info[:3] == (False, 0, 0)
    pf = info[3].prefill_plan
    assert (pf.max_seqlen_q, pf.max_seqlen_k, pf.total_seqlen_k) == (0, 0, 0)
    np.testing.assert_array_equal(pf.cu_seqlens_q, [0])


def test_lengths_from_lists_and_int64_and_keywords():
    info = mc.msa_plan_from_lengths([2, 3], np.array([5, 6], np.int64), num_qo_heads=8, num_kv_heads=4)
    assert info[3].num_kv_heads == 4 and info[3].kv_lens.dtype == np.int32
    info = mc.msa_plan_from_lengths([2], [5], 8, num_kv_heads=0)  # <= 0 means "same as num_qo_heads"
    assert info[3].num_kv_heads == 8
    info = mc.msa_plan_from_lengths([2], [5], 8, usable_SM_count=132, device="cpu", stream=None)
    assert info[3].mode == "dense" and info[3].usable_sm_count == 132
    assert info[3].device_vectors is None  # a host plan: nothing uploaded


def test_seed_alias_is_the_eager_planner():
    assert msa_interface._msa_plan_from_lengths is mc.msa_plan_from_lengths


@pytest.mark.torch
def test_lengths_from_torch():
    import torch

    info = mc.msa_plan_from_lengths(torch.tensor([3, 4]), torch.tensor([9, 4], dtype=torch.int64), 2)
    np.testing.assert_array_equal(info[3].qo_offset, [6, 0])
    assert isinstance(info[3].qo_lens, np.ndarray)


# ----------------------------------------------------------------------------- eager refusals


EAGER_ERRORS = [
    ("qo-2d", ([[1, 2]], [[3, 4]], 4), {}, ValueError),
    ("shape-mismatch", ([1, 2], [3], 4), {}, ValueError),
    ("three-positionals", ([1], [3], 4, 2, 1), {}, TypeError),
    ("missing-num-qo-heads", ([1], [3]), {}, TypeError),
    ("heads-not-divisible", ([1], [3], 6, 4), {}, ValueError),
    ("unexpected-keyword", ([1], [3], 4), {"bogus": 1}, TypeError),
    ("num-qo-heads-twice", ([1], [3], 4), {"num_qo_heads": 4}, TypeError),
    ("num-kv-heads-twice", ([1], [3], 4, 2), {"num_kv_heads": 2}, TypeError),
    ("topk-5", ([1], [3], 4), {"page_size": 128, "kv_block_num": 5}, ValueError),
    ("forced-exceed-topk", ([1], [3], 4), {"page_size": 128, "kv_block_num": 4, "force_begin_blocks": 3,
                                           "force_end_blocks": 2}, ValueError),
    ("forced-negative", ([1], [3], 4), {"page_size": 128, "kv_block_num": 4, "force_begin_blocks": -1}, ValueError),
    ("width-over-64", ([1], [3], 4), {"page_size": 128, "kv_block_num": 64, "force_begin_blocks": 1,
                                      "force_blocks_count_in_topk": False}, ValueError),
    ("forced-without-sparse", ([1], [3], 4), {"force_end_blocks": 1}, ValueError),
    ("sparse-without-pages", ([1], [3], 4), {"kv_block_num": 8}, ValueError),
    ("sparse-bad-kernel-mode", ([1], [3], 4), {"page_size": 128, "kv_block_num": 8,
                                               "sparse_kernel_mode": "fast"}, ValueError),
    ("sparse-page-64", ([1], [3], 4), {"page_size": 64, "kv_block_num": 8}, ValueError),
    ("sparse-block-64", ([1], [3], 4), {"page_size": 64, "sparse_block_size": 64, "kv_block_num": 8}, ValueError),
    ("maxscore-page-64", ([1], [3], 4), {"page_size": 64, "output_maxscore": True}, ValueError),
    ("offset-wrong-length", ([1, 2], [3, 4], 4), {"qo_offset": np.array([1, 2, 3])}, ValueError),
    ("offset-2d", ([1, 2], [3, 4], 4), {"qo_offset": np.array([[1, 2]])}, ValueError),
    ("negative-length", ([1, -2], [3, 4], 4), {}, ValueError),
    ("zero-heads", ([1], [3], 0), {}, ValueError),
    ("page-size-48", ([1], [3], 4), {"page_size": 48}, NotImplementedError),
    ("sparse-page-size-96", ([1], [3], 4), {"page_size": 96, "kv_block_num": 4}, NotImplementedError),
    ("usable-sm-zero", ([1], [3], 4), {"usable_SM_count": 0}, ValueError),
    ("usable-sm-float", ([1], [3], 4), {"usable_SM_count": 1.5}, ValueError),
    ("device-name", ([1], [3], 4), {"device": "tpu"}, ValueError),
    ("device-negative", ([1], [3], 4), {"device": -1}, ValueError),
    ("prefill-tile-query", ([1], [3], 4), {"prefill_tile": "ws2n128s2"}, ValueError),
    # totals and offsets beyond int32 (the plan's cumulative offsets), never wrapped
    ("q-total-over-int32", ([2**30, 2**30], [100, 200], 8, 2), {"device": "cpu"}, ValueError),
    ("k-total-over-int32", ([3, 5], [2**31 - 1] * 2, 8, 2), {"device": "cpu"}, ValueError),
    ("offset-float32-2**31", ([3, 5], [100, 200], 8, 2), {"qo_offset": np.array([2**31, 0], np.float32)},
     ValueError),
    ("offset-int-2**40", ([3, 5], [100, 200], 8, 2), {"qo_offset": 2**40}, ValueError),
    # integer options are ints or whole floats (fractions were truncated; strings and bools converted)
    ("heads-fractional", ([1], [3], 8.5), {}, ValueError),
    ("heads-str", ([1], [3], "8"), {}, TypeError),
    ("kv-heads-fractional", ([1], [3], 8, 2.5), {}, ValueError),
    ("page-size-bool", ([1], [3], 4), {"page_size": True}, TypeError),
    ("kv-splits-fractional", ([1], [3], 4), {"num_kv_splits": 2.5}, ValueError),
    ("forced-fractional", ([1], [3], 4), {"page_size": 128, "kv_block_num": 4, "force_begin_blocks": 2.5},
     ValueError),
]


@pytest.mark.parametrize("args, kw, exc", [pytest.param(a, k, e, id=i) for i, a, k, e in EAGER_ERRORS])
def test_eager_planner_refusals(args, kw, exc):
    with pytest.raises(exc):
        mc.msa_plan_from_lengths(*args, **kw)


# ----------------------------------------------------------------------------- static plans


def test_static_plan_fields():
    info = mc.msa_plan(4, 16, 4096, 16, num_kv_heads=2, page_size=128, total_seqlen_k=65536, kv_block_num=16)
    assert info[:3] == (False, 0, 4) and info[4] is None
    p = info[3]
    assert p.is_static and p.mode == "sparse_decode" and p.kv_page_indptr is None
    assert p.prefill_plan.total_seqlen_k == 65536 and p.prefill_plan.max_seqlen_k == 4096
    assert p.prefill_plan.max_seqlen_q == 16 and p.selected_block_count == 16
    for vec in (p.qo_lens, p.kv_lens, p.qo_offset):
        np.testing.assert_array_equal(vec, np.zeros(4))
    np.testing.assert_array_equal(p.prefill_plan.cu_seqlens_q, np.zeros(5))
    assert p.decode_plan is not None and p.decode_plan.page_size == 128


@pytest.mark.parametrize(
    "kw, mode",
    [({}, "dense"), ({"page_size": 16}, "paged"), ({"page_size": 128, "kv_block_num": 4}, "sparse_prefill"),
     ({"page_size": 128, "kv_block_num": 4, "sparse_kernel_mode": "decode"}, "sparse_decode")],
    ids=["dense", "paged", "sparse-prefill", "sparse-decode"],
)
def test_static_modes(kw, mode):
    p = mc.msa_plan(2, 512, 1024, 8, **kw)[3]
    assert p.mode == mode and p.is_static
    assert p.prefill_plan.total_seqlen_k == 1024  # defaults to max_seqlen_k


STATIC_ERRORS = [
    ("zero-q-heads", (2, 8, 8, 0), {}, ValueError),
    ("zero-kv-heads", (2, 8, 8, 4), {"num_kv_heads": 0}, ValueError),
    ("not-divisible", (2, 8, 8, 6), {"num_kv_heads": 4}, ValueError),
    ("negative-batch", (-1, 8, 8, 4), {}, ValueError),
    ("zero-max-q", (2, 0, 8, 4), {}, ValueError),
    ("zero-max-k", (2, 8, 0, 4), {}, ValueError),
    ("total-below-max", (2, 8, 64, 4), {"total_seqlen_k": 32}, ValueError),
    ("total-not-positive", (2, 8, 64, 4), {"total_seqlen_k": -5}, ValueError),
    ("sparse-without-pages", (2, 8, 64, 4), {"kv_block_num": 8}, ValueError),
    ("sparse-mode-name", (2, 8, 64, 4), {"kv_block_num": 8, "page_size": 128, "sparse_kernel_mode": "x"}, ValueError),
    ("sparse-page-64", (2, 8, 64, 4), {"kv_block_num": 8, "page_size": 64}, ValueError),
    ("maxscore-page-32", (2, 8, 64, 4), {"page_size": 32, "output_maxscore": True}, ValueError),
    ("topk-12", (2, 8, 64, 4), {"kv_block_num": 12, "page_size": 128}, ValueError),
    ("forced-without-sparse", (2, 8, 64, 4), {"force_begin_blocks": 1}, ValueError),
    ("unknown-keyword", (2, 8, 64, 4), {"qo_offset": 3}, TypeError),
    ("page-size-24", (2, 8, 64, 4), {"page_size": 24}, NotImplementedError),
    ("batch-2**40", (2**40, 64, 128, 8), {}, ValueError),
    ("rows-over-int32", (2**20, 2**12, 128, 8), {}, ValueError),
    ("max-k-inf", (2, 64, float("inf"), 8), {}, ValueError),
    ("batch-fractional", (2.5, 8, 8, 4), {}, ValueError),
    ("heads-bool", (2, 8, 8, True), {}, TypeError),
]


def test_string_and_nan_arguments_are_value_errors_too():
    """The reproduced API converts with int(): 'abc' and NaN raise ValueError there; here the
    error is both a TypeError and a ValueError."""
    for args in ((2, 8, 64, "abc"), (float("nan"), 8, 64, 4)):
        with pytest.raises(ValueError):
            mc.msa_plan(*args)
    with pytest.raises(TypeError, match="num_qo_heads must be an int, got str 'abc'"):
        mc.msa_plan(2, 8, 64, "abc")
    info = mc.msa_plan(2.0, 8.0, 64.0, 4.0)  # whole floats are their integers
    assert (info[3].batch_size, info[3].num_qo_heads) == (2, 4) and type(info[3].batch_size) is int


def test_planners_take_numpy_integers():
    info = mc.msa_plan(np.int64(2), np.int32(8), np.int64(64), np.int64(4), num_kv_heads=np.int32(2))
    assert (info[3].batch_size, info[3].num_qo_heads, info[3].num_kv_heads) == (2, 4, 2)
    info = mc.msa_plan_from_lengths([1, 2], [3, 4], np.int64(4), np.int64(-1), device="cpu")
    assert info[3].num_kv_heads == 4


@pytest.mark.parametrize("args, kw, exc", [pytest.param(a, k, e, id=i) for i, a, k, e in STATIC_ERRORS])
def test_static_planner_refusals(args, kw, exc):
    with pytest.raises(exc):
        mc.msa_plan(*args, **kw)


# ----------------------------------------------------------------------------- prefill tile option


def test_prefill_tile_option_in_eager_static_and_sparse_plans():
    eager = mc.msa_plan_from_lengths([1, 300], [500, 600], 16, 2, page_size=128, kv_block_num=16,
                                     prefill_tile="gather")
    assert eager[0] and eager[3].prefill_tile == eager[4].prefill_tile == "gather"  # both parts of a split
    assert mc.msa_plan(2, 512, 1024, 8, prefill_tile="gather")[3].prefill_tile == "gather"
    assert mc.sparse_msa_plan([300], [600], 16, 1, prefill_tile="gather", **SPARSE)[3].prefill_tile == "gather"
    assert mc.msa_plan_from_lengths([3], [5], 4)[3].prefill_tile == "gather"  # the default
    assert mc.msa_plan_from_lengths([3], [5], 4, prefill_tile=None)[3].prefill_tile == "gather"
    assert mc.msa_plan(1, 8, 8, 4)[3].prefill_tile == "gather"
    assert mc.sparse_msa_plan([300], [600], 16, 1, prefill_tile="query", **SPARSE)[3].prefill_tile == "query"
    for bad in ("nope", "", 3, "prefill", "ws2n128s3", "mma256"):  # query tiles are not options
        with pytest.raises(ValueError, match="prefill_tile"):
            mc.msa_plan_from_lengths([3], [5], 4, prefill_tile=bad)
        with pytest.raises(ValueError, match="prefill_tile"):
            mc.msa_plan(1, 8, 8, 4, prefill_tile=bad)


def test_no_tile_environment_variables():
    from mate_cupy.msa import attention_launch as al
    from mate_cupy.msa import execute as ex

    for mod in (al, ex):
        src = open(mod.__file__).read()
        assert "environ" not in src and "MATE_CUPY_ATTN" not in src


# ----------------------------------------------------------------------------- signatures


@pytest.mark.parametrize("fn", ["msa_plan_from_lengths", "sparse_msa_plan", "msa_plan", "msa", "sparse_msa",
                                "sparse_decode_atten_func", "upload_plan"])
def test_public_signatures_are_explicit(fn):
    import inspect

    params = inspect.signature(getattr(mc, fn)).parameters.values()
    assert not [p for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def test_eager_planner_keeps_the_seed_positional_order():
    import inspect

    params = list(inspect.signature(mc.msa_plan_from_lengths).parameters.values())
    assert [p.name for p in params[:4]] == ["qo_segment_lens", "kv_segment_lens", "num_qo_heads", "num_kv_heads"]
    assert all(p.kind is p.KEYWORD_ONLY for p in params[4:])
    names = {p.name for p in params}
    assert {"usable_SM_count", "device", "stream", "qo_offset", "split_prefill_decode"} <= names
    info = mc.msa_plan_from_lengths([2, 3], [5, 6], 8, 2)
    assert (info[3].num_qo_heads, info[3].num_kv_heads) == (8, 2)


# ----------------------------------------------------------------------------- devices, upload, workspace


@pytest.mark.parametrize("device, index", [(3, 3), ("cuda:2", 2), ("CUDA:0", 0), ("cpu", None)])
def test_device_index(device, index):
    from mate_cupy.msa.plan import device_index

    assert device_index(device) == index


@pytest.mark.torch
def test_device_index_of_torch_devices():
    import torch

    from mate_cupy.msa.plan import device_index

    assert device_index(torch.device("cuda", 1)) == 1 and device_index(torch.device("cpu")) is None


@pytest.mark.parametrize("bad", ["cuda:x", "npu", 1.0, object()])
def test_device_index_refusals(bad):
    from mate_cupy.msa.plan import device_index

    with pytest.raises(ValueError, match="device"):
        device_index(bad)


def test_stream_address():
    from mate_cupy.msa.plan import stream_address

    class TorchLike:
        cuda_stream = 1234

    class CupyLike:
        ptr = 99

    assert stream_address(None) is None and stream_address(7) == 7
    assert stream_address(TorchLike()) == 1234 and stream_address(CupyLike()) == 99
    with pytest.raises(TypeError, match="stream"):
        stream_address("default")


def test_upload_to_the_host_is_refused():
    info = mc.msa_plan_from_lengths([2], [5], 8)
    with pytest.raises(ValueError, match="CUDA device"):
        info[3].upload("cpu")
    with pytest.raises(ValueError, match="CUDA device"):
        mc.upload_plan(info, device="cpu")
    with pytest.raises(TypeError):
        mc.upload_plan("not a plan", device="cpu")


def test_plans_own_their_device_state():
    info = mc.msa_plan_from_lengths([1, 300], [10, 400], 8, 1, page_size=128)
    for plan in info[3:]:
        assert plan.device_vectors is None and plan.workspace is None
    assert info[3].total_q == 1 and info[4].total_q == 300
    static = mc.msa_plan(4, 16, 4096, 16, num_kv_heads=1, page_size=128, kv_block_num=16)[3]
    assert static.total_q == 4 * 16 and static.device_vectors is None
    from mate_cupy.msa import attention_launch

    assert not hasattr(attention_launch, "_WORKSPACES")


def test_not_uploaded_message_says_how():
    from mate_cupy.msa.runtime import not_uploaded

    err = not_uploaded("msa", 1)
    assert isinstance(err, ValueError)
    assert "upload(device=1)" in str(err) and "upload_plan" in str(err) and "device=" in str(err)


# ----------------------------------------------------------------------------- sparse_msa_plan


def test_sparse_msa_plan_forces_prefill_and_no_split():
    info = mc.sparse_msa_plan([1, 300], [500, 600], 16, 2, **SPARSE)
    assert info[0] is False and info[3].mode == "sparse_prefill" and info[3].batch_size == 2
    info = mc.sparse_msa_plan([1], [500], 16, 2, sparse_kernel_mode="decode", **SPARSE)
    assert info[3].mode == "sparse_prefill"  # the mode is always prefill


@pytest.mark.parametrize(
    "kw, exc",
    [({"page_size": 128}, ValueError), ({}, ValueError), ({"split_prefill_decode": True, **SPARSE}, ValueError),
     ({"bogus": 1, **SPARSE}, TypeError)],
    ids=["not-sparse-paged", "not-sparse-dense", "mixed-batch", "unknown-keyword"],
)
def test_sparse_msa_plan_refusals(kw, exc):
    with pytest.raises(exc):
        mc.sparse_msa_plan([1, 300], [500, 600], 16, 2, **kw)


def test_plan_info_must_be_a_plan():
    q = np.zeros((1, 1, 8), np.float16)
    with pytest.raises(TypeError):
        mc.msa(q, q, q, (1, 2, 3))
    with pytest.raises(TypeError):
        mc.msa(q, q, q, "plan")


@settings(max_examples=200, deadline=None)
@given(
    qo=st.lists(st.integers(0, 300), min_size=0, max_size=8),
    extra=st.lists(st.integers(0, 500), min_size=8, max_size=8),
    sparse=st.booleans(),
    split=st.booleans(),
)
def test_eager_plan_properties(qo, extra, sparse, split):
    kv = [q + e for q, e in zip(qo, extra)]
    kw = dict(SPARSE) if sparse else {"page_size": 16}
    mixed, cut, batch, first, second = mc.msa_plan_from_lengths(qo, kv, 8, 2, split_prefill_decode=split, **kw)
    threshold = 32 if sparse else 128
    big = [i for i, q in enumerate(qo) if q > threshold]
    expect = big[0] if (split and big) else 0
    assert batch == len(qo) and cut == expect and mixed == (expect > 0)
    parts = [(first, 0, expect), (second, expect, len(qo))] if mixed else [(first, 0, len(qo))]
    for plan, lo, hi in parts:
        np.testing.assert_array_equal(plan.qo_lens, qo[lo:hi])
        np.testing.assert_array_equal(plan.qo_offset, np.subtract(kv[lo:hi], qo[lo:hi]))
        pf = plan.prefill_plan
        np.testing.assert_array_equal(pf.cu_seqlens_q, np.cumsum([0] + qo[lo:hi]))
        np.testing.assert_array_equal(pf.cu_seqlens_k, np.cumsum([0] + kv[lo:hi]))
        assert pf.max_seqlen_q == max(qo[lo:hi], default=0) and pf.total_seqlen_k == sum(kv[lo:hi])
        ps = plan.page_size
        np.testing.assert_array_equal(plan.kv_page_indptr, np.cumsum([0] + [-(-x // ps) for x in kv[lo:hi]]))
        if sparse:
            want = "sparse_prefill" if pf.max_seqlen_q > 32 else "sparse_decode"
        else:
            want = "paged"
        assert plan.mode == want
        if mixed and plan is first:
            assert pf.max_seqlen_q <= threshold


def test_workspace_and_upload_are_exported():
    from mate_cupy.runtime.workspace import Workspace

    assert mc.Workspace is Workspace and "Workspace" in msa_interface.__all__
    assert mc.upload_plan is msa_interface.upload_plan and "upload_plan" in msa_interface.__all__
    assert callable(mc.MsaPlan.upload) and callable(mc.MsaPlan.workspace_bytes)


def test_lengths_must_be_whole_numbers():
    import mate_cupy as mc

    plan = mc.msa_plan_from_lengths(np.array([3.0, 5.0]), np.array([7.0, 9.0]), 4, 1, device="cpu")
    assert plan[3].qo_lens.tolist() == [3, 5] and plan[3].kv_lens.tolist() == [7, 9]
    with pytest.raises(ValueError, match=r"qo_segment_lens must hold whole numbers, got 2\.5 at index 1"):
        mc.msa_plan_from_lengths([3.0, 2.5], [7, 9], 4, 1, device="cpu")
    with pytest.raises(ValueError, match="whole numbers"):
        mc.msa_plan_from_lengths([3, 5], np.array([7.0, np.nan]), 4, 1, device="cpu")
    with pytest.raises(ValueError, match="fit in int32"):
        mc.msa_plan_from_lengths(np.array([3, 2**31]), [7, 9], 4, 1, device="cpu")
    with pytest.raises(TypeError, match="must hold integers"):
        mc.msa_plan_from_lengths(np.array(["3", "5"]), [7, 9], 4, 1, device="cpu")


def test_host_vector_takes_only_the_plan_vectors():
    plan = mc.msa_plan_from_lengths([1, 2], [3, 4], 4, device="cpu")[3]
    np.testing.assert_array_equal(plan.host_vector("cu_seqlens_k"), [0, 3, 7])
    np.testing.assert_array_equal(plan.host_vector("qo_lens"), [1, 2])
    for bad in ("bogus", "batch_size", "prefill_plan", "__class__"):
        with pytest.raises(ValueError, match="host_vector name must be one of"):
            plan.host_vector(bad)
