// Small utility kernels: dtype casts and the CSR -> page-table builder.
#include "common/dtype.cuh"

using namespace mate;

// out[i] = cast(in[i]) for a contiguous array of n elements. Each thread handles
// 8 elements with vector loads/stores (16 bytes for 16-bit types).
template <typename Tin, typename Tout>
__global__ void cast_kernel(const Tin* __restrict__ in, Tout* __restrict__ out, long long n, float scale) {
    constexpr int kVec = 8;
    long long i0 = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * kVec;
    if (i0 + kVec <= n) {
        struct __align__(sizeof(Tin) * kVec) InVec { Tin v[kVec]; };
        struct __align__(sizeof(Tout) * kVec) OutVec { Tout v[kVec]; };
        InVec a = *reinterpret_cast<const InVec*>(in + i0);
        OutVec b;
#pragma unroll
        for (int j = 0; j < kVec; ++j) b.v[j] = from_float<Tout>(to_float<Tin>(a.v[j]) * scale);
        *reinterpret_cast<OutVec*>(out + i0) = b;
    } else {
        for (long long i = i0; i < n; ++i) out[i] = from_float<Tout>(to_float<Tin>(in[i]) * scale);
    }
}

// page_table[b, j] = kv_indices[start_b + j] for j < ceil(kv_lens[b] / page_size), else 0,
// with start_b the exclusive prefix sum of page counts. One block per request.
__global__ void build_page_table_kernel(const int* __restrict__ kv_indices, const int* __restrict__ kv_lens,
                                        int* __restrict__ page_table, int batch, int max_pages, int page_size) {
    __shared__ long long partial[32];
    const int b = blockIdx.x;
    long long acc = 0;
    for (int i = threadIdx.x; i < b; i += blockDim.x) acc += (kv_lens[i] + page_size - 1) / page_size;
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = acc;
    __syncthreads();
    long long start = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) start += partial[w];
    const int count = (kv_lens[b] + page_size - 1) / page_size;
    for (int j = threadIdx.x; j < max_pages; j += blockDim.x)
        page_table[(long long)b * max_pages + j] = j < count ? kv_indices[start + j] : 0;
}
