"""Shared pytest set-up: GPU/torch markers skip when the hardware or package is absent."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401

        return True
    except Exception:
        return False


HAS_GPU = _has_gpu()
HAS_TORCH = _has_torch()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with CuPy")
    skip_torch = pytest.mark.skip(reason="needs PyTorch")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "torch" in item.keywords and not HAS_TORCH:
            item.add_marker(skip_torch)


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test id (reproducible, distinct)."""
    import zlib

    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
