// Synchronisation of warp-specialised sm_90 kernels (producer and consumer warpgroups):
// mbarriers addressed as shared-space bytes, cp.async arrivals, named barriers and register
// reallocation (PTX ISA "mbarrier", "cp.async.mbarrier.arrive", "bar", "setmaxnreg").
// The functions are compiled for the GPU only (the CPU emulators supply their own versions);
// setmaxnreg_fits, a compile-time check, everywhere.
#pragma once
#include "dtype.cuh"

namespace mate {
// Whether setmaxnreg budgets fit a CTA of `threads` launched at __launch_bounds__(threads, 1):
// one producer warpgroup at `producer_regs` and `consumers` consumer warpgroups at
// `consumer_regs` per thread, multiples of 8 in [24, 256], within the launch allocation (the
// 64K file per thread, in multiples of 8). setmaxnreg only moves registers inside that
// allocation: a claim beyond it waits forever.
constexpr bool setmaxnreg_fits(int threads, int consumers, int producer_regs, int consumer_regs) {
    return 128 * producer_regs + 128 * consumers * consumer_regs <= 65536 / threads / 8 * 8 * threads &&
           producer_regs % 8 == 0 && consumer_regs % 8 == 0 && producer_regs >= 24 && consumer_regs <= 256;
}
}  // namespace mate

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
