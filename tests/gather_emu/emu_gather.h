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

namespace mate {
namespace attn {
inline float fast_exp2(float x) { return std::exp2(x); }
}  // namespace attn
}  // namespace mate
