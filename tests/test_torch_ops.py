"""``torch.ops.mate_cupy``: opcheck, ``torch.compile(fullgraph=True)`` and eager results on CPU tensors.

CPU tensors run the float64 references, so every op result is compared with the public
function's result on the same NumPy inputs. Compiles use ``backend="aot_eager"`` (Dynamo
and AOTAutograd with the fake implementations, no C++ compiler).
"""
from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from msa_cases import BF16, make_problem, random_selection

import mate_cupy as mc

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from mate_cupy.integrations import torch_ops as tops  # noqa: E402

F32 = np.float32


def tt(a: np.ndarray, dev: str = "cpu"):
    """A torch tensor copy of a NumPy array on ``dev`` (bfloat16 kept)."""
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(dev)
    return torch.from_numpy(a.copy()).to(dev)


def nan_like(shape, dtype, like):
    """A tensor of NaN on ``like``'s device (an output poisoned before the launch)."""
    return torch.full(shape, float("nan"), dtype=dtype, device=like.device)


def plan_device(dev: str):
    """The ``device=`` of an eager plan for inputs on ``dev`` (uploaded to the GPU for CUDA)."""
    return "cpu" if dev == "cpu" else 0


def to_np(x) -> np.ndarray:
    x = x.detach().cpu()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def same(a, b) -> None:
    """Equal values (NaN where NaN) and dtypes; ``a`` a torch tensor, ``b`` NumPy or torch."""
    b = to_np(b) if isinstance(b, torch.Tensor) else b
    a = to_np(a)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    np.testing.assert_array_equal(a.astype(np.float64), b.astype(np.float64))


def metadata(p, page=None, table=None, dev="cpu", torch_tensors=True):
    conv = (lambda x: tt(x, dev)) if torch_tensors else (lambda x: x)
    i32 = lambda x: conv(np.asarray(x, np.int32))  # noqa: E731
    extra = {}
    if table is not None:
        extra["page_table"] = i32(table)
    elif page is not None:
        extra["kv_page_indptr"] = i32(np.concatenate([[0], np.cumsum(-(-p.kv // page))]))
    return mc.MsaRuntimeMetadata(qo_lens=i32(p.qo), kv_lens=i32(p.kv), qo_offset=i32(p.kv - p.qo),
                                 cu_seqlens_q=i32(p.cu_q), cu_seqlens_k=i32(p.cu_k), seqused_k=i32(p.kv), **extra)


# ----------------------------------------------------------------------------- cases
# Each case returns (call, inputs, reference): call(*inputs) -> tuple of tensors (results, and
# in-place buffers after the call); reference: the same results from the public function on
# NumPy arrays. ``dev``: where the tensors live. Fresh inputs per case; call keeps no state.


def case_msa_dense(rng, dev):
    p = make_problem(rng, [3, 40], [70, 40], 4, 2, 64)
    info = mc.msa_plan_from_lengths(p.qo, p.kv, 4, 2, output_maxscore=True, device=plan_device(dev))
    lse_ref = np.empty((p.total_q, 4), F32)
    ref = mc.msa(p.q, p.k, p.v, info, lse=lse_ref)

    def call(q, k, v):
        lse = nan_like((q.shape[0], 4), torch.float32, q)
        out, ms = tops.msa(q, k, v, info, lse=lse)
        return out, ms, lse
    return call, (tt(p.q, dev), tt(p.k, dev), tt(p.v, dev)), (*ref, lse_ref)


def case_msa_paged_static_out(rng, dev):
    p = make_problem(rng, [1, 1, 1], [130, 9, 256], 8, 2, 64, page_size=64)
    info = mc.msa_plan(3, 1, 256, 8, num_kv_heads=2, page_size=64, total_seqlen_k=p.k_cache.shape[0] * 64)
    ref, _ = mc.msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices,
                    runtime_metadata=metadata(p, page=64, torch_tensors=False))
    md = metadata(p, page=64, dev=dev)

    def call(q, kc, vc, idx):
        out = nan_like(q.shape, q.dtype, q)
        res, ms = tops.msa(q, kc, vc, info, kv_indices=idx, out=out, runtime_metadata=md)
        assert res is out and ms is None
        return (out,)
    return call, tuple(tt(a, dev) for a in (p.q, p.k_cache, p.v_cache, p.kv_indices)), (ref,)


def case_sparse_msa(rng, dev):
    p = make_problem(rng, [40], [300], 16, 2, 128, page_size=128)
    info = mc.sparse_msa_plan(p.qo, p.kv, 16, 2, page_size=128, kv_block_num=4, device=plan_device(dev))
    sel = random_selection(rng, p, 4)
    ref = mc.sparse_msa(p.q, p.k_cache, p.v_cache, info, kv_indices=p.kv_indices, kv_block_indexes=sel,
                        output_maxscore=True)

    def call(q, kc, vc, idx, s):
        return tops.sparse_msa(q, kc, vc, info, kv_indices=idx, kv_block_indexes=s, output_maxscore=True)
    return call, tuple(tt(a, dev) for a in (p.q, p.k_cache, p.v_cache, p.kv_indices, sel)), ref


def case_sparse_decode_static(rng, dev):
    p = make_problem(rng, [1, 1], [300, 129], 16, 1, 128, page_size=128)
    info = mc.msa_plan(2, 1, 384, 16, num_kv_heads=1, page_size=128, kv_block_num=4, total_seqlen_k=1024)
    table = np.where(p.page_table >= 0, p.page_table, 0).astype(np.int32)
    table = np.pad(table, ((0, 0), (0, 3 - table.shape[1])))
    sel = random_selection(rng, p, 4)
    ref = mc.sparse_decode_atten_func(p.q, p.k_cache, p.v_cache, info, kv_block_indexes=sel,
                                      runtime_metadata=metadata(p, table=table, torch_tensors=False),
                                      return_softmax_lse=True)
    md = metadata(p, table=table, dev=dev)

    def call(q, kc, vc, s):
        return tops.sparse_decode_atten_func(q, kc, vc, info, kv_block_indexes=s, runtime_metadata=md,
                                             return_softmax_lse=True)
    return call, tuple(tt(a, dev) for a in (p.q, p.k_cache, p.v_cache, sel)), ref


def case_pipeline(rng, dev):
    from test_msa_pipeline import index_branch

    p = make_problem(rng, [1, 2, 150], [300, 129, 700], 16, 2, 128, page_size=128)
    iq, _, icache = index_branch(rng, p)
    kw = dict(topk=4, force_begin_blocks=1, force_end_blocks=1)
    ref = mc.sparse_attention_pipeline(p.q, p.k_cache, p.v_cache, iq, icache,
                                       mc.sparse_pipeline_plan(p.qo, p.kv, 16, 2, device="cpu", **kw),
                                       kv_indices=p.kv_indices)
    plan = mc.sparse_pipeline_plan(p.qo, p.kv, 16, 2, device=plan_device(dev), **kw)

    def call(q, kc, vc, iq, ik, idx):
        return tops.sparse_attention_pipeline(q, kc, vc, iq, ik, plan, kv_indices=idx)
    return call, tuple(tt(a, dev) for a in (p.q, p.k_cache, p.v_cache, iq, icache, p.kv_indices)), ref


def case_topk(rng, dev):
    scores = rng.standard_normal((5, 4, 24)).astype(F32)
    pos = rng.integers(0, 24 * 128, 5).astype(np.int64)
    ref_a = mc.sparse_topk_select(scores, 8, force_begin_blocks=1)
    ref_b = mc.sparse_topk_select(scores, 4, force_end_blocks=1, query_positions=pos)

    def call(s, qp):
        out = torch.full((5, 4, 4), -7, dtype=torch.int32, device=s.device)
        res = tops.sparse_topk_select(s, 4, output=out, force_end_blocks=1, query_positions=qp)
        assert res is out
        return tops.sparse_topk_select(s, 8, force_begin_blocks=1), out
    return call, (tt(scores, dev), tt(pos, dev)), (ref_a, ref_b)


def case_page_table(rng, dev):
    lens = np.array([130, 0, 513], np.int64)
    idx = rng.permutation(20)[:2 + 0 + 5].astype(np.int64)
    ref = mc.build_page_table_from_flat_kv_indices(idx, lens, 128)

    def call(i, n):
        return (tops.build_page_table_from_flat_kv_indices(i, n, 128),)
    return call, (tt(idx, dev), tt(lens, dev)), (ref,)


def case_cast(rng, dev):
    x = (rng.standard_normal((33, 16)) * 40).astype(F32)
    ref_a = mc.cast(x, "bfloat16", 0.5)
    ref_b = mc.cast(x, "float16")

    def call(t):
        out = nan_like(t.shape, torch.float16, t)
        assert tops.cast(t, torch.float16, out=out) is out
        return tops.cast(t, torch.bfloat16, 0.5), out
    return call, (tt(x, dev),), (ref_a, ref_b)


def chunk_inputs(rng):
    B, T, H, HV = 1, 20, 1, 2
    g = (-np.abs(rng.standard_normal((B, T, HV, 128))) * 0.2).astype(BF16)
    x = [rng.standard_normal((B, T, H, 128)).astype(BF16), rng.standard_normal((B, T, H, 128)).astype(BF16),
         rng.standard_normal((B, T, HV, 128)).astype(BF16), g, rng.standard_normal((B, T, HV)).astype(BF16),
         (0.5 * rng.standard_normal((B, HV, 128, 128))).astype(F32)]
    return x


def case_chunk_kda(rng, dev):
    q, k, v, g, beta, s0 = chunk_inputs(rng)
    ref = mc.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)

    def call(q, k, v, g, beta, s0):
        return tops.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    return call, tuple(tt(a, dev) for a in (q, k, v, g, beta, s0)), ref


def case_chunk_kda_out(rng, dev):
    q, k, v, g, beta, s0 = chunk_inputs(rng)
    ref = mc.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)

    def call(q, k, v, g, beta, s0):
        out, fs = nan_like(v.shape, v.dtype, v), nan_like(s0.shape, torch.float32, v)
        res = tops.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, output=out,
                             final_state=fs)
        assert res[0] is out and res[1] is fs
        return out, fs
    return call, tuple(tt(a, dev) for a in (q, k, v, g, beta, s0)), ref


def decode_inputs(rng, B=3, P=5, H=1, HV=2, V=16):
    return dict(
        q=rng.standard_normal((B, 1, H, 128)).astype(BF16), k=rng.standard_normal((B, 1, H, 128)).astype(BF16),
        v=rng.standard_normal((B, 1, HV, V)).astype(BF16),
        state=(0.5 * rng.standard_normal((P, HV, V, 128))).astype(F32),
        A_log=rng.uniform(-1, 1, HV).astype(F32), a=rng.standard_normal((B, 1, HV, 128)).astype(BF16),
        b=rng.uniform(-2, 2, (B, 1, HV)).astype(BF16), state_indices=np.array([4, 0, 2], np.int32))


def case_decode(rng, dev):
    x = decode_inputs(rng)
    names = ("q", "k", "v", "state", "A_log", "a", "b", "state_indices")
    ref = mc.gated_delta_rule_decode(x["q"], x["k"], x["v"], x["state"], x["A_log"], x["a"], None, None, None,
                                     x["b"], state_indices=x["state_indices"], store_final_state=True)

    def call(q, k, v, state, A_log, a, b, idx):  # noqa: N803
        return tops.gated_delta_rule_decode(q, k, v, state, A_log, a, None, None, None, b, state_indices=idx,
                                            store_final_state=True)
    return call, tuple(tt(x[n], dev) for n in names), ref


def case_decode_inplace(rng, dev):
    x = decode_inputs(rng)
    names = ("q", "k", "v", "state", "A_log", "a", "b", "state_indices")
    pool = x["state"].copy()
    out_ref, _ = mc.gated_delta_rule_decode(x["q"], x["k"], x["v"], pool, x["A_log"], x["a"], None, None, None,
                                            x["b"], state_indices=x["state_indices"], inplace_final_state=True)

    def call(q, k, v, state, A_log, a, b, idx):  # noqa: N803
        out = nan_like(v.shape, torch.bfloat16, v)
        res, fs = tops.gated_delta_rule_decode(q, k, v, state, A_log, a, None, None, None, b, state_indices=idx,
                                               output=out, inplace_final_state=True)
        assert res is out and fs is state
        return out, state
    return call, tuple(tt(x[n], dev) for n in names), (out_ref, pool)


CASES = {
    "msa_dense": case_msa_dense, "msa_paged_static_out": case_msa_paged_static_out, "sparse_msa": case_sparse_msa,
    "sparse_decode_static": case_sparse_decode_static, "sparse_topk_select": case_topk,
    "build_page_table": case_page_table, "cast": case_cast, "chunk_kda": case_chunk_kda,
    "chunk_kda_out": case_chunk_kda_out, "gated_delta_rule_decode": case_decode,
    "sparse_attention_pipeline": case_pipeline,
    "gated_delta_rule_decode_inplace": case_decode_inplace,
}
# build_page_table's output width is data-dependent: test_page_table_compiles compiles it.
COMPILE_CASES = [name for name in CASES if name != "build_page_table"]
# The in-place buffers of a case (indices into its inputs) that a call mutates.
MUTATED_INPUTS = {"gated_delta_rule_decode_inplace": (3,)}


def clone_all(inputs):
    return tuple(x.clone() for x in inputs)


def check_all(results, reference):
    assert len(results) == len(reference)
    for r, e in zip(results, reference):
        same(r, e)


class OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ``mate_cupy`` ops a call dispatches (for opcheck)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "mate_cupy":
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


@pytest.mark.parametrize("name", list(CASES))
def test_eager_equals_reference(name, rng):
    call, inputs, reference = CASES[name](rng, "cpu")
    check_all(call(*inputs), reference)


def opcheck_case(name, rng, dev):
    """``torch.library.opcheck`` of every ``mate_cupy`` op the case ``name`` dispatches on ``dev``."""
    call, inputs, _ = CASES[name](rng, dev)
    with OpRecorder() as rec:
        call(*clone_all(inputs))
    assert rec.calls
    for func, args, kwargs in rec.calls:
        torch.library.opcheck(func, args, kwargs)


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck(name, rng):
    opcheck_case(name, rng, "cpu")


@pytest.mark.parametrize("name", COMPILE_CASES)
def test_compile_fullgraph_equals_eager(name, rng):
    call, inputs, reference = CASES[name](rng, "cpu")
    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    eager_in, compiled_in = clone_all(inputs), clone_all(inputs)
    eager = call(*eager_in)
    got = compiled(*compiled_in)
    check_all(got, reference)
    check_all(got, eager)
    for i in MUTATED_INPUTS.get(name, ()):
        same(compiled_in[i], eager_in[i])


def test_page_table_compiles(rng):
    call, inputs, reference = case_page_table(rng, "cpu")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        got = torch.compile(call, fullgraph=True, backend="aot_eager")(*inputs)
    check_all(got, reference)


def test_no_graph_break_in_a_module():
    """A module calling a static-plan MSA and an in-place KDA decode compiles as one graph."""

    class Layer(torch.nn.Module):
        def __init__(self, plan, md):
            super().__init__()
            self.plan, self.md = plan, md

        def forward(self, q, k, v, pool, a, b, idx):
            o, _ = tops.msa(q, k, v, self.plan, runtime_metadata=self.md)
            d, _ = tops.gated_delta_rule_decode(q[:3, None, :1].contiguous(), q[:3, None, 1:2].contiguous(),
                                                o[:3, None, :2, :16].contiguous(), pool, None, a, None, None,
                                                None, b, state_indices=idx, inplace_final_state=True)
            return o, d

    rng = np.random.default_rng(7)
    p = make_problem(rng, [2, 1, 3], [9, 1, 20], 2, 2, 128)
    info = mc.msa_plan(3, 4, 32, 2, total_seqlen_k=64)
    md = metadata(p)
    x = decode_inputs(rng)
    inputs = (tt(p.q), tt(p.k), tt(p.v), tt(x["state"]), tt(x["a"]), tt(x["b"]), tt(x["state_indices"]))
    layer = Layer(info, md)
    explain = torch._dynamo.explain(layer)(*clone_all(inputs))
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    eager_in, compiled_in = clone_all(inputs), clone_all(inputs)
    eager = layer(*eager_in)
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(*compiled_in)
    check_all(got, eager)
    same(compiled_in[3], eager_in[3])
    assert not torch.equal(eager_in[3], inputs[3])  # the pool was written


def test_plan_handles_are_stable_and_freed_with_the_plan():
    import gc

    info = mc.msa_plan(2, 4, 32, 2, total_seqlen_k=64)
    h = tops.register_plan(info)
    assert tops.register_plan(info) == h == tops.register_plan(info[3])
    mixed = mc.msa_plan_from_lengths([1, 200], [10, 200], 2, 2, device="cpu")
    assert mixed[0]
    hm = tops.register_plan(mixed)
    assert hm != h and tops._plan_info(hm)[4] is mixed[4]
    del info
    gc.collect()
    assert h not in tops._PLANS
    with pytest.raises(ValueError, match="no live MSA plan"):
        tops._plan_info(h)
    assert tops.register_plan(mixed) == hm


def test_import_without_torch_names_the_install():
    code = ("import sys; sys.modules['torch'] = None\n"
            "try:\n    import mate_cupy.integrations.torch_ops\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "PyTorch" in out and "pip install" in out


def test_each_plan_object_keeps_its_handle_under_compile(rng):
    """A compiled function called with another plan uses that plan (Dynamo guards on the plan)."""
    p = make_problem(rng, [3, 4], [9, 30], 2, 2, 64)
    plans = [mc.msa_plan_from_lengths(p.qo, kv, 2, 2, device="cpu") for kv in ([9, 30], [3, 12], [9, 30])]
    fn = torch.compile(lambda q, k, v, info: tops.msa(q, k, v, info)[0], fullgraph=True, backend="aot_eager")
    q, k, v = tt(p.q), tt(p.k), tt(p.v)
    for info in plans + plans[:1]:
        same(fn(q, k, v, info), mc.msa(p.q, p.k, p.v, info)[0])
    assert len({tops.register_plan(info) for info in plans}) == 3


def test_a_copied_plan_gets_its_own_handle():
    import copy

    import mate_cupy as mc
    from mate_cupy.integrations import torch_ops

    plan = mc.msa_plan_from_lengths([3, 5], [7, 9], 4, 2, device="cpu")
    h = torch_ops.register_plan(plan)
    dup = plan[:3] + (copy.copy(plan[3]), plan[4])  # the part object copied, its handle attribute too
    assert torch_ops._plan(dup)[0] != h and torch_ops._plan(plan)[0] == h


def test_plans_built_after_import_are_registered_when_built():
    import mate_cupy as mc
    from mate_cupy.integrations import torch_ops

    plan = mc.msa_plan_from_lengths([3, 5], [7, 9], 4, 2, device="cpu")
    static = mc.msa_plan(2, 1, 256, 4, total_seqlen_k=512, num_kv_heads=2)
    for info in (plan, static):
        handle = info[3].__dict__.get("_torch_op_handle")
        assert isinstance(handle, int) and torch_ops._plan(info)[0] == handle
        assert torch_ops._plan_info(handle)[3] is info[3]
