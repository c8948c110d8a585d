"""Run the per-token gather tile's launcher (``mate_cupy.msa.gather_launch.run_gather``) against
the CPU emulator.

``build(tmp_dir, dtype_code)`` compiles ``tests/index_emu/driver.cpp`` around
``cuda_src/attention_gather.cu`` for one element type (``GATHER_DTYPE``: 0 fp16, 1 bf16).
:func:`run_gather` then calls the launcher on host arrays: its launches and its counter memset
are recorded (``launch``, ``get_kernel`` and CuPy's ``memsetAsync`` swapped for stand-ins), the
memset is applied to the host workspace and each launch runs in the emulator in order, every
pointer argument resolved to the host array (or workspace) that holds its address.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from index_emu.harness import build_driver, drop_function, locate, run_launch, wrap
from mate_cupy.msa import gather_launch as gl

HERE = Path(__file__).resolve().parent
CUDA_SRC = Path(gl.__file__).resolve().parent.parent / "cuda_src"


def _header(name: str, drop=()) -> str:
    """common/<name> without its pragma, its includes and the device functions named in ``drop``."""
    src = (CUDA_SRC / "common" / name).read_text().replace("#pragma once", "")
    src = re.sub(r'#include "[^"]+"\n', "", src)
    for fn in drop:
        src = drop_function(src, fn)
    return src


def emulator_source() -> str:
    """attention_gather.cu with its plain headers pasted in; the GPU headers, inline PTX and
    ``fast_exp2`` supplied by the emulator."""
    src = (CUDA_SRC / gl.SOURCE).read_text()
    for inc in ('#include "common/dtype.cuh"', '#include "common/mma.cuh"', '#include "common/attention_wgmma.cuh"'):
        assert inc in src, inc
        src = src.replace(inc, "")
    pasted = {"softmax.cuh": _header("float_max.cuh") + _header("softmax.cuh", drop=("fast_exp2",)),
              "kv_pages.cuh": _header("kv_pages.cuh"), "request_rows.cuh": _header("request_rows.cuh")}
    for name, text in pasted.items():
        inc = f'#include "common/{name}"'
        assert inc in src, inc
        src = src.replace(inc, text)
    bar = 'asm volatile("bar.sync %0, 128;\\n" ::"r"(1 + wg) : "memory");'
    assert src.count(bar) == 2, "the warpgroup barriers of the attention kernel"
    src = src.replace(bar, "named_sync(1 + wg, 128);")
    decl = "extern __shared__ __align__(1024) unsigned char smem_raw[];"
    assert src.count(decl) == 1
    return src.replace(decl, "unsigned char* smem_raw = emu::dyn_smem();")


def build(tmp_dir: Path, dtype_code: int, sanitize: bool | None = None) -> Path:
    """Compile the emulator for ``GATHER_DTYPE = dtype_code``; returns the executable."""
    return build_driver(tmp_dir, f"gather_emu_{int(dtype_code)}", emulator_source(), gl.KERNELS,
                        header="emu_gather.h", include_dirs=(HERE,), strict_aliasing=False, sanitize=sanitize,
                        defines=(f"GATHER_DTYPE={int(dtype_code)}", f"GATHER_CAP={gl.CAP}"))


def run_gather(exe: Path, work: Path, arrays: dict, workspace: np.ndarray, *, lazy_cp_async: bool = False,
               **kwargs) -> int:
    """``gl.run_gather(**arrays wrapped, **kwargs)`` with its launches run in the emulator;
    ``arrays`` (C-contiguous, None allowed) and ``workspace`` (uint8) are updated in place.
    ``lazy_cp_async``: cp.async copies land, and wgmma computes, at the wait that retires their
    group instead of at issue. Returns the number of launches."""
    import cupy.cuda.runtime as rt

    buffers = [a for a in arrays.values() if a is not None] + [workspace]
    assert all(a.flags.c_contiguous for a in buffers)
    recorded = []

    def memset(ptr, value, size, stream):
        i, off = locate(buffers, ptr)
        buffers[i].view(np.uint8).reshape(-1)[off:off + size] = value

    saved = gl.launch, gl.get_kernel, rt.memsetAsync
    gl.launch = lambda kern, grid, block, params, values, shared_mem=0, stream=0: recorded.append(
        (kern, tuple(grid), tuple(block), params, tuple(values), int(shared_mem)))
    gl.get_kernel = lambda spec, name: name
    rt.memsetAsync = memset
    try:
        gl.run_gather(**{k: wrap(a, k) for k, a in arrays.items()},
                      workspace_ptr=workspace.__array_interface__["data"][0], workspace_nbytes=workspace.nbytes,
                      stream=0, **kwargs)
    finally:
        gl.launch, gl.get_kernel, rt.memsetAsync = saved
    for n, (name, grid, block, params, values, smem) in enumerate(recorded):
        run_launch(exe, Path(work) / f"launch{n}", name, grid, block[0], smem, params, values, buffers,
                   lazy=lazy_cp_async)
    return len(recorded)
