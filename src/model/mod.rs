//! The compute path: a small hybrid MLA + KDA model (docs/design.md section 5) that the
//! PP prefill stages and the TP x DCP decode ranks actually run, and the colocated
//! single-rank reference it must agree with.
//!
//! - [`weights`]: dimensions from the topology's `[model]` table, seeded host
//!   weights (SplitMix64 streams, N(0, 1/sqrt(fan_in))), and their upload as the
//!   backend buffers of a TP group ([`Model::upload_group`]).
//! - [`forward`]: the layers, written once over a TP group of shards and generic
//!   over the `Backend`; caches are the caller's (a prefill sink, a
//!   [`forward::BatchCaches`]); decode runs a batch of requests per step.
//! - [`reference`](mod@reference): the colocated run with plain caches.
//! - [`regions`]: the byte view of registered regions the caches go through.
//! - [`ranks`]: prefill ranks writing producer regions, decode ranks running from
//!   their decode regions (byte layout of docs/layout.md).
//! - [`bench`](mod@bench): throughput figures of the small model and of the decode kernels.
//!
//! Everything is written against the kernels' `Backend` trait: host memory appears
//! only at upload and download. The CPU backend is named once, by
//! [`run_colocated`], the reference verify compares against.

pub mod bench;
pub mod checkpoint;
pub mod dtype;
pub mod forward;
mod init;
pub mod ranks;
pub mod reference;
pub mod regions;
pub mod step;
pub mod weights;

pub use bench::{ComputeFigures, PrefillBatchFigure, bench_compute, bench_prefill};
pub use forward::{BatchCaches, PrefillCache, PrefillSeq, ShardGroup};
pub use reference::{Trace, run_colocated, run_colocated_forced_on, run_colocated_on};
pub use regions::RegionView;
pub use weights::{Dims, Model, RankShard};

/// Why the compute path refused.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("kernel: {0}")]
    Kernel(#[from] handoff_kernels::KernelError),
    #[error("model config: {0}")]
    Config(String),
    #[error("region: {0}")]
    Region(String),
}
