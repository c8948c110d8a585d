"""``chunk_kda`` on host arrays: results against the float64 references, output/state dtype
rules, preallocated outputs, varlen layouts, frameworks, and every refused input; the same
refusals for CUDA inputs (validation run on CPU-side stand-ins for CUDA arrays), the
workspace size helper and the CUDA workspace checks."""
from __future__ import annotations

import numpy as np
import pytest

import mate_cupy
from mate_cupy import chunk_kda, chunk_kda_workspace_bytes
from mate_cupy.kda import chunk as ch
from mate_cupy.runtime import interop
from mate_cupy.runtime import workspace as wsmod
from mate_cupy.reference.kda import kda_chunked, kda_recurrent
from test_kda_reference import BF16, kda_inputs, rel

F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
TOL = {BF16: 1e-2, F16: 5e-3}


def _ref_kwargs(x):
    return {key: val for key, val in x.items() if key != "output_final_state"}


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("layout", ["dense", "varlen4d", "varlen3d"])
@pytest.mark.parametrize("gate_params", [False, True], ids=["logdecay", "gateparams"])
@pytest.mark.parametrize("state", [None, "f32", "qdtype"])
def test_matches_references(rng, dtype, layout, gate_params, state):
    state_dt = {None: None, "f32": F32, "qdtype": dtype}[state]
    if layout == "dense":
        x = kda_inputs(rng, 2, 77, 2, 4, dtype=dtype, gate_params=gate_params, state=state_dt)
    else:
        x = kda_inputs(rng, 0, 0, 1, 2, dtype=dtype, gate_params=gate_params, state=state_dt, lens=[13, 0, 64, 66])
        if layout == "varlen3d":
            for key in ("q", "k", "v", "g", "beta"):
                x[key] = x[key][0]
    o, fs = chunk_kda(**x, output_final_state=True)
    o_ref, fs_ref = kda_recurrent(**x)
    o_chk, fs_chk = kda_chunked(**x)
    assert isinstance(o, np.ndarray) and o.dtype == dtype and o.shape == x["v"].shape
    assert fs.dtype == (state_dt if state_dt is not None else dtype)
    assert fs.shape == fs_ref.shape
    assert rel(o, o_ref) < TOL[dtype] and rel(o, o_chk) < TOL[dtype]
    state_tol = 1e-6 if fs.dtype == F32 else TOL[dtype]
    assert rel(fs, fs_ref) < state_tol and rel(fs, fs_chk) < state_tol
    # stored values are the float64 results rounded once
    np.testing.assert_array_equal(o, o_ref.astype(dtype))
    np.testing.assert_array_equal(fs, fs_ref.astype(fs.dtype))


def test_returns_output_only_by_default(rng):
    x = kda_inputs(rng, 1, 5, 1, 1)
    o = chunk_kda(**x)
    assert isinstance(o, np.ndarray) and o.shape == x["v"].shape


def test_defaults_scale_lower_bound_l2norm(rng):
    x = kda_inputs(rng, 1, 20, 2, 2, gate_params=True)
    o1 = chunk_kda(**x)
    o2 = chunk_kda(**x, scale=128 ** -0.5, lower_bound=-5.0, use_qk_l2norm_in_kernel=True)
    np.testing.assert_array_equal(o1, o2)
    o3 = chunk_kda(**x, lower_bound=-2.0)
    assert not np.array_equal(o1, o3)
    o4 = chunk_kda(**x, scale=0.25, use_qk_l2norm_in_kernel=False)
    ref, _ = kda_recurrent(**x, scale=0.25, use_qk_l2norm=False)
    assert rel(o4, ref) < 1e-2


def test_final_state_dtype_rules(rng):
    x = kda_inputs(rng, 2, 9, 1, 2)
    _, fs = chunk_kda(**x, output_final_state=True)
    assert fs.dtype == BF16  # q's dtype without states
    pre = np.full((2, 2, 128, 128), np.nan, np.float32)
    _, fs2 = chunk_kda(**x, output_final_state=True, final_state=pre)
    assert fs2 is pre and np.isfinite(pre).all()
    init = (0.1 * rng.standard_normal((2, 2, 128, 128))).astype(np.float32)
    _, fs3 = chunk_kda(**x, output_final_state=True, initial_state=init)
    assert fs3.dtype == F32
    _, ref = kda_recurrent(**x, initial_state=init)
    assert rel(fs3, ref) < 1e-6


def test_preallocated_output_and_state_written_in_place(rng):
    x = kda_inputs(rng, 2, 40, 2, 4, gate_params=True, state=np.float32)
    out = np.full(x["v"].shape, np.nan, BF16)
    fs = np.full((2, 4, 128, 128), np.nan, np.float32)
    o, f = chunk_kda(**x, output_final_state=True, output=out, final_state=fs)
    assert o is out and f is fs
    o_ref, fs_ref = kda_recurrent(**x)
    np.testing.assert_array_equal(out, o_ref.astype(BF16))
    assert rel(fs, fs_ref) < 1e-6


def test_final_state_ignored_without_output_final_state(rng):
    x = kda_inputs(rng, 1, 4, 1, 1)
    fs = np.full((1, 1, 128, 128), 7.0, np.float32)
    res = chunk_kda(**x, final_state=fs)
    assert isinstance(res, np.ndarray)
    assert (fs == 7.0).all()


def test_varlen_shapes(rng):
    x = kda_inputs(rng, 0, 0, 1, 2, lens=[3, 5])
    x3 = dict(x, q=x["q"][0], k=x["k"][0], v=x["v"][0], g=x["g"][0], beta=x["beta"][0])
    o3, fs3 = chunk_kda(**x3, output_final_state=True)
    o4, fs4 = chunk_kda(**x, output_final_state=True)
    assert o3.shape == (8, 2, 128) and o4.shape == (1, 8, 2, 128) and fs3.shape == (2, 2, 128, 128)
    np.testing.assert_array_equal(o3, o4[0])
    np.testing.assert_array_equal(fs3, fs4)
    # beta packed 2-D with 4-D q, and a 3-D preallocated output for 3-D q
    o5 = chunk_kda(**dict(x, beta=x["beta"][0]))
    np.testing.assert_array_equal(o5, o4)
    out = np.empty((8, 2, 128), BF16)
    assert chunk_kda(**x3, output=out) is out
    np.testing.assert_array_equal(out, o3)


def test_empty_sequences_keep_state(rng):
    init = (0.3 * rng.standard_normal((3, 2, 128, 128))).astype(np.float32)
    x = kda_inputs(rng, 0, 0, 2, 2, lens=[0, 4, 0])
    o, fs = chunk_kda(**x, initial_state=init, output_final_state=True)
    np.testing.assert_array_equal(fs[0], init[0])
    np.testing.assert_array_equal(fs[2], init[2])
    assert not np.array_equal(fs[1], init[1])
    # a dense batch with T = 0
    y = kda_inputs(rng, 2, 0, 1, 1)
    o, fs = chunk_kda(**y, initial_state=init[:2, :1], output_final_state=True)
    assert o.shape == (2, 0, 1, 128)
    np.testing.assert_array_equal(fs, init[:2, :1])
    # no sequences at all
    z = kda_inputs(rng, 0, 0, 1, 1, lens=[])
    o, fs = chunk_kda(**z, output_final_state=True)
    assert o.shape == (1, 0, 1, 128) and fs.shape == (0, 1, 128, 128)


def test_dt_bias_flat_and_non_f32_gate_params(rng):
    x = kda_inputs(rng, 1, 10, 1, 2, gate_params=True)
    o1 = chunk_kda(**x)
    o2 = chunk_kda(**dict(x, dt_bias=x["dt_bias"].reshape(-1)))
    np.testing.assert_array_equal(o1, o2)
    o3 = chunk_kda(**dict(x, A_log=x["A_log"].astype(np.float64), dt_bias=x["dt_bias"].astype(BF16)))
    ref, _ = kda_recurrent(**dict(x, dt_bias=x["dt_bias"].astype(BF16)))
    np.testing.assert_array_equal(o3, ref.astype(BF16))


def test_non_contiguous_inputs(rng):
    x = kda_inputs(rng, 2, 12, 2, 2, gate_params=True)
    big = {key: np.repeat(x[key], 2, axis=1)[:, ::2] for key in ("q", "k", "v", "g", "beta")}
    assert not big["q"].flags.c_contiguous
    np.testing.assert_array_equal(chunk_kda(**dict(x, **big)), chunk_kda(**x))


def test_int64_cu_seqlens(rng):
    x = kda_inputs(rng, 0, 0, 1, 1, lens=[2, 3])
    o1 = chunk_kda(**x)
    o2 = chunk_kda(**dict(x, cu_seqlens=x["cu_seqlens"].astype(np.int64)))
    np.testing.assert_array_equal(o1, o2)


@pytest.mark.torch
def test_torch_cpu_tensors(rng):
    import torch

    x = kda_inputs(rng, 1, 30, 1, 2, gate_params=True, state=np.float32)
    o_np, fs_np = chunk_kda(**x, output_final_state=True)

    def tt(a):
        t = torch.from_numpy(np.asarray(a, np.float32) if a.dtype == BF16 else a)
        return t.to(torch.bfloat16) if a.dtype == BF16 else t

    xt = {key: tt(val) for key, val in x.items()}
    o, fs = chunk_kda(**xt, output_final_state=True)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and fs.dtype == torch.float32
    np.testing.assert_array_equal(o.float().numpy(), o_np.astype(np.float32))
    np.testing.assert_array_equal(fs.numpy(), fs_np)
    out = torch.full(o.shape, float("nan"), dtype=torch.bfloat16)
    assert chunk_kda(**xt, output=out) is out
    assert torch.equal(out, o)


def test_package_exports():
    assert mate_cupy.chunk_kda is chunk_kda
    assert mate_cupy.chunk_kda_workspace_bytes is chunk_kda_workspace_bytes
    for name in ("chunk_kda", "chunk_kda_workspace_bytes", "gated_delta_rule_decode"):
        assert name in mate_cupy.__all__
    assert getattr(chunk_kda, "__mate_api__", False)


def test_signature_and_defaults():
    import inspect

    sig = inspect.signature(chunk_kda)
    assert list(sig.parameters) == ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                                    "cu_seqlens", "A_log", "dt_bias", "lower_bound", "use_qk_l2norm_in_kernel",
                                    "output", "final_state", "workspace"]
    defaults = {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    assert defaults == dict(scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, A_log=None,
                            dt_bias=None, lower_bound=-5.0, use_qk_l2norm_in_kernel=True, output=None,
                            final_state=None, workspace=None)


# ----------------------------------------------------------------------------- refused inputs


def _base(rng, varlen=False):
    if varlen:
        x = kda_inputs(rng, 0, 0, 1, 2, lens=[2, 3], gate_params=True)
    else:
        x = kda_inputs(rng, 2, 3, 1, 2, gate_params=True)
    return x


def _drop(d, *keys):
    return {k: v for k, v in d.items() if k not in keys}


BF = BF16
ERRORS = [
    # (id, varlen base, mutation(x, rng) -> kwargs, exception)
    ("dense-q-3d", False, lambda x: dict(x, q=x["q"][0]), ValueError),
    ("varlen-q-batch2", True, lambda x: dict(x, q=np.concatenate([x["q"], x["q"]])), ValueError),
    ("varlen-q-2d", True, lambda x: dict(x, q=x["q"][0, :, 0]), ValueError),
    ("varlen-q-5d", True, lambda x: dict(x, q=x["q"][None]), ValueError),
    ("head-dim-64", False, lambda x: dict(x, q=x["q"][..., :64], k=x["k"][..., :64]), ValueError),
    ("v-head-dim-64", False, lambda x: dict(x, v=x["v"][..., :64]), ValueError),
    ("k-shape", False, lambda x: dict(x, k=x["k"][:, :2]), ValueError),
    ("v-time", False, lambda x: dict(x, v=x["v"][:, :2], g=x["g"][:, :2], beta=x["beta"][:, :2]), ValueError),
    ("g-heads", False, lambda x: dict(x, g=np.concatenate([x["g"], x["g"]], axis=2)), ValueError),
    ("gva-not-divisible", False,
     lambda x: dict(x, q=np.repeat(x["q"], 3, 2), k=np.repeat(x["k"], 3, 2)), ValueError),
    ("beta-shape", False, lambda x: dict(x, beta=x["beta"][..., :1]), ValueError),
    ("beta-per-channel", False, lambda x: dict(x, beta=x["v"]), ValueError),
    ("q-float32", False, lambda x: dict(x, q=x["q"].astype(np.float32)), TypeError),
    ("k-dtype", False, lambda x: dict(x, k=x["k"].astype(np.float16)), TypeError),
    ("v-dtype", False, lambda x: dict(x, v=x["v"].astype(np.float16)), TypeError),
    ("g-dtype", False, lambda x: dict(x, g=x["g"].astype(np.float32)), TypeError),
    ("beta-dtype", False, lambda x: dict(x, beta=x["beta"].astype(np.float32)), TypeError),
    ("A_log-alone", False, lambda x: _drop(x, "dt_bias"), ValueError),
    ("dt_bias-alone", False, lambda x: _drop(x, "A_log"), ValueError),
    ("A_log-shape", False, lambda x: dict(x, A_log=x["A_log"][:1]), ValueError),
    ("dt_bias-shape", False, lambda x: dict(x, dt_bias=x["dt_bias"][:, :64]), ValueError),
    ("A_log-int", False, lambda x: dict(x, A_log=np.zeros(2, np.int32)), TypeError),
    ("initial-state-f16", False,
     lambda x: dict(x, initial_state=np.zeros((2, 2, 128, 128), np.float16)), TypeError),
    ("initial-state-shape", False,
     lambda x: dict(x, initial_state=np.zeros((2, 2, 128, 64), np.float32)), ValueError),
    ("initial-state-count", False,
     lambda x: dict(x, initial_state=np.zeros((3, 2, 128, 128), np.float32)), ValueError),
    ("cu_seqlens-float", True, lambda x: dict(x, cu_seqlens=x["cu_seqlens"].astype(np.float32)), TypeError),
    ("cu_seqlens-2d", True, lambda x: dict(x, cu_seqlens=x["cu_seqlens"][None]), ValueError),
    ("cu_seqlens-start", True, lambda x: dict(x, cu_seqlens=np.array([1, 2, 5], np.int32)), ValueError),
    ("cu_seqlens-decreasing", True, lambda x: dict(x, cu_seqlens=np.array([0, 4, 3, 5], np.int32)), ValueError),
    ("cu_seqlens-too-long", True, lambda x: dict(x, cu_seqlens=np.array([0, 2, 6], np.int32)), ValueError),
    ("cu_seqlens-short", True, lambda x: dict(x, cu_seqlens=np.array([0, 2, 4], np.int32)), ValueError),
    ("output-shape", False, lambda x: dict(x, output=np.empty((2, 3, 2, 64), BF)), ValueError),
    ("output-dtype", False, lambda x: dict(x, output=np.empty((2, 3, 2, 128), np.float32)), TypeError),
    ("final-state-f16", False,
     lambda x: dict(x, output_final_state=True, final_state=np.zeros((2, 2, 128, 128), np.float16)), TypeError),
    ("final-state-shape", False,
     lambda x: dict(x, output_final_state=True, final_state=np.zeros((1, 2, 128, 128), np.float32)), ValueError),
    ("state-dtypes-differ", False,
     lambda x: dict(x, output_final_state=True, initial_state=np.zeros((2, 2, 128, 128), BF),
                    final_state=np.zeros((2, 2, 128, 128), np.float32)), TypeError),
    ("q-not-array", False, lambda x: dict(x, q=[[1.0]]), TypeError),
    ("no-q-heads", False, lambda x: dict(x, q=x["q"][:, :, :0], k=x["k"][:, :, :0]), ValueError),
    ("v-heads-over-kernel-limit", False, lambda x: _many_v_heads(x, 65536), NotImplementedError),
    ("workspace-not-on-q-device", False, lambda x: dict(x, workspace=HostBuffer(np.empty(1 << 20, np.uint8))),
     ValueError),
    ("scale-nan", False, lambda x: dict(x, scale=float("nan")), ValueError),
    ("scale-inf", False, lambda x: dict(x, scale=float("inf")), ValueError),
    ("scale-str", False, lambda x: dict(x, scale="0.1"), TypeError),
    ("lower-bound-nan", False, lambda x: dict(x, lower_bound=float("nan")), ValueError),
]
# Conditions on cu_seqlens values: checked for host inputs only (CUDA offsets are not read
# on the host; the kernels clamp them).
HOST_ONLY = {"cu_seqlens-start", "cu_seqlens-decreasing", "cu_seqlens-too-long", "cu_seqlens-short"}


class HostBuffer:
    """A host array seen only through DLPack (it stays a host array for the CUDA stand-ins below)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def _many_v_heads(x, hv):
    """Zero-length (T = 0) inputs with ``hv`` value heads: cheap at any head count."""
    z = lambda *shape: np.zeros(shape, BF)  # noqa: E731
    return dict(q=z(2, 0, 1, 128), k=z(2, 0, 1, 128), v=z(2, 0, hv, 128), g=z(2, 0, hv, 128), beta=z(2, 0, hv))


@pytest.mark.parametrize("varlen,mutate,exc", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_refused_inputs(rng, varlen, mutate, exc):
    x = mutate(_base(rng, varlen))
    with pytest.raises(exc):
        chunk_kda(**x)


def test_error_messages_name_the_argument(rng):
    x = _base(rng)
    with pytest.raises(TypeError, match="beta"):
        chunk_kda(**dict(x, beta=x["beta"].astype(np.float32)))
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(**dict(x, initial_state=np.zeros((2, 2, 128, 64), np.float32)))
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda(**dict(_base(rng, True), cu_seqlens=np.array([0, 2, 6], np.int32)))


def test_refusal_leaves_preallocated_arrays_untouched(rng):
    x = _base(rng, True)
    out = np.full((1, 5, 2, 128), 3.0, BF16)
    with pytest.raises(ValueError):
        chunk_kda(**dict(x, cu_seqlens=np.array([0, 2, 6], np.int32)), output=out)
    assert (out.astype(np.float32) == 3.0).all()


def test_host_inputs_take_no_workspace(rng):
    x = _base(rng)
    with pytest.raises(ValueError, match="workspace"):
        chunk_kda(**x, workspace=np.empty(chunk_kda_workspace_bytes(2, 3, 2), np.uint8))


@pytest.mark.slow  # the reference builds 65535 zero states
def test_kernel_limit_accepts_the_largest_head_count(rng):
    o = chunk_kda(**_many_v_heads(None, 65535))
    assert o.shape == (2, 0, 65535, 128)


# ----------------------------------------------------------------------------- workspace size


def test_workspace_bytes_values():
    slot = 66048
    assert chunk_kda_workspace_bytes(2, 130, 4) == 2 * 3 * 4 * slot  # 3 chunks per sequence
    assert chunk_kda_workspace_bytes(1, 64, 1) == slot
    assert chunk_kda_workspace_bytes(3, 0, 8) == 0
    # varlen: (S + 63 N) // 64 slots, then an int32 [N + 1] offsets table
    assert chunk_kda_workspace_bytes(1, 1000, 64, num_seqs=3) == (1189 // 64) * 64 * slot + 16
    assert chunk_kda_workspace_bytes(1, 0, 4, num_seqs=0) == chunk_kda_workspace_bytes(1, 100, 4, num_seqs=0) == 4
    assert chunk_kda_workspace_bytes(np.int64(1), np.int32(10), 2, num_seqs=np.int64(2)) == 2 * 2 * slot + 12


def test_workspace_bytes_bounds_every_varlen_split(rng):
    for _ in range(200):
        lens = rng.integers(0, 300, rng.integers(1, 12))
        need = int(sum((n + 63) // 64 for n in lens)) * 3 * 66048 + 4 * (len(lens) + 1)
        assert need <= chunk_kda_workspace_bytes(1, int(lens.sum()), 3, num_seqs=len(lens))


def test_workspace_bytes_grow_with_every_argument():
    base = chunk_kda_workspace_bytes(1, 500, 4, num_seqs=5)
    assert base <= chunk_kda_workspace_bytes(1, 501, 4, num_seqs=5)
    assert base <= chunk_kda_workspace_bytes(1, 500, 5, num_seqs=5)
    assert base <= chunk_kda_workspace_bytes(1, 500, 4, num_seqs=6)
    dense = chunk_kda_workspace_bytes(2, 500, 4)
    assert dense <= chunk_kda_workspace_bytes(3, 500, 4) and dense <= chunk_kda_workspace_bytes(2, 501, 4)


@pytest.mark.parametrize("args, exc", [
    ((1.5, 10, 2), ValueError), ((1, "10", 2), TypeError), ((1, 10, 2, 2.5), ValueError),
    ((-1, 10, 2), ValueError), ((1, -10, 2), ValueError), ((1, 10, -2), ValueError), ((1, 10, 2, -1), ValueError),
    ((2, 10, 2, 3), ValueError),  # varlen input has batch 1
    ((None, 10, 2), TypeError), ((True, 10, 2), TypeError),
])
def test_workspace_bytes_refusals(args, exc):
    with pytest.raises(exc):
        chunk_kda_workspace_bytes(*args)


# ----------------------------------------------------------------------------- CUDA validation on the CPU
# ``validate`` only reads array descriptions (Arg: shape, dtype, device, address, strides), so
# NumPy arrays described as cuda:0 arrays exercise its CUDA branch without a GPU.

STREAM = 0x5000


def cuda_standin(name, a):
    """An Arg describing the NumPy array ``a`` as a cuda:0 CuPy array (the data stays NumPy)."""
    if not isinstance(a, np.ndarray):
        return interop.wrap(name, a)
    item = a.dtype.itemsize
    arg = interop.Arg(name, a, a.dtype, "cupy", 0, a.shape, tuple(s // item for s in a.strides),
                      a.__array_interface__["data"][0], data=a)
    return arg


class StandinCall(interop.Call):
    """A Call of CUDA stand-ins: no device scope, a fixed stream address, and allocations
    (NumPy, described as cuda:0) recorded in ``allocations``."""

    allocations: list = []

    def add(self, name, obj):
        if obj is None:
            return None
        arg = cuda_standin(name, obj)
        if self.device is None:
            self.device, self.framework, self._first = arg.device, arg.framework, name
        elif arg.device != self.device:
            raise ValueError(f"{name} is on another device than {self._first}")
        self.args[name] = arg
        return arg

    def device_scope(self):
        import contextlib

        return contextlib.nullcontext()

    @property
    def stream(self):
        import contextlib

        return contextlib.nullcontext()

    @property
    def stream_ptr(self):
        return STREAM

    def new(self, name, shape, dtype):
        StandinCall.allocations.append(name)
        return cuda_standin(name, np.zeros(tuple(shape), interop.as_dtype(dtype)))


def standin_workspace(nbytes, offset=0):
    """A workspace array described as cuda:0 (``offset`` bytes into a 256-aligned buffer)."""
    buf = np.empty(nbytes + offset + 256, np.uint8)
    start = -buf.__array_interface__["data"][0] % 256
    return buf[start + offset:start + offset + nbytes]


@pytest.fixture
def cuda_standins(monkeypatch):
    """chunk_kda's validation sees NumPy arrays as cuda:0 arrays (an sm_90 device, 132 SMs)."""
    monkeypatch.setattr(ch, "Call", StandinCall)
    monkeypatch.setattr(ch, "device_info", lambda device=None: (132, 90))
    monkeypatch.setattr(wsmod, "wrap", cuda_standin)
    StandinCall.allocations = []
    return StandinCall


def validate_args(x):
    """Every keyword of ``validate`` (the public defaults where ``x`` has none)."""
    args = dict(q=None, k=None, v=None, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                cu_seqlens=None, A_log=None, dt_bias=None, lower_bound=-5.0, use_qk_l2norm_in_kernel=True,
                output=None, final_state=None, workspace=None)
    args.update(x)
    return args


@pytest.mark.parametrize("varlen,mutate,exc", [e[1:] for e in ERRORS if e[0] not in HOST_ONLY],
                         ids=[e[0] for e in ERRORS if e[0] not in HOST_ONLY])
def test_cuda_inputs_refused_alike(rng, cuda_standins, varlen, mutate, exc):
    """Every refusal of host inputs that is part of the contract holds for CUDA inputs, with
    the same exception type (a host workspace is on another device than CUDA q, too)."""
    x = mutate(_base(rng, varlen))
    with pytest.raises(exc):
        ch.validate(**validate_args(x))


@pytest.mark.parametrize("case", sorted(HOST_ONLY))
def test_cuda_offsets_are_not_read_on_the_host(rng, cuda_standins, case):
    x = next(e for e in ERRORS if e[0] == case)[2](_base(rng, True))
    call, p, _ = ch.validate(**validate_args(x))
    assert call.is_cuda and p.varlen


def test_cuda_validation_problem(rng, cuda_standins):
    x = kda_inputs(rng, 0, 0, 2, 4, gate_params=True, lens=[5, 0, 70], state=F32)
    call, p, ws = ch.validate(**validate_args(dict(x, output_final_state=True)))
    assert ws is None and p.device == 0 and p.varlen and not p.squeeze
    assert (p.batch, p.seqlen, p.num_heads, p.num_v_heads, p.num_seqs) == (1, 75, 2, 4, 3)
    assert p.state_dtype == F32 and p.initial_state_dtype == F32 and p.has_gate_params and not p.cu_seqlens_int64
    assert p.staged == frozenset()
    assert p.workspace_bytes == chunk_kda_workspace_bytes(1, 75, 4, num_seqs=3)
    hash(p)  # frozen, hashable: the key of select_config's cache


def _odd(a):
    """A view of ``a`` one element into a copy: same shape, contiguous, misaligned by one element."""
    flat = np.empty(a.size + 16, a.dtype)
    i = next(j for j in range(1, 16) if (flat[j:].__array_interface__["data"][0] % 16))
    v = flat[i:i + a.size].reshape(a.shape)
    v[...] = a
    return v


def test_cuda_staging_decisions(rng, cuda_standins):
    x = kda_inputs(rng, 2, 70, 1, 2, gate_params=True, state=F32)
    nc = lambda a: np.repeat(a, 2, axis=1)[:, ::2]  # noqa: E731  same values, not contiguous
    cases = [
        (dict(q=nc(x["q"])), {"q"}),
        (dict(beta=nc(x["beta"])), {"beta"}),
        (dict(A_log=x["A_log"].astype(np.float64), dt_bias=x["dt_bias"].astype(BF16)), {"A_log", "dt_bias"}),
        (dict(dt_bias=x["dt_bias"].reshape(-1)), set()),
        (dict(initial_state=_odd(x["initial_state"])), {"initial_state"}),  # f32 states: 8-byte alignment
        (dict(output=_odd(np.zeros(x["v"].shape, BF16))), {"output"}),
        (dict(k=_odd(x["k"])), {"k"}),
        (dict(initial_state=x["initial_state"].astype(BF16), output_final_state=True,
              final_state=np.zeros((2, 2, 128, 128), BF16)), set()),
    ]
    for change, staged in cases:
        _, p, _ = ch.validate(**validate_args(dict(x, **change)))
        assert p.staged == frozenset(staged), (change.keys(), p.staged)
    # fp16 q: fp16 states go through float32 copies
    y = kda_inputs(rng, 1, 10, 1, 1, dtype=F16, state=F16)
    fs = np.zeros((1, 1, 128, 128), F16)
    _, p, _ = ch.validate(**validate_args(dict(y, output_final_state=True, final_state=fs)))
    assert p.staged == {"initial_state", "final_state"} and p.state_dtype == F16


@pytest.mark.parametrize("how", ["small", "misaligned", "strided", "other-device", "not-an-array"])
def test_cuda_workspace_refusals(rng, cuda_standins, how):
    x = kda_inputs(rng, 0, 0, 1, 2, lens=[3, 100])
    need = chunk_kda_workspace_bytes(1, 103, 2, num_seqs=2)
    if how == "small":
        ws = standin_workspace(need - 1)
    elif how == "misaligned":
        ws = standin_workspace(need, offset=8)
    elif how == "strided":
        ws = standin_workspace(2 * need)[::2]
    elif how == "other-device":
        ws = wsmod.Workspace.__new__(wsmod.Workspace)
        ws.nbytes, ws.device, ws.ptr = need, 1, 4096
    else:
        ws = object()
    with pytest.raises(TypeError if how == "not-an-array" else ValueError, match="workspace"):
        ch.validate(**validate_args(dict(x, workspace=ws)))


def test_cuda_workspace_accepted(rng, cuda_standins):
    x = kda_inputs(rng, 0, 0, 1, 2, lens=[3, 100])
    need = chunk_kda_workspace_bytes(1, 103, 2, num_seqs=2)
    _, p, ws = ch.validate(**validate_args(dict(x, workspace=standin_workspace(need))))
    assert ws.nbytes == need == p.workspace_bytes and ws.ptr % 256 == 0
    obj = wsmod.Workspace.__new__(wsmod.Workspace)
    obj.nbytes, obj.device, obj.ptr = need + 1000, 0, 1 << 20
    _, _, ws = ch.validate(**validate_args(dict(x, workspace=obj)))
    assert ws is obj


@pytest.mark.parametrize("cc, refused", [(75, True), (80, False), (86, True), (89, True), (90, False), (100, False),
                                         (120, True)])
def test_cuda_device_support(rng, cuda_standins, monkeypatch, cc, refused):
    """The recurrence kernel needs 145 KB of shared memory per block at its narrowest."""
    monkeypatch.setattr(ch, "device_info", lambda device=None: (100, cc))
    x = kda_inputs(rng, 1, 5, 1, 1)
    if refused:
        with pytest.raises(NotImplementedError, match="shared memory"):
            ch.validate(**validate_args(x))
    else:
        ch.validate(**validate_args(x))


def test_head_first_looking_input_warns(rng):
    """[B, T, H, K] with fewer tokens than heads (the shape head-first input takes) warns, as
    flash-linear-attention does; varlen input and T >= H do not."""
    import warnings

    from mate_cupy import chunk_kda

    def inputs(T, H):
        q = rng.standard_normal((1, T, H, 128)).astype(np.float16)
        g = -np.abs(rng.standard_normal((1, T, H, 128))).astype(np.float16) * 0.1
        return dict(q=q, k=q.copy(), v=q.copy(), g=g, beta=rng.standard_normal((1, T, H)).astype(np.float16))

    with pytest.warns(UserWarning, match=r"head-first \[B, H, T, K\]"):
        chunk_kda(**inputs(2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chunk_kda(**inputs(4, 4))
        x = inputs(2, 4)
        chunk_kda(**{n: a[0] for n, a in x.items()}, cu_seqlens=np.array([0, 2], np.int32))
