// CPU SIMT emulation of the CUDA features used by cuda_src/kda_chunk.cu, so the kernel
// source itself runs under g++ (and AddressSanitizer) on a machine without a GPU.
// One host thread per CUDA thread; std::barrier for __syncthreads and for the warp
// collectives (mma.sync bf16/fp16/tf32, ldmatrix(.trans), movmatrix, shuffles, votes);
// cp.async copies eagerly (earliest point: exposes early overwrites) or at the wait
// (latest point: exposes missing waits). Fragment layouts per the PTX ISA. Dynamic
// shared memory is a fresh malloc per block filled with 0xFF (NaN) so stray reads show.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <vector_types.h>
#include <vector_functions.h>
#include <barrier>
#include <thread>
#include <vector>
#include <cstring>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>

#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __forceinline__
#define __forceinline__ inline
#define __launch_bounds__(...)
#undef __shared__
#define __shared__ static
#ifndef __align__
#define __align__(n) alignas(n)
#endif
using std::min;
using std::max;

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
};
inline Block* g_block = nullptr;
inline bool g_lazy_cp_async = false;
struct PendingCopy { void* dst; const void* src; bool pred; };
inline thread_local std::vector<PendingCopy> t_pending;
inline unsigned char* dyn_smem() { return g_block->smem; }
inline Warp& my_warp() { return *g_block->warps[threadIdx.x / 32]; }
inline int my_lane() { return threadIdx.x % 32; }
template <typename V>
inline void put(const V& v) { static_assert(sizeof(V) <= 64); std::memcpy(my_warp().slot[my_lane()], &v, sizeof(V)); }
template <typename V>
inline V get(int lane) { V v; std::memcpy(&v, my_warp().slot[lane], sizeof(V)); return v; }
inline void wsync() { my_warp().bar.arrive_and_wait(); }

template <typename F>
inline void launch(EmuDim grid, int threads, size_t smem_bytes, F&& body) {
    gridDim = grid;
    blockDim = EmuDim{(unsigned)threads, 1, 1};
    for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            Block b;
            b.bar = std::make_unique<std::barrier<>>(threads);
            for (int w = 0; w < threads / 32; ++w) b.warps.emplace_back(std::make_unique<Warp>());
            b.smem_bytes = smem_bytes;
            b.smem = smem_bytes ? (unsigned char*)std::malloc(smem_bytes) : nullptr;
            if (b.smem) std::memset(b.smem, 0xFF, smem_bytes);  // NaN poison
            g_block = &b;
            std::vector<std::thread> ts;
            for (int t = 0; t < threads; ++t)
                ts.emplace_back([&, t, bx, by] {
                    threadIdx = EmuDim{(unsigned)t, 0, 0};
                    blockIdx = EmuDim{bx, by, 0};
                    body();
                });
            for (auto& t : ts) t.join();
            std::free(b.smem);
            g_block = nullptr;
        }
}
}  // namespace emu

inline void __syncthreads() { emu::g_block->bar->arrive_and_wait(); }
template <typename V>
inline V __shfl_xor_sync(unsigned, V v, int o) {
    emu::put(v); emu::wsync(); V r = emu::get<V>(emu::my_lane() ^ o); emu::wsync(); return r;
}
template <typename V>
inline V __shfl_up_sync(unsigned, V v, int o) {
    emu::put(v); emu::wsync(); int l = emu::my_lane(); V r = l >= o ? emu::get<V>(l - o) : v; emu::wsync(); return r;
}
inline bool __any_sync(unsigned, bool p) {
    emu::put(int(p)); emu::wsync(); bool r = false; for (int l = 0; l < 32; ++l) r |= emu::get<int>(l) != 0; emu::wsync(); return r;
}
inline float __expf(float x) { return expf(x); }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline float __fdividef(float a, float b) { return a / b; }

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

inline void cp_async_16(void* smem, const void* gmem, bool pred = true) {
    if (emu::g_lazy_cp_async) { emu::t_pending.push_back({smem, gmem, pred}); return; }
    if (pred) std::memcpy(smem, gmem, 16); else std::memset(smem, 0, 16);
}
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {
    static_assert(N == 0, "emulator handles wait_group 0 only");
    for (auto& p : emu::t_pending) { if (p.pred) std::memcpy(p.dst, p.src, 16); else std::memset(p.dst, 0, 16); }
    emu::t_pending.clear();
}

// ldmatrix x4: lane l gives the address of row l%8 of matrix l/8.
inline void ldmatrix_x4(u32& r0, u32& r1, u32& r2, u32& r3, const void* p) {
    emu::put(p); emu::wsync();
    int l = emu::my_lane(), g = l / 4, t = l % 4;
    u32 r[4];
    for (int m = 0; m < 4; ++m) { const unsigned char* row = emu::get<const unsigned char*>(8 * m + g); std::memcpy(&r[m], row + 4 * t, 4); }
    emu::wsync();
    r0 = r[0]; r1 = r[1]; r2 = r[2]; r3 = r[3];
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

template <typename T>
inline void mma_16x8x16(float* d, const u32* a, const u32* b) {
    struct In { u32 a[4]; u32 b[2]; float c[4]; } in;
    for (int i = 0; i < 4; ++i) { in.a[i] = a[i]; in.c[i] = d[i]; }
    in.b[0] = b[0]; in.b[1] = b[1];
    emu::put(in); emu::wsync();
    float A[16][16], B[16][8], C[16][8];
    for (int L = 0; L < 32; ++L) {
        In x = emu::get<In>(L);
        int g = L / 4, t = L % 4;
        for (int e = 0; e < 2; ++e) {
            A[g][2 * t + e] = h2f<T>(half_of(x.a[0], e));
            A[g + 8][2 * t + e] = h2f<T>(half_of(x.a[1], e));
            A[g][2 * t + 8 + e] = h2f<T>(half_of(x.a[2], e));
            A[g + 8][2 * t + 8 + e] = h2f<T>(half_of(x.a[3], e));
            B[2 * t + e][g] = h2f<T>(half_of(x.b[0], e));
            B[2 * t + 8 + e][g] = h2f<T>(half_of(x.b[1], e));
            C[g][2 * t + e] = x.c[e];
            C[g + 8][2 * t + e] = x.c[2 + e];
        }
    }
    emu::wsync();
    int l = emu::my_lane(), g = l / 4, t = l % 4;
    int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int i = 0; i < 4; ++i) {
        float s = C[rows[i]][cols[i]];
        for (int kk = 0; kk < 16; ++kk) s += A[rows[i]][kk] * B[kk][cols[i]];
        d[i] = s;
    }
}

template <typename T> inline u32 pack2(float lo, float hi);
template <> inline u32 pack2<half_t>(float lo, float hi) { __half2 h = __floats2half2_rn(lo, hi); u32 r; std::memcpy(&r, &h, 4); return r; }
template <> inline u32 pack2<bf16_t>(float lo, float hi) { __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi); u32 r; std::memcpy(&r, &h, 4); return r; }

namespace kda {
// ex2.approx.ftz: subnormal results flush to zero.
inline float fast_exp2(float x) { const float y = exp2f(x); return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y; }
inline u32 to_tf32(float x) { u32 u; std::memcpy(&u, &x, 4); return (u + 0x1000u) & 0xFFFFE000u; }
inline float bits_f(u32 u) { float f; std::memcpy(&f, &u, 4); return f; }
inline void mma_tf32_16x8x8(float* d, const u32* a, const u32* b) {
    struct In { u32 a[4]; u32 b[2]; float c[4]; } in;
    for (int i = 0; i < 4; ++i) { in.a[i] = a[i]; in.c[i] = d[i]; }
    in.b[0] = b[0]; in.b[1] = b[1];
    emu::put(in); emu::wsync();
    float A[16][8], B[8][8], C[16][8];
    for (int L = 0; L < 32; ++L) {
        In x = emu::get<In>(L);
        int g = L / 4, t = L % 4;
        A[g][t] = bits_f(x.a[0]); A[g + 8][t] = bits_f(x.a[1]); A[g][t + 4] = bits_f(x.a[2]); A[g + 8][t + 4] = bits_f(x.a[3]);
        B[t][g] = bits_f(x.b[0]); B[t + 4][g] = bits_f(x.b[1]);
        C[g][2 * t] = x.c[0]; C[g][2 * t + 1] = x.c[1]; C[g + 8][2 * t] = x.c[2]; C[g + 8][2 * t + 1] = x.c[3];
    }
    emu::wsync();
    int l = emu::my_lane(), g = l / 4, t = l % 4;
    int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int i = 0; i < 4; ++i) {
        float s = C[rows[i]][cols[i]];
        for (int kk = 0; kk < 8; ++kk) s += A[rows[i]][kk] * B[kk][cols[i]];
        d[i] = s;
    }
}
// lane holds M[lane/4][2(lane%4)+e]; returns M^T the same way: M[2(lane%4)+e][lane/4]
inline u32 movmatrix_trans(u32 x) {
    emu::put(x); emu::wsync();
    int l = emu::my_lane(), g = l / 4, t = l % 4;
    auto elem = [&](int r, int c) { return half_of(emu::get<u32>(4 * r + c / 2), c % 2); };
    u32 y = (u32)elem(2 * t, g) | ((u32)elem(2 * t + 1, g) << 16);
    emu::wsync();
    return y;
}
template <typename T> inline float2 unpack2(u32 x) { return make_float2(h2f<T>(half_of(x, 0)), h2f<T>(half_of(x, 1))); }
template <typename T> inline void unpack4(const uint2& v, float* f) {
    float2 a = unpack2<T>(v.x), b = unpack2<T>(v.y); f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
}
template <typename T> inline void unpack8(const vec16& v, float* f) {
    for (int i = 0; i < 4; ++i) { float2 p = unpack2<T>(v.w[i]); f[2 * i] = p.x; f[2 * i + 1] = p.y; }
}
template <typename T> inline vec16 pack8(const float* f) {
    vec16 v; for (int i = 0; i < 4; ++i) v.w[i] = pack2<T>(f[2 * i], f[2 * i + 1]); return v;
}
}  // namespace kda
}  // namespace mate
