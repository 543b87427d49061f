//! Transfer: submit each stage's plans once the stage has computed, and turn
//! completed writes into write-done reports. The bytes move through a `Mover`,
//! which knows regions and descriptors, never requests.

use bevy_ecs::prelude::*;
use handoff_components::ecs::*;
use handoff_components::failure::{Cause, Failure, ProcessRole};
use handoff_components::plan::Plan;
use handoff_components::vocab::{DecodeRank, PrefillRank, RankId, RegionKind};
use std::time::{Duration, Instant};
use thiserror::Error;

/// Identifies one plan's writes to the mover and back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket {
    pub request: u64,
    pub nonce: u64,
    pub producer: PrefillRank,
    pub consumer: DecodeRank,
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

/// Submits the pending plans of every stage that has computed.
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
            if entry.state != WriteState::Pending || !computed.0.get(entry.plan.producer.pp as usize).copied().unwrap_or(false) {
                continue;
            }
            let ticket = Ticket { request: req.id, nonce: req.nonce, producer: entry.plan.producer, consumer: entry.plan.consumer };
            let submitted = if !entry.plan.staged.is_empty() && transfers.0.staging_bytes().is_none() {
                Err(MoveError::StagingUnsupported { groups: entry.plan.staged.len() })
            } else {
                transfers.0.submit(ticket, &entry.plan)
            };
            match submitted {
                Ok(()) => entry.state = WriteState::InFlight,
                Err(e) => {
                    *status = Status::Failed(move_failure(&ticket, "submit", &e));
                    break;
                }
            }
        }
    }
}

/// Collects completed writes: successes become write-done reports, failures fail
/// the request. Either way the plan's sources are no longer being read.
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
        match c.result {
            Ok(()) => {
                reports.write(WriteDone { request: t.request, nonce: t.nonce, producer: t.producer, consumer: t.consumer });
            }
            Err(reason) => {
                let Some(&e) = index.0.get(&t.request) else { continue };
                let Ok((req, mut status, holdings)) = requests.get_mut(e) else { continue };
                if req.nonce != t.nonce {
                    continue;
                }
                for &p in &holdings.plans {
                    if let Ok(mut entry) = plans.get_mut(p)
                        && entry.plan.producer == t.producer
                        && entry.plan.consumer == t.consumer
                    {
                        entry.state = WriteState::Done;
                    }
                }
                if !matches!(*status, Status::Failed { .. }) {
                    *status = Status::Failed(move_failure(&t, "write", &reason));
                }
            }
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
