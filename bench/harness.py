"""Cases, implementations and the loop that runs one case in isolation.

A :class:`Case` is one op at one shape: it builds the input sets (rotated by the
timer), lists the implementations to time (ours and the peers), names the
baseline peer that ratios are taken against, the issue's target, the FLOP/byte
model and a correctness check. :func:`run_case` never raises: an exception in
building inputs, in one impl, in the CUDA-graph capture or in the check is
recorded in the ``error`` / ``graph_error`` / ``note`` field and the run goes on.
"""
from __future__ import annotations

import gc
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .report import Target, finalize_case, new_record
from .timing import TimingConfig, rotation_sets, time_box

PEER_FAMILIES = ("sdpa_flash", "sdpa_cudnn", "flex", "torch_topk", "fla")


@dataclass
class BenchConfig:
    """What one ``bench/run.py`` invocation asked for."""

    device: str = "cuda"            # "cuda", or "cpu" for the smoke run (tiny shapes, no graphs)
    size: str = "full"              # "full" (the issues' shapes), "quick", "tiny" (CPU smoke)
    peers: tuple = PEER_FAMILIES    # peer families to run
    graphs: bool = True             # CUDA-graph replay timing for capture-safe small ops
    check: bool = True              # correctness check against the case's reference
    case_filter: Optional[str] = None
    flex_per_token: bool = False    # time FlexAttention's per-token sparse case (219 ms per call)
    fla_budget_s: float = 300.0     # total time allowed for fla's first calls (Triton autotuning)
    fla_configs: Optional[str] = None  # directory of saved fla autotune configs ("" = none)
    l2_bytes: float = 50e6
    timing: TimingConfig = field(default_factory=TimingConfig)
    ceilings: dict = field(default_factory=dict)  # {"tflops": .., "tbps": ..} measured this run
    outdir: Optional[str] = None
    context_lost: Optional[str] = None  # set when a sticky CUDA error killed the context

    def wants(self, peer_family: Optional[str]) -> bool:
        return peer_family is None or peer_family in self.peers


@dataclass
class Bound:
    """An implementation bound to a case's input sets.

    run(i): launch on input set ``i`` (returns the output); result(out): turns the
    first call's output (``run(0)``) into what the case's check compares (default:
    ``out`` itself; the harness clones it); context: entered around the first call,
    timing and capture (e.g. ``sdpa_kernel``).
    """

    run: Callable[[int], Any]
    result: Optional[Callable[[Any], Any]] = None
    context: Optional[Callable[[], Any]] = None
    note: Optional[str] = None


@dataclass
class Impl:
    name: str
    kind: str                                   # "ours" or "peer"
    build: Callable[[list], Bound]              # inputs (list of sets) -> Bound; untimed
    family: Optional[str] = None                # peer family for --peers (None: always run)
    capture_safe: bool = False                  # time CUDA-graph replay too
    flops: Optional[float] = None               # override the case's model (e.g. max score vs attention)
    bytes: Optional[float] = None
    samples: Optional[int] = None               # cap (very slow peers)
    guard: Optional[Callable[[], Any]] = None   # context around build + first call (time boxes)
    fixed: Optional[dict] = None                # not timed: {"ms": .., "note": ..} (a number from the notes)
    once: bool = False                          # calls of many seconds: one timed call after the first


@dataclass
class Case:
    op: str
    name: str
    make_inputs: Callable[[int], list]          # n_sets -> list of input dicts
    set_bytes: float                            # bytes one call reads (rotation sizing)
    impls: list
    metric: str = "tflops"                      # "tflops" or "tbps": what the ceiling fraction uses
    flops: Optional[float] = None
    bytes: Optional[float] = None
    baseline: Optional[str] = None
    target: Optional[Target] = None
    check: Optional[Callable[[dict, dict], dict]] = None   # (results by impl, inputs[0]) -> {impl: {"err", "err_vs"}}
    tol: Optional[float] = None
    params: dict = field(default_factory=dict)
    max_sets: int = 8


def _err_text(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = ""
    if tb:
        fr = tb[-1]
        where = f" [{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno}]"
    msg = " ".join(str(e).split())
    if len(msg) > 600:
        msg = msg[:597] + "..."
    return f"{type(e).__name__}: {msg}{where}"


def _snapshot(x):
    """Detach a result from buffers later calls overwrite."""
    if x is None:
        return None
    if isinstance(x, (tuple, list)):
        return type(x)(_snapshot(v) for v in x)
    if isinstance(x, dict):
        return {k: _snapshot(v) for k, v in x.items()}
    if hasattr(x, "clone"):
        return x.clone()
    if hasattr(x, "copy"):
        return x.copy()
    return x


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


def free_device_memory() -> None:
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:
            pass
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            cupy.get_default_memory_pool().free_all_blocks()
        except Exception:
            pass


def cuda_alive() -> bool:
    """False once a sticky CUDA error (e.g. an illegal address) has killed the context."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return True
    try:
        torch.cuda.synchronize()
        return float(torch.ones(1, device="cuda").add_(1).item()) == 2.0
    except Exception:
        return False


def _sync_quietly(timer) -> Optional[str]:
    try:
        timer.sync()
        return None
    except Exception as e:  # an asynchronous kernel fault surfaces here
        return _err_text(e)


def run_case(case: Case, cfg: BenchConfig, timer, log=print) -> list[dict]:
    """Time every wanted impl of ``case``; returns its finalized records."""
    impls = [im for im in case.impls if cfg.wants(im.family)]
    recs = {}
    for im in impls:
        recs[im.name] = new_record(
            case.op, case.name, im.name, im.kind, metric=case.metric,
            flops=im.flops if im.flops is not None else case.flops,
            bytes=im.bytes if im.bytes is not None else case.bytes,
            params=dict(case.params), note=None,
        )
    log(f"[{case.op}] {case.name}")
    inputs = None
    try:
        n_sets = rotation_sets(case.set_bytes, cfg.l2_bytes, max_sets=case.max_sets)
        inputs = case.make_inputs(n_sets)
        for im in impls:  # models may depend on the drawn inputs (sparse selections)
            r = recs[im.name]
            r["n_sets"] = n_sets
            r["flops"] = im.flops if im.flops is not None else case.flops
            r["bytes"] = im.bytes if im.bytes is not None else case.bytes
    except Exception as e:
        err = "building inputs: " + _err_text(e)
        for r in recs.values():
            r["error"] = err
        log(f"    inputs failed: {err}")
        inputs = None
    results = {}
    if inputs is not None:
        for im in impls:
            rec = recs[im.name]
            if im.fixed is not None:
                rec.update(ms=im.fixed["ms"], measured=False, note=im.fixed.get("note"))
                continue
            bound = None
            try:
                with (im.guard() if im.guard else _nullcontext()):
                    bound = im.build(inputs)
                    if bound.note:
                        rec["note"] = bound.note
                    with (bound.context() if bound.context else _nullcontext()):
                        out, first_s = timer.wall(lambda: bound.run(0))
                rec["first_call_ms"] = first_s * 1e3
                if cfg.check and case.check is not None:
                    results[im.name] = _snapshot(bound.result(out) if bound.result else out)
                del out
                with (bound.context() if bound.context else _nullcontext()):
                    if im.once:
                        _, once_s = timer.wall(lambda: bound.run(0))
                        res = {"ms": once_s * 1e3, "ms_min": once_s * 1e3, "ms_max": once_s * 1e3, "samples": 1,
                               "inner": 1}
                        rec["note"] = (rec["note"] + "; " if rec["note"] else "") + "one call, wall clock"
                    else:
                        res = timer.time(bound.run, len(inputs), samples=im.samples)
                rec.update(ms=res["ms"], ms_min=res["ms_min"], ms_max=res["ms_max"],
                           samples=res["samples"], inner=res["inner"])
            except Exception as e:
                rec["error"] = _err_text(e)
                late = _sync_quietly(timer)
                if late and late != rec["error"]:
                    rec["error"] += f" | then: {late}"
                log(f"    {im.name}: {rec['error']}")
                bound = None
                if timer.kind == "cuda" and not cuda_alive():
                    cfg.context_lost = f"{case.op} / {case.name} / {im.name}: {rec['error']}"
                    log("    CUDA context lost: the remaining impls and cases are skipped")
                    break
                continue
            if im.capture_safe and cfg.graphs and timer.kind == "cuda":
                try:
                    with (bound.context() if bound.context else _nullcontext()):
                        g = timer.time_graph(bound.run, len(inputs), samples=im.samples)
                    rec["ms_graph"] = g["ms_graph"]
                except Exception as e:
                    rec["graph_error"] = _err_text(e)
                    _sync_quietly(timer)
            log(f"    {im.name}: {rec['ms']:.4f} ms" + (f" (graph {rec['ms_graph']:.4f} ms)" if rec["ms_graph"] else ""))
            del bound
        if cfg.context_lost:
            for r in recs.values():
                if r["ms"] is None and r["error"] is None:
                    r["error"] = f"skipped: CUDA context lost after {cfg.context_lost}"
            results = {}
        if cfg.check and case.check is not None and results:
            try:
                errs = case.check(results, inputs[0])
                for name, fields in errs.items():
                    if name in recs:
                        recs[name]["err"] = fields.get("err")
                        recs[name]["err_vs"] = fields.get("err_vs")
            except Exception as e:
                msg = "check failed: " + _err_text(e)
                for name in results:
                    recs[name]["note"] = (recs[name]["note"] + "; " if recs[name]["note"] else "") + msg
                log(f"    {msg}")
    del inputs, results
    if not cfg.context_lost:
        free_device_memory()
    records = list(recs.values())
    finalize_case(records, baseline=case.baseline, target=case.target, ceilings=cfg.ceilings, tol=case.tol)
    return records


def select_cases(cases: list, cfg: BenchConfig) -> list:
    if not cfg.case_filter:
        return cases
    import re

    pat = re.compile(cfg.case_filter)
    return [c for c in cases if pat.search(f"{c.op} {c.name}")]


def skipped_records(case: Case, cfg: BenchConfig, why: str) -> list[dict]:
    return [new_record(case.op, case.name, im.name, im.kind, metric=case.metric, params=dict(case.params),
                       error=why) for im in case.impls if cfg.wants(im.family)]


def run_cases(cases: list, cfg: BenchConfig, timer, log=print, progress=None) -> list[dict]:
    """Run each case in turn (a failure inside one never stops the others; after a
    lost CUDA context the rest are recorded as skipped). ``progress(records)`` is
    called after every case (partial results survive a crash)."""
    out = []
    for case in select_cases(cases, cfg):
        if cfg.context_lost:
            out += skipped_records(case, cfg, f"skipped: CUDA context lost after {cfg.context_lost}")
            continue
        try:
            out += run_case(case, cfg, timer, log=log)
        except Exception as e:  # defensive: run_case records its own errors
            log(f"[{case.op}] {case.name}: harness error {_err_text(e)}")
            out.append(new_record(case.op, case.name, "harness", "ours", error=_err_text(e)))
        if progress is not None:
            progress(out)
    return out


def sized(cfg: BenchConfig, full, quick, tiny):
    """Pick the shape for the run's size."""
    return {"full": full, "quick": quick, "tiny": tiny}[cfg.size]


__all__ = ["BenchConfig", "Bound", "Case", "Impl", "PEER_FAMILIES", "cuda_alive", "free_device_memory", "run_case",
           "run_cases", "select_cases", "skipped_records", "sized", "time_box"]
