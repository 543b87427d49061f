//! The CPU reference backend: f32 storage, f32 accumulation, rayon across
//! heads, rows and tokens. It is the oracle the GPU paths are checked against.

mod conv;
mod dense;
pub(crate) mod kda;
mod math;
pub(crate) mod mla;
mod norm;

#[cfg(test)]
mod tests;

use crate::backend::Backend;
use crate::dtype::StorageDtype;
use crate::error::{Result, check_len, elems, range};
use crate::shapes::{
    ColsCopy, ConvShape, EmbeddingShape, KdaInputs, KdaParams, KdaPrefillShape, KdaRaggedShape, KdaStepShape, MatmulShape, MergeShape, MlaShape, MlpShape,
    MlpWeights, NormShape, ReplayShape, RowSet,
};

pub use kda::KDA_CHUNK;

/// Work (element operations) a parallel task should at least get. Splitting a
/// loop hands tasks to the pool's threads, which costs microseconds (tens of them
/// when the threads sleep or the machine is loaded); a decode step is hundreds of
/// small ops, so a loop over a few rows runs on one thread. Only the schedule
/// changes: every item (row, head, slot) is still computed whole by one task in
/// the same order, so results do not depend on it.
const GRAIN: usize = 1 << 15;

/// Minimum items per parallel task for items of `work` element operations each.
pub(crate) fn grain(work: usize) -> usize {
    (GRAIN / work.max(1)).max(1)
}

/// An f32 buffer of the CPU backend: host memory, which transports may read
/// and write through [`CpuBuf::as_slice`] and [`CpuBuf::as_mut_slice`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CpuBuf(Vec<f32>);

impl CpuBuf {
    /// Wraps a host vector without copying.
    pub fn from_vec(data: Vec<f32>) -> Self {
        Self(data)
    }
    /// The elements.
    pub fn as_slice(&self) -> &[f32] {
        &self.0
    }
    /// The elements, mutable (for transports writing into a region).
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.0
    }
    /// Unwraps the host vector.
    pub fn into_vec(self) -> Vec<f32> {
        self.0
    }
}

/// An i32 buffer of the CPU backend (token ids, replay cursors).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CpuIBuf(Vec<i32>);

impl CpuIBuf {
    /// The elements.
    pub fn as_slice(&self) -> &[i32] {
        &self.0
    }
    /// The elements, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [i32] {
        &mut self.0
    }
}

/// An f64 buffer of the CPU backend (attention partials).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CpuF64Buf(Vec<f64>);

impl CpuF64Buf {
    /// Wraps a host vector without copying.
    pub fn from_vec(data: Vec<f64>) -> Self {
        Self(data)
    }
    /// The elements.
    pub fn as_slice(&self) -> &[f64] {
        &self.0
    }
    /// The elements, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [f64] {
        &mut self.0
    }
    /// Unwraps the host vector.
    pub fn into_vec(self) -> Vec<f64> {
        self.0
    }
}

/// The CPU backend. Runs on the global rayon pool; construct with
/// `CpuBackend::new()` (infallible: a CPU is always there).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

impl CpuBackend {
    /// The CPU backend.
    pub fn new() -> Self {
        Self
    }
}

fn kda_inputs<'a>(x: &KdaInputs<'a, CpuBuf>) -> kda::Inputs<'a> {
    kda::Inputs { q: &x.q.0, k: &x.k.0, v: &x.v.0, g_raw: &x.g_raw.0, b_raw: &x.b_raw.0 }
}

fn kda_params<'a>(p: &KdaParams<'a, CpuBuf>) -> kda::Params<'a> {
    kda::Params { a_log: &p.a_log.0, dt_bias: &p.dt_bias.0 }
}

impl Backend for CpuBackend {
    type Buf = CpuBuf;
    type IBuf = CpuIBuf;
    type F64Buf = CpuF64Buf;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn alloc(&self, len: usize) -> Result<CpuBuf> {
        Ok(CpuBuf(vec![0.0; len]))
    }

    fn upload(&self, data: &[f32]) -> Result<CpuBuf> {
        Ok(CpuBuf(data.to_vec()))
    }

    fn upload_into(&self, dst: &mut CpuBuf, offset: usize, data: &[f32]) -> Result<()> {
        let r = range("upload_into", "dst", offset, data.len(), dst.0.len())?;
        dst.0[r].copy_from_slice(data);
        Ok(())
    }

    fn download(&self, buf: &CpuBuf) -> Result<Vec<f32>> {
        Ok(buf.0.clone())
    }

    fn buf_len(&self, buf: &CpuBuf) -> usize {
        buf.0.len()
    }

    fn alloc_i32(&self, len: usize) -> Result<CpuIBuf> {
        Ok(CpuIBuf(vec![0; len]))
    }

    fn upload_i32(&self, data: &[i32]) -> Result<CpuIBuf> {
        Ok(CpuIBuf(data.to_vec()))
    }

    fn download_i32(&self, buf: &CpuIBuf) -> Result<Vec<i32>> {
        Ok(buf.0.clone())
    }

    fn alloc_f64(&self, len: usize) -> Result<CpuF64Buf> {
        Ok(CpuF64Buf(vec![0.0; len]))
    }

    fn upload_f64(&self, data: &[f64]) -> Result<CpuF64Buf> {
        Ok(CpuF64Buf(data.to_vec()))
    }

    fn download_f64(&self, buf: &CpuF64Buf) -> Result<Vec<f64>> {
        Ok(buf.0.clone())
    }

    fn fill(&self, buf: &mut CpuBuf, value: f32) -> Result<()> {
        buf.0.fill(value);
        Ok(())
    }

    fn copy(&self, src: &CpuBuf, src_off: usize, dst: &mut CpuBuf, dst_off: usize, len: usize) -> Result<()> {
        let rs = range("copy", "src", src_off, len, src.0.len())?;
        let rd = range("copy", "dst", dst_off, len, dst.0.len())?;
        dst.0[rd].copy_from_slice(&src.0[rs]);
        Ok(())
    }

    fn copy_cols(&self, shape: ColsCopy, src: &CpuBuf, dst: &mut CpuBuf) -> Result<()> {
        let op = "copy_cols";
        let ColsCopy { rows, src_cols, src_col, dst_cols, dst_col, width } = shape;
        check_len(op, "src", src.0.len(), elems(op, &[rows, src_cols])?)?;
        check_len(op, "dst", dst.0.len(), elems(op, &[rows, dst_cols])?)?;
        range(op, "src row", src_col, width, src_cols)?;
        range(op, "dst row", dst_col, width, dst_cols)?;
        for r in 0..rows {
            let s = r * src_cols + src_col;
            let d = r * dst_cols + dst_col;
            dst.0[d..d + width].copy_from_slice(&src.0[s..s + width]);
        }
        Ok(())
    }

    fn copy_f64(&self, src: &CpuF64Buf, src_off: usize, dst: &mut CpuF64Buf, dst_off: usize, len: usize) -> Result<()> {
        let rs = range("copy_f64", "src", src_off, len, src.0.len())?;
        let rd = range("copy_f64", "dst", dst_off, len, dst.0.len())?;
        dst.0[rd].copy_from_slice(&src.0[rs]);
        Ok(())
    }

    fn round_to(&self, buf: &mut CpuBuf, dtype: StorageDtype) -> Result<()> {
        if dtype != StorageDtype::F32 {
            for x in buf.0.iter_mut() {
                *x = dtype.round(*x);
            }
        }
        Ok(())
    }

    fn kda_step(
        &self,
        shape: KdaStepShape,
        state: &mut CpuBuf,
        x: KdaInputs<'_, CpuBuf>,
        params: KdaParams<'_, CpuBuf>,
        out: &mut CpuBuf,
        record: Option<&mut CpuBuf>,
    ) -> Result<()> {
        kda::step(shape, &mut state.0, kda_inputs(&x), kda_params(&params), &mut out.0, record.map(|r| &mut r.0[..]))
    }

    fn kda_prefill(
        &self,
        shape: KdaPrefillShape,
        state: &mut CpuBuf,
        x: KdaInputs<'_, CpuBuf>,
        params: KdaParams<'_, CpuBuf>,
        out: &mut CpuBuf,
        record: Option<&mut CpuBuf>,
    ) -> Result<()> {
        kda::prefill(shape, &mut state.0, kda_inputs(&x), kda_params(&params), &mut out.0, record.map(|r| &mut r.0[..]))
    }

    fn kda_prefill_ragged(
        &self,
        shape: KdaRaggedShape,
        seqs: &[std::ops::Range<usize>],
        states: &mut CpuBuf,
        x: KdaInputs<'_, CpuBuf>,
        params: KdaParams<'_, CpuBuf>,
        out: &mut CpuBuf,
        record: Option<&mut CpuBuf>,
    ) -> Result<()> {
        kda::prefill_ragged(shape, seqs, &mut states.0, kda_inputs(&x), kda_params(&params), &mut out.0, record.map(|r| &mut r.0[..]))
    }

    fn replay_append(&self, shape: ReplayShape, tokens: usize, ring: &mut CpuBuf, cursor: &mut CpuIBuf, records: &CpuBuf) -> Result<()> {
        kda::replay_append(shape, tokens, &mut ring.0, &mut cursor.0, &records.0)
    }

    fn replay_commit(&self, shape: ReplayShape, state: &mut CpuBuf, ring: &CpuBuf, cursor: &mut CpuIBuf) -> Result<()> {
        kda::replay_commit(shape, &mut state.0, &ring.0, &mut cursor.0)
    }

    fn conv_prefill(&self, shape: ConvShape, tokens: usize, x: &CpuBuf, weight: &CpuBuf, state: &mut CpuBuf, out: &mut CpuBuf) -> Result<()> {
        conv::prefill(shape, tokens, &x.0, &weight.0, &mut state.0, &mut out.0)
    }

    fn conv_step(&self, shape: ConvShape, batch: usize, x: &CpuBuf, weight: &CpuBuf, state: &mut CpuBuf, out: &mut CpuBuf) -> Result<()> {
        conv::step(shape, batch, &x.0, &weight.0, &mut state.0, &mut out.0)
    }

    fn rms_norm(&self, shape: NormShape, x: &CpuBuf, weight: &CpuBuf, out: &mut CpuBuf) -> Result<()> {
        norm::rms_norm(shape, &x.0, &weight.0, &mut out.0)
    }

    fn gated_rms_norm(&self, shape: NormShape, o: &CpuBuf, gate: &CpuBuf, weight: &CpuBuf, out: &mut CpuBuf) -> Result<()> {
        norm::gated_rms_norm(shape, &o.0, &gate.0, &weight.0, &mut out.0)
    }

    fn mla_prefill(&self, shape: MlaShape, tokens: usize, q_lat: &CpuBuf, rows: RowSet<'_, CpuBuf>, out: &mut CpuBuf, lse: Option<&mut CpuBuf>) -> Result<()> {
        mla::prefill(shape, tokens, &q_lat.0, &rows.buf.0, rows.count, &mut out.0, lse.map(|l| &mut l.0[..]))
    }

    fn mla_decode(&self, shape: MlaShape, q_lat: &CpuBuf, rows: RowSet<'_, CpuBuf>, out: &mut CpuBuf, lse: &mut CpuBuf) -> Result<()> {
        mla::decode(shape, &q_lat.0, &rows.buf.0, rows.count, &mut out.0, &mut lse.0)
    }

    fn dcp_merge(&self, shape: MergeShape, o_shards: &CpuBuf, lse_shards: &CpuBuf, out: &mut CpuBuf, lse: &mut CpuBuf) -> Result<()> {
        mla::dcp_merge(shape, &o_shards.0, &lse_shards.0, &mut out.0, &mut lse.0)
    }

    fn mla_decode_partial(&self, shape: MlaShape, q_lat: &CpuBuf, rows: RowSet<'_, CpuBuf>, partial: &mut CpuF64Buf) -> Result<()> {
        mla::decode_partial(shape, &q_lat.0, &rows.buf.0, rows.count, &mut partial.0)
    }

    fn mla_decode_partial_ragged(&self, shape: MlaShape, q_lat: &CpuBuf, rows: &CpuBuf, counts: &[usize], partial: &mut CpuF64Buf) -> Result<()> {
        mla::decode_partial_ragged(shape, &q_lat.0, &rows.0, counts, &mut partial.0)
    }

    fn dcp_merge_partials(&self, shape: MergeShape, partials: &CpuF64Buf, out: &mut CpuBuf, lse: &mut CpuBuf) -> Result<()> {
        mla::dcp_merge_partials(shape, &partials.0, &mut out.0, &mut lse.0)
    }

    fn matmul(&self, shape: MatmulShape, x: &CpuBuf, w: &CpuBuf, out: &mut CpuBuf) -> Result<()> {
        dense::matmul(shape, &x.0, &w.0, &mut out.0)
    }

    fn swiglu(&self, shape: MlpShape, x: &CpuBuf, w: MlpWeights<'_, CpuBuf>, out: &mut CpuBuf) -> Result<()> {
        dense::swiglu(shape, &x.0, &w.gate.0, &w.up.0, &w.down.0, &mut out.0)
    }

    fn silu_mul(&self, gate: &CpuBuf, up: &CpuBuf, out: &mut CpuBuf) -> Result<()> {
        dense::silu_mul(&gate.0, &up.0, &mut out.0)
    }

    fn embedding(&self, shape: EmbeddingShape, table: &CpuBuf, ids: &CpuIBuf, out: &mut CpuBuf) -> Result<()> {
        dense::embedding(shape, &table.0, &ids.0, &mut out.0)
    }

    fn argmax(&self, rows: usize, cols: usize, logits: &CpuBuf, ids: &mut CpuIBuf) -> Result<()> {
        dense::argmax(rows, cols, &logits.0, &mut ids.0)
    }

    fn add_inplace(&self, dst: &mut CpuBuf, src: &CpuBuf) -> Result<()> {
        dense::add_inplace(&mut dst.0, &src.0)
    }

    fn add_units(&self, acc: &mut CpuBuf, stacked: &CpuBuf, units: std::ops::Range<usize>) -> Result<()> {
        let n = acc.0.len();
        crate::error::check_units("add_units", n, stacked.0.len(), &units)?;
        for u in units {
            dense::add_inplace(&mut acc.0, &stacked.0[u * n..(u + 1) * n])?;
        }
        Ok(())
    }
}
