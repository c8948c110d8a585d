"""The CUDA kernels of the bench sweeps compile for sm_90a with NVRTC (no GPU): a sweep that
includes the project's headers keeps building as they change. The decode grid sweep's launch
configurations."""
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


@pytest.mark.torch
def test_kda_decode_grid_variants_configure_the_launch():
    """The decode grid sweep's select_config replacements: one CTA per work item (w2, w4) or
    one and two resident waves of CTAs (w2p, w2p2), otherwise the same launch."""
    pytest.importorskip("cupy")
    import dataclasses

    import numpy as np
    from test_kda_decode import _problem

    from mate_cupy.kda import decode_launch as dl

    sweep = _sweep("kda_decode_grid")
    p = _problem(np.random.default_rng(0), B=32)
    w2 = sweep.VARIANTS["w2"](p, 132, 90)
    assert (w2.warps, w2.grid) == (2, 32 * 32 * 4)
    per_sm = dl.resident_vfirst_ctas(w2.threads, w2.smem)
    for name, waves in (("w2p", 1), ("w2p2", 2)):
        cfg = sweep.VARIANTS[name](p, 132, 90)
        assert cfg.grid == waves * 132 * per_sm
        assert dataclasses.replace(cfg, grid=w2.grid) == w2
    w4 = sweep.VARIANTS["w4"](p, 132, 90)
    assert sweep.VARIANTS["w4p"](p, 132, 90).grid == 132 * dl.resident_vfirst_ctas(w4.threads, w4.smem)
