"""Run the MSA index launchers against the CPU emulator (tests/index_emu).

``build(tmp_dir)`` compiles ``driver.cpp`` around ``cuda_src/msa_index.cu`` (every
registered variant). ``Emulated(exe, tmp_dir)`` then runs a launcher of
``mate_cupy.msa.index_kernels`` with NumPy arrays: the launcher validates and sizes the
launch as on a GPU, each recorded launch runs in the emulator, and the arrays come back
with what the kernel wrote.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

from mate_cupy.msa import index_kernels as ik

HERE = Path(__file__).resolve().parent
CUDA_SRC = Path(ik.__file__).resolve().parent.parent / "cuda_src"


def emulator_source() -> str:
    """msa_index.cu with topk.cuh pasted in, the GPU headers and inline PTX left out."""
    src = (CUDA_SRC / "msa_index.cu").read_text()
    topk = (CUDA_SRC / "common" / "topk.cuh").read_text()
    topk = topk.replace("#pragma once", "").replace('#include "dtype.cuh"', "")
    for inc in ('#include "common/dtype.cuh"', '#include "common/mma.cuh"', '#include "common/attention_wgmma.cuh"'):
        assert inc in src, inc
        src = src.replace(inc, "")
    assert '#include "common/topk.cuh"' in src
    src = src.replace('#include "common/topk.cuh"', topk)
    decl = "extern __shared__ __align__(128) unsigned char smem_raw[];"
    assert src.count(decl) >= 1
    src = src.replace(decl, "unsigned char* smem_raw = emu::dyn_smem();")
    return "#define MATE_CUPY_EMU 1\n" + src


def kernel_names() -> list:
    specs = list(ik.TOPK_SPECS.values()) + list(ik.STREAM_SPECS.values()) + list(ik.MAX_SCORE_SPECS.values())
    return [k for s in specs for k in s.kernels]


def build(tmp_dir: Path, sanitize: bool | None = None) -> Path:
    """Compile the emulator; returns the executable."""
    from mate_cupy.jit.compiler import cuda_include_dirs

    if shutil.which("g++") is None or not cuda_include_dirs():
        raise RuntimeError("needs g++ and the CUDA fp16/bf16 headers")
    if sanitize is None:
        sanitize = bool(os.environ.get("MATE_CUPY_EMU_SANITIZE"))
    tmp_dir = Path(tmp_dir)
    (tmp_dir / "msa_index_emu.inc").write_text(emulator_source())
    (tmp_dir / "emu_kernels.inc").write_text("".join(f'REG("{n}", {n});\n' for n in kernel_names()))
    flags = ["-O1", "-g", "-fsanitize=address,undefined"] if sanitize else ["-O2"]
    exe = tmp_dir / "index_driver"
    cmd = ["g++", "-std=c++20", *flags, "-w", f"-I{HERE}", f"-I{HERE.parent / 'cuda_emu'}", f"-I{tmp_dir}",
           *(f"-I{i}" for i in cuda_include_dirs()), str(HERE / "driver.cpp"), "-o", str(exe), "-lpthread"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-6000:])
    return exe


class _Data:
    def __init__(self, ptr: int):
        self.ptr = ptr


class EmuArray:
    """A NumPy array dressed as a device array for the launchers (``.data.ptr``,
    ``.flags``, ``.strides``, ...). Views keep their base buffer and byte offset."""

    def __init__(self, a: np.ndarray):
        base = a
        while isinstance(base.base, np.ndarray):
            base = base.base
        if not base.flags.c_contiguous:
            raise ValueError("the base buffer must be contiguous")
        self.a = a
        self.base = base
        self.offset = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        self.data = _Data(a.__array_interface__["data"][0])
        self.dtype, self.shape, self.ndim, self.size = a.dtype, a.shape, a.ndim, a.size
        self.strides, self.itemsize, self.flags = a.strides, a.itemsize, a.flags

    def get(self) -> np.ndarray:
        return self.a


def wrap(a):
    return None if a is None else EmuArray(np.asarray(a))


class Emulated:
    """Context for running launchers in the emulator."""

    def __init__(self, exe: Path, work: Path, sm_count: int = 132):
        self.exe, self.work, self.sm_count = Path(exe), Path(work), sm_count
        self.launches: list = []
        self.runs = 0

    def __call__(self, launcher, *args, lazy_cp_async: bool = False, **kwargs):
        recorded = []

        def fake_launch(kernel, grid, block, largs, *, shared_mem=0, stream=None):
            recorded.append((kernel, tuple(grid), tuple(block), tuple(largs), int(shared_mem)))

        saved = ik.launch, ik.get_kernel, ik._sm_count
        ik.launch = fake_launch
        ik.get_kernel = lambda spec, kernel=None, device_id=None: spec.kernels[0] if kernel is None else kernel
        ik._sm_count = lambda: self.sm_count
        try:
            launcher(*args, **kwargs)
        finally:
            ik.launch, ik.get_kernel, ik._sm_count = saved
        for rec in recorded:
            self._run(*rec, lazy=lazy_cp_async)
        self.launches.extend(recorded)
        return recorded

    def _run(self, name, grid, block, largs, smem, *, lazy):
        d = self.work / f"launch{self.runs}"
        self.runs += 1
        d.mkdir(parents=True, exist_ok=True)
        grid = tuple(grid) + (1,) * (3 - len(grid))
        lines = [name, f"{grid[0]} {grid[1]} {grid[2]} {block[0]} {smem} {int(lazy)}"]
        bases: dict = {}
        for a in largs:
            if isinstance(a, EmuArray):
                key = id(a.base)
                if key not in bases:
                    bases[key] = (len(bases), a.base)
                    a.base.tofile(d / f"a{bases[key][0]}.bin")
                lines.append(f"A {bases[key][0]} {a.offset}")
            elif isinstance(a, np.uintp) and int(a) == 0:
                lines.append("P0")
            elif isinstance(a, (np.integer, int)):
                lines.append(f"I {int(a)}")
            elif isinstance(a, (np.floating, float)):
                lines.append(f"F {float(a)!r}")
            else:
                raise TypeError(f"argument of type {type(a)}")
        (d / "launch.txt").write_text("\n".join(lines) + "\n")
        r = subprocess.run([str(self.exe), str(d)], capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise RuntimeError(f"emulated {name} failed ({r.returncode}): {r.stderr[-4000:]}")
        for idx, base in bases.values():
            out = np.fromfile(d / f"a{idx}.out", dtype=base.dtype).reshape(base.shape)
            base[...] = out
        shutil.rmtree(d, ignore_errors=True)
