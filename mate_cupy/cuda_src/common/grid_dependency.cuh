// Programmatic dependent launch (sm_90+; PTX ISA "griddepcontrol"). A kernel launched with
// the programmatic stream serialization attribute may start while the grid before it on the
// stream is still finishing; `grid_dependency_sync` waits until that grid has completed and
// its writes are visible, then lets the grid after this one be scheduled (its CTAs take SM
// slots as this grid's CTAs leave them and wait in their own `grid_dependency_sync`). Call
// it before the first global memory access. In a launch without the attribute, and before
// sm_90, both steps are no-ops.
#pragma once

namespace mate {

__device__ __forceinline__ void grid_dependency_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace mate
