//! Device memory of registered regions on CUDA, opened without a backend
//! (the buffers themselves are the driver-generic `DeviceBuf`, `gpu/ops/`).

use super::*;

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
        Ok(Arc::new(crate::gpu::CudaMemory::new(ctx)?))
    };
    match std::panic::catch_unwind(open) {
        Ok(r) => r,
        Err(p) => Err(KernelError::BackendUnavailable(format!("cuda: the CUDA runtime failed while opening device {device}: {}", panic_text(p.as_ref())))),
    }
}
