// Bulk (TMA engine) copies of contiguous byte ranges and the mbarrier they complete on
// (sm_90+; PTX ISA "cp.async.bulk", "mbarrier"). On older targets the functions compile to
// nothing and `kBulkCopy` is false: launchers never request a bulk copy there.
#pragma once
#include "mma.cuh"  // smem_u32

namespace mate {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kBulkCopy = true;
#else
constexpr bool kBulkCopy = false;
#endif

// Initialise a one-arrival mbarrier and make it visible to the async proxy.
__device__ __forceinline__ void mbarrier_init_one(unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(bar)));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::);
#endif
}

// Global -> shared copy of `bytes` (multiple of 16, both addresses 16-byte aligned) that
// completes on `bar`; the calling thread arrives on `bar` expecting those bytes.
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, unsigned bytes, unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            smem_u32(smem)),
        "l"(gmem), "r"(bytes), "r"(smem_u32(bar))
        : "memory");
#endif
}

// Prefetch `bytes` (multiple of 16, 16-byte aligned) from global memory into L2; no
// completion, no shared memory.
__device__ __forceinline__ void bulk_prefetch_l2(const void* gmem, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(gmem), "r"(bytes) : "memory");
#endif
}

// Wait until phase `parity` of `bar` completes (the bulk bytes are then visible).
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n"
        "}\n" ::"r"(smem_u32(bar)),
        "r"(parity)
        : "memory");
#endif
}

}  // namespace mate
