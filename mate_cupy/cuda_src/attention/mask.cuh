// Masking of the attention forward kernel's scores.
//
// A CTA row is a (query, head) pair; its local query index ql (0xff: a padding row) is
// one byte of a packed u32 (byte 2 * mt + h: m-tile mt, accumulator half h, i.e. rows g
// and g + 8 of the m16n8 layout). A row of query ql attends keys j < limit(ql): every key
// of the request, or, causal, the keys up to its position (bottom-right aligned through
// qo_offset). Keys on pages the page table marks invalid, and blocks a row's query did
// not select (block-sparse), are masked too.
#pragma once
#include "../common/dtype.cuh"
#include "../common/softmax.cuh"

namespace mate {
namespace attn {

// Key limit of each local query of a CTA: keys j < (*this)(ql).
struct RowLimits {
    int base;  // limit of local query 0 before clamping (causal): qo_offset + first query + 1
    int keys;  // keys of the request
    bool causal;
    __device__ __forceinline__ int operator()(int ql) const { return causal ? min(keys, max(0, base + ql)) : keys; }
};

// S [kMT][kNT][4]: one warp's raw scores of keys kw0 .. kw0 + 8 * kNT - 1 (lane t4 holds
// keys kw0 + 8 n + 2 t4 + {0, 1}); entries a row may not attend become -inf.
// row_qls: the rows' local queries; member bit 2 * mt + h: the row's query selected this
// block (all set when not block-sparse). page_valid: null when every key of the tile sits
// on a valid page, else one byte per key of the tile starting at key kstart (0: invalid).
template <int kMT, int kNT>
__device__ __forceinline__ void mask_scores(float (&S)[kMT][kNT][4], u32 row_qls, u32 member, const RowLimits& limit,
                                            int kw0, int t4, const unsigned char* page_valid, int kstart) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int i = 2 * mt + h;
            const int ql = (row_qls >> (8 * i)) & 0xff;
            const int lim = (ql != 0xff && ((member >> i) & 1u)) ? limit(ql) : 0;
#pragma unroll
            for (int n8 = 0; n8 < kNT; ++n8) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int j = kw0 + n8 * 8 + 2 * t4 + e;
                    bool ok = j < lim;
                    if (page_valid != nullptr) ok = ok && page_valid[j - kstart] != 0;
                    if (!ok) S[mt][n8][2 * h + e] = kNegInf;
                }
            }
        }
    }
}

}  // namespace attn
}  // namespace mate
