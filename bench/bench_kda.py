"""KDA cases (issues 6, 7): the recurrent decode step and the fused chunk forward.

Peer: flash-linear-attention (``fla-core`` 0.6.0, Triton), configured to compute
exactly what ours does: gate ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``
in kernel (fla: ``use_gate_in_kernel=True, safe_gate=True, lower_bound=-5``),
q/k l2norm in kernel, beta sigmoid in kernel, V-first ``[N, HV, V, K]`` state
(fla: ``state_v_first=True``), so no layout conversion is needed on either side.
Also measured: our ``chunk_kda`` first-call wall time (NVRTC compile) in a fresh
process, with an empty and with a filled kernel disk cache.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from . import ours
from .bench_attention import _gen, _randn
from .checks import kda_prefix, kda_step, rel_err
from .fla_peer import FlaSession, gpu_dir_name
from .harness import Bound, Case, Impl, free_device_memory, sized
from .models import kda_chunk_flops, kda_decode_bytes
from .report import Target, new_record

K = V = 128
LOWER_BOUND = -5.0
PREFIX_STEPS = 64  # tokens per sequence checked against the recurrent fp32 reference

SESSION: FlaSession | None = None


def _gate_params(g, hv, device):
    import torch

    a_log = torch.log(torch.empty(hv, device=device).uniform_(1.0, 16.0, generator=g))
    dt_bias = torch.randn(hv * K, generator=g, device=device) * 0.5
    return a_log, dt_bias


# --------------------------------------------------------------------------- decode

def _ours_decode(inputs, v_first: bool, states) -> Bound:
    """Our in-place decode step over a copy of the inputs' pool (every impl starts from the same
    state); optional ``acc`` / ``cu`` inputs are the speculative and varlen arguments.
    ``states(pool, inputs[0])``: the updated states the check compares."""
    import torch

    pool = inputs[0]["pool"].clone()
    outs = [torch.empty_like(x["v"]) for x in inputs]

    def run(i):
        x = inputs[i]
        return ours.first(ours.gated_delta_rule_decode(
            x["q"], x["k"], x["v"], pool, x["A_log"], x["a"], x["dt_bias"], x.get("acc"), x.get("cu"), x["b"],
            state_indices=x["idx"], output=outs[i], use_qk_l2norm=True, lower_bound=LOWER_BOUND,
            use_gate_in_kernel=True, use_lower_bound=True, apply_beta_sigmoid=True, inplace_final_state=True,
            state_v_first=v_first))

    return Bound(run, result=lambda out: (out, states(pool, inputs[0])))


def _fla_decode(session, inputs, v_first: bool, states) -> Bound:
    """fla's ``fused_recurrent_kda_fwd`` on the same step as :func:`_ours_decode` (``cu64``:
    its int64 ``cu_seqlens``)."""
    import torch

    fla = session.load()
    pool = inputs[0]["pool"].clone()
    outs = [torch.empty_like(x["v"]) for x in inputs]

    def run(i):
        x = inputs[i]
        return fla.fused_recurrent_kda_fwd(
            q=x["q"], k=x["k"], v=x["v"], g=x["a"], beta=x["b"], A_log=x["A_log"], dt_bias=x["dt_bias"],
            initial_state=pool, scale=None, output_final_state=False, inplace_final_state=True,
            state_v_first=v_first, cu_seqlens=x.get("cu64"), ssm_state_indices=x["idx"],
            num_accepted_tokens=x.get("acc"), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND, out=outs[i])[0]

    return Bound(run, result=lambda out: (out, states(pool, inputs[0])))


def decode_case(cfg, batch: int, hv: int, h: int, *, session: FlaSession, target: Target | None,
                v_first: bool = True, identity_slots: bool = False, state_dtype: str = "float32") -> Case:
    """One in-place decode step over a float32 or bfloat16 pool of ``batch * n_sets`` slots:
    V-first ``[P, HV, V, K]`` (the bench's case) or K-first ``[P, HV, K, V]`` (fla's default),
    with each input set's slots a random permutation of its share of the pool or, with
    ``identity_slots``, the share in order."""
    dev = cfg.device
    state_bytes = 4 if state_dtype == "float32" else 2

    def make_inputs(n):
        import torch

        g = _gen(dev, 7)
        pool_size = batch * n  # each input set updates its own slots: rotation covers the whole pool
        pool = (torch.randn((pool_size, hv, V, K) if v_first else (pool_size, hv, K, V), generator=g,
                            device=dev) * 0.05).to(getattr(torch, state_dtype))
        if identity_slots:
            perm = torch.arange(pool_size, device=dev, dtype=torch.int32)
        else:
            perm = torch.randperm(pool_size, generator=g, device=dev).to(torch.int32)
        a_log, dt_bias = _gate_params(g, hv, dev)
        dt_bias = dt_bias.view(hv, K)
        return [{"q": _randn((batch, 1, h, K), g, dev), "k": _randn((batch, 1, h, K), g, dev),
                 "v": _randn((batch, 1, hv, V), g, dev), "a": _randn((batch, 1, hv, K), g, dev),
                 "b": _randn((batch, 1, hv), g, dev), "idx": perm[i * batch:(i + 1) * batch].contiguous(),
                 "pool": pool, "A_log": a_log, "dt_bias": dt_bias} for i in range(n)]

    def states(pool, x):
        return pool[x["idx"].long()]

    def ours_build(inputs):
        return _ours_decode(inputs, v_first, states)

    def fla_build(inputs):
        return _fla_decode(session, inputs, v_first, states)

    def check(results, inp):
        idx = inp["idx"].long()
        vf = (lambda st: st) if v_first else (lambda st: st.transpose(-1, -2))  # [N, HV, V, K] view
        o, s = kda_step(vf(inp["pool"][idx]).float(), inp["q"][:, 0], inp["k"][:, 0], inp["v"][:, 0], inp["a"][:, 0],
                        inp["b"][:, 0], inp["A_log"], inp["dt_bias"], LOWER_BOUND, K ** -0.5)
        out = {}
        for name, (o_impl, s_impl) in results.items():
            out[name] = {"err": max(rel_err(o_impl[:, 0], o), rel_err(vf(s_impl), s)),
                         "err_vs": "fp32 torch step (max of output and updated-state errors)"}
        return out

    layout = "[P, HV, V, K]" if v_first else "[P, HV, K, V]"
    nbytes = kda_decode_bytes(batch, hv, state_bytes=state_bytes)
    return Case(
        op="kda decode",
        name=f"B{batch} HV{hv} H{h} {'fp32' if state_bytes == 4 else 'bf16'} pool in place"
        + ("" if v_first else " K-first") + (" identity slots" if identity_slots else ""),
        make_inputs=make_inputs, set_bytes=nbytes,
        impls=[Impl("mate_cupy", "ours", ours_build, capture_safe=True),
               Impl("fla", "peer", fla_build, family="fla", capture_safe=True, guard=session.guard)],
        metric="tbps", bytes=nbytes, baseline="fla", target=target, check=check, tol=1e-2,
        params=dict(B=batch, T=1, HV=hv, H=h, K=K, V=V, state=f"{state_dtype} {layout}", qkv="bfloat16",
                    lower_bound=LOWER_BOUND, gate_in_kernel=True, beta_sigmoid=True, l2norm=True,
                    bytes_model="state read + written once (TB/s; ceiling fraction against the measured copy)"),
    )


def decode_tokens_case(cfg, batch: int, hv: int, h: int, *, session: FlaSession, target: Target | None,
                       tokens: int = 4, varlen: bool = False) -> Case:
    """Several tokens per sequence, in place over a float32 V-first pool with ``[N, C]`` slots
    (the state after token ``t`` goes to ``state_indices[n, t]``):

    * speculative verify (``varlen=False``): ``[B, T]`` tokens, ``num_accepted_tokens[n]``
      picks the read slot ``state_indices[n, acc - 1]`` (fla: ``num_accepted_tokens``);
    * varlen (``varlen=True``): ``batch`` sequences of 1..``tokens`` packed tokens with
      ``cu_seqlens``, read slot ``state_indices[n, 0]``.

    Bytes: one state read and one written per token of each sequence."""
    dev = cfg.device
    state_elems = hv * V * K

    def lengths():
        import torch

        if not varlen:
            return [tokens] * batch
        g = torch.Generator().manual_seed(11)
        return torch.randint(1, tokens + 1, (batch,), generator=g).tolist()

    lens = lengths()
    total = int(sum(lens))
    nbytes = 4.0 * state_elems * (batch + total)

    def make_inputs(n):
        import torch

        g = _gen(dev, 9)
        per_set = batch * tokens
        pool = torch.randn((per_set * n, hv, V, K), generator=g, device=dev) * 0.05
        perm = torch.randperm(per_set * n, generator=g, device=dev).to(torch.int32)
        a_log, dt_bias = _gate_params(g, hv, dev)
        dt_bias = dt_bias.view(hv, K)
        shp = (1, total) if varlen else (batch, tokens)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        acc = None if varlen else torch.randint(1, tokens + 1, (batch,), generator=g, device=dev).to(torch.int32)
        return [{"q": _randn(shp + (h, K), g, dev), "k": _randn(shp + (h, K), g, dev),
                 "v": _randn(shp + (hv, V), g, dev), "a": _randn(shp + (hv, K), g, dev),
                 "b": _randn(shp + (hv,), g, dev), "idx": perm[i * per_set:(i + 1) * per_set].view(batch, tokens),
                 "acc": acc, "cu": cu if varlen else None, "cu64": cu.long() if varlen else None,
                 "pool": pool, "A_log": a_log, "dt_bias": dt_bias} for i in range(n)]

    def written(pool, x):
        """The states each sequence's tokens wrote, [total, HV, V, K] in token order."""
        import torch

        return torch.cat([pool[x["idx"][i, :ln].long()] for i, ln in enumerate(lens)])

    def ours_build(inputs):
        return _ours_decode(inputs, True, written)

    def fla_build(inputs):
        return _fla_decode(session, inputs, True, written)

    def check(results, inp):
        o_ref, s_ref = decode_tokens_reference(inp, lens)
        out = {}
        for name, (o_impl, s_impl) in results.items():
            o_flat = o_impl.reshape(-1, hv, V)
            out[name] = {"err": max(rel_err(o_flat, o_ref), rel_err(s_impl, s_ref)),
                         "err_vs": "fp32 torch steps (max of output and every stored state's error)"}
        return out

    label = (f"varlen {batch} seqs of 1-{tokens} tokens" if varlen
             else f"B{batch} T{tokens} speculative verify")
    return Case(
        op="kda decode", name=f"{label} HV{hv} H{h} fp32 pool [N, C] slots",
        make_inputs=make_inputs, set_bytes=nbytes, max_sets=4,
        impls=[Impl("mate_cupy", "ours", ours_build, capture_safe=True),
               Impl("fla", "peer", fla_build, family="fla", capture_safe=True, guard=session.guard)],
        metric="tbps", bytes=nbytes, baseline="fla", target=target, check=check, tol=1e-2,
        params=dict(B=batch, T=tokens, tokens=total, varlen=varlen, speculative=not varlen, HV=hv, H=h, K=K, V=V,
                    state="float32 [P, HV, V, K]", slots="[N, C] in place", qkv="bfloat16",
                    lower_bound=LOWER_BOUND, gate_in_kernel=True, beta_sigmoid=True, l2norm=True,
                    bytes_model="one state read per sequence, one written per token"),
    )


def decode_tokens_reference(inp, lens):
    """fp32 torch reference of ``decode_tokens_case``: outputs ``[total, HV, V]`` and the
    state after every token ``[total, HV, V, K]``, in token order."""
    import torch

    idx = inp["idx"].long()
    n = idx.shape[0]
    read_col = (inp["acc"].long() - 1) if inp["acc"] is not None else torch.zeros(n, dtype=torch.long,
                                                                                   device=idx.device)
    S = inp["pool"][idx[torch.arange(n, device=idx.device), read_col]].float()
    hv = S.shape[1]
    flat = {k_: inp[k_].reshape((-1,) + tuple(inp[k_].shape[2:])) for k_ in ("q", "k", "v", "a", "b")}
    starts = torch.tensor([0] + list(lens[:-1]), device=idx.device).cumsum(0)
    lens_t = torch.tensor(lens, device=idx.device)
    o_all = torch.empty((int(sum(lens)), hv, V), device=idx.device)
    s_all = torch.empty((int(sum(lens)), hv, V, K), device=idx.device)
    for t in range(max(lens)):
        act = lens_t > t
        rows = (starts + t).clamp(max=o_all.shape[0] - 1)
        o, S_new = kda_step(S, flat["q"][rows], flat["k"][rows], flat["v"][rows], flat["a"][rows], flat["b"][rows],
                            inp["A_log"], inp["dt_bias"], LOWER_BOUND, K ** -0.5)
        S = torch.where(act[:, None, None, None], S_new, S)
        o_all[rows[act]] = o[act]
        s_all[rows[act]] = S[act]
    return o_all, s_all


# --------------------------------------------------------------------------- chunk

def chunk_case(cfg, seqs: list, h: int, hv: int, *, varlen: bool, session: FlaSession,
               target: Target | None) -> Case:
    dev = cfg.device
    total = int(sum(seqs))
    n_seq = len(seqs)

    def make_inputs(n):
        import torch

        g = _gen(dev, 8)
        a_log, dt_bias = _gate_params(g, hv, dev)
        cu = None
        if varlen:
            cu = torch.tensor([0] + list(torch.tensor(seqs).cumsum(0).tolist()), dtype=torch.int32, device=dev)
        return [{"q": _randn((1, total, h, K), g, dev), "k": _randn((1, total, h, K), g, dev),
                 "v": _randn((1, total, hv, V), g, dev), "g": _randn((1, total, hv, K), g, dev),
                 "beta": _randn((1, total, hv), g, dev), "A_log": a_log, "dt_bias": dt_bias,
                 "cu": cu, "cu64": None if cu is None else cu.long(),
                 "cu64_cpu": None if cu is None else cu.long().cpu()} for _ in range(n)]

    def ours_build(inputs):
        import torch

        outs = [torch.empty_like(x["v"]) for x in inputs]
        finals = [torch.empty((n_seq, hv, V, K), dtype=torch.float32, device=x["v"].device) for x in inputs]

        def run(i):
            x = inputs[i]
            return ours.first(ours.chunk_kda(
                x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                lower_bound=LOWER_BOUND, use_qk_l2norm_in_kernel=True, output_final_state=True,
                cu_seqlens=x["cu"], output=outs[i], final_state=finals[i]))

        return Bound(run)

    def fla_build(inputs):
        fla = session.load()

        def run(i):
            x = inputs[i]
            return fla.chunk_kda(
                q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], scale=None, initial_state=None,
                output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND, state_v_first=True,
                cu_seqlens=x["cu64"], cu_seqlens_cpu=x["cu64_cpu"], A_log=x["A_log"], dt_bias=x["dt_bias"])[0]

        return Bound(run)

    def check(results, inp):
        import torch

        starts = (inp["cu"][:-1].long() if inp["cu"] is not None
                  else torch.zeros(1, dtype=torch.long, device=inp["q"].device))
        steps = min(PREFIX_STEPS, min(seqs))
        ref = kda_prefix(inp["q"][0], inp["k"][0], inp["v"][0], inp["g"][0], inp["beta"][0], inp["A_log"],
                         inp["dt_bias"].view(hv, K), starts, steps, LOWER_BOUND, K ** -0.5)
        rows = starts[:, None] + torch.arange(steps, device=starts.device)[None, :]
        return {name: {"err": rel_err(out[0][rows], ref),
                       "err_vs": f"fp32 recurrent reference, first {steps} tokens of each sequence"}
                for name, out in results.items()}

    label = f"varlen {n_seq}x{seqs[0]}" if varlen else f"B1 T{total}"
    return Case(
        op="kda chunk", name=f"{label} H{h} HV{hv}", make_inputs=make_inputs,
        set_bytes=2.0 * total * (2 * h * K + 2 * hv * K + hv),
        impls=[Impl("mate_cupy", "ours", ours_build),
               Impl("fla", "peer", fla_build, family="fla", guard=session.guard)],
        metric="tflops", flops=kda_chunk_flops(total, hv), baseline="fla", target=target, check=check, tol=2e-2,
        params=dict(seqlens=list(seqs), varlen=varlen, H=h, HV=hv, K=K, V=V, dtype="bfloat16",
                    lower_bound=LOWER_BOUND, gate_in_kernel=True, beta_sigmoid=True, l2norm=True,
                    final_state="float32 [N, HV, V, K]", flop_model="chunk-64 (bench/models.py)"),
    )


# --------------------------------------------------------------------------- cases / after

def default_fla_configs(gpu_name: str) -> str | None:
    d = Path(__file__).resolve().parent / "fla_configs" / gpu_dir_name(gpu_name)
    return str(d) if d.is_dir() else None


def cases(cfg) -> list:
    global SESSION
    if SESSION is None:
        SESSION = FlaSession(cfg.fla_budget_s, cfg.fla_configs)
    s = SESSION
    beat = Target("speedup", 1.0, "fla")
    small_batch = Target("speedup", 1.5, "fla")  # issue 6: B = 32 at >= 1.5x fla
    chunk_target = Target("speedup", 1.2, "fla")
    out = []
    hv, h = sized(cfg, (32, 16), (32, 16), (4, 2))
    for b in sized(cfg, (32, 256, 1024), (32, 256), (4,)):
        out.append(decode_case(cfg, b, hv, h, session=s, target=small_batch if b == 32 else beat))
    for b in sized(cfg, (32, 256, 1024), (256,), (4,)):  # bf16 pools: half the bytes
        out.append(decode_case(cfg, b, hv, h, session=s, target=beat, state_dtype="bfloat16"))
    for b, heads in sized(cfg, [(256, 64), (256, 96)], [(64, 64), (64, 96)], [(2, 8)]):  # more value heads
        out.append(decode_case(cfg, b, heads, heads // 2, session=s, target=beat))
    for b in sized(cfg, (64, 256), (64,), (3,)):  # speculative verify, 4 tokens per sequence
        out.append(decode_tokens_case(cfg, b, hv, h, session=s, target=beat, tokens=4))
    b = sized(cfg, 256, 64, 3)
    out.append(decode_tokens_case(cfg, b, hv, h, session=s, target=beat, tokens=4, varlen=True))
    dense = sized(cfg, [(8192, 64), (8192, 96), (32768, 32)], [(2048, 64)], [(128, 2)])
    for t, heads in dense:
        out.append(chunk_case(cfg, [t], heads, heads, varlen=False, session=s, target=chunk_target))
    n, t, heads = sized(cfg, (8, 1024, 64), (4, 512, 64), (2, 64, 2))
    out.append(chunk_case(cfg, [t] * n, heads, heads, varlen=True, session=s, target=chunk_target))
    return out


FIRST_CALL_OPS = (  # (record op, first_call.py arguments, params)
    ("kda chunk first call", ["--op", "chunk"], {"op": "chunk_kda", "B": 1, "T": 1024}),
    ("kda decode first call", ["--op", "decode"], {"op": "gated_delta_rule_decode", "B": 32, "T": 1,
                                                   "state": "float32 [P, HV, V, K]"}),
    ("kda decode first call", ["--op", "decode", "--state-dtype", "bfloat16"],
     {"op": "gated_delta_rule_decode", "B": 32, "T": 1, "state": "bfloat16 [P, HV, V, K]"}),
    ("kda decode first call", ["--op", "decode-spec"], {"op": "gated_delta_rule_decode", "B": 32, "T": 4,
                                                        "state": "float32 [P, HV, V, K]", "slots": "[N, 4]"}),
)


def first_call_records(cfg, *, tokens: int = 1024, heads: int = 64, log=print) -> list[dict]:
    """Wall time of the first call of every KDA op in fresh processes: cold (an empty kernel
    disk cache of its own) then warm (the cache the cold run filled). Prebuilt cubins
    (``MATE_CUPY_CUBIN_DIR``) are hidden from the child, so cold means compiled."""
    free_device_memory()
    here = Path(__file__).resolve().parent
    recs = []
    for op, argv, params in FIRST_CALL_OPS:
        cache = tempfile.mkdtemp(prefix="mate_cupy_kernel_cache_")
        env = dict(os.environ, CUPY_CACHE_DIR=cache,
                   PYTHONPATH=os.pathsep.join([str(here.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        env.pop("MATE_CUPY_CUBIN_DIR", None)
        args = argv + ["--tokens", str(tokens), "--heads", str(heads)]
        shape = f"B1 T{tokens} H{heads}" if params["op"] == "chunk_kda" else (
            f"B{params['B']} T{params['T']} HV{heads} {params['state'].split()[0]} pool")
        for label in ("cold: empty kernel cache", "warm: kernel disk cache filled"):
            rec = new_record(op, f"{shape} {label}", "mate_cupy", "ours", metric=None,
                             params=dict(params, HV=heads, CUPY_CACHE_DIR="fresh temporary dir"))
            try:
                p = subprocess.run([sys.executable, str(here / "first_call.py"), *args], env=env,
                                   capture_output=True, text=True, timeout=600)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
                if p.returncode != 0 or not lines:
                    tail = " ".join((p.stderr or p.stdout).strip().splitlines()[-3:])
                    raise RuntimeError(f"first_call.py exited {p.returncode}: {tail[-400:]}")
                res = json.loads(lines[-1])
                rec.update(ms=res["first_call_ms"], first_call_ms=res["first_call_ms"],
                           note=f"wall time of the first call in a new process (import excluded); second call "
                                f"{res['second_call_ms']:.2f} ms")
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {' '.join(str(e).split())}"
            log(f"[{op}] {shape} {label}: " + (f"{rec['ms']:.0f} ms" if rec["ms"] else rec["error"]))
            recs.append(rec)
    return recs


def after(cfg, timer, log=print) -> list[dict]:
    """Extra records after the KDA cases; saves fla's tuned configs into the output folder."""
    recs = []
    if cfg.device == "cuda" and cfg.size != "tiny":
        recs += first_call_records(cfg, heads=sized(cfg, 64, 64, 2), log=log)
    if SESSION is not None and SESSION.modules is not None and cfg.outdir:
        try:
            import torch

            gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
            files = SESSION.dump_configs(Path(cfg.outdir) / "fla_configs" / gpu_dir_name(gpu))
            if files:
                log(f"fla autotune configs: {len(files)} kernels saved under {Path(files[0]).parent}")
        except Exception as e:
            log(f"could not save fla configs: {type(e).__name__}: {e}")
    return recs
