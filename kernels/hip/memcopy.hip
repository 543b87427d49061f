// Device-to-device copies of the cuda-ipc transport (kernels/src/region.rs,
// Copy2d), many in one launch: copy c of the table is `height` rows of `width`
// bytes, row r from src + r * sp to dst + r * dp. The table is the kernel's
// by-value argument (no host-to-device upload before the launch, which from
// pageable memory would wait for the stream), so a hand-off plan of many
// descriptors is one launch instead of one driver call per descriptor, and a
// narrow row (an MLA row is 1,152 bytes) moves at SM speed where the copy
// engines move it a row at a time.
//
// Table size: CUDA 12.1 and later take up to 32,764 bytes of kernel
// parameters on Volta and newer (this program is compiled by NVRTC 13 for
// sm_90), so a CUDA table holds 500 copies (32,016 bytes) and a whole
// hand-off pass of the flagship (448 copies) is one launch. HIP keeps the
// 4 KB that every driver accepts (48 copies, 3,088 bytes): larger kernel
// arguments have never been tried on AMD hardware. The host side keeps both
// counts (kernels/src/region.rs, TABLE_COPIES and WIDE_TABLE_COPIES).
//
// Work items: each copy moves words of 16, 4 or 1 bytes (the largest that
// divides both addresses, both pitches and the width, chosen on the host).
// Word g of the table is copied by thread g % threads (threads = the grid's
// thread count), so consecutive lanes of a warp move consecutive words
// (coalesced) and a narrow row is spread over many threads. Each thread takes
// CT_UNROLL of its words a turn (g0, g0 + threads, ..., g0 + 7 * threads),
// loads them all, then stores them all: eight independent loads in flight per
// thread instead of one, which is what keeps a narrow-row copy (or a launch
// too small to fill the device with threads) at the memory's rate. start[c]
// is the first word of copy c (prefix sums of height x words per row, filled
// on the host), and start[n] the word count; a copy's words number less than
// 2^31, so a row and a column come from one 32-bit division. The host puts
// two copies in one table only when neither writes what the other reads or
// writes (table_launches), so the words of a table may move in any order
// (all loads of a turn before its stores included); tables on one stream run
// in order.
// Launch: any grid, block 256. The host sizes the grid to at most three
// blocks a multiprocessor (the launch bounds: at most 85 registers, 77 with
// NVRTC 13 for sm_90a, so three
// blocks of 256 are resident and a grid-stride turn never waits for a second
// wave of blocks), fewer when the table has fewer words than that grid takes
// in one turn (kernels/src/gpu/ops/memory.rs).

#ifdef __HIPCC__
#define CT_COPIES 48
#else
#define CT_COPIES 500
#endif
#define CT_UNROLL 8

struct hk_copy_table {
    hk_i64 c[CT_COPIES][7];  // src, dst, words per row, height, src pitch, dst pitch, word bytes
    hk_i64 start[CT_COPIES + 1];
    int n;
    int pad;
};

struct __attribute__((aligned(16))) hk_w16 {
    unsigned int x, y, z, w;
};

extern "C" __global__ void __launch_bounds__(256, 3) copy_table(hk_copy_table t)
{
    const hk_i64 threads = (hk_i64)gridDim.x * blockDim.x;
    const hk_i64 words = t.start[t.n];
    int c = 0;
    // A thread's words only grow (over k within a turn, and from turn to
    // turn), so its copy index only moves forward.
    for (hk_i64 g0 = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; g0 < words; g0 += threads * CT_UNROLL) {
        hk_w16 v[CT_UNROLL];
        hk_i64 dst[CT_UNROLL];
        int wb[CT_UNROLL];
#pragma unroll
        for (int k = 0; k < CT_UNROLL; ++k) {
            const hk_i64 g = g0 + k * threads;
            wb[k] = 0;  // no word: past the table's end
            dst[k] = 0;
            if (g < words) {
                while (g >= t.start[c + 1]) ++c;
                const unsigned int per_row = (unsigned int)t.c[c][2];
                const unsigned int local = (unsigned int)(g - t.start[c]);
                const unsigned int row = local / per_row;
                const unsigned int col = local - row * per_row;
                const hk_i64 b = t.c[c][6];
                const hk_i64 src = t.c[c][0] + (hk_i64)row * t.c[c][4] + (hk_i64)col * b;
                dst[k] = t.c[c][1] + (hk_i64)row * t.c[c][5] + (hk_i64)col * b;
                wb[k] = (int)b;
                if (b == 16) {
                    v[k] = *(const hk_w16*)src;
                } else if (b == 4) {
                    v[k].x = *(const unsigned int*)src;
                } else {
                    v[k].x = *(const unsigned char*)src;
                }
            }
        }
#pragma unroll
        for (int k = 0; k < CT_UNROLL; ++k) {
            if (wb[k] == 16) {
                *(hk_w16*)dst[k] = v[k];
            } else if (wb[k] == 4) {
                *(unsigned int*)dst[k] = v[k].x;
            } else if (wb[k] == 1) {
                *(unsigned char*)dst[k] = (unsigned char)v[k].x;
            }
        }
    }
}
