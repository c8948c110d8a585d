// Shared-memory tiles and tensor-core fragments of the attention kernels.
//
// A tile is ROWS x ROW_BYTES bytes, row-major, stored in 16-byte chunks whose
// column is XOR-swizzled by the row so that ldmatrix (8 rows x 16 bytes) and
// cp.async are bank-conflict free. Q, K and V tiles all use it: Q [rows, D],
// K [keys, D], V [keys, D] (element size 2 for fp16/bf16, 1 for e4m3).
//
// Fragment conventions (PTX ISA, mma.m16n8k16 / m16n8k32): g = lane / 4,
// t = lane % 4. Accumulator c0,c1: row g, columns 2t, 2t+1; c2,c3: row g+8.
// One "k-step" of the QK product covers 32 bytes of the head dimension
// (16 fp16/bf16 values: m16n8k16; 32 e4m3 values: m16n8k32); the byte
// addressing of the ldmatrix loads is identical for both.
#pragma once
#include "dtype.cuh"
#include "mma.cuh"
#include "opaque.cuh"

namespace mate {
namespace attn {

template <int ROW_BYTES>
struct SwizzledTile {
    static constexpr int kChunks = ROW_BYTES / 16;
    static_assert(ROW_BYTES % 16 == 0, "rows are whole 16-byte chunks");
    static_assert(kChunks == 4 || kChunks % 8 == 0, "swizzle needs 4 or a multiple of 8 chunks per row");
    // Physical chunk of logical chunk c in row `row`.
    static __device__ __forceinline__ int chunk(int row, int c) {
        if constexpr (kChunks >= 8) {
            return c ^ (row & 7);
        } else {
            return c ^ ((row >> 1) & 3);  // 64-byte rows: two rows share one 128-byte line
        }
    }
    static __device__ __forceinline__ int offset(int row, int c) { return row * ROW_BYTES + chunk(row, c) * 16; }
};

// ---- ldmatrix fragment loads ----
//
// Rows are a power of two of bytes, so the swizzled byte offset of (row, chunk
// 2*step + x) is (row * ROW_BYTES + ((16 * x) ^ swz(row))) ^ (32 * step): each
// lane precomputes the part that depends on it (a "lane offset", relative to
// the tile) and the loops only add tile bases and xor compile-time constants.

template <int ROW_BYTES>
__device__ __forceinline__ u32 swizzle_bytes(int row) {
    return (u32)(SwizzledTile<ROW_BYTES>::chunk(row, 0) * 16);
}

// A operand (Q, 16 rows from m0): a0..a3 = rows 0-7 / 8-15 x chunk lo / hi.
template <int ROW_BYTES>
__device__ __forceinline__ u32 lane_offset_a(int m0, int lane) {
    const int row = m0 + (lane & 7) + ((lane >> 3) & 1) * 8;
    return row * ROW_BYTES + (((lane >> 4) * 16) ^ swizzle_bytes<ROW_BYTES>(row));
}
// B operand of S = Q K^T, two n-tiles of keys from n0: b[0],b[1] keys n0..n0+7, b[2],b[3] n0+8..n0+15.
template <int ROW_BYTES>
__device__ __forceinline__ u32 lane_offset_b(int n0, int lane) {
    const int row = n0 + (lane & 7) + (lane >> 4) * 8;
    return row * ROW_BYTES + ((((lane >> 3) & 1) * 16) ^ swizzle_bytes<ROW_BYTES>(row));
}
// B operand of O += P V (16-bit), keys k0..k0+15 transposed: b[0],b[1] dims 8c..8c+7, b[2],b[3] the next 8.
template <int ROW_BYTES>
__device__ __forceinline__ u32 lane_offset_vt(int k0, int lane) {
    const int row = k0 + (lane & 7) + ((lane >> 3) & 1) * 8;
    return row * ROW_BYTES + (((lane >> 4) * 16) ^ swizzle_bytes<ROW_BYTES>(row));
}
// B operand of O += P V (e4m3), keys k0..k0+31, one 16-byte chunk.
template <int ROW_BYTES>
__device__ __forceinline__ u32 lane_offset_vt8(int k0, int lane) {
    const int row = k0 + (lane & 7) + (lane >> 3) * 8;
    return row * ROW_BYTES + swizzle_bytes<ROW_BYTES>(row);
}

// 16-byte global -> shared copy to a shared-space address; `pred == false` zero-fills.
__device__ __forceinline__ void cp_async_16_u32(u32 saddr, const void* gmem, bool pred) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(gmem), "r"(pred ? 16 : 0));
}

// Hint: the 128-byte line holding gmem into L2 (no register, nothing to wait for).
__device__ __forceinline__ void prefetch_l2(const void* gmem) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(gmem)); }

__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// e4m3 V fragments from one ldmatrix.trans over keys k0..k0+31 of a chunk c:
// lane (g, t) receives {V[2t][2g], V[2t][2g+1], V[2t+1][2g], V[2t+1][2g+1]}
// of each 8-key group; byte permutes regroup them into the k32 fragments of
// two n-tiles: `even` holds dims 16c + 2n, `odd` dims 16c + 2n + 1 (n = 0..7),
// with the key order {2t, 2t+1, 8+2t, 9+2t | 16+2t, 17+2t, 24+2t, 25+2t}
// that the P fragment (pack4_e4m3 of the S accumulators) uses too.
__device__ __forceinline__ void ldsm_vt_e4m3(u32 (&even)[2], u32 (&odd)[2], u32 addr) {
    u32 r[4];
    ldsm_x4_t(r, addr);
    even[0] = __byte_perm(r[0], r[1], 0x6420);
    even[1] = __byte_perm(r[2], r[3], 0x6420);
    odd[0] = __byte_perm(r[0], r[1], 0x7531);
    odd[1] = __byte_perm(r[2], r[3], 0x7531);
}

// ---- tensor-core products ----

// S(16x8) += A(16 x one k-step) B(one k-step x 8).
template <typename E> struct QkMma {
    static __device__ __forceinline__ void run(float* d, const u32* a, const u32* b) { mma_16x8x16<E>(d, a, b); }
};
template <> struct QkMma<fp8_t> {
    static __device__ __forceinline__ void run(float* d, const u32* a, const u32* b) { mma_16x8x32_e4m3(d, a, b); }
};

// ---- softmax weights as the A operand of the PV product ----

// Four floats -> four e4m3 bytes (x0 in the lowest byte), saturating.
__device__ __forceinline__ u32 pack4_e4m3(float x0, float x1, float x2, float x3) {
    const u32 lo = __nv_cvt_float2_to_fp8x2(make_float2(x0, x1), __NV_SATFINITE, __NV_E4M3);
    const u32 hi = __nv_cvt_float2_to_fp8x2(make_float2(x2, x3), __NV_SATFINITE, __NV_E4M3);
    return (lo & 0xffffu) | (hi << 16);
}

}  // namespace attn
}  // namespace mate
