"""The MSA index kernels' own source (cuda_src/msa_index.cu), run on the CPU SIMT
emulator in tests/index_emu through the real launchers, against the float64 references.

Top-k: exact id equality on adversarial rows for every kernel family (streaming warp
kernel at each chunk size, warp and CTA kernels), including rows built to reach each
rare path of the streaming kernel (candidate overflow, cutting the buffer, the chunk's
own best k, the exact-key pass). Max score: dense and paged K, causal and not, GQA,
offsets, every variant, with cp.async copies landing both at issue and at the retiring wait.
The warp-specialised wgmma kernel runs with the emulator's mbarriers (its producer and
consumer warpgroups as real threads). Set MATE_CUPY_EMU_SANITIZE=1 to build the emulator
with ASan/UBSan.
"""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from mate_cupy.msa import index_launch as il
from mate_cupy.msa.topk import TopkProblem, validate_topk
from mate_cupy.reference import msa as ref

from helpers import emulator_or_skip, signed_rows
from test_gpu_index import (BF16, F16, K_VIEW_LAYOUTS, SCORE_KINDS, _check_max_score, _in_order_pages,
                            _k_view_decode_problem, _lengths, _meta, _paged_decode_problem, _positions, _rand, _scores,
                            _width)

BLOCK = 128


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    """(harness module, Emulated runner) standing in for an H200 (132 SMs, sm_90: the
    emulator runs wgmma)."""
    from index_emu import harness

    d = tmp_path_factory.mktemp("index_emu")
    return harness, harness.Emulated(emulator_or_skip(harness.build, d), d / "work")


# ============================================================================ score rows

F32_BITS = np.uint32


def _bits(u) -> np.float32:
    return np.array([u], dtype=np.uint32).view(np.float32)[0]


def special_rows(rng, rows: int, nt: int, k: int, kind: str) -> np.ndarray:
    """[rows, nt] float32 rows aimed at the streaming kernel's rare paths."""
    x = rng.standard_normal((rows, nt)).astype(np.float32)
    for r in range(rows):
        if kind == "inf_head":  # first chunks all -inf: overflow with an empty buffer
            x[r, : min(nt, 1100)] = -np.inf
        elif kind == "tie_flood":  # fewer than k larger scores, the rest one tied value
            x[r] = 0.75
            few = rng.choice(nt, size=min(nt, max(0, k - 3)), replace=False)
            x[r, few] = 2.0 + rng.random(few.size)
        elif kind == "late_ties":  # later chunks repeat the k-th best of the first one
            head = min(nt, 512)
            kth = np.sort(x[r, :head])[-min(k, head)]
            tail = np.arange(head, nt)
            x[r, tail[rng.random(tail.size) < 0.5]] = kth
        elif kind == "zeros":  # T at zero: +0 and -0 tie (fast keys cannot decide)
            x[r] = np.where(rng.random(nt) < 0.5, np.float32(0.0), np.float32(-0.0))
            few = rng.choice(nt, size=min(nt, max(0, k // 2)), replace=False)
            x[r, few] = 1.0 + rng.random(few.size)
        elif kind == "pos_nan":  # a positive NaN competes (fast keys put it on top)
            x[r, rng.choice(nt, size=min(nt, 3), replace=False)] = _bits(0x7FC00001)
        elif kind == "neg_nan":  # few numbers, many NaN payloads of both signs: T below -inf
            pay = rng.choice(np.array([0xFFFFFFFF, 0xFF800001, 0xFFC00000, 0x7FC00000, 0x7F800001], dtype=np.uint32),
                             size=nt)
            x[r] = pay.view(np.float32)
            few = rng.choice(nt, size=min(nt, max(0, k // 3)), replace=False)
            x[r, few] = rng.standard_normal(few.size).astype(np.float32)
            x[r, rng.choice(nt, size=min(nt, 2), replace=False)] = -np.inf
        elif kind == "neg_nan_only":  # negative NaNs only (distinct fast keys), few numbers
            pay = rng.choice(np.array([0xFFFFFFFF, 0xFF800001, 0xFFC00000, 0xFFC12345], dtype=np.uint32), size=nt)
            x[r] = pay.view(np.float32)
            few = rng.choice(nt, size=min(nt, max(0, k // 3)), replace=False)
            x[r, few] = rng.standard_normal(few.size).astype(np.float32)
        elif kind == "denormal_ties":
            x[r] = np.float32(1e-42) * rng.integers(-3, 4, size=nt).astype(np.float32)
        elif kind == "increasing":  # the bound rises every chunk
            x[r] = np.linspace(-5, 5, nt, dtype=np.float32) + 1e-3 * rng.standard_normal(nt).astype(np.float32)
        elif kind == "decreasing":
            x[r] = np.linspace(5, -5, nt, dtype=np.float32) + 1e-3 * rng.standard_normal(nt).astype(np.float32)
        else:
            raise ValueError(kind)
    return x


SPECIAL_KINDS = ("inf_head", "tie_flood", "late_ties", "zeros", "pos_nan", "neg_nan", "neg_nan_only",
                 "denormal_ties", "increasing", "decreasing")


def _select(H, emu, ms, topk, nvp, begin, end, count_in, qp, kernel=None, npt=None, cap=None):
    """Run one selection in the emulator: the automatic choice, or ``kernel`` ("stream" /
    "block") with its chunk size ``npt`` / candidate capacity ``cap`` replaced."""
    width = _width(topk, begin, end, count_in)
    out = np.full(ms.shape[:2] + (width,), -7, dtype=np.int32)
    args = H.wrap(ms, "max_score"), H.wrap(out, "output"), H.wrap(qp, "query_positions")
    problem = validate_topk(args[0], topk, nvp, args[1], begin, end, count_in, args[2])
    if kernel is None:
        config = il.select_topk_config(problem)
    elif kernel == "stream":
        config = il.stream_topk_config(problem)
        config = config if npt is None else dataclasses.replace(config, scores_per_thread=npt)
    else:
        config = il.block_topk_config(problem)
        config = config if cap is None else dataclasses.replace(config, candidate_capacity=cap)
    emu(il.launch_topk, problem, config, *args, 0)
    return out


# ============================================================================ top-k

STREAM_NTS = [1, 5, 40, 64, 255, 256, 257, 600, 1024, 1025, 2049, 4100, 8192, 12287]


@pytest.mark.slow
@pytest.mark.parametrize("npt", il.STREAM_NPT)
@pytest.mark.parametrize("nt", STREAM_NTS)
def test_stream_topk_emulated_exact(emu, rng, nt, npt):
    """Streaming kernel, every chunk size, random flags, every score kind (rows of one
    launch mix the kinds), plus rows aimed at each rare path."""
    H, run = emu
    configs = [(16, 0, 0, True, None, False), (8, 1, 2, False, None, True), (32, 2, 2, True, None, False),
               (4, 0, 1, True, max(1, nt // 2), True), (16, 1, 0, True, None, True), (32, 6, 6, True, nt, False)]
    for topk, begin, end, count_in, nvp, use_qp in configs:
        kinds = list(SCORE_KINDS) + list(SPECIAL_KINDS)
        hq = 2
        total_q = len(kinds)
        ms = np.empty((total_q, hq, nt), dtype=np.float32)
        k = max(1, _width(topk, begin, end, count_in) - begin - end)
        for i, kind in enumerate(kinds):
            ms[i] = _scores(rng, (hq, nt), kind) if kind in SCORE_KINDS else special_rows(rng, hq, nt, k, kind)
        qp = _positions(rng, total_q, nt) if use_qp else None
        if use_qp:
            qp[::3] = nt * BLOCK + 5  # some rows see every block
        want = ref.topk_select(ms, topk, nvp, begin, end, count_in, qp)
        got = _select(H, run, ms, topk, nvp, begin, end, count_in, qp, kernel="stream", npt=npt)
        bad = np.argwhere((got != want).any(-1))
        assert bad.shape[0] == 0, (nt, npt, topk, begin, end, count_in, nvp, use_qp,
                                   [(kinds[i], h, got[i, h].tolist(), want[i, h].tolist()) for i, h in bad[:3]])


@pytest.mark.slow
def test_stream_topk_many_rows_and_tails(emu, rng):
    """Several CTAs (partial last one), unaligned rows (scalar loads), causal -inf tails."""
    H, run = emu
    for nt in (1000, 3001):  # nt % 4 != 0 for 3001: scalar loads
        ms = _scores(rng, (37, 3, nt), "causal")
        for topk, begin, end in ((16, 0, 0), (16, 1, 2)):
            want = ref.topk_select(ms, topk, None, begin, end, True, None)
            for npt in il.STREAM_NPT:
                got = _select(H, run, ms, topk, None, begin, end, True, None, kernel="stream", npt=npt)
                assert np.array_equal(got, want), (nt, topk, npt)


@pytest.mark.slow
@pytest.mark.parametrize("nt", [7, 200, 1024, 1025, 5000, 12287])
def test_block_topk_emulated_exact(emu, rng, nt):
    """The warp / CTA kernels (msa_topk_select_kernel), both selection paths."""
    H, run = emu
    kinds = list(SCORE_KINDS) + list(SPECIAL_KINDS)
    for topk, begin, end, count_in, cap in ((16, 0, 0, True, None), (64, 2, 2, True, None), (8, 1, 1, False, 0),
                                            (64, 12, 12, True, None)):
        if _width(topk, begin, end, count_in) > 64:
            continue
        k = _width(topk, begin, end, count_in) - begin - end
        ms = np.stack([_scores(rng, (2, nt), kd) if kd in SCORE_KINDS else special_rows(rng, 2, nt, k, kd)
                       for kd in kinds])
        qp = _positions(rng, len(kinds), nt)
        want = ref.topk_select(ms, topk, None, begin, end, count_in, qp)
        got = _select(H, run, ms, topk, None, begin, end, count_in, qp, kernel="block", cap=cap)
        assert np.array_equal(got, want), (nt, topk, begin, end, cap)


def _problem(rows: int, nt: int, slots: int) -> TopkProblem:
    return TopkProblem(rows, 1, nt, slots, slots, nt, 0, 0, True, False, True, 0)


def test_auto_choice_routes_small_k_to_stream():
    kernel = lambda rows, nt, slots: il.select_topk_config(_problem(rows, nt, slots)).kernel  # noqa: E731
    assert kernel(524288, 1024, 16) == "stream"
    assert kernel(4096, 8192, 16) == "stream"
    assert kernel(64, 8192, 16) == "block"
    assert kernel(64, 1024, 16) == "stream"
    assert kernel(4096, 1024, 17) == "block"
    npt = lambda nt: il.stream_topk_config(_problem(64, nt, 16)).scores_per_thread  # noqa: E731
    assert npt(64) == 8 and npt(1024) == 32 and npt(8192) == 16 and npt(300) == 16


# ============================================================================ max score


def _emu_max_score(H, run, q, k, nt, qo, kv, off, cu_q, *, cu_k=None, page_table=None, kv_indices=None,
                   indptr=None, kv_layout="NHD", page_size=0, causal=True, lazy=False, config=None, score_scale=1.0):
    ms = np.full((q.shape[0], q.shape[1], nt), np.nan, dtype=np.float32)
    w = H.wrap
    run(il.run_max_score, w(q), w(k), w(ms), cu_seqlens_q=w(cu_q), qo_lens=w(qo), kv_lens=w(kv), qo_offset=w(off),
        cu_seqlens_k=w(cu_k), page_table=w(page_table), kv_indices=w(kv_indices), kv_page_indptr=w(indptr),
        kv_layout=kv_layout, page_size=page_size, max_seqlen_q=int(qo.max(initial=0)), causal=causal, stream=0,
        config=config, lazy_cp_async=lazy, score_scale=score_scale)
    return ms


CONFIGS = (None,) + tuple(c for c in il.MAX_SCORE_CONFIGS if not c.decode)  # the automatic choice, every
# variant of msa_block_max_score_kernel (the decode kernel has its own tests below)
MS_CASES = [  # dtype, D, (Hq, Hkv), causal, cp.async copies land and wgmma computes at the wait
    pytest.param(BF16, 128, (8, 1), True, False, id="bf16-d128-r8-causal"),
    pytest.param(BF16, 128, (8, 1), True, True, id="bf16-d128-r8-causal-copy-at-wait"),
    pytest.param(F16, 64, (6, 2), False, False, id="fp16-d64-r3-full"),
    pytest.param(BF16, 256, (4, 4), True, False, id="bf16-d256-r1"),
    pytest.param(F16, 128, (12, 4), True, True, id="fp16-d128-r3-copy-at-wait"),
]


def _dense_problem(rng, qo, kv, offsets, hq, hkv, d, dtype, causal):
    """Dense K for the max-score kernels: ``(cu_q, cu_k, offsets, q, k, nt, float64 reference)``."""
    cu_q, cu_k, off = _meta(qo, kv, offsets)
    q = _rand(rng, (int(cu_q[-1]), hq, d), dtype)
    k = _rand(rng, (max(int(cu_k[-1]), 1), hkv, d), dtype)
    nt = -(-int(kv.max()) // BLOCK) + 1
    want = ref.block_max_score(q, k, cu_q, cu_k, qo_offset=off, causal=causal, max_k_tiles=nt, qo_lens=qo,
                               kv_lens=kv)
    return cu_q, cu_k, off, q, k, nt, want


@pytest.mark.slow
@pytest.mark.parametrize("dtype,d,heads,causal,lazy", MS_CASES)
def test_max_score_dense_emulated(emu, rng, dtype, d, heads, causal, lazy):
    """Every variant (mma.sync with 4 and 8 warps, the warp-specialised wgmma kernel):
    decode-like rows (key-range splits), a prefill with offsets, lengths not multiples of 128."""
    H, run = emu
    hq, hkv = heads
    for case in ("prefill", "decode"):
        if case == "prefill":  # (small: the emulator runs one host thread per CUDA thread)
            qo, kv = np.array([37, 20], dtype=np.int32), np.array([300, 129], dtype=np.int32)
            offsets = (kv - qo + np.array([0, -40])).astype(np.int32)
        else:
            qo, kv = np.ones(3, dtype=np.int32), np.array([1, 700, 129], dtype=np.int32)
            offsets = None
        cu_q, cu_k, off, q, k, nt, want = _dense_problem(rng, qo, kv, offsets, hq, hkv, d, dtype, causal)
        for config in CONFIGS:
            got = _emu_max_score(H, run, q, k, nt, qo, kv, off, cu_q, cu_k=cu_k, causal=causal, lazy=lazy,
                                 config=config)
            _check_max_score(got, want, q, k, f"{case} causal={causal} {config}")


@pytest.mark.slow
@pytest.mark.parametrize("kv_layout,source,page_size", [("NHD", "table", 64), ("HND", "csr", 16), ("NHD", "csr", 256)])
def test_max_score_paged_emulated(emu, rng, kv_layout, source, page_size):
    H, run = emu
    hq, hkv, d, dtype = 8, 2, 128, BF16
    qo = np.array([1, 37, 130], dtype=np.int32)
    kv = np.array([50, 300, 129], dtype=np.int32)
    cu_q, _, off = _meta(qo, kv, None)
    counts = -(-kv // page_size)
    num_pages = int(counts.sum()) + 3
    perm = rng.permutation(num_pages).astype(np.int32)
    kv_indices = perm[: int(counts.sum())]
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    table = ref.page_table_from_indptr(kv_indices, indptr, width=int(counts.max()) + 1)
    shape = (num_pages, page_size, hkv, d) if kv_layout == "NHD" else (num_pages, hkv, page_size, d)
    k_cache = _rand(rng, shape, dtype)
    q = _rand(rng, (int(cu_q[-1]), hq, d), dtype)
    nt = -(-int(kv.max()) // BLOCK) + 1
    kw = dict(page_table=table) if source == "table" else dict(kv_indices=kv_indices, indptr=indptr)
    want = ref.paged_block_max_score(q, k_cache, cu_q, kv, np.where(table < 0, -1, table), qo_offset=off,
                                     causal=True, max_k_tiles=nt, kv_layout=kv_layout, qo_lens=qo)
    k_nhd = k_cache if kv_layout == "NHD" else k_cache.transpose(0, 2, 1, 3)
    for config in CONFIGS:
        got = _emu_max_score(H, run, q, k_cache, nt, qo, kv, off, cu_q, kv_layout=kv_layout, page_size=page_size,
                             config=config, **kw)
        _check_max_score(got, want, q, k_nhd.reshape(-1, d), f"{source} {kv_layout} page={page_size} {config}")


def test_max_score_config_choice():
    """Decode kernel up to 32 packed rows (fewest 8-row n-blocks), 4 warps of mma.sync up
    to 64; above, the warp-specialised wgmma kernel on sm_90 only."""
    dec1, dec2, dec4, mma4, mma8, wg8 = il.MAX_SCORE_CONFIGS
    for cc in (80, 90):
        assert il.select_max_score_config(1, cc) == dec1 and il.select_max_score_config(8, cc) == dec1
        assert il.select_max_score_config(9, cc) == dec2 and il.select_max_score_config(16, cc) == dec2
        assert il.select_max_score_config(17, cc) == dec4 and il.select_max_score_config(32, cc) == dec4
        assert il.select_max_score_config(33, cc) == mma4 and il.select_max_score_config(64, cc) == mma4
    assert il.select_max_score_config(65, 90) == wg8 and il.select_max_score_config(1 << 20, 90) == wg8
    assert il.select_max_score_config(65, 80) == mma8 and il.select_max_score_config(4096, 100) == mma8
    assert wg8 == il.WS_CONFIG == il.FP8_PREFILL_CONFIGS[256] and il.FP8_PREFILL_CONFIGS[128] == il.FP8_WS_CONFIG
    assert il.select_max_score_config(4096, 90, fp8=True) == il.FP8_WS_CONFIG
    assert il.select_max_score_config(4096, 90, fp8=True, head_dim=256) == wg8
    assert [c.stages() for c in (mma4, mma8, wg8)] == [3, 3, 4]
    assert [dec1.stages(d) for d in (64, 128, 256)] == [6, 3, 3]
    # float8: the decode kernel up to 32 rows (16 at D 256), else the wgmma kernel
    assert il.FP8_DECODE_MAX_ROWS == {64: 32, 128: 32, 256: 16}
    for cc in (89, 90):
        for d in (64, 128):
            assert [il.select_max_score_config(r, cc, fp8=True, head_dim=d) for r in (1, 9, 17, 32, 33, 4096)] \
                == [dec1, dec2, dec4, dec4, il.FP8_WS_CONFIG, il.FP8_WS_CONFIG]
        assert [il.select_max_score_config(r, cc, fp8=True, head_dim=256) for r in (8, 16, 17, 64)] \
            == [dec1, dec2, wg8, wg8]


def test_max_score_smem_bytes():
    """Dynamic shared memory: the mma.sync block kernel (MaxScoreTile::SMEM_BYTES: three K
    stages, the row-max stash, the key flags) and the warp-specialised kernel
    (MaxScoreWsTile::SMEM_BYTES: K stages, the Q tile in whole 128-byte column-block rows
    (e4m3 D 64 pads each row to 128 bytes), the stash, key flags, two mbarriers per stage and
    the alignment slack)."""
    mma8, ws = il.MaxScoreConfig("mma_sync", 8), il.WS_CONFIG
    stash, flags = 128 * 17 * 4, lambda stages: stages * 128
    assert il.max_score_smem_bytes(128, mma8) == 3 * 128 * 256 + stash + flags(3)
    for d, elem, row in ((64, 2, 128), (128, 2, 256), (256, 2, 512), (64, 1, 128), (128, 1, 128), (256, 1, 256)):
        bm, stages = ws.rows_per_cta(d, elem), ws.stages(d, elem)
        assert bm == (256 if row <= 256 else 128)
        assert il.max_score_smem_bytes(d, ws, elem) == (stages * 128 * row + bm * row + bm * 17 * 4
                                                        + stages * (128 + 16) + 1024) <= 227 * 1024


# ============================================================================ decode max score

DECODE_CONFIGS = (None,) + il.DECODE_CONFIGS


def _decode_configs(rows: int):
    """The automatic choice and every decode variant holding ``rows`` packed rows."""
    return [c for c in DECODE_CONFIGS if c is None or c.rows_per_cta() >= rows]


@pytest.mark.slow
@pytest.mark.parametrize("dtype,d,heads,causal,lazy", [
    pytest.param(BF16, 128, (4, 1), True, False, id="bf16-d128-r4-causal"),
    pytest.param(BF16, 128, (4, 1), False, True, id="bf16-d128-r4-full-copy-at-wait"),
    pytest.param(F16, 64, (8, 2), True, True, id="fp16-d64-r4-copy-at-wait"),
    pytest.param(BF16, 256, (6, 6), True, False, id="bf16-d256-r1"),
])
def test_decode_max_score_dense_emulated(emu, rng, dtype, d, heads, causal, lazy):
    """The decode kernel on dense K: one query per request (empty requests, kv_len 0 and 1,
    lengths not multiples of 32 or 128; 2500 keys: key-range splits of 11 and 10 blocks),
    then multi-query causal decode with offsets (negative included) up to 32 packed rows."""
    H, run = emu
    hq, hkv = heads
    r = hq // hkv
    for case in ("single", "multi"):
        if case == "single":
            qo = np.array([1, 1, 0, 1, 1, 1], dtype=np.int32)
            kv = np.array([1, 2500, 50, 0, 129, 33], dtype=np.int32)
            offsets = None
        else:
            nq = max(1, 32 // r)
            qo = np.array([nq, 2, nq - 1, 1], dtype=np.int32)
            kv = np.array([700, 260, 90, 1], dtype=np.int32)
            offsets = (kv - qo + np.array([0, -3, -200, 0])).astype(np.int32)
        cu_q, cu_k, off, q, k, nt, want = _dense_problem(rng, qo, kv, offsets, hq, hkv, d, dtype, causal)
        for config in _decode_configs(int(qo.max()) * r):
            n0 = len(run.launches)
            got = _emu_max_score(H, run, q, k, nt, qo, kv, off, cu_q, cu_k=cu_k, causal=causal, lazy=lazy,
                                 config=config)
            _check_max_score(got, want, q, k, f"{case} causal={causal} {config}")
            (name, grid, *_), = run.launches[n0:]
            assert "msa_decode_max_score_kernel" in name and (case != "single" or grid[0] > len(qo)), (name, grid)


@pytest.mark.slow
@pytest.mark.parametrize("kv_layout,source,page_size,d,lazy", [
    ("NHD", "table", 128, 128, False), ("HND", "csr", 16, 128, True), ("NHD", "csr", 256, 64, False),
    ("HND", "table", 64, 256, False), ("NHD", "table", 32, 128, True)])
def test_decode_max_score_paged_emulated(emu, rng, kv_layout, source, page_size, d, lazy):
    """Paged K (NHD / HND, page table / CSR, page sizes 16..256) with invalid page ids
    (-1, >= P, past the table width, outside the CSR range): single and multi-query
    causal decode; request 0's 2100 keys are split over CTAs."""
    H, run = emu
    hq, hkv, dtype = 8, 2, BF16
    for qo in (np.array([1, 1, 1, 0], dtype=np.int32), np.array([4, 1, 3, 2], dtype=np.int32)):
        kv = np.array([2100, 300, 129, 40], dtype=np.int32)
        cu_q, _, off = _meta(qo, kv, None)

        def corrupt(kv_indices, indptr, counts, num_pages):
            # invalid ids: -1 and >= P in request 0; request 1's CSR range one page short
            kv_indices[1] = -1
            kv_indices[min(3, counts[0] - 1)] = num_pages + 5
            indptr[2] -= 1

        # (a page table narrower than request 0's pages: columns past it)
        kw, q, k_cache, nt, want, k_rows = _paged_decode_problem(
            rng, qo, kv, off, cu_q, hq=hq, hkv=hkv, d=d, dtype=dtype, page_size=page_size, kv_layout=kv_layout,
            source=source, spare_pages=3, corrupt=corrupt, table_columns=lambda counts: max(2, counts[0] - 2))
        assert np.isneginf(want).any()  # some block lost every key to invalid pages
        for config in _decode_configs(int(qo.max()) * (hq // hkv)):
            got = _emu_max_score(H, run, q, k_cache, nt, qo, kv, off, cu_q, kv_layout=kv_layout,
                                 page_size=page_size, lazy=lazy, config=config, **kw)
            _check_max_score(got, want, q, k_rows, f"{source} {kv_layout} page={page_size} qo={qo.tolist()} {config}")


@pytest.mark.slow
@pytest.mark.parametrize("kv_layout,page_size,heads", [("NHD", 8, (4, 1)), ("HND", 16, (4, 1)), ("HND", 16, (8, 2))])
def test_decode_max_score_in_order_small_pages_emulated(emu, rng, kv_layout, page_size, heads):
    """Pages smaller than a sub-tile in storage order: one-base copies across page
    boundaries, key-by-key copies around two swapped pages, an invalid id and request ends
    (HND with two KV heads: every sub-tile key by key)."""
    H, run = emu
    hq, hkv = heads
    qo = np.array([1, 1, 0, 1], dtype=np.int32)
    kv = np.array([700, 300, 40, 129], dtype=np.int32)
    cu_q, _, off = _meta(qo, kv, None)
    kw, q, k_cache, nt, want, k_rows = _paged_decode_problem(
        rng, qo, kv, off, cu_q, hq=hq, hkv=hkv, d=128, dtype=BF16, page_size=page_size, kv_layout=kv_layout,
        source="csr", spare_pages=2, corrupt=_in_order_pages, table_columns=None)
    got = _emu_max_score(H, run, q, k_cache, nt, qo, kv, off, cu_q, kv_layout=kv_layout, page_size=page_size,
                         lazy=True, **kw)
    _check_max_score(got, want, q, k_rows, f"in-order pages {kv_layout} page={page_size} Hq{hq} Hkv{hkv}")


@pytest.mark.slow
@pytest.mark.parametrize("layout", K_VIEW_LAYOUTS)
def test_decode_max_score_k_views_emulated(emu, rng, layout):
    """K as a view with strides other than its shape's (rows padded past D; the K half of
    pages holding K and V): the one-base copies follow the strides (Hq 8 over Hkv 2)."""
    H, run = emu
    qo = np.array([1, 2, 0, 1], dtype=np.int32)
    kv = np.array([900, 333, 40, 129], dtype=np.int32)
    cu_q, q, k_base, view, nt, want, kw, k_rows, off = _k_view_decode_problem(rng, layout, qo, kv)
    got = _emu_max_score(H, run, q, view(k_base), nt, qo, kv, off, cu_q, **kw)
    _check_max_score(got, want, q, k_rows, f"K view {layout}")


# ============================================================================ fp8 decode max score

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _fp8_keys(rng, q, qo, kv, cu_q, cu_k, off, nt, *, hkv, d, paged, causal, page_size):
    """Random e4m3 K, dense ``[total_k, Hkv, D]`` or paged HND (CSR page ids, one invalid), with
    the float64 block max of the fp8 values: ``(k, want, launch kwargs, K rows for the error bound)``."""
    if paged:
        counts = -(-kv // page_size)
        num_pages = int(counts.sum()) + 2
        kv_indices = rng.permutation(num_pages).astype(np.int32)[: int(counts.sum())].copy()
        kv_indices[2] = -1
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        k = rng.standard_normal((num_pages, hkv, page_size, d)).astype(np.float32).astype(FP8)
        table = ref.page_table_from_indptr(kv_indices, indptr, width=int(counts.max()))
        want = ref.paged_block_max_score(q, k, cu_q, kv, table, qo_offset=off, causal=causal, max_k_tiles=nt,
                                         kv_layout="HND", qo_lens=qo)
        kw = dict(kv_indices=kv_indices, indptr=indptr, kv_layout="HND", page_size=page_size)
        return k, want, kw, k.transpose(0, 2, 1, 3).reshape(-1, d)
    k = rng.standard_normal((int(cu_k[-1]), hkv, d)).astype(np.float32).astype(FP8)
    want = ref.block_max_score(q, k, cu_q, cu_k, qo_offset=off, causal=causal, max_k_tiles=nt, qo_lens=qo,
                               kv_lens=kv)
    return k, want, dict(cu_k=cu_k), k


@pytest.mark.slow
@pytest.mark.parametrize("d,paged,lazy", [(128, False, False), (64, True, True), (256, True, False),
                                          (128, True, True)])
def test_fp8_decode_max_score_emulated(emu, rng, d, paged, lazy):
    """float8 e4m3 q and k with a score scale (the product of per-tensor scales): the decode
    kernel's m16n8k32 path on dense and paged K (HND, CSR, an invalid page), single and
    multi-query causal decode, against the float64 reference of the fp8 values."""
    H, run = emu
    hq, hkv, page_size, scale = 8, 2, 32, 0.37 * 1.9
    r = hq // hkv
    for qo in (np.array([1, 1, 0, 1], dtype=np.int32), np.array([4, 2, 1, 3], dtype=np.int32)):
        kv = np.array([2100, 300, 77, 129], dtype=np.int32)
        cu_q, cu_k, off = _meta(qo, kv, None)
        q = rng.standard_normal((int(cu_q[-1]), hq, d)).astype(np.float32).astype(FP8)
        nt = -(-int(kv.max()) // BLOCK) + 1
        k, want, kw, k_rows = _fp8_keys(rng, q, qo, kv, cu_q, cu_k, off, nt, hkv=hkv, d=d, paged=paged,
                                        causal=True, page_size=page_size)
        want = want * scale
        for config in _decode_configs(int(qo.max()) * r):
            if config is not None and (FP8, d, config) not in il.MAX_SCORE_SPECS:
                continue
            got = _emu_max_score(H, run, q, k, nt, qo, kv, off, cu_q, lazy=lazy, config=config, score_scale=scale,
                                 **kw)
            _check_max_score(got, want, q.astype(np.float64) * scale, k_rows.astype(np.float64),
                             f"fp8 d={d} paged={paged} qo={qo.tolist()} {config}")


# ============================================================================ fp8 prefill max score (wgmma)


@pytest.mark.slow
@pytest.mark.parametrize("d,causal,paged,lazy,heads", [
    (128, True, False, False, (8, 2)), (64, False, False, True, (8, 2)), (256, True, True, False, (8, 2)),
    (128, False, True, True, (8, 2)), (128, True, False, True, (12, 4))])
def test_fp8_prefill_max_score_emulated(emu, rng, d, causal, paged, lazy, heads):
    """float8 e4m3 q and k with more packed rows than the decode kernel holds: the
    warp-specialised kernel's wgmma m64n128k32 (e4m3 tiles in 128-byte-swizzled column
    blocks, D 64 rows padded to 128 bytes) with a score scale, dense and paged (HND, CSR, an invalid page),
    causal with offsets and not, GQA 4 and 3 (the last case: a 2100-key request, so the key
    range is split over several CTAs), against the float64 reference of the fp8 values."""
    H, run = emu
    (hq, hkv), page_size, scale = heads, 32, 0.37 * 1.9
    long_kv = hq // hkv == 3
    qo = np.array([37, 20, 1] if not long_kv else [12, 30], dtype=np.int32)
    kv = np.array([300, 129, 77] if not long_kv else [2100, 200], dtype=np.int32)
    cu_q, cu_k, off = _meta(qo, kv, (kv - qo + np.array([0, -40, 3][: len(qo)])).astype(np.int32))
    q = rng.standard_normal((int(cu_q[-1]), hq, d)).astype(np.float32).astype(FP8)
    nt = -(-int(kv.max()) // BLOCK) + 1
    k, want, kw, k_rows = _fp8_keys(rng, q, qo, kv, cu_q, cu_k, off, nt, hkv=hkv, d=d, paged=paged, causal=causal,
                                    page_size=page_size)
    cfg = il.FP8_PREFILL_CONFIGS[d]
    assert il.select_max_score_config(int(qo.max()) * hq // hkv, 90, fp8=True, head_dim=d) == cfg
    if long_kv:
        assert il.max_score_splits(-(-int(qo.max()) * 3 // cfg.rows_per_cta(d, 1)) * len(qo) * hkv, nt, 132)[0] > 1
    first = len(run.launches)
    got = _emu_max_score(H, run, q, k, nt, qo, kv, off, cu_q, causal=causal, lazy=lazy, score_scale=scale, **kw)
    assert [r[0] for r in run.launches[first:]] == [f"msa_max_score_ws_kernel<fp8_t, {d}>"]
    _check_max_score(got, want * scale, q.astype(np.float64) * scale, k_rows.astype(np.float64),
                     f"fp8 wgmma d={d} causal={causal} paged={paged}")


# ============================================================================ warp-specialised kernel, long keys


@pytest.mark.slow
@pytest.mark.parametrize("dtype,d,heads,causal,lazy", [
    pytest.param(F16, 256, (4, 2), True, True, id="fp16-d256-r2-causal-copy-at-wait"),
    pytest.param(BF16, 64, (16, 1), False, False, id="bf16-d64-r16-full"),
])
def test_ws_max_score_long_keys_emulated(emu, rng, dtype, d, heads, causal, lazy):
    """The warp-specialised kernel over a long request (2200 keys at D 64, 1100 at D 256): its
    stage ring (2 stages of 512-byte rows at D 256, whose 128-row tiles run one MMA half per
    tile; 8 stages at D 64) wraps many times, 16-block stash stores and a partial one (D 64),
    key-range splits, offsets short of the keys, rows in several 256-row tiles."""
    H, run = emu
    hq, hkv = heads
    # the 16-block stash and its partial successor at D 64 (2200 keys); D 256 emulates slowly
    # (its Q register exchange runs per k-step on the host): fewer rows and keys, still two
    # row tiles and two key ranges
    qo = np.array([37, 20, 300 if d == 64 else 140], dtype=np.int32)
    kv = np.array([300, 129, 2200 if d == 64 else 1100], dtype=np.int32)
    offsets = (kv - qo + np.array([0, -40, -100])).astype(np.int32)
    cu_q, cu_k, off, q, k, nt, want = _dense_problem(rng, qo, kv, offsets, hq, hkv, d, dtype, causal)
    first = len(run.launches)
    got = _emu_max_score(H, run, q, k, nt, qo, kv, off, cu_q, cu_k=cu_k, causal=causal, lazy=lazy,
                         config=il.WS_CONFIG)
    (name, grid, block, *_), = run.launches[first:]
    assert name == il.MAX_SCORE_SPECS[(dtype, d, il.WS_CONFIG)].kernels[0] and block == (384,) and grid[2] > 1
    _check_max_score(got, want, q, k, f"ws D{d} causal={causal}")


@pytest.mark.slow
def test_ws_max_score_negative_blocks_emulated(emu, rng):
    """float8 blocks whose scores are all negative for some rows of a warp and not for others,
    blocks whose two 64-key halves have opposite signs (one 64-key MMA unit of a row negative,
    the other not), and a block of zero keys: the kernel's bit-pattern maxima where a row holds
    a value >= 0, the float path elsewhere (test_gpu_index.test_ws_max_score_negative_blocks)."""
    H, run = emu
    hq, hkv, d = 4, 1, 64
    qo, kv = np.array([40], dtype=np.int32), np.array([700], dtype=np.int32)
    cu_q, cu_k, off = _meta(qo, kv, None)
    ints = lambda shape: rng.integers(1, 4, size=shape).astype(np.float32).astype(FP8)  # noqa: E731
    q = signed_rows(ints((40, hq, d)), np.where(np.arange(40) // 5 % 2 == 0, 1.0, -1.0))
    key_block = np.arange(700) // BLOCK
    k_signs = np.where(key_block % 2 == 0, 1.0, -1.0)
    first_half = np.arange(700) % BLOCK < BLOCK // 2
    k_signs[key_block == 1] = np.where(first_half, 1.0, -1.0)[key_block == 1]
    k_signs[key_block == 3] = np.where(first_half, -1.0, 1.0)[key_block == 3]
    k = signed_rows(ints((700, hkv, d)), k_signs)
    k[key_block == 4] = 0
    nt = -(-700 // BLOCK) + 1
    want = ref.block_max_score(q, k, cu_q, cu_k, qo_offset=off, causal=True, max_k_tiles=nt, qo_lens=qo, kv_lens=kv)
    assert (want[np.isfinite(want)] < 0).any() and (want[np.isfinite(want)] > 0).any()
    got = _emu_max_score(H, run, q, k, nt, qo, kv, off, cu_q, cu_k=cu_k, causal=True,
                         config=il.FP8_PREFILL_CONFIGS[d])
    _check_max_score(got, want, q.astype(np.float64), k.astype(np.float64), "ws fp8 negative blocks")
