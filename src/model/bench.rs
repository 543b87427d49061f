//! Throughput of the small model on a backend (the CLI runs it on the CPU), of the
//! batched decode step at several batch sizes, and of the two decode kernels
//! against a memory roofline measured in the same run. Reports only; asserts
//! nothing.
//!
//! Batched decode: B requests, each after a prompt of [`BATCH_PROMPT`] tokens
//! (one prefill, its caches cloned B times: the step's cost does not depend on
//! the prompt's contents), step [`forward::decode_batch`] together through the
//! colocated reference's host caches ([`LocalCaches`]), so a step includes the
//! gather and scatter of the batch's caches, as a decode instance's does.
//!
//! Roofline: a decode step must at least read and write each KDA state once
//! (2 x H x Dk x Dv x 4 bytes per layer) and read every cached MLA row once
//! ((L+R) x e bytes per token per layer); divided by the memcpy bandwidth measured
//! here on a buffer of the same order as those bytes, that is the lower bound on the
//! step's time.

use super::ModelError;
use super::forward::{self, PrefillCache};
use super::reference::{LocalCaches, prefill_local, run_colocated_on};
use super::weights::Model;
use handoff_components::Topology;
use handoff_kernels::{Backend, KdaInputs, KdaParams, KdaStepShape, MlaShape, RowSet, SplitMix64};
use std::time::Instant;

/// Prompt tokens of each request of the batched decode figures.
pub const BATCH_PROMPT: usize = 128;
/// Batch sizes of the batched decode figures (88: the flagship's in-flight count).
pub const BATCHES: [usize; 4] = [1, 8, 32, 88];

/// One batched decode figure: B requests stepping together.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchFigure {
    pub batch: usize,
    /// Mean time of one `decode_batch` step over the batch.
    pub step_us: f64,
    /// Generated tokens per second: batch / step time.
    pub tokens_per_s: f64,
}

/// The figures of one `bench_compute` run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ComputeFigures {
    pub prompt_tokens: usize,
    pub steps: u32,
    pub threads: usize,
    /// Whole model at TP1, colocated: prompt tokens per second of prefill.
    pub prefill_tokens_per_s: f64,
    /// Whole model at TP1: generated tokens per second (batch 1).
    pub decode_tokens_per_s: f64,
    /// Whole model at TP1: one batched decode step per batch size of [`BATCHES`],
    /// each request after a prompt of `batch_prompt_tokens`.
    pub batch_prompt_tokens: usize,
    pub batched: Vec<BatchFigure>,
    /// memcpy bandwidth measured in this run, bytes/s.
    pub memcpy_bytes_per_s: f64,
    /// KDA decode step (all KDA heads, batch `kda_batch`): time, state bytes moved,
    /// achieved bandwidth and its fraction of memcpy.
    pub kda_batch: usize,
    pub kda_step_us: f64,
    pub kda_step_bytes: u64,
    pub kda_bytes_per_s: f64,
    pub kda_roofline_fraction: f64,
    /// MLA decode (all heads, one query) over `mla_tokens` cached rows.
    pub mla_tokens: usize,
    pub mla_step_us: f64,
    pub mla_step_bytes: u64,
    pub mla_bytes_per_s: f64,
    pub mla_roofline_fraction: f64,
}

impl std::fmt::Display for ComputeFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "compute bench ({} rayon threads), prompt {} tokens, {} decode steps", self.threads, self.prompt_tokens, self.steps)?;
        writeln!(f, "  model prefill   {:>12.0} tokens/s", self.prefill_tokens_per_s)?;
        writeln!(f, "  model decode    {:>12.1} tokens/s (batch 1, {} steps after the prompt)", self.decode_tokens_per_s, self.steps)?;
        for b in &self.batched {
            writeln!(
                f,
                "  decode batch {:>3} {:>9.1} us/step {:>10.1} tokens/s (prompts of {} tokens)",
                b.batch, b.step_us, b.tokens_per_s, self.batch_prompt_tokens
            )?;
        }
        writeln!(f, "  copy            {:>12.2} GB/s (roofline: the backend's own copy, read + write)", self.memcpy_bytes_per_s / 1e9)?;
        writeln!(
            f,
            "  KDA decode step {:>9.2} us  batch {} x all heads, {} B of state, {:.2} GB/s = {:.1}% of copy",
            self.kda_step_us, self.kda_batch, self.kda_step_bytes, self.kda_bytes_per_s / 1e9, self.kda_roofline_fraction * 100.0
        )?;
        writeln!(
            f,
            "  MLA decode step {:>9.2} us  {} rows, {} B of KV, {:.2} GB/s = {:.1}% of copy",
            self.mla_step_us, self.mla_tokens, self.mla_step_bytes, self.mla_bytes_per_s / 1e9, self.mla_roofline_fraction * 100.0
        )
    }
}

/// Best time of `reps` runs of `f` on `be`, in seconds, after one warm-up. Each
/// run ends with [`Backend::synchronize`], so a device's queued work is inside
/// the time.
fn best<B: Backend, F: FnMut() -> Result<(), ModelError>>(be: &B, reps: usize, mut f: F) -> Result<f64, ModelError> {
    f()?;
    be.synchronize()?;
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        f()?;
        be.synchronize()?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// The backend's own copy bandwidth over `bytes` (bytes read plus bytes
/// written): host memcpy on the CPU, a device-to-device copy on a GPU. The
/// kernels' state and KV traffic is quoted against it.
fn copy_bandwidth<B: Backend>(be: &B, bytes: usize) -> Result<f64, ModelError> {
    let n = (bytes / 4).max(1);
    let src = be.upload(&vec![1.0f32; n])?;
    let mut dst = be.alloc(n)?;
    let t = best(be, 5, || Ok(be.copy(&src, 0, &mut dst, 0, n)?))?;
    Ok(2.0 * (n * 4) as f64 / t)
}

/// Mean time of a batched decode step of `batch` requests, each after `prompt`.
fn batched_step<B: Backend>(
    be: &B,
    group: &forward::ShardGroup<B>,
    prompt: &[u8],
    batch: usize,
    steps: usize,
) -> Result<BatchFigure, ModelError> {
    let (req, _, first) = prefill_local(be, group, prompt)?;
    let mut caches = LocalCaches::new(&group.dims, group.tp(), vec![req; batch]);
    let mut tokens = vec![first; batch];
    let mut pos = prompt.len();
    let mut step = |tokens: &mut Vec<u8>, pos: &mut usize| -> Result<(), ModelError> {
        let out = forward::decode_batch(be, group, tokens, &vec![*pos; batch], &mut caches)?;
        *tokens = out.into_iter().map(|(_, t)| t).collect();
        *pos += 1;
        Ok(())
    };
    step(&mut tokens, &mut pos)?;
    let steps = steps.max(1);
    let t0 = Instant::now();
    for _ in 0..steps {
        step(&mut tokens, &mut pos)?;
    }
    let s = t0.elapsed().as_secs_f64() / steps as f64;
    Ok(BatchFigure { batch, step_us: s * 1e6, tokens_per_s: batch as f64 / s })
}

/// Prefill and decode throughput of the topology's model (colocated, TP1) on
/// `be`, the batched decode step at the batch sizes of [`BATCHES`], and the KDA /
/// MLA decode kernels against the memcpy roofline.
pub fn bench_compute<B: Backend>(be: &B, topo: &Topology, prompt_len: usize, steps: u32) -> Result<ComputeFigures, ModelError> {
    let model = Model::new(topo)?;
    let dims = model.dims.clone();
    let prompt_len = prompt_len.max(1);
    let mut g = SplitMix64::new(11);
    let prompt: Vec<u8> = (0..prompt_len).map(|_| g.below(256) as u8).collect();
    let group = model.upload_group(be, 1)?;
    let n = dims.num_layers();

    let prefill_s = best(be, 2, || {
        let mut h = forward::embed(be, &group, &prompt)?;
        forward::prefill_layers(be, &group, 0..n, &mut h, prompt_len, 0, &mut |_, _, _: PrefillCache<'_>| Ok(()))?;
        forward::logits_of_last(be, &group, &h, prompt_len)?;
        Ok(())
    })?;
    let total = {
        let t0 = Instant::now();
        run_colocated_on(be, &group, &prompt, steps)?;
        t0.elapsed().as_secs_f64()
    };
    let decode_s = (total - prefill_s).max(1e-9);

    let batch_prompt: Vec<u8> = (0..BATCH_PROMPT).map(|_| g.below(256) as u8).collect();
    let batched = BATCHES.iter().map(|&b| batched_step(be, &group, &batch_prompt, b, 4)).collect::<Result<Vec<_>, _>>()?;

    // KDA decode kernel: a batch large enough that the state outgrows the caches.
    let (h, dk, dv) = (dims.kda_heads, dims.dk, dims.dv);
    let state_bytes = h * dk * dv * 4;
    let batch = ((64usize << 20) / state_bytes.max(1)).clamp(1, 4096);
    let mut state = be.upload(&g.vec_normal(batch * h * dk * dv, 0.1))?;
    let q = be.upload(&g.vec_normal(batch * h * dk, 1.0))?;
    let k = be.upload(&g.vec_normal(batch * h * dk, 1.0))?;
    let v = be.upload(&g.vec_normal(batch * h * dv, 1.0))?;
    let gr = be.upload(&g.vec_normal(batch * h * dk, 1.0))?;
    let br = be.upload(&g.vec_normal(batch * h, 1.0))?;
    let a_log = be.upload(&vec![-0.5; h])?;
    let dt_bias = be.upload(&vec![-2.0; h * dk])?;
    let mut out = be.alloc(batch * h * dv)?;
    let kda_s = best(be, 5, || {
        be.kda_step(
            KdaStepShape { batch, heads: h, dk, dv },
            &mut state,
            KdaInputs { q: &q, k: &k, v: &v, g_raw: &gr, b_raw: &br },
            KdaParams { a_log: &a_log, dt_bias: &dt_bias },
            &mut out,
            None,
        )?;
        Ok(())
    })?;
    let kda_bytes = (2 * batch * state_bytes) as u64;

    // MLA decode kernel: all heads, one query, rows of f32 (the kernel's storage).
    let w = dims.row_width();
    let mla_tokens = ((64usize << 20) / (w * 4).max(1)).clamp(1, 1 << 20);
    let rows = be.upload(&g.vec_normal(mla_tokens * w, 1.0))?;
    let ql = be.upload(&g.vec_normal(dims.mla_heads * w, 1.0))?;
    let shape = MlaShape { heads: dims.mla_heads, kv_lora_rank: dims.kv_lora_rank, rope_dim: dims.rope_dim, scale: dims.mla_scale() };
    let mut o = be.alloc(dims.mla_heads * dims.kv_lora_rank)?;
    let mut lse = be.alloc(dims.mla_heads)?;
    let mla_s = best(be, 5, || {
        be.mla_decode(shape, &ql, RowSet { buf: &rows, count: mla_tokens }, &mut o, &mut lse)?;
        Ok(())
    })?;
    let mla_bytes = (mla_tokens * w * 4) as u64;

    // Past the caches: 64 MiB on the CPU (20x its L3 here), 1 GiB on a device.
    let bw = copy_bandwidth(be, if be.name() == "cpu" { 64 << 20 } else { 1 << 30 })?;
    let kda_bw = kda_bytes as f64 / kda_s;
    let mla_bw = mla_bytes as f64 / mla_s;
    Ok(ComputeFigures {
        prompt_tokens: prompt_len,
        steps,
        threads: rayon::current_num_threads(),
        prefill_tokens_per_s: prompt_len as f64 / prefill_s,
        decode_tokens_per_s: steps as f64 / decode_s,
        batch_prompt_tokens: BATCH_PROMPT,
        batched,
        memcpy_bytes_per_s: bw,
        kda_batch: batch,
        kda_step_us: kda_s * 1e6,
        kda_step_bytes: kda_bytes,
        kda_bytes_per_s: kda_bw,
        kda_roofline_fraction: kda_bw / bw,
        mla_tokens,
        mla_step_us: mla_s * 1e6,
        mla_step_bytes: mla_bytes,
        mla_bytes_per_s: mla_bw,
        mla_roofline_fraction: mla_bw / bw,
    })
}
