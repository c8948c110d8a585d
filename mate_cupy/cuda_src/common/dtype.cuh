// Element types and conversions shared by every kernel family.
// fp16 (__half), bf16 (__nv_bfloat16), fp8 e4m3 (__nv_fp8_e4m3, stored as uint8).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace mate {

typedef __half half_t;
typedef __nv_bfloat16 bf16_t;
typedef unsigned char fp8_t;  // e4m3fn bits
typedef unsigned int u32;
typedef long long i64;

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<half_t>(half_t x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<bf16_t>(bf16_t x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_float<fp8_t>(fp8_t x) {
    __nv_fp8_e4m3 v;
    v.__x = x;
    return float(v);
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ half_t from_float<half_t>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float x) { return __float2bfloat16_rn(x); }
// Saturating round-to-nearest-even (e4m3fn has no infinity; NaN stays NaN).
template <> __device__ __forceinline__ fp8_t from_float<fp8_t>(float x) {
    return (fp8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

// 16-byte vector of raw bits for vectorised global loads/stores.
struct __align__(16) vec16 { u32 w[4]; };

}  // namespace mate
