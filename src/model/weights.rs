//! The small hybrid model: dimensions from the topology's `[model]` table, seeded
//! weights, and their tensor-parallel shards.

use super::ModelError;
use handoff_components::Topology;
use handoff_components::vocab::{Dtype, LayerKind};
use handoff_kernels::step::WeightDtype;
use handoff_kernels::{Backend, SplitMix64};
use std::ops::Range;

/// Inner-dimension chunk of the model's matmuls: the kernel's decode path sums chunks of 64
/// in whatever order its thread pool finishes them, and picks a different loop for
/// many rows; calling it on one chunk at a time and summing our own chunks in
/// order keeps every product independent of thread timing and of row count (the
/// batch size). Weights are held in chunks of this many rows ([`Mat`]).
pub const K_CHUNK: usize = 64;

/// Every TP rank's weights of one group, plus the replicated embedding, final
/// norm and LM head, as backend buffers ([`super::Model::upload_group`]).
pub struct ShardGroup<B: Backend> {
    pub dims: Dims,
    /// TP rank r's shard at index r.
    pub ranks: Vec<RankShard<B>>,
    /// `[vocab, hidden]`.
    pub embed: B::Buf,
    /// `[hidden]`.
    pub final_norm: B::Buf,
    /// `[hidden, vocab]`.
    pub lm_head: Mat<B>,
}

impl<B: Backend> ShardGroup<B> {
    /// TP degree of the group.
    pub fn tp(&self) -> usize {
        self.ranks.len()
    }
}

/// Byte-level vocabulary.
pub const VOCAB: usize = 256;
/// Epsilon of every RMSNorm (and of the KDA output norm).
pub const NORM_EPS: f32 = 1e-6;
/// Largest model the CPU compute path builds: f32 weights of at most 4 GiB
/// (the verification holds them two or three times over: the model, the
/// reference's shard and the ranks' shards).
pub const MAX_WEIGHT_BYTES: u64 = 4 << 30;

/// Every dimension the compute needs, read once from the topology.
#[derive(Debug, Clone, PartialEq)]
pub struct Dims {
    pub hidden: usize,
    pub vocab: usize,
    pub intermediate: usize,
    pub dtype: Dtype,
    pub layer_kinds: Vec<LayerKind>,
    /// KDA heads (H), key and value widths per head, conv kernel width.
    pub kda_heads: usize,
    pub dk: usize,
    pub dv: usize,
    pub conv: usize,
    /// MLA query heads, latent width L, rope (NoPE) width R, per-head nope and value widths.
    pub mla_heads: usize,
    pub kv_lora_rank: usize,
    pub rope_dim: usize,
    pub nope_dim: usize,
    pub v_head_dim: usize,
    /// ReplaySSM ring capacity, when configured.
    pub replay: Option<usize>,
    /// How the dense products hold their weights (`[model] weight_dtype`).
    pub weight_dtype: WeightDtype,
}

impl Dims {
    pub fn from_topology(topo: &Topology) -> Dims {
        let m = topo.model();
        let hidden = m.hidden_size as usize;
        Dims {
            hidden,
            vocab: VOCAB,
            intermediate: m.intermediate_size.map_or(2 * hidden, |i| i as usize),
            dtype: m.dtype,
            layer_kinds: topo.layer_kinds.clone(),
            kda_heads: m.kda.heads as usize,
            dk: m.kda.head_k_dim as usize,
            dv: m.kda.head_v_dim as usize,
            conv: m.kda.conv_kernel as usize,
            mla_heads: m.mla.heads as usize,
            kv_lora_rank: m.mla.kv_lora_rank as usize,
            rope_dim: m.mla.rope_dim as usize,
            nope_dim: m.mla.nope_head_dim as usize,
            v_head_dim: m.mla.v_head_dim as usize,
            replay: m.replay.as_ref().map(|r| r.capacity as usize),
            weight_dtype: match m.weight_dtype {
                Dtype::Bf16 => WeightDtype::Bf16,
                _ => WeightDtype::F32,
            },
        }
    }

    /// Width of one cached MLA row: L + R.
    pub fn row_width(&self) -> usize {
        self.kv_lora_rank + self.rope_dim
    }
    /// Conv channels of a rank holding `hl` KDA heads: q | k | v.
    pub fn conv_channels(&self, hl: usize) -> usize {
        hl * (2 * self.dk + self.dv)
    }
    /// Width of one ReplaySSM record of one head: k^, u, g.
    pub fn record_width(&self) -> usize {
        2 * self.dk + self.dv
    }
    /// Absorbed MLA softmax scale, (nope + rope)^-1/2.
    pub fn mla_scale(&self) -> f32 {
        1.0 / ((self.nope_dim + self.rope_dim) as f32).sqrt()
    }
    /// Reduction units of the MLP: the gcd of the head counts of the layer kinds
    /// the model has. Every TP degree the attention admits divides both head
    /// counts, hence the gcd, so every rank holds whole units; and the
    /// decomposition depends on the model only, so the all-reduce sums the same
    /// units in the same order at every TP degree.
    pub fn mlp_units(&self) -> usize {
        let kda = if self.layer_kinds.contains(&LayerKind::Kda) { self.kda_heads } else { 0 };
        let mla = if self.layer_kinds.contains(&LayerKind::Mla) { self.mla_heads } else { 0 };
        gcd(kda, mla).max(1)
    }
    /// The intermediate channels of MLP unit `u`: `intermediate` split into
    /// [`Dims::mlp_units`] contiguous ranges whose widths differ by at most one
    /// (the first `intermediate % units` are one wider). A unit may be empty when
    /// the intermediate size is below the unit count.
    pub fn mlp_unit(&self, u: usize) -> Range<usize> {
        let units = self.mlp_units();
        let (q, r) = (self.intermediate / units, self.intermediate % units);
        let start = u * q + u.min(r);
        start..start + q + usize::from(u < r)
    }
    pub fn num_layers(&self) -> usize {
        self.layer_kinds.len()
    }
    /// f32 bytes of the full (unsharded) weights, computed without overflow.
    pub fn weight_bytes(&self) -> u128 {
        let (d, i) = (self.hidden as u128, self.intermediate as u128);
        let (h, dk, dv, w) = (self.kda_heads as u128, self.dk as u128, self.dv as u128, self.conv as u128);
        let (hm, l, r, dn, dvh) = (self.mla_heads as u128, self.kv_lora_rank as u128, self.rope_dim as u128, self.nope_dim as u128, self.v_head_dim as u128);
        let c = h * (2 * dk + dv);
        let kda = d * c + c * w + d * h * dk + d * h + h + h * dk + d * h * dv + dv + h * dv * d;
        let mla = d * (l + r) + l + d * hm * (dn + r) + hm * dn * l + hm * l * dvh + hm * dvh * d;
        let common = 2 * d + 3 * d * i;
        let layers: u128 = self.layer_kinds.iter().map(|k| common + if *k == LayerKind::Kda { kda } else { mla }).sum();
        4 * (layers + 2 * self.vocab as u128 * d + d)
    }
    /// ReplaySSM records prefill leaves for decode to replay over a prompt of
    /// `tokens`: half the ring, at most the prompt (0 without replay).
    pub fn record_tail(&self, tokens: usize) -> usize {
        self.replay.map_or(0, |cap| (cap / 2).min(tokens))
    }
}

/// Full (unsharded) weights of one KDA layer. Matrices are `[in, out]`, row-major.
#[derive(Debug, Clone)]
pub struct KdaWeights {
    /// q | k | v projections fused: `[hidden, H*Dk + H*Dk + H*Dv]`.
    pub wqkv: Vec<f32>,
    /// Depthwise conv `[C, W]` over the same channel order as `wqkv`.
    pub conv: Vec<f32>,
    /// Decay logits `[hidden, H*Dk]`, beta logits `[hidden, H]`.
    pub wg: Vec<f32>,
    pub wb: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// Output gate `[hidden, H*Dv]`, gated RMSNorm weight `[Dv]` (shared by heads).
    pub wgate: Vec<f32>,
    pub onorm: Vec<f32>,
    /// `[H*Dv, hidden]`.
    pub wo: Vec<f32>,
}

/// Full weights of one MLA layer.
#[derive(Debug, Clone)]
pub struct MlaWeights {
    /// `[hidden, L + R]`: latent then rope (NoPE) part of the cached row.
    pub wkva: Vec<f32>,
    /// RMSNorm of the latent part `[L]`.
    pub kv_norm: Vec<f32>,
    /// `[hidden, Hm * (nope + R)]`, per head nope then rope.
    pub wq: Vec<f32>,
    /// `[Hm, nope, L]`: absorbed into the query.
    pub wuk: Vec<f32>,
    /// `[Hm, L, v_head_dim]`: applied to the latent output.
    pub wuv: Vec<f32>,
    /// `[Hm * v_head_dim, hidden]`.
    pub wo: Vec<f32>,
}

#[derive(Debug, Clone)]
pub enum Mixer {
    Kda(KdaWeights),
    Mla(MlaWeights),
}

#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub mlp_norm: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
    pub mixer: Mixer,
}

/// The whole model, unsharded, in host memory. Every rank derives its shard from
/// this, so every rank sees the same numbers for the same seed; the forward pass
/// runs on the backend buffers of [`Model::upload_group`].
#[derive(Debug, Clone)]
pub struct Model {
    pub dims: Dims,
    /// `[vocab, hidden]`.
    pub embed: Vec<f32>,
    pub layers: Vec<LayerWeights>,
    /// `[hidden]`.
    pub final_norm: Vec<f32>,
    /// `[hidden, vocab]`.
    pub lm_head: Vec<f32>,
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn normal(seed: u64, stream: u64, n: usize, fan_in: usize) -> Vec<f32> {
    SplitMix64::with_stream(seed, stream).vec_normal(n, 1.0 / (fan_in.max(1) as f32).sqrt())
}

fn around(seed: u64, stream: u64, n: usize, center: f32, spread: f32) -> Vec<f32> {
    SplitMix64::with_stream(seed, stream).vec_uniform(n, center - spread, center + spread)
}

impl Dims {
    /// The topology's dimensions, refused (naming the values) when the weights
    /// would not fit the compute path or the MLP is empty.
    pub fn checked(topo: &Topology) -> Result<Dims, ModelError> {
        let dims = Dims::from_topology(topo);
        let bytes = dims.weight_bytes();
        if bytes > MAX_WEIGHT_BYTES as u128 {
            return Err(ModelError::Config(format!(
                "model {:?} is too large for the CPU compute path: its f32 weights would take {:.1} GiB \
                 (hidden_size {}, {} layers, {} KDA heads of {}x{}, {} MLA heads), over the limit of {} GiB",
                topo.model().name,
                bytes as f64 / (1u64 << 30) as f64,
                dims.hidden,
                dims.num_layers(),
                dims.kda_heads,
                dims.dk,
                dims.dv,
                dims.mla_heads,
                MAX_WEIGHT_BYTES >> 30
            )));
        }
        if dims.intermediate == 0 {
            return Err(ModelError::Config("model.intermediate_size must be at least 1".into()));
        }
        Ok(dims)
    }
}

impl Model {
    /// Seeded weights of `dims`: each tensor draws from its own SplitMix64
    /// stream (layer x 32 + tensor), N(0, 1/sqrt(fan_in)), rounded as the
    /// products use them ([`Model::round_weights`]).
    pub fn seeded(dims: Dims, seed: u64) -> Model {
        let d = dims.hidden;
        let (h, dk, dv) = (dims.kda_heads, dims.dk, dims.dv);
        let (hm, l, r, dn, dvh) = (dims.mla_heads, dims.kv_lora_rank, dims.rope_dim, dims.nope_dim, dims.v_head_dim);
        let mut layers = Vec::with_capacity(dims.num_layers());
        for (i, kind) in dims.layer_kinds.iter().enumerate() {
            let s = |t: u64| 1000 + i as u64 * 32 + t;
            let mixer = match kind {
                LayerKind::Kda => {
                    let c = h * (2 * dk + dv);
                    Mixer::Kda(KdaWeights {
                        wqkv: normal(seed, s(0), d * c, d),
                        conv: normal(seed, s(1), c * dims.conv, dims.conv),
                        wg: normal(seed, s(2), d * h * dk, d),
                        wb: normal(seed, s(3), d * h, d),
                        // Decays of about exp(-0.05) .. exp(-0.5) per token: a memory of
                        // tens of tokens, so the state carries the prompt into decode.
                        a_log: around(seed, s(4), h, -0.5, 0.5),
                        dt_bias: around(seed, s(5), h * dk, -2.0, 0.5),
                        wgate: normal(seed, s(6), d * h * dv, d),
                        onorm: around(seed, s(7), dv, 1.0, 0.1),
                        wo: normal(seed, s(8), h * dv * d, h * dv),
                    })
                }
                LayerKind::Mla => Mixer::Mla(MlaWeights {
                    wkva: normal(seed, s(0), d * (l + r), d),
                    kv_norm: around(seed, s(1), l, 1.0, 0.1),
                    wq: normal(seed, s(2), d * hm * (dn + r), d),
                    wuk: normal(seed, s(3), hm * dn * l, dn),
                    wuv: normal(seed, s(4), hm * l * dvh, l),
                    wo: normal(seed, s(5), hm * dvh * d, hm * dvh),
                }),
            };
            layers.push(LayerWeights {
                attn_norm: around(seed, s(20), d, 1.0, 0.1),
                mlp_norm: around(seed, s(21), d, 1.0, 0.1),
                gate: normal(seed, s(22), d * dims.intermediate, d),
                up: normal(seed, s(23), d * dims.intermediate, d),
                down: normal(seed, s(24), dims.intermediate * d, dims.intermediate),
                mixer,
            });
        }
        let mut model = Model {
            embed: SplitMix64::with_stream(seed, 1).vec_normal(VOCAB * d, 1.0),
            final_norm: around(seed, 2, d, 1.0, 0.1),
            lm_head: normal(seed, 3, d * VOCAB, d),
            layers,
            dims,
        };
        model.round_weights();
        model
    }

    /// Rounds every dense product's weights to what a device multiplies by
    /// under `[model] weight_dtype` ([`WeightDtype::round`]: bf16, or an f32
    /// weight's bf16 pair), so the CPU reference and the GPU use the same
    /// numbers. Embedding, norms, conv and the KDA decay parameters are not
    /// products and stay f32.
    pub fn round_weights(&mut self) {
        let wd = self.dims.weight_dtype;
        let round = |w: &mut Vec<f32>| w.iter_mut().for_each(|x| *x = wd.round(*x));
        for l in &mut self.layers {
            for w in [&mut l.gate, &mut l.up, &mut l.down] {
                round(w);
            }
            match &mut l.mixer {
                Mixer::Kda(k) => {
                    for w in [&mut k.wqkv, &mut k.wg, &mut k.wb, &mut k.wgate, &mut k.wo] {
                        round(w);
                    }
                }
                Mixer::Mla(a) => {
                    for w in [&mut a.wkva, &mut a.wq, &mut a.wuk, &mut a.wuv, &mut a.wo] {
                        round(w);
                    }
                }
            }
        }
        round(&mut self.lm_head);
    }

    /// Refuses a TP degree the heads cannot be split over (naming the heads).
    pub fn check_tp(&self, tp: usize) -> Result<(), ModelError> {
        let d = &self.dims;
        let has = |k| d.layer_kinds.contains(&k);
        for (what, n) in
            [("model.kda.heads", if has(LayerKind::Kda) { d.kda_heads } else { 0 }), ("model.mla.heads", if has(LayerKind::Mla) { d.mla_heads } else { 0 })]
        {
            if tp == 0 || n % tp != 0 {
                return Err(ModelError::Config(format!("{what} = {n} cannot be split over tp {tp}")));
            }
        }
        // tp divides every head count present, hence their gcd: whole MLP units.
        debug_assert!(d.mlp_units().is_multiple_of(tp));
        Ok(())
    }

    /// The weights of every rank of a TP group of `tp` ranks, plus the replicated
    /// embedding, final norm and LM head, as backend buffers.
    pub fn upload_group<B: Backend>(&self, be: &B, tp: usize) -> Result<ShardGroup<B>, ModelError> {
        self.check_tp(tp)?;
        let d = &self.dims;
        Ok(ShardGroup {
            dims: d.clone(),
            ranks: (0..tp).map(|t| self.rank_shard(be, tp, t)).collect::<Result<_, _>>()?,
            embed: be.upload(&self.embed)?,
            final_norm: be.upload(&self.final_norm)?,
            lm_head: Mat::upload(be, &self.lm_head, d.hidden, d.vocab)?,
        })
    }

    fn rank_shard<B: Backend>(&self, be: &B, tp: usize, t: usize) -> Result<RankShard<B>, ModelError> {
        let d = &self.dims;
        let hid = d.hidden;
        let up = |x: &[f32]| be.upload(x).map_err(ModelError::from);
        let mat = |x: &[f32], inner: usize, cols: usize| Mat::upload(be, x, inner, cols);
        let mut layers = Vec::with_capacity(self.layers.len());
        for lw in &self.layers {
            let mixer = match &lw.mixer {
                Mixer::Kda(w) => {
                    let (h, dk, dv) = (d.kda_heads, d.dk, d.dv);
                    let hl = h / tp;
                    let c = h * (2 * dk + dv);
                    let h0 = t * hl;
                    // The rank's conv channels, in its own q | k | v order.
                    let chans: Vec<usize> = (h0 * dk..(h0 + hl) * dk)
                        .chain(h * dk + h0 * dk..h * dk + (h0 + hl) * dk)
                        .chain(2 * h * dk + h0 * dv..2 * h * dk + (h0 + hl) * dv)
                        .collect();
                    let conv: Vec<f32> = chans.iter().flat_map(|&ch| w.conv[ch * d.conv..(ch + 1) * d.conv].iter().copied()).collect();
                    MixerShard::Kda(KdaShard {
                        heads: hl,
                        first_head: h0,
                        wqkv: mat(&pick_cols(&w.wqkv, hid, c, &chans), hid, chans.len())?,
                        conv: up(&conv)?,
                        wg: mat(&cols(&w.wg, hid, h * dk, h0 * dk, hl * dk), hid, hl * dk)?,
                        wb: mat(&cols(&w.wb, hid, h, h0, hl), hid, hl)?,
                        a_log: up(&w.a_log[h0..h0 + hl])?,
                        dt_bias: up(&w.dt_bias[h0 * dk..(h0 + hl) * dk])?,
                        wgate: mat(&cols(&w.wgate, hid, h * dv, h0 * dv, hl * dv), hid, hl * dv)?,
                        onorm: up(&w.onorm)?,
                        wo: (h0..h0 + hl).map(|hh| mat(&w.wo[hh * dv * hid..(hh + 1) * dv * hid], dv, hid)).collect::<Result<_, _>>()?,
                    })
                }
                Mixer::Mla(w) => {
                    let (hm, l, r, dn, dvh) = (d.mla_heads, d.kv_lora_rank, d.rope_dim, d.nope_dim, d.v_head_dim);
                    let hl = hm / tp;
                    let h0 = t * hl;
                    let qw = dn + r;
                    MixerShard::Mla(MlaShard {
                        heads: hl,
                        wkva: mat(&w.wkva, hid, l + r)?,
                        kv_norm: up(&w.kv_norm)?,
                        wq: mat(&cols(&w.wq, hid, hm * qw, h0 * qw, hl * qw), hid, hl * qw)?,
                        wuk: (h0..h0 + hl).map(|hh| mat(&w.wuk[hh * dn * l..(hh + 1) * dn * l], dn, l)).collect::<Result<_, _>>()?,
                        wuv: (h0..h0 + hl).map(|hh| mat(&w.wuv[hh * l * dvh..(hh + 1) * l * dvh], l, dvh)).collect::<Result<_, _>>()?,
                        wo: (h0..h0 + hl).map(|hh| mat(&w.wo[hh * dvh * hid..(hh + 1) * dvh * hid], dvh, hid)).collect::<Result<_, _>>()?,
                    })
                }
            };
            let units = d.mlp_units();
            let mut mlp = Vec::new();
            for u in t * units / tp..(t + 1) * units / tp {
                let ch = d.mlp_unit(u);
                let uw = ch.len();
                if uw == 0 {
                    // An empty unit contributes nothing at any TP degree.
                    continue;
                }
                mlp.push(MlpUnit {
                    width: uw,
                    gate: mat(&cols(&lw.gate, hid, d.intermediate, ch.start, uw), hid, uw)?,
                    up: mat(&cols(&lw.up, hid, d.intermediate, ch.start, uw), hid, uw)?,
                    down: mat(&lw.down[ch.start * hid..ch.end * hid], uw, hid)?,
                });
            }
            layers.push(LayerShard { attn_norm: up(&lw.attn_norm)?, mlp_norm: up(&lw.mlp_norm)?, mlp, mixer });
        }
        Ok(RankShard { tp, rank: t, layers })
    }
}

/// Columns `c0..c0+n` of a `[rows, total]` matrix.
fn cols(w: &[f32], rows: usize, total: usize, c0: usize, n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * n);
    for r in 0..rows {
        out.extend_from_slice(&w[r * total + c0..r * total + c0 + n]);
    }
    out
}

/// The listed columns of a `[rows, total]` matrix, in the listed order.
fn pick_cols(w: &[f32], rows: usize, total: usize, which: &[usize]) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * which.len());
    for r in 0..rows {
        out.extend(which.iter().map(|&c| w[r * total + c]));
    }
    out
}

/// A weight matrix `[inner, cols]` on the backend, held as its row chunks of
/// `chunk_rows` rows (the last one shorter). On a backend whose matmul is not
/// row-count invariant past [`K_CHUNK`] inner rows (the CPU), chunks are
/// [`K_CHUNK`] rows: the forward pass multiplies chunk by chunk and sums the
/// chunk products in order, so every output row is the same sum whatever the
/// row count of the call (see `forward::matmul`). A backend that sums in fixed
/// order ([`Backend::matmul_fixed_order`], the GPU) holds the matrix whole: one
/// launch a product instead of three a chunk. Holding the chunks avoids slicing
/// the weights at every call.
pub struct Mat<B: Backend> {
    pub inner: usize,
    pub cols: usize,
    /// Inner rows per chunk (at least 1).
    pub chunk_rows: usize,
    /// Rows `c * chunk_rows ..` of the matrix, each `[rows, cols]`; at least
    /// one (an empty matrix has one empty chunk).
    pub chunks: Vec<B::Buf>,
}

impl<B: Backend> Mat<B> {
    /// Uploads the row-major `w` `[inner, cols]` in row chunks.
    pub fn upload(be: &B, w: &[f32], inner: usize, cols: usize) -> Result<Self, ModelError> {
        if w.len() != inner * cols {
            return Err(ModelError::Config(format!("weight of {} elements is not [{inner}, {cols}]", w.len())));
        }
        let chunk_rows = if be.matmul_fixed_order() { inner.max(1) } else { K_CHUNK };
        let chunks = if inner == 0 || cols == 0 { vec![be.upload(w)?] } else { w.chunks(chunk_rows * cols).map(|c| be.upload(c)).collect::<Result<_, _>>()? };
        Ok(Mat { inner, cols, chunk_rows, chunks })
    }
}

/// The weights one TP rank holds: its KDA heads, its MLA query heads, its MLP
/// units; the MLA latent projection is replicated (every rank caches the same rows).
pub struct RankShard<B: Backend> {
    pub tp: usize,
    pub rank: usize,
    pub layers: Vec<LayerShard<B>>,
}

/// One layer of one rank's weights.
pub struct LayerShard<B: Backend> {
    pub attn_norm: B::Buf,
    pub mlp_norm: B::Buf,
    /// The rank's MLP units, in global unit order (empty units left out).
    pub mlp: Vec<MlpUnit<B>>,
    pub mixer: MixerShard<B>,
}

/// One reduction unit of the MLP: `width` intermediate channels (gate, up columns
/// and down rows). The unit, not the rank, is what the all-reduce sums, so the
/// reduction order does not depend on TP.
pub struct MlpUnit<B: Backend> {
    pub width: usize,
    pub gate: Mat<B>,
    pub up: Mat<B>,
    pub down: Mat<B>,
}

/// The attention mixer of one layer on one rank.
pub enum MixerShard<B: Backend> {
    Kda(KdaShard<B>),
    Mla(MlaShard<B>),
}

/// One rank's KDA heads `first_head .. first_head + heads` of one layer.
pub struct KdaShard<B: Backend> {
    pub heads: usize,
    pub first_head: usize,
    /// `[hidden, C]`, C = the rank's q | k | v conv channels.
    pub wqkv: Mat<B>,
    /// `[C, W]`.
    pub conv: B::Buf,
    pub wg: Mat<B>,
    pub wb: Mat<B>,
    pub a_log: B::Buf,
    pub dt_bias: B::Buf,
    pub wgate: Mat<B>,
    pub onorm: B::Buf,
    /// o_proj rows of each head `[Dv, hidden]`.
    pub wo: Vec<Mat<B>>,
}

/// One rank's MLA query heads of one layer, and the replicated latent projection.
pub struct MlaShard<B: Backend> {
    pub heads: usize,
    pub wkva: Mat<B>,
    pub kv_norm: B::Buf,
    pub wq: Mat<B>,
    pub wuk: Vec<Mat<B>>,
    pub wuv: Vec<Mat<B>>,
    /// o_proj rows of each head `[v_head_dim, hidden]`.
    pub wo: Vec<Mat<B>>,
}
