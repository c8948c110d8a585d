// Float maxima through the three-input integer maximum of sm_90 (VIMNMX3, `__vimax3_s32`):
// read as signed 32-bit integers, the bit patterns of floats >= +0 order like the floats
// and lie above those of every negative float (whose order is reversed). So the integer
// maximum of a set holding any value >= +0 is its float maximum, at two new values per
// instruction against one for `fmaxf`. A negative integer maximum means every value was
// negative (-0 and -inf included) and is not the float maximum: callers test for it and
// then take the float maximum instead.
#pragma once

namespace mate {

// The integer maximum of a running value and two floats' bit patterns.
__device__ __forceinline__ int bits_max3(int running, float a, float b) {
    return __vimax3_s32(running, __float_as_int(a), __float_as_int(b));
}

// The integer maximum of N floats' bit patterns as a tree of three-input maxima (depth
// about log3 N, so the row maxima of an accumulator do not wait on one serial chain).
template <int N>
__device__ __forceinline__ int bits_max_tree(const float (&v)[N]) {
    static_assert(N >= 1, "at least one value");
    if constexpr (N == 1) {
        return __float_as_int(v[0]);
    } else if constexpr (N == 2) {
        return max(__float_as_int(v[0]), __float_as_int(v[1]));
    } else {
        constexpr int M = (N + 2) / 3;
        float w[M];
#pragma unroll
        for (int i = 0; i < M; ++i) {
            int x;
            if (3 * i + 2 < N) x = bits_max3(__float_as_int(v[3 * i]), v[3 * i + 1], v[3 * i + 2]);
            else if (3 * i + 1 < N) x = max(__float_as_int(v[3 * i]), __float_as_int(v[3 * i + 1]));
            else x = __float_as_int(v[3 * i]);
            w[i] = __int_as_float(x);
        }
        return bits_max_tree<M>(w);
    }
}

// The maximum of a float over a row's quad (lanes 4 g .. 4 g + 3).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// The maximum of a bit-pattern value over a row's quad (lanes 4 g .. 4 g + 3).
__device__ __forceinline__ int quad_bits_max(int x) {
    x = max(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return max(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// Start of a running bit-pattern maximum: the pattern of -0, below every float >= +0.
constexpr int kBitsMaxStart = (int)0x80000000u;

}  // namespace mate
