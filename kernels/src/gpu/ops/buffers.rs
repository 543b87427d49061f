//! Device buffers over a driver: f32, i32 (with the host's known copy) and
//! f64; their allocation, upload and download.

use std::marker::PhantomData;

use super::*;

/// An element type of a device buffer: its name in `Debug` text and the
/// buffer's type name there (`CudaBuf`, `CudaIBuf`, `CudaF64Buf`).
pub trait Elem: Copy + Send + Sync + 'static {
    /// The element's name ("f32").
    const NAME: &'static str;
    /// The buffer type's name after the platform's prefix ("Buf").
    const BUF: &'static str;
}

macro_rules! elem {
    ($t:ty, $name:literal, $buf:literal) => {
        impl Elem for $t {
            const NAME: &'static str = $name;
            const BUF: &'static str = $buf;
        }
    };
}
elem!(f32, "f32", "Buf");
elem!(i32, "i32", "IBuf");
elem!(f64, "f64", "F64Buf");
elem!(i64, "i64", "I64Buf");
elem!(u64, "u64", "U64Buf");
elem!(u8, "u8", "ByteBuf");

/// A buffer of `T` in the device memory of driver `D` (`CudaBuf` is
/// `DeviceBuf<f32, CudaDriver>`): at least one element is allocated (a
/// zero-length device allocation is not portable), `len` of them are the
/// buffer's. Freed on the driver's stream when dropped, after the work
/// queued before.
pub struct DeviceBuf<T: Elem, D: Driver> {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    /// Elements allocated (what a whole-buffer view spans).
    pub(crate) cap: usize,
    drv: D,
    _t: PhantomData<T>,
}

impl<T: Elem, D: Driver> Drop for DeviceBuf<T, D> {
    fn drop(&mut self) {
        // SAFETY: ptr came from alloc_async on this driver and is freed once.
        unsafe { self.drv.free_async(self.ptr) };
    }
}

impl<T: Elem, D: Driver> fmt::Debug for DeviceBuf<T, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}({} x {})", D::TYPE_PREFIX, T::BUF, self.len, T::NAME)
    }
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
pub struct DeviceIBuf<D: Driver> {
    pub(crate) data: DeviceBuf<i32, D>,
    pub(crate) known: std::sync::Mutex<Option<Vec<i32>>>,
}

impl<D: Driver> DeviceIBuf<D> {
    pub(crate) fn new(data: DeviceBuf<i32, D>, known: Option<Vec<i32>>) -> Self {
        DeviceIBuf { data, known: std::sync::Mutex::new(known) }
    }

    pub(crate) fn known(&self) -> std::sync::MutexGuard<'_, Option<Vec<i32>>> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn set_known(&mut self, v: Option<Vec<i32>>) {
        *self.known.get_mut().unwrap_or_else(|e| e.into_inner()) = v;
    }
}

impl<D: Driver> fmt::Debug for DeviceIBuf<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.data.fmt(f)
    }
}

impl<D: Driver> GpuBackend<D> {
    /// `len` elements (at least one allocated), zeroed on the stream.
    pub(crate) fn alloc_t<T: Elem>(&self, op: &'static str, len: usize) -> Result<DeviceBuf<T, D>> {
        let cap = len.max(1);
        let mut buf = self.alloc_raw::<T>(op, cap)?;
        // SAFETY: the allocation holds cap elements.
        unsafe { self.drv.memset_zero(buf.ptr, cap * std::mem::size_of::<T>()) }.map_err(dev(op))?;
        buf.len = len;
        Ok(buf)
    }

    /// `cap` elements, not zeroed (scratch that a kernel writes before any
    /// read; `len` = `cap`).
    pub(crate) fn alloc_raw<T: Elem>(&self, op: &'static str, cap: usize) -> Result<DeviceBuf<T, D>> {
        self.drv.bind().map_err(dev(op))?;
        let ptr = self.drv.alloc_async(cap * std::mem::size_of::<T>()).map_err(dev(op))?;
        Ok(DeviceBuf { ptr, len: cap, cap, drv: self.drv.clone(), _t: PhantomData })
    }

    /// A buffer holding `data` (allocated and zeroed, then copied).
    pub(crate) fn upload_t<T: Elem>(&self, op: &'static str, data: &[T]) -> Result<DeviceBuf<T, D>> {
        let buf = self.alloc_t::<T>(op, data.len())?;
        if !data.is_empty() {
            self.write_t(op, buf.ptr, data)?;
        }
        Ok(buf)
    }

    /// Copies `data` to device address `dst` on the stream.
    pub(crate) fn write_t<T: Elem>(&self, op: &'static str, dst: u64, data: &[T]) -> Result<()> {
        self.drv.bind().map_err(dev(op))?;
        // SAFETY: callers pass an address inside a buffer with room for data.
        unsafe { self.drv.upload(dst, data) }.map_err(dev(op))
    }

    /// Zeroes `n` elements of `T` at `dst` on the stream.
    pub(crate) fn zero_t<T: Elem>(&self, op: &'static str, dst: u64, n: usize) -> Result<()> {
        self.drv.bind().map_err(dev(op))?;
        // SAFETY: callers pass an address inside a buffer with room for n elements.
        unsafe { self.drv.memset_zero(dst, n * std::mem::size_of::<T>()) }.map_err(dev(op))
    }

    /// The first `len` elements of `buf`, after everything queued before.
    pub(crate) fn download_t<T: Elem + Default>(&self, op: &'static str, buf: &DeviceBuf<T, D>, len: usize) -> Result<Vec<T>> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let mut v = vec![T::default(); len];
        self.drv.bind().map_err(dev(op))?;
        // SAFETY: buf holds at least len elements.
        unsafe { self.drv.download(&mut v, buf.ptr) }.map_err(dev(op))?;
        self.drv.synchronize().map_err(dev(op))?;
        Ok(v)
    }

    /// Copies `n` elements of `T` from `src` to `dst` on the device.
    pub(crate) fn copy_t<T: Elem>(&self, op: &'static str, dst: u64, src: u64, n: usize) -> Result<()> {
        self.drv.bind().map_err(dev(op))?;
        // SAFETY: callers checked both ranges against their buffers.
        unsafe { self.drv.copy_dtod(dst, src, n * std::mem::size_of::<T>()) }.map_err(dev(op))
    }
}
