//! The forward pass, written once for every placement and every backend: a TP
//! group of rank shards ([`ShardGroup`]) runs a range of layers; the caller decides
//! where caches live (a sink for prefill, a [`BatchCaches`] for decode). The
//! colocated reference is the same code with its own plain caches; the
//! disaggregated run gives it prefill ranks and decode ranks.
//!
//! Everything runs on `B: Backend` buffers; host memory appears only where a
//! cache crosses into host regions (`upload*` / `download*`).
//!
//! All-reduce: TP ranks' partial outputs (o_proj, MLP down) are summed in global
//! unit order in-process. After an all-reduce every TP rank holds the same hidden
//! state, so the group keeps one copy of it.
//!
//! Batching: a decode step runs B requests at once, every dense op with rows = B.
//! Each op here computes a row from that row alone with a summation order that
//! does not depend on the row count (matmuls are chunked by [`K_CHUNK`], the KDA,
//! conv, norm, attention-partial and merge kernels work per row, head or slot), so
//! a request's logits in a batch are the bits it gets alone.

use super::ModelError;
use super::dtype::storage;
use super::weights::{Dims, KdaShard, LayerShard, Mat, MixerShard, MlaShard, NORM_EPS};
use handoff_components::vocab::LayerKind;
use handoff_kernels::{
    Backend, ColsCopy, ConvShape, EmbeddingShape, KdaInputs, KdaParams, KdaPrefillShape, KdaRaggedShape, KdaStepShape, MatmulShape, MergeShape, MlaShape,
    NormShape, ReplayShape, RowSet, UnitProduct, UnitsOut, UnitsShape, mla_partial_width, replay_record_width,
};
use std::ops::Range;

type R<T> = Result<T, ModelError>;

pub use super::weights::{K_CHUNK, ShardGroup};

/// x `[rows, w.inner]` . w = `[rows, w.cols]`, chunk by chunk (see [`K_CHUNK`] and [`Mat`]).
fn matmul<B: Backend>(be: &B, x: &B::Buf, w: &Mat<B>, rows: usize) -> R<B::Buf> {
    let (inner, cols) = (w.inner, w.cols);
    let mut out = be.alloc(rows * cols)?;
    if let [only] = &w.chunks[..] {
        be.matmul(MatmulShape { rows, inner, cols }, x, only, &mut out)?;
        return Ok(out);
    }
    let mut part = be.alloc(rows * cols)?;
    for (c, wc) in w.chunks.iter().enumerate() {
        let k0 = c * w.chunk_rows;
        let kn = w.chunk_rows.min(inner - k0);
        let xs = take_cols(be, x, rows, inner, k0, kn)?;
        be.matmul(MatmulShape { rows, inner: kn, cols }, &xs, wc, &mut part)?;
        be.add_inplace(&mut out, &part)?;
    }
    Ok(out)
}

/// Products of column blocks of `x` in one backend call (`Backend::matmul_units`):
/// `units[i]` = (w, first column of x, first column of out). Each product's bits
/// are what [`matmul`] gives on its block alone: on chunked weights (the CPU)
/// chunk c of every product is one call, and the chunk products are summed in
/// chunk order from 0 (a product with fewer chunks adds zeros, which leaves a
/// sum that started at +0 unchanged).
fn matmul_units<B: Backend>(be: &B, shape: UnitsShape, x: &B::Buf, units: &[(&Mat<B>, usize, usize)]) -> R<B::Buf> {
    let empty = be.alloc(0)?;
    let chunk = |c: usize| -> Vec<UnitProduct<'_, B::Buf>> {
        units
            .iter()
            .map(|&(w, x_col, out_col)| {
                let k0 = (c * w.chunk_rows).min(w.inner);
                match w.chunks.get(c) {
                    Some(wc) => UnitProduct { w: wc, inner: w.chunk_rows.min(w.inner - k0), cols: w.cols, x_col: x_col + k0, out_col },
                    None => UnitProduct { w: &empty, inner: 0, cols: w.cols, x_col, out_col },
                }
            })
            .collect()
    };
    let chunks = units.iter().map(|u| u.0.chunks.len()).max().unwrap_or(1);
    let first = chunk(0);
    let mut out = be.alloc(shape.out_len("matmul_units", &first)?)?;
    if chunks == 1 {
        be.matmul_units(shape, x, &first, &mut out)?;
        return Ok(out);
    }
    let mut part = be.alloc(be.buf_len(&out))?;
    for c in 0..chunks {
        be.matmul_units(shape, x, &chunk(c), &mut part)?;
        be.add_inplace(&mut out, &part)?;
    }
    Ok(out)
}

/// A rank's contribution to an all-reduce: `units` partials stacked `[units, *]`.
pub struct Partials<B: Backend> {
    pub buf: B::Buf,
    pub units: usize,
}

/// Per-head o_proj partials: head j's `[t, width]` columns of `y` times its rows,
/// stacked head by head.
fn per_head_out<B: Backend>(be: &B, y: &B::Buf, wo: &[Mat<B>], t: usize, width: usize) -> R<Partials<B>> {
    let hl = wo.len();
    let units: Vec<_> = wo.iter().enumerate().map(|(j, w)| (w, j * width, 0)).collect();
    let buf = matmul_units(be, UnitsShape { rows: t, x_width: hl * width, out: UnitsOut::Stacked }, y, &units)?;
    Ok(Partials { buf, units: hl })
}

fn take_cols<B: Backend>(be: &B, src: &B::Buf, rows: usize, src_cols: usize, col: usize, width: usize) -> R<B::Buf> {
    let mut out = be.alloc(rows * width)?;
    be.copy_cols(ColsCopy { rows, src_cols, src_col: col, dst_cols: width, dst_col: 0, width }, src, &mut out)?;
    Ok(out)
}

fn put_cols<B: Backend>(be: &B, src: &B::Buf, rows: usize, dst: &mut B::Buf, dst_cols: usize, col: usize) -> R<()> {
    let width = be.buf_len(src) / rows.max(1);
    be.copy_cols(ColsCopy { rows, src_cols: width, src_col: 0, dst_cols, dst_col: col, width }, src, dst)?;
    Ok(())
}

/// Rows `r` of a `[*, width]` buffer, as a new buffer.
fn rows_of<B: Backend>(be: &B, buf: &B::Buf, r: Range<usize>, width: usize) -> R<B::Buf> {
    let mut out = be.alloc(r.len() * width)?;
    be.copy(buf, r.start * width, &mut out, 0, r.len() * width)?;
    Ok(out)
}

fn rms<B: Backend>(be: &B, x: &B::Buf, w: &B::Buf, rows: usize, dim: usize) -> R<B::Buf> {
    let mut out = be.alloc(rows * dim)?;
    be.rms_norm(NormShape { rows, dim, eps: NORM_EPS }, x, w, &mut out)?;
    Ok(out)
}

/// The in-process all-reduce: every TP rank contributes its partial outputs, one
/// per reduction unit it holds (a head for o_proj, an MLP unit for the MLP), and
/// the units are summed one by one in global unit order (the first unit, then
/// each next one added). Ranks hold contiguous unit ranges, so rank-major order is
/// global order, and the sum is the same bits for every TP degree (TP1 included).
pub fn all_reduce<B: Backend>(be: &B, partials: Vec<Partials<B>>) -> R<B::Buf> {
    let mut ranks = partials.into_iter().filter(|p| p.units > 0);
    let first = ranks.next().ok_or_else(|| ModelError::Config("all-reduce over zero units".into()))?;
    let n = be.buf_len(&first.buf) / first.units;
    let mut acc = be.alloc(n)?;
    be.copy(&first.buf, 0, &mut acc, 0, n)?;
    be.add_units(&mut acc, &first.buf, 1..first.units)?;
    for p in ranks {
        be.add_units(&mut acc, &p.buf, 0..p.units)?;
    }
    Ok(acc)
}

/// Embeds byte tokens: `[T, hidden]`.
pub fn embed<B: Backend>(be: &B, group: &ShardGroup<B>, tokens: &[u8]) -> R<B::Buf> {
    let d = group.dims.hidden;
    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    let ids = be.upload_i32(&ids)?;
    let mut out = be.alloc(tokens.len() * d)?;
    be.embedding(EmbeddingShape { tokens: tokens.len(), vocab: group.dims.vocab, dim: d }, &group.embed, &ids, &mut out)?;
    Ok(out)
}

/// Final norm, LM head and greedy pick of every row of `h` `[rows, hidden]`.
fn logits_rows<B: Backend>(be: &B, group: &ShardGroup<B>, h: &B::Buf, rows: usize) -> R<Vec<(Vec<f32>, u8)>> {
    let (d, v) = (group.dims.hidden, group.dims.vocab);
    let xn = rms(be, h, &group.final_norm, rows, d)?;
    let logits = matmul(be, &xn, &group.lm_head, rows)?;
    let mut picks = be.alloc_i32(rows)?;
    be.argmax(rows, v, &logits, &mut picks)?;
    let picks = be.download_i32(&picks)?;
    let logits = be.download(&logits)?;
    Ok(logits.chunks_exact(v.max(1)).zip(picks).map(|(l, p)| (l.to_vec(), p.clamp(0, 255) as u8)).collect())
}

/// Final norm and LM head of the last row of `h` `[T, hidden]`: the logits and the greedy pick.
pub fn logits_of_last<B: Backend>(be: &B, group: &ShardGroup<B>, h: &B::Buf, tokens: usize) -> R<(Vec<f32>, u8)> {
    if tokens == 0 {
        return Err(ModelError::Config("logits of an empty sequence".into()));
    }
    let d = group.dims.hidden;
    let last = rows_of(be, h, tokens - 1..tokens, d)?;
    logits_rows(be, group, &last, 1)?.pop().ok_or_else(|| ModelError::Config("no logits row".into()))
}

// ---- KDA ----------------------------------------------------------------------

/// What a KDA layer leaves in the caches of one rank for one prompt after
/// prefill, as backend buffers (on a GPU they stay on the device until the sink
/// scatters them into the regions).
pub struct KdaCache<B: Backend> {
    /// Recurrent state `[hl, Dk, Dv]` f32: the state after the prompt, or, when
    /// `records` holds the last r tokens, the state before them (S_{T-r}).
    pub state: B::Buf,
    /// Conv state `[W-1, C]` (q | k | v channels), rounded to the model dtype.
    pub conv: B::Buf,
    /// ReplaySSM records `[r, hl, 2Dk+Dv]` of the prompt's last r tokens (empty
    /// when r = 0).
    pub records: B::Buf,
    pub record_tokens: usize,
}

/// One prompt of a batched prefill: rows `start..start + len` of the batch's
/// hidden states, whose last `record_tail` tokens leave ReplaySSM records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillSeq {
    pub start: usize,
    pub len: usize,
    pub record_tail: usize,
}

impl PrefillSeq {
    /// The rows of the prompt in the batch.
    pub fn rows(&self) -> Range<usize> {
        self.start..self.start + self.len
    }

    /// Prompts of `lens` tokens laid end to end, each with the record tail `tail(len)`.
    pub fn packed(lens: &[usize], tail: impl Fn(usize) -> usize) -> Vec<PrefillSeq> {
        let mut start = 0;
        lens.iter()
            .map(|&len| {
                let s = PrefillSeq { start, len, record_tail: tail(len).min(len) };
                start += len;
                s
            })
            .collect()
    }
}

/// Rows of the batch the seqs cover, checked to be laid end to end from 0.
fn batch_rows(seqs: &[PrefillSeq]) -> R<usize> {
    let mut end = 0;
    for s in seqs {
        if s.start != end || s.len == 0 || s.record_tail > s.len {
            return Err(ModelError::Config(format!("prefill batch: {s:?} does not follow row {end} (prompts are laid end to end, none empty)")));
        }
        end += s.len;
    }
    if end == 0 {
        return Err(ModelError::Config("prefill batch of no prompts".into()));
    }
    Ok(end)
}

/// Rows `r` of a `[t, width]` buffer, copied out unless they are all of it.
fn sub_rows<B: Backend>(be: &B, buf: &B::Buf, r: Range<usize>, t: usize, width: usize) -> R<Option<B::Buf>> {
    if r == (0..t) { Ok(None) } else { rows_of(be, buf, r, width).map(Some) }
}

/// The per-token KDA inputs of one rank before the recurrence: q, k, v after the
/// short conv, g and beta logits.
struct KdaIn<B: Backend> {
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    g: B::Buf,
    b: B::Buf,
}

fn kda_split<B: Backend>(be: &B, dims: &Dims, sh: &KdaShard<B>, xn: &B::Buf, conv_out: &B::Buf, t: usize) -> R<KdaIn<B>> {
    let (hl, dk, dv) = (sh.heads, dims.dk, dims.dv);
    let c = dims.conv_channels(hl);
    Ok(KdaIn {
        q: take_cols(be, conv_out, t, c, 0, hl * dk)?,
        k: take_cols(be, conv_out, t, c, hl * dk, hl * dk)?,
        v: take_cols(be, conv_out, t, c, 2 * hl * dk, hl * dv)?,
        g: matmul(be, xn, &sh.wg, t)?,
        b: matmul(be, xn, &sh.wb, t)?,
    })
}

fn kda_output<B: Backend>(be: &B, dims: &Dims, sh: &KdaShard<B>, xn: &B::Buf, o: &B::Buf, t: usize) -> R<Partials<B>> {
    let (hl, dv) = (sh.heads, dims.dv);
    let gate = matmul(be, xn, &sh.wgate, t)?;
    let mut y = be.alloc(t * hl * dv)?;
    be.gated_rms_norm(NormShape { rows: t * hl, dim: dv, eps: NORM_EPS }, o, &gate, &sh.onorm, &mut y)?;
    per_head_out(be, &y, &sh.wo, t, dv)
}

/// The short conv of every prompt of a batch from zero state: the conv outputs
/// `[t, C]` of all rows and each prompt's final conv state, rounded to the model
/// dtype.
fn conv_batch<B: Backend>(be: &B, dims: &Dims, sh: &KdaShard<B>, qkv: &B::Buf, seqs: &[PrefillSeq], t: usize) -> R<(B::Buf, Vec<B::Buf>)> {
    let c = dims.conv_channels(sh.heads);
    let shape = ConvShape { channels: c, width: dims.conv };
    let mut out = be.alloc(t * c)?;
    let mut states = Vec::with_capacity(seqs.len());
    for s in seqs {
        let mut state = be.alloc((dims.conv - 1) * c)?;
        match sub_rows(be, qkv, s.rows(), t, c)? {
            None => be.conv_prefill(shape, t, qkv, &sh.conv, &mut state, &mut out)?,
            Some(x) => {
                let mut y = be.alloc(s.len * c)?;
                be.conv_prefill(shape, s.len, &x, &sh.conv, &mut state, &mut y)?;
                be.copy(&y, 0, &mut out, s.start * c, s.len * c)?;
            }
        }
        be.round_to(&mut state, storage(dims.dtype))?;
        states.push(state);
    }
    Ok((out, states))
}

/// KDA prefill of one rank's heads over a batch of prompts, each from zero
/// state. The dense products run once over all rows and the conv per prompt.
/// The recurrence runs, on a backend that says it pays
/// ([`Backend::ragged_prefill_pays`]: a device, one launch per phase for the
/// whole batch), in one ragged call over all prompts, and elsewhere prompt by
/// prompt; each prompt gets the same bits either way. A prompt with a record
/// tail r > 0 runs its last r tokens as a second pass that emits ReplaySSM
/// records, and caches the state before them.
pub fn kda_prefill<B: Backend>(be: &B, dims: &Dims, sh: &KdaShard<B>, xn: &B::Buf, seqs: &[PrefillSeq]) -> R<(Partials<B>, Vec<KdaCache<B>>)> {
    let t = batch_rows(seqs)?;
    let hl = sh.heads;
    let qkv = matmul(be, xn, &sh.wqkv, t)?;
    let (conv_out, convs) = conv_batch(be, dims, sh, &qkv, seqs, t)?;
    let x = kda_split(be, dims, sh, xn, &conv_out, t)?;
    let mut o = be.alloc(t * hl * dims.dv)?;
    let states = if be.ragged_prefill_pays() {
        kda_recurrence_ragged(be, dims, sh, &x, seqs, t, &mut o)?
    } else {
        kda_recurrence_each(be, dims, sh, &x, seqs, t, &mut o)?
    };
    let caches =
        seqs.iter().zip(convs).zip(states).map(|((s, conv), (state, records))| KdaCache { state, conv, records, record_tokens: s.record_tail }).collect();
    let partial = kda_output(be, dims, sh, xn, &o, t)?;
    Ok((partial, caches))
}

/// Each prompt's (state before its record tail, tail records) after the
/// recurrence over the batch in two ragged calls (the heads, then the tails
/// with records); outputs into `o`.
fn kda_recurrence_ragged<B: Backend>(
    be: &B,
    dims: &Dims,
    sh: &KdaShard<B>,
    x: &KdaIn<B>,
    seqs: &[PrefillSeq],
    t: usize,
    o: &mut B::Buf,
) -> R<Vec<(B::Buf, B::Buf)>> {
    let (hl, dk, dv) = (sh.heads, dims.dk, dims.dv);
    let params = KdaParams { a_log: &sh.a_log, dt_bias: &sh.dt_bias };
    let inputs = KdaInputs { q: &x.q, k: &x.k, v: &x.v, g_raw: &x.g, b_raw: &x.b };
    let shape = KdaRaggedShape { rows: t, heads: hl, dk, dv };
    let per = hl * dk * dv;
    let mut states = be.alloc(seqs.len() * per)?;
    let heads: Vec<Range<usize>> = seqs.iter().map(|s| s.start..s.start + s.len - s.record_tail).collect();
    be.kda_prefill_ragged(shape, &heads, &mut states, inputs, params, o, None)?;
    // Each cache's state is the one before its record tail, taken before the
    // tail pass moves the states on (ops run in order).
    let mut cached = Vec::with_capacity(seqs.len());
    for i in 0..seqs.len() {
        let mut state = be.alloc(per)?;
        be.copy(&states, i * per, &mut state, 0, per)?;
        cached.push(state);
    }
    let w = dims.record_width();
    let records = if seqs.iter().any(|s| s.record_tail > 0) {
        let tails: Vec<Range<usize>> = seqs.iter().map(|s| s.start + s.len - s.record_tail..s.start + s.len).collect();
        let mut rec = be.alloc(t * hl * w)?;
        be.kda_prefill_ragged(shape, &tails, &mut states, inputs, params, o, Some(&mut rec))?;
        Some(rec)
    } else {
        None
    };
    let mut out = Vec::with_capacity(seqs.len());
    for (s, state) in seqs.iter().zip(cached) {
        let tail = s.record_tail;
        let recs = match &records {
            Some(rec) if tail > 0 => rows_of(be, rec, s.start + s.len - tail..s.start + s.len, hl * w)?,
            _ => be.alloc(0)?,
        };
        out.push((state, recs));
    }
    Ok(out)
}

/// The same, prompt by prompt through `kda_prefill` on copies of its rows:
/// what a backend whose ragged call would only loop over the prompts takes
/// (on the CPU the ragged path's batch-sized buffers stepped a prefill
/// stage's heap by 2 to 3 MiB over a soak, where these per-prompt ones stay
/// flat: tests/serve_e2e.rs).
fn kda_recurrence_each<B: Backend>(
    be: &B,
    dims: &Dims,
    sh: &KdaShard<B>,
    x: &KdaIn<B>,
    seqs: &[PrefillSeq],
    t: usize,
    o: &mut B::Buf,
) -> R<Vec<(B::Buf, B::Buf)>> {
    let (hl, dk, dv) = (sh.heads, dims.dk, dims.dv);
    let params = KdaParams { a_log: &sh.a_log, dt_bias: &sh.dt_bias };
    let mut out = Vec::with_capacity(seqs.len());
    for s in seqs {
        let mut state = be.alloc(hl * dk * dv)?;
        let tail = s.record_tail;
        let end = s.start + s.len;
        let mut cached_state = None;
        let mut records = be.alloc(0)?;
        for (range, record) in [(s.start..end - tail, false), (end - tail..end, true)] {
            if record {
                if tail == 0 {
                    break;
                }
                let mut before = be.alloc(hl * dk * dv)?;
                be.copy(&state, 0, &mut before, 0, hl * dk * dv)?;
                cached_state = Some(before);
            }
            if range.is_empty() {
                continue;
            }
            let n = range.len();
            let piece = |buf: &B::Buf, w: usize| sub_rows(be, buf, range.clone(), t, w);
            let (q, k, v, g, b) = (piece(&x.q, hl * dk)?, piece(&x.k, hl * dk)?, piece(&x.v, hl * dv)?, piece(&x.g, hl * dk)?, piece(&x.b, hl)?);
            let inputs = KdaInputs {
                q: q.as_ref().unwrap_or(&x.q),
                k: k.as_ref().unwrap_or(&x.k),
                v: v.as_ref().unwrap_or(&x.v),
                g_raw: g.as_ref().unwrap_or(&x.g),
                b_raw: b.as_ref().unwrap_or(&x.b),
            };
            let mut rec = if record { Some(be.alloc(n * hl * dims.record_width())?) } else { None };
            let shape = KdaPrefillShape { tokens: n, heads: hl, dk, dv };
            if n == t {
                be.kda_prefill(shape, &mut state, inputs, params, o, rec.as_mut())?;
            } else {
                let mut part = be.alloc(n * hl * dv)?;
                be.kda_prefill(shape, &mut state, inputs, params, &mut part, rec.as_mut())?;
                be.copy(&part, 0, o, range.start * hl * dv, n * hl * dv)?;
            }
            if let Some(r) = rec {
                records = r;
            }
        }
        out.push((cached_state.unwrap_or(state), records));
    }
    Ok(out)
}

/// The KDA caches of one rank and one layer for every request of a decode batch,
/// gathered from their slots into backend buffers (request-major).
pub struct KdaBatch<B: Backend> {
    /// Recurrent state `[B, hl, Dk, Dv]`; under ReplaySSM the committed state.
    pub state: B::Buf,
    /// Conv state `[B, W-1, C]`, as stored (model dtype values).
    pub conv: B::Buf,
    /// ReplaySSM rings and cursors, when `[model.replay]` is configured.
    pub replay: Option<ReplayBatch<B>>,
}

/// The ReplaySSM rings `[B, capacity, hl, 2Dk+Dv]` and cursors `[B]` of a batch.
pub struct ReplayBatch<B: Backend> {
    pub ring: B::Buf,
    pub cursor: B::IBuf,
}

/// Where a decode TP group keeps the caches of the requests of one batch. Request
/// b of the batch is the b-th entry of the `tokens` / `positions` of
/// [`decode_batch`]; `rank` is a TP rank of the group. Implementations move bytes
/// only (the math is all in this module), and touch only the batch's requests.
pub trait BatchCaches<B: Backend> {
    /// Requests in the batch.
    fn batch(&self) -> usize;
    /// DCP degree: MLA rows are spread over runs of `dcp` consecutive TP ranks.
    fn dcp(&self) -> usize;
    /// The batch's KDA caches of `layer` on TP rank `rank`.
    fn kda_load(&mut self, be: &B, rank: usize, layer: usize) -> R<KdaBatch<B>>;
    /// Stores what a step left in `kda`: conv state, and rings and cursors under
    /// replay, for every request; the recurrent state only of the requests whose
    /// `state_changed` is set (under replay, the slots that committed).
    fn kda_store(&mut self, be: &B, rank: usize, layer: usize, kda: &KdaBatch<B>, state_changed: &[bool]) -> R<()>;
    /// The MLA cache of `layer` on TP rank `rank` for this step, in one go: stores
    /// the rows of `new_rows` (`[B, L+R]`, model dtype values; request b's row is
    /// that of position `positions[b]`) that the rank owns, then returns the rows
    /// the rank holds of positions `0..=positions[b]`, request by request (`[sum
    /// n_b, L+R]`), and each request's count n_b. Called once per rank of the
    /// group per MLA layer per step, in rank order.
    fn mla_rows(&mut self, be: &B, rank: usize, layer: usize, positions: &[usize], new_rows: &B::Buf) -> R<(B::Buf, Vec<usize>)>;
}

/// Copies the `per`-element items `which` of `src` (`[*, per]`) into a new
/// buffer, in that order.
fn gather<B: Backend>(be: &B, src: &B::Buf, which: &[usize], per: usize) -> R<B::Buf> {
    let mut out = be.alloc(which.len() * per)?;
    for (i, &b) in which.iter().enumerate() {
        be.copy(src, b * per, &mut out, i * per, per)?;
    }
    Ok(out)
}

/// One KDA decode step of one rank for a batch of `nb` requests: `xn` `[B,
/// hidden]`, caches in `kb` updated in place (conv rounded to the model dtype, as
/// it is stored). Returns the per-head o_proj partials and, per request, whether
/// its recurrent state changed.
///
/// Under ReplaySSM every slot's current state is rebuilt from its committed state
/// and its `cursor` records (`replay_commit` on a copy), stepped, and the step's
/// record appended; the slots whose ring is then full commit (committed state :=
/// state rebuilt from the full ring, cursor 0), the others keep their committed
/// state. Per slot and head this is exactly the batch-1 schedule: every kernel
/// involved works per (slot, head), so a slot's bits do not depend on its batch.
pub fn kda_decode_batch<B: Backend>(be: &B, dims: &Dims, sh: &KdaShard<B>, xn: &B::Buf, nb: usize, kb: &mut KdaBatch<B>) -> R<(Partials<B>, Vec<bool>)> {
    let (hl, dk, dv) = (sh.heads, dims.dk, dims.dv);
    let c = dims.conv_channels(hl);
    let qkv = matmul(be, xn, &sh.wqkv, nb)?;
    let mut conv_out = be.alloc(nb * c)?;
    be.conv_step(ConvShape { channels: c, width: dims.conv }, nb, &qkv, &sh.conv, &mut kb.conv, &mut conv_out)?;
    be.round_to(&mut kb.conv, storage(dims.dtype))?;
    let x = kda_split(be, dims, sh, xn, &conv_out, nb)?;
    let inputs = KdaInputs { q: &x.q, k: &x.k, v: &x.v, g_raw: &x.g, b_raw: &x.b };
    let params = KdaParams { a_log: &sh.a_log, dt_bias: &sh.dt_bias };
    let step = KdaStepShape { batch: nb, heads: hl, dk, dv };
    let mut o = be.alloc(nb * hl * dv)?;
    let changed = match (&mut kb.replay, dims.replay) {
        (None, None) => {
            be.kda_step(step, &mut kb.state, inputs, params, &mut o, None)?;
            vec![true; nb]
        }
        (Some(rb), Some(capacity)) => {
            let shape = ReplayShape { batch: nb, heads: hl, dk, dv, capacity };
            let per = hl * dk * dv;
            let mut current = be.alloc(nb * per)?;
            be.copy(&kb.state, 0, &mut current, 0, nb * per)?;
            let mut scratch = be.upload_i32(&be.download_i32(&rb.cursor)?)?;
            be.replay_commit(shape, &mut current, &rb.ring, &mut scratch)?;
            let mut record = be.alloc(nb * hl * replay_record_width(dk, dv))?;
            be.kda_step(step, &mut current, inputs, params, &mut o, Some(&mut record))?;
            be.replay_append(shape, 1, &mut rb.ring, &mut rb.cursor, &record)?;
            let mut cursors = be.download_i32(&rb.cursor)?;
            let full: Vec<usize> = (0..nb).filter(|&b| cursors[b] as usize >= capacity).collect();
            if !full.is_empty() {
                // Commit the full slots only, as a sub-batch gathered from their rows.
                let ring_per = capacity * hl * replay_record_width(dk, dv);
                let sub = ReplayShape { batch: full.len(), ..shape };
                let mut st = gather(be, &kb.state, &full, per)?;
                let ring = gather(be, &rb.ring, &full, ring_per)?;
                let mut cur = be.upload_i32(&vec![capacity as i32; full.len()])?;
                be.replay_commit(sub, &mut st, &ring, &mut cur)?;
                for (i, &b) in full.iter().enumerate() {
                    be.copy(&st, i * per, &mut kb.state, b * per, per)?;
                    cursors[b] = 0;
                }
                rb.cursor = be.upload_i32(&cursors)?;
            }
            (0..nb).map(|b| full.contains(&b)).collect()
        }
        _ => return Err(ModelError::Config("the caches' ReplaySSM buffers do not match [model.replay]".into())),
    };
    Ok((kda_output(be, dims, sh, xn, &o, nb)?, changed))
}

// ---- MLA ----------------------------------------------------------------------

/// The cached rows of `t` tokens `[t, L+R]`: RMSNorm'd latent, then the NoPE part;
/// rounded to the model dtype. Replicated over TP: every rank computes the same.
pub fn mla_rows<B: Backend>(be: &B, dims: &Dims, sh: &MlaShard<B>, xn: &B::Buf, t: usize) -> R<B::Buf> {
    let (l, w) = (dims.kv_lora_rank, dims.row_width());
    let mut kv = matmul(be, xn, &sh.wkva, t)?;
    let lat = take_cols(be, &kv, t, w, 0, l)?;
    let lat = rms(be, &lat, &sh.kv_norm, t, l)?;
    put_cols(be, &lat, t, &mut kv, w, 0)?;
    be.round_to(&mut kv, storage(dims.dtype))?;
    Ok(kv)
}

/// Absorbed queries of one rank's heads: `[t, hl, L+R]` = [q_nope W_UK | q_rope].
pub fn mla_q_lat<B: Backend>(be: &B, dims: &Dims, sh: &MlaShard<B>, xn: &B::Buf, t: usize) -> R<B::Buf> {
    let (l, r, dn, w) = (dims.kv_lora_rank, dims.rope_dim, dims.nope_dim, dims.row_width());
    let hl = sh.heads;
    let qw = dn + r;
    let q = matmul(be, xn, &sh.wq, t)?;
    let units: Vec<_> = sh.wuk.iter().enumerate().map(|(h, wuk)| (wuk, h * qw, h * w)).collect();
    let mut q_lat = matmul_units(be, UnitsShape { rows: t, x_width: hl * qw, out: UnitsOut::Columns { width: hl * w } }, &q, &units)?;
    if r > 0 {
        for h in 0..hl {
            let rope = ColsCopy { rows: t, src_cols: hl * qw, src_col: h * qw + dn, dst_cols: hl * w, dst_col: h * w + l, width: r };
            be.copy_cols(rope, &q, &mut q_lat)?;
        }
    }
    Ok(q_lat)
}

/// W_UV per head on the latent output `[t, hl, L]`, then the rank's o_proj rows.
pub fn mla_out<B: Backend>(be: &B, dims: &Dims, sh: &MlaShard<B>, o_lat: &B::Buf, t: usize) -> R<Partials<B>> {
    let (l, dvh) = (dims.kv_lora_rank, dims.v_head_dim);
    let hl = sh.heads;
    let units: Vec<_> = sh.wuv.iter().enumerate().map(|(h, wuv)| (wuv, h * l, h * dvh)).collect();
    let y = matmul_units(be, UnitsShape { rows: t, x_width: hl * l, out: UnitsOut::Columns { width: hl * dvh } }, o_lat, &units)?;
    per_head_out(be, &y, &sh.wo, t, dvh)
}

/// Absorbed MLA attention geometry of `heads` query heads.
pub fn mla_shape(dims: &Dims, heads: usize) -> MlaShape {
    MlaShape { heads, kv_lora_rank: dims.kv_lora_rank, rope_dim: dims.rope_dim, scale: dims.mla_scale() }
}

/// The MLA layer of one decode step for a batch: every DCP group all-gathers its
/// members' queries `[B, dcp * hl, L+R]`; each member computes the f64 partials of
/// those queries over its own rows of each request (ragged: counts differ per
/// request and member); the partials, stacked shard-major `[dcp, B * hg, 2+L]`
/// (the batch folds into the heads), merge in one f64 merge, rounded once at the
/// end, so the result does not depend on how the tokens were sharded: one shard
/// (the colocated run) and any DCP degree agree bit for bit. Returns the o_proj
/// partials of every rank, in rank order.
fn mla_decode_batch<B: Backend>(
    be: &B,
    group: &ShardGroup<B>,
    layer: usize,
    xn: &B::Buf,
    positions: &[usize],
    caches: &mut dyn BatchCaches<B>,
) -> R<Vec<Partials<B>>> {
    let dims = &group.dims;
    let nb = positions.len();
    let (tp, dcp) = (group.tp(), caches.dcp());
    if dcp == 0 || !tp.is_multiple_of(dcp) {
        return Err(ModelError::Config(format!("dcp {dcp} does not divide the group's tp {tp}")));
    }
    let mla = |r: usize| match &group.ranks[r].layers[layer].mixer {
        MixerShard::Mla(sh) => Ok(sh),
        MixerShard::Kda(_) => Err(kind_err(layer)),
    };
    let rows = mla_rows(be, dims, mla(0)?, xn, nb)?;
    let (l, w) = (dims.kv_lora_rank, dims.row_width());
    let hl = mla(0)?.heads;
    let hg = hl * dcp;
    let pw = mla_partial_width(l);
    let shape = mla_shape(dims, hg);
    let mut parts = Vec::with_capacity(tp);
    for g in 0..tp / dcp {
        let members = g * dcp..(g + 1) * dcp;
        // All-gather of the group's queries: request-major, then member-major heads.
        let mut q = be.alloc(nb * hg * w)?;
        for (j, r) in members.clone().enumerate() {
            let qr = mla_q_lat(be, dims, mla(r)?, xn, nb)?;
            put_cols(be, &qr, nb, &mut q, hg * w, j * hl * w)?;
        }
        // Each member's f64 partials over its own rows, stacked member-major.
        let mut partials = be.alloc_f64(dcp * nb * hg * pw)?;
        let mut p = be.alloc_f64(nb * hg * pw)?;
        for (j, r) in members.clone().enumerate() {
            let (own, counts) = caches.mla_rows(be, r, layer, positions, &rows)?;
            if counts.len() != nb {
                return Err(ModelError::Region(format!("tp rank {r}: rows of {} requests for a batch of {nb}", counts.len())));
            }
            be.mla_decode_partial_ragged(shape, &q, &own, &counts, &mut p)?;
            be.copy_f64(&p, 0, &mut partials, j * nb * hg * pw, nb * hg * pw)?;
        }
        let mut o = be.alloc(nb * hg * l)?;
        let mut lse = be.alloc(nb * hg)?;
        be.dcp_merge_partials(MergeShape { shards: dcp, heads: nb * hg, width: l }, &partials, &mut o, &mut lse)?;
        // Each member keeps its own heads.
        for (j, r) in members.enumerate() {
            let oj = take_cols(be, &o, nb, hg * l, j * hl * l, hl * l)?;
            parts.push(mla_out(be, dims, mla(r)?, &oj, nb)?);
        }
    }
    Ok(parts)
}

/// The rank's MLP partials, one per unit, stacked: down(silu(gate x) * up x). The
/// units' gate and up columns sit side by side (one call each), so the
/// activation is one call too.
fn mlp<B: Backend>(be: &B, ls: &LayerShard<B>, xn: &B::Buf, t: usize, hidden: usize) -> R<Partials<B>> {
    // Unit u's columns in the side-by-side gate and up outputs start at at[u].
    let mut at = Vec::with_capacity(ls.mlp.len());
    let mut width = 0;
    for u in &ls.mlp {
        at.push(width);
        width += u.width;
    }
    if ls.mlp.is_empty() {
        return Ok(Partials { buf: be.alloc(0)?, units: 0 });
    }
    let side = UnitsShape { rows: t, x_width: hidden, out: UnitsOut::Columns { width } };
    let g = matmul_units(be, side, xn, &ls.mlp.iter().zip(&at).map(|(u, &c)| (&u.gate, 0, c)).collect::<Vec<_>>())?;
    let up = matmul_units(be, side, xn, &ls.mlp.iter().zip(&at).map(|(u, &c)| (&u.up, 0, c)).collect::<Vec<_>>())?;
    let mut act = be.alloc(t * width)?;
    be.silu_mul(&g, &up, &mut act)?;
    let down: Vec<_> = ls.mlp.iter().zip(&at).map(|(u, &c)| (&u.down, c, 0)).collect();
    let buf = matmul_units(be, UnitsShape { rows: t, x_width: width, out: UnitsOut::Stacked }, &act, &down)?;
    Ok(Partials { buf, units: ls.mlp.len() })
}

fn mlp_block<B: Backend>(be: &B, group: &ShardGroup<B>, layer: usize, h: &mut B::Buf, t: usize) -> R<()> {
    let d = group.dims.hidden;
    let xn = rms(be, h, &group.ranks[0].layers[layer].mlp_norm, t, d)?;
    let parts = group.ranks.iter().map(|s| mlp(be, &s.layers[layer], &xn, t, d)).collect::<R<Vec<_>>>()?;
    let sum = all_reduce(be, parts)?;
    be.add_inplace(h, &sum)?;
    Ok(())
}

// ---- drivers ------------------------------------------------------------------

/// A cache a prefill rank produced for one layer and one prompt, as backend
/// buffers: the sink scatters them into the regions (on the device when the
/// regions live there).
pub enum PrefillCache<'a, B: Backend> {
    Kda(&'a KdaCache<B>),
    /// MLA rows `[T, L+R]` of the prompt, rounded to the model dtype.
    Mla(&'a B::Buf),
}

/// Where a one-prompt prefill puts what it caches: `(tp_rank, layer, cache)`.
pub type LayerSink<'s, B> = dyn FnMut(usize, usize, PrefillCache<'_, B>) -> R<()> + 's;

/// Where a prefill puts what it caches: `(prompt, tp_rank, layer, cache)`.
pub type PrefillSink<'s, B> = dyn FnMut(usize, usize, usize, PrefillCache<'_, B>) -> R<()> + 's;

fn kind_err(layer: usize) -> ModelError {
    ModelError::Config(format!("layer {layer}: shard kind does not match the pattern"))
}

fn check_layers<B: Backend>(group: &ShardGroup<B>, layers: &Range<usize>) -> R<()> {
    let n = group.dims.num_layers();
    if group.ranks.is_empty() || layers.end > n || group.ranks.iter().any(|r| r.layers.len() != n) {
        return Err(ModelError::Config(format!("layers {layers:?} of a group of {} ranks over a {n}-layer model", group.ranks.len())));
    }
    Ok(())
}

/// Prefill of `layers` by one TP group over one prompt, `h` `[t, hidden]`
/// (updated in place); `sink(tp_rank, layer, cache)` stores what each rank caches.
#[allow(clippy::too_many_arguments)]
pub fn prefill_layers<B: Backend>(
    be: &B,
    group: &ShardGroup<B>,
    layers: Range<usize>,
    h: &mut B::Buf,
    t: usize,
    record_tail: usize,
    sink: &mut LayerSink<'_, B>,
) -> R<()> {
    let seq = [PrefillSeq { start: 0, len: t, record_tail: record_tail.min(t) }];
    prefill_batch(be, group, layers, h, &seq, &mut |_, r, layer, cache| sink(r, layer, cache))
}

/// Prefill of `layers` by one TP group over a batch of prompts laid end to end
/// in `h` `[rows, hidden]` (updated in place). Every dense op runs once over all
/// rows; the conv, the KDA recurrence and the MLA attention run per prompt. A
/// row's products do not depend on the row count (see the module doc), so each
/// prompt gets the bits it gets alone. `sink(prompt, tp_rank, layer, cache)`
/// stores what each rank caches for each prompt.
pub fn prefill_batch<B: Backend>(
    be: &B,
    group: &ShardGroup<B>,
    layers: Range<usize>,
    h: &mut B::Buf,
    seqs: &[PrefillSeq],
    sink: &mut PrefillSink<'_, B>,
) -> R<()> {
    prefill_batch_streamed(be, group, layers, h, seqs, sink, &mut |_| Ok(()))
}

/// [`prefill_batch`], calling `layer_done(layer)` once each layer is computed
/// (every rank's caches of every prompt given to `sink`, the residual
/// updated), before the next layer starts: layer-wise streaming issues that
/// layer's writes from it.
pub fn prefill_batch_streamed<B: Backend>(
    be: &B,
    group: &ShardGroup<B>,
    layers: Range<usize>,
    h: &mut B::Buf,
    seqs: &[PrefillSeq],
    sink: &mut PrefillSink<'_, B>,
    layer_done: &mut dyn FnMut(usize) -> R<()>,
) -> R<()> {
    check_layers(group, &layers)?;
    let t = batch_rows(seqs)?;
    let dims = &group.dims;
    for layer in layers {
        let xn = rms(be, h, &group.ranks[0].layers[layer].attn_norm, t, dims.hidden)?;
        let mut parts = Vec::with_capacity(group.tp());
        match dims.layer_kinds[layer] {
            LayerKind::Kda => {
                for (r, s) in group.ranks.iter().enumerate() {
                    let MixerShard::Kda(sh) = &s.layers[layer].mixer else { return Err(kind_err(layer)) };
                    let (p, caches) = kda_prefill(be, dims, sh, &xn, seqs)?;
                    for (i, cache) in caches.iter().enumerate() {
                        sink(i, r, layer, PrefillCache::Kda(cache))?;
                    }
                    parts.push(p);
                }
            }
            LayerKind::Mla => {
                let MixerShard::Mla(sh0) = &group.ranks[0].layers[layer].mixer else { return Err(kind_err(layer)) };
                let w = dims.row_width();
                let rows = mla_rows(be, dims, sh0, &xn, t)?;
                let seq_rows = seqs.iter().map(|s| sub_rows(be, &rows, s.rows(), t, w)).collect::<R<Vec<_>>>()?;
                for (r, s) in group.ranks.iter().enumerate() {
                    let MixerShard::Mla(sh) = &s.layers[layer].mixer else { return Err(kind_err(layer)) };
                    for (i, own) in seq_rows.iter().enumerate() {
                        sink(i, r, layer, PrefillCache::Mla(own.as_ref().unwrap_or(&rows)))?;
                    }
                    let q_lat = mla_q_lat(be, dims, sh, &xn, t)?;
                    let (shape, lw) = (mla_shape(dims, sh.heads), sh.heads * dims.kv_lora_rank);
                    let mut o = be.alloc(t * lw)?;
                    for (s, own) in seqs.iter().zip(&seq_rows) {
                        let Some(own) = own else {
                            be.mla_prefill(shape, t, &q_lat, RowSet { buf: &rows, count: t }, &mut o, None)?;
                            continue;
                        };
                        let q = rows_of(be, &q_lat, s.rows(), sh.heads * w)?;
                        let mut out = be.alloc(s.len * lw)?;
                        be.mla_prefill(shape, s.len, &q, RowSet { buf: own, count: s.len }, &mut out, None)?;
                        be.copy(&out, 0, &mut o, s.start * lw, s.len * lw)?;
                    }
                    parts.push(mla_out(be, dims, sh, &o, t)?);
                }
            }
        }
        let sum = all_reduce(be, parts)?;
        be.add_inplace(h, &sum)?;
        mlp_block(be, group, layer, h, t)?;
        layer_done(layer)?;
    }
    Ok(())
}

/// Final norm, LM head and greedy pick of the last row of every prompt of a batch.
pub fn logits_of_lasts<B: Backend>(be: &B, group: &ShardGroup<B>, h: &B::Buf, seqs: &[PrefillSeq]) -> R<Vec<(Vec<f32>, u8)>> {
    batch_rows(seqs)?;
    let d = group.dims.hidden;
    let mut lasts = be.alloc(seqs.len() * d)?;
    for (i, s) in seqs.iter().enumerate() {
        be.copy(h, (s.start + s.len - 1) * d, &mut lasts, i * d, d)?;
    }
    logits_rows(be, group, &lasts, seqs.len())
}

/// One decode step of one TP group for a batch of B requests: request b feeds
/// `tokens[b]` at position `positions[b]` (its caches hold positions
/// `0..positions[b]`). Returns each request's logits and greedy pick, in batch
/// order. Every dense op runs with rows = B; the KDA step, conv step and replay
/// run once per rank and layer over the batch's gathered slots; MLA attention is
/// one ragged partial per DCP member and one merge per DCP group. Request b's
/// result is bit for bit what a batch of one gives.
pub fn decode_batch<B: Backend>(be: &B, group: &ShardGroup<B>, tokens: &[u8], positions: &[usize], caches: &mut dyn BatchCaches<B>) -> R<Vec<(Vec<f32>, u8)>> {
    let nb = tokens.len();
    if positions.len() != nb || caches.batch() != nb {
        return Err(ModelError::Config(format!("decode batch of {nb} tokens, {} positions, caches of {} requests", positions.len(), caches.batch())));
    }
    if nb == 0 {
        return Ok(Vec::new());
    }
    let dims = &group.dims;
    check_layers(group, &(0..dims.num_layers()))?;
    let mut h = embed(be, group, tokens)?;
    for layer in 0..dims.num_layers() {
        let xn = rms(be, &h, &group.ranks[0].layers[layer].attn_norm, nb, dims.hidden)?;
        let parts = match dims.layer_kinds[layer] {
            LayerKind::Kda => {
                let mut parts = Vec::with_capacity(group.tp());
                for (r, s) in group.ranks.iter().enumerate() {
                    let MixerShard::Kda(sh) = &s.layers[layer].mixer else { return Err(kind_err(layer)) };
                    let mut kb = caches.kda_load(be, r, layer)?;
                    let (p, changed) = kda_decode_batch(be, dims, sh, &xn, nb, &mut kb)?;
                    caches.kda_store(be, r, layer, &kb, &changed)?;
                    parts.push(p);
                }
                parts
            }
            LayerKind::Mla => mla_decode_batch(be, group, layer, &xn, positions, caches)?,
        };
        let sum = all_reduce(be, parts)?;
        be.add_inplace(&mut h, &sum)?;
        mlp_block(be, group, layer, &mut h, nb)?;
    }
    logits_rows(be, group, &h, nb)
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_kernels::{CpuBackend, SplitMix64};

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The units helper on chunked weights (the CPU's 64-row chunks, products of
    /// 2 and 1 chunks side by side) gives each product the bits of `matmul` on
    /// its block alone, laid side by side or stacked.
    #[test]
    fn units_of_chunked_weights_equal_each_product_alone() {
        let be = CpuBackend::new();
        let mut r = SplitMix64::new(7);
        let mut uni = |n: usize| (0..n).map(|_| r.next_f32() * 2.0 - 1.0).collect::<Vec<f32>>();
        let rows = 5;
        let dims = [(65usize, 9usize), (64, 9), (130, 9)];
        let x_width: usize = dims.iter().map(|d| d.0).sum();
        let x = uni(rows * x_width);
        let ws: Vec<Mat<CpuBackend>> = dims.iter().map(|&(k, c)| Mat::upload(&be, &uni(k * c), k, c).unwrap()).collect();
        assert!(ws.iter().any(|w| w.chunks.len() > 1), "the weights are chunked");
        let xb = be.upload(&x).unwrap();
        let (mut x_col, mut out_col) = (0, 0);
        let mut units = Vec::new();
        let mut alone = Vec::new();
        for (w, &(k, c)) in ws.iter().zip(&dims) {
            units.push((w, x_col, out_col));
            let block = take_cols(&be, &xb, rows, x_width, x_col, k).unwrap();
            alone.push(be.download(&matmul(&be, &block, w, rows).unwrap()).unwrap());
            x_col += k;
            out_col += c;
        }
        let width = out_col + 2;
        let side = matmul_units(&be, UnitsShape { rows, x_width, out: UnitsOut::Columns { width } }, &xb, &units).unwrap();
        let side = be.download(&side).unwrap();
        let stacked = matmul_units(&be, UnitsShape { rows, x_width, out: UnitsOut::Stacked }, &xb, &units).unwrap();
        let stacked = be.download(&stacked).unwrap();
        let mut at = 0;
        for (i, (a, &(_, c))) in alone.iter().zip(&dims).enumerate() {
            let cols: Vec<f32> = (0..rows).flat_map(|row| side[row * width + at..row * width + at + c].to_vec()).collect();
            assert_eq!(bits(&cols), bits(a), "product {i} side by side");
            assert_eq!(bits(&stacked[i * rows * c..(i + 1) * rows * c]), bits(a), "product {i} stacked");
            at += c;
        }
        assert!((0..rows).all(|row| side[row * width + at..(row + 1) * width].iter().all(|&v| v == 0.0)), "columns no product writes stay 0");
    }
}
