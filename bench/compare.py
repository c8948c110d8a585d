"""Compare two benchmark runs: per (op, case, impl), old ms -> new ms and the speedup.

    python bench/compare.py OLD/results.json NEW/results.json [--impl mate_cupy]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def compare(old: list[dict], new: list[dict], impl: str | None = None) -> list[dict]:
    """Rows ``{op, case, impl, old_ms, new_ms, speedup}`` for every record in ``new``
    (``speedup = old_ms / new_ms``; None where either side has no time)."""
    before = {(r["op"], r["case"], r["impl"]): r for r in old}
    rows = []
    for r in new:
        if r.get("kind") == "ceiling" or (impl and r["impl"] != impl):
            continue
        o = before.get((r["op"], r["case"], r["impl"]))
        old_ms = o.get("ms") if o else None
        new_ms = r.get("ms")
        ok = isinstance(old_ms, (int, float)) and isinstance(new_ms, (int, float)) and new_ms > 0
        rows.append({"op": r["op"], "case": r["case"], "impl": r["impl"], "old_ms": old_ms, "new_ms": new_ms,
                     "speedup": old_ms / new_ms if ok else None,
                     "old_commit": o.get("commit") if o else None, "new_commit": r.get("commit")})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--impl", default=None, help="only this impl (e.g. mate_cupy)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.report import load_results

    rows = compare(load_results(args.old), load_results(args.new), args.impl)
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    w = max([len(f"{r['op']} | {r['case']} | {r['impl']}") for r in rows] + [10])
    for r in rows:
        name = f"{r['op']} | {r['case']} | {r['impl']}"
        print(f"{name.ljust(w)}  {fmt(r['old_ms'], '10.4f')} -> {fmt(r['new_ms'], '10.4f')} ms  "
              f"x{fmt(r['speedup'], '.2f')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
