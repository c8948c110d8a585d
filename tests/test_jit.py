"""Kernel loader: header pasting, cache keys, compile errors, every variant compiles."""
from __future__ import annotations

import os
import time

import pytest

from mate_cupy.jit import KernelCompileError, KernelSpec, compile_all, compile_variant, registered
from mate_cupy.jit import sources


@pytest.fixture
def src_dir(tmp_path, monkeypatch):
    (tmp_path / "common").mkdir()
    monkeypatch.setattr(sources, "SRC_DIR", tmp_path)
    return tmp_path


def _write(path, text):
    path.write_text(text)
    # make sure the mtime moves even on coarse-grained filesystems
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_headers_are_pasted_once_with_line_markers(src_dir):
    _write(src_dir / "common" / "a.cuh", "#pragma once\n#define A_VALUE 3\n")
    _write(src_dir / "common" / "b.cuh", '#pragma once\n#include "a.cuh"\n#define B_VALUE (A_VALUE + 1)\n')
    _write(src_dir / "fam.cu", '#include "common/a.cuh"\n#include "common/b.cuh"\n__global__ void k() {}\n')
    text = sources.expand_source("fam.cu")
    assert text.count("#define A_VALUE 3") == 1
    assert '#line 1 "common/a.cuh"' in text and '#line 1 "common/b.cuh"' in text
    assert '#line 2 "fam.cu"' in text and '#line 3 "fam.cu"' in text
    assert "#include \"" not in text


def test_header_edit_changes_source_text(src_dir):
    _write(src_dir / "common" / "h.cuh", "#define H 1\n")
    _write(src_dir / "fam.cu", '#include "common/h.cuh"\n')
    first = sources.source_text("fam.cu")
    assert sources.source_text("fam.cu") is first  # cached while nothing changed
    time.sleep(0.01)
    _write(src_dir / "common" / "h.cuh", "#define H 2\n")
    second = sources.source_text("fam.cu")
    assert "#define H 2" in second and second != first


def test_missing_header_is_reported(src_dir):
    _write(src_dir / "fam.cu", '#include "common/nope.cuh"\n')
    with pytest.raises(FileNotFoundError, match="nope.cuh"):
        sources.expand_source("fam.cu")


def test_compile_error_names_kernel_options_and_file(src_dir):
    _write(src_dir / "common" / "bad.cuh", "#pragma once\n__device__ int f() { return undefined_symbol; }\n")
    _write(src_dir / "fam.cu", '#include "common/bad.cuh"\n__global__ void broken_kernel() { f(); }\n')
    spec = KernelSpec("fam.cu", ("broken_kernel",), (("TILE", "64"),))
    with pytest.raises(KernelCompileError) as e:
        compile_variant(spec, "sm_90a")
    msg = str(e.value)
    assert "fam[TILE=64]" in msg and "broken_kernel" in msg and "-arch=sm_90a" in msg
    assert "common/bad.cuh(2)" in msg and "undefined_symbol" in msg


def test_defines_specialise_the_source(src_dir):
    _write(src_dir / "fam.cu", "template <int N> __global__ void k(int* x) { x[0] = N * WIDTH; }\n")
    spec = KernelSpec("fam.cu", ("k<2>",), (("WIDTH", "8"),))
    r = compile_variant(spec, "sm_90a")
    assert r["cubin_bytes"] > 0 and r["name"] == "fam[WIDTH=8]"


def test_spec_names_spell_choices():
    spec = KernelSpec("attention_fwd.cu", ("k",), (("CAUSAL", "1"), ("HEAD_DIM", "128")))
    assert spec.name == "attention_fwd[CAUSAL=1,HEAD_DIM=128]"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_every_registered_variant_compiles(arch):
    specs = registered()
    assert any(s.source == "util.cu" for s in specs)
    results = compile_all(arch, jobs=2)
    failed = [r for r in results if "error" in r]
    assert not failed, "\n\n".join(r["error"] for r in failed[:3])
    compiled = [r for r in results if "skipped" not in r]
    assert len(compiled) >= 1
    for r in results:
        if "skipped" in r:
            spec = next(s for s in specs if s.name == r["name"] and s.kernels == r["kernels"])
            assert spec.min_sm > 80 and arch == "sm_80"


def test_cubin_dir_saves_cubin_and_lowered_names(src_dir, tmp_path_factory):
    import json

    from mate_cupy.jit.compiler import cubin_key

    _write(src_dir / "fam.cu", "template <int N> __global__ void k(int* x) { x[0] = N; }\n")
    spec = KernelSpec("fam.cu", ("k<3>",))
    out = tmp_path_factory.mktemp("cubins")
    compile_variant(spec, "sm_90a", cubin_dir=out)
    key = cubin_key(spec, "sm_90a")
    assert (out / f"{key}.cubin").stat().st_size > 0
    assert json.loads((out / f"{key}.json").read_text()) == {"k<3>": "_Z1kILi3EEvPi"}
    _write(src_dir / "fam.cu", "template <int N> __global__ void k(int* x) { x[0] = N + 1; }\n")
    assert cubin_key(spec, "sm_90a") != key  # a source edit never reuses a stale cubin
