//! `impl Backend for GpuBackend<D>`: every op's checks and launches, for
//! any driver.

use super::*;

/// The f32 buffer of a backend on driver `D`.
type Buf<D> = DeviceBuf<f32, D>;

impl<D: Driver> Backend for GpuBackend<D> {
    fn decode_step(&self, spec: &crate::step::StepSpec) -> Result<Box<dyn crate::step::DecodeStep>> {
        let step = crate::gpu::step_gpu::GpuStep::new(self.drv.clone(), spec)?;
        Ok(Box::new(step))
    }

    fn device_memory(&self) -> Result<Arc<dyn DeviceMemory>> {
        (self.memory)(&self.drv)
    }

    fn region_gather(&self, region: DeviceRegion, items: RegionItems<'_>) -> Result<Buf<D>> {
        let op = "region_gather";
        let n = items.check(op, region)?;
        let out = self.alloc(n)?;
        self.region_launch(op, region, items, n, |offs, it, per, code| self.region_kernel(op, true, region, offs, it, per, code, out.ptr))?;
        Ok(out)
    }

    fn region_scatter(&self, src: &Buf<D>, region: DeviceRegion, items: RegionItems<'_>) -> Result<()> {
        let op = "region_scatter";
        self.region_launch(op, region, items, src.len, |offs, it, per, code| self.region_kernel(op, false, region, offs, it, per, code, src.ptr))
    }

    fn region_gather_i32(&self, region: DeviceRegion, offsets: &[u64]) -> Result<DeviceIBuf<D>> {
        let op = "region_gather_i32";
        let items = RegionItems { offsets, values: 1, dtype: StorageDtype::F32 };
        let mut out = self.alloc_i32(offsets.len())?;
        out.set_known(None);
        self.region_launch(op, region, items, offsets.len(), |offs, it, per, code| self.region_kernel(op, true, region, offs, it, per, code, out.data.ptr))?;
        Ok(out)
    }

    fn region_scatter_i32(&self, src: &DeviceIBuf<D>, region: DeviceRegion, offsets: &[u64]) -> Result<()> {
        let op = "region_scatter_i32";
        let items = RegionItems { offsets, values: 1, dtype: StorageDtype::F32 };
        self.region_launch(op, region, items, src.data.len, |offs, it, per, code| self.region_kernel(op, false, region, offs, it, per, code, src.data.ptr))
    }

    fn synchronize(&self) -> Result<()> {
        GpuBackend::synchronize(self)
    }

    fn mark_layer(&self) -> Result<Option<crate::region::StreamMark>> {
        let Some(m) = &self.marker else { return Ok(None) };
        self.drv.bind().map_err(crate::gpu::launch::dev("layer mark"))?;
        m.mark().map(Some)
    }

    type Buf = Buf<D>;
    type IBuf = DeviceIBuf<D>;
    type F64Buf = DeviceBuf<f64, D>;

    fn name(&self) -> &'static str {
        D::NAME
    }

    fn alloc(&self, len: usize) -> Result<Buf<D>> {
        self.alloc_t("alloc", len)
    }

    fn upload(&self, data: &[f32]) -> Result<Buf<D>> {
        self.upload_t("upload", data)
    }

    fn upload_into(&self, dst: &mut Buf<D>, offset: usize, data: &[f32]) -> Result<()> {
        let op = "upload_into";
        let r = range(op, "dst", offset, data.len(), dst.len)?;
        if !data.is_empty() {
            self.write_t(op, at::<f32>(dst.ptr, r.start), data)?;
        }
        Ok(())
    }

    fn download(&self, buf: &Buf<D>) -> Result<Vec<f32>> {
        self.download_t("download", buf, buf.len)
    }

    fn buf_len(&self, buf: &Buf<D>) -> usize {
        buf.len
    }

    fn alloc_i32(&self, len: usize) -> Result<DeviceIBuf<D>> {
        Ok(DeviceIBuf::new(self.alloc_t("alloc_i32", len)?, Some(vec![0; len])))
    }

    fn upload_i32(&self, data: &[i32]) -> Result<DeviceIBuf<D>> {
        Ok(DeviceIBuf::new(self.upload_t("upload_i32", data)?, Some(data.to_vec())))
    }

    fn download_i32(&self, buf: &DeviceIBuf<D>) -> Result<Vec<i32>> {
        let mut known = buf.known();
        if let (true, Some(v)) = (self.fused, known.as_ref()) {
            return Ok(v.clone());
        }
        let v = self.download_t("download_i32", &buf.data, buf.data.len)?;
        *known = Some(v.clone());
        Ok(v)
    }

    fn alloc_f64(&self, len: usize) -> Result<DeviceBuf<f64, D>> {
        self.alloc_t("alloc_f64", len)
    }

    fn upload_f64(&self, data: &[f64]) -> Result<DeviceBuf<f64, D>> {
        self.upload_t("upload_f64", data)
    }

    fn download_f64(&self, buf: &DeviceBuf<f64, D>) -> Result<Vec<f64>> {
        self.download_t("download_f64", buf, buf.len)
    }

    fn fill(&self, buf: &mut Buf<D>, value: f32) -> Result<()> {
        self.fill_unchecked("fill", buf.ptr, buf.len, value)
    }

    fn copy(&self, src: &Buf<D>, src_off: usize, dst: &mut Buf<D>, dst_off: usize, len: usize) -> Result<()> {
        let op = "copy";
        let rs = range(op, "src", src_off, len, src.len)?;
        let rd = range(op, "dst", dst_off, len, dst.len)?;
        if len > 0 {
            self.copy_t::<f32>(op, at::<f32>(dst.ptr, rd.start), at::<f32>(src.ptr, rs.start), len)?;
        }
        Ok(())
    }

    fn copy_cols(&self, shape: ColsCopy, src: &Buf<D>, dst: &mut Buf<D>) -> Result<()> {
        let op = "copy_cols";
        let ColsCopy { rows, src_cols, src_col, dst_cols, dst_col, width } = shape;
        check_len(op, "src", src.len, elems(op, &[rows, src_cols])?)?;
        check_len(op, "dst", dst.len, elems(op, &[rows, dst_cols])?)?;
        range(op, "src row", src_col, width, src_cols)?;
        range(op, "dst row", dst_col, width, dst_cols)?;
        let n = rows * width;
        if n == 0 {
            return Ok(());
        }
        let mut args = vec![Arg::P(src.ptr), Arg::P(dst.ptr)];
        args.extend([rows, src_cols, src_col, dst_cols, dst_col, width].map(|v| Arg::L(i64_of(v))));
        // SAFETY: types and order match copy_cols; ranges were checked.
        unsafe { self.launch(op, self.f.copy_cols, ew_cfg(n), None, &args) }
    }

    fn copy_f64(&self, src: &DeviceBuf<f64, D>, src_off: usize, dst: &mut DeviceBuf<f64, D>, dst_off: usize, len: usize) -> Result<()> {
        let op = "copy_f64";
        let rs = range(op, "src", src_off, len, src.len)?;
        let rd = range(op, "dst", dst_off, len, dst.len)?;
        if len > 0 {
            self.copy_t::<f64>(op, at::<f64>(dst.ptr, rd.start), at::<f64>(src.ptr, rs.start), len)?;
        }
        Ok(())
    }

    fn round_to(&self, buf: &mut Buf<D>, dtype: StorageDtype) -> Result<()> {
        let op = "round_to";
        let code: i32 = match dtype {
            StorageDtype::F32 => return Ok(()),
            StorageDtype::Bf16 => 1,
            StorageDtype::F16 => 2,
        };
        let n = buf.len;
        if n == 0 {
            return Ok(());
        }
        let args = [Arg::P(buf.ptr), Arg::I(code), Arg::L(i64_of(n))];
        // SAFETY: types and order match round_to.
        unsafe { self.launch(op, self.f.round_to, ew_cfg(n), None, &args) }
    }

    fn kda_step(
        &self,
        shape: KdaStepShape,
        state: &mut Buf<D>,
        x: KdaInputs<'_, Buf<D>>,
        params: KdaParams<'_, Buf<D>>,
        out: &mut Buf<D>,
        record: Option<&mut Buf<D>>,
    ) -> Result<()> {
        let op = "kda_step";
        let KdaStepShape { batch, heads, dk, dv } = shape;
        kda::check_kda(op, batch, heads, dk, dv, state.len, batch, &x, &params, out.len, record.as_ref().map(|r| r.len))?;
        self.kda_recurrent(op, batch, 1, None, heads, dk, dv, state, x, params, out, record)
    }

    /// The chunked form (kda_chunk.hip) where it applies (at least one chunk
    /// of 64 tokens, 2 dv >= 3 x 64, dk <= 128, the shared memory given): a
    /// parallel pass over all chunks, then one block per (head, 16 value
    /// columns) walks the chunks; it agrees with the CPU's chunked form to
    /// rounding. Otherwise the recurrent form: one block per (head, column
    /// tile) walks the tokens with the state in registers, so the result
    /// equals `tokens` decode steps bit for bit.
    fn kda_prefill(
        &self,
        shape: KdaPrefillShape,
        state: &mut Buf<D>,
        x: KdaInputs<'_, Buf<D>>,
        params: KdaParams<'_, Buf<D>>,
        out: &mut Buf<D>,
        record: Option<&mut Buf<D>>,
    ) -> Result<()> {
        let KdaPrefillShape { tokens, heads, dk, dv } = shape;
        let one = KdaRaggedShape { rows: tokens, heads, dk, dv };
        self.kda_prefill_seqs("kda_prefill", one, std::slice::from_ref(&(0..tokens)), state, x, params, out, record)
    }

    fn ragged_prefill_pays(&self) -> bool {
        true
    }

    /// Every prompt of a batch in one launch per phase: the chunked ones
    /// through kda_chunk_prep, kda_chunk_state and kda_chunk_out, the short ones through one
    /// recurrent launch (each as `kda_prefill` would run it alone).
    fn kda_prefill_ragged(
        &self,
        shape: KdaRaggedShape,
        seqs: &[std::ops::Range<usize>],
        states: &mut Buf<D>,
        x: KdaInputs<'_, Buf<D>>,
        params: KdaParams<'_, Buf<D>>,
        out: &mut Buf<D>,
        record: Option<&mut Buf<D>>,
    ) -> Result<()> {
        self.kda_prefill_seqs("kda_prefill_ragged", shape, seqs, states, x, params, out, record)
    }

    fn replay_append(&self, shape: ReplayShape, tokens: usize, ring: &mut Buf<D>, cursor: &mut DeviceIBuf<D>, records: &Buf<D>) -> Result<()> {
        let op = "replay_append";
        let w = cpu_kda::check_replay(op, &shape, ring.len, cursor.data.len)?;
        let ReplayShape { batch, heads, capacity, .. } = shape;
        check_len(op, "records", records.len, elems(op, &[batch, tokens, heads, w])?)?;
        let cur = self.read_cursors(op, cursor, capacity)?;
        for (b, &c) in cur.iter().enumerate() {
            if c + tokens > capacity {
                return Err(KernelError::ReplayFull { slot: b, cursor: c, tokens, capacity });
            }
        }
        let per = heads * w;
        let n = tokens * per;
        if batch == 0 || n == 0 {
            return Ok(());
        }
        if batch > 65535 {
            return Err(KernelError::InvalidShape { op, reason: format!("{batch} slots exceed the device grid") });
        }
        let mut cfg = ew_cfg(n);
        cfg.grid.0 = cfg.grid.0.min((EW_MAX_BLOCKS / batch).max(1) as u32);
        cfg.grid.1 = batch as u32;
        let (cap, tok, per64) = (int(op, "capacity", capacity)?, int(op, "tokens", tokens)?, i64_of(per));
        let args = [Arg::P(ring.ptr), Arg::P(cursor.data.ptr), Arg::P(records.ptr), Arg::I(cap), Arg::I(tok), Arg::L(per64)];
        // SAFETY: types and order match replay_append; every cursor + tokens
        // was checked to fit the ring.
        unsafe { self.launch(op, self.f.replay_append, cfg, None, &args) }?;
        // c + tokens <= capacity, which the cursor range check bounds by i32.
        let next: Vec<i32> = cur.iter().map(|&c| (c + tokens) as i32).collect();
        self.write_t(op, cursor.data.ptr, &next)?;
        cursor.set_known(Some(next));
        Ok(())
    }

    fn replay_commit(&self, shape: ReplayShape, state: &mut Buf<D>, ring: &Buf<D>, cursor: &mut DeviceIBuf<D>) -> Result<()> {
        let op = "replay_commit";
        cpu_kda::check_replay(op, &shape, ring.len, cursor.data.len)?;
        let ReplayShape { batch, heads, dk, dv, capacity } = shape;
        check_len(op, "state", state.len, elems(op, &[batch, heads, dk, dv])?)?;
        self.read_cursors(op, cursor, capacity)?;
        if dk > KDA_MAX_DK {
            return Err(KernelError::InvalidShape { op, reason: format!("dk = {dk}: the device KDA kernels hold at most {KDA_MAX_DK} key rows per head") });
        }
        if batch == 0 {
            return Ok(());
        }
        let tiles = dv.div_ceil(128); // replay_commit's tile: 4 columns per lane
        let (threads, _) = kda::kda_block(dk, 4);
        let cfg = Cfg { grid: (int(op, "slots x heads", batch * heads)? as u32, tiles as u32, 1), block: threads, smem: 0 };
        let (cap, h, k, v) = (int(op, "capacity", capacity)?, int(op, "heads", heads)?, int(op, "dk", dk)?, int(op, "dv", dv)?);
        let args = [Arg::P(state.ptr), Arg::P(ring.ptr), Arg::P(cursor.data.ptr), Arg::I(cap), Arg::I(h), Arg::I(k), Arg::I(v)];
        // SAFETY: types and order match replay_commit; cursors were checked.
        unsafe { self.launch(op, self.f.replay_commit, cfg, None, &args) }?;
        self.zero_t::<i32>(op, cursor.data.ptr, batch)?;
        cursor.set_known(Some(vec![0; batch]));
        Ok(())
    }

    fn conv_prefill(&self, shape: ConvShape, tokens: usize, x: &Buf<D>, weight: &Buf<D>, state: &mut Buf<D>, out: &mut Buf<D>) -> Result<()> {
        let op = "conv_prefill";
        let ConvShape { channels: ch, width } = shape;
        check_nonzero(op, "conv width", width)?;
        check_len(op, "weight", weight.len, elems(op, &[ch, width])?)?;
        let hist = width - 1;
        check_len(op, "x", x.len, elems(op, &[tokens, ch])?)?;
        check_len(op, "out", out.len, elems(op, &[tokens, ch])?)?;
        check_len(op, "state", state.len, elems(op, &[hist, ch])?)?;
        if ch == 0 {
            return Ok(());
        }
        let (t, c, w) = (int(op, "tokens", tokens)?, int(op, "channels", ch)?, int(op, "width", width)?);
        if tokens > 0 {
            let args = [Arg::P(x.ptr), Arg::P(weight.ptr), Arg::P(state.ptr), Arg::P(out.ptr), Arg::I(t), Arg::I(c), Arg::I(w)];
            // SAFETY: types and order match conv_prefill_out; lengths checked.
            unsafe { self.launch(op, self.f.conv_prefill_out, ew_cfg(tokens * ch), None, &args) }?;
        }
        if hist > 0 {
            // After the outputs (same stream), which read the old state.
            let args = [Arg::P(x.ptr), Arg::P(state.ptr), Arg::I(t), Arg::I(c), Arg::I(w)];
            // SAFETY: types and order match conv_prefill_state; lengths checked.
            unsafe { self.launch(op, self.f.conv_prefill_state, ew_cfg(ch), None, &args) }?;
        }
        Ok(())
    }

    fn conv_step(&self, shape: ConvShape, batch: usize, x: &Buf<D>, weight: &Buf<D>, state: &mut Buf<D>, out: &mut Buf<D>) -> Result<()> {
        let op = "conv_step";
        let ConvShape { channels: ch, width } = shape;
        check_nonzero(op, "conv width", width)?;
        check_len(op, "weight", weight.len, elems(op, &[ch, width])?)?;
        let hist = width - 1;
        check_len(op, "x", x.len, elems(op, &[batch, ch])?)?;
        check_len(op, "out", out.len, elems(op, &[batch, ch])?)?;
        check_len(op, "state", state.len, elems(op, &[batch, hist, ch])?)?;
        if ch == 0 || batch == 0 {
            return Ok(());
        }
        let (bb, c, w) = (int(op, "batch", batch)?, int(op, "channels", ch)?, int(op, "width", width)?);
        let args = [Arg::P(x.ptr), Arg::P(weight.ptr), Arg::P(state.ptr), Arg::P(out.ptr), Arg::I(bb), Arg::I(c), Arg::I(w)];
        // SAFETY: types and order match conv_step; lengths checked.
        unsafe { self.launch(op, self.f.conv_step, ew_cfg(batch * ch), None, &args) }
    }

    fn rms_norm(&self, shape: NormShape, x: &Buf<D>, weight: &Buf<D>, out: &mut Buf<D>) -> Result<()> {
        let op = "rms_norm";
        let n = elems(op, &[shape.rows, shape.dim])?;
        check_len(op, "x", x.len, n)?;
        check_len(op, "weight", weight.len, shape.dim)?;
        check_len(op, "out", out.len, n)?;
        if shape.dim == 0 || shape.rows == 0 {
            return Ok(());
        }
        let cfg = Cfg { grid: (int(op, "rows", shape.rows)? as u32, 1, 1), block: 256, smem: (256 / 32) * 4 };
        let d = int(op, "dim", shape.dim)?;
        let args = [Arg::P(x.ptr), Arg::P(weight.ptr), Arg::P(out.ptr), Arg::I(d), Arg::F(shape.eps)];
        // SAFETY: types and order match rms_norm; lengths checked.
        unsafe { self.launch(op, self.f.rms_norm, cfg, None, &args) }
    }

    fn gated_rms_norm(&self, shape: NormShape, o: &Buf<D>, gate: &Buf<D>, weight: &Buf<D>, out: &mut Buf<D>) -> Result<()> {
        let op = "gated_rms_norm";
        let n = elems(op, &[shape.rows, shape.dim])?;
        check_len(op, "x", o.len, n)?;
        check_len(op, "weight", weight.len, shape.dim)?;
        check_len(op, "out", out.len, n)?;
        check_len(op, "gate", gate.len, o.len)?;
        if shape.dim == 0 || shape.rows == 0 {
            return Ok(());
        }
        let cfg = Cfg { grid: (int(op, "rows", shape.rows)? as u32, 1, 1), block: 256, smem: (256 / 32) * 4 };
        let d = int(op, "dim", shape.dim)?;
        let args = [Arg::P(o.ptr), Arg::P(gate.ptr), Arg::P(weight.ptr), Arg::P(out.ptr), Arg::I(d), Arg::F(shape.eps)];
        // SAFETY: types and order match gated_rms_norm; lengths checked.
        unsafe { self.launch(op, self.f.gated_rms_norm, cfg, None, &args) }
    }

    fn mla_prefill(&self, shape: MlaShape, tokens: usize, q_lat: &Buf<D>, rows: RowSet<'_, Buf<D>>, out: &mut Buf<D>, lse: Option<&mut Buf<D>>) -> Result<()> {
        let op = "mla_prefill";
        let n = rows.count;
        let width = cpu_mla::check_rows(op, &shape, rows.buf.len, n)?;
        if n < tokens {
            return Err(KernelError::InvalidShape { op, reason: format!("{tokens} query tokens need at least as many rows, got {n}") });
        }
        let (h, l) = (shape.heads, shape.kv_lora_rank);
        check_len(op, "q_lat", q_lat.len, elems(op, &[tokens, h, width])?)?;
        check_len(op, "out", out.len, elems(op, &[tokens, h, l])?)?;
        if let Some(x) = lse.as_ref() {
            check_len(op, "lse", x.len, elems(op, &[tokens, h])?)?;
        }
        // Query t sees rows 0..=prefix + t: base = prefix + 1 rows for t = 0.
        self.mla_attend(op, shape, tokens, n - tokens + 1, q_lat, rows.buf, out, lse)
    }

    fn mla_decode(&self, shape: MlaShape, q_lat: &Buf<D>, rows: RowSet<'_, Buf<D>>, out: &mut Buf<D>, lse: &mut Buf<D>) -> Result<()> {
        let op = "mla_decode";
        let n = rows.count;
        let width = cpu_mla::check_rows(op, &shape, rows.buf.len, n)?;
        let (h, l) = (shape.heads, shape.kv_lora_rank);
        check_len(op, "q_lat", q_lat.len, elems(op, &[h, width])?)?;
        check_len(op, "out", out.len, elems(op, &[h, l])?)?;
        check_len(op, "lse", lse.len, h)?;
        if n > 0 && self.mla_tc_applies(shape) {
            // The tensor-core partial splits the rows over chunks (one block a
            // chunk and 8 heads, as the ragged partial does); one shard's merge
            // then normalizes it. mla_attend walks every row in one block a head.
            let mut partial = self.alloc_f64(h * mla_partial_width(l))?;
            self.mla_partial_any(op, shape, q_lat, rows.buf, &[n], &mut partial)?;
            return self.dcp_merge_partials(MergeShape { shards: 1, heads: h, width: l }, &partial, out, lse);
        }
        self.mla_attend(op, shape, 1, n, q_lat, rows.buf, out, Some(lse))
    }

    fn dcp_merge(&self, shape: MergeShape, o_shards: &Buf<D>, lse_shards: &Buf<D>, out: &mut Buf<D>, lse: &mut Buf<D>) -> Result<()> {
        let op = "dcp_merge";
        let MergeShape { shards, heads, width } = shape;
        check_len(op, "o_shards", o_shards.len, elems(op, &[shards, heads, width])?)?;
        check_len(op, "lse_shards", lse_shards.len, elems(op, &[shards, heads])?)?;
        check_len(op, "out", out.len, elems(op, &[heads, width])?)?;
        check_len(op, "lse", lse.len, heads)?;
        if heads == 0 {
            return Ok(());
        }
        let cfg = Cfg { grid: (int(op, "heads", heads)? as u32, 1, 1), block: 128, smem: 0 };
        let (s, h, w) = (int(op, "shards", shards)?, int(op, "heads", heads)?, int(op, "width", width)?);
        let args = [Arg::P(o_shards.ptr), Arg::P(lse_shards.ptr), Arg::P(out.ptr), Arg::P(lse.ptr), Arg::I(s), Arg::I(h), Arg::I(w)];
        // SAFETY: types and order match dcp_merge_f32; lengths checked.
        unsafe { self.launch(op, self.f.dcp_merge_f32, cfg, None, &args) }
    }

    fn mla_decode_partial(&self, shape: MlaShape, q_lat: &Buf<D>, rows: RowSet<'_, Buf<D>>, partial: &mut DeviceBuf<f64, D>) -> Result<()> {
        let op = "mla_decode_partial";
        let n = rows.count;
        let width = cpu_mla::check_rows(op, &shape, rows.buf.len, n)?;
        let (h, l) = (shape.heads, shape.kv_lora_rank);
        check_len(op, "q_lat", q_lat.len, elems(op, &[h, width])?)?;
        check_len(op, "partial", partial.len, elems(op, &[h, mla_partial_width(l)])?)?;
        self.mla_partial_any(op, shape, q_lat, rows.buf, &[n], partial)
    }

    fn mla_decode_partial_ragged(&self, shape: MlaShape, q_lat: &Buf<D>, rows: &Buf<D>, counts: &[usize], partial: &mut DeviceBuf<f64, D>) -> Result<()> {
        let op = "mla_decode_partial_ragged";
        let total = counts.iter().try_fold(0usize, |a, &n| a.checked_add(n)).ok_or_else(|| KernelError::SizeOverflow { op, dims: counts.to_vec() })?;
        let width = cpu_mla::check_rows(op, &shape, rows.len, total)?;
        let (h, l) = (shape.heads, shape.kv_lora_rank);
        let batch = counts.len();
        check_len(op, "q_lat", q_lat.len, elems(op, &[batch, h, width])?)?;
        check_len(op, "partial", partial.len, elems(op, &[batch, h, mla_partial_width(l)])?)?;
        self.mla_partial_any(op, shape, q_lat, rows, counts, partial)
    }

    fn dcp_merge_partials(&self, shape: MergeShape, partials: &DeviceBuf<f64, D>, out: &mut Buf<D>, lse: &mut Buf<D>) -> Result<()> {
        let op = "dcp_merge_partials";
        let MergeShape { shards, heads, width } = shape;
        check_len(op, "partials", partials.len, elems(op, &[shards, heads, mla_partial_width(width)])?)?;
        check_len(op, "out", out.len, elems(op, &[heads, width])?)?;
        check_len(op, "lse", lse.len, heads)?;
        if heads == 0 {
            return Ok(());
        }
        let cfg = Cfg { grid: (int(op, "heads", heads)? as u32, 1, 1), block: 128, smem: 0 };
        let (s, h, w) = (int(op, "shards", shards)?, int(op, "heads", heads)?, int(op, "width", width)?);
        let args = [Arg::P(partials.ptr), Arg::P(out.ptr), Arg::P(lse.ptr), Arg::I(s), Arg::I(h), Arg::I(w)];
        // SAFETY: types and order match dcp_merge_f64; lengths checked.
        unsafe { self.launch(op, self.f.dcp_merge_f64, cfg, None, &args) }
    }

    /// Both matmul kernels sum in one order whatever the rows (dense.hip).
    fn matmul_fixed_order(&self) -> bool {
        true
    }

    fn matmul(&self, shape: MatmulShape, x: &Buf<D>, w: &Buf<D>, out: &mut Buf<D>) -> Result<()> {
        let op = "matmul";
        let MatmulShape { rows, inner, cols } = shape;
        check_len(op, "x", x.len, elems(op, &[rows, inner])?)?;
        check_len(op, "w", w.len, elems(op, &[inner, cols])?)?;
        check_len(op, "out", out.len, elems(op, &[rows, cols])?)?;
        // The whole allocation, as the view of all of `out` spans it.
        self.matmul_unchecked(op, rows, inner, cols, x.ptr, w.ptr, out.ptr, out.cap)
    }

    fn swiglu(&self, shape: MlpShape, x: &Buf<D>, w: MlpWeights<'_, Buf<D>>, out: &mut Buf<D>) -> Result<()> {
        let op = "swiglu";
        let MlpShape { tokens, hidden, intermediate } = shape;
        check_len(op, "x", x.len, elems(op, &[tokens, hidden])?)?;
        check_len(op, "gate", w.gate.len, elems(op, &[hidden, intermediate])?)?;
        check_len(op, "up", w.up.len, elems(op, &[hidden, intermediate])?)?;
        check_len(op, "down", w.down.len, elems(op, &[intermediate, hidden])?)?;
        check_len(op, "out", out.len, elems(op, &[tokens, hidden])?)?;
        if hidden == 0 || tokens == 0 {
            return Ok(());
        }
        if intermediate == 0 {
            return self.fill_unchecked(op, out.ptr, out.len, 0.0);
        }
        let n = tokens * intermediate;
        let g = self.alloc_t::<f32>(op, n)?;
        let u = self.alloc_t::<f32>(op, n)?;
        let a = self.alloc_t::<f32>(op, n)?;
        self.matmul_unchecked(op, tokens, hidden, intermediate, x.ptr, w.gate.ptr, g.ptr, g.cap)?;
        self.matmul_unchecked(op, tokens, hidden, intermediate, x.ptr, w.up.ptr, u.ptr, u.cap)?;
        self.silu_mul_unchecked(op, n, g.ptr, u.ptr, a.ptr)?;
        self.matmul_unchecked(op, tokens, intermediate, hidden, a.ptr, w.down.ptr, out.ptr, out.cap)
    }

    fn silu_mul(&self, gate: &Buf<D>, up: &Buf<D>, out: &mut Buf<D>) -> Result<()> {
        let op = "silu_mul";
        check_len(op, "up", up.len, gate.len)?;
        check_len(op, "out", out.len, gate.len)?;
        self.silu_mul_unchecked(op, gate.len, gate.ptr, up.ptr, out.ptr)
    }

    fn embedding(&self, shape: EmbeddingShape, table: &Buf<D>, ids: &DeviceIBuf<D>, out: &mut Buf<D>) -> Result<()> {
        let op = "embedding";
        let EmbeddingShape { tokens, vocab, dim } = shape;
        check_len(op, "table", table.len, elems(op, &[vocab, dim])?)?;
        check_len(op, "ids", ids.data.len, tokens)?;
        check_len(op, "out", out.len, elems(op, &[tokens, dim])?)?;
        // The ids are device data (argmax writes them): read them back to give
        // the CPU's IndexOutOfRange instead of reading outside the table.
        let host = self.download_i32(ids)?;
        for (t, &id) in host.iter().enumerate() {
            if id < 0 || id as usize >= vocab {
                return Err(KernelError::IndexOutOfRange { op, what: "token id", index: id as i64, position: t, bound: vocab });
            }
        }
        if dim == 0 || tokens == 0 {
            return Ok(());
        }
        let (t, d) = (int(op, "tokens", tokens)?, int(op, "dim", dim)?);
        let args = [Arg::P(table.ptr), Arg::P(ids.data.ptr), Arg::P(out.ptr), Arg::I(t), Arg::I(d)];
        // SAFETY: types and order match embedding; ids were checked.
        unsafe { self.launch(op, self.f.embedding, ew_cfg(tokens * dim), None, &args) }
    }

    fn argmax(&self, rows: usize, cols: usize, logits: &Buf<D>, ids: &mut DeviceIBuf<D>) -> Result<()> {
        let op = "argmax";
        check_len(op, "logits", logits.len, elems(op, &[rows, cols])?)?;
        check_len(op, "ids", ids.data.len, rows)?;
        if cols > i32::MAX as usize {
            return Err(KernelError::InvalidShape { op, reason: format!("{cols} columns do not fit an i32 id") });
        }
        if cols == 0 {
            return Err(KernelError::InvalidShape { op, reason: "argmax over 0 columns".into() });
        }
        if rows == 0 {
            return Ok(());
        }
        let cfg = Cfg { grid: (int(op, "rows", rows)? as u32, 1, 1), block: 256, smem: 0 };
        ids.set_known(None);
        let args = [Arg::P(logits.ptr), Arg::P(ids.data.ptr), Arg::I(cols as i32)];
        // SAFETY: types and order match argmax_rows; lengths checked.
        unsafe { self.launch(op, self.f.argmax_rows, cfg, None, &args) }
    }

    fn matmul_units(&self, shape: UnitsShape, x: &Buf<D>, units: &[UnitProduct<'_, Buf<D>>], out: &mut Buf<D>) -> Result<()> {
        let op = "matmul_units";
        check_len(op, "x", x.len, elems(op, &[shape.rows, shape.x_width])?)?;
        check_len(op, "out", out.len, shape.out_len(op, units)?)?;
        for u in units {
            check_len(op, "w", u.w.len, elems(op, &[u.inner, u.cols])?)?;
        }
        if shape.rows == 0 {
            return Ok(());
        }
        if !self.fused {
            return self.matmul_units_each(op, shape, x, units, out);
        }
        for (g, group) in units.chunks(UNITS_PER_LAUNCH).enumerate() {
            self.matmul_units_launch(op, shape, x, group, g * UNITS_PER_LAUNCH, out)?;
        }
        Ok(())
    }

    fn add_units(&self, acc: &mut Buf<D>, stacked: &Buf<D>, units: std::ops::Range<usize>) -> Result<()> {
        let op = "add_units";
        let n = acc.len;
        crate::error::check_units(op, n, stacked.len, &units)?;
        if n == 0 || units.is_empty() {
            return Ok(());
        }
        let nn = i64_of(n);
        if !self.fused {
            // Unit by unit through add_inplace, reading each unit in place.
            for u in units {
                let args = [Arg::P(acc.ptr), Arg::P(at::<f32>(stacked.ptr, u * n)), Arg::L(nn)];
                // SAFETY: types and order match add_inplace; the unit lies in stacked.
                unsafe { self.launch(op, self.f.add_inplace, ew_cfg(n), None, &args) }?;
            }
            return Ok(());
        }
        let (from, to) = (int(op, "units", units.start)?, int(op, "units", units.end)?);
        let args = [Arg::P(acc.ptr), Arg::P(stacked.ptr), Arg::L(nn), Arg::I(from), Arg::I(to)];
        // SAFETY: types and order match add_units; every unit lies in stacked.
        unsafe { self.launch(op, self.f.add_units, ew_cfg(n), None, &args) }
    }

    fn add_inplace(&self, dst: &mut Buf<D>, src: &Buf<D>) -> Result<()> {
        let op = "add_inplace";
        check_len(op, "src", src.len, dst.len)?;
        let n = dst.len;
        if n == 0 {
            return Ok(());
        }
        let args = [Arg::P(dst.ptr), Arg::P(src.ptr), Arg::L(i64_of(n))];
        // SAFETY: types and order match add_inplace; lengths checked.
        unsafe { self.launch(op, self.f.add_inplace, ew_cfg(n), None, &args) }
    }
}
