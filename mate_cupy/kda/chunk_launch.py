"""Launchers of the KDA chunked prefill kernels (``cuda_src/kda_chunk.cu``).

One ``chunk_kda`` call launches, on the caller's stream, in this order:

1. ``kda_chunk_offsets_kernel`` (varlen only, one block): the first chunk slot of every
   sequence, an int32 ``[N + 1]`` table in the workspace.
2. ``kda_chunk_prepare_kernel<T>``: one CTA per (64-token chunk slot, value head), fully
   parallel; writes one ``SLOT_BYTES`` workspace slot per (chunk, value head).
3. ``kda_chunk_recurrence_kernel<T, NW>`` (mma.sync) or, on sm_90a,
   ``kda_chunk_recurrence_wgmma_kernel<T, NW>`` (warpgroup MMA, NW = 4 or 8): one CTA per
   (sequence, value head, V slice of ``16 * NW`` state rows), sequential over the chunks,
   state in float32 registers.

One long sequence whose recurrence leaves most SMs idle (``config.pipeline_segments > 1``)
runs 2 and 3 per segment of the sequence instead: the prepare kernels on the caller's
stream, each segment's recurrence on a second, high-priority stream of this thread once its
prepare is done (an event), carrying the float32 state between segments in the workspace;
the prepare of segment ``s + 1`` runs on the SMs the recurrence of segment ``s`` leaves
free. The caller's stream waits for the last recurrence before it goes on.

Workspace layout (bytes): ``num_slots * HV`` slots of ``SLOT_BYTES``, slot
``slot * HV + hv``; then, for varlen, the int32 offsets table, or, for one dense sequence
of at least ``2 * PIPELINE_MIN_CHUNKS`` chunks, the carried state (float32
``[HV, 128, 128]``). ``T`` is the input dtype (``half_t`` or ``bf16_t``). Nothing here
checks arguments: :func:`mate_cupy.kda.chunk.validate` has, and
:func:`mate_cupy.kda.chunk.select_config` chose the launch shape.
"""
from __future__ import annotations

from functools import lru_cache

from ..jit import KernelParams, address, get_kernel, launch, register
from ..jit.registry import SM90A
from ..runtime.interop import BFLOAT16, FLOAT16, FLOAT32
from ..runtime.streams import side_stream

CHUNK = 64  # tokens per chunk
HEAD_DIM = 128  # K = V
SLOT_BYTES = 66048  # Qs, Kt, Kb [64, 128] + T, Aqk [64, 64] in the input dtype, egl [128] float32
PREPARE_THREADS = 256
PREPARE_SMEM = 2 * 64 * 144 * 2 + 64 * 144 * 4 + 3 * 64 * 4 + 128 * 4 + 64  # 75,072 bytes (kPrepSmemBytes)
OFFSETS_THREADS = 1024
CARRY_BYTES = HEAD_DIM * HEAD_DIM * 4  # float32 [V, K] state carried between pipelined segments, per value head
PIPELINE_MIN_CHUNKS = 64  # chunks per pipelined segment, at least
PIPELINE_MAX_SEGMENTS = 8
RECURRENCE_WARPS = (1, 2, 4, 8)  # V slice = 16 * warps rows of the state per CTA
WGMMA_STAGE_V = 66048  # wgmma recurrence stage: Qs, Kt, Kb, T, Aqk tiles and egl, then the V slice (kWgV)
WGMMA_RECURRENCE_WARPS = (4, 8)  # sm_90a: one or two warpgroups of 64 state rows

# state_in_kind / state_out_kind of the recurrence kernel
STATE_NONE, STATE_FLOAT32, STATE_BFLOAT16 = 0, 1, 2
STATE_KIND = {FLOAT32: STATE_FLOAT32, BFLOAT16: STATE_BFLOAT16}

_CTYPE = {FLOAT16: "half_t", BFLOAT16: "bf16_t"}
OFFSETS_KERNEL = "kda_chunk_offsets_kernel"
PREPARE_KERNEL = {dt: f"kda_chunk_prepare_kernel<{ct}>" for dt, ct in _CTYPE.items()}
RECURRENCE_KERNEL = {(dt, nw): f"kda_chunk_recurrence_kernel<{ct}, {nw}>"
                     for dt, ct in _CTYPE.items() for nw in RECURRENCE_WARPS}
WGMMA_RECURRENCE_KERNEL = {(dt, nw): f"kda_chunk_recurrence_wgmma_kernel<{ct}, {nw}>"
                           for dt, ct in _CTYPE.items() for nw in WGMMA_RECURRENCE_WARPS}

# NVRTC modules: per input dtype one with the offsets and prepare kernels, and one per
# recurrence width, so a first call compiles only the two it launches.
PREPARE_SPECS = {dt: register("kda_chunk.cu", (OFFSETS_KERNEL, PREPARE_KERNEL[dt])) for dt in _CTYPE}
RECURRENCE_SPECS = {key: register("kda_chunk.cu", (name,)) for key, name in RECURRENCE_KERNEL.items()}
WGMMA_RECURRENCE_SPECS = {key: register("kda_chunk.cu", (name,), only_arch=SM90A)
                          for key, name in WGMMA_RECURRENCE_KERNEL.items()}

OFFSETS_PARAMS = KernelParams((
    ("cu_seqlens", "ptr"), ("cu_is_64", "i32"), ("num_seqs", "i32"), ("total_rows", "i64"), ("offsets", "ptr"),
))
PREPARE_PARAMS = KernelParams((
    ("q", "ptr"), ("k", "ptr"), ("g", "ptr"), ("beta", "ptr"), ("A_log", "ptr"), ("dt_bias", "ptr"),
    ("cu_seqlens", "ptr"), ("cu_is_64", "i32"), ("chunk_offsets", "ptr"), ("ws", "ptr"), ("num_seqs", "i32"),
    ("seq_len_dense", "i64"), ("total_rows", "i64"), ("H", "i32"), ("HV", "i32"), ("scale", "f32"),
    ("lower_bound", "f32"), ("use_l2norm", "i32"), ("has_gate", "i32"),
))
RECURRENCE_PARAMS = KernelParams((
    ("v", "ptr"), ("ws", "ptr"), ("out", "ptr"), ("state_in", "ptr"), ("state_in_kind", "i32"),
    ("state_out", "ptr"), ("state_out_kind", "i32"), ("cu_seqlens", "ptr"), ("cu_is_64", "i32"),
    ("chunk_offsets", "ptr"), ("num_slots", "i32"), ("seq_len_dense", "i64"), ("total_rows", "i64"),
    ("HV", "i32"),
))


def recurrence_smem(warps: int, wgmma: bool = False) -> int:
    """Dynamic shared memory of the recurrence kernel with ``warps`` warps (two pipeline stages).

    wgmma: stages of ``[Kt; Qs]``, ``Kb``, ``T``, ``Aqk`` (swizzled, 1024-byte aligned), ``egl``
    and the V slice, rounded up to 1 KB (``rec_wg_stage_bytes``), plus 1 KB to align the base."""
    bv = 16 * warps
    if wgmma:
        stage = -(-(WGMMA_STAGE_V + 64 * (bv + 8) * 2) // 1024) * 1024
        return 2 * stage + 1024
    stage = 3 * 64 * 136 * 2 + 2 * 64 * 72 * 2 + HEAD_DIM * 4 + 64 * (bv + 8) * 2
    return 2 * stage


def num_chunk_slots(batch: int, seqlen: int, num_seqs: int, varlen: bool) -> int:
    """Workspace chunk slots: exact for dense input, an upper bound for varlen.

    Varlen: ``sum ceil(len_n / 64) <= (S + 63 N) // 64`` for any N lengths summing to S;
    no sequences, no slots (rows outside every sequence are not read).
    """
    if num_seqs == 0:
        return 0
    if varlen:
        return (seqlen + (CHUNK - 1) * num_seqs) // CHUNK
    return batch * ((seqlen + CHUNK - 1) // CHUNK)


def holds_carry(batch: int, seqlen: int, varlen: bool) -> bool:
    """Whether the workspace holds a carried state: one dense sequence long enough for two
    pipelined segments (``launch_chunk``)."""
    return not varlen and batch == 1 and -(-seqlen // CHUNK) >= 2 * PIPELINE_MIN_CHUNKS


def workspace_layout(batch: int, seqlen: int, num_v_heads: int, num_seqs: int, varlen: bool) -> tuple:
    """``(num_slots, tail_at, total_bytes)``: slot count, byte offset of the region after the
    slots (256-byte aligned: ``SLOT_BYTES`` is a multiple of 256) and bytes in all. The tail
    is the varlen chunk-offsets table, or the carried state where :func:`holds_carry`."""
    slots = num_chunk_slots(batch, seqlen, num_seqs, varlen)
    tail_at = slots * num_v_heads * SLOT_BYTES
    if varlen:
        return slots, tail_at, tail_at + 4 * (num_seqs + 1)
    return slots, tail_at, tail_at + (num_v_heads * CARRY_BYTES if holds_carry(batch, seqlen, varlen) else 0)


def segment_bounds(seqlen: int, segments: int) -> tuple:
    """Token bounds of ``segments`` pipelined segments of a ``seqlen``-token sequence: whole
    chunks each (the last may end in a partial one), as even as chunks allow."""
    chunks = -(-seqlen // CHUNK)
    bounds = [min(seqlen, (chunks * i // segments) * CHUNK) for i in range(segments)]
    return tuple(bounds) + (seqlen,)


@lru_cache(maxsize=None)
def prepare_kernel(dtype, device: int):
    """The offsets and prepare kernels of ``dtype`` on ``device``; the prepare kernel's
    shared-memory carveout is set to the maximum when it is loaded (three 75 KB CTAs per SM
    on sm_90 need it)."""
    spec = PREPARE_SPECS[dtype]
    prep = get_kernel(spec, PREPARE_KERNEL[dtype], device)
    prep.raw.preferred_shared_memory_carveout = 100
    return get_kernel(spec, OFFSETS_KERNEL, device), prep


def launch_chunk(problem, config, *, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, final_state,
                 out, workspace, state_in_kind: int, state_out_kind: int, stream: int) -> None:
    """Launch the kernels ``config`` (a :class:`mate_cupy.kda.chunk.ChunkConfig`) names for
    ``problem`` (a :class:`mate_cupy.kda.chunk.ChunkProblem`) on the stream address ``stream``.

    Arrays are device pointers (ints, ``Arg``s or None), every one contiguous and aligned as
    the kernels need: q, k ``[B, T, H, 128]``, v, g, out ``[B, T, HV, 128]`` (16-byte
    aligned inputs, 4-byte aligned out), beta ``[B, T, HV]``, A_log ``[HV]`` and dt_bias
    ``[HV * 128]`` float32 or None, cu_seqlens ``[N + 1]`` or None, states
    ``[N, HV, 128, 128]`` of ``state_*_kind`` (float32 8-byte, bfloat16 4-byte aligned) or
    None, ``workspace`` of ``problem.workspace_bytes``.
    """
    p, c = problem, config
    if not c.launches_any:
        return
    ws = address(workspace)
    if c.pipeline_segments > 1:
        _launch_pipelined(p, c, q=address(q), k=address(k), v=address(v), g=address(g), beta=address(beta),
                          A_log=A_log, dt_bias=dt_bias, initial_state=initial_state, final_state=final_state,
                          out=address(out), ws=ws, state_in_kind=state_in_kind, state_out_kind=state_out_kind,
                          stream=stream)
        return
    cu64 = int(p.cu_seqlens_int64)
    offsets = ws + c.tail_at if p.varlen else 0
    seq_len_dense = 0 if p.varlen else p.seqlen
    total_rows = p.batch * p.seqlen
    if c.launch_offsets:
        launch(prepare_kernel(p.dtype, p.device)[0], (1,), (OFFSETS_THREADS,), OFFSETS_PARAMS,
               (cu_seqlens, cu64, p.num_seqs, total_rows, offsets), stream=stream)
    if c.launch_prepare:
        _launch_prepare(p, c.prepare_grid, (q, k, g, beta, A_log, dt_bias, cu_seqlens, cu64, offsets, ws,
                                            p.num_seqs, seq_len_dense, total_rows), stream)
    if c.launch_recurrence:
        _launch_recurrence(p, c, (v, ws, out, initial_state, state_in_kind, final_state, state_out_kind, cu_seqlens,
                                  cu64, offsets, c.num_slots, seq_len_dense, total_rows), stream)


def recurrence_kernel(problem, config):
    """The recurrence kernel ``config`` names, loaded on ``problem``'s device."""
    key = (problem.dtype, config.recurrence_warps)
    if config.recurrence_wgmma:
        return get_kernel(WGMMA_RECURRENCE_SPECS[key], WGMMA_RECURRENCE_KERNEL[key], problem.device)
    return get_kernel(RECURRENCE_SPECS[key], RECURRENCE_KERNEL[key], problem.device)


def _launch_prepare(p, grid, values, stream) -> None:
    """The prepare kernel over ``grid``: ``values`` are its parameters up to ``total_rows``
    (``PREPARE_PARAMS``), the rest come from the problem."""
    launch(prepare_kernel(p.dtype, p.device)[1], grid, (PREPARE_THREADS,), PREPARE_PARAMS,
           tuple(values) + (p.num_heads, p.num_v_heads, p.scale, p.lower_bound, int(p.use_qk_l2norm),
                            int(p.has_gate_params)),
           shared_mem=PREPARE_SMEM, stream=stream)


def _launch_recurrence(p, c, values, stream) -> None:
    """The recurrence kernel ``c`` names: ``values`` are its parameters up to ``total_rows``
    (``RECURRENCE_PARAMS``), then ``HV``."""
    launch(recurrence_kernel(p, c), c.recurrence_grid, (32 * c.recurrence_warps,), RECURRENCE_PARAMS,
           tuple(values) + (p.num_v_heads,), shared_mem=c.recurrence_smem, stream=stream)


def launch_prepare_segment(p, t0: int, length: int, *, q, k, g, beta, A_log, dt_bias, ws: int, stream: int) -> None:
    """The prepare kernel over tokens ``[t0, t0 + length)`` of one dense sequence
    (``t0`` a multiple of ``CHUNK``), as a batch-1 problem of ``length`` tokens over
    pointer-offset views (int addresses; 2-byte inputs), its slots from chunk ``t0 / CHUNK``."""
    HV = p.num_v_heads
    qk_row, v_row = p.num_heads * HEAD_DIM * 2, HV * HEAD_DIM * 2
    _launch_prepare(p, (-(-length // CHUNK), HV),
                    (q + t0 * qk_row, k + t0 * qk_row, g + t0 * v_row, beta + t0 * HV * 2, A_log, dt_bias, 0, 0, 0,
                     ws + (t0 // CHUNK) * HV * SLOT_BYTES, 1, length, length), stream)


def launch_recurrence_segment(p, c, t0: int, length: int, *, v, out, ws: int, state_in, state_in_kind: int,
                              state_out, state_out_kind: int, stream: int) -> None:
    """The recurrence over tokens ``[t0, t0 + length)`` of one dense sequence, from
    ``state_in`` to ``state_out``, on the slots :func:`launch_prepare_segment` wrote."""
    v_row = p.num_v_heads * HEAD_DIM * 2
    _launch_recurrence(p, c, (v + t0 * v_row, ws + (t0 // CHUNK) * p.num_v_heads * SLOT_BYTES, out + t0 * v_row,
                              state_in, state_in_kind, state_out, state_out_kind, 0, 0, 0, -(-length // CHUNK),
                              length, length), stream)


def _launch_pipelined(p, c, *, q, k, v, g, beta, A_log, dt_bias, initial_state, final_state, out, ws,
                      state_in_kind: int, state_out_kind: int, stream: int) -> None:
    """One dense sequence (``batch == 1``) in ``c.pipeline_segments`` segments: segment ``s``'s
    prepare on ``stream``, its recurrence on this thread's side stream after that prepare
    (and after segment ``s - 1``'s recurrence: stream order), the state carried in float32
    through the workspace tail (each recurrence CTA reads its state rows before it writes
    them, so the carry is read and written in place); ``stream`` then waits for the side
    stream. Addresses are ints."""
    side = side_stream(p.device)
    carry = ws + c.tail_at
    bounds = segment_bounds(p.seqlen, c.pipeline_segments)
    last = c.pipeline_segments - 1
    for s in range(c.pipeline_segments):
        t0, length = bounds[s], bounds[s + 1] - bounds[s]
        launch_prepare_segment(p, t0, length, q=q, k=k, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, ws=ws,
                               stream=stream)
        side.wait_for(stream, s)
        launch_recurrence_segment(
            p, c, t0, length, v=v, out=out, ws=ws,
            state_in=initial_state if s == 0 else carry,
            state_in_kind=state_in_kind if s == 0 else STATE_FLOAT32,
            state_out=final_state if s == last else carry,
            state_out_kind=state_out_kind if s == last else STATE_FLOAT32,
            stream=side.ptr)
    side.join(stream)
