//! Short causal depthwise conv1d with SiLU on the CPU.

use rayon::prelude::*;

use super::math::silu;
use crate::error::{Result, check_len, check_nonzero, elems};
use crate::shapes::ConvShape;

fn check_common(op: &'static str, shape: &ConvShape, weight: &[f32]) -> Result<()> {
    check_nonzero(op, "conv width", shape.width)?;
    check_len(op, "weight", weight.len(), elems(op, &[shape.channels, shape.width])?)
}

/// Weight `[C, W]` transposed to `[W, C]`, so the tap loop runs over contiguous channels.
fn taps(weight: &[f32], channels: usize, width: usize) -> Vec<f32> {
    let mut t = vec![0.0f32; weight.len()];
    for c in 0..channels {
        for j in 0..width {
            t[j * channels + c] = weight[c * width + j];
        }
    }
    t
}

/// See [`crate::Backend::conv_prefill`].
pub(crate) fn prefill(shape: ConvShape, tokens: usize, x: &[f32], weight: &[f32], state: &mut [f32], out: &mut [f32]) -> Result<()> {
    let op = "conv_prefill";
    check_common(op, &shape, weight)?;
    let ConvShape { channels: ch, width } = shape;
    let hist = width - 1;
    check_len(op, "x", x.len(), elems(op, &[tokens, ch])?)?;
    check_len(op, "out", out.len(), elems(op, &[tokens, ch])?)?;
    check_len(op, "state", state.len(), elems(op, &[hist, ch])?)?;
    let w_t = taps(weight, ch, width);
    // Input row at position p relative to the first new token; p < 0 reads the state.
    let input_row = |p: isize| -> &[f32] {
        if p < 0 {
            let r = (hist as isize + p) as usize;
            &state[r * ch..(r + 1) * ch]
        } else {
            let r = p as usize;
            &x[r * ch..(r + 1) * ch]
        }
    };
    if ch > 0 {
        out.par_chunks_mut(ch).enumerate().with_min_len(super::grain(2 * ch * width)).for_each(|(t, orow)| {
            orow.fill(0.0);
            for j in 0..width {
                let src = input_row(t as isize + j as isize - hist as isize);
                let wj = &w_t[j * ch..(j + 1) * ch];
                for ((o, s), w) in orow.iter_mut().zip(src).zip(wj) {
                    *o += w * s;
                }
            }
            for o in orow.iter_mut() {
                *o = silu(*o);
            }
        });
    }
    let mut next = vec![0.0f32; hist * ch];
    for r in 0..hist {
        let src = input_row(tokens as isize + r as isize - hist as isize);
        next[r * ch..(r + 1) * ch].copy_from_slice(src);
    }
    state.copy_from_slice(&next);
    Ok(())
}

/// See [`crate::Backend::conv_step`].
pub(crate) fn step(shape: ConvShape, batch: usize, x: &[f32], weight: &[f32], state: &mut [f32], out: &mut [f32]) -> Result<()> {
    let op = "conv_step";
    check_common(op, &shape, weight)?;
    let ConvShape { channels: ch, width } = shape;
    let hist = width - 1;
    check_len(op, "x", x.len(), elems(op, &[batch, ch])?)?;
    check_len(op, "out", out.len(), elems(op, &[batch, ch])?)?;
    check_len(op, "state", state.len(), elems(op, &[batch, hist, ch])?)?;
    if ch == 0 {
        return Ok(());
    }
    let step_one = |b: usize, st: &mut [f32], orow: &mut [f32]| {
        let xb = &x[b * ch..(b + 1) * ch];
        for c in 0..ch {
            let wc = &weight[c * width..(c + 1) * width];
            let mut acc = wc[hist] * xb[c];
            for j in 0..hist {
                acc += wc[j] * st[j * ch + c];
            }
            orow[c] = silu(acc);
        }
        if hist > 0 {
            st.copy_within(ch.., 0);
            st[(hist - 1) * ch..].copy_from_slice(xb);
        }
    };
    if hist == 0 {
        out.par_chunks_mut(ch).enumerate().with_min_len(super::grain(2 * ch * width)).for_each(|(b, o)| step_one(b, &mut [], o));
    } else {
        state
            .par_chunks_mut(hist * ch)
            .zip(out.par_chunks_mut(ch))
            .enumerate()
            .with_min_len(super::grain(2 * ch * width))
            .for_each(|(b, (st, o))| step_one(b, st, o));
    }
    Ok(())
}
