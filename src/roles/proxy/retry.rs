//! No request lost to one fault: a choice whose role died under it is sent
//! again once that role is back, at most once per fault.
//!
//! - **Which failures.** Read from the typed error alone, never its text
//!   ([`dead_role`]): a [`Failure`] whose cause is a peer found dead
//!   ([`PeerLoss::Dead`]: its process is gone, and `up` starts another), charged
//!   to decode or a prefill stage; or a 503 of such a role found down in the
//!   middle of the request (its port refused before the job went out). A role
//!   found stopped may resume and still write, so its requests fail as before;
//!   so do timeouts, compute and transfer errors, cancels and refusals.
//! - **One retry per fault.** A fault is the role and the process of it that the
//!   request's attempt used ([`Fault`]). A request retries once for each fault it
//!   meets (a stage killed, later decode killed: two retries), never twice for
//!   the same one; a second failure on a role that was not replaced fails it.
//! - **When.** Once the role is back ([`super::registry::back_after`]): every
//!   role up, no down still being carried out (decode told of a dead stage, so
//!   its `StageDown` cannot fail the retry), and a new process in the slot, or the
//!   same one proved alive by a later heartbeat.
//! - **Deadline.** A retry re-enters admission, so it waits for the role at most
//!   `timeouts.admission_s` from the failure, as a request waits for its place;
//!   past it, while draining, or for a fault already retried, the request fails
//!   with the failure that stopped it, naming its role and phase as before.
//! - **What is sent again.** The prompt as it came, under a new request id (the
//!   old one's state at decode, if any, is freed or cancelled as before), with
//!   the tokens already streamed as decode's forced tokens: decode feeds them
//!   back as it fed its own picks the first time, so the new run computes the
//!   first run's bits step for step, and the proxy passes on only the tokens
//!   after them. A stream sees a pause, not an error or a repeated token, and a
//!   greedy or seeded choice ends with the tokens of an unfaulted run.
//! - **Counted** in `handoff_request_retries_total{phase,role}`: the phase the
//!   request was in and the role that died.

use super::error::{Absence, NotReady, ServeError};
use super::registry::{back_after, stopped};
use super::state::Proxy;
use crate::base::lock;
use crate::roles::host::secs;
use handoff_components::ecs::PhaseName;
use handoff_components::failure::{Cause, PeerLoss, ProcessRole};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A fault a request met: the role (its slot: 0 decode, 1 + s stage s) and the
/// process of it that the request's attempt used (0: none registered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Fault {
    pub(super) slot: usize,
    pub(super) pid: u32,
}

fn slot_of(role: ProcessRole) -> Option<usize> {
    match role {
        ProcessRole::Decode => Some(0),
        ProcessRole::Prefill { stage } => Some(1 + stage as usize),
        ProcessRole::Proxy => None,
    }
}

/// The role whose death ended an attempt: its slot, the phase the request was
/// in and the role, from the typed error alone (see the module docs). `phase`:
/// where the attempt was, for a 503 (which names no phase). `is_stopped` says
/// whether a slot's role is stopped, not dead.
pub(super) fn dead_role(e: &ServeError, phase: PhaseName, is_stopped: impl Fn(usize) -> bool) -> Option<(usize, PhaseName, ProcessRole)> {
    match e {
        ServeError::Failed(f) => match f.cause {
            Cause::PeerDown { loss: PeerLoss::Dead, .. } => slot_of(f.role).map(|s| (s, f.phase, f.role)),
            _ => None,
        },
        ServeError::NotReady(NotReady(absent)) => absent.iter().find_map(|a| match a {
            Absence::Down { role, .. } => slot_of(*role).filter(|&s| !is_stopped(s)).map(|s| (s, phase, *role)),
            Absence::Unregistered(_) => None,
        }),
        _ => None,
    }
}

/// What to do with an attempt that ended in `e`.
pub(super) enum Verdict {
    /// Send it again: the role is back (counted).
    Retry,
    /// Answer `e`.
    Fail,
    /// The client went away while the request waited: nothing to answer.
    Gone,
}

/// How often a waiting retry looks at the registry.
const POLL: Duration = Duration::from_millis(50);

/// Decides whether the attempt that ended in `e` (the attempt was in `phase`
/// and found the roles' processes `pids`) is sent again, and waits for its role
/// to be back when it is (see the module docs). `retried`: the faults this
/// request has already retried; `gone`: whether its client went away.
pub(super) async fn after(p: &Arc<Proxy>, e: &ServeError, phase: PhaseName, pids: &[u32], retried: &mut Vec<Fault>, gone: impl Fn() -> bool) -> Verdict {
    if p.draining.load(Ordering::SeqCst) {
        return Verdict::Fail;
    }
    let Some((slot, phase, role)) = dead_role(e, phase, |s| stopped(p, s)) else { return Verdict::Fail };
    let fault = Fault { slot, pid: pids.get(slot).copied().unwrap_or(0) };
    if retried.contains(&fault) {
        tracing::warn!(%role, pid = fault.pid, "proxy: a request failed again for a fault it was retried for; failing it");
        return Verdict::Fail;
    }
    let since = Instant::now();
    let until = since + secs(p.topo.config.timeouts.admission_s);
    while !back_after(p, slot, fault.pid, since) {
        if gone() {
            return Verdict::Gone;
        }
        if Instant::now() >= until || p.draining.load(Ordering::SeqCst) {
            tracing::warn!(%role, phase = phase.name(), "proxy: the role was not back within timeouts.admission_s; the request fails");
            return Verdict::Fail;
        }
        tokio::time::sleep(POLL).await;
    }
    retried.push(fault);
    *lock(&p.metrics).retries.entry((phase.name(), role.to_string())).or_default() += 1;
    tracing::info!(%role, phase = phase.name(), waited_ms = since.elapsed().as_millis() as u64, "proxy: sending a request again after its role died");
    Verdict::Retry
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_components::failure::Failure;

    fn failed(phase: PhaseName, role: ProcessRole, cause: Cause) -> ServeError {
        ServeError::Failed(Failure::new(phase, role, cause))
    }

    /// Only a role found dead is retried around, whatever the detail says; a
    /// stopped one, a timeout, a compute error, a cancel, the proxy's own are not.
    #[test]
    fn only_a_dead_role_is_retried_around() {
        let dead = |detail: &str| Cause::PeerDown { loss: PeerLoss::Dead, detail: detail.into() };
        let never = |_| false;
        let e = failed(PhaseName::Compute, ProcessRole::Prefill { stage: 1 }, dead("died"));
        assert_eq!(dead_role(&e, PhaseName::Decode, never), Some((2, PhaseName::Compute, ProcessRole::Prefill { stage: 1 })));
        let e = failed(PhaseName::Decode, ProcessRole::Decode, dead("its link closed"));
        assert_eq!(dead_role(&e, PhaseName::Admission, never), Some((0, PhaseName::Decode, ProcessRole::Decode)));
        let stopped = Cause::PeerDown { loss: PeerLoss::Stopped, detail: "died".into() };
        assert_eq!(dead_role(&failed(PhaseName::Decode, ProcessRole::Decode, stopped), PhaseName::Decode, never), None);
        let late = Cause::Timeout { after: Duration::from_secs(1), waiting_for: vec![0], detail: "peer down, died".into() };
        assert_eq!(dead_role(&failed(PhaseName::Compute, ProcessRole::Decode, late), PhaseName::Compute, never), None);
        let compute = Cause::Compute { detail: "peer_down dead".into() };
        assert_eq!(dead_role(&failed(PhaseName::Compute, ProcessRole::Prefill { stage: 0 }, compute), PhaseName::Compute, never), None);
        assert_eq!(dead_role(&failed(PhaseName::Decode, ProcessRole::Proxy, dead("x")), PhaseName::Decode, never), None);
        let cancelled = Cause::Cancelled { detail: "the client went away".into() };
        assert_eq!(dead_role(&failed(PhaseName::Decode, ProcessRole::Decode, cancelled), PhaseName::Decode, never), None);
    }

    /// A 503 raised mid-request names a role down: retried around when that role
    /// is not merely stopped, in the phase the attempt was in.
    #[test]
    fn a_role_found_down_mid_request_is_retried_around_unless_stopped() {
        let down = ServeError::NotReady(NotReady(vec![Absence::Down { role: ProcessRole::Prefill { stage: 0 }, why: "died".into() }]));
        assert_eq!(dead_role(&down, PhaseName::Compute, |_| false), Some((1, PhaseName::Compute, ProcessRole::Prefill { stage: 0 })));
        assert_eq!(dead_role(&down, PhaseName::Compute, |s| s == 1), None);
        let unregistered = ServeError::NotReady(NotReady(vec![Absence::Unregistered(ProcessRole::Decode)]));
        assert_eq!(dead_role(&unregistered, PhaseName::Admission, |_| false), None);
        assert_eq!(dead_role(&ServeError::Draining, PhaseName::Admission, |_| false), None);
    }
}
