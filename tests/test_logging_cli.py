"""API logging levels and the command line."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mate_cupy import _logging

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, env_extra=None, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, **kw)


def test_level_zero_returns_function_unchanged(monkeypatch):
    monkeypatch.setattr(_logging, "_level", 0)

    def f(x):
        return x + 1

    assert _logging.mate_api(f) is f


def test_level_one_logs_names_level_three_logs_shapes(monkeypatch, caplog):
    import numpy as np

    monkeypatch.setattr(_logging, "_level", 1)

    @_logging.mate_api
    def op(x, flag=True):
        return x

    with caplog.at_level("INFO", logger="mate_cupy"):
        op(np.zeros((2, 3), np.float32))
    assert "op" in caplog.text and "(2, 3)" not in caplog.text
    caplog.clear()
    monkeypatch.setattr(_logging, "_level", 3)
    with caplog.at_level("INFO", logger="mate_cupy"):
        op(np.zeros((2, 3), np.float32), flag=False)
    assert "(2, 3)" in caplog.text and "float32" in caplog.text and "flag=False" in caplog.text


def test_env_variable_controls_public_functions():
    code = "import numpy as np, mate_cupy as m; m.cast(np.ones(4, np.float32), 'bfloat16')"
    quiet = _run(["-c", code], {"MATE_CUPY_LOGLEVEL": "0"})
    assert quiet.returncode == 0 and "cast" not in quiet.stderr
    loud = _run(["-c", code], {"MATE_CUPY_LOGLEVEL": "3"})
    assert loud.returncode == 0, loud.stderr
    assert "cast(" in loud.stderr and "(4,)" in loud.stderr


def test_cli_check_compile_only():
    # Every variant is compiled by tests/test_jit.py; here the command itself, on one family.
    r = _run(["-m", "mate_cupy", "check", "--arch", "sm_90a", "--compile-only", "--jobs", "2", "--only", "^util"],
             timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Python" in r.stdout and "NVRTC" in r.stdout and "no GPU" in r.stdout
    import re

    from mate_cupy.jit import registered

    n = sum(1 for spec in registered() if spec.source == "util.cu")
    assert re.search(rf"\b{n} compiled, 0 skipped, 0 failed", r.stdout), r.stdout[-2000:]


def test_cli_demo_runs():
    r = _run(["-m", "mate_cupy", "demo", "--cpu"], timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "NumPy float64 reference path" in r.stdout
    assert "FAILED" not in r.stdout


def test_cast_reference_path(rng):
    import ml_dtypes
    import numpy as np

    import mate_cupy as m

    x = (rng.standard_normal(100) * 300).astype(np.float32)
    y = m.cast(x, "float8_e4m3fn")
    assert y.dtype == ml_dtypes.float8_e4m3fn
    expect = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(y.view(np.uint8), expect.view(np.uint8))
    out = np.empty(100, ml_dtypes.bfloat16)
    assert m.cast(x, "bfloat16", out=out) is out
    with pytest.raises(TypeError, match="x must be float32/float16/bfloat16/float8_e4m3fn, got int32"):
        m.cast(np.zeros(3, np.int32), "float32")
