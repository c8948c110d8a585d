"""Write-then-read round trips through a ring that stays in L2, against the same bytes in DRAM.

    PYTHONPATH=. python bench/sweeps/l2_round_trip.py OUTDIR

The question it answers: can per-slot attention partials, written and read back soon after,
move at L2 rates instead of DRAM rates when the buffer they pass through is a ring small
enough to stay in L2? Each CTA of a one-wave grid repeats: store a slab of ``slab_kb`` KiB
with 16-byte ``st.global`` (L1 is write-through: the lines land in L2), barrier, read the slab
back with ``ld.global.cg`` (L2 only, as a merge kernel would; each thread a vector another
thread stored), barrier. The next round writes the same addresses again (``ring``: the
footprint ``grid * slab_kb`` stays fixed, so dirty lines are overwritten in L2 and need never
reach DRAM) or a fresh slab further along a 4 GiB buffer (``stream``: every byte goes to DRAM
and back). ``discard`` adds ``discard.global.L2`` after each read (the lines' data dropped
without write-back). Reports TB/s (bytes written + read per second) per variant and
footprint, beside a device-to-device copy. Writes ``OUTDIR/l2_round_trip.json``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SRC = r'''
extern "C" __global__ void __launch_bounds__(512) round_trip(uint4* __restrict__ buf, long long buf_vecs,
                                                             int slab_vecs, int rounds, int ring, int discard,
                                                             unsigned* sink) {
    const int grid = gridDim.x;
    unsigned acc = 0;
    for (int r = 0; r < rounds; ++r) {
        // (slabs start on 128-byte lines: discard.global.L2 takes 128-byte aligned addresses)
        const long long span = (buf_vecs - (long long)grid * slab_vecs) / 8 + 1;
        const long long base = ring ? 0 : ((long long)r * grid * slab_vecs / 8) % span * 8;
        uint4* slab = buf + base + (long long)blockIdx.x * slab_vecs;
        const uint4 val = make_uint4(r, blockIdx.x, threadIdx.x, r ^ blockIdx.x);
#pragma unroll 4
        for (int i = threadIdx.x; i < slab_vecs; i += blockDim.x) slab[i] = val;
        __syncthreads();
        // read back through L2 (.cg), each thread a different vector than it stored
#pragma unroll 4
        for (int i = (threadIdx.x + 32) % blockDim.x; i < slab_vecs + 32; i += blockDim.x) {
            const int j = i % slab_vecs;
            uint4 v;
            asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(slab + j));
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        __syncthreads();
        if (discard)
            for (int i = threadIdx.x * 8; i < slab_vecs; i += blockDim.x * 8)
                asm volatile("discard.global.L2 [%0], 128;\n" ::"l"(slab + i) : "memory");
        __syncthreads();
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}
'''


def main(outdir: str) -> None:
    import cupy as cp

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    kernel = mod.get_function("round_trip")
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    l2 = dev.attributes["L2CacheSize"]
    buf_bytes = 4 << 30
    buf = cp.empty(buf_bytes // 16 * 4, dtype=cp.uint32)
    sink = cp.zeros(1, cp.uint32)
    start, stop = cp.cuda.Event(), cp.cuda.Event()

    def timed(fn, reps=5):
        fn()
        times = []
        for _ in range(reps):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1e-3)
        return sorted(times)[len(times) // 2]

    copy_src = cp.empty(1 << 30, dtype=cp.uint8)
    copy_dst = cp.empty_like(copy_src)
    copy_s = timed(lambda: copy_dst.__setitem__(Ellipsis, copy_src))
    recs = [{"variant": "d2d copy 1 GiB", "tb_s": 2 * copy_src.nbytes / copy_s / 1e12}]
    print(f"L2 {l2 / 2**20:.0f} MiB, {sms} SMs; d2d copy {recs[0]['tb_s']:.2f} TB/s", flush=True)
    total = 8 << 30  # bytes written per measurement (about the partials of one S32768 call)
    for slab_kb in (32, 64, 128, 192, 256, 384):
        slab_vecs = slab_kb * 1024 // 16
        footprint = sms * slab_kb * 1024
        rounds = max(1, total // footprint)
        for variant, ring, discard in (("ring", 1, 0), ("ring+discard", 1, 1), ("stream", 0, 0),
                                       ("stream+discard", 0, 1)):
            def call():
                kernel((sms,), (512,), (buf, cp.int64(buf.size // 4), cp.int32(slab_vecs), cp.int32(rounds),
                                        cp.int32(ring), cp.int32(discard), sink))
            secs = timed(call)
            rec = {"variant": variant, "slab_kb": slab_kb, "footprint_mib": footprint / 2**20, "rounds": rounds,
                   "ms": secs * 1e3, "tb_s": 2 * rounds * footprint / secs / 1e12}
            recs.append(rec)
            print(f"{variant:15s} slab {slab_kb:4d} KiB footprint {rec['footprint_mib']:6.1f} MiB: "
                  f"{rec['tb_s']:.2f} TB/s ({rec['ms']:.2f} ms)", flush=True)
    (out / "l2_round_trip.json").write_text(json.dumps({"l2_bytes": l2, "sms": sms, "records": recs}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
