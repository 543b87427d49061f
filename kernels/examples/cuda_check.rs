//! Device check of the CUDA backend against the CPU reference, runnable on a
//! GPU machine with no Rust toolchain (build here, strip, carry the binary):
//!
//! ```text
//! cargo build --release -p handoff-kernels --features cuda --example cuda_check
//! strip target/release/examples/cuda_check
//! ./cuda_check            # every op: CPU vs CUDA, batch invariance, determinism
//! ./cuda_check --bench    # timings: KDA step vs device copy bandwidth, and more
//! ./cuda_check --bench-mla   # the device copy and the MLA partial rows only
//! ./cuda_check --bench-matmul   # the device copy and the fused step's tensor-core products only
//! ./cuda_check --bench-mla --mla tc4:256   # another MLA partial kernel (scalar, tc4, tc8[:rows])
//! ```
//!
//! For every op it draws fresh random inputs (SplitMix64, `--seed`), runs
//! `CpuBackend` and `CudaBackend` on them and prints `op | case | max rel err |
//! tol | ok`. The error is max |gpu - cpu| over max |cpu| (relative to the
//! output's inf-norm); "exact" rows compare bits. Tolerances: f32 ops 1e-5;
//! the matmul and what is built on it 3e-5 (tensor cores on the bf16 split of
//! f32, dense.hip: the dropped lo x lo term is about 2^-16 of each product);
//! KDA prefill 1e-4 (the CPU runs the chunked form on wide heads, and so does
//! the GPU where dk <= 128; both agree to rounding only); f64 attention partials 1e-12; copies, rounding, embedding,
//! argmax, cursors exact. Batch invariance (matmul, KDA step, ragged MLA
//! partial: a batch of B against each row alone, bit-equal) and determinism
//! (two runs, bit-equal) are checked on the GPU. Exits 0 when all pass, 1 on a
//! failure, 2 when no CUDA device can be opened (the message says why).

use std::process::ExitCode;

use handoff_kernels::backend::matmul_units_each;
use handoff_kernels::dtype::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use handoff_kernels::{
    Backend, ColsCopy, ConvShape, Copy2d, CpuBackend, CudaBackend, DeviceRegion, EmbeddingShape, KdaInputs, KdaKernel, KdaParams, KdaPrefillShape,
    KdaStepShape, KernelError, MatmulShape, MergeShape, MlaShape, MlpShape, MlpWeights, NormShape, RegionItems, ReplayShape, RowSet, SplitMix64, StorageDtype,
    UnitProduct, UnitsOut, UnitsShape, mla_partial_width, replay_record_width,
};

type R<T> = Result<T, KernelError>;

// ------------------------------------------------------------------ report

struct Report {
    rows: Vec<(String, String, String, String, bool)>,
}

impl Report {
    fn new() -> Self {
        Self { rows: Vec::new() }
    }

    /// A toleranced comparison: max |got - want| / max |want|.
    fn close(&mut self, op: &str, case: &str, got: &[f32], want: &[f32], tol: f64) {
        let e = rel_err(got, want);
        self.push(op, case, format!("{e:.2e}"), format!("{tol:.0e}"), e <= tol);
    }

    fn close64(&mut self, op: &str, case: &str, got: &[f64], want: &[f64], tol: f64) {
        let e = rel_err64(got, want);
        self.push(op, case, format!("{e:.2e}"), format!("{tol:.0e}"), e <= tol);
    }

    /// Bit-exact comparison.
    fn exact_f32(&mut self, op: &str, case: &str, got: &[f32], want: &[f32]) {
        let ok = got.len() == want.len() && got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
        let e = if ok { "0 (bits)".to_string() } else { format!("{:.2e}", rel_err(got, want)) };
        self.push(op, case, e, "exact".into(), ok);
    }

    fn exact_f64(&mut self, op: &str, case: &str, got: &[f64], want: &[f64]) {
        let ok = got.len() == want.len() && got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
        let e = if ok { "0 (bits)".to_string() } else { format!("{:.2e}", rel_err64(got, want)) };
        self.push(op, case, e, "exact".into(), ok);
    }

    fn exact_i32(&mut self, op: &str, case: &str, got: &[i32], want: &[i32]) {
        let ok = got == want;
        let e = if ok {
            "0".to_string()
        } else {
            let bad = got.iter().zip(want).filter(|(a, b)| a != b).count();
            format!("{bad} differ")
        };
        self.push(op, case, e, "exact".into(), ok);
    }

    fn flag(&mut self, op: &str, case: &str, ok: bool, what: &str) {
        self.push(op, case, what.to_string(), "-".into(), ok);
    }

    fn push(&mut self, op: &str, case: &str, err: String, tol: String, ok: bool) {
        println!("| {op:<28} | {case:<44} | {err:>11} | {tol:>6} | {} |", if ok { "ok" } else { "FAIL" });
        self.rows.push((op.into(), case.into(), err, tol, ok));
    }

    fn failures(&self) -> usize {
        self.rows.iter().filter(|r| !r.4).count()
    }
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let mut scale = 0.0f64;
    let mut diff = 0.0f64;
    for (&g, &w) in got.iter().zip(want) {
        if g == w {
            continue; // covers equal infinities
        }
        let d = (g as f64 - w as f64).abs();
        diff = if d.is_nan() { f64::INFINITY } else { diff.max(d) };
    }
    for &w in want {
        if w.is_finite() {
            scale = scale.max((w as f64).abs());
        }
    }
    if diff == 0.0 { 0.0 } else { diff / scale.max(1e-30) }
}

fn rel_err64(got: &[f64], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let mut scale = 0.0f64;
    let mut diff = 0.0f64;
    for (&g, &w) in got.iter().zip(want) {
        if g == w {
            continue;
        }
        let d = (g - w).abs();
        diff = if d.is_nan() { f64::INFINITY } else { diff.max(d) };
    }
    for &w in want {
        if w.is_finite() {
            scale = scale.max(w.abs());
        }
    }
    if diff == 0.0 { 0.0 } else { diff / scale.max(1e-300) }
}

// ------------------------------------------------------------------ inputs

fn uni(r: &mut SplitMix64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    r.vec_uniform(n, lo, hi)
}

/// Host KDA inputs for `n` rows (batch or tokens) of `h` heads.
struct KdaHost {
    h: usize,
    dk: usize,
    dv: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g_raw: Vec<f32>,
    b_raw: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
}

impl KdaHost {
    fn new(r: &mut SplitMix64, n: usize, h: usize, dk: usize, dv: usize) -> Self {
        Self {
            h,
            dk,
            dv,
            q: uni(r, n * h * dk, -1.0, 1.0),
            k: uni(r, n * h * dk, -1.0, 1.0),
            v: uni(r, n * h * dv, -1.0, 1.0),
            g_raw: uni(r, n * h * dk, -3.0, 1.0),
            b_raw: uni(r, n * h, -2.0, 2.0),
            a_log: uni(r, h, -2.0, 0.5),
            dt_bias: uni(r, h * dk, -1.0, 1.0),
        }
    }

    /// Rows a..b of the per-row inputs (the parameters stay whole).
    fn rows(&self, a: usize, b: usize) -> Self {
        let (h, dk, dv) = (self.h, self.dk, self.dv);
        Self {
            h,
            dk,
            dv,
            q: self.q[a * h * dk..b * h * dk].to_vec(),
            k: self.k[a * h * dk..b * h * dk].to_vec(),
            v: self.v[a * h * dv..b * h * dv].to_vec(),
            g_raw: self.g_raw[a * h * dk..b * h * dk].to_vec(),
            b_raw: self.b_raw[a * h..b * h].to_vec(),
            a_log: self.a_log.clone(),
            dt_bias: self.dt_bias.clone(),
        }
    }
}

/// KDA inputs uploaded to backend `B`.
struct KdaDev<B: Backend> {
    x: [B::Buf; 5],
    p: [B::Buf; 2],
}

impl<B: Backend> KdaDev<B> {
    fn new(be: &B, c: &KdaHost) -> R<Self> {
        Ok(Self {
            x: [be.upload(&c.q)?, be.upload(&c.k)?, be.upload(&c.v)?, be.upload(&c.g_raw)?, be.upload(&c.b_raw)?],
            p: [be.upload(&c.a_log)?, be.upload(&c.dt_bias)?],
        })
    }
    fn inputs(&self) -> KdaInputs<'_, B::Buf> {
        KdaInputs { q: &self.x[0], k: &self.x[1], v: &self.x[2], g_raw: &self.x[3], b_raw: &self.x[4] }
    }
    fn params(&self) -> KdaParams<'_, B::Buf> {
        KdaParams { a_log: &self.p[0], dt_bias: &self.p[1] }
    }
}

// ------------------------------------------------------------------ op runners (generic)

/// `steps` KDA steps of one batch; returns (last out, final state, last record).
fn run_kda_steps<B: Backend>(be: &B, b: usize, c: &[KdaHost], s0: &[f32]) -> R<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let (h, dk, dv) = (c[0].h, c[0].dk, c[0].dv);
    let shape = KdaStepShape { batch: b, heads: h, dk, dv };
    let mut state = be.upload(s0)?;
    let mut out = be.alloc(b * h * dv)?;
    let mut rec = be.alloc(b * h * replay_record_width(dk, dv))?;
    for step in c {
        let d = KdaDev::new(be, step)?;
        be.kda_step(shape, &mut state, d.inputs(), d.params(), &mut out, Some(&mut rec))?;
    }
    Ok((be.download(&out)?, be.download(&state)?, be.download(&rec)?))
}

fn run_kda_prefill<B: Backend>(be: &B, t: usize, c: &KdaHost, s0: &[f32]) -> R<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let (h, dk, dv) = (c.h, c.dk, c.dv);
    let shape = KdaPrefillShape { tokens: t, heads: h, dk, dv };
    let mut state = be.upload(s0)?;
    let mut out = be.alloc(t * h * dv)?;
    let mut rec = be.alloc(t * h * replay_record_width(dk, dv))?;
    let d = KdaDev::new(be, c)?;
    be.kda_prefill(shape, &mut state, d.inputs(), d.params(), &mut out, Some(&mut rec))?;
    Ok((be.download(&out)?, be.download(&state)?, be.download(&rec)?))
}

/// The prefill without a record; returns (out, final state).
fn run_kda_prefill_norec<B: Backend>(be: &B, t: usize, c: &KdaHost, s0: &[f32]) -> R<(Vec<f32>, Vec<f32>)> {
    let (h, dk, dv) = (c.h, c.dk, c.dv);
    let shape = KdaPrefillShape { tokens: t, heads: h, dk, dv };
    let mut state = be.upload(s0)?;
    let mut out = be.alloc(t * h * dv)?;
    let d = KdaDev::new(be, c)?;
    be.kda_prefill(shape, &mut state, d.inputs(), d.params(), &mut out, None)?;
    Ok((be.download(&out)?, be.download(&state)?))
}

/// Whether CudaBackend::kda_prefill takes the chunked kernels (kda_chunk.hip)
/// for this shape: the CPU's own rule (a full chunk, 2 dv >= 3 x 64) and dk <= 128.
fn device_prefill_chunked(t: usize, dk: usize, dv: usize) -> bool {
    t >= handoff_kernels::KDA_CHUNK && dk <= 128 && 2 * dv >= 3 * handoff_kernels::KDA_CHUNK
}

/// (ring after the appends, cursors after the appends, committed state, cursors after the commit).
type ReplayOut = (Vec<f32>, Vec<i32>, Vec<f32>, Vec<i32>);

/// Two appends of `tokens` records per slot then a commit.
fn run_replay<B: Backend>(be: &B, shape: ReplayShape, tokens: usize, recs: &[Vec<f32>; 2], cursor0: &[i32], s0: &[f32]) -> R<ReplayOut> {
    let w = replay_record_width(shape.dk, shape.dv);
    let mut ring = be.alloc(shape.batch * shape.capacity * shape.heads * w)?;
    let mut cursor = be.upload_i32(cursor0)?;
    for r in recs {
        let rb = be.upload(r)?;
        be.replay_append(shape, tokens, &mut ring, &mut cursor, &rb)?;
    }
    let ring_h = be.download(&ring)?;
    let cur_h = be.download_i32(&cursor)?;
    let mut state = be.upload(s0)?;
    be.replay_commit(shape, &mut state, &ring, &mut cursor)?;
    Ok((ring_h, cur_h, be.download(&state)?, be.download_i32(&cursor)?))
}

fn run_conv_prefill<B: Backend>(be: &B, shape: ConvShape, t: usize, x: &[f32], w: &[f32], st: &[f32]) -> R<(Vec<f32>, Vec<f32>)> {
    let (xb, wb) = (be.upload(x)?, be.upload(w)?);
    let mut sb = be.upload(st)?;
    let mut out = be.alloc(t * shape.channels)?;
    be.conv_prefill(shape, t, &xb, &wb, &mut sb, &mut out)?;
    Ok((be.download(&out)?, be.download(&sb)?))
}

fn run_conv_step<B: Backend>(be: &B, shape: ConvShape, b: usize, x: &[f32], w: &[f32], st: &[f32]) -> R<(Vec<f32>, Vec<f32>)> {
    let (xb, wb) = (be.upload(x)?, be.upload(w)?);
    let mut sb = be.upload(st)?;
    let mut out = be.alloc(b * shape.channels)?;
    be.conv_step(shape, b, &xb, &wb, &mut sb, &mut out)?;
    Ok((be.download(&out)?, be.download(&sb)?))
}

fn run_norms<B: Backend>(be: &B, shape: NormShape, x: &[f32], g: &[f32], w: &[f32]) -> R<(Vec<f32>, Vec<f32>)> {
    let (xb, gb, wb) = (be.upload(x)?, be.upload(g)?, be.upload(w)?);
    let mut o1 = be.alloc(x.len())?;
    let mut o2 = be.alloc(x.len())?;
    be.rms_norm(shape, &xb, &wb, &mut o1)?;
    be.gated_rms_norm(shape, &xb, &gb, &wb, &mut o2)?;
    Ok((be.download(&o1)?, be.download(&o2)?))
}

fn run_mla_prefill<B: Backend>(be: &B, shape: MlaShape, t: usize, q: &[f32], rows: &[f32], n: usize) -> R<(Vec<f32>, Vec<f32>)> {
    let (qb, rb) = (be.upload(q)?, be.upload(rows)?);
    let mut out = be.alloc(t * shape.heads * shape.kv_lora_rank)?;
    let mut lse = be.alloc(t * shape.heads)?;
    be.mla_prefill(shape, t, &qb, RowSet { buf: &rb, count: n }, &mut out, Some(&mut lse))?;
    Ok((be.download(&out)?, be.download(&lse)?))
}

fn run_mla_decode<B: Backend>(be: &B, shape: MlaShape, q: &[f32], rows: &[f32], n: usize) -> R<(Vec<f32>, Vec<f32>, Vec<f64>)> {
    let (qb, rb) = (be.upload(q)?, be.upload(rows)?);
    let mut out = be.alloc(shape.heads * shape.kv_lora_rank)?;
    let mut lse = be.alloc(shape.heads)?;
    be.mla_decode(shape, &qb, RowSet { buf: &rb, count: n }, &mut out, &mut lse)?;
    let mut p = be.alloc_f64(shape.heads * mla_partial_width(shape.kv_lora_rank))?;
    be.mla_decode_partial(shape, &qb, RowSet { buf: &rb, count: n }, &mut p)?;
    Ok((be.download(&out)?, be.download(&lse)?, be.download_f64(&p)?))
}

fn run_ragged<B: Backend>(be: &B, shape: MlaShape, q: &[f32], rows: &[f32], counts: &[usize]) -> R<Vec<f64>> {
    let (qb, rb) = (be.upload(q)?, be.upload(rows)?);
    let mut p = be.alloc_f64(counts.len() * shape.heads * mla_partial_width(shape.kv_lora_rank))?;
    be.mla_decode_partial_ragged(shape, &qb, &rb, counts, &mut p)?;
    be.download_f64(&p)
}

fn run_dcp_merge<B: Backend>(be: &B, shape: MergeShape, o: &[f32], lse: &[f32]) -> R<(Vec<f32>, Vec<f32>)> {
    let (ob, lb) = (be.upload(o)?, be.upload(lse)?);
    let mut out = be.alloc(shape.heads * shape.width)?;
    let mut l = be.alloc(shape.heads)?;
    be.dcp_merge(shape, &ob, &lb, &mut out, &mut l)?;
    Ok((be.download(&out)?, be.download(&l)?))
}

fn run_merge_partials<B: Backend>(be: &B, shape: MergeShape, p: &[f64]) -> R<(Vec<f32>, Vec<f32>)> {
    let pb = be.upload_f64(p)?;
    let mut out = be.alloc(shape.heads * shape.width)?;
    let mut l = be.alloc(shape.heads)?;
    be.dcp_merge_partials(shape, &pb, &mut out, &mut l)?;
    Ok((be.download(&out)?, be.download(&l)?))
}

fn run_matmul<B: Backend>(be: &B, shape: MatmulShape, x: &[f32], w: &[f32]) -> R<Vec<f32>> {
    let (xb, wb) = (be.upload(x)?, be.upload(w)?);
    let mut out = be.alloc(shape.rows * shape.cols)?;
    be.matmul(shape, &xb, &wb, &mut out)?;
    be.download(&out)
}

/// `matmul_units` over products `dims[i]` = (inner, cols) with weights `ws`,
/// blocks of x and out laid side by side; `each` runs the one-by-one default.
fn run_units<B: Backend>(be: &B, shape: UnitsShape, x: &[f32], dims: &[(usize, usize)], ws: &[Vec<f32>], each: bool) -> R<Vec<f32>> {
    let wb: Vec<B::Buf> = ws.iter().map(|w| be.upload(w)).collect::<R<_>>()?;
    let (mut x_col, mut out_col) = (0, 0);
    let mut units = Vec::new();
    for (w, &(inner, cols)) in wb.iter().zip(dims) {
        units.push(UnitProduct { w, inner, cols, x_col, out_col });
        x_col += inner;
        out_col += cols;
    }
    let xb = be.upload(x)?;
    let mut out = be.alloc(shape.out_len("run_units", &units)?)?;
    if each {
        matmul_units_each(be, shape, &xb, &units, &mut out)?;
    } else {
        be.matmul_units(shape, &xb, &units, &mut out)?;
    }
    be.download(&out)
}

fn run_swiglu<B: Backend>(be: &B, shape: MlpShape, x: &[f32], g: &[f32], u: &[f32], d: &[f32]) -> R<Vec<f32>> {
    let (xb, gb, ub, db) = (be.upload(x)?, be.upload(g)?, be.upload(u)?, be.upload(d)?);
    let mut out = be.alloc(shape.tokens * shape.hidden)?;
    be.swiglu(shape, &xb, MlpWeights { gate: &gb, up: &ub, down: &db }, &mut out)?;
    be.download(&out)
}

fn run_elementwise<B: Backend>(be: &B, a: &[f32], b: &[f32]) -> R<(Vec<f32>, Vec<f32>)> {
    let (ab, bb) = (be.upload(a)?, be.upload(b)?);
    let mut o = be.alloc(a.len())?;
    be.silu_mul(&ab, &bb, &mut o)?;
    let mut d = be.upload(a)?;
    be.add_inplace(&mut d, &bb)?;
    Ok((be.download(&o)?, be.download(&d)?))
}

fn run_embedding<B: Backend>(be: &B, shape: EmbeddingShape, table: &[f32], ids: &[i32]) -> R<Vec<f32>> {
    let tb = be.upload(table)?;
    let ib = be.upload_i32(ids)?;
    let mut out = be.alloc(shape.tokens * shape.dim)?;
    be.embedding(shape, &tb, &ib, &mut out)?;
    be.download(&out)
}

fn run_argmax<B: Backend>(be: &B, rows: usize, cols: usize, logits: &[f32]) -> R<Vec<i32>> {
    let lb = be.upload(logits)?;
    let mut ids = be.alloc_i32(rows)?;
    be.argmax(rows, cols, &lb, &mut ids)?;
    be.download_i32(&ids)
}

/// fill, copy, copy_cols, copy_f64, upload_into and round_to on one set of data.
fn run_buffers<B: Backend>(be: &B, a: &[f32], cols: ColsCopy, p: &[f64]) -> R<Vec<Vec<f32>>> {
    let src = be.upload(a)?;
    let mut out = Vec::new();
    let mut f = be.alloc(a.len())?;
    be.fill(&mut f, -1.25)?;
    out.push(be.download(&f)?);
    let mut c = be.alloc(a.len())?;
    be.copy(&src, 3, &mut c, 10, a.len() - 20)?;
    out.push(be.download(&c)?);
    let mut cc = be.alloc(cols.rows * cols.dst_cols)?;
    be.copy_cols(cols, &src, &mut cc)?;
    out.push(be.download(&cc)?);
    let mut u = be.upload(a)?;
    be.upload_into(&mut u, 5, &a[..7])?;
    out.push(be.download(&u)?);
    let ps = be.upload_f64(p)?;
    let mut pd = be.alloc_f64(p.len() + 4)?;
    be.copy_f64(&ps, 1, &mut pd, 3, p.len() - 1)?;
    out.push(be.download_f64(&pd)?.iter().map(|&x| x as f32).collect());
    for dt in [StorageDtype::Bf16, StorageDtype::F16, StorageDtype::F32] {
        let mut r = be.upload(a)?;
        be.round_to(&mut r, dt)?;
        out.push(be.download(&r)?);
    }
    Ok(out)
}

// ------------------------------------------------------------------ checks

fn checks(gpu: &CudaBackend, rep: &mut Report, seed: u64) -> R<()> {
    let cpu = CpuBackend::new();
    let mut r = SplitMix64::new(seed);

    // Buffers, copies and storage rounding (with the values that test rounding).
    {
        let mut a = uni(&mut r, 4000, -3.0, 3.0);
        let special = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            65504.0,
            65520.0,
            70000.0,
            6.1035156e-5,
            5.9604645e-8,
            2.9802322e-8,
            1e-40,
            -1e-45,
            3.4e38,
            1.0 + 1.0 / 2048.0,
            -2.5,
        ];
        a[..special.len()].copy_from_slice(&special);
        let cols = ColsCopy { rows: 40, src_cols: 100, src_col: 13, dst_cols: 50, dst_col: 7, width: 31 };
        let p: Vec<f64> = (0..100).map(|i| i as f64 * 0.37 - 5.0).collect();
        let g = run_buffers(gpu, &a, cols, &p)?;
        let c = run_buffers(&cpu, &a, cols, &p)?;
        let names = ["fill", "copy", "copy_cols", "upload_into", "copy_f64", "round_to bf16", "round_to f16", "round_to f32"];
        for ((n, gv), cv) in names.iter().zip(&g).zip(&c) {
            rep.exact_f32(n, "4000 values incl. NaN, inf, subnormal, ties", gv, cv);
        }
    }

    // KDA step: K3's 128x128 heads, small heads, ragged widths (several column
    // tiles, rows not a multiple of 16), the widest dk; three steps, records.
    for &(b, h, dk, dv) in &[(4usize, 3usize, 128usize, 128usize), (5, 4, 16, 16), (3, 2, 40, 200), (2, 2, 256, 64), (1, 1, 7, 300)] {
        let steps: Vec<KdaHost> = (0..3).map(|_| KdaHost::new(&mut r, b, h, dk, dv)).collect();
        let s0 = uni(&mut r, b * h * dk * dv, -0.5, 0.5);
        let (go, gs, gr) = run_kda_steps(gpu, b, &steps, &s0)?;
        let (co, cs, cr) = run_kda_steps(&cpu, b, &steps, &s0)?;
        let case = format!("B={b} H={h} dk={dk} dv={dv}, 3 steps");
        rep.close("kda_step out", &case, &go, &co, 1e-5);
        rep.close("kda_step state", &case, &gs, &cs, 1e-5);
        rep.close("kda_step record", &case, &gr, &cr, 1e-5);
    }

    // KDA prefill: CPU chunked (wide heads) and recurrent (small heads) forms;
    // where the GPU runs the recurrent prefill too (under a chunk of tokens,
    // narrow heads) it must equal its own steps bit for bit; its chunked
    // prefill (T = 65 and up here, and the 40x200 heads) agrees with the CPU
    // to 1e-4.
    for &(t, h, dk, dv) in &[(1usize, 2usize, 128usize, 128usize), (63, 2, 128, 128), (65, 2, 128, 128), (200, 2, 128, 128), (100, 4, 16, 16), (70, 3, 40, 200)]
    {
        let c = KdaHost::new(&mut r, t, h, dk, dv);
        let s0 = uni(&mut r, h * dk * dv, -0.5, 0.5);
        let (go, gs, gr) = run_kda_prefill(gpu, t, &c, &s0)?;
        let (co, cs, cr) = run_kda_prefill(&cpu, t, &c, &s0)?;
        let case = format!("T={t} H={h} dk={dk} dv={dv}");
        rep.close("kda_prefill out", &case, &go, &co, 1e-4);
        rep.close("kda_prefill state", &case, &gs, &cs, 1e-4);
        rep.close("kda_prefill record", &case, &gr, &cr, 1e-4);
        if t <= 65 && !device_prefill_chunked(t, dk, dv) {
            // T steps of batch one on the device.
            let steps: Vec<KdaHost> = (0..t).map(|i| c.rows(i, i + 1)).collect();
            let shape = KdaStepShape { batch: 1, heads: h, dk, dv };
            let mut state = gpu.upload(&s0)?;
            let mut outs = Vec::new();
            let mut o = gpu.alloc(h * dv)?;
            for s in &steps {
                let d = KdaDev::new(gpu, s)?;
                gpu.kda_step(shape, &mut state, d.inputs(), d.params(), &mut o, None)?;
                outs.extend(gpu.download(&o)?);
            }
            rep.exact_f32("kda_prefill = T gpu steps", &format!("{case}: out"), &go, &outs);
            rep.exact_f32("kda_prefill = T gpu steps", &format!("{case}: state"), &gs, &gpu.download(&state)?);
        }
    }

    // Chunked KDA prefill on the device against the CPU's chunked form: K3's
    // 128x128 heads, one chunk exactly, one token past it, a short last
    // chunk, many chunks; a nonzero initial state; with and without the
    // record (the output must not depend on it); two runs bit-equal.
    for &(t, h) in &[(64usize, 2usize), (65, 3), (200, 2), (1000, 3)] {
        let (dk, dv) = (128usize, 128usize);
        let c = KdaHost::new(&mut r, t, h, dk, dv);
        let s0 = uni(&mut r, h * dk * dv, -0.5, 0.5);
        let case = format!("T={t} H={h} dk={dk} dv={dv}");
        let (go, gs, gr) = run_kda_prefill(gpu, t, &c, &s0)?;
        let (co, cs, cr) = run_kda_prefill(&cpu, t, &c, &s0)?;
        rep.close("kda_prefill chunked out", &case, &go, &co, 1e-4);
        rep.close("kda_prefill chunked state", &case, &gs, &cs, 1e-4);
        rep.close("kda_prefill chunked record", &case, &gr, &cr, 1e-4);
        let (no, ns) = run_kda_prefill_norec(gpu, t, &c, &s0)?;
        let (cno, cns) = run_kda_prefill_norec(&cpu, t, &c, &s0)?;
        rep.close("kda_prefill chunked no rec", &format!("{case}: out"), &no, &cno, 1e-4);
        rep.close("kda_prefill chunked no rec", &format!("{case}: state"), &ns, &cns, 1e-4);
        rep.exact_f32("kda_prefill chunked rec = no rec", &case, &[no, ns].concat(), &[go.clone(), gs.clone()].concat());
        let (go2, gs2, gr2) = run_kda_prefill(gpu, t, &c, &s0)?;
        rep.exact_f32("determinism kda_prefill chunk", &format!("{case}, two runs"), &[go2, gs2, gr2].concat(), &[go, gs, gr].concat());
    }

    // ReplaySSM: records from real steps, two appends of 3 tokens, commit.
    {
        let (b, h, dk, dv, cap, tokens) = (3usize, 2usize, 32usize, 48usize, 8usize, 3usize);
        let shape = ReplayShape { batch: b, heads: h, dk, dv, capacity: cap };
        let w = replay_record_width(dk, dv);
        let mut recs = [Vec::new(), Vec::new()];
        for rr in recs.iter_mut() {
            // [B, tokens, H, w]: plausible records (k^ unit-ish, g negative).
            let mut v = Vec::with_capacity(b * tokens * h * w);
            for _ in 0..b * tokens * h {
                v.extend(uni(&mut r, dk, -0.3, 0.3));
                v.extend(uni(&mut r, dv, -1.0, 1.0));
                v.extend(uni(&mut r, dk, -0.5, -0.01));
            }
            *rr = v;
        }
        let cursor0 = vec![0, 1, 2];
        let s0 = uni(&mut r, b * h * dk * dv, -0.5, 0.5);
        let g = run_replay(gpu, shape, tokens, &recs, &cursor0, &s0)?;
        let c = run_replay(&cpu, shape, tokens, &recs, &cursor0, &s0)?;
        let case = format!("B={b} H={h} dk={dk} dv={dv} cap={cap}, 2 x {tokens} tokens");
        rep.exact_f32("replay_append ring", &case, &g.0, &c.0);
        rep.exact_i32("replay_append cursor", &case, &g.1, &c.1);
        rep.close("replay_commit state", &case, &g.2, &c.2, 1e-5);
        rep.exact_i32("replay_commit cursor", &case, &g.3, &c.3);
        // A third append overflows slot 2 (2 + 6 + 3 > 8): both refuse the same way.
        let full = |be: &dyn Fn() -> R<()>| be();
        let ge = full(&|| {
            let mut ring = gpu.alloc(b * cap * h * w)?;
            let mut cur = gpu.upload_i32(&[0, 1, 6])?;
            let rb = gpu.upload(&recs[0])?;
            gpu.replay_append(shape, tokens, &mut ring, &mut cur, &rb)
        });
        let ce = full(&|| {
            let mut ring = cpu.alloc(b * cap * h * w)?;
            let mut cur = cpu.upload_i32(&[0, 1, 6])?;
            let rb = cpu.upload(&recs[0])?;
            cpu.replay_append(shape, tokens, &mut ring, &mut cur, &rb)
        });
        rep.flag("replay_append refuses full", "cursor 6 + 3 > 8", ge.is_err() && ge == ce, "same error");
    }

    // Short conv.
    for &(t, ch, width) in &[(1usize, 96usize, 4usize), (2, 96, 4), (37, 200, 4), (5, 33, 1)] {
        let shape = ConvShape { channels: ch, width };
        let x = uni(&mut r, t * ch, -2.0, 2.0);
        let w = uni(&mut r, ch * width, -1.0, 1.0);
        let st = uni(&mut r, (width - 1) * ch, -2.0, 2.0);
        let g = run_conv_prefill(gpu, shape, t, &x, &w, &st)?;
        let c = run_conv_prefill(&cpu, shape, t, &x, &w, &st)?;
        let case = format!("T={t} C={ch} W={width}");
        rep.close("conv_prefill out", &case, &g.0, &c.0, 1e-5);
        rep.exact_f32("conv_prefill state", &case, &g.1, &c.1);
    }
    for &(b, ch, width) in &[(5usize, 96usize, 4usize), (88, 64, 4), (3, 10, 1)] {
        let shape = ConvShape { channels: ch, width };
        let x = uni(&mut r, b * ch, -2.0, 2.0);
        let w = uni(&mut r, ch * width, -1.0, 1.0);
        let st = uni(&mut r, b * (width - 1) * ch, -2.0, 2.0);
        let g = run_conv_step(gpu, shape, b, &x, &w, &st)?;
        let c = run_conv_step(&cpu, shape, b, &x, &w, &st)?;
        let case = format!("B={b} C={ch} W={width}");
        rep.close("conv_step out", &case, &g.0, &c.0, 1e-5);
        rep.exact_f32("conv_step state", &case, &g.1, &c.1);
    }

    // Norms.
    for &(rows, dim) in &[(7usize, 33usize), (88, 7168), (3, 1)] {
        let shape = NormShape { rows, dim, eps: 1e-5 };
        let x = uni(&mut r, rows * dim, -3.0, 3.0);
        let gt = uni(&mut r, rows * dim, -3.0, 3.0);
        let w = uni(&mut r, dim, 0.5, 1.5);
        let g = run_norms(gpu, shape, &x, &gt, &w)?;
        let c = run_norms(&cpu, shape, &x, &gt, &w)?;
        let case = format!("rows={rows} dim={dim}");
        rep.close("rms_norm", &case, &g.0, &c.0, 1e-5);
        rep.close("gated_rms_norm", &case, &g.1, &c.1, 1e-5);
    }

    // MLA prefill (with a cached prefix) and decode; f64 partials.
    let small = MlaShape { heads: 4, kv_lora_rank: 32, rope_dim: 8, scale: 1.0 / 24f32.sqrt() };
    let k3 = MlaShape { heads: 8, kv_lora_rank: 512, rope_dim: 64, scale: 1.0 / 192f32.sqrt() };
    for &(shape, t, n) in &[(small, 12usize, 40usize), (small, 1, 1), (k3, 100, 300)] {
        let wd = shape.row_width();
        let q = uni(&mut r, t * shape.heads * wd, -1.0, 1.0);
        let rows = uni(&mut r, (n + 3) * wd, -1.0, 1.0); // 3 rows past N: must be ignored
        let g = run_mla_prefill(gpu, shape, t, &q, &rows, n)?;
        let c = run_mla_prefill(&cpu, shape, t, &q, &rows, n)?;
        let case = format!("H={} L={} R={} T={t} N={n}", shape.heads, shape.kv_lora_rank, shape.rope_dim);
        rep.close("mla_prefill out", &case, &g.0, &c.0, 1e-5);
        rep.close("mla_prefill lse", &case, &g.1, &c.1, 1e-5);
    }
    for &(shape, n) in &[(small, 0usize), (small, 1), (small, 77), (k3, 777), (k3, 4096)] {
        let wd = shape.row_width();
        let q = uni(&mut r, shape.heads * wd, -1.0, 1.0);
        let rows = uni(&mut r, (n + 2) * wd, -1.0, 1.0);
        let g = run_mla_decode(gpu, shape, &q, &rows, n)?;
        let c = run_mla_decode(&cpu, shape, &q, &rows, n)?;
        let case = format!("H={} L={} N={n}", shape.heads, shape.kv_lora_rank);
        rep.close("mla_decode out", &case, &g.0, &c.0, 1e-5);
        rep.close("mla_decode lse", &case, &g.1, &c.1, 1e-5);
        rep.close64("mla_decode_partial (f64)", &case, &g.2, &c.2, 1e-12);
    }

    // Ragged partials: against the CPU, against each request alone (batch
    // invariance), and twice (determinism).
    // K3's rows run the tensor-core kernel (chunks of 512 rows by default,
    // tiles of 16, heads in groups of 8): counts across chunk and tile edges,
    // 16 heads.
    let k3h16 = MlaShape { heads: 16, ..k3 };
    for &(shape, ref counts) in &[
        (small, vec![3usize, 0, 17, 1]),
        (k3, vec![0usize, 5, 300, 1, 1024, 64]),
        (k3, vec![2049usize, 17, 255, 256, 511, 0, 16]),
        (k3h16, vec![257usize, 0, 15, 600]),
    ] {
        let wd = shape.row_width();
        let b = counts.len();
        let total: usize = counts.iter().sum();
        let q = uni(&mut r, b * shape.heads * wd, -1.0, 1.0);
        let rows = uni(&mut r, total * wd, -1.0, 1.0);
        let g = run_ragged(gpu, shape, &q, &rows, counts)?;
        let c = run_ragged(&cpu, shape, &q, &rows, counts)?;
        let case = format!("H={} L={} counts={counts:?}", shape.heads, shape.kv_lora_rank);
        rep.close64("mla_partial_ragged (f64)", &case, &g, &c, 1e-12);
        let mut alone = Vec::new();
        let mut r0 = 0;
        let per_q = shape.heads * wd;
        for (i, &n) in counts.iter().enumerate() {
            alone.extend(run_ragged(gpu, shape, &q[i * per_q..(i + 1) * per_q], &rows[r0 * wd..(r0 + n) * wd], &[n])?);
            r0 += n;
        }
        rep.exact_f64("batch-invariance ragged MLA", &format!("{case}: batch vs each alone"), &g, &alone);
        let again = run_ragged(gpu, shape, &q, &rows, counts)?;
        rep.exact_f64("determinism ragged MLA", &case, &again, &g);
    }

    // DCP merges (a head with all shards empty).
    {
        let shape = MergeShape { shards: 4, heads: 8, width: 512 };
        let o = uni(&mut r, 4 * 8 * 512, -1.0, 1.0);
        let mut lse = uni(&mut r, 4 * 8, -5.0, 5.0);
        for s in 0..4 {
            lse[s * 8 + 3] = f32::NEG_INFINITY;
        }
        lse[8 + 5] = f32::NEG_INFINITY;
        let g = run_dcp_merge(gpu, shape, &o, &lse)?;
        let c = run_dcp_merge(&cpu, shape, &o, &lse)?;
        rep.close("dcp_merge out", "S=4 H=8 W=512, one head empty", &g.0, &c.0, 1e-5);
        rep.close("dcp_merge lse", "S=4 H=8 W=512, one head empty", &g.1, &c.1, 1e-5);
    }
    {
        let (s, h, l) = (3usize, 8usize, 512usize);
        let shape = MergeShape { shards: s, heads: h, width: l };
        let pw = mla_partial_width(l);
        let mut p = Vec::with_capacity(s * h * pw);
        for sh in 0..s {
            for hd in 0..h {
                if hd == 2 || (sh == 1 && hd == 6) {
                    p.push(f64::NEG_INFINITY);
                    p.push(0.0);
                    p.extend(std::iter::repeat_n(0.0, l));
                } else {
                    p.push(r.next_f64() * 10.0 - 5.0);
                    p.push(r.next_f64() * 100.0 + 1.0);
                    p.extend((0..l).map(|_| r.next_f64() * 50.0 - 25.0));
                }
            }
        }
        let g = run_merge_partials(gpu, shape, &p)?;
        let c = run_merge_partials(&cpu, shape, &p)?;
        rep.close("dcp_merge_partials out", "S=3 H=8 L=512, empty shards", &g.0, &c.0, 1e-6);
        rep.close("dcp_merge_partials lse", "S=3 H=8 L=512, empty shards", &g.1, &c.1, 1e-6);
    }

    // Dense.
    for &(rows, inner, cols) in &[(1usize, 1000usize, 777usize), (130, 333, 65), (88, 512, 1024), (3, 7, 5), (64, 0, 8)] {
        let shape = MatmulShape { rows, inner, cols };
        let x = uni(&mut r, rows * inner, -1.0, 1.0);
        let w = uni(&mut r, inner * cols, -1.0, 1.0);
        let g = run_matmul(gpu, shape, &x, &w)?;
        let c = run_matmul(&cpu, shape, &x, &w)?;
        rep.close("matmul", &format!("{rows}x{inner} . {inner}x{cols}"), &g, &c, 3e-5);
    }
    {
        let shape = MlpShape { tokens: 5, hidden: 64, intermediate: 136 };
        let x = uni(&mut r, 5 * 64, -1.0, 1.0);
        let gw = uni(&mut r, 64 * 136, -0.3, 0.3);
        let uw = uni(&mut r, 64 * 136, -0.3, 0.3);
        let dw = uni(&mut r, 136 * 64, -0.3, 0.3);
        let g = run_swiglu(gpu, shape, &x, &gw, &uw, &dw)?;
        let c = run_swiglu(&cpu, shape, &x, &gw, &uw, &dw)?;
        rep.close("swiglu", "T=5 hidden=64 inter=136", &g, &c, 3e-5);
    }
    {
        let a = uni(&mut r, 100_003, -8.0, 8.0);
        let b = uni(&mut r, 100_003, -2.0, 2.0);
        let g = run_elementwise(gpu, &a, &b)?;
        let c = run_elementwise(&cpu, &a, &b)?;
        rep.close("silu_mul", "n=100003", &g.0, &c.0, 1e-5);
        rep.exact_f32("add_inplace", "n=100003", &g.1, &c.1);
    }
    {
        let shape = EmbeddingShape { tokens: 9, vocab: 1000, dim: 65 };
        let table = uni(&mut r, 1000 * 65, -1.0, 1.0);
        let ids = [0, 999, 5, 5, 17, 500, 1, 998, 42];
        let g = run_embedding(gpu, shape, &table, &ids)?;
        let c = run_embedding(&cpu, shape, &table, &ids)?;
        rep.exact_f32("embedding", "9 ids of vocab 1000, dim 65", &g, &c);
        let bad = [0, 1000, 2, 3, 4, 5, 6, 7, 8];
        let ge = run_embedding(gpu, shape, &table, &bad).err();
        let ce = run_embedding(&cpu, shape, &table, &bad).err();
        rep.flag("embedding refuses bad id", "id 1000 of vocab 1000", ge.is_some() && ge == ce, "same error");
    }
    {
        let (rows, cols) = (6usize, 5000usize);
        let mut l = uni(&mut r, rows * cols, -10.0, 10.0);
        l[cols + 100] = 50.0; // row 1: a tie, lowest index wins
        l[cols + 4000] = 50.0;
        for v in &mut l[2 * cols..3 * cols] {
            *v = f32::NAN; // row 2: all NaN -> 0
        }
        for (i, v) in l[3 * cols..4 * cols].iter_mut().enumerate() {
            *v = if i % 2 == 0 { f32::NAN } else { f32::NEG_INFINITY }; // row 3: NaNs and -inf -> 1
        }
        l[4 * cols + 4999] = 11.0; // row 4: max at the end, NaN before it
        l[4 * cols + 4998] = f32::NAN;
        l[5 * cols] = f32::INFINITY; // row 5: +inf first
        let g = run_argmax(gpu, rows, cols, &l)?;
        let c = run_argmax(&cpu, rows, cols, &l)?;
        rep.exact_i32("argmax", "ties, NaNs, all-NaN row, -inf, +inf", &g, &c);
        let (rows, cols) = (88usize, 163_840usize);
        let l = uni(&mut r, rows * cols, -10.0, 10.0);
        rep.exact_i32("argmax", "88 rows x vocab 163840", &run_argmax(gpu, rows, cols, &l)?, &run_argmax(&cpu, rows, cols, &l)?);
    }

    // Batch invariance and determinism on the GPU.
    {
        let (rows, inner, cols) = (88usize, 1024usize, 520usize);
        let shape = MatmulShape { rows, inner, cols };
        let x = uni(&mut r, rows * inner, -1.0, 1.0);
        let w = uni(&mut r, inner * cols, -1.0, 1.0);
        let all = run_matmul(gpu, shape, &x, &w)?;
        let mut alone = Vec::new();
        for i in 0..rows {
            alone.extend(run_matmul(gpu, MatmulShape { rows: 1, inner, cols }, &x[i * inner..(i + 1) * inner], &w)?);
        }
        rep.exact_f32("batch-invariance matmul", "88 rows vs each row alone (1024x520)", &all, &alone);
        let some = run_matmul(gpu, MatmulShape { rows: 7, inner, cols }, &x[40 * inner..47 * inner], &w)?;
        rep.exact_f32("batch-invariance matmul", "rows 40..47 as a batch of 7", &some, &all[40 * cols..47 * cols]);
        rep.exact_f32("determinism matmul", "88x1024 . 1024x520, two runs", &run_matmul(gpu, shape, &x, &w)?, &all);
    }
    {
        // Across the two tile shapes: 300 and 129 rows take 32-row tiles, 1
        // and 7 rows 16-row ones; inner 1000 ends mid-chunk and mid-tile.
        let (rows, inner, cols) = (300usize, 1000usize, 200usize);
        let x = uni(&mut r, rows * inner, -1.0, 1.0);
        let w = uni(&mut r, inner * cols, -1.0, 1.0);
        let all = run_matmul(gpu, MatmulShape { rows, inner, cols }, &x, &w)?;
        let mut alone = Vec::new();
        for i in [0usize, 17, 150, 299] {
            alone.extend(run_matmul(gpu, MatmulShape { rows: 1, inner, cols }, &x[i * inner..(i + 1) * inner], &w)?);
        }
        let picked: Vec<f32> = [0usize, 17, 150, 299].iter().flat_map(|&i| all[i * cols..(i + 1) * cols].iter().copied()).collect();
        rep.exact_f32("batch-invariance matmul", "rows of a 300-row call (32-row tiles) vs each alone (16-row tiles)", &picked, &alone);
        let seven = run_matmul(gpu, MatmulShape { rows: 7, inner, cols }, &x[100 * inner..107 * inner], &w)?;
        rep.exact_f32("batch-invariance matmul", "rows 100..107 of 300 as a batch of 7 (16-row tiles)", &seven, &all[100 * cols..107 * cols]);
        let big = run_matmul(gpu, MatmulShape { rows: 129, inner, cols }, &x[..129 * inner], &w)?;
        rep.exact_f32("batch-invariance matmul", "rows 0..129 of 300 as a batch of 129 (32-row tiles)", &big, &all[..129 * cols]);
    }
    {
        let (b, h, dk, dv) = (16usize, 2usize, 128usize, 128usize);
        let step = KdaHost::new(&mut r, b, h, dk, dv);
        let s0 = uni(&mut r, b * h * dk * dv, -0.5, 0.5);
        let (ao, as_, ar) = run_kda_steps(gpu, b, std::slice::from_ref(&step), &s0)?;
        let (mut lo, mut ls, mut lr) = (Vec::new(), Vec::new(), Vec::new());
        let per = h * dk * dv;
        for i in 0..b {
            let (o, s, rr) = run_kda_steps(gpu, 1, std::slice::from_ref(&step.rows(i, i + 1)), &s0[i * per..(i + 1) * per])?;
            lo.extend(o);
            ls.extend(s);
            lr.extend(rr);
        }
        let case = "B=16 H=2 128x128 vs each slot alone";
        rep.exact_f32("batch-invariance kda_step", &format!("{case}: out"), &ao, &lo);
        rep.exact_f32("batch-invariance kda_step", &format!("{case}: state"), &as_, &ls);
        rep.exact_f32("batch-invariance kda_step", &format!("{case}: record"), &ar, &lr);
        let (bo, bs, _) = run_kda_steps(gpu, b, std::slice::from_ref(&step), &s0)?;
        rep.exact_f32("determinism kda_step", "B=16 H=2 128x128, two runs", &[bo, bs].concat(), &[ao.clone(), as_.clone()].concat());
    }
    Ok(())
}

/// The launch-saving paths (`CudaBackend::set_fused`, on by default) against
/// the paths they replace, bit for bit.
fn check_fused(gpu: &mut CudaBackend, rep: &mut Report, seed: u64) -> R<()> {
    let cpu = CpuBackend::new();
    let mut r = SplitMix64::new(seed ^ 0x0F05_ED00);
    let fused_default = true;
    {
        // Several products in one call (matmul_units): every product's bits are
        // those of matmul on its block alone (the one-by-one default); heads side
        // by side and stacked, unequal widths ending mid-chunk, 40 products (two
        // launches), 1, 88 and 200 rows (200 through the tiled kernel).
        for stacked in [false, true] {
            for &rows in &[1usize, 88, 200] {
                let n = 40;
                let dims: Vec<(usize, usize)> = (0..n).map(|i| (120 + 5 * (i % 3), if stacked { 96 } else { 64 + i % 2 })).collect();
                let x_width: usize = dims.iter().map(|d| d.0).sum::<usize>() + 3;
                let width: usize = dims.iter().map(|d| d.1).sum::<usize>() + 5;
                let out = if stacked { UnitsOut::Stacked } else { UnitsOut::Columns { width } };
                let shape = UnitsShape { rows, x_width, out };
                let x = uni(&mut r, rows * x_width, -1.0, 1.0);
                let ws: Vec<Vec<f32>> = dims.iter().map(|&(k, c)| uni(&mut r, k * c, -1.0, 1.0)).collect();
                gpu.set_fused(true);
                let fused = run_units(gpu, shape, &x, &dims, &ws, false)?;
                gpu.set_fused(false);
                let unfused = run_units(gpu, shape, &x, &dims, &ws, false)?;
                let each = run_units(gpu, shape, &x, &dims, &ws, true)?;
                let case = format!("{n} products of {rows} rows, {}", if stacked { "stacked" } else { "side by side" });
                rep.exact_f32("matmul_units fused vs each", &case, &fused, &each);
                rep.exact_f32("matmul_units unfused vs each", &case, &unfused, &each);
                rep.close("matmul_units", &case, &fused, &run_units(&cpu, shape, &x, &dims, &ws, true)?, 3e-5);
            }
        }
        // The all-reduce's sum of stacked partials: the bits of add_inplace in order.
        let (n, units) = (5000usize, 9usize);
        let stacked = uni(&mut r, n * units, -1.0, 1.0);
        let acc0 = uni(&mut r, n, -1.0, 1.0);
        let mut want = gpu.upload(&acc0)?;
        for u in 2..units {
            gpu.add_inplace(&mut want, &gpu.upload(&stacked[u * n..(u + 1) * n])?)?;
        }
        let want = gpu.download(&want)?;
        for fused in [true, false] {
            gpu.set_fused(fused);
            let mut acc = gpu.upload(&acc0)?;
            gpu.add_units(&mut acc, &gpu.upload(&stacked)?, 2..units)?;
            let case = format!("units 2..9 of 5000 values, fused {fused}");
            rep.exact_f32("add_units vs add_inplace", &case, &gpu.download(&acc)?, &want);
        }
        // i32 downloads answered from what the host knows: after an upload, after
        // replay ops set the cursors, and after argmax (which the host does not know).
        gpu.set_fused(true);
        let ids = gpu.upload_i32(&[3, 1, 4])?;
        rep.exact_i32("download_i32 known", "after upload", &gpu.download_i32(&ids)?, &[3, 1, 4]);
        let logits = uni(&mut r, 3 * 50, -1.0, 1.0);
        let mut picks = gpu.upload_i32(&[0, 0, 0])?;
        gpu.argmax(3, 50, &gpu.upload(&logits)?, &mut picks)?;
        let want_picks = run_argmax(&cpu, 3, 50, &logits)?;
        rep.exact_i32("download_i32 known", "after argmax (device values)", &gpu.download_i32(&picks)?, &want_picks);
        let (b, h, dk, dv, cap) = (3usize, 2usize, 16usize, 16usize, 4usize);
        let cursor0 = [0i32, 2, 3];
        let state = uni(&mut r, b * h * dk * dv, -0.5, 0.5);
        let recs = uni(&mut r, b * h * replay_record_width(dk, dv), -0.5, 0.5);
        let mut got = Vec::new();
        for fused in [true, false] {
            gpu.set_fused(fused);
            let shape = ReplayShape { batch: b, heads: h, dk, dv, capacity: cap };
            let mut ring = gpu.alloc(b * cap * h * replay_record_width(dk, dv))?;
            let mut cur = gpu.upload_i32(&cursor0)?;
            gpu.replay_append(shape, 1, &mut ring, &mut cur, &gpu.upload(&recs)?)?;
            let after_append = gpu.download_i32(&cur)?;
            let mut st = gpu.upload(&state)?;
            gpu.replay_commit(shape, &mut st, &ring, &mut cur)?;
            got.push((after_append, gpu.download_i32(&cur)?, gpu.download(&st)?));
        }
        rep.exact_i32("download_i32 known", "cursors after replay_append", &got[0].0, &got[1].0);
        rep.exact_i32("download_i32 known", "cursors after replay_commit", &got[0].1, &got[1].1);
        rep.exact_f32("download_i32 known", "state after replay_commit", &got[0].2, &got[1].2);
        gpu.set_fused(fused_default);
    }
    Ok(())
}

/// Every KDA step kernel variant (tile width, blocks per multiprocessor)
/// gives the same bits; the prefill kernel does not depend on the choice.
fn check_kda_variants(gpu: &mut CudaBackend, rep: &mut Report, seed: u64) -> R<()> {
    let mut r = SplitMix64::new(seed ^ 0x5eed);
    let (b, h, dk, dv) = (8usize, 3usize, 128usize, 200usize);
    let steps: Vec<KdaHost> = (0..2).map(|_| KdaHost::new(&mut r, b, h, dk, dv)).collect();
    let s0 = uni(&mut r, b * h * dk * dv, -0.5, 0.5);
    let pre = KdaHost::new(&mut r, 40, h, dk, dv);
    let p0 = uni(&mut r, h * dk * dv, -0.5, 0.5);
    let default = gpu.kda_kernel();
    let flat = |x: (Vec<f32>, Vec<f32>, Vec<f32>)| [x.0, x.1, x.2].concat();
    let want_step = flat(run_kda_steps(gpu, b, &steps, &s0)?);
    let want_pre = flat(run_kda_prefill(gpu, 40, &pre, &p0)?);
    for k in KdaKernel::ALL {
        gpu.set_kda_kernel(k);
        let got = flat(run_kda_steps(gpu, b, &steps, &s0)?);
        rep.exact_f32(&format!("kda {k:?} = {default:?} kernel"), "step B=8 H=3 128x200, 2 steps", &got, &want_step);
        let got = flat(run_kda_prefill(gpu, 40, &pre, &p0)?);
        rep.exact_f32(&format!("kda {k:?} = {default:?} kernel"), "prefill T=40 H=3 128x200", &got, &want_pre);
    }
    gpu.set_kda_kernel(default);
    Ok(())
}

/// Device regions: the backend's region ops against the host's byte encoding
/// (exact), and the device memory's 2D copies against a host loop (exact).
fn check_regions(gpu: &CudaBackend, rep: &mut Report, seed: u64) -> R<()> {
    let mut r = SplitMix64::new(seed ^ 0x4e61);
    let mem = gpu.device_memory()?;
    let len = 8u64 << 20;
    let addr = mem.alloc(len)?;
    let region = DeviceRegion { addr, len };
    let mut zero = vec![1u8; len as usize];
    unsafe { mem.read(addr, &mut zero)? };
    rep.flag("region alloc", "8 MiB, zeroed", zero.iter().all(|&b| b == 0), "all 0");
    // Items at scattered, aligned offsets, each dtype: scatter then gather.
    for (dt, vb) in [(StorageDtype::F32, 4u64), (StorageDtype::Bf16, 2), (StorageDtype::F16, 2)] {
        let values = 576usize;
        let offsets: Vec<u64> = (0..37u64).map(|i| (i * 7919 * vb * 3) % (len - values as u64 * vb) / vb * vb).collect();
        // Distinct items (no overlap): keep the first of overlapping ones.
        let mut items: Vec<u64> = Vec::new();
        for o in offsets {
            if items.iter().all(|&p| o + values as u64 * vb <= p || p + values as u64 * vb <= o) {
                items.push(o);
            }
        }
        let xs = uni(&mut r, items.len() * values, -3.0, 3.0);
        let it = RegionItems { offsets: &items, values, dtype: dt };
        gpu.region_scatter(&gpu.upload(&xs)?, region, it)?;
        let mut host = vec![0u8; len as usize];
        unsafe { mem.read(addr, &mut host)? };
        let mut want_bytes = Vec::new();
        let mut got_bytes = Vec::new();
        let mut want_vals = Vec::new();
        for (i, &o) in items.iter().enumerate() {
            for j in 0..values {
                let x = xs[i * values + j];
                let at = (o + j as u64 * vb) as usize;
                got_bytes.extend_from_slice(&host[at..at + vb as usize]);
                match dt {
                    StorageDtype::F32 => {
                        want_bytes.extend_from_slice(&x.to_le_bytes());
                        want_vals.push(x);
                    }
                    StorageDtype::Bf16 => {
                        want_bytes.extend_from_slice(&f32_to_bf16(x).to_le_bytes());
                        want_vals.push(bf16_to_f32(f32_to_bf16(x)));
                    }
                    StorageDtype::F16 => {
                        want_bytes.extend_from_slice(&f32_to_f16(x).to_le_bytes());
                        want_vals.push(f16_to_f32(f32_to_f16(x)));
                    }
                }
            }
        }
        rep.flag("region_scatter", &format!("{} items x {values} {dt:?}: bytes = host encoding", items.len()), got_bytes == want_bytes, "bytes");
        let back = gpu.download(&gpu.region_gather(region, it)?)?;
        rep.exact_f32("region_gather", &format!("{} items x {values} {dt:?}", items.len()), &back, &want_vals);
    }
    let offs = [8u64, 4000, 123_456 * 4];
    gpu.region_scatter_i32(&gpu.upload_i32(&[7, -3, 1 << 30])?, region, &offs)?;
    let got = gpu.download_i32(&gpu.region_gather_i32(region, &offs)?)?;
    rep.exact_i32("region_gather_i32", "3 cursors", &got, &[7, -3, 1 << 30]);
    let past = gpu.region_gather(region, RegionItems { offsets: &[len - 8], values: 4, dtype: StorageDtype::F32 });
    rep.flag("region_gather", "an item past the region's end", past.is_err(), "refused");
    // 2D copies between two allocations, against the same copies on the host.
    let dst = mem.alloc(len)?;
    let mut src_host = vec![0u8; len as usize];
    for b in src_host.iter_mut() {
        *b = (r.next_u64() & 0xff) as u8;
    }
    unsafe { mem.write(addr, &src_host)? };
    let mut copies = vec![
        Copy2d { src: addr + 64, src_pitch: 1152, dst: dst + 128, dst_pitch: 4608, width: 1152, height: 100 },
        Copy2d { src: addr + 300_000, src_pitch: 0, dst: dst + 700_000, dst_pitch: 0, width: 65_536, height: 1 },
        Copy2d { src: addr, src_pitch: 16, dst: dst + 128, dst_pitch: 16, width: 16, height: 1 },
        // Narrow rows on 4-byte and on byte alignment (the kernel's other
        // paths), two overlapping narrow copies (must stay in order), and wide
        // strided rows (the copy engines' 2D copy).
        Copy2d { src: addr + 4, src_pitch: 1004, dst: dst + 800_004, dst_pitch: 1008, width: 1000, height: 9 },
        Copy2d { src: addr + 3, src_pitch: 1001, dst: dst + 820_001, dst_pitch: 1003, width: 999, height: 7 },
        Copy2d { src: addr + 9_000, src_pitch: 64, dst: dst + 820_500, dst_pitch: 64, width: 48, height: 40 },
        Copy2d { src: addr + 100_000, src_pitch: 70_000, dst: dst + 850_000, dst_pitch: 66_000, width: 65_600, height: 2 },
        // A large contiguous copy (the table kernel: below the copy-engine
        // size), then a small copy over part of what it wrote (must come after it).
        Copy2d { src: addr + (2 << 20), src_pitch: 4 << 20, dst: dst + (2 << 20), dst_pitch: 4 << 20, width: 4 << 20, height: 1 },
        Copy2d { src: addr + 100, src_pitch: 500, dst: dst + (2 << 20) + 1000, dst_pitch: 500, width: 500, height: 1 },
    ];
    // More copies than one table holds.
    copies.extend((0..100u64).map(|i| Copy2d {
        src: addr + 1_000_000 + i * 256,
        src_pitch: 200,
        dst: dst + 1_000_000 + i * 208,
        dst_pitch: 200,
        width: 200,
        height: 1,
    }));
    let t = unsafe { mem.copy(&copies)? };
    let mut spins = 0u64;
    while !mem.done(t)? {
        spins += 1;
        std::hint::spin_loop();
    }
    let mut want = vec![0u8; len as usize];
    for c in &copies {
        for row in 0..c.height {
            let s = (c.src - addr + row * c.src_pitch) as usize;
            let d = (c.dst - dst + row * c.dst_pitch) as usize;
            want[d..d + c.width as usize].copy_from_slice(&src_host[s..s + c.width as usize]);
        }
    }
    let mut got = vec![0u8; len as usize];
    unsafe { mem.read(dst, &mut got)? };
    rep.flag(
        "device copy",
        &format!("{} copies: 2D narrow (16/4/1-byte words) and wide, contiguous up to 4 MiB, overlapping, in order ({spins} polls)", copies.len()),
        got == want,
        "bytes",
    );
    rep.flag("device copy", "a ticket is forgotten once done", mem.done(t).is_err(), "refused");
    let handle = mem.export(addr)?;
    rep.flag("ipc export", "a region's handle", handle.len() == 64, "64 bytes");
    unsafe {
        mem.free(dst);
        mem.free(addr);
    }
    Ok(())
}

// ------------------------------------------------------------------ bench

/// MLA DCP decode partial on K3's rows (f32 here, 576 wide), 8 heads per rank:
/// rows read per second against the read half of the device copy. The rows
/// are random (one request's block uploaded, copied to every request). The
/// kernel is the backend's (`--mla`, printed).
fn bench_mla(gpu: &CudaBackend, bw: f64, r: &mut SplitMix64, kernel: &str) -> R<()> {
    let shape = MlaShape { heads: 8, kv_lora_rank: 512, rope_dim: 64, scale: 1.0 / 192f32.sqrt() };
    for &(b, n) in &[(88usize, 8192usize), (88, 32768), (8, 8192), (1, 32768), (88, 131072)] {
        let wd = shape.row_width();
        let q = gpu.upload(&uni(r, b * shape.heads * wd, -1.0, 1.0))?;
        let one = gpu.upload(&uni(r, n * wd, -1.0, 1.0))?;
        let mut rows = gpu.alloc(b * n * wd)?;
        for i in 0..b {
            gpu.copy(&one, 0, &mut rows, i * n * wd, n * wd)?;
        }
        #[allow(clippy::drop_non_drop)] // a device buffer in the cuda build
        drop(one);
        let mut p = gpu.alloc_f64(b * shape.heads * mla_partial_width(512))?;
        let counts = vec![n; b];
        gpu.mla_decode_partial_ragged(shape, &q, &rows, &counts, &mut p)?;
        let reps = if b * n >= 88 * 32768 { 3 } else { 10 };
        let us = gpu.time_us(reps, || gpu.mla_decode_partial_ragged(shape, &q, &rows, &counts, &mut p))?;
        let bytes = (b * n * wd * 4) as f64;
        let gbs = bytes / (us * 1e-6) / 1e9;
        println!(
            "| mla_decode_partial_ragged f64 [{kernel}] | B={b} x {n} rows x 576 f32, H=8 | {us:.0} | {gbs:.0} (rows read) | {:.2} (vs copy/2) |",
            gbs / (bw / 2.0)
        );
    }
    Ok(())
}

/// The fused step's tensor-core product: against an f64 reference for each
/// weight dtype and term count, and batch invariant (row 0's bits, and the
/// first rows', the same at M = 1, 7, 17, 88, 130 and 4096, for plain and unit-segment
/// weights).
fn check_step_matmul(gpu: &CudaBackend, rep: &mut Report, seed: u64) -> R<()> {
    use handoff_kernels::step::{StepMat, WeightDtype};
    let mut r = SplitMix64::new(seed ^ 0x7c3);
    let op = "step matmul (tensor cores)";
    for &(m, k, n) in &[(1usize, 64usize, 40usize), (37, 256, 200), (130, 512, 96)] {
        let x = uni(&mut r, m * k, -1.0, 1.0);
        let w = uni(&mut r, k * n, -1.0, 1.0);
        for (dtype, terms, tol) in [(WeightDtype::F32, 3u32, 3e-5), (WeightDtype::Bf16, 2, 3e-5), (WeightDtype::Bf16, 1, 1e-5)] {
            let mat = StepMat::plain(k, n, w.clone());
            let (got, _) = gpu.step_matmul(&x, m, &mat, dtype, terms, 1)?;
            // The f64 product of the numbers the device multiplies by: the
            // rounded weights, and x itself (x rounded to bf16 with one term).
            let wr: Vec<f64> = w.iter().map(|&v| dtype.round(v) as f64).collect();
            let xr: Vec<f64> = x.iter().map(|&v| if terms == 1 { WeightDtype::Bf16.round(v) as f64 } else { v as f64 }).collect();
            let want: Vec<f32> = (0..m * n)
                .map(|e| {
                    let (i, j) = (e / n, e % n);
                    (0..k).map(|kk| xr[i * k + kk] * wr[kk * n + j]).sum::<f64>() as f32
                })
                .collect();
            rep.close(op, &format!("{m}x{k}.{k}x{n} {} weights, {terms} terms", dtype.name()), &got, &want, tol);
        }
    }
    // Batch invariance: one tiling and one reduction order for every M.
    let (k, n) = (1024usize, 320usize);
    let x = uni(&mut r, 4096 * k, -1.0, 1.0);
    let w = uni(&mut r, k * n, -1.0, 1.0);
    for (name, mat) in [("auto segments", StepMat::plain(k, n, w.clone())), ("16 unit segments", StepMat::units(k, n, 16, w.clone()))] {
        // Each kernel variant: bf16 weights (one plane, 1 or 2 terms) and f32 (two planes, 3 terms).
        for (dtype, terms) in [(WeightDtype::Bf16, 2u32), (WeightDtype::Bf16, 1), (WeightDtype::F32, 3)] {
            let (full, _) = gpu.step_matmul(&x, 4096, &mat, dtype, terms, 1)?;
            for m in [1usize, 7, 17, 88, 130] {
                let (part, _) = gpu.step_matmul(&x[..m * k], m, &mat, dtype, terms, 1)?;
                rep.exact_f32(op, &format!("rows of M = {m} vs M = 4096, {name}, {} weights, {terms} terms", dtype.name()), &part, &full[..m * n]);
            }
        }
    }
    Ok(())
}

fn bench(gpu: &mut CudaBackend, seed: u64, mla_only: bool, matmul_only: bool, mla_kernel: &str) -> R<()> {
    println!();
    let copy_bytes = 1usize << 30;
    let bw = gpu.copy_bandwidth_gbs(copy_bytes, 20)?;
    println!("device copy (memcpy_dtod of 1 GiB, read + write counted): {bw:.0} GB/s");
    if matmul_only {
        let mut r = SplitMix64::new(seed ^ 0xbe7c);
        return bench_step_matmul(gpu, &mut r);
    }
    if mla_only {
        let mut r = SplitMix64::new(seed ^ 0x3a1a);
        println!();
        println!("| kernel | shape | us/call | GB/s | of copy bw |");
        println!("|---|---|---|---|---|");
        return bench_mla(gpu, bw, &mut r, mla_kernel);
    }
    println!();
    println!("| kernel | shape | us/step | state GB/s | of copy bw |");
    println!("|---|---|---|---|---|");
    let mut r = SplitMix64::new(seed ^ 0xbe7c);
    for &(b, h) in &[(88usize, 12usize), (32, 96), (88, 96)] {
        let (dk, dv) = (128usize, 128usize);
        let host = KdaHost::new(&mut r, b, h, dk, dv);
        let d = KdaDev::new(&*gpu, &host)?;
        let mut state = gpu.upload(&uni(&mut r, b * h * dk * dv, -0.5, 0.5))?;
        let mut out = gpu.alloc(b * h * dv)?;
        let mut rec = gpu.alloc(b * h * replay_record_width(dk, dv))?;
        let shape = KdaStepShape { batch: b, heads: h, dk, dv };
        let bytes = 2.0 * (b * h * dk * dv * 4) as f64;
        let default = gpu.kda_kernel();
        for k in KdaKernel::ALL {
            gpu.set_kda_kernel(k);
            for with_rec in [false, true] {
                // Warm-up, then the steps back to back between two events.
                for _ in 0..3 {
                    gpu.kda_step(shape, &mut state, d.inputs(), d.params(), &mut out, with_rec.then_some(&mut rec))?;
                }
                let reps = if b * h > 2000 { 30 } else { 100 };
                let g = &*gpu;
                let us = g.time_us(reps, || g.kda_step(shape, &mut state, d.inputs(), d.params(), &mut out, with_rec.then_some(&mut rec)))?;
                let gbs = bytes / (us * 1e-6) / 1e9;
                println!(
                    "| kda_step {k:?}{}{} | B={b} H={h} 128x128 f32 | {us:.1} | {gbs:.0} | {:.2} |",
                    if k == default { " (default)" } else { "" },
                    if with_rec { " +record" } else { "" },
                    gbs / bw
                );
            }
        }
        gpu.set_kda_kernel(default);
    }

    // KDA prefill, 8K tokens x 12 heads: the recurrent kernel, for
    // comparison. A 128x128 prefill of 64 tokens or more now runs chunked, so
    // the recurrent figure is taken from calls of 63 tokens each (inputs
    // uploaded per piece beforehand; one launch per 63 tokens, whose launch
    // cost is small against the 63 dependent steps it runs).
    {
        let (t, h, dk, dv) = (8192usize, 12usize, 128usize, 128usize);
        let piece = handoff_kernels::KDA_CHUNK - 1;
        let host = KdaHost::new(&mut r, t, h, dk, dv);
        type Buf = <CudaBackend as Backend>::Buf;
        let mut pieces: Vec<(usize, KdaDev<CudaBackend>, Buf)> = (0..t)
            .step_by(piece)
            .map(|a| {
                let b = (a + piece).min(t);
                Ok((b - a, KdaDev::new(&*gpu, &host.rows(a, b))?, gpu.alloc((b - a) * h * dv)?))
            })
            .collect::<R<_>>()?;
        let mut state = gpu.alloc(h * dk * dv)?;
        let g = &*gpu;
        let mut run = || -> R<()> {
            for (n, d, o) in pieces.iter_mut() {
                let shape = KdaPrefillShape { tokens: *n, heads: h, dk, dv };
                g.kda_prefill(shape, &mut state, d.inputs(), d.params(), o, None)?;
            }
            Ok(())
        };
        run()?;
        let us = g.time_us(3, &mut run)?;
        println!("| kda_prefill (recurrent, 63-token calls) | T={t} H={h} 128x128 | {us:.0} per call | {:.2} M tok/s | - |", t as f64 / us);
    }
    // KDA prefill, chunked (kda_chunk.hip; the workspace allocation included).
    for &t in &[8192usize, 32768] {
        let (h, dk, dv) = (12usize, 128usize, 128usize);
        let host = KdaHost::new(&mut r, t, h, dk, dv);
        let d = KdaDev::new(&*gpu, &host)?;
        let mut state = gpu.alloc(h * dk * dv)?;
        let mut out = gpu.alloc(t * h * dv)?;
        let shape = KdaPrefillShape { tokens: t, heads: h, dk, dv };
        gpu.kda_prefill(shape, &mut state, d.inputs(), d.params(), &mut out, None)?;
        let g = &*gpu;
        let us = g.time_us(3, || g.kda_prefill(shape, &mut state, d.inputs(), d.params(), &mut out, None))?;
        println!("| kda_prefill (chunked) | T={t} H={h} 128x128 | {us:.0} per call | {:.2} M tok/s | - |", t as f64 / us);
    }

    bench_mla(gpu, bw, &mut r, mla_kernel)?;

    // Dense: a decode-sized and a prefill-sized matmul.
    for &(rows, inner, cols) in &[(1usize, 2048usize, 2048usize), (88, 2048, 2048), (1, 7168, 7168), (88, 7168, 7168), (4096, 4096, 4096)] {
        let x = gpu.upload(&uni(&mut r, rows * inner, -1.0, 1.0))?;
        let w = gpu.upload(&uni(&mut r, inner * cols, -1.0, 1.0))?;
        let mut o = gpu.alloc(rows * cols)?;
        let shape = MatmulShape { rows, inner, cols };
        gpu.matmul(shape, &x, &w, &mut o)?;
        let g = &*gpu;
        let reps = if rows > 1000 { 5 } else { 20 };
        let us = g.time_us(reps, || g.matmul(shape, &x, &w, &mut o))?;
        let tflops = 2.0 * (rows * inner * cols) as f64 / (us * 1e-6) / 1e12;
        let wgbs = (inner * cols * 4) as f64 / (us * 1e-6) / 1e9;
        println!("| matmul | {rows}x{inner} . {inner}x{cols} | {us:.0} | w read {wgbs:.0} | {tflops:.1} TFLOP/s |");
    }
    bench_step_matmul(gpu, &mut r)
}

/// The fused step's tensor-core product (hip/step.hip st_mm_few / st_mm):
/// bf16 x bf16 (1 term, torch.matmul's bf16 semantics), the model's bf16
/// weights (2 terms: f32 activations) and f32 weights (3 terms).
fn bench_step_matmul(gpu: &CudaBackend, r: &mut SplitMix64) -> R<()> {
    {
        use handoff_kernels::step::{StepMat, WeightDtype};
        for &(rows, inner, cols) in &[(1usize, 7168usize, 7168usize), (88, 7168, 7168), (4096, 4096, 4096), (1, 2048, 2048), (88, 2048, 2048)] {
            let x = uni(r, rows * inner, -1.0, 1.0);
            let mat = StepMat::plain(inner, cols, uni(r, inner * cols, -1.0, 1.0));
            for (dtype, terms) in [(WeightDtype::Bf16, 1u32), (WeightDtype::Bf16, 2), (WeightDtype::F32, 3)] {
                let reps = if rows > 1000 { 5 } else { 30 };
                let (_, us) = gpu.step_matmul(&x, rows, &mat, dtype, terms, reps)?;
                let tflops = 2.0 * (rows * inner * cols) as f64 / (us * 1e-6) / 1e12;
                let wgbs = (inner * cols * 2 * dtype.planes()) as f64 / (us * 1e-6) / 1e9;
                println!(
                    "| step_matmul {} weights, {terms} term{} | {rows}x{inner} . {inner}x{cols} ({} segments) | {us:.1} | w read {wgbs:.0} | {tflops:.1} TFLOP/s |",
                    dtype.name(),
                    if terms > 1 { "s" } else { "" },
                    mat.segments
                );
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mla_only = args.iter().any(|a| a == "--bench-mla");
    let matmul_only = args.iter().any(|a| a == "--bench-matmul");
    let bench_mode = mla_only || matmul_only || args.iter().any(|a| a == "--bench");
    let seed = args.iter().position(|a| a == "--seed").and_then(|i| args.get(i + 1)).and_then(|s| s.parse().ok()).unwrap_or(0x00C0_FFEE_u64);
    let t0 = std::time::Instant::now();
    let mut gpu = match CudaBackend::new(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let (maj, min) = gpu.compute_capability();
    println!("device 0: {} (sm_{maj}{min}), kernels compiled by NVRTC in {:.0} ms; seed {seed:#x}", gpu.device_name(), t0.elapsed().as_secs_f64() * 1e3);
    let mla_kernel = args.iter().position(|a| a == "--mla").and_then(|i| args.get(i + 1)).cloned().unwrap_or_else(|| "default".to_string());
    if mla_kernel != "default"
        && let Err(e) = gpu.set_mla_kernel(&mla_kernel)
    {
        eprintln!("error: --mla {e}");
        return ExitCode::from(2);
    }
    if bench_mode {
        return match bench(&mut gpu, seed, mla_only, matmul_only, &mla_kernel) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(1)
            }
        };
    }
    println!("| {:<28} | {:<44} | {:>11} | {:>6} | ok |", "op", "case", "max rel err", "tol");
    println!("|{}|{}|{}|{}|----|", "-".repeat(30), "-".repeat(46), "-".repeat(13), "-".repeat(8));
    let mut rep = Report::new();
    let res = checks(&gpu, &mut rep, seed)
        .and_then(|()| check_regions(&gpu, &mut rep, seed))
        .and_then(|()| check_kda_variants(&mut gpu, &mut rep, seed))
        .and_then(|()| check_fused(&mut gpu, &mut rep, seed))
        .and_then(|()| check_step_matmul(&gpu, &mut rep, seed));
    if let Err(e) = res {
        eprintln!("error: a check could not run: {e}");
        return ExitCode::from(1);
    }
    let fails = rep.failures();
    println!("{} checks, {} failed ({:.1} s)", rep.rows.len(), fails, t0.elapsed().as_secs_f64());
    if fails > 0 { ExitCode::from(1) } else { ExitCode::SUCCESS }
}
