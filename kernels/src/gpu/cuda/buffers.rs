//! Device memory of registered regions on CUDA: the driver-generic
//! `DeviceMem` (`gpu/ops/memory.rs`) on a context, opened with or without a
//! backend (the buffers themselves are the driver-generic `DeviceBuf`).

use super::*;
use crate::gpu::launch::dev;
use crate::gpu::ops::DeviceMem;

/// [`crate::gpu::cuda_device_memory`]: the device's primary context, checked like
/// [`CudaBackend::new`] (libraries first, then the device count).
pub(crate) fn open_memory(device: usize) -> Result<Arc<dyn DeviceMemory>> {
    if let Some(why) = runtime_missing() {
        return Err(KernelError::BackendUnavailable(why));
    }
    let open = || -> Result<Arc<dyn DeviceMemory>> {
        let count = CudaContext::device_count().map_err(|e| unavailable("no device (cuInit or device count failed)", e))?;
        if device >= count.max(0) as usize {
            return Err(KernelError::BackendUnavailable(format!("cuda: no device {device}: the driver reports {count}")));
        }
        let ctx = CudaContext::new(device).map_err(|e| unavailable("cannot open the device context", e))?;
        memory_on(ctx)
    };
    match std::panic::catch_unwind(open) {
        Ok(r) => r,
        Err(p) => Err(KernelError::BackendUnavailable(format!("cuda: the CUDA runtime failed while opening device {device}: {}", panic_text(p.as_ref())))),
    }
}

/// Device memory for regions on `ctx`: a stream of its own for host access,
/// and `copy_table` compiled on its own (a few tens of ms), so that a
/// transport opens without the model's kernels.
pub(crate) fn memory_on(ctx: Arc<CudaContext>) -> Result<Arc<dyn DeviceMemory>> {
    let op = "device memory";
    let fault = |e: DriverError| dev(op)(crate::gpu::launch::DriverFault(e.to_string()));
    let stream = ctx.new_stream().map_err(fault)?;
    let cc = ctx.compute_capability().map_err(fault)?;
    let program = crate::gpu::program_of(|name| name == "memcopy.hip");
    let cubin = nvrtc_cubin_of(&program, &format!("{}{}", cc.0, cc.1))?;
    let module = ctx.load_module(Ptx::from_binary(cubin)).map_err(fault)?;
    Ok(Arc::new(DeviceMem::new(CudaDriver { ctx, stream, module, cc })?))
}
