"""Pieces shared by the two KDA ops: dtype sets and varlen views."""
from __future__ import annotations

from ..runtime.interop import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, INT32, INT64, dtype_name

HALF_DTYPES = (FLOAT16, BFLOAT16)
INDEX_DTYPES = (INT32, INT64)
FLOAT_DTYPES = (FLOAT16, BFLOAT16, FLOAT32, FLOAT64)


def names(dtypes) -> str:
    return " or ".join(dtype_name(d) for d in dtypes)


def with_batch(x, add: bool):
    """``x[None]`` (a view, any strides) when ``add``, else ``x``."""
    return x[None] if add else x
