"""mate_cupy.distributed on the GPU: the context-parallel ops on CUDA tensors against the
single-process float64 run of the same problem, and merge_state on the device.

One GPU holds every rank: world size 1 runs over NCCL; two and four ranks share the GPU over gloo
(NCCL refuses two ranks on one device). The launcher sets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 for every rank.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from distributed_cases import check_ranks, launch, rel_err, single_process  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

# GPU against float64: bf16 outputs, float32 accumulation and scores, bf16 MMA operands.
# (A wrong entry state is off by more than 0.3: check_ranks asserts that as well.)
GPU_TOL = dict(msa_tol=3e-2, lse_tol=1e-3, kda_tol=5e-2, state_tol=5e-2, exact_selection=False)


@pytest.fixture(scope="module")
def single():
    return single_process()


def test_world_one_nccl(tmp_path, single):
    ranks = launch(1, tmp_path, backend="nccl", device="cuda", timeout=600)
    check_ranks(ranks, 1, single, **GPU_TOL)


def test_two_ranks_gloo_on_cuda_tensors(tmp_path, single):
    ranks = launch(2, tmp_path, backend="gloo", device="cuda", timeout=600)
    check_ranks(ranks, 2, single, **GPU_TOL)


def test_four_ranks_gloo_on_cuda_tensors(tmp_path, single):
    """Chunks of 128 queries; KDA segments of 64, 1, 0 and 165 tokens."""
    ranks = launch(4, tmp_path, backend="gloo", device="cuda", timeout=600)
    check_ranks(ranks, 4, single, **GPU_TOL)


def test_merge_state_on_the_device(rng):
    """torch CUDA and CuPy arrays: the float64 merge to float32 rounding, empty partials 0."""
    import cupy

    from mate_cupy.distributed import merge_state

    n, h, d = 300, 4, 64
    oa, ob = rng.standard_normal((n, h, d)), rng.standard_normal((n, h, d))
    la, lb = 3 * rng.standard_normal((n, h)), 3 * rng.standard_normal((n, h))
    la[:10] = -np.inf
    lb[5:15] = -np.inf
    oa[:10] = np.nan  # never read
    ro, rl = merge_state(oa, la, ob, lb)
    assert np.isneginf(rl[5:10]).all() and (ro[5:10] == 0).all()
    t = lambda x: torch.from_numpy(x).to("cuda", torch.float32)  # noqa: E731
    o, lse = merge_state(t(oa), t(la), t(ob), t(lb))
    assert o.is_cuda and o.dtype == torch.float32
    fin = np.isfinite(rl)
    assert rel_err(o.cpu().numpy(), ro) < 1e-6
    assert rel_err(lse.cpu().numpy()[fin], rl[fin]) < 1e-6 and np.isneginf(lse.cpu().numpy()[~fin]).all()
    c = lambda x: cupy.asarray(x, dtype=cupy.float32)  # noqa: E731
    o, lse = merge_state(c(oa), c(la), c(ob), c(lb))
    assert isinstance(o, cupy.ndarray)
    assert rel_err(o.get(), ro) < 1e-6
    assert rel_err(lse.get()[fin], rl[fin]) < 1e-6
