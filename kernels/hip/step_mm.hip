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
//     index mt * KT + kt, its four 8 x 8 core matrices as wgmma reads them
//     from shared memory (prelude.h's st_a_at); the mma.sync kernels gather
//     their fragments from it with four coalesced 32-bit loads (st_a_frag);
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

// Four adjacent partials (16-byte aligned), L2 only, as st_ld_cg.
static __device__ __forceinline__ float4 st_ld_cg4(const float* p) {
#ifdef __HIPCC__
    const volatile float* q = (const volatile float*)p;
    return make_float4(q[0], q[1], q[2], q[3]);
#else
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
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

// st_seg_sum of four adjacent elements at once (q 16-byte aligned): each
// element's partials added in segment order, the same sums as four
// st_seg_sum calls, with four times the bytes of each load.
static __device__ __forceinline__ float4 st_seg_sum4(const float* q, hk_i64 seg, int S) {
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int x = 0; x < S; x += 8) {
        float4 t[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) t[i] = x + i < S ? st_ld_cg4(q + (hk_i64)(x + i) * seg) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (x + i < S) {
                if (x + i == 0) {
                    v = t[i];
                } else {
                    v.x = v.x + t[i].x;
                    v.y = v.y + t[i].y;
                    v.z = v.z + t[i].z;
                    v.w = v.w + t[i].w;
                }
            }
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
    HK_GRID_DEP();
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
    const unsigned* At = (const unsigned*)(A + (hk_i64)g * a_group);
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
                    const uint4 ah = st_a_frag(At + (hk_i64)(kt + u) * 128, lane);
                    const uint4 al = terms >= 2 ? st_a_frag(At + 4 * a_plane + (hk_i64)(kt + u) * 128, lane) : ah;
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
        const uint4* tiles = sm + (hk_i64)(c % NB) * buf_tiles * 32;
        const uint4* buf = tiles + lane;
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
                            const uint4 ah = st_a_frag((const unsigned*)(tiles + ((hk_i64)mt * ST_KC + kk) * 32), lane);
                            const uint4 al = terms >= 2 ? st_a_frag((const unsigned*)(tiles + (((hk_i64)mrows + mt) * ST_KC + kk) * 32), lane) : ah;
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
// (they cost more than the loads). A thread takes four adjacent elements
// with 16-byte loads (partial rows are nt * 16 floats, so four from a
// multiple of four never straddle a row, nor, for mode 2, a gate/up group of
// eight); each element's sum is st_finish's, in segment order. Launch: grid
// (ceil(ncols / 1024), min(G * M, 65535)); block 256.
extern "C" __global__ void st_reduce(
    const float* __restrict__ part, hk_i64 part_seg, hk_i64 part_group, int ldp,
    int M, int ncols, int S, int G,
    int mode, float* __restrict__ out, int ldo, int gcol,
    unsigned short* __restrict__ ap, hk_i64 ap_plane, int akt, int uw, int uwp)
{
    HK_GRID_DEP();
    const StEpi e{mode, out, ldo, gcol, ap, ap_plane, akt, uw, uwp};
    const int n = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (n >= ncols) return;
    const bool whole = n + 4 <= ncols;
    // Block rows past the grid's y limit (65535) stride over the rest.
    for (unsigned y = blockIdx.y; y < (unsigned)G * (unsigned)M; y += gridDim.y) {
        const int r = (int)(y % (unsigned)M);
        const int g = (int)(y / (unsigned)M);
        const float* pg = part + (hk_i64)g * part_group;
        if (!whole) {
            for (int i = 0; n + i < ncols; ++i) st_finish(pg, part_seg, ldp, S, r, n + i, g, e);
            continue;
        }
        if (mode == 2) {
            const float* q = pg + (hk_i64)r * ldp + (n / 8) * 16 + n % 8;
            const float4 gv = st_seg_sum4(q, part_seg, S);
            const float4 uv = st_seg_sum4(q + 8, part_seg, S);
            const float gs[4] = {gv.x, gv.y, gv.z, gv.w};
            const float us[4] = {uv.x, uv.y, uv.z, uv.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
                st_pack(ap, ap_plane, 2, r, ((n + i) / uw) * uwp + (n + i) % uw, akt, hk_silu(gs[i]) * us[i]);
            continue;
        }
        const float4 v4 = st_seg_sum4(pg + (hk_i64)r * ldp + n, part_seg, S);
        const float v[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (mode == 0) {
                out[(hk_i64)r * ldo + (hk_i64)g * gcol + n + i] = v[i];
            } else if (mode == 1) {
                float* o = out + (hk_i64)r * ldo + n + i;
                *o = *o + v[i];
            } else {
                st_pack(ap, ap_plane, 2, r, g * gcol + n + i, akt, v[i]);
            }
        }
    }
}

// st_reduce's residual add (mode 1) for one row, then st_rms_pack of that
// row: the two launches that follow a product into the residual stream with
// more than 16 rows (o_proj, down), as one. Block b adds the segment sums of
// row b into h in st_reduce's order and, after a barrier (the row's new
// values, written by this block, are then seen by all its threads), packs
// the row's RMSNorm as st_rms_pack does: the same bits as the two kernels.
// The host fuses only where the row is the norm's (ncols = dim). Launch: grid
// (rows); block 256.
extern "C" __global__ void st_reduce_rms(
    const float* __restrict__ part, hk_i64 part_seg, int ldp, int ncols, int S,
    float* __restrict__ h, const float* __restrict__ w,
    unsigned short* __restrict__ a, hk_i64 a_plane, int planes, int dim, int akt, float eps)
{
    HK_GRID_DEP();
    __shared__ float red[32];
    const int r = blockIdx.x;
    const StEpi e{1, h, ncols, 0, 0, 0, 1, 1, 1};
    for (int n = 4 * threadIdx.x; n < ncols; n += 4 * blockDim.x) {
        if (n + 4 > ncols) {
            for (int i = 0; n + i < ncols; ++i) st_finish(part, part_seg, ldp, S, r, n + i, 0, e);
            continue;
        }
        const float4 v4 = st_seg_sum4(part + (hk_i64)r * ldp + n, part_seg, S);
        const float v[4] = {v4.x, v4.y, v4.z, v4.w};
        float* o = h + (hk_i64)r * ncols + n;
#pragma unroll
        for (int i = 0; i < 4; ++i) o[i] = o[i] + v[i];
    }
    __syncthreads();
    st_rms_pack_row(h, w, a, a_plane, planes, dim, akt, eps, r, red);
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
extern "C" __global__ void __launch_bounds__(ST_MM_THREADS, 1) st_mm(ST_MM_ARGS) { HK_GRID_DEP(); st_mm_body<1, 3>(ST_MM_PASS); }
extern "C" __global__ void __launch_bounds__(ST_MM_THREADS, 1) st_mm_w2(ST_MM_ARGS) { HK_GRID_DEP(); st_mm_body<2, 3>(ST_MM_PASS); }
extern "C" __global__ void __launch_bounds__(ST_MM_THREADS, 1) st_mm_w2p2(ST_MM_ARGS) { HK_GRID_DEP(); st_mm_body<2, 2>(ST_MM_PASS); }

// ---- Hopper: the warpgroup product (wgmma, sm_90a) ------------------------------------
//
// Rows 17 to 128 on a device of compute capability 9.0 (NVRTC builds for
// sm_90a there). The product is the same one the kernels above compute, with
// the operands' roles swapped: D^T = W^T X^T, so a warpgroup's 64 "rows" are
// 64 output columns (4 weight tiles, one a warp) and its N "columns" are the
// batch's rows. A weight tile as packed (kernels/src/step.rs's b_index) is
// already the A fragment of a 16-row slice of W^T: registers (x, z, y, w) of
// the B-fragment uint4 are the A fragment's (a0, a1, a2, a3). So weights go
// from memory straight into registers, read once, and the activations, shared
// by every column of the block, go through shared memory once a block, where
// the tensor cores read them without the register file (the mma.sync kernels
// load every A fragment into every warp that uses it; that is what held them
// at a fifth of the copy rate with 88 rows, benches/README.md).
//
// Shared memory holds the activations of a k-step as the descriptor's
// K-major core matrices with no swizzle: rows 8j .. 8j + 7 and k 8c .. 8c + 7
// (16 bytes a row) at byte offset j * 256 + c * 128, so LBO (the next core
// matrix along k) is 128 and SBO (the next along the rows) 256: a packed A
// tile (st_a_at) as it is, copied 16 bytes a lane. (Packed as mma.sync
// fragments, lane by lane, it took four 4-byte copies a lane and tile.)
//
// Per element, a k-step adds x_hi w_hi, then x_lo w_hi (terms >= 2), then
// x_hi w_lo (terms = 3), k-steps in increasing order, exactly as
// ST_MMA_KSTEP does; cuda_check holds its rows bit for bit against
// st_mm_few's and st_mm's at every row count.

// Present where prelude.h's wgmma helpers are (HK_WGMMA: an sm_90a pass, and
// nvcc's host pass for the probes); absent from every other build.
#ifdef HK_WGMMA
#define ST_WG 1

// d[16] += W^T slice (a: (x, z, y, w) of a packed weight tile) . X^T (desc).
static __device__ __forceinline__ void st_wgmma_n32(float* d, uint4 w, unsigned long long desc) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %21, 0; wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0; }"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(w.x), "r"(w.z), "r"(w.y), "r"(w.w), "l"(desc), "r"(1) : "memory");
}
static __device__ __forceinline__ void st_wg_hold_n32(float* d) {
#pragma unroll
    for (int i = 0; i < 16; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// d[32] += W^T slice (a: (x, z, y, w) of a packed weight tile) . X^T (desc).
static __device__ __forceinline__ void st_wgmma_n64(float* d, uint4 w, unsigned long long desc) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %37, 0; wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0; }"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(w.x), "r"(w.z), "r"(w.y), "r"(w.w), "l"(desc), "r"(1) : "memory");
}
static __device__ __forceinline__ void st_wg_hold_n64(float* d) {
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// d[48] += W^T slice (a: (x, z, y, w) of a packed weight tile) . X^T (desc).
static __device__ __forceinline__ void st_wgmma_n96(float* d, uint4 w, unsigned long long desc) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %53, 0; wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47}, {%48, %49, %50, %51}, %52, p, 1, 1, 0; }"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
                 : "r"(w.x), "r"(w.z), "r"(w.y), "r"(w.w), "l"(desc), "r"(1) : "memory");
}
static __device__ __forceinline__ void st_wg_hold_n96(float* d) {
#pragma unroll
    for (int i = 0; i < 48; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// d[64] += W^T slice (a: (x, z, y, w) of a packed weight tile) . X^T (desc).
static __device__ __forceinline__ void st_wgmma_n128(float* d, uint4 w, unsigned long long desc) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %69, 0; wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0; }"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(w.x), "r"(w.z), "r"(w.y), "r"(w.w), "l"(desc), "r"(1) : "memory");
}
static __device__ __forceinline__ void st_wg_hold_n128(float* d) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d += the slice of W^T in `w` times the activations at `desc`, for NB rows.
template <int NB>
static __device__ __forceinline__ void st_wgmma(float* d, uint4 w, unsigned long long desc) {
    if constexpr (NB == 32) st_wgmma_n32(d, w, desc);
    else if constexpr (NB == 64) st_wgmma_n64(d, w, desc);
    else if constexpr (NB == 96) st_wgmma_n96(d, w, desc);
    else st_wgmma_n128(d, w, desc);
}
template <int NB>
static __device__ __forceinline__ void st_wg_hold(float* d) {
    if constexpr (NB == 32) st_wg_hold_n32(d);
    else if constexpr (NB == 64) st_wg_hold_n64(d);
    else if constexpr (NB == 96) st_wg_hold_n96(d);
    else st_wg_hold_n128(d);
}

// The warpgroup product of one block: 2 warpgroups, 8 column tiles (warp w:
// tile blockIdx.x * 8 + w; warpgroup q: the 64 output columns of tiles 4q ..
// 4q + 3) of one segment of one group, for the NB rows from blockIdx.z * NB.
// The segment goes in chunks of KC k-steps through a ring of D + 1
// shared-memory buffers that cp.async fills D chunks ahead, so that D chunks
// of weights are in flight a block (the copy engine holds them, not
// registers: one chunk in registers at a time held the first version at a
// fifth of the copy rate). A buffer holds the chunk's weight tiles, each
// lane's 16 bytes where that lane reads them back (no barrier needed for
// them), then its activations as core matrices (both planes when terms >= 2),
// which the block shares: one barrier a chunk makes them visible and frees
// the buffer the next copy fills. A warpgroup's tiles past the last column
// multiply zeros (its four warps must all issue each wgmma). Writes the
// segment partials as st_mm does; st_reduce adds them. Launch: grid
// (ceil(nt16 / 8), S * G, ceil(M / NB)); block 256; dynamic shared memory
// (D + 1) KC (8 WP 512 + planes NB 32) bytes (planes: 2 when terms >= 2).
#define ST_WG_THREADS 256
// NW: warps a block (8 in the step; benches/gpu/mm_wg_probe.cu also times 16,
// a block of 4 warpgroups that reads the shared activations once for twice
// the columns).
template <int NB, int WP, int KC, int D, int NW = 8>
static __device__ __forceinline__ void st_mm_wg_body(
    const uint4* __restrict__ A, hk_i64 a_plane, hk_i64 a_group, const uint4* __restrict__ W, hk_i64 w_plane,
    hk_i64 w_group, float* __restrict__ part, hk_i64 part_seg, hk_i64 part_group, int ldp, int M, int nt16, int KT,
    int S, int terms)
{
    constexpr int MTN = NB / 16;
    constexpr int KB = NB * 32;   // bytes of one plane of one k-step's activations
    constexpr int NBUF = D + 1;
    HK_DYN_SMEM(unsigned char, sm);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nt = blockIdx.x * NW + warp;
    const bool active = nt < nt16;
    const int s = blockIdx.y % S, g = blockIdx.y / S;
    const int row0 = blockIdx.z * NB;
    const int left = (M - row0 + 15) >> 4;
    const int mts = left < MTN ? left : MTN;
    const int planes = terms >= 2 ? 2 : 1;
    const int seg = KT / S, kt0 = s * seg, kend = kt0 + seg;
    const int nchunks = (seg + KC - 1) / KC;
    const int ntiles = KC * planes * MTN;
    const int buf_bytes = KC * (NW * WP * 512 + planes * KB);
    const uint4* Ag = A + (hk_i64)g * a_group + (hk_i64)(row0 >> 4) * KT * 32 + lane;
    const uint4* Wt = W + (hk_i64)g * w_group + (hk_i64)(active ? nt : 0) * KT * 32 + lane;

    // Chunk c into buffer c % NBUF: one commit group a chunk (empty past the
    // last), so that the waits count chunks.
    auto load = [&](int c) {
        if (c < nchunks) {
            unsigned char* b = sm + (hk_i64)(c % NBUF) * buf_bytes;
            // This warp's weight tiles: [kk][p], lane's 16 bytes.
#pragma unroll
            for (int kk = 0; kk < KC; ++kk) {
                const int kt = kt0 + c * KC + kk;
                const bool ok = active && kt < kend;
#pragma unroll
                for (int p = 0; p < WP; ++p)
                    hk_cp16(b + ((hk_i64)(warp * KC + kk) * WP + p) * 512 + lane * 16, Wt + (hk_i64)p * w_plane + (hk_i64)(ok ? kt : kt0) * 32, ok);
            }
            // The activations: warp w takes tiles w, w + 8, ...; a packed tile
            // is already the instruction's core matrices (st_a_at), 16 bytes a lane.
            unsigned char* ab = b + KC * NW * WP * 512;
            for (int t = warp; t < ntiles; t += NW) {
                const int kk = t / (planes * MTN), p = (t / MTN) % planes, mt = t % MTN;
                const int kt = kt0 + c * KC + kk;
                const bool ok = kt < kend && mt < mts;
                hk_cp16(ab + (hk_i64)(kk * planes + p) * KB + mt * 512 + lane * 16,
                        Ag + (hk_i64)p * a_plane + ((hk_i64)(ok ? mt : 0) * KT + (ok ? kt : kt0)) * 32, ok);
            }
        }
        hk_cp_commit();
    };

    float d[NB / 2];
#pragma unroll
    for (int i = 0; i < NB / 2; ++i) d[i] = 0.0f;
#pragma unroll
    for (int c = 0; c < D; ++c) load(c);
    // The products of a chunk end before the next chunk's barrier: letting
    // them run on under the next chunk's loads (wait_group 1, a second set of
    // weight registers, one more buffer) measured no faster.
    for (int c = 0; c < nchunks; ++c) {
        hk_cp_wait_n<D - 1>();  // this thread's copies of chunk c are in
        st_proxy_fence();       // ... and visible to the tensor cores
        __syncthreads();        // every thread's; chunk c - 1's buffer is free
        load(c + D);
        const unsigned char* b = sm + (hk_i64)(c % NBUF) * buf_bytes;
        const unsigned char* ab = b + KC * NW * WP * 512;
        uint4 w[KC][WP];
#pragma unroll
        for (int kk = 0; kk < KC; ++kk)
#pragma unroll
            for (int p = 0; p < WP; ++p) w[kk][p] = *(const uint4*)(b + ((hk_i64)(warp * KC + kk) * WP + p) * 512 + lane * 16);
        st_wg_fence();
#pragma unroll
        for (int kk = 0; kk < KC; ++kk) {
            if (c * KC + kk < seg) {
                const unsigned char* x = ab + (hk_i64)kk * planes * KB;
                const unsigned long long dh = st_wg_desc(x);
                st_wgmma<NB>(d, w[kk][0], dh);
                if (terms >= 2) st_wgmma<NB>(d, w[kk][0], st_wg_desc(x + KB));
                if (terms == 3) st_wgmma<NB>(d, w[kk][WP - 1], dh);
            }
        }
        st_wg_commit();
        st_wg_wait0();
        st_wg_hold<NB>(d);
    }
    hk_cp_wait_all();
    if (active) {
        float* pg = part + (hk_i64)s * part_seg + (hk_i64)g * part_group;
        const int gq = lane >> 2, t4 = lane & 3;
#pragma unroll
        for (int j = 0; j < NB / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = row0 + 8 * j + 2 * t4 + (e & 1);
                if (r < M) pg[(hk_i64)r * ldp + nt * 16 + gq + 8 * (e >> 1)] = d[4 * j + e];
            }
    }
}

// The instances the step launches: st_mm_wg<NB>_<WP> (st_mm_few's
// arguments; counters and the epilogue unused: st_reduce follows). One
// weight plane: chunks of 8 k-steps, double-buffered (one chunk in flight),
// the best of the variants timed on the H200 at the step's shapes
// (benches/gpu/mm_wg_probe.cu, benches/README.md session 9). Two planes (f32
// weights): chunks of 2 k-steps, 2 in flight (3 buffers, 86 KB with 96
// rows, so that two blocks fit a multiprocessor), 9 to 11% faster than 4
// k-steps double-buffered at the step's 88-row shapes on an H100 (session
// 25, benches/runs/h100-2026-12-07-s25.txt); on the H200 in session 9 the
// deeper rings it tried kept one block a multiprocessor and were slower.
// Shared memory: (ST_WG_D(WP) + 1) ST_WG_KC(WP) (8 WP 512 + planes NB 32)
// bytes (kernels/src/gpu/step_gpu/launches.rs, wg_smem). Present only in an
// sm_90a build: the Rust side takes st_mm without them.
#define ST_WG_D(WP) ((WP) == 1 ? 1 : 2)
#define ST_WG_KC(WP) ((WP) == 1 ? 8 : 2)
#define ST_MM_WG(NB, WP)                                                                                    \
    extern "C" __global__ void __launch_bounds__(ST_WG_THREADS, 1) st_mm_wg##NB##_##WP(ST_MM_ARGS) {         \
        HK_GRID_DEP();                                                                                      \
        st_mm_wg_body<NB, WP, ST_WG_KC(WP), ST_WG_D(WP)>(A, a_plane, a_group, W, w_plane, w_group, part, part_seg, \
                                                   part_group, ldp, M, nt16, KT, S, terms);                \
    }
ST_MM_WG(32, 1)
ST_MM_WG(64, 1)
ST_MM_WG(96, 1)
ST_MM_WG(128, 1)
ST_MM_WG(32, 2)
ST_MM_WG(64, 2)
ST_MM_WG(96, 2)
ST_MM_WG(128, 2)
#endif  // sm_90a
