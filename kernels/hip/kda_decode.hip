// KDA recurrent decode step (design.md section 5, steps 1-7), HIP/CUDA-common.
//
// Plain C++ with the __global__/__shared__/threadIdx subset that hipcc (HIP
// mode auto-includes the runtime wrapper) and NVRTC both accept: no headers,
// no HIP- or CUDA-only intrinsics. The CPU reference is
// kernels/src/cpu/kda.rs (fn step); layouts match the Backend::kda_step docs.
//
// Launch: grid = (B * H) blocks, one per (slot, head); blockDim.x a power of
// two (128 or 256); dynamic shared memory = (4 * dk + blockDim.x) * 4 bytes.
// Thread j owns value columns j, j + blockDim.x, ...: the key-channel
// reductions S'^T k^ and S^T q^ run down a column inside one thread, and
// threads of a warp touch consecutive columns of a state row (coalesced).
//
// Checked through NVRTC on the H200 by kernels/hip/check_nvrtc.py (against
// float64). Speed there, graph replay, batch 88 x 12 heads of 128x128: about
// 138 us a step, 1.0 TB/s of state traffic, where FLA's fused_recurrent_kda
// takes 47.8 us (design.md section 7). One thread walking a whole column has
// few loads in flight; splitting the key dimension over several threads per
// column (partial sums through shared memory) is the next step.

#define KDA_L2_EPS 1e-6f

static __device__ __forceinline__ float kda_softplus(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}

static __device__ __forceinline__ float kda_sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

// Sum of `v` over the block; every thread gets the result. `red` has
// blockDim.x floats; blockDim.x must be a power of two.
static __device__ float kda_block_sum(float v, float* red) {
    const unsigned tid = threadIdx.x;
    red[tid] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) red[tid] += red[tid + s];
        __syncthreads();
    }
    const float total = red[0];
    __syncthreads();
    return total;
}

extern "C" __global__ void kda_decode_step(
    float* __restrict__ state,          // [B, H, dk, dv], updated in place
    const float* __restrict__ q,        // [B, H, dk]
    const float* __restrict__ k,        // [B, H, dk]
    const float* __restrict__ v,        // [B, H, dv]
    const float* __restrict__ g_raw,    // [B, H, dk]
    const float* __restrict__ b_raw,    // [B, H]
    const float* __restrict__ a_log,    // [H]
    const float* __restrict__ dt_bias,  // [H, dk]
    float* __restrict__ out,            // [B, H, dv]
    float* __restrict__ record,         // [B, H, 2*dk + dv] (k^, u, g) or null
    int heads, int dk, int dv)
{
    extern __shared__ float smem[];
    float* qh = smem;            // [dk] q^ (normalized, scaled by dk^-1/2)
    float* kh = qh + dk;         // [dk] k^
    float* gs = kh + dk;         // [dk] log decay g
    float* al = gs + dk;         // [dk] alpha = exp(g)
    float* red = al + dk;        // [blockDim.x]

    const long bh = blockIdx.x;
    const int h = (int)(bh % heads);
    const unsigned tid = threadIdx.x;
    const unsigned nt = blockDim.x;

    const float* qb = q + bh * dk;
    const float* kb = k + bh * dk;
    const float* gb = g_raw + bh * dk;
    const float* vb = v + bh * dv;
    float* S = state + bh * (long)dk * dv;

    // Step 1: L2 norms of q and k.
    float sq = 0.0f, sk = 0.0f;
    for (int i = tid; i < dk; i += nt) {
        const float qi = qb[i], ki = kb[i];
        sq += qi * qi;
        sk += ki * ki;
    }
    sq = kda_block_sum(sq, red);
    sk = kda_block_sum(sk, red);
    const float qs = rsqrtf(sq + KDA_L2_EPS) * rsqrtf((float)dk);
    const float ks = rsqrtf(sk + KDA_L2_EPS);

    // Steps 2-3: per-channel log decay and beta.
    const float rate = -expf(a_log[h]);
    for (int i = tid; i < dk; i += nt) {
        qh[i] = qb[i] * qs;
        kh[i] = kb[i] * ks;
        gs[i] = rate * kda_softplus(gb[i] + dt_bias[(long)h * dk + i]);
        al[i] = expf(gs[i]);
    }
    const float beta = kda_sigmoid(b_raw[bh]);
    __syncthreads();

    float* rec = record ? record + bh * (long)(2 * dk + dv) : 0;
    for (int j = tid; j < dv; j += nt) {
        float o = 0.0f;
        // Steps 4-5: S' = Diag(alpha) S, u = beta (v - S'^T k^).
        float kv = 0.0f;
        for (int i = 0; i < dk; ++i) {
            const float s = S[(long)i * dv + j] * al[i];
            S[(long)i * dv + j] = s;
            kv += s * kh[i];
        }
        const float u = beta * (vb[j] - kv);
        // Steps 6-7: S = S' + k^ u^T, o = S^T q^.
        for (int i = 0; i < dk; ++i) {
            const float s = S[(long)i * dv + j] + kh[i] * u;
            S[(long)i * dv + j] = s;
            o += s * qh[i];
        }
        out[bh * dv + j] = o;
        if (rec) rec[dk + j] = u;
    }
    if (rec) {
        for (int i = tid; i < dk; i += nt) {
            rec[i] = kh[i];
            rec[dk + dv + i] = gs[i];
        }
    }
}
