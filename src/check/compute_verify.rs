//! `handoff verify --compute`: the invariant that disaggregated P/D decode computes
//! what a colocated single-rank run computes.
//!
//! The disaggregated path goes through the engine and the same [`ModelCompute`] the
//! role processes run: the requests are placed and split, the dispatch phase runs
//! each PP stage's TP ranks over their layers, writing their caches into their own
//! producer regions, the plans run as byte copies (the oracle's counting copy), the
//! tickets complete, and the dispatch phase decodes every request together as one
//! batch on the TP x DCP ranks, from their decode regions only. Each request is
//! compared with its own colocated run. Greedy tokens must be equal at every step and the logits within
//! [`LOGIT_TOLERANCE`]: relative error of a step = max |a - b| / max |b| over the
//! vocabulary (b the reference), the report keeps the largest over all steps.
//!
//! Both paths run the same decode algorithm: MLA attention as f64 partials per DCP
//! rank merged in f64 (the colocated run is a DCP group of one), and ReplaySSM with
//! the same ring and commit schedule when `[model.replay]` is configured. So the
//! result holds for 16-bit caches too: in practice the logits are equal exactly,
//! whatever the PP, TP, DCP and interleave. Models whose f32 weights exceed
//! [`crate::model::weights::MAX_WEIGHT_BYTES`] are refused up front, naming the size.

use crate::check::CheckError;
use crate::check::oracle::{self, Memory};
use crate::engine::compute::{LogitTrace, ModelCompute, layouts_of};
use crate::engine::{Engine, QueueMover};
use crate::model::reference::{LocalCaches, LocalRequest};
use crate::model::regions::{DeviceRegions, RegionView};
use crate::model::{Model, Trace, run_colocated};
use handoff_components::Topology;
use handoff_components::ecs::{EngineEvent, Inputs, Submit};
use handoff_components::plan::Plan;
use handoff_components::vocab::RankId;
use handoff_components::vocab::RegionKind;
use handoff_kernels::{Backend, Copy2d, CpuBackend};
use handoff_systems::dispatch::{Compute, ComputeError, DecodeItem, DecodeOutput, PrefillJob, PrefillOutput};
use handoff_systems::placement::Capacity;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Largest relative logit error accepted between the disaggregated run and the
/// colocated run on the same backend.
pub const LOGIT_TOLERANCE: f32 = 1e-4;

/// Largest relative logit error accepted between a device backend's run and the
/// CPU reference, for f32 caches: the device's kernels sum in other orders
/// (tree reductions over a block, the device's exp), so the two agree to f32
/// rounding grown over the model's depth and the decode steps, not bit for bit.
/// Greedy tokens must still be equal.
pub const DEVICE_TOLERANCE: f32 = 2e-3;

/// [`DEVICE_TOLERANCE`] for 16-bit caches: there a last-bit difference in an f32
/// value can round a stored bf16 row to the neighbouring value (a relative step
/// of 2^-8), and the step feeds every later token; seen on the H200: 2.5e-3 and
/// 4.2e-3 over 32 steps of the shipped bf16 configs. Four bf16 steps.
pub const DEVICE_TOLERANCE_16BIT: f32 = 1.6e-2;

/// Decode steps over which a device run must also agree with the free-running
/// CPU reference (besides the per-step check of every step).
pub const FREE_RUNNING_STEPS: usize = 4;

/// The device tolerance for `topo`'s cache dtype.
pub fn device_tolerance(topo: &Topology) -> f32 {
    match topo.model().dtype {
        handoff_components::vocab::Dtype::F32 => DEVICE_TOLERANCE,
        _ => DEVICE_TOLERANCE_16BIT,
    }
}

/// What a passing compute verification saw.
#[derive(Debug, Clone, Default)]
pub struct ComputeReport {
    /// Requests decoded together as one batch.
    pub requests: u32,
    pub prompt_tokens: usize,
    pub steps: u32,
    /// The greedy tokens both paths produced (prefill's pick, then one per step).
    pub tokens: Vec<u8>,
    /// Largest relative logit error over all steps, and the step where it occurred
    /// (0 = prefill's logits).
    pub max_rel_err: f32,
    pub worst_step: usize,
    pub descriptors: u64,
    pub bytes_transferred: u64,
    pub bytes_by_kind: BTreeMap<RegionKind, u64>,
    /// The backend the disaggregated run computed on ("cpu", "cuda", "hip").
    pub backend: &'static str,
    /// On a device backend: the largest relative logit error of the per-step
    /// check against the CPU (each step re-run on the CPU from the device's
    /// caches and token; limit [`device_tolerance`]); 0 on the CPU, where the
    /// reference is the colocated run itself.
    pub device_rel_err: f32,
    /// On a device backend: (request, step) where the CPU's top two logits were
    /// within the device tolerance and the device picked the runner-up.
    pub near_ties: Vec<(u32, usize)>,
    /// Every logit of the disaggregated run equal bit for bit to the colocated
    /// run on the same backend.
    pub bit_equal: bool,
    /// How decode ran: the fused step's description or why the generic pass ran.
    pub decode_path: String,
    /// The same for the colocated run on a device.
    pub colocated_decode_path: String,
    /// Where the regions lived: "host memory" or the device's label.
    pub regions: String,
    /// On a device backend: the per-step check's largest relative error at
    /// each step (0 = prefill), over the requests.
    pub device_steps: Vec<f32>,
    /// On a device backend: the largest relative error of the free-running
    /// comparison with the CPU reference (compounding; for information).
    pub free_running_err: f32,
}

/// Relative error of one logit vector: max |a - b| / max |b|. NaN anywhere gives infinity.
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
    let mut worst = 0.0f32;
    for (a, b) in got.iter().zip(want) {
        let e = (a - b).abs() / scale;
        if e.is_nan() {
            return f32::INFINITY;
        }
        worst = worst.max(e);
    }
    if got.len() != want.len() { f32::INFINITY } else { worst }
}

/// What registered memory holds before anything is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fill {
    /// The oracle's per-region canary: a byte nobody wrote decodes as garbage.
    #[default]
    Canary,
    /// Zeros: a state that was never transferred reads as a zero state (the quiet
    /// failure a public engine shipped).
    Zeros,
}

/// Runs `prompt` and `steps` decode steps colocated and disaggregated and compares.
/// `tamper` may edit the plans before they run (negative tests drop descriptors).
pub fn verify_compute(topo: &Topology, prompt: &[u8], steps: u32, tamper: impl FnMut(&mut Vec<Plan>)) -> Result<ComputeReport, CheckError> {
    verify_compute_with(topo, &[prompt.to_vec()], steps, Fill::Canary, tamper)
}

/// The prompts `verify --compute --requests R` runs together: `prompt`, then
/// shorter prefixes of it, so the decode batch mixes lengths.
pub fn batch_prompts(prompt: &[u8], requests: u32) -> Vec<Vec<u8>> {
    (0..requests.max(1) as usize).map(|i| prompt[..prompt.len().saturating_sub(i * 3).max(1)].to_vec()).collect()
}

/// [`verify_compute`] for several prompts at once (decoded as one batch), with a
/// choice of what unwritten memory holds. The report is the worst over them.
pub fn verify_compute_with(
    topo: &Topology,
    prompts: &[Vec<u8>],
    steps: u32,
    fill: Fill,
    tamper: impl FnMut(&mut Vec<Plan>),
) -> Result<ComputeReport, CheckError> {
    verify_compute_on(topo, prompts, steps, fill, CpuBackend::new(), tamper)
}

/// [`verify_compute_with`] with the disaggregated run on `be`. On a device
/// backend it checks two things: the disaggregated run against a colocated run
/// on the same device (within [`LOGIT_TOLERANCE`], tokens equal), and against
/// the CPU reference (within [`DEVICE_TOLERANCE`], tokens equal).
pub fn verify_compute_on<B: Backend + Clone + 'static>(
    topo: &Topology,
    prompts: &[Vec<u8>],
    steps: u32,
    fill: Fill,
    be: B,
    tamper: impl FnMut(&mut Vec<Plan>),
) -> Result<ComputeReport, CheckError> {
    if prompts.is_empty() || prompts.iter().any(|p| p.is_empty()) {
        return Err(CheckError::Input("empty prompt".into()));
    }
    // Refuses models whose weights exceed the CPU path's limit, naming the size.
    let model = Model::new(topo).map_err(|e| CheckError::model("the model", e))?;
    let mut references = Vec::new();
    for p in prompts {
        references.push(run_colocated(&model, p, steps).map_err(|e| CheckError::model("colocated reference", e))?);
    }
    let backend = be.name();
    let on_device = backend != CpuBackend::new().name();
    // On a device, the colocated run is the same engine at PP1 x TP1 -> TP1 x
    // DCP1 on the same backend, its regions in device memory too, with CUDA
    // graphs off: the disaggregated run (graphs as the topology says) must
    // equal it, so a replayed step equals a launched one as well. Its caches
    // are snapshotted before every decode step for the per-step CPU check.
    let mut colocated_here = Vec::new();
    let mut colocated_path = String::new();
    let probes: Probes = Arc::default();
    if on_device {
        let mut colo = colocated_topology(topo)?;
        colo.config.device.graphs = false;
        colo.config.device.dependent_launch = false;
        let (runs, rep) = run_probed(&colo, prompts, &[], steps, Fill::Zeros, be.clone(), |_| {}, Some(probes.clone()))
            .map_err(|e| e.within(format!("colocated run on {backend}")))?;
        colocated_here = runs;
        colocated_path = rep.decode_path;
    }
    let (got, mut report) = run_disaggregated(topo, prompts, &[], steps, fill, be, tamper)?;
    report.backend = backend;
    report.colocated_decode_path = colocated_path;
    let same_backend = if on_device { &colocated_here } else { &references };
    report.bit_equal = true;
    for (i, (want, got)) in same_backend.iter().zip(&got).enumerate() {
        let mut worst = (report.max_rel_err, report.worst_step);
        compare(want, got, LOGIT_TOLERANCE, &format!("the colocated run on {backend}"), &mut worst, false)
            .map_err(|e| e.within(format!("request {} ({} prompt tokens)", i + 1, prompts[i].len())))?;
        (report.max_rel_err, report.worst_step) = worst;
        report.bit_equal &=
            want.logits.len() == got.logits.len() && want.logits.iter().zip(&got.logits).all(|(a, b)| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
    if on_device {
        let probes = std::mem::take(&mut *probes.lock().map_err(|_| CheckError::Poisoned("the per-step probes"))?);
        let check = per_step_check(&model, topo, &references, &colocated_here, probes)?;
        report.device_rel_err = check.worst;
        report.device_steps = check.per_step;
        report.near_ties = check.near_ties;
        // The free-running comparison with the CPU reference (its caches never
        // went through a hand-off): it must hold over the first steps, where a
        // lost or misplaced hand-off already shows and 16-bit rounding has not
        // yet compounded; past them it is reported, not judged (the per-step
        // check above judges every step).
        for (i, (want, got)) in references.iter().zip(&got).enumerate() {
            let head = |t: &Trace| Trace {
                tokens: t.tokens.iter().take(FREE_RUNNING_STEPS + 1).copied().collect(),
                logits: t.logits.iter().take(FREE_RUNNING_STEPS + 1).cloned().collect(),
            };
            let mut first = (0.0, 0);
            compare(&head(want), &head(got), device_tolerance(topo), "the CPU reference (free-running, first steps)", &mut first, true)
                .map_err(|e| e.within(format!("request {} ({} prompt tokens)", i + 1, prompts[i].len())))?;
            let mut worst = (report.free_running_err, 0);
            let _ = compare(want, got, f32::INFINITY, "the CPU reference", &mut worst, true);
            report.free_running_err = worst.0;
        }
    }
    report.tokens = references[0].tokens.clone();
    report.requests = prompts.len() as u32;
    Ok(report)
}

/// What the per-step check saw.
struct StepCheck {
    worst: f32,
    per_step: Vec<f32>,
    near_ties: Vec<(u32, usize)>,
}

/// The device against the CPU, one step at a time: step 0 (prefill's logits)
/// against the CPU reference's, and every decode step of the colocated device
/// run against the CPU fed that step's input, the token the device fed and the
/// caches the device held before it (read back from its regions). The error
/// of a step is the step's own: nothing compounds over the steps, and no pick
/// sends the two down different sequences, so every step is compared. A step
/// passes when its logits are within the device tolerance and the picks are
/// equal, or the CPU's top two are within the tolerance of each other and the
/// device picked the CPU's runner-up (a near-tie, reported).
fn per_step_check(model: &Model, topo: &Topology, references: &[Trace], device: &[Trace], probes: Vec<StepProbe>) -> Result<StepCheck, CheckError> {
    let tol = device_tolerance(topo);
    let cpu = CpuBackend::new();
    let group = model.upload_group(&cpu, 1).map_err(|e| CheckError::model("CPU reference", e))?;
    let mut out = StepCheck { worst: 0.0, per_step: Vec::new(), near_ties: Vec::new() };
    let mut judge = |req: usize, step: usize, dev: &[f32], dev_pick: u8, cpu_logits: &[f32], cpu_pick: u8| -> Result<(), CheckError> {
        let e = rel_err(dev, cpu_logits);
        if out.per_step.len() <= step {
            out.per_step.resize(step + 1, 0.0);
        }
        out.per_step[step] = out.per_step[step].max(e);
        out.worst = if e.is_nan() { f32::INFINITY } else { out.worst.max(e) };
        if e.is_nan() || e > tol {
            return Err(CheckError::Diverged(format!(
                "request {}: at step {step} the device's logits are {e:.3e} from the CPU fed the same caches and token (limit {tol:.1e})",
                req + 1
            )));
        }
        if dev_pick != cpu_pick {
            let runner_up = runner_up(cpu_logits);
            if top2_gap(cpu_logits) <= tol && usize::from(dev_pick) == runner_up {
                out.near_ties.push((req as u32 + 1, step));
            } else {
                return Err(CheckError::Diverged(format!(
                    "request {}: at step {step} the device picked {dev_pick} where the CPU fed the same caches and token picked {cpu_pick} (top-two gap {:.2e}, limit {tol:.1e})",
                    req + 1,
                    top2_gap(cpu_logits)
                )));
            }
        }
        Ok(())
    };
    for (i, (want, got)) in references.iter().zip(device).enumerate() {
        let (Some(dl), Some(cl)) = (got.logits.first(), want.logits.first()) else {
            return Err(CheckError::Engine(format!("request {}: no prefill logits", i + 1)));
        };
        judge(i, 0, dl, got.tokens[0], cl, want.tokens[0])?;
    }
    let mut seen: BTreeMap<u64, usize> = BTreeMap::new();
    for p in probes {
        let k = seen.entry(p.request).or_insert(0);
        *k += 1;
        let step = *k;
        let i = p.request as usize - 1;
        let trace = device.get(i).ok_or_else(|| CheckError::Engine(format!("a probe of request {} that the run does not have", p.request)))?;
        let (Some(dl), Some(&dp)) = (trace.logits.get(step), trace.tokens.get(step)) else {
            return Err(CheckError::Engine(format!("request {}: step {step} probed but not in the device trace", p.request)));
        };
        let mut caches = LocalCaches::new(&group.dims, 1, vec![p.caches]);
        let mut stepped = crate::model::forward::decode_batch(&cpu, &group, &[p.token], &[p.pos], &mut caches).map_err(|e| CheckError::model("CPU step", e))?;
        let (cl, cp) = stepped.pop().ok_or_else(|| CheckError::Engine("the CPU step returned nothing".into()))?;
        judge(i, step, dl, dp, &cl, cp)?;
    }
    Ok(out)
}

/// The index of the second largest logit (the first of the ties after the top).
fn runner_up(logits: &[f32]) -> usize {
    let top = crate::roles::sampling::argmax(logits) as usize;
    let mut best = None::<usize>;
    for (i, &x) in logits.iter().enumerate() {
        if i != top && !x.is_nan() && best.is_none_or(|b| x > logits[b]) {
            best = Some(i);
        }
    }
    best.unwrap_or(top)
}

/// `topo`'s model on one prefill rank and one decode rank (PP1 x TP1 -> TP1 x
/// DCP1): the colocated placement, run through the same engine.
pub fn colocated_topology(topo: &Topology) -> Result<Topology, CheckError> {
    let mut c = topo.config.clone();
    c.prefill.pp = 1;
    c.prefill.tp = 1;
    c.prefill.layer_split = Vec::new();
    c.decode.tp = 1;
    c.decode.dcp = 1;
    c.decode.interleave = 1;
    c.validate().map_err(|source| CheckError::Config { what: "the colocated placement of this model", source })
}

/// The gap between the largest and second-largest logit, over max |logit|.
fn top2_gap(logits: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in logits {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    let scale = logits.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
    (a - b) / scale
}

/// Compares a disaggregated trace with `want` (`what` names it in the error):
/// tokens equal at every step, logits within `tolerance`. `worst` keeps the
/// largest relative error seen and its step.
///
/// With `near_ties` (a device run against the CPU reference, whose arithmetic
/// differs in the last bits) a token may differ at a step where every logit so
/// far was within `tolerance` and the reference's top two logits are within
/// `tolerance` of each other: greedy decoding then picks either, legitimately,
/// and the two runs continue different sequences, which can no longer be
/// compared. That step is returned (and printed by the callers); any other
/// difference fails.
fn compare(want: &Trace, got: &Trace, tolerance: f32, what: &str, worst: &mut (f32, usize), near_ties: bool) -> Result<Option<usize>, CheckError> {
    let mut first_bad_token = None;
    let mut first_bad_logits = None;
    for i in 0..want.logits.len().max(got.logits.len()) {
        let e = match (got.logits.get(i), want.logits.get(i)) {
            (Some(a), Some(b)) => rel_err(a, b),
            _ => f32::INFINITY,
        };
        // NaN counts as the worst error.
        if e.is_nan() || e > worst.0 {
            *worst = (e, i);
        }
        if (e.is_nan() || e > tolerance) && first_bad_logits.is_none() {
            first_bad_logits = Some((i, e));
        }
        if got.tokens.get(i) != want.tokens.get(i) && first_bad_token.is_none() {
            let tie = near_ties && first_bad_logits.is_none() && want.logits.get(i).is_some_and(|l| top2_gap(l) <= tolerance);
            if tie {
                return Ok(Some(i));
            }
            first_bad_token = Some(i);
        }
    }
    if first_bad_token.is_none() && first_bad_logits.is_none() {
        return Ok(None);
    }
    let mut msg = format!("disaggregated decode diverged from {what}:");
    if let Some(i) = first_bad_token {
        msg += &format!(" tokens diverged first at step {i} (colocated {:?}, disaggregated {:?});", want.tokens.get(i), got.tokens.get(i));
    }
    if let Some((i, e)) = first_bad_logits {
        msg += &format!(" logits diverged first at step {i} (relative error {e:.3e} > {tolerance:.1e});");
    }
    msg += &format!(" max logit relative error {:.3e} at step {} of {} (step 0 = prefill)", worst.0, worst.1, want.logits.len().saturating_sub(1));
    Err(CheckError::Diverged(msg))
}

/// The disaggregated run through one engine of every rank: its dispatch phase
/// computes the prefill stages and the batched decode through [`ModelCompute`],
/// its transfer phase hands the plans to this driver, which runs them as the
/// oracle's counting copy. Returns each request's trace, in prompt order.
pub(crate) fn run_disaggregated<B: Backend + 'static>(
    topo: &Topology,
    prompts: &[Vec<u8>],
    forced: &[Vec<u8>],
    steps: u32,
    fill: Fill,
    be: B,
    tamper: impl FnMut(&mut Vec<Plan>),
) -> Result<(Vec<Trace>, ComputeReport), CheckError> {
    run_probed(topo, prompts, forced, steps, fill, be, tamper, None)
}

/// [`run_disaggregated`], and with `probes` (a single-rank decode) each
/// request's caches snapshotted from its regions before every decode step.
#[allow(clippy::too_many_arguments)]
fn run_probed<B: Backend + 'static>(
    topo: &Topology,
    prompts: &[Vec<u8>],
    forced: &[Vec<u8>],
    steps: u32,
    fill: Fill,
    be: B,
    mut tamper: impl FnMut(&mut Vec<Plan>),
    probes: Option<Probes>,
) -> Result<(Vec<Trace>, ComputeReport), CheckError> {
    topo.admits_transfer_mode().map_err(CheckError::Admission)?;
    let longest = prompts.iter().map(|p| p.len()).max().unwrap_or(0) as u64;
    // The run's context: the longest prompt and its steps fit (the fused step
    // sizes its tables by serve.max_context).
    let mut topo = topo.clone();
    let need = (longest + steps as u64 + 2) as u32;
    topo.config.serve.max_context = topo.config.serve.max_context.max(need);
    let topo = &topo;
    let cap = Capacity::for_requests(topo, prompts.len() as u32, longest + steps as u64 + 1);
    let mover = QueueMover::default();
    let mut engine = Engine::new(topo.clone(), cap, Box::new(mover.clone()));
    let regions = engine.regions();
    let store = Store::new(&be, &regions, fill)?;
    let trace: LogitTrace = Arc::default();
    let compute = ModelCompute::new(topo, be, layouts_of(&regions), store.view()).map_err(|e| CheckError::model("the compute", e))?.with_trace(trace.clone());
    let decode_path = compute.decode_path();
    match probes {
        Some(probes) => {
            engine.set_compute(Box::new(Probing { inner: Box::new(compute), topo: topo.clone(), layouts: layouts_of(&regions), view: store.view(), probes }))
        }
        None => engine.set_compute(Box::new(compute)),
    }

    let mut tokens: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    for (i, p) in prompts.iter().enumerate() {
        let id = i as u64 + 1;
        let inputs = Inputs { prompt: p.clone(), hidden: None };
        let forced = forced.get(i).cloned().unwrap_or_default();
        engine.submit_request(Submit { id, tokens: p.len() as u64, inputs, max_tokens: steps + 1, forced, ..Default::default() });
        tokens.insert(id, Vec::new());
    }
    let mut report = ComputeReport { prompt_tokens: prompts[0].len(), steps, decode_path, regions: store.label(), ..Default::default() };
    let mut finished = 0;
    // Each tick: the transfer phase's plans run as byte copies before the next.
    let limit = 64 * (topo.prefill().pp as usize + steps as usize + 8);
    for _ in 0..limit {
        engine.tick();
        let submitted = mover.take_submitted();
        if !submitted.is_empty() {
            let mut plans: Vec<Plan> = submitted.iter().map(|(_, p)| p.clone()).collect();
            report.descriptors += plans.iter().map(|p| p.descriptors.len() as u64).sum::<u64>();
            tamper(&mut plans);
            let exec = store.execute(&plans)?;
            report.bytes_transferred += exec.bytes;
            for ((_, kind), b) in &exec.written {
                *report.bytes_by_kind.entry(*kind).or_default() += b;
            }
            for (ticket, _) in &submitted {
                mover.complete(*ticket, Ok(()));
            }
        }
        for o in engine.take_outcomes() {
            if let Err(failure) = o.result {
                return Err(CheckError::Failed { request: o.request, failure });
            }
        }
        for ev in engine.take_events() {
            match ev {
                EngineEvent::Token { request, token, .. } => tokens.entry(request).or_default().push(token),
                EngineEvent::Finished { .. } => finished += 1,
                _ => {}
            }
        }
        if finished == prompts.len() && engine.live_requests() == 0 {
            break;
        }
    }
    if finished < prompts.len() || engine.live_requests() > 0 {
        return Err(CheckError::Engine(format!(
            "{} of {} requests finished after {limit} ticks; {} still held",
            finished,
            prompts.len(),
            engine.live_requests()
        )));
    }
    let logits = std::mem::take(&mut *trace.lock().map_err(|_| CheckError::Poisoned("the logit trace"))?);
    let traces = tokens.into_iter().map(|(id, tokens)| Trace { tokens, logits: logits.get(&id).cloned().unwrap_or_default() }).collect();
    Ok((traces, report))
}

/// One decode step of a single-rank device run as the CPU re-runs it: the
/// request's caches before the step, read back from its regions, and the token
/// and position the step fed.
pub(crate) struct StepProbe {
    request: u64,
    token: u8,
    pos: usize,
    caches: LocalRequest,
}

type Probes = Arc<Mutex<Vec<StepProbe>>>;

/// The compute of the colocated device run, snapshotting every request's caches
/// before each decode step (the per-step check against the CPU).
struct Probing {
    inner: Box<dyn Compute>,
    topo: Topology,
    layouts: crate::model::ranks::Layouts,
    view: Arc<dyn RegionView>,
    probes: Probes,
}

impl Compute for Probing {
    fn prefill(&mut self, job: PrefillJob<'_>) -> Result<PrefillOutput, ComputeError> {
        self.inner.prefill(job)
    }

    fn prefill_batch(&mut self, jobs: Vec<PrefillJob<'_>>) -> Vec<Result<PrefillOutput, ComputeError>> {
        self.inner.prefill_batch(jobs)
    }

    fn prefill_streamed(
        &mut self,
        jobs: Vec<PrefillJob<'_>>,
        on_layer: &mut handoff_systems::dispatch::LayerHook<'_>,
    ) -> Vec<Result<PrefillOutput, ComputeError>> {
        self.inner.prefill_streamed(jobs, on_layer)
    }

    fn decode(&mut self, batch: &[DecodeItem<'_>]) -> Result<DecodeOutput, ComputeError> {
        for item in batch {
            let lease = item.leases.first().ok_or(ComputeError::MissingInput { stage: 0, what: "a decode lease" })?;
            let caches = crate::model::ranks::snapshot_single_rank(&self.topo, &self.layouts, self.view.as_ref(), lease, item.pos as usize)
                .map_err(|e| ComputeError::Step { what: "snapshot for the per-step check", source: std::sync::Arc::new(e) })?;
            self.probes.lock().unwrap_or_else(|p| p.into_inner()).push(StepProbe { request: item.request, token: item.token, pos: item.pos as usize, caches });
        }
        self.inner.decode(batch)
    }
}

/// Where verify keeps the registered regions: the oracle's host memory, or the
/// backend's device memory (read and written in place by the model and the
/// fused decode step, as a role's are; the hand-off runs as device copies
/// after the oracle's checks).
enum Store {
    Host(Arc<Mutex<Memory>>),
    Device(Arc<DeviceRegions>),
}

impl Store {
    fn new<B: Backend>(be: &B, regions: &[handoff_components::ecs::Region], fill: Fill) -> Result<Store, CheckError> {
        let init = |r: &handoff_components::ecs::Region| {
            let mut buf = vec![0u8; r.layout.len as usize];
            if fill == Fill::Canary {
                oracle::fill_canary(r.rank, r.layout.kind, &mut buf);
            }
            buf
        };
        match be.device_memory() {
            Ok(mem) => {
                let sizes: Vec<_> = regions.iter().map(|r| ((r.rank, r.layout.kind), r.layout.len)).collect();
                let dev = DeviceRegions::alloc(mem, &sizes).map_err(|e| CheckError::model("device regions", e))?;
                for r in regions {
                    dev.write_all(r.rank, r.layout.kind, &init(r)).map_err(|e| CheckError::model("device regions", e))?;
                }
                Ok(Store::Device(Arc::new(dev)))
            }
            Err(_) => {
                let mut mem = Memory::new();
                for r in regions {
                    mem.insert((r.rank, r.layout.kind), init(r));
                }
                Ok(Store::Host(Arc::new(Mutex::new(mem))))
            }
        }
    }

    fn view(&self) -> Arc<dyn RegionView> {
        match self {
            Store::Host(m) => m.clone(),
            Store::Device(d) => d.clone(),
        }
    }

    fn label(&self) -> String {
        match self {
            Store::Host(_) => "host memory".into(),
            Store::Device(d) => format!("{} memory", d.mem.label()),
        }
    }

    /// Runs the plans: the oracle's counting copy on the host, or its checks
    /// followed by the plans' copies on the device.
    fn execute(&self, plans: &[Plan]) -> Result<oracle::ExecStats, CheckError> {
        match self {
            Store::Host(m) => {
                let mut mem = m.lock().map_err(|_| CheckError::Poisoned("the host regions"))?;
                Ok(oracle::execute_counted(plans, &mut mem)?)
            }
            Store::Device(d) => {
                let lens = d.regions.iter().map(|(k, r)| (*k, r.len)).collect();
                let stats = oracle::check_counted(plans, &lens)?;
                let mut copies = Vec::new();
                for plan in plans {
                    let (src_rank, dst_rank) = (RankId::Prefill(plan.producer), RankId::Decode(plan.consumer));
                    for x in &plan.descriptors {
                        let (src, dst) = (d.regions[&(src_rank, x.kind)], d.regions[&(dst_rank, x.kind)]);
                        copies.push(Copy2d {
                            src: src.addr + x.src_offset,
                            src_pitch: if x.count > 1 { x.src_stride } else { x.len },
                            dst: dst.addr + x.dst_offset,
                            dst_pitch: if x.count > 1 { x.dst_stride } else { x.len },
                            width: x.len,
                            height: x.count as u64,
                        });
                    }
                }
                // SAFETY: check_counted put every range inside its region.
                let ticket = unsafe { d.mem.copy(&copies) }.map_err(|e| CheckError::model("device hand-off", e))?;
                d.mem.wait(ticket).map_err(|e| CheckError::model("device hand-off", e))?;
                Ok(stats)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(tokens: &[u8], logits: &[[f32; 3]]) -> Trace {
        Trace { tokens: tokens.to_vec(), logits: logits.iter().map(|l| l.to_vec()).collect() }
    }

    /// The per-step check re-runs each decode step on the CPU from the caches
    /// the run held before it: on a CPU run that reproduces every step exactly
    /// (the snapshot reads back what the regions hold, byte for byte), and a
    /// step whose logits the run got wrong fails it, naming the step.
    #[test]
    fn the_per_step_check_reruns_every_step_exactly_and_names_a_wrong_one() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/config/small.toml");
        let topo = colocated_topology(&Topology::load(path).unwrap()).unwrap();
        let prompts = batch_prompts(b"the per-step check", 2);
        let model = Model::new(&topo).unwrap();
        let refs: Vec<Trace> = prompts.iter().map(|p| run_colocated(&model, p, 5).unwrap()).collect();
        let probes: Probes = Arc::default();
        let (runs, _) = run_probed(&topo, &prompts, &[], 5, Fill::Zeros, CpuBackend::new(), |_| {}, Some(probes.clone())).unwrap();
        let taken = |p: &Probes| std::mem::take(&mut *p.lock().unwrap());
        let ps = taken(&probes);
        assert_eq!(ps.len(), 2 * 5, "a probe per request per decode step");
        let check = per_step_check(&model, &topo, &refs, &runs, ps).unwrap();
        assert_eq!(check.worst, 0.0, "the CPU re-run of a CPU run is exact: {:?}", check.per_step);
        assert_eq!(check.per_step.len(), 6);
        let mut wrong = runs.clone();
        for x in wrong[1].logits[3].iter_mut() {
            *x = -*x;
        }
        let (_, again) = run_probed(&topo, &prompts, &[], 5, Fill::Zeros, CpuBackend::new(), |_| {}, Some(probes.clone())).unwrap();
        drop(again);
        let e = per_step_check(&model, &topo, &refs, &wrong, taken(&probes)).map(|_| ()).unwrap_err();
        assert!(matches!(e, CheckError::Diverged(_)), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("request 2") && e.contains("step 3"), "{e}");
    }

    #[test]
    fn a_flip_at_a_near_tie_is_accepted_only_for_device_runs() {
        // Step 1: the reference's top two are 1.0 and 0.9995 (gap 5e-4 of max 1.0).
        let want = trace(&[0, 0, 2], &[[1.0, 0.0, 0.0], [1.0, 0.0, 0.9995], [0.0, 0.0, 1.0]]);
        let got = trace(&[0, 2, 1], &[[1.0, 0.0, 0.0], [0.9999, 0.0, 0.99995], [0.0, 1.0, 0.0]]);
        let mut worst = (0.0, 0);
        assert_eq!(compare(&want, &got, 2e-3, "the CPU reference", &mut worst, true).ok(), Some(Some(1)));
        // The same flip against the same backend's colocated run is a failure.
        let mut worst = (0.0, 0);
        let e = compare(&want, &got, 2e-3, "the colocated run on cpu", &mut worst, false).unwrap_err().to_string();
        assert!(e.contains("tokens diverged first at step 1"), "{e}");
    }

    #[test]
    fn a_flip_with_a_clear_winner_fails_even_for_device_runs() {
        let want = trace(&[0, 0], &[[1.0, 0.0, 0.0], [1.0, 0.0, 0.5]]);
        let got = trace(&[0, 2], &[[1.0, 0.0, 0.0], [1.0, 0.0, 0.5]]);
        let mut worst = (0.0, 0);
        let e = compare(&want, &got, 2e-3, "the CPU reference", &mut worst, true).unwrap_err().to_string();
        assert!(e.contains("diverged from the CPU reference") && e.contains("step 1"), "{e}");
    }

    #[test]
    fn logits_past_the_tolerance_before_a_flip_fail() {
        let want = trace(&[0, 0], &[[1.0, 0.0, 0.0], [1.0, 0.0, 0.9995]]);
        let got = trace(&[0, 2], &[[0.9, 0.0, 0.0], [0.9999, 0.0, 0.99995]]);
        let mut worst = (0.0, 0);
        assert!(compare(&want, &got, 2e-3, "the CPU reference", &mut worst, true).is_err());
    }
}
