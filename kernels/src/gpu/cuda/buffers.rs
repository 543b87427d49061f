//! Device buffers: f32, i32 (with the host's known copy) and f64; their
//! allocation, upload and download; the device memory of registered regions.

use super::*;

/// An f32 buffer in device memory.
pub struct CudaBuf {
    pub(super) data: CudaSlice<f32>,
    pub(super) len: usize,
}

/// An i32 buffer in device memory (token ids, replay cursors).
///
/// `known` holds the contents when the host knows them without asking the
/// device: what was uploaded, the zeros of an allocation, the cursors an op set
/// from values it checked, or what the last download read. A download then
/// needs no round trip (under ReplaySSM a decode step reads its cursors back
/// several times a layer, and every read used to wait for the stream). Every op
/// that writes the buffer on the device from values the host does not have
/// (argmax, a region gather) clears it; those all take the buffer `&mut` or
/// create it.
pub struct CudaIBuf {
    pub(super) data: CudaSlice<i32>,
    pub(super) len: usize,
    pub(super) known: std::sync::Mutex<Option<Vec<i32>>>,
}

impl CudaIBuf {
    pub(super) fn new(data: CudaSlice<i32>, len: usize, known: Option<Vec<i32>>) -> Self {
        CudaIBuf { data, len, known: std::sync::Mutex::new(known) }
    }

    pub(super) fn known(&self) -> std::sync::MutexGuard<'_, Option<Vec<i32>>> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn set_known(&mut self, v: Option<Vec<i32>>) {
        *self.known.get_mut().unwrap_or_else(|e| e.into_inner()) = v;
    }
}

/// An f64 buffer in device memory (attention partials).
pub struct CudaF64Buf {
    pub(super) data: CudaSlice<f64>,
    pub(super) len: usize,
}

impl fmt::Debug for CudaBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaBuf({} x f32)", self.len)
    }
}
impl fmt::Debug for CudaIBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaIBuf({} x i32)", self.len)
    }
}
impl fmt::Debug for CudaF64Buf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaF64Buf({} x f64)", self.len)
    }
}

impl CudaBackend {
    pub(super) fn alloc_t<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, op: &'static str, len: usize) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros::<T>(len.max(1)).map_err(dev(op))
    }

    pub(super) fn upload_t<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, op: &'static str, data: &[T]) -> Result<CudaSlice<T>> {
        let mut buf = self.alloc_t::<T>(op, data.len())?;
        if !data.is_empty() {
            self.stream.memcpy_htod(data, &mut buf.slice_mut(0..data.len())).map_err(dev(op))?;
        }
        Ok(buf)
    }

    pub(super) fn download_t<T: cudarc::driver::DeviceRepr>(&self, op: &'static str, data: &CudaSlice<T>, len: usize) -> Result<Vec<T>> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let v = self.stream.clone_dtoh(&data.slice(0..len)).map_err(dev(op))?;
        self.stream.synchronize().map_err(dev(op))?;
        Ok(v)
    }
}

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
