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

impl CudaBackend {
    /// f32 MLA attention: decode (tokens = 1, base = rows) or causal prefill.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mla_attend(
        &self,
        op: &'static str,
        shape: MlaShape,
        tokens: usize,
        base: usize,
        q_lat: &CudaBuf,
        rows: &CudaBuf,
        out: &mut CudaBuf,
        lse: Option<&mut CudaBuf>,
    ) -> Result<()> {
        let (h, l, width) = (shape.heads, shape.kv_lora_rank, shape.row_width());
        if tokens == 0 {
            return Ok(());
        }
        let (threads, smem) = mla_warps(op, l, width, 4)?;
        let cfg = LaunchConfig { grid_dim: (int(op, "tokens x heads", tokens * h)? as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem };
        let (hh, ll, ww) = (int(op, "heads", h)?, int(op, "kv_lora_rank", l)?, int(op, "row width", width)?);
        let base = i64_of(base);
        let null: u64 = 0;
        let mut b = self.stream.launch_builder(&self.f.mla_attend_f32);
        b.arg(&q_lat.data).arg(&rows.data).arg(&mut out.data);
        match lse {
            Some(x) => b.arg(&mut x.data),
            None => b.arg(&null),
        };
        b.arg(&hh).arg(&ll).arg(&ww).arg(&base).arg(&shape.scale);
        // SAFETY: types and order match mla_attend_f32; lengths were checked.
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        Ok(())
    }

    /// Whether the tensor-core partial takes `shape` (K3's row shape, heads
    /// in groups of 8, and not switched off by `--mla scalar`).
    pub(super) fn mla_tc_applies(&self, shape: MlaShape) -> bool {
        self.mla_tc.warps != 0 && shape.kv_lora_rank == MLA_TC_L && shape.rope_dim == MLA_TC_R && shape.heads.is_multiple_of(8)
    }

    /// f64 partials of `counts.len()` requests whose rows lie one after the
    /// other in `rows` (lengths checked by the caller): the tensor-core kernel
    /// for K3's row shape, else the scalar one.
    pub(super) fn mla_partial_any(
        &self,
        op: &'static str,
        shape: MlaShape,
        q_lat: &CudaBuf,
        rows: &CudaBuf,
        counts: &[usize],
        partial: &mut CudaF64Buf,
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
        self.mla_partial(op, shape, batch, q_lat, rows, Some(&starts), 0, partial)
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
        q_lat: &CudaBuf,
        rows: &CudaBuf,
        counts: &[usize],
        partial: &mut CudaF64Buf,
        tc: MlaTc,
    ) -> Result<()> {
        let (h, l) = (shape.heads, shape.kv_lora_rank);
        let batch = counts.len();
        let nchunks: usize = counts.iter().map(|&n| n.div_ceil(tc.chunk)).sum();
        let pw = mla_partial_width(l);
        // The work table and the chunk partials' scratch stay on the device
        // while the row counts do (a repeated call uploads and allocates
        // nothing: the device never waits for the host between calls).
        let mut cache = self.mla_scratch.lock().unwrap_or_else(|p| p.into_inner());
        let fresh = !matches!(&*cache, Some(c) if c.counts == counts && c.chunk == tc.chunk && c.heads == h && c.parts.len() >= (nchunks * h * pw).max(1));
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
            // SAFETY: every element of the scratch is written by the chunk
            // kernel (each (chunk, head) block writes its m, l and all L
            // columns) before the merge reads it; both run on this stream in order.
            let parts = unsafe { self.stream.alloc::<f64>((nchunks * h * pw).max(1)) }.map_err(dev(op))?;
            *cache = Some(MlaScratch { counts: counts.to_vec(), chunk: tc.chunk, heads: h, table, parts });
        }
        let MlaScratch { table, parts, .. } = cache.as_mut().expect("filled above");
        let (hh, ll) = (int(op, "heads", h)?, int(op, "kv_lora_rank", l)?);
        if nchunks > 0 {
            if nchunks > i32::MAX as usize || h / 8 > 65535 {
                return Err(KernelError::InvalidShape { op, reason: format!("{nchunks} chunks x {h} heads exceed the device grid") });
            }
            let nw = tc.warps;
            let (func, smem) = if tc.deep(nchunks * (h / 8), self.sms) {
                (&self.f.mla_partial_tc8_deep, mla_tc_smem_ring(8, MLA_TC_DEEP_RING))
            } else if nw == 8 {
                (&self.f.mla_partial_tc8, mla_tc_smem(8))
            } else {
                (&self.f.mla_partial_tc4, mla_tc_smem(4))
            };
            let cfg = LaunchConfig { grid_dim: (nchunks as u32, (h / 8) as u32, 1), block_dim: ((32 * nw) as u32, 1, 1), shared_mem_bytes: smem as u32 };
            let work = table.slice((batch + 1)..);
            let scale = shape.scale as f64;
            let mut b = self.stream.launch_builder(func);
            b.arg(&q_lat.data).arg(&rows.data).arg(&work).arg(&mut *parts).arg(&hh).arg(&scale);
            // SAFETY: types and order match mla_partial_tc4/8/8_deep; the table's rows
            // lie inside `rows` (checked by the caller), q_lat holds B x H rows.
            unsafe { b.launch(cfg) }.map_err(dev(op))?;
        }
        let col_blocks = l.div_ceil(MLA_MERGE_COLS).max(1) as u32;
        let cfg = LaunchConfig {
            grid_dim: (int(op, "requests x heads", batch * h)? as u32, col_blocks, 1),
            block_dim: (MLA_MERGE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.f.mla_chunk_merge_f64);
        b.arg(&*parts).arg(&*table).arg(&mut partial.data).arg(&hh).arg(&ll);
        // SAFETY: types and order match mla_chunk_merge_f64; partial holds B x H x (2 + L).
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        if nchunks * h * pw * 8 > MLA_SCRATCH_KEEP {
            // Too large to hold between calls: freed in stream order, after the merge.
            *cache = None;
        }
        Ok(())
    }

    /// f64 partials for `batch` requests; `starts` (batch + 1 row offsets) or,
    /// when None, one request of `count` rows.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mla_partial(
        &self,
        op: &'static str,
        shape: MlaShape,
        batch: usize,
        q_lat: &CudaBuf,
        rows: &CudaBuf,
        starts: Option<&CudaSlice<u64>>,
        count: usize,
        partial: &mut CudaF64Buf,
    ) -> Result<()> {
        let (h, l, width) = (shape.heads, shape.kv_lora_rank, shape.row_width());
        if batch == 0 {
            return Ok(());
        }
        let (threads, smem) = mla_warps(op, l, width, 8)?;
        let cfg = LaunchConfig { grid_dim: (int(op, "requests x heads", batch * h)? as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem };
        let (hh, ll, ww) = (int(op, "heads", h)?, int(op, "kv_lora_rank", l)?, int(op, "row width", width)?);
        let count = i64_of(count);
        let scale = shape.scale as f64;
        let null: u64 = 0;
        let mut b = self.stream.launch_builder(&self.f.mla_partial_f64);
        b.arg(&q_lat.data).arg(&rows.data);
        match starts {
            Some(s) => b.arg(s),
            None => b.arg(&null),
        };
        b.arg(&mut partial.data).arg(&hh).arg(&ll).arg(&ww).arg(&count).arg(&scale);
        // SAFETY: types and order match mla_partial_f64; lengths were checked.
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        Ok(())
    }
}
