// A request's query rows in a varlen batch, clamped to the q array.
#pragma once

namespace mate {
namespace attn {

// Request b's rows [start, start + len) of q [total_q, ...]: none when cu_seqlens_q[b]
// lies outside [0, total_q], and never past total_q (or below a length of 0).
struct QueryRows {
    int start, len;
};

__device__ __forceinline__ QueryRows query_rows(const int* cu_seqlens_q, const int* qo_lens, int total_q, int b) {
    const int start = cu_seqlens_q[b], len = qo_lens[b];
    return {start, (start < 0 || start > total_q) ? 0 : max(0, min(len, total_q - start))};
}

}  // namespace attn
}  // namespace mate
