// Small utility kernels: dtype casts, the CSR -> page-table builder, the query positions of
// a batch from its device-resident lengths.
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
// j < page_start[b + 1] - page_start[b], else 0; 64-bit ids saturate to the int32 range (an id
// outside it stays outside every cache). page_start [batch + 1] is the exclusive prefix sum of
// the requests' page counts. One block per request.
template <typename I>
__global__ void build_page_table_kernel(const I* __restrict__ kv_indices, long long kv_indices_stride,
                                        const long long* __restrict__ page_start, int* __restrict__ page_table,
                                        int max_pages) {
    const int b = blockIdx.x;
    const long long start = page_start[b];
    const long long count = page_start[b + 1] - start;
    for (int j = threadIdx.x; j < max_pages; j += blockDim.x)
        page_table[(long long)b * max_pages + j] =
            j < count ? (int)max(-2147483648LL, min(2147483647LL, (long long)kv_indices[(start + j) * kv_indices_stride]))
                      : 0;
}

// positions[i] (int64, i < total_q): the last key position query row i may attend, from the
// batch's device-resident lengths (static plans' runtime metadata). Request b owns rows
// [cu_seqlens_q[b], cu_seqlens_q[b] + qo_lens[b]); its row t sits at qo_offset[b] + t and,
// when causal, attends keys up to min(qo_offset[b] + t, kv_lens[b] - 1); otherwise up to
// kv_lens[b] - 1. Rows of no request get -1. The request of a row is found by binary search
// over cu_seqlens_q (any values: the search stays inside [0, batch]). Grid-stride over rows.
__global__ void query_positions_kernel(const int* __restrict__ cu_seqlens_q, const int* __restrict__ qo_lens,
                                       const int* __restrict__ kv_lens, const int* __restrict__ qo_offset,
                                       int batch, int total_q, int causal, long long* __restrict__ positions) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total_q; i += gridDim.x * blockDim.x) {
        int lo = 0, hi = batch;  // the last b in [0, batch) with cu_seqlens_q[b] <= i, else -1
        while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if (cu_seqlens_q[mid] <= i) lo = mid + 1;
            else hi = mid;
        }
        const int b = lo - 1;
        long long pos = -1;
        if (b >= 0) {
            const long long t = (long long)i - cu_seqlens_q[b];
            if (t < qo_lens[b]) {
                const long long last = (long long)kv_lens[b] - 1;
                pos = causal ? min((long long)qo_offset[b] + t, last) : last;
            }
        }
        positions[i] = pos;
    }
}
