"""``torch.ops.mate_cupy`` on CUDA tensors: opcheck, ``torch.compile(fullgraph=True)`` (inductor)
and ``mode="reduce-overhead"`` (CUDA graphs), against the float64 references.

The cases are those of ``tests/test_torch_ops.py`` with their tensors on the GPU (eager plans
uploaded when built); outputs given as ``out=`` are poisoned with NaN before the launch.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_rel
from msa_cases import make_problem

import mate_cupy as mc

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.torch,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")]

from test_torch_ops import (  # noqa: E402
    CASES, COMPILE_CASES, MUTATED_INPUTS, clone_all, decode_inputs, metadata, nan_like, opcheck_case, tops, tt,
)

DEV = "cuda"


def close(got, ref, what: str = "") -> None:
    """A GPU result against its float64 reference: integers exactly, floats within a relative RMS
    error (2e-2 for 16-bit results, 1e-2 for float32 ones: KDA states accumulate over tokens)."""
    ref_np = ref.detach().cpu() if isinstance(ref, torch.Tensor) else np.asarray(ref)
    if got.dtype in (torch.int32, torch.int64):
        np.testing.assert_array_equal(got.cpu().numpy(), np.asarray(ref_np), err_msg=what)
        return
    assert tuple(got.shape) == tuple(ref_np.shape), (what, got.shape, ref_np.shape)
    assert_rel(got, ref_np, 1e-2 if got.dtype == torch.float32 else 2e-2, what)


def close_all(results, reference, what: str) -> None:
    assert len(results) == len(reference)
    for i, (r, e) in enumerate(zip(results, reference)):
        close(r, e, f"{what} result {i}")


@pytest.mark.parametrize("name", list(CASES))
def test_eager_matches_reference(name, rng):
    call, inputs, reference = CASES[name](rng, DEV)
    close_all(call(*inputs), reference, name)


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck(name, rng):
    opcheck_case(name, rng, DEV)


@pytest.mark.parametrize("name", COMPILE_CASES)
def test_compile_fullgraph_matches_eager_and_reference(name, rng):
    call, inputs, reference = CASES[name](rng, DEV)
    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True)
    eager_in, compiled_in = clone_all(inputs), clone_all(inputs)
    eager = call(*eager_in)
    got = compiled(*compiled_in)
    close_all(got, reference, f"{name} compiled")
    for g, e in zip(got, eager):
        close(g, e, f"{name} compiled vs eager")
    for i in MUTATED_INPUTS.get(name, ()):
        close(compiled_in[i], eager_in[i], f"{name} in-place input {i}")


def _no_cudagraph_skips():
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"] == 0


class DecodeLayer(torch.nn.Module):
    """One KDA decode step on strided views of a fused projection, state pool as a buffer."""

    def __init__(self, pool, A_log):  # noqa: N803
        super().__init__()
        self.register_buffer("pool", pool)
        self.register_buffer("A_log", A_log)

    def forward(self, qkv, a, b, slots):
        B, H, HV, V = qkv.shape[0], 1, 2, 16  # noqa: N806
        q = qkv[:, :, :H * 128].unflatten(-1, (H, 128))
        k = qkv[:, :, H * 128:2 * H * 128].unflatten(-1, (H, 128))
        v = qkv[:, :, 2 * H * 128:].unflatten(-1, (HV, V))
        out = torch.full((B, 1, HV, V), float("nan"), dtype=qkv.dtype, device=qkv.device)
        o, _ = tops.gated_delta_rule_decode(q, k, v, self.pool, self.A_log, a, None, None, None, b,
                                            state_indices=slots, output=out, inplace_final_state=True)
        return o * 1.0


def _counting(monkeypatch, name: str) -> list:
    """Count the calls of ``tops.<name>`` (the public function an op implementation runs): a
    CUDA-graph replay runs no Python, so replays leave the count unchanged."""
    calls, fn = [], getattr(tops, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    monkeypatch.setattr(tops, name, counted)
    return calls


def test_reduce_overhead_decode_updates_the_pool_as_eager(rng, monkeypatch):
    from torch._dynamo.utils import counters

    x = decode_inputs(rng)
    runs = _counting(monkeypatch, "_decode")
    seen = []
    pool, A_log = tt(x["state"], DEV), tt(x["A_log"], DEV)  # noqa: N806
    eager, graphed = DecodeLayer(pool.clone(), A_log), DecodeLayer(pool.clone(), A_log)
    host_pool = x["state"].copy()
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(graphed, mode="reduce-overhead", fullgraph=True)
    for it in range(4):
        y = decode_inputs(rng)
        qkv_np = np.concatenate([y["q"].reshape(3, 1, -1), y["k"].reshape(3, 1, -1), y["v"].reshape(3, 1, -1)], -1)
        args = (tt(qkv_np, DEV), tt(y["a"], DEV), tt(y["b"], DEV), tt(x["state_indices"], DEV))
        ref, _ = mc.gated_delta_rule_decode(y["q"], y["k"], y["v"], host_pool, x["A_log"], y["a"], None, None, None,
                                            y["b"], state_indices=x["state_indices"], inplace_final_state=True)
        got = step(*args).clone()
        want = eager(*args)
        close(got, ref, f"step {it} output")
        close(got, want, f"step {it} output vs eager")
        close(graphed.pool, host_pool, f"step {it} pool")
        close(graphed.pool, eager.pool, f"step {it} pool vs eager")
        seen.append(len(runs))
    assert _no_cudagraph_skips()
    # warm-up and recording run the op (with the eager steps); later steps replay the graph:
    # only the eager step's call is counted
    assert seen[3] - seen[2] == 1, seen


def _static_paged_problem(rng, kv, n_pages):
    p = make_problem(rng, [1] * len(kv), kv, 8, 2, 128, page_size=64,
                     extra_pages=n_pages - int(sum(-(-k // 64) for k in kv)))
    table = np.zeros((len(kv), 4096 // 64), np.int32)
    table[:, :p.page_table.shape[1]] = np.where(p.page_table >= 0, p.page_table, 0)
    return p, table


def test_reduce_overhead_static_msa_reads_each_calls_metadata(rng, monkeypatch):
    from torch._dynamo.utils import counters

    runs = _counting(monkeypatch, "_msa")
    seen = []
    n_pages = 96
    info = mc.msa_plan(3, 1, 4096, 8, num_kv_heads=2, page_size=64, total_seqlen_k=n_pages * 64)
    mc.upload_plan(info, device=0, head_dim=128, dtype=torch.bfloat16)

    def attend(q, kc, vc, qo, kvl, off, cu_q, cu_k, used, table):
        md = mc.MsaRuntimeMetadata(qo, kvl, off, cu_q, cu_k, used, page_table=table)
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
        res, _ = tops.msa(q, kc, vc, info, out=out, runtime_metadata=md)
        return res * 1.0

    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(attend, mode="reduce-overhead", fullgraph=True)
    for kv in ([1000, 37, 4096], [129, 3000, 64], [1000, 37, 4096], [5, 1, 2048]):
        p, table = _static_paged_problem(rng, kv, n_pages)
        host_md = metadata(p, table=table, torch_tensors=False)
        ref, _ = mc.msa(p.q, p.k_cache, p.v_cache, info, runtime_metadata=host_md)
        md = metadata(p, table=table, dev=DEV)
        args = (tt(p.q, DEV), tt(p.k_cache, DEV), tt(p.v_cache, DEV), md.qo_lens, md.kv_lens, md.qo_offset,
                md.cu_seqlens_q, md.cu_seqlens_k, md.seqused_k, md.page_table)
        close(step(*args).clone(), ref, f"kv lens {kv}")
        seen.append(len(runs))
    assert _no_cudagraph_skips()
    assert seen[3] == seen[2], seen  # the fourth call replays the graph: no Python op run

