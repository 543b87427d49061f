//! The seam between the launch table and a GPU driver.
//!
//! The fused decode step (`gpu/step_gpu/`) decides every launch once, as plain
//! data: which kernel, the grid, the block, the dynamic shared memory and a
//! flat list of arguments ([`Launch`]). Running that list is the only thing
//! that differs between CUDA and HIP, so it goes through [`Driver`], a handful
//! of calls that the CUDA driver API (cudarc, `gpu/cuda/driver.rs`) and the
//! HIP runtime (hip-sys, `gpu/hip/driver.rs`) both have: load a kernel by
//! name, allocate, copy, zero, launch, wait, capture a graph and replay it,
//! time with events. The kernels are one set of sources (`kernels/hip/`), so
//! the same list names the same kernels with the same arguments on both.
//!
//! The generic ops of the backends (`gpu/ops/`, `GpuBackend<D>`) go through
//! the same trait: their buffers are allocated, copied and freed on the
//! driver's stream ([`Driver::alloc_async`], [`Driver::copy_dtod`],
//! [`Driver::free_async`]) and their kernels launched with
//! [`Driver::launch_args`].
//!
//! The trait and its types are `pub` only so that the public buffer and
//! backend aliases (`CudaBuf = DeviceBuf<f32, CudaDriver>`, ...) may name
//! them; the module is private, so nothing outside the crate can.

use std::ffi::c_void;

use crate::error::{KernelError, Result};

/// What a driver call reported, in the driver's own words (cudarc's
/// `DriverError` text, or the HIP error's name and description). Call sites
/// turn it into a [`KernelError`] that names the op.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DriverFault(pub(crate) String);

/// Maps a driver fault of op `op` to a `KernelError::Device`.
pub(crate) fn dev(op: &'static str) -> impl Fn(DriverFault) -> KernelError {
    move |e| KernelError::Device { op, message: e.0 }
}

/// The calls a launch list needs from a GPU driver. Addresses are device
/// pointers as integers (`CUdeviceptr`, `hipDeviceptr_t`); one stream per
/// driver value, on which everything is queued in call order. Send and Sync:
/// a backend and its buffers move between threads (each call binds the
/// device first).
pub trait Driver: Clone + Send + Sync + 'static {
    /// A loaded kernel (`CUfunction`, `hipFunction_t`), valid while the
    /// driver's modules are loaded.
    type Func: Copy;
    /// An instantiated, replayable graph of captured launches.
    type Graph;
    /// A timing event recorded on the stream.
    type Event;
    /// The backend's name, first word of its refusals ("cuda", "hip").
    const NAME: &'static str;
    /// The platform's name in prose ("CUDA graphs", "HIP graphs").
    const LABEL: &'static str;
    /// The prefix of the backend's public type names ("Cuda": `CudaBackend`,
    /// `CudaBuf`), for their `Debug` text.
    const TYPE_PREFIX: &'static str;

    /// The kernel `name` of the loaded modules.
    fn function(&self, name: &str) -> std::result::Result<Self::Func, DriverFault>;
    /// Lets `f` take `bytes` of dynamic shared memory a block (CUDA opts in
    /// past 48 KiB; HIP has no opt-in, so there it checks the device's limit).
    fn set_max_dynamic_smem(&self, f: Self::Func, bytes: u32) -> std::result::Result<(), DriverFault>;
    /// Asks for the largest shared-memory carveout for `f`, so that two of its
    /// blocks share a multiprocessor.
    fn prefer_shared_carveout(&self, f: Self::Func) -> std::result::Result<(), DriverFault>;
    /// Multiprocessors (compute units) of the device.
    fn multiprocessors(&self) -> std::result::Result<usize, DriverFault>;
    /// Makes the driver's device current on this thread.
    fn bind(&self) -> std::result::Result<(), DriverFault>;
    /// A device allocation of `bytes` (not zeroed).
    fn alloc(&self, bytes: usize) -> std::result::Result<u64, DriverFault>;
    /// Frees an allocation of [`Driver::alloc`].
    ///
    /// # Safety
    /// `ptr` came from `alloc` on this driver and is freed once, after the
    /// work that uses it.
    unsafe fn free(&self, ptr: u64);
    /// A stream-ordered allocation of `bytes` (not zeroed) for an op's buffer
    /// or scratch: CUDA's `cuMemAllocAsync` where the device has it (freed
    /// memory then stays in the stream's pool), else `cuMemAlloc`; HIP's
    /// `hipMalloc`.
    fn alloc_async(&self, bytes: usize) -> std::result::Result<u64, DriverFault>;
    /// Frees an allocation of [`Driver::alloc_async`] after the work queued
    /// before it on the stream (CUDA: `cuMemFreeAsync`, or a wait and
    /// `cuMemFree`; HIP: `hipFree`, which waits for the device). A failure is
    /// kept where the driver keeps one (CUDA: the context's error state,
    /// reported by the next [`Driver::bind`]).
    ///
    /// # Safety
    /// `ptr` came from `alloc_async` on this driver and is freed once.
    unsafe fn free_async(&self, ptr: u64);
    /// Copies `bytes` from `src` to `dst` on the device, queued on the stream.
    ///
    /// # Safety
    /// Both hold at least `bytes` bytes.
    unsafe fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> std::result::Result<(), DriverFault>;
    /// Zeroes `bytes` at `ptr`, queued on the stream.
    ///
    /// # Safety
    /// `ptr` holds at least `bytes` bytes.
    unsafe fn memset_zero(&self, ptr: u64, bytes: usize) -> std::result::Result<(), DriverFault>;
    /// Copies `src` to `dst`, queued on the stream (pageable host memory: the
    /// copy has read `src` when the call returns).
    ///
    /// # Safety
    /// `dst` holds at least `size_of_val(src)` bytes.
    unsafe fn upload<T: Copy>(&self, dst: u64, src: &[T]) -> std::result::Result<(), DriverFault>;
    /// Copies `dst.len()` values from `src`, queued on the stream; `dst` holds
    /// them after [`Driver::synchronize`].
    ///
    /// # Safety
    /// `src` holds at least `size_of_val(dst)` bytes.
    unsafe fn download<T: Copy>(&self, dst: &mut [T], src: u64) -> std::result::Result<(), DriverFault>;
    /// Launches `f` on the stream; `params` points at each argument's value.
    ///
    /// # Safety
    /// `params` matches the kernel's signature and every address in it is
    /// valid for what the kernel reads and writes.
    unsafe fn launch(&self, f: Self::Func, grid: (u32, u32, u32), block: u32, smem: u32, params: &mut [*mut c_void]) -> std::result::Result<(), DriverFault>;
    /// Whether [`Driver::launch_dependent`] overlaps a launch with the
    /// kernel before it on this device (CUDA on sm_90 and later).
    fn dependent_launch(&self) -> bool {
        false
    }
    /// Launches `f` as a programmatic dependent of the kernel queued before it
    /// on the stream: the device may launch it while that kernel's last blocks
    /// still run, and each of its blocks waits in `HK_GRID_DEP` (prelude.h)
    /// until that kernel has completed and its writes are visible. A driver
    /// without it launches in plain stream order, which is what HK_GRID_DEP
    /// then amounts to: the bits are the same either way.
    ///
    /// # Safety
    /// As [`Driver::launch`], and `f` begins with `HK_GRID_DEP()`.
    unsafe fn launch_dependent(
        &self,
        f: Self::Func,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        params: &mut [*mut c_void],
    ) -> std::result::Result<(), DriverFault> {
        // SAFETY: the caller's contract.
        unsafe { self.launch(f, grid, block, smem, params) }
    }
    /// Launches `f` with `args` by value, after `head` where the kernel's
    /// first parameter is a struct passed by value (the units kernels'
    /// `hk_mm_units` table: its bytes, in the C layout). A recording driver
    /// (the tests) overrides this to keep the arguments as they are.
    ///
    /// # Safety
    /// As [`Driver::launch`]: `head` and `args` match the kernel's signature.
    unsafe fn launch_args(
        &self,
        f: Self::Func,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        head: Option<&[u8]>,
        args: &[Arg],
    ) -> std::result::Result<(), DriverFault> {
        let mut vals: Vec<u64> = args.iter().map(|a| a.word()).collect();
        let mut params: Vec<*mut c_void> = Vec::with_capacity(vals.len() + 1);
        if let Some(h) = head {
            // The driver reads the struct's bytes through this pointer (it
            // copies them when the launch is queued; `h` outlives the call).
            params.push(h.as_ptr() as *mut c_void);
        }
        for v in vals.iter_mut() {
            params.push(v as *mut u64 as *mut c_void);
        }
        // SAFETY: the caller's contract; each pointer is live for the call.
        unsafe { self.launch(f, grid, block, smem, &mut params) }
    }
    /// Waits for everything queued on the stream.
    fn synchronize(&self) -> std::result::Result<(), DriverFault>;
    /// Starts capturing the stream's work into a graph (this thread's only).
    fn begin_capture(&self) -> std::result::Result<(), DriverFault>;
    /// Ends the capture: the instantiated graph, or None when nothing was captured.
    fn end_capture(&self) -> std::result::Result<Option<Self::Graph>, DriverFault>;
    /// Makes a captured graph ready before its first replay (CUDA uploads it).
    fn prepare_graph(&self, g: &Self::Graph) -> std::result::Result<(), DriverFault>;
    /// Replays a graph on the stream.
    fn replay(&self, g: &Self::Graph) -> std::result::Result<(), DriverFault>;
    /// Records an event on the stream.
    fn record_event(&self) -> std::result::Result<Self::Event, DriverFault>;
    /// Milliseconds between two recorded events (after they completed).
    fn elapsed_ms(&self, start: &Self::Event, end: &Self::Event) -> std::result::Result<f32, DriverFault>;
}

/// Bytes of an IPC memory handle: CUDA's `CUipcMemHandle` and HIP's
/// `hipIpcMemHandle_t` both hold 64 (the transport hex-encodes them).
pub const IPC_HANDLE_BYTES: usize = 64;

/// What device memory for registered regions (`gpu/ops/memory.rs`) needs of
/// a driver beyond launches: more streams, completion events a thread can
/// sleep on, copy-engine copies of strided rows, and IPC handles. A trait of
/// its own so that a driver that only runs launch lists (the step's test
/// recorder) need not fake them.
pub(crate) trait MemoryDriver: Driver {
    /// A completion event (`CUevent` with blocking sync, `hipEvent_t` with
    /// `hipEventBlockingSync`), recorded again and again.
    type Fence: Send + Sync;

    /// The device's ordinal, for the memory's label ("cuda:0").
    fn ordinal(&self) -> usize;
    /// Copies in one `copy_table` launch (`CT_COPIES` of memcopy.hip as this
    /// platform compiles it): [`crate::WIDE_TABLE_COPIES`] where kernel
    /// arguments may take 32 KB (CUDA 12.1+), [`crate::TABLE_COPIES`] where
    /// they stay within 4 KB.
    fn table_copies(&self) -> usize;
    /// The same device and loaded kernels on a new stream of its own (host
    /// access and each copy stream queue apart from the backend's ops).
    fn with_new_stream(&self) -> std::result::Result<Self, DriverFault>;
    /// Copies `height` rows of `width` bytes, row r from `src + r * src_pitch`
    /// to `dst + r * dst_pitch`, on the copy engines, queued on the stream.
    ///
    /// # Safety
    /// Every row lies in a live allocation of this device (or one opened here).
    unsafe fn copy_2d(&self, dst: u64, dst_pitch: u64, src: u64, src_pitch: u64, width: u64, height: u64) -> std::result::Result<(), DriverFault>;
    /// A completion event, not yet recorded; a thread waiting on it sleeps in
    /// the driver instead of spinning.
    fn new_fence(&self) -> std::result::Result<Self::Fence, DriverFault>;
    /// Records `f` on the stream, after everything queued before.
    fn record_fence(&self, f: &Self::Fence) -> std::result::Result<(), DriverFault>;
    /// Makes the work queued on this stream after the call wait, on the
    /// device, for the work before `f`'s last record (which may be on another
    /// stream of the device): `cuStreamWaitEvent`, `hipStreamWaitEvent`. The
    /// host does not wait; recording `f` again later does not change this wait.
    fn wait_fence(&self, f: &Self::Fence) -> std::result::Result<(), DriverFault>;
    /// Whether the work before `f`'s last record has completed (a query).
    fn fence_done(&self, f: &Self::Fence) -> std::result::Result<bool, DriverFault>;
    /// Waits (sleeping) until the work before `f`'s last record has completed.
    fn fence_wait(&self, f: &Self::Fence) -> std::result::Result<(), DriverFault>;
    /// The IPC handle of allocation `ptr` (from [`Driver::alloc`]).
    fn ipc_export(&self, ptr: u64) -> std::result::Result<[u8; IPC_HANDLE_BYTES], DriverFault>;
    /// Opens another process's exported allocation; its address here.
    fn ipc_open(&self, handle: &[u8; IPC_HANDLE_BYTES]) -> std::result::Result<u64, DriverFault>;
    /// Closes an address of [`MemoryDriver::ipc_open`].
    ///
    /// # Safety
    /// No queued work still uses `ptr`.
    unsafe fn ipc_close(&self, ptr: u64) -> std::result::Result<(), DriverFault>;
}

/// One kernel argument, by value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A device address (any pointer parameter).
    P(u64),
    /// A 64-bit integer (`hk_i64`).
    L(i64),
    /// A 32-bit integer (`int`, `unsigned`).
    I(i32),
    F(f32),
    D(f64),
}

impl Arg {
    /// The argument as 8 bytes of storage, read by the driver at the width the
    /// kernel declares (little-endian: an i32 or f32 is its first 4 bytes).
    fn word(self) -> u64 {
        match self {
            Arg::P(x) => x,
            Arg::L(x) => x as u64,
            Arg::I(x) => x as u32 as u64,
            Arg::F(x) => x.to_bits() as u64,
            Arg::D(x) => x.to_bits(),
        }
    }
}

/// One launch of a fixed sequence: the launch table's row.
pub(crate) struct Launch<F> {
    pub(crate) f: F,
    pub(crate) name: &'static str,
    pub(crate) grid: (u32, u32, u32),
    pub(crate) block: u32,
    pub(crate) smem: u32,
    pub(crate) args: Vec<Arg>,
}

/// Launches `list` in order on the driver's stream; with `dependent`, every
/// launch but the first as a programmatic dependent of the one before
/// ([`Driver::launch_dependent`]: the step's kernels all begin with
/// HK_GRID_DEP). The first follows the host's upload of the tick, which is a
/// copy, not a kernel.
pub(crate) fn launch_all<D: Driver>(drv: &D, list: &[Launch<D::Func>], dependent: bool) -> Result<()> {
    let op = "decode_step launch";
    drv.bind().map_err(dev(op))?;
    let mut vals: Vec<u64> = Vec::with_capacity(32);
    let mut params: Vec<*mut c_void> = Vec::with_capacity(32);
    for (i, l) in list.iter().enumerate() {
        vals.clear();
        params.clear();
        vals.extend(l.args.iter().map(|a| a.word()));
        for v in vals.iter_mut() {
            params.push(v as *mut u64 as *mut c_void);
        }
        // SAFETY: each argument list matches its kernel's signature in
        // hip/step.hip, step_mm.hip and mla.hip (a test holds every list the
        // step builds against those signatures); every address is an
        // allocation of the step or a registered region checked by
        // StepSpec::check and the tick's index checks.
        // Every kernel of a list begins with HK_GRID_DEP (a test holds the
        // sources to it).
        let launched = if dependent && i > 0 {
            unsafe { drv.launch_dependent(l.f, l.grid, l.block, l.smem, &mut params) }
        } else {
            unsafe { drv.launch(l.f, l.grid, l.block, l.smem, &mut params) }
        };
        launched.map_err(|e| KernelError::Device { op, message: format!("{}: {e}", l.name) })?;
    }
    Ok(())
}

/// Device memory owned by a step (or a check), each allocation zeroed when
/// made and freed with the arena.
pub(crate) struct Arena<D: Driver> {
    pub(crate) drv: D,
    allocs: Vec<u64>,
    pub(crate) bytes: u64,
}

impl<D: Driver> Arena<D> {
    pub(crate) fn new(drv: D) -> Arena<D> {
        Arena { drv, allocs: Vec::new(), bytes: 0 }
    }

    pub(crate) fn alloc(&mut self, bytes: usize) -> Result<u64> {
        let op = "decode_step alloc";
        self.drv.bind().map_err(dev(op))?;
        let n = bytes.max(16).next_multiple_of(256);
        let ptr = self.drv.alloc(n).map_err(dev(op))?;
        self.allocs.push(ptr);
        // SAFETY: ptr holds n bytes; zeroed on the stream before any use.
        unsafe { self.drv.memset_zero(ptr, n) }.map_err(dev(op))?;
        self.bytes += n as u64;
        Ok(ptr)
    }

    pub(crate) fn upload<T: Copy>(&mut self, data: &[T]) -> Result<u64> {
        let ptr = self.alloc(std::mem::size_of_val(data))?;
        if !data.is_empty() {
            // SAFETY: ptr holds at least size_of_val(data) bytes.
            unsafe { self.drv.upload(ptr, data) }.map_err(dev("decode_step upload"))?;
        }
        Ok(ptr)
    }
}

impl<D: Driver> Drop for Arena<D> {
    fn drop(&mut self) {
        if self.drv.bind().is_ok() {
            for &ptr in &self.allocs {
                // SAFETY: each came from `alloc` above and is freed once.
                unsafe { self.drv.free(ptr) };
            }
        }
    }
}
