"""docs/api.md documents every public name of ``mate_cupy.__all__`` and every parameter.

Each public function, class (its constructor) and public method of a public class has a
section in docs/api.md whose heading names it in backticks (``### `msa` ``,
``#### `MsaPlan.upload` ``); every parameter of its signature appears in that section in
backticks.
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import mate_cupy

API_MD = Path(__file__).resolve().parents[1] / "docs" / "api.md"
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
# A commit id: 7-40 hex digits with at least one digit and one letter.
_COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def _sections() -> dict:
    """``{name: text}`` for every heading that names one identifier in backticks; the text
    runs to the next heading of the same or a higher level (subsections included)."""
    lines = API_MD.read_text().splitlines()
    heads = []
    for i, line in enumerate(lines):
        m = _HEADING.match(line)
        if m:
            heads.append((i, len(m.group(1)), m.group(2).strip()))
    out = {}
    for n, (i, level, title) in enumerate(heads):
        name = re.fullmatch(r"`([A-Za-z_][A-Za-z0-9_.]*)`", title)
        if not name:
            continue
        end = len(lines)
        for j, lvl, _ in heads[n + 1:]:
            if lvl <= level:
                end = j
                break
        out[name.group(1)] = "\n".join(lines[i:end])
    return out


def _public():
    """``(name, object, signature or None)`` for each documented public item."""
    for name in mate_cupy.__all__:
        obj = getattr(mate_cupy, name)
        if inspect.isclass(obj):
            yield name, obj, inspect.signature(obj)
            for meth_name, meth in vars(obj).items():
                if not meth_name.startswith("_") and inspect.isfunction(meth):
                    yield f"{name}.{meth_name}", meth, inspect.signature(meth)
        elif callable(obj) and not isinstance(obj, type(tuple[int])):
            yield name, obj, inspect.signature(obj)
        else:  # a type alias (MsaPlanInfo) or a constant (__version__)
            yield name, obj, None


SECTIONS = _sections()
PUBLIC = list(_public())


def test_api_md_exists():
    assert API_MD.is_file()


@pytest.mark.parametrize("name", [p[0] for p in PUBLIC])
def test_every_public_name_has_a_section(name):
    assert name in SECTIONS, f"docs/api.md has no section headed `{name}`"


@pytest.mark.parametrize("name,sig", [(p[0], p[2]) for p in PUBLIC if p[2] is not None],
                         ids=[p[0] for p in PUBLIC if p[2] is not None])
def test_every_parameter_is_documented_in_its_section(name, sig):
    text = SECTIONS.get(name, "")
    missing = [p for p in sig.parameters if p != "self" and f"`{p}`" not in text]
    assert not missing, f"docs/api.md, section `{name}`: parameters not mentioned: {missing}"


def test_no_section_for_a_name_mate_cupy_does_not_export():
    known = {p[0] for p in PUBLIC}
    stale = [n for n in SECTIONS if not n.startswith("mate_cupy.") and n not in known]
    assert not stale, f"docs/api.md has sections for names mate_cupy does not export: {stale}"


def test_docs_stand_alone():
    """The docs cite nothing outside the repository (no external contract, no commit ids)."""
    bad = []
    for path in sorted(API_MD.parent.glob("*.md")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bSPEC\b|\bseeds?\b", line) or _COMMIT.search(line):
                bad.append(f"{path.name}:{n}: {line.strip()}")
    assert not bad, "docs cite material outside the repository:\n" + "\n".join(bad)
