// Buffer ops: fill, the strided column-block copy, storage rounding. (Plain
// range copies are driver device-to-device copies on the Rust side.) Needs
// prelude.h in front. Launch: grid-stride, any grid; block 256.

extern "C" __global__ void fill_f32(float* __restrict__ buf, float value, hk_i64 n)
{
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x)
        buf[e] = value;
}

// For each of `rows` rows: dst[r, dst_col .. + width] = src[r, src_col .. + width].
extern "C" __global__ void copy_cols(
    const float* __restrict__ src, float* __restrict__ dst,
    hk_i64 rows, hk_i64 src_cols, hk_i64 src_col, hk_i64 dst_cols, hk_i64 dst_col, hk_i64 width)
{
    const hk_i64 n = rows * width;
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x) {
        const hk_i64 r = e / width;
        const hk_i64 c = e % width;
        dst[r * dst_cols + dst_col + c] = src[r * src_cols + src_col + c];
    }
}

// Rounds every element to what the storage dtype keeps: dtype 1 = bf16,
// 2 = f16 (round to nearest even, src/dtype.rs's bit algorithm); f32 is not
// launched.
extern "C" __global__ void round_to(float* __restrict__ buf, int dtype, hk_i64 n)
{
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x) {
        const float x = buf[e];
        buf[e] = dtype == 1 ? hk_bf16_to_f32(hk_f32_to_bf16(x)) : hk_f16_to_f32(hk_f32_to_f16(x));
    }
}

// Registered regions in device memory (kernels/src/region.rs): item i is `per`
// values at byte offset offs[i] of the region at `base`; row i of the buffer.
// 4-byte values move as bits (f32 and i32 alike); 16-bit values are decoded to
// or encoded from f32, dtype 1 = bf16, 2 = f16. The host checked every item
// against the region and its alignment.
extern "C" __global__ void region_gather_b32(
    const unsigned char* __restrict__ base, const hk_i64* __restrict__ offs,
    hk_i64 items, hk_i64 per, unsigned int* __restrict__ out)
{
    const hk_i64 n = items * per;
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x) {
        const hk_i64 i = e / per;
        out[e] = ((const unsigned int*)(base + offs[i]))[e - i * per];
    }
}

extern "C" __global__ void region_scatter_b32(
    unsigned char* __restrict__ base, const hk_i64* __restrict__ offs,
    hk_i64 items, hk_i64 per, const unsigned int* __restrict__ src)
{
    const hk_i64 n = items * per;
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x) {
        const hk_i64 i = e / per;
        ((unsigned int*)(base + offs[i]))[e - i * per] = src[e];
    }
}

extern "C" __global__ void region_gather_b16(
    const unsigned char* __restrict__ base, const hk_i64* __restrict__ offs,
    hk_i64 items, hk_i64 per, int dtype, float* __restrict__ out)
{
    const hk_i64 n = items * per;
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x) {
        const hk_i64 i = e / per;
        const unsigned short h = ((const unsigned short*)(base + offs[i]))[e - i * per];
        out[e] = dtype == 1 ? hk_bf16_to_f32(h) : hk_f16_to_f32(h);
    }
}

extern "C" __global__ void region_scatter_b16(
    unsigned char* __restrict__ base, const hk_i64* __restrict__ offs,
    hk_i64 items, hk_i64 per, int dtype, const float* __restrict__ src)
{
    const hk_i64 n = items * per;
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x) {
        const hk_i64 i = e / per;
        const float x = src[e];
        ((unsigned short*)(base + offs[i]))[e - i * per] = dtype == 1 ? hk_f32_to_bf16(x) : hk_f32_to_f16(x);
    }
}
