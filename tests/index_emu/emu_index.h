// The CPU emulator (tests/cuda_emu/emu_cuda.h) plus what cuda_src/msa_index.cu needs beyond it.
#pragma once
#include "emu_cuda.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>

// wgmma (sm_90a) with both operands in shared memory, K-major, 128-byte swizzle: every
// thread computes its own accumulator elements from the descriptors (no exchange needed).
// Descriptor: start >> 4 in bits [0,14), LBO >> 4 in [16,30), SBO >> 4 in [32,46),
// layout type in [62,64) (1: 128-byte swizzle). Element (r, k) of a k-step (k16 for 16-bit
// types, k32 for e4m3: 32 bytes of each row either way) sits at byte
// start + (r / 8) SBO + (r % 8) 128 + k sizeof(E), with address bits [4,7) ^= bits [7,10).
namespace mate {
// cp.async with an L2 prefetch hint: the hint has no effect on the result.
inline void cp_async_16_l2_at(u32 saddr, const void* gmem, bool pred) { cp_async_16_at(saddr, gmem, pred); }

// float8 e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; S.1111.111 is NaN, no inf).
inline float e4m3_to_float(unsigned v) {
    const int e = (v >> 3) & 15, m = v & 7;
    float x;
    if (e == 15 && m == 7) x = std::numeric_limits<float>::quiet_NaN();
    else if (e == 0) x = std::ldexp((float)m, -9);
    else x = std::ldexp(1.0f + (float)m / 8.0f, e - 7);
    return (v & 0x80u) ? -x : x;
}

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
// bar.sync id, 128: one std::barrier per id, made afresh for each block.
inline void named_sync(int id, int threads) {
    if (threads != 128) { std::fprintf(stderr, "named_sync: only warpgroup barriers are emulated\n"); std::abort(); }
    static std::mutex m;
    static const emu::Block* owner = nullptr;
    static std::unique_ptr<std::barrier<>> bars[16];
    std::barrier<>* b;
    {
        std::lock_guard<std::mutex> lock(m);
        if (owner != emu::g_block) {
            for (auto& x : bars) x.reset();
            owner = emu::g_block;
        }
        if (!bars[id]) bars[id] = std::make_unique<std::barrier<>>(128);
        b = bars[id].get();
    }
    b->arrive_and_wait();
}

namespace attn {
typedef unsigned long long u64;
// Tile of ROWS rows in 128-byte-swizzled column blocks (as common/attention_wgmma.cuh).
template <int ROWS>
struct ColumnBlockTile {
    static constexpr int kBlockBytes = ROWS * 128;
    static int offset(int row, int c) { return (c >> 3) * kBlockBytes + row * 128 + (((c & 7) ^ (row & 7)) << 4); }
};
inline u64 wg_desc(u32 saddr, u32 lbo, u32 sbo) {
    return (u64)((saddr >> 4) & 0x3FFFu) | ((u64)((lbo >> 4) & 0x3FFFu) << 16) |
           ((u64)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}
inline u64 wg_desc_add(u64 desc, u32 bytes) { return desc + (u64)(bytes >> 4); }
inline void wg_fence() {}
inline void wg_commit() {}
template <int N> inline void wg_wait() {}
inline void fence_proxy_async_smem() {}
template <int N> inline void wg_fence_regs(float*) {}

template <typename E>
inline float wg_elem(u64 desc, int r, int k) {
    if ((desc >> 62) != 1 || ((desc >> 49) & 7) != 0) { std::fprintf(stderr, "wgmma: unexpected descriptor mode\n"); std::abort(); }
    const u32 start = (u32)(desc & 0x3FFFu) << 4, sbo = (u32)((desc >> 32) & 0x3FFFu) << 4;
    u32 addr = start + (u32)(r / 8) * sbo + (u32)(r % 8) * 128u + (u32)sizeof(E) * (u32)k;
    addr ^= ((addr >> 7) & 7u) << 4;
    if (addr + sizeof(E) > emu::g_block->smem_bytes) { std::fprintf(stderr, "wgmma operand past shared memory\n"); std::abort(); }
    if constexpr (sizeof(E) == 1) {
        return e4m3_to_float(emu::dyn_smem()[addr]);
    } else {
        uint16_t bits;
        std::memcpy(&bits, emu::dyn_smem() + addr, 2);
        return h2f<E>(bits);
    }
}

template <int N, typename E>
struct WgmmaSS {
    // D[64 x N] (+)= A[64 x K] B[K x N] (K = 32 bytes / sizeof(E)); this thread's d[4 i + j] is
    // row 16 w + g + 8 (j / 2), column 8 i + 2 t + (j % 2) (w: warp in the warpgroup, g = lane / 4,
    // t = lane % 4).
    static void run(float* d, u64 da, u64 db, int scale_d) {
        constexpr int K = 32 / (int)sizeof(E);
        const int w = (threadIdx.x / 32) % 4, l = emu::my_lane(), g = l / 4, t = l % 4;
        for (int i = 0; i < N / 8; ++i)
            for (int j = 0; j < 4; ++j) {
                const int row = 16 * w + g + 8 * (j / 2), col = 8 * i + 2 * t + (j % 2);
                float s = scale_d ? d[4 * i + j] : 0.f;
                for (int k = 0; k < K; ++k) s += wg_elem<E>(da, row, k) * wg_elem<E>(db, col, k);
                d[4 * i + j] = s;
            }
    }
    static void first(float* d, u64 da, u64 db) { run(d, da, db, 0); }
};

// The same with A in registers (wgmma RS, B K-major by descriptor). The warp's 16 rows of A
// are exchanged between its lanes: lane (g, t)'s a[0] holds bytes 4 t .. 4 t + 3 of row g of
// the k-step's 32 bytes, a[1] of row g + 8, a[2] / a[3] bytes 16 + 4 t .. of rows g / g + 8
// (16-bit: two values per register, low half first; e4m3: four, low byte first).
template <int N, typename E>
struct WgmmaRSKMajor {
    static void run(float* d, const u32* a, u64 db, int scale_d) {
        constexpr int K = 32 / (int)sizeof(E), PER = 4 / (int)sizeof(E);  // values per register
        struct In { u32 a[4]; } in;
        for (int i = 0; i < 4; ++i) in.a[i] = a[i];
        emu::put(in);
        emu::wsync();
        float A[16][K];
        for (int L = 0; L < 32; ++L) {
            const In x = emu::get<In>(L);
            const int g = L / 4, t = L % 4;
            for (int e = 0; e < PER; ++e) {
                auto val = [&](u32 w) {
                    if constexpr (sizeof(E) == 1) return e4m3_to_float((w >> (8 * e)) & 0xffu);
                    else return h2f<E>(half_of(w, e));
                };
                A[g][PER * t + e] = val(x.a[0]);
                A[g + 8][PER * t + e] = val(x.a[1]);
                A[g][K / 2 + PER * t + e] = val(x.a[2]);
                A[g + 8][K / 2 + PER * t + e] = val(x.a[3]);
            }
        }
        emu::wsync();
        const int l = emu::my_lane(), g = l / 4, t = l % 4;
        for (int i = 0; i < N / 8; ++i)
            for (int j = 0; j < 4; ++j) {
                const int row = g + 8 * (j / 2), col = 8 * i + 2 * t + (j % 2);
                float s = scale_d ? d[4 * i + j] : 0.f;
                for (int k = 0; k < K; ++k) s += A[row][k] * wg_elem<E>(db, col, k);
                d[4 * i + j] = s;
            }
    }
    static void first(float* d, const u32* a, u64 db) { run(d, a, db, 0); }
};
}  // namespace attn
}  // namespace mate
