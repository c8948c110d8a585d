"""Run the KDA decode launcher's kernels (``cuda_src/kda_decode.cu``) on the CPU emulator.

``build(tmp_dir)`` compiles ``tests/index_emu/driver.cpp`` around ``kda_decode.cu`` (every
registered variant). :func:`run_decode` validates a call as a CUDA call on stand-in tensors that
carry the host arrays' addresses (``decode.validate``), takes the launcher's configuration and
kernel arguments (``decode_launch.select_config`` or ``decode_config``, ``kernel_values``), runs
the launch in the emulator with every pointer resolved to the host array that holds it, and
copies back what the kernel wrote.
"""
from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np

from helpers import fake_cuda
from index_emu.harness import build_driver, run_launch
from mate_cupy.kda import decode, decode_launch as dl

HERE = Path(__file__).resolve().parent
CUDA_SRC = Path(dl.__file__).resolve().parent.parent / "cuda_src"


def emulator_source() -> str:
    """kda_decode.cu without its GPU headers (the emulator supplies them; the grid dependency
    header, a no-op off the GPU, and the opaque header, plain inline asm, are inlined as they
    are), its dynamic shared memory the emulator's."""
    src = (CUDA_SRC / dl.SOURCE).read_text()
    for inc in ('#include "common/dtype.cuh"', '#include "common/mma.cuh"', '#include "common/bulk_copy.cuh"'):
        assert inc in src, inc
        src = src.replace(inc, "")
    for name in ("grid_dependency.cuh", "opaque.cuh"):
        inc = f'#include "common/{name}"'
        assert inc in src, inc
        src = src.replace(inc, (CUDA_SRC / "common" / name).read_text().replace("#pragma once", ""))
    decl = "extern __shared__ __align__(16) unsigned char kda_decode_smem[];"
    assert src.count(decl) == 1
    return src.replace(decl, "#define kda_decode_smem (emu::dyn_smem())")


def build(tmp_dir: Path, sanitize: bool | None = None) -> Path:
    """Compile the emulator with every registered decode kernel; returns the executable."""
    names = [name for spec in dl.SPECS.values() for name in spec.kernels]
    return build_driver(tmp_dir, "kda_decode_emu", emulator_source(), names, header="emu_kda_decode.h",
                        include_dirs=(HERE,), strict_aliasing=False, sanitize=sanitize)


def _validate(arrays: dict, opts: dict):
    """``decode.validate`` of the call on stand-in CUDA tensors at the host arrays' addresses."""
    kw = {n: None for n in inspect.signature(decode.validate).parameters}
    kw.update(store_final_state=False, inplace_final_state=False)
    kw.update(opts)
    for n, a in arrays.items():
        kw[n] = None if a is None else fake_cuda(a, address=a.__array_interface__["data"][0])
    return decode.validate(**kw)


def run_decode(exe: Path, work: Path, x: dict, opts: dict, *, cc: int = 90, sm_count: int = 132,
               warps: int | None = None, lazy: bool = False, timeout: float = 600):
    """The CUDA path of ``gated_delta_rule_decode(**x, **opts)`` on the emulator. ``x``'s arrays
    are used in place (the pool is written when ``inplace_final_state``). ``warps``:
    ``decode_config(problem, cc, warps)`` instead of ``select_config``. ``lazy``: cp.async
    and bulk copies land at the wait that retires them instead of at issue. ``timeout``: seconds
    the emulated launch may take (a barrier phase waited out of order never completes).
    Returns ``(output, final_state or None)``; the output is poisoned (NaN) before the launch."""
    B, T = x["q"].shape[:2]
    HV, V = x["v"].shape[2:]
    out = np.full((B, T, HV, V), np.nan, dtype=x["q"].dtype)
    given = {**x, **{n: a for n, a in opts.items() if isinstance(a, np.ndarray)}}  # state_indices too
    opts = {n: a for n, a in opts.items() if n not in given}
    for n, a in given.items():
        assert a is None or a.flags.c_contiguous, f"{n}: pass C-contiguous arrays"
    arrays = {**given, "output": out}
    call, p = _validate(arrays, opts)
    assert not p.staged
    cfg = dl.select_config(p, sm_count, cc) if warps is None else dl.decode_config(p, cc, warps)
    ptrs = {name: arg.ptr for name, arg in call.args.items()}
    final = None
    if p.store_final_state and not p.inplace_final_state:
        final = np.full(p.final_shape, np.nan, dtype=p.state_dtype)
        ptrs["final_state"] = final.__array_interface__["data"][0]
    if not cfg.grid:
        return out, final
    buffers = [a for a in arrays.values() if a is not None] + ([final] if final is not None else [])
    run_launch(exe, work, cfg.spec.kernels[0], (cfg.grid,), cfg.threads, cfg.smem, dl.PARAMS,
               dl.kernel_values(p, cfg, ptrs), buffers, lazy=lazy, timeout=timeout)
    return out, final
