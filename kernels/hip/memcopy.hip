// Device-to-device copies of the cuda-ipc transport (kernels/src/region.rs,
// Copy2d), many in one launch: copy c of the table is `height` rows of `width`
// bytes, row r from src + r * sp to dst + r * dp. The table is the kernel's
// by-value argument (no host-to-device upload before the launch, which from
// pageable memory would wait for the stream), so a hand-off plan of a few
// descriptors is one launch instead of one driver call per descriptor, and a
// narrow row (an MLA row is 1,152 bytes) moves at SM speed where the copy
// engines move it a row at a time.
//
// Work items: each copy moves words of 16, 4 or 1 bytes (the largest that
// divides both addresses, both pitches and the width, chosen on the host),
// and each thread copies one word per turn of a grid-stride loop over every
// word of the table, so a narrow row is spread over many threads and every
// thread has its own load in flight (a warp per row would leave a 1,152-byte
// row to 2 or 3 dependent turns of one warp). start[c] is the first word of
// copy c (prefix sums of height x words per row, filled on the host), and
// start[n] the word count; a copy's words number less than 2^31, so a row and
// a column come from one 32-bit division. The host puts two copies in one
// table only when neither writes what the other reads or writes
// (table_launches), so the words of a table may move in any order; tables on
// one stream run in order.
// Launch: any grid, block 256.

#define CT_COPIES 48

struct hk_copy_table {
    hk_i64 c[CT_COPIES][7];  // src, dst, words per row, height, src pitch, dst pitch, word bytes
    hk_i64 start[CT_COPIES + 1];
    int n;
    int pad;
};

struct __attribute__((aligned(16))) hk_w16 {
    unsigned int x, y, z, w;
};

extern "C" __global__ void copy_table(hk_copy_table t)
{
    const hk_i64 threads = (hk_i64)gridDim.x * blockDim.x;
    const hk_i64 words = t.start[t.n];
    int c = 0;
    // A thread's words only grow, so its copy index only moves forward.
    for (hk_i64 g = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; g < words; g += threads) {
        while (g >= t.start[c + 1]) ++c;
        const unsigned int per_row = (unsigned int)t.c[c][2];
        const unsigned int local = (unsigned int)(g - t.start[c]);
        const unsigned int row = local / per_row;
        const unsigned int col = local - row * per_row;
        const hk_i64 wb = t.c[c][6];
        const hk_i64 src = t.c[c][0] + (hk_i64)row * t.c[c][4] + (hk_i64)col * wb;
        const hk_i64 dst = t.c[c][1] + (hk_i64)row * t.c[c][5] + (hk_i64)col * wb;
        if (wb == 16) {
            *(hk_w16*)dst = *(const hk_w16*)src;
        } else if (wb == 4) {
            *(unsigned int*)dst = *(const unsigned int*)src;
        } else {
            *(unsigned char*)dst = *(const unsigned char*)src;
        }
    }
}
