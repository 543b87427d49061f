//! Absorbed MLA attention and the DCP LSE merge on the CPU.

use rayon::prelude::*;

use super::math::{axpy, dot};
use crate::error::{KernelError, Result, check_len, check_nonzero, elems};
use crate::shapes::{MergeShape, MlaShape};

/// Softmax attention of one query over the first `n` rows; writes the latent
/// output (first `l` columns of the rows) and returns the LSE of the scaled scores.
fn attend(q: &[f32], rows: &[f32], n: usize, l: usize, scale: f32, scores: &mut Vec<f32>, o: &mut [f32]) -> f32 {
    o.fill(0.0);
    if n == 0 {
        return f32::NEG_INFINITY;
    }
    let width = q.len();
    scores.clear();
    scores.extend(rows[..n * width].chunks_exact(width).map(|r| dot(q, r) * scale));
    let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for (r, &s) in scores.iter().enumerate() {
        let p = (s - m).exp();
        sum += p;
        axpy(o, p, &rows[r * width..r * width + l]);
    }
    let inv = 1.0 / sum;
    for v in o.iter_mut() {
        *v *= inv;
    }
    m + sum.ln()
}

pub(crate) fn check_rows(op: &'static str, shape: &MlaShape, rows_len: usize, count: usize) -> Result<usize> {
    check_nonzero(op, "heads", shape.heads)?;
    let width =
        shape.kv_lora_rank.checked_add(shape.rope_dim).ok_or_else(|| KernelError::SizeOverflow { op, dims: vec![shape.kv_lora_rank, shape.rope_dim] })?;
    check_nonzero(op, "kv_lora_rank + rope_dim", width)?;
    let need = elems(op, &[count, width])?;
    if rows_len < need || !rows_len.is_multiple_of(width) {
        return Err(KernelError::InvalidShape {
            op,
            reason: format!("rows buffer of {rows_len} elements cannot hold {count} rows of {width} (a whole number of rows, at least {need})"),
        });
    }
    Ok(width)
}

/// See [`crate::Backend::mla_decode`].
pub(crate) fn decode(shape: MlaShape, q_lat: &[f32], rows: &[f32], n: usize, out: &mut [f32], lse: &mut [f32]) -> Result<()> {
    let op = "mla_decode";
    let width = check_rows(op, &shape, rows.len(), n)?;
    let (h, l) = (shape.heads, shape.kv_lora_rank);
    check_len(op, "q_lat", q_lat.len(), elems(op, &[h, width])?)?;
    check_len(op, "out", out.len(), elems(op, &[h, l])?)?;
    check_len(op, "lse", lse.len(), h)?;
    let run = |hd: usize, o: &mut [f32], scores: &mut Vec<f32>| attend(&q_lat[hd * width..(hd + 1) * width], rows, n, l, shape.scale, scores, o);
    if l == 0 {
        let mut scores = Vec::new();
        for (hd, x) in lse.iter_mut().enumerate() {
            *x = run(hd, &mut [], &mut scores);
        }
    } else {
        out.par_chunks_mut(l)
            .zip(lse.par_iter_mut())
            .enumerate()
            .with_min_len(super::grain(2 * n * width))
            .for_each_init(Vec::new, |scores, (hd, (o, x))| *x = run(hd, o, scores));
    }
    Ok(())
}

/// See [`crate::Backend::mla_prefill`].
pub(crate) fn prefill(shape: MlaShape, tokens: usize, q_lat: &[f32], rows: &[f32], n: usize, out: &mut [f32], lse: Option<&mut [f32]>) -> Result<()> {
    let op = "mla_prefill";
    let width = check_rows(op, &shape, rows.len(), n)?;
    if n < tokens {
        return Err(KernelError::InvalidShape { op, reason: format!("{tokens} query tokens need at least as many rows, got {n}") });
    }
    let (h, l) = (shape.heads, shape.kv_lora_rank);
    check_len(op, "q_lat", q_lat.len(), elems(op, &[tokens, h, width])?)?;
    check_len(op, "out", out.len(), elems(op, &[tokens, h, l])?)?;
    if let Some(x) = lse.as_ref() {
        check_len(op, "lse", x.len(), elems(op, &[tokens, h])?)?;
    }
    let prefix = n - tokens;
    let mut lse_local;
    let lse = match lse {
        Some(x) => x,
        None => {
            lse_local = vec![0.0f32; tokens * h];
            &mut lse_local[..]
        }
    };
    // Query (t, head) sees rows 0..=prefix + t.
    let run = |th: usize, o: &mut [f32], scores: &mut Vec<f32>| {
        let t = th / h;
        attend(&q_lat[th * width..(th + 1) * width], rows, prefix + t + 1, l, shape.scale, scores, o)
    };
    if l == 0 {
        let mut scores = Vec::new();
        for (th, x) in lse.iter_mut().enumerate() {
            *x = run(th, &mut [], &mut scores);
        }
    } else {
        out.par_chunks_mut(l).zip(lse.par_iter_mut()).enumerate().with_min_len(4).for_each_init(Vec::new, |scores, (th, (o, x))| *x = run(th, o, scores));
    }
    Ok(())
}

/// See [`crate::Backend::dcp_merge`].
pub(crate) fn dcp_merge(shape: MergeShape, o_shards: &[f32], lse_shards: &[f32], out: &mut [f32], lse: &mut [f32]) -> Result<()> {
    let op = "dcp_merge";
    let MergeShape { shards, heads, width } = shape;
    check_len(op, "o_shards", o_shards.len(), elems(op, &[shards, heads, width])?)?;
    check_len(op, "lse_shards", lse_shards.len(), elems(op, &[shards, heads])?)?;
    check_len(op, "out", out.len(), elems(op, &[heads, width])?)?;
    check_len(op, "lse", lse.len(), heads)?;
    for hd in 0..heads {
        let o = &mut out[hd * width..(hd + 1) * width];
        o.fill(0.0);
        let m = (0..shards).map(|r| lse_shards[r * heads + hd]).fold(f32::NEG_INFINITY, f32::max);
        if m == f32::NEG_INFINITY {
            // Every shard is empty for this head (docs/design.md: m = 0, nothing to add).
            lse[hd] = f32::NEG_INFINITY;
            continue;
        }
        let sum: f32 = (0..shards).map(|r| (lse_shards[r * heads + hd] - m).exp()).sum();
        let total = m + sum.ln();
        for r in 0..shards {
            let wgt = (lse_shards[r * heads + hd] - total).exp();
            if wgt != 0.0 {
                let at = (r * heads + hd) * width;
                axpy(o, wgt, &o_shards[at..at + width]);
            }
        }
        lse[hd] = total;
    }
    Ok(())
}

/// f64 attention partial of one query over the first `n` rows (see
/// [`crate::Backend::mla_decode_partial`]): `p` = [m, l, acc (`p.len() - 2`)].
/// Every value is formed in f64 from the f32 inputs, row by row in row order, so
/// a row contributes the same terms whichever shard holds it.
fn partial64(q: &[f32], rows: &[f32], n: usize, scale: f64, scores: &mut Vec<f64>, p: &mut [f64]) {
    let (head, acc) = p.split_at_mut(2);
    acc.fill(0.0);
    if n == 0 {
        head[0] = f64::NEG_INFINITY;
        head[1] = 0.0;
        return;
    }
    let width = q.len();
    let l = acc.len();
    scores.clear();
    scores.extend(rows[..n * width].chunks_exact(width).map(|r| {
        let mut s = 0.0f64;
        for (&a, &b) in q.iter().zip(r) {
            s += a as f64 * b as f64;
        }
        s * scale
    }));
    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut sum = 0.0f64;
    for (r, &s) in scores.iter().enumerate() {
        let e = (s - m).exp();
        sum += e;
        for (a, &v) in acc.iter_mut().zip(&rows[r * width..r * width + l]) {
            *a += e * v as f64;
        }
    }
    head[0] = m;
    head[1] = sum;
}

/// See [`crate::Backend::mla_decode_partial`].
pub(crate) fn decode_partial(shape: MlaShape, q_lat: &[f32], rows: &[f32], n: usize, partial: &mut [f64]) -> Result<()> {
    let op = "mla_decode_partial";
    let width = check_rows(op, &shape, rows.len(), n)?;
    let (h, l) = (shape.heads, shape.kv_lora_rank);
    let pw = crate::shapes::mla_partial_width(l);
    check_len(op, "q_lat", q_lat.len(), elems(op, &[h, width])?)?;
    check_len(op, "partial", partial.len(), elems(op, &[h, pw])?)?;
    let scale = shape.scale as f64;
    partial
        .par_chunks_mut(pw)
        .enumerate()
        .with_min_len(super::grain(2 * n * width))
        .for_each_init(Vec::new, |scores, (hd, p)| partial64(&q_lat[hd * width..(hd + 1) * width], rows, n, scale, scores, p));
    Ok(())
}

/// See [`crate::Backend::mla_decode_partial_ragged`]. One task per (request,
/// head), each running [`partial64`] over that request's rows only: the terms and
/// their order are those of [`decode_partial`] on the request alone.
pub(crate) fn decode_partial_ragged(shape: MlaShape, q_lat: &[f32], rows: &[f32], counts: &[usize], partial: &mut [f64]) -> Result<()> {
    let op = "mla_decode_partial_ragged";
    let total = counts.iter().try_fold(0usize, |a, &n| a.checked_add(n)).ok_or_else(|| KernelError::SizeOverflow { op, dims: counts.to_vec() })?;
    let width = check_rows(op, &shape, rows.len(), total)?;
    let (h, l) = (shape.heads, shape.kv_lora_rank);
    let batch = counts.len();
    let pw = crate::shapes::mla_partial_width(l);
    check_len(op, "q_lat", q_lat.len(), elems(op, &[batch, h, width])?)?;
    check_len(op, "partial", partial.len(), elems(op, &[batch, h, pw])?)?;
    // First row of each request.
    let starts: Vec<usize> = counts
        .iter()
        .scan(0usize, |at, &n| {
            let s = *at;
            *at += n;
            Some(s)
        })
        .collect();
    let scale = shape.scale as f64;
    // Rows per request on average: the batch's tasks are balanced by count.
    let mean = total / batch.max(1);
    partial.par_chunks_mut(pw).enumerate().with_min_len(super::grain(2 * mean * width)).for_each_init(Vec::new, |scores, (bh, p)| {
        let b = bh / h;
        let (r0, n) = (starts[b], counts[b]);
        partial64(&q_lat[bh * width..(bh + 1) * width], &rows[r0 * width..(r0 + n) * width], n, scale, scores, p)
    });
    Ok(())
}

/// See [`crate::Backend::dcp_merge_partials`].
pub(crate) fn dcp_merge_partials(shape: MergeShape, partials: &[f64], out: &mut [f32], lse: &mut [f32]) -> Result<()> {
    let op = "dcp_merge_partials";
    let MergeShape { shards, heads, width } = shape;
    let pw = crate::shapes::mla_partial_width(width);
    check_len(op, "partials", partials.len(), elems(op, &[shards, heads, pw])?)?;
    check_len(op, "out", out.len(), elems(op, &[heads, width])?)?;
    check_len(op, "lse", lse.len(), heads)?;
    let mut acc = vec![0.0f64; width];
    for hd in 0..heads {
        let part = |r: usize| &partials[(r * heads + hd) * pw..(r * heads + hd + 1) * pw];
        let o = &mut out[hd * width..(hd + 1) * width];
        let m = (0..shards).map(|r| part(r)[0]).fold(f64::NEG_INFINITY, f64::max);
        if m == f64::NEG_INFINITY {
            o.fill(0.0);
            lse[hd] = f32::NEG_INFINITY;
            continue;
        }
        acc.fill(0.0);
        let mut total = 0.0f64;
        for r in 0..shards {
            let p = part(r);
            if p[0] == f64::NEG_INFINITY {
                continue;
            }
            let w = (p[0] - m).exp();
            total += p[1] * w;
            for (a, &x) in acc.iter_mut().zip(&p[2..]) {
                *a += x * w;
            }
        }
        for (oc, &a) in o.iter_mut().zip(&acc) {
            *oc = (a / total) as f32;
        }
        lse[hd] = (m + total.ln()) as f32;
    }
    Ok(())
}
