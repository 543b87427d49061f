//! Where bytes live on a rank: the row table of each region (by module layer), the
//! TP segments of per-slot regions, and the per-request layout a rank publishes.
//!
//! Byte address of (module layer L, unit u) in a region = `row(L).offset + u * unit_stride`,
//! where a unit is a block (paged regions) or a slot (per-slot regions). Within a block,
//! token i sits at `i * token_bytes`. Within a slot, heads sit as the segment says.

use crate::vocab::{DecodeRank, ModuleLayer, PrefillRank, RankId, RegionKind};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use std::ops::Range;

/// One row of a region: the bytes of one module layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Row {
    pub layer: ModuleLayer,
    pub offset: u64,
}

/// One channel group of a head-split segment, relative to the start of a (row, slot)
/// unit. Head j of the segment (counted from `SegmentSpec::heads.start`) lies at
/// `offset + j * head_bytes + i * stride` for i in 0..repeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeadGroup {
    pub offset: u64,
    pub head_bytes: u64,
    pub stride: u64,
    pub repeat: u32,
}

/// The TP segment a rank publishes for a head-split region: which global heads it
/// holds and where each head lies in bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentSpec {
    pub heads: Range<u32>,
    pub groups: SmallVec<[HeadGroup; 3]>,
}

/// The layout of one registered region on one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionLayout {
    pub kind: RegionKind,
    /// Rows sorted by module layer.
    pub rows: Vec<Row>,
    /// Bytes between consecutive units (blocks or slots) of one row.
    pub unit_stride: u64,
    /// Blocks (paged) or slots (per-slot) the region holds.
    pub units: u32,
    /// Tokens per block (paged regions; 0 otherwise).
    pub block_size: u32,
    /// Bytes of one token of one row (paged regions; 0 otherwise).
    pub token_bytes: u64,
    /// Bytes of one (row, unit): a block of one layer or a slot of one layer.
    pub unit_bytes: u64,
    /// Head-split regions: the TP segment this rank holds.
    pub segment: Option<SegmentSpec>,
    /// Total bytes of the region.
    pub len: u64,
}

impl RegionLayout {
    pub fn row(&self, layer: ModuleLayer) -> Option<&Row> {
        self.rows.binary_search_by_key(&layer, |r| r.layer).ok().map(|i| &self.rows[i])
    }

    /// Byte address of unit `unit` of module layer `layer`.
    pub fn unit_offset(&self, layer: ModuleLayer, unit: u32) -> Option<u64> {
        self.row(layer).map(|r| r.offset + unit as u64 * self.unit_stride)
    }
}

/// The static layout of one rank: every region it registered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankLayout {
    pub rank: RankId,
    pub regions: Vec<RegionLayout>,
}

impl RankLayout {
    pub fn region(&self, kind: RegionKind) -> Option<&RegionLayout> {
        self.regions.iter().find(|r| r.kind == kind)
    }
}

/// What a decode rank publishes for one request: its regions, its DCP position, the
/// blocks it allocated (in local-position order) and the slot. Producers plan from
/// this alone, so the same code serves when roles are separate processes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsumerLayout {
    pub rank: DecodeRank,
    /// Decode TP size (the consumer's instance width).
    pub tp: u32,
    pub dcp: u32,
    pub interleave: u32,
    pub blocks: Vec<u32>,
    pub slot: u32,
    pub layout: RankLayout,
}

impl ConsumerLayout {
    pub fn dcp_rank(&self) -> u32 {
        self.rank.dcp_rank(self.dcp)
    }
}

/// A producer's own view of one request: its regions, its blocks (in token order)
/// and its slot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProducerLayout {
    pub rank: PrefillRank,
    pub blocks: Vec<u32>,
    pub slot: u32,
    pub layout: RankLayout,
}

/// Tokens of a sequence of `tokens` that dcp rank `dcp_rank` owns under the DCP
/// rule of docs/design.md section 4 (token p on dcp rank `(p / S) % dcp`). A rule of the
/// layout, shared by placement, the model and the oracle's checks.
pub fn owned_tokens(tokens: u64, dcp: u32, dcp_rank: u32, interleave: u32) -> u64 {
    let (s, dcp, d) = (interleave as u64, dcp as u64, dcp_rank as u64);
    let round = s * dcp;
    let full = tokens / round;
    let rem = tokens % round;
    full * s + rem.saturating_sub(d * s).min(s)
}

/// Blocks of `block_size` tokens that hold `tokens` tokens.
pub fn blocks_for(tokens: u64, block_size: u32) -> u64 {
    tokens.div_ceil(block_size as u64)
}
