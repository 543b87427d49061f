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
// The table's words are cut into chunks of blockDim.x * CT_UNROLL: block b
// takes chunks b, b + gridDim.x, ..., and thread t of it words t, t +
// blockDim.x, ..., t + 7 * blockDim.x of each, all eight loaded, then all
// stored. So the lanes of a warp move consecutive words (coalesced), a narrow
// row is spread over many threads, a block streams one contiguous 32 KB of
// the table's words at a time, and each thread has eight independent loads in
// flight. The host launches one block a chunk (a grid-stride loop over the
// table with at most three blocks a multiprocessor, the first version, reached
// 0.79 of the device copy on a flagship pass where one block a chunk reaches
// 0.95 on its widest rows, on an H100: benches/gpu/copy_probe.cu); the loop
// over chunks keeps any grid correct. start[c] is the first word of copy c
// (prefix sums of height x words per row, filled on the host), and start[n]
// the word count; a thread finds the copy of its first word by bisection
// (scanning from copy 0 cost a block deep into a 448-copy table hundreds of
// table reads) and moves forward from there. A copy's words number less than
// 2^31, so a row and a column come from one 32-bit division. The host puts
// two copies in one table only when neither writes what the other reads or
// writes (table_launches), so the words of a table may move in any order
// (all loads of a turn before its stores included); tables on one stream run
// in order.
// Launch: any grid (one block a chunk: ceil(start[n] / (256 CT_UNROLL))),
// block 256 (kernels/src/gpu/ops/memory.rs).

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

// The same table for short lists (copy_table_small, CUDA only: HIP's one
// table is already this small): 63 copies, 4,048 bytes of argument. Behind a
// gate on an H100 a launch of copy_table with its 32 KB argument took 6.8 us
// of the device's time for one 16-byte copy, a kernel with 4 KB 3.4 us
// (benches/gpu/copy_probe.cu); a mover's submission of 8 plans has 56 copies.
#define CT_SMALL 63
struct hk_copy_table_small {
    hk_i64 c[CT_SMALL][7];
    hk_i64 start[CT_SMALL + 1];
    int n;
    int pad;
};

struct __attribute__((aligned(16))) hk_w16 {
    unsigned int x, y, z, w;
};

// One launch's copies (either table: the same fields, the same code).
template <typename Table>
static __device__ __forceinline__ void copy_table_run(const Table& t)
{
    const hk_i64 words = t.start[t.n];
    const hk_i64 chunk = (hk_i64)blockDim.x * CT_UNROLL;
    hk_i64 base = (hk_i64)blockIdx.x * chunk;
    if (base >= words) return;
    // The copy of this thread's first word: the last c with start[c] <= it
    // (start[0] = 0; an empty copy's start equals the next one's).
    int c = 0;
    {
        const hk_i64 g = base + threadIdx.x;
        int hi = t.n;
        while (hi - c > 1) {
            const int mid = (c + hi) >> 1;
            if (t.start[mid] <= g) c = mid;
            else hi = mid;
        }
    }
    // A thread's words only grow (over k within a chunk, and from chunk to
    // chunk), so its copy index only moves forward.
    for (; base < words; base += (hk_i64)gridDim.x * chunk) {
        const hk_i64 g0 = base + threadIdx.x;
        hk_w16 v[CT_UNROLL];
        hk_i64 dst[CT_UNROLL];
        int wb[CT_UNROLL];
#pragma unroll
        for (int k = 0; k < CT_UNROLL; ++k) {
            const hk_i64 g = g0 + (hk_i64)k * blockDim.x;
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

extern "C" __global__ void __launch_bounds__(256) copy_table(hk_copy_table t)
{
    copy_table_run(t);
}

extern "C" __global__ void __launch_bounds__(256) copy_table_small(hk_copy_table_small t)
{
    copy_table_run(t);
}

// The gate in front of a timed copy list (DeviceMemory::time_copies): one
// thread spins for `cycles` clock cycles, so that every launch of the list is
// on the stream before the start event behind the gate fires. Without it the
// start event fires at once on an idle stream and the interval counts the
// host's time to queue the launches (tens of microseconds: more than the
// copies of a 15 MB region kind take). Launch: grid 1, block 1.
extern "C" __global__ void copy_gate(hk_i64 cycles)
{
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}
