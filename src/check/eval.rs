//! `handoff eval`: teacher-forced accuracy of held-out text through the
//! disaggregated path, next to the colocated run.
//!
//! Each sample is a window of the text: its first `prefix` bytes are the prompt
//! (PP x TP prefill into the stages' regions, the hand-off as the oracle's byte
//! copy of every plan), then decode (TP x DCP, all samples as one batch) is fed
//! the true next bytes. Every step's logits score the byte that follows:
//! bits per byte = mean of -log2 p(true byte), accuracy = share of steps whose
//! argmax is the true byte. The colocated run (one rank, the same weights) is
//! scored the same way; the two must agree within the equivalence tolerance.
//!
//! `--drop KIND` removes one region kind's descriptors from the hand-off and
//! starts decode from zeroed memory, so the lost state shows as a number: the
//! silent failure of docs/design.md made visible.

use crate::check::CheckError;
use crate::check::compute_verify::{Fill, LOGIT_TOLERANCE, colocated_topology, rel_err, run_disaggregated};
use crate::model::{Model, Trace, run_colocated_forced_on};
use handoff_components::Topology;
use handoff_components::vocab::RegionKind;
use handoff_kernels::{Backend, CpuBackend};

/// Bits per byte and next-byte accuracy of one run.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Score {
    pub bits_per_byte: f64,
    pub accuracy: f64,
    /// Bytes scored.
    pub bytes: usize,
}

/// What `handoff eval` measured.
#[derive(Debug, Clone, Default)]
pub struct EvalReport {
    pub samples: usize,
    pub prefix: usize,
    pub continuation: usize,
    pub disaggregated: Score,
    pub colocated: Score,
    /// Largest relative logit error between the two runs over every step.
    pub max_rel_err: f32,
    /// The kind whose hand-off was dropped, if any.
    pub dropped: Option<RegionKind>,
}

/// The windows of `text` the eval scores: `samples` windows of `prefix +
/// continuation` bytes, spread evenly over the text.
pub fn windows(text: &[u8], samples: usize, prefix: usize, continuation: usize) -> Result<Vec<&[u8]>, CheckError> {
    let w = prefix + continuation;
    if samples == 0 || prefix == 0 || continuation == 0 {
        return Err(CheckError::Input("--samples, --prefix and --continuation must each be at least 1".into()));
    }
    if text.len() < w {
        return Err(CheckError::Input(format!("the data has {} bytes; one window needs {w} (prefix {prefix} + continuation {continuation})", text.len())));
    }
    let span = text.len() - w;
    Ok((0..samples)
        .map(|i| {
            let start = if samples == 1 { 0 } else { span * i / (samples - 1) };
            &text[start..start + w]
        })
        .collect())
}

/// Scores `traces[i]` against the continuation of `windows[i]`: step k's logits
/// predict byte `prefix + k`.
pub fn score(traces: &[Trace], windows: &[&[u8]], prefix: usize) -> Score {
    let (mut bits, mut hits, mut n) = (0.0f64, 0usize, 0usize);
    for (t, w) in traces.iter().zip(windows) {
        for (k, logits) in t.logits.iter().enumerate() {
            let Some(&truth) = w.get(prefix + k) else { break };
            let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
            let lse = m + logits.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
            bits += (lse - logits[truth as usize] as f64) / std::f64::consts::LN_2;
            // argmax with the lowest index on ties, as greedy decoding picks.
            let pick = logits.iter().enumerate().fold(0, |best, (i, &x)| if x > logits[best] { i } else { best });
            hits += usize::from(pick == truth as usize);
            n += 1;
        }
    }
    Score { bits_per_byte: bits / n.max(1) as f64, accuracy: hits as f64 / n.max(1) as f64, bytes: n }
}

/// Runs the eval of `text` on `topo` (CPU backend).
pub fn eval(topo: &Topology, text: &[u8], samples: usize, prefix: usize, continuation: usize, dropped: Option<RegionKind>) -> Result<EvalReport, CheckError> {
    eval_on(topo, text, samples, prefix, continuation, dropped, CpuBackend::new())
}

/// [`eval`] on backend `be`. On a device both runs are on it: the
/// disaggregated one, and the colocated one as the same engine at PP1 x TP1 ->
/// TP1 x DCP1 (its regions in device memory, the fused decode step where the
/// backend has one), teacher-forced alike.
pub fn eval_on<B: Backend + Clone + 'static>(
    topo: &Topology,
    text: &[u8],
    samples: usize,
    prefix: usize,
    continuation: usize,
    dropped: Option<RegionKind>,
    be: B,
) -> Result<EvalReport, CheckError> {
    let windows = windows(text, samples, prefix, continuation)?;
    let prompts: Vec<Vec<u8>> = windows.iter().map(|w| w[..prefix].to_vec()).collect();
    // Step k (k >= 1) feeds byte prefix + k - 1; the last window byte is only scored.
    let forced: Vec<Vec<u8>> = windows.iter().map(|w| w[prefix..prefix + continuation - 1].to_vec()).collect();
    let steps = (continuation - 1) as u32;

    let colocated: Vec<Trace> = if be.name() == CpuBackend::new().name() {
        let model = Model::new(topo).map_err(|e| CheckError::model("the model", e))?;
        let cpu = CpuBackend::new();
        let group = model.upload_group(&cpu, 1).map_err(|e| CheckError::model("the model on the CPU", e))?;
        prompts
            .iter()
            .zip(&forced)
            .map(|(p, f)| run_colocated_forced_on(&cpu, &group, p, steps, f))
            .collect::<Result<_, _>>()
            .map_err(|e| CheckError::model("colocated run", e))?
    } else {
        let colo = colocated_topology(topo)?;
        run_disaggregated(&colo, &prompts, &forced, steps, Fill::Zeros, be.clone(), |_| {}).map_err(|e| e.within("colocated run"))?.0
    };

    let fill = if dropped.is_some() { Fill::Zeros } else { Fill::Canary };
    let tamper = move |plans: &mut Vec<handoff_components::plan::Plan>| {
        if let Some(kind) = dropped {
            for p in plans.iter_mut() {
                p.descriptors.retain(|d| d.kind != kind);
            }
        }
    };
    let (disaggregated, _) = run_disaggregated(topo, &prompts, &forced, steps, fill, be, tamper)?;

    let mut max_rel_err = 0.0f32;
    for (a, b) in disaggregated.iter().zip(&colocated) {
        for (x, y) in a.logits.iter().zip(&b.logits) {
            let e = rel_err(x, y);
            if e.is_nan() || e > max_rel_err {
                max_rel_err = e;
            }
        }
    }
    Ok(EvalReport {
        samples,
        prefix,
        continuation,
        disaggregated: score(&disaggregated, &windows, prefix),
        colocated: score(&colocated, &windows, prefix),
        max_rel_err,
        dropped,
    })
}

impl EvalReport {
    /// Whether the disaggregated run equals the colocated one within the
    /// equivalence tolerance (meaningful without `--drop`).
    pub fn equal(&self) -> bool {
        self.max_rel_err <= LOGIT_TOLERANCE && (self.disaggregated.bits_per_byte - self.colocated.bits_per_byte).abs() <= 1e-6
    }
}
