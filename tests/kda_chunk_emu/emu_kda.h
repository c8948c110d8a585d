// The CPU emulator (tests/cuda_emu/emu_cuda.h, emu_wgmma.h, emu_bulk.h) plus what cuda_src/kda_chunk.cu needs
// beyond it.
#pragma once
#include "emu_cuda.h"
#include "emu_wgmma.h"
#include "emu_bulk.h"

namespace mate {
namespace kda {
// ex2.approx.ftz: subnormal results flush to zero.
inline float fast_exp2(float x) { const float y = exp2f(x); return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y; }
inline u32 to_tf32(float x) { u32 u; std::memcpy(&u, &x, 4); return (u + 0x1000u) & 0xFFFFE000u; }
inline float bits_f(u32 u) { float f; std::memcpy(&f, &u, 4); return f; }
inline void mma_tf32_16x8x8(float* d, const u32* a, const u32* b) {
    mma_16x8<8>(d, a, b, [](const u32* xa, const u32* xb, int g, int t, float (*A)[8], float (*B)[8]) {
        A[g][t] = bits_f(xa[0]); A[g + 8][t] = bits_f(xa[1]); A[g][t + 4] = bits_f(xa[2]); A[g + 8][t + 4] = bits_f(xa[3]);
        B[t][g] = bits_f(xb[0]); B[t + 4][g] = bits_f(xb[1]);
    });
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
