// Device-to-device copies of the cuda-ipc transport (kernels/src/region.rs,
// Copy2d), many in one launch: copy c of the table is `height` rows of `width`
// bytes, row r from src + r * sp to dst + r * dp. The table is the kernel's
// by-value argument (no host-to-device upload before the launch, which from
// pageable memory would wait for the stream), so a hand-off plan of a few
// descriptors is one launch instead of one driver call per descriptor, and a
// narrow row (an MLA row is 1,152 bytes) moves at SM speed where the copy
// engines move it a row at a time.
//
// Work items: each row is cut into pieces of at most CT_PIECE bytes, and one
// warp copies one piece, in 16-byte words when both addresses and the length
// are multiples of 16, else 4-byte words, else bytes. start[c] is the first
// item of copy c (prefix sums over height x pieces, filled on the host), and
// start[n] the item count. The host puts two copies in one table only when
// neither writes what the other reads or writes (table_launches), so the
// items of a table may run in any order; tables on one stream run in order.
// Launch: any grid, block 256.

#define CT_COPIES 48
#define CT_PIECE 16384

struct hk_copy_table {
    hk_i64 c[CT_COPIES][6];  // src, dst, width, height, src pitch, dst pitch
    hk_i64 start[CT_COPIES + 1];
    int n;
    int pad;
};

struct __attribute__((aligned(16))) hk_w16 {
    unsigned int x, y, z, w;
};

extern "C" __global__ void copy_table(hk_copy_table t)
{
    const int lane = threadIdx.x & 31;
    const hk_i64 warps = (hk_i64)gridDim.x * (blockDim.x >> 5);
    const hk_i64 items = t.start[t.n];
    int c = 0;
    // A warp's items only grow, so its copy index only moves forward.
    for (hk_i64 it = (hk_i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); it < items; it += warps) {
        while (it >= t.start[c + 1]) ++c;
        const hk_i64 width = t.c[c][2];
        const hk_i64 pieces = (width + CT_PIECE - 1) / CT_PIECE;
        const hk_i64 local = it - t.start[c];
        const hk_i64 row = local / pieces;
        const hk_i64 off = (local % pieces) * CT_PIECE;
        const hk_i64 len = width - off < CT_PIECE ? width - off : CT_PIECE;
        const hk_i64 src = t.c[c][0] + row * t.c[c][4] + off;
        const hk_i64 dst = t.c[c][1] + row * t.c[c][5] + off;
        const hk_i64 align = src | dst | len;
        if ((align & 15) == 0) {
            const hk_w16* s16 = (const hk_w16*)src;
            hk_w16* d16 = (hk_w16*)dst;
            const hk_i64 n = len / 16;
            hk_i64 i = lane;
            // Four loads in flight before their stores.
            for (; i + 96 < n; i += 128) {
                const hk_w16 a = s16[i], b = s16[i + 32], e = s16[i + 64], f = s16[i + 96];
                d16[i] = a;
                d16[i + 32] = b;
                d16[i + 64] = e;
                d16[i + 96] = f;
            }
            for (; i < n; i += 32) d16[i] = s16[i];
        } else if ((align & 3) == 0) {
            const unsigned int* s4 = (const unsigned int*)src;
            unsigned int* d4 = (unsigned int*)dst;
            for (hk_i64 i = lane; i < len / 4; i += 32) d4[i] = s4[i];
        } else {
            const unsigned char* s = (const unsigned char*)src;
            unsigned char* d = (unsigned char*)dst;
            for (hk_i64 i = lane; i < len; i += 32) d[i] = s[i];
        }
    }
}
