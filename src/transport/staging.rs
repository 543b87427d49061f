//! Staging for the DCP relayout: gather strided pieces into contiguous runs.
//!
//! Token-interleaved DCP scatters one destination's rows over the source (every
//! DCP-th group of S tokens), so a per-row plan has one tiny descriptor per token.
//! [`gather_runs`] groups pieces whose destinations are contiguous into runs; a run
//! fed by several source pieces is first copied into a registered staging buffer
//! from a bounded [`StagingPool`], then written as one contiguous descriptor. The
//! [`Stager`] caps descriptors per batch (`transport.max_batch`), keeps the pool's
//! buffers in flight, and retries transient failures with exponential backoff.
//!
//! The planner's staged groups ([`StagedRows`], rows whose producer and consumer
//! blocks do not line up) run through the same pool: [`Stager::transfer_staged`]
//! gathers each write's rows into one buffer (contiguous reads), writes the buffer
//! as one batch whose descriptors land the rows in the consumer's blocks, and
//! waits for a buffer when the pool is out, however long, instead of failing.

use super::{RegionHandle, RemoteRegion, Result, Side, Transport, TransportError, TransportExt, validate};
use crate::base::lock;
use handoff_components::config::TransportConfig;
use handoff_components::plan::{Descriptor, StagedError, StagedRows, StagedWrite};
use handoff_components::vocab::{RankId, RegionKind};
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A fixed set of registered staging buffers. Never grows: when all are out,
/// [`StagingPool::acquire`] waits, then fails with [`TransportError::PoolExhausted`].
pub struct StagingPool {
    transport: Arc<dyn Transport>,
    free: Mutex<Vec<RegionHandle>>,
    cv: Condvar,
    buffers: u32,
    bytes: u64,
}

/// One borrowed staging buffer; returned to its pool on drop.
pub struct StagingBuffer<'a> {
    pool: &'a StagingPool,
    handle: Option<RegionHandle>,
}

impl StagingBuffer<'_> {
    /// The buffer's region handle (a local region of the pool's transport).
    pub fn handle(&self) -> &RegionHandle {
        self.handle.as_ref().unwrap_or_else(|| unreachable!("handle taken only on drop"))
    }
    pub fn len(&self) -> u64 {
        self.pool.bytes
    }
    pub fn is_empty(&self) -> bool {
        self.pool.bytes == 0
    }
}

impl Drop for StagingBuffer<'_> {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            lock(&self.pool.free).push(h);
            self.pool.cv.notify_one();
        }
    }
}

impl StagingPool {
    /// Registers `buffers` regions of `bytes` each on `transport`, for `rank`.
    pub fn new(transport: Arc<dyn Transport>, rank: RankId, kind: RegionKind, buffers: u32, bytes: u64) -> Result<Self> {
        if buffers == 0 || bytes == 0 {
            return Err(TransportError::Unavailable {
                what: "staging pool".into(),
                reason: format!("needs at least one buffer of at least one byte (got {buffers} x {bytes} B)"),
            });
        }
        let mut free = Vec::with_capacity(buffers as usize);
        for _ in 0..buffers {
            free.push(transport.register(rank, kind, bytes)?);
        }
        Ok(StagingPool { transport, free: Mutex::new(free), cv: Condvar::new(), buffers, bytes })
    }

    /// The pool that `transport.staging_buffers` x `transport.staging_bytes` configure.
    pub fn from_config(transport: Arc<dyn Transport>, rank: RankId, kind: RegionKind, cfg: &TransportConfig) -> Result<Self> {
        Self::new(transport, rank, kind, cfg.staging_buffers, cfg.staging_bytes)
    }

    pub fn buffer_bytes(&self) -> u64 {
        self.bytes
    }
    pub fn buffers(&self) -> u32 {
        self.buffers
    }
    /// Buffers not lent out now.
    pub fn available(&self) -> usize {
        lock(&self.free).len()
    }

    pub fn try_acquire(&self) -> Option<StagingBuffer<'_>> {
        lock(&self.free).pop().map(|h| StagingBuffer { pool: self, handle: Some(h) })
    }

    /// Waits up to `timeout` for a free buffer.
    pub fn acquire(&self, timeout: Duration) -> Result<StagingBuffer<'_>> {
        let deadline = Instant::now() + timeout;
        let mut free = lock(&self.free);
        loop {
            if let Some(h) = free.pop() {
                return Ok(StagingBuffer { pool: self, handle: Some(h) });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TransportError::PoolExhausted { buffers: self.buffers, bytes: self.bytes, waited: timeout });
            }
            free = match self.cv.wait_timeout(free, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

impl StagingPool {
    /// Waits for a free buffer for as long as it takes, and says whether it had to:
    /// a staged write that cannot get staging waits and is never refused for it
    /// (issue 21). Every lent buffer comes back when the batch that holds it
    /// completes or fails, each of those waits bounded, so this wait ends too;
    /// `patience` only spaces the log lines that say it is still waiting.
    pub fn acquire_waiting(&self, patience: Duration) -> (StagingBuffer<'_>, bool) {
        let mut waited = false;
        let mut free = lock(&self.free);
        loop {
            if let Some(h) = free.pop() {
                return (StagingBuffer { pool: self, handle: Some(h) }, waited);
            }
            waited = true;
            let (guard, timed_out) = match self.cv.wait_timeout(free, patience.max(Duration::from_millis(1))) {
                Ok((g, t)) => (g, t.timed_out()),
                Err(p) => {
                    let (g, t) = p.into_inner();
                    (g, t.timed_out())
                }
            };
            free = guard;
            if timed_out {
                tracing::info!(buffers = self.buffers, bytes = self.bytes, ?patience, "staging: still waiting for a buffer");
            }
        }
    }
}

impl Drop for StagingPool {
    fn drop(&mut self) {
        for h in lock(&self.free).drain(..) {
            let _ = self.transport.unregister(&h);
        }
    }
}

/// One contiguous destination range and, in order, the source pieces that fill it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatherRun {
    pub kind: RegionKind,
    pub dst_offset: u64,
    pub len: u64,
    /// (source offset, bytes); their bytes add up to `len`.
    pub sources: Vec<(u64, u64)>,
}

impl GatherRun {
    /// A run that is one contiguous source range needs no staging.
    pub fn is_direct(&self) -> bool {
        self.sources.len() == 1
    }
}

/// Groups the pieces of a batch, in order, into runs of contiguous destination
/// bytes of at most `max_run` bytes, merging adjacent source pieces as it goes.
/// Writing the runs in order writes what the descriptors write, provided no two
/// pieces' destinations overlap (plans never overlap).
pub fn gather_runs(descriptors: &[Descriptor], max_run: u64) -> Vec<GatherRun> {
    let max_run = max_run.max(1);
    let mut runs: Vec<GatherRun> = Vec::new();
    for d in descriptors {
        if d.len == 0 {
            continue;
        }
        for (mut src, mut dst) in d.pieces() {
            let mut left = d.len;
            while left > 0 {
                let extend = runs.last().is_some_and(|r| r.kind == d.kind && r.dst_offset + r.len == dst && r.len < max_run);
                if !extend {
                    runs.push(GatherRun { kind: d.kind, dst_offset: dst, len: 0, sources: Vec::new() });
                }
                let Some(run) = runs.last_mut() else { break };
                let take = left.min(max_run - run.len);
                match run.sources.last_mut() {
                    Some((s, n)) if *s + *n == src => *n += take,
                    _ => run.sources.push((src, take)),
                }
                run.len += take;
                src += take;
                dst += take;
                left -= take;
            }
        }
    }
    runs
}

/// Bounded retries with exponential backoff, for transient errors only.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    /// Tries in all, the first included (at least 1).
    pub attempts: u32,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy { attempts: 4, initial_backoff: Duration::from_millis(10), max_backoff: Duration::from_secs(1) }
    }
}

impl RetryPolicy {
    /// Runs `f` until it succeeds, fails with a non-transient error, or the attempts
    /// are spent (then [`TransportError::RetriesExhausted`] with the last error).
    pub fn run<T>(&self, mut f: impl FnMut(u32) -> Result<T>) -> Result<T> {
        let attempts = self.attempts.max(1);
        let mut backoff = self.initial_backoff;
        let mut attempt = 0;
        loop {
            attempt += 1;
            match f(attempt) {
                Ok(v) => return Ok(v),
                Err(e) if !e.is_transient() => return Err(e),
                Err(e) if attempt >= attempts => {
                    return Err(TransportError::RetriesExhausted { attempts, last: Box::new(e) });
                }
                Err(e) => {
                    tracing::debug!(attempt, error = %e, ?backoff, "transport: retrying");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(self.max_backoff);
                }
            }
        }
    }
}

/// What a staged transfer did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StagedStats {
    /// Descriptors given, and contiguous pieces they expand to.
    pub descriptors_in: usize,
    pub pieces: u64,
    /// Descriptors actually written (one per run).
    pub descriptors_out: usize,
    /// Runs written straight from the source, and through staging.
    pub direct_runs: usize,
    pub staged_runs: usize,
    pub staged_bytes: u64,
    pub batches: usize,
    pub bytes: u64,
}

/// What [`Stager::transfer_staged`] did with one staged group.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StagedGroupStats {
    /// Writes in the group, and buffers written (more when a write was cut for a
    /// larger buffer than this pool's).
    pub writes: usize,
    pub buffers: usize,
    /// Contiguous reads into staging, and landing descriptors out of it.
    pub gather_pieces: u64,
    pub landing_descriptors: u64,
    pub batches: usize,
    pub bytes: u64,
    /// Buffers that had to be waited for (the pool was out).
    pub waits: usize,
}

/// One staging buffer of a staged group in flight: its landing batches (more than
/// one only past `max_batch` landing descriptors) and the buffer they read.
struct GroupInFlight<'a> {
    buf: StagingBuffer<'a>,
    batches: Vec<(Vec<Descriptor>, Result<super::BatchId>)>,
}

/// A staged batch in flight: its buffer stays borrowed until the batch is done.
struct InFlight<'a> {
    buf: StagingBuffer<'a>,
    descs: Vec<Descriptor>,
    batch: Result<super::BatchId>,
}

/// Writes descriptor batches through gather + staging, capped and retried.
pub struct Stager {
    transport: Arc<dyn Transport>,
    pool: StagingPool,
    max_batch: usize,
    retry: RetryPolicy,
    timeout: Duration,
}

impl Stager {
    /// `timeout` bounds each wait: for a batch's completion and for a staging buffer.
    pub fn new(transport: Arc<dyn Transport>, pool: StagingPool, max_batch: u32, retry: RetryPolicy, timeout: Duration) -> Self {
        Stager { transport, pool, max_batch: max_batch.max(1) as usize, retry, timeout }
    }

    pub fn pool(&self) -> &StagingPool {
        &self.pool
    }

    /// Submits `descriptors` in batches of at most `max_batch`, each waited and retried.
    fn write_batches(&self, src: &RegionHandle, dst: RemoteRegion, descriptors: &[Descriptor], stats: &mut StagedStats) -> Result<()> {
        for chunk in descriptors.chunks(self.max_batch) {
            self.retry.run(|_| self.transport.transfer(src, dst, chunk, self.timeout))?;
            stats.batches += 1;
        }
        Ok(())
    }

    /// Copies a group of staged runs from `src` into `buf`, returning their descriptors.
    fn fill(&self, src: &RegionHandle, buf: &StagingBuffer<'_>, runs: &[&GatherRun]) -> Result<Vec<Descriptor>> {
        let mut out = Vec::with_capacity(runs.len());
        let mut at = 0;
        for r in runs {
            out.push(Descriptor::copy(r.kind, at, r.dst_offset, r.len));
            at += r.len;
        }
        let t = &self.transport;
        let mut inner = Ok(());
        t.with_region(src, &mut |s| {
            inner = t.with_region_mut(buf.handle(), &mut |stage| {
                let mut at = 0usize;
                for r in runs {
                    for &(off, n) in &r.sources {
                        let (off, n) = (off as usize, n as usize);
                        stage[at..at + n].copy_from_slice(&s[off..off + n]);
                        at += n;
                    }
                }
            });
        })?;
        inner?;
        Ok(out)
    }

    /// Writes `descriptors` from local `src` into attached `dst`. Validates the whole
    /// batch first: a bad descriptor moves nothing.
    pub fn transfer(&self, src: &RegionHandle, dst: RemoteRegion, descriptors: &[Descriptor]) -> Result<StagedStats> {
        validate(descriptors, Some(src.len), dst.len, dst.kind)?;
        let runs = gather_runs(descriptors, self.pool.bytes);
        let mut stats = StagedStats {
            descriptors_in: descriptors.len(),
            pieces: descriptors.iter().filter(|d| d.len > 0).map(|d| d.count as u64).sum(),
            descriptors_out: runs.len(),
            bytes: descriptors.iter().map(Descriptor::bytes).sum(),
            ..StagedStats::default()
        };
        let direct: Vec<Descriptor> = runs.iter().filter(|r| r.is_direct()).map(|r| Descriptor::copy(r.kind, r.sources[0].0, r.dst_offset, r.len)).collect();
        stats.direct_runs = direct.len();
        self.write_batches(src, dst, &direct, &mut stats)?;

        // Staged runs, packed into buffers; up to the pool's size in flight.
        let staged: Vec<&GatherRun> = runs.iter().filter(|r| !r.is_direct()).collect();
        stats.staged_runs = staged.len();
        let mut in_flight: VecDeque<InFlight<'_>> = VecDeque::new();
        let mut i = 0;
        while i < staged.len() {
            let mut end = i;
            let mut bytes = 0;
            while end < staged.len() && bytes + staged[end].len <= self.pool.bytes && end - i < self.max_batch {
                bytes += staged[end].len;
                end += 1;
            }
            let buf = match self.pool.try_acquire() {
                Some(b) => b,
                None => match in_flight.pop_front() {
                    Some(done) => {
                        self.finish(dst, done, &mut stats)?;
                        self.pool.acquire(self.timeout)?
                    }
                    None => self.pool.acquire(self.timeout)?,
                },
            };
            let descs = self.fill(src, &buf, &staged[i..end])?;
            stats.staged_bytes += bytes;
            // A submit that failed at once is retried (if transient) in `finish`.
            let batch = self.transport.submit(buf.handle(), dst, &descs);
            in_flight.push_back(InFlight { buf, descs, batch });
            i = end;
        }
        while let Some(done) = in_flight.pop_front() {
            self.finish(dst, done, &mut stats)?;
        }
        Ok(stats)
    }

    /// Writes one staged group from local `src` into attached `dst`: each write's
    /// rows are gathered into a buffer of the pool, written as one batch whose
    /// descriptors land them in the consumer's blocks, with up to the pool's
    /// buffers in flight. A write larger than this pool's buffers is cut to fit.
    /// The group and its block tables are checked against both regions first: a
    /// bad group moves nothing. With every buffer out, it waits for one
    /// ([`StagingPool::acquire_waiting`]) rather than fail.
    pub fn transfer_staged(&self, src: &RegionHandle, dst: RemoteRegion, group: &StagedRows) -> Result<StagedGroupStats> {
        group.check()?;
        let kind = group.kind;
        for (side, end, len, region) in [(Side::Src, group.src_end()?, src.len, src.kind), (Side::Dst, group.dst_end()?, dst.len, dst.kind)] {
            if end > len || region != kind {
                return Err(TransportError::StagedOutOfBounds { kind, side, end, len, region });
            }
        }
        let tb = group.token_bytes;
        let per = self.pool.bytes / tb;
        if per == 0 {
            return Err(StagedError::TooLarge { kind, index: 0, bytes: tb, staging: self.pool.bytes }.into());
        }
        let mut stats = StagedGroupStats { writes: group.writes.len(), ..StagedGroupStats::default() };
        let mut in_flight: VecDeque<GroupInFlight<'_>> = VecDeque::new();
        let mut failed = None;
        'writes: for w in &group.writes {
            let mut start = w.start;
            while start < w.end {
                let part = StagedWrite { row: w.row, start, end: (start + per).min(w.end) };
                let buf = match self.pool.try_acquire() {
                    Some(b) => b,
                    None => {
                        // Our own oldest buffer first: waiting on the pool while
                        // holding buffers we could free would wait on ourselves.
                        if let Some(done) = in_flight.pop_front()
                            && let Err(e) = self.finish_group(dst, done, &mut stats)
                        {
                            failed = Some(e);
                            break 'writes;
                        }
                        let (b, waited) = self.pool.acquire_waiting(self.timeout);
                        stats.waits += usize::from(waited);
                        b
                    }
                };
                let landing = match self.gather(src, &buf, group, part, &mut stats) {
                    Ok(l) => l,
                    Err(e) => {
                        failed = Some(e);
                        break 'writes;
                    }
                };
                let batches = landing.chunks(self.max_batch).map(|c| (c.to_vec(), self.transport.submit(buf.handle(), dst, c))).collect();
                in_flight.push_back(GroupInFlight { buf, batches });
                stats.buffers += 1;
                stats.bytes += (part.end - part.start) * tb;
                start = part.end;
            }
        }
        // Every submitted batch is waited for, even after a failure, so that no
        // buffer goes back to the pool while a batch may still read it.
        while let Some(done) = in_flight.pop_front() {
            if let Err(e) = self.finish_group(dst, done, &mut stats) {
                failed.get_or_insert(e);
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(stats),
        }
    }

    /// Copies write `w`'s rows from `src` into `buf`, merging reads that continue
    /// each other, and returns the descriptors that land the buffer's bytes.
    fn gather(&self, src: &RegionHandle, buf: &StagingBuffer<'_>, group: &StagedRows, w: StagedWrite, stats: &mut StagedGroupStats) -> Result<Vec<Descriptor>> {
        let kind = group.kind;
        let mut landing: Vec<Descriptor> = Vec::new();
        let mut reads = 0u64;
        let t = &self.transport;
        let mut inner = Ok(());
        t.with_region(src, &mut |s| {
            inner = t.with_region_mut(buf.handle(), &mut |stage| {
                // The read being extended: (source offset, staging offset, bytes).
                let mut read: Option<(u64, u64, u64)> = None;
                let mut flush = |r: (u64, u64, u64)| {
                    let (a, b, n) = (r.0 as usize, r.1 as usize, r.2 as usize);
                    stage[b..b + n].copy_from_slice(&s[a..a + n]);
                };
                for p in group.pieces(w) {
                    match &mut read {
                        Some(r) if r.0 + r.2 == p.src && r.1 + r.2 == p.stage => r.2 += p.len,
                        _ => {
                            if let Some(r) = read.replace((p.src, p.stage, p.len)) {
                                flush(r);
                                reads += 1;
                            }
                        }
                    }
                    match landing.last_mut() {
                        Some(d) if d.src_offset + d.len == p.stage && d.dst_offset + d.len == p.dst => d.len += p.len,
                        _ => landing.push(Descriptor::copy(kind, p.stage, p.dst, p.len)),
                    }
                }
                if let Some(r) = read {
                    flush(r);
                    reads += 1;
                }
            });
        })?;
        inner?;
        stats.gather_pieces += reads;
        stats.landing_descriptors += landing.len() as u64;
        Ok(landing)
    }

    /// Waits for one buffer's landing batches, rewriting a transiently failed one
    /// from the still-held buffer (the same bytes to the same place).
    fn finish_group(&self, dst: RemoteRegion, GroupInFlight { buf, batches }: GroupInFlight<'_>, stats: &mut StagedGroupStats) -> Result<()> {
        let mut first = Ok(());
        for (descs, batch) in batches {
            let r = match batch.and_then(|b| self.transport.wait(b, self.timeout)) {
                Err(e) if e.is_transient() && self.retry.attempts > 1 && first.is_ok() => {
                    let retry = RetryPolicy { attempts: self.retry.attempts - 1, ..self.retry };
                    retry.run(|_| self.transport.transfer(buf.handle(), dst, &descs, self.timeout))
                }
                r => r,
            };
            match r {
                Ok(()) => stats.batches += 1,
                Err(e) => {
                    if first.is_ok() {
                        first = Err(e);
                    }
                }
            }
        }
        drop(buf);
        first
    }

    /// Waits for one staged batch; on a transient failure rewrites it from the
    /// still-held buffer (idempotent: the same bytes to the same place).
    fn finish(&self, dst: RemoteRegion, InFlight { buf, descs, batch }: InFlight<'_>, stats: &mut StagedStats) -> Result<()> {
        let first = batch.and_then(|b| self.transport.wait(b, self.timeout));
        match first {
            Ok(()) => stats.batches += 1,
            Err(e) if e.is_transient() && self.retry.attempts > 1 => {
                let retry = RetryPolicy { attempts: self.retry.attempts - 1, ..self.retry };
                retry.run(|_| self.transport.transfer(buf.handle(), dst, &descs, self.timeout))?;
                stats.batches += 1;
            }
            Err(e) => return Err(e),
        }
        drop(buf);
        Ok(())
    }
}
