//! The fused decode step (`handoff_kernels::step`) of this model over the decode
//! ranks' registered regions: the whole model's weights in the step's form (one
//! input product per mixer, gate and up side by side, o_proj and down cut into
//! their all-reduce units) and every decode rank's regions as device addresses.
//!
//! A backend that has a fused step (CUDA) runs decode through it whenever every
//! decode region lives in its device memory; otherwise the generic forward pass
//! ([`super::forward::decode_batch`]) runs. The reason a step is not used is
//! returned, so the caller can say it once.

use super::dtype::storage;
use super::ranks::Layouts;
use super::regions::RegionView;
use super::weights::{Dims, Mixer, Model, NORM_EPS};
use handoff_components::Topology;
use handoff_components::ecs::Lease;
use handoff_components::vocab::{DecodeRank, ModuleLayer, RankId, RegionKind};
use handoff_kernels::Backend;
use handoff_kernels::step::{
    DecodeStep, StepKda, StepLayer, StepMat, StepMixer, StepMla, StepModel, StepOptions, StepPlacement, StepRank, StepRegion, StepRequest, StepSpec,
};

/// Columns side by side: `parts` are `[rows, c_i]` matrices.
fn side_by_side(rows: usize, parts: &[(&[f32], usize)]) -> Vec<f32> {
    let total: usize = parts.iter().map(|p| p.1).sum();
    let mut out = Vec::with_capacity(rows * total);
    for r in 0..rows {
        for &(w, c) in parts {
            out.extend_from_slice(&w[r * c..(r + 1) * c]);
        }
    }
    out
}

/// Gate and up `[rows, i]` interleaved in blocks of 8 channels, so that a 16-column
/// tile of the product holds a block's gate and its up (the fused step applies
/// SwiGLU where the product's sums land): columns 16q .. 16q + 7 are gate
/// channels 8q .. 8q + 7, the next 8 their up; a short last block is zeros.
fn interleave_gate_up(rows: usize, i: usize, gate: &[f32], up: &[f32]) -> Vec<f32> {
    let blocks = i.div_ceil(8);
    let mut out = vec![0.0f32; rows * 16 * blocks];
    for r in 0..rows {
        for c in 0..i {
            let (q, j) = (c / 8, c % 8);
            out[r * 16 * blocks + 16 * q + j] = gate[r * i + c];
            out[r * 16 * blocks + 16 * q + 8 + j] = up[r * i + c];
        }
    }
    out
}

/// The model's weights as the step computes with them (already rounded by
/// `[model] weight_dtype`, as the CPU reference's are).
pub fn step_model(model: &Model) -> StepModel {
    let d: &Dims = &model.dims;
    let hid = d.hidden;
    let (h, dk, dv) = (d.kda_heads, d.dk, d.dv);
    let c = h * (2 * dk + dv);
    let (hm, l, r, dn, dvh) = (d.mla_heads, d.kv_lora_rank, d.rope_dim, d.nope_dim, d.v_head_dim);
    let i = d.intermediate;
    let layers = model
        .layers
        .iter()
        .map(|lw| {
            let mixer = match &lw.mixer {
                Mixer::Kda(k) => StepMixer::Kda(StepKda {
                    in_proj: StepMat::plain(hid, c + h * dk + h + h * dv, side_by_side(hid, &[(&k.wqkv, c), (&k.wg, h * dk), (&k.wb, h), (&k.wgate, h * dv)])),
                    conv: k.conv.clone(),
                    a_log: k.a_log.clone(),
                    dt_bias: k.dt_bias.clone(),
                    onorm: k.onorm.clone(),
                    wo: StepMat::units(h * dv, hid, h, k.wo.clone()),
                }),
                Mixer::Mla(a) => StepMixer::Mla(StepMla {
                    in_proj: StepMat::plain(hid, l + r + hm * (dn + r), side_by_side(hid, &[(&a.wkva, l + r), (&a.wq, hm * (dn + r))])),
                    kv_norm: a.kv_norm.clone(),
                    wuk: StepMat::grouped(hm, dn, l, a.wuk.clone()),
                    wuv: StepMat::grouped(hm, l, dvh, a.wuv.clone()),
                    wo: StepMat::units(hm * dvh, hid, hm, a.wo.clone()),
                }),
            };
            StepLayer {
                attn_norm: lw.attn_norm.clone(),
                mlp_norm: lw.mlp_norm.clone(),
                mixer,
                gate_up: StepMat::plain(hid, 16 * i.div_ceil(8), interleave_gate_up(hid, i, &lw.gate, &lw.up)),
                down: StepMat::units(i, hid, d.mlp_units(), lw.down.clone()),
            }
        })
        .collect();
    StepModel {
        hidden: hid,
        vocab: d.vocab,
        intermediate: i,
        kda_heads: h,
        dk,
        dv,
        conv: d.conv,
        mla_heads: hm,
        kv_lora_rank: l,
        rope_dim: r,
        nope_dim: dn,
        v_head_dim: dvh,
        replay: d.replay.unwrap_or(0),
        eps: NORM_EPS,
        mla_scale: d.mla_scale(),
        weights: d.weight_dtype,
        cache: storage(d.dtype),
        embed: model.embed.clone(),
        final_norm: model.final_norm.clone(),
        lm_head: StepMat::plain(hid, d.vocab, model.lm_head.clone()),
        layers,
    }
}

/// Why no fused step runs, so decode takes the generic forward pass.
#[derive(Debug, thiserror::Error)]
pub enum NoStep {
    #[error("{rank} has no {kind} region")]
    MissingRegion { rank: RankId, kind: RegionKind },
    #[error("{rank}'s {kind} region is host memory")]
    HostRegion { rank: RankId, kind: RegionKind },
    #[error("the fused step runs hybrid models (KDA and MLA layers)")]
    NotHybrid,
    /// The step's shapes or the backend refused (the backend has no fused
    /// step, a shape it cannot tile).
    #[error("{0}")]
    Kernel(#[from] handoff_kernels::KernelError),
}

/// Every decode rank's regions as device addresses, or why not (a region that
/// is host memory, a kind missing).
pub fn step_placement(topo: &Topology, layouts: &Layouts, view: &dyn RegionView) -> Result<StepPlacement, NoStep> {
    let dc = topo.decode();
    let n = topo.layer_kinds.len();
    let region = |rank: DecodeRank, kind: RegionKind| -> Result<StepRegion, NoStep> {
        let id = RankId::Decode(rank);
        let l = layouts.get(&(id, kind)).ok_or(NoStep::MissingRegion { rank: id, kind })?;
        let dev = view.device(id, kind).ok_or(NoStep::HostRegion { rank: id, kind })?;
        Ok(StepRegion {
            addr: dev.addr,
            len: dev.len,
            unit_stride: l.unit_stride,
            units: l.units,
            rows: (0..n).map(|i| l.row(ModuleLayer(i as u32)).map(|r| r.offset)).collect(),
        })
    };
    let replay = topo.model().replay.is_some();
    let has_kda = topo.layer_kinds.contains(&handoff_components::vocab::LayerKind::Kda);
    let has_mla = topo.layer_kinds.contains(&handoff_components::vocab::LayerKind::Mla);
    if !has_kda || !has_mla {
        return Err(NoStep::NotHybrid);
    }
    let mut ranks = Vec::with_capacity(dc.tp as usize);
    for t in 0..dc.tp {
        let rank = DecodeRank { tp: t };
        ranks.push(StepRank {
            state: region(rank, RegionKind::KdaState)?,
            conv: region(rank, RegionKind::KdaConv)?,
            ring: if replay { Some(region(rank, RegionKind::ReplayRecords)?) } else { None },
            cursor: if replay { Some(region(rank, RegionKind::ReplayCursor)?) } else { None },
            mla: region(rank, RegionKind::MlaKv)?,
        });
    }
    let rank0 = RankId::Decode(DecodeRank { tp: 0 });
    let mla = layouts.get(&(rank0, RegionKind::MlaKv)).ok_or(NoStep::MissingRegion { rank: rank0, kind: RegionKind::MlaKv })?;
    Ok(StepPlacement {
        tp: dc.tp as usize,
        dcp: dc.dcp as usize,
        interleave: dc.interleave as usize,
        block_size: dc.block_size as usize,
        token_bytes: mla.token_bytes as usize,
        max_context: topo.config.serve.max_context as usize,
        ranks,
    })
}

/// The fused decode step of `model` on `be` over the decode regions, or why
/// none runs (the backend has none, a region is host memory, a shape the step
/// cannot tile).
pub fn open<B: Backend>(be: &B, topo: &Topology, model: &Model, layouts: &Layouts, view: &dyn RegionView) -> Result<Box<dyn DecodeStep>, NoStep> {
    let place = step_placement(topo, layouts, view)?;
    let spec = StepSpec {
        model: step_model(model),
        place,
        options: StepOptions {
            max_batch: topo.config.serve.batch() as usize,
            graphs: topo.config.device.graphs,
            dependent_launch: topo.config.device.dependent_launch,
        },
    };
    spec.check()?;
    Ok(be.decode_step(&spec)?)
}

/// One decode request's slots and block tables in rank order, held while its
/// [`StepRequest`] borrows them.
pub struct TickRows<'a> {
    pub slots: Vec<u32>,
    pub blocks: Vec<&'a [u32]>,
}

impl<'a> TickRows<'a> {
    /// From the request's leases on every decode rank, in TP order.
    pub fn of(leases: &[&'a Lease]) -> TickRows<'a> {
        TickRows { slots: leases.iter().map(|l| l.slot).collect(), blocks: leases.iter().map(|l| l.blocks.as_slice()).collect() }
    }

    pub fn request(&self, token: u32, pos: u64) -> StepRequest<'_> {
        StepRequest { token, pos, slots: &self.slots, blocks: &self.blocks }
    }
}
