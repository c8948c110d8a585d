"""The public API: explicit signatures, nothing but public re-exports at the top level."""
from __future__ import annotations

import inspect

import mate_cupy


def _public_callables():
    for name in mate_cupy.__all__:
        obj = getattr(mate_cupy, name)
        if inspect.isfunction(obj) or inspect.isbuiltin(obj):
            yield name, obj
        elif inspect.isclass(obj):
            for meth_name, meth in vars(obj).items():
                if not meth_name.startswith("_") and inspect.isfunction(meth):
                    yield f"{name}.{meth_name}", meth


def test_every_public_function_has_an_explicit_signature():
    bad = []
    for name, fn in _public_callables():
        sig = inspect.signature(fn)
        kinds = {p.kind for p in sig.parameters.values()}
        if inspect.Parameter.VAR_POSITIONAL in kinds or inspect.Parameter.VAR_KEYWORD in kinds:
            bad.append(f"{name}{sig}")
    assert not bad, "public functions with *args/**kwargs:\n" + "\n".join(bad)


def test_every_public_function_is_documented():
    missing = [name for name, fn in _public_callables() if not (fn.__doc__ or "").strip()]
    assert not missing, missing


def test_import_does_not_import_frameworks_or_cupy():
    import subprocess
    import sys

    code = ("import sys, mate_cupy; bad = [m for m in ('torch', 'jax', 'cupy') if m in sys.modules]; "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing mate_cupy imported {out}"
