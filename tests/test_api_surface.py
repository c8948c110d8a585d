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


def test_a_required_array_given_as_none_is_named():
    """None for a required array is a TypeError naming it (not an internal KeyError/AttributeError)."""
    import numpy as np
    import pytest

    mc = mate_cupy
    x = np.zeros((2, 4), np.float32)
    info = mc.msa_plan_from_lengths([2], [4], 4, device="cpu")
    cases = [
        (lambda: mc.msa(None, x, x, info), "msa: q is required"),
        (lambda: mc.msa(x, x, None, info), "msa: v is required"),
        (lambda: mc.chunk_kda(x, x, None, x, x), "chunk_kda: v is required"),
        (lambda: mc.gated_delta_rule_decode(x, x, x, None, None, None, None, None, None, x),
         "gated_delta_rule_decode: a is required"),
        (lambda: mc.cast(None, "bfloat16"), "cast: x is required"),
        (lambda: mc.sparse_topk_select(None, 4), "sparse_topk_select: max_score is required"),
        (lambda: mc.build_page_table_from_flat_kv_indices(None, [1], 16), "kv_indices is required"),
        (lambda: mc.build_page_table_from_flat_kv_indices([1], None, 16), "kv_lens is required"),
        (lambda: mc.sparse_attention_pipeline(x, x, x, x, None, None), "sparse_attention_pipeline: index_k is required"),
    ]
    for fn, message in cases:
        with pytest.raises(TypeError, match=message):
            fn()
