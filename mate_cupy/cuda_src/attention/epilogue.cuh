// Epilogue of the attention forward kernel: merge the key-split warps of a CTA,
// normalise, and store each (query, head) row of the tile.
//
// Each warp (wm, wn) holds O (unnormalised), its running row max m (raw scores) and
// partial row sum l for kMT 16-row m-tiles over its slice of the keys. The warps of a
// row stage them in shared memory ([kWN][kM][kD + 8] floats, then [kWN][kM] max, sum
// and factor), combine them with the usual log-sum-exp weights and write
//   out [total_q, Hq, D] (16-byte vector stores, OutT) and lse [total_q, Hq] (natural
//       log, -inf for a row with no key), or, split-KV, the split's partial rows
//   ws_o [splits, total_q * Hq, D] f32 (normalised) and ws_lse [splits, total_q * Hq].
// e4m3 inputs carry P scaled by kPScale = 256 (undone here); out_scale is v_scale.
#pragma once
#include "../common/dtype.cuh"
#include "../common/softmax.cuh"
#include "../common/request_rows.cuh"
#include "../common/mma.cuh"

namespace mate {
namespace attn {

// A 4 x 4 transpose of 32-bit words across the lanes of a quad (t4 = lane & 3): lane t4's
// x[c] (its word of 16-byte chunk c of a row: columns 2 t4, 2 t4 + 1 of the chunk) becomes
// the words of chunk t4 in column order, x[s] = lane s's old x[t4]; two butterfly shuffle
// rounds (every lane of the warp takes part).
__device__ __forceinline__ void quad_transpose4(u32 (&x)[4], int t4) {
    // Round 1 (lanes t4 ^ 2): keep the chunks of this lane's high bit, trade the others.
    const bool hi = t4 & 2, lo = t4 & 1;
    u32 a0 = hi ? x[0] : x[2], a1 = hi ? x[1] : x[3];
    a0 = __shfl_xor_sync(0xffffffffu, a0, 2);
    a1 = __shfl_xor_sync(0xffffffffu, a1, 2);
    // w[s1][c0] = word (column pair of lane (s1, t4 & 1)) of chunk (t4 >> 1, c0)
    u32 w00 = hi ? a0 : x[0], w01 = hi ? a1 : x[1], w10 = hi ? x[2] : a0, w11 = hi ? x[3] : a1;
    // Round 2 (lanes t4 ^ 1): trade the chunk of the other low bit.
    u32 b0 = lo ? w00 : w01, b1 = lo ? w10 : w11;
    b0 = __shfl_xor_sync(0xffffffffu, b0, 1);
    b1 = __shfl_xor_sync(0xffffffffu, b1, 1);
    x[0] = lo ? b0 : w00;
    x[1] = lo ? w01 : b0;
    x[2] = lo ? b1 : w10;
    x[3] = lo ? w11 : b1;
}

template <int kD, int kM, int kMT, int kWN, int kThreads, bool kFp8>
struct AttentionEpilogue {
    // Shared memory: kWN x kM staged rows of kD + 8 floats (bank-conflict padding), then
    // the kWN x kM row max, sum and factor.
    static constexpr int kSmemBytes = kWN * kM * (kD + 8) * 4 + 3 * kWN * kM * 4;

    // The tile's rows are CTA rows r = 0..kM-1, packed row P = row0 + r (query P / group,
    // head kvh * group + P % group of request rows starting at token q_start); rows
    // P >= rows_total are padding. `smem`: kSmemBytes of shared memory (the K/V ring).
    template <typename OutT>
    static __device__ __forceinline__ void store(
        float (&O)[kMT][kD / 8][4], float (&m_run)[kMT][2], float (&l_run)[kMT][2], unsigned char* smem, int tid,
        int m_base, int g, int t4, int wn, int row0, int rows_total, int group, int q_start, int kvh,
        int num_heads_q, int total_q, int split, OutT* __restrict__ out, float* __restrict__ lse,
        float* __restrict__ ws_o, float* __restrict__ ws_lse, long long out_tok_stride, long long out_head_stride,
        float scale_log2, float out_scale) {
        constexpr int kDT = kD / 8;  // O n-tiles per m-tile
        constexpr int kEpiStride = kD + 8;
        constexpr float kPScale = kFp8 ? 256.f : 1.f;
        cp_async_wait<0>();
        __syncthreads();
        float* eO = reinterpret_cast<float*>(smem);  // [kWN][kM][kEpiStride]
        float* eM = eO + kWN * kM * kEpiStride;    // [kWN][kM] row max (log2 domain)
        float* eL = eM + kWN * kM;                 // [kWN][kM] row sum
        float* eF = eL + kWN * kM;                 // [kWN][kM] per-warp factor
    #pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
    #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = m_base + mt * 16 + h * 8 + g;
                const float l = quad_sum(l_run[mt][h]);
                if (t4 == 0) {
                    eM[wn * kM + r] = m_run[mt][h] * scale_log2;  // log2 domain (-inf stays -inf)
                    eL[wn * kM + r] = l;
                }
                float* dst = eO + (wn * kM + r) * kEpiStride;
                if constexpr (!kFp8) {
    #pragma unroll
                    for (int d = 0; d < kDT; ++d)
                        *reinterpret_cast<float2*>(dst + d * 8 + 2 * t4) =
                            make_float2(O[mt][d][2 * h], O[mt][d][2 * h + 1]);
                } else {
                    // n-tile 2c holds the even dims 16c + 4t + {0, 2}, n-tile 2c+1 the odd ones.
    #pragma unroll
                    for (int c = 0; c < kD / 16; ++c)
                        *reinterpret_cast<float4*>(dst + c * 16 + 4 * t4) =
                            make_float4(O[mt][2 * c][2 * h], O[mt][2 * c + 1][2 * h], O[mt][2 * c][2 * h + 1],
                                        O[mt][2 * c + 1][2 * h + 1]);
                }
            }
        }
        __syncthreads();
        const long long split_rows = (long long)total_q * num_heads_q;
        if (tid < kM) {
            const int r = tid;
            float mx = kNegInf;
    #pragma unroll
            for (int w = 0; w < kWN; ++w) mx = fmaxf(mx, eM[w * kM + r]);
            float f[kWN];
            float L = 0.f;
    #pragma unroll
            for (int w = 0; w < kWN; ++w) {
                f[w] = (mx == kNegInf) ? 0.f : fast_exp2(eM[w * kM + r] - mx);
                L += eL[w * kM + r] * f[w];
            }
            const float inv = L > 0.f ? out_scale / (kPScale * L) : 0.f;
    #pragma unroll
            for (int w = 0; w < kWN; ++w) eF[w * kM + r] = f[w] * inv;
            const int P = row0 + r;
            if (P < rows_total) {
                const int qi = P / group, h = P - qi * group;
                const long long ridx = (long long)(q_start + qi) * num_heads_q + kvh * group + h;
                const float row_lse = L > 0.f ? (mx + __log2f(L)) * 0.69314718055994531f : kNegInf;
                if (ws_lse != nullptr) {
                    ws_lse[split * split_rows + ridx] = row_lse;
                } else if (lse != nullptr) {
                    lse[ridx] = row_lse;
                }
            }
        }
        __syncthreads();
        constexpr int kC8 = kD / 8;
        for (int it = tid; it < kM * kC8; it += kThreads) {
            const int r = it / kC8, c8 = it - r * kC8;
            const int P = row0 + r;
            if (P >= rows_total) continue;
            float acc[8];
    #pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    #pragma unroll
            for (int w = 0; w < kWN; ++w) {
                const float fw = eF[w * kM + r];
                const float* src = eO + (w * kM + r) * kEpiStride + c8 * 8;
                const float4 x0 = *reinterpret_cast<const float4*>(src);
                const float4 x1 = *reinterpret_cast<const float4*>(src + 4);
                acc[0] += fw * x0.x;
                acc[1] += fw * x0.y;
                acc[2] += fw * x0.z;
                acc[3] += fw * x0.w;
                acc[4] += fw * x1.x;
                acc[5] += fw * x1.y;
                acc[6] += fw * x1.z;
                acc[7] += fw * x1.w;
            }
            const int qi = P / group, h = P - qi * group;
            const int tok = q_start + qi, head = kvh * group + h;
            if (ws_o != nullptr) {
                float* dst = ws_o + ((split * split_rows + (long long)tok * num_heads_q + head) * kD + c8 * 8);
                *reinterpret_cast<float4*>(dst) = make_float4(acc[0], acc[1], acc[2], acc[3]);
                *reinterpret_cast<float4*>(dst + 4) = make_float4(acc[4], acc[5], acc[6], acc[7]);
            } else {
                vec16 pk;
                pk.w[0] = pack2<OutT>(acc[0], acc[1]);
                pk.w[1] = pack2<OutT>(acc[2], acc[3]);
                pk.w[2] = pack2<OutT>(acc[4], acc[5]);
                pk.w[3] = pack2<OutT>(acc[6], acc[7]);
                *reinterpret_cast<vec16*>(out + (long long)tok * out_tok_stride + (long long)head * out_head_stride +
                                          c8 * 8) = pk;
            }
        }
    }
};

// Split-KV combine, one warp per (query, head) row of request blockIdx.y (blocks of
// blockDim.x / 32 rows along x): the rows' partials weighted by exp(lse_s - lse).
//   ws_o [splits, total_q * Hq, D] f32 (normalised per split), ws_lse [splits, total_q * Hq];
//   out [total_q, Hq, D] (token and head strides given), lse [total_q, Hq] f32 or null.
template <int kD, typename OutT>
__device__ __forceinline__ void merge_split_rows(
    const float* __restrict__ ws_o, const float* __restrict__ ws_lse, OutT* __restrict__ out,
    float* __restrict__ lse, const int* __restrict__ cu_seqlens_q, const int* __restrict__ qo_lens, int total_q,
    int num_heads_q, int num_splits, long long out_tok_stride, long long out_head_stride) {
    constexpr int kPer = kD / 32;  // values per lane: 2, 4 or 8
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int b = blockIdx.y;
    const QueryRows qr = query_rows(cu_seqlens_q, qo_lens, total_q, b);
    const int q_start = qr.start, Lq = qr.len;
    if (row >= (long long)Lq * num_heads_q) return;
    const long long ridx = (long long)q_start * num_heads_q + row;
    const int tok = (int)(ridx / num_heads_q), head = (int)(ridx - (long long)tok * num_heads_q);
    const long long split_rows = (long long)total_q * num_heads_q;

    float mx = kNegInf;
    for (int s = lane; s < num_splits; s += 32) mx = fmaxf(mx, ws_lse[s * split_rows + ridx]);
    mx = warp_max(mx);
    float acc[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) acc[e] = 0.f;
    float row_lse = kNegInf;
    if (mx != kNegInf) {
        float sum = 0.f;
        for (int s = lane; s < num_splits; s += 32) sum += __expf(ws_lse[s * split_rows + ridx] - mx);
        sum = warp_sum(sum);
        const float inv = 1.f / sum;
        for (int s = 0; s < num_splits; ++s) {
            const float ls = ws_lse[s * split_rows + ridx];
            if (ls == kNegInf) continue;
            const float w = __expf(ls - mx) * inv;
            const float* src = ws_o + (s * split_rows + ridx) * kD + lane * kPer;
#pragma unroll
            for (int e = 0; e < kPer; e += 2) {
                const float2 x = *reinterpret_cast<const float2*>(src + e);
                acc[e] += w * x.x;
                acc[e + 1] += w * x.y;
            }
        }
        row_lse = mx + __logf(sum);
    }
    OutT* dst = out + (long long)tok * out_tok_stride + (long long)head * out_head_stride + lane * kPer;
#pragma unroll
    for (int e = 0; e < kPer; e += 2) *reinterpret_cast<u32*>(dst + e) = pack2<OutT>(acc[e], acc[e + 1]);
    if (lse != nullptr && lane == 0) lse[ridx] = row_lse;
}

}  // namespace attn
}  // namespace mate
