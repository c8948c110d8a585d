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

// Keys of a 128-key tile on invalid pages become -inf. flag_word: this lane's validity bytes
// of keys 4 lane .. 4 lane + 3 (0: invalid); S [kNT][4] as in mask_scores (one m-tile).
template <int kNT>
__device__ __forceinline__ void mask_flagged_keys(float (&S)[kNT][4], u32 flag_word, int t4) {
    static_assert(kNT == 16, "a 128-key tile: 32 lanes of 4 keys");
    // by[e] bit l: key 4 l + e is valid. Lane t4 holds keys 8 n + 2 t4 + e = 4 (2 n + t4 / 2) + 2 (t4 % 2) + e.
    u32 by[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) by[e] = __ballot_sync(0xffffffffu, (flag_word >> (8 * e)) & 0xffu);
    const int odd = t4 & 1, sh = t4 >> 1;
    const u32 w0 = (odd ? by[2] : by[0]) >> sh, w1 = (odd ? by[3] : by[1]) >> sh;
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
        if (!((w0 >> (2 * n)) & 1u)) S[n][0] = S[n][2] = kNegInf;
        if (!((w1 >> (2 * n)) & 1u)) S[n][1] = S[n][3] = kNegInf;
    }
}

}  // namespace attn
}  // namespace mate
