//! handoff: prefill/decode disaggregated serving of hybrid MLA + KDA models.
//!
//! The root package holds the engine (a bevy_ecs World and its phase schedule), the
//! transports, the roles and the CLI. Plain data lives in `handoff-components`, the
//! phase systems in `handoff-systems`, the compute in `handoff-kernels`.

pub mod auth;
pub mod bench_cli;
pub mod bench_ipc;
pub mod cli;
pub mod compute;
pub mod compute_verify;
pub mod device;
pub mod engine;
pub mod eval;
pub mod fuzz;
pub mod model;
pub mod oracle;
pub mod profile;
pub mod roles;
pub mod transport;
pub mod verify;
