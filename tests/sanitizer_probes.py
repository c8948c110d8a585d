"""Minimal race-free kernels with the synchronisation patterns of the attention kernels, to read
what compute-sanitizer reports on them (needs a CUDA GPU of compute capability 9.0):

    compute-sanitizer --tool synccheck python tests/sanitizer_probes.py cp-async-inc
    compute-sanitizer --tool synccheck python tests/sanitizer_probes.py cp-async-noinc
    compute-sanitizer --tool racecheck python tests/sanitizer_probes.py named-barriers

Probes (all by default, or the names given):

* ``cp-async-inc``: a warp's 16-byte cp.async rows completed on an mbarrier of count 1 by
  ``cp.async.mbarrier.arrive`` (the incrementing form: each lane raises the pending count and
  its copies arrive) and lane 0's own arrival; legal PTX, reported by synccheck as a barrier
  overflow.
* ``cp-async-noinc``: the same rows on a barrier of count 32, one
  ``cp.async.mbarrier.arrive.noinc`` per lane (the form the kernels use); synccheck reports
  nothing.
* ``named-barriers``: thread 0 publishes a value in shared memory between two ``__syncthreads``
  and every thread reads it, while one warpgroup alone runs named barriers between rounds (the
  work-item hand-off of ``msa_gather_attn_kernel``); racecheck reports a read-after-write
  hazard on the value although the two CTA barriers order every write before the reads.

Each probe checks its result, so a run that completes also ran the kernel it names.
"""
from __future__ import annotations

import sys

SOURCE = r"""
template <bool kInc>
__device__ void copy_rounds(const int4* src, int4* dst, int rounds) {
    __shared__ __align__(16) int4 buf[32];
    __shared__ __align__(8) unsigned long long bar;
    const unsigned b = (unsigned)__cvta_generic_to_shared(&bar);
    const unsigned d = (unsigned)__cvta_generic_to_shared(&buf[threadIdx.x]);
    if (threadIdx.x == 0) asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(b), "r"(kInc ? 1 : 32));
    __syncthreads();
    int4 acc = make_int4(0, 0, 0, 0);
    for (int r = 0; r < rounds; ++r) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src + 32 * r + threadIdx.x) : "memory");
        if (kInc) {
            asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(b) : "memory");
            __syncwarp();
            if (threadIdx.x == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(b) : "memory");
        } else {
            asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(b) : "memory");
        }
        asm volatile("{\n.reg .pred p;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                     "@!p bra WAIT_%=;\n}\n" ::"r"(b), "r"(r & 1) : "memory");
        const int4 x = buf[(threadIdx.x + 1) & 31];  // another lane's row
        acc.x += x.x;
        acc.y += x.y;
        acc.z += x.z;
        acc.w += x.w;
        __syncwarp();  // the rows are read before the next round's copies
    }
    dst[threadIdx.x] = acc;
}
extern "C" __global__ void probe_cp_async_inc(const int4* s, int4* d, int rounds) { copy_rounds<true>(s, d, rounds); }
extern "C" __global__ void probe_cp_async_noinc(const int4* s, int4* d, int rounds) { copy_rounds<false>(s, d, rounds); }

// 256 threads: rounds of (barrier, thread 0 writes v, barrier, all read v); warpgroup 0 then
// runs 1 to 3 named barriers of its own 128 threads.
extern "C" __global__ void probe_named_barriers(int* out, int rounds) {
    __shared__ int v;
    const int wg = threadIdx.x >> 7;
    int acc = 0;
    for (int i = 0;; ++i) {
        __syncthreads();
        if (threadIdx.x == 0) v = i < rounds ? i : -1;
        __syncthreads();
        const int x = v;
        if (x < 0) break;
        acc += x;
        if (wg == 0)
            for (int j = 0; j <= x % 3; ++j) asm volatile("bar.sync 1, 128;\n" ::: "memory");
    }
    out[threadIdx.x] = acc;
}
"""


def _module():
    import cupy as cp

    return cp.RawModule(code=SOURCE, options=("-arch=sm_90a", "-std=c++17"))


def _cp_async(inc: bool) -> None:
    import cupy as cp

    rounds = 8
    src = cp.arange(32 * rounds * 4, dtype=cp.int32)
    ref = cp.roll(src.reshape(rounds, 32, 4), -1, axis=1).sum(0)
    dst = cp.full((32, 4), -1, cp.int32)
    name = "probe_cp_async_inc" if inc else "probe_cp_async_noinc"
    _module().get_function(name)((1,), (32,), (src, dst, cp.int32(rounds)))
    cp.cuda.runtime.deviceSynchronize()
    assert bool((dst == ref).all()), name


def _named_barriers() -> None:
    import cupy as cp

    rounds = 7
    out = cp.full(256, -1, cp.int32)
    _module().get_function("probe_named_barriers")((4,), (256,), (out, cp.int32(rounds)))
    cp.cuda.runtime.deviceSynchronize()
    assert bool((out == rounds * (rounds - 1) // 2).all()), "probe_named_barriers"


PROBES = {
    "cp-async-inc": lambda: _cp_async(True),
    "cp-async-noinc": lambda: _cp_async(False),
    "named-barriers": _named_barriers,
}


def main(argv) -> int:
    names = argv or list(PROBES)
    unknown = [n for n in names if n not in PROBES]
    if unknown:
        print(f"unknown probe(s) {unknown}; expected some of {list(PROBES)}", file=sys.stderr)
        return 2
    for n in names:
        PROBES[n]()
        print(n, "ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
