//! The independent check of the model's math: the Rust CPU path on the trained
//! checkpoint against logits that the PyTorch reference (tools/torch_ref/,
//! written from docs/weights.md and docs/design.md section 5, sharing no code with
//! src/model) computed on the same weights: for each held-out prompt, the
//! prefill logits and 32 greedy decode steps. Also through the disaggregated
//! path of the checkpoint's topology (PP2 x TP1 -> TP2 x DCP2, replay on), which
//! must give the same tokens.

use handoff::check::compute_verify::{rel_err, verify_compute};
use handoff::model::{Model, run_colocated};
use handoff_components::Topology;
use serde::Deserialize;

/// Largest relative logit error (max |a - b| / max |b| per step) accepted between
/// the Rust f32 path and the PyTorch reference: both are f32 with different
/// summation orders (and f64 attention partials on the Rust side).
const GOLDEN_TOLERANCE: f32 = 1e-3;

#[derive(Deserialize)]
struct Golden {
    config: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    prompt: Vec<u8>,
    tokens: Vec<u8>,
    logits: Vec<Vec<f32>>,
}

fn golden() -> (Topology, Golden) {
    let root = env!("CARGO_MANIFEST_DIR");
    let text = std::fs::read_to_string(format!("{root}/tools/torch_ref/golden.json")).expect("tools/torch_ref/golden.json");
    let g: Golden = serde_json::from_str(&text).expect("golden.json parses");
    let topo = Topology::load(&format!("{root}/{}", g.config)).expect("the golden file's topology");
    assert!(topo.model().weights.is_some(), "the golden topology must name the trained weights");
    (topo, g)
}

#[test]
fn rust_cpu_logits_match_the_pytorch_reference() {
    let (topo, g) = golden();
    let model = Model::new(&topo).expect("load the trained checkpoint");
    assert!(g.cases.len() >= 4, "golden.json holds {} cases", g.cases.len());
    for (i, c) in g.cases.iter().enumerate() {
        let steps = c.logits.len() as u32 - 1;
        assert!(steps >= 32, "case {i}: {steps} steps");
        let got = run_colocated(&model, &c.prompt, steps).unwrap_or_else(|e| panic!("case {i}: {e}"));
        let worst = got.logits.iter().zip(&c.logits).map(|(a, b)| rel_err(a, b)).fold(0.0f32, f32::max);
        eprintln!("case {i} ({} prompt bytes): max relative logit error {worst:.2e} over {} steps", c.prompt.len(), steps + 1);
        for (step, (a, b)) in got.logits.iter().zip(&c.logits).enumerate() {
            let e = rel_err(a, b);
            assert!(
                e <= GOLDEN_TOLERANCE,
                "case {i} ({:?}) step {step}: relative logit error {e:.3e} > {GOLDEN_TOLERANCE:.0e}",
                String::from_utf8_lossy(&c.prompt)
            );
        }
        assert_eq!(got.tokens, c.tokens, "case {i}: greedy tokens differ from the PyTorch reference");
    }
}

#[test]
fn the_disaggregated_checkpoint_writes_the_reference_tokens() {
    let (topo, g) = golden();
    let c = &g.cases[0];
    let r = verify_compute(&topo, &c.prompt, c.logits.len() as u32 - 1, |_| {}).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.tokens, c.tokens);
}

/// `handoff eval` of held-out text on the checkpoint's flagship-shaped topology:
/// the disaggregated score equals the colocated one, it is far better than
/// chance (8 bits per byte), and losing the KDA state in the hand-off costs.
#[test]
fn eval_of_held_out_text_is_equal_and_lost_state_costs() {
    let root = env!("CARGO_MANIFEST_DIR");
    let topo = Topology::load(&format!("{root}/config/trained-pp4-tp4dcp4.toml")).expect("config/trained-pp4-tp4dcp4.toml");
    let text = std::fs::read(format!("{root}/tools/torch_ref/data/heldout.txt")).expect("held-out text");
    let ok = handoff::check::eval::eval(&topo, &text, 4, 48, 32, None).unwrap_or_else(|e| panic!("{e}"));
    assert!(ok.equal(), "disaggregated {:?} vs colocated {:?}", ok.disaggregated, ok.colocated);
    assert!(ok.colocated.bits_per_byte < 3.0, "a trained model scores well under 8 bits per byte: {:?}", ok.colocated);
    let lost = handoff::check::eval::eval(&topo, &text, 4, 48, 32, Some(handoff_components::vocab::RegionKind::KdaState)).unwrap();
    assert!(
        lost.disaggregated.bits_per_byte > ok.disaggregated.bits_per_byte + 0.01,
        "dropping kda.state must cost: {:?} vs {:?}",
        lost.disaggregated,
        ok.disaggregated
    );
}
