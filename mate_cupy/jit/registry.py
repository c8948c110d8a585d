"""The registry of every kernel variant mate_cupy can launch.

A :class:`KernelSpec` is one NVRTC module: a family source (``attention_fwd.cu``),
the macro values that specialise it, and the kernel name expressions it
exports. Op modules register the variants they may launch at import time, so
``compile_all(arch)`` can build all of them without a GPU.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

# Modules whose import registers kernel variants.
_OP_MODULES = (
    "mate_cupy.util_ops",
    "mate_cupy.msa.attention_launch",
    "mate_cupy.msa.index_launch",
    "mate_cupy.kda.decode_launch",
    "mate_cupy.kda.chunk_launch",
)


@dataclass(frozen=True)
class KernelSpec:
    """One compiled module: ``source`` + ``defines`` exporting ``kernels``."""

    source: str
    kernels: tuple
    defines: tuple = ()
    min_sm: int = 80  # lowest compute capability the variant builds for (fp8 mma: 89, wgmma: 90)
    only_arch: str = ""  # the one target it builds for ("sm_90a": wgmma/TMA), "" for min_sm or newer

    @property
    def requirement(self) -> str:
        """What the variant needs, in words: ``"sm_90a only"`` or ``"sm_80 or newer"``."""
        return f"{self.only_arch} only" if self.only_arch else f"sm_{self.min_sm} or newer"

    def builds_for(self, arch: str) -> bool:
        """Whether the variant targets ``arch`` (``"sm_100"``, ``"sm_90a"``, ...).

        An ``only_arch`` variant (wgmma, TMA: ``sm_90a``) builds for exactly that target,
        never for a newer one (sm_100 and sm_120 have no wgmma); the others for every
        target of compute capability ``min_sm`` or above.
        """
        if self.only_arch:
            return arch == self.only_arch
        return arch_capability(arch) >= self.min_sm

    @property
    def name(self) -> str:
        """Readable name spelling every compile-time choice."""
        stem = self.source.rsplit(".", 1)[0]
        if not self.defines:
            return stem
        return stem + "[" + ",".join(f"{k}={v}" for k, v in self.defines) + "]"

    def prelude(self) -> str:
        return "".join(f"#define {k} {v}\n" for k, v in self.defines)


def arch_capability(arch: str) -> int:
    """'sm_90a' -> 90, 'sm_120' -> 120."""
    return int("".join(c for c in str(arch).split("_", 1)[-1] if c.isdigit()))


#: The target of the Hopper-only variants (wgmma, TMA): arch-specific, so never built for sm_100/sm_120.
SM90A = "sm_90a"

_REGISTRY: dict = {}


def register(source: str, kernels, *, min_sm: int = 80, only_arch: str = "", **defines) -> KernelSpec:
    """Register (or look up) the variant ``source`` specialised by ``defines``.

    ``min_sm`` is the lowest compute capability the variant targets (e.g. 89 for fp8
    mma.sync); ``only_arch`` names the one target an arch-specific variant builds for
    (``"sm_90a"`` for wgmma/TMA; its ``min_sm`` is then that target's capability).
    ``compile_all`` skips a variant for every target it does not build for.
    """
    if isinstance(kernels, str):
        kernels = (kernels,)
    if only_arch:
        min_sm = arch_capability(only_arch)
    spec = KernelSpec(source, tuple(kernels), tuple(sorted((k, str(v)) for k, v in defines.items())), int(min_sm),
                      str(only_arch))
    return _REGISTRY.setdefault(spec.name + "|" + ",".join(spec.kernels), spec)


def registered() -> list:
    """Every registered variant (imports the op modules that declare them)."""
    for mod in _OP_MODULES:
        importlib.import_module(mod)
    return sorted(_REGISTRY.values(), key=lambda s: (s.source, s.name, s.kernels))
