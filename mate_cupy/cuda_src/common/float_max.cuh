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

// The maximum of a bit-pattern value over a row's quad (lanes 4 g .. 4 g + 3).
__device__ __forceinline__ int quad_bits_max(int x) {
    x = max(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return max(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// Start of a running bit-pattern maximum: the pattern of -0, below every float >= +0.
constexpr int kBitsMaxStart = (int)0x80000000u;

}  // namespace mate
