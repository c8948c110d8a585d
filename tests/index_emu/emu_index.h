// The CPU emulator (tests/cuda_emu/emu_cuda.h, emu_wgmma.h) plus what cuda_src/msa_index.cu needs
// beyond it.
#pragma once
#include "emu_cuda.h"
#include "emu_wgmma.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>

namespace mate {
// cp.async with an L2 prefetch hint: the hint has no effect on the result.
inline void cp_async_16_l2_at(u32 saddr, const void* gmem, bool pred) { cp_async_16_at(saddr, gmem, pred); }

// cvt.rn.f16x2.e4m3x2 twice: bytes 0, 1 of x -> lo, bytes 2, 3 -> hi (low byte in the low half).
inline void e4m3x4_to_f16x2(u32 x, u32& lo, u32& hi) {
    auto h = [](u32 byte) -> u32 {
        const __half v = __float2half_rn(e4m3_to_float(byte & 0xffu));
        uint16_t r;
        std::memcpy(&r, &v, 2);
        return r;
    };
    lo = h(x) | h(x >> 8) << 16;
    hi = h(x >> 16) | h(x >> 24) << 16;
}

// mma.sync m16n8k32 e4m3 x e4m3 -> f32: a[i] holds 4 bytes of row g (+ 8 for a[1], a[3]) at
// k = 4 t .. (+ 16 for a[2], a[3]); b[i] 4 bytes of column g at k = 4 t .. (+ 16 for b[1]).
inline void mma_16x8x32_e4m3(float* d, const u32* a, const u32* b) {
    mma_16x8<32>(d, a, b, [](const u32* xa, const u32* xb, int g, int t, float (*A)[32], float (*B)[8]) {
        for (int i = 0; i < 4; ++i) {
            auto byte = [&](u32 w) { return e4m3_to_float((w >> (8 * i)) & 0xffu); };
            A[g][4 * t + i] = byte(xa[0]);
            A[g + 8][4 * t + i] = byte(xa[1]);
            A[g][16 + 4 * t + i] = byte(xa[2]);
            A[g + 8][16 + 4 * t + i] = byte(xa[3]);
            B[4 * t + i][g] = byte(xb[0]);
            B[16 + 4 * t + i][g] = byte(xb[1]);
        }
    });
}

// The warp-specialised max-score kernel's primitives (sm_90 mbarriers, warpgroup barriers,
// setmaxnreg). An mbarrier's 8 bytes of shared memory hold its state: pending arrivals in
// bits [0, 24), the arrival count per phase in [24, 48), the phase number from bit 48.
// try_wait.parity(P) succeeds once the phase of parity P has completed (the current phase
// has the other parity); a fresh barrier reports the phase before it completed.
inline unsigned long long& mbar_word(u32 bar) {
    if (bar % 8 || bar + 8 > emu::g_block->smem_bytes) { std::fprintf(stderr, "mbarrier address\n"); std::abort(); }
    return *reinterpret_cast<unsigned long long*>(emu::dyn_smem() + bar);
}
inline void mbar_init(u32 bar, u32 count) { mbar_word(bar) = (unsigned long long)count << 24 | count; }
inline void mbar_arrive(u32 bar) {
    std::atomic_ref<unsigned long long> w(mbar_word(bar));
    unsigned long long v = w.load(), n;
    do {
        const unsigned long long pending = v & 0xFFFFFFull, count = (v >> 24) & 0xFFFFFFull, phase = v >> 48;
        if (pending == 0) { std::fprintf(stderr, "mbarrier: arrival past the count\n"); std::abort(); }
        n = pending > 1 ? v - 1 : ((phase + 1) << 48 | count << 24 | count);
    } while (!w.compare_exchange_weak(v, n));
}
inline void mbar_wait(u32 bar, u32 parity) {
    std::atomic_ref<unsigned long long> w(mbar_word(bar));
    for (int spins = 0; ((w.load() >> 48) & 1u) == parity; ++spins)
        if (spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(50)); else std::this_thread::yield();
}
// cp.async.mbarrier.arrive.noinc: this thread's copies land, then it arrives.
inline void cp_async_mbar_arrive_noinc(u32 bar) {
    for (auto& p : emu::t_open) emu::do_copy(p);
    emu::t_open.clear();
    for (auto& g : emu::t_groups) for (auto& p : g) emu::do_copy(p);
    emu::t_groups.clear();
    mbar_arrive(bar);
}
inline void cp_async_wait_all() {
    cp_async_commit();
    cp_async_wait<0>();
}
template <int N> inline void regs_release() {}
template <int N> inline void regs_claim() {}
// bar.sync id, threads: one std::barrier per id and block (of `threads` arrivals).
inline void named_sync(int id, int threads) {
    if (id < 0 || id >= 16 || threads % 32 || threads <= 0) { std::fprintf(stderr, "named_sync: barrier\n"); std::abort(); }
    emu::Block& blk = *emu::g_block;
    std::barrier<>* b;
    {
        std::lock_guard<std::mutex> lock(blk.named_m);
        if (!blk.named[id]) {
            blk.named[id] = std::make_unique<std::barrier<>>(threads);
            blk.named_count[id] = threads;
        }
        if (blk.named_count[id] != threads) { std::fprintf(stderr, "named_sync: thread count differs\n"); std::abort(); }
        b = blk.named[id].get();
    }
    b->arrive_and_wait();
}

}  // namespace mate
