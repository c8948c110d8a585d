"""Benchmark mate_cupy beside its peers in one process; write results.json + results.md.

    python bench/run.py OUTDIR [--only attention,index,pipeline,kda] [--quick] [--peers LIST]

Times each op with CUDA events (warm-up, median of several samples, input sets
rotated so the L2 cache does not flatter), measures the machine's ceilings
(device copy TB/s, bf16 GEMM TFLOP/s), checks every implementation's output
against a cheap fp32 reference, prints a table (last lines of the output) and
writes ``OUTDIR/results.json`` (a list of records) and ``OUTDIR/results.md``.
See bench/README.md for the columns and the committed results.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("attention", "index", "pipeline", "kda")
PEERS = ("sdpa_flash", "sdpa_cudnn", "flex", "torch_topk", "fla")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="bench/run.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Peers: " + ", ".join(PEERS) + ". fla needs the fla-core wheel on PYTHONPATH (bench/README.md).")
    ap.add_argument("outdir", help="folder for results.json, results.md (and fla_configs/)")
    ap.add_argument("--only", default=",".join(FAMILIES),
                    help="comma-separated op families: attention,index,pipeline,kda (default: all)")
    ap.add_argument("--quick", action="store_true",
                    help="smaller shapes, fewer samples, one decode/chunk shape per family (a few minutes less)")
    ap.add_argument("--peers", default="all",
                    help="comma-separated peers to time (default: all; 'none' = ours only)")
    ap.add_argument("--case", default=None, help="only cases whose 'op name' matches this regex")
    ap.add_argument("--samples", type=int, default=None, help="timed samples per impl (default 10, quick 5)")
    ap.add_argument("--no-graphs", action="store_true", help="skip CUDA-graph replay timing")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    ap.add_argument("--no-ceilings", action="store_true", help="skip measuring the copy/GEMM ceilings")
    ap.add_argument("--flex-per-token", action="store_true",
                    help="time FlexAttention on per-token sparse selection (about 219 ms per call)")
    ap.add_argument("--fla-budget-s", type=float, default=300.0,
                    help="seconds allowed for all fla first calls (Triton autotuning); then fla is skipped")
    ap.add_argument("--fla-configs", default=None,
                    help="folder of saved fla autotune configs to replay (default: bench/fla_configs/<GPU>/ "
                         "if present; 'none' = autotune)")
    ap.add_argument("--commit", default=None,
                    help="commit id to record (default: $MATE_CUPY_COMMIT, else git rev-parse HEAD)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: smoke-test the harness with tiny shapes and wall-clock timing (no GPU)")
    ap.add_argument("--isolate", choices=("auto", "yes", "no"), default="auto",
                    help="one child process per family, so a CUDA fault in one family cannot take the others "
                         "down (auto: yes on a GPU with several families)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)       # run by the parent
    ap.add_argument("--ceilings-json", default=None, help=argparse.SUPPRESS)   # the parent's measurements
    args = ap.parse_args(argv)
    fams = [f.strip() for f in args.only.split(",") if f.strip()]
    bad = [f for f in fams if f not in FAMILIES]
    if bad:
        ap.error(f"--only: unknown families {bad}; choose from {', '.join(FAMILIES)}")
    args.only = fams
    if args.peers == "all":
        args.peers = PEERS
    elif args.peers == "none":
        args.peers = ()
    else:
        peers = tuple(p.strip() for p in args.peers.split(",") if p.strip())
        bad = [p for p in peers if p not in PEERS]
        if bad:
            ap.error(f"--peers: unknown peers {bad}; choose from {', '.join(PEERS)}")
        args.peers = peers
    return args


def git_commit(explicit=None) -> str:
    """The commit to record: ``--commit``, else ``$MATE_CUPY_COMMIT`` (a copy of the tree whose
    ``.git`` is absent or stale), else ``git rev-parse HEAD`` (+dirty)."""
    if explicit:
        return explicit
    if os.environ.get("MATE_CUPY_COMMIT"):
        return os.environ["MATE_CUPY_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if sha:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return sha[:12] + ("+dirty" if dirty else "")
    except Exception:
        pass
    return "unknown"


def environment(device: str) -> dict:
    import torch

    meta = {"torch": torch.__version__}
    for mod in ("cupy", "triton"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception:
            meta[mod] = None
    if device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
        meta["cuda"] = torch.version.cuda
        props = torch.cuda.get_device_properties(0)
        meta["l2_bytes"] = int(getattr(props, "L2_cache_size", 50 * 2**20) or 50 * 2**20)
    else:
        import platform

        meta["gpu"] = f"cpu ({platform.processor() or platform.machine()})"
        meta["l2_bytes"] = 32 * 2**20
    return meta


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    from bench import bench_attention, bench_index, bench_kda, bench_pipeline
    from bench.harness import BenchConfig, run_cases
    from bench.report import format_table, new_record, status, write_results
    from bench.timing import TimingConfig, make_timer

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/run.py: no CUDA device visible to torch (use --device cpu for a harness smoke run)",
              file=sys.stderr)
        return 2
    size = "tiny" if args.device == "cpu" else ("quick" if args.quick else "full")
    timing = {"full": TimingConfig(), "quick": TimingConfig(warmup=2, samples=5, budget_s=4.0),
              "tiny": TimingConfig(warmup=1, samples=2, min_samples=1, budget_s=2.0)}[size]
    if args.samples:
        timing.samples = args.samples
    meta = environment(args.device)
    args._commit = git_commit(args.commit)
    meta.update(commit=args._commit, mode=size,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                command="python bench/run.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                   else sys.argv[1:])))
    fla_configs = args.fla_configs
    if fla_configs is None and args.device == "cuda":
        fla_configs = bench_kda.default_fla_configs(meta["gpu"])
    elif fla_configs == "none":
        fla_configs = None
    if fla_configs:
        fla_configs = str(Path(fla_configs).resolve())
    cfg = BenchConfig(device=args.device, size=size, peers=tuple(args.peers), graphs=not args.no_graphs,
                      check=not args.no_check, case_filter=args.case, flex_per_token=args.flex_per_token,
                      fla_budget_s=args.fla_budget_s, fla_configs=fla_configs, l2_bytes=meta["l2_bytes"],
                      timing=timing, outdir=args.outdir)
    timer = make_timer(args.device, timing)
    if args.child:
        meta["command"] = None
    print(f"mate_cupy bench: {meta['gpu']}, commit {meta['commit']}, {size} shapes, families {args.only}, "
          f"peers {list(cfg.peers) or 'none'}" + (f", fla configs {fla_configs}" if fla_configs else ""))
    t_start = time.perf_counter()
    records = []
    torch.set_grad_enabled(False)
    if args.ceilings_json:
        cfg.ceilings.update(json.loads(args.ceilings_json))
    elif args.device == "cuda" and not args.no_ceilings:
        records += ceiling_records(cfg, timer, size)
    isolate = not args.child and (args.isolate == "yes" or (
        args.isolate == "auto" and args.device == "cuda" and len(args.only) > 1))
    if isolate:
        if args.device == "cuda":
            torch.cuda.empty_cache()
        for fam in args.only:
            records += run_family_in_child(fam, args, cfg, meta)
        shutil.rmtree(Path(args.outdir) / ".parts", ignore_errors=True)
    else:
        modules = {"attention": bench_attention, "index": bench_index, "pipeline": bench_pipeline, "kda": bench_kda}

        def save_partial(recs):
            write_results(args.outdir, records + recs, dict(meta, partial=True))

        for fam in args.only:
            mod = modules[fam]
            try:
                records += run_cases(mod.cases(cfg), cfg, timer, progress=save_partial)
                if hasattr(mod, "after"):
                    records += mod.after(cfg, timer)
            except Exception as e:
                print(f"[{fam}] family failed: {type(e).__name__}: {e}")
                records.append(new_record(fam, "(all cases)", "harness", "ours", error=f"{type(e).__name__}: {e}"))
        fla = bench_kda.SESSION
        if fla is not None and fla.version:
            meta["fla"] = fla.version + (f" (autotune configs from {fla.configs_dir}: {fla.preloaded} entries "
                                         "preloaded)" if fla.configs_dir else " (autotuned in this run)")
    meta["seconds"] = round(time.perf_counter() - t_start, 1)
    jpath, mpath = write_results(args.outdir, records, meta)
    if args.child:
        (Path(args.outdir) / "meta.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
        return 0
    body = [r for r in records if r["kind"] != "ceiling"]
    counts = {}
    for r in body:
        st = status(r)
        counts[st] = counts.get(st, 0) + 1
    print(f"\nwrote {jpath} and {mpath} ({meta['seconds']} s)\n")
    print(format_table(records))
    print("\n" + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + f"  [{meta['gpu']}, {meta['commit']}]")
    return 0


def ceiling_records(cfg, timer, size: str) -> list[dict]:
    from bench.report import new_record
    from bench.timing import measure_ceilings

    records = []
    try:
        for c in measure_ceilings(timer, copy_bytes=(1 << 31) if size == "full" else (1 << 29)):
            rec = new_record("ceiling", c["case"], "torch", "ceiling", ms=c["ms"], metric=c["metric"],
                             flops=c.get("flops"), bytes=c.get("bytes"), ceiling_frac=1.0)
            if c["metric"] == "tflops":
                rec["tflops"] = cfg.ceilings["tflops"] = c["flops"] / (c["ms"] * 1e-3) / 1e12
            else:
                rec["tbps"] = cfg.ceilings["tbps"] = c["bytes"] / (c["ms"] * 1e-3) / 1e12
            records.append(rec)
        print(f"ceilings: copy {cfg.ceilings.get('tbps', 0):.2f} TB/s, GEMM {cfg.ceilings.get('tflops', 0):.0f} TFLOP/s")
    except Exception as e:
        print(f"ceilings failed: {type(e).__name__}: {e}")
    return records


def child_argv(fam: str, args, cfg, part: Path) -> list[str]:
    """The command line of the child process that runs one family."""
    argv = [str(Path(__file__).resolve()), str(part), "--only", fam, "--child", "--no-ceilings", "--device", cfg.device,
            "--ceilings-json", json.dumps(cfg.ceilings), "--peers", ",".join(cfg.peers) or "none",
            "--fla-budget-s", str(args.fla_budget_s), "--commit", cfg_commit(args)]
    flags = {"--quick": args.quick, "--no-graphs": args.no_graphs, "--no-check": args.no_check,
             "--flex-per-token": args.flex_per_token}
    argv += [f for f, on in flags.items() if on]
    if args.case:
        argv += ["--case", args.case]
    if args.samples:
        argv += ["--samples", str(args.samples)]
    if cfg.fla_configs:
        argv += ["--fla-configs", cfg.fla_configs]
    else:
        argv += ["--fla-configs", "none"]
    return argv


def cfg_commit(args) -> str:
    return args._commit


def run_family_in_child(fam: str, args, cfg, meta: dict) -> list[dict]:
    """Run one family in a child process; merge its records (a crash becomes an error record)."""
    from bench.report import load_results, new_record

    part = (Path(args.outdir) / ".parts" / fam).resolve()
    if part.exists():
        shutil.rmtree(part)
    print(f"--- {fam} (child process)", flush=True)
    proc = subprocess.run([sys.executable] + child_argv(fam, args, cfg, part))
    records = []
    if (part / "results.json").is_file():
        records = [r for r in load_results(part / "results.json") if r.get("kind") != "ceiling"]
    if (part / "meta.json").is_file():
        child = json.loads((part / "meta.json").read_text())
        if child.get("fla"):
            meta["fla"] = child["fla"]
    if proc.returncode != 0:
        what = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        done = {(r["op"], r["case"]) for r in records}
        records.append(new_record(fam, "(family process)", "harness", "ours",
                                  error=f"the {fam} process died ({what}) after {len(done)} cases; "
                                        "its completed cases are kept (see the log above)"))
    configs = part / "fla_configs"
    if configs.is_dir():
        dest = Path(args.outdir) / "fla_configs"
        shutil.copytree(configs, dest, dirs_exist_ok=True)
    shutil.rmtree(part, ignore_errors=True)
    return records


if __name__ == "__main__":
    sys.exit(main())
