// KDA prefill in chunks of 64 tokens on the device: the chunked form of
// kernels/src/cpu/kda.rs (prefill_chunked, whose doc comment gives the math).
// Needs prelude.h in front.
//
// Why three kernels. The recurrent prefill (kda.hip) walks the tokens one by
// one: one barrier-separated state update per token, and only heads x dv / 32
// blocks for the whole sequence, so a long prompt runs at the latency of T
// dependent steps. In the chunked form most of the work of a chunk does not
// need the state entering it: the prepared q^, k^, g, the cumulative decay
// Gam, the C x C matrices A and P and the triangular solve depend on the
// chunk's own tokens only. The solve is linear in its right-hand side, so
//   u = (I + A)^-1 beta (v - S_0^T (e^Gam k^)) = U0 - W S_0,
//   U0 = (I + A)^-1 diag(beta) V,   W = (I + A)^-1 diag(beta) (e^Gam k^),
// and the part that does depend on S_0 is three products with it and one with
// P. Of those only two feed the next chunk's state. So:
//   kda_chunk_prep   one block per (chunk, head), all chunks at once: the
//                    per-token preparation, Gam, A and P (exponentials of the
//                    differences Gam_t - Gam_s <= 0 only, as on the CPU, so no
//                    decay however strong overflows), the forward substitution
//                    of the dk + dv columns of [diag(beta) e^Gam k^ | diag(beta) V]
//                    (one column per thread, the 64 unknowns in registers), and
//                    e^Gam q^, e^(Gam_last - Gam) k^, e^Gam_last into a workspace;
//   kda_chunk_state  one block per (head, 16-column tile of the values), walking
//                    the chunks in order, the only sequential part: u = U0 - W S,
//                    the state entering the chunk saved, S = e^Gam_last S +
//                    (e^(Gam_last - Gam) k^)^T u. Value columns are independent
//                    (as in kda.hip), so narrow tiles give more blocks on the
//                    sequential part without any cross-block reduction;
//   kda_chunk_out    one block per (chunk, head, 64 value columns), all chunks
//                    at once: o = (e^Gam q^) S_c + P u from the saved states.
// Every sum has a fixed order (key channels, then tokens, in index order, one
// thread per output element): the result depends on the sequence only, never
// on the launch, and two runs give the same bits. It agrees with the CPU's
// chunked form to rounding (fused multiply-adds; the solve applied to the two
// parts of the right-hand side separately), not bit for bit.
//
// Several prompts at once. Both kernels take a sequence table: sequence i is
// rows seg[4i] .. + seg[4i + 1] - 1 of the inputs, out and record, its chunks
// are numbers seg[4i + 2] .. of the workspace, and its state is number
// seg[4i + 3] of `state`; after the nseq entries, one int per chunk names its
// sequence. kda_chunk_prep and kda_chunk_out run over every chunk of every
// sequence, and kda_chunk_state one block per (head, value tile, sequence). A sequence's
// arithmetic does not depend on the others, so one launch over a batch of
// prompts gives each the bits it gets alone.
//
// Limits (the Rust side keeps the recurrent kernel otherwise): dk <= 128 (key
// channels are padded to 128 with zeros, which add nothing); any dv (tiles);
// tokens >= 1 (the last chunk may be short: its missing tokens are zero rows
// with g = 0, which leave every sum unchanged).
//
// Workspace (floats; Tp = chunks * 64, chunks summed over the sequences),
// written in full by kda_chunk_prep but for the last part:
//   W  [H][Tp][128]   U0 [H][Tp][dv] (kda_chunk_state writes u over it)
//   e^Gam q^ [H][Tp][128]  e^(Gam_last - Gam) k^ [H][Tp][128]
//   P [H][chunks][64][64] (zero above the diagonal)  e^Gam_last [H][chunks][128]
//   hs [H][chunks][dv][128] (the state entering each chunk, column by column;
//   written by kda_chunk_state)
// in that order (kda_chunk_ws below); the host sizes it the same way.

#define KC_C 64          // chunk length (kernels/src/cpu/kda.rs KDA_CHUNK)
#define KC_DK 128        // key channels, padded
#define KC_THREADS 256
#define KC_LD1 (KC_DK + 4)  // row stride of q^, k^, Gam in kda_chunk_prep (4 g + t: step 3d's fragments hit 32 banks)
#define KC_IN_PAIRS (4 * 136)  // kda_chunk_prep: the pairs s <= t within the four 16-token subchunks
#define KC_IN_PER_THREAD ((KC_IN_PAIRS + KC_THREADS - 1) / KC_THREADS)
#define KC_TILE 16          // value columns per kda_chunk_state block
#define KC_LDW (KC_DK + 4)  // row stride of the 128-wide operands in shared memory
#define KC_LDP (KC_C + 4)   // row stride of P in kda_chunk_out
#define KC_LDA (KC_C + 4)   // row stride of A in kda_chunk_prep's step 4
#define KC_LDL 20           // row stride of the L_b^-1 in kda_chunk_prep (20 g + t: 32 banks)
#define KC_L2_EPS 1e-6f

// e^x for the prep's exponents, all <= 0 (differences Gam_t - Gam_s with s
// <= t: Gam only falls): one ex2.approx (relative error below 2^-21) after
// one multiply, where expf's accurate form costs about eight instructions and
// the prep takes some 100K a chunk. Results below 2^-126 flush to zero.
static __device__ __forceinline__ float kc_exp(float x) {
#ifdef __HIPCC__
    return exp2f(x * 1.4426950408889634f);
#else
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x * 1.4426950408889634f));
    return r;
#endif
}

// c += a . b in 3xTF32 as hk_mma_3xtf32 does, with the two small products
// into two accumulators of their own: three independent chains, so that a
// warp's next tensor-core product need not wait for its last.
static __device__ __forceinline__ void kc_mma3(float* c, float* s1, float* s2, const unsigned* ah, const unsigned* al, float b0, float b1) {
    unsigned bh0, bl0, bh1, bl1;
    hk_tf32_split(b0, bh0, bl0);
    hk_tf32_split(b1, bh1, bl1);
    hk_mma_tf32(s1, al, bh0, bh1);
    hk_mma_tf32(s2, ah, bl0, bl1);
    hk_mma_tf32(c, ah, bh0, bh1);
}

struct KdaChunkWs {
    float* w;
    float* u0;
    float* qg;
    float* kd;
    float* p;
    float* dc;
    float* hs;
};

static __device__ __forceinline__ KdaChunkWs kda_chunk_ws(float* ws, int heads, int chunks, int dv) {
    const hk_i64 tp = (hk_i64)chunks * KC_C;
    KdaChunkWs r;
    r.w = ws;
    r.u0 = r.w + (hk_i64)heads * tp * KC_DK;
    r.qg = r.u0 + (hk_i64)heads * tp * dv;
    r.kd = r.qg + (hk_i64)heads * tp * KC_DK;
    r.p = r.kd + (hk_i64)heads * tp * KC_DK;
    r.dc = r.p + (hk_i64)heads * chunks * KC_C * KC_C;
    r.hs = r.dc + (hk_i64)heads * chunks * KC_DK;
    return r;
}

// Phase 1: everything of chunk blockIdx.x (of all sequences), head blockIdx.y
// that does not need the state. Writes k^ and g of the record (u comes from
// kda_chunk_state).
// Launch: grid (chunks, heads); block KC_THREADS; dynamic shared memory
// (3 * 64 * KC_LD1 + 64 + 6 * KC_DK) floats.
// Shared memory: q^, k^, Gam [64][KC_LD1], beta [64], Gam at the subchunk
// ends [3][KC_DK] and the middle factors [3][KC_DK] (step 3); from barrier D
// the first three hold step 3's factored operands, and after barrier E the
// q^ region holds A [64][64].
extern "C" __global__ void __launch_bounds__(KC_THREADS, 2) kda_chunk_prep(
    const float* __restrict__ q,        // [T, H, dk]
    const float* __restrict__ k,        // [T, H, dk]
    const float* __restrict__ v,        // [T, H, dv]
    const float* __restrict__ g_raw,    // [T, H, dk]
    const float* __restrict__ b_raw,    // [T, H]
    const float* __restrict__ a_log,    // [H]
    const float* __restrict__ dt_bias,  // [H, dk]
    float* __restrict__ record,         // [T, H, 2*dk + dv] or null
    float* __restrict__ ws,
    const int* __restrict__ seg,        // the sequence table (above)
    int nseq, int heads, int dk, int dv)
{
    HK_DYN_SMEM(float, smem);
    float* qh = smem;
    float* kh = qh + KC_C * KC_LD1;
    float* gm = kh + KC_C * KC_LD1;
    float* bt = gm + KC_C * KC_LD1;
    float* am = qh;  // A [64][KC_LDA], after barrier E

    const int c = blockIdx.x;
    const int h = blockIdx.y;
    const int chunks = gridDim.x;
    const int tid = threadIdx.x;
    const int lane = tid & (HK_WARP - 1);
    const int wp = tid / HK_WARP;
    const int sq = seg[4 * nseq + c];                     // the chunk's sequence
    const int c0 = (c - seg[4 * sq + 2]) * KC_C;          // its first token there
    const hk_i64 in0 = (hk_i64)seg[4 * sq] + c0;          // and that token's row
    const int left = seg[4 * sq + 1] - c0;
    const int n = left < KC_C ? left : KC_C;
    const int wrec = 2 * dk + dv;
    const KdaChunkWs W = kda_chunk_ws(ws, heads, chunks, dv);
    const hk_i64 row0 = (hk_i64)h * chunks * KC_C + (hk_i64)c * KC_C;  // workspace row of token c0

    // Step 1: q^, k^, g, beta; one warp per token (8 warps, 8 tokens each).
    const float rate = -expf(a_log[h]);
    const float inv_sqrt_dk = 1.0f / sqrtf((float)dk);
    float dtb[KC_DK / HK_WARP];  // the same for every token
#pragma unroll
    for (int x = 0; x < KC_DK / HK_WARP; ++x) dtb[x] = lane + HK_WARP * x < dk ? dt_bias[(hk_i64)h * dk + lane + HK_WARP * x] : 0.0f;
    // Two tokens a trip, so that a warp has two tokens' loads in flight (one
    // at a time left it waiting on each token's loads in turn).
#pragma unroll 2
    for (int t = wp; t < KC_C; t += KC_THREADS / HK_WARP) {
        float qv[KC_DK / HK_WARP], kv[KC_DK / HK_WARP], gv[KC_DK / HK_WARP];
        float sq = 0.0f, sk = 0.0f;
        const hk_i64 th = (in0 + t) * heads + h;
#pragma unroll
        for (int x = 0; x < KC_DK / HK_WARP; ++x) {
            const int i = lane + HK_WARP * x;
            const bool on = t < n && i < dk;
            qv[x] = on ? q[th * dk + i] : 0.0f;
            kv[x] = on ? k[th * dk + i] : 0.0f;
            gv[x] = on ? rate * hk_softplus(g_raw[th * dk + i] + dtb[x]) : 0.0f;
            sq += qv[x] * qv[x];
            sk += kv[x] * kv[x];
        }
        sq = hk_warp_sum(sq);
        sk = hk_warp_sum(sk);
        const float qs = 1.0f / sqrtf(sq + KC_L2_EPS) * inv_sqrt_dk;
        const float ks = 1.0f / sqrtf(sk + KC_L2_EPS);
        float* rec = (record && t < n) ? record + th * wrec : 0;
#pragma unroll
        for (int x = 0; x < KC_DK / HK_WARP; ++x) {
            const int i = lane + HK_WARP * x;
            const float kk = kv[x] * ks;
            qh[t * KC_LD1 + i] = qv[x] * qs;
            kh[t * KC_LD1 + i] = kk;
            gm[t * KC_LD1 + i] = gv[x];
            if (rec && i < dk) {
                rec[i] = kk;
                rec[dk + dv + i] = gv[x];
            }
        }
        if (lane == 0) bt[t] = t < n ? hk_sigmoid(b_raw[th]) : 0.0f;
    }
    __syncthreads();  // A

    // Step 2: Gam, the inclusive cumulative sum of g over the chunk's tokens.
    if (tid < KC_DK) {
        float acc = 0.0f;
        for (int t = 0; t < KC_C; ++t) {
            acc += gm[t * KC_LD1 + tid];
            gm[t * KC_LD1 + tid] = acc;
        }
    }
    __syncthreads();  // B

    // Step 3: A (strictly lower, times beta_t) and P over the pairs s <= t:
    //   A_ts = beta_t sum_i k^_t,i k^_s,i e^(Gam_t,i - Gam_s,i),  P_ts = the
    //   same with q^_t (s <= t).
    // A thread a pair computing one exponential a pair and channel was bound
    // by the exponentials and by five shared-memory reads a pair and channel.
    // Within each 16-token subchunk the pairs still do (3b); across
    // subchunks a < b the decay factors through the subchunk ends
    // e(a) = 16 a + 15:
    //   e^(Gam_t - Gam_s) = e^(Gam_t - Gam_e(b-1)) e^(Gam_e(b-1) - Gam_e(a)) e^(Gam_e(a) - Gam_s),
    // every exponent <= 0 (Gam only falls), so no factor overflows where the
    // direct one would not. k^ and q^ of t times the first factor, k^ of s
    // times the last, and the middle one (1 when b = a + 1) are made once
    // (3c), and the 1,536 pairs across subchunks become plain products on
    // the tensor cores (3d): 20K exponentials a chunk instead of 266K. The
    // factored products round differently from the direct ones (agreement
    // with the CPU to rounding, as before); every sum has a fixed order.
    float* P = W.p + ((hk_i64)h * chunks + c) * KC_C * KC_C;
    float* gref = bt + KC_C;        // Gam at the subchunk ends 15, 31, 47 [3][KC_DK]
    float* mid = gref + 3 * KC_DK;  // e^(Gam_e(b-1) - Gam_e(a)) for (a, b) = (0, 2), (0, 3), (1, 3)

    // 3a: e^Gam q^ and e^(Gam_last - Gam) k^ (zero on the padding rows and
    // channels, whose q^ and k^ are zero), e^Gam_last, and step 4's
    // right-hand side diag(beta) e^Gam k^ into W (solved in place there);
    // the subchunk ends' Gam.
    // Thread tid takes channel ci = tid % 128 of tokens ct0, ct0 + 2, .. (ct0 =
    // tid / 128): fixed offsets from pointers made once (the index
    // arithmetic made per element cost as much as the element's own work).
    const float* glast = gm + (n - 1) * KC_LD1;
    const int ci = tid % KC_DK, ct0 = tid / KC_DK;
    static_assert(KC_THREADS == 2 * KC_DK, "two tokens a step");
    {
        const hk_i64 g0 = (row0 + ct0) * KC_DK + ci;
        float* qgp = W.qg + g0;
        float* kdp = W.kd + g0;
        float* wp0 = W.w + g0;
        const float gl = glast[ci];
#pragma unroll 4
        for (int j = 0; j < KC_C / 2; ++j) {
            const int t = ct0 + 2 * j, x = t * KC_LD1 + ci;
            const float gt = gm[x];
            const float eg = kc_exp(gt);
            const float kt = kh[x];
            qgp[j * 2 * KC_DK] = eg * qh[x];
            kdp[j * 2 * KC_DK] = kc_exp(gl - gt) * kt;
            wp0[j * 2 * KC_DK] = bt[t] * (eg * kt);
        }
    }
    if (tid < KC_DK) W.dc[((hk_i64)h * chunks + c) * KC_DK + tid] = kc_exp(glast[tid]);
    for (int e = tid; e < 3 * KC_DK; e += KC_THREADS) gref[e] = gm[(16 * (e / KC_DK) + 15) * KC_LD1 + e % KC_DK];

    // 3b: the 4 x 136 pairs within a subchunk, one thread a pair, directly.
    float adiag[KC_IN_PER_THREAD];
#pragma unroll
    for (int m = 0; m < KC_IN_PER_THREAD; ++m) {
        const int p = tid + KC_THREADS * m;
        adiag[m] = 0.0f;
        if (p < KC_IN_PAIRS) {
            const int sub = p / 136, r = p % 136;
            int tl = (int)((sqrtf(8.0f * (float)r + 1.0f) - 1.0f) * 0.5f);
            while (tl * (tl + 1) / 2 > r) --tl;
            while ((tl + 1) * (tl + 2) / 2 <= r) ++tl;
            const int t = 16 * sub + tl, s2 = 16 * sub + r - tl * (tl + 1) / 2;
            // Four channels a read (rows are 16-byte aligned and zero past dk,
            // where the terms add nothing): a quarter of the shared-memory
            // instructions, the same sums in the same order.
            float akk = 0.0f, aqk = 0.0f;
            const float* gt = gm + t * KC_LD1;
            const float* gs = gm + s2 * KC_LD1;
            const float* kt = kh + t * KC_LD1;
            const float* ks = kh + s2 * KC_LD1;
            const float* qt = qh + t * KC_LD1;
            for (int i = 0; i < dk; i += 4) {
                const float4 a = *(const float4*)(gt + i), b = *(const float4*)(gs + i), kv = *(const float4*)(ks + i);
                const float4 kk = *(const float4*)(kt + i), qq = *(const float4*)(qt + i);
                const float d0 = kc_exp(a.x - b.x) * kv.x, d1 = kc_exp(a.y - b.y) * kv.y;
                const float d2 = kc_exp(a.z - b.z) * kv.z, d3 = kc_exp(a.w - b.w) * kv.w;
                akk = fmaf(kk.x, d0, akk);
                aqk = fmaf(qq.x, d0, aqk);
                akk = fmaf(kk.y, d1, akk);
                aqk = fmaf(qq.y, d1, aqk);
                akk = fmaf(kk.z, d2, akk);
                aqk = fmaf(qq.z, d2, aqk);
                akk = fmaf(kk.w, d3, akk);
                aqk = fmaf(qq.w, d3, aqk);
            }
            adiag[m] = s2 < t ? bt[t] * akk : 0.0f;
            P[t * KC_C + s2] = aqk;
        }
    }
    for (int e = tid; e < KC_C * KC_C; e += KC_THREADS) {
        if ((e & (KC_C - 1)) > (e / KC_C)) P[e] = 0.0f;
    }
    __syncthreads();  // C: Gam's raw values and the subchunk ends are read

    // 3c: in place, k^ := k^ e^(Gam_t - Gam_e(b-1)) and q^ likewise for the
    // tokens of subchunks 1 to 3, Gam := k^ e^(Gam_e(a) - Gam_s) for those of
    // subchunks 0 to 2; and the middle factors.
    {
        const float ge[3] = {gref[ci], gref[KC_DK + ci], gref[2 * KC_DK + ci]};
#pragma unroll
        for (int sub = 0; sub < 4; ++sub) {
#pragma unroll 4
            for (int j = 0; j < 8; ++j) {
                const int x = (16 * sub + ct0 + 2 * j) * KC_LD1 + ci;
                const float g = gm[x], kt = kh[x];
                if (sub < 3) gm[x] = kt * kc_exp(ge[sub < 3 ? sub : 0] - g);
                if (sub > 0) {
                    const float el = kc_exp(g - ge[sub > 0 ? sub - 1 : 0]);
                    kh[x] = kt * el;
                    qh[x] = qh[x] * el;
                }
            }
        }
    }
    for (int e = tid; e < 3 * KC_DK; e += KC_THREADS) {
        const int which = e / KC_DK, i = e % KC_DK;
        const int hi = which == 0 ? 1 : 2, lo = which == 2 ? 1 : 0;
        mid[e] = kc_exp(gref[hi * KC_DK + i] - gref[lo * KC_DK + i]);
    }
    __syncthreads();  // D: the factored operands are in place

    // 3d: the pairs across subchunks on the tensor cores (3xTF32, prelude.h):
    // twelve 16 x 16 blocks, A's six (k^ rows) and P's six (q^ rows), each
    // two m16n8 tiles; warp w takes tiles w, w + 8, w + 16 (tile q: block q /
    // 2, value half q % 2), k over the 128 channels, 8 at a time. Block
    // (a, b), a < b: rows 16 b .., columns 16 a .., the B operand Gam's
    // region (k^_s e^(Gam_e(a) - Gam_s)) times the middle factor when b > a + 1.
    // On the CUDA cores (4 x 4 tiles, a thread each) only 96 threads had work
    // here, 64 multiply-adds and 12 shared-memory reads a channel each, while
    // the other five warps waited at barrier E.
    float acc[3][4];
    const int gq = lane / 4, t4 = lane % 4;
#pragma unroll
    for (int m = 0; m < 3; ++m) {
        const int q = wp + 8 * m;
        const int blk = (q / 2) % 6, nh = q % 2;
        const bool isp = q >= 12;
        const int sa = blk < 3 ? (blk == 2 ? 1 : 0) : blk - 3;  // (0,1) (0,2) (1,2) (0,3) (1,3) (2,3)
        const int sb = blk < 3 ? (blk == 0 ? 1 : 2) : 3;
        const float* mrow = sb == sa + 1 ? 0 : mid + (sa == 1 ? 2 : sb == 2 ? 0 : 1) * KC_DK;
        const float* xa = (isp ? qh : kh) + (16 * sb + gq) * KC_LD1 + t4;
        const float* xb = gm + (16 * sa + 8 * nh + gq) * KC_LD1 + t4;
        float big[4] = {0.0f, 0.0f, 0.0f, 0.0f}, small[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
        for (int k0 = 0; k0 < KC_DK; k0 += 8) {
            const float av[4] = {xa[k0], xa[8 * KC_LD1 + k0], xa[k0 + 4], xa[8 * KC_LD1 + k0 + 4]};
            unsigned ah[4], al[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) hk_tf32_split(av[i], ah[i], al[i]);
            float b0 = xb[k0], b1 = xb[k0 + 4];
            if (mrow) {
                b0 *= mrow[k0 + t4];
                b1 *= mrow[k0 + t4 + 4];
            }
            hk_mma_3xtf32(big, small, ah, al, b0, b1);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int t = 16 * sb + gq + 8 * (e >> 1), s = 16 * sa + 8 * nh + 2 * t4 + (e & 1);
            const float v = big[e] + small[e];
            if (isp) P[t * KC_C + s] = v;
            acc[m][e] = isp ? 0.0f : v * bt[t];
        }
    }
    __syncthreads();  // E: q^'s region is free

    // A over q^'s region: the pairs within subchunks (their upper halves and
    // the diagonal as zeros), the tiles across them, zeros above.
#pragma unroll
    for (int m = 0; m < KC_IN_PER_THREAD; ++m) {
        const int p = tid + KC_THREADS * m;
        if (p < KC_IN_PAIRS) {
            const int sub = p / 136, r = p % 136;
            int tl = (int)((sqrtf(8.0f * (float)r + 1.0f) - 1.0f) * 0.5f);
            while (tl * (tl + 1) / 2 > r) --tl;
            while ((tl + 1) * (tl + 2) / 2 <= r) ++tl;
            am[(16 * sub + tl) * KC_LDA + 16 * sub + r - tl * (tl + 1) / 2] = adiag[m];
        }
    }
#pragma unroll
    for (int m = 0; m < 3; ++m) {
        const int q = wp + 8 * m;
        if (q >= 12) continue;
        const int blk = q / 2, nh = q % 2;
        const int sa = blk < 3 ? (blk == 2 ? 1 : 0) : blk - 3;
        const int sb = blk < 3 ? (blk == 0 ? 1 : 2) : 3;
#pragma unroll
        for (int e = 0; e < 4; ++e) am[(16 * sb + gq + 8 * (e >> 1)) * KC_LDA + 16 * sa + 8 * nh + 2 * t4 + (e & 1)] = acc[m][e];
    }
    for (int e = tid; e < KC_C * KC_C; e += KC_THREADS) {
        if ((e & (KC_C - 1)) > (e / KC_C)) am[(e / KC_C) * KC_LDA + (e & (KC_C - 1))] = 0.0f;
    }
    __syncthreads();  // F: A is whole

    // Step 4: X = (I + A)^-1 R for the columns R of diag(beta) e^Gam k^ (in W,
    // from 3a; X is W) and of diag(beta) V (X is U0), by 16-token blocks on
    // the tensor cores (3xTF32): with L_b = I + A_bb, block b of X is
    //   X_b = L_b^-1 (R_b - sum_{j<b} A_bj X_j),
    // the four L_b^-1 made first by substitution (a thread a column of one).
    // Warp w owns columns 32 w .. + 31 of each group of 256 (its X in shared
    // memory, rows 16 b .. first holding R_b - .. for the product with L_b^-1),
    // so after the inverses the warps never wait for each other. A column
    // solved one thread each by substitution ran 4.4K instructions a thread
    // with long dependent chains; this agrees with it to rounding.
    float* li = am + KC_C * KC_LDA;          // L_b^-1 [4][16][KC_LDL]
    float* xs = li + 4 * 16 * KC_LDL;        // X [8 warps][64][32], swizzled
    if (tid < KC_C) {
        const int b = tid / 16, j = tid % 16;
        const float* ab = am + 16 * b * KC_LDA + 16 * b;
        float y[16];
#pragma unroll
        for (int r = 0; r < 16; ++r) {
            float acc = r == j ? 1.0f : 0.0f;
#pragma unroll
            for (int x = 0; x < r; ++x) acc = fmaf(-ab[r * KC_LDA + x], y[x], acc);  // y[x] = 0 for x < j
            y[r] = acc;
            li[(b * 16 + r) * KC_LDL + j] = acc;
        }
    }
    __syncthreads();  // G: the inverses are in place
    float* xw = xs + wp * KC_C * 32;
    // X[row][col] of this warp at row * 32 + (col ^ 8 (row & 3)): the B
    // fragments' reads (rows t4 .., columns g ..) and C fragments' writes
    // spread over the banks.
    auto xat = [&](int row, int col) { return xw + row * 32 + (col ^ ((row & 3) << 3)); };
    for (int cg0 = 0; cg0 < KC_DK + dv; cg0 += KC_THREADS) {
#pragma unroll 1
        for (int b = 0; b < 4; ++b) {
            // A warp's 32 columns are all W's or all U0's (KC_DK is a multiple of 32).
            const int cw = cg0 + 32 * wp + 2 * t4;  // this lane's first column
            const bool isw = cg0 + 32 * wp < KC_DK;
            const int t0 = 16 * b + gq;
            float* wrow = W.w + (row0 + t0) * KC_DK + cw;
            float* urow = W.u0 + (row0 + t0) * dv + cw - KC_DK;
            float c[4][4];
            if (isw) {
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) c[nt][e] = wrow[8 * (e >> 1) * KC_DK + 8 * nt + (e & 1)];  // 3a's
            } else {
                const float* vrow = v + ((in0 + t0) * heads + h) * dv + cw - KC_DK;
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int t = t0 + 8 * (e >> 1), j = cw - KC_DK + 8 * nt + (e & 1);
                        c[nt][e] = t < n && j < dv ? bt[t] * vrow[(hk_i64)8 * (e >> 1) * heads * dv + 8 * nt + (e & 1)] : 0.0f;
                    }
            }
            // R_b - sum_{j<b} A_bj X_j, then into rows 16 b .. of X.
            {
                float big[4][4], small[4][4];
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) big[nt][e] = small[nt][e] = 0.0f;
                for (int k0 = 0; k0 < 16 * b; k0 += 8) {
                    const float* a = am + (16 * b + gq) * KC_LDA + k0 + t4;
                    const float av[4] = {a[0], a[8 * KC_LDA], a[4], a[8 * KC_LDA + 4]};
                    unsigned ah[4], al[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) hk_tf32_split(av[i], ah[i], al[i]);
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt) hk_mma_3xtf32(big[nt], small[nt], ah, al, *xat(k0 + t4, 8 * nt + gq), *xat(k0 + t4 + 4, 8 * nt + gq));
                }
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) c[nt][e] -= big[nt][e] + small[nt][e];
            }
            HK_SYNCWARP();  // every lane's reads of X rows < 16 b are done (and, b = 0, the last group's)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) *xat(16 * b + gq + 8 * (e >> 1), 8 * nt + 2 * t4 + (e & 1)) = c[nt][e];
            HK_SYNCWARP();
            // X_b = L_b^-1 (R_b - ..).
            float big[4][4], small[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) big[nt][e] = small[nt][e] = 0.0f;
#pragma unroll
            for (int k0 = 0; k0 < 16; k0 += 8) {
                const float* a = li + (16 * b + gq) * KC_LDL + k0 + t4;
                const float av[4] = {a[0], a[8 * KC_LDL], a[4], a[8 * KC_LDL + 4]};
                unsigned ah[4], al[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) hk_tf32_split(av[i], ah[i], al[i]);
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
                    hk_mma_3xtf32(big[nt], small[nt], ah, al, *xat(16 * b + k0 + t4, 8 * nt + gq), *xat(16 * b + k0 + t4 + 4, 8 * nt + gq));
            }
            HK_SYNCWARP();
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float x = big[nt][e] + small[nt][e];
                    *xat(t0 + 8 * (e >> 1), 8 * nt + 2 * t4 + (e & 1)) = x;
                    if (isw) wrow[8 * (e >> 1) * KC_DK + 8 * nt + (e & 1)] = x;
                    else if (cw - KC_DK + 8 * nt + (e & 1) < dv) urow[(hk_i64)8 * (e >> 1) * dv + 8 * nt + (e & 1)] = x;
                }
            HK_SYNCWARP();
        }
    }
}

// Phase 2: the state walk, the only sequential part. The chunks of sequence
// blockIdx.z, head blockIdx.x in order, for value columns blockIdx.y * 16 ..
// + 15: u = U0 - W S (written over U0 in the workspace), the state entering
// the chunk to the workspace (hs) for phase 3, then S = e^Gam_last S +
// (e^(Gam_last - Gam) k^)^T u. The output, (e^Gam q^) S + P u, needs nothing
// of the next chunk and is phase 3's, over every chunk at once.
// Both products are on the tensor cores, f32 as three TF32 products
// (prelude.h's hk_mma_3xtf32): on the CUDA cores the walk was bound by
// shared-memory wavefronts (about 7K a chunk, 4 us), where an m16n8k8 tile
// reads 768 bytes of fragments for 1024 multiply-adds. The eight warps:
//   u:  warp w computes tokens 16 (w / 2) .. + 15 of columns 8 (w % 2) .. + 7
//       over the 128 key channels, 8 at a time;
//   S:  warp w owns state rows (key channels) 16 w .. + 15 of all 16 columns
//       in registers (two C fragments), across the chunks, and adds
//       k^T u over the 64 tokens, 8 at a time.
// Each output's sum has a fixed order (the large TF32 products in one
// accumulator over k in order, the two small ones in another, added at the
// end), the same for every launch and every batch; it agrees with the CPU's
// chunked form to rounding. Strides that spread each fragment read over the
// 32 banks: W and S^T rows KC_LDW (4 g + t), k^ rows KC_LDK (8 t + g), u rows
// KC_LDUS (24 t + g). The next chunk's W and e^(..) k^ load (cp.async,
// double-buffered) under this chunk's products; two barriers a chunk: B (u is
// in shared memory, every read of S^T done) and C (S^T updated, the next
// chunk's operands landed).
// Launch: grid (heads, ceil(dv / 16), nseq); block KC_THREADS; dynamic shared
// memory KC_H_SMEM floats.
#define KC_LDK (KC_DK + 8)
#define KC_LDUS 24
#define KC_H_SMEM (KC_TILE * KC_LDW + 2 * KC_C * KC_LDW + 2 * KC_C * KC_LDK + KC_C * KC_LDUS + 2 * KC_C * KC_TILE + 2 * KC_DK)
extern "C" __global__ void __launch_bounds__(KC_THREADS, 1) kda_chunk_state(
    float* __restrict__ state,  // [states, H, dk, dv], updated in place
    float* __restrict__ ws,
    const int* __restrict__ seg,  // the sequence table (above)
    int wchunks, int heads, int dk, int dv)  // wchunks: the workspace's chunks
{
    HK_DYN_SMEM(float, smem);
    float* ST = smem;                      // S^T [16][KC_LDW]
    float* Wb = ST + KC_TILE * KC_LDW;     // W [2][64][KC_LDW]
    float* Kb = Wb + 2 * KC_C * KC_LDW;    // e^(..) k^ [2][64][KC_LDK]
    float* Us = Kb + 2 * KC_C * KC_LDK;    // u [64][KC_LDUS]
    float* U0b = Us + KC_C * KC_LDUS;      // U0 of the tile [2][64][16]
    float* Db = U0b + 2 * KC_C * KC_TILE;  // e^Gam_last [2][128]

    const int h = blockIdx.x;
    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t4 = lane % 4;  // the fragments' row and column groups
    const int cbase0 = blockIdx.y * KC_TILE;
    const int sq = blockIdx.z;
    const int tokens = seg[4 * sq + 1];
    const int cbase = seg[4 * sq + 2];
    const int chunks = (tokens + KC_C - 1) / KC_C;
    const KdaChunkWs W = kda_chunk_ws(ws, heads, wchunks, dv);
    float* Sg = state + ((hk_i64)seg[4 * sq + 3] * heads + h) * dk * dv;
    const hk_i64 wrow = (hk_i64)h * wchunks * KC_C + (hk_i64)cbase * KC_C;
    const hk_i64 wch = (hk_i64)h * wchunks + cbase;  // the sequence's first chunk for head h
    const bool pre = dv % 4 == 0;  // U0 and e^Gam_last come with the chunk's operands

    // This warp's state, as two C fragments: sr[n][e] is row 16 warp + g +
    // 8 (e / 2), column 8 n + 2 t4 + e % 2 of the tile.
    float sr[2][4];
    auto srow = [&](int e) { return 16 * warp + g + 8 * (e >> 1); };
    auto scol = [&](int n, int e) { return 8 * n + 2 * t4 + (e & 1); };
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = srow(e), j = cbase0 + scol(n, e);
            sr[n][e] = (i < dk && j < dv) ? Sg[(hk_i64)i * dv + j] : 0.0f;
        }
    auto put_st = [&]() {
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) ST[scol(n, e) * KC_LDW + srow(e)] = sr[n][e];
    };
    put_st();

    // Chunk cc's W and e^(..) k^ into buffer cc % 2, 16 bytes a copy (rows of
    // 128 floats, strides multiples of 4 floats): thread tid copies floats
    // 4 (tid % 32) .. + 3 of rows tid / 32 + 8 j, j < 8, so its sources and
    // destinations are fixed offsets from pointers made once here (the
    // index arithmetic made per copy was a fifth of the walk's instructions).
    const int lr = tid / 32, lc = 4 * (tid % 32);
    const float* wsrc = W.w + (wrow + lr) * KC_DK + lc;
    const float* ksrc = W.kd + (wrow + lr) * KC_DK + lc;
    float* wdst = Wb + lr * KC_LDW + lc;
    float* kdst = Kb + lr * KC_LDK + lc;
    // U0 of the tile's columns (token tid / 4, columns 4 (tid % 4) ..) and
    // e^Gam_last (tid < 32) too, so that no global read is left on the
    // chunk's own path. 16-byte copies need dv a multiple of 4; otherwise
    // the chunk reads them itself.
    const int ut = tid / (KC_TILE / 4), uj = 4 * (tid % (KC_TILE / 4));
    const bool uon = cbase0 + uj < dv;
    const float* usrc = W.u0 + (wrow + ut) * dv + cbase0 + uj;
    const float* dsrc = W.dc + wch * KC_DK + 4 * tid;
    auto load = [&](int cc) {
        const hk_i64 r = (hk_i64)cc * KC_C * KC_DK;
        float* wd = wdst + (cc & 1) * KC_C * KC_LDW;
        float* kd = kdst + (cc & 1) * KC_C * KC_LDK;
#pragma unroll
        for (int j = 0; j < KC_C / 8; ++j) {
            hk_cp16(wd + 8 * j * KC_LDW, wsrc + r + 8 * j * KC_DK, true);
            hk_cp16(kd + 8 * j * KC_LDK, ksrc + r + 8 * j * KC_DK, true);
        }
        if (pre) {
            static_assert(KC_C * (KC_TILE / 4) == KC_THREADS, "one U0 copy a thread");
            hk_cp16(U0b + (cc & 1) * KC_C * KC_TILE + ut * KC_TILE + uj, uon ? usrc + (hk_i64)cc * KC_C * dv : W.u0, uon);
            if (tid < KC_DK / 4) hk_cp16(Db + (cc & 1) * KC_DK + 4 * tid, dsrc + (hk_i64)cc * KC_DK, true);
        }
        hk_cp_commit();
    };
    if (chunks > 0) load(0);
    hk_cp_wait_all();
    __syncthreads();

    const int mt = warp >> 1, nt = warp & 1;  // u: tokens 16 mt .., columns 8 nt ..
    float* hsdst = W.hs + (wch * dv + cbase0 + lr) * KC_DK + lc;
    static_assert(KC_TILE * (KC_DK / 4) == 2 * KC_THREADS, "two hs copies a thread");
    for (int c = 0; c < chunks; ++c) {
        if (c + 1 < chunks) load(c + 1);  // its buffer was last read before the previous barrier C
        const hk_i64 row0 = wrow + (hk_i64)c * KC_C;
        const float* Wc = Wb + (c & 1) * KC_C * KC_LDW;
        const float* Kc = Kb + (c & 1) * KC_C * KC_LDK;

        // The state entering the chunk, for phase 3 ([col][128]), from S^T:
        // columns lr and lr + 8, floats lc .. lc + 3.
#pragma unroll
        for (int m = 0; m < KC_TILE / 8; ++m) {
            if (cbase0 + lr + 8 * m < dv)
                *(float4*)(hsdst + (hk_i64)c * dv * KC_DK + 8 * m * KC_DK) = *(const float4*)(ST + (lr + 8 * m) * KC_LDW + lc);
        }

        // u = U0 - W S over the key channels, 8 at a time.
        {
            // Four accumulators (the large products of even and odd k-steps,
            // the two small ones apart), added in a fixed order at the end:
            // one accumulator took 32 dependent products a chunk.
            float big[2][4] = {}, sm1[4] = {}, sm2[4] = {};
            const float* wa = Wc + (16 * mt + g) * KC_LDW + t4;
            const float* sb = ST + (8 * nt + g) * KC_LDW + t4;
#pragma unroll 4
            for (int k0 = 0; k0 < KC_DK; k0 += 8) {
                const float av[4] = {wa[k0], wa[8 * KC_LDW + k0], wa[k0 + 4], wa[8 * KC_LDW + k0 + 4]};
                unsigned ah[4], al[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) hk_tf32_split(av[i], ah[i], al[i]);
                kc_mma3(big[(k0 >> 3) & 1], sm1, sm2, ah, al, sb[k0], sb[k0 + 4]);
            }
            float acc4[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) acc4[e] = (big[0][e] + big[1][e]) + (sm1[e] + sm2[e]);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = 16 * mt + g + 8 * (e >> 1), j = 8 * nt + 2 * t4 + (e & 1);
                const bool on = cbase0 + j < dv;
                float u0;
                if (pre) u0 = U0b[(c & 1) * KC_C * KC_TILE + t * KC_TILE + j];
                else u0 = on ? W.u0[(row0 + t) * dv + cbase0 + j] : 0.0f;
                const float u = u0 - acc4[e];
                Us[t * KC_LDUS + j] = u;
                if (on) W.u0[(row0 + t) * dv + cbase0 + j] = u;
            }
        }
        __syncthreads();  // B

        // S = e^Gam_last S + sum_s (e^(Gam_last - Gam_s) k^_s) u_s^T over the
        // tokens, 8 at a time (the padding tokens' k^ and u are zero).
        {
            float dr[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = 16 * warp + g + 8 * r;
                dr[r] = pre ? Db[(c & 1) * KC_DK + i] : W.dc[(wch + c) * KC_DK + i];
            }
            // k^T u into fresh accumulators (even and odd token steps, the
            // small products apart), then added to the decayed state in a
            // fixed order: accumulating onto the state chained 16 products.
            float big[2][2][4] = {}, sm1[2][4] = {}, sm2[2][4] = {};
            const float* ka = Kc + t4 * KC_LDK + 16 * warp + g;
            const float* ub = Us + t4 * KC_LDUS + g;
#pragma unroll 4
            for (int s0 = 0; s0 < KC_C; s0 += 8) {
                const float av[4] = {ka[s0 * KC_LDK], ka[s0 * KC_LDK + 8], ka[(s0 + 4) * KC_LDK], ka[(s0 + 4) * KC_LDK + 8]};
                unsigned ah[4], al[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) hk_tf32_split(av[i], ah[i], al[i]);
#pragma unroll
                for (int n = 0; n < 2; ++n) kc_mma3(big[(s0 >> 3) & 1][n], sm1[n], sm2[n], ah, al, ub[s0 * KC_LDUS + 8 * n], ub[(s0 + 4) * KC_LDUS + 8 * n]);
            }
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) sr[n][e] = fmaf(sr[n][e], dr[e >> 1], (big[0][n][e] + big[1][n][e]) + (sm1[n][e] + sm2[n][e]));
        }
        put_st();
        hk_cp_wait_all();
        __syncthreads();  // C
    }

#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = srow(e), j = cbase0 + scol(n, e);
            if (i < dk && j < dv) Sg[(hk_i64)i * dv + j] = sr[n][e];
        }
}

// Phase 3: the output of every chunk at once, o = (e^Gam q^) S_c + P u with
// S_c the state entering the chunk (phase 2's hs) and u phase 2's: chunk
// blockIdx.x (of all sequences), head blockIdx.y, value columns
// blockIdx.z * 64 .. + 63. On the tensor cores (3xTF32, prelude.h): warp w
// computes tokens 16 (w % 4) .. + 15 of columns 32 (w / 4) .. + 31 (four
// m16n8 tiles), k over the 128 key channels, then over the tokens s up to
// the tile's last (P is zero above the diagonal), 8 at a time; the large
// TF32 products in one accumulator, the small ones in another, added at the
// end: a fixed order for every launch. (On the CUDA cores, a thread a 4 x 4
// tile, the kernel ran 4.8K instructions a warp.) Strides 4 g + t over the
// banks: q^ and S^T rows KC_LDW, P and u^T rows KC_LDP = KC_LDU. Also
// writes u to the record.
// Launch: grid (chunks, heads, ceil(dv / 64)); block KC_THREADS; dynamic
// shared memory KC_O_SMEM floats.
#define KC_LDU (KC_C + 4)  // row stride of u^T in kda_chunk_out
#define KC_OT 64  // value columns per kda_chunk_out block
#define KC_O_SMEM (2 * KC_C * KC_LDW + KC_C * KC_LDP + KC_OT * KC_LDU)
extern "C" __global__ void __launch_bounds__(KC_THREADS, 2) kda_chunk_out(
    float* __restrict__ out,     // [T, H, dv]
    float* __restrict__ record,  // [T, H, 2*dk + dv] or null
    const float* __restrict__ ws,
    const int* __restrict__ seg,  // the sequence table (above)
    int nseq, int heads, int dk, int dv)
{
    HK_DYN_SMEM(float, smem);
    float* Qs = smem;                  // e^Gam q^ [64][KC_LDW]
    float* ST = Qs + KC_C * KC_LDW;    // S_c^T [64 columns][KC_LDW]
    float* Ps = ST + KC_OT * KC_LDW;   // P [64][KC_LDP]
    float* UT = Ps + KC_C * KC_LDP;    // u^T [64 columns][KC_LDU]

    const int cg = blockIdx.x;
    const int h = blockIdx.y;
    const int chunks = gridDim.x;
    const int col0 = blockIdx.z * KC_OT;
    const int tid = threadIdx.x;
    const int sq = seg[4 * nseq + cg];
    const int c0 = (cg - seg[4 * sq + 2]) * KC_C;
    const hk_i64 in0 = (hk_i64)seg[4 * sq] + c0;
    const int left = seg[4 * sq + 1] - c0;
    const int n = left < KC_C ? left : KC_C;
    const int wrec = 2 * dk + dv;
    const KdaChunkWs W = kda_chunk_ws((float*)ws, heads, chunks, dv);
    const hk_i64 row0 = (hk_i64)h * chunks * KC_C + (hk_i64)cg * KC_C;
    const hk_i64 ch = (hk_i64)h * chunks + cg;

    // The operands, from pointers made once (fixed offsets a copy): thread
    // tid copies floats 4 (tid % 32) .. + 3 of rows tid / 32 + 8 j of e^Gam q^
    // and of S_c^T (a row there is a column of the tile), and of P floats
    // 4 (tid % 16) .. of rows tid / 16 + 16 j; u^T gathers column tid % 64
    // of tokens tid / 64 + 4 j.
    {
        const int lr = tid / 32, lc = 4 * (tid % 32);
        const float* qsrc = W.qg + (row0 + lr) * KC_DK + lc;
#pragma unroll
        for (int j = 0; j < KC_C / 8; ++j) {
            const int col = lr + 8 * j;
            const bool cv = col0 + col < dv;
            hk_cp16(Qs + col * KC_LDW + lc, qsrc + 8 * j * KC_DK, true);
            hk_cp16(ST + col * KC_LDW + lc, W.hs + (ch * dv + (cv ? col0 + col : 0)) * KC_DK + lc, cv);
        }
        const float* psrc = W.p + ch * KC_C * KC_C + (tid / 16) * KC_C + 4 * (tid % 16);
#pragma unroll
        for (int j = 0; j < KC_C / 16; ++j) hk_cp16(Ps + (tid / 16 + 16 * j) * KC_LDP + 4 * (tid % 16), psrc + 16 * j * KC_C, true);
        hk_cp_commit();
        const int uc = tid % KC_OT, ut0 = tid / KC_OT;
        const bool uon = col0 + uc < dv;
        const float* usrc = W.u0 + (row0 + ut0) * dv + col0 + uc;
#pragma unroll 4
        for (int j = 0; j < KC_C / 4; ++j) UT[uc * KC_LDU + ut0 + 4 * j] = uon ? usrc[(hk_i64)4 * j * dv] : 0.0f;
        static_assert(KC_THREADS == 4 * KC_OT, "four tokens a step of u^T");
    }
    hk_cp_wait_all();
    __syncthreads();

    const int warp = tid / 32, lane = tid % 32, gq = lane / 4, t4 = lane % 4;
    const int mt = warp % 4, cb = 32 * (warp / 4);
    // The two small products of 3xTF32 in accumulators of their own (kc_mma3):
    // twelve independent chains a warp.
    float big[4][4] = {}, sm1[4][4] = {}, sm2[4][4] = {};
    // One k-step: A from `a` (rows 16 mt + gq, + 8; k t4, t4 + 4), B from
    // `b` (column cb + 8 j + gq, k t4, t4 + 4) for the four column tiles.
    auto kstep = [&](const float* a, int lda, const float* b, int ldb) {
        const float av[4] = {a[0], a[8 * lda], a[4], a[8 * lda + 4]};
        unsigned ah[4], al[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) hk_tf32_split(av[i], ah[i], al[i]);
#pragma unroll
        for (int j = 0; j < 4; ++j) kc_mma3(big[j], sm1[j], sm2[j], ah, al, b[8 * j * ldb], b[8 * j * ldb + 4]);
    };
    const float* qa = Qs + (16 * mt + gq) * KC_LDW + t4;
    const float* sb = ST + (cb + gq) * KC_LDW + t4;
#pragma unroll 4
    for (int k0 = 0; k0 < KC_DK; k0 += 8) kstep(qa + k0, KC_LDW, sb + k0, KC_LDW);
    const float* pa = Ps + (16 * mt + gq) * KC_LDP + t4;
    const float* ub = UT + (cb + gq) * KC_LDU + t4;
    for (int s0 = 0; s0 < 16 * (mt + 1); s0 += 8) kstep(pa + s0, KC_LDP, ub + s0, KC_LDU);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int t = 16 * mt + gq + 8 * (e >> 1);
        if (t >= n) continue;
        const hk_i64 th = (in0 + t) * heads + h;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int cc = cb + 8 * j + 2 * t4 + (e & 1);
            if (col0 + cc < dv) out[th * dv + col0 + cc] = big[j][e] + (sm1[j][e] + sm2[j][e]);
        }
    }
    if (record && col0 + tid % KC_OT < dv) {
        const int uc = tid % KC_OT, ut0 = tid / KC_OT;
        float* rdst = record + ((in0 + ut0) * heads + h) * wrec + dk + col0 + uc;
        for (int j = 0; ut0 + 4 * j < n; ++j) rdst[(hk_i64)4 * j * heads * wrec] = UT[uc * KC_LDU + ut0 + 4 * j];
    }
}
