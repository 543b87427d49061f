// Strided device-to-device copies of the cuda-ipc transport (kernels/src/region.rs,
// Copy2d): copy c of the table is `height` rows of `width` bytes, row r from
// src + r * src_pitch to dst + r * dst_pitch. The copy engines move narrow rows
// (an MLA row is 1,152 bytes) a row at a time and far below bandwidth, so these
// go through the SMs: one warp per row, in 16-byte words when every address,
// pitch and the width are multiples of 16, else 4-byte words, else bytes.
// Rows of one copy never overlap (the transport splits those), and copies of
// a batch run in queue order on one stream.
// One launch per copy, its shape as arguments (a table in device memory would
// need a host-to-device copy first, and one from pageable memory waits for the
// stream, which would serialise every batch with the ones before it).
// Launch: any grid, block 256.

struct __attribute__((aligned(16))) hk_w16 {
    unsigned int x, y, z, w;
};

extern "C" __global__ void strided_copy(
    hk_i64 src, hk_i64 dst, hk_i64 width, hk_i64 height, hk_i64 sp, hk_i64 dp)
{
    const int lane = threadIdx.x & 31;
    const hk_i64 warps = (hk_i64)gridDim.x * (blockDim.x >> 5);
    const hk_i64 align = src | dst | width | sp | dp;
    for (hk_i64 r = (hk_i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < height; r += warps) {
        const unsigned char* s = (const unsigned char*)(src + r * sp);
        unsigned char* d = (unsigned char*)(dst + r * dp);
        if ((align & 15) == 0) {
            const hk_w16* s16 = (const hk_w16*)s;
            hk_w16* d16 = (hk_w16*)d;
            for (hk_i64 i = lane; i < width / 16; i += 32)
                d16[i] = s16[i];
        } else if ((align & 3) == 0) {
            const unsigned int* s4 = (const unsigned int*)s;
            unsigned int* d4 = (unsigned int*)d;
            for (hk_i64 i = lane; i < width / 4; i += 32)
                d4[i] = s4[i];
        } else {
            for (hk_i64 i = lane; i < width; i += 32)
                d[i] = s[i];
        }
    }
}
