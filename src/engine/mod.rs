//! The engine: a bevy_ecs World holding this process's ranks, regions and requests,
//! and the schedule that runs the phases in order once per tick.
//!
//! Every role process builds one: a prefill stage's World holds its TP ranks, decode's
//! holds the decode ranks, and `verify` builds one World of every rank. The role
//! talks to it only through commands in ([`Engine::submit`], [`Engine::report`],
//! [`Engine::cancel`], [`Engine::stage_down`], [`Engine::settle`]) and messages
//! out ([`Engine::take_outcomes`], [`Engine::take_events`]); the World itself
//! stays private. Decode's World also takes the stages' notices itself, from the
//! [`NoticeSource`] the role gives it ([`Engine::set_notices`]).

use bevy_ecs::message::{MessageRegistry, Messages, message_update_system};
use bevy_ecs::prelude::*;
use bevy_ecs::schedule::SingleThreadedExecutor;
use handoff_components::Topology;
use handoff_components::ecs::*;
use handoff_components::layout::ConsumerLayout;
use handoff_components::plan::Plan;
use handoff_components::sampling::Sampling;
use handoff_systems::dispatch::{Compute, Dispatcher};
use handoff_systems::placement::{Capacity, spawn_ranks};
use handoff_systems::transfer::{MoveError, Mover, NoticeSource, Notices, PlanCompletion, Ticket, Transfers};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Which ranks an engine holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineRole {
    /// One PP stage's TP ranks.
    Stage(u32),
    /// The decode TP x DCP ranks.
    Decode,
    /// Every rank in one World (`verify`, tests).
    All,
}

impl EngineRole {
    pub fn local(self, topo: &Topology) -> LocalRanks {
        match self {
            EngineRole::Stage(s) => LocalRanks { stages: vec![s], decode: false },
            EngineRole::Decode => LocalRanks { stages: Vec::new(), decode: true },
            EngineRole::All => LocalRanks { stages: (0..topo.prefill().pp).collect(), decode: true },
        }
    }
}

/// What a World holds now: the counts `/metrics` reports, which return to their
/// baseline once every request has left (`settled` once its entries are older
/// than `Settled::keep`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Counts {
    pub entities: u32,
    pub requests: u32,
    /// Live producer entries, per local stage (stage order).
    pub producer_entries: Vec<(u32, u32)>,
    pub plans: u32,
    pub free_blocks: u64,
    pub free_slots: u64,
    /// Requests that sample their tokens (a [`Sampling`] on the request entity).
    #[serde(default)]
    pub sampling: u32,
    /// Prefill only: requests settled before their job came ([`Settled`]),
    /// remembered so a late job is dropped (each forgotten `Settled::keep` after
    /// it was settled).
    #[serde(default)]
    pub settled: u32,
}

pub mod compute;
pub mod device;
pub mod mover;
pub mod profile;

/// One World and its schedule.
pub struct Engine {
    world: World,
    schedule: Schedule,
    role: EngineRole,
}

impl Engine {
    /// An engine of every rank (the `verify` shape).
    pub fn new(topo: Topology, cap: Capacity, mover: Box<dyn Mover>) -> Engine {
        Engine::for_role(topo, EngineRole::All, cap, mover)
    }

    /// An engine holding only `role`'s ranks.
    pub fn for_role(topo: Topology, role: EngineRole, cap: Capacity, mover: Box<dyn Mover>) -> Engine {
        let mut world = World::new();
        MessageRegistry::register_message::<Submit>(&mut world);
        MessageRegistry::register_message::<WriteDone>(&mut world);
        MessageRegistry::register_message::<StageReport>(&mut world);
        MessageRegistry::register_message::<Cancel>(&mut world);
        MessageRegistry::register_message::<StageDown>(&mut world);
        MessageRegistry::register_message::<Settle>(&mut world);
        MessageRegistry::register_message::<Outcome>(&mut world);
        MessageRegistry::register_message::<EngineEvent>(&mut world);
        world.init_resource::<RequestIndex>();
        world.init_resource::<ReportStats>();
        world.init_resource::<Settled>();
        spawn_ranks(&mut world, &topo, cap, &role.local(&topo));
        world.insert_resource(TopologyRes(topo));
        world.insert_resource(Transfers(mover));
        let mut schedule = Schedule::default();
        // The phases are chained: the multi-threaded executor would only add task
        // hand-offs to a tick of small systems.
        schedule.set_executor(SingleThreadedExecutor::new());
        handoff_systems::add_phases(&mut schedule);
        schedule.add_systems(message_update_system.after(handoff_systems::Phase::Dispatch));
        Engine { world, schedule, role }
    }

    /// Gives the dispatch phase its compute.
    pub fn set_compute(&mut self, compute: Box<dyn Compute>) {
        self.world.insert_resource(Dispatcher(compute));
    }

    /// Where the stages of other processes' notices come from (decode): the
    /// transfer phase polls it every tick, as a stage's World polls its mover.
    pub fn set_notices(&mut self, notices: Box<dyn NoticeSource>) {
        self.world.insert_resource(Notices(notices));
    }

    /// How long a settled request is remembered (`Settled::KEEP` by default).
    pub fn set_settle_keep(&mut self, keep: Duration) {
        self.world.resource_mut::<Settled>().keep = keep;
    }

    pub fn role(&self) -> EngineRole {
        self.role
    }

    pub fn topology(&self) -> &Topology {
        &self.world.resource::<TopologyRes>().0
    }

    /// A request of `tokens` prompt tokens with nothing else (the byte-level checks).
    pub fn submit(&mut self, id: u64, tokens: u64) {
        self.submit_request(Submit { id, tokens, ..Default::default() });
    }

    /// A request as the role received it.
    pub fn submit_request(&mut self, s: Submit) {
        self.world.write_message(s);
    }

    /// A stage's report as decode received it.
    pub fn report(&mut self, r: StageReport) {
        self.world.write_message(r);
    }

    /// Fails a live request (a peer failed it, or its client went away).
    pub fn cancel(&mut self, c: Cancel) {
        self.world.write_message(c);
    }

    /// Decode: a PP stage died or stopped answering (the release phase fails
    /// what waits for it).
    pub fn stage_down(&mut self, d: StageDown) {
        self.world.write_message(d);
    }

    /// A prefill stage: settle requests an earlier stage's death left to it.
    pub fn settle(&mut self, s: Settle) {
        self.world.write_message(s);
    }

    /// Runs every phase once.
    pub fn tick(&mut self) {
        self.schedule.run(&mut self.world);
        // Without a bevy App nothing else clears the removed-component records that
        // every despawn leaves; uncleared, they grow with every request served.
        self.world.clear_trackers();
    }

    /// Outcomes since the last call (handed off, rejected, failed).
    pub fn take_outcomes(&mut self) -> Vec<Outcome> {
        self.world.resource_mut::<Messages<Outcome>>().drain().collect()
    }

    /// Events for the role to carry out since the last call.
    pub fn take_events(&mut self) -> Vec<EngineEvent> {
        self.world.resource_mut::<Messages<EngineEvent>>().drain().collect()
    }

    /// Requests this World holds.
    pub fn live_requests(&self) -> u32 {
        self.world.resource::<RequestIndex>().0.len() as u32
    }

    /// Whether any held request is decoding (the role keeps ticking without waiting).
    pub fn decoding(&mut self) -> bool {
        let mut q = self.world.query::<(&Status, &DecodeProgress)>();
        q.iter(&self.world).any(|(s, g)| *s == Status::HandedOff && g.last.is_some())
    }

    /// Writes of computed stages not yet reported done: in flight, or about to
    /// be submitted (their stage has computed and the request is planned).
    pub fn writes_outstanding(&mut self) -> u32 {
        let mut q = self.world.query::<&PlanEntry>();
        let plans: Vec<(Entity, u32, WriteState)> = q.iter(&self.world).map(|p| (p.request, p.plan.producer.pp, p.state)).collect();
        plans
            .into_iter()
            .filter(|&(r, pp, state)| match state {
                WriteState::InFlight => true,
                WriteState::Pending => {
                    self.world.get::<Status>(r) == Some(&Status::Planned)
                        && self.world.get::<StagesComputed>(r).is_some_and(|c| c.0.get(pp as usize).copied().unwrap_or(false))
                }
                WriteState::Done => false,
            })
            .count() as u32
    }

    pub fn entity_of(&self, id: u64) -> Option<Entity> {
        self.world.resource::<RequestIndex>().0.get(&id).copied()
    }

    pub fn status(&self, id: u64) -> Option<Status> {
        self.entity_of(id).and_then(|e| self.world.get::<Status>(e).cloned())
    }

    pub fn nonce(&self, id: u64) -> Option<u64> {
        self.entity_of(id).and_then(|e| self.world.get::<Request>(e)).map(|r| r.nonce)
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

    /// The byte-level checks' decode is done with a request: release it next tick.
    pub fn finish(&mut self, id: u64) {
        if let Some(e) = self.entity_of(id)
            && let Some(mut s) = self.world.get_mut::<Status>(e)
            && !matches!(*s, Status::Failed { .. })
        {
            *s = Status::Finished;
        }
    }

    /// Where a request lives on each local rank.
    pub fn leases(&self, id: u64) -> Vec<Lease> {
        let Some(h) = self.entity_of(id).and_then(|e| self.world.get::<Holdings>(e)) else { return vec![] };
        h.leases.iter().filter_map(|&l| self.world.get::<Lease>(l).cloned()).collect()
    }

    /// The layouts the local decode ranks published for a request, in rank order.
    pub fn published(&self, id: u64) -> Vec<ConsumerLayout> {
        let Some(h) = self.entity_of(id).and_then(|e| self.world.get::<Holdings>(e)) else { return vec![] };
        let mut v: Vec<ConsumerLayout> = h.leases.iter().filter_map(|&l| self.world.get::<Published>(l).map(|p| p.0.clone())).collect();
        v.sort_by_key(|c| c.rank.tp);
        v
    }

    pub fn plans(&self, id: u64) -> Vec<Plan> {
        let Some(h) = self.entity_of(id).and_then(|e| self.world.get::<Holdings>(e)) else { return vec![] };
        h.plans.iter().filter_map(|&p| self.world.get::<PlanEntry>(p).map(|e| e.plan.clone())).collect()
    }

    /// Every local region, as registered at startup.
    pub fn regions(&mut self) -> Vec<Region> {
        let mut q = self.world.query::<&Region>();
        q.iter(&self.world).cloned().collect()
    }

    /// The local ranks' free blocks and slots.
    pub fn pools(&self) -> &Pools {
        self.world.resource::<Pools>()
    }

    pub fn entity_count(&self) -> u32 {
        self.world.entities().count_spawned()
    }

    /// Live producer entries per PP stage of the topology (0 for stages held elsewhere).
    pub fn producer_entries(&mut self) -> Vec<u32> {
        let pp = self.topology().prefill().pp as usize;
        let mut v = vec![0; pp];
        let mut q = self.world.query::<&ProducerEntry>();
        for e in q.iter(&self.world) {
            v[e.stage as usize] += 1;
        }
        v
    }

    /// What the World holds now.
    pub fn counts(&mut self) -> Counts {
        let entries = self.producer_entries();
        let local = self.world.resource::<LocalRanks>().clone();
        let plans = self.world.query::<&PlanEntry>().iter(&self.world).count() as u32;
        let sampling = self.world.query::<&Sampling>().iter(&self.world).count() as u32;
        let settled = self.world.resource::<Settled>().requests.len() as u32;
        let pools = self.pools();
        Counts {
            entities: self.entity_count(),
            requests: self.live_requests(),
            producer_entries: local.stages.iter().map(|&s| (s, entries[s as usize])).collect(),
            plans,
            free_blocks: pools.0.values().map(|p| p.free_block_count()).sum(),
            free_slots: pools.0.values().map(|p| p.free_slots.len() as u64).sum(),
            sampling,
            settled,
        }
    }

    pub fn report_stats(&self) -> ReportStats {
        self.world.resource::<ReportStats>().clone()
    }

    /// Delivers a report as if it came from a peer (tests of the protocol).
    pub fn deliver_report(&mut self, r: WriteDone) {
        self.world.write_message(r);
    }

    /// Edits the first plan of a request before it is submitted (negative tests of
    /// the transfer phase: a descriptor a transport must refuse).
    #[doc(hidden)]
    pub fn edit_first_plan(&mut self, id: u64, f: impl FnOnce(&mut Plan)) {
        let Some(h) = self.entity_of(id).and_then(|e| self.world.get::<Holdings>(e)).cloned() else { return };
        if let Some(mut e) = h.plans.first().and_then(|&p| self.world.get_mut::<PlanEntry>(p)) {
            f(&mut e.plan);
        }
    }

    /// Edits every plan of a request before it is submitted, in the order of
    /// [`Engine::plans`]; plans past those `f` leaves are kept as they were
    /// (`verify --transport`'s negative tests: what the mover must run or refuse).
    #[doc(hidden)]
    pub fn edit_plans(&mut self, id: u64, f: impl FnOnce(&mut Vec<Plan>)) {
        let Some(h) = self.entity_of(id).and_then(|e| self.world.get::<Holdings>(e)).cloned() else { return };
        let mut plans = self.plans(id);
        f(&mut plans);
        let entities: Vec<Entity> = h.plans.iter().copied().filter(|&p| self.world.get::<PlanEntry>(p).is_some()).collect();
        for (entity, plan) in entities.into_iter().zip(plans) {
            if let Some(mut e) = self.world.get_mut::<PlanEntry>(entity) {
                e.plan = plan;
            }
        }
    }
}

/// A mover that queues submitted plans for the caller to execute, then completes
/// them when told. `verify` uses it to run the oracle's counting copy, planned as
/// for a staging mover ([`QueueMover::staging`]); the compute checks, whose device
/// copies run descriptors only, keep the default (no staged groups).
#[derive(Clone, Default)]
pub struct QueueMover {
    pub inner: Arc<Mutex<QueueState>>,
    /// What [`Mover::staging_bytes`] says: the caller runs staged groups too.
    pub staging: Option<u64>,
}

#[derive(Default)]
pub struct QueueState {
    pub submitted: Vec<(Ticket, Plan)>,
    pub completed: Vec<PlanCompletion>,
}

use crate::base::lock;

impl Mover for QueueMover {
    fn submit(&mut self, ticket: Ticket, plan: &Plan) -> Result<(), MoveError> {
        lock(&self.inner).submitted.push((ticket, plan.clone()));
        Ok(())
    }
    fn poll(&mut self, out: &mut Vec<PlanCompletion>) {
        out.append(&mut lock(&self.inner).completed);
    }
    fn staging_bytes(&self) -> Option<u64> {
        self.staging
    }
}

impl QueueMover {
    /// A queue whose caller runs staged groups cut for buffers of `bytes`.
    pub fn staging(bytes: Option<u64>) -> Self {
        QueueMover { staging: bytes, ..QueueMover::default() }
    }
    pub fn take_submitted(&self) -> Vec<(Ticket, Plan)> {
        std::mem::take(&mut lock(&self.inner).submitted)
    }
    pub fn complete(&self, ticket: Ticket, result: Result<(), MoveError>) {
        lock(&self.inner).completed.push(PlanCompletion { ticket, result });
    }
}

/// A mover for a World without local producers (decode): nothing is ever submitted.
pub struct NoMover;

impl Mover for NoMover {
    fn submit(&mut self, ticket: Ticket, _plan: &Plan) -> Result<(), MoveError> {
        Err(MoveError::UnknownRegion {
            kind: handoff_components::vocab::RegionKind::MlaKv,
            rank: handoff_components::vocab::RankId::Prefill(ticket.producer),
            side: "source",
        })
    }
    fn poll(&mut self, _out: &mut Vec<PlanCompletion>) {}
}
