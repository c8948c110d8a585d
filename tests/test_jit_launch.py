"""Kernel parameter packing (mate_cupy.jit.launch) on the host: layout and conversions."""
from __future__ import annotations

import os
import shutil
import struct
import subprocess

import numpy as np
import pytest

from mate_cupy.jit.compiler import cuda_include_dirs
from mate_cupy.jit.launch import _LAUNCH_CONFIG, _PROGRAMMATIC_ATTRIBUTE, KernelParams, address


class _HasPtr:
    def __init__(self, ptr):
        self.ptr = ptr


def test_pack_aligns_each_parameter_to_its_size():
    p = KernelParams((("a", "ptr"), ("n", "i32"), ("b", "ptr"), ("x", "f32"), ("y", "i64"), ("u", "u32")))
    raw = p.pack((0x1000, np.int32(-3), None, 1.5, 2**40, 7))
    assert len(raw) == 8 + 4 + 4 + 8 + 4 + 4 + 8 + 4
    a, n, b, x, y, u = struct.unpack("<Qi4xQf4xqI", raw)
    assert (a, n, b, x, y, u) == (0x1000, -3, 0, 1.5, 2**40, 7)


def test_pointer_values_accept_addresses_none_and_ptr_objects():
    assert address(None) == 0 and address(123) == 123 and address(_HasPtr(456)) == 456
    p = KernelParams((("a", "ptr"), ("b", "ptr")))
    assert struct.unpack("<QQ", p.pack((_HasPtr(8), None))) == (8, 0)


def test_wrong_parameter_count_names_the_parameters():
    p = KernelParams((("a", "ptr"), ("n", "i32")))
    with pytest.raises(TypeError, match=r"takes 2 parameters \(a, n\), got 1"):
        p.pack((1,))


def test_fill_returns_a_table_of_pointers_into_the_packed_buffer():
    import ctypes

    p = KernelParams((("a", "ptr"), ("n", "i32"), ("x", "f32")))
    table = p.fill((0xABC, 5, 2.0))
    ptrs = (ctypes.c_void_p * 3).from_address(table)
    assert ctypes.c_uint64.from_address(ptrs[0]).value == 0xABC
    assert ctypes.c_int32.from_address(ptrs[1]).value == 5
    assert ctypes.c_float.from_address(ptrs[2]).value == 2.0


def test_fill_takes_ptr_objects_and_refuses_a_wrong_count():
    """fill packs plain values directly and falls back to converting pointer slots."""
    import ctypes

    p = KernelParams((("a", "ptr"), ("b", "ptr"), ("n", "i32")))
    data, _, _ = p._buffers()
    p.fill((_HasPtr(8), None, 5))
    assert struct.unpack_from("<QQi", ctypes.string_at(ctypes.addressof(data), 20)) == (8, 0, 5)
    p.fill((16, 24, -1))
    assert struct.unpack_from("<QQi", ctypes.string_at(ctypes.addressof(data), 20)) == (16, 24, -1)
    with pytest.raises(TypeError, match=r"takes 3 parameters"):
        p.fill((1, 2))


def test_get_kernel_loads_and_opts_in_on_the_requested_device(monkeypatch):
    """A kernel asked for on device 1 while device 0 is current is loaded, and its shared
    memory opted into, with device 1 current (CuPy resolves a function on the current device)."""
    import cupy

    from mate_cupy.jit import compiler
    from mate_cupy.jit.registry import registered
    from mate_cupy.runtime import interop

    current = [0]
    events = []

    class FakeDevice:
        def __init__(self, dev):
            self.dev = dev

        def __enter__(self):
            self.prev, current[0] = current[0], self.dev

        def __exit__(self, *exc):
            current[0] = self.prev

    class FakeFunction:
        ptr = 0x1000

    class FakeRaw:
        @property
        def kernel(self):
            events.append(("load", current[0]))
            return FakeFunction()

        @property
        def max_dynamic_shared_size_bytes(self):
            return 0

        @max_dynamic_shared_size_bytes.setter
        def max_dynamic_shared_size_bytes(self, n):
            events.append(("smem", current[0], n))

    class FakeModule:
        def get_function(self, name):
            return FakeRaw()

    monkeypatch.setattr(interop, "_GET_DEVICE", [lambda: current[0]])
    monkeypatch.setattr(cupy.cuda, "Device", FakeDevice)
    monkeypatch.setattr(compiler, "get_module", lambda spec, device_id: FakeModule())
    monkeypatch.setattr(compiler, "_kernels", {})
    spec = registered()[0]
    k = compiler.get_kernel(spec, None, 1)
    k.reserve_shared_memory(100 * 1024)
    assert events == [("load", 1), ("smem", 1, 100 * 1024)]
    assert current[0] == 0 and k.device == 1
    assert compiler.get_kernel(spec, None, 1) is k and compiler.get_kernel(spec, None, 0) is not k
    assert events[-1] == ("load", 0)


def test_programmatic_launch_structures_match_the_driver_header(tmp_path):
    """The ``CUlaunchConfig`` and ``CUlaunchAttribute`` bytes handed to ``cuLaunchKernelEx``
    have the layout of ``cuda.h``: sizes, field offsets and the attribute's id, as the C
    compiler lays them out."""
    include = next((d for d in cuda_include_dirs() if os.path.isfile(os.path.join(d, "cuda.h"))), None)
    cc = shutil.which("cc") or shutil.which("gcc")
    if include is None or cc is None:
        pytest.skip("needs cuda.h and a C compiler")
    src = tmp_path / "layout.c"
    src.write_text(
        "#include <stddef.h>\n#include <stdio.h>\n#include <cuda.h>\n"
        "int main(void) {\n"
        "  printf(\"%zu %zu %zu %zu %zu %zu %zu %zu %zu %d\\n\", sizeof(CUlaunchConfig),\n"
        "    offsetof(CUlaunchConfig, blockDimX), offsetof(CUlaunchConfig, sharedMemBytes),\n"
        "    offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs),\n"
        "    offsetof(CUlaunchConfig, numAttrs), sizeof(CUlaunchAttribute),\n"
        "    offsetof(CUlaunchAttribute, value),\n"
        "    offsetof(CUlaunchAttributeValue, programmaticStreamSerializationAllowed),\n"
        "    (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);\n"
        "  return 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, f"-I{include}", str(src), "-o", str(exe)], check=True, capture_output=True)
    size, block_at, smem_at, stream_at, attrs_at, n_at, attr_size, value_at, allowed_at, attr_id = map(
        int, subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split())

    cfg = _LAUNCH_CONFIG.pack(11, 12, 13, 21, 22, 23, 31, 0x0102030405060708, 0x1112131415161718, 3)
    assert len(cfg) == size
    assert struct.unpack_from("<3I", cfg, 0) == (11, 12, 13)
    assert struct.unpack_from("<3I", cfg, block_at) == (21, 22, 23)
    assert struct.unpack_from("<I", cfg, smem_at) == (31,)
    assert struct.unpack_from("<Q", cfg, stream_at) == (0x0102030405060708,)
    assert struct.unpack_from("<Q", cfg, attrs_at) == (0x1112131415161718,)
    assert struct.unpack_from("<I", cfg, n_at) == (3,)

    assert len(_PROGRAMMATIC_ATTRIBUTE) == attr_size
    assert struct.unpack_from("<i", _PROGRAMMATIC_ATTRIBUTE, 0) == (attr_id,)
    assert struct.unpack_from("<i", _PROGRAMMATIC_ATTRIBUTE, value_at + allowed_at) == (1,)
