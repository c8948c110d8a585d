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
// row_tiles x batch x (KV head * splits) in L2 sections of l2_section (request, KV head,
// split) triples (row_tiles, batch, l2_section: ignored by the other tiles).
// CTA: ATT_WARPS_M x ATT_WARPS_N warps; warp (wm, wn) owns ATT_MTILES 16-row
// m-tiles and the wn-th slice of ATT_BLOCK_N / ATT_WARPS_N keys of each K/V
// tile (decode shapes split the keys across warps and merge at the end).
// K/V tiles stream through an ATT_STAGES-deep cp.async ring with one barrier
// per tile. S = Q K^T and O += P V run on mma.sync (m16n8k16 fp16/bf16,
// m16n8k32 e4m3 with P quantised to e4m3 after scaling by 256).
//
// On sm_90a (fp16/bf16, D 64/128; ATT_WS) the kernel body is instead the warp-specialised
// mainloop of attention/mainloop_sm90.cuh: a producer warpgroup and two consumer
// warpgroups of warpgroup MMAs, for dense, paged and block-sparse KV.
//
// This file is the mma.sync mainloop; masking (attention/mask.cuh) and the epilogue and
// split-KV combine (attention/epilogue.cuh) are role headers.
//
// Compile-time specialisation (macros): ATT_HEAD_DIM, ATT_DTYPE (0 fp16,
// 1 bf16, 2 e4m3), ATT_WARPS_M, ATT_MTILES, ATT_WARPS_N, ATT_BLOCK_N,
// ATT_STAGES, ATT_KV (0 dense, 1 paged, 2 block-sparse), ATT_MIN_BLOCKS, ATT_WS (1: the
// warp-specialised mainloop of attention/mainloop_sm90.cuh: a producer warpgroup and
// ATT_WARPS_M / 4 = 2 consumer warpgroups of warpgroup MMAs, mbarrier-tracked K/V stages;
// with ATT_WS_PRODUCER_REGS / ATT_WS_CONSUMER_REGS, their registers after setmaxnreg),
// ATT_SMEM_FIXED (host's view of the fixed shared-memory bytes, checked below; the
// warp-specialised variants get 1024 more bytes from the host to align the tiles).
#include "common/dtype.cuh"
#include "common/mma.cuh"
#include "common/attention_tile.cuh"
#include "common/softmax.cuh"
#include "common/kv_pages.cuh"
#include "common/request_rows.cuh"
#include "common/block_union.cuh"
#include "common/attention_wgmma.cuh"
#include "common/tma.cuh"
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
constexpr int kPrefetch = ATT_STAGES - 1;  // tiles loaded ahead of the one being computed

// Q and K/V tile layouts of the mma.sync tiles: row-swizzled for ldmatrix.
typedef SwizzledTile<kRowBytes> QTile;
typedef SwizzledTile<kRowBytes> KvTile;

static_assert(kD == 64 || kD == 128 || kD == 256, "head dim");
static_assert(kKW % (kFp8 ? 32 : 16) == 0, "a warp's key slice must fill whole PV k-steps");
static_assert(kThreads % kChunks == 0, "K/V tile loads cover whole rows per pass");
static_assert(kBN <= kSparseBlock && kSparseBlock % kBN == 0, "key tiles must tile a 128-key block");
static_assert(kStages >= 2 && kStages <= 4, "pipeline depth");
static_assert(!kWS || (!kFp8 && (kD == 64 || kD == 128) && kWN == 1 && kMT == 1 && kWM == 8 && kBN == 128),
              "warp-specialised tiles: fp16/bf16, D 64/128, two consumer warpgroups of wgmma, 128 keys");

constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }
constexpr int cmax(int a, int b) { return a > b ? a : b; }

// Shared memory: [Q tile][region: K/V stages | epilogue | sparse scratch][page flags][sparse lists]
constexpr int kQBytes = kM * kRowBytes;
constexpr int kStageBytes = 2 * kBN * kRowBytes;
typedef AttentionEpilogue<kD, kM, kMT, kWN, kThreads, kFp8> Epilogue;
constexpr int kEpiBytes = Epilogue::kSmemBytes;
constexpr int kRegionBytes = round_up(cmax(kStages * kStageBytes, kEpiBytes), 128);
// (warp-specialised tiles: their mbarriers, work item and stage metadata instead)
constexpr int kFlagBytes = kWS ? round_up(ws_bar_bytes(kStages, ATT_KV), 128) : round_up(kStages * kBN, 128);
constexpr int kSmemFixed = kQBytes + kRegionBytes + kFlagBytes;
static_assert(kSmemFixed == ATT_SMEM_FIXED, "host and device disagree on the shared-memory layout");
// Sparse scratch (bitmap + prefix words) aliases the region.
constexpr int kUnionWords = kRegionBytes / 8;
#if ATT_WS
// Warp-specialised tiles: the ring is the region; the mbarriers, the work item and the key
// flags sit in the page-flag bytes.
typedef MainloopSm90<kD, kBN, kStages, Elem, ATT_KV, ATT_WS_PRODUCER_REGS * 1000 + ATT_WS_CONSUMER_REGS> WsMainloop;
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
    int page_size_log2, int page_list_len, int list_width, int nq_cap, int qmask_words, int union_words,
    int num_splits, int row_tiles, int batch, int l2_section, float scale_log2, float out_scale,
    const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
    const __grid_constant__ TensorMap v_map) {
    extern __shared__ __align__(kWS ? 1024 : 128) unsigned char smem_raw[];
    // wgmma tiles need 1024-byte aligned shared addresses (the host adds 1024 bytes for this).
    unsigned char* smem = smem_raw + (kWS ? ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u) : 0u);
    unsigned char* sQ = smem;
    unsigned char* sR = smem + kQBytes;
    unsigned char* sFlags = sR + kRegionBytes;
#if ATT_WS
    // Block-sparse: [ulist | upage: nq_cap * W ints each][membership: 2 x nq_cap * qmask_words]
    // [union bitmap | prefix: union_words each] after the flag bytes.
    auto ws_sparse_lists = [](const int* lists, int width, int nq_cap, int qwords, int union_words,
                              unsigned char* base) {
        SparseLists sp;
        sp.lists = lists;
        sp.width = width;
        sp.nq_cap = nq_cap;
        sp.qwords = qwords;
        sp.union_words = union_words;
        sp.ulist = reinterpret_cast<int*>(base);
        sp.upage = sp.ulist + nq_cap * width;
        sp.qmask = reinterpret_cast<u32*>(sp.upage + nq_cap * width);
        sp.scratch = sp.qmask + 2 * nq_cap * qwords;
        return sp;
    };
    WsMainloop::run(q, k, v, out, lse, ws_o, ws_lse, cu_seqlens_q, qo_lens, kv_lens, qo_offset, cu_seqlens_k,
                    page_list, page_indptr, q_tok_stride, q_head_stride, out_tok_stride, out_head_stride,
                    k_page_stride, k_slot_stride, k_head_stride, v_page_stride, v_slot_stride, v_head_stride,
                    total_q, kv_extent, num_heads_q, num_heads_kv, group, causal, page_size_log2, page_list_len,
                    num_splits, row_tiles, batch, l2_section, scale_log2, smem_u32(sQ), smem_u32(sR), smem_u32(sFlags), sFlags,
                    ws_sparse_lists(block_lists, list_width, nq_cap, qmask_words, union_words, sFlags + kFlagBytes),
                    &q_map, &k_map, &v_map);
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
        __shared__ int union_warp_total[kThreads / 32];
        nq = min(qi_last - qi_first + 1, nq_cap);
        int nb = (kend + kSparseBlock - 1) / kSparseBlock;
        nb = min(nb, min(pages.count, kUnionWords * 32));
        const long long list_row0 = ((long long)(q_start + qi_first) * num_heads_kv + kvh) * list_width;
        const int U = build_block_union<kThreads>(
            block_lists, list_row0, (long long)num_heads_kv * list_width, list_width, nq, max(nb, 0), pages, kv_extent,
            reinterpret_cast<u32*>(sR), reinterpret_cast<int*>(sR) + kUnionWords, sList, sPage, sQmask, qmask_words,
            union_warp_total);
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
                    const u32 so = (kLdStep % 8 == 0) ? i * kLdStep * kRowBytes
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

    float S[kMT][kNT][4];

    for (int t = t_begin, n = 0; t < t_end; ++t, ++n) {
        const int stage = n % kStages;
        cp_async_wait<kPrefetch - 1>();
        if constexpr (kPaged && !kSparse) {
            if (__syncthreads_or(pending_bad)) flags |= 1u << (kPrefetch - 1);
        } else {
            __syncthreads();
        }
        // Stage (n - 1) % kStages is free: every warp finished it.
        pending_bad = issue_tile(t + kPrefetch, (n + kPrefetch) % kStages);

        const u32 k_addr = sR_addr + stage * kStageBytes;
        const u32 v_addr = k_addr + kBN * kRowBytes;
        // Per-lane offsets and row data, re-materialised each tile (cheaper than spilling
        // their derived addresses and limits).
        const u32 off_a = opaque(off_a0), off_b = opaque(off_b0), off_v = opaque(off_v0);
        const u32 row_qls = opaque(row_qls0);
        int spage;
        const int kstart = tile_start(t, spage);
        const int kw0 = kstart + wn * kKW;  // first key of this warp's slice
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
                if (ql == 0xff) continue;
                const bool mem = ql < nq && ((sQmask[ql * qmask_words + (u >> 5)] >> (u & 31)) & 1u);
                const int lim = row_limit(ql);
                member |= (mem ? 1u : 0u) << i;
                live |= (mem && kw0 < lim ? 1u : 0u) << i;
                full &= mem && kw0 + kKW <= lim;
            }
            any = live != 0;
            active = __any_sync(0xffffffffu, any);
            need_mask = tile_bad || !__all_sync(0xffffffffu, full);
            if constexpr (kMT > 1) {
                // Per-token lists: an m-tile (one query of a 16-head group) often did not pick
                // the block its warp-mate did; skip its MMAs and softmax step.
                u32 mine = 0;
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) mine |= ((live >> (2 * mt)) & 3u) ? (1u << mt) : 0u;
                mt_on = __reduce_or_sync(0xffffffffu, mine);
            }
        } else {
            active = kw0 < warp_lim_hi;
            need_mask = tile_bad || kw0 + kKW > warp_lim_lo;
        }
        if (!active) continue;

        // ---- S = Q K^T (raw scores) ----
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

        if (need_mask)
            mask_scores<kMT, kNT>(S, row_qls, member, row_limit, kw0, t4, tile_bad ? sFlags + stage * kBN : nullptr,
                                  kstart);

        // ---- online softmax ----
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
            if ((mt_on >> mt) & 1u) online_softmax_update<kNT, kDT>(S[mt], O[mt], m_run[mt], l_run[mt], scale_log2);

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

