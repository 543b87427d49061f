// KDA on the device: the recurrent step (batched decode) and prefill, and the
// ReplaySSM ring (append, commit). Math: design.md section 5; CPU reference:
// kernels/src/cpu/kda.rs. Needs prelude.h in front.
//
// Layout of the state work (kda_recurrent and replay_commit). The value
// columns of a head are independent of each other (u_j, the update of column j
// and o_j read only column j of the state), so a head's state [dk, dv] splits
// into column tiles of KDA_TILE = 128 columns, one block per (slot, head, tile).
// Inside a block:
//   - lane l of a warp owns columns l, l + 32, l + 64, l + 96 of the tile, so
//     each load or store instruction of a warp touches 128 contiguous bytes of
//     one state row;
//   - warp w owns the key rows w * 16 .. w * 16 + 15 (KDA_ROWS), so the key
//     dimension is split across nw = ceil(dk / 16) warps and every thread keeps
//     its 16 x 4 state values in registers: 64 independent loads in flight per
//     thread, each state value read once and written once per launch;
//   - the key-dimension sums (S'^T k^ and S^T q^) add a thread's 16 rows in row
//     order, then the warps' partial sums in warp order through shared memory:
//     a fixed order, and a block's work depends only on (dk, dv), so a slot's
//     result is the same bits whatever the batch size.
// dk is limited to 16 * 16 = 256 (16 warps); the Rust side refuses more.

#define KDA_L2_EPS 1e-6f
#define KDA_ROWS 16
#define KDA_COLS 4
#define KDA_TILE (HK_WARP * KDA_COLS)
// Largest block (dk = 256: 16 warps); as a launch bound it caps registers at
// 65536 / 512 = 128 per thread.
#define KDA_MAX_THREADS 512

// Recurrent KDA over `seqs` independent sequences of `tokens` tokens each.
//   decode step: seqs = B, tokens = 1  (inputs [B, H, *], state [B, H, dk, dv])
//   prefill:     seqs = 1, tokens = T  (inputs [T, H, *], state [1, H, dk, dv])
// Row r = seq * tokens + t of the inputs, outputs and records is token t of
// sequence seq. The state stays in registers across the tokens, so a prefill
// reads and writes it once, and its result equals T decode steps exactly.
//
// Launch: grid (seqs * heads, ceil(dv / 128)); block 32 * ceil(dk / 16) threads;
// dynamic shared memory (4 * nw * 16 + nw * 128 + nw) floats, nw = blockDim.x / 32.
static __device__ __forceinline__ void kda_recurrent_body(
    float* __restrict__ state,          // [seqs, H, dk, dv], updated in place
    const float* __restrict__ q,        // [seqs * tokens, H, dk]
    const float* __restrict__ k,        // [seqs * tokens, H, dk]
    const float* __restrict__ v,        // [seqs * tokens, H, dv]
    const float* __restrict__ g_raw,    // [seqs * tokens, H, dk]
    const float* __restrict__ b_raw,    // [seqs * tokens, H]
    const float* __restrict__ a_log,    // [H]
    const float* __restrict__ dt_bias,  // [H, dk]
    float* __restrict__ out,            // [seqs * tokens, H, dv]
    float* __restrict__ record,         // [seqs * tokens, H, 2*dk + dv] or null
    int tokens, int heads, int dk, int dv)
{
    const int nw = blockDim.x / HK_WARP;
    const int kpad = nw * KDA_ROWS;  // key rows covered by the block (>= dk)
    HK_DYN_SMEM(float, smem);
    float* qh = smem;               // [kpad] q^ (0 past dk)
    float* kh = qh + kpad;          // [kpad] k^
    float* gs = kh + kpad;          // [kpad] log decay g
    float* al = gs + kpad;          // [kpad] alpha = exp(g)
    float* part = al + kpad;        // [nw][KDA_TILE] per-warp partial sums
    float* red = part + nw * KDA_TILE;  // [nw] block-sum scratch

    const int sh = blockIdx.x;      // seq * heads + h
    const int seq = sh / heads;
    const int h = sh % heads;
    const int tid = threadIdx.x;
    const int lane = tid & (HK_WARP - 1);
    const int w = tid / HK_WARP;
    const int col0 = blockIdx.y * KDA_TILE;
    const int wrec = 2 * dk + dv;

    float* S = state + (hk_i64)sh * dk * dv;
    float s[KDA_ROWS][KDA_COLS];
    // All loads first (independent), then use: many in flight per thread.
#pragma unroll
    for (int r = 0; r < KDA_ROWS; ++r) {
        const int i = w * KDA_ROWS + r;
#pragma unroll
        for (int c = 0; c < KDA_COLS; ++c) {
            const int j = col0 + lane + HK_WARP * c;
            s[r][c] = (i < dk && j < dv) ? S[(hk_i64)i * dv + j] : 0.0f;
        }
    }
    const float rate = -expf(a_log[h]);
    const float inv_sqrt_dk = 1.0f / sqrtf((float)dk);

    for (int t = 0; t < tokens; ++t) {
        const hk_i64 th = ((hk_i64)seq * tokens + t) * heads + h;
        const float* qb = q + th * dk;
        const float* kb = k + th * dk;
        // Step 1: L2 norms (blockDim >= 2 * dk, so one element per thread).
        const float qi = tid < dk ? qb[tid] : 0.0f;
        const float ki = tid < dk ? kb[tid] : 0.0f;
        const float sq = hk_block_sum(qi * qi, red);
        const float sk = hk_block_sum(ki * ki, red);
        const float qs = 1.0f / sqrtf(sq + KDA_L2_EPS) * inv_sqrt_dk;
        const float ks = 1.0f / sqrtf(sk + KDA_L2_EPS);
        // Steps 2-3: per-channel log decay, alpha, beta.
        if (tid < kpad) {
            if (tid < dk) {
                const float g = rate * hk_softplus(g_raw[th * dk + tid] + dt_bias[(hk_i64)h * dk + tid]);
                qh[tid] = qi * qs;
                kh[tid] = ki * ks;
                gs[tid] = g;
                al[tid] = expf(g);
            } else {
                qh[tid] = 0.0f;
                kh[tid] = 0.0f;
                gs[tid] = 0.0f;
                al[tid] = 0.0f;
            }
        }
        const float beta = hk_sigmoid(b_raw[th]);
        __syncthreads();

        // Steps 4-5: S' = Diag(alpha) S; partial sums of S'^T k^ over this warp's rows.
        float acc[KDA_COLS];
#pragma unroll
        for (int c = 0; c < KDA_COLS; ++c) acc[c] = 0.0f;
#pragma unroll
        for (int r = 0; r < KDA_ROWS; ++r) {
            const int i = w * KDA_ROWS + r;
            const float a = al[i];
            const float kk = kh[i];
#pragma unroll
            for (int c = 0; c < KDA_COLS; ++c) {
                s[r][c] *= a;
                acc[c] = fmaf(s[r][c], kk, acc[c]);
            }
        }
#pragma unroll
        for (int c = 0; c < KDA_COLS; ++c) part[w * KDA_TILE + lane + HK_WARP * c] = acc[c];
        __syncthreads();
        // u = beta (v - S'^T k^): every warp adds the warp partials in warp order
        // (the same bits in every warp), for its own columns.
        float u[KDA_COLS];
        const float* vb = v + th * dv;
#pragma unroll
        for (int c = 0; c < KDA_COLS; ++c) {
            const int jj = lane + HK_WARP * c;
            const int j = col0 + jj;
            float kv = 0.0f;
            for (int x = 0; x < nw; ++x) kv += part[x * KDA_TILE + jj];
            u[c] = j < dv ? beta * (vb[j] - kv) : 0.0f;
        }
        __syncthreads();  // part is reused below

        // Steps 6-7: S = S' + k^ u^T; partial sums of S^T q^.
#pragma unroll
        for (int c = 0; c < KDA_COLS; ++c) acc[c] = 0.0f;
#pragma unroll
        for (int r = 0; r < KDA_ROWS; ++r) {
            const int i = w * KDA_ROWS + r;
            const float kk = kh[i];
            const float qq = qh[i];
#pragma unroll
            for (int c = 0; c < KDA_COLS; ++c) {
                s[r][c] = fmaf(kk, u[c], s[r][c]);
                acc[c] = fmaf(s[r][c], qq, acc[c]);
            }
        }
#pragma unroll
        for (int c = 0; c < KDA_COLS; ++c) part[w * KDA_TILE + lane + HK_WARP * c] = acc[c];
        __syncthreads();
        float* rec = record ? record + th * wrec : 0;
        if (w == 0) {
#pragma unroll
            for (int c = 0; c < KDA_COLS; ++c) {
                const int jj = lane + HK_WARP * c;
                const int j = col0 + jj;
                if (j < dv) {
                    float o = 0.0f;
                    for (int x = 0; x < nw; ++x) o += part[x * KDA_TILE + jj];
                    out[th * dv + j] = o;
                    if (rec) rec[dk + j] = u[c];
                }
            }
        }
        if (rec && blockIdx.y == 0 && tid < dk) {
            rec[tid] = kh[tid];
            rec[dk + dv + tid] = gs[tid];
        }
        __syncthreads();  // qh, kh, part are rewritten by the next token
    }

#pragma unroll
    for (int r = 0; r < KDA_ROWS; ++r) {
        const int i = w * KDA_ROWS + r;
#pragma unroll
        for (int c = 0; c < KDA_COLS; ++c) {
            const int j = col0 + lane + HK_WARP * c;
            if (i < dk && j < dv) S[(hk_i64)i * dv + j] = s[r][c];
        }
    }
}

#define KDA_RECURRENT_ARGS                                                              \
    float* __restrict__ state, const float* __restrict__ q, const float* __restrict__ k,  \
    const float* __restrict__ v, const float* __restrict__ g_raw,                         \
    const float* __restrict__ b_raw, const float* __restrict__ a_log,                     \
    const float* __restrict__ dt_bias, float* __restrict__ out, float* __restrict__ record, \
    int tokens, int heads, int dk, int dv
#define KDA_RECURRENT_CALL \
    kda_recurrent_body(state, q, k, v, g_raw, b_raw, a_log, dt_bias, out, record, tokens, heads, dk, dv)

// The entry points differ only in their launch bounds, which set the register
// budget the compiler gets for the 64 state values per thread:
//   kda_recurrent      dk <= 128 (256 threads), one block per multiprocessor,
//                      no register cap below the hardware's 255: no spills;
//   kda_recurrent_2x   dk <= 128, two blocks per multiprocessor (128 registers,
//                      a few spilled), so one block's loads overlap another's
//                      compute and stores;
//   kda_recurrent_wide 128 < dk <= 256 (up to 512 threads).
// The backend picks by dk (and the 1x/2x choice, see CudaBackend); all three
// compute the same bits.
extern "C" __global__ void __launch_bounds__(256, 1) kda_recurrent(KDA_RECURRENT_ARGS) { KDA_RECURRENT_CALL; }
extern "C" __global__ void __launch_bounds__(256, 2) kda_recurrent_2x(KDA_RECURRENT_ARGS) { KDA_RECURRENT_CALL; }
extern "C" __global__ void __launch_bounds__(KDA_MAX_THREADS, 1) kda_recurrent_wide(KDA_RECURRENT_ARGS) { KDA_RECURRENT_CALL; }

// ReplaySSM append: copies slot b's `tokens` records to its ring at its cursor.
// The cursors were checked on the host (in range, room left); the host writes
// the advanced cursors after this kernel.
// Launch: grid (ceil(tokens * per / 256), B); block 256.
extern "C" __global__ void replay_append(
    float* __restrict__ ring,           // [B, capacity, H, w]
    const int* __restrict__ cursor,     // [B]
    const float* __restrict__ records,  // [B, tokens, H, w]
    int capacity, int tokens, hk_i64 per)  // per = H * w, elements per token
{
    const int b = blockIdx.y;
    const hk_i64 n = (hk_i64)tokens * per;
    const hk_i64 dst = ((hk_i64)b * capacity + cursor[b]) * per;
    const hk_i64 src = (hk_i64)b * n;
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x) {
        ring[dst + e] = records[src + e];
    }
}

// ReplaySSM commit: S_n = exp(G_n) S_0 + sum_j exp(G_n - G_j) k^_j u_j^T over
// the cursor[b] records of slot b, newest first so that G_n - G_j is a suffix
// sum of g (as the CPU does). Same thread layout as kda_recurrent; the host
// resets the cursors afterwards.
// Launch: grid (B * heads, ceil(dv / 128)); block 32 * ceil(dk / 16); no shared memory.
extern "C" __global__ void __launch_bounds__(KDA_MAX_THREADS, 1) replay_commit(
    float* __restrict__ state,          // [B, H, dk, dv]
    const float* __restrict__ ring,     // [B, capacity, H, 2*dk + dv]
    const int* __restrict__ cursor,     // [B]
    int capacity, int heads, int dk, int dv)
{
    const int bh = blockIdx.x;
    const int b = bh / heads;
    const int h = bh % heads;
    const int lane = threadIdx.x & (HK_WARP - 1);
    const int w = threadIdx.x / HK_WARP;
    const int col0 = blockIdx.y * KDA_TILE;
    const int wrec = 2 * dk + dv;
    const int n = cursor[b];
    float* S = state + (hk_i64)bh * dk * dv;
    const float* rec0 = ring + ((hk_i64)b * capacity * heads + h) * wrec;
    const hk_i64 rstride = (hk_i64)heads * wrec;  // one token of the ring

    float s[KDA_ROWS][KDA_COLS];
    float suffix[KDA_ROWS];
#pragma unroll
    for (int r = 0; r < KDA_ROWS; ++r) {
        const int i = w * KDA_ROWS + r;
        // G_n of row i: the sum of g over the records, oldest first.
        float total = 0.0f;
        if (i < dk)
            for (int j = 0; j < n; ++j) total += rec0[j * rstride + dk + dv + i];
        const float e = expf(total);
        suffix[r] = 0.0f;
#pragma unroll
        for (int c = 0; c < KDA_COLS; ++c) {
            const int jc = col0 + lane + HK_WARP * c;
            s[r][c] = (i < dk && jc < dv) ? S[(hk_i64)i * dv + jc] * e : 0.0f;
        }
    }
    for (int j = n - 1; j >= 0; --j) {
        const float* rj = rec0 + j * rstride;
        float uu[KDA_COLS];
#pragma unroll
        for (int c = 0; c < KDA_COLS; ++c) {
            const int jc = col0 + lane + HK_WARP * c;
            uu[c] = jc < dv ? rj[dk + jc] : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < KDA_ROWS; ++r) {
            const int i = w * KDA_ROWS + r;
            if (i < dk) {
                const float coef = expf(suffix[r]) * rj[i];
#pragma unroll
                for (int c = 0; c < KDA_COLS; ++c) s[r][c] += coef * uu[c];
                suffix[r] += rj[dk + dv + i];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < KDA_ROWS; ++r) {
        const int i = w * KDA_ROWS + r;
#pragma unroll
        for (int c = 0; c < KDA_COLS; ++c) {
            const int jc = col0 + lane + HK_WARP * c;
            if (i < dk && jc < dv) S[(hk_i64)i * dv + jc] = s[r][c];
        }
    }
}
