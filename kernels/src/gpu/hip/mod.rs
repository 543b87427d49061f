//! The HIP backend (feature `hip`): the HIP runtime through hip-sys (linked
//! against libamdhip64, Debian's with `HIP_PATH=/usr`) and the gfx90a code
//! objects build.rs compiled with hipcc from the one set of kernel sources.
//!
//! What is wired: `HipBackend` is `GpuBackend<HipDriver>`, the CUDA backend's
//! driver-generic implementation (`gpu/ops/`) over [`HipDriver`]: buffers
//! (f32, i32 with the host's known copy, f64) and every generic op, with the
//! same kernels, grids, blocks, shared memory, argument order and checks as
//! CUDA, and the fused decode step ([`crate::Backend::decode_step`]) through
//! the step's launch table (`gpu/step_gpu/`). Where a gfx90a block cannot take
//! a kernel's shared memory (64 KiB of LDS), opening falls back to a kernel
//! of the same bits (`gpu/ops/open.rs`, `SmemPolicy::FallBack`): the
//! tensor-core MLA partials (83 KB and more) give way to the scalar partial,
//! matmul_tc16 (75 KB) to matmul_tc32, matmul_tcb (102 KB) to the split over
//! k, and the chunked KDA prefill to the recurrent one. Device memory for
//! registered regions ([`crate::Backend::device_memory`], and
//! [`crate::hip_device_memory`] without the backend) is CUDA's
//! driver-generic `DeviceMem` (`gpu/ops/memory.rs`) over the same driver:
//! `hipMalloc` allocations, `hipIpcGetMemHandle` / `hipIpcOpenMemHandle` /
//! `hipIpcCloseMemHandle` (64-byte handles, as CUDA's), `copy_table` from the
//! memcopy.hip code object on eight streams of its own, `hipMemcpyDtoDAsync`
//! and `hipMemcpy2DAsync` for the copies CUDA gives the copy engines, and
//! `hipEventBlockingSync` events; the region ops take any device address.
//!
//! There is no AMD GPU on any machine this project runs on, so none of this
//! has run on AMD hardware: here `new` stops at the device count
//! (`hipErrorNoDevice`). The launches are checked against the kernels'
//! signatures and the gfx90a code objects' symbols by tests that need no
//! device (`gpu/ops/tests/`). On a gfx90a the fused step's build would refuse
//! its Hopper-sized shared memory (st_mm, st_kda past 64 KiB of LDS a block;
//! see `driver::lds_fits`).

use std::sync::Arc;

use hip_sys::hiprt::{hipDeviceGetName, hipError_t, hipGetDeviceCount, hipGetErrorString};

use crate::error::{KernelError, Result};
use crate::gpu::launch::{Driver, MemoryDriver, dev};
use crate::gpu::ops::{DeviceBuf, DeviceIBuf, DeviceMem, GpuBackend, SmemPolicy};
use crate::gpu::step_gpu::STEP_KERNELS;
use crate::region::DeviceMemory;

mod driver;
pub use driver::HipDriver;
#[cfg(test)]
pub(crate) use driver::lds_fits;

/// AMD backend: the driver-generic ops and the fused decode step on one HIP
/// device (`GpuBackend` over hip-sys).
///
/// Opening it loads every gfx90a code object ([`crate::gpu::HIP_CODE_OBJECTS`])
/// and resolves every kernel of the generic ops and of the step's table, so a
/// missing kernel is a refusal at start. Never run on AMD hardware.
pub type HipBackend = GpuBackend<HipDriver>;
/// An f32 buffer in HIP device memory.
pub type HipBuf = DeviceBuf<f32, HipDriver>;
/// An i32 buffer in HIP device memory, with the host's known copy.
pub type HipIBuf = DeviceIBuf<HipDriver>;
/// An f64 buffer in HIP device memory.
pub type HipF64Buf = DeviceBuf<f64, HipDriver>;

/// Device memory for the regions of a HIP backend: the driver-generic
/// `DeviceMem` (`gpu/ops/memory.rs`) on the backend's device and modules,
/// host access on a stream of its own (as CUDA's).
fn memory_of(drv: &HipDriver) -> Result<Arc<dyn DeviceMemory>> {
    let host = drv.with_new_stream().map_err(dev("device memory"))?;
    Ok(Arc::new(DeviceMem::new(host)?))
}

/// [`crate::gpu::hip_device_memory`]: device memory for regions on HIP
/// device `device` without the backend, with only memcopy.hip's code object
/// loaded (a transport opens it before the compute backend).
pub(crate) fn open_memory(device: usize) -> Result<Arc<dyn DeviceMemory>> {
    let count = device_count()?;
    if device >= count {
        return Err(KernelError::BackendUnavailable(format!("hip: no device {device}: the HIP runtime sees {count} device(s)")));
    }
    let images: Vec<(&'static str, &'static [u8])> = crate::gpu::HIP_CODE_OBJECTS.iter().copied().filter(|(name, _)| *name == "memcopy.hip").collect();
    let drv = HipDriver::open(device, &images).map_err(|e| KernelError::BackendUnavailable(format!("hip: cannot open device {device}: {e}")))?;
    Ok(Arc::new(DeviceMem::new(drv)?))
}

/// Devices the HIP runtime sees, or why it sees none.
fn device_count() -> Result<usize> {
    let mut count: std::os::raw::c_int = 0;
    // SAFETY: hipGetDeviceCount writes one int through a valid pointer.
    let err = unsafe { hipGetDeviceCount(&mut count) };
    if err != hipError_t::hipSuccess || count <= 0 {
        let why = format!("hip: no device: hipGetDeviceCount reported {} with a count of {count} (no AMD GPU here)", describe(err));
        return Err(KernelError::BackendUnavailable(why));
    }
    Ok(count as usize)
}

impl GpuBackend<HipDriver> {
    /// Opens HIP device `device`: loads the code objects and resolves every
    /// kernel of the generic ops and of the decode step's launch table.
    /// Refuses with `BackendUnavailable` when the runtime sees no such device
    /// ("hip: no device: ..."), a code object does not load (another
    /// architecture than gfx90a), or a kernel is missing.
    pub fn new(device: usize) -> Result<Self> {
        let count = device_count()?;
        if device >= count {
            return Err(KernelError::BackendUnavailable(format!("hip: no device {device}: the HIP runtime sees {count} device(s)")));
        }
        let drv = HipDriver::open(device, crate::gpu::HIP_CODE_OBJECTS)
            .map_err(|e| KernelError::BackendUnavailable(format!("hip: cannot open device {device}: {e}")))?;
        for name in STEP_KERNELS {
            drv.function(name).map_err(|e| KernelError::BackendUnavailable(format!("hip: kernel {name} missing: {e}")))?;
        }
        let mut buf = [0 as std::os::raw::c_char; 256];
        // SAFETY: buf holds 256 bytes; the runtime writes a NUL-terminated name.
        let named = unsafe { hipDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, device as i32) } == hipError_t::hipSuccess;
        // SAFETY: NUL-terminated within buf (zeroed, and written by the runtime).
        let device_name = if named { unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned() } else { format!("HIP device {device}") };
        // gfx90a blocks take 64 KiB: the Hopper-sized kernels fall back to
        // ones of the same bits (see the module docs).
        GpuBackend::on_driver(drv, device_name, device, String::new(), SmemPolicy::FallBack, memory_of).map(crate::gpu::ops::with_layer_marks)
    }

    /// Whether the HIP runtime sees at least one device here.
    pub fn is_available() -> bool {
        device_count().is_ok()
    }
}

fn describe(err: hipError_t) -> String {
    // SAFETY: hipGetErrorString returns a static NUL-terminated string (or null).
    let p = unsafe { hipGetErrorString(err) };
    if p.is_null() {
        format!("{err:?}")
    } else {
        // SAFETY: non-null, NUL-terminated, static.
        let s = unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy();
        let name = format!("{err:?}");
        if s == name { name } else { format!("{name} ({s})") }
    }
}
