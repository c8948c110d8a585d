"""Kernel source text: ``cuda_src/<family>.cu`` with its shared headers pasted in.

CuPy's disk-cache key covers the source text and the options, not headers
reached through ``-I``. Every quoted ``#include "common/x.cuh"`` is therefore
pasted into the text (once per file, ``#pragma once`` semantics) between
``#line`` markers, so compile errors still point at the right file and a
header edit always changes the key. Angle-bracket includes (CUDA's own
headers) are left to the include path.
"""
from __future__ import annotations

import re
from pathlib import Path

SRC_DIR = Path(__file__).resolve().parent.parent / "cuda_src"

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"\s*(//.*)?$')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\b")


def _resolve(name: str, including: Path | None) -> Path:
    candidates = []
    if including is not None:
        candidates.append(including.parent / name)
    candidates.append(SRC_DIR / name)
    for c in candidates:
        if c.is_file():
            return c.resolve()
    where = f" (included from {including.relative_to(SRC_DIR)})" if including else ""
    raise FileNotFoundError(f"kernel source {name!r} not found under {SRC_DIR}{where}")


def _expand(path: Path, seen: set, out: list) -> None:
    if path in seen:
        return
    seen.add(path)
    rel = path.relative_to(SRC_DIR).as_posix()
    out.append(f'#line 1 "{rel}"')
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if _PRAGMA_ONCE.match(line):
            out.append("")
            continue
        m = _INCLUDE.match(line)
        if m:
            _expand(_resolve(m.group(1), path), seen, out)
            out.append(f'#line {lineno + 1} "{rel}"')
            continue
        out.append(line)


def expand_source(name: str) -> str:
    """Full text of ``cuda_src/name`` with quoted includes pasted in."""
    out: list = []
    _expand(_resolve(name, None), set(), out)
    return "\n".join(out) + "\n"


_TEXTS: dict = {}  # name -> (modification times under cuda_src, expanded text): one entry per source


def source_text(name: str) -> str:
    """``expand_source`` cached on the modification times of every file under cuda_src."""
    stamp = tuple(sorted((p.name, p.stat().st_mtime_ns) for p in SRC_DIR.rglob("*.cu*")))
    hit = _TEXTS.get(name)
    if hit is None or hit[0] != stamp:
        hit = _TEXTS[name] = (stamp, expand_source(name))
    return hit[1]
