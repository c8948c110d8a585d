"""The CUDA kernels of the bench sweeps compile for sm_90a with NVRTC (no GPU): a sweep that
includes the project's headers keeps building as they change."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# sweep module -> the name expressions of its templated kernels (the others are extern "C")
SWEEPS = {
    "l2_read": (),
    "l2_round_trip": (),
    "state_copy_paths": tuple(f"state_rw<{m}>" for m in range(6)),
    "state_fanout": tuple(f"state_fanout<{m}>" for m in range(4)),
}


def _sweep(name):
    sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module(f"bench.sweeps.{name}")
    finally:
        sys.path.remove(str(ROOT))


@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_sweep_kernels_compile(name):
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc

    mod = _sweep(name)
    opts = mod.module_options() if hasattr(mod, "module_options") else ("-std=c++17",)
    prog = nvrtc.createProgram(mod.SRC, f"{name}.cu", [], [])
    try:
        for expr in SWEEPS[name]:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, [*opts, "-arch=sm_90a"])
        except nvrtc.NVRTCError:
            pytest.fail(f"{name}: {nvrtc.getProgramLog(prog)}")
        assert len(nvrtc.getCUBIN(prog)) > 0
        for expr in SWEEPS[name]:
            assert nvrtc.getLoweredName(prog, expr)
    finally:
        nvrtc.destroyProgram(prog)
