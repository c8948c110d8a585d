"""Run the MSA index launchers against the CPU emulator (tests/index_emu).

``build(tmp_dir)`` compiles ``driver.cpp`` around ``cuda_src/msa_index.cu`` (every
registered variant). ``Emulated(exe, tmp_dir)`` then runs a launcher of
``mate_cupy.msa.index_launch`` on host arrays wrapped by :func:`wrap`: the launcher
sizes and packs the launch as on a GPU (``launch``, ``get_kernel`` and ``device_info``
of the module are swapped for recording stand-ins while it runs), each recorded launch
runs in the emulator, and the arrays come back with what the kernel wrote.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from mate_cupy.msa import index_launch as il
from mate_cupy.runtime.interop import Arg

HERE = Path(__file__).resolve().parent
CUDA_SRC = Path(il.__file__).resolve().parent.parent / "cuda_src"
# Inline-PTX helpers of msa_index.cu that the emulator (tests/cuda_emu/emu_cuda.h) supplies.
EMULATED_FUNCTIONS = ("cp_async_16_at", "cp_async_16_l2_at", "ldmatrix_x4_at", "e4m3x4_to_f16x2")


def drop_function(src: str, name: str) -> str:
    """``src`` without the definition of the device function ``name`` (signature to matching brace)."""
    m = re.search(r"__device__ __forceinline__ \w+ " + name + r"\(", src)
    assert m, name
    i = src.index("{", m.end())
    depth = 0
    for j in range(i, len(src)):
        depth += {"{": 1, "}": -1}.get(src[j], 0)
        if depth == 0:
            return src[: m.start()] + src[j + 1:]
    raise AssertionError(f"unbalanced braces in {name}")


def emulator_source() -> str:
    """msa_index.cu with topk.cuh, float_max.cuh and warp_specialized.cuh (its host part: the
    compile-time checks) pasted in, the other GPU headers and inline PTX left out."""
    src = (CUDA_SRC / "msa_index.cu").read_text()
    topk = (CUDA_SRC / "common" / "topk.cuh").read_text()
    topk = topk.replace("#pragma once", "").replace('#include "dtype.cuh"', "")
    for inc in ('#include "common/dtype.cuh"', '#include "common/mma.cuh"', '#include "common/attention_wgmma.cuh"'):
        assert inc in src, inc
        src = src.replace(inc, "")
    ws = (CUDA_SRC / "common" / "warp_specialized.cuh").read_text()
    ws = ws.replace("#pragma once", "").replace('#include "dtype.cuh"', "")
    assert '#include "common/warp_specialized.cuh"' in src
    src = src.replace('#include "common/warp_specialized.cuh"', ws)
    assert '#include "common/topk.cuh"' in src
    src = src.replace('#include "common/topk.cuh"', topk)
    float_max = (CUDA_SRC / "common" / "float_max.cuh").read_text().replace("#pragma once", "")
    assert '#include "common/float_max.cuh"' in src
    src = src.replace('#include "common/float_max.cuh"', float_max)
    for name in EMULATED_FUNCTIONS:
        src = drop_function(src, name)
    decl = "extern __shared__ __align__(128) unsigned char smem_raw[];"
    assert src.count(decl) >= 1
    return src.replace(decl, "unsigned char* smem_raw = emu::dyn_smem();")


def kernel_names() -> list:
    specs = list(il.TOPK_SPECS.values()) + list(il.STREAM_SPECS.values()) + list(il.MAX_SCORE_SPECS.values())
    return [k for s in specs for k in s.kernels]


def block_statics(src: str) -> str:
    """Each static ``__shared__ [__align__(n)] T a[n], b;`` declaration of ``src`` as references
    to one object per block (``emu::block_shared``), so that blocks the driver runs at once
    (``EMU_CONCURRENT_BLOCKS``) do not share it."""
    ids = itertools.count()

    def one(m):
        decls = [d.strip() for d in m.group(1).split(",")]
        ty, name, dims = re.fullmatch(r"(.*\S)\s+([A-Za-z_]\w*)\s*((?:\[[^\]]*\])*)", decls[0]).groups()
        refs = [(name, dims)] + [re.fullmatch(r"([A-Za-z_]\w*)\s*((?:\[[^\]]*\])*)", d).groups() for d in decls[1:]]
        return " ".join(f"auto& {n} = emu::block_shared<{ty}{d}, {next(ids)}>();" for n, d in refs)

    # block_shared storage is 128-byte aligned: an alignment up to that needs no attribute
    src = re.sub(r"(?<!extern )__shared__ __align__\((\d+)\)",
                 lambda m: "__shared__" if int(m.group(1)) <= 128 else m.group(0), src)
    out = re.sub(r"(?<!extern )__shared__ ([^;]*);", one, src)
    assert "__shared__" not in out.replace("extern __shared__", ""), "a shared declaration the rewrite does not handle"
    return out


def build_driver(tmp_dir: Path, exe_name: str, source: str, kernels, *, header: str | None = None,
                 include_dirs=(), defines=(), strict_aliasing: bool = True, sanitize: bool | None = None) -> Path:
    """Compile ``driver.cpp`` around ``source`` (a kernel file prepared for the emulator, its
    static shared variables made per block: :func:`block_statics`) with ``kernels`` registered; ``header``: the family's emulator extras (``EMU_HEADER``, default
    emu_index.h), found in ``include_dirs``. Returns the executable ``tmp_dir/exe_name``."""
    from mate_cupy.jit.compiler import cuda_include_dirs

    if shutil.which("g++") is None or not cuda_include_dirs():
        raise RuntimeError("needs g++ and the CUDA fp16/bf16 headers")
    if sanitize is None:
        sanitize = bool(os.environ.get("MATE_CUPY_EMU_SANITIZE"))
    tmp_dir = Path(tmp_dir)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    (tmp_dir / f"{exe_name}.inc").write_text(block_statics(source))
    (tmp_dir / "emu_kernels.inc").write_text("".join(f'REG("{n}", {n});\n' for n in kernels))
    flags = ["-O1", "-g", "-fsanitize=address,undefined"] if sanitize else ["-O2"]
    if not strict_aliasing:  # kernels that reinterpret registers through pointer casts, as CUDA C++ allows
        flags.append("-fno-strict-aliasing")
    exe = tmp_dir / exe_name
    cmd = ["g++", "-std=c++20", *flags, "-w", *(f"-D{d}" for d in defines), f'-DEMU_SOURCE="{exe_name}.inc"',
           *([f'-DEMU_HEADER="{header}"'] if header else []), *(f"-I{i}" for i in include_dirs), f"-I{HERE}",
           f"-I{HERE.parent / 'cuda_emu'}", f"-I{tmp_dir}", *(f"-I{i}" for i in cuda_include_dirs()),
           str(HERE / "driver.cpp"), "-o", str(exe), "-lpthread"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-6000:])
    return exe


def build(tmp_dir: Path, sanitize: bool | None = None) -> Path:
    """Compile the emulator; returns the executable."""
    return build_driver(tmp_dir, "msa_index_emu", emulator_source(), kernel_names(), sanitize=sanitize)


def locate(buffers: list, ptr: int) -> tuple:
    """``(index, byte offset)`` of the array of ``buffers`` that holds address ``ptr``."""
    for i, a in enumerate(buffers):
        base = a.__array_interface__["data"][0]
        if base <= ptr < base + max(a.nbytes, 1):
            return i, ptr - base
    raise ValueError(f"pointer {ptr:#x} outside every host array")


def run_launch(exe: Path, d: Path, name: str, grid, threads: int, smem: int, params, values, buffers: list, *,
               lazy: bool = False, timeout: float = 3600) -> None:
    """Run one launch in the emulator through the folder ``d`` (driver.cpp's launch.txt): every
    nonzero pointer value is resolved to the array of ``buffers`` that holds it (:func:`locate`);
    those arrays come back with what the kernel wrote. ``lazy``: copies land and wgmma computes
    at the wait that retires them instead of at issue."""
    d = Path(d)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    lines = [name, f"{grid[0]} {grid[1]} {grid[2]} {threads} {smem} {int(lazy)}"]
    used = {}
    for kind, v in zip(params.kinds, values):
        if kind == "ptr":
            if not v:
                lines.append("P0")
                continue
            i, off = locate(buffers, int(v))
            used[i] = buffers[i]
            lines.append(f"A {i} {off}")
        elif kind == "f32":
            lines.append(f"F {float(v)!r}")
        else:
            lines.append(f"I {int(v)}")
    for i, a in used.items():
        a.tofile(d / f"a{i}.bin")
    (d / "launch.txt").write_text("\n".join(lines) + "\n")
    r = subprocess.run([str(exe), str(d)], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, ASAN_OPTIONS="detect_leaks=0"))
    if r.returncode != 0:
        raise RuntimeError(f"emulated {name} failed ({r.returncode}): {r.stderr[-4000:]}")
    for i, a in used.items():
        a[...] = np.fromfile(d / f"a{i}.out", dtype=a.dtype).reshape(a.shape)
    shutil.rmtree(d, ignore_errors=True)


class EmuArg(Arg):
    """A host array described as a device array of cuda:0 (what the launchers read:
    ``ptr``, ``shape``, element ``strides``, ``dtype``), keeping its base buffer and byte
    offset for the emulator."""

    def __init__(self, name: str, a: np.ndarray):
        base = a
        while isinstance(base.base, np.ndarray):
            base = base.base
        if not base.flags.c_contiguous:
            raise ValueError("the base buffer must be contiguous")
        ptr = a.__array_interface__["data"][0]
        super().__init__(name, a, a.dtype, "numpy", 0, a.shape, tuple(s // a.itemsize for s in a.strides), ptr,
                         data=a)
        self.base = base
        self.offset = ptr - base.__array_interface__["data"][0]


def wrap(a, name: str = "array"):
    return None if a is None else EmuArg(name, np.asarray(a))


class Emulated:
    """Context for running launchers in the emulator as on a device of ``sm_count`` SMs
    and compute capability ``cc`` (the emulator runs wgmma, so 90 by default)."""

    def __init__(self, exe: Path, work: Path, sm_count: int = 132, cc: int = 90):
        self.exe, self.work, self.sm_count, self.cc = Path(exe), Path(work), sm_count, cc
        self.launches: list = []
        self.runs = 0

    def __call__(self, launcher, *args, lazy_cp_async: bool = False, **kwargs):
        recorded = []

        def fake_launch(kernel, grid, block, params, values, *, shared_mem=0, stream=0):
            recorded.append((kernel, tuple(grid), tuple(block), params, tuple(values), int(shared_mem)))

        saved = il.launch, il.get_kernel, il.device_info
        il.launch = fake_launch
        il.get_kernel = lambda spec, kernel=None, device_id=None: spec.kernels[0] if kernel is None else kernel
        il.device_info = lambda device=None: (self.sm_count, self.cc)
        try:
            launcher(*args, **kwargs)
        finally:
            il.launch, il.get_kernel, il.device_info = saved
        for rec in recorded:
            self._run(*rec, lazy=lazy_cp_async)
        self.launches.extend(recorded)
        return recorded

    def _run(self, name, grid, block, params, values, smem, *, lazy):
        d = self.work / f"launch{self.runs}"
        self.runs += 1
        params.pack(values)  # the values fit the parameter kinds
        bases: dict = {}
        addresses = []
        for kind, a in zip(params.kinds, values):
            if kind == "ptr" and not (a is None or (isinstance(a, int) and a == 0)):
                if not isinstance(a, EmuArg):
                    raise TypeError(f"pointer argument of type {type(a)}")
                bases.setdefault(id(a.base), a.base)
                a = a.ptr
            addresses.append(0 if a is None else a)
        run_launch(self.exe, d, name, grid, block[0], smem, params, addresses, list(bases.values()), lazy=lazy)
