"""In-place read + write of KDA decode state slices without the recurrence: which load/store
path moves a pool's bytes fastest at the V-first kernel's CTA shapes.

    PYTHONPATH=. python bench/sweeps/state_copy_paths.py OUTDIR [TAG]

Pool ``[4B, HV 32, 128, 128]`` fp32; each call reads and rewrites (``x + 1``) the heads of B
slots chosen by a random permutation, as an in-place decode step does. A CTA owns a
contiguous slice of one head (``slice_kb``: 32 KB for four warps, 16 KB for two); its dynamic
shared memory (``smem_kb``) sets the CTAs per SM. Paths:

* ``bulk>regs>stcs``: bulk copy into shared memory, every lane moves its 16-byte chunks into
  registers, adds 1, streaming stores (``st.global.cs``) from registers (the decode kernel's path);
* ``bulk>regs>st``: the same with plain stores;
* ``bulk>regs>smem>bulk``: registers written back to the stage, one bulk store per warp;
* ``bulk>regs>smem>bulk/cta``: the same, one bulk store per CTA after a CTA barrier;
* ``bulk>bulk``: bulk copy in, bulk store out (no registers, no change to the values);
* ``ldg>stcs``: 16-byte loads straight into registers, streaming stores;
* ``persistent>stcs/S``: as many CTAs as fit per SM, each rewriting every G-th slice (the
  decode kernel's path per slice), with S slices' bulk copies in flight per CTA: the next
  slice's read is issued as soon as the current one is in registers, before its stores.

``bulk>regs>stcs/out`` and ``bulk>bulk/out`` write the same slots of a second pool instead
(out of place). Beside them a device-to-device copy of the same bytes, and ``flat`` /
``flat/out``: one contiguous range of the same size read, incremented and written in place /
to another buffer by a grid-stride kernel (four 16-byte pieces in flight per thread), which
separates what writing in place costs from what the slices and slots cost. Times are medians
of back-to-back launches (CUDA events). Writes ``OUTDIR/state_copy_paths_TAG.json``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
CUDA_SRC = Path(__file__).resolve().parents[2] / "mate_cupy" / "cuda_src"

SRC = r"""
#include "common/bulk_copy.cuh"
#include "common/attention_wgmma.cuh"
using namespace mate;

// One bulk store of `bytes` from shared to global memory, waited for until it has read them.
__device__ __forceinline__ void bulk_store_read(void* gmem, const void* smem, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem), "r"(smem_u32(smem)),
                 "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

// Slice s (split fastest, then head, then sequence) of the pool: 128 x 128 floats per head.
__device__ __forceinline__ float* slice_base(float* pool, const int* slots, int HV, int splits, int slice_elems,
                                             int s) {
    const int split = s % splits, nh = s / splits, hv = nh % HV, n = nh / HV;
    return pool + ((long long)slots[n] * HV + hv) * (128LL * 128) + (long long)split * slice_elems;
}

// MODE 0: bulk > regs > st.global.cs   1: bulk > regs > st.global   2: bulk > bulk
// MODE 3: bulk > regs > smem > bulk store per warp   4: ... per CTA   5: ld.global > st.global.cs
template <int MODE>
__global__ void __launch_bounds__(128) state_rw(float* pool, float* out, const int* slots, int HV, int splits,
                                                 int slice_elems) {
    extern __shared__ __align__(128) float stage[];
    __shared__ unsigned long long bar;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float* base = slice_base(pool, slots, HV, splits, slice_elems, blockIdx.x);
    float* obase = slice_base(out, slots, HV, splits, slice_elems, blockIdx.x);  // base when in place
    const unsigned bytes = slice_elems * 4;
    if constexpr (MODE != 5) {
        if (tid == 0) mbarrier_init_one(&bar);
        __syncthreads();
        if (tid == 0) bulk_load(stage, base, bytes, &bar);
        mbarrier_wait(&bar, 0);
    }
    if constexpr (MODE == 2) {
        if (tid == 0) bulk_store_read(obase, stage, bytes);
    } else {
    // lane rows warp * 16 + (lane >> 3) + 4 r (r < 4), 16-byte pieces j * 8 + (lane & 7) (j < 4)
    const int rows = slice_elems / 128, wrows = rows / (blockDim.x >> 5);
    const int off = (warp * wrows + (lane >> 3)) * 128 + (lane & 7) * 4;
    float4 x[4][4];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int o = off + r * 4 * 128 + j * 32;
            x[r][j] = MODE == 5 ? __ldcs(reinterpret_cast<const float4*>(base + o)) : *reinterpret_cast<const float4*>(stage + o);
            x[r][j].x += 1.f; x[r][j].y += 1.f; x[r][j].z += 1.f; x[r][j].w += 1.f;
        }
    if constexpr (MODE == 0 || MODE == 1 || MODE == 5) {
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float4* d = reinterpret_cast<float4*>(obase + off + r * 4 * 128 + j * 32);
                if (MODE == 1) *d = x[r][j]; else __stcs(d, x[r][j]);
            }
    } else {
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int j = 0; j < 4; ++j) *reinterpret_cast<float4*>(stage + off + r * 4 * 128 + j * 32) = x[r][j];
    attn::fence_proxy_async_smem();
    if constexpr (MODE == 3) {
        __syncwarp();
        if (lane == 0) bulk_store_read(obase + warp * wrows * 128, stage + warp * wrows * 128, wrows * 512);
    } else {
        __syncthreads();
        if (tid == 0) bulk_store_read(obase, stage, bytes);
    }
    }
    }
}

// Every 16-byte piece of a contiguous range read, incremented and written to dst (dst == src:
// in place), four pieces in flight per thread, streaming loads and stores.
__global__ void __launch_bounds__(256) flat_rw(const float4* src, float4* dst, long long n4) {
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += 4 * step) {
        float4 x[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) if (i + u * step < n4) x[u] = __ldcs(src + i + u * step);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            x[u].x += 1.f; x[u].y += 1.f; x[u].z += 1.f; x[u].w += 1.f;
            if (i + u * step < n4) __stcs(dst + i + u * step, x[u]);
        }
    }
}

// Persistent CTAs: CTA c rewrites slices c, c + G, c + 2G, ... (G = gridDim.x). STAGES slices
// are in flight per CTA: as soon as every lane has moved stage st into registers, thread 0
// issues the bulk copy of the slice STAGES iterations ahead into it, so the next slices' reads
// overlap this slice's stores.
template <int STAGES>
__global__ void __launch_bounds__(128) state_rw_persistent(float* pool, const int* slots, int HV, int splits,
                                                            int slice_elems, int n_slices) {
    extern __shared__ __align__(128) float stage[];
    __shared__ unsigned long long bar[STAGES];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const unsigned bytes = slice_elems * 4;
    auto base_of = [&](int s) { return slice_base(pool, slots, HV, splits, slice_elems, s); };
    if (tid == 0)
        for (int st = 0; st < STAGES; ++st) mbarrier_init_one(&bar[st]);
    __syncthreads();
    if (tid == 0)
        for (int st = 0; st < STAGES; ++st) {
            const int s = blockIdx.x + st * gridDim.x;
            if (s < n_slices) bulk_load(stage + st * slice_elems, base_of(s), bytes, &bar[st]);
        }
    const int rows = slice_elems / 128, wrows = rows / (blockDim.x >> 5);
    const int off = (warp * wrows + (lane >> 3)) * 128 + (lane & 7) * 4;
    int it = 0;
    for (int s = blockIdx.x; s < n_slices; s += gridDim.x, ++it) {
        const int st = it % STAGES;
        float* base = base_of(s);
        float* sp = stage + st * slice_elems;
        mbarrier_wait(&bar[st], (it / STAGES) & 1);
        float4 x[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int j = 0; j < 4; ++j) x[r][j] = *reinterpret_cast<const float4*>(sp + off + r * 4 * 128 + j * 32);
        __syncthreads();
        if (tid == 0) {
            const int s2 = s + STAGES * gridDim.x;
            if (s2 < n_slices) bulk_load(sp, base_of(s2), bytes, &bar[st]);
        }
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float4 y = x[r][j];
                y.x += 1.f; y.y += 1.f; y.z += 1.f; y.w += 1.f;
                __stcs(reinterpret_cast<float4*>(base + off + r * 4 * 128 + j * 32), y);
            }
    }
}
"""
def module_options() -> tuple:
    """NVRTC options: the project's kernel headers (``common/bulk_copy.cuh``) and the CUDA headers."""
    from mate_cupy.jit.compiler import cuda_include_dirs

    return ("-std=c++17", f"-I{CUDA_SRC}", *(f"-I{d}" for d in cuda_include_dirs()))


MODES = {"bulk>regs>stcs": 0, "bulk>regs>st": 1, "bulk>bulk": 2, "bulk>regs>smem>bulk": 3,
         "bulk>regs>smem>bulk/cta": 4, "ldg>stcs": 5}
KERNEL = "state_rw"  # SRC's kernel template, instantiated once per mode
# Persistent CTAs (as many as fit per SM, each looping over slices): stages in flight per CTA.
PERSISTENT = {"persistent>stcs/1": 1, "persistent>stcs/2": 2}
#: Modes also run out of place: read from the pool, written to the same slots of a second pool.
OUT_OF_PLACE = ("bulk>regs>stcs", "bulk>bulk")
#: The row keys that are times, in the order printed.
TIMED = (*(n + s for n in MODES for s in ("", "/out") if not s or n in OUT_OF_PLACE), "flat", "flat/out", *PERSISTENT)
HV = 32
HEAD = 128 * 128


def module_functions(src: str, exprs: dict) -> dict:
    """``{name: function}`` for the name expressions ``exprs`` (``{name: "kernel<mode>"}``) of
    ``src``, from one NVRTC module."""
    mod = cp.RawModule(code=src, options=module_options(), name_expressions=list(exprs.values()))
    return {name: mod.get_function(e) for name, e in exprs.items()}


def timed_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(5):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / reps)
    return float(np.median(times))


def main(argv) -> None:
    outdir = Path(argv[0])
    tag = argv[1] if len(argv) > 1 else "run"
    outdir.mkdir(parents=True, exist_ok=True)
    fns = module_functions(SRC, {**{n: f"{KERNEL}<{m}>" for n, m in MODES.items()},
                                 **{n: f"state_rw_persistent<{m}>" for n, m in PERSISTENT.items()},
                                 "flat": "flat_rw"})
    kernels = {n: fns[n] for n in MODES}
    persistent = {n: fns[n] for n in PERSISTENT}
    flat = fns["flat"]
    sm_count = cp.cuda.Device().attributes["MultiProcessorCount"]
    # (B, warps, slice_kb, smem_kb): the decode kernel's shapes (B32: two-warp CTAs, 8 per SM;
    # B >= 256: four-warp CTAs, 4 per SM) and more CTAs per SM where registers allow.
    shapes = [(32, 2, 16, 26), (32, 4, 32, 50), (256, 4, 32, 50), (256, 4, 32, 36), (1024, 4, 32, 50),
              (1024, 4, 32, 36), (1024, 2, 16, 26)]
    results = []
    for B, warps, slice_kb, smem_kb in shapes:
        P = 4 * B
        pool = cp.random.standard_normal((P, HV, HEAD), dtype=cp.float32)
        pool2 = cp.zeros_like(pool)  # the out-of-place rows' destination (same slots)
        perms = [cp.asarray(np.random.default_rng(i).permutation(P)[:B].astype(np.int32)) for i in range(4)]
        slice_elems = slice_kb * 256
        splits = HEAD // slice_elems
        grid = B * HV * splits
        nbytes = 2 * B * HV * HEAD * 4
        half = nbytes // 2
        src, dst = cp.empty(half, dtype=cp.uint8), cp.empty(half, dtype=cp.uint8)
        reps = max(5, int(2e5 // (B * 16)))
        row = dict(B=B, warps=warps, slice_kb=slice_kb, smem_kb=smem_kb, bytes=nbytes,
                   copy_us=timed_us(lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, half, 3, 0), reps))
        for name, kern in kernels.items():
            kern.max_dynamic_shared_size_bytes = smem_kb * 1024
            for suffix, out in (("", pool), ("/out", pool2)):
                if suffix and name not in OUT_OF_PLACE:
                    continue
                it = [0]

                def call(kern=kern, out=out):
                    it[0] = (it[0] + 1) % 4
                    kern((grid,), (warps * 32,), (pool, out, perms[it[0]], np.int32(HV), np.int32(splits),
                                                  np.int32(slice_elems)), shared_mem=smem_kb * 1024)
                row[name + suffix] = timed_us(call, reps)
        n4 = half // 16
        flat_grid = (sm_count * 8,)
        row["flat"] = timed_us(lambda: flat(flat_grid, (256,), (pool, pool, np.int64(n4))), reps)
        row["flat/out"] = timed_us(lambda: flat(flat_grid, (256,), (src, dst, np.int64(n4))), reps)
        for name, kern in persistent.items():
            smem = (PERSISTENT[name] * slice_kb + smem_kb - slice_kb) * 1024
            kern.max_dynamic_shared_size_bytes = smem
            per_sm = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kern.kernel.ptr, warps * 32, smem)
            it = [0]

            def call(kern=kern, smem=smem, ctas=sm_count * per_sm):
                it[0] = (it[0] + 1) % 4
                kern((ctas,), (warps * 32,), (pool, perms[it[0]], np.int32(HV), np.int32(splits), np.int32(slice_elems),
                                              np.int32(grid)), shared_mem=smem)
            row[name] = timed_us(call, reps)
            row[name + " ctas/SM"] = per_sm
        results.append(row)
        print(f"B{B:<5d} w{warps} {slice_kb}KB smem {smem_kb}KB copy {row['copy_us']:.1f} us "
              f"({nbytes / row['copy_us'] / 1e6:.2f} TB/s) | "
              + " ".join(f"{n} {row[n]:.1f} ({nbytes / row[n] / 1e6:.2f})" for n in TIMED), flush=True)
        del pool, pool2, src, dst
    (outdir / f"state_copy_paths_{tag}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
