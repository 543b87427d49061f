//! KDA launchers (kda.hip, kda_chunk.hip): the length checks, block shapes
//! and the recurrent kernels.

use super::*;

/// The checks of the CPU reference's KDA ops (same errors), on lengths.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_kda<D: Driver>(
    op: &'static str,
    n: usize,
    heads: usize,
    dk: usize,
    dv: usize,
    state_len: usize,
    state_n: usize,
    x: &KdaInputs<'_, DeviceBuf<f32, D>>,
    p: &KdaParams<'_, DeviceBuf<f32, D>>,
    out_len: usize,
    record_len: Option<usize>,
) -> Result<()> {
    check_nonzero(op, "heads", heads)?;
    check_nonzero(op, "dk", dk)?;
    check_nonzero(op, "dv", dv)?;
    check_len(op, "state", state_len, elems(op, &[state_n, heads, dk, dv])?)?;
    check_len(op, "q", x.q.len, elems(op, &[n, heads, dk])?)?;
    check_len(op, "k", x.k.len, elems(op, &[n, heads, dk])?)?;
    check_len(op, "v", x.v.len, elems(op, &[n, heads, dv])?)?;
    check_len(op, "g_raw", x.g_raw.len, elems(op, &[n, heads, dk])?)?;
    check_len(op, "b_raw", x.b_raw.len, elems(op, &[n, heads])?)?;
    check_len(op, "a_log", p.a_log.len, heads)?;
    check_len(op, "dt_bias", p.dt_bias.len, elems(op, &[heads, dk])?)?;
    check_len(op, "out", out_len, elems(op, &[n, heads, dv])?)?;
    if let Some(len) = record_len {
        let w = dk.checked_add(dk).and_then(|x| x.checked_add(dv)).ok_or(KernelError::SizeOverflow { op, dims: vec![dk, dv] })?;
        check_len(op, "record", len, elems(op, &[n, heads, w])?)?;
    }
    if dk > KDA_MAX_DK {
        return Err(KernelError::InvalidShape { op, reason: format!("dk = {dk}: the device KDA kernels hold at most {KDA_MAX_DK} key rows per head") });
    }
    Ok(())
}

/// Block size and dynamic shared memory of the KDA kernels for `dk` and
/// `cols` value columns per lane: warps of 16 key rows each. Depends on the
/// widths only, never on the batch.
pub(super) fn kda_block(dk: usize, cols: usize) -> (u32, u32) {
    let nw = dk.div_ceil(KDA_ROWS).max(1);
    let kpad = nw * KDA_ROWS;
    let smem = (4 * kpad + 2 * nw * 32 * cols + 2 * nw) * 4;
    ((nw * 32) as u32, smem as u32)
}

/// The addresses of the KDA inputs and parameters, in the kernels' order (q,
/// k, v, g_raw, b_raw, a_log, dt_bias).
fn kda_in<D: Driver>(x: &KdaInputs<'_, DeviceBuf<f32, D>>, p: &KdaParams<'_, DeviceBuf<f32, D>>) -> [Arg; 7] {
    [x.q, x.k, x.v, x.g_raw, x.b_raw, p.a_log, p.dt_bias].map(|b| Arg::P(b.ptr))
}

impl<D: Driver> GpuBackend<D> {
    /// Whether a sequence of `tokens` takes the chunked form (kda_chunk.hip):
    /// where the CPU reference takes it too (at least one chunk of 64 tokens
    /// and 2 dv >= 3 x 64), dk <= 128, and the device gives the kernels their
    /// shared memory (the H200 does).
    fn kda_chunked_fits(&self, tokens: usize, dk: usize, dv: usize) -> bool {
        let chunk = cpu_kda::KDA_CHUNK;
        self.f.kda_chunk.is_some() && tokens >= chunk && dk <= KDA_CHUNK_DK && 2 * dv >= 3 * chunk
    }

    /// The prefill of every non-empty sequence of `seqs` (rows of the inputs;
    /// sequence i's state is number i of `states`): the chunked ones in one
    /// launch per phase, the others in one recurrent launch. A sequence's
    /// result does not depend on the others in the launch.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn kda_prefill_seqs(
        &self,
        op: &'static str,
        shape: KdaRaggedShape,
        seqs: &[std::ops::Range<usize>],
        states: &mut DeviceBuf<f32, D>,
        x: KdaInputs<'_, DeviceBuf<f32, D>>,
        p: KdaParams<'_, DeviceBuf<f32, D>>,
        out: &mut DeviceBuf<f32, D>,
        mut record: Option<&mut DeviceBuf<f32, D>>,
    ) -> Result<()> {
        let KdaRaggedShape { rows, heads, dk, dv } = shape;
        crate::shapes::check_ragged_seqs(op, rows, seqs)?;
        check_kda(op, rows, heads, dk, dv, states.len, seqs.len(), &x, &p, out.len, record.as_ref().map(|r| r.len))?;
        // Sequence tables (kda.hip, kda_chunk.hip): (first row, rows, state)
        // for the recurrent kernel; (first row, rows, first chunk, state) and
        // then each chunk's sequence for the chunked ones.
        let (mut recurrent, mut chunked, mut chunk_seq) = (Vec::new(), Vec::new(), Vec::new());
        for (i, r) in seqs.iter().enumerate() {
            if r.is_empty() {
                continue;
            }
            let (row0, len, si) = (int(op, "first row", r.start)?, int(op, "tokens", r.len())?, int(op, "sequences", i)?);
            if self.kda_chunked_fits(r.len(), dk, dv) {
                let at = int(op, "sequences", chunked.len() / 4)?;
                chunked.extend([row0, len, int(op, "chunks", chunk_seq.len())?, si]);
                chunk_seq.extend(std::iter::repeat_n(at, r.len().div_ceil(cpu_kda::KDA_CHUNK)));
            } else {
                recurrent.extend([row0, len, si]);
            }
        }
        if !recurrent.is_empty() {
            let seg = self.upload_t(op, &recurrent)?;
            self.kda_recurrent(op, recurrent.len() / 3, 0, Some(seg.ptr), heads, dk, dv, states, x, p, out, record.as_deref_mut())?;
        }
        if !chunked.is_empty() {
            let nseq = chunked.len() / 4;
            let chunks = chunk_seq.len();
            chunked.extend(chunk_seq);
            self.kda_chunked(op, nseq, chunks, &chunked, heads, dk, dv, states, x, p, out, record)?;
        }
        Ok(())
    }

    /// The chunked form over `nseq` sequences of `chunks` chunks in all, `table`
    /// as kda_chunk.hip reads it.
    #[allow(clippy::too_many_arguments)]
    fn kda_chunked(
        &self,
        op: &'static str,
        nseq: usize,
        chunks: usize,
        table: &[i32],
        heads: usize,
        dk: usize,
        dv: usize,
        states: &mut DeviceBuf<f32, D>,
        x: KdaInputs<'_, DeviceBuf<f32, D>>,
        p: KdaParams<'_, DeviceBuf<f32, D>>,
        out: &mut DeviceBuf<f32, D>,
        record: Option<&mut DeviceBuf<f32, D>>,
    ) -> Result<()> {
        let Some((prep, pass, outk)) = self.f.kda_chunk else {
            return Err(KernelError::InvalidShape { op, reason: "the device cannot run the chunked KDA kernels".into() });
        };
        let chunk = cpu_kda::KDA_CHUNK;
        // Workspace of kda_chunk.hip (kda_chunk_ws), every element written by
        // kda_chunk_prep (W, U0, e^Gam q^, e^(..) k^, P, e^Gam_last) or
        // kda_chunk_state (u over U0, the states entering each chunk) before
        // a later phase reads it.
        let ws_len = (|| {
            let rows = heads.checked_mul(chunks)?.checked_mul(chunk)?;
            let per_chunk = heads.checked_mul(chunks)?.checked_mul(chunk * chunk + KDA_CHUNK_DK + dv.checked_mul(KDA_CHUNK_DK)?)?;
            rows.checked_mul(3 * KDA_CHUNK_DK + dv)?.checked_add(per_chunk)
        })()
        .ok_or(KernelError::SizeOverflow { op, dims: vec![chunks, heads, dv] })?;
        let tiles = dv.div_ceil(KDA_CHUNK_TILE);
        let out_tiles = dv.div_ceil(KDA_CHUNK_OUT_TILE);
        if tiles > 65535 || heads > 65535 || nseq > 65535 {
            return Err(KernelError::InvalidShape { op, reason: format!("{nseq} sequences of {heads} heads of dv = {dv}: too many blocks") });
        }
        // Each part of the workspace is written by a phase queued before the
        // phase that reads it, on the same stream.
        let ws = self.alloc_raw::<f32>(op, ws_len)?;
        let seg = self.upload_t(op, table)?;
        let (h, k, v) = (int(op, "heads", heads)?, int(op, "dk", dk)?, int(op, "dv", dv)?);
        let (ns, nch) = (int(op, "sequences", nseq)?, int(op, "chunks", chunks)?);
        let rec = record.map_or(0, |r| r.ptr);
        let mut args = kda_in(&x, &p).to_vec();
        args.extend([Arg::P(rec), Arg::P(ws.ptr), Arg::P(seg.ptr), Arg::I(ns), Arg::I(h), Arg::I(k), Arg::I(v)]);
        let cfg = Cfg { grid: (nch as u32, heads as u32, 1), block: KDA_CHUNK_THREADS, smem: KDA_CHUNK_PREP_SMEM };
        // SAFETY: argument types and order match kda_chunk_prep; the table's
        // rows were checked to lie inside the inputs and the record, the
        // workspace is sized as kda_chunk_ws lays it out for `chunks`.
        unsafe { self.launch(op, prep, cfg, None, &args) }?;
        let args = [Arg::P(states.ptr), Arg::P(ws.ptr), Arg::P(seg.ptr), Arg::I(nch), Arg::I(h), Arg::I(k), Arg::I(v)];
        let cfg = Cfg { grid: (heads as u32, tiles as u32, nseq as u32), block: KDA_CHUNK_THREADS, smem: KDA_CHUNK_STATE_SMEM };
        // SAFETY: argument types and order match kda_chunk_state; the states
        // were checked against the table's sequences.
        unsafe { self.launch(op, pass, cfg, None, &args) }?;
        let args = [Arg::P(out.ptr), Arg::P(rec), Arg::P(ws.ptr), Arg::P(seg.ptr), Arg::I(ns), Arg::I(h), Arg::I(k), Arg::I(v)];
        let cfg = Cfg { grid: (nch as u32, heads as u32, out_tiles as u32), block: KDA_CHUNK_THREADS, smem: KDA_CHUNK_OUT_SMEM };
        // SAFETY: argument types and order match kda_chunk_out; out and the
        // record were checked against the table's rows.
        unsafe { self.launch(op, outk, cfg, None, &args) }
    }

    /// Recurrent KDA (see kda.hip) over `seqs` sequences: of `tokens` tokens
    /// each, or, with a sequence table `seg` ((first row, rows, state) each,
    /// its device address), as the table says.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn kda_recurrent(
        &self,
        op: &'static str,
        seqs: usize,
        tokens: usize,
        seg: Option<u64>,
        heads: usize,
        dk: usize,
        dv: usize,
        state: &mut DeviceBuf<f32, D>,
        x: KdaInputs<'_, DeviceBuf<f32, D>>,
        p: KdaParams<'_, DeviceBuf<f32, D>>,
        out: &mut DeviceBuf<f32, D>,
        record: Option<&mut DeviceBuf<f32, D>>,
    ) -> Result<()> {
        if seqs == 0 || (seg.is_none() && tokens == 0) {
            return Ok(());
        }
        let grid_x = int(op, "slots x heads", seqs * heads)? as u32;
        // The step kernels are compiled for tokens == 1 (no token loop).
        let (func, cols) = if dk > 128 {
            (self.f.kda_recurrent_wide, 1)
        } else if tokens == 1 && seg.is_none() {
            let k = self.kda_kernel;
            let at = KdaKernel::ALL.iter().position(|&x| x == k).expect("every variant is loaded");
            (self.f.kda_step[at], k.cols_per_lane())
        } else {
            (self.f.kda_prefill, 1)
        };
        let tiles = dv.div_ceil(32 * cols);
        if tiles > 65535 {
            return Err(KernelError::InvalidShape { op, reason: format!("dv = {dv} is too wide") });
        }
        let (threads, smem) = kda_block(dk, cols);
        let cfg = Cfg { grid: (grid_x, tiles as u32, 1), block: threads, smem };
        let (t, h, k, v) = (int(op, "tokens", tokens)?, int(op, "heads", heads)?, int(op, "dk", dk)?, int(op, "dv", dv)?);
        let mut args = vec![Arg::P(state.ptr)];
        args.extend(kda_in(&x, &p));
        args.extend([Arg::P(out.ptr), Arg::P(record.map_or(0, |r| r.ptr)), Arg::P(seg.unwrap_or(0)), Arg::I(t), Arg::I(h), Arg::I(k), Arg::I(v)]);
        // SAFETY: argument types and order match kda_recurrent; every buffer
        // was checked to hold the elements the launch touches (with a table,
        // every sequence's rows and state).
        unsafe { self.launch(op, func, cfg, None, &args) }
    }

    /// Reads and validates the replay cursors (the CPU's errors) on the host.
    pub(super) fn read_cursors(&self, op: &'static str, cursor: &DeviceIBuf<D>, capacity: usize) -> Result<Vec<usize>> {
        let host = self.download_i32(cursor)?;
        cpu_kda::read_cursors(op, &host, capacity)
    }
}
