"""Prepared launches (KDA decode, MSA calls of one plan part) on the stub device of
bench/host_overhead.py: torch CPU tensors posing as CUDA tensors, the driver launch recorded.

A call that reuses a prepared launch must launch exactly what the call that prepared it
launched (kernel, grid, block, shared memory, stream, packed argument bytes), and that
must be what the unprepared launcher launches; memos are bounded, a refused call is never
stored, and a plan's prepared calls are freed with it.
"""
from __future__ import annotations

import gc
import importlib
import os
import sys
import weakref

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import host_overhead as ho  # noqa: E402

import mate_cupy as mc  # noqa: E402
from mate_cupy.kda import decode, decode_launch  # noqa: E402
from mate_cupy.msa import execute  # noqa: E402
from mate_cupy.runtime.interop import Call  # noqa: E402
from mate_cupy.runtime.memo import BoundedMemo  # noqa: E402


@pytest.fixture
def stub(monkeypatch):
    rec = ho.install_stub_device(monkeypatch.setattr)
    monkeypatch.setattr(decode, "_PREPARED", BoundedMemo(256))
    monkeypatch.setattr(decode, "_PROBLEMS", BoundedMemo(256))
    return rec


OPS = ("gated_delta_rule_decode B1", "sparse_decode_atten_func B1 eager", "msa paged decode static B1",
       "msa paged decode eager B1")


@pytest.mark.parametrize("op", OPS)
def test_a_prepared_call_launches_what_its_miss_and_the_launcher_launch(stub, op):
    cases = ho.stub_cases(mc)
    fn = cases[op]
    miss = stub.record(fn)  # validates, prepares, launches the prepared launch
    hit = stub.record(fn)  # the prepared launch only
    assert miss and hit == miss
    # KDA decode launches are programmatic on the stub's sm_90; the others are not
    assert all(r[6] == op.startswith("gated") for r in miss)
    assert all(r[4] == ho.STUB_STREAM for r in hit)
    # The unprepared launcher on the same arrays.
    if op.startswith("gated"):
        dq = fn.__defaults__[0]
        pool, idx = fn.__defaults__[1:]
        call = Call(q=dq["q"], k=dq["k"], v=dq["v"], a=dq["a"], b=dq["b"], state=pool, A_log=dq["A_log"],
                    dt_bias=dq["dt_bias"], state_indices=idx, output=dq["out"])
        problem = decode._check(call, None, None, None, None, True, True, None, None, None, False, False, True,
                                None)
        plain = stub.record(lambda: decode_launch.run(call, problem))
        assert len(decode._PREPARED) == 1
    else:
        plain = stub.record(lambda: _unprepared_msa(fn))
    assert plain == miss


def _unprepared_msa(fn):
    """The call of ``fn`` through execute.validate and the plain CUDA launcher."""
    captured = {}

    def spy(fn_name, info, *args):
        captured["args"] = (fn_name, info) + args
        raise _Stop

    ops = importlib.import_module("mate_cupy.msa.ops")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "run", spy)
        with pytest.raises(_Stop):
            fn()
    prob, operands = execute.validate(*captured["args"])
    execute._run_cuda(prob, operands)


class _Stop(Exception):
    pass


def test_prepared_msa_calls_are_bounded_owned_by_the_plan_and_never_store_a_refusal(stub):
    cases = ho.stub_cases(mc)
    fn = cases["msa paged decode eager B1"]
    q, k, v, plan = fn.__defaults__[0]
    kw = fn.__defaults__[1]
    memo = plan[3].prepared_calls if isinstance(plan, tuple) else plan.prepared_calls
    memo.clear()
    for i in range(memo.capacity + 4):  # a distinct key per sm_scale
        mc.msa(q, k, v, plan, sm_scale=0.01 * (i + 1), **kw)
    assert len(memo) == memo.capacity
    bad_out = ho.FakeCudaTensor(torch.empty(q.shape, dtype=torch.float16))
    before = len(memo)
    for _ in range(2):
        with pytest.raises(TypeError, match="out"):
            mc.msa(q, k, v, plan, kv_indices=kw["kv_indices"], out=bad_out, sm_scale=0.5)
    assert len(memo) == before
    entries = set(map(id, memo._items.values()))
    owner = weakref.ref(plan[3] if isinstance(plan, tuple) else plan)
    del fn, plan, memo, cases, kw
    gc.collect()
    assert owner() is None
    assert not any(id(o) in entries for o in gc.get_objects() if type(o) is execute.PreparedCall)


def test_prepared_decode_calls_are_bounded_and_never_store_a_refusal(stub, monkeypatch):
    monkeypatch.setattr(decode, "_PREPARED", BoundedMemo(4))
    fn = ho.stub_cases(mc)["gated_delta_rule_decode B1"]
    dq, pool, idx = fn.__defaults__
    args = (dq["q"], dq["k"], dq["v"], pool, dq["A_log"], dq["a"], dq["dt_bias"], None, None, dq["b"])
    for i in range(6):
        mc.gated_delta_rule_decode(*args, state_indices=idx, output=dq["out"], scale=0.1 * (i + 1),
                                   inplace_final_state=True)
    assert len(decode._PREPARED) == 4
    bad_pool = ho.FakeCudaTensor(torch.empty(tuple(pool.shape), dtype=torch.float16))
    for _ in range(2):
        with pytest.raises(ValueError, match="state"):
            mc.gated_delta_rule_decode(*args[:3], bad_pool, *args[4:], state_indices=idx, output=dq["out"],
                                       inplace_final_state=True)
    assert len(decode._PREPARED) == 4
    # A hit returns the caller's objects, as the launcher does.
    out, final = mc.gated_delta_rule_decode(*args, state_indices=idx, output=dq["out"], scale=0.6,
                                            inplace_final_state=True)
    assert out is dq["out"] and final is pool


# ----------------------------------------------------------------------------- on the GPU


def _gpu_cases():
    """``(name, make_inputs(seed), run(inputs, validated))`` per op. ``validated=True`` passes an
    option that keeps the call off prepared launches without changing what it launches: the
    default scale as a NumPy float (prepared calls take plain Python options only)."""
    import math

    import numpy as np

    dev = "cuda"
    hv, h, kd, b = 32, 16, 128, 4

    def kda_inputs(seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        rn = lambda *s, dt=torch.bfloat16: torch.randn(s, generator=g, device=dev).to(dt)  # noqa: E731
        return dict(q=rn(b, 1, h, kd), k=rn(b, 1, h, kd), v=rn(b, 1, hv, kd), a=rn(b, 1, hv, kd), b=rn(b, 1, hv),
                    A_log=torch.rand(hv, generator=g, device=dev), dt_bias=rn(hv, kd, dt=torch.float32) * 0.1,
                    state=rn(b + 2, hv, kd, kd, dt=torch.float32) * 0.05,
                    state_indices=torch.tensor([3, 0, 5, 1], dtype=torch.int32, device=dev),
                    output=torch.full((b, 1, hv, kd), float("nan"), device=dev, dtype=torch.bfloat16))

    def kda_run(x, validated):
        mc.gated_delta_rule_decode(x["q"], x["k"], x["v"], x["state"], x["A_log"], x["a"], x["dt_bias"], None, None,
                                   x["b"], state_indices=x["state_indices"], output=x["output"], use_lower_bound=True,
                                   apply_beta_sigmoid=True, inplace_final_state=True,
                                   scale=np.float64(kd ** -0.5) if validated else None)
        return ("output", "state")

    page, hq, hkv, d, L = 128, 64, 4, 128, 4096
    splan = mc.msa_plan_from_lengths([1], [L], hq, hkv, page_size=page, kv_block_num=16, device=0)
    mc.upload_plan(splan, device=0, head_dim=d, dtype=torch.bfloat16)

    def sparse_inputs(seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        n = L // page
        sel = torch.stack([torch.randperm(n, device=dev, generator=g)[:16] for _ in range(hkv)])[None]
        return dict(q=torch.randn(1, hq, d, generator=g, device=dev).bfloat16(),
                    k=torch.randn(n, page, hkv, d, generator=g, device=dev).bfloat16(),
                    v=torch.randn(n, page, hkv, d, generator=g, device=dev).bfloat16(),
                    kv_indices=torch.randperm(n, device=dev, generator=g).int(), kv_block_indexes=sel.int(),
                    out=torch.full((1, hq, d), float("nan"), device=dev, dtype=torch.bfloat16))

    def sparse_run(x, validated):
        mc.sparse_decode_atten_func(x["q"], x["k"], x["v"], splan, kv_indices=x["kv_indices"],
                                    kv_block_indexes=x["kv_block_indexes"], out=x["out"],
                                    sm_scale=np.float64(1.0 / math.sqrt(d)) if validated else None)
        return ("out",)

    L2, page2, hq2, hkv2, bs = 8192, 64, 64, 8, 2
    n2 = bs * L2 // page2
    static = mc.msa_plan(bs, 1, L2, hq2, total_seqlen_k=n2 * page2, num_kv_heads=hkv2, page_size=page2)
    mc.upload_plan(static, device=0, head_dim=d, dtype=torch.bfloat16)
    eager = mc.msa_plan_from_lengths([1, 1], [L2, L2 - 1000], hq2, hkv2, page_size=page2, device=0)
    mc.upload_plan(eager, device=0, head_dim=d, dtype=torch.bfloat16)

    def paged_inputs(seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        kv = torch.tensor([L2, L2 - 1000], dtype=torch.int32, device=dev)
        qo = torch.ones(bs, dtype=torch.int32, device=dev)
        zero = torch.zeros(1, dtype=torch.int32, device=dev)
        pages = (kv + page2 - 1) // page2
        total_pages = int(pages.sum())
        return dict(q=torch.randn(bs, hq2, d, generator=g, device=dev).bfloat16(),
                    k=torch.randn(n2, page2, hkv2, d, generator=g, device=dev).bfloat16(),
                    v=torch.randn(n2, page2, hkv2, d, generator=g, device=dev).bfloat16(),
                    kv_indices=torch.randperm(n2, device=dev, generator=g)[:total_pages].int(),
                    out=torch.full((bs, hq2, d), float("nan"), device=dev, dtype=torch.bfloat16),
                    md=(qo, kv, kv - qo, torch.cat([zero, qo.cumsum(0, dtype=torch.int32)]),
                        torch.cat([zero, kv.cumsum(0, dtype=torch.int32)]), kv.clone(),
                        torch.cat([zero, pages.cumsum(0, dtype=torch.int32)])))

    def static_run(x, validated):
        md = x["md"]
        meta = mc.MsaRuntimeMetadata(qo_lens=md[0], kv_lens=md[1], qo_offset=md[2], cu_seqlens_q=md[3],
                                     cu_seqlens_k=md[4], seqused_k=md[5], kv_page_indptr=md[6])
        mc.msa(x["q"], x["k"], x["v"], static, kv_indices=x["kv_indices"], out=x["out"], runtime_metadata=meta,
               sm_scale=np.float64(1.0 / math.sqrt(d)) if validated else None)
        return ("out",)

    def eager_run(x, validated):
        mc.msa(x["q"], x["k"], x["v"], eager, kv_indices=x["kv_indices"], out=x["out"],
               sm_scale=np.float64(1.0 / math.sqrt(d)) if validated else None)
        return ("out",)

    from mate_cupy.kda import decode as kda_decode
    from mate_cupy.msa.plan import unpack_plan_info

    def plan_memo(info):
        return lambda: unpack_plan_info(info)[3].prepared_calls

    return (("gated_delta_rule_decode", kda_inputs, kda_run, lambda: kda_decode._PREPARED),
            ("sparse_decode_atten_func", sparse_inputs, sparse_run, plan_memo(splan)),
            ("msa static plan", paged_inputs, static_run, plan_memo(static)),
            ("msa eager plan", paged_inputs, eager_run, plan_memo(eager)))


def _clone(x):
    if isinstance(x, dict):
        return {n: _clone(a) for n, a in x.items()}
    if isinstance(x, tuple):
        return tuple(_clone(a) for a in x)
    return x.clone()


@pytest.mark.gpu
def test_gpu_prepared_calls_equal_the_validated_path_bit_for_bit():
    """Each op on torch tensors: the first call (validated, prepared) and later ones on new
    tensors of the same metadata (the prepared launch) write exactly what the validated
    path writes for copies of the same inputs; outputs poisoned with NaN."""
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    for name, make, run, memo in _gpu_cases():
        for seed in (1, 2, 3):  # seed 1 prepares, 2 and 3 reuse it (new tensors, new addresses)
            x = make(seed)
            y = _clone(x)
            written = run(x, False)
            torch.cuda.synchronize()
            run(y, True)
            torch.cuda.synchronize()
            for n in written:
                assert not torch.isnan(x[n].float()).any(), (name, seed, n)
                assert not torch.isnan(y[n].float()).any(), (name, seed, n)
                assert torch.equal(x[n], y[n]), (name, seed, n)
        assert len(memo()) >= 1, name  # the torch calls were prepared


def test_prepared_launch_fills_sources_into_fixed_values():
    from mate_cupy.jit import KernelParams, PreparedLaunch, Source

    params = KernelParams((("a", "ptr"), ("n", "i32"), ("b", "ptr"), ("x", "f32"), ("c", "ptr")))

    class K:
        ptr, name = 1, "k"

        def reserve_shared_memory(self, n):
            raise AssertionError("no shared memory above 48 KiB here")

    pl = PreparedLaunch(K(), (3,), (128,), params, (Source(1), 7, None, 0.5, Source(0)), n_addresses=2)
    assert pl.grid == (3, 1, 1) and pl.block == (128, 1, 1)
    assert pl.values((0x100, 0x200)) == (0x200, 7, 0, 0.5, 0x100)
    assert params.pack(pl.values((0x100, 0x200))) == params.pack((0x200, 7, 0, 0.5, 0x100))
    with pytest.raises(ValueError, match="n"):
        PreparedLaunch(K(), (1,), (1,), params, (0, Source(0), 0, 0.5, 0), n_addresses=1)
    with pytest.raises(ValueError, match="c"):
        PreparedLaunch(K(), (1,), (1,), params, (0, 1, 0, 0.5, Source(2)), n_addresses=2)


def test_prepared_launch_run_packs_what_launch_packs(monkeypatch):
    """A run repacks only the span of sourced slots into its per-thread buffer: the bytes
    handed to cuLaunchKernel equal those of :func:`launch` with the same values, for fixed
    values before, inside and after the span, run after run and in a second thread."""
    import ctypes
    import importlib
    import threading

    from mate_cupy.jit import KernelParams, PreparedLaunch, Source, launch

    launch_mod = importlib.import_module("mate_cupy.jit.launch")  # the module (``jit.launch`` is its function)
    params = KernelParams((("n0", "i32"), ("a", "ptr"), ("n", "i32"), ("b", "ptr"), ("x", "f32"), ("c", "ptr"),
                           ("m", "i64"), ("y", "f32")))
    seen = []

    def fake_launch(f, gx, gy, gz, bx, by, bz, smem, stream, table, extra):
        ptrs = (ctypes.c_void_p * len(params.kinds)).from_address(table)
        sizes = {"ptr": 8, "i32": 4, "f32": 4, "i64": 8}
        seen.append((f, (gx, gy, gz), (bx, by, bz), smem, stream,
                     b"".join(ctypes.string_at(ptrs[i], sizes[k]) for i, k in enumerate(params.kinds))))

    monkeypatch.setattr(launch_mod, "_launch_kernel", fake_launch)

    class K:
        ptr, name = 11, "k"

    fixed = (-3, Source(1), 7, 0x900, 0.5, Source(0), 1 << 40, -2.25)
    pl = PreparedLaunch(K(), (3, 2), (128,), params, fixed, n_addresses=2)
    for addrs in ((0x100, 0x200), (0x300, 0x400), (0x100, 0x200)):
        seen.clear()
        pl.run(addrs, 5)
        launch(K(), (3, 2), (128,), params, (-3, addrs[1], 7, 0x900, 0.5, addrs[0], 1 << 40, -2.25), stream=5)
        assert len(seen) == 2 and seen[0] == seen[1], addrs
    seen.clear()
    t = threading.Thread(target=pl.run, args=((0x500, 0x600), 9))
    t.start()
    t.join()
    launch(K(), (3, 2), (128,), params, (-3, 0x600, 7, 0x900, 0.5, 0x500, 1 << 40, -2.25), stream=9)
    assert len(seen) == 2 and seen[0] == seen[1]


def test_programmatic_launcher_passes_the_launch_config():
    """``cuLaunchKernelEx`` gets a ``CUlaunchConfig`` with the launch's grid, block, shared
    memory and stream and one attribute, programmatic stream serialization = 1, and the
    kernel's parameter table; the config is packed again at every launch."""
    import ctypes
    import struct

    from mate_cupy.jit.launch import programmatic_launcher

    seen = []

    def fake_launch_ex(config, f, table, extra):
        gx, gy, gz, bx, by, bz, smem, stream, attrs, n_attrs = struct.unpack("<7I4xQQI4x", ctypes.string_at(config, 56))
        attr_id, value = struct.unpack_from("<i4xi", ctypes.string_at(attrs, 72))
        seen.append(((gx, gy, gz), (bx, by, bz), smem, stream, n_attrs, attr_id, value, f, table, extra))
        return 0

    launch_ex = programmatic_launcher(fake_launch_ex)
    launch_ex(0x1230, 4096, 1, 1, 64, 1, 1, 17920, 0x5000, 0x7000, 0)
    launch_ex(0x1240, 3, 2, 1, 128, 2, 1, 0, 0, 0x7100, 0)
    assert seen == [((4096, 1, 1), (64, 1, 1), 17920, 0x5000, 1, 6, 1, 0x1230, 0x7000, None),
                    ((3, 2, 1), (128, 2, 1), 0, 0, 1, 6, 1, 0x1240, 0x7100, None)]


def test_prepared_launch_encodes_tensor_maps_on_the_call_address(monkeypatch):
    """A tensor map on a source's address is encoded with each run's address (again only when
    it changed), and a run hands cuLaunchKernel the bytes :func:`launch` hands it; a map on a
    fixed address is encoded once. The driver's encoder is replaced by one that writes the
    address and the box into the descriptor."""
    import ctypes
    import dataclasses
    import importlib
    import struct

    from mate_cupy.jit import KernelParams, PreparedLaunch, Source, launch
    from mate_cupy.jit import tensor_map as tm

    launch_mod = importlib.import_module("mate_cupy.jit.launch")
    encoded = []

    def fake_encode(dest, dtype, rank, addr, dims, strides, box, elem, interleave, swizzle, l2, oob):
        assert dest % 64 == 0
        encoded.append(addr)
        ctypes.memmove(dest, struct.pack("<QI", addr, box[rank - 1]).ljust(tm.MAP_BYTES, b"\x01"), tm.MAP_BYTES)
        return 0

    monkeypatch.setattr(tm, "_ENCODE", [fake_encode])
    params = KernelParams((("a", "ptr"), ("n", "i32"), ("qm", "map"), ("km", "map")))
    seen = []

    def fake_launch(f, gx, gy, gz, bx, by, bz, smem, stream, table, extra):
        ptrs = (ctypes.c_void_p * 4).from_address(table)
        sizes = (8, 4, tm.MAP_BYTES, tm.MAP_BYTES)
        seen.append(b"".join(ctypes.string_at(ptrs[i], n) for i, n in enumerate(sizes)))

    monkeypatch.setattr(launch_mod, "_launch_kernel", fake_launch)

    class K:
        ptr, name = 11, "k"

    qm = tm.TensorMap(Source(1), tm.DTYPE_BFLOAT16, (128, 8, 100), (256, 2048), (64, 8, 16))
    km = tm.TensorMap(0x7000, tm.DTYPE_BFLOAT16, (128, 1, 50), (256, 256), (64, 1, 128))
    pl = PreparedLaunch(K(), (1,), (384,), params, (Source(0), 5, qm, km), n_addresses=2)
    assert encoded == [0x7000]
    for addrs, encodes in (((0x100, 0x200), [0x200]), ((0x300, 0x200), []), ((0x100, 0x400), [0x400])):
        encoded.clear()
        seen.clear()
        pl.run(addrs, 0)
        assert encoded == encodes, addrs
        launch(K(), (1,), (384,), params, (addrs[0], 5, dataclasses.replace(qm, address=addrs[1]), km))
        assert len(seen) == 2 and seen[0] == seen[1], addrs
        assert seen[0][12:20] == struct.pack("<Q", addrs[1])
    assert pl.values((0x100, 0x200))[2][:8] == struct.pack("<Q", 0x200)
    with pytest.raises(ValueError, match="qm"):
        PreparedLaunch(K(), (1,), (1,), params, (0, 5, qm, km), n_addresses=1)
