//! The colocated single-rank reference: the same model at TP1, no PP, no DCP, with
//! its own plain in-memory caches (stored values rounded to the model dtype, as a
//! colocated engine's caches would hold them).
//!
//! It runs the same decode algorithm as the disaggregated decode ranks: MLA
//! attention as one f64 partial merged like a DCP group of one, and, when
//! `[model.replay]` is configured, ReplaySSM with the same ring, records and
//! commit schedule (prefill keeps the state before the prompt's last r tokens and
//! their records) on one rank holding every head. ReplaySSM is part of decode,
//! not of the hand-off; the hand-off only moves what it keeps.

use super::ModelError;
use super::forward::{self, DecodeCaches, PrefillCache};
use super::weights::{Model, RankShard};
use handoff_kernels::{Backend, CpuBackend, CpuBuf, CpuIBuf, ReplayShape};

/// Greedy tokens and the logits that chose them: entry 0 comes from prefill (the
/// prompt's last position), entry i > 0 from decode step i.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    pub tokens: Vec<u8>,
    pub logits: Vec<Vec<f32>>,
}

/// One KDA layer's caches: state (the committed state under replay), conv state,
/// and the ReplaySSM ring and cursor when configured.
#[derive(Clone)]
struct KdaLocal {
    state: CpuBuf,
    conv: CpuBuf,
    replay: Option<(CpuBuf, CpuIBuf)>,
}

/// Plain caches of one rank holding every head.
struct LocalCaches {
    kda: Vec<Option<KdaLocal>>,
    replay: Option<ReplayShape>,
    mla: Vec<Vec<f32>>,
    width: usize,
    shape: handoff_kernels::MlaShape,
}

impl DecodeCaches for LocalCaches {
    fn kda(
        &mut self,
        _rank: usize,
        layer: usize,
        step: &mut forward::KdaStepFn<'_>,
    ) -> Result<(), ModelError> {
        let be = CpuBackend::new();
        let c = self.kda[layer].as_mut().ok_or_else(|| ModelError::Config(format!("layer {layer} has no KDA cache")))?;
        match (&mut c.replay, self.replay) {
            (Some((ring, cursor)), Some(shape)) => {
                forward::replay_step(&be, shape, &mut c.state, ring, cursor, &mut c.conv, step)?;
                Ok(())
            }
            _ => step(&mut c.state, &mut c.conv, None),
        }
    }
    fn mla_append(&mut self, layer: usize, pos: usize, row: &[f32]) -> Result<(), ModelError> {
        let rows = &mut self.mla[layer];
        if rows.len() != pos * self.width {
            return Err(ModelError::Config(format!("layer {layer}: appending position {pos} to {} rows", rows.len() / self.width)));
        }
        rows.extend_from_slice(row);
        Ok(())
    }
    fn mla_attend(&mut self, layer: usize, pos: usize, q_lat: &[CpuBuf]) -> Result<Vec<CpuBuf>, ModelError> {
        let be = CpuBackend::new();
        let rows = CpuBuf::from_vec(self.mla[layer].clone());
        // A DCP group of one: the same f64 partial and merge as the decode ranks.
        let partial = forward::mla_partial(&be, self.shape, &q_lat[0], &rows, pos + 1)?;
        Ok(vec![forward::mla_merge(&be, self.shape, 1, &partial)?])
    }
}

/// Runs the prompt and `steps` greedy decode steps on one rank.
pub fn run_colocated(model: &Model, prompt: &[u8], steps: u32) -> Result<Trace, ModelError> {
    let be = CpuBackend::new();
    let dims = &model.dims;
    let shard: Vec<RankShard> = model.shard(1)?;
    let t = prompt.len();
    if t == 0 {
        return Err(ModelError::Config("empty prompt".into()));
    }
    let n = dims.num_layers();
    let tail = dims.record_tail(t);
    let replay = dims.replay.map(|capacity| ReplayShape { batch: 1, heads: dims.kda_heads, dk: dims.dk, dv: dims.dv, capacity });
    let mut caches = LocalCaches {
        kda: vec![None; n],
        replay,
        mla: vec![Vec::new(); n],
        width: dims.row_width(),
        shape: forward::mla_shape(dims, dims.mla_heads),
    };
    let mut h = forward::embed(&be, model, prompt)?;
    forward::prefill_layers(&be, model, &shard, 0..n, &mut h, t, tail, &mut |_, layer, cache| {
        match cache {
            PrefillCache::Kda(c) => {
                let replay = match replay {
                    Some(shape) => {
                        let mut ring = vec![0.0f32; shape.capacity * shape.heads * dims.record_width()];
                        ring.get_mut(..c.records.len())
                            .ok_or_else(|| ModelError::Config(format!("layer {layer}: {} records overflow the ring", c.record_tokens)))?
                            .copy_from_slice(&c.records);
                        Some((CpuBuf::from_vec(ring), be.upload_i32(&[c.record_tokens as i32])?))
                    }
                    None => None,
                };
                caches.kda[layer] =
                    Some(KdaLocal { state: CpuBuf::from_vec(c.state.clone()), conv: CpuBuf::from_vec(c.conv.clone()), replay });
            }
            PrefillCache::Mla(rows) => caches.mla[layer] = rows.to_vec(),
        }
        Ok(())
    })?;
    let (logits, tok) = forward::logits_of_last(&be, model, &h, t)?;
    let mut trace = Trace { tokens: vec![tok], logits: vec![logits] };
    for i in 0..steps as usize {
        let prev = trace.tokens[i];
        let (logits, tok) = forward::decode_step(&be, model, &shard, prev, t + i, &mut caches)?;
        trace.tokens.push(tok);
        trace.logits.push(logits);
    }
    Ok(trace)
}
