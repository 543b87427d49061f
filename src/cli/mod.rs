//! The command line's library side: the role subcommands ([`roles`]) that
//! `main.rs` flattens into its own, and the `plan` and `summary` output ([`plan`]).
//! This is the top layer: it may call anything below it, and nothing calls it.

pub mod plan;
pub mod roles;

pub use plan::{PlanRun, plan_json, plan_request, plan_table, rule_bytes, summary};
pub use roles::RoleCommand;
