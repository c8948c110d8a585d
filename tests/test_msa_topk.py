"""sparse_topk_select on host arrays: brute-force selection by sorting, properties, refusals."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mate_cupy as mc
from mate_cupy.reference import msa as R


def brute_topk(ms, topk, valid=None, begin=0, end=0, in_topk=True, qpos=None):
    """Row by row with Python's sort: forced blocks, then best scores (NaN last, ties low index)."""
    total_q, hq, nt = ms.shape
    width = topk if in_topk else topk + begin + end
    out = np.full((total_q, hq, width), -1, dtype=np.int32)
    for i in range(total_q):
        v = nt if valid is None else valid
        if qpos is not None:
            v = max(0, min(v, qpos[i] // 128 + 1))
        for h in range(hq):
            forced = set(range(min(begin, v))) | set(range(max(v - end, 0), v))
            rest = [t for t in range(v) if t not in forced]
            rest.sort(key=lambda t: (1, 0.0, t) if np.isnan(ms[i, h, t]) else (0, -float(ms[i, h, t]), t))
            chosen = sorted(forced | set(rest[: width - len(forced)]))
            out[i, h, : len(chosen)] = chosen
    return out


CASES = [
    pytest.param(dict(topk=4), id="plain"),
    pytest.param(dict(topk=4, begin=1, end=1), id="forced-in-topk"),
    pytest.param(dict(topk=4, begin=2, end=3, in_topk=False), id="forced-extra"),
    pytest.param(dict(topk=8, begin=4, end=4), id="all-forced"),
    pytest.param(dict(topk=4, valid=6), id="num-valid-pages"),
    pytest.param(dict(topk=16, valid=20, begin=1), id="valid-near-width"),
    pytest.param(dict(topk=8, valid=5), id="identity"),
    pytest.param(dict(topk=4, begin=1, end=2, qpos=True), id="query-positions"),
    pytest.param(dict(topk=16, begin=3, end=3, in_topk=False, qpos=True), id="query-positions-extra"),
    pytest.param(dict(topk=32, begin=1, end=1), id="topk-32"),
    pytest.param(dict(topk=64), id="topk-64"),
]


def _scores(rng, shape, ties=True, specials=True):
    ms = rng.standard_normal(shape).astype(np.float32)
    if ties:
        ms = np.round(ms * 2) / 2  # many ties
    if specials:
        mask = rng.random(shape)
        ms[mask < 0.05] = np.nan
        ms[(mask >= 0.05) & (mask < 0.1)] = -np.inf
        ms[(mask >= 0.1) & (mask < 0.12)] = np.inf
    return ms


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("nt", [7, 40, 130])
def test_topk_matches_brute_force(rng, case, nt):
    case = dict(case)
    total_q, hq = 9, 3
    ms = _scores(rng, (total_q, hq, nt))
    qpos = None
    if case.pop("qpos", False):
        qpos = rng.integers(-200, nt * 128 + 300, size=total_q).astype(np.int64)
        qpos[0], qpos[1] = -1, 0
    valid = case.pop("valid", None)
    if valid is not None and valid > nt:
        valid = nt
    topk, begin, end, in_topk = case["topk"], case.get("begin", 0), case.get("end", 0), case.get("in_topk", True)
    got = mc.sparse_topk_select(ms, topk, num_valid_pages=valid, force_begin_blocks=begin, force_end_blocks=end,
                                force_blocks_count_in_topk=in_topk, query_positions=qpos)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, brute_topk(ms, topk, valid, begin, end, in_topk, qpos))
    np.testing.assert_array_equal(R.topk_select(ms, topk, valid, begin, end, in_topk, qpos), got)


def test_nan_ranks_below_minus_inf_and_ties_go_low():
    ms = np.array([[[np.nan, -np.inf, 1.0, 1.0, 1.0, np.nan, -np.inf, 0.5]]], dtype=np.float32)
    np.testing.assert_array_equal(mc.sparse_topk_select(ms, 4), [[[2, 3, 4, 7]]])
    ms = np.array([[[np.nan, -np.inf, np.nan, -np.inf, np.nan, 2.0]]], dtype=np.float32)
    np.testing.assert_array_equal(mc.sparse_topk_select(ms, 4), [[[0, 1, 3, 5]]])  # 2.0, -inf, -inf, first NaN


def test_identity_path_takes_every_valid_block():
    ms = np.full((2, 1, 10), np.nan, dtype=np.float32)
    got = mc.sparse_topk_select(ms, 8, num_valid_pages=6)
    np.testing.assert_array_equal(got, np.tile([0, 1, 2, 3, 4, 5, -1, -1], (2, 1, 1)))


def test_preallocated_output_and_empty_batch(rng):
    ms = _scores(rng, (4, 2, 20))
    out = np.full((4, 2, 6), 77, dtype=np.int32)
    res = mc.sparse_topk_select(ms, 4, output=out, force_begin_blocks=1, force_end_blocks=1,
                                force_blocks_count_in_topk=False)
    assert res is out
    np.testing.assert_array_equal(out, brute_topk(ms, 4, None, 1, 1, False))
    empty = mc.sparse_topk_select(np.zeros((0, 2, 20), np.float32), 4)
    assert empty.shape == (0, 2, 4)


@pytest.mark.torch
def test_torch_cpu_in_torch_out(rng):
    import torch

    ms = _scores(rng, (5, 2, 33))
    got = mc.sparse_topk_select(torch.from_numpy(ms), 8, query_positions=torch.arange(5, dtype=torch.int64) * 900)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.int32
    np.testing.assert_array_equal(got.numpy(), brute_topk(ms, 8, qpos=np.arange(5) * 900))


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    total_q=st.integers(0, 5),
    hq=st.integers(1, 3),
    nt=st.integers(1, 80),
    topk=st.sampled_from([4, 8, 16]),
    begin=st.integers(0, 5),
    end=st.integers(0, 5),
    in_topk=st.booleans(),
    use_qpos=st.booleans(),
)
def test_topk_property(data, total_q, hq, nt, topk, begin, end, in_topk, use_qpos):
    if in_topk and begin + end > topk:
        begin, end = 0, 0
    vals = st.sampled_from([0.0, 1.0, -1.0, 2.5, float("nan"), float("inf"), float("-inf")]) | st.floats(-3, 3, width=32)
    ms = np.array(data.draw(st.lists(vals, min_size=total_q * hq * nt, max_size=total_q * hq * nt)),
                  dtype=np.float32).reshape(total_q, hq, nt)
    valid = data.draw(st.none() | st.integers(1, nt))
    qpos = None
    if use_qpos:
        qpos = np.array(data.draw(st.lists(st.integers(-300, nt * 128 + 200), min_size=total_q, max_size=total_q)),
                        dtype=np.int64)
    got = mc.sparse_topk_select(ms, topk, num_valid_pages=valid, force_begin_blocks=begin, force_end_blocks=end,
                                force_blocks_count_in_topk=in_topk, query_positions=qpos)
    want = brute_topk(ms, topk, valid, begin, end, in_topk, qpos)
    np.testing.assert_array_equal(got, want)
    # structural properties: ascending ids, then -1; forced blocks present; ids valid
    width = topk if in_topk else topk + begin + end
    assert got.shape == (total_q, hq, width)
    for i in range(total_q):
        v = nt if valid is None else valid
        if qpos is not None:
            v = max(0, min(v, qpos[i] // 128 + 1))
        for h in range(hq):
            row = got[i, h]
            ids = row[row >= 0]
            assert np.all(np.diff(ids) > 0) and np.all(ids < v)
            assert np.all(row[len(ids):] == -1)
            assert len(ids) == min(v, width)
            assert set(range(min(begin, v))) | set(range(max(v - end, 0), v)) <= set(ids.tolist())


ERRORS = [
    ("float64-scores", lambda: (np.zeros((2, 2, 8)), 4), {}, TypeError),
    ("rank-2", lambda: (np.zeros((2, 8), np.float32), 4), {}, ValueError),
    ("non-contiguous", lambda: (np.zeros((2, 2, 16), np.float32)[:, :, ::2], 4), {}, ValueError),
    ("zero-heads", lambda: (np.zeros((2, 0, 8), np.float32), 4), {}, ValueError),
    ("zero-tiles", lambda: (np.zeros((2, 2, 0), np.float32), 4), {}, ValueError),
    ("too-many-tiles", lambda: (np.zeros((1, 1, 12288), np.float32), 4), {}, ValueError),
    ("qpos-int32", lambda: (np.zeros((2, 2, 8), np.float32), 4), {"query_positions": np.zeros(2, np.int32)}, TypeError),
    ("qpos-shape", lambda: (np.zeros((2, 2, 8), np.float32), 4), {"query_positions": np.zeros(3, np.int64)}, ValueError),
    ("qpos-strided", lambda: (np.zeros((2, 2, 8), np.float32), 4),
     {"query_positions": np.zeros(4, np.int64)[::2]}, ValueError),
    ("valid-zero", lambda: (np.zeros((2, 2, 8), np.float32), 4), {"num_valid_pages": 0}, ValueError),
    ("valid-past-nt", lambda: (np.zeros((2, 2, 8), np.float32), 4), {"num_valid_pages": 9}, ValueError),
    ("topk-5", lambda: (np.zeros((2, 2, 8), np.float32), 5), {}, ValueError),
    ("topk-0", lambda: (np.zeros((2, 2, 8), np.float32), 0), {}, ValueError),
    ("forced-over-topk", lambda: (np.zeros((2, 2, 8), np.float32), 4),
     {"force_begin_blocks": 3, "force_end_blocks": 2}, ValueError),
    ("forced-negative", lambda: (np.zeros((2, 2, 8), np.float32), 4), {"force_end_blocks": -1}, ValueError),
    ("width-over-64", lambda: (np.zeros((2, 2, 8), np.float32), 64),
     {"force_begin_blocks": 1, "force_blocks_count_in_topk": False}, ValueError),
    ("output-int64", lambda: (np.zeros((2, 2, 8), np.float32), 4), {"output": np.zeros((2, 2, 4), np.int64)}, TypeError),
    ("output-shape", lambda: (np.zeros((2, 2, 8), np.float32), 4), {"output": np.zeros((2, 2, 5), np.int32)}, ValueError),
    ("output-strided", lambda: (np.zeros((2, 2, 8), np.float32), 4),
     {"output": np.zeros((2, 2, 8), np.int32)[:, :, ::2]}, ValueError),
    ("not-an-array", lambda: ("scores", 4), {}, TypeError),
    ("topk-fractional", lambda: (np.zeros((2, 2, 8), np.float32), 4.5), {}, ValueError),
    ("topk-str", lambda: (np.zeros((2, 2, 8), np.float32), "4"), {}, TypeError),
    ("valid-fractional", lambda: (np.zeros((2, 2, 8), np.float32), 4), {"num_valid_pages": 2.5}, ValueError),
    ("forced-fractional", lambda: (np.zeros((2, 2, 8), np.float32), 4), {"force_begin_blocks": 1.5}, ValueError),
]


@pytest.mark.parametrize("make, kw, exc", [pytest.param(m, k, e, id=i) for i, m, k, e in ERRORS])
def test_topk_refusals(make, kw, exc):
    with pytest.raises(exc):
        mc.sparse_topk_select(*make(), **kw)


# ---------------------------------------------------------------------------- one validation for both paths


def _on_cuda(a):
    """The same array described as if it lived on cuda:0: validation reads only metadata,
    so a CUDA input with these shapes, dtypes and strides meets the same checks."""
    from mate_cupy.runtime.interop import Arg

    if a is None:
        return None
    return Arg(a.name, a.obj, a.dtype, "cupy", 0, a.shape, a.strides, a.ptr, data=a.data)


def _validate(device_arg, args, kw):
    from mate_cupy.msa.topk import validate_topk
    from mate_cupy.runtime.interop import wrap

    ms, topk = args
    arg = lambda name: None if kw.get(name) is None else device_arg(wrap(name, kw[name]))  # noqa: E731
    return validate_topk(device_arg(wrap("max_score", ms)), topk, kw.get("num_valid_pages"), arg("output"),
                         kw.get("force_begin_blocks", 0), kw.get("force_end_blocks", 0),
                         kw.get("force_blocks_count_in_topk", True), arg("query_positions"))


@pytest.mark.parametrize("make, kw, exc", [pytest.param(m, k, e, id=i) for i, m, k, e in ERRORS if i != "not-an-array"])
def test_topk_refusals_are_the_same_for_host_and_cuda_inputs(make, kw, exc):
    """validate_topk (the one validation of both paths) refuses the CUDA description of
    each refused host input with the same exception and message."""
    messages = []
    for device_arg in (lambda a: a, _on_cuda):
        with pytest.raises(exc) as info:
            _validate(device_arg, make(), kw)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


def test_topk_problem_is_the_same_for_host_and_cuda_inputs():
    args = (np.zeros((3, 2, 40), np.float32), 8)
    kw = dict(num_valid_pages=30, force_begin_blocks=1, force_end_blocks=2, force_blocks_count_in_topk=False,
              query_positions=np.arange(3, dtype=np.int64), output=np.zeros((3, 2, 11), np.int32))
    host, cuda = _validate(lambda a: a, args, kw), _validate(_on_cuda, args, kw)
    assert (host.device, cuda.device) == (-1, 0)
    assert dataclasses.replace(host, device=0) == cuda
    assert (host.width, host.free_slots, host.rows, host.num_valid_pages) == (11, 8, 6, 30)


# ----------------------------------------------------------------------------- positions from a plan


def _causal_prefill_scores(rng, qo, kv, hq=4, hkv=1, d=128):
    total_q, total_k = sum(qo), sum(kv)
    q = rng.standard_normal((total_q, hq, d)).astype(np.float32)
    k = rng.standard_normal((total_k, hkv, d)).astype(np.float32)
    cu_q, cu_k = np.concatenate([[0], np.cumsum(qo)]), np.concatenate([[0], np.cumsum(kv)])
    return R.block_max_score(q, k, cu_q, cu_k, causal=True, max_k_tiles=-(-max(kv) // 128)).astype(np.float32)


def test_plan_positions_keep_a_causal_prefill_off_masked_blocks(rng):
    qo, kv = [300, 40], [300, 700]  # a prefill from scratch, then a chunk continuing at key 660
    plan = mc.msa_plan_from_lengths(qo, kv, 4, 1, device="cpu")
    scores = _causal_prefill_scores(rng, qo, kv)
    pos = mc.plan_query_positions(plan)
    assert pos.dtype == np.int64 and pos.tolist() == list(range(300)) + list(range(660, 700))
    sel = mc.sparse_topk_select(scores, 4, force_begin_blocks=1, force_end_blocks=1, plan_info=plan)
    assert np.array_equal(sel, mc.sparse_topk_select(scores, 4, force_begin_blocks=1, force_end_blocks=1,
                                                     query_positions=pos))
    own_block = (pos // 128)[:, None, None]
    assert np.all((sel == -1) | (sel <= own_block))       # never a block past the query's position
    assert np.all((sel == own_block).any(axis=-1))        # the local block is the forced end block
    blind = mc.sparse_topk_select(scores, 4, force_begin_blocks=1, force_end_blocks=1)
    assert np.any(blind > own_block)  # without positions, early queries are handed masked blocks


def test_plan_positions_refusals():
    static = mc.msa_plan(2, 1, 256, 4, total_seqlen_k=512, num_kv_heads=1)
    scores = np.zeros((2, 4, 4), np.float32)
    with pytest.raises(ValueError, match="static plan"):
        mc.sparse_topk_select(scores, 4, plan_info=static)
    eager = mc.msa_plan_from_lengths([1, 1], [100, 500], 4, 1, device="cpu")
    with pytest.raises(ValueError, match="not both"):
        mc.sparse_topk_select(scores, 4, plan_info=eager, query_positions=np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="query_positions"):
        mc.sparse_topk_select(np.zeros((3, 4, 4), np.float32), 4, plan_info=eager)  # rows != the plan's
