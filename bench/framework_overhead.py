"""Host time of one decode step through each framework path, beside the plain eager call.

Usage: ``python bench/framework_overhead.py OUTDIR [--calls N] [--device cuda|cpu]``.

For the KDA decode step (B1, HV32 H16, fp32 pool in place) and an MSA paged decode step
(B1, 8192 keys, page 64, Hq64 Hkv8, static plan with runtime metadata) this times, in
microseconds per call:

* ``eager``: the public function on torch tensors;
* ``torch_op``: the ``torch.ops.mate_cupy`` wrapper, eagerly;
* ``compiled``: a function calling the wrapper under ``torch.compile(fullgraph=True)``;
* ``reduce_overhead``: the same compiled with ``mode="reduce-overhead"`` (a CUDA graph
  replay per call);
* ``jax_eager`` / ``jax_jit``: the public function on JAX arrays, and the
  ``jax_ffi`` op under ``jax.jit`` (when JAX is installed).

torch paths are timed with the GPU kept busy (``torch.cuda._sleep``), so the figure is
host time; JAX paths are timed back to back and synchronised once per sample. Writes
``OUTDIR/framework_overhead.json`` (a list of ``{op, path, us_per_call}``). ``--device
cpu`` runs the same paths on the NumPy reference with tiny shapes (a smoke test of the
script; the figures then time the references, not the library's host layer).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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

    cases = {"gated_delta_rule_decode B1": decode, "msa paged decode static B1": paged}
    backend = "inductor" if cuda else "aot_eager"
    for op, make in cases.items():
        public = mc.gated_delta_rule_decode if op.startswith("gated") else mc.msa
        wrapped = tops.gated_delta_rule_decode if op.startswith("gated") else tops.msa
        paths = {"eager": make(public), "torch_op": make(wrapped),
                 "compiled": torch.compile(make(wrapped), fullgraph=True, backend=backend)}
        if cuda:
            paths["reduce_overhead"] = torch.compile(make(wrapped), fullgraph=True, mode="reduce-overhead")
        for path, fn in paths.items():
            try:
                for _ in range(3):
                    fn()
                if sync:
                    sync()
                rows.append({"op": op, "path": path, "us_per_call": _timed(fn, calls, busy, sync)})
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
        apply_beta_sigmoid=True, inplace_final_state=True))
    state = {"pool": pool}

    def jitted():
        out, state["pool"] = step(state["pool"])
        return out

    rows = []
    for path, fn in (("jax_eager", eager), ("jax_jit", jitted)):
        try:
            for _ in range(3):
                fn().block_until_ready()
            sync = lambda: state["pool"].block_until_ready()  # noqa: E731
            rows.append({"op": "gated_delta_rule_decode B1", "path": path, "us_per_call": _timed(fn, calls, None, sync)})
        except Exception as exc:  # noqa: BLE001
            rows.append({"op": "gated_delta_rule_decode B1", "path": path, "error": f"{type(exc).__name__}: {exc}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args(argv)
    os.makedirs(args.outdir, exist_ok=True)
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
