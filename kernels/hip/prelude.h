// Prelude of the HIP/CUDA-common kernel sources in kernels/hip/.
//
// Every *.hip file here is written in the subset that both Debian's hipcc
// (HIP 5.2, clang) and NVRTC (CUDA 13) compile. This header maps the few
// spellings that differ, so the kernels themselves never test the compiler:
//   - hipcc: build.rs passes `-include prelude.h`; this hipcc does not put the
//     HIP runtime header in front of a source by itself, so it is included here
//     (threadIdx, __syncthreads, __forceinline__ come from it).
//   - NVRTC: the Rust side (src/gpu/cuda.rs) prepends this text to the sources;
//     NVRTC has the CUDA builtins without any header, and no standard header is
//     used anywhere (NVRTC has none).
//
// Conventions shared by every kernel:
//   - A "warp" here is 32 lanes, on both vendors. On AMD's 64-wide waves the
//     shuffles below run on 32-lane halves (the `width` argument), so a block
//     of 32 * n threads is n logical warps everywhere and every reduction tree
//     is the same on both.
//   - Reductions have a fixed order (no atomics): the same input gives the same
//     bits on every run, and a row, head or slot is computed by a block whose
//     shape depends only on the op's widths, never on the batch size.
//   - 16-bit storage types are `unsigned short` bit patterns with conversions
//     equal to kernels/src/dtype.rs (round to nearest, ties to even).
#ifndef HANDOFF_PRELUDE_H
#define HANDOFF_PRELUDE_H

#ifdef __HIPCC__
#include <hip/hip_runtime.h>
#define HK_SHFL_XOR(v, m) __shfl_xor((v), (m), 32)
#else
#define HK_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m), 32)
#endif

#define HK_WARP 32
// A warp's lanes meet (shared-memory writes before it seen by reads after).
// The HIP spelling is the block barrier: its callers reach it from loops
// every warp runs alike, and HIP's own warp barrier differs between versions.
#ifdef __HIPCC__
#define HK_SYNCWARP() __syncthreads()
#else
#define HK_SYNCWARP() __syncwarp()
#endif

// The first statement of every kernel of the fused decode step. The step
// launches each kernel but its first as a programmatic dependent of the one
// before (CUDA's programmatic dependent launch, sm_90): the next kernel's
// blocks are launched while this one's last blocks still run, and wait here
// until it has completed and its writes are visible. Nothing of a kernel
// runs before the wait, so the bits and the order of every read and write are
// those of plain stream order; only the launch latency between two kernels
// is hidden. Every block calls it, so that a kernel cannot complete before
// the one it follows (the chain then orders each kernel after all earlier
// ones). It then lets the next kernel launch at once (its blocks take free
// multiprocessors and wait in turn). A no-op where the kernel was launched
// without the attribute, and on HIP and before sm_90, where it is empty.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && !defined(__HIPCC__)
#define HK_GRID_DEP()                                         \
    do {                                                      \
        asm volatile("griddepcontrol.wait;" ::: "memory");    \
        asm volatile("griddepcontrol.launch_dependents;" ::); \
    } while (0)
#else
#define HK_GRID_DEP() \
    do {              \
    } while (0)
#endif

typedef long long hk_i64;
typedef unsigned short hk_bf16;
typedef unsigned short hk_f16;

// Infinities without <math.h>: bit patterns.
#define HK_INF_F (__int_as_float(0x7f800000))
#define HK_NEG_INF_F (__int_as_float((int)0xff800000u))
#define HK_NEG_INF_D (__longlong_as_double((long long)0xfff0000000000000ull))

// Dynamic shared memory: one declaration of one type for every kernel of the
// program (NVRTC compiles all sources as one unit, and two `extern __shared__`
// arrays of one name and different types would conflict). double gives 8-byte
// alignment; kernels cast.
// (tools/kernel_emu defines its own first.)
#ifndef HK_DYN_SMEM
#define HK_DYN_SMEM(type, name)                  \
    extern __shared__ double hk_dyn_smem[];      \
    type* name = (type*)hk_dyn_smem
#endif

// ---- scalar math, in the operation order of the CPU reference -------------

// log(1 + e^x), linear above 20 (as torch, FLA and kernels/src/cpu/math.rs).
static __device__ __forceinline__ float hk_softplus(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}

static __device__ __forceinline__ float hk_sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

static __device__ __forceinline__ float hk_silu(float x) {
    return x * hk_sigmoid(x);
}

static __device__ __forceinline__ bool hk_isnan(float x) {
    return x != x;
}

// ---- 16-bit storage conversions (same bit algorithm as src/dtype.rs) ------

static __device__ __forceinline__ hk_bf16 hk_f32_to_bf16(float x) {
    const unsigned int b = __float_as_uint(x);
    if (x != x) return (hk_bf16)((b >> 16) | 0x0040u);  // quiet NaN
    const unsigned int lsb = (b >> 16) & 1u;
    return (hk_bf16)((b + 0x7fffu + lsb) >> 16);  // unsigned add wraps like wrapping_add
}

static __device__ __forceinline__ float hk_bf16_to_f32(hk_bf16 h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

static __device__ __forceinline__ hk_f16 hk_f32_to_f16(float x) {
    const unsigned int b = __float_as_uint(x);
    const unsigned int sign = (b >> 16) & 0x8000u;
    const int exp = (int)((b >> 23) & 0xffu);
    const unsigned int man = b & 0x7fffffu;
    if (exp == 0xff) return (hk_f16)(sign | 0x7c00u | (man != 0 ? 0x200u : 0u));
    const int e = exp - 112;  // rebias 127 -> 15
    if (e >= 0x1f) return (hk_f16)(sign | 0x7c00u);
    if (e <= 0) {
        if (e < -10) return (hk_f16)sign;
        const unsigned int m = man | 0x800000u;
        const unsigned int shift = (unsigned int)(14 - e);
        const unsigned int half = 1u << (shift - 1);
        const unsigned int rem = m & ((1u << shift) - 1);
        unsigned int r = m >> shift;
        if (rem > half || (rem == half && (r & 1u))) r += 1;
        return (hk_f16)(sign | r);
    }
    unsigned int r = (((unsigned int)e) << 10) | (man >> 13);
    const unsigned int rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r += 1;
    return (hk_f16)(sign | r);
}

static __device__ __forceinline__ float hk_f16_to_f32(hk_f16 h) {
    const unsigned int sign = ((unsigned int)(h & 0x8000u)) << 16;
    const unsigned int exp = (h >> 10) & 0x1fu;
    const unsigned int man = h & 0x3ffu;
    if (exp == 0) {
        // Subnormal (or zero): exact as man * 2^-24.
        const float v = (float)man * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (man << 13));
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// ---- reductions -------------------------------------------------------------

// Butterfly sum over the 32 lanes of a logical warp. Every lane ends with the
// same bits: at each level lane x adds v_x + v_(x^m) and its partner adds the
// same two values (addition commutes exactly), so the lanes stay identical.
static __device__ __forceinline__ float hk_warp_sum(float v) {
    v += HK_SHFL_XOR(v, 16);
    v += HK_SHFL_XOR(v, 8);
    v += HK_SHFL_XOR(v, 4);
    v += HK_SHFL_XOR(v, 2);
    v += HK_SHFL_XOR(v, 1);
    return v;
}

static __device__ __forceinline__ double hk_warp_sum_d(double v) {
    v += HK_SHFL_XOR(v, 16);
    v += HK_SHFL_XOR(v, 8);
    v += HK_SHFL_XOR(v, 4);
    v += HK_SHFL_XOR(v, 2);
    v += HK_SHFL_XOR(v, 1);
    return v;
}

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 1024): each
// warp's butterfly, then the warp totals in warp order. Every thread returns the
// total. `red` holds blockDim.x / 32 floats; the trailing barrier lets the
// caller reuse `red` at once.
static __device__ float hk_block_sum(float v, float* red) {
    const unsigned nw = blockDim.x / HK_WARP;
    v = hk_warp_sum(v);
    if ((threadIdx.x & (HK_WARP - 1)) == 0) red[threadIdx.x / HK_WARP] = v;
    __syncthreads();
    float total = 0.0f;
    for (unsigned w = 0; w < nw; ++w) total += red[w];
    __syncthreads();
    return total;
}

// ---- lane exchange and asynchronous copies ---------------------------------------

#ifdef __HIPCC__
#define HK_SHFL_IDX(v, src) __shfl((v), (src), 32)
#define HK_ANY(p) __any(p)
#else
#define HK_SHFL_IDX(v, src) __shfl_sync(0xffffffffu, (v), (src), 32)
#define HK_ANY(p) __any_sync(0xffffffffu, (p))
#endif

// 16-byte global -> shared copy (zero-filled when !valid), asynchronous on
// CUDA (cp.async, completed by hk_cp_wait*), a plain copy on HIP.
static __device__ __forceinline__ void hk_cp16(void* dst, const void* src, bool valid) {
#ifdef __HIPCC__
    uint4 v;
    v.x = v.y = v.z = v.w = 0u;
    if (valid) v = *(const uint4*)src;
    *(uint4*)dst = v;
#else
    unsigned s;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(s) : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src), "r"(valid ? 16 : 0) : "memory");
#endif
}

static __device__ __forceinline__ void hk_cp_commit() {
#ifndef __HIPCC__
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits for every committed copy group.
static __device__ __forceinline__ void hk_cp_wait_all() {
#ifndef __HIPCC__
    asm volatile("cp.async.wait_group 0;" ::: "memory");
#endif
}

// Waits for every committed copy group but the latest.
static __device__ __forceinline__ void hk_cp_wait_but_last() {
#ifndef __HIPCC__
    asm volatile("cp.async.wait_group 1;" ::: "memory");
#endif
}

// Waits for every committed copy group but the latest N.
template <int N>
static __device__ __forceinline__ void hk_cp_wait_n() {
#ifndef __HIPCC__
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// ---- the tensor-core product (dense.hip's matmul, step.hip's products) ----------

// c += a . b for one m16n8k16 tile (bf16 in, f32 accumulate).
static __device__ __forceinline__ void st_mma(float* c, uint4 a, unsigned b0, unsigned b1) {
#ifdef __HIPCC__
    // The same product by shuffles, in the PTX fragment layout (the HIP build
    // is compiled, not run; its sum order is its own).
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const unsigned ar[4] = {a.x, a.y, a.z, a.w};
    for (int k = 0; k < 16; ++k) {
        const int src_t = (k & 7) >> 1, hw = k & 1, kh = k >> 3;
        // A[g][k] and A[g + 8][k]: registers kh * 2 + {0, 1} of lane 4g + src_t.
        unsigned a_lo = 0, a_hi = 0;
        for (int q = 0; q < 4; ++q) {
            const unsigned v0 = __shfl(ar[q], g * 4 + src_t, 32);
            if (q == 2 * kh) a_lo = v0;
            if (q == 2 * kh + 1) a_hi = v0;
        }
        const float x0 = hk_bf16_to_f32((unsigned short)(hw ? a_lo >> 16 : a_lo & 0xffffu));
        const float x1 = hk_bf16_to_f32((unsigned short)(hw ? a_hi >> 16 : a_hi & 0xffffu));
        // B[k][2t] and B[k][2t + 1]: register kh of lanes 4 (2t) + src_t and 4 (2t + 1) + src_t.
        const unsigned bsel = kh ? b1 : b0;
        const unsigned y0r = __shfl(bsel, (2 * t) * 4 + src_t, 32);
        const unsigned y1r = __shfl(bsel, (2 * t + 1) * 4 + src_t, 32);
        const float y0 = hk_bf16_to_f32((unsigned short)(hw ? y0r >> 16 : y0r & 0xffffu));
        const float y1 = hk_bf16_to_f32((unsigned short)(hw ? y1r >> 16 : y1r & 0xffffu));
        c[0] = fmaf(x0, y0, c[0]);
        c[1] = fmaf(x0, y1, c[1]);
        c[2] = fmaf(x1, y0, c[2]);
        c[3] = fmaf(x1, y1, c[3]);
    }
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
#endif
}

// ---- f32 products on the tensor cores as three TF32 products (kda_chunk.hip) -------
//
// x = hi + lo with hi = x cut to TF32 (its low 13 bits cleared: x - hi is
// exact and below 2^-10 |x|) and lo = x - hi cut the same way carries 20 of
// f32's 24 significand bits; a . b ~ hi_a hi_b + hi_a lo_b + lo_a hi_b leaves
// out lo_a lo_b and the cut of lo (each below 2^-20 of the product), so three
// m16n8k8 TF32 products give an f32 product to a few ulp, as CUTLASS's
// 3xTF32 does. Cutting, not cvt.rna.tf32.f32: sm_90 has no instruction for
// that conversion, and its four-instruction expansion (a finiteness test,
// add, select, mask), twice a value, was most of the state walk's
// instructions (tools/sass.py); a cut is one mask.

// x cut to TF32 (10 mantissa bits, toward zero), as f32 bits.
static __device__ __forceinline__ unsigned hk_tf32(float x) { return __float_as_uint(x) & 0xffffe000u; }

// The two TF32 parts of x (above).
static __device__ __forceinline__ void hk_tf32_split(float x, unsigned& hi, unsigned& lo) {
    hi = hk_tf32(x);
    lo = hk_tf32(x - __uint_as_float(hi));
}

// c += a . b for one m16n8k8 tile, TF32 in (f32 bits cut by hk_tf32), f32
// accumulate. Fragments (g = lane / 4, t = lane % 4): a = A[g][t], A[g + 8][t],
// A[g][t + 4], A[g + 8][t + 4]; b = B[t][g], B[t + 4][g]; c = C[g][2t],
// C[g][2t + 1], C[g + 8][2t], C[g + 8][2t + 1].
static __device__ __forceinline__ void hk_mma_tf32(float* c, const unsigned* a, unsigned b0, unsigned b1) {
#ifdef __HIPCC__
    // The same product by shuffles, in the PTX fragment layout (the tensor
    // core's sum order is its own; this one goes over k in order).
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    for (int k = 0; k < 8; ++k) {
        const int src = k & 3, upper = k >> 2;
        const float x0 = __uint_as_float(__shfl(upper ? a[2] : a[0], g * 4 + src, 32));      // A[g][k]
        const float x1 = __uint_as_float(__shfl(upper ? a[3] : a[1], g * 4 + src, 32));      // A[g + 8][k]
        const float y0 = __uint_as_float(__shfl(upper ? b1 : b0, (2 * t) * 4 + src, 32));    // B[k][2t]
        const float y1 = __uint_as_float(__shfl(upper ? b1 : b0, (2 * t + 1) * 4 + src, 32));  // B[k][2t + 1]
        c[0] = fmaf(x0, y0, c[0]);
        c[1] = fmaf(x0, y1, c[1]);
        c[2] = fmaf(x1, y0, c[2]);
        c[3] = fmaf(x1, y1, c[3]);
    }
#else
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// c += a . b in 3xTF32 (above), a already split (hk_tf32_split of each of its
// four values), b as f32: the small products into `small` and the large one
// into `c`, so that the caller adds small to c once at the end (the same sum
// for every launch).
static __device__ __forceinline__ void hk_mma_3xtf32(float* c, float* small, const unsigned* ah, const unsigned* al, float b0, float b1) {
    unsigned bh0, bl0, bh1, bl1;
    hk_tf32_split(b0, bh0, bl0);
    hk_tf32_split(b1, bh1, bl1);
    hk_mma_tf32(small, al, bh0, bh1);
    hk_mma_tf32(small, ah, bl0, bl1);
    hk_mma_tf32(c, ah, bh0, bh1);
}

// ---- the fused decode step's operands and cache values (step.hip, mla.hip) ------
//
// Packed A operand of the tensor-core products: kernels/src/step.rs's a_index.

// bf16 element index of A[m][k] within one plane of a [*, 16 KT] operand:
// tile (m / 16, k / 16) of 256 values, tile index mt * KT + kt; in a tile the
// four 8 x 8 core matrices (rows 0-7, then 8-15, 256 bytes apart; k 0-7, then
// 8-15, 128 bytes apart), each row's 8 k in 16 contiguous bytes. That is
// wgmma's K-major layout with no swizzle, so the warpgroup product copies a
// tile as it is; read as 32-bit words, the mma.sync A fragment of lane L is
// words L, L + 64, L + 32, L + 96 of the tile (st_a_frag).
static __device__ __forceinline__ hk_i64 st_a_at(int m, int k, int KT) {
    const int mt = m >> 4, r = m & 15, kt = k >> 4, c = k & 15;
    return ((hk_i64)mt * KT + kt) * 256 + (r >> 3) * 128 + (c >> 3) * 64 + (r & 7) * 8 + (c & 7);
}

// The mma.sync A fragment (a0..a3: rows g and g + 8 by k 2t.. and 2t + 8..)
// of lane `lane` from a packed tile's 128 words (coalesced 32-bit loads).
static __device__ __forceinline__ uint4 st_a_frag(const unsigned* t, int lane) {
    uint4 a;
    a.x = t[lane];
    a.y = t[64 + lane];
    a.z = t[32 + lane];
    a.w = t[96 + lane];
    return a;
}

// Writes x as the A operand element (m, k): its bf16 rounding in plane 0 and,
// with two planes, the bf16 rounding of the rest in plane 1.
static __device__ __forceinline__ void st_pack(
    unsigned short* a, hk_i64 plane, int planes, int m, int k, int KT, float x)
{
    const hk_i64 at = st_a_at(m, k, KT);
    const unsigned short hi = hk_f32_to_bf16(x);
    a[at] = hi;
    if (planes > 1) a[plane + at] = hk_f32_to_bf16(x - hk_bf16_to_f32(hi));
}

// ---- the step's RMSNorm (st_rms_pack, st_reduce_rms) ----------------------------

// Fixed-order mean square of one row (hk_block_sum's order).
static __device__ float st_inv_rms(const float* x, int dim, float eps, float* red) {
    float ss = 0.0f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) ss += x[c] * x[c];
    const float ms = hk_block_sum(ss, red) / (float)dim;
    return 1.0f / sqrtf(ms + eps);
}

// RMSNorm of row b of h, written as the A operand of the next product (akt
// k tiles: dim padded to whole k-steps). A row of up to ST_RMS_V x 256
// values is read once into registers, every load issued before the first
// use: the strided loop (load, add, next) waited on each load in turn, twice
// a row, and took 8.5 us a launch for one row of 2048 on the H200. The sums
// are st_inv_rms's, in its order. Launch: grid (rows); block 256.
#define ST_RMS_V 16
// The body of st_rms_pack for row b, called by every thread of a block of
// blockDim.x threads (st_reduce_rms runs it after its sums).
static __device__ __forceinline__ void st_rms_pack_row(
    const float* __restrict__ h, const float* __restrict__ w,
    unsigned short* __restrict__ a, hk_i64 a_plane, int planes, int dim, int akt, float eps, int b, float* red)
{
    const float* x = h + (hk_i64)b * dim;
    if (dim > ST_RMS_V * (int)blockDim.x) {
        const float r = st_inv_rms(x, dim, eps, red);
        for (int c = threadIdx.x; c < dim; c += blockDim.x) st_pack(a, a_plane, planes, b, c, akt, x[c] * r * w[c]);
        return;
    }
    float v[ST_RMS_V], g[ST_RMS_V];
#pragma unroll
    for (int i = 0; i < ST_RMS_V; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        v[i] = c < dim ? x[c] : 0.0f;
        g[i] = c < dim ? w[c] : 0.0f;
    }
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < ST_RMS_V; ++i)
        if (threadIdx.x + i * blockDim.x < dim) ss += v[i] * v[i];
    const float r = 1.0f / sqrtf(hk_block_sum(ss, red) / (float)dim + eps);
#pragma unroll
    for (int i = 0; i < ST_RMS_V; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < dim) st_pack(a, a_plane, planes, b, c, akt, v[i] * r * g[i]);
    }
}

// ---- region values --------------------------------------------------------------

// Storage dtype codes: 0 f32, 1 bf16, 2 f16 (kernels/src/dtype.rs).
static __device__ __forceinline__ float st_ld(const unsigned char* p, int dt) {
    if (dt == 0) return *(const float*)p;
    const unsigned short v = *(const unsigned short*)p;
    return dt == 1 ? hk_bf16_to_f32(v) : hk_f16_to_f32(v);
}

static __device__ __forceinline__ void st_st(unsigned char* p, int dt, float x) {
    if (dt == 0) *(float*)p = x;
    else *(unsigned short*)p = dt == 1 ? hk_f32_to_bf16(x) : hk_f32_to_f16(x);
}

static __device__ __forceinline__ int st_ebytes(int dt) { return dt == 0 ? 4 : 2; }

// ---- Hopper's warpgroup products (wgmma, sm_90a) ----------------------------------
//
// Declared for an sm_90a device pass and for nvcc's host pass (the probes
// launch the templates that use them); absent from every other build (HIP, a
// plain sm_XY pass), whose kernels without them are the fallbacks.
#if (defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)) && !defined(__HIPCC__)
#define HK_WGMMA 1

// The descriptor of a K-major operand in shared memory with no swizzle: core
// matrices of 8 rows x 16 bytes (128 contiguous bytes), the next along k 128
// bytes on (LBO), the next 8 rows 256 bytes on (SBO).
static __device__ __forceinline__ unsigned long long st_wg_desc(const void* smem) {
    unsigned s;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(s) : "l"(smem));
    return (unsigned long long)((s >> 4) & 0x3fff) | ((unsigned long long)(128 >> 4) << 16) | ((unsigned long long)(256 >> 4) << 32);
}
static __device__ __forceinline__ void st_wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
static __device__ __forceinline__ void st_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
static __device__ __forceinline__ void st_wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
static __device__ __forceinline__ void st_wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
// Shared-memory writes of this thread made visible to the tensor cores' reads.
static __device__ __forceinline__ void st_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#endif  // sm_90a

#endif  // HANDOFF_PRELUDE_H
