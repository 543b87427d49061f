//! MLA attention, DCP merge and the f64 partials' tests.

use super::*;

// ---------------------------------------------------------------- MLA

/// Naive attention of one query over rows; returns (o `[L]`, lse).
fn attend64(q: &[f32], rows: &[f32], n: usize, l: usize, scale: f64) -> (Vec<f64>, f64) {
    let width = q.len();
    if n == 0 {
        return (vec![0.0; l], f64::NEG_INFINITY);
    }
    let s: Vec<f64> = (0..n).map(|r| scale * (0..width).map(|c| q[c] as f64 * rows[r * width + c] as f64).sum::<f64>()).collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
    let o = (0..l).map(|c| (0..n).map(|r| (s[r] - m).exp() / z * rows[r * width + c] as f64).sum()).collect();
    (o, m + z.ln())
}

fn mla_shape(h: usize, l: usize, rd: usize) -> MlaShape {
    MlaShape { heads: h, kv_lora_rank: l, rope_dim: rd, scale: 1.0 / ((l / 4 + rd) as f32).sqrt() }
}

#[test]
fn mla_decode_matches_naive_with_lse() {
    let (h, l, rd, n, cap) = (4, 32, 8, 50, 64);
    let width = l + rd;
    let shape = mla_shape(h, l, rd);
    let mut r = SplitMix64::new(12);
    let q = rand(&mut r, h * width, -2.0, 2.0);
    let rows = rand(&mut r, cap * width, -1.0, 1.0);
    let mut o = BE.alloc(h * l).unwrap();
    let mut lse = BE.alloc(h).unwrap();
    let rows_b = up(&rows);
    BE.mla_decode(shape, &up(&q), RowSet { buf: &rows_b, count: n }, &mut o, &mut lse).unwrap();
    let mut want_o = vec![0.0; h * l];
    let mut want_lse = vec![0.0; h];
    for hd in 0..h {
        let (oo, ls) = attend64(&q[hd * width..(hd + 1) * width], &rows, n, l, shape.scale as f64);
        want_o[hd * l..(hd + 1) * l].copy_from_slice(&oo);
        want_lse[hd] = ls;
    }
    assert_close("mla_decode o", o.as_slice(), &want_o, 1e-6, 1e-5, |i| coord(&["h", "c"], &[h, l], i));
    assert_close("mla_decode lse", lse.as_slice(), &want_lse, 1e-6, 1e-5, |i| format!("h={i}"));

    // No rows: o = 0, lse = -inf.
    BE.mla_decode(shape, &up(&q), RowSet { buf: &rows_b, count: 0 }, &mut o, &mut lse).unwrap();
    assert!(o.as_slice().iter().all(|&v| v == 0.0), "o must be 0 with no rows");
    assert!(lse.as_slice().iter().all(|&v| v == f32::NEG_INFINITY), "lse must be -inf with no rows");
    // More rows than the buffer holds: refused.
    let e = BE.mla_decode(shape, &up(&q), RowSet { buf: &rows_b, count: cap + 1 }, &mut o, &mut lse).unwrap_err();
    assert!(matches!(e, KernelError::InvalidShape { op: "mla_decode", .. }), "{e}");
}

#[test]
fn mla_prefill_is_causal_and_matches_naive_with_prefix() {
    let (h, l, rd) = (3, 16, 4);
    let width = l + rd;
    let shape = mla_shape(h, l, rd);
    for &(t_len, n) in &[(9usize, 9usize), (5, 12), (1, 1)] {
        let mut r = SplitMix64::new(t_len as u64 * 100 + n as u64);
        let q = rand(&mut r, t_len * h * width, -2.0, 2.0);
        let rows = rand(&mut r, n * width, -1.0, 1.0);
        let rows_b = up(&rows);
        let mut o = BE.alloc(t_len * h * l).unwrap();
        let mut lse = BE.alloc(t_len * h).unwrap();
        BE.mla_prefill(shape, t_len, &up(&q), RowSet { buf: &rows_b, count: n }, &mut o, Some(&mut lse)).unwrap();
        let mut want_o = vec![0.0; t_len * h * l];
        let mut want_lse = vec![0.0; t_len * h];
        for t in 0..t_len {
            for hd in 0..h {
                let th = t * h + hd;
                let seen = n - t_len + t + 1;
                let (oo, ls) = attend64(&q[th * width..(th + 1) * width], &rows, seen, l, shape.scale as f64);
                want_o[th * l..(th + 1) * l].copy_from_slice(&oo);
                want_lse[th] = ls;
            }
        }
        let what = format!("mla_prefill o T={t_len} N={n}");
        assert_close(&what, o.as_slice(), &want_o, 1e-6, 1e-5, |i| coord(&["t", "h", "c"], &[t_len, h, l], i));
        assert_close("mla_prefill lse", lse.as_slice(), &want_lse, 1e-6, 1e-5, |i| coord(&["t", "h"], &[t_len, h], i));
        // Without the optional lse output the latent output is the same.
        let mut o2 = BE.alloc(t_len * h * l).unwrap();
        BE.mla_prefill(shape, t_len, &up(&q), RowSet { buf: &rows_b, count: n }, &mut o2, None).unwrap();
        assert_eq!(o2.as_slice(), o.as_slice());
    }
    let rows_b = BE.alloc(3 * width).unwrap();
    let mut o = BE.alloc(4 * h * l).unwrap();
    let q = BE.alloc(4 * h * width).unwrap();
    let e = BE.mla_prefill(shape, 4, &q, RowSet { buf: &rows_b, count: 3 }, &mut o, None).unwrap_err();
    assert!(matches!(e, KernelError::InvalidShape { op: "mla_prefill", .. }), "{e}");
}

#[test]
fn dcp_sharded_decode_then_merge_equals_single_rank() {
    let (h, l, rd) = (4, 32, 8);
    let width = l + rd;
    let shape = mla_shape(h, l, rd);
    let mut r = SplitMix64::new(2024);
    let q = rand(&mut r, h * width, -3.0, 3.0);
    let q_b = up(&q);
    for &n in &[0usize, 3, 37, 130] {
        let rows = rand(&mut r, n * width, -1.0, 1.0);
        let mut o_full = BE.alloc(h * l).unwrap();
        let mut lse_full = BE.alloc(h).unwrap();
        BE.mla_decode(shape, &q_b, RowSet { buf: &up(&rows), count: n }, &mut o_full, &mut lse_full).unwrap();
        for &interleave in &[1usize, 4] {
            for &dcp in &[1usize, 2, 4, 8] {
                // Token p lives on dcp rank (p / S) % DCP, in position order.
                let mut shard_rows: Vec<Vec<f32>> = vec![Vec::new(); dcp];
                for p in 0..n {
                    shard_rows[(p / interleave) % dcp].extend_from_slice(&rows[p * width..(p + 1) * width]);
                }
                let mut o_sh = Vec::new();
                let mut lse_sh = Vec::new();
                for sr in &shard_rows {
                    let cnt = sr.len() / width;
                    let mut o = BE.alloc(h * l).unwrap();
                    let mut ls = BE.alloc(h).unwrap();
                    BE.mla_decode(shape, &q_b, RowSet { buf: &up(sr), count: cnt }, &mut o, &mut ls).unwrap();
                    o_sh.extend_from_slice(o.as_slice());
                    lse_sh.extend_from_slice(ls.as_slice());
                }
                let mut o = BE.alloc(h * l).unwrap();
                let mut ls = BE.alloc(h).unwrap();
                let ms = MergeShape { shards: dcp, heads: h, width: l };
                BE.dcp_merge(ms, &up(&o_sh), &up(&lse_sh), &mut o, &mut ls).unwrap();
                let what = format!("merged o, N={n} S={interleave} DCP={dcp}");
                assert_close(&what, o.as_slice(), &f64s(o_full.as_slice()), 1e-5, 0.0, |i| coord(&["h", "c"], &[h, l], i));
                let what = format!("merged lse, N={n} S={interleave} DCP={dcp}");
                assert_close(&what, ls.as_slice(), &f64s(lse_full.as_slice()), 1e-5, 0.0, |i| format!("h={i}"));
            }
        }
    }
}

#[test]
fn dcp_merge_matches_formula_and_handles_empty_shards() {
    let (s, h, w) = (3, 2, 5);
    let mut r = SplitMix64::new(9);
    let o = rand(&mut r, s * h * w, -1.0, 1.0);
    // head 0: shard 1 empty; head 1: every shard empty.
    let lse = vec![0.3, f32::NEG_INFINITY, f32::NEG_INFINITY, f32::NEG_INFINITY, -1.2, f32::NEG_INFINITY];
    let mut out = BE.alloc(h * w).unwrap();
    let mut lse_out = BE.alloc(h).unwrap();
    BE.dcp_merge(MergeShape { shards: s, heads: h, width: w }, &up(&o), &up(&lse), &mut out, &mut lse_out).unwrap();
    let (l0, l2) = (0.3f64, -1.2f64);
    let m = l0.max(l2);
    let tot = m + ((l0 - m).exp() + (l2 - m).exp()).ln();
    let mut want = vec![0.0; h * w];
    for c in 0..w {
        want[c] = (l0 - tot).exp() * o[c] as f64 + (l2 - tot).exp() * o[(2 * h) * w + c] as f64;
    }
    assert_close("merge o", out.as_slice(), &want, 1e-6, 1e-6, |i| coord(&["h", "c"], &[h, w], i));
    assert_close("merge lse", lse_out.as_slice(), &[tot, f64::NEG_INFINITY], 1e-6, 1e-6, |i| format!("h={i}"));
}

// ---------------------------------------------------------------- MLA, f64 partials

/// Naive f64 partial of one query: (m, l, acc) with every term formed directly.
fn partial_naive(q: &[f32], rows: &[f32], n: usize, l: usize, scale: f64) -> (f64, f64, Vec<f64>) {
    let width = q.len();
    if n == 0 {
        return (f64::NEG_INFINITY, 0.0, vec![0.0; l]);
    }
    let s: Vec<f64> = (0..n).map(|r| scale * (0..width).map(|c| q[c] as f64 * rows[r * width + c] as f64).sum::<f64>()).collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let z = s.iter().map(|x| (x - m).exp()).sum();
    let acc = (0..l).map(|c| (0..n).map(|r| (s[r] - m).exp() * rows[r * width + c] as f64).sum()).collect();
    (m, z, acc)
}

fn decode_partial(shape: MlaShape, q: &CpuBuf, rows: &[f32], n: usize) -> Vec<f64> {
    let mut p = BE.alloc_f64(shape.heads * crate::shapes::mla_partial_width(shape.kv_lora_rank)).unwrap();
    BE.mla_decode_partial(shape, q, RowSet { buf: &up(rows), count: n }, &mut p).unwrap();
    BE.download_f64(&p).unwrap()
}

fn merge_partials(shards: usize, heads: usize, l: usize, partials: &[f64]) -> (Vec<f32>, Vec<f32>) {
    let mut o = BE.alloc(heads * l).unwrap();
    let mut lse = BE.alloc(heads).unwrap();
    BE.dcp_merge_partials(MergeShape { shards, heads, width: l }, &BE.upload_f64(partials).unwrap(), &mut o, &mut lse).unwrap();
    (o.into_vec(), lse.into_vec())
}

#[test]
fn mla_decode_partial_matches_naive_f64_and_one_shard_merge_is_attention() {
    for &(h, l, rd, n) in &[(4usize, 32usize, 8usize, 50usize), (3, 16, 0, 1), (2, 8, 4, 0), (1, 64, 16, 300)] {
        let width = l + rd;
        let shape = mla_shape(h, l, rd);
        let mut r = SplitMix64::new(77 + n as u64);
        let q = rand(&mut r, h * width, -2.0, 2.0);
        let rows = rand(&mut r, (n + 3) * width, -1.0, 1.0);
        let p = decode_partial(shape, &up(&q), &rows, n);
        let pw = l + 2;
        let mut want_o = vec![0.0; h * l];
        let mut want_lse = vec![0.0; h];
        for hd in 0..h {
            let (m, z, acc) = partial_naive(&q[hd * width..(hd + 1) * width], &rows, n, l, shape.scale as f64);
            let got = &p[hd * pw..(hd + 1) * pw];
            let close = |a: f64, b: f64| a == b || (a - b).abs() <= 1e-12 * b.abs().max(1.0);
            assert!(close(got[0], m), "m of head {hd} (N={n}): {} vs {m}", got[0]);
            assert!(close(got[1], z), "l of head {hd} (N={n}): {} vs {z}", got[1]);
            for c in 0..l {
                assert!(close(got[2 + c], acc[c]), "acc h={hd} c={c} (N={n}): {} vs {}", got[2 + c], acc[c]);
            }
            let (oo, ls) = attend64(&q[hd * width..(hd + 1) * width], &rows, n, l, shape.scale as f64);
            want_o[hd * l..(hd + 1) * l].copy_from_slice(&oo);
            want_lse[hd] = ls;
        }
        // One shard: plain attention, correctly rounded to within an f32 ulp.
        let (o, lse) = merge_partials(1, h, l, &p);
        assert_close("merged one shard o", &o, &want_o, 1e-7, 1e-6, |i| coord(&["h", "c"], &[h, l], i));
        assert_close("merged one shard lse", &lse, &want_lse, 1e-7, 1e-6, |i| format!("h={i}"));
        // And the f32 path agrees within its own tolerance.
        let mut o32 = BE.alloc(h * l).unwrap();
        let mut lse32 = BE.alloc(h).unwrap();
        BE.mla_decode(shape, &up(&q), RowSet { buf: &up(&rows), count: n }, &mut o32, &mut lse32).unwrap();
        assert_close("f32 decode vs f64 partial", o32.as_slice(), &f64s(&o), 1e-5, 1e-5, |i| coord(&["h", "c"], &[h, l], i));
    }
}

#[test]
fn dcp_merge_partials_matches_formula_and_handles_empty_shards() {
    let (s, h, l) = (3, 2, 5);
    let pw = l + 2;
    let mut r = SplitMix64::new(19);
    let acc = rand(&mut r, s * h * l, 0.1, 1.0);
    let mut p = vec![0.0f64; s * h * pw];
    // head 0: shards 0 and 2 hold rows, shard 1 is empty; head 1: every shard empty.
    let ms = [(0usize, 0.3f64, 1.7f64), (2, -1.2, 0.9)];
    for sh in 0..s {
        for hd in 0..h {
            let at = (sh * h + hd) * pw;
            p[at] = f64::NEG_INFINITY;
            p[at + 1] = 0.0;
        }
    }
    for &(sh, m, z) in &ms {
        let at = sh * h * pw;
        p[at] = m;
        p[at + 1] = z;
        for c in 0..l {
            p[at + 2 + c] = acc[sh * l + c] as f64;
        }
    }
    let (o, lse) = merge_partials(s, h, l, &p);
    let mm = 0.3f64;
    let tot: f64 = ms.iter().map(|&(_, m, z)| z * (m - mm).exp()).sum();
    let want: Vec<f64> = (0..h * l)
        .map(|i| {
            if i >= l {
                return 0.0;
            }
            ms.iter().map(|&(sh, m, _)| acc[sh * l + i] as f64 * (m - mm).exp()).sum::<f64>() / tot
        })
        .collect();
    assert_close("merge partials o", &o, &want, 1e-7, 1e-6, |i| coord(&["h", "c"], &[h, l], i));
    assert_close("merge partials lse", &lse, &[mm + tot.ln(), f64::NEG_INFINITY], 1e-7, 1e-6, |i| format!("h={i}"));
    assert!(o[l..].iter().all(|&v| v == 0.0), "an all-empty head gives 0");
    // Wrong lengths are refused, naming the op.
    let e = BE
        .dcp_merge_partials(
            MergeShape { shards: s, heads: h, width: l },
            &BE.upload_f64(&p[1..]).unwrap(),
            &mut BE.alloc(h * l).unwrap(),
            &mut BE.alloc(h).unwrap(),
        )
        .unwrap_err();
    assert!(matches!(e, KernelError::ShapeMismatch { op: "dcp_merge_partials", .. }), "{e}");
    let e = BE
        .mla_decode_partial(
            mla_shape(h, l, 3),
            &BE.alloc(h * (l + 3)).unwrap(),
            RowSet { buf: &BE.alloc(4 * (l + 3)).unwrap(), count: 4 },
            &mut BE.alloc_f64(h * pw - 1).unwrap(),
        )
        .unwrap_err();
    assert!(matches!(e, KernelError::ShapeMismatch { op: "mla_decode_partial", .. }), "{e}");
}

/// The property the disaggregated decode rests on: attention over tokens sharded
/// by DCP (any degree, token interleave, empty shards) and merged equals the
/// unsharded attention bit for bit, output and LSE.
#[test]
fn dcp_sharded_partials_then_merge_equal_unsharded_bit_for_bit() {
    let mut r = SplitMix64::new(4242);
    let mut cases = 0;
    for round in 0..40usize {
        let h = 1 + r.below(4) as usize;
        let l = [8usize, 16, 32][round % 3];
        let rd = [0usize, 4, 8][(round / 3) % 3];
        let width = l + rd;
        let shape = mla_shape(h, l, rd);
        // Scores of several magnitudes: large queries make the softmax peaked.
        let amp = [0.5f32, 2.0, 8.0][round % 3];
        let q = rand(&mut r, h * width, -amp, amp);
        let q_b = up(&q);
        for &n in &[0usize, 1, 2, 5, 9, 31, 64, 97] {
            let rows = rand(&mut r, n * width, -1.0, 1.0);
            let (o_full, lse_full) = merge_partials(1, h, l, &decode_partial(shape, &q_b, &rows, n));
            for &interleave in &[1usize, 4] {
                for dcp in 1..=8usize {
                    let mut shard_rows: Vec<Vec<f32>> = vec![Vec::new(); dcp];
                    for p in 0..n {
                        shard_rows[(p / interleave) % dcp].extend_from_slice(&rows[p * width..(p + 1) * width]);
                    }
                    let mut parts = Vec::new();
                    for sr in &shard_rows {
                        parts.extend(decode_partial(shape, &q_b, sr, sr.len() / width));
                    }
                    let (o, lse) = merge_partials(dcp, h, l, &parts);
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&o), bits(&o_full), "o: round {round} N={n} S={interleave} DCP={dcp}");
                    assert_eq!(bits(&lse), bits(&lse_full), "lse: round {round} N={n} S={interleave} DCP={dcp}");
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 40 * 8 * 2 * 8);
}

// ---------------------------------------------------------------- ops the model's batched decode needs

/// The batched kernel the decode step runs per DCP member: each request's
/// partial over its own rows, with row counts that differ per request (zero
/// included), equals the single-request kernel over those rows bit for bit.
#[test]
fn mla_decode_partial_ragged_equals_single_request_partials_bit_for_bit() {
    let mut r = SplitMix64::new(515);
    for &(h, l, rd) in &[(4usize, 32usize, 8usize), (3, 16, 0), (1, 8, 4)] {
        let width = l + rd;
        let pw = l + 2;
        let shape = mla_shape(h, l, rd);
        for counts in [vec![5usize], vec![0, 3, 17, 1], vec![64, 0, 0, 9, 130], vec![0]] {
            let b = counts.len();
            let total: usize = counts.iter().sum();
            let q = rand(&mut r, b * h * width, -3.0, 3.0);
            let rows = rand(&mut r, total * width, -1.0, 1.0);
            let mut p = BE.alloc_f64(b * h * pw).unwrap();
            BE.mla_decode_partial_ragged(shape, &up(&q), &up(&rows), &counts, &mut p).unwrap();
            let got = BE.download_f64(&p).unwrap();
            let mut r0 = 0;
            for (bi, &n) in counts.iter().enumerate() {
                let want = decode_partial(shape, &up(&q[bi * h * width..(bi + 1) * h * width]), &rows[r0 * width..(r0 + n) * width], n);
                let g = &got[bi * h * pw..(bi + 1) * h * pw];
                for (i, (a, w)) in g.iter().zip(&want).enumerate() {
                    assert!(a.to_bits() == w.to_bits(), "request {bi} of counts {counts:?}: {} differs ({a} vs {w})", coord(&["h", "p"], &[h, pw], i));
                }
                r0 += n;
            }
        }
    }
    // Too few rows for the counts, and a partial of the wrong size, are refused.
    let shape = mla_shape(2, 8, 0);
    let e = BE
        .mla_decode_partial_ragged(shape, &BE.alloc(2 * 2 * 8).unwrap(), &BE.alloc(3 * 8).unwrap(), &[2, 2], &mut BE.alloc_f64(2 * 2 * 10).unwrap())
        .unwrap_err();
    assert!(matches!(e, KernelError::InvalidShape { op: "mla_decode_partial_ragged", .. }), "{e}");
    let e = BE
        .mla_decode_partial_ragged(shape, &BE.alloc(2 * 2 * 8).unwrap(), &BE.alloc(4 * 8).unwrap(), &[2, 2], &mut BE.alloc_f64(2 * 2 * 10 - 1).unwrap())
        .unwrap_err();
    assert!(matches!(e, KernelError::ShapeMismatch { op: "mla_decode_partial_ragged", name: "partial", .. }), "{e}");
}
