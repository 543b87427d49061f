//! `verify --compute` on the CUDA backend over the compute test matrix: for every
//! topology, the disaggregated run on the GPU (prefill stages computing into
//! their regions, the oracle's byte copy of every plan, one batched decode of
//! three requests) must equal a colocated run on the GPU within
//! `LOGIT_TOLERANCE` and the CPU reference within `DEVICE_TOLERANCE`, with every
//! greedy token equal to both.
//!
//! Built only with `--features cuda`, and ignored by default because it needs an
//! NVIDIA GPU: on the GPU machine run the test binary with `--ignored`
//! (README, "GPU"). Without a device it fails, naming the reason.

#![cfg(feature = "cuda")]

mod common;

use handoff::check::compute_verify::{Fill, LOGIT_TOLERANCE, batch_prompts, device_tolerance, verify_compute_on};
use handoff_kernels::CudaBackend;

type Case = common::ComputeShape;
const BASE: Case = common::COMPUTE;
const STEPS: u32 = 32;

/// The topologies of tests/compute_equivalence.rs, one or two of each kind.
fn matrix() -> Vec<(String, Case)> {
    let mut m = vec![("pp1 tp1 -> tp1".to_string(), BASE)];
    for (pp, ptp, split) in [(2, 1, ""), (3, 2, "1, 4, 3")] {
        m.push((format!("pp{pp} tp{ptp} split [{split}]"), Case { layers: 8, pp, ptp, split, dtp: 2, ..BASE }));
    }
    for (dtp, dcp, interleave) in [(2, 2, 1), (4, 2, 8), (4, 4, 1)] {
        m.push((format!("decode tp{dtp} dcp{dcp} S{interleave}"), Case { pp: 2, dtp, dcp, interleave, ..BASE }));
    }
    for (pbs, dbs, interleave) in [(8, 16, 4), (16, 4, 2)] {
        m.push((format!("blocks {pbs}->{dbs} S{interleave}"), Case { pp: 2, ptp: 2, pbs, dtp: 4, dcp: 2, interleave, dbs, ..BASE }));
    }
    for (cap, dtp, dcp) in [(8, 2, 2), (4, 4, 4)] {
        m.push((format!("replay cap {cap} decode tp{dtp} dcp{dcp}"), Case { pp: 2, replay: Some(cap), dtp, dcp, ..BASE }));
    }
    for dtype in ["bf16", "f16"] {
        m.push((format!("{dtype} tp4 dcp2 replay"), Case { dtype, pp: 2, ptp: 2, dtp: 4, dcp: 2, replay: Some(8), ..BASE }));
    }
    for pattern in ["MKKM", "K"] {
        m.push((format!("pattern {pattern}"), Case { pattern, layers: 5, pp: 2, dtp: 2, dcp: 2, ..BASE }));
    }
    m.push(("24 KDA + 8 MLA heads".to_string(), Case { kda_heads: 24, mla_heads: 8, pp: 2, dtp: 4, dcp: 2, ..BASE }));
    // The two shapes the device-vs-CPU check once failed on (bf16 caches, small heads).
    m.push((
        "bf16 pp5 -> tp4 dcp2 replay 4, 27 layers, hidden 64".to_string(),
        Case { dtype: "bf16", layers: 27, hidden: 64, pp: 5, dtp: 4, dcp: 2, replay: Some(4), ..BASE },
    ));
    m.push(("bf16 pp6 tp2 -> tp12 dcp4".to_string(), Case { dtype: "bf16", layers: 12, kda_heads: 24, mla_heads: 24, pp: 6, ptp: 2, dtp: 12, dcp: 4, ..BASE }));
    m
}

#[test]
#[ignore = "needs an NVIDIA GPU: run this test binary with --ignored on the GPU machine"]
fn cuda_disaggregated_decode_matches_colocated_and_the_cpu_reference() {
    let prompt: Vec<u8> = (0..23u32).map(|i| (i * 37 + 11) as u8).collect();
    let prompts = batch_prompts(&prompt, 3);
    let mut failures = Vec::new();
    for (name, case) in matrix() {
        let be = CudaBackend::new(0).unwrap_or_else(|e| panic!("this test needs a CUDA device: {e}"));
        let topo = case.topology();
        match verify_compute_on(&topo, &prompts, STEPS, Fill::Canary, be, |_| {}) {
            Ok(r) => {
                eprintln!(
                    "{name}: ok on {}: vs colocated on the GPU {:.2e} (limit {LOGIT_TOLERANCE:.0e}), vs the CPU {:.2e} (limit {:.0e}), tokens {:?}",
                    r.backend,
                    r.max_rel_err,
                    r.device_rel_err,
                    device_tolerance(&topo),
                    String::from_utf8_lossy(&r.tokens)
                );
                assert_eq!(r.backend, "cuda", "{name}");
                assert_eq!(r.tokens.len(), STEPS as usize + 1, "{name}");
            }
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    assert!(failures.is_empty(), "{} of {} topologies failed:\n{}", failures.len(), matrix().len(), failures.join("\n"));
}
