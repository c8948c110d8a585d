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

    @property
    def name(self) -> str:
        """Readable name spelling every compile-time choice."""
        stem = self.source.rsplit(".", 1)[0]
        if not self.defines:
            return stem
        return stem + "[" + ",".join(f"{k}={v}" for k, v in self.defines) + "]"

    def prelude(self) -> str:
        return "".join(f"#define {k} {v}\n" for k, v in self.defines)


_REGISTRY: dict = {}


def register(source: str, kernels, *, min_sm: int = 80, **defines) -> KernelSpec:
    """Register (or look up) the variant ``source`` specialised by ``defines``.

    ``min_sm`` is the lowest compute capability the variant targets (e.g. 89 for fp8
    mma.sync, 90 for wgmma); ``compile_all`` skips it for older archs.
    """
    if isinstance(kernels, str):
        kernels = (kernels,)
    spec = KernelSpec(source, tuple(kernels), tuple(sorted((k, str(v)) for k, v in defines.items())), int(min_sm))
    return _REGISTRY.setdefault(spec.name + "|" + ",".join(spec.kernels), spec)


def registered() -> list:
    """Every registered variant (imports the op modules that declare them)."""
    for mod in _OP_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:  # a family not written yet
            if e.name != mod:
                raise
    return sorted(_REGISTRY.values(), key=lambda s: (s.source, s.name, s.kernels))
