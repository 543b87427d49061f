//! 100,000 requests through the engine and the local transport: after the soak,
//! nothing is left behind (entities, producer entries, pools, the mover's tickets),
//! and sampled waves are byte-exact against the oracle.

use handoff::check::oracle::{self, OracleRequest, Placement};
use handoff::engine::Engine;
use handoff::engine::mover::{LocalCluster, local_cluster};
use handoff::transport::TransportExt;
use handoff_components::Topology;
use handoff_components::config::{Config, TransportKind};
use handoff_components::ecs::{Lease, Status};
use handoff_components::vocab::{DecodeRank, RankId};
use handoff_systems::placement::Capacity;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const REQUESTS: u64 = 100_000;
const WAVE: u64 = 64;
/// Every this many waves, the whole wave is filled with the pattern and checked.
const SAMPLE_EVERY: u64 = 97;
const MAX_TOKENS: u64 = 40;
const WAIT: Duration = Duration::from_secs(30);

fn topology() -> Topology {
    // PP2 x TP1 -> TP2 x DCP2, tiny hybrid model with replay records.
    let mut cfg = Config::load(concat!(env!("CARGO_MANIFEST_DIR"), "/config/small.toml")).expect("config");
    cfg.timeouts.transfer_s = 30.0;
    cfg.validate().expect("topology")
}

/// Tokens of request `id`: 1..=MAX_TOKENS, so partial blocks and DCP remainders vary.
fn tokens_of(id: u64) -> u64 {
    1 + (id.wrapping_mul(0x9E37_79B9) >> 7) % MAX_TOKENS
}

fn pools_full(engine: &Engine) -> Result<(), String> {
    for (rank, pool) in &engine.pools().0 {
        let blocks = pool.free_block_count();
        if blocks != pool.blocks as u64 || pool.free_slots.len() != pool.slots as usize || pool.free_blocks.len() > 1 {
            return Err(format!(
                "{rank}: {blocks}/{} blocks free in {} ranges, {}/{} slots",
                pool.blocks,
                pool.free_blocks.len(),
                pool.free_slots.len(),
                pool.slots
            ));
        }
    }
    Ok(())
}

/// Ticks until every request of the wave has an outcome; panics on a failure.
/// Outcomes are taken after every tick: a message lives for two ticks only.
fn run_until_outcomes(engine: &mut Engine, cluster: &LocalCluster, ids: &[u64]) {
    let deadline = Instant::now() + WAIT;
    let mut left: std::collections::HashSet<u64> = ids.iter().copied().collect();
    while !left.is_empty() {
        assert!(cluster.mover.wait_idle(WAIT), "mover still busy after {WAIT:?}");
        engine.tick();
        for o in engine.take_outcomes() {
            if let Err(failure) = &o.result {
                panic!("request {} failed in {}: {failure}", o.request, failure.phase.name());
            }
            left.remove(&o.request);
        }
        assert!(Instant::now() < deadline, "requests {left:?} never handed off: {:?}", engine.status(*left.iter().next().unwrap()));
    }
}

#[test]
fn soak_100k_requests_local_transport_leaves_nothing_behind_and_samples_are_byte_exact() {
    let topo = topology();
    let cap = Capacity::for_requests(&topo, WAVE as u32, MAX_TOKENS);
    let (mut engine, transport, cluster) = local_cluster(&topo, cap, TransportKind::Local).expect("cluster");
    engine.tick();
    let baseline = engine.entity_count();
    pools_full(&engine).expect("pools full at start");
    let units: BTreeMap<_, _> = { engine.regions().iter().map(|r| ((r.rank, r.layout.kind), r.layout.units)).collect() };
    let started = Instant::now();
    let (mut sampled, mut pattern_bytes) = (0u64, 0u64);
    let mut next_id = 1u64;
    let waves = REQUESTS / WAVE + u64::from(!REQUESTS.is_multiple_of(WAVE));
    for wave in 0..waves {
        let n = WAVE.min(REQUESTS - wave * WAVE);
        let ids: Vec<u64> = (next_id..next_id + n).collect();
        next_id += n;
        let sample = wave % SAMPLE_EVERY == 0 || wave + 1 == waves;
        if sample {
            // Nothing is in flight: reset every consumer region to its canary so that
            // bytes outside this wave's requests can be checked too.
            for ((rank, kind), h) in &cluster.regions {
                if matches!(rank, RankId::Decode(_)) {
                    transport.write_region(h, |b| oracle::fill_canary(*rank, *kind, b)).expect("canary");
                }
            }
        }
        for &id in &ids {
            engine.submit(id, tokens_of(id));
        }
        engine.tick();
        assert!(engine.take_outcomes().is_empty(), "no request is rejected or fails at admission");
        let mut leases = BTreeMap::new();
        for &id in &ids {
            assert_eq!(engine.status(id), Some(Status::Planned), "request {id} not planned after one tick");
            if sample {
                let req = OracleRequest { id, tokens: tokens_of(id) };
                for Lease { rank, blocks, slot } in engine.leases(id) {
                    if let RankId::Prefill(p) = rank {
                        for kind in topo.region_kinds() {
                            let h = &cluster.regions[&(rank, kind)];
                            let at = Placement { blocks: &blocks, slot };
                            transport.write_region(h, |b| oracle::fill_producer(&topo, p, kind, units[&(rank, kind)], &req, &at, b)).expect("fill producer");
                        }
                    }
                    leases.insert((id, rank), (blocks, slot));
                }
            }
            for s in 0..topo.prefill().pp {
                engine.mark_computed(id, s);
            }
        }
        run_until_outcomes(&mut engine, &cluster, &ids);
        if sample {
            for tp in 0..topo.decode().tp {
                let rank = DecodeRank { tp };
                let rid = RankId::Decode(rank);
                for kind in topo.region_kinds() {
                    let reqs: Vec<(OracleRequest, Placement)> = ids
                        .iter()
                        .map(|&id| {
                            let (b, s) = &leases[&(id, rid)];
                            (OracleRequest { id, tokens: tokens_of(id) }, Placement { blocks: b, slot: *s })
                        })
                        .collect();
                    let stats = transport
                        .read_region(&cluster.regions[&(rid, kind)], |b| oracle::check_consumer(&topo, rank, kind, units[&(rid, kind)], &reqs, b))
                        .expect("read consumer")
                        .unwrap_or_else(|e| panic!("wave {wave}: {e}"));
                    pattern_bytes += stats.pattern_bytes;
                }
            }
            sampled += n;
        }
        for &id in &ids {
            engine.finish(id);
        }
        engine.tick();
        assert!(engine.take_outcomes().is_empty(), "finished requests report nothing more");
    }
    engine.tick();
    let elapsed = started.elapsed();
    eprintln!(
        "soak: {REQUESTS} requests in {:.1} s, {sampled} checked byte-exact ({pattern_bytes} pattern bytes), report stats {:?}",
        elapsed.as_secs_f64(),
        engine.report_stats()
    );
    assert_eq!(engine.entity_count(), baseline, "entities left behind");
    assert!(engine.producer_entries().iter().all(|&n| n == 0), "producer entries left: {:?}", engine.producer_entries());
    pools_full(&engine).expect("pools full after the soak");
    assert_eq!(cluster.mover.in_flight(), 0, "mover tickets in flight");
    assert_eq!(cluster.mover.unpolled(), 0, "mover completions never polled");
    let stats = engine.report_stats();
    assert_eq!(stats.accepted, REQUESTS * 4, "one report per (producer, consumer) pair: PP2 x TP1 -> TP2");
    assert_eq!(stats.duplicate + stats.wrong_nonce + stats.unknown, 0);
    assert!(sampled >= 1000, "sampled {sampled}");
    let _ = transport.name();
}

/// A write the transport refuses (a descriptor past the end of the consumer region)
/// comes back as one `Err` completion for its plan: the engine fails the request
/// naming the transfer phase, frees everything once no write is in flight, and the
/// next request over the same mover is handed off.
#[test]
fn refused_write_fails_request_in_transfer_phase_and_frees_everything() {
    let topo = topology();
    let cap = Capacity::for_requests(&topo, 2, MAX_TOKENS);
    let (mut engine, _transport, cluster) = local_cluster(&topo, cap, TransportKind::Local).expect("cluster");
    engine.tick();
    let baseline = engine.entity_count();
    engine.submit(1, 30);
    engine.tick();
    assert_eq!(engine.status(1), Some(Status::Planned));
    // Push one descriptor of one plan past the end of its destination.
    let mut pair = None;
    engine.edit_first_plan(1, |plan| {
        pair = Some((plan.producer, plan.consumer));
        plan.descriptors[0].dst_offset = u64::MAX / 4;
    });
    let (producer, consumer) = pair.expect("a plan");
    for s in 0..topo.prefill().pp {
        engine.mark_computed(1, s);
    }
    let deadline = Instant::now() + WAIT;
    let failure = loop {
        assert!(cluster.mover.wait_idle(WAIT));
        engine.tick();
        if let Some(o) = engine.take_outcomes().into_iter().find(|o| o.request == 1) {
            break o.result.expect_err("a refused write must fail the request");
        }
        assert!(Instant::now() < deadline, "no outcome: {:?}", engine.status(1));
    };
    let reason = failure.to_string();
    assert_eq!(failure.phase.name(), "transfer", "{reason}");
    assert!(matches!(failure.cause, handoff_components::Cause::Transfer { .. }), "{failure:?}");
    let names = format!("prefill pp{} tp{} to decode tp{}", producer.pp, producer.tp, consumer.tp);
    assert!(reason.contains(&names) && reason.contains("past the end"), "{reason}");
    assert_eq!(engine.entity_count(), baseline, "entities left behind");
    assert!(engine.producer_entries().iter().all(|&n| n == 0));
    pools_full(&engine).expect("pools full after the failure");
    assert_eq!((cluster.mover.in_flight(), cluster.mover.unpolled()), (0, 0));

    engine.submit(2, 30);
    engine.tick();
    for s in 0..topo.prefill().pp {
        engine.mark_computed(2, s);
    }
    run_until_outcomes(&mut engine, &cluster, &[2]);
    engine.finish(2);
    engine.tick();
    assert_eq!(engine.entity_count(), baseline);
}
