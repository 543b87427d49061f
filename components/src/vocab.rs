//! The vocabulary of docs/design.md section 1 as small value types.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A layer's index in the model, whatever its kind. Rows are placed by this id, so
/// "module layer 5" means the same thing on every rank and on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ModuleLayer(pub u32);

/// A layer mark: the device event a prefill stage recorded on its compute
/// stream once a layer's caches were queued into its source regions, by its
/// id (`handoff_kernels::StreamMark`; plain data, so that it rides with that
/// layer's writes through the phases). A mover whose writes are device copies
/// makes them wait on it on the device, so the host never waits for a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LayerMark(pub u64);

impl fmt::Display for ModuleLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "layer {}", self.0)
    }
}

/// The kind of a module layer in the hybrid pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LayerKind {
    /// Kimi Delta Attention: recurrent state, conv state, optional replay records.
    Kda,
    /// Multi-head latent attention: paged KV rows.
    Mla,
}

/// Element type of model-dtype data (MLA rows, conv state, indexer rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Bf16,
    F16,
    F32,
}

impl Dtype {
    pub const fn bytes(self) -> u64 {
        match self {
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
        }
    }
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::F32 => "f32",
        }
    }
}

/// The kind of a registered memory region (docs/design.md section 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum RegionKind {
    /// MLA latent KV rows, paged per block; replicated over TP, sharded by token over DCP.
    MlaKv,
    /// MLA indexer rows (sparse MLA only), paged like `MlaKv`.
    MlaIndexer,
    /// KDA recurrent state, per slot, split by head.
    KdaState,
    /// KDA short-conv state, per slot, split by head in three channel groups (q, k, v).
    KdaConv,
    /// ReplaySSM records ring, per slot, split by head.
    ReplayRecords,
    /// ReplaySSM cursor, one i32 per slot per KDA layer, replicated.
    ReplayCursor,
}

/// How a region's data is distributed over the decode ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Distribution {
    /// Paged by token; every TP rank holds the same rows, DCP shards tokens.
    TokenSharded,
    /// Per slot, split by head over TP; every DCP rank holds its TP share.
    HeadSplit,
    /// Per slot, written whole to every decode rank.
    Replicated,
}

impl RegionKind {
    pub const ALL: [RegionKind; 6] =
        [RegionKind::MlaKv, RegionKind::MlaIndexer, RegionKind::KdaState, RegionKind::KdaConv, RegionKind::ReplayRecords, RegionKind::ReplayCursor];

    /// The name used in messages, JSON and metrics.
    pub const fn name(self) -> &'static str {
        match self {
            RegionKind::MlaKv => "mla.kv",
            RegionKind::MlaIndexer => "mla.indexer",
            RegionKind::KdaState => "kda.state",
            RegionKind::KdaConv => "kda.conv",
            RegionKind::ReplayRecords => "replay.records",
            RegionKind::ReplayCursor => "replay.cursor",
        }
    }

    pub fn from_name(name: &str) -> Option<RegionKind> {
        RegionKind::ALL.into_iter().find(|k| k.name() == name)
    }

    pub const fn distribution(self) -> Distribution {
        match self {
            RegionKind::MlaKv | RegionKind::MlaIndexer => Distribution::TokenSharded,
            RegionKind::KdaState | RegionKind::KdaConv | RegionKind::ReplayRecords => Distribution::HeadSplit,
            RegionKind::ReplayCursor => Distribution::Replicated,
        }
    }

    /// The layer kind whose rows this region holds.
    pub const fn layer_kind(self) -> LayerKind {
        match self {
            RegionKind::MlaKv | RegionKind::MlaIndexer => LayerKind::Mla,
            _ => LayerKind::Kda,
        }
    }

    pub const fn is_paged(self) -> bool {
        matches!(self.distribution(), Distribution::TokenSharded)
    }

    /// A small stable index, for per-kind arrays.
    pub const fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for RegionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A prefill rank: one TP rank of one PP stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PrefillRank {
    pub pp: u32,
    pub tp: u32,
}

/// A decode rank. Its DCP rank is `tp % dcp` (DCP groups are runs of `dcp`
/// consecutive TP ranks, as in vLLM).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct DecodeRank {
    pub tp: u32,
}

impl DecodeRank {
    pub const fn dcp_rank(self, dcp: u32) -> u32 {
        self.tp % dcp
    }
}

/// Any rank of the deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum RankId {
    Prefill(PrefillRank),
    Decode(DecodeRank),
}

impl fmt::Display for RankId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RankId::Prefill(p) => write!(f, "prefill pp{} tp{}", p.pp, p.tp),
            RankId::Decode(d) => write!(f, "decode tp{}", d.tp),
        }
    }
}
