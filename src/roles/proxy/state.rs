//! The proxy's shared state: the registered roles, the routes of the choices in
//! flight, the links, the metrics, and the per-request accounting ([`Served`]).

use super::error::{ServeError, classify};
use crate::base::lock;
use crate::roles::prom::{Histogram, REQUEST_BUCKETS_S};
use crate::roles::wire::{Msg, Register};
use crate::transport::auth::ClusterSecret;
use axum::response::{IntoResponse, Response};
use handoff_components::Topology;
use handoff_components::ecs::PhaseName;
use handoff_components::failure::ProcessRole;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Semaphore, mpsc};

/// A heartbeat older than this with the port still open: the role stopped answering.
pub(super) const ALIVE: Duration = Duration::from_secs(2);

/// A heartbeat this late gets the role's port probed (heartbeats come every 300 ms).
pub(super) const LATE: Duration = Duration::from_millis(700);

/// Where a registered role stands, as the watchdog sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PeerState {
    Up,
    /// Heartbeats stopped, port open: stopped, hung or partitioned.
    Stopped,
    /// Port refused (or replaced by a new process): gone.
    Dead,
}

impl PeerState {
    pub(super) fn name(self) -> &'static str {
        match self {
            PeerState::Up => "up",
            PeerState::Stopped => "stopped",
            PeerState::Dead => "dead",
        }
    }
}

#[derive(Clone)]
pub(super) struct Peer {
    pub(super) reg: Register,
    pub(super) seen: Instant,
    pub(super) state: PeerState,
    /// When it went down, and why.
    pub(super) down: Option<(Instant, String)>,
}

/// One slot per role: 0 is decode, 1 + s is prefill stage s.
#[derive(Default)]
pub(super) struct Roles {
    pub(super) slots: Vec<Option<Peer>>,
    /// Deaths (and stops) the watchdog saw, per slot.
    pub(super) downs: Vec<u64>,
    /// The register timestamp last accepted, per slot: a registration must be
    /// later (a captured heartbeat sent again is a replay).
    pub(super) last_auth: Vec<u64>,
    /// Per slot, the downs whose consequences ([`super::registry::role_down`]:
    /// decode told of a dead stage, a dead decode's link dropped) are still being
    /// carried out: a retry waits for them, so that a stage's `StageDown` can
    /// never fail the retry itself.
    pub(super) settling: Vec<u32>,
}

impl Roles {
    /// No role registered yet, for a topology of `pp` prefill stages.
    pub(super) fn new(pp: usize) -> Roles {
        let n = pp + 1;
        Roles { slots: vec![None; n], downs: vec![0; n], last_auth: vec![0; n], settling: vec![0; n] }
    }
}

/// The role of a slot.
pub(super) fn slot_role(slot: usize) -> ProcessRole {
    if slot == 0 { ProcessRole::Decode } else { ProcessRole::Prefill { stage: (slot - 1) as u32 } }
}

pub(super) fn role_name(slot: usize) -> String {
    slot_role(slot).to_string()
}

/// The role's label in `/metrics`.
pub(super) fn role_label(slot: usize) -> String {
    if slot == 0 { "decode".into() } else { format!("prefill{}", slot - 1) }
}

pub(super) struct Metrics {
    pub(super) outcomes: BTreeMap<&'static str, u64>,
    pub(super) refusals: BTreeMap<&'static str, u64>,
    /// Seconds per phase of each completed choice.
    pub(super) phases: BTreeMap<&'static str, Histogram>,
    pub(super) ttft: Histogram,
    pub(super) itl: Histogram,
    pub(super) e2e: Histogram,
    /// The hand-off tail of each completed choice ([`Summary::tail_ms`]).
    pub(super) tail: Histogram,
    /// Requests failed after admission, by (phase, role).
    pub(super) failures: BTreeMap<(&'static str, String), u64>,
    /// Requests failed because a phase ran out of time, by phase.
    pub(super) timeouts: BTreeMap<&'static str, u64>,
    /// Requests sent again after a role they were in died, by (phase, role):
    /// the phase they were in and the role that died.
    pub(super) retries: BTreeMap<(&'static str, String), u64>,
    pub(super) bytes: u64,
    pub(super) tokens: u64,
    /// Register requests refused for not proving the cluster secret.
    pub(super) unauthenticated_register: u64,
    /// Of those, registrations refused as replays.
    pub(super) replayed_register: u64,
    /// Control lines from decode refused after the handshake (the link closed).
    pub(super) refused_control_messages: u64,
    /// Connections closed by a listener's limits: (listener, reason) -> count.
    pub(super) closed: BTreeMap<(&'static str, &'static str), u64>,
}

impl Default for Metrics {
    fn default() -> Metrics {
        let phases = ["queue", "handoff", "decode"].into_iter().map(|p| (p, Histogram::new(REQUEST_BUCKETS_S))).collect();
        Metrics {
            outcomes: BTreeMap::new(),
            refusals: BTreeMap::new(),
            phases,
            ttft: Histogram::new(REQUEST_BUCKETS_S),
            itl: Histogram::new(REQUEST_BUCKETS_S),
            e2e: Histogram::new(REQUEST_BUCKETS_S),
            tail: Histogram::new(crate::roles::prom::TAIL_BUCKETS_S),
            failures: BTreeMap::new(),
            timeouts: BTreeMap::new(),
            retries: BTreeMap::new(),
            bytes: 0,
            tokens: 0,
            unauthenticated_register: 0,
            replayed_register: 0,
            refused_control_messages: 0,
            closed: BTreeMap::new(),
        }
    }
}

/// A choice in flight on the decode link: where decode's messages for it go, the
/// phase it is in (named when decode dies) and which link carries it.
pub(super) struct ChoiceRoute {
    pub(super) tx: mpsc::UnboundedSender<Msg>,
    pub(super) phase: PhaseName,
    pub(super) link: u64,
}

pub(super) struct Proxy {
    pub(super) topo: Topology,
    pub(super) roles: Mutex<Roles>,
    pub(super) places: Arc<Semaphore>,
    pub(super) queued: AtomicU32,
    pub(super) next_id: AtomicU64,
    pub(super) metrics: Mutex<Metrics>,
    /// One link to decode and one to stage 0, shared by every request.
    pub(super) links: tokio::sync::Mutex<Links>,
    pub(super) routes: Arc<Mutex<HashMap<u64, ChoiceRoute>>>,
    pub(super) next_link: AtomicU64,
    pub(super) draining: AtomicBool,
    /// HTTP generation requests being served now.
    pub(super) inflight: AtomicU32,
    /// This proxy's own restarts (from `up`).
    pub(super) restarts: u32,
    /// When set, the /v1 routes require `Authorization: Bearer` with it.
    pub(super) api_key: Option<String>,
    /// What the roles' registrations prove and what the proxy proves to them.
    pub(super) secret: ClusterSecret,
    /// The public listener's connection places (`serve.max_connections`).
    pub(super) public_slots: Arc<Semaphore>,
}

#[derive(Default)]
pub(super) struct Links {
    pub(super) decode: Option<(SocketAddr, u64, mpsc::UnboundedSender<Msg>)>,
    /// Stage 0's link: its writing half and what seals the proxy's lines on it.
    pub(super) stage0: Option<(SocketAddr, tokio::net::tcp::OwnedWriteHalf, crate::transport::auth::Sealer)>,
}

/// The largest body accepted: room for a prompt of `serve.max_context` tokens as
/// JSON token ids, and a chat of the same length, with headroom.
pub(super) fn body_limit(topo: &Topology) -> usize {
    (1 << 20) + 16 * topo.config.serve.max_context as usize
}

pub(super) fn count_closed(p: &Proxy, listener: &'static str, reason: &'static str) {
    *lock(&p.metrics).closed.entry((listener, reason)).or_default() += 1;
}

pub(super) fn set_phase(p: &Proxy, id: u64, phase: PhaseName) {
    if let Some(r) = lock(&p.routes).get_mut(&id) {
        r.phase = phase;
    }
}

/// What a choice's task reports.
pub(super) enum Ev {
    /// Generated bytes that are final (no stop sequence can claim them).
    Piece(Vec<u8>),
    Done {
        finish: &'static str,
        tokens: u32,
        summary: Summary,
    },
    Error(ServeError),
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub(super) struct Summary {
    pub(super) queue_ms: f64,
    pub(super) ttft_ms: f64,
    pub(super) itl_ms: Vec<f64>,
    pub(super) handoff_ms: f64,
    /// The hand-off tail: the longest of the stages' times from their last
    /// layer's compute to their write-done report (layer-wise streaming makes
    /// it short); None when decode had no figure.
    pub(super) tail_ms: Option<f64>,
    /// The compute of the stage with that tail (its batch, first layer to
    /// last), so a reader can set the tail against it.
    pub(super) stage_prefill_ms: Option<f64>,
    pub(super) decode_ms: f64,
    pub(super) bytes_handed_off: u64,
}

/// One generation request from arrival to its last byte: counts it in flight
/// (the drain waits for it) and, when dropped, counts its outcome once; dropped
/// without one, the client went away (`cancelled`).
pub(super) struct Served {
    pub(super) p: Arc<Proxy>,
    pub(super) outcome: Option<&'static str>,
}

impl Served {
    pub(super) fn new(p: &Arc<Proxy>) -> Served {
        p.inflight.fetch_add(1, Ordering::SeqCst);
        Served { p: Arc::clone(p), outcome: None }
    }

    /// The request failed: counts its refusal reason and returns its response.
    pub(super) fn fail(&mut self, e: ServeError) -> Response {
        self.note(&e);
        e.into_response()
    }

    pub(super) fn note(&mut self, e: &ServeError) {
        if self.outcome.is_none() {
            self.outcome = Some(e.outcome());
            let mut m = lock(&self.p.metrics);
            match e {
                ServeError::Failed(f) => {
                    let class = classify(f);
                    *m.failures.entry(class.labels).or_default() += 1;
                    if let Some(phase) = class.timeout {
                        *m.timeouts.entry(phase).or_default() += 1;
                    }
                }
                _ => {
                    if let ServeError::AdmissionTimeout(_) = e {
                        *m.timeouts.entry(PhaseName::Admission.name()).or_default() += 1;
                    }
                    *m.refusals.entry(e.code()).or_default() += 1;
                }
            }
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        *lock(&self.p.metrics).outcomes.entry(self.outcome.unwrap_or("cancelled")).or_default() += 1;
        self.p.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}
