//! [`DeviceMemory`] on CUDA: regions as plain `cuMemAlloc` allocations (the
//! stream-ordered pools cudarc allocates buffers from cannot be exported), IPC
//! handles (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle`), and copies queued on
//! streams of their own, each batch followed by an event that
//! [`DeviceMemory::done`] queries. A batch's copies go through one small
//! kernel of its own (`kernels/hip/memcopy.hip`), up to 48 copies a launch
//! with the table as the launch's argument; only large contiguous copies go
//! to the copy engines. The memory shares its backend's context, so the
//! backend's kernels and these copies see one address space.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaStream, DeviceRepr, DriverError, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use crate::error::{KernelError, Result};
use crate::region::{Copy2d, CopyTicket, DeviceMemory, TABLE_COPIES, table_launches};

/// Bytes of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// Contiguous copies of at least this many bytes go to the copy engines;
/// everything else goes through `copy_table`. A copy-engine call into memory
/// opened through IPC cost about 15 us of host time on the H200 (the
/// hand-off bench's timeline: 64 such calls for the KDA state took most of a
/// millisecond to queue), where one table launch queues 48 copies.
const ENGINE_BYTES: u64 = 256 << 20;
/// How long [`DeviceMemory::wait`] queries an event before it sleeps on it.
const SPIN_BEFORE_SLEEP: std::time::Duration = std::time::Duration::from_micros(500);
/// Streams copy batches are spread over.
const COPY_STREAMS: usize = 8;
/// Threads of a `copy_table` block; each copies one word per turn.
const COPY_THREADS: u32 = 256;
/// Blocks of a `copy_table` launch at most (a grid-stride loop covers the rest).
const COPY_BLOCKS: u64 = 4096;
/// Words of one copy in a table at most (the kernel's 32-bit row division);
/// a larger copy is queued in parts of whole rows.
const COPY_WORDS: u64 = 1 << 31;

/// `hk_copy_table` of memcopy.hip, the by-value argument of `copy_table`.
#[repr(C)]
struct CopyTable {
    /// src, dst, words per row, height, src pitch, dst pitch, word bytes.
    c: [[i64; 7]; TABLE_COPIES],
    /// First word of each copy; `start[n]` is the count.
    start: [i64; TABLE_COPIES + 1],
    n: i32,
    pad: i32,
}

/// The word a copy moves in: 16, 4 or 1 bytes, the largest dividing both
/// addresses, both pitches (when there is more than one row) and the width.
fn word_bytes(c: &Copy2d) -> u64 {
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

// SAFETY: plain integers in the C layout of hk_copy_table (3,088 bytes,
// within the 4 KB kernel argument limit).
unsafe impl DeviceRepr for CopyTable {}

/// CUDA device memory for a transport's regions (see the module docs).
pub struct CudaMemory {
    ctx: Arc<CudaContext>,
    /// Host-side access and allocation.
    stream: Arc<CudaStream>,
    /// Copy batches go round robin over these: one batch stays on one stream
    /// (its copies run in order), batches overlap on the device, since one
    /// stream would run every small copy and kernel after the other.
    copy_streams: Vec<Arc<CudaStream>>,
    next_stream: std::sync::atomic::AtomicUsize,
    copy_table: CudaFunction,
    next: AtomicU64,
    /// Each batch's event (blocking-sync: a waiting thread sleeps in the
    /// driver instead of spinning on it).
    events: Mutex<HashMap<u64, Arc<CudaEvent>>>,
    /// Events of finished batches, recorded again by later ones (creating and
    /// destroying one per batch costs two driver calls).
    spare: Mutex<Vec<Arc<CudaEvent>>>,
}

fn dev(op: &'static str) -> impl Fn(DriverError) -> KernelError {
    move |e| KernelError::Device { op, message: e.to_string() }
}

impl CudaMemory {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Result<Self> {
        let op = "device memory";
        let stream = ctx.new_stream().map_err(dev(op))?;
        // The one kernel it launches, compiled on its own (a few tens of ms),
        // so that a transport opens without the model's kernels.
        let (maj, min) = ctx.compute_capability().map_err(dev(op))?;
        let program = super::program_of(|name| name == "memcopy.hip");
        let cubin = super::cuda::nvrtc_cubin_of(&program, &format!("{maj}{min}"))?;
        let module = ctx.load_module(Ptx::from_binary(cubin)).map_err(dev(op))?;
        let copy_table = module.load_function("copy_table").map_err(dev(op))?;
        let copy_streams = (0..COPY_STREAMS).map(|_| ctx.new_stream().map_err(dev(op))).collect::<Result<Vec<_>>>()?;
        Ok(CudaMemory {
            ctx,
            stream,
            copy_streams,
            next_stream: std::sync::atomic::AtomicUsize::new(0),
            copy_table,
            next: AtomicU64::new(1),
            events: Mutex::new(HashMap::new()),
            spare: Mutex::new(Vec::new()),
        })
    }

    fn bind(&self, op: &'static str) -> Result<()> {
        self.ctx.bind_to_thread().map_err(dev(op))
    }

    fn sync(&self, op: &'static str) -> Result<()> {
        self.stream.synchronize().map_err(dev(op))
    }

    /// Queues `copies` (no two conflicting, at most TABLE_COPIES, none empty,
    /// each of fewer than COPY_WORDS words) as one `copy_table` launch.
    fn launch_table(&self, op: &'static str, stream: &CudaStream, copies: &[Copy2d]) -> Result<()> {
        let mut t = CopyTable { c: [[0; 7]; TABLE_COPIES], start: [0; TABLE_COPIES + 1], n: copies.len() as i32, pad: 0 };
        let mut words = 0u64;
        for (i, c) in copies.iter().enumerate() {
            let wb = word_bytes(c);
            let per_row = c.width / wb;
            t.c[i] = [c.src, c.dst, per_row, c.height, c.src_pitch, c.dst_pitch, wb].map(|v| v as i64);
            t.start[i] = words as i64;
            words += per_row * c.height;
        }
        t.start[copies.len()] = words as i64;
        let grid_x = words.div_ceil(COPY_THREADS as u64).clamp(1, COPY_BLOCKS) as u32;
        let cfg = LaunchConfig { grid_dim: (grid_x, 1, 1), block_dim: (COPY_THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut b = stream.launch_builder(&self.copy_table);
        b.arg(&t);
        // SAFETY: the table as copy_table takes it; the caller of `copy`
        // guarantees every range.
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        Ok(())
    }

    /// Queues `copies` through `copy_table`, in as many launches as
    /// [`table_launches`] needs to keep their order.
    fn launch_tables(&self, op: &'static str, stream: &CudaStream, copies: &[Copy2d]) -> Result<()> {
        for r in table_launches(copies) {
            self.launch_table(op, stream, &copies[r])?;
        }
        Ok(())
    }

    /// Queues one copy on the copy engines (a plain or a 2D copy).
    ///
    /// # Safety
    /// As [`DeviceMemory::copy`].
    unsafe fn engine_copy(&self, op: &'static str, s: sys::CUstream, c: &Copy2d) -> Result<()> {
        let contiguous = c.height == 1 || (c.src_pitch == c.width && c.dst_pitch == c.width);
        // SAFETY: the caller guarantees every range lies in a live allocation.
        let r = if contiguous {
            unsafe { sys::cuMemcpyDtoDAsync_v2(c.dst, c.src, (c.width * c.height) as usize, s) }
        } else {
            let m = sys::CUDA_MEMCPY2D_st {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                srcHost: std::ptr::null(),
                srcDevice: c.src,
                srcArray: std::ptr::null_mut(),
                srcPitch: c.src_pitch as usize,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                dstHost: std::ptr::null_mut(),
                dstDevice: c.dst,
                dstArray: std::ptr::null_mut(),
                dstPitch: c.dst_pitch as usize,
                WidthInBytes: c.width as usize,
                Height: c.height as usize,
            };
            unsafe { sys::cuMemcpy2DAsync_v2(&m, s) }
        };
        r.result().map_err(dev(op))
    }
}

impl DeviceMemory for CudaMemory {
    fn label(&self) -> String {
        format!("cuda:{}", self.ctx.ordinal())
    }

    fn alloc(&self, len: u64) -> Result<u64> {
        let op = "region alloc";
        self.bind(op)?;
        let n = usize::try_from(len.max(1)).map_err(|_| KernelError::SizeOverflow { op, dims: vec![] })?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: p is valid for writes; the context is bound to this thread.
        unsafe { sys::cuMemAlloc_v2(&mut p, n) }.result().map_err(dev(op))?;
        // SAFETY: p is a fresh allocation of n bytes.
        if let Err(e) = unsafe { sys::cuMemsetD8Async(p, 0, n, self.stream.cu_stream()) }.result() {
            unsafe { sys::cuMemFree_v2(p) };
            return Err(dev(op)(e));
        }
        self.sync(op)?;
        Ok(p)
    }

    unsafe fn free(&self, addr: u64) {
        if self.bind("region free").is_ok() {
            // SAFETY: the caller guarantees addr came from alloc and is unused.
            let _ = unsafe { sys::cuMemFree_v2(addr) };
        }
    }

    fn export(&self, addr: u64) -> Result<Vec<u8>> {
        let op = "ipc export";
        self.bind(op)?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; IPC_HANDLE_BYTES] };
        // SAFETY: h is valid for writes; addr is an allocation of this context.
        unsafe { sys::cuIpcGetMemHandle(&mut h, addr) }.result().map_err(dev(op))?;
        Ok(h.reserved.iter().map(|&c| c as u8).collect())
    }

    fn open(&self, handle: &[u8]) -> Result<u64> {
        let op = "ipc open";
        if handle.len() != IPC_HANDLE_BYTES {
            return Err(KernelError::InvalidShape { op, reason: format!("an IPC handle has {IPC_HANDLE_BYTES} bytes, got {}", handle.len()) });
        }
        self.bind(op)?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; IPC_HANDLE_BYTES] };
        for (d, &b) in h.reserved.iter_mut().zip(handle) {
            *d = b as _;
        }
        let mut p: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: p is valid for writes; the driver checks the handle.
        unsafe { sys::cuIpcOpenMemHandle_v2(&mut p, h, flags) }.result().map_err(dev(op))?;
        Ok(p)
    }

    unsafe fn close(&self, addr: u64) {
        // Copies into it may still be queued on any copy stream.
        let idle = self.copy_streams.iter().all(|s| s.synchronize().is_ok());
        if self.bind("ipc close").is_ok() && idle {
            // SAFETY: the caller guarantees addr came from open and is unused.
            let _ = unsafe { sys::cuIpcCloseMemHandle(addr) };
        }
    }

    unsafe fn copy(&self, copies: &[Copy2d]) -> Result<CopyTicket> {
        let op = "region copy";
        self.bind(op)?;
        let stream = &self.copy_streams[self.next_stream.fetch_add(1, Ordering::Relaxed) % self.copy_streams.len()];
        let s = stream.cu_stream();
        // Large contiguous copies go to the copy engines, the rest through
        // copy_table; all on the batch's stream, in the batch's order (the
        // table copies before an engine copy are queued before it).
        let contiguous = |c: &Copy2d| c.height == 1 || (c.src_pitch == c.width && c.dst_pitch == c.width);
        let engine = |c: &Copy2d| (contiguous(c) && c.width * c.height >= ENGINE_BYTES) || c.width / word_bytes(c) >= COPY_WORDS;
        let mut pending: Vec<Copy2d> = Vec::new();
        for c in copies.iter().filter(|c| c.width > 0 && c.height > 0) {
            if engine(c) {
                self.launch_tables(op, stream, &pending)?;
                pending.clear();
                // SAFETY: the caller guarantees every range.
                unsafe { self.engine_copy(op, s, c)? };
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
        self.launch_tables(op, stream, &pending)?;
        let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let ev = match spare {
            Some(ev) => ev,
            None => {
                let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC;
                Arc::new(self.ctx.new_event(Some(flags)).map_err(dev(op))?)
            }
        };
        ev.record(stream).map_err(dev(op))?;
        let t = self.next.fetch_add(1, Ordering::Relaxed);
        self.events.lock().unwrap_or_else(|p| p.into_inner()).insert(t, ev);
        Ok(CopyTicket(t))
    }

    fn done(&self, ticket: CopyTicket) -> Result<bool> {
        let op = "region copy";
        let mut events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let ev = events.get(&ticket.0).ok_or_else(|| KernelError::InvalidShape { op, reason: format!("unknown copy ticket {}", ticket.0) })?;
        let done = ev.try_is_complete();
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
        let ev = self
            .events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ticket.0)
            .cloned()
            .ok_or_else(|| KernelError::InvalidShape { op, reason: format!("unknown copy ticket {}", ticket.0) })?;
        // Query for a short while first (a copy batch often finishes within
        // it, and a sleep in the driver costs a wake-up of hundreds of
        // microseconds on this machine), then sleep in the driver.
        let started = std::time::Instant::now();
        let r = loop {
            match ev.try_is_complete() {
                Ok(true) => break Ok(()),
                Ok(false) if started.elapsed() < SPIN_BEFORE_SLEEP => std::thread::yield_now(),
                Ok(false) => break ev.synchronize().map_err(dev(op)),
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

    unsafe fn read(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        let op = "region read";
        if out.is_empty() {
            return Ok(());
        }
        self.bind(op)?;
        // SAFETY: the caller guarantees the range; out stays borrowed until the sync.
        unsafe { sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), addr, out.len(), self.stream.cu_stream()) }.result().map_err(dev(op))?;
        self.sync(op)
    }

    unsafe fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        let op = "region write";
        if data.is_empty() {
            return Ok(());
        }
        self.bind(op)?;
        // SAFETY: the caller guarantees the range; data stays borrowed until the sync.
        unsafe { sys::cuMemcpyHtoDAsync_v2(addr, data.as_ptr().cast(), data.len(), self.stream.cu_stream()) }.result().map_err(dev(op))?;
        self.sync(op)
    }
}
