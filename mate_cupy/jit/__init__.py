"""NVRTC kernel loader: sources, variant registry, compilation, loading and launch."""
from .compiler import (
    MIN_SM,
    Kernel,
    KernelCompileError,
    UnsupportedArchError,
    arch_for_capability,
    compile_all,
    compile_variant,
    device_arch,
    get_kernel,
    load,
    normalize_arch,
)
from .launch import KernelParams, PreparedLaunch, Source, address, launch
from .registry import SM90A, KernelSpec, arch_capability, register, registered
from .sources import expand_source, source_text

__all__ = [
    "MIN_SM", "SM90A", "Kernel", "KernelCompileError", "KernelParams", "KernelSpec", "PreparedLaunch", "Source",
    "UnsupportedArchError", "address",
    "arch_capability", "arch_for_capability", "compile_all", "compile_variant", "device_arch", "expand_source",
    "get_kernel", "launch", "load", "normalize_arch", "register", "registered", "source_text",
]
