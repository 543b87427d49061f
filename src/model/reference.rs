//! The colocated reference: the same model with no PP and no DCP, with its own
//! plain host caches (stored values rounded to the model dtype, as a colocated
//! engine's caches would hold them). [`run_colocated`] is the single-rank (TP1)
//! run that verify compares against.
//!
//! It runs the same decode algorithm as the disaggregated decode ranks
//! ([`forward::decode_batch`], at batch one): MLA attention as one f64 partial
//! merged like a DCP group of one, and, when `[model.replay]` is configured,
//! ReplaySSM with the same ring, records and commit schedule (prefill keeps the
//! state before the prompt's last r tokens and their records). ReplaySSM is part
//! of decode, not of the hand-off; the hand-off only moves what it keeps.
//!
//! [`LocalCaches`] holds any number of requests on a TP group of any width (DCP
//! 1), so the tests and the compute bench batch requests through it too.

use super::ModelError;
use super::forward::{self, BatchCaches, KdaBatch, PrefillCache, ReplayBatch, ShardGroup};
use super::weights::{Dims, Model};
use handoff_kernels::Backend;

type R<T> = Result<T, ModelError>;

/// Greedy tokens and the logits that chose them: entry 0 comes from prefill (the
/// prompt's last position), entry i > 0 from decode step i.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    pub tokens: Vec<u8>,
    pub logits: Vec<Vec<f32>>,
}

/// One KDA layer's caches on one rank: state (the committed state under replay),
/// conv state, and the ReplaySSM ring and cursor when configured.
#[derive(Debug, Clone)]
struct KdaLocal {
    state: Vec<f32>,
    conv: Vec<f32>,
    replay: Option<(Vec<f32>, i32)>,
}

/// One KDA layer's caches as parts: state, conv state, and the ReplaySSM ring
/// and cursor when configured.
pub type KdaParts = (Vec<f32>, Vec<f32>, Option<(Vec<f32>, i32)>);

/// One request's caches on a TP group: per layer, each rank's KDA caches, and
/// the MLA rows `[n, L+R]` (replicated over TP, so held once).
#[derive(Debug, Clone)]
pub struct LocalRequest {
    kda: Vec<Vec<Option<KdaLocal>>>,
    mla: Vec<Vec<f32>>,
}

impl LocalRequest {
    /// A request with nothing cached yet (position 0): zero KDA state and conv
    /// state, empty rings, no MLA rows. Decoding from here is the recurrent form
    /// of a prefill.
    pub fn empty(dims: &Dims, tp: usize) -> LocalRequest {
        let hl = dims.kda_heads / tp.max(1);
        let kda = dims
            .layer_kinds
            .iter()
            .map(|k| match k {
                handoff_components::vocab::LayerKind::Kda => (0..tp)
                    .map(|_| {
                        Some(KdaLocal {
                            state: vec![0.0; hl * dims.dk * dims.dv],
                            conv: vec![0.0; (dims.conv - 1) * dims.conv_channels(hl)],
                            replay: dims.replay.map(|cap| (vec![0.0; cap * hl * dims.record_width()], 0)),
                        })
                    })
                    .collect(),
                handoff_components::vocab::LayerKind::Mla => vec![None; tp],
            })
            .collect();
        LocalRequest { kda, mla: vec![Vec::new(); dims.num_layers()] }
    }

    /// A single-rank request's caches from their parts: per layer, its KDA
    /// state `[H, Dk, Dv]`, conv state `[W-1, C]` and ReplaySSM ring and cursor
    /// (None for MLA layers), and its MLA rows `[n, L+R]` (empty for KDA
    /// layers). What a check reads back from a device run's regions.
    pub fn from_parts(kda: Vec<Option<KdaParts>>, mla: Vec<Vec<f32>>) -> LocalRequest {
        let kda = kda.into_iter().map(|k| vec![k.map(|(state, conv, replay)| KdaLocal { state, conv, replay })]).collect();
        LocalRequest { kda, mla }
    }
}

/// Plain host caches of a batch of requests on one TP group (DCP 1).
#[derive(Debug, Clone)]
pub struct LocalCaches {
    dims: Dims,
    tp: usize,
    /// The batch, in batch order.
    pub requests: Vec<LocalRequest>,
}

impl LocalCaches {
    /// The caches of `requests` on a group of `tp` ranks.
    pub fn new(dims: &Dims, tp: usize, requests: Vec<LocalRequest>) -> LocalCaches {
        LocalCaches { dims: dims.clone(), tp, requests }
    }

    fn kda(&self, b: usize, rank: usize, layer: usize) -> R<&KdaLocal> {
        self.requests
            .get(b)
            .and_then(|r| r.kda.get(layer))
            .and_then(|l| l.get(rank))
            .and_then(|c| c.as_ref())
            .ok_or_else(|| ModelError::Config(format!("request {b}: no KDA cache of layer {layer} on tp rank {rank}")))
    }
}

impl<B: Backend> BatchCaches<B> for LocalCaches {
    fn batch(&self) -> usize {
        self.requests.len()
    }

    fn dcp(&self) -> usize {
        1
    }

    fn kda_load(&mut self, be: &B, rank: usize, layer: usize) -> R<KdaBatch<B>> {
        let nb = self.requests.len();
        let (mut state, mut conv, mut ring, mut cursor) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for b in 0..nb {
            let c = self.kda(b, rank, layer)?;
            state.extend_from_slice(&c.state);
            conv.extend_from_slice(&c.conv);
            if let Some((r, k)) = &c.replay {
                ring.extend_from_slice(r);
                cursor.push(*k);
            }
        }
        let replay = match self.dims.replay {
            Some(_) if cursor.len() == nb => Some(ReplayBatch { ring: be.upload(&ring)?, cursor: be.upload_i32(&cursor)? }),
            Some(_) => return Err(ModelError::Config(format!("layer {layer}: a request has no ReplaySSM ring"))),
            None => None,
        };
        Ok(KdaBatch { state: be.upload(&state)?, conv: be.upload(&conv)?, replay })
    }

    fn kda_store(&mut self, be: &B, rank: usize, layer: usize, kda: &KdaBatch<B>, state_changed: &[bool]) -> R<()> {
        let nb = self.requests.len();
        let state = be.download(&kda.state)?;
        let conv = be.download(&kda.conv)?;
        let replay = match &kda.replay {
            Some(rb) => Some((be.download(&rb.ring)?, be.download_i32(&rb.cursor)?)),
            None => None,
        };
        let (ps, pc) = (state.len() / nb.max(1), conv.len() / nb.max(1));
        for b in 0..nb {
            let c = self.requests[b].kda[layer][rank].as_mut().ok_or_else(|| ModelError::Config(format!("request {b}: no KDA cache of layer {layer}")))?;
            if state_changed.get(b).copied().unwrap_or(false) {
                c.state.copy_from_slice(&state[b * ps..(b + 1) * ps]);
            }
            c.conv.copy_from_slice(&conv[b * pc..(b + 1) * pc]);
            if let (Some((ring, cursor)), Some((r, k))) = (&replay, c.replay.as_mut()) {
                let pr = ring.len() / nb;
                r.copy_from_slice(&ring[b * pr..(b + 1) * pr]);
                *k = cursor[b];
            }
        }
        Ok(())
    }

    /// The rows are replicated over TP and held once: rank 0 (called first)
    /// appends, every rank reads.
    fn mla_rows(&mut self, be: &B, rank: usize, layer: usize, positions: &[usize], new_rows: &B::Buf) -> R<(B::Buf, Vec<usize>)> {
        if rank >= self.tp {
            return Err(ModelError::Config(format!("tp rank {rank} of a group of {}", self.tp)));
        }
        let w = self.dims.row_width();
        if rank == 0 {
            let new_rows = be.download(new_rows)?;
            for (b, &pos) in positions.iter().enumerate() {
                let have = &mut self.requests[b].mla[layer];
                if have.len() != pos * w {
                    return Err(ModelError::Config(format!("request {b} layer {layer}: appending position {pos} to {} rows", have.len() / w.max(1))));
                }
                have.extend_from_slice(&new_rows[b * w..(b + 1) * w]);
            }
        }
        let mut rows = Vec::new();
        let mut counts = Vec::with_capacity(positions.len());
        for (b, &pos) in positions.iter().enumerate() {
            let have = &self.requests[b].mla[layer];
            if have.len() != (pos + 1) * w {
                return Err(ModelError::Config(format!("request {b} layer {layer}: {} rows, attending to {}", have.len() / w.max(1), pos + 1)));
            }
            rows.extend_from_slice(have);
            counts.push(pos + 1);
        }
        Ok((be.upload(&rows)?, counts))
    }
}

/// Prefill of `prompt` on `group` into fresh local caches: the request's caches
/// and the logits and greedy pick of the prompt's last position.
pub fn prefill_local<B: Backend>(be: &B, group: &ShardGroup<B>, prompt: &[u8]) -> R<(LocalRequest, Vec<f32>, u8)> {
    let dims = &group.dims;
    let t = prompt.len();
    if t == 0 {
        return Err(ModelError::Config("empty prompt".into()));
    }
    let n = dims.num_layers();
    let tail = dims.record_tail(t);
    let mut req = LocalRequest::empty(dims, group.tp());
    let mut h = forward::embed(be, group, prompt)?;
    forward::prefill_layers(be, group, 0..n, &mut h, t, tail, &mut |rank, layer, cache| {
        match cache {
            PrefillCache::Kda(c) => {
                let (state, records) = (be.download(&c.state)?, be.download(&c.records)?);
                let replay = match dims.replay {
                    Some(cap) => {
                        let mut ring = vec![0.0f32; cap * (state.len() / (dims.dk * dims.dv)) * dims.record_width()];
                        ring.get_mut(..records.len())
                            .ok_or_else(|| ModelError::Config(format!("layer {layer}: {} records overflow the ring", c.record_tokens)))?
                            .copy_from_slice(&records);
                        Some((ring, c.record_tokens as i32))
                    }
                    None => None,
                };
                req.kda[layer][rank] = Some(KdaLocal { state, conv: be.download(&c.conv)?, replay });
            }
            PrefillCache::Mla(rows) => req.mla[layer] = be.download(rows)?,
        }
        Ok(())
    })?;
    let (logits, tok) = forward::logits_of_last(be, group, &h, t)?;
    Ok((req, logits, tok))
}

/// Runs the prompt and `steps` greedy decode steps on `group` (any TP, DCP 1),
/// decoding as a batch of one.
pub fn run_colocated_on<B: Backend>(be: &B, group: &ShardGroup<B>, prompt: &[u8], steps: u32) -> R<Trace> {
    run_colocated_forced_on(be, group, prompt, steps, &[])
}

/// [`run_colocated_on`] under teacher forcing: step i feeds `forced[i]` (the
/// true byte at position prompt + i) instead of the previous pick, while it
/// is given; the trace still records the model's own picks and logits.
pub fn run_colocated_forced_on<B: Backend>(be: &B, group: &ShardGroup<B>, prompt: &[u8], steps: u32, forced: &[u8]) -> R<Trace> {
    let (req, logits, tok) = prefill_local(be, group, prompt)?;
    let mut caches = LocalCaches::new(&group.dims, group.tp(), vec![req]);
    let mut trace = Trace { tokens: vec![tok], logits: vec![logits] };
    for i in 0..steps as usize {
        let prev = forced.get(i).copied().unwrap_or(trace.tokens[i]);
        let mut out = forward::decode_batch(be, group, &[prev], &[prompt.len() + i], &mut caches)?;
        let (logits, tok) = out.pop().ok_or_else(|| ModelError::Config("decode step returned nothing".into()))?;
        trace.tokens.push(tok);
        trace.logits.push(logits);
    }
    Ok(trace)
}

/// The colocated single-rank reference: the prompt and `steps` greedy decode
/// steps at TP1 on the CPU backend (the reference every placement is checked
/// against; the one place the model names a backend).
pub fn run_colocated(model: &Model, prompt: &[u8], steps: u32) -> R<Trace> {
    let be = handoff_kernels::CpuBackend::new();
    let group = model.upload_group(&be, 1)?;
    run_colocated_on(&be, &group, prompt, steps)
}
