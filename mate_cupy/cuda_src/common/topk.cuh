// Exact top-k selection primitives: order-preserving score keys and bitwise
// radix searches over group-wide counts (no sort, no global scratch).
//
// A selection problem here is "the k largest keys, ties to the lower index".
// Keys are 32-bit unsigned, distinct keys compare like the scores they encode;
// key 0 is reserved for "not competing" and is never selected.
#pragma once
#include "dtype.cuh"

namespace mate {

constexpr u32 kFullMask = 0xffffffffu;

// Order-preserving key of a float score: a > b (as numbers) <=> key(a) > key(b).
// -0.0 and +0.0 share a key; every NaN maps to 1, below -inf (0x007fffff) and
// every number; 0 stays free for "not competing". Works on the bits, so it is
// exact for denormals whatever the flush-to-zero mode.
__device__ __forceinline__ u32 score_order_key(float x) {
    u32 b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 1u;  // NaN
    if (b == 0x80000000u) b = 0u;                     // -0.0 -> +0.0
    return b ^ ((u32)((int)b >> 31) | 0x80000000u);   // negatives: flip all; positives: set sign
}

// Largest T with count_ge(T) >= k, where count_ge(c) counts the keys >= c over the
// whole group (every thread of the group must call with the same k and get the
// same counts). With integer keys this T is exactly the k-th largest key.
// Requires at least k keys >= 1 for a non-zero answer.
template <class CountGe>
__device__ __forceinline__ u32 kth_largest_key(int k, CountGe count_ge) {
    u32 t = 0;
#pragma unroll 1
    for (int b = 31; b >= 0; --b) {
        const u32 c = t | (1u << b);
        if (count_ge(c) >= k) t = c;
    }
    return t;
}

// Largest I in [0, 2^bits) with count_lt(I) < need, where count_lt(c) counts the
// tied elements with index < c (group-wide). For need >= 1 and at least `need`
// tied elements this is the index of the need-th tied element in index order.
template <class CountLt>
__device__ __forceinline__ int nth_smallest_index(int need, int bits, CountLt count_lt) {
    int t = 0;
#pragma unroll 1
    for (int b = bits - 1; b >= 0; --b) {
        const int c = t | (1 << b);
        if (count_lt(c) < need) t = c;
    }
    return t;
}

// Write the n distinct ids of `ids` (shared memory) to out[0..n) in ascending
// order: the rank of an id is the number of smaller ids. Threads `rank` of a
// group of `group` threads share the work; n <= 64 in practice.
__device__ __forceinline__ void write_ids_ascending(const int* ids, int n, int rank, int group, int* out) {
    for (int a = rank; a < n; a += group) {
        const int v = ids[a];
        int pos = 0;
        for (int b = 0; b < n; ++b) pos += ids[b] < v;
        out[pos] = v;
    }
}

// Bitonic sort of one value per lane: lane i ends with the i-th smallest (15 steps).
__device__ __forceinline__ u32 warp_sort_ascending(u32 v, int lane) {
#pragma unroll
    for (int size = 2; size <= 32; size <<= 1) {
#pragma unroll
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            const u32 other = __shfl_xor_sync(kFullMask, v, stride);
            const bool ascending = (lane & size) == 0;
            const bool lower = (lane & stride) == 0;
            v = lower == ascending ? min(v, other) : max(v, other);
        }
    }
    return v;
}

// Inclusive prefix sum over the 32 lanes of a warp.
__device__ __forceinline__ int warp_inclusive_scan(int x, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(kFullMask, x, o);
        if (lane >= o) x += y;
    }
    return x;
}

}  // namespace mate
