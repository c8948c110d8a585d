"""mate_cupy: MiniMax Sparse Attention and Kimi Delta Attention kernels for any DLPack framework.

CUDA arrays (CuPy, torch, JAX) run NVRTC-compiled kernels on the caller's stream;
NumPy (host) arrays run the float64 references. Results come back in the framework
of the first array argument.
"""
from ._version import __version__
from ._logging import get_log_level, set_log_level
from .util_ops import cast
from .msa_interface import *  # noqa: F401,F403
from .msa_interface import __all__ as _msa_all
from .kda_interface import *  # noqa: F401,F403
from .kda_interface import __all__ as _kda_all

__all__ = ["__version__", "cast", "get_log_level", "set_log_level", *_msa_all, *_kda_all]
