// common/bulk_copy.cuh emulated: sm_90 bulk copies into shared memory and the one-arrival
// mbarriers they complete on. The mbarrier word counts completed phases; a bulk copy
// completes one phase when issued. Its bytes land at issue, which exposes a copy issued into a
// stage another thread still reads, or, when emu::g_lazy_cp_async is set, at the first wait
// on its barrier, which exposes a read of the stage without that wait.
#pragma once
#include "emu_cuda.h"

#include <atomic>
#include <mutex>
#include <thread>

namespace emu {
struct PendingBulk {
    unsigned long long* bar;
    void* dst;
    const void* src;
    unsigned bytes;
};
inline std::mutex g_bulk_mutex;
inline std::vector<PendingBulk> g_bulk_pending;  // lazy copies not landed yet
// Land the lazy copies that complete on `bar`.
inline void land_bulk(unsigned long long* bar) {
    std::lock_guard<std::mutex> lock(g_bulk_mutex);
    auto& v = g_bulk_pending;
    for (size_t i = 0; i < v.size();) {
        if (v[i].bar == bar) {
            std::memcpy(v[i].dst, v[i].src, v[i].bytes);
            v.erase(v.begin() + static_cast<long>(i));
        } else {
            ++i;
        }
    }
}
}  // namespace emu

namespace mate {
constexpr bool kBulkCopy = true;
inline void mbarrier_init_one(unsigned long long* bar) { std::atomic_ref<unsigned long long>(*bar).store(0); }
inline void bulk_load(void* smem, const void* gmem, unsigned bytes, unsigned long long* bar) {
    const auto s = reinterpret_cast<std::uintptr_t>(smem), g = reinterpret_cast<std::uintptr_t>(gmem);
    const auto base = reinterpret_cast<std::uintptr_t>(emu::dyn_smem());
    if (bytes % 16 || g % 16 || s % 16 || s < base || s + bytes > base + emu::g_block->smem_bytes) {
        std::fprintf(stderr, "bulk_load: misaligned or past shared memory\n");
        std::abort();
    }
    if (emu::g_lazy_cp_async) {
        std::lock_guard<std::mutex> lock(emu::g_bulk_mutex);
        emu::g_bulk_pending.push_back({bar, smem, gmem, bytes});
    } else {
        std::memcpy(smem, gmem, bytes);
    }
    std::atomic_ref<unsigned long long>(*bar).fetch_add(1, std::memory_order_release);
}
inline void bulk_prefetch_l2(const void* gmem, unsigned bytes) {
    if (bytes % 16 || reinterpret_cast<std::uintptr_t>(gmem) % 16) {
        std::fprintf(stderr, "bulk_prefetch_l2: misaligned\n");
        std::abort();
    }
}
// Phase `parity` has completed once the count of completed phases has the other parity (waits
// are in phase order, so the count is then one past it).
inline void mbarrier_wait(unsigned long long* bar, unsigned parity) {
    while ((std::atomic_ref<unsigned long long>(*bar).load(std::memory_order_acquire) & 1u) == parity)
        std::this_thread::yield();
    emu::land_bulk(bar);
}
}  // namespace mate
