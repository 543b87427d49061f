//! `handoff bench transfer --transport cuda-ipc`: the hand-off between two
//! processes on one GPU, with its peers measured in the same run.
//!
//! This process is the producer; it starts itself again as the consumer
//! (`handoff bench transfer-consumer`, JSON lines on stdin and stdout). The
//! consumer registers the decode ranks' regions in device memory, fills them
//! with the oracle's canary and publishes their handles; the producer fills its
//! regions with the oracle's pattern, opens the consumer's regions through CUDA
//! IPC and moves the engine's plans through a [`TransportMover`] on the
//! [`DeviceTransport`], exactly as a prefill stage does. Peers, over the same
//! transport and byte count: one contiguous copy into memory of this process
//! (the device copy) and one into a region of the consumer opened through IPC
//! (the IPC copy). Afterwards the consumer checks every byte of its regions with
//! the oracle: a fast wrong hand-off does not report.

use crate::bench::transfer::{BenchCmdOptions, kinds_line, planned, run_pass};
use crate::check::oracle::{self, OracleRequest, Placement};
use crate::engine::mover::{MoverOptions, TransportMover};
use crate::transport::auth::{ClusterSecret, SECRET_ENV};
use crate::transport::device::{DeviceTransport, Submission};
use crate::transport::{MemoryKind, RegionHandle, RemoteRegion, Transport, TransportExt, shm};
use anyhow::{Context, anyhow, bail};
use handoff_components::Topology;
use handoff_components::plan::{Descriptor, Plan};
use handoff_components::vocab::{DecodeRank, PrefillRank, RankId, RegionKind};
use handoff_systems::transfer::Ticket;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Runs of each submission timed on the device's clock; the median is reported.
const DEVICE_REPS: u32 = 9;

/// What the producer tells the consumer process first.
#[derive(Debug, Serialize, Deserialize)]
struct ConsumerJob {
    config: String,
    tokens: u64,
    requests: u32,
    ordinal: u32,
    /// Bytes of the scratch region the IPC-copy peer writes into.
    scratch: u64,
}

/// The consumer's regions and its scratch region.
#[derive(Debug, Serialize, Deserialize)]
struct Ready {
    regions: Vec<RegionHandle>,
    scratch: RegionHandle,
}

/// Where each request sits on each decode rank: (request, decode tp, blocks, slot).
type Leases = Vec<(u64, u32, Vec<u32>, u32)>;

fn open(ordinal: u32) -> anyhow::Result<DeviceTransport> {
    let mem = handoff_kernels::cuda_device_memory(ordinal as usize).map_err(|e| anyhow!("device cuda:{ordinal}: {e}"))?;
    Ok(DeviceTransport::new(mem, ordinal, shm::default_dir(), ClusterSecret::process())?)
}

fn load(path: &str, tokens: u64, requests: u32) -> anyhow::Result<Topology> {
    let topo = Topology::load(path).with_context(|| format!("loading {path}"))?;
    if requests == 0 || tokens == 0 {
        bail!("the bench needs at least one request of at least one token");
    }
    topo.admits_transfer_mode().map_err(|r| anyhow!("refused at admission: {r}"))?;
    Ok(topo)
}

/// Bytes moved per second of `f`, run `reps` times after one warm-up.
fn rate(bytes: u64, reps: u32, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    f()?;
    let t = Instant::now();
    for _ in 0..reps.max(1) {
        f()?;
    }
    Ok(bytes as f64 * reps.max(1) as f64 / t.elapsed().as_secs_f64().max(1e-9) / 1e9)
}

/// What the cuda-ipc bench measured; printed (`Display`) as the command's
/// report, whose last line is `ratio to device copy: R`.
#[derive(Debug, Clone, PartialEq)]
pub struct IpcReport {
    pub config_path: String,
    pub model: String,
    /// Prefill PP and TP, decode TP and DCP.
    pub shape: (u32, u32, u32, u32),
    /// The device, as the transport names it.
    pub device: String,
    /// The consumer's process id.
    pub consumer_pid: u32,
    pub requests: u32,
    pub tokens: u64,
    pub plans: usize,
    pub bytes_per_pass: u64,
    /// Bytes per region kind, as `kind bytes, ...`.
    pub by_kind_bytes: String,
    pub descriptors_per_pass: usize,
    pub passes: u32,
    pub warmup: u32,
    pub seconds: f64,
    pub handoff_gbs: f64,
    /// The passes one region kind at a time: time, descriptors, rows, GB/s.
    pub by_kind: String,
    /// Where one more pass's time goes (its submissions).
    pub timeline: String,
    /// The pass's descriptors in one submission straight through the
    /// transport (no mover), GB/s.
    pub direct_gbs: f64,
    /// The device copy's rate on the device's own clock (events), GB/s.
    pub copy_device_gbs: f64,
    /// The pass and each kind on the device's own clock, GB/s and the
    /// fraction of `copy_device_gbs`.
    pub on_device: String,
    /// Each kind within the pass on the device's clock: the pass's time less
    /// the pass's without the kind (medians), GB/s and the fraction of
    /// `copy_device_gbs`.
    pub marginal: String,
    /// The peers of the same run, GB/s: one contiguous copy in this process,
    /// and one into the consumer's memory through IPC.
    pub copy_gbs: f64,
    pub ipc_gbs: f64,
    /// Pattern bytes the consumer process checked with the oracle.
    pub pattern_bytes: String,
}

impl fmt::Display for IpcReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (pp, ptp, dtp, dcp) = self.shape;
        let (config_path, requests, tokens, bytes_per_pass) = (&self.config_path, self.requests, self.tokens, self.bytes_per_pass);
        writeln!(
            f,
            "transfer bench: {config_path} ({}), prefill PP{pp} x TP{ptp} -> decode TP{dtp} x DCP{dcp}, cuda-ipc transport on {} (consumer in process {}), {requests} request(s) x {tokens} tokens",
            self.model, self.device, self.consumer_pid
        )?;
        writeln!(f, "plans: {} per pass; {bytes_per_pass} bytes per pass ({})", self.plans, self.by_kind_bytes)?;
        writeln!(f, "descriptors: {} per pass, each one device copy (2D when strided)", self.descriptors_per_pass)?;
        writeln!(f, "passes: {} timed after {} warmup, {:.4} s", self.passes, self.warmup, self.seconds)?;
        writeln!(f, "hand-off: {:.1} GB/s ({:.1} us per pass)", self.handoff_gbs, self.seconds / self.passes as f64 * 1e6)?;
        writeln!(f, "by kind: {}", self.by_kind)?;
        writeln!(f, "timeline of one more pass: {}", self.timeline)?;
        writeln!(
            f,
            "the pass in one submission without the mover: {:.1} GB/s ({:.3} of device copy)",
            self.direct_gbs,
            self.direct_gbs / self.copy_gbs.max(1e-9)
        )?;
        writeln!(f, "device copy (same run, {bytes_per_pass} B contiguous, this process): {:.1} GB/s", self.copy_gbs)?;
        writeln!(f, "IPC copy (same run, {bytes_per_pass} B contiguous into the consumer): {:.1} GB/s", self.ipc_gbs)?;
        writeln!(
            f,
            "on the device's clock (events around one submission, median of {DEVICE_REPS}; the device copy {:.1} GB/s): {}",
            self.copy_device_gbs, self.on_device
        )?;
        writeln!(
            f,
            "each kind within the pass on the device's clock (the pass less the pass without it, medians of {DEVICE_REPS}; differences of a few us are noise): {}",
            self.marginal
        )?;
        writeln!(f, "byte-exact: yes, every consumer byte checked by the oracle in the consumer process ({} pattern bytes)", self.pattern_bytes)?;
        writeln!(f, "ratio to IPC copy: {:.3}", self.handoff_gbs / self.ipc_gbs.max(1e-9))?;
        write!(f, "ratio to device copy: {:.3}", self.handoff_gbs / self.copy_gbs.max(1e-9))
    }
}

/// The producer side, and what it measured.
pub fn bench_transfer_ipc(config_path: &str, ordinal: u32, tokens: u64, requests: u32, o: &BenchCmdOptions) -> anyhow::Result<IpcReport> {
    let topo = load(config_path, tokens, requests)?;
    // The device first: where there is none, that is the answer.
    let producer = Arc::new(open(ordinal)?);
    let (mut engine, jobs, ids) = planned(&topo, tokens, requests)?;
    let bytes_per_pass: u64 = jobs.iter().map(|(_, p)| p.bytes()).sum();
    let device = producer.device();

    let exe = std::env::current_exe().context("the bench's own executable")?;
    let mut child = Command::new(exe)
        .args(["bench", "transfer-consumer"])
        .env(SECRET_ENV, ClusterSecret::process().to_hex())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting the consumer process")?;
    let mut to_child = child.stdin.take().ok_or_else(|| anyhow!("consumer stdin"))?;
    let mut from_child = BufReader::new(child.stdout.take().ok_or_else(|| anyhow!("consumer stdout"))?);
    let job = ConsumerJob { config: config_path.to_string(), tokens, requests, ordinal, scratch: bytes_per_pass };
    writeln!(to_child, "{}", serde_json::to_string(&job)?)?;
    let mut line = String::new();
    from_child.read_line(&mut line)?;
    let ready: Ready = serde_json::from_str(line.trim()).with_context(|| format!("the consumer said {:?}", line.trim()))?;
    if ready.regions.iter().chain([&ready.scratch]).any(|h| h.ipc.as_ref().is_none_or(|i| i.pid == std::process::id())) {
        bail!("the consumer's regions are not another process's device memory");
    }

    let opts = MoverOptions { staging: o.staging, workers: o.workers.max(1), batch_timeout: Duration::from_secs(120), ..MoverOptions::from_topology(&topo) };
    let mut mover = TransportMover::new(producer.clone() as Arc<dyn Transport>, opts)?;
    let memory = MemoryKind::Device { ordinal };
    // The same regions, for the passes written straight through the transport.
    let mut sources: BTreeMap<(RankId, RegionKind), RegionHandle> = BTreeMap::new();
    let mut targets: BTreeMap<(RankId, RegionKind), RemoteRegion> = BTreeMap::new();
    for r in engine.regions() {
        let RankId::Prefill(p) = r.rank else { continue };
        let (rank, kind) = (r.rank, r.layout.kind);
        let h = producer.register_memory(rank, kind, r.layout.len, memory)?;
        for id in &ids {
            for l in engine.leases(*id).into_iter().filter(|l| l.rank == rank) {
                let req = OracleRequest { id: *id, tokens };
                let at = Placement { blocks: &l.blocks, slot: l.slot };
                producer.write_region(&h, |b| oracle::fill_producer(&topo, p, kind, r.layout.units, &req, &at, b))?;
            }
        }
        sources.insert((rank, kind), h.clone());
        mover.add_source(h);
    }
    for h in &ready.regions {
        let remote = mover.attach_target(h).with_context(|| format!("opening {h} through CUDA IPC"))?;
        targets.insert((h.rank, h.kind), remote);
    }
    // A pass written straight through the transport: every plan's
    // descriptors in one submission (one copy_after, one event), then one
    // wait each; no mover, no worker thread. What the mover's pass costs
    // beyond this is host time.
    let groups = |jobs: &[(Ticket, Plan)]| -> anyhow::Result<Vec<(RegionHandle, RemoteRegion, Vec<Descriptor>)>> {
        let mut groups = Vec::new();
        for (_, p) in jobs {
            let mut by: BTreeMap<RegionKind, Vec<Descriptor>> = BTreeMap::new();
            for d in &p.descriptors {
                by.entry(d.kind).or_default().push(*d);
            }
            for (kind, descs) in by {
                let src = sources.get(&(RankId::Prefill(p.producer), kind)).ok_or_else(|| anyhow!("no {kind} source of {}", RankId::Prefill(p.producer)))?;
                let dst = *targets.get(&(RankId::Decode(p.consumer), kind)).ok_or_else(|| anyhow!("no {kind} target of {}", RankId::Decode(p.consumer)))?;
                groups.push((src.clone(), dst, descs));
            }
        }
        Ok(groups)
    };
    let direct = |jobs: &[(Ticket, Plan)]| -> anyhow::Result<()> {
        let g = groups(jobs)?;
        let w: Vec<(&RegionHandle, RemoteRegion, &[Descriptor])> = g.iter().map(|(s, d, v)| (s, *d, v.as_slice())).collect();
        for b in producer.submit_all(&w) {
            producer.wait(b?, Duration::from_secs(60))?;
        }
        Ok(())
    };
    // The device's own time for the same submission (events on its stream),
    // the median of `reps`: the copies' rate without the host's part.
    let on_device = |jobs: &[(Ticket, Plan)], reps: u32| -> anyhow::Result<f64> {
        let g = groups(jobs)?;
        let w: Vec<(&RegionHandle, RemoteRegion, &[Descriptor])> = g.iter().map(|(s, d, v)| (s, *d, v.as_slice())).collect();
        producer.time_on_device(&w)?;
        let mut t: Vec<f64> = (0..reps.max(1)).map(|_| producer.time_on_device(&w).map(|d| d.as_secs_f64())).collect::<Result<_, _>>()?;
        t.sort_by(f64::total_cmp);
        Ok(t[t.len() / 2])
    };

    for _ in 0..o.warmup {
        run_pass(&mut mover, &jobs)?;
    }
    let started = Instant::now();
    for _ in 0..o.iterations.max(1) {
        run_pass(&mut mover, &jobs)?;
    }
    let seconds = started.elapsed().as_secs_f64().max(1e-9);
    let handoff_gbs = bytes_per_pass as f64 * o.iterations.max(1) as f64 / seconds / 1e9;
    // One more pass with its submissions logged: where its time goes.
    producer.record_submissions();
    let pass_start = Instant::now();
    run_pass(&mut mover, &jobs)?;
    let pass_us = pass_start.elapsed().as_secs_f64() * 1e6;
    let timeline = timeline(&producer.take_submissions(), pass_start, pass_us);
    let direct_gbs = rate(bytes_per_pass, o.iterations.max(1), || direct(&jobs))?;

    // Where the time goes: the same passes, one region kind at a time.
    let mut by_kind = String::new();
    let mut kinds_on_device: Vec<(RegionKind, u64, f64)> = Vec::new();
    // What each kind adds to the pass on the device: the pass without it,
    // against the whole pass (its copies share the other kinds' launches).
    let mut kinds_marginal: Vec<(RegionKind, u64, f64)> = Vec::new();
    let pass_device_s = on_device(&jobs, DEVICE_REPS)?;
    for kind in [RegionKind::MlaKv, RegionKind::KdaState, RegionKind::KdaConv, RegionKind::ReplayRecords] {
        let only: Vec<(Ticket, Plan)> = jobs
            .iter()
            .map(|(t, p)| (*t, Plan { descriptors: p.descriptors.iter().filter(|d| d.kind == kind).copied().collect(), ..p.clone() }))
            .filter(|(_, p)| !p.descriptors.is_empty())
            .collect();
        if only.is_empty() {
            continue;
        }
        let bytes: u64 = only.iter().map(|(_, p)| p.bytes()).sum();
        let descs: Vec<&Descriptor> = only.iter().flat_map(|(_, p)| &p.descriptors).collect();
        let rows: u64 = descs.iter().map(|d| d.count as u64).sum();
        run_pass(&mut mover, &only)?;
        let t = Instant::now();
        for _ in 0..o.iterations.max(1) {
            run_pass(&mut mover, &only)?;
        }
        let us = t.elapsed().as_secs_f64() / o.iterations.max(1) as f64 * 1e6;
        let alone = rate(bytes, o.iterations.max(1), || direct(&only))?;
        let device_s = on_device(&only, DEVICE_REPS)?;
        kinds_on_device.push((kind, bytes, device_s));
        let without: Vec<(Ticket, Plan)> = jobs
            .iter()
            .map(|(t, p)| (*t, Plan { descriptors: p.descriptors.iter().filter(|d| d.kind != kind).copied().collect(), ..p.clone() }))
            .filter(|(_, p)| !p.descriptors.is_empty())
            .collect();
        kinds_marginal.push((kind, bytes, pass_device_s - on_device(&without, DEVICE_REPS)?));
        write!(
            by_kind,
            "{}{kind} {:.0} us ({} descriptors, {} rows of {} B avg, {:.1} GB/s; in one submission without the mover {:.1} GB/s; on the device {:.1} us, {:.1} GB/s)",
            if by_kind.is_empty() { "" } else { "; " },
            us,
            descs.len(),
            rows,
            bytes / rows.max(1),
            bytes as f64 / us / 1e3,
            alone,
            device_s * 1e6,
            bytes as f64 / device_s.max(1e-12) / 1e9
        )?;
    }

    // Peers: the same bytes as one contiguous copy, here and into the consumer.
    let kind = RegionKind::MlaKv;
    let rank = RankId::Prefill(PrefillRank { pp: 0, tp: 0 });
    let src = producer.register_memory(rank, kind, bytes_per_pass, memory)?;
    let here = producer.register_memory(RankId::Decode(DecodeRank { tp: 0 }), kind, bytes_per_pass, memory)?;
    let here = producer.attach(&here)?;
    let there = producer.attach(&ready.scratch).context("opening the consumer's scratch region")?;
    let one = [Descriptor::copy(kind, 0, 0, bytes_per_pass)];
    let timeout = Duration::from_secs(60);
    let reps = o.iterations.max(1) * 3;
    let copy_gbs = rate(bytes_per_pass, reps, || Ok(producer.transfer(&src, here, &one, timeout)?))?;
    let copy_device_s = {
        producer.time_on_device(&[(&src, here, &one)])?;
        let mut t: Vec<f64> = (0..DEVICE_REPS).map(|_| producer.time_on_device(&[(&src, here, &one)]).map(|d| d.as_secs_f64())).collect::<Result<_, _>>()?;
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    let copy_device_gbs = bytes_per_pass as f64 / copy_device_s.max(1e-12) / 1e9;
    let on_device_line = std::iter::once(format!(
        "the pass {:.1} GB/s ({:.3})",
        bytes_per_pass as f64 / pass_device_s.max(1e-12) / 1e9,
        copy_device_s / pass_device_s.max(1e-12)
    ))
    .chain(
        kinds_on_device
            .iter()
            .map(|(k, b, t)| format!("{k} {:.1} GB/s ({:.3})", *b as f64 / t.max(1e-12) / 1e9, (*b as f64 / t.max(1e-12) / 1e9) / copy_device_gbs)),
    )
    .collect::<Vec<_>>()
    .join("; ");
    let marginal = kinds_marginal
        .iter()
        .map(|(k, b, t)| {
            let gbs = *b as f64 / t.max(1e-12) / 1e9;
            format!("{k} {:.1} us, {gbs:.1} GB/s ({:.3})", t * 1e6, gbs / copy_device_gbs)
        })
        .collect::<Vec<_>>()
        .join("; ");
    let ipc_gbs = rate(bytes_per_pass, reps, || Ok(producer.transfer(&src, there, &one, timeout)?))?;

    // The consumer checks every byte of what it was handed.
    let leases: Leases = ids
        .iter()
        .flat_map(|&id| engine.leases(id).into_iter().map(move |l| (id, l)))
        .filter_map(|(id, l)| match l.rank {
            RankId::Decode(d) => Some((id, d.tp, l.blocks, l.slot)),
            RankId::Prefill(_) => None,
        })
        .collect();
    writeln!(to_child, "{}", serde_json::to_string(&leases)?)?;
    line.clear();
    from_child.read_line(&mut line)?;
    let status = child.wait()?;
    let pattern_bytes = match line.trim().strip_prefix("checked ") {
        Some(n) if status.success() => n.to_string(),
        _ => bail!("the hand-off is wrong: the consumer says {:?} ({status})", line.trim()),
    };
    drop(mover);

    let (p, d) = (topo.prefill(), topo.decode());
    Ok(IpcReport {
        config_path: config_path.to_string(),
        model: topo.model().name.clone(),
        shape: (p.pp, p.tp, d.tp, d.dcp),
        device: device.to_string(),
        consumer_pid: ready.scratch.ipc.as_ref().map_or(0, |i| i.pid),
        requests,
        tokens,
        plans: jobs.len(),
        bytes_per_pass,
        by_kind_bytes: kinds_line(&jobs),
        descriptors_per_pass: jobs.iter().map(|(_, p)| p.descriptors.len()).sum::<usize>(),
        passes: o.iterations.max(1),
        warmup: o.warmup,
        seconds,
        handoff_gbs,
        by_kind,
        timeline,
        direct_gbs,
        copy_device_gbs,
        on_device: on_device_line,
        marginal,
        copy_gbs,
        ipc_gbs,
        pattern_bytes,
    })
}

/// One pass's submissions, as times from the pass's start: how many, how
/// much each queued, how long queueing took on the host, and how long each
/// waited for its completion to be seen.
fn timeline(subs: &[Submission], start: Instant, pass_us: f64) -> String {
    if subs.is_empty() {
        return format!("{pass_us:.0} us, no submission logged");
    }
    let us = |t: Instant| t.saturating_duration_since(start).as_secs_f64() * 1e6;
    let queue_us: f64 = subs.iter().map(|s| (s.queued - s.called).as_secs_f64() * 1e6).sum();
    let waits: Vec<f64> = subs.iter().filter_map(|s| s.done.map(|d| (d - s.queued).as_secs_f64() * 1e6)).collect();
    let first = subs.iter().map(|s| us(s.called)).fold(f64::INFINITY, f64::min);
    let last_queued = subs.iter().map(|s| us(s.queued)).fold(0.0, f64::max);
    let last_done = subs.iter().filter_map(|s| s.done.map(us)).fold(0.0, f64::max);
    // Each submission as called, copy list built, queued (the device
    // memory's launches between) and seen done, in us from the pass's start,
    // and its copies: where the device could have waited for the host.
    let each: Vec<String> = subs
        .iter()
        .map(|s| {
            format!(
                "{:.0}/{:.0}/{:.0}/{} ({}{}{})",
                us(s.called),
                us(s.listed),
                us(s.queued),
                s.done.map_or("-".to_string(), |d| format!("{:.0}", us(d))),
                s.copies,
                s.on_device.map_or(String::new(), |(a, b)| format!("; device {a:.0}-{b:.0}")),
                s.launch_us.map_or(String::new(), |l| format!("; launches {l:.1} us"))
            )
        })
        .collect();
    format!(
        "{pass_us:.0} us; {} submissions ({} batches, {} copies); first called at {first:.0} us, last queued at {last_queued:.0} us, last seen done at {last_done:.0} us; host time queueing {queue_us:.0} us in all; queued to seen done {:.0} us mean, {:.0} us max; {}; each called/listed/queued/done (copies; device reached-done; host time of its launches): {}",
        subs.len(),
        subs.iter().map(|s| s.batches).sum::<usize>(),
        subs.iter().map(|s| s.copies).sum::<usize>(),
        waits.iter().sum::<f64>() / waits.len().max(1) as f64,
        waits.iter().copied().fold(0.0, f64::max),
        device_busy(subs),
        each.join(", "),
    )
}

/// The device's side of a timeline: from its first list reached to its last
/// done, how long some list was running and how long none was (the device
/// waiting for the host between submissions).
fn device_busy(subs: &[Submission]) -> String {
    let mut spans: Vec<(f64, f64)> = subs.iter().filter_map(|s| s.on_device).collect();
    if spans.is_empty() {
        return "no device stamps".to_string();
    }
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (first, mut reach, mut busy) = (spans[0].0, spans[0].0, 0.0);
    let mut last = first;
    for (a, b) in spans {
        let a = a.max(reach);
        if b > a {
            busy += b - a;
        }
        reach = reach.max(b);
        last = last.max(b);
    }
    format!(
        "on the device's clock (from the log's start): first list reached at {first:.0} us, last done at {last:.0} us, some list running {busy:.0} us, none {:.0} us",
        (last - first - busy).max(0.0)
    )
}

/// The consumer process of [`bench_transfer_ipc`] (`handoff bench
/// transfer-consumer`): reads its job, publishes its regions, then checks them
/// against the leases it is sent and says `checked N` (pattern bytes) or why not.
pub fn transfer_consumer() -> anyhow::Result<()> {
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let mut line = String::new();
    input.read_line(&mut line)?;
    let job: ConsumerJob = serde_json::from_str(line.trim()).context("the consumer's job")?;
    let topo = load(&job.config, job.tokens, job.requests)?;
    let (mut engine, _, _) = planned(&topo, job.tokens, job.requests)?;
    let t = open(job.ordinal)?;
    let memory = MemoryKind::Device { ordinal: job.ordinal };
    let mut regions = Vec::new();
    let mut units = BTreeMap::new();
    for r in engine.regions() {
        let RankId::Decode(_) = r.rank else { continue };
        let h = t.register_memory(r.rank, r.layout.kind, r.layout.len, memory)?;
        t.write_region(&h, |b| oracle::fill_canary(r.rank, r.layout.kind, b))?;
        units.insert((r.rank, r.layout.kind), r.layout.units);
        regions.push(h);
    }
    let scratch = t.register_memory(RankId::Decode(DecodeRank { tp: 0 }), RegionKind::MlaKv, job.scratch, memory)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string(&Ready { regions: regions.clone(), scratch })?)?;
    out.flush()?;

    line.clear();
    input.read_line(&mut line)?;
    let leases: Leases = serde_json::from_str(line.trim()).context("the leases to check")?;
    let mut pattern = 0u64;
    let mut verdict = Ok(());
    for h in &regions {
        let RankId::Decode(d) = h.rank else { continue };
        let mine: Vec<_> = leases.iter().filter(|l| l.1 == d.tp).collect();
        let reqs: Vec<(OracleRequest, Placement)> =
            mine.iter().map(|(id, _, blocks, slot)| (OracleRequest { id: *id, tokens: job.tokens }, Placement { blocks, slot: *slot })).collect();
        match t.read_region(h, |b| oracle::check_consumer(&topo, d, h.kind, units[&(h.rank, h.kind)], &reqs, b))? {
            Ok(stats) => pattern += stats.pattern_bytes,
            Err(e) => {
                verdict = Err(format!("{h}: {e}"));
                break;
            }
        }
    }
    match verdict {
        Ok(()) => writeln!(out, "checked {pattern}")?,
        Err(e) => writeln!(out, "wrong {e}")?,
    }
    out.flush()?;
    Ok(())
}
