"""Launch of the KDA decode kernels (``cuda_src/kda_decode.cu``) for a validated
:class:`~mate_cupy.kda.decode.DecodeProblem`.

Four kernels, all registered here: state dtype (float32 / bfloat16) x state layout
(V-first ``[P, HV, V, K]``: ``kda_decode_vfirst_kernel``, K-first ``[P, HV, K, V]``:
``kda_decode_kfirst_kernel``). Every other choice (q/k/v/a/b/dt_bias/output dtypes, gate
and beta modes, L2 norm, slot mode, varlen, token count) is a runtime argument: it only
changes the per-token prologue, which runs once per CTA outside the state loop.

Work split (``docs/kda_decode.md``): one CTA per (sequence, value head, V-slice).
V-first slices are ``16 * warps`` (fp32) or ``32 * warps`` (bf16) rows, 256 bytes of state
per lane either way, ``warps`` in {1, 2, 4} picked by :func:`vfirst_warps` (the tokens per
sequence and the CTAs per SM), staged by one bulk copy on sm_90 when V is a whole number of
slices; K-first slices are 128 bytes of each
K row (32 fp32 or 64 bf16 columns).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..jit import KernelParams, KernelSpec, PreparedLaunch, Source, get_kernel, launch, register
from ..runtime.device import device_info
from ..runtime.interop import BFLOAT16, FLOAT16, FLOAT32, INT64, torch_stream_ptr
from ..runtime.staging import cuda_contiguous, cuda_copy_into

SOURCE = "kda_decode.cu"
_STATE_CTYPE = {FLOAT32: "float", BFLOAT16: "__nv_bfloat16"}

#: (state dtype, state_v_first) -> the registered variant.
SPECS = {
    (dt, v_first): register(SOURCE, f"kda_decode::kda_decode_{'vfirst' if v_first else 'kfirst'}_kernel<{ctype}>")
    for dt, ctype in _STATE_CTYPE.items()
    for v_first in (True, False)
}

K_DIM = 128  # the kernels' q/k head dim (one state row)
STATE_CHUNK_BYTES = 16  # the kernels move the state in 16-byte chunks (K-first: along V)
MAX_CHUNK = 8  # tokens prepared per prologue (kMaxChunk in the kernel)
#: V rows of one V-first warp per state dtype: 4 row groups of 8 lanes x the rows of a lane
#: (``VFirst::kRows``: 256 bytes of state per lane, 4 fp32 or 8 bf16 rows of 16 values).
VFIRST_ROWS_PER_WARP = {FLOAT32: 16, BFLOAT16: 32}
MIN_V_SLICE = min(VFIRST_ROWS_PER_WARP.values())  # the smallest V-slice of any configuration (bounds the grid)
#: K-first CTA shape per state dtype: (threads, V columns per CTA).
KFIRST_SHAPE = {FLOAT32: (64, 32), BFLOAT16: (128, 64)}

# Option flags and dtype codes: the enums of kda_decode.cu.
F_VARLEN, F_L2NORM, F_GATE_IN_KERNEL, F_LOWER_BOUND = 1 << 0, 1 << 1, 1 << 2, 1 << 3
F_BETA_SIGMOID, F_NEG_EIGVAL, F_INITIAL_STATE, F_INPLACE = 1 << 4, 1 << 5, 1 << 6, 1 << 7
F_BETA_PER_CHANNEL, F_IDX64, F_ACCEPTED64, F_CU64, F_HAS_ACCEPTED = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
F_BULK = 1 << 13
_DT_CODE = {FLOAT32: 0, FLOAT16: 1, BFLOAT16: 2}
_DT_SHIFT = {"q": 0, "k": 2, "v": 4, "a": 6, "b": 8, "dt_bias": 10, "out": 12}
NO_POOL = (1 << 63) - 1  # pool_size without a pool: every non-negative slot reads as in range

#: The parameter list of both kernels (``KDA_DECODE_KERNEL_ARGS`` in the source): the
#: arrays, the pool's slot count, the (batch, token, head) element strides of q, k, v, a, b,
#: sizes, slot columns, option flags, dtype codes, scale, lower bound, V-slices per head
#: and tokens per prologue.
PARAMS = KernelParams((
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("a", "ptr"), ("b", "ptr"), ("A_log", "ptr"), ("dt_bias", "ptr"),
    ("state", "ptr"), ("state_indices", "ptr"), ("num_accepted", "ptr"), ("cu_seqlens", "ptr"), ("out", "ptr"),
    ("final_state", "ptr"), ("pool_size", "i64"),
    ("q_sb", "i32"), ("q_st", "i32"), ("q_sh", "i32"), ("k_sb", "i32"), ("k_st", "i32"), ("k_sh", "i32"),
    ("v_sb", "i32"), ("v_st", "i32"), ("v_sh", "i32"), ("a_sb", "i32"), ("a_st", "i32"), ("a_sh", "i32"),
    ("b_sb", "i32"), ("b_st", "i32"), ("b_sh", "i32"),
    ("N", "i32"), ("T", "i32"), ("H", "i32"), ("HV", "i32"), ("V", "i32"), ("idx_cols", "i32"), ("flags", "i32"),
    ("dtypes", "i32"), ("scale", "f32"), ("lower_bound", "f32"), ("n_splits", "i32"), ("tc", "i32"),
))
#: Kernel name -> its parameter list (checked against the source by the CPU tests).
KERNEL_PARAMS = {"kda_decode_vfirst_kernel": PARAMS, "kda_decode_kfirst_kernel": PARAMS}


@dataclass(frozen=True)
class DecodeConfig:
    """How one decode problem is launched on one device.

    ``v_slice``: V rows (V-first) or V columns (K-first) of one head a CTA owns;
    ``n_splits`` slices per head, ``grid = N * HV * n_splits`` CTAs of ``threads``;
    ``token_chunk`` tokens prepared per prologue; ``smem`` dynamic shared memory bytes;
    ``bulk_stage``: the V-first slice is staged by one bulk copy (sm_90, whole slices);
    ``programmatic``: a programmatic dependent launch (sm_90+: the kernels wait for the
    previous grid on the device, so their CTAs are scheduled while it finishes);
    ``option_flags`` / ``dtype_codes``: the kernel's flag word and packed dtype codes.
    """

    spec: KernelSpec
    warps: int
    threads: int
    v_slice: int
    n_splits: int
    grid: int
    token_chunk: int
    smem: int
    bulk_stage: bool
    programmatic: bool
    option_flags: int
    dtype_codes: int


def smem_bytes(stage_bytes: int, token_chunk: int, v_slice: int, red_floats: int) -> int:
    """Dynamic shared memory of one CTA (the layout of ``carve_smem`` in the kernel)."""
    tc = token_chunk
    return (stage_bytes + ((tc + 1) // 2) * 16 + ((tc + 3) // 4) * 16 + 3 * tc * K_DIM * 4
            + 2 * tc * v_slice * 4 + red_floats * 4)


def vfirst_warps(n_heads: int, V: int, sm_count: int, rows_per_warp: int, tokens: float = 1.0) -> int:
    """Warps per V-first CTA over ``n_heads`` = N * HV states of V rows, ``rows_per_warp``
    rows per warp, ``tokens`` per sequence: 4 with two or more tokens or when four-warp CTAs
    still give >= 16 per SM, else 2; halved while a CTA would hold more rows than V. Two warps
    run the prologue's two tasks per token side by side, four take half the rounds of two
    with several tokens (measurements: ``docs/kda_decode.md``, "Configuration")."""
    warps = 4 if tokens >= 2 or n_heads * -(-V // (rows_per_warp * 4)) >= 16 * sm_count else 2
    while warps > 1 and rows_per_warp * warps > V:  # no wider than the state: no idle warps
        warps //= 2
    return warps


def tokens_per_sequence(problem) -> float:
    """Tokens a CTA runs: T, or with ``cu_seqlens`` the packed tokens over the sequences."""
    return problem.T / max(problem.N, 1) if problem.varlen else float(problem.T)


# Boolean problem fields and the kernel flag each one sets.
_BOOL_FLAGS = (("varlen", F_VARLEN), ("use_qk_l2norm", F_L2NORM), ("use_gate_in_kernel", F_GATE_IN_KERNEL),
               ("use_lower_bound", F_LOWER_BOUND), ("apply_beta_sigmoid", F_BETA_SIGMOID),
               ("allow_neg_eigval", F_NEG_EIGVAL), ("use_initial_state", F_INITIAL_STATE),
               ("inplace_final_state", F_INPLACE), ("beta_per_channel", F_BETA_PER_CHANNEL))


def _option_flags(p) -> int:
    f = sum(flag for field, flag in _BOOL_FLAGS if getattr(p, field))
    if p.cu_seqlens_dtype == INT64:
        f |= F_CU64
    if p.index_dtype == INT64:
        f |= F_IDX64
    if p.accepted_dtype is not None:
        f |= F_HAS_ACCEPTED | (F_ACCEPTED64 if p.accepted_dtype == INT64 else 0)
    return f


def _dtype_codes(p) -> int:
    c = _DT_CODE[p.qkv_dtype]
    codes = (c << _DT_SHIFT["q"] | c << _DT_SHIFT["k"] | c << _DT_SHIFT["v"] | _DT_CODE[p.a_dtype] << _DT_SHIFT["a"]
             | _DT_CODE[p.b_dtype] << _DT_SHIFT["b"] | _DT_CODE[p.out_dtype] << _DT_SHIFT["out"])
    if p.dt_bias_dtype is not None:
        codes |= _DT_CODE[p.dt_bias_dtype] << _DT_SHIFT["dt_bias"]
    return codes


@functools.lru_cache(maxsize=256)
def select_config(problem, sm_count: int, cc: int) -> DecodeConfig:
    """The launch of ``problem`` (a :class:`~mate_cupy.kda.decode.DecodeProblem`) on a device
    with ``sm_count`` SMs and compute capability ``cc`` (major * 10 + minor). Pure."""
    p = problem
    warps = None
    if p.state_v_first:
        warps = vfirst_warps(p.N * p.HV, p.V, sm_count, VFIRST_ROWS_PER_WARP[p.state_dtype],
                             tokens_per_sequence(p))
    return decode_config(p, cc, warps)


def decode_config(problem, cc: int, warps: int | None = None) -> DecodeConfig:
    """The launch of ``problem`` with V-first CTAs of ``warps`` warps (required for a V-first
    state; K-first CTAs have one shape per state dtype, and ``warps`` is ignored). Pure."""
    p = problem
    if p.state_v_first:
        v_slice = VFIRST_ROWS_PER_WARP[p.state_dtype] * warps
        red_floats = 0
    else:
        threads, v_slice = KFIRST_SHAPE[p.state_dtype]
        warps = threads // 32
        red_floats = 2 * warps * 2 * v_slice  # [2 parities][warps][S_dec k, S_dec q][v_slice]
    n_splits = -(-p.V // v_slice)
    token_chunk = max(1, min(p.T, MAX_CHUNK))
    bulk_stage = p.state_v_first and cc >= 90 and p.V % v_slice == 0
    return DecodeConfig(
        spec=SPECS[(p.state_dtype, p.state_v_first)], warps=warps, threads=32 * warps, v_slice=v_slice,
        n_splits=n_splits, grid=p.N * p.HV * n_splits, token_chunk=token_chunk,
        smem=smem_bytes(v_slice * K_DIM * p.state_dtype.itemsize, token_chunk, v_slice, red_floats),
        bulk_stage=bulk_stage, programmatic=cc >= 90, option_flags=_option_flags(p) | (F_BULK if bulk_stage else 0),
        dtype_codes=_dtype_codes(p),
    )


def run(call, problem):
    """Run ``problem`` on the CUDA arrays of ``call`` on the caller's stream.

    Writes the output (every element), the pool when ``inplace_final_state`` and the new
    final state when ``store_final_state``; returns ``(output, final_state or None)`` as
    the caller's objects (the pool itself when in place). Arrays named in
    ``problem.staged`` go through contiguous copies (copied back when written); otherwise
    nothing is allocated beyond the results the caller did not pass, and nothing
    synchronises.
    """
    p = problem
    cfg = select_config(p, *device_info(p.device))
    ptrs = {name: arg.ptr for name, arg in call.args.items()}
    out = call.args.get("output")
    if out is None:
        out = call.new("output", (p.B, p.T, p.HV, p.V), p.out_dtype)
        ptrs["output"] = out.ptr
    final = None
    if p.store_final_state and not p.inplace_final_state:
        final = call.new("final_state", p.final_shape, p.state_dtype)
        ptrs["final_state"] = final.ptr
    staged, write_back = _stage(call, p, ptrs) if p.staged else ((), ())
    if cfg.grid:
        with call.device_scope():
            launch(get_kernel(cfg.spec, None, p.device), (cfg.grid,), (cfg.threads,), PARAMS,
                   kernel_values(p, cfg, ptrs), shared_mem=cfg.smem, stream=call.stream_ptr,
                   programmatic=cfg.programmatic)
    if write_back:
        with call.launch_scope():
            for dst, src in write_back:
                cuda_copy_into(dst, src)
    del staged  # the copies stay allocated until the launch and the copy-back are enqueued
    if p.inplace_final_state:
        return out.obj, call["state"].obj
    return out.obj, None if final is None else final.obj


#: The arrays of a prepared call, in the order of its addresses (the kernel's pointer order).
PREPARED_ARRAYS = ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state", "state_indices", "num_accepted_tokens",
                   "cu_seqlens", "output")


class PreparedDecode:
    """The launch of a validated decode call for later calls with equal array metadata and
    options: the problem, the device and the :class:`~mate_cupy.jit.PreparedLaunch` (None
    when the grid is empty)."""

    __slots__ = ("problem", "device", "launch")

    def __init__(self, problem, device: int, launch):
        self.problem, self.device, self.launch = problem, device, launch

    def run(self, addresses: tuple) -> None:
        if self.launch is not None:
            self.launch.run(addresses, torch_stream_ptr(self.device))


def preparable(call, problem) -> bool:
    """Whether a validated CUDA call allocates nothing, so that its launch can be prepared:
    the output given, no staged copy, no new final state."""
    p = problem
    return not p.staged and "output" in call.args and not (p.store_final_state and not p.inplace_final_state)


def prepared_launch(problem, arrays):
    """The :class:`~mate_cupy.jit.PreparedLaunch` a :func:`preparable` call of ``problem``
    launches (None when the grid is empty): the configuration and :func:`kernel_values` of
    :func:`run`, with the addresses of the named ``arrays`` (the call's arrays) taken by
    position in :data:`PREPARED_ARRAYS`."""
    p = problem
    cfg = select_config(p, *device_info(p.device))
    if not cfg.grid:
        return None
    ptrs = {name: Source(i) for i, name in enumerate(PREPARED_ARRAYS) if name in arrays}
    return PreparedLaunch(get_kernel(cfg.spec, None, p.device), (cfg.grid,), (cfg.threads,), PARAMS,
                          kernel_values(p, cfg, ptrs), shared_mem=cfg.smem, n_addresses=len(PREPARED_ARRAYS),
                          programmatic=cfg.programmatic)


def prepare(call, problem):
    """The :class:`PreparedDecode` of a validated torch CUDA call that allocates nothing
    (:func:`preparable`), else None. Its launch is the one :func:`run` makes
    (:func:`prepared_launch`)."""
    if call.framework != "torch" or not preparable(call, problem):
        return None
    return PreparedDecode(problem, problem.device, prepared_launch(problem, call.args))


def kernel_values(problem, config: DecodeConfig, ptrs: dict) -> tuple:
    """The kernel arguments (:data:`PARAMS` order) of ``problem`` launched with ``config``.

    ``ptrs`` maps the call's array names (``q`` ... ``output``, and ``final_state`` when one
    is returned) to device addresses. The pool is passed when the kernel reads or writes
    it (``use_initial_state`` or ``inplace_final_state``), else a null pool of unbounded
    size (only the sign of a slot matters then).
    """
    p = problem
    pool = p.use_initial_state or p.inplace_final_state
    get = ptrs.get
    return (
        ptrs["q"], ptrs["k"], ptrs["v"], ptrs["a"], ptrs["b"], get("A_log", 0), get("dt_bias", 0),
        ptrs["state"] if pool else 0, get("state_indices", 0), get("num_accepted_tokens", 0), get("cu_seqlens", 0),
        ptrs["output"], get("final_state", 0), p.pool_size if pool else NO_POOL, *p.token_strides,
        p.N, p.T, p.H, p.HV, p.V, p.slot_columns, config.option_flags, config.dtype_codes, p.scale, p.lower_bound,
        config.n_splits, config.token_chunk,
    )


def _stage(call, p, ptrs: dict) -> tuple[list, list]:
    """Contiguous copies of the arrays named in ``p.staged`` (their addresses replace the
    caller's in ``ptrs``). Returns ``(copies, write_back)``: every copy, which the caller
    keeps alive until the launch is enqueued (a copy freed earlier would hand its memory to
    the next one), and the ``(caller array, copy)`` pairs to copy back after the launch: a
    staged output, and a staged pool written in place."""
    copies, write_back = [], []
    with call.launch_scope():
        for name in p.staged:
            arg = call[name]
            if name == "output":
                tmp = call.empty(arg.shape, arg.dtype)  # written in full by the kernel
            else:
                tmp = cuda_contiguous(arg.data)
            ptrs[name] = int(tmp.data.ptr)
            copies.append(tmp)
            if name == "output" or (name == "state" and p.inplace_final_state):
                write_back.append((arg.data, tmp))
    return copies, write_back
