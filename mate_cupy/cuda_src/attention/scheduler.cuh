// Static persistent tile scheduler of the warp-specialised attention mainloop
// (mainloop_sm90.cuh): the order in which its CTAs walk the work items.
//
// A work item is one row tile of kM packed rows of a request and one (KV head, split) of its
// keys. The CTAs of a persistent grid walk the items in waves of gridDim.x, waves
// alternating direction (CTA c takes item c of wave 0, the c-th lightest of wave 1, ...).
// Item i lies in an L2 section of `section` consecutive (request, KV head, split) triples
// whose K/V the host sized to stay in L2 together (attention_launch.l2_section); inside a
// section the heaviest row tiles (causal: the last rows, which see the most keys) come
// first, then the triple. An item's keys are the key tiles of kBN keys its rows may attend,
// shared out among its request's splits.
#pragma once
#include "../common/dtype.cuh"
#include "../common/request_rows.cuh"

namespace mate {
namespace attn {

// kDenseKeys: a request's keys are rows cu_seqlens_k[b] .. of one dense array of kv_extent
// rows (else pages, whose bounds the loads check).
template <int kM, int kBN, bool kDenseKeys>
struct PersistentScheduler {
    // One work item: row tile, request and (KV head, split) of a CTA in the non-persistent
    // grid. The mainloop's producer derives it from the item index and hands it to the
    // consumers in shared memory with the item's Q tile (n_count < 0: no more items).
    // kend: keys any row may attend; nq: queries whose lists make the union (sparse).
    struct Item {
        long long k_row0, qoff;
        int row0, q_start, rows_total, Lk, qi_first, kvh, split, t_begin, n_count, b, kend, nq;
    };
    // Item i. The (request, KV head, split) triples run in L2 sections of `section`
    // consecutive triples, whose K/V the host sized to stay in L2 together; inside a section
    // the heaviest row tiles come first (row tile index reversed), then the triple. False
    // when the row tile lies past the request.
    static __device__ __forceinline__ bool item_at(long long i, int row_tiles, int batch, int heads_splits,
                                                   int num_splits, int section, const int* __restrict__ cu_seqlens_q,
                                                   const int* __restrict__ qo_lens, const int* __restrict__ kv_lens,
                                                   const int* __restrict__ qo_offset,
                                                   const int* __restrict__ cu_seqlens_k, int total_q, int kv_extent,
                                                   int group, int causal, int nq_cap, Item& it) {
        const long long n_triples = (long long)batch * heads_splits;
        const long long per_section = (long long)section * row_tiles;
        const long long sec = i / per_section;
        const long long first = sec * section;
        const int width = (int)min((long long)section, n_triples - first);
        const long long r = i - sec * per_section;
        const int rt = (int)(r / width);
        const long long triple = first + (r - (long long)rt * width);
        const int b = (int)(triple / heads_splits), z = (int)(triple - (long long)b * heads_splits);
        it.kvh = z / num_splits;
        it.split = z - it.kvh * num_splits;
        it.row0 = (row_tiles - 1 - rt) * kM;
        const QueryRows qr = query_rows(cu_seqlens_q, qo_lens, total_q, b);
        it.q_start = qr.start;
        it.rows_total = qr.len * group;
        it.b = b;
        if (it.row0 >= it.rows_total) return false;
        int Lk = max(kv_lens[b], 0);
        it.k_row0 = 0;
        if constexpr (kDenseKeys) {
            const int ks = cu_seqlens_k[b];
            if (ks < 0 || ks > kv_extent) {
                Lk = 0;
            } else {
                Lk = min(Lk, kv_extent - ks);
                it.k_row0 = ks;
            }
        }
        it.Lk = Lk;
        it.qoff = qo_offset[b];
        it.qi_first = it.row0 / group;
        const int qi_last = min(qr.len - 1, (it.row0 + kM - 1) / group);
        it.kend = causal ? (int)max(0LL, min((long long)Lk, it.qoff + qi_last + 1)) : Lk;
        it.nq = min(qi_last - it.qi_first + 1, nq_cap);
        split_tiles((it.kend + kBN - 1) / kBN, num_splits, it);
        return true;
    }
    // The item's share of n_tiles key tiles.
    static __device__ __forceinline__ void split_tiles(int n_tiles, int num_splits, Item& it) {
        const int per_split = (n_tiles + num_splits - 1) / num_splits;
        it.t_begin = min(n_tiles, it.split * per_split);
        it.n_count = min(n_tiles, it.t_begin + per_split) - it.t_begin;
    }

    // Item index of this CTA in wave w (may lie past the last item).
    static __device__ __forceinline__ long long wave_item(long long w) {
        return w * gridDim.x + ((w & 1) ? (long long)gridDim.x - 1 - blockIdx.x : (long long)blockIdx.x);
    }
};

}  // namespace attn
}  // namespace mate
