//! RMSNorm and the gated output norm on the CPU.

use rayon::prelude::*;

use super::math::silu;
use crate::error::{Result, check_len, elems};
use crate::shapes::NormShape;

fn check(op: &'static str, shape: &NormShape, x: usize, weight: usize, out: usize) -> Result<()> {
    let n = elems(op, &[shape.rows, shape.dim])?;
    check_len(op, "x", x, n)?;
    check_len(op, "weight", weight, shape.dim)?;
    check_len(op, "out", out, n)
}

#[inline]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (ms + eps).sqrt()
}

/// See [`crate::Backend::rms_norm`].
pub(crate) fn rms_norm(shape: NormShape, x: &[f32], weight: &[f32], out: &mut [f32]) -> Result<()> {
    check("rms_norm", &shape, x.len(), weight.len(), out.len())?;
    let d = shape.dim;
    if d == 0 {
        return Ok(());
    }
    out.par_chunks_mut(d).zip(x.par_chunks(d)).with_min_len(super::grain(3 * d)).for_each(|(o, xr)| {
        let r = inv_rms(xr, shape.eps);
        for ((oi, xi), wi) in o.iter_mut().zip(xr).zip(weight) {
            *oi = xi * r * wi;
        }
    });
    Ok(())
}

/// See [`crate::Backend::gated_rms_norm`].
pub(crate) fn gated_rms_norm(shape: NormShape, o: &[f32], gate: &[f32], weight: &[f32], out: &mut [f32]) -> Result<()> {
    let op = "gated_rms_norm";
    check(op, &shape, o.len(), weight.len(), out.len())?;
    check_len(op, "gate", gate.len(), o.len())?;
    let d = shape.dim;
    if d == 0 {
        return Ok(());
    }
    out.par_chunks_mut(d).zip(o.par_chunks(d)).zip(gate.par_chunks(d)).with_min_len(super::grain(8 * d)).for_each(|((y, xr), gr)| {
        let r = inv_rms(xr, shape.eps);
        for (((yi, xi), wi), gi) in y.iter_mut().zip(xr).zip(weight).zip(gr) {
            *yi = xi * r * wi * silu(*gi);
        }
    });
    Ok(())
}
