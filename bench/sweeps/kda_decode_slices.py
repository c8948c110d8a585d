"""V-first KDA decode: CTA shape (warps x register passes) against the configuration's choice.

    PYTHONPATH=. python bench/sweeps/kda_decode_slices.py OUTDIR [B ...]

Case: the bench's serving step (HV 32, H 16, K = V = 128, T = 1, fp16 q/k/v/a/b, in-kernel
gate with lower bound, L2 norm, beta sigmoid, ``[N]`` slots in place: 4 input sets, each
updating its own B slots, in a random order, of one pool of 4 * B slots), fp32 and bf16
pools, B in 32 / 256 / 1024 by default. Per (B, pool dtype) every V-first CTA shape
``warps`` in {1, 2, 4} x ``passes`` in {1, 2, 4} whose slice divides V is launched directly
(``decode_launch.kernel_values`` of the selected configuration with its shape replaced) and
timed by CUDA-graph replay of 32 calls rotating over the sets; ``chosen`` marks
``select_config``'s shape. Beside them, a device-to-device copy of the same bytes. Each
shape's output and pool after one call on the initial pool are checked bit for bit against
the first shape's (rows are independent: the slicing must not change a bit); the exit status
is 1 when one differs.
Writes ``OUTDIR/kda_decode_slices.json`` and ``.md``.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

HV, H, K = 32, 16, 128
NSETS, CALLS = 4, 32


def _input_sets(cp, B, bf16_pool):
    """NSETS input sets sharing one pool of NSETS * B slots, each set updating its own B."""
    rs = cp.random.RandomState(0)
    h = lambda *s: rs.standard_normal(s, dtype=cp.float32).astype(cp.float16)  # noqa: E731
    pool = rs.standard_normal((NSETS * B, HV, K, K), dtype=cp.float32) * 0.1
    if bf16_pool:  # round to nearest even on the device, keep the bits
        import ml_dtypes

        u = pool.view(cp.uint32)
        pool = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16).view(ml_dtypes.bfloat16)
    perm = rs.permutation(NSETS * B).astype(cp.int32)
    return [dict(q=h(B, 1, H, K), k=h(B, 1, H, K), v=h(B, 1, HV, K), a=h(B, 1, HV, K), b=h(B, 1, HV),
                 A_log=rs.standard_normal(HV, dtype=cp.float32) * 0.5,
                 dt_bias=rs.standard_normal((HV, K), dtype=cp.float32) * 0.5, state=pool,
                 state_indices=perm[i * B:(i + 1) * B].copy(), output=cp.empty((B, 1, HV, K), dtype=cp.float16))
            for i in range(NSETS)]


def _problem(x):
    from mate_cupy.kda import decode as dec

    return dec.validate(q=x["q"], k=x["k"], v=x["v"], state=x["state"], A_log=x["A_log"], a=x["a"],
                        dt_bias=x["dt_bias"], num_accepted_tokens=None, cu_seqlens=None, b=x["b"],
                        state_indices=x["state_indices"], scale=None, output=x["output"], use_qk_l2norm=True,
                        lower_bound=None, use_gate_in_kernel=True, use_lower_bound=True, apply_beta_sigmoid=True,
                        allow_neg_eigval=False, use_initial_state=True, state_v_first=True, is_varlen=None,
                        store_final_state=None, inplace_final_state=True, state_dtype=None)


def _shape(cfg, problem, warps, passes, cc):
    """``cfg`` with the V-first CTA shape (warps, passes)."""
    from mate_cupy.kda import decode_launch as dl

    v_slice = dl.ROWS_PER_WARP * warps * passes
    n_splits = -(-problem.V // v_slice)
    bulk = cc >= 90 and problem.V % v_slice == 0
    return dataclasses.replace(
        cfg, warps=warps, threads=32 * warps, passes=passes, v_slice=v_slice, n_splits=n_splits,
        grid=problem.N * problem.HV * n_splits, bulk_stage=bulk,
        smem=dl.smem_bytes(v_slice * dl.K_DIM * problem.state_dtype.itemsize, cfg.token_chunk, v_slice, 0),
        option_flags=(cfg.option_flags & ~dl.F_BULK) | (dl.F_BULK if bulk else 0))


def _launcher(cp, x, cfg):
    from mate_cupy.jit import get_kernel, launch
    from mate_cupy.kda import decode_launch as dl

    call, problem = _problem(x)
    kernel = get_kernel(cfg.spec, None, cp.cuda.Device().id)
    values = dl.kernel_values(problem, cfg, {name: arg.ptr for name, arg in call.args.items()})
    return lambda stream: launch(kernel, (cfg.grid,), (cfg.threads,), dl.PARAMS, values, shared_mem=cfg.smem,
                                 stream=stream.ptr)


def _graph_us(cp, runs, stream, replays=20):
    with stream:
        for r in runs:
            r(stream)
        stream.begin_capture()
        for i in range(CALLS):
            runs[i % len(runs)](stream)
        g = stream.end_capture()
        for _ in range(3):
            g.launch()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        for _ in range(replays):
            g.launch()
        e1.record()
    e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) * 1e3 / (replays * CALLS)


def _copy_us(cp, nbytes, stream):
    src, dst = cp.empty(nbytes // 2, dtype=cp.uint8), cp.empty(nbytes // 2, dtype=cp.uint8)
    return _graph_us(cp, [lambda s: dst.data.copy_from_device_async(src.data, src.nbytes, s)], stream)


def main(argv) -> int:
    import cupy as cp

    from mate_cupy.kda import decode_launch as dl
    from mate_cupy.runtime.device import device_info

    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    batches = [int(a) for a in argv[1:]] or [32, 256, 1024]
    sm_count, cc = device_info()
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    for B in batches:
        for sdt_name in ("float32", "bfloat16"):
            sets = _input_sets(cp, B, sdt_name == "bfloat16")
            pool0 = sets[0]["state"].copy()  # every shape's equality check starts from this pool
            problem = _problem(sets[0])[1]
            chosen = dl.select_config(problem, sm_count, cc)
            state_bytes = 2 * B * HV * K * K * problem.state_dtype.itemsize
            copy_us = _copy_us(cp, state_bytes, stream)
            bits = cp.uint16 if problem.state_dtype.itemsize == 2 else cp.uint32
            ref = None
            for warps in (1, 2, 4):
                for passes in (1, 2, 4):
                    if problem.V % (dl.ROWS_PER_WARP * warps * passes):
                        continue
                    cfg = _shape(chosen, problem, warps, passes, cc)
                    x0 = dict(sets[0], state=pool0.copy(), output=cp.full_like(sets[0]["output"], cp.nan))
                    _launcher(cp, x0, cfg)(stream)
                    stream.synchronize()
                    got = (x0["output"].view(cp.uint16), x0["state"].view(bits))
                    del x0
                    ref = got if ref is None else ref
                    same = all(bool(cp.array_equal(a, b)) for a, b in zip(got, ref))
                    del got
                    us = _graph_us(cp, [_launcher(cp, x, cfg) for x in sets], stream)
                    row = dict(B=B, state=sdt_name, warps=warps, passes=passes, v_slice=cfg.v_slice, grid=cfg.grid,
                               smem=cfg.smem, chosen=(warps, passes) == (chosen.warps, chosen.passes),
                               graph_us=round(us, 2), tb_s=round(state_bytes / us / 1e6, 3),
                               copy_us=round(copy_us, 2), of_copy=round(copy_us / us, 3), bitwise_equal=same)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del sets, pool0, ref
            cp.get_default_memory_pool().free_all_blocks()
    (out_dir / "kda_decode_slices.json").write_text(json.dumps(rows, indent=1))
    lines = ["| B | state | warps | passes | v_slice | grid | smem | chosen | graph us | TB/s | of copy | equal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['B']} | {r['state']} | {r['warps']} | {r['passes']} | {r['v_slice']} | {r['grid']} | {r['smem']} "
              f"| {'*' if r['chosen'] else ''} | {r['graph_us']} | {r['tb_s']} | {r['of_copy']} | {r['bitwise_equal']} |"
              for r in rows]
    (out_dir / "kda_decode_slices.md").write_text("\n".join(lines) + "\n")
    return 0 if all(r["bitwise_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
