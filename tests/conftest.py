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


def pytest_configure(config):
    """Under pytest-xdist (``-n N`` on the controller, before the workers start), give every
    worker its share of the cores for BLAS unless the caller set the thread counts: the
    workers inherit this environment, and each one's float64 references would otherwise
    start one BLAS thread per core (N x cores threads, which slowed GPU runs several-fold)."""
    n = getattr(config.option, "numprocesses", None)
    if os.environ.get("PYTEST_XDIST_WORKER") or not n:
        return
    cores = os.cpu_count() or 1
    workers = n if isinstance(n, int) else cores  # "auto" / "logical": about one per core
    if workers > 1:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, str(max(1, cores // workers)))


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
