// A probe of the fused step's tensor-core product (kernels/hip/step_mm.hip) outside
// the engine, for nvcc and Nsight Compute on the device machine:
//   nvcc -O3 -arch=sm_90 -std=c++17 -I kernels/hip -include prelude.h \
//        benches/gpu/mm_probe.cu -o mm_probe
//   ./mm_probe M K N TERMS [WEIGHT_PLANES]     (prints us per product)
//   ncu --clock-control none -k regex:st_mm ./mm_probe 88 7168 7168 1
// Operands hold random bf16 bits of small magnitude: the time of a product does
// not depend on its values. The segment count follows kernels/src/step.rs's
// auto_segments; shared memory follows step_cuda.rs's mm_shape.
// The whole program NVRTC builds (prelude.h, then every source in name order).
#include "conv.hip"
#include "copy.hip"
#include "dense.hip"
#include "kda.hip"
#include "kda_chunk.hip"
#include "memcopy.hip"
#include "mla.hip"
#include "norm.hip"
#include "step.hip"
#include "step_mm.hip"
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_util.h"

int main(int argc, char** argv) {
    if (argc < 5) { fprintf(stderr, "usage: mm_probe M K N TERMS [WP]\n"); return 2; }
    const int M = atoi(argv[1]), K = atoi(argv[2]), N = atoi(argv[3]), terms = atoi(argv[4]);
    const int WP = argc > 5 ? atoi(argv[5]) : (terms == 3 ? 2 : 1);
    const int mp = (M + 15) / 16 * 16, KT = K / 16, nt = N / 16, S = auto_segments(K, N);
    const int planes_a = terms >= 2 ? 2 : 1;
    const size_t a_plane = (size_t)mp * K / 8, w_plane = (size_t)N * K / 8;  // uint4 units
    uint4 *A, *W; float *part, *out; unsigned* cnt;
    CK(cudaMalloc(&A, a_plane * planes_a * 16));
    CK(cudaMalloc(&W, w_plane * WP * 16));
    CK(cudaMalloc(&part, (size_t)S * mp * N * 4));
    CK(cudaMalloc(&out, (size_t)mp * N * 4));
    CK(cudaMalloc(&cnt, 65536 * 4));
    CK(cudaMemset(cnt, 0, 65536 * 4));
    fill_bits<<<1024, 256>>>((unsigned*)A, a_plane * planes_a * 4, 1u);
    fill_bits<<<1024, 256>>>((unsigned*)W, w_plane * WP * 4, 2u);
    CK(cudaDeviceSynchronize());
    const hk_i64 ldp = N, part_group = (hk_i64)mp * ldp, part_seg = part_group;
    int mode = 0, ncols = N, ldo = N, gcol = 0, akt = 1, uw = 1, uwp = 1;
    unsigned short* ap = nullptr; hk_i64 ap_plane = 0;
    hk_i64 ap_ = (hk_i64)a_plane, ag = (hk_i64)(planes_a * a_plane), wp_ = (hk_i64)w_plane, wg = (hk_i64)(WP * w_plane);
    const int buf = (planes_a * (mp / 16 < 8 ? mp / 16 : 8) + 8 * WP) * 4 * 512;
    const int P = 4 * buf <= 226 * 1024 ? 3 : 2;
    const int smem = (P + 1) * buf;
    auto mm = WP == 1 ? st_mm : (P == 3 ? st_mm_w2 : st_mm_w2p2);
    CK(cudaFuncSetAttribute(mm, cudaFuncAttributeMaxDynamicSharedMemorySize, 226 * 1024));
    dim3 grid((nt + 7) / 8, S, (M + 127) / 128);
    const dim3 rgrid((unsigned)((ncols + 1023) / 1024), (unsigned)(M < 65535 ? M : 65535));  // st_reduce: a block row a row, four columns a thread
    auto run = [&](bool reduce) {
        mm<<<grid, ST_MM_THREADS, smem>>>(A, ap_, ag, W, wp_, wg, part, part_seg, part_group, (int)ldp, cnt, M, nt, KT, S, terms,
                                mode, ncols, out, ldo, gcol, ap, ap_plane, akt, uw, uwp);
        if (reduce) st_reduce<<<rgrid, 256>>>(part, part_seg, part_group, (int)ldp, M, ncols, S, 1, mode, out, ldo, gcol, ap, ap_plane, akt, uw, uwp);
    };
    run(true);
    CK(cudaDeviceSynchronize());
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    const int reps = 50;
    float ms[2];
    for (int r = 0; r < 2; ++r) {
        CK(cudaEventRecord(e0));
        for (int i = 0; i < reps; ++i) run(r == 1);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventElapsedTime(&ms[r], e0, e1));
    }
    CK(cudaGetLastError());
    const double us_mm = ms[0] * 1e3 / reps, us_all = ms[1] * 1e3 / reps;
    const double wbytes = (double)N * K * 2 * WP;
    printf("mm_probe M=%d K=%d N=%d terms=%d WP=%d S=%d grid=%dx%dx%d smem=%d P=%d: st_mm %.1f us, +st_reduce %.1f us; weights %.0f GB/s; %.1f TFLOP/s\n",
           M, K, N, terms, WP, S, grid.x, grid.y, grid.z, smem, P, us_mm, us_all, wbytes / (us_all * 1e3), 2.0 * M * K * N * terms / (us_all * 1e6));
    return 0;
}
