// The union of the 128-key blocks selected by the queries of one CTA.
//
// Block-sparse attention gives every (query, KV head) its own list of block
// ids (any order, -1 padding). A CTA holds the rows of `nq` consecutive
// queries of one KV head; it walks the ascending union of their lists once,
// loading each K/V block a single time for all its rows, and masks a row
// wherever its query did not list the block. This header builds, in shared
// memory:
//   ulist[U]          ascending distinct block ids,
//   upage[U]          their page ids,
//   qmask[nq][qwords] bit u of query ql set when ql listed ulist[u].
// A block id is kept only when 0 <= id < nb (the caller folds the request's
// block count, the page-list length and the causal horizon into nb) and its
// page id lies inside the cache; anything else is skipped, never dereferenced.
//
// The NT threads that build a union are threads 0 .. NT - 1 of the CTA and meet at barrier
// kBar: 0 is __syncthreads (the whole CTA builds it), another id a named barrier of those NT
// threads (the producer warpgroup of a warp-specialised kernel).
#pragma once
#include "dtype.cuh"
#include "kv_pages.cuh"
#include "warp_specialized.cuh"

namespace mate {
namespace attn {

template <int NT, int kBar>
__device__ __forceinline__ void union_sync() {
    if constexpr (kBar == 0) {
        __syncthreads();
    } else {
        named_sync(kBar, NT);
    }
}

// Exclusive prefix sum of popc(bitmap[w]) over w < nwords into prefix[];
// returns the total. warp_total: NT / 32 ints of shared scratch. All NT threads call it;
// it ends with a barrier.
template <int NT, int kBar = 0>
__device__ __forceinline__ int bitmap_exclusive_scan(const u32* bitmap, int* prefix, int nwords, int* warp_total) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int per = (nwords + NT - 1) / NT;
    const int w0 = min(nwords, tid * per), w1 = min(nwords, w0 + per);
    int local = 0;
    for (int w = w0; w < w1; ++w) local += __popc(bitmap[w]);
    int incl = local;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += y;
    }
    if (lane == 31) warp_total[warp] = incl;
    union_sync<NT, kBar>();
    int before = 0, total = 0;
#pragma unroll
    for (int w = 0; w < NT / 32; ++w) {
        const int x = warp_total[w];
        before += (w < warp) ? x : 0;
        total += x;
    }
    int run = before + incl - local;
    for (int w = w0; w < w1; ++w) {
        prefix[w] = run;
        run += __popc(bitmap[w]);
    }
    union_sync<NT, kBar>();
    return total;
}

// Builds ulist/upage/qmask (see the file comment) and returns U.
//   lists: entry x of query ql is lists[row0 + ql * row_stride + x], x < width.
//   bitmap, prefix: scratch of ceil(nb / 32) words each (may alias tiles not yet in use);
//   warp_total: NT / 32 ints of shared scratch.
// All NT threads call it; it ends with a barrier.
template <int NT, int kBar = 0>
__device__ int build_block_union(const int* __restrict__ lists, long long row0, long long row_stride, int width,
                                 int nq, int nb, PageList pages, int num_pages, u32* bitmap, int* prefix, int* ulist,
                                 int* upage, u32* qmask, int qwords, int* warp_total) {
    const int tid = threadIdx.x;
    const int nwords = (nb + 31) >> 5;
    const int nent = nq * width;
    for (int w = tid; w < nwords; w += NT) bitmap[w] = 0u;
    for (int i = tid; i < nq * qwords; i += NT) qmask[i] = 0u;
    union_sync<NT, kBar>();
    for (int e = tid; e < nent; e += NT) {
        const int ql = e / width, x = e - ql * width;
        const int s = lists[row0 + ql * row_stride + x];
        if (s >= 0 && s < nb && pages.page(s, num_pages) >= 0) atomicOr(&bitmap[s >> 5], 1u << (s & 31));
    }
    union_sync<NT, kBar>();
    const int total = bitmap_exclusive_scan<NT, kBar>(bitmap, prefix, nwords, warp_total);
    // Compaction and membership only read bitmap/prefix: no barrier between them.
    for (int w = tid; w < nwords; w += NT) {
        u32 bits = bitmap[w];
        int pos = prefix[w];
        while (bits) {
            const int s = (w << 5) + __ffs(bits) - 1;
            bits &= bits - 1;
            ulist[pos] = s;
            upage[pos] = pages.page(s, num_pages);
            ++pos;
        }
    }
    for (int e = tid; e < nent; e += NT) {
        const int ql = e / width, x = e - ql * width;
        const int s = lists[row0 + ql * row_stride + x];
        if (s < 0 || s >= nb) continue;
        const u32 word = bitmap[s >> 5];
        if (!((word >> (s & 31)) & 1u)) continue;
        const int pos = prefix[s >> 5] + __popc(word & ((1u << (s & 31)) - 1u));
        atomicOr(&qmask[ql * qwords + (pos >> 5)], 1u << (pos & 31));
    }
    union_sync<NT, kBar>();
    return total;
}

}  // namespace attn
}  // namespace mate
