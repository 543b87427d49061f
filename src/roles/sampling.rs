//! Sampling of generated tokens: greedy by default, or temperature and nucleus
//! (top-p) sampling with a seeded generator.
//!
//! The uniform draw of step `k` of choice `c` of a request with seed `s` is a pure
//! function of `(s, c, k)` (a SplitMix64 hash, not a stream that advances), so a
//! token depends only on the logits of its step and these three numbers, never on
//! which process sampled it, how the batch was composed or what other requests
//! ran. The model's logits are bit for bit those of the colocated single-rank run,
//! so a seeded request gives the same tokens disaggregated and colocated.
//!
//! Where the logits are, the pick is made: the last prefill stage samples token 0
//! from the prompt's last position, decode samples every later token. Both wrap
//! the role's compute in a [`Sampler`], which reads the logits the model records
//! for each step and replaces the model's greedy pick for the requests that asked
//! for sampling.

use crate::engine::compute::LogitTrace;
use crate::model::ranks::Layouts;
use crate::model::regions::RegionView;
use crate::model::{Model, ModelError};
use handoff_components::Topology;
use handoff_components::config::DeviceConfig;
use handoff_systems::dispatch::{Compute, ComputeError, DecodeItem, PrefillJob, PrefillOutput};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// How one choice of a request picks its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    /// 0: greedy (the model's own pick).
    pub temperature: f32,
    /// Nucleus: sample among the most likely tokens whose mass reaches `top_p`.
    pub top_p: f32,
    pub seed: u64,
    /// The choice's index in the response (keys the draws, so `n` choices differ).
    pub choice: u32,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling { temperature: 0.0, top_p: 1.0, seed: 0, choice: 0 }
    }
}

impl Sampling {
    pub fn is_greedy(&self) -> bool {
        // NaN counts as greedy too.
        self.temperature.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
    }
}

/// One SplitMix64 step: the golden-ratio increment, then the shared finalizer.
fn mix(z: u64) -> u64 {
    crate::base::mix(z.wrapping_add(0x9e37_79b9_7f4a_7c15))
}

/// The uniform draw in [0, 1) of step `step` of choice `choice` under `seed`.
pub fn uniform(seed: u64, choice: u32, step: u32) -> f64 {
    let h = mix(mix(mix(seed) ^ u64::from(choice)) ^ u64::from(step));
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

/// A request's sampling as the role holds it while the request is live.
#[derive(Debug, Clone, Copy)]
pub struct Live {
    pub sampling: Sampling,
    /// Prompt tokens: decode's item at position p makes token p + 1 - prompt.
    pub prompt: u64,
}

/// The sampled requests a role holds now, by request id (greedy ones are absent).
pub type SamplingTable = Arc<Mutex<HashMap<u64, Live>>>;

/// The role's compute with the sampled picks: the model records each step's
/// logits, the sampler replaces the greedy pick of every request in its table.
pub struct Sampler {
    inner: Box<dyn Compute>,
    trace: LogitTrace,
    table: SamplingTable,
}

impl Sampler {
    /// The last logits recorded for `request`, forgetting all of them (the model
    /// records every step; nothing may pile up).
    fn take_last(&self, request: u64) -> Option<Vec<f32>> {
        let mut t = self.trace.lock().unwrap_or_else(|p| p.into_inner());
        t.remove(&request).and_then(|mut v| v.pop())
    }
}

impl Sampler {
    /// Replaces the greedy first token of a sampled request by its sampled pick.
    fn sample_first(&self, request: u64, out: &mut PrefillOutput) {
        let logits = self.take_last(request);
        if let Some(first) = out.first_token.as_mut() {
            // The last stage made token 0: this stage is done with the request.
            let live = crate::base::lock(&self.table).remove(&request);
            if let (Some(live), Some(l)) = (live, logits) {
                *first = pick(&l, &live.sampling, 0);
            }
        }
    }
}

impl Compute for Sampler {
    fn prefill(&mut self, job: PrefillJob<'_>) -> Result<PrefillOutput, ComputeError> {
        let request = job.request;
        let mut out = self.inner.prefill(job)?;
        self.sample_first(request, &mut out);
        Ok(out)
    }

    /// The batch goes to the model as one batch (the trait's default would run
    /// it one job at a time), then each first token is sampled.
    fn prefill_batch(&mut self, jobs: Vec<PrefillJob<'_>>) -> Vec<Result<PrefillOutput, ComputeError>> {
        let ids: Vec<u64> = jobs.iter().map(|j| j.request).collect();
        let mut outs = self.inner.prefill_batch(jobs);
        for (id, out) in ids.into_iter().zip(outs.iter_mut()) {
            if let Ok(out) = out {
                self.sample_first(id, out);
            }
        }
        outs
    }

    fn decode(&mut self, batch: &[DecodeItem<'_>]) -> Result<Vec<u8>, ComputeError> {
        let mut picks = self.inner.decode(batch)?;
        let table = crate::base::lock(&self.table);
        for (item, tok) in batch.iter().zip(picks.iter_mut()) {
            let logits = self.take_last(item.request);
            if let (Some(live), Some(l)) = (table.get(&item.request), logits) {
                let step = (item.pos + 1).saturating_sub(live.prompt);
                *tok = pick(&l, &live.sampling, u32::try_from(step).unwrap_or(u32::MAX));
            }
        }
        Ok(picks)
    }
}

/// The role's compute on `dev` (the model over the registered regions, as
/// `device::model_compute` builds it) with the sampler around it.
pub fn sampled_compute(
    dev: DeviceConfig,
    topo: &Topology,
    layouts: Layouts,
    view: Arc<dyn RegionView>,
    table: SamplingTable,
) -> anyhow::Result<Box<dyn Compute>> {
    let trace = LogitTrace::default();
    let sampled = Arc::clone(&table);
    let only: crate::engine::compute::TraceFilter = Arc::new(move |request| crate::base::lock(&sampled).contains_key(&request));
    let inner = crate::engine::device::model_compute(dev, topo, layouts, view, trace.clone(), only)?;
    Ok(Box::new(Sampler { inner, trace, table }))
}

/// The colocated single-rank run of `prompt` with `s`: `max_tokens` tokens, the
/// first from the prompt's last position, each fed back as the next input (the
/// reference a seeded disaggregated run must equal).
pub fn colocated(model: &Model, prompt: &[u8], max_tokens: u32, s: &Sampling) -> Result<Vec<u8>, ModelError> {
    let be = handoff_kernels::CpuBackend::new();
    let group = model.upload_group(&be, 1)?;
    let (req, logits, _) = crate::model::reference::prefill_local(&be, &group, prompt)?;
    let mut caches = crate::model::reference::LocalCaches::new(&group.dims, group.tp(), vec![req]);
    let mut tokens = vec![pick(&logits, s, 0)];
    for step in 1..max_tokens {
        let prev = tokens[tokens.len() - 1];
        let mut out = crate::model::forward::decode_batch(&be, &group, &[prev], &[prompt.len() + step as usize - 1], &mut caches)?;
        let (logits, _) = out.pop().ok_or_else(|| ModelError::Config("decode step returned nothing".into()))?;
        tokens.push(pick(&logits, s, step));
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch reaches the inner compute as one batch through the sampler, and
    /// each sampled request's first token is its sampled pick.
    #[test]
    fn the_sampler_passes_a_prefill_batch_on_whole() {
        struct Inner {
            trace: LogitTrace,
            batches: Arc<Mutex<Vec<usize>>>,
        }
        impl Compute for Inner {
            fn prefill(&mut self, job: PrefillJob<'_>) -> Result<PrefillOutput, ComputeError> {
                let mut v = self.prefill_batch(vec![job]);
                v.pop().unwrap_or(Err(ComputeError::MissingInput { stage: 0, what: "an output" }))
            }
            fn prefill_batch(&mut self, jobs: Vec<PrefillJob<'_>>) -> Vec<Result<PrefillOutput, ComputeError>> {
                self.batches.lock().unwrap().push(jobs.len());
                let logits: Vec<f32> = (0..256).map(|i| ((i * 37) % 101) as f32 / 25.0).collect();
                for j in &jobs {
                    self.trace.lock().unwrap().entry(j.request).or_default().push(logits.clone());
                }
                jobs.iter().map(|_| Ok(PrefillOutput { hidden: Vec::new(), first_token: Some(argmax(&logits)) })).collect()
            }
            fn decode(&mut self, batch: &[DecodeItem<'_>]) -> Result<Vec<u8>, ComputeError> {
                Ok(vec![0; batch.len()])
            }
        }
        let trace = LogitTrace::default();
        let batches = Arc::new(Mutex::new(Vec::new()));
        let table = SamplingTable::default();
        let hot = Sampling { temperature: 5.0, seed: 3, ..Sampling::default() };
        table.lock().unwrap().insert(2, Live { sampling: hot, prompt: 4 });
        let mut s = Sampler { inner: Box::new(Inner { trace: trace.clone(), batches: batches.clone() }), trace: trace.clone(), table: table.clone() };
        let job = |request| PrefillJob { request, stage: 0, tokens: 4, prompt: &[1, 2, 3, 4], hidden: None, leases: Vec::new() };
        let outs: Vec<u8> = s.prefill_batch(vec![job(1), job(2), job(3)]).into_iter().map(|o| o.unwrap().first_token.unwrap()).collect();
        assert_eq!(*batches.lock().unwrap(), vec![3], "one batch of three reached the model");
        let logits: Vec<f32> = (0..256).map(|i| ((i * 37) % 101) as f32 / 25.0).collect();
        assert_eq!(outs, vec![argmax(&logits), pick(&logits, &hot, 0), argmax(&logits)]);
        assert!(table.lock().unwrap().is_empty(), "the sampled request left the table");
        assert!(trace.lock().unwrap().is_empty(), "no logits kept");
    }

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
}
