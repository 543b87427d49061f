//! The phases of handoff. Each phase module holds its pure rules (functions over
//! layouts, testable without a World) and the bevy systems that apply them.
//!
//! Order of one tick: admission -> placement -> splitting -> transfer -> release ->
//! dispatch (the compute, when the engine has a `dispatch::Dispatcher`). `coalesce`
//! (merging adjacent copies), `share` (who sends what to whom) and `sampling`
//! (the pick of a sampled token) are rules the phases share; placement comes before splitting in the imports too. `error` holds
//! `ErrorSource`, the error of the layers below that the phases share (re-exported
//! here); this root only declares, re-exports and wires the phases into a schedule,
//! so no phase imports from it.

pub mod admission;
pub mod coalesce;
pub mod dispatch;
pub mod error;
pub mod placement;
pub mod release;
pub mod sampling;
pub mod share;
pub mod splitting;
pub mod transfer;

pub use error::ErrorSource;

use bevy_ecs::prelude::*;

/// The phases, as system sets chained in this order.
#[derive(SystemSet, Debug, Clone, PartialEq, Eq, Hash)]
pub enum Phase {
    Admission,
    Placement,
    Splitting,
    Transfer,
    Release,
    Dispatch,
}

/// Adds every phase's systems to a schedule, chained.
pub fn add_phases(schedule: &mut Schedule) {
    schedule.configure_sets((Phase::Admission, Phase::Placement, Phase::Splitting, Phase::Transfer, Phase::Release, Phase::Dispatch).chain());
    schedule.add_systems((
        admission::admit_requests.in_set(Phase::Admission),
        placement::place_requests.in_set(Phase::Placement),
        splitting::split_requests.in_set(Phase::Splitting),
        (transfer::advance_deadlines, transfer::submit_plans, transfer::poll_transfers, transfer::poll_notices).chain().in_set(Phase::Transfer),
        (
            release::fail_stage_down,
            release::settle_requests,
            release::receive_reports,
            release::apply_cancels,
            release::record_reports,
            release::complete_handoffs,
            release::expire_requests,
            release::retire_requests,
        )
            .chain()
            .in_set(Phase::Release),
        (dispatch::run_prefill, dispatch::grow_leases, dispatch::run_decode).chain().in_set(Phase::Dispatch),
    ));
}
