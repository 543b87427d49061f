//! KDA launchers (kda.hip, kda_chunk.hip): the length checks, block shapes
//! and the recurrent kernels.

use super::*;

/// The checks of the CPU reference's KDA ops (same errors), on lengths.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_kda(
    op: &'static str,
    n: usize,
    heads: usize,
    dk: usize,
    dv: usize,
    state_len: usize,
    state_n: usize,
    x: &KdaInputs<'_, CudaBuf>,
    p: &KdaParams<'_, CudaBuf>,
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

impl CudaBackend {
    /// Recurrent KDA over `seqs` sequences of `tokens` tokens (see kda.hip).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn kda_recurrent(
        &self,
        op: &'static str,
        seqs: usize,
        tokens: usize,
        heads: usize,
        dk: usize,
        dv: usize,
        state: &mut CudaBuf,
        x: KdaInputs<'_, CudaBuf>,
        p: KdaParams<'_, CudaBuf>,
        out: &mut CudaBuf,
        record: Option<&mut CudaBuf>,
    ) -> Result<()> {
        if seqs == 0 || tokens == 0 {
            return Ok(());
        }
        let grid_x = int(op, "slots x heads", seqs * heads)? as u32;
        // The step kernels are compiled for tokens == 1 (no token loop).
        let (func, cols) = if dk > 128 {
            (&self.f.kda_recurrent_wide, 1)
        } else if tokens == 1 {
            let k = self.kda_kernel;
            let at = KdaKernel::ALL.iter().position(|&x| x == k).expect("every variant is loaded");
            (&self.f.kda_step[at], k.cols_per_lane())
        } else {
            (&self.f.kda_prefill, 1)
        };
        let tiles = dv.div_ceil(32 * cols);
        if tiles > 65535 {
            return Err(KernelError::InvalidShape { op, reason: format!("dv = {dv} is too wide") });
        }
        let (threads, smem) = kda_block(dk, cols);
        let cfg = LaunchConfig { grid_dim: (grid_x, tiles as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem };
        let (t, h, k, v) = (int(op, "tokens", tokens)?, int(op, "heads", heads)?, int(op, "dk", dk)?, int(op, "dv", dv)?);
        let null: u64 = 0;
        let mut b = self.stream.launch_builder(func);
        b.arg(&mut state.data)
            .arg(&x.q.data)
            .arg(&x.k.data)
            .arg(&x.v.data)
            .arg(&x.g_raw.data)
            .arg(&x.b_raw.data)
            .arg(&p.a_log.data)
            .arg(&p.dt_bias.data)
            .arg(&mut out.data);
        match record {
            Some(r) => b.arg(&mut r.data),
            None => b.arg(&null),
        };
        b.arg(&t).arg(&h).arg(&k).arg(&v);
        // SAFETY: argument types and order match kda_recurrent; every buffer
        // was checked to hold the elements the launch touches.
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        Ok(())
    }

    /// Reads and validates the replay cursors (the CPU's errors) on the host.
    pub(super) fn read_cursors(&self, op: &'static str, cursor: &CudaIBuf, capacity: usize) -> Result<Vec<usize>> {
        let host = self.download_i32(cursor)?;
        cpu_kda::read_cursors(op, &host, capacity)
    }
}
