// The CPU emulator (tests/cuda_emu, tests/index_emu/emu_index.h: wgmma, warpgroup barriers) plus
// what cuda_src/attention_gather.cu needs beyond it: integer atomics and the fast math of
// common/softmax.cuh (ex2.approx as exp2f).
#pragma once
#include "emu_index.h"

#include <atomic>
#include <cmath>

inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline unsigned atomicMax(unsigned* p, unsigned v) {
    std::atomic_ref<unsigned> a(*p);
    unsigned cur = a.load();
    while (cur < v && !a.compare_exchange_weak(cur, v)) {
    }
    return cur;
}
inline float __log2f(float x) { return std::log2(x); }
// Streaming (evict-first) stores and loads: plain accesses here.
template <typename V>
inline void __stcs(V* p, const V& v) {
    *p = v;
}
inline uint4 __ldcs(const uint4* p) { return *p; }
namespace mate {
// L2 cache policies: no cache here, a copy is a copy.
inline unsigned long long l2_policy_evict_last() { return 0; }
inline unsigned long long l2_policy_evict_first() { return 0; }
inline void cp_async_16_policy(void* smem, const void* gmem, unsigned long long, bool pred = true) {
    cp_async_16(smem, gmem, pred);
}
}  // namespace mate

namespace mate {
namespace attn {
inline float fast_exp2(float x) { return std::exp2(x); }
}  // namespace attn
}  // namespace mate
