"""``python -m mate_cupy demo``: the MSA pipeline and a KDA prefill -> decode, checked.

* MSA, on a causal GQA prefill of two requests: ``msa`` (dense attention plus the block
  max scores) -> ``sparse_topk_select`` (the top-k 128-key blocks per query and head, the
  query positions taken from the plan so no block past a query is chosen) ->
  ``sparse_msa`` over a paged KV cache with those blocks.
* KDA: ``chunk_kda`` over a prompt (prefill, returning the final state) ->
  ``gated_delta_rule_decode`` of the next token from that state, in place.

With a CUDA GPU the inputs are CuPy arrays and the kernels run; each result is compared
with the float64 NumPy reference (the same call on host arrays). Without one the NumPy
path runs, which *is* the reference; each result is then compared with an independent
computation (a direct softmax, the token-by-token KDA recurrence, the prefill of one more
token). The relative errors are printed; a result off by more than its tolerance fails
the demo (exit status 1).
"""
from __future__ import annotations

import time

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
BLOCK = 128
TOL = 2e-2  # bf16 inputs and outputs: the outputs are rounded to bfloat16 (rel. 2**-9 each)


def backend(force_cpu: bool = False):
    """``(cupy or None, where, why)``: the arrays the demo runs on and why."""
    from .jit import MIN_SM, arch_capability

    if force_cpu:
        return None, "NumPy", "--cpu: running the float64 NumPy references"
    try:
        import cupy
    except ImportError:
        return None, "NumPy", "CuPy is not installed: running the float64 NumPy references"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device
        msg = str(e).split("\n")[0]
        return None, "NumPy", f"no CUDA GPU visible ({msg}): running the float64 NumPy references"
    if n == 0:
        return None, "NumPy", "no CUDA GPU visible: running the float64 NumPy references"
    from .cli import gpu_info

    info = gpu_info()
    if info is None:
        return None, "NumPy", "the CUDA GPU could not be queried: running the float64 NumPy references"
    name, arch = info
    if arch_capability(arch) < MIN_SM:
        return None, "NumPy", (f"CUDA GPU {name} ({arch}) is older than sm_{MIN_SM}, which the kernels need: "
                               f"running the float64 NumPy references")
    return cupy, "GPU", (f"CUDA GPU: {name} ({arch}), running the kernels on CuPy arrays; "
                         f"each result is compared with the float64 NumPy reference")


def rel_err(a, b) -> float:
    """``|a - b| / |b|`` over the entries where ``b`` is finite (0 when ``b`` is 0)."""
    a = np.asarray(_host(a), dtype=np.float64)
    b = np.asarray(_host(b), dtype=np.float64)
    fin = np.isfinite(b)
    a, b = a[fin], b[fin]
    den = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / den) if den else float(np.abs(a).max(initial=0.0))


def _elapsed_ms(xp, t0: float) -> float:
    """Milliseconds since ``t0``, after the GPU's queued work (``xp`` CuPy) has finished."""
    if xp is not None:
        xp.cuda.Device().synchronize()
    return (time.perf_counter() - t0) * 1e3


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


class _Report:
    def __init__(self):
        self.failed = []

    def compare(self, what: str, got, want, tol: float = TOL, against: str = "reference") -> None:
        e = rel_err(got, want)
        ok = e <= tol
        if not ok:
            self.failed.append(what)
        print(f"    {what} vs {against}: rel err {e:.1e} ({'ok' if ok else f'FAILED, over {tol:.0e}'})")

    def check(self, what: str, ok: bool, detail: str) -> None:
        if not ok:
            self.failed.append(what)
        print(f"    {what}: {detail} ({'ok' if ok else 'FAILED'})")


# ----------------------------------------------------------------------------- MSA


def _msa_inputs(rng):
    """Two causal prefill requests; a few key blocks per request share a direction with the
    queries (planted retrieval blocks), so the top-k blocks hold most of the attention."""
    qo = np.array([256, 384], np.int32)
    kv = np.array([768, 1152], np.int32)
    hq, hkv, d = 16, 2, 128
    q = rng.standard_normal((int(qo.sum()), hq, d))
    k = rng.standard_normal((int(kv.sum()), hkv, d))
    v = rng.standard_normal((int(kv.sum()), hkv, d))
    u = rng.standard_normal(d)
    u *= 6.0 / np.linalg.norm(u)
    q += u
    k0 = 0
    for n in kv:
        for blk in rng.choice(int(n) // BLOCK - 1, size=2, replace=False):
            k[k0 + blk * BLOCK:k0 + (blk + 1) * BLOCK] += u
        k0 += int(n)
    return qo, kv, hq, hkv, d, q.astype(BF16), k.astype(BF16), v.astype(BF16)


def _positions(qo, kv) -> np.ndarray:
    """Absolute position of each query row (bottom-right causal alignment)."""
    return np.concatenate([np.arange(n - m, n, dtype=np.int64) for m, n in zip(qo, kv)])


def _paged(x, kv, perm):
    """Dense ``[total_k, Hkv, D]`` keys -> a ``[pages, 128, Hkv, D]`` cache (pages in the order
    ``perm``) and the flat page ids of each request (CSR by page counts)."""
    pages, k0 = [], 0
    for n in kv:
        seq = x[k0:k0 + n]
        pad = -n % BLOCK
        seq = np.concatenate([seq, np.zeros((pad,) + seq.shape[1:], seq.dtype)])
        pages += list(seq.reshape(-1, BLOCK, *seq.shape[1:]))
        k0 += n
    cache = np.empty((len(pages),) + pages[0].shape, x.dtype)
    cache[perm] = np.stack(pages)
    return cache, perm.astype(np.int32)


def _direct_block_max(q, k, qo, kv, pos):
    """max_j q.k_j over the admissible keys of each 128-key block (float64, -inf when none)."""
    q = q.astype(np.float64)
    k = k.astype(np.float64)
    r = q.shape[1] // k.shape[1]
    nt = -(-int(kv.max()) // BLOCK)
    out = np.full((q.shape[0], q.shape[1], nt), -np.inf)
    q0 = k0 = 0
    for m, n in zip(qo, kv):
        s = np.einsum("ihd,jhd->ihj", q[q0:q0 + m], np.repeat(k[k0:k0 + n], r, axis=1))
        s = np.where(np.arange(n)[None, None, :] > pos[q0:q0 + m, None, None], -np.inf, s)
        s = np.pad(s, ((0, 0), (0, 0), (0, nt * BLOCK - n)), constant_values=-np.inf)
        out[q0:q0 + m] = s.reshape(m, q.shape[1], nt, BLOCK).max(axis=-1)
        q0, k0 = q0 + m, k0 + n
    return out


def _direct_sparse(q, k, v, qo, kv, pos, ids):
    """softmax over the admissible keys of each query's selected blocks (float64); ``ids``
    ``[total_q, Hkv, W]``: one list per KV head, shared by its query heads."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    hq, d = q.shape[1], q.shape[2]
    r = hq // k.shape[1]
    ids = np.repeat(ids, r, axis=1)
    out = np.zeros(q.shape)
    q0 = k0 = 0
    for m, n in zip(qo, kv):
        s = np.einsum("ihd,jhd->ihj", q[q0:q0 + m], np.repeat(k[k0:k0 + n], r, axis=1)) * d ** -0.5
        sel = np.zeros((m, hq, -(-n // BLOCK) + 1), bool)
        blk = np.where(ids[q0:q0 + m] >= 0, ids[q0:q0 + m], sel.shape[2] - 1)
        np.put_along_axis(sel, blk, True, axis=2)
        ok = sel[:, :, np.arange(n) // BLOCK] & (np.arange(n)[None, None, :] <= pos[q0:q0 + m, None, None])
        s = np.where(ok, s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out[q0:q0 + m] = np.einsum("ihj,jhd->ihd", p, np.repeat(v[k0:k0 + n], r, axis=1))
        q0, k0 = q0 + m, k0 + n
    return out


def _msa_demo(xp, rng, rep: _Report) -> None:
    import mate_cupy as mc
    from mate_cupy.reference.msa import block_softmax_mass

    qo, kv, hq, hkv, d, q, k, v = _msa_inputs(rng)
    topk, begin, end = 4, 1, 1
    nt = -(-int(kv.max()) // BLOCK)
    pos = _positions(qo, kv)
    dev = (lambda a: a) if xp is None else xp.asarray
    where = "CPU reference" if xp is None else "GPU"
    on = None if xp is None else xp.cuda.Device().id

    def plans(device):
        dense = mc.msa_plan_from_lengths(qo, kv, hq, hkv, split_prefill_decode=False, output_maxscore=True,
                                         device=device)
        sparse = mc.sparse_msa_plan(qo, kv, hq, hkv, page_size=BLOCK, kv_block_num=topk, force_begin_blocks=begin,
                                    force_end_blocks=end, device=device)
        return dense, sparse

    def select(ms, dense_plan):
        # The sparse kernels read one block list per (query, KV head), shared by its Hq/Hkv query
        # heads: select on the group's max score; the query positions come from the plan's lengths.
        ms = ms.reshape(ms.shape[0], hkv, hq // hkv, ms.shape[2]).max(axis=2)
        return mc.sparse_topk_select(ms, topk, force_begin_blocks=begin, force_end_blocks=end, plan_info=dense_plan)

    perm = rng.permutation(sum(-(-int(n) // BLOCK) for n in kv))
    kc, kv_indices = _paged(k, kv, perm)
    vc, _ = _paged(v, kv, perm)

    t0 = time.perf_counter()
    dense_plan, sparse_plan = plans(on if xp is not None else "cpu")
    out_dense, max_score = mc.msa(dev(q), dev(k), dev(v), dense_plan)
    ids = select(max_score, dense_plan)
    out_sparse, _ = mc.sparse_msa(dev(q), dev(kc), dev(vc), sparse_plan, kv_indices=dev(kv_indices),
                                  kv_block_indexes=ids)
    ms = _elapsed_ms(xp, t0)
    print(f"  causal GQA prefill: Hq {hq} / Hkv {hkv}, D {d}, bf16, q lengths {qo.tolist()}, "
          f"k lengths {kv.tolist()} ({nt} blocks of {BLOCK} keys at most) [{where}, {ms:.0f} ms"
          f"{', first call compiles the kernels' if xp is not None else ''}]")
    print(f"  1. msa (dense, output_maxscore): out {tuple(out_dense.shape)}, max_score {tuple(max_score.shape)}")
    h_ids = _host(ids)
    if xp is not None:
        host_dense, host_sparse = plans("cpu")
        ref_out, ref_ms = mc.msa(q, k, v, host_dense)
        rep.compare("dense out", out_dense, ref_out)
        rep.compare("max_score", max_score, ref_ms, tol=1e-2)
    else:
        rep.compare("max_score", max_score, _direct_block_max(q, k, qo, kv, pos), tol=1e-6,
                    against="a direct float64 q.k block max")
    print(f"  2. sparse_topk_select top-{topk} (+{begin} first, +{end} last block, counted in the {topk}) on the "
          f"max over each KV head's {hq // hkv} query heads: ids {tuple(h_ids.shape)}; last query, KV head 0 -> "
          f"{h_ids[-1, 0].tolist()}")
    if xp is not None:
        ref_ids = select(_host(max_score), host_dense)
        rep.check("ids vs reference (same scores)", np.array_equal(h_ids, ref_ids),
                  f"{np.mean(h_ids == ref_ids):.1%} equal")
    last_block = pos // BLOCK
    past = int(((h_ids > last_block[:, None, None]) & (h_ids >= 0)).sum())
    rep.check("causal selection", past == 0, f"{past} selected blocks past a query's position")
    mass = block_softmax_mass(q, k, np.concatenate([[0], np.cumsum(qo)]), np.concatenate([[0], np.cumsum(kv)]))
    per_q = np.repeat(h_ids, hq // hkv, axis=1)
    recall = np.take_along_axis(mass, np.maximum(per_q, 0), axis=2) * (per_q >= 0)
    print(f"    the selected blocks hold {recall.sum(axis=2).mean():.1%} of the dense softmax mass "
          f"(mean over queries and heads; {topk} of up to {nt} blocks)")
    print(f"  3. sparse_msa over a paged cache ({kc.shape[0]} pages of {BLOCK}, shuffled), those blocks: "
          f"out {tuple(out_sparse.shape)}")
    if xp is not None:
        ref_sparse, _ = mc.sparse_msa(q, kc, vc, host_sparse, kv_indices=kv_indices, kv_block_indexes=h_ids)
        rep.compare("sparse out", out_sparse, ref_sparse)
    else:
        rep.compare("sparse out", out_sparse, _direct_sparse(q, k, v, qo, kv, pos, h_ids),
                    against="a direct softmax over the selected blocks")
    print(f"    sparse vs dense output: rel diff {rel_err(out_sparse, out_dense):.1e} "
          f"(what dropping the other blocks costs on these inputs)")


# ----------------------------------------------------------------------------- KDA


def _kda_demo(xp, rng, rep: _Report) -> None:
    import mate_cupy as mc
    from mate_cupy.reference.kda import kda_recurrent

    b, t, h, hv, d = 2, 100, 2, 4, 128
    where = "CPU reference" if xp is None else "GPU"
    dev = (lambda a: a) if xp is None else xp.asarray

    def tokens(n):
        return (rng.standard_normal((b, n, h, d)).astype(BF16), rng.standard_normal((b, n, h, d)).astype(BF16),
                rng.standard_normal((b, n, hv, d)).astype(BF16), rng.standard_normal((b, n, hv, d)).astype(BF16),
                rng.standard_normal((b, n, hv)).astype(BF16))

    q, k, v, g, beta = tokens(t)
    a_log = rng.uniform(-1, 0.5, hv).astype(np.float32)
    dt_bias = (rng.standard_normal((hv, d)) * 0.1).astype(np.float32)
    s0 = np.zeros((b, hv, d, d), np.float32)  # float32 state (without one the state comes in q's dtype)

    def prefill(arrs, state):
        return mc.chunk_kda(*arrs, initial_state=state, output_final_state=True, A_log=dev(a_log),
                            dt_bias=dev(dt_bias))

    t0 = time.perf_counter()
    o, state = prefill([dev(a) for a in (q, k, v, g, beta)], dev(s0))
    ms = _elapsed_ms(xp, t0)
    print(f"  1. chunk_kda prefill: B {b}, T {t}, H {h}, HV {hv}, D {d}, bf16, gate from A_log/dt_bias: "
          f"o {tuple(o.shape)}, final state {tuple(state.shape)} float32, V-first [{where}, {ms:.0f} ms]")
    if xp is not None:
        ref_o, ref_state = prefill([q, k, v, g, beta], s0)
        rep.compare("o", o, ref_o)
        rep.compare("final state", state, ref_state, tol=1e-2)
    else:
        rec_o, rec_state = kda_recurrent(q, k, v, g, beta, initial_state=s0, A_log=a_log, dt_bias=dt_bias)
        rep.compare("o", o, rec_o, against="the token-by-token recurrence")
        rep.compare("final state", state, rec_state, tol=1e-6, against="the token-by-token recurrence")

    q1, k1, v1, a1, b1 = tokens(1)
    pool = state.copy()  # a state pool: slot n holds sequence n's state, updated in place
    t0 = time.perf_counter()
    o1, _ = mc.gated_delta_rule_decode(dev(q1), dev(k1), dev(v1), pool, dev(a_log), dev(a1), dev(dt_bias), None,
                                       None, dev(b1), use_lower_bound=True, apply_beta_sigmoid=True,
                                       inplace_final_state=True)
    ms = _elapsed_ms(xp, t0)
    print(f"  2. gated_delta_rule_decode of token {t} from that state (same gate: use_lower_bound, beta "
          f"logits: apply_beta_sigmoid), state updated in place: o {tuple(o1.shape)} [{where}, {ms:.0f} ms]")
    if xp is not None:
        ref_o1, ref_pool = mc.gated_delta_rule_decode(q1, k1, v1, _host(state).copy(), a_log, a1, dt_bias, None,
                                                      None, b1, use_lower_bound=True, apply_beta_sigmoid=True,
                                                      inplace_final_state=True)
        rep.compare("decode o", o1, ref_o1)
        rep.compare("state after decode", pool, ref_pool, tol=1e-2)
    # prefill then decode == the prefill of one more token
    cat = [np.concatenate([x, y], axis=1) for x, y in zip((q, k, v, g, beta), (q1, k1, v1, a1, b1))]
    o_all, state_all = prefill([dev(a) for a in cat], dev(s0))
    rep.compare("decode o", o1, o_all[:, t:], against=f"the last token of a {t + 1}-token prefill")
    rep.compare("state after decode", pool, state_all, tol=1e-2, against=f"a {t + 1}-token prefill's state")


def run_demo(force_cpu: bool = False) -> int:
    t_start = time.perf_counter()
    xp, _, why = backend(force_cpu)
    print(f"mate_cupy demo: {why}")
    rng = np.random.default_rng(0)
    rep = _Report()
    for title, fn in (("MSA: max score -> top-k block selection -> sparse attention", _msa_demo),
                      ("KDA: chunked prefill -> recurrent decode from its final state", _kda_demo)):
        print(title)
        try:
            fn(xp, rng, rep)
        except BrokenPipeError:  # the reader went away (``| head``)
            raise
        except Exception as e:  # report and continue with the next family
            print(f"  FAILED: {type(e).__name__}: {e}")
            rep.failed.append(title)
    total = time.perf_counter() - t_start
    if rep.failed:
        print(f"demo FAILED ({', '.join(rep.failed)}) in {total:.1f} s")
        return 1
    print(f"demo done in {total:.1f} s: every result within tolerance of its reference")
    return 0
