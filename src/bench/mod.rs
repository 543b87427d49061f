//! Benchmarks that are commands (`handoff bench ...`); the criterion benches are
//! in `benches/`. They report and never assert a time.
//!
//! - [`transfer`]: `bench transfer`, the hand-off bytes through one transport;
//! - [`ipc`]: `bench transfer --transport cuda-ipc`, across two processes of one GPU;
//! - [`serve`]: `bench serve`, a whole deployment under load per concurrency level;
//! - [`soak`]: `bench soak`, a long load with faults, checking that nothing leaks.

pub mod ipc;
pub mod serve;
pub mod soak;
pub mod transfer;

pub use serve::bench_serve;
pub use soak::{SoakOptions, bench_soak};
