// The fused decode step (kernels/src/gpu/step_cuda/ drives it): one fixed
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
// Its dense products are step_mm.hip's (st_mm_few, st_mm, st_reduce).


// ---- embedding, norms, argmax ---------------------------------------------------------

// h[b] = table[token b] (ids outside the vocabulary read row 0; the host
// checks them). Launch: grid (rows); block 256.
extern "C" __global__ void st_embed(
    const float* __restrict__ table, const int* __restrict__ tick, int tok,
    float* __restrict__ h, int dim, int vocab)
{
    HK_GRID_DEP();
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
// k tiles: dim padded to whole k-steps). A row of up to ST_RMS_V x 256
// values is read once into registers, every load issued before the first
// use: the strided loop (load, add, next) waited on each load in turn, twice
// a row, and took 8.5 us a launch for one row of 2048 on the H200. The sums
// are st_inv_rms's, in its order. Launch: grid (rows); block 256.
#define ST_RMS_V 16
extern "C" __global__ void st_rms_pack(
    const float* __restrict__ h, const float* __restrict__ w,
    unsigned short* __restrict__ a, hk_i64 a_plane, int planes, int dim, int akt, float eps)
{
    HK_GRID_DEP();
    __shared__ float red[32];
    const int b = blockIdx.x;
    const float* x = h + (hk_i64)b * dim;
    if (dim > ST_RMS_V * (int)blockDim.x) {
        const float r = st_inv_rms(x, dim, eps, red);
        for (int c = threadIdx.x; c < dim; c += blockDim.x) st_pack(a, a_plane, planes, b, c, akt, x[c] * r * w[c]);
        return;
    }
    float v[ST_RMS_V], g[ST_RMS_V];
#pragma unroll
    for (int i = 0; i < ST_RMS_V; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        v[i] = c < dim ? x[c] : 0.0f;
        g[i] = c < dim ? w[c] : 0.0f;
    }
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < ST_RMS_V; ++i)
        if (threadIdx.x + i * blockDim.x < dim) ss += v[i] * v[i];
    const float r = 1.0f / sqrtf(hk_block_sum(ss, red) / (float)dim + eps);
#pragma unroll
    for (int i = 0; i < ST_RMS_V; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < dim) st_pack(a, a_plane, planes, b, c, akt, v[i] * r * g[i]);
    }
}

// KDA's gated output norm of (row b, head h): rms(o) * w * silu(gate), as the
// A operand (b, h * dvp + j) of o_proj (a head is one reduction unit, padded
// to dvp, whole k-steps). Launch: grid (rows * H); block 128.
extern "C" __global__ void st_gnorm_pack(
    const float* __restrict__ o, const float* __restrict__ proj, int ldproj, int gate_off,
    const float* __restrict__ w, unsigned short* __restrict__ a, hk_i64 a_plane, int planes,
    int heads, int dv, int dvp, float eps)
{
    HK_GRID_DEP();
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
    HK_GRID_DEP();
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
// rows[r]: address of this layer's row in rank r's conv region. One thread a
// (request, channel), the request from the grid's y: no 64-bit division an
// element (the grid-stride form divided by C twice an element).
// Launch: grid (ceil(C / 256), rows); block 256.
extern "C" __global__ void st_conv(
    const float* __restrict__ proj, int ldproj, const float* __restrict__ weight,
    const int* __restrict__ tick, int slot, int tp,
    const unsigned long long* __restrict__ rows, hk_i64 unit_stride, int dt,
    float* __restrict__ out, int bmax, int H, int hl, int dk, int dv, int width)
{
    HK_GRID_DEP();
    const int C = H * (2 * dk + dv);
    const int cr = hl * (2 * dk + dv);
    const int hist = width - 1;
    const int eb = st_ebytes(dt);
    const int b = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (b < tick[0] && c < C) {
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
    const int n = hi - lo;  // <= ST_KDA_RC
    // A thread owns positions x of a record (no division an element) and
    // loads them from every staged record at once, eight in flight: the
    // records are the step's longest chain of dependent reads, so they go in
    // as few round trips as fit.
    for (int x = threadIdx.x; x < per; x += blockDim.x) {
        int src = -1;  // offset in a ring record, -1: a zero past dk or dv
        if (x < kpad) {
            if (x < dk) src = x;
        } else if (x < 2 * kpad) {
            if (x - kpad < dk) src = dk + dv + (x - kpad);
        } else {
            const int jc = col0 + (x - 2 * kpad);
            if (jc < dv) src = dk + jc;
        }
        for (int j0 = 0; j0 < n; j0 += 8) {
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) v[u] = (j0 + u < n && src >= 0) ? rec0[(hk_i64)(lo + j0 + u) * rstride + src] : 0.0f;
#pragma unroll
            for (int u = 0; u < 8; ++u)
                if (j0 + u < n) srec[(j0 + u) * per + x] = v[u];
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

// The warp's key rows of the item's column tile back to the state region (int
// offsets from one base: a head's state is far below 2^31 values).
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

// The warp's key rows of an S_0 tile in shared memory ([kpad][TILE], zeros
// past dk and dv).
static __device__ __forceinline__ void st_kda_tile(float (&s)[ST_KDA_ROWS][ST_KDA_COLS], const float* tS, int w, int lane) {
#pragma unroll
    for (int r = 0; r < ST_KDA_ROWS; ++r)
#pragma unroll
        for (int c = 0; c < ST_KDA_COLS; ++c) s[r][c] = tS[(w * ST_KDA_ROWS + r) * ST_KDA_TILE + lane + HK_WARP * c];
}

// q, k, v: the conv outputs cv [rows, C] (full order); g_raw, b_raw and the
// gate in proj; out [rows, H, dv]. rows3: this layer's row addresses of the
// state, ring and cursor regions, [3][tp] (ring and cursor 0 without replay).
//
// Persistent: a block takes the items (request, head, 64-column tile) it,
// it + gridDim.x, ... of the live ones, and copies the next item's tile of
// S_0 (dk x 64 floats) into shared memory by cp.async while it computes the
// current one, so that the state's bytes stream in under the record walk's
// latency instead of between blocks (one block an item measured 29% of the
// copy rate at B = 88). Which block takes an item changes none of its bits.
// Launch: grid (any, 1); block 32 * ceil(dk / 16) (dk <= 128); dynamic
// shared memory (2 kpad 64 + 4 kpad + 2 nw 64 + 2 nw) floats, kpad = 16 nw,
// and under ReplaySSM (ST_KDA_RC (2 kpad + 64) + kpad) more.
extern "C" __global__ void __launch_bounds__(256, 2) st_kda(
    const float* __restrict__ cv, const float* __restrict__ proj, int ldproj, int g_off, int b_off,
    const float* __restrict__ a_log, const float* __restrict__ dt_bias, float* __restrict__ out,
    const int* __restrict__ tick, int slot, int tp,
    const unsigned long long* __restrict__ rows3, hk_i64 state_stride, hk_i64 ring_stride, hk_i64 cursor_stride,
    int heads, int hl, int dk, int dv, int cap)
{
    HK_GRID_DEP();
    const int TILE = ST_KDA_TILE;
    const int nw = blockDim.x / HK_WARP;
    const int kpad = nw * ST_KDA_ROWS;
    HK_DYN_SMEM(float, smem);
    float* sbuf = smem;                           // [2][kpad][TILE] S_0 tiles
    float* qh = sbuf + 2 * kpad * TILE;
    float* kh = qh + kpad;
    float* gs = kh + kpad;
    float* al = gs + kpad;
    float* part1 = al + kpad;
    float* part2 = part1 + nw * TILE;
    float* red = part2 + nw * TILE;
    float* srec = red + 2 * nw;                   // replay records (ST_KDA_RC at a time)
    float* stot = srec + ST_KDA_RC * (2 * kpad + TILE);

    const int tid = threadIdx.x;
    const int lane = tid & (HK_WARP - 1);
    const int w = tid / HK_WARP;
    const int tiles = (dv + TILE - 1) / TILE;
    const int items = tick[0] * heads * tiles;

    // Item it's state tile: its address in the region, and its copy into dst
    // (zeros past dk and dv; one commit group, empty past the last item).
    auto state_of = [&](int it) -> float* {
        const int b = it / (heads * tiles);
        const int h = (it / tiles) % heads;
        const int r = h / hl;
        const unsigned long long sl = (unsigned long long)tick[slot + b * tp + r];
        return (float*)(rows3[r] + sl * state_stride) + (hk_i64)(h % hl) * dk * dv;
    };
    auto fetch = [&](int it, float* dst) {
        if (it < items) {
            const float* S = state_of(it);
            const int col0 = (it % tiles) * TILE;
            if ((dv & 3) == 0 && ((unsigned long long)S & 15ull) == 0) {
                for (int q = tid; q < kpad * (TILE / 4); q += blockDim.x) {
                    const int i = q / (TILE / 4);
                    const int j = col0 + 4 * (q % (TILE / 4));
                    const bool ok = i < dk && j < dv;
                    hk_cp16(dst + i * TILE + (j - col0), S + (ok ? (hk_i64)i * dv + j : 0), ok);
                }
            } else {
                for (int e = tid; e < kpad * TILE; e += blockDim.x) {
                    const int i = e / TILE;
                    const int j = col0 + e % TILE;
                    dst[e] = i < dk && j < dv ? S[(hk_i64)i * dv + j] : 0.0f;
                }
            }
        }
        hk_cp_commit();
    };

    // One item, its S_0 tile in tS (shared memory).
    auto item = [&](int it, const float* tS) {
        const int b = it / (heads * tiles);
        const int h = (it / tiles) % heads;
        const int col0 = (it % tiles) * TILE;
        const int r = h / hl;
        const int lh = h % hl;
        const unsigned long long sl = (unsigned long long)tick[slot + b * tp + r];
        float* S = state_of(it);
        const int wrec = 2 * dk + dv;

        float s[ST_KDA_ROWS][ST_KDA_COLS];
        st_kda_tile(s, tS, w, lane);

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
            st_kda_tile(s, tS, w, lane);
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
    };

    fetch(blockIdx.x, sbuf);
    for (int it = blockIdx.x, i = 0; it < items; it += gridDim.x, ++i) {
        fetch(it + gridDim.x, sbuf + ((i + 1) & 1) * kpad * TILE);
        hk_cp_wait_but_last();
        __syncthreads();  // item it's tile is in
        item(it, sbuf + (i & 1) * kpad * TILE);
        __syncthreads();  // its buffers are free for the next item
    }
    hk_cp_wait_all();
}

// Advances every live request's ReplaySSM cursor of every KDA layer on every
// rank (one i32 per slot per layer): c + 1, or 0 when the ring committed.
// rows: [layers][tp] row addresses of the cursor region. Launch: grid-stride
// over live * tp * layers.
extern "C" __global__ void st_cursor(
    const int* __restrict__ tick, int slot, int tp, const unsigned long long* __restrict__ rows,
    int layers, hk_i64 unit_stride, int cap)
{
    HK_GRID_DEP();
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
    HK_GRID_DEP();
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

