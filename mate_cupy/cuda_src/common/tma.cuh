// Tensor memory accelerator (TMA) loads of tiled tensor regions (sm_90; PTX ISA
// "cp.async.bulk.tensor", "cp.async.bulk.prefetch.tensor", "mbarrier.expect_tx").
// A tensor map is the driver's 128-byte descriptor (cuTensorMapEncodeTiled, encoded by the
// host: mate_cupy.jit.tensor_map), passed by value as a `const __grid_constant__` kernel
// parameter; the loads take its generic address.
#pragma once
#include "dtype.cuh"

namespace mate {

struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Fetch the descriptor into the TMA unit's cache ahead of its first use.
__device__ __forceinline__ void tma_prefetch_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}
// The box at coordinates (c0, c1, c2) (innermost first, in elements) into shared memory at
// dst, completing `bytes` of the transaction count of the mbarrier at bar. Box elements
// outside the tensor are zero-filled.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TensorMap* map, int c0, int c1, int c2, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap* map, int c0, int c1, int c2, int c3, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
        "%5}], [%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}
// The box at (c0, c1, c2) into L2 (nothing to wait for).
__device__ __forceinline__ void tma_prefetch_3d(const TensorMap* map, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];\n" ::"l"(
                     reinterpret_cast<unsigned long long>(map)),
                 "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}
// Raise the transaction count of the mbarrier's current phase by `bytes` (no arrival).
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
#endif

}  // namespace mate
