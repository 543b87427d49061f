// Dense ops: matmul, the SwiGLU activation, embedding, argmax, the residual
// add. CPU reference: kernels/src/cpu/dense.rs. Needs prelude.h in front.

// ---- matmul -----------------------------------------------------------------
//
// out [rows, cols] = x [rows, inner] . w [inner, cols], row-major, on the
// tensor cores (matmul_tc16/32 below), then the chunk sums added in order:
// k runs in chunks of MM_KC = 128, each chunk's partial of an element is
// written to a scratch [chunks, rows, cols], and matmul_chunk_sum adds the
// chunks in chunk order to a total that starts at 0. Nothing in that order
// depends on the row count, so a row's bits never depend on how many rows the
// call has (decode of a batch equals decode of one).

#define MM_KC 128

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
// Up to MU_UNITS products that read column blocks of one x (the heads of
// o_proj, W_UK, W_UV; the MLP's units) in two launches: matmul_tc writes each
// product's chunk sums to its own [chunks, rows, cols] scratch, and
// matmul_units_sum adds them in chunk order into place, so every product has
// the bits of the same matmul on its block alone. Entry u of the by-value
// table: w's address, x's first column, the element of out that takes the
// product's row 0, the product's first element in part, inner, cols. Out rows
// are out_row elements apart. A plain matmul is a table of one.
// Launch of matmul_units_sum: grid (any, units); block 256.

#define MU_UNITS 32

struct hk_mm_units {
    hk_i64 u[MU_UNITS][6];  // w, x column, out offset, part offset, inner, cols
};

// ---- the tensor-core matmul ------------------------------------------------------
//
// matmul_tc16 / matmul_tc32: the chunk sums of up to MU_UNITS products (the
// table above; a plain matmul is a table of one) on the tensor cores, for
// every row count: block (column tile bx, chunk by, row tile bz of product u)
// computes the chunk's partial of a BM x BN tile and writes it to the
// product's [chunks, rows, cols] scratch; matmul_units_sum (or
// matmul_chunk_sum) adds the chunks in chunk order from 0, as before.
//
// Within a chunk (MM_KC = 128 k, zero-padded past inner), an element's partial
// is one mma.sync m16n8k16 accumulator from 0 over the chunk's 8 k16 steps in
// order, each step three products in a fixed order on the bf16 split of the
// f32 operands, x = xh + xl and w = wh + wl: xh.wh, then xl.wh, then xh.wl
// (the xl.wl term, about 2^-16 of |x w|, is dropped; the CPU reference is
// exact f32, so the device matches it to ~1e-5, not bit for bit). A tensor-core
// instruction computes an element from its own row and column only, and the
// tile shape (BM = 16 for few rows, 32 for more) never changes that sequence,
// so a row's bits never depend on how many rows the call has.
//
// Each warp owns a 16 x 32 tile (four n8 tiles); a block of four warps is
// WM x WN of them: 1 x 4 (16 x 128, decode's few rows: wide tiles, many
// blocks reading the weight) or 2 x 2 (32 x 64). The chunk's x and w tiles go
// to shared memory by cp.async in two halves of 64 k, so the products of the
// first half overlap the copy of the second; padded rows (x: 128 + 8 floats,
// w: BN + 4) keep the fragment reads free of bank conflicts.
// Launch: grid (ceil(max cols / BN), max chunks, ceil(rows / BM) x units);
// block 128; dynamic shared memory (BM (128 + 8) + 128 (BN + 4)) x 4 bytes.
#define TC_XS (MM_KC + 8)

// The bf16 pair (lo element first) of two floats, and of what they leave.
static __device__ __forceinline__ void tc_split(float a, float b, unsigned& hi, unsigned& lo) {
    const hk_bf16 ha = hk_f32_to_bf16(a), hb = hk_f32_to_bf16(b);
    const hk_bf16 la = hk_f32_to_bf16(a - hk_bf16_to_f32(ha)), lb = hk_f32_to_bf16(b - hk_bf16_to_f32(hb));
    hi = (unsigned)ha | ((unsigned)hb << 16);
    lo = (unsigned)la | ((unsigned)lb << 16);
}

template <int WM, int WN>
static __device__ __forceinline__ void matmul_tc_body(hk_mm_units& t, const float* __restrict__ x, float* __restrict__ part, int rows, hk_i64 x_row)
{
    constexpr int BM = 16 * WM, BN = 32 * WN, WS = BN + 4;
    HK_DYN_SMEM(float, sm);
    float* xs = sm;                // [BM][TC_XS]
    float* ws = sm + BM * TC_XS;   // [MM_KC][WS]
    const int tiles = (rows + BM - 1) / BM;
    const int u = blockIdx.z / tiles;
    const int inner = (int)t.u[u][4];
    const int cols = (int)t.u[u][5];
    const int col0 = blockIdx.x * BN;
    const int k0 = blockIdx.y * MM_KC;
    if (col0 >= cols || k0 >= inner) return;
    const int row0 = (blockIdx.z % tiles) * BM;
    const float* xb = x + t.u[u][1];
    const float* w = (const float*)t.u[u][0];
    const int tid = threadIdx.x;
    // Copy half h (k0 + 64 h .. + 63) of the chunk: zeros past rows, inner, cols.
    // 16-byte copies where the whole quad is in range and aligned, else 4-byte ones.
    auto load = [&](int h) {
        for (int q = tid; q < BM * 16; q += 128) {
            const int r = q / 16, kq = (q % 16) * 4 + 64 * h;
            const int gr = row0 + r, gk = k0 + kq;
            float* d = xs + r * TC_XS + kq;
            const float* src = xb + (hk_i64)gr * x_row + gk;
            if (gr < rows && gk + 3 < inner && ((((unsigned long long)src) & 15) == 0)) {
                hk_cp16(d, src, true);
            } else {
                for (int e = 0; e < 4; ++e) d[e] = (gr < rows && gk + e < inner) ? src[e] : 0.0f;
            }
        }
        for (int q = tid; q < 64 * (BN / 4); q += 128) {
            const int kk = q / (BN / 4) + 64 * h, c = (q % (BN / 4)) * 4;
            const int gk = k0 + kk, gc = col0 + c;
            float* d = ws + kk * WS + c;
            const float* src = w + (hk_i64)gk * cols + gc;
            if (gk < inner && gc + 3 < cols && ((((unsigned long long)src) & 15) == 0)) {
                hk_cp16(d, src, true);
            } else {
                for (int e = 0; e < 4; ++e) d[e] = (gk < inner && gc + e < cols) ? src[e] : 0.0f;
            }
        }
        hk_cp_commit();
    };
    load(0);
    load(1);
    const int lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WN, wn = warp % WN;
    const int g = lane >> 2, q4 = lane & 3;
    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;
    const float* xa = xs + (wm * 16 + g) * TC_XS + 2 * q4;
    const float* wb = ws + (2 * q4) * WS + wn * 32 + g;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (h == 0) hk_cp_wait_but_last(); else hk_cp_wait_all();
        __syncthreads();
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const int kk = 64 * h + 16 * s;
            const float2 a0 = *(const float2*)(xa + kk);
            const float2 a1 = *(const float2*)(xa + 8 * TC_XS + kk);
            const float2 a2 = *(const float2*)(xa + kk + 8);
            const float2 a3 = *(const float2*)(xa + 8 * TC_XS + kk + 8);
            uint4 ah, al;
            tc_split(a0.x, a0.y, ah.x, al.x);
            tc_split(a1.x, a1.y, ah.y, al.y);
            tc_split(a2.x, a2.y, ah.z, al.z);
            tc_split(a3.x, a3.y, ah.w, al.w);
            unsigned bh[4][2], bl[4][2];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float* b = wb + kk * WS + 8 * j;
                tc_split(b[0], b[WS], bh[j][0], bl[j][0]);
                tc_split(b[8 * WS], b[9 * WS], bh[j][1], bl[j][1]);
            }
            // Term by term over the 4 accumulators (each still xh.wh, xl.wh,
            // xh.wl in that order), so dependent products are not adjacent.
#pragma unroll
            for (int j = 0; j < 4; ++j) st_mma(acc[j], ah, bh[j][0], bh[j][1]);
#pragma unroll
            for (int j = 0; j < 4; ++j) st_mma(acc[j], al, bh[j][0], bh[j][1]);
#pragma unroll
            for (int j = 0; j < 4; ++j) st_mma(acc[j], ah, bl[j][0], bl[j][1]);
        }
    }
    // acc[j]: rows g, g + 8 of the warp tile; columns 8 j + 2 q4, + 1.
    float* p = part + t.u[u][3] + (hk_i64)blockIdx.y * rows * cols;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int c = col0 + wn * 32 + 8 * j + 2 * q4;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int r = row0 + wm * 16 + g + 8 * hr;
            if (r >= rows) continue;
            if (c < cols) p[(hk_i64)r * cols + c] = acc[j][2 * hr];
            if (c + 1 < cols) p[(hk_i64)r * cols + c + 1] = acc[j][2 * hr + 1];
        }
    }
}

extern "C" __global__ void __launch_bounds__(128) matmul_tc16(
    hk_mm_units t, const float* __restrict__ x, float* __restrict__ part, int rows, hk_i64 x_row)
{
    matmul_tc_body<1, 4>(t, x, part, rows, x_row);
}

extern "C" __global__ void __launch_bounds__(128) matmul_tc32(
    hk_mm_units t, const float* __restrict__ x, float* __restrict__ part, int rows, hk_i64 x_row)
{
    matmul_tc_body<2, 2>(t, x, part, rows, x_row);
}

// ---- the tensor-core matmul for many rows ------------------------------------------
//
// matmul_tcb: the same products as matmul_tc16/32 followed by their chunk sums,
// for many rows (prefill), in one launch and with no scratch: block (column
// tile bx, row tile by, product bz) owns a 64 x 128 tile of one product of the
// table and walks all of the product's chunks itself. Each chunk's partial of
// an element is the same mma.sync sequence from 0 as in matmul_tc (the chunk's
// 8 k16 steps in order, three products a step: xh.wh, xl.wh, xh.wl, zeros past
// inner), and the partials are added in chunk order to a total that starts at
// 0, as matmul_chunk_sum / matmul_units_sum add them: so every element has the
// bits of the two-launch path, whichever kernel the row count picks.
//
// Eight warps, 2 x 4, each a 32 x 32 tile (two m16 by four n8 accumulators, and
// as many for the total). The k walk is in stages of TCB_KS = 32 (a quarter
// chunk). Each stage's f32 operands come by cp.async into a raw buffer of a
// TCB_NST ring (stage i + 1 is copied while stage i is used), and are then split
// once for the whole block into bf16 planes (hi, lo) packed two k a word, in the
// layout of the mma fragments: x as [row][k pair], w as [k pair][column]. So every
// fragment register is one 32-bit shared load, and each operand is converted
// once, not once per warp that reads it (the split on the SIMT units was most
// of the issue slots when every warp split its own fragments). The split values
// and the mma sequence are those of matmul_tc, so the bits are too.
// Planes are double-buffered: stage i + 1 is split while slower warps still
// multiply stage i, with two barriers a stage.
// Launch: grid (ceil(max cols / 128), ceil(rows / 64), units); block 256;
// dynamic shared memory TCB_NST x (64 x 32 + 32 x 128) x 4
// + 2 x 2 x (64 x TCB_XP + 16 x TCB_WP) x 4 = 104,448 bytes (two blocks a
// multiprocessor).
#define TCB_KS 32
#define TCB_NST 2
#define TCB_RAW (64 * TCB_KS + TCB_KS * 128)
// Plane row strides in words: 16 pairs + 4 (x), 128 columns + 8 (w), so that a
// warp's fragment loads fall on 32 different banks.
#define TCB_XP (TCB_KS / 2 + 4)
#define TCB_WP (128 + 8)
#define TCB_PLANE (64 * TCB_XP + (TCB_KS / 2) * TCB_WP)

extern "C" __global__ void __launch_bounds__(256, 2) matmul_tcb(
    hk_mm_units t, const float* __restrict__ x, float* __restrict__ out, int rows, hk_i64 x_row, hk_i64 out_row)
{
    HK_DYN_SMEM(float, sm);
    unsigned* planes = (unsigned*)(sm + TCB_NST * TCB_RAW);
    const int u = blockIdx.z;
    const int inner = (int)t.u[u][4];
    const int cols = (int)t.u[u][5];
    const int col0 = blockIdx.x * 128;
    const int row0 = blockIdx.y * 64;
    if (col0 >= cols || row0 >= rows) return;
    const float* xb = x + t.u[u][1];
    const float* w = (const float*)t.u[u][0];
    const int tid = threadIdx.x;
    constexpr int per_chunk = MM_KC / TCB_KS;
    const int stages = per_chunk * ((inner + MM_KC - 1) / MM_KC);
    auto load = [&](int i) {
        if (i < stages) {
            float* xs = sm + (i % TCB_NST) * TCB_RAW;
            float* ws = xs + 64 * TCB_KS;
            const int k0 = TCB_KS * i;
            for (int q = tid; q < 64 * (TCB_KS / 4); q += 256) {
                const int r = q / (TCB_KS / 4), kq = (q % (TCB_KS / 4)) * 4;
                const int gr = row0 + r, gk = k0 + kq;
                float* d = xs + r * TCB_KS + kq;
                const float* src = xb + (hk_i64)gr * x_row + gk;
                if (gr < rows && gk + 3 < inner && ((((unsigned long long)src) & 15) == 0)) {
                    hk_cp16(d, src, true);
                } else {
                    for (int e = 0; e < 4; ++e) d[e] = (gr < rows && gk + e < inner) ? src[e] : 0.0f;
                }
            }
            for (int q = tid; q < TCB_KS * 32; q += 256) {
                const int kk = q / 32, c = (q % 32) * 4;
                const int gk = k0 + kk, gc = col0 + c;
                float* d = ws + kk * 128 + c;
                const float* src = w + (hk_i64)gk * cols + gc;
                if (gk < inner && gc + 3 < cols && ((((unsigned long long)src) & 15) == 0)) {
                    hk_cp16(d, src, true);
                } else {
                    for (int e = 0; e < 4; ++e) d[e] = (gk < inner && gc + e < cols) ? src[e] : 0.0f;
                }
            }
        }
        hk_cp_commit();
    };
    // Stage i's raw operands into plane buffer i % 2: hi at p, lo at p + TCB_PLANE.
    auto split = [&](int i) {
        const float* xs = sm + (i % TCB_NST) * TCB_RAW;
        const float* ws = xs + 64 * TCB_KS;
        unsigned* p = planes + (i % 2) * 2 * TCB_PLANE;
        for (int q = tid; q < 64 * (TCB_KS / 2); q += 256) {
            const int r = q / (TCB_KS / 2), kp = q % (TCB_KS / 2);
            const float2 v = *(const float2*)(xs + r * TCB_KS + 2 * kp);
            unsigned h, l;
            tc_split(v.x, v.y, h, l);
            p[r * TCB_XP + kp] = h;
            p[TCB_PLANE + r * TCB_XP + kp] = l;
        }
        unsigned* pw = p + 64 * TCB_XP;
        for (int q = tid; q < (TCB_KS / 2) * 32; q += 256) {
            const int kp = q / 32, c = (q % 32) * 4;
            const float4 e = *(const float4*)(ws + (2 * kp) * 128 + c);
            const float4 o = *(const float4*)(ws + (2 * kp + 1) * 128 + c);
            uint4 h, l;
            tc_split(e.x, o.x, h.x, l.x);
            tc_split(e.y, o.y, h.y, l.y);
            tc_split(e.z, o.z, h.z, l.z);
            tc_split(e.w, o.w, h.w, l.w);
            *(uint4*)(pw + kp * TCB_WP + c) = h;
            *(uint4*)(pw + TCB_PLANE + kp * TCB_WP + c) = l;
        }
    };
    const int lane = tid & 31, warp = tid >> 5;
    const int wm = warp / 4, wn = warp % 4;
    const int g = lane >> 2, q4 = lane & 3;
    float acc[2][4][4], total[2][4][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][j][i] = total[m][j][i] = 0.0f;
#pragma unroll
    for (int i = 0; i < TCB_NST - 1; ++i) load(i);
    for (int i = 0; i < stages; ++i) {
        load(i + TCB_NST - 1);
        hk_cp_wait_n<TCB_NST - 1>();
        __syncthreads();
        split(i);
        __syncthreads();
        const unsigned* ph = planes + (i % 2) * 2 * TCB_PLANE;
        const unsigned* xh = ph + (wm * 32 + g) * TCB_XP + q4;
        const unsigned* wh = ph + 64 * TCB_XP + q4 * TCB_WP + wn * 32 + g;
#pragma unroll
        for (int s = 0; s < TCB_KS / 16; ++s) {
            unsigned bh[4][2], bl[4][2];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned* b = wh + (8 * s) * TCB_WP + 8 * j;
                bh[j][0] = b[0];
                bh[j][1] = b[4 * TCB_WP];
                bl[j][0] = b[TCB_PLANE];
                bl[j][1] = b[TCB_PLANE + 4 * TCB_WP];
            }
            uint4 ah[2], al[2];
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                const unsigned* a = xh + (m * 16) * TCB_XP + 8 * s;
                ah[m].x = a[0];
                ah[m].y = a[8 * TCB_XP];
                ah[m].z = a[4];
                ah[m].w = a[8 * TCB_XP + 4];
                al[m].x = a[TCB_PLANE];
                al[m].y = a[TCB_PLANE + 8 * TCB_XP];
                al[m].z = a[TCB_PLANE + 4];
                al[m].w = a[TCB_PLANE + 8 * TCB_XP + 4];
            }
            // Term by term over the warp's 8 accumulators: each accumulator
            // still takes xh.wh, xl.wh, xh.wl in that order (the bits of
            // matmul_tc), but 7 independent products now stand between two
            // that depend on each other, instead of none.
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int j = 0; j < 4; ++j) st_mma(acc[m][j], ah[m], bh[j][0], bh[j][1]);
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int j = 0; j < 4; ++j) st_mma(acc[m][j], al[m], bh[j][0], bh[j][1]);
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int j = 0; j < 4; ++j) st_mma(acc[m][j], ah[m], bl[j][0], bl[j][1]);
        }
        if (i % per_chunk == per_chunk - 1) {
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        total[m][j][e] += acc[m][j][e];
                        acc[m][j][e] = 0.0f;
                    }
        }
    }
    hk_cp_wait_all();
    float* o = out + t.u[u][2];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int c = col0 + wn * 32 + 8 * j + 2 * q4;
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int r = row0 + wm * 32 + m * 16 + g + 8 * hr;
                if (r >= rows) continue;
                if (c < cols) o[(hk_i64)r * out_row + c] = total[m][j][2 * hr];
                if (c + 1 < cols) o[(hk_i64)r * out_row + c + 1] = total[m][j][2 * hr + 1];
            }
        }
}

// ---- Hopper: the same matmul on warpgroup products (wgmma, sm_90a) ---------------
//
// matmul_wg computes what matmul_tcb computes, bit for bit, on Hopper's
// warpgroup tensor-core instructions, which read both operands from shared
// memory. Per element, each chunk's partial is one accumulator from 0 over the
// chunk's 8 k16 steps in order, three products a step (xh.wh, then xl.wh,
// then xh.wl), added at the chunk's end to a total that starts at 0:
// matmul_tc's sequence (a wgmma k16 step sums in the order of an mma.sync
// one; cuda_check holds the rows of the two kernels bit for bit).
//
// Three launches. mwg_pack_x and mwg_pack_w split the f32 operands once into
// bf16 planes (hi, lo; tc_split) laid out as the instruction's K-major core
// matrices: a tile of 128 rows (x) or columns (w) by one k-step is 8 KB, hi
// then lo, each 16 groups of 8 rows, each two core matrices of 8 x 8 (k 0-7,
// then 8-15; 128 bytes each). Tiles go k-step after k-step for one block of
// 128 rows or columns, zeros past rows, columns and inner up to a whole chunk,
// so a block's operands for a stage of k are one contiguous run. matmul_wg
// then only copies: block (column tile bx, row tile by, product bz) owns a
// 128 x 128 tile (two warpgroups of 64 rows) and walks all of the product's
// chunks in stages of two k-steps through a ring of MWG_NST shared-memory
// buffers that cp.async fills MWG_NST - 2 stages ahead; a stage's products
// run while the next stage's copies land, and are waited for at the chunk's
// end to add the chunk to the total. Splitting inside the product kernel
// (each operand split again by every block that reads it) ran at a quarter
// of this.
//
// Packed layout of product u (the units table's order): x at byte offset
// 8192 * MT * sum_{v < u} KT_v (or 0 for every product when they share one
// block of x), w at 8192 * sum_{v < u} NT_v KT_v, where MT, NT_v and KT_v
// count 128-row tiles, 128-column tiles and k-steps (a whole number of
// chunks). Only compiled where prelude.h declares the wgmma helpers
// (HK_WGMMA); elsewhere the Rust side launches matmul_tcb.
#ifdef HK_WGMMA
#define MWG_TILE 8192                      // bytes of one 128 x 16 tile, both planes
#define MWG_NST 6                          // ring buffers of one stage (2 k-steps of x and w)
#define MWG_STAGE (4 * MWG_TILE)
#define MWG_SMEM (MWG_NST * MWG_STAGE)

// K-steps of product u (whole chunks of MM_KC) and its 128-wide tiles of columns.
static __device__ __forceinline__ int mwg_kt(const hk_mm_units& t, int u) { return (int)((t.u[u][4] + MM_KC - 1) / MM_KC) * (MM_KC / 16); }
static __device__ __forceinline__ int mwg_nt(const hk_mm_units& t, int u) { return (int)((t.u[u][5] + 127) / 128); }
// Byte offsets of product u's packed x (mt_n row tiles) and w.
static __device__ __forceinline__ hk_i64 mwg_x_at(const hk_mm_units& t, int u, int mt_n, int x_shared) {
    hk_i64 k = 0;
    if (!x_shared)
        for (int v = 0; v < u; ++v) k += mwg_kt(t, v);
    return k * mt_n * MWG_TILE;
}
static __device__ __forceinline__ hk_i64 mwg_w_at(const hk_mm_units& t, int u) {
    hk_i64 k = 0;
    for (int v = 0; v < u; ++v) k += (hk_i64)mwg_nt(t, v) * mwg_kt(t, v);
    return k * MWG_TILE;
}

// One packed 16 bytes of each plane from 8 floats (k in order).
static __device__ __forceinline__ void mwg_put(unsigned char* o, const float* v) {
    uint4 h, l;
    tc_split(v[0], v[1], h.x, l.x);
    tc_split(v[2], v[3], h.y, l.y);
    tc_split(v[4], v[5], h.z, l.z);
    tc_split(v[6], v[7], h.w, l.w);
    *(uint4*)o = h;
    *(uint4*)(o + MWG_TILE / 2) = l;
}

// x's tile (row tile by, k-step bx) of product bz (of product 0 when they
// share x): thread (r, c, j) makes row 8 j + r, k 8 c .. 8 c + 7.
// Launch: grid (max KT, MT, x_shared ? 1 : units); block 256.
extern "C" __global__ void mwg_pack_x(hk_mm_units t, const float* __restrict__ x, hk_i64 x_row, int rows, int x_shared, unsigned char* __restrict__ xp) {
    const int u = blockIdx.z, kt = blockIdx.x, mt = blockIdx.y;
    const int KT = mwg_kt(t, u);
    if (kt >= KT) return;
    const int inner = (int)t.u[u][4];
    const int r = threadIdx.x & 7, c = (threadIdx.x >> 3) & 1, j = threadIdx.x >> 4;
    const int row = mt * 128 + 8 * j + r, k0 = kt * 16 + 8 * c;
    const float* src = x + t.u[u][1] + (hk_i64)row * x_row;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = row < rows && k0 + e < inner ? src[k0 + e] : 0.0f;
    mwg_put(xp + mwg_x_at(t, u, gridDim.y, x_shared) + ((hk_i64)mt * KT + kt) * MWG_TILE + j * 256 + c * 128 + r * 16, v);
}

// w's tile (column tile by, k-step bx) of product bz: thread (r, j, c) makes
// column 8 j + r, k 8 c .. 8 c + 7 (a warp reads 32 consecutive columns of a
// row of w at a time). Launch: grid (max KT, max NT, units); block 256.
extern "C" __global__ void mwg_pack_w(hk_mm_units t, unsigned char* __restrict__ wp) {
    const int u = blockIdx.z, kt = blockIdx.x, nt = blockIdx.y;
    const int KT = mwg_kt(t, u);
    if (kt >= KT || nt >= mwg_nt(t, u)) return;
    const float* w = (const float*)t.u[u][0];
    const int inner = (int)t.u[u][4], cols = (int)t.u[u][5];
    const int r = threadIdx.x & 7, j = (threadIdx.x >> 3) & 15, c = threadIdx.x >> 7;
    const int n = nt * 128 + 8 * j + r, k0 = kt * 16 + 8 * c;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = n < cols && k0 + e < inner ? w[(hk_i64)(k0 + e) * cols + n] : 0.0f;
    mwg_put(wp + mwg_w_at(t, u) + ((hk_i64)nt * KT + kt) * MWG_TILE + j * 256 + c * 128 + r * 16, v);
}

// d[64] += A (64 x 16, desc a) . B (16 x 128, desc b), both K-major in shared memory.
static __device__ __forceinline__ void mwg_mma(float* d, unsigned long long a, unsigned long long b) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %66, 0; wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0; }"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(a), "l"(b), "r"(1) : "memory");
}
static __device__ __forceinline__ void mwg_hold(float* d) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Launch: grid (ceil(max cols / 128), MT, units); block 256; dynamic shared
// memory MWG_SMEM bytes (one block a multiprocessor).
extern "C" __global__ void __launch_bounds__(256, 1) matmul_wg(
    hk_mm_units t, const unsigned char* __restrict__ xp, const unsigned char* __restrict__ wp, int x_shared,
    float* __restrict__ out, int rows, hk_i64 out_row)
{
    HK_DYN_SMEM(uint4, sm);
    unsigned char* ring = (unsigned char*)sm;
    const int u = blockIdx.z;
    const int cols = (int)t.u[u][5];
    const int col0 = blockIdx.x * 128, row0 = blockIdx.y * 128;
    if (col0 >= cols || row0 >= rows) return;
    const int KT = mwg_kt(t, u);
    const uint4* xs = (const uint4*)(xp + mwg_x_at(t, u, gridDim.y, x_shared) + (hk_i64)blockIdx.y * KT * MWG_TILE);
    const uint4* ws = (const uint4*)(wp + mwg_w_at(t, u) + (hk_i64)blockIdx.x * KT * MWG_TILE);
    const int tid = threadIdx.x;
    const int stages = KT / 2;
    // Stage i (k-steps 2i, 2i + 1) into buffer i % MWG_NST: x's two tiles, then w's.
    auto load = [&](int i) {
        if (i < stages) {
            uint4* b = (uint4*)(ring + (i % MWG_NST) * MWG_STAGE);
            const uint4* xa = xs + (hk_i64)i * (2 * MWG_TILE / 16);
            const uint4* wa = ws + (hk_i64)i * (2 * MWG_TILE / 16);
#pragma unroll
            for (int q = tid; q < 2 * MWG_TILE / 16; q += 256) {
                hk_cp16(b + q, xa + q, true);
                hk_cp16(b + 2 * MWG_TILE / 16 + q, wa + q, true);
            }
        }
        hk_cp_commit();
    };
    const int warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
    float d[64], total[64];
#pragma unroll
    for (int e = 0; e < 64; ++e) d[e] = total[e] = 0.0f;
#pragma unroll
    for (int i = 0; i < MWG_NST - 2; ++i) load(i);
    constexpr int per_chunk = MM_KC / 32;
    for (int ch = 0; ch < stages / per_chunk; ++ch) {
        // A chunk's stages unrolled, so that its accumulator is only ever
        // written by the tensor cores between the zeroing and the chunk's
        // final wait (a branch on the stage left ptxas waiting every stage).
#pragma unroll
        for (int s = 0; s < per_chunk; ++s) {
            const int i = ch * per_chunk + s;
            hk_cp_wait_n<MWG_NST - 3>();  // this thread's copies of stage i are in
            st_proxy_fence();             // ... visible to the tensor cores
            __syncthreads();              // ... every thread's; stage i - 2's products are done
            load(i + MWG_NST - 2);        // (into stage i - 2's buffer)
            const unsigned char* b = ring + (i % MWG_NST) * MWG_STAGE;
            st_wg_fence();
#pragma unroll
            for (int ks = 0; ks < 2; ++ks) {
                const unsigned char* xa = b + ks * MWG_TILE + wg * 2048;
                const unsigned char* wa = b + 2 * MWG_TILE + ks * MWG_TILE;
                const unsigned long long xh = st_wg_desc(xa), xl = st_wg_desc(xa + MWG_TILE / 2);
                const unsigned long long wh = st_wg_desc(wa), wl = st_wg_desc(wa + MWG_TILE / 2);
                mwg_mma(d, xh, wh);
                mwg_mma(d, xl, wh);
                mwg_mma(d, xh, wl);
            }
            st_wg_commit();
            if (s < per_chunk - 1) st_wg_wait1();  // stage i - 1's products are done
        }
        st_wg_wait0();
        mwg_hold(d);
#pragma unroll
        for (int e = 0; e < 64; ++e) {
            total[e] += d[e];
            d[e] = 0.0f;
        }
    }
    hk_cp_wait_all();
    // Accumulator element 4 j + e of lane 4 g + q4 in warp w of the warpgroup:
    // row 16 w + g + 8 (e / 2), column 8 j + 2 q4 + e % 2.
    float* o = out + t.u[u][2];
    const int g = lane >> 2, q4 = lane & 3;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int c = col0 + 8 * j + 2 * q4;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int r = row0 + wg * 64 + (warp & 3) * 16 + g + 8 * hr;
            if (r >= rows) continue;
            if (c < cols) o[(hk_i64)r * out_row + c] = total[4 * j + 2 * hr];
            if (c + 1 < cols) o[(hk_i64)r * out_row + c + 1] = total[4 * j + 2 * hr + 1];
        }
    }
}
#endif  // HK_WGMMA

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
