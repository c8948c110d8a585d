// Small utility kernels: dtype casts and the CSR -> page-table builder.
#include "common/dtype.cuh"

using namespace mate;

// out[i] = cast(in[i] * scale) for contiguous arrays of n elements. Each thread handles 8
// elements, with vector loads / stores when both arrays are aligned to 8 elements.
template <typename Tin, typename Tout>
__global__ void cast_kernel(const Tin* __restrict__ in, Tout* __restrict__ out, long long n, float scale) {
    constexpr int kVec = 8;
    const bool aligned = ((unsigned long long)in % (sizeof(Tin) * kVec)) == 0 &&
                         ((unsigned long long)out % (sizeof(Tout) * kVec)) == 0;
    long long i0 = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * kVec;
    if (aligned && i0 + kVec <= n) {
        struct __align__(sizeof(Tin) * kVec) InVec { Tin v[kVec]; };
        struct __align__(sizeof(Tout) * kVec) OutVec { Tout v[kVec]; };
        InVec a = *reinterpret_cast<const InVec*>(in + i0);
        OutVec b;
#pragma unroll
        for (int j = 0; j < kVec; ++j) b.v[j] = from_float<Tout>(to_float<Tin>(a.v[j]) * scale);
        *reinterpret_cast<OutVec*>(out + i0) = b;
    } else {
        const long long i1 = min(i0 + kVec, n);
        for (long long i = i0; i < i1; ++i) out[i] = from_float<Tout>(to_float<Tin>(in[i]) * scale);
    }
}

// page_table[b, j] = kv_indices[(page_start[b] + j) * kv_indices_stride] for
// j < page_start[b + 1] - page_start[b], else 0. page_start [batch + 1] is the exclusive
// prefix sum of the requests' page counts. One block per request.
template <typename I>
__global__ void build_page_table_kernel(const I* __restrict__ kv_indices, long long kv_indices_stride,
                                        const long long* __restrict__ page_start, int* __restrict__ page_table,
                                        int max_pages) {
    const int b = blockIdx.x;
    const long long start = page_start[b];
    const long long count = page_start[b + 1] - start;
    for (int j = threadIdx.x; j < max_pages; j += blockDim.x)
        page_table[(long long)b * max_pages + j] = j < count ? (int)kv_indices[(start + j) * kv_indices_stride] : 0;
}
