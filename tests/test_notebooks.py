"""Every notebook in ``notebooks/`` executes top to bottom and prints results within bounds.

Each notebook runs in a fresh Jupyter kernel of this interpreter (nbclient, matplotlib's Agg
backend), on the NumPy path without a GPU and on the CuPy path with one, under a per-notebook
time limit. The notebook files are not modified (they are executed in memory). Then the numbers
a notebook prints are checked: relative errors below bounds, recall within [0, 1], ratios and
ceiling fractions read from the committed benchmark record. The committed copies must hold
their outputs (plots as PNG) and stay small.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
NOTEBOOK_TIMEOUT_S = 150  # whole notebook; each runs in well under 60 s on two cores
MAX_NOTEBOOK_BYTES = 1_500_000


def _missing_packages() -> list[str]:
    missing = []
    for name in ("nbclient", "nbformat", "ipykernel", "matplotlib"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    return missing


def _kernel_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A ``python3`` kernel spec that runs this interpreter (first on ``JUPYTER_PATH``)."""
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python",
    }))
    return tmp_path / "jupyter"


def _execute(path: pathlib.Path, tmp_path, monkeypatch) -> tuple[str, float]:
    """Run the notebook in a fresh kernel; return its stdout (all cells, in order) and the seconds."""
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("JUPYTER_PATH", str(_kernel_dir(tmp_path)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(path, as_version=4)
    deadline = time.monotonic() + NOTEBOOK_TIMEOUT_S
    client = NotebookClient(nb, kernel_name="python3", allow_errors=False,
                            timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    t0 = time.monotonic()
    client.execute()
    seconds = time.monotonic() - t0
    text = []
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.get("output_type") == "stream" and out.get("name") == "stdout":
                text.append(out["text"])
    return "".join(text), seconds


def _number(pattern: str, text: str, count: int = 1) -> tuple[float, ...]:
    m = re.search(pattern, text)
    assert m, f"the notebook did not print a line matching {pattern!r}:\n{text}"
    vals = tuple(float(g) for g in m.groups())
    assert len(vals) == count
    return vals


def _check_backend_line(text: str) -> None:
    assert re.search(r"^path: (NumPy arrays -> float64 references|CuPy arrays -> CUDA kernels) \(.+\)$", text,
                     re.M), "the notebook must say which path runs and why"


def check_msa_sparsity_explorer(text: str) -> None:
    _check_backend_line(text)
    for lo, hi in re.findall(r"mass row sums in \[([\d.]+), ([\d.]+)\]", text):
        assert abs(float(lo) - 1) < 1e-9 and abs(float(hi) - 1) < 1e-9
    lo, hi = _number(r"recall range over every query, head, topk and input: \[([-\d.e+]+), ([-\d.e+]+)\]", text, 2)
    assert 0.0 <= lo <= hi <= 1.0 + 1e-9
    (full,) = _number(r"recall with all 32 blocks selected \(topk=32\): min ([-\d.e+]+)", text)
    assert abs(full - 1.0) < 1e-9
    table = re.findall(r"^(random inputs|structured, \w+ heads)\s+(.*)$", text, re.M)
    assert len(table) == 4
    for _, row in table:
        per_head = [float(x) for x in re.findall(r"([\d.]+) \(", row)]
        assert len(per_head) == 4 and all(0 <= r <= 1 for r in per_head)
        assert per_head == sorted(per_head), f"recall must grow with topk: {row}"
    local = [float(x) for x in re.findall(r"([\d.]+) \(", dict(table)["structured, local heads"])]
    rand = [float(x) for x in re.findall(r"([\d.]+) \(", dict(table)["random inputs"])]
    assert local[0] > rand[0] + 0.3, "structure must raise the recall of a small topk"
    for name in ("random", "structured"):
        errs = _number(rf"{name}\s+sparse vs dense relative error: top-4 ([-\d.e+]+), top-8 ([-\d.e+]+), "
                       r"top-16 ([-\d.e+]+), top-32 ([-\d.e+]+)", text, 4)
        assert errs[0] > errs[2] > errs[3], f"{name}: the sparse error must fall with topk: {errs}"
    (err_all,) = _number(r"sparse vs dense relative error with all 32 blocks selected: ([-\d.e+]+)", text)
    assert err_all < 2e-2


def check_kda_prefill_decode(text: str) -> None:
    _check_backend_line(text)
    state, out = _number(r"pieces vs one call: final state rel diff ([-\d.e+]+), output rel diff ([-\d.e+]+)", text, 2)
    assert state < 1e-4 and out < 1e-2
    o, s = _number(r"kda_chunked vs kda_recurrent: output rel err ([-\d.e+]+), state ([-\d.e+]+)", text, 2)
    assert o < 1e-10 and s < 1e-10
    o, s = _number(r"chunk_kda vs recurrent reference: output rel err ([-\d.e+]+), final state rel err ([-\d.e+]+)",
                   text, 2)
    assert o < 1e-2 and s < 1e-3
    o, s = _number(r"decode after prefill vs one prefill: output rel err ([-\d.e+]+), state rel err ([-\d.e+]+)",
                   text, 2)
    assert o < 1e-2 and s < 1e-4
    (o,) = _number(r"decode after prefill vs float64 recurrence: output rel err ([-\d.e+]+)", text)
    assert o < 1e-2


def check_bench_report(text: str) -> None:
    records = json.loads((ROOT / "bench" / "results" / "2026-11-30-H200-c" / "results.json").read_text())
    (n,) = _number(r"^(\d+) records from bench/results/2026-11-30-H200-c", text + "\n")
    assert n == len(records)
    wins, pairs, lo, hi = _number(r"(\d+) of (\d+) case/peer pairs faster than the peer; ratios from "
                                  r"([\d.]+)x to ([\d.]+)x", text, 4)
    ours = [r for r in records if r["impl"] == "mate_cupy" and (r.get("ratios") or r.get("ratio"))]
    expected = [v for r in ours for v in (r.get("ratios") or {r["baseline"]: r["ratio"]}).values()]
    assert pairs == len(expected) and wins == sum(v > 1 for v in expected)
    assert lo == pytest.approx(min(expected), abs=0.006) and hi == pytest.approx(max(expected), abs=0.006)
    lo, hi, cases = _number(r"mate_cupy ceiling fractions: (\d+)% \.\. (\d+)% over (\d+) cases", text, 3)
    assert 0 < lo <= hi < 150 and cases > 0


CHECKS = {
    "msa_sparsity_explorer": check_msa_sparsity_explorer,
    "kda_prefill_decode": check_kda_prefill_decode,
    "bench_report": check_bench_report,
}


def test_every_notebook_has_a_check():
    assert {p.stem for p in NOTEBOOKS} == set(CHECKS), "add a check of what each notebook prints"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch):
    missing = _missing_packages()
    if missing:
        pytest.skip(f"executing notebooks needs {', '.join(missing)} (pip install -e '.[test]')")
    text, seconds = _execute(path, tmp_path, monkeypatch)
    assert seconds < NOTEBOOK_TIMEOUT_S
    CHECKS[path.stem](text)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebook_has_outputs(path):
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES, f"{path.name} is {path.stat().st_size} bytes"
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c.get("execution_count") for c in code), "commit the notebook executed, top to bottom"
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plots must be committed as PNG outputs"
