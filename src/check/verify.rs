//! `handoff verify`: run placement, splitting and an in-process transfer through the
//! engine, then check every consumer byte with the oracle (which knows only the rules).

use crate::check::CheckError;
use crate::check::oracle::{self, Memory, OracleRequest, Placement};
use crate::engine::{Engine, QueueMover};
use handoff_components::Topology;
use handoff_components::ecs::{Outcome, Status};
use handoff_components::plan::Plan;
use handoff_components::vocab::{DecodeRank, RankId, RegionKind};
use handoff_systems::placement::Capacity;
use std::collections::BTreeMap;

/// What a passing verification checked.
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    pub requests: u32,
    pub tokens: u64,
    pub descriptors: u64,
    pub uncoalesced: u64,
    pub bytes_written: u64,
    pub pattern_bytes: u64,
    pub canary_bytes: u64,
    pub by_kind: BTreeMap<RegionKind, u64>,
    pub entities_after: u32,
    pub entities_baseline: u32,
}

/// `topo` with `[model] num_layers` set to `layers` (`handoff verify
/// --layers`): the same ranks, widths and heads at another depth, so a model
/// too large to hold (the flagship's 92 layers) is checked at a depth that
/// fits. The cut topology passes the loader's own checks, so a depth of 0,
/// fewer layers than prefill stages or a `layer_split` that no longer sums is
/// refused, with the values. `path` only labels the message.
pub fn at_depth(topo: &Topology, path: &str, layers: u32) -> Result<Topology, CheckError> {
    let full = topo.num_layers();
    let mut config = topo.config.clone();
    config.model.num_layers = layers;
    config.validate().map_err(|e| CheckError::Input(format!("--layers {layers}: {path} cannot be checked at {layers} of its {full} layers: {e}")))
}

/// Runs `requests` requests of `tokens` tokens through the engine and the oracle.
/// `tamper` may edit the plans before they run (negative tests).
pub fn verify(topo: &Topology, tokens: u64, requests: u32, mut tamper: impl FnMut(&mut Vec<Plan>)) -> Result<VerifyReport, CheckError> {
    topo.admits_transfer_mode().map_err(CheckError::Admission)?;
    // One spare request's worth of blocks and slots stays free: its bytes must stay canary.
    let cap = Capacity::for_requests(topo, requests + 1, tokens);
    let mover = QueueMover::default();
    let mut engine = Engine::new(topo.clone(), cap, Box::new(mover.clone()));
    // Baseline after one idle tick: the first run of a schedule creates its own bookkeeping.
    engine.tick();
    let baseline = engine.entity_count();

    // Registered memory: every region, filled with its canary. Placement's region
    // sizes must agree with the layout convention the oracle computes on its own.
    let mut mem = Memory::new();
    let mut units = BTreeMap::new();
    for r in engine.regions().iter() {
        let expect = oracle::region_len(topo, r.rank, r.layout.kind, r.layout.units);
        if expect != r.layout.len {
            return Err(CheckError::Engine(format!(
                "{} {}: placement sized the region {} bytes, the layout convention says {expect}",
                r.rank, r.layout.kind, r.layout.len
            )));
        }
        let mut buf = vec![0u8; r.layout.len as usize];
        oracle::fill_canary(r.rank, r.layout.kind, &mut buf);
        mem.insert((r.rank, r.layout.kind), buf);
        units.insert((r.rank, r.layout.kind), r.layout.units);
    }

    let ids: Vec<u64> = (0..requests as u64).map(|i| 1000 + i).collect();
    for &id in &ids {
        engine.submit(id, tokens);
    }
    engine.tick();
    fail_on_outcomes(&mut engine)?;
    let mut leases = BTreeMap::new();
    for &id in &ids {
        match engine.status(id) {
            Some(Status::Planned) => {}
            other => return Err(CheckError::Engine(format!("request {id} was not planned after one tick: {other:?}"))),
        }
        let req = OracleRequest { id, tokens };
        for handoff_components::ecs::Lease { rank, blocks, slot } in engine.leases(id) {
            if let RankId::Prefill(p) = rank {
                for kind in topo.region_kinds() {
                    let u = units[&(rank, kind)];
                    let buf = mem.get_mut(&(rank, kind)).ok_or_else(|| CheckError::Engine(format!("{rank} {kind}: a lease on a region it does not have")))?;
                    oracle::fill_producer(topo, p, kind, u, &req, &Placement { blocks: &blocks, slot }, buf);
                }
            }
            leases.insert((id, rank), (blocks, slot));
        }
        for s in 0..topo.prefill().pp {
            engine.mark_computed(id, s);
        }
    }
    engine.tick();
    let submitted = mover.take_submitted();
    let mut plans: Vec<Plan> = submitted.iter().map(|(_, p)| p.clone()).collect();
    let mut report = VerifyReport { requests, tokens, entities_baseline: baseline, ..Default::default() };
    for p in &plans {
        report.descriptors += p.descriptors.len() as u64;
        report.uncoalesced += p.uncoalesced;
    }
    tamper(&mut plans);
    let exec = oracle::execute_counted(&plans, &mut mem)?;
    report.bytes_written = exec.bytes;
    for (t, _) in &submitted {
        mover.complete(*t, Ok(()));
    }
    engine.tick();
    let outcomes = engine.take_outcomes();
    for &id in &ids {
        if !outcomes.iter().any(|o| o.request == id && o.result.is_ok()) {
            return Err(CheckError::Engine(format!("request {id} did not complete its hand-off: {:?}", engine.status(id))));
        }
    }

    // The oracle: every byte of every consumer region.
    for tp in 0..topo.decode().tp {
        let rank = DecodeRank { tp };
        let rid = RankId::Decode(rank);
        let expected = oracle::expected_bytes(topo, rank, tokens);
        for kind in topo.region_kinds() {
            let reqs: Vec<(OracleRequest, Placement)> = ids
                .iter()
                .map(|&id| {
                    let (b, s) = &leases[&(id, rid)];
                    (OracleRequest { id, tokens }, Placement { blocks: b, slot: *s })
                })
                .collect();
            let stats = oracle::check_consumer(topo, rank, kind, units[&(rid, kind)], &reqs, &mem[&(rid, kind)])?;
            report.pattern_bytes += stats.pattern_bytes;
            report.canary_bytes += stats.canary_bytes;
            let want = expected.get(&kind).copied().unwrap_or(0) * requests as u64;
            let got = exec.written.get(&(rank, kind)).copied().unwrap_or(0);
            if want != got {
                return Err(CheckError::Engine(format!("decode tp{tp} {kind}: plans wrote {got} bytes, the rules say {want}")));
            }
            *report.by_kind.entry(kind).or_default() += got;
        }
    }

    for &id in &ids {
        engine.finish(id);
    }
    engine.tick();
    report.entities_after = engine.entity_count();
    if report.entities_after != baseline {
        return Err(CheckError::Engine(format!("release left {} entities, baseline {baseline}", report.entities_after)));
    }
    Ok(report)
}

fn fail_on_outcomes(engine: &mut Engine) -> Result<(), CheckError> {
    for Outcome { request, result, .. } in engine.take_outcomes() {
        if let Err(failure) = result {
            return Err(CheckError::Failed { request, failure });
        }
    }
    Ok(())
}
