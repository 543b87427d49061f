//! Copy launchers (copy.hip): fill and the region gather/scatter kernels.

use super::*;

impl CudaBackend {
    pub(super) fn fill_unchecked(&self, op: &'static str, buf: &mut CudaSlice<f32>, n: usize, value: f32) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let nn = i64_of(n);
        let mut b = self.stream.launch_builder(&self.f.fill_f32);
        b.arg(buf).arg(&value).arg(&nn);
        // SAFETY: types and order match fill_f32; n is within the buffer.
        unsafe { b.launch(ew_cfg(n)) }.map_err(dev(op))?;
        Ok(())
    }
}

/// The region kernels' launch: items, values per item, the device offsets.
impl CudaBackend {
    pub(super) fn region_launch(
        &self,
        op: &'static str,
        region: DeviceRegion,
        items: RegionItems<'_>,
        buf_len: usize,
        launch: impl FnOnce(&CudaSlice<i64>, i64, i64, i32) -> Result<()>,
    ) -> Result<()> {
        let n = items.check(op, region)?;
        check_len(op, "buffer", buf_len, n)?;
        if n == 0 {
            return Ok(());
        }
        let offs: Vec<i64> = items.offsets.iter().map(|&o| o as i64).collect();
        let offs = self.upload_t::<i64>(op, &offs)?;
        let code = match items.dtype {
            StorageDtype::F32 => 0,
            StorageDtype::Bf16 => 1,
            StorageDtype::F16 => 2,
        };
        launch(&offs, i64_of(items.offsets.len()), i64_of(items.values), code)
    }

    /// Launches a 4-byte (`code` 0) or 16-bit region kernel over `n` elements.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn region_kernel<T: cudarc::driver::DeviceRepr>(
        &self,
        op: &'static str,
        b32: &CudaFunction,
        b16: &CudaFunction,
        region: DeviceRegion,
        offs: &CudaSlice<i64>,
        items: i64,
        per: i64,
        code: i32,
        buf: &CudaSlice<T>,
    ) -> Result<()> {
        let n = (items * per) as usize;
        let base = region.addr;
        let mut b = self.stream.launch_builder(if code == 0 { b32 } else { b16 });
        b.arg(&base).arg(offs).arg(&items).arg(&per);
        if code != 0 {
            b.arg(&code);
        }
        b.arg(buf);
        // SAFETY: argument types and order match region_{gather,scatter}_b{32,16}
        // (the base is a device address, passed as 8 bytes); every item was
        // checked against the region by `RegionItems::check`.
        unsafe { b.launch(ew_cfg(n)) }.map_err(dev(op))?;
        Ok(())
    }
}
