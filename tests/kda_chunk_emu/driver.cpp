// Host driver: runs the kda_chunk kernels in the emulator the way mate_cupy/kda/chunk_launch.py
// launches them.
// Usage: driver DIR (DIR/params.txt and raw input arrays in, out.bin/ht.bin/ws.bin out).
#include "emu_kda.h"
#include "kda_chunk_emu.inc"
#include <fstream>
#include <string>

static std::string DIR;
static void* load(const char* name, size_t* nbytes = nullptr) {
    std::ifstream f(DIR + "/" + name, std::ios::binary | std::ios::ate);
    if (!f) return nullptr;
    size_t n = f.tellg(); f.seekg(0);
    void* p = std::malloc(n ? n : 1);
    f.read((char*)p, n);
    if (nbytes) *nbytes = n;
    return p;
}
static void save(const char* name, const void* p, size_t n) {
    std::ofstream f(DIR + "/" + name, std::ios::binary); f.write((const char*)p, n);
}

template <typename T, int NW>
void run_rec(EmuDim grid, const T* v, const unsigned char* ws, T* out, const void* h0, int ik, void* ht, int ok,
             const void* cu, int is64, const int* offs, int num_slots, long long Tdense, long long rows, int HV) {
    constexpr int stage = rec_stage_bytes(16 * NW);
    emu::launch(grid, 32 * NW, 2 * stage, [&] {
        kda_chunk_recurrence_kernel<T, NW>(v, ws, out, h0, ik, ht, ok, cu, is64, offs, num_slots, Tdense, rows, HV);
    });
}

template <typename T, int NW>
void run_rec_wgmma(EmuDim grid, const T* v, const unsigned char* ws, T* out, const void* h0, int ik, void* ht, int ok,
                   const void* cu, int is64, const int* offs, int num_slots, long long Tdense, long long rows, int HV) {
    constexpr int smem = 2 * rec_wg_stage_bytes(16 * NW) + 1024;  // chunk_launch.recurrence_smem(NW, wgmma=True)
    emu::launch(grid, 32 * NW, smem, [&] {
        kda_chunk_recurrence_wgmma_kernel<T, NW>(v, ws, out, h0, ik, ht, ok, cu, is64, offs, num_slots, Tdense, rows,
                                                 HV);
    });
}

template <typename T>
int run(int B, int Tn, int H, int HV, int N, int varlen, int has_gate, int l2, float scale, float lb, int ik, int okind,
        int is64, int nw, int wgmma) {
    const T* q = (const T*)load("q.bin"); const T* k = (const T*)load("k.bin");
    const T* v = (const T*)load("v.bin"); const T* g = (const T*)load("g.bin"); const T* beta = (const T*)load("beta.bin");
    const float* A_log = has_gate ? (const float*)load("A_log.bin") : nullptr;
    const float* dt_bias = has_gate ? (const float*)load("dt_bias.bin") : nullptr;
    const void* cu = varlen ? load("cu.bin") : nullptr;
    const void* h0 = ik ? load("h0.bin") : nullptr;
    long long rows = (long long)B * Tn;
    int num_slots = varlen ? (int)((Tn + 63LL * N) / 64) : B * ((Tn + 63) / 64);
    size_t wsb = (size_t)std::max(1, num_slots * HV * kWsSlotBytes);
    unsigned char* ws = (unsigned char*)std::malloc(wsb); std::memset(ws, 0xFF, wsb);
    size_t outb = (size_t)rows * HV * 128 * sizeof(T);
    T* out = (T*)std::malloc(outb ? outb : 1); std::memset(out, 0xFF, outb);
    size_t htb = (size_t)N * HV * 128 * 128 * (okind == 1 ? 4 : 2);
    void* ht = okind ? std::malloc(htb) : nullptr; if (ht) std::memset(ht, 0xFF, htb);
    int* offs = nullptr;
    if (varlen && N > 0) {
        offs = (int*)std::malloc((N + 1) * sizeof(int));
        emu::launch(EmuDim{1, 1, 1}, 1024, 0, [&] { kda_chunk_offsets_kernel(cu, is64, N, rows, offs); });
        save("offsets.bin", offs, (N + 1) * sizeof(int));
    }
    if (num_slots > 0 && HV > 0) {
        const EmuDim grid{(unsigned)num_slots, (unsigned)HV, 1};
        emu::launch(grid, 256, kPrepSmemBytes, [&] {
            kda_chunk_prepare_kernel<T>(q, k, g, beta, A_log, dt_bias, cu, is64, offs, ws, N, varlen ? 0 : Tn, rows, H,
                                        HV, scale, lb, l2, has_gate);
        });
    }
    save("ws.bin", ws, wsb);
    if (N > 0 && HV > 0 && !(Tn == 0 && !okind)) {
        EmuDim grid{(unsigned)(N * (128 / (16 * nw))), (unsigned)HV, 1};
        long long Td = varlen ? 0 : Tn;
        if (wgmma) {
            if (nw == 4) run_rec_wgmma<T, 4>(grid, v, ws, out, h0, ik, ht, okind, cu, is64, offs, num_slots, Td, rows, HV);
            if (nw == 8) run_rec_wgmma<T, 8>(grid, v, ws, out, h0, ik, ht, okind, cu, is64, offs, num_slots, Td, rows, HV);
        } else switch (nw) {
            case 1: run_rec<T, 1>(grid, v, ws, out, h0, ik, ht, okind, cu, is64, offs, num_slots, Td, rows, HV); break;
            case 2: run_rec<T, 2>(grid, v, ws, out, h0, ik, ht, okind, cu, is64, offs, num_slots, Td, rows, HV); break;
            case 4: run_rec<T, 4>(grid, v, ws, out, h0, ik, ht, okind, cu, is64, offs, num_slots, Td, rows, HV); break;
            case 8: run_rec<T, 8>(grid, v, ws, out, h0, ik, ht, okind, cu, is64, offs, num_slots, Td, rows, HV); break;
        }
    }
    save("out.bin", out, outb);
    if (ht) save("ht.bin", ht, htb);
    return 0;
}

int main(int argc, char** argv) {
    DIR = argv[1];
    std::ifstream p(DIR + "/params.txt");
    int B, Tn, H, HV, N, varlen, dtype, has_gate, l2, ik, ok, is64, nw, lazy, wgmma; float scale, lb;
    p >> B >> Tn >> H >> HV >> N >> varlen >> dtype >> has_gate >> l2 >> scale >> lb >> ik >> ok >> is64 >> nw >> lazy
      >> wgmma;
    emu::g_lazy_cp_async = lazy;
    emu::g_lazy_wgmma = lazy;
    return dtype ? run<mate::bf16_t>(B, Tn, H, HV, N, varlen, has_gate, l2, scale, lb, ik, ok, is64, nw, wgmma)
                 : run<mate::half_t>(B, Tn, H, HV, N, varlen, has_gate, l2, scale, lb, ik, ok, is64, nw, wgmma);
}
