"""Speculative verify's byte pattern without the recurrence: one state slice read, T written.

    PYTHONPATH=. python bench/sweeps/state_fanout.py OUTDIR [TAG]

Pool ``[P, HV 32, 128, 128]`` fp32 with ``[B, T]`` slots (distinct, a random permutation of the
pool): each CTA owns a contiguous slice of one head (the V-first decode kernel's shapes: 32 KB
for four warps, 16 KB for two), stages it by one bulk copy into shared memory, moves its 16-byte
chunks into registers and, for each of the T tokens, adds 1 and stores the slice to the token's
slot, as `gated_delta_rule_decode` does with ``[N, C]`` indices in place. Store paths:

* ``stcs``: streaming stores from registers (the decode kernel's path);
* ``st``: plain stores from registers;
* ``bulk``: each warp writes its rows back to the stage, one lane stores them with one bulk copy
  per token, waiting for the copy to have read the stage before the next token rewrites it;
* ``bulk2``: the same through two alternating stage buffers (one more slice of shared memory).

Beside them a device-to-device copy of the same number of bytes (read + written) and a device
memset of the written bytes. Times are medians of back-to-back launches (CUDA events); TB/s
counts ``(1 + T)`` slices per (sequence, head), the bench's accounting. Writes
``OUTDIR/state_fanout_TAG.json``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.sweeps.state_copy_paths import HEAD, HV, module_functions, timed_us  # noqa: E402

SRC = r"""
#include "common/bulk_copy.cuh"
using namespace mate;

// slots [B, T]: read slots[n, 0]'s slice, write T slices (token t to slots[n, t]).
// MODE 0: streaming stores from registers (the decode kernel's path); 1: plain stores;
// 2: each warp writes its rows back to the stage and one lane stores them with one bulk copy
// per token (waiting for the copy to have read the stage before the next token rewrites it);
// 3: the same through two alternating stage buffers.
template <int MODE>
__global__ void __launch_bounds__(128) state_fanout(float* pool, const int* slots, int HV, int splits,
                                                     int slice_elems, int T) {
    extern __shared__ __align__(128) float stage[];
    __shared__ unsigned long long bar;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int split = blockIdx.x % splits, nh = blockIdx.x / splits;
    const int hv = nh % HV, n = nh / HV;
    const long long head = 128LL * 128, off_head = (long long)hv * head + (long long)split * slice_elems;
    const float* src = pool + (long long)slots[(long long)n * T] * HV * head + off_head;
    if (tid == 0) mbarrier_init_one(&bar);
    __syncthreads();
    if (tid == 0) bulk_load(stage, src, slice_elems * 4, &bar);
    mbarrier_wait(&bar, 0);
    const int rows = slice_elems / 128, wrows = rows / (blockDim.x >> 5);
    const int off = (warp * wrows + (lane >> 3)) * 128 + (lane & 7) * 4;
    float4 x[4][4];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int j = 0; j < 4; ++j) x[r][j] = *reinterpret_cast<const float4*>(stage + off + r * 4 * 128 + j * 32);
    for (int t = 0; t < T; ++t) {
        float* dst = pool + (long long)slots[(long long)n * T + t] * HV * head + off_head;
        float* buf = stage + (MODE == 3 ? (t & 1) * slice_elems : 0);
        if (MODE >= 2) {
            if (lane == 0 && t >= (MODE == 3 ? 2 : 1))
                asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(MODE == 3 ? 1 : 0) : "memory");
            __syncwarp();
        }
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                x[r][j].x += 1.f; x[r][j].y += 1.f; x[r][j].z += 1.f; x[r][j].w += 1.f;
                const int o = off + r * 4 * 128 + j * 32;
                if (MODE == 0) __stcs(reinterpret_cast<float4*>(dst + o), x[r][j]);
                else if (MODE == 1) *reinterpret_cast<float4*>(dst + o) = x[r][j];
                else *reinterpret_cast<float4*>(buf + o) = x[r][j];
            }
        if (MODE >= 2) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            __syncwarp();
            if (lane == 0) {
                const int w0 = warp * wrows * 128;
                asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + w0),
                             "r"((unsigned)__cvta_generic_to_shared(buf + w0)), "r"(wrows * 512) : "memory");
                asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            }
        }
    }
    if (MODE >= 2 && lane == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
"""
MODES = {"stcs": 0, "st": 1, "bulk": 2, "bulk2": 3}
KERNEL = "state_fanout"  # SRC's kernel template, instantiated once per mode


def main(argv) -> None:
    outdir = Path(argv[0])
    tag = argv[1] if len(argv) > 1 else "run"
    outdir.mkdir(parents=True, exist_ok=True)
    kernels = module_functions(SRC, {n: f"{KERNEL}<{m}>" for n, m in MODES.items()})
    # (B, T, warps, slice_kb, smem_kb): the decode kernel's CTAs for speculative verify
    # (B >= 33: four-warp CTAs, 4 per SM) and two-warp CTAs for comparison.
    shapes = [(64, 4, 4, 32, 50), (64, 4, 2, 16, 26), (256, 4, 4, 32, 50), (64, 1, 4, 32, 50),
              (256, 1, 4, 32, 50)]
    results = []
    for B, T, warps, slice_kb, smem_kb in shapes:
        P = B * T + 8
        pool = cp.random.standard_normal((P, HV, HEAD), dtype=cp.float32)
        slot_sets = [cp.asarray(np.random.default_rng(i).permutation(P)[:B * T].astype(np.int32)) for i in range(4)]
        slice_elems = slice_kb * 256
        splits = HEAD // slice_elems
        grid = B * HV * splits
        state = HV * HEAD * 4
        nbytes = (1 + T) * B * state
        half = nbytes // 2
        src, dst = cp.empty(half, dtype=cp.uint8), cp.empty(half, dtype=cp.uint8)
        wr = cp.empty(T * B * state, dtype=cp.uint8)
        reps = max(5, int(2e5 // (B * T * 16)))
        row = dict(B=B, T=T, warps=warps, slice_kb=slice_kb, smem_kb=smem_kb, bytes=nbytes,
                   copy_us=timed_us(lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, half, 3, 0), reps),
                   memset_us=timed_us(lambda: cp.cuda.runtime.memsetAsync(wr.data.ptr, 0, wr.nbytes, 0), reps))
        for name, kern in kernels.items():
            smem = (2 * slice_kb + smem_kb - slice_kb if name == "bulk2" else smem_kb) * 1024
            kern.max_dynamic_shared_size_bytes = smem
            it = [0]

            def call():
                it[0] = (it[0] + 1) % 4
                kern((grid,), (warps * 32,), (pool, slot_sets[it[0]], np.int32(HV), np.int32(splits),
                                              np.int32(slice_elems), np.int32(T)), shared_mem=smem)

            row[name + "_us"] = timed_us(call, reps)
        results.append(row)
        print(f"B{B:<4d} T{T} w{warps} {slice_kb}KB | copy {row['copy_us']:.1f} us ({nbytes / row['copy_us'] / 1e6:.2f} TB/s)"
              f" | memset of the written bytes {row['memset_us']:.1f} us ({T * B * state / row['memset_us'] / 1e6:.2f})"
              + "".join(f" | {n} {row[n + '_us']:.1f} us ({nbytes / row[n + '_us'] / 1e6:.2f})" for n in MODES), flush=True)
        del pool, src, dst, wr
    (outdir / f"state_fanout_{tag}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
