"""flash-linear-attention (``fla-core`` 0.6.0) as a peer: import, time budget, autotune configs.

fla is optional: when it cannot be imported its rows carry the error and the run
goes on. Its kernels are Triton with ``@autotune``; the first ``chunk_kda`` call
for a new head count tunes for 80-100 s. Two controls keep the bench short:

* a time budget shared by every fla first call (``--fla-budget-s``): a first
  call that overruns it is interrupted (SIGALRM) and later fla rows are skipped;
* saved configs: after a run, every tuned fla kernel's chosen configs are
  written to ``OUTDIR/fla_configs/<GPU>/<module>.<kernel>.json``. Committed under
  ``bench/fla_configs/<GPU>/``, they seed the Triton autotuners' caches on later
  runs (exact autotune-key matches skip tuning; anything else still tunes), so
  fla still runs its own best configs, without the 80-100 s search.

fla's backend dispatch is turned off (``FLA_DISABLE_BACKEND_DISPATCH=1``) so its
Triton kernels run (the TileLang / FlashKDA backends are not installed there).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

from .timing import time_box


def gpu_dir_name(gpu_name: str) -> str:
    """fla's sanitised GPU name ("NVIDIA H200" -> "NVIDIA_H200")."""
    return re.sub(r"[^0-9A-Za-z]+", "_", gpu_name).strip("_") or "unknown_gpu"


class FlaSession:
    """One process's fla: loaded once, with a time budget for first calls."""

    def __init__(self, budget_s: float, configs_dir: str | None):
        self.budget_s = float(budget_s)
        self.used_s = 0.0
        self.configs_dir = configs_dir
        self.modules = None
        self.error = None
        self.version = None
        self.preloaded = None  # entries seeded from configs_dir

    # ------------------------------------------------------------------ loading
    def load(self):
        """Import fla (once). Returns a namespace with ``chunk_kda`` and ``fused_recurrent_kda_fwd``."""
        if self.modules is not None:
            return self.modules
        if self.error is not None:
            raise RuntimeError(self.error)
        os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
        try:
            from fla.ops.kda import chunk_kda
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        except Exception as e:  # ImportError, or a missing dependency inside fla
            self.error = f"fla not importable ({type(e).__name__}: {e}); install the fla-core wheel (bench/README.md)"
            raise RuntimeError(self.error) from None
        try:
            from importlib.metadata import version

            self.version = version("fla-core")
        except Exception:
            self.version = "unknown"

        class _Ns:
            pass

        ns = _Ns()
        ns.chunk_kda = chunk_kda
        ns.fused_recurrent_kda_fwd = fused_recurrent_kda_fwd
        self.modules = ns
        if self.configs_dir and Path(self.configs_dir).is_dir():
            try:
                self.preloaded = self.preload_configs(self.configs_dir)
            except Exception as e:  # a stale folder must not cost the peer
                self.preloaded = f"failed: {type(e).__name__}: {e}"
        return ns

    # ------------------------------------------------------------------ budget
    @contextlib.contextmanager
    def guard(self):
        """Around an fla impl's build + first call: enforce what is left of the budget."""
        left = self.budget_s - self.used_s
        if left <= 0:
            raise RuntimeError(f"skipped: the fla time budget ({self.budget_s:.0f} s, --fla-budget-s) is spent")
        t0 = time.perf_counter()
        try:
            with time_box(left, "fla first call (Triton autotuning)"):
                yield
        finally:
            self.used_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ configs
    def autotuners(self):
        """Every Triton autotuner object in the loaded fla modules (deduplicated)."""
        try:
            from triton.runtime.autotuner import Autotuner
        except Exception:
            return []
        found = {}
        for name, mod in list(sys.modules.items()):
            if not (name == "fla" or name.startswith("fla.")) or mod is None:
                continue
            for obj in list(vars(mod).values()):
                depth = 0
                while obj is not None and depth < 6:
                    if isinstance(obj, Autotuner):
                        found[id(obj)] = obj
                        break
                    obj = getattr(obj, "fn", None)
                    depth += 1
        return list(found.values())

    @staticmethod
    def kernel_id(autotuner) -> str:
        fn = autotuner.base_fn
        return f"{fn.__module__}.{fn.__qualname__}"

    def dump_configs(self, outdir) -> list[str]:
        """Write every tuned fla kernel's chosen configs to ``<module>.<kernel>.json``
        (merged with what the folder already holds); returns the files written."""
        if self.modules is None:
            return []
        import triton

        outdir = Path(outdir)
        written = []
        for at in self.autotuners():
            cache = getattr(at, "cache", None) or {}
            entries = []
            for key, cfg in cache.items():
                if getattr(cfg, "pre_hook", None) is not None:
                    continue  # not serialisable; that kernel keeps autotuning
                entry = {"key": list(key),
                         "config": {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps,
                                    "num_stages": cfg.num_stages, "num_ctas": getattr(cfg, "num_ctas", 1),
                                    "maxnreg": getattr(cfg, "maxnreg", None)}}
                try:
                    json.dumps(entry)
                except (TypeError, ValueError):
                    continue
                entries.append(entry)
            if not entries:
                continue
            outdir.mkdir(parents=True, exist_ok=True)
            path = outdir / f"{self.kernel_id(at)}.json"
            merged = {}
            if path.is_file():
                try:
                    for e in json.loads(path.read_text()).get("entries", []):
                        merged[json.dumps(e["key"])] = e
                except Exception:
                    merged = {}
            for e in entries:
                merged[json.dumps(e["key"])] = e
            path.write_text(json.dumps({"kernel": self.kernel_id(at), "fla_version": self.version,
                                        "triton_version": triton.__version__,
                                        "entries": sorted(merged.values(), key=lambda e: json.dumps(e["key"]))},
                                       indent=1) + "\n")
            written.append(str(path))
        return written

    def preload_configs(self, folder) -> int:
        """Seed each fla autotuner's cache with the configs saved in ``folder``, so
        matching calls skip tuning. A saved config is used only if it is one of that
        autotuner's own candidates (a changed fla falls back to tuning). Returns the
        number of (kernel, key) entries loaded."""
        import triton

        folder = Path(folder)
        loaded = 0
        for at in self.autotuners():
            path = folder / f"{self.kernel_id(at)}.json"
            if not path.is_file():
                continue
            try:
                entries = json.loads(path.read_text()).get("entries", [])
            except Exception:
                continue
            for e in entries:
                c = e["config"]
                cfg = triton.Config(dict(c["kwargs"]), num_warps=c["num_warps"], num_stages=c["num_stages"],
                                    num_ctas=c.get("num_ctas", 1), maxnreg=c.get("maxnreg"))
                match = next((x for x in at.configs if x == cfg), None)
                if match is None:
                    continue
                at.cache[tuple(e["key"])] = match
                loaded += 1
        return loaded
