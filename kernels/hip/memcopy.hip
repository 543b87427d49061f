// Strided device-to-device copies of the cuda-ipc transport (kernels/src/region.rs,
// Copy2d): copy c of the table is `height` rows of `width` bytes, row r from
// src + r * src_pitch to dst + r * dst_pitch. The copy engines move narrow rows
// (an MLA row is 1,152 bytes) a row at a time and far below bandwidth, so these
// go through the SMs: one warp per row, in 16-byte words when every address,
// pitch and the width are multiples of 16, else 4-byte words, else bytes.
// Rows of one copy never overlap (the transport splits those), and copies of
// one launch write disjoint bytes or are launched in order.
// Table: 6 x i64 per copy (src, dst, width, height, src_pitch, dst_pitch).
// Launch: grid (any, copies), block 256.

struct __attribute__((aligned(16))) hk_w16 {
    unsigned int x, y, z, w;
};

extern "C" __global__ void strided_copy(const hk_i64* __restrict__ table, hk_i64 copies)
{
    const int lane = threadIdx.x & 31;
    const hk_i64 warps = (hk_i64)gridDim.x * (blockDim.x >> 5);
    for (hk_i64 c = blockIdx.y; c < copies; c += gridDim.y) {
        const hk_i64* t = table + 6 * c;
        const hk_i64 src = t[0], dst = t[1], width = t[2], height = t[3], sp = t[4], dp = t[5];
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
}
