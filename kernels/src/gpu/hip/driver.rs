//! The launch seam's driver on HIP: the HIP runtime (hip-sys) on one
//! device, one stream, and the modules of the gfx90a code objects that
//! build.rs compiled with hipcc ([`crate::gpu::HIP_CODE_OBJECTS`]). The fused
//! step and every generic op (`gpu/ops/`) run through it.
//!
//! Never run on AMD hardware (none is available to this project): it builds
//! and links against Debian's libamdhip64, and `HipBackend::new` stops at the
//! device count where there is no device.

use std::ffi::{CString, c_void};
use std::sync::Arc;

use hip_sys::hiprt::{
    hipDeviceAttribute_t, hipDeviceGetAttribute, hipDeviceptr_t, hipError_t, hipEvent_t, hipEventCreate, hipEventDestroy, hipEventElapsedTime, hipEventRecord,
    hipFree, hipFunction_t, hipGraph_t, hipGraphDestroy, hipGraphExec_t, hipGraphExecDestroy, hipGraphInstantiate, hipGraphLaunch, hipMalloc,
    hipMemcpyDtoDAsync, hipMemcpyDtoHAsync, hipMemcpyHtoDAsync, hipMemsetD8Async, hipModule_t, hipModuleGetFunction, hipModuleLaunchKernel, hipModuleLoadData,
    hipModuleUnload, hipSetDevice, hipStream_t, hipStreamBeginCapture, hipStreamCaptureMode, hipStreamCreate, hipStreamDestroy, hipStreamEndCapture,
    hipStreamSynchronize, hipStreamWaitEvent,
};
use hip_sys::hiprt::{
    hipEventBlockingSync, hipEventCreateWithFlags, hipEventQuery, hipEventSynchronize, hipIpcCloseMemHandle, hipIpcGetMemHandle, hipIpcMemHandle_t,
    hipIpcMemLazyEnablePeerAccess, hipIpcOpenMemHandle, hipMemcpy2DAsync, hipMemcpyKind,
};

use super::describe;
use crate::gpu::launch::{Driver, DriverFault, IPC_HANDLE_BYTES, MemoryDriver};

/// Whether a block of `bytes` dynamic shared memory fits a device whose
/// blocks may take `max` (hipDeviceAttributeMaxSharedMemoryPerBlock). AMD has
/// no opt-in past a default: a block may take the device's LDS (64 KiB on
/// gfx90a), no more. A launch past it would fail at every replay, so the
/// launch table is refused when it is built instead, naming the kernel.
pub(crate) fn lds_fits(bytes: u32, max: usize) -> Result<(), DriverFault> {
    if bytes as usize > max {
        return Err(DriverFault(format!("{bytes} bytes of shared memory a block, past the device's {max} (LDS)")));
    }
    Ok(())
}

/// `Ok` on `hipSuccess`, else the fault naming the call.
fn check(call: &'static str, err: hipError_t) -> Result<(), DriverFault> {
    if err == hipError_t::hipSuccess { Ok(()) } else { Err(DriverFault(format!("{call}: {}", describe(err)))) }
}

/// The device and its loaded modules; unloaded when the last [`HipDriver`]
/// (and so every step using them) is gone.
struct HipDevice {
    ordinal: i32,
    /// One module a code object (the sources are one translation unit for
    /// NVRTC, so a kernel name is defined in one module).
    modules: Vec<hipModule_t>,
    /// Bytes of shared memory (LDS) a block may take, static and dynamic.
    max_smem: usize,
    multiprocessors: usize,
}

impl Drop for HipDevice {
    fn drop(&mut self) {
        // SAFETY: the modules were loaded in `HipDriver::open` and are
        // unloaded once, here, after every user (they hold this Arc) is gone;
        // every stream that ran their kernels was drained when it was
        // dropped (a driver drops its stream before its device).
        unsafe {
            let _ = hipSetDevice(self.ordinal);
            for &m in &self.modules {
                let _ = hipModuleUnload(m);
            }
        }
    }
}

/// A stream of a device, drained and destroyed when the last driver on it
/// is gone.
struct HipStream {
    ordinal: i32,
    stream: hipStream_t,
}

impl HipStream {
    fn create(ordinal: i32) -> Result<HipStream, DriverFault> {
        let mut stream: hipStream_t = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; destroyed by HipStream's drop.
        check("hipStreamCreate", unsafe { hipStreamCreate(&mut stream) })?;
        Ok(HipStream { ordinal, stream })
    }
}

impl Drop for HipStream {
    fn drop(&mut self) {
        // SAFETY: created by `create`, destroyed once after its work.
        unsafe {
            let _ = hipSetDevice(self.ordinal);
            let _ = hipStreamSynchronize(self.stream);
            let _ = hipStreamDestroy(self.stream);
        }
    }
}

// SAFETY: a stream handle may be used from any thread once its device is
// current there (`bind`); work on it is queued in call order.
unsafe impl Send for HipStream {}
// SAFETY: as above.
unsafe impl Sync for HipStream {}

// SAFETY: the HIP runtime's handles may be used from any thread once the
// device is made current there (`bind`); the device's own state is immutable
// after `open`.
unsafe impl Send for HipDevice {}
// SAFETY: as above; every call queues on the one stream, in call order.
unsafe impl Sync for HipDevice {}

/// The launch seam's driver on HIP device `ordinal` (cheap to clone): the
/// device's modules and one stream. `pub` only for the public aliases that
/// name it; its module is private.
#[derive(Clone)]
pub struct HipDriver {
    /// Declared first: dropped (drained) before the device's modules go.
    s: Arc<HipStream>,
    d: Arc<HipDevice>,
}

impl HipDriver {
    /// Opens device `ordinal`: makes it current, creates a stream and loads
    /// every code object of `images` (`(source file, clang offload bundle)`).
    pub(crate) fn open(ordinal: usize, images: &[(&'static str, &'static [u8])]) -> Result<HipDriver, DriverFault> {
        let ord = i32::try_from(ordinal).map_err(|_| DriverFault(format!("device ordinal {ordinal} is not a HIP device id")))?;
        // SAFETY: plain runtime calls with valid out-pointers.
        unsafe {
            check("hipSetDevice", hipSetDevice(ord))?;
            let attr = |a: hipDeviceAttribute_t, what: &'static str| -> Result<usize, DriverFault> {
                let mut v: std::os::raw::c_int = 0;
                check(what, hipDeviceGetAttribute(&mut v, a, ord))?;
                Ok(v.max(0) as usize)
            };
            let max_smem = attr(hipDeviceAttribute_t::hipDeviceAttributeMaxSharedMemoryPerBlock, "hipDeviceGetAttribute(max shared memory a block)")?;
            let multiprocessors = attr(hipDeviceAttribute_t::hipDeviceAttributeMultiprocessorCount, "hipDeviceGetAttribute(compute units)")?.max(1);
            let s = Arc::new(HipStream::create(ord)?);
            let mut dev = HipDevice { ordinal: ord, modules: Vec::with_capacity(images.len()), max_smem, multiprocessors };
            for &(name, image) in images {
                let mut m: hipModule_t = std::ptr::null_mut();
                // The image is a static byte array that outlives the module.
                check("hipModuleLoadData", hipModuleLoadData(&mut m, image.as_ptr().cast()))
                    .map_err(|e| DriverFault(format!("the gfx90a code object of {name}: {e}")))?;
                dev.modules.push(m);
            }
            Ok(HipDriver { s, d: Arc::new(dev) })
        }
    }
}

/// A captured graph and its instantiation, destroyed together.
pub struct HipGraph {
    graph: hipGraph_t,
    exec: hipGraphExec_t,
}

impl Drop for HipGraph {
    fn drop(&mut self) {
        // SAFETY: created by `end_capture`, destroyed once.
        unsafe {
            let _ = hipGraphExecDestroy(self.exec);
            let _ = hipGraphDestroy(self.graph);
        }
    }
}

/// A timing event, destroyed with the value.
pub struct HipEvent(hipEvent_t);

impl Drop for HipEvent {
    fn drop(&mut self) {
        // SAFETY: created by `record_event`, destroyed once.
        let _ = unsafe { hipEventDestroy(self.0) };
    }
}

impl Driver for HipDriver {
    type Func = hipFunction_t;
    type Graph = HipGraph;
    type Event = HipEvent;
    const NAME: &'static str = "hip";
    const LABEL: &'static str = "HIP";
    const TYPE_PREFIX: &'static str = "Hip";

    fn function(&self, name: &str) -> Result<hipFunction_t, DriverFault> {
        let c = CString::new(name).map_err(|_| DriverFault(format!("kernel name {name:?} has a NUL byte")))?;
        for &m in &self.d.modules {
            let mut f: hipFunction_t = std::ptr::null_mut();
            // SAFETY: m is a loaded module, c a NUL-terminated name.
            if unsafe { hipModuleGetFunction(&mut f, m, c.as_ptr()) } == hipError_t::hipSuccess && !f.is_null() {
                return Ok(f);
            }
        }
        Err(DriverFault(format!("no module of the {} code objects defines {name}", self.d.modules.len())))
    }

    fn set_max_dynamic_smem(&self, _: hipFunction_t, bytes: u32) -> Result<(), DriverFault> {
        lds_fits(bytes, self.d.max_smem)
    }

    fn prefer_shared_carveout(&self, _: hipFunction_t) -> Result<(), DriverFault> {
        // LDS is not carved out of the L1 cache on AMD: nothing to ask for.
        Ok(())
    }

    fn multiprocessors(&self) -> Result<usize, DriverFault> {
        Ok(self.d.multiprocessors)
    }

    fn bind(&self) -> Result<(), DriverFault> {
        // SAFETY: a plain runtime call.
        check("hipSetDevice", unsafe { hipSetDevice(self.d.ordinal) })
    }

    fn alloc(&self, bytes: usize) -> Result<u64, DriverFault> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        check("hipMalloc", unsafe { hipMalloc(&mut p, bytes) })?;
        Ok(p as u64)
    }

    unsafe fn free(&self, ptr: u64) {
        // SAFETY: the caller's contract (an allocation of `alloc`, freed once).
        let _ = unsafe { hipFree(ptr as *mut c_void) };
    }

    fn alloc_async(&self, bytes: usize) -> Result<u64, DriverFault> {
        // hipMallocAsync is a beta API in HIP 5.2 (Debian's): the plain
        // allocation instead, whose free (below) waits for the device, so a
        // buffer freed while a queued kernel still reads it stays valid.
        self.alloc(bytes)
    }

    unsafe fn free_async(&self, ptr: u64) {
        // SAFETY: the caller's contract (an allocation of alloc_async, freed
        // once); hipFree waits for the device's work first.
        let _ = unsafe { hipFree(ptr as *mut c_void) };
    }

    unsafe fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<(), DriverFault> {
        // SAFETY: the caller's contract (both hold bytes).
        check("hipMemcpyDtoDAsync", unsafe { hipMemcpyDtoDAsync(dst as hipDeviceptr_t, src as hipDeviceptr_t, bytes, self.s.stream) })
    }

    unsafe fn memset_zero(&self, ptr: u64, bytes: usize) -> Result<(), DriverFault> {
        // SAFETY: the caller's contract (ptr holds bytes).
        check("hipMemsetD8Async", unsafe { hipMemsetD8Async(ptr as hipDeviceptr_t, 0, bytes, self.s.stream) })
    }

    unsafe fn upload<T: Copy>(&self, dst: u64, src: &[T]) -> Result<(), DriverFault> {
        // SAFETY: the caller's contract (dst holds src's bytes); HIP only reads src.
        check("hipMemcpyHtoDAsync", unsafe {
            hipMemcpyHtoDAsync(dst as hipDeviceptr_t, src.as_ptr() as *mut c_void, std::mem::size_of_val(src), self.s.stream)
        })?;
        // The trait promises that src has been read when this returns (callers
        // drop packed weights right after), as CUDA does for pageable memory;
        // HIP does not promise it, so wait. The step's per-tick upload finds
        // the stream idle (the previous step ended in a wait), so this costs
        // nothing there.
        self.synchronize()
    }

    unsafe fn download<T: Copy>(&self, dst: &mut [T], src: u64) -> Result<(), DriverFault> {
        // SAFETY: the caller's contract (src holds dst's bytes).
        check("hipMemcpyDtoHAsync", unsafe { hipMemcpyDtoHAsync(dst.as_mut_ptr().cast(), src as hipDeviceptr_t, std::mem::size_of_val(dst), self.s.stream) })
    }

    unsafe fn launch(&self, f: hipFunction_t, grid: (u32, u32, u32), block: u32, smem: u32, params: &mut [*mut c_void]) -> Result<(), DriverFault> {
        // SAFETY: the caller's contract (params match f's signature).
        check("hipModuleLaunchKernel", unsafe {
            hipModuleLaunchKernel(f, grid.0, grid.1, grid.2, block, 1, 1, smem, self.s.stream, params.as_mut_ptr(), std::ptr::null_mut())
        })
    }

    fn synchronize(&self) -> Result<(), DriverFault> {
        // SAFETY: a plain runtime call on the driver's stream.
        check("hipStreamSynchronize", unsafe { hipStreamSynchronize(self.s.stream) })
    }

    fn begin_capture(&self) -> Result<(), DriverFault> {
        // SAFETY: a plain runtime call on the driver's stream.
        check("hipStreamBeginCapture", unsafe { hipStreamBeginCapture(self.s.stream, hipStreamCaptureMode::hipStreamCaptureModeThreadLocal) })
    }

    fn end_capture(&self) -> Result<Option<HipGraph>, DriverFault> {
        let mut graph: hipGraph_t = std::ptr::null_mut();
        // SAFETY: valid out-pointers; the graph is instantiated once and both
        // handles are destroyed by HipGraph's drop.
        unsafe {
            check("hipStreamEndCapture", hipStreamEndCapture(self.s.stream, &mut graph))?;
            if graph.is_null() {
                return Ok(None);
            }
            let mut exec: hipGraphExec_t = std::ptr::null_mut();
            if let Err(e) = check("hipGraphInstantiate", hipGraphInstantiate(&mut exec, graph, std::ptr::null_mut(), std::ptr::null_mut(), 0)) {
                let _ = hipGraphDestroy(graph);
                return Err(e);
            }
            Ok(Some(HipGraph { graph, exec }))
        }
    }

    fn prepare_graph(&self, _: &HipGraph) -> Result<(), DriverFault> {
        // Instantiated in `end_capture`; HIP 5.2 has no separate upload.
        Ok(())
    }

    fn replay(&self, g: &HipGraph) -> Result<(), DriverFault> {
        // SAFETY: an instantiated graph on the driver's stream.
        check("hipGraphLaunch", unsafe { hipGraphLaunch(g.exec, self.s.stream) })
    }

    fn record_event(&self) -> Result<HipEvent, DriverFault> {
        let mut e: hipEvent_t = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the event is destroyed by HipEvent's drop.
        check("hipEventCreate", unsafe { hipEventCreate(&mut e) })?;
        let ev = HipEvent(e);
        // SAFETY: a created event on the driver's stream.
        check("hipEventRecord", unsafe { hipEventRecord(ev.0, self.s.stream) })?;
        Ok(ev)
    }

    fn elapsed_ms(&self, start: &HipEvent, end: &HipEvent) -> Result<f32, DriverFault> {
        let mut ms = 0f32;
        // SAFETY: two recorded events; waits for the end one first.
        unsafe {
            check("hipEventSynchronize", hipEventSynchronize(end.0))?;
            check("hipEventElapsedTime", hipEventElapsedTime(&mut ms, start.0, end.0))?;
        }
        Ok(ms)
    }
}

// SAFETY: an event handle may be queried, waited on and recorded from any
// thread; the memory's map of them is behind a lock.
unsafe impl Send for HipEvent {}
// SAFETY: as above.
unsafe impl Sync for HipEvent {}

impl MemoryDriver for HipDriver {
    type Fence = HipEvent;

    fn ordinal(&self) -> usize {
        self.d.ordinal as usize
    }

    /// Kernel arguments past 4 KB have never been tried on AMD hardware.
    fn table_copies(&self) -> usize {
        crate::region::TABLE_COPIES
    }

    fn with_new_stream(&self) -> Result<Self, DriverFault> {
        Ok(HipDriver { s: Arc::new(HipStream::create(self.d.ordinal)?), d: Arc::clone(&self.d) })
    }

    unsafe fn copy_2d(&self, dst: u64, dst_pitch: u64, src: u64, src_pitch: u64, width: u64, height: u64) -> Result<(), DriverFault> {
        // SAFETY: the caller's contract (every row in a live allocation).
        check("hipMemcpy2DAsync", unsafe {
            hipMemcpy2DAsync(
                dst as *mut c_void,
                dst_pitch as usize,
                src as *const c_void,
                src_pitch as usize,
                width as usize,
                height as usize,
                hipMemcpyKind::hipMemcpyDeviceToDevice,
                self.s.stream,
            )
        })
    }

    fn new_fence(&self) -> Result<HipEvent, DriverFault> {
        let mut e: hipEvent_t = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; destroyed by HipEvent's drop. Blocking
        // sync, as CUDA's: a waiting thread sleeps instead of spinning.
        check("hipEventCreateWithFlags", unsafe { hipEventCreateWithFlags(&mut e, hipEventBlockingSync) })?;
        Ok(HipEvent(e))
    }

    fn record_fence(&self, f: &HipEvent) -> Result<(), DriverFault> {
        // SAFETY: a created event on this driver's stream.
        check("hipEventRecord", unsafe { hipEventRecord(f.0, self.s.stream) })
    }

    fn wait_fence(&self, f: &HipEvent) -> Result<(), DriverFault> {
        // SAFETY: a created event and this driver's live stream; the wait is
        // queued, the host does not block.
        check("hipStreamWaitEvent", unsafe { hipStreamWaitEvent(self.s.stream, f.0, 0) })
    }

    fn fence_done(&self, f: &HipEvent) -> Result<bool, DriverFault> {
        // SAFETY: a created event.
        match unsafe { hipEventQuery(f.0) } {
            hipError_t::hipSuccess => Ok(true),
            hipError_t::hipErrorNotReady => Ok(false),
            e => check("hipEventQuery", e).map(|()| false),
        }
    }

    fn fence_wait(&self, f: &HipEvent) -> Result<(), DriverFault> {
        // SAFETY: a created event.
        check("hipEventSynchronize", unsafe { hipEventSynchronize(f.0) })
    }

    fn ipc_export(&self, ptr: u64) -> Result<[u8; IPC_HANDLE_BYTES], DriverFault> {
        let mut h = hipIpcMemHandle_t { reserved: [0; IPC_HANDLE_BYTES] };
        // SAFETY: h is valid for writes; ptr is a hipMalloc allocation.
        check("hipIpcGetMemHandle", unsafe { hipIpcGetMemHandle(&mut h, ptr as *mut c_void) })?;
        Ok(h.reserved.map(|c| c as u8))
    }

    fn ipc_open(&self, handle: &[u8; IPC_HANDLE_BYTES]) -> Result<u64, DriverFault> {
        let h = hipIpcMemHandle_t { reserved: handle.map(|b| b as _) };
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: p is valid for writes; the runtime checks the handle. The
        // flag is the one HIP accepts (CUDA's lazy peer access).
        check("hipIpcOpenMemHandle", unsafe { hipIpcOpenMemHandle(&mut p, h, hipIpcMemLazyEnablePeerAccess) })?;
        Ok(p as u64)
    }

    unsafe fn ipc_close(&self, ptr: u64) -> Result<(), DriverFault> {
        // SAFETY: the caller's contract (an address of ipc_open, unused).
        check("hipIpcCloseMemHandle", unsafe { hipIpcCloseMemHandle(ptr as *mut c_void) })
    }
}
