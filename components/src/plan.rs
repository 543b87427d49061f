//! Descriptors and plans: the copies of one hand-off.

use crate::layout::owned_tokens;
use crate::vocab::{DecodeRank, ModuleLayer, PrefillRank, RegionKind};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::sync::Arc;
use thiserror::Error;

/// One copy, possibly strided: for i in 0..count, `len` bytes from
/// `src_offset + i * src_stride` in the producer's region of `kind` to
/// `dst_offset + i * dst_stride` in the consumer's region of the same kind.
/// The ranks are those of the plan that holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Descriptor {
    pub kind: RegionKind,
    pub src_offset: u64,
    pub dst_offset: u64,
    pub len: u64,
    pub count: u32,
    pub src_stride: u64,
    pub dst_stride: u64,
}

impl Descriptor {
    /// A plain contiguous copy.
    pub const fn copy(kind: RegionKind, src_offset: u64, dst_offset: u64, len: u64) -> Self {
        Descriptor { kind, src_offset, dst_offset, len, count: 1, src_stride: 0, dst_stride: 0 }
    }

    /// Bytes this descriptor writes.
    pub const fn bytes(&self) -> u64 {
        self.len * self.count as u64
    }

    /// The (src, dst) offsets of each contiguous piece.
    pub fn pieces(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.count as u64).map(|i| (self.src_offset + i * self.src_stride, self.dst_offset + i * self.dst_stride))
    }

    /// One past the last destination byte written.
    pub fn dst_end(&self) -> u64 {
        self.dst_offset + (self.count as u64 - 1) * self.dst_stride + self.len
    }

    /// One past the last source byte read.
    pub fn src_end(&self) -> u64 {
        self.src_offset + (self.count as u64 - 1) * self.src_stride + self.len
    }
}

/// Every copy of one request from one producer rank to one consumer rank, coalesced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub producer: PrefillRank,
    pub consumer: DecodeRank,
    pub descriptors: Vec<Descriptor>,
    /// Token rows whose producer and consumer blocks do not line up, moved through
    /// staging (one group per region kind; empty when the blocks line up).
    #[serde(default)]
    pub staged: Vec<StagedRows>,
    /// Contiguous pieces before coalescing (one per token row or head range).
    pub uncoalesced: u64,
    /// A chunked transfer (`[prefill] chunked`): where each chunk's descriptors end,
    /// in token order. Chunk `k` holds the token rows of its token range only;
    /// the last one also holds every head-split and replicated kind (KDA state,
    /// conv, replay records and cursor), so the state lands after every row.
    /// The mover writes a chunk only after the one before it completed. Empty:
    /// one plain hand-off, in any order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<u32>,
    /// Layer-wise streaming (`[prefill] layer_streaming`): the plan's writes cut
    /// by module layer, in layer order, so that a stage issues each layer's
    /// writes as soon as that layer is computed ([`Plan::part`]). No descriptor
    /// or staged group spans two layers. Empty: one part, the whole plan.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<LayerPart>,
}

/// Where one module layer's writes of a layered plan ([`Plan::layers`]) end:
/// its descriptors are `descriptors[previous end..descriptors]`, its staged
/// groups `staged[previous end..staged]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerPart {
    pub layer: ModuleLayer,
    pub descriptors: u32,
    pub staged: u32,
}

impl Plan {
    /// Bytes the plan writes into the consumer, descriptors and staged writes.
    pub fn bytes(&self) -> u64 {
        self.descriptors.iter().map(Descriptor::bytes).sum::<u64>() + self.staged.iter().map(StagedRows::bytes).sum::<u64>()
    }

    pub fn bytes_of(&self, kind: RegionKind) -> u64 {
        let staged: u64 = self.staged.iter().filter(|g| g.kind == kind).map(StagedRows::bytes).sum();
        self.descriptors.iter().filter(|d| d.kind == kind).map(Descriptor::bytes).sum::<u64>() + staged
    }

    /// The descriptors of each chunk, in order (one slice, all of them, when the
    /// plan is not chunked).
    pub fn chunk_descriptors(&self) -> Vec<&[Descriptor]> {
        if self.chunks.is_empty() {
            return vec![&self.descriptors];
        }
        let mut out = Vec::with_capacity(self.chunks.len());
        let mut start = 0usize;
        for (i, &end) in self.chunks.iter().enumerate() {
            // The last chunk takes every descriptor left: none is ever skipped.
            let end = if i + 1 == self.chunks.len() { self.descriptors.len() } else { (end as usize).clamp(start, self.descriptors.len()) };
            out.push(&self.descriptors[start..end]);
            start = end;
        }
        out
    }

    /// Parts the plan is written in: one per [`LayerPart`] of a layered plan,
    /// else 1.
    pub fn parts(&self) -> usize {
        self.layers.len().max(1)
    }

    /// The module layer whose compute part `i` waits for (None: the whole
    /// plan, which waits for the stage's every layer).
    pub fn part_layer(&self, i: usize) -> Option<ModuleLayer> {
        self.layers.get(i).map(|p| p.layer)
    }

    /// Part `i` as a plan of its own: layer `i`'s descriptors and staged groups
    /// of a layered plan (the whole plan when it is not layered). The plan's
    /// `uncoalesced` count goes with part 0, so the parts add up to the plan.
    pub fn part(&self, i: usize) -> Plan {
        if self.layers.is_empty() {
            return self.clone();
        }
        // The last part takes whatever is left, so no write is ever skipped.
        let bound = |k: Option<usize>, len: usize, end: fn(&LayerPart) -> u32| match k {
            None => 0,
            Some(k) if k + 1 >= self.layers.len() => len,
            Some(k) => (end(&self.layers[k]) as usize).min(len),
        };
        let (nd, ns) = (self.descriptors.len(), self.staged.len());
        let d1 = bound(Some(i), nd, |p| p.descriptors);
        let d0 = bound(i.checked_sub(1), nd, |p| p.descriptors).min(d1);
        let s1 = bound(Some(i), ns, |p| p.staged);
        let s0 = bound(i.checked_sub(1), ns, |p| p.staged).min(s1);
        Plan {
            producer: self.producer,
            consumer: self.consumer,
            descriptors: self.descriptors[d0..d1].to_vec(),
            staged: self.staged[s0..s1].to_vec(),
            uncoalesced: if i == 0 { self.uncoalesced } else { 0 },
            chunks: Vec::new(),
            layers: Vec::new(),
        }
    }

    /// Writes through the transport: one per descriptor and one per staged write.
    pub fn writes(&self) -> usize {
        self.descriptors.len() + self.staged.iter().map(|g| g.writes.len()).sum::<usize>()
    }
}

/// One side's block table of a staged group: block `blocks[i]` holds positions
/// `i * block_size ..` of every row, `block_stride` bytes apart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagedBlocks {
    /// Shared, not copied: a producer's table serves every consumer's plan.
    #[serde(serialize_with = "ser_blocks", deserialize_with = "de_blocks")]
    pub blocks: Arc<[u32]>,
    pub block_size: u32,
    pub block_stride: u64,
}

fn ser_blocks<S: Serializer>(b: &Arc<[u32]>, s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(b.iter())
}

fn de_blocks<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<[u32]>, D::Error> {
    Vec::<u32>::deserialize(d).map(Arc::from)
}

/// One staging buffer's worth of a staged group: local positions `start..end` (the
/// consumer's token order) of row `rows[row]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagedWrite {
    pub row: u32,
    pub start: u64,
    pub end: u64,
}

/// Token-sharded rows of one kind for one (producer, consumer) pair, moved through
/// staging: each write gathers its positions' rows from the producer's blocks into
/// one staging buffer, is written as one contiguous range, and lands in the
/// consumer's blocks (docs/design.md section 4, "Coalescing"). The group carries
/// both block tables and the DCP rule instead of one copy per block, so its size
/// grows with the bytes over the staging buffer, not with the token rows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagedRows {
    pub kind: RegionKind,
    pub token_bytes: u64,
    /// The request's positions are `0..tokens`.
    pub tokens: u64,
    /// The consumer's DCP degree, its DCP rank and the token interleave S.
    pub dcp: u32,
    pub dcp_rank: u32,
    pub interleave: u32,
    pub src: StagedBlocks,
    pub dst: StagedBlocks,
    /// (producer row offset, consumer row offset) of each layer.
    pub rows: Vec<(u64, u64)>,
    /// The staging buffer bytes the writes were cut for: no write is larger.
    pub staging_bytes: u64,
    pub writes: Vec<StagedWrite>,
}

/// Why a staged group cannot be run: each names the values involved.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StagedError {
    #[error("{kind}: {what} is 0")]
    Zero { kind: RegionKind, what: &'static str },
    #[error("{kind}: dcp rank {rank} of a dcp {dcp} instance")]
    DcpRank { kind: RegionKind, rank: u32, dcp: u32 },
    #[error("{kind}: write {index} names row {row} of {rows}")]
    Row { kind: RegionKind, index: usize, row: u32, rows: usize },
    #[error("{kind}: write {index} covers positions {start}..{end}, outside the {owned} the consumer owns")]
    Positions { kind: RegionKind, index: usize, start: u64, end: u64, owned: u64 },
    #[error("{kind}: write {index} of {bytes} B exceeds the {staging} B staging buffer")]
    TooLarge { kind: RegionKind, index: usize, bytes: u64, staging: u64 },
    #[error("{kind}: {side} has {have} blocks, the positions need {need}")]
    ShortBlocks { kind: RegionKind, side: &'static str, have: u64, need: u64 },
    #[error("{kind}: {side} range ends past u64")]
    Overflow { kind: RegionKind, side: &'static str },
}

/// One contiguous stretch of a staged write: `len` bytes at `src` in the producer's
/// region, at `stage` in the staging buffer and at `dst` in the consumer's region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedPiece {
    pub src: u64,
    pub stage: u64,
    pub dst: u64,
    pub len: u64,
}

impl StagedRows {
    /// Positions the consumer owns (its rows' local positions are `0..owned`).
    pub fn owned(&self) -> u64 {
        owned_tokens(self.tokens, self.dcp, self.dcp_rank, self.interleave)
    }

    /// Bytes the group writes into the consumer.
    pub fn bytes(&self) -> u64 {
        self.writes.iter().map(|w| (w.end - w.start) * self.token_bytes).sum()
    }

    /// Refuses a group whose pieces could not be computed: zero sizes, writes
    /// outside the owned positions or larger than the staging buffer, block tables
    /// too short for the positions. Afterwards [`StagedRows::pieces`] indexes only
    /// inside the tables and every offset fits in u64; [`StagedRows::src_end`] and
    /// [`StagedRows::dst_end`] bound what it reads and writes.
    pub fn check(&self) -> Result<(), StagedError> {
        let kind = self.kind;
        for (what, v) in [
            ("token bytes", self.token_bytes),
            ("dcp", u64::from(self.dcp)),
            ("interleave", u64::from(self.interleave)),
            ("producer block size", u64::from(self.src.block_size)),
            ("consumer block size", u64::from(self.dst.block_size)),
        ] {
            if v == 0 {
                return Err(StagedError::Zero { kind, what });
            }
        }
        if self.dcp_rank >= self.dcp {
            return Err(StagedError::DcpRank { kind, rank: self.dcp_rank, dcp: self.dcp });
        }
        let owned = self.owned();
        for (index, w) in self.writes.iter().enumerate() {
            if w.row as usize >= self.rows.len() {
                return Err(StagedError::Row { kind, index, row: w.row, rows: self.rows.len() });
            }
            if w.start >= w.end || w.end > owned {
                return Err(StagedError::Positions { kind, index, start: w.start, end: w.end, owned });
            }
            let bytes = (w.end - w.start).saturating_mul(self.token_bytes);
            if bytes > self.staging_bytes {
                return Err(StagedError::TooLarge { kind, index, bytes, staging: self.staging_bytes });
            }
        }
        // The last owned position lies below `tokens`, and its global position too.
        let need_src = self.tokens.div_ceil(u64::from(self.src.block_size));
        let need_dst = owned.div_ceil(u64::from(self.dst.block_size));
        for (side, have, need) in [("producer", self.src.blocks.len() as u64, need_src), ("consumer", self.dst.blocks.len() as u64, need_dst)] {
            if have < need {
                return Err(StagedError::ShortBlocks { kind, side, have, need });
            }
        }
        self.src_end()?;
        self.dst_end()?;
        Ok(())
    }

    /// One past the last producer byte any write may read: the end of the last
    /// block of the table in the row at the highest offset.
    pub fn src_end(&self) -> Result<u64, StagedError> {
        let rows = self.rows.iter().map(|r| r.0).max();
        end_of(&self.src, rows, self.token_bytes).ok_or(StagedError::Overflow { kind: self.kind, side: "producer" })
    }

    /// One past the last consumer byte any write may land on.
    pub fn dst_end(&self) -> Result<u64, StagedError> {
        let rows = self.rows.iter().map(|r| r.1).max();
        end_of(&self.dst, rows, self.token_bytes).ok_or(StagedError::Overflow { kind: self.kind, side: "consumer" })
    }

    /// The pieces of write `w`, in position order: each stays inside one interleave
    /// group and one block on either side, so it is contiguous everywhere. Call on a
    /// group that passed [`StagedRows::check`]; `w` must be one of its writes.
    pub fn pieces(&self, w: StagedWrite) -> impl Iterator<Item = StagedPiece> + '_ {
        let (s, dcp, d) = (u64::from(self.interleave), u64::from(self.dcp), u64::from(self.dcp_rank));
        let (pbs, dbs, tb) = (u64::from(self.src.block_size), u64::from(self.dst.block_size), self.token_bytes);
        let (src_row, dst_row) = self.rows[w.row as usize];
        let mut lp = w.start;
        std::iter::from_fn(move || {
            if lp >= w.end {
                return None;
            }
            // docs/design.md section 4: local position lp of dcp rank d is token p.
            let within = lp % s;
            let p = (lp / s) * s * dcp + d * s + within;
            let n = (s - within).min(w.end - lp).min(pbs - p % pbs).min(dbs - lp % dbs);
            let piece = StagedPiece {
                src: src_row + u64::from(self.src.blocks[(p / pbs) as usize]) * self.src.block_stride + p % pbs * tb,
                stage: (lp - w.start) * tb,
                dst: dst_row + u64::from(self.dst.blocks[(lp / dbs) as usize]) * self.dst.block_stride + lp % dbs * tb,
                len: n * tb,
            };
            lp += n;
            Some(piece)
        })
    }
}

/// `max_row + max_block * stride + block_size * token_bytes`, checked.
fn end_of(side: &StagedBlocks, max_row: Option<u64>, tb: u64) -> Option<u64> {
    let (Some(row), Some(&b)) = (max_row, side.blocks.iter().max()) else { return Some(0) };
    u64::from(b).checked_mul(side.block_stride)?.checked_add(row)?.checked_add(u64::from(side.block_size).checked_mul(tb)?)
}
