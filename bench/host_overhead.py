"""Host-side cost of one public call (Python validation, interop, launch), with a profile.

Usage: ``python bench/host_overhead.py OUTDIR [--calls N]``. For small ops whose kernels
take tens of microseconds, the Python layer decides the plain-call time. For each op
this prints the wall time per call with the GPU kept busy (so host time is measured, not
GPU time), the GPU time per call from a CUDA graph replay, and writes a cProfile of the
host path (top functions by own time) to ``OUTDIR/host_profile.txt``.
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



def _cases(torch, mc):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def rn(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=g, device=dev).to(dtype)

    cases = {}
    # KDA decode, HV32 H16, fp32 pool in place, preallocated output: B1 and B32.
    hv, h, k = 32, 16, 128
    for b in (1, 32):
        pool = torch.randn((b, hv, k, k), generator=g, device=dev) * 0.05
        idx = torch.arange(b, dtype=torch.int32, device=dev)
        dq = dict(q=rn(b, 1, h, k), k=rn(b, 1, h, k), v=rn(b, 1, hv, k), a=rn(b, 1, hv, k), b=rn(b, 1, hv),
                  A_log=torch.rand(hv, device=dev, generator=g).float(), dt_bias=torch.zeros(hv, k, device=dev),
                  out=torch.empty(b, 1, hv, k, device=dev, dtype=torch.bfloat16))

        def kda_decode(dq=dq, pool=pool, idx=idx):
            return mc.gated_delta_rule_decode(dq["q"], dq["k"], dq["v"], pool, dq["A_log"], dq["a"], dq["dt_bias"],
                                              None, None, dq["b"], state_indices=idx, output=dq["out"],
                                              use_lower_bound=True, apply_beta_sigmoid=True,
                                              inplace_final_state=True)

        cases[f"gated_delta_rule_decode B{b}"] = kda_decode

    # Sparse decode B1, 128K keys, Hq64 Hkv4 top-16, page 128: eager and static plan.
    page, hq, hkv, d, L = 128, 64, 4, 128, 131072
    n_pages = L // page
    kc, vc = rn(n_pages, page, hkv, d), rn(n_pages, page, hkv, d)
    qs = rn(1, hq, d)
    outs = torch.empty_like(qs)
    idx_s = torch.randperm(n_pages, device=dev, generator=g).to(torch.int32)
    sel = torch.randint(0, n_pages, (1, hkv, 16), device=dev, generator=g, dtype=torch.int32)
    splan = mc.msa_plan_from_lengths(torch.ones(1, dtype=torch.int32), torch.full((1,), L, dtype=torch.int32), hq,
                                     hkv, page_size=page, kv_block_num=16, device=0)
    mc.upload_plan(splan, device=0, head_dim=d, dtype=torch.bfloat16)

    def sparse_decode():
        return mc.sparse_decode_atten_func(qs, kc, vc, splan, kv_indices=idx_s, kv_block_indexes=sel, out=outs)

    cases["sparse_decode_atten_func B1 eager"] = sparse_decode

    # MSA paged decode B1 and B64 (8192 keys, page 64, Hq64 Hkv8), static plan + runtime metadata
    # and eager plan.
    L, page, hq, hkv = 8192, 64, 64, 8
    for bs in (1, 64):
        n_pages = bs * L // page
        kc2, vc2 = rn(n_pages, page, hkv, d), rn(n_pages, page, hkv, d)
        qd = rn(bs, hq, d)
        outd = torch.empty_like(qd)
        kv_indices = torch.randperm(n_pages, device=dev, generator=g).to(torch.int32)
        qo = torch.ones(bs, dtype=torch.int32, device=dev)
        kv = torch.full((bs,), L, dtype=torch.int32, device=dev)
        zero = torch.zeros(1, dtype=torch.int32, device=dev)
        meta = mc.MsaRuntimeMetadata(
            qo_lens=qo, kv_lens=kv, qo_offset=kv - qo,
            cu_seqlens_q=torch.cat([zero, torch.cumsum(qo, 0, dtype=torch.int32)]),
            cu_seqlens_k=torch.cat([zero, torch.cumsum(kv, 0, dtype=torch.int32)]), seqused_k=kv.clone(),
            kv_page_indptr=torch.cat([zero, torch.cumsum(kv // page, 0, dtype=torch.int32)]))
        plan = mc.msa_plan(bs, 1, L, hq, total_seqlen_k=n_pages * page, num_kv_heads=hkv, page_size=page)
        mc.upload_plan(plan, device=0, head_dim=d, dtype=torch.bfloat16)
        eplan = mc.msa_plan_from_lengths(qo, kv, hq, hkv, page_size=page)  # CUDA lengths: uploaded at once
        mc.upload_plan(eplan, device=0, head_dim=d, dtype=torch.bfloat16)

        def paged_static(a=(qd, kc2, vc2, plan), kw=dict(kv_indices=kv_indices, out=outd, runtime_metadata=meta)):
            return mc.msa(*a, **kw)

        def paged_eager(a=(qd, kc2, vc2, eplan), kw=dict(kv_indices=kv_indices, out=outd)):
            return mc.msa(*a, **kw)

        cases[f"msa paged decode static B{bs}"] = paged_static
        cases[f"msa paged decode eager B{bs}"] = paged_eager

    scores = torch.randn((64, 64, 8192), generator=g, device=dev)
    selk = torch.empty((64, 64, 16), dtype=torch.int32, device=dev)

    def topk():
        return mc.sparse_topk_select(scores, 16, output=selk)

    cases["sparse_topk_select [64,64,8192]"] = topk
    return cases


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

    saved = launch_mod._launch_kernel  # bound by the warm-up calls
    launch_mod._launch_kernel = lambda *a: None
    try:
        return _host_us(torch, fn, calls, repeats=3)
    finally:
        launch_mod._launch_kernel = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("outdir")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
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
