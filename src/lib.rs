//! handoff: prefill/decode disaggregated serving of hybrid MLA + KDA models.
//!
//! The root package holds the engine (a bevy_ecs World and its phase schedule), the
//! transports, the roles and the CLI. Plain data lives in `handoff-components`, the
//! phase systems in `handoff-systems`, the compute in `handoff-kernels`.
//!
//! The modules, from the top layer down; a module imports only from its own layer
//! or one below (`tools/import_map.py` checks it):
//!
//! - [`cli`]: the command line's subcommands and what they print;
//! - [`bench`](mod@bench)(mod@bench): the load generators and the transfer benches;
//! - [`check`]: the oracles, `verify` and `eval`;
//! - [`roles`]: the processes of a deployment (proxy, prefill, decode, `up`);
//! - [`engine`]: the World and its schedule, the mover, the compute over the model;
//! - [`transport`], [`model`]: bytes between regions, and the forward pass;
//! - [`base`]: the helpers every layer shares (a lock, a hash).

pub mod base;
pub mod bench;
pub mod check;
pub mod cli;
pub mod engine;
pub mod model;
pub mod roles;
pub mod transport;
