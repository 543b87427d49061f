//! Benchmarks that are commands (`handoff bench ...`); the criterion benches are
//! in `benches/`. They report and never assert a time.
//!
//! - [`transfer`]: `bench transfer`, the hand-off bytes through one transport;
//! - [`ipc`]: `bench transfer --transport cuda-ipc`, across two processes of one GPU;
//! - [`serve`]: `bench serve`, a whole deployment under load per concurrency level;
//! - [`soak`]: `bench soak`, a long load with faults, checking that nothing leaks;
//! - [`simulate`]: `handoff simulate`, a model of the hand-off's links at cluster
//!   scale from the engine's real plans (a model: it measures nothing);
//! - [`plot`]: the `--plot FILE.svg` pictures of `bench serve` and `bench compute`,
//!   drawn from plain structs the benches fill ([`compute`] fills the latter).

pub mod compute;
pub mod ipc;
pub mod plot;
pub mod serve;
pub mod simulate;
pub mod soak;
pub mod transfer;
pub mod ucx;

pub use serve::bench_serve;
pub use soak::{SoakOptions, bench_soak};
