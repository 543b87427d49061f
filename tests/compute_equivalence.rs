//! Disaggregated P/D decode computes what a colocated single-rank run computes:
//! equal greedy tokens and logits within 1e-4 (relative) for 32+ decode steps, over
//! a matrix of PP, prefill TP, decode TP, DCP, interleave, layer splits, prompt
//! lengths, replay and block sizes (16-bit caches under DCP and replay included,
//! where the logits are equal exactly); and dropping KDA state, conv state, MLA
//! rows or replay records from the hand-off makes the check fail loudly.

mod common;

use handoff::check::CheckError;
use handoff::check::compute_verify::{Fill, LOGIT_TOLERANCE, verify_compute, verify_compute_with};
use handoff_components::Topology;
use handoff_components::plan::Plan;
use handoff_components::vocab::RegionKind;

const STEPS: u32 = 32;

type Case = common::ComputeShape;

const BASE: Case = common::COMPUTE;

fn topo(c: &Case) -> Topology {
    c.topology()
}

fn prompt(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u32 * 37 + 11) as u8).collect()
}

fn check(name: &str, c: &Case, len: usize) {
    let t = topo(c);
    match verify_compute(&t, &prompt(len), STEPS, |_| {}) {
        Ok(r) => {
            eprintln!(
                "{name} (prompt {len}): max rel err {:.2e} at step {}, {} descriptors, tokens {:?}",
                r.max_rel_err,
                r.worst_step,
                r.descriptors,
                String::from_utf8_lossy(&r.tokens)
            );
            assert_eq!(r.tokens.len(), STEPS as usize + 1, "{name}");
            assert!(r.max_rel_err <= LOGIT_TOLERANCE, "{name}: {}", r.max_rel_err);
            // Every placement performs the colocated run's arithmetic per head (the
            // all-reduce in global unit order, f64 attention partials, the same
            // ReplaySSM schedule), so the logits are equal, not merely close.
            assert_eq!(r.max_rel_err, 0.0, "{name}: logits differ at step {}", r.worst_step);
        }
        Err(e) => panic!("{name} (prompt {len}): {e}"),
    }
}

#[test]
fn colocated_topology_matches_itself() {
    check("pp1 tp1 -> tp1", &BASE, 13);
}

#[test]
fn pp_stages_and_prefill_tp_match_colocated() {
    for (pp, ptp, split) in [(2, 1, ""), (3, 1, ""), (2, 2, "3, 5"), (3, 2, "1, 4, 3")] {
        let c = Case { layers: 8, pp, ptp, split, dtp: 2, ..BASE };
        check(&format!("pp{pp} tp{ptp} split [{split}]"), &c, 19);
    }
}

#[test]
fn decode_tp_and_dcp_match_colocated() {
    for (dtp, dcp, interleave) in [(2, 1, 1), (2, 2, 1), (4, 2, 8), (4, 4, 1), (4, 4, 8), (4, 1, 1)] {
        let c = Case { pp: 2, dtp, dcp, interleave, ..BASE };
        check(&format!("decode tp{dtp} dcp{dcp} S{interleave}"), &c, 21);
    }
}

#[test]
fn prompt_lengths_and_block_sizes_match_colocated() {
    for (pbs, dbs, interleave) in [(8, 8, 1), (8, 16, 4), (16, 4, 2), (4, 8, 8)] {
        for len in [1, 16, 23] {
            let c = Case { pp: 2, ptp: 2, pbs, dtp: 4, dcp: 2, interleave, dbs, ..BASE };
            check(&format!("blocks {pbs}->{dbs} S{interleave}"), &c, len);
        }
    }
}

#[test]
fn replay_records_match_colocated() {
    for (cap, len, dtp, dcp) in [(8, 19, 2, 2), (4, 1, 4, 4), (16, 40, 1, 1)] {
        let c = Case { pp: 2, replay: Some(cap), dtp, dcp, ..BASE };
        check(&format!("replay cap {cap} decode tp{dtp} dcp{dcp}"), &c, len);
    }
}

/// Without DCP and replay the disaggregated run performs the colocated run's
/// arithmetic in the same order (the all-reduce sums per head / per MLP unit in
/// global order), so 16-bit caches hold the same bits on both paths: zero error.
#[test]
fn model_dtypes_bf16_and_f16_match_colocated_bit_for_bit() {
    for dtype in ["bf16", "f16", "f32"] {
        for (pp, ptp, dtp) in [(2, 2, 4), (3, 1, 2)] {
            let c = Case { dtype, layers: 8, pp, ptp, dtp, dcp: 1, ..BASE };
            let r = verify_compute(&topo(&c), &prompt(17), STEPS, |_| {}).unwrap_or_else(|e| panic!("{dtype} pp{pp} tp{ptp} -> tp{dtp}: {e}"));
            assert_eq!(r.max_rel_err, 0.0, "{dtype} pp{pp} tp{ptp} -> tp{dtp}");
        }
    }
}

/// 16-bit caches under every decode decomposition: bf16 and f16, DCP 1/2/4,
/// token interleave 1 and = block size, replay on and off, several prompts, 32
/// steps. The decode MLA attention is an f64 partial per DCP rank merged in f64
/// (the colocated run merges its single shard the same way), and the colocated
/// run keeps the same ReplaySSM ring and commit schedule, so both paths perform
/// the same arithmetic per head: the stored 16-bit rows are the same bits and the
/// logits are equal, not merely close. A one-ulp difference in a merged output
/// would round a later bf16 row differently and grow; zero error is the check.
#[test]
fn sixteen_bit_caches_under_dcp_and_replay_match_colocated_exactly() {
    let prompts: [Vec<u8>; 3] = [b"dcp".to_vec(), (0..17u32).map(|i| (i * 31 + 7) as u8).collect(), (0..30u32).map(|i| (i * 53 + 101) as u8).collect()];
    let mut runs = 0;
    for dtype in ["bf16", "f16"] {
        for (dtp, dcp) in [(2, 1), (4, 2), (4, 4)] {
            for interleave in [1, 8] {
                for replay in [None, Some(8)] {
                    let c = Case { dtype, pp: 2, ptp: 2, dtp, dcp, interleave, dbs: 8, replay, ..BASE };
                    let t = topo(&c);
                    for p in &prompts {
                        let name = format!("{dtype} tp{dtp} dcp{dcp} S{interleave} replay {replay:?} prompt {}", p.len());
                        let r = verify_compute(&t, p, STEPS, |_| {}).unwrap_or_else(|e| panic!("{name}: {e}"));
                        assert_eq!(r.tokens.len(), STEPS as usize + 1, "{name}");
                        assert_eq!(r.max_rel_err, 0.0, "{name}: max rel err {:.3e} at step {}", r.max_rel_err, r.worst_step);
                        runs += 1;
                    }
                }
            }
        }
    }
    assert_eq!(runs, 2 * 3 * 2 * 2 * 3);
}

/// The uneven shipped topology (PP3 x TP2 -> TP4 x DCP2, S4, replay, bf16) over
/// more prompts and 48 steps.
#[test]
fn shipped_bf16_dcp_replay_topology_matches_colocated_exactly() {
    let t = Topology::load(concat!(env!("CARGO_MANIFEST_DIR"), "/config/pp3-tp2-to-tp4dcp2.toml")).expect("config/pp3-tp2-to-tp4dcp2.toml");
    for seed in 0..4usize {
        let p: Vec<u8> = (0..9 + 5 * seed).map(|i| (i * 31 + seed * 7) as u8).collect();
        let r = verify_compute(&t, &p, 48, |_| {}).unwrap_or_else(|e| panic!("prompt {seed}: {e}"));
        assert_eq!(r.max_rel_err, 0.0, "prompt {seed}");
    }
}

/// The flagship's weights (about 255 GiB as f32) are refused by size, up front.
#[test]
fn flagship_config_is_refused_by_size_before_allocating() {
    let t = Topology::load(concat!(env!("CARGO_MANIFEST_DIR"), "/config/k3-pp8-tp8dcp8.toml")).expect("config/k3-pp8-tp8dcp8.toml");
    let e = verify_compute(&t, b"hi", 1, |_| {}).expect_err("the flagship must be refused");
    assert!(matches!(e, CheckError::Model { .. }), "the model refuses it: {e:?}");
    let e = e.to_string();
    assert!(e.contains("too large") && e.contains("GiB") && e.contains("7168"), "{e}");
}

#[test]
fn mla_first_and_kda_only_patterns_match_colocated() {
    for pattern in ["MKKM", "KMKM", "K"] {
        let c = Case { pattern, layers: 5, pp: 2, dtp: 2, dcp: 2, ..BASE };
        check(pattern, &c, 10);
    }
}

fn drop_kind(kind: RegionKind) -> impl FnMut(&mut Vec<Plan>) {
    move |plans: &mut Vec<Plan>| {
        for p in plans.iter_mut() {
            p.descriptors.retain(|d| d.kind != kind);
        }
    }
}

fn assert_diverges(kind: RegionKind, c: &Case) {
    let t = topo(c);
    let before = verify_compute(&t, &prompt(20), STEPS, |_| {});
    assert!(before.is_ok(), "untampered run must pass: {before:?}");
    match verify_compute(&t, &prompt(20), STEPS, drop_kind(kind)) {
        Ok(r) => panic!("dropping {kind} went unnoticed: {r:?}"),
        Err(e) => {
            eprintln!("dropping {kind}: {e}");
            assert!(matches!(e.root(), CheckError::Diverged(_)), "the run must be found diverged: {e:?}");
            assert!(e.to_string().contains("diverged"), "message must say the run diverged: {e}");
        }
    }
}

#[test]
fn dropping_kda_state_descriptors_fails_loudly() {
    assert_diverges(RegionKind::KdaState, &Case { pp: 2, dtp: 2, dcp: 2, ..BASE });
}

#[test]
fn dropping_conv_state_descriptors_fails_loudly() {
    assert_diverges(RegionKind::KdaConv, &Case { pp: 2, dtp: 2, dcp: 2, ..BASE });
}

#[test]
fn dropping_mla_rows_fails_loudly() {
    assert_diverges(RegionKind::MlaKv, &Case { pp: 2, dtp: 2, dcp: 2, ..BASE });
}

#[test]
fn dropping_replay_records_fails_loudly() {
    assert_diverges(RegionKind::ReplayRecords, &Case { pp: 2, dtp: 2, dcp: 2, replay: Some(8), ..BASE });
}

#[test]
fn dropping_kda_state_into_zeroed_memory_fails_loudly() {
    // The shipped bug: the state never arrives and decode runs from zeros.
    let c = Case { pp: 2, dtp: 2, dcp: 2, ..BASE };
    for kind in [RegionKind::KdaState, RegionKind::KdaConv] {
        match verify_compute_with(&topo(&c), &[prompt(20)], STEPS, Fill::Zeros, drop_kind(kind)) {
            Ok(r) => panic!("dropping {kind} into zeroed memory went unnoticed: {r:?}"),
            Err(e) => {
                eprintln!("dropping {kind} (zeros): {e}");
                assert!(matches!(e.root(), CheckError::Diverged(_)), "{e:?}");
                assert!(e.to_string().contains("diverged"), "{e}");
            }
        }
    }
}
