//! The model as the engine's dispatch phase runs it: one [`Compute`] for the role
//! processes and `verify --compute`. A prefill stage computes its layers straight
//! into its registered source regions; decode runs one batched step for every live
//! request, reading and writing KV and state in its registered decode regions
//! through a [`RegionView`] (host memory on the CPU backend).

use crate::model::forward;
use crate::model::forward::ShardGroup;
use crate::model::ranks::{self, DecodeRanks, Layouts};
use crate::model::regions::RegionView;
use crate::model::{Model, ModelError};
use crate::transport::{RegionHandle, Transport};
use handoff_components::Topology;
use handoff_components::ecs::Lease;
use handoff_components::vocab::{LayerMark, ModuleLayer, PrefillRank, RankId, RegionKind};
use handoff_kernels::step::DecodeStep;
use handoff_kernels::{Backend, StreamMark};
use handoff_systems::dispatch::{Compute, ComputeError, DecodeItem, DecodeOutput, LayerHook, PrefillJob, PrefillOutput};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// The logits of every step of every request, kept when `verify` asks for them:
/// request id -> (step 0 = prefill's last position, then one per decode step).
pub type LogitTrace = Arc<Mutex<BTreeMap<u64, Vec<Vec<f32>>>>>;

fn model_err(e: ModelError) -> ComputeError {
    ComputeError::model(e)
}

/// The model on backend `B` for the ranks of one World.
pub struct ModelCompute<B: Backend> {
    topo: Topology,
    be: B,
    layouts: Layouts,
    view: Arc<dyn RegionView>,
    /// The prefill TP group's weights (a World holding a stage).
    prefill: Option<ShardGroup<B>>,
    /// The decode TP group's weights (a World holding the decode ranks).
    decode: Option<ShardGroup<B>>,
    /// The fused decode step (a device backend whose decode regions are in its
    /// memory): decode runs through it instead of the generic forward pass.
    step: Option<std::sync::Mutex<Box<dyn DecodeStep>>>,
    /// Why decode runs the generic forward pass, when it does.
    generic_reason: Option<crate::model::step::NoStep>,
    /// Every step's logits of every request (verify); the role processes keep
    /// none: a sampled request's logits go back with its step's output.
    trace: Option<LogitTrace>,
}

impl<B: Backend> ModelCompute<B> {
    /// `layouts`: every local region; the groups are uploaded for the sides present.
    pub fn new(topo: &Topology, be: B, layouts: Layouts, view: Arc<dyn RegionView>) -> Result<Self, ModelError> {
        let model = Model::new(topo)?;
        let has_prefill = layouts.keys().any(|(r, _)| matches!(r, RankId::Prefill(_)));
        let has_decode = layouts.keys().any(|(r, _)| matches!(r, RankId::Decode(_)));
        let prefill = if has_prefill { Some(model.upload_group(&be, topo.prefill().tp as usize)?) } else { None };
        let (mut step, mut generic_reason) = (None, None);
        if has_decode {
            match crate::model::step::open(&be, topo, &model, &layouts, view.as_ref()) {
                Ok(s) => {
                    tracing::info!(backend = be.name(), "{}", s.describe());
                    step = Some(std::sync::Mutex::new(s));
                }
                Err(why) => {
                    if be.name() != "cpu" {
                        tracing::info!(backend = be.name(), "decode runs the generic forward pass: {why}");
                    }
                    generic_reason = Some(why);
                }
            }
        }
        // The generic weights serve decode only without a fused step.
        let decode = if has_decode && step.is_none() { Some(model.upload_group(&be, topo.decode().tp as usize)?) } else { None };
        Ok(ModelCompute { topo: topo.clone(), be, layouts, view, prefill, decode, step, generic_reason, trace: None })
    }

    /// Keeps every step's logits in `trace` (verify compares them).
    pub fn with_trace(mut self, trace: LogitTrace) -> Self {
        self.trace = Some(trace);
        self
    }

    /// How decode runs here: the fused step's description, or why the generic
    /// forward pass runs.
    pub fn decode_path(&self) -> String {
        match (&self.step, &self.generic_reason) {
            (Some(s), _) => s.lock().map(|s| s.describe()).unwrap_or_else(|_| "fused decode step".into()),
            (None, Some(why)) => format!("generic forward pass ({why})"),
            (None, None) => "no decode ranks in this World".into(),
        }
    }

    /// Keeps `logits` in the trace (when there is one) and gives them back when
    /// the step asked for them (`asked`: a sampled request).
    fn record(&self, request: u64, logits: Vec<f32>, asked: bool) -> Option<Vec<f32>> {
        let Some(t) = &self.trace else { return asked.then_some(logits) };
        let back = asked.then(|| logits.clone());
        t.lock().unwrap_or_else(|p| p.into_inner()).entry(request).or_default().push(logits);
        back
    }

    /// One PP stage of a batch of requests (one job alone is a batch of one) as
    /// one forward pass over their prompts laid end to end: each rank's caches
    /// of each prompt go straight into its leased regions (scattered on the
    /// device when the regions live there), and the only host traffic is the
    /// hidden states for the next stage or the first tokens.
    ///
    /// With `on_layer` (layer-wise streaming), the hook hears of each layer as
    /// [`layer_ready`] says: on a device whose hook takes marks, with a mark
    /// recorded on the backend's stream after the layer (no host wait);
    /// otherwise once the layer's caches have landed.
    fn prefill_pass(&mut self, jobs: Vec<PrefillJob<'_>>, mut on_layer: Option<&mut LayerHook<'_>>) -> Result<Vec<PrefillOutput>, ComputeError> {
        let Some(first) = jobs.first() else { return Ok(Vec::new()) };
        let stage = first.stage;
        let group = self.prefill.as_ref().ok_or(ComputeError::MissingInput { stage, what: "prefill weights in this World" })?;
        if jobs.iter().any(|j| j.stage != stage) {
            return Err(ComputeError::MissingInput { stage, what: "one stage for every job of a prefill batch" });
        }
        let be = &self.be;
        let lens: Vec<usize> = jobs.iter().map(|j| j.tokens as usize).collect();
        let seqs = forward::PrefillSeq::packed(&lens, |t| ranks::prefill_record_tail(&self.topo, t));
        let d = group.dims.hidden;
        let mut h = if stage == 0 {
            let mut prompt = Vec::with_capacity(lens.iter().sum());
            for j in &jobs {
                if j.prompt.len() != j.tokens as usize {
                    return Err(ComputeError::MissingInput { stage, what: "a prompt of the request's token count" });
                }
                prompt.extend_from_slice(j.prompt);
            }
            forward::embed(be, group, &prompt).map_err(model_err)?
        } else {
            let mut hidden = Vec::with_capacity(lens.iter().sum::<usize>() * d);
            for j in &jobs {
                match j.hidden {
                    Some(x) if x.len() == j.tokens as usize * d => hidden.extend_from_slice(x),
                    _ => return Err(ComputeError::MissingInput { stage, what: "the previous stage's hidden states" }),
                }
            }
            be.upload(&hidden).map_err(|e| model_err(e.into()))?
        };
        let layers = self.topo.stage_layers[stage as usize].clone();
        let last = layers.end.saturating_sub(1) as usize;
        let (topo, layouts, view) = (&self.topo, &self.layouts, self.view.as_ref());
        let mut layer_done = |layer: usize| -> Result<(), ModelError> {
            if let Some(hook) = on_layer.as_deref_mut() {
                layer_ready(be, hook, ModuleLayer(layer as u32), layer == last)?;
            }
            Ok(())
        };
        let mut sink = |i: usize, tp: usize, layer: usize, cache: forward::PrefillCache<'_, B>| {
            let rank = PrefillRank { pp: stage, tp: tp as u32 };
            let lease = jobs[i]
                .leases
                .iter()
                .find(|l| l.rank == RankId::Prefill(rank))
                .ok_or_else(|| ModelError::Region(format!("request {}: no lease on prefill pp{stage} tp{tp}", jobs[i].request)))?;
            ranks::store_prefill(be, topo, layouts, view, rank, lease, layer, cache)
        };
        forward::prefill_batch_streamed(be, group, layers.start as usize..layers.end as usize, &mut h, &seqs, &mut sink, &mut layer_done).map_err(model_err)?;
        // Device regions were written on the backend's stream; the transport's
        // copies run on their own stream once the engine hands the request off,
        // so the writes must have landed first.
        be.synchronize().map_err(|e| model_err(e.into()))?;
        if stage as usize + 1 == self.topo.stage_layers.len() {
            let lasts = forward::logits_of_lasts(be, group, &h, &seqs).map_err(model_err)?;
            return Ok(jobs
                .iter()
                .zip(lasts)
                .map(|(j, (logits, first))| {
                    let logits = self.record(j.request, logits, j.logits);
                    PrefillOutput { hidden: Vec::new(), first_token: Some(first), logits }
                })
                .collect());
        }
        let hidden = be.download(&h).map_err(|e| model_err(e.into()))?;
        Ok(seqs.iter().map(|s| PrefillOutput { hidden: hidden[s.start * d..(s.start + s.len) * d].to_vec(), first_token: None, logits: None }).collect())
    }

    /// One decode step through the fused step. The batch's logits come back
    /// from the device only when a request samples (or verify keeps them).
    fn decode_fused(&mut self, batch: &[DecodeItem<'_>]) -> Result<DecodeOutput, ComputeError> {
        let rows: Vec<crate::model::step::TickRows<'_>> = batch.iter().map(|i| crate::model::step::TickRows::of(&i.leases)).collect();
        let reqs: Vec<_> = batch.iter().zip(&rows).map(|(i, r)| r.request(u32::from(i.token), i.pos)).collect();
        let want = self.trace.is_some() || batch.iter().any(|i| i.logits);
        let mut logits = Vec::new();
        let step = self.step.as_mut().ok_or(ComputeError::MissingInput { stage: 0, what: "the fused decode step" })?;
        let step = step.get_mut().map_err(|_| ComputeError::Poisoned("the fused decode step"))?;
        let ids = step.run(&reqs, want.then_some(&mut logits)).map_err(ComputeError::model)?;
        let mut out = DecodeOutput::from(ids.into_iter().map(|t| t.min(255) as u8).collect::<Vec<u8>>());
        if want {
            let v = logits.len() / batch.len().max(1);
            out.logits = batch.iter().enumerate().map(|(b, item)| self.record(item.request, logits[b * v..(b + 1) * v].to_vec(), item.logits)).collect();
        }
        Ok(out)
    }
}

/// What [`layer_ready`] needs of a backend: a layer mark, a host wait.
pub(crate) trait LayerQueue {
    fn mark_layer(&self) -> Result<Option<StreamMark>, ModelError>;
    fn synchronize(&self) -> Result<(), ModelError>;
}

impl<B: Backend> LayerQueue for B {
    fn mark_layer(&self) -> Result<Option<StreamMark>, ModelError> {
        Ok(Backend::mark_layer(self)?)
    }
    fn synchronize(&self) -> Result<(), ModelError> {
        Ok(Backend::synchronize(self)?)
    }
}

/// Tells `hook` that `layer`'s caches are queued into the source regions
/// (layer-wise streaming). Where the hook takes marks and the backend gives
/// one (a device), the hook gets a mark recorded on the backend's stream
/// after the layer, and the layer's copies wait on it on the device: the host
/// queues the next layer at once. Otherwise the host waits for the backend
/// first (a no-op on the CPU), so the layer has landed when the hook hears of
/// it. The stage's `last` layer is waited for on the host either way: the
/// pass waits for the device right after it (the hidden states or the logits
/// come back), and the stage's hand-off tail is timed from it.
pub(crate) fn layer_ready(be: &impl LayerQueue, hook: &mut LayerHook<'_>, layer: ModuleLayer, last: bool) -> Result<(), ModelError> {
    let mark = if hook.takes_marks && !last { be.mark_layer()? } else { None };
    if mark.is_none() {
        be.synchronize()?;
    }
    hook.layer_done(layer, mark.map(|m| LayerMark(m.0)));
    Ok(())
}

impl<B: Backend + 'static> Compute for ModelCompute<B> {
    fn prefill(&mut self, job: PrefillJob<'_>) -> Result<PrefillOutput, ComputeError> {
        let stage = job.stage;
        let mut out = self.prefill_pass(vec![job], None)?;
        out.pop().ok_or(ComputeError::MissingInput { stage, what: "a prefill output" })
    }

    fn prefill_batch(&mut self, jobs: Vec<PrefillJob<'_>>) -> Vec<Result<PrefillOutput, ComputeError>> {
        let n = jobs.len();
        match self.prefill_pass(jobs, None) {
            Ok(outs) => outs.into_iter().map(Ok).collect(),
            Err(e) => vec![Err(e); n],
        }
    }

    fn prefill_streamed(&mut self, jobs: Vec<PrefillJob<'_>>, on_layer: &mut LayerHook<'_>) -> Vec<Result<PrefillOutput, ComputeError>> {
        let n = jobs.len();
        match self.prefill_pass(jobs, Some(on_layer)) {
            Ok(outs) => outs.into_iter().map(Ok).collect(),
            Err(e) => vec![Err(e); n],
        }
    }

    fn decode(&mut self, batch: &[DecodeItem<'_>]) -> Result<DecodeOutput, ComputeError> {
        if self.step.is_some() {
            return self.decode_fused(batch);
        }
        let group = self.decode.as_ref().ok_or(ComputeError::MissingInput { stage: 0, what: "decode weights in this World" })?;
        let leases: Vec<Vec<Lease>> = batch.iter().map(|i| i.leases.iter().map(|&l| l.clone()).collect()).collect();
        let tokens: Vec<u8> = batch.iter().map(|i| i.token).collect();
        let positions: Vec<usize> = batch.iter().map(|i| i.pos as usize).collect();
        let mut caches = DecodeRanks::new(&self.topo, &self.layouts, self.view.as_ref(), leases);
        let out = forward::decode_batch(&self.be, group, &tokens, &positions, &mut caches).map_err(model_err)?;
        let mut picks = DecodeOutput { tokens: Vec::with_capacity(out.len()), logits: Vec::with_capacity(out.len()) };
        for (item, (logits, tok)) in batch.iter().zip(out) {
            picks.logits.push(self.record(item.request, logits, item.logits));
            picks.tokens.push(tok);
        }
        Ok(picks)
    }
}

/// The regions a role registered in its transport, as the model reads and writes
/// them: in place, through the transport's own access to its local regions.
pub struct TransportRegions {
    pub transport: Arc<dyn Transport>,
    pub handles: BTreeMap<(RankId, RegionKind), RegionHandle>,
}

impl TransportRegions {
    fn handle(&self, rank: RankId, kind: RegionKind) -> Result<&RegionHandle, ModelError> {
        self.handles.get(&(rank, kind)).ok_or_else(|| ModelError::Region(format!("{rank} registered no {kind} region")))
    }
}

impl RegionView for TransportRegions {
    fn with(&self, rank: RankId, kind: RegionKind, f: &mut dyn FnMut(&[u8])) -> Result<(), ModelError> {
        let h = self.handle(rank, kind)?;
        self.transport.with_region(h, f).map_err(|e| ModelError::Region(e.to_string()))
    }
    fn with_mut(&self, rank: RankId, kind: RegionKind, f: &mut dyn FnMut(&mut [u8])) -> Result<(), ModelError> {
        let h = self.handle(rank, kind)?;
        self.transport.with_region_mut(h, f).map_err(|e| ModelError::Region(e.to_string()))
    }
    fn device(&self, rank: RankId, kind: RegionKind) -> Option<handoff_kernels::DeviceRegion> {
        self.transport.device_region(self.handle(rank, kind).ok()?)
    }
}

/// Every region of `regions` by (rank, kind), as the model addresses them.
pub fn layouts_of(regions: &[handoff_components::ecs::Region]) -> Layouts {
    regions.iter().map(|r| ((r.rank, r.layout.kind), r.layout.clone())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A backend's queue as `layer_ready` sees it: `device` gives marks (a GPU
    /// with marks) or none (the CPU); every call is logged in order.
    struct Queue {
        device: bool,
        next: std::cell::Cell<u64>,
        log: RefCell<Vec<String>>,
    }

    impl LayerQueue for Queue {
        fn mark_layer(&self) -> Result<Option<StreamMark>, ModelError> {
            if !self.device {
                return Ok(None);
            }
            let m = self.next.get() + 1;
            self.next.set(m);
            self.log.borrow_mut().push(format!("mark {m}"));
            Ok(Some(StreamMark(m)))
        }
        fn synchronize(&self) -> Result<(), ModelError> {
            self.log.borrow_mut().push("synchronize".into());
            Ok(())
        }
    }

    /// Runs a stage of `layers` layers through `layer_ready`: the queue's log
    /// with each hook call in it ("hook L mark M" or "hook L").
    fn stage(device: bool, takes_marks: bool, layers: u32) -> Vec<String> {
        let q = Queue { device, next: Default::default(), log: RefCell::default() };
        let mut on_layer = |layer: ModuleLayer, mark: Option<LayerMark>| match mark {
            Some(m) => q.log.borrow_mut().push(format!("hook {} mark {}", layer.0, m.0)),
            None => q.log.borrow_mut().push(format!("hook {}", layer.0)),
        };
        let mut hook = LayerHook { takes_marks, on_layer: &mut on_layer };
        for l in 0..layers {
            layer_ready(&q, &mut hook, ModuleLayer(l), l + 1 == layers).unwrap();
        }
        q.log.take()
    }

    /// On a device whose hook takes marks, each layer but the stage's last is
    /// marked and handed to the hook with its mark, with no host wait; the
    /// last is waited for (the pass waits right after it anyway).
    #[test]
    fn a_device_stage_marks_its_layers_and_waits_only_after_the_last() {
        assert_eq!(stage(true, true, 3), ["mark 1", "hook 0 mark 1", "mark 2", "hook 1 mark 2", "synchronize", "hook 2"]);
    }

    /// A hook that takes no marks (a mover over host memory), or a backend
    /// without marks (the CPU): the layer has landed when the hook hears of
    /// it, as before marks.
    #[test]
    fn without_marks_each_layer_is_waited_for_before_its_hook() {
        let waited = ["synchronize", "hook 0", "synchronize", "hook 1"];
        assert_eq!(stage(true, false, 2), waited);
        assert_eq!(stage(false, true, 2), waited);
        assert_eq!(stage(false, false, 2), waited);
    }
}
