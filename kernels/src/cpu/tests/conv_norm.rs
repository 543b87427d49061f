//! Short convolution and RMS norm tests.

use super::*;

// ---------------------------------------------------------------- conv

fn conv64(ch: usize, width: usize, x: &[f32], weight: &[f32], state: &[f32], tokens: usize) -> Vec<f64> {
    let hist = width - 1;
    let mut full = f64s(state);
    full.extend(f64s(x));
    let mut out = vec![0.0; tokens * ch];
    for t in 0..tokens {
        for c in 0..ch {
            let mut acc = 0.0;
            for j in 0..width {
                acc += weight[c * width + j] as f64 * full[(t + j) * ch + c];
            }
            let _ = hist;
            out[t * ch + c] = silu64(acc);
        }
    }
    out
}

#[test]
fn conv_prefill_matches_naive_and_keeps_last_inputs_as_state() {
    for &(ch, width, tokens) in &[(10usize, 4usize, 7usize), (5, 4, 2), (6, 1, 3), (3, 2, 5), (4, 4, 0)] {
        let mut r = SplitMix64::new(ch as u64 * 31 + width as u64);
        let hist = width - 1;
        let x = rand(&mut r, tokens * ch, -1.0, 1.0);
        let wt = rand(&mut r, ch * width, -1.0, 1.0);
        let st0 = rand(&mut r, hist * ch, -1.0, 1.0);
        let shape = ConvShape { channels: ch, width };
        let mut state = up(&st0);
        let mut out = BE.alloc(tokens * ch).unwrap();
        BE.conv_prefill(shape, tokens, &up(&x), &up(&wt), &mut state, &mut out).unwrap();
        let want = conv64(ch, width, &x, &wt, &st0, tokens);
        let what = format!("conv prefill C={ch} W={width} T={tokens}");
        assert_close(&what, out.as_slice(), &want, 1e-6, 1e-5, |i| coord(&["t", "c"], &[tokens, ch], i));
        let mut all = st0.clone();
        all.extend_from_slice(&x);
        let want_state = f64s(&all[all.len() - hist * ch..]);
        assert_close("conv state", state.as_slice(), &want_state, 0.0, 0.0, |i| coord(&["row", "c"], &[hist, ch], i));
    }
}

#[test]
fn conv_prefill_then_steps_equals_prefill_over_whole_sequence() {
    for &width in &[4usize, 2, 1] {
        let (ch, t_pre, t_dec) = (9, 5, 6);
        let total = t_pre + t_dec;
        let hist = width - 1;
        let mut r = SplitMix64::new(width as u64);
        let x = rand(&mut r, total * ch, -1.0, 1.0);
        let wt = up(&rand(&mut r, ch * width, -1.0, 1.0));
        let st0 = rand(&mut r, hist * ch, -1.0, 1.0);
        let shape = ConvShape { channels: ch, width };

        let mut whole_state = up(&st0);
        let mut whole = BE.alloc(total * ch).unwrap();
        BE.conv_prefill(shape, total, &up(&x), &wt, &mut whole_state, &mut whole).unwrap();

        let mut state = up(&st0);
        let mut pre = BE.alloc(t_pre * ch).unwrap();
        BE.conv_prefill(shape, t_pre, &up(&x[..t_pre * ch]), &wt, &mut state, &mut pre).unwrap();
        let mut got = pre.into_vec();
        for t in t_pre..total {
            let mut o = BE.alloc(ch).unwrap();
            BE.conv_step(shape, 1, &up(&x[t * ch..(t + 1) * ch]), &wt, &mut state, &mut o).unwrap();
            got.extend_from_slice(o.as_slice());
        }
        let what = format!("prefill+steps vs whole prefill, W={width}");
        assert_close(&what, &got, &f64s(whole.as_slice()), 1e-6, 1e-6, |i| coord(&["t", "c"], &[total, ch], i));
        assert_close("conv state after steps", state.as_slice(), &f64s(whole_state.as_slice()), 0.0, 0.0, |i| coord(&["row", "c"], &[hist, ch], i));
    }
}

#[test]
fn conv_step_batches_slots_independently() {
    let (b, ch, width) = (3, 5, 4);
    let hist = width - 1;
    let mut r = SplitMix64::new(8);
    let x = rand(&mut r, b * ch, -1.0, 1.0);
    let wt = rand(&mut r, ch * width, -1.0, 1.0);
    let st = rand(&mut r, b * hist * ch, -1.0, 1.0);
    let shape = ConvShape { channels: ch, width };
    let mut state = up(&st);
    let mut out = BE.alloc(b * ch).unwrap();
    BE.conv_step(shape, b, &up(&x), &up(&wt), &mut state, &mut out).unwrap();
    for s in 0..b {
        let want = conv64(ch, width, &x[s * ch..(s + 1) * ch], &wt, &st[s * hist * ch..(s + 1) * hist * ch], 1);
        let what = format!("conv step slot {s}");
        assert_close(&what, &out.as_slice()[s * ch..(s + 1) * ch], &want, 1e-6, 1e-5, |i| format!("c={i}"));
    }
    let e = BE.conv_step(shape, b + 1, &up(&x), &up(&wt), &mut state, &mut out).unwrap_err();
    assert!(matches!(e, KernelError::ShapeMismatch { op: "conv_step", .. }), "{e}");
}

// ---------------------------------------------------------------- norms

#[test]
fn rms_norm_and_gated_norm_match_naive() {
    let (rows, dim, eps) = (7, 33, 1e-5f32);
    let mut r = SplitMix64::new(4);
    let x = rand(&mut r, rows * dim, -2.0, 2.0);
    let gate = rand(&mut r, rows * dim, -3.0, 3.0);
    let wt = rand(&mut r, dim, 0.5, 1.5);
    let shape = NormShape { rows, dim, eps };
    let mut out = BE.alloc(rows * dim).unwrap();
    BE.rms_norm(shape, &up(&x), &up(&wt), &mut out).unwrap();
    let mut want = vec![0.0; rows * dim];
    let mut want_g = vec![0.0; rows * dim];
    for rr in 0..rows {
        let xr = &x[rr * dim..(rr + 1) * dim];
        let ms = xr.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dim as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        for c in 0..dim {
            want[rr * dim + c] = xr[c] as f64 * inv * wt[c] as f64;
            want_g[rr * dim + c] = want[rr * dim + c] * silu64(gate[rr * dim + c] as f64);
        }
    }
    assert_close("rms_norm", out.as_slice(), &want, 1e-6, 1e-5, |i| coord(&["row", "c"], &[rows, dim], i));
    BE.gated_rms_norm(shape, &up(&x), &up(&gate), &up(&wt), &mut out).unwrap();
    assert_close("gated_rms_norm", out.as_slice(), &want_g, 1e-6, 1e-5, |i| coord(&["row", "c"], &[rows, dim], i));
    let e = BE.rms_norm(shape, &up(&x), &up(&wt[1..]), &mut out).unwrap_err();
    assert!(matches!(e, KernelError::ShapeMismatch { name: "weight", .. }), "{e}");
}
