"""The notebooks' code cells run top to bottom (NumPy path without a GPU, CuPy with one)."""
from __future__ import annotations

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, capsys):
    cells = json.loads(path.read_text())["cells"]
    scope: dict = {"__name__": "__notebook__"}
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{path.name}[cell {i}]", "exec"), scope)
    assert "rel" in capsys.readouterr().out
