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

// st_rms_pack_row and st_inv_rms are in prelude.h (st_reduce_rms in
// step_mm.hip runs the norm too, and HIP compiles each source alone).
extern "C" __global__ void st_rms_pack(
    const float* __restrict__ h, const float* __restrict__ w,
    unsigned short* __restrict__ a, hk_i64 a_plane, int planes, int dim, int akt, float eps)
{
    HK_GRID_DEP();
    __shared__ float red[32];
    st_rms_pack_row(h, w, a, a_plane, planes, dim, akt, eps, blockIdx.x, red);
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
#define ST_CONV_HIST 7  // history rows kept in registers (a conv of width 8 at most)
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
        if (hist <= ST_CONV_HIST) {
            // The history read once, every load before the first use, and
            // shifted from registers: the loop below reads each row again
            // after the store before it, which the compiler may not hoist
            // (the rows could alias), one round trip a row.
            float sv[ST_CONV_HIST];
#pragma unroll
            for (int j = 0; j < ST_CONV_HIST; ++j) sv[j] = j < hist ? st_ld(st + ((hk_i64)j * cr + lc) * eb, dt) : 0.0f;
#pragma unroll
            for (int j = 0; j < ST_CONV_HIST; ++j)
                if (j < hist) acc += wc[j] * sv[j];
            out[(hk_i64)b * C + c] = hk_silu(acc);
#pragma unroll
            for (int j = 0; j + 1 < ST_CONV_HIST; ++j)
                if (j + 1 < hist) st_st(st + ((hk_i64)j * cr + lc) * eb, dt, sv[j + 1]);
        } else {
            for (int j = 0; j < hist; ++j) acc += wc[j] * st_ld(st + ((hk_i64)j * cr + lc) * eb, dt);
            out[(hk_i64)b * C + c] = hk_silu(acc);
            for (int j = 0; j + 1 < hist; ++j)
                st_st(st + ((hk_i64)j * cr + lc) * eb, dt, st_ld(st + ((hk_i64)(j + 1) * cr + lc) * eb, dt));
        }
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
// it + gridDim.x, ... of the live ones. An item's inputs sit behind chains of
// dependent reads (the tick names the slot, the slot the cursor, the cursor
// how many ring records to read), and at one round trip to memory each they
// took most of an item's time (about 9 us an item at B = 88, the state read
// at a quarter of the copy rate). So:
//   - first, one thread an item resolves every item of the block at once
//     (its state and ring addresses, its record count, its beta and decay
//     rate) into shared memory: one chain of reads for the whole launch;
//   - then, while the block computes an item, everything the next one reads
//     is in flight by cp.async into a second set of buffers: its S_0 tile
//     (dk x 64 floats), its q, k, g, dt_bias and value columns, and its ring
//     records (k^, g and this tile's u of each), so that an item computes
//     from shared memory alone.
// Which block takes an item, and whether its inputs came early, changes none
// of its bits: the arithmetic is the same, in the same order.
// Launch: grid (any, 1); block 32 * ceil(dk / 16) (dk <= 128); dynamic
// shared memory st_kda_smem_floats(nw, cap) floats (kernels/src/gpu/step_gpu).
#define ST_KDA_META 32

// Ring records one buffer holds (all of an item's but where cap - 1 exceeds
// ST_KDA_RC; those items stage theirs in the item, ST_KDA_RC at a time).
static __device__ __forceinline__ int st_kda_rcp(int cap) {
    return cap > 0 ? (cap - 1 < ST_KDA_RC ? cap - 1 : ST_KDA_RC) : 0;
}

// Where item it's inputs are, resolved once.
struct StKdaItem {
    const float* S;   // its S_0 (or state) head in the state region
    float* rec0;      // its head's first ring record (null without replay)
    int n;            // records in the ring
    float br;         // beta before the sigmoid
    float rate;       // -exp(a_log[h])
};

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
    const int rcp = st_kda_rcp(cap);
    const int per = 2 * kpad + TILE;  // floats of one staged record
    const int inw = 4 * kpad + TILE;  // q, k, g, dt_bias [kpad each], v [TILE]
    HK_DYN_SMEM(float, smem);
    float* sbuf = smem;                           // [2][kpad][TILE] S_0 tiles
    float* srecs = sbuf + 2 * kpad * TILE;        // [2][rcp][per] ring records
    float* sin = srecs + 2 * rcp * per;           // [2][inw] the item's inputs
    float* al = sin + 2 * inw;
    float* part1 = al + kpad;
    float* part2 = part1 + nw * TILE;
    float* red = part2 + nw * TILE;
    float* stot = red + 2 * nw;
    unsigned long long* mptr = (unsigned long long*)(stot + kpad);  // [ST_KDA_META][2] S, rec0
    int* mn = (int*)(mptr + 2 * ST_KDA_META);
    float* mbr = (float*)(mn + ST_KDA_META);
    float* mrate = mbr + ST_KDA_META;

    const int tid = threadIdx.x;
    const int lane = tid & (HK_WARP - 1);
    const int w = tid / HK_WARP;
    const int tiles = (dv + TILE - 1) / TILE;
    const int items = tick[0] * heads * tiles;
    const int wrec = 2 * dk + dv;
    const hk_i64 rstride = (hk_i64)hl * wrec;
    const int C = heads * (2 * dk + dv);

    auto resolve = [&](int it) -> StKdaItem {
        const int b = it / (heads * tiles);
        const int h = (it / tiles) % heads;
        const int r = h / hl;
        const int lh = h % hl;
        const unsigned long long sl = (unsigned long long)tick[slot + b * tp + r];
        StKdaItem m;
        m.S = (const float*)(rows3[r] + sl * state_stride) + (hk_i64)lh * dk * dv;
        m.rec0 = 0;
        m.n = 0;
        if (cap > 0) {
            m.rec0 = (float*)(rows3[tp + r] + sl * ring_stride) + (hk_i64)lh * wrec;
            int n = *(const int*)(rows3[2 * tp + r] + sl * cursor_stride);
            m.n = n < 0 ? 0 : (n > cap - 1 ? cap - 1 : n);
        }
        m.br = proj[(hk_i64)b * ldproj + b_off + h];
        m.rate = -expf(a_log[h]);
        return m;
    };
    // Item it's (the block's i-th): from the table, or resolved here past it.
    auto item_of = [&](int it, int i) -> StKdaItem {
        if (i < ST_KDA_META) {
            StKdaItem m;
            m.S = (const float*)mptr[2 * i];
            m.rec0 = (float*)mptr[2 * i + 1];
            m.n = mn[i];
            m.br = mbr[i];
            m.rate = mrate[i];
            return m;
        }
        return resolve(it);
    };
    // One thread an item: the table of the block's first ST_KDA_META items.
    {
        const int i = tid;
        const int it = blockIdx.x + i * gridDim.x;
        if (i < ST_KDA_META && it < items) {
            const StKdaItem m = resolve(it);
            mptr[2 * i] = (unsigned long long)m.S;
            mptr[2 * i + 1] = (unsigned long long)m.rec0;
            mn[i] = m.n;
            mbr[i] = m.br;
            mrate[i] = m.rate;
        }
        __syncthreads();
    }

    // n floats from src to dst (zeros from `valid` on, up to `n` rounded up
    // to 4): cp.async in 16-byte pieces where both ends allow, else plain
    // loads and stores (seen after the barrier that follows the group's wait).
    auto copy_in = [&](float* dst, const float* src, int n, int valid) {
        if ((n & 3) == 0 && (valid & 3) == 0 && ((unsigned long long)src & 15ull) == 0) {
            for (int q = tid; q < n / 4; q += blockDim.x) hk_cp16(dst + 4 * q, src + (4 * q < valid ? 4 * q : 0), 4 * q < valid);
        } else {
            for (int e = tid; e < n; e += blockDim.x) dst[e] = e < valid ? src[e] : 0.0f;
        }
    };
    // Every input of item it (the block's i-th) into buffer set `buf`, as one
    // commit group (empty past the last item).
    auto fetch = [&](int it, int i, int buf) {
        if (it < items) {
            const StKdaItem m = item_of(it, i);
            const int b = it / (heads * tiles);
            const int h = (it / tiles) % heads;
            const int col0 = (it % tiles) * TILE;
            float* dst = sbuf + buf * kpad * TILE;
            const float* S = m.S;
            if ((dv & 3) == 0 && ((unsigned long long)S & 15ull) == 0) {
                for (int q = tid; q < kpad * (TILE / 4); q += blockDim.x) {
                    const int i2 = q / (TILE / 4);
                    const int j = col0 + 4 * (q % (TILE / 4));
                    const bool ok = i2 < dk && j < dv;
                    hk_cp16(dst + i2 * TILE + (j - col0), S + (ok ? (hk_i64)i2 * dv + j : 0), ok);
                }
            } else {
                for (int e = tid; e < kpad * TILE; e += blockDim.x) {
                    const int i2 = e / TILE;
                    const int j = col0 + e % TILE;
                    dst[e] = i2 < dk && j < dv ? S[(hk_i64)i2 * dv + j] : 0.0f;
                }
            }
            const float* cvb = cv + (hk_i64)b * C;
            float* in = sin + buf * inw;
            copy_in(in, cvb + h * dk, kpad, dk);
            copy_in(in + kpad, cvb + heads * dk + h * dk, kpad, dk);
            copy_in(in + 2 * kpad, proj + (hk_i64)b * ldproj + g_off + h * dk, kpad, dk);
            copy_in(in + 3 * kpad, dt_bias + (hk_i64)h * dk, kpad, dk);
            const int vcols = dv - col0 < TILE ? dv - col0 : TILE;
            copy_in(in + 4 * kpad, cvb + 2 * heads * dk + h * dv + col0, TILE, vcols);
            if (m.n > 0 && m.n <= rcp) {
                float* srec = srecs + buf * rcp * per;
                for (int j = 0; j < m.n; ++j) {
                    const float* rj = m.rec0 + (hk_i64)j * rstride;
                    copy_in(srec + j * per, rj, kpad, dk);
                    copy_in(srec + j * per + kpad, rj + dk + dv, kpad, dk);
                    copy_in(srec + j * per + 2 * kpad, rj + dk + col0, TILE, vcols);
                }
            }
        }
        hk_cp_commit();
    };

    // One item (the block's i-th), its inputs in buffer set `buf`.
    auto item = [&](int it, int i, int buf) {
        const int b = it / (heads * tiles);
        const int h = (it / tiles) % heads;
        const int col0 = (it % tiles) * TILE;
        const StKdaItem m = item_of(it, i);
        float* S = (float*)m.S;
        const float* tS = sbuf + buf * kpad * TILE;
        float* in = sin + buf * inw;
        float* srec = srecs + buf * rcp * per;
        // q^, k^ and g replace q, k and g in the input buffer (each thread
        // its own channel, after the barrier that ends step 1's reads).
        float* qh = in;
        float* kh = in + kpad;
        float* gs = in + 2 * kpad;

        float s[ST_KDA_ROWS][ST_KDA_COLS];
        st_kda_tile(s, tS, w, lane);

        const float qi = tid < dk ? in[tid] : 0.0f;
        const float ki = tid < dk ? in[kpad + tid] : 0.0f;
        const float gr = tid < dk ? in[2 * kpad + tid] : 0.0f;
        const float br = m.br;
        float vv[ST_KDA_COLS];
    #pragma unroll
        for (int c = 0; c < ST_KDA_COLS; ++c) {
            const int j = col0 + lane + HK_WARP * c;
            vv[c] = j < dv ? in[4 * kpad + lane + HK_WARP * c] : 0.0f;
        }
        const float rate = m.rate;
        const float bias = tid < dk ? in[3 * kpad + tid] : 0.0f;
        const float inv_sqrt_dk = 1.0f / sqrtf((float)dk);

        // ReplaySSM: the committed state S_0 and the n records since.
        float* rec0 = m.rec0;
        const int n = m.n;
        // The records came with the inputs (all of them fit the buffer).
        const bool staged = n <= rcp;

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
        for (int hi = n; hi > 0; hi -= ST_KDA_RC) {
            const int lo = hi > ST_KDA_RC ? hi - ST_KDA_RC : 0;
            if (!staged) {
                if (hi != n) __syncthreads();  // the previous records are consumed
                st_kda_stage(srec, rec0, rstride, lo, hi, kpad, dk, dv, col0);
            }
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
                for (int i2 = lane; i2 < kpad; i2 += HK_WARP) {
                    dk_ = fmaf(rj[i2], kh[i2], dk_);
                    dq_ = fmaf(rj[i2], qh[i2], dq_);
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
        for (int i2 = lane; i2 < kpad; i2 += HK_WARP) kq = fmaf(kh[i2], qh[i2], kq);
        kq = hk_warp_sum(kq);
        // S_0's part.
    #pragma unroll
        for (int rr = 0; rr < ST_KDA_ROWS; ++rr) {
            const int i2 = w * ST_KDA_ROWS + rr;
            const float e = al[i2];
            const float xk = e * kh[i2];
            const float xq = e * qh[i2];
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
        if (rec && col0 == 0 && tid < dk) {
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
                const int i2 = w * ST_KDA_ROWS + rr;
                const float a = al[i2];
                const float kk = kh[i2];
    #pragma unroll
                for (int c = 0; c < ST_KDA_COLS; ++c) s[rr][c] = fmaf(kk, u[c], s[rr][c] * a);
            }
        }
        st_kda_store(s, S, w, lane, col0, dk, dv);
    };

    fetch(blockIdx.x, 0, 0);
    for (int it = blockIdx.x, i = 0; it < items; it += gridDim.x, ++i) {
        fetch(it + gridDim.x, i + 1, (i + 1) & 1);
        hk_cp_wait_but_last();
        __syncthreads();  // item it's inputs are in
        item(it, i, i & 1);
        __syncthreads();  // its buffers are free for the item after next
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

