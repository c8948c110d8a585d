// Prototype (bench/sweeps/block_gather.py): block-sparse prefill with per-token block lists,
// decomposed per key block ("block-stationary", docs/attention.md). Not a library kernel.
//
// block_gather_attn: one CTA per (KV head, key block, segment of the queries that picked the
// block). K and V of the block (128 keys, page = block, NHD cache [pages, 128, Hkv, 128])
// are loaded once; each warpgroup then takes groups of 4 queries (64 rows = 4 x 16 heads of
// the KV head's group), gathers their Q rows, and computes S = Q K^T, a one-block softmax
// and O = P V with wgmma. Writes O / l (fp16) and lse (log2 domain) to the pair's slot:
// part_o [S, Hkv, 16 slots, 16 heads, 128], part_lse [S, Hkv, 16, 16].
// block_gather_merge: out[q, kvh * 16 + h] = sum_j 2^(lse_j - M) O_j / sum_j 2^(lse_j - M)
// over the query's valid slots.
#include "common/dtype.cuh"
#include "common/mma.cuh"
#include "common/softmax.cuh"
#include "common/attention_wgmma.cuh"

using namespace mate;
using namespace mate::attn;

namespace {
constexpr int kD = 128, kBN = 128, kGroup = 16, kSlots = 16;
#ifndef BG_WGS
#define BG_WGS 2
#endif
#ifndef BG_QBUF
#define BG_QBUF 2
#endif
#ifndef BG_MINB
#define BG_MINB 1
#endif
constexpr int kWGs = BG_WGS, kThreads = 128 * kWGs;  // warpgroups per CTA, each its own 4-query groups
constexpr int kQBuf = BG_QBUF;  // Q tiles per warpgroup: 2 = the next group gathered while this one computes
constexpr int kTileBytes = kBN * kD * 2;  // 32 KB: K or V of one block
constexpr int kQBytes = 64 * kD * 2;      // 16 KB: one 64-row Q tile
typedef ColumnBlockTile<kBN> KvTile;
typedef ColumnBlockTile<64> QTile;
}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads, BG_MINB)
    block_gather_attn(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
                      const int* __restrict__ kv_indices, const int* __restrict__ cta_info,
                      const int* __restrict__ pair_q, const int* __restrict__ pair_slot, half_t* __restrict__ part_o,
                      float* __restrict__ part_lse, int S, int Hkv, int n_ctas, float scale_log2) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
    unsigned char* sK = smem;
    unsigned char* sV = smem + kTileBytes;
    unsigned char* sQ = smem + 2 * kTileBytes;  // [kWGs][kQBuf][kQBytes]
    const int c = blockIdx.x;
    if (c >= n_ctas) return;
    const int kvh = cta_info[4 * c], blk = cta_info[4 * c + 1], begin = cta_info[4 * c + 2], end = cta_info[4 * c + 3];
    const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, w = wtid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int Hq = Hkv * kGroup;
    const long long rs = (long long)Hkv * kD;  // elements between consecutive keys of a page
    const int page = kv_indices[blk];
    const bf16_t* kb = kc + (long long)page * kBN * rs + (long long)kvh * kD;
    const bf16_t* vb = vc + (long long)page * kBN * rs + (long long)kvh * kD;
    for (int i = tid; i < kBN * 16; i += kThreads) {
        const int r = i >> 4, ch = i & 15;
        cp_async_16(sK + KvTile::offset(r, ch), kb + r * rs + ch * 8);
        cp_async_16(sV + KvTile::offset(r, ch), vb + r * rs + ch * 8);
    }
    cp_async_commit();

    const int n_grp = (end - begin + 3) >> 2;
    auto load_q = [&](int grp, int buf) {
        if (grp < n_grp) {
            unsigned char* dst = sQ + (wg * kQBuf + buf) * kQBytes;
            for (int i = wtid; i < 64 * 16; i += 128) {
                const int r = i >> 4, ch = i & 15;
                const int pi = begin + 4 * grp + (r >> 4);
                const bool ok = pi < end;
                const bf16_t* src = q;
                if (ok) src = q + ((long long)pair_q[pi] * Hq + kvh * kGroup + (r & 15)) * kD + ch * 8;
                cp_async_16(dst + QTile::offset(r, ch), src, ok);
            }
        }
        cp_async_commit();
    };
    if (kQBuf == 2) load_q(wg, 0);
    cp_async_wait<0>();
    fence_proxy_async_smem();
    __syncthreads();

    const u64 k_desc = wg_desc(smem_u32(sK), 16, 1024);
    const u64 v_desc = wg_desc(smem_u32(sV), 16, 1024);
    int buf = 0;
    for (int grp = wg; grp < n_grp; grp += kWGs, buf ^= (kQBuf - 1)) {
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");  // the other buffer is free
        if (kQBuf == 2) {
            load_q(grp + kWGs, buf ^ 1);
            cp_async_wait<1>();
        } else {
            load_q(grp, 0);
            cp_async_wait<0>();
        }
        fence_proxy_async_smem();
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
        const u64 q_desc = wg_desc(smem_u32(sQ + (wg * kQBuf + buf) * kQBytes), 16, 1024);
        float S[16][4];
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < kD / 16; ++ks) {
            const u32 qo = (ks >> 2) * (64 * 128) + (ks & 3) * 32;
            const u32 ko = (ks >> 2) * (kBN * 128) + (ks & 3) * 32;
            if (ks == 0)
                WgmmaSS<kBN, bf16_t>::first(&S[0][0], wg_desc_add(q_desc, qo), wg_desc_add(k_desc, ko));
            else
                WgmmaSS<kBN, bf16_t>::run(&S[0][0], wg_desc_add(q_desc, qo), wg_desc_add(k_desc, ko), 1);
        }
        wg_commit();
        wg_wait<0>();
        wg_fence_regs<64>(&S[0][0]);
        // This warp's 16 rows are one query (its 16 heads): causal limit inside the block.
        const int pi = begin + 4 * grp + w;
        const bool live = pi < end;
        const int qi = live ? pair_q[pi] : 0;
        const int lim = live ? min(kBN, max(0, qi + 1 - blk * kBN)) : 0;  // keys j < lim attend
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
                    const float pv = fast_exp2(fmaf(S[n][2 * h + e], scale_log2, -ms));
                    S[n][2 * h + e] = pv;
                    sum += pv;
                }
            m[h] = mx;
            l[h] = sum;
        }
        u32 pa[8][4];
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            pa[kk][0] = pack2<bf16_t>(S[2 * kk][0], S[2 * kk][1]);
            pa[kk][1] = pack2<bf16_t>(S[2 * kk][2], S[2 * kk][3]);
            pa[kk][2] = pack2<bf16_t>(S[2 * kk + 1][0], S[2 * kk + 1][1]);
            pa[kk][3] = pack2<bf16_t>(S[2 * kk + 1][2], S[2 * kk + 1][3]);
        }
        float O[16][4];
#pragma unroll
        for (int n = 0; n < 16; ++n) O[n][0] = O[n][1] = O[n][2] = O[n][3] = 0.f;
        wg_fence_regs<64>(&O[0][0]);
        wg_fence_regs<32>(&pa[0][0]);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
#pragma unroll
            for (int cb = 0; cb < 2; ++cb)
                WgmmaRS<64, bf16_t>::run(&O[8 * cb][0], pa[kk], wg_desc_add(v_desc, cb * (kBN * 128) + kk * 2048), 1);
        wg_commit();
        wg_wait<0>();
        wg_fence_regs<64>(&O[0][0]);
        if (!live) continue;  // (warp-uniform: one query per warp)
        // O / l as fp16 through the bytes of this warp's own Q rows just consumed (its 16 rows
        // in both column blocks: 2 x 2 KB; head r at piece r / 8, row r % 8, 16-byte chunk n at
        // n ^ (r & 7)), then one contiguous 4 KB store: the slot's 16 heads x 128 values are
        // adjacent in part_o.
        const int slot = pair_slot[pi];
        const long long base = (((long long)qi * Hkv + kvh) * kSlots + slot) * kGroup;
        unsigned char* const qbuf = sQ + (wg * kQBuf + buf) * kQBytes + w * 2048;
        auto stg_row = [&](int r) { return qbuf + (r >> 3) * (64 * 128) + (r & 7) * 256; };
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float lt = quad_sum(l[h]);
            const float inv = lt > 0.f ? 1.f / lt : 0.f;
            const int r = g + 8 * h;
#pragma unroll
            for (int n = 0; n < 16; ++n)
                *reinterpret_cast<u32*>(stg_row(r) + ((n ^ (r & 7)) << 4) + 4 * t) =
                    pack2<half_t>(O[n][2 * h] * inv, O[n][2 * h + 1] * inv);
            if (t == 0) part_lse[base + r] = lt > 0.f ? m[h] * scale_log2 + __log2f(lt) : kNegInf;
        }
        __syncwarp();
        uint4* dst = reinterpret_cast<uint4*>(part_o + base * kD);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int k = lane + 32 * i, r = k >> 4, cc = k & 15;
            dst[k] = *reinterpret_cast<const uint4*>(stg_row(r) + ((cc ^ (r & 7)) << 4));
        }
    }
}

// One CTA of 128 threads per (query, KV head): thread (head = tid / 8, 16 columns).
extern "C" __global__ void __launch_bounds__(128)
    block_gather_merge(const half_t* __restrict__ part_o, const float* __restrict__ part_lse,
                       const int* __restrict__ ids, bf16_t* __restrict__ out, int S, int Hkv, int n_blocks) {
    const int qi = blockIdx.x, kvh = blockIdx.y;
    const int head = threadIdx.x >> 3, c0 = (threadIdx.x & 7) * 16;
    const long long base = ((long long)qi * Hkv + kvh) * kSlots;
    const int* row = ids + base;  // ids [S, Hkv, 16]
    float lse[kSlots];
    float M = kNegInf;
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
        const int b = row[j];
        const bool ok = b >= 0 && b < n_blocks && b * kBN <= qi;
        lse[j] = ok ? part_lse[(base + j) * kGroup + head] : kNegInf;
        M = fmaxf(M, lse[j]);
    }
    float acc[16], den = 0.f;
#pragma unroll
    for (int e = 0; e < 16; ++e) acc[e] = 0.f;
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
        if (lse[j] == kNegInf) continue;
        const float wj = exp2f(lse[j] - M);
        den += wj;
        const uint4* src = reinterpret_cast<const uint4*>(part_o + ((base + j) * kGroup + head) * kD + c0);
#pragma unroll
        for (int v = 0; v < 2; ++v) {
            const uint4 x = src[v];
            const u32 ws[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&ws[e]));
                acc[8 * v + 2 * e] += wj * f.x;
                acc[8 * v + 2 * e + 1] += wj * f.y;
            }
        }
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
    bf16_t* dst = out + ((long long)qi * Hkv * kGroup + kvh * kGroup + head) * kD + c0;
    uint4 o[2];
    u32* ow = reinterpret_cast<u32*>(o);
#pragma unroll
    for (int e = 0; e < 8; ++e) ow[e] = pack2<bf16_t>(acc[2 * e] * inv, acc[2 * e + 1] * inv);
    reinterpret_cast<uint4*>(dst)[0] = o[0];
    reinterpret_cast<uint4*>(dst)[1] = o[1];
}
