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

/// One fused decode step figure: B requests at context [`FUSED_CONTEXT`], their
/// KV and state in device regions laid out as a decode instance's.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FusedFigure {
    pub batch: usize,
    /// Wall time of one step (tick upload, graph replay, picks download), the
    /// median of the timed steps.
    pub graph_us: f64,
    /// The same step with the kernels launched one by one (graphs off).
    pub launched_us: f64,
    /// The graph with every kernel but the first launched as a programmatic
    /// dependent of the one before (`[device] dependent_launch = true`); the
    /// same as `graph_us` where the device has no such launches.
    pub graph_dependent_us: f64,
    /// Bytes a step must move at least: the weights once, every request's KDA
    /// state read and written, its MLA rows read.
    pub floor_bytes: u64,
    /// `floor_bytes` over the device copy bandwidth of this run.
    pub floor_us: f64,
    /// One step with every launch timed on its own: (kernel, launches, us).
    pub profile: Vec<(String, usize, f64)>,
}

/// Prompt lengths of the prefill breakdown: a serving prompt of `bench serve`
/// (32 to 127 tokens), a chunk's worth and a long one, so the fixed cost of a
/// prefill shows apart from its per-token cost.
pub const PREFILL_LENS: [usize; 4] = [16, 80, 256, 1024];

/// One prefill figure: the whole model at TP1 over one prompt of `tokens`, as a
/// prefill stage runs it (ReplaySSM tail records included), and each layer's
/// share (the device synchronized after each layer).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrefillFigure {
    pub tokens: usize,
    /// Embedding, every layer and the last position's logits.
    pub total_us: f64,
    /// (layer kind, layers, us in all) in model order of first appearance.
    pub by_kind: Vec<(char, usize, f64)>,
}

/// A prefill stage's batch in the figures: prompts of `bench serve`'s mean
/// length (80 tokens), 32 of them (C32's worth) on a device, 8 on the CPU.
pub const PREFILL_BATCH_TOKENS: usize = 80;

/// The prefill of several prompts as one batched pass against the same prompts
/// one pass each (the whole model at TP1, ReplaySSM tails included).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrefillBatchFigure {
    pub prompts: usize,
    pub tokens: usize,
    pub batched_us: f64,
    pub one_by_one_us: f64,
}

/// Context (cached tokens) of each request of the fused step figures: the
/// PyTorch peer (benches/peers/torch_model.py) steps at the same context.
pub const FUSED_CONTEXT: usize = 192;

/// Rounds in which the fused step's three ways take turns (a multiple of
/// three: each way in each place of the order equally often), and the steps
/// each times a round (after two untimed): 18 samples a way and batch.
const FUSED_ROUNDS: usize = 6;
const FUSED_STEPS_A_ROUND: usize = 3;

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
    /// The prefill at each of [`PREFILL_LENS`] (up to the model's context).
    pub prefills: Vec<PrefillFigure>,
    /// A prefill stage's batch of prompts as one pass and one by one.
    pub prefill_batch: PrefillBatchFigure,
    /// KDA decode step (all KDA heads, batch `kda_batch`): time, state bytes moved,
    /// achieved bandwidth and its fraction of memcpy.
    pub kda_batch: usize,
    pub kda_step_us: f64,
    pub kda_step_bytes: u64,
    pub kda_bytes_per_s: f64,
    pub kda_roofline_fraction: f64,
    /// On a backend with a fused decode step: the step through device regions
    /// at each batch of [`BATCHES`], with graphs and without, against the floor.
    pub fused: Vec<FusedFigure>,
    /// The fused step's description (launches, buckets, weights).
    pub fused_path: String,
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
        for p in &self.prefills {
            let parts: Vec<String> = p.by_kind.iter().map(|(k, n, us)| format!("{k} {us:.0} us/{n}")).collect();
            writeln!(
                f,
                "  prefill {:>5} tokens {:>10.1} us {:>9.0} tokens/s; layers (synchronized one by one): {}",
                p.tokens,
                p.total_us,
                p.tokens as f64 / (p.total_us * 1e-6),
                parts.join(", ")
            )?;
        }
        let pb = &self.prefill_batch;
        let all = (pb.prompts * pb.tokens) as f64;
        if pb.prompts > 0 {
            writeln!(
                f,
                "  prefill batch {} x {} tokens: {:>10.1} us as one pass ({:.0} tokens/s), {:.1} us one by one ({:.0} tokens/s): {:.2}x",
                pb.prompts,
                pb.tokens,
                pb.batched_us,
                all / (pb.batched_us * 1e-6),
                pb.one_by_one_us,
                all / (pb.one_by_one_us * 1e-6),
                pb.one_by_one_us / pb.batched_us
            )?;
        }
        if !self.fused.is_empty() {
            writeln!(f, "  {}", self.fused_path)?;
            for x in &self.fused {
                writeln!(
                    f,
                    "  fused step batch {:>3} at context {FUSED_CONTEXT}: {:>8.1} us (graph) {:>8.1} us (graph, dependent launches) {:>8.1} us (launched) {:>9.0} tokens/s; floor {:>7.1} us ({:.2} GB over copy) = {:.2}x the floor (the default: graph, dependent launches)",
                    x.batch,
                    x.graph_us,
                    x.graph_dependent_us,
                    x.launched_us,
                    x.batch as f64 / (x.graph_dependent_us * 1e-6),
                    x.floor_us,
                    x.floor_bytes as f64 / 1e9,
                    x.graph_dependent_us / x.floor_us
                )?;
                let total: f64 = x.profile.iter().map(|p| p.2).sum();
                let parts: Vec<String> = x.profile.iter().map(|(n, c, us)| format!("{n} {us:.0} us/{c}")).collect();
                writeln!(f, "    kernels one by one ({total:.0} us in all): {}", parts.join(", "))?;
            }
        }
        writeln!(
            f,
            "  KDA decode step {:>9.2} us  batch {} x all heads, {} B of state, {:.2} GB/s = {:.1}% of copy",
            self.kda_step_us,
            self.kda_batch,
            self.kda_step_bytes,
            self.kda_bytes_per_s / 1e9,
            self.kda_roofline_fraction * 100.0
        )?;
        writeln!(
            f,
            "  MLA decode step {:>9.2} us  {} rows, {} B of KV, {:.2} GB/s = {:.1}% of copy",
            self.mla_step_us,
            self.mla_tokens,
            self.mla_step_bytes,
            self.mla_bytes_per_s / 1e9,
            self.mla_roofline_fraction * 100.0
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

/// The prefill of one random prompt of `t` tokens, whole and layer by layer.
fn prefill_figure<B: Backend>(be: &B, topo: &Topology, group: &forward::ShardGroup<B>, g: &mut SplitMix64, t: usize) -> Result<PrefillFigure, ModelError> {
    let prompt: Vec<u8> = (0..t).map(|_| g.below(256) as u8).collect();
    let tail = super::ranks::prefill_record_tail(topo, t);
    let n = group.dims.num_layers();
    let total = best(be, 2, || {
        let mut h = forward::embed(be, group, &prompt)?;
        forward::prefill_layers(be, group, 0..n, &mut h, t, tail, &mut |_, _, _: PrefillCache<'_, B>| Ok(()))?;
        forward::logits_of_last(be, group, &h, t)?;
        Ok(())
    })?;
    let mut by_kind: Vec<(char, usize, f64)> = Vec::new();
    let mut h = forward::embed(be, group, &prompt)?;
    for layer in 0..n {
        be.synchronize()?;
        let t0 = Instant::now();
        forward::prefill_layers(be, group, layer..layer + 1, &mut h, t, tail, &mut |_, _, _: PrefillCache<'_, B>| Ok(()))?;
        be.synchronize()?;
        let us = t0.elapsed().as_secs_f64() * 1e6;
        let kind = match group.dims.layer_kinds[layer] {
            handoff_components::vocab::LayerKind::Kda => 'K',
            handoff_components::vocab::LayerKind::Mla => 'M',
        };
        match by_kind.iter_mut().find(|x| x.0 == kind) {
            Some(x) => {
                x.1 += 1;
                x.2 += us;
            }
            None => by_kind.push((kind, 1, us)),
        }
    }
    Ok(PrefillFigure { tokens: t, total_us: total * 1e6, by_kind })
}

/// `prompts` random prompts of `tokens` prefilled as one batch, best of `reps`
/// passes, and (`one_by_one`) the same prompts one pass each.
fn prefill_batch_figure<B: Backend>(
    be: &B,
    group: &forward::ShardGroup<B>,
    g: &mut SplitMix64,
    (prompts, tokens, reps): (usize, usize, usize),
    one_by_one: bool,
) -> Result<PrefillBatchFigure, ModelError> {
    let dims = &group.dims;
    let n = dims.num_layers();
    let all: Vec<Vec<u8>> = (0..prompts).map(|_| (0..tokens).map(|_| g.below(256) as u8).collect()).collect();
    let seqs = forward::PrefillSeq::packed(&vec![tokens; prompts], |t| dims.record_tail(t));
    let flat = all.concat();
    let batched = best(be, reps, || {
        let mut h = forward::embed(be, group, &flat)?;
        forward::prefill_batch(be, group, 0..n, &mut h, &seqs, &mut |_, _, _, _| Ok(()))?;
        forward::logits_of_lasts(be, group, &h, &seqs)?;
        Ok(())
    })?;
    let alone = if !one_by_one {
        0.0
    } else {
        best(be, reps, || {
            for p in &all {
                let mut h = forward::embed(be, group, p)?;
                forward::prefill_layers(be, group, 0..n, &mut h, tokens, dims.record_tail(tokens), &mut |_, _, _| Ok(()))?;
                forward::logits_of_last(be, group, &h, tokens)?;
            }
            Ok(())
        })?
    };
    Ok(PrefillBatchFigure { prompts, tokens, batched_us: batched * 1e6, one_by_one_us: alone * 1e6 })
}

/// `bench prefill`: `prompts` prompts of `tokens` tokens prefilled as one batch
/// through the whole model at TP1, the best of `reps` passes (after a warm-up);
/// alone, a pass is short enough to run under a kernel profiler.
pub fn bench_prefill<B: Backend>(be: &B, topo: &Topology, prompts: usize, tokens: usize, reps: usize) -> Result<PrefillBatchFigure, ModelError> {
    let model = Model::new(topo)?;
    let group = model.upload_group(be, 1)?;
    prefill_batch_figure(be, &group, &mut SplitMix64::new(13), (prompts.max(1), tokens.max(1), reps), false)
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
fn batched_step<B: Backend>(be: &B, group: &forward::ShardGroup<B>, prompt: &[u8], batch: usize, steps: usize) -> Result<BatchFigure, ModelError> {
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
        forward::prefill_layers(be, &group, 0..n, &mut h, prompt_len, 0, &mut |_, _, _: PrefillCache<'_, B>| Ok(()))?;
        forward::logits_of_last(be, &group, &h, prompt_len)?;
        Ok(())
    })?;
    let total = {
        let t0 = Instant::now();
        run_colocated_on(be, &group, &prompt, steps)?;
        t0.elapsed().as_secs_f64()
    };
    let decode_s = (total - prefill_s).max(1e-9);
    let prefills = PREFILL_LENS.iter().map(|&t| prefill_figure(be, topo, &group, &mut g, t)).collect::<Result<Vec<_>, _>>()?;
    let prefill_batch = prefill_batch_figure(be, &group, &mut g, (if be.name() == "cpu" { 8 } else { 32 }, PREFILL_BATCH_TOKENS, 2), true)?;

    // Past the caches: 64 MiB on the CPU (20x its L3 here), 1 GiB on a device.
    let bw = copy_bandwidth(be, if be.name() == "cpu" { 64 << 20 } else { 1 << 30 })?;
    let (fused, fused_path) = fused_figures(be, topo, &model, bw)?;
    // The generic pass's batched steps (host caches) where no fused step runs.
    let batched = if fused.is_empty() {
        let batch_prompt: Vec<u8> = (0..BATCH_PROMPT).map(|_| g.below(256) as u8).collect();
        BATCHES.iter().map(|&b| batched_step(be, &group, &batch_prompt, b, 4)).collect::<Result<Vec<_>, _>>()?
    } else {
        Vec::new()
    };

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
        prefills,
        prefill_batch,
        fused,
        fused_path,
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

/// The fused decode step's figures at each batch of [`BATCHES`]: the decode
/// ranks' regions laid out as a decode instance lays them out
/// (`placement::place_rank`) in the backend's device memory, filled with
/// finite values, every request at [`FUSED_CONTEXT`]; the step timed with
/// graphs and with plain launches. Empty on a backend without a fused step.
fn fused_figures<B: Backend>(be: &B, topo: &Topology, model: &Model, bw: f64) -> Result<(Vec<FusedFigure>, String), ModelError> {
    use super::regions::DeviceRegions;
    use handoff_components::vocab::{DecodeRank, RankId, RegionKind};
    let Ok(mem) = be.device_memory() else { return Ok((Vec::new(), String::new())) };
    let bmax = *BATCHES.iter().max().unwrap_or(&1);
    let steps = FUSED_STEPS_A_ROUND;
    let mut t = topo.clone();
    t.config.serve.max_requests = t.config.serve.max_requests.max(bmax as u32);
    t.config.serve.max_batch = Some(bmax as u32);
    t.config.serve.max_context = t.config.serve.max_context.max((FUSED_CONTEXT + 4 * steps + 4) as u32);
    let d = t.decode();
    let (tp, dcp, bs) = (d.tp as usize, d.dcp as usize, d.block_size as usize);
    let local = (t.config.serve.max_context as usize).div_ceil(dcp) + bs;
    let per_req = local.div_ceil(bs);
    let blocks = (bmax * per_req) as u32;
    let mut layouts = super::ranks::Layouts::new();
    for r in 0..tp {
        let id = RankId::Decode(DecodeRank { tp: r as u32 });
        for l in handoff_systems::placement::place_rank(&t, id, blocks, bmax as u32).regions {
            layouts.insert((id, l.kind), l);
        }
    }
    let sizes: Vec<_> = layouts.iter().map(|(k, l)| (*k, l.len)).collect();
    let regions = DeviceRegions::alloc(mem, &sizes)?;
    // Finite contents of the right dtype: small states, unit-scale rows, cursors mid-ring.
    let mut g = SplitMix64::new(5);
    let dt = model.dims.dtype;
    let cap = model.dims.replay.unwrap_or(0);
    for ((id, kind), l) in &layouts {
        let n = l.len as usize;
        let bytes: Vec<u8> = match kind {
            RegionKind::ReplayCursor => (0..n / 4).flat_map(|_| ((cap / 2) as i32).to_le_bytes()).collect(),
            RegionKind::KdaState | RegionKind::ReplayRecords => g.vec_normal(n / 4, 0.05).iter().flat_map(|x| x.to_le_bytes()).collect(),
            _ => {
                let e = dt.bytes() as usize;
                let mut out = vec![0u8; n];
                for (i, v) in g.vec_normal(n / e, 1.0).into_iter().enumerate() {
                    super::dtype::encode(dt, &[v], &mut out[i * e..(i + 1) * e]);
                }
                out
            }
        };
        regions.write_all(*id, *kind, &bytes)?;
    }
    let mut step = super::step::open(be, &t, model, &layouts, &regions).map_err(|e| ModelError::Config(e.to_string()))?;
    let path = step.describe();
    let dims = &model.dims;
    let kda_layers = dims.layer_kinds.iter().filter(|k| **k == handoff_components::vocab::LayerKind::Kda).count();
    let mla_layers = dims.num_layers() - kda_layers;
    let state = (dims.kda_heads * dims.dk * dims.dv * 4 * kda_layers) as u64;
    let rows = (FUSED_CONTEXT as u64) * (dims.row_width() as u64 * dt.bytes()) * mla_layers as u64;
    let weights = dims.weight_bytes() as u64 / 4 * dims.weight_dtype.planes() as u64 * 2;
    let mut out = Vec::new();
    for &b in BATCHES.iter() {
        let slots: Vec<Vec<u32>> = (0..b).map(|i| vec![i as u32; tp]).collect();
        let tables: Vec<Vec<u32>> = (0..b).map(|i| ((i * per_req) as u32..((i + 1) * per_req) as u32).collect()).collect();
        let rank_tables: Vec<Vec<&[u32]>> = (0..b).map(|i| vec![tables[i].as_slice(); tp]).collect();
        // The three ways (graphs; graphs with dependent launches; plain
        // launches) take turns, FUSED_ROUNDS rounds of a few steps each, the
        // order rotated every round so that each goes first, second and
        // third equally often, and each reports the median of its steps:
        // timed one after the other, the order moved B = 88 by more than the
        // difference between the ways (an H100: dependent launches timed
        // first 4.6% slower in session 22, timed second 5% faster in
        // session 24, 2.5% faster in turns).
        let ways = [(true, false), (true, true), (false, false)];
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); ways.len()];
        for round in 0..FUSED_ROUNDS {
            for k in 0..ways.len() {
                let w = (k + round) % ways.len();
                let (graphs, dependent) = ways[w];
                step.set_graphs(graphs);
                step.set_dependent_launch(dependent);
                for s in 0..steps + 2 {
                    let reqs: Vec<_> = (0..b)
                        .map(|i| handoff_kernels::step::StepRequest {
                            token: (i % 256) as u32,
                            pos: (FUSED_CONTEXT + s) as u64,
                            slots: &slots[i],
                            blocks: &rank_tables[i],
                        })
                        .collect();
                    let t0 = Instant::now();
                    step.run(&reqs, None)?;
                    if s >= 2 {
                        samples[w].push(t0.elapsed().as_secs_f64());
                    }
                }
            }
        }
        let [graph_us, graph_dependent_us, launched_us] = [0, 1, 2].map(|w| {
            let v = &mut samples[w];
            v.sort_by(f64::total_cmp);
            v[v.len() / 2] * 1e6
        });
        let floor_bytes = weights + b as u64 * (2 * state + rows);
        let reqs: Vec<_> = (0..b)
            .map(|i| handoff_kernels::step::StepRequest { token: (i % 256) as u32, pos: FUSED_CONTEXT as u64, slots: &slots[i], blocks: &rank_tables[i] })
            .collect();
        let profile = step.profile(&reqs)?.into_iter().map(|k| (k.name.to_string(), k.launches, k.us)).collect();
        out.push(FusedFigure { batch: b, graph_us, launched_us, graph_dependent_us, floor_bytes, floor_us: floor_bytes as f64 / bw * 1e6, profile });
    }
    step.set_graphs(true);
    step.set_dependent_launch(false);
    Ok((out, path))
}
