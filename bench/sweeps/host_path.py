"""Host cost of the public ops with launch replay on and off, and replay correctness (one GPU).

    PYTHONPATH=. python bench/sweeps/host_path.py OUTDIR

The knob is ``mate_cupy._launch_cache`` (``MATE_CUPY_LAUNCH_CACHE``): off, every call runs
the full path (checks, array wrapping, launcher packing); on, a call whose signature ran
before replays the recorded launches. Cases use torch CUDA tensors as the bench does:
KDA decode B32 (in place, preallocated; and allocating its output), MSA paged decode B64
(static plan + runtime metadata; eager plan), block-sparse decode B8 (split-KV: two
kernels and the cached workspace), top-k select [64, 64, 8192], chunk_kda T1024 H64.

Per case and mode:

* ``host_us``: wall time per call while the GPU is held busy (``torch.cuda._sleep``), so
  launches never wait for it: 64 calls per sample, median of 3 samples. ``busy_ok``
  says every sample ended before the sleep did (else the number is GPU-bound).
* ``plain_us`` (replay on): back-to-back calls timed with CUDA events: what a caller sees.
* ``graph_us``: GPU time per call from a CUDA-graph replay of the captured call.
* ``check``: the outputs of a replayed call equal those of a full-path call on the same
  inputs bit for bit (in-place states on clones); ``replayed`` confirms the replay path ran.

Writes ``OUTDIR/host_path.json`` and ``OUTDIR/host_path_profile.txt`` (cProfile of each
replayed call); prints a table (last lines).
"""
from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

NAME = "host_path"
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.timing import graph_replay_us  # noqa: E402

CALLS = 64
SAMPLES = 3
BUDGET_S = 50  # cases left when this much wall time has passed are skipped (the sweep must end < 60 s)
SLEEP_CYCLES = int(2e8)  # ~0.1 s of GPU time: longer than 64 calls of any case on the host


def _cases(torch, mc):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def rn(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(shape, generator=g, device=dev) * scale).to(dtype)

    def i32(x):
        return x.to(torch.int32).contiguous()

    cases = {}

    # ---- KDA decode B32 HV32 H16, fp32 pool in place (the bench's decode row).
    b, hv, h, k = 32, 32, 16, 128
    pool0 = rn(b * 2, hv, k, k, dtype=torch.float32, scale=0.05)
    a_log, dt_bias = torch.rand(hv, device=dev, generator=g), rn(hv, k, dtype=torch.float32, scale=0.5)
    dq = dict(q=rn(b, 1, h, k), k=rn(b, 1, h, k), v=rn(b, 1, hv, k), a=rn(b, 1, hv, k), b=rn(b, 1, hv),
              idx=i32(torch.randperm(b * 2, device=dev, generator=g)[:b]))

    def dec_make(prealloc):
        def make():
            return dict(pool=pool0.clone(), out=torch.empty(b, 1, hv, k, device=dev, dtype=torch.bfloat16)
                        if prealloc else None)
        return make

    def dec_fn(x):
        o, _ = mc.gated_delta_rule_decode(dq["q"], dq["k"], dq["v"], x["pool"], a_log, dq["a"], dt_bias, None, None,
                                          dq["b"], state_indices=dq["idx"], output=x["out"], use_lower_bound=True,
                                          apply_beta_sigmoid=True, inplace_final_state=True)
        return o, x["pool"]

    cases["kda decode B32 prealloc"] = (dec_fn, dec_make(True))
    cases["kda decode B32 alloc out"] = (dec_fn, dec_make(False))

    # ---- MSA paged decode B64 L8192 page 64 Hq64 Hkv8.
    bs, L, page, hq, hkv, d = 64, 8192, 64, 64, 8, 128
    n_pages = bs * L // page
    kc, vc = rn(n_pages, page, hkv, d), rn(n_pages, page, hkv, d)
    qd = rn(bs, hq, d)
    kv_idx = i32(torch.randperm(n_pages, device=dev, generator=g))
    qo = torch.ones(bs, dtype=torch.int32, device=dev)
    kvl = torch.full((bs,), L, dtype=torch.int32, device=dev)
    zero = torch.zeros(1, dtype=torch.int32, device=dev)

    def cums(x):
        return torch.cat([zero, torch.cumsum(x, 0, dtype=torch.int32)])

    meta = mc.MsaRuntimeMetadata(qo_lens=qo, kv_lens=kvl, qo_offset=kvl - qo, cu_seqlens_q=cums(qo),
                                 cu_seqlens_k=cums(kvl), seqused_k=kvl.clone(), kv_page_indptr=cums(kvl // page))
    splan = mc.msa_plan(bs, 1, L, hq, total_seqlen_k=n_pages * page, num_kv_heads=hkv, page_size=page)
    eplan = mc.msa_plan_from_lengths(qo.cpu(), kvl.cpu(), hq, hkv, page_size=page)

    def msa_make():
        return dict(out=torch.empty_like(qd))

    cases["msa paged decode static B64"] = (
        lambda x: mc.msa(qd, kc, vc, splan, kv_indices=kv_idx, out=x["out"], runtime_metadata=meta)[0], msa_make)
    cases["msa paged decode eager B64"] = (
        lambda x: mc.msa(qd, kc, vc, eplan, kv_indices=kv_idx, out=x["out"])[0], msa_make)

    # ---- Block-sparse decode B8, 32K keys, Hq64 Hkv4, 16 blocks (split-KV + merge).
    sb, sl, shq, shkv, topk = 8, 32768, 64, 4, 16
    sp = sb * sl // 128
    ks, vs = rn(sp, 128, shkv, d), rn(sp, 128, shkv, d)
    sq = rn(sb, shq, d)
    s_idx = i32(torch.randperm(sp, device=dev, generator=g))
    nblk = sl // 128
    kbi = i32(torch.rand(sb, shkv, nblk, device=dev, generator=g).argsort(-1)[..., :topk].sort(-1).values)
    sqo = torch.ones(sb, dtype=torch.int32, device=dev)
    skv = torch.full((sb,), sl, dtype=torch.int32, device=dev)
    smeta = mc.MsaRuntimeMetadata(qo_lens=sqo, kv_lens=skv, qo_offset=skv - sqo, cu_seqlens_q=cums(sqo),
                                  cu_seqlens_k=cums(skv), seqused_k=skv.clone(), kv_page_indptr=cums(skv // 128))
    spplan = mc.msa_plan(sb, 1, sl, shq, total_seqlen_k=sp * 128, num_kv_heads=shkv, page_size=128,
                         kv_block_num=topk, sparse_kernel_mode="decode")
    cases["sparse decode B8 (split-KV)"] = (
        lambda x: mc.sparse_decode_atten_func(sq, ks, vs, spplan, kv_indices=s_idx, kv_block_indexes=kbi,
                                              out=x["out"], runtime_metadata=smeta),
        lambda: dict(out=torch.empty_like(sq)))

    # ---- top-k select.
    scores = torch.randn((64, 64, 8192), generator=g, device=dev)
    cases["topk [64,64,8192]"] = (
        lambda x: mc.sparse_topk_select(scores, 16, output=x["sel"]),
        lambda: dict(sel=torch.empty((64, 64, 16), dtype=torch.int32, device=dev)))

    # ---- chunk_kda T1024 H64 (replayed only once its launcher records, see docs/host_path.md).
    T, H = 1024, 64
    cq, ck_, cv, cg = rn(1, T, H, k), rn(1, T, H, k), rn(1, T, H, k), rn(1, T, H, k, scale=0.1)
    cb = rn(1, T, H)
    c_alog, c_dtb = torch.rand(H, device=dev, generator=g), rn(H * k, dtype=torch.float32, scale=0.5)

    def chunk_fn(x):
        return mc.chunk_kda(cq, ck_, cv, cg, cb, A_log=c_alog, dt_bias=c_dtb, output_final_state=True,
                            output=x["out"], final_state=x["fs"])

    cases["chunk_kda T1024 H64"] = (
        chunk_fn, lambda: dict(out=torch.empty_like(cv), fs=torch.empty(1, H, k, k, device=dev)))
    return cases


def _flat(res):
    if isinstance(res, (tuple, list)):
        return [t for r in res for t in _flat(r)]
    return [] if res is None else [res]


_SLEEP_S = []


def _sleep_s(torch) -> float:
    """GPU seconds of one ``torch.cuda._sleep(SLEEP_CYCLES)``."""
    if not _SLEEP_S:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        e0.record()
        torch.cuda._sleep(SLEEP_CYCLES)
        e1.record()
        torch.cuda.synchronize()
        _SLEEP_S.append(e0.elapsed_time(e1) / 1e3)
    return _SLEEP_S[0]


def _host_us(torch, fn, x):
    samples, ok = [], True
    busy = _sleep_s(torch)
    for _ in range(SAMPLES):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn(x)
        t = time.perf_counter() - t0
        ok = ok and t < 0.8 * busy  # ended well before the sleep: no launch waited for the GPU
        samples.append(t / CALLS * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples), ok


def _plain_us(torch, fn, x):
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(CALLS):
        fn(x)
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / CALLS * 1e3


def main() -> int:
    outdir = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/host_path")
    outdir.mkdir(parents=True, exist_ok=True)
    import torch

    import mate_cupy as mc
    from mate_cupy import _launch_cache as lc

    replays = [0]
    real_replay = lc.replay

    def counting(recipe, ptrs, first):
        replays[0] += 1
        return real_replay(recipe, ptrs, first)

    lc.replay = counting
    rows, prof = [], io.StringIO()
    t_start = time.perf_counter()
    for name, (fn, make) in _cases(torch, mc).items():
        row = {"case": name}
        t_case = time.perf_counter()
        if t_case - t_start > BUDGET_S:
            row["error"] = f"skipped: the sweep's {BUDGET_S} s budget is spent"
            rows.append(row)
            continue
        try:
            # Correctness: full path vs replay, same inputs, fresh outputs/states.
            lc.set_enabled(False)
            x_full = make()
            ref = [t.clone() for t in _flat(fn(x_full))]
            lc.set_enabled(True)
            fn(make())  # records
            before = replays[0]
            x_rep = make()
            got = _flat(fn(x_rep))
            torch.cuda.synchronize()
            row["replayed"] = replays[0] > before
            row["check"] = "bit-exact" if all(torch.equal(a, b) for a, b in zip(ref, got)) and len(ref) == len(got) \
                else "MISMATCH max|d|=" + str(max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref, got)))
            # Host time: replay off, then on.
            x = make()
            lc.set_enabled(False)
            row["host_us_full"], ok_full = _host_us(torch, fn, x)
            lc.set_enabled(True)
            fn(x)
            row["host_us_replay"], ok_rep = _host_us(torch, fn, x)
            row["busy_ok"] = ok_full and ok_rep
            row["plain_us"] = _plain_us(torch, fn, x)
            row["graph_us"] = graph_replay_us(torch, lambda: fn(x))
            pr = cProfile.Profile()
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            pr.enable()
            for _ in range(CALLS):
                fn(x)
            pr.disable()
            torch.cuda.synchronize()
            prof.write(f"\n===== {name}: replay on, {row['host_us_replay']:.1f} us/call host\n")
            pstats.Stats(pr, stream=prof).sort_stats("tottime").print_stats(15)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            lc.set_enabled(True)
            torch.cuda.synchronize()
        row["case_s"] = round(time.perf_counter() - t_case, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    lc.replay = real_replay
    (outdir / f"{NAME}.json").write_text(json.dumps(rows, indent=1))
    (outdir / f"{NAME}_profile.txt").write_text(prof.getvalue())

    def f(v):
        return f"{v:8.1f}" if isinstance(v, float) else f"{str(v)[:8]:>8s}"

    print(f"\n{'case':30s} {'full us':>8s} {'replay':>8s} {'plain':>8s} {'graph':>8s} busy replayed check")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:30s} ERROR {r['error'][:90]}")
            continue
        print(f"{r['case']:30s} {f(r['host_us_full'])} {f(r['host_us_replay'])} {f(r['plain_us'])} "
              f"{f(r['graph_us'])} {str(r['busy_ok']):5s} {str(r['replayed']):8s} {r['check']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
