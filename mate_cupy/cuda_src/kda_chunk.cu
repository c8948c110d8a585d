// Kimi Delta Attention, chunked prefill (chunk_kda). K = V = 128, chunks of 64 tokens.
//
// Per value head hv (q/k head hv / (HV / H)) and token, with state S [V, K] (f32):
//   S = S * exp(gk)[None, :];  S += b * (v - S k) k^T;  o = (S q) * scale
// Per chunk (rows i, j < 64; gc = inclusive cumsum of gk over the chunk, per channel):
//   Qs = q exp(gc) scale, Kt = k exp(gc), Kb = k exp(gc_last - gc), egl = exp(gc_last)
//   Akk[i, j] = b_i sum_c k_i k_j exp(gc_i - gc_j)   (j < i)
//   Aqk[i, j] = scale sum_c q_i k_j exp(gc_i - gc_j) (j <= i)
//   T = (I + Akk)^-1 diag(b)
//   U = T (V - Kt S^T);  O = Qs S^T + Aqk U;  S' = S diag(egl) + U^T Kb
//
// Kernels (launched by mate_cupy/kda/chunk_launch.py, in this order):
//   kda_chunk_offsets_kernel       varlen only: chunk-slot offset of every sequence.
//   kda_chunk_prepare_kernel<T>    one CTA per (chunk slot, value head), fully parallel:
//                                  l2norm, gate, cumsum, Qs/Kt/Kb/egl, Aqk, Akk (tf32
//                                  mma.sync), T (f32 block forward substitution) -> workspace.
//   kda_chunk_recurrence_kernel<T, NW>  one CTA per (sequence, value head, V slice of 16*NW
//                                  rows of S), sequential over the chunks: state in f32
//                                  registers, bf16/fp16 mma.sync m16n8k16, cp.async double
//                                  buffering of the next chunk's workspace tiles.
//   kda_chunk_recurrence_wgmma_kernel<T, NW>  sm_90a, the same CTA grid with NW = 4 or 8 (one
//                                  or two warpgroups of 64 state rows): the transposed chunk
//                                  step (S as a wgmma m64n128 f32 accumulator, every A operand
//                                  a register fragment, B tiles 128-byte swizzled in shared
//                                  memory), cp.async double buffering.
// T is the input dtype (half_t or bf16_t): the operand type of the recurrence GEMMs.
#include "common/dtype.cuh"
#include "common/mma.cuh"
#include "common/kda_chunk_ops.cuh"
#include "common/attention_wgmma.cuh"
#include "common/bulk_copy.cuh"

using namespace mate;
using namespace mate::kda;
using mate::attn::u64;

namespace {

constexpr int kC = 64;     // tokens per chunk
constexpr int kD = 128;    // head dim (K = V)
constexpr int kS16 = 136;  // smem row stride (elements) of 16-bit [64][128] tiles
constexpr int kSA = 68;    // smem row stride of f32 [64][64] tiles
constexpr int kS64 = 72;   // smem row stride of 16-bit [64][64] tiles
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kPrepThreads = 256;  // prepare kernel: 8 warps
constexpr int kPrepCtasPerSm = 3;  // 75 KB of shared memory and <= 80 registers per thread
// Diagonal 16x16 blocks of Aqk/Akk use a mid-point reference, i.e. factors up to
// exp(max |gc_i - gc_mid|). Beyond this span (natural-log units) the block is
// computed element by element instead (exact for any gate values).
constexpr float kDiagSpanLimit2 = 60.f * kLog2e;

// Workspace slot of one (chunk, value head), bytes: Qs, Kt, Kb [64][128] T; T, Aqk [64][64] T;
// egl [128] f32. The tiles are stored as the wgmma recurrence's shared-memory image
// (SlotTile below), so that kernel loads a slot with one bulk copy.
constexpr int kWsQs = 0;
constexpr int kWsKt = 16384;
constexpr int kWsKb = 32768;
constexpr int kWsT = 49152;
constexpr int kWsAqk = 57344;
constexpr int kWsEgl = 65536;
constexpr int kWsSlotBytes = 66048;

// Byte offset, inside a [64 rows][N 16-bit values] tile of the slot, of 16-byte chunk c of row
// r (c < N / 8): the wgmma operand layout, 128-byte-swizzled column blocks of 64 values
// (common/attention_wgmma.cuh). T and Aqk are whole 64 x 64 tiles whose 16 x 16 blocks above
// the diagonal are zero.
typedef attn::ColumnBlockTile<kC> SlotTile;

// Prepare kernel shared memory (bytes). Row strides chosen for conflict-free vector loads:
// q, k rows are 288 bytes (= 32 mod 128: an 8-byte load by 4 rows x 4 lanes), gc rows 576
// bytes (= 64 mod 128: a 16-byte load by 2 rows x 4 lanes).
constexpr int kPQ = 144;                          // row stride (elements) of the q, k tiles
constexpr int kPG = 144;                          // row stride (floats) of the cumulative gates
constexpr int kPrepQ = 0;                         // T [64][kPQ]; from P3 f32 Akk [64][kSA]
constexpr int kPrepK = kPrepQ + kC * kPQ * 2;     // T [64][kPQ]; from P5 f32 [3][16][16]
constexpr int kPrepGc = kPrepK + kC * kPQ * 2;    // f32 [64][kPG] log2 units; from P4 f32 L [64][kSA]
constexpr int kPrepQn = kPrepGc + kC * kPG * 4;   // f32 [64] q row scales
constexpr int kPrepKn = kPrepQn + kC * 4;         // f32 [64] k row scales
constexpr int kPrepB = kPrepKn + kC * 4;          // f32 [64] sigmoid(beta) (0 past the end)
constexpr int kPrepTot = kPrepB + kC * 4;         // f32 [128] gate sums over rows 0..31
constexpr int kPrepFlag = kPrepTot + kD * 4;      // int [8 warps][2] diagonal-block fallback flags
constexpr int kPrepSmemBytes = kPrepFlag + 64;
static_assert(kPrepSmemBytes == 75072, "PREPARE_SMEM in chunk_launch.py");
static_assert(kC * kSA * 4 <= kC * kPQ * 2 && kC * kSA * 4 <= kC * kPG * 4 && 8 * 128 * 4 <= kC * kPQ * 2,
              "Akk, L and Y fit the dead tiles");

// Recurrence kernel shared memory, per pipeline stage (bytes).
constexpr int kRecQs = 0;
constexpr int kRecKt = kRecQs + kC * kS16 * 2;
constexpr int kRecKb = kRecKt + kC * kS16 * 2;
constexpr int kRecT = kRecKb + kC * kS16 * 2;
constexpr int kRecAqk = kRecT + kC * kS64 * 2;
constexpr int kRecEgl = kRecAqk + kC * kS64 * 2;
constexpr int kRecV = kRecEgl + kD * 4;
__host__ __device__ constexpr int rec_stage_bytes(int bv) { return kRecV + kC * (bv + 8) * 2; }
// The mma.sync recurrence copies Qs|Kt|Kb and T|Aqk as runs of consecutive tiles (workspace and
// stage).
static_assert(kWsKt == kWsQs + kC * kD * 2 && kWsKb == kWsKt + kC * kD * 2, "Qs, Kt, Kb tiles are consecutive");
static_assert(kWsAqk == kWsT + kC * kC * 2, "T, Aqk tiles are consecutive");
static_assert(kRecKt == kRecQs + kC * kS16 * 2 && kRecKb == kRecKt + kC * kS16 * 2 && kRecAqk == kRecT + kC * kS64 * 2,
              "stage tiles are consecutive rows");

// sm_90a recurrence (wgmma) shared memory, per pipeline stage (bytes). Tiles start on 1024-byte
// boundaries and are stored in 128-byte-swizzled column blocks of 64 16-bit values
// (ColumnBlockTile, common/attention_wgmma.cuh): 16-byte chunk c of row r of a block at
// r * 128 + ((c ^ (r & 7)) << 4).
constexpr int kWgQs = 0;       // Qs: 64 token rows x 128 channels, 2 blocks of 8 KB
constexpr int kWgKt = 16384;   // Kt: as Qs
constexpr int kWgKb = 32768;   // Kb: as Qs
constexpr int kWgT = 49152;    // T: 64 rows i x 64 columns j, one block; the blocks above the diagonal are zero
constexpr int kWgAqk = 57344;  // Aqk: as T
constexpr int kWgEgl = 65536;  // f32 [128]
constexpr int kWgV = 66048;    // V slice [64 tokens][BV + 8] (rows padded for conflict-free ldmatrix)
// One mbarrier per stage (the slot's bulk copy) in the stage's last 8 bytes, past the V slice.
__host__ __device__ constexpr int rec_wg_stage_bytes(int bv) { return (kWgV + kC * (bv + 8) * 2 + 8 + 1023) / 1024 * 1024; }
static_assert(kWgQs == kWsQs && kWgKt == kWsKt && kWgKb == kWsKb && kWgT == kWsT && kWgAqk == kWsAqk && kWgEgl == kWsEgl &&
                  kWgV == kWsSlotBytes,
              "a workspace slot is the stage image up to the V slice");

__device__ __forceinline__ long long load_cu(const void* cu, int is64, long long i) {
    return is64 ? reinterpret_cast<const long long*>(cu)[i] : (long long)reinterpret_cast<const int*>(cu)[i];
}

// Rows [bos, eos) of sequence n, clamped into [0, total_rows]: no cu_seqlens value can
// make a kernel address rows outside the arrays.
__device__ __forceinline__ void seq_bounds(const void* cu, int is64, int n, long long total_rows, long long& bos,
                                           long long& eos) {
    long long a = load_cu(cu, is64, n), b = load_cu(cu, is64, n + 1);
    a = min(max(a, 0LL), total_rows);
    b = min(max(b, a), total_rows);
    bos = a;
    eos = b;
}

// Chunk of workspace slot `slot`: first row row0 and valid rows L (1..64); false when the
// slot holds no chunk (varlen slots past the last sequence's chunks).
//   dense (cu_seqlens == null): slot = n * ceil(T / 64) + chunk, rows n * T + ...
//   varlen: slot in [offsets[n], offsets[n + 1]) for sequence n.
__device__ __forceinline__ bool locate_chunk(int slot, const void* cu_seqlens, int cu_is_64, const int* chunk_offsets,
                                             int num_seqs, long long seq_len_dense, long long total_rows,
                                             long long& row0, int& L) {
    long long bos, len;
    int chunk;
    if (cu_seqlens != nullptr) {
        if (slot >= chunk_offsets[num_seqs]) return false;
        int lo = 0, hi = num_seqs;  // offsets[lo] <= slot < offsets[hi]
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (chunk_offsets[mid] <= slot) lo = mid; else hi = mid;
        }
        long long eos;
        seq_bounds(cu_seqlens, cu_is_64, lo, total_rows, bos, eos);
        len = eos - bos;
        chunk = slot - chunk_offsets[lo];
    } else {
        const int cps = (int)((seq_len_dense + kC - 1) / kC);
        const int n = slot / cps;
        chunk = slot - n * cps;
        bos = (long long)n * seq_len_dense;
        len = seq_len_dense;
    }
    if ((long long)chunk * kC >= len) return false;
    row0 = bos + (long long)chunk * kC;
    L = (int)min((long long)kC, len - (long long)chunk * kC);
    return true;
}

// Gate rows s < nrow of one channel (gp[s * vgs]) -> gacc: the inclusive cumsum over the
// 32 rows of gk / unit (natural log units; see below), rows past the chunk end adding 0.
// Returns the sum. With gate parameters gk = lower_bound * sigmoid(exp(A_log) (g + dt_bias))
// and the cumsum is of the sigmoid alone (unit = lower_bound, applied with the log2
// conversion in P1), formed with ex2 and rcp: an overflowing exponential gives 1 / inf = 0,
// the limit; nea2 = -exp(A_log) log2(e), nb = nea2 dt_bias. Without, gk = g (unit 1).
// kFull: all 32 rows valid (no masks).
template <bool kFull, typename T>
__device__ __forceinline__ float gate_cumsum(float (&gacc)[32], const T* __restrict__ gp, unsigned vgs, int nrow,
                                             int has_gate, float nea2, float nb) {
#pragma unroll
    for (int s = 0; s < 32; ++s) gacc[s] = (kFull || s < nrow) ? to_float(gp[(unsigned)s * vgs]) : 0.f;
    float acc = 0.f;
#pragma unroll
    for (int s = 0; s < 32; ++s) {
        float gk = has_gate ? __fdividef(1.f, 1.f + fast_exp2(fmaf(nea2, gacc[s], nb))) : gacc[s];
        if (!kFull) gk = s < nrow ? gk : 0.f;
        acc += gk;
        gacc[s] = acc;
    }
    return acc;
}

// Diagonal block B of the prepare kernel needs the element-wise pass: any of the four
// warps covering its row half (warps 4 (B / 2) .. +3, flag B % 2 of each) saw a span above
// the limit. The flags are written in P1 and read after its barrier.
__device__ __forceinline__ bool diag_block_wide(const int* sflag, int B) {
    const int* f = sflag + 8 * (B >> 1) + (B & 1);
    return (f[0] | f[2] | f[4] | f[6]) != 0;
}

// First of the Qs/Kt/Kb rows prepare warp w writes in P2a (w = 0..8; 64 for w = 8):
// 15, 15, 10, 10, 6, 6, 1, 1 rows. Warp w's P2b work grows with its row block w / 2 (1 + w / 2
// column blocks), and one P2a row costs about a fifth of one column block's operands and
// MMAs, so each warp gets about the same instruction count.
__device__ __forceinline__ int qk_rows_begin(int w) {
    constexpr unsigned long long kBegin = 0ull | (15ull << 7) | (30ull << 14) | (40ull << 21) | (50ull << 28) |
                                          (56ull << 35) | (62ull << 42) | (63ull << 49) | (64ull << 56);
    return (int)((kBegin >> (7 * w)) & 127u);
}

// N = 2 or 4 consecutive floats (8- or 16-byte aligned) in shared memory.
template <int N>
__device__ __forceinline__ void load_floats(const float* p, float (&f)[N]) {
    if constexpr (N == 2) {
        const float2 t = *reinterpret_cast<const float2*>(p);
        f[0] = t.x; f[1] = t.y;
    } else {
        const float4 t = *reinterpret_cast<const float4*>(p);
        f[0] = t.x; f[1] = t.y; f[2] = t.z; f[3] = t.w;
    }
}
template <int N>
__device__ __forceinline__ void store_floats(float* p, const float (&f)[N]) {
    if constexpr (N == 2)
        *reinterpret_cast<float2*>(p) = make_float2(f[0], f[1]);
    else
        *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
}

// acc[v] += sum_{x < 16} row[x] * block[x * stride + v], v < N: a 16-float row (16-byte
// aligned, read as float4) times a 16-row slice of N columns (row stride `stride` floats).
template <int N>
__device__ __forceinline__ void row_times_block(float (&acc)[N], const float* row, const float* block, int stride) {
#pragma unroll
    for (int x4 = 0; x4 < 16; x4 += 4) {
        const float4 r4 = *reinterpret_cast<const float4*>(row + x4);
        const float rv[4] = {r4.x, r4.y, r4.z, r4.w};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            float bv[N];
            load_floats<N>(block + (x4 + u) * stride, bv);
#pragma unroll
            for (int v = 0; v < N; ++v) acc[v] = fmaf(rv[u], bv[v], acc[v]);
        }
    }
}

// Prepare P5 for one warp: columns [c0, c0 + 2 VPL) of block column J of Lm = (I + Akk)^-1,
// blocks I = J + 1 .. 3 in order: Y = sum_{K=J}^{I-1} Akk_IK Lm_KJ, then Lm_IJ = -Lm_II Y (Lm_II
// is written in full by P4, zeros above its diagonal). Lane: row r = lane / 2 of the block,
// VPL consecutive columns. sakk, sL: f32 [64][kSA]; sYw: this warp's f32 [16][2 VPL].
template <int VPL>
__device__ __forceinline__ void invert_column_slice(const float* sakk, float* sL, float* sYw, int J, int c0, int lane) {
    constexpr int NC = 2 * VPL;
    const int r = lane >> 1, cq = (lane & 1) * VPL;
#pragma unroll 1
    for (int I = J + 1; I < 4; ++I) {
        float y[VPL];
#pragma unroll
        for (int v = 0; v < VPL; ++v) y[v] = 0.f;
#pragma unroll 1
        for (int K = J; K < I; ++K)
            row_times_block<VPL>(y, sakk + (16 * I + r) * kSA + 16 * K, sL + (16 * K) * kSA + c0 + cq, kSA);
        store_floats<VPL>(sYw + r * NC + cq, y);
        __syncwarp();
        float o[VPL];
#pragma unroll
        for (int v = 0; v < VPL; ++v) o[v] = 0.f;
        row_times_block<VPL>(o, sL + (16 * I + r) * kSA + 16 * I, sYw + cq, NC);
#pragma unroll
        for (int v = 0; v < VPL; ++v) o[v] = -o[v];
        store_floats<VPL>(sL + (16 * I + r) * kSA + c0 + cq, o);
        __syncwarp();  // Lm_IJ visible to the next block row; Y free to be rewritten
    }
}

// ---- recurrence helpers (both kernels)

// The chunks of sequence n the recurrence walks: rows [bos, bos + len), workspace slots
// [base_slot, base_slot + nchunks) (the count capped by the slot count).
struct SeqChunks {
    long long bos, len;
    int base_slot, nchunks;
};
__device__ __forceinline__ SeqChunks sequence_chunks(int n, const void* cu_seqlens, int cu_is_64,
                                                     const int* chunk_offsets, int num_slots, long long seq_len_dense,
                                                     long long total_rows) {
    SeqChunks c;
    if (cu_seqlens != nullptr) {
        long long eos;
        seq_bounds(cu_seqlens, cu_is_64, n, total_rows, c.bos, eos);
        c.len = eos - c.bos;
        c.base_slot = chunk_offsets[n];
    } else {
        c.bos = (long long)n * seq_len_dense;
        c.len = seq_len_dense;
        c.base_slot = n * (int)((seq_len_dense + kC - 1) / kC);
    }
    c.nchunks = max(0, min((int)((c.len + kC - 1) / kC), num_slots - c.base_slot));
    return c;
}

// A warp's 16 state rows in mma accumulator layout (also a wgmma accumulator's per-warp
// layout): s[kt][0..1] = S[v0 + g][8 kt + 2 t, +1], s[kt][2..3] = S[v0 + g + 8][...].
// kind 0: zeros (load) / nothing (store), 1: float32, 2: bfloat16; state [N, HV, V, K] from
// sbase (elements).
__device__ __forceinline__ void load_state_rows(float (&s)[16][4], const void* state, int kind, long long sbase,
                                                int v0, int g, int t) {
#pragma unroll
    for (int kt = 0; kt < 16; ++kt) {
        const long long ia = sbase + (long long)(v0 + g) * kD + 8 * kt + 2 * t, ib = ia + 8 * kD;
        if (kind == 1) {
            const float2 a = *reinterpret_cast<const float2*>(reinterpret_cast<const float*>(state) + ia);
            const float2 b = *reinterpret_cast<const float2*>(reinterpret_cast<const float*>(state) + ib);
            s[kt][0] = a.x; s[kt][1] = a.y; s[kt][2] = b.x; s[kt][3] = b.y;
        } else if (kind == 2) {
            const float2 a = unpack2<bf16_t>(*reinterpret_cast<const u32*>(reinterpret_cast<const bf16_t*>(state) + ia));
            const float2 b = unpack2<bf16_t>(*reinterpret_cast<const u32*>(reinterpret_cast<const bf16_t*>(state) + ib));
            s[kt][0] = a.x; s[kt][1] = a.y; s[kt][2] = b.x; s[kt][3] = b.y;
        } else {
            s[kt][0] = s[kt][1] = s[kt][2] = s[kt][3] = 0.f;
        }
    }
}
__device__ __forceinline__ void store_state_rows(const float (&s)[16][4], void* state, int kind, long long sbase,
                                                 int v0, int g, int t) {
    if (kind == 0) return;
#pragma unroll
    for (int kt = 0; kt < 16; ++kt) {
        const long long ia = sbase + (long long)(v0 + g) * kD + 8 * kt + 2 * t, ib = ia + 8 * kD;
        if (kind == 1) {
            float* so = reinterpret_cast<float*>(state);
            *reinterpret_cast<float2*>(so + ia) = make_float2(s[kt][0], s[kt][1]);
            *reinterpret_cast<float2*>(so + ib) = make_float2(s[kt][2], s[kt][3]);
        } else {
            bf16_t* so = reinterpret_cast<bf16_t*>(state);
            *reinterpret_cast<u32*>(so + ia) = pack2<bf16_t>(s[kt][0], s[kt][1]);
            *reinterpret_cast<u32*>(so + ib) = pack2<bf16_t>(s[kt][2], s[kt][3]);
        }
    }
}
// S = S diag(egl) on the rows of load_state_rows (egl: f32 [128] in shared memory).
__device__ __forceinline__ void decay_state_columns(float (&s)[16][4], const float* egl, int t) {
#pragma unroll
    for (int kt = 0; kt < 16; ++kt) {
        const float2 e = *reinterpret_cast<const float2*>(egl + 8 * kt + 2 * t);
        s[kt][0] *= e.x; s[kt][1] *= e.y; s[kt][2] *= e.x; s[kt][3] *= e.y;
    }
}

// ---- wgmma recurrence helpers (sm_90a). Accumulators are float acc[N / 8][4] of an m64nN
// wgmma: acc[i][j] = D[16 w + g + 8 (j / 2)][8 i + 2 t + (j % 2)] in warp w of the warpgroup.

// A fragments (mma.m16n8k16 A layout per warp) of the 16-bit rounding of an accumulator:
// k-step kk covers its columns 16 kk .. 16 kk + 15.
template <typename T, int KS>
__device__ __forceinline__ void accumulator_to_a(u32 (&a)[KS][4], const float (*acc)[4]) {
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        a[kk][0] = pack2<T>(acc[2 * kk][0], acc[2 * kk][1]);
        a[kk][1] = pack2<T>(acc[2 * kk][2], acc[2 * kk][3]);
        a[kk][2] = pack2<T>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
        a[kk][3] = pack2<T>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
    }
}

// A fragments of D^T = V^T - X^T [values x 64 tokens], rounded once: V^T read from the V
// slice (rows = tokens, stride SV elements; this warp's 16 values from column vcol) with
// ldmatrix.trans (matrix m of k-step kk: tokens 16 kk + 8 (m / 2), values vcol + 8 (m % 2),
// which is A register m); X^T = x[0..7] (accumulator columns = tokens).
template <typename T, int SV>
__device__ __forceinline__ void value_residual_to_a(u32 (&a)[4][4], const float (*x)[4], const T* sV, int vcol,
                                                    int lane) {
    const int lr = (lane & 7) + ((lane >> 4) << 3), lc = ((lane >> 3) & 1) << 3;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        u32 r[4];
        ldmatrix_x4_trans(r[0], r[1], r[2], r[3], sV + (16 * kk + lr) * SV + vcol + lc);
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const float2 v = unpack2<T>(r[m]);
            const float* xx = x[2 * kk + (m >> 1)] + 2 * (m & 1);
            a[kk][m] = pack2<T>(v.x - xx[0], v.y - xx[1]);
        }
    }
}

// acc = S B^T (m64n64, K = 128 channels): B the 64-row K-major tile at tile (Kt or Qs: rows
// tokens, channels in two column blocks of 8 KB); k-step ks reads block ks / 4 at byte
// (ks % 4) * 32.
template <typename T>
__device__ __forceinline__ void issue_state_product(float (*acc)[4], const u32 (&a)[8][4], u32 tile) {
    const u64 desc = attn::wg_desc(tile, 16, 1024);
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
        const u64 d = attn::wg_desc_add(desc, (ks >> 2) * (kC * 128) + (ks & 3) * 32);
        if (ks == 0)
            attn::WgmmaRSKMajor<64, T>::first(&acc[0][0], a[ks], d);
        else
            attn::WgmmaRSKMajor<64, T>::run(&acc[0][0], a[ks], d, 1);
    }
}

// acc (+)= A B^T (m64n64, K = 64 tokens) with B^T the 64 x 64 tile at tile (T or Aqk: rows
// n, columns k, K-major; the zero blocks above the diagonal are multiplied like the others).
template <typename T, bool kFirst>
__device__ __forceinline__ void issue_chunk_square(float (*acc)[4], const u32 (&a)[4][4], u32 tile) {
    const u64 desc = attn::wg_desc(tile, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        if (kFirst && kk == 0)
            attn::WgmmaRSKMajor<64, T>::first(&acc[0][0], a[kk], attn::wg_desc_add(desc, kk * 32));
        else
            attn::WgmmaRSKMajor<64, T>::run(&acc[0][0], a[kk], attn::wg_desc_add(desc, kk * 32), 1);
    }
}

// S += U^T Kb (m64n128, K = 64 tokens): Kb MN-major (token rows, channels in two 64-column
// blocks of 8 KB, one n64 wgmma each); k-step kk is 16 rows (2048 bytes) further.
template <typename T>
__device__ __forceinline__ void issue_state_update(float (*s)[4], const u32 (&u)[4][4], u32 kb) {
    const u64 desc = attn::wg_desc(kb, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int cb = 0; cb < 2; ++cb)
            attn::WgmmaRS<64, T>::run(&s[8 * cb][0], u[kk], attn::wg_desc_add(desc, cb * (64 * 128) + kk * 2048), 1);
}

// O^T of this warp (accumulator o: rows values v0 + g, + 8; columns tokens) -> out[row0 +
// token][hv][value] for tokens < L. Each 8 x 8 block of o (n-tile i, values g or g + 8) is
// transposed by movmatrix, so that lane (g, t) holds values v0 + 2t, + 1 (and v0 + 8 + 2t,
// + 1) of token 8i + g: two 4-byte stores per lane and n-tile.
template <typename T>
__device__ __forceinline__ void store_output_columns(T* out, const float (*o)[4], long long row0, int L, int HV,
                                                     int hv, int v0, int g, int t) {
    const long long tok_stride = (long long)HV * kD;
    T* p = out + (row0 + g) * tok_stride + (long long)hv * kD + v0 + 2 * t;  // token 8 i + g
#pragma unroll
    for (int i = 0; i < 8; ++i, p += 8 * tok_stride) {
        const u32 lo = movmatrix_trans(pack2<T>(o[i][0], o[i][1]));
        const u32 hi = movmatrix_trans(pack2<T>(o[i][2], o[i][3]));
        if (8 * i + g < L) {
            *reinterpret_cast<u32*>(p) = lo;
            *reinterpret_cast<u32*>(p + 8) = hi;
        }
    }
}

}  // namespace

// offsets[n] = sum over sequences m < n of ceil(len_m / 64), n = 0..num_seqs (saturating
// at INT_MAX). One block of 1024 threads.
__global__ void __launch_bounds__(1024) kda_chunk_offsets_kernel(const void* __restrict__ cu_seqlens, int cu_is_64,
                                                                 int num_seqs, long long total_rows,
                                                                 int* __restrict__ offsets) {
    __shared__ long long warp_total[32];
    __shared__ long long carry_s;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const long long kMax = 2147483647LL;
    if (tid == 0) carry_s = 0;
    __syncthreads();
    for (int base = 0; base < num_seqs; base += 1024) {
        const int n = base + tid;
        long long cnt = 0;
        if (n < num_seqs) {
            long long bos, eos;
            seq_bounds(cu_seqlens, cu_is_64, n, total_rows, bos, eos);
            cnt = (eos - bos + kC - 1) / kC;
        }
        long long incl = cnt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const long long y = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += y;
        }
        if (lane == 31) warp_total[warp] = incl;
        __syncthreads();
        long long before = carry_s;
        for (int w = 0; w < warp; ++w) before += warp_total[w];
        if (n < num_seqs) offsets[n] = (int)min(before + incl - cnt, kMax);
        __syncthreads();
        if (tid == 1023) carry_s = before + incl;
        __syncthreads();
    }
    if (tid == 0) offsets[num_seqs] = (int)min(carry_s, kMax);
}

// Phase 1: one CTA (8 warps) per (chunk slot, value head; see locate_chunk). Writes the
// workspace slot (slot * HV + hv). Steps (barriers between them):
//   P0  cp.async q, k; every thread loads 32 gate inputs (one channel, one row half) into
//       registers and forms the gate and its cumsum over its 32 rows; beta.
//   P1  rows 32..63 add the first half's sums; gc (log2 units) -> smem; diagonal-block
//       spans; q/k row scales (two threads per row).
//   P2  Qs, Kt, Kb, egl -> workspace (rows split over the warps, qk_rows_begin). All
//       warps: Aqk/Akk with tf32 mma.sync, warp w: row block I = w / 2, 8-column half w % 2
//       of every block J <= I, operands built in registers (16 channels per step, vector
//       shared loads), l2 scales on the products; Aqk -> workspace. Element-wise diagonal
//       blocks where the gate span is too large.
//   P3  Akk -> smem (over the dead q tile).  P4  diagonal blocks of (I + Akk)^-1.
//   P5  off-diagonal blocks, one warp per column slice (invert_column_slice).
//   P6  T = L diag(b) -> workspace.
template <typename T>
__global__ void __launch_bounds__(kPrepThreads, kPrepCtasPerSm) kda_chunk_prepare_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ g, const T* __restrict__ beta,
    const float* __restrict__ A_log, const float* __restrict__ dt_bias, const void* __restrict__ cu_seqlens,
    int cu_is_64, const int* __restrict__ chunk_offsets, unsigned char* __restrict__ ws, int num_seqs,
    long long seq_len_dense, long long total_rows, int H, int HV, float scale, float lower_bound, int use_l2norm,
    int has_gate) {
    extern __shared__ __align__(16) unsigned char smem[];
    T* sq = reinterpret_cast<T*>(smem + kPrepQ);
    T* sk = reinterpret_cast<T*>(smem + kPrepK);
    float* sgc = reinterpret_cast<float*>(smem + kPrepGc);
    float* sqn = reinterpret_cast<float*>(smem + kPrepQn);
    float* skn = reinterpret_cast<float*>(smem + kPrepKn);
    float* sb = reinterpret_cast<float*>(smem + kPrepB);
    float* stot = reinterpret_cast<float*>(smem + kPrepTot);
    int* sflag = reinterpret_cast<int*>(smem + kPrepFlag);
    float* sakk = reinterpret_cast<float*>(smem + kPrepQ);  // from P3: f32 [64][kSA]
    float* sY = reinterpret_cast<float*>(smem + kPrepK);    // from P5: f32 [8 warps][16][8]
    float* sL = reinterpret_cast<float*>(smem + kPrepGc);   // from P4: f32 [64][kSA]

    const int slot = blockIdx.x, hv = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h = hv / (HV / H);
    long long row0;
    int L;
    if (!locate_chunk(slot, cu_seqlens, cu_is_64, chunk_offsets, num_seqs, seq_len_dense, total_rows, row0, L)) return;
    const long long vg_stride = (long long)HV * kD;

    // ---- P0: q, k copies (rows past the chunk end zero-filled)
    {
        // row offsets from the chunk's first row: unsigned 32-bit (63 * H * 128 < 2^31)
        const unsigned qk_stride = (unsigned)H * kD;
        const int r0 = tid >> 4, c = (tid & 15) * 8;
        const long long base = row0 * qk_stride + (long long)h * kD + c;
        const T* qh = q + base;
        const T* kh = k + base;
#pragma unroll
        for (int i = 0; i < kC / 16; ++i) {
            const int r = r0 + 16 * i;
            const bool ok = r < L;
            const unsigned off = (ok ? (unsigned)r : 0u) * qk_stride;
            cp_async_16(sq + r * kPQ + c, qh + off, ok);
            cp_async_16(sk + r * kPQ + c, kh + off, ok);
        }
        cp_async_commit();
    }
    // Gate thread: channel gch, rows [32 ghalf, +32) (gate_cumsum).
    const int gch = tid & (kD - 1), ghalf = tid >> 7;
    float gacc[32];
    {
        // rows 32 ghalf + s, s < nrow: 32-bit offsets from one base (HV * 128 * 31 < 2^31)
        const int nrow = min(32, L - 32 * ghalf);
        const T* gp = g + (row0 + (nrow > 0 ? 32 * ghalf : 0)) * vg_stride + (long long)hv * kD + gch;
        float nb = 0.f, nea2 = 0.f;  // -exp(A_log) and -exp(A_log) dt_bias in log2 units
        if (has_gate) {
            nea2 = -__expf(A_log[hv]) * kLog2e;
            nb = nea2 * dt_bias[(long long)hv * kD + gch];
        }
        const unsigned vgs = (unsigned)HV * kD;
        // full halves (every half but a sequence's last) skip the row masks
        const float acc = nrow >= 32 ? gate_cumsum<true>(gacc, gp, vgs, 32, has_gate, nea2, nb)
                                     : gate_cumsum<false>(gacc, gp, vgs, nrow, has_gate, nea2, nb);
        if (ghalf == 0) stot[gch] = acc;
    }
    if (tid < kC) {
        float bb = 0.f;
        if (tid < L) bb = __fdividef(1.f, 1.f + __expf(-to_float(beta[(row0 + tid) * HV + hv])));
        sb[tid] = bb;
    }
    cp_async_wait<0>();
    __syncthreads();

    // ---- P1: finish the cumsum (log2 units), spans of the diagonal blocks; q/k row scales
    {
        const float off = ghalf ? stot[gch] : 0.f, unit = has_gate ? lower_bound * kLog2e : kLog2e;
#pragma unroll
        for (int s = 0; s < 32; ++s) {
            gacc[s] = (gacc[s] + off) * unit;
            sgc[(32 * ghalf + s) * kPG + gch] = gacc[s];
        }
#pragma unroll
        for (int b = 0; b < 2; ++b) {  // block I = 2 ghalf + b, mid-row reference 16 I + 7
            const float m = gacc[16 * b + 7];
            float span = 0.f;
#pragma unroll
            for (int s = 0; s < 16; ++s) span = fmaxf(span, fabsf(gacc[16 * b + s] - m));
            // one flag per (warp, block): every word has one writer (warps 4 ghalf .. +3 share block I)
            const bool wide = __any_sync(0xffffffffu, span > kDiagSpanLimit2);
            if (lane == 0) sflag[2 * warp + b] = wide;
        }
    }
    {
        // 1 / sqrt(sum x^2 + 1e-6): two threads per row of q (warps 0-3) or k (warps 4-7), the
        // row's 16-byte pieces interleaved between them (no bank conflicts)
        const int r = (tid >> 1) & (kC - 1), part = tid & 1;
        const T* src = (tid >> 7 ? sk : sq) + r * kPQ + part * 8;
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            float f[8];
            unpack8<T>(*reinterpret_cast<const vec16*>(src + 16 * j), f);
#pragma unroll
            for (int x = 0; x < 8; ++x) ss = fmaf(f[x], f[x], ss);
        }
        ss += __shfl_xor_sync(0xffffffffu, ss, 1);
        if (part == 0) (tid >> 7 ? skn : sqn)[r] = use_l2norm ? rsqrtf(ss + 1e-6f) : 1.f;
    }
    __syncthreads();

    unsigned char* wslot = ws + ((long long)slot * HV + hv) * kWsSlotBytes;
    unsigned char* wAqk = wslot + kWsAqk;
    auto aqk_at = [&](int i, int j) { return wAqk + SlotTile::offset(i, j >> 3) + (j & 7) * 2; };  // element (i, j)

    // ---- P2a: Qs, Kt, Kb (8-byte stores, a warp writes one 256-byte row), egl (warp 0).
    // Warp w writes rows [qk_rows_begin(w), qk_rows_begin(w + 1)): more rows to the warps
    // with fewer Aqk/Akk blocks in P2b, so that the warps reach the barrier after P2 together.
    {
        unsigned char* wQs = wslot + kWsQs;
        unsigned char* wKt = wslot + kWsKt;
        unsigned char* wKb = wslot + kWsKb;
        const int c4 = lane * 4;
        const float4 gl4 = *reinterpret_cast<const float4*>(sgc + (kC - 1) * kPG + c4);
        const float glv[4] = {gl4.x, gl4.y, gl4.z, gl4.w};
        if (tid < 32)
            *reinterpret_cast<float4*>(wslot + kWsEgl + c4 * 4) =
                make_float4(fast_exp2(glv[0]), fast_exp2(glv[1]), fast_exp2(glv[2]), fast_exp2(glv[3]));
        const int r_end = qk_rows_begin(warp + 1);
#pragma unroll 2
        for (int r = qk_rows_begin(warp); r < r_end; ++r) {
            const float4 gc4 = *reinterpret_cast<const float4*>(sgc + r * kPG + c4);
            const float gcv[4] = {gc4.x, gc4.y, gc4.z, gc4.w};
            const uint2 qw = *reinterpret_cast<const uint2*>(sq + r * kPQ + c4);
            const uint2 kw = *reinterpret_cast<const uint2*>(sk + r * kPQ + c4);
            const float2 q01 = unpack2<T>(qw.x), q23 = unpack2<T>(qw.y), k01 = unpack2<T>(kw.x), k23 = unpack2<T>(kw.y);
            const float qf[4] = {q01.x, q01.y, q23.x, q23.y}, kf[4] = {k01.x, k01.y, k23.x, k23.y};
            const float qs = sqn[r] * scale, ks = skn[r];
            float oq[4], ok[4], ob[4];
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                const float e1 = fast_exp2(gcv[x]), e2 = fast_exp2(glv[x] - gcv[x]);
                const float kx = kf[x] * ks;
                oq[x] = qf[x] * qs * e1;
                ok[x] = kx * e1;
                ob[x] = kx * e2;
            }
            const int o = SlotTile::offset(r, lane >> 1) + (lane & 1) * 8;  // channels c4 .. c4 + 3
            *reinterpret_cast<uint2*>(wQs + o) = make_uint2(pack2<T>(oq[0], oq[1]), pack2<T>(oq[2], oq[3]));
            *reinterpret_cast<uint2*>(wKt + o) = make_uint2(pack2<T>(ok[0], ok[1]), pack2<T>(ok[2], ok[3]));
            *reinterpret_cast<uint2*>(wKb + o) = make_uint2(pack2<T>(ob[0], ob[1]), pack2<T>(ob[2], ob[3]));
        }
    }

    // ---- P2b: Aqk, Akk with tf32 mma.sync m16n8k8. Warp w: row block I = w / 2, the
    // n-tile nj = w % 2 (8 columns) of every column block J <= I. The operands are the raw
    // q, k rows times the gate factors; the l2 row scales (qn_i or kn_i, kn_j) multiply the
    // accumulators (Aqk here, Akk in P3).
    // One reference per row block: rows get exp(gc_i - ref), columns exp(ref - gc_j).
    //   ref = gc[16 I + 7] (mid-block) when the block's span is small (every J <= I): row
    //     factors within exp(+-60), column factors <= 1 for J < I (an underflowed column
    //     factor means a negligible product), bounded for J = I.
    //   ref = gc[16 I - 1] (the row above) otherwise (J < I only: both factors <= 1); the
    //     diagonal block then goes element-wise below.
    // Channels: lane (g, t) takes channels cb + 4t .. cb + 4t + 3 of each 16-channel step;
    // k-step s of the step uses cb + 4t + 2s as mma column t and cb + 4t + 2s + 1 as t + 4
    // (A and B agree, so every channel is summed once).
    const int I = warp >> 1, nj = warp & 1;
    const int gq = lane >> 2, tq = lane & 3;
    const bool diag_fast = !diag_block_wide(sflag, I);
    const int i0 = 16 * I + gq, i1 = i0 + 8;
    float acck[4][4];
    {
        float accq[4][4];
#pragma unroll
        for (int J = 0; J < 4; ++J)
#pragma unroll
            for (int x = 0; x < 4; ++x) accq[J][x] = acck[J][x] = 0.f;
        if (diag_fast || I > 0) {
            const float* gref = sgc + (diag_fast ? 16 * I + 7 : 16 * I - 1) * kPG;
#pragma unroll 2
            for (int cb = 0; cb < kD; cb += 16) {
                const int ch = cb + 4 * tq;
                const float4 rf4 = *reinterpret_cast<const float4*>(gref + ch);
                const float rf[4] = {rf4.x, rf4.y, rf4.z, rf4.w};
                u32 aq[2][4], ak[2][4];  // [k-step][a0..a3]
                {
                    const uint2 q0 = *reinterpret_cast<const uint2*>(sq + i0 * kPQ + ch);
                    const uint2 q1 = *reinterpret_cast<const uint2*>(sq + i1 * kPQ + ch);
                    const uint2 k0 = *reinterpret_cast<const uint2*>(sk + i0 * kPQ + ch);
                    const uint2 k1 = *reinterpret_cast<const uint2*>(sk + i1 * kPQ + ch);
                    const float4 g0 = *reinterpret_cast<const float4*>(sgc + i0 * kPG + ch);
                    const float4 g1 = *reinterpret_cast<const float4*>(sgc + i1 * kPG + ch);
                    float qf0[4], qf1[4], kf0[4], kf1[4];
                    unpack4<T>(q0, qf0); unpack4<T>(q1, qf1); unpack4<T>(k0, kf0); unpack4<T>(k1, kf1);
                    const float gv0[4] = {g0.x, g0.y, g0.z, g0.w}, gv1[4] = {g1.x, g1.y, g1.z, g1.w};
#pragma unroll
                    for (int x = 0; x < 4; ++x) {
                        const int s = x >> 1, a = 2 * (x & 1);  // a0/a2: row g; a1/a3: row g + 8
                        const float e0 = fast_exp2(gv0[x] - rf[x]), e1 = fast_exp2(gv1[x] - rf[x]);
                        aq[s][a] = to_tf32(qf0[x] * e0);
                        aq[s][a + 1] = to_tf32(qf1[x] * e1);
                        ak[s][a] = to_tf32(kf0[x] * e0);
                        ak[s][a + 1] = to_tf32(kf1[x] * e1);
                    }
                }
#pragma unroll
                for (int J = 0; J < 4; ++J) {
                    if (J > I || (J == I && !diag_fast)) continue;
                    const int j = 16 * J + 8 * nj + gq;
                    const uint2 kw = *reinterpret_cast<const uint2*>(sk + j * kPQ + ch);
                    const float4 gj4 = *reinterpret_cast<const float4*>(sgc + j * kPG + ch);
                    float kj[4];
                    unpack4<T>(kw, kj);
                    const float gj[4] = {gj4.x, gj4.y, gj4.z, gj4.w};
                    u32 b[2][2];  // [k-step][b0, b1]
#pragma unroll
                    for (int x = 0; x < 4; ++x) b[x >> 1][x & 1] = to_tf32(kj[x] * fast_exp2(rf[x] - gj[x]));
#pragma unroll
                    for (int s = 0; s < 2; ++s) {
                        mma_tf32_16x8x8(accq[J], aq[s], b[s]);
                        mma_tf32_16x8x8(acck[J], ak[s], b[s]);
                    }
                }
            }
        }
        // Aqk qn_i kn_j scale (j <= i) -> workspace, blocks J <= I (the blocks right of the
        // diagonal are never read: not written). Masked entries of the diagonal blocks are
        // selected away (they may hold inf).
        const float qs0 = sqn[i0] * scale, qs1 = sqn[i1] * scale;
#pragma unroll
        for (int J = 0; J < 4; ++J) {
            if (J > I || (J == I && !diag_fast)) continue;  // diagonal: maybe the element-wise pass
            const int j = 16 * J + 8 * nj + 2 * tq;
            const float2 knj = *reinterpret_cast<const float2*>(skn + j);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int i = hh ? i1 : i0;
                const float qs = hh ? qs1 : qs0;
                const float v0 = j <= i ? accq[J][2 * hh] * qs * knj.x : 0.f;
                const float v1 = j + 1 <= i ? accq[J][2 * hh + 1] * qs * knj.y : 0.f;
                *reinterpret_cast<u32*>(aqk_at(i, j)) = pack2<T>(v0, v1);
            }
        }
    }
    // Element-wise diagonal blocks (gate span too large for the mid-row reference):
    // sum_c q_i k_j exp(gc_i - gc_j) in f32, exact for any gates. Thread (ii, jj) =
    // (tid / 16, tid % 16) of each such block; its Akk value waits in fb for P3.
    float fb[4] = {0.f, 0.f, 0.f, 0.f};
    const int ii = tid >> 4, jj = tid & 15;
#pragma unroll
    for (int B = 0; B < 4; ++B) {
        if (!diag_block_wide(sflag, B)) continue;
        const int i = 16 * B + ii, j = 16 * B + jj;
        float aq = 0.f, ak = 0.f;
        if (jj <= ii) {
#pragma unroll 4
            for (int c = 0; c < kD; ++c) {
                const float d = fast_exp2(sgc[i * kPG + c] - sgc[j * kPG + c]);
                const float kj = to_float(sk[j * kPQ + c]) * d;
                aq += to_float(sq[i * kPQ + c]) * kj;
                ak += to_float(sk[i * kPQ + c]) * kj;
            }
            aq *= sqn[i] * skn[j] * scale;
            ak = jj < ii ? ak * skn[i] * skn[j] * sb[i] : 0.f;
        }
        fb[B] = ak;
        *reinterpret_cast<T*>(aqk_at(i, j)) = from_float<T>(aq);
    }
    __syncthreads();  // q, k, gc are dead from here

    // ---- P3: Akk b_i kn_i kn_j (j < i) -> smem f32 [64][kSA], blocks J <= I (only those
    // are read)
    const float kb0 = sb[i0] * skn[i0], kb1 = sb[i1] * skn[i1];
#pragma unroll
    for (int J = 0; J < 4; ++J) {
        if (J > I || (J == I && !diag_fast)) continue;
        const int j = 16 * J + 8 * nj + 2 * tq;
        const float2 knj = *reinterpret_cast<const float2*>(skn + j);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int i = hh ? i1 : i0;
            const float kb = hh ? kb1 : kb0;
            *reinterpret_cast<float2*>(sakk + i * kSA + j) = make_float2(
                j < i ? acck[J][2 * hh] * kb * knj.x : 0.f, j + 1 < i ? acck[J][2 * hh + 1] * kb * knj.y : 0.f);
        }
    }
#pragma unroll
    for (int B = 0; B < 4; ++B)
        if (diag_block_wide(sflag, B)) sakk[(16 * B + ii) * kSA + 16 * B + jj] = fb[B];
    __syncthreads();

    // ---- P4: Lm_II = (I + Akk_II)^-1 (unit lower triangular), one thread per column of
    // each diagonal block, column-oriented forward substitution.
    if (tid < kC) {
        const int B = tid >> 4, j = tid & 15;
        const float* M = sakk + (16 * B) * kSA + 16 * B;
        float s[16], x[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) s[i] = 0.f;
#pragma unroll
        for (int kk = 0; kk < 16; ++kk) {
            const float xk = kk < j ? 0.f : (kk == j ? 1.f : -s[kk]);
            x[kk] = xk;
#pragma unroll
            for (int i = kk + 1; i < 16; ++i) s[i] = fmaf(M[i * kSA + kk], xk, s[i]);
        }
#pragma unroll
        for (int i = 0; i < 16; ++i) sL[(16 * B + i) * kSA + 16 * B + j] = x[i];
    }
    __syncthreads();

    // ---- P5: Lm_IJ = -Lm_II sum_{K=J}^{I-1} Akk_IK Lm_KJ (invert_column_slice): column
    // blocks are independent, so each warp walks one column slice down its block column,
    // ordered by __syncwarp alone. Warps 0-3: 4 columns each of J = 0 (the longest chain);
    // warps 4, 5: 8 columns of J = 1; warps 6, 7: 8 columns of J = 2.
    if (warp < 4)
        invert_column_slice<2>(sakk, sL, sY + warp * 128, 0, 4 * warp, lane);
    else
        invert_column_slice<4>(sakk, sL, sY + warp * 128, (warp >> 1) - 1, 16 * ((warp >> 1) - 1) + 8 * (warp & 1),
                               lane);
    __syncthreads();

    // ---- P6: T = Lm diag(b) on and below the diagonal blocks; the blocks above the diagonal
    // of T and Aqk are zero.
    {
        unsigned char* wT = wslot + kWsT;
        for (int e = tid; e < kC * 8; e += kPrepThreads) {
            const int r = e >> 3, c = (e & 7) * 8;  // 8 columns of one 16x16 block
            const int o = SlotTile::offset(r, e & 7);
            if ((c >> 4) > (r >> 4)) {
                *reinterpret_cast<uint4*>(wT + o) = make_uint4(0u, 0u, 0u, 0u);
                *reinterpret_cast<uint4*>(wAqk + o) = make_uint4(0u, 0u, 0u, 0u);
                continue;
            }
            const float4* l = reinterpret_cast<const float4*>(sL + r * kSA + c);
            const float4* bb = reinterpret_cast<const float4*>(sb + c);
            const float4 l0 = l[0], l1 = l[1], b0 = bb[0], b1 = bb[1];
            const float f[8] = {l0.x * b0.x, l0.y * b0.y, l0.z * b0.z, l0.w * b0.w,
                                l1.x * b1.x, l1.y * b1.y, l1.z * b1.z, l1.w * b1.w};
            *reinterpret_cast<vec16*>(wT + o) = pack8<T>(f);
        }
    }
}

// Phase 2: one CTA of NW warps per (sequence n, value head hv, V slice vb of 16 * NW rows).
// Warp w owns rows [vb * 16NW + 16w, +16) of S (all 128 K columns) as mma accumulators
// (64 f32 per thread), so warps never exchange data; they share the chunk's tiles in
// shared memory (two stages, cp.async). grid = (N * (128 / (16 NW)), HV).
// state_*_kind: 0 none (zeros / not stored), 1 float32, 2 bfloat16; layout [N, HV, V, K].
template <typename T, int NW>
__global__ void __launch_bounds__(NW * 32, 1) kda_chunk_recurrence_kernel(
    const T* __restrict__ v, const unsigned char* __restrict__ ws, T* __restrict__ out,
    const void* __restrict__ state_in, int state_in_kind, void* __restrict__ state_out, int state_out_kind,
    const void* __restrict__ cu_seqlens, int cu_is_64, const int* __restrict__ chunk_offsets, int num_slots,
    long long seq_len_dense, long long total_rows, int HV) {
    constexpr int BV = 16 * NW, NT = 32 * NW, VB = kD / BV, SV = BV + 8;
    constexpr int kStage = rec_stage_bytes(BV);
    extern __shared__ __align__(16) unsigned char smem[];

    const int vb = blockIdx.x % VB, n = blockIdx.x / VB, hv = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, tq = lane & 3;

    const SeqChunks sc = sequence_chunks(n, cu_seqlens, cu_is_64, chunk_offsets, num_slots, seq_len_dense, total_rows);
    const long long bos = sc.bos, len = sc.len;
    const int base_slot = sc.base_slot, nchunks = sc.nchunks;

    // ---- initial state rows of this warp
    const int v0 = vb * BV + warp * 16;
    const long long sbase = ((long long)n * HV + hv) * kD * kD;
    float sacc[16][4];
    load_state_rows(sacc, state_in, state_in_kind, sbase, v0, gq, tq);

    // Per-thread copy pattern (fully unrolled: one cp.async instruction per 16 bytes). Qs, Kt,
    // Kb are 192 rows (three consecutive tiles of the slot, SlotTile) of stride kS16 in the stage;
    // T, Aqk 128 rows of stride kS64, of which only the 10 lower-triangular 16x16 blocks of each
    // are copied (6 KB less per chunk); the V slice 64 rows of 2 * BV bytes, NT / (BV / 8) = 16
    // rows per pass. Thread tid copies chunk tid % 16 (T, Aqk: tid % 8) of every NT / 16-th
    // (NT / 8-th) row from row tid / 16 (tid / 8).
    constexpr int kRowsA = NT / 16, kRowsB = NT / 8, kVPR = BV / 8;
    // Rows 8 or more apart share a swizzle phase (constant source offsets); narrower CTAs
    // unroll less, so that their per-copy offsets are not all live at once.
    constexpr int kUnrollA = kRowsA >= 8 ? 192 / kRowsA : 8, kUnrollB = kRowsB >= 8 ? 128 / kRowsB : 8;
    const int offA_sm = (tid >> 4) * (kS16 * 2) + (tid & 15) * 16;
    const int offB_sm = (tid >> 3) * (kS64 * 2) + (tid & 7) * 16;
    auto src_A = [&](int R) { return (R >> 6) * (kC * kD * 2) + SlotTile::offset(R & (kC - 1), tid & 15); };  // row R of 192
    auto src_B = [&](int R) { return (R >> 6) * (kC * kC * 2) + SlotTile::offset(R & (kC - 1), tid & 7); };   // row R of 128
    const int vr0 = tid / kVPR, vc = (tid % kVPR) * 8;
    const long long v_row_stride = (long long)HV * kD;
    const T* v_head = v + (long long)hv * kD + vb * BV + vc;
    auto issue_loads = [&](int tc, int stage) {
        unsigned char* st = smem + stage * kStage;
        const unsigned char* wslot = ws + ((long long)(base_slot + tc) * HV + hv) * kWsSlotBytes;
        {
            unsigned char* dst = st + kRecQs + offA_sm;
#pragma unroll(kUnrollA)
            for (int i = 0; i < 192 / kRowsA; ++i)
                cp_async_16(dst + i * kRowsA * (kS16 * 2), wslot + kWsQs + src_A((tid >> 4) + i * kRowsA));
        }
        {
            // only the blocks on and below the diagonal (the GEMMs read no others): piece
            // column block (tid & 7) / 2 <= row block of the tile row
            unsigned char* dst = st + kRecT + offB_sm;
#pragma unroll(kUnrollB)
            for (int i = 0; i < 128 / kRowsB; ++i)
                if (((tid & 7) >> 1) <= ((((tid >> 3) + i * kRowsB) & (kC - 1)) >> 4))
                    cp_async_16(dst + i * kRowsB * (kS64 * 2), wslot + kWsT + src_B((tid >> 3) + i * kRowsB));
        }
        if (tid < 32) cp_async_16(st + kRecEgl + tid * 16, wslot + kWsEgl + tid * 16);
        const long long row0 = bos + (long long)tc * kC;
        const int L = (int)min((long long)kC, len - (long long)tc * kC);
#pragma unroll
        for (int i = 0; i < kC / 16; ++i) {  // V slice, zero past the sequence end
            const int r = vr0 + 16 * i;
            const bool ok = r < L;
            cp_async_16(st + kRecV + (r * SV + vc) * 2, v_head + (row0 + (ok ? r : 0)) * v_row_stride, ok);
        }
    };

    if (nchunks > 0) issue_loads(0, 0);
    cp_async_commit();

#pragma unroll 1
    for (int tc = 0; tc < nchunks; ++tc) {
        cp_async_wait<0>();
        __syncthreads();  // chunk tc visible; every warp is done with chunk tc - 1's stage
        if (tc + 1 < nchunks) issue_loads(tc + 1, (tc + 1) & 1);
        cp_async_commit();

        const unsigned char* st = smem + (tc & 1) * kStage;
        const T* sQs = reinterpret_cast<const T*>(st + kRecQs);
        const T* sKt = reinterpret_cast<const T*>(st + kRecKt);
        const T* sKb = reinterpret_cast<const T*>(st + kRecKb);
        const T* sT = reinterpret_cast<const T*>(st + kRecT);
        const T* sAqk = reinterpret_cast<const T*>(st + kRecAqk);
        const float* segl = reinterpret_cast<const float*>(st + kRecEgl);
        const T* sV = reinterpret_cast<const T*>(st + kRecV);
        const long long row0 = bos + (long long)tc * kC;
        const int L = (int)min((long long)kC, len - (long long)tc * kC);
        const int lr = (lane & 7) + ((lane >> 3) & 1) * 8, lc = (lane >> 4) * 8;  // ldmatrix_x4 row/col

        // X = Kt S^T and O = Qs S^T: M = 64 tokens, N = this warp's 16 values, K = 128.
        // S (C layout, rows v, cols k) is directly the B fragment of S^T.
        float accX[4][2][4], accO[4][2][4];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int nv = 0; nv < 2; ++nv)
#pragma unroll
                for (int x = 0; x < 4; ++x) accX[mt][nv][x] = accO[mt][nv][x] = 0.f;
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
            u32 bS[2][2];
            bS[0][0] = pack2<T>(sacc[2 * ks][0], sacc[2 * ks][1]);
            bS[0][1] = pack2<T>(sacc[2 * ks + 1][0], sacc[2 * ks + 1][1]);
            bS[1][0] = pack2<T>(sacc[2 * ks][2], sacc[2 * ks][3]);
            bS[1][1] = pack2<T>(sacc[2 * ks + 1][2], sacc[2 * ks + 1][3]);
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                u32 ak[4], aq[4];
                ldmatrix_x4(ak[0], ak[1], ak[2], ak[3], sKt + (16 * mt + lr) * kS16 + 16 * ks + lc);
                ldmatrix_x4(aq[0], aq[1], aq[2], aq[3], sQs + (16 * mt + lr) * kS16 + 16 * ks + lc);
#pragma unroll
                for (int nv = 0; nv < 2; ++nv) {
                    mma_16x8x16<T>(accX[mt][nv], ak, bS[nv]);
                    mma_16x8x16<T>(accO[mt][nv], aq, bS[nv]);
                }
            }
        }

        // D = V - X in the operand type, transposed into B fragments (k = token, n = value).
        u32 dT[4][2][2];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int nv = 0; nv < 2; ++nv) {
                const int cv = 16 * warp + 8 * nv + 2 * tq;
                const float2 va = unpack2<T>(*reinterpret_cast<const u32*>(sV + (16 * mt + gq) * SV + cv));
                const float2 vc = unpack2<T>(*reinterpret_cast<const u32*>(sV + (16 * mt + gq + 8) * SV + cv));
                dT[mt][nv][0] = movmatrix_trans(pack2<T>(va.x - accX[mt][nv][0], va.y - accX[mt][nv][1]));
                dT[mt][nv][1] = movmatrix_trans(pack2<T>(vc.x - accX[mt][nv][2], vc.y - accX[mt][nv][3]));
            }

        // U = T D (T lower triangular by 16x16 blocks)
        float accU[4][2][4];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
            for (int nv = 0; nv < 2; ++nv)
#pragma unroll
                for (int x = 0; x < 4; ++x) accU[mt][nv][x] = 0.f;
#pragma unroll
            for (int ks = 0; ks <= mt; ++ks) {
                u32 a[4];
                ldmatrix_x4(a[0], a[1], a[2], a[3], sT + (16 * mt + lr) * kS64 + 16 * ks + lc);
#pragma unroll
                for (int nv = 0; nv < 2; ++nv) mma_16x8x16<T>(accU[mt][nv], a, dT[ks][nv]);
            }
        }
        // U in the operand type, transposed: B fragments of U (k = token, n = value), which
        // are also the A fragments of U^T for the state update.
        u32 uT[4][2][2];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int nv = 0; nv < 2; ++nv) {
                uT[mt][nv][0] = movmatrix_trans(pack2<T>(accU[mt][nv][0], accU[mt][nv][1]));
                uT[mt][nv][1] = movmatrix_trans(pack2<T>(accU[mt][nv][2], accU[mt][nv][3]));
            }

        // O += Aqk U (lower triangular by blocks), then store the valid rows
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int ks = 0; ks <= mt; ++ks) {
                u32 a[4];
                ldmatrix_x4(a[0], a[1], a[2], a[3], sAqk + (16 * mt + lr) * kS64 + 16 * ks + lc);
#pragma unroll
                for (int nv = 0; nv < 2; ++nv) mma_16x8x16<T>(accO[mt][nv], a, uT[ks][nv]);
            }
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int nv = 0; nv < 2; ++nv) {
                const int col = vb * BV + 16 * warp + 8 * nv + 2 * tq;
                const int i = 16 * mt + gq;
                if (i < L)
                    *reinterpret_cast<u32*>(out + ((row0 + i) * HV + hv) * kD + col) =
                        pack2<T>(accO[mt][nv][0], accO[mt][nv][1]);
                if (i + 8 < L)
                    *reinterpret_cast<u32*>(out + ((row0 + i + 8) * HV + hv) * kD + col) =
                        pack2<T>(accO[mt][nv][2], accO[mt][nv][3]);
            }

        // S = S diag(egl) + U^T Kb: M = 16 values, N = 128 channels, K = 64 tokens
        decay_state_columns(sacc, segl, tq);
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            const u32 a[4] = {uT[ks][0][0], uT[ks][1][0], uT[ks][0][1], uT[ks][1][1]};
#pragma unroll
            for (int kp = 0; kp < 8; ++kp) {
                u32 b[4];
                ldmatrix_x4_trans(b[0], b[1], b[2], b[3], sKb + (16 * ks + lr) * kS16 + 16 * kp + lc);
                mma_16x8x16<T>(sacc[2 * kp], a, b);
                mma_16x8x16<T>(sacc[2 * kp + 1], a, b + 2);
            }
        }
    }
    cp_async_wait<0>();

    // ---- final state
    store_state_rows(sacc, state_out, state_out_kind, sbase, v0, gq, tq);
}

// Phase 2 on sm_90a: one CTA of NW = 4 or 8 warps (one or two warpgroups) per (sequence n,
// value head hv, V slice vb of 16 NW state rows), the grid of the mma.sync kernel. The chunk
// step runs transposed, so that the state is the accumulator of its own update and every A
// operand is a register fragment of an earlier accumulator. Warpgroup w holds state rows
// [vb * 16NW + 64 w, +64) as an m64n128 f32 accumulator (64 registers per thread, warp
// layout as load_state_rows) and per chunk issues, in four commit groups,
//   X^T = S Kt^T,  O^T = S Qs^T                 m64n64k128 each, A = S (input dtype)
//   D^T = V^T - X^T                             registers (V^T by ldmatrix.trans)
//   U^T = D^T T^T                               m64n64k64,  A = D^T
//   O^T += U^T Aqk^T                            m64n64k64,  A = U^T
//   S = S diag(egl) + U^T Kb                    m64n128k64 (two n64 halves), A = U^T, Kb MN-major
// with every B tile read by descriptor from the stage (rec_wg_stage_bytes). Warpgroups never
// exchange data; the CTA synchronises once per chunk to recycle the two stages, filled by
// cp.async from fixed per-thread offsets. grid = (N * (128 / (16 NW)), HV); parameters and
// state kinds as kda_chunk_recurrence_kernel.
template <typename T, int NW>
__global__ void __launch_bounds__(NW * 32, 1) kda_chunk_recurrence_wgmma_kernel(
    const T* __restrict__ v, const unsigned char* __restrict__ ws, T* __restrict__ out,
    const void* __restrict__ state_in, int state_in_kind, void* __restrict__ state_out, int state_out_kind,
    const void* __restrict__ cu_seqlens, int cu_is_64, const int* __restrict__ chunk_offsets, int num_slots,
    long long seq_len_dense, long long total_rows, int HV) {
    static_assert(NW == 4 || NW == 8, "one or two warpgroups");
    constexpr int BV = 16 * NW, NT = 32 * NW, VB = kD / BV, SV = BV + 8;
    constexpr int kStage = rec_wg_stage_bytes(BV);
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // swizzled tiles need 1024-byte aligned shared addresses (the host adds 1024 bytes for this)
    unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);

    const int vb = blockIdx.x % VB, n = blockIdx.x / VB, hv = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const SeqChunks sc = sequence_chunks(n, cu_seqlens, cu_is_64, chunk_offsets, num_slots, seq_len_dense, total_rows);

    const int v0 = vb * BV + warp * 16;  // this warp's first state row
    const long long sbase = ((long long)n * HV + hv) * kD * kD;
    float S[16][4];
    load_state_rows(S, state_in, state_in_kind, sbase, v0, g, t);

    // Chunk tc's slot (its stage image: Qs | Kt | Kb | T | Aqk | egl) arrives by one bulk copy,
    // issued by thread 0 a chunk ahead, on the stage's mbarrier, with slot tc + 1 prefetched
    // into L2 at the same time; the V slice by cp.async: 64 rows of 2 BV bytes, NT / (BV / 8) =
    // 16 rows per pass.
    auto full = [&](int stage) { return reinterpret_cast<unsigned long long*>(smem + (stage + 1) * kStage - 8); };
    if (tid == 0) {
        mbarrier_init_one(full(0));
        mbarrier_init_one(full(1));
    }
    __syncthreads();  // the initialised barriers, before thread 0's first arrival and any wait
    constexpr int kVPR = BV / 8;
    const int vr0 = tid / kVPR, vc = (tid % kVPR) * 8;
    const long long v_row_stride = (long long)HV * kD;
    const T* v_head = v + (long long)hv * kD + vb * BV + vc;
    auto slot_bytes = [&](int tc) { return ws + ((long long)(sc.base_slot + tc) * HV + hv) * kWsSlotBytes; };
    auto issue_loads = [&](int tc, int stage) {
        unsigned char* st = smem + stage * kStage;
        if (tid == 0) {
            bulk_load(st, slot_bytes(tc), kWsSlotBytes, full(stage));
            if (tc + 1 < sc.nchunks) bulk_prefetch_l2(slot_bytes(tc + 1), kWsSlotBytes);  // the copy after this one
        }
        const long long row0 = sc.bos + (long long)tc * kC;
        const int L = (int)min((long long)kC, sc.len - (long long)tc * kC);
#pragma unroll
        for (int i = 0; i < kC / 16; ++i) {  // V slice, zero past the sequence end
            const int r = vr0 + 16 * i;
            const bool ok = r < L;
            cp_async_16(st + kWgV + (r * SV + vc) * 2, v_head + (row0 + (ok ? r : 0)) * v_row_stride, ok);
        }
    };

    if (sc.nchunks > 0) issue_loads(0, 0);
    cp_async_commit();

#pragma unroll 1
    for (int tc = 0; tc < sc.nchunks; ++tc) {
        unsigned char* st = smem + (tc & 1) * kStage;
        cp_async_wait<0>();
        mbarrier_wait(full(tc & 1), (tc >> 1) & 1);
        attn::fence_proxy_async_smem();  // this thread's cp.async writes, visible to wgmma
        __syncthreads();  // chunk tc visible; every warpgroup is done with chunk tc - 1's stage

        const u32 st_addr = smem_u32(st);
        const long long row0 = sc.bos + (long long)tc * kC;
        const int L = (int)min((long long)kC, sc.len - (long long)tc * kC);

        // X^T = S Kt^T (first group), O^T = S Qs^T (second group, still running during the
        // residual and U^T = (V^T - X^T) T^T)
        u32 aS[8][4];
        accumulator_to_a<T, 8>(aS, S);
        float x[8][4], o[8][4], u[8][4];
        attn::wg_fence_regs<32>(&aS[0][0]);
        attn::wg_fence();
        issue_state_product<T>(x, aS, st_addr + kWgKt);
        attn::wg_commit();
        issue_state_product<T>(o, aS, st_addr + kWgQs);
        attn::wg_commit();
        // the next chunk's tiles into the other stage, issued under the products
        if (tc + 1 < sc.nchunks) issue_loads(tc + 1, (tc + 1) & 1);
        cp_async_commit();
        attn::wg_wait<1>();
        attn::wg_fence_regs<32>(&x[0][0]);
        u32 aD[4][4];
        value_residual_to_a<T, SV>(aD, x, reinterpret_cast<const T*>(st + kWgV), 16 * warp, lane);
        attn::wg_fence_regs<16>(&aD[0][0]);
        attn::wg_fence();
        issue_chunk_square<T, true>(u, aD, st_addr + kWgT);
        attn::wg_commit();
        attn::wg_wait<0>();
        attn::wg_fence_regs<32>(&u[0][0]);
        attn::wg_fence_regs<32>(&o[0][0]);
        u32 aU[4][4];
        accumulator_to_a<T, 4>(aU, u);

        // O^T += U^T Aqk^T (first group), S = S diag(egl) + U^T Kb (second group); the output
        // is stored while the state update runs.
        decay_state_columns(S, reinterpret_cast<const float*>(st + kWgEgl), t);
        attn::wg_fence_regs<16>(&aU[0][0]);
        attn::wg_fence_regs<32>(&o[0][0]);
        attn::wg_fence_regs<64>(&S[0][0]);
        attn::wg_fence();
        issue_chunk_square<T, false>(o, aU, st_addr + kWgAqk);
        attn::wg_commit();
        issue_state_update<T>(S, aU, st_addr + kWgKb);
        attn::wg_commit();
        attn::wg_wait<1>();
        attn::wg_fence_regs<32>(&o[0][0]);
        store_output_columns<T>(out, o, row0, L, HV, hv, v0, g, t);
        attn::wg_wait<0>();
        attn::wg_fence_regs<64>(&S[0][0]);
    }
    cp_async_wait<0>();

    // ---- final state
    store_state_rows(S, state_out, state_out_kind, sbase, v0, g, t);
}
