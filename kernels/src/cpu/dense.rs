//! Dense ops on the CPU: matmul, SwiGLU and its activation, embedding, argmax,
//! residual add.

use rayon::prelude::*;

use super::math::{axpy, silu};
use crate::error::{KernelError, Result, check_len, elems};
use crate::shapes::{EmbeddingShape, MatmulShape, MlpShape};

/// Rows of x per register block in the many-rows path.
const ROW_BLOCK: usize = 4;
/// Columns of a packed panel of w (one register block is ROW_BLOCK x PANEL).
const PANEL: usize = 8;
/// Rows of w per task in the few-rows (decode) path.
const K_CHUNK: usize = 64;

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

/// out = x . w for checked sizes, cols > 0.
fn matmul_unchecked(rows: usize, inner: usize, cols: usize, x: &[f32], w: &[f32], out: &mut [f32]) {
    let threads = rayon::current_num_threads().max(1);
    if rows >= ROW_BLOCK * threads {
        matmul_many_rows(inner, cols, x, w, out);
    } else {
        matmul_few_rows(rows, inner, cols, x, w, out);
    }
}

/// Many rows (prefill, batched decode): each task owns ROW_BLOCK rows and keeps
/// a ROW_BLOCK x PANEL block of out in registers while it walks k, reading the
/// panel's PANEL contiguous columns of each row of w in place. (An earlier
/// version packed w into panels first: for the decode batch's small matrices
/// that copy of every weight on every call cost as much as the products.) Every
/// output is the plain sum over k in order, so a row's bits do not depend on
/// which block it lands in.
fn matmul_many_rows(inner: usize, cols: usize, x: &[f32], w: &[f32], out: &mut [f32]) {
    if inner == 0 {
        out.fill(0.0);
        return;
    }
    let avx2 = has_avx2();
    out.par_chunks_mut(ROW_BLOCK * cols).enumerate().with_min_len(super::grain(2 * ROW_BLOCK * inner * cols)).for_each(|(rb, oblk)| {
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: the CPU has AVX2 (checked at run time just above).
            unsafe { row_block_avx2(rb, inner, cols, x, w, oblk) };
            return;
        }
        let _ = avx2;
        row_block(rb, inner, cols, x, w, oblk);
    });
}

/// Whether the CPU has AVX2, so that the dense kernels can take their 8-wide
/// build. The two builds compute the same IEEE operations in the same order
/// (Rust never fuses a multiply and an add on its own), so their results are
/// bit-identical and a machine's choice never changes a token.
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`row_block`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn row_block_avx2(rb: usize, inner: usize, cols: usize, x: &[f32], w: &[f32], oblk: &mut [f32]) {
    row_block(rb, inner, cols, x, w, oblk)
}

/// Block `rb` (rows `rb*ROW_BLOCK..`) of out = x . w.
#[inline(always)]
fn row_block(rb: usize, inner: usize, cols: usize, x: &[f32], w: &[f32], oblk: &mut [f32]) {
    let full = cols / PANEL;
    let r0 = rb * ROW_BLOCK;
    let nr = oblk.len() / cols;
    // Short blocks (the last one) read row 0 of the block in place of the
    // missing rows and drop those results.
    let xrow = |r: usize| {
        let r = if r < nr { r0 + r } else { r0 };
        &x[r * inner..(r + 1) * inner]
    };
    let (x0, x1, x2, x3) = (xrow(0), xrow(1), xrow(2), xrow(3));
    for p in 0..full {
        let c0 = p * PANEL;
        let mut acc = [[0.0f32; PANEL]; ROW_BLOCK];
        for ((((&a0, &a1), &a2), &a3), wrow) in x0.iter().zip(x1).zip(x2).zip(x3).zip(w.chunks_exact(cols)) {
            let Some(wk) = wrow.get(c0..c0 + PANEL).and_then(|p| <&[f32; PANEL]>::try_from(p).ok()) else { return };
            for c in 0..PANEL {
                let wc = wk[c];
                acc[0][c] += a0 * wc;
                acc[1][c] += a1 * wc;
                acc[2][c] += a2 * wc;
                acc[3][c] += a3 * wc;
            }
        }
        for (r, acc_r) in acc.iter().enumerate().take(nr) {
            oblk[r * cols + c0..r * cols + c0 + PANEL].copy_from_slice(acc_r);
        }
    }
    // The columns past the last full panel, one at a time, in the same order.
    for c in full * PANEL..cols {
        for r in 0..nr {
            let mut acc = 0.0f32;
            for (k, &a) in xrow(r).iter().enumerate() {
                acc += a * w[k * cols + c];
            }
            oblk[r * cols + c] = acc;
        }
    }
}

/// Few rows (decode): split k into chunks so that every task streams
/// contiguous rows of w, then sum the per-chunk partial outputs.
fn matmul_few_rows(rows: usize, inner: usize, cols: usize, x: &[f32], w: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    if rows == 0 || inner == 0 {
        return;
    }
    let partials: Vec<Vec<f32>> = (0..inner.div_ceil(K_CHUNK))
        .into_par_iter()
        .fold(
            || vec![0.0f32; rows * cols],
            |mut part, kc| {
                let k1 = ((kc + 1) * K_CHUNK).min(inner);
                for k in kc * K_CHUNK..k1 {
                    let wk = &w[k * cols..(k + 1) * cols];
                    for r in 0..rows {
                        let a = x[r * inner + k];
                        if a != 0.0 {
                            axpy(&mut part[r * cols..(r + 1) * cols], a, wk);
                        }
                    }
                }
                part
            },
        )
        .collect();
    out.par_chunks_mut(1024).enumerate().for_each(|(i, o)| {
        let n = o.len();
        for part in &partials {
            for (oi, pi) in o.iter_mut().zip(&part[i * 1024..i * 1024 + n]) {
                *oi += pi;
            }
        }
    });
}

/// See [`crate::Backend::swiglu`].
pub(crate) fn swiglu(shape: MlpShape, x: &[f32], gate: &[f32], up: &[f32], down: &[f32], out: &mut [f32]) -> Result<()> {
    let op = "swiglu";
    let MlpShape { tokens, hidden, intermediate } = shape;
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
    g.par_iter_mut().zip(u.par_iter()).for_each(|(gi, ui)| *gi = silu(*gi) * ui);
    matmul_unchecked(tokens, intermediate, hidden, &g, down, out);
    Ok(())
}

/// See [`crate::Backend::silu_mul`].
pub(crate) fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
    let op = "silu_mul";
    check_len(op, "up", up.len(), gate.len())?;
    check_len(op, "out", out.len(), gate.len())?;
    out.par_chunks_mut(4096).zip(gate.par_chunks(4096).zip(up.par_chunks(4096))).for_each(|(o, (g, u))| {
        for ((oi, &gi), &ui) in o.iter_mut().zip(g).zip(u) {
            *oi = silu(gi) * ui;
        }
    });
    Ok(())
}

/// See [`crate::Backend::embedding`].
pub(crate) fn embedding(shape: EmbeddingShape, table: &[f32], ids: &[i32], out: &mut [f32]) -> Result<()> {
    let op = "embedding";
    let EmbeddingShape { tokens, vocab, dim } = shape;
    check_len(op, "table", table.len(), elems(op, &[vocab, dim])?)?;
    check_len(op, "ids", ids.len(), tokens)?;
    check_len(op, "out", out.len(), elems(op, &[tokens, dim])?)?;
    for (t, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= vocab {
            return Err(KernelError::IndexOutOfRange { op, what: "token id", index: id as i64, position: t, bound: vocab });
        }
    }
    if dim == 0 {
        return Ok(());
    }
    out.par_chunks_mut(dim).zip(ids.par_iter()).with_min_len(super::grain(dim)).for_each(|(o, &id)| {
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
        return Err(KernelError::InvalidShape { op, reason: format!("{cols} columns do not fit an i32 id") });
    }
    if cols == 0 {
        return Err(KernelError::InvalidShape { op, reason: "argmax over 0 columns".into() });
    }
    ids.par_iter_mut().enumerate().with_min_len(super::grain(cols)).for_each(|(r, id)| {
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
    dst.par_chunks_mut(4096).zip(src.par_chunks(4096)).for_each(|(d, s)| {
        for (a, b) in d.iter_mut().zip(s) {
            *a += b;
        }
    });
    Ok(())
}
