// Dense ops: matmul, the SwiGLU activation, embedding, argmax, the residual
// add. CPU reference: kernels/src/cpu/dense.rs. Needs prelude.h in front.

// ---- matmul -----------------------------------------------------------------
//
// out [rows, cols] = x [rows, inner] . w [inner, cols], row-major.
//
// The order of the sum, which every kernel below keeps bit for bit: k runs in
// chunks of MM_KC = 128; within a chunk an output element is one fmaf chain
// from 0 over k in order, and the chunk sums are added in chunk order to a
// total that starts at 0. k is padded with zeros to a multiple of MM_BK
// (fmaf(0, 0, acc) on both paths). So a row's bits never depend on how many
// rows the call has or on which kernel ran it (decode of a batch equals decode
// of one).
//
// matmul_f32, for many rows: a shared-memory tiled kernel; a block computes a
// 64 x 64 tile of out with 256 threads, each thread a 4 x 4 register block
// (rows ty + 16 i, columns tx + 16 j, so a warp's loads and stores of w and out
// are contiguous), walking k in steps of 16 through shared-memory tiles of x
// and w and folding its chunk sums into the total every MM_KC.
// Launch: grid (ceil(cols / 64), ceil(rows / 64)); block 256.
//
// matmul_splitk_f32 + matmul_chunk_sum, for decode's few rows: with one tile
// of rows the tiled kernel has only cols / 64 blocks, each walking all of k
// one shared tile at a time, which leaves the device latency-bound; here every
// (column tile, k chunk, 16-row tile) is a block of its own that writes its
// chunk sums to a scratch [chunks, rows, cols], and matmul_chunk_sum adds them
// in chunk order.

#define MM_KC 128
#define MM_BM 64
#define MM_BN 64
#define MM_BK 16

extern "C" __global__ void matmul_f32(
    const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out,
    int rows, int inner, int cols)
{
    __shared__ float xs[MM_BK][MM_BM + 1];  // x tile, k-major (+1: no bank conflicts on the transposed store)
    __shared__ float ws[MM_BK][MM_BN];
    const int tid = threadIdx.x;
    const int tx = tid % 16;
    const int ty = tid / 16;
    const int row0 = blockIdx.y * MM_BM;
    const int col0 = blockIdx.x * MM_BN;
    float acc[4][4], tot[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = tot[i][j] = 0.0f;

    for (int k0 = 0; k0 < inner; k0 += MM_BK) {
        // x tile: 64 rows x 16 k, four elements per thread, k fastest (contiguous reads).
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int idx = tid + 256 * e;
            const int r = idx / MM_BK;
            const int kk = idx % MM_BK;
            const int gr = row0 + r;
            const int gk = k0 + kk;
            xs[kk][r] = (gr < rows && gk < inner) ? x[(hk_i64)gr * inner + gk] : 0.0f;
        }
        // w tile: 16 k x 64 columns, columns fastest.
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int idx = tid + 256 * e;
            const int kk = idx / MM_BN;
            const int c = idx % MM_BN;
            const int gk = k0 + kk;
            const int gc = col0 + c;
            ws[kk][c] = (gk < inner && gc < cols) ? w[(hk_i64)gk * cols + gc] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < MM_BK; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = xs[kk][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = ws[kk][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
        if ((k0 + MM_BK) % MM_KC == 0 || k0 + MM_BK >= inner) {
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    tot[i][j] += acc[i][j];
                    acc[i][j] = 0.0f;
                }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int gr = row0 + ty + 16 * i;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int gc = col0 + tx + 16 * j;
            if (gr < rows && gc < cols) out[(hk_i64)gr * cols + gc] = tot[i][j];
        }
    }
}

// Chunk sums of the split-k path: block (column tile bx, chunk by, row tile
// bz) writes part[by][r][c] for rows bz * 16 .. +16 and columns bx * 64 .. +64;
// thread (tx = column, ty) holds rows ty + 4 i. The chunk's 16 x 128 slice of
// x is staged in shared memory; w is read straight from memory, a warp's 32
// columns contiguous. x's rows are x_row elements apart (inner for a plain
// matmul, wider when the product reads a column block of x). Launch: grid
// (ceil(cols / 64), ceil(inner / MM_KC), ceil(rows / 16)); block 256.
#define MS_ROWS 16
__device__ __forceinline__ void splitk_tile(
    const float* __restrict__ x, hk_i64 x_row, const float* __restrict__ w, float* __restrict__ part,
    int rows, int inner, int cols, int bx, int by, int bz, float (*xs)[MM_KC])
{
    const int tid = threadIdx.x;
    const int tx = tid % 64;
    const int ty = tid / 64;
    const int col = bx * 64 + tx;
    const int k0 = by * MM_KC;
    const int row0 = bz * MS_ROWS;
    const int padded = (inner + MM_BK - 1) / MM_BK * MM_BK;
    const int kn = padded - k0 < MM_KC ? padded - k0 : MM_KC;
    for (int e = tid; e < MS_ROWS * MM_KC; e += 256) {
        const int r = e / MM_KC;
        const int kk = e % MM_KC;
        const int gr = row0 + r;
        const int gk = k0 + kk;
        xs[r][kk] = (gr < rows && gk < inner) ? x[(hk_i64)gr * x_row + gk] : 0.0f;
    }
    __syncthreads();
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const bool live = col < cols;
#pragma unroll 8
    for (int kk = 0; kk < kn; ++kk) {
        const int gk = k0 + kk;
        const float b = (live && gk < inner) ? w[(hk_i64)gk * cols + col] : 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] = fmaf(xs[ty + 4 * i][kk], b, acc[i]);
    }
    if (!live) return;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int gr = row0 + ty + 4 * i;
        if (gr < rows) part[((hk_i64)by * rows + gr) * cols + col] = acc[i];
    }
}

extern "C" __global__ void matmul_splitk_f32(
    const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ part,
    int rows, int inner, int cols)
{
    __shared__ float xs[MS_ROWS][MM_KC];
    splitk_tile(x, inner, w, part, rows, inner, cols, blockIdx.x, blockIdx.y, blockIdx.z, xs);
}

// out[e] = the chunk sums of element e added in chunk order, from 0.
// Launch: grid-stride, any grid; block 256.
extern "C" __global__ void matmul_chunk_sum(
    const float* __restrict__ part, float* __restrict__ out, hk_i64 n, int chunks)
{
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x) {
        float t = 0.0f;
        for (int c = 0; c < chunks; ++c) t += part[(hk_i64)c * n + e];
        out[e] = t;
    }
}

// ---- several products in one launch -------------------------------------------
//
// matmul_units_splitk + matmul_units_sum: up to MU_UNITS products that read
// column blocks of one x (the heads of o_proj, W_UK, W_UV; the MLP's units),
// each exactly the split-k matmul above on its block alone (splitk_tile, the
// same chunk-sum order), so the bits do not change with how the products are
// grouped. Entry u of the by-value table: w's address, x's first column, the
// element of out that takes the product's row 0, the product's first element
// in part (its [chunks, rows, cols] scratch), inner, cols. Out rows are
// out_row elements apart.
// Launch of matmul_units_splitk: grid (max column tiles, max chunks, row tiles
// x units); block 256; a block past its product's extent exits at once.
// Launch of matmul_units_sum: grid (any, units); block 256.

#define MU_UNITS 32

struct hk_mm_units {
    hk_i64 u[MU_UNITS][6];  // w, x column, out offset, part offset, inner, cols
};

extern "C" __global__ void matmul_units_splitk(
    hk_mm_units t, const float* __restrict__ x, float* __restrict__ part, int rows, hk_i64 x_row)
{
    __shared__ float xs[MS_ROWS][MM_KC];
    const int tiles = (rows + MS_ROWS - 1) / MS_ROWS;
    const int u = blockIdx.z / tiles;
    const int inner = (int)t.u[u][4];
    const int cols = (int)t.u[u][5];
    if ((int)blockIdx.x * 64 >= cols || (int)blockIdx.y * MM_KC >= inner) return;
    splitk_tile(x + t.u[u][1], x_row, (const float*)t.u[u][0], part + t.u[u][3],
                rows, inner, cols, blockIdx.x, blockIdx.y, blockIdx.z % tiles, xs);
}

extern "C" __global__ void matmul_units_sum(
    hk_mm_units t, const float* __restrict__ part, float* __restrict__ out, int rows, hk_i64 out_row)
{
    const int u = blockIdx.y;
    const int inner = (int)t.u[u][4];
    const int cols = (int)t.u[u][5];
    const int chunks = (inner + MM_KC - 1) / MM_KC;
    const hk_i64 n = (hk_i64)rows * cols;
    const float* p = part + t.u[u][3];
    float* o = out + t.u[u][2];
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int c = 0; c < chunks; ++c) s += p[(hk_i64)c * n + e];
        const hk_i64 r = e / cols;
        o[r * out_row + (e - r * cols)] = s;
    }
}

// acc[e] += stacked[u * n + e] for u = from .. to - 1 in order: the
// all-reduce's partials in one pass, each add rounded as add_inplace rounds it.
// Launch: grid-stride, any grid; block 256.
extern "C" __global__ void add_units(
    float* __restrict__ acc, const float* __restrict__ stacked, hk_i64 n, int from, int to)
{
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x) {
        float s = acc[e];
        for (int u = from; u < to; ++u) s += stacked[(hk_i64)u * n + e];
        acc[e] = s;
    }
}

// ---- element-wise -------------------------------------------------------------
// Launch: grid-stride, any grid; block 256.

// out = silu(gate) * up.
extern "C" __global__ void silu_mul(
    const float* __restrict__ gate, const float* __restrict__ up, float* __restrict__ out, hk_i64 n)
{
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x)
        out[e] = hk_silu(gate[e]) * up[e];
}

// dst += src.
extern "C" __global__ void add_inplace(float* __restrict__ dst, const float* __restrict__ src, hk_i64 n)
{
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x)
        dst[e] += src[e];
}

// out[t] = table[ids[t]]; the ids were checked on the host (0 <= id < vocab).
extern "C" __global__ void embedding(
    const float* __restrict__ table, const int* __restrict__ ids, float* __restrict__ out,
    int tokens, int dim)
{
    const hk_i64 n = (hk_i64)tokens * dim;
    for (hk_i64 e = (hk_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (hk_i64)gridDim.x * blockDim.x) {
        const hk_i64 t = e / dim;
        const int c = (int)(e % dim);
        out[e] = table[(hk_i64)ids[t] * dim + c];
    }
}

// ---- argmax ---------------------------------------------------------------------
//
// ids[r] = argmax of row r: NaNs skipped, the lowest index wins ties, a row of
// NaNs picks 0 (the CPU's left-to-right scan). Each thread scans a strided
// slice left to right, then the block combines candidates in a fixed tree:
// (found, larger value, lower index) — the same answer as one scan.
// Launch: grid (rows); block 256 (a power of two).

struct hk_cand {
    float v;
    int i;
    int found;
};

static __device__ __forceinline__ hk_cand argmax_pick(hk_cand a, hk_cand b) {
    if (!b.found) return a;
    if (!a.found) return b;
    if (b.v > a.v) return b;
    if (a.v > b.v) return a;
    return b.i < a.i ? b : a;
}

extern "C" __global__ void argmax_rows(
    const float* __restrict__ logits, int* __restrict__ ids, int cols)
{
    __shared__ float sv[256];
    __shared__ int si[256];
    __shared__ int sf[256];
    const float* row = logits + (hk_i64)blockIdx.x * cols;
    hk_cand best;
    best.v = HK_NEG_INF_F;
    best.i = 0;
    best.found = 0;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = row[c];
        if (!hk_isnan(v) && (!best.found || v > best.v)) {
            best.v = v;
            best.i = c;
            best.found = 1;
        }
    }
    sv[threadIdx.x] = best.v;
    si[threadIdx.x] = best.i;
    sf[threadIdx.x] = best.found;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            hk_cand a, b;
            a.v = sv[threadIdx.x]; a.i = si[threadIdx.x]; a.found = sf[threadIdx.x];
            b.v = sv[threadIdx.x + s]; b.i = si[threadIdx.x + s]; b.found = sf[threadIdx.x + s];
            const hk_cand p = argmax_pick(a, b);
            sv[threadIdx.x] = p.v; si[threadIdx.x] = p.i; sf[threadIdx.x] = p.found;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) ids[blockIdx.x] = sf[0] ? si[0] : 0;
}
