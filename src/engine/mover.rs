//! The engine's mover over a [`Transport`], and in-process clusters built on it.
//!
//! [`TransportMover`] implements systems' [`Mover`]: it knows, for every
//! (rank, region kind), the local source region of a producer and the attached
//! region of a consumer (from the handle the consumer published), and turns one
//! plan into descriptor batches on the transport. A plan runs on a worker thread
//! (the engine's systems never block on I/O); its batches are capped at
//! `transport.max_batch` descriptors, transient failures are retried with backoff,
//! and only when **every** batch of the plan has completed does the ticket come
//! back from [`Mover::poll`], once, as `Ok` or as `Err(reason)`.
//!
//! Token-sharded rows (MLA KV, indexer) under token-interleaved DCP are scattered
//! at the source: [`StagingMode`] decides whether they go through
//! [`Stager`] (gather one destination's rows into contiguous staging, write runs) or
//! are written as strided descriptors. Staging pays one extra copy to turn many
//! descriptors into few; it pays off where a descriptor costs a work request or a
//! wire header (tcp, rdma), not where the transport is itself a memcpy (local, shm,
//! and cuda-ipc, whose strided descriptors are single 2D device copies),
//! so [`StagingMode::Auto`] stages only on the former.
//!
//! The planner's staged groups ([`Plan::staged`]: rows whose producer and consumer
//! blocks do not line up) run through the same [`Stager`], one group at a time
//! ([`Stager::transfer_staged`]: contiguous reads into a buffer of the pool, one
//! write a buffer, landing descriptors into the consumer's blocks; a write waits
//! for a buffer rather than fail). The mover says so to the planner through
//! [`Mover::staging_bytes`] on the transports whose regions are host memory it
//! can gather from (local, shm, tcp). The device transport (cuda-ipc) only queues
//! descriptors as device copies and has no gather into a registered device
//! buffer, so its mover keeps `None` and the planner gives it descriptors.
//!
//! Like the transports, a mover knows regions and descriptors: a [`Ticket`] is opaque
//! to it, something to hand back.

use super::Engine;
use crate::base::lock;
use crate::transport::staging::{RetryPolicy, Stager, StagingPool};
use crate::transport::{self, BatchId, RegionHandle, RemoteRegion, Transport, TransportError};
use handoff_components::config::{Topology, TransportKind};
use handoff_components::plan::{Descriptor, Plan};
use handoff_components::vocab::{Distribution, LayerMark, RankId, RegionKind};
use handoff_kernels::StreamMark;
use handoff_systems::placement::Capacity;
use handoff_systems::transfer::{MoveError, Mover, PlanCompletion, Ticket};
use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Whether token-sharded rows are gathered through staging before they are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StagingMode {
    /// Stage where a piece is a message (tcp, rdma, ucx over the network); write
    /// strided descriptors directly where the transport stores into a mapping
    /// (local, shm, cuda-ipc, ucx over shared memory):
    /// [`Transport::writes_in_place`].
    #[default]
    Auto,
    Always,
    Never,
}

/// Settings of a [`TransportMover`].
#[derive(Debug, Clone)]
pub struct MoverOptions {
    /// Most descriptors in one submitted batch.
    pub max_batch: u32,
    pub staging_buffers: u32,
    pub staging_bytes: u64,
    pub staging: StagingMode,
    pub retry: RetryPolicy,
    /// Bound on each wait: for one batch's completion, for a staging buffer.
    pub batch_timeout: Duration,
    /// Plans run concurrently on this many worker threads.
    pub workers: usize,
}

impl Default for MoverOptions {
    fn default() -> Self {
        let cfg = handoff_components::config::TransportConfig::default();
        MoverOptions {
            max_batch: cfg.max_batch,
            staging_buffers: cfg.staging_buffers,
            staging_bytes: cfg.staging_bytes,
            staging: StagingMode::Auto,
            retry: RetryPolicy::default(),
            batch_timeout: Duration::from_secs(30),
            workers: 2,
        }
    }
}

impl MoverOptions {
    /// The `[transport]` section's batch cap and staging pool; each batch waits at
    /// most the transfer timeout.
    pub fn from_topology(topo: &Topology) -> Self {
        let t = &topo.config.transport;
        MoverOptions {
            max_batch: t.max_batch,
            staging_buffers: t.staging_buffers,
            staging_bytes: t.staging_bytes,
            batch_timeout: Duration::from_secs_f64(topo.config.timeouts.transfer_s.clamp(0.001, 3600.0)),
            ..MoverOptions::default()
        }
    }
}

/// Tickets in flight and completions not yet polled.
#[derive(Default)]
struct Book {
    in_flight: HashMap<Ticket, Instant>,
    done: Vec<PlanCompletion>,
}

struct Shared {
    transport: Arc<dyn Transport>,
    opts: MoverOptions,
    /// Shared, so that a plan's writes hold their source without cloning a handle.
    sources: RwLock<HashMap<(RankId, RegionKind), Arc<RegionHandle>>>,
    targets: RwLock<HashMap<(RankId, RegionKind), RemoteRegion>>,
    /// The handle each target was attached from (a restarted consumer publishes new ones).
    attached: RwLock<HashMap<(RankId, RegionKind), RegionHandle>>,
    /// Created on first use: a mover that never stages registers no staging pool.
    stager: OnceLock<Result<Stager, TransportError>>,
    book: Mutex<Book>,
    idle: Condvar,
    /// How long waits poll before they sleep: [`crate::base::SPIN`] where the
    /// transport's waits are polled ([`Transport::polls_waits`]), else zero.
    spin: Duration,
}

/// A cheap handle on a [`TransportMover`]'s bookkeeping, usable after the mover
/// itself was boxed into an engine.
#[derive(Clone)]
pub struct MoverHandle {
    shared: Arc<Shared>,
}

impl MoverHandle {
    /// Registers a local producer region as the source of its (rank, kind).
    pub fn add_source(&self, handle: RegionHandle) {
        transport::write(&self.shared.sources).insert((handle.rank, handle.kind), Arc::new(handle));
    }

    /// Attaches a consumer's published region as the destination of its (rank, kind).
    pub fn attach_target(&self, handle: &RegionHandle) -> Result<RemoteRegion, TransportError> {
        let remote = self.shared.transport.attach(handle)?;
        let replaced = transport::write(&self.shared.targets).insert((handle.rank, handle.kind), remote);
        if let Some(old) = replaced.filter(|&old| old != remote) {
            self.shared.transport.detach(old);
        }
        transport::write(&self.shared.attached).insert((handle.rank, handle.kind), handle.clone());
        Ok(remote)
    }

    /// Whether a consumer's region is attached already, as this handle names it.
    pub fn attached(&self, handle: &RegionHandle) -> bool {
        transport::read(&self.shared.attached).get(&(handle.rank, handle.kind)) == Some(handle)
    }

    /// Tickets submitted whose completion has not been produced yet.
    pub fn in_flight(&self) -> usize {
        lock(&self.shared.book).in_flight.len()
    }

    /// Completions produced and not yet taken by `poll`.
    pub fn unpolled(&self) -> usize {
        lock(&self.shared.book).done.len()
    }

    /// Waits until no ticket is in flight (its completion may still be unpolled).
    /// Returns whether that happened within `timeout`.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        crate::base::wait_until(&self.shared.book, &self.shared.idle, Instant::now() + timeout, self.shared.spin, |b| b.in_flight.is_empty()).1
    }

    /// Waits until a completion is ready to poll, or nothing is in flight, or
    /// `timeout` has passed.
    pub fn wait_completion(&self, timeout: Duration) {
        let _ = crate::base::wait_until(&self.shared.book, &self.shared.idle, Instant::now() + timeout, self.shared.spin, |b| {
            !b.done.is_empty() || b.in_flight.is_empty()
        });
    }

    /// The transport the mover writes through.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.shared.transport
    }
}

/// One plan, queued for a worker.
struct Job {
    ticket: Ticket,
    plan: Plan,
    /// The device mark its writes wait on (layer-wise streaming on a GPU).
    after: Option<LayerMark>,
}

/// Implements [`Mover`] over a [`Transport`]. See the module docs.
pub struct TransportMover {
    shared: Arc<Shared>,
    jobs: Option<mpsc::Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
}

impl TransportMover {
    /// A mover writing through `transport`, with no regions known yet.
    pub fn new(transport: Arc<dyn Transport>, opts: MoverOptions) -> Result<Self, TransportError> {
        let transport_polls = transport.polls_waits();
        let shared = Arc::new(Shared {
            transport,
            opts: MoverOptions { workers: opts.workers.max(1), max_batch: opts.max_batch.max(1), ..opts },
            sources: RwLock::new(HashMap::new()),
            targets: RwLock::new(HashMap::new()),
            attached: RwLock::new(HashMap::new()),
            stager: OnceLock::new(),
            book: Mutex::new(Book::default()),
            idle: Condvar::new(),
            spin: if transport_polls { crate::base::SPIN } else { Duration::ZERO },
        });
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let mut workers = Vec::new();
        for i in 0..shared.opts.workers {
            let (s, rx) = (Arc::clone(&shared), Arc::clone(&rx));
            let spawned = std::thread::Builder::new().name(format!("mover-{i}")).spawn(move || worker(&s, &rx));
            workers.push(spawned.map_err(|e| TransportError::io("spawn mover worker", e))?);
        }
        Ok(TransportMover { shared, jobs: Some(tx), workers })
    }

    /// Registers a local producer region as the source of its (rank, kind).
    pub fn add_source(&self, handle: RegionHandle) {
        self.handle().add_source(handle);
    }

    /// Attaches a consumer's published region as the destination of its (rank, kind).
    pub fn attach_target(&self, handle: &RegionHandle) -> Result<RemoteRegion, TransportError> {
        self.handle().attach_target(handle)
    }

    pub fn handle(&self) -> MoverHandle {
        MoverHandle { shared: Arc::clone(&self.shared) }
    }
}

impl Drop for TransportMover {
    fn drop(&mut self) {
        // Closing the queue ends the workers once they finish what they hold.
        self.jobs.take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl Mover for TransportMover {
    fn submit(&mut self, ticket: Ticket, plan: &Plan) -> Result<(), MoveError> {
        self.submit_after(ticket, plan, None)
    }

    /// The plan's writes are queued by a worker, after the host has moved on:
    /// the mark goes with the job, and the transport's copies wait on it on
    /// the device ([`Transport::submit_all_after`]).
    fn submit_after(&mut self, ticket: Ticket, plan: &Plan, after: Option<LayerMark>) -> Result<(), MoveError> {
        if after.is_some() && !self.takes_marks() {
            return Err(MoveError::MarksUnsupported);
        }
        // Refuse at once what no worker could run: a region the mover does not know,
        // staged groups on a transport that cannot gather them.
        if !plan.staged.is_empty() && self.staging_bytes().is_none() {
            return Err(MoveError::StagingUnsupported { groups: plan.staged.len() });
        }
        check_regions(&self.shared, plan)?;
        {
            let mut book = lock(&self.shared.book);
            if book.in_flight.contains_key(&ticket) {
                return Err(MoveError::AlreadyInFlight(ticket.request));
            }
            book.in_flight.insert(ticket, Instant::now());
        }
        let sent = self.jobs.as_ref().is_some_and(|tx| tx.send(Job { ticket, plan: plan.clone(), after }).is_ok());
        if !sent {
            lock(&self.shared.book).in_flight.remove(&ticket);
            self.shared.idle.notify_all();
            return Err(MoveError::Stopped);
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<PlanCompletion>) {
        out.append(&mut lock(&self.shared.book).done);
    }

    /// Where the transport's writes are device copies that can wait on a
    /// mark (the device transport), and no row is gathered through host
    /// staging first (a host read would not wait for the mark).
    fn takes_marks(&self) -> bool {
        self.shared.transport.takes_marks() && self.shared.opts.staging != StagingMode::Always
    }

    /// The `[transport]` staging buffer's bytes where the transport's regions are
    /// host memory the stager gathers from (local, shm, tcp); `None` on the device
    /// transport (see the module docs) and for a pool of no buffer or no byte.
    fn staging_bytes(&self) -> Option<u64> {
        let o = &self.shared.opts;
        (runs_staged(self.shared.transport.name()) && o.staging_buffers > 0 && o.staging_bytes > 0).then_some(o.staging_bytes)
    }
}

/// Whether a transport of this name runs staged groups: its regions are host
/// memory that [`Stager::transfer_staged`] gathers from. The device transport's
/// regions are device memory, reached from the host only by copying a whole region
/// out and back; rdma is a stub.
fn runs_staged(transport: &str) -> bool {
    matches!(transport, "local" | "shm" | "tcp" | "ucx")
}

/// How long a worker that has queued some plans waits for the next one to
/// arrive before it waits for their copies, where the transport's waits are
/// polled (see [`worker`]).
const GATHER_QUIET: Duration = Duration::from_micros(20);

/// Plans a worker queues at most before it waits for them and reports (a
/// flagship pass: 64): under a steady stream of plans it must still report,
/// and the other workers take what arrives meanwhile.
const PLANS_PER_ROUND: usize = 64;

/// The next job: polled (yielding) for `spin` first, since a sleeping
/// worker's wake-up costs more than a pass's planning on a loaded host, then
/// waited for; None once the mover is dropped.
fn next_job(rx: &mpsc::Receiver<Job>, spin: Duration) -> Option<Job> {
    let until = Instant::now() + spin;
    while Instant::now() < until {
        match rx.try_recv() {
            Ok(j) => return Some(j),
            Err(mpsc::TryRecvError::Empty) => std::thread::yield_now(),
            Err(mpsc::TryRecvError::Disconnected) => return None,
        }
    }
    rx.recv().ok()
}

/// Takes the jobs queued now into `jobs`, up to `group` in all; with
/// `quiet`, waits that long for the first one if none is queued. Returns
/// false once the mover is dropped.
fn take_queued(rx: &mpsc::Receiver<Job>, jobs: &mut Vec<Job>, group: usize, quiet: Duration) -> bool {
    let since = Instant::now();
    while jobs.len() < group {
        match rx.try_recv() {
            Ok(j) => jobs.push(j),
            Err(mpsc::TryRecvError::Empty) if jobs.is_empty() && since.elapsed() < quiet => std::thread::yield_now(),
            Err(mpsc::TryRecvError::Empty) => break,
            Err(mpsc::TryRecvError::Disconnected) => return false,
        }
    }
    true
}

/// A worker: takes the plans queued (a pass, a tick's requests arrive a few
/// microseconds apart), submits them a group at a time
/// ([`Transport::plans_per_submission`]; on a device the first plan alone
/// and groups doubling from there),
/// and takes the plans that arrived
/// meanwhile as the next group before it waits for any, so that an
/// asynchronous transport copies the first group while the host prepares
/// the next. Then (at the latest after [`PLANS_PER_ROUND`] plans) it waits
/// for every group in turn and reports its plans.
fn worker(shared: &Shared, rx: &Mutex<mpsc::Receiver<Job>>) {
    let group = shared.transport.plans_per_submission().max(1);
    let quiet = if shared.spin.is_zero() || group == 1 { Duration::ZERO } else { GATHER_QUIET };
    let async_copies = shared.transport.polls_waits() && group > 1;
    // A transport that takes one plan a submission (tcp writes it in the
    // caller) runs one plan a round: the other workers write the next ones
    // meanwhile, as they did before groups.
    let round = if group == 1 { 1 } else { PLANS_PER_ROUND };
    loop {
        let mut started: Vec<(Vec<Job>, Started)> = Vec::new();
        {
            let rx = lock(rx);
            let first = match next_job(&rx, shared.spin) {
                Some(j) => j,
                None => return,
            };
            // On an asynchronous transport (a device's copies) the round's
            // first plan goes alone and each group after it at most doubles
            // the one before, up to `group`: the device copies the first
            // plans while the host prepares the next ones, instead of idling
            // until a whole group is queued (on the H200 the first 7 plans of
            // a flagship pass reached the device 70 us into its 893 us; a
            // submission costs the host 10 to 25 us of driver calls and a
            // plan 3 to 4 us, where the device copies a flagship plan in 11
            // to 16 us). A transport that copies in `submit_all` (local,
            // shm) takes what is queued.
            let mut jobs = vec![first];
            let mut open = async_copies || take_queued(&rx, &mut jobs, group, Duration::ZERO);
            let mut taken = 0;
            while !jobs.is_empty() {
                taken += jobs.len();
                let size = jobs.len();
                let s = start_jobs(shared, &jobs);
                started.push((std::mem::take(&mut jobs), s));
                if !open || taken >= round {
                    break;
                }
                let next = if async_copies { group.min(2 * size) } else { group };
                open = take_queued(&rx, &mut jobs, next.min(round - taken), quiet);
            }
        }
        for (jobs, s) in started {
            let results = finish_plans(shared, s);
            let mut book = lock(&shared.book);
            for (job, result) in jobs.iter().zip(results) {
                let result = result.map_err(|e| MoveError::Transport(std::sync::Arc::new(e)));
                if let Err(reason) = &result {
                    tracing::warn!(request = job.ticket.request, %reason, "mover: plan failed");
                }
                book.in_flight.remove(&job.ticket);
                book.done.push(PlanCompletion { ticket: job.ticket, result });
            }
            drop(book);
            shared.idle.notify_all();
        }
    }
}

/// Starts a group of jobs: [`start_plans`] of their plans, after every mark
/// among them (a plan waiting on a later layer's mark too only waits longer).
fn start_jobs(shared: &Shared, jobs: &[Job]) -> Started {
    let _span = tracing::debug_span!(
        "mover.plans",
        plans = jobs.len(),
        request = jobs[0].ticket.request,
        pp = jobs[0].plan.producer.pp,
        tp = jobs[0].plan.producer.tp,
        consumer = jobs[0].plan.consumer.tp,
        bytes = jobs.iter().map(|j| j.plan.bytes()).sum::<u64>()
    )
    .entered();
    let plans: Vec<&Plan> = jobs.iter().map(|j| &j.plan).collect();
    let mut after: Vec<StreamMark> = jobs.iter().filter_map(|j| j.after).map(|m| StreamMark(m.0)).collect();
    after.sort_unstable();
    after.dedup();
    start_plans(shared, &plans, &after)
}

fn source_rank(plan: &Plan) -> RankId {
    RankId::Prefill(plan.producer)
}

fn target_rank(plan: &Plan) -> RankId {
    RankId::Decode(plan.consumer)
}

fn check_regions(shared: &Shared, plan: &Plan) -> Result<(), MoveError> {
    let sources = transport::read(&shared.sources);
    let targets = transport::read(&shared.targets);
    // Each kind once (a plan's descriptors come kind by kind).
    let mut kinds: Vec<RegionKind> = plan.descriptors.iter().map(|d| d.kind).chain(plan.staged.iter().map(|g| g.kind)).collect();
    kinds.sort_unstable();
    kinds.dedup();
    for kind in kinds {
        if !sources.contains_key(&(source_rank(plan), kind)) {
            return Err(MoveError::UnknownRegion { kind, rank: source_rank(plan), side: "source" });
        }
        if !targets.contains_key(&(target_rank(plan), kind)) {
            return Err(MoveError::UnknownRegion { kind, rank: target_rank(plan), side: "destination, not attached" });
        }
    }
    Ok(())
}

fn stages(shared: &Shared, kind: RegionKind, dst: RemoteRegion) -> bool {
    kind.distribution() == Distribution::TokenSharded
        && match shared.opts.staging {
            StagingMode::Always => true,
            StagingMode::Never => false,
            // Gathering narrow rows pays where each piece is a message; where
            // the transport stores into a mapping it is a second copy.
            StagingMode::Auto => !shared.transport.writes_in_place(dst),
        }
}

fn stager(shared: &Shared, rank: RankId) -> Result<&Stager, TransportError> {
    let made = shared.stager.get_or_init(|| {
        let o = &shared.opts;
        let pool = StagingPool::new(Arc::clone(&shared.transport), rank, RegionKind::MlaKv, o.staging_buffers, o.staging_bytes)?;
        Ok(Stager::new(Arc::clone(&shared.transport), pool, o.max_batch, o.retry, o.batch_timeout))
    });
    made.as_ref().map_err(Clone::clone)
}

/// A batch of direct writes: the plan it belongs to, source, destination and
/// descriptors.
type DirectWrite = (usize, Arc<RegionHandle>, RemoteRegion, Vec<Descriptor>);

/// A plan's writes of one kind: source, destination and descriptors.
type KindWrite = (Arc<RegionHandle>, RemoteRegion, Vec<Descriptor>);

/// Writes every descriptor of each plan, in two halves: this one, up to the
/// first wait, and [`finish_plans`], which returns once all batches
/// completed, one result per plan. Chunked plans, staged groups and the kinds
/// that stage run here to the end, through the stager, plan by plan; every
/// batch of the other kinds, of all the plans, is submitted here, before the
/// first wait, so an asynchronous transport (tcp, a GPU's copy queue) has all
/// of it in flight at once (and the worker can start the next group before
/// it waits for this one). A plan that fails fails alone: the other plans'
/// results are their own.
///
/// `after`: device marks every write waits on ([`Transport::submit_all_after`]).
fn start_plans(shared: &Shared, plans: &[&Plan], after: &[StreamMark]) -> Started {
    let mut results: Vec<Result<(), TransportError>> = plans.iter().map(|_| Ok(())).collect();
    let mut direct: Vec<DirectWrite> = Vec::new();
    for (i, plan) in plans.iter().enumerate() {
        if !plan.chunks.is_empty() {
            results[i] = run_chunks(shared, plan, after);
            continue;
        }
        match plan_writes(shared, plan, after) {
            Ok(w) => direct.extend(w.into_iter().map(|(src, dst, descs)| (i, src, dst, descs))),
            Err(e) => results[i] = Err(e),
        }
    }
    let submitted = submit_direct(shared, &direct, after);
    Started { results, direct, after: after.to_vec(), submitted }
}

/// Plans whose direct writes are queued and not yet waited for.
struct Started {
    results: Vec<Result<(), TransportError>>,
    direct: Vec<DirectWrite>,
    after: Vec<StreamMark>,
    submitted: Vec<Result<BatchId, TransportError>>,
}

/// The second half of [`start_plans`], from its first wait: every plan's result.
fn finish_plans(shared: &Shared, s: Started) -> Vec<Result<(), TransportError>> {
    let Started { mut results, direct, after, submitted } = s;
    for (i, e) in finish_direct(shared, &direct, &after, submitted) {
        if results[i].is_ok() {
            results[i] = Err(e);
        }
    }
    results
}

/// The source and the attached destination of one (plan, kind).
fn regions_of(shared: &Shared, plan: &Plan, kind: RegionKind) -> Result<(Arc<RegionHandle>, RemoteRegion), TransportError> {
    let src = transport::read(&shared.sources)
        .get(&(source_rank(plan), kind))
        .cloned()
        .ok_or_else(|| TransportError::UnknownRegion(format!("{kind} source of {}", source_rank(plan))))?;
    let dst = transport::read(&shared.targets)
        .get(&(target_rank(plan), kind))
        .copied()
        .ok_or_else(|| TransportError::UnknownRegion(format!("{kind} destination of {}", target_rank(plan))))?;
    Ok((src, dst))
}

/// A chunked plan ([`Plan::chunks`]): each chunk's writes complete before the
/// next chunk's start, so the rows land in token order and the state (in the
/// last chunk) after every row; staged groups, if any, go with the last chunk.
fn run_chunks(shared: &Shared, plan: &Plan, after: &[StreamMark]) -> Result<(), TransportError> {
    let chunks = plan.chunk_descriptors();
    let last = chunks.len().saturating_sub(1);
    for (k, descs) in chunks.into_iter().enumerate() {
        let staged = if k == last { plan.staged.clone() } else { Vec::new() };
        if descs.is_empty() && staged.is_empty() {
            continue;
        }
        let chunk = Plan {
            producer: plan.producer,
            consumer: plan.consumer,
            descriptors: descs.to_vec(),
            staged,
            uncoalesced: 0,
            chunks: Vec::new(),
            layers: Vec::new(),
        };
        let _span = tracing::trace_span!("mover.chunk", chunk = k, descriptors = chunk.descriptors.len(), bytes = chunk.bytes()).entered();
        let direct = plan_writes(shared, &chunk, after)?;
        let writes: Vec<DirectWrite> = direct.into_iter().map(|(src, dst, d)| (0, src, dst, d)).collect();
        if let Some((_, e)) = write_direct(shared, &writes, after).into_iter().next() {
            return Err(e);
        }
    }
    Ok(())
}

/// Resolves a plan's regions kind by kind, writes its staged groups and the kinds
/// that stage, and returns the direct writes of the others.
/// A host gather (staging) would read the source without waiting on `after`:
/// refused with marks (a mover that stages says it takes none).
fn plan_writes(shared: &Shared, plan: &Plan, after: &[StreamMark]) -> Result<Vec<KindWrite>, TransportError> {
    let unmarked = |what: &str| -> Result<(), TransportError> {
        if after.is_empty() {
            return Ok(());
        }
        Err(TransportError::Unavailable { what: format!("{what} after a layer mark"), reason: "a host gather does not wait on the device".into() })
    };
    if !plan.staged.is_empty() {
        unmarked("staged groups")?;
    }
    for group in &plan.staged {
        let (src, dst) = regions_of(shared, plan, group.kind)?;
        let st = stager(shared, source_rank(plan))?.transfer_staged(&src, dst, group)?;
        tracing::debug!(kind = %group.kind, writes = st.writes, buffers = st.buffers, landing = st.landing_descriptors, waits = st.waits, bytes = st.bytes, "mover: staged group");
    }
    // Descriptors of one kind share a source and a destination region.
    let mut by_kind: BTreeMap<RegionKind, Vec<Descriptor>> = BTreeMap::new();
    for d in &plan.descriptors {
        by_kind.entry(d.kind).or_default().push(*d);
    }
    let mut direct = Vec::new();
    for (kind, descs) in by_kind {
        let (src, dst) = regions_of(shared, plan, kind)?;
        if stages(shared, kind, dst) {
            unmarked("staged rows")?;
            stager(shared, source_rank(plan))?.transfer(&src, dst, &descs)?;
        } else {
            direct.push((src, dst, descs));
        }
    }
    Ok(direct)
}

/// Submits every batch of `writes` first (a remote or asynchronous transport
/// keeps them all in flight), then waits for each; a batch that failed
/// transiently is written again, with backoff. Returns the first error of
/// each plan that had one.
fn write_direct(shared: &Shared, writes: &[DirectWrite], after: &[StreamMark]) -> Vec<(usize, TransportError)> {
    let submitted = submit_direct(shared, writes, after);
    finish_direct(shared, writes, after, submitted)
}

/// The batches of `writes` (each cut at `max_batch` descriptors) in the
/// order [`finish_direct`] takes them.
fn direct_batches<'a>(shared: &Shared, writes: &'a [DirectWrite]) -> Vec<(usize, &'a RegionHandle, RemoteRegion, &'a [Descriptor])> {
    let max = shared.opts.max_batch as usize;
    writes.iter().flat_map(|(plan, src, dst, descs)| descs.chunks(max).map(move |c| (*plan, &**src, *dst, c))).collect()
}

/// Submits every batch of `writes` in one submission, without waiting.
fn submit_direct(shared: &Shared, writes: &[DirectWrite], after: &[StreamMark]) -> Vec<Result<BatchId, TransportError>> {
    let batches: Vec<(&RegionHandle, RemoteRegion, &[Descriptor])> = direct_batches(shared, writes).into_iter().map(|(_, s, d, c)| (s, d, c)).collect();
    shared.transport.submit_all_after(&batches, after)
}

/// Waits for the batches [`submit_direct`] queued for `writes` and writes a
/// batch that failed transiently again, with backoff. Returns the first error
/// of each plan that had one.
fn finish_direct(
    shared: &Shared,
    writes: &[DirectWrite],
    after: &[StreamMark],
    submitted: Vec<Result<BatchId, TransportError>>,
) -> Vec<(usize, TransportError)> {
    let o = &shared.opts;
    let t = &shared.transport;
    let chunks = direct_batches(shared, writes);
    // Every submitted batch is waited for, even after a failure, so none is
    // left in flight when the plan reports; all in one wait.
    let queued: Vec<BatchId> = submitted.iter().filter_map(|b| b.as_ref().ok().copied()).collect();
    let mut waited = t.wait_all(&queued, o.batch_timeout).into_iter();
    let outcomes: Vec<Result<(), TransportError>> =
        submitted.into_iter().map(|b| b.and_then(|id| waited.next().unwrap_or(Err(TransportError::UnknownBatch(id))))).collect();
    let mut errors: Vec<(usize, TransportError)> = Vec::new();
    for ((plan, src, dst, chunk), outcome) in chunks.into_iter().zip(outcomes) {
        let failed = errors.iter().any(|(p, _)| *p == plan);
        let r = match outcome {
            Ok(()) => Ok(()),
            Err(e) if !failed && e.is_transient() && o.retry.attempts > 1 => {
                tracing::debug!(error = %e, "mover: retrying a batch");
                std::thread::sleep(o.retry.initial_backoff);
                let again = RetryPolicy { attempts: o.retry.attempts - 1, ..o.retry };
                // Again after the marks: a batch refused before it was queued
                // never waited on them.
                again.run(|_| {
                    let b = t.submit_all_after(&[(src, dst, chunk)], after).pop().unwrap_or_else(|| Err(TransportError::UnknownRegion(src.to_string())));
                    b.and_then(|b| t.wait(b, o.batch_timeout))
                })
            }
            Err(e) => Err(e),
        };
        if let Err(e) = r
            && !failed
        {
            errors.push((plan, e));
        }
    }
    errors
}

// ---------------------------------------------------------------------------

/// Every region of a cluster, as registered: (rank, kind) to handle.
pub type RegionHandles = BTreeMap<(RankId, RegionKind), RegionHandle>;

/// What [`local_cluster`] built besides the engine.
pub struct LocalCluster {
    /// Every rank's regions, producer and consumer, registered in the transport.
    pub regions: RegionHandles,
    /// The engine's mover, for its bookkeeping.
    pub mover: MoverHandle,
}

/// Registers every region of the engine's world (sizes from its `Region` entities)
/// in `producer` (prefill ranks) or `consumer` (decode ranks), and a
/// [`TransportMover`] writing through `producer` that knows them all.
pub fn cluster_over(
    topo: &Topology,
    cap: Capacity,
    producer: Arc<dyn Transport>,
    consumer: Arc<dyn Transport>,
    opts: MoverOptions,
) -> Result<(Engine, LocalCluster), TransportError> {
    let mover = TransportMover::new(Arc::clone(&producer), opts)?;
    let handle = mover.handle();
    // The engine owns the mover; regions are added through `handle`'s shared state.
    let mut engine = Engine::new(topo.clone(), cap, Box::new(mover));
    let mut regions = RegionHandles::new();
    let wanted: Vec<(RankId, RegionKind, u64)> = engine.regions().into_iter().map(|r| (r.rank, r.layout.kind, r.layout.len)).collect();
    for (rank, kind, len) in wanted {
        let h = match rank {
            RankId::Prefill(_) => {
                let h = producer.register(rank, kind, len)?;
                handle.add_source(h.clone());
                h
            }
            RankId::Decode(_) => {
                let h = consumer.register(rank, kind, len)?;
                let remote = producer.attach(&h)?;
                transport::write(&handle.shared.targets).insert((rank, kind), remote);
                h
            }
        };
        regions.insert((rank, kind), h);
    }
    Ok((engine, LocalCluster { regions, mover: handle }))
}

/// An in-process engine whose regions live in one transport of `kind` (tcp: its
/// writes go over loopback to itself), with the `[transport]` settings of `topo`.
pub fn local_cluster(topo: &Topology, cap: Capacity, kind: TransportKind) -> Result<(Engine, Arc<dyn Transport>, LocalCluster), TransportError> {
    let t = transport::open(kind, None)?;
    let (engine, cluster) = cluster_over(topo, cap, Arc::clone(&t), Arc::clone(&t), MoverOptions::from_topology(topo))?;
    Ok((engine, t, cluster))
}
