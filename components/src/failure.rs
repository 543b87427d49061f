//! Why a request failed, as one typed value from the system that failed it to the
//! proxy's answer: the phase it was in, the role that failed it and the cause.
//! Everything downstream (the HTTP status, the metrics labels, whether it counts
//! as a timeout) is decided from these fields; the `detail` strings are for the
//! person reading the message only and are never matched.

use crate::phase::PhaseName;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::time::Duration;

/// A role process of a deployment: the one a failure is charged to (that failed
/// the request, or whose silence or death made another give up on it), and the
/// one whose listeners an address names (`src/roles/addr.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum ProcessRole {
    Proxy,
    Prefill { stage: u32 },
    Decode,
}

impl fmt::Display for ProcessRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProcessRole::Proxy => f.write_str("proxy"),
            ProcessRole::Prefill { stage } => write!(f, "prefill stage {stage}"),
            ProcessRole::Decode => f.write_str("decode"),
        }
    }
}

/// How a peer went away.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PeerLoss {
    /// Its process is gone (port refused, replaced, link closed): it writes no more.
    Dead,
    /// Heartbeats stopped with its port still open (stopped, hung, partitioned):
    /// it may still write when it resumes.
    Stopped,
}

/// What went wrong, with the structured facts each kind of failure has.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cause", rename_all = "snake_case")]
pub enum Cause {
    /// A phase's deadline passed, or a wait for a peer's answer ran out.
    /// `waiting_for`: the prefill stages that still owed their part (the engine's
    /// deadlines name them); `detail`: what was waited for, when not the phase.
    Timeout { after: Duration, waiting_for: Vec<u32>, detail: String },
    /// The role went away: died, or stopped answering its heartbeat.
    PeerDown { loss: PeerLoss, detail: String },
    /// The model or its kernels refused the request or its batch.
    Compute { detail: String },
    /// A write of the hand-off could not start or failed.
    Transfer { detail: String },
    /// Ended on purpose: the client went away, a stop sequence, the drain, a settle.
    Cancelled { detail: String },
    /// Admission refused it (a duplicate id, a length the topology cannot hold).
    Refused { detail: String },
    /// No blocks or slots were left for it.
    Capacity { detail: String },
    /// A peer broke the protocol: an answer out of turn, a report without the token
    /// it must carry.
    Protocol { detail: String },
}

impl Cause {
    /// The cause's name as the error body and the logs show it.
    pub const fn name(&self) -> &'static str {
        match self {
            Cause::Timeout { .. } => "timeout",
            Cause::PeerDown { .. } => "peer_down",
            Cause::Compute { .. } => "compute",
            Cause::Transfer { .. } => "transfer",
            Cause::Cancelled { .. } => "cancelled",
            Cause::Refused { .. } => "refused",
            Cause::Capacity { .. } => "capacity",
            Cause::Protocol { .. } => "protocol",
        }
    }
}

/// A request's failure: the phase it was in, the role charged with it, the cause.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub phase: PhaseName,
    pub role: ProcessRole,
    pub cause: Cause,
}

impl Failure {
    pub fn new(phase: PhaseName, role: ProcessRole, cause: Cause) -> Failure {
        Failure { phase, role, cause }
    }

    /// A phase deadline that passed after `after`, with the stages still owed.
    pub fn deadline(phase: PhaseName, role: ProcessRole, after: Duration, waiting_for: Vec<u32>) -> Failure {
        Failure::new(phase, role, Cause::Timeout { after, waiting_for, detail: String::new() })
    }
}

/// `"prefill stage 1: compute phase timed out after 5 s waiting for prefill stage 1"`,
/// `"decode: stopped answering (pid 7: no heartbeat for 2.1 s)"`: the role first,
/// then what happened.
impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.role)?;
        match &self.cause {
            Cause::Timeout { after, waiting_for, detail } => {
                write!(f, "{} phase timed out after {} s", self.phase, after.as_secs_f64())?;
                if !waiting_for.is_empty() {
                    let stages: Vec<String> = waiting_for.iter().map(u32::to_string).collect();
                    write!(f, " waiting for prefill stage {}", stages.join(", "))?;
                }
                if !detail.is_empty() {
                    write!(f, ": {detail}")?;
                }
                Ok(())
            }
            Cause::PeerDown { detail, .. }
            | Cause::Compute { detail }
            | Cause::Transfer { detail }
            | Cause::Cancelled { detail }
            | Cause::Refused { detail }
            | Cause::Capacity { detail }
            | Cause::Protocol { detail } => f.write_str(detail),
        }
    }
}

impl std::error::Error for Failure {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_names_its_role_then_what_happened() {
        let f = Failure::deadline(PhaseName::Transfer, ProcessRole::Decode, Duration::from_secs(300), vec![1, 2]);
        assert_eq!(f.to_string(), "decode: transfer phase timed out after 300 s waiting for prefill stage 1, 2");
        let f = Failure::new(PhaseName::Compute, ProcessRole::Prefill { stage: 1 }, Cause::Compute { detail: "out of memory".into() });
        assert_eq!(f.to_string(), "prefill stage 1: out of memory");
        let f = Failure::new(
            PhaseName::Admission,
            ProcessRole::Decode,
            Cause::Timeout { after: Duration::from_millis(1500), waiting_for: vec![], detail: "no answer".into() },
        );
        assert_eq!(f.to_string(), "decode: admission phase timed out after 1.5 s: no answer");
    }

    #[test]
    fn a_failure_round_trips_through_json() {
        let fs = [
            Failure::deadline(PhaseName::Compute, ProcessRole::Prefill { stage: 3 }, Duration::from_millis(250), vec![3]),
            Failure::new(PhaseName::Transfer, ProcessRole::Proxy, Cause::Cancelled { detail: "the client went away".into() }),
            Failure::new(PhaseName::Admission, ProcessRole::Decode, Cause::PeerDown { loss: PeerLoss::Dead, detail: "x".into() }),
        ];
        for f in fs {
            let text = serde_json::to_string(&f).expect("encode");
            assert_eq!(serde_json::from_str::<Failure>(&text).expect("decode"), f, "{text}");
        }
    }
}
