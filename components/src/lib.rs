//! Plain data of handoff. Everything here is a value type: the topology file and its
//! validated form, the vocabulary of docs/design.md (ranks, module layers, regions, segments,
//! descriptors, plans) and the ECS components that carry them. Logic beyond
//! constructors and invariants lives in the `handoff-systems` crate.

pub mod cluster;
pub mod config;
pub mod ecs;
pub mod failure;
pub mod layout;
pub mod phase;
pub mod plan;
pub mod sampling;
pub mod vocab;

pub use config::{Config, ConfigError, Topology};
pub use failure::{Cause, Failure, PeerLoss, ProcessRole};
pub use layout::{RankLayout, RegionLayout, SegmentSpec};
pub use plan::{Descriptor, Plan, StagedRows};
pub use sampling::Sampling;
pub use vocab::{DecodeRank, Dtype, LayerKind, ModuleLayer, PrefillRank, RegionKind};
