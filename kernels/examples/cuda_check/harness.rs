//! Random inputs and the op runners, generic over the backend.

use super::*;

// ------------------------------------------------------------------ inputs

pub(crate) fn uni(r: &mut SplitMix64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    r.vec_uniform(n, lo, hi)
}

/// Host KDA inputs for `n` rows (batch or tokens) of `h` heads.
pub(crate) struct KdaHost {
    pub(crate) h: usize,
    pub(crate) dk: usize,
    pub(crate) dv: usize,
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    pub(crate) g_raw: Vec<f32>,
    pub(crate) b_raw: Vec<f32>,
    pub(crate) a_log: Vec<f32>,
    pub(crate) dt_bias: Vec<f32>,
}

impl KdaHost {
    pub(crate) fn new(r: &mut SplitMix64, n: usize, h: usize, dk: usize, dv: usize) -> Self {
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
    pub(crate) fn rows(&self, a: usize, b: usize) -> Self {
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
pub(crate) struct KdaDev<B: Backend> {
    pub(crate) x: [B::Buf; 5],
    pub(crate) p: [B::Buf; 2],
}

impl<B: Backend> KdaDev<B> {
    pub(crate) fn new(be: &B, c: &KdaHost) -> R<Self> {
        Ok(Self {
            x: [be.upload(&c.q)?, be.upload(&c.k)?, be.upload(&c.v)?, be.upload(&c.g_raw)?, be.upload(&c.b_raw)?],
            p: [be.upload(&c.a_log)?, be.upload(&c.dt_bias)?],
        })
    }
    pub(crate) fn inputs(&self) -> KdaInputs<'_, B::Buf> {
        KdaInputs { q: &self.x[0], k: &self.x[1], v: &self.x[2], g_raw: &self.x[3], b_raw: &self.x[4] }
    }
    pub(crate) fn params(&self) -> KdaParams<'_, B::Buf> {
        KdaParams { a_log: &self.p[0], dt_bias: &self.p[1] }
    }
}

// ------------------------------------------------------------------ op runners (generic)

/// `steps` KDA steps of one batch; returns (last out, final state, last record).
pub(crate) fn run_kda_steps<B: Backend>(be: &B, b: usize, c: &[KdaHost], s0: &[f32]) -> R<(Vec<f32>, Vec<f32>, Vec<f32>)> {
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

pub(crate) fn run_kda_prefill<B: Backend>(be: &B, t: usize, c: &KdaHost, s0: &[f32]) -> R<(Vec<f32>, Vec<f32>, Vec<f32>)> {
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
pub(crate) fn run_kda_prefill_norec<B: Backend>(be: &B, t: usize, c: &KdaHost, s0: &[f32]) -> R<(Vec<f32>, Vec<f32>)> {
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
pub(crate) fn device_prefill_chunked(t: usize, dk: usize, dv: usize) -> bool {
    t >= handoff_kernels::KDA_CHUNK && dk <= 128 && 2 * dv >= 3 * handoff_kernels::KDA_CHUNK
}

/// (ring after the appends, cursors after the appends, committed state, cursors after the commit).
pub(crate) type ReplayOut = (Vec<f32>, Vec<i32>, Vec<f32>, Vec<i32>);

/// Two appends of `tokens` records per slot then a commit.
pub(crate) fn run_replay<B: Backend>(be: &B, shape: ReplayShape, tokens: usize, recs: &[Vec<f32>; 2], cursor0: &[i32], s0: &[f32]) -> R<ReplayOut> {
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

pub(crate) fn run_conv_prefill<B: Backend>(be: &B, shape: ConvShape, t: usize, x: &[f32], w: &[f32], st: &[f32]) -> R<(Vec<f32>, Vec<f32>)> {
    let (xb, wb) = (be.upload(x)?, be.upload(w)?);
    let mut sb = be.upload(st)?;
    let mut out = be.alloc(t * shape.channels)?;
    be.conv_prefill(shape, t, &xb, &wb, &mut sb, &mut out)?;
    Ok((be.download(&out)?, be.download(&sb)?))
}

pub(crate) fn run_conv_step<B: Backend>(be: &B, shape: ConvShape, b: usize, x: &[f32], w: &[f32], st: &[f32]) -> R<(Vec<f32>, Vec<f32>)> {
    let (xb, wb) = (be.upload(x)?, be.upload(w)?);
    let mut sb = be.upload(st)?;
    let mut out = be.alloc(b * shape.channels)?;
    be.conv_step(shape, b, &xb, &wb, &mut sb, &mut out)?;
    Ok((be.download(&out)?, be.download(&sb)?))
}

pub(crate) fn run_norms<B: Backend>(be: &B, shape: NormShape, x: &[f32], g: &[f32], w: &[f32]) -> R<(Vec<f32>, Vec<f32>)> {
    let (xb, gb, wb) = (be.upload(x)?, be.upload(g)?, be.upload(w)?);
    let mut o1 = be.alloc(x.len())?;
    let mut o2 = be.alloc(x.len())?;
    be.rms_norm(shape, &xb, &wb, &mut o1)?;
    be.gated_rms_norm(shape, &xb, &gb, &wb, &mut o2)?;
    Ok((be.download(&o1)?, be.download(&o2)?))
}

pub(crate) fn run_mla_prefill<B: Backend>(be: &B, shape: MlaShape, t: usize, q: &[f32], rows: &[f32], n: usize) -> R<(Vec<f32>, Vec<f32>)> {
    let (qb, rb) = (be.upload(q)?, be.upload(rows)?);
    let mut out = be.alloc(t * shape.heads * shape.kv_lora_rank)?;
    let mut lse = be.alloc(t * shape.heads)?;
    be.mla_prefill(shape, t, &qb, RowSet { buf: &rb, count: n }, &mut out, Some(&mut lse))?;
    Ok((be.download(&out)?, be.download(&lse)?))
}

pub(crate) fn run_mla_decode<B: Backend>(be: &B, shape: MlaShape, q: &[f32], rows: &[f32], n: usize) -> R<(Vec<f32>, Vec<f32>, Vec<f64>)> {
    let (qb, rb) = (be.upload(q)?, be.upload(rows)?);
    let mut out = be.alloc(shape.heads * shape.kv_lora_rank)?;
    let mut lse = be.alloc(shape.heads)?;
    be.mla_decode(shape, &qb, RowSet { buf: &rb, count: n }, &mut out, &mut lse)?;
    let mut p = be.alloc_f64(shape.heads * mla_partial_width(shape.kv_lora_rank))?;
    be.mla_decode_partial(shape, &qb, RowSet { buf: &rb, count: n }, &mut p)?;
    Ok((be.download(&out)?, be.download(&lse)?, be.download_f64(&p)?))
}

pub(crate) fn run_ragged<B: Backend>(be: &B, shape: MlaShape, q: &[f32], rows: &[f32], counts: &[usize]) -> R<Vec<f64>> {
    let (qb, rb) = (be.upload(q)?, be.upload(rows)?);
    let mut p = be.alloc_f64(counts.len() * shape.heads * mla_partial_width(shape.kv_lora_rank))?;
    be.mla_decode_partial_ragged(shape, &qb, &rb, counts, &mut p)?;
    be.download_f64(&p)
}

pub(crate) fn run_dcp_merge<B: Backend>(be: &B, shape: MergeShape, o: &[f32], lse: &[f32]) -> R<(Vec<f32>, Vec<f32>)> {
    let (ob, lb) = (be.upload(o)?, be.upload(lse)?);
    let mut out = be.alloc(shape.heads * shape.width)?;
    let mut l = be.alloc(shape.heads)?;
    be.dcp_merge(shape, &ob, &lb, &mut out, &mut l)?;
    Ok((be.download(&out)?, be.download(&l)?))
}

pub(crate) fn run_merge_partials<B: Backend>(be: &B, shape: MergeShape, p: &[f64]) -> R<(Vec<f32>, Vec<f32>)> {
    let pb = be.upload_f64(p)?;
    let mut out = be.alloc(shape.heads * shape.width)?;
    let mut l = be.alloc(shape.heads)?;
    be.dcp_merge_partials(shape, &pb, &mut out, &mut l)?;
    Ok((be.download(&out)?, be.download(&l)?))
}

pub(crate) fn run_matmul<B: Backend>(be: &B, shape: MatmulShape, x: &[f32], w: &[f32]) -> R<Vec<f32>> {
    let (xb, wb) = (be.upload(x)?, be.upload(w)?);
    let mut out = be.alloc(shape.rows * shape.cols)?;
    be.matmul(shape, &xb, &wb, &mut out)?;
    be.download(&out)
}

/// `matmul_units` over products `dims[i]` = (inner, cols) with weights `ws`,
/// blocks of x and out laid side by side; `each` runs the one-by-one default.
pub(crate) fn run_units<B: Backend>(be: &B, shape: UnitsShape, x: &[f32], dims: &[(usize, usize)], ws: &[Vec<f32>], each: bool) -> R<Vec<f32>> {
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

pub(crate) fn run_swiglu<B: Backend>(be: &B, shape: MlpShape, x: &[f32], g: &[f32], u: &[f32], d: &[f32]) -> R<Vec<f32>> {
    let (xb, gb, ub, db) = (be.upload(x)?, be.upload(g)?, be.upload(u)?, be.upload(d)?);
    let mut out = be.alloc(shape.tokens * shape.hidden)?;
    be.swiglu(shape, &xb, MlpWeights { gate: &gb, up: &ub, down: &db }, &mut out)?;
    be.download(&out)
}

pub(crate) fn run_elementwise<B: Backend>(be: &B, a: &[f32], b: &[f32]) -> R<(Vec<f32>, Vec<f32>)> {
    let (ab, bb) = (be.upload(a)?, be.upload(b)?);
    let mut o = be.alloc(a.len())?;
    be.silu_mul(&ab, &bb, &mut o)?;
    let mut d = be.upload(a)?;
    be.add_inplace(&mut d, &bb)?;
    Ok((be.download(&o)?, be.download(&d)?))
}

pub(crate) fn run_embedding<B: Backend>(be: &B, shape: EmbeddingShape, table: &[f32], ids: &[i32]) -> R<Vec<f32>> {
    let tb = be.upload(table)?;
    let ib = be.upload_i32(ids)?;
    let mut out = be.alloc(shape.tokens * shape.dim)?;
    be.embedding(shape, &tb, &ib, &mut out)?;
    be.download(&out)
}

pub(crate) fn run_argmax<B: Backend>(be: &B, rows: usize, cols: usize, logits: &[f32]) -> R<Vec<i32>> {
    let lb = be.upload(logits)?;
    let mut ids = be.alloc_i32(rows)?;
    be.argmax(rows, cols, &lb, &mut ids)?;
    be.download_i32(&ids)
}

/// fill, copy, copy_cols, copy_f64, upload_into and round_to on one set of data.
pub(crate) fn run_buffers<B: Backend>(be: &B, a: &[f32], cols: ColsCopy, p: &[f64]) -> R<Vec<Vec<f32>>> {
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
