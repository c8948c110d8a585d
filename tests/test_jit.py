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
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80", "sm_100", "sm_120"])
def test_every_registered_variant_compiles(arch):
    specs = registered()
    assert any(s.source == "util.cu" for s in specs)
    results = compile_all(arch, jobs=2)
    failed = [r for r in results if "error" in r]
    assert not failed, "\n\n".join(r["error"] for r in failed[:3])
    compiled = [r for r in results if "skipped" not in r]
    assert len(compiled) >= 1
    for r in results:
        spec = next(s for s in specs if s.name == r["name"] and s.kernels == r["kernels"])
        assert ("skipped" in r) == (not spec.builds_for(arch))
        if "skipped" in r:
            assert arch != "sm_90a" and (spec.min_sm > 80 or spec.only_arch == "sm_90a")


# ----------------------------------------------------------------------------- targets and dispatch


def _is_wgmma(spec) -> bool:
    d = dict(spec.defines)
    return (d.get("ATT_WS") == "1" or spec.source == "attention_gather.cu"
            or any(k.startswith(("msa_max_score_ws_kernel", "kda_chunk_recurrence_wgmma_kernel"))
                   for k in spec.kernels))


def test_hopper_only_variants_build_for_sm90a_alone():
    specs = registered()
    hopper = [s for s in specs if _is_wgmma(s)]
    assert len(hopper) == 27 and len(specs) == 159  # 4 of them the wgmma chunk_kda recurrence (2 dtypes x 2 widths)
    for s in specs:
        if _is_wgmma(s):
            assert s.only_arch == "sm_90a" and s.requirement == "sm_90a only" and s.min_sm == 90
            assert s.builds_for("sm_90a")
            assert not any(s.builds_for(a) for a in ("sm_80", "sm_89", "sm_90", "sm_100", "sm_100a", "sm_120"))
        else:
            assert s.only_arch == "" and s.requirement == f"sm_{s.min_sm} or newer"
            assert all(s.builds_for(a) for a in ("sm_89", "sm_90a", "sm_100", "sm_103", "sm_120", "sm_121"))
            assert s.builds_for("sm_80") == (s.min_sm <= 80)


@pytest.mark.slow
def test_wgmma_variants_are_not_serialized():
    """ptxas serializes a kernel's wgmma (C7515, C7518) when an MMA stage stays open across
    a branch it cannot prove warp-uniform, or when other instructions write its accumulators:
    the kernel still computes the same, slower, with no error."""
    specs = [s for s in registered() if _is_wgmma(s)]
    assert len(specs) == 27
    for spec in specs:
        log = compile_variant(spec, "sm_90a", ptxas_verbose=True)["log"]
        assert log.count("Compiling entry function") >= len(spec.kernels), spec.name
        assert "wgmma.mma_async instructions are serialized" not in log, f"{spec.name}\n{log}"


def test_kernels_use_only_counted_cp_async_arrivals():
    """Every mbarrier expects exactly the arrivals it gets: the incrementing
    ``cp.async.mbarrier.arrive`` (legal PTX: it raises the pending count, then arrives) is
    reported by compute-sanitizer synccheck as a barrier overflow and aborts the kernel, so the
    kernels' inline PTX uses the ``.noinc`` form (tests/sanitizer_probes.py shows both)."""
    import re
    from pathlib import Path

    asm = re.compile(r"cp\.async\.mbarrier\.arrive(\.shared|\.b64|\s*\[)")  # the instruction, not .noinc
    root = Path(sources.SRC_DIR)
    files = sorted(p for p in root.rglob("*") if p.suffix in (".cu", ".cuh"))
    assert len(files) > 10
    hits = [f"{p.relative_to(root)}:{i}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if asm.search(line)]
    assert hits == []


@pytest.mark.parametrize("text,arch", [("sm_100", "sm_100"), ("sm_90a", "sm_90a"), ("90", "sm_90a"),
                                       ("9.0", "sm_90a"), ("10.0", "sm_100"), ("sm_120", "sm_120"),
                                       ("12.0", "sm_120"), ("sm_80", "sm_80"), ("SM_86", "sm_86")])
def test_normalize_arch(text, arch):
    from mate_cupy.jit import normalize_arch

    assert normalize_arch(text) == arch


@pytest.mark.parametrize("text,match", [("sm_75", "sm_75 is not supported.*sm_80 or newer"),
                                        ("7.0", "sm_70 is not supported"), ("sm_86a", "start at sm_90"),
                                        ("hopper", "unknown target"), ("sm_999", "unknown to this NVRTC")])
def test_normalize_arch_refuses(text, match):
    from mate_cupy.jit import UnsupportedArchError, normalize_arch

    with pytest.raises(UnsupportedArchError, match=match):
        normalize_arch(text)


CCS = (80, 86, 89, 90, 100, 103, 120, 121)


def _attention_configs(cc):
    """(config, dtype_code) over the attention configuration space on compute capability ``cc``."""
    from mate_cupy.msa import attention_launch as al
    from mate_cupy.msa import execute

    for kv in (al.KV_DENSE, al.KV_PAGED, al.KV_SPARSE):
        sparse = kv == al.KV_SPARSE
        for d in ((execute.SPARSE_HEAD_DIM,) if sparse else execute.HEAD_DIMS):
            for code in execute.DTYPE_CODES.values():
                if code == al.DTYPE_E4M3 and cc < 89:
                    continue  # fp8 needs sm_89 (refused by the validation)
                for group in (execute.SPARSE_GQA_RATIOS if sparse else (1, 8, 16)):
                    for max_q in (1, 64, 8192):
                        for causal in (True, False):
                            for sparse_decode in ((False, True) if sparse else (False,)):
                                for gather in ((False, True) if sparse else (False,)):
                                    p = al.AttentionProblem(
                                        kv_mode=kv, batch=1, total_q=max_q, num_heads_q=8 * group, num_heads_kv=8,
                                        head_dim=d, dtype_code=code, max_seqlen_q=max_q, max_seqlen_k=8192,
                                        page_size=128 if kv != al.KV_DENSE else 0, list_width=16 if sparse else 0,
                                        causal=causal, sparse_decode=sparse_decode, num_kv_splits=-1, gather=gather)
                                    yield al.select_config(p, 132, cc), code


@pytest.mark.parametrize("cc", CCS)
def test_dispatch_picks_only_variants_the_gpu_builds(cc):
    """Each GPU's configuration picks only variants its arch builds: no wgmma/TMA tile, gather
    kernel or wgmma max score anywhere but compute capability 9.0 (sm_90a)."""
    from mate_cupy.jit import arch_for_capability
    from mate_cupy.msa import attention_launch as al
    from mate_cupy.msa import index_launch as il
    from mate_cupy.runtime.interop import BFLOAT16, FLOAT16, FP8_E4M3

    arch = arch_for_capability(cc)
    tiles = set()
    for cfg, code in _attention_configs(cc):
        tiles.add(cfg.tile)
        for spec in al.config_specs(cfg, code):
            assert spec.builds_for(arch), (cc, cfg.tile, spec.name)
    assert ({"ws2n128s3", "ws2n128s2", "gather"} <= tiles) == (cc == 90)
    if cc != 90:
        assert tiles <= {"decode", "prefill"}
    for rows in (1, 64, 65, 8192, 1 << 20):
        cfg = il.select_max_score_config(rows, cc)
        assert (cfg.mma == "wgmma") == (cc == 90 and rows > 64)
        for dt in (FLOAT16, BFLOAT16):
            for d in il.MAX_SCORE_HEAD_DIMS:
                assert il.MAX_SCORE_SPECS[(dt, d, cfg)].builds_for(arch)
    # float8 (sm_89+): the decode kernel up to FP8_DECODE_MAX_ROWS[D] rows, wgmma above, which the
    # validation admits on compute capability 9.0 only (execute.check_fp8_max_score)
    for d in il.MAX_SCORE_HEAD_DIMS:
        for rows in (1, 16, 17, 32, 33, 8192):
            cfg = il.select_max_score_config(rows, cc, fp8=True, head_dim=d)
            decode = rows <= il.FP8_DECODE_MAX_ROWS[d]
            assert cfg.decode == decode and (decode or cfg.mma == "wgmma")
            if cc >= 89 and (decode or cc == 90):
                assert il.MAX_SCORE_SPECS[(FP8_E4M3, d, cfg)].builds_for(arch), (cc, d, rows)


@pytest.mark.parametrize("cc,arch", [(100, "sm_100"), (120, "sm_120")])
def test_blackwell_dispatch_compiles(cc, arch):
    """The variants a Blackwell GPU picks for a long causal prefill (attention and max score)
    build with NVRTC for its arch."""
    from mate_cupy.jit import arch_for_capability
    from mate_cupy.msa import attention_launch as al
    from mate_cupy.msa import index_launch as il
    from mate_cupy.runtime.interop import BFLOAT16

    assert arch_for_capability(cc) == arch
    p = al.AttentionProblem(kv_mode=al.KV_DENSE, batch=1, total_q=8192, num_heads_q=64, num_heads_kv=8,
                            head_dim=128, dtype_code=al.DTYPE_BF16, max_seqlen_q=8192, max_seqlen_k=8192,
                            page_size=0, list_width=0, causal=True, sparse_decode=False, num_kv_splits=-1,
                            gather=False)
    cfg = al.select_config(p, 148, cc)
    assert cfg.tile == "prefill"
    ms = il.MAX_SCORE_SPECS[(BFLOAT16, 128, il.select_max_score_config(8192 * 8, cc))]
    for spec in (cfg.spec, ms):
        assert compile_variant(spec, arch)["cubin_bytes"] > 0


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
