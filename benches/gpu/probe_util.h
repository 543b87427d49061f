// What the product probes (mm_probe.cu, mm_wg_probe.cu) share: a checked
// CUDA call, kernels/src/step.rs's auto_segments, and random operand bits.
#pragma once
#include <cstdio>
#include <cstdlib>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

static int auto_segments(int inner, int cols) {
    int kt = inner / 16, tiles = (cols + 15) / 16, s = 1;
    while (kt % (s * 2) == 0 && kt / (s * 2) >= 8 && tiles * s < 2048) s *= 2;
    return s;
}

// Pairs of bf16 of magnitude below 1 (sign, exponent 0x70..0x7e, mantissa):
// a product's time does not depend on its values, and zeros would hide
// unwritten outputs.
__global__ void fill_bits(unsigned* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned x = (unsigned)i * 2654435761u ^ seed;
        x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
        unsigned lo = (x & 0x807fu) | ((0x70u + (x >> 8) % 15u) << 7);
        unsigned hi = ((x >> 16) & 0x807fu) | ((0x70u + (x >> 24) % 15u) << 7);
        p[i] = lo | (hi << 16);
    }
}
