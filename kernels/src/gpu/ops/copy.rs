//! Copy launchers (copy.hip): fill and the region gather/scatter kernels.

use super::*;

impl<D: Driver> GpuBackend<D> {
    /// fill_f32 over the `n` floats at `buf`.
    pub(super) fn fill_unchecked(&self, op: &'static str, buf: u64, n: usize, value: f32) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let args = [Arg::P(buf), Arg::F(value), Arg::L(i64_of(n))];
        // SAFETY: types and order match fill_f32; n is within the buffer.
        unsafe { self.launch(op, self.f.fill_f32, ew_cfg(n), None, &args) }
    }

    /// The region kernels' launch: items, values per item, the device offsets.
    pub(super) fn region_launch(
        &self,
        op: &'static str,
        region: DeviceRegion,
        items: RegionItems<'_>,
        buf_len: usize,
        launch: impl FnOnce(u64, i64, i64, i32) -> Result<()>,
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
        // The offsets' buffer is freed on the stream after the launch.
        launch(offs.ptr, i64_of(items.offsets.len()), i64_of(items.values), code)
    }

    /// Launches a 4-byte (`code` 0) or 16-bit region kernel over `items` x
    /// `per` elements; `gather` picks the direction, `buf` is the buffer's
    /// address.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn region_kernel(
        &self,
        op: &'static str,
        gather: bool,
        region: DeviceRegion,
        offs: u64,
        items: i64,
        per: i64,
        code: i32,
        buf: u64,
    ) -> Result<()> {
        let n = (items * per) as usize;
        let (b32, b16) = if gather { (self.f.region_gather_b32, self.f.region_gather_b16) } else { (self.f.region_scatter_b32, self.f.region_scatter_b16) };
        let mut args = vec![Arg::P(region.addr), Arg::P(offs), Arg::L(items), Arg::L(per)];
        if code != 0 {
            args.push(Arg::I(code));
        }
        args.push(Arg::P(buf));
        // SAFETY: argument types and order match region_{gather,scatter}_b{32,16}
        // (the base is a device address, passed as 8 bytes); every item was
        // checked against the region by `RegionItems::check`.
        unsafe { self.launch(op, if code == 0 { b32 } else { b16 }, ew_cfg(n), None, &args) }
    }
}
