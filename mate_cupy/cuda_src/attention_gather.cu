// Block-sparse prefill decomposed per key block ("block-stationary", docs/attention.md; row
// windows and workspace: docs/gather.md), for block lists chosen per query token: instead
// of a query tile walking the union of its queries' blocks, every (request, query window,
// KV head, block) key gathers the queries that listed the block. The host walks the
// flattened query rows in row windows [row_begin, row_end) and launches five kernels per
// row window, all sizes bounded on the host by one window's rows, nothing read back:
//
//   msa_gather_count_kernel    valid (query, slot) entries per key (atomics), and the key
//                              range of the window's requests
//   msa_gather_scan_kernel     one CTA over that key range: pair offsets per key, work items
//                              of <= kCap queries per key (item -> key, pair range), the item
//                              count; zeroes the counts and the range for the next window
//   msa_gather_scatter_kernel  the pairs (token, slot) of each key
//   msa_gather_attn_kernel     per item: K/V of the block loaded once; each warpgroup takes
//                              groups of 4 queries (64 rows = 4 x 16 heads), gathers their Q
//                              rows, S = Q K^T, a one-block softmax, O = P V (wgmma), and
//                              writes O / l (fp16) and the log2 lse to the pair's slot
//   msa_gather_merge_kernel    per (query, KV head): the valid slots combined by their lse
//
// An entry (query i of request r, KV head, slot j) is valid when its block id s is in range
// (0 <= s < the request's block count, its page valid), not a repeat of an earlier slot of
// the same list, and s * 128 < the query's causal key limit: the blocks the query-tile
// kernel (attention_fwd.cu) attends for that query. A row window takes the entries of the
// queries whose flattened row lies in [row_begin, row_end) (and i < max_q); its partials
// are indexed by row - row_begin. Keys of a window: (request, query window of the request
// counted from the first one the row window touches (< wins), KV head, block).
// Group 16 (16 query heads per KV head), D 128, page size 128 (a block is a page),
// fp16/bf16, sm_90a.
#include "common/dtype.cuh"
#include "common/mma.cuh"
#include "common/softmax.cuh"
#include "common/attention_wgmma.cuh"
#include "common/kv_pages.cuh"
#include "common/request_rows.cuh"

using namespace mate;
using namespace mate::attn;

#ifndef GATHER_DTYPE
#define GATHER_DTYPE 1
#endif

namespace gather {

template <int C> struct ElemOf { typedef bf16_t type; };
template <> struct ElemOf<0> { typedef half_t type; };
typedef ElemOf<GATHER_DTYPE>::type Elem;
constexpr int kD = 128, kBN = 128, kGroup = 16;
// The launcher (gather_launch.py) passes the work-item cap.
#ifndef GATHER_CAP
#define GATHER_CAP 512
#endif
constexpr int kCap = GATHER_CAP;  // queries per work item
constexpr int kBig = kCap / 4;  // queries of a big work item (taken first)
constexpr int kMaxWidth = 128;  // list width the merge handles (the launcher checks)
constexpr int kWGs = 3, kThreads = 128 * kWGs;
constexpr int kTileBytes = kBN * kD * 2;  // K or V of one block: 32 KB
constexpr int kQBytes = 64 * kD * 2;      // one 64-row Q tile: 16 KB
typedef ColumnBlockTile<kBN> KvTile;
typedef ColumnBlockTile<64> QTile;

// Request r's geometry, clamped to the arrays as attention_fwd.cu clamps it (query_rows,
// PageList).
struct Req {
    int q_start, Lq, Lk, nb;  // nb: blocks an entry may name
    long long qoff;
    PageList pages;
};

__device__ __forceinline__ Req request_of(int r, const int* cu_seqlens_q, const int* qo_lens, const int* kv_lens,
                                          const int* qo_offset, const int* page_list, const int* page_indptr,
                                          int page_list_len, int total_q, int nb_max) {
    Req q;
    const QueryRows rows = query_rows(cu_seqlens_q, qo_lens, total_q, r);
    q.q_start = rows.start;
    q.Lq = rows.len;
    q.Lk = max(kv_lens[r], 0);
    q.qoff = qo_offset[r];
    q.pages = PageList::of_request(page_list, page_indptr, page_list_len, r);
    q.nb = min(min((q.Lk + kBN - 1) / kBN, q.pages.count), nb_max);
    return q;
}

// Keys query i of the request attends: [0, limit).
__device__ __forceinline__ int key_limit(const Req& q, int i, int causal) {
    if (!causal) return q.Lk;
    return (int)max(0LL, min((long long)q.Lk, q.qoff + i + 1));
}

// Block id of slot j of (token t, KV head) when the entry is valid, else -1.
__device__ __forceinline__ int valid_block(const Req& q, const int* lists, long long row, int j, int i, int causal,
                                           int kv_extent) {
    const int s = lists[row + j];
    if (s < 0 || s >= q.nb || (long long)s * kBN >= key_limit(q, i, causal) || q.pages.page(s, kv_extent) < 0)
        return -1;
    for (int x = 0; x < j; ++x)
        if (lists[row + x] == s) return -1;  // listed twice: attended once
    return s;
}

// Queries [i0, i1) of the request lie in the row window (and below max_q).
struct Span {
    int i0, i1;
};

__device__ __forceinline__ Span span_of(const Req& q, int row_begin, int row_end, int max_q) {
    if (q.Lq <= 0) return {0, 0};  // (q_start is in [0, total_q] otherwise)
    return {max(0, row_begin - q.q_start), min(min(q.Lq, max_q), row_end - q.q_start)};
}

// Key of (request r, query i, KV head, block s) in a row window whose first query of r is i0:
// the query window (of `win` queries, chosen by the launcher) counts from i0's (< wins for the
// queries of one row window).
__device__ __forceinline__ long long key_of(int r, int i, int i0, int kvh, int s, int win, int wins, int hkv,
                                            int nb_max) {
    return (((long long)r * wins + (i / win - i0 / win)) * hkv + kvh) * nb_max + s;
}

// Entry e (thread (blockIdx.x, threadIdx.x) of a 256-thread grid over the window's queries of
// request blockIdx.y x hkv x width, from its first one): its key (-1 when invalid or past the
// request's queries in the window), token and slot.
struct Entry {
    long long key;
    int tok, slot;
};

__device__ __forceinline__ Entry entry_of(const Req& q, const Span& sp, const int* lists, int hkv, int width,
                                          int causal, int kv_extent, int win, int wins, int nb_max) {
    Entry x{-1, 0, 0};
    const long long e = (long long)blockIdx.x * 256 + threadIdx.x;
    const int per_q = hkv * width;
    if (e >= (long long)(sp.i1 - sp.i0) * per_q) return x;
    const int il = (int)(e / per_q), rem = (int)(e - (long long)il * per_q), kvh = rem / width, j = rem - kvh * width;
    const int i = sp.i0 + il;
    x.tok = q.q_start + i;
    x.slot = j;
    const int s = valid_block(q, lists, ((long long)x.tok * hkv + kvh) * width, j, i, causal, kv_extent);
    if (s >= 0) x.key = key_of(blockIdx.y, i, sp.i0, kvh, s, win, wins, hkv, nb_max);
    return x;
}

#define GATHER_GEOMETRY_ARGS                                                                                  \
    const int *__restrict__ block_lists, const int *__restrict__ cu_seqlens_q, const int *__restrict__ qo_lens, \
        const int *__restrict__ kv_lens, const int *__restrict__ qo_offset, const int *__restrict__ page_list,  \
        const int *__restrict__ page_indptr, int page_list_len, int kv_extent, int total_q, int hkv, int width,    \
        int causal, int max_q, int win, int wins, int nb_max, int row_begin, int row_end

#define GATHER_REQUEST(r) \
    request_of(r, cu_seqlens_q, qo_lens, kv_lens, qo_offset, page_list, page_indptr, page_list_len, total_q, nb_max)

}  // namespace gather

using namespace gather;

// Grid (ceil(min(max_q, window rows) * hkv * width / 256), B): one thread per entry of the
// window's queries of request blockIdx.y. key_range [2]: ~(first key) and the end key of the
// window's requests (atomic maxima: zero means none; the scan reads and clears them).
extern "C" __global__ void __launch_bounds__(256) msa_gather_count_kernel(GATHER_GEOMETRY_ARGS, int* counts,
                                                                           unsigned* key_range) {
    const Req q = GATHER_REQUEST(blockIdx.y);
    const Span sp = span_of(q, row_begin, row_end, max_q);
    if (blockIdx.x == 0 && threadIdx.x == 0 && sp.i1 > sp.i0) {
        const long long first = (long long)blockIdx.y * wins * hkv * nb_max;
        const long long end = first + (long long)((sp.i1 - 1) / win - sp.i0 / win + 1) * hkv * nb_max;
        atomicMax(&key_range[0], ~(unsigned)first);
        atomicMax(&key_range[1], (unsigned)end);
    }
    const Entry x = entry_of(q, sp, block_lists, hkv, width, causal, kv_extent, win, wins, nb_max);
    if (x.key >= 0) atomicAdd(&counts[x.key], 1);
}

// Items of a key with c pairs: c / kCap of kCap queries, then one of the rest. An item of at
// least kBig queries is big: big items are stored from the front of items in key order, the
// others from the back (the j-th at max_items - 1 - j), and the attention kernel takes the big
// ones first, then the others in key order, so no long item starts near the end of a window.
static_assert(0 < kBig && kBig <= kCap, "a full item is big");
__device__ __forceinline__ int big_items(int c) { return c / kCap + (c % kCap >= kBig ? 1 : 0); }
__device__ __forceinline__ int small_items(int c) {
    const int rest = c % kCap;
    return rest > 0 && rest < kBig ? 1 : 0;
}

// One CTA of 1024 threads, over tiles of 4096 keys of [first, end) (key_range; 4 consecutive
// keys per thread, loads coalesced). counts [n_keys] -> cursors (pair offsets), items
// [max_items][3] (key, first pair, end pair), n_items [3]: the item count, 0 (the attention
// kernel's work counter), the big item count; the counts and key_range are zeroed again.
// Keys outside the range have no entries (their counts stay zero, their cursors are not
// read). The host bounds hold for well-formed requests (no query in two requests); past
// them nothing is stored out of bounds.
extern "C" __global__ void __launch_bounds__(1024) msa_gather_scan_kernel(int* counts, unsigned* key_range,
                                                                          int* cursors, int* items, int* n_items,
                                                                          int n_keys, int max_items, int max_pairs) {
    __shared__ int warp_sum[3][32], carry[3];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int first = (int)min(~key_range[0], (unsigned)n_keys), end = (int)min(key_range[1], (unsigned)n_keys);
    if (tid == 0) carry[0] = carry[1] = carry[2] = 0;
    for (int base = first; base < end; base += 4096) {
        const int k0 = base + 4 * tid;
        int c[4], v[3] = {0, 0, 0};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            c[e] = k0 + e < end ? counts[k0 + e] : 0;
            v[0] += c[e];
            v[1] += big_items(c[e]);
            v[2] += small_items(c[e]);
        }
        int incl[3] = {v[0], v[1], v[2]};
#pragma unroll
        for (int off = 1; off < 32; off <<= 1)
#pragma unroll
            for (int x = 0; x < 3; ++x) {
                const int y = __shfl_up_sync(0xffffffffu, incl[x], off);
                if (lane >= off) incl[x] += y;
            }
        if (lane == 31)
#pragma unroll
            for (int x = 0; x < 3; ++x) warp_sum[x][warp] = incl[x];
        __syncthreads();
        int pos[3], tot[3];
#pragma unroll
        for (int x = 0; x < 3; ++x) {
            pos[x] = carry[x] + incl[x] - v[x];
            tot[x] = 0;
        }
        for (int w = 0; w < 32; ++w)
#pragma unroll
            for (int x = 0; x < 3; ++x) {
                pos[x] += w < warp ? warp_sum[x][w] : 0;
                tot[x] += warp_sum[x][w];
            }
        int p = pos[0], ib = pos[1], is = pos[2];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int k = k0 + e;
            if (k >= end) break;
            cursors[k] = p;
            for (int a = 0; a < c[e] && (ib < max_items || is < max_items); a += kCap) {
                const int n = min(kCap, c[e] - a);
                const int it = n >= kBig ? ib++ : max_items - 1 - is++;
                if (it >= 0 && it < max_items) {  // (pairs past max_pairs: none stored)
                    items[3 * it] = k;
                    items[3 * it + 1] = min(p + a, max_pairs);
                    items[3 * it + 2] = min(p + a + n, max_pairs);
                }
            }
            p += c[e];
            counts[k] = 0;
        }
        __syncthreads();  // warp_sum and carry are read
        if (tid == 0)
#pragma unroll
            for (int x = 0; x < 3; ++x) carry[x] += tot[x];
    }
    __syncthreads();
    if (tid == 0) {
        const int total = min(carry[1] + carry[2], max_items);
        n_items[0] = total;
        n_items[1] = 0;  // the attention kernel's work counter
        n_items[2] = min(carry[1], total);
        key_range[0] = key_range[1] = 0u;
    }
}

// Same grid as the count kernel: pairs (token, slot) in the key's range (order within a
// key is not deterministic; each pair's result does not depend on it).
extern "C" __global__ void __launch_bounds__(256) msa_gather_scatter_kernel(GATHER_GEOMETRY_ARGS, int* cursors,
                                                                            int* pair_tok, int* pair_slot,
                                                                            int max_pairs) {
    const Req q = GATHER_REQUEST(blockIdx.y);
    const Entry x = entry_of(q, span_of(q, row_begin, row_end, max_q), block_lists, hkv, width, causal, kv_extent,
                             win, wins, nb_max);
    if (x.key < 0) return;
    const int pos = atomicAdd(&cursors[x.key], 1);
    if (pos >= max_pairs) return;
    pair_tok[pos] = x.tok;
    pair_slot[pos] = x.slot;
}

// Grid: one CTA of 384 threads per SM (at most max_items), taking the n_items[0] work
// items in order (the n_items[2] big ones from the front of items, then the rest from the
// back). Partials of the window's rows:
// part_o [row_end - row_begin, hkv, width, 16, 128] fp16 (O / l),
// part_lse [row_end - row_begin, hkv, width, 16] (log2 domain), written for valid entries only.
extern "C" __global__ void __launch_bounds__(kThreads, 1) msa_gather_attn_kernel(
    GATHER_GEOMETRY_ARGS, const Elem* __restrict__ q, const Elem* __restrict__ k, const Elem* __restrict__ v,
    long long q_tok_stride, long long q_head_stride, long long k_page_stride, long long k_slot_stride,
    long long k_head_stride, long long v_page_stride, long long v_slot_stride, long long v_head_stride,
    const int* __restrict__ items, const int* __restrict__ n_items, int* __restrict__ work_counter, int max_items,
    const int* __restrict__ pair_tok, const int* __restrict__ pair_slot, half_t* __restrict__ part_o,
    float* __restrict__ part_lse, float scale_log2) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
    unsigned char* sK = smem;
    unsigned char* sV = smem + kTileBytes;
    unsigned char* sQ = smem + 2 * kTileBytes;  // [kWGs][2][kQBytes]
    const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, w = wtid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    __shared__ int next_item;
    // Persistent CTAs taking items in order from a counter (work_counter[0], zeroed by the scan):
    // the n_items[2] big ones from the front of items, then the others from the back.
    // This thread's Q rows of a group: query e = i / 2 (i = 0..7), head (wtid / 16) + 8 (i % 2),
    // 16-byte chunk wtid % 16.
    const int qrow0 = wtid >> 4, qch = wtid & 15;
    for (;;) {
        __syncthreads();  // the previous item's K/V and Q tiles are consumed; next_item is read
        if (tid == 0) {
            const int taken = atomicAdd(work_counter, 1), n_big = n_items[2];
            next_item = taken >= n_items[0] ? -1 : taken < n_big ? taken : max_items - 1 - (taken - n_big);
        }
        __syncthreads();
        const int item = next_item;
        if (item < 0) break;
        const long long key = items[3 * item];
        const int begin = items[3 * item + 1], end = items[3 * item + 2];
        const int s = (int)(key % nb_max);
        const int kvh = (int)((key / nb_max) % hkv);
        const int r = (int)(key / ((long long)nb_max * hkv * wins));
        const Req rq = GATHER_REQUEST(r);
        const int page = rq.pages.page(s, kv_extent);  // valid: the entries were checked
        {
            const Elem* kb = k + (long long)page * k_page_stride + (long long)kvh * k_head_stride;
            const Elem* vb = v + (long long)page * v_page_stride + (long long)kvh * v_head_stride;
            for (int x = tid; x < kBN * 16; x += kThreads) {
                const int row = x >> 4, ch = x & 15;
                const bool ok = s * kBN + row < rq.Lk;  // keys past the request: zeros, masked below
                cp_async_16(sK + KvTile::offset(row, ch), ok ? kb + row * k_slot_stride + ch * 8 : k, ok);
                cp_async_16(sV + KvTile::offset(row, ch), ok ? vb + row * v_slot_stride + ch * 8 : v, ok);
            }
            cp_async_commit();
        }
        const int n_grp = (end - begin + 3) >> 2;
        // Keys of the block a query (token t) attends: min(lim_a, lim_b + t) clamped to [0, 128]
        // when causal, else lim_a clamped (lim_b is clamped to [INT_MIN, 128], which keeps that).
        const int lim_a = rq.Lk - s * kBN;
        const int lim_b = (int)max(-2147483648LL, min((long long)kBN, rq.qoff - rq.q_start + 1 - (long long)s * kBN));
        // This thread's 16-byte chunk of head qrow0 of token 0 (bytes): token t's is t * q_tok_bytes
        // further, head qrow0 + 8's q_h8_bytes further.
        const char* const qh0 =
            reinterpret_cast<const char*>(q + (long long)(kvh * kGroup + qrow0) * q_head_stride + qch * 8);
        const unsigned long long q_tok_bytes = (unsigned long long)q_tok_stride * sizeof(Elem);
        const unsigned long long q_h8_bytes = (unsigned long long)q_head_stride * 8 * sizeof(Elem);
        // Tokens of group grp's four queries, loaded a group ahead of use; past the item the
        // item's last one (rows computed and never stored: no zero fill, no predicate).
        auto load_toks = [&](int grp, unsigned (&tk)[4]) {
            if (grp < n_grp)
#pragma unroll
                for (int e = 0; e < 4; ++e) tk[e] = (unsigned)pair_tok[min(begin + 4 * grp + e, end - 1)];
        };
        // Row qrow0 + 8 i of the tile is query i / 2, head qrow0 + 8 (i % 2): one address per
        // token, the second head 8 rows (8 * 128 bytes, same swizzle phase) further.
        auto load_q = [&](int grp, const unsigned (&tk)[4], int buf) {
            if (grp < n_grp) {
                unsigned char* dst = sQ + (wg * 2 + buf) * kQBytes + QTile::offset(qrow0, qch);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const char* src = qh0 + tk[e] * q_tok_bytes;
                    cp_async_16(dst + (2 * e) * 1024, src);
                    cp_async_16(dst + (2 * e + 1) * 1024, src + q_h8_bytes);
                }
            }
            cp_async_commit();
        };
        // This warp's query of a group is its w-th: its token is tk[w] of the group's tokens.
        auto warp_tok = [&](const unsigned (&tk)[4]) {
            return static_cast<int>((w & 2) ? ((w & 1) ? tk[3] : tk[2]) : ((w & 1) ? tk[1] : tk[0]));
        };
        unsigned tk_next[4] = {0u, 0u, 0u, 0u};  // (stays so when the warpgroup has no group)
        load_toks(wg, tk_next);
        load_q(wg, tk_next, 0);
        int tok_cur = warp_tok(tk_next);  // of the group the loop starts with
        load_toks(wg + kWGs, tk_next);
        cp_async_wait<0>();
        fence_proxy_async_smem();
        __syncthreads();

        const u64 k_desc = wg_desc(smem_u32(sK), 16, 1024);
        const u64 v_desc = wg_desc(smem_u32(sV), 16, 1024);
        // S = Q K^T of the group in buffer b (issued, not waited for).
        auto issue_qk = [&](float (&S)[16][4], int b) {
            const u64 q_desc = wg_desc(smem_u32(sQ + (wg * 2 + b) * kQBytes), 16, 1024);
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < kD / 16; ++ks) {
                const u32 qo = (ks >> 2) * (64 * 128) + (ks & 3) * 32;
                const u32 ko = (ks >> 2) * (kBN * 128) + (ks & 3) * 32;
                if (ks == 0)
                    WgmmaSS<kBN, Elem>::first(&S[0][0], wg_desc_add(q_desc, qo), wg_desc_add(k_desc, ko));
                else
                    WgmmaSS<kBN, Elem>::run(&S[0][0], wg_desc_add(q_desc, qo), wg_desc_add(k_desc, ko), 1);
            }
            wg_commit();
        };
        int buf = 0;
        for (int grp = wg; grp < n_grp; grp += kWGs, buf ^= 1) {
            // This warp's query (its 16 rows): its token, read with the group's Q tokens a step
            // ago, and its slot, loaded before the MMAs that hide it.
            const int pi = begin + 4 * grp + w;
            const bool live = pi < end;
            const int tok = live ? tok_cur : 0;
            const int slot = live ? pair_slot[pi] : 0;
            asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");  // the other buffer is free
            load_q(grp + kWGs, tk_next, buf ^ 1);
            tok_cur = warp_tok(tk_next);  // (group grp + kWGs, the next step's)
            load_toks(grp + 2 * kWGs, tk_next);
            cp_async_wait<1>();
            fence_proxy_async_smem();
            asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
            float S[16][4];
            issue_qk(S, buf);
            wg_wait<0>();
            wg_fence_regs<64>(&S[0][0]);
            // This warp's 16 rows are one query (its 16 heads): its key limit inside the block.
            const int lim_q = lim_b >= kBN - tok ? kBN : lim_b + tok;  // (no overflow either way)
            const int lim = live ? max(0, min(kBN, causal ? min(lim_a, lim_q) : lim_a)) : 0;
            if (lim < kBN) {
    #pragma unroll
                for (int n = 0; n < 16; ++n)
    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (8 * n + 2 * t + (e & 1) >= lim) S[n][e] = kNegInf;
            }
            // One block per row: a one-shot softmax (row max over the 128 keys, no rescaling).
            float m[2], l[2];
    #pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = kNegInf;
    #pragma unroll
                for (int n = 0; n < 16; ++n) mx = fmaxf(mx, fmaxf(S[n][2 * h], S[n][2 * h + 1]));
                mx = quad_max(mx);
                const float ms = (mx == kNegInf) ? 0.f : mx * scale_log2;
                float sum = 0.f;
    #pragma unroll
                for (int n = 0; n < 16; ++n)
    #pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = fast_exp2(fmaf(S[n][2 * h + e], scale_log2, -ms));
                        S[n][2 * h + e] = p;
                        sum += p;
                    }
                m[h] = mx;
                l[h] = sum;
            }
            u32 pa[8][4];
    #pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                pa[kk][0] = pack2<Elem>(S[2 * kk][0], S[2 * kk][1]);
                pa[kk][1] = pack2<Elem>(S[2 * kk][2], S[2 * kk][3]);
                pa[kk][2] = pack2<Elem>(S[2 * kk + 1][0], S[2 * kk + 1][1]);
                pa[kk][3] = pack2<Elem>(S[2 * kk + 1][2], S[2 * kk + 1][3]);
            }
            float O[16][4];
            wg_fence_regs<32>(&pa[0][0]);
            wg_fence();
    #pragma unroll
            for (int kk = 0; kk < 8; ++kk)
    #pragma unroll
                for (int cb = 0; cb < 2; ++cb) {
                    const u64 vd = wg_desc_add(v_desc, cb * (kBN * 128) + kk * 2048);
                    if (kk == 0)
                        WgmmaRS<64, Elem>::first(&O[8 * cb][0], pa[kk], vd);
                    else
                        WgmmaRS<64, Elem>::run(&O[8 * cb][0], pa[kk], vd, 1);
                }
            wg_commit();
            wg_wait<0>();
            wg_fence_regs<64>(&O[0][0]);
            if (!live) continue;  // (warp-uniform: one query per warp)
            // O / l as fp16 through the bytes of this warp's own (consumed) Q rows: 2 x 2 KB, head
            // row r at piece r / 8, row r % 8, 16-byte chunk n at n ^ (r & 7); then one contiguous
            // 4 KB store (the slot's 16 heads x 128 values are adjacent in part_o).
            const long long base = (((long long)(tok - row_begin) * hkv + kvh) * width + slot) * kGroup;
            unsigned char* const mine = sQ + (wg * 2 + buf) * kQBytes + w * 2048;
            auto stg_row = [&](int row) { return mine + (row >> 3) * (64 * 128) + (row & 7) * 256; };
            // Row g + 8 h, chunk n = 8 a + b at mine + h * 8192 + g * 256 + a * 128 + (b ^ g) * 16:
            // one chunk offset per b for both rows and both halves.
            unsigned char* const mine_g = mine + g * 256 + 4 * t;
            float inv[2];
    #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float lt = quad_sum(l[h]);
                inv[h] = lt > 0.f ? 1.f / lt : 0.f;
                if (t == 0) part_lse[base + g + 8 * h] = lt > 0.f ? m[h] * scale_log2 + __log2f(lt) : kNegInf;
            }
    #pragma unroll
            for (int b = 0; b < 8; ++b) {
                unsigned char* const col = mine_g + ((b ^ g) << 4);
    #pragma unroll
                for (int h = 0; h < 2; ++h)
    #pragma unroll
                    for (int a = 0; a < 2; ++a)
                        *reinterpret_cast<u32*>(col + h * 8192 + a * 128) =
                            pack2<half_t>(O[8 * a + b][2 * h] * inv[h], O[8 * a + b][2 * h + 1] * inv[h]);
            }
            __syncwarp();
            uint4* dst = reinterpret_cast<uint4*>(part_o + base * kD);
    #pragma unroll
            for (int x = 0; x < 8; ++x) {
                const int c = lane + 32 * x, row = c >> 4, cc = c & 15;
                dst[c] = *reinterpret_cast<const uint4*>(stg_row(row) + ((cc ^ (row & 7)) << 4));
            }
        }
    }
}

// Grid (min(max_q, window rows), hkv, B), 128 threads: (head = tid / 8, 16 columns), the
// window's queries of request blockIdx.z from its first one. out [total_q, Hq, 128]
// (strided), lse [total_q, Hq] natural log or null; queries with no valid entry get O = 0,
// lse = -inf.
extern "C" __global__ void __launch_bounds__(128) msa_gather_merge_kernel(
    GATHER_GEOMETRY_ARGS, const half_t* __restrict__ part_o, const float* __restrict__ part_lse, Elem* __restrict__ out,
    float* __restrict__ lse, long long out_tok_stride, long long out_head_stride) {
    __shared__ unsigned char slot_ok[kMaxWidth];
    const int kvh = blockIdx.y, r = blockIdx.z;
    const Req q = GATHER_REQUEST(r);
    const Span sp = span_of(q, row_begin, row_end, max_q);
    const int i = sp.i0 + blockIdx.x;
    if (i >= sp.i1) return;
    const int tok = q.q_start + i;
    const int head = threadIdx.x >> 3, c0 = (threadIdx.x & 7) * 16;
    const long long list_row = ((long long)tok * hkv + kvh) * width;
    const long long row = ((long long)(tok - row_begin) * hkv + kvh) * width;  // of the window's partials
    for (int j = threadIdx.x; j < width; j += 128)
        slot_ok[j] = valid_block(q, block_lists, list_row, j, i, causal, kv_extent) >= 0 ? 1 : 0;
    __syncthreads();
    float M = kNegInf;
    for (int j = 0; j < width; ++j)
        if (slot_ok[j]) M = fmaxf(M, part_lse[(row + j) * kGroup + head]);
    float acc[16], den = 0.f;
#pragma unroll
    for (int e = 0; e < 16; ++e) acc[e] = 0.f;
    if (M != kNegInf) {
        for (int j = 0; j < width; ++j) {
            if (!slot_ok[j]) continue;
            const float ls = part_lse[(row + j) * kGroup + head];
            if (ls == kNegInf) continue;
            const float wj = fast_exp2(ls - M);
            den += wj;
            const uint4* src = reinterpret_cast<const uint4*>(part_o + ((row + j) * kGroup + head) * kD + c0);
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const uint4 vv = src[x];
                const u32 ws[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&ws[e]));
                    acc[8 * x + 2 * e] += wj * f.x;
                    acc[8 * x + 2 * e + 1] += wj * f.y;
                }
            }
        }
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
    const int qh = kvh * kGroup + head;
    vec16 pk[2];
#pragma unroll
    for (int x = 0; x < 2; ++x)
#pragma unroll
        for (int e = 0; e < 4; ++e) pk[x].w[e] = pack2<Elem>(acc[8 * x + 2 * e] * inv, acc[8 * x + 2 * e + 1] * inv);
    vec16* dst = reinterpret_cast<vec16*>(out + (long long)tok * out_tok_stride + (long long)qh * out_head_stride + c0);
    dst[0] = pk[0];
    dst[1] = pk[1];
    if (lse != nullptr && (threadIdx.x & 7) == 0)
        lse[(long long)tok * hkv * kGroup + qh] = den > 0.f ? (M + __log2f(den)) * 0.69314718055994531f : kNegInf;
}
