"""Host cost of the public CUDA ops measured on a machine without a GPU.

Usage: ``python bench/host_overhead_cpu.py [--calls N] [--profile]``.

:class:`FakeCuda` stands in for the device: torch-like CUDA tensors that carry only
dtype/shape/strides/address (:class:`FakeTensor`), CuPy arrays over invented addresses,
and kernels that record the exact bytes of every kernel parameter instead of launching.
Everything between the public call and ``cuLaunchKernel`` runs for real: argument
checks, array wrapping, launcher packing, the replay cache. What is not measured:
CuPy's own launch call (per-argument conversion in C plus ``cuLaunchKernel``, a few
microseconds) and the torch/CUDA calls the fakes replace (``data_ptr``, streams).

The same fakes let ``tests/test_launch_cache.py`` check that a replayed launch is
byte-for-byte the launch the full path makes.
"""
from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_BASE = 0x7F00_0000_0000


class FakeTensor:
    """A torch CUDA tensor as mate_cupy sees it: metadata and an address, no memory."""

    __slots__ = ("dtype", "shape", "_stride", "_ptr", "device", "requires_grad")
    is_cuda = True

    def __init__(self, shape, dtype, ptr: int, stride=None, device=None):
        import torch

        self.shape = torch.Size(shape)
        self.dtype = dtype
        self._ptr = int(ptr)
        if stride is None:
            stride, acc = [], 1
            for n in reversed(self.shape):
                stride.append(acc)
                acc *= max(int(n), 1)
            stride = tuple(reversed(stride))
        self._stride = tuple(stride)
        self.device = device if device is not None else torch.device("cuda", 0)
        self.requires_grad = False

    def stride(self):
        return self._stride

    def data_ptr(self):
        return self._ptr

    def get_device(self):
        return self.device.index

    def dim(self):
        return len(self.shape)

    ndim = property(dim)

    def numel(self):
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    def is_contiguous(self):
        acc = 1
        for n, s in zip(reversed(self.shape), reversed(self._stride)):
            if n != 1 and s != acc:
                return False
            acc *= n
        return True

    def __getitem__(self, i):
        """``t[i]`` for an int ``i`` (the only indexing the ops do on results)."""
        i = int(i)
        n = self.shape[0]
        if not -n <= i < n:
            raise IndexError(i)
        i %= n
        item = self.dtype.itemsize
        return FakeTensor(self.shape[1:], self.dtype, self._ptr + i * self._stride[0] * item, self._stride[1:],
                          self.device)

    def __dlpack__(self, stream=None):  # presence marks an array; never called on this path
        raise RuntimeError("FakeTensor has no memory")

    def __dlpack_device__(self):
        return (2, self.device.index)


FakeTensor.__module__ = "torch.fake"  # framework_of() reads the top-level module name


class _Addresses:
    """Bump allocator of invented device addresses (256-byte aligned)."""

    def __init__(self):
        self.next = _BASE

    def take(self, nbytes: int, misalign: int = 0) -> int:
        p = self.next + misalign
        self.next += ((max(int(nbytes), 1) + misalign + 255) // 256 + 1) * 256
        return p


class FakeKernel:
    """Records launches: (name, grid, block, shared memory, parameter bytes); ``log=None``
    records nothing (timing)."""

    def __init__(self, name: str, log):
        self.name, self.log = name, log
        self.max_dynamic_shared_size_bytes = 0
        self.preferred_shared_memory_carveout = -1

    @property
    def kernel(self):
        return self

    def __call__(self, grid, block, args, shared_mem=0, stream=None, **_):
        if self.log is not None:
            self.log.append((self.name, tuple(grid), tuple(block), int(shared_mem), tuple(param_bytes(a) for a in args)))


def param_bytes(a) -> bytes:
    """The bytes CuPy would hand to ``cuLaunchKernel`` for one kernel argument."""
    import cupy
    from cupy._core._scalar import CScalar
    from cupy.cuda.function import CPointer

    if a is None:
        return bytes(8)
    if isinstance(a, cupy.ndarray):
        return int(a.data.ptr).to_bytes(8, "little")
    if isinstance(a, CScalar):
        return ctypes.string_at(a.ptr, a.dtype.itemsize)
    if isinstance(a, CPointer):  # CIntptr: a pointer-sized value
        return ctypes.string_at(a.ptr, 8)
    if isinstance(a, np.generic):
        return a.tobytes()
    if isinstance(a, bool):
        return bytes([int(a)])
    if isinstance(a, int):
        return int(a).to_bytes(8, "little", signed=True)
    if isinstance(a, float):
        return np.float64(a).tobytes()
    raise TypeError(f"unexpected kernel argument {type(a).__name__}")


class _FakeStream:
    ptr = 0x5EED

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _FakeDevice:
    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeCuda:
    """``with FakeCuda() as fc:``: mate_cupy's CUDA path runs against fake tensors and kernels.

    ``fc.tensor(shape, torch_dtype)`` makes a fake torch CUDA tensor, ``fc.cupy(shape,
    dtype)`` a CuPy array over an invented address; ``fc.log`` lists the launches. Every
    patched module attribute and cache is restored on exit.
    """

    def __init__(self, record: bool = True):
        self.log: list = []
        self.record = record
        self.addr = _Addresses()
        self._undo: list = []
        self._kernels: dict = {}

    # ---------------------------------------------------------------- arrays
    def tensor(self, shape, dtype, *, misalign: int = 0, stride=None):
        import torch

        item = torch.empty((), dtype=dtype).element_size()
        n = int(np.prod(shape)) if len(shape) else 1
        return FakeTensor(shape, dtype, self.addr.take(n * item, misalign), stride=stride)

    def cupy(self, shape, dtype, *, misalign: int = 0):
        import cupy

        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in np.atleast_1d(shape)) if not isinstance(shape, tuple) else shape
        n = int(np.prod(shape)) if len(shape) else 1
        mem = cupy.cuda.UnownedMemory(self.addr.take(n * dtype.itemsize, misalign), max(1, n * dtype.itemsize),
                                      None, 0)
        return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))

    # ---------------------------------------------------------------- patching
    def _set(self, obj, name, value):
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def _kernel(self, spec, name=None):
        key = (spec.name, name or spec.kernels[0])
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = FakeKernel(f"{spec.source}:{key[1]}", self.log if self.record else None)
        return k

    def __enter__(self):
        import cupy
        import torch

        from mate_cupy import _interop
        from mate_cupy import _launch_cache as lc
        from mate_cupy.jit import compiler
        from mate_cupy.kda import chunk_kernels, decode_kernels
        from mate_cupy.msa import attention_kernels, gather_kernels, index_kernels
        from mate_cupy.msa.plan import MsaPlan

        lc.register_tensor_type(FakeTensor, 1)
        lc.clear()
        fc = self
        for mod in (decode_kernels, attention_kernels, gather_kernels, index_kernels, chunk_kernels):
            self._set(mod, "get_kernel", self._kernel)
        for mod in (decode_kernels, index_kernels, chunk_kernels):
            if hasattr(mod, "_sm_count"):
                self._set(mod, "_sm_count", lambda: 132)
        if hasattr(decode_kernels, "_cc_major"):
            self._set(decode_kernels, "_cc_major", lambda: 9)
        if hasattr(attention_kernels, "_device_info"):
            self._set(attention_kernels, "_device_info", lambda: (132, 90))
        if hasattr(attention_kernels, "_sm_count"):
            self._set(attention_kernels, "_sm_count", lambda: 132)
        self._set(cupy.cuda, "Device", _FakeDevice)
        self._set(cupy.cuda, "get_current_stream", lambda *a: _FakeStream())
        self._set(cupy, "empty", lambda shape, dtype=float, order="C": fc.cupy(shape, dtype))
        self._set(cupy, "zeros", lambda shape, dtype=float, order="C": fc.cupy(shape, dtype))
        self._set(_interop, "_torch_stream_ptr", lambda device: _FakeStream.ptr)
        self._set(_interop, "external_stream", lambda ptr: _FakeStream())
        self._set(lc, "_current_device", lambda: 0)
        self._set(lc, "_torch_stream", lambda device: _FakeStream())

        def alloc(first, torch_result, shape, dtype):
            if torch_result:
                tdt = {v: k for k, v in _interop._torch_dtype_map().items()}[np.dtype(dtype)]
                t = fc.tensor(shape, tdt)
                return t, t.data_ptr()
            a = fc.cupy(tuple(shape), dtype)
            return a, a.data.ptr

        self._set(lc, "_alloc", alloc)
        real_export = _interop.export

        def export(arr, framework, *, dtype=None, call=None):
            if framework == "torch" and isinstance(arr, cupy.ndarray):
                logical = _interop.as_dtype(dtype) if dtype is not None else np.dtype(arr.dtype)
                tdt = {v: k for k, v in _interop._torch_dtype_map().items()}[logical]
                return FakeTensor(arr.shape, tdt, arr.data.ptr, stride=tuple(s // arr.itemsize for s in arr.strides))
            return real_export(arr, framework, dtype=dtype, call=call)

        self._set(_interop, "export", export)

        def device_vector(plan, name, device):
            key = (int(device), name)
            if key not in plan._device_cache:
                for f in ("qo_lens", "kv_lens", "qo_offset", "kv_page_indptr", "cu_seqlens_q", "cu_seqlens_k"):
                    host = plan.host_vector(f)
                    plan._device_cache[(int(device), f)] = None if host is None else fc.cupy(host.shape, np.int32)
            return plan._device_cache[key]

        self._set(MsaPlan, "device_vector", device_vector)
        self._saved_optin = dict(compiler._smem_optin)
        self._saved_ws = {k: list(v) for k, v in attention_kernels._WORKSPACES.items()}
        self._saved_counts = {k: list(v) for k, v in gather_kernels._COUNTS.items()}
        del torch
        return self

    def __exit__(self, *exc):
        from mate_cupy import _launch_cache as lc
        from mate_cupy.jit import compiler
        from mate_cupy.msa import attention_kernels, gather_kernels

        for obj, name, value in reversed(self._undo):
            setattr(obj, name, value)
        self._undo.clear()
        lc.clear()
        compiler._smem_optin.clear()
        compiler._smem_optin.update(self._saved_optin)
        attention_kernels._WORKSPACES.clear()
        attention_kernels._WORKSPACES.update(self._saved_ws)
        gather_kernels._COUNTS.clear()
        gather_kernels._COUNTS.update(self._saved_counts)
        return False


# ----------------------------------------------------------------------------- cases


def cases(fc: FakeCuda) -> dict:
    """Name -> (fn(inputs) -> result, make_inputs() -> inputs): the ops of bench/host_overhead.py."""
    import torch

    import mate_cupy as mc

    bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    out = {}

    # KDA decode B32 HV32 H16, fp32 pool in place, preallocated output.
    b, hv, h, k = 32, 32, 16, 128
    pool = fc.tensor((b, hv, k, k), f32)
    a_log, dt_bias = fc.tensor((hv,), f32), fc.tensor((hv, k), f32)

    def dec_inputs():
        return dict(q=fc.tensor((b, 1, h, k), bf16), k=fc.tensor((b, 1, h, k), bf16),
                    v=fc.tensor((b, 1, hv, k), bf16), a=fc.tensor((b, 1, hv, k), bf16),
                    b=fc.tensor((b, 1, hv), bf16), idx=fc.tensor((b,), i32), out=fc.tensor((b, 1, hv, k), bf16))

    def dec(x):
        return mc.gated_delta_rule_decode(x["q"], x["k"], x["v"], pool, a_log, x["a"], dt_bias, None, None, x["b"],
                                          state_indices=x["idx"], output=x["out"], use_lower_bound=True,
                                          apply_beta_sigmoid=True, inplace_final_state=True)

    out["kda decode B32"] = (dec, dec_inputs)

    # MSA paged decode B64 L8192 page 64, static plan + runtime metadata.
    bs, L, page, hq, hkv, d = 64, 8192, 64, 64, 8, 128
    n_pages = bs * L // page
    kc, vc = fc.tensor((n_pages, page, hkv, d), bf16), fc.tensor((n_pages, page, hkv, d), bf16)
    plan = mc.msa_plan(bs, 1, L, hq, total_seqlen_k=n_pages * page, num_kv_heads=hkv, page_size=page)

    def msa_inputs():
        meta = mc.MsaRuntimeMetadata(
            qo_lens=fc.tensor((bs,), i32), kv_lens=fc.tensor((bs,), i32), qo_offset=fc.tensor((bs,), i32),
            cu_seqlens_q=fc.tensor((bs + 1,), i32), cu_seqlens_k=fc.tensor((bs + 1,), i32),
            seqused_k=fc.tensor((bs,), i32), kv_page_indptr=fc.tensor((bs + 1,), i32))
        return dict(q=fc.tensor((bs, hq, d), bf16), out=fc.tensor((bs, hq, d), bf16),
                    idx=fc.tensor((n_pages,), i32), meta=meta)

    def paged_static(x):
        return mc.msa(x["q"], kc, vc, plan, kv_indices=x["idx"], out=x["out"], runtime_metadata=x["meta"])

    out["msa paged decode static B64"] = (paged_static, msa_inputs)
    eplan = mc.msa_plan_from_lengths(np.ones(bs, np.int32), np.full(bs, L, np.int32), hq, hkv, page_size=page)

    def paged_eager(x):
        return mc.msa(x["q"], kc, vc, eplan, kv_indices=x["idx"], out=x["out"])

    out["msa paged decode eager B64"] = (paged_eager, msa_inputs)

    # Sparse decode B8 (split-KV: the merge kernel and the cached workspace too).
    sb, sL, hq2, hkv2, topk = 8, 32768, 64, 4, 16
    sp_pages = sb * sL // 128
    ks, vs = fc.tensor((sp_pages, 128, hkv2, d), bf16), fc.tensor((sp_pages, 128, hkv2, d), bf16)
    splan = mc.msa_plan(sb, 1, sL, hq2, total_seqlen_k=sp_pages * 128, num_kv_heads=hkv2, page_size=128,
                        kv_block_num=topk, sparse_kernel_mode="decode")

    def sparse_inputs():
        meta = mc.MsaRuntimeMetadata(
            qo_lens=fc.tensor((sb,), i32), kv_lens=fc.tensor((sb,), i32), qo_offset=fc.tensor((sb,), i32),
            cu_seqlens_q=fc.tensor((sb + 1,), i32), cu_seqlens_k=fc.tensor((sb + 1,), i32),
            seqused_k=fc.tensor((sb,), i32), kv_page_indptr=fc.tensor((sb + 1,), i32))
        return dict(q=fc.tensor((sb, hq2, d), bf16), out=fc.tensor((sb, hq2, d), bf16),
                    idx=fc.tensor((sp_pages,), i32), kbi=fc.tensor((sb, hkv2, topk), i32), meta=meta)

    def sparse_decode(x):
        return mc.sparse_decode_atten_func(x["q"], ks, vs, splan, kv_indices=x["idx"], kv_block_indexes=x["kbi"],
                                           out=x["out"], runtime_metadata=x["meta"])

    out["msa sparse decode B8"] = (sparse_decode, sparse_inputs)

    def topk_inputs():
        return dict(scores=fc.tensor((64, 64, 8192), f32), sel=fc.tensor((64, 64, 16), i32))

    def topk_call(x):
        return mc.sparse_topk_select(x["scores"], 16, output=x["sel"])

    out["topk [64,64,8192]"] = (topk_call, topk_inputs)

    # chunk_kda B1 T1024 H64, preallocated output and float32 final state.
    T, H = 1024, 64

    def chunk_inputs():
        return dict(q=fc.tensor((1, T, H, k), bf16), k=fc.tensor((1, T, H, k), bf16), v=fc.tensor((1, T, H, k), bf16),
                    g=fc.tensor((1, T, H, k), bf16), beta=fc.tensor((1, T, H), bf16), A_log=fc.tensor((H,), f32),
                    dt_bias=fc.tensor((H * k,), f32), out=fc.tensor((1, T, H, k), bf16),
                    fs=fc.tensor((1, H, k, k), f32))

    def chunk_call(x):
        return mc.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                            output_final_state=True, output=x["out"], final_state=x["fs"])

    out["chunk_kda T1024 H64"] = (chunk_call, chunk_inputs)
    return out


def _time(fn, inputs: list, calls: int) -> float:
    for i in range(3):
        fn(inputs[i % len(inputs)])
    t0 = time.perf_counter()
    for i in range(calls):
        fn(inputs[i % len(inputs)])
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true", help="print a cProfile of each op's replayed path")
    args = ap.parse_args()
    from mate_cupy import _launch_cache as lc

    rows = []
    with FakeCuda(record=False) as fc:
        for name, (fn, make) in cases(fc).items():
            inputs = [make() for _ in range(4)]
            try:
                lc.set_enabled(False)
                full = _time(fn, inputs, max(200, args.calls // 4))
                lc.set_enabled(True)
                fast = _time(fn, inputs, args.calls)
            except Exception as e:  # report, keep going
                rows.append((name, f"{type(e).__name__}: {e}"[:120]))
                lc.set_enabled(True)
                continue
            rows.append((name, full, fast))
            if args.profile:
                pr = cProfile.Profile()
                pr.enable()
                for i in range(200):
                    fn(inputs[i % 4])
                pr.disable()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12)
                print(f"===== {name} (replayed)\n{s.getvalue()}")
    print(f"{'op':32s} {'full path us':>13s} {'replayed us':>12s} {'speed-up':>9s}")
    for r in rows:
        if len(r) == 2:
            print(f"{r[0]:32s} {r[1]}")
        else:
            print(f"{r[0]:32s} {r[1]:13.1f} {r[2]:12.1f} {r[1] / r[2]:8.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
