//! The sampling rule the dispatch phase applies: greedy by default, or
//! temperature and nucleus (top-p) sampling with a seeded draw.
//!
//! The uniform draw of step `k` of choice `c` of a request with seed `s` is a pure
//! function of `(s, c, k)` (a SplitMix64 hash, not a stream that advances), so a
//! token depends only on the logits of its step and these three numbers, never on
//! which process sampled it, how the batch was composed or what other requests
//! ran. The model's logits are bit for bit those of the colocated single-rank run,
//! so a seeded request gives the same tokens disaggregated and colocated.

use handoff_components::sampling::{Sampling, mix};

/// One SplitMix64 step: the golden-ratio increment, then the shared finalizer.
fn step_mix(z: u64) -> u64 {
    mix(z.wrapping_add(0x9e37_79b9_7f4a_7c15))
}

/// The uniform draw in [0, 1) of step `step` of choice `choice` under `seed`.
pub fn uniform(seed: u64, choice: u32, step: u32) -> f64 {
    let h = step_mix(step_mix(step_mix(seed) ^ u64::from(choice)) ^ u64::from(step));
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// The greedy pick: the first index of the largest logit (NaN never wins).
pub fn argmax(logits: &[f32]) -> u8 {
    let mut best = 0usize;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] || logits[best].is_nan() && !x.is_nan() {
            best = i;
        }
    }
    best.min(255) as u8
}

/// The token of step `step` for `s`, from that step's logits over the byte-level
/// vocabulary. Greedy when `s.temperature` is 0; otherwise softmax(logits / T) in
/// f64, cut to the smallest set of most likely tokens whose mass reaches top_p
/// (ties broken by the lower token id), and one draw from it.
pub fn pick(logits: &[f32], s: &Sampling, step: u32) -> u8 {
    if s.is_greedy() || logits.is_empty() {
        return argmax(logits);
    }
    let logits = &logits[..logits.len().min(256)];
    let t = f64::from(s.temperature);
    let max = logits.iter().copied().filter(|x| x.is_finite()).fold(f64::NEG_INFINITY, |m, x| m.max(f64::from(x)));
    if !max.is_finite() {
        return argmax(logits);
    }
    let mut w: Vec<(f64, usize)> = logits.iter().enumerate().map(|(i, &x)| (if x.is_finite() { ((f64::from(x) - max) / t).exp() } else { 0.0 }, i)).collect();
    w.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let total: f64 = w.iter().map(|x| x.0).sum();
    let top_p = f64::from(s.top_p).clamp(0.0, 1.0);
    let mut kept = 0;
    let mut mass = 0.0;
    for &(p, _) in &w {
        kept += 1;
        mass += p;
        if mass >= top_p * total {
            break;
        }
    }
    let w = &w[..kept.max(1)];
    let target = uniform(s.seed, s.choice, step) * w.iter().map(|x| x.0).sum::<f64>();
    let mut acc = 0.0;
    for &(p, i) in w {
        acc += p;
        if target < acc {
            return i as u8;
        }
    }
    w[w.len() - 1].1 as u8
}

/// The token a request keeps at step `step`: the model's greedy pick, or the
/// sampled pick from the step's logits when the request samples (and the
/// compute returned them).
pub fn choose(greedy: u8, sampling: Option<&Sampling>, logits: Option<&[f32]>, step: u32) -> u8 {
    match (sampling, logits) {
        (Some(s), Some(l)) => pick(l, s, step),
        _ => greedy,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Greedy is the argmax; a temperature near 0 is the argmax too; the same
    /// (seed, choice, step) gives the same token, and other choices or seeds
    /// spread over the vocabulary.
    #[test]
    fn sampling_is_a_pure_function_of_logits_seed_choice_and_step() {
        let logits: Vec<f32> = (0..256).map(|i| ((i * 37) % 101) as f32 / 25.0).collect();
        let greedy = Sampling::default();
        assert_eq!(pick(&logits, &greedy, 3), argmax(&logits));
        let cold = Sampling { temperature: 1e-4, ..greedy };
        assert_eq!(pick(&logits, &cold, 3), argmax(&logits));
        let hot = Sampling { temperature: 1.5, top_p: 1.0, seed: 42, choice: 0 };
        assert_eq!(pick(&logits, &hot, 7), pick(&logits, &hot, 7));
        let mut seen = std::collections::BTreeSet::new();
        for step in 0..200 {
            seen.insert(pick(&logits, &hot, step));
        }
        assert!(seen.len() > 20, "a hot sampler should spread: {seen:?}");
        // top_p small enough keeps only the most likely token.
        let narrow = Sampling { top_p: 1e-9, ..hot };
        for step in 0..50 {
            assert_eq!(pick(&logits, &narrow, step), argmax(&logits));
        }
        assert_ne!(
            (0..16).map(|k| pick(&logits, &hot, k)).collect::<Vec<_>>(),
            (0..16).map(|k| pick(&logits, &Sampling { choice: 1, ..hot }, k)).collect::<Vec<_>>()
        );
    }

    /// Draws are uniform enough: the mean of many is near 1/2, none leaves [0, 1).
    #[test]
    fn uniform_draws_stay_in_the_unit_interval() {
        let xs: Vec<f64> = (0..10_000).map(|k| uniform(7, 0, k)).collect();
        assert!(xs.iter().all(|&x| (0.0..1.0).contains(&x)));
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
    }

    /// The draws are pinned: a change to the hash would change every seeded
    /// request's tokens (these are the draws of the sampler as it was first written).
    #[test]
    fn the_draws_are_pinned() {
        let got: Vec<u64> = (0..4).map(|k| (uniform(42, 0, k) * 1e6) as u64).collect();
        assert_eq!(got, PINNED);
    }
    const PINNED: [u64; 4] = [386_974, 712_935, 865_830, 169_887];
}
