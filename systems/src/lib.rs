//! The phases of handoff. Each phase module holds its pure rules (functions over
//! layouts, testable without a World) and the bevy systems that apply them.

pub mod coalesce;
pub mod placement;
pub mod splitting;
