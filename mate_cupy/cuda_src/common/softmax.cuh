// Online softmax in registers for the flash-attention kernels.
//
// Scores arrive raw (q.k, masked entries -inf) and are scaled into the log2
// domain (s * sm_scale * log2(e)) inside the exponent, one FFMA per element. Each thread owns two rows of a 16-row m-tile (g and g+8 of the
// mma accumulator layout); the four lanes of a quad share those rows, so row
// reductions are two xor-shuffles. The running row sum `l` stays a per-thread
// partial until the epilogue (quad_sum), as in FlashAttention-2.
//
// Rows with no admissible key keep m = -inf, l = 0 and O = 0: the exponent is
// taken relative to 0 instead of -inf, so no NaN is ever produced.
#pragma once
#include "dtype.cuh"
#include "float_max.cuh"

namespace mate {
namespace attn {

// -inf as a value usable in device code (NVRTC has no INFINITY macro).
#define kNegInf __int_as_float(0xff800000u)

// How far (log2 of the factor) a lazily rescaled running max may lag a row's true max:
// probabilities stay <= 2^8, far inside fp32 and the 16-bit P operand.
constexpr float kLazyRescaleLog2 = 8.f;

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The maximum of m and the scores S[.][2 h], S[.][2 h + 1] of row half h (rows g + 8 h),
// reduced over the row's quad. With kBits on sm_90 by bit patterns (float_max.cuh), exact
// where m or a score of every row of the warp is >= 0; otherwise by fmaxf.
template <bool kBits, int NT>
__device__ __forceinline__ float tile_row_max(const float (&S)[NT][4], float m, int h) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (kBits) {
        int chain[2] = {__float_as_int(m), kBitsMaxStart};  // two independent chains (latency)
#pragma unroll
        for (int n = 0; n < NT; ++n) chain[n & 1] = bits_max3(chain[n & 1], S[n][2 * h], S[n][2 * h + 1]);
        const int bm = quad_bits_max(max(chain[0], chain[1]));
        if (__all_sync(0xffffffffu, bm >= 0)) return __int_as_float(bm);
    }
#endif
    float mx = m;
#pragma unroll
    for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(S[n][2 * h], S[n][2 * h + 1]));
    return quad_max(mx);
}

// One online-softmax step of row half h (rows g + 8 h) of a 16-row slab: the raw scores
// S[.][2 h], S[.][2 h + 1] (masked = -inf) become p = 2^(S * scale - m_new * scale), the
// running raw max m and partial sum l are updated; returns the rescale factor
// 2^((m_old - m_new) * scale) of the row's output.
// kWs: the warp-specialised consumers' form, row maxima on bit patterns (tile_row_max) and
// a lazily moved running max: it stays where the tile's max exceeds it by at most
// kLazyRescaleLog2 in the exponent (so p <= 2^kLazyRescaleLog2 and the rescale factor is
// exactly 1: the caller skips rescaling O when every row of its warp has 1).
template <bool kWs, int NT>
__device__ __forceinline__ float online_softmax_row(float (&S)[NT][4], float& m, float& l, float scale, int h) {
    float mx = tile_row_max<kWs>(S, m, h);
    if constexpr (kWs) {
        if (!((mx - m) * scale > kLazyRescaleLog2)) mx = m;  // (-inf - -inf: NaN, kept)
    }
    const float m_scaled = (mx == kNegInf) ? 0.f : mx * scale;
    const float alpha = (kWs && mx == m) ? 1.f : fast_exp2(m * scale - m_scaled);
    m = mx;
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float p = fast_exp2(fmaf(S[n][2 * h + e], scale, -m_scaled));
            S[n][2 * h + e] = p;
            sum += p;
        }
    }
    l = l * alpha + sum;
    return alpha;
}

// Online softmax of one tile's raw scores without touching O: each row's rescale factor
// for O in `alpha` (the caller applies it, and may skip it where every factor of its warp
// is 1). The warp-specialised sm_90 consumers' form: row maxima on bit patterns
// (tile_row_max), the running max moved only when a tile's max exceeds it by more than
// kLazyRescaleLog2 in the exponent.
template <int NT>
__device__ __forceinline__ void online_softmax_scores(float (&S)[NT][4], float (&m)[2], float (&l)[2], float scale,
                                                      float (&alpha)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) alpha[h] = online_softmax_row<true>(S, m[h], l[h], scale, h);
}

// One online-softmax step for a 16-row slab (FlashAttention-2 form; the mma.sync tiles, row
// maxima by fmaxf).
//   S [NT][4]: this tile's raw scores q.k (masked = -inf); replaced by
//              p = 2^(S * scale - m_new * scale).
//   O [DT][4]: output accumulator, rescaled by 2^((m_old - m_new) * scale).
//   m[2], l[2]: running raw max and partial sum of rows g (index 0) and g+8 (1).
//   scale: softmax scale in the log2 domain, > 0 (sm_scale * log2(e)).
template <int NT, int DT>
__device__ __forceinline__ void online_softmax_update(float (&S)[NT][4], float (&O)[DT][4], float (&m)[2],
                                                      float (&l)[2], float scale) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float alpha = online_softmax_row<false>(S, m[h], l[h], scale, h);
#pragma unroll
        for (int d = 0; d < DT; ++d) {
            O[d][2 * h] *= alpha;
            O[d][2 * h + 1] *= alpha;
        }
    }
}

}  // namespace attn
}  // namespace mate
