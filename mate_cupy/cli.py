"""mate_cupy's command line: versions, kernel compilation for a GPU arch, and a demo.

commands:
  check   print the versions and the GPU; compile (and on a GPU load) every kernel
          variant the target arch runs
  demo    run the MSA pipeline (max score -> top-k select -> sparse attention) and a
          KDA prefill -> decode, on the GPU or the NumPy float64 references, and compare
          each result with its reference
"""
from __future__ import annotations

import argparse
import platform
import shutil
import sys
import time
from collections import Counter

EPILOG = """examples:
  python -m mate_cupy demo                     the demo (5-15 s on 2 CPU cores without a GPU)
  python -m mate_cupy check                    on a GPU: compile and load what it runs
  python -m mate_cupy check --arch sm_100 --compile-only --jobs 2
                                               no GPU needed: build what a B200 runs
                                               (one to two minutes on 2 cores)
  python -m mate_cupy check --arch sm_90a --compile-only --cubin-dir cubins
                                               prebuild the H100/H200 cubins
targets: sm_80, sm_86, sm_89 (fp8), sm_90a (H100/H200: adds the wgmma/TMA variants),
sm_100, sm_120, ...; below sm_80 is not supported."""

# What a variant that a target skips needs, in words (KernelSpec.requirement -> why).
_SKIP_WHY = {
    "sm_90a only": "wgmma/TMA variants: Hopper-only, picked only on compute capability 9.0",
    "sm_89 or newer": "fp8 mma.sync",
}


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


# ----------------------------------------------------------------------------- progress


def _ellipsis(stream) -> str:
    try:
        "\u2026".encode(getattr(stream, "encoding", None) or "ascii")
        return "\u2026"
    except (UnicodeEncodeError, LookupError):
        return "..."


def fit(text: str, width: int, ellipsis: str = "\u2026") -> str:
    """``text`` in at most ``width`` columns: cut at the last token boundary (``,`` ``[`` ``<``
    ``(`` or a space) that fits, marked with ``ellipsis``; never inside a token unless one
    token alone is wider than the space."""
    if len(text) <= width:
        return text
    room = width - len(ellipsis)
    if room <= 0:
        return ellipsis[:max(width, 0)]
    cut = text[:room]
    for i in range(len(cut) - 1, len(cut) // 3, -1):
        if cut[i] in ",[<( ":
            cut = cut[:i + 1]
            break
    return cut.rstrip(" ") + ellipsis


def short_name(name: str) -> str:
    """A variant's name for a progress line: the prefix its macros share dropped
    (``attention_fwd[ATT_BLOCK_N=64,ATT_DTYPE=1,...]`` -> ``attention_fwd[BLOCK_N=64,DTYPE=1,...]``)."""
    import os

    stem, sep, rest = name.partition("[")
    if not sep or not rest.endswith("]"):
        return name
    items = rest[:-1].split(",")
    prefix = os.path.commonprefix([i.split("=", 1)[0] for i in items])
    prefix = prefix[:prefix.rfind("_") + 1]
    return f"{stem}[{','.join(i[len(prefix):] for i in items)}]" if prefix else name


def progress_line(done: int, total: int, result: dict, elapsed: float, columns: int, ellipsis: str = "\u2026"):
    """One progress line of at most ``columns - 1`` characters (the last column is left free
    so a terminal never wraps it): a bar when there is room, the count, the time, the status
    and the variant's name (shortened with ``ellipsis``)."""
    status = "FAIL" if "error" in result else ("skip" if "skipped" in result else "ok")
    name = result["name"]
    label = short_name(name) if "[" in name else f"{name} {result['kernels'][0]}"  # macros, else the template
    width = max(columns - 1, 20)
    head = f"{done:>{len(str(total))}}/{total} {elapsed:6.1f}s {status:4s} "
    bar_w = min(30, width - len(head) - 3 - max(48, min(len(label), 90)))  # a bar only where the name keeps room
    if bar_w >= 10:
        fill = int(bar_w * done / max(total, 1))
        head = f"[{'#' * fill}{'.' * (bar_w - fill)}] " + head
    return head + fit(label, width - len(head), ellipsis)


def _progress(done: int, total: int, result: dict, t0: float, stream=None) -> None:
    """A progress line rewritten in place on a terminal; a line per tenth of the work (and per
    failure) otherwise. Lines fit the terminal's width (``shutil.get_terminal_size``)."""
    stream = sys.stdout if stream is None else stream
    columns = shutil.get_terminal_size().columns
    line = progress_line(done, total, result, time.perf_counter() - t0, columns, _ellipsis(stream))
    failed = "error" in result
    if stream.isatty():
        stream.write("\r" + line.ljust(max(columns - 1, 20)))
        if done == total or failed:
            stream.write("\n")
    elif done == total or failed or done * 10 // total != (done - 1) * 10 // total:
        stream.write(line + "\n")
    stream.flush()


# ----------------------------------------------------------------------------- check


def _arch_arg(text: str) -> str:
    from .jit import UnsupportedArchError, normalize_arch

    try:
        return normalize_arch(text)
    except UnsupportedArchError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _target(args, gpu):
    """``(arch, compile_only, why)``: the target of ``check`` and the reason for it."""
    from .jit import MIN_SM, arch_capability

    if args.arch:
        why = "from --arch"
        compile_only = args.compile_only or gpu is None
        if gpu is not None and not args.compile_only and args.arch != gpu[1]:
            why += f"; it is not this GPU's {gpu[1]}, so NVRTC compiles without loading"
            compile_only = True
        return args.arch, compile_only, why
    if gpu is not None:
        cc = arch_capability(gpu[1])
        if cc < MIN_SM:
            return gpu[1], args.compile_only, None
        return gpu[1], args.compile_only, f"the GPU's: {gpu[0]}, compute capability {cc // 10}.{cc % 10}"
    return "sm_90a", True, ("no GPU visible and no --arch, so the default: Hopper; "
                            "pass --arch sm_80, sm_100 or sm_120 for other GPUs")


def cmd_check(args) -> int:
    for k, v in _versions():
        print(f"{k:12s} {v}")
    gpu = gpu_info()
    print(f"{'GPU':12s} {f'{gpu[0]} ({gpu[1]})' if gpu else 'no GPU'}")
    arch, compile_only, why = _target(args, gpu)
    if why is None:
        print(f"error: this GPU ({gpu[0]}, {arch}) is older than sm_80: mate_cupy's kernels do not run on it; "
              f"host (NumPy) arrays still run the float64 references", file=sys.stderr)
        return 2
    from .jit import compile_all, get_kernel, registered

    specs = registered()
    if args.only:
        import re

        pat = re.compile(args.only)
        specs = [s for s in specs if pat.search(f"{s.name} {' '.join(s.kernels)}")]
    print(f"{'target':12s} {arch} ({why})")
    builds = [s for s in specs if s.builds_for(arch)]
    how = "NVRTC alone (no loading)" if compile_only else "CuPy on the device, then loaded"
    print(f"compiling the {len(builds)} of {len(specs)} kernel variants that {arch} runs, with {how}")
    for req, n in sorted(Counter(s.requirement for s in specs if not s.builds_for(arch)).items()):
        extra = _SKIP_WHY.get(req)
        print(f"  skipping {n} that need {req}" + (f" ({extra})" if extra else ""))
    t0 = time.perf_counter()
    if compile_only:
        results = compile_all(arch, jobs=args.jobs, cubin_dir=args.cubin_dir, specs=specs,
                              progress=lambda d, n, r: _progress(d, n, r, t0))
    else:
        results = []
        for i, spec in enumerate(specs, 1):
            r = {"name": spec.name, "kernels": spec.kernels}
            if not spec.builds_for(arch):
                r["skipped"] = f"needs {spec.requirement}"
            else:
                try:
                    for k in spec.kernels:
                        get_kernel(spec, k)
                except Exception as e:
                    r["error"] = str(e)
            results.append(r)
            _progress(i, len(specs), r, t0)
    failed = [r for r in results if "error" in r]
    skipped = [r for r in results if "skipped" in r]
    for r in failed:
        print(f"\nFAILED {r['name']} {r['kernels']}\n{r['error']}")
    print(f"{len(results) - len(failed) - len(skipped)} compiled, {len(skipped)} skipped, {len(failed)} failed "
          f"in {time.perf_counter() - t0:.1f} s ({arch})")
    return 1 if failed else 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(force_cpu=args.cpu)


def parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="python -m mate_cupy", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"mate_cupy {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="{check,demo}")
    c = sub.add_parser("check", help="print versions and the GPU, compile the kernel variants an arch runs",
                       description="Print the versions and the GPU, then compile every kernel variant the "
                                   "target arch runs (on a GPU also load each). The target is --arch, else "
                                   "the GPU's, else sm_90a; variants for other archs are skipped (the "
                                   "sm_90a-only wgmma/TMA ones everywhere but sm_90a). Exit status 1 when a "
                                   "variant fails, 2 for a target below sm_80.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--arch", default=None, type=_arch_arg,
                   help="target: sm_80, sm_86, sm_89, sm_90a, sm_100, sm_120, ... or a compute capability "
                        "such as 9.0 (default: the GPU's; sm_90a without a GPU)")
    c.add_argument("--compile-only", action="store_true", help="compile with NVRTC alone (no GPU needed)")
    c.add_argument("--jobs", type=int, default=None, help="parallel compile processes (default: the CPU count)")
    c.add_argument("--only", default=None, help="regex: compile only the variants whose name or kernels match")
    c.add_argument("--cubin-dir", default=None,
                   help="with --compile-only: save the cubins there, for MATE_CUPY_CUBIN_DIR on a GPU machine")
    c.set_defaults(fn=cmd_check)
    d = sub.add_parser("demo", help="the MSA pipeline and a KDA prefill -> decode, compared with the references",
                       description="Run the MSA pipeline (msa with max scores -> sparse_topk_select -> "
                                   "sparse_msa) and KDA (chunk_kda prefill -> gated_delta_rule_decode from its "
                                   "final state) on the GPU when CuPy sees one, else on the NumPy float64 "
                                   "references; compare each result with its reference.")
    d.add_argument("--cpu", action="store_true", help="run on the NumPy reference path even with a GPU")
    d.set_defaults(fn=cmd_demo)
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.cmd is None:
        p.print_help()
        return 0
    return args.fn(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
