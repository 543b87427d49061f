//! `handoff verify`: run placement, splitting and an in-process transfer through the
//! engine, then check every consumer byte with the oracle (which knows only the rules).

use crate::check::CheckError;
use crate::check::oracle::{self, Memory, OracleRequest, Placement};
use crate::engine::mover::{LocalCluster, local_cluster};
use crate::engine::{Engine, QueueMover};
use crate::transport::{Transport, TransportExt};
use handoff_components::Topology;
use handoff_components::config::TransportKind;
use handoff_components::ecs::{Outcome, Status};
use handoff_components::layout::{blocks_for, owned_tokens};
use handoff_components::plan::Plan;
use handoff_components::vocab::{DecodeRank, RankId, RegionKind};
use handoff_systems::placement::Capacity;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// Staged row groups in the plans (scattered blocks), and their writes: one a
    /// staging buffer.
    pub staged_groups: u64,
    pub staged_writes: u64,
    /// Staged writes that ran (the oracle's count over the plans that ran).
    pub staged_writes_run: u64,
    /// The decode pool was fragmented (`--fragmented`), and the bytes moved by this
    /// transport (`--transport`; `None`: the oracle's counting copy).
    pub fragmented: bool,
    pub transport: Option<TransportKind>,
    /// Chunks of the plans of a chunked transfer (`[prefill] chunked`; 0
    /// otherwise), and the plans that have them.
    pub chunks: u64,
    pub chunks_plans: u64,
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

/// How [`verify_with`] runs: the decode pool as it comes or fragmented, and the
/// bytes moved by the oracle's counting copy or by the engine's own mover.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VerifyOptions {
    /// Cut the decode block pool into holes between live requests before the
    /// checked requests are placed (`handoff verify --fragmented`), so that each
    /// takes scattered decode blocks and its rows are planned as staged groups.
    pub fragmented: bool,
    /// Move the bytes through the engine's [`crate::engine::mover::TransportMover`]
    /// over this transport (`--transport`), staged groups through its stager, instead of
    /// the oracle's counting copy. The oracle still checks every copy's bounds
    /// and single write from the plans, then every consumer byte.
    pub transport: Option<TransportKind>,
}

/// Runs `requests` requests of `tokens` tokens through the engine and the oracle.
/// `tamper` may edit the plans before they run (negative tests).
pub fn verify(topo: &Topology, tokens: u64, requests: u32, tamper: impl FnMut(&mut Vec<Plan>)) -> Result<VerifyReport, CheckError> {
    verify_with(topo, tokens, requests, VerifyOptions::default(), tamper)
}

/// How the decode pool is cut for `--fragmented`: `holes` holes of `hole` blocks a
/// rank, each followed by a live request of one block a rank.
struct Fragments {
    holes: u32,
    hole: u32,
}

impl Fragments {
    /// Holes of half a checked request's decode blocks (rank 0's, the most), two
    /// a checked request: each request spans two holes on every rank that needs
    /// more than half of rank 0's blocks. A request of one decode block a rank
    /// cannot be scattered and is refused.
    fn new(topo: &Topology, tokens: u64, requests: u32) -> Result<Fragments, CheckError> {
        if topo.config.prefill.chunked {
            return Err(CheckError::Input(
                "--fragmented: this topology's transfer is chunked ([prefill] chunked), and chunked plans stage nothing (a staged group spans the whole request); check it without --fragmented".into(),
            ));
        }
        let d = topo.decode();
        let blocks = blocks_for(owned_tokens(tokens, d.dcp, 0, d.interleave), d.block_size);
        if blocks < 2 {
            return Err(CheckError::Input(format!(
                "--fragmented: {tokens} tokens take one decode block a rank (decode block_size {}, dcp {}), which cannot be scattered; give more than {} tokens",
                d.block_size,
                d.dcp,
                u64::from(d.block_size) * u64::from(d.dcp)
            )));
        }
        Ok(Fragments { holes: 2 * requests, hole: blocks.div_ceil(2) as u32 })
    }

    /// Tokens of a request that takes `blocks` decode blocks on every rank.
    fn tokens(topo: &Topology, blocks: u32) -> u64 {
        let d = topo.decode();
        u64::from(blocks) * u64::from(d.block_size) * u64::from(d.dcp)
    }
}

/// Where the bytes move.
enum Exec {
    /// The oracle's counting copy over host memory; the engine's mover only queues.
    Oracle(QueueMover),
    /// The engine's transport mover; the regions live in the transport.
    Transport(Arc<dyn Transport>, LocalCluster),
}

impl Exec {
    /// Ticks until every request of `ids` has an outcome; a queued plan is
    /// completed without copying a byte (the fillers of `--fragmented`).
    fn hand_off_empty(&self, engine: &mut Engine, ids: &[u64]) -> Result<(), CheckError> {
        let mut left: Vec<u64> = ids.to_vec();
        let deadline = Instant::now() + Duration::from_secs(300);
        while !left.is_empty() {
            match self {
                Exec::Oracle(q) => {
                    for (t, _) in q.take_submitted() {
                        q.complete(t, Ok(()));
                    }
                }
                Exec::Transport(_, c) => {
                    c.mover.wait_completion(Duration::from_millis(50));
                }
            }
            engine.tick();
            for o in engine.take_outcomes() {
                if let Err(failure) = o.result {
                    return Err(CheckError::Failed { request: o.request, failure });
                }
                left.retain(|&id| id != o.request);
            }
            if Instant::now() > deadline {
                return Err(CheckError::Engine(format!("requests {left:?} never handed off: {:?}", engine.status(left[0]))));
            }
        }
        Ok(())
    }
}

/// [`verify`] with its [`VerifyOptions`].
pub fn verify_with(
    topo: &Topology,
    tokens: u64,
    requests: u32,
    opts: VerifyOptions,
    mut tamper: impl FnMut(&mut Vec<Plan>),
) -> Result<VerifyReport, CheckError> {
    topo.admits_transfer_mode().map_err(CheckError::Admission)?;
    let fragments = if opts.fragmented { Some(Fragments::new(topo, tokens, requests)?) } else { None };
    // One spare request's worth of blocks and slots stays free: its bytes must stay
    // canary. Fragmented, the decode pool is the holes and the requests between
    // them, and one spare block: no free run is as long as a checked request.
    let mut cap = Capacity::for_requests(topo, requests + 1, tokens);
    if let Some(f) = &fragments {
        cap.decode_blocks = f.holes * (f.hole + 1) + 1;
        cap.slots = cap.slots.max(2 * f.holes + 1);
    }
    // The mover plans as the engine's transport movers do: the topology's staging
    // buffer, so that rows whose blocks do not line up go out as staged groups.
    let staging = Some(topo.config.transport.staging_bytes).filter(|&b| b > 0 && topo.config.transport.staging_buffers > 0);
    let (mut engine, exec) = match opts.transport {
        None => {
            let mover = QueueMover::staging(staging);
            (Engine::new(topo.clone(), cap, Box::new(mover.clone())), Exec::Oracle(mover))
        }
        Some(kind) => {
            let (engine, t, cluster) = local_cluster(topo, cap, kind).map_err(|e| CheckError::model("the transport", e))?;
            (engine, Exec::Transport(t, cluster))
        }
    };
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

    // Fragmented: holes and live requests one after the other, each placed alone
    // (so their blocks follow in order) and handed off without a byte copied (the
    // transport's copies are overwritten with the canary below); then the holes go.
    let mut fillers = Vec::new();
    if let Some(f) = &fragments {
        let mut holes = Vec::new();
        for i in 0..f.holes as u64 {
            for (id, blocks) in [(1_000_000 + 2 * i, f.hole), (1_000_001 + 2 * i, 1)] {
                engine.submit(id, Fragments::tokens(topo, blocks));
                engine.tick();
                for s in 0..topo.prefill().pp {
                    engine.mark_computed(id, s);
                }
                exec.hand_off_empty(&mut engine, &[id])?;
                if blocks == f.hole { holes.push(id) } else { fillers.push(id) }
            }
        }
        for &id in &holes {
            engine.finish(id);
        }
        engine.tick();
        fail_on_outcomes(&mut engine)?;
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
    }
    let mut report =
        VerifyReport { requests, tokens, entities_baseline: baseline, fragmented: opts.fragmented, transport: opts.transport, ..Default::default() };
    let exec_stats = match &exec {
        Exec::Oracle(mover) => {
            for &id in &ids {
                for s in 0..topo.prefill().pp {
                    engine.mark_computed(id, s);
                }
            }
            engine.tick();
            let submitted = mover.take_submitted();
            let mut plans: Vec<Plan> = submitted.iter().map(|(_, p)| p.clone()).collect();
            count_plans(&plans, &mut report);
            tamper(&mut plans);
            let stats = oracle::execute_counted(&plans, &mut mem)?;
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
            stats
        }
        Exec::Transport(t, cluster) => {
            // The plans as the engine holds them, tampered in place; the oracle
            // checks their bounds and single writes before the mover runs them.
            let mut plans: Vec<Plan> = ids.iter().flat_map(|&id| engine.plans(id)).collect();
            count_plans(&plans, &mut report);
            tamper(&mut plans);
            let mut rest = plans.iter();
            for &id in &ids {
                let n = engine.plans(id).len();
                let mine: Vec<Plan> = rest.by_ref().take(n).cloned().collect();
                engine.edit_plans(id, |p| *p = mine);
            }
            let lens = mem.iter().map(|(k, v)| (*k, v.len() as u64)).collect();
            let stats = oracle::check_counted(&plans, &lens)?;
            // Every region as the check filled it: the canary over what the
            // fillers' hand-offs wrote, the requests' pattern on the producers.
            for ((rank, kind), h) in &cluster.regions {
                t.write_region(h, |b| b.copy_from_slice(&mem[&(*rank, *kind)])).map_err(|e| CheckError::model("filling a region", e))?;
            }
            for &id in &ids {
                for s in 0..topo.prefill().pp {
                    engine.mark_computed(id, s);
                }
            }
            exec.hand_off_empty(&mut engine, &ids)?;
            for ((rank, kind), h) in &cluster.regions {
                if matches!(rank, RankId::Decode(_)) {
                    let got = t.region_bytes(h).map_err(|e| CheckError::model("reading a region", e))?;
                    mem.insert((*rank, *kind), got);
                }
            }
            stats
        }
    };
    report.bytes_written = exec_stats.bytes;
    report.staged_writes_run = exec_stats.staged_writes;

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
            let got = exec_stats.written.get(&(rank, kind)).copied().unwrap_or(0);
            if want != got {
                return Err(CheckError::Engine(format!("decode tp{tp} {kind}: plans wrote {got} bytes, the rules say {want}")));
            }
            *report.by_kind.entry(kind).or_default() += got;
        }
    }
    if fragments.is_some() && report.staged_groups == 0 {
        return Err(CheckError::Engine(format!(
            "--fragmented: the decode blocks were scattered, and no plan staged its rows (staging buffer {} B)",
            topo.config.transport.staging_bytes
        )));
    }

    for &id in ids.iter().chain(&fillers) {
        engine.finish(id);
    }
    engine.tick();
    report.entities_after = engine.entity_count();
    if report.entities_after != baseline {
        return Err(CheckError::Engine(format!("release left {} entities, baseline {baseline}", report.entities_after)));
    }
    Ok(report)
}

/// The plans' descriptors and staged groups, before any tampering.
fn count_plans(plans: &[Plan], report: &mut VerifyReport) {
    for p in plans {
        report.descriptors += p.descriptors.len() as u64;
        report.uncoalesced += p.uncoalesced;
        report.staged_groups += p.staged.len() as u64;
        report.staged_writes += p.staged.iter().map(|g| g.writes.len() as u64).sum::<u64>();
        report.chunks += p.chunks.len() as u64;
        report.chunks_plans += u64::from(!p.chunks.is_empty());
    }
}

fn fail_on_outcomes(engine: &mut Engine) -> Result<(), CheckError> {
    for Outcome { request, result, .. } in engine.take_outcomes() {
        if let Err(failure) = result {
            return Err(CheckError::Failed { request, failure });
        }
    }
    Ok(())
}
