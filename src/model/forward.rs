//! The forward pass, written once for every placement: a TP group of rank shards
//! runs a range of layers; the caller decides where caches live (a sink for prefill,
//! a [`DecodeCaches`] for decode). The colocated reference is the same code with one
//! rank of all heads; the disaggregated run gives it prefill ranks and decode ranks.
//!
//! All-reduce: TP ranks' partial outputs (o_proj, MLP down) are summed in rank
//! order in-process. After an all-reduce every TP rank holds the same hidden state,
//! so the group keeps one copy of it.

use super::ModelError;
use super::dtype::round_to;
use super::weights::{Dims, KdaShard, LayerShard, MixerShard, MlaShard, Model, NORM_EPS, RankShard};
use handoff_components::vocab::LayerKind;
use handoff_kernels::{
    Backend, ColsCopy, ConvShape, CpuBackend, CpuBuf, CpuIBuf, EmbeddingShape, KdaInputs,
    KdaParams, KdaPrefillShape, KdaStepShape, MatmulShape, MergeShape, MlaShape,
    NormShape, ReplayShape, RowSet,
};
use std::ops::Range;

type R<T> = Result<T, ModelError>;

/// Inner-dimension chunk of [`matmul`]: the kernel's decode path sums chunks of 64
/// in whatever order its thread pool finishes them; summing our own chunks in order
/// keeps every product independent of thread timing and of row count.
const K_CHUNK: usize = 64;

fn matmul(be: &CpuBackend, x: &CpuBuf, w: &CpuBuf, rows: usize, inner: usize, cols: usize) -> R<CpuBuf> {
    let mut out = be.alloc(rows * cols)?;
    if inner <= K_CHUNK {
        be.matmul(MatmulShape { rows, inner, cols }, x, w, &mut out)?;
        return Ok(out);
    }
    let mut part = be.alloc(rows * cols)?;
    for k0 in (0..inner).step_by(K_CHUNK) {
        let kn = K_CHUNK.min(inner - k0);
        let xs = take_cols(be, x, rows, inner, k0, kn)?;
        let ws = CpuBuf::from_vec(w.as_slice()[k0 * cols..(k0 + kn) * cols].to_vec());
        be.matmul(MatmulShape { rows, inner: kn, cols }, &xs, &ws, &mut part)?;
        be.add_inplace(&mut out, &part)?;
    }
    Ok(out)
}

/// Per-head o_proj partials: head j's `[t, width]` columns of `y` times its rows.
fn per_head_out(be: &CpuBackend, y: &CpuBuf, wo: &[CpuBuf], t: usize, width: usize, hidden: usize) -> R<Vec<CpuBuf>> {
    let hl = wo.len();
    (0..hl)
        .map(|j| {
            let yj = take_cols(be, y, t, hl * width, j * width, width)?;
            matmul(be, &yj, &wo[j], t, width, hidden)
        })
        .collect()
}

fn take_cols(be: &CpuBackend, src: &CpuBuf, rows: usize, src_cols: usize, col: usize, width: usize) -> R<CpuBuf> {
    let mut out = be.alloc(rows * width)?;
    be.copy_cols(ColsCopy { rows, src_cols, src_col: col, dst_cols: width, dst_col: 0, width }, src, &mut out)?;
    Ok(out)
}

fn put_cols(be: &CpuBackend, src: &CpuBuf, rows: usize, dst: &mut CpuBuf, dst_cols: usize, col: usize) -> R<()> {
    let width = be.buf_len(src) / rows.max(1);
    be.copy_cols(ColsCopy { rows, src_cols: width, src_col: 0, dst_cols, dst_col: col, width }, src, dst)?;
    Ok(())
}

fn rms(be: &CpuBackend, x: &CpuBuf, w: &CpuBuf, rows: usize, dim: usize) -> R<CpuBuf> {
    let mut out = be.alloc(rows * dim)?;
    be.rms_norm(NormShape { rows, dim, eps: NORM_EPS }, x, w, &mut out)?;
    Ok(out)
}

/// The in-process all-reduce: every TP rank contributes its partial outputs, one
/// per reduction unit it holds (a head for o_proj, an MLP unit for the MLP), and
/// the units are summed one by one in global unit order. Ranks hold contiguous unit
/// ranges, so rank-major order is global order, and the sum is the same bits for
/// every TP degree (TP1 included).
pub fn all_reduce(be: &CpuBackend, partials: Vec<Vec<CpuBuf>>) -> R<CpuBuf> {
    let mut units = partials.into_iter().flatten();
    let mut acc = units.next().ok_or_else(|| ModelError::Config("all-reduce over zero units".into()))?;
    for p in units {
        be.add_inplace(&mut acc, &p)?;
    }
    Ok(acc)
}

/// Embeds byte tokens: `[T, hidden]`.
pub fn embed(be: &CpuBackend, model: &Model, tokens: &[u8]) -> R<CpuBuf> {
    let d = model.dims.hidden;
    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    let ids = be.upload_i32(&ids)?;
    let mut out = be.alloc(tokens.len() * d)?;
    be.embedding(EmbeddingShape { tokens: tokens.len(), vocab: model.dims.vocab, dim: d }, &model.embed, &ids, &mut out)?;
    Ok(out)
}

/// Final norm and LM head of the last row of `h` `[T, hidden]`: the logits and the greedy pick.
pub fn logits_of_last(be: &CpuBackend, model: &Model, h: &CpuBuf, tokens: usize) -> R<(Vec<f32>, u8)> {
    let d = model.dims.hidden;
    let last = CpuBuf::from_vec(h.as_slice()[(tokens - 1) * d..tokens * d].to_vec());
    let xn = rms(be, &last, &model.final_norm, 1, d)?;
    let logits = matmul(be, &xn, &model.lm_head, 1, d, model.dims.vocab)?;
    let mut pick = be.alloc_i32(1)?;
    be.argmax(1, model.dims.vocab, &logits, &mut pick)?;
    let tok = be.download_i32(&pick)?[0];
    Ok((be.download(&logits)?, tok.clamp(0, 255) as u8))
}

// ---- KDA ----------------------------------------------------------------------

/// What a KDA layer leaves in the caches of one rank after prefill.
#[derive(Debug, Clone)]
pub struct KdaCache {
    /// Recurrent state `[hl, Dk, Dv]` f32: the state after the prompt, or, when
    /// `records` holds the last r tokens, the state before them (S_{T-r}).
    pub state: Vec<f32>,
    /// Conv state `[W-1, C]` (q | k | v channels), rounded to the model dtype.
    pub conv: Vec<f32>,
    /// ReplaySSM records `[r, hl, 2Dk+Dv]` of the prompt's last r tokens.
    pub records: Vec<f32>,
    pub record_tokens: usize,
}

/// The per-token KDA inputs of one rank before the recurrence: q, k, v after the
/// short conv, g and beta logits.
struct KdaIn {
    q: CpuBuf,
    k: CpuBuf,
    v: CpuBuf,
    g: CpuBuf,
    b: CpuBuf,
}

fn kda_split(be: &CpuBackend, dims: &Dims, sh: &KdaShard, xn: &CpuBuf, conv_out: &CpuBuf, t: usize) -> R<KdaIn> {
    let (hl, dk, dv, d) = (sh.heads, dims.dk, dims.dv, dims.hidden);
    let c = dims.conv_channels(hl);
    Ok(KdaIn {
        q: take_cols(be, conv_out, t, c, 0, hl * dk)?,
        k: take_cols(be, conv_out, t, c, hl * dk, hl * dk)?,
        v: take_cols(be, conv_out, t, c, 2 * hl * dk, hl * dv)?,
        g: matmul(be, xn, &sh.wg, t, d, hl * dk)?,
        b: matmul(be, xn, &sh.wb, t, d, hl)?,
    })
}

fn kda_output(be: &CpuBackend, dims: &Dims, sh: &KdaShard, xn: &CpuBuf, o: &CpuBuf, t: usize) -> R<Vec<CpuBuf>> {
    let (hl, dv, d) = (sh.heads, dims.dv, dims.hidden);
    let gate = matmul(be, xn, &sh.wgate, t, d, hl * dv)?;
    let mut y = be.alloc(t * hl * dv)?;
    be.gated_rms_norm(NormShape { rows: t * hl, dim: dv, eps: NORM_EPS }, o, &gate, &sh.onorm, &mut y)?;
    per_head_out(be, &y, &sh.wo, t, dv, d)
}

fn rows_of(buf: &CpuBuf, r: Range<usize>, width: usize) -> CpuBuf {
    CpuBuf::from_vec(buf.as_slice()[r.start * width..r.end * width].to_vec())
}

/// KDA prefill of one rank's heads over `t` tokens from zero state. With
/// `record_tail` = r > 0 the last r tokens run as a second chunked pass that emits
/// ReplaySSM records, and the cached state is the one before them.
pub fn kda_prefill(be: &CpuBackend, dims: &Dims, sh: &KdaShard, xn: &CpuBuf, t: usize, record_tail: usize) -> R<(Vec<CpuBuf>, KdaCache)> {
    let (hl, dk, dv, d) = (sh.heads, dims.dk, dims.dv, dims.hidden);
    let c = dims.conv_channels(hl);
    let qkv = matmul(be, xn, &sh.wqkv, t, d, c)?;
    let mut conv_state = be.alloc((dims.conv - 1) * c)?;
    let mut conv_out = be.alloc(t * c)?;
    be.conv_prefill(ConvShape { channels: c, width: dims.conv }, t, &qkv, &sh.conv, &mut conv_state, &mut conv_out)?;
    let mut conv = be.download(&conv_state)?;
    round_to(dims.dtype, &mut conv);
    let x = kda_split(be, dims, sh, xn, &conv_out, t)?;
    let params = KdaParams { a_log: &sh.a_log, dt_bias: &sh.dt_bias };
    let mut state = be.alloc(hl * dk * dv)?;
    let tail = record_tail.min(t);
    let mut o = be.alloc(t * hl * dv)?;
    let mut cached_state = None;
    let mut records = Vec::new();
    let mut pieces = vec![(0..t - tail, false)];
    if tail > 0 {
        pieces.push((t - tail..t, true));
    }
    for (range, record) in pieces {
        if range.is_empty() {
            if record {
                cached_state = Some(be.download(&state)?);
            }
            continue;
        }
        let n = range.len();
        if record {
            cached_state = Some(be.download(&state)?);
        }
        let (q, k, v) = (rows_of(&x.q, range.clone(), hl * dk), rows_of(&x.k, range.clone(), hl * dk), rows_of(&x.v, range.clone(), hl * dv));
        let (g, b) = (rows_of(&x.g, range.clone(), hl * dk), rows_of(&x.b, range.clone(), hl));
        let mut out = be.alloc(n * hl * dv)?;
        let mut rec = if record { Some(be.alloc(n * hl * dims.record_width())?) } else { None };
        be.kda_prefill(
            KdaPrefillShape { tokens: n, heads: hl, dk, dv },
            &mut state,
            KdaInputs { q: &q, k: &k, v: &v, g_raw: &g, b_raw: &b },
            params,
            &mut out,
            rec.as_mut(),
        )?;
        be.copy(&out, 0, &mut o, range.start * hl * dv, n * hl * dv)?;
        if let Some(r) = rec {
            records = be.download(&r)?;
        }
    }
    let state = match cached_state {
        Some(s) => s,
        None => be.download(&state)?,
    };
    let partial = kda_output(be, dims, sh, xn, &o, t)?;
    Ok((partial, KdaCache { state, conv, records, record_tokens: tail }))
}

/// One KDA decode step of one rank: `state` `[hl, Dk, Dv]` and `conv` `[W-1, C]`
/// are updated in place (conv rounded to the model dtype, as it is stored).
pub fn kda_decode(
    be: &CpuBackend,
    dims: &Dims,
    sh: &KdaShard,
    xn: &CpuBuf,
    state: &mut CpuBuf,
    conv: &mut CpuBuf,
    record: Option<&mut CpuBuf>,
) -> R<Vec<CpuBuf>> {
    let (hl, dk, dv, d) = (sh.heads, dims.dk, dims.dv, dims.hidden);
    let c = dims.conv_channels(hl);
    let qkv = matmul(be, xn, &sh.wqkv, 1, d, c)?;
    let mut conv_out = be.alloc(c)?;
    be.conv_step(ConvShape { channels: c, width: dims.conv }, 1, &qkv, &sh.conv, conv, &mut conv_out)?;
    round_to(dims.dtype, conv.as_mut_slice());
    let x = kda_split(be, dims, sh, xn, &conv_out, 1)?;
    let mut o = be.alloc(hl * dv)?;
    be.kda_step(
        KdaStepShape { batch: 1, heads: hl, dk, dv },
        state,
        KdaInputs { q: &x.q, k: &x.k, v: &x.v, g_raw: &x.g, b_raw: &x.b },
        KdaParams { a_log: &sh.a_log, dt_bias: &sh.dt_bias },
        &mut o,
        record,
    )?;
    kda_output(be, dims, sh, xn, &o, 1)
}

// ---- MLA ----------------------------------------------------------------------

/// The cached rows of `t` tokens `[t, L+R]`: RMSNorm'd latent, then the NoPE part;
/// rounded to the model dtype. Replicated over TP: every rank computes the same.
pub fn mla_rows(be: &CpuBackend, dims: &Dims, sh: &MlaShard, xn: &CpuBuf, t: usize) -> R<CpuBuf> {
    let (l, w) = (dims.kv_lora_rank, dims.row_width());
    let mut kv = matmul(be, xn, &sh.wkva, t, dims.hidden, w)?;
    let lat = take_cols(be, &kv, t, w, 0, l)?;
    let lat = rms(be, &lat, &sh.kv_norm, t, l)?;
    put_cols(be, &lat, t, &mut kv, w, 0)?;
    round_to(dims.dtype, kv.as_mut_slice());
    Ok(kv)
}

/// Absorbed queries of one rank's heads: `[t, hl, L+R]` = [q_nope W_UK | q_rope].
pub fn mla_q_lat(be: &CpuBackend, dims: &Dims, sh: &MlaShard, xn: &CpuBuf, t: usize) -> R<CpuBuf> {
    let (l, r, dn, w) = (dims.kv_lora_rank, dims.rope_dim, dims.nope_dim, dims.row_width());
    let hl = sh.heads;
    let qw = dn + r;
    let q = matmul(be, xn, &sh.wq, t, dims.hidden, hl * qw)?;
    let mut q_lat = be.alloc(t * hl * w)?;
    for h in 0..hl {
        let nope = take_cols(be, &q, t, hl * qw, h * qw, dn)?;
        let lat = matmul(be, &nope, &sh.wuk[h], t, dn, l)?;
        put_cols(be, &lat, t, &mut q_lat, hl * w, h * w)?;
        if r > 0 {
            let rope = take_cols(be, &q, t, hl * qw, h * qw + dn, r)?;
            put_cols(be, &rope, t, &mut q_lat, hl * w, h * w + l)?;
        }
    }
    Ok(q_lat)
}

/// W_UV per head on the latent output `[t, hl, L]`, then the rank's o_proj rows.
pub fn mla_out(be: &CpuBackend, dims: &Dims, sh: &MlaShard, o_lat: &CpuBuf, t: usize) -> R<Vec<CpuBuf>> {
    let (l, dvh) = (dims.kv_lora_rank, dims.v_head_dim);
    let hl = sh.heads;
    let mut y = be.alloc(t * hl * dvh)?;
    for h in 0..hl {
        let oh = take_cols(be, o_lat, t, hl * l, h * l, l)?;
        let vh = matmul(be, &oh, &sh.wuv[h], t, l, dvh)?;
        put_cols(be, &vh, t, &mut y, hl * dvh, h * dvh)?;
    }
    per_head_out(be, &y, &sh.wo, t, dvh, dims.hidden)
}

/// One DCP rank's share of absorbed MLA decode: the f64 partials `[heads, 2+L]`
/// of queries `q_lat` `[heads, L+R]` over the rank's `n` cached rows.
pub fn mla_partial(be: &CpuBackend, shape: MlaShape, q_lat: &CpuBuf, rows: &CpuBuf, n: usize) -> R<Vec<f64>> {
    let mut p = be.alloc_f64(shape.heads * handoff_kernels::mla_partial_width(shape.kv_lora_rank))?;
    be.mla_decode_partial(shape, q_lat, RowSet { buf: rows, count: n }, &mut p)?;
    Ok(be.download_f64(&p)?)
}

/// Merges the partials of `shards` DCP ranks (`[shards, heads, 2+L]`, rank-major)
/// into the latent outputs `[heads, L]`. The merge is f64 and rounds once at the
/// end, so the result does not depend on how the tokens were sharded: one shard
/// (the colocated run) and any DCP degree agree bit for bit in practice.
pub fn mla_merge(be: &CpuBackend, shape: MlaShape, shards: usize, partials: &[f64]) -> R<CpuBuf> {
    let (h, l) = (shape.heads, shape.kv_lora_rank);
    let mut o = be.alloc(h * l)?;
    let mut lse = be.alloc(h)?;
    be.dcp_merge_partials(MergeShape { shards, heads: h, width: l }, &be.upload_f64(partials)?, &mut o, &mut lse)?;
    Ok(o)
}

pub fn mla_shape(dims: &Dims, heads: usize) -> MlaShape {
    MlaShape { heads, kv_lora_rank: dims.kv_lora_rank, rope_dim: dims.rope_dim, scale: dims.mla_scale() }
}

/// The rank's MLP partials, one per unit: down(silu(gate x) * up x).
fn mlp(be: &CpuBackend, dims: &Dims, ls: &LayerShard, xn: &CpuBuf, t: usize) -> R<Vec<CpuBuf>> {
    let d = dims.hidden;
    ls.mlp
        .iter()
        .map(|u| {
            let g = matmul(be, xn, &u.gate, t, d, u.width)?;
            let up = matmul(be, xn, &u.up, t, d, u.width)?;
            let act: Vec<f32> =
                g.as_slice().iter().zip(up.as_slice()).map(|(&a, &b)| a / (1.0 + (-a).exp()) * b).collect();
            matmul(be, &CpuBuf::from_vec(act), &u.down, t, u.width, d)
        })
        .collect()
}

fn mlp_block(be: &CpuBackend, dims: &Dims, group: &[RankShard], layer: usize, h: &mut CpuBuf, t: usize) -> R<()> {
    let xn = rms(be, h, &group[0].layers[layer].mlp_norm, t, dims.hidden)?;
    let parts = group.iter().map(|s| mlp(be, dims, &s.layers[layer], &xn, t)).collect::<R<Vec<_>>>()?;
    let sum = all_reduce(be, parts)?;
    be.add_inplace(h, &sum)?;
    Ok(())
}

// ---- drivers ------------------------------------------------------------------

/// A cache a prefill rank produced for one layer.
pub enum PrefillCache<'a> {
    Kda(&'a KdaCache),
    /// MLA rows `[T, L+R]`, rounded to the model dtype.
    Mla(&'a [f32]),
}

#[allow(clippy::too_many_arguments)]
/// Prefill of `layers` by one TP group over `h` `[t, hidden]` (updated in place).
/// `sink(tp_rank, layer, cache)` stores what each rank caches.
pub fn prefill_layers(
    be: &CpuBackend,
    model: &Model,
    group: &[RankShard],
    layers: Range<usize>,
    h: &mut CpuBuf,
    t: usize,
    record_tail: usize,
    sink: &mut dyn FnMut(usize, usize, PrefillCache<'_>) -> R<()>,
) -> R<()> {
    let dims = &model.dims;
    for layer in layers {
        let xn = rms(be, h, &group[0].layers[layer].attn_norm, t, dims.hidden)?;
        let mut parts = Vec::with_capacity(group.len());
        match dims.layer_kinds[layer] {
            LayerKind::Kda => {
                for (r, s) in group.iter().enumerate() {
                    let MixerShard::Kda(sh) = &s.layers[layer].mixer else { return Err(kind_err(layer)) };
                    let (p, cache) = kda_prefill(be, dims, sh, &xn, t, record_tail)?;
                    sink(r, layer, PrefillCache::Kda(&cache))?;
                    parts.push(p);
                }
            }
            LayerKind::Mla => {
                let MixerShard::Mla(sh0) = &group[0].layers[layer].mixer else { return Err(kind_err(layer)) };
                let rows = mla_rows(be, dims, sh0, &xn, t)?;
                for (r, s) in group.iter().enumerate() {
                    let MixerShard::Mla(sh) = &s.layers[layer].mixer else { return Err(kind_err(layer)) };
                    sink(r, layer, PrefillCache::Mla(rows.as_slice()))?;
                    let q_lat = mla_q_lat(be, dims, sh, &xn, t)?;
                    let mut o = be.alloc(t * sh.heads * dims.kv_lora_rank)?;
                    be.mla_prefill(mla_shape(dims, sh.heads), t, &q_lat, RowSet { buf: &rows, count: t }, &mut o, None)?;
                    parts.push(mla_out(be, dims, sh, &o, t)?);
                }
            }
        }
        let sum = all_reduce(be, parts)?;
        be.add_inplace(h, &sum)?;
        mlp_block(be, dims, group, layer, h, t)?;
    }
    Ok(())
}

fn kind_err(layer: usize) -> ModelError {
    ModelError::Config(format!("layer {layer}: shard kind does not match the pattern"))
}

/// The step a [`DecodeCaches::kda`] call runs on one rank's state, conv state and
/// optional record buffer.
pub type KdaStepFn<'a> = dyn FnMut(&mut CpuBuf, &mut CpuBuf, Option<&mut CpuBuf>) -> R<()> + 'a;

/// One ReplaySSM decode step of one rank's KDA heads, the same on every placement
/// (ReplaySSM is part of decode, so the colocated run keeps the same ring): the
/// current state is rebuilt from the committed state `committed` and the `cursor`
/// records of `ring` (`replay_commit` on a copy), `step` advances it and writes
/// the token's record, which is appended; when the ring is full the records are
/// committed in place (`committed` := rebuilt state, cursor 0). Per head the
/// arithmetic depends only on that head's data, so the TP head split does not
/// change it. Returns whether it committed.
pub fn replay_step(
    be: &CpuBackend,
    shape: ReplayShape,
    committed: &mut CpuBuf,
    ring: &mut CpuBuf,
    cursor: &mut CpuIBuf,
    conv: &mut CpuBuf,
    step: &mut KdaStepFn<'_>,
) -> R<bool> {
    let mut current = committed.clone();
    let mut scratch = cursor.clone();
    be.replay_commit(shape, &mut current, ring, &mut scratch)?;
    let mut record = be.alloc(shape.heads * handoff_kernels::replay_record_width(shape.dk, shape.dv))?;
    step(&mut current, conv, Some(&mut record))?;
    be.replay_append(shape, 1, ring, cursor, &record)?;
    if be.download_i32(cursor)?.first().is_some_and(|&c| c as usize >= shape.capacity) {
        be.replay_commit(shape, committed, ring, cursor)?;
        return Ok(true);
    }
    Ok(false)
}

/// Where a decode TP group keeps its caches.
pub trait DecodeCaches {
    /// Runs `step` on TP rank `rank`'s KDA state `[hl, Dk, Dv]` and conv state of
    /// `layer`, with a record buffer `[hl, 2Dk+Dv]` when the caches keep ReplaySSM
    /// records, and stores what it leaves.
    fn kda(
        &mut self,
        rank: usize,
        layer: usize,
        step: &mut KdaStepFn<'_>,
    ) -> R<()>;
    /// Appends the cached row of position `pos` for `layer`.
    fn mla_append(&mut self, layer: usize, pos: usize, row: &[f32]) -> R<()>;
    /// Attention of every rank's absorbed queries (`q_lat[r]` `[hl, L+R]`) over
    /// positions `0..=pos`: the latent outputs `[hl, L]` per rank.
    fn mla_attend(&mut self, layer: usize, pos: usize, q_lat: &[CpuBuf]) -> R<Vec<CpuBuf>>;
}

/// One decode step of one TP group: token `token` at position `pos`. Returns the
/// logits and the greedy pick.
pub fn decode_step(
    be: &CpuBackend,
    model: &Model,
    group: &[RankShard],
    token: u8,
    pos: usize,
    caches: &mut dyn DecodeCaches,
) -> R<(Vec<f32>, u8)> {
    let dims = &model.dims;
    let mut h = embed(be, model, &[token])?;
    for layer in 0..dims.num_layers() {
        let xn = rms(be, &h, &group[0].layers[layer].attn_norm, 1, dims.hidden)?;
        let mut parts = Vec::with_capacity(group.len());
        match dims.layer_kinds[layer] {
            LayerKind::Kda => {
                for (r, s) in group.iter().enumerate() {
                    let MixerShard::Kda(sh) = &s.layers[layer].mixer else { return Err(kind_err(layer)) };
                    let mut out = None;
                    caches.kda(r, layer, &mut |state, conv, rec| {
                        out = Some(kda_decode(be, dims, sh, &xn, state, conv, rec)?);
                        Ok(())
                    })?;
                    parts.push(out.ok_or_else(|| ModelError::Config("kda cache did not run the step".into()))?);
                }
            }
            LayerKind::Mla => {
                let MixerShard::Mla(sh0) = &group[0].layers[layer].mixer else { return Err(kind_err(layer)) };
                let row = mla_rows(be, dims, sh0, &xn, 1)?;
                caches.mla_append(layer, pos, row.as_slice())?;
                let mut q = Vec::with_capacity(group.len());
                for s in group {
                    let MixerShard::Mla(sh) = &s.layers[layer].mixer else { return Err(kind_err(layer)) };
                    q.push(mla_q_lat(be, dims, sh, &xn, 1)?);
                }
                let o = caches.mla_attend(layer, pos, &q)?;
                for (s, o) in group.iter().zip(&o) {
                    let MixerShard::Mla(sh) = &s.layers[layer].mixer else { return Err(kind_err(layer)) };
                    parts.push(mla_out(be, dims, sh, o, 1)?);
                }
            }
        }
        let sum = all_reduce(be, parts)?;
        be.add_inplace(&mut h, &sum)?;
        mlp_block(be, dims, group, layer, &mut h, 1)?;
    }
    logits_of_last(be, model, &h, 1)
}
