//! Transfer: submit each stage's plans once the stage has computed, and turn
//! completed writes into write-done reports. The bytes move through a `Mover`,
//! which knows regions and descriptors, never requests.

use bevy_ecs::prelude::*;
use handoff_components::ecs::*;
use handoff_components::failure::{Cause, Failure, ProcessRole};
use handoff_components::plan::Plan;
use handoff_components::vocab::{DecodeRank, LayerMark, ModuleLayer, PrefillRank, RankId, RegionKind};
use std::time::{Duration, Instant};
use thiserror::Error;

/// Identifies one plan's writes to the mover and back: the whole plan, or one
/// part of a layered plan ([`Plan::part`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket {
    pub request: u64,
    pub nonce: u64,
    pub producer: PrefillRank,
    pub consumer: DecodeRank,
    /// The part of the plan (0 for a plan that is not layered).
    pub part: u32,
}

/// Why a mover could not start or finish a plan's writes.
#[derive(Debug, Clone, Error)]
pub enum MoveError {
    #[error("no {kind} region of {rank} known to the mover ({side})")]
    UnknownRegion { kind: RegionKind, rank: RankId, side: &'static str },
    #[error("ticket of request {0} is already in flight")]
    AlreadyInFlight(u64),
    #[error("the mover's workers have stopped")]
    Stopped,
    /// The transport failed the writes; its own error.
    #[error("{0}")]
    Transport(#[source] crate::error::ErrorSource),
    #[error("no write-done report from prefill pp{pp} tp{tp} within {after:?} (producer gone or stalled)")]
    NoReport { pp: u32, tp: u32, after: Duration },
    /// The plan holds staged groups and the mover runs descriptors only: were it
    /// submitted, their rows would never be written.
    #[error("the plan moves {groups} staged row groups, and this mover runs descriptors only")]
    StagingUnsupported { groups: usize },
    /// A layer's writes came with a device mark to wait on, and this mover's
    /// writes cannot wait on one ([`Mover::takes_marks`] is false).
    #[error("a layer's writes must wait on a device layer mark, and this mover cannot wait on one")]
    MarksUnsupported,
}

/// The end of one plan's writes.
#[derive(Debug, Clone)]
pub struct PlanCompletion {
    pub ticket: Ticket,
    pub result: Result<(), MoveError>,
}

/// Moves the bytes of plans between registered regions.
pub trait Mover: Send + Sync + 'static {
    /// Starts the writes of one plan; its completion comes back from `poll`.
    fn submit(&mut self, ticket: Ticket, plan: &Plan) -> Result<(), MoveError>;
    /// [`Mover::submit`] of a layer's writes that must not start before
    /// `after`, the mark the compute recorded on its device stream after the
    /// layer (layer-wise streaming on a GPU): the writes wait on it on the
    /// device, the caller does not. With None it is `submit`. The default,
    /// for a mover that cannot wait on a mark ([`Mover::takes_marks`] false,
    /// so the compute never gives it one), refuses a mark.
    fn submit_after(&mut self, ticket: Ticket, plan: &Plan, after: Option<LayerMark>) -> Result<(), MoveError> {
        match after {
            None => self.submit(ticket, plan),
            Some(_) => Err(MoveError::MarksUnsupported),
        }
    }
    /// Whether [`Mover::submit_after`] makes writes wait on a layer mark on
    /// the device. Without it a device compute waits for each layer on the
    /// host before its writes are submitted.
    fn takes_marks(&self) -> bool {
        false
    }
    /// Appends the completions that arrived since the last call.
    fn poll(&mut self, out: &mut Vec<PlanCompletion>);
    /// The bytes of one staging buffer when this mover runs staged groups
    /// ([`Plan::staged`]); `None`, the default, when it runs descriptors only. The
    /// planner stages rows only for a mover that says so, since it cannot tell
    /// from a plan whether the mover will write its groups.
    fn staging_bytes(&self) -> Option<u64> {
        None
    }
}

/// What a request fails with when the mover could not start (`what` = "submit")
/// or finish ("write") one plan's writes: charged to the producing stage, a
/// report that never came as a timeout, anything else as a failed transfer.
pub fn move_failure(t: &Ticket, what: &str, e: &MoveError) -> Failure {
    let role = ProcessRole::Prefill { stage: t.producer.pp };
    let pair = format!("{what} from prefill pp{} tp{} to decode tp{}", t.producer.pp, t.producer.tp, t.consumer.tp);
    let cause = match e {
        MoveError::NoReport { pp, after, .. } => Cause::Timeout { after: *after, waiting_for: vec![*pp], detail: format!("{pair}: {e}") },
        _ => Cause::Transfer { detail: format!("{pair}: {e}") },
    };
    Failure::new(PhaseName::Transfer, role, cause)
}

/// The engine's mover.
#[derive(Resource)]
pub struct Transfers(pub Box<dyn Mover>);

/// Moves a planned request from the compute deadline to the transfer deadline once
/// every stage has computed it.
pub fn advance_deadlines(mut requests: Query<(&Status, &StagesComputed, &mut Deadline)>, topo: Res<TopologyRes>) {
    for (status, computed, mut deadline) in requests.iter_mut() {
        if *status == Status::Planned && deadline.phase == PhaseName::Compute && computed.0.iter().all(|&c| c) {
            *deadline = Deadline { phase: PhaseName::Transfer, at: Instant::now() + Duration::from_secs_f64(topo.0.config.timeouts.transfer_s) };
        }
    }
}

/// Submits the parts of `entry`'s plan not yet submitted whose layer is at
/// most `upto` (every part left, with None: the stage has computed them all),
/// in layer order. A plan that is not layered is one part, submitted only with
/// None. Returns the parts submitted; an error leaves the parts before it
/// submitted.
///
/// `after`: the device mark of layer `upto` (layer-wise streaming on a GPU):
/// the parts submitted now wait on it on the device ([`Mover::submit_after`]);
/// a part of an earlier layer waits on it too, which only waits longer.
pub fn submit_parts(
    mover: &mut dyn Mover,
    req: &Request,
    entry: &mut PlanEntry,
    upto: Option<ModuleLayer>,
    after: Option<LayerMark>,
) -> Result<u32, MoveError> {
    // A plan with staged groups for a mover that does not run them is refused
    // before any of its parts goes out: its rows would never be written.
    if entry.submitted == 0 && !entry.plan.staged.is_empty() && mover.staging_bytes().is_none() {
        return Err(MoveError::StagingUnsupported { groups: entry.plan.staged.len() });
    }
    let mut sent = 0;
    while !entry.all_submitted() && entry.state != WriteState::Done {
        let i = entry.submitted as usize;
        let ready = match (upto, entry.plan.part_layer(i)) {
            (None, _) => true,
            (Some(done), Some(layer)) => layer <= done,
            (Some(_), None) => false,
        };
        if !ready {
            break;
        }
        let part = entry.plan.part(i);
        let ticket = Ticket { request: req.id, nonce: req.nonce, producer: part.producer, consumer: part.consumer, part: i as u32 };
        if !part.staged.is_empty() && mover.staging_bytes().is_none() {
            return Err(MoveError::StagingUnsupported { groups: part.staged.len() });
        }
        mover.submit_after(ticket, &part, after)?;
        entry.submitted += 1;
        entry.state = WriteState::InFlight;
        sent += 1;
    }
    Ok(sent)
}

/// Submits what is left of the plans of every stage that has computed: the
/// whole plan, or the parts of a layered plan that the dispatch phase did not
/// submit while the stage computed (a compute without a layer hook, a batch
/// run again).
pub fn submit_plans(
    mut requests: Query<(&Request, &mut Status, &StagesComputed, &Holdings)>,
    mut plans: Query<&mut PlanEntry>,
    mut transfers: ResMut<Transfers>,
) {
    for (req, mut status, computed, holdings) in requests.iter_mut() {
        if *status != Status::Planned {
            continue;
        }
        for &p in &holdings.plans {
            let Ok(mut entry) = plans.get_mut(p) else { continue };
            if entry.all_submitted() || entry.state == WriteState::Done || !computed.0.get(entry.plan.producer.pp as usize).copied().unwrap_or(false) {
                continue;
            }
            if let Err(e) = submit_parts(transfers.0.as_mut(), req, &mut entry, None, None) {
                let ticket = Ticket { request: req.id, nonce: req.nonce, producer: entry.plan.producer, consumer: entry.plan.consumer, part: entry.submitted };
                *status = Status::Failed(move_failure(&ticket, "submit", &e));
                break;
            }
        }
    }
}

/// Collects completed writes: a plan whose every part completed becomes a
/// write-done report; a failed part fails the request. A plan whose parts are
/// no longer being written (all completed, or the request failed and no part
/// is in flight) no longer reads its sources.
pub fn poll_transfers(
    mut transfers: ResMut<Transfers>,
    index: Res<RequestIndex>,
    mut requests: Query<(&Request, &mut Status, &Holdings)>,
    mut plans: Query<&mut PlanEntry>,
    mut reports: MessageWriter<WriteDone>,
    mut buf: Local<Vec<PlanCompletion>>,
) {
    buf.clear();
    transfers.0.poll(&mut buf);
    for c in buf.drain(..) {
        let t = c.ticket;
        let entry = index.0.get(&t.request).and_then(|&e| requests.get_mut(e).ok()).filter(|(req, ..)| req.nonce == t.nonce);
        let Some((_, mut status, holdings)) = entry else {
            // A request gone or of another life: the release phase counts the report.
            if c.result.is_ok() {
                reports.write(WriteDone { request: t.request, nonce: t.nonce, producer: t.producer, consumer: t.consumer });
            }
            continue;
        };
        let pair = |x: &PlanEntry| x.plan.producer == t.producer && x.plan.consumer == t.consumer;
        let Some(p) = holdings.plans.iter().copied().find(|&p| plans.get(p).is_ok_and(pair)) else { continue };
        let Ok(mut entry) = plans.get_mut(p) else { continue };
        entry.completed = (entry.completed + 1).min(entry.submitted);
        if let Err(reason) = c.result {
            entry.failed = true;
            if !matches!(*status, Status::Failed { .. }) {
                *status = Status::Failed(move_failure(&t, "write", &reason));
            }
        }
        if entry.writing() {
            continue;
        }
        if entry.all_submitted() && !entry.failed {
            // Every byte of the plan is in place (a request failed meanwhile is
            // reported too: decode frees its blocks once every stage has).
            reports.write(WriteDone { request: t.request, nonce: t.nonce, producer: t.producer, consumer: t.consumer });
        } else if entry.failed || matches!(*status, Status::Failed { .. }) {
            // No more part goes out, and none is in flight: the sources are free.
            entry.state = WriteState::Done;
        }
    }
}

/// Where a World whose producers are other processes (decode) hears from them:
/// the stages' write-done reports and failures, as they arrive. The consumer's
/// side of a hand-off, polled like the producer's [`Mover`].
pub trait NoticeSource: Send + Sync + 'static {
    /// Appends the notices that arrived since the last call (never blocks).
    fn poll(&mut self, out: &mut Vec<StageNotice>);
}

/// The engine's notice source, when its producers live elsewhere.
#[derive(Resource)]
pub struct Notices(pub Box<dyn NoticeSource>);

/// Takes the stages' notices: a report goes to the release phase as a
/// [`StageReport`]; a stage's failure fails the request there as a [`Cancel`]
/// naming the stage (it writes no more).
pub fn poll_notices(
    notices: Option<ResMut<Notices>>,
    mut reports: MessageWriter<StageReport>,
    mut cancels: MessageWriter<Cancel>,
    mut buf: Local<Vec<StageNotice>>,
) {
    let Some(mut notices) = notices else { return };
    buf.clear();
    notices.0.poll(&mut buf);
    for n in buf.drain(..) {
        match n {
            StageNotice::Written(r) => {
                tracing::debug!(request = r.request, stage = r.stage, "a stage's writes reported");
                reports.write(r);
            }
            StageNotice::Failed { request, nonce, stage, failure } => {
                tracing::debug!(request, stage, %failure, "a stage failed the request");
                cancels.write(Cancel { request, failure, stage: Some(stage), nonce, unsent: false });
            }
        }
    }
}
