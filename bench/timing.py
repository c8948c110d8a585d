"""Timing: CUDA events (back-to-back launches), CUDA-graph replay, ceilings, time boxes.

``run(i)`` callables take the index of an input set; the timers call them in
rotation (``0, 1, ..., n_sets - 1, 0, ...``) so that consecutive calls read
different memory and the L2 cache (50 MB on an H200) does not flatter.

* :meth:`Timer.time`: warm-up calls, one estimate, more warm-up calls until
  ``warmup_ms`` of GPU time has run (so that the GPU settles under the op's own
  load before any sample, whatever ran or idled before it), then ``samples`` event pairs
  each around ``inner`` back-to-back calls (``inner`` grows for sub-millisecond
  ops so a sample lasts at least ``min_sample_ms``); the result is the median
  sample divided by ``inner``. No host synchronisation between samples, so this
  is the throughput of plain Python launches (launch overhead included).
* :meth:`Timer.time_graph`: captures ``calls`` rotated calls in one
  ``torch.cuda.CUDAGraph``, replays it back to back for ``warmup_ms`` as above, and times
  ``samples`` replays: the GPU-side cost without Python.
* :class:`CpuTimer`: the same interface on ``time.perf_counter`` for the CPU
  smoke run (tests); no graphs.
"""
from __future__ import annotations

import contextlib
import math
import signal
import statistics
import threading
import time
from dataclasses import dataclass


@dataclass
class TimingConfig:
    warmup: int = 3
    warmup_ms: float = 50.0        # then back-to-back calls for at least this long before the samples
    samples: int = 10
    min_samples: int = 3
    min_sample_ms: float = 1.0
    max_inner: int = 200
    budget_s: float = 8.0          # cap on the timed phase of one impl (samples shrink, never below min_samples)
    graph_min_calls: int = 32      # calls captured in one graph (rounded up to a multiple of n_sets)


def rotation_sets(set_bytes: float, l2_bytes: float, *, l2_multiple: float = 4.0, max_sets: int = 8,
                  max_total_bytes: float = 24e9) -> int:
    """How many input sets to rotate through: enough that one rotation covers
    ``l2_multiple`` x the L2 size, at most ``max_sets`` and ``max_total_bytes``."""
    if set_bytes <= 0:
        return 1
    n = math.ceil(l2_multiple * l2_bytes / set_bytes)
    n = min(n, max_sets, max(1, int(max_total_bytes // set_bytes)))
    return max(1, n)


class Timer:
    """CUDA-event timer on torch's current stream."""

    kind = "cuda"

    def __init__(self, cfg: TimingConfig):
        self.cfg = cfg
        import torch

        self.torch = torch

    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def wall(self, fn):
        """Wall-clock seconds of ``fn()`` including the GPU work it queued."""
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t0

    def _event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def _warmup_count(self, est_ms: float) -> int:
        """Back-to-back calls (or replays) of ``est_ms`` each that fill ``warmup_ms``."""
        return int(min(self.cfg.warmup_ms / est_ms, 10_000))

    def time(self, run, n_sets: int, *, samples: int | None = None, warmup: int | None = None) -> dict:
        cfg = self.cfg
        samples = cfg.samples if samples is None else samples
        warmup = cfg.warmup if warmup is None else warmup
        for w in range(warmup):
            run(w % n_sets)
        self.sync()
        # estimate one call from one rotation
        e0, e1 = self._event(), self._event()
        e0.record()
        for i in range(n_sets):
            run(i)
        e1.record()
        self.sync()
        est = max(e0.elapsed_time(e1) / n_sets, 1e-4)
        for w in range(self._warmup_count(est)):
            run(w % n_sets)
        inner = int(min(cfg.max_inner, max(1, math.ceil(cfg.min_sample_ms / est))))
        fit = int(cfg.budget_s * 1e3 / (est * inner))
        samples = max(cfg.min_samples, min(samples, fit))
        events = [(self._event(), self._event()) for _ in range(samples)]
        k = 0
        for start, end in events:
            start.record()
            for _ in range(inner):
                run(k % n_sets)
                k += 1
            end.record()
        self.sync()
        times = sorted(s.elapsed_time(e) / inner for s, e in events)
        return {"ms": statistics.median(times), "ms_min": times[0], "ms_max": times[-1],
                "samples": samples, "inner": inner}

    def time_graph(self, run, n_sets: int, *, samples: int | None = None) -> dict:
        """Median ms per call replaying a CUDA graph of rotated calls (raises if capture fails)."""
        torch = self.torch
        samples = self.cfg.samples if samples is None else samples
        calls = n_sets * max(1, math.ceil(self.cfg.graph_min_calls / n_sets))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm the capture path on a side stream (allocator, lazy init)
            for i in range(n_sets):
                run(i)
        torch.cuda.current_stream().wait_stream(side)
        self.sync()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for j in range(calls):
                    run(j % n_sets)
            graph.replay()
            self.sync()
            e0, e1 = self._event(), self._event()  # one timed replay, then replays for warmup_ms
            e0.record()
            graph.replay()
            e1.record()
            self.sync()
            for _ in range(self._warmup_count(max(e0.elapsed_time(e1), 1e-4))):
                graph.replay()
            events = [(self._event(), self._event()) for _ in range(samples)]
            for start, end in events:
                start.record()
                graph.replay()
                end.record()
            self.sync()
            times = sorted(s.elapsed_time(e) / calls for s, e in events)
        finally:
            del graph
        return {"ms_graph": statistics.median(times), "graph_calls": calls}


class CpuTimer:
    """perf_counter timer with :class:`Timer`'s interface (CPU smoke runs)."""

    kind = "cpu"

    def __init__(self, cfg: TimingConfig):
        self.cfg = cfg

    def sync(self) -> None:
        pass

    def wall(self, fn):
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0

    def time(self, run, n_sets: int, *, samples: int | None = None, warmup: int | None = None) -> dict:
        cfg = self.cfg
        samples = max(1, cfg.samples if samples is None else samples)
        for w in range(cfg.warmup if warmup is None else warmup):
            run(w % n_sets)
        times = []
        for k in range(samples):
            t0 = time.perf_counter()
            run(k % n_sets)
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return {"ms": statistics.median(times), "ms_min": times[0], "ms_max": times[-1],
                "samples": samples, "inner": 1}

    def time_graph(self, run, n_sets: int, *, samples: int | None = None) -> dict:
        raise NotImplementedError("CUDA graphs need a GPU")


def captured_graph(torch, fn):
    """``fn()`` run once on a side stream (allocator and lazy initialisation), then captured
    in a ``torch.cuda.CUDAGraph``, which is returned (not yet replayed)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        fn()
    return gr


def graph_replay_us(torch, fn, replays: int = 20, err_chars: int = 120):
    """GPU microseconds per call of ``fn()`` captured once in a CUDA graph (warmed on a side
    stream first, :func:`captured_graph`) and replayed ``replays`` times; a string saying why
    when capture fails."""
    try:
        gr = captured_graph(torch, fn)
        gr.replay()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(replays):
            gr.replay()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / replays * 1e3
    except Exception as e:  # not capture-safe
        torch.cuda.synchronize()
        return f"capture failed: {type(e).__name__}: {e}"[:err_chars]


def make_timer(device: str, cfg: TimingConfig):
    return Timer(cfg) if device == "cuda" else CpuTimer(cfg)


# --------------------------------------------------------------------------- ceilings

def _copy_ms(timer, nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src.fill_(1)
    dst = torch.empty_like(src)
    return timer.time(lambda i: dst.copy_(src), 1, samples=10, warmup=2)["ms"]


def _gemm_ms(timer, n: int) -> float:
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    c = torch.empty_like(a)
    return timer.time(lambda i: torch.matmul(a, b, out=c), 1, samples=10, warmup=3)["ms"]


def measure_ceilings(timer, *, copy_bytes: int = 1 << 31, gemm_n: int = 8192) -> list[dict]:
    """The machine's measured ceilings: a device-to-device copy (TB/s counting bytes
    read + written) and an ``n^3`` bf16 GEMM (TFLOP/s). Returns ``[{"case", "ms",
    "bytes" | "flops", "metric"}]``; the caller turns them into records."""
    import torch

    out = [{"case": f"d2d copy {copy_bytes / 2**30:g} GiB", "ms": _copy_ms(timer, copy_bytes),
            "bytes": 2.0 * copy_bytes, "metric": "tbps"}]
    torch.cuda.empty_cache()
    out.append({"case": f"bf16 GEMM {gemm_n}^3", "ms": _gemm_ms(timer, gemm_n), "flops": 2.0 * gemm_n**3,
                "metric": "tflops"})
    torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- time boxes

class TimeBoxExceeded(TimeoutError):
    pass


@contextlib.contextmanager
def time_box(seconds: float | None, what: str = "call"):
    """Raise :class:`TimeBoxExceeded` inside the block after ``seconds`` (SIGALRM;
    main thread on Unix only, else a no-op). The signal interrupts Python code
    between bytecodes and blocking waits (e.g. on a ``ptxas`` subprocess)."""
    usable = (seconds is not None and seconds > 0 and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def _alarm(signum, frame):
        raise TimeBoxExceeded(f"{what} exceeded its time box of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
