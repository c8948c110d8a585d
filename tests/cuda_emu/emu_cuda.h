// CPU SIMT emulation of the CUDA features the kernels of cuda_src/ use, so a kernel source
// itself runs under g++ (optionally with AddressSanitizer) on a machine without a GPU.
// One host thread per CUDA thread; std::barrier for __syncthreads and for every warp
// collective (shuffles, votes, reductions, ldmatrix, mma.sync). cp.async copies either
// when issued (exposes buffers refilled while still being read) or at the wait that
// retires their group (exposes missing waits). Fragment layouts follow the PTX ISA.
// Dynamic shared memory is a fresh allocation per block filled with 0xFF (NaN). Blocks run
// one after another, or up to g_concurrent_blocks at once (their threads interleave, so the
// order of cross-block atomics varies). A static __shared__ variable is one object for
// every block here; tests/index_emu's driver build, which can run blocks at once, rewrites
// such declarations to block_shared (one object per block, filled with 0xFF).
// Extras: emu_wgmma.h (wgmma), emu_bulk.h (bulk copies, mbarriers); per kernel family
// tests/index_emu/emu_index.h, tests/kda_chunk_emu/emu_kda.h, tests/kda_decode_emu/emu_kda_decode.h.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <vector_types.h>
#include <vector_functions.h>
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __forceinline__
#define __forceinline__ inline
#undef __noinline__
#define __noinline__
#define __launch_bounds__(...)
#undef __shared__
#define __shared__ static
#ifndef __align__
#define __align__(n) alignas(n)
#endif
using std::max;
using std::min;

struct EmuDim { unsigned x = 0, y = 0, z = 0; };
inline thread_local EmuDim threadIdx, blockIdx;
inline EmuDim blockDim, gridDim;

namespace emu {
struct Warp {
    std::barrier<> bar{32};
    unsigned char slot[32][64];
};
struct Block {
    std::unique_ptr<std::barrier<>> bar;
    std::vector<std::unique_ptr<Warp>> warps;
    unsigned char* smem = nullptr;
    size_t smem_bytes = 0;
    std::mutex named_m;  // named barriers (bar.sync id, count), made at first use
    std::unique_ptr<std::barrier<>> named[16];
    int named_count[16] = {};
    std::mutex statics_m;  // block_shared objects, made at first use
    std::map<int, std::unique_ptr<unsigned char, decltype(&std::free)>> statics;
};
inline thread_local Block* g_block = nullptr;  // the block of this emulated thread
inline bool g_lazy_cp_async = false;
inline int g_concurrent_blocks = 1;  // blocks run at once (1: one after another)
struct PendingCopy { void* dst; const void* src; bool pred; };
inline thread_local std::vector<PendingCopy> t_open;              // issued, not committed
inline thread_local std::deque<std::vector<PendingCopy>> t_groups;  // committed, not retired
inline unsigned char* dyn_smem() { return g_block->smem; }
// The static __shared__ variable `Id` of type T (an array type allowed) of this thread's
// block, 128-byte aligned.
template <typename T, int Id>
inline T& block_shared() {
    Block& b = *g_block;
    std::lock_guard<std::mutex> lock(b.statics_m);
    auto it = b.statics.find(Id);
    if (it == b.statics.end()) {
        const size_t n = (sizeof(T) + 127) / 128 * 128;
        it = b.statics.emplace(Id, std::unique_ptr<unsigned char, decltype(&std::free)>(
                                       (unsigned char*)std::aligned_alloc(128, n), &std::free)).first;
        std::memset(it->second.get(), 0xFF, n);
    }
    return *reinterpret_cast<T*>(it->second.get());
}
inline Warp& my_warp() { return *g_block->warps[threadIdx.x / 32]; }
inline int my_lane() { return threadIdx.x % 32; }
template <typename V>
inline void put(const V& v) { static_assert(sizeof(V) <= 64); std::memcpy(my_warp().slot[my_lane()], &v, sizeof(V)); }
template <typename V>
inline V get(int lane) { V v; std::memcpy(&v, my_warp().slot[lane], sizeof(V)); return v; }
inline void wsync() { my_warp().bar.arrive_and_wait(); }
inline void do_copy(const PendingCopy& p) {
    if (p.pred) std::memcpy(p.dst, p.src, 16); else std::memset(p.dst, 0, 16);
}

// Blocks in order (x fastest, then y, then z), g_concurrent_blocks of them at a time.
template <typename F>
inline void launch(EmuDim grid, int threads, size_t smem_bytes, F&& body) {
    gridDim = grid;
    blockDim = EmuDim{(unsigned)threads, 1, 1};
    std::vector<std::unique_ptr<Block>> live;
    std::vector<std::thread> ts;
    auto finish = [&] {
        for (auto& t : ts) t.join();
        ts.clear();
        for (auto& b : live) std::free(b->smem);
        live.clear();
    };
    for (unsigned bz = 0; bz < std::max(grid.z, 1u); ++bz)
        for (unsigned by = 0; by < std::max(grid.y, 1u); ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                live.emplace_back(std::make_unique<Block>());
                Block* b = live.back().get();
                b->bar = std::make_unique<std::barrier<>>(threads);
                for (int w = 0; w < threads / 32; ++w) b->warps.emplace_back(std::make_unique<Warp>());
                b->smem_bytes = smem_bytes;
                b->smem = smem_bytes ? (unsigned char*)std::aligned_alloc(128, (smem_bytes + 127) / 128 * 128) : nullptr;
                if (b->smem) std::memset(b->smem, 0xFF, smem_bytes);
                for (int t = 0; t < threads; ++t)
                    ts.emplace_back([&body, b, t, bx, by, bz] {
                        g_block = b;
                        threadIdx = EmuDim{(unsigned)t, 0, 0};
                        blockIdx = EmuDim{bx, by, bz};
                        t_open.clear();
                        t_groups.clear();
                        body();
                        for (auto& p : t_open) do_copy(p);  // (a kernel should not exit with copies in flight)
                        for (auto& g : t_groups) for (auto& p : g) do_copy(p);
                    });
                if ((int)live.size() >= std::max(g_concurrent_blocks, 1)) finish();
            }
    finish();
}
}  // namespace emu

inline void __syncthreads() { emu::g_block->bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::wsync(); }
template <typename V>
inline V __shfl_sync(unsigned, V v, int src) {
    emu::put(v); emu::wsync(); V r = emu::get<V>(src & 31); emu::wsync(); return r;
}
template <typename V>
inline V __shfl_xor_sync(unsigned, V v, int o) {
    emu::put(v); emu::wsync(); V r = emu::get<V>(emu::my_lane() ^ o); emu::wsync(); return r;
}
template <typename V>
inline V __shfl_up_sync(unsigned, V v, int o) {
    emu::put(v); emu::wsync(); int l = emu::my_lane(); V r = l >= o ? emu::get<V>(l - o) : v; emu::wsync(); return r;
}
inline unsigned __ballot_sync(unsigned, bool p) {
    emu::put(int(p)); emu::wsync();
    unsigned r = 0;
    for (int l = 0; l < 32; ++l) r |= (emu::get<int>(l) != 0 ? 1u : 0u) << l;
    emu::wsync();
    return r;
}
inline bool __any_sync(unsigned m, bool p) { return __ballot_sync(m, p) != 0u; }
inline bool __all_sync(unsigned m, bool p) { return __ballot_sync(m, p) == 0xffffffffu; }
inline int __reduce_add_sync(unsigned, int x) {
    emu::put(x); emu::wsync();
    long long s = 0;
    for (int l = 0; l < 32; ++l) s += emu::get<int>(l);
    emu::wsync();
    return (int)s;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __float_as_uint(float x) { unsigned u; std::memcpy(&u, &x, 4); return u; }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
inline int __vimax3_s32(int a, int b, int c) { return std::max(a, std::max(b, c)); }
inline float __expf(float x) { return expf(x); }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __ldcs(const float* p) { return *p; }
inline float4 __ldcs(const float4* p) {
    if (reinterpret_cast<uintptr_t>(p) % 16) { std::fprintf(stderr, "misaligned float4 load\n"); std::abort(); }
    return *p;
}

namespace mate {
typedef __half half_t;
typedef __nv_bfloat16 bf16_t;
typedef unsigned char fp8_t;
typedef unsigned int u32;
typedef long long i64;
template <typename T> inline float to_float(T x);
template <> inline float to_float<float>(float x) { return x; }
template <> inline float to_float<half_t>(half_t x) { return __half2float(x); }
template <> inline float to_float<bf16_t>(bf16_t x) { return __bfloat162float(x); }
template <typename T> inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline half_t from_float<half_t>(float x) { return __float2half_rn(x); }
template <> inline bf16_t from_float<bf16_t>(float x) { return __float2bfloat16_rn(x); }
struct alignas(16) vec16 { u32 w[4]; };

// Shared-space byte addresses are offsets into the block's dynamic shared memory.
inline u32 smem_u32(const void* p) {
    return (u32)(reinterpret_cast<const unsigned char*>(p) - emu::dyn_smem());
}
inline void cp_async_16(void* smem, const void* gmem, bool pred = true) {
    if (reinterpret_cast<uintptr_t>(smem) % 16 || (pred && reinterpret_cast<uintptr_t>(gmem) % 16)) {
        std::fprintf(stderr, "misaligned cp.async\n");
        std::abort();
    }
    emu::PendingCopy p{smem, gmem, pred};
    if (emu::g_lazy_cp_async) emu::t_open.push_back(p); else emu::do_copy(p);
}
inline void cp_async_16_at(u32 saddr, const void* gmem, bool pred) {
    if (saddr + 16 > emu::g_block->smem_bytes) { std::fprintf(stderr, "cp.async past shared memory\n"); std::abort(); }
    cp_async_16(emu::dyn_smem() + saddr, gmem, pred);
}
inline void cp_async_commit() {
    emu::t_groups.push_back(std::move(emu::t_open));
    emu::t_open.clear();
}
template <int N> inline void cp_async_wait() {
    while ((int)emu::t_groups.size() > N) {
        for (auto& p : emu::t_groups.front()) emu::do_copy(p);
        emu::t_groups.pop_front();
    }
}

// ldmatrix x4: lane l gives the address of row l%8 of matrix l/8; register m of lane l
// holds elements (l/4, 2(l%4)) and (l/4, 2(l%4)+1) of matrix m.
inline void ldmatrix_x4(u32& r0, u32& r1, u32& r2, u32& r3, const void* p) {
    emu::put(p); emu::wsync();
    int l = emu::my_lane(), g = l / 4, t = l % 4;
    u32 r[4];
    for (int m = 0; m < 4; ++m) {
        const unsigned char* row = emu::get<const unsigned char*>(8 * m + g);
        std::memcpy(&r[m], row + 4 * t, 4);
    }
    emu::wsync();
    r0 = r[0]; r1 = r[1]; r2 = r[2]; r3 = r[3];
}
inline void ldmatrix_x4_at(u32* r, u32 saddr) {
    if (saddr + 16 > emu::g_block->smem_bytes) { std::fprintf(stderr, "ldmatrix past shared memory\n"); std::abort(); }
    ldmatrix_x4(r[0], r[1], r[2], r[3], emu::dyn_smem() + saddr);
}

inline void ldmatrix_x4_trans(u32& r0, u32& r1, u32& r2, u32& r3, const void* p) {
    emu::put(p); emu::wsync();
    int l = emu::my_lane(), g = l / 4, t = l % 4;
    u32 r[4];
    for (int m = 0; m < 4; ++m) {
        uint16_t lo, hi;
        const unsigned char* ra = emu::get<const unsigned char*>(8 * m + 2 * t);
        const unsigned char* rb = emu::get<const unsigned char*>(8 * m + 2 * t + 1);
        std::memcpy(&lo, ra + 2 * g, 2); std::memcpy(&hi, rb + 2 * g, 2);
        r[m] = (u32)lo | ((u32)hi << 16);
    }
    emu::wsync();
    r0 = r[0]; r1 = r[1]; r2 = r[2]; r3 = r[3];
}

template <typename T> inline float h2f(uint16_t b) { T x; std::memcpy(&x, &b, 2); return to_float<T>(x); }
inline uint16_t half_of(u32 w, int i) { return i ? (uint16_t)(w >> 16) : (uint16_t)(w & 0xFFFF); }

// A warp-wide m16n8kK mma.sync, f32 accumulate (exact products, float sums in k order): the
// lanes' fragments are exchanged, `place(a, b, g, t, A, B)` puts lane (g = lane / 4,
// t = lane % 4)'s A and B elements, and each lane gets its four elements of C + A B.
template <int K, typename Place>
inline void mma_16x8(float* d, const u32* a, const u32* b, Place place) {
    struct In { u32 a[4]; u32 b[2]; float c[4]; } in;
    for (int i = 0; i < 4; ++i) { in.a[i] = a[i]; in.c[i] = d[i]; }
    in.b[0] = b[0]; in.b[1] = b[1];
    emu::put(in); emu::wsync();
    float A[16][K], B[K][8], C[16][8];
    for (int L = 0; L < 32; ++L) {
        In x = emu::get<In>(L);
        int g = L / 4, t = L % 4;
        place(x.a, x.b, g, t, A, B);
        C[g][2 * t] = x.c[0]; C[g][2 * t + 1] = x.c[1]; C[g + 8][2 * t] = x.c[2]; C[g + 8][2 * t + 1] = x.c[3];
    }
    emu::wsync();
    int l = emu::my_lane(), g = l / 4, t = l % 4;
    int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int i = 0; i < 4; ++i) {
        float s = C[rows[i]][cols[i]];
        for (int kk = 0; kk < K; ++kk) s += A[rows[i]][kk] * B[kk][cols[i]];
        d[i] = s;
    }
}

// mma.sync m16n8k16 on fp16/bf16 fragments.
template <typename T>
inline void mma_16x8x16(float* d, const u32* a, const u32* b) {
    mma_16x8<16>(d, a, b, [](const u32* xa, const u32* xb, int g, int t, float (*A)[16], float (*B)[8]) {
        for (int e = 0; e < 2; ++e) {
            A[g][2 * t + e] = h2f<T>(half_of(xa[0], e));
            A[g + 8][2 * t + e] = h2f<T>(half_of(xa[1], e));
            A[g][2 * t + 8 + e] = h2f<T>(half_of(xa[2], e));
            A[g + 8][2 * t + 8 + e] = h2f<T>(half_of(xa[3], e));
            B[2 * t + e][g] = h2f<T>(half_of(xb[0], e));
            B[2 * t + 8 + e][g] = h2f<T>(half_of(xb[1], e));
        }
    });
}

template <typename T> inline u32 pack2(float lo, float hi);
template <> inline u32 pack2<half_t>(float lo, float hi) { __half2 h = __floats2half2_rn(lo, hi); u32 r; std::memcpy(&r, &h, 4); return r; }
template <> inline u32 pack2<bf16_t>(float lo, float hi) { __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi); u32 r; std::memcpy(&r, &h, 4); return r; }
}  // namespace mate
