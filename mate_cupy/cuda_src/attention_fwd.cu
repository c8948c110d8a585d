// MSA attention forward: dense, paged and block-sparse KV, prefill and decode.
//
// One FlashAttention-2 style kernel whose key loop walks either a dense key
// range, a paged key range through a page table / CSR page list, or the union
// of the selected 128-key blocks of the CTA's queries (ATT_KV). GQA is
// packed: the rows of a CTA tile are (query, head-in-group) pairs of one KV
// head, query-major (packed row P = i * group + h), so every K/V tile loaded
// serves all query heads of the group.
//
//   q    [total_q, Hq, D]          (token and head strides given)
//   k, v dense [total_k, Hkv, D]   (slot stride = token stride, page stride unused)
//        paged [pages, page, Hkv, D] ("NHD") or [pages, Hkv, page, D] ("HND"),
//        any page/slot/head strides with D contiguous
//   out  [total_q, Hq, D] fp16/bf16 (bf16 for e4m3 inputs); lse [total_q, Hq] f32
//   split-KV: partial out ws_o [splits, total_q*Hq, D] f32 and ws_lse
//        [splits, total_q*Hq], combined by msa_attention_merge_kernel.
//
// Grid: x = row tiles (heaviest first), y = request, z = KV head * splits; the
// warp-specialised tile is persistent instead: a 1-D grid whose CTAs walk the work items
// row_tiles x batch x (KV head * splits) in that order (ignored by the other tiles).
// CTA: ATT_WARPS_M x ATT_WARPS_N warps; warp (wm, wn) owns ATT_MTILES 16-row
// m-tiles and the wn-th slice of ATT_BLOCK_N / ATT_WARPS_N keys of each K/V
// tile (decode shapes split the keys across warps and merge at the end).
// K/V tiles stream through an ATT_STAGES-deep cp.async ring with one barrier
// per tile. S = Q K^T and O += P V run on mma.sync (m16n8k16 fp16/bf16,
// m16n8k32 e4m3 with P quantised to e4m3 after scaling by 256), or, with
// ATT_WGMMA (sm_90a, fp16/bf16, D 64/128), on warpgroup MMAs: each warpgroup
// of four warps owns 64 rows, S = Q K^T reads Q and K straight from shared
// memory (column-block tiles, attention_wgmma.cuh), O += P V takes P from
// registers; masking, softmax and the epilogue are the same code.
//
// This file is the mainloop; masking (attention/mask.cuh) and the epilogue and split-KV
// combine (attention/epilogue.cuh) are role headers.
//
// Compile-time specialisation (macros): ATT_HEAD_DIM, ATT_DTYPE (0 fp16,
// 1 bf16, 2 e4m3), ATT_WARPS_M, ATT_MTILES, ATT_WARPS_N, ATT_BLOCK_N,
// ATT_STAGES, ATT_KV (0 dense, 1 paged, 2 block-sparse), ATT_MIN_BLOCKS,
// ATT_WGMMA (0 mma.sync, 1 warpgroup MMA), ATT_WG_ROT (1: warpgroup 1 one phase
// behind warpgroup 0), ATT_WS (1: the warp-specialised dense mainloop of
// attention/mainloop_sm90.cuh: a producer warpgroup and ATT_WARPS_M / 4 = 2 consumer
// warpgroups, mbarrier-tracked K/V stages), ATT_SMEM_FIXED (host's view of the
// fixed shared-memory bytes, checked below; wgmma variants get 1024 more bytes
// from the host to align the tiles).
#include "common/dtype.cuh"
#include "common/mma.cuh"
#include "common/attention_tile.cuh"
#include "common/softmax.cuh"
#include "common/kv_pages.cuh"
#include "common/request_rows.cuh"
#include "common/block_union.cuh"
#include "common/attention_wgmma.cuh"
#include "attention/mask.cuh"
#include "attention/epilogue.cuh"
#include "attention/mainloop_sm90.cuh"

using namespace mate;
using namespace mate::attn;

// Elem: q/k/v storage; OutT: output; Mma16: operand type of the 16-bit PV path
// (never executed for e4m3, but compiled).
#if ATT_DTYPE == 0
typedef half_t Elem;
typedef half_t OutT;
typedef half_t Mma16;
#elif ATT_DTYPE == 1
typedef bf16_t Elem;
typedef bf16_t OutT;
typedef bf16_t Mma16;
#else
typedef fp8_t Elem;
typedef bf16_t OutT;
typedef bf16_t Mma16;
#endif

#ifndef ATT_WS
#define ATT_WS 0
#endif
#if ATT_WS
// The warp-specialised variant's body is its own mainloop: the constants of the one in this
// file are left unreferenced.
#pragma nv_diag_suppress 177
#endif

namespace {

constexpr int kD = ATT_HEAD_DIM;
constexpr bool kFp8 = ATT_DTYPE == 2;
constexpr int kElemBytes = kFp8 ? 1 : 2;
constexpr int kElemsPerChunk = 16 / kElemBytes;
constexpr int kRowBytes = kD * kElemBytes;
constexpr int kChunks = kRowBytes / 16;
constexpr int kWM = ATT_WARPS_M;
constexpr int kMT = ATT_MTILES;
constexpr int kWN = ATT_WARPS_N;
constexpr int kBN = ATT_BLOCK_N;
constexpr int kStages = ATT_STAGES;
constexpr bool kSparse = ATT_KV == 2;  // union of selected 128-key blocks
constexpr bool kPaged = ATT_KV >= 1;   // keys reached through a page list
// Warp-specialised dense mainloop (sm_90a): the kWM consumer warps plus a producer warpgroup.
constexpr bool kWS = ATT_WS != 0;
constexpr int kThreads = 32 * kWM * kWN + (kWS ? 128 : 0);
constexpr int kM = kWM * kMT * 16;          // rows per CTA
constexpr int kKW = kBN / kWN;               // keys per warp per tile
constexpr int kNT = kKW / 8;                 // S n-tiles per warp
constexpr int kKSteps = kRowBytes / 32;      // QK k-steps
constexpr int kDT = kD / 8;                  // O n-tiles
constexpr float kPScale = kFp8 ? 256.f : 1.f;
constexpr int kSparseBlock = 128;
constexpr int kTilesPerBlock = kSparseBlock / kBN;
constexpr bool kWG = ATT_WGMMA != 0;  // warpgroup MMAs (sm_90a)
#ifndef ATT_WG_ROT
#define ATT_WG_ROT 0
#endif
// Warpgroup 1 runs one phase behind warpgroup 0 (softmax + O += P V of the previous tile,
// then S = Q K^T of this one), so one warpgroup's softmax overlaps the other's MMAs.
constexpr bool kRot = kWG && ATT_WG_ROT != 0;
// Tiles loaded ahead of the one being computed: a rotated tile keeps the previous stage busy.
constexpr int kPrefetch = kRot ? ATT_STAGES - 2 : ATT_STAGES - 1;

// Q and K/V tile layouts: row-swizzled for ldmatrix, column blocks for wgmma.
template <bool WG, int ROWS> struct TileOf { typedef SwizzledTile<kRowBytes> type; };
template <int ROWS> struct TileOf<true, ROWS> { typedef ColumnBlockTile<ROWS> type; };
typedef typename TileOf<kWG, kM>::type QTile;
typedef typename TileOf<kWG, kBN>::type KvTile;
constexpr int kKvRowStride = kWG ? 128 : kRowBytes;  // bytes between rows r and r + 8k (same swizzle)

static_assert(kD == 64 || kD == 128 || kD == 256, "head dim");
static_assert(kKW % (kFp8 ? 32 : 16) == 0, "a warp's key slice must fill whole PV k-steps");
static_assert(kThreads % kChunks == 0, "K/V tile loads cover whole rows per pass");
static_assert(kBN <= kSparseBlock && kSparseBlock % kBN == 0, "key tiles must tile a 128-key block");
static_assert(kStages >= 2 && kStages <= 4, "pipeline depth");
static_assert(!kWG || (!kFp8 && (kD == 64 || kD == 128) && kWN == 1 && kMT == 1 && kWM % 4 == 0 &&
                       (kBN == 64 || kBN == 128)),
              "wgmma tiles: fp16/bf16, D 64/128, one 16-row m-tile per warp, warpgroups of 4 warps, 64/128 keys");
static_assert(!kRot || (kWM == 8 && kStages >= 3), "rotated wgmma tiles: two warpgroups, three or more stages");
static_assert(!kWS || (kWG && !kRot && kWM == 8 && ATT_KV == 0),
              "warp-specialised tiles: dense KV, two consumer warpgroups of wgmma");

constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }
constexpr int cmax(int a, int b) { return a > b ? a : b; }

// Shared memory: [Q tile][region: K/V stages | epilogue | sparse scratch][page flags][sparse lists]
constexpr int kQBytes = kM * kRowBytes;
constexpr int kStageBytes = 2 * kBN * kRowBytes;
typedef AttentionEpilogue<kD, kM, kMT, kWN, kThreads, kFp8> Epilogue;
constexpr int kEpiBytes = Epilogue::kSmemBytes;
constexpr int kRegionBytes = round_up(cmax(kStages * kStageBytes, kEpiBytes), 128);
constexpr int kFlagBytes = round_up(kStages * kBN, 128);
constexpr int kSmemFixed = kQBytes + kRegionBytes + kFlagBytes;
static_assert(kSmemFixed == ATT_SMEM_FIXED, "host and device disagree on the shared-memory layout");
// Sparse scratch (bitmap + prefix words) aliases the region.
constexpr int kUnionWords = kRegionBytes / 8;
#if ATT_WS
// Warp-specialised tiles: the ring is the region, the mbarriers sit in the page-flag bytes.
typedef DenseMainloopSm90<kD, kBN, kStages, Elem> WsMainloop;
static_assert(WsMainloop::kThreads == kThreads && WsMainloop::kM == kM && WsMainloop::kBarBytes <= kFlagBytes &&
                  WsMainloop::kStageBytes == kStageBytes,
              "warp-specialised tile: shape and shared-memory layout");
#endif

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads, ATT_MIN_BLOCKS) msa_attention_fwd_kernel(
    const Elem* __restrict__ q, const Elem* __restrict__ k, const Elem* __restrict__ v, OutT* __restrict__ out,
    float* __restrict__ lse, float* __restrict__ ws_o, float* __restrict__ ws_lse,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ qo_lens, const int* __restrict__ kv_lens,
    const int* __restrict__ qo_offset, const int* __restrict__ cu_seqlens_k, const int* __restrict__ page_list,
    const int* __restrict__ page_indptr, const int* __restrict__ block_lists, long long q_tok_stride,
    long long q_head_stride, long long out_tok_stride, long long out_head_stride, long long k_page_stride,
    long long k_slot_stride, long long k_head_stride, long long v_page_stride, long long v_slot_stride,
    long long v_head_stride, int total_q, int kv_extent, int num_heads_q, int num_heads_kv, int group, int causal,
    int page_size_log2, int page_list_len, int list_width, int nq_cap, int qmask_words, int num_splits,
    int row_tiles, int batch, float scale_log2, float out_scale) {
    extern __shared__ __align__(kWG ? 1024 : 128) unsigned char smem_raw[];
    // wgmma tiles need 1024-byte aligned shared addresses (the host adds 1024 bytes for this).
    unsigned char* smem = smem_raw + (kWG ? ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u) : 0u);
    unsigned char* sQ = smem;
    unsigned char* sR = smem + kQBytes;
    unsigned char* sFlags = sR + kRegionBytes;
#if ATT_WS
    WsMainloop::run(q, k, v, out, lse, ws_o, ws_lse, cu_seqlens_q, qo_lens, kv_lens, qo_offset, cu_seqlens_k,
                    q_tok_stride, q_head_stride, out_tok_stride, out_head_stride, k_slot_stride, k_head_stride,
                    v_slot_stride, v_head_stride, total_q, kv_extent, num_heads_q, num_heads_kv, group, causal,
                    num_splits, row_tiles, batch, scale_log2, smem_u32(sQ), smem_u32(sR), smem_u32(sFlags),
                    reinterpret_cast<WsMainloop::Item*>(sFlags + WsMainloop::kItemOffset));
}
#else
    int* sList = reinterpret_cast<int*>(sFlags + kFlagBytes);
    int* sPage = sList + nq_cap * list_width;
    u32* sQmask = reinterpret_cast<u32*>(sPage + nq_cap * list_width);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp % kWM, wn = warp / kWM;
    const int g = lane >> 2, t4 = lane & 3;
    const int m_base = wm * kMT * 16;  // first CTA row of this warp

    const int b = blockIdx.y;
    const int kvh = blockIdx.z / num_splits, split = blockIdx.z - kvh * num_splits;
    const int row0 = (gridDim.x - 1 - blockIdx.x) * kM;

    // ---- request geometry, clamped to the arrays ----
    const QueryRows qr = query_rows(cu_seqlens_q, qo_lens, total_q, b);
    const int q_start = qr.start, Lq = qr.len;
    const int rows_total = Lq * group;
    if (row0 >= rows_total) return;

    int Lk = max(kv_lens[b], 0);
    long long k_row0 = 0;
    PageList pages{nullptr, 0};
    if constexpr (!kPaged) {
        const int ks = cu_seqlens_k[b];
        if (ks < 0 || ks > kv_extent) {
            Lk = 0;
        } else {
            Lk = min(Lk, kv_extent - ks);
            k_row0 = ks;
        }
    } else {
        pages = PageList::of_request(page_list, page_indptr, page_list_len, b);
    }
    const long long qoff = qo_offset[b];
    const int qi_first = row0 / group;
    const int qi_last = min(Lq - 1, (row0 + kM - 1) / group);
    // Keys any row of this CTA may attend: [0, kend).
    const int kend = causal ? (int)max(0LL, min((long long)Lk, qoff + qi_last + 1)) : Lk;

    // ---- this thread's rows ----
    // Local query index ql = qi - qi_first of row (mt, h), one byte each (0xff: padding row).
    // A row attends keys j < row_limit(ql).
    const RowLimits row_limit{(int)max(-(1LL << 30), min(1LL << 30, qoff + qi_first + 1)), Lk, causal != 0};
    u32 row_qls0 = 0;
    int lim_lo = 0x7fffffff, lim_hi = 0;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int P = row0 + m_base + mt * 16 + h * 8 + g;
            int ql = 0xff;
            if (P < rows_total) {
                ql = P / group - qi_first;
                const int lim = row_limit(ql);
                lim_lo = min(lim_lo, lim);
                lim_hi = max(lim_hi, lim);
            }
            row_qls0 |= (u32)ql << (8 * (2 * mt + h));
        }
    }
    const int warp_lim_lo = __reduce_min_sync(0xffffffffu, lim_lo);
    const int warp_lim_hi = __reduce_max_sync(0xffffffffu, lim_hi);

    // ---- Q tile (zero rows past the request) ----
    {
        const int c = tid % kChunks;
        constexpr int kQIters = (kM * kChunks + kThreads - 1) / kThreads;
#pragma unroll
        for (int i = 0; i < kQIters; ++i) {
            const int r = tid / kChunks + i * (kThreads / kChunks);
            if (kQIters * kThreads > kM * kChunks && r >= kM) break;
            const int P = row0 + r;
            const bool ok = P < rows_total;
            const Elem* src = q;
            if (ok) {
                const int qi = P / group, h = P - qi * group;
                src = q + (long long)(q_start + qi) * q_tok_stride + (long long)(kvh * group + h) * q_head_stride +
                      c * kElemsPerChunk;
            }
            cp_async_16(sQ + QTile::offset(r, c), src, ok);
        }
        cp_async_commit();
    }

    // ---- the tiles this CTA walks ----
    int n_tiles;
    int nq = 0;  // queries whose block lists are loaded (sparse)
    if constexpr (kSparse) {
        nq = min(qi_last - qi_first + 1, nq_cap);
        int nb = (kend + kSparseBlock - 1) / kSparseBlock;
        nb = min(nb, min(pages.count, kUnionWords * 32));
        const long long list_row0 = ((long long)(q_start + qi_first) * num_heads_kv + kvh) * list_width;
        const int U = build_block_union<kThreads>(
            block_lists, list_row0, (long long)num_heads_kv * list_width, list_width, nq, max(nb, 0), pages, kv_extent,
            reinterpret_cast<u32*>(sR), reinterpret_cast<int*>(sR) + kUnionWords, sList, sPage, sQmask, qmask_words);
        n_tiles = U * kTilesPerBlock;
    } else {
        n_tiles = (kend + kBN - 1) / kBN;
    }
    const int per_split = (n_tiles + num_splits - 1) / num_splits;
    const int t_begin = min(n_tiles, split * per_split);
    const int t_end = min(n_tiles, t_begin + per_split);

    // First key of tile t (and, sparse, its page).
    auto tile_start = [&](int t, int& page) -> int {
        if constexpr (kSparse) {
            const int u = t / kTilesPerBlock;
            page = sPage[u];
            return sList[u] * kSparseBlock + (t - u * kTilesPerBlock) * kBN;
        } else {
            page = 0;
            return t * kBN;
        }
    };

    // Issue the cp.async loads of K/V tile t into `stage` (one commit group,
    // empty past t_end). Keys past Lk or on invalid pages are zero-filled and
    // never read; returns 1 when a key < Lk sits on an invalid page.
    const u32 sQ_addr = smem_u32(sQ), sR_addr = smem_u32(sR);
    const int ld_c = tid % kChunks, ld_r0 = tid / kChunks;
    const Elem* kbase = k + (long long)kvh * k_head_stride + ld_c * kElemsPerChunk;
    const Elem* vbase = v + (long long)kvh * v_head_stride + ld_c * kElemsPerChunk;
    constexpr int kLdStep = kThreads / kChunks;  // rows between a thread's chunks
    constexpr int kLdIters = (kBN + kLdStep - 1) / kLdStep;
    constexpr bool kLdExact = kBN % kLdStep == 0;  // else the last pass covers part of the rows
    auto issue_tile = [&](int t, int stage) -> int {
        int bad = 0;
        if (t < t_end) {
            const u32 dK = sR_addr + stage * kStageBytes + KvTile::offset(ld_r0, ld_c);
            const u32 dV = dK + kBN * kRowBytes;
            int spage;
            const int kstart = tile_start(t, spage);
            if constexpr (!kPaged || kSparse) {
                // Rows of the tile are equally spaced in memory: walk one pointer per operand
                // (a closed form per row would be hoisted out of the key loop and spilled).
                long long first;
                if constexpr (kSparse) {
                    first = (long long)spage * k_page_stride + ((kstart & (kSparseBlock - 1)) + ld_r0) * k_slot_stride;
                } else {
                    first = (k_row0 + kstart + ld_r0) * k_slot_stride;
                }
                const long long vfirst = kSparse ? (long long)spage * v_page_stride +
                                                       ((kstart & (kSparseBlock - 1)) + ld_r0) * v_slot_stride
                                                 : (k_row0 + kstart + ld_r0) * v_slot_stride;
                const Elem* kp = kbase + first;
                const Elem* vp = vbase + vfirst;
                const long long kstep = kLdStep * k_slot_stride, vstep = kLdStep * v_slot_stride;
#pragma unroll
                for (int i = 0; i < kLdIters; ++i) {
                    const int r = ld_r0 + i * kLdStep;
                    if (!kLdExact && r >= kBN) break;
                    const bool ok = kstart + r < Lk;
                    const u32 so = (kLdStep % 8 == 0) ? i * kLdStep * kKvRowStride
                                                      : KvTile::offset(r, ld_c) - KvTile::offset(ld_r0, ld_c);
                    cp_async_16_u32(dK + so, ok ? kp : kbase, ok);
                    cp_async_16_u32(dV + so, ok ? vp : vbase, ok);
                    kp += kstep;
                    vp += vstep;
                }
            } else {
                int last_pi = -1, pg = -1;
#pragma unroll
                for (int i = 0; i < kLdIters; ++i) {
                    const int r = ld_r0 + i * kLdStep;
                    if (!kLdExact && r >= kBN) break;
                    const int j = kstart + r;
                    bool ok = j < Lk;
                    const int pi = j >> page_size_log2;
                    if (pi != last_pi) {
                        last_pi = pi;
                        pg = pages.page(pi, kv_extent);
                    }
                    if (ld_c == 0) sFlags[stage * kBN + r] = pg >= 0 ? 1 : 0;
                    if (ok && pg < 0) {
                        bad = 1;
                        ok = false;
                    }
                    const long long slot = j & ((1 << page_size_log2) - 1);
                    const Elem* ks = kbase;
                    const Elem* vs = vbase;
                    if (ok) {
                        ks += pg * k_page_stride + slot * k_slot_stride;
                        vs += pg * v_page_stride + slot * v_slot_stride;
                    }
                    const u32 so = KvTile::offset(r, ld_c) - KvTile::offset(ld_r0, ld_c);
                    cp_async_16_u32(dK + so, ks, ok);
                    cp_async_16_u32(dV + so, vs, ok);
                }
            }
        }
        cp_async_commit();
        return bad;
    };

    float O[kMT][kDT][4];
    float m_run[kMT][2], l_run[kMT][2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int d = 0; d < kDT; ++d) O[mt][d][0] = O[mt][d][1] = O[mt][d][2] = O[mt][d][3] = 0.f;
        m_run[mt][0] = m_run[mt][1] = kNegInf;
        l_run[mt][0] = l_run[mt][1] = 0.f;
    }

    // ---- pipeline prologue ----
    // flags bit i: tile (current + i) has keys on invalid pages (paged mode).
    u32 flags = 0;
    int pending_bad = 0;
#pragma unroll
    for (int s = 0; s < kPrefetch; ++s) {
        pending_bad = issue_tile(t_begin + s, s);
        if (kPaged && s < kPrefetch - 1) {
            if (__syncthreads_or(pending_bad)) flags |= 1u << s;
        }
    }

    const u32 off_a0 = lane_offset_a<kRowBytes>(m_base, lane);
    const u32 off_b0 = lane_offset_b<kRowBytes>(wn * kKW, lane);
    const u32 off_v0 = kFp8 ? lane_offset_vt8<kRowBytes>(wn * kKW, lane) : lane_offset_vt<kRowBytes>(wn * kKW, lane);

    // wgmma: this warp's warpgroup, its named barrier, and its 64 rows of the Q tile.
    const int wgrp = warp >> 2;
    const u64 q_desc = wg_desc(smem_u32(sQ) + wgrp * 64 * 128, 16, 1024);

    // Rotated warpgroup: S of the previous tile and that tile's metadata, carried across the barrier.
    const bool rot = kRot && wgrp == 1;
    float S[kMT][kNT][4];
    bool p_active = false, p_need_mask = false, p_tile_bad = false;
    int p_kstart = 0, p_stage = 0;
    u32 p_member = 0, p_k_addr = 0, p_v_addr = 0;
    bool p_warp_on = false;

    // (A rotated kernel runs one extra iteration: warpgroup 1 finishes the last tile.)
    for (int t = t_begin, n = 0; t < t_end + (kRot ? 1 : 0); ++t, ++n) {
        const bool real = !kRot || t < t_end;
        int stage = n % kStages;
        cp_async_wait<kPrefetch - 1>();
        // wgmma reads shared memory through the async proxy: publish this thread's landed
        // cp.async bytes to it before the barrier. (Every MMA of the tiles whose stage is
        // refilled below has completed.)
        if constexpr (kWG) fence_proxy_async_smem();
        if constexpr (kPaged && !kSparse) {
            if (__syncthreads_or(pending_bad)) flags |= 1u << (kPrefetch - 1);
        } else {
            __syncthreads();
        }
        // Stage (n - 1) % kStages (rotated: (n - 2) % kStages) is free: every warp finished it.
        pending_bad = issue_tile(t + kPrefetch, (n + kPrefetch) % kStages);

        u32 k_addr = sR_addr + stage * kStageBytes;
        u32 v_addr = k_addr + kBN * kRowBytes;
        // Per-lane offsets and row data, re-materialised each tile (cheaper than spilling
        // their derived addresses and limits).
        const u32 off_a = kWG ? 0u : opaque(off_a0), off_b = kWG ? 0u : opaque(off_b0),
                  off_v = kWG ? 0u : opaque(off_v0);
        const u32 row_qls = opaque(row_qls0);
        int spage;
        int kstart = real ? tile_start(t, spage) : 0;
        int kw0 = kstart + wn * kKW;  // first key of this warp's slice
        bool tile_bad = flags & 1u;
        flags >>= 1;

        // Is any row of this warp attending a key of the slice; does any need masking?
        u32 member = 0xffffffffu;  // bit 2*mt+h: the row's query listed this block (sparse)
        bool active, need_mask;
        u32 mt_on = (1u << kMT) - 1;  // bit mt: m-tile mt has a row attending this slice
        if constexpr (kSparse) {
            const int u = t / kTilesPerBlock;
            bool any = false, full = true;
            u32 live = 0;
            member = 0;
#pragma unroll
            for (int i = 0; i < 2 * kMT; ++i) {
                const int ql = (row_qls >> (8 * i)) & 0xff;
                if (ql == 0xff || !real) continue;
                const bool mem = ql < nq && ((sQmask[ql * qmask_words + (u >> 5)] >> (u & 31)) & 1u);
                const int lim = row_limit(ql);
                member |= (mem ? 1u : 0u) << i;
                live |= (mem && kw0 < lim ? 1u : 0u) << i;
                full &= mem && kw0 + kKW <= lim;
            }
            any = live != 0;
            active = __any_sync(0xffffffffu, any);
            need_mask = tile_bad || !__all_sync(0xffffffffu, full);
            if constexpr (!kWG && kMT > 1) {
                // Per-token lists: an m-tile (one query of a 16-head group) often did not pick
                // the block its warp-mate did; skip its MMAs and softmax step.
                u32 mine = 0;
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) mine |= ((live >> (2 * mt)) & 3u) ? (1u << mt) : 0u;
                mt_on = __reduce_or_sync(0xffffffffu, mine);
            }
        } else {
            active = real && kw0 < warp_lim_hi;
            need_mask = tile_bad || kw0 + kKW > warp_lim_lo;
        }
        // A warpgroup issues its MMAs together: it skips a tile only when none of its warps needs it.
        // Block-sparse: a warp of an active warpgroup with no row attending the tile (with
        // per-token lists, most warps) skips masking and softmax: its P is zero, its running
        // max, sum and O stay as they are. (Dense kernels keep their registers for the MMAs.)
        bool warp_on = active;
        if constexpr (kWG) active = warpgroup_any(active, 1 + wgrp);

        // S = Q K^T of the tile at k_addr, 64 x kBN per warpgroup; k-step ks reads 32 bytes of
        // column block ks / 4 of Q and K.
        auto wg_qk = [&](u32 kaddr) {
            const u64 k_desc = wg_desc(kaddr, 16, 1024);
            wg_fence();
            wg_issue_qk<kD, kM, kBN, Elem>(&S[0][0][0], q_desc, k_desc);
            wg_commit();
            wg_wait<0>();
            wg_fence_regs<kNT * 4>(&S[0][0][0]);
        };

        if (rot) {
            // Softmax and O += P V below run on the previous tile (whose S is in registers);
            // this tile's metadata waits for the next iteration.
            bool b;
            int i;
            u32 w;
            b = active, active = p_active, p_active = b;
            b = warp_on, warp_on = p_warp_on, p_warp_on = b;
            b = need_mask, need_mask = p_need_mask, p_need_mask = b;
            b = tile_bad, tile_bad = p_tile_bad, p_tile_bad = b;
            i = kstart, kstart = p_kstart, p_kstart = i;
            i = stage, stage = p_stage, p_stage = i;
            w = member, member = p_member, p_member = w;
            w = k_addr, k_addr = p_k_addr, p_k_addr = w;
            w = v_addr, v_addr = p_v_addr, p_v_addr = w;
            kw0 = kstart + wn * kKW;
        }
        if (!active) {
            if (rot && p_active) wg_qk(p_k_addr);
            continue;
        }

        // ---- S = Q K^T (raw scores) ----
        if constexpr (kWG) {
            if (!rot) wg_qk(k_addr);
        } else {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int n8 = 0; n8 < kNT; ++n8) S[mt][n8][0] = S[mt][n8][1] = S[mt][n8][2] = S[mt][n8][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks) {
            u32 a[kMT][4];
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
                if ((mt_on >> mt) & 1u) ldsm_x4(a[mt], sQ_addr + ((off_a + mt * 16 * kRowBytes) ^ (ks * 32)));
#pragma unroll
            for (int np = 0; np < kNT / 2; ++np) {
                u32 bf[4];
                ldsm_x4(bf, k_addr + ((off_b + np * 16 * kRowBytes) ^ (ks * 32)));
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) {
                    if (!((mt_on >> mt) & 1u)) continue;
                    QkMma<Elem>::run(S[mt][2 * np], a[mt], bf);
                    QkMma<Elem>::run(S[mt][2 * np + 1], a[mt], bf + 2);
                }
            }
        }
        }

        if (kWG && kSparse && !warp_on) {
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (int n8 = 0; n8 < kNT; ++n8) S[mt][n8][0] = S[mt][n8][1] = S[mt][n8][2] = S[mt][n8][3] = 0.f;
        } else {
        if (need_mask)
            mask_scores<kMT, kNT>(S, row_qls, member, row_limit, kw0, t4, tile_bad ? sFlags + stage * kBN : nullptr,
                                  kstart);

        // ---- online softmax ----
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
            if ((mt_on >> mt) & 1u) online_softmax_update<kNT, kDT>(S[mt], O[mt], m_run[mt], l_run[mt], scale_log2);
        }

        // ---- O += P V (P converted to the MMA operand type first, so S dies early) ----
        if constexpr (!kFp8) {
            u32 pa[kMT][kKW / 16][4];
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
                for (int kk = 0; kk < kKW / 16; ++kk) {
                    pa[mt][kk][0] = pack2<Mma16>(S[mt][2 * kk][0], S[mt][2 * kk][1]);
                    pa[mt][kk][1] = pack2<Mma16>(S[mt][2 * kk][2], S[mt][2 * kk][3]);
                    pa[mt][kk][2] = pack2<Mma16>(S[mt][2 * kk + 1][0], S[mt][2 * kk + 1][1]);
                    pa[mt][kk][3] = pack2<Mma16>(S[mt][2 * kk + 1][2], S[mt][2 * kk + 1][3]);
                }
            }
            if constexpr (kWG) {
                // O[64 x D] += P[64 x kBN] V[kBN x D]: per 16-key step one n64 MMA per 64-dim
                // column block of V (MN-major); waited for at the top of the next tile.
                const u64 v_desc = wg_desc(v_addr, 16, 1024);
                // The rescaled O and the packed P are written before the fence (pinned here).
                wg_fence_regs<kDT * 4>(&O[0][0][0]);
                wg_fence_regs<kBN / 4>(&pa[0][0][0]);
                wg_fence();
#pragma unroll
                for (int kk = 0; kk < kBN / 16; ++kk) {
#pragma unroll
                    for (int cb = 0; cb < kD / 64; ++cb)
                        WgmmaRS<64, Mma16>::run(&O[0][8 * cb][0], pa[0][kk],
                                                wg_desc_add(v_desc, cb * (kBN * 128) + kk * 2048), 1);
                }
                wg_commit();
                // Waited for here: deferring it across the loop back-edge makes ptxas serialize the MMAs.
                wg_wait<0>();
                wg_fence_regs<kDT * 4>(&O[0][0][0]);
                if (rot && p_active) wg_qk(p_k_addr);  // this iteration's tile, for the next one
            } else {
#pragma unroll
            for (int kk = 0; kk < kKW / 16; ++kk) {
#pragma unroll
                for (int dp = 0; dp < kDT / 2; ++dp) {
                    u32 bf[4];
                    ldsm_x4_t(bf, v_addr + ((off_v + kk * 16 * kRowBytes) ^ (dp * 32)));
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt) {
                        if (!((mt_on >> mt) & 1u)) continue;
                        mma_16x8x16<Mma16>(O[mt][2 * dp], pa[mt][kk], bf);
                        mma_16x8x16<Mma16>(O[mt][2 * dp + 1], pa[mt][kk], bf + 2);
                    }
                }
            }
            }
        } else {
            u32 pa[kMT][kKW >= 32 ? kKW / 32 : 1][4];  // (this branch is compiled, not run, for 16-bit types)
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
                for (int kk = 0; kk < kKW / 32; ++kk) {
                    const float(&s0)[4] = S[mt][4 * kk];
                    const float(&s1)[4] = S[mt][4 * kk + 1];
                    const float(&s2)[4] = S[mt][4 * kk + 2];
                    const float(&s3)[4] = S[mt][4 * kk + 3];
                    pa[mt][kk][0] = pack4_e4m3(s0[0] * kPScale, s0[1] * kPScale, s1[0] * kPScale, s1[1] * kPScale);
                    pa[mt][kk][1] = pack4_e4m3(s0[2] * kPScale, s0[3] * kPScale, s1[2] * kPScale, s1[3] * kPScale);
                    pa[mt][kk][2] = pack4_e4m3(s2[0] * kPScale, s2[1] * kPScale, s3[0] * kPScale, s3[1] * kPScale);
                    pa[mt][kk][3] = pack4_e4m3(s2[2] * kPScale, s2[3] * kPScale, s3[2] * kPScale, s3[3] * kPScale);
                }
            }
#pragma unroll
            for (int kk = 0; kk < kKW / 32; ++kk) {
#pragma unroll
                for (int c = 0; c < kD / 16; ++c) {
                    u32 be[2], bo[2];
                    ldsm_vt_e4m3(be, bo, v_addr + ((off_v + kk * 32 * kRowBytes) ^ (c * 16)));
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt) {
                        if (!((mt_on >> mt) & 1u)) continue;
                        mma_16x8x32_e4m3(O[mt][2 * c], pa[mt][kk], be);
                        mma_16x8x32_e4m3(O[mt][2 * c + 1], pa[mt][kk], bo);
                    }
                }
            }
        }
    }

    // ---- epilogue: merge the key-split warps, normalise, store ----
    Epilogue::store(
        O, m_run, l_run, sR, tid, m_base, g, t4, wn, row0, rows_total, group, q_start, kvh, num_heads_q, total_q,
        split, out, lse, ws_o, ws_lse, out_tok_stride, out_head_stride, scale_log2, out_scale);
}
#endif  // ATT_WS

// Combine split-KV partials: one warp per (query, head) row of request blockIdx.y.
//   ws_o [splits, total_q*Hq, D] f32 (normalised per split), ws_lse [splits, total_q*Hq];
//   out [total_q, Hq, D] (strided), lse [total_q, Hq] f32 or null.
extern "C" __global__ void __launch_bounds__(128) msa_attention_merge_kernel(
    const float* __restrict__ ws_o, const float* __restrict__ ws_lse, OutT* __restrict__ out,
    float* __restrict__ lse, const int* __restrict__ cu_seqlens_q, const int* __restrict__ qo_lens, int total_q,
    int num_heads_q, int num_splits, long long out_tok_stride, long long out_head_stride) {
    merge_split_rows<kD>(ws_o, ws_lse, out, lse, cu_seqlens_q, qo_lens, total_q, num_heads_q, num_splits,
                         out_tok_stride, out_head_stride);
}

