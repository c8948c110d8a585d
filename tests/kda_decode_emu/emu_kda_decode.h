// The CPU emulator (tests/cuda_emu/emu_cuda.h, emu_bulk.h) plus what cuda_src/kda_decode.cu
// needs beyond it: streaming stores, byte permutes, the register cap attribute.
#pragma once
#include "emu_cuda.h"
#include "emu_bulk.h"
#include "emu_wgmma.h"  // (the shared driver sets its lazy flag)

#define __maxnreg__(...)

template <typename V>
inline void __stcs(V* p, const V& v) {
    static_assert(sizeof(V) == 16);
    if (reinterpret_cast<std::uintptr_t>(p) % 16) {
        std::fprintf(stderr, "misaligned 16-byte store\n");
        std::abort();
    }
    *p = v;
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// prmt (default mode): byte i of the result is byte s[4i + 2 : 4i] of {y, x} (x bytes 0-3).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long b = (unsigned long long)y << 32 | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((b >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
    return r;
}
