//! Release: the completion protocol, producer entries, timeouts, and freeing every
//! block, slot and entity a request held.

use crate::placement::free_blocks;
use bevy_ecs::prelude::*;
use handoff_components::ecs::*;
use handoff_components::vocab::RankId;
use std::time::Instant;

/// Applies write-done reports. A report counts once per (pp, tp, consumer) and only
/// with the request's current nonce; duplicates, late and wrong-nonce reports are
/// ignored and counted. A stage's producer entry is dropped as soon as its own
/// writes are all reported, whatever the other stages do.
#[allow(clippy::type_complexity)]
pub fn record_reports(
    mut commands: Commands,
    mut reports: MessageReader<WriteDone>,
    index: Res<RequestIndex>,
    requests: Query<(&Request, &Holdings)>,
    mut plans: Query<&mut PlanEntry>,
    mut entries: Query<&mut ProducerEntry>,
    mut progress: Query<(&BlockTable, &mut ConsumerProgress)>,
    mut stats: ResMut<ReportStats>,
) {
    for r in reports.read() {
        let Some((req, holdings)) = index.0.get(&r.request).and_then(|&e| requests.get(e).ok()) else {
            stats.unknown += 1;
            continue;
        };
        if req.nonce != r.nonce {
            stats.wrong_nonce += 1;
            continue;
        }
        let plan = holdings.plans.iter().find(|&&p| {
            plans.get(p).is_ok_and(|e| e.plan.producer == r.producer && e.plan.consumer == r.consumer)
        });
        let Some(mut entry) = plan.and_then(|&p| plans.get_mut(p).ok()) else {
            stats.unknown += 1;
            continue;
        };
        if entry.state == WriteState::Done {
            stats.duplicate += 1;
            continue;
        }
        entry.state = WriteState::Done;
        stats.accepted += 1;
        if let Some(&pe) = holdings.entries.get(r.producer.pp as usize)
            && let Ok(mut pe_entry) = entries.get_mut(pe)
        {
            pe_entry.pending = pe_entry.pending.saturating_sub(1);
            if pe_entry.pending == 0 {
                commands.entity(pe).try_despawn();
            }
        }
        for &l in &holdings.leases {
            if let Ok((table, mut prog)) = progress.get_mut(l)
                && table.rank == RankId::Decode(r.consumer)
            {
                let from = (r.producer.pp, r.producer.tp);
                if !prog.reported.contains(&from) {
                    prog.reported.push(from);
                }
            }
        }
    }
}

/// A request whose every decode rank has every expected report is handed off: its
/// source blocks and slots go back to the pools.
pub fn complete_handoffs(
    mut commands: Commands,
    mut requests: Query<(&Request, &mut Status, &mut Holdings)>,
    leases: Query<(&BlockTable, &Slot, Option<&ConsumerProgress>)>,
    mut pools: ResMut<Pools>,
    mut outcomes: MessageWriter<Outcome>,
) {
    for (req, mut status, mut holdings) in requests.iter_mut() {
        if *status != Status::Planned {
            continue;
        }
        let done = holdings.leases.iter().all(|&l| match leases.get(l) {
            Ok((_, _, Some(p))) => p.reported.len() as u32 >= p.expected,
            _ => true,
        });
        if !done {
            continue;
        }
        holdings.leases.retain(|&l| {
            let Ok((table, slot, _)) = leases.get(l) else { return false };
            if matches!(table.rank, RankId::Decode(_)) {
                return true;
            }
            release_lease(&mut pools, table, slot);
            commands.entity(l).despawn();
            false
        });
        *status = Status::HandedOff;
        outcomes.write(Outcome { request: req.id, result: Ok(()) });
    }
}

fn release_lease(pools: &mut Pools, table: &BlockTable, slot: &Slot) {
    if let Some(pool) = pools.0.get_mut(&table.rank) {
        free_blocks(pool, &table.blocks);
        pool.free_slots.push(slot.index);
    }
}

/// Fails every request whose current phase has run past its deadline.
pub fn expire_requests(mut requests: Query<(&mut Status, &Deadline)>, topo: Res<TopologyRes>) {
    let now = Instant::now();
    let t = &topo.0.config.timeouts;
    for (mut status, deadline) in requests.iter_mut() {
        let live = matches!(*status, Status::Waiting | Status::Placed | Status::Planned);
        if live && now >= deadline.at {
            let secs = match deadline.phase {
                PhaseName::Admission => t.admission_s,
                PhaseName::Compute => t.compute_s,
                _ => t.transfer_s,
            };
            *status = Status::Failed {
                phase: deadline.phase,
                reason: format!("{} phase timed out after {secs} s", deadline.phase.name()),
            };
        }
    }
}

/// Frees everything a finished or failed request held and despawns its entities.
/// A failed request waits while any of its writes is in flight, so an abort never
/// frees a source that a write may still be reading.
pub fn retire_requests(
    mut commands: Commands,
    requests: Query<(Entity, &Request, &Status, &Holdings)>,
    leases: Query<(&BlockTable, &Slot)>,
    plans: Query<&PlanEntry>,
    mut pools: ResMut<Pools>,
    mut index: ResMut<RequestIndex>,
    mut outcomes: MessageWriter<Outcome>,
) {
    for (e, req, status, holdings) in requests.iter() {
        match status {
            Status::Finished => {}
            Status::Failed { .. } => {
                if holdings.plans.iter().any(|&p| plans.get(p).is_ok_and(|p| p.state == WriteState::InFlight)) {
                    continue;
                }
            }
            _ => continue,
        }
        for &l in &holdings.leases {
            if let Ok((table, slot)) = leases.get(l) {
                release_lease(&mut pools, table, slot);
            }
            commands.entity(l).try_despawn();
        }
        for &p in holdings.plans.iter().chain(&holdings.entries) {
            commands.entity(p).try_despawn();
        }
        commands.entity(e).despawn();
        index.0.remove(&req.id);
        if let Status::Failed { phase, reason } = status {
            outcomes.write(Outcome { request: req.id, result: Err((*phase, reason.clone())) });
        }
    }
}
