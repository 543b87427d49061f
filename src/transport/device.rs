//! Device-resident regions between processes of one host: CUDA IPC, or
//! HIP IPC where the memory is HIP's (the same `DeviceMemory` calls; never
//! run on AMD hardware).
//!
//! [`DeviceTransport`] keeps every region it registers in device memory,
//! allocated through a [`DeviceMemory`] (the compute backend's device, so the
//! model's kernels read and write the regions in place). A region's handle
//! carries the allocation's IPC handle; a producer in another process opens it
//! once and its descriptors become device-to-device copies into the consumer's
//! memory: a strided descriptor is one 2D copy, a contiguous one a plain copy.
//! A batch completes when the event recorded after its copies has (one
//! completion thread waits on the events in queue order), and only then does
//! `wait` or `poll` report it, so a write-done notice the engine sends after
//! the batch follows the bytes.
//!
//! Notifications and the cluster secret are the shm transport's: its Unix
//! socket carries the write-done reports, HMAC'd. NCCL refuses two ranks on one
//! GPU, so IPC is the path between the role processes of one GPU.
//!
//! Host access ([`Transport::with_region`]) copies a region to the host and,
//! for writes, back: for setup and for the oracle's checks, never on the
//! serving path (the model uses [`Transport::device_region`]).

use super::shm::ShmTransport;
use super::{
    BatchCompletion, BatchId, Completions, Incident, IpcHandle, MemoryKind, Notification, PeerAddr, RegionHandle, RemoteRegion, Result, Transport,
    TransportError, lock, read, validate, write,
};
use crate::transport::auth::ClusterSecret;
use handoff_components::plan::Descriptor;
use handoff_components::vocab::{RankId, RegionKind};
use handoff_kernels::{Copy2d, CopyTicket, DeviceMemory, DeviceRegion, StreamMark};
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

/// Device region ids and attachment ids are tagged so they never collide with
/// the shm transport's (which carries only notifications here).
const DEVICE_ID: u64 = 1 << 62;

struct Local {
    addr: u64,
    len: u64,
    kind: RegionKind,
}

struct Attached {
    addr: u64,
    len: u64,
    kind: RegionKind,
    /// Opened through IPC (closed on drop); false for this process's own regions.
    opened: bool,
}

/// The CUDA IPC transport (see the module docs).
pub struct DeviceTransport {
    notes: ShmTransport,
    /// The notification socket's address, which names this transport's
    /// regions (kept, so that checking a handle allocates nothing).
    endpoint: PeerAddr,
    mem: Arc<dyn DeviceMemory>,
    ordinal: u32,
    /// "cuda-ipc" or "hip-ipc", after the memory's platform.
    name: &'static str,
    next: AtomicU64,
    regions: RwLock<HashMap<u64, Local>>,
    attached: RwLock<HashMap<u64, Attached>>,
    /// (exporting pid, its address) -> attachment id: one IPC open per allocation.
    opened: Mutex<HashMap<(u32, u64), u64>>,
    reaper: Arc<Reaper>,
    reaper_thread: Option<std::thread::JoinHandle<()>>,
}

/// Completes batches in queue order: one thread sleeps on the oldest batch's
/// event and reports it, then the next (batches on other streams that finished
/// meanwhile are reported at once), and callers of `wait` sleep on the
/// completion table's condvar. One driver wait at a time instead of one per
/// caller: many callers polling or waiting in the driver contend for it.
struct Reaper {
    mem: Arc<dyn DeviceMemory>,
    completions: Completions,
    queue: Mutex<VecDeque<(BatchId, CopyTicket)>>,
    work: Condvar,
    stop: AtomicBool,
    /// When on ([`DeviceTransport::record_submissions`]), one entry per queued
    /// submission, its done time filled in by the completion thread.
    log: Mutex<Option<Vec<Submission>>>,
}

/// One `submit_all` that queued copies, for timelines (the hand-off bench).
#[derive(Debug, Clone, Copy)]
pub struct Submission {
    /// When `submit_all` was called, when its copy list was built (the
    /// device memory's part, the launches, starts then) and when it had
    /// queued everything.
    pub called: Instant,
    pub listed: Instant,
    pub queued: Instant,
    /// When the completion thread saw its event complete.
    pub done: Option<Instant>,
    /// On the device's clock, in microseconds from when the log started:
    /// when its stream reached it (an event before its first launch) and
    /// when its last copy finished; none where the memory has no timer.
    pub on_device: Option<(f64, f64)>,
    /// Host microseconds its launches took (part of listed to queued).
    pub launch_us: Option<f64>,
    pub batches: usize,
    pub copies: usize,
    ticket: CopyTicket,
}

impl Reaper {
    fn run(&self) {
        loop {
            let next = {
                let mut q = lock(&self.queue);
                loop {
                    if let Some(&(_, ticket)) = q.front() {
                        break Some(ticket);
                    }
                    if self.stop.load(Ordering::Acquire) {
                        break None;
                    }
                    q = self.work.wait(q).unwrap_or_else(|p| p.into_inner());
                }
            };
            let Some(ticket) = next else { return };
            let r = self.mem.wait(ticket).map_err(|e| device_err("device copy", e));
            if let Some(log) = lock(&self.log).as_mut() {
                let now = Instant::now();
                log.iter_mut().filter(|s| s.ticket == ticket).for_each(|s| s.done = Some(now));
            }
            // A submission's batches are queued together under one lock, so
            // they sit side by side at the front: all of them complete with
            // its one event, in one wake-up of their waiters.
            let batches: Vec<BatchId> = {
                let mut q = lock(&self.queue);
                let n = q.iter().take_while(|(_, t)| *t == ticket).count();
                q.drain(..n).map(|(b, _)| b).collect()
            };
            self.completions.finish_all(&batches, r);
        }
    }

    fn idle(&self) -> bool {
        lock(&self.queue).is_empty()
    }
}

fn device_err(op: &str, e: handoff_kernels::KernelError) -> TransportError {
    TransportError::Io { op: op.to_string(), kind: std::io::ErrorKind::Other, message: e.to_string() }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

impl DeviceTransport {
    /// A transport whose regions live in `mem` (device `ordinal`), with its
    /// notification socket under `dir`, requiring `secret` of its peers.
    pub fn new(mem: Arc<dyn DeviceMemory>, ordinal: u32, dir: impl Into<PathBuf>, secret: ClusterSecret) -> Result<Self> {
        let name = if mem.label().starts_with("hip:") { "hip-ipc" } else { "cuda-ipc" };
        let reaper = Arc::new(Reaper {
            mem: Arc::clone(&mem),
            completions: Completions::polled(crate::base::SPIN),
            queue: Mutex::new(VecDeque::new()),
            work: Condvar::new(),
            stop: AtomicBool::new(false),
            log: Mutex::new(None),
        });
        let thread = {
            let r = Arc::clone(&reaper);
            std::thread::Builder::new()
                .name(format!("{name}-completions"))
                .spawn(move || r.run())
                .map_err(|e| TransportError::io("spawn the completion thread", e))?
        };
        let notes = ShmTransport::with_secret(dir, secret)?;
        Ok(DeviceTransport {
            endpoint: notes.endpoint(),
            notes,
            mem,
            ordinal,
            name,
            next: AtomicU64::new(1),
            regions: RwLock::new(HashMap::new()),
            attached: RwLock::new(HashMap::new()),
            opened: Mutex::new(HashMap::new()),
            reaper: Arc::clone(&reaper),
            reaper_thread: Some(thread),
        })
    }

    /// Starts (or restarts, empty) the log of submissions, and stamps each
    /// on the device's clock where the memory can
    /// ([`DeviceMemory::stamp_copies`]; the null device cannot).
    pub fn record_submissions(&self) {
        *lock(&self.reaper.log) = Some(Vec::new());
        if let Err(e) = self.mem.stamp_copies(true) {
            tracing::debug!(error = %e, "device transport: submissions logged without device stamps");
        }
    }

    /// Stops the log and returns it, in queue order, each submission with
    /// its device stamps where there are any (this waits for its copies).
    pub fn take_submissions(&self) -> Vec<Submission> {
        let mut log = lock(&self.reaper.log).take().unwrap_or_default();
        match self.mem.take_copy_stamps() {
            Ok(stamps) => {
                for st in stamps {
                    if let Some(s) = log.iter_mut().find(|s| s.ticket == st.ticket) {
                        s.on_device = Some((st.start_us, st.end_us));
                        s.launch_us = Some(st.queue_us);
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "device transport: the submissions' device stamps"),
        }
        log
    }

    /// The device this transport allocates on ("cuda:0", "hip:0").
    pub fn device(&self) -> String {
        self.mem.label()
    }

    /// The device's time for `writes` (each checked as `submit` checks it),
    /// queued as one submission and timed by events on its stream: what the
    /// copies cost on the GPU, without the host's queueing and wake-ups
    /// (`bench transfer`'s per-kind rates).
    pub fn time_on_device(&self, writes: &[(&RegionHandle, RemoteRegion, &[Descriptor])]) -> Result<Duration> {
        let mut list = Vec::new();
        for &(src, dst, descriptors) in writes {
            self.copy_list(src, dst, descriptors, &mut list)?;
        }
        // SAFETY: every descriptor was validated against both regions above.
        unsafe { self.mem.time_copies(&list) }.map_err(|e| device_err("device copy timing", e))
    }

    fn next_id(&self) -> u64 {
        DEVICE_ID | self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Appends the device copies of `descriptors` from `src` into `dst` to
    /// `out`, each descriptor checked against both regions first (on an
    /// error nothing is appended).
    fn copy_list(&self, src: &RegionHandle, dst: RemoteRegion, descriptors: &[Descriptor], out: &mut Vec<Copy2d>) -> Result<()> {
        let (src_addr, src_len) = self.local(src)?;
        let (dst_addr, dst_len, dst_kind) = match read(&self.attached).get(&dst.id) {
            Some(a) => (a.addr, a.len, a.kind),
            None => return Err(TransportError::UnknownRegion(format!("attachment {} ({})", dst.id, dst.kind))),
        };
        validate(descriptors, Some(src_len), dst_len, dst_kind)?;
        copies_into(descriptors, src_addr, dst_addr, out);
        Ok(())
    }

    fn local(&self, handle: &RegionHandle) -> Result<(u64, u64)> {
        match read(&self.regions).get(&handle.id) {
            Some(l) if handle.peer == self.endpoint && l.kind == handle.kind => Ok((l.addr, l.len)),
            _ => Err(TransportError::UnknownRegion(handle.to_string())),
        }
    }
}

impl Drop for DeviceTransport {
    fn drop(&mut self) {
        // Let queued copies finish before their memory goes.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !self.reaper.idle() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        self.reaper.stop.store(true, Ordering::Release);
        self.reaper.work.notify_all();
        if self.reaper.idle()
            && let Some(t) = self.reaper_thread.take()
        {
            let _ = t.join();
        }
        for (_, a) in write(&self.attached).drain() {
            if a.opened {
                // SAFETY: no copy is queued any more (or we gave up waiting at exit).
                unsafe { self.mem.close(a.addr) };
            }
        }
        for (_, l) in write(&self.regions).drain() {
            // SAFETY: as above; peers that opened it keep their own mapping.
            unsafe { self.mem.free(l.addr) };
        }
    }
}

/// The copies of a validated batch, appended to `out`: one 2D copy per strided descriptor, one
/// plain copy per contiguous one; descriptors whose rows overlap (a stride
/// below the row length) go piece by piece, which keeps the sequential
/// semantics every transport gives a batch.
fn copies_into(descriptors: &[Descriptor], src: u64, dst: u64, out: &mut Vec<Copy2d>) {
    out.reserve(descriptors.len());
    for d in descriptors {
        if d.len == 0 || d.count == 0 {
            continue;
        }
        let rows_apart = d.count == 1 || (d.src_stride >= d.len && d.dst_stride >= d.len);
        if rows_apart {
            out.push(Copy2d {
                src: src + d.src_offset,
                src_pitch: if d.count == 1 { d.len } else { d.src_stride },
                dst: dst + d.dst_offset,
                dst_pitch: if d.count == 1 { d.len } else { d.dst_stride },
                width: d.len,
                height: d.count as u64,
            });
        } else {
            for (s, t) in d.pieces() {
                out.push(Copy2d { src: src + s, src_pitch: d.len, dst: dst + t, dst_pitch: d.len, width: d.len, height: 1 });
            }
        }
    }
}

/// Device memory without a device, for tests and the host-path bench
/// (`benches/device_host.rs`): made-up addresses, no bytes; each copy list is
/// split into table launches as the GPU's memory splits it (the host's work
/// before a launch), recorded with the marks it waits on, and done at once.
/// Its label ("cuda:0" unless given) names the transport.
#[derive(Default)]
pub struct NullDevice {
    label: &'static str,
    next: AtomicU64,
    /// Each copy list: its copies, the marks it waits on, its table launches.
    lists: Mutex<Vec<(usize, Vec<StreamMark>, usize)>>,
    /// While set, no copy completes ([`NullDevice::hold`]).
    held: AtomicBool,
}

impl NullDevice {
    /// Holds every queued copy pending (`done` says no) until released: a
    /// device still busy with earlier copies.
    pub fn hold(&self, on: bool) {
        self.held.store(on, Ordering::Release);
    }

    /// A null device named `label` ("hip:0" makes its transport hip-ipc).
    pub fn labelled(label: &'static str) -> Self {
        NullDevice { label, ..NullDevice::default() }
    }

    /// Every copy list queued so far: (copies, the marks it waits on, table launches).
    pub fn lists(&self) -> Vec<(usize, Vec<StreamMark>, usize)> {
        lock(&self.lists).clone()
    }
}

impl DeviceMemory for NullDevice {
    fn label(&self) -> String {
        if self.label.is_empty() { "cuda:0".into() } else { self.label.into() }
    }
    fn alloc(&self, _: u64) -> handoff_kernels::Result<u64> {
        Ok((self.next.fetch_add(1, Ordering::Relaxed) + 1) << 40)
    }
    unsafe fn free(&self, _: u64) {}
    fn export(&self, _: u64) -> handoff_kernels::Result<Vec<u8>> {
        Ok(vec![0; 64])
    }
    fn open(&self, _: &[u8]) -> handoff_kernels::Result<u64> {
        Ok(0)
    }
    unsafe fn close(&self, _: u64) {}
    unsafe fn copy(&self, copies: &[Copy2d]) -> handoff_kernels::Result<CopyTicket> {
        // SAFETY: nothing is copied.
        unsafe { self.copy_after(copies, &[]) }
    }
    unsafe fn copy_after(&self, copies: &[Copy2d], after: &[StreamMark]) -> handoff_kernels::Result<CopyTicket> {
        let tables = handoff_kernels::table_launches(copies, handoff_kernels::WIDE_TABLE_COPIES).len();
        lock(&self.lists).push((copies.len(), after.to_vec(), tables));
        Ok(CopyTicket(1))
    }
    fn done(&self, _: CopyTicket) -> handoff_kernels::Result<bool> {
        Ok(!self.held.load(Ordering::Acquire))
    }
    unsafe fn read(&self, _: u64, _: &mut [u8]) -> handoff_kernels::Result<()> {
        Ok(())
    }
    unsafe fn write(&self, _: u64, _: &[u8]) -> handoff_kernels::Result<()> {
        Ok(())
    }
}

impl Transport for DeviceTransport {
    fn name(&self) -> &'static str {
        self.name
    }

    fn endpoint(&self) -> PeerAddr {
        self.endpoint.clone()
    }

    fn register_memory(&self, rank: RankId, kind: RegionKind, len: u64, memory: MemoryKind) -> Result<RegionHandle> {
        match memory {
            MemoryKind::Device { ordinal } if ordinal == self.ordinal => {}
            other => {
                return Err(TransportError::Unavailable {
                    what: format!("{other} memory on the {} transport", self.name),
                    reason: format!("it keeps regions in the memory of {} only", self.mem.label()),
                });
            }
        }
        let addr = self.mem.alloc(len).map_err(|e| device_err("device alloc", e))?;
        let bytes = match self.mem.export(addr) {
            Ok(b) => b,
            Err(e) => {
                // SAFETY: just allocated, never used.
                unsafe { self.mem.free(addr) };
                return Err(device_err("ipc export", e));
            }
        };
        let id = self.next_id();
        write(&self.regions).insert(id, Local { addr, len, kind });
        let ipc = IpcHandle { pid: std::process::id(), addr, handle: hex(&bytes) };
        Ok(RegionHandle { peer: self.endpoint(), id, rank, kind, len, memory, ipc: Some(ipc), remote_key: None })
    }

    fn unregister(&self, handle: &RegionHandle) -> Result<()> {
        self.local(handle)?;
        if !self.reaper.idle() {
            return Err(TransportError::Unavailable { what: format!("unregistering {handle}"), reason: "copies are still queued".into() });
        }
        if let Some(l) = write(&self.regions).remove(&handle.id) {
            // SAFETY: nothing is queued; peers keep their own mappings.
            unsafe { self.mem.free(l.addr) };
        }
        Ok(())
    }

    /// A peer's device memory is opened here through CUDA IPC: the copy kernels store into it, many pieces a launch.
    fn writes_in_place(&self, _: RemoteRegion) -> bool {
        true
    }

    fn attach(&self, handle: &RegionHandle) -> Result<RemoteRegion> {
        let MemoryKind::Device { ordinal } = handle.memory else {
            return Err(TransportError::Unavailable { what: format!("{handle}"), reason: format!("the {} transport writes device regions only", self.name) });
        };
        if ordinal != self.ordinal {
            return Err(TransportError::Unavailable {
                what: format!("{handle} on {}:{ordinal}", self.name.trim_end_matches("-ipc")),
                reason: format!("this transport copies within {} (another GPU needs NCCL)", self.mem.label()),
            });
        }
        let ipc = handle
            .ipc
            .as_ref()
            .ok_or_else(|| TransportError::Protocol { peer: handle.peer.to_string(), message: format!("{handle} is a device region without an IPC handle") })?;
        let key = (ipc.pid, ipc.addr);
        let mut opened = lock(&self.opened);
        if let Some(&id) = opened.get(&key)
            && let Some(a) = read(&self.attached).get(&id)
            && a.len == handle.len
            && a.kind == handle.kind
        {
            return Ok(RemoteRegion { id, kind: a.kind, len: a.len });
        }
        let (addr, by_ipc) = if ipc.pid == std::process::id() {
            // A region of this process (another transport of it, or this one):
            // the address is valid here as it is; IPC cannot open it.
            (ipc.addr, false)
        } else {
            let bytes = unhex(&ipc.handle)
                .ok_or_else(|| TransportError::Protocol { peer: handle.peer.to_string(), message: format!("{handle}: the IPC handle is not hex") })?;
            (self.mem.open(&bytes).map_err(|e| device_err(&format!("ipc open of {handle}"), e))?, true)
        };
        let id = self.next_id();
        write(&self.attached).insert(id, Attached { addr, len: handle.len, kind: handle.kind, opened: by_ipc });
        opened.insert(key, id);
        Ok(RemoteRegion { id, kind: handle.kind, len: handle.len })
    }

    fn detach(&self, remote: RemoteRegion) {
        let Some(a) = write(&self.attached).remove(&remote.id) else { return };
        lock(&self.opened).retain(|_, id| *id != remote.id);
        if a.opened {
            // Copies into it may still be queued: `close` waits for the stream first.
            // SAFETY: the attachment is gone, so nothing new is queued on it.
            unsafe { self.mem.close(a.addr) };
        }
    }

    fn with_region(&self, handle: &RegionHandle, f: &mut dyn FnMut(&[u8])) -> Result<()> {
        let (addr, len) = self.local(handle)?;
        let mut bytes = vec![0u8; super::usize_len(len)?];
        // SAFETY: the whole of a live region of this transport.
        unsafe { self.mem.read(addr, &mut bytes) }.map_err(|e| device_err("device read", e))?;
        f(&bytes);
        Ok(())
    }

    fn with_region_mut(&self, handle: &RegionHandle, f: &mut dyn FnMut(&mut [u8])) -> Result<()> {
        let (addr, len) = self.local(handle)?;
        let mut bytes = vec![0u8; super::usize_len(len)?];
        // SAFETY: the whole of a live region of this transport.
        unsafe { self.mem.read(addr, &mut bytes) }.map_err(|e| device_err("device read", e))?;
        f(&mut bytes);
        // SAFETY: as above.
        unsafe { self.mem.write(addr, &bytes) }.map_err(|e| device_err("device write", e))
    }

    fn device_region(&self, handle: &RegionHandle) -> Option<DeviceRegion> {
        self.local(handle).ok().map(|(addr, len)| DeviceRegion { addr, len })
    }

    fn submit(&self, src: &RegionHandle, dst: RemoteRegion, descriptors: &[Descriptor]) -> Result<BatchId> {
        self.submit_all(&[(src, dst, descriptors)]).pop().unwrap_or_else(|| Err(TransportError::UnknownRegion(src.to_string())))
    }

    /// Every batch that passes its checks goes into one queued copy list with
    /// one event; a batch that fails them moves nothing and reports its error.
    fn submit_all(&self, writes: &[(&RegionHandle, RemoteRegion, &[Descriptor])]) -> Vec<Result<BatchId>> {
        self.submit_all_after(writes, &[])
    }

    /// As `submit_all`; the copy list's stream waits on the device for the
    /// marks first ([`DeviceMemory::copy_after`]), so the batches' event, and
    /// every write-done report after it, follows the layers they carry.
    fn submit_all_after(&self, writes: &[(&RegionHandle, RemoteRegion, &[Descriptor])], after: &[StreamMark]) -> Vec<Result<BatchId>> {
        let called = Instant::now();
        let mut results: Vec<Result<BatchId>> = Vec::with_capacity(writes.len());
        let mut list = Vec::new();
        let mut ok = Vec::new();
        for (i, &(src, dst, descriptors)) in writes.iter().enumerate() {
            match self.copy_list(src, dst, descriptors, &mut list) {
                Ok(()) => {
                    ok.push(i);
                    results.push(Ok(BatchId(0)));
                }
                Err(e) => results.push(Err(e)),
            }
        }
        if ok.is_empty() {
            return results;
        }
        let listed = Instant::now();
        // SAFETY: every descriptor was checked against both regions, which are
        // live: ours until unregistered (refused while copies are queued), the
        // peer's for as long as it is opened here.
        match unsafe { self.mem.copy_after(&list, after) } {
            Ok(ticket) => {
                if let Some(log) = lock(&self.reaper.log).as_mut() {
                    log.push(Submission {
                        called,
                        listed,
                        queued: Instant::now(),
                        done: None,
                        on_device: None,
                        launch_us: None,
                        batches: ok.len(),
                        copies: list.len(),
                        ticket,
                    });
                }
                let batches = self.reaper.completions.begin_n(ok.len());
                let mut q = lock(&self.reaper.queue);
                for (&i, batch) in ok.iter().zip(batches) {
                    q.push_back((batch, ticket));
                    results[i] = Ok(batch);
                }
                drop(q);
                self.reaper.work.notify_one();
            }
            Err(e) => {
                let e = device_err("device copy", e);
                for &i in &ok {
                    results[i] = Err(e.clone());
                }
            }
        }
        results
    }

    /// Copies run on the device's streams after `submit_all` returns. A
    /// flagship pass (64 plans) queued as one submission kept the device idle
    /// while the host prepared all of it (about 0.4 ms on an H100's host);
    /// eight a submission, the first are copied while the rest are prepared,
    /// each submission on its own stream.
    fn plans_per_submission(&self) -> usize {
        8
    }

    fn polls_waits(&self) -> bool {
        true
    }

    fn takes_marks(&self) -> bool {
        true
    }

    fn poll(&self) -> Vec<BatchCompletion> {
        self.reaper.completions.poll()
    }

    fn wait(&self, batch: BatchId, timeout: Duration) -> Result<()> {
        self.reaper.completions.wait(batch, timeout)
    }

    fn wait_all(&self, batches: &[BatchId], timeout: Duration) -> Vec<Result<()>> {
        self.reaper.completions.wait_all(batches, timeout)
    }

    fn notify(&self, peer: &PeerAddr, bytes: &[u8]) -> Result<()> {
        self.notes.notify(peer, bytes)
    }

    fn recv_notifications(&self) -> Vec<Notification> {
        self.notes.recv_notifications()
    }

    fn take_incidents(&self) -> Vec<Incident> {
        self.notes.take_incidents()
    }

    fn unauthenticated(&self) -> u64 {
        self.notes.unauthenticated()
    }

    fn refused_frames(&self) -> u64 {
        self.notes.refused_frames()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_become_2d_copies_and_overlapping_rows_go_piece_by_piece() {
        let kind = RegionKind::MlaKv;
        let strided = Descriptor { kind, src_offset: 8, src_stride: 64, dst_offset: 16, dst_stride: 128, len: 32, count: 4 };
        let single = Descriptor { kind, src_offset: 0, src_stride: 0, dst_offset: 0, dst_stride: 0, len: 100, count: 1 };
        let overlapping = Descriptor { kind, src_offset: 0, src_stride: 4, dst_offset: 0, dst_stride: 4, len: 8, count: 3 };
        let mut c = Vec::new();
        copies_into(&[strided, single, overlapping], 1000, 5000, &mut c);
        assert_eq!(c[0], Copy2d { src: 1008, src_pitch: 64, dst: 5016, dst_pitch: 128, width: 32, height: 4 });
        assert_eq!(c[1], Copy2d { src: 1000, src_pitch: 100, dst: 5000, dst_pitch: 100, width: 100, height: 1 });
        assert_eq!(c.len(), 2 + 3);
        assert_eq!(c[4], Copy2d { src: 1008, src_pitch: 8, dst: 5008, dst_pitch: 8, width: 8, height: 1 });
    }

    /// The flagship's hand-off (PP8 -> TP8 x DCP8, 64 plans) submitted as one
    /// list goes to the device in as few table launches as the table size
    /// allows (one on CUDA): the plans' rows interleave in the decode regions
    /// without meeting, so no copy has to wait for another.
    #[test]
    fn the_flagship_pass_takes_the_fewest_table_launches() {
        let topo = handoff_components::Topology::load(concat!(env!("CARGO_MANIFEST_DIR"), "/config/k3-pp8-tp8dcp8.toml")).expect("config");
        let (_engine, jobs, _) = crate::bench::transfer::planned(&topo, 32768, 1).expect("plans");
        // Every (rank, kind) region its own allocation, far apart.
        let mut bases: HashMap<(String, RegionKind), u64> = HashMap::new();
        let mut base = |rank: String, kind| {
            let n = bases.len() as u64;
            *bases.entry((rank, kind)).or_insert((n + 1) << 40)
        };
        let mut list = Vec::new();
        for (_, p) in &jobs {
            for d in &p.descriptors {
                let (src, dst) = (base(format!("{:?}", p.producer), d.kind), base(format!("{:?}", p.consumer), d.kind));
                copies_into(std::slice::from_ref(d), src, dst, &mut list);
            }
        }
        assert_eq!(list.len(), 448);
        // CUDA's 500-copy table: the whole pass is one launch; HIP's 48: ten.
        for max in [handoff_kernels::WIDE_TABLE_COPIES, handoff_kernels::TABLE_COPIES] {
            let launches = handoff_kernels::table_launches(&list, max);
            assert_eq!(launches.len(), list.len().div_ceil(max), "{launches:?}");
        }
    }

    /// HIP's device memory makes the transport hip-ipc, CUDA's (and any
    /// other) cuda-ipc, and its refusals name it.
    #[test]
    fn the_transport_is_named_after_its_memorys_platform() {
        let dir = std::env::temp_dir();
        for (label, name) in [("hip:0", "hip-ipc"), ("cuda:0", "cuda-ipc")] {
            let t = DeviceTransport::new(Arc::new(NullDevice::labelled(label)), 0, &dir, ClusterSecret::from_bytes(b"test")).expect("transport");
            assert_eq!((t.name(), t.device()), (name, label.to_string()));
            let e = t
                .register_memory(RankId::Prefill(handoff_components::vocab::PrefillRank { pp: 0, tp: 0 }), RegionKind::MlaKv, 64, MemoryKind::Host)
                .unwrap_err();
            assert!(e.to_string().contains(&format!("host memory on the {name} transport")), "{e}");
        }
    }

    /// Layer-wise streaming on a GPU, the transport's side: a layer's plan
    /// submitted with its device mark reaches the device as a copy list that
    /// waits on that mark (through the mover's worker, which queues it after
    /// the host has moved on), and a plan without one waits on nothing. The
    /// device transport's mover says it takes marks; a mover over a transport
    /// whose writes are not device copies says not, and refuses one.
    #[test]
    fn a_layers_writes_reach_the_device_copies_with_its_mark() {
        use crate::engine::mover::{MoverOptions, TransportMover};
        use handoff_components::plan::Plan;
        use handoff_components::vocab::{DecodeRank, LayerMark, PrefillRank};
        use handoff_systems::transfer::{MoveError, Mover, Ticket};
        let mem = Arc::new(NullDevice::default());
        let dir = std::env::temp_dir();
        let t = Arc::new(DeviceTransport::new(mem.clone(), 0, &dir, ClusterSecret::from_bytes(b"test")).expect("transport"));
        let (producer, consumer) = (PrefillRank { pp: 0, tp: 0 }, DecodeRank { tp: 0 });
        let kind = RegionKind::MlaKv;
        let device = MemoryKind::Device { ordinal: 0 };
        let src = t.register_memory(RankId::Prefill(producer), kind, 4096, device).expect("source");
        let dst = t.register_memory(RankId::Decode(consumer), kind, 4096, device).expect("destination");
        let mut mover = TransportMover::new(t.clone(), MoverOptions::default()).expect("mover");
        mover.add_source(src);
        mover.attach_target(&dst).expect("attach");
        assert!(mover.takes_marks());
        let d = Descriptor { kind, src_offset: 0, src_stride: 0, dst_offset: 1024, dst_stride: 0, len: 512, count: 1 };
        let plan = Plan { producer, consumer, descriptors: vec![d], staged: Vec::new(), uncoalesced: 0, chunks: Vec::new(), layers: Vec::new() };
        let ticket = |request| Ticket { request, nonce: 1, producer, consumer, part: 0 };
        for (request, mark) in [(1, Some(LayerMark(7))), (2, None)] {
            mover.submit_after(ticket(request), &plan, mark).expect("submit");
            assert!(mover.handle().wait_idle(Duration::from_secs(10)));
        }
        let mut done = Vec::new();
        mover.poll(&mut done);
        assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
        let lists: Vec<(usize, Vec<StreamMark>)> = mem.lists().into_iter().map(|(n, marks, _)| (n, marks)).collect();
        assert_eq!(lists, vec![(1, vec![StreamMark(7)]), (1, vec![])]);
        // A host transport's mover takes no marks and refuses one.
        let local: Arc<dyn Transport> = Arc::new(crate::transport::local::LocalTransport::new());
        let mut host = TransportMover::new(local, MoverOptions::default()).expect("mover");
        assert!(!host.takes_marks());
        assert!(matches!(host.submit_after(ticket(3), &plan, Some(LayerMark(8))), Err(MoveError::MarksUnsupported)));
    }

    /// Under a steady stream of plans a worker still reports: it queues a
    /// few plans a submission and the ones that arrive meanwhile, but waits
    /// and reports after a round's worth, so completions come while plans
    /// keep arriving (a worker that took every plan arriving within its quiet
    /// time reported none until the stream stopped), and every plan completes.
    #[test]
    fn a_worker_reports_while_plans_keep_arriving() {
        use crate::engine::mover::{MoverOptions, TransportMover};
        use handoff_components::plan::Plan;
        use handoff_components::vocab::{DecodeRank, PrefillRank};
        use handoff_systems::transfer::{Mover, Ticket};
        let mem = Arc::new(NullDevice::default());
        let dir = std::env::temp_dir();
        let t = Arc::new(DeviceTransport::new(mem.clone(), 0, &dir, ClusterSecret::from_bytes(b"test")).expect("transport"));
        assert!(t.plans_per_submission() > 1 && t.polls_waits());
        let (producer, consumer) = (PrefillRank { pp: 0, tp: 0 }, DecodeRank { tp: 0 });
        let kind = RegionKind::MlaKv;
        let device = MemoryKind::Device { ordinal: 0 };
        let src = t.register_memory(RankId::Prefill(producer), kind, 4096, device).expect("source");
        let dst = t.register_memory(RankId::Decode(consumer), kind, 4096, device).expect("destination");
        let mut mover = TransportMover::new(t.clone(), MoverOptions { workers: 1, ..MoverOptions::default() }).expect("mover");
        mover.add_source(src);
        mover.attach_target(&dst).expect("attach");
        let d = Descriptor { kind, src_offset: 0, src_stride: 0, dst_offset: 1024, dst_stride: 0, len: 512, count: 1 };
        let plan = Plan { producer, consumer, descriptors: vec![d], staged: Vec::new(), uncoalesced: 0, chunks: Vec::new(), layers: Vec::new() };
        // Plans a few microseconds apart until the first report (on a busy
        // machine the worker may take a while to be scheduled at all).
        let most = 100_000u64;
        let mut plans = 0;
        while plans < most && mover.handle().unpolled() == 0 {
            plans += 1;
            mover.submit(Ticket { request: plans, nonce: 1, producer, consumer, part: 0 }, &plan).expect("submit");
        }
        assert!(plans < most, "no plan was reported while {most} kept arriving");
        assert!(mover.handle().wait_idle(Duration::from_secs(30)));
        let mut done = Vec::new();
        mover.poll(&mut done);
        assert_eq!(done.len() as u64, plans);
        assert!(done.iter().all(|c| c.result.is_ok()));
        // No submission of more than a group (a copy a plan).
        assert!(mem.lists().iter().all(|l| l.0 <= t.plans_per_submission()), "a submission of more plans than a group");
    }

    /// A pass queued at once (behind a plan the device is still copying, so
    /// that the whole pass waits in the mover's queue): its first plan
    /// reaches the device alone (the device starts copying while the host
    /// prepares the rest), the groups after it double up to a full one
    /// (1, 2, 4, 8, 8, 1 for 24 plans), and every plan is written once.
    #[test]
    fn a_passs_first_plan_is_queued_alone() {
        use crate::engine::mover::{MoverOptions, TransportMover};
        use handoff_components::plan::Plan;
        use handoff_components::vocab::{DecodeRank, PrefillRank};
        use handoff_systems::transfer::{Mover, Ticket};
        let mem = Arc::new(NullDevice::default());
        let t = Arc::new(DeviceTransport::new(mem.clone(), 0, std::env::temp_dir(), ClusterSecret::from_bytes(b"test")).expect("transport"));
        let (producer, consumer) = (PrefillRank { pp: 0, tp: 0 }, DecodeRank { tp: 0 });
        let kind = RegionKind::MlaKv;
        let device = MemoryKind::Device { ordinal: 0 };
        let src = t.register_memory(RankId::Prefill(producer), kind, 1 << 16, device).expect("source");
        let dst = t.register_memory(RankId::Decode(consumer), kind, 1 << 16, device).expect("destination");
        let mut mover = TransportMover::new(t.clone(), MoverOptions { workers: 1, ..MoverOptions::default() }).expect("mover");
        mover.add_source(src);
        mover.attach_target(&dst).expect("attach");
        let plans: Vec<Plan> = (0..24u64)
            .map(|i| {
                let d = Descriptor { kind, src_offset: i * 512, src_stride: 0, dst_offset: i * 512, dst_stride: 0, len: 512, count: 1 };
                Plan { producer, consumer, descriptors: vec![d], staged: Vec::new(), uncoalesced: 0, chunks: Vec::new(), layers: Vec::new() }
            })
            .collect();
        for round in 0..3u64 {
            // The worker waits for a plan the device holds.
            mem.hold(true);
            mover.submit(Ticket { request: round * 100 + 99, nonce: 1, producer, consumer, part: 0 }, &plans[0]).expect("submit");
            std::thread::sleep(Duration::from_millis(50));
            let before = mem.lists().len();
            for (i, p) in plans.iter().enumerate() {
                mover.submit(Ticket { request: round * 100 + i as u64, nonce: 1, producer, consumer, part: 0 }, p).expect("submit");
            }
            std::thread::sleep(Duration::from_millis(5));
            mem.hold(false);
            assert!(mover.handle().wait_idle(Duration::from_secs(30)));
            let mut done = Vec::new();
            mover.poll(&mut done);
            assert_eq!(done.len(), plans.len() + 1);
            let lists: Vec<usize> = mem.lists()[before..].iter().map(|l| l.0).collect();
            let full = t.plans_per_submission();
            let ramp: Vec<usize> = (0..)
                .map(|i| (1usize << i).min(full))
                .scan(0, |sum, n| {
                    (*sum < plans.len()).then(|| {
                        let n = n.min(plans.len() - *sum);
                        *sum += n;
                        n
                    })
                })
                .collect();
            assert_eq!(lists, ramp, "round {round}: the submissions' plans");
            assert_eq!(lists.iter().sum::<usize>(), plans.len(), "round {round}: {lists:?}");
            assert!(lists.iter().all(|&n| n <= t.plans_per_submission()), "round {round}: {lists:?}");
        }
    }

    #[test]
    fn ipc_handles_round_trip_through_hex() {
        let b: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37)).collect();
        assert_eq!(unhex(&hex(&b)).unwrap(), b);
        assert!(unhex("abc").is_none());
        assert!(unhex("zz").is_none());
    }
}
