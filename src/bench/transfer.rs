//! `handoff bench transfer`: the hand-off of real plans (the engine's, for the
//! config's topology) through a transport on this host, timed against this
//! machine's memcpy measured in the same run.
//!
//! The producer and the consumer are two transports of one kind in this process,
//! wired as two processes would be: `local`, two in-process instances; `shm`, two
//! shared-memory endpoints, the producer mapping the consumer's region files and
//! copying into them exactly as a producer process does (only the process boundary
//! is missing: the copy path is the same); `tcp`, two endpoints on 127.0.0.1.
//! Producer regions hold the oracle's pattern, and after the timed passes every
//! consumer byte is checked with the oracle: a fast wrong transfer does not report.

use crate::check::oracle::{self, OracleRequest, Placement};
use crate::engine::mover::{MoverOptions, StagingMode, TransportMover};
use crate::engine::{Engine, QueueMover};
use crate::transport::bench::CopyLimits;
use crate::transport::{Transport, TransportExt, loopback_pair_config};
use anyhow::{Context, anyhow, bail};
use handoff_components::Topology;
use handoff_components::config::TransportKind;
use handoff_components::ecs::Region;
use handoff_components::plan::Plan;
use handoff_components::vocab::{RankId, RegionKind};
use handoff_systems::placement::Capacity;
use handoff_systems::transfer::{Mover, PlanCompletion, Ticket};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Knobs of the transfer bench beyond the command's arguments.
#[derive(Debug, Clone)]
pub struct BenchCmdOptions {
    pub warmup: u32,
    /// Timed passes; each moves every plan of every request once, right after
    /// the copy limits are taken (the report gives the medians of both).
    pub iterations: u32,
    pub staging: StagingMode,
    /// Mover worker threads (plans in flight at once).
    pub workers: usize,
    /// Check every consumer byte with the oracle after the passes.
    pub verify: bool,
    pub memcpy_bytes: usize,
}

impl Default for BenchCmdOptions {
    fn default() -> Self {
        BenchCmdOptions {
            warmup: 1,
            iterations: 5,
            staging: StagingMode::Auto,
            workers: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).clamp(1, 8),
            verify: true,
            memcpy_bytes: 256 << 20,
        }
    }
}

/// What a run of the transfer bench measured; printed (`Display`) as the
/// command's report, whose last line is exactly `ratio to memcpy: R`.
#[derive(Debug, Clone, PartialEq)]
pub struct TransferReport {
    pub config_path: String,
    pub model: String,
    /// Prefill PP and TP, decode TP and DCP.
    pub shape: (u32, u32, u32, u32),
    pub transport: &'static str,
    pub requests: u32,
    pub tokens: u64,
    /// Plans, bytes and descriptors of one pass (each plan once).
    pub plans: usize,
    pub bytes_per_pass: u64,
    /// Bytes per region kind, as `kind bytes, ...`.
    pub by_kind: String,
    pub descriptors_per_pass: u64,
    /// Descriptors before coalescing.
    pub uncoalesced: u64,
    pub staging: StagingMode,
    pub workers: usize,
    pub passes: u32,
    pub warmup: u32,
    /// All the timed passes, together.
    pub seconds: f64,
    /// The median pass.
    pub gb_per_s: f64,
    pub descriptors_per_s: f64,
    /// memcpy of the same run, GB/s, on 1 and 2 threads: the medians of the
    /// copies taken before each pass.
    pub memcpy: (f64, f64),
    /// The transports' own streaming copy of one contiguous buffer on 2
    /// threads, taken the same way: what a copy without the destination's read
    /// for ownership reaches on this machine.
    pub streaming: f64,
    /// Pattern bytes the oracle checked in the consumer's regions (None: not checked).
    pub verified: Option<u64>,
}

impl TransferReport {
    /// The bandwidth against the faster memcpy of the same run.
    pub fn ratio_to_memcpy(&self) -> f64 {
        self.gb_per_s / self.memcpy.0.max(self.memcpy.1).max(1e-9)
    }
}

impl fmt::Display for TransferReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (pp, ptp, dtp, dcp) = self.shape;
        let (config_path, requests, tokens) = (&self.config_path, self.requests, self.tokens);
        writeln!(
            f,
            "transfer bench: {config_path} ({}), prefill PP{pp} x TP{ptp} -> decode TP{dtp} x DCP{dcp}, {} transport, {requests} request(s) x {tokens} tokens",
            self.model, self.transport
        )?;
        writeln!(f, "plans: {} per pass; {} bytes per pass ({})", self.plans, self.bytes_per_pass, self.by_kind)?;
        writeln!(
            f,
            "descriptors: {} per pass ({} before coalescing, {:.1}x fewer); staging {:?}, {} mover workers",
            self.descriptors_per_pass,
            self.uncoalesced,
            self.uncoalesced as f64 / self.descriptors_per_pass.max(1) as f64,
            self.staging,
            self.workers
        )?;
        writeln!(f, "passes: {} timed after {} warmup, {:.3} s, each right after the copy limits below", self.passes, self.warmup, self.seconds)?;
        writeln!(f, "bandwidth: {:.2} GB/s (the median pass)", self.gb_per_s)?;
        writeln!(f, "descriptors per second: {:.0}", self.descriptors_per_s)?;
        writeln!(f, "memcpy (same run, medians): {:.2} GB/s on 1 thread, {:.2} GB/s on 2 threads", self.memcpy.0, self.memcpy.1)?;
        writeln!(
            f,
            "streaming copy (same run, median, 2 threads, one contiguous buffer): {:.2} GB/s, ratio {:.3}",
            self.streaming,
            self.gb_per_s / self.streaming.max(1e-9)
        )?;
        match self.verified {
            Some(pattern) => writeln!(f, "byte-exact: yes, every consumer byte checked by the oracle ({pattern} pattern bytes)")?,
            None => writeln!(f, "byte-exact: not checked")?,
        }
        write!(f, "ratio to memcpy: {:.3}", self.ratio_to_memcpy())
    }
}

/// Runs the transfer bench with the default options.
pub fn bench_transfer_cmd(config_path: &str, kind: TransportKind, tokens: u64, requests: u32) -> anyhow::Result<TransferReport> {
    bench_transfer_with(config_path, kind, tokens, requests, &BenchCmdOptions::default())
}

/// [`bench_transfer_cmd`] with explicit options.
pub fn bench_transfer_with(config_path: &str, kind: TransportKind, tokens: u64, requests: u32, o: &BenchCmdOptions) -> anyhow::Result<TransferReport> {
    let topo = Topology::load(config_path).with_context(|| format!("loading {config_path}"))?;
    let config = handoff_components::config::TransportConfig { kind, ..topo.config.transport.clone() };
    let (producer, consumer) = loopback_pair_config(&config).context("opening the transports")?;
    bench_transfer_on(config_path, &topo, producer, consumer, tokens, requests, o)
}

/// The transfer bench between two given transports of this process (the
/// producer first), for a loaded topology.
pub fn bench_transfer_on(
    config_path: &str,
    topo: &Topology,
    producer: Arc<dyn Transport>,
    consumer: Arc<dyn Transport>,
    tokens: u64,
    requests: u32,
    o: &BenchCmdOptions,
) -> anyhow::Result<TransferReport> {
    let topo = topo.clone();
    if requests == 0 || tokens == 0 {
        bail!("the bench needs at least one request of at least one token");
    }
    topo.admits_transfer_mode().map_err(|r| anyhow!("refused at admission: {r}"))?;

    let (mut engine, jobs, ids) = planned(&topo, tokens, requests)?;
    let mover_opts =
        MoverOptions { staging: o.staging, workers: o.workers.max(1), batch_timeout: Duration::from_secs(120), ..MoverOptions::from_topology(&topo) };
    let mut mover = TransportMover::new(producer.clone(), mover_opts)?;
    let regions: Vec<Region> = engine.regions();
    let mut consumer_regions = BTreeMap::new();
    let mut units = BTreeMap::new();
    for r in &regions {
        let (rank, kind, len) = (r.rank, r.layout.kind, r.layout.len);
        units.insert((rank, kind), r.layout.units);
        match rank {
            RankId::Prefill(p) => {
                let h = producer.register(rank, kind, len)?;
                for (id, handoff_components::ecs::Lease { rank: rk, blocks, slot }) in
                    ids.iter().flat_map(|&id| engine.leases(id).into_iter().map(move |l| (id, l)))
                {
                    if rk == rank {
                        let req = OracleRequest { id, tokens };
                        let at = Placement { blocks: &blocks, slot };
                        producer.write_region(&h, |b| oracle::fill_producer(&topo, p, kind, r.layout.units, &req, &at, b))?;
                    }
                }
                mover.add_source(h);
            }
            RankId::Decode(_) => {
                let h = consumer.register(rank, kind, len)?;
                consumer.write_region(&h, |b| oracle::fill_canary(rank, kind, b))?;
                mover.attach_target(&h)?;
                consumer_regions.insert((rank, kind), h);
            }
        }
    }

    let bytes_per_pass: u64 = jobs.iter().map(|(_, p)| p.bytes()).sum();
    let descriptors_per_pass: u64 = jobs.iter().map(|(_, p)| p.descriptors.len() as u64).sum();
    let uncoalesced: u64 = jobs.iter().map(|(_, p)| p.uncoalesced).sum();
    let pass = |mover: &mut TransportMover| run_pass(mover, &jobs);
    let mut limits = CopyLimits::new(o.memcpy_bytes);
    for _ in 0..o.warmup {
        pass(&mut mover)?;
    }
    let passes = o.iterations.max(1);
    let (mut rates, mut memcpy1, mut memcpy2, mut streaming) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut seconds = 0.0;
    for _ in 0..passes {
        memcpy1.push(limits.memcpy(1));
        memcpy2.push(limits.memcpy(2));
        streaming.push(limits.streaming(2));
        let started = Instant::now();
        pass(&mut mover)?;
        let s = started.elapsed().as_secs_f64().max(1e-9);
        seconds += s;
        rates.push(bytes_per_pass as f64 / s / 1e9);
    }
    let gb_per_s = median(&mut rates);
    let desc_per_s = descriptors_per_pass as f64 * gb_per_s * 1e9 / bytes_per_pass.max(1) as f64;

    let verified = if o.verify {
        let mut pattern = 0u64;
        let leases: BTreeMap<(u64, RankId), (Vec<u32>, u32)> =
            ids.iter().flat_map(|&id| engine.leases(id).into_iter().map(move |l| ((id, l.rank), (l.blocks, l.slot)))).collect();
        for ((rank, kind), h) in &consumer_regions {
            let RankId::Decode(d) = *rank else { continue };
            let reqs: Vec<(OracleRequest, Placement)> = ids
                .iter()
                .map(|&id| {
                    let (b, s) = &leases[&(id, *rank)];
                    (OracleRequest { id, tokens }, Placement { blocks: b, slot: *s })
                })
                .collect();
            let stats = consumer
                .read_region(h, |b| oracle::check_consumer(&topo, d, *kind, units[&(*rank, *kind)], &reqs, b))?
                .map_err(|e| anyhow!("the bench's transfer is wrong: {e}"))?;
            pattern += stats.pattern_bytes;
        }
        Some(pattern)
    } else {
        None
    };
    drop(mover);

    let (p, d) = (topo.prefill(), topo.decode());
    Ok(TransferReport {
        config_path: config_path.to_string(),
        model: topo.model().name.clone(),
        shape: (p.pp, p.tp, d.tp, d.dcp),
        transport: producer.name(),
        requests,
        tokens,
        plans: jobs.len(),
        bytes_per_pass,
        by_kind: kinds_line(&jobs),
        descriptors_per_pass,
        uncoalesced,
        staging: o.staging,
        workers: o.workers.max(1),
        passes,
        warmup: o.warmup,
        seconds,
        gb_per_s,
        descriptors_per_s: desc_per_s,
        memcpy: (median(&mut memcpy1), median(&mut memcpy2)),
        streaming: median(&mut streaming),
        verified,
    })
}

/// What [`planned`] returns: the engine, its plans by ticket, the request ids.
pub type Planned = (Engine, Vec<(Ticket, Plan)>, Vec<u64>);

/// The engine's plans for `requests` requests of `tokens` tokens (captured by a
/// queue mover), with the engine that placed them and the request ids.
///
/// The plans are whole-request ones, as with `[prefill] layer_streaming = false`:
/// the bench moves each request's hand-off as one pass, against memcpy or the
/// device copy. A streaming stage moves the same bytes in parts a layer, with
/// more descriptors (the flagship at 32K: 3,496 against 448), as each layer
/// is computed.
pub fn planned(topo: &Topology, tokens: u64, requests: u32) -> anyhow::Result<Planned> {
    let cap = Capacity::for_requests(topo, requests, tokens);
    let queue = QueueMover::default();
    let mut whole = topo.clone();
    whole.config.prefill.layer_streaming = false;
    let mut engine = Engine::new(whole, cap, Box::new(queue.clone()));
    let ids: Vec<u64> = (0..requests as u64).map(|i| 1 + i).collect();
    for &id in &ids {
        engine.submit(id, tokens);
    }
    engine.tick();
    for o in engine.take_outcomes() {
        if let Err(failure) = o.result {
            bail!("request {} refused in {}: {failure}", o.request, failure.phase.name());
        }
    }
    for &id in &ids {
        for s in 0..topo.prefill().pp {
            engine.mark_computed(id, s);
        }
    }
    engine.tick();
    let jobs: Vec<(Ticket, Plan)> = queue.take_submitted();
    if jobs.is_empty() {
        bail!("the engine planned no copies ({:?})", engine.status(ids[0]));
    }
    Ok((engine, jobs, ids))
}

/// Moves every plan once through `mover` and waits for all of them; refuses a
/// failed or missing completion.
pub fn run_pass(mover: &mut TransportMover, jobs: &[(Ticket, Plan)]) -> anyhow::Result<()> {
    for (t, p) in jobs {
        mover.submit(*t, p).map_err(|e| anyhow!("submit: {e}"))?;
    }
    if !mover.handle().wait_idle(Duration::from_secs(600)) {
        bail!("transfers did not complete within 600 s");
    }
    let mut done: Vec<PlanCompletion> = Vec::new();
    mover.poll(&mut done);
    if done.len() != jobs.len() {
        bail!("{} completions for {} plans", done.len(), jobs.len());
    }
    if let Some(PlanCompletion { ticket, result: Err(e) }) = done.into_iter().find(|c| c.result.is_err()) {
        bail!("write from prefill pp{} tp{} to decode tp{} failed: {e}", ticket.producer.pp, ticket.producer.tp, ticket.consumer.tp);
    }
    Ok(())
}

/// The median of `xs` (the upper one of an even count); 0 when empty.
fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(0.0)
}

pub fn kinds_line(jobs: &[(Ticket, Plan)]) -> String {
    let mut by: BTreeMap<RegionKind, u64> = BTreeMap::new();
    for (_, p) in jobs {
        for d in &p.descriptors {
            *by.entry(d.kind).or_default() += d.bytes();
        }
    }
    by.iter().map(|(k, b)| format!("{k} {b}")).collect::<Vec<_>>().join(", ")
}
