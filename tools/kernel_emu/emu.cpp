#include "hip/hip_runtime.h"
#include <cstdio>
#include <cstdlib>
#include <cstdint>
thread_local dim3 threadIdx;
dim3 blockIdx, blockDim, gridDim;
double hk_dyn_smem[1 << 16];
struct BlockSync {
    std::barrier<> all;
    std::vector<std::barrier<>*> warp;
    std::vector<double> slot;
    BlockSync(int n) : all(n), slot(n) { for (int w = 0; w < n / 32; ++w) warp.push_back(new std::barrier<>(32)); }
};
thread_local BlockSync* hk_sync;
void __syncthreads() { hk_sync->all.arrive_and_wait(); }
static double exch(double v, int lane_src) {
    int t = threadIdx.x, w = t / 32;
    hk_sync->slot[t] = v;
    hk_sync->warp[w]->arrive_and_wait();
    double r = hk_sync->slot[w * 32 + lane_src];
    hk_sync->warp[w]->arrive_and_wait();
    return r;
}
float __shfl_xor(float v, int m, int) { return (float)exch(v, (threadIdx.x & 31) ^ m); }
double __shfl_xor(double v, int m, int) { return exch(v, (threadIdx.x & 31) ^ m); }
int __shfl_xor(int v, int m, int) { return (int)exch((double)v, (threadIdx.x & 31) ^ m); }
double __shfl(double v, int s, int) { return exch(v, s & 31); }
float __shfl(float v, int s, int) { return (float)exch(v, s & 31); }
unsigned __shfl(unsigned v, int s, int) { return (unsigned)exch((double)v, s & 31); }
int __any(int p) { int r = 0; for (int l = 0; l < 32; ++l) r |= (int)exch((double)p, l); return r; }
// Runs kernel f over grid g with n threads a block.
void launch(dim3 g, int n, std::function<void()> f) {
    gridDim = g; blockDim.x = n;
    for (unsigned z = 0; z < g.z; ++z) for (unsigned y = 0; y < g.y; ++y) for (unsigned x = 0; x < g.x; ++x) {
        blockIdx = {x, y, z};
        BlockSync s(n);
        memset(hk_dyn_smem, 0xff, sizeof hk_dyn_smem);  // garbage, as a GPU's shared memory
        std::vector<std::thread> ts;
        for (int t = 0; t < n; ++t) ts.emplace_back([&, t] { threadIdx.x = t; hk_sync = &s; f(); });
        for (auto& t : ts) t.join();
        for (auto* w : s.warp) delete w;
    }
}
#include KSRC  // prelude.h + one kda_chunk.hip + driver.cpp, concatenated by run.sh
