// Page lists of a paged KV cache, bounds-checked.
//
// A request's pages are either a row of a page table [B, width] or a slice
// kv_indices[indptr[b] : indptr[b+1]] of a CSR list (nnz entries). Both become
// a (pointer, count) pair; every id read from device memory is checked
// against the list and the cache, and an invalid one yields -1 (the caller
// masks those keys and never dereferences the page).
#pragma once
#include "dtype.cuh"

namespace mate {
namespace attn {

struct PageList {
    const int* ids;
    int count;

    // Page table row b (`indptr == nullptr`, `len` = table width) or CSR slice (`len` = nnz).
    static __device__ __forceinline__ PageList of_request(const int* list, const int* indptr, int len, int b) {
        PageList p;
        if (indptr != nullptr) {
            const int s0 = min(max(indptr[b], 0), len);
            const int s1 = min(max(indptr[b + 1], s0), len);
            p.ids = list + s0;
            p.count = s1 - s0;
        } else {
            p.ids = list + (long long)b * len;
            p.count = max(len, 0);
        }
        return p;
    }

    // Page id of logical page `i`, or -1 when `i` or the id is out of range.
    __device__ __forceinline__ int page(int i, int num_pages) const {
        if (i < 0 || i >= count) return -1;
        const int id = ids[i];
        return (id >= 0 && id < num_pages) ? id : -1;
    }
};

}  // namespace attn
}  // namespace mate
