//! The one backend trait every compute path goes through.
//!
//! Buffers are owned by the backend (`Backend::Buf` for f32 data,
//! `Backend::IBuf` for i32 data: token ids, replay cursors). Host memory
//! appears only in `upload*` and `download*`; every op takes backend buffers
//! plus a plain-data shape, checks lengths, and returns a typed error instead
//! of panicking. Storage and accumulation are f32, except the attention
//! partials (`Backend::F64Buf`): MLA decode partials and their DCP merge are f64,
//! so that the merged result does not depend on how the tokens were sharded.

use crate::dtype::StorageDtype;
use crate::error::Result;
use crate::region::{DeviceMemory, DeviceRegion, RegionItems, unsupported};
use crate::shapes::{
    ColsCopy, ConvShape, EmbeddingShape, KdaInputs, KdaParams, KdaPrefillShape, KdaRaggedShape, KdaStepShape, MatmulShape, MergeShape, MlaShape, MlpShape,
    MlpWeights, NormShape, ReplayShape, RowSet, UnitProduct, UnitsOut, UnitsShape,
};
use std::ops::Range;
use std::sync::Arc;

/// A compute backend: buffer management plus the model's ops.
pub trait Backend: Send + Sync {
    /// An f32 buffer owned by the backend.
    type Buf: Send + Sync;
    /// An i32 buffer owned by the backend (token ids, replay cursors).
    type IBuf: Send + Sync;
    /// An f64 buffer owned by the backend (attention partials).
    type F64Buf: Send + Sync;

    /// Short name for logs ("cpu", "cuda", "hip").
    fn name(&self) -> &'static str;

    /// Waits until every op queued so far has finished. Device ops are
    /// asynchronous (a download waits for them; nothing else does), so a
    /// caller that times ops calls this before reading the clock. The CPU's
    /// ops finish before they return.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// Records a layer mark on the backend's queue, after every op queued so
    /// far: a prefill stage marks each layer once its caches are queued into
    /// the source regions, and the device transport's copies of that layer
    /// wait on the mark on the device ([`crate::DeviceMemory::copy_after`]),
    /// so the host never waits for a layer. `None` where there is nothing to
    /// mark with (the CPU, whose ops have finished when they return; a device
    /// backend without marks): the caller then waits with
    /// [`Backend::synchronize`] if it must.
    fn mark_layer(&self) -> Result<Option<crate::region::StreamMark>> {
        Ok(None)
    }

    // ---- buffers ---------------------------------------------------------

    /// A zeroed f32 buffer of `len` elements.
    fn alloc(&self, len: usize) -> Result<Self::Buf>;
    /// A buffer holding a copy of `data`.
    fn upload(&self, data: &[f32]) -> Result<Self::Buf>;
    /// Overwrites `dst[offset..offset + data.len()]` with `data`.
    fn upload_into(&self, dst: &mut Self::Buf, offset: usize, data: &[f32]) -> Result<()>;
    /// The buffer's contents.
    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    /// Elements in the buffer.
    fn buf_len(&self, buf: &Self::Buf) -> usize;
    /// A zeroed i32 buffer of `len` elements.
    fn alloc_i32(&self, len: usize) -> Result<Self::IBuf>;
    /// An i32 buffer holding a copy of `data`.
    fn upload_i32(&self, data: &[i32]) -> Result<Self::IBuf>;
    /// The i32 buffer's contents.
    fn download_i32(&self, buf: &Self::IBuf) -> Result<Vec<i32>>;

    /// A zeroed f64 buffer of `len` elements.
    fn alloc_f64(&self, len: usize) -> Result<Self::F64Buf>;
    /// An f64 buffer holding a copy of `data`.
    fn upload_f64(&self, data: &[f64]) -> Result<Self::F64Buf>;
    /// The f64 buffer's contents.
    fn download_f64(&self, buf: &Self::F64Buf) -> Result<Vec<f64>>;

    /// Sets every element of `buf` to `value`.
    fn fill(&self, buf: &mut Self::Buf, value: f32) -> Result<()>;
    /// `dst[dst_off..dst_off + len] = src[src_off..src_off + len]`.
    fn copy(&self, src: &Self::Buf, src_off: usize, dst: &mut Self::Buf, dst_off: usize, len: usize) -> Result<()>;
    /// Strided copy of a column block (see [`ColsCopy`]).
    fn copy_cols(&self, shape: ColsCopy, src: &Self::Buf, dst: &mut Self::Buf) -> Result<()>;
    /// `dst[dst_off..dst_off + len] = src[src_off..src_off + len]` on f64 buffers
    /// (stacking the DCP members' attention partials shard-major for one merge).
    fn copy_f64(&self, src: &Self::F64Buf, src_off: usize, dst: &mut Self::F64Buf, dst_off: usize, len: usize) -> Result<()>;
    /// Rounds every element to what `dtype` stores (round to nearest even), in
    /// place: what a cache of that dtype would hand back. Identity for f32.
    fn round_to(&self, buf: &mut Self::Buf, dtype: StorageDtype) -> Result<()>;

    // ---- KDA -------------------------------------------------------------

    /// One recurrent KDA step for a batch (docs/design.md section 5, steps 1-7).
    ///
    /// `state` `[B, H, Dk, Dv]` is updated in place; inputs are `[B, H, *]` (see
    /// [`KdaInputs`]); `out` `[B, H, Dv]`. When `record` is given, it receives
    /// the ReplaySSM record `[B, H, 2*Dk+Dv]` = (k^, u, g) of this token.
    fn kda_step(
        &self,
        shape: KdaStepShape,
        state: &mut Self::Buf,
        x: KdaInputs<'_, Self::Buf>,
        params: KdaParams<'_, Self::Buf>,
        out: &mut Self::Buf,
        record: Option<&mut Self::Buf>,
    ) -> Result<()>;

    /// KDA prefill of one sequence, equal to `tokens` recurrent steps: chunked
    /// (chunk [`crate::KDA_CHUNK`]), or, on the CPU where it costs less (small
    /// heads), the recurrent steps themselves. `state` `[H, Dk, Dv]` holds the initial state
    /// and receives the final one; inputs are `[T, H, *]`; `out` `[T, H, Dv]`;
    /// `record`, when given, `[T, H, 2*Dk+Dv]`.
    fn kda_prefill(
        &self,
        shape: KdaPrefillShape,
        state: &mut Self::Buf,
        x: KdaInputs<'_, Self::Buf>,
        params: KdaParams<'_, Self::Buf>,
        out: &mut Self::Buf,
        record: Option<&mut Self::Buf>,
    ) -> Result<()>;

    /// KDA prefill of several independent sequences in one call: sequence `i`
    /// is the rows `seqs[i]` of the inputs, `out` and `record` (each `[rows, H,
    /// *]` as in [`Backend::kda_prefill`]), and starts from and leaves its
    /// state in `states[i]` (`[seqs.len(), H, Dk, Dv]`). Each sequence gets the
    /// bits [`Backend::kda_prefill`] gives it alone; rows outside every
    /// sequence, and the states of empty ones, are left as they are. This
    /// default runs `kda_prefill` once per sequence through copies; a device
    /// backend runs all of them in one launch per phase.
    #[allow(clippy::too_many_arguments)]
    fn kda_prefill_ragged(
        &self,
        shape: KdaRaggedShape,
        seqs: &[Range<usize>],
        states: &mut Self::Buf,
        x: KdaInputs<'_, Self::Buf>,
        params: KdaParams<'_, Self::Buf>,
        out: &mut Self::Buf,
        record: Option<&mut Self::Buf>,
    ) -> Result<()> {
        kda_prefill_ragged_by_copies(self, shape, seqs, states, x, params, out, record)
    }

    /// Appends `tokens` records per slot, `records` `[B, tokens, H, 2*Dk+Dv]`,
    /// to the rings (see [`ReplayShape`]) at each slot's cursor and advances
    /// the cursors. Refuses with `ReplayFull` rather than overwrite.
    fn replay_append(&self, shape: ReplayShape, tokens: usize, ring: &mut Self::Buf, cursor: &mut Self::IBuf, records: &Self::Buf) -> Result<()>;

    /// Rebuilds each slot's state from its committed state S_0 (`state`
    /// `[B, H, Dk, Dv]`, in place) and its `cursor` recorded tokens:
    /// S_n = exp(G_n) S_0 + sum_j exp(G_n - G_j) k^_j u_j^T; then resets the
    /// cursors to 0.
    fn replay_commit(&self, shape: ReplayShape, state: &mut Self::Buf, ring: &Self::Buf, cursor: &mut Self::IBuf) -> Result<()>;

    // ---- short conv --------------------------------------------------------

    /// Causal depthwise conv1d + SiLU over one sequence: x `[T, C]`, weight
    /// `[C, W]`, state `[W-1, C]` (the inputs before x; updated to the last W-1
    /// inputs), out `[T, C]`.
    fn conv_prefill(&self, shape: ConvShape, tokens: usize, x: &Self::Buf, weight: &Self::Buf, state: &mut Self::Buf, out: &mut Self::Buf) -> Result<()>;

    /// One conv decode step for a batch: x `[B, C]`, weight `[C, W]`, state
    /// `[B, W-1, C]` (shifted in place), out `[B, C]`.
    fn conv_step(&self, shape: ConvShape, batch: usize, x: &Self::Buf, weight: &Self::Buf, state: &mut Self::Buf, out: &mut Self::Buf) -> Result<()>;

    // ---- norms -------------------------------------------------------------

    /// out = x / sqrt(mean(x^2) + eps) * weight, row-wise; x, out `[rows, dim]`,
    /// weight `[dim]`.
    fn rms_norm(&self, shape: NormShape, x: &Self::Buf, weight: &Self::Buf, out: &mut Self::Buf) -> Result<()>;

    /// KDA output norm (FLA's FusedRMSNormGated): out = rms_norm(o) * weight *
    /// silu(gate); o, gate, out `[rows, dim]`, weight `[dim]`.
    fn gated_rms_norm(&self, shape: NormShape, o: &Self::Buf, gate: &Self::Buf, weight: &Self::Buf, out: &mut Self::Buf) -> Result<()>;

    // ---- MLA ---------------------------------------------------------------

    /// Causal absorbed MLA prefill: q_lat `[T, H, L+R]` against `rows`
    /// `[N, L+R]` with N >= T, query t seeing rows 0..=N-T+t (the last T rows
    /// are the queries' own). out `[T, H, L]`; `lse`, when given, `[T, H]`.
    fn mla_prefill(
        &self,
        shape: MlaShape,
        tokens: usize,
        q_lat: &Self::Buf,
        rows: RowSet<'_, Self::Buf>,
        out: &mut Self::Buf,
        lse: Option<&mut Self::Buf>,
    ) -> Result<()>;

    /// Absorbed MLA decode of one token: q_lat `[H, L+R]` against `rows`;
    /// out `[H, L]`, lse `[H]` (natural log of the sum of exp of the scaled
    /// scores). With no rows: out = 0, lse = -inf.
    fn mla_decode(&self, shape: MlaShape, q_lat: &Self::Buf, rows: RowSet<'_, Self::Buf>, out: &mut Self::Buf, lse: &mut Self::Buf) -> Result<()>;

    /// DCP LSE merge: o_shards `[S, H, W]`, lse_shards `[S, H]` -> out `[H, W]`,
    /// lse `[H]`. Heads whose shards are all -inf get out = 0, lse = -inf.
    fn dcp_merge(&self, shape: MergeShape, o_shards: &Self::Buf, lse_shards: &Self::Buf, out: &mut Self::Buf, lse: &mut Self::Buf) -> Result<()>;

    /// Absorbed MLA decode of one token over `rows`, as an f64 partial that
    /// [`Backend::dcp_merge_partials`] merges. q_lat `[H, L+R]`; `partial`
    /// `[H, 2+L]` (see [`crate::mla_partial_width`]): per head the max m of the
    /// scaled scores, l = sum_j e^{s_j - m}, acc = sum_j e^{s_j - m} v_j (v_j the
    /// row's first L values); scores, exponentials and sums all in f64. With no
    /// rows: m = -inf, l = 0, acc = 0.
    fn mla_decode_partial(&self, shape: MlaShape, q_lat: &Self::Buf, rows: RowSet<'_, Self::Buf>, partial: &mut Self::F64Buf) -> Result<()>;

    /// [`Backend::mla_decode_partial`] for a batch of `counts.len()` = B requests
    /// whose row counts differ: q_lat `[B, H, L+R]`; `rows` holds request 0's
    /// `counts[0]` rows, then request 1's, ... (`[sum counts, L+R]`, at least);
    /// `partial` `[B, H, 2+L]`. Request b's partial is computed exactly as
    /// `mla_decode_partial` computes it over its own rows alone (same terms in the
    /// same order), so batching never changes a request's bits.
    fn mla_decode_partial_ragged(&self, shape: MlaShape, q_lat: &Self::Buf, rows: &Self::Buf, counts: &[usize], partial: &mut Self::F64Buf) -> Result<()>;

    /// DCP merge of f64 partials `[S, H, 2+L]` (shard-major; `shape.width` = L)
    /// into out `[H, L]` and lse `[H]`, in f64, rounded to f32 at the end:
    /// M = max_r m_r, l = sum_r l_r e^{m_r - M}, O = sum_r acc_r e^{m_r - M} / l,
    /// LSE = M + ln l. Heads whose shards are all empty get out = 0, lse = -inf.
    /// One shard is plain single-rank attention, so a sharded run and an
    /// unsharded one agree to f64 rounding before the final f32 rounding.
    fn dcp_merge_partials(&self, shape: MergeShape, partials: &Self::F64Buf, out: &mut Self::Buf, lse: &mut Self::Buf) -> Result<()>;

    // ---- dense -------------------------------------------------------------

    /// Whether [`Backend::kda_prefill_ragged`] saves work over one
    /// `kda_prefill` a sequence (a device: one launch a phase for a batch).
    /// The model's prefill takes the ragged call only then; the bits are the
    /// same either way.
    fn ragged_prefill_pays(&self) -> bool {
        false
    }

    /// True when [`Backend::matmul`] sums every output element over k in one
    /// fixed order whatever the row count, so a caller may pass the whole inner
    /// dimension and still get batch-invariant rows. False (the default) means
    /// only a call with at most 64 inner rows is row-count invariant (the CPU's
    /// thread pool sums 64-row chunks in finishing order), and callers chunk.
    fn matmul_fixed_order(&self) -> bool {
        false
    }

    /// out = x . w (see [`MatmulShape`]).
    fn matmul(&self, shape: MatmulShape, x: &Self::Buf, w: &Self::Buf, out: &mut Self::Buf) -> Result<()>;

    /// out = down(silu(gate(x)) * up(x)); x, out `[tokens, hidden]`.
    fn swiglu(&self, shape: MlpShape, x: &Self::Buf, w: MlpWeights<'_, Self::Buf>, out: &mut Self::Buf) -> Result<()>;

    /// The SwiGLU activation on its own: out = silu(gate) * up, element-wise,
    /// equal lengths. The model runs its MLP as chunked matmuls around this, so
    /// that each row's result does not depend on how many rows are in the call.
    fn silu_mul(&self, gate: &Self::Buf, up: &Self::Buf, out: &mut Self::Buf) -> Result<()>;

    /// `out[t] = table[ids[t]]`; refuses ids outside `0..vocab`.
    fn embedding(&self, shape: EmbeddingShape, table: &Self::Buf, ids: &Self::IBuf, out: &mut Self::Buf) -> Result<()>;

    /// Greedy pick: `ids[r]` = argmax of logits row r (`[rows, cols]`); the lowest
    /// index wins ties, NaNs are skipped (a row of NaNs picks 0).
    fn argmax(&self, rows: usize, cols: usize, logits: &Self::Buf, ids: &mut Self::IBuf) -> Result<()>;

    /// Residual add: dst += src, element-wise, equal lengths.
    fn add_inplace(&self, dst: &mut Self::Buf, src: &Self::Buf) -> Result<()>;

    /// Several products over column blocks of one x in one call (the heads of
    /// o_proj, W_UK and W_UV, the units of the MLP; see [`UnitsShape`]). Each
    /// product's bits are those of [`Backend::matmul`] on its block alone; the
    /// default runs them one by one ([`matmul_units_each`]), a device in one
    /// launch. The weights are whole (one buffer a product).
    fn matmul_units(&self, shape: UnitsShape, x: &Self::Buf, units: &[UnitProduct<'_, Self::Buf>], out: &mut Self::Buf) -> Result<()> {
        matmul_units_each(self, shape, x, units, out)
    }

    /// `acc += stacked[u]` for each `u` of `units` in order, where `stacked` is
    /// `[*, acc.len()]`: the all-reduce's sum of partials, the same bits as
    /// that many [`Backend::add_inplace`] calls.
    /// Refuses a range of units outside `stacked`.
    fn add_units(&self, acc: &mut Self::Buf, stacked: &Self::Buf, units: Range<usize>) -> Result<()>;

    // ---- the fused decode step ---------------------------------------------

    /// A decode step that runs without the host in the loop (one fixed launch
    /// sequence a batch bucket, regions read and written in place; see
    /// [`crate::step`]). Backends without one refuse with `Unsupported`, and
    /// the model runs its generic forward pass.
    fn decode_step(&self, spec: &crate::step::StepSpec) -> Result<Box<dyn crate::step::DecodeStep>> {
        let _ = spec;
        Err(crate::error::KernelError::Unsupported {
            op: "decode_step",
            backend: self.name().to_string(),
            reason: "no fused decode step on this backend; the generic forward pass runs instead".into(),
        })
    }

    // ---- device regions ----------------------------------------------------
    //
    // A region registered in device memory (crate::region) is reached in place
    // by these ops; backends without device regions refuse with `Unsupported`
    // (their regions are host bytes, which the model reads directly).

    /// Device memory for registered regions on this backend's device, sharing
    /// its address space (a transport allocates regions from it).
    fn device_memory(&self) -> Result<Arc<dyn DeviceMemory>> {
        Err(unsupported(self.name(), "device_memory"))
    }

    /// `[items, values]`: item i of the region as row i, 16-bit items decoded
    /// to f32 (exactly).
    fn region_gather(&self, region: DeviceRegion, items: RegionItems<'_>) -> Result<Self::Buf> {
        let _ = (region, items);
        Err(unsupported(self.name(), "region_gather"))
    }

    /// Writes row i of `src` (`[items, values]`) to item i of the region,
    /// encoded as `items.dtype` (round to nearest even). Items must not
    /// overlap.
    fn region_scatter(&self, src: &Self::Buf, region: DeviceRegion, items: RegionItems<'_>) -> Result<()> {
        let _ = (src, region, items);
        Err(unsupported(self.name(), "region_scatter"))
    }

    /// The little-endian i32 at each byte offset of the region (replay cursors).
    fn region_gather_i32(&self, region: DeviceRegion, offsets: &[u64]) -> Result<Self::IBuf> {
        let _ = (region, offsets);
        Err(unsupported(self.name(), "region_gather_i32"))
    }

    /// Writes `src[i]` as a little-endian i32 at `offsets[i]` of the region.
    fn region_scatter_i32(&self, src: &Self::IBuf, region: DeviceRegion, offsets: &[u64]) -> Result<()> {
        let _ = (src, region, offsets);
        Err(unsupported(self.name(), "region_scatter_i32"))
    }
}

/// [`Backend::matmul_units`] one product at a time: the block of x copied out
/// (unless it is all of x), multiplied, and copied to its place in `out`.
pub fn matmul_units_each<B: Backend + ?Sized>(be: &B, shape: UnitsShape, x: &B::Buf, units: &[UnitProduct<'_, B::Buf>], out: &mut B::Buf) -> Result<()> {
    let op = "matmul_units";
    let UnitsShape { rows, x_width, .. } = shape;
    crate::error::check_len(op, "x", be.buf_len(x), crate::error::elems(op, &[rows, x_width])?)?;
    crate::error::check_len(op, "out", be.buf_len(out), shape.out_len(op, units)?)?;
    for (i, u) in units.iter().enumerate() {
        let mm = MatmulShape { rows, inner: u.inner, cols: u.cols };
        let block = if u.x_col == 0 && u.inner == x_width {
            None
        } else {
            let mut b = be.alloc(rows * u.inner)?;
            be.copy_cols(ColsCopy { rows, src_cols: x_width, src_col: u.x_col, dst_cols: u.inner, dst_col: 0, width: u.inner }, x, &mut b)?;
            Some(b)
        };
        let mut p = be.alloc(rows * u.cols)?;
        be.matmul(mm, block.as_ref().unwrap_or(x), u.w, &mut p)?;
        let (at, _) = shape.out_at(i, u);
        match shape.out {
            UnitsOut::Stacked => be.copy(&p, 0, out, at, rows * u.cols)?,
            UnitsOut::Columns { width } => {
                be.copy_cols(ColsCopy { rows, src_cols: u.cols, src_col: 0, dst_cols: width, dst_col: at, width: u.cols }, &p, out)?
            }
        }
    }
    Ok(())
}

/// [`Backend::kda_prefill_ragged`] as `kda_prefill` once per sequence, through
/// copies of its rows and state: the trait's default, public so that tests can
/// hold a backend's own ragged prefill against it.
#[allow(clippy::too_many_arguments)]
pub fn kda_prefill_ragged_by_copies<B: Backend + ?Sized>(
    be: &B,
    shape: KdaRaggedShape,
    seqs: &[Range<usize>],
    states: &mut B::Buf,
    x: KdaInputs<'_, B::Buf>,
    params: KdaParams<'_, B::Buf>,
    out: &mut B::Buf,
    mut record: Option<&mut B::Buf>,
) -> Result<()> {
    let op = "kda_prefill_ragged";
    crate::shapes::check_ragged_seqs(op, shape.rows, seqs)?;
    let KdaRaggedShape { heads, dk, dv, .. } = shape;
    let w = crate::shapes::replay_record_width(dk, dv);
    let per_state = heads * dk * dv;
    crate::error::check_len(op, "states", be.buf_len(states), seqs.len() * per_state)?;
    for (i, r) in seqs.iter().enumerate() {
        if r.is_empty() {
            continue;
        }
        let n = r.len();
        let rows_of = |b: &B::Buf, width: usize| -> Result<B::Buf> {
            let mut part = be.alloc(n * width)?;
            be.copy(b, r.start * width, &mut part, 0, n * width)?;
            Ok(part)
        };
        let (q, k, v) = (rows_of(x.q, heads * dk)?, rows_of(x.k, heads * dk)?, rows_of(x.v, heads * dv)?);
        let (g_raw, b_raw) = (rows_of(x.g_raw, heads * dk)?, rows_of(x.b_raw, heads)?);
        let mut state = be.alloc(per_state)?;
        be.copy(states, i * per_state, &mut state, 0, per_state)?;
        let mut o = be.alloc(n * heads * dv)?;
        let mut rec = match record {
            Some(_) => Some(be.alloc(n * heads * w)?),
            None => None,
        };
        let one = KdaPrefillShape { tokens: n, heads, dk, dv };
        be.kda_prefill(one, &mut state, KdaInputs { q: &q, k: &k, v: &v, g_raw: &g_raw, b_raw: &b_raw }, params, &mut o, rec.as_mut())?;
        be.copy(&o, 0, out, r.start * heads * dv, n * heads * dv)?;
        be.copy(&state, 0, states, i * per_state, per_state)?;
        if let (Some(dst), Some(src)) = (record.as_deref_mut(), rec.as_ref()) {
            be.copy(src, 0, dst, r.start * heads * w, n * heads * w)?;
        }
    }
    Ok(())
}
