"""NVRTC kernel loader: sources, variant registry, compilation, loading and launch."""
from .compiler import (
    Kernel,
    KernelCompileError,
    arch_for_capability,
    compile_all,
    compile_variant,
    device_arch,
    get_kernel,
    load,
)
from .launch import KernelParams, address, launch
from .registry import KernelSpec, register, registered
from .sources import expand_source, source_text

__all__ = [
    "Kernel", "KernelCompileError", "KernelParams", "KernelSpec", "address", "arch_for_capability", "compile_all",
    "compile_variant", "device_arch", "expand_source", "get_kernel", "launch", "load", "register", "registered",
    "source_text",
]
