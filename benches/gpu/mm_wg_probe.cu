// st_mm_wg (kernels/hip/step_mm.hip, the warpgroup product) against the step's
// mma.sync kernels on the device machine: the same bits (every output element
// compared with st_mm_few's at M <= 16, st_mm's above), then the time of each
// variant with st_reduce, for choosing the chunk (KC) and the row block (NB):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -diag-suppress 1556,177,550 \
//        -I kernels/hip -include prelude.h benches/gpu/mm_wg_probe.cu -o mm_wg_probe
//   ./mm_wg_probe M K N TERMS
#include "step.hip"
#include "step_mm.hip"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "probe_util.h"

template <int NB, int WP, int KC, int D, int NW>
__global__ void __launch_bounds__(32 * NW, 1) probe_wg(const uint4* A, hk_i64 a_plane, hk_i64 a_group, const uint4* W, hk_i64 w_plane,
                                                             hk_i64 w_group, float* part, hk_i64 part_seg, hk_i64 part_group, int ldp, int M,
                                                             int nt16, int KT, int S, int terms) {
    st_mm_wg_body<NB, WP, KC, D, NW>(A, a_plane, a_group, W, w_plane, w_group, part, part_seg, part_group, ldp, M, nt16, KT, S, terms);
}
typedef void (*WgFn)(const uint4*, hk_i64, hk_i64, const uint4*, hk_i64, hk_i64, float*, hk_i64, hk_i64, int, int, int, int, int, int);
struct Variant { int nb, wp, kc, d, nw; WgFn f; };
#define V(nb, wp, kc, d) Variant{nb, wp, kc, d, 8, probe_wg<nb, wp, kc, d, 8>}
#define V16(nb, wp, kc, d) Variant{nb, wp, kc, d, 16, probe_wg<nb, wp, kc, d, 16>}
static const Variant variants[] = {
    V(32, 1, 8, 1), V(32, 1, 4, 3), V(32, 2, 4, 1), V(32, 2, 2, 3),
    V(64, 1, 8, 1), V(64, 1, 4, 3), V(64, 2, 4, 1), V(64, 2, 2, 3),
    V(96, 1, 8, 1), V(96, 1, 4, 3), V(96, 2, 4, 1), V(96, 2, 2, 3),
    V(128, 1, 8, 1), V(128, 1, 4, 3), V(128, 2, 4, 1), V(128, 2, 2, 3),
    // 16 warps a block: the activations a chunk carries serve 256 columns.
    V16(64, 1, 8, 1), V16(64, 2, 4, 1), V16(96, 1, 8, 1), V16(96, 1, 4, 2), V16(96, 2, 4, 1), V16(96, 2, 2, 2), V16(96, 2, 2, 3),
    V16(128, 2, 2, 2), V(96, 2, 4, 2), V(96, 2, 2, 2),
};

int main(int argc, char** argv) {
    if (argc < 5) { fprintf(stderr, "usage: mm_wg_probe M K N TERMS\n"); return 2; }
    const int M = atoi(argv[1]), K = atoi(argv[2]), N = atoi(argv[3]), terms = atoi(argv[4]);
    const int WP = terms == 3 ? 2 : 1;
    const int mp = (M + 15) / 16 * 16, KT = K / 16, nt = N / 16, S = auto_segments(K, N);
    const int planes_a = terms >= 2 ? 2 : 1;
    const size_t a_plane = (size_t)mp * K / 8, w_plane = (size_t)N * K / 8;
    uint4 *A, *W; float *part, *out, *ref; unsigned* cnt;
    CK(cudaMalloc(&A, a_plane * 2 * 16));
    CK(cudaMalloc(&W, w_plane * WP * 16));
    CK(cudaMalloc(&part, (size_t)S * mp * N * 4));
    CK(cudaMalloc(&out, (size_t)mp * N * 4));
    CK(cudaMalloc(&ref, (size_t)mp * N * 4));
    CK(cudaMalloc(&cnt, 65536 * 4));
    CK(cudaMemset(cnt, 0, 65536 * 4));
    fill_bits<<<1024, 256>>>((unsigned*)A, a_plane * 2 * 4, 1u + (unsigned)M);
    fill_bits<<<1024, 256>>>((unsigned*)W, w_plane * WP * 4, 2u + (unsigned)N);
    CK(cudaDeviceSynchronize());
    const hk_i64 ldp = N, part_group = (hk_i64)mp * ldp, part_seg = part_group;
    const hk_i64 ap_ = (hk_i64)a_plane, ag = (hk_i64)(2 * a_plane), wp_ = (hk_i64)w_plane, wg = (hk_i64)(WP * w_plane);
    const dim3 rgrid((unsigned)((N + 1023) / 1024), (unsigned)M);
    auto reduce = [&](float* o) {
        st_reduce<<<rgrid, 256>>>(part, part_seg, part_group, (int)ldp, M, N, S, 1, 0, o, N, 0, nullptr, 0, 1, 1, 1);
    };
    const int buf = (planes_a * (mp / 16 < 8 ? mp / 16 : 8) + 8 * WP) * 4 * 512;
    const int P = 4 * buf <= 226 * 1024 ? 3 : 2;
    const int smem = (P + 1) * buf;
    auto mm = WP == 1 ? st_mm : (P == 3 ? st_mm_w2 : st_mm_w2p2);
    CK(cudaFuncSetAttribute(mm, cudaFuncAttributeMaxDynamicSharedMemorySize, 226 * 1024));
    auto run_ref = [&](float* o) {
        if (M <= 16) {
            st_mm_few<<<dim3((nt + 3) / 4, S), 128>>>(A, ap_, ag, W, wp_, wg, part, part_seg, part_group, (int)ldp, cnt, M, nt, KT, S, terms, 0, N, o, N, 0,
                                                     nullptr, 0, 1, 1, 1);
        } else {
            mm<<<dim3((nt + 7) / 8, S, (M + 127) / 128), ST_MM_THREADS, smem>>>(A, ap_, ag, W, wp_, wg, part, part_seg, part_group, (int)ldp, cnt, M, nt, KT,
                                                                               S, terms, 0, N, o, N, 0, nullptr, 0, 1, 1, 1);
            reduce(o);
        }
    };
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    const int reps = 50;
    auto time = [&](auto&& f) {
        f(); CK(cudaDeviceSynchronize());
        float best = 1e30f;
        for (int r = 0; r < 3; ++r) {
            CK(cudaEventRecord(e0));
            for (int i = 0; i < reps; ++i) f();
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
            best = ms < best ? ms : best;
        }
        CK(cudaGetLastError());
        return best * 1e3 / reps;
    };
    const double wbytes = (double)N * K * 2 * WP;
    std::vector<float> h_ref((size_t)M * N), h_out((size_t)M * N);
    CK(cudaMemset(ref, 0xff, (size_t)mp * N * 4));
    const double t_ref = time([&] { run_ref(ref); });
    CK(cudaMemcpy(h_ref.data(), ref, (size_t)M * N * 4, cudaMemcpyDeviceToHost));
    printf("M=%d K=%d N=%d terms=%d S=%d: %s %.1f us (%.0f GB/s of weights)\n", M, K, N, terms, S, M <= 16 ? "st_mm_few" : "st_mm+st_reduce", t_ref,
           wbytes / (t_ref * 1e3));
    for (const Variant& v : variants) {
        if (v.wp != WP) continue;
        if (v.nb >= 2 * M + 32 && v.nb > 32) continue;  // far more rows than the product has
        const int smem_wg = (v.d + 1) * v.kc * (v.nw * v.wp * 512 + planes_a * v.nb * 32);
        if (smem_wg > 226 * 1024) continue;
        CK(cudaFuncSetAttribute(v.f, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_wg));
        const dim3 grid((unsigned)((nt + v.nw - 1) / v.nw), (unsigned)S, (unsigned)((M + v.nb - 1) / v.nb));
        CK(cudaMemset(out, 0xff, (size_t)mp * N * 4));
        auto run = [&] {
            v.f<<<grid, 32 * v.nw, smem_wg>>>(A, ap_, ag, W, wp_, wg, part, part_seg, part_group, (int)ldp, M, nt, KT, S, terms);
            reduce(out);
        };
        const double t = time(run);
        CK(cudaMemcpy(h_out.data(), out, (size_t)M * N * 4, cudaMemcpyDeviceToHost));
        size_t diff = 0, first = 0;
        for (size_t i = 0; i < h_out.size(); ++i)
            if (memcmp(&h_out[i], &h_ref[i], 4) != 0) { if (!diff) first = i; ++diff; }
        cudaFuncAttributes at; CK(cudaFuncGetAttributes(&at, v.f));
        printf("  st_mm_wg NB=%d KC=%d D=%d NW=%d grid %ux%ux%u regs %d smem %d: %.1f us (%.0f GB/s) %.2fx the reference, %s\n", v.nb, v.kc, v.d, v.nw, grid.x, grid.y, grid.z,
               at.numRegs, smem_wg, t, wbytes / (t * 1e3), t_ref / t, diff ? "BITS DIFFER" : "same bits");
        if (diff) printf("    %zu of %zu elements differ; first at row %zu col %zu: %.9g vs %.9g\n", diff, h_out.size(), first / N, first % N, h_out[first], h_ref[first]);
    }
    return 0;
}
