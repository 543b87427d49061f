//! `handoff verify --compute`: the invariant that disaggregated P/D decode computes
//! what a colocated single-rank run computes.
//!
//! The disaggregated path goes through the engine: the request is placed and split,
//! the dispatch phase runs each PP stage's TP ranks over their layers, writing their
//! caches into their own producer regions, the plans run as byte copies (the
//! oracle's counting copy), the tickets complete, and the dispatch phase decodes on
//! the TP x DCP ranks from their decode regions only. Greedy tokens must be equal at every step and the logits within
//! [`LOGIT_TOLERANCE`]: relative error of a step = max |a - b| / max |b| over the
//! vocabulary (b the reference), the report keeps the largest over all steps.
//!
//! Both paths run the same decode algorithm: MLA attention as f64 partials per DCP
//! rank merged in f64 (the colocated run is a DCP group of one), and ReplaySSM with
//! the same ring and commit schedule when `[model.replay]` is configured. So the
//! result holds for 16-bit caches too: in practice the logits are equal exactly,
//! whatever the PP, TP, DCP and interleave. Models whose f32 weights exceed
//! [`crate::model::weights::MAX_WEIGHT_BYTES`] are refused up front, naming the size.

use crate::engine::{Engine, QueueMover};
use crate::model::forward;
use crate::model::ranks::{self, DecodeRanks, Layouts};
use crate::model::{Model, Trace, run_colocated};
use crate::oracle::{self, Memory};
use handoff_components::Topology;
use handoff_components::ecs::{Outcome, Pools, Region, Status};
use handoff_components::ecs::Lease;
use handoff_systems::dispatch::{Compute, Dispatcher, Lease as DispatchLease};
use handoff_kernels::{Backend, CpuBackend};
use std::sync::{Arc, Mutex};
use handoff_components::plan::Plan;
use handoff_components::vocab::{DecodeRank, PrefillRank, RankId, RegionKind};
use handoff_systems::placement::{Capacity, alloc_blocks, blocks_for, free_blocks, owned_tokens};
use std::collections::BTreeMap;

/// Largest relative logit error accepted.
pub const LOGIT_TOLERANCE: f32 = 1e-4;

/// What a passing compute verification saw.
#[derive(Debug, Clone, Default)]
pub struct ComputeReport {
    pub prompt_tokens: usize,
    pub steps: u32,
    /// The greedy tokens both paths produced (prefill's pick, then one per step).
    pub tokens: Vec<u8>,
    /// Largest relative logit error over all steps, and the step where it occurred
    /// (0 = prefill's logits).
    pub max_rel_err: f32,
    pub worst_step: usize,
    pub descriptors: u64,
    pub bytes_transferred: u64,
    pub bytes_by_kind: BTreeMap<RegionKind, u64>,
}

/// Relative error of one logit vector: max |a - b| / max |b|. NaN anywhere gives infinity.
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
    let mut worst = 0.0f32;
    for (a, b) in got.iter().zip(want) {
        let e = (a - b).abs() / scale;
        if e.is_nan() {
            return f32::INFINITY;
        }
        worst = worst.max(e);
    }
    if got.len() != want.len() { f32::INFINITY } else { worst }
}

/// What registered memory holds before anything is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fill {
    /// The oracle's per-region canary: a byte nobody wrote decodes as garbage.
    #[default]
    Canary,
    /// Zeros: a state that was never transferred reads as a zero state (the quiet
    /// failure a public engine shipped).
    Zeros,
}

/// Runs `prompt` and `steps` decode steps colocated and disaggregated and compares.
/// `tamper` may edit the plans before they run (negative tests drop descriptors).
pub fn verify_compute(
    topo: &Topology,
    prompt: &[u8],
    steps: u32,
    tamper: impl FnMut(&mut Vec<Plan>),
) -> Result<ComputeReport, String> {
    verify_compute_with(topo, prompt, steps, Fill::Canary, tamper)
}

/// [`verify_compute`] with a choice of what unwritten memory holds.
pub fn verify_compute_with(
    topo: &Topology,
    prompt: &[u8],
    steps: u32,
    fill: Fill,
    tamper: impl FnMut(&mut Vec<Plan>),
) -> Result<ComputeReport, String> {
    // Refuses models whose weights exceed the CPU path's limit, naming the size.
    let model = Model::new(topo).map_err(|e| e.to_string())?;
    let reference = run_colocated(&model, prompt, steps).map_err(|e| format!("colocated reference: {e}"))?;
    let model = Arc::new(model);
    let (got, mut report) = run_disaggregated(topo, model.clone(), prompt, steps, fill, tamper)?;
    compare(&reference, &got, &mut report)?;
    report.tokens = reference.tokens;
    Ok(report)
}

fn compare(want: &Trace, got: &Trace, report: &mut ComputeReport) -> Result<(), String> {
    let mut first_bad_token = None;
    let mut first_bad_logits = None;
    for i in 0..want.logits.len().max(got.logits.len()) {
        let e = match (got.logits.get(i), want.logits.get(i)) {
            (Some(a), Some(b)) => rel_err(a, b),
            _ => f32::INFINITY,
        };
        // NaN counts as the worst error.
        if e.is_nan() || e > report.max_rel_err {
            report.max_rel_err = e;
            report.worst_step = i;
        }
        if (e.is_nan() || e > LOGIT_TOLERANCE) && first_bad_logits.is_none() {
            first_bad_logits = Some((i, e));
        }
        if got.tokens.get(i) != want.tokens.get(i) && first_bad_token.is_none() {
            first_bad_token = Some(i);
        }
    }
    if first_bad_token.is_none() && first_bad_logits.is_none() {
        return Ok(());
    }
    let mut msg = String::from("disaggregated decode diverged from the colocated run:");
    if let Some(i) = first_bad_token {
        msg += &format!(
            " tokens diverged first at step {i} (colocated {:?}, disaggregated {:?});",
            want.tokens.get(i),
            got.tokens.get(i)
        );
    }
    if let Some((i, e)) = first_bad_logits {
        msg += &format!(" logits diverged first at step {i} (relative error {e:.3e} > {LOGIT_TOLERANCE:.0e});");
    }
    msg += &format!(
        " max logit relative error {:.3e} at step {} of {} (step 0 = prefill)",
        report.max_rel_err,
        report.worst_step,
        want.logits.len().saturating_sub(1)
    );
    Err(msg)
}

fn fail_on_outcomes(engine: &mut Engine) -> Result<(), String> {
    for Outcome { request, result } in engine.take_outcomes() {
        if let Err((phase, reason)) = result {
            return Err(format!("request {request} failed in {}: {reason}", phase.name()));
        }
    }
    Ok(())
}

/// The model as the engine's dispatch phase runs it: each prefill stage computes its
/// layers into its producer regions (hidden states kept between stages), and decode
/// runs from the decode regions the transfer wrote.
struct ModelCompute {
    topo: Topology,
    model: Arc<Model>,
    layouts: Layouts,
    mem: Arc<Mutex<Memory>>,
    prompt: Vec<u8>,
    steps: u32,
    be: CpuBackend,
    /// Hidden states between PP stages, as they travel between stage processes.
    hidden: BTreeMap<u64, Vec<f32>>,
    trace: Arc<Mutex<Option<Trace>>>,
}

fn lease_map(leases: &[DispatchLease]) -> BTreeMap<RankId, Lease> {
    leases.iter().map(|(rank, blocks, slot)| (*rank, Lease { rank: *rank, blocks: blocks.clone(), slot: *slot })).collect()
}

impl Compute for ModelCompute {
    fn prefill(&mut self, request: u64, tokens: u64, stage: u32, leases: &[DispatchLease]) -> Result<(), String> {
        let me = |e: crate::model::ModelError| e.to_string();
        let t = tokens as usize;
        let ModelCompute { topo, model, layouts, mem, prompt, be, hidden, trace, .. } = self;
        if prompt.len() != t {
            return Err(format!("request {request} has {t} tokens, the compute was given a {}-token prompt", prompt.len()));
        }
        let group = model.upload_group(be, topo.prefill().tp as usize).map_err(me)?;
        let mut h = match stage {
            0 => forward::embed(be, &group, prompt).map_err(me)?,
            _ => be
                .upload(&hidden.remove(&request).ok_or_else(|| format!("stage {stage} ran before stage {}", stage - 1))?)
                .map_err(|e| e.to_string())?,
        };
        let leases = lease_map(leases);
        let tail = ranks::prefill_record_tail(topo, t);
        let layers = topo.stage_layers[stage as usize].clone();
        let view: &Mutex<Memory> = mem;
        forward::prefill_layers(be, &group, layers.start as usize..layers.end as usize, &mut h, t, tail, &mut |tp, layer, cache| {
            let rank = PrefillRank { pp: stage, tp: tp as u32 };
            let lease = leases
                .get(&RankId::Prefill(rank))
                .ok_or_else(|| crate::model::ModelError::Region(format!("no lease on prefill pp{stage} tp{tp}")))?;
            ranks::store_prefill(topo, layouts, view, rank, lease, layer, cache)
        })
        .map_err(me)?;
        if stage as usize + 1 == topo.stage_layers.len() {
            let (logits, first) = forward::logits_of_last(be, &group, &h, t).map_err(me)?;
            *trace.lock().map_err(|e| e.to_string())? = Some(Trace { tokens: vec![first], logits: vec![logits] });
        } else {
            hidden.insert(request, be.download(&h).map_err(|e| e.to_string())?);
        }
        Ok(())
    }

    fn decode(&mut self, _request: u64, tokens: u64, leases: &[DispatchLease], pools: &mut Pools) -> Result<(), String> {
        let me = |e: crate::model::ModelError| e.to_string();
        let ModelCompute { topo, model, layouts, mem, steps, be, trace, .. } = self;
        let t = tokens as usize;
        let total = tokens + *steps as u64;
        let leases = lease_map(leases);
        // Decode block tables grow from each rank's pool to hold prompt + steps tokens.
        let d = topo.decode();
        let mut decode_leases = Vec::new();
        let mut grown: Vec<(RankId, Vec<u32>)> = Vec::new();
        for tp in 0..d.tp {
            let rank = DecodeRank { tp };
            let rid = RankId::Decode(rank);
            let mut lease = leases.get(&rid).cloned().ok_or_else(|| format!("no lease on decode tp{tp}"))?;
            let need = blocks_for(owned_tokens(total, d.dcp, rank.dcp_rank(d.dcp), d.interleave), d.block_size) as usize;
            if need > lease.blocks.len() {
                let pool = pools.0.get_mut(&rid).ok_or_else(|| format!("no pool on decode tp{tp}"))?;
                let more = alloc_blocks(pool, (need - lease.blocks.len()) as u32)
                    .ok_or_else(|| format!("decode tp{tp}: no free blocks for {need} blocks of prompt + steps"))?;
                lease.blocks.extend_from_slice(&more);
                grown.push((rid, more));
            }
            decode_leases.push(lease);
        }
        let dgroup = model.upload_group(be, d.tp as usize).map_err(me)?;
        let mut guard = trace.lock().map_err(|e| e.to_string())?;
        let trace = guard.as_mut().ok_or("decode ran before prefill produced the first token")?;
        let view: &Mutex<Memory> = mem;
        let result = (|| {
            let mut caches = DecodeRanks::new(topo, layouts, view, vec![decode_leases]);
            for i in 0..*steps as usize {
                let prev = trace.tokens[i];
                let (logits, tok) = forward::decode_batch(be, &dgroup, &[prev], &[t + i], &mut caches)
                    .map_err(|e| format!("decode step {}: {e}", i + 1))?
                    .pop()
                    .ok_or_else(|| format!("decode step {}: no result", i + 1))?;
                trace.tokens.push(tok);
                trace.logits.push(logits);
            }
            Ok(())
        })();
        for (rid, blocks) in &grown {
            if let Some(pool) = pools.0.get_mut(rid) {
                free_blocks(pool, blocks);
            }
        }
        result
    }
}

/// The disaggregated run through the engine: its dispatch phase computes the prefill
/// stages and the decode, its transfer phase hands the plans to the caller, which runs
/// them as the oracle's counting copy.
fn run_disaggregated(
    topo: &Topology,
    model: Arc<Model>,
    prompt: &[u8],
    steps: u32,
    fill: Fill,
    mut tamper: impl FnMut(&mut Vec<Plan>),
) -> Result<(Trace, ComputeReport), String> {
    let t = prompt.len();
    if t == 0 {
        return Err("empty prompt".into());
    }
    if let Err(reason) = topo.admits_transfer_mode() {
        return Err(format!("refused at admission: {reason}"));
    }
    let total = t as u64 + steps as u64;
    let cap = Capacity::for_requests(topo, 1, total);
    let mover = QueueMover::default();
    let mut engine = Engine::new(topo.clone(), cap, Box::new(mover.clone()));
    engine.tick();

    let mut mem = Memory::new();
    let mut layouts = Layouts::new();
    let mut q = engine.world.query::<&Region>();
    for r in q.iter(&engine.world) {
        let mut buf = vec![0u8; r.layout.len as usize];
        if fill == Fill::Canary {
            oracle::fill_canary(r.rank, r.layout.kind, &mut buf);
        }
        mem.insert((r.rank, r.layout.kind), buf);
        layouts.insert((r.rank, r.layout.kind), r.layout.clone());
    }
    let mem = Arc::new(Mutex::new(mem));
    let trace = Arc::new(Mutex::new(None));
    engine.world.insert_resource(Dispatcher(Box::new(ModelCompute {
        topo: topo.clone(),
        model,
        layouts,
        mem: mem.clone(),
        prompt: prompt.to_vec(),
        steps,
        be: CpuBackend::new(),
        hidden: BTreeMap::new(),
        trace: trace.clone(),
    })));

    // Tick 1: admission, placement, splitting; dispatch computes every prefill stage.
    let id = 1;
    engine.submit(id, t as u64);
    engine.tick();
    fail_on_outcomes(&mut engine)?;
    match engine.status(id) {
        Some(Status::Planned) => {}
        Some(Status::Failed { phase, reason }) => return Err(format!("request {id} failed in {}: {reason}", phase.name())),
        other => return Err(format!("request {id} was not planned after one tick: {other:?}")),
    }

    // Tick 2: the transfer phase submits every stage's plans; they run as byte copies.
    engine.tick();
    let submitted = mover.take_submitted();
    let mut plans: Vec<Plan> = submitted.iter().map(|(_, p)| p.clone()).collect();
    let mut report = ComputeReport { prompt_tokens: t, steps, ..Default::default() };
    report.descriptors = plans.iter().map(|p| p.descriptors.len() as u64).sum();
    tamper(&mut plans);
    {
        let mut mem = mem.lock().map_err(|e| e.to_string())?;
        let exec = oracle::execute_counted(&plans, &mut mem).map_err(|e| format!("plan execution refused: {e}"))?;
        report.bytes_transferred = exec.bytes;
        for ((_, kind), b) in &exec.written {
            *report.bytes_by_kind.entry(*kind).or_default() += b;
        }
    }
    for (ticket, _) in &submitted {
        mover.complete(*ticket, Ok(()));
    }

    // Tick 3: release sees every report (handed off); dispatch decodes. Tick 4: retire.
    engine.tick();
    let mut outcomes = engine.take_outcomes();
    engine.tick();
    outcomes.extend(engine.take_outcomes());
    if let Some(Outcome { result: Err((phase, reason)), .. }) = outcomes.iter().find(|o| o.result.is_err()) {
        return Err(format!("request {id} failed in {}: {reason}", phase.name()));
    }
    if !outcomes.iter().any(|o| o.request == id && o.result.is_ok()) {
        return Err(format!("request {id} did not complete its hand-off: {:?} {outcomes:?}", engine.status(id)));
    }
    if engine.entity_of(id).is_some() {
        return Err(format!("request {id} was not released after decode: {:?}", engine.status(id)));
    }
    let trace = trace.lock().map_err(|e| e.to_string())?.take().ok_or("prefill produced no token")?;
    Ok((trace, report))
}
