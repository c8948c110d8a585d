"""Host-side cost of one public call (Python validation, interop, launch), with a profile.

Usage: ``python bench/host_overhead.py OUTDIR [--calls N]``. For small ops whose kernels
take tens of microseconds, the Python layer decides the plain-call time. For each op
this prints the wall time per call with the GPU kept busy (so host time is measured, not
GPU time), the GPU time per call from a CUDA graph replay, and writes a cProfile of the
host path (top functions by own time) to ``OUTDIR/host_profile.txt``.

``--stub-device`` runs without a GPU: the same calls on stand-in CUDA tensors
(:class:`FakeCudaTensor`, torch CPU tensors that report device 0), with the device queries,
the stream getter, module loading and ``cuLaunchKernel`` replaced by stand-ins
(:func:`install_stub_device`), so exactly the Python code of a real CUDA call is timed
(the Python share, in process CPU time; the driver's launch is not included). It writes
``OUTDIR/host_overhead_stub.json`` and ``OUTDIR/host_profile_stub.txt``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.timing import graph_replay_us  # noqa: E402



def decode_cases(mc, rn, ints, upload, paged_batches=(1, 64), with_topk=True) -> dict:
    """name -> call of each host-bound op with preallocated outputs, on arrays made by
    ``rn(*shape, dtype=, scale=)`` (random floats on the device) and ``ints(t)`` (a host int
    tensor put on the device); ``upload(plan_info)`` prepares a plan. Used on the GPU
    (:func:`_cases`) and on the stub device (:func:`stub_cases`)."""
    import torch

    cases = {}
    # KDA decode, HV32 H16, fp32 pool in place, preallocated output: B1 and B32.
    hv, h, k = 32, 16, 128
    for b in (1, 32):
        dq = dict(q=rn(b, 1, h, k), k=rn(b, 1, h, k), v=rn(b, 1, hv, k), a=rn(b, 1, hv, k), b=rn(b, 1, hv),
                  A_log=rn(hv, dtype=torch.float32, scale=0.5), dt_bias=rn(hv, k, dtype=torch.float32, scale=0.0),
                  out=rn(b, 1, hv, k))
        pool, idx = rn(b, hv, k, k, dtype=torch.float32, scale=0.05), ints(torch.arange(b, dtype=torch.int32))

        def kda_decode(dq=dq, pool=pool, idx=idx):
            return mc.gated_delta_rule_decode(dq["q"], dq["k"], dq["v"], pool, dq["A_log"], dq["a"], dq["dt_bias"],
                                              None, None, dq["b"], state_indices=idx, output=dq["out"],
                                              use_lower_bound=True, apply_beta_sigmoid=True,
                                              inplace_final_state=True)

        cases[f"gated_delta_rule_decode B{b}"] = kda_decode

    # Sparse decode B1, 128K keys, Hq64 Hkv4 top-16, page 128, eager plan.
    page, hq, hkv, d, L = 128, 64, 4, 128, 131072
    n_pages = L // page
    kc, vc = rn(n_pages, page, hkv, d), rn(n_pages, page, hkv, d)
    qs, outs = rn(1, hq, d), rn(1, hq, d)
    idx_s = ints(torch.randperm(n_pages).to(torch.int32))
    sel = ints(torch.randint(0, n_pages, (1, hkv, 16), dtype=torch.int32))
    splan = mc.msa_plan_from_lengths(torch.ones(1, dtype=torch.int32), torch.full((1,), L, dtype=torch.int32), hq,
                                     hkv, page_size=page, kv_block_num=16, device="cpu")
    upload(splan)

    def sparse_decode():
        return mc.sparse_decode_atten_func(qs, kc, vc, splan, kv_indices=idx_s, kv_block_indexes=sel, out=outs)

    cases["sparse_decode_atten_func B1 eager"] = sparse_decode

    # MSA paged decode (8192 keys, page 64, Hq64 Hkv8): static plan + runtime metadata, and eager plan.
    L, page, hq, hkv = 8192, 64, 64, 8
    for bs in paged_batches:
        n_pages = bs * L // page
        kc2, vc2 = rn(n_pages, page, hkv, d), rn(n_pages, page, hkv, d)
        qd, outd = rn(bs, hq, d), rn(bs, hq, d)
        kv_indices = ints(torch.randperm(n_pages).to(torch.int32))
        qo = torch.ones(bs, dtype=torch.int32)
        kv = torch.full((bs,), L, dtype=torch.int32)
        zero = torch.zeros(1, dtype=torch.int32)
        meta = mc.MsaRuntimeMetadata(
            qo_lens=ints(qo), kv_lens=ints(kv), qo_offset=ints(kv - qo),
            cu_seqlens_q=ints(torch.cat([zero, torch.cumsum(qo, 0, dtype=torch.int32)])),
            cu_seqlens_k=ints(torch.cat([zero, torch.cumsum(kv, 0, dtype=torch.int32)])), seqused_k=ints(kv),
            kv_page_indptr=ints(torch.cat([zero, torch.cumsum(kv // page, 0, dtype=torch.int32)])))
        plan = mc.msa_plan(bs, 1, L, hq, total_seqlen_k=n_pages * page, num_kv_heads=hkv, page_size=page)
        upload(plan)
        eplan = mc.msa_plan_from_lengths(qo, kv, hq, hkv, page_size=page, device="cpu")
        upload(eplan)

        def paged_static(a=(qd, kc2, vc2, plan), kw=dict(kv_indices=kv_indices, out=outd, runtime_metadata=meta)):
            return mc.msa(*a, **kw)

        def paged_eager(a=(qd, kc2, vc2, eplan), kw=dict(kv_indices=kv_indices, out=outd)):
            return mc.msa(*a, **kw)

        cases[f"msa paged decode static B{bs}"] = paged_static
        cases[f"msa paged decode eager B{bs}"] = paged_eager

    if with_topk:
        scores = rn(64, 64, 8192, dtype=torch.float32)
        selk = ints(torch.empty((64, 64, 16), dtype=torch.int32))

        def topk():
            return mc.sparse_topk_select(scores, 16, output=selk)

        cases["sparse_topk_select [64,64,8192]"] = topk
    return cases


def _cases(torch, mc):
    """:func:`decode_cases` on the GPU (torch CUDA tensors, plans uploaded with their dtypes)."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rn(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(shape, generator=g, device="cuda") * scale).to(dtype)

    def upload(plan):
        mc.upload_plan(plan, device=0, head_dim=128, dtype=torch.bfloat16)

    torch.manual_seed(0)
    return decode_cases(mc, rn, lambda t: t.to("cuda"), upload)


def _host_us(torch, fn, calls: int, repeats: int = 5) -> float:
    """Host microseconds per call: the least of ``repeats`` timings of ``calls`` back-to-back
    calls, each while the GPU is kept busy (launches never wait for it)."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda._sleep(int(5e8))
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def _python_us(torch, fn, calls: int) -> float:
    """Host microseconds per call with the driver launches replaced by a no-op: the
    Python layer's share of :func:`_host_us` (the difference is ``cuLaunchKernel``)."""
    import importlib

    launch_mod = importlib.import_module("mate_cupy.jit.launch")  # the module (``jit.launch`` is its function)

    saved = launch_mod._launch_kernel, launch_mod._launch_kernel_programmatic  # bound by the warm-up calls
    launch_mod._launch_kernel = launch_mod._launch_kernel_programmatic = lambda *a: None
    try:
        return _host_us(torch, fn, calls, repeats=3)
    finally:
        launch_mod._launch_kernel, launch_mod._launch_kernel_programmatic = saved


# ----------------------------------------------------------------------------- the stub device


class FakeCudaTensor:
    """A torch CPU tensor that reports CUDA device 0: ``shape``, ``dtype``, ``stride()``,
    ``data_ptr()``, ``is_contiguous()`` are the tensor's own (the same C calls a CUDA tensor answers),
    ``get_device()`` returns 0. The stub device's arrays; never read by a kernel."""

    __slots__ = ("tensor", "shape", "dtype", "stride", "data_ptr", "is_contiguous", "get_device", "is_cuda", "device")

    def __init__(self, tensor):
        self.tensor = tensor
        self.shape, self.dtype, self.stride, self.data_ptr = tensor.shape, tensor.dtype, tensor.stride, tensor.data_ptr
        self.is_contiguous = tensor.is_contiguous
        self.get_device = (0).__int__
        self.is_cuda = True
        self.device = "cuda:0"

    def __dlpack__(self, *a, **k):  # an array by the protocol; the stub path never exports it
        raise NotImplementedError("stub CUDA tensors are not exported")


class StubKernel:
    """What the stub module loader returns: a fake ``CUfunction`` address per kernel name."""

    def __init__(self, name: str, ptr: int):
        self.kernel = type("K", (), {"ptr": ptr})()
        self.name = name
        self.max_dynamic_shared_size_bytes = 0


class StubLaunches:
    """Records every launch of the stub device (``cuLaunchKernel``, or ``cuLaunchKernelEx``
    through :meth:`programmatic`): ``(kernel name, grid, block, shared memory, stream, packed
    parameter bytes, programmatic)``, read through the ``void**`` table with the kernel's
    ``KernelParams``."""

    def __init__(self):
        self.records = []
        self.recording = False
        self.names = {}  # fake CUfunction address -> kernel name

    def __call__(self, f, gx, gy, gz, bx, by, bz, smem, stream, table, extra, programmatic=False):
        if not self.recording:
            return
        import ctypes

        name = self.names[f]
        params = _params_of_table(table)
        ptrs = (ctypes.c_void_p * len(params.kinds)).from_address(table)
        from mate_cupy.jit.launch import _SIZE

        packed = b"".join(ctypes.string_at(ptrs[i], _SIZE[k]) for i, k in enumerate(params.kinds))
        self.records.append((name, (gx, gy, gz), (bx, by, bz), smem, stream, packed, programmatic))

    def programmatic(self, *args):
        self(*args, programmatic=True)

    def record(self, fn) -> list:
        """The launches of one ``fn()`` call."""
        self.records.clear()
        self.recording = True
        try:
            fn()
        finally:
            self.recording = False
        return list(self.records)


def _params_of_table(table: int):
    """The ``KernelParams`` whose packing table (this thread's, or that of one of this
    thread's prepared launches) is at ``table``."""
    import gc
    import sys as _sys

    from mate_cupy.jit.launch import KernelParams, PreparedLaunch

    for mod in list(_sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("mate_cupy"):
            for value in list(vars(mod).values()):
                if isinstance(value, KernelParams) and value._buffers()[2] == table:
                    return value
    for obj in gc.get_objects():
        if type(obj) is PreparedLaunch:  # (isinstance would read __class__ of every object, some deprecated)
            bufs = getattr(obj._tls, "bufs", None)
            if bufs is not None and bufs[2] == table:
                return obj.params
    raise LookupError(f"no KernelParams packs at {table:#x}")


STUB_SM_COUNT, STUB_CC, STUB_STREAM = 132, 90, 0x5000


def install_stub_device(patch=setattr) -> StubLaunches:
    """Make this process's CUDA path run without a GPU (see the module docstring); returns
    the launch recorder. Device 0 is an H200 (132 SMs, sm_90); the caller's stream is
    :data:`STUB_STREAM`. ``patch(module, name, value)`` sets each stand-in (a test passes
    ``monkeypatch.setattr`` so that everything is restored afterwards)."""
    import importlib

    import torch

    from mate_cupy.jit import compiler
    from mate_cupy.runtime import device, interop

    rec = StubLaunches()

    class _Module:
        def get_function(self, name):
            ptr = 0x1000 + 16 * len(rec.names)
            rec.names[ptr] = name
            return StubKernel(name, ptr)

    patch(compiler, "get_module", lambda spec, device_id: _Module())
    patch(compiler, "_kernels", {})
    patch(device, "_INFO", {**device._INFO, 0: (STUB_SM_COUNT, STUB_CC)})
    patch(device, "_libcuda", False)
    patch(interop, "_GET_DEVICE", [(0).__int__])
    patch(interop, "_TORCH_RAW_STREAM", [lambda dev: STUB_STREAM])
    interop._torch_dtype_map()
    patch(interop, "_TORCH_TYPES", interop._TORCH_TYPES | {FakeCudaTensor, torch.Tensor})
    launch_mod = importlib.import_module("mate_cupy.jit.launch")  # (``jit.launch`` is the function)
    patch(launch_mod, "_launch_kernel", rec)
    patch(launch_mod, "_launch_kernel_programmatic", rec.programmatic)
    return rec


def stub_upload(plan_info, head_dim: int = 128, dtype="bfloat16") -> None:
    """``upload_plan`` on the stub device: the eager vectors as fake CUDA tensors, a fake
    plan-owned workspace of the plan's bound."""
    import numpy as np
    import torch

    from mate_cupy.msa.plan import _VECTORS, DeviceVectors, unpack_plan_info
    from mate_cupy.runtime.interop import wrap
    from mate_cupy.runtime.workspace import Workspace

    mixed, _, _, first, second = unpack_plan_info(plan_info)
    for plan in (first, second) if mixed else (first,):
        if not plan.is_static:
            vec = DeviceVectors.__new__(DeviceVectors)
            vec.device, vec.buffer, vec.lengths = 0, None, None
            for name in _VECTORS:
                h = plan.host_vector(name)
                setattr(vec, name, None if h is None else wrap(name, FakeCudaTensor(
                    torch.from_numpy(np.ascontiguousarray(h, dtype=np.int32)))))
            plan.device_vectors = vec
    ws = Workspace.__new__(Workspace)
    ws.buffer, ws.nbytes, ws.device = None, max(1, first.workspace_bytes(head_dim, dtype, device=0)), 0
    ws.ptr = 0x7F0000000000
    first.workspace = ws


def stub_cases(mc) -> dict:
    """The ops of :func:`_cases` (paged decode at B1, no top-k) on the stub device."""
    import torch

    torch.manual_seed(0)

    def rn(*shape, dtype=torch.bfloat16, scale=1.0):
        return FakeCudaTensor(torch.empty(shape, dtype=dtype))

    return decode_cases(mc, rn, lambda t: FakeCudaTensor(t.contiguous()), stub_upload, paged_batches=(1,),
                        with_topk=False)


def _stub_us(fn, calls: int, repeats: int) -> float:
    """Microseconds of this process's CPU time per call (``time.process_time``, so time spent
    descheduled on a shared host does not count): the least of ``repeats`` timings."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - t0) / calls * 1e6)
    return best


def main_stub(outdir: str, calls: int, repeats: int) -> int:
    """``--stub-device``: the Python share of each op's CUDA call, without a GPU."""
    rec = install_stub_device()
    import mate_cupy as mc

    rows, prof_text = [], io.StringIO()
    for name, fn in stub_cases(mc).items():
        for _ in range(5):
            fn()
        launches = [(r[0], r[1], r[2], r[3]) for r in rec.record(fn)]
        us = _stub_us(fn, calls, repeats)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            fn()
        pr.disable()
        prof_text.write(f"\n===== {name}: {us:.2f} us/call (stub device, Python share)\n")
        pstats.Stats(pr, stream=prof_text).sort_stats("tottime").print_stats(25)
        rows.append({"op": name, "python_us_per_call_stub": round(us, 2), "launches": launches})
    with open(os.path.join(outdir, "host_profile_stub.txt"), "w") as f:
        f.write(prof_text.getvalue())
    with open(os.path.join(outdir, "host_overhead_stub.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        print(json.dumps({"op": r["op"], "python_us_per_call_stub": r["python_us_per_call_stub"],
                          "launches": len(r["launches"])}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("outdir")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--stub-device", action="store_true",
                    help="no GPU: time the Python share of each CUDA call on stand-in tensors")
    ap.add_argument("--repeats", type=int, default=15, help="timings per op with --stub-device (the least is kept)")
    args = ap.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    if args.stub_device:
        return main_stub(args.outdir, max(args.calls, 2000), args.repeats)
    import torch

    import mate_cupy as mc

    cases = _cases(torch, mc)
    rows, prof_text = [], io.StringIO()
    for name, fn in cases.items():
        try:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            # Host time: keep the GPU busy so launches never wait for it.
            host_us = _host_us(torch, fn, args.calls)
            python_us = _python_us(torch, fn, args.calls)
            # GPU time per call: CUDA graph replay.
            graph_us = graph_replay_us(torch, fn, replays=50, err_chars=160)
            pr = cProfile.Profile()
            torch.cuda._sleep(int(2e9))
            pr.enable()
            for _ in range(100):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            st = pstats.Stats(pr, stream=prof_text)
            prof_text.write(f"\n===== {name}: {host_us:.1f} us/call host\n")
            st.sort_stats("tottime").print_stats(25)
            rows.append({"op": name, "host_us_per_call": host_us, "python_us_per_call": python_us,
                         "graph_gpu_us": graph_us})
        except Exception as e:
            rows.append({"op": name, "error": f"{type(e).__name__}: {e}"[:300]})
    with open(os.path.join(args.outdir, "host_profile.txt"), "w") as f:
        f.write(prof_text.getvalue())
    with open(os.path.join(args.outdir, "host_overhead.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
