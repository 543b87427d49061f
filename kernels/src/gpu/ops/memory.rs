//! [`DeviceMemory`] on a GPU, written once over the driver seam
//! ([`MemoryDriver`]): regions as plain allocations (`Driver::alloc`: CUDA's
//! `cuMemAlloc`, HIP's `hipMalloc`; the stream-ordered pools the backends
//! allocate buffers from cannot be exported), IPC handles, and copies queued
//! on streams of their own, each batch followed by an event that
//! [`DeviceMemory::done`] queries. A batch's copies go through one small
//! kernel of its own (`kernels/hip/memcopy.hip`), up to 500 copies a launch
//! on CUDA (48 on HIP) with the table as the launch's argument; only large contiguous copies (and
//! rows too wide for the table) go to the copy engines. The memory shares its
//! backend's device (CUDA: the context), so the backend's kernels and these
//! copies see one address space.
//!
//! `CudaBackend` and `HipBackend` both open this type over their drivers
//! (`gpu/cuda/buffers.rs`, `gpu/hip/mod.rs`); CUDA's was `gpu/cuda_memory.rs`
//! before session 21 and makes the same driver calls, launches and events.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{KernelError, Result};
use crate::gpu::launch::{Arg, IPC_HANDLE_BYTES, MemoryDriver, dev};
use crate::region::{Copy2d, CopyStamp, CopyTicket, DeviceMemory, SMALL_TABLE_COPIES, StreamMark, table_launches};

/// Contiguous copies of at least this many bytes go to the copy engines;
/// everything else goes through `copy_table`. A copy-engine call into memory
/// opened through IPC cost about 15 us of host time on the H200 (the
/// hand-off bench's timeline: 64 such calls for the KDA state took most of a
/// millisecond to queue), where one table launch queues up to 500 copies
/// (48 on HIP).
pub(super) const ENGINE_BYTES: u64 = 256 << 20;
/// How long [`DeviceMemory::wait`] queries an event before it sleeps on it:
/// longer than a flagship pass's copies at 32K tokens (about 1.1 ms on an
/// H100), since the sleep's wake-up (a blocking-sync event) adds hundreds of
/// microseconds to a hand-off that finished long before.
const SPIN_BEFORE_SLEEP: std::time::Duration = std::time::Duration::from_millis(3);
/// Streams copy batches are spread over.
pub(super) const COPY_STREAMS: usize = 8;
/// Threads of a `copy_table` block.
pub(super) const COPY_THREADS: u32 = 256;
/// Words each `copy_table` thread moves a turn (`CT_UNROLL`: all loaded, then
/// all stored).
pub(super) const COPY_UNROLL: u64 = 8;
/// Clock cycles the gate in front of a timed copy list spins
/// (`copy_gate`): about 100 us at an H100's or H200's 1.6 to 2 GHz, longer
/// than the host takes to queue a flagship pass's launches.
const GATE_CYCLES: i64 = 200_000;
/// Words of one copy in a table at most (the kernel's 32-bit row division);
/// a larger copy is queued in parts of whole rows.
pub(super) const COPY_WORDS: u64 = 1 << 31;

/// `hk_copy_table` of memcopy.hip, the by-value argument of `copy_table`,
/// as its bytes for a table of `cap` copies (`CT_COPIES`): `c[cap][7]` i64
/// (src, dst, words per row, height, src pitch, dst pitch, word bytes), then
/// `start[cap + 1]` i64 (the first word of each copy; `start[n]` the count),
/// then `n` and a pad as i32; 64 bytes a copy and 16 more, no padding.
pub(super) struct CopyTable {
    bytes: Vec<u8>,
}

impl CopyTable {
    /// Bytes of a table of `cap` copies.
    pub(super) fn size(cap: usize) -> usize {
        64 * cap + 16
    }

    /// The table of `copies` (at most `cap`, none empty) and its word count.
    pub(super) fn of(copies: &[Copy2d], cap: usize) -> (CopyTable, u64) {
        debug_assert!(copies.len() <= cap);
        let mut bytes = vec![0u8; Self::size(cap)];
        let put = |b: &mut [u8], at: usize, v: i64| b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        let starts = 56 * cap;
        let mut words = 0u64;
        for (i, c) in copies.iter().enumerate() {
            let wb = word_bytes(c);
            let per_row = c.width / wb;
            for (k, v) in [c.src, c.dst, per_row, c.height, c.src_pitch, c.dst_pitch, wb].into_iter().enumerate() {
                put(&mut bytes, i * 56 + k * 8, v as i64);
            }
            put(&mut bytes, starts + i * 8, words as i64);
            words += per_row * c.height;
        }
        put(&mut bytes, starts + copies.len() * 8, words as i64);
        let n = starts + (cap + 1) * 8;
        bytes[n..n + 4].copy_from_slice(&(copies.len() as i32).to_le_bytes());
        (CopyTable { bytes }, words)
    }

    /// The table's bytes as the kernel takes them (3,088 for HIP's 48
    /// copies, within the 4 KB every driver accepts; 32,016 for CUDA's 500,
    /// within the 32,764 of CUDA 12.1 and later).
    pub(super) fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// The word a copy moves in: 16, 4 or 1 bytes, the largest dividing both
/// addresses, both pitches (when there is more than one row) and the width.
pub(super) fn word_bytes(c: &Copy2d) -> u64 {
    let pitches = if c.height > 1 { c.src_pitch | c.dst_pitch } else { 0 };
    let align = c.src | c.dst | c.width | pitches;
    if align.is_multiple_of(16) {
        16
    } else if align.is_multiple_of(4) {
        4
    } else {
        1
    }
}

fn contiguous(c: &Copy2d) -> bool {
    c.height == 1 || (c.src_pitch == c.width && c.dst_pitch == c.width)
}

/// A loaded kernel handle shared across threads.
struct Kernel<F>(F);
// SAFETY: a kernel handle (CUfunction, hipFunction_t) is valid on any thread
// once its device is bound; the memory holds the driver that keeps its module
// loaded, and nothing is written through it.
unsafe impl<F> Send for Kernel<F> {}
// SAFETY: as above.
unsafe impl<F> Sync for Kernel<F> {}

/// Device memory for a transport's regions on a GPU (see the module docs).
pub(crate) struct DeviceMem<D: MemoryDriver> {
    /// Host-side access and allocation: the device on a stream of its own.
    host: D,
    /// Copy batches go round robin over these: one batch stays on one stream
    /// (its copies run in order), batches overlap on the device, since one
    /// stream would run every small copy and kernel after the other.
    copy_streams: Vec<D>,
    next_stream: AtomicUsize,
    copy_table: Kernel<D::Func>,
    /// `copy_table_small`, for launches of at most SMALL_TABLE_COPIES
    /// copies, where the platform's table is wider (CUDA).
    copy_table_small: Option<Kernel<D::Func>>,
    copy_gate: Kernel<D::Func>,
    /// Copies a `copy_table` launch takes ([`MemoryDriver::table_copies`]).
    table_copies: usize,
    next: AtomicU64,
    /// Each batch's event (blocking-sync: a waiting thread sleeps in the
    /// driver instead of spinning on it).
    events: Mutex<HashMap<u64, Arc<D::Fence>>>,
    /// Events of finished batches, recorded again by later ones (creating and
    /// destroying one per batch costs two driver calls).
    spare: Mutex<Vec<Arc<D::Fence>>>,
    /// Whether copy lists are stamped ([`DeviceMemory::stamp_copies`]): read
    /// by every `copy_after`, so that an unstamped one takes no lock.
    stamping: AtomicBool,
    stamps: Mutex<Option<Stamps<D::Event>>>,
}

/// The events of a stamped pass: the origin, recorded on the host stream
/// when stamping started, and each list's (ticket, start, end, host
/// microseconds its launches took to queue).
struct Stamps<E> {
    origin: E,
    lists: Vec<(u64, E, E, f64)>,
}

impl<D: MemoryDriver> DeviceMem<D> {
    /// The memory on `host`, a driver on a stream of its own whose loaded
    /// kernels include `copy_table`; its copy streams are made here.
    pub(crate) fn new(host: D) -> Result<Self> {
        let op = "device memory";
        let copy_table = Kernel(host.function("copy_table").map_err(dev(op))?);
        let copy_gate = Kernel(host.function("copy_gate").map_err(dev(op))?);
        let copy_table_small = match host.table_copies() > SMALL_TABLE_COPIES {
            true => Some(Kernel(host.function("copy_table_small").map_err(dev(op))?)),
            false => None,
        };
        let copy_streams = (0..COPY_STREAMS).map(|_| host.with_new_stream().map_err(dev(op))).collect::<Result<Vec<_>>>()?;
        Ok(DeviceMem {
            table_copies: host.table_copies(),
            host,
            copy_streams,
            next_stream: AtomicUsize::new(0),
            copy_table,
            copy_table_small,
            copy_gate,
            next: AtomicU64::new(1),
            events: Mutex::new(HashMap::new()),
            spare: Mutex::new(Vec::new()),
            stamping: AtomicBool::new(false),
            stamps: Mutex::new(None),
        })
    }

    fn bind(&self, op: &'static str) -> Result<()> {
        self.host.bind().map_err(dev(op))
    }

    fn sync(&self, op: &'static str) -> Result<()> {
        self.host.synchronize().map_err(dev(op))
    }

    /// The grid of a `copy_table` launch of `words` words: one block a
    /// chunk of COPY_THREADS x COPY_UNROLL words (memcopy.hip: a grid-stride
    /// loop over the table at three blocks a multiprocessor moved a flagship
    /// pass at 0.79 of the device copy on an H100, where a block a chunk
    /// moves its widest rows at 0.95).
    pub(super) fn table_grid(&self, words: u64) -> u32 {
        words.div_ceil(COPY_THREADS as u64 * COPY_UNROLL).clamp(1, u32::MAX as u64) as u32
    }

    /// Queues `copies` (no two conflicting, at most `table_copies`, none
    /// empty, each of fewer than COPY_WORDS words) as one `copy_table`
    /// launch, `copy_table_small` where it has one and they fit.
    fn launch_table(&self, op: &'static str, stream: &D, copies: &[Copy2d]) -> Result<()> {
        let (f, cap) = match &self.copy_table_small {
            Some(small) if copies.len() <= SMALL_TABLE_COPIES => (small.0, SMALL_TABLE_COPIES),
            _ => (self.copy_table.0, self.table_copies),
        };
        let (t, words) = CopyTable::of(copies, cap);
        let grid_x = self.table_grid(words);
        // Bound before each launch, as cudarc's launch did for CUDA.
        stream.bind().map_err(dev(op))?;
        // SAFETY: the table as copy_table takes it (its only parameter); the
        // caller of `copy` guarantees every range.
        unsafe { stream.launch_args(f, (grid_x, 1, 1), COPY_THREADS, 0, Some(t.bytes()), &[]) }.map_err(dev(op))
    }

    /// Queues `copies` through `copy_table`, in as many launches as
    /// [`table_launches`] needs to keep their order.
    fn launch_tables(&self, op: &'static str, stream: &D, copies: &[Copy2d]) -> Result<()> {
        for r in table_launches(copies, self.table_copies) {
            self.launch_table(op, stream, &copies[r])?;
        }
        Ok(())
    }

    /// Queues one copy on the copy engines (a plain or a 2D copy).
    ///
    /// # Safety
    /// As [`DeviceMemory::copy`].
    unsafe fn engine_copy(&self, op: &'static str, stream: &D, c: &Copy2d) -> Result<()> {
        // SAFETY: the caller guarantees every range lies in a live allocation.
        let r = if contiguous(c) {
            unsafe { stream.copy_dtod(c.dst, c.src, (c.width * c.height) as usize) }
        } else {
            unsafe { stream.copy_2d(c.dst, c.dst_pitch, c.src, c.src_pitch, c.width, c.height) }
        };
        r.map_err(dev(op))
    }

    /// Queues `copies` on `stream`: large contiguous copies on the copy
    /// engines, the rest through copy_table, in the list's order (the table
    /// copies before an engine copy are queued before it).
    ///
    /// # Safety
    /// As [`DeviceMemory::copy`].
    unsafe fn queue_copies(&self, op: &'static str, stream: &D, copies: &[Copy2d]) -> Result<()> {
        let engine = |c: &Copy2d| (contiguous(c) && c.width * c.height >= ENGINE_BYTES) || c.width / word_bytes(c) >= COPY_WORDS;
        let mut pending: Vec<Copy2d> = Vec::new();
        for c in copies.iter().filter(|c| c.width > 0 && c.height > 0) {
            if engine(c) {
                self.launch_tables(op, stream, &pending)?;
                pending.clear();
                // SAFETY: the caller guarantees every range.
                unsafe { self.engine_copy(op, stream, c)? };
            } else {
                // Whole rows, fewer than COPY_WORDS words a part.
                let rows = (COPY_WORDS / (c.width / word_bytes(c)).max(1)).max(1);
                let mut r0 = 0;
                while r0 < c.height {
                    let h = rows.min(c.height - r0);
                    pending.push(Copy2d { src: c.src + r0 * c.src_pitch, dst: c.dst + r0 * c.dst_pitch, height: h, ..*c });
                    r0 += h;
                }
            }
        }
        self.launch_tables(op, stream, &pending)
    }

    fn event_of(&self, op: &'static str, ticket: CopyTicket) -> Result<Arc<D::Fence>> {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ticket.0)
            .cloned()
            .ok_or_else(|| KernelError::InvalidShape { op, reason: format!("unknown copy ticket {}", ticket.0) })
    }
}

impl<D: MemoryDriver> DeviceMemory for DeviceMem<D>
where
    D::Event: Send,
{
    fn label(&self) -> String {
        format!("{}:{}", D::NAME, self.host.ordinal())
    }

    fn alloc(&self, len: u64) -> Result<u64> {
        let op = "region alloc";
        self.bind(op)?;
        let n = usize::try_from(len.max(1)).map_err(|_| KernelError::SizeOverflow { op, dims: vec![] })?;
        let p = self.host.alloc(n).map_err(dev(op))?;
        // SAFETY: p is a fresh allocation of n bytes.
        if let Err(e) = unsafe { self.host.memset_zero(p, n) } {
            // SAFETY: p came from alloc and nothing uses it.
            unsafe { self.host.free(p) };
            return Err(dev(op)(e));
        }
        self.sync(op)?;
        Ok(p)
    }

    unsafe fn free(&self, addr: u64) {
        if self.bind("region free").is_ok() {
            // SAFETY: the caller guarantees addr came from alloc and is unused.
            unsafe { self.host.free(addr) };
        }
    }

    fn export(&self, addr: u64) -> Result<Vec<u8>> {
        let op = "ipc export";
        self.bind(op)?;
        Ok(self.host.ipc_export(addr).map_err(dev(op))?.to_vec())
    }

    fn open(&self, handle: &[u8]) -> Result<u64> {
        let op = "ipc open";
        let h: &[u8; IPC_HANDLE_BYTES] = handle
            .try_into()
            .map_err(|_| KernelError::InvalidShape { op, reason: format!("an IPC handle has {IPC_HANDLE_BYTES} bytes, got {}", handle.len()) })?;
        self.bind(op)?;
        self.host.ipc_open(h).map_err(dev(op))
    }

    unsafe fn close(&self, addr: u64) {
        // Copies into it may still be queued on any copy stream.
        let idle = self.copy_streams.iter().all(|s| s.synchronize().is_ok());
        if self.bind("ipc close").is_ok() && idle {
            // SAFETY: the caller guarantees addr came from open and is unused.
            let _ = unsafe { self.host.ipc_close(addr) };
        }
    }

    unsafe fn copy(&self, copies: &[Copy2d]) -> Result<CopyTicket> {
        // SAFETY: the caller's contract.
        unsafe { self.copy_after(copies, &[]) }
    }

    unsafe fn copy_after(&self, copies: &[Copy2d], after: &[StreamMark]) -> Result<CopyTicket> {
        let op = "region copy";
        self.bind(op)?;
        let stream = &self.copy_streams[self.next_stream.fetch_add(1, Ordering::Relaxed) % self.copy_streams.len()];
        // The layers these copies carry were computed on a backend's stream:
        // the batch's stream waits for them on the device, before its first
        // copy (so the batch's event, and with it the write-done report,
        // follows the layers too).
        super::marks::wait_on(stream, after)?;
        let stamped = self.stamping.load(Ordering::Acquire);
        let start = if stamped { Some(stream.record_event().map_err(dev(op))?) } else { None };
        let queued = std::time::Instant::now();
        // SAFETY: the caller's contract.
        unsafe { self.queue_copies(op, stream, copies)? };
        let t = self.next.fetch_add(1, Ordering::Relaxed);
        if let Some(start) = start {
            let queue_us = queued.elapsed().as_secs_f64() * 1e6;
            let end = stream.record_event().map_err(dev(op))?;
            if let Some(s) = self.stamps.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
                s.lists.push((t, start, end, queue_us));
            }
        }
        let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let ev = match spare {
            Some(ev) => ev,
            None => Arc::new(stream.new_fence().map_err(dev(op))?),
        };
        stream.record_fence(&ev).map_err(dev(op))?;
        self.events.lock().unwrap_or_else(|p| p.into_inner()).insert(t, ev);
        Ok(CopyTicket(t))
    }

    fn done(&self, ticket: CopyTicket) -> Result<bool> {
        let op = "region copy";
        let mut events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let ev = events.get(&ticket.0).ok_or_else(|| KernelError::InvalidShape { op, reason: format!("unknown copy ticket {}", ticket.0) })?;
        let done = self.host.fence_done(ev);
        match done {
            Ok(false) => Ok(false),
            Ok(true) => {
                events.remove(&ticket.0);
                Ok(true)
            }
            Err(e) => {
                events.remove(&ticket.0);
                Err(dev(op)(e))
            }
        }
    }

    fn wait(&self, ticket: CopyTicket) -> Result<()> {
        let op = "region copy";
        let ev = self.event_of(op, ticket)?;
        // Query for a short while first (a copy batch often finishes within
        // it, and a sleep in the driver costs a wake-up of hundreds of
        // microseconds on this machine), then sleep in the driver.
        let started = std::time::Instant::now();
        let r = loop {
            match self.host.fence_done(&ev) {
                Ok(true) => break Ok(()),
                Ok(false) if started.elapsed() < SPIN_BEFORE_SLEEP => std::thread::yield_now(),
                Ok(false) => break self.host.fence_wait(&ev).map_err(dev(op)),
                Err(e) => break Err(dev(op)(e)),
            }
        };
        let taken = self.events.lock().unwrap_or_else(|p| p.into_inner()).remove(&ticket.0);
        drop(ev);
        if let Some(ev) = taken.filter(|e| r.is_ok() && Arc::strong_count(e) == 1) {
            self.spare.lock().unwrap_or_else(|p| p.into_inner()).push(ev);
        }
        r
    }

    fn stamp_copies(&self, on: bool) -> Result<()> {
        let op = "copy stamps";
        let mut stamps = self.stamps.lock().unwrap_or_else(|p| p.into_inner());
        *stamps = None;
        if on {
            self.bind(op)?;
            *stamps = Some(Stamps { origin: self.host.record_event().map_err(dev(op))?, lists: Vec::new() });
        }
        self.stamping.store(on, Ordering::Release);
        Ok(())
    }

    fn take_copy_stamps(&self) -> Result<Vec<CopyStamp>> {
        let op = "copy stamps";
        self.stamping.store(false, Ordering::Release);
        let Some(s) = self.stamps.lock().unwrap_or_else(|p| p.into_inner()).take() else { return Ok(Vec::new()) };
        self.bind(op)?;
        for stream in &self.copy_streams {
            stream.synchronize().map_err(dev(op))?;
        }
        let us = |e: &D::Event| self.host.elapsed_ms(&s.origin, e).map(|ms| f64::from(ms) * 1e3).map_err(dev(op));
        s.lists.iter().map(|(t, start, end, q)| Ok(CopyStamp { ticket: CopyTicket(*t), start_us: us(start)?, end_us: us(end)?, queue_us: *q })).collect()
    }

    unsafe fn time_copies(&self, copies: &[Copy2d]) -> Result<std::time::Duration> {
        let op = "region copy timing";
        self.bind(op)?;
        let stream = &self.copy_streams[self.next_stream.fetch_add(1, Ordering::Relaxed) % self.copy_streams.len()];
        // The gate holds the stream while the start event, the launches and
        // the end event are queued behind it: the interval is the device's.
        stream.bind().map_err(dev(op))?;
        // SAFETY: copy_gate takes one i64 and touches no memory.
        unsafe { stream.launch_args(self.copy_gate.0, (1, 1, 1), 1, 0, None, &[Arg::L(GATE_CYCLES)]) }.map_err(dev(op))?;
        let start = stream.record_event().map_err(dev(op))?;
        // SAFETY: the caller's contract.
        unsafe { self.queue_copies(op, stream, copies)? };
        let end = stream.record_event().map_err(dev(op))?;
        stream.synchronize().map_err(dev(op))?;
        let ms = stream.elapsed_ms(&start, &end).map_err(dev(op))?;
        Ok(std::time::Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
    }

    unsafe fn read(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        let op = "region read";
        if out.is_empty() {
            return Ok(());
        }
        self.bind(op)?;
        // SAFETY: the caller guarantees the range; out stays borrowed until the sync.
        unsafe { self.host.download(out, addr) }.map_err(dev(op))?;
        self.sync(op)
    }

    unsafe fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        let op = "region write";
        if data.is_empty() {
            return Ok(());
        }
        self.bind(op)?;
        // SAFETY: the caller guarantees the range; data stays borrowed until the sync.
        unsafe { self.host.upload(addr, data) }.map_err(dev(op))?;
        self.sync(op)
    }
}
