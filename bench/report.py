"""Result records: schema, targets, derived columns, the printed table, JSON and markdown.

One record (a ``dict``) per (op, case, impl). JSON files hold a list of records so
runs compare by script::

    op, case, impl, kind        what ran ("ours" or "peer"; "ceiling" for the machine figures)
    ms                          median time per call, plain back-to-back launches (CUDA events)
    ms_graph                    median time per call replayed from a CUDA graph (small ops), or null
    tflops, tbps                from the case's FLOP / byte model, or null where meaningless
    baseline, ratio             the case's reference impl and baseline_ms / ms (> 1: faster than it)
    ratios                      {peer impl: peer_ms / ms} for every peer timed in the case
    ceiling_frac                tflops / measured GEMM ceiling, or tbps / measured copy ceiling
    target, target_met          the issue's target for our impl (text) and whether this run met it
    err, err_vs, err_ok         normalised error ||out - ref|| / ||ref|| (or mismatch fraction) and against what
    error                       exception text when the impl failed (the run continues)
    commit, gpu, mode, date     provenance (in every record)

Everything here is plain Python: unit-tested on the CPU.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from .models import tbps, tflops

RECORD_KEYS = (
    "op", "case", "impl", "kind", "ms", "ms_graph", "tflops", "tbps", "baseline", "ratio",
    "ratios", "ceiling_frac", "target", "target_met", "err", "err_vs", "err_ok", "error",
    "graph_error", "flops", "bytes", "metric", "params", "n_sets", "samples", "inner",
    "ms_min", "ms_max", "first_call_ms", "measured", "note", "commit", "gpu", "mode", "date",
)


def new_record(op: str, case: str, impl: str, kind: str, **fields) -> dict:
    """A record with every schema key present (``None`` where unknown)."""
    rec = {k: None for k in RECORD_KEYS}
    rec.update(op=op, case=case, impl=impl, kind=kind, measured=True)
    for k, v in fields.items():
        if k not in rec:
            raise KeyError(f"unknown record field {k!r}")
        rec[k] = v
    return rec


@dataclass(frozen=True)
class Target:
    """The issue's goal for our implementation in one case.

    kind ``"speedup"``: ``vs_ms / ms >= value`` (at least ``value`` x as fast as impl ``vs``);
    kind ``"time_ratio"``: ``ms / vs_ms <= value`` (at most ``value`` x the time of ``vs``);
    kind ``"tbps"``: ``tbps >= value``; kind ``"tflops"``: ``tflops >= value``;
    kind ``"ms"``: ``ms <= value`` (an absolute time budget).
    """

    kind: str
    value: float
    vs: Optional[str] = None

    def __post_init__(self):
        if self.kind not in ("speedup", "time_ratio", "tbps", "tflops", "ms"):
            raise ValueError(f"unknown target kind {self.kind!r}")
        if self.kind not in ("tbps", "tflops", "ms") and not self.vs:
            raise ValueError(f"target kind {self.kind!r} needs vs=<impl name>")

    @property
    def text(self) -> str:
        if self.kind == "speedup":
            return f">={self.value:g}x {self.vs}"
        if self.kind == "time_ratio":
            return f"<={self.value:g}x time of {self.vs}"
        if self.kind == "ms":
            return f"<={self.value:g} ms"
        if self.kind == "tflops":
            return f">={self.value:g} TFLOP/s"
        return f">={self.value:g} TB/s"

    def evaluate(self, rec: dict, case_records: Iterable[dict]) -> Optional[bool]:
        """True/False when decidable from this run, else None (missing time or peer)."""
        ms = rec.get("ms")
        if not _num(ms):
            return None
        if self.kind in ("tbps", "tflops"):
            return rec.get(self.kind) is not None and rec[self.kind] >= self.value
        if self.kind == "ms":
            return ms <= self.value
        other = next((r for r in case_records if r["impl"] == self.vs and _num(r.get("ms"))), None)
        if other is None:
            return None
        if self.kind == "speedup":
            return other["ms"] / ms >= self.value
        return ms / other["ms"] <= self.value


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def finalize_case(records: list[dict], *, baseline: Optional[str], target: Optional[Target],
                  ceilings: dict, tol: Optional[float]) -> list[dict]:
    """Fill the derived columns of one case's records in place (and return them).

    ceilings: ``{"tflops": measured GEMM TFLOP/s, "tbps": measured copy TB/s}`` (either may be absent).
    """
    peers = {r["impl"]: r["ms"] for r in records if r["kind"] == "peer" and _num(r.get("ms"))}
    base_ms = next((r["ms"] for r in records if r["impl"] == baseline and _num(r.get("ms"))), None)
    for r in records:
        r["baseline"] = baseline
        ms = r.get("ms")
        if _num(ms):
            r["tflops"] = tflops(r.get("flops"), ms)
            r["tbps"] = tbps(r.get("bytes"), ms)
            r["ratio"] = base_ms / ms if base_ms else None
            r["ratios"] = {name: pms / ms for name, pms in peers.items() if name != r["impl"]} or None
            metric = r.get("metric")
            value = r.get(metric) if metric in ("tflops", "tbps") else None
            ceil = ceilings.get(metric) if metric else None
            r["ceiling_frac"] = value / ceil if value is not None and ceil else None
        if r.get("err") is not None and tol is not None:
            r["err_ok"] = bool(math.isfinite(r["err"]) and r["err"] <= tol)
        if r["kind"] == "ours" and target is not None:
            r["target"] = target.text
            r["target_met"] = target.evaluate(r, records)
    return records


def status(rec: dict) -> str:
    """One word for the table: ERROR, WRONG, met, MISSED, ok (peer or no target), n/a."""
    if rec.get("error"):
        return "ERROR"
    if rec.get("err_ok") is False:
        return "WRONG"
    if rec.get("target_met") is True:
        return "met"
    if rec.get("target_met") is False:
        return "MISSED"
    if rec.get("target") and rec.get("kind") == "ours":
        return "n/a"
    return "ok" if _num(rec.get("ms")) else "-"


# --------------------------------------------------------------------------- formatting

def _fmt(x, spec: str, none: str = "-") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none if x is None else str(x)
    return format(x, spec)


def _fmt_ms(x) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.3f}"
    return f"{x:.4f}"


def _fmt_err(x) -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return "inf"
    return f"{x:.1e}"


TABLE_COLUMNS = ("op", "case", "impl", "ms", "graph ms", "TFLOP/s", "TB/s", "x base", "ceil",
                 "err", "target", "status")


def table_rows(records: list[dict]) -> list[list[str]]:
    rows = []
    for r in records:
        ms = _fmt_ms(r.get("ms"))
        if r.get("measured") is False and r.get("ms") is not None:
            ms += "*"
        gms = _fmt_ms(r.get("ms_graph")) if r.get("ms_graph") is not None else ("fail" if r.get("graph_error") else "-")
        st = status(r)
        if st == "ERROR":
            st = "ERROR: " + _short(r["error"], 60)
        rows.append([
            r["op"], r["case"], r["impl"], ms, gms,
            _fmt(r.get("tflops"), ".1f"), _fmt(r.get("tbps"), ".2f"),
            _fmt(r.get("ratio"), ".2f"), _fmt(r.get("ceiling_frac"), ".0%"),
            _fmt_err(r.get("err")), r.get("target") or "-", st,
        ])
    return rows


def _short(text: str, n: int) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= n else line[: n - 3] + "..."


def format_table(records: list[dict]) -> str:
    """Fixed-width text table (what the end of the run prints)."""
    rows = [list(TABLE_COLUMNS)] + table_rows(records)
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_COLUMNS))]
    widths[-1] = min(widths[-1], 72)
    lines = []
    for j, row in enumerate(rows):
        cells = []
        for i, c in enumerate(row):
            numeric = 3 <= i <= 9 and j > 0
            cells.append(c.rjust(widths[i]) if numeric else c.ljust(widths[i]))
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _md_escape(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def format_markdown(records: list[dict], meta: dict) -> str:
    """Markdown report: provenance, ceilings, the table, then every error in full."""
    out = [f"# mate_cupy benchmark: {meta.get('gpu', '?')}", ""]
    out.append(f"- command: `{meta.get('command', '?')}`")
    for key in ("commit", "date", "mode", "torch", "cupy", "triton", "fla", "cuda"):
        if meta.get(key) is not None:
            out.append(f"- {key}: {meta[key]}")
    ceil = [r for r in records if r["kind"] == "ceiling"]
    for r in ceil:
        val = f"{r['tflops']:.0f} TFLOP/s" if r.get("tflops") else (f"{r['tbps']:.2f} TB/s" if r.get("tbps") else "-")
        out.append(f"- ceiling {r['case']}: {val} ({_fmt_ms(r.get('ms'))} ms)")
    out += ["", "Columns: `ms` median per call (back-to-back launches, CUDA events, inputs rotated so L2 "
            "does not flatter); `graph ms` the same replayed from a CUDA graph; `x base` = baseline ms / ms "
            "(> 1 is faster than the case's baseline peer); `ceil` = fraction of the measured ceiling "
            "(GEMM TFLOP/s or copy TB/s); `err` = normalised error against the case's reference "
            "(see bench/README.md). `*` = not measured in this run (see note).", ""]
    body = [r for r in records if r["kind"] != "ceiling"]
    out.append("| " + " | ".join(TABLE_COLUMNS) + " |")
    out.append("|" + "|".join("---" for _ in TABLE_COLUMNS) + "|")
    for row in table_rows(body):
        out.append("| " + " | ".join(_md_escape(c) for c in row) + " |")
    notes = [r for r in body if r.get("note")]
    if notes:
        out += ["", "## Notes", ""]
        out += [f"- {r['op']} / {r['case']} / {r['impl']}: {_md_escape(r['note'])}" for r in notes]
    errs = [r for r in body if r.get("error") or r.get("graph_error")]
    if errs:
        out += ["", "## Errors", ""]
        for r in errs:
            if r.get("error"):
                out.append(f"- {r['op']} / {r['case']} / {r['impl']}: `{_md_escape(r['error'])}`")
            if r.get("graph_error"):
                out.append(f"- {r['op']} / {r['case']} / {r['impl']} (CUDA graph): `{_md_escape(r['graph_error'])}`")
    return "\n".join(out) + "\n"


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy / torch scalars
        return _jsonable(x.item())
    return x


def write_results(outdir, records: list[dict], meta: dict) -> tuple[Path, Path]:
    """Write ``results.json`` (a list of records) and ``results.md`` into ``outdir``."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    for r in records:
        for key in ("commit", "gpu", "mode", "date"):
            if r.get(key) is None:
                r[key] = meta.get(key)
    jpath, mpath = outdir / "results.json", outdir / "results.md"
    jpath.write_text(json.dumps(_jsonable(records), indent=1) + "\n")
    mpath.write_text(format_markdown(records, meta))
    return jpath, mpath


def load_results(path) -> list[dict]:
    """Read a ``results.json`` back (for comparing runs by script)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of records")
    return data
