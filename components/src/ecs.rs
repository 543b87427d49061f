//! ECS components, resources and messages: plain data only.
//!
//! Entities: one per rank, region and segment (spawned at startup), and per request:
//! the request itself, one lease per rank it holds blocks or a slot on, one plan per
//! (producer, consumer) pair and one producer entry per PP stage.

use crate::config::Topology;
use crate::layout::{ConsumerLayout, RegionLayout, SegmentSpec};
use crate::plan::Plan;
use crate::vocab::{DecodeRank, PrefillRank, RankId, RegionKind};
use bevy_ecs::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

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

/// The phase a request is in. Named phases are what timeouts and failures report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PhaseName {
    Admission,
    Compute,
    Transfer,
    Decode,
}

impl PhaseName {
    pub const fn name(self) -> &'static str {
        match self {
            PhaseName::Admission => "admission",
            PhaseName::Compute => "compute",
            PhaseName::Transfer => "transfer",
            PhaseName::Decode => "decode",
        }
    }
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
    Failed { phase: PhaseName, reason: String },
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

/// Where one request lives on one rank: its blocks, in position order, and its
/// slot. The one lease shape: the engine's lease entities carry it, the compute
/// reads it.
#[derive(Component, Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub rank: RankId,
    pub blocks: Vec<u32>,
    pub slot: u32,
}

/// A request's blocks on one rank, in position order.
#[derive(Component, Debug, Clone)]
pub struct BlockTable {
    pub request: Entity,
    pub rank: RankId,
    pub blocks: Vec<u32>,
}

/// A request's slot on one rank.
#[derive(Component, Debug, Clone, Copy)]
pub struct Slot {
    pub request: Entity,
    pub rank: RankId,
    pub index: u32,
}

/// The layout a decode rank published for a request (on its lease entity).
#[derive(Component, Debug, Clone)]
pub struct Published(pub ConsumerLayout);

/// Which (pp, producer tp) have reported their writes into this decode rank.
#[derive(Component, Debug, Clone, Default)]
pub struct ConsumerProgress {
    pub expected: u32,
    pub reported: Vec<(u32, u32)>,
}

/// One plan of a request and where its writes stand.
#[derive(Component, Debug, Clone)]
pub struct PlanEntry {
    pub request: Entity,
    pub plan: Plan,
    pub state: WriteState,
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

/// A request to be handed off, as it arrives.
#[derive(Message, Debug, Clone)]
pub struct Submit {
    pub id: u64,
    pub tokens: u64,
}

/// A write-done report: producer (pp, tp) finished its writes into one decode rank.
#[derive(Message, Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteDone {
    pub request: u64,
    pub nonce: u64,
    pub producer: PrefillRank,
    pub consumer: DecodeRank,
}

/// A request left the hand-off: handed off (ready to decode), rejected or failed.
#[derive(Message, Debug, Clone, PartialEq)]
pub struct Outcome {
    pub request: u64,
    pub result: Result<(), (PhaseName, String)>,
}

/// Counters of the completion protocol.
#[derive(Resource, Debug, Default, Clone)]
pub struct ReportStats {
    pub accepted: u64,
    pub duplicate: u64,
    pub wrong_nonce: u64,
    pub unknown: u64,
}
