"""Host time of one decode step through each framework path, beside the plain eager call.

Usage: ``python bench/framework_overhead.py OUTDIR [--calls N] [--device cuda|cpu]
[--stub-device]``.

For the KDA decode step (B1, HV32 H16, fp32 pool in place) and an MSA paged decode step
(B1, 8192 keys, page 64, Hq64 Hkv8, static plan with runtime metadata) this times, in
microseconds per call:

* ``eager``: the public function on torch tensors (outputs given: the prepared launch);
* ``torch_op``: the ``torch.ops.mate_cupy`` wrapper, eagerly;
* ``compiled``: a function calling the wrapper under ``torch.compile(fullgraph=True)``;
* ``reduce_overhead``: a module calling the wrapper compiled with
  ``mode="reduce-overhead"``, in the form CUDA-graph trees replay (``docs/frameworks.md``):
  the pool a registered buffer, outputs allocated inside the compiled function;
* ``cuda_graph``: the eager call captured once in a ``torch.cuda.CUDAGraph``, one
  ``replay()`` per call (what a serving loop that captures its own step pays);
* ``jax_eager`` / ``jax_jit``: the public function on JAX arrays, and the ``jax_ffi`` op
  under ``jax.jit`` (the pool donated; a CUDA execution runs the handler's prepared
  launch) when JAX is installed; ``jax_eager_wrap`` times only the wrapping of the eager
  call's JAX arrays (DLPack export and reading), the part of ``jax_eager`` spent before
  validation.

torch paths are timed with the GPU kept busy (``torch.cuda._sleep``), so the figure is
host time; JAX paths are timed back to back and synchronised once per sample. Writes
``OUTDIR/framework_overhead.json`` (a list of ``{op, path, us_per_call}``). ``--device
cpu`` runs the same paths on the NumPy reference with tiny shapes (a smoke test of the
script; the figures then time the references, not the library's host layer).

``--stub-device`` needs no GPU: on the stub device of ``bench/host_overhead.py`` (device
queries, module loading and ``cuLaunchKernel`` replaced) it times the Python share, in
process CPU time, of ``eager`` and ``torch_op`` on torch tensors that report CUDA device
0, and of the JAX CUDA handler on an XLA call frame built over host memory
(:class:`SyntheticFrame`): ``jax_handler_prepared`` (a hit of ``jax_ffi.PREPARED_CALLS``)
and ``jax_handler_validated`` (the public function on the call's buffers). It writes
``OUTDIR/framework_overhead_stub.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.timing import captured_graph  # noqa: E402


def _timed(fn, calls: int, busy=None, sync=None, repeats: int = 5) -> float:
    """Least of ``repeats`` timings of ``calls`` calls, in microseconds per call."""
    best = float("inf")
    for _ in range(repeats):
        if busy is not None:
            busy()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        if sync is not None:
            sync()
    return best


def _kda_inputs(torch, dev, b=1, hv=32, h=16, k=128):
    g = torch.Generator(device=dev).manual_seed(0)

    def rn(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=g, device=dev).to(dtype)

    return dict(q=rn(b, 1, h, k), k=rn(b, 1, h, k), v=rn(b, 1, hv, k), a=rn(b, 1, hv, k), b=rn(b, 1, hv),
                A_log=torch.rand(hv, device=dev, generator=g).float(), dt_bias=torch.zeros(hv, k, device=dev),
                state=torch.randn((b, hv, k, k), generator=g, device=dev) * 0.05,
                state_indices=torch.arange(b, dtype=torch.int32, device=dev),
                output=torch.empty(b, 1, hv, k, device=dev, dtype=torch.bfloat16))


def _decode_call(fn, x):
    return fn(x["q"], x["k"], x["v"], x["state"], x["A_log"], x["a"], x["dt_bias"], None, None, x["b"],
              state_indices=x["state_indices"], output=x["output"], use_lower_bound=True, apply_beta_sigmoid=True,
              inplace_final_state=True)


def _msa_inputs(torch, mc, dev, length: int, page: int, hq: int, hkv: int, d: int = 128):
    g = torch.Generator(device=dev).manual_seed(1)
    n_pages = length // page
    kc = torch.randn((n_pages, page, hkv, d), generator=g, device=dev).to(torch.bfloat16)
    vc = torch.randn((n_pages, page, hkv, d), generator=g, device=dev).to(torch.bfloat16)
    q = torch.randn((1, hq, d), generator=g, device=dev).to(torch.bfloat16)
    kv_indices = torch.randperm(n_pages, device=dev, generator=g).to(torch.int32)
    qo = torch.ones(1, dtype=torch.int32, device=dev)
    kv = torch.full((1,), length, dtype=torch.int32, device=dev)
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    meta = mc.MsaRuntimeMetadata(
        qo_lens=qo, kv_lens=kv, qo_offset=kv - qo, cu_seqlens_q=torch.cat([zero, qo.cumsum(0, dtype=torch.int32)]),
        cu_seqlens_k=torch.cat([zero, kv.cumsum(0, dtype=torch.int32)]), seqused_k=kv.clone(),
        kv_page_indptr=torch.cat([zero, (kv // page).cumsum(0, dtype=torch.int32)]))
    plan = mc.msa_plan(1, 1, length, hq, total_seqlen_k=length, num_kv_heads=hkv, page_size=page)
    if dev == "cuda":
        mc.upload_plan(plan, device=0, head_dim=d, dtype=torch.bfloat16)
    return dict(q=q, k=kc, v=vc, plan=plan, kv_indices=kv_indices, out=torch.empty_like(q), meta=meta)


def _torch_rows(torch, mc, tops, dev: str, calls: int) -> list:
    cuda = dev == "cuda"
    busy = (lambda: torch.cuda._sleep(int(5e8))) if cuda else None
    sync = torch.cuda.synchronize if cuda else None
    rows = []
    x = _kda_inputs(torch, dev, k=128)
    m = (_msa_inputs(torch, mc, dev, 8192, 64, 64, 8) if cuda else _msa_inputs(torch, mc, dev, 256, 64, 8, 1))

    def decode(fn):
        return lambda: _decode_call(fn, x)

    def paged(fn):
        return lambda: fn(m["q"], m["k"], m["v"], m["plan"], kv_indices=m["kv_indices"], out=m["out"],
                          runtime_metadata=m["meta"])

    class DecodeStep(torch.nn.Module):
        """The decode step as CUDA-graph trees replay it: the pool a buffer, the output made inside."""

        def __init__(self):
            super().__init__()
            self.register_buffer("pool", x["state"].clone())

        def forward(self, q, k, v, a, b, A_log, dt_bias, slots):  # noqa: N803
            out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
            o, _ = tops.gated_delta_rule_decode(q, k, v, self.pool, A_log, a, dt_bias, None, None, b,
                                                state_indices=slots, output=out, use_lower_bound=True,
                                                apply_beta_sigmoid=True, inplace_final_state=True)
            return o

    def decode_graphed():
        step = torch.compile(DecodeStep(), fullgraph=True, mode="reduce-overhead")
        args = tuple(x[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state_indices"))
        return lambda: step(*args)

    def paged_graphed():
        def attend(q, k, v, kv_indices, qo, kv, off, cu_q, cu_k, used, indptr):
            meta = mc.MsaRuntimeMetadata(qo, kv, off, cu_q, cu_k, used, kv_page_indptr=indptr)
            return tops.msa(q, k, v, m["plan"], kv_indices=kv_indices, runtime_metadata=meta)[0]

        step = torch.compile(attend, fullgraph=True, mode="reduce-overhead")
        md = m["meta"]
        args = (m["q"], m["k"], m["v"], m["kv_indices"], md.qo_lens, md.kv_lens, md.qo_offset, md.cu_seqlens_q,
                md.cu_seqlens_k, md.seqused_k, md.kv_page_indptr)
        return lambda: step(*args)

    def captured(fn):
        return captured_graph(torch, fn).replay

    cases = {"gated_delta_rule_decode B1": (decode, decode_graphed),
             "msa paged decode static B1": (paged, paged_graphed)}
    backend = "inductor" if cuda else "aot_eager"
    for op, (make, graphed) in cases.items():
        public = mc.gated_delta_rule_decode if op.startswith("gated") else mc.msa
        wrapped = tops.gated_delta_rule_decode if op.startswith("gated") else tops.msa
        paths = {"eager": lambda: make(public), "torch_op": lambda: make(wrapped),
                 "compiled": lambda: torch.compile(make(wrapped), fullgraph=True, backend=backend)}
        if cuda:
            paths["reduce_overhead"] = graphed
            paths["cuda_graph"] = lambda: captured(make(public))
        for path, build in paths.items():
            try:
                fn = build()
                for _ in range(3):
                    fn()
                if sync:
                    sync()
                # CUDA-graph trees synchronise on a replay while the busy kernel runs, which would
                # charge the busy period to the calls: that path is timed on an idle GPU.
                idle = path == "reduce_overhead"
                rows.append({"op": op, "path": path, "us_per_call": _timed(fn, calls, None if idle else busy, sync),
                             **({"gpu": "idle"} if idle else {})})
            except Exception as exc:  # noqa: BLE001 - one failing path must not hide the others
                rows.append({"op": op, "path": path, "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _jax_rows(mc, dev: str, calls: int) -> list:
    try:
        import jax
        import numpy as np

        from mate_cupy.integrations import jax_ffi
    except ImportError as exc:
        return [{"op": "jax", "path": "jax_jit", "error": f"ImportError: {exc}"}]
    target = jax.devices("gpu")[0] if dev == "cuda" else jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    b, hv, h, k = 1, 32, 16, 128

    def put(a):
        return jax.device_put(a, target)

    bf16 = jax.numpy.bfloat16
    q = put(rng.standard_normal((b, 1, h, k)).astype(np.float32)).astype(bf16)
    kk = put(rng.standard_normal((b, 1, h, k)).astype(np.float32)).astype(bf16)
    v = put(rng.standard_normal((b, 1, hv, k)).astype(np.float32)).astype(bf16)
    a = put(rng.standard_normal((b, 1, hv, k)).astype(np.float32)).astype(bf16)
    beta = put(rng.standard_normal((b, 1, hv)).astype(np.float32)).astype(bf16)
    A_log = put(rng.random(hv).astype(np.float32))  # noqa: N806
    dt_bias = put(np.zeros((hv, k), np.float32))
    pool = put((rng.standard_normal((b, hv, k, k)) * 0.05).astype(np.float32))
    slots = put(np.arange(b, dtype=np.int32))

    def eager():
        return mc.gated_delta_rule_decode(q, kk, v, pool, A_log, a, dt_bias, None, None, beta, state_indices=slots,
                                          use_lower_bound=True, apply_beta_sigmoid=True)[0]

    step = jax.jit(lambda pool: jax_ffi.gated_delta_rule_decode(
        q, kk, v, pool, A_log, a, dt_bias, None, None, beta, state_indices=slots, use_lower_bound=True,
        apply_beta_sigmoid=True, inplace_final_state=True), donate_argnums=0)
    state = {"pool": jax.numpy.array(pool, copy=True)}  # donated by the jitted step

    def jitted():
        out, state["pool"] = step(state["pool"])
        return out

    from mate_cupy.runtime.interop import wrap

    arrays = (q, kk, v, a, beta, A_log, dt_bias, pool, slots)

    def wrapped():
        for arr in arrays:
            wrap("x", arr)
        return q

    # MSA paged decode, static plan + runtime metadata (the torch rows' shapes on a GPU)
    length, page, hq, hkv, d = (8192, 64, 64, 8, 128) if dev == "cuda" else (256, 64, 8, 1, 128)
    n_pages = length // page
    plan = mc.msa_plan(1, 1, length, hq, total_seqlen_k=length, num_kv_heads=hkv, page_size=page)
    if dev == "cuda":
        mc.upload_plan(plan, device=0, head_dim=d, dtype=bf16)
    mq = put(rng.standard_normal((1, hq, d)).astype(np.float32)).astype(bf16)
    mk = put(rng.standard_normal((n_pages, page, hkv, d)).astype(np.float32)).astype(bf16)
    mv = put(rng.standard_normal((n_pages, page, hkv, d)).astype(np.float32)).astype(bf16)
    kv_indices = put(rng.permutation(n_pages).astype(np.int32))
    one, kvl = np.ones(1, np.int32), np.full(1, length, np.int32)
    meta = (put(one), put(kvl), put(kvl - one), put(np.array([0, 1], np.int32)),
            put(np.array([0, length], np.int32)), put(kvl), put(np.array([0, n_pages], np.int32)))

    @jax.jit
    def attend(q, k, v, idx, qo, kv, off, cu_q, cu_k, used, indptr):
        md = mc.MsaRuntimeMetadata(qo, kv, off, cu_q, cu_k, used, kv_page_indptr=indptr)
        return jax_ffi.msa(q, k, v, plan, kv_indices=idx, runtime_metadata=md)[0]

    last = {}

    def msa_jitted():
        last["out"] = attend(mq, mk, mv, kv_indices, *meta)
        return last["out"]

    rows = []
    for op, path, fn, sync in (
            ("gated_delta_rule_decode B1", "jax_eager", eager, lambda: state["pool"].block_until_ready()),
            ("gated_delta_rule_decode B1", "jax_eager_wrap", wrapped, lambda: state["pool"].block_until_ready()),
            ("gated_delta_rule_decode B1", "jax_jit", jitted, lambda: state["pool"].block_until_ready()),
            ("msa paged decode static B1", "jax_jit", msa_jitted, lambda: last["out"].block_until_ready())):
        try:
            for _ in range(3):
                fn().block_until_ready()
            rows.append({"op": op, "path": path, "us_per_call": _timed(fn, calls, None, sync)})
        except Exception as exc:  # noqa: BLE001
            rows.append({"op": op, "path": path, "error": f"{type(exc).__name__}: {exc}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


# ----------------------------------------------------------------------------- stub device (no GPU)


class SyntheticFrame:
    """An ``XLA_FFI_CallFrame`` (execute stage) over NumPy arrays, laid out as XLA passes it:
    the operands, the results (an array may be both, as an aliased buffer is), the one
    string attribute ``spec`` and an API whose stream and device-ordinal getters answer
    ``stream`` and ``ordinal`` and whose error_create records ``(code, message)`` in
    ``errors``. ``address`` is what XLA hands the handler."""

    def __init__(self, operands: list, results: list, spec: str, stream: int, ordinal: int = 0):
        import ctypes

        from mate_cupy.integrations import jax_ffi as jf

        codes = {name: code for code, name in jf._DTYPE_NAMES.items()}
        keep, self.errors = [], []

        def buffers(arrays):
            bufs = []
            for arr in arrays:
                dims = (ctypes.c_int64 * max(arr.ndim, 1))(*arr.shape)
                buf = jf._Buffer(ctypes.sizeof(jf._Buffer), None, codes[arr.dtype.name], arr.ctypes.data, arr.ndim,
                                 dims)
                keep.extend((dims, buf))
                bufs.append(ctypes.pointer(buf))
            items = (ctypes.POINTER(jf._Buffer) * max(len(bufs), 1))(*bufs)
            types = (ctypes.c_int * max(len(bufs), 1))(*([1] * len(bufs)))  # XLA_FFI_ArgType_BUFFER
            keep.extend((items, types))
            return jf._BufferList(ctypes.sizeof(jf._BufferList), None, len(bufs), types, items)

        raw_name, raw_spec = jf.SPEC_ATTRIBUTE.encode(), spec.encode()
        name, value = ctypes.create_string_buffer(raw_name), ctypes.create_string_buffer(raw_spec)
        name_span = jf._ByteSpan(ctypes.addressof(name), len(raw_name))
        value_span = jf._ByteSpan(ctypes.addressof(value), len(raw_spec))
        names = (ctypes.POINTER(jf._ByteSpan) * 1)(ctypes.pointer(name_span))
        values = (ctypes.c_void_p * 1)(ctypes.addressof(value_span))
        atypes = (ctypes.c_int * 1)(jf._ATTR_STRING)
        keep.extend((name, value, name_span, value_span, names, values, atypes))

        def stream_get(args):
            args.contents.stream = stream

        def ordinal_get(args):
            args.contents.device_ordinal = ordinal

        def error_create(args):
            self.errors.append((args.contents.errc, args.contents.message.decode()))
            return 1

        callbacks = (jf._STREAM_GET(stream_get), jf._DEVICE_ORDINAL_GET(ordinal_get),
                     jf._ERROR_CREATE(error_create))
        api = jf._Api(ctypes.sizeof(jf._Api))
        api.stream_get, api.device_ordinal_get, api.error_create = (
            ctypes.cast(c, ctypes.c_void_p).value for c in callbacks)
        self.frame = jf._CallFrame(ctypes.sizeof(jf._CallFrame), None, ctypes.pointer(api), None,
                                   jf._STAGE_EXECUTE, buffers(operands), buffers(results),
                                   jf._Attrs(ctypes.sizeof(jf._Attrs), None, 1, atypes, names, values), None)
        self._keep = (keep, callbacks, api)
        self.address = ctypes.addressof(self.frame)


def staged_spec(fn, *args, **kwargs) -> tuple:
    """``(spec, operand names, result names, result dtypes)`` of the ``ffi_call`` that the
    ``jax_ffi`` function ``fn`` stages for ``args`` (NumPy arrays; nothing is run)."""
    import jax

    from mate_cupy.integrations import jax_ffi as jf

    seen, saved = {}, jax.ffi.ffi_call

    def ffi_call(target, result_shapes, **_):
        def call(*operands, **attrs):
            seen.update(attrs)
            return [np.zeros(r.shape, r.dtype) for r in result_shapes]
        return call

    jax.ffi.ffi_call = ffi_call
    try:
        fn(*args, **kwargs)
    finally:
        jax.ffi.ffi_call = saved
    spec = seen[jf.SPEC_ATTRIBUTE]
    d = json.loads(spec)
    return spec, [o[0] for o in d["operands"]], [r[0] for r in d["results"]], [r[1] for r in d["results"]]


class NoScope:
    """A context that does nothing (the stub device's CuPy device scope)."""

    def __init__(self, *args):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def install_stub_jax(patch=setattr):
    """The stub device for the JAX CUDA handler: CuPy's device scopes and setting the device
    do nothing and its current stream is the stub stream (XLA buffers on device 0 over host
    memory)."""
    import cupy

    from bench.host_overhead import STUB_STREAM
    from mate_cupy.integrations import jax_ffi as jf
    from mate_cupy.runtime import interop

    patch(cupy.cuda, "Device", NoScope)
    patch(interop, "_cupy_stream_ptr", lambda: STUB_STREAM)
    patch(jf, "_cuda_scope", lambda ordinal, stream: NoScope())
    patch(jf, "_set_device", lambda ordinal: None)


def decode_frame(x: dict, **options) -> SyntheticFrame:
    """The CUDA call frame of a decode step in place (the pool aliased) over the NumPy arrays
    of ``x`` (q, k, v, state, A_log, a, dt_bias, b, state_indices); options as the op's."""
    from bench.host_overhead import STUB_STREAM
    from mate_cupy.integrations import jax_ffi as jf

    spec, operands, results, dtypes = staged_spec(
        jf.gated_delta_rule_decode, *(x[n] for n in ("q", "k", "v", "state", "A_log", "a", "dt_bias")), None, None,
        x["b"], state_indices=x["state_indices"], inplace_final_state=True, **options)
    arrays = {**x, "output": np.full(x["v"].shape, np.nan, np.float32).astype(dtypes[results.index("output")])}
    return SyntheticFrame([arrays[n] for n in operands], [arrays[n] for n in results], spec, STUB_STREAM)


def msa_frame(q, k, v, plan, **kwargs) -> SyntheticFrame:
    """The CUDA call frame of ``jax_ffi.msa(q, k, v, plan, **kwargs)`` over NumPy arrays (the
    runtime metadata's fields as operands ``md_<field>``), its output a new array."""
    from bench.host_overhead import STUB_STREAM
    from mate_cupy.integrations import jax_ffi as jf

    spec, operands, results, dtypes = staged_spec(jf.msa, q, k, v, plan, **kwargs)
    md = kwargs.get("runtime_metadata")
    arrays = dict(q=q, k=k, v=v, **{n: a for n, a in kwargs.items() if isinstance(a, np.ndarray)},
                  **({f"md_{f}": getattr(md, f) for f in jf._MD_FIELDS} if md is not None else {}))
    for name, dtype in zip(results, dtypes):
        arrays[name] = np.zeros(q.shape if name == "out" else q.shape[:2], np.dtype(dtype))
    return SyntheticFrame([arrays[n] for n in operands], [arrays[n] for n in results], spec, STUB_STREAM)


def _stub_rows(calls: int, repeats: int) -> list:
    import torch

    from bench import host_overhead as ho

    ho.install_stub_device()
    install_stub_jax()
    from mate_cupy.runtime import interop

    class Device0(torch.Tensor):
        """A torch CPU tensor that reports CUDA device 0 (passes through torch.ops as a tensor)."""

        __torch_function__ = torch._C._disabled_torch_function_impl

        def get_device(self):
            return 0

    interop._TORCH_TYPES.add(Device0)
    import mate_cupy as mc
    from mate_cupy.integrations import jax_ffi as jf
    from mate_cupy.integrations import torch_ops as tops

    def dev0(t):
        return t.as_subclass(Device0)

    rng = np.random.default_rng(0)
    b, hv, h, k = 1, 32, 16, 128
    x = dict(q=torch.zeros(b, 1, h, k, dtype=torch.bfloat16), k=torch.zeros(b, 1, h, k, dtype=torch.bfloat16),
             v=torch.zeros(b, 1, hv, k, dtype=torch.bfloat16), a=torch.zeros(b, 1, hv, k, dtype=torch.bfloat16),
             b=torch.zeros(b, 1, hv, dtype=torch.bfloat16), A_log=torch.zeros(hv), dt_bias=torch.zeros(hv, k),
             state=torch.zeros(b, hv, k, k), state_indices=torch.arange(b, dtype=torch.int32),
             output=torch.empty(b, 1, hv, k, dtype=torch.bfloat16))
    xt = {n: dev0(t) for n, t in x.items()}

    def decode(fn):
        return lambda: _decode_call(fn, xt)

    m = _stub_msa(torch, mc, dev0)

    def paged(fn):
        return lambda: fn(m["q"], m["k"], m["v"], m["plan"], kv_indices=m["kv_indices"], out=m["out"],
                          runtime_metadata=m["meta"])

    xn = {n: (t.float().numpy().astype(np.dtype("bfloat16")) if t.dtype == torch.bfloat16 else t.numpy())
          for n, t in x.items()}
    frame = decode_frame(xn, use_lower_bound=True, apply_beta_sigmoid=True)

    def handler(preparer, op="gated_delta_rule_decode", runner=jf._run_decode, frame=frame):
        return lambda: jf._handle(op, runner, preparer, True, frame.address)

    mn = {n: m[n].float().numpy().astype(np.dtype("bfloat16")) for n in ("q", "k", "v")}
    mdn = mc.MsaRuntimeMetadata(**{f: None if getattr(m["meta"], f) is None else getattr(m["meta"], f).numpy()
                                   for f in jf._MD_FIELDS})
    mframe = msa_frame(mn["q"], mn["k"], mn["v"], m["plan"], kv_indices=m["kv_indices"].numpy(),
                       runtime_metadata=mdn)

    cases = {"gated_delta_rule_decode B1": {"eager": decode(mc.gated_delta_rule_decode),
                                            "torch_op": decode(tops.gated_delta_rule_decode),
                                            "jax_handler_prepared": handler(jf._prepare_decode),
                                            "jax_handler_validated": handler(None)},
             "msa paged decode static B1": {
                 "eager": paged(mc.msa), "torch_op": paged(tops.msa),
                 "jax_handler_prepared": handler(jf._prepare_msa, "msa", jf._run_msa, mframe),
                 "jax_handler_validated": handler(None, "msa", jf._run_msa, mframe)}}
    rows = []
    for op, paths in cases.items():
        for path, fn in paths.items():
            us = ho._stub_us(fn, calls, repeats)
            rows.append({"op": op, "path": path, "python_us_per_call_stub": round(us, 2)})
            print(json.dumps(rows[-1]), flush=True)
    assert not frame.errors and not mframe.errors, frame.errors + mframe.errors
    del rng
    return rows


def _stub_msa(torch, mc, dev0) -> dict:
    """The MSA paged decode step of the GPU rows on the stub device (static plan, metadata)."""
    from bench.host_overhead import stub_upload

    length, page, hq, hkv, d = 8192, 64, 64, 8, 128
    n_pages = length // page
    qo = torch.ones(1, dtype=torch.int32)
    kv = torch.full((1,), length, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32)
    meta = mc.MsaRuntimeMetadata(
        qo_lens=dev0(qo), kv_lens=dev0(kv), qo_offset=dev0(kv - qo),
        cu_seqlens_q=dev0(torch.cat([zero, qo.cumsum(0, dtype=torch.int32)])),
        cu_seqlens_k=dev0(torch.cat([zero, kv.cumsum(0, dtype=torch.int32)])), seqused_k=dev0(kv.clone()),
        kv_page_indptr=dev0(torch.cat([zero, (kv // page).cumsum(0, dtype=torch.int32)])))
    plan = mc.msa_plan(1, 1, length, hq, total_seqlen_k=length, num_kv_heads=hkv, page_size=page)
    stub_upload(plan)
    return dict(q=dev0(torch.zeros(1, hq, d, dtype=torch.bfloat16)),
                k=dev0(torch.zeros(n_pages, page, hkv, d, dtype=torch.bfloat16)),
                v=dev0(torch.zeros(n_pages, page, hkv, d, dtype=torch.bfloat16)), plan=plan,
                kv_indices=dev0(torch.randperm(n_pages).to(torch.int32)),
                out=dev0(torch.zeros(1, hq, d, dtype=torch.bfloat16)), meta=meta)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--stub-device", action="store_true",
                    help="no GPU: the Python share of eager, torch_op and the JAX CUDA handler")
    ap.add_argument("--repeats", type=int, default=15, help="timings per path with --stub-device (least kept)")
    args = ap.parse_args(argv)
    os.makedirs(args.outdir, exist_ok=True)
    if args.stub_device:
        rows = _stub_rows(max(args.calls, 2000), args.repeats)
        with open(os.path.join(args.outdir, "framework_overhead_stub.json"), "w") as f:
            json.dump(rows, f, indent=1)
        return 0
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import torch

    import mate_cupy as mc
    from mate_cupy.integrations import torch_ops as tops

    rows = _torch_rows(torch, mc, tops, args.device, args.calls) + _jax_rows(mc, args.device, args.calls)
    with open(os.path.join(args.outdir, "framework_overhead.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
