// MSA index kernels: per-128-key-block max scores and top-k block selection.
//
//   msa_block_max_score_kernel   max_score[i, h, t] = max_{admissible j in block t} q[i,h] . k[j, h/r]
//   msa_topk_select_kernel       per (query, head) row: forced blocks + the best remaining blocks
//                                (a warp or a CTA per row)
//   msa_topk_stream_kernel       the same selection, one warp per row streaming its scores (K <= 32)
//
// Semantics: SPEC sections 3 and 4; decisions and layouts: docs/index_kernels.md.
#include "common/dtype.cuh"
#include "common/mma.cuh"
#include "common/topk.cuh"
#include "common/attention_wgmma.cuh"
#include "common/warp_specialized.cuh"
#include "common/float_max.cuh"

using namespace mate;

// ============================================================================
// Top-k block selection
// ============================================================================
//
// One row (query i, head h) of max_score [R, NT] f32 is handled by a group of G
// threads: a warp (NW == 1, 8 rows per CTA) or a whole CTA (NW > 1, G = 32 NW).
// Each thread holds NPT scores of the row as order keys in registers (VEC = 4:
// 16-byte loads), read once with streaming loads. With V the row's valid block
// count, W the output width and K = W - begin - end the free slots:
//
//   V <= W           every valid block, then -1 (no score is read)
//   otherwise        [0, begin) ++ sorted(best K of [begin, V - end)) ++ [V - end, V)
//
// Best K, exactly: a lower bound t0 of the K-th largest key is the K-th largest
// of the per-thread maxima, or with TOP2 of each thread's two largest keys (they
// are distinct elements; TOP2 keeps the bound tight when 2 K > G, and warp rows,
// chosen only for K > 16, always use it). Keys >= t0 are
// compacted into shared memory (usually a few dozen) and one warp finds the
// K-th largest key T by a bitwise search over them, then resolves ties at T by
// a bitwise search over indices. If more than `cand_cap` keys pass t0 (heavy
// ties), the same searches run over the registers of the whole group instead.

constexpr int kTopkRowsPerWarpCta = 8;    // NW == 1: rows (warps) per CTA
constexpr int kTopkWarpCandidates = 256;  // NW == 1: candidate capacity per row
constexpr int kTopkCtaCandidates = 2048;  // NW > 1: candidate capacity per row
constexpr int kTopkMaxSelect = 64;        // W <= 64
enum { kTopkIndexBits = 14 };             // NT < 12288 < 2^14

template <int NW, bool TOP2>
struct TopkSmem {
    static constexpr int kCap = NW == 1 ? kTopkWarpCandidates : kTopkCtaCandidates;
    static constexpr int kMaxima = NW == 1 ? 1 : 32 * NW * (TOP2 ? 2 : 1);
    u32 cand_key[kCap];
    int cand_idx[kCap];
    int sel[kTopkMaxSelect];
    u32 maxima[kMaxima];
    int red[2 * NW];
    u32 bcast;
};

// Reductions over the threads that share one row: a warp or the whole CTA.
template <int NW>
struct RowGroup {
    int lane, warp;
    int* red;  // [2 * NW] shared, double-buffered by `parity`
    int parity;

    __device__ __forceinline__ void sync() {
        if constexpr (NW == 1) __syncwarp(); else __syncthreads();
    }
    __device__ __forceinline__ int sum(int x) {
        x = __reduce_add_sync(kFullMask, x);
        if constexpr (NW == 1) {
            return x;
        } else {
            if (lane == 0) red[parity * NW + warp] = x;
            __syncthreads();
            int s = 0;
#pragma unroll
            for (int w = 0; w < NW; ++w) s += red[parity * NW + w];
            parity ^= 1;
            return s;
        }
    }
    // Exclusive prefix over the group in thread order; `total` gets the sum.
    __device__ __forceinline__ int exclusive_scan(int x, int& total) {
        const int incl = warp_inclusive_scan(x, lane);
        const int wsum = __shfl_sync(kFullMask, incl, 31);
        if constexpr (NW == 1) {
            total = wsum;
            return incl - x;
        } else {
            if (lane == 31) red[parity * NW + warp] = wsum;
            __syncthreads();
            int before = 0, all = 0;
#pragma unroll
            for (int w = 0; w < NW; ++w) {
                const int v = red[parity * NW + w];
                all += v;
                before += w < warp ? v : 0;
            }
            parity ^= 1;
            total = all;
            return before + incl - x;
        }
    }
};

// One warp: the k best of the n candidates in shared memory (keys >= 1, all
// competing), written ascending to out[0..k).
template <class Smem>
__device__ __forceinline__ void select_from_candidates(Smem& s, int n, int k, int lane, int* out) {
    u32 T;
    int greater, equal;
    if (n <= 32) {
        const u32 ck = lane < n ? s.cand_key[lane] : 0u;
        T = kth_largest_key(k, [&](u32 c) { return __popc(__ballot_sync(kFullMask, ck >= c)); });
        greater = __popc(__ballot_sync(kFullMask, ck > T));
        equal = __popc(__ballot_sync(kFullMask, ck == T));
    } else {
        T = kth_largest_key(k, [&](u32 c) {
            int m = 0;
            for (int i = lane; i < n; i += 32) m += s.cand_key[i] >= c;
            return __reduce_add_sync(kFullMask, m);
        });
        int g = 0, e = 0;
        for (int i = lane; i < n; i += 32) {
            const u32 x = s.cand_key[i];
            g += x > T;
            e += x == T;
        }
        greater = __reduce_add_sync(kFullMask, g);
        equal = __reduce_add_sync(kFullMask, e);
    }
    const int need = k - greater;  // 1 <= need <= equal
    int cut = 0x7fffffff;          // tied ids <= cut are taken
    if (equal > need) {
        cut = nth_smallest_index(need, kTopkIndexBits, [&](int c) {
            int m = 0;
            for (int i = lane; i < n; i += 32) m += (s.cand_key[i] == T) & (s.cand_idx[i] < c);
            return __reduce_add_sync(kFullMask, m);
        });
    }
    int base = 0;
    for (int i0 = 0; i0 < n; i0 += 32) {
        const int i = i0 + lane;
        bool take = false;
        int id = 0;
        if (i < n) {
            const u32 x = s.cand_key[i];
            id = s.cand_idx[i];
            take = x > T || (x == T && id <= cut);
        }
        const u32 m = __ballot_sync(kFullMask, take);
        if (take) s.sel[base + __popc(m & ((1u << lane) - 1u))] = id;
        base += __popc(m);
    }
    __syncwarp();
    write_ids_ascending(s.sel, k, lane, 32, out);
}

// Shared start of the top-k kernels for one output row: the row's valid blocks (capped by
// its query position). When every valid block is chosen the row is written whole (ascending,
// -1 padded) and 0 is returned; otherwise the forced first / last blocks are written and the
// number of blocks still to pick among [lo, hi) is returned. `rank` / `step`: this thread's
// index and the thread count of the row.
__device__ __forceinline__ int topk_row_start(int* orow, long long row, int num_heads, int width, int num_valid_pages,
                                              int force_begin, int force_end,
                                              const long long* __restrict__ query_positions, int rank, int step,
                                              int& lo, int& hi) {
    int valid = num_valid_pages;
    if (query_positions != nullptr) {
        const long long pos = query_positions[row / num_heads];
        valid = pos < 0 ? 0 : (int)min((long long)valid, pos / 128 + 1);
    }
    if (valid <= width) {  // every valid block is chosen
        for (int t = rank; t < width; t += step) orow[t] = t < valid ? t : -1;
        return 0;
    }
    // valid > width >= begin + end: the forced sets are disjoint and complete.
    for (int t = rank; t < force_begin; t += step) orow[t] = t;
    for (int t = rank; t < force_end; t += step) orow[width - force_end + t] = valid - force_end + t;
    lo = force_begin;
    hi = valid - force_end;  // competing blocks [lo, hi), more than width - begin - end of them
    return width - force_begin - force_end;
}

// scores [num_rows, nt] f32 (row = query * num_heads + head), out [num_rows, width] i32.
// query_positions [num_rows / num_heads] i64 or null. cand_cap <= the smem capacity
// (0 forces the register path; tests use it).
template <int NW, int NPT, int VEC, bool TOP2>
__global__ void __launch_bounds__(NW == 1 ? 32 * kTopkRowsPerWarpCta : 32 * NW)
msa_topk_select_kernel(const float* __restrict__ scores, int* __restrict__ out, long long num_rows, int num_heads,
                       int nt, int width, int num_valid_pages, int force_begin, int force_end,
                       const long long* __restrict__ query_positions, int cand_cap) {
    static_assert(NPT % VEC == 0, "NPT must be a multiple of VEC");
    static_assert(NW > 1 || TOP2, "warp rows take the top-2 bound (the streaming kernel serves K <= 16)");
    constexpr int G = 32 * NW;
    constexpr int NV = NPT / VEC;
    using Smem = TopkSmem<NW, TOP2>;
    __shared__ Smem smem_rows[NW == 1 ? kTopkRowsPerWarpCta : 1];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    Smem& s = smem_rows[NW == 1 ? warp : 0];
    const int rank = NW == 1 ? lane : (int)threadIdx.x;
    const long long row = NW == 1 ? (long long)blockIdx.x * kTopkRowsPerWarpCta + warp : (long long)blockIdx.x;
    if (row >= num_rows) return;  // uniform over the group

    int* orow = out + row * width;
    int lo, hi;  // competing blocks [lo, hi), more than k of them
    const int k = topk_row_start(orow, row, num_heads, width, num_valid_pages, force_begin, force_end,
                                 query_positions, rank, G, lo, hi);
    if (k <= 0) return;

    // ---- load the row once, as order keys (0 = not competing)
    u32 key[NPT];
    const float* srow = scores + row * (long long)nt;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
        const int base = VEC * (G * v + rank);
        if constexpr (VEC == 4) {
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
            if (base < hi) x = __ldcs(reinterpret_cast<const float4*>(srow + base));
            const float xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int c = 0; c < 4; ++c)
                key[4 * v + c] = (unsigned)(base + c - lo) < (unsigned)(hi - lo) ? score_order_key(xs[c]) : 0u;
        } else {
            float x = 0.f;
            if (base < hi) x = __ldcs(srow + base);
            key[v] = (unsigned)(base - lo) < (unsigned)(hi - lo) ? score_order_key(x) : 0u;
        }
    }
    // Index of key[i] is VEC * rank + step(i), step(i) a compile-time constant: comparisons
    // against an index bound subtract VEC * rank from the bound once.
    auto step_of = [](int i) { return VEC * G * (i / VEC) + i % VEC; };
    auto index_of = [&](int i) { return VEC * rank + step_of(i); };

    RowGroup<NW> grp{lane, warp, s.red, 0};

    // ---- lower bound t0 <= T: the k-th largest of the per-thread maxima (top-2 with TOP2)
    u32 m1 = 0, m2 = 0;
#pragma unroll
    for (int i = 0; i < NPT; ++i) {
        if constexpr (TOP2) m2 = max(m2, min(m1, key[i]));
        m1 = max(m1, key[i]);
    }
    u32 t0;
    if constexpr (NW == 1) {
        t0 = kth_largest_key(k, [&](u32 c) {
            return __popc(__ballot_sync(kFullMask, m1 >= c)) + __popc(__ballot_sync(kFullMask, m2 >= c));
        });
    } else {
        constexpr int PER_LANE = Smem::kMaxima / 32;
        s.maxima[rank] = m1;
        if constexpr (TOP2) s.maxima[G + rank] = m2;
        __syncthreads();
        if (warp == 0) {
            u32 mv[PER_LANE];
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) mv[i] = s.maxima[lane + 32 * i];
            const u32 t = kth_largest_key(k, [&](u32 c) {
                int n = 0;
#pragma unroll
                for (int i = 0; i < PER_LANE; ++i) n += mv[i] >= c;
                return __reduce_add_sync(kFullMask, n);
            });
            if (lane == 0) s.bcast = t;
        }
        __syncthreads();
        t0 = s.bcast;
    }
    t0 = max(t0, 1u);  // a 0 came from threads without competing keys: no bound

    // ---- candidates: keys >= t0, compacted into shared memory
    int mine = 0;
#pragma unroll
    for (int i = 0; i < NPT; ++i) mine += key[i] >= t0;
    int total;
    const int offset = grp.exclusive_scan(mine, total);
    if (total <= min(cand_cap, Smem::kCap)) {
        int pos = offset;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            if (key[i] >= t0) {
                s.cand_key[pos] = key[i];
                s.cand_idx[pos] = index_of(i);
                ++pos;
            }
        }
        grp.sync();
        if (NW == 1 || warp == 0) select_from_candidates(s, total, k, lane, orow + lo);
        return;
    }

    // ---- register path (many keys tie at the threshold): the same searches group-wide
    const u32 T = kth_largest_key(k, [&](u32 c) {
        int n = 0;
#pragma unroll
        for (int i = 0; i < NPT; ++i) n += key[i] >= c;
        return grp.sum(n);
    });
    int g = 0, e = 0;
#pragma unroll
    for (int i = 0; i < NPT; ++i) {
        g += key[i] > T;
        e += key[i] == T;
    }
    g = grp.sum(g);
    e = grp.sum(e);
    const int need = k - g;
    int cut = 0x7fffffff;
    if (e > need) {
        cut = nth_smallest_index(need, kTopkIndexBits, [&](int c) {
            const int c_rel = c - VEC * rank;
            int n = 0;
#pragma unroll
            for (int i = 0; i < NPT; ++i) n += (key[i] == T) & (step_of(i) < c_rel);
            return grp.sum(n);
        });
    }
    const int cut_rel = cut == 0x7fffffff ? cut : cut - VEC * rank;
    int chosen = 0;
#pragma unroll
    for (int i = 0; i < NPT; ++i) chosen += key[i] > T || (key[i] == T && step_of(i) <= cut_rel);
    int all_chosen;
    int pos = grp.exclusive_scan(chosen, all_chosen);
#pragma unroll
    for (int i = 0; i < NPT; ++i) {
        if (key[i] > T || (key[i] == T && step_of(i) <= cut_rel)) s.sel[pos++] = index_of(i);
    }
    grp.sync();
    write_ids_ascending(s.sel, k, rank, G, orow + lo);
}

// ============================================================================
// Top-k block selection, streaming: one warp per row (k <= 32; used for k <= 16)
// ============================================================================
//
// The warp reads its row once, in chunks of CH = 32 NPT scores (VEC = 4: 16-byte
// streaming loads), only up to the end of the competing range, and keeps a
// candidate buffer in shared memory. Per chunk c:
//
//   * each lane keeps the running max of its keys; t_c, the k-th largest of the
//     32 running maxima, is a lower bound of the row's k-th largest key T (k
//     distinct scores reach it);
//   * tp is a bound backed by k scores of *earlier* chunks: a score of chunk c
//     whose key equals tp loses the tie to each of those k (ties go to the lower
//     index), so it is never chosen and the filter may be strict;
//   * the chunk's keys >= f = max(t_c, tp + 1) are appended to the buffer.
//
// Invariant: the buffer holds the row's best k (by key, then lower index). When a
// chunk's candidates do not fit (heavy ties), the buffer is first cut to its own
// best k (their k-th key raises tp), and if that is not enough the chunk's own
// best k, found in registers by the bitwise search, are appended instead. At the
// end the entries >= tp (about 20 on random rows) are selected: at most 32 by two
// bitonic sorts, one entry per lane; more by bitwise searches over shared memory.
//
// Keys: the first pass uses fast_order_key (two instructions). It orders every
// non-NaN score exactly except -0 < +0, and puts positive NaNs above +inf and
// negative NaNs below -inf (all-ones bits even at 0, "not competing"). Its result
// is exact unless a competing score is a positive NaN or the k-th largest key T is
// -0/+0 or below -inf; such rows are selected again with score_order_key.

constexpr int kStreamCap = 256;  // candidate buffer entries per row

// Rows (warps) per CTA: each row also stages its chunk's keys in shared memory.
template <int NPT>
struct StreamRows {
    static constexpr int kPerCta = NPT > 16 ? 4 : 8;
};

struct StreamSmem {
    u32 key[kStreamCap];
    int idx[kStreamCap];
    int sel[kTopkMaxSelect];
};

// Order key of x up to -0/+0 and NaN placement (see above).
__device__ __forceinline__ u32 fast_order_key(float x) {
    const u32 b = __float_as_uint(x);
    return b ^ ((u32)((int)b >> 31) | 0x80000000u);
}

template <bool EXACT>
__device__ __forceinline__ u32 stream_key(float x) {
    if constexpr (EXACT) return score_order_key(x); else return fast_order_key(x);
}

// Fast keys chose exactly what score_order_key would: T at or above -inf's key
// (0x007fffff), not -0 (0x7fffffff) or +0 (0x80000000), no positive NaN competing.
__device__ __forceinline__ bool fast_keys_exact(u32 T, bool pos_nan) {
    return !pos_nan && T >= 0x007fffffu && T != 0x7fffffffu && T != 0x80000000u;
}

__device__ __forceinline__ u32 strictly_above(u32 t) { return t == 0xffffffffu ? t : t + 1u; }

__device__ __forceinline__ u32 lanemask_lt(int lane) { return (1u << lane) - 1u; }

// Offset in its chunk of the i-th key of a lane.
template <int VEC>
__device__ __forceinline__ int stream_offset(int i, int lane) {
    return VEC == 4 ? 128 * (i / 4) + 4 * lane + (i % 4) : 32 * i + lane;
}

// Keys of chunk [c0, c0 + CH); MASK: some scores lie outside the competing range [lo, hi)
// (their key is 0, nothing at or past hi is read).
template <bool EXACT, bool MASK, int NPT, int VEC>
__device__ __forceinline__ void stream_load(const float* __restrict__ srow, int c0, int lo, int hi, int lane,
                                            u32 (&key)[NPT]) {
    const int first = c0 + VEC * lane;        // index of this lane's first score in the chunk
    const float* p = srow + first;            // the rest are at constant offsets: one address register
#pragma unroll
    for (int v = 0; v < NPT / VEC; ++v) {
        const int base = first + 32 * VEC * v;
        if constexpr (VEC == 4) {
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
            if (!MASK || base < hi) x = __ldcs(reinterpret_cast<const float4*>(p + 32 * VEC * v));
            const float xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 kx = stream_key<EXACT>(xs[j]);
                key[4 * v + j] = !MASK || (unsigned)(base + j - lo) < (unsigned)(hi - lo) ? kx : 0u;
            }
        } else {
            float x = 0.f;
            if (!MASK || base < hi) x = __ldcs(p + 32 * v);
            const u32 kx = stream_key<EXACT>(x);
            key[v] = !MASK || (unsigned)(base - lo) < (unsigned)(hi - lo) ? kx : 0u;
        }
    }
}

// Stage this lane's chunk keys in shared memory, [NPT / VEC][32 lanes][VEC] (16-byte
// stores), so the few candidates can be picked by a variable index.
template <int NPT, int VEC>
__device__ __forceinline__ void stream_stage(const u32 (&key)[NPT], int lane, u32* __restrict__ stage) {
#pragma unroll
    for (int v = 0; v < NPT / VEC; ++v) {
        if constexpr (VEC == 4)
            *reinterpret_cast<uint4*>(stage + 4 * (32 * v + lane)) =
                make_uint4(key[4 * v], key[4 * v + 1], key[4 * v + 2], key[4 * v + 3]);
        else
            stage[32 * v + lane] = key[v];
    }
}

// Append the chunk's keys >= f (and their indices) to buffer entries [count, ...);
// false, writing nothing, when they do not fit. Keys are read back from this lane's
// staged copy (no other lane's), one iteration per candidate.
template <int NPT, int VEC>
__device__ __forceinline__ bool stream_append(const u32 (&key)[NPT], u32 f, int c0, int lane,
                                              const u32* __restrict__ stage, StreamSmem& s, int& count) {
    static_assert(NPT <= 32, "one mask bit per key");
    u32 mask = 0;
#pragma unroll
    for (int i = 0; i < NPT; ++i) mask |= (key[i] >= f ? 1u : 0u) << i;
    const int mine = __popc(mask);
    const int incl = warp_inclusive_scan(mine, lane);
    const int total = __shfl_sync(kFullMask, incl, 31);
    if (count + total > kStreamCap) return false;
    int pos = count + incl - mine;
    while (mask != 0u) {
        const int i = __ffs(mask) - 1;
        mask &= mask - 1u;
        s.key[pos] = stage[VEC == 4 ? 4 * (32 * (i >> 2) + lane) + (i & 3) : 32 * i + lane];
        s.idx[pos] = c0 + (VEC == 4 ? 128 * (i >> 2) + 4 * lane + (i & 3) : 32 * i + lane);
        ++pos;
    }
    count += total;
    return true;
}

// The best k of buffer entries [0, n) (keys >= 1): chosen <=> key > T, or key == T and
// idx <= cut. With fewer than k entries T is 0 (callers check).
struct StreamPick {
    u32 T;
    int cut;
};

__device__ __forceinline__ StreamPick buffer_pick(const StreamSmem& s, int n, int k, int lane) {
    const u32 T = kth_largest_key(k, [&](u32 c) {
        int m = 0;
        for (int i = lane; i < n; i += 32) m += s.key[i] >= c;
        return __reduce_add_sync(kFullMask, m);
    });
    int g = 0, e = 0;
    for (int i = lane; i < n; i += 32) {
        g += s.key[i] > T;
        e += s.key[i] == T;
    }
    const int need = k - __reduce_add_sync(kFullMask, g);  // >= 1: fewer than k keys exceed T
    int cut = 0x7fffffff;
    if (__reduce_add_sync(kFullMask, e) > need) {
        cut = nth_smallest_index(need, kTopkIndexBits, [&](int c) {
            int m = 0;
            for (int i = lane; i < n; i += 32) m += (s.key[i] == T) & (s.idx[i] < c);
            return __reduce_add_sync(kFullMask, m);
        });
    }
    return {T, cut};
}

// Keep the buffer entries that `keep` accepts, in order, at the front; returns how many.
template <class Keep>
__device__ __forceinline__ int buffer_compact(StreamSmem& s, int n, int lane, Keep keep) {
    int base = 0;
    for (int i0 = 0; i0 < n; i0 += 32) {
        const int i = i0 + lane;
        u32 x = 0;
        int id = 0;
        bool k = false;
        if (i < n) {
            x = s.key[i];
            id = s.idx[i];
            k = keep(x, id);
        }
        const u32 m = __ballot_sync(kFullMask, k);
        __syncwarp();  // this round is read before anything is moved (targets are <= sources)
        if (k) {
            const int at = base + __popc(m & lanemask_lt(lane));
            s.key[at] = x;
            s.idx[at] = id;
        }
        base += __popc(m);
        __syncwarp();
    }
    return base;
}

// The chunk's best k among its keys >= f (more than k of them), appended to buffer
// entries [count, count + k) (count + k <= kStreamCap); returns their k-th largest key.
// Rare (heavy ties): re-reads the chunk, out of line so the hot loop keeps its registers.
template <bool EXACT, int NPT, int VEC>
__device__ __noinline__ u32 stream_append_chunk_best(const float* __restrict__ srow, int c0, int lo, int hi, u32 f,
                                                     int lane, int k, StreamSmem* sp, int count) {
    constexpr int OFFSET_BITS = NPT == 32 ? 10 : (NPT == 8 ? 8 : 14);  // offsets < 32 NPT
    static_assert(32 * NPT <= (1 << OFFSET_BITS), "offset bits");
    StreamSmem& s = *sp;
    u32 key[NPT];
    stream_load<EXACT, true, NPT, VEC>(srow, c0, lo, hi, lane, key);
#pragma unroll
    for (int i = 0; i < NPT; ++i) key[i] = key[i] >= f ? key[i] : 0u;
    const u32 T = kth_largest_key(k, [&](u32 c) {
        int n = 0;
#pragma unroll
        for (int i = 0; i < NPT; ++i) n += key[i] >= c;
        return __reduce_add_sync(kFullMask, n);
    });
    int g = 0, e = 0;
#pragma unroll
    for (int i = 0; i < NPT; ++i) {
        g += key[i] > T;
        e += key[i] == T;
    }
    const int need = k - __reduce_add_sync(kFullMask, g);
    int cut = 0x7fffffff;  // tied offsets <= cut are taken
    if (__reduce_add_sync(kFullMask, e) > need) {
        cut = nth_smallest_index(need, OFFSET_BITS, [&](int c) {
            int n = 0;
#pragma unroll
            for (int i = 0; i < NPT; ++i) n += (key[i] == T) & (stream_offset<VEC>(i, lane) < c);
            return __reduce_add_sync(kFullMask, n);
        });
    }
    int mine = 0;
#pragma unroll
    for (int i = 0; i < NPT; ++i) mine += key[i] > T || (key[i] == T && stream_offset<VEC>(i, lane) <= cut);
    int pos = count + warp_inclusive_scan(mine, lane) - mine;
#pragma unroll
    for (int i = 0; i < NPT; ++i) {
        if (key[i] > T || (key[i] == T && stream_offset<VEC>(i, lane) <= cut)) {
            s.key[pos] = key[i];
            s.idx[pos] = c0 + stream_offset<VEC>(i, lane);
            ++pos;
        }
    }
    __syncwarp();
    return T;
}

// Cut buffer entries [0, count) (more than k, keys >= 1) to their best k, in order;
// returns their k-th largest key (0, nothing cut, if fewer than k keys are >= 1).
struct StreamCut {
    u32 T;
    int count;
};

__device__ __noinline__ StreamCut stream_buffer_cut(StreamSmem* sp, int count, int k, int lane) {
    StreamSmem& s = *sp;
    const StreamPick p = buffer_pick(s, count, k, lane);
    const int n = buffer_compact(s, count, lane, [&](u32 x, int id) { return x > p.T || (x == p.T && id <= p.cut); });
    return {p.T, n};
}

// One chunk of stream_select_row: read it, update the lane's running max and the bounds,
// append its candidates; false when they do not fit (EXACT == false: the row is then
// redone by the exact pass, which handles heavy ties). The masked and unmasked chunks
// run separate copies, so the key registers never merge across a branch.
template <bool EXACT, bool MASK, int NPT, int VEC>
__device__ __forceinline__ bool stream_chunk(const float* __restrict__ srow, int c0, int lo, int hi, int k, int lane,
                                             u32* __restrict__ stage, StreamSmem& s, u32& run_max, u32& tp,
                                             int& count) {
    u32 key[NPT];
    stream_load<EXACT, MASK, NPT, VEC>(srow, c0, lo, hi, lane, key);
    stream_stage<NPT, VEC>(key, lane, stage);
#pragma unroll
    for (int i = 0; i < NPT; ++i) run_max = max(run_max, key[i]);
    const u32 tc = __shfl_sync(kFullMask, warp_sort_ascending(run_max, lane), 32 - k);
    u32 f = max(max(tc, strictly_above(tp)), 1u);
    if (!stream_append<NPT, VEC>(key, f, c0, lane, stage, s, count)) {  // heavy ties: rare
        if constexpr (!EXACT) return false;
        if (count > k) {
            __syncwarp();
            const StreamCut cut = stream_buffer_cut(&s, count, k, lane);
            count = cut.count;
            tp = max(tp, cut.T);
            f = max(f, strictly_above(tp));
        }
        if (!stream_append<NPT, VEC>(key, f, c0, lane, stage, s, count)) {
            tp = max(tp, stream_append_chunk_best<EXACT, NPT, VEC>(srow, c0, lo, hi, f, lane, k, &s, count));
            count += k;
        }
    }
    tp = max(tp, tc);
    return true;
}

// Select the row's best k of the competing blocks [lo, hi) (hi - lo > k) into
// out[0..k), ascending. Returns false (nothing written) when the fast keys cannot
// decide the row exactly or its candidates overflow the buffer (EXACT == false only).
template <bool EXACT, int NPT, int VEC>
__device__ __forceinline__ bool stream_select_row(const float* __restrict__ srow, int lo, int hi, int k, int lane,
                                                  u32* __restrict__ stage, StreamSmem& s, int* __restrict__ out) {
    constexpr int CH = 32 * NPT;
    const int nchunks = (hi + CH - 1) / CH;
    u32 run_max = 0;  // this lane's largest key so far
    u32 tp = 0;       // k competing scores of earlier chunks have keys >= tp
    int count = 0;    // buffer entries
    __syncwarp();     // (the exact pass reuses the buffer: order the fast pass's writes first)
#pragma unroll 1
    for (int c = 0; c < nchunks; ++c) {
        const int c0 = c * CH;
        bool ok;
        if (c0 >= lo && c0 + CH <= hi) ok = stream_chunk<EXACT, false, NPT, VEC>(srow, c0, lo, hi, k, lane, stage, s, run_max, tp, count);
        else ok = stream_chunk<EXACT, true, NPT, VEC>(srow, c0, lo, hi, k, lane, stage, s, run_max, tp, count);
        if (!EXACT && !ok) return false;
    }
    if (!EXACT && __any_sync(kFullMask, run_max > 0xff800000u)) return false;  // a positive NaN competes
    __syncwarp();
    int n = count;
    if (nchunks > 1) n = buffer_compact(s, count, lane, [&](u32 x, int) { return x >= tp; });

    if (n <= 32) {  // one entry per lane
        const u32 ck = lane < n ? s.key[lane] : 0u;
        const u32 ci = lane < n ? (u32)s.idx[lane] : 0xffffffffu;
        const u32 T = __shfl_sync(kFullMask, warp_sort_ascending(ck, lane), 32 - k);
        if (!EXACT && !fast_keys_exact(T, false)) return false;
        const int need = k - __popc(__ballot_sync(kFullMask, ck > T));
        u32 cut = 0xffffffffu;
        if (__popc(__ballot_sync(kFullMask, ck == T)) > need)
            cut = __shfl_sync(kFullMask, warp_sort_ascending(ck == T ? ci : 0xffffffffu, lane), need - 1);
        const bool take = ck > T || (ck == T && ci <= cut);
        const u32 ids = warp_sort_ascending(take ? ci : 0xffffffffu, lane);
        if (lane < k) out[lane] = (int)ids;
        return true;
    }
    const StreamPick p = buffer_pick(s, n, k, lane);
    if (!EXACT && !fast_keys_exact(p.T, false)) return false;
    int base = 0;
    for (int i0 = 0; i0 < n; i0 += 32) {
        const int i = i0 + lane;
        bool take = false;
        int id = 0;
        if (i < n) {
            const u32 x = s.key[i];
            id = s.idx[i];
            take = x > p.T || (x == p.T && id <= p.cut);
        }
        const u32 m = __ballot_sync(kFullMask, take);
        if (take) s.sel[base + __popc(m & lanemask_lt(lane))] = id;
        base += __popc(m);
    }
    __syncwarp();
    write_ids_ascending(s.sel, k, lane, 32, out);
    return true;
}

// The exact pass, out of line: the fast pass keeps its registers.
template <int NPT, int VEC>
__device__ __noinline__ void stream_select_row_exact(const float* __restrict__ srow, int lo, int hi, int k, int lane,
                                                     u32* stage, StreamSmem* s, int* __restrict__ out) {
    stream_select_row<true, NPT, VEC>(srow, lo, hi, k, lane, stage, *s, out);
}

// Same contract as msa_topk_select_kernel (k = width - begin - end <= 32), one warp per row,
// StreamRows<NPT>::kPerCta rows per CTA.
template <int NPT, int VEC>
__global__ void __launch_bounds__(32 * StreamRows<NPT>::kPerCta, NPT > 16 ? 6 : 4)
msa_topk_stream_kernel(const float* __restrict__ scores, int* __restrict__ out, long long num_rows, int num_heads,
                       int nt, int width, int num_valid_pages, int force_begin, int force_end,
                       const long long* __restrict__ query_positions) {
    static_assert(NPT % VEC == 0, "NPT must be a multiple of VEC");
    constexpr int RPC = StreamRows<NPT>::kPerCta;
    __shared__ StreamSmem smem_rows[RPC];
    __shared__ __align__(16) u32 stage_rows[RPC][32 * NPT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    StreamSmem& s = smem_rows[warp];
    u32* stage = stage_rows[warp];
    const long long row = (long long)blockIdx.x * RPC + warp;
    if (row >= num_rows) return;  // uniform over the warp

    int* orow = out + row * width;
    int lo, hi;  // more than k competing blocks in [lo, hi)
    const int k = topk_row_start(orow, row, num_heads, width, num_valid_pages, force_begin, force_end,
                                 query_positions, lane, 32, lo, hi);
    if (k <= 0) return;
    const float* srow = scores + row * (long long)nt;
    if (!stream_select_row<false, NPT, VEC>(srow, lo, hi, k, lane, stage, s, orow + lo))
        stream_select_row_exact<NPT, VEC>(srow, lo, hi, k, lane, stage, &s, orow + lo);
}

// ============================================================================
// Per-128-key-block max score
// ============================================================================
//
// The QK^T half of flash attention with a row-max epilogue. A CTA of NWARPS warps owns
// BM = 16 NWARPS packed rows of one request and one KV head g: packed row p is query
// (p0 + p) / r, head g r + (p0 + p) % r, so the r query heads that read KV head g share
// every K tile (GQA packing). Per 128-key block each warp computes the scores of its 16
// rows (f32 accumulate), masks inadmissible keys (causal, j >= kv_len, keys of invalid
// pages) only on blocks where some row of the warp needs it, and reduces each row to
// its max. K tiles stream through a cp.async ring (3 stages) with one CTA barrier per
// block. Each warp holds its 16 rows of Q in registers (mma.sync A fragments) and runs
// m16n8k16 MMAs on ldmatrix'd K fragments; tiles are stored [rows][D] with 16-byte chunks
// XOR-swizzled by row % 8 (conflict-free ldmatrix). Accumulator layout: rows g and g + 8,
// column 8 i + 2 t + e of n-block i. Row maxima are staged in shared memory and stored
// kMsStash blocks at a time. Blocks past the tile's last admissible key are not computed:
// they, and tiles up to nt, are stored as -inf. On sm_90a the warp-specialised wgmma
// kernel below (msa_max_score_ws_kernel) computes the same output.

constexpr int kMsBlock = 128;  // keys per block
constexpr int kMsStash = 16;   // blocks staged per store (64-byte row segments)

template <typename T, int D, int NWARPS>
struct MaxScoreTile {
    static_assert(D % 64 == 0, "D must be a multiple of 64");
    static_assert(sizeof(T) == 2, "16-bit types (float8 runs the wgmma kernel)");
    static constexpr int STAGES = 3;  // K tiles in flight
    static constexpr int BM = 16 * NWARPS;                // packed (query, head) rows per CTA
    static_assert(BM <= 128, "the Q tile must fit a K stage");
    static constexpr int THREADS = 32 * NWARPS;
    static constexpr int RB = D * (int)sizeof(T);  // bytes per row
    static constexpr int CPR = RB / 16;            // 16-byte chunks per row
    static constexpr int EPC = 16 / (int)sizeof(T);  // values per chunk
    static constexpr int K_TILE_BYTES = kMsBlock * RB;
    static constexpr int K_BYTES = STAGES * K_TILE_BYTES;
    static constexpr int STASH_BYTES = BM * (kMsStash + 1) * 4;
    // Q is held in registers after the prologue: it is staged in the last stage (first
    // filled by the first loop iteration).
    static constexpr int Q_OFFSET = (STAGES - 1) * K_TILE_BYTES;
    static constexpr int STASH_OFFSET = K_BYTES;
    static constexpr int KVALID_OFFSET = STASH_OFFSET + STASH_BYTES;  // [STAGES][128] key flags
    static constexpr int SMEM_BYTES = KVALID_OFFSET + STAGES * kMsBlock;
};

// Byte offset of 16-byte chunk ch of row `row` in a [rows][RB bytes] tile, chunks
// XOR-swizzled by row % 8.
template <int RB>
__device__ __forceinline__ int ms_tile_offset(int row, int ch) {
    return row * RB + ((ch ^ (row & 7)) << 4);
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// 16-byte cp.async to a shared-space byte address; pred == false zero-fills.
__device__ __forceinline__ void cp_async_16_at(u32 saddr, const void* gmem, bool pred) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(gmem), "r"(pred ? 16 : 0));
}

// The same copy with an L2 prefetch hint of 256 bytes (streams of consecutive keys).
__device__ __forceinline__ void cp_async_16_l2_at(u32 saddr, const void* gmem, bool pred) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(gmem),
                 "r"(pred ? 16 : 0));
}

// ldmatrix x4 from a shared-space byte address (lets the constant part of the
// address fold into the instruction's immediate offset).
__device__ __forceinline__ void ldmatrix_x4_at(u32* r, u32 saddr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(saddr));
}

// Four e4m3 bytes -> two f16x2 words: bytes 0, 1 -> lo and bytes 2, 3 -> hi (low byte in
// the low half; exact: every e4m3 value is an f16 value). sm_89+.
__device__ __forceinline__ void e4m3x4_to_f16x2(u32 x, u32& lo, u32& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi) : "r"(x));
#else
    lo = hi = 0u;  // (no float8 kernel is built below sm_89)
#endif
}

// Packed rows p0 + p of one request's max-score tile: the admissible keys of each row and
// where it is stored (shared by the prefill max-score kernels).
struct MaxScoreRows {
    int r, qlen, p0, lk, causal, num_heads_q, g, nt;
    long long q0, off, total_q;
    // Query qi of packed row p; false for rows outside the request (never stored).
    __device__ __forceinline__ bool valid(int p, int& qi) const {
        qi = (p0 + p) / r;
        return qi < qlen && q0 + qi >= 0 && q0 + qi < total_q;
    }
    // Admissible keys of packed row p: j < limit(p); rows outside the request get no mask.
    __device__ __forceinline__ int limit(int p) const {
        int qi;
        if (!valid(p, qi)) return 0x7fffffff;
        if (!causal) return lk;
        return (int)min((long long)lk, max(off + qi + 1, 0LL));
    }
    // Output offset of packed row p in max_score [total_q, Hq, nt] (-1: not stored).
    __device__ __forceinline__ long long out(int p) const {
        int qi;
        return valid(p, qi) ? ((q0 + qi) * num_heads_q + g * r + (p0 + p) % r) * (long long)nt : -1;
    }
    // End of the blocks a tile of bm rows computes within [t_begin, t_stop) (the rest are -inf).
    __device__ __forceinline__ int t_end(int bm, int t_begin, int t_stop) const {
        const int q_last = (int)min((long long)qlen - 1, ((long long)p0 + bm - 1) / r);
        const long long lim_tile = causal ? min((long long)lk, max(off + q_last + 1, 0LL)) : (long long)lk;
        return (int)max(min((lim_tile + kMsBlock - 1) / kMsBlock, (long long)t_stop), (long long)t_begin);
    }
};

// Keys of one request for the prefill max-score kernels: key j of KV head g in the key cache
// (kv_mode 0 dense rows from cu_seqlens_k[b], 1 a page-table row, 2 a CSR page list).
struct MaxScoreKeys {
    const int* page_table;
    const int* kv_indices;
    long long dense_start, csr_lo, csr_hi, k_extent, k_stride_outer, k_stride_slot, k_stride_head, num_kv_indices;
    int kv_mode, lk, page_shift, slot_mask, page_table_cols, b, g;
    // Elements between consecutive keys of one dense run or one page.
    __device__ __forceinline__ long long key_stride() const { return kv_mode == 0 ? k_stride_outer : k_stride_slot; }
    // Element offset of key j, -1 when the key is not admissible or not in memory.
    __device__ __forceinline__ long long offset(int j) const {
        if (j >= lk) return -1;
        if (kv_mode == 0) {
            const long long row = dense_start + j;
            return row >= 0 && row < k_extent ? row * k_stride_outer + g * k_stride_head : -1;
        }
        const int pi = j >> page_shift;
        long long page;
        if (kv_mode == 1) {
            if (pi >= page_table_cols) return -1;
            page = page_table[(long long)b * page_table_cols + pi];
        } else {
            const long long at = csr_lo + pi;
            if (at < 0 || at >= csr_hi || at >= num_kv_indices) return -1;
            page = kv_indices[at];
        }
        if (page < 0 || page >= k_extent) return -1;
        return page * k_stride_outer + (long long)(j & slot_mask) * k_stride_slot + g * k_stride_head;
    }
};

// The parameter list of both max-score kernels (one launcher table, MAX_SCORE_PARAMS); T is
// the kernel's element type.
#define MAX_SCORE_KERNEL_ARGS                                                                              \
    const T *__restrict__ q, const T *__restrict__ kc, float *__restrict__ max_score,                     \
        const int *__restrict__ cu_seqlens_q, const int *__restrict__ qo_lens, const int *__restrict__ kv_lens, \
        const int *__restrict__ qo_offset, const int *__restrict__ cu_seqlens_k,                           \
        const int *__restrict__ page_table, const int *__restrict__ kv_indices,                            \
        const int *__restrict__ kv_page_indptr, int kv_mode, long long q_stride_tok, long long q_stride_head, \
        long long k_stride_outer, long long k_stride_slot, long long k_stride_head, long long total_q,    \
        long long k_extent, int page_shift, int page_table_cols, long long num_kv_indices, int batch,      \
        int num_m_tiles, int num_heads_q, int num_heads_kv, int nt, int causal, int tiles_per_split,       \
        float score_scale

// q [total_q, Hq, D] (row strides q_stride_tok / q_stride_head, D contiguous).
// K (kv_mode): 0 dense [total_k, Hkv, D], key j of request b at row cu_seqlens_k[b] + j;
//   1 paged by page_table [batch, page_table_cols]; 2 paged by CSR kv_indices +
//   kv_page_indptr [batch + 1]. Paged element offset of (page, slot, head):
//   page * k_stride_outer + slot * k_stride_slot + head * k_stride_head (NHD or HND).
// k_extent: rows (dense) or pages (paged) of k; out-of-range ids are inadmissible keys.
// max_score [total_q, Hq, nt] f32. Grid: (num_m_tiles * batch, Hkv, splits): split s owns
// the output blocks [s * tiles_per_split, (s + 1) * tiles_per_split) (block maxima need
// no merge, so short-query batches spread the key range over more CTAs).
template <typename T, int D, int NWARPS>
__global__ void __launch_bounds__(32 * NWARPS, D <= 128 ? 2 : 1)
msa_block_max_score_kernel(MAX_SCORE_KERNEL_ARGS) {
    using Cfg = MaxScoreTile<T, D, NWARPS>;
    constexpr int BM = Cfg::BM, THREADS = Cfg::THREADS, CPR = Cfg::CPR, STAGES = Cfg::STAGES, RB = Cfg::RB;
    constexpr int EPC = Cfg::EPC;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = smem_raw;
    const u32 smem_base = smem_u32(smem);
    float* stash = reinterpret_cast<float*>(smem + Cfg::STASH_OFFSET);  // [BM][kMsStash + 1]
    unsigned char* kvalid = smem + Cfg::KVALID_OFFSET;                   // [STAGES][128]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int b = blockIdx.x % batch;
    const int m_tile = num_m_tiles - 1 - (int)(blockIdx.x / batch);  // longest causal tiles first
    const int g = blockIdx.y;
    const int t_begin = blockIdx.z * tiles_per_split;  // this CTA's output blocks [t_begin, t_stop)
    if (t_begin >= nt) return;
    const int t_stop = min(t_begin + tiles_per_split, nt);
    const int r = num_heads_q / num_heads_kv;
    const int qlen = max(qo_lens[b], 0);
    const int p0 = m_tile * BM;
    if ((long long)p0 >= (long long)qlen * r) return;
    const int lk = max(kv_lens[b], 0);
    const long long q0 = cu_seqlens_q[b];
    const long long off = qo_offset[b];

    const MaxScoreRows rows{r, qlen, p0, lk, causal, num_heads_q, g, nt, q0, off, total_q};
    // Blocks [t_begin, t_end) are computed, [t_end, t_stop) are -inf.
    const int t_end = rows.t_end(BM, t_begin, t_stop);

    // Lanes 0..15: output offset of the warp's row 16 warp + lane (-1: not stored).
    const long long out_off = lane < 16 ? rows.out(warp * 16 + lane) : -1;
    auto fill_neg_inf_from = [&](int t_from) {
        for (int rr = 0; rr < 16; ++rr) {
            const long long o = __shfl_sync(kFullMask, out_off, rr);
            if (o >= 0)
                for (int c = t_from + lane; c < t_stop; c += 32) max_score[o + c] = neg_inf();
        }
    };
    if (t_end <= t_begin) {
        fill_neg_inf_from(t_begin);
        return;
    }

    // ---- address of key j (head g) or -1 when the key is not admissible / not in memory
    const MaxScoreKeys keys{page_table, kv_indices,
                                  kv_mode == 0 ? (long long)cu_seqlens_k[b] : 0,
                                  kv_mode == 2 ? (long long)kv_page_indptr[b] : 0,
                                  kv_mode == 2 ? (long long)kv_page_indptr[b + 1] : 0,
                                  k_extent, k_stride_outer, k_stride_slot, k_stride_head, num_kv_indices,
                                  kv_mode, lk, page_shift, (1 << page_shift) - 1, page_table_cols, b, g};
    // Loader geometry: thread tid copies chunk ld_ch of K rows ld_row0 + i * LD_STEP.
    constexpr int LD_STEP = THREADS / CPR;
    const int ld_ch = tid % CPR, ld_row0 = tid / CPR;
    auto load_k_tile = [&](int t, int stage) {
        const u32 dst = smem_base + (u32)(stage * Cfg::K_TILE_BYTES);
#pragma unroll
        for (int i = 0; i < kMsBlock / LD_STEP; ++i) {
            const int row = ld_row0 + i * LD_STEP;
            const long long o = keys.offset(t * kMsBlock + row);
            cp_async_16_at(dst + (u32)ms_tile_offset<RB>(row, ld_ch),
                           o >= 0 ? kc + o + ld_ch * EPC : kc, o >= 0);
            if (ld_ch == 0) kvalid[stage * kMsBlock + row] = o >= 0 ? 1 : 0;
        }
    };

    // ---- prologue: the Q tile (in the first group, with K tile t_begin) and K tiles up to
    // t_begin + STAGES - 2, one commit group per tile (empty groups past t_end keep the count)
#pragma unroll
    for (int i = 0; i < BM * CPR / THREADS; ++i) {
        const int cid = tid + THREADS * i;
        const int p = cid / CPR, ch = cid % CPR;
        int qi;
        const bool ok = rows.valid(p, qi);
        const T* src = ok ? q + (q0 + qi) * q_stride_tok + (long long)(g * r + (p0 + p) % r) * q_stride_head + ch * EPC
                          : q;
        cp_async_16_at(smem_base + (u32)(Cfg::Q_OFFSET + ms_tile_offset<RB>(p, ch)), src, ok);
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (t_begin + s < t_end) load_k_tile(t_begin + s, s);
        cp_async_commit();
    }

    const int mi = lane >> 3;  // ldmatrix: the 8x8 matrix this lane addresses
    u32 qf[D / 16][4];
    cp_async_wait<STAGES - 2>();  // the first group: Q and K tile t_begin
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int row = warp * 16 + (mi & 1) * 8 + (lane & 7);
        ldmatrix_x4_at(qf[kk], smem_base + (u32)(Cfg::Q_OFFSET + ms_tile_offset<RB>(row, 2 * kk + (mi >> 1))));
    }
    // (The loop's first barrier orders these reads before the Q area is reused.)
    // This thread's accumulator rows: 16 warp + lane / 4 (+ 8), admissible below lim.
    int lim[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) lim[h] = rows.limit(warp * 16 + (lane >> 2) + 8 * h);
    const int lim_min = min(lim[0], lim[1]);
    // mma.sync B fragments: lane addresses K row np * 16 + (mi >> 1) * 8 + lane % 8, chunk
    // 2 kk + (mi & 1). With z = (mi & 1) ^ (lane % 8) the swizzled chunk is (2 kk) ^ z =
    // 8 (kk / 4) + ((2 (kk % 4)) ^ z): four per-thread byte offsets, the rest folds into constants.
    const u32 k_lane_base = smem_base + (u32)(((mi >> 1) * 8 + (lane & 7)) * D * (int)sizeof(T));
    u32 k_chunk_off[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) k_chunk_off[m] = (u32)((((2 * m) ^ ((mi & 1) ^ (lane & 7)))) * 16);

    for (int t = t_begin, n = 0; t < t_end; ++t, ++n) {
        const int stage = n % STAGES;
        cp_async_wait<STAGES - 2>();  // K tile t landed (this thread's copies)
        __syncthreads();  // every thread's copies of tile t landed; every warp is done with tile t - 1
        if (t + STAGES - 1 < t_end) load_k_tile(t + STAGES - 1, (n + STAGES - 1) % STAGES);
        cp_async_commit();

        const int kbase = t * kMsBlock;
        const unsigned char* kv = kvalid + stage * kMsBlock;
        const bool holes = !__all_sync(kFullMask, reinterpret_cast<const u32*>(kv)[lane] == 0x01010101u);
        const bool edge = __any_sync(kFullMask, kbase + kMsBlock > lim_min) || holes;
        float mx[2] = {neg_inf(), neg_inf()};

        float acc[16][4];  // the warp's 16 x 128 scores: n-block n8 = keys [8 n8, 8 n8 + 8)
#pragma unroll
        for (int n8 = 0; n8 < 16; ++n8) acc[n8][0] = acc[n8][1] = acc[n8][2] = acc[n8][3] = 0.f;
        const u32 kt = k_lane_base + (u32)(stage * Cfg::K_TILE_BYTES);
        // Steps s = (kk, np): B fragments (16 keys x 16 values) of step s + 1 are loaded
        // before the MMAs of step s (ldmatrix and mma are volatile asm: issue order is source order).
        constexpr int NP = 8;
        constexpr int STEPS = (D / 16) * NP;
        auto b_addr = [&](int step) {
            const int kk = step / NP, np = step % NP;
            return kt + k_chunk_off[kk % 4] + (u32)((kk / 4) * 128) + (u32)(np * 16 * D * (int)sizeof(T));
        };
        u32 bf[2][4];
        ldmatrix_x4_at(bf[0], b_addr(0));
#pragma unroll
        for (int step = 0; step < STEPS; ++step) {
            if (step + 1 < STEPS) ldmatrix_x4_at(bf[(step + 1) & 1], b_addr(step + 1));
            const int kk = step / NP, np = step % NP;
            mma_16x8x16<T>(acc[2 * np], qf[kk], bf[step & 1]);
            mma_16x8x16<T>(acc[2 * np + 1], qf[kk], bf[step & 1] + 2);
        }

        // Row maxima; masks only on blocks where some row of the warp needs them.
        if (!edge) {
#pragma unroll
            for (int n8 = 0; n8 < 16; ++n8) {
                mx[0] = fmaxf(mx[0], fmaxf(acc[n8][0], acc[n8][1]));
                mx[1] = fmaxf(mx[1], fmaxf(acc[n8][2], acc[n8][3]));
            }
        } else {
#pragma unroll
            for (int n8 = 0; n8 < 16; ++n8) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = n8 * 8 + 2 * (lane & 3) + e;
                    const bool ok = kv[col] != 0;
                    if (ok && kbase + col < lim[0]) mx[0] = fmaxf(mx[0], acc[n8][e]);
                    if (ok && kbase + col < lim[1]) mx[1] = fmaxf(mx[1], acc[n8][2 + e]);
                }
            }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFullMask, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFullMask, mx[h], 2));
        }

        const int slot = n % kMsStash;
        if ((lane & 3) == 0) {
#pragma unroll
            for (int h = 0; h < 2; ++h)
                stash[(warp * 16 + (lane >> 2) + 8 * h) * (kMsStash + 1) + slot] = mx[h] * score_scale;
        }
        if (slot == kMsStash - 1 || t == t_end - 1) {  // store the staged blocks of the warp's 16 rows
            __syncwarp();
            const int t_first = t - slot;
#pragma unroll 4
            for (int rr = 0; rr < 16; rr += 2) {  // two rows per pass: lanes 0-15 and 16-31
                const int rw = rr + (lane >> 4), c = lane & 15;
                const long long o = __shfl_sync(kFullMask, out_off, rw);
                if (o >= 0 && c <= slot) max_score[o + t_first + c] = stash[(warp * 16 + rw) * (kMsStash + 1) + c];
            }
            __syncwarp();
        }
    }
    fill_neg_inf_from(t_end);
}

// ============================================================================
// Block max score, warp-specialised wgmma pipeline (sm_90a)
// ============================================================================
//
// The same output as msa_block_max_score_kernel, at GEMM speed on sm_90a. A CTA of three
// warpgroups owns BM packed rows (same packing, grid and split as above):
//   warpgroup 0, the producer (registers lowered by setmaxnreg): streams the CTA's K
//     tiles (128 keys) into a ring of STAGES shared-memory stages. Warp w copies keys
//     32 w .. 32 w + 31 of a tile: lane l looks up key 32 w + l (page table, bounds)
//     and writes its validity flag, the warp then copies whole rows (CPR lanes per row)
//     with 16-byte cp.async into 128-byte-swizzled column blocks: when the 32 keys lie at
//     one stride each lane steps its own source address, else row addresses by shuffle.
//     Each thread arrives on the stage's `full` mbarrier twice: once when its copies land
//     (cp.async.mbarrier.arrive.noinc) and once after its flag store (release).
//   warpgroups 1 and 2, the consumers (registers raised): each holds WG_ROWS = 64 HALVES
//     rows of Q for the whole CTA in registers as wgmma A fragments, loaded once (ldmatrix)
//     from the shared-memory Q tile. A unit is one 64-row half against one K tile: wgmma
//     m64n128 (k16; e4m3 k32) chains with A in registers, reading only K by descriptor,
//     into one of two accumulator sets, so the row-max epilogue of a unit runs
//     while the next unit's MMAs do (async wgmma, wait_group 1). After the last unit of a
//     tile every consumer thread arrives on the stage's `empty` mbarrier (each read the
//     tile's key flags), which the producer waits for before refilling it.
// HALVES is 2 (BM 256: K is read once per 256 rows) when a key row is at most 256 bytes,
// else 1 (BM 128, Q 64 KB). Masking, the stash of row maxima and the -inf fill are those
// of msa_block_max_score_kernel. Built for sm_90a only.

template <typename T, int D>
struct MaxScoreWsTile {
    static_assert(D % 64 == 0, "D must be a multiple of 64");
    static constexpr int RB = D * (int)sizeof(T);      // bytes per row
    static constexpr int SRB = (RB + 127) / 128 * 128;  // bytes per row in shared memory (whole column-block rows)
    static constexpr int CPR = RB / 16;                 // 16-byte chunks per row
    static_assert(CPR <= 32, "a warp copies a row per instruction at least");
    static constexpr int EPC = 16 / (int)sizeof(T);     // values per chunk
    static constexpr int KSTEPS = RB / 32;              // wgmma k-steps of 32 bytes
    static constexpr int HALVES = SRB <= 256 ? 2 : 1;   // 64-row MMA units per consumer warpgroup
    // float8 at D <= 128 (rows of at most 128 bytes): three consumer warpgroups of 64-key units
    // (m64n64, three 32-register accumulator sets each), since with two warpgroups the row-max
    // epilogue of a unit outlasts the MMA work queued behind it; otherwise two of 128-key units.
    static constexpr bool NARROW = sizeof(T) == 1 && SRB <= 128;
    static constexpr int CONSUMERS = NARROW ? 3 : 2;    // consumer warpgroups
    static constexpr int UNIT_N = NARROW ? 64 : 128;    // keys per MMA unit
    static constexpr int COLS = kMsBlock / UNIT_N;      // units per (tile, half)
    static constexpr int WG_ROWS = 64 * HALVES;
    static constexpr int BM = CONSUMERS * WG_ROWS;      // packed rows per CTA
    static constexpr int THREADS = 128 * (1 + CONSUMERS);
    // Registers per thread after setmaxnreg: 128 x 56 + 256 x 224 (two consumers), 128 x 32 +
    // 384 x 160 (three: three 32-register accumulator sets and 32 of Q each).
    static constexpr int PRODUCER_REGS = NARROW ? 32 : 56, CONSUMER_REGS = NARROW ? 160 : 224;
    static_assert(setmaxnreg_fits(THREADS, CONSUMERS, PRODUCER_REGS, CONSUMER_REGS),
                  "setmaxnreg: multiples of 8 within the launch allocation");
    static constexpr int K_TILE_BYTES = kMsBlock * SRB;
    static constexpr int Q_BYTES = BM * SRB;
    static constexpr int STASH_BYTES = BM * (kMsStash + 1) * 4;
    static constexpr int SMEM_LIMIT = 227 * 1024;       // opt-in shared memory per CTA (sm_90)
    static constexpr int ALIGN_SLACK = 1024;            // tiles start on 1024-byte boundaries
    static constexpr int PER_STAGE = K_TILE_BYTES + kMsBlock + 16;  // tile, key flags, two mbarriers
    static constexpr int FIT = (SMEM_LIMIT - ALIGN_SLACK - Q_BYTES - STASH_BYTES) / PER_STAGE;
    static constexpr int STAGES = FIT < 8 ? FIT : 8;
    static_assert(STAGES >= 2, "two K stages at least");
    static constexpr int Q_OFFSET = STAGES * K_TILE_BYTES;
    static constexpr int STASH_OFFSET = Q_OFFSET + Q_BYTES;
    static constexpr int KVALID_OFFSET = STASH_OFFSET + STASH_BYTES;   // [STAGES][128] key flags
    static constexpr int BAR_OFFSET = KVALID_OFFSET + STAGES * kMsBlock;  // full[STAGES], empty[STAGES]
    static constexpr int SMEM_BYTES = BAR_OFFSET + STAGES * 16 + ALIGN_SLACK;
    static_assert(SMEM_BYTES <= SMEM_LIMIT, "shared memory");
};


template <typename T, int D>
__global__ void __launch_bounds__(MaxScoreWsTile<T, D>::THREADS, 1)
msa_max_score_ws_kernel(MAX_SCORE_KERNEL_ARGS) {
    using Cfg = MaxScoreWsTile<T, D>;
    constexpr int BM = Cfg::BM, CPR = Cfg::CPR, STAGES = Cfg::STAGES, EPC = Cfg::EPC;
    constexpr int HALVES = Cfg::HALVES, WG_ROWS = Cfg::WG_ROWS, KSTEPS = Cfg::KSTEPS;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
    const u32 smem_base = smem_u32(smem);
    float* stash = reinterpret_cast<float*>(smem + Cfg::STASH_OFFSET);  // [BM][kMsStash + 1]
    unsigned char* kvalid = smem + Cfg::KVALID_OFFSET;                   // [STAGES][128]
    const u32 full_bar = smem_base + (u32)Cfg::BAR_OFFSET;               // [STAGES] u64
    const u32 empty_bar = full_bar + 8u * STAGES;                        // [STAGES] u64

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int b = blockIdx.x % batch;
    const int m_tile = num_m_tiles - 1 - (int)(blockIdx.x / batch);  // longest causal tiles first
    const int g = blockIdx.y;
    const int t_begin = blockIdx.z * tiles_per_split;  // this CTA's output blocks [t_begin, t_stop)
    if (t_begin >= nt) return;
    const int t_stop = min(t_begin + tiles_per_split, nt);
    const int r = num_heads_q / num_heads_kv;
    const int qlen = max(qo_lens[b], 0);
    const int p0 = m_tile * BM;
    if ((long long)p0 >= (long long)qlen * r) return;
    const int lk = max(kv_lens[b], 0);
    const long long q0 = cu_seqlens_q[b];
    const long long off = qo_offset[b];

    const MaxScoreRows rows{r, qlen, p0, lk, causal, num_heads_q, g, nt, q0, off, total_q};
    // Blocks [t_begin, t_end) are computed, [t_end, t_stop) are -inf.
    const int t_end = rows.t_end(BM, t_begin, t_stop);
    if (t_end <= t_begin) {  // nothing to compute: the CTA's rows are -inf over [t_begin, t_stop)
        for (int p = warp; p < BM; p += Cfg::THREADS / 32) {
            const long long o = rows.out(p);
            if (o >= 0)
                for (int c = t_begin + lane; c < t_stop; c += 32) max_score[o + c] = neg_inf();
        }
        return;
    }

    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_bar + 8u * s, 2 * 128);         // per producer thread: copies landed, flags stored
            mbar_init(empty_bar + 8u * s, 128 * Cfg::CONSUMERS);  // per consumer thread: done with the stage
        }
    }
    __syncthreads();

    if (warp < 4) {
        // ---------------------------------------------------------------- producer
        regs_release<Cfg::PRODUCER_REGS>();
        const MaxScoreKeys keys{page_table, kv_indices,
                                      kv_mode == 0 ? (long long)cu_seqlens_k[b] : 0,
                                      kv_mode == 2 ? (long long)kv_page_indptr[b] : 0,
                                      kv_mode == 2 ? (long long)kv_page_indptr[b + 1] : 0,
                                      k_extent, k_stride_outer, k_stride_slot, k_stride_head, num_kv_indices,
                                      kv_mode, lk, page_shift, (1 << page_shift) - 1, page_table_cols, b, g};
        constexpr int RPI = 32 / CPR;  // rows per warp-wide copy instruction
        const int sub = lane / CPR, ch = lane % CPR;
        const int own = 32 * warp + lane;  // the key this lane looks up
        // Copy ci of a tile: chunk ch of row 32 warp + ci RPI + sub. Its offset in the tile is the
        // lane's copy-0 offset ci RPI rows further, with the swizzle phase (bits 4-6) xor'ed by
        // (ci RPI) % 8 (sub < RPI <= 8): one per-lane base, a constant per copy.
        const u32 dst_lane = (u32)attn::ColumnBlockTile<kMsBlock>::offset(32 * warp + sub, ch);
        auto dst_row = [&](int ci) { return (dst_lane ^ (u32)(((ci * RPI) & 7) << 4)) + (u32)(ci * RPI * 128); };
        const long long key_stride = keys.key_stride();
        for (int t = t_begin, n = 0; t < t_end; ++t, ++n) {
            const int stage = n % STAGES;
            mbar_wait(empty_bar + 8u * stage, ((n / STAGES) & 1) ^ 1);  // (the first pass finds them free)
            const long long o_own = keys.offset(t * kMsBlock + own);
            kvalid[stage * kMsBlock + own] = o_own >= 0 ? 1 : 0;
            const u32 dst = smem_base + (u32)(stage * Cfg::K_TILE_BYTES);
            // The warp's 32 keys at one stride from its first (dense rows; a page of 32 keys or
            // more): each lane steps its own source address, no per-row shuffles.
            const long long o_first = __shfl_sync(kFullMask, o_own, 0);
            if (__all_sync(kFullMask, o_first >= 0 && o_own == o_first + (long long)lane * key_stride)) {
                const T* src = kc + o_first + (long long)sub * key_stride + ch * EPC;
#pragma unroll
                for (int ci = 0; ci < 32 / RPI; ++ci, src += RPI * key_stride)
                    cp_async_16_at(dst + dst_row(ci), src, true);
            } else {
#pragma unroll
                for (int ci = 0; ci < 32 / RPI; ++ci) {
                    const long long o = __shfl_sync(kFullMask, o_own, ci * RPI + sub);
                    cp_async_16_at(dst + dst_row(ci), o >= 0 ? kc + o + ch * EPC : kc, o >= 0);
                }
            }
            cp_async_mbar_arrive_noinc(full_bar + 8u * stage);
            mbar_arrive(full_bar + 8u * stage);
        }
        cp_async_wait_all();
        return;
    }

    // -------------------------------------------------------------------- consumers
    regs_claim<Cfg::CONSUMER_REGS>();
    const int c = (warp >> 2) - 1;  // consumer warpgroup: rows c WG_ROWS .. + WG_ROWS
    const int cw = warp & 3;        // warp in the warpgroup
    {  // this warpgroup's Q rows
        const int ctid = tid & 127;
#pragma unroll
        for (int i = 0; i < WG_ROWS * CPR / 128; ++i) {
            const int cid = ctid + 128 * i;
            const int p = c * WG_ROWS + cid / CPR, ch = cid % CPR;
            int qi;
            const bool ok = rows.valid(p, qi);
            const T* src = ok ? q + (q0 + qi) * q_stride_tok + (long long)(g * r + (p0 + p) % r) * q_stride_head +
                                    ch * EPC
                              : q;
            cp_async_16_at(smem_base + (u32)(Cfg::Q_OFFSET + attn::ColumnBlockTile<BM>::offset(p, ch)), src, ok);
        }
        cp_async_wait_all();
        attn::fence_proxy_async_smem();
        named_sync(1 + c, 128);
    }
    // qf[h][ks] = A fragments of k-step ks (32 bytes) of the warp's 16 rows of half h.
    // ldmatrix.x4: lane l addresses row (l / 8 % 2) 8 + l % 8 of the warp's rows, 16-byte
    // chunk 2 ks + l / 16 (matrices rows 0-7 | 8-15 x chunk lo | hi: a[0..3] of the A layout).
    u32 qf[HALVES][KSTEPS][4];
    {
        const int mi = lane >> 3;
#pragma unroll
        for (int h = 0; h < HALVES; ++h) {
            const int row = c * WG_ROWS + h * 64 + cw * 16 + (mi & 1) * 8 + (lane & 7);
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks)
                ldmatrix_x4_at(qf[h][ks], smem_base + (u32)(Cfg::Q_OFFSET +
                                                            attn::ColumnBlockTile<BM>::offset(row, 2 * ks + (mi >> 1))));
        }
    }
    // Accumulator rows of this thread in half h: row0(h) + lane / 4 (+ 8).
    auto row0 = [&](int h) { return c * WG_ROWS + h * 64 + cw * 16; };
    int lim[HALVES][2], lim_min[HALVES];
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
        lim[h][0] = rows.limit(row0(h) + (lane >> 2));
        lim[h][1] = rows.limit(row0(h) + (lane >> 2) + 8);
        lim_min[h] = min(lim[h][0], lim[h][1]);
    }
    // Lane l: output offset of the warp's row l % 16 of half l / 16 (the stash order).
    const long long out_off = lane / 16 < HALVES ? rows.out(row0(lane / 16) + (lane & 15)) : -1;

    // This lane's word of the key flags of the even / odd tiles, read when the tile's stage is
    // acquired, so that the epilogue's vote does not wait on a shared-memory load.
    u32 flags0 = 0, flags1 = 0;
    constexpr int NB = Cfg::UNIT_N / 8;  // 8-column accumulator blocks of a unit
    // Unit (tile n, half h, column block cx): half h's 64 rows against keys cx UNIT_N ..
    // + UNIT_N of the CTA's tile n, into accumulator set `acc`. The first unit of a tile
    // acquires its stage and reads this lane's word of the key flags.
    auto issue = [&](int n, int h, int cx, float* acc) {
        const int stage = n % STAGES;
        if (h == 0 && cx == 0) {
            mbar_wait(full_bar + 8u * stage, (n / STAGES) & 1);
            attn::fence_proxy_async_smem();  // the producer's cp.async bytes, to wgmma's proxy
            const u32 f = reinterpret_cast<const u32*>(kvalid + stage * kMsBlock)[lane];
            if (n & 1) flags1 = f; else flags0 = f;
        }
        // keys cx UNIT_N ..: UNIT_N rows of 128 bytes further (whole 1024-byte swizzle atoms)
        const attn::u64 k_desc = attn::wg_desc(
            smem_base + (u32)(stage * Cfg::K_TILE_BYTES + cx * Cfg::UNIT_N * 128), 16, 1024);
        attn::wg_fence();
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            const u32 ko = (u32)((ks >> 2) * (kMsBlock * 128) + (ks & 3) * 32);
            const attn::u64 kd = attn::wg_desc_add(k_desc, ko);
            if (ks == 0) attn::WgmmaRSKMajor<Cfg::UNIT_N, T>::first(acc, qf[h][ks], kd);
            else attn::WgmmaRSKMajor<Cfg::UNIT_N, T>::run(acc, qf[h][ks], kd, 1);
        }
        attn::wg_commit();
    };
    // This thread's maxima of its two rows over a unit's columns and the carried bit patterns
    // `carry` (kBitsMaxStart: none) as bit patterns (float_max.cuh: the float maxima where a row
    // holds a value >= 0), each a tree of three-input maxima...
    auto bits_rows = [&](const float* acc, const int* carry, int* bm) {
        float r0[2 * NB + 1], r1[2 * NB + 1];
#pragma unroll
        for (int n8 = 0; n8 < NB; ++n8) {
            r0[2 * n8] = acc[4 * n8], r0[2 * n8 + 1] = acc[4 * n8 + 1];
            r1[2 * n8] = acc[4 * n8 + 2], r1[2 * n8 + 1] = acc[4 * n8 + 3];
        }
        r0[2 * NB] = __int_as_float(carry[0]);
        r1[2 * NB] = __int_as_float(carry[1]);
        bm[0] = bits_max_tree(r0);
        bm[1] = bits_max_tree(r1);
    };
    constexpr int kNoCarry[2] = {kBitsMaxStart, kBitsMaxStart};
    // ... by fmaxf (their fallback) ...
    auto fmax_rows = [&](const float* acc, float* mx) {
        mx[0] = mx[1] = neg_inf();
#pragma unroll
        for (int n8 = 0; n8 < NB; ++n8) {
            mx[0] = fmaxf(mx[0], fmaxf(acc[4 * n8], acc[4 * n8 + 1]));
            mx[1] = fmaxf(mx[1], fmaxf(acc[4 * n8 + 2], acc[4 * n8 + 3]));
        }
    };
    // ... and on edge units over the keys with a K row (kv: the unit's key flags) below each
    // row's causal limit (kbase: the unit's first key; h: the rows' half).
    auto fmax_rows_masked = [&](const float* acc, const unsigned char* kv, int kbase, int h, float* mx) {
        mx[0] = mx[1] = neg_inf();
#pragma unroll
        for (int n8 = 0; n8 < NB; ++n8) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = n8 * 8 + 2 * (lane & 3) + e;
                const bool ok = kv[col] != 0;
                if (ok && kbase + col < lim[h][0]) mx[0] = fmaxf(mx[0], acc[4 * n8 + e]);
                if (ok && kbase + col < lim[h][1]) mx[1] = fmaxf(mx[1], acc[4 * n8 + 2 + e]);
            }
        }
    };
    // The row maxima mx of half h of tile n (reduced over the quad) into the stash; after the
    // tile's last half the stage goes back to the producer and full stash rows are stored.
    auto stash_rows = [&](int n, int h, const float* mx) {
        const int stage = n % STAGES, t = t_begin + n, slot = n % kMsStash;
        if ((lane & 3) == 0) {
#pragma unroll
            for (int e = 0; e < 2; ++e) stash[(row0(h) + (lane >> 2) + 8 * e) * (kMsStash + 1) + slot] = mx[e] * score_scale;
        }
        if (h == HALVES - 1) {
            __syncwarp();                         // the stash rows, before the store below reads them
            mbar_arrive(empty_bar + 8u * stage);  // every thread: its own key-flag reads are done
            if (slot == kMsStash - 1 || t == t_end - 1) {  // store the staged blocks of the warp's rows
                const int t_first = t - slot;
                // Two rows per pass (lanes 0-15 and 16-31); the passes' shuffles and loads are
                // independent of the stores (predicated, no branches), so they overlap.
#pragma unroll
                for (int rr = 0; rr < 16 * HALVES; rr += 2) {
                    const int rw = rr + (lane >> 4), cc = lane & 15;
                    const long long o = __shfl_sync(kFullMask, out_off, rw);
                    const float v = stash[(row0(rw >> 4) + (rw & 15)) * (kMsStash + 1) + cc];
                    float* const dst = max_score + (o + t_first + cc);
                    if (o >= 0 && cc <= slot) *dst = v;
                }
                __syncwarp();
            }
        }
    };

    if constexpr (!Cfg::NARROW) {
        // Row maxima of unit u (half h of tile u / HALVES, all 128 keys) from `acc`.
        auto epilogue = [&](int u, int h, const float* acc) {
            const int n = u / HALVES, t = t_begin + n;
            const int kbase = t * kMsBlock;
            const bool holes = !__all_sync(kFullMask, ((n & 1) ? flags1 : flags0) == 0x01010101u);
            const bool edge = __any_sync(kFullMask, kbase + kMsBlock > lim_min[h]) || holes;
            float mx[2];
            // float8, whose MMAs take half the time of 16-bit ones and leave the row maxima the
            // bound: a whole tile's maxima by bit patterns, two values per instruction, where
            // every row of the warp holds a value >= 0; the rest by fmaxf.
            bool done = false;
            if constexpr (sizeof(T) == 1) {
                if (!edge) {
                    int bm[2];
                    bits_rows(acc, kNoCarry, bm);
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        bm[e] = quad_bits_max(bm[e]);
                        mx[e] = __int_as_float(bm[e]);
                    }
                    done = __all_sync(kFullMask, (bm[0] | bm[1]) >= 0);
                }
            }
            if (!done) {
                if (!edge) fmax_rows(acc, mx);
                else fmax_rows_masked(acc, kvalid + (n % STAGES) * kMsBlock, kbase, h, mx);
#pragma unroll
                for (int e = 0; e < 2; ++e) mx[e] = quad_max(mx[e]);
            }
            stash_rows(n, h, mx);
        };
        // Units u (acc0) and u + 1 (acc1) per iteration; at the loop head unit u is in flight.
        const int units = (t_end - t_begin) * HALVES;
        float acc0[64], acc1[64];
        issue(0, 0, 0, acc0);
        int u = 0;
        for (; u + 2 < units; u += 2) {
            issue((u + 1) / HALVES, HALVES - 1, 0, acc1);
            attn::wg_wait<1>();
            attn::wg_fence_regs<64>(acc0);
            epilogue(u, 0, acc0);
            issue((u + 2) / HALVES, 0, 0, acc0);
            attn::wg_wait<1>();
            attn::wg_fence_regs<64>(acc1);
            epilogue(u + 1, HALVES - 1, acc1);
        }
        if (u + 1 < units) {  // the last two units
            issue((u + 1) / HALVES, HALVES - 1, 0, acc1);
            attn::wg_wait<1>();
            attn::wg_fence_regs<64>(acc0);
            epilogue(u, 0, acc0);
            attn::wg_wait<0>();
            attn::wg_fence_regs<64>(acc1);
            epilogue(u + 1, HALVES - 1, acc1);
        } else {  // the last unit (HALVES 1, an odd count)
            attn::wg_wait<0>();
            attn::wg_fence_regs<64>(acc0);
            epilogue(u, 0, acc0);
        }
    } else {
        // NARROW: unit (tile n, half h, column half cx) against keys 64 cx .. 64 cx + 63 of the
        // tile, into one of three 32-register sets (a tile's units in sets 0, 1, 2, 0): a half's
        // first column half stays in its set until the second's epilogue, so the negative check
        // and its fmaxf fallback run once per half over both; the first column half's bit-pattern
        // maxima are carried into the second's tree.
        float pend[2];       // this thread's maxima of the half's first column half (bits or, on edges, fmaxf)
        bool holes = false;  // the tile has keys without a K row (voted once per tile)
        bool edge = false;   // per thread and half: its rows reach past the tile's causal limit, or holes
        auto first_cols = [&](int n, int h, const float* acc) {
            const int t = t_begin + n;
            if (h == 0) holes = !__all_sync(kFullMask, ((n & 1) ? flags1 : flags0) == 0x01010101u);
            edge = t * kMsBlock + kMsBlock > lim_min[h] || holes;
            if (!edge) {
                int bm[2];
                bits_rows(acc, kNoCarry, bm);
                pend[0] = __int_as_float(bm[0]);
                pend[1] = __int_as_float(bm[1]);
            } else {
                fmax_rows_masked(acc, kvalid + (n % STAGES) * kMsBlock, t * kMsBlock, h, pend);
            }
        };
        // The second column half (acc; the first still in acc_first): this thread's maxima of its
        // two rows over the half's 128 keys, by bit patterns where each row holds a value >= 0,
        // else (and on edges) by fmaxf; then the quad reduction and the stash.
        auto second_cols = [&](int n, int h, const float* acc_first, const float* acc) {
            const int t = t_begin + n;
            float mx[2];
            if (!edge) {
                const int carry[2] = {__float_as_int(pend[0]), __float_as_int(pend[1])};
                int bm[2];
                bits_rows(acc, carry, bm);
                mx[0] = __int_as_float(bm[0]);
                mx[1] = __int_as_float(bm[1]);
                if ((bm[0] | bm[1]) < 0) {  // a row without a value >= 0 among the thread's 32
                    float m0[2], m1[2];
                    fmax_rows(acc_first, m0);
                    fmax_rows(acc, m1);
#pragma unroll
                    for (int e = 0; e < 2; ++e) mx[e] = fmaxf(m0[e], m1[e]);
                }
            } else {
                fmax_rows_masked(acc, kvalid + (n % STAGES) * kMsBlock + Cfg::UNIT_N, t * kMsBlock + Cfg::UNIT_N,
                                 h, mx);
#pragma unroll
                for (int e = 0; e < 2; ++e) mx[e] = fmaxf(mx[e], pend[e]);
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) mx[e] = quad_max(mx[e]);
            stash_rows(n, h, mx);
        };
        static_assert(Cfg::NARROW ? (HALVES == 2 && Cfg::COLS == 2) : true, "four units per tile");
        // Units of tile n: (h 0, c 0) set 0, (0, 1) set 1, (1, 0) set 2, (1, 1) set 0, each issued
        // before the previous one's epilogue; no MMA stays in flight from one tile to the next
        // (the tile's last epilogue runs under the other consumer warpgroups' MMAs).
        constexpr int ACC = Cfg::UNIT_N / 2;
        float acc0[ACC], acc1[ACC], acc2[ACC];
        for (int n = 0; n < t_end - t_begin; ++n) {
            issue(n, 0, 0, acc0);
            issue(n, 0, 1, acc1);
            attn::wg_wait<1>();
            attn::wg_fence_regs<ACC>(acc0);
            first_cols(n, 0, acc0);
            issue(n, 1, 0, acc2);
            attn::wg_wait<1>();
            attn::wg_fence_regs<ACC>(acc1);
            second_cols(n, 0, acc0, acc1);
            issue(n, 1, 1, acc0);
            attn::wg_wait<1>();
            attn::wg_fence_regs<ACC>(acc2);
            first_cols(n, 1, acc2);
            attn::wg_wait<0>();
            attn::wg_fence_regs<ACC>(acc0);
            second_cols(n, 1, acc2, acc0);
        }
    }
    // Blocks past the CTA's last admissible key.
#pragma unroll
    for (int rw = 0; rw < 16 * HALVES; ++rw) {
        const long long o = __shfl_sync(kFullMask, out_off, rw);
        if (o >= 0)
            for (int cc = t_end + lane; cc < t_stop; cc += 32) max_score[o + cc] = neg_inf();
    }
}

// ============================================================================
// Block max score, decode-shaped requests (few packed rows, long K)
// ============================================================================
//
// Memory bound on reading K: every warp streams its own K and runs without CTA
// barriers. A CTA (4 warps) owns the output blocks [t_begin, t_stop) of one (request,
// KV head); warp w computes blocks t_begin + w, t_begin + w + 4, ... and streams each as
// four sub-tiles of 32 keys through a private ring of WS cp.async stages (16-byte
// copies, WS - 1 sub-tiles in flight per warp). Keys are the MMA's M dimension and the
// packed rows its N: mma.sync m16n8k16 with A = 16 keys x 16 values (ldmatrix from the
// XOR-swizzled stage) and B = 8 packed rows of Q held in registers (NB n-blocks, up to
// 8 NB rows). Accumulator element (key g (+ 8), row 2 t + e) of each n-block: a lane
// keeps the running max of its two rows per n-block over the block's 128 keys, the 8
// lanes of a row (g) reduce it by shuffles and lanes 0..3 store it. Lane l looks up key l
// of a sub-tile (page id one sub-tile ahead); key validity (j < kv_len, page ids in range)
// is the ballot of those lookups, a 32-bit mask per sub-tile; sub-tiles whose keys lie at
// one stride copy from one base address. Causal limits apply per row; sub-tiles entirely
// admissible for every row skip masking.

constexpr int kDecSubKeys = 32;  // keys per sub-tile (one warp's cp.async stage)
constexpr int kDecWarps = 4;
// float8 MMAs: mma.sync m16n8k32 e4m3 where the tensor cores run it (sm_89, sm_120+); on
// sm_90 and sm_100 - sm_110, where ptxas lowers it to f16 MMAs on values converted at every
// MMA (Q included) with the two halves added in f32, the kernel converts Q once and K's
// fragments itself and runs two m16n8k16 f16 MMAs per 32-byte k-step into the accumulator.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 890 || __CUDA_ARCH__ >= 1200)
constexpr bool kDecFp8Native = true;
#else
constexpr bool kDecFp8Native = false;
#endif

template <typename T, int D, int NB>
struct DecodeTile {
    static_assert(D % 64 == 0, "D must be a multiple of 64");
    static constexpr bool FP8 = sizeof(T) == 1;                // e4m3: mma k32 on the same byte layout
    static constexpr int RB = D * (int)sizeof(T);              // bytes per key
    static constexpr int WS = RB <= 128 ? 6 : 3;               // stages per warp
    static constexpr int CPR = RB / 16;                        // 16-byte chunks per key
    static constexpr int SWZ = (CPR < 8 ? CPR : 8) - 1;        // chunk XOR mask (key % 8, or % 4 for 64-byte keys)
    static constexpr int KSTEPS = RB / 32;                     // mma k-steps: 32 bytes each (k16 16-bit, k32 fp8)
    static constexpr int SUB_BYTES = kDecSubKeys * RB;
    static constexpr int WARP_BYTES = WS * SUB_BYTES;
    static constexpr int MASK_OFFSET = kDecWarps * WARP_BYTES;  // [warps][WS] u32 key masks
    static constexpr int SMEM_BYTES = MASK_OFFSET + kDecWarps * WS * 4;
};

// Same parameters as msa_block_max_score_kernel (num_m_tiles is 1). Grid: (batch * splits,
// Hkv): CTA x owns request x % batch and blocks [(x / batch) * tiles_per_split, ...).
template <typename T, int D, int NB>
__global__ void __launch_bounds__(32 * kDecWarps, D * sizeof(T) <= 256 ? 2 : 1)
msa_decode_max_score_kernel(MAX_SCORE_KERNEL_ARGS) {
    using Cfg = DecodeTile<T, D, NB>;
    constexpr int WS = Cfg::WS, CPR = Cfg::CPR, ROWS = 8 * NB, RB = Cfg::RB, KSTEPS = Cfg::KSTEPS;
    constexpr int RPI = 32 / CPR;           // keys per cp.async instruction of the warp
    constexpr int NI = kDecSubKeys / RPI;   // instructions per sub-tile
    static_assert(RPI >= 1 && RPI * CPR == 32, "a warp instruction copies whole keys");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 smem_base = smem_u32(smem_raw);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int b = (int)(blockIdx.x % (unsigned)batch);
    const int t_begin = (int)(blockIdx.x / (unsigned)batch) * tiles_per_split;
    const int g = blockIdx.y;
    if (t_begin >= nt) return;
    const int t_stop = min(t_begin + tiles_per_split, nt);
    const int r = num_heads_q / num_heads_kv;
    const int qlen = max(qo_lens[b], 0);
    const int lk = max(kv_lens[b], 0);
    const long long q0 = cu_seqlens_q[b];
    const long long off = qo_offset[b];
    // (read with the lengths: the first page lookups need them)
    const long long dense_start = kv_mode == 0 ? (long long)cu_seqlens_k[b] : 0;
    const long long csr_lo = kv_mode == 2 ? (long long)kv_page_indptr[b] : 0;
    const long long csr_hi = kv_mode == 2 ? (long long)kv_page_indptr[b + 1] : 0;
    const int nrows = (int)min((long long)qlen * r, (long long)ROWS);  // packed rows [0, nrows)

    auto row_valid = [&](int p, int& qi) {
        qi = p / r;
        return p < nrows && q0 + qi >= 0 && q0 + qi < total_q;
    };
    auto row_limit = [&](int p) -> int {  // admissible keys j < row_limit(p)
        int qi;
        if (!row_valid(p, qi)) return 0x7fffffff;
        if (!causal) return lk;
        return (int)min((long long)lk, max(off + qi + 1, 0LL));
    };
    auto out_offset = [&](int p) -> long long {
        int qi;
        if (!row_valid(p, qi)) return -1;
        return ((q0 + qi) * num_heads_q + g * r + p % r) * (long long)nt;
    };
    // Blocks [t_begin, t_end) are computed, [t_end, t_stop) are -inf.
    long long lim_tile = 0;
    if (nrows > 0) {
        const long long q_last = (nrows - 1) / r;
        lim_tile = causal ? min((long long)lk, max(off + q_last + 1, 0LL)) : (long long)lk;
    }
    const int t_end = (int)max(min((lim_tile + kMsBlock - 1) / kMsBlock, (long long)t_stop), (long long)t_begin);

    // ---- -inf for [t_end, t_stop) (the whole CTA; disjoint from the warps' blocks)
    {
        const int span = t_stop - t_end;
        for (int i = tid; i < nrows * span; i += 32 * kDecWarps) {
            const long long o = out_offset(i / span);
            if (o >= 0) max_score[o + t_end + i % span] = neg_inf();
        }
    }
    const int nblk = max(0, (t_end - t_begin - warp + kDecWarps - 1) / kDecWarps);  // this warp's blocks
    if (nblk == 0) return;

    // ---- key addressing, one key per lane: lane l of sub-tile s stands for key sub_key0(s) + l.
    // `fetch_key` reads what the key's address needs (its page id; dense: its row) one
    // sub-tile before the copies need it, so the page-table read is off the issue path;
    // `key_offset` makes the element offset of key (head g), -1 when not admissible or
    // not in memory.
    const int slot_mask = (1 << page_shift) - 1;
    const long long head_off = (long long)g * k_stride_head;
    // Sub-tile s of this warp: keys [128 (t_begin + warp + 4 (s / 4)) + 32 (s % 4), + 32).
    auto sub_key0 = [&](int s) { return (t_begin + warp + kDecWarps * (s >> 2)) * kMsBlock + (s & 3) * kDecSubKeys; };
    const int n_sub = 4 * nblk;
    auto fetch_key = [&](int s) -> long long {
        const int j = sub_key0(s) + lane;
        if (s >= n_sub || j >= lk) return -1;
        if (kv_mode == 0) return dense_start + j;
        const int pi = j >> page_shift;
        if (kv_mode == 1) return pi < page_table_cols ? (long long)page_table[(long long)b * page_table_cols + pi] : -1;
        const long long at = csr_lo + pi;
        return at >= 0 && at < csr_hi && at < num_kv_indices ? (long long)kv_indices[at] : -1;
    };
    auto key_offset = [&](long long id, int s) -> long long {
        if (id < 0 || id >= k_extent) return -1;
        const long long o = id * k_stride_outer + head_off;
        return kv_mode == 0 ? o : o + (long long)((sub_key0(s) + lane) & slot_mask) * k_stride_slot;
    };

    // Copies of a sub-tile: instruction i moves 16-byte chunk ld_ch of keys RPI i + ld_row0
    // into the stage (chunk XOR-swizzled by key % (SWZ + 1); the swizzle repeats every SWP
    // instructions, so its offsets are computed once). A sub-tile whose 32 keys are all in
    // memory at one stride (one page of >= 32 keys, or dense rows) streams from one base
    // address; any other (a page boundary inside it, invalid or absent keys) takes each
    // key's offset from its lane by shuffles.
    constexpr int SWP = (Cfg::SWZ + 1) / RPI > 1 ? (Cfg::SWZ + 1) / RPI : 1;
    const int ld_ch = lane % CPR, ld_row0 = lane / CPR;
    u32 dst_sw[SWP];
#pragma unroll
    for (int p = 0; p < SWP; ++p) {
        const int row = ld_row0 + RPI * p;
        dst_sw[p] = (u32)(row * RB + ((ld_ch ^ (row & Cfg::SWZ)) << 4));
    }
    const long long key_stride = kv_mode == 0 ? k_stride_outer : k_stride_slot;  // elements between keys
    const long long lane_stride = lane * key_stride;
    const long long lane_src = (long long)ld_row0 * key_stride * (long long)sizeof(T) + ld_ch * 16;
    const long long inst_step = (long long)RPI * key_stride * (long long)sizeof(T);
    const unsigned char* kbytes = reinterpret_cast<const unsigned char*>(kc);
    const u32 warp_smem = smem_base + (u32)(warp * Cfg::WARP_BYTES);
    u32* masks = reinterpret_cast<u32*>(smem_raw + Cfg::MASK_OFFSET) + warp * WS;
    auto load_sub = [&](int s, long long id) {
        const int stage = s % WS;
        const u32 dst = warp_smem + (u32)(stage * Cfg::SUB_BYTES);
        const long long o = key_offset(id, s);
        const u32 valid = __ballot_sync(kFullMask, o >= 0);
        const long long o0 = __shfl_sync(kFullMask, o, 0);
        if (__all_sync(kFullMask, o >= 0 && o == o0 + lane_stride)) {
            const unsigned char* src = kbytes + o0 * (long long)sizeof(T) + lane_src;
#pragma unroll
            for (int i = 0; i < NI; ++i)
                cp_async_16_l2_at(dst + dst_sw[i % SWP] + (u32)((i / SWP) * SWP * RPI * RB), src + i * inst_step, true);
        } else {
#pragma unroll
            for (int i = 0; i < NI; ++i) {
                const long long oi = __shfl_sync(kFullMask, o, ld_row0 + RPI * i);
                cp_async_16_l2_at(dst + dst_sw[i % SWP] + (u32)((i / SWP) * SWP * RPI * RB),
                                  oi >= 0 ? kbytes + oi * (long long)sizeof(T) + ld_ch * 16 : kbytes, oi >= 0);
            }
        }
        if (lane == 0) masks[stage] = valid;
    };

    // Prologue: the first WS sub-tiles' lookups in flight together, then WS - 1 sub-tiles' copies.
    long long first_id[WS];
#pragma unroll
    for (int s = 0; s < WS; ++s) first_id[s] = fetch_key(s);
#pragma unroll
    for (int s = 0; s < WS - 1; ++s) {
        if (s < n_sub) load_sub(s, first_id[s]);
        cp_async_commit();
    }
    long long next_id = first_id[WS - 1];  // key of this lane in the next sub-tile to copy

    // ---- Q as mma B fragments: n-block nb, k-step kk: row 8 nb + lane / 4, bytes
    // 32 kk + 4 (lane % 4) .. + 3 and 16 bytes further (16-bit: values 16 kk + 2 (lane % 4),
    // +1 and +8, +9; fp8: values 32 kk + 4 (lane % 4) .. +3 and +16 .. +19)
    const int fg = lane >> 2, ft = lane & 3;
    constexpr bool F16K = Cfg::FP8 && !kDecFp8Native;  // fp8 through f16 MMAs (sm_90, sm_100)
    u32 qf[NB][KSTEPS][2];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        int qi;
        const int p = 8 * nb + fg;
        const bool ok = row_valid(p, qi);
        const unsigned char* src = reinterpret_cast<const unsigned char*>(
            q + (ok ? (q0 + qi) * q_stride_tok + (long long)(g * r + p % r) * q_stride_head : 0)) + 4 * ft;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            qf[nb][kk][0] = ok ? *reinterpret_cast<const u32*>(src + 32 * kk) : 0u;
            qf[nb][kk][1] = ok ? *reinterpret_cast<const u32*>(src + 32 * kk + 16) : 0u;
        }
    }
    // F16K: qh[nb][kk] = f16 pairs of Q bytes (32 kk + 4 ft, +1), (+2, +3), (+16, +17), (+18, +19):
    // the B fragments of two m16n8k16 MMAs whose k pairs (2 ft, 2 ft + 1) and (2 ft + 8, 2 ft + 9)
    // stand for those bytes (the A side converts K the same way; a dot product is blind to
    // the order of its k).
    u32 qh[NB][KSTEPS][F16K ? 4 : 1];
    if constexpr (F16K) {
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk) {
                e4m3x4_to_f16x2(qf[nb][kk][0], qh[nb][kk][0], qh[nb][kk][1]);
                e4m3x4_to_f16x2(qf[nb][kk][1], qh[nb][kk][2], qh[nb][kk][3]);
            }
    }
    // This lane's accumulator rows 8 nb + 2 ft + e: limits and output offsets.
    int lim[NB][2];
    long long oo[NB][2];
    int lim_min = 0x7fffffff;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            lim[nb][e] = row_limit(8 * nb + 2 * ft + e);
            oo[nb][e] = out_offset(8 * nb + 2 * ft + e);
            lim_min = min(lim_min, lim[nb][e]);
        }
#pragma unroll
    for (int x = 1; x < 32; x <<= 1) lim_min = min(lim_min, __shfl_xor_sync(kFullMask, lim_min, x));

    // ldmatrix A (16 keys x 32 bytes): lane addresses key 16 mt + (mi & 1) 8 + lane % 8,
    // chunk 2 kk + (mi >> 1); swizzled chunk = 8 (kk / 4) + ((2 (kk % 4) + (mi >> 1)) ^ (key & SWZ)).
    // (ldmatrix's b16 fragment of 16 keys x 32 bytes is the A fragment of both m16n8k16 and
    // the fp8 m16n8k32: lane l holds bytes 4 (l % 4) .. + 3 of key l / 4 per 8 x 16-byte matrix.)
    const int mi = lane >> 3;
    const u32 a_lane = (u32)(((mi & 1) * 8 + (lane & 7)) * RB);
    u32 a_chunk[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) a_chunk[m] = (u32)((((2 * m + (mi >> 1)) ^ (lane & Cfg::SWZ))) * 16);

    float mx[NB][2];
    for (int s = 0; s < n_sub; ++s) {
        const int stage = s % WS;
        cp_async_wait<WS - 2>();  // sub-tile s landed (this lane's copies)
        __syncwarp();             // ... every lane's; every lane is done with sub-tile s - 1
        if (s + WS - 1 < n_sub) load_sub(s + WS - 1, next_id);
        cp_async_commit();
        next_id = fetch_key(s + WS);
        if ((s & 3) == 0) {
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) mx[nb][0] = mx[nb][1] = neg_inf();
        }
        const int j0 = sub_key0(s);
        const u32 vmask = masks[stage];
        const u32 st = warp_smem + (u32)(stage * Cfg::SUB_BYTES) + a_lane;
        float acc[2][NB][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) acc[mt][nb][0] = acc[mt][nb][1] = acc[mt][nb][2] = acc[mt][nb][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                u32 a[4];
                ldmatrix_x4_at(a, st + (u32)(mt * 16 * RB) + a_chunk[kk % 4] + (u32)((kk / 4) * 128));
                if constexpr (F16K) {
                    // a[0..3]: bytes 4 ft .. + 3 of keys g, g + 8, then 16 bytes further
                    u32 lo[4], hi[4];
#pragma unroll
                    for (int r = 0; r < 4; ++r) e4m3x4_to_f16x2(a[r], lo[r], hi[r]);
                    const u32 a0[4] = {lo[0], lo[1], hi[0], hi[1]}, a1[4] = {lo[2], lo[3], hi[2], hi[3]};
#pragma unroll
                    for (int nb = 0; nb < NB; ++nb) {
                        mma_16x8x16<half_t>(acc[mt][nb], a0, &qh[nb][kk][0]);
                        mma_16x8x16<half_t>(acc[mt][nb], a1, &qh[nb][kk][2]);
                    }
                } else {
#pragma unroll
                    for (int nb = 0; nb < NB; ++nb) {
                        if constexpr (Cfg::FP8) mma_16x8x32_e4m3(acc[mt][nb], a, qf[nb][kk]);
                        else mma_16x8x16<T>(acc[mt][nb], a, qf[nb][kk]);
                    }
                }
            }
        }
        if (vmask == 0xffffffffu && j0 + kDecSubKeys <= lim_min) {
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mx[nb][0] = fmaxf(mx[nb][0], fmaxf(acc[mt][nb][0], acc[mt][nb][2]));
                    mx[nb][1] = fmaxf(mx[nb][1], fmaxf(acc[mt][nb][1], acc[mt][nb][3]));
                }
        } else {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int key = 16 * mt + fg + 8 * h;
                    const bool ok = (vmask >> key) & 1u;
#pragma unroll
                    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            if (ok && j0 + key < lim[nb][e]) mx[nb][e] = fmaxf(mx[nb][e], acc[mt][nb][2 * h + e]);
                }
        }
        if ((s & 3) == 3) {  // block done: reduce over the 8 lanes of each row, lanes 0..3 store
            const int t = t_begin + warp + kDecWarps * (s >> 2);
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float v = mx[nb][e];
                    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 4));
                    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 8));
                    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 16));
                    if (lane < 4 && oo[nb][e] >= 0) max_score[oo[nb][e] + t] = v * score_scale;
                }
        }
    }
}
