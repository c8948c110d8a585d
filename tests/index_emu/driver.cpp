// Host driver: runs one launch of a kernel of cuda_src/ in the CPU emulator, exactly as the
// Python launcher recorded it: msa_index.cu by default, another family's source through
// -DEMU_HEADER="<its emulator extras>" -DEMU_SOURCE="<its prepared source>" (tests/gather_emu).
//
// Usage: driver DIR. DIR/launch.txt:
//   line 1: kernel name (as registered, e.g. "msa_topk_stream_kernel<16, 4>")
//   line 2: grid.x grid.y grid.z threads dynamic_smem_bytes lazy (cp.async copies land and
//           wgmma computes at the wait that retires their group, instead of at issue)
//   then one line per kernel argument: "A <index> <byte offset>" (array DIR/a<index>.bin),
//   "P0" (null pointer), "I <integer>" or "F <float>".
// Arrays are loaded 256-byte aligned (once per index) and written back to DIR/a<index>.out.
// EMU_CONCURRENT_BLOCKS=N: up to N blocks of the launch run at once (default 1).
#ifndef EMU_HEADER
#define EMU_HEADER "emu_index.h"
#endif
#ifndef EMU_SOURCE
#define EMU_SOURCE "msa_index_emu.inc"
#endif
#include EMU_HEADER
#include EMU_SOURCE

#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

namespace {

struct Arg {
    char kind = 'I';
    void* ptr = nullptr;
    long long i = 0;
    double f = 0.0;
};

struct Args {
    std::vector<Arg> v;
    template <typename P>
    P get(size_t k) const {
        if (k >= v.size()) { std::fprintf(stderr, "missing argument %zu\n", k); std::exit(3); }
        const Arg& a = v[k];
        if constexpr (std::is_pointer_v<P>) {
            if (a.kind != 'A' && a.kind != 'Z') { std::fprintf(stderr, "argument %zu: pointer expected\n", k); std::exit(3); }
            return reinterpret_cast<P>(a.ptr);
        } else if constexpr (std::is_floating_point_v<P>) {
            if (a.kind != 'F') { std::fprintf(stderr, "argument %zu: float expected\n", k); std::exit(3); }
            return (P)a.f;
        } else {
            if (a.kind != 'I') { std::fprintf(stderr, "argument %zu: integer expected\n", k); std::exit(3); }
            return (P)a.i;
        }
    }
};

template <typename... P, size_t... I>
void call_impl(void (*f)(P...), const Args& a, std::index_sequence<I...>) {
    f(a.template get<P>(I)...);
}

template <typename... P>
std::function<void(const Args&)> entry(void (*f)(P...)) {
    return [f](const Args& a) {
        if (a.v.size() != sizeof...(P)) {
            std::fprintf(stderr, "kernel takes %zu arguments, launch gave %zu\n", sizeof...(P), a.v.size());
            std::exit(3);
        }
        call_impl(f, a, std::index_sequence_for<P...>{});
    };
}

std::map<std::string, std::function<void(const Args&)>>& kernels() {
    static std::map<std::string, std::function<void(const Args&)>> m;
    return m;
}

#define REG(NAME, ...) kernels()[NAME] = entry(&__VA_ARGS__)

void register_kernels() {
#include "emu_kernels.inc"  // REG("<name>", <name>); for every registered variant
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) { std::fprintf(stderr, "usage: driver DIR\n"); return 2; }
    const std::string dir = argv[1];
    register_kernels();
    std::ifstream f(dir + "/launch.txt");
    std::string name;
    std::getline(f, name);
    unsigned gx, gy, gz;
    int threads, lazy;
    size_t smem;
    f >> gx >> gy >> gz >> threads >> smem >> lazy;
    Args args;
    std::map<int, std::pair<unsigned char*, size_t>> loaded;  // array index -> (buffer, bytes)
    std::string kind;
    while (f >> kind) {
        Arg a;
        if (kind == "A") {
            int idx;
            long long offset;
            f >> idx >> offset;
            if (!loaded.count(idx)) {
                std::ifstream in(dir + "/a" + std::to_string(idx) + ".bin", std::ios::binary | std::ios::ate);
                if (!in) { std::fprintf(stderr, "missing array %d\n", idx); return 3; }
                size_t n = in.tellg();
                in.seekg(0);
                unsigned char* base = (unsigned char*)std::aligned_alloc(256, (n + 256) / 256 * 256);
                in.read((char*)base, n);
                loaded[idx] = {base, n};
            }
            a.kind = 'A';
            a.ptr = loaded[idx].first + offset;
        } else if (kind == "P0") {
            a.kind = 'Z';
        } else if (kind == "I") {
            f >> a.i;
        } else if (kind == "F") {
            a.kind = 'F';
            f >> a.f;
        } else {
            std::fprintf(stderr, "bad argument kind %s\n", kind.c_str());
            return 3;
        }
        args.v.push_back(a);
    }
    auto it = kernels().find(name);
    if (it == kernels().end()) { std::fprintf(stderr, "kernel not in the driver: %s\n", name.c_str()); return 4; }
    emu::g_lazy_cp_async = lazy != 0;
    emu::g_lazy_wgmma = lazy != 0;
    if (const char* c = std::getenv("EMU_CONCURRENT_BLOCKS")) emu::g_concurrent_blocks = std::atoi(c);
    emu::launch(EmuDim{gx, gy, gz}, threads, smem, [&] { it->second(args); });
    for (auto& [idx, buf] : loaded) {
        std::ofstream out(dir + "/a" + std::to_string(idx) + ".out", std::ios::binary);
        out.write((const char*)buf.first, buf.second);
        std::free(buf.first);
    }
    return 0;
}
