//! The HIP backend (feature `hip`): the HIP runtime through hip-sys (linked
//! against libamdhip64, Debian's with `HIP_PATH=/usr`) and the gfx90a code
//! objects build.rs compiled with hipcc from the one set of kernel sources.
//!
//! What is wired: the fused decode step ([`crate::Backend::decode_step`]),
//! whose launch table (`gpu/step_gpu/`) is the CUDA backend's, executed
//! through [`HipDriver`] instead of cudarc. What is not: the generic ops
//! (their launchers are CUDA's, `gpu/cuda/`), device memory for registered
//! regions and buffers; each refuses with `Unsupported`, naming the op. There
//! is no AMD GPU on any machine this project runs on, so none of this has run
//! on AMD hardware: here `new` stops at the device count (`hipErrorNoDevice`).
//! On a gfx90a the step's build would refuse its Hopper-sized shared memory
//! (st_mm, st_kda past 64 KiB of LDS a block; see `driver::lds_fits`).

use hip_sys::hiprt::{hipDeviceGetName, hipError_t, hipGetDeviceCount, hipGetErrorString};

use crate::dtype::StorageDtype;
use crate::error::{KernelError, Result};
use crate::gpu::NoBuf;
use crate::gpu::launch::{Driver, dev};
use crate::gpu::step_gpu::{GpuStep, STEP_KERNELS};
use crate::shapes::{
    ColsCopy, ConvShape, EmbeddingShape, KdaInputs, KdaParams, KdaPrefillShape, KdaStepShape, MatmulShape, MergeShape, MlaShape, MlpShape, MlpWeights,
    NormShape, ReplayShape, RowSet,
};

mod driver;
pub(crate) use driver::HipDriver;
#[cfg(test)]
pub(crate) use driver::lds_fits;

/// AMD backend: the fused decode step's launch table on one HIP device.
///
/// Opening it loads every gfx90a code object ([`crate::gpu::HIP_CODE_OBJECTS`])
/// and resolves every kernel the step's table names, so a missing kernel is a
/// refusal at start. Never run on AMD hardware.
#[derive(Clone)]
pub struct HipBackend {
    drv: HipDriver,
    ordinal: usize,
    device_name: String,
}

impl std::fmt::Debug for HipBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HipBackend(device {} {:?})", self.ordinal, self.device_name)
    }
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

impl HipBackend {
    /// Opens HIP device `device`: loads the code objects and resolves every
    /// kernel of the decode step's launch table. Refuses with
    /// `BackendUnavailable` when the runtime sees no such device ("hip: no
    /// device: ..."), a code object does not load (another architecture than
    /// gfx90a), or a kernel is missing.
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
        Ok(HipBackend { drv, ordinal: device, device_name })
    }

    /// Whether the HIP runtime sees at least one device here.
    pub fn is_available() -> bool {
        device_count().is_ok()
    }

    /// The device's name as the runtime reports it.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The device ordinal this backend opened.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Waits until every queued launch has finished; reports a failed one.
    pub fn synchronize(&self) -> Result<()> {
        self.drv.synchronize().map_err(dev("synchronize"))
    }
}

impl crate::gpu::stub::RefuseBuffers for HipBackend {
    fn refuse_buffers<T>(&self, op: &'static str) -> Result<T> {
        Err(KernelError::Unsupported {
            op,
            backend: "hip".to_string(),
            reason: "only the fused decode step (decode_step) is wired on HIP; the generic ops' launchers are CUDA's".to_string(),
        })
    }
}

crate::gpu::stub::backend_without_buffers!(HipBackend, "hip", {
    fn synchronize(&self) -> Result<()> {
        HipBackend::synchronize(self)
    }

    fn decode_step(&self, spec: &crate::step::StepSpec) -> Result<Box<dyn crate::step::DecodeStep>> {
        Ok(Box::new(GpuStep::new(self.drv.clone(), spec)?))
    }
});

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
