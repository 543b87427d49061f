// RMSNorm and KDA's gated output norm (FLA's FusedRMSNormGated), one block
// per row. CPU reference: kernels/src/cpu/norm.rs. Needs prelude.h in front.
//
// The mean square is a fixed-order block sum (hk_block_sum), so a row's result
// does not depend on how many rows the call has.
// Launch: grid (rows); block 256; dynamic shared memory (256 / 32) floats.

static __device__ float norm_inv_rms(const float* xr, int dim, float eps, float* red) {
    float ss = 0.0f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) ss += xr[c] * xr[c];
    const float ms = hk_block_sum(ss, red) / (float)dim;
    return 1.0f / sqrtf(ms + eps);
}

extern "C" __global__ void rms_norm(
    const float* __restrict__ x, const float* __restrict__ weight, float* __restrict__ out,
    int dim, float eps)
{
    HK_DYN_SMEM(float, red);
    const hk_i64 at = (hk_i64)blockIdx.x * dim;
    const float r = norm_inv_rms(x + at, dim, eps, red);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) out[at + c] = x[at + c] * r * weight[c];
}

// out = rms_norm(o) * weight * silu(gate).
extern "C" __global__ void gated_rms_norm(
    const float* __restrict__ o, const float* __restrict__ gate, const float* __restrict__ weight,
    float* __restrict__ out, int dim, float eps)
{
    HK_DYN_SMEM(float, red);
    const hk_i64 at = (hk_i64)blockIdx.x * dim;
    const float r = norm_inv_rms(o + at, dim, eps, red);
    for (int c = threadIdx.x; c < dim; c += blockDim.x)
        out[at + c] = o[at + c] * r * weight[c] * hk_silu(gate[at + c]);
}
