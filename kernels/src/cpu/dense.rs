//! Dense ops on the CPU: matmul, SwiGLU, embedding, argmax, residual add.

use rayon::prelude::*;

use super::math::{axpy, silu};
use crate::error::{KernelError, Result, check_len, elems};
use crate::shapes::{EmbeddingShape, MatmulShape, MlpShape};

/// Rows of x per task in the row-parallel path.
const ROW_BLOCK: usize = 4;
/// Output columns per tile (1 KiB of f32, stays in L1 across the k loop).
const COL_TILE: usize = 256;
/// Rows of w per block (one w block of 256 x 256 f32 is 256 KiB, in L2).
const K_BLOCK: usize = 256;

/// See [`crate::Backend::matmul`].
pub(crate) fn matmul(shape: MatmulShape, x: &[f32], w: &[f32], out: &mut [f32]) -> Result<()> {
    let op = "matmul";
    let MatmulShape { rows, inner, cols } = shape;
    check_len(op, "x", x.len(), elems(op, &[rows, inner])?)?;
    check_len(op, "w", w.len(), elems(op, &[inner, cols])?)?;
    check_len(op, "out", out.len(), elems(op, &[rows, cols])?)?;
    if cols == 0 {
        return Ok(());
    }
    matmul_unchecked(rows, inner, cols, x, w, out);
    Ok(())
}

/// out = x . w for checked sizes, cols > 0. i-k-j order: the inner loop is an
/// axpy over a contiguous tile of a row of w.
fn matmul_unchecked(rows: usize, inner: usize, cols: usize, x: &[f32], w: &[f32], out: &mut [f32]) {
    let threads = rayon::current_num_threads().max(1);
    if rows >= ROW_BLOCK * threads {
        // Many rows: a task owns ROW_BLOCK rows and walks w block by block, so
        // each w block is reused ROW_BLOCK times while it sits in cache.
        out.par_chunks_mut(ROW_BLOCK * cols)
            .enumerate()
            .for_each(|(rb, oblk)| {
                oblk.fill(0.0);
                let r0 = rb * ROW_BLOCK;
                let nr = oblk.len() / cols;
                for c0 in (0..cols).step_by(COL_TILE) {
                    let c1 = (c0 + COL_TILE).min(cols);
                    for k0 in (0..inner).step_by(K_BLOCK) {
                        let k1 = (k0 + K_BLOCK).min(inner);
                        for r in 0..nr {
                            let xr = &x[(r0 + r) * inner..(r0 + r + 1) * inner];
                            let orow = &mut oblk[r * cols + c0..r * cols + c1];
                            for k in k0..k1 {
                                let a = xr[k];
                                if a != 0.0 {
                                    axpy(orow, a, &w[k * cols + c0..k * cols + c1]);
                                }
                            }
                        }
                    }
                }
            });
    } else {
        // Few rows (decode): split each output row over column tiles instead.
        for r in 0..rows {
            let xr = &x[r * inner..(r + 1) * inner];
            out[r * cols..(r + 1) * cols]
                .par_chunks_mut(COL_TILE)
                .enumerate()
                .for_each(|(ct, otile)| {
                    otile.fill(0.0);
                    let c0 = ct * COL_TILE;
                    let c1 = c0 + otile.len();
                    for (k, &a) in xr.iter().enumerate() {
                        if a != 0.0 {
                            axpy(otile, a, &w[k * cols + c0..k * cols + c1]);
                        }
                    }
                });
        }
    }
}

/// See [`crate::Backend::swiglu`].
pub(crate) fn swiglu(
    shape: MlpShape,
    x: &[f32],
    gate: &[f32],
    up: &[f32],
    down: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let op = "swiglu";
    let MlpShape {
        tokens,
        hidden,
        intermediate,
    } = shape;
    check_len(op, "x", x.len(), elems(op, &[tokens, hidden])?)?;
    check_len(op, "gate", gate.len(), elems(op, &[hidden, intermediate])?)?;
    check_len(op, "up", up.len(), elems(op, &[hidden, intermediate])?)?;
    check_len(op, "down", down.len(), elems(op, &[intermediate, hidden])?)?;
    check_len(op, "out", out.len(), elems(op, &[tokens, hidden])?)?;
    if hidden == 0 {
        return Ok(());
    }
    if intermediate == 0 {
        out.fill(0.0);
        return Ok(());
    }
    let n = tokens * intermediate;
    let mut g = vec![0.0f32; n];
    let mut u = vec![0.0f32; n];
    matmul_unchecked(tokens, hidden, intermediate, x, gate, &mut g);
    matmul_unchecked(tokens, hidden, intermediate, x, up, &mut u);
    g.par_iter_mut()
        .zip(u.par_iter())
        .for_each(|(gi, ui)| *gi = silu(*gi) * ui);
    matmul_unchecked(tokens, intermediate, hidden, &g, down, out);
    Ok(())
}

/// See [`crate::Backend::embedding`].
pub(crate) fn embedding(
    shape: EmbeddingShape,
    table: &[f32],
    ids: &[i32],
    out: &mut [f32],
) -> Result<()> {
    let op = "embedding";
    let EmbeddingShape { tokens, vocab, dim } = shape;
    check_len(op, "table", table.len(), elems(op, &[vocab, dim])?)?;
    check_len(op, "ids", ids.len(), tokens)?;
    check_len(op, "out", out.len(), elems(op, &[tokens, dim])?)?;
    for (t, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= vocab {
            return Err(KernelError::IndexOutOfRange {
                op,
                what: "token id",
                index: id as i64,
                position: t,
                bound: vocab,
            });
        }
    }
    if dim == 0 {
        return Ok(());
    }
    out.par_chunks_mut(dim)
        .zip(ids.par_iter())
        .for_each(|(o, &id)| {
            let r = id as usize;
            o.copy_from_slice(&table[r * dim..(r + 1) * dim]);
        });
    Ok(())
}

/// See [`crate::Backend::argmax`].
pub(crate) fn argmax(rows: usize, cols: usize, logits: &[f32], ids: &mut [i32]) -> Result<()> {
    let op = "argmax";
    check_len(op, "logits", logits.len(), elems(op, &[rows, cols])?)?;
    check_len(op, "ids", ids.len(), rows)?;
    if cols > i32::MAX as usize {
        return Err(KernelError::InvalidShape {
            op,
            reason: format!("{cols} columns do not fit an i32 id"),
        });
    }
    if cols == 0 {
        return Err(KernelError::InvalidShape {
            op,
            reason: "argmax over 0 columns".into(),
        });
    }
    ids.par_iter_mut().enumerate().for_each(|(r, id)| {
        let row = &logits[r * cols..(r + 1) * cols];
        let mut best = 0usize;
        let mut best_v = f32::NEG_INFINITY;
        let mut found = false;
        for (c, &v) in row.iter().enumerate() {
            if !v.is_nan() && (!found || v > best_v) {
                best = c;
                best_v = v;
                found = true;
            }
        }
        *id = best as i32;
    });
    Ok(())
}

/// See [`crate::Backend::add_inplace`].
pub(crate) fn add_inplace(dst: &mut [f32], src: &[f32]) -> Result<()> {
    check_len("add_inplace", "src", src.len(), dst.len())?;
    dst.par_chunks_mut(4096)
        .zip(src.par_chunks(4096))
        .for_each(|(d, s)| {
            for (a, b) in d.iter_mut().zip(s) {
                *a += b;
            }
        });
    Ok(())
}
