"""build_page_table_from_flat_kv_indices on host arrays: properties and refusals."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mate_cupy as mc


def test_small_table():
    table = mc.build_page_table_from_flat_kv_indices(np.array([5, 9, 2, 7], np.int32), np.array([17, 0, 64, 1]), 32)
    np.testing.assert_array_equal(table, [[5, 0], [0, 0], [9, 2], [7, 0]])
    assert table.dtype == np.int32


def test_wide_ids_saturate_instead_of_wrapping():
    """int64 ids beyond int32 become int32's bounds (outside every cache), never the low bits."""
    idx = np.array([5 + 2**32, -(2**40), 2, 7 + 2**40], np.int64)
    table = mc.build_page_table_from_flat_kv_indices(idx, np.array([17, 64, 1]), 32)
    np.testing.assert_array_equal(table, [[2**31 - 1, 0], [-(2**31), 2], [2**31 - 1, 0]])


def test_empty_inputs():
    table = mc.build_page_table_from_flat_kv_indices(np.zeros(0, np.int32), np.zeros(0, np.int32), 16)
    assert table.shape == (0, 0)
    table = mc.build_page_table_from_flat_kv_indices(np.zeros(0, np.int64), np.zeros(3, np.int32), 16)
    assert table.shape == (3, 0)


@settings(max_examples=200, deadline=None)
@given(
    lens=st.lists(st.integers(0, 700), min_size=0, max_size=8),
    page_size=st.sampled_from([1, 16, 32, 64, 128, 256]),
    int64=st.booleans(),
    data=st.data(),
)
def test_builder_property(lens, page_size, int64, data):
    counts = [-(-n // page_size) for n in lens]
    total = sum(counts)
    ids = np.array(data.draw(st.lists(st.integers(0, 10**6), min_size=total, max_size=total)),
                   dtype=np.int64 if int64 else np.int32)
    table = mc.build_page_table_from_flat_kv_indices(ids, np.array(lens, dtype=np.int32), page_size)
    assert table.dtype == np.int32 and table.shape == (len(lens), max(counts, default=0))
    start = 0
    for b, c in enumerate(counts):
        np.testing.assert_array_equal(table[b, :c], ids[start:start + c])  # the request's pages, in order
        assert np.all(table[b, c:] == 0)  # then zeros
        start += c


@pytest.mark.torch
def test_torch_in_torch_out():
    import torch

    table = mc.build_page_table_from_flat_kv_indices(torch.tensor([3, 4, 5]), torch.tensor([20, 1]), 16)
    assert isinstance(table, torch.Tensor) and table.dtype == torch.int32
    assert table.tolist() == [[3, 4], [5, 0]]


@pytest.mark.parametrize(
    "idx, lens, page_size, exc",
    [
        pytest.param([1, 2], [20], 0, ValueError, id="page-size-zero"),
        pytest.param([1, 2], [20], -16, ValueError, id="page-size-negative"),
        pytest.param([1, 2, 3], [20], 16, ValueError, id="too-many-ids"),
        pytest.param([1], [20], 16, ValueError, id="too-few-ids"),
        pytest.param([[1, 2]], [20], 16, ValueError, id="ids-2d"),
        pytest.param([1, 2], [[20]], 16, ValueError, id="lens-2d"),
        pytest.param([1.0, 2.0], [20], 16, TypeError, id="float-ids"),
        pytest.param([1, 2], [-4, 20], 16, ValueError, id="negative-length"),
    ],
)
def test_builder_refusals(idx, lens, page_size, exc):
    with pytest.raises(exc):
        mc.build_page_table_from_flat_kv_indices(np.array(idx), np.array(lens), page_size)


def _on_cuda(a):
    """The same array described as if it lived on cuda:0 (validation reads only metadata)."""
    from mate_cupy.runtime.interop import Arg

    return Arg(a.name, a.obj, a.dtype, "cupy", 0, a.shape, a.strides, a.ptr, data=a.data)


@pytest.mark.parametrize(
    "idx, lens, page_size, exc",
    [
        pytest.param([1, 2], [20], 0, ValueError, id="page-size-zero"),
        pytest.param([1, 2, 3], [20], 16, ValueError, id="too-many-ids"),
        pytest.param([[1, 2]], [20], 16, ValueError, id="ids-2d"),
        pytest.param([1, 2], [[20]], 16, ValueError, id="lens-2d"),
        pytest.param([1.0, 2.0], [20], 16, TypeError, id="float-ids"),
        pytest.param([1, 2], [20.0], 16, TypeError, id="float-lens"),
        pytest.param([1, 2], [-4, 20], 16, ValueError, id="negative-length"),
    ],
)
def test_builder_refusals_are_the_same_for_host_and_cuda_ids(idx, lens, page_size, exc):
    """validate_page_table (the one validation of both paths) refuses the CUDA description
    of each refused host input with the same exception and message."""
    from mate_cupy.msa.page_table import validate_page_table
    from mate_cupy.runtime.interop import wrap

    messages = []
    for device_arg in (lambda a: a, _on_cuda):
        with pytest.raises(exc) as info:
            validate_page_table(device_arg(wrap("kv_indices", np.array(idx))), np.array(lens), page_size)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


def test_builder_problem_holds_the_page_starts():
    from mate_cupy.msa.page_table import validate_page_table
    from mate_cupy.runtime.interop import wrap

    p = validate_page_table(wrap("kv_indices", np.arange(7, dtype=np.int16)), [17, 0, 64, 1], 16)
    assert (p.batch, p.max_pages, p.page_size) == (4, 4, 16)
    assert p.page_start.tolist() == [0, 2, 2, 6, 7] and p.page_start.dtype == np.int64
