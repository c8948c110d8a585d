"""``chunk_kda``: one validation, then the float64 reference (host) or the chunk kernels (CUDA).

The public function is :func:`mate_cupy.kda_interface.chunk_kda`. Its path::

    validate(...)                      -> (Call, ChunkProblem, workspace or None); raises
    host:  run_reference(call, problem)
    CUDA:  select_config(problem, sm_count, cc) -> ChunkConfig (pure)
           run_cuda(call, problem, config, workspace)
               -> staging copies (only for arrays the problem marks), results,
                  chunk_launch.launch_chunk (grids, packed arguments, launches)
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np

from ..checks import check_given, finite_arg, int_arg
from ..reference.kda import kda_recurrent, sequence_bounds
from ..runtime.device import device_info
from ..runtime.interop import BFLOAT16, FLOAT16, FLOAT32, Call, dtype_name
from ..runtime.staging import cuda_copy_into
from ..runtime.workspace import as_workspace
from . import chunk_launch as cl
from .common import FLOAT_DTYPES, HALF_DTYPES, INDEX_DTYPES, names, with_batch

HEAD_DIM = cl.HEAD_DIM

# Kernel limits (part of the contract on both paths): grid.y is the value head, grid.x the
# chunk slot (prepare) or sequence x V slice (recurrence, up to 8 slices).
MAX_V_HEADS = 65535
MAX_GRID_X = 2 ** 31 - 1

# Largest dynamic shared memory per block by compute capability (CUDA programming guide);
# the recurrence kernel needs 145-173 KB. Capabilities not listed are not run.
MAX_SMEM_PER_BLOCK = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 103: 232448,
                      110: 232448, 120: 101376, 121: 101376}

# Relative per-chunk latency of a recurrence CTA by warp count (one CTA per SM: the stage
# buffers take 145-173 KB), fitted to H200 timings of each width at H16/H32/H64/H96 and varlen 8x1024: every warp
# does the same 232 MMAs per chunk at every width, so 1, 2 and 4 warps (one warp per SM
# sub-partition) take about the same time per chunk, narrower CTAs only adding copy
# instructions and L2 reads; 8 warps put two warps on each sub-partition (~1.6x).
WARP_COST = {1: 1.05, 2: 0.87, 4: 1.0, 8: 1.6}

# Compute capabilities whose recurrence is the warpgroup-MMA kernel
# (kda_chunk_recurrence_wgmma_kernel, built for sm_90a only); every other device runs the
# mma.sync kernel. An empty tuple sends sm_90 back to the mma.sync kernel.
WGMMA_RECURRENCE_CC = (90,)

# Relative per-chunk latency of a wgmma recurrence CTA (one per SM: 149-165 KB of stages) by
# warp count: a warpgroup issues 256 m64n8k16 units of MMA per chunk (~1,000 cycles of the
# SM's dense bf16 rate) in four commit groups, the tensor pipe idle only while U^T is
# converted and at the waits; two warpgroups (8 warps) fill those gaps but double the tensor
# work per SM, so a step costs ~1.5x one warpgroup's. On the H200 the width this picks was
# the faster of the two on each benchmark shape (docs/kda_chunk.md, "Performance").
WGMMA_WARP_COST = {4: 1.0, 8: 1.5}

# Alignment (bytes) the kernels need of the arrays they access with vector instructions.
_ALIGN = {"q": 16, "k": 16, "v": 16, "g": 16, "output": 4}
_STATE_ALIGN = {FLOAT32: 8, BFLOAT16: 4}


def chunk_kda_workspace_bytes(batch: int, seqlen: int, num_v_heads: int, num_seqs: Optional[int] = None) -> int:
    """Bytes of the CUDA workspace ``chunk_kda(..., workspace=)`` takes.

    Dense (``num_seqs=None``): q ``[batch, seqlen, H, 128]``; the size is exact. Varlen
    (``cu_seqlens`` of ``num_seqs`` sequences): ``batch=1`` and ``seqlen`` = S, the packed
    token count (q ``[S, H, 128]`` or ``[1, S, H, 128]``); the size bounds every split of S
    tokens into ``num_seqs`` sequences. The value grows with every argument, so a workspace
    sized for the largest call serves every smaller one.

    Integers or whole floats: ``ValueError`` for fractions, negative values or a varlen
    ``batch`` other than 1; ``checks.ArgumentTypeError`` (a ``TypeError`` and a
    ``ValueError``) for strings, bools and other objects.
    """
    vals = {name: int_arg(name, x, lo=0, hi=None)
            for name, x in (("batch", batch), ("seqlen", seqlen), ("num_v_heads", num_v_heads), ("num_seqs", num_seqs))
            if x is not None or name != "num_seqs"}
    varlen = num_seqs is not None
    if varlen and vals["batch"] != 1:
        raise ValueError(f"batch must be 1 with num_seqs (varlen input), got {vals['batch']}")
    return cl.workspace_layout(vals["batch"], vals["seqlen"], vals["num_v_heads"],
                               vals.get("num_seqs", vals["batch"]), varlen)[2]


@dataclass(frozen=True)
class ChunkProblem:
    """A validated ``chunk_kda`` call: shapes (batched 4-D form), dtypes, layouts, options."""

    device: int  # -1: host inputs (float64 reference)
    dtype: np.dtype  # q's dtype: k, v, g, beta and the output
    batch: int  # B (1 with cu_seqlens)
    seqlen: int  # T, or the packed token count S with cu_seqlens
    num_heads: int  # H (q/k)
    num_v_heads: int  # HV (v/g/beta/output/states)
    num_seqs: int  # N: B, or len(cu_seqlens) - 1
    varlen: bool
    squeeze: bool  # q given [S, H, 128]: an allocated output is [S, HV, 128]
    cu_seqlens_int64: bool
    has_gate_params: bool  # A_log and dt_bias given
    initial_state_dtype: Optional[np.dtype]  # None: zeros
    state_dtype: np.dtype  # final state: final_state's, else initial_state's, else q's
    output_final_state: bool
    scale: float
    lower_bound: float
    use_qk_l2norm: bool
    workspace_bytes: int  # CUDA scratch (chunk_kda_workspace_bytes)
    staged: frozenset  # CUDA: arrays passed through a contiguous, aligned float32/own-dtype copy

    @property
    def v_shape(self) -> tuple:
        return (self.batch, self.seqlen, self.num_v_heads, HEAD_DIM)

    @property
    def state_shape(self) -> tuple:
        return (self.num_seqs, self.num_v_heads, HEAD_DIM, HEAD_DIM)


def _shape4(arg, varlen: bool) -> tuple:
    """Shape of a q/k/v/g argument as ``[B, T, H, 128]`` (varlen ``[S, H, D]`` gets B = 1)."""
    name, shape = arg.name, arg.shape
    if not varlen:
        if arg.ndim != 4:
            raise ValueError(f"{name} must be a 4D array [B, T, H, {HEAD_DIM}], got shape {shape}")
        return shape
    if arg.ndim == 3:
        return (1,) + shape
    if arg.ndim == 4:
        if shape[0] != 1:
            raise ValueError(
                f"{name}.shape[0] must be 1 when cu_seqlens is given (flatten variable-length "
                f"input as [S, H, {HEAD_DIM}] or [1, S, H, {HEAD_DIM}]), got shape {shape}"
            )
        return shape
    raise ValueError(
        f"{name} must be [S, H, {HEAD_DIM}] or [1, S, H, {HEAD_DIM}] when cu_seqlens is given, got shape {shape}"
    )


def _check_state_dtype(arg, q_dtype) -> None:
    if arg.dtype not in (q_dtype, FLOAT32):
        raise TypeError(
            f"{arg.name} must have dtype {dtype_name(q_dtype)} (q's dtype) or float32, got {dtype_name(arg.dtype)}"
        )


def recurrence_widths(cc: int) -> tuple:
    """Recurrence warp counts whose shared memory fits a block on compute capability ``cc``."""
    limit = MAX_SMEM_PER_BLOCK.get(int(cc), 0)
    return tuple(nw for nw in cl.RECURRENCE_WARPS if cl.recurrence_smem(nw) <= limit)


def _staged(call: Call) -> frozenset:
    """Arrays a CUDA call copies first: not contiguous, not aligned for the kernels' vector
    accesses, or in a dtype the kernels do not read (fp16 states, non-float32 gate parameters)."""
    out = set()
    for name, arg in call.args.items():
        if arg.size == 0:
            continue  # nothing is read or written
        if name in ("A_log", "dt_bias") and arg.dtype != FLOAT32:
            out.add(name)
        elif name in ("initial_state", "final_state") and arg.dtype == FLOAT16:
            out.add(name)
        else:
            align = _STATE_ALIGN[arg.dtype] if name in ("initial_state", "final_state") else _ALIGN.get(name, 1)
            if not arg.is_contiguous() or arg.ptr % align:
                out.add(name)
    return frozenset(out)


def validate(*, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, A_log, dt_bias,
             lower_bound, use_qk_l2norm_in_kernel, output, final_state, workspace):
    """Check every ``chunk_kda`` argument, host and CUDA alike; raises before any launch.

    Returns ``(call, problem, workspace)``: the wrapped arrays, the :class:`ChunkProblem`
    and the checked workspace (``.ptr``, ``.nbytes``) or None.
    """
    output_final_state = bool(output_final_state)
    check_given("chunk_kda", q=q, k=k, v=v, g=g, beta=beta)
    call = Call(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                A_log=A_log, dt_bias=dt_bias, output=output,
                final_state=final_state if output_final_state else None)
    varlen = cu_seqlens is not None
    qa, ka, va, ga, ba = (call[n] for n in ("q", "k", "v", "g", "beta"))
    qs, ks, vs, gs = (_shape4(a, varlen) for a in (qa, ka, va, ga))
    bs = (1,) + ba.shape if (varlen and ba.ndim == 2) else ba.shape

    for a, s in ((qa, qs), (ka, ks), (va, vs), (ga, gs)):
        if s[-1] != HEAD_DIM:
            raise ValueError(f"chunk_kda requires head dim {HEAD_DIM}: {a.name} has shape {a.shape}")
    if ks != qs:
        raise ValueError(f"k must have the same shape as q {qs}, got {ks}")
    if qs[:2] != vs[:2] or qs[:2] != gs[:2]:
        raise ValueError(f"q, v and g must have matching [B, T] dimensions, got q {qs}, v {vs}, g {gs}")
    if gs != vs:
        raise ValueError(f"g must have the same shape as v {vs}, got {gs}")
    B, T, H, K = qs
    HV = vs[2]
    if H == 0:
        raise ValueError(f"q must have at least one head, got shape {qa.shape}")
    if HV % H != 0:
        raise ValueError(f"the v/g head count must be a multiple of the q/k head count, got HV={HV}, H={H}")
    if tuple(bs) != vs[:3]:
        raise ValueError(f"beta must have shape [B, T, HV] = {vs[:3]}, got {ba.shape}")
    if not varlen and 0 < T < H:
        warnings.warn(
            f"chunk_kda: q has shape {tuple(qa.shape)}, read as [B, T, H, K] with T={T} tokens and H={H} "
            f"heads; fewer tokens than heads often means head-first [B, H, T, K] input, which this layout "
            "reads wrongly (transpose to [B, T, H, K])", UserWarning, stacklevel=4)
    if qa.dtype not in HALF_DTYPES:
        raise TypeError(f"chunk_kda supports q of dtype {names(HALF_DTYPES)}, got {dtype_name(qa.dtype)}")
    for a in (ka, va, ga, ba):
        if a.dtype != qa.dtype:
            raise TypeError(f"{a.name} must have q's dtype {dtype_name(qa.dtype)}, got {dtype_name(a.dtype)}")
    if (A_log is None) != (dt_bias is None):
        raise ValueError("A_log and dt_bias must be provided together (both or neither)")
    if A_log is not None:
        la, da = call["A_log"], call["dt_bias"]
        if la.shape != (HV,):
            raise ValueError(f"A_log must have shape [HV] = ({HV},), got {la.shape}")
        if da.shape not in ((HV, K), (HV * K,)):
            raise ValueError(f"dt_bias must have shape [HV, {K}] = {(HV, K)} or [HV*{K}] = ({HV * K},), got {da.shape}")
        for a in (la, da):
            if a.dtype not in FLOAT_DTYPES:
                raise TypeError(f"{a.name} must be a floating array (float32 preferred), got {dtype_name(a.dtype)}")
    ia = call["initial_state"]
    if ia is not None:
        _check_state_dtype(ia, qa.dtype)
    ca = call["cu_seqlens"]
    if ca is not None:
        if ca.dtype not in INDEX_DTYPES:
            raise TypeError(f"cu_seqlens must have dtype {names(INDEX_DTYPES)}, got {dtype_name(ca.dtype)}")
        if ca.ndim != 1 or ca.shape[0] < 1:
            raise ValueError(f"cu_seqlens must be a 1D array [N+1], got shape {ca.shape}")
    N = ca.shape[0] - 1 if varlen else B
    state_shape = (N, HV, HEAD_DIM, HEAD_DIM)
    if ia is not None and ia.shape != state_shape:
        raise ValueError(f"initial_state must have shape [N, HV, V, K] = {state_shape}, got {ia.shape}")

    squeeze = varlen and qa.ndim == 3
    oa = call["output"]
    if oa is not None:
        os_ = (1,) + oa.shape if (squeeze and oa.ndim == 3) else oa.shape
        if tuple(os_) != vs:
            raise ValueError(f"output must have the shape of v {va.shape}, got {oa.shape}")
        if oa.dtype != qa.dtype:
            raise TypeError(f"output must have q's dtype {dtype_name(qa.dtype)}, got {dtype_name(oa.dtype)}")
    fa = call["final_state"]
    if fa is not None:
        _check_state_dtype(fa, qa.dtype)
        if fa.shape != state_shape:
            raise ValueError(f"final_state must have shape [N, HV, V, K] = {state_shape}, got {fa.shape}")
        if ia is not None and ia.dtype != fa.dtype:
            raise TypeError(
                f"initial_state and final_state must have the same dtype, got "
                f"{dtype_name(ia.dtype)} and {dtype_name(fa.dtype)}"
            )

    num_slots, _, ws_bytes = cl.workspace_layout(B, T, HV, N, varlen)
    if HV > MAX_V_HEADS:
        raise NotImplementedError(f"chunk_kda runs at most {MAX_V_HEADS} value heads, got HV={HV}")
    if num_slots > MAX_GRID_X or N * (HEAD_DIM // 16) > MAX_GRID_X:
        raise NotImplementedError(
            f"chunk_kda runs at most {MAX_GRID_X} chunk slots of 64 tokens and {MAX_GRID_X // 8} sequences, "
            f"got {num_slots} slots and N={N}"
        )

    if call.is_cuda:
        _, cc = device_info(call.device)
        if not recurrence_widths(cc):
            raise NotImplementedError(
                f"chunk_kda's recurrence kernel needs {cl.recurrence_smem(1)} bytes of shared memory per block "
                f"(compute capability 8.0, 8.7, 9.0, 10.x or 11.0); cuda:{call.device} has compute "
                f"capability {cc // 10}.{cc % 10}"
            )
        ws = None if workspace is None else as_workspace(workspace, ws_bytes, call.device)
    else:
        if varlen:
            sequence_bounds(ca.data, T)  # ValueError on bad offsets (CUDA offsets are not read on the host)
        if workspace is not None:
            raise ValueError(f"workspace is CUDA scratch: host (cpu) inputs take none, got {type(workspace).__name__}")
        ws = None

    state_dtype = fa.dtype if fa is not None else ia.dtype if ia is not None else qa.dtype
    problem = ChunkProblem(
        device=call.device, dtype=qa.dtype, batch=B, seqlen=T, num_heads=H, num_v_heads=HV, num_seqs=N,
        varlen=varlen, squeeze=squeeze, cu_seqlens_int64=ca is not None and ca.dtype.itemsize == 8,
        has_gate_params=A_log is not None, initial_state_dtype=None if ia is None else ia.dtype,
        state_dtype=state_dtype, output_final_state=output_final_state,
        scale=HEAD_DIM ** -0.5 if scale is None else finite_arg("scale", scale),
        lower_bound=finite_arg("lower_bound", lower_bound),
        use_qk_l2norm=bool(use_qk_l2norm_in_kernel), workspace_bytes=ws_bytes,
        staged=_staged(call) if call.is_cuda else frozenset(),
    )
    return call, problem, ws


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ChunkConfig:
    """Launch shape of one CUDA ``chunk_kda`` call."""

    recurrence_warps: int  # NW: one recurrence CTA per V slice of 16 NW state rows
    recurrence_wgmma: bool  # the sm_90a warpgroup-MMA recurrence kernel (else mma.sync)
    num_slots: int  # workspace chunk slots (exact dense, upper bound varlen)
    tail_at: int  # byte offset of the workspace tail: varlen chunk-offsets table or carried state
    pipeline_segments: int  # > 1: one sequence, prepare and recurrence overlapped per segment
    launch_offsets: bool
    launch_prepare: bool
    launch_recurrence: bool
    prepare_grid: tuple  # (num_slots, HV)
    recurrence_grid: tuple  # (N * 128 / (16 NW), HV)
    recurrence_smem: int

    @property
    def launches_any(self) -> bool:
        return self.launch_offsets or self.launch_prepare or self.launch_recurrence


def recurrence_warps(num_units: int, sm_count: int, widths=cl.RECURRENCE_WARPS, warp_cost=None) -> int:
    """Warps per recurrence CTA for ``num_units`` = sequences x value heads: the width in
    ``widths`` minimising waves x relative chunk latency (``warp_cost``, default
    :data:`WARP_COST`); ties go to the wider."""
    warp_cost = WARP_COST if warp_cost is None else warp_cost
    best, best_cost = None, None
    for nw in sorted(widths, reverse=True):
        ctas = num_units * (8 // nw)
        cost = -(-ctas // max(1, sm_count)) * warp_cost[nw]
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = nw, cost
    return best


def pipeline_segments(problem: ChunkProblem, recurrence_ctas: int, sm_count: int) -> int:
    """Segments of the prepare/recurrence overlap for ``problem``: 1 (none) unless it is one
    dense sequence of at least two segments of ``PIPELINE_MIN_CHUNKS`` chunks whose
    ``recurrence_ctas`` leave at least half of the ``sm_count`` SMs to the prepare kernel;
    then as many segments of at least that many chunks as fit, at most ``PIPELINE_MAX_SEGMENTS``."""
    p = problem
    if not cl.holds_carry(p.batch, p.seqlen, p.varlen) or 2 * recurrence_ctas > sm_count:
        return 1
    return min(cl.PIPELINE_MAX_SEGMENTS, -(-p.seqlen // cl.CHUNK) // cl.PIPELINE_MIN_CHUNKS)


def chunk_config(problem: ChunkProblem, warps: int, wgmma: bool = False, segments: int = 1) -> ChunkConfig:
    """The launch shape of ``problem`` with ``warps`` warps per recurrence CTA, of the wgmma
    kernel (``warps`` in ``WGMMA_RECURRENCE_WARPS``; sm_90a devices only) or the mma.sync one,
    overlapping prepare and recurrence over ``segments`` segments (> 1 only where the
    workspace holds a carried state, :func:`mate_cupy.kda.chunk_launch.holds_carry`)."""
    if warps not in (cl.WGMMA_RECURRENCE_WARPS if wgmma else cl.RECURRENCE_WARPS):
        raise ValueError(f"no {'wgmma' if wgmma else 'mma.sync'} recurrence kernel of {warps} warps")
    p = problem
    if segments != 1 and not (cl.holds_carry(p.batch, p.seqlen, p.varlen)
                              and 2 <= segments <= min(cl.PIPELINE_MAX_SEGMENTS, -(-p.seqlen // cl.CHUNK))):
        raise ValueError(f"{segments} pipelined segments need one dense sequence of at least "
                         f"{2 * cl.PIPELINE_MIN_CHUNKS} chunks and 2 to {cl.PIPELINE_MAX_SEGMENTS} segments "
                         f"of one chunk or more, got batch {p.batch}, seqlen {p.seqlen}, varlen {p.varlen}")
    slots, tail_at, _ = cl.workspace_layout(p.batch, p.seqlen, p.num_v_heads, p.num_seqs, p.varlen)
    heads = p.num_v_heads > 0
    return ChunkConfig(
        recurrence_warps=warps, recurrence_wgmma=wgmma, num_slots=slots, tail_at=tail_at,
        pipeline_segments=segments if heads else 1,
        launch_offsets=p.varlen and p.num_seqs > 0 and heads,
        launch_prepare=slots > 0 and heads,
        launch_recurrence=p.num_seqs > 0 and heads and (p.seqlen > 0 or p.output_final_state),
        prepare_grid=(slots, p.num_v_heads),
        recurrence_grid=(p.num_seqs * (HEAD_DIM // (16 * warps)), p.num_v_heads),
        recurrence_smem=cl.recurrence_smem(warps, wgmma),
    )


@lru_cache(maxsize=256)
def select_config(problem: ChunkProblem, sm_count: int, cc: int) -> ChunkConfig:
    """Pure: the launch shape for ``problem`` on a device of ``sm_count`` SMs and compute
    capability ``cc``: the wgmma recurrence on :data:`WGMMA_RECURRENCE_CC`, else the mma.sync
    one, each at the width (among those whose shared memory fits) of least modelled time;
    prepare and recurrence overlapped in segments where :func:`pipeline_segments` says so."""
    units = problem.num_seqs * problem.num_v_heads
    wgmma = int(cc) in WGMMA_RECURRENCE_CC
    if wgmma:
        warps = recurrence_warps(units, sm_count, cl.WGMMA_RECURRENCE_WARPS, WGMMA_WARP_COST)
    else:
        warps = recurrence_warps(units, sm_count, recurrence_widths(cc))
    config = chunk_config(problem, warps, wgmma=wgmma)
    segments = pipeline_segments(problem, config.recurrence_grid[0] * config.recurrence_grid[1], sm_count)
    return config if segments == 1 else chunk_config(problem, warps, wgmma=wgmma, segments=segments)


# ----------------------------------------------------------------------------- the two paths


def chunk_kda(*, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, A_log, dt_bias,
              lower_bound, use_qk_l2norm_in_kernel, output, final_state, workspace):
    """:func:`mate_cupy.kda_interface.chunk_kda` (every argument given)."""
    call, problem, ws = validate(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, output=output,
        final_state=final_state, workspace=workspace)
    if problem.device < 0:
        out_new, fs_new = run_reference(call, problem)
    else:
        sm_count, cc = device_info(problem.device)
        out_new, fs_new = run_cuda(call, problem, select_config(problem, sm_count, cc), ws)
    out = output if output is not None else out_new
    if not problem.output_final_state:
        return out
    return out, (final_state if final_state is not None else fs_new)


def run_reference(call: Call, p: ChunkProblem):
    """Host path: the float64 recurrence, rounded once into the output dtypes. Writes the
    caller's ``output``/``final_state`` in place; returns the arrays it allocated
    ``(output or None, final_state or None)`` in the caller's framework."""
    d = call.data

    def batched(name, packed_ndim):
        x = d(name)
        return with_batch(x, p.varlen and x.ndim == packed_ndim)

    o, fs_ref = kda_recurrent(
        *(batched(n, 3) for n in ("q", "k", "v", "g")), batched("beta", 2),
        scale=p.scale, initial_state=d("initial_state"), cu_seqlens=d("cu_seqlens"),
        A_log=d("A_log"), dt_bias=d("dt_bias"), lower_bound=p.lower_bound, use_qk_l2norm=p.use_qk_l2norm,
    )
    out_new = fs_new = None
    out = d("output")
    if out is not None:
        out[...] = o.reshape(out.shape).astype(p.dtype)
    else:
        y = o.astype(p.dtype)
        out_new = call.export(y[0] if p.squeeze else y)
    if p.output_final_state:
        fs = d("final_state")
        if fs is not None:
            fs[...] = fs_ref.astype(p.state_dtype)
        else:
            fs_new = call.export(fs_ref.astype(p.state_dtype))
    return out_new, fs_new


def _copy_into(dst, src) -> None:
    """``dst[...] = src`` on CuPy arrays of one shape: bit-exact for one dtype, else converted
    (float16/float64 -> float32 exact or rounded to nearest even; float32 -> float16 rounded
    to nearest even)."""
    if dst.dtype == src.dtype:
        cuda_copy_into(dst, src)
    elif src.dtype == BFLOAT16:  # -> float32, exact: the bf16 bits are the float32's high half
        bits = dst.view(np.uint32)
        bits[...] = src.view(np.uint16)
        bits <<= 16
    else:
        dst[...] = src


def _staged_input(call: Call, p: ChunkProblem, name: str, dtype=None):
    """The Arg the kernels read for ``name``: the caller's, or (when the problem stages it)
    a contiguous copy in ``dtype`` (default the caller's) from the caller's framework."""
    arg = call[name]
    if arg is None or name not in p.staged:
        return arg
    tmp = call.new(name, arg.shape, arg.dtype if dtype is None else dtype)
    _copy_into(tmp.data, arg.data)
    return tmp


def run_cuda(call: Call, p: ChunkProblem, config: ChunkConfig, workspace):
    """CUDA path: stage what ``p.staged`` names, allocate missing results and (without
    ``workspace``) the scratch through the caller's framework, launch on the caller's stream,
    copy staged results back. Returns the arrays it allocated ``(output or None,
    final_state or None)`` in the caller's framework. With contiguous aligned inputs, float32
    gate parameters, float32/bfloat16 states, ``output``, ``final_state`` (when returned) and
    ``workspace`` given, it allocates nothing; it never synchronises."""
    staged = p.staged
    with call.device_scope():
        with call.stream if staged else contextlib.nullcontext():  # CuPy copies on the caller's stream
            q, k, v, g, beta, cu = (_staged_input(call, p, n) for n in ("q", "k", "v", "g", "beta", "cu_seqlens"))
            A_log = _staged_input(call, p, "A_log", FLOAT32)
            dt_bias = _staged_input(call, p, "dt_bias", FLOAT32)
            init = _staged_input(call, p, "initial_state", FLOAT32 if p.initial_state_dtype == FLOAT16 else None)

        out_new = None
        out = call["output"]
        if out is None:
            out_new = call.new("output", (p.seqlen, p.num_v_heads, HEAD_DIM) if p.squeeze else p.v_shape, p.dtype)
            out = out_new
        elif "output" in staged:
            out = call.new("output_staged", out.shape, p.dtype)

        fs_new = fs = None
        if p.output_final_state:
            fs = call["final_state"]
            if fs is None:
                fs_new = fs = call.new("final_state", p.state_shape, p.state_dtype)
            if p.state_dtype == FLOAT16:
                fs = call.new("final_state_f32", p.state_shape, FLOAT32)
            elif "final_state" in staged:
                fs = call.new("final_state_staged", p.state_shape, p.state_dtype)

        if workspace is None and config.launches_any:
            workspace = call.new("workspace", (p.workspace_bytes,), np.uint8)
        cl.launch_chunk(
            p, config, q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu,
            initial_state=init, final_state=fs, out=out, workspace=workspace,
            state_in_kind=cl.STATE_NONE if init is None else cl.STATE_KIND[init.dtype],
            state_out_kind=cl.STATE_NONE if fs is None else cl.STATE_KIND[fs.dtype],
            stream=call.stream_ptr,
        )

        target_fs = call["final_state"] if fs_new is None else fs_new
        copy_out = out is not call["output"] and out is not out_new
        copy_fs = fs is not None and fs is not target_fs
        if copy_out or copy_fs:
            with call.stream:
                if copy_out:
                    _copy_into(call["output"].data, out.data)
                if copy_fs:
                    _copy_into(target_fs.data, fs.data)
    return (None if out_new is None else out_new.obj), (None if fs_new is None else fs_new.obj)

