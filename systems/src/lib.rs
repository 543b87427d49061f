//! The phases of handoff. Each phase module holds its pure rules (functions over
//! layouts, testable without a World) and the bevy systems that apply them.
//!
//! Order of one tick: admission -> placement -> splitting -> transfer -> release ->
//! dispatch (the compute, when the engine has a `dispatch::Dispatcher`). `coalesce`
//! (merging adjacent copies) and `share` (who sends what to whom) are rules the
//! phases share; placement comes before splitting in the imports too.

pub mod admission;
pub mod coalesce;
pub mod dispatch;
pub mod placement;
pub mod release;
pub mod share;
pub mod splitting;
pub mod transfer;

use bevy_ecs::prelude::*;

/// The error of a layer below the systems (the model, its kernels, a transport),
/// kept whole: the systems know it only as an error, and a failure's text is
/// built from it where the request fails.
pub type ErrorSource = std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>;

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
        (transfer::advance_deadlines, transfer::submit_plans, transfer::poll_transfers).chain().in_set(Phase::Transfer),
        (
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
