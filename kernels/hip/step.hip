// The fused decode step (kernels/src/gpu/step_cuda.rs drives it): one fixed
// sequence of launches over a whole batch bucket, captured once per bucket as
// a CUDA graph. Every kernel reads its per-request addresses from the tick
// table on the device (slots, positions, block tables) and reaches the KV cache
// and KDA state in place in the registered regions; nothing here allocates or
// talks to the host. Needs prelude.h in front.
//
// The tick table (int32, uploaded once per step, kernels/src/step.rs TickLayout):
//   [0]                       live requests n (rows >= n are padding: they
//                             compute garbage and touch no region)
//   [tok  + b]                token fed by request b
//   [pos  + b]                its position (the caches hold 0 .. pos - 1)
//   [slot + b * tp + r]       its slot on decode TP rank r
//   [blk + (r * bmax + b) * maxblk + i]   block i of its table on rank r
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
// while the rest of the device waits. Launch: grid-stride over G * M * ncols.
extern "C" __global__ void st_reduce(
    const float* __restrict__ part, hk_i64 part_seg, hk_i64 part_group, int ldp,
    int M, int ncols, int S, int G,
    int mode, float* __restrict__ out, int ldo, int gcol,
    unsigned short* __restrict__ ap, hk_i64 ap_plane, int akt, int uw, int uwp)
{
    const StEpi e{mode, out, ldo, gcol, ap, ap_plane, akt, uw, uwp};
    const hk_i64 total = (hk_i64)G * M * ncols;
    for (hk_i64 x = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; x < total; x += (hk_i64)gridDim.x * blockDim.x) {
        const int n = (int)(x % ncols);
        const int r = (int)((x / ncols) % M);
        const int g = (int)(x / ((hk_i64)ncols * M));
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

// ---- embedding, norms, argmax ---------------------------------------------------------

// h[b] = table[token b] (ids outside the vocabulary read row 0; the host
// checks them). Launch: grid (rows); block 256.
extern "C" __global__ void st_embed(
    const float* __restrict__ table, const int* __restrict__ tick, int tok,
    float* __restrict__ h, int dim, int vocab)
{
    const int b = blockIdx.x;
    int id = tick[tok + b];
    if (id < 0 || id >= vocab) id = 0;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) h[(hk_i64)b * dim + c] = table[(hk_i64)id * dim + c];
}

// Fixed-order mean square of one row (the block sum of the prelude).
static __device__ float st_inv_rms(const float* x, int dim, float eps, float* red) {
    float ss = 0.0f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) ss += x[c] * x[c];
    const float ms = hk_block_sum(ss, red) / (float)dim;
    return 1.0f / sqrtf(ms + eps);
}

// RMSNorm of row b of h, written as the A operand of the next product (akt
// k tiles: dim padded to whole k-steps). Launch: grid (rows); block 256.
extern "C" __global__ void st_rms_pack(
    const float* __restrict__ h, const float* __restrict__ w,
    unsigned short* __restrict__ a, hk_i64 a_plane, int planes, int dim, int akt, float eps)
{
    __shared__ float red[32];
    const int b = blockIdx.x;
    const float* x = h + (hk_i64)b * dim;
    const float r = st_inv_rms(x, dim, eps, red);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) st_pack(a, a_plane, planes, b, c, akt, x[c] * r * w[c]);
}

// KDA's gated output norm of (row b, head h): rms(o) * w * silu(gate), as the
// A operand (b, h * dvp + j) of o_proj (a head is one reduction unit, padded
// to dvp, whole k-steps). Launch: grid (rows * H); block 128.
extern "C" __global__ void st_gnorm_pack(
    const float* __restrict__ o, const float* __restrict__ proj, int ldproj, int gate_off,
    const float* __restrict__ w, unsigned short* __restrict__ a, hk_i64 a_plane, int planes,
    int heads, int dv, int dvp, float eps)
{
    __shared__ float red[32];
    const int b = blockIdx.x / heads;
    const int hd = blockIdx.x % heads;
    const float* x = o + ((hk_i64)b * heads + hd) * dv;
    const float* gt = proj + (hk_i64)b * ldproj + gate_off + (hk_i64)hd * dv;
    const float r = st_inv_rms(x, dv, eps, red);
    const int akt = (heads * dvp) >> 4;
    for (int j = threadIdx.x; j < dv; j += blockDim.x)
        st_pack(a, a_plane, planes, b, hd * dvp + j, akt, x[j] * r * w[j] * hk_silu(gt[j]));
}

// Greedy pick per row: the lowest index of the largest logit, NaNs skipped (a
// row of NaNs picks 0). Launch: grid (rows); block 256.
extern "C" __global__ void st_argmax(const float* __restrict__ logits, int cols, int* __restrict__ ids)
{
    __shared__ float sv[256];
    __shared__ int si[256];
    const float* row = logits + (hk_i64)blockIdx.x * cols;
    float bv = 0.0f;
    int bi = -1;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = row[c];
        if (!hk_isnan(v) && (bi < 0 || v > bv)) {
            bv = v;
            bi = c;
        }
    }
    sv[threadIdx.x] = bv;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float ov = sv[threadIdx.x + s];
            const int oi = si[threadIdx.x + s];
            const int mi = si[threadIdx.x];
            if (oi >= 0 && (mi < 0 || ov > sv[threadIdx.x] || (ov == sv[threadIdx.x] && oi < mi))) {
                sv[threadIdx.x] = ov;
                si[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) ids[blockIdx.x] = si[0] < 0 ? 0 : si[0];
}

// ---- short conv in place ------------------------------------------------------------

// Global channel c (the full model's q | k | v order) of request b: rank r =
// head / hl holds it at local channel lc of its own q | k | v layout.
static __device__ __forceinline__ void st_conv_channel(int c, int H, int hl, int dk, int dv, int* r, int* lc) {
    const int qk = H * dk;
    if (c < qk) {
        const int hd = c / dk;
        *r = hd / hl;
        *lc = (hd % hl) * dk + c % dk;
    } else if (c < 2 * qk) {
        const int cc = c - qk;
        const int hd = cc / dk;
        *r = hd / hl;
        *lc = hl * dk + (hd % hl) * dk + cc % dk;
    } else {
        const int cc = c - 2 * qk;
        const int hd = cc / dv;
        *r = hd / hl;
        *lc = 2 * hl * dk + (hd % hl) * dv + cc % dv;
    }
}

// One conv decode step per live request, on the conv state where it lies:
// out = silu(w[W-1] x + sum_j w[j] st[j]) (that order), then the state shifts
// up one row and takes x, stored in the cache dtype. x = proj[b, c].
// rows[r]: address of this layer's row in rank r's conv region.
// Launch: grid-stride over rows * C.
extern "C" __global__ void st_conv(
    const float* __restrict__ proj, int ldproj, const float* __restrict__ weight,
    const int* __restrict__ tick, int slot, int tp,
    const unsigned long long* __restrict__ rows, hk_i64 unit_stride, int dt,
    float* __restrict__ out, int bmax, int H, int hl, int dk, int dv, int width)
{
    const int C = H * (2 * dk + dv);
    const int cr = hl * (2 * dk + dv);
    const int hist = width - 1;
    const int eb = st_ebytes(dt);
    const int live = tick[0];
    const hk_i64 n = (hk_i64)live * C;
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x) {
        const int b = (int)(e / C);
        const int c = (int)(e % C);
        int r, lc;
        st_conv_channel(c, H, hl, dk, dv, &r, &lc);
        unsigned char* st = (unsigned char*)(rows[r] + (unsigned long long)tick[slot + b * tp + r] * unit_stride);
        const float* wc = weight + (hk_i64)c * width;
        const float xv = proj[(hk_i64)b * ldproj + c];
        float acc = wc[hist] * xv;
        for (int j = 0; j < hist; ++j) acc += wc[j] * st_ld(st + ((hk_i64)j * cr + lc) * eb, dt);
        out[(hk_i64)b * C + c] = hk_silu(acc);
        for (int j = 0; j + 1 < hist; ++j)
            st_st(st + ((hk_i64)j * cr + lc) * eb, dt, st_ld(st + ((hk_i64)(j + 1) * cr + lc) * eb, dt));
        if (hist > 0) st_st(st + ((hk_i64)(hist - 1) * cr + lc) * eb, dt, xv);
    }
    (void)bmax;
}

// ---- KDA step in place ------------------------------------------------------------
//
// The thread layout of kda.hip's kda_recurrent (64-column tiles: 2 columns a
// lane, 16 key rows a warp, dk / 16 warps), one block per (request, head,
// tile). The state lives in its rank's kda.state region at the request's
// slot; under ReplaySSM that is the committed state S_0, which the step only
// reads: it needs the current state only through two products with it, which
// it takes from S_0 and the ring's records in one pass (see st_kda), appends
// this token's record (k^, u, g) to the ring, and when the ring is then full
// commits: S_0 := the state rebuilt from S_0 over all the records
// (replay_commit's arithmetic, st_kda_rebuild). Without ReplaySSM the state
// is read once and written once. The cursors are advanced by st_cursor after
// every layer has run.

#define ST_KDA_ROWS 16
#define ST_KDA_COLS 2
#define ST_KDA_TILE (HK_WARP * ST_KDA_COLS)

// Records staged in shared memory at a time by st_kda_rebuild.
#define ST_KDA_RC 16

// Records lo .. hi - 1 of a head's ring into shared memory, ST_KDA_RC at most:
// k^ (kpad), g (kpad) and u of the block's columns (ST_KDA_TILE) each, zeros
// past dk and dv; ends with a barrier. Every thread of the block calls it.
static __device__ __forceinline__ void st_kda_stage(
    float* srec, const float* __restrict__ rec0, hk_i64 rstride, int lo, int hi, int kpad, int dk, int dv, int col0)
{
    const int per = 2 * kpad + ST_KDA_TILE;
    const int total = (hi - lo) * per;
    // Eight loads a thread in flight at once: the records are the step's
    // longest chain of dependent reads, so they go in as few round trips as fit.
    for (int base = 0; base < total; base += 8 * (int)blockDim.x) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int q = base + u * (int)blockDim.x + (int)threadIdx.x;
            v[u] = 0.0f;
            if (q < total) {
                const int x = q % per;
                const float* rj = rec0 + (lo + q / per) * rstride;
                if (x < kpad) {
                    if (x < dk) v[u] = rj[x];
                } else if (x < 2 * kpad) {
                    if (x - kpad < dk) v[u] = rj[dk + dv + (x - kpad)];
                } else {
                    const int jc = col0 + (x - 2 * kpad);
                    if (jc < dv) v[u] = rj[dk + jc];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int q = base + u * (int)blockDim.x + (int)threadIdx.x;
            if (q < total) srec[q] = v[u];
        }
    }
    __syncthreads();
}

// s (S_0 on entry) := exp(G) S_0 + sum_j exp(G - G_j) k_j u_j^T over n ring
// records of this head (oldest first in memory, applied newest first so that
// G - G_j is a suffix sum of g), then, when `local` is set, one more record
// newest of all from shared memory (k^ kl, g gl) and registers (u ul).
// The records go through shared memory ST_KDA_RC at a time (k^, g of every
// key row, u of the block's columns), loaded by the whole block at once, so
// the serial walk reads shared memory, not the ring. srec holds ST_KDA_RC * (2
// kpad + TILE) floats, stot kpad. Every thread of the block calls it.
static __device__ __forceinline__ void st_kda_rebuild(
    float (&s)[ST_KDA_ROWS][ST_KDA_COLS], const float* __restrict__ rec0, hk_i64 rstride, int n,
    bool local, const float* kl, const float* gl, const float* ul,
    int w, int lane, int col0, int dk, int dv, int kpad, float* srec, float* stot)
{
    const int tid = threadIdx.x;
    const int per = 2 * kpad + ST_KDA_TILE;
    auto stage = [&](int lo, int hi) { st_kda_stage(srec, rec0, rstride, lo, hi, kpad, dk, dv, col0); };
    // One staging for the usual ring (every record fits), else ST_KDA_RC at a time.
    const bool all = n <= ST_KDA_RC;
    if (all && n > 0) stage(0, n);
    // G over every record, oldest first, one thread a key row.
    if (tid < kpad) {
        float total = 0.0f;
        if (tid < dk) {
            for (int j = 0; j < n; ++j) total += all ? srec[j * per + kpad + tid] : rec0[j * rstride + dk + dv + tid];
            if (local) total += gl[tid];
        }
        stot[tid] = total;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ST_KDA_ROWS; ++r) {
        const float e = expf(stot[w * ST_KDA_ROWS + r]);
#pragma unroll
        for (int c = 0; c < ST_KDA_COLS; ++c) s[r][c] *= e;
    }
    // Key row tid's suffix of g (records newer than the one applied next).
    float suf = 0.0f;
    if (local) {
#pragma unroll
        for (int r = 0; r < ST_KDA_ROWS; ++r) {
            const int i = w * ST_KDA_ROWS + r;
            if (i < dk) {
                const float coef = kl[i];  // expf(0) * k
#pragma unroll
                for (int c = 0; c < ST_KDA_COLS; ++c) s[r][c] += coef * ul[c];
            }
        }
        if (tid < dk) suf = gl[tid];
    }
    for (int hi = n; hi > 0; hi -= ST_KDA_RC) {
        const int lo = hi > ST_KDA_RC ? hi - ST_KDA_RC : 0;
        if (!all) {
            __syncthreads();  // the previous records are consumed
            stage(lo, hi);
        }
        // Each record's coefficient exp(G - G_j) k_j, newest first, one thread
        // a key row (in place of k_j): every lane of a warp needs the same ones.
        if (tid < dk) {
            for (int j = hi - 1; j >= lo; --j) {
                float* rj = srec + (j - lo) * per;
                const float coef = expf(suf) * rj[tid];
                suf += rj[kpad + tid];
                rj[tid] = coef;
            }
        }
        __syncthreads();
        for (int j = hi - 1; j >= lo; --j) {
            const float* rj = srec + (j - lo) * per;
            float uu[ST_KDA_COLS];
#pragma unroll
            for (int c = 0; c < ST_KDA_COLS; ++c) uu[c] = rj[2 * kpad + lane + HK_WARP * c];
#pragma unroll
            for (int r = 0; r < ST_KDA_ROWS; ++r) {
                const float coef = rj[w * ST_KDA_ROWS + r];  // 0 past dk
#pragma unroll
                for (int c = 0; c < ST_KDA_COLS; ++c) s[r][c] += coef * uu[c];
            }
        }
    }
    // The caller may reuse srec after the next barrier.
    __syncthreads();
}

// The warp's key rows of the block's column tile of a head's state (int
// offsets from one base: a head's state is far below 2^31 values).
static __device__ __forceinline__ void st_kda_load(
    float (&s)[ST_KDA_ROWS][ST_KDA_COLS], const float* S, int w, int lane, int col0, int dk, int dv)
{
    const float* base = S + (hk_i64)(w * ST_KDA_ROWS) * dv + col0 + lane;
#pragma unroll
    for (int r = 0; r < ST_KDA_ROWS; ++r) {
        const int i = w * ST_KDA_ROWS + r;
#pragma unroll
        for (int c = 0; c < ST_KDA_COLS; ++c) {
            const int j = col0 + lane + HK_WARP * c;
            s[r][c] = (i < dk && j < dv) ? base[r * dv + HK_WARP * c] : 0.0f;
        }
    }
}

static __device__ __forceinline__ void st_kda_store(
    const float (&s)[ST_KDA_ROWS][ST_KDA_COLS], float* S, int w, int lane, int col0, int dk, int dv)
{
    float* base = S + (hk_i64)(w * ST_KDA_ROWS) * dv + col0 + lane;
#pragma unroll
    for (int r = 0; r < ST_KDA_ROWS; ++r) {
        const int i = w * ST_KDA_ROWS + r;
#pragma unroll
        for (int c = 0; c < ST_KDA_COLS; ++c) {
            const int j = col0 + lane + HK_WARP * c;
            if (i < dk && j < dv) base[r * dv + HK_WARP * c] = s[r][c];
        }
    }
}

// q, k, v: the conv outputs cv [rows, C] (full order); g_raw, b_raw and the
// gate in proj; out [rows, H, dv]. rows3: this layer's row addresses of the
// state, ring and cursor regions, [3][tp] (ring and cursor 0 without replay).
// Launch: grid (rows * H, ceil(dv / 64)); block 32 * ceil(dk / 16) (dk <= 128);
// dynamic shared memory (4 kpad + 2 nw 64 + 2 nw) floats, kpad = 16 nw, and
// under ReplaySSM (ST_KDA_RC (2 kpad + 64) + kpad) more.
extern "C" __global__ void __launch_bounds__(256, 2) st_kda(
    const float* __restrict__ cv, const float* __restrict__ proj, int ldproj, int g_off, int b_off,
    const float* __restrict__ a_log, const float* __restrict__ dt_bias, float* __restrict__ out,
    const int* __restrict__ tick, int slot, int tp,
    const unsigned long long* __restrict__ rows3, hk_i64 state_stride, hk_i64 ring_stride, hk_i64 cursor_stride,
    int heads, int hl, int dk, int dv, int cap)
{
    const int TILE = ST_KDA_TILE;
    const int nw = blockDim.x / HK_WARP;
    const int kpad = nw * ST_KDA_ROWS;
    HK_DYN_SMEM(float, smem);
    float* qh = smem;
    float* kh = qh + kpad;
    float* gs = kh + kpad;
    float* al = gs + kpad;
    float* part1 = al + kpad;
    float* part2 = part1 + nw * TILE;
    float* red = part2 + nw * TILE;
    float* srec = red + 2 * nw;                   // replay records (ST_KDA_RC at a time)
    float* stot = srec + ST_KDA_RC * (2 * kpad + TILE);

    const int b = blockIdx.x / heads;
    const int h = blockIdx.x % heads;
    if (b >= tick[0]) return;
    const int tid = threadIdx.x;
    const int lane = tid & (HK_WARP - 1);
    const int w = tid / HK_WARP;
    const int col0 = blockIdx.y * TILE;
    const int r = h / hl;
    const int lh = h % hl;
    const unsigned long long sl = (unsigned long long)tick[slot + b * tp + r];
    float* S = (float*)(rows3[r] + sl * state_stride) + (hk_i64)lh * dk * dv;
    const int wrec = 2 * dk + dv;

    // S_0's tile, in flight while the records are walked.
    float s[ST_KDA_ROWS][ST_KDA_COLS];
    st_kda_load(s, S, w, lane, col0, dk, dv);

    const int C = heads * (2 * dk + dv);
    const float* cvb = cv + (hk_i64)b * C;
    const float* pb = proj + (hk_i64)b * ldproj;
    const float qi = tid < dk ? cvb[h * dk + tid] : 0.0f;
    const float ki = tid < dk ? cvb[heads * dk + h * dk + tid] : 0.0f;
    const float gr = tid < dk ? pb[g_off + h * dk + tid] : 0.0f;
    const float br = pb[b_off + h];
    float vv[ST_KDA_COLS];
#pragma unroll
    for (int c = 0; c < ST_KDA_COLS; ++c) {
        const int j = col0 + lane + HK_WARP * c;
        vv[c] = j < dv ? cvb[2 * heads * dk + h * dv + j] : 0.0f;
    }
    const float rate = -expf(a_log[h]);
    const float bias = tid < dk ? dt_bias[(hk_i64)h * dk + tid] : 0.0f;
    const float inv_sqrt_dk = 1.0f / sqrtf((float)dk);

    // ReplaySSM: the committed state S_0 and the n records since.
    float* rec0 = 0;
    int n = 0;
    const hk_i64 rstride = (hk_i64)hl * wrec;
    if (cap > 0) {
        rec0 = (float*)(rows3[tp + r] + sl * ring_stride) + (hk_i64)lh * wrec;
        n = *(const int*)(rows3[2 * tp + r] + sl * cursor_stride);
        n = n < 0 ? 0 : (n > cap - 1 ? cap - 1 : n);
    }

    // Step 1: L2 norms of q and k, one fixed-order block sum for both.
    float sq = hk_warp_sum(qi * qi);
    float sk = hk_warp_sum(ki * ki);
    if (lane == 0) {
        red[2 * w] = sq;
        red[2 * w + 1] = sk;
    }
    __syncthreads();
    sq = 0.0f;
    sk = 0.0f;
    for (int x = 0; x < nw; ++x) {
        sq += red[2 * x];
        sk += red[2 * x + 1];
    }
    const float qs = 1.0f / sqrtf(sq + 1e-6f) * inv_sqrt_dk;
    const float ks = 1.0f / sqrtf(sk + 1e-6f);
    // Steps 2-3: per-channel log decay, beta.
    if (tid < kpad) {
        if (tid < dk) {
            qh[tid] = qi * qs;
            kh[tid] = ki * ks;
            gs[tid] = rate * hk_softplus(gr + bias);
        } else {
            qh[tid] = kh[tid] = gs[tid] = 0.0f;
        }
    }
    const float beta = hk_sigmoid(br);
    __syncthreads();

    // The step reads the current state S only through S'^T x = (Diag(alpha) S)^T x
    // for x = k^ and q^, and S = Diag(e^G) S_0 + sum_j Diag(e^(G - G_j)) k_j u_j^T
    // over the records (G - G_j: the decay of the records newer than j), so
    //   S'^T x = S_0^T (E x) + sum_j u_j (c_j . x),  E = e^(g + G),
    //   c_j = e^(g + G - G_j) k_j,
    // one pass over S_0 with no state written back (it is written only when
    // the ring commits, or every step without ReplaySSM). Then
    //   u = beta (v - S'^T k^),  o = S_t^T q^ = S'^T q^ + u (k^ . q^).
    // Partial sums over the warp's key rows: pk for x = k^, pq for x = q^.
    float pk[ST_KDA_COLS], pq[ST_KDA_COLS];
#pragma unroll
    for (int c = 0; c < ST_KDA_COLS; ++c) pk[c] = pq[c] = 0.0f;
    // Key row tid's decay so far, newest record first.
    float suf = tid < dk ? gs[tid] : 0.0f;
    const int per = 2 * kpad + TILE;
    for (int hi = n; hi > 0; hi -= ST_KDA_RC) {
        const int lo = hi > ST_KDA_RC ? hi - ST_KDA_RC : 0;
        if (hi != n) __syncthreads();  // the previous records are consumed
        st_kda_stage(srec, rec0, rstride, lo, hi, kpad, dk, dv, col0);
        if (tid < dk) {
            for (int j = hi - 1; j >= lo; --j) {
                float* rj = srec + (j - lo) * per;
                const float coef = expf(suf) * rj[tid];
                suf += rj[kpad + tid];
                rj[tid] = coef;  // c_j in place of k_j
            }
        }
        __syncthreads();
        // Record j's dot products, by warp j % nw, added to that warp's partials.
        for (int j = lo + w; j < hi; j += nw) {
            const float* rj = srec + (j - lo) * per;
            float dk_ = 0.0f, dq_ = 0.0f;
            for (int i = lane; i < kpad; i += HK_WARP) {
                dk_ = fmaf(rj[i], kh[i], dk_);
                dq_ = fmaf(rj[i], qh[i], dq_);
            }
            dk_ = hk_warp_sum(dk_);
            dq_ = hk_warp_sum(dq_);
#pragma unroll
            for (int c = 0; c < ST_KDA_COLS; ++c) {
                const float uj = rj[2 * kpad + lane + HK_WARP * c];
                pk[c] = fmaf(uj, dk_, pk[c]);
                pq[c] = fmaf(uj, dq_, pq[c]);
            }
        }
    }
    if (tid < kpad) al[tid] = tid < dk ? expf(suf) : 0.0f;  // E (alpha itself without records)
    __syncthreads();
    // k^ . q^, in every warp in one order.
    float kq = 0.0f;
    for (int i = lane; i < kpad; i += HK_WARP) kq = fmaf(kh[i], qh[i], kq);
    kq = hk_warp_sum(kq);
    // S_0's part.
#pragma unroll
    for (int rr = 0; rr < ST_KDA_ROWS; ++rr) {
        const int i = w * ST_KDA_ROWS + rr;
        const float e = al[i];
        const float xk = e * kh[i];
        const float xq = e * qh[i];
#pragma unroll
        for (int c = 0; c < ST_KDA_COLS; ++c) {
            pk[c] = fmaf(s[rr][c], xk, pk[c]);
            pq[c] = fmaf(s[rr][c], xq, pq[c]);
        }
    }
#pragma unroll
    for (int c = 0; c < ST_KDA_COLS; ++c) {
        part1[w * TILE + lane + HK_WARP * c] = pk[c];
        part2[w * TILE + lane + HK_WARP * c] = pq[c];
    }
    __syncthreads();
    float u[ST_KDA_COLS];
#pragma unroll
    for (int c = 0; c < ST_KDA_COLS; ++c) {
        const int jj = lane + HK_WARP * c;
        float kv = 0.0f;
        for (int x = 0; x < nw; ++x) kv += part1[x * TILE + jj];
        u[c] = col0 + jj < dv ? beta * (vv[c] - kv) : 0.0f;
    }
    float* rec = cap > 0 ? rec0 + (hk_i64)n * rstride : 0;
    if (w == 0) {
#pragma unroll
        for (int c = 0; c < ST_KDA_COLS; ++c) {
            const int jj = lane + HK_WARP * c;
            const int j = col0 + jj;
            if (j < dv) {
                float o = 0.0f;
                for (int x = 0; x < nw; ++x) o += part2[x * TILE + jj];
                out[((hk_i64)b * heads + h) * dv + j] = fmaf(u[c], kq, o);
                if (rec) rec[dk + j] = u[c];
            }
        }
    }
    if (rec && blockIdx.y == 0 && tid < dk) {
        rec[tid] = kh[tid];
        rec[dk + dv + tid] = gs[tid];
    }
    if (cap > 0) {
        if (n + 1 < cap) return;  // the committed state stays; the ring holds the step
        // The ring is full: S_0 := the state rebuilt from S_0 over all its records.
        __syncthreads();  // srec is free
        st_kda_load(s, S, w, lane, col0, dk, dv);
        st_kda_rebuild(s, rec0, rstride, n, true, kh, gs, u, w, lane, col0, dk, dv, kpad, srec, stot);
    } else {
        // S_t = Diag(alpha) S + k^ u^T.
#pragma unroll
        for (int rr = 0; rr < ST_KDA_ROWS; ++rr) {
            const int i = w * ST_KDA_ROWS + rr;
            const float a = al[i];
            const float kk = kh[i];
#pragma unroll
            for (int c = 0; c < ST_KDA_COLS; ++c) s[rr][c] = fmaf(kk, u[c], s[rr][c] * a);
        }
    }
    st_kda_store(s, S, w, lane, col0, dk, dv);
}

// Advances every live request's ReplaySSM cursor of every KDA layer on every
// rank (one i32 per slot per layer): c + 1, or 0 when the ring committed.
// rows: [layers][tp] row addresses of the cursor region. Launch: grid-stride
// over live * tp * layers.
extern "C" __global__ void st_cursor(
    const int* __restrict__ tick, int slot, int tp, const unsigned long long* __restrict__ rows,
    int layers, hk_i64 unit_stride, int cap)
{
    const hk_i64 n = (hk_i64)tick[0] * tp * layers;
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x) {
        const int l = (int)(e % layers);
        const int r = (int)((e / layers) % tp);
        const int b = (int)(e / ((hk_i64)layers * tp));
        int* c = (int*)(rows[(hk_i64)l * tp + r] + (unsigned long long)tick[slot + b * tp + r] * unit_stride);
        const int v = *c < 0 ? 0 : *c;
        *c = v + 1 >= cap ? 0 : v + 1;
    }
}

// ---- MLA: the new row, the absorbed query ---------------------------------------------

// Row b of proj holds [latent (L) | rope (R) | per head: q_nope (dn) q_rope (R)].
// The cached row is [rms(latent) * kv_norm | rope], rounded to the cache dtype
// and written to the rank of every TP group whose DCP rank owns the position
// ((p / S) % dcp, at local position (p / (S dcp)) S + p % S). q_nope goes out
// as the A operand of head h's W_UK product (group h), q_rope to q_lat [b, h, L:].
// mla_rows[r]: this layer's row address of rank r's mla.kv region.
// Launch: grid (rows); block 256.
extern "C" __global__ void st_mla_prep(
    const float* __restrict__ proj, int ldproj, const float* __restrict__ kv_norm,
    int L, int R, int heads, int dn, float eps, int dt,
    const int* __restrict__ tick, int pos, int blk, int maxblk, int bmax, int tp, int dcp, int interleave, int bs,
    const unsigned long long* __restrict__ mla_rows, hk_i64 block_stride, int tb,
    float* __restrict__ q_lat, unsigned short* __restrict__ aq, hk_i64 aq_plane, hk_i64 aq_group, int planes, int qkt)
{
    __shared__ float red[32];
    const int b = blockIdx.x;
    const float* pb = proj + (hk_i64)b * ldproj;
    const float r = st_inv_rms(pb, L, eps, red);
    const int W = L + R;
    if (b < tick[0]) {
        const int p = tick[pos + b];
        const int d = (p / interleave) % dcp;
        const int lp = (p / (interleave * dcp)) * interleave + p % interleave;
        const int eb = st_ebytes(dt);
        for (int g = 0; g < tp / dcp; ++g) {
            const int rk = g * dcp + d;
            const int bl = tick[blk + (rk * bmax + b) * maxblk + lp / bs];
            unsigned char* row = (unsigned char*)(mla_rows[rk] + (unsigned long long)bl * block_stride) + (hk_i64)(lp % bs) * tb;
            for (int c = threadIdx.x; c < W; c += blockDim.x) {
                const float x = c < L ? pb[c] * r * kv_norm[c] : pb[c];
                st_st(row + (hk_i64)c * eb, dt, x);
            }
        }
    }
    const int qw = dn + R;
    for (int e = threadIdx.x; e < heads * qw; e += blockDim.x) {
        const int hd = e / qw;
        const int c = e % qw;
        const float x = pb[W + e];
        if (c < dn) st_pack(aq + (hk_i64)hd * aq_group, aq_plane, planes, b, c, qkt, x);
        else q_lat[((hk_i64)b * heads + hd) * W + L + (c - dn)] = x;
    }
}

