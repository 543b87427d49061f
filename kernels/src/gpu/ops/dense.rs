//! Dense launchers (dense.hip): the tensor-core matmul, its chunk and units
//! sums, SwiGLU's activation.

use super::*;

/// The matmul's k chunk (MM_KC in dense.hip).
pub(super) const MATMUL_KC: usize = 128;
/// matmul_tc's dynamic shared memory for a `bm` x `bn` tile (dense.hip: x
/// rows of MM_KC + 8 floats, w rows of bn + 4).
pub(super) const fn tc_smem(bm: usize, bn: usize) -> u32 {
    ((bm * (MATMUL_KC + 8) + MATMUL_KC * (bn + 4)) * 4) as u32
}
/// matmul_tcb's dynamic shared memory (dense.hip): two raw stages of 64 x 32 x
/// floats and 32 x 128 w floats, and two buffers of bf16 planes (hi and lo),
/// each 64 x (16 + 4) x words and 16 x (128 + 8) w words.
pub(super) const TCB_SMEM: u32 = ((2 * (64 * 32 + 32 * 128) + 2 * 2 * (64 * 20 + 16 * 136)) * 4) as u32;
/// matmul_wg's dynamic shared memory (dense.hip): a ring of 6 stages, each two
/// k-steps of packed x and w tiles (8 KB a tile).
pub(super) const MWG_SMEM: u32 = 6 * 4 * 8192;
/// A product runs as matmul_tcb (one launch, no scratch, each block over all
/// of k) when it has at least this many 64 x 128 output tiles; fewer tiles
/// (the few rows of a decode step, a short prompt's narrow products) go split
/// over k (matmul_tc + the chunk sums), which keeps the device busy. Both give
/// the same bits; this is only speed. On the H200 (`cuda_check --bench-dense`,
/// 2026-12-03) the two tie near 80 tiles at k = 2,048 and matmul_tcb is twice
/// as fast from 128 (a block over all of k takes about 160 us there, however
/// few blocks run).
pub const TCB_MIN_TILES: usize = 96;
/// The same switch for matmul_wg: on the H200 (`cuda_check --bench-dense`,
/// 2026-12-04) it beats the split from 32 tiles (128 x 2,048 . 2,048 x 2,048:
/// 62.8 against 76.8 us) and by 2.7x at 80 (1,024 x 2,048 . 2,048 x 576).
pub const WG_MIN_TILES: usize = 32;

impl<D: Driver> GpuBackend<D> {
    /// Whether a product of `rows` x `cols` (`units` of them) runs as matmul_tcb
    /// (or matmul_wg): never where the device has neither.
    pub(super) fn tcb_pays(&self, rows: usize, cols: usize, units: usize) -> bool {
        (self.f.matmul_tcb.is_some() || self.matmul_wg()) && rows >= 64 && rows.div_ceil(64) * cols.div_ceil(128) * units >= self.tcb_min_tiles()
    }
}

/// One launch of a tiled kernel: the `units` products of a table over one x
/// (rows `x_row` apart), `rows` rows, the widest product's `max_cols`, out
/// rows `out_row` apart.
pub(super) struct Tiled<'a> {
    pub(super) t: &'a UnitsTable,
    pub(super) units: usize,
    pub(super) x: u64,
    pub(super) x_row: i64,
    pub(super) rows: usize,
    pub(super) max_cols: usize,
    pub(super) out_row: i64,
}

/// Products of one `matmul_tc` launch at most (MU_UNITS in dense.hip).
pub(super) const UNITS_PER_LAUNCH: usize = 32;

/// `hk_mm_units` of dense.hip, the by-value table of the units kernels: per
/// product w's address, x's first column, out's element of row 0, the first
/// element of its scratch, inner, cols.
#[repr(C)]
pub(crate) struct UnitsTable {
    pub(crate) u: [[i64; 6]; UNITS_PER_LAUNCH],
}

impl UnitsTable {
    /// The table's bytes in the C layout of hk_mm_units (1,536 bytes, within
    /// the 4 KB kernel argument limit), as the launch passes them.
    pub(super) fn bytes(&self) -> &[u8] {
        let words = self.u.as_flattened();
        // SAFETY: plain i64s, no padding (repr(C) arrays); u8 has no alignment.
        unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), std::mem::size_of_val(words)) }
    }
}

impl<D: Driver> GpuBackend<D> {
    /// Both matmul kernels sum in the one order dense.hip describes, so the
    /// choice between them never changes a bit: few rows (decode) go split
    /// over k chunks, many rows (prefill) through the tiled kernel. `out` is
    /// the output's address and `out_len` the elements it spans (zeroed
    /// when `inner` is 0).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_unchecked(&self, op: &'static str, rows: usize, inner: usize, cols: usize, x: u64, w: u64, out: u64, out_len: usize) -> Result<()> {
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        if inner == 0 {
            return self.zero_t::<f32>(op, out, out_len);
        }
        int(op, "inner", inner)?;
        int(op, "cols", cols)?;
        let chunks = inner.div_ceil(MATMUL_KC);
        let mut t = UnitsTable { u: [[0; 6]; UNITS_PER_LAUNCH] };
        t.u[0] = [w as i64, 0, 0, 0, i64_of(inner), i64_of(cols)];
        if self.tcb_pays(rows, cols, 1) {
            let call = Tiled { t: &t, units: 1, x, x_row: i64_of(inner), rows, max_cols: cols, out_row: i64_of(cols) };
            return self.tcb_launch(op, &call, out);
        }
        // matmul_tc writes every chunk sum of every element before
        // matmul_chunk_sum, queued after it on the same stream, reads any.
        let part = self.alloc_raw::<f32>(op, chunks * rows * cols)?;
        self.tc_launch(op, &t, 1, x, i64_of(inner), part.ptr, rows, cols, chunks)?;
        let n = rows * cols;
        let args = [Arg::P(part.ptr), Arg::P(out), Arg::L(i64_of(n)), Arg::I(chunks as i32)];
        // SAFETY: types and order match matmul_chunk_sum; part holds chunks x
        // rows x cols sums, out rows x cols.
        unsafe { self.launch(op, self.f.matmul_chunk_sum, ew_cfg(n), None, &args) }
    }

    /// matmul_tc over the `units` products of `t` (chunk sums into `part`),
    /// its tile from the row count: 16 x 128 for few rows, 32 x 64 for more
    /// (and for few rows where the device cannot give matmul_tc16 its shared
    /// memory: the same bits).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn tc_launch(
        &self,
        op: &'static str,
        t: &UnitsTable,
        units: usize,
        x: u64,
        x_row: i64,
        part: u64,
        rows: usize,
        max_cols: usize,
        max_chunks: usize,
    ) -> Result<()> {
        let (func, bm, bn) = match self.f.matmul_tc16 {
            Some(tc16) if rows <= 16 => (tc16, 16, 128),
            _ => (self.f.matmul_tc32, 32, 64),
        };
        let z = rows.div_ceil(bm) * units;
        if z > 65535 || max_chunks > 65535 {
            return Err(KernelError::InvalidShape { op, reason: format!("{rows} rows x {units} products exceed the device grid") });
        }
        let cfg = Cfg { grid: (int(op, "column tiles", max_cols.div_ceil(bn))? as u32, max_chunks as u32, z as u32), block: 128, smem: tc_smem(bm, bn) };
        let r = int(op, "rows", rows)?;
        let args = [Arg::P(x), Arg::P(part), Arg::I(r), Arg::L(x_row)];
        // SAFETY: types and order match matmul_tc16/32; the caller checked the
        // table's blocks of x and w and sized part for every product's chunks.
        unsafe { self.launch(op, func, cfg, Some(t), &args) }
    }

    /// matmul_tcb (or, on Hopper, matmul_wg: the same bits) over the products
    /// of `call`, each written into `out` in place (row r of product u at
    /// `t.u[u][2] + r * out_row`).
    pub(super) fn tcb_launch(&self, op: &'static str, call: &Tiled<'_>, out: u64) -> Result<()> {
        let &Tiled { t, units, x, x_row, rows, max_cols, out_row } = call;
        if units > UNITS_PER_LAUNCH {
            return Err(KernelError::InvalidShape { op, reason: format!("{units} products exceed the table of one launch") });
        }
        if let (Some(wg), true) = (&self.f.matmul_wg, self.matmul_wg) {
            return self.wg_launch(op, wg, call, out);
        }
        let Some(tcb) = self.f.matmul_tcb else {
            // tcb_pays is false without either kernel.
            return Err(KernelError::InvalidShape { op, reason: "the device cannot run the tiled matmul".into() });
        };
        let tiles = rows.div_ceil(64);
        if tiles > 65535 {
            return Err(KernelError::InvalidShape { op, reason: format!("{rows} rows exceed the device grid") });
        }
        let cfg = Cfg { grid: (int(op, "column tiles", max_cols.div_ceil(128))? as u32, tiles as u32, units as u32), block: 256, smem: TCB_SMEM };
        let r = int(op, "rows", rows)?;
        let args = [Arg::P(x), Arg::P(out), Arg::I(r), Arg::L(x_row), Arg::L(out_row)];
        // SAFETY: types and order match matmul_tcb; the caller checked the
        // table's blocks of x and w and that every product's rows fall inside out.
        unsafe { self.launch(op, tcb, cfg, Some(t), &args) }
    }

    /// matmul_wg (dense.hip) over the products of `call`: x and w split into
    /// packed bf16 planes (mwg_pack_x, mwg_pack_w, into scratch sized here by
    /// the layout dense.hip describes), then the product.
    fn wg_launch(&self, op: &'static str, wg: &open::MatmulWg<D::Func>, call: &Tiled<'_>, out: u64) -> Result<()> {
        let &Tiled { t, units, x, x_row, rows, max_cols, out_row } = call;
        const TILE: usize = 8192;
        let mt = rows.div_ceil(128);
        let used = &t.u[..units];
        let kt = |e: &[i64; 6]| (e[4] as usize).div_ceil(MATMUL_KC) * (MATMUL_KC / 16);
        let nt = |e: &[i64; 6]| (e[5] as usize).div_ceil(128);
        // Products reading the same block of x (the MLP's units) share one packing of it.
        let x_shared = used.iter().all(|e| e[1] == used[0][1] && e[4] == used[0][4]);
        let x_tiles = if x_shared { kt(&used[0]) } else { used.iter().map(kt).sum() };
        let w_tiles: usize = used.iter().map(|e| nt(e) * kt(e)).sum();
        let max_kt = used.iter().map(kt).max().unwrap_or(0);
        let max_nt = used.iter().map(nt).max().unwrap_or(0);
        if mt > 65535 || max_nt > 65535 || max_kt > i32::MAX as usize {
            return Err(KernelError::InvalidShape { op, reason: format!("{rows} rows x {max_cols} columns exceed the device grid") });
        }
        if max_kt == 0 {
            return Ok(());
        }
        // The pack kernels below write every byte of every tile the product
        // reads before it runs (same stream, in order).
        let xp = self.alloc_raw::<u8>(op, mt * x_tiles * TILE)?;
        let wp = self.alloc_raw::<u8>(op, w_tiles * TILE)?;
        let (r, xs) = (int(op, "rows", rows)?, i32::from(x_shared));
        let block = 256;
        let cfg = Cfg { grid: (max_kt as u32, mt as u32, if x_shared { 1 } else { units as u32 }), block, smem: 0 };
        let args = [Arg::P(x), Arg::L(x_row), Arg::I(r), Arg::I(xs), Arg::P(xp.ptr)];
        // SAFETY: types and order match mwg_pack_x; xp holds every product's tiles.
        unsafe { self.launch(op, wg.pack_x, cfg, Some(t), &args) }?;
        let cfg = Cfg { grid: (max_kt as u32, max_nt as u32, units as u32), block, smem: 0 };
        // SAFETY: types and order match mwg_pack_w; wp holds every product's tiles.
        unsafe { self.launch(op, wg.pack_w, cfg, Some(t), &[Arg::P(wp.ptr)]) }?;
        let cfg = Cfg { grid: (int(op, "column tiles", max_cols.div_ceil(128))? as u32, mt as u32, units as u32), block, smem: MWG_SMEM };
        let args = [Arg::P(xp.ptr), Arg::P(wp.ptr), Arg::I(xs), Arg::P(out), Arg::I(r), Arg::L(out_row)];
        // SAFETY: types and order match matmul_wg; xp and wp were packed for
        // this table above, and the caller checked that every product's rows
        // fall inside out.
        unsafe { self.launch(op, wg.product, cfg, Some(t), &args) }
    }

    /// The products of a checked `matmul_units` one matmul at a time: a block of
    /// x that is not all of it copied out; a stacked product written in place, a
    /// side-by-side one copied to its columns.
    pub(super) fn matmul_units_each(
        &self,
        op: &'static str,
        shape: UnitsShape,
        x: &DeviceBuf<f32, D>,
        units: &[UnitProduct<'_, DeviceBuf<f32, D>>],
        out: &mut DeviceBuf<f32, D>,
    ) -> Result<()> {
        let rows = shape.rows;
        for (i, u) in units.iter().enumerate() {
            let block = if u.x_col == 0 && u.inner == shape.x_width {
                None
            } else {
                let mut b = self.alloc(rows * u.inner)?;
                let cols = ColsCopy { rows, src_cols: shape.x_width, src_col: u.x_col, dst_cols: u.inner, dst_col: 0, width: u.inner };
                self.copy_cols(cols, x, &mut b)?;
                Some(b)
            };
            let xb = block.as_ref().unwrap_or(x).ptr;
            let (at_, _) = shape.out_at(i, u);
            match shape.out {
                UnitsOut::Stacked => {
                    self.matmul_unchecked(op, rows, u.inner, u.cols, xb, u.w.ptr, at::<f32>(out.ptr, at_), rows * u.cols)?;
                }
                UnitsOut::Columns { width } => {
                    let p = self.alloc(rows * u.cols)?;
                    self.matmul_unchecked(op, rows, u.inner, u.cols, xb, u.w.ptr, p.ptr, p.cap)?;
                    self.copy_cols(ColsCopy { rows, src_cols: u.cols, src_col: 0, dst_cols: width, dst_col: at_, width: u.cols }, &p, out)?;
                }
            }
        }
        Ok(())
    }

    /// Up to UNITS_PER_LAUNCH split-k products (checked by the caller) in two
    /// launches: the chunk sums of all, then their sums into place.
    pub(super) fn matmul_units_launch(
        &self,
        op: &'static str,
        shape: UnitsShape,
        x: &DeviceBuf<f32, D>,
        units: &[UnitProduct<'_, DeviceBuf<f32, D>>],
        first: usize,
        out: &mut DeviceBuf<f32, D>,
    ) -> Result<()> {
        let rows = shape.rows;
        let mut t = UnitsTable { u: [[0; 6]; UNITS_PER_LAUNCH] };
        let (mut scratch, mut max_cols, mut max_chunks, mut max_n) = (0usize, 1usize, 1usize, 1usize);
        for (i, u) in units.iter().enumerate() {
            let (at_, _) = shape.out_at(first + i, u);
            let chunks = u.inner.div_ceil(MATMUL_KC);
            t.u[i] = [u.w.ptr as i64, i64_of(u.x_col), i64_of(at_), i64_of(scratch), i64_of(u.inner), i64_of(u.cols)];
            int(op, "inner", u.inner)?;
            int(op, "cols", u.cols)?;
            scratch += chunks * rows * u.cols;
            max_cols = max_cols.max(u.cols);
            max_chunks = max_chunks.max(chunks);
            max_n = max_n.max(rows * u.cols);
        }
        if self.tcb_pays(rows, max_cols, units.len()) {
            let (_, pitch) = units.first().map_or((0, 0), |u| shape.out_at(first, u));
            let call = Tiled { t: &t, units: units.len(), x: x.ptr, x_row: i64_of(shape.x_width), rows, max_cols, out_row: i64_of(pitch) };
            return self.tcb_launch(op, &call, out.ptr);
        }
        // Every element of a product's scratch is written by matmul_tc before
        // matmul_units_sum reads it.
        let part = self.alloc_raw::<f32>(op, scratch.max(1))?;
        let r = int(op, "rows", rows)?;
        let xr = i64_of(shape.x_width);
        self.tc_launch(op, &t, units.len(), x.ptr, xr, part.ptr, rows, max_cols, max_chunks)?;
        let (_, pitch) = units.first().map_or((0, 0), |u| shape.out_at(first, u));
        let or = i64_of(pitch);
        let mut cfg = ew_cfg(max_n);
        cfg.grid.0 = cfg.grid.0.min((EW_MAX_BLOCKS / units.len()).max(1) as u32);
        cfg.grid.1 = units.len() as u32;
        let args = [Arg::P(part.ptr), Arg::P(out.ptr), Arg::I(r), Arg::L(or)];
        // SAFETY: types and order match matmul_units_sum; every product's rows
        // fall inside out (UnitsShape::out_len).
        unsafe { self.launch(op, self.f.matmul_units_sum, cfg, Some(&t), &args) }
    }

    pub(super) fn silu_mul_unchecked(&self, op: &'static str, n: usize, gate: u64, up: u64, out: u64) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let args = [Arg::P(gate), Arg::P(up), Arg::P(out), Arg::L(i64_of(n))];
        // SAFETY: types and order match silu_mul; lengths were checked.
        unsafe { self.launch(op, self.f.silu_mul, ew_cfg(n), None, &args) }
    }
}
