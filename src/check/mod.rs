//! Checking: the oracles that say what every byte of a hand-off must be, and the
//! drivers that run an engine against them.
//!
//! - [`oracle`]: the expected bytes of every region, computed from the rules alone;
//! - [`verify`]: `handoff verify`, every copy plan executed and checked byte by byte;
//! - [`compute_verify`]: `verify --compute`, the disaggregated forward pass against
//!   the colocated reference;
//! - [`eval`]: `handoff eval`, the checkpoint's next-token quality, both ways.

pub mod compute_verify;
pub mod error;
pub mod eval;
pub mod oracle;
pub mod verify;

pub use error::CheckError;
