"""NVRTC kernel loader: sources, variant registry, compilation and launch."""
from .compiler import (
    KernelCompileError,
    arch_for_capability,
    compile_all,
    compile_variant,
    device_arch,
    get_kernel,
    launch,
)
from .registry import KernelSpec, register, registered
from .sources import expand_source, source_text

__all__ = [
    "KernelCompileError", "KernelSpec", "arch_for_capability", "compile_all", "compile_variant",
    "device_arch", "expand_source", "get_kernel", "launch", "register", "registered", "source_text",
]
