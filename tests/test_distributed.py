"""mate_cupy.distributed on CPU: merge_state, zig-zag sharding, and context-parallel MSA and
KDA prefill on 2-4 gloo processes against a single-process run of the same problem.

The ranks run on CPU torch tensors, so every op is the float64 reference rounded once into
its output dtype: a rank's results must equal the single-process results up to that
rounding (and, for KDA, the float32 segment maps).
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from distributed_cases import check_ranks, launch, single_process  # noqa: E402
from distributed_cases import rel_err as _err  # noqa: E402

pytestmark = pytest.mark.torch


# ----------------------------------------------------------------------------- merge_state


def _partials(rng, n=5, h=3, d=16, nk=40, m=17):
    """Attention of n queries over nk keys, and its two partials over keys [0, m) and [m, nk)."""
    from mate_cupy.reference.msa import dense_attention

    q, k, v = rng.standard_normal((n, h, d)), rng.standard_normal((nk, h, d)), rng.standard_normal((nk, h, d))
    cu = lambda x: np.array([0, x])  # noqa: E731
    full = dense_attention(q, k, v, cu(n), cu(nk), causal=False)
    a = dense_attention(q, k[:m], v[:m], cu(n), cu(m), causal=False)
    b = dense_attention(q, k[m:], v[m:], cu(n), cu(nk - m), causal=False)
    return full, a, b


def test_merge_state_numpy_is_attention_over_the_union(rng):
    from mate_cupy.distributed import merge_state

    (of, lf), (oa, la), (ob, lb) = _partials(rng)
    o, lse = merge_state(oa, la, ob, lb)
    assert o.dtype == np.float64 and lse.dtype == np.float64
    assert _err(o, of) < 1e-13 and _err(lse, lf) < 1e-13
    o2, lse2 = merge_state(ob, lb, oa, la)  # symmetric
    assert _err(o2, of) < 1e-13 and _err(lse2, lf) < 1e-13


def test_merge_state_natural_log_convention(rng):
    """lse is natural-log: merging two equal partials adds log(2)."""
    from mate_cupy.distributed import merge_state

    o = rng.standard_normal((2, 2, 8))
    lse = rng.standard_normal((2, 2))
    om, lm = merge_state(o, lse, o, lse)
    np.testing.assert_allclose(lm, lse + np.log(2.0), rtol=0, atol=1e-14)
    np.testing.assert_allclose(om, o, rtol=0, atol=1e-14)


def test_merge_state_empty_partials(rng):
    """lse = -inf is an empty partial: weight 0, its o never read (NaN there stays out)."""
    from mate_cupy.distributed import merge_state

    o = rng.standard_normal((4, 2, 8))
    lse = rng.standard_normal((4, 2))
    lse[0, 0] = -np.inf
    o[0, 0] = 0.0
    nan_o = np.full_like(o, np.nan)
    empty = np.full_like(lse, -np.inf)
    with np.errstate(all="raise"):
        om, lm = merge_state(o, lse, nan_o, empty)
    np.testing.assert_array_equal(om, o)
    np.testing.assert_array_equal(lm, lse)
    om, lm = merge_state(nan_o, empty, nan_o, empty)
    np.testing.assert_array_equal(om, 0.0)
    assert np.isneginf(lm).all()


def test_merge_state_torch_float32_and_dtypes(rng):
    from mate_cupy.distributed import merge_state

    (of, lf), (oa, la), (ob, lb) = _partials(rng)
    t = lambda x, dt: torch.from_numpy(x).to(dt)  # noqa: E731
    o, lse = merge_state(t(oa, torch.bfloat16), t(la, torch.float32), t(ob, torch.bfloat16), t(lb, torch.float32))
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert _err(o.float().numpy(), of) < 1e-2 and _err(lse.numpy(), lf) < 1e-6
    la2 = la.copy()
    la2[1] = -np.inf
    o, lse = merge_state(t(np.full_like(oa, np.nan), torch.float32), t(la2, torch.float32),
                         t(ob, torch.float32), t(lb, torch.float32))
    assert torch.isfinite(o[1]).all()
    assert _err(o[1].numpy(), ob[1]) < 1e-6 and _err(lse[1].numpy(), lb[1]) < 1e-6


def test_merge_state_refusals(rng):
    from mate_cupy.distributed import merge_state

    o, lse = np.zeros((2, 3, 4)), np.zeros((2, 3))
    with pytest.raises(ValueError, match="o_a and o_b"):
        merge_state(o, lse, o[:1], lse)
    with pytest.raises(ValueError, match="lse_b must have shape"):
        merge_state(o, lse, o, lse[:, :2])
    with pytest.raises(TypeError, match="one array library"):
        merge_state(o, lse, torch.from_numpy(o), lse)
    with pytest.raises(TypeError, match="o_b must have o_a's dtype"):
        merge_state(o, lse, o.astype(np.float32), lse)
    with pytest.raises(TypeError, match="floating-point"):
        merge_state(o, lse.astype(np.int32), o, lse)
    with pytest.raises(TypeError, match="NumPy array"):
        merge_state([[[0.0]]], lse, o, lse)


# ----------------------------------------------------------------------------- import, zig-zag


def test_import_without_torch_is_a_clear_error():
    code = ("import sys; sys.modules['torch'] = None\nimport mate_cupy\ntry:\n    import mate_cupy.distributed\n"
            "except ImportError as e:\n    print('ImportError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "ImportError: mate_cupy.distributed needs PyTorch" in out


def test_api_md_documents_every_parameter():
    """docs/api.md has a section `mate_cupy.distributed.<name>` for every public name,
    mentioning every parameter (the rule tests/test_api_docs.py applies to mate_cupy)."""
    import inspect

    import mate_cupy.distributed as D
    from test_api_docs import _sections

    sections = _sections()
    for name in D.__all__:
        text = sections.get(f"mate_cupy.distributed.{name}")
        assert text, f"docs/api.md has no section `mate_cupy.distributed.{name}`"
        obj = getattr(D, name)
        if inspect.isfunction(obj):
            assert (obj.__doc__ or "").strip(), name
            missing = [p for p in inspect.signature(obj).parameters if f"`{p}`" not in text]
            assert not missing, f"section `mate_cupy.distributed.{name}`: parameters not mentioned: {missing}"


def test_zigzag_ranges_shard_and_unshard():
    from mate_cupy.distributed import zigzag_ranges, zigzag_shard, zigzag_unshard

    assert zigzag_ranges(16, 2, 0) == ((0, 4), (12, 16))
    assert zigzag_ranges(16, 2, 1) == ((4, 8), (8, 12))
    x = torch.arange(48).reshape(24, 2)
    for world in (1, 2, 3):
        parts = [zigzag_shard(x, world, r) for r in range(world)]
        assert all(p.shape == (24 // world, 2) for p in parts)
        assert torch.equal(zigzag_unshard(parts), x)
    # every rank holds the same causal work: sum over its queries of (position + 1)
    work = [sum(b * (b + 1) // 2 - a * (a + 1) // 2 for a, b in zigzag_ranges(64, 4, r)) for r in range(4)]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="multiple of 2 \\* world_size"):
        zigzag_ranges(10, 3, 0)
    with pytest.raises(ValueError, match="rank must be"):
        zigzag_ranges(12, 3, 3)


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    """A one-rank gloo process group in this process."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    path = tmp_path_factory.mktemp("pg") / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_plan_refusals(world1):
    from mate_cupy import distributed as D

    with pytest.raises(ValueError, match="multiple of 2 \\* world_size \\* 128"):
        D.cp_attention_plan(200, 8, 1, device="cpu")
    plan = D.cp_attention_plan(256, 8, 1, device="cpu")
    assert (plan.chunk_len, plan.page_size, plan.local_len) == (128, 128, 256)
    dense = D.cp_attention_plan(24, 4, 2, sparse=False, device="cpu")
    assert (dense.chunk_len, dense.page_size) == (12, 4)
    q = torch.zeros(256, 8, 128, dtype=torch.bfloat16)
    kv = torch.zeros(256, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a dense plan"):
        D.cp_dense_attention(q, kv, kv, plan)
    with pytest.raises(ValueError, match=r"q_local must be \[256, 8, D\]"):
        D.cp_sparse_attention(q[:100], kv, kv, kv, kv, plan)
    with pytest.raises(TypeError, match="ContextParallelPlan"):
        D.cp_sparse_attention(q, kv, kv, kv, kv, object())
    with pytest.raises(ValueError, match="dense layout"):
        D.cp_chunk_kda(q, q, q, q, q)


def test_dense_pages_as_wide_as_the_kv_heads(world1):
    """Chunks whose page size equals Hkv (a cache shape that fits both layouts) attend
    correctly: the gathered pages are handed over as an HND view."""
    from mate_cupy import distributed as D
    from mate_cupy.reference import msa as R

    n, h, d = 16, 8, 64
    plan = D.cp_attention_plan(n, h, h, sparse=False, device="cpu")
    assert plan.page_size == h
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, h, d, generator=g).to(torch.bfloat16) for _ in range(3))
    out, _ = D.cp_dense_attention(q, k, v, plan)
    f = lambda t: t.float().numpy().astype(np.float64)  # noqa: E731
    ref, _ = R.dense_attention(f(q), f(k), f(v), np.array([0, n]), np.array([0, n]), qo_offset=[0])
    assert np.abs(out.float().numpy() - ref).max() < 0.02


def test_world_one_matches_the_single_process_ops(world1):
    """With one rank the context-parallel ops are the single-GPU ops on the whole sequence."""
    results = single_process()
    from distributed_cases import run_rank

    res = run_rank(0, 1, "cpu")
    check_ranks([res], 1, results)


# ----------------------------------------------------------------------------- multi-process


@pytest.fixture(scope="module")
def single():
    return single_process()


def test_two_ranks_gloo_match_one_process(tmp_path, single):
    ranks = launch(2, tmp_path, backend="gloo", device="cpu", timeout=180)
    check_ranks(ranks, 2, single)


def test_four_ranks_gloo_match_one_process(tmp_path, single):
    """Four ranks: chunks of 128 queries, KDA segments of 64, 1, 0 and 165 tokens."""
    ranks = launch(4, tmp_path, backend="gloo", device="cpu", timeout=300)
    check_ranks(ranks, 4, single)


@pytest.mark.slow
def test_bench_cpu_smoke(tmp_path):
    """bench/context_parallel.py --device cpu on 1 and 2 gloo ranks writes every row."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(root / "bench" / "context_parallel.py"), str(tmp_path), "--device", "cpu",
                    "--world", "1,2", "--samples", "1", "--timeout", "300"], check=True, timeout=400,
                   cwd=root, capture_output=True)
    rows = json.loads((tmp_path / "results.json").read_text())
    got = {(r["op"], r["world"]) for r in rows}
    assert got == {("msa sparse", 1), ("msa dense", 1), ("kda", 1), ("msa sparse", 2), ("msa dense", 2),
                   ("kda", 2), ("kda 3:1:..:1", 2), ("gather k/v/index", 2)}
    assert all(r["ms"] > 0 for r in rows)
    assert (tmp_path / "results.md").read_text().startswith("| op |")
