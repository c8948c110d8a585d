// Warp-specialised Hopper mainloop of the attention forward over dense, paged or
// block-sparse KV (sm_90a, fp16/bf16).
//
// A CTA of three warpgroups owns 128 packed rows (GQA: row P = query * group + head in
// group) of one request and KV head, like the other query tiles:
//
//   warpgroup 0, the producer (setmaxnreg down), streams K and V tiles of kBN keys into a
//     kStages-deep ring. Each stage has a "full" mbarrier per operand and an "empty" one the
//     consumer warps arrive on once their MMAs have read the stage (lane 0 of each warp;
//     every consumer thread on a paged K stage, since each read its key flags). K and V have
//     their own barriers: K of tile n is loaded before V of tile n - 1, the order the
//     consumers read them in.
//     Dense and paged KV (produce_tma): one warp; tiles inside the request arrive by TMA
//     boxes (cp.async.bulk.tensor) completing the stage's transaction count, the Q tile
//     too where the group divides kM; a request's partial last tile (and pages under 8
//     keys) by the warp's cp.async, zero-filled past the request. Paged: the tile's pages
//     are looked up a tile ahead, one per lane; keys on invalid pages are zero-filled and
//     flagged (one byte per key of the stage; each lane arrives on the K barrier after
//     writing its four), and the consumers mask them.
//     Block-sparse KV: 128 threads; before each item they build the ascending union of the
//     128-key blocks its queries selected (block_union.cuh; the query membership bits
//     double-buffered by item), walk it tile by tile (warp 0: a TMA box per column block, or
//     16-byte cp.async for a block reaching past the request) and publish each K tile's first
//     key with the stage;
//     the consumers mask the blocks a row's query did not select.
//   warpgroups 1 and 2, the consumers (setmaxnreg up): 64 rows each, S = Q K^T with both
//     operands in shared memory, O += P V with P from registers (attention_wgmma.cuh).
//     Inside a warpgroup the product of the next tile overlaps the softmax of the
//     current one (FlashAttention-3): iteration n issues S_n = Q K_n^T and then
//     O += P_{n-1} V_{n-1} (O rescaled first), waits for S_n only, masks it and runs the
//     online softmax while the PV product is in flight, then waits for it and packs P_n.
//     Between the warpgroups the issue sections (the MMAs of one iteration) alternate
//     through two named barriers, so one warpgroup's softmax runs under the other's MMAs;
//     the alternation runs on across items, so one warpgroup starts the next item while
//     the other drains the current one.
//
// The CTA is persistent: it walks work items (row tile, request, KV head and split) in a
// static order (scheduler.cuh), in L2 sections of (request, KV head, split) triples whose K/V
// fit in L2 together and heaviest row tiles first within a section, and the producer runs ahead into
// the next item: it prefetches the next Q tile's rows into L2 as soon as it reaches the item,
// loads the tile (one buffer, with its own full/empty mbarriers) once the consumers' last
// Q K^T of the current item has completed, then that item's K/V tiles.
// Causal items walk only the key tiles their rows can see ([0, kend)); rows past a query's
// limit are masked where a warp's rows need it (mask.cuh). Keys past the request are
// zero-filled (never NaN garbage under a zero weight). The epilogue normalises in
// registers and stores straight from them (split-KV: f32 partials).
#pragma once
#include "../common/dtype.cuh"
#include "../common/mma.cuh"
#include "../common/attention_tile.cuh"
#include "../common/attention_wgmma.cuh"
#include "../common/softmax.cuh"
#include "../common/request_rows.cuh"
#include "../common/kv_pages.cuh"
#include "../common/block_union.cuh"
#include "../common/warp_specialized.cuh"
#include "../common/tma.cuh"
#include "mask.cuh"
#include "scheduler.cuh"
#include "epilogue.cuh"

namespace mate {
namespace attn {

// Block-sparse lists of the current kernel call and their shared-memory homes.
struct SparseLists {
    const int* lists;  // [total_q, Hkv, width] block ids
    int width, nq_cap, qwords;
    int* ulist;        // [nq_cap * width] the union's block ids (producer only)
    int* upage;        // [nq_cap * width] their page ids (producer only)
    u32* qmask;        // 2 x [nq_cap][qwords]: membership, by item parity
    u32* scratch;      // 2 x union_words: bitmap and prefix of the union build
    int union_words;   // blocks a union can hold / 32 (the plan's longest request)
};

// Shared bytes of a warp-specialised tile's mbarriers (full/empty x K/V x stages, Q
// full/empty), work item (80), per-stage K metadata (paged: a validity byte per key of
// 128; sparse: the first key) and the union build's warp totals (16); mirrored by
// attention_launch.ws_bar_bytes.
constexpr int ws_bar_bytes(int stages, int kv) {
    return 4 * stages * 8 + 16 + 80 + (kv == 1 ? stages * 128 : kv == 2 ? 4 * stages : 0) + 16;
}

// kKv: 0 dense, 1 paged, 2 block-sparse (128-key blocks on pages of 128); kRegs: the
// producer's and the consumers' registers per thread, producer * 1000 + consumer.
template <int kD, int kBN, int kStages, typename Elem, int kKv, int kRegs>
struct MainloopSm90 {
    static constexpr bool kPaged = kKv == 1;
    static constexpr bool kSparse = kKv == 2;
    static constexpr int kBarProducer = 3;  // named barrier of the producer warpgroup
    static constexpr int kM = 128;  // rows per CTA: two consumer warpgroups of 64
    static constexpr int kThreads = 384;
    // Registers per thread after setmaxnreg (the host's choice, attention_launch.WS_REGISTERS).
    static constexpr int kProducerRegs = kRegs / 1000, kConsumerRegs = kRegs % 1000;
    static_assert(setmaxnreg_fits(kThreads, 2, kProducerRegs, kConsumerRegs),
                  "setmaxnreg: multiples of 8 within the launch allocation");
    static constexpr int kRowBytes = kD * 2;
    static constexpr int kChunks = kRowBytes / 16;  // 16-byte chunks per row
    static constexpr int kNT = kBN / 8;             // S n-tiles per warp
    static constexpr int kDT = kD / 8;              // O n-tiles per warp
    static constexpr int kTileBytes = kBN * kRowBytes;
    static constexpr int kStageBytes = 2 * kTileBytes;  // K then V
    // full/empty x K/V x stages, Q full/empty, then the current item's geometry (Item), then
    // per stage (paged) one page-validity byte per key of its K tile or (sparse) its K tile's
    // first key.
    static constexpr int kItemOffset = 4 * kStages * 8 + 16;
    static constexpr int kItemBytes = 80;
    static constexpr int kKeyFlagOffset = kItemOffset + kItemBytes;
    static constexpr int kWarpTotalOffset = kKeyFlagOffset + (kPaged ? kStages * kBN : kSparse ? 4 * kStages : 0);
    static constexpr int kBarBytes = kWarpTotalOffset + 16;
    static_assert(kBarBytes == ws_bar_bytes(kStages, kKv) && kItemBytes == 80 && kBN == 128, "host's layout");
    static constexpr u32 kAllKeysValid = 0x01010101u;  // a flag word of four valid keys
    // Arrivals that complete a stage's full barrier (every count is met the same way by a tile
    // loaded by TMA boxes, whose bytes complete the transaction count, and by a tile of cp.async,
    // each lane's copies arriving once by cp.async.mbarrier.arrive.noinc):
    //   K and V tiles: 32 lanes' copies + lane 0 after its writes of the stage's metadata; boxes:
    //     lane 0 arrives for all of them after raising the transaction count;
    //   paged K: per lane, its copies + its own arrival after writing its key-flag word; boxes:
    //     each lane arrives twice after its flag word.
    static constexpr int kTileArrivals = 33, kPagedKArrivals = 64;
    // The Q barrier (Q tile and item slot): as a K/V tile for the TMA producer warp; block-sparse,
    // per producer thread its copies + its arrival after its membership writes (boxes: each
    // thread arrives twice, thread 0 after raising the transaction count).
    static constexpr int kQArrivals = kSparse ? 256 : 33;
    struct TileMeta {
        int kstart;  // first key of the tile
        u32 word;    // paged: this lane's key flag word; sparse: the rows' membership bits
    };
    // Named barriers: 1 + w: consumer warpgroup w's issue turn.
    static constexpr int kBarTurn = 1;
    typedef ColumnBlockTile<kM> QTile;
    typedef ColumnBlockTile<kBN> KvTile;
    static_assert(kD == 64 || kD == 128, "head dim");
    static_assert(kBN == 128, "keys per tile: one 4-key flag word per lane");
    static_assert(kStages >= 2 && kStages <= 4, "pipeline depth");
    static_assert(128 % kChunks == 0 && kBN % (128 / kChunks) == 0, "K/V tile loads cover whole rows per pass");
    static_assert((128 / kChunks) % 8 == 0, "a producer thread's rows share one swizzle phase");

    typedef PersistentScheduler<kM, kBN, kKv == 0> Scheduler;
    typedef typename Scheduler::Item Item;
    static_assert(sizeof(Item) <= kItemBytes, "item slot");

    // The item's Q tile at (q_head, q_tok) as kD / 64 TMA boxes of (64 columns, group heads,
    // kM / group queries): into L2, or into sQ with the tile's bytes on q_full, then
    // `arrivals` arrivals on it.
    static __device__ __forceinline__ void prefetch_q_boxes(const TensorMap* q_map, int q_head, int q_tok) {
#pragma unroll
        for (int cb = 0; cb < kD / 64; ++cb) tma_prefetch_3d(q_map, cb * 64, q_head, q_tok);
    }
    static __device__ __forceinline__ void load_q_boxes(const TensorMap* q_map, u32 sQ, int q_head, int q_tok,
                                                        u32 q_full, u32 arrivals) {
        mbar_expect_tx(q_full, kM * kRowBytes);
#pragma unroll
        for (int cb = 0; cb < kD / 64; ++cb)
            tma_load_3d(sQ + cb * QTile::kBlockBytes, q_map, cb * 64, q_head, q_tok, q_full);
        mbar_arrive_n(q_full, arrivals);
    }

    // The producer of dense and paged K/V: one warp (the producer warpgroup's others exit).
    // Each K/V tile of kBN keys whose keys all lie in the request is loaded by the tensor
    // memory accelerator: dense, lane 0 issues kD / 64 boxes of (64 columns, 1 head, kBN
    // keys); paged (pages of at least 8 keys), lane j issues the boxes of (64 columns, 1 head,
    // min(page, kBN) slots, 1 page) of the tile's j-th page, at page -1 (zero-filled) where
    // the page id is invalid, after lane 0 raised the stage's transaction count by the tile's
    // bytes. The boxes land in the 128-byte-swizzled ColumnBlockTile layout. Any other tile
    // (the request's last, when it is partial: the next request's rows or memory no request
    // owns lie past it; pages under 8 keys) is copied by the warp's cp.async, zero-filled
    // past the request and on invalid pages. Paged K stages also carry a validity byte per
    // key; each lane arrives after writing its keys' bytes. The Q tile is one box of
    // (64 columns, group heads, kM / group queries) per column block where the packed rows
    // are whole queries (kM % group == 0; its rows past the request are not stored), else
    // the warp's cp.async rows. Maps (host: mate_cupy.msa.attention_launch.tensor_maps): q
    // [total_q, Hq, D]; k/v dense [rows, Hkv, D], paged [pages, page, Hkv, D] as
    // (D, Hkv, page, pages) whatever the layout's strides.
    template <typename ItemAt>
    static __device__ __forceinline__ void produce_tma(
        ItemAt item, long long n_items, const TensorMap* q_map, const TensorMap* k_map, const TensorMap* v_map,
        const Elem* __restrict__ q, long long q_tok_stride, long long q_head_stride, const Elem* __restrict__ k,
        const Elem* __restrict__ v, long long k_page_stride, long long k_slot_stride, long long k_head_stride,
        long long v_page_stride, long long v_slot_stride, long long v_head_stride, int group, int kv_extent,
        int page_size_log2, const int* __restrict__ page_list, const int* __restrict__ page_indptr,
        int page_list_len, u32 sQ, u32 sKV, u32 full_k, u32 full_v, u32 empty_k, u32 empty_v, u32 q_full,
        u32 q_empty, Item* slot, unsigned char* key_flags) {
        const int lane = threadIdx.x & 31;
        const bool q_boxes = kM % group == 0;
        // Paged: slots per box (<= kBN) and boxes (pages) per tile; pages under 8 slots (the
        // host's WS_MIN_BOX_PAGE), and a cache without pages (no map: every key is on an invalid
        // page), take cp.async.
        const int box_log2 = kPaged ? min(page_size_log2, 7) : 7;
        const int n_boxes = kBN >> box_log2;
        const bool page_boxes = !kPaged || (page_size_log2 >= 3 && kv_extent > 0);
        const int slot_mask = kPaged ? (1 << page_size_log2) - 1 : 0;
        if (lane == 0) {
            if (q_boxes) tma_prefetch_map(q_map);
            if (page_boxes) {
                tma_prefetch_map(k_map);
                tma_prefetch_map(v_map);
            }
        }
        constexpr int kLaneRows = 32 / kChunks;  // rows between a lane's cp.async chunks
        const int c = lane % kChunks;
        int kv_n = 0, q_n = 0;
        for (long long w = 0; w * gridDim.x < n_items; ++w) {
            Item it;
            if (!item(w, it)) continue;
            const int q_tok = it.q_start + it.qi_first, q_head = it.kvh * group;
            // The item's Q rows into L2: the load below waits for the consumers' last Q K^T of
            // the previous item.
            if (q_boxes && lane == 0) prefetch_q_boxes(q_map, q_head, q_tok);
            PageList pages{nullptr, 0};
            if constexpr (kPaged) pages = PageList::of_request(page_list, page_indptr, page_list_len, it.b);
            mbar_wait(q_empty, (q_n & 1) ^ 1);
            if (lane == 0) *slot = it;
            if (q_boxes) {
                if (lane == 0) load_q_boxes(q_map, sQ, q_head, q_tok, q_full, kQArrivals);
            } else {
                for (int r = lane / kChunks; r < kM; r += kLaneRows) {
                    const int P = it.row0 + r;
                    const bool ok = P < it.rows_total;
                    const int qi = ok ? P / group : 0, h = ok ? P - qi * group : 0;
                    cp_async_16_u32(sQ + QTile::offset(r, c),
                                    q + (long long)(it.q_start + qi) * q_tok_stride +
                                        (long long)(q_head + h) * q_head_stride + c * 8,
                                    ok);
                }
                cp_async_mbar_arrive_noinc(q_full);
                if (lane == 0) mbar_arrive(q_full);  // after the slot write
            }
            ++q_n;
            const Elem* kb = k + (long long)it.kvh * k_head_stride;
            const Elem* vb = v + (long long)it.kvh * v_head_stride;
            // Whether tile t is loaded by boxes, and (paged) this lane's page of its boxes: the
            // page id of box `lane`, -1 when invalid (looked up a tile ahead).
            auto by_boxes = [&](int t) { return page_boxes && (t + 1) * kBN <= it.Lk; };
            auto box_page = [&](int t) -> int {
                if (!kPaged || lane >= n_boxes || !by_boxes(t)) return -1;
                return pages.page((t * kBN + (lane << box_log2)) >> page_size_log2, kv_extent);
            };
            // Tile t of K or V (base: the item's KV head; page and slot strides) into the stage at
            // dst, completing on `full`; flags: the stage's key validity bytes (paged K).
            auto load_tile = [&](const TensorMap* map, const Elem* base, long long page_stride, long long stride,
                                 int t, int pid, u32 dst, u32 full, unsigned char* flags) {
                const int kstart = t * kBN;
                if (by_boxes(t)) {
                    if constexpr (kPaged) {
                        if (lane == 0) mbar_expect_tx(full, kTileBytes);
                        __syncwarp();
                        if (lane < n_boxes) {
                            const int key0 = kstart + (lane << box_log2);
#pragma unroll
                            for (int cb = 0; cb < kD / 64; ++cb)
                                tma_load_4d(dst + cb * KvTile::kBlockBytes + (lane << box_log2) * 128, map, cb * 64,
                                            it.kvh, key0 & slot_mask, pid, full);
                        }
                        if (flags != nullptr) {
                            // (each lane arrives twice after writing its flags: kPagedKArrivals)
                            const int owner = __shfl_sync(0xffffffffu, pid, (4 * lane) >> box_log2);
                            reinterpret_cast<u32*>(flags)[lane] = owner >= 0 ? kAllKeysValid : 0u;
                            mbar_arrive_n(full, 2);
                        } else {
                            __syncwarp();
                            if (lane == 0) mbar_arrive_n(full, kTileArrivals);
                        }
                    } else if (lane == 0) {
                        mbar_expect_tx(full, kTileBytes);
#pragma unroll
                        for (int cb = 0; cb < kD / 64; ++cb)
                            tma_load_3d(dst + cb * KvTile::kBlockBytes, map, cb * 64, it.kvh,
                                        (int)(it.k_row0 + kstart), full);
                        mbar_arrive_n(full, kTileArrivals);
                    }
                    return;
                }
                // The key's row, or nullptr past the request or on an invalid page.
                auto row = [&](int key) -> const Elem* {
                    if (key >= it.Lk) return nullptr;
                    if constexpr (kPaged) {
                        const int pg = pages.page(key >> page_size_log2, kv_extent);
                        return pg < 0 ? nullptr : base + pg * page_stride + (long long)(key & slot_mask) * stride;
                    }
                    return base + (it.k_row0 + key) * stride;
                };
                for (int r = lane / kChunks; r < kBN; r += kLaneRows) {
                    const Elem* src = row(kstart + r);
                    cp_async_16_u32(dst + KvTile::offset(r, c), (src != nullptr ? src : base) + c * 8, src != nullptr);
                }
                cp_async_mbar_arrive_noinc(full);
                if (flags != nullptr) {
                    u32 word = 0;
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = kstart + 4 * lane + e;
                        word |= (key >= it.Lk || row(key) != nullptr ? 1u : 0u) << (8 * e);
                    }
                    reinterpret_cast<u32*>(flags)[lane] = word;
                    mbar_arrive(full);
                } else if (lane == 0) {
                    mbar_arrive(full);
                }
            };
            // K of tile n, then V of tile n - 1 (the order the consumers read them in). Paged:
            // the box pages of tile n + 1 are looked up before tile n waits for its stage.
            int pid_prev = -1, pid_cur = it.n_count > 0 ? box_page(it.t_begin) : -1;
            for (int n = 0; n <= it.n_count; ++n) {
                const int pid_next = n + 1 < it.n_count ? box_page(it.t_begin + n + 1) : -1;
                if (n < it.n_count) {
                    const int g = kv_n + n, s = g % kStages;
                    mbar_wait(empty_k + 8 * s, ((g / kStages) & 1) ^ 1);
                    load_tile(k_map, kb, k_page_stride, k_slot_stride, it.t_begin + n, pid_cur, sKV + s * kStageBytes,
                              full_k + 8 * s, kPaged ? key_flags + s * kBN : nullptr);
                }
                if (n >= 1) {
                    const int g = kv_n + n - 1, s = g % kStages;
                    mbar_wait(empty_v + 8 * s, ((g / kStages) & 1) ^ 1);
                    load_tile(v_map, vb, v_page_stride, v_slot_stride, it.t_begin + n - 1, pid_prev,
                              sKV + s * kStageBytes + kTileBytes, full_v + 8 * s, nullptr);
                }
                pid_prev = pid_cur;
                pid_cur = pid_next;
            }
            kv_n += it.n_count;
        }
        // No more items.
        mbar_wait(q_empty, (q_n & 1) ^ 1);
        if (lane == 0) {
            slot->n_count = -1;
            mbar_arrive_n(q_full, kQArrivals);
        }
        cp_async_wait_all();  // nothing in flight when the warp exits
    }

    // Persistent: the CTAs walk the items of row_tiles x batch x (Hkv * splits) in waves of
    // gridDim.x items (scheduler.cuh; section: triples per L2 section).
    // sQ, sKV: shared addresses of the Q tile and the ring (1024-byte aligned); bars: kBarBytes
    // of shared memory (8-byte aligned) at the generic pointer bars_ptr: the item slot at
    // kItemOffset, the key flags at kKeyFlagOffset. kv_extent: rows of k (dense) or pages of
    // the cache (paged; page_list/page_indptr/page_list_len as PageList::of_request).
    template <typename OutT>
    static __device__ __forceinline__ void run(
        const Elem* __restrict__ q, const Elem* __restrict__ k, const Elem* __restrict__ v, OutT* __restrict__ out,
        float* __restrict__ lse, float* __restrict__ ws_o, float* __restrict__ ws_lse,
        const int* __restrict__ cu_seqlens_q, const int* __restrict__ qo_lens, const int* __restrict__ kv_lens,
        const int* __restrict__ qo_offset, const int* __restrict__ cu_seqlens_k, const int* __restrict__ page_list,
        const int* __restrict__ page_indptr, long long q_tok_stride, long long q_head_stride, long long out_tok_stride,
        long long out_head_stride, long long k_page_stride, long long k_slot_stride, long long k_head_stride,
        long long v_page_stride, long long v_slot_stride, long long v_head_stride, int total_q, int kv_extent,
        int num_heads_q, int num_heads_kv, int group, int causal, int page_size_log2, int page_list_len,
        int num_splits, int row_tiles, int batch, int section, float scale_log2, u32 sQ, u32 sKV, u32 bars,
        unsigned char* bars_ptr, SparseLists sp, const TensorMap* q_map, const TensorMap* k_map,
        const TensorMap* v_map) {
        Item* slot = reinterpret_cast<Item*>(bars_ptr + kItemOffset);
        const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
        const int wg = warp >> 2;
        const int heads_splits = num_heads_kv * num_splits;
        const long long n_items = (long long)row_tiles * batch * heads_splits;
        // This CTA's item of wave w, false when there is none (Scheduler::wave_item).
        auto item = [&](long long w, Item& it) {
            const long long i = Scheduler::wave_item(w);
            return i < n_items && Scheduler::item_at(i, row_tiles, batch, heads_splits, num_splits, section,
                                                     cu_seqlens_q, qo_lens, kv_lens, qo_offset, cu_seqlens_k, total_q,
                                                     kv_extent, group, causal, sp.nq_cap, it);
        };

        // Barriers: full K [s], full V [s], empty K [s], empty V [s], Q full, Q empty. Q full
        // also publishes the item slot (its writer arrives after writing it).
        const u32 full_k = bars, full_v = bars + 8 * kStages, empty_k = bars + 16 * kStages,
                  empty_v = bars + 24 * kStages, q_full = bars + 32 * kStages, q_empty = q_full + 8;
        if (tid == 0) {
#pragma unroll
            for (int s = 0; s < kStages; ++s) {
                mbar_init(full_k + 8 * s, kPaged ? kPagedKArrivals : kTileArrivals);
                mbar_init(full_v + 8 * s, kTileArrivals);
                mbar_init(empty_k + 8 * s, kPaged ? 256 : 8);
                mbar_init(empty_v + 8 * s, 8);
            }
            mbar_init(q_full, kQArrivals);
            mbar_init(q_empty, 256);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();

        if (wg == 0) {
            // ================= producer =================
            regs_release<kProducerRegs>();
            if constexpr (kKv != 2) {
                if (warp == 0)
                    produce_tma(item, n_items, q_map, k_map, v_map, q, q_tok_stride, q_head_stride, k, v, k_page_stride,
                                k_slot_stride, k_head_stride, v_page_stride, v_slot_stride, v_head_stride, group,
                                kv_extent, page_size_log2, page_list, page_indptr, page_list_len, sQ, sKV, full_k,
                                full_v, empty_k, empty_v, q_full, q_empty, slot, bars_ptr + kKeyFlagOffset);
                return;
            }
            // Block-sparse: the warpgroup builds each item's block union and loads its Q tile
            // (thread 0, by TMA boxes where the group divides kM); warp 0 loads its K/V tiles.
            const bool q_boxes = kM % group == 0;
            if (tid == 0 && q_boxes) tma_prefetch_map(q_map);
            constexpr int kStep = 128 / kChunks;  // rows between one thread's chunks
            const int c = tid % kChunks, r0 = tid / kChunks;
            const u32 q_off = sQ + QTile::offset(r0, c);
            int kv_n = 0;  // K/V tiles loaded so far (ring position)
            int q_n = 0;   // Q tiles loaded so far
            for (long long w = 0; w * gridDim.x < n_items; ++w) {
                Item it;
                if (!item(w, it)) continue;
                // Packed row P (< rows_total) of the item's Q tile: query P / group, head in group P % group.
                auto q_row = [&](int P) {
                    const int qi = P / group, h = P - qi * group;
                    return q + (long long)(it.q_start + qi) * q_tok_stride + (long long)(it.kvh * group + h) * q_head_stride;
                };
                const int q_tok = it.q_start + it.qi_first, q_head = it.kvh * group;
                // The item's Q rows into L2 (boxes, or thread tid: packed row tid): its load below
                // waits for the consumers' last Q K^T of the previous item, and then hits L2.
                if (q_boxes) {
                    if (tid == 0) prefetch_q_boxes(q_map, q_head, q_tok);
                } else if (it.row0 + tid < it.rows_total) {
                    const char* row = reinterpret_cast<const char*>(q_row(it.row0 + tid));
#pragma unroll
                    for (int l = 0; l < kRowBytes / 128; ++l) prefetch_l2(row + 128 * l);
                }
                const PageList pages = PageList::of_request(page_list, page_indptr, page_list_len, it.b);
                {
                    // The union of the item's queries' blocks (ends with the producer barrier).
                    // Built before the wait below: the consumers are still on the previous item,
                    // whose membership bits sit in the other buffer.
                    const int nb = min((it.kend + kBN - 1) / kBN, min(pages.count, sp.union_words * 32));
                    const long long list_row0 =
                        ((long long)(it.q_start + it.qi_first) * num_heads_kv + it.kvh) * sp.width;
                    const int n_union = build_block_union<128, kBarProducer>(
                        sp.lists, list_row0, (long long)num_heads_kv * sp.width, sp.width, it.nq, max(nb, 0),
                        pages, kv_extent, sp.scratch, reinterpret_cast<int*>(sp.scratch) + sp.union_words, sp.ulist,
                        sp.upage, sp.qmask + (q_n & 1) * sp.nq_cap * sp.qwords, sp.qwords,
                        reinterpret_cast<int*>(bars_ptr + kWarpTotalOffset));
                    Scheduler::split_tiles(n_union, num_splits, it);
                }
                // Q: the item's 128 packed rows, once the consumers' last Q K^T of the previous
                // item has completed; the item's geometry with it. Boxes as the dense tile's where
                // the group divides kM, else the warpgroup's cp.async rows (zero past the
                // request). Every thread arrives after its membership writes (kQArrivals).
                mbar_wait(q_empty, (q_n & 1) ^ 1);
                if (q_boxes) {
                    if (tid == 0) {
                        *slot = it;
                        load_q_boxes(q_map, sQ, q_head, q_tok, q_full, 2);
                    } else {
                        mbar_arrive_n(q_full, 2);
                    }
                } else {
                    if (tid == 0) *slot = it;
#pragma unroll 4
                    for (int j = 0; j < kM / kStep; ++j) {
                        const int P = it.row0 + r0 + j * kStep;
                        const bool ok = P < it.rows_total;
                        cp_async_16_u32(q_off + j * kStep * 128, ok ? q_row(P) + c * 8 : q, ok);
                    }
                    cp_async_mbar_arrive_noinc(q_full);
                    mbar_arrive(q_full);
                }
                ++q_n;
                // K/V: warp 0 alone; the other warps go on to the next item's union build, which
                // meets warp 0 at its barriers before it rewrites the union's blocks.
                if (warp == 0) {
                    const Elem* kb = k + (long long)it.kvh * k_head_stride;
                    const Elem* vb = v + (long long)it.kvh * v_head_stride;
                    // Tile t (union block t: one page of kBN keys) of an operand (its map; base, page
                    // and slot strides) into the stage at dst, completing on `full`: one TMA box per
                    // column block, or, for a block that reaches past the request, the warp's
                    // cp.async zero-filled past it. With `meta`, lane 0 publishes the block's first
                    // key with the stage.
                    auto load_tile = [&](const TensorMap* map, const Elem* base, long long page_stride,
                                         long long stride, int t, u32 dst, u32 full, unsigned char* meta) {
                        const int kstart = sp.ulist[t] * kBN, page = sp.upage[t];
                        if (kstart + kBN <= it.Lk) {
                            if (lane == 0) {
                                if (meta != nullptr) *reinterpret_cast<int*>(meta) = kstart;
                                mbar_expect_tx(full, kTileBytes);
#pragma unroll
                                for (int cb = 0; cb < kD / 64; ++cb)
                                    tma_load_4d(dst + cb * KvTile::kBlockBytes, map, cb * 64, it.kvh, 0, page, full);
                                mbar_arrive_n(full, kTileArrivals);
                            }
                            return;
                        }
                        const Elem* p = base + page * page_stride;
                        const int cl = lane % kChunks;
                        for (int r = lane / kChunks; r < kBN; r += 32 / kChunks) {
                            const bool ok = kstart + r < it.Lk;
                            cp_async_16_u32(dst + KvTile::offset(r, cl), (ok ? p + r * stride : p) + cl * 8, ok);
                        }
                        cp_async_mbar_arrive_noinc(full);
                        if (lane == 0) {
                            if (meta != nullptr) *reinterpret_cast<int*>(meta) = kstart;
                            mbar_arrive(full);
                        }
                    };
                    // K of tile n, then V of tile n - 1 (the order the consumers read them in).
                    for (int n = 0; n <= it.n_count; ++n) {
                        if (n < it.n_count) {
                            const int g = kv_n + n, s = g % kStages;
                            mbar_wait(empty_k + 8 * s, ((g / kStages) & 1) ^ 1);
                            load_tile(k_map, kb, k_page_stride, k_slot_stride, it.t_begin + n, sKV + s * kStageBytes,
                                      full_k + 8 * s, bars_ptr + kKeyFlagOffset + 4 * s);
                        }
                        if (n >= 1) {
                            const int g = kv_n + n - 1, s = g % kStages;
                            mbar_wait(empty_v + 8 * s, ((g / kStages) & 1) ^ 1);
                            load_tile(v_map, vb, v_page_stride, v_slot_stride, it.t_begin + n - 1,
                                      sKV + s * kStageBytes + kTileBytes, full_v + 8 * s, nullptr);
                        }
                    }
                }
                kv_n += it.n_count;
            }
            // No more items.
            mbar_wait(q_empty, (q_n & 1) ^ 1);
            if (tid == 0) slot->n_count = -1;
            mbar_arrive_n(q_full, 2);
            cp_async_wait_all();  // nothing in flight when the warpgroup exits
            return;
        }

        // ================= consumers =================
        regs_claim<kConsumerRegs>();
        const int cw = wg - 1;       // consumer warpgroup 0 / 1
        const int g = lane >> 2, t4 = lane & 3;
        const int m_base = cw * 64 + (warp & 3) * 16;  // first CTA row of this warp
        const u64 q_desc = wg_desc(sQ + cw * 64 * 128, 16, 1024);
        const int turn_mine = kBarTurn + cw, turn_other = kBarTurn + (cw ^ 1);
        const long long split_rows = (long long)total_q * num_heads_q;
        int kv_n = 0, q_n = 0;
        bool turns_started = false;  // the first issue section has been handed to warpgroup 0

        float S[1][kNT][4];
        float O[kDT][4];
        u32 P[kBN / 16][4];
        float m_run[2], l_run[2], alpha[2];

        // S = Q K^T of the K tile at kaddr (issued, not waited for).
        auto issue_qk = [&](u32 kaddr) {
            const u64 k_desc = wg_desc(kaddr, 16, 1024);
            wg_fence();
            wg_issue_qk<kD, kM, kBN, Elem>(&S[0][0][0], q_desc, k_desc);
            wg_commit();
        };
        // O += P V of the V tile at vaddr (issued, not waited for); per 16-key step one n64
        // MMA per 64-dim column block of V (MN-major).
        auto issue_pv = [&](u32 vaddr) {
            const u64 v_desc = wg_desc(vaddr, 16, 1024);
            wg_fence_regs<kDT * 4>(&O[0][0]);
            wg_fence_regs<kBN / 4>(&P[0][0]);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < kBN / 16; ++kk) {
#pragma unroll
                for (int cb = 0; cb < kD / 64; ++cb)
                    WgmmaRS<64, Elem>::run(&O[8 * cb][0], P[kk], wg_desc_add(v_desc, cb * (kBN * 128) + kk * 2048), 1);
            }
            wg_commit();
        };
        auto pack_p = [&]() {
#pragma unroll
            for (int kk = 0; kk < kBN / 16; ++kk) {
                P[kk][0] = pack2<Elem>(S[0][2 * kk][0], S[0][2 * kk][1]);
                P[kk][1] = pack2<Elem>(S[0][2 * kk][2], S[0][2 * kk][3]);
                P[kk][2] = pack2<Elem>(S[0][2 * kk + 1][0], S[0][2 * kk + 1][1]);
                P[kk][3] = pack2<Elem>(S[0][2 * kk + 1][2], S[0][2 * kk + 1][3]);
            }
        };
        auto rescale_o = [&]() {
            // (a lazily kept running max gives factors of exactly 1: skipped warp by warp)
            if (!__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
#pragma unroll
            for (int d = 0; d < kDT; ++d) {
                O[d][0] *= alpha[0];
                O[d][1] *= alpha[0];
                O[d][2] *= alpha[1];
                O[d][3] *= alpha[1];
            }
        };
        // A warp's lane 0 releases a stage once the warpgroup's MMAs on it have completed. Paged,
        // every consumer thread releases the K stages: each read the stage's key flags, and its
        // own arrival orders that read before the producer's next write.
        auto release = [&](u32 bar) {
            if (lane == 0) mbar_arrive(bar);
        };
        auto release_k = [&](u32 bar) {
            if (kPaged || lane == 0) mbar_arrive(bar);
        };
        // Every consumer thread releases the Q tile and item slot: each thread read the slot,
        // so each thread's own arrival orders its read before the producer's next write.
        auto release_q = [&]() { mbar_arrive(q_empty); };

        for (;;) {
            mbar_wait(q_full, q_n & 1);
            ++q_n;
            const Item it = *slot;
            const int n_count = it.n_count;
            if (n_count < 0) break;
            const u32* qmask = kSparse ? sp.qmask + ((q_n - 1) & 1) * sp.nq_cap * sp.qwords : nullptr;

            // ---- this thread's rows: local query (0xff padding) and key limits ----
            const RowLimits row_limit{(int)max(-(1LL << 30), min(1LL << 30, it.qoff + it.qi_first + 1)), it.Lk,
                                      causal != 0};
            u32 row_qls = 0;
            int lim_lo = 0x7fffffff;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int Prow = it.row0 + m_base + h * 8 + g;
                int ql = 0xff;
                if (Prow < it.rows_total) {
                    ql = Prow / group - it.qi_first;
                    lim_lo = min(lim_lo, row_limit(ql));
                }
                row_qls |= (u32)ql << (8 * h);
            }
            const int warp_lim_lo = __reduce_min_sync(0xffffffffu, lim_lo);
            // Key tile t (stage s): its first key and, paged, the page-validity bytes of keys
            // 4 lane .. 4 lane + 3, or, sparse, bit h: row h's query selected the block. Read
            // once the stage's K barrier completed, before the stage and the Q tile (whose
            // release lets the producer reuse the membership buffer) are released.
            auto tile_meta = [&](int s, int t) -> TileMeta {
                TileMeta m{t * kBN, kAllKeysValid};
                if constexpr (kPaged) m.word = reinterpret_cast<const u32*>(bars_ptr + kKeyFlagOffset)[s * (kBN / 4) + lane];
                if constexpr (kSparse) {
                    // (lane 0 reads it: its arrival releases the stage)
                    int ks = 0;
                    if (lane == 0) ks = *reinterpret_cast<const int*>(bars_ptr + kKeyFlagOffset + 4 * s);
                    m.kstart = __shfl_sync(0xffffffffu, ks, 0);
                    m.word = 0;
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int ql = (row_qls >> (8 * h)) & 0xff;
                        if (ql < it.nq) m.word |= ((qmask[ql * sp.qwords + (t >> 5)] >> (t & 31)) & 1u) << h;
                    }
                }
                return m;
            };
            // Mask (where this warp's rows need it: causal limits, keys on invalid pages, blocks
            // a row's query did not select) and the online softmax of a tile's scores.
            auto softmax = [&](const TileMeta& m) {
                const int kstart = m.kstart;
                if constexpr (kSparse) {
                    bool full = true;
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int ql = (row_qls >> (8 * h)) & 0xff;
                        if (ql != 0xff) full = full && ((m.word >> h) & 1u) && kstart + kBN <= row_limit(ql);
                    }
                    if (!__all_sync(0xffffffffu, full))
                        mask_scores<1, kNT>(S, row_qls, m.word, row_limit, kstart, t4, nullptr, kstart);
                } else {
                    const bool flagged = kPaged && __any_sync(0xffffffffu, m.word != kAllKeysValid);
                    if (flagged || kstart + kBN > warp_lim_lo)
                        mask_scores<1, kNT>(S, row_qls, 0xffffffffu, row_limit, kstart, t4, nullptr, kstart);
                    if (flagged) mask_flagged_keys<kNT>(S[0], m.word, t4);
                }
                online_softmax_scores<kNT>(S[0], m_run, l_run, scale_log2, alpha);
            };

#pragma unroll
            for (int d = 0; d < kDT; ++d) O[d][0] = O[d][1] = O[d][2] = O[d][3] = 0.f;
            m_run[0] = m_run[1] = kNegInf;
            l_run[0] = l_run[1] = 0.f;

            if (n_count > 0) {
                // Issue sections alternate between the warpgroups across items: warpgroup 1 hands
                // the first one to warpgroup 0 once, warpgroup 0 takes the last hand-over back
                // after the loop. Warpgroup 0 starts an item once warpgroup 1 has issued its
                // last MMAs of the previous one, while warpgroup 1 finishes that item.
                if (!turns_started) {
                    if (cw == 1) named_arrive(turn_other, 256);
                    turns_started = true;
                }
                {
                    const int s = kv_n % kStages;
                    mbar_wait(full_k + 8 * s, (kv_n / kStages) & 1);
                    const TileMeta meta = tile_meta(s, it.t_begin);
                    fence_proxy_async_smem();
                    named_sync(turn_mine, 256);
                    issue_qk(sKV + s * kStageBytes);
                    named_arrive(turn_other, 256);
                    wg_wait<0>();
                    wg_fence_regs<kNT * 4>(&S[0][0][0]);
                    release_k(empty_k + 8 * s);
                    if (n_count == 1) release_q();
                    softmax(meta);
                    pack_p();
                }
                for (int n = 1; n < n_count; ++n) {
                    const int gk = kv_n + n, gv = gk - 1;
                    const int s = gk % kStages, sp = gv % kStages;
                    // (V_{n-1} was loaded right after K_n: one proxy fence covers both.)
                    mbar_wait(full_k + 8 * s, (gk / kStages) & 1);
                    mbar_wait(full_v + 8 * sp, (gv / kStages) & 1);
                    const TileMeta meta = tile_meta(s, it.t_begin + n);
                    fence_proxy_async_smem();
                    named_sync(turn_mine, 256);
                    issue_qk(sKV + s * kStageBytes);
                    rescale_o();
                    issue_pv(sKV + sp * kStageBytes + kTileBytes);
                    named_arrive(turn_other, 256);
                    wg_wait<1>();  // S_n has landed; the PV product is still in flight
                    wg_fence_regs<kNT * 4>(&S[0][0][0]);
                    release_k(empty_k + 8 * s);
                    if (n == n_count - 1) release_q();  // the producer may load the next Q
                    softmax(meta);
                    wg_wait<0>();
                    wg_fence_regs<kDT * 4>(&O[0][0]);
                    release(empty_v + 8 * sp);
                    pack_p();
                }
                const int gl = kv_n + n_count - 1, sl = gl % kStages;
                rescale_o();
                mbar_wait(full_v + 8 * sl, (gl / kStages) & 1);
                fence_proxy_async_smem();
                issue_pv(sKV + sl * kStageBytes + kTileBytes);
                wg_wait<0>();
                wg_fence_regs<kDT * 4>(&O[0][0]);
                release(empty_v + 8 * sl);
                kv_n += n_count;
            } else {
                release_q();
            }

            // ---- epilogue: normalise, lse, store ----
            float inv[2];
            long long ridx[2];
            int tok[2], head[2];
            bool live[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float l = quad_sum(l_run[h]);
                inv[h] = l > 0.f ? 1.f / l : 0.f;
                const int Prow = it.row0 + m_base + h * 8 + g;
                live[h] = Prow < it.rows_total;
                const int qi = Prow / group, hh = Prow - qi * group;
                tok[h] = it.q_start + qi;
                head[h] = it.kvh * group + hh;
                ridx[h] = (long long)tok[h] * num_heads_q + head[h];
                if (live[h] && t4 == 0) {
                    const float row_lse =
                        l > 0.f ? (m_run[h] * scale_log2 + __log2f(l)) * 0.69314718055994531f : kNegInf;
                    if (ws_lse != nullptr) {
                        ws_lse[it.split * split_rows + ridx[h]] = row_lse;
                    } else if (lse != nullptr) {
                        lse[ridx[h]] = row_lse;
                    }
                }
            }
            // Straight from the registers (the Q tile is being refilled, the ring holds the next
            // item's K/V): split-KV partials as a quad's 32 contiguous bytes per n-tile; out as
            // 16-byte chunks, the quad's words of four n-tiles transposed so each lane holds one.
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (ws_o != nullptr) {
                    if (!live[h]) continue;
                    float* dst = ws_o + (it.split * split_rows + ridx[h]) * kD + 2 * t4;
#pragma unroll
                    for (int d = 0; d < kDT; ++d)
                        *reinterpret_cast<float2*>(dst + 8 * d) =
                            make_float2(O[d][2 * h] * inv[h], O[d][2 * h + 1] * inv[h]);
                    continue;
                }
                OutT* dst = out + (long long)tok[h] * out_tok_stride + (long long)head[h] * out_head_stride + 8 * t4;
#pragma unroll
                for (int j = 0; j < kDT / 4; ++j) {
                    u32 x[4];
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        x[c] = pack2<OutT>(O[4 * j + c][2 * h] * inv[h], O[4 * j + c][2 * h + 1] * inv[h]);
                    quad_transpose4(x, t4);
                    if (live[h]) *reinterpret_cast<uint4*>(dst + 32 * j) = make_uint4(x[0], x[1], x[2], x[3]);
                }
            }
        }
        if (cw == 0 && turns_started) named_sync(turn_mine, 256);  // warpgroup 1's last hand-over
    }
};

}  // namespace attn
}  // namespace mate
