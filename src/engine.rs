//! The engine: a bevy_ecs World holding ranks, regions and requests, and the schedule
//! that runs the phases in order once per tick.

use bevy_ecs::message::{MessageRegistry, Messages, message_update_system};
use bevy_ecs::prelude::*;
use handoff_components::ecs::*;
use handoff_components::plan::Plan;
use handoff_components::vocab::RankId;
use handoff_components::Topology;
use handoff_systems::placement::{Capacity, spawn_ranks};
use handoff_systems::transfer::{Completion, Mover, Ticket, Transfers};
use std::sync::{Arc, Mutex};

/// One World and its schedule.
pub struct Engine {
    pub world: World,
    schedule: Schedule,
}

impl Engine {
    pub fn new(topo: Topology, cap: Capacity, mover: Box<dyn Mover>) -> Engine {
        let mut world = World::new();
        MessageRegistry::register_message::<Submit>(&mut world);
        MessageRegistry::register_message::<WriteDone>(&mut world);
        MessageRegistry::register_message::<Outcome>(&mut world);
        world.init_resource::<RequestIndex>();
        world.init_resource::<ReportStats>();
        spawn_ranks(&mut world, &topo, cap);
        world.insert_resource(TopologyRes(topo));
        world.insert_resource(Transfers(mover));
        let mut schedule = Schedule::default();
        handoff_systems::add_phases(&mut schedule);
        schedule.add_systems(message_update_system.after(handoff_systems::Phase::Dispatch));
        Engine { world, schedule }
    }

    pub fn topology(&self) -> &Topology {
        &self.world.resource::<TopologyRes>().0
    }

    pub fn submit(&mut self, id: u64, tokens: u64) {
        self.world.write_message(Submit { id, tokens });
    }

    /// Runs every phase once.
    pub fn tick(&mut self) {
        self.schedule.run(&mut self.world);
    }

    /// Outcomes since the last call (handed off, rejected, failed).
    pub fn take_outcomes(&mut self) -> Vec<Outcome> {
        self.world.resource_mut::<Messages<Outcome>>().drain().collect()
    }

    pub fn entity_of(&self, id: u64) -> Option<Entity> {
        self.world.resource::<RequestIndex>().0.get(&id).copied()
    }

    pub fn status(&self, id: u64) -> Option<Status> {
        self.entity_of(id).and_then(|e| self.world.get::<Status>(e).cloned())
    }

    /// Marks a PP stage of a request computed: its plans may now be submitted.
    pub fn mark_computed(&mut self, id: u64, stage: u32) {
        if let Some(e) = self.entity_of(id)
            && let Some(mut c) = self.world.get_mut::<StagesComputed>(e)
            && let Some(s) = c.0.get_mut(stage as usize)
        {
            *s = true;
        }
    }

    /// Decode is done with a request: release everything it holds on the next tick.
    pub fn finish(&mut self, id: u64) {
        if let Some(e) = self.entity_of(id)
            && let Some(mut s) = self.world.get_mut::<Status>(e)
            && !matches!(*s, Status::Failed { .. })
        {
            *s = Status::Finished;
        }
    }

    /// Where a request lives on each rank: (rank, blocks, slot).
    pub fn leases(&self, id: u64) -> Vec<(RankId, Vec<u32>, u32)> {
        let Some(h) = self.entity_of(id).and_then(|e| self.world.get::<Holdings>(e)) else { return vec![] };
        h.leases
            .iter()
            .filter_map(|&l| {
                let t = self.world.get::<BlockTable>(l)?;
                let s = self.world.get::<Slot>(l)?;
                Some((t.rank, t.blocks.clone(), s.index))
            })
            .collect()
    }

    pub fn plans(&self, id: u64) -> Vec<Plan> {
        let Some(h) = self.entity_of(id).and_then(|e| self.world.get::<Holdings>(e)) else { return vec![] };
        h.plans.iter().filter_map(|&p| self.world.get::<PlanEntry>(p).map(|e| e.plan.clone())).collect()
    }

    pub fn entity_count(&self) -> u32 {
        self.world.entities().count_spawned()
    }

    /// Live producer entries per PP stage.
    pub fn producer_entries(&mut self) -> Vec<u32> {
        let pp = self.topology().prefill().pp as usize;
        let mut v = vec![0; pp];
        let mut q = self.world.query::<&ProducerEntry>();
        for e in q.iter(&self.world) {
            v[e.stage as usize] += 1;
        }
        v
    }

    pub fn report_stats(&self) -> ReportStats {
        self.world.resource::<ReportStats>().clone()
    }

    /// Delivers a report as if it came from a peer (tests of the protocol).
    pub fn deliver_report(&mut self, r: WriteDone) {
        self.world.write_message(r);
    }
}

/// A mover that queues submitted plans for the caller to execute, then completes
/// them when told. `verify` uses it to run the oracle's counting copy.
#[derive(Clone, Default)]
pub struct QueueMover {
    pub inner: Arc<Mutex<QueueState>>,
}

#[derive(Default)]
pub struct QueueState {
    pub submitted: Vec<(Ticket, Plan)>,
    pub completed: Vec<Completion>,
}

impl Mover for QueueMover {
    fn submit(&mut self, ticket: Ticket, plan: &Plan) -> Result<(), String> {
        self.inner.lock().map_err(|e| e.to_string())?.submitted.push((ticket, plan.clone()));
        Ok(())
    }
    fn poll(&mut self, out: &mut Vec<Completion>) {
        if let Ok(mut s) = self.inner.lock() {
            out.append(&mut s.completed);
        }
    }
}

impl QueueMover {
    pub fn take_submitted(&self) -> Vec<(Ticket, Plan)> {
        std::mem::take(&mut self.inner.lock().expect("queue lock").submitted)
    }
    pub fn complete(&self, ticket: Ticket, result: Result<(), String>) {
        self.inner.lock().expect("queue lock").completed.push(Completion { ticket, result });
    }
}
