//! `handoff verify --compute`: the invariant that disaggregated P/D decode computes
//! what a colocated single-rank run computes.
//!
//! The disaggregated path goes through the engine: the request is placed and split,
//! each PP stage's TP ranks compute their layers and write their caches into their
//! own producer regions, the plans run as byte copies (the oracle's counting copy),
//! the tickets complete, and the decode TP x DCP ranks decode from their decode
//! regions only. Greedy tokens must be equal at every step and the logits within
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
use crate::model::ranks::{self, DecodeRanks, Layouts, Lease};
use crate::model::{Model, Trace, run_colocated};
use crate::oracle::{self, Memory};
use handoff_components::Topology;
use handoff_components::ecs::{Outcome, Pools, Region, Status};
use handoff_components::plan::Plan;
use handoff_components::vocab::{DecodeRank, PrefillRank, RankId, RegionKind};
use handoff_kernels::CpuBackend;
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
    let (got, mut report) = run_disaggregated(topo, &model, prompt, steps, fill, tamper)?;
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

/// The disaggregated run through the engine.
fn run_disaggregated(
    topo: &Topology,
    model: &Model,
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
    let me = |e: crate::model::ModelError| e.to_string();
    let be = CpuBackend::new();
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

    let id = 1;
    engine.submit(id, t as u64);
    engine.tick();
    fail_on_outcomes(&mut engine)?;
    match engine.status(id) {
        Some(Status::Planned) => {}
        other => return Err(format!("request {id} was not planned after one tick: {other:?}")),
    }
    let leases: BTreeMap<RankId, Lease> =
        engine.leases(id).into_iter().map(|(rank, blocks, slot)| (rank, Lease { blocks, slot })).collect();

    // Prefill: stage by stage, each stage's TP group computing its layers; the
    // hidden states pass from stage s to stage s + 1.
    let p = topo.prefill();
    let group = model.shard(p.tp as usize).map_err(me)?;
    let tail = ranks::prefill_record_tail(topo, t);
    let mut h = forward::embed(&be, model, prompt).map_err(me)?;
    for (s, layers) in topo.stage_layers.iter().enumerate() {
        let range = layers.start as usize..layers.end as usize;
        forward::prefill_layers(&be, model, &group, range, &mut h, t, tail, &mut |tp, layer, cache| {
            let rank = PrefillRank { pp: s as u32, tp: tp as u32 };
            let lease = leases
                .get(&RankId::Prefill(rank))
                .ok_or_else(|| crate::model::ModelError::Region(format!("no lease on prefill pp{s} tp{tp}")))?;
            ranks::store_prefill(topo, &layouts, &mut mem, rank, lease, layer, cache)
        })
        .map_err(|e| format!("prefill stage {s}: {e}"))?;
        engine.mark_computed(id, s as u32);
    }
    let (logits, first) = forward::logits_of_last(&be, model, &h, t).map_err(me)?;
    let mut trace = Trace { tokens: vec![first], logits: vec![logits] };

    // Hand-off: the plans, as byte copies.
    engine.tick();
    let submitted = mover.take_submitted();
    let mut plans: Vec<Plan> = submitted.iter().map(|(_, p)| p.clone()).collect();
    let mut report = ComputeReport { prompt_tokens: t, steps, ..Default::default() };
    report.descriptors = plans.iter().map(|p| p.descriptors.len() as u64).sum();
    tamper(&mut plans);
    let exec = oracle::execute_counted(&plans, &mut mem).map_err(|e| format!("plan execution refused: {e}"))?;
    report.bytes_transferred = exec.bytes;
    for ((_, kind), b) in &exec.written {
        *report.bytes_by_kind.entry(*kind).or_default() += b;
    }
    for (ticket, _) in &submitted {
        mover.complete(*ticket, Ok(()));
    }
    engine.tick();
    let outcomes = engine.take_outcomes();
    if !outcomes.iter().any(|o| o.request == id && o.result.is_ok()) {
        return Err(format!("request {id} did not complete its hand-off: {:?} {outcomes:?}", engine.status(id)));
    }

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
            let mut pools = engine.world.resource_mut::<Pools>();
            let pool = pools.0.get_mut(&rid).ok_or_else(|| format!("no pool on decode tp{tp}"))?;
            let more = alloc_blocks(pool, (need - lease.blocks.len()) as u32)
                .ok_or_else(|| format!("decode tp{tp}: no free blocks for {need} blocks of prompt + steps"))?;
            lease.blocks.extend_from_slice(&more);
            grown.push((rid, more));
        }
        decode_leases.push(lease);
    }
    let dgroup = model.shard(d.tp as usize).map_err(me)?;
    {
        let mut caches = DecodeRanks::new(topo, &layouts, &mut mem, decode_leases);
        for i in 0..steps as usize {
            let prev = trace.tokens[i];
            let (logits, tok) = forward::decode_step(&be, model, &dgroup, prev, t + i, &mut caches)
                .map_err(|e| format!("decode step {}: {e}", i + 1))?;
            trace.tokens.push(tok);
            trace.logits.push(logits);
        }
    }

    {
        let mut pools = engine.world.resource_mut::<Pools>();
        for (rid, blocks) in &grown {
            if let Some(pool) = pools.0.get_mut(rid) {
                free_blocks(pool, blocks);
            }
        }
    }
    engine.finish(id);
    engine.tick();
    Ok((trace, report))
}
