//! Planner benchmarks: planning one flagship request, descriptors after coalescing
//! against one per token row, and the ECS tick with 88 requests in flight.
//! Every request is planned as for a mover that stages (the flagship's
//! `transport.staging_bytes`): rows whose blocks do not line up go out as staged
//! writes, one a staging buffer; `_unstaged` plans them as descriptors only.
//!
//! cargo bench --bench planner

use criterion::{Criterion, criterion_group, criterion_main};
use handoff::engine::{Engine, EngineRole, NoMover, QueueMover};
use handoff_components::Topology;
use handoff_components::layout::{ConsumerLayout, ProducerLayout};
use handoff_components::vocab::{DecodeRank, PrefillRank, RankId};
use handoff_systems::placement::{Capacity, blocks_for, owned_tokens, place_rank};
use handoff_systems::splitting::{ProducerPlanner, share};
use std::hint::black_box;

const FLAGSHIP: &str = "config/k3-pp8-tp8dcp8.toml";

/// Every producer and consumer layout of one request, blocks allocated contiguously
/// (`scattered`: consumer blocks reversed and producer blocks strided by two).
fn layouts(topo: &Topology, tokens: u64, scattered: bool) -> (Vec<ProducerLayout>, Vec<ConsumerLayout>) {
    let (p, d) = (topo.prefill(), topo.decode());
    let pblocks = blocks_for(tokens, p.block_size) as u32;
    let producers = (0..p.pp)
        .flat_map(|pp| (0..p.tp).map(move |tp| PrefillRank { pp, tp }))
        .map(|rank| {
            let blocks: Vec<u32> = if scattered { (0..pblocks).map(|b| 2 * b).collect() } else { (0..pblocks).collect() };
            ProducerLayout { rank, blocks, slot: 0, layout: place_rank(topo, RankId::Prefill(rank), 2 * pblocks, 1) }
        })
        .collect();
    let consumers = (0..d.tp)
        .map(|tp| {
            let rank = DecodeRank { tp };
            let n = blocks_for(owned_tokens(tokens, d.dcp, rank.dcp_rank(d.dcp), d.interleave), d.block_size) as u32;
            let mut blocks: Vec<u32> = (0..n).collect();
            if scattered {
                blocks.reverse();
            }
            ConsumerLayout { rank, tp: d.tp, dcp: d.dcp, interleave: d.interleave, blocks, slot: 0, layout: place_rank(topo, RankId::Decode(rank), n, 1) }
        })
        .collect();
    (producers, consumers)
}

/// What planning one request gave.
#[derive(Default)]
struct Planned {
    /// Writes through the transport: descriptors plus staged writes.
    writes: usize,
    descriptors: usize,
    staged_writes: usize,
    groups: usize,
    /// Contiguous pieces before coalescing.
    uncoalesced: u64,
}

/// Plans every pair of one request, staging with buffers of `staging` bytes.
fn plan_all(topo: &Topology, producers: &[ProducerLayout], consumers: &[ConsumerLayout], tokens: u64, staging: Option<u64>) -> Planned {
    let mut out = Planned::default();
    for p in producers {
        let planner = ProducerPlanner::new(p, tokens).staging(staging);
        for c in consumers {
            let sh = share(topo.prefill().tp, c.tp, p.rank.tp, c.rank.tp);
            if sh.rows || sh.state {
                let plan = planner.plan(c, sh).expect("plan");
                out.writes += plan.writes();
                out.descriptors += plan.descriptors.len();
                out.staged_writes += plan.writes() - plan.descriptors.len();
                out.groups += plan.staged.len();
                out.uncoalesced += plan.uncoalesced;
            }
        }
    }
    out
}

fn planning(c: &mut Criterion) {
    let topo = Topology::load(FLAGSHIP).expect("flagship config");
    let staging = Some(topo.config.transport.staging_bytes);
    let mut g = c.benchmark_group("plan_flagship_request");
    for (name, tokens) in [("8K", 8192u64), ("128K", 131072), ("1M", 1 << 20)] {
        for (scattered, staging, suffix) in [(false, staging, ""), (true, staging, "_scattered"), (true, None, "_scattered_unstaged")] {
            let (p, cs) = layouts(&topo, tokens, scattered);
            let n = plan_all(&topo, &p, &cs, tokens, staging);
            let label = format!("{name}{suffix}");
            eprintln!(
                "{label}: {} writes ({} descriptors + {} staged writes in {} groups), {} contiguous pieces before ({:.0}x fewer)",
                n.writes,
                n.descriptors,
                n.staged_writes,
                n.groups,
                n.uncoalesced,
                n.uncoalesced as f64 / n.writes as f64
            );
            g.bench_function(&label, |b| b.iter(|| black_box(plan_all(&topo, &p, &cs, black_box(tokens), staging).writes)));
        }
    }
    g.finish();
}

fn tick_in_flight(c: &mut Criterion) {
    let topo = Topology::load(FLAGSHIP).expect("flagship config");
    let cap = Capacity::for_requests(&topo, 88, 8192);
    let mut engine = Engine::new(topo, cap, Box::new(QueueMover::default()));
    for id in 0..88 {
        engine.submit(id, 8192);
    }
    engine.tick();
    // 88 requests planned and waiting for prefill compute: the steady state of a busy decode.
    c.bench_function("ecs_tick_88_in_flight", |b| b.iter(|| engine.tick()));
    eprintln!("entities with 88 requests in flight: {}", engine.entity_count());
    // The same 88 requests in decode's own World (what a decode process ticks):
    // placed and published, waiting for the stages' reports.
    let topo = Topology::load(FLAGSHIP).expect("flagship config");
    let mut engine = Engine::for_role(topo, EngineRole::Decode, cap, Box::new(NoMover));
    for id in 0..88 {
        engine.submit(id, 8192);
    }
    engine.tick();
    c.bench_function("ecs_tick_88_in_flight_decode_world", |b| b.iter(|| engine.tick()));
    eprintln!("decode World entities with 88 requests in flight: {}", engine.entity_count());
}

criterion_group!(benches, planning, tick_in_flight);
criterion_main!(benches);
