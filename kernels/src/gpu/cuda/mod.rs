//! The CUDA backend (feature `cuda`): cudarc's driver API and NVRTC, both
//! loaded at run time, and the HIP/CUDA-common sources of `kernels/hip/`.
//!
//! - [`CudaBackend::new`] checks that the driver (`libcuda.so.1`) and NVRTC
//!   (`libnvrtc.so*`) can be loaded *before* the first cudarc call, because
//!   cudarc's loaders panic on a missing library; a missing one is
//!   `BackendUnavailable("cuda: no CUDA driver: ...")`. It then opens the
//!   device's primary context, compiles [`super::device_program`] with NVRTC to
//!   a cubin for the device's architecture (sm_90 on the H200) and loads it.
//! - Every op is the driver-generic implementation of `gpu/ops/`
//!   (`CudaBackend` is `GpuBackend<CudaDriver>`) over cudarc's driver API
//!   (`driver.rs`); what stays here is CUDA's own: NVRTC (`program.rs`), the
//!   context and its stream-ordered pool, and opening device memory for
//!   regions on the context (`buffers.rs`: the driver-generic `DeviceMem` of
//!   `gpu/ops/memory.rs` with `copy_table` compiled alone).
//! - One stream per backend; every op enqueues on it in call order, so ops
//!   need no events between them (cudarc's per-buffer event tracking, meant
//!   for several streams, is switched off). `download*` synchronizes.
//!
//! Numerics: f32 storage and accumulation, f64 for the MLA partials and their
//! merge, as on the CPU; reductions have a fixed order (see the sources), so a
//! result is the same bits on every run and a row's, slot's or request's result
//! does not depend on the batch it is in. Against the CPU the results agree to
//! rounding (fused multiply-adds, other summation trees); the device check
//! (`examples/cuda_check/`) states the tolerance of each op.

use std::ffi::CString;
use std::sync::Arc;

use cudarc::driver::{CudaContext, DriverError};
use cudarc::nvrtc::Ptx;

use crate::error::{KernelError, Result};
use crate::gpu::ops::{DeviceBuf, DeviceIBuf, GpuBackend, SmemPolicy};
use crate::region::DeviceMemory;

mod buffers;
mod driver;
mod program;

pub(crate) use buffers::open_memory;
pub use driver::CudaDriver;
pub(crate) use program::nvrtc_cubin_of;
#[cfg(test)]
use program::nvrtc_present;
use program::{nvrtc_arch, nvrtc_cubin, runtime_missing};

/// NVIDIA backend: device memory buffers and the model's ops as NVRTC-compiled
/// kernels on one stream (the driver-generic ops of `GpuBackend` over
/// cudarc's driver API).
///
/// ```no_run
/// use handoff_kernels::{Backend, CudaBackend};
/// if CudaBackend::is_available() {
///     let be = CudaBackend::new(0).unwrap();
///     let x = be.upload(&[1.0, 2.0]).unwrap();
///     assert_eq!(be.download(&x).unwrap(), vec![1.0, 2.0]);
/// }
/// ```
///
/// Cloning shares the context, stream and compiled program (no recompile).
pub type CudaBackend = GpuBackend<CudaDriver>;
/// An f32 buffer in CUDA device memory.
pub type CudaBuf = DeviceBuf<f32, CudaDriver>;
/// An i32 buffer in CUDA device memory (token ids, replay cursors), with the
/// host's known copy of its contents.
pub type CudaIBuf = DeviceIBuf<CudaDriver>;
/// An f64 buffer in CUDA device memory (attention partials).
pub type CudaF64Buf = DeviceBuf<f64, CudaDriver>;

fn unavailable(what: &str, e: DriverError) -> KernelError {
    KernelError::BackendUnavailable(format!("cuda: {what}: {e}"))
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// Device memory for the regions of a CUDA backend: `DeviceMem` on its context.
fn memory_of(drv: &CudaDriver) -> Result<Arc<dyn DeviceMemory>> {
    buffers::memory_on(Arc::clone(&drv.ctx))
}

impl GpuBackend<CudaDriver> {
    /// Opens CUDA device `device` and compiles the kernels for it (NVRTC, a
    /// few hundred milliseconds). Refuses with `BackendUnavailable` and a
    /// reason when the driver or NVRTC library is missing ("cuda: no CUDA
    /// driver: ..."), there is no such device, or the compile fails.
    pub fn new(device: usize) -> Result<Self> {
        if let Some(why) = runtime_missing() {
            return Err(KernelError::BackendUnavailable(why));
        }
        // cudarc still panics on a missing symbol (a driver older than the
        // CUDA 13 API it binds): keep that a refusal as well.
        match std::panic::catch_unwind(|| Self::open(device)) {
            Ok(r) => r,
            Err(p) => Err(KernelError::BackendUnavailable(format!("cuda: the CUDA runtime failed while opening device {device}: {}", panic_text(p.as_ref())))),
        }
    }

    /// Whether `CudaBackend::new(0)` can open a device here: the libraries
    /// load and the driver reports at least one device. Does not compile.
    pub fn is_available() -> bool {
        runtime_missing().is_none() && std::panic::catch_unwind(|| CudaContext::device_count().map(|n| n > 0).unwrap_or(false)).unwrap_or(false)
    }

    fn open(device: usize) -> Result<Self> {
        let count = CudaContext::device_count().map_err(|e| unavailable("no device (cuInit or device count failed)", e))?;
        if count <= 0 {
            return Err(KernelError::BackendUnavailable("cuda: no device: the driver reports 0 CUDA devices".to_string()));
        }
        if device >= count as usize {
            return Err(KernelError::BackendUnavailable(format!("cuda: no device {device}: the driver reports {count}")));
        }
        let ctx = CudaContext::new(device).map_err(|e| unavailable("cannot open the device context", e))?;
        // SAFETY: called before any buffer or stream exists; every op of this
        // backend runs on its one stream, in order, so no buffer needs the
        // events cudarc records for cross-stream use.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| unavailable("cannot create a stream", e))?;
        keep_freed_memory(&ctx);
        let cc = ctx.compute_capability().map_err(|e| unavailable("compute capability", e))?;
        let device_name = ctx.name().map_err(|e| unavailable("device name", e))?;
        let cubin = nvrtc_cubin(&nvrtc_arch(cc))?;
        let module = ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| unavailable("cannot load the compiled kernels", e))?;
        let drv = CudaDriver { ctx, stream, module, cc };
        // Every NVIDIA device this backend targets gives the large-tile
        // kernels their shared memory; one that does not is refused, naming
        // the kernel (the chunked KDA prefill alone falls back).
        GpuBackend::on_driver(drv, device_name, device, format!(", sm_{}{}", cc.0, cc.1), SmemPolicy::Refuse, memory_of).map(crate::gpu::ops::with_layer_marks)
    }

    /// The fused decode step's tensor-core product alone (see
    /// `step_gpu::tc_matmul`): the product and its mean device time in us.
    #[allow(clippy::too_many_arguments)]
    pub fn step_matmul(
        &self,
        x: &[f32],
        m: usize,
        w: &crate::step::StepMat,
        dtype: crate::step::WeightDtype,
        terms: u32,
        reps: usize,
    ) -> Result<(Vec<f32>, f64)> {
        crate::gpu::step_gpu::tc_matmul(&self.driver(), x, m, w, dtype, terms, reps)
    }

    /// The launch seam's driver of this backend (context, stream, module).
    fn driver(&self) -> CudaDriver {
        self.drv.clone()
    }

    /// Compute capability (major, minor); the kernels were compiled for it.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.drv.cc
    }
}

/// Workspaces (the chunked KDA prefill's, the products' packed operands) are
/// allocated and freed on the stream each pass, from the device's default
/// stream-ordered pool. Its release threshold is 0 by default, so every
/// synchronize handed the freed memory back to the driver and the next pass
/// mapped it again; keeping it in the pool makes those allocations cheap.
/// The pool then holds at most the largest pass's workspaces. A driver that
/// refuses leaves the default, which is only slower.
fn keep_freed_memory(ctx: &CudaContext) {
    use cudarc::driver::sys::{CUmemPool_attribute, CUmemoryPool, CUresult, cuDeviceGetDefaultMemPool, cuMemPoolSetAttribute};
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: pool is a valid out-pointer; the device ordinal is this context's.
    if unsafe { cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) } != CUresult::CUDA_SUCCESS || pool.is_null() {
        return;
    }
    let mut keep: u64 = u64::MAX;
    // SAFETY: the release threshold attribute takes a pointer to a u64 (cuuint64_t).
    let _ = unsafe { cuMemPoolSetAttribute(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, (&mut keep as *mut u64).cast()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compiles every kernel source through NVRTC for sm_90 where libnvrtc can
    /// be loaded (no driver or GPU needed); elsewhere there is nothing to run.
    #[test]
    fn nvrtc_compiles_the_sources_for_sm_90_where_nvrtc_exists() {
        if !nvrtc_present() {
            // CI puts NVIDIA's NVRTC wheel on the loader path (.ci/run), so
            // there a missing library is a failure, not a skip.
            assert!(std::env::var("CI").map_or(true, |v| v != "true"), "CI: libnvrtc is not on the loader path, so the kernels were not compiled for sm_90");
            eprintln!("libnvrtc not on the loader path: NVRTC compile not checked here");
            return;
        }
        // The H200's target (sm_90a: the warpgroup products are in it) and
        // plain sm_90 (they are left out, and the rest still builds).
        for (arch, wg) in [(nvrtc_arch((9, 0)), true), ("90".to_string(), false)] {
            let cubin = nvrtc_cubin(&arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(cubin.starts_with(b"\x7fELF"), "NVRTC did not return a cubin for sm_{arch}");
            let has = |name: &[u8]| cubin.windows(name.len()).any(|w| w == name);
            assert!(has(b"st_mm_few"), "sm_{arch}: st_mm_few missing");
            assert_eq!(has(b"matmul_wg"), wg, "sm_{arch}: matmul_wg present = {}", !wg);
            for nb in [32, 64, 96, 128] {
                for wp in [1, 2] {
                    let name = format!("st_mm_wg{nb}_{wp}");
                    assert_eq!(has(name.as_bytes()), wg, "sm_{arch}: {name} present = {}", !wg);
                }
            }
        }
    }

    #[test]
    fn without_a_driver_new_refuses_naming_the_missing_library() {
        if runtime_missing().is_none() {
            return; // a machine with the driver: CudaBackend::new is tested on the device
        }
        let e = CudaBackend::new(0).unwrap_err();
        let KernelError::BackendUnavailable(msg) = e else { panic!("{e:?}") };
        assert!(msg.starts_with("cuda: no "), "{msg}");
        assert!(!CudaBackend::is_available());
    }
}
