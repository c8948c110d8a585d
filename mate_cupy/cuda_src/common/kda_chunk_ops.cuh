// Device helpers of the KDA chunk kernels: tf32 mma.sync, movmatrix, fast exp2,
// 16-bit pair packing. Fragment layouts follow the PTX ISA "Matrix Fragments".
#pragma once
#include "dtype.cuh"
#include "mma.cuh"

namespace mate {
namespace kda {

// 2^x with the MUFU unit (ex2.approx.ftz): 2^-inf = 0, 2^+inf = inf.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// float -> tf32 (round to nearest, ties away from zero; the low 13 bits cleared), kept in
// a 32-bit register. Integer form of cvt.rna.tf32.f32 (which sm_90 emulates with three
// instructions and an infinity test): a finite value that rounds past the largest tf32
// becomes inf, inf stays inf.
__device__ __forceinline__ u32 to_tf32(float x) { return (__float_as_uint(x) + 0x1000u) & 0xFFFFE000u; }

// D(16x8 f32) += A(16x8 tf32, row) * B(8x8 tf32, col).
// a0:(g, t) a1:(g+8, t) a2:(g, t+4) a3:(g+8, t+4); b0:(k=t, n=g) b1:(k=t+4, n=g);
// d: (g, 2t..2t+1), (g+8, 2t..2t+1); g = lane / 4, t = lane % 4.
__device__ __forceinline__ void mma_tf32_16x8x8(float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Transpose an 8x8 b16 matrix held one row pair per lane (lane holds row lane/4,
// columns 2*(lane%4)..+1); the result is held the same way for the transpose.
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
    u32 y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// Two 16-bit values (lo = element 0) -> two floats.
template <typename T> __device__ __forceinline__ float2 unpack2(u32 x);
template <> __device__ __forceinline__ float2 unpack2<half_t>(u32 x) {
    __half2 h = *reinterpret_cast<__half2*>(&x);
    return __half22float2(h);
}
// bfloat16 -> float is exact: the 16 bits become the high half (one shift or mask each).
template <> __device__ __forceinline__ float2 unpack2<bf16_t>(u32 x) {
    return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xFFFF0000u));
}

// Four 16-bit values in an 8-byte vector -> floats.
template <typename T>
__device__ __forceinline__ void unpack4(const uint2& v, float* f) {
    const float2 a = unpack2<T>(v.x), b = unpack2<T>(v.y);
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
}

// Eight 16-bit values in a 16-byte vector -> floats.
template <typename T>
__device__ __forceinline__ void unpack8(const vec16& v, float* f) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 p = unpack2<T>(v.w[i]);
        f[2 * i] = p.x;
        f[2 * i + 1] = p.y;
    }
}
template <typename T>
__device__ __forceinline__ vec16 pack8(const float* f) {
    vec16 v;
#pragma unroll
    for (int i = 0; i < 4; ++i) v.w[i] = pack2<T>(f[2 * i], f[2 * i + 1]);
    return v;
}

}  // namespace kda
}  // namespace mate
