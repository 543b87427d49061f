//! Dense (matmul, SwiGLU, element-wise, embedding, argmax) and copy tests.

use super::*;

// ---------------------------------------------------------------- dense

fn matmul64(rows: usize, inner: usize, cols: usize, x: &[f32], w: &[f32]) -> Vec<f64> {
    let mut out = vec![0.0; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            out[r * cols + c] = (0..inner).map(|k| x[r * inner + k] as f64 * w[k * cols + c] as f64).sum();
        }
    }
    out
}

#[test]
fn matmul_matches_naive_on_both_paths_and_tile_edges() {
    for &(rows, inner, cols) in &[(1usize, 300usize, 270usize), (3, 17, 5), (8, 64, 192), (37, 300, 270), (64, 5, 1), (70, 64, 33), (0, 4, 4), (9, 0, 3)] {
        let mut r = SplitMix64::new((rows * 7 + inner * 3 + cols) as u64);
        let x = rand(&mut r, rows * inner, -1.0, 1.0);
        let w = rand(&mut r, inner * cols, -1.0, 1.0);
        let mut out = BE.alloc(rows * cols).unwrap();
        BE.matmul(MatmulShape { rows, inner, cols }, &up(&x), &up(&w), &mut out).unwrap();
        let want = matmul64(rows, inner, cols, &x, &w);
        let what = format!("matmul {rows}x{inner}x{cols}");
        assert_close(&what, out.as_slice(), &want, 1e-5, 1e-5, |i| coord(&["row", "col"], &[rows, cols], i));
    }
    let mut out = BE.alloc(4).unwrap();
    let e = BE.matmul(MatmulShape { rows: 2, inner: 3, cols: 2 }, &up(&[0.0; 6]), &up(&[0.0; 5]), &mut out);
    assert!(matches!(e, Err(KernelError::ShapeMismatch { name: "w", .. })), "{e:?}");
}

/// The property the model's batched decode rests on: with an inner dimension of
/// at most one k chunk, a row's product does not depend on how many rows the
/// call has (every loop sums over k in order from zero), bit for bit.
#[test]
fn matmul_rows_do_not_depend_on_the_row_count_within_one_k_chunk() {
    let mut r = SplitMix64::new(404);
    for &(inner, cols) in &[(64usize, 192usize), (5, 256), (33, 7)] {
        let n = 100;
        let x = rand(&mut r, n * inner, -1.0, 1.0);
        let w = up(&rand(&mut r, inner * cols, -1.0, 1.0));
        let mut all = BE.alloc(n * cols).unwrap();
        BE.matmul(MatmulShape { rows: n, inner, cols }, &up(&x), &w, &mut all).unwrap();
        for rows in [1usize, 2, 3, 7, 8, 9, 31, 63, 64, 65] {
            let mut out = BE.alloc(rows * cols).unwrap();
            BE.matmul(MatmulShape { rows, inner, cols }, &up(&x[..rows * inner]), &w, &mut out).unwrap();
            for (i, (a, b)) in out.as_slice().iter().zip(all.as_slice()).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "inner {inner}: {} differs between a call of {rows} rows and one of {n}",
                    coord(&["row", "col"], &[rows, cols], i)
                );
            }
        }
    }
}

#[test]
fn swiglu_matches_naive() {
    let (t, d, f) = (5, 24, 40);
    let mut r = SplitMix64::new(31);
    let x = rand(&mut r, t * d, -1.0, 1.0);
    let wg = rand(&mut r, d * f, -0.5, 0.5);
    let wu = rand(&mut r, d * f, -0.5, 0.5);
    let wd = rand(&mut r, f * d, -0.5, 0.5);
    let mut out = BE.alloc(t * d).unwrap();
    let (g, u, dn) = (up(&wg), up(&wu), up(&wd));
    BE.swiglu(MlpShape { tokens: t, hidden: d, intermediate: f }, &up(&x), MlpWeights { gate: &g, up: &u, down: &dn }, &mut out).unwrap();
    let gg = matmul64(t, d, f, &x, &wg);
    let uu = matmul64(t, d, f, &x, &wu);
    let hmid: Vec<f64> = gg.iter().zip(&uu).map(|(a, b)| silu64(*a) * b).collect();
    let mut want = vec![0.0; t * d];
    for r0 in 0..t {
        for c in 0..d {
            want[r0 * d + c] = (0..f).map(|k| hmid[r0 * f + k] * wd[k * d + c] as f64).sum();
        }
    }
    assert_close("swiglu", out.as_slice(), &want, 1e-5, 1e-5, |i| coord(&["t", "c"], &[t, d], i));
}

#[test]
fn embedding_argmax_add_and_copies() {
    let (v, d) = (6, 3);
    let table: Vec<f32> = (0..v * d).map(|i| i as f32).collect();
    let ids = BE.upload_i32(&[5, 0, 2]).unwrap();
    let mut out = BE.alloc(3 * d).unwrap();
    let es = EmbeddingShape { tokens: 3, vocab: v, dim: d };
    BE.embedding(es, &up(&table), &ids, &mut out).unwrap();
    assert_eq!(out.as_slice(), &[15.0, 16.0, 17.0, 0.0, 1.0, 2.0, 6.0, 7.0, 8.0]);
    let bad = BE.upload_i32(&[1, 6, 0]).unwrap();
    let e = BE.embedding(es, &up(&table), &bad, &mut out).unwrap_err();
    assert_eq!(e, KernelError::IndexOutOfRange { op: "embedding", what: "token id", index: 6, position: 1, bound: v });

    let logits = [1.0, 3.0, 3.0, -1.0, f32::NAN, -5.0, -2.0, f32::NAN, f32::NAN, f32::NAN, f32::NAN, f32::NAN];
    let mut am = BE.alloc_i32(3).unwrap();
    BE.argmax(3, 4, &up(&logits), &mut am).unwrap();
    assert_eq!(BE.download_i32(&am).unwrap(), vec![1, 2, 0], "ties to lowest index, NaN skipped");

    let mut a = up(&[1.0, 2.0, 3.0]);
    BE.add_inplace(&mut a, &up(&[0.5, 0.5, -3.0])).unwrap();
    assert_eq!(a.as_slice(), &[1.5, 2.5, 0.0]);
    assert!(BE.add_inplace(&mut a, &up(&[1.0])).is_err());

    let mut dst = BE.alloc(5).unwrap();
    BE.copy(&up(&[1.0, 2.0, 3.0]), 1, &mut dst, 3, 2).unwrap();
    assert_eq!(dst.as_slice(), &[0.0, 0.0, 0.0, 2.0, 3.0]);
    let e = BE.copy(&up(&[1.0, 2.0, 3.0]), 2, &mut dst, 0, 2).unwrap_err();
    assert!(matches!(e, KernelError::RangeOutOfBounds { name: "src", .. }), "{e}");
    BE.upload_into(&mut dst, 0, &[9.0]).unwrap();
    assert!(BE.upload_into(&mut dst, usize::MAX, &[9.0]).is_err());
    BE.fill(&mut dst, 7.0).unwrap();
    assert_eq!(BE.download(&dst).unwrap(), vec![7.0; 5]);

    // Split a [2, 6] conv output into its middle [2, 2] channel group.
    let src = up(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0]);
    let mut mid = BE.alloc(4).unwrap();
    let cc = ColsCopy { rows: 2, src_cols: 6, src_col: 2, dst_cols: 2, dst_col: 0, width: 2 };
    BE.copy_cols(cc, &src, &mut mid).unwrap();
    assert_eq!(mid.as_slice(), &[2.0, 3.0, 12.0, 13.0]);
    let e = BE.copy_cols(ColsCopy { src_col: 5, ..cc }, &src, &mut mid).unwrap_err();
    assert!(matches!(e, KernelError::RangeOutOfBounds { .. }), "{e}");
}

#[test]
fn silu_mul_matches_naive_and_refuses_unequal_lengths() {
    let mut r = SplitMix64::new(31);
    let n = 10_000;
    let g = rand(&mut r, n, -8.0, 8.0);
    let u = rand(&mut r, n, -2.0, 2.0);
    let mut out = BE.alloc(n).unwrap();
    BE.silu_mul(&up(&g), &up(&u), &mut out).unwrap();
    let want: Vec<f64> = g.iter().zip(&u).map(|(&a, &b)| silu64(a as f64) * b as f64).collect();
    assert_close("silu_mul", out.as_slice(), &want, 1e-6, 1e-5, |i| format!("i={i}"));
    let e = BE.silu_mul(&up(&g), &up(&u[1..]), &mut out).unwrap_err();
    assert!(matches!(e, KernelError::ShapeMismatch { op: "silu_mul", name: "up", .. }), "{e}");
}

#[test]
fn round_to_storage_dtype_is_the_host_conversion_and_f32_is_identity() {
    use crate::dtype::{StorageDtype, bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
    let mut r = SplitMix64::new(8);
    let x = rand(&mut r, 1000, -70000.0, 70000.0).into_iter().chain(rand(&mut r, 1000, -1e-3, 1e-3)).collect::<Vec<_>>();
    let mut b = up(&x);
    BE.round_to(&mut b, StorageDtype::F32).unwrap();
    assert_eq!(b.as_slice(), &x[..]);
    let mut b = up(&x);
    BE.round_to(&mut b, StorageDtype::Bf16).unwrap();
    for (i, (&got, &v)) in b.as_slice().iter().zip(&x).enumerate() {
        assert_eq!(got.to_bits(), bf16_to_f32(f32_to_bf16(v)).to_bits(), "bf16 at {i}");
    }
    let mut b = up(&x);
    BE.round_to(&mut b, StorageDtype::F16).unwrap();
    for (i, (&got, &v)) in b.as_slice().iter().zip(&x).enumerate() {
        assert_eq!(got.to_bits(), f16_to_f32(f32_to_f16(v)).to_bits(), "f16 at {i}");
    }
}

#[test]
fn copy_f64_copies_the_range_and_refuses_out_of_bounds() {
    let src = BE.upload_f64(&[1.0, 2.0, 3.0, 4.0]).unwrap();
    let mut dst = BE.alloc_f64(6).unwrap();
    BE.copy_f64(&src, 1, &mut dst, 3, 3).unwrap();
    assert_eq!(BE.download_f64(&dst).unwrap(), vec![0.0, 0.0, 0.0, 2.0, 3.0, 4.0]);
    let e = BE.copy_f64(&src, 2, &mut dst, 0, 3).unwrap_err();
    assert!(matches!(e, KernelError::RangeOutOfBounds { op: "copy_f64", name: "src", .. }), "{e}");
    let e = BE.copy_f64(&src, 0, &mut dst, 4, 3).unwrap_err();
    assert!(matches!(e, KernelError::RangeOutOfBounds { op: "copy_f64", name: "dst", .. }), "{e}");
}

/// The all-reduce's sum of stacked partials is, bit for bit, that many
/// add_inplace calls in order; a range outside the stack is refused naming it.
#[test]
fn add_units_is_add_inplace_in_order_and_refuses_units_outside_the_stack() {
    let (n, units) = (300usize, 5usize);
    let stacked = rand(&mut SplitMix64::new(9), n * units, -1.0, 1.0);
    let acc0 = rand(&mut SplitMix64::new(10), n, -1.0, 1.0);
    let mut want = up(&acc0);
    for u in 1..4 {
        BE.add_inplace(&mut want, &up(&stacked[u * n..(u + 1) * n])).unwrap();
    }
    let mut acc = up(&acc0);
    BE.add_units(&mut acc, &up(&stacked), 1..4).unwrap();
    let bits = |b: &CpuBuf| b.as_slice().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&acc), bits(&want));
    let err = BE.add_units(&mut acc, &up(&stacked), 3..6).unwrap_err().to_string();
    assert!(err.contains("3..6") && err.contains("1500"), "{err}");
}
