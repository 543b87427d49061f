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
//   - st_reduce adds the segment partials in segment order.
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

#define ST_WARPS 4   // warps per GEMM block, one 16-column tile each
#define ST_MT 4      // 16-row tiles per GEMM block (64 rows)
#define ST_UNROLL 4  // k-steps whose weights are loaded before the first product

// ---- packed operands ----------------------------------------------------------

// bf16 element index of A[m][k] within one plane of a [*, 16 KT] operand.
static __device__ __forceinline__ hk_i64 st_a_at(int m, int k, int KT) {
    const int mt = m >> 4, r = m & 15, kt = k >> 4, c = k & 15;
    const int g = r & 7, rh = r >> 3, ch = c >> 3, cc = c & 7;
    const int lane = g * 4 + (cc >> 1);
    const int reg = rh + 2 * ch;
    return ((((hk_i64)mt * KT + kt) * 32 + lane) * 4 + reg) * 2 + (cc & 1);
}

// Writes x as the A operand element (m, k): its bf16 rounding in plane 0 and,
// with two planes, the bf16 rounding of the rest in plane 1.
static __device__ __forceinline__ void st_pack(
    unsigned short* a, hk_i64 plane, int planes, int m, int k, int KT, float x)
{
    const hk_i64 at = st_a_at(m, k, KT);
    const unsigned short hi = hk_f32_to_bf16(x);
    a[at] = hi;
    if (planes > 1) a[plane + at] = hk_f32_to_bf16(x - hk_bf16_to_f32(hi));
}

// ---- region values --------------------------------------------------------------

// Storage dtype codes: 0 f32, 1 bf16, 2 f16 (kernels/src/dtype.rs).
static __device__ __forceinline__ float st_ld(const unsigned char* p, int dt) {
    if (dt == 0) return *(const float*)p;
    const unsigned short v = *(const unsigned short*)p;
    return dt == 1 ? hk_bf16_to_f32(v) : hk_f16_to_f32(v);
}

static __device__ __forceinline__ void st_st(unsigned char* p, int dt, float x) {
    if (dt == 0) *(float*)p = x;
    else *(unsigned short*)p = dt == 1 ? hk_f32_to_bf16(x) : hk_f32_to_f16(x);
}

static __device__ __forceinline__ int st_ebytes(int dt) { return dt == 0 ? 4 : 2; }

// ---- the tensor-core product --------------------------------------------------------

// c += a . b for one m16n8k16 tile (bf16 in, f32 accumulate).
static __device__ __forceinline__ void st_mma(float* c, uint4 a, unsigned b0, unsigned b1) {
#ifdef __HIPCC__
    // The same product by shuffles, in the PTX fragment layout (the HIP build
    // is compiled, not run; its sum order is its own).
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const unsigned ar[4] = {a.x, a.y, a.z, a.w};
    for (int k = 0; k < 16; ++k) {
        const int src_t = (k & 7) >> 1, hw = k & 1, kh = k >> 3;
        // A[g][k] and A[g + 8][k]: registers kh * 2 + {0, 1} of lane 4g + src_t.
        unsigned a_lo = 0, a_hi = 0;
        for (int q = 0; q < 4; ++q) {
            const unsigned v0 = __shfl(ar[q], g * 4 + src_t, 32);
            if (q == 2 * kh) a_lo = v0;
            if (q == 2 * kh + 1) a_hi = v0;
        }
        const float x0 = hk_bf16_to_f32((unsigned short)(hw ? a_lo >> 16 : a_lo & 0xffffu));
        const float x1 = hk_bf16_to_f32((unsigned short)(hw ? a_hi >> 16 : a_hi & 0xffffu));
        // B[k][2t] and B[k][2t + 1]: register kh of lanes 4 (2t) + src_t and 4 (2t + 1) + src_t.
        const unsigned bsel = kh ? b1 : b0;
        const unsigned y0r = __shfl(bsel, (2 * t) * 4 + src_t, 32);
        const unsigned y1r = __shfl(bsel, (2 * t + 1) * 4 + src_t, 32);
        const float y0 = hk_bf16_to_f32((unsigned short)(hw ? y0r >> 16 : y0r & 0xffffu));
        const float y1 = hk_bf16_to_f32((unsigned short)(hw ? y1r >> 16 : y1r & 0xffffu));
        c[0] = fmaf(x0, y0, c[0]);
        c[1] = fmaf(x0, y1, c[1]);
        c[2] = fmaf(x1, y0, c[2]);
        c[3] = fmaf(x1, y1, c[3]);
    }
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
#endif
}

// Segment partials of out = A . W for G groups (group g: A_g [M, 16 KT] and
// W_g [16 KT, 16 nt16]): part[s][g][m][n] = the products over segment s. A warp
// owns one 16-column tile of one segment of one group for up to 64 rows (the
// block's M-block); terms 1 = x_hi w, 2 = + x_lo w, 3 = + x_hi w_lo.
// Launch: grid (ceil(nt16 / ST_WARPS), S * G, ceil(M / 64)); block 32 * ST_WARPS.
// Pointers and strides in 16-byte units (8 bf16).
extern "C" __global__ void __launch_bounds__(32 * ST_WARPS) st_mm(
    const uint4* __restrict__ A, hk_i64 a_plane, hk_i64 a_group,
    const uint4* __restrict__ W, hk_i64 w_plane, hk_i64 w_group,
    float* __restrict__ part, hk_i64 part_seg, hk_i64 part_group, int ldp,
    int M, int nt16, int KT, int S, int terms)
{
    const int lane = threadIdx.x & 31;
    const int nt = blockIdx.x * ST_WARPS + (threadIdx.x >> 5);
    if (nt >= nt16) return;
    const int s = blockIdx.y % S;
    const int g = blockIdx.y / S;
    const int mb = blockIdx.z;
    const int rows = M - mb * 64;
    const int mts = rows >= 64 ? ST_MT : (rows + 15) >> 4;
    const int seg = KT / S;
    const int kt0 = s * seg;
    const int kend = kt0 + seg;
    const uint4* Wt = W + (hk_i64)g * w_group + (hk_i64)nt * KT * 32 + lane;
    const uint4* At = A + (hk_i64)g * a_group + (hk_i64)(mb * ST_MT) * KT * 32 + lane;

    float acc[ST_MT][2][4];
#pragma unroll
    for (int mt = 0; mt < ST_MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][h][i] = 0.0f;

    for (int kt = kt0; kt < kend; kt += ST_UNROLL) {
        uint4 bh[ST_UNROLL], bl[ST_UNROLL];
#pragma unroll
        for (int u = 0; u < ST_UNROLL; ++u) {
            if (kt + u < kend) {
                bh[u] = Wt[(hk_i64)(kt + u) * 32];
                if (terms == 3) bl[u] = Wt[w_plane + (hk_i64)(kt + u) * 32];
            }
        }
#pragma unroll
        for (int u = 0; u < ST_UNROLL; ++u) {
            if (kt + u >= kend) break;
#pragma unroll
            for (int mt = 0; mt < ST_MT; ++mt) {
                if (mt < mts) {
                    const hk_i64 at = ((hk_i64)mt * KT + kt + u) * 32;
                    const uint4 ah = At[at];
                    st_mma(acc[mt][0], ah, bh[u].x, bh[u].y);
                    st_mma(acc[mt][1], ah, bh[u].z, bh[u].w);
                    if (terms >= 2) {
                        const uint4 al = At[a_plane + at];
                        st_mma(acc[mt][0], al, bh[u].x, bh[u].y);
                        st_mma(acc[mt][1], al, bh[u].z, bh[u].w);
                    }
                    if (terms == 3) {
                        st_mma(acc[mt][0], ah, bl[u].x, bl[u].y);
                        st_mma(acc[mt][1], ah, bl[u].z, bl[u].w);
                    }
                }
            }
        }
    }
    float* p = part + (hk_i64)s * part_seg + (hk_i64)g * part_group;
    const int gq = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < ST_MT; ++mt) {
        if (mt < mts) {
            const int r0 = mb * 64 + mt * 16 + gq;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int col = nt * 16 + h * 8 + 2 * t;
                *(float2*)(p + (hk_i64)r0 * ldp + col) = make_float2(acc[mt][h][0], acc[mt][h][1]);
                *(float2*)(p + (hk_i64)(r0 + 8) * ldp + col) = make_float2(acc[mt][h][2], acc[mt][h][3]);
            }
        }
    }
}

// The segment sum of st_mm's partials in segment order, and what the product
// feeds (mode):
//   0 store     out[m * ldo + g * gcol + n] = sum
//   1 residual  out[m * ldo + n] += sum            (h = h + all-reduce)
//   2 swiglu    silu(sum(n)) * sum(n + N) -> A operand (m, n) of the next product
//               (gate and up side by side, N = the intermediate width), its
//               column n placed in MLP unit n / uw, each unit padded to uwp
//   3 pack      sum -> A operand (m, g * gcol + n) of the next product (gcol:
//               a group's width padded to whole k-steps)
// Launch: grid-stride over G * M * N.
extern "C" __global__ void st_reduce(
    const float* __restrict__ part, hk_i64 part_seg, hk_i64 part_group, int ldp,
    int M, int N, int S, int G, int mode,
    float* __restrict__ out, int ldo, int gcol,
    unsigned short* __restrict__ a, hk_i64 a_plane, int planes, int akt, int uw, int uwp)
{
    const hk_i64 total = (hk_i64)G * M * N;
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (hk_i64)gridDim.x * blockDim.x) {
        const int n = (int)(e % N);
        const int m = (int)((e / N) % M);
        const int g = (int)(e / ((hk_i64)N * M));
        const float* p = part + (hk_i64)g * part_group + (hk_i64)m * ldp + n;
        float v = p[0];
        for (int s = 1; s < S; ++s) v += p[(hk_i64)s * part_seg];
        if (mode == 0) {
            out[(hk_i64)m * ldo + (hk_i64)g * gcol + n] = v;
        } else if (mode == 1) {
            float* o = out + (hk_i64)m * ldo + n;
            *o = *o + v;
        } else if (mode == 2) {
            float u = p[N];
            for (int s = 1; s < S; ++s) u += p[(hk_i64)s * part_seg + N];
            st_pack(a, a_plane, planes, m, (n / uw) * uwp + n % uw, akt, hk_silu(v) * u);
        } else {
            st_pack(a, a_plane, planes, m, g * gcol + n, akt, v);
        }
    }
}

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
// tile), the state tile in registers, read once and written once. The state
// lives in its rank's kda.state region at the request's slot; under
// ReplaySSM that is the committed state S_0, and the block first rebuilds the
// current state from it and the ring's records (replay_commit's arithmetic),
// steps it, appends this token's record (k^, u, g) to the ring, and when the
// ring is then full commits: S_0 := the state rebuilt from S_0 over all the
// records. The cursors are advanced by st_cursor after every layer has run.

#define ST_KDA_ROWS 16
#define ST_KDA_COLS 2
#define ST_KDA_TILE (HK_WARP * ST_KDA_COLS)

// s (S_0 on entry) := exp(G) S_0 + sum_j exp(G - G_j) k_j u_j^T over n ring
// records of this head (oldest first in memory, applied newest first so that
// G - G_j is a suffix sum of g), then, when `local` is set, one more record
// newest of all from shared memory (k^ kl, g gl) and registers (u ul).
static __device__ __forceinline__ void st_kda_rebuild(
    float (&s)[ST_KDA_ROWS][ST_KDA_COLS], const float* __restrict__ rec0, hk_i64 rstride, int n,
    bool local, const float* kl, const float* gl, const float* ul,
    int w, int lane, int col0, int dk, int dv)
{
    float suffix[ST_KDA_ROWS];
#pragma unroll
    for (int r = 0; r < ST_KDA_ROWS; ++r) {
        const int i = w * ST_KDA_ROWS + r;
        float total = 0.0f;
        if (i < dk) {
            for (int j = 0; j < n; ++j) total += rec0[j * rstride + dk + dv + i];
            if (local) total += gl[i];
        }
        const float e = expf(total);
        suffix[r] = 0.0f;
#pragma unroll
        for (int c = 0; c < ST_KDA_COLS; ++c) s[r][c] *= e;
    }
    if (local) {
#pragma unroll
        for (int r = 0; r < ST_KDA_ROWS; ++r) {
            const int i = w * ST_KDA_ROWS + r;
            if (i < dk) {
                const float coef = kl[i];  // expf(0) * k
#pragma unroll
                for (int c = 0; c < ST_KDA_COLS; ++c) s[r][c] += coef * ul[c];
                suffix[r] += gl[i];
            }
        }
    }
    for (int j = n - 1; j >= 0; --j) {
        const float* rj = rec0 + j * rstride;
        float uu[ST_KDA_COLS];
#pragma unroll
        for (int c = 0; c < ST_KDA_COLS; ++c) {
            const int jc = col0 + lane + HK_WARP * c;
            uu[c] = jc < dv ? rj[dk + jc] : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < ST_KDA_ROWS; ++r) {
            const int i = w * ST_KDA_ROWS + r;
            if (i < dk) {
                const float coef = expf(suffix[r]) * rj[i];
#pragma unroll
                for (int c = 0; c < ST_KDA_COLS; ++c) s[r][c] += coef * uu[c];
                suffix[r] += rj[dk + dv + i];
            }
        }
    }
}

static __device__ __forceinline__ void st_kda_load(
    float (&s)[ST_KDA_ROWS][ST_KDA_COLS], const float* S, int w, int lane, int col0, int dk, int dv)
{
#pragma unroll
    for (int r = 0; r < ST_KDA_ROWS; ++r) {
        const int i = w * ST_KDA_ROWS + r;
#pragma unroll
        for (int c = 0; c < ST_KDA_COLS; ++c) {
            const int j = col0 + lane + HK_WARP * c;
            s[r][c] = (i < dk && j < dv) ? S[(hk_i64)i * dv + j] : 0.0f;
        }
    }
}

// q, k, v: the conv outputs cv [rows, C] (full order); g_raw, b_raw and the
// gate in proj; out [rows, H, dv]. rows3: this layer's row addresses of the
// state, ring and cursor regions, [3][tp] (ring and cursor 0 without replay).
// Launch: grid (rows * H, ceil(dv / 64)); block 32 * ceil(dk / 16) (dk <= 128);
// dynamic shared memory (4 kpad + 2 nw 64 + 2 nw) floats, kpad = 16 nw.
extern "C" __global__ void __launch_bounds__(256, 3) st_kda(
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

    // ReplaySSM: the current state from S_0 and the n records so far.
    float* rec0 = 0;
    int n = 0;
    const hk_i64 rstride = (hk_i64)hl * wrec;
    if (cap > 0) {
        rec0 = (float*)(rows3[tp + r] + sl * ring_stride) + (hk_i64)lh * wrec;
        n = *(const int*)(rows3[2 * tp + r] + sl * cursor_stride);
        n = n < 0 ? 0 : (n > cap - 1 ? cap - 1 : n);
        st_kda_rebuild(s, rec0, rstride, n, false, 0, 0, 0, w, lane, col0, dk, dv);
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
    // Steps 2-3: per-channel log decay, alpha, beta.
    if (tid < kpad) {
        if (tid < dk) {
            const float g = rate * hk_softplus(gr + bias);
            qh[tid] = qi * qs;
            kh[tid] = ki * ks;
            gs[tid] = g;
            al[tid] = expf(g);
        } else {
            qh[tid] = kh[tid] = gs[tid] = al[tid] = 0.0f;
        }
    }
    const float beta = hk_sigmoid(br);
    __syncthreads();

    // Steps 4-5: S' = Diag(alpha) S; partial sums of S'^T k^ over the warp's rows.
    float acc[ST_KDA_COLS];
#pragma unroll
    for (int c = 0; c < ST_KDA_COLS; ++c) acc[c] = 0.0f;
#pragma unroll
    for (int rr = 0; rr < ST_KDA_ROWS; ++rr) {
        const int i = w * ST_KDA_ROWS + rr;
        const float a = al[i];
        const float kk = kh[i];
#pragma unroll
        for (int c = 0; c < ST_KDA_COLS; ++c) {
            s[rr][c] *= a;
            acc[c] = fmaf(s[rr][c], kk, acc[c]);
        }
    }
#pragma unroll
    for (int c = 0; c < ST_KDA_COLS; ++c) part1[w * TILE + lane + HK_WARP * c] = acc[c];
    __syncthreads();
    float u[ST_KDA_COLS];
#pragma unroll
    for (int c = 0; c < ST_KDA_COLS; ++c) {
        const int jj = lane + HK_WARP * c;
        float kv = 0.0f;
        for (int x = 0; x < nw; ++x) kv += part1[x * TILE + jj];
        u[c] = col0 + jj < dv ? beta * (vv[c] - kv) : 0.0f;
    }
    // Steps 6-7: S = S' + k^ u^T; partial sums of S^T q^.
#pragma unroll
    for (int c = 0; c < ST_KDA_COLS; ++c) acc[c] = 0.0f;
#pragma unroll
    for (int rr = 0; rr < ST_KDA_ROWS; ++rr) {
        const int i = w * ST_KDA_ROWS + rr;
        const float kk = kh[i];
        const float qq = qh[i];
#pragma unroll
        for (int c = 0; c < ST_KDA_COLS; ++c) {
            s[rr][c] = fmaf(kk, u[c], s[rr][c]);
            acc[c] = fmaf(s[rr][c], qq, acc[c]);
        }
    }
#pragma unroll
    for (int c = 0; c < ST_KDA_COLS; ++c) part2[w * TILE + lane + HK_WARP * c] = acc[c];
    __syncthreads();
    float* rec = cap > 0 ? rec0 + (hk_i64)n * rstride : 0;
    if (w == 0) {
#pragma unroll
        for (int c = 0; c < ST_KDA_COLS; ++c) {
            const int jj = lane + HK_WARP * c;
            const int j = col0 + jj;
            if (j < dv) {
                float o = 0.0f;
                for (int x = 0; x < nw; ++x) o += part2[x * TILE + jj];
                out[((hk_i64)b * heads + h) * dv + j] = o;
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
        st_kda_load(s, S, w, lane, col0, dk, dv);
        st_kda_rebuild(s, rec0, rstride, n, true, kh, gs, u, w, lane, col0, dk, dv);
    }
#pragma unroll
    for (int rr = 0; rr < ST_KDA_ROWS; ++rr) {
        const int i = w * ST_KDA_ROWS + rr;
#pragma unroll
        for (int c = 0; c < ST_KDA_COLS; ++c) {
            const int j = col0 + lane + HK_WARP * c;
            if (i < dk && j < dv) S[(hk_i64)i * dv + j] = s[rr][c];
        }
    }
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

// ---- MLA attention over the paged rows ---------------------------------------------------
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
