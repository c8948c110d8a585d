"""Command line: ``python -m mate_cupy check`` and ``python -m mate_cupy demo``."""
from __future__ import annotations

import argparse
import platform
import sys
import time


def _versions() -> list:
    import ml_dtypes
    import numpy as np

    from . import __version__

    rows = [("mate_cupy", __version__), ("Python", platform.python_version()), ("NumPy", np.__version__),
            ("ml_dtypes", ml_dtypes.__version__)]
    try:
        import cupy

        rows.append(("CuPy", cupy.__version__))
        try:
            from cupy.cuda import nvrtc

            rows.append(("NVRTC", ".".join(map(str, nvrtc.getVersion()))))
        except Exception as e:  # pragma: no cover - depends on the install
            rows.append(("NVRTC", f"unavailable ({type(e).__name__})"))
        try:
            v = cupy.cuda.runtime.driverGetVersion()
            rows.append(("CUDA driver", f"{v // 1000}.{v % 1000 // 10}" if v else "none"))
        except Exception:
            rows.append(("CUDA driver", "none"))
    except ImportError:
        rows.append(("CuPy", "not installed (NumPy reference path only)"))
    return rows


def gpu_info():
    """``(name, arch)`` of the current GPU, or None without one."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None
        from .jit import device_arch

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        return name, device_arch()
    except Exception:
        return None


def _progress(done: int, total: int, result: dict, t0: float, stream=sys.stdout) -> None:
    """A progress bar on a terminal; a line per tenth of the work otherwise."""
    width = 30
    fill = int(width * done / max(total, 1))
    status = "FAIL" if "error" in result else ("skip" if "skipped" in result else "ok")
    label = f"{result['name']} {result['kernels'][0]}"[:70]
    bar = f"[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {time.perf_counter() - t0:6.1f}s"
    if stream.isatty():
        stream.write(f"\r{bar} {status:4s} {label:70s}")
        if done == total:
            stream.write("\n")
    elif done == total or status == "FAIL" or done * 10 // total != (done - 1) * 10 // total:
        stream.write(f"{bar} {status} {label}\n")
    stream.flush()


def cmd_check(args) -> int:
    for k, v in _versions():
        print(f"{k:12s} {v}")
    gpu = gpu_info()
    print(f"{'GPU':12s} {f'{gpu[0]} ({gpu[1]})' if gpu else 'no GPU'}")
    from .jit import compile_all, get_kernel, registered

    specs = registered()
    if args.only:
        import re

        pat = re.compile(args.only)
        specs = [s for s in specs if pat.search(f"{s.name} {' '.join(s.kernels)}")]
    compile_only = args.compile_only or gpu is None
    arch = args.arch or (gpu[1] if gpu else "sm_90a")
    how = f"NVRTC for {arch}" if compile_only else f"CuPy RawModule on the device ({arch})"
    print(f"compiling {len(specs)} kernel variants with {how}")
    t0 = time.perf_counter()
    if compile_only:
        results = compile_all(arch, jobs=args.jobs, cubin_dir=args.cubin_dir, specs=specs,
                              progress=lambda d, n, r: _progress(d, n, r, t0))
    else:
        results = []
        for i, spec in enumerate(specs, 1):
            try:
                for k in spec.kernels:
                    get_kernel(spec, k)
                r = {"name": spec.name, "kernels": spec.kernels}
            except Exception as e:
                r = {"name": spec.name, "kernels": spec.kernels, "error": str(e)}
            results.append(r)
            _progress(i, len(specs), r, t0)
    failed = [r for r in results if "error" in r]
    skipped = [r for r in results if "skipped" in r]
    for r in failed:
        print(f"\nFAILED {r['name']} {r['kernels']}\n{r['error']}")
    print(f"{len(results) - len(failed) - len(skipped)} compiled, {len(skipped)} skipped, {len(failed)} failed "
          f"in {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(force_cpu=args.cpu)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mate_cupy", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="print versions and the GPU, compile every kernel variant")
    c.add_argument("--arch", default=None, help="target arch, e.g. sm_90a or sm_80 (default: the GPU's)")
    c.add_argument("--compile-only", action="store_true", help="compile with NVRTC alone (no GPU needed)")
    c.add_argument("--jobs", type=int, default=None, help="parallel compile processes")
    c.add_argument("--only", default=None, help="regex: compile only the variants whose name or kernels match")
    c.add_argument("--cubin-dir", default=None,
                   help="with --compile-only: save the cubins there, for MATE_CUPY_CUBIN_DIR on a GPU machine")
    c.set_defaults(fn=cmd_check)
    d = sub.add_parser("demo", help="a small MSA and KDA call on the GPU (or the NumPy reference path)")
    d.add_argument("--cpu", action="store_true", help="run on the NumPy reference path even with a GPU")
    d.set_defaults(fn=cmd_demo)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
