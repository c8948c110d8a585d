// Hide a loop-invariant value from the optimiser: expressions of it are then recomputed where
// used (a few integer ops) instead of hoisted, held across a loop and spilled.
#pragma once

__device__ __forceinline__ unsigned opaque(unsigned x) {
    asm volatile("" : "+r"(x));
    return x;
}
__device__ __forceinline__ int opaque(int x) {
    asm volatile("" : "+r"(x));
    return x;
}
