//! MLA launchers (mla.hip): attention, the f64 partials (scalar and tensor
//! core) and their block shapes.

use super::*;

/// Warps per block of the MLA kernels: 8 when their shared memory
/// (q, one accumulator per warp, (m, l) per warp) fits, fewer for wide rows.
/// Depends on the widths only, so a request's reduction order never depends
/// on the batch.
pub(super) fn mla_warps(op: &'static str, l: usize, width: usize, elem: usize) -> Result<(u32, u32)> {
    for nw in [8usize, 4, 2, 1] {
        let bytes = (width + nw * l + 2 * nw) * elem;
        if bytes <= SMEM_BUDGET {
            return Ok(((nw * 32) as u32, bytes as u32));
        }
    }
    Err(KernelError::InvalidShape { op, reason: format!("rows of {width} (latent {l}) do not fit the device kernel's shared memory") })
}

impl<D: Driver> GpuBackend<D> {
    /// f32 MLA attention: decode (tokens = 1, base = rows) or causal prefill.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mla_attend(
        &self,
        op: &'static str,
        shape: MlaShape,
        tokens: usize,
        base: usize,
        q_lat: &DeviceBuf<f32, D>,
        rows: &DeviceBuf<f32, D>,
        out: &mut DeviceBuf<f32, D>,
        lse: Option<&mut DeviceBuf<f32, D>>,
    ) -> Result<()> {
        let (h, l, width) = (shape.heads, shape.kv_lora_rank, shape.row_width());
        if tokens == 0 {
            return Ok(());
        }
        let (threads, smem) = mla_warps(op, l, width, 4)?;
        let cfg = Cfg { grid: (int(op, "tokens x heads", tokens * h)? as u32, 1, 1), block: threads, smem };
        let (hh, ll, ww) = (int(op, "heads", h)?, int(op, "kv_lora_rank", l)?, int(op, "row width", width)?);
        let args = [
            Arg::P(q_lat.ptr),
            Arg::P(rows.ptr),
            Arg::P(out.ptr),
            Arg::P(lse.map_or(0, |x| x.ptr)),
            Arg::I(hh),
            Arg::I(ll),
            Arg::I(ww),
            Arg::L(i64_of(base)),
            Arg::F(shape.scale),
        ];
        // SAFETY: types and order match mla_attend_f32; lengths were checked.
        unsafe { self.launch(op, self.f.mla_attend_f32, cfg, None, &args) }
    }

    /// Whether the tensor-core partial takes `shape` (K3's row shape, heads
    /// in groups of 8, not switched off by `--mla scalar`, and the device
    /// gives its blocks their shared memory).
    pub(super) fn mla_tc_applies(&self, shape: MlaShape) -> bool {
        self.mla_tc.warps != 0 && self.f.mla_tc.is_some() && shape.kv_lora_rank == MLA_TC_L && shape.rope_dim == MLA_TC_R && shape.heads.is_multiple_of(8)
    }

    /// f64 partials of `counts.len()` requests whose rows lie one after the
    /// other in `rows` (lengths checked by the caller): the tensor-core kernel
    /// for K3's row shape, else the scalar one.
    pub(super) fn mla_partial_any(
        &self,
        op: &'static str,
        shape: MlaShape,
        q_lat: &DeviceBuf<f32, D>,
        rows: &DeviceBuf<f32, D>,
        counts: &[usize],
        partial: &mut DeviceBuf<f64, D>,
    ) -> Result<()> {
        let batch = counts.len();
        if batch == 0 {
            return Ok(());
        }
        if self.mla_tc_applies(shape) {
            return self.mla_partial_tc(op, shape, q_lat, rows, counts, partial, self.mla_tc);
        }
        if batch == 1 {
            return self.mla_partial(op, shape, 1, q_lat, rows, None, counts[0], partial);
        }
        // Row offsets of the requests, uploaded for this call (B + 1 values);
        // the temporary is freed on the stream after the kernel.
        let mut starts = Vec::with_capacity(batch + 1);
        let mut at = 0u64;
        starts.push(0);
        for &c in counts {
            at += c as u64;
            starts.push(at);
        }
        let starts = self.upload_t(op, &starts)?;
        self.mla_partial(op, shape, batch, q_lat, rows, Some(starts.ptr), 0, partial)
    }

    /// The tensor-core partial (mla.hip, `mla_partial_tc4/8`): every request's
    /// rows cut into chunks of `tc.chunk` rows counted from the request's first
    /// row, one block per (chunk, 8 heads) into a scratch of chunk partials,
    /// then `mla_chunk_merge_f64` merges each request's chunks in order.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mla_partial_tc(
        &self,
        op: &'static str,
        shape: MlaShape,
        q_lat: &DeviceBuf<f32, D>,
        rows: &DeviceBuf<f32, D>,
        counts: &[usize],
        partial: &mut DeviceBuf<f64, D>,
        tc: MlaTc,
    ) -> Result<()> {
        let Some(k) = self.f.mla_tc else {
            return Err(KernelError::InvalidShape { op, reason: "the device cannot run the tensor-core MLA partial".into() });
        };
        let (h, l) = (shape.heads, shape.kv_lora_rank);
        let batch = counts.len();
        let nchunks: usize = counts.iter().map(|&n| n.div_ceil(tc.chunk)).sum();
        let pw = mla_partial_width(l);
        // The work table and the chunk partials' scratch stay on the device
        // while the row counts do (a repeated call uploads and allocates
        // nothing: the device never waits for the host between calls).
        let mut cache = self.mla_scratch.lock().unwrap_or_else(|p| p.into_inner());
        let fresh = !matches!(&*cache, Some(c) if c.counts == counts && c.chunk == tc.chunk && c.heads == h && c.parts.cap >= (nchunks * h * pw).max(1));
        if fresh {
            // One table: [B + 1] first chunk of each request, then per chunk
            // (first row, rows, request).
            let mut table: Vec<i64> = Vec::with_capacity(batch + 1 + 3 * nchunks);
            let mut c = 0usize;
            table.push(0);
            for &n in counts {
                c += n.div_ceil(tc.chunk);
                table.push(i64_of(c));
            }
            let mut row0 = 0usize;
            for (b, &n) in counts.iter().enumerate() {
                let mut r = 0usize;
                while r < n {
                    let k = tc.chunk.min(n - r);
                    table.extend([i64_of(row0 + r), i64_of(k), i64_of(b)]);
                    r += k;
                }
                row0 += n;
            }
            *cache = None; // the old scratch goes first
            let table = self.upload_t(op, &table)?;
            // Every element of the scratch is written by the chunk kernel
            // (each (chunk, head) block writes its m, l and all L columns)
            // before the merge reads it; both run on this stream in order.
            let parts = self.alloc_raw::<f64>(op, (nchunks * h * pw).max(1))?;
            *cache = Some(MlaScratch { counts: counts.to_vec(), chunk: tc.chunk, heads: h, table, parts });
        }
        let MlaScratch { table, parts, .. } = cache.as_ref().expect("filled above");
        let (hh, ll) = (int(op, "heads", h)?, int(op, "kv_lora_rank", l)?);
        if nchunks > 0 {
            if nchunks > i32::MAX as usize || h / 8 > 65535 {
                return Err(KernelError::InvalidShape { op, reason: format!("{nchunks} chunks x {h} heads exceed the device grid") });
            }
            let nw = tc.warps;
            let (func, smem) = if tc.deep(nchunks * (h / 8), self.sms) {
                (k.tc8_deep, mla_tc_smem_ring(8, MLA_TC_DEEP_RING))
            } else if nw == 8 {
                (k.tc8, mla_tc_smem(8))
            } else {
                (k.tc4, mla_tc_smem(4))
            };
            let cfg = Cfg { grid: (nchunks as u32, (h / 8) as u32, 1), block: (32 * nw) as u32, smem: smem as u32 };
            let work = at::<i64>(table.ptr, batch + 1);
            let args = [Arg::P(q_lat.ptr), Arg::P(rows.ptr), Arg::P(work), Arg::P(parts.ptr), Arg::I(hh), Arg::D(shape.scale as f64)];
            // SAFETY: types and order match mla_partial_tc4/8/8_deep; the table's rows
            // lie inside `rows` (checked by the caller), q_lat holds B x H rows.
            unsafe { self.launch(op, func, cfg, None, &args) }?;
        }
        let col_blocks = l.div_ceil(MLA_MERGE_COLS).max(1) as u32;
        let cfg = Cfg { grid: (int(op, "requests x heads", batch * h)? as u32, col_blocks, 1), block: MLA_MERGE_THREADS, smem: 0 };
        let args = [Arg::P(parts.ptr), Arg::P(table.ptr), Arg::P(partial.ptr), Arg::I(hh), Arg::I(ll)];
        // SAFETY: types and order match mla_chunk_merge_f64; partial holds B x H x (2 + L).
        unsafe { self.launch(op, self.f.mla_chunk_merge_f64, cfg, None, &args) }?;
        if nchunks * h * pw * 8 > MLA_SCRATCH_KEEP {
            // Too large to hold between calls: freed in stream order, after the merge.
            *cache = None;
        }
        Ok(())
    }

    /// f64 partials for `batch` requests; `starts` (the device address of
    /// batch + 1 row offsets) or, when None, one request of `count` rows.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mla_partial(
        &self,
        op: &'static str,
        shape: MlaShape,
        batch: usize,
        q_lat: &DeviceBuf<f32, D>,
        rows: &DeviceBuf<f32, D>,
        starts: Option<u64>,
        count: usize,
        partial: &mut DeviceBuf<f64, D>,
    ) -> Result<()> {
        let (h, l, width) = (shape.heads, shape.kv_lora_rank, shape.row_width());
        if batch == 0 {
            return Ok(());
        }
        let (threads, smem) = mla_warps(op, l, width, 8)?;
        let cfg = Cfg { grid: (int(op, "requests x heads", batch * h)? as u32, 1, 1), block: threads, smem };
        let (hh, ll, ww) = (int(op, "heads", h)?, int(op, "kv_lora_rank", l)?, int(op, "row width", width)?);
        let args = [
            Arg::P(q_lat.ptr),
            Arg::P(rows.ptr),
            Arg::P(starts.unwrap_or(0)),
            Arg::P(partial.ptr),
            Arg::I(hh),
            Arg::I(ll),
            Arg::I(ww),
            Arg::L(i64_of(count)),
            Arg::D(shape.scale as f64),
        ];
        // SAFETY: types and order match mla_partial_f64; lengths were checked.
        unsafe { self.launch(op, self.f.mla_partial_f64, cfg, None, &args) }
    }
}
