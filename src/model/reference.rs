//! The colocated single-rank reference: the same model at TP1, no PP, no DCP, with
//! its own plain in-memory caches (stored values rounded to the model dtype, as a
//! colocated engine's caches would hold them).

use super::ModelError;
use super::forward::{self, DecodeCaches, PrefillCache};
use super::weights::{Model, RankShard};
use handoff_kernels::{Backend, CpuBackend, CpuBuf, RowSet};

/// Greedy tokens and the logits that chose them: entry 0 comes from prefill (the
/// prompt's last position), entry i > 0 from decode step i.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    pub tokens: Vec<u8>,
    pub logits: Vec<Vec<f32>>,
}

/// Plain caches of one rank holding every head.
struct LocalCaches {
    kda: Vec<Option<(CpuBuf, CpuBuf)>>,
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
        let (s, c) = self.kda[layer].as_mut().ok_or_else(|| ModelError::Config(format!("layer {layer} has no KDA cache")))?;
        step(s, c, None)
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
        let mut o = be.alloc(self.shape.heads * self.shape.kv_lora_rank)?;
        let mut lse = be.alloc(self.shape.heads)?;
        be.mla_decode(self.shape, &q_lat[0], RowSet { buf: &rows, count: pos + 1 }, &mut o, &mut lse)?;
        Ok(vec![o])
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
    let mut caches = LocalCaches {
        kda: vec![None; n],
        mla: vec![Vec::new(); n],
        width: dims.row_width(),
        shape: forward::mla_shape(dims, dims.mla_heads),
    };
    let mut h = forward::embed(&be, model, prompt)?;
    forward::prefill_layers(&be, model, &shard, 0..n, &mut h, t, 0, &mut |_, layer, cache| {
        match cache {
            PrefillCache::Kda(c) => {
                caches.kda[layer] = Some((CpuBuf::from_vec(c.state.clone()), CpuBuf::from_vec(c.conv.clone())));
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
