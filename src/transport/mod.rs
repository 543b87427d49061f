//! Transports: one-sided writes of registered memory regions between ranks.
//!
//! A transport knows regions and descriptors, never requests (docs/design.md section 6). A
//! consumer rank registers a region and hands its [`RegionHandle`] (plain serde data)
//! to a producer, possibly in another process or on another host; the producer
//! [`Transport::attach`]es it and [`Transport::submit`]s descriptor batches that copy
//! from one of its own regions into the peer's. Completion is reported per batch;
//! small generic messages (write-done reports) travel with [`Transport::notify`].
//!
//! Backends: [`local`] (in-process, rayon), [`shm`] (shared memory between processes
//! on one host), [`device`] (device memory between processes of one GPU, CUDA IPC),
//! [`tcp`] (streams between hosts), [`ucx`] (UCX one-sided puts, between hosts
//! or on one; built with the `ucx` feature), [`rdma`] (ibverbs RDMA WRITE over RC
//! queue pairs, built with the `rdma` feature; not yet run on hardware). [`staging`] gathers strided batches into contiguous runs through
//! a bounded pool, and [`bench`](mod@bench)(mod@bench) measures transfers against this machine's memcpy.
//!
//! [`auth`] holds the cluster secret that every connection between the processes
//! of a deployment proves, the transports' and the roles' alike.
//!
//! Every descriptor is bounds-checked against both regions before any byte moves: an
//! out-of-range descriptor is a [`TransportError::OutOfBounds`], never a wild write.
//! Within one batch, copies have sequential semantics (descriptor order, piece order),
//! so a batch whose destinations overlap still yields what a naive loop yields.

pub mod auth;
pub mod bench;
pub(crate) mod copy;
pub mod device;
pub(crate) mod host;
pub mod local;
pub(crate) mod multicopy;
mod open;
pub mod rdma;
pub mod shm;
pub mod staging;
pub mod tcp;
pub mod ucx;

use handoff_components::plan::Descriptor;
use handoff_components::vocab::{RankId, RegionKind};
use handoff_kernels::StreamMark;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

pub use local::LocalTransport;
pub use open::{loopback_pair, loopback_pair_config, open, open_config, open_with};
pub use shm::ShmTransport;
pub use tcp::{TcpOptions, TcpTransport};
pub use ucx::{UcxOptions, UcxTransport};

/// Where a region's bytes live: host memory (local, shm, tcp), or the memory of
/// GPU `ordinal` ([`device::DeviceTransport`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum MemoryKind {
    #[default]
    Host,
    Device {
        ordinal: u32,
    },
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryKind::Host => f.write_str("host"),
            MemoryKind::Device { ordinal } => write!(f, "device {ordinal}"),
        }
    }
}

/// How another process opens a device region: the exporting process, the
/// allocation's address there (a region of the same process is used as it is),
/// and the CUDA IPC memory handle, hex.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IpcHandle {
    pub pid: u32,
    pub addr: u64,
    pub handle: String,
}

/// The address of a transport endpoint: where its regions live and where its
/// notifications go. Plain data, so it travels inside handles and messages.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "transport", rename_all = "lowercase")]
pub enum PeerAddr {
    /// An in-process [`LocalTransport`] instance.
    Local { instance: u64 },
    /// A [`ShmTransport`]: its regions are files `{dir}/{prefix}-r{id}`, its
    /// notification socket is `{dir}/{prefix}.sock`.
    Shm { dir: PathBuf, prefix: String },
    /// A [`TcpTransport`] listening at `addr`.
    Tcp { addr: SocketAddr },
    /// An [`rdma::RdmaTransport`] whose bootstrap (queue pair and key
    /// exchange, notifications) listens at `addr`.
    Rdma { addr: SocketAddr },
    /// A [`ucx::UcxTransport`]: its UCX worker's address (hex, what
    /// `ucp_worker_get_address` packs) and where its notifications go (tcp).
    Ucx { worker: String, notify: SocketAddr },
}

impl fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerAddr::Local { instance } => write!(f, "local:{instance:x}"),
            PeerAddr::Shm { dir, prefix } => write!(f, "shm:{}/{prefix}", dir.display()),
            PeerAddr::Tcp { addr } => write!(f, "tcp:{addr}"),
            PeerAddr::Rdma { addr } => write!(f, "rdma:{addr}"),
            PeerAddr::Ucx { notify, worker } => write!(f, "ucx:{notify}/{}", &worker[..worker.len().min(16)]),
        }
    }
}

/// A registered region, as a peer addresses it. Serializable: send it to the
/// producer (JSON, the engine's own messages), which [`Transport::attach`]es it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionHandle {
    /// The transport that owns the region.
    pub peer: PeerAddr,
    /// The region's id within its transport.
    pub id: u64,
    /// The rank the region belongs to.
    pub rank: RankId,
    pub kind: RegionKind,
    /// Bytes in the region.
    pub len: u64,
    pub memory: MemoryKind,
    /// Set for device regions: what a producer in another process opens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipc: Option<IpcHandle>,
    /// Set for ucx regions: where the region lies and its packed remote key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_key: Option<RemoteKey>,
}

/// A UCX region as a peer puts into it: its address in the owning process and
/// the remote key `ucp_rkey_pack` made for it (hex). It travels only inside
/// region handles, that is over the roles' authenticated links.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RemoteKey {
    pub addr: u64,
    pub rkey: String,
}

impl fmt::Display for RegionHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} region {} of {} ({} B) at {}", self.kind, self.id, self.rank, self.len, self.peer)
    }
}

/// A peer's region opened for writing by this transport (the result of `attach`).
/// Only meaningful to the transport that returned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RemoteRegion {
    /// Attachment id within the attaching transport.
    pub id: u64,
    pub kind: RegionKind,
    pub len: u64,
}

/// One submitted descriptor batch, unique within its transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BatchId(pub u64);

impl fmt::Display for BatchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "batch {}", self.0)
    }
}

/// The outcome of one batch.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchCompletion {
    pub batch: BatchId,
    pub result: Result<(), TransportError>,
}

/// A small message received from a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The sender's endpoint when the transport knows it.
    pub from: Option<PeerAddr>,
    pub bytes: Vec<u8>,
}

/// Something that went wrong on the receiving side without a local call to
/// report it to: a producer that vanished or stalled mid-batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Incident {
    pub peer: Option<PeerAddr>,
    pub error: TransportError,
}

/// Which side of a descriptor an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Src,
    Dst,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Src => "source",
            Side::Dst => "destination",
        })
    }
}

/// Errors of every transport. Clone, so that a batch's failure can be reported both
/// through `poll` and to the engine's own bookkeeping.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TransportError {
    #[error("descriptor {index} ({kind}) reaches {side} bytes {start}..{end}, past the end of the {len}-byte region")]
    OutOfBounds { index: usize, kind: RegionKind, side: Side, start: u64, end: u64, len: u64 },
    #[error("descriptor {index} is for {descriptor} but the destination region holds {region}")]
    KindMismatch { index: usize, descriptor: RegionKind, region: RegionKind },
    #[error("batch of {count} descriptors exceeds the limit of {max}")]
    BatchTooLarge { count: usize, max: usize },
    #[error("unknown region: {0}")]
    UnknownRegion(String),
    #[error("region handle {handle} belongs to {owner}, not to this {transport} transport")]
    ForeignHandle { handle: String, owner: String, transport: &'static str },
    #[error("unknown {0} (never submitted, or its completion was already taken)")]
    UnknownBatch(BatchId),
    #[error("{what} unavailable: {reason}")]
    Unavailable { what: String, reason: String },
    #[error("I/O error during {op}: {message}")]
    Io { op: String, kind: std::io::ErrorKind, message: String },
    #[error("connection to {peer} lost: {reason}")]
    Disconnected { peer: String, reason: String },
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: String, after: Duration },
    #[error("peer {peer} rejected {batch}: {message}")]
    Rejected { peer: String, batch: BatchId, message: String },
    #[error("protocol error from {peer}: {message}")]
    Protocol { peer: String, message: String },
    /// A peer's message after the handshake did not prove itself (altered,
    /// replayed, reordered, from another connection), or a peer did not prove
    /// the cluster secret: the connection was closed.
    #[error("refused {peer}: {reason}")]
    Refused { peer: String, reason: String },
    #[error("staging pool of {buffers} x {bytes} B exhausted for {waited:?}")]
    PoolExhausted { buffers: u32, bytes: u64, waited: Duration },
    #[error("gave up after {attempts} attempts: {last}")]
    RetriesExhausted { attempts: u32, last: Box<TransportError> },
    /// A staged group whose positions cannot be computed (its own check).
    #[error("staged group refused: {0}")]
    Staged(#[from] handoff_components::plan::StagedError),
    /// A staged group whose block tables reach past a region, or that names
    /// another kind than the destination holds.
    #[error("staged {kind} group reaches {side} byte {end}, past the {len}-byte {region} region")]
    StagedOutOfBounds { kind: RegionKind, side: Side, end: u64, len: u64, region: RegionKind },
}

impl TransportError {
    pub(crate) fn io(op: impl Into<String>, e: std::io::Error) -> Self {
        TransportError::Io { op: op.into(), kind: e.kind(), message: e.to_string() }
    }

    /// Whether trying again may succeed (a lost connection, a stall, a full pool),
    /// as opposed to a request that is wrong (bounds, kinds, unknown regions).
    pub fn is_transient(&self) -> bool {
        matches!(self, TransportError::Io { .. } | TransportError::Disconnected { .. } | TransportError::Timeout { .. } | TransportError::PoolExhausted { .. })
    }
}

pub type Result<T, E = TransportError> = std::result::Result<T, E>;

/// Moves bytes from this process's registered regions into peers' registered regions.
///
/// Object safe; share it as `Arc<dyn Transport>`. Reading or filling a local region
/// goes through [`TransportExt::read_region`]/[`TransportExt::write_region`] (or the
/// `dyn FnMut` forms here). Writes that a peer makes into a region of this transport
/// become visible once the peer's batch completed and its notification arrived; the
/// engine must not read a region while writes into it may be in flight.
pub trait Transport: Send + Sync {
    /// `"local"`, `"shm"`, `"tcp"`, `"ucx"`, `"rdma"`.
    fn name(&self) -> &'static str;

    /// Where peers reach this transport (for notifications).
    fn endpoint(&self) -> PeerAddr;

    /// Allocates and registers a zeroed region for a local rank.
    fn register_memory(&self, rank: RankId, kind: RegionKind, len: u64, memory: MemoryKind) -> Result<RegionHandle>;

    /// Allocates and registers a zeroed host region for a local rank.
    fn register(&self, rank: RankId, kind: RegionKind, len: u64) -> Result<RegionHandle> {
        self.register_memory(rank, kind, len, MemoryKind::Host)
    }

    /// Drops a local region. Peers that attached it get errors on later writes (tcp)
    /// or keep writing into memory nobody reads (shm mappings outlive the name).
    fn unregister(&self, handle: &RegionHandle) -> Result<()>;

    /// Opens a peer's (or one's own) region for writing.
    fn attach(&self, handle: &RegionHandle) -> Result<RemoteRegion>;

    /// Whether writes into `dst` are this process's own stores into memory it
    /// has mapped, so that a narrow piece costs what its bytes cost. Where it
    /// is false each piece is a message (a frame, a put, a work request), and
    /// the mover gathers narrow rows into staging buffers first
    /// (`StagingMode::Auto`); where it is true that gather would only add a copy.
    fn writes_in_place(&self, dst: RemoteRegion) -> bool {
        let _ = dst;
        false
    }

    /// Forgets an attachment that a newer handle of the same (rank, kind)
    /// replaced (a restarted consumer): the device transport closes its IPC
    /// mapping so the dead consumer's memory can go. Others keep theirs.
    fn detach(&self, remote: RemoteRegion) {
        let _ = remote;
    }

    /// Calls `f` with the bytes of a local region.
    fn with_region(&self, handle: &RegionHandle, f: &mut dyn FnMut(&[u8])) -> Result<()>;

    /// Calls `f` with the bytes of a local region, writable.
    fn with_region_mut(&self, handle: &RegionHandle, f: &mut dyn FnMut(&mut [u8])) -> Result<()>;

    /// A local region in device memory, as the compute backend's region ops
    /// address it; `None` for host regions (reached through `with_region`).
    fn device_region(&self, handle: &RegionHandle) -> Option<handoff_kernels::DeviceRegion> {
        let _ = handle;
        None
    }

    /// One-sided writes from local region `src` into the attached region `dst`.
    /// Every descriptor is checked against both regions (and its kind against the
    /// destination's) before any byte moves; a rejected batch moves nothing.
    fn submit(&self, src: &RegionHandle, dst: RemoteRegion, descriptors: &[Descriptor]) -> Result<BatchId>;

    /// [`Transport::submit`] of several batches at once, each checked on its
    /// own; one result per batch, in order. A transport whose queueing costs
    /// per call (the device transport: driver calls and an event per batch)
    /// queues them as one, and they all complete together.
    fn submit_all(&self, writes: &[(&RegionHandle, RemoteRegion, &[Descriptor])]) -> Vec<Result<BatchId>> {
        writes.iter().map(|&(src, dst, d)| self.submit(src, dst, d)).collect()
    }

    /// [`Transport::submit_all`], each batch started only once the work
    /// before every mark of `after` has run: layer marks a compute backend
    /// recorded on its stream (layer-wise streaming on a GPU), waited on by
    /// the copies on the device, never by the caller. With no mark it is
    /// `submit_all`; the default refuses marks
    /// ([`Transport::takes_marks`] false).
    fn submit_all_after(&self, writes: &[(&RegionHandle, RemoteRegion, &[Descriptor])], after: &[StreamMark]) -> Vec<Result<BatchId>> {
        if after.is_empty() {
            return self.submit_all(writes);
        }
        let e = TransportError::Unavailable {
            what: format!("waiting on a layer mark in the {} transport", self.name()),
            reason: "its writes are not device copies".into(),
        };
        writes.iter().map(|_| Err(e.clone())).collect()
    }

    /// Whether [`Transport::submit_all_after`] makes writes wait on layer
    /// marks on the device (the device transport).
    fn takes_marks(&self) -> bool {
        false
    }

    /// Whether waits on this transport's completions are worth polling for
    /// [`crate::base::SPIN`] before sleeping: a device's copies, which finish
    /// within about a millisecond, where a sleeping thread's wake-up costs
    /// hundreds of microseconds. False (the default) where a completion is
    /// ready when `submit` returns or comes from a peer: a spinning waiter
    /// would only take a core from the compute.
    fn polls_waits(&self) -> bool {
        false
    }

    /// How many plans a mover hands this transport in one
    /// [`Transport::submit_all`] at most (1: one plan a worker). The in-host
    /// transports copy many in one pass over each shared source region; the
    /// device transport queues a few at a time on its copy streams, so that
    /// the device copies the first plans while the host prepares the rest.
    fn plans_per_submission(&self) -> usize {
        1
    }

    /// Takes every completion reported since the last call, in batch order.
    fn poll(&self) -> Vec<BatchCompletion>;

    /// Waits for one batch; takes its completion (a later `poll` will not see it).
    fn wait(&self, batch: BatchId, timeout: Duration) -> Result<()>;

    /// Waits for every one of `batches` and takes their completions, in
    /// order. The device transport waits for them in one go, within
    /// `timeout` (a pass's 320 batches end with one event); the others one
    /// after the other, each within `timeout`, as [`Transport::wait`].
    fn wait_all(&self, batches: &[BatchId], timeout: Duration) -> Vec<Result<()>> {
        batches.iter().map(|&b| self.wait(b, timeout)).collect()
    }

    /// Sends a small message to a peer endpoint. On one peer, a message sent after a
    /// batch completed is received after that batch's bytes are in place.
    fn notify(&self, peer: &PeerAddr, bytes: &[u8]) -> Result<()>;

    /// Takes the messages received since the last call.
    fn recv_notifications(&self) -> Vec<Notification>;

    /// Takes receive-side failures since the last call (a producer that died or
    /// stalled mid-batch). Transports without a receive side report none.
    fn take_incidents(&self) -> Vec<Incident> {
        Vec::new()
    }

    /// Connections (tcp) or messages (shm) refused so far for not proving the
    /// cluster secret ([`crate::transport::auth`]). Transports that accept nothing from
    /// outside the process report 0.
    fn unauthenticated(&self) -> u64 {
        0
    }

    /// Messages refused so far after a peer proved the secret: tcp frames or
    /// shm datagrams whose MAC does not hold for their place (altered, replayed,
    /// reordered, from another connection). Transports that accept nothing from
    /// outside the process report 0.
    fn refused_frames(&self) -> u64 {
        0
    }
}

/// Generic conveniences over any transport.
pub trait TransportExt: Transport {
    /// Runs `f` on a local region's bytes and returns its result.
    fn read_region<R>(&self, handle: &RegionHandle, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        let mut f = Some(f);
        let mut out = None;
        self.with_region(handle, &mut |b| {
            if let Some(f) = f.take() {
                out = Some(f(b));
            }
        })?;
        out.ok_or_else(|| TransportError::UnknownRegion(handle.to_string()))
    }

    /// Runs `f` on a local region's bytes, writable, and returns its result.
    fn write_region<R>(&self, handle: &RegionHandle, f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        let mut f = Some(f);
        let mut out = None;
        self.with_region_mut(handle, &mut |b| {
            if let Some(f) = f.take() {
                out = Some(f(b));
            }
        })?;
        out.ok_or_else(|| TransportError::UnknownRegion(handle.to_string()))
    }

    /// A copy of a local region's bytes.
    fn region_bytes(&self, handle: &RegionHandle) -> Result<Vec<u8>> {
        self.read_region(handle, |b| b.to_vec())
    }

    /// Submits and waits.
    fn transfer(&self, src: &RegionHandle, dst: RemoteRegion, descriptors: &[Descriptor], timeout: Duration) -> Result<()> {
        let batch = self.submit(src, dst, descriptors)?;
        self.wait(batch, timeout)
    }

    /// Waits until at least one notification arrived, or the timeout passed
    /// (then returns what there is, possibly nothing).
    fn wait_notifications(&self, timeout: Duration) -> Vec<Notification> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_micros(50);
        loop {
            let got = self.recv_notifications();
            if !got.is_empty() || Instant::now() >= deadline {
                return got;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
    }
}

impl<T: Transport + ?Sized> TransportExt for T {}

// ---------------------------------------------------------------------------
// Shared pieces of the backends.

/// One contiguous copy, already bounds-checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// The end of a strided range, or `None` on overflow. Empty descriptors (count or
/// len 0) cover nothing and return `Some(offset)`.
fn range_end(offset: u64, stride: u64, count: u32, len: u64) -> Option<u64> {
    if count == 0 || len == 0 {
        return Some(offset);
    }
    (count as u64 - 1).checked_mul(stride)?.checked_add(offset)?.checked_add(len)
}

/// Checks every descriptor against both regions and the destination's kind.
/// `src_len`/`dst_len` may be `None` for a side this end cannot see.
pub(crate) fn validate(descriptors: &[Descriptor], src_len: Option<u64>, dst_len: u64, dst_kind: RegionKind) -> Result<()> {
    for (index, d) in descriptors.iter().enumerate() {
        if d.kind != dst_kind {
            return Err(TransportError::KindMismatch { index, descriptor: d.kind, region: dst_kind });
        }
        let sides = [(Side::Src, d.src_offset, d.src_stride, src_len), (Side::Dst, d.dst_offset, d.dst_stride, Some(dst_len))];
        for (side, offset, stride, len) in sides {
            let Some(region_len) = len else { continue };
            match range_end(offset, stride, d.count, d.len) {
                Some(end) if end <= region_len => {}
                end => {
                    return Err(TransportError::OutOfBounds { index, kind: d.kind, side, start: offset, end: end.unwrap_or(u64::MAX), len: region_len });
                }
            }
        }
    }
    Ok(())
}

/// The contiguous pieces of a (validated) batch, in order, empty ones dropped.
pub(crate) fn pieces(descriptors: &[Descriptor]) -> Vec<Piece> {
    let n: usize = descriptors.iter().filter(|d| d.len > 0).map(|d| d.count as usize).sum();
    let mut out = Vec::with_capacity(n);
    for d in descriptors {
        if d.len == 0 {
            continue;
        }
        for (src, dst) in d.pieces() {
            out.push(Piece { src, dst, len: d.len });
        }
    }
    out
}

/// Batch bookkeeping shared by the backends: pending batches and their outcomes.
#[derive(Default)]
pub(crate) struct Completions {
    state: Mutex<CompletionState>,
    cv: Condvar,
    /// How long a waiter polls before it sleeps (see [`crate::base::SPIN`]).
    spin: Duration,
}

#[derive(Default)]
struct CompletionState {
    next: u64,
    pending: HashSet<BatchId, BuildHasherDefault<BatchHash>>,
    done: HashMap<BatchId, Result<()>, BuildHasherDefault<BatchHash>>,
}

/// Batch ids are a counter: a multiply spreads them over the table (a device
/// pass begins, finishes and waits for 320 of them at once; SipHash was a
/// tenth of its host time).
#[derive(Default)]
struct BatchHash(u64);

impl Hasher for BatchHash {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

impl Completions {
    /// Completions whose waiters poll for `spin` before they sleep: a
    /// device's copies, which finish within about a millisecond.
    pub fn polled(spin: Duration) -> Self {
        Completions { spin, ..Completions::default() }
    }

    /// A fresh batch id, marked pending.
    pub fn begin(&self) -> BatchId {
        self.begin_n(1)[0]
    }

    /// `n` fresh batch ids, marked pending under one lock.
    pub fn begin_n(&self, n: usize) -> Vec<BatchId> {
        let mut s = lock(&self.state);
        (0..n)
            .map(|_| {
                s.next += 1;
                let id = BatchId(s.next);
                s.pending.insert(id);
                id
            })
            .collect()
    }

    pub fn finish(&self, batch: BatchId, result: Result<()>) {
        self.finish_all(&[batch], result);
    }

    /// [`Completions::finish`] of batches that completed together (one
    /// device event): one lock and one wake-up for all of them, not one each.
    pub fn finish_all(&self, batches: &[BatchId], result: Result<()>) {
        let mut s = lock(&self.state);
        let mut any = false;
        for &batch in batches {
            if s.pending.remove(&batch) {
                s.done.insert(batch, result.clone());
                any = true;
            }
        }
        if any {
            self.cv.notify_all();
        }
    }

    /// Forgets a batch that was never sent (its submit returned an error).
    pub fn cancel(&self, batch: BatchId) {
        lock(&self.state).pending.remove(&batch);
    }

    pub fn poll(&self) -> Vec<BatchCompletion> {
        let mut s = lock(&self.state);
        let mut done: Vec<BatchCompletion> = s.done.drain().map(|(batch, result)| BatchCompletion { batch, result }).collect();
        done.sort_unstable_by_key(|c| c.batch);
        done
    }

    /// [`Transport::wait_all`]: one wait until none of `batches` is pending,
    /// then each one's completion (an unknown batch, or one still pending at
    /// the deadline, its error).
    pub fn wait_all(&self, batches: &[BatchId], timeout: Duration) -> Vec<Result<()>> {
        let deadline = Instant::now() + timeout;
        let (mut s, _) = crate::base::wait_until(&self.state, &self.cv, deadline, self.spin, |s| batches.iter().all(|b| !s.pending.contains(b)));
        batches
            .iter()
            .map(|&b| match s.done.remove(&b) {
                Some(r) => r,
                None if !s.pending.contains(&b) => Err(TransportError::UnknownBatch(b)),
                None => Err(TransportError::Timeout { what: b.to_string(), after: timeout }),
            })
            .collect()
    }

    pub fn wait(&self, batch: BatchId, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let (mut s, _) = crate::base::wait_until(&self.state, &self.cv, deadline, self.spin, |s| s.done.contains_key(&batch) || !s.pending.contains(&batch));
        match s.done.remove(&batch) {
            Some(r) => r,
            None if !s.pending.contains(&batch) => Err(TransportError::UnknownBatch(batch)),
            None => Err(TransportError::Timeout { what: batch.to_string(), after: timeout }),
        }
    }
}

/// Locks a mutex, ignoring poisoning: the data behind our locks stays consistent
/// across a panicking holder (queues and maps updated in single steps).
// The backends take it from here with the rest of their shared items.
pub(crate) use crate::base::lock;

pub(crate) fn read<T>(m: &std::sync::RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn write<T>(m: &std::sync::RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|p| p.into_inner())
}

/// A unique-enough 64-bit nonce for instance ids and file prefixes: time, pid and
/// a process counter through a mixer (no rand dependency needed).
pub(crate) fn nonce() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let mut x = t ^ ((std::process::id() as u64) << 32) ^ COUNTER.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    // splitmix64 finalizer
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Refuses device memory: no backend in this build allocates it.
pub(crate) fn host_only(memory: MemoryKind, transport: &str) -> Result<()> {
    match memory {
        MemoryKind::Host => Ok(()),
        MemoryKind::Device { .. } => Err(TransportError::Unavailable {
            what: format!("device memory on the {transport} transport"),
            reason: "it moves host memory only (device regions go through the cuda-ipc transport)".into(),
        }),
    }
}

/// Converts a region length to `usize`, refusing what this address space cannot hold.
pub(crate) fn usize_len(len: u64) -> Result<usize> {
    usize::try_from(len).map_err(|_| TransportError::Unavailable { what: format!("a region of {len} bytes"), reason: "larger than this address space".into() })
}

#[cfg(test)]
mod completion_tests {
    use super::*;

    /// Batches finished together are each waited for once, with their
    /// shared result; a batch left out stays pending (its wait times out)
    /// and a batch never begun is unknown.
    #[test]
    fn batches_finished_together_complete_each_with_the_shared_result() {
        for c in [Completions::default(), Completions::polled(Duration::from_millis(1))] {
            let (a, b, left) = (c.begin(), c.begin(), c.begin());
            c.finish_all(&[a, b], Ok(()));
            assert!(c.wait(a, Duration::from_secs(1)).is_ok());
            assert!(c.wait(b, Duration::from_secs(1)).is_ok());
            assert!(matches!(c.wait(a, Duration::from_secs(1)), Err(TransportError::UnknownBatch(_))));
            assert!(matches!(c.wait(left, Duration::from_millis(5)), Err(TransportError::Timeout { .. })));
            let err = TransportError::Io { op: "device copy".into(), kind: std::io::ErrorKind::Other, message: "lost".into() };
            c.finish_all(&[left], Err(err));
            assert!(matches!(c.wait(left, Duration::from_secs(1)), Err(TransportError::Io { .. })));
        }
    }
}
