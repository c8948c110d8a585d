"""Float64 NumPy references: ``reference.msa`` (attention, max score, top-k) and ``reference.kda``."""
from .msa import block_softmax_mass

__all__ = ["block_softmax_mass"]
