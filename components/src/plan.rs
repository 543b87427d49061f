//! Descriptors and plans: the copies of one hand-off.

use crate::vocab::{DecodeRank, PrefillRank, RegionKind};
use serde::{Deserialize, Serialize};

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
    /// Contiguous pieces before coalescing (one per token row or head range).
    pub uncoalesced: u64,
}

impl Plan {
    pub fn bytes(&self) -> u64 {
        self.descriptors.iter().map(Descriptor::bytes).sum()
    }

    pub fn bytes_of(&self, kind: RegionKind) -> u64 {
        self.descriptors.iter().filter(|d| d.kind == kind).map(Descriptor::bytes).sum()
    }
}
