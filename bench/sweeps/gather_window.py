"""The `gather` tile's query window on one GPU: sparse attention time per window size.

    PYTHONPATH=. python bench/sweeps/gather_window.py OUTDIR [S ...]

At MiniMax-M3's shapes (Hq 64, Hkv 4, D 128, bf16, page 128, top 16 per query token from the
pipeline's own index and selection, as ``bench/bench_pipeline.py`` builds them), times the
attention stage (``msa`` with the pipeline plan's selection) with the query window that
:func:`mate_cupy.msa.gather_launch.query_window` picks and with fixed windows of 2048 to
8192 queries, CUDA events, median of 5 after one warm-up. The output must not depend on the
window (each (query, slot) partial is computed by the same instructions whatever work item
holds it, and the merge combines slots in list order): every window's output is compared
bitwise with the chosen one's. Writes ``OUTDIR/gather_window.json``.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

WINDOWS = (2048, 4096, 7168)


def main(outdir: str, seqlens: list[int]) -> None:
    import torch

    from bench import bench_pipeline as bp
    from mate_cupy.msa import gather_launch as gl

    import mate_cupy as mc

    out_path = Path(outdir)
    out_path.mkdir(parents=True, exist_ok=True)
    chosen_fn = gl.query_window
    records = []
    for s in seqlens:
        x = bp._inputs("cuda", 1, s, s, 64, 4, 11)
        plan = bp._plan(1, s, s, 64, 4)
        mc.sparse_attention_pipeline(x["q"], x["k_cache"], x["v_cache"], x["index_q"], x["index_k"], plan,
                                     kv_indices=x["kv_indices"])
        nb = -(-s // 128)
        full = gl.window_rows(4, 16)
        chosen = chosen_fn(full, 16, nb)
        ref = None
        for win in (chosen,) + tuple(w for w in WINDOWS if w != chosen):
            gl.query_window = lambda full_rows, width, nb_max, _w=win: _w
            gl.gather_bounds.cache_clear()
            out = torch.full_like(x["q"], float("nan"))

            def run():
                return mc.msa(x["q"], x["k_cache"], x["v_cache"], plan.attention, kv_indices=x["kv_indices"],
                              kv_block_indexes=plan.selection, out=out)

            run()
            torch.cuda.synchronize()
            times = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            same = None
            if ref is None:
                ref = out.clone()
            else:
                same = bool(torch.equal(out, ref))
            rec = {"S": s, "win": win, "chosen": win == chosen, "ms": statistics.median(times),
                   "ms_all": times, "bitwise_equal_to_chosen": same, "nan": bool(torch.isnan(out).any())}
            print(json.dumps(rec), flush=True)
            records.append(rec)
        gl.query_window = chosen_fn
        gl.gather_bounds.cache_clear()
        del x, plan, ref, out
        torch.cuda.empty_cache()
    (out_path / "gather_window.json").write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], [int(a) for a in sys.argv[2:]] or [32768, 131072, 1048576])
