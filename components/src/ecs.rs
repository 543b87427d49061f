//! ECS components, resources and messages: plain data only.
//!
//! Entities: one per rank, region and segment (spawned at startup), and per request:
//! the request itself, one lease per rank it holds blocks or a slot on, one plan per
//! (producer, consumer) pair and one producer entry per PP stage.

use crate::config::Topology;
use crate::failure::{Failure, ProcessRole};
use crate::layout::{ConsumerLayout, RegionLayout, SegmentSpec};
// Re-exported: `ecs::PhaseName` is the path the systems, roles and tests name it by.
pub use crate::phase::{PhaseName, UnknownPhase};
use crate::plan::Plan;
use crate::sampling::Sampling;
use crate::vocab::{DecodeRank, PrefillRank, RankId, RegionKind};
use bevy_ecs::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// A worker of the deployment.
#[derive(Component, Debug, Clone, Copy)]
pub struct Rank {
    pub id: RankId,
}

/// A registered region of one rank. For head-split kinds the TP segment is its own
/// entity (`Segment`), joined in when the rank publishes its layout.
#[derive(Component, Debug, Clone)]
pub struct Region {
    pub rank: RankId,
    pub layout: RegionLayout,
}

/// The TP segment of one head-split region: which heads, where in bytes.
#[derive(Component, Debug, Clone)]
pub struct Segment {
    pub rank: RankId,
    pub kind: RegionKind,
    pub spec: SegmentSpec,
}

/// One request being handed off.
#[derive(Component, Debug, Clone)]
pub struct Request {
    pub id: u64,
    pub tokens: u64,
    /// Reports carrying another nonce belong to an earlier life of this id.
    pub nonce: u64,
}

/// Where a request is in its life.
#[derive(Component, Debug, Clone, PartialEq, Eq)]
pub enum Status {
    /// Waiting for blocks and slots.
    Waiting,
    /// Leases held, consumer layouts published.
    Placed,
    /// Plans made; stages write as they finish computing.
    Planned,
    /// Every consumer rank has every stage's writes; sources freed.
    HandedOff,
    /// Decode finished with it; everything is released next tick.
    Finished,
    /// Failed; released once no write may still read its sources.
    Failed(Failure),
}

/// When the current phase of a request expires.
#[derive(Component, Debug, Clone, Copy)]
pub struct Deadline {
    pub phase: PhaseName,
    pub at: Instant,
}

/// The per-request entities a request owns, so release finds them without a scan.
#[derive(Component, Debug, Clone, Default)]
pub struct Holdings {
    pub leases: Vec<Entity>,
    pub plans: Vec<Entity>,
    pub entries: Vec<Entity>,
}

/// Which PP stages have finished computing a request (their rows may be read).
#[derive(Component, Debug, Clone, Default)]
pub struct StagesComputed(pub Vec<bool>);

/// When each PP stage held here finished computing its last layer of the
/// request (the start of the stage's hand-off tail, which ends at its
/// write-done report, [`StageReport::tail_us`]), and how long the stage's
/// compute of the batch that held the request took.
#[derive(Component, Debug, Clone, Default)]
pub struct LastLayerAt(pub Vec<Option<StageCompute>>);

/// One stage's compute of one request: when its last layer was done, and the
/// microseconds from the batch's compute start to then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageCompute {
    pub last_layer: Instant,
    pub compute_us: u64,
}

/// Where one request lives on one rank: its blocks, in position order, and its
/// slot. The one lease shape: the engine's lease entities carry it, the compute
/// reads it.
#[derive(Component, Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub rank: RankId,
    pub blocks: Vec<u32>,
    pub slot: u32,
}

/// The layout a decode rank published for a request (on its lease entity).
#[derive(Component, Debug, Clone)]
pub struct Published(pub ConsumerLayout);

/// Which (pp, producer tp) have reported their writes into this decode rank, and
/// how many must: the producers whose share reaches this rank (the rules of
/// docs/design.md section 4, from the topology), set when the rank publishes.
#[derive(Component, Debug, Clone, Default)]
pub struct ConsumerProgress {
    pub expected: u32,
    pub reported: Vec<(u32, u32)>,
}

/// What decode published for a request whose consumers live in another World
/// (a prefill stage's copy of decode's layouts): splitting plans against these.
#[derive(Component, Debug, Clone)]
pub struct RemoteConsumers(pub Vec<ConsumerLayout>);

/// What a prefill stage's compute reads: the prompt (byte tokens; stage 0 embeds
/// them) and the previous stage's hidden states `[tokens, hidden]`, once known.
#[derive(Component, Debug, Clone, Default)]
pub struct Inputs {
    pub prompt: Vec<u8>,
    pub hidden: Option<Vec<f32>>,
}

/// The last stage's greedy pick at the prompt's last position: the first
/// generated token, sent to decode with that stage's write-done report.
#[derive(Component, Debug, Clone, Copy)]
pub struct FirstToken(pub u8);

/// When a decode World admitted a request and handed it off, and the bytes its
/// stages reported: the figures `Finished` carries.
#[derive(Component, Debug, Clone, Copy)]
pub struct Timing {
    pub admitted: Instant,
    pub handed_off: Option<Instant>,
    pub bytes: u64,
    /// The longest hand-off tail the stages reported ([`StageReport::tail_us`]).
    pub tail_us: Option<u64>,
    /// The compute time of the stage that reported that tail
    /// ([`StageReport::compute_us`]): what the tail is set against.
    pub tail_stage_compute_us: Option<u64>,
}

/// Decode progress of a handed-off request: `emitted` tokens of `max_tokens` have
/// left the engine, `last` is the token the next step feeds (at position
/// prompt + emitted - 1).
#[derive(Component, Debug, Clone, Copy, Default)]
pub struct DecodeProgress {
    pub max_tokens: u32,
    pub emitted: u32,
    pub last: Option<u8>,
    /// The decode tick that last stepped it: past `serve.max_batch`, those stepped
    /// longest ago go first.
    pub stepped: u64,
}

/// Teacher forcing (`handoff eval`): the bytes a decode request is fed in place
/// of its own picks, `0[k]` at position prompt + k (see [`Submit::forced`]).
#[derive(Component, Debug, Clone, Default)]
pub struct Forced(pub Vec<u8>);

/// One plan of a request and where its writes stand. A layered plan
/// ([`Plan::layers`]) is written in parts, one a module layer, each submitted
/// once its layer is computed: `submitted` parts have gone to the mover (always
/// a prefix, in layer order) and `completed` of them came back.
#[derive(Component, Debug, Clone)]
pub struct PlanEntry {
    pub request: Entity,
    pub plan: Plan,
    pub state: WriteState,
    pub submitted: u32,
    pub completed: u32,
    /// A part's writes failed: the plan reports no write-done.
    pub failed: bool,
}

impl PlanEntry {
    /// A plan none of whose writes has started.
    pub fn new(request: Entity, plan: Plan) -> Self {
        PlanEntry { request, plan, state: WriteState::Pending, submitted: 0, completed: 0, failed: false }
    }

    /// Whether a submitted part's writes may still be reading the sources.
    pub fn writing(&self) -> bool {
        self.submitted > self.completed
    }

    /// Whether every part has been submitted.
    pub fn all_submitted(&self) -> bool {
        self.submitted as usize >= self.plan.parts()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteState {
    Pending,
    InFlight,
    Done,
}

/// The producer-side record of one in-flight hand-off on one PP stage; dropped as
/// soon as that stage's own writes complete.
#[derive(Component, Debug, Clone)]
pub struct ProducerEntry {
    pub request: Entity,
    pub stage: u32,
    pub pending: u32,
}

/// The validated topology.
#[derive(Resource, Debug, Clone)]
pub struct TopologyRes(pub Topology);

/// Which ranks this World holds: a prefill stage holds its TP ranks, decode its
/// TP x DCP ranks, and `verify` one World of every rank.
#[derive(Resource, Debug, Clone, PartialEq, Eq)]
pub struct LocalRanks {
    /// The PP stages whose ranks live here, in order.
    pub stages: Vec<u32>,
    /// Whether the decode ranks live here.
    pub decode: bool,
}

impl LocalRanks {
    pub fn has_stage(&self, stage: u32) -> bool {
        self.stages.contains(&stage)
    }

    /// The role a failure this World makes is charged to, where no one system
    /// knows better: decode where the decode ranks live, else its first stage.
    pub fn role(&self) -> ProcessRole {
        match self.stages.first() {
            Some(&stage) if !self.decode => ProcessRole::Prefill { stage },
            _ => ProcessRole::Decode,
        }
    }
}

/// Request id to entity.
#[derive(Resource, Debug, Default)]
pub struct RequestIndex(pub HashMap<u64, Entity>);

/// Free blocks and slots of every rank.
#[derive(Resource, Debug, Default)]
pub struct Pools(pub BTreeMap<RankId, RankPool>);

/// Free blocks (as ranges, so fresh allocations are contiguous) and free slots of one rank.
#[derive(Debug, Clone, Default)]
pub struct RankPool {
    /// start -> length of each free block range.
    pub free_blocks: BTreeMap<u32, u32>,
    pub free_slots: Vec<u32>,
    pub blocks: u32,
    pub slots: u32,
}

impl RankPool {
    pub fn new(blocks: u32, slots: u32) -> Self {
        let mut free_blocks = BTreeMap::new();
        if blocks > 0 {
            free_blocks.insert(0, blocks);
        }
        RankPool { free_blocks, free_slots: (0..slots).rev().collect(), blocks, slots }
    }

    pub fn free_block_count(&self) -> u64 {
        self.free_blocks.values().map(|&n| n as u64).sum()
    }
}

/// A request to be handed off, as it arrives (admission reads it).
#[derive(Message, Debug, Clone, Default)]
pub struct Submit {
    pub id: u64,
    /// Prompt tokens.
    pub tokens: u64,
    /// Decode's nonce for this life of the id; `None` lets admission draw one (the
    /// World that places the consumers does).
    pub nonce: Option<u64>,
    /// Decode's published layouts, when the consumers live in another World.
    pub consumers: Vec<ConsumerLayout>,
    /// What the prefill compute reads (empty without a compute).
    pub inputs: Inputs,
    /// Tokens decode generates (decode Worlds; 0 elsewhere).
    pub max_tokens: u32,
    /// Teacher forcing (`handoff eval`): the bytes decode feeds in place of its
    /// own picks, `forced[k]` at position prompt + k; empty = greedy.
    pub forced: Vec<u8>,
    /// How the request picks its tokens (None or greedy: the model's own pick).
    /// Admission puts a non-greedy one on the request entity, where the dispatch
    /// phase reads it and from which it goes with the request.
    pub sampling: Option<Sampling>,
}

/// A write-done report: producer (pp, tp) finished its writes into one decode rank.
#[derive(Message, Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteDone {
    pub request: u64,
    pub nonce: u64,
    pub producer: PrefillRank,
    pub consumer: DecodeRank,
}

/// A stage's report as decode receives it from another process: every pair whose
/// writes completed, and (last stage) the first generated token.
#[derive(Message, Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StageReport {
    pub request: u64,
    pub nonce: u64,
    pub stage: u32,
    pub pairs: Vec<(PrefillRank, DecodeRank)>,
    pub first_token: Option<u8>,
    pub bytes: u64,
    /// The stage's hand-off tail: microseconds from its last layer's compute to
    /// this report (None where the World did not compute it, as in `verify`).
    #[serde(default)]
    pub tail_us: Option<u64>,
    /// The stage's compute of the batch that held the request, microseconds
    /// from its start to the last layer (None where `tail_us` is).
    #[serde(default)]
    pub compute_us: Option<u64>,
}

/// Fail a live request (its client went away, a peer failed it): the release
/// phase frees what it holds once no write may still read its sources.
#[derive(Message, Debug, Clone, PartialEq, Eq)]
pub struct Cancel {
    pub request: u64,
    /// What the request fails with: the phase, the role charged, the cause.
    pub failure: Failure,
    /// The stage that failed the request, when one did: it writes no more.
    pub stage: Option<u32>,
    /// The life of the id it cancels, when the sender knows it: a cancel of an
    /// earlier life does not touch a new request that reuses the id.
    pub nonce: Option<u64>,
    /// No stage was ever given the request (the proxy failed it before it sent
    /// the prefill job), so none will write or report: every stage counts as
    /// settled and a decode frees the blocks at once, not at the phase deadline.
    pub unsent: bool,
}

/// A request left the hand-off: handed off (ready to decode), rejected or failed.
/// A request that fails after its hand-off (in decode) has both.
#[derive(Message, Debug, Clone, PartialEq)]
pub struct Outcome {
    pub request: u64,
    /// The life of the id it ended (None for an id refused before it had one).
    pub nonce: Option<u64>,
    pub result: Result<(), Failure>,
}

/// What the engine tells its role to carry out of the process.
#[derive(Message, Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// Decode placed a request: every decode rank's layout (rank order) and the nonce.
    Published { request: u64, nonce: u64, consumers: Vec<ConsumerLayout> },
    /// A stage computed a request whose next stage lives elsewhere: its hidden
    /// states, and what the next stage needs to plan (decode's layouts, the nonce).
    /// `sampling` goes with the job, so that the last stage samples token 0.
    Computed { request: u64, nonce: u64, stage: u32, tokens: u64, hidden: Vec<f32>, consumers: Vec<ConsumerLayout>, sampling: Option<Sampling> },
    /// Every write of one stage for a request completed (its producer entry is gone).
    Written(StageReport),
    /// Decode produced a token (`index` 0 is the first, from prefill).
    Token { request: u64, index: u32, token: u8 },
    /// Decode emitted a request's last token; its blocks and slots are freed.
    /// `tail_ms`: the longest of the stages' hand-off tails, when they measured
    /// one; `stage_prefill_ms`: that stage's compute of the request's batch.
    Finished { request: u64, handoff_ms: f64, decode_ms: f64, bytes: u64, tail_ms: Option<f64>, stage_prefill_ms: Option<f64> },
    /// A prefill stage settled a request it never held ([`Settle`]): it will drop
    /// the request's job if that still comes, and decode must hear now that this
    /// stage writes nothing for it.
    Settled { request: u64, nonce: u64, failure: Failure },
    /// Decode: these requests (id, nonce) wait for PP stage `stage`, which may
    /// never get their job (an earlier stage died before passing it on); the
    /// stage is to be asked to settle them ([`Settle`]).
    Orphaned { stage: u32, requests: Vec<(u64, u64)>, failure: Failure },
    /// Decode failed a request now ([`StageDown`]); its outcome comes when it is
    /// released, which may be as late as its phase deadline, so the client is
    /// told at once.
    Failing { request: u64, failure: Failure },
}

/// Decode: PP stage `stage` died (`dead`: its process is gone, so it writes no
/// more) or stopped answering. The release phase fails every request still
/// waiting for its writes and names the later stages' orphans.
#[derive(Message, Debug, Clone, PartialEq, Eq)]
pub struct StageDown {
    pub stage: u32,
    pub dead: bool,
    pub detail: String,
}

/// A prefill stage: settle these requests (id, nonce), which an earlier stage's
/// death left waiting for this one. One the World holds fails with `failure`
/// (after its writes in flight complete); one it does not hold is remembered in
/// [`Settled`], so that its job is dropped if it still comes.
#[derive(Message, Debug, Clone, PartialEq, Eq)]
pub struct Settle {
    pub requests: Vec<(u64, u64)>,
    pub failure: Failure,
}

/// Requests settled before their job came (id -> nonce and when), each kept for
/// `keep` after it was settled: admission drops a job for one of them.
#[derive(Resource, Debug, Clone)]
pub struct Settled {
    pub requests: HashMap<u64, (u64, Instant)>,
    pub keep: Duration,
}

impl Default for Settled {
    fn default() -> Self {
        Settled { requests: HashMap::new(), keep: Settled::KEEP }
    }
}

impl Settled {
    /// Long enough that a job still in flight when its request was settled has
    /// arrived; short enough that the entries are bounded by the settles of
    /// that long.
    pub const KEEP: Duration = Duration::from_secs(120);

    pub fn holds(&self, request: u64, nonce: u64) -> bool {
        self.requests.get(&request).is_some_and(|&(n, _)| n == nonce)
    }
}

/// What decode hears from the stages of other processes, after their writes
/// completed (so a report is received only after the bytes it reports are in
/// place): the counterpart, on the consumer's side, of a mover's completions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StageNotice {
    /// Every write of the stage for the request completed.
    Written(StageReport),
    /// Stage `stage` failed the request and writes no more for it; `nonce` is the
    /// request's life when the stage knew it.
    Failed { request: u64, nonce: Option<u64>, stage: u32, failure: Failure },
}

/// Counters of the completion protocol.
#[derive(Resource, Debug, Default, Clone)]
pub struct ReportStats {
    pub accepted: u64,
    pub duplicate: u64,
    pub wrong_nonce: u64,
    pub unknown: u64,
}
