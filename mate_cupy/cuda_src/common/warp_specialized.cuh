// Synchronisation of warp-specialised sm_90 kernels (producer and consumer warpgroups):
// mbarriers addressed as shared-space bytes, cp.async arrivals, named barriers and register
// reallocation (PTX ISA "mbarrier", "cp.async.mbarrier.arrive", "bar", "setmaxnreg").
// Compiled for the GPU only; the CPU emulators supply their own versions of these functions.
#pragma once
#include "dtype.cuh"

#if defined(__CUDA_ARCH__)
namespace mate {

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Wait until the phase of parity `parity` of `bar` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// Arrive (release: this thread's earlier shared-memory writes are visible to the waiters).
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrive `count` times at once (release, as mbar_arrive; the count operand needs sm_90).
__device__ __forceinline__ void mbar_arrive_n(u32 bar, u32 count) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Arrive on `bar` once every cp.async this thread issued so far has landed (the arrival
// is one of the barrier's expected count: no pending-count increment).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32).
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// setmaxnreg: a warpgroup gives back registers down to R, or claims them up to R.
template <int R>
__device__ __forceinline__ void regs_release() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void regs_claim() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}

}  // namespace mate
#endif
