//! Dispatch: the compute. A prefill stage computes planned requests' layers into
//! its registered source regions, the oldest ready request and those ready at
//! the same stage after it as one batch of at most `serve.prefill_batch_tokens`
//! prompt tokens a tick (so the transfer phase of the next tick submits their
//! writes while the stage computes the next batch); decode runs one step for every live handed-off request as one
//! batch (continuous batching), growing block tables as positions pass them. The
//! model lives behind `Compute`, so the phase stays plain scheduling.

pub use crate::error::ErrorSource;
use crate::placement::{alloc_blocks, blocks_needed};
use crate::sampling::choose;
use crate::transfer::{Mover, Ticket, Transfers, move_failure, submit_parts};
use bevy_ecs::prelude::*;
use handoff_components::ecs::*;
use handoff_components::failure::{Cause, Failure, ProcessRole};
use handoff_components::sampling::Sampling;
use handoff_components::vocab::{LayerMark, ModuleLayer, RankId};
use std::sync::Arc;
use std::time::Instant;
use thiserror::Error;

/// Why the compute failed a request (or a batch).
#[derive(Debug, Clone, Error)]
pub enum ComputeError {
    #[error("stage {stage} has no input: {what}")]
    MissingInput { stage: u32, what: &'static str },
    #[error("no lease on {0}")]
    MissingLease(RankId),
    #[error("{rank}: no free blocks for {tokens} tokens")]
    OutOfBlocks { rank: RankId, tokens: u64 },
    /// The model or its kernels refused; their own error.
    #[error("{0}")]
    Model(#[source] ErrorSource),
    /// A step of the compute's own (a per-step probe, a snapshot) failed.
    #[error("{what}: {source}")]
    Step { what: &'static str, source: ErrorSource },
    #[error("{0}'s lock is poisoned")]
    Poisoned(&'static str),
}

impl ComputeError {
    /// The model's (or a kernel's) own error.
    pub fn model(e: impl std::error::Error + Send + Sync + 'static) -> ComputeError {
        ComputeError::Model(Arc::new(e))
    }

    /// What a request that this error failed fails with.
    pub fn cause(&self) -> Cause {
        match self {
            ComputeError::OutOfBlocks { .. } => Cause::Capacity { detail: self.to_string() },
            _ => Cause::Compute { detail: self.to_string() },
        }
    }
}

/// One PP stage of one request, as the compute sees it.
#[derive(Debug)]
pub struct PrefillJob<'a> {
    pub request: u64,
    pub stage: u32,
    /// Prompt tokens (the rows of the hidden states).
    pub tokens: u64,
    /// The prompt itself (stage 0 embeds it; later stages may get it empty).
    pub prompt: &'a [u8],
    /// The previous stage's hidden states (stage > 0).
    pub hidden: Option<&'a [f32]>,
    /// The stage's leases (one per TP rank).
    pub leases: Vec<&'a Lease>,
    /// The request samples its first token: the last stage returns the logits
    /// of the prompt's last position ([`PrefillOutput::logits`]).
    pub logits: bool,
}

/// What a stage's compute leaves besides its caches.
#[derive(Debug, Clone, Default)]
pub struct PrefillOutput {
    /// Hidden states `[tokens, hidden]` for the next stage (empty after the last).
    pub hidden: Vec<f32>,
    /// The greedy pick at the prompt's last position (last stage).
    pub first_token: Option<u8>,
    /// The logits at the prompt's last position, when the job asked for them
    /// (last stage): the dispatch phase samples token 0 from them.
    pub logits: Option<Vec<f32>>,
}

/// One request of a decode batch: feed `token` at position `pos`.
#[derive(Debug)]
pub struct DecodeItem<'a> {
    pub request: u64,
    pub token: u8,
    pub pos: u64,
    /// The request's lease on every decode rank, in TP order; blocks cover `pos`.
    pub leases: Vec<&'a Lease>,
    /// The request samples: return this step's logits ([`DecodeOutput::logits`]).
    pub logits: bool,
}

/// What one decode step gives back.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodeOutput {
    /// The greedy token of each request, in batch order.
    pub tokens: Vec<u8>,
    /// In batch order, the step's logits of each request whose item asked for
    /// them, None for the others; empty when none asked. The dispatch phase
    /// samples those requests' tokens from them: only the sampled requests'
    /// logits leave the device.
    pub logits: Vec<Option<Vec<f32>>>,
}

impl From<Vec<u8>> for DecodeOutput {
    fn from(tokens: Vec<u8>) -> Self {
        DecodeOutput { tokens, logits: Vec::new() }
    }
}

/// A stage's layer hook (layer-wise streaming): the compute calls it with each
/// module layer of the stage, in order, before it computes the next layer,
/// once every job's caches of that layer are in the stage's source regions
/// (mark None), or, on a device and where the hook takes marks, once they
/// are queued there, with the mark the compute recorded on its stream after
/// them: the layer's writes then wait on the mark on the device, and the
/// host never waits for a layer. The dispatch phase issues that layer's
/// writes from it.
pub struct LayerHook<'h> {
    /// Whether the hook's writes can wait on a [`LayerMark`] on the device
    /// ([`crate::transfer::Mover::takes_marks`]); without it the compute
    /// waits for each layer (a host wait on a device) and gives no mark.
    pub takes_marks: bool,
    /// Called with each layer, and its mark where the compute gave one.
    pub on_layer: &'h mut dyn FnMut(ModuleLayer, Option<LayerMark>),
}

impl<'h> LayerHook<'h> {
    /// A hook that takes no marks: each layer is in the regions when it is called.
    pub fn new(on_layer: &'h mut dyn FnMut(ModuleLayer, Option<LayerMark>)) -> Self {
        LayerHook { takes_marks: false, on_layer }
    }

    /// Tells the hook that `layer` is done (`mark`: see [`LayerHook`]).
    pub fn layer_done(&mut self, layer: ModuleLayer, mark: Option<LayerMark>) {
        (self.on_layer)(layer, mark)
    }
}

/// The compute of the prefill stages and the decode ranks.
pub trait Compute: Send + Sync + 'static {
    /// Runs PP stage `job.stage` of a request (every TP rank of the stage), writing
    /// the stage's KV rows and state into its producer regions.
    fn prefill(&mut self, job: PrefillJob<'_>) -> Result<PrefillOutput, ComputeError>;
    /// Runs one PP stage of several requests as one pass; a result per job, in
    /// job order, each what [`Compute::prefill`] gives that job alone. The
    /// default runs them one by one.
    fn prefill_batch(&mut self, jobs: Vec<PrefillJob<'_>>) -> Vec<Result<PrefillOutput, ComputeError>> {
        jobs.into_iter().map(|j| self.prefill(j)).collect()
    }
    /// [`Compute::prefill_batch`], calling `on_layer` as each layer's caches
    /// land ([`LayerHook`]). The default calls it never: the stage's writes
    /// then go out once the whole pass is done, as without streaming.
    fn prefill_streamed(&mut self, jobs: Vec<PrefillJob<'_>>, on_layer: &mut LayerHook<'_>) -> Vec<Result<PrefillOutput, ComputeError>> {
        let _ = on_layer;
        self.prefill_batch(jobs)
    }
    /// One decode step for every request of the batch, reading and writing KV and
    /// state in the decode regions; the greedy token of each, in batch order, and
    /// the logits of the items that ask for them.
    fn decode(&mut self, batch: &[DecodeItem<'_>]) -> Result<DecodeOutput, ComputeError>;
}

/// The engine's compute, when it has one.
#[derive(Resource)]
pub struct Dispatcher(pub Box<dyn Compute>);

/// Runs the oldest planned request's next local stage whose input is there,
/// batched with the requests ready at the same stage after it (by id) while
/// their prompt tokens fit `serve.prefill_batch_tokens` (the first always
/// runs). Stage s + 1 of the same World reads stage s's hidden states from
/// `Inputs`; a stage whose successor lives elsewhere hands them out as
/// `EngineEvent::Computed`. A request with [`Sampling`] gets its first token
/// sampled from the last position's logits, the others the model's greedy pick.
///
/// With layer-wise streaming (`[prefill] layer_streaming`) the compute calls a
/// [`LayerHook`] after each layer, and the parts of the batch's plans up to
/// that layer go to the mover at once (`stream_layer`), while the next layers
/// compute; the transfer phase submits whatever is left once the stage is
/// computed. The time the last layer finished is kept ([`LastLayerAt`]): the
/// stage's hand-off tail runs from it to the write-done report.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub fn run_prefill(
    mut commands: Commands,
    dispatcher: Option<ResMut<Dispatcher>>,
    mut requests: Query<(
        Entity,
        &Request,
        &mut Status,
        &mut StagesComputed,
        &Holdings,
        &mut Inputs,
        Option<&RemoteConsumers>,
        Option<&Sampling>,
        Option<&mut LastLayerAt>,
    )>,
    leases: Query<&Lease>,
    mut plans: Query<&mut PlanEntry>,
    mut transfers: Option<ResMut<Transfers>>,
    local: Res<LocalRanks>,
    topo: Res<TopologyRes>,
    mut events: MessageWriter<EngineEvent>,
) {
    let Some(mut dispatcher) = dispatcher else { return };
    let pp = topo.0.config.prefill.pp;
    let budget = u64::from(topo.0.config.serve.prefill_batch_tokens);
    let ready =
        |computed: &StagesComputed, inputs: &Inputs| local.stages.iter().copied().find(|&s| !computed.0[s as usize] && (s == 0 || inputs.hidden.is_some()));
    let mut cands: Vec<(u64, Entity, u32, u64)> = requests
        .iter()
        .filter(|(_, _, st, ..)| **st == Status::Planned)
        .filter_map(|(e, r, _, c, _, i, ..)| ready(c, i).map(|s| (r.id, e, s, r.tokens)))
        .collect();
    cands.sort_unstable();
    let Some(&(_, _, stage, _)) = cands.first() else { return };
    let mut batch = Vec::new();
    let mut tokens = 0u64;
    for &(_, e, s, t) in &cands {
        if s != stage {
            continue;
        }
        if !batch.is_empty() && tokens + t > budget {
            break;
        }
        tokens += t;
        batch.push(e);
    }
    let last_layer = topo.0.stage_layers.get(stage as usize).and_then(|r| r.end.checked_sub(1)).map(ModuleLayer);
    let streaming = topo.0.config.prefill.streams_layers();
    let mut last_at: Option<Instant> = None;
    let started = Instant::now();
    let mut failed: Vec<(Entity, Failure)> = Vec::new();
    let (batch, mut outs) = {
        let rows: Vec<_> = batch.iter().filter_map(|&e| requests.get(e).ok()).collect();
        let ents: Vec<Entity> = rows.iter().map(|r| r.0).collect();
        let jobs: Vec<PrefillJob<'_>> = rows.iter().map(|(_, req, _, _, h, i, _, smp, _)| stage_job(stage, req, h, i, *smp, &leases)).collect();
        let outs = match transfers.as_deref_mut().filter(|_| streaming) {
            Some(t) => {
                let owners: Vec<(Entity, &Request, &Holdings)> = rows.iter().map(|r| (r.0, r.1, r.4)).collect();
                let takes_marks = t.0.takes_marks();
                let mut on_layer = |layer: ModuleLayer, mark: Option<LayerMark>| {
                    stream_layer(t.0.as_mut(), &mut plans, &owners, stage, layer, mark, &mut failed);
                    if Some(layer) == last_layer {
                        last_at = Some(Instant::now());
                    }
                };
                dispatcher.0.prefill_streamed(jobs, &mut LayerHook { takes_marks, on_layer: &mut on_layer })
            }
            None => dispatcher.0.prefill_batch(jobs),
        };
        (ents, outs)
    };
    // A batch fails as a whole (one pass), so a job of a failed batch runs
    // again alone: one bad request costs only itself. (Parts its layers
    // submitted during the failed pass are not submitted again; the rerun
    // writes the same bits into the same sources, a prompt's bits not
    // depending on its batch.)
    let mut reran = false;
    if batch.len() > 1 {
        for (&e, out) in batch.iter().zip(outs.iter_mut()) {
            if out.is_err()
                && let Ok((_, req, _, _, h, i, _, smp, _)) = requests.get(e)
            {
                *out = dispatcher.0.prefill(stage_job(stage, req, h, i, smp, &leases));
                reran = true;
            }
        }
    }
    // Without a hook call for the last layer (no streaming, a compute without
    // hooks) or after a rerun, the last layer was done when the compute returned.
    let last_at = match last_at {
        Some(at) if !reran => at,
        _ => Instant::now(),
    };
    for (&e, out) in batch.iter().zip(outs) {
        let Ok((e, req, mut status, mut computed, _, mut inputs, remote, sampling, last_layer_at)) = requests.get_mut(e) else { continue };
        if let Some((_, failure)) = failed.iter().find(|(f, _)| *f == e) {
            *status = Status::Failed(failure.clone());
            continue;
        }
        match out {
            Ok(out) => {
                computed.0[stage as usize] = true;
                if let Some(mut at) = last_layer_at
                    && let Some(slot) = at.0.get_mut(stage as usize)
                {
                    let compute_us = last_at.saturating_duration_since(started).as_micros() as u64;
                    *slot = Some(StageCompute { last_layer: last_at, compute_us });
                }
                if let Some(greedy) = out.first_token {
                    commands.entity(e).insert(FirstToken(choose(greedy, sampling, out.logits.as_deref(), 0)));
                }
                if stage + 1 < pp {
                    if local.has_stage(stage + 1) {
                        inputs.hidden = Some(out.hidden);
                    } else {
                        inputs.hidden = None;
                        let consumers = remote.map(|r| r.0.clone()).unwrap_or_default();
                        let sampling = sampling.copied();
                        events.write(EngineEvent::Computed {
                            request: req.id,
                            nonce: req.nonce,
                            stage,
                            tokens: req.tokens,
                            hidden: out.hidden,
                            consumers,
                            sampling,
                        });
                    }
                }
            }
            Err(e) => *status = Status::Failed(Failure::new(PhaseName::Compute, ProcessRole::Prefill { stage }, e.cause())),
        }
    }
}

/// Layer-wise streaming, the dispatch phase's side: `layer` of every request
/// of the batch is in the stage's source regions, so the parts of the stage's
/// plans up to that layer go to the mover now ([`submit_parts`]), while the
/// next layers compute. A request whose part could not be submitted goes into
/// `failed` (and gets no further part).
fn stream_layer(
    mover: &mut dyn Mover,
    plans: &mut Query<&mut PlanEntry>,
    owners: &[(Entity, &Request, &Holdings)],
    stage: u32,
    layer: ModuleLayer,
    mark: Option<LayerMark>,
    failed: &mut Vec<(Entity, Failure)>,
) {
    for &(e, req, holdings) in owners {
        if failed.iter().any(|(f, _)| *f == e) {
            continue;
        }
        for &p in &holdings.plans {
            let Ok(mut entry) = plans.get_mut(p) else { continue };
            if entry.plan.producer.pp != stage {
                continue;
            }
            if let Err(err) = submit_parts(mover, req, &mut entry, Some(layer), mark) {
                let ticket = Ticket { request: req.id, nonce: req.nonce, producer: entry.plan.producer, consumer: entry.plan.consumer, part: entry.submitted };
                failed.push((e, move_failure(&ticket, "submit", &err)));
                break;
            }
        }
    }
}

/// The job of `req` at `stage`: its prompt or hidden states and its leases on
/// the stage's ranks.
fn stage_job<'a>(
    stage: u32,
    req: &'a Request,
    holdings: &'a Holdings,
    inputs: &'a Inputs,
    sampling: Option<&Sampling>,
    leases: &'a Query<&Lease>,
) -> PrefillJob<'a> {
    let leases = holdings.leases.iter().filter_map(|&l| leases.get(l).ok()).filter(|l| matches!(l.rank, RankId::Prefill(p) if p.pp == stage)).collect();
    PrefillJob { request: req.id, stage, tokens: req.tokens, prompt: &inputs.prompt, hidden: inputs.hidden.as_deref(), leases, logits: sampling.is_some() }
}

/// Blocks for generated tokens: each decoding request's block tables grow from the
/// rank's pool as its next position passes them.
#[allow(clippy::type_complexity)]
pub fn grow_leases(
    mut requests: Query<(&Request, &mut Status, &DecodeProgress, &Holdings)>,
    mut leases: Query<&mut Lease>,
    mut pools: ResMut<Pools>,
    topo: Res<TopologyRes>,
) {
    let topo = &topo.0;
    for (req, mut status, generation, holdings) in requests.iter_mut() {
        if *status != Status::HandedOff || generation.last.is_none() {
            continue;
        }
        // The token fed next sits at position prompt + emitted - 1.
        let tokens = req.tokens + generation.emitted as u64;
        for &l in &holdings.leases {
            let Ok(mut lease) = leases.get_mut(l) else { continue };
            let need = blocks_needed(topo, lease.rank, tokens) as usize;
            if need <= lease.blocks.len() {
                continue;
            }
            let more = pools.0.get_mut(&lease.rank).and_then(|p| alloc_blocks(p, (need - lease.blocks.len()) as u32));
            match more {
                Some(more) => lease.blocks.extend(more),
                None => {
                    let e = ComputeError::OutOfBlocks { rank: lease.rank, tokens };
                    *status = Status::Failed(Failure::new(PhaseName::Decode, ProcessRole::Decode, e.cause()));
                    break;
                }
            }
        }
    }
}

/// One decode step for every handed-off request (up to `serve.max_batch`, those
/// stepped longest ago first) as one batch; each token leaves as `EngineEvent::Token`, and
/// a request that emitted its last token is finished (release frees it next tick).
/// A request with [`Sampling`] keeps the token sampled from its step's logits.
#[allow(clippy::type_complexity)]
pub fn run_decode(
    dispatcher: Option<ResMut<Dispatcher>>,
    mut requests: Query<(Entity, &Request, &mut Status, &mut DecodeProgress, &Holdings, Option<&Sampling>)>,
    leases: Query<&Lease>,
    forced: Query<&Forced>,
    topo: Res<TopologyRes>,
    mut tick: Local<u64>,
    mut events: MessageWriter<EngineEvent>,
) {
    let Some(mut dispatcher) = dispatcher else { return };
    *tick += 1;
    let mut live: Vec<(u64, u64, Entity)> = requests
        .iter()
        .filter(|(_, _, s, g, ..)| **s == Status::HandedOff && g.last.is_some() && g.emitted < g.max_tokens)
        .map(|(e, r, _, g, ..)| (g.stepped, r.id, e))
        .collect();
    if live.is_empty() {
        return;
    }
    live.sort_unstable();
    live.truncate(topo.0.config.serve.batch() as usize);
    let mut batch = Vec::with_capacity(live.len());
    for &(_, _, e) in &live {
        let Ok((_, req, _, generation, holdings, sampling)) = requests.get(e) else { continue };
        let mut held: Vec<&Lease> = holdings.leases.iter().filter_map(|&l| leases.get(l).ok()).filter(|l| matches!(l.rank, RankId::Decode(_))).collect();
        held.sort_by_key(|l| l.rank);
        // Teacher forcing feeds the true byte of this position instead of the pick.
        let truth = forced.get(e).ok().and_then(|f| f.0.get(generation.emitted.saturating_sub(1) as usize).copied());
        let token = truth.or(generation.last).unwrap_or(0);
        let pos = req.tokens + generation.emitted as u64 - 1;
        batch.push(DecodeItem { request: req.id, token, pos, leases: held, logits: sampling.is_some() });
    }
    let result = dispatcher.0.decode(&batch);
    drop(batch);
    for (i, &(_, _, e)) in live.iter().enumerate() {
        let Ok((_, req, mut status, mut generation, _, sampling)) = requests.get_mut(e) else { continue };
        generation.stepped = *tick;
        match &result {
            Ok(out) => {
                let Some(&greedy) = out.tokens.get(i) else {
                    let detail = format!("the compute returned {} tokens for a batch of {}", out.tokens.len(), live.len());
                    *status = Status::Failed(Failure::new(PhaseName::Decode, ProcessRole::Decode, Cause::Compute { detail }));
                    continue;
                };
                // Token k of the request is step k of its draws (token 0 came
                // from the last prefill stage).
                let logits = out.logits.get(i).and_then(|l| l.as_deref());
                let tok = choose(greedy, sampling, logits, generation.emitted);
                events.write(EngineEvent::Token { request: req.id, index: generation.emitted, token: tok });
                generation.last = Some(tok);
                generation.emitted += 1;
                if generation.emitted >= generation.max_tokens {
                    *status = Status::Finished;
                }
            }
            Err(e) => {
                let cause = match e.cause() {
                    Cause::Compute { detail } => Cause::Compute { detail: format!("decode step: {detail}") },
                    other => other,
                };
                *status = Status::Failed(Failure::new(PhaseName::Decode, ProcessRole::Decode, cause));
            }
        }
    }
}
