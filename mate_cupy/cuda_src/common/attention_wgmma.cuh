// Warpgroup MMA (sm_90a wgmma.mma_async) building blocks of the attention kernels.
//
// Shared-memory operand layout ("column blocks", the 128-byte-swizzled
// canonical layout of wgmma): a tile of ROWS rows x D 16-bit values is stored
// as D / 64 column blocks of ROWS x 128 bytes (8-bit values: 128 per block row); 16-byte chunk c (0..7) of row r
// of a block sits at physical chunk c ^ (r & 7). Every tile starts on a
// 1024-byte boundary, so the hardware swizzle (address bits [4,7) ^= [7,10))
// matches this XOR. The same bytes serve both operand kinds:
//   K-major (Q, K as A / B of S = Q K^T): rows are M / N, 8-row groups 1024 B
//     apart (SBO); a k-step of 16 values (32 for e4m3, k32) is +32 B inside a block.
//   MN-major (V as B of O = P V, transposed): rows are the K (key) dimension,
//     8-key groups 1024 B apart (SBO), one 64-value block per instruction
//     (N = 64), a k-step of 16 keys is +2048 B.
// Accumulators and register A operands follow the per-warp mma.m16n8k16
// layouts: warp w of the warpgroup owns rows 16w..16w+15, d[4i + j] is row
// g + 8 (j / 2), column 8i + 2t + (j % 2) (g = lane / 4, t = lane % 4).
#pragma once
#include "dtype.cuh"

namespace mate {
namespace attn {

typedef unsigned long long u64;

// Tile of ROWS x (8 * CHUNKS) 16-bit values in column blocks (see above).
template <int ROWS>
struct ColumnBlockTile {
    static_assert(ROWS % 8 == 0, "rows come in 8-row swizzle atoms");
    static constexpr int kBlockBytes = ROWS * 128;
    // Byte offset of 16-byte chunk c (0 .. D/8 - 1) of row `row`.
    static __device__ __forceinline__ int offset(int row, int c) {
        return (c >> 3) * kBlockBytes + row * 128 + (((c & 7) ^ (row & 7)) << 4);
    }
};

// Shared-memory matrix descriptor, 128-byte swizzle; addresses/offsets in bytes.
__device__ __forceinline__ u64 wg_desc(u32 saddr, u32 lbo, u32 sbo) {
    return (u64)((saddr >> 4) & 0x3FFFu) | ((u64)((lbo >> 4) & 0x3FFFu) << 16) |
           ((u64)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}
// The same descriptor `bytes` further (bytes % 16 == 0; stays inside the 256 KB window).
__device__ __forceinline__ u64 wg_desc_add(u64 desc, u32 bytes) { return desc + (u64)(bytes >> 4); }

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Generic-proxy shared-memory writes (cp.async, st.shared) made visible to wgmma reads.
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keep the compiler from moving accesses of accumulator registers across a
// wgmma issue / wait (the asm "writes" them, so later reads depend on it).
template <int N>
__device__ __forceinline__ void wg_fence_regs(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

template <int N>
__device__ __forceinline__ void wg_fence_regs(u32* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Shapes/types without a specialisation below exist only so that discarded
// `if constexpr` branches of non-wgmma kernel variants compile; never executed.
template <int N, typename E> struct WgmmaSS {
    static __device__ __forceinline__ void run(float*, u64, u64, int) { __trap(); }
    static __device__ __forceinline__ void first(float*, u64, u64) { __trap(); }
};
template <int N, typename E> struct WgmmaRS {
    static __device__ __forceinline__ void run(float*, const u32*, u64, int) { __trap(); }
};
template <int N, typename E> struct WgmmaRSKMajor {
    static __device__ __forceinline__ void run(float*, const u32*, u64, int) { __trap(); }
    static __device__ __forceinline__ void first(float*, const u32*, u64) { __trap(); }
};

// The specialisations differ only in N and the element type, so they are stamped out by
// the macros below (the PTX text of each is what a hand-written copy would be).
// Accumulator operands d[i .. i+7] with constraint C ("+f": accumulate, "=f": overwrite).
#define MATE_WG_ACC8(C, i) \
    C(d[i]), C(d[i + 1]), C(d[i + 2]), C(d[i + 3]), C(d[i + 4]), C(d[i + 5]), C(d[i + 6]), C(d[i + 7])
#define MATE_WG_ACC32(C) MATE_WG_ACC8(C, 0), MATE_WG_ACC8(C, 8), MATE_WG_ACC8(C, 16), MATE_WG_ACC8(C, 24)
#define MATE_WG_ACC64(C) \
    MATE_WG_ACC32(C), MATE_WG_ACC8(C, 32), MATE_WG_ACC8(C, 40), MATE_WG_ACC8(C, 48), MATE_WG_ACC8(C, 56)
#define MATE_WG_REGS32                                                 \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"          \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define MATE_WG_REGS64                                                 \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"          \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
    "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
    "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"

// D[64 x N] (+)= A[64 x K] B[K x N]: A and B K-major in shared memory (descriptors); K is 16
// for 16-bit types, 32 for e4m3 (32 bytes per row either way). ACC lists the N / 2
// accumulator registers; A, B, P are the operand numbers after them. IMM: the immediate
// operands after scale-d (scale-a, scale-b, and for 16-bit types the transpose flags: 0,
// K-major; 8-bit types have none and are always K-major).
#define MATE_WG_SS(N, K, ELEM, TY, IMM, REGS, ACC, A, B, P)                                           \
    template <> struct WgmmaSS<N, ELEM> {                                                             \
        static __device__ __forceinline__ void run(float* d, u64 da, u64 db, int scale_d) {           \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n"                              \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k" #K ".f32." TY "." TY " " REGS ", " \
                         "%" #A ", %" #B ", p, " IMM ";\n}\n"                                         \
                         : ACC("+f")                                                                  \
                         : "l"(da), "l"(db), "r"(scale_d));                                           \
        }                                                                                             \
        /* D = A B (accumulator not read: the registers are pure outputs). */                         \
        static __device__ __forceinline__ void first(float* d, u64 da, u64 db) {                      \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n"                              \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k" #K ".f32." TY "." TY " " REGS ", " \
                         "%" #A ", %" #B ", p, " IMM ";\n}\n"                                         \
                         : ACC("=f")                                                                  \
                         : "l"(da), "l"(db), "r"(0));                                                 \
        }                                                                                             \
    };

// D[64 x N] (+)= A[64 x 16] B[16 x N]: A in registers (mma.m16n8k16 A layout per warp), B in
// shared memory; NAME<N, ELEM> is WgmmaRS (B MN-major: transposed descriptor, TRANS 1) or
// WgmmaRSKMajor (B K-major, TRANS 0). ACC lists the N / 2 accumulator registers; A0 is the
// operand number of the first A register (three more follow), then the B descriptor and
// scale-d.
#define MATE_WG_RS(NAME, N, ELEM, TY, TRANS, REGS, ACC, A0, A1, A2, A3, B, P)                          \
    template <> struct NAME<N, ELEM> {                                                                \
        static __device__ __forceinline__ void run(float* d, const u32* a, u64 db, int scale_d) {     \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n"                              \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS          \
                         ", {%" #A0 ",%" #A1 ",%" #A2 ",%" #A3 "}, %" #B ", p, 1, 1, " #TRANS ";\n}\n"  \
                         : ACC("+f")                                                                  \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));        \
        }                                                                                             \
        /* D = A B (accumulator not read: the registers are pure outputs). */                         \
        static __device__ __forceinline__ void first(float* d, const u32* a, u64 db) {                \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n"                              \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS          \
                         ", {%" #A0 ",%" #A1 ",%" #A2 ",%" #A3 "}, %" #B ", p, 1, 1, " #TRANS ";\n}\n"  \
                         : ACC("=f")                                                                  \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(0));              \
        }                                                                                             \
    };
#define MATE_WG_RS64(NAME, ELEM, TY, TRANS) \
    MATE_WG_RS(NAME, 64, ELEM, TY, TRANS, MATE_WG_REGS32, MATE_WG_ACC32, 32, 33, 34, 35, 36, 37)
#define MATE_WG_RS128(NAME, ELEM, TY, TRANS) \
    MATE_WG_RS(NAME, 128, ELEM, TY, TRANS, MATE_WG_REGS64, MATE_WG_ACC64, 64, 65, 66, 67, 68, 69)

// e4m3: D[64 x N] (+)= A[64 x 32] B[32 x N], A in registers, B K-major in shared memory
// (descriptor), as S = Q K^T with Q held by the warpgroup (16-bit types: MATE_WG_RS above).
// Per warp (rows 16 w ..): a[0] holds the 4 bytes 4 t .. 4 t + 3 of row g of the k-step's 32
// bytes, a[1] the same of row g + 8, a[2] / a[3] bytes 16 + 4 t .. of rows g / g + 8 (the
// mma.m16n8k32 A layout, byte for byte the m16n8k16 one of 16-bit types; ldmatrix.x4 of the
// 8 x 16-byte matrices (rows 0-7 | 8-15) x (bytes 0-15 | 16-31) gives it). IMM: scale-a,
// scale-b (no transpose flags for 8-bit types).
#define MATE_WG_RS_KMAJOR(N, K, ELEM, TY, IMM, REGS, ACC, AREGS, B, P)                                \
    template <> struct WgmmaRSKMajor<N, ELEM> {                                                       \
        static __device__ __forceinline__ void run(float* d, const u32* a, u64 db, int scale_d) {     \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n"                              \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k" #K ".f32." TY "." TY " " REGS ", " \
                         AREGS ", %" #B ", p, " IMM ";\n}\n"                                          \
                         : ACC("+f")                                                                  \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));        \
        }                                                                                             \
        /* D = A B (accumulator not read: the registers are pure outputs). */                         \
        static __device__ __forceinline__ void first(float* d, const u32* a, u64 db) {                \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n"                              \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k" #K ".f32." TY "." TY " " REGS ", " \
                         AREGS ", %" #B ", p, " IMM ";\n}\n"                                          \
                         : ACC("=f")                                                                  \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(0));              \
        }                                                                                             \
    };

MATE_WG_SS(64, 16, half_t, "f16", "1, 1, 0, 0", MATE_WG_REGS32, MATE_WG_ACC32, 32, 33, 34)
MATE_WG_SS(128, 16, half_t, "f16", "1, 1, 0, 0", MATE_WG_REGS64, MATE_WG_ACC64, 64, 65, 66)
MATE_WG_RS64(WgmmaRS, half_t, "f16", 1)
MATE_WG_RS64(WgmmaRSKMajor, half_t, "f16", 0)
MATE_WG_RS128(WgmmaRSKMajor, half_t, "f16", 0)
MATE_WG_SS(64, 16, bf16_t, "bf16", "1, 1, 0, 0", MATE_WG_REGS32, MATE_WG_ACC32, 32, 33, 34)
MATE_WG_SS(128, 16, bf16_t, "bf16", "1, 1, 0, 0", MATE_WG_REGS64, MATE_WG_ACC64, 64, 65, 66)
MATE_WG_RS64(WgmmaRS, bf16_t, "bf16", 1)
MATE_WG_RS64(WgmmaRSKMajor, bf16_t, "bf16", 0)
MATE_WG_RS128(WgmmaRSKMajor, bf16_t, "bf16", 0)
MATE_WG_SS(128, 32, fp8_t, "e4m3", "1, 1", MATE_WG_REGS64, MATE_WG_ACC64, 64, 65, 66)
MATE_WG_RS_KMAJOR(128, 32, fp8_t, "e4m3", "1, 1", MATE_WG_REGS64, MATE_WG_ACC64, "{%64,%65,%66,%67}", 68, 69)
MATE_WG_RS_KMAJOR(64, 32, fp8_t, "e4m3", "1, 1", MATE_WG_REGS32, MATE_WG_ACC32, "{%32,%33,%34,%35}", 36, 37)

#undef MATE_WG_SS
#undef MATE_WG_RS128
#undef MATE_WG_RS64
#undef MATE_WG_RS
#undef MATE_WG_RS_KMAJOR
#undef MATE_WG_REGS64
#undef MATE_WG_REGS32
#undef MATE_WG_ACC64
#undef MATE_WG_ACC32
#undef MATE_WG_ACC8

// S = Q K^T issued for one warpgroup (not committed): Q rows of a QROWS-row tile and K rows of
// a KROWS-row tile, both in column blocks; k-step ks (16 values, 32 bytes) reads column block
// ks / 4 at byte ks % 4 * 32. S holds the KROWS / 2 accumulator registers of m64nKROWS.
template <int D, int QROWS, int KROWS, typename E>
__device__ __forceinline__ void wg_issue_qk(float* S, u64 q_desc, u64 k_desc) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        const u32 qo = (ks >> 2) * (QROWS * 128) + (ks & 3) * 32;
        const u32 ko = (ks >> 2) * (KROWS * 128) + (ks & 3) * 32;
        if (ks == 0)
            WgmmaSS<KROWS, E>::first(S, wg_desc_add(q_desc, qo), wg_desc_add(k_desc, ko));
        else
            WgmmaSS<KROWS, E>::run(S, wg_desc_add(q_desc, qo), wg_desc_add(k_desc, ko), 1);
    }
}


}  // namespace attn
}  // namespace mate
