// Absorbed MLA attention (one latent KV head, rows L + R wide) and the DCP
// LSE merges. CPU reference: kernels/src/cpu/mla.rs. Needs prelude.h in front.
//
// mla_attend_f32 and mla_partial_f64 (every shape): one block per query
// (token x head, or request x head). Its nw warps split
// the query's rows round-robin in groups of MLA_GROUP = 4 consecutive rows
// (warp w takes groups w, w + nw, ...); a warp forms a group's scores with its
// 32 lanes (lane-strided products, then the butterfly of the prelude,
// identical in every lane) and keeps an online softmax: running max m, sum l
// and accumulator acc[L] (in shared memory, lane-strided columns), rescaled
// once per group. At the end the warps' (m, l, acc) merge in warp order. Everything is a fixed order that depends only on the query's own row
// count and the widths: a request's result is the same bits in a batch of any
// size (the ragged partial relies on it). T is float for the f32 ops and
// double for the f64 partials, which form scores, exponentials and sums in f64
// from the f32 inputs, as the CPU does. The f64 partials of K3's row shape
// (L = 512, R = 64, heads a multiple of 8) run mla_partial_tc4/8 below
// instead: all 8 heads of a group per row read, on the f64 tensor cores.

#define MLA_GROUP 4

static __device__ __forceinline__ float hk_exp(float x) { return expf(x); }
static __device__ __forceinline__ double hk_exp(double x) { return exp(x); }
static __device__ __forceinline__ float hk_log(float x) { return logf(x); }
static __device__ __forceinline__ double hk_log(double x) { return log(x); }
static __device__ __forceinline__ float hk_sum32(float x) { return hk_warp_sum(x); }
static __device__ __forceinline__ double hk_sum32(double x) { return hk_warp_sum_d(x); }
template <typename T> static __device__ __forceinline__ T hk_neg_inf();
template <> __device__ __forceinline__ float hk_neg_inf<float>() { return HK_NEG_INF_F; }
template <> __device__ __forceinline__ double hk_neg_inf<double>() { return HK_NEG_INF_D; }

// Shared memory of mla_attend, in T: q [width], acc [nw * L], (m, l) [2 * nw].
// Returns the merged max M and sum l; the merged accumulator of column c is
// mla_merged_acc(.., c, M). With no rows, M = -inf and l = 0.
template <typename T>
static __device__ void mla_attend(
    const float* __restrict__ q, const float* __restrict__ rows, hk_i64 n,
    int L, int width, T scale, T* sq, T* sacc, T* sml, T* M_out, T* l_out)
{
    const int nw = blockDim.x / HK_WARP;
    const int lane = threadIdx.x & (HK_WARP - 1);
    const int w = threadIdx.x / HK_WARP;
    for (int c = threadIdx.x; c < width; c += blockDim.x) sq[c] = (T)q[c];
    for (int c = threadIdx.x; c < nw * L; c += blockDim.x) sacc[c] = (T)0;
    __syncthreads();

    T m = hk_neg_inf<T>();
    T l = (T)0;
    T* acc = sacc + w * L;
    // Warp w takes groups of MLA_GROUP consecutive rows: w, w + nw, ... (in
    // groups). The group's scores are formed together (independent loads and
    // butterflies in flight), then folded into the online softmax at once.
    for (hk_i64 j0 = (hk_i64)w * MLA_GROUP; j0 < n; j0 += (hk_i64)nw * MLA_GROUP) {
        const float* r[MLA_GROUP];
        T d[MLA_GROUP];
#pragma unroll
        for (int g = 0; g < MLA_GROUP; ++g) {
            // Rows past the end re-read the last row (valid memory); their
            // scores are masked to -inf below, so they add exactly 0.
            const hk_i64 j = j0 + g < n ? j0 + g : n - 1;
            r[g] = rows + j * width;
            d[g] = (T)0;
        }
        for (int c = lane; c < width; c += HK_WARP) {
            const T qc = sq[c];
#pragma unroll
            for (int g = 0; g < MLA_GROUP; ++g) d[g] += qc * (T)r[g][c];
        }
        T mg = m;
#pragma unroll
        for (int g = 0; g < MLA_GROUP; ++g) {
            d[g] = j0 + g < n ? hk_sum32(d[g]) * scale : hk_neg_inf<T>();
            mg = d[g] > mg ? d[g] : mg;
        }
        // d and m are the same in every lane, so this is warp-uniform.
        const T f = hk_exp(m - mg);  // 0 on the first group (m = -inf), 1 if the max stays
        T e[MLA_GROUP];
        T esum = (T)0;
#pragma unroll
        for (int g = 0; g < MLA_GROUP; ++g) {
            e[g] = hk_exp(d[g] - mg);  // 0 for masked rows
            esum += e[g];
        }
        l = l * f + esum;
        for (int c = lane; c < L; c += HK_WARP) {
            T a = acc[c] * f;
#pragma unroll
            for (int g = 0; g < MLA_GROUP; ++g) a += e[g] * (T)r[g][c];
            acc[c] = a;
        }
        m = mg;
    }
    if (lane == 0) {
        sml[2 * w] = m;
        sml[2 * w + 1] = l;
    }
    __syncthreads();
    T M = hk_neg_inf<T>();
    for (int x = 0; x < nw; ++x) M = sml[2 * x] > M ? sml[2 * x] : M;
    T lt = (T)0;
    if (M != hk_neg_inf<T>())
        for (int x = 0; x < nw; ++x)
            if (sml[2 * x] != hk_neg_inf<T>()) lt += sml[2 * x + 1] * hk_exp(sml[2 * x] - M);
    *M_out = M;
    *l_out = lt;
}

template <typename T>
static __device__ __forceinline__ T mla_merged_acc(const T* sacc, const T* sml, int L, int c, T M) {
    const int nw = blockDim.x / HK_WARP;
    T a = (T)0;
    for (int x = 0; x < nw; ++x)
        if (sml[2 * x] != hk_neg_inf<T>()) a += sacc[x * L + c] * hk_exp(sml[2 * x] - M);
    return a;
}

// f32 attention for decode (tokens = 1, base = row count) and causal prefill
// (query t sees base + t rows, base = N - T + 1): out [tokens, H, L],
// lse [tokens, H] or null. No rows: out = 0, lse = -inf.
// Launch: grid (tokens * heads); block 32 * nw; dynamic shared memory
// (width + nw * L + 2 * nw) floats.
extern "C" __global__ void mla_attend_f32(
    const float* __restrict__ q_lat,  // [tokens, H, width]
    const float* __restrict__ rows,   // [>= N, width]
    float* __restrict__ out,          // [tokens, H, L]
    float* __restrict__ lse,          // [tokens, H] or null
    int heads, int L, int width, hk_i64 base, float scale)
{
    HK_DYN_SMEM(float, smem);
    const int nw = blockDim.x / HK_WARP;
    float* sq = smem;
    float* sacc = sq + width;
    float* sml = sacc + nw * L;
    const hk_i64 th = blockIdx.x;
    const hk_i64 n = base + th / heads;
    float M, lt;
    mla_attend<float>(q_lat + th * width, rows, n, L, width, scale, sq, sacc, sml, &M, &lt);
    const bool empty = M == HK_NEG_INF_F;
    const float inv = 1.0f / lt;
    for (int c = threadIdx.x; c < L; c += blockDim.x)
        out[th * L + c] = empty ? 0.0f : mla_merged_acc<float>(sacc, sml, L, c, M) * inv;
    if (lse && threadIdx.x == 0) lse[th] = empty ? HK_NEG_INF_F : M + logf(lt);
}

// f64 partials (m, l, acc[L]) per (request, head). Request b owns rows
// starts[b] .. starts[b+1]; with starts null there is one request of `count`
// rows from row 0 (mla_decode_partial).
// Launch: grid (B * heads); block 32 * nw; dynamic shared memory
// (width + nw * L + 2 * nw) doubles.
extern "C" __global__ void mla_partial_f64(
    const float* __restrict__ q_lat,              // [B, H, width]
    const float* __restrict__ rows,               // [sum counts, width]
    const unsigned long long* __restrict__ starts,  // [B + 1] or null
    double* __restrict__ partial,                 // [B, H, 2 + L]
    int heads, int L, int width, hk_i64 count, double scale)
{
    HK_DYN_SMEM(double, smem);
    const int nw = blockDim.x / HK_WARP;
    double* sq = smem;
    double* sacc = sq + width;
    double* sml = sacc + nw * L;
    const hk_i64 bh = blockIdx.x;
    const hk_i64 b = bh / heads;
    hk_i64 r0 = 0, n = count;
    if (starts) {
        r0 = (hk_i64)starts[b];
        n = (hk_i64)starts[b + 1] - r0;
    }
    double M, lt;
    mla_attend<double>(q_lat + bh * width, rows + r0 * width, n, L, width, scale, sq, sacc, sml, &M, &lt);
    double* p = partial + bh * (L + 2);
    for (int c = threadIdx.x; c < L; c += blockDim.x)
        p[2 + c] = M == HK_NEG_INF_D ? 0.0 : mla_merged_acc<double>(sacc, sml, L, c, M);
    if (threadIdx.x == 0) {
        p[0] = M;
        p[1] = lt;
    }
}

// ---- f64 partials on the tensor cores (L = 512, R = 64, heads in groups of 8)
//
// The K3 shape of mla_partial_f64, with each row read from memory once for
// every head of a group of 8 (the M of the f64 MMA, m8n8k4). The rows of a
// request are cut into chunks of `chunk` rows (request-local: chunk c is rows
// c * chunk .. of the request, whatever the batch); one block per (chunk, head
// group) computes the chunk's (m, l, acc) for its 8 heads, and
// mla_chunk_merge_f64 merges a request's chunks in chunk order. A request's
// bits depend only on its own rows, count and the chunk size: batch invariant.
//
// A block of MLA_TC_NW warps walks its chunk in tiles of MLA_TC_TILE = 16 rows,
// each tile copied to shared memory once (cp.async, double buffered, 16-byte
// pieces XOR-swizzled so both fragment reads below are free of bank
// conflicts). Per tile:
//   1. scores S = Q . R^T (8 heads x 16 rows, K = 576): warp w takes the
//      column blocks of 16 jb = w, w + NW, ..; its Q fragments stay in
//      registers for the whole chunk. Products and sums are f64 (the f32 rows
//      converted exactly); four accumulator chains per 8 rows, added in order.
//   2. the warps' partial scores are added in warp order and scaled; 128
//      threads (one per head x row) update the running max, form e = exp(s - m)
//      and the rescale factor f = exp(m_old - m) in f64, and the sum l (a
//      16-lane butterfly, then l = l * f + sum).
//   3. acc = acc * f + P . R[:, :L] (8 heads x 512 columns, K = 16 rows): warp
//      w owns the 32-column groups w, w + NW, ..; acc stays in registers.
// Every sum has a fixed order; no atomics.

#define MLA_TC_L 512
#define MLA_TC_W 576
#define MLA_TC_TILE 16
#define MLA_TC_NBLK (MLA_TC_W / 16)  // column blocks of 16: the score GEMM's K in pieces
#define MLA_TC_CH (MLA_TC_W / 4)     // 16-byte pieces of a row
#define MLA_TC_SP 20                 // row stride (doubles) of the score and weight tiles

// Shared memory of mla_partial_tc<NW, NS> (f32 tiles, a ring of NS) and of
// st_mla_part_tc (16-bit tiles, two), in bytes.
#define MLA_TC_SMEM_RING(nw, eb, ns) ((((nw) * 8 + 8) * MLA_TC_SP + 8) * 8 + (ns) * MLA_TC_TILE * MLA_TC_W * (eb))
#define MLA_TC_SMEM_ELEM(nw, eb) MLA_TC_SMEM_RING(nw, eb, 2)
#define MLA_TC_SMEM(nw) MLA_TC_SMEM_ELEM(nw, 4)

// D = A . B + C for one 8x8x4 f64 tile of a warp: lane holds a = A[lane / 4][lane % 4],
// b = B[lane % 4][lane / 4], c0, c1 = C[lane / 4][2 * (lane % 4) + {0, 1}].
static __device__ __forceinline__ void hk_dmma(double& c0, double& c1, double a, double b) {
#ifdef __HIPCC__
    // Same product, by shuffles (the HIP build is compiled, not run).
    const int lane = threadIdx.x & 31;
    const int m = lane >> 2, n0 = 2 * (lane & 3);
    for (int k = 0; k < 4; ++k) {
        const double ak = HK_SHFL_IDX(a, 4 * m + k);
        const double b0 = HK_SHFL_IDX(b, 4 * n0 + k);
        const double b1 = HK_SHFL_IDX(b, 4 * (n0 + 1) + k);
        c0 = fma(ak, b0, c0);
        c1 = fma(ak, b1, c1);
    }
#else
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
        : "+d"(c0), "+d"(c1)
        : "d"(a), "d"(b));
#endif
}

// Position (in 16-byte pieces) of piece c of tile row r.
static __device__ __forceinline__ int mla_tc_pos(int r, int c) { return c ^ (((r & 1) << 2) | (r & 2)); }

// Tile rows row0 .. row0 + 15 of a chunk of n rows (past n: zeros).
static __device__ __forceinline__ void mla_tc_load(float* dst, const float* src, hk_i64 n, hk_i64 row0) {
    for (int q = threadIdx.x; q < MLA_TC_TILE * MLA_TC_CH; q += blockDim.x) {
        const int r = q / MLA_TC_CH;
        const int c = q - r * MLA_TC_CH;
        const hk_i64 g = row0 + r;
        const bool valid = g < n;
        hk_cp16(dst + r * MLA_TC_W + 4 * mla_tc_pos(r, c), src + (valid ? g : 0) * MLA_TC_W + 4 * c, valid);
    }
}

// Where a chunk's rows come from: `Src` fills a ring of NS row tiles
// (TILE_BYTES each, in the source's own element type) and reads them back;
// NS - 1 tiles are in flight while the math reads the oldest.
//   start(sR)      tiles 0 .. NS - 2 into buffers 0 .. NS - 2, one cp.async
//                  group each
//   wait()         the oldest group begun is in (at most NS - 2 pending)
//   begin(sR, t)   starts tile t into buffer t % NS (after the barrier that
//                  freed it); one group, empty past the chunk's last tile,
//                  so that the waits count tiles
//   land(sR, t)    finishes tile t (register-staged sources store it here;
//                  the next barrier publishes it)
//   ld4(tile, r, c)  columns 4c .. 4c + 3 of tile row r, widened to f32
// The math below is one code for every source and ring depth, so a chunk's
// partial is the same bits wherever its rows live and however many tiles
// were in flight.
//
// Contiguous f32 rows (the ragged partial of the generic path): cp.async.
// Two tiles in a ring let two blocks share a multiprocessor (many chunks);
// four keep three tiles in flight for a launch of about one block a
// multiprocessor (one long request), whose blocks otherwise wait on each
// tile's load in turn.
template <int NS_>
struct MlaRowsF32 {
    static constexpr int NS = NS_;
    static constexpr int TILE_BYTES = MLA_TC_TILE * MLA_TC_W * 4;
    const float* rb;
    hk_i64 n;
    __device__ void start(unsigned char* sR) {
#pragma unroll
        for (int t = 0; t < NS - 1; ++t) begin(sR, t);
    }
    __device__ void wait() { hk_cp_wait_n<NS - 2>(); }
    __device__ void begin(unsigned char* sR, int t) {
        if ((hk_i64)t * MLA_TC_TILE < n) mla_tc_load((float*)(sR + (t % NS) * TILE_BYTES), rb, n, (hk_i64)t * MLA_TC_TILE);
        hk_cp_commit();
    }
    __device__ void land(unsigned char*, int) {}
    __device__ float4 ld4(const unsigned char* tile, int r, int c) const {
        return *(const float4*)((const float*)tile + r * MLA_TC_W + 4 * mla_tc_pos(r, c));
    }
};

// The chunk's partial (m, l, acc) for heads h0 .. h0 + 7 of request b over
// n rows from `src`, written to p (head x at p + x * head_stride).
template <int NW, typename Src>
static __device__ __forceinline__ void mla_partial_tc_body(
    const float* __restrict__ q_lat, Src& src, hk_i64 n, hk_i64 b, int h0,
    double* __restrict__ p, hk_i64 head_stride, int heads, double scale, double* smem)
{
    constexpr int W = MLA_TC_W;
    constexpr int L = MLA_TC_L;
    constexpr int T = MLA_TC_TILE;
    constexpr int SP = MLA_TC_SP;
    constexpr int KB = (MLA_TC_NBLK + NW - 1) / NW;  // score column blocks per warp
    constexpr int UB = L / (32 * NW);                // 32-column groups of acc per warp
    double* sS = smem;              // [NW][8][SP] the warps' partial scores
    double* sP = sS + NW * 8 * SP;  // [8][SP] e of the tile
    double* sF = sP + 8 * SP;       // [8] rescale factor of the tile
    unsigned char* sR = (unsigned char*)(sF + 8);  // [2] row tiles (Src's layout)

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int w = tid >> 5;
    const int g4 = lane >> 2;  // fragment row: head (A, C) or column (B)
    const int k4 = lane & 3;   // fragment k
    const int ntiles = (int)((n + T - 1) / T);

    src.start(sR);

    // Q fragments: qa[t][i] = q[h0 + g4][16 jb + 4 k4 + i], jb = w + NW t.
    double qa[KB][4];
    const float* qh = q_lat + ((b * heads) + h0 + g4) * (hk_i64)W;
#pragma unroll
    for (int t = 0; t < KB; ++t) {
        const int jb = w + NW * t;
        if (MLA_TC_NBLK % NW == 0 || jb < MLA_TC_NBLK) {
            const float4 v = *(const float4*)(qh + 16 * jb + 4 * k4);
            qa[t][0] = (double)v.x;
            qa[t][1] = (double)v.y;
            qa[t][2] = (double)v.z;
            qa[t][3] = (double)v.w;
        } else {
            qa[t][0] = qa[t][1] = qa[t][2] = qa[t][3] = 0.0;
        }
    }
    // acc[u][i][j] = acc[h0 + g4][32 (w + NW u) + 4 (2 k4 + j) + i].
    double acc[UB][4][2];
#pragma unroll
    for (int u = 0; u < UB; ++u)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[u][i][0] = acc[u][i][1] = 0.0;
    double m_run = HK_NEG_INF_D;  // softmax threads (tid < 128): head tid / 16
    double l_run = 0.0;

    for (int it = 0; it < ntiles; ++it) {
        src.wait();
        __syncthreads();  // tile it is in; every warp is done with tile it - 1
        src.begin(sR, it + Src::NS - 1);  // into tile it - 1's buffer
        const unsigned char* tR = sR + (it % Src::NS) * Src::TILE_BYTES;

        // 1. Partial scores over this warp's column blocks.
        double c[2][2][2];
#pragma unroll
        for (int g = 0; g < 2; ++g)
#pragma unroll
            for (int i = 0; i < 2; ++i) c[g][i][0] = c[g][i][1] = 0.0;
#pragma unroll
        for (int t = 0; t < KB; ++t) {
            const int jb = w + NW * t;
            if (MLA_TC_NBLK % NW == 0 || jb < MLA_TC_NBLK) {
#pragma unroll
                for (int g = 0; g < 2; ++g) {
                    const int r = 8 * g + g4;
                    const float4 v = src.ld4(tR, r, 4 * jb + k4);
                    hk_dmma(c[g][0][0], c[g][0][1], qa[t][0], (double)v.x);
                    hk_dmma(c[g][1][0], c[g][1][1], qa[t][1], (double)v.y);
                    hk_dmma(c[g][0][0], c[g][0][1], qa[t][2], (double)v.z);
                    hk_dmma(c[g][1][0], c[g][1][1], qa[t][3], (double)v.w);
                }
            }
        }
#pragma unroll
        for (int g = 0; g < 2; ++g)
#pragma unroll
            for (int j = 0; j < 2; ++j)
                sS[(w * 8 + g4) * SP + 8 * g + 2 * k4 + j] = c[g][0][j] + c[g][1][j];
        __syncthreads();

        // 2. Online softmax of the tile, one thread per (head, row).
        if (tid < 8 * T) {
            const int hh = tid >> 4;
            const int r = tid & 15;
            double s = sS[hh * SP + r];
#pragma unroll
            for (int x = 1; x < NW; ++x) s += sS[(x * 8 + hh) * SP + r];
            s = (hk_i64)it * T + r < n ? s * scale : HK_NEG_INF_D;
            double mx = s;
#pragma unroll
            for (int o = 8; o >= 1; o >>= 1) {
                const double y = HK_SHFL_XOR(mx, o);
                mx = y > mx ? y : mx;
            }
            const double mnew = mx > m_run ? mx : m_run;
            const double e = exp(s - mnew);  // 0 for rows past the end
            const double f = exp(m_run - mnew);  // 0 on the first tile, 1 if the max stays
            double es = e;
#pragma unroll
            for (int o = 8; o >= 1; o >>= 1) es += HK_SHFL_XOR(es, o);  // same bits in the 16 lanes
            l_run = l_run * f + es;
            m_run = mnew;
            sP[hh * SP + r] = e;
            if (r == 0) sF[hh] = f;
        }
        __syncthreads();

        // 3. acc = acc * f + P . R.
        const double f = sF[g4];
        if (HK_ANY(f != 1.0)) {
#pragma unroll
            for (int u = 0; u < UB; ++u)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    acc[u][i][0] *= f;
                    acc[u][i][1] *= f;
                }
        }
#pragma unroll
        for (int s4 = 0; s4 < T / 4; ++s4) {
            const int r = 4 * s4 + k4;
            const double a = sP[g4 * SP + r];
#pragma unroll
            for (int u = 0; u < UB; ++u) {
                const float4 v = src.ld4(tR, r, 8 * (w + NW * u) + g4);
                hk_dmma(acc[u][0][0], acc[u][0][1], a, (double)v.x);
                hk_dmma(acc[u][1][0], acc[u][1][1], a, (double)v.y);
                hk_dmma(acc[u][2][0], acc[u][2][1], a, (double)v.z);
                hk_dmma(acc[u][3][0], acc[u][3][1], a, (double)v.w);
            }
        }
        if (it + 1 < ntiles) src.land(sR, it + 1);
    }

    if (tid < 8 * T && (tid & 15) == 0) {
        p[(tid >> 4) * head_stride] = m_run;
        p[(tid >> 4) * head_stride + 1] = l_run;
    }
#pragma unroll
    for (int u = 0; u < UB; ++u)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j)
                p[g4 * head_stride + 2 + 32 * (w + NW * u) + 4 * (2 * k4 + j) + i] = acc[u][i][j];
}

// work: [chunks, 3] (first row of the chunk in `rows`, its row count, request);
// parts: [chunks, H, 2 + L]. Launch: grid (chunks, H / 8); block 32 * NW;
// dynamic shared memory MLA_TC_SMEM_RING(NW, 4, NS).
template <int NW, int NS = 2>
static __device__ __forceinline__ void mla_partial_tc(
    const float* __restrict__ q_lat, const float* __restrict__ rows, const hk_i64* __restrict__ work,
    double* __restrict__ parts, int heads, double scale, double* smem)
{
    const hk_i64 chunk = blockIdx.x;
    MlaRowsF32<NS> src{rows + work[3 * chunk] * MLA_TC_W, work[3 * chunk + 1]};
    const int h0 = blockIdx.y * 8;
    mla_partial_tc_body<NW>(q_lat, src, src.n, work[3 * chunk + 2], h0, parts + (chunk * heads + h0) * (MLA_TC_L + 2),
                            MLA_TC_L + 2, heads, scale, smem);
}

extern "C" __global__ void __launch_bounds__(128, 2) mla_partial_tc4(
    const float* __restrict__ q_lat, const float* __restrict__ rows, const hk_i64* __restrict__ work,
    double* __restrict__ parts, int heads, double scale)
{
    HK_DYN_SMEM(double, smem);
    mla_partial_tc<4>(q_lat, rows, work, parts, heads, scale, smem);
}

extern "C" __global__ void __launch_bounds__(256) mla_partial_tc8(
    const float* __restrict__ q_lat, const float* __restrict__ rows, const hk_i64* __restrict__ work,
    double* __restrict__ parts, int heads, double scale)
{
    HK_DYN_SMEM(double, smem);
    mla_partial_tc<8>(q_lat, rows, work, parts, heads, scale, smem);
}

// mla_partial_tc8 with a ring of four tiles (three in flight), one block a
// multiprocessor: for launches of about as many blocks as multiprocessors.
// Same math, same bits. Dynamic shared memory MLA_TC_SMEM_RING(8, 4, 4).
extern "C" __global__ void __launch_bounds__(256, 1) mla_partial_tc8_deep(
    const float* __restrict__ q_lat, const float* __restrict__ rows, const hk_i64* __restrict__ work,
    double* __restrict__ parts, int heads, double scale)
{
    HK_DYN_SMEM(double, smem);
    mla_partial_tc<8, 4>(q_lat, rows, work, parts, heads, scale, smem);
}

// Merge of each request's chunk partials (mla_partial_tc*): M = max m_c,
// l = sum l_c e^(m_c - M), acc = sum acc_c e^(m_c - M). A request of no
// chunks (no rows) gets m = -inf, l = 0, acc = 0.
// One block a (request, head) and 32 columns; its 256 threads are 32 columns
// x 8 slices, slice s taking chunks s, s + 8, s + 16, .. of each window of
// 256 chunks in order (eight loads in flight a thread), then the eight slice sums are added in slice
// order. The order depends on the request's chunk count only (batch
// invariant), and a long request (hundreds of chunks) is merged by L / 32
// blocks in a few round trips, not one chunk after another. The max is
// order-free. cstart: [B + 1] first chunk of each request; parts [chunks, H,
// 2 + L]; partial [B, H, 2 + L]. Launch: grid (B * heads, ceil(L / 32));
// block MLA_MERGE_THREADS.
#define MLA_MERGE_THREADS 256
#define MLA_MERGE_COLS 32
#define MLA_MERGE_SLICES (MLA_MERGE_THREADS / MLA_MERGE_COLS)
#define MLA_MERGE_U 8
extern "C" __global__ void __launch_bounds__(MLA_MERGE_THREADS) mla_chunk_merge_f64(
    const double* __restrict__ parts, const hk_i64* __restrict__ cstart, double* __restrict__ partial,
    int heads, int L)
{
    __shared__ double smax[MLA_MERGE_THREADS];  // the max, then a window's weights
    __shared__ double sl[MLA_MERGE_THREADS];    // a window's l_c, then the slices' l sums
    __shared__ double sacc[MLA_MERGE_SLICES][MLA_MERGE_COLS];
    const hk_i64 bh = blockIdx.x;
    const hk_i64 b = bh / heads;
    const hk_i64 h = bh - b * heads;
    const hk_i64 c0 = cstart[b];
    const hk_i64 nc = cstart[b + 1] - c0;
    const int pw = L + 2;
    const double* base = parts + (c0 * heads + h) * pw;
    const hk_i64 cs = (hk_i64)heads * pw;  // stride between chunks
    const int tid = threadIdx.x;
    double M = HK_NEG_INF_D;
    for (hk_i64 c = tid; c < nc; c += MLA_MERGE_THREADS) {
        const double x = base[c * cs];
        M = x > M ? x : M;
    }
    smax[tid] = M;
    __syncthreads();
    M = HK_NEG_INF_D;
    for (int x = 0; x < MLA_MERGE_THREADS; ++x) M = smax[x] > M ? smax[x] : M;
    const int cl = tid % MLA_MERGE_COLS;
    const int sc = tid / MLA_MERGE_COLS;
    const int col = blockIdx.y * MLA_MERGE_COLS + cl;
    const bool has = col < L;
    const bool lead = blockIdx.y == 0 && cl == 0;  // also sums l for its slice
    double a = 0.0;
    double lt = 0.0;
    const double* pcol = base + 2 + (has ? col : 0);
    // Windows of 256 chunks: each thread weighs one (e^(m_c - M) and l_c into
    // shared memory), then slice sc adds the window's chunks sc, sc + 8, ...
    for (hk_i64 w0 = 0; w0 < nc; w0 += MLA_MERGE_THREADS) {
        const int wn = (int)(nc - w0 < MLA_MERGE_THREADS ? nc - w0 : MLA_MERGE_THREADS);
        __syncthreads();  // the previous window's weights are used
        if (tid < wn) {
            const double* pc = base + (w0 + tid) * cs;
            const double mc = pc[0];
            smax[tid] = mc == HK_NEG_INF_D ? 0.0 : exp(mc - M);
            sl[tid] = pc[1];
        }
        __syncthreads();
        for (int x = sc; x < wn; x += MLA_MERGE_SLICES * MLA_MERGE_U) {
            double v[MLA_MERGE_U];
#pragma unroll
            for (int u = 0; u < MLA_MERGE_U; ++u) {
                const int xu = x + u * MLA_MERGE_SLICES;
                v[u] = xu < wn ? pcol[(w0 + xu) * cs] : 0.0;
            }
#pragma unroll
            for (int u = 0; u < MLA_MERGE_U; ++u) {
                const int xu = x + u * MLA_MERGE_SLICES;
                if (xu < wn) {
                    a += v[u] * smax[xu];
                    if (lead) lt += sl[xu] * smax[xu];
                }
            }
        }
    }
    __syncthreads();  // smax and sl are free for the slice sums
    sacc[sc][cl] = a;
    if (lead) sl[sc] = lt;
    __syncthreads();
    if (sc != 0) return;
    a = 0.0;
    for (int x = 0; x < MLA_MERGE_SLICES; ++x) a += sacc[x][cl];
    double* p = partial + bh * pw;
    if (has) p[2 + col] = a;
    if (lead) {
        lt = 0.0;
        for (int x = 0; x < MLA_MERGE_SLICES; ++x) lt += sl[x];
        p[0] = M;
        p[1] = lt;
    }
}

// f32 DCP merge of (o, lse) shards [S, H, W], [S, H] -> out [H, W], lse [H].
// Every thread of a head forms the head's max and LSE itself (S is small), in
// shard order; heads whose shards are all -inf give out = 0, lse = -inf.
// Launch: grid (heads); block 128.
extern "C" __global__ void dcp_merge_f32(
    const float* __restrict__ o_shards, const float* __restrict__ lse_shards,
    float* __restrict__ out, float* __restrict__ lse, int shards, int heads, int width)
{
    const int hd = blockIdx.x;
    float m = HK_NEG_INF_F;
    for (int r = 0; r < shards; ++r) {
        const float x = lse_shards[r * heads + hd];
        m = x > m ? x : m;
    }
    float* o = out + (hk_i64)hd * width;
    if (m == HK_NEG_INF_F) {
        for (int c = threadIdx.x; c < width; c += blockDim.x) o[c] = 0.0f;
        if (threadIdx.x == 0) lse[hd] = HK_NEG_INF_F;
        return;
    }
    float sum = 0.0f;
    for (int r = 0; r < shards; ++r) sum += expf(lse_shards[r * heads + hd] - m);
    const float total = m + logf(sum);
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        float a = 0.0f;
        for (int r = 0; r < shards; ++r) {
            const float wgt = expf(lse_shards[r * heads + hd] - total);
            if (wgt != 0.0f) a += wgt * o_shards[((hk_i64)r * heads + hd) * width + c];
        }
        o[c] = a;
    }
    if (threadIdx.x == 0) lse[hd] = total;
}

// f64 DCP merge of partials [S, H, 2 + W] -> out [H, W], lse [H], rounded to
// f32 at the end: M = max m_r, l = sum l_r e^(m_r - M), O = sum acc_r e^(m_r - M) / l.
// Launch: grid (heads); block 128.
extern "C" __global__ void dcp_merge_f64(
    const double* __restrict__ partials, float* __restrict__ out, float* __restrict__ lse,
    int shards, int heads, int width)
{
    const int hd = blockIdx.x;
    const int pw = width + 2;
    double m = HK_NEG_INF_D;
    for (int r = 0; r < shards; ++r) {
        const double x = partials[((hk_i64)r * heads + hd) * pw];
        m = x > m ? x : m;
    }
    float* o = out + (hk_i64)hd * width;
    if (m == HK_NEG_INF_D) {
        for (int c = threadIdx.x; c < width; c += blockDim.x) o[c] = 0.0f;
        if (threadIdx.x == 0) lse[hd] = HK_NEG_INF_F;
        return;
    }
    double total = 0.0;
    for (int r = 0; r < shards; ++r) {
        const double* p = partials + ((hk_i64)r * heads + hd) * pw;
        if (p[0] != HK_NEG_INF_D) total += p[1] * exp(p[0] - m);
    }
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        double a = 0.0;
        for (int r = 0; r < shards; ++r) {
            const double* p = partials + ((hk_i64)r * heads + hd) * pw;
            if (p[0] != HK_NEG_INF_D) a += p[2 + c] * exp(p[0] - m);
        }
        o[c] = (float)(a / total);
    }
    if (threadIdx.x == 0) lse[hd] = (float)(m + log(total));
}

// ---- the fused decode step: attention over the paged rows of the regions ------------
//
// The f64 partials (m, l, acc[L]) of every (request b, head h, DCP member j,
// chunk c): member j of head h's TP group (rank (h / hg) dcp + j) holds the
// request's tokens it owns, its local rows 0 .. n_j - 1 paged through its
// block table; chunk c is local rows c * chunk .. (c + 1) * chunk - 1. A
// chunk's partial depends only on its own rows (batch invariant). st_mla_merge
// merges a (b, h)'s partials in (member, chunk) order, in f64, rounding once at
// the end, as mla.hip's DCP merge does. parts: [(b * H + h) * dcp + j][maxc][2 + L].

// The rows a DCP member of a request holds (layout.rs's owned_tokens).
static __device__ __forceinline__ int st_owned(int tokens, int dcp, int d, int s) {
    const int round = s * dcp;
    const int full = tokens / round;
    const int rem = tokens % round;
    int extra = rem - d * s;
    extra = extra < 0 ? 0 : (extra > s ? s : extra);
    return full * s + extra;
}

// Address of local row lp of (rank rk, request b).
static __device__ __forceinline__ const unsigned char* st_mla_row(
    const int* tick, int blk, int maxblk, int bmax, int rk, int b, int lp, int bs,
    const unsigned long long* mla_rows, hk_i64 block_stride, int tb)
{
    const int bl = tick[blk + (rk * bmax + b) * maxblk + lp / bs];
    return (const unsigned char*)(mla_rows[rk] + (unsigned long long)bl * block_stride) + (hk_i64)(lp % bs) * tb;
}

// 16-bit rows of the rank's mla.kv region, paged through the request's block
// table (the fused decode step, K3's row shape), copied as they are (cp.async,
// no registers held across the tile's math) into 16-bit tiles: a row is 72
// pieces of 16 bytes (8 values), piece c of row r at mla_tc_pos(r, c), which
// keeps both of the math's read patterns at two wavefronts a warp. ld4 widens
// to f32 (bf16 and f16 widen exactly), so the math sees the values the f32
// tiles would hold.
#define MLA_PG_CH (MLA_TC_W / 8)  // 16-byte pieces of a 16-bit row
// A ring of NS_ tiles: NS_ - 1 in flight while the math reads the oldest. A
// paged tile's loads wait on a block-table read first, so one tile in
// flight (NS_ = 2) left each tile's math waiting on its load; with four, a
// 64-row chunk (four tiles) has all its loads issued before its first tile's
// math.
#define MLA_PG_RING 4
template <int NS_>
struct MlaRowsPaged {
    static constexpr int NS = NS_;
    static constexpr int TILE_BYTES = MLA_TC_TILE * MLA_TC_W * 2;
    const int* bt;              // the request's block table on this rank
    const unsigned char* base;  // the rank's mla.kv region
    hk_i64 block_stride;
    int r0, bs, tb, dt;
    hk_i64 n;
    __device__ void load(unsigned char* dst, int t) const {
        for (int q = threadIdx.x; q < MLA_TC_TILE * MLA_PG_CH; q += blockDim.x) {
            const int r = q / MLA_PG_CH;
            const int c = q - r * MLA_PG_CH;
            const hk_i64 g = (hk_i64)t * MLA_TC_TILE + r;
            const bool valid = g < n;
            const int lp = r0 + (valid ? (int)g : 0);
            const unsigned char* src = base + (unsigned long long)bt[lp / bs] * block_stride + (hk_i64)(lp % bs) * tb + 16 * c;
            hk_cp16(dst + r * (MLA_TC_W * 2) + 16 * mla_tc_pos(r, c), src, valid);
        }
    }
    __device__ void start(unsigned char* sR) {
#pragma unroll
        for (int t = 0; t < NS - 1; ++t) begin(sR, t);
    }
    __device__ void wait() { hk_cp_wait_n<NS - 2>(); }
    __device__ void begin(unsigned char* sR, int t) {
        if ((hk_i64)t * MLA_TC_TILE < n) load(sR + (t % NS) * TILE_BYTES, t);
        hk_cp_commit();
    }
    __device__ void land(unsigned char*, int) {}
    __device__ float4 ld4(const unsigned char* tile, int r, int c) const {
        const uint2 u = *(const uint2*)(tile + r * (MLA_TC_W * 2) + 16 * mla_tc_pos(r, c >> 1) + 8 * (c & 1));
        if (dt == 1)
            return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                               __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
        return make_float4(hk_f16_to_f32((unsigned short)(u.x & 0xffffu)), hk_f16_to_f32((unsigned short)(u.x >> 16)),
                           hk_f16_to_f32((unsigned short)(u.y & 0xffffu)), hk_f16_to_f32((unsigned short)(u.y >> 16)));
    }
};

// The fused step's partials on the f64 tensor cores (L = 512, R = 64, 16-bit
// rows, heads in groups of 8 within one TP group): the math of
// mla_partial_tc for each (request, DCP member, chunk, 8 heads). The grid is
// sized for the longest context a step may hold (maxc chunks a member), but
// a tick's requests hold far fewer rows, and one block a possible chunk left
// nine in ten blocks with nothing to do at a 192-token context: at one block
// a multiprocessor (198 registers, 85 KB of tiles) their launches took most
// of the kernel's 133 us at B = 88. So a block walks the possible chunks
// it = blockIdx.x, + gridDim.x, ... in chunk-major order (c, b, j), skipping
// empty ones in a few instructions; the live chunks come first. The 16-bit
// tiles (47 KB a block) and at most 128 registers let two blocks share a
// multiprocessor, so one block's barriers and f64 latencies hide behind the
// other's work. The walk stops after the chunks of the longest live context
// (member 0 owns the most rows of a request), so a short tick does not step
// through the empty chunks of the longest context a step may hold. parts as
// st_mla_part's. Launch: grid (any, H / 8); block 256; dynamic shared memory
// MLA_TC_SMEM_RING(8, 2, MLA_PG_RING).
extern "C" __global__ void __launch_bounds__(256, 2) st_mla_part_tc(
    const float* __restrict__ q_lat, const int* __restrict__ tick, int pos, int blk, int maxblk, int bmax,
    int dcp, int interleave, int bs, int hg,
    const unsigned long long* __restrict__ mla_rows, hk_i64 block_stride, int tb, int dt,
    double* __restrict__ parts, int maxc, int chunk, int heads, double scale)
{
    HK_GRID_DEP();
    HK_DYN_SMEM(double, smem);
    const int h0 = blockIdx.y * 8;
    const int live = tick[0];
    int longest = 0;  // tokens of the longest live request, the same in every lane
    for (int b = threadIdx.x & 31; b < live; b += 32) {
        const int t = tick[pos + b] + 1;
        longest = t > longest ? t : longest;
    }
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) {
        const int t = HK_SHFL_XOR(longest, o);
        longest = t > longest ? t : longest;
    }
    const int cl = (st_owned(longest, dcp, 0, interleave) + chunk - 1) / chunk;
    const int cmax = cl < maxc ? cl : maxc;
    const int items = cmax * live * dcp;
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
        const int j = it % dcp;
        const int b = (it / dcp) % live;
        const int c = it / (dcp * live);
        const int nj = st_owned(tick[pos + b] + 1, dcp, j, interleave);
        const int r0 = c * chunk;
        if (r0 >= nj) continue;  // uniform in the block
        MlaRowsPaged<MLA_PG_RING> src;
        const int rk = (h0 / hg) * dcp + j;
        src.bt = tick + blk + (rk * bmax + b) * maxblk;
        src.base = (const unsigned char*)mla_rows[rk];
        src.block_stride = block_stride;
        src.r0 = r0;
        src.bs = bs;
        src.tb = tb;
        src.dt = dt;
        src.n = nj - r0 < chunk ? nj - r0 : chunk;
        const hk_i64 head_stride = (hk_i64)dcp * maxc * (MLA_TC_L + 2);
        double* p = parts + ((((hk_i64)b * heads + h0) * dcp + j) * maxc + c) * (MLA_TC_L + 2);
        mla_partial_tc_body<8>(q_lat, src, src.n, b, h0, p, head_stride, heads, scale, smem);
        __syncthreads();  // the tiles are free for the next chunk
    }
}

// Scalar f64 partials, every shape: one block per (b, member, chunk, head),
// nw warps taking groups of 4 rows round-robin, an online softmax per warp,
// the warps merged in warp order (mla.hip's mla_attend in f64).
// Launch: grid (bmax * dcp * maxc, H); block 32 * nw; dynamic shared memory
// (W + nw L + 2 nw) doubles.
extern "C" __global__ void st_mla_part(
    const float* __restrict__ q_lat, const int* __restrict__ tick, int pos, int blk, int maxblk, int bmax,
    int dcp, int interleave, int bs, int hg,
    const unsigned long long* __restrict__ mla_rows, hk_i64 block_stride, int tb, int dt,
    double* __restrict__ parts, int maxc, int chunk, int heads, int L, int W, double scale)
{
    HK_GRID_DEP();
    HK_DYN_SMEM(double, smem);
    const int nw = blockDim.x / HK_WARP;
    double* sq = smem;
    double* sacc = sq + W;
    double* sml = sacc + nw * L;
    const int lane = threadIdx.x & (HK_WARP - 1);
    const int w = threadIdx.x / HK_WARP;
    const int c = blockIdx.x % maxc;
    const int j = (blockIdx.x / maxc) % dcp;
    const int b = blockIdx.x / (maxc * dcp);
    const int h = blockIdx.y;
    if (b >= tick[0]) return;
    const int nj = st_owned(tick[pos + b] + 1, dcp, j, interleave);
    const int r0 = c * chunk;
    if (r0 >= nj) return;
    const int n = nj - r0 < chunk ? nj - r0 : chunk;
    const int rk = (h / hg) * dcp + j;
    const int eb = st_ebytes(dt);
    const float* q = q_lat + ((hk_i64)b * heads + h) * W;
    for (int x = threadIdx.x; x < W; x += blockDim.x) sq[x] = (double)q[x];
    for (int x = threadIdx.x; x < nw * L; x += blockDim.x) sacc[x] = 0.0;
    __syncthreads();
    double m = HK_NEG_INF_D;
    double l = 0.0;
    double* acc = sacc + w * L;
    for (int j0 = w * 4; j0 < n; j0 += nw * 4) {
        const unsigned char* rp[4];
        double d4[4];
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            const int jj = j0 + g < n ? j0 + g : n - 1;
            rp[g] = st_mla_row(tick, blk, maxblk, bmax, rk, b, r0 + jj, bs, mla_rows, block_stride, tb);
            d4[g] = 0.0;
        }
        for (int x = lane; x < W; x += HK_WARP) {
            const double qc = sq[x];
#pragma unroll
            for (int g = 0; g < 4; ++g) d4[g] += qc * (double)st_ld(rp[g] + (hk_i64)x * eb, dt);
        }
        double mg = m;
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            d4[g] = j0 + g < n ? hk_warp_sum_d(d4[g]) * scale : HK_NEG_INF_D;
            mg = d4[g] > mg ? d4[g] : mg;
        }
        const double f = exp(m - mg);
        double e4[4];
        double es = 0.0;
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            e4[g] = exp(d4[g] - mg);
            es += e4[g];
        }
        l = l * f + es;
        for (int x = lane; x < L; x += HK_WARP) {
            double a = acc[x] * f;
#pragma unroll
            for (int g = 0; g < 4; ++g) a += e4[g] * (double)st_ld(rp[g] + (hk_i64)x * eb, dt);
            acc[x] = a;
        }
        m = mg;
    }
    if (lane == 0) {
        sml[2 * w] = m;
        sml[2 * w + 1] = l;
    }
    __syncthreads();
    double M = HK_NEG_INF_D;
    for (int x = 0; x < nw; ++x) M = sml[2 * x] > M ? sml[2 * x] : M;
    double lt = 0.0;
    for (int x = 0; x < nw; ++x)
        if (sml[2 * x] != HK_NEG_INF_D) lt += sml[2 * x + 1] * exp(sml[2 * x] - M);
    double* p = parts + ((((hk_i64)b * heads + h) * dcp + j) * maxc + c) * (L + 2);
    for (int x = threadIdx.x; x < L; x += blockDim.x) {
        double a = 0.0;
        for (int y = 0; y < nw; ++y)
            if (sml[2 * y] != HK_NEG_INF_D) a += sacc[y * L + x] * exp(sml[2 * y] - M);
        p[2 + x] = a;
    }
    if (threadIdx.x == 0) {
        p[0] = M;
        p[1] = lt;
    }
}

// Merge of (b, h)'s partials in (member, chunk) order, in f64:
// M = max m, l = sum l e^(m - M), o = (sum acc e^(m - M)) / l rounded to f32,
// written as the A operand of head h's W_UV product (group h). No rows: o = 0.
// Launch: grid (rows * H); block 128.
extern "C" __global__ void st_mla_merge(
    const double* __restrict__ parts, const int* __restrict__ tick, int pos, int dcp, int interleave,
    int maxc, int chunk, int heads, int L,
    unsigned short* __restrict__ a, hk_i64 a_plane, hk_i64 a_group, int planes, int akt)
{
    HK_GRID_DEP();
    const int b = blockIdx.x / heads;
    const int h = blockIdx.x % heads;
    unsigned short* ag = a + (hk_i64)h * a_group;
    if (b >= tick[0]) {
        for (int x = threadIdx.x; x < L; x += blockDim.x) st_pack(ag, a_plane, planes, b, x, akt, 0.0f);
        return;
    }
    const int tokens = tick[pos + b] + 1;
    const double* base = parts + ((hk_i64)b * heads + h) * dcp * maxc * (L + 2);
    double M = HK_NEG_INF_D;
    for (int j = 0; j < dcp; ++j) {
        const int nc = (st_owned(tokens, dcp, j, interleave) + chunk - 1) / chunk;
        for (int c = 0; c < nc; ++c) {
            const double x = base[((hk_i64)j * maxc + c) * (L + 2)];
            M = x > M ? x : M;
        }
    }
    double lt = 0.0;
    double acc[4] = {0.0, 0.0, 0.0, 0.0};  // columns tid + 128 k (L <= 512)
    if (M != HK_NEG_INF_D) {
        for (int j = 0; j < dcp; ++j) {
            const int nc = (st_owned(tokens, dcp, j, interleave) + chunk - 1) / chunk;
            for (int c = 0; c < nc; ++c) {
                const double* p = base + ((hk_i64)j * maxc + c) * (L + 2);
                if (p[0] == HK_NEG_INF_D) continue;
                const double wt = exp(p[0] - M);
                lt += p[1] * wt;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const int col = threadIdx.x + 128 * k;
                    if (col < L) acc[k] += p[2 + col] * wt;
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int col = threadIdx.x + 128 * k;
        if (col < L) st_pack(ag, a_plane, planes, b, col, akt, M == HK_NEG_INF_D ? 0.0f : (float)(acc[k] / lt));
    }
}
