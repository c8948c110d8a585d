"""Memory soak (``-m gpu``): 10,000 calls over varied shapes and plans; device memory stays bounded.

Every op is called with fresh shapes and, for MSA, a fresh eager plan per call. The library
keeps no device memory across calls (plans and workspaces own theirs and free it with
them), so once every result and plan is dropped, the memory CuPy's pool and torch's
allocator hold in use returns to where it was before the loop.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

import mate_cupy as mc

pytestmark = pytest.mark.gpu

CALLS = 10_000


def _in_use():
    import cupy

    return cupy.get_default_memory_pool().used_bytes()


def _ops(rng):
    """Callables that each make one public call on new shapes and return nothing."""
    import cupy

    def randn(*shape, dtype=np.float16):
        return cupy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    K = 128
    pool = cupy.asarray(rng.standard_normal((64, 2, K, K)).astype(np.float32) * 0.05)
    hq, hkv, d, page = 16, 1, 128, 128

    def kda_decode(i):
        b = 1 + i % 32
        h, hv = 1, 2
        out, _ = mc.gated_delta_rule_decode(
            randn(b, 1, h, K), randn(b, 1, h, K), randn(b, 1, hv, K), pool, None, randn(b, 1, hv, K),
            None, None, None, randn(b, 1, hv), state_indices=cupy.arange(b, dtype=cupy.int32),
            inplace_final_state=True)
        del out

    def kda_chunk(i):
        t = 1 + (i * 37) % 300
        o = mc.chunk_kda(randn(1, t, 1, K), randn(1, t, 1, K), randn(1, t, 2, K),
                         -cupy.abs(randn(1, t, 2, K)) * 0.1, randn(1, t, 2))
        del o

    def topk(i):
        rows, nt = 1 + i % 17, 4 + (i * 7) % 300
        sel = mc.sparse_topk_select(cupy.asarray(rng.standard_normal((rows, 2, nt)).astype(np.float32)), 4)
        del sel

    def dense(i):
        qo = [1 + (i % 5) * 13, 1 + (i % 3)]
        kv = [q + (i * 11) % 200 for q in qo]
        plan = mc.msa_plan_from_lengths(np.array(qo), np.array(kv), hq, hkv)
        out, _ = mc.msa(randn(sum(qo), hq, d), randn(sum(kv), hkv, d), randn(sum(kv), hkv, d), plan)
        del out, plan

    def sparse_decode(i):
        b = 1 + i % 4
        kv = np.array([129 + (i * 53 + 97 * j) % 2000 for j in range(b)], np.int32)
        pages = -(-kv // page)
        n_pages = int(pages.sum())
        plan = mc.msa_plan_from_lengths(np.ones(b, np.int32), kv, hq, hkv, page_size=page, kv_block_num=4)
        kbi = cupy.full((b, hkv, 4), -1, dtype=cupy.int32)
        kbi[:, :, 0] = 0
        cache = randn(n_pages, page, hkv, d)
        out = mc.sparse_decode_atten_func(randn(b, hq, d), cache, cache, plan,
                                          kv_indices=cupy.arange(n_pages, dtype=cupy.int32), kv_block_indexes=kbi)
        del out, plan

    return [kda_decode, kda_chunk, topk, dense, sparse_decode]


def test_memory_stays_bounded_over_10000_calls(rng):
    import cupy

    ops = _ops(rng)
    for i, op in enumerate(ops * 4):  # warm: every kernel loaded, the pool primed
        op(i)
    cupy.cuda.runtime.deviceSynchronize()
    gc.collect()
    before = _in_use()
    peak = 0
    for i in range(CALLS):
        ops[i % len(ops)](i)
        if i % 500 == 0:
            peak = max(peak, _in_use())
    cupy.cuda.runtime.deviceSynchronize()
    gc.collect()
    after = _in_use()
    assert after <= before + (1 << 20), f"device memory in use grew from {before} to {after} bytes"
    assert peak <= before + (256 << 20), f"device memory in use peaked at {peak} bytes (start {before})"
