//! The compute path: a small hybrid MLA + KDA model (design.md section 5) that the
//! PP prefill stages and the TP x DCP decode ranks actually run, and the colocated
//! single-rank reference it must agree with.
//!
//! - [`weights`]: dimensions from the topology's `[model]` table, seeded weights
//!   (SplitMix64 streams, N(0, 1/sqrt(fan_in))), TP shards.
//! - [`forward`]: the layers, written once over a TP group of shards; caches are the
//!   caller's (a prefill sink, a [`forward::DecodeCaches`]).
//! - [`reference`]: the colocated run with plain caches.
//! - [`ranks`]: prefill ranks writing producer regions, decode ranks running from
//!   their decode regions (byte layout of docs/layout.md).
//! - [`bench`]: throughput figures of the small model and of the decode kernels.
//!
//! The backend is the kernels' `CpuBackend`, called through the `Backend` trait.

pub mod bench;
pub mod dtype;
pub mod forward;
pub mod ranks;
pub mod reference;
pub mod weights;

pub use bench::{ComputeFigures, bench_compute};
pub use reference::{Trace, run_colocated};
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
