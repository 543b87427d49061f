// The fused decode step's dense products (kernels/src/gpu/step_cuda/ launches
// them, step.hip holds the rest of the step). Needs prelude.h in front.
//
// Dense products run on the tensor cores (mma.sync m16n8k16, bf16 operands,
// f32 accumulation) with one reduction order for every row count, so a row's
// bits never depend on its batch:
//   - the weight's inner dimension is cut into S equal segments (S fixed by the
//     weight's shape, never by the batch; for o_proj and the MLP's down
//     projection the segments are the all-reduce units, heads and MLP units,
//     so the sum is the one a TP group's all-reduce makes);
//   - within a segment, one accumulator per output element takes the k-steps
//     of 16 in increasing order, each k-step 1 to 3 products in a fixed order
//     (f32 weights: x_hi w_hi, x_lo w_hi, x_hi w_lo; bf16 weights: x_hi w,
//     x_lo w; x = x_hi + x_lo and w = w_hi + w_lo split into bf16 pairs);
//   - the segment partials are added in segment order (st_seg_sum): by the
//     last block of a column group in st_mm_few, by st_reduce after st_mm.
// A tensor-core instruction computes each output element from that element's
// row and column only, so tiling over rows changes nothing of a row's result.
//
// Operand layouts (the Rust side packs weights with the same index functions,
// kernels/src/step.rs, and a CPU test checks them against the PTX fragment
// layout):
//   A (activations, [M, K] as bf16 planes): 16 x 16 tile (mt, kt) at tile
//     index mt * KT + kt, 32 lanes x 8 values, lane 4g + t holding rows g and
//     g + 8 and columns 2t, 2t + 1, 2t + 8, 2t + 9 in the order of the mma's
//     four A registers;
//   B (weights, [K, N] as bf16 planes): 16 columns x 16 k tile (nt, kt) at tile
//     index nt * KT + kt, lane 4g + t holding the two B registers of column
//     g and of column 8 + g; a warp walking k reads one contiguous stream.


// ---- the tensor-core product --------------------------------------------------------

// st_mma (prelude.h): c += a . b for one m16n8k16 tile.

// A 16-byte weight load that bypasses L1 (each weight is read once a step;
// the A operand keeps L1 and shared memory).
static __device__ __forceinline__ uint4 st_ld_stream(const uint4* p) {
#ifdef __HIPCC__
    return *p;
#else
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#endif
}

// A float written by another block of this grid (read past L1).
static __device__ __forceinline__ float st_ld_cg(const float* p) {
#ifdef __HIPCC__
    return *(volatile const float*)p;
#else
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
#endif
}

// What a product's sums feed (mode), one output element at a time:
//   0 store     out[m * ldo + g * gcol + n] = sum
//   1 residual  out[m * ldo + n] += sum            (h = h + the all-reduce)
//   2 swiglu    the weight's columns interleave gate and up in blocks of 8
//               (tile t: gate of channels 8t .. 8t + 7, then their up); for
//               channel n: silu(gate) * up -> A operand (m, n) of the next
//               product, channel n placed in MLP unit n / uw padded to uwp
//   3 pack      sum -> A operand (m, g * gcol + n) of the next product
// The sum of element (m, col) is its S segment partials added in segment
// order: p_0 + p_1 + ... (st_seg_sum), whichever kernel adds them.
struct StEpi {
    int mode;
    float* out;
    int ldo, gcol;
    unsigned short* ap;
    hk_i64 ap_plane;
    int akt, uw, uwp;
};

// The partials of one element, in segment order: p_0 + p_1 + ... (each
// group of eight loads issued before its adds, so that one element costs one
// round trip for S <= 8, not S).
static __device__ __forceinline__ float st_seg_sum(const float* q, hk_i64 seg, int S) {
    float v = 0.0f;
    for (int x = 0; x < S; x += 8) {
        float t[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) t[i] = x + i < S ? st_ld_cg(q + (hk_i64)(x + i) * seg) : 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (x + i < S) v = x + i == 0 ? t[i] : v + t[i];
    }
    return v;
}

// Element (row r, column or channel n) of group g: its sum(s) and what the mode does.
static __device__ __forceinline__ void st_finish(
    const float* pg, hk_i64 part_seg, int ldp, int S, int r, int n, int g, const StEpi& e)
{
    if (e.mode == 2) {
        const int col = (n / 8) * 16 + n % 8;
        const float* q = pg + (hk_i64)r * ldp + col;
        const float gv = st_seg_sum(q, part_seg, S);
        const float uv = st_seg_sum(q + 8, part_seg, S);
        st_pack(e.ap, e.ap_plane, 2, r, (n / e.uw) * e.uwp + n % e.uw, e.akt, hk_silu(gv) * uv);
        return;
    }
    const float v = st_seg_sum(pg + (hk_i64)r * ldp + n, part_seg, S);
    if (e.mode == 0) {
        e.out[(hk_i64)r * e.ldo + (hk_i64)g * e.gcol + n] = v;
    } else if (e.mode == 1) {
        float* o = e.out + (hk_i64)r * e.ldo + n;
        *o = *o + v;
    } else {
        st_pack(e.ap, e.ap_plane, 2, r, g * e.gcol + n, e.akt, v);
    }
}

// The k-steps of one segment for up to 8 row tiles and 16 columns: the same
// products in the same order in every kernel below.
#define ST_MMA_KSTEP(acc, ah, al, b_hi, b_lo, terms)         \
    do {                                                      \
        st_mma((acc)[0], (ah), (b_hi).x, (b_hi).y);           \
        st_mma((acc)[1], (ah), (b_hi).z, (b_hi).w);           \
        if ((terms) >= 2) {                                   \
            st_mma((acc)[0], (al), (b_hi).x, (b_hi).y);       \
            st_mma((acc)[1], (al), (b_hi).z, (b_hi).w);       \
        }                                                     \
        if ((terms) == 3) {                                   \
            st_mma((acc)[0], (ah), (b_lo).x, (b_lo).y);       \
            st_mma((acc)[1], (ah), (b_lo).z, (b_lo).w);       \
        }                                                     \
    } while (0)

// A warp's partial sums of one 16-column tile for its row tiles mt0, mt0 +
// step, ... (below mts; acc[i] holds tile mt0 + i step) of the rows from row0,
// into part[s][g].
template <int N>
static __device__ __forceinline__ void st_store_partials(
    float* p, int ldp, int nt, int row0, int mt0, int step, int mts, const float (&acc)[N][2][4], int lane)
{
    const int gq = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int mt = mt0 + i * step;
        if (mt < mts) {
            const int r0 = row0 + mt * 16 + gq;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int col = nt * 16 + h * 8 + 2 * t4;
                *(float2*)(p + (hk_i64)r0 * ldp + col) = make_float2(acc[i][h][0], acc[i][h][1]);
                *(float2*)(p + (hk_i64)(r0 + 8) * ldp + col) = make_float2(acc[i][h][2], acc[i][h][3]);
            }
        }
    }
}

// The segment sum of the last of the S blocks of one column group to finish
// (a counter per column group, reset for the next launch): it adds
// the S partials of its columns in segment order and applies the mode. The
// other blocks return. `per` columns (channels for mode 2) a block, rows
// row0 .. row0 + rows - 1; the caller has stored its partials.
static __device__ __forceinline__ void st_last_finish(
    unsigned* cnt, int S, const float* pg, hk_i64 part_seg, int ldp, int row0, int rows, int n0, int per, int ncols, int g, const StEpi& e)
{
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(cnt, 1u) == (unsigned)(S - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int x = threadIdx.x; x < rows * per; x += blockDim.x) {
        const int r = row0 + x / per;
        const int n = n0 + x % per;
        if (n < ncols) st_finish(pg, part_seg, ldp, S, r, n, g, e);
    }
    if (threadIdx.x == 0) *cnt = 0u;  // ready for the next launch
}

// Few rows (M <= 16, the memory-bound decode of small batches): a warp owns
// one 16-column tile of one segment of one group, reads its A tile straight
// from memory (L1 serves the block's 4 warps) and its weights 8 k-steps ahead
// in registers, so enough bytes are in flight to read the weights at the copy
// rate. The last of the S blocks of a column group to finish (a counter) adds
// the S partials in segment order and applies the mode, then resets the
// counter for the next launch: one launch a product.
// Launch: grid (ceil(nt16 / 4), S * G); block 128. A and W pointers and
// strides in 16-byte units; ncols: columns (channels for mode 2).
#define ST_SK 8
extern "C" __global__ void __launch_bounds__(128, 4) st_mm_few(
    const uint4* __restrict__ A, hk_i64 a_plane, hk_i64 a_group,
    const uint4* __restrict__ W, hk_i64 w_plane, hk_i64 w_group,
    float* __restrict__ part, hk_i64 part_seg, hk_i64 part_group, int ldp, unsigned* __restrict__ counters,
    int M, int nt16, int KT, int S, int terms,
    int mode, int ncols, float* __restrict__ out, int ldo, int gcol,
    unsigned short* __restrict__ ap, hk_i64 ap_plane, int akt, int uw, int uwp)
{
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int nt = blockIdx.x * 4 + (tid >> 5);
    const bool active = nt < nt16;
    const int s = blockIdx.y % S;
    const int g = blockIdx.y / S;
    const int seg = KT / S;
    const int kt0 = s * seg;
    const int kend = kt0 + seg;
    const uint4* Wt = W + (hk_i64)g * w_group + (hk_i64)(active ? nt : 0) * KT * 32 + lane;
    const uint4* At = A + (hk_i64)g * a_group + lane;
    float acc[1][2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[0][h][i] = 0.0f;
    if (active) {
        for (int kt = kt0; kt < kend; kt += ST_SK) {
            uint4 bh[ST_SK], bl[ST_SK];
#pragma unroll
            for (int u = 0; u < ST_SK; ++u) {
                if (kt + u < kend) {
                    bh[u] = st_ld_stream(Wt + (hk_i64)(kt + u) * 32);
                    if (terms == 3) bl[u] = st_ld_stream(Wt + w_plane + (hk_i64)(kt + u) * 32);
                }
            }
#pragma unroll
            for (int u = 0; u < ST_SK; ++u) {
                if (kt + u < kend) {
                    const uint4 ah = At[(hk_i64)(kt + u) * 32];
                    const uint4 al = terms >= 2 ? At[a_plane + (hk_i64)(kt + u) * 32] : ah;
                    ST_MMA_KSTEP(acc[0], ah, al, bh[u], bl[u], terms);
                }
            }
        }
        st_store_partials(part + (hk_i64)s * part_seg + (hk_i64)g * part_group, ldp, nt, 0, 0, 1, 1, acc, lane);
    }
    const StEpi e{mode, out, ldo, gcol, ap, ap_plane, akt, uw, uwp};
    const int per = mode == 2 ? 32 : 64;  // the block's columns (channels: 8 a tile)
    st_last_finish(counters + (hk_i64)g * gridDim.x + blockIdx.x, S, part + (hk_i64)g * part_group, part_seg, ldp, 0, M, blockIdx.x * per, per,
                   ncols, g, e);
}

// Many rows (M > 16): a block owns 8 column tiles of 16 of one segment of
// one group for up to 128 rows (8 row tiles, the block's M-block), with 16
// warps: warp w takes column tile w % 8 and the row tiles of parity w / 8
// (0, 2, 4, 6 or 1, 3, 5, 7), so two warps share each column tile's weights
// and a multiprocessor has 16 warps to hide the tensor-core and shared-memory
// latencies with (8 left it issuing every third cycle). It walks the segment
// in chunks of ST_KC k-steps through a ring of P + 1 shared-memory buffers
// filled P chunks ahead by cp.async: each buffer holds the chunk's A tiles
// (shared by the 16 warps) and the 8 column tiles' weight tiles. The copy
// engine, not registers, holds the bytes in flight, and one barrier a chunk
// frees the buffer the next copy fills. The products and their order are
// st_mm_few's; it writes the segment partials, st_reduce adds them.
// WP: weight planes (2 for f32 weights, terms = 3); P: chunks in flight.
// Launch: grid (ceil(nt16 / 8), S * G, ceil(M / 128)); block 512; dynamic
// shared memory (P + 1) * (planes * mrows + 8 * WP) * ST_KC * 512 bytes
// (mrows: row tiles of the first M-block, planes: 2 when terms >= 2). Takes
// st_mm_few's arguments (counters and the epilogue unused).
#ifndef ST_KC
#define ST_KC 4  // benches/gpu/mm_probe.cu tries others with -D
#endif
#define ST_MM_THREADS 512
template <int WP, int P>
static __device__ __forceinline__ void st_mm_body(
    const uint4* __restrict__ A, hk_i64 a_plane, hk_i64 a_group,
    const uint4* __restrict__ W, hk_i64 w_plane, hk_i64 w_group,
    float* __restrict__ part, hk_i64 part_seg, hk_i64 part_group, int ldp, unsigned* __restrict__ counters,
    int M, int nt16, int KT, int S, int terms,
    int mode, int ncols, float* __restrict__ out, int ldo, int gcol,
    unsigned short* __restrict__ ap, hk_i64 ap_plane, int akt, int uw, int uwp)
{
    constexpr int NB = P + 1;
    HK_DYN_SMEM(uint4, sm);
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int cw = warp & 7;   // column tile of the block
    const int rh = warp >> 3;  // row-tile parity
    const int nt = blockIdx.x * 8 + cw;
    const bool active = nt < nt16;
    const int s = blockIdx.y % S;
    const int g = blockIdx.y / S;
    const int mb = blockIdx.z;
    const int rows = M - mb * 128 < 128 ? M - mb * 128 : 128;
    const int mts = (rows + 15) >> 4;
    const int mrows = M >= 128 ? 8 : (M + 15) >> 4;
    const int planes = terms >= 2 ? 2 : 1;
    const int seg = KT / S;
    const int kt0 = s * seg;
    const int kend = kt0 + seg;
    const int nchunks = (seg + ST_KC - 1) / ST_KC;
    const uint4* Ag = A + (hk_i64)g * a_group + (hk_i64)(mb * 8) * KT * 32;
    const uint4* Wt = W + (hk_i64)g * w_group + (hk_i64)(active ? nt : 0) * KT * 32 + lane;
    const int a_tiles = planes * mrows * ST_KC;  // a buffer: A tiles, then 8 column tiles' weight tiles
    const int buf_tiles = a_tiles + 8 * ST_KC * WP;

    // Chunk c into buffer c % NB (zeros past the segment); one commit group a
    // chunk, empty past the last, so the waits below count chunks. The two
    // warps of a column tile copy its weight k-steps half each.
    auto load = [&](int c) {
        if (c < nchunks) {
            uint4* dst = sm + (hk_i64)(c % NB) * buf_tiles * 32;
            const int n = planes * mts * ST_KC * 32;
            for (int q = tid; q < n; q += ST_MM_THREADS) {
                const int l = q & 31;
                const int t = q >> 5;
                const int kk = t % ST_KC;
                const int mt = (t / ST_KC) % mts;
                const int p = t / (ST_KC * mts);
                const int kt = kt0 + c * ST_KC + kk;
                const bool ok = kt < kend;
                hk_cp16(dst + (((hk_i64)p * mrows + mt) * ST_KC + kk) * 32 + l,
                        Ag + (hk_i64)p * a_plane + ((hk_i64)mt * KT + (ok ? kt : kt0)) * 32 + l, ok);
            }
            uint4* wd = dst + (hk_i64)(a_tiles + cw * ST_KC * WP) * 32 + lane;
#pragma unroll
            for (int kk = rh; kk < ST_KC; kk += 2) {
                const int kt = kt0 + c * ST_KC + kk;
                const bool ok = active && kt < kend;
#pragma unroll
                for (int p = 0; p < WP; ++p) hk_cp16(wd + (kk * WP + p) * 32, Wt + (hk_i64)p * w_plane + (hk_i64)(ok ? kt : kt0) * 32, ok);
            }
        }
        hk_cp_commit();
    };

    float acc[4][2][4];  // [i]: row tile rh + 2 i
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][h][i] = 0.0f;

#pragma unroll
    for (int c = 0; c < P; ++c) load(c);
    for (int c = 0; c < nchunks; ++c) {
        hk_cp_wait_n<P - 1>();  // chunk c is in (the P - 1 after it may still fly)
        __syncthreads();        // ... for every thread; chunk c - 1's buffer is free
        load(c + P);
        const uint4* buf = sm + (hk_i64)(c % NB) * buf_tiles * 32 + lane;
        if (active) {
#pragma unroll
            for (int kk = 0; kk < ST_KC; ++kk) {
                if (c * ST_KC + kk < seg) {
                    const uint4* wb = buf + (hk_i64)(a_tiles + (cw * ST_KC + kk) * WP) * 32;
                    const uint4 bh = wb[0];
                    const uint4 bl = WP == 2 ? wb[32] : bh;
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int mt = rh + 2 * i;
                        if (mt < mts) {
                            const uint4 ah = buf[((hk_i64)mt * ST_KC + kk) * 32];
                            const uint4 al = terms >= 2 ? buf[(((hk_i64)mrows + mt) * ST_KC + kk) * 32] : ah;
                            ST_MMA_KSTEP(acc[i], ah, al, bh, bl, terms);
                        }
                    }
                }
            }
        }
    }
    hk_cp_wait_all();
    if (active) st_store_partials(part + (hk_i64)s * part_seg + (hk_i64)g * part_group, ldp, nt, mb * 128, rh, 2, mts, acc, lane);
}

// The segment sums of st_mm's partials and what they feed (StEpi), every
// element of every group, spread over the whole device: with many rows the
// sums are too many for the last block of a column group to add them alone
// (st_mm_few's way), which would leave one block a column group working
// while the rest of the device waits. One block row a (group, row) pair, so
// the index math is one division a block, not 64-bit divisions an element
// (they cost more than the loads). Launch: grid (ceil(ncols / 256), min(G *
// M, 65535)); block 256.
extern "C" __global__ void st_reduce(
    const float* __restrict__ part, hk_i64 part_seg, hk_i64 part_group, int ldp,
    int M, int ncols, int S, int G,
    int mode, float* __restrict__ out, int ldo, int gcol,
    unsigned short* __restrict__ ap, hk_i64 ap_plane, int akt, int uw, int uwp)
{
    const StEpi e{mode, out, ldo, gcol, ap, ap_plane, akt, uw, uwp};
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= ncols) return;
    // Block rows past the grid's y limit (65535) stride over the rest.
    for (unsigned y = blockIdx.y; y < (unsigned)G * (unsigned)M; y += gridDim.y) {
        const int r = (int)(y % (unsigned)M);
        const int g = (int)(y / (unsigned)M);
        st_finish(part + (hk_i64)g * part_group, part_seg, ldp, S, r, n, g, e);
    }
}

#define ST_MM_ARGS                                                                                               \
    const uint4 *__restrict__ A, hk_i64 a_plane, hk_i64 a_group, const uint4 *__restrict__ W, hk_i64 w_plane,  \
        hk_i64 w_group, float *__restrict__ part, hk_i64 part_seg, hk_i64 part_group, int ldp,                  \
        unsigned *__restrict__ counters, int M, int nt16, int KT, int S, int terms, int mode, int ncols,        \
        float *__restrict__ out, int ldo, int gcol, unsigned short *__restrict__ ap, hk_i64 ap_plane, int akt, \
        int uw, int uwp
#define ST_MM_PASS \
    A, a_plane, a_group, W, w_plane, w_group, part, part_seg, part_group, ldp, counters, M, nt16, KT, S, terms, mode, ncols, out, ldo, gcol, ap, ap_plane, akt, uw, uwp

// One weight plane (bf16 weights, or terms < 3), three chunks in flight; two
// planes (f32 weights, terms = 3), three chunks or, where four buffers would
// not fit in shared memory (128 rows), two.
extern "C" __global__ void __launch_bounds__(ST_MM_THREADS, 1) st_mm(ST_MM_ARGS) { st_mm_body<1, 3>(ST_MM_PASS); }
extern "C" __global__ void __launch_bounds__(ST_MM_THREADS, 1) st_mm_w2(ST_MM_ARGS) { st_mm_body<2, 3>(ST_MM_PASS); }
extern "C" __global__ void __launch_bounds__(ST_MM_THREADS, 1) st_mm_w2p2(ST_MM_ARGS) { st_mm_body<2, 2>(ST_MM_PASS); }
