// Host driver: runs the V-first KDA decode kernel (cuda_src/kda_decode.cu) in the CPU
// emulator over a fixed grid of cases (state dtype, warps, tokens, slot modes, V) and
// writes every output and pool byte to one file, so two kernel sources or two slicings can
// be compared bit for bit. Usage: driver OUTFILE [PASSES [LAZY_CP_ASYNC]] (the kernel source
// is included as kda_decode_emu.inc; PASSES: register passes per V-first CTA).
#include "emu_cuda.h"
#undef __maxnreg__
#define __maxnreg__(n)
#define kda_decode_smem (emu::dyn_smem())
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long b = (unsigned long long)y << 32 | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((b >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}
inline void __stcs(float4* p, float4 v) { *p = v; }
inline void __stcs(uint4* p, uint4 v) { *p = v; }
namespace mate {
constexpr bool kBulkCopy = false;
inline void mbarrier_init_one(unsigned long long*) {}
inline void bulk_load(void*, const void*, unsigned, unsigned long long*) {}
inline void mbarrier_wait(unsigned long long*, unsigned) {}
}  // namespace mate
#include "kda_decode_emu.inc"
#include <random>

using namespace mate;
using namespace kda_decode;

static std::mt19937 rng(1234);
static float rnd(float s) { return std::normal_distribution<float>(0.f, s)(rng); }
template <typename T> static std::vector<T> randv(size_t n, float s) {
    std::vector<T> v(n);
    for (auto& x : v) x = from_float<T>(rnd(s));
    return v;
}

template <typename S>
static void run_case(FILE* f, int nw, int passes, int T, int idx_mode, int V, int inplace, int final_state) {
    const int N = 3, H = 2, HV = 4, K = 128, P = 5;
    const int VS = 16 * nw * passes, n_splits = (V + VS - 1) / VS;
    const int C = 4;  // [N, C] slots
    auto q = randv<bf16_t>((size_t)N * T * H * K, 1.f), k = randv<bf16_t>((size_t)N * T * H * K, 1.f);
    auto v = randv<bf16_t>((size_t)N * T * HV * V, 1.f), a = randv<bf16_t>((size_t)N * T * HV * K, 1.f);
    auto b = randv<bf16_t>((size_t)N * T * HV, 1.f);
    std::vector<float> A_log(HV), dt_bias((size_t)HV * K);
    for (auto& x : A_log) x = rnd(0.5f);
    for (auto& x : dt_bias) x = rnd(0.5f);
    auto pool = randv<S>((size_t)P * HV * V * K, 0.3f);
    std::vector<float> out((size_t)N * T * HV * V, NAN);
    std::vector<S> fin((size_t)N * HV * V * K, from_float<S>(NAN));
    std::vector<int> idx;
    std::vector<int> acc = {2, 1, 3};
    int idx_cols = 0;
    if (idx_mode == 1) { idx = {3, -1, 0}; idx_cols = -1; }
    if (idx_mode == 2) { idx = {1, 2, -1, 4, 0, 3, 2, 1, 4, -1, 9, 0}; idx_cols = C; }
    int flags = kL2Norm | kGateInKernel | kLowerBound | kBetaSigmoid | kInitialState;
    if (inplace) flags |= kInplace;
    if (idx_mode == 2) flags |= kHasAccepted;
    const int dtypes = (kBF16 << kDtQ) | (kBF16 << kDtK) | (kBF16 << kDtV) | (kBF16 << kDtA) | (kBF16 << kDtB) |
                       (kF32 << kDtBias) | (kF32 << kDtOut);
    const int tc = std::min(T, 8);
    const int stage = VS * K * (int)sizeof(S);
    const size_t smem = stage + ((tc + 1) / 2) * 16 + ((tc + 3) / 4) * 16 + 3 * tc * K * 4 + 2 * tc * VS * 4;
    emu::launch(EmuDim{(unsigned)(N * HV * n_splits), 1, 1}, 32 * nw, smem, [&] {
        kda_decode::kda_decode_vfirst_kernel<S>(
            q.data(), k.data(), v.data(), a.data(), b.data(), A_log.data(), dt_bias.data(), pool.data(),
            idx.empty() ? nullptr : idx.data(), idx_mode == 2 ? acc.data() : nullptr, nullptr, out.data(),
            final_state ? fin.data() : nullptr, P, T * H * K, H * K, K, T * H * K, H * K, K, T * HV * V, HV * V, V,
            T * HV * K, HV * K, K, T * HV, HV, 1, N, T, H, HV, V, idx_cols, flags, dtypes, 0.0884f, -5.f, n_splits,
            tc, VS);
    });
    std::fwrite(out.data(), 4, out.size(), f);
    std::fwrite(pool.data(), sizeof(S), pool.size(), f);
    if (final_state) std::fwrite(fin.data(), sizeof(S), fin.size(), f);
}

int main(int argc, char** argv) {
    FILE* f = std::fopen(argv[1], "wb");
    const int passes = argc > 2 ? std::atoi(argv[2]) : 1;
    emu::g_lazy_cp_async = argc > 3 && std::atoi(argv[3]) != 0;  // copies land at their wait
    int n = 0;
    for (int nw : {1, 2, 4})
        for (int T : {1, 3, 10})
            for (int idx_mode : {0, 1, 2})
                for (int V : {128, 48}) {
                    if (V == 48 && nw != 4) continue;
                    const int inplace = (n % 3) != 2, fs = !inplace || (n % 4 == 0);
                    run_case<float>(f, nw, passes, T, idx_mode, V, inplace, fs);
                    run_case<bf16_t>(f, nw, passes, T, idx_mode, V, inplace, fs);
                    ++n;
                }
    std::fclose(f);
    std::printf("%d cases x 2 dtypes\n", n);
    return 0;
}
