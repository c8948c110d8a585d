// wgmma (sm_90a) for the CPU emulator (tests/cuda_emu/emu_cuda.h), as common/attention_wgmma.cuh
// issues it: both operands in shared memory (WgmmaSS, K-major), or A from registers and B in
// shared memory (WgmmaRS: B MN-major; WgmmaRSKMajor: B K-major). Every shared operand uses the
// 128-byte swizzle. Each call computes its result at issue, or with emu::g_lazy_wgmma at the
// wg_wait that retires its commit group (register A operands are taken at issue, shared
// operands and the accumulators at the wait): a kernel that rewrites a shared operand or
// reads an accumulator between issue and wait then computes on the changed operand or reads
// the stale accumulator.
// Descriptor: start >> 4 in bits [0,14), LBO >> 4 in [16,30), SBO >> 4 in [32,46), layout type in
// [62,64) (1: 128-byte swizzle).
#pragma once
#include "emu_cuda.h"

#include <deque>
#include <functional>
#include <limits>
#include <vector>

namespace mate {
// float8 e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; S.1111.111 is NaN, no inf).
inline float e4m3_to_float(unsigned v) {
    const int e = (v >> 3) & 15, m = v & 7;
    float x;
    if (e == 15 && m == 7) x = std::numeric_limits<float>::quiet_NaN();
    else if (e == 0) x = std::ldexp((float)m, -9);
    else x = std::ldexp(1.0f + (float)m / 8.0f, e - 7);
    return (v & 0x80u) ? -x : x;
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
}  // namespace attn
}  // namespace mate
namespace emu {
inline bool g_lazy_wgmma = false;
inline thread_local std::vector<std::function<void()>> t_wg_open;              // issued, not committed
inline thread_local std::deque<std::vector<std::function<void()>>> t_wg_groups;  // committed, not retired
// Runs op now, or (lazy) when the wait that retires its commit group runs.
inline void wg_issue(std::function<void()> op) {
    if (g_lazy_wgmma) t_wg_open.push_back(std::move(op)); else op();
}
}  // namespace emu
namespace mate {
namespace attn {
inline void wg_commit() {
    emu::t_wg_groups.push_back(std::move(emu::t_wg_open));
    emu::t_wg_open.clear();
}
template <int N> inline void wg_wait() {
    while ((int)emu::t_wg_groups.size() > N) {
        for (auto& op : emu::t_wg_groups.front()) op();
        emu::t_wg_groups.pop_front();
    }
}
inline void fence_proxy_async_smem() {}
template <int N> inline void wg_fence_regs(float*) {}
template <int N> inline void wg_fence_regs(u32*) {}

// Element (outer, inner) of a 128-byte-swizzled descriptor operand: byte start + (outer / 8) SBO +
// (outer % 8) 128 + inner sizeof(E), address bits [4,7) ^= bits [7,10). K-major: outer = row (M
// or N), inner = k; MN-major (transposed B, 16-bit, N <= 64): outer = k, inner = n.
template <typename E>
inline float wg_smem_elem(u64 desc, int outer, int inner) {
    if ((desc >> 62) != 1 || ((desc >> 49) & 7) != 0) { std::fprintf(stderr, "wgmma: unexpected descriptor mode\n"); std::abort(); }
    const u32 start = (u32)(desc & 0x3FFFu) << 4, sbo = (u32)((desc >> 32) & 0x3FFFu) << 4;
    u32 addr = start + (u32)(outer / 8) * sbo + (u32)(outer % 8) * 128u + (u32)sizeof(E) * (u32)inner;
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
template <typename E>
inline float wg_elem(u64 desc, int r, int k) { return wg_smem_elem<E>(desc, r, k); }

template <int N, typename E>
struct WgmmaSS {
    // D[64 x N] (+)= A[64 x K] B[K x N] (K = 32 bytes / sizeof(E)); this thread's d[4 i + j] is
    // row 16 w + g + 8 (j / 2), column 8 i + 2 t + (j % 2) (w: warp in the warpgroup, g = lane / 4,
    // t = lane % 4).
    static void run(float* d, u64 da, u64 db, int scale_d) {
        emu::wg_issue([=] {
            constexpr int K = 32 / (int)sizeof(E);
            const int w = (threadIdx.x / 32) % 4, l = emu::my_lane(), g = l / 4, t = l % 4;
            for (int i = 0; i < N / 8; ++i)
                for (int j = 0; j < 4; ++j) {
                    const int row = 16 * w + g + 8 * (j / 2), col = 8 * i + 2 * t + (j % 2);
                    float s = scale_d ? d[4 * i + j] : 0.f;
                    for (int k = 0; k < K; ++k) s += wg_elem<E>(da, row, k) * wg_elem<E>(db, col, k);
                    d[4 * i + j] = s;
                }
        });
    }
    static void first(float* d, u64 da, u64 db) { run(d, da, db, 0); }
};

// Element e of a 32-bit A register: a 16-bit value (e < 2) or an e4m3 byte (e < 4).
template <typename E>
inline float a_elem(u32 r, int e) {
    if constexpr (sizeof(E) == 1) return e4m3_to_float((r >> (8 * e)) & 0xffu);
    else return h2f<E>(half_of(r, e));
}

// A[64 x K] from registers (K = 32 bytes: 16 16-bit values or 32 e4m3): warp w's lanes hold rows
// 16 w .. 16 w + 15 in the mma A layout (a[0]: row g, k R t .. R t + R - 1 with R values per
// register; a[1]: row g + 8; a[2]: k + K / 2; a[3]: both), exchanged within the warp;
// D[64 x N] (+)= A B with B from shared memory, B(k, n) at bk(k, n). The A registers are taken
// at issue; the exchange and the products run through emu::wg_issue (now, or at the wait).
template <int N, typename E, typename BElem>
inline void wg_rs(float* d, const u32* a, int scale_d, BElem bk) {
    struct Frag { u32 a[4]; } mine;
    for (int i = 0; i < 4; ++i) mine.a[i] = a[i];
    emu::wg_issue([=] {
        constexpr int K = 32 / (int)sizeof(E), R = 4 / (int)sizeof(E);
        emu::put(mine); emu::wsync();
        float A[16][K];
        for (int L = 0; L < 32; ++L) {
            const Frag f = emu::get<Frag>(L);
            const int g = L / 4, t = L % 4;
            for (int e = 0; e < R; ++e) {
                A[g][R * t + e] = a_elem<E>(f.a[0], e);
                A[g + 8][R * t + e] = a_elem<E>(f.a[1], e);
                A[g][K / 2 + R * t + e] = a_elem<E>(f.a[2], e);
                A[g + 8][K / 2 + R * t + e] = a_elem<E>(f.a[3], e);
            }
        }
        emu::wsync();
        const int l = emu::my_lane(), g = l / 4, t = l % 4;
        for (int i = 0; i < N / 8; ++i)
            for (int j = 0; j < 4; ++j) {
                const int row = g + 8 * (j / 2), col = 8 * i + 2 * t + (j % 2);
                float s = scale_d ? d[4 * i + j] : 0.f;
                for (int k = 0; k < K; ++k) s += A[row][k] * bk(k, col);
                d[4 * i + j] = s;
            }
    });
}
// B MN-major (transposed descriptor; N = 64: one swizzle atom wide).
template <int N, typename E>
struct WgmmaRS {
    static_assert(N == 64, "MN-major B of one 64-value column block");
    static void run(float* d, const u32* a, u64 db, int scale_d) {
        wg_rs<N, E>(d, a, scale_d, [=](int k, int n) { return wg_smem_elem<E>(db, k, n); });
    }
    static void first(float* d, const u32* a, u64 db) { run(d, a, db, 0); }
};
// B K-major.
template <int N, typename E>
struct WgmmaRSKMajor {
    static void run(float* d, const u32* a, u64 db, int scale_d) {
        wg_rs<N, E>(d, a, scale_d, [=](int k, int n) { return wg_smem_elem<E>(db, n, k); });
    }
    static void first(float* d, const u32* a, u64 db) { run(d, a, db, 0); }
};
}  // namespace attn
}  // namespace mate
