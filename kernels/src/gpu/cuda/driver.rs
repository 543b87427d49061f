//! The launch seam's driver on CUDA: cudarc's driver API on the backend's
//! context, stream and NVRTC-compiled module. The fused step and every
//! generic op (`gpu/ops/`) run through it.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUfunction_attribute, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaEvent, CudaGraph, CudaModule, CudaStream, DriverError, result};

use crate::gpu::launch::{Driver, DriverFault, IPC_HANDLE_BYTES, MemoryDriver};

/// The backend's context, stream and module (cheap to clone: three `Arc`s).
/// `pub` only for the public aliases that name it (`CudaBuf`, ...); its
/// module is private.
#[derive(Clone)]
pub struct CudaDriver {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) module: Arc<CudaModule>,
    /// The device's compute capability (the module was compiled for it).
    pub(crate) cc: (i32, i32),
}

/// A captured graph (cudarc's graph is not Send; a step uses its graphs
/// through `&mut`, one thread at a time).
pub struct CudaStepGraph(CudaGraph);

fn fault(e: DriverError) -> DriverFault {
    DriverFault(e.to_string())
}

impl Driver for CudaDriver {
    type Func = sys::CUfunction;
    type Graph = CudaStepGraph;
    type Event = CudaEvent;
    const NAME: &'static str = "cuda";
    const LABEL: &'static str = "CUDA";
    const TYPE_PREFIX: &'static str = "Cuda";

    fn function(&self, name: &str) -> Result<sys::CUfunction, DriverFault> {
        // The handle stays valid while `module` is loaded; the driver value
        // (and so every step holding it) keeps the module alive.
        self.module.load_function(name).map(|f| f.cu_function()).map_err(fault)
    }

    fn set_max_dynamic_smem(&self, f: sys::CUfunction, bytes: u32) -> Result<(), DriverFault> {
        // SAFETY: f is a function of the loaded module.
        unsafe { result::function::set_function_attribute(f, CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32) }
            .map_err(fault)
    }

    fn prefer_shared_carveout(&self, f: sys::CUfunction) -> Result<(), DriverFault> {
        // SAFETY: f is a function of the loaded module.
        unsafe { result::function::set_function_attribute(f, CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100) }.map_err(fault)
    }

    fn multiprocessors(&self) -> Result<usize, DriverFault> {
        self.ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map(|n| n.max(1) as usize).map_err(fault)
    }

    fn bind(&self) -> Result<(), DriverFault> {
        self.ctx.bind_to_thread().map_err(fault)
    }

    fn alloc(&self, bytes: usize) -> Result<u64, DriverFault> {
        // SAFETY: a plain device allocation in the bound context.
        unsafe { result::malloc_sync(bytes) }.map_err(fault)
    }

    unsafe fn free(&self, ptr: u64) {
        // SAFETY: the caller's contract (an allocation of `alloc`, freed once).
        let _ = unsafe { result::free_sync(ptr) };
    }

    fn alloc_async(&self, bytes: usize) -> Result<u64, DriverFault> {
        // What cudarc's CudaStream::alloc did for the backend's buffers before
        // they moved onto the seam: stream-ordered where the device can
        // (freed memory stays in the pool, see `keep_freed_memory`).
        // SAFETY: a plain device allocation in the bound context, on its stream.
        if self.ctx.has_async_alloc() { unsafe { result::malloc_async(self.stream.cu_stream(), bytes) } } else { unsafe { result::malloc_sync(bytes) } }
            .map_err(fault)
    }

    unsafe fn free_async(&self, ptr: u64) {
        // As cudarc's CudaSlice drop: a failure is recorded in the context and
        // reported by its next bind_to_thread (our `bind`).
        if self.ctx.has_async_alloc() {
            // SAFETY: the caller's contract (an allocation of alloc_async, freed once).
            self.ctx.record_err(unsafe { result::free_async(ptr, self.stream.cu_stream()) });
        } else {
            self.ctx.record_err(self.stream.synchronize());
            // SAFETY: as above; the stream is idle.
            self.ctx.record_err(unsafe { result::free_sync(ptr) });
        }
    }

    unsafe fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<(), DriverFault> {
        // SAFETY: the caller's contract (both hold bytes); one context.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }.map_err(fault)
    }

    unsafe fn memset_zero(&self, ptr: u64, bytes: usize) -> Result<(), DriverFault> {
        // SAFETY: the caller's contract (ptr holds bytes).
        unsafe { result::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream()) }.map_err(fault)
    }

    unsafe fn upload<T: Copy>(&self, dst: u64, src: &[T]) -> Result<(), DriverFault> {
        // SAFETY: the caller's contract (dst holds src's bytes).
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }.map_err(fault)
    }

    unsafe fn download<T: Copy>(&self, dst: &mut [T], src: u64) -> Result<(), DriverFault> {
        // SAFETY: the caller's contract (src holds dst's bytes).
        unsafe { result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }.map_err(fault)
    }

    unsafe fn launch(&self, f: sys::CUfunction, grid: (u32, u32, u32), block: u32, smem: u32, params: &mut [*mut c_void]) -> Result<(), DriverFault> {
        // SAFETY: the caller's contract (params match f's signature).
        unsafe { result::launch_kernel(f, grid, (block, 1, 1), smem, self.stream.cu_stream(), params) }.map_err(fault)
    }

    fn dependent_launch(&self) -> bool {
        self.cc.0 >= 9
    }

    unsafe fn launch_dependent(&self, f: sys::CUfunction, grid: (u32, u32, u32), block: u32, smem: u32, params: &mut [*mut c_void]) -> Result<(), DriverFault> {
        if !self.dependent_launch() {
            // SAFETY: the caller's contract.
            return unsafe { self.launch(f, grid, block, smem, params) };
        }
        // SAFETY: a plain-data union; the one field set is the one this
        // attribute reads.
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attr = sys::CUlaunchAttribute { id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, pad: [0; 4], value };
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: the caller's contract (params match f's signature); cfg and
        // its attribute live for the call, which copies them.
        unsafe { sys::cuLaunchKernelEx(&cfg, f, params.as_mut_ptr(), std::ptr::null_mut()) }.result().map_err(fault)
    }

    fn synchronize(&self) -> Result<(), DriverFault> {
        self.stream.synchronize().map_err(fault)
    }

    fn begin_capture(&self) -> Result<(), DriverFault> {
        self.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(fault)
    }

    fn end_capture(&self) -> Result<Option<CudaStepGraph>, DriverFault> {
        self.stream.end_capture(CUgraphInstantiate_flags(0)).map(|g| g.map(CudaStepGraph)).map_err(fault)
    }

    fn prepare_graph(&self, g: &CudaStepGraph) -> Result<(), DriverFault> {
        g.0.upload().map_err(fault)
    }

    fn replay(&self, g: &CudaStepGraph) -> Result<(), DriverFault> {
        g.0.launch().map_err(fault)
    }

    fn record_event(&self) -> Result<CudaEvent, DriverFault> {
        self.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(fault)
    }

    fn elapsed_ms(&self, start: &CudaEvent, end: &CudaEvent) -> Result<f32, DriverFault> {
        start.elapsed_ms(end).map_err(fault)
    }
}

impl MemoryDriver for CudaDriver {
    type Fence = CudaEvent;

    fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// NVRTC 13 and a CUDA 13 driver: 32,764 bytes of kernel arguments.
    fn table_copies(&self) -> usize {
        crate::region::WIDE_TABLE_COPIES
    }

    fn with_new_stream(&self) -> Result<Self, DriverFault> {
        Ok(CudaDriver { stream: self.ctx.new_stream().map_err(fault)?, ..self.clone() })
    }

    unsafe fn copy_2d(&self, dst: u64, dst_pitch: u64, src: u64, src_pitch: u64, width: u64, height: u64) -> Result<(), DriverFault> {
        let m = sys::CUDA_MEMCPY2D_st {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch as usize,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch as usize,
            WidthInBytes: width as usize,
            Height: height as usize,
        };
        // SAFETY: the caller's contract (every row in a live allocation).
        unsafe { sys::cuMemcpy2DAsync_v2(&m, self.stream.cu_stream()) }.result().map_err(fault)
    }

    fn new_fence(&self) -> Result<CudaEvent, DriverFault> {
        self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC)).map_err(fault)
    }

    fn record_fence(&self, f: &CudaEvent) -> Result<(), DriverFault> {
        f.record(&self.stream).map_err(fault)
    }

    fn wait_fence(&self, f: &CudaEvent) -> Result<(), DriverFault> {
        self.ctx.bind_to_thread().map_err(fault)?;
        // SAFETY: a live event of this context and this driver's live stream;
        // the wait is queued, the host does not block.
        unsafe { sys::cuStreamWaitEvent(self.stream.cu_stream(), f.cu_event(), 0) }.result().map_err(fault)
    }

    fn fence_done(&self, f: &CudaEvent) -> Result<bool, DriverFault> {
        f.try_is_complete().map_err(fault)
    }

    fn fence_wait(&self, f: &CudaEvent) -> Result<(), DriverFault> {
        f.synchronize().map_err(fault)
    }

    fn ipc_export(&self, ptr: u64) -> Result<[u8; IPC_HANDLE_BYTES], DriverFault> {
        let mut h = sys::CUipcMemHandle_st { reserved: [0; IPC_HANDLE_BYTES] };
        // SAFETY: h is valid for writes; ptr is an allocation of this context.
        unsafe { sys::cuIpcGetMemHandle(&mut h, ptr) }.result().map_err(fault)?;
        Ok(h.reserved.map(|c| c as u8))
    }

    fn ipc_open(&self, handle: &[u8; IPC_HANDLE_BYTES]) -> Result<u64, DriverFault> {
        let h = sys::CUipcMemHandle_st { reserved: handle.map(|b| b as _) };
        let mut p: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: p is valid for writes; the driver checks the handle.
        unsafe { sys::cuIpcOpenMemHandle_v2(&mut p, h, flags) }.result().map_err(fault)?;
        Ok(p)
    }

    unsafe fn ipc_close(&self, ptr: u64) -> Result<(), DriverFault> {
        // SAFETY: the caller's contract (an address of ipc_open, unused).
        unsafe { sys::cuIpcCloseMemHandle(ptr) }.result().map_err(fault)
    }
}
