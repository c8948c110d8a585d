"""MSA index kernels: per-128-key-block max score and top-k block selection.

CPU tests (run everywhere): a NumPy model of the top-k kernel's algorithm (same
thread layout, lower bound, candidate compaction, bitwise searches, tie rule) is
checked against the float64 reference on adversarial rows; the kernel choices reach
every registered variant and only those; the launchers' parameter tables match the
kernel signatures in the source; every registered variant compiles with NVRTC for
sm_90a and sm_80. GPU tests: the CUDA kernels, through the launchers and through the
public API, against ``mate_cupy.reference.msa`` on fresh random inputs with poisoned
outputs: selected ids must be identical; max scores must match to fp32 rounding with
``-inf`` exactly where the reference has it.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from mate_cupy.msa import index_launch as il
from mate_cupy.msa.topk import TopkProblem, validate_topk
from mate_cupy.reference import msa as ref
from mate_cupy.runtime.interop import wrap
from helpers import kernel_params, signed_rows

BLOCK = 128
F16, BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
FP8_DT = np.dtype(ml_dtypes.float8_e4m3fn)


# ============================================================================ score generators


def _scores(rng, shape, kind: str) -> np.ndarray:
    """float32 scores with the features a selection must get right."""
    if kind == "normal":
        x = rng.standard_normal(shape)
    elif kind == "ties":  # few distinct values: ties everywhere, at the threshold too
        x = rng.integers(0, 6, size=shape) * 0.5
    elif kind == "constant":  # every score equal: the register (heavy-tie) path
        x = np.full(shape, 1.25)
    elif kind == "special":  # NaN, +-inf, +-0, denormals, huge values, ties
        x = rng.standard_normal(shape)
        pick = rng.random(shape)
        x = np.where(pick < 0.10, np.nan, x)
        x = np.where((pick >= 0.10) & (pick < 0.20), -np.inf, x)
        x = np.where((pick >= 0.20) & (pick < 0.23), np.inf, x)
        x = np.where((pick >= 0.23) & (pick < 0.30), 0.0, x)
        x = np.where((pick >= 0.30) & (pick < 0.35), -0.0, x)
        x = np.where((pick >= 0.35) & (pick < 0.40), 1e-42 * rng.choice([-1, 1], size=shape), x)
        x = np.where((pick >= 0.40) & (pick < 0.45), 3e38, x)
        x = np.where((pick >= 0.45) & (pick < 0.50), np.round(x), x)
    elif kind == "causal":  # a -inf tail per row, as a causal max-score pass leaves it
        x = rng.standard_normal(shape)
        nt = shape[-1]
        cut = rng.integers(0, nt + 1, size=shape[:-1])[..., None]
        x = np.where(np.arange(nt) >= cut, -np.inf, x)
    elif kind == "allnan":
        x = np.full(shape, np.nan)
    else:
        raise ValueError(kind)
    return np.ascontiguousarray(x.astype(np.float32))


SCORE_KINDS = ("normal", "ties", "constant", "special", "causal", "allnan")


# ============================================================================ NumPy model of the top-k kernel


def _order_keys(x: np.ndarray) -> np.ndarray:
    """score_order_key of common/topk.cuh, on float32 bits."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    b = np.where(b == 0x80000000, 0, b)
    k = np.where(b >> 31, (~b) & 0xFFFFFFFF, b | 0x80000000)
    return np.where(nan, 1, k).astype(np.uint64)


def _kth_largest(vals: np.ndarray, k: int) -> int:
    t = 0
    for bit in range(31, -1, -1):
        c = t | (1 << bit)
        if int((vals >= c).sum()) >= k:
            t = c
    return t


def _nth_index(idx: np.ndarray, need: int, bits: int = 14) -> int:
    t = 0
    for bit in range(bits - 1, -1, -1):
        c = t | (1 << bit)
        if int((idx < c).sum()) < need:
            t = c
    return t


def model_topk_row(row: np.ndarray, width: int, valid: int, begin: int, end: int, cap=None) -> np.ndarray:
    """What msa_topk_select_kernel writes for one row (thread layout included)."""
    nt = row.shape[0]
    out = np.full(width, -7, dtype=np.int64)
    if valid <= width:
        t = np.arange(width)
        return np.where(t < valid, t, -1)
    out[:begin] = np.arange(begin)
    out[width - end:] = np.arange(valid - end, valid)
    k = width - begin - end
    if k <= 0:
        return out
    lo, hi = begin, valid - end
    cfg = il.block_topk_config(_problem(nt, k, nt % 4 == 0))
    nw, npt, vec, top2 = cfg.warps_per_row, cfg.scores_per_thread, cfg.vector_width, cfg.top2
    g = 32 * nw
    v, c = np.meshgrid(np.arange(npt // vec), np.arange(vec), indexing="ij")
    step = (vec * g * v + c).reshape(-1)                        # [NPT] in key[] order
    idx = vec * np.arange(g)[:, None] + step[None, :]           # [G, NPT]
    keys = _order_keys(row[np.minimum(idx, nt - 1)])
    keys = np.where((idx >= lo) & (idx < hi), keys, 0)
    srt = np.sort(keys, axis=1)
    maxima = srt[:, -1] if not top2 else np.concatenate([srt[:, -1], srt[:, -2]])
    t0 = max(_kth_largest(maxima, k), 1)
    cap = cfg.candidate_capacity if cap is None else cap
    sel_pool = keys >= t0
    if sel_pool.sum() > cap:  # register path: all keys
        sel_pool = keys >= 1
    ck, ci = keys[sel_pool], idx[sel_pool]
    T = _kth_largest(ck, k)
    greater, equal = int((ck > T).sum()), int((ck == T).sum())
    need = k - greater
    assert 1 <= need <= equal
    cut = _nth_index(ci[ck == T], need) if equal > need else 2**31 - 1
    chosen = ci[(ck > T) | ((ck == T) & (ci <= cut))]
    assert chosen.shape[0] == k
    out[lo:lo + k] = np.sort(chosen)
    return out


def _problem(nt: int, slots: int, aligned: bool = True, rows: int = 1) -> TopkProblem:
    """A selection of ``rows`` rows of ``nt`` scores with ``slots`` free slots (no forced blocks)."""
    return TopkProblem(rows, 1, nt, slots, slots, nt, 0, 0, True, False, aligned, 0)


def _valid_per_row(total_q, nt, num_valid_pages, query_positions):
    v = np.full(total_q, nt if num_valid_pages is None else num_valid_pages, dtype=np.int64)
    if query_positions is not None:
        v = np.clip(np.minimum(v, np.floor_divide(query_positions, BLOCK) + 1), 0, None)
    return v


def _width(topk, begin, end, count_in):
    return topk if count_in else topk + begin + end


def _selection_cases(rng, n_cases: int, nts):
    """Random (nt, topk, begin, end, count_in, num_valid_pages, query_positions?, kind) tuples."""
    cases = []
    for _ in range(n_cases):
        nt = int(rng.choice(nts))
        topk = int(rng.choice([4, 8, 16, 32, 64]))
        begin, end = int(rng.integers(0, 3)), int(rng.integers(0, 3))
        count_in = bool(rng.integers(0, 2))
        if _width(topk, begin, end, count_in) > 64 or (count_in and begin + end > topk):
            count_in, topk = True, min(topk, 64)
        nvp = None if rng.random() < 0.5 else int(rng.integers(1, nt + 1))
        use_qp = rng.random() < 0.5
        kind = str(rng.choice(SCORE_KINDS))
        cases.append((nt, topk, begin, end, count_in, nvp, use_qp, kind))
    return cases


def _positions(rng, total_q, nt):
    hi = nt * BLOCK + 300
    qp = rng.integers(-300, hi, size=total_q).astype(np.int64)
    qp[: max(1, total_q // 4)] = rng.integers(-200, 3 * BLOCK, size=max(1, total_q // 4))  # small / negative
    return qp


@pytest.mark.parametrize("cap", [None, 0], ids=["candidates", "registers"])
def test_topk_model_matches_reference(rng, cap):
    """The kernel's algorithm, modelled in NumPy, is exact on adversarial rows."""
    nts = [1, 5, 16, 63, 64, 100, 128, 200, 255, 256, 257, 700, 1024, 1025, 2048, 3001, 4100, 8192, 12287]
    for nt, topk, begin, end, count_in, nvp, use_qp, kind in _selection_cases(rng, 120, nts):
        total_q, hq = 3, 2
        ms = _scores(rng, (total_q, hq, nt), kind)
        qp = _positions(rng, total_q, nt) if use_qp else None
        want = ref.topk_select(ms, topk, nvp, begin, end, count_in, qp)
        valid = _valid_per_row(total_q, nt, nvp, qp)
        width = _width(topk, begin, end, count_in)
        for i in range(total_q):
            for h in range(hq):
                got = model_topk_row(ms[i, h], width, int(valid[i]), begin, end, cap)
                assert np.array_equal(got, want[i, h]), (nt, topk, begin, end, count_in, nvp, kind, i, h)


def test_order_keys_sort_like_the_reference():
    x = np.array([np.nan, -np.inf, -3e38, -1.0, -1e-42, -0.0, 0.0, 1e-42, 1.0, 3e38, np.inf, -np.nan],
                 dtype=np.float32)
    k = _order_keys(x)
    assert k[0] == k[-1] == 1                      # every NaN lowest
    assert k[5] == k[6]                            # -0 == +0
    assert np.all(np.diff(k[1:-1].astype(np.int64)[[0, 1, 2, 3, 4, 6, 7, 8, 9]]) > 0)
    assert k[1] > 1                                # -inf above NaN


def test_block_topk_config_choice():
    key = lambda c: (c.warps_per_row, c.scores_per_thread, c.vector_width, c.top2)  # noqa: E731
    assert key(il.block_topk_config(_problem(64, 16))) == (1, 8, 4, True)
    assert key(il.block_topk_config(_problem(1024, 16))) == (1, 32, 4, True)
    assert key(il.block_topk_config(_problem(1024, 64, False))) == (1, 32, 1, True)
    assert key(il.block_topk_config(_problem(8192, 16))) == (8, 32, 4, False)
    assert key(il.block_topk_config(_problem(2048, 33))) == (2, 32, 4, True)
    assert key(il.block_topk_config(_problem(12287, 64, False))) == (12, 32, 1, False)
    for nt in (1, 256, 257, 1024, 1025, 2048, 2049, 4096, 4097, 8192, 8193, 12287):
        for slots in (1, 16, 17, 32, 33, 64):
            for aligned in (True, False):
                cfg = il.block_topk_config(_problem(nt, slots, aligned))
                assert 32 * cfg.warps_per_row * cfg.scores_per_thread >= nt
                assert key(cfg) in il.TOPK_SPECS
                assert cfg.candidate_capacity == (256 if cfg.warps_per_row == 1 else 2048)


def test_choices_reach_every_registered_variant_and_only_those():
    """No registered variant is unreachable: the automatic choices over a grid of problems
    pick exactly the registered top-k and max-score variants."""
    picked = set()
    for nt in (1, 256, 257, 512, 513, 1024, 1025, 2048, 2049, 4096, 4097, 8192, 8193, 12287):
        for slots in (0, 1, 16, 17, 32, 33, 64):
            for aligned in (True, False):
                for rows in (1, 1023, 1024, 1 << 20):
                    cfg = il.select_topk_config(_problem(nt, slots, aligned, rows))
                    if cfg.kernel == "stream":
                        picked.add(il.STREAM_SPECS[(cfg.scores_per_thread, cfg.vector_width)])
                    else:
                        picked.add(il.TOPK_SPECS[(cfg.warps_per_row, cfg.scores_per_thread, cfg.vector_width,
                                                  cfg.top2)])
    assert picked == set(il.TOPK_SPECS.values()) | set(il.STREAM_SPECS.values())
    configs = {il.select_max_score_config(rows, cc) for rows in (1, 9, 17, 33, 64, 65, 1 << 20)
               for cc in (80, 86, 89, 90, 100)}
    assert configs == set(il.MAX_SCORE_CONFIGS)
    assert {cfg for dt, _, cfg in il.MAX_SCORE_SPECS if dt != FP8_DT} == configs
    fp8 = {(d, il.select_max_score_config(rows, 90, fp8=True, head_dim=d))
           for d in il.MAX_SCORE_HEAD_DIMS for rows in (1, 9, 16, 17, 32, 33, 1 << 20)}
    assert fp8 == {(d, cfg) for dt, d, cfg in il.MAX_SCORE_SPECS if dt == FP8_DT}


def _split_cost(ctas, nt, slots, s):
    """Makespan of ``s`` key splits in tile times: waves of ``slots`` CTAs, each ``ceil(nt / s)``
    tiles plus the ramp."""
    per = -(-nt // s)
    return -(-ctas * -(-nt // per) // slots) * (per + il.SPLIT_RAMP_TILES)


def test_max_score_launch_geometry():
    """Key splits cover every output block once, keep at least 4 blocks per split, and cost no
    more than any other split count up to the extra waves tried (brute force over every count);
    shared memory fits an H200 SM."""
    for slots in (132, 264):
        for ctas in (0, 1, 7, 32, 64, 128, 140, 256, 527, 528, 4096):
            for nt in (1, 2, 5, 64, 257, 1000, 1025, 12287):
                splits, per = il.max_score_splits(ctas, nt, slots)
                assert splits >= 1 and per >= 1 and splits * per >= nt > (splits - 1) * per
                assert splits == 1 or per >= 4
                if ctas == 0:
                    continue
                first = -(-ctas // slots)
                limit = (first + il.SPLIT_EXTRA_WAVES) * slots  # CTAs of the most waves tried
                others = [_split_cost(ctas, nt, slots, s) for s in range(1, max(1, nt // 4) + 1) if ctas * s <= limit]
                assert _split_cost(ctas, nt, slots, splits) <= min(others), (slots, ctas, nt, splits)
    assert il.max_score_splits(4096, 64, 132) == (1, 64)      # S8192 Hq64 Hkv8: one CTA per tile
    assert il.max_score_splits(128, 1025, 132) == (1, 1025)   # 128 tiles of 256 rows: one wave, whole key range
    assert il.max_score_splits(32, 1025, 132) == (4, 257)     # 32 tiles: four ranges each fill one wave
    assert il.max_score_splits(8, 8192, 132)[0] > 32           # decode: the key range is spread
    for d in il.MAX_SCORE_HEAD_DIMS:
        for cfg in il.MAX_SCORE_CONFIGS:
            smem = il.max_score_smem_bytes(d, cfg)
            assert smem <= 227 * 1024, (d, cfg)
            per_sm = il.max_score_ctas_per_sm(d, cfg)  # the launch bounds' promise
            assert per_sm == (1 if d > 128 or cfg.mma == "wgmma" else 2), (d, cfg)
            assert per_sm * (smem + 1024) <= 228 * 1024, (d, cfg)
        smem = il.max_score_smem_bytes(d, il.FP8_PREFILL_CONFIGS[d], 1)
        assert smem <= 227 * 1024
        assert il.max_score_ctas_per_sm(d, il.FP8_PREFILL_CONFIGS[d], 1) * (smem + 1024) <= 228 * 1024


def test_ws_max_score_tile_shapes():
    """The warp-specialised kernel's tile (MaxScoreWsTile): 256 rows (two consumer warpgroups
    of two 64-row halves) for key rows of at most 256 bytes, else 128; K stages as many as fit
    227 KB beside Q, the stash, the key flags, the mbarriers and the alignment slack (at most 8)."""
    ws = il.WS_CONFIG
    assert ws.num_warps == 12 and ws.mma == "wgmma"
    # (D, element bytes) -> (shared-memory row bytes, rows per CTA, stages)
    want = {(64, 2): (128, 256, 8), (128, 2): (256, 256, 4), (256, 2): (512, 128, 2),
            (64, 1): (128, 256, 8), (128, 1): (128, 256, 8), (256, 1): (256, 256, 4)}
    for (d, elem), (row, bm, stages) in want.items():
        assert (ws.rows_per_cta(d, elem), ws.stages(d, elem)) == (bm, stages), (d, elem)
        smem = il.max_score_smem_bytes(d, ws, elem)
        assert smem == stages * 128 * row + bm * row + bm * 17 * 4 + stages * (128 + 16) + 1024 <= 227 * 1024
    # float8 rows of at most 128 bytes: three consumer warpgroups (MaxScoreWsTile::NARROW), 384 rows
    w3 = il.FP8_WS_CONFIG
    assert w3.num_warps == 16 and il.FP8_PREFILL_CONFIGS == {64: w3, 128: w3, 256: ws}
    for d in (64, 128):
        assert (w3.rows_per_cta(d, 1), w3.stages(d, 1)) == (384, 8)
        assert il.max_score_smem_bytes(d, w3, 1) == 8 * 128 * 128 + 384 * 128 + 384 * 17 * 4 + 8 * 144 + 1024
        assert smem + 128 * row + 144 > 227 * 1024 or stages == 8   # one more stage would not fit


# ---------------------------------------------------------------------------- launchers vs the source

SRC = Path(il.__file__).resolve().parent.parent / "cuda_src" / il.SOURCE


def c_params(kernel: str, src: Path = SRC) -> list:
    """(name, kind) of each parameter of ``kernel`` as declared in ``src``."""
    return kernel_params(src, kernel, macros=("MAX_SCORE_KERNEL_ARGS",))


@pytest.mark.parametrize("kernel,params", [("msa_block_max_score_kernel", il.MAX_SCORE_PARAMS),
                                           ("msa_max_score_ws_kernel", il.MAX_SCORE_PARAMS),
                                           ("msa_decode_max_score_kernel", il.MAX_SCORE_PARAMS),
                                           ("msa_topk_select_kernel", il.TOPK_PARAMS),
                                           ("msa_topk_stream_kernel", il.STREAM_PARAMS)])
def test_launcher_parameters_match_kernel_signature(kernel, params):
    assert c_params(kernel) == list(params.params)


def _recording(monkeypatch, sm_count=132, cc=90):
    """Launches of index_launch recorded instead of run (kernel name, grid, block, params, values, smem)."""
    launches = []
    monkeypatch.setattr(il, "launch", lambda kern, grid, block, params, values, shared_mem=0, stream=0:
                        launches.append((kern, tuple(grid), tuple(block), params, tuple(values), shared_mem, stream)))
    monkeypatch.setattr(il, "get_kernel", lambda spec, kernel=None, device_id=None: spec.kernels[0])
    monkeypatch.setattr(il, "device_info", lambda device=None: (sm_count, cc))
    return launches


@pytest.mark.parametrize("paged", ["dense", "table", "csr"])
@pytest.mark.parametrize("cc", [80, 90])
def test_run_max_score_packs_its_launch(monkeypatch, paged, cc):
    """Grid, block, shared memory and packed values of one launch (host arrays as Args)."""
    launches = _recording(monkeypatch, cc=cc)
    hq, hkv, d, page = 8, 2, 128, 64
    qo, kv = np.array([100, 3], np.int32), np.array([700, 300], np.int32)
    cu_q, cu_k, off = _meta(qo, kv, None)
    q = wrap("q", np.zeros((int(cu_q[-1]), hq, d), BF16))
    ms = wrap("max_score", np.zeros((q.shape[0], hq, 6), np.float32))
    w = lambda n, a: None if a is None else wrap(n, a)  # noqa: E731
    kw = dict(cu_seqlens_q=w("cu_q", cu_q), qo_lens=w("qo", qo), kv_lens=w("kv", kv), qo_offset=w("off", off))
    if paged == "dense":
        k = wrap("k", np.zeros((int(cu_k[-1]), hkv, d), BF16))
        kw.update(cu_seqlens_k=w("cu_k", cu_k))
    else:
        k = wrap("k", np.zeros((20, hkv, page, d), BF16))  # HND
        table = np.zeros((2, 11), np.int32)
        if paged == "table":
            kw.update(page_table=w("table", table), kv_layout="HND", page_size=page)
        else:
            kw.update(kv_indices=w("idx", table.ravel()[:16]), kv_layout="HND", page_size=page,
                      kv_page_indptr=w("indptr", np.array([0, 11, 16], np.int32)))
    il.run_max_score(q, k, ms, max_seqlen_q=100, causal=True, stream=1234, **kw)
    (kern, grid, block, params, values, smem, stream), = launches
    cfg = il.select_max_score_config(100 * 4, cc)
    assert kern == il.MAX_SCORE_SPECS[(BF16, d, cfg)].kernels[0] and stream == 1234
    assert cfg.rows_per_cta(d) == (256 if cc == 90 else 128)
    m_tiles = -(-400 // cfg.rows_per_cta(d))
    assert grid == (m_tiles * 2, hkv, il.max_score_splits(m_tiles * 2 * hkv, 6, 132)[0])
    assert block == (32 * cfg.num_warps,) and smem == il.max_score_smem_bytes(d, cfg)
    params.pack(values)  # every value fits its kind
    v = dict(zip(params.names, values))
    assert v["kv_mode"] == {"dense": 0, "table": 1, "csr": 2}[paged]
    assert v["q_stride_tok"] == hq * d and v["q_stride_head"] == d
    if paged == "dense":
        assert (v["k_stride_outer"], v["k_stride_slot"], v["k_stride_head"]) == (hkv * d, 0, d)
        assert v["page_table"] is None and v["kv_indices"] is None and v["cu_seqlens_k"] is not None
    else:
        assert (v["k_stride_outer"], v["k_stride_slot"], v["k_stride_head"]) == (hkv * page * d, d, page * d)
        assert v["page_shift"] == 6 and v["cu_seqlens_k"] is None
        assert v["page_table_cols"] == (11 if paged == "table" else 0)
        assert v["num_kv_indices"] == (16 if paged == "csr" else 0)
    assert (v["batch"], v["num_heads_q"], v["num_heads_kv"], v["nt"], v["causal"]) == (2, hq, hkv, 6, 1)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_run_max_score_packs_fp8_prefill_launch(monkeypatch, d):
    """float8 q and k with more packed rows than the decode kernel holds: the sm_90a
    warp-specialised wgmma kernel (256 rows per CTA; e4m3 D 64 rows padded to 128 bytes)."""
    launches = _recording(monkeypatch, cc=90)
    hq, hkv = 4, 1
    qo, kv = np.array([300, 5], np.int32), np.array([1000, 77], np.int32)
    cu_q, cu_k, off = _meta(qo, kv, None)
    q = wrap("q", np.zeros((int(cu_q[-1]), hq, d), FP8_DT))
    k = wrap("k", np.zeros((int(cu_k[-1]), hkv, d), FP8_DT))
    ms = wrap("max_score", np.zeros((q.shape[0], hq, 8), np.float32))
    w = lambda n, a: wrap(n, a)  # noqa: E731
    il.run_max_score(q, k, ms, cu_seqlens_q=w("cu_q", cu_q), qo_lens=w("qo", qo), kv_lens=w("kv", kv),
                     qo_offset=w("off", off), cu_seqlens_k=w("cu_k", cu_k), max_seqlen_q=300, causal=True, stream=7,
                     score_scale=0.25)
    (kern, grid, block, params, values, smem, stream), = launches
    cfg = il.FP8_PREFILL_CONFIGS[d]
    assert kern == f"msa_max_score_ws_kernel<fp8_t, {d}>" == il.MAX_SCORE_SPECS[(FP8_DT, d, cfg)].kernels[0]
    bm = cfg.rows_per_cta(d, 1)
    m_tiles = -(-300 * 4 // bm)
    assert grid == (m_tiles * 2, hkv, il.max_score_splits(m_tiles * 2, 8, 132)[0]) and block == (32 * cfg.num_warps,)
    row, stages = max(d, 128), cfg.stages(d, 1)
    assert smem == il.max_score_smem_bytes(d, cfg, 1) == (stages * 128 * row + bm * row + bm * 17 * 4
                                                          + stages * 144 + 1024)
    params.pack(values)
    v = dict(zip(params.names, values))
    assert v["q_stride_tok"] == hq * d and v["k_stride_outer"] == hkv * d and v["score_scale"] == 0.25


@pytest.mark.parametrize("paged", ["dense", "csr"])
def test_run_max_score_packs_decode_launch(monkeypatch, paged):
    """Decode-shaped rows take the decode kernel: grid (batch * splits, Hkv), 4 warps,
    the key range of each (request, head) split to fill whole waves of 2 CTAs per SM."""
    launches = _recording(monkeypatch, cc=90)
    hq, hkv, d, page = 16, 2, 128, 128
    batch, nt = 8, 8192
    qo, kv = np.full(batch, 2, np.int32), np.full(batch, nt * BLOCK, np.int32)
    cu_q, cu_k, off = _meta(qo, kv, None)
    q = wrap("q", np.zeros((int(cu_q[-1]), hq, d), BF16))
    ms = wrap("max_score", np.zeros((q.shape[0], hq, nt), np.float32))
    w = lambda n, a: wrap(n, a)  # noqa: E731
    kw = dict(cu_seqlens_q=w("cu_q", cu_q), qo_lens=w("qo", qo), kv_lens=w("kv", kv), qo_offset=w("off", off))
    if paged == "dense":
        k = wrap("k", np.zeros((2, hkv, d), BF16))  # shapes only: nothing is read
        kw.update(cu_seqlens_k=w("cu_k", cu_k))
    else:
        k = wrap("k", np.zeros((3, page, hkv, d), BF16))
        kw.update(kv_indices=w("idx", np.zeros(3, np.int32)), kv_page_indptr=w("indptr", np.zeros(batch + 1, np.int32)),
                  page_size=page)
    il.run_max_score(q, k, ms, max_seqlen_q=2, causal=True, stream=77, **kw)
    (kern, grid, block, params, values, smem, stream), = launches
    cfg = il.select_max_score_config(2 * hq // hkv, 90)
    assert cfg == il.DECODE_CONFIGS[1] and kern == il.MAX_SCORE_SPECS[(BF16, d, cfg)].kernels[0]
    splits, per = il.decode_splits(batch * hkv, nt, 2 * 132)
    assert grid == (batch * splits, hkv) and block == (128,) and smem == il.max_score_smem_bytes(d, cfg)
    params.pack(values)
    v = dict(zip(params.names, values))
    assert (v["num_m_tiles"], v["tiles_per_split"], v["batch"], v["nt"]) == (1, per, batch, nt)
    with pytest.raises(ValueError, match="packed rows"):  # a decode variant too small for the rows
        il.run_max_score(q, k, ms, max_seqlen_q=2, causal=True, stream=77, config=il.DECODE_CONFIGS[0], **kw)


def test_decode_splits_cover_and_fill_waves():
    """Splits cover every block once, give each CTA at least 8 blocks where the blocks
    allow, and fill whole waves at the benchmark shapes."""
    for units in (1, 7, 8, 64, 264, 5000):
        for nt in (1, 5, 9, 64, 1024, 8192, 12289):
            s, per = il.decode_splits(units, nt, 264)
            assert s >= 1 and s * per >= nt > (s - 1) * per, (units, nt)
            assert s == 1 or per >= il.DECODE_MIN_TILES, (units, nt, s, per)
    assert il.decode_splits(8, 8192, 264) == (33, 249)      # B8, 1M keys: one full wave
    s, per = il.decode_splits(64, 1024, 264)                 # B64, 128K keys
    assert -(-64 * s // 264) * per <= 1.04 * 64 * 1024 / 264


def test_run_max_score_empty_launches_nothing(monkeypatch):
    launches = _recording(monkeypatch)
    z = lambda *shape, dt=np.int32: wrap("a", np.zeros(shape, dt))  # noqa: E731
    for total_q, batch, nt, max_q in ((0, 1, 4, 1), (3, 0, 4, 1), (3, 1, 0, 1), (3, 1, 4, 0)):
        il.run_max_score(z(total_q, 4, 64, dt=F16), z(5, 1, 64, dt=F16), z(total_q, 4, nt, dt=np.float32),
                         cu_seqlens_q=z(batch + 1), qo_lens=z(batch), kv_lens=z(batch), qo_offset=z(batch),
                         cu_seqlens_k=z(batch + 1), max_seqlen_q=max_q, causal=True, stream=0)
    assert launches == []


@pytest.mark.parametrize("nt,slots,rows", [(64, 16, 7), (2000, 16, 7), (2000, 40, 3000), (5000, 64, 3)])
def test_launch_topk_packs_its_launch(monkeypatch, nt, slots, rows):
    launches = _recording(monkeypatch)
    ms = wrap("max_score", np.zeros((rows, 1, nt), np.float32))
    out = wrap("output", np.zeros((rows, 1, slots), np.int32))
    problem = _problem(nt, slots, ms.ptr % 16 == 0 and nt % 4 == 0, rows)
    cfg = il.select_topk_config(problem)
    il.launch_topk(problem, cfg, ms, out, None, 77)
    (kern, grid, block, params, values, smem, stream), = launches
    params.pack(values)
    v = dict(zip(params.names, values))
    assert (v["num_rows"], v["nt"], v["width"], v["num_valid_pages"]) == (rows, nt, slots, nt)
    assert v["query_positions"] is None
    assert stream == 77 and smem == 0
    if cfg.kernel == "stream":
        assert params is il.STREAM_PARAMS and kern.startswith("msa_topk_stream_kernel")
        assert grid == (-(-rows // cfg.rows_per_cta),) and block == (32 * cfg.rows_per_cta,)
    else:
        assert params is il.TOPK_PARAMS and v["cand_cap"] == cfg.candidate_capacity
        if cfg.warps_per_row == 1:
            assert grid == (-(-rows // 8),) and block == (256,)
        else:
            assert grid == (rows,) and block == (32 * cfg.warps_per_row,)


def _index_specs():
    return list(il.TOPK_SPECS.values()) + list(il.STREAM_SPECS.values()) + list(il.MAX_SCORE_SPECS.values())


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_index_variants_compile(arch):
    """Every registered variant builds with NVRTC (no GPU needed; wgmma only for sm_90a)."""
    from mate_cupy.jit import compile_all

    results = compile_all(arch, specs=_index_specs())
    errors = [r for r in results if "error" in r]
    assert not errors, errors[0]["error"][:4000]
    skipped = {r["name"] for r in results if "skipped" in r}
    wgmma = {s.name for s in il.MAX_SCORE_SPECS.values() if s.min_sm == 90}
    fp8 = {s.name for (dt, _, _), s in il.MAX_SCORE_SPECS.items() if dt == FP8_DT}
    assert all(s.min_sm == 89 if k[2].decode else s.only_arch == "sm_90a"
               for k, s in il.MAX_SCORE_SPECS.items() if k[0] == FP8_DT)
    assert skipped == (set() if arch == "sm_90a" else wgmma | fp8)


@pytest.mark.slow
def test_hot_variants_keep_to_registers():
    """The hot variants never read local memory in the kernel itself (the streaming kernel
    saves a few registers around its out-of-line exact pass, which only rare rows take)."""
    from mate_cupy.jit import compile_variant

    hot = [il.TOPK_SPECS[(1, 32, 4, True)], il.TOPK_SPECS[(8, 32, 4, False)],
           il.STREAM_SPECS[(32, 4)], il.STREAM_SPECS[(16, 4)], il.STREAM_SPECS[(8, 4)]]
    hot += [il.MAX_SCORE_SPECS[(BF16, 128, cfg)] for cfg in il.MAX_SCORE_CONFIGS]
    hot += [il.MAX_SCORE_SPECS[(F16, 64, il.MaxScoreConfig("mma_sync", 8))]]
    hot += [il.MAX_SCORE_SPECS[(dt, d, cfg)] for dt in (F16, BF16) for d in (64, 256) for cfg in il.DECODE_CONFIGS]
    hot += [s for (dt, _, _), s in il.MAX_SCORE_SPECS.items() if dt == FP8_DT]
    for spec in hot:
        log = compile_variant(spec, "sm_90a", ptxas_verbose=True)["log"]
        # per function: "Function properties for <mangled>" then "... spill stores, N bytes spill loads"
        funcs = re.findall(r"Function properties for (\S+)\s+ptxas\s+\.\s+\d+ bytes stack frame, (\d+) bytes spill "
                           r"stores, (\d+) bytes spill loads", log)
        kernel = [f for f in funcs if "kernel" in f[0]]
        assert kernel, (spec.name, log)
        assert all(int(loads) == 0 for _, _, loads in kernel), (spec.name, log)
        if "stream" not in spec.kernels[0]:
            assert all(int(stores) == 0 for _, stores, _ in kernel), (spec.name, log)


# ============================================================================ GPU helpers


def _cp():
    import cupy

    return cupy


def _dev(a: np.ndarray):
    """Host array (bf16 included) -> CuPy array, exact."""
    cp = _cp()
    try:
        return cp.asarray(a)
    except Exception:
        if a.dtype != BF16:
            raise
        from mate_cupy import cast  # bf16 values are exact in float32 and back

        return cast(cp.asarray(a.astype(np.float32)), "bfloat16")


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


# ============================================================================ GPU: top-k select


def _run_topk_gpu(ms, topk, nvp, begin, end, count_in, qp, cap=None, kernel=None, npt=None):
    """One selection through validate_topk and launch_topk: the automatic choice, or
    ``kernel`` ("stream" / "block") with its chunk size / candidate capacity replaced."""
    cp = _cp()
    width = _width(topk, begin, end, count_in)
    d_ms = cp.asarray(ms)
    out = cp.full(ms.shape[:2] + (width,), -7, dtype=cp.int32)  # poison
    args = (wrap("max_score", d_ms), wrap("output", out),
            None if qp is None else wrap("query_positions", cp.asarray(qp)))
    problem = validate_topk(args[0], topk, nvp, args[1], begin, end, count_in, args[2])
    if kernel is None:
        config = il.select_topk_config(problem)
    elif kernel == "stream":
        config = il.stream_topk_config(problem)
        config = config if npt is None else dataclasses.replace(config, scores_per_thread=npt)
    else:
        config = il.block_topk_config(problem)
        config = config if cap is None else dataclasses.replace(config, candidate_capacity=cap)
    il.launch_topk(problem, config, *args, cp.cuda.get_current_stream().ptr)
    return _host(out)


# (kernel, candidate capacity, stream chunk size): auto choice; block kernels with candidates /
# register path; streaming kernel at each chunk size.
TOPK_PATHS = [(None, None, None), ("block", None, None), ("block", 0, None),
              ("stream", None, 8), ("stream", None, 16), ("stream", None, 32)]
TOPK_PATH_IDS = ["auto", "block-candidates", "block-registers", "stream8", "stream16", "stream32"]


@pytest.mark.gpu
@pytest.mark.parametrize("path", TOPK_PATHS, ids=TOPK_PATH_IDS)
@pytest.mark.parametrize("nt", [1, 3, 7, 16, 64, 100, 128, 255, 256, 257, 1000, 1024, 1025, 2047, 2048,
                                3001, 4096, 6000, 8192, 10000, 12287])
def test_topk_select_exact(rng, nt, path):
    kernel, cap, npt = path
    for topk, begin, end, count_in, nvp, use_qp, kind in [c[1:] for c in _selection_cases(rng, 24, [nt])]:
        if kernel == "stream" and _width(topk, begin, end, count_in) - begin - end > il.STREAM_KERNEL_MAX_SLOTS:
            continue
        total_q, hq = (7, 3) if nt <= 2048 else (3, 2)
        ms = _scores(rng, (total_q, hq, nt), kind)
        qp = _positions(rng, total_q, nt) if use_qp else None
        want = ref.topk_select(ms, topk, nvp, begin, end, count_in, qp)
        got = _run_topk_gpu(ms, topk, nvp, begin, end, count_in, qp, cap, kernel, npt)
        assert np.array_equal(got, want), (nt, topk, begin, end, count_in, nvp, use_qp, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("npt", [8, 16, 32])
@pytest.mark.parametrize("nt", [40, 257, 1024, 1025, 4100, 8192, 12287])
def test_topk_stream_rare_paths(rng, nt, npt):
    """Streaming kernel on rows built for its rare paths (candidate overflow, buffer cut,
    a chunk's own best k, the exact-key pass: +NaN, T at +-0, NaN payloads, ties)."""
    from test_index_emu import SPECIAL_KINDS, special_rows

    for topk, begin, end, count_in in ((16, 0, 0, True), (8, 1, 2, False), (32, 0, 0, True)):
        k = _width(topk, begin, end, count_in) - begin - end
        ms = np.stack([special_rows(rng, 3, nt, k, kind) for kind in SPECIAL_KINDS])
        qp = _positions(rng, ms.shape[0], nt)
        qp[::2] = nt * BLOCK
        for q in (None, qp):
            want = ref.topk_select(ms, topk, None, begin, end, count_in, q)
            got = _run_topk_gpu(ms, topk, None, begin, end, count_in, q, kernel="stream", npt=npt)
            bad = np.argwhere((got != want).any(-1))
            assert bad.shape[0] == 0, (nt, npt, topk, [SPECIAL_KINDS[i] for i, _ in bad[:5]])


@pytest.mark.gpu
def test_topk_stream_many_rows(rng):
    """Thousands of rows through the streaming kernel (CTAs of 4 and 8 rows, partial last CTA)."""
    for nt, rows in ((1024, 2053), (8192, 1037), (600, 999)):
        ms = _scores(rng, (rows, 1, nt), "normal")
        ms[::7] = _scores(rng, (len(ms[::7]), 1, nt), "causal")
        want = ref.topk_select(ms, 16, None, 0, 0, True, None)
        for npt in il.STREAM_NPT:
            got = _run_topk_gpu(ms, 16, None, 0, 0, True, None, kernel="stream", npt=npt)
            assert np.array_equal(got, want), (nt, npt)


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [4, 8, 16, 32, 64])
@pytest.mark.parametrize("count_in", [True, False])
@pytest.mark.parametrize("begin,end", [(0, 0), (1, 0), (0, 1), (2, 2), (1, 2)])
def test_topk_select_flags_grid(rng, topk, count_in, begin, end):
    if _width(topk, begin, end, count_in) > 64:
        pytest.skip("width > 64")
    for nt in (33, 200, 1024, 5000):
        for kind in ("normal", "ties", "special"):
            ms = _scores(rng, (6, 4, nt), kind)
            for nvp, qp in ((None, None), (max(1, nt // 2), None), (None, _positions(rng, 6, nt)),
                            (nt, _positions(rng, 6, nt))):
                want = ref.topk_select(ms, topk, nvp, begin, end, count_in, qp)
                got = _run_topk_gpu(ms, topk, nvp, begin, end, count_in, qp)
                assert np.array_equal(got, want), (nt, kind, nvp, qp is not None)


@pytest.mark.gpu
def test_topk_select_many_rows_and_tie_blocks(rng):
    """Thousands of rows (several CTAs, the partial last CTA), ties placed at the threshold."""
    total_q, hq, nt = 1031, 5, 512
    ms = _scores(rng, (total_q, hq, nt), "normal")
    kth = np.sort(ms, axis=-1)[..., -16]  # the 16th largest of each row
    for i, h in zip(*np.nonzero(rng.random((total_q, hq)) < 0.3)):
        ms[i, h, rng.integers(0, nt, size=5)] = kth[i, h]  # ties at the threshold
    for topk, begin, end, count_in in ((16, 0, 0, True), (16, 1, 1, False), (64, 2, 2, True)):
        want = ref.topk_select(ms, topk, None, begin, end, count_in, None)
        got = _run_topk_gpu(ms, topk, None, begin, end, count_in, None)
        assert np.array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_sparse_topk_select_public_api(rng, framework):
    """Through mate_cupy.sparse_topk_select, fresh and preallocated outputs, both frameworks."""
    cp = _cp()
    from mate_cupy import msa_interface as mi

    if framework == "torch":
        torch = pytest.importorskip("torch")
    for nt, topk, begin, end, count_in, qp_on in ((64, 16, 1, 1, True, True), (1024, 16, 0, 2, False, False),
                                                  (8192, 8, 1, 0, True, True), (300, 4, 0, 0, True, False),
                                                  (12287, 32, 2, 2, False, True)):
        ms = _scores(rng, (9, 4, nt), "special")
        qp = _positions(rng, 9, nt) if qp_on else None
        want = ref.topk_select(ms, topk, None, begin, end, count_in, qp)
        if framework == "cupy":
            d_ms, d_qp = cp.asarray(ms), None if qp is None else cp.asarray(qp)
            out = cp.full(want.shape, -7, dtype=cp.int32)
        else:
            d_ms = torch.from_numpy(ms).cuda()
            d_qp = None if qp is None else torch.from_numpy(qp).cuda()
            out = torch.full(want.shape, -7, dtype=torch.int32, device="cuda")
        got = mi.sparse_topk_select(d_ms, topk, query_positions=d_qp, force_begin_blocks=begin,
                                    force_end_blocks=end, force_blocks_count_in_topk=count_in)
        assert np.array_equal(_host(got) if framework == "cupy" else got.cpu().numpy(), want)
        same = mi.sparse_topk_select(d_ms, topk, output=out, query_positions=d_qp, force_begin_blocks=begin,
                                     force_end_blocks=end, force_blocks_count_in_topk=count_in)
        assert same is out
        assert np.array_equal(_host(out) if framework == "cupy" else out.cpu().numpy(), want)


# ============================================================================ GPU: max score


def _rand(rng, shape, dtype):
    return (rng.standard_normal(shape)).astype(np.float32).astype(dtype)


def _check_max_score(got, want, q, k_rows, what="", rel=2e-5):
    """-inf exactly where the reference has it; values within fp32 accumulation error
    (``rel * |q| * max |k|``)."""
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert not np.isnan(got).any(), f"{what}: unwritten (NaN) elements at {np.argwhere(np.isnan(got))[:5]}"
    fin = np.isfinite(want)
    bad = np.argwhere(np.isfinite(got) != fin)
    assert bad.shape[0] == 0, f"{what}: -inf pattern differs at {bad[:5]} (got {got[tuple(bad[0])]}, want {want[tuple(bad[0])]})"
    assert np.array_equal(got[~fin], want[~fin]), what
    qn = np.linalg.norm(q.astype(np.float64), axis=-1)                   # [total_q, Hq]
    kmax = float(np.linalg.norm(k_rows.astype(np.float64), axis=-1).max(initial=1.0))
    tol = rel * qn[..., None] * kmax + 1e-30
    err = np.where(fin, np.abs(np.where(fin, got, 0.0) - np.where(fin, want, 0.0)), 0.0)
    worst = np.unravel_index(np.argmax(np.where(fin, err / tol, 0)), err.shape)
    assert np.all(np.where(fin, err <= tol, True)), f"{what}: error {err[worst]:.3e} > tol {tol[worst]:.3e} at {worst}"


def _lengths(rng, case: str):
    if case == "mixed":
        qo = np.array([1, 0, 37, 130, 5, 200, 64], dtype=np.int32)
        kv = np.array([1, 50, 300, 129, 0, 1000, 64], dtype=np.int32)
    elif case == "prefill":
        qo = np.array([257, 128], dtype=np.int32)
        kv = np.array([257, 700], dtype=np.int32)
    elif case == "decode":
        kv = rng.integers(1, 2000, size=9).astype(np.int32)
        qo = np.ones(9, dtype=np.int32)
    else:
        raise ValueError(case)
    return qo, kv


def _meta(qo, kv, offsets):
    cu_q = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    off = (kv - qo if offsets is None else offsets).astype(np.int32)
    return cu_q, cu_k, off


def _launch_max_score(q, k, nt, qo, kv, off, cu_q, *, cu_k=None, page_table=None, kv_indices=None,
                      indptr=None, kv_layout="NHD", page_size=0, causal=True, config=None):
    cp = _cp()
    total_q = q.shape[0]
    ms = cp.full((total_q, q.shape[1], nt), np.nan, dtype=cp.float32)  # poison
    dv = lambda name, a: None if a is None else wrap(name, cp.asarray(a))  # noqa: E731
    il.run_max_score(wrap("q", _dev(q)), wrap("k", _dev(k)), wrap("max_score", ms), cu_seqlens_q=dv("cu_q", cu_q),
                     qo_lens=dv("qo", qo), kv_lens=dv("kv", kv), qo_offset=dv("off", off),
                     cu_seqlens_k=dv("cu_k", cu_k), page_table=dv("table", page_table),
                     kv_indices=dv("idx", kv_indices), kv_page_indptr=dv("indptr", indptr), kv_layout=kv_layout,
                     page_size=page_size, max_seqlen_q=int(qo.max(initial=0)), causal=causal,
                     stream=cp.cuda.get_current_stream().ptr, config=config)
    return _host(ms)


CONFIGS = [None] + list(il.MAX_SCORE_CONFIGS)  # the automatic choice, then every variant


def _configs(qo, heads):
    """The automatic choice and every variant that holds ``max(qo) * Hq / Hkv`` packed rows
    (decode variants hold 8, 16 or 32; the others any number)."""
    rows = int(np.max(qo, initial=0)) * heads[0] // heads[1]
    return [c for c in CONFIGS if c is None or not c.decode or c.rows_per_cta() >= rows]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("heads", [(4, 1), (8, 2), (6, 6), (12, 4)], ids=lambda h: f"Hq{h[0]}Hkv{h[1]}")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_max_score_dense(rng, dtype, d, heads, causal):
    hq, hkv = heads
    for case in ("mixed", "prefill", "decode"):
        qo, kv = _lengths(rng, case)
        offsets = None if rng.random() < 0.5 else (kv - qo + rng.integers(-150, 40, size=qo.shape)).astype(np.int32)
        cu_q, cu_k, off = _meta(qo, kv, offsets)
        total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
        q = _rand(rng, (total_q, hq, d), dtype)
        k = _rand(rng, (max(total_k, 1), hkv, d), dtype)
        nt = -(-int(kv.max()) // BLOCK) + 2  # tiles past every request: -inf
        want = ref.block_max_score(q, k, cu_q, cu_k, qo_offset=off, causal=causal, max_k_tiles=nt,
                                   qo_lens=qo, kv_lens=kv)
        for config in _configs(qo, heads):
            got = _launch_max_score(q, k, nt, qo, kv, off, cu_q, cu_k=cu_k, causal=causal, config=config)
            _check_max_score(got, want, q, k, f"{case} causal={causal} config={config}")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 128, 256])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("source", ["table", "csr"])
def test_max_score_paged(rng, page_size, kv_layout, source):
    hq, hkv, d, dtype = 8, 2, 128, BF16
    qo, kv = _lengths(rng, "mixed")
    cu_q, _, off = _meta(qo, kv, None)
    counts = -(-kv // page_size)
    num_pages = int(counts.sum()) + 5
    perm = rng.permutation(num_pages).astype(np.int32)  # scattered pages
    kv_indices = perm[: int(counts.sum())]
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    table = ref.page_table_from_indptr(kv_indices, indptr, width=int(counts.max()) + 1)
    shape = (num_pages, page_size, hkv, d) if kv_layout == "NHD" else (num_pages, hkv, page_size, d)
    k_cache = _rand(rng, shape, dtype)
    total_q = int(cu_q[-1])
    q = _rand(rng, (total_q, hq, d), dtype)
    nt = -(-int(kv.max()) // BLOCK) + 1
    kw = dict(page_table=table) if source == "table" else dict(kv_indices=kv_indices, indptr=indptr)
    want = ref.paged_block_max_score(q, k_cache, cu_q, kv, np.where(table < 0, -1, table), qo_offset=off,
                                     causal=True, max_k_tiles=nt, kv_layout=kv_layout, qo_lens=qo)
    k_nhd = k_cache if kv_layout == "NHD" else k_cache.transpose(0, 2, 1, 3)
    for config in _configs(qo, (hq, hkv)):
        got = _launch_max_score(q, k_cache, nt, qo, kv, off, cu_q, kv_layout=kv_layout, page_size=page_size,
                                config=config, **kw)
        _check_max_score(got, want, q, k_nhd.reshape(-1, d), f"{source} {kv_layout} page={page_size} {config}")


@pytest.mark.gpu
def test_max_score_invalid_pages_are_not_admissible(rng):
    """Page ids -1, >= num_pages and columns past the table make keys inadmissible (-inf)."""
    hq, hkv, d, dtype, page_size = 4, 1, 64, F16, 16
    qo = np.array([3, 40], dtype=np.int32)
    kv = np.array([200, 130], dtype=np.int32)
    cu_q, _, off = _meta(qo, kv, None)
    num_pages = 30
    table = rng.integers(0, num_pages, size=(2, 11)).astype(np.int32)  # 11 * 16 = 176 < 200: short table
    table[0, 2] = -1
    table[1, 4] = num_pages + 7
    table[1, 0] = -5
    k_cache = _rand(rng, (num_pages, page_size, hkv, d), dtype)
    q = _rand(rng, (int(cu_q[-1]), hq, d), dtype)
    nt = 2
    want = ref.paged_block_max_score(q, k_cache, cu_q, kv, table, qo_offset=off, causal=True, max_k_tiles=nt)
    for config in _configs(qo, (hq, hkv)):
        got = _launch_max_score(q, k_cache, nt, qo, kv, off, cu_q, page_table=table, page_size=page_size,
                                config=config)
        _check_max_score(got, want, q, k_cache.reshape(-1, d), f"invalid pages {config}")


def _ws_lengths(case: str):
    """Lengths for the warp-specialised kernel: ``long`` (many K tiles: the stage ring wraps
    many times, full and partial 16-block stash stores; several 256-row tiles per request,
    lengths not multiples of 128 or of the row tile; offsets shifted both ways) or
    ``split`` (few rows per request over long keys: the key range is split over CTAs)."""
    if case == "long":
        qo = np.array([300, 77, 0, 1, 190], dtype=np.int32)
        kv = np.array([4500, 2100, 50, 4099, 1000], dtype=np.int32)
        off = (kv - qo).astype(np.int32)
        off[1] -= 700   # queries end short of the keys
        off[4] = -60    # the first queries see no key
        return qo, kv, off
    qo = np.array([20, 9], dtype=np.int32)
    kv = np.array([9000, 6001], dtype=np.int32)
    return qo, kv, (kv - qo).astype(np.int32)


# (dtype, D, (Hq, Hkv), causal): GQA 1..16, both row tiles (256 rows; 128 for 512-byte key rows);
# Hq 64 over Hkv 8 (the benchmark's heads): more CTAs than SMs, of several requests and heads
WS_CASES = [(BF16, 128, (16, 1), True), (BF16, 128, (4, 1), False), (F16, 64, (12, 4), True),
            (BF16, 256, (8, 2), True), (F16, 256, (1, 1), False), (BF16, 64, (2, 1), True),
            (BF16, 128, (64, 8), True)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,heads,causal", WS_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("case", ["long", "split"])
def test_ws_max_score_long_keys(rng, dtype, d, heads, causal, case):
    """The warp-specialised wgmma kernel over many K tiles (NaN-poisoned output, float64
    reference)."""
    _needs_sm90()
    hq, hkv = heads
    qo, kv, off = _ws_lengths(case)
    cu_q, cu_k, _ = _meta(qo, kv, off)
    q = _rand(rng, (int(cu_q[-1]), hq, d), dtype)
    k = _rand(rng, (int(cu_k[-1]), hkv, d), dtype)
    nt = -(-int(kv.max()) // BLOCK) + 1
    want = ref.block_max_score(q, k, cu_q, cu_k, qo_offset=off, causal=causal, max_k_tiles=nt, qo_lens=qo,
                               kv_lens=kv)
    got = _launch_max_score(q, k, nt, qo, kv, off, cu_q, cu_k=cu_k, causal=causal, config=il.WS_CONFIG)
    _check_max_score(got, want, q, k, f"ws {case} D{d} Hq{hq} Hkv{hkv} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("case", ["long", "split"])
def test_ws_fp8_max_score_long_keys(rng, d, case):
    """The float8 warp-specialised kernel over many K tiles, paged (scattered CSR pages of 64
    keys, two invalid ids) for ``long``, dense for ``split``."""
    _needs_sm90()
    hq, hkv, scale = 8, 2, 0.37
    qo, kv, off = _ws_lengths(case)
    cu_q, cu_k, _ = _meta(qo, kv, off)
    q = _fp8_ints(rng, (int(cu_q[-1]), hq, d))
    nt = -(-int(kv.max()) // BLOCK) + 1
    if case == "long":
        page = 64
        counts = -(-kv // page)
        num_pages = int(counts.sum()) + 3
        kv_indices = rng.permutation(num_pages).astype(np.int32)[: int(counts.sum())].copy()
        kv_indices[[2, 70]] = -1, num_pages + 1
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        table = ref.page_table_from_indptr(kv_indices, indptr, width=int(counts.max()))
        k_cache = _fp8_ints(rng, (num_pages, page, hkv, d))
        want = ref.paged_block_max_score(q, k_cache, cu_q, kv, table, qo_offset=off, causal=True, max_k_tiles=nt,
                                         qo_lens=qo)
        got = _launch_max_score_torch(q, k_cache, nt, qo, kv, off, cu_q, score_scale=scale, page_size=page,
                                      kv_indices=kv_indices, indptr=indptr, config=il.FP8_PREFILL_CONFIGS[d])
        k_rows = k_cache.reshape(-1, d)
    else:
        k_rows = _fp8_ints(rng, (int(cu_k[-1]), hkv, d))
        want = ref.block_max_score(q, k_rows, cu_q, cu_k, qo_offset=off, causal=True, max_k_tiles=nt, qo_lens=qo,
                                   kv_lens=kv)
        got = _launch_max_score_torch(q, k_rows, nt, qo, kv, off, cu_q, score_scale=scale, cu_k=cu_k,
                                      config=il.FP8_PREFILL_CONFIGS[d])
    _check_max_score(got, want * scale, q.astype(np.float64) * scale, k_rows.reshape(-1, d).astype(np.float64),
                     f"ws fp8 {case} D{d}", rel=2e-5)


def _launch_ws_max_score(q, k, nt, qo, kv, off, cu_q, cu_k, causal):
    """The warp-specialised kernel on dense K: float8 through torch tensors (score scale 1),
    16-bit through CuPy."""
    if q.dtype == FP8_DT:
        return _launch_max_score_torch(q, k, nt, qo, kv, off, cu_q, score_scale=1.0, cu_k=cu_k, causal=causal,
                                       config=il.FP8_PREFILL_CONFIGS[q.shape[-1]])
    return _launch_max_score(q, k, nt, qo, kv, off, cu_q, cu_k=cu_k, causal=causal, config=il.WS_CONFIG)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [(BF16, 128), (F16, 256), (FP8_DT, 128), (FP8_DT, 64)], ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ws_max_score_tile_edges(rng, dtype, d, causal):
    """Row and block edges of the warp-specialised kernel: packed rows 1 past a 256-row tile
    (a last tile of one row: its other 64-row halves are all padding), 64 and 65 past it
    (a half boundary), odd block counts (3, 7, 9), keys 1 short of and 1 past a block, key
    ranges split at boundaries not multiples of the 16-block stash (one query over 11
    blocks). Integer inputs for float8 (exact partial sums), normal values otherwise."""
    _needs_sm90()
    hq, hkv = 2, 1   # r = 2: packed rows = 2 * queries
    qo = np.array([129, 32, 161, 1, 1], dtype=np.int32)           # rows 258, 64, 322, 2, 2
    kv = np.array([128 * 9 - 1, 128 * 7, 128 * 3 + 1, 128 * 11, 1], dtype=np.int32)
    off = (kv - qo).astype(np.int32)
    off[1] -= 200   # queries end short of the keys
    cu_q, cu_k, _ = _meta(qo, kv, off)
    shape_q, shape_k = (int(cu_q[-1]), hq, d), (int(cu_k[-1]), hkv, d)
    fp8 = dtype == FP8_DT
    q = _fp8_ints(rng, shape_q) if fp8 else _rand(rng, shape_q, dtype)
    k = _fp8_ints(rng, shape_k) if fp8 else _rand(rng, shape_k, dtype)
    nt = -(-int(kv.max()) // BLOCK) + 1
    want = ref.block_max_score(q, k, cu_q, cu_k, qo_offset=off, causal=causal, max_k_tiles=nt, qo_lens=qo,
                               kv_lens=kv)
    got = _launch_ws_max_score(q, k, nt, qo, kv, off, cu_q, cu_k, causal)
    _check_max_score(got, want, q.astype(np.float64), k.astype(np.float64),
                     f"ws edges {dtype} D{d} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FP8_DT], ids=["bf16", "fp8"])
def test_ws_max_score_negative_blocks(rng, dtype):
    """Blocks whose scores are all negative for some rows of a warp and not for others (the
    float8 kernel's bit-pattern maxima hold only where a value is >= 0; the float path takes
    the rest): q rows of one sign each (runs of 5, so a warp's 16 rows mix signs), keys of one
    sign per block of 128 except a mixed one and two whose 64-key halves have opposite signs
    (one 64-key MMA unit of a row negative, the other not), zeros in one block (maxima of +0
    and -0)."""
    _needs_sm90()
    hq, hkv, d = 4, 1, 128
    qo, kv = np.array([300, 70], dtype=np.int32), np.array([1000, 700], dtype=np.int32)
    off = (kv - qo).astype(np.int32)
    cu_q, cu_k, _ = _meta(qo, kv, off)
    gen = _fp8_ints if dtype == FP8_DT else (lambda r, shape: _rand(r, shape, dtype))
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q = signed_rows(gen(rng, (total_q, hq, d)), np.where(np.arange(total_q) // 5 % 2 == 0, 1.0, -1.0))
    key_block = (np.arange(total_k) - np.repeat(cu_k[:-1], kv)) // BLOCK
    k_signs = np.where(key_block % 2 == 0, 1.0, -1.0)
    k_signs[key_block == 3] = rng.choice([-1.0, 1.0], size=int((key_block == 3).sum()))
    first_half = (np.arange(total_k) - np.repeat(cu_k[:-1], kv)) % BLOCK < BLOCK // 2
    k_signs[key_block == 1] = np.where(first_half, 1.0, -1.0)[key_block == 1]
    k_signs[key_block == 4] = np.where(first_half, -1.0, 1.0)[key_block == 4]
    k = signed_rows(gen(rng, (total_k, hkv, d)), k_signs)
    k[key_block == 5] = 0
    nt = -(-int(kv.max()) // BLOCK) + 1
    for causal in (True, False):
        want = ref.block_max_score(q, k, cu_q, cu_k, qo_offset=off, causal=causal, max_k_tiles=nt, qo_lens=qo,
                                   kv_lens=kv)
        assert (want[np.isfinite(want)] < 0).any() and (want[np.isfinite(want)] > 0).any()
        got = _launch_ws_max_score(q, k, nt, qo, kv, off, cu_q, cu_k, causal)
        _check_max_score(got, want, q.astype(np.float64), k.astype(np.float64),
                         f"ws negative blocks {dtype} causal={causal}")


def _decode_lengths(rng, nq: int, long_keys: int):
    """Decode batch: ``nq`` queries per request (one request with fewer, one empty), kv
    lengths from 0 to ``long_keys`` (not multiples of 32 or 128), offsets mostly
    bottom-right, one negative and one short of the end."""
    kv = np.concatenate([[long_keys, 0, 1, 33, 129], rng.integers(1, long_keys, size=5)]).astype(np.int32)
    qo = np.full(kv.shape, nq, dtype=np.int32)
    qo[3], qo[6] = 0, max(1, nq - 1)
    off = (kv - qo).astype(np.int32)
    off[7] = -2
    off[8] -= 37
    return qo, kv, off


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [(BF16, 128), (F16, 64), (BF16, 256)], ids=["bf16-d128", "fp16-d64", "bf16-d256"])
@pytest.mark.parametrize("heads,nq", [((4, 1), 1), ((4, 1), 8), ((8, 2), 2), ((16, 1), 1), ((6, 6), 3)],
                         ids=["r4q1", "r4q8", "r4q2-Hkv2", "r16q1", "r1q3"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_decode_max_score_dense(rng, dtype, d, heads, nq, causal):
    """The decode kernel (and the automatic choice) on dense K: multi-query causal decode
    with offsets, lengths up to 40000 keys (key-range splits), empty requests, kv_len 0."""
    hq, hkv = heads
    qo, kv, off = _decode_lengths(rng, nq, 40000)
    cu_q, cu_k, _ = _meta(qo, kv, off)
    q = _rand(rng, (int(cu_q[-1]), hq, d), dtype)
    k = _rand(rng, (int(cu_k[-1]), hkv, d), dtype)
    nt = -(-int(kv.max()) // BLOCK) + 1
    want = ref.block_max_score(q, k, cu_q, cu_k, qo_offset=off, causal=causal, max_k_tiles=nt,
                               qo_lens=qo, kv_lens=kv)
    rows = nq * hq // hkv
    for config in [None] + [c for c in il.DECODE_CONFIGS if c.rows_per_cta() >= rows]:
        got = _launch_max_score(q, k, nt, qo, kv, off, cu_q, cu_k=cu_k, causal=causal, config=config)
        _check_max_score(got, want, q, k, f"decode nq={nq} causal={causal} {config}")


def _paged_decode_problem(rng, qo, kv, off, cu_q, *, hq, hkv, d, dtype, page_size, kv_layout, source, spare_pages,
                          corrupt, table_columns):
    """A paged max-score problem over shuffled pages with invalid ids: ``corrupt(kv_indices,
    indptr, counts, num_pages)`` spoils the CSR in place; a page table keeps
    ``table_columns(counts)`` columns. Returns ``(kw, q, k_cache, nt, want, k_rows)``: the
    page arguments of the launch, the inputs, the float64 reference and K as rows."""
    counts = -(-kv // page_size)
    num_pages = int(counts.sum()) + spare_pages
    perm = rng.permutation(num_pages).astype(np.int32)
    kv_indices = perm[: int(counts.sum())].copy()
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    corrupt(kv_indices, indptr, counts, num_pages)
    table = ref.page_table_from_indptr(kv_indices, indptr, width=int(counts.max()) + 1)
    if source == "table":
        table = np.ascontiguousarray(table[:, : table_columns(counts)])
        kw = dict(page_table=table)
    else:
        kw = dict(kv_indices=kv_indices, indptr=indptr)
    shape = (num_pages, page_size, hkv, d) if kv_layout == "NHD" else (num_pages, hkv, page_size, d)
    k_cache = _rand(rng, shape, dtype)
    q = _rand(rng, (int(cu_q[-1]), hq, d), dtype)
    nt = -(-int(kv.max()) // BLOCK) + 1
    want = ref.paged_block_max_score(q, k_cache, cu_q, kv, table, qo_offset=off, causal=True, max_k_tiles=nt,
                                     kv_layout=kv_layout, qo_lens=qo)
    k_nhd = k_cache if kv_layout == "NHD" else k_cache.transpose(0, 2, 1, 3)
    return kw, q, k_cache, nt, want, k_nhd.reshape(-1, d)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("source", ["table", "csr"])
@pytest.mark.parametrize("nq", [1, 4])
def test_decode_max_score_paged(rng, page_size, kv_layout, source, nq):
    """Paged decode (M3 index branch heads: Hq 4 over Hkv 1, and Hq 8 over Hkv 2) with
    scattered pages and invalid ids (-1, >= P, a table narrower than the pages, a CSR range
    one page short)."""
    d, dtype = 128, BF16
    for hq, hkv in ((4, 1), (8, 2)):
        qo, kv, off = _decode_lengths(rng, nq, 30000)
        cu_q, _, _ = _meta(qo, kv, off)

        def corrupt(kv_indices, indptr, counts, num_pages):
            kv_indices[rng.integers(0, counts[0], size=3)] = -1
            kv_indices[rng.integers(0, counts[0], size=2)] = num_pages + rng.integers(0, 100, size=2)
            indptr[3] -= 1

        kw, q, k_cache, nt, want, k_rows = _paged_decode_problem(
            rng, qo, kv, off, cu_q, hq=hq, hkv=hkv, d=d, dtype=dtype, page_size=page_size, kv_layout=kv_layout,
            source=source, spare_pages=7, corrupt=corrupt, table_columns=lambda counts: int(counts[0]) - 5)
        rows = nq * hq // hkv
        for config in [None] + [c for c in il.DECODE_CONFIGS if c.rows_per_cta() >= rows]:
            got = _launch_max_score(q, k_cache, nt, qo, kv, off, cu_q, kv_layout=kv_layout, page_size=page_size,
                                    config=config, **kw)
            _check_max_score(got, want, q, k_rows,
                             f"{source} {kv_layout} page={page_size} Hq{hq} Hkv{hkv} nq={nq} {config}")


def _in_order_pages(kv_indices, indptr, counts, num_pages):
    """Pages in storage order (a 32-key sub-tile of pages smaller than 32 keys lies at one
    stride for NHD, and for HND with one KV head), the run broken by two swapped pages and
    an invalid id in request 0."""
    kv_indices[:] = np.arange(kv_indices.size)
    kv_indices[[5, 9]] = kv_indices[[9, 5]]
    kv_indices[17] = -1


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_decode_max_score_in_order_small_pages(rng, page_size, kv_layout):
    """Pages of 8 or 16 keys in storage order: sub-tiles spanning adjacent pages copy from
    one base address, those touching the swapped pages, the invalid id or a request's end
    copy key by key (HND with two KV heads always: its pages are not at one key stride)."""
    d, dtype = 128, BF16
    for hq, hkv in ((4, 1), (8, 2)):
        qo, kv, off = _decode_lengths(rng, 1, 20000)
        cu_q, _, _ = _meta(qo, kv, off)
        kw, q, k_cache, nt, want, k_rows = _paged_decode_problem(
            rng, qo, kv, off, cu_q, hq=hq, hkv=hkv, d=d, dtype=dtype, page_size=page_size, kv_layout=kv_layout,
            source="csr", spare_pages=2, corrupt=_in_order_pages, table_columns=None)
        for config in [None] + [c for c in il.DECODE_CONFIGS if c.rows_per_cta() >= hq // hkv]:
            got = _launch_max_score(q, k_cache, nt, qo, kv, off, cu_q, kv_layout=kv_layout, page_size=page_size,
                                    config=config, **kw)
            _check_max_score(got, want, q, k_rows, f"in-order pages {kv_layout} page={page_size} Hq{hq} Hkv{hkv} {config}")


K_VIEW_LAYOUTS = ("dense-padded", "NHD-kv-pages", "HND-kv-pages")


def _k_view_decode_problem(rng, layout, qo, kv, hq=8, hkv=2, d=128, page=64):
    """A float16 decode max-score problem whose K is a view with strides other than its
    shape's: ``dense-padded`` rows padded past D, ``*-kv-pages`` the K half of pages holding
    K and V (``[P, 2, ...]``). Returns ``(cu_q, q, k_base, view, nt, want, kw, k_rows,
    offsets)`` with K = ``view(k_base)`` (on the host or, sliced there, on the device)."""
    cu_q, cu_k, off = _meta(qo, kv, None)
    q = _rand(rng, (int(cu_q[-1]), hq, d), F16)
    nt = -(-int(kv.max()) // BLOCK) + 1
    if layout == "dense-padded":
        k_base = _rand(rng, (int(cu_k[-1]), hkv, d + 24), F16)
        view = lambda a: a[:, :, :d]  # noqa: E731
        k = view(k_base)
        want = ref.block_max_score(q, k, cu_q, cu_k, qo_offset=off, causal=True, max_k_tiles=nt, qo_lens=qo,
                                   kv_lens=kv)
        return cu_q, q, k_base, view, nt, want, dict(cu_k=cu_k), k.reshape(-1, d), off
    kl = layout[:3]
    counts = -(-kv // page)
    num_pages = int(counts.sum()) + 2
    kv_indices = rng.permutation(num_pages).astype(np.int32)[: int(counts.sum())].copy()
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    inner = (page, hkv, d) if kl == "NHD" else (hkv, page, d)
    k_base = _rand(rng, (num_pages, 2) + inner, F16)
    view = lambda a: a[:, 0]  # noqa: E731
    k = view(k_base)
    table = ref.page_table_from_indptr(kv_indices, indptr, width=int(counts.max()))
    want = ref.paged_block_max_score(q, k, cu_q, kv, table, qo_offset=off, causal=True, max_k_tiles=nt,
                                     kv_layout=kl, qo_lens=qo)
    k_rows = (k if kl == "NHD" else k.transpose(0, 2, 1, 3)).reshape(-1, d)
    return cu_q, q, k_base, view, nt, want, dict(page_table=table, kv_layout=kl, page_size=page), k_rows, off


@pytest.mark.gpu
@pytest.mark.parametrize("layout", K_VIEW_LAYOUTS)
def test_decode_max_score_k_views(rng, layout):
    """K as a view with strides other than its shape's (rows padded past D; the K half of
    pages holding K and V), sliced on the device: the decode kernel's copies follow the
    strides."""
    qo, kv, _ = _decode_lengths(rng, 1, 20000)
    cu_q, q, k_base, view, nt, want, kw, k_rows, off = _k_view_decode_problem(rng, layout, qo, kv)
    k_dev = view(_dev(k_base))
    assert not k_dev.flags.c_contiguous
    for config in [None] + list(il.DECODE_CONFIGS):
        got = _launch_max_score(q, k_dev, nt, qo, kv, off, cu_q, config=config, **kw)
        _check_max_score(got, want, q, k_rows, f"K view {layout} {config}")


FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _fp8(rng, shape):
    return (1.5 * rng.standard_normal(shape)).astype(np.float32).astype(FP8)


def _launch_max_score_torch(q, k, nt, qo, kv, off, cu_q, *, score_scale, config=None, causal=True, **kw):
    """The launcher on torch CUDA tensors (float8 arrays: CuPy has no float8 dtype)."""
    import torch

    def t(a):
        if a is None:
            return None
        if a.dtype == FP8:
            return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).cuda().view(torch.float8_e4m3fn)
        return torch.from_numpy(np.ascontiguousarray(a)).cuda()

    ms = torch.full((q.shape[0], q.shape[1], nt), float("nan"), dtype=torch.float32, device="cuda")
    w = lambda name, a: None if a is None else wrap(name, t(a))  # noqa: E731
    il.run_max_score(w("q", q), w("k", k), wrap("max_score", ms), cu_seqlens_q=w("cu_q", cu_q), qo_lens=w("qo", qo),
                     kv_lens=w("kv", kv), qo_offset=w("off", off), cu_seqlens_k=w("cu_k", kw.get("cu_k")),
                     page_table=w("table", kw.get("page_table")), kv_indices=w("idx", kw.get("kv_indices")),
                     kv_page_indptr=w("indptr", kw.get("indptr")), kv_layout=kw.get("kv_layout", "NHD"),
                     page_size=kw.get("page_size", 0), max_seqlen_q=int(qo.max(initial=0)), causal=causal,
                     stream=torch.cuda.current_stream().cuda_stream, config=config, score_scale=score_scale)
    torch.cuda.synchronize()
    return ms.cpu().numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mode", ["dense", "NHD-table", "HND-csr"])
@pytest.mark.parametrize("nq", [1, 4])
def test_fp8_decode_max_score(rng, d, mode, nq):
    """float8 e4m3 q and k with per-tensor scales (score_scale = q_scale * k_scale): the
    decode kernel's m16n8k32 path vs the float64 reference of the fp8 values."""
    hq, hkv, page_size, scale = 4, 1, 64, 0.02 * 0.7
    qo, kv, off = _decode_lengths(rng, nq, 30000)
    cu_q, cu_k, _ = _meta(qo, kv, off)
    q = _fp8(rng, (int(cu_q[-1]), hq, d))
    nt = -(-int(kv.max()) // BLOCK) + 1
    if mode == "dense":
        k = _fp8(rng, (int(cu_k[-1]), hkv, d))
        want = ref.block_max_score(q, k, cu_q, cu_k, qo_offset=off, causal=True, max_k_tiles=nt, qo_lens=qo,
                                   kv_lens=kv)
        kw, k_rows = dict(cu_k=cu_k), k.reshape(-1, d)
    else:
        layout = mode[:3]
        counts = -(-kv // page_size)
        num_pages = int(counts.sum()) + 3
        kv_indices = rng.permutation(num_pages).astype(np.int32)[: int(counts.sum())].copy()
        kv_indices[[1, 5]] = -1, num_pages + 1
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        table = ref.page_table_from_indptr(kv_indices, indptr, width=int(counts.max()))
        k = _fp8(rng, (num_pages, page_size, hkv, d) if layout == "NHD" else (num_pages, hkv, page_size, d))
        want = ref.paged_block_max_score(q, k, cu_q, kv, table, qo_offset=off, causal=True, max_k_tiles=nt,
                                         kv_layout=layout, qo_lens=qo)
        kw = dict(kv_layout=layout, page_size=page_size)
        kw.update(dict(page_table=table) if mode.endswith("table") else dict(kv_indices=kv_indices, indptr=indptr))
        k_rows = (k if layout == "NHD" else k.transpose(0, 2, 1, 3)).reshape(-1, d)
    rows = nq * hq // hkv
    for config in [None] + [c for c in il.DECODE_CONFIGS if c.rows_per_cta() >= rows]:
        if config is not None and (FP8, d, config) not in il.MAX_SCORE_SPECS:
            continue
        got = _launch_max_score_torch(q, k, nt, qo, kv, off, cu_q, score_scale=scale, config=config, **kw)
        _check_max_score(got, want * scale, q.astype(np.float64) * scale, k_rows.astype(np.float64),
                         f"fp8 d={d} {mode} nq={nq} {config}")


# Hopper's fp8 wgmma adds each k32 step's products into the accumulator with about 14 bits
# aligned to the largest term (not a full fp32 sum): random e4m3 inputs are checked at
# 1e-3 |q| max|k|; small-integer inputs (every partial sum below 2**13, so exact either way)
# at the fp32 tolerance.
FP8_WGMMA_REL = 1e-3


def _fp8_ints(rng, shape):
    return rng.integers(-3, 4, size=shape).astype(np.float32).astype(FP8)


def _needs_sm90():
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fp8 prefill max score (wgmma) runs on compute capability 9.0 only")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("heads", [(4, 1), (8, 2), (6, 6), (12, 4)], ids=lambda h: f"Hq{h[0]}Hkv{h[1]}")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("values", ["normal", "ints"])
def test_fp8_prefill_max_score_dense(rng, d, heads, causal, values):
    """float8 e4m3 q and k, more packed rows than the decode kernel holds: the sm_90a wgmma
    m64n128k32 variant vs the float64 reference of the fp8 values (NaN-poisoned output,
    lengths not multiples of 128, GQA, shifted query offsets, tiles past every request)."""
    _needs_sm90()
    hq, hkv = heads
    scale = 0.02 * 0.7
    gen = _fp8 if values == "normal" else _fp8_ints
    rel = FP8_WGMMA_REL if values == "normal" else 2e-5
    for case in ("mixed", "prefill"):
        qo, kv = _lengths(rng, case)
        offsets = None if rng.random() < 0.5 else (kv - qo + rng.integers(-150, 40, size=qo.shape)).astype(np.int32)
        cu_q, cu_k, off = _meta(qo, kv, offsets)
        total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
        q = gen(rng, (total_q, hq, d))
        k = gen(rng, (max(total_k, 1), hkv, d))
        nt = -(-int(kv.max()) // BLOCK) + 2
        want = ref.block_max_score(q, k, cu_q, cu_k, qo_offset=off, causal=causal, max_k_tiles=nt, qo_lens=qo,
                                   kv_lens=kv)
        assert il.select_max_score_config(int(qo.max()) * hq // hkv, 90, fp8=True, head_dim=d).mma == "wgmma"
        got = _launch_max_score_torch(q, k, nt, qo, kv, off, cu_q, score_scale=scale, causal=causal, cu_k=cu_k)
        _check_max_score(got, want * scale, q.astype(np.float64) * scale, k.astype(np.float64),
                         f"fp8 wgmma {values} {case} d={d} Hq{hq} Hkv{hkv} causal={causal}", rel=rel)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 128, 256])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("source", ["table", "csr"])
def test_fp8_prefill_max_score_paged(rng, page_size, kv_layout, source):
    """The fp8 wgmma variant on scattered pages, with invalid page ids (-1, past the cache)."""
    _needs_sm90()
    hq, hkv, d, scale = 8, 2, 128, 0.37
    qo, kv = _lengths(rng, "mixed")
    cu_q, _, off = _meta(qo, kv, None)
    counts = -(-kv // page_size)
    num_pages = int(counts.sum()) + 5
    kv_indices = rng.permutation(num_pages).astype(np.int32)[: int(counts.sum())].copy()
    kv_indices[[0, 3]] = -1, num_pages + 2
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    table = ref.page_table_from_indptr(kv_indices, indptr, width=int(counts.max()) + 1)
    shape = (num_pages, page_size, hkv, d) if kv_layout == "NHD" else (num_pages, hkv, page_size, d)
    k_cache = _fp8(rng, shape)
    q = _fp8(rng, (int(cu_q[-1]), hq, d))
    nt = -(-int(kv.max()) // BLOCK) + 1
    kw = dict(page_table=table) if source == "table" else dict(kv_indices=kv_indices, indptr=indptr)
    want = ref.paged_block_max_score(q, k_cache, cu_q, kv, table, qo_offset=off, causal=True, max_k_tiles=nt,
                                     kv_layout=kv_layout, qo_lens=qo)
    k_nhd = k_cache if kv_layout == "NHD" else k_cache.transpose(0, 2, 1, 3)
    got = _launch_max_score_torch(q, k_cache, nt, qo, kv, off, cu_q, score_scale=scale, kv_layout=kv_layout,
                                  page_size=page_size, **kw)
    _check_max_score(got, want * scale, q.astype(np.float64) * scale, k_nhd.reshape(-1, d).astype(np.float64),
                     f"fp8 wgmma {source} {kv_layout} page={page_size}", rel=FP8_WGMMA_REL)


def _torch_cuda(a):
    """Host array -> torch CUDA tensor (float8 through its bytes: CuPy has no float8 dtype)."""
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == FP8:
        return torch.from_numpy(a.view(np.uint8)).cuda().view(torch.float8_e4m3fn)
    return torch.from_numpy(a).cuda()


# (queries per request, Hq, Hkv, D): 1 to 32 packed rows (16 at D 256)
FP8_MSA_SHAPES = [(1, 8, 1, 128), (2, 16, 1, 128), (8, 4, 1, 64), (32, 2, 2, 128), (4, 4, 1, 256), (1, 16, 1, 256)]


# more than the decode kernel's rows: the wgmma variant (compute capability 9.0)
FP8_MSA_PREFILL_SHAPES = [(40, 8, 1, 128), (33, 4, 4, 64), (17, 8, 8, 256), (200, 4, 1, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("nq,hq,hkv,d", FP8_MSA_SHAPES + FP8_MSA_PREFILL_SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("mode", ["dense", "NHD-table", "HND-csr", "NHD-csr"])
def test_fp8_max_score_through_msa(rng, nq, hq, hkv, d, mode):
    """msa(output_o=False, max_score=) with float8 q and k: k_scale times the float64 block max of
    the fp8 values, into a NaN-poisoned buffer one tile wider than needed (that tile -inf)."""
    import torch

    import mate_cupy as mc
    from msa_cases import make_problem

    prefill = nq * hq // hkv > il.FP8_DECODE_MAX_ROWS[d]
    if prefill:
        _needs_sm90()

    qo = [nq, nq, max(1, nq - 1), nq, 0, nq]
    kv = [30000, 1, 129, 4000 + nq, 77, 12345]
    page = {"dense": 0, "NHD-table": 64, "HND-csr": 128, "NHD-csr": 16}[mode]
    p = make_problem(rng, qo, kv, hq, hkv, d, dtype=FP8, page_size=page, layout=mode[:3] if page else "NHD")
    k_scale = 0.02 * 0.7  # a Q8KV8 index's q_scale * k_scale
    nt = -(-max(kv) // BLOCK)
    ms = torch.full((p.total_q, hq, nt + 1), float("nan"), dtype=torch.float32, device="cuda")
    if page == 0:
        plan = mc.msa_plan_from_lengths(p.qo, p.kv, hq, hkv, causal=True, device=0)
        mc.msa(_torch_cuda(p.q), _torch_cuda(p.k), _torch_cuda(p.v), plan, max_score=ms, output_o=False,
               k_scale=k_scale)
        want = ref.block_max_score(p.q, p.k, p.cu_q, p.cu_k, max_k_tiles=nt + 1, k_scale=k_scale)
    else:
        plan = mc.msa_plan_from_lengths(p.qo, p.kv, hq, hkv, page_size=page, causal=True, device=0)
        where = (dict(page_table=_torch_cuda(p.page_table)) if mode.endswith("table")
                 else dict(kv_indices=_torch_cuda(p.kv_indices)))
        kc = _torch_cuda(p.k_cache)
        mc.msa(_torch_cuda(p.q), kc, kc, plan, max_score=ms, output_o=False, k_scale=k_scale, **where)
        want = ref.paged_block_max_score(p.q, p.k_cache, p.cu_q, p.kv, p.page_table, max_k_tiles=nt + 1,
                                         kv_layout=mode[:3], k_scale=k_scale)
    torch.cuda.synchronize()
    got = ms.cpu().numpy()
    assert np.isneginf(got[..., nt]).all()
    _check_max_score(got, want, p.q.astype(np.float64) * k_scale, p.k.reshape(-1, d).astype(np.float64),
                     f"fp8 msa {mode} nq={nq} Hq{hq} Hkv{hkv} D{d}", rel=FP8_WGMMA_REL if prefill else 2e-5)


@pytest.mark.gpu
def test_fp8_sparse_decode_with_max_score_shares_k_scale(rng):
    """sparse_decode_atten_func on fp8 q/k/v: attention and max score in one call, one k_scale."""
    import torch

    import mate_cupy as mc
    from msa_cases import make_problem, random_selection

    p = make_problem(rng, [1, 2, 1, 4], [9000, 300, 129, 2000], 16, 2, 128, dtype=FP8, page_size=128)
    plan = mc.msa_plan_from_lengths(p.qo, p.kv, 16, 2, page_size=128, kv_block_num=8, use_fp8_kvcache=True,
                                    device=0)
    assert plan[3].mode == "sparse_decode"
    sel = random_selection(rng, p, 8)
    nt = -(-int(p.kv.max()) // BLOCK)
    ms = torch.full((p.total_q, 16, nt), float("nan"), dtype=torch.float32, device="cuda")
    out = torch.full(p.q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    kc, vc = _torch_cuda(p.k_cache), _torch_cuda(p.v_cache)
    res, got = mc.sparse_decode_atten_func(_torch_cuda(p.q), kc, vc, plan, kv_indices=_torch_cuda(p.kv_indices),
                                           kv_block_indexes=_torch_cuda(sel), k_scale=0.5, v_scale=1.5, out=out,
                                           max_score=ms)
    torch.cuda.synchronize()
    assert res is out and got is ms
    want = ref.paged_block_max_score(p.q, p.k_cache, p.cu_q, p.kv, p.page_table, k_scale=0.5)
    _check_max_score(ms.cpu().numpy(), want, p.q.astype(np.float64) * 0.5, p.k.reshape(-1, 128))
    ref_out, _ = ref.sparse_attention(p.q, p.k_cache, p.v_cache, p.cu_q, p.kv, p.page_table, sel, k_scale=0.5,
                                      v_scale=1.5)
    from helpers import assert_rel

    assert_rel(out, ref_out, 4e-2, "fp8 sparse decode out")  # the fp8 error budget (docs/semantics.md, 5)


@pytest.mark.gpu
def test_max_score_rows_outside_requests_untouched(rng):
    """Rows of no request keep their poison; empty requests and kv_len 0 write -inf rows."""
    hq, hkv, d, dtype = 4, 2, 128, BF16
    qo = np.array([2, 0, 3], dtype=np.int32)
    kv = np.array([0, 10, 129], dtype=np.int32)
    cu_q = np.array([0, 2, 2, 5], dtype=np.int32)
    off = (kv - qo).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    q = _rand(rng, (8, hq, d), dtype)  # rows 5..7 belong to no request
    k = _rand(rng, (int(cu_k[-1]), hkv, d), dtype)
    want = ref.block_max_score(q[:5], k, cu_q, cu_k, qo_offset=off, max_k_tiles=3, qo_lens=qo, kv_lens=kv)
    for config in _configs(qo, (hq, hkv)):
        got = _launch_max_score(q, k, 3, qo, kv, off, cu_q, cu_k=cu_k, config=config)
        assert np.isnan(got[5:]).all(), config
        _check_max_score(got[:5], want, q[:5], k, f"{config}")
        assert np.isneginf(got[:2]).all(), config


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_msa_output_maxscore_public_api(rng, paged):
    """msa(..., output_maxscore=True, output_o=False) through an eager plan, CuPy arrays."""
    cp = _cp()
    from mate_cupy import msa_interface as mi

    hq, hkv, d, dtype = 8, 2, 128, BF16
    qo = np.array([100, 1, 300], dtype=np.int32)
    kv = np.array([500, 77, 300], dtype=np.int32)
    cu_q, cu_k, off = _meta(qo, kv, None)
    q = _rand(rng, (int(cu_q[-1]), hq, d), dtype)
    nt = -(-int(kv.max()) // BLOCK)
    if not paged:
        k = _rand(rng, (int(cu_k[-1]), hkv, d), dtype)
        plan = mi.msa_plan_from_lengths(qo, kv, hq, hkv, causal=True, split_prefill_decode=False)
        _, ms = mi.msa(_dev(q), _dev(k), _dev(k), plan, output_o=False, output_maxscore=True)
        want = ref.block_max_score(q, k, cu_q, cu_k, qo_offset=off, max_k_tiles=nt)
        _check_max_score(_host(ms), want, q, k)
    else:
        counts = -(-kv // BLOCK)
        pages = rng.permutation(int(counts.sum())).astype(np.int32)
        k_cache = _rand(rng, (int(counts.sum()), BLOCK, hkv, d), dtype)
        plan = mi.msa_plan_from_lengths(qo, kv, hq, hkv, causal=True, page_size=BLOCK,
                                        split_prefill_decode=False)
        _, ms = mi.msa(_dev(q), _dev(k_cache), _dev(k_cache), plan, kv_indices=cp.asarray(pages),
                       output_o=False, output_maxscore=True)
        table = ref.page_table_from_csr(pages, kv, BLOCK)
        want = ref.paged_block_max_score(q, k_cache, cu_q, kv, table, qo_offset=off, max_k_tiles=nt)
        _check_max_score(_host(ms), want, q, k_cache.reshape(-1, d))


@pytest.mark.gpu
def test_max_score_then_select_end_to_end(rng):
    """The intended pipeline: causal max score, then top-16 with forced blocks and positions."""
    cp = _cp()
    hq, hkv, d, dtype = 8, 1, 128, BF16
    qo = np.array([333], dtype=np.int32)
    kv = np.array([4000], dtype=np.int32)
    cu_q, cu_k, off = _meta(qo, kv, None)
    q = _rand(rng, (333, hq, d), dtype)
    k = _rand(rng, (4000, hkv, d), dtype)
    nt = 32
    ms = _launch_max_score(q, k, nt, qo, kv, off, cu_q, cu_k=cu_k)
    pos = (off[0] + np.arange(333)).astype(np.int64)
    got = _run_topk_gpu(ms, 16, None, 1, 2, True, pos)
    want = ref.topk_select(ms, 16, None, 1, 2, True, pos)  # same scores in: exact ids out
    assert np.array_equal(got, want)
    assert cp is not None


def _to_device(a):
    """A host array on the GPU with the same shape, dtype and element strides."""
    cp = _cp()
    if a is None or not isinstance(a, np.ndarray):
        return a
    if a.flags.c_contiguous:
        return cp.asarray(a)
    base = cp.asarray(a.base if a.base is not None else np.ascontiguousarray(a))
    return cp.lib.stride_tricks.as_strided(base, a.shape, a.strides)


@pytest.mark.gpu
def test_sparse_topk_select_refuses_cuda_inputs_like_host_inputs():
    """Each refusal of host inputs (tests/test_msa_topk.py ERRORS) holds for CUDA inputs:
    same exception, same message."""
    from test_msa_topk import ERRORS

    from mate_cupy import msa_interface as mi

    for name, make, kw, exc in ERRORS:
        if name == "not-an-array":
            continue
        args = make()
        with pytest.raises(exc) as host:
            mi.sparse_topk_select(*args, **kw)
        with pytest.raises(exc) as dev:
            mi.sparse_topk_select(_to_device(args[0]), args[1], **{k: _to_device(v) for k, v in kw.items()})
        assert str(dev.value) == str(host.value), name
