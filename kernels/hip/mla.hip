// Absorbed MLA attention (one latent KV head, rows L + R wide) and the DCP
// LSE merges. CPU reference: kernels/src/cpu/mla.rs. Needs prelude.h in front.
//
// One block per query (token x head, or request x head). Its nw warps split
// the query's rows round-robin in groups of MLA_GROUP = 4 consecutive rows
// (warp w takes groups w, w + nw, ...); a warp forms a group's scores with its
// 32 lanes (lane-strided products, then the butterfly of the prelude,
// identical in every lane) and keeps an online softmax: running max m, sum l
// and accumulator acc[L] (in shared memory, lane-strided columns), rescaled
// once per group. At the end the warps' (m, l, acc) merge in warp order. Everything is a fixed order that depends only on the query's own row
// count and the widths: a request's result is the same bits in a batch of any
// size (the ragged partial relies on it). T is float for the f32 ops and
// double for the f64 partials, which form scores, exponentials and sums in f64
// from the f32 inputs, as the CPU does.

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
