//! The small hybrid model: dimensions from the topology's `[model]` table, seeded
//! weights, and their tensor-parallel shards.

use super::ModelError;
use handoff_components::Topology;
use handoff_components::vocab::{Dtype, LayerKind};
use handoff_kernels::{CpuBuf, SplitMix64};

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
    /// Reduction units of the MLP: as many as the model has heads (KDA heads, or MLA
    /// heads in an MLA-only model), so every legal TP degree holds whole units.
    pub fn mlp_units(&self) -> usize {
        if self.layer_kinds.contains(&LayerKind::Kda) { self.kda_heads } else { self.mla_heads }
    }
    pub fn num_layers(&self) -> usize {
        self.layer_kinds.len()
    }
    /// f32 bytes of the full (unsharded) weights, computed without overflow.
    pub fn weight_bytes(&self) -> u128 {
        let (d, i) = (self.hidden as u128, self.intermediate as u128);
        let (h, dk, dv, w) = (self.kda_heads as u128, self.dk as u128, self.dv as u128, self.conv as u128);
        let (hm, l, r, dn, dvh) =
            (self.mla_heads as u128, self.kv_lora_rank as u128, self.rope_dim as u128, self.nope_dim as u128, self.v_head_dim as u128);
        let c = h * (2 * dk + dv);
        let kda = d * c + c * w + d * h * dk + d * h + h + h * dk + d * h * dv + dv + h * dv * d;
        let mla = d * (l + r) + l + d * hm * (dn + r) + hm * dn * l + hm * l * dvh + hm * dvh * d;
        let common = 2 * d + 3 * d * i;
        let layers: u128 = self
            .layer_kinds
            .iter()
            .map(|k| common + if *k == LayerKind::Kda { kda } else { mla })
            .sum();
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

/// The whole model, unsharded. Every rank derives its shard from this, so every
/// rank sees the same numbers for the same seed.
#[derive(Debug, Clone)]
pub struct Model {
    pub dims: Dims,
    pub embed: CpuBuf,
    pub layers: Vec<LayerWeights>,
    pub final_norm: CpuBuf,
    pub lm_head: CpuBuf,
}

fn normal(seed: u64, stream: u64, n: usize, fan_in: usize) -> Vec<f32> {
    SplitMix64::with_stream(seed, stream).vec_normal(n, 1.0 / (fan_in.max(1) as f32).sqrt())
}

fn around(seed: u64, stream: u64, n: usize, center: f32, spread: f32) -> Vec<f32> {
    SplitMix64::with_stream(seed, stream).vec_uniform(n, center - spread, center + spread)
}

impl Model {
    /// Seeded weights for the topology's `[model]` table. Each tensor draws from its
    /// own SplitMix64 stream (layer x 32 + tensor), N(0, 1/sqrt(fan_in)).
    pub fn new(topo: &Topology) -> Result<Model, ModelError> {
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
        let seed = topo.model().seed;
        let d = dims.hidden;
        if dims.intermediate == 0 {
            return Err(ModelError::Config("model.intermediate_size must be at least 1".into()));
        }
        let (h, dk, dv) = (dims.kda_heads, dims.dk, dims.dv);
        let (hm, l, r, dn, dvh) =
            (dims.mla_heads, dims.kv_lora_rank, dims.rope_dim, dims.nope_dim, dims.v_head_dim);
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
        Ok(Model {
            embed: CpuBuf::from_vec(SplitMix64::with_stream(seed, 1).vec_normal(VOCAB * d, 1.0)),
            final_norm: CpuBuf::from_vec(around(seed, 2, d, 1.0, 0.1)),
            lm_head: CpuBuf::from_vec(normal(seed, 3, d * VOCAB, d)),
            layers,
            dims,
        })
    }

    /// The shards of every rank of a TP group of `tp` ranks.
    pub fn shard(&self, tp: usize) -> Result<Vec<RankShard>, ModelError> {
        let d = &self.dims;
        let has = |k| d.layer_kinds.contains(&k);
        for (what, n) in [
            ("model.kda.heads", if has(LayerKind::Kda) { d.kda_heads } else { 0 }),
            ("model.mla.heads", if has(LayerKind::Mla) { d.mla_heads } else { 0 }),
        ] {
            if tp == 0 || n % tp != 0 {
                return Err(ModelError::Config(format!("{what} = {n} cannot be split over tp {tp}")));
            }
        }
        let units = d.mlp_units();
        if !units.is_multiple_of(tp) || !d.intermediate.is_multiple_of(units) {
            return Err(ModelError::Config(format!(
                "model.intermediate_size = {} must split into {units} MLP units (one per attention head) over tp {tp}",
                d.intermediate
            )));
        }
        Ok((0..tp).map(|t| self.rank_shard(tp, t)).collect())
    }

    fn rank_shard(&self, tp: usize, t: usize) -> RankShard {
        let d = &self.dims;
        let hid = d.hidden;
        let layers = self
            .layers
            .iter()
            .map(|lw| {
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
                        let conv: Vec<f32> =
                            chans.iter().flat_map(|&ch| w.conv[ch * d.conv..(ch + 1) * d.conv].iter().copied()).collect();
                        MixerShard::Kda(KdaShard {
                            heads: hl,
                            first_head: h0,
                            wqkv: CpuBuf::from_vec(pick_cols(&w.wqkv, hid, c, &chans)),
                            conv: CpuBuf::from_vec(conv),
                            wg: CpuBuf::from_vec(cols(&w.wg, hid, h * dk, h0 * dk, hl * dk)),
                            wb: CpuBuf::from_vec(cols(&w.wb, hid, h, h0, hl)),
                            a_log: CpuBuf::from_vec(w.a_log[h0..h0 + hl].to_vec()),
                            dt_bias: CpuBuf::from_vec(w.dt_bias[h0 * dk..(h0 + hl) * dk].to_vec()),
                            wgate: CpuBuf::from_vec(cols(&w.wgate, hid, h * dv, h0 * dv, hl * dv)),
                            onorm: CpuBuf::from_vec(w.onorm.clone()),
                            wo: (h0..h0 + hl)
                                .map(|hh| CpuBuf::from_vec(w.wo[hh * dv * hid..(hh + 1) * dv * hid].to_vec()))
                                .collect(),
                        })
                    }
                    Mixer::Mla(w) => {
                        let (hm, l, r, dn, dvh) = (d.mla_heads, d.kv_lora_rank, d.rope_dim, d.nope_dim, d.v_head_dim);
                        let hl = hm / tp;
                        let h0 = t * hl;
                        let qw = dn + r;
                        MixerShard::Mla(MlaShard {
                            heads: hl,
                            wkva: CpuBuf::from_vec(w.wkva.clone()),
                            kv_norm: CpuBuf::from_vec(w.kv_norm.clone()),
                            wq: CpuBuf::from_vec(cols(&w.wq, hid, hm * qw, h0 * qw, hl * qw)),
                            wuk: (h0..h0 + hl)
                                .map(|hh| CpuBuf::from_vec(w.wuk[hh * dn * l..(hh + 1) * dn * l].to_vec()))
                                .collect(),
                            wuv: (h0..h0 + hl)
                                .map(|hh| CpuBuf::from_vec(w.wuv[hh * l * dvh..(hh + 1) * l * dvh].to_vec()))
                                .collect(),
                            wo: (h0..h0 + hl)
                                .map(|hh| CpuBuf::from_vec(w.wo[hh * dvh * hid..(hh + 1) * dvh * hid].to_vec()))
                                .collect(),
                        })
                    }
                };
                LayerShard {
                    attn_norm: CpuBuf::from_vec(lw.attn_norm.clone()),
                    mlp_norm: CpuBuf::from_vec(lw.mlp_norm.clone()),
                    mlp: {
                        let units = d.mlp_units();
                        let uw = d.intermediate / units;
                        (t * units / tp..(t + 1) * units / tp)
                            .map(|u| MlpUnit {
                                width: uw,
                                gate: CpuBuf::from_vec(cols(&lw.gate, hid, d.intermediate, u * uw, uw)),
                                up: CpuBuf::from_vec(cols(&lw.up, hid, d.intermediate, u * uw, uw)),
                                down: CpuBuf::from_vec(lw.down[u * uw * hid..(u + 1) * uw * hid].to_vec()),
                            })
                            .collect()
                    },
                    mixer,
                }
            })
            .collect();
        RankShard { tp, rank: t, layers }
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

/// The weights one TP rank holds: its KDA heads, its MLA query heads, its slice of
/// the MLP; the MLA latent projection is replicated (every rank caches the same rows).
#[derive(Debug, Clone)]
pub struct RankShard {
    pub tp: usize,
    pub rank: usize,
    pub layers: Vec<LayerShard>,
}

#[derive(Debug, Clone)]
pub struct LayerShard {
    pub attn_norm: CpuBuf,
    pub mlp_norm: CpuBuf,
    /// The rank's MLP units, in global unit order.
    pub mlp: Vec<MlpUnit>,
    pub mixer: MixerShard,
}

/// One reduction unit of the MLP: `width` intermediate channels (gate, up columns
/// and down rows). The unit, not the rank, is what the all-reduce sums, so the
/// reduction order does not depend on TP.
#[derive(Debug, Clone)]
pub struct MlpUnit {
    pub width: usize,
    pub gate: CpuBuf,
    pub up: CpuBuf,
    pub down: CpuBuf,
}

#[derive(Debug, Clone)]
pub enum MixerShard {
    Kda(KdaShard),
    Mla(MlaShard),
}

#[derive(Debug, Clone)]
pub struct KdaShard {
    pub heads: usize,
    pub first_head: usize,
    pub wqkv: CpuBuf,
    pub conv: CpuBuf,
    pub wg: CpuBuf,
    pub wb: CpuBuf,
    pub a_log: CpuBuf,
    pub dt_bias: CpuBuf,
    pub wgate: CpuBuf,
    pub onorm: CpuBuf,
    /// o_proj rows of each head `[Dv, hidden]`.
    pub wo: Vec<CpuBuf>,
}

#[derive(Debug, Clone)]
pub struct MlaShard {
    pub heads: usize,
    pub wkva: CpuBuf,
    pub kv_norm: CpuBuf,
    pub wq: CpuBuf,
    pub wuk: Vec<CpuBuf>,
    pub wuv: Vec<CpuBuf>,
    /// o_proj rows of each head `[v_head_dim, hidden]`.
    pub wo: Vec<CpuBuf>,
}
