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


def test_cli_alone_prints_help():
    r = _run(["-m", "mate_cupy"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: python -m mate_cupy") and r.stderr == ""
    for word in ("check", "demo", "--version", "sm_100"):
        assert word in r.stdout


def test_cli_version():
    from mate_cupy import __version__

    r = _run(["-m", "mate_cupy", "--version"], timeout=120)
    assert r.returncode == 0 and r.stdout == f"mate_cupy {__version__}\n"


@pytest.mark.parametrize("arch", ["sm_75", "sm_70"])
def test_cli_refuses_targets_below_sm80(arch):
    r = _run(["-m", "mate_cupy", "check", "--arch", arch, "--compile-only"], timeout=120)
    assert r.returncode == 2
    assert f"{arch} is not supported" in r.stderr and "sm_80 or newer" in r.stderr
    assert "compiled" not in r.stdout


def test_cli_check_sm100_builds_what_it_runs():
    # max score, half, D 64: the two mma.sync variants build for sm_100, the warp-specialised one is sm_90a only
    r = _run(["-m", "mate_cupy", "check", "--arch", "sm_100", "--compile-only", "--jobs", "2",
              "--only", r"msa_(block_max_score|max_score_ws)_kernel<half_t, 64[,>]"], {"COLUMNS": "60"}, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "target       sm_100 (from --arch)" in r.stdout
    assert "the 2 of 3 kernel variants that sm_100 runs" in r.stdout
    assert "skipping 1 that need sm_90a only" in r.stdout
    assert "2 compiled, 1 skipped, 0 failed" in r.stdout
    progress = [ln for ln in r.stdout.splitlines() if "/3 " in ln]
    assert progress and all(len(ln) <= 59 for ln in progress), progress


def test_cli_check_default_target_says_why():
    from mate_cupy.cli import _target, gpu_info

    class Args:
        arch, compile_only = None, False

    gpu = gpu_info()
    arch, compile_only, why = _target(Args, gpu)
    if gpu is None:
        assert (arch, compile_only) == ("sm_90a", True) and why.startswith("no GPU visible and no --arch")
    else:
        assert arch == gpu[1] and why.startswith("the GPU's: ")
    Args.arch = "sm_120"
    assert _target(Args, gpu)[0] == "sm_120" and _target(Args, gpu)[2].startswith("from --arch")


def test_progress_lines_fit_and_cut_between_tokens():
    from mate_cupy.cli import fit, progress_line, short_name

    name = ("attention_fwd[ATT_BLOCK_N=128,ATT_DTYPE=1,ATT_HEAD_DIM=64,ATT_KV=0,ATT_MIN_BLOCKS=2,ATT_MTILES=2,"
            "ATT_SMEM_FIXED=49152,ATT_STAGES=3,ATT_WARPS_M=4,ATT_WARPS_N=1,ATT_WS=0]")
    assert short_name(name).startswith("attention_fwd[BLOCK_N=128,DTYPE=1,HEAD_DIM=64,")
    for columns in (30, 60, 80, 120, 300):
        line = progress_line(7, 127, {"name": name, "kernels": ("msa_attention_fwd_kernel",)}, 12.5, columns)
        assert len(line) <= max(columns - 1, 20)
        assert " 7/127" in line and "ok" in line
        if columns >= 200:
            assert line.endswith(",WS=0]")
        else:
            assert line.endswith("\u2026")
            if columns >= 60:
                assert line[-2] in ",[", line  # cut after a separator, not inside a macro
    assert fit("cast_kernel<float, bf16_t>", 22, "...") == "cast_kernel<float,..."
    assert fit("short", 10) == "short"


def test_demo_says_where_it_runs():
    from mate_cupy.cli import gpu_info
    from mate_cupy.demo import backend

    xp, where, why = backend()
    if gpu_info() is None:
        assert xp is None and where == "NumPy"
        assert why.startswith(("no CUDA GPU visible", "CuPy is not installed")), why
        assert why.endswith("running the float64 NumPy references")
    else:
        assert why.startswith("CUDA GPU: ") and "running the kernels" in why
    assert backend(force_cpu=True)[2] == "--cpu: running the float64 NumPy references"


def test_cli_demo_runs():
    r = _run(["-m", "mate_cupy", "demo", "--cpu"], timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert out.startswith("mate_cupy demo: --cpu: running the float64 NumPy references")
    assert "FAILED" not in out and "demo done in" in out
    # the whole MSA pipeline, then KDA prefill -> decode, each compared with a reference
    steps = ["1. msa (dense, output_maxscore)", "2. sparse_topk_select", "3. sparse_msa", "1. chunk_kda prefill",
             "2. gated_delta_rule_decode"]
    pos = [out.index(s) for s in steps]
    assert pos == sorted(pos)
    assert out.count("rel err") >= 6 and "0 selected blocks past a query's position" in out
    assert "RuntimeWarning" not in r.stderr


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
