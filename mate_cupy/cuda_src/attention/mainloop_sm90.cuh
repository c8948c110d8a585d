// Warp-specialised Hopper mainloop of the dense attention forward (sm_90a, fp16/bf16).
//
// A CTA of three warpgroups owns 128 packed rows (GQA: row P = query * group + head in
// group) of one request and KV head, like the other query tiles:
//
//   warpgroup 0, the producer (setmaxnreg down): its 128 threads stream K and V tiles of
//     kBN keys with 16-byte cp.async into a kStages-deep ring; each stage has a "full"
//     mbarrier per operand, completed by the producer threads' cp.async.mbarrier.arrive
//     .noinc (128 arrivals once their copies land), and an "empty" mbarrier the consumer
//     warps arrive on (8 arrivals) once their MMAs have read the stage. K and V have their
//     own barriers: K of tile n is loaded before V of tile n - 1, the order the consumers
//     read them in.
//   warpgroups 1 and 2, the consumers (setmaxnreg up): 64 rows each, S = Q K^T with both
//     operands in shared memory, O += P V with P from registers (attention_wgmma.cuh).
//     Inside a warpgroup the product of the next tile overlaps the softmax of the
//     current one (FlashAttention-3): iteration n issues S_n = Q K_n^T and then
//     O += P_{n-1} V_{n-1} (O rescaled first), waits for S_n only, masks it and runs the
//     online softmax while the PV product is in flight, then waits for it and packs P_n.
//     Between the warpgroups the issue sections (the MMAs of one iteration) alternate
//     through two named barriers, so one warpgroup's softmax runs under the other's MMAs.
//
// The CTA is persistent: it walks work items (row tile, request, KV head and split) in a
// static heaviest-first order, and the producer runs ahead into the next item: it loads
// the next Q tile (one buffer, with its own full/empty mbarriers) as soon as the consumers'
// last Q K^T of the current item has completed, then that item's K/V tiles.
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
#include "../common/warp_specialized.cuh"
#include "mask.cuh"

namespace mate {
namespace attn {

template <int kD, int kBN, int kStages, typename Elem>
struct DenseMainloopSm90 {
    static constexpr int kM = 128;  // rows per CTA: two consumer warpgroups of 64
    static constexpr int kThreads = 384;
    static constexpr int kProducerRegs = 40;
    static constexpr int kConsumerRegs = 232;  // 128 * 40 + 256 * 232 <= 65536
    static constexpr int kRowBytes = kD * 2;
    static constexpr int kChunks = kRowBytes / 16;  // 16-byte chunks per row
    static constexpr int kNT = kBN / 8;             // S n-tiles per warp
    static constexpr int kDT = kD / 8;              // O n-tiles per warp
    static constexpr int kTileBytes = kBN * kRowBytes;
    static constexpr int kStageBytes = 2 * kTileBytes;  // K then V
    // full/empty x K/V x stages, Q full/empty, then the current item's geometry (Item)
    static constexpr int kItemOffset = 4 * kStages * 8 + 16;
    static constexpr int kBarBytes = kItemOffset + 64;
    // Named barriers: 1 + w: consumer warpgroup w's issue turn.
    static constexpr int kBarTurn = 1;
    typedef ColumnBlockTile<kM> QTile;
    typedef ColumnBlockTile<kBN> KvTile;
    static_assert(kD == 64 || kD == 128, "head dim");
    static_assert(kBN == 64 || kBN == 128, "keys per tile");
    static_assert(kStages >= 2 && kStages <= 4, "pipeline depth");
    static_assert(128 % kChunks == 0 && kBN % (128 / kChunks) == 0, "K/V tile loads cover whole rows per pass");
    static_assert((128 / kChunks) % 8 == 0, "a producer thread's rows share one swizzle phase");

    // One work item: row tile, request and (KV head, split) of a CTA in the non-persistent
    // grid. The producer derives it from the item index and hands it to the consumers in
    // shared memory with the item's Q tile (n_count < 0: no more items).
    struct Item {
        long long k_row0, qoff;
        int row0, q_start, rows_total, Lk, qi_first, kvh, split, t_begin, n_count;
    };
    static_assert(sizeof(Item) <= 64, "item slot");
    // Item i, heaviest row tiles first (row tile index reversed, then request, then head):
    // false when the row tile lies past the request.
    static __device__ __forceinline__ bool item_at(long long i, int row_tiles, int batch, int heads_splits,
                                                   int num_splits, const int* __restrict__ cu_seqlens_q,
                                                   const int* __restrict__ qo_lens, const int* __restrict__ kv_lens,
                                                   const int* __restrict__ qo_offset,
                                                   const int* __restrict__ cu_seqlens_k, int total_q, int kv_extent,
                                                   int group, int causal, Item& it) {
        const long long per_rt = (long long)batch * heads_splits;
        const int rt = (int)(i / per_rt);
        const long long rem = i - rt * per_rt;
        const int b = (int)(rem / heads_splits), z = (int)(rem - (long long)b * heads_splits);
        it.kvh = z / num_splits;
        it.split = z - it.kvh * num_splits;
        it.row0 = (row_tiles - 1 - rt) * kM;
        const QueryRows qr = query_rows(cu_seqlens_q, qo_lens, total_q, b);
        it.q_start = qr.start;
        it.rows_total = qr.len * group;
        if (it.row0 >= it.rows_total) return false;
        int Lk = max(kv_lens[b], 0);
        it.k_row0 = 0;
        const int ks = cu_seqlens_k[b];
        if (ks < 0 || ks > kv_extent) {
            Lk = 0;
        } else {
            Lk = min(Lk, kv_extent - ks);
            it.k_row0 = ks;
        }
        it.Lk = Lk;
        it.qoff = qo_offset[b];
        it.qi_first = it.row0 / group;
        const int qi_last = min(qr.len - 1, (it.row0 + kM - 1) / group);
        const int kend = causal ? (int)max(0LL, min((long long)Lk, it.qoff + qi_last + 1)) : Lk;
        const int n_tiles = (kend + kBN - 1) / kBN;
        const int per_split = (n_tiles + num_splits - 1) / num_splits;
        it.t_begin = min(n_tiles, it.split * per_split);
        it.n_count = min(n_tiles, it.t_begin + per_split) - it.t_begin;
        return true;
    }

    // Persistent: the CTAs walk the items of row_tiles x batch x (Hkv * splits) in waves of
    // gridDim.x items.
    // sQ, sKV: shared addresses of the Q tile and the ring (1024-byte aligned); bars: kBarBytes
    // of shared memory (8-byte aligned), the item slot at kItemOffset (its generic pointer).
    template <typename OutT>
    static __device__ __forceinline__ void run(
        const Elem* __restrict__ q, const Elem* __restrict__ k, const Elem* __restrict__ v, OutT* __restrict__ out,
        float* __restrict__ lse, float* __restrict__ ws_o, float* __restrict__ ws_lse,
        const int* __restrict__ cu_seqlens_q, const int* __restrict__ qo_lens, const int* __restrict__ kv_lens,
        const int* __restrict__ qo_offset, const int* __restrict__ cu_seqlens_k, long long q_tok_stride,
        long long q_head_stride, long long out_tok_stride, long long out_head_stride, long long k_slot_stride,
        long long k_head_stride, long long v_slot_stride, long long v_head_stride, int total_q, int kv_extent,
        int num_heads_q, int num_heads_kv, int group, int causal, int num_splits, int row_tiles, int batch,
        float scale_log2, u32 sQ, u32 sKV, u32 bars, Item* slot) {
        const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
        const int wg = warp >> 2;
        const int heads_splits = num_heads_kv * num_splits;
        const long long n_items = (long long)row_tiles * batch * heads_splits;
        // This CTA's item of wave w: waves alternate direction (CTA c takes item c of wave 0,
        // the c-th lightest of wave 1, ...), so the heaviest-first order balances the CTAs.
        // False when there is none (past the last item, or past its request's rows).
        auto item = [&](long long w, Item& it) {
            const long long i =
                w * gridDim.x + ((w & 1) ? (long long)gridDim.x - 1 - blockIdx.x : (long long)blockIdx.x);
            return i < n_items && item_at(i, row_tiles, batch, heads_splits, num_splits, cu_seqlens_q, qo_lens, kv_lens, qo_offset,
                           cu_seqlens_k, total_q, kv_extent, group, causal, it);
        };

        // Barriers: full K [s], full V [s], empty K [s], empty V [s], Q full, Q empty. Q full
        // also publishes the item slot: 128 cp.async arrivals and thread 0's arrival after
        // writing the slot.
        const u32 full_k = bars, full_v = bars + 8 * kStages, empty_k = bars + 16 * kStages,
                  empty_v = bars + 24 * kStages, q_full = bars + 32 * kStages, q_empty = q_full + 8;
        if (tid == 0) {
#pragma unroll
            for (int s = 0; s < kStages; ++s) {
                mbar_init(full_k + 8 * s, 128);
                mbar_init(full_v + 8 * s, 128);
                mbar_init(empty_k + 8 * s, 8);
                mbar_init(empty_v + 8 * s, 8);
            }
            mbar_init(q_full, 129);
            mbar_init(q_empty, 256);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();

        if (wg == 0) {
            // ================= producer =================
            regs_release<kProducerRegs>();
            constexpr int kStep = 128 / kChunks;  // rows between one thread's chunks
            const int c = tid % kChunks, r0 = tid / kChunks;
            const u32 kv_off = sKV + KvTile::offset(r0, c);
            const u32 q_off = sQ + QTile::offset(r0, c);
            int kv_n = 0;  // K/V tiles loaded so far (ring position)
            int q_n = 0;   // Q tiles loaded so far
            for (long long w = 0; w * gridDim.x < n_items; ++w) {
                Item it;
                if (!item(w, it)) continue;
                // Q: the item's 128 packed rows (zero past the request), once the consumers'
                // last Q K^T of the previous item has completed; the item's geometry with it.
                mbar_wait(q_empty, (q_n & 1) ^ 1);
                if (tid == 0) *slot = it;
#pragma unroll 4
                for (int j = 0; j < kM / kStep; ++j) {
                    const int P = it.row0 + r0 + j * kStep;
                    const bool ok = P < it.rows_total;
                    const Elem* src = q;
                    if (ok) {
                        const int qi = P / group, h = P - qi * group;
                        src = q + (long long)(it.q_start + qi) * q_tok_stride +
                              (long long)(it.kvh * group + h) * q_head_stride + c * 8;
                    }
                    cp_async_16_u32(q_off + j * kStep * 128, src, ok);
                }
                cp_async_mbar_arrive_noinc(q_full);
                if (tid == 0) mbar_arrive(q_full);
                ++q_n;
                const Elem* kb = k + (long long)it.kvh * k_head_stride + c * 8;
                const Elem* vb = v + (long long)it.kvh * v_head_stride + c * 8;
                // Tile t of an operand (base, stride) into the shared tile at dst; keys past the
                // request are zero-filled. Completes on `full` (this thread's arrival).
                auto load_tile = [&](const Elem* base, long long stride, int t, u32 dst, u32 full) {
                    const int kstart = t * kBN;
                    const Elem* p = base + (it.k_row0 + kstart + r0) * stride;
                    const long long step = kStep * stride;
#pragma unroll
                    for (int j = 0; j < kBN / kStep; ++j) {
                        const bool ok = kstart + r0 + j * kStep < it.Lk;
                        cp_async_16_u32(dst + j * kStep * 128, ok ? p : base, ok);
                        p += step;
                    }
                    cp_async_mbar_arrive_noinc(full);
                };
                // K of tile n, then V of tile n - 1 (the order the consumers read them in).
                for (int n = 0; n <= it.n_count; ++n) {
                    if (n < it.n_count) {
                        const int g = kv_n + n, s = g % kStages;
                        mbar_wait(empty_k + 8 * s, ((g / kStages) & 1) ^ 1);
                        load_tile(kb, k_slot_stride, it.t_begin + n, kv_off + s * kStageBytes, full_k + 8 * s);
                    }
                    if (n >= 1) {
                        const int g = kv_n + n - 1, s = g % kStages;
                        mbar_wait(empty_v + 8 * s, ((g / kStages) & 1) ^ 1);
                        load_tile(vb, v_slot_stride, it.t_begin + n - 1, kv_off + s * kStageBytes + kTileBytes,
                                  full_v + 8 * s);
                    }
                }
                kv_n += it.n_count;
            }
            // No more items.
            mbar_wait(q_empty, (q_n & 1) ^ 1);
            if (tid == 0) slot->n_count = -1;
            cp_async_mbar_arrive_noinc(q_full);
            if (tid == 0) mbar_arrive(q_full);
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
#pragma unroll
            for (int d = 0; d < kDT; ++d) {
                O[d][0] *= alpha[0];
                O[d][1] *= alpha[0];
                O[d][2] *= alpha[1];
                O[d][3] *= alpha[1];
            }
        };
        // A warp's lane 0 releases a stage once the warpgroup's MMAs on it have completed.
        auto release = [&](u32 bar) {
            if (lane == 0) mbar_arrive(bar);
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
            // Mask (where this warp's rows need it) and the online softmax of tile t's scores.
            auto softmax = [&](int t) {
                const int kstart = t * kBN;
                if (kstart + kBN > warp_lim_lo)
                    mask_scores<1, kNT>(S, row_qls, 0xffffffffu, row_limit, kstart, t4, nullptr, kstart);
                online_softmax_scores<kNT>(S[0], m_run, l_run, scale_log2, alpha);
            };

#pragma unroll
            for (int d = 0; d < kDT; ++d) O[d][0] = O[d][1] = O[d][2] = O[d][3] = 0.f;
            m_run[0] = m_run[1] = kNegInf;
            l_run[0] = l_run[1] = 0.f;

            if (n_count > 0) {
                // Issue sections alternate between the warpgroups: warpgroup 0 goes first, and
                // warpgroup 1 skips its last hand-over, so each item completes every barrier phase.
                if (cw == 1) named_arrive(turn_other, 256);
                {
                    const int s = kv_n % kStages;
                    mbar_wait(full_k + 8 * s, (kv_n / kStages) & 1);
                    fence_proxy_async_smem();
                    named_sync(turn_mine, 256);
                    issue_qk(sKV + s * kStageBytes);
                    if (!(cw == 1 && n_count == 1)) named_arrive(turn_other, 256);
                    wg_wait<0>();
                    wg_fence_regs<kNT * 4>(&S[0][0][0]);
                    release(empty_k + 8 * s);
                    if (n_count == 1) release_q();
                    softmax(it.t_begin);
                    pack_p();
                }
                for (int n = 1; n < n_count; ++n) {
                    const int gk = kv_n + n, gv = gk - 1;
                    const int s = gk % kStages, sp = gv % kStages;
                    // (V_{n-1} was loaded right after K_n: one proxy fence covers both.)
                    mbar_wait(full_k + 8 * s, (gk / kStages) & 1);
                    mbar_wait(full_v + 8 * sp, (gv / kStages) & 1);
                    fence_proxy_async_smem();
                    named_sync(turn_mine, 256);
                    issue_qk(sKV + s * kStageBytes);
                    rescale_o();
                    issue_pv(sKV + sp * kStageBytes + kTileBytes);
                    if (!(cw == 1 && n == n_count - 1)) named_arrive(turn_other, 256);
                    wg_wait<1>();  // S_n has landed; the PV product is still in flight
                    wg_fence_regs<kNT * 4>(&S[0][0][0]);
                    release(empty_k + 8 * s);
                    if (n == n_count - 1) release_q();  // the producer may load the next Q
                    softmax(it.t_begin + n);
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
            // Straight from the registers: a quad writes 16 contiguous bytes of a row per
            // n-tile (the Q tile is being refilled, the ring holds the next item's K/V).
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (!live[h]) continue;
                if (ws_o != nullptr) {
                    float* dst = ws_o + (it.split * split_rows + ridx[h]) * kD + 2 * t4;
#pragma unroll
                    for (int d = 0; d < kDT; ++d)
                        *reinterpret_cast<float2*>(dst + 8 * d) =
                            make_float2(O[d][2 * h] * inv[h], O[d][2 * h + 1] * inv[h]);
                } else {
                    OutT* dst = out + (long long)tok[h] * out_tok_stride + (long long)head[h] * out_head_stride + 2 * t4;
#pragma unroll
                    for (int d = 0; d < kDT; ++d)
                        *reinterpret_cast<u32*>(dst + 8 * d) = pack2<OutT>(O[d][2 * h] * inv[h], O[d][2 * h + 1] * inv[h]);
                }
            }
        }
    }
};

}  // namespace attn
}  // namespace mate
