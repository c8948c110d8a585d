"""Compile kernel variants with NVRTC: through CuPy on a GPU, directly without one.

* :func:`get_kernel` returns a loaded :class:`Kernel` for a device's arch, compiling the
  variant's module on first use (one module per variant and arch in memory, rebuilt when
  its source text changes; CuPy's disk cache underneath).
* :func:`compile_variant` / :func:`compile_all` build cubins with NVRTC alone
  (``cupy.cuda.nvrtc``), so every variant can be checked on a machine with no
  GPU and no driver.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from functools import lru_cache
from pathlib import Path

from ..runtime.interop import current_device
from .registry import SM90A, KernelSpec, registered
from .sources import source_text

CXX_STD = "--std=c++17"
#: The oldest target mate_cupy's kernels build for (bf16 mma.sync, cp.async, ldmatrix: Ampere).
MIN_SM = 80


class KernelCompileError(RuntimeError):
    """NVRTC rejected a variant; carries the variant, the options and the log."""

    def __init__(self, spec: KernelSpec, options, log: str):
        self.spec, self.options, self.log = spec, tuple(options), log
        super().__init__(
            f"NVRTC failed to compile {spec.name} (kernels {', '.join(spec.kernels)})\n"
            f"options: {' '.join(self.options)}\n{log}"
        )


def arch_for_capability(cc: str) -> str:
    """'90' -> 'sm_90a' (wgmma needs the arch-specific target); others 'sm_XY' ('100' -> 'sm_100')."""
    cc = str(cc).replace(".", "")
    return SM90A if cc == "90" else f"sm_{cc}"


class UnsupportedArchError(ValueError):
    """A compile target mate_cupy cannot build for (below sm_80, or unknown to NVRTC)."""


def nvrtc_archs() -> tuple:
    """Compute capabilities this NVRTC compiles for (e.g. ``(75, 80, ..., 120, 121)``), () if unknown."""
    try:
        from cupy.cuda import nvrtc

        return tuple(int(a) for a in nvrtc.getSupportedArchs())
    except Exception:  # pragma: no cover - an NVRTC without the query
        return ()


def normalize_arch(arch) -> str:
    """A compile target from ``"sm_100"``, ``"sm_90a"``, ``"sm_100f"``, ``"90"`` or ``"9.0"``.

    A bare compute capability maps as :func:`arch_for_capability` does (``"90"`` -> ``"sm_90a"``).
    Raises :class:`UnsupportedArchError` for a malformed name, a target below sm_80 (the
    kernels use Ampere's bf16 ``mma.sync`` and ``cp.async``) or one this NVRTC does not know.
    """
    import re

    text = str(arch).strip().lower()
    m = re.fullmatch(r"(?:sm_)?(\d+)(?:\.(\d))?([af]?)", text)
    if m is None or (m.group(2) is not None and m.group(3)):
        raise UnsupportedArchError(
            f"unknown target {arch!r}: give an arch such as sm_80, sm_90a, sm_100 or sm_120 "
            f"(or a compute capability such as 9.0)")
    if m.group(2) is not None:  # "9.0"
        cc = int(m.group(1)) * 10 + int(m.group(2))
        suffix = ""
        name = arch_for_capability(str(cc))
    else:
        cc, suffix = int(m.group(1)), m.group(3)
        bare = not text.startswith("sm_")
        name = arch_for_capability(str(cc)) if bare and not suffix else f"sm_{cc}{suffix}"
    if cc < MIN_SM:
        raise UnsupportedArchError(
            f"{name} is not supported: mate_cupy's kernels need sm_{MIN_SM} or newer (Ampere and later: "
            f"bf16 mma.sync, cp.async); on older GPUs use the NumPy reference path (host arrays)")
    if suffix and cc < 90:
        raise UnsupportedArchError(f"{name}: arch-specific ('a') and family ('f') targets start at sm_90; use sm_{cc}")
    known = nvrtc_archs()
    if known and cc not in known:
        raise UnsupportedArchError(
            f"{name} is unknown to this NVRTC {'.'.join(map(str, _nvrtc_version()))} "
            f"(it compiles for {', '.join(f'sm_{a}' for a in known if a >= MIN_SM)})")
    return name


def device_arch(device_id=None) -> str:
    import cupy

    dev = cupy.cuda.Device(device_id)
    return arch_for_capability(dev.compute_capability)


@lru_cache(maxsize=None)
def cuda_include_dirs() -> tuple:
    """Directories holding ``cuda_fp16.h``/``cuda_bf16.h``/``cuda_fp8.h``."""
    dirs = []
    for mod in ("nvidia.cu13", "nvidia.cuda_runtime"):
        try:
            import importlib

            m = importlib.import_module(mod)
            for p in getattr(m, "__path__", []):
                inc = Path(p) / "include"
                if (inc / "cuda_fp16.h").is_file():
                    dirs.append(str(inc))
        except ImportError:
            pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            dirs.append(os.path.join(os.environ[env], "include"))
    dirs.append("/usr/local/cuda/include")
    seen, out = set(), []
    for d in dirs:
        if d not in seen and os.path.isfile(os.path.join(d, "cuda_fp16.h")):
            seen.add(d)
            out.append(d)
    return tuple(out)


def compile_options(arch: str) -> tuple:
    opts = [CXX_STD, f"-arch={arch}", "-DNDEBUG"]
    opts += [f"-I{d}" for d in cuda_include_dirs()]
    return tuple(opts)


def full_source(spec: KernelSpec) -> str:
    """Macro prelude + the family source with headers pasted in."""
    return spec.prelude() + f'#line 1 "{spec.source}"\n' + source_text(spec.source)


_modules: dict = {}  # (spec, arch) -> ((source text, options), module)
_kernels: dict = {}  # (spec, kernel name, device) -> Kernel


def _nvrtc_version() -> tuple:
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getVersion())


def cubin_key(spec: KernelSpec, arch: str) -> str:
    """Key of a prebuilt cubin: source text, machine-independent options, arch, NVRTC version."""
    import hashlib

    opts = [o for o in compile_options(arch) if not o.startswith("-I")]
    text = "\0".join([full_source(spec), " ".join(opts), arch, repr(_nvrtc_version()), "\0".join(spec.kernels)])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _cubin_dir():
    d = os.environ.get("MATE_CUPY_CUBIN_DIR")
    return Path(d) if d else None


class _PrebuiltModule:
    """A cubin compiled ahead of time (``check --compile-only --cubin-dir``), loaded by CuPy."""

    def __init__(self, path: Path, lowered: dict):
        import cupy

        self._mod = cupy.RawModule(path=str(path))
        self._lowered = lowered

    def get_function(self, name: str):
        return self._mod.get_function(self._lowered[name])


def _load_prebuilt(spec: KernelSpec, arch: str):
    d = _cubin_dir()
    if d is None:
        return None
    key = cubin_key(spec, arch)
    cubin, meta = d / f"{key}.cubin", d / f"{key}.json"
    if not (cubin.is_file() and meta.is_file()):
        return None
    import json

    return _PrebuiltModule(cubin, json.loads(meta.read_text()))


def get_module(spec: KernelSpec, device_id=None):
    """The compiled module of ``spec`` for the device's arch (compiled once per process).

    Looks first in ``$MATE_CUPY_CUBIN_DIR`` for a cubin built ahead of time with the same
    source, options, arch and NVRTC version; else compiles through ``cupy.RawModule``
    (CuPy's disk cache underneath).
    """
    import cupy

    arch = device_arch(device_id)
    src = full_source(spec)
    opts = compile_options(arch)
    hit = _modules.get((spec, arch))  # one module per variant and arch (the latest source's)
    mod = hit[1] if hit is not None and hit[0] == (src, opts) else None
    if mod is None:
        if not spec.builds_for(arch):
            raise RuntimeError(f"{spec.name} needs {spec.requirement} and cannot run on this {arch} GPU "
                               f"(the launch configuration must not pick it there)")
        mod = _load_prebuilt(spec, arch)
        if mod is None:
            mod = cupy.RawModule(code=src, options=opts, name_expressions=list(spec.kernels))
            try:
                mod.compile()
            except cupy.cuda.compiler.CompileException as e:
                raise KernelCompileError(spec, opts, str(e)) from None
        _modules[(spec, arch)] = ((src, opts), mod)
    return mod


class Kernel:
    """One loaded kernel function on one device: CuPy's ``RawKernel`` and its ``CUfunction``."""

    __slots__ = ("raw", "ptr", "name", "device", "_smem")

    def __init__(self, raw, name: str, device: int):
        self.raw, self.name, self.device = raw, name, device
        self.ptr = int(raw.kernel.ptr)  # loads the function now (on the current device), not at its first launch
        self._smem = 48 * 1024

    def reserve_shared_memory(self, nbytes: int) -> None:
        """Opt into ``nbytes`` of dynamic shared memory (above the 48 KiB default)."""
        if nbytes > self._smem:
            with _device_scope(self.device):  # CuPy sets the attribute of the current device's function
                self.raw.max_dynamic_shared_size_bytes = int(nbytes)
            self._smem = int(nbytes)


def _device_scope(device: int):
    """Context: ``device`` current (no-op when it is)."""
    if current_device() == device:
        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.Device(device)


def get_kernel(spec: KernelSpec, kernel: str | None = None, device_id=None) -> Kernel:
    """The loaded :class:`Kernel` ``kernel`` (default: the spec's first) on ``device_id``
    (default: the current device).

    Compiles and loads the variant's module on first use (once per process and device),
    with ``device_id`` current while it loads. Loading runs in CUDA's relaxed capture mode,
    so a first use inside a stream capture (``torch.cuda.graph``) loads the module instead
    of invalidating the capture.
    """
    kernel = spec.kernels[0] if kernel is None else kernel
    if device_id is None:
        device_id = current_device()
    k = _kernels.get((spec, kernel, device_id))
    if k is None:
        from ..runtime.device import capture_tolerant

        if kernel not in spec.kernels:
            raise KeyError(f"{kernel} is not exported by {spec.name}")
        with _device_scope(device_id), capture_tolerant():
            k = Kernel(get_module(spec, device_id).get_function(kernel), kernel, device_id)
        _kernels[(spec, kernel, device_id)] = k
    return k


def load(spec: KernelSpec, device_id=None) -> None:
    """Compile and load every kernel of ``spec`` on the device (plans call this when prepared)."""
    for name in spec.kernels:
        get_kernel(spec, name, device_id)


def compile_variant(spec: KernelSpec, arch: str = "sm_90a", *, ptxas_verbose: bool = False,
                    cubin_dir=None) -> dict:
    """Compile ``spec`` to a cubin with NVRTC alone (no GPU needed).

    Returns ``{"name", "seconds", "cubin_bytes", "log"}``; raises
    :class:`KernelCompileError` with the NVRTC log on failure. With ``cubin_dir`` the
    cubin and its lowered kernel names are saved there under :func:`cubin_key`, for
    ``MATE_CUPY_CUBIN_DIR`` to load on a GPU machine without compiling.
    """
    from cupy.cuda import nvrtc

    if cubin_dir is not None and not ptxas_verbose:
        key = cubin_key(spec, arch)
        cached = Path(cubin_dir) / f"{key}.cubin"
        if cached.is_file() and (Path(cubin_dir) / f"{key}.json").is_file():
            return {"name": spec.name, "kernels": spec.kernels, "seconds": 0.0,
                    "cubin_bytes": cached.stat().st_size, "log": "", "cached": True}
    src = full_source(spec)
    opts = list(compile_options(arch)) + ["--device-as-default-execution-space", "-ftz=true"]
    if ptxas_verbose:
        opts.append("--ptxas-options=-v")
    t0 = time.perf_counter()
    prog = nvrtc.createProgram(src, spec.source, [], [])
    try:
        for k in spec.kernels:
            nvrtc.addNameExpression(prog, k)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError:
            raise KernelCompileError(spec, opts, nvrtc.getProgramLog(prog)) from None
        log = nvrtc.getProgramLog(prog)
        cubin = nvrtc.getCUBIN(prog)
        lowered = {k: nvrtc.getLoweredName(prog, k) for k in spec.kernels}
    finally:
        nvrtc.destroyProgram(prog)
    if cubin_dir is not None:
        import json

        d = Path(cubin_dir)
        d.mkdir(parents=True, exist_ok=True)
        key = cubin_key(spec, arch)
        (d / f"{key}.cubin").write_bytes(cubin)
        (d / f"{key}.json").write_text(json.dumps(lowered))
    return {"name": spec.name, "kernels": spec.kernels, "seconds": time.perf_counter() - t0,
            "cubin_bytes": len(cubin), "log": log}


def _compile_one(args):
    spec, arch, cubin_dir = args
    if not spec.builds_for(arch):
        return {"name": spec.name, "kernels": spec.kernels, "skipped": f"needs {spec.requirement}"}
    try:
        return compile_variant(spec, arch, cubin_dir=cubin_dir)
    except KernelCompileError as e:
        return {"name": spec.name, "kernels": spec.kernels, "error": str(e)}


def compile_all(arch: str = "sm_90a", *, jobs: int | None = None, progress=None, specs=None,
                cubin_dir=None) -> list:
    """Compile every registered variant for ``arch`` without a GPU.

    Variants that do not build for ``arch`` (:meth:`KernelSpec.builds_for`: fp8 below
    sm_89, the sm_90a-only wgmma/TMA variants on every other target) come back with
    ``"skipped"``. ``progress(done, total, result)`` is called after each variant. Returns
    the per-variant results; failures carry ``"error"`` instead of raising.
    """
    specs = registered() if specs is None else list(specs)
    jobs = jobs or max(1, min(len(specs), os.cpu_count() or 1))
    results = []
    if jobs == 1 or len(specs) <= 1:
        it = map(_compile_one, [(s, arch, cubin_dir) for s in specs])
        for r in it:
            results.append(r)
            if progress:
                progress(len(results), len(specs), r)
        return results
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing as mp

    ctx = mp.get_context("spawn" if sys.platform != "linux" else "fork")
    with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        for r in pool.map(_compile_one, [(s, arch, cubin_dir) for s in specs]):
            results.append(r)
            if progress:
                progress(len(results), len(specs), r)
    return results
