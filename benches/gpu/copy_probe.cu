// The cuda-ipc hand-off's copy kernel (kernels/hip/memcopy.hip, copy_table)
// against variants of it and against the device copy, on the device machine:
// the flagship pass's own copy list (benches/gpu/flagship-copies.txt: the 448
// copies of one request of 32K tokens, as the transport makes them from the
// planner's descriptors), one whole pass and each row
// width alone, every variant's destination bytes checked against the copy
// engines' (one cudaMemcpy2D a copy).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels/hip -include prelude.h \
//        benches/gpu/copy_probe.cu -o copy_probe
//   ./copy_probe COPIES_FILE
// A line of COPIES_FILE: src region, src offset, src pitch, dst region, dst
// offset, dst pitch, width, height (regions are numbered; each is allocated
// on its own, as the transport's are).
#include "memcopy.hip"
#include <cstdio>
#include <cstdlib>
#include <map>
#include <vector>
#include <thread>
#include <atomic>
#include <algorithm>
#include <functional>
#include <string>
#include <cstring>
#include <chrono>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

struct Line { int sr; long long so, sp; int dr; long long dof, dp, w, h; };

// The ceiling of a kernel copy: one contiguous range, 16 bytes a word.
template <int U>
__global__ void __launch_bounds__(256) copy_flat(const hk_w16* __restrict__ s, hk_w16* __restrict__ d, hk_i64 n) {
    const hk_i64 threads = (hk_i64)gridDim.x * 256;
    for (hk_i64 g0 = (hk_i64)blockIdx.x * 256 * U + threadIdx.x; g0 < n; g0 += threads * U) {
        hk_w16 v[U];
#pragma unroll
        for (int k = 0; k < U; ++k) if (g0 + k * 256 < n) v[k] = s[g0 + k * 256];
#pragma unroll
        for (int k = 0; k < U; ++k) if (g0 + k * 256 < n) d[g0 + k * 256] = v[k];
    }
}

__global__ void nothing() {}
// Kernels whose argument is as large as a table of 64 copies (4 KB) and of
// 256 (16 KB), for what the argument's size costs a launch (one word read).
struct Arg4k { hk_i64 w[512]; };
struct Arg16k { hk_i64 w[2048]; };
__global__ void arg4k(Arg4k a, hk_i64* out) { if (a.w[511] == 12345) *out = 1; }
__global__ void arg16k(Arg16k a, hk_i64* out) { if (a.w[2047] == 12345) *out = 1; }

__global__ void fill(unsigned* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned x = (unsigned)i * 2654435761u ^ seed;
        x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
        p[i] = x;
    }
}
__global__ void digest(const unsigned* p, size_t n, unsigned long long* out) {
    unsigned long long acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        acc += (unsigned long long)p[i] * (2 * i + 1);
    atomicAdd(out, acc);
}

int main(int argc, char** argv) {
    if (argc < 2) { fprintf(stderr, "usage: copy_probe COPIES_FILE\n"); return 2; }
    FILE* f = fopen(argv[1], "r");
    if (!f) { perror(argv[1]); return 2; }
    std::vector<Line> lines;
    Line l;
    while (fscanf(f, "%d %lld %lld %d %lld %lld %lld %lld", &l.sr, &l.so, &l.sp, &l.dr, &l.dof, &l.dp, &l.w, &l.h) == 8) lines.push_back(l);
    fclose(f);
    std::map<int, long long> extent;
    long long bytes = 0;
    for (auto& x : lines) {
        extent[x.sr] = std::max(extent[x.sr], x.so + (x.h - 1) * x.sp + x.w);
        extent[x.dr] = std::max(extent[x.dr], x.dof + (x.h - 1) * x.dp + x.w);
        bytes += x.w * x.h;
    }
    std::map<int, char*> base;
    for (auto& [r, n] : extent) {
        char* p;
        CK(cudaMalloc(&p, (n + 15) / 16 * 16));
        CK(cudaMemset(p, 0, n));
        base[r] = p;
    }
    for (auto& [r, n] : extent) fill<<<1024, 256>>>((unsigned*)base[r], (size_t)n / 4, 7u + (unsigned)r);
    CK(cudaDeviceSynchronize());
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    auto is_dst = [&](int r) { for (auto& x : lines) if (x.dr == r) return true; return false; };
    // The destinations' digest after the copies (zeroed first).
    unsigned long long* dg;
    CK(cudaMalloc(&dg, 8));
    auto clear_dst = [&]() { for (auto& [r, n] : extent) if (is_dst(r)) CK(cudaMemset(base[r], 0, n)); };
    auto dst_digest = [&]() {
        unsigned long long total = 0;
        for (auto& [r, n] : extent) if (is_dst(r)) {
            CK(cudaMemset(dg, 0, 8));
            digest<<<1024, 256>>>((const unsigned*)base[r], (size_t)n / 4, dg);
            unsigned long long h; CK(cudaMemcpy(&h, dg, 8, cudaMemcpyDeviceToHost));
            total = total * 1000003ull + h;
        }
        return total;
    };
    // The reference: one copy-engine call a copy.
    clear_dst();
    for (auto& x : lines) CK(cudaMemcpy2D(base[x.dr] + x.dof, x.dp, base[x.sr] + x.so, x.sp, x.w, x.h, cudaMemcpyDeviceToDevice));
    CK(cudaDeviceSynchronize());
    const unsigned long long want = dst_digest();

    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    auto time = [&](std::function<void()> fn) {
        fn(); CK(cudaDeviceSynchronize());
        std::vector<float> ts;
        for (int r = 0; r < 9; ++r) {
            // The gate (memcopy.hip) holds the stream until fn's launches are queued.
            copy_gate<<<1, 1>>>(200000);
            CK(cudaEventRecord(e0)); fn(); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
            float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); ts.push_back(ms);
        }
        std::sort(ts.begin(), ts.end());
        return ts[ts.size() / 2] * 1e3;  // us
    };
    // The device copy of the pass's byte count, contiguous, on the copy engines and as a kernel.
    char *fs, *fd;
    CK(cudaMalloc(&fs, bytes)); CK(cudaMalloc(&fd, bytes));
    CK(cudaMemset(fs, 1, bytes));
    const double t_mc = time([&] { CK(cudaMemcpyAsync(fd, fs, bytes, cudaMemcpyDeviceToDevice)); });
    printf("device: %d SMs; pass %lld bytes in %zu copies\n", sms, bytes, lines.size());
    printf("cudaMemcpy contiguous: %.1f us (%.1f GB/s)\n", t_mc, bytes / t_mc / 1e3);
    for (int bps : {2, 3, 4, 8}) {
        const double t = time([&] { copy_flat<8><<<sms * bps, 256>>>((const hk_w16*)fs, (hk_w16*)fd, bytes / 16); });
        printf("copy_flat U8 %d blocks/SM: %.1f us (%.1f GB/s, %.3f of cudaMemcpy)\n", bps, t, bytes / t / 1e3, t_mc / t);
    }
    CK(cudaFree(fs)); CK(cudaFree(fd));

    // The table of a list, as memory.rs builds it.
    auto table_of = [&](const std::vector<Line>& ls, hk_copy_table& t) {
        memset(&t, 0, sizeof t);
        hk_i64 words = 0;
        for (size_t i = 0; i < ls.size(); ++i) {
            auto& x = ls[i];
            long long s = (long long)(size_t)(base[x.sr] + x.so), d = (long long)(size_t)(base[x.dr] + x.dof);
            long long al = s | d | x.w | (x.h > 1 ? (x.sp | x.dp) : 0);
            long long wb = al % 16 == 0 ? 16 : al % 4 == 0 ? 4 : 1;
            long long v[7] = {s, d, x.w / wb, x.h, x.h > 1 ? x.sp : x.w, x.h > 1 ? x.dp : x.w, wb};
            for (int k = 0; k < 7; ++k) t.c[i][k] = v[k];
            t.start[i] = words;
            words += x.w / wb * x.h;
        }
        t.start[ls.size()] = words;
        t.n = (int)ls.size();
        return words;
    };
    struct Var { const char* name; std::function<void(const hk_copy_table&, hk_i64)> run; };
    // copy_table's grid: one block a chunk of 2,048 words (what memory.rs
    // launches), or a grid-stride loop over the chunks with fewer blocks.
    auto grid = [&](hk_i64 words, int per_sm) {
        const hk_i64 chunks = std::max<hk_i64>(1, (words + 2047) / 2048);
        return (unsigned)(per_sm ? std::min<hk_i64>(chunks, (hk_i64)sms * per_sm) : chunks);
    };
    std::vector<Var> vars = {
        {"copy_table, a block a chunk", [&](const hk_copy_table& t, hk_i64 w) { copy_table<<<grid(w, 0), 256>>>(t); }},
        {"copy_table, 1 block/SM", [&](const hk_copy_table& t, hk_i64 w) { copy_table<<<grid(w, 1), 256>>>(t); }},
        {"copy_table, 3 blocks/SM", [&](const hk_copy_table& t, hk_i64 w) { copy_table<<<grid(w, 3), 256>>>(t); }},
        {"copy_table, 8 blocks/SM", [&](const hk_copy_table& t, hk_i64 w) { copy_table<<<grid(w, 8), 256>>>(t); }},
    };
    {
        // A launch's fixed cost: one 16-byte copy through the table (its
        // 32 KB argument), against a kernel with no argument.
        std::vector<Line> one = {lines[0]};
        one[0].w = 16; one[0].h = 1;
        hk_copy_table* t = new hk_copy_table;
        table_of(one, *t);
        Arg4k* a4 = new Arg4k();
        Arg16k* a16 = new Arg16k();
        hk_copy_table_small* ts = new hk_copy_table_small;
        memset(ts, 0, sizeof *ts);
        for (int k = 0; k < 7; ++k) ts->c[0][k] = t->c[0][k];
        ts->start[1] = t->start[1];
        ts->n = 1;
        const double t_one = time([&] { copy_table<<<1, 256>>>(*t); });
        const double t_small = time([&] { copy_table_small<<<1, 256>>>(*ts); });
        printf("copy_table_small (4 KB argument) with the same copy: %.1f us on the device's clock\n", t_small);
        const double t_empty = time([&] { nothing<<<1, 256>>>(); });
        const double t_4k = time([&] { arg4k<<<1, 256>>>(*a4, (hk_i64*)dg); });
        const double t_16k = time([&] { arg16k<<<1, 256>>>(*a16, (hk_i64*)dg); });
        printf("a launch alone, on the device's clock (behind a gate): copy_table (32 KB argument) with one 16-byte copy %.1f us; a kernel with no argument %.1f us, "
               "with 4 KB %.1f us, with 16 KB %.1f us\n", t_one, t_empty, t_4k, t_16k);
        // The host's time to queue a launch (no wait), 200 in a row on the
        // legacy stream (synchronized alone: the gate below runs beside it).
        auto host_us = [&](std::function<void()> fn) {
            CK(cudaStreamSynchronize(0));
            auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < 200; ++i) fn();
            auto t1 = std::chrono::steady_clock::now();
            CK(cudaStreamSynchronize(0));
            return std::chrono::duration<double, std::micro>(t1 - t0).count() / 200;
        };
        cudaEvent_t ev;
        CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        printf("a launch on the host's clock: copy_table (32 KB) %.2f us; no argument %.2f us; 4 KB %.2f us; 16 KB %.2f us; an event record %.2f us; "
               "an event query %.2f us\n",
               host_us([&] { copy_table<<<1, 256>>>(*t); }), host_us([&] { nothing<<<1, 256>>>(); }), host_us([&] { arg4k<<<1, 256>>>(*a4, (hk_i64*)dg); }),
               host_us([&] { arg16k<<<1, 256>>>(*a16, (hk_i64*)dg); }), host_us([&] { CK(cudaEventRecord(ev)); }), host_us([&] { (void)cudaEventQuery(ev); }));
        // The same launches while another thread queries an event in a loop
        // (yielding between queries), as a completion thread waiting on an
        // earlier copy list does: what the driver's locks cost the launches.
        {
            std::atomic<bool> stop{false};
            cudaStream_t side;
            CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
            cudaEvent_t pending;
            CK(cudaEventCreateWithFlags(&pending, cudaEventDisableTiming));
            // Pending for the whole measurement: behind a gate of about 100 ms
            // on a stream of its own (non-blocking: the launches below, on
            // the legacy stream, do not wait for it).
            copy_gate<<<1, 1, 0, side>>>(200000000LL);
            CK(cudaEventRecord(pending, side));
            std::thread spinner([&] {
                while (!stop.load()) {
                    (void)cudaEventQuery(pending);
                    std::this_thread::yield();
                }
            });
            const double c32 = host_us([&] { copy_table<<<1, 256>>>(*t); });
            const double c4 = host_us([&] { copy_table_small<<<1, 256>>>(*ts); });
            const double rec = host_us([&] { CK(cudaEventRecord(ev)); });
            printf("a launch on the host's clock beside a thread querying a pending event: copy_table (32 KB) %.2f us; copy_table_small (4 KB) %.2f us; an event record %.2f us (event still pending after: %s)\n",
                   c32, c4, rec, cudaEventQuery(pending) == cudaErrorNotReady ? "yes" : "no");
            stop = true;
            spinner.join();
            CK(cudaStreamSynchronize(side));
            CK(cudaStreamDestroy(side));
        }
        printf("a launch on the host's clock alone, again: copy_table (32 KB) %.2f us; copy_table_small (4 KB) %.2f us\n",
               host_us([&] { copy_table<<<1, 256>>>(*t); }), host_us([&] { copy_table_small<<<1, 256>>>(*ts); }));
        delete t;
        delete ts;
        delete a4;
        delete a16;
    }
    // The whole pass, then each row width alone.
    std::vector<std::pair<std::string, std::vector<Line>>> sets = {{"pass", lines}};
    std::map<long long, std::vector<Line>> by_w;
    for (auto& x : lines) by_w[x.w].push_back(x);
    for (auto& [w, ls] : by_w) sets.push_back({"width " + std::to_string(w), ls});
    for (auto& [name, ls] : sets) {
        hk_copy_table* t = new hk_copy_table;
        const hk_i64 words = table_of(ls, *t);
        long long b = 0;
        for (auto& x : ls) b += x.w * x.h;
        const double t_e = time([&] { for (auto& x : ls) CK(cudaMemcpy2DAsync(base[x.dr] + x.dof, x.dp, base[x.sr] + x.so, x.sp, x.w, x.h, cudaMemcpyDeviceToDevice)); });
        printf("%s: %zu copies, %lld bytes; copy engines (a 2D copy each) %.1f us (%.3f of cudaMemcpy's rate)\n", name.c_str(), ls.size(), b, t_e,
               (b / t_e) / (bytes / t_mc));
        for (auto& v : vars) {
            const double tt = time([&] { v.run(*t, words); });
            bool ok = true;
            if (name == "pass") {
                clear_dst();
                v.run(*t, words);
                CK(cudaDeviceSynchronize());
                ok = dst_digest() == want;
            }
            printf("  %-28s %8.1f us  %7.1f GB/s  %.3f of cudaMemcpy's rate%s\n", v.name, tt, b / tt / 1e3, (b / tt) / (bytes / t_mc),
                   name == "pass" ? (ok ? "  bytes ok" : "  BYTES DIFFER") : "");
        }
        delete t;
    }
    return 0;
}
