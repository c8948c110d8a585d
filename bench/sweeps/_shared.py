"""Pieces shared by the tuning sweeps (perf_attn, perf_index, perf_kda): cubin prebuild,
the time-boxed smoke child, CUDA-event timing on torch's current stream."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build_cubins(specs, cubin_dir: str) -> dict:
    """Compile ``specs`` for sm_90a into ``cubin_dir`` (NVRTC, in parallel), so no compile
    lands in a timed region: {"seconds", "modules", "errors"}."""
    from mate_cupy.jit import compile_all

    t0 = time.perf_counter()
    res = compile_all("sm_90a", specs=specs, cubin_dir=cubin_dir, jobs=min(16, os.cpu_count() or 1))
    errors = [r["name"] + ": " + r["error"][-400:] for r in res if "error" in r]
    return {"seconds": round(time.perf_counter() - t0, 2), "modules": len(res), "errors": errors}


def run_smoke_child(script: str, env, timeout_s: float, names) -> dict:
    """Run ``script --smoke STATUS.json`` in a time-boxed child (a hang or a CUDA fault cannot
    take the sweep with it). Candidates in ``names`` the child never finished are marked
    "untested/hung" (it was running one) or "untested"."""
    with tempfile.TemporaryDirectory() as td:
        path = os.path.join(td, "smoke.json")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, script, "--smoke", path], env=env, cwd=str(ROOT),
                                  timeout=timeout_s, capture_output=True, text=True)
            tail = (proc.stdout + proc.stderr)[-1500:]
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            tail, rc = "timed out", "timeout"
        status = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
        for n in names:
            if status.get(n) in (None, "running"):
                status[n] = f"untested/hung (child rc={rc})" if status.get(n) == "running" else "untested"
        return {"status": status, "rc": rc, "seconds": round(time.perf_counter() - t0, 1),
                "tail": tail if rc != 0 else ""}


class TorchCtx:
    """torch CUDA device + the CuPy view of torch's current stream, and event timing."""

    def __init__(self):
        import cupy
        import torch

        self.torch, self.cupy = torch, cupy
        self.dev = torch.device("cuda")
        ptr = torch.cuda.current_stream().cuda_stream
        self.stream = cupy.cuda.Stream.null if ptr == 0 else cupy.cuda.ExternalStream(ptr)

    def cp(self, t):
        return self.cupy.from_dlpack(t) if t is not None else None

    def time(self, fn, n_sets: int, warmup: int = 3, iters: int = 15) -> float:
        """Median ms of ``fn(i % n_sets)`` over ``iters`` back-to-back calls after ``warmup``."""
        torch = self.torch
        for i in range(warmup):
            fn(i % n_sets)
        torch.cuda.synchronize()
        ev = []
        for i in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(i % n_sets)
            b.record()
            ev.append((a, b))
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in ev)
