// Short causal depthwise conv1d + SiLU (Kimi Linear's ShortConvolution, no
// bias), for prefill and for the batched decode step. CPU reference:
// kernels/src/cpu/conv.rs. weight [C, W] (last tap on the newest input);
// state [W-1, C], oldest row first. Needs prelude.h in front.

// Input row p of channel c relative to the first new token: p < 0 reads the
// state (the W-1 inputs before x).
static __device__ __forceinline__ float conv_input(
    const float* x, const float* state, int hist, int ch, int p, int c)
{
    return p < 0 ? state[(hk_i64)(hist + p) * ch + c] : x[(hk_i64)p * ch + c];
}

// out[t, c] = silu(sum_j w[c, j] * input(t + j - hist, c)), taps in order j = 0..W-1.
// Launch: grid-stride over tokens * ch; reads the state, does not write it.
extern "C" __global__ void conv_prefill_out(
    const float* __restrict__ x,       // [T, C]
    const float* __restrict__ weight,  // [C, W]
    const float* __restrict__ state,   // [W-1, C]
    float* __restrict__ out,           // [T, C]
    int tokens, int ch, int width)
{
    const int hist = width - 1;
    const hk_i64 n = (hk_i64)tokens * ch;
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x) {
        const int t = (int)(e / ch);
        const int c = (int)(e % ch);
        float acc = 0.0f;
        for (int j = 0; j < width; ++j)
            acc += weight[(hk_i64)c * width + j] * conv_input(x, state, hist, ch, t + j - hist, c);
        out[e] = hk_silu(acc);
    }
}

// New state: row r = input(tokens + r - hist). One thread per channel walks
// the rows in ascending order; a row it reads from the old state (r + tokens)
// is later than the row it writes (r), so it is read before it is overwritten,
// and no other thread touches the channel: in place without scratch.
// Launch after conv_prefill_out; grid-stride over ch.
extern "C" __global__ void conv_prefill_state(
    const float* __restrict__ x,  // [T, C]
    float* __restrict__ state,    // [W-1, C]
    int tokens, int ch, int width)
{
    const int hist = width - 1;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < ch; c += gridDim.x * blockDim.x) {
        for (int r = 0; r < hist; ++r)
            state[(hk_i64)r * ch + c] = conv_input(x, state, hist, ch, tokens + r - hist, c);
    }
}

// One decode step per slot: out = silu(w[hist] x + sum_j w[j] st[j]) (that
// order, as the CPU), then the state shifts up one row and takes x.
// Launch: grid-stride over batch * ch.
extern "C" __global__ void conv_step(
    const float* __restrict__ x,       // [B, C]
    const float* __restrict__ weight,  // [C, W]
    float* __restrict__ state,         // [B, W-1, C]
    float* __restrict__ out,           // [B, C]
    int batch, int ch, int width)
{
    const int hist = width - 1;
    const hk_i64 n = (hk_i64)batch * ch;
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x) {
        const hk_i64 b = e / ch;
        const int c = (int)(e % ch);
        const float* wc = weight + (hk_i64)c * width;
        float* st = state + b * hist * ch;
        const float xv = x[e];
        float acc = wc[hist] * xv;
        for (int j = 0; j < hist; ++j) acc += wc[j] * st[(hk_i64)j * ch + c];
        out[e] = hk_silu(acc);
        for (int j = 0; j + 1 < hist; ++j) st[(hk_i64)j * ch + c] = st[(hk_i64)(j + 1) * ch + c];
        if (hist > 0) st[(hk_i64)(hist - 1) * ch + c] = xv;
    }
}
