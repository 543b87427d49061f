// KDA on the device: the recurrent step (batched decode) and prefill, and the
// ReplaySSM ring (append, commit). Math: docs/design.md section 5; CPU reference:
// kernels/src/cpu/kda.rs. Needs prelude.h in front.
//
// Layout of the state work (kda_recurrent_* and replay_commit). The value
// columns of a head are independent of each other (u_j, the update of column j
// and o_j read only column j of the state), so a head's state [dk, dv] splits
// into column tiles of 32 * COLS columns, one block per (slot, head, tile).
// Inside a block:
//   - lane l of a warp owns columns l, l + 32, ... (COLS of them) of the tile,
//     so each load or store instruction of a warp touches 128 contiguous bytes
//     of one state row;
//   - warp w owns the key rows w * 16 .. w * 16 + 15 (KDA_ROWS), so the key
//     dimension is split across nw = ceil(dk / 16) warps and every thread keeps
//     its 16 x COLS state values in registers: they are all loaded before the
//     first is used (16 * COLS loads in flight per thread), and each state
//     value is read once and written once per launch;
//   - the key-dimension sums (S'^T k^ and S^T q^) add a thread's 16 rows in row
//     order, then the warps' partial sums in warp order through shared memory:
//     a fixed order that depends on dk only. So a slot's result is the same
//     bits whatever the batch size and whatever the tile width (COLS only
//     decides which block computes a column, not how).
// Narrow tiles (COLS = 1: 16 KB of state per block, few registers) give many
// small blocks per multiprocessor, which is what keeps enough loads in flight
// to run near the copy bandwidth; the wider ones are kept for comparison
// (`cuda_check --bench` times them all).
// dk is limited to 16 * 16 = 256 (16 warps); the Rust side refuses more.

#define KDA_L2_EPS 1e-6f
#define KDA_ROWS 16
// Tile of replay_commit (4 columns per lane).
#define KDA_COLS 4
#define KDA_TILE (HK_WARP * KDA_COLS)
// Largest block (dk = 256: 16 warps).
#define KDA_MAX_THREADS 512

// Recurrent KDA over `seqs` independent sequences of `tokens` tokens each.
//   decode step: seqs = B, tokens = 1  (inputs [B, H, *], state [B, H, dk, dv])
//   prefill:     seqs = 1, tokens = T  (inputs [T, H, *], state [1, H, dk, dv])
// Row r = seq * tokens + t of the inputs, outputs and records is token t of
// sequence seq. With a sequence table `seg` (a ragged prefill over several
// prompts at once; null otherwise) sequence seq is instead rows
// seg[3 seq] .. + seg[3 seq + 1] - 1 and its state is number seg[3 seq + 2]
// of `state`; `tokens` is then unused. The arithmetic of a sequence is the
// same either way, so a ragged launch gives each prompt the bits of its own. The state stays in registers across the tokens, so a prefill
// reads and writes it once, and its result equals T decode steps exactly. The
// next token's inputs are loaded while the current one is computed.
//
// Per token: one block sum (q and k norms together), then three barriers:
//   A  q^, k^, g, alpha in shared memory;
//   B  per-warp partials of S'^T k^ (part1) written;
//   C  per-warp partials of S^T q^ (part2) written.
// Each shared array is rewritten only after a barrier that every reader of its
// previous contents has passed (red after C, part1 after A, part2 after B,
// q^/k^ after C, and k^/g for the record are read by the thread that writes them).
//
// Launch: grid (seqs * heads, ceil(dv / (32 * COLS))); block 32 * ceil(dk / 16)
// threads; dynamic shared memory (4 * nw * 16 + 2 * nw * 32 * COLS + 2 * nw)
// floats, nw = blockDim.x / 32.
template <int COLS>
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
    const int* __restrict__ seg,        // [seqs][3] (first row, rows, state) or null
    int tokens, int heads, int dk, int dv)
{
    const int TILE = HK_WARP * COLS;
    const int nw = blockDim.x / HK_WARP;
    const int kpad = nw * KDA_ROWS;  // key rows covered by the block (>= dk)
    HK_DYN_SMEM(float, smem);
    float* qh = smem;                   // [kpad] q^ (0 past dk)
    float* kh = qh + kpad;              // [kpad] k^
    float* gs = kh + kpad;              // [kpad] log decay g
    float* al = gs + kpad;              // [kpad] alpha = exp(g)
    float* part1 = al + kpad;           // [nw][TILE] partials of S'^T k^
    float* part2 = part1 + nw * TILE;   // [nw][TILE] partials of S^T q^
    float* red = part2 + nw * TILE;     // [2 * nw] norm partials

    const int sh = blockIdx.x;      // seq * heads + h
    const int seq = sh / heads;
    const int h = sh % heads;
    const int tid = threadIdx.x;
    const int lane = tid & (HK_WARP - 1);
    const int w = tid / HK_WARP;
    const int col0 = blockIdx.y * TILE;
    const int wrec = 2 * dk + dv;

    hk_i64 row0 = (hk_i64)seq * tokens;
    hk_i64 sidx = sh;
    if (seg) {
        row0 = seg[3 * seq];
        tokens = seg[3 * seq + 1];
        sidx = (hk_i64)seg[3 * seq + 2] * heads + h;
    }
    float* S = state + sidx * dk * dv;
    float s[KDA_ROWS][COLS];
#pragma unroll
    for (int r = 0; r < KDA_ROWS; ++r) {
        const int i = w * KDA_ROWS + r;
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
            const int j = col0 + lane + HK_WARP * c;
            s[r][c] = (i < dk && j < dv) ? S[(hk_i64)i * dv + j] : 0.0f;
        }
    }
    const float rate = -expf(a_log[h]);
    const float bias = tid < dk ? dt_bias[(hk_i64)h * dk + tid] : 0.0f;
    const float inv_sqrt_dk = 1.0f / sqrtf((float)dk);

    // Token 0's inputs; later ones are loaded one token ahead.
    hk_i64 th = row0 * heads + h;
    float qn = tid < dk ? q[th * dk + tid] : 0.0f;
    float kn = tid < dk ? k[th * dk + tid] : 0.0f;
    float gn = tid < dk ? g_raw[th * dk + tid] : 0.0f;
    float bn = b_raw[th];
    float vn[COLS];
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
        const int j = col0 + lane + HK_WARP * c;
        vn[c] = j < dv ? v[th * dv + j] : 0.0f;
    }

    // (A build specialised to one token, without the loop and the look-ahead
    // loads, was measured slower on the H200: 48.5 against 43.2 us for the
    // B = 88 x 12-head step; its scheduler issued the state loads later.)
    for (int t = 0; t < tokens; ++t) {
        const float qi = qn, ki = kn, gr = gn, br = bn;
        float vv[COLS];
#pragma unroll
        for (int c = 0; c < COLS; ++c) vv[c] = vn[c];
        const hk_i64 tht = th;
        if (t + 1 < tokens) {
            th += heads;
            qn = tid < dk ? q[th * dk + tid] : 0.0f;
            kn = tid < dk ? k[th * dk + tid] : 0.0f;
            gn = tid < dk ? g_raw[th * dk + tid] : 0.0f;
            bn = b_raw[th];
#pragma unroll
            for (int c = 0; c < COLS; ++c) {
                const int j = col0 + lane + HK_WARP * c;
                vn[c] = j < dv ? v[th * dv + j] : 0.0f;
            }
        }
        // Step 1: L2 norms of q and k (blockDim >= 2 * dk: one element per
        // thread), one fixed-order block sum for both.
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
        const float qs = 1.0f / sqrtf(sq + KDA_L2_EPS) * inv_sqrt_dk;
        const float ks = 1.0f / sqrtf(sk + KDA_L2_EPS);
        // Steps 2-3: per-channel log decay, alpha, beta.
        if (tid < kpad) {
            if (tid < dk) {
                const float g = rate * hk_softplus(gr + bias);
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
        const float beta = hk_sigmoid(br);
        __syncthreads();  // A

        // Steps 4-5: S' = Diag(alpha) S; partial sums of S'^T k^ over this warp's rows.
        float acc[COLS];
#pragma unroll
        for (int c = 0; c < COLS; ++c) acc[c] = 0.0f;
#pragma unroll
        for (int r = 0; r < KDA_ROWS; ++r) {
            const int i = w * KDA_ROWS + r;
            const float a = al[i];
            const float kk = kh[i];
#pragma unroll
            for (int c = 0; c < COLS; ++c) {
                s[r][c] *= a;
                acc[c] = fmaf(s[r][c], kk, acc[c]);
            }
        }
#pragma unroll
        for (int c = 0; c < COLS; ++c) part1[w * TILE + lane + HK_WARP * c] = acc[c];
        __syncthreads();  // B
        // u = beta (v - S'^T k^): every warp adds the warp partials in warp
        // order (the same bits in every warp), for its own columns.
        float u[COLS];
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
            const int jj = lane + HK_WARP * c;
            float kv = 0.0f;
            for (int x = 0; x < nw; ++x) kv += part1[x * TILE + jj];
            u[c] = col0 + jj < dv ? beta * (vv[c] - kv) : 0.0f;
        }
        // Steps 6-7: S = S' + k^ u^T; partial sums of S^T q^.
#pragma unroll
        for (int c = 0; c < COLS; ++c) acc[c] = 0.0f;
#pragma unroll
        for (int r = 0; r < KDA_ROWS; ++r) {
            const int i = w * KDA_ROWS + r;
            const float kk = kh[i];
            const float qq = qh[i];
#pragma unroll
            for (int c = 0; c < COLS; ++c) {
                s[r][c] = fmaf(kk, u[c], s[r][c]);
                acc[c] = fmaf(s[r][c], qq, acc[c]);
            }
        }
#pragma unroll
        for (int c = 0; c < COLS; ++c) part2[w * TILE + lane + HK_WARP * c] = acc[c];
        __syncthreads();  // C
        float* rec = record ? record + tht * wrec : 0;
        if (w == 0) {
#pragma unroll
            for (int c = 0; c < COLS; ++c) {
                const int jj = lane + HK_WARP * c;
                const int j = col0 + jj;
                if (j < dv) {
                    float o = 0.0f;
                    for (int x = 0; x < nw; ++x) o += part2[x * TILE + jj];
                    out[tht * dv + j] = o;
                    if (rec) rec[dk + j] = u[c];
                }
            }
        }
        if (rec && blockIdx.y == 0 && tid < dk) {
            rec[tid] = kh[tid];
            rec[dk + dv + tid] = gs[tid];
        }
    }

#pragma unroll
    for (int r = 0; r < KDA_ROWS; ++r) {
        const int i = w * KDA_ROWS + r;
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
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
    const int* __restrict__ seg, int tokens, int heads, int dk, int dv
#define KDA_RECURRENT_CALL(cols) \
    kda_recurrent_body<cols>(state, q, k, v, g_raw, b_raw, a_log, dt_bias, out, record, seg, tokens, heads, dk, dv)

// Entry points. They differ in the tile width (value columns per lane) and in
// the launch bounds, which set the register budget (65536 / (threads x blocks
// per multiprocessor)), never in the arithmetic of a column:
//   decode step (tokens = 1), dk <= 128 (256 threads):
//     kda_step_c1    32-column tiles, 4 blocks per multiprocessor (64 registers);
//     kda_step_c2    64-column tiles, 3 blocks (80 registers, 32 bytes spilled): the default;
//     kda_step_c2x4  64-column tiles, 4 blocks (64 registers, a few bytes spilled);
//     kda_step_c4x1  128-column tiles, 1 block (no register cap);
//   kda_prefill      32-column tiles (the most blocks for one sequence), 3 blocks, dk <= 128;
//   kda_recurrent_wide  step or prefill for 128 < dk <= 256 (up to 512 threads).
// The backend picks the step kernel (CudaBackend::set_kda_kernel); all give
// the same bits, and a prefill equals its decode steps bit for bit.
extern "C" __global__ void __launch_bounds__(256, 4) kda_step_c1(KDA_RECURRENT_ARGS) { KDA_RECURRENT_CALL(1); }
extern "C" __global__ void __launch_bounds__(256, 3) kda_step_c2(KDA_RECURRENT_ARGS) { KDA_RECURRENT_CALL(2); }
extern "C" __global__ void __launch_bounds__(256, 4) kda_step_c2x4(KDA_RECURRENT_ARGS) { KDA_RECURRENT_CALL(2); }
extern "C" __global__ void __launch_bounds__(256, 1) kda_step_c4x1(KDA_RECURRENT_ARGS) { KDA_RECURRENT_CALL(4); }
extern "C" __global__ void __launch_bounds__(256, 3) kda_prefill(KDA_RECURRENT_ARGS) { KDA_RECURRENT_CALL(1); }
extern "C" __global__ void __launch_bounds__(KDA_MAX_THREADS, 2) kda_recurrent_wide(KDA_RECURRENT_ARGS) { KDA_RECURRENT_CALL(1); }

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
