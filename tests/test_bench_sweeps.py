"""The CUDA kernels of the bench sweeps compile for sm_90a with NVRTC (no GPU): a sweep that
includes the project's headers keeps building as they change."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SWEEPS = ("l2_read", "l2_round_trip", "state_copy_paths", "state_fanout")


def _sweep(name):
    sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module(f"bench.sweeps.{name}")
    finally:
        sys.path.remove(str(ROOT))


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_kernels_compile(name):
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc

    mod = _sweep(name)
    opts = _sweep("state_copy_paths").module_options()  # the project's headers on the include path
    # a templated kernel (KERNEL) is instantiated once per mode; the others are extern "C"
    exprs = [f"{mod.KERNEL}<{m}>" for m in mod.MODES.values()] if hasattr(mod, "KERNEL") else []
    prog = nvrtc.createProgram(mod.SRC, f"{name}.cu", [], [])
    try:
        for expr in exprs:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, [*opts, "-arch=sm_90a"])
        except nvrtc.NVRTCError:
            pytest.fail(f"{name}: {nvrtc.getProgramLog(prog)}")
        assert len(nvrtc.getCUBIN(prog)) > 0
        for expr in exprs:
            assert nvrtc.getLoweredName(prog, expr)
    finally:
        nvrtc.destroyProgram(prog)
