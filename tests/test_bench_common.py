"""CPU tests of the benchmark harness (bench/): models, records, timing helpers, the
per-case loop's isolation, the peers' block masks and the fp32 check references."""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import models, report  # noqa: E402
from bench.harness import BenchConfig, Bound, Case, Impl, run_case, run_cases  # noqa: E402
from bench.report import Target, finalize_case, new_record  # noqa: E402
from bench.timing import CpuTimer, TimeBoxExceeded, TimingConfig, rotation_sets, time_box  # noqa: E402


# --------------------------------------------------------------------------- models

def test_causal_flops_match_the_issue_model():
    # 2 * B * Hq * S^2 * D for square causal attention
    assert models.attention_flops(1, 64, 8192, 8192, 128, True) == 2 * 64 * 8192**2 * 128
    assert models.attention_flops(16, 64, 1024, 1024, 128, True) == 2 * 16 * 64 * 1024**2 * 128
    assert models.attention_flops(2, 8, 100, 300, 64, False) == 4 * 2 * 8 * 100 * 300 * 64
    assert models.max_score_flops(1, 4, 10, 10, 128, True) * 2 == models.attention_flops(1, 4, 10, 10, 128, True)


def test_causal_pairs_with_offset():
    # queries at the end of the keys: Sq*Sk - Sq^2/2
    assert models.causal_pairs(8192, 131072) == 8192 * 131072 - 8192**2 / 2
    # more queries than keys: the leading queries see nothing
    assert models.causal_pairs(300, 100) == 100 * 100 / 2
    assert models.causal_pairs(64, 64) == 64 * 64 / 2


def test_sparse_pairs_against_brute_force(rng):
    total_q, hkv, w, kv_len, blk = 300, 2, 3, 290, 16
    nb = math.ceil(kv_len / blk)
    ids = np.full((total_q, hkv, w), -1, dtype=np.int64)
    for i in range(total_q):
        for g in range(hkv):
            m = rng.integers(0, w + 1)
            ids[i, g, :m] = np.sort(rng.choice(nb, size=m, replace=False))
    pos = rng.integers(-5, 320, size=total_q)
    want = 0
    for i in range(total_q):
        for g in range(hkv):
            for b in ids[i, g]:
                if b < 0:
                    continue
                for j in range(b * blk, (b + 1) * blk):
                    want += int(j <= pos[i] and j < kv_len)
    assert models.sparse_pairs(ids, pos, kv_len, block=blk) == want


def test_sparse_attention_flops_scales_with_gqa():
    ids = np.array([[[0, 1]], [[0, -1]]])
    pos = np.array([200, 50])
    pairs = models.sparse_pairs(ids, pos, 1000)
    assert pairs == 128 + 73 + 51
    assert models.sparse_attention_flops(ids, pos, 1000, hq=8, d=128) == 4 * 128 * 8 * pairs
    with pytest.raises(ValueError):
        models.sparse_attention_flops(np.zeros((2, 2, 1), int), pos, 1000, hq=3, d=128)


def test_byte_models_and_rates():
    assert models.kv_bytes(64, 8192, 8, 128) == 2 * 64 * 8192 * 8 * 128 * 2
    assert models.topk_bytes(8192 * 64, 1024) == 8192 * 64 * 1024 * 4
    assert models.kda_decode_bytes(256, 32) == 2 * 256 * 32 * 128 * 128 * 4
    per_tok = 2 * 64 * (3 * 128 + 2 * 128) + 6 * 128 * 128
    assert models.kda_chunk_flops(8192, 64) == per_tok * 8192 * 64
    assert models.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert models.tbps(4e12, 1000.0) == pytest.approx(4.0)
    assert models.tflops(None, 1.0) is None and models.tbps(1.0, 0.0) is None


# --------------------------------------------------------------------------- records and targets

def test_new_record_has_the_schema():
    r = new_record("op", "case", "impl", "ours", ms=1.0)
    assert set(report.RECORD_KEYS) <= set(r)
    assert r["op"] == "op" and r["impl"] == "impl" and r["measured"] is True
    with pytest.raises(KeyError):
        new_record("op", "case", "impl", "ours", bogus=1)


def test_targets():
    ours = new_record("op", "c", "mate_cupy", "ours", ms=2.0, tbps=3.5, tflops=550.0)
    peer = new_record("op", "c", "flash", "peer", ms=3.0)
    recs = [ours, peer]
    assert Target("speedup", 1.0, "flash").evaluate(ours, recs) is True
    assert Target("speedup", 2.0, "flash").evaluate(ours, recs) is False
    assert Target("time_ratio", 0.6, "flash").evaluate(ours, recs) is False   # 2/3 > 0.6
    assert Target("time_ratio", 0.7, "flash").evaluate(ours, recs) is True
    assert Target("tbps", 3.0).evaluate(ours, recs) is True
    assert Target("tflops", 600).evaluate(ours, recs) is False and Target("tflops", 500).evaluate(ours, recs) is True
    assert Target("tflops", 600).text == ">=600 TFLOP/s"
    assert Target("ms", 2.5).evaluate(ours, recs) is True and Target("ms", 1.5).evaluate(ours, recs) is False
    assert Target("ms", 8.0).text == "<=8 ms"
    assert Target("speedup", 1.0, "missing").evaluate(ours, recs) is None
    failed = new_record("op", "c", "mate_cupy", "ours", error="boom")
    assert Target("speedup", 1.0, "flash").evaluate(failed, [failed, peer]) is None
    with pytest.raises(ValueError):
        Target("speedup", 1.0)
    with pytest.raises(ValueError):
        Target("fast", 1.0, "x")
    assert "sdpa_flash" in Target("speedup", 1.0, "sdpa_flash").text


def test_finalize_case_fills_derived_columns():
    ours = new_record("attn", "c", "mate_cupy", "ours", ms=2.0, flops=4e12, metric="tflops", err=1e-3)
    flash = new_record("attn", "c", "sdpa_flash", "peer", ms=4.0, flops=4e12, metric="tflops", err=5e-2)
    cudnn = new_record("attn", "c", "sdpa_cudnn", "peer", ms=1.0, flops=4e12, metric="tflops")
    broken = new_record("attn", "c", "other", "peer", error="RuntimeError: x")
    recs = finalize_case([ours, flash, cudnn, broken], baseline="sdpa_flash",
                         target=Target("speedup", 1.0, "sdpa_flash"), ceilings={"tflops": 4000.0}, tol=2e-2)
    assert ours["tflops"] == pytest.approx(2000.0)
    assert ours["ratio"] == pytest.approx(2.0) and flash["ratio"] == pytest.approx(1.0)
    assert ours["ratios"] == {"sdpa_flash": pytest.approx(2.0), "sdpa_cudnn": pytest.approx(0.5)}
    assert ours["ceiling_frac"] == pytest.approx(0.5)
    assert ours["target_met"] is True and ours["target"] == ">=1x sdpa_flash"
    assert flash["target"] is None and flash["target_met"] is None
    assert ours["err_ok"] is True and flash["err_ok"] is False
    assert broken["ratio"] is None and broken["tflops"] is None
    assert [report.status(r) for r in recs] == ["met", "WRONG", "ok", "ERROR"]


def test_status_of_missed_and_undecidable_targets():
    ours = new_record("op", "c", "mate_cupy", "ours", ms=5.0, bytes=1e9, metric="tbps")
    finalize_case([ours], baseline=None, target=Target("tbps", 3.0), ceilings={}, tol=None)
    assert ours["target_met"] is False and report.status(ours) == "MISSED"
    solo = new_record("op", "c", "mate_cupy", "ours", ms=5.0)
    finalize_case([solo], baseline="peer", target=Target("speedup", 1.0, "peer"), ceilings={}, tol=None)
    assert solo["target_met"] is None and report.status(solo) == "n/a"


def test_table_markdown_and_json_roundtrip(tmp_path):
    recs = [
        new_record("ceiling", "bf16 GEMM 8192^3", "torch", "ceiling", ms=1.5, tflops=733.0),
        new_record("msa dense prefill", "B1 S8192", "mate_cupy", "ours", ms=1.234, flops=1e12, metric="tflops",
                   err=float("inf")),
        new_record("msa dense prefill", "B1 S8192", "sdpa_flash", "peer", ms=3.3, flops=1e12, metric="tflops"),
        new_record("msa dense prefill", "B1 S8192", "sdpa_cudnn", "peer",
                   error="RuntimeError: No available kernel | with pipes"),
        new_record("msa sparse", "per-token", "flex", "peer", ms=219.0, measured=False, note="from the notes"),
    ]
    finalize_case(recs[1:4], baseline="sdpa_flash", target=Target("speedup", 1.0, "sdpa_flash"),
                  ceilings={"tflops": 733.0}, tol=2e-2)
    text = report.format_table(recs)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["op", "case", "impl"]
    assert any("ERROR: RuntimeError" in ln for ln in lines)
    assert any("219.0*" in ln for ln in lines)
    assert any("WRONG" in ln and "inf" in ln for ln in lines)
    meta = {"gpu": "NVIDIA H200", "commit": "abc123", "command": "python bench/run.py out", "date": "today",
            "mode": "full"}
    jpath, mpath = report.write_results(tmp_path / "out", recs, meta)
    back = report.load_results(jpath)
    assert isinstance(back, list) and len(back) == len(recs)
    assert all(r["commit"] == "abc123" and r["gpu"] == "NVIDIA H200" for r in back)
    assert back[1]["err"] == "inf"  # JSON has no inf: written as a string
    for r in back:
        assert {"op", "case", "impl", "ms", "tflops", "tbps"} <= set(r)
    md = mpath.read_text()
    assert md.startswith("# mate_cupy benchmark: NVIDIA H200")
    assert "`python bench/run.py out`" in md and "ceiling bf16 GEMM 8192^3: 733 TFLOP/s" in md
    assert "## Errors" in md and "No available kernel \\| with pipes" in md
    assert "## Notes" in md and "from the notes" in md
    table_lines = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert len(table_lines) == 1 + 4  # header + the non-ceiling records
    assert all(ln.count(" | ") == len(report.TABLE_COLUMNS) - 1 for ln in table_lines)


def test_load_results_refuses_non_lists(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"op": 1}))
    with pytest.raises(ValueError):
        report.load_results(p)


# --------------------------------------------------------------------------- timing helpers

def test_rotation_sets():
    l2 = 50e6
    assert rotation_sets(2e9, l2) == 1                 # big sets: no rotation needed
    assert rotation_sets(67e6, l2) == 3                # ceil(4 * 50 / 67)
    assert rotation_sets(1e3, l2) == 8                 # capped
    assert rotation_sets(1e3, l2, max_sets=2) == 2
    assert rotation_sets(10e9, l2, max_total_bytes=5e9) == 1
    assert rotation_sets(0, l2) == 1


def test_cpu_timer_rotates_and_takes_median():
    calls = []
    timer = CpuTimer(TimingConfig(warmup=2, samples=5))
    res = timer.time(lambda i: calls.append(i), 3)
    assert calls == [0, 1, 0, 1, 2, 0, 1]
    assert res["samples"] == 5 and res["ms"] >= 0 and res["ms_min"] <= res["ms"] <= res["ms_max"]
    with pytest.raises(NotImplementedError):
        timer.time_graph(lambda i: None, 1)


class _FakeCudaClock:
    """torch stand-in for :class:`bench.timing.Timer`: every call of the timed op advances a
    GPU clock by ``call_ms``; events read that clock when recorded."""

    def __init__(self, call_ms):
        self.call_ms, self.now = call_ms, 0.0
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = clock.now

            def elapsed_time(self, end):
                return end.t - self.t

        class cuda:
            synchronize = staticmethod(lambda: None)

        cuda.Event = Event
        self.cuda = cuda

        class CUDAGraph:  # capture records the calls; a replay runs them on the clock
            def __init__(self):
                self.calls = []

            def replay(self):
                clock.now += clock.call_ms * len(self.calls)
                clock.replays += 1

        @contextlib.contextmanager
        def graph(g):
            clock.capturing = g
            try:
                yield
            finally:
                clock.capturing = None

        @contextlib.contextmanager
        def stream(s):
            yield

        class Stream:
            def wait_stream(self, other):
                pass

        cuda.CUDAGraph, cuda.graph, cuda.stream, cuda.Stream = CUDAGraph, staticmethod(graph), \
            staticmethod(stream), Stream
        cuda.current_stream = staticmethod(Stream)
        self.capturing, self.replays = None, 0

    def op(self, calls):
        def run(i):
            calls.append(i)
            if self.capturing is not None:
                self.capturing.calls.append(i)
            else:
                self.now += self.call_ms
        return run


def test_cuda_timer_warms_up_for_a_time_before_its_samples():
    from bench.timing import Timer

    for call_ms, n_sets in ((0.5, 2), (0.0625, 3), (80.0, 1)):  # exact binary fractions
        fake = _FakeCudaClock(call_ms)
        timer = Timer.__new__(Timer)
        timer.cfg, timer.torch = TimingConfig(warmup=3, warmup_ms=50.0, samples=4, min_sample_ms=1.0), fake
        calls = []
        res = timer.time(fake.op(calls), n_sets)
        extra = int(50.0 / call_ms)                      # back-to-back warm-up after the estimate
        inner = max(1, math.ceil(1.0 / call_ms))
        assert res["inner"] == inner and res["samples"] == 4
        assert len(calls) == 3 + n_sets + extra + 4 * inner
        assert calls[3 + n_sets:3 + n_sets + extra] == [w % n_sets for w in range(extra)]
        assert res["ms"] == pytest.approx(call_ms)


def test_cuda_graph_timer_warms_up_for_a_time_before_its_samples():
    from bench.timing import Timer

    for call_ms, n_sets in ((0.5, 2), (0.0625, 3), (4.0, 1)):  # exact binary fractions
        fake = _FakeCudaClock(call_ms)
        timer = Timer.__new__(Timer)
        timer.cfg, timer.torch = TimingConfig(warmup_ms=50.0, graph_min_calls=32), fake
        calls = []
        res = timer.time_graph(fake.op(calls), n_sets, samples=4)
        graph_calls = n_sets * math.ceil(32 / n_sets)
        assert res["graph_calls"] == graph_calls
        assert calls[:n_sets] == list(range(n_sets))   # the side-stream warm-up, then the capture
        assert calls[n_sets:] == [j % n_sets for j in range(graph_calls)]
        extra = int(50.0 / (call_ms * graph_calls))     # replays after the timed one
        assert fake.replays == 1 + 1 + extra + 4
        assert res["ms_graph"] == pytest.approx(call_ms)


def test_time_box_interrupts_and_restores():
    with pytest.raises(TimeBoxExceeded):
        with time_box(0.2, "sleeper"):
            time.sleep(2.0)
    with time_box(5.0):
        time.sleep(0.01)
    with time_box(None):
        pass


# --------------------------------------------------------------------------- the per-case loop

def _case(impls, check=None, make_inputs=None, target=None, baseline="peer"):
    return Case(op="op", name="case", make_inputs=make_inputs or (lambda n: [{"x": i} for i in range(n)]),
                set_bytes=1e3, impls=impls, metric="tbps", bytes=1e9, baseline=baseline, target=target,
                check=check, tol=1e-3)


def _cfg(**kw):
    return BenchConfig(device="cpu", size="tiny", graphs=False, timing=TimingConfig(warmup=1, samples=2), **kw)


def test_run_case_isolates_failures_and_checks():
    seen = []

    def good(inputs):
        return Bound(lambda i: seen.append(("good", inputs[i]["x"])) or [1.0, 2.0])

    def bad_build(inputs):
        raise NotImplementedError("kernel not written yet")

    def bad_run(inputs):
        def run(i):
            raise RuntimeError("launch failed")
        return Bound(run)

    def check(results, inp):
        assert inp == {"x": 0}
        return {name: {"err": 0.0 if name == "mine" else 1.0, "err_vs": "ref"} for name in results}

    case = _case([Impl("mine", "ours", good), Impl("peer", "peer", good, family="sdpa_flash"),
                  Impl("nope", "ours", bad_build), Impl("boom", "peer", bad_run, family="flex")],
                 check=check, target=Target("speedup", 1.0, "peer"))
    recs = {r["impl"]: r for r in run_case(case, _cfg(), CpuTimer(TimingConfig(warmup=1, samples=2)), log=lambda *a: None)}
    assert recs["mine"]["ms"] is not None and recs["mine"]["err"] == 0.0 and recs["mine"]["err_ok"] is True
    assert recs["peer"]["err"] == 1.0 and recs["peer"]["err_ok"] is False
    assert recs["nope"]["error"].startswith("NotImplementedError: kernel not written yet")
    assert recs["boom"]["error"].startswith("RuntimeError: launch failed")
    assert recs["mine"]["n_sets"] == 8 and recs["mine"]["tbps"] is not None
    assert recs["mine"]["target"] == ">=1x peer" and recs["mine"]["target_met"] in (True, False)
    assert recs["mine"]["first_call_ms"] is not None


def test_run_case_peer_filter_fixed_numbers_and_input_failure():
    case = _case([Impl("mine", "ours", lambda inp: Bound(lambda i: time.sleep(0.001))),
                  Impl("flexpeer", "peer", lambda inp: Bound(lambda i: None), family="flex"),
                  Impl("noted", "peer", None, family="fla", fixed={"ms": 219.0, "note": "from the notes"})],
                 baseline="noted")
    recs = {r["impl"]: r for r in run_case(case, _cfg(peers=("fla",)), CpuTimer(TimingConfig()),
                                           log=lambda *a: None)}
    assert set(recs) == {"mine", "noted"}
    assert recs["noted"]["ms"] == 219.0 and recs["noted"]["measured"] is False
    assert recs["mine"]["ratio"] == pytest.approx(219.0 / recs["mine"]["ms"])

    def broken_inputs(n):
        raise MemoryError("out of memory")

    case = _case([Impl("mine", "ours", lambda inp: Bound(lambda i: None))], make_inputs=broken_inputs)
    recs = run_case(case, _cfg(), CpuTimer(TimingConfig()), log=lambda *a: None)
    assert recs[0]["error"].startswith("building inputs: MemoryError")


def test_run_case_check_failure_is_a_note_not_a_crash():
    def check(results, inp):
        raise ValueError("shape mismatch")

    case = _case([Impl("mine", "ours", lambda inp: Bound(lambda i: 1))], check=check)
    (rec,) = run_case(case, _cfg(), CpuTimer(TimingConfig()), log=lambda *a: None)
    assert rec["ms"] is not None and rec["error"] is None
    assert "check failed: ValueError: shape mismatch" in rec["note"]


def test_run_cases_filters_by_regex():
    a = _case([Impl("mine", "ours", lambda inp: Bound(lambda i: None))])
    b = Case(op="kda decode", name="B32", make_inputs=lambda n: [{}], set_bytes=1, impls=a.impls)
    recs = run_cases([a, b], _cfg(case_filter="kda"), CpuTimer(TimingConfig()), log=lambda *a: None)
    assert {r["op"] for r in recs} == {"kda decode"}


# --------------------------------------------------------------------------- torch pieces

@pytest.mark.torch
def test_select_blocks_properties():
    import torch

    from bench.bench_attention import select_blocks

    nb, topk, hkv = 40, 8, 3
    g = torch.Generator().manual_seed(0)
    last = torch.arange(nb)
    ids = select_blocks(last, hkv, nb, topk, g)
    assert ids.shape == (nb, hkv, topk) and ids.dtype == torch.int32
    for t in range(nb):
        for h in range(hkv):
            row = [b for b in ids[t, h].tolist() if b >= 0]
            assert row == sorted(set(row)), row                 # ascending, no duplicates
            assert all(b <= t for b in row) and 0 in row and t in row
            assert len(row) == min(topk, t + 1)
            assert ids[t, h, len(row):].eq(-1).all()


@pytest.mark.torch
@pytest.mark.parametrize("per_token", [False, True])
def test_flex_block_masks_match_a_dense_mask(per_token):
    import torch

    from bench.bench_attention import select_blocks
    from bench.checks import rel_err
    from bench.peers import tile_block_mask, token_block_mask
    from torch.nn.attention.flex_attention import flex_attention

    s, hq, hkv, d, topk, blk = 768, 4, 2, 32, 3, 128
    nb, r = s // blk, hq // hkv
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(s, h, d, generator=g) for h in (hq, hkv, hkv))
    if per_token:
        ids = select_blocks(torch.arange(s) // blk, hkv, nb, topk, g)
        bm = token_block_mask(ids, hq, nb)
    else:
        tiles = select_blocks(torch.arange(nb), hkv, nb, topk, g)
        ids = tiles[torch.arange(s) // blk]
        bm = tile_block_mask(tiles, hq, nb)
    allowed = torch.zeros(hkv, s, s, dtype=torch.bool)
    for i in range(s):
        for h in range(hkv):
            for b in ids[i, h].tolist():
                if b >= 0:
                    allowed[h, i, b * blk:(b + 1) * blk] = True
    allowed = allowed.repeat_interleave(r, 0) & torch.ones(s, s, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(r, 0), v.transpose(0, 1).repeat_interleave(r, 0),
        attn_mask=allowed).transpose(0, 1)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex_attention(q.view(1, s, hq, d).transpose(1, 2), k.view(1, s, hkv, d).transpose(1, 2),
                             v.view(1, s, hkv, d).transpose(1, 2), block_mask=bm, enable_gqa=True)
    assert rel_err(out.transpose(1, 2).reshape(s, hq, d), ref) < 1e-5


@pytest.mark.torch
def test_attention_and_block_max_references_against_brute_force():
    import torch

    from bench.checks import attention_rows, block_max_rows, rel_err

    g = torch.Generator().manual_seed(2)
    sk, hq, hkv, d = 300, 4, 2, 16
    q = torch.randn(5, hq, d, generator=g)
    k, v = torch.randn(sk, hkv, d, generator=g), torch.randn(sk, hkv, d, generator=g)
    pos = torch.tensor([0, 17, 128, 255, 299])
    out = attention_rows(q, k, v, pos, sk, True, 0.25)
    mx = block_max_rows(q, k, pos, sk, True, n_tiles=3)
    for i in range(5):
        for h in range(hq):
            kk, vv = k[: pos[i] + 1, h // 2].double(), v[: pos[i] + 1, h // 2].double()
            s = kk @ q[i, h].double()
            p = torch.softmax(s * 0.25, 0)
            assert rel_err(out[i, h], p @ vv) < 1e-5
            for t in range(3):
                seg = s[t * 128:(t + 1) * 128]
                want = seg.max() if seg.numel() else torch.tensor(-math.inf)
                assert (mx[i, h, t].double() - want).abs() < 1e-4 or (mx[i, h, t] == want)


@pytest.mark.torch
def test_kda_prefix_matches_the_project_reference():
    import torch

    from bench.checks import kda_prefix, rel_err
    from mate_cupy.reference import kda as ref_kda

    g = torch.Generator().manual_seed(3)
    t, h, hv, kd = 12, 2, 4, 16
    q, k = torch.randn(t, h, kd, generator=g), torch.randn(t, h, kd, generator=g)
    v, graw = torch.randn(t, hv, kd, generator=g), torch.randn(t, hv, kd, generator=g)
    beta = torch.randn(t, hv, generator=g)
    a_log = torch.log(torch.empty(hv).uniform_(1, 16, generator=g))
    dt_bias = torch.randn(hv, kd, generator=g) * 0.5
    cu = torch.tensor([0, 5, 12])
    steps = 5
    ours = kda_prefix(q, k, v, graw, beta, a_log, dt_bias, cu[:-1], steps, -5.0, kd ** -0.5)
    want, _ = ref_kda.kda_recurrent(q[None].numpy(), k[None].numpy(), v[None].numpy(), graw[None].numpy(),
                                    beta[None].numpy(), scale=kd ** -0.5, cu_seqlens=cu.numpy(),
                                    A_log=a_log.numpy(), dt_bias=dt_bias.numpy(), lower_bound=-5.0,
                                    use_qk_l2norm=True)
    want = torch.from_numpy(np.asarray(want))[0]
    for n in range(2):
        assert rel_err(ours[n], want[cu[n]:cu[n] + steps]) < 1e-5


@pytest.mark.torch
def test_cpu_smoke_run_writes_results(tmp_path):
    from bench import run

    rc = run.main([str(tmp_path / "out"), "--device", "cpu", "--only", "index", "--case", "topk",
                   "--commit", "testcommit"])
    assert rc == 0
    recs = report.load_results(tmp_path / "out" / "results.json")
    impls = {(r["case"], r["impl"]) for r in recs}
    assert len({c for c, _ in impls}) == 2
    for r in recs:
        assert r["commit"] == "testcommit" and r["mode"] == "tiny"
        assert {"op", "case", "impl", "ms", "tbps", "gpu"} <= set(r)
    peers = [r for r in recs if r["impl"] == "torch.topk"]
    assert all(r["ms"] > 0 and r["err"] == 0.0 and r["error"] is None for r in peers)
    ours = [r for r in recs if r["impl"] == "mate_cupy"]
    assert all(r["error"] or r["err"] == 0.0 for r in ours)  # our reference path, or a recorded error
    assert (tmp_path / "out" / "results.md").read_text().count("| msa topk select |") == 4


def test_compare_runs():
    from bench.compare import compare

    old = [new_record("op", "c", "mate_cupy", "ours", ms=2.0, commit="a"),
           new_record("op", "c", "flash", "peer", ms=3.0, commit="a")]
    new = [new_record("op", "c", "mate_cupy", "ours", ms=1.0, commit="b"),
           new_record("op", "c", "flash", "peer", error="x", commit="b"),
           new_record("op", "d", "mate_cupy", "ours", ms=5.0, commit="b"),
           new_record("ceiling", "copy", "torch", "ceiling", ms=1.0)]
    rows = compare(old, new)
    assert [(r["case"], r["impl"], r["speedup"]) for r in rows] == [
        ("c", "mate_cupy", 2.0), ("c", "flash", None), ("d", "mate_cupy", None)]
    assert [r["impl"] for r in compare(old, new, impl="flash")] == ["flash"]


# --------------------------------------------------------------------------- on the GPU

@pytest.mark.gpu
@pytest.mark.torch
def test_gpu_timer_graph_and_ceilings():
    import torch

    from bench.timing import Timer, measure_ceilings

    timer = Timer(TimingConfig(warmup=2, samples=5))
    xs = [torch.randn(4096, 4096, device="cuda") for _ in range(2)]
    ys = [torch.empty_like(x) for x in xs]
    calls = []

    def run(i):
        calls.append(i)
        return torch.mul(xs[i], 2.0, out=ys[i])

    res = timer.time(run, 2)
    assert 0 < res["ms_min"] <= res["ms"] <= res["ms_max"] and res["samples"] >= 3
    assert calls[:4] == [0, 1, 0, 1]
    g = timer.time_graph(run, 2, samples=3)
    assert g["ms_graph"] > 0 and g["graph_calls"] % 2 == 0
    torch.testing.assert_close(ys[1], xs[1] * 2.0)
    ceil = {c["metric"]: c for c in measure_ceilings(timer, copy_bytes=1 << 28, gemm_n=4096)}
    assert 0.5e12 < ceil["tbps"]["bytes"] / (ceil["tbps"]["ms"] * 1e-3) < 20e12
    assert 50e12 < ceil["tflops"]["flops"] / (ceil["tflops"]["ms"] * 1e-3) < 5000e12


@pytest.mark.gpu
@pytest.mark.torch
@pytest.mark.parametrize("backend", ["flash", "cudnn"])
def test_gpu_sdpa_peer_matches_the_reference(backend):
    import torch

    from bench.checks import attention_rows, rel_err, sample_rows
    from bench.peers import sdpa_build

    b, s, hq, hkv, d = 2, 512, 8, 2, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = [{n: torch.randn(b * s, h, d, generator=g, device="cuda").to(torch.bfloat16)
               for n, h in (("q", hq), ("k", hkv), ("v", hkv))}]
    bound = sdpa_build(backend, b, s, s, hq, hkv, d, causal=True)(inputs)
    with bound.context():
        out = bound.result(bound.run(0))
    rows = sample_rows(b * s, 16, "cuda")
    bi, pos = rows // s, rows % s
    k = inputs[0]["k"].view(b, s, hkv, d)[bi]
    v = inputs[0]["v"].view(b, s, hkv, d)[bi]
    ref = attention_rows(inputs[0]["q"][rows], k, v, pos, torch.full_like(pos, s), True, d ** -0.5)
    assert rel_err(out[rows], ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.torch
def test_gpu_quick_run_times_torch_topk(tmp_path):
    from bench import run

    rc = run.main([str(tmp_path / "o"), "--quick", "--only", "index", "--case", "topk", "--peers", "torch_topk",
                   "--no-ceilings", "--samples", "3", "--commit", "gputest"])
    assert rc == 0
    recs = [r for r in report.load_results(tmp_path / "o" / "results.json") if r["impl"] == "torch.topk"]
    assert len(recs) == 2
    for r in recs:
        assert r["error"] is None and r["ms"] > 0 and r["tbps"] > 0 and r["err"] == 0.0
        assert r["ms_graph"] is not None and r["ms_graph"] > 0, r["graph_error"]


def test_lost_cuda_context_skips_the_rest(monkeypatch):
    import bench.harness as harness

    monkeypatch.setattr(harness, "cuda_alive", lambda: False)

    class FakeCudaTimer(CpuTimer):
        kind = "cuda"

    def faulting(inputs):
        def run(i):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return Bound(run)

    ok = lambda inputs: Bound(lambda i: None)  # noqa: E731
    first = _case([Impl("mine", "ours", faulting), Impl("peer", "peer", ok)])
    second = Case(op="op2", name="next", make_inputs=lambda n: [{}], set_bytes=1,
                  impls=[Impl("mine", "ours", ok)])
    cfg = _cfg()
    seen = []
    recs = run_cases([first, second], cfg, FakeCudaTimer(TimingConfig()), log=lambda *a: None,
                     progress=lambda r: seen.append(len(r)))
    by = {(r["op"], r["impl"]): r for r in recs}
    assert by[("op", "mine")]["error"].startswith("RuntimeError: CUDA error: an illegal memory access")
    assert by[("op", "peer")]["error"].startswith("skipped: CUDA context lost after op / case / mine")
    assert by[("op2", "mine")]["error"].startswith("skipped: CUDA context lost")
    assert cfg.context_lost and seen == [2]


def test_family_child_crash_keeps_partial_records(tmp_path, monkeypatch):
    import subprocess
    import types

    from bench import run

    args = run.parse_args([str(tmp_path / "out"), "--only", "index,kda", "--device", "cpu", "--case", "topk"])
    args._commit = "c0ffee"
    cfg = BenchConfig(device="cpu", peers=("torch_topk",), outdir=args.outdir)
    part = tmp_path / "out" / ".parts" / "index"

    def fake_run(argv):
        assert argv[2] == str(part.resolve()) and argv[argv.index("--only") + 1] == "index" and "--child" in argv
        assert argv[argv.index("--peers") + 1] == "torch_topk" and argv[argv.index("--commit") + 1] == "c0ffee"
        report.write_results(part, [new_record("msa topk select", "[8, 4, 1024]", "mate_cupy", "ours", ms=1.0)],
                             {"commit": "c0ffee"})
        (part / "fla_configs" / "GPU").mkdir(parents=True)
        (part / "fla_configs" / "GPU" / "k.json").write_text("{}")
        return types.SimpleNamespace(returncode=-11)

    monkeypatch.setattr(subprocess, "run", fake_run)
    meta = {}
    recs = run.run_family_in_child("index", args, cfg, meta)
    assert recs[0]["impl"] == "mate_cupy" and recs[0]["ms"] == 1.0
    assert recs[-1]["impl"] == "harness" and "died (signal 11) after 1 cases" in recs[-1]["error"]
    assert (tmp_path / "out" / "fla_configs" / "GPU" / "k.json").is_file() and not part.exists()
