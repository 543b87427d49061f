//! Property tests of the planner over random valid topologies, and the coalescing
//! figures on scattered block layouts.

mod common;
use common::Shape;
use handoff::check::oracle;
use handoff::check::verify::verify;
use handoff_components::layout::{ConsumerLayout, ProducerLayout};
use handoff_components::vocab::{DecodeRank, PrefillRank, RankId, RegionKind};
use handoff_systems::placement::place_rank;
use handoff_systems::splitting::{plan_pair, share};
use proptest::prelude::*;

fn shape_strategy() -> impl Strategy<Value = (Shape, u64, u32)> {
    (1u32..=4, 0usize..3, 0usize..4, 0usize..4, 1u32..=8, 0usize..4, prop::bool::ANY, 1u64..=70, 1u32..=3, 0usize..3).prop_filter_map(
        "valid shape",
        |(pp, ptp_i, dtp_i, dcp_i, pbs, dbs_i, replay, tokens, requests, pat)| {
            let ptp = [1, 2, 4][ptp_i];
            let dtp = [1, 2, 4, 8][dtp_i];
            let dcp = [1, 2, 4, 8][dcp_i];
            let dbs = [1, 2, 4, 8][dbs_i];
            if dtp % ptp != 0 || dtp % dcp != 0 {
                return None;
            }
            let interleave = if tokens % 2 == 0 { 1 } else { dbs };
            let pattern = ["KKKM", "KM", "MKK"][pat];
            let shape = Shape { pp, ptp, dtp, dcp, pbs, dbs, interleave, pattern, replay: replay.then_some(2), ..Default::default() };
            Some((shape, tokens, requests))
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Invariant: for any valid topology, prompt length and number of requests in
    /// flight, every consumer byte equals what the rules say, every other byte is
    /// untouched, each destination byte is written once, coalescing never adds
    /// descriptors, and release returns the entity count to its baseline.
    #[test]
    fn any_valid_topology_hands_off_byte_exact((shape, tokens, requests) in shape_strategy()) {
        let topo = shape.topology();
        let r = verify(&topo, tokens, requests, |_| {});
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
        let r = r.unwrap();
        prop_assert!(r.descriptors <= r.uncoalesced);
        prop_assert_eq!(r.entities_after, r.entities_baseline);
    }

    /// Invariant: with the blocks of both sides scattered at random, the plan still
    /// copies exactly the rule's bytes (checked by verify's byte counts elsewhere) and
    /// a token-interleaved DCP relayout needs at least 16x fewer descriptors than one
    /// per token row, for 128-token blocks over 8 DCP ranks.
    #[test]
    fn scattered_blocks_coalesce_at_least_16x(seed in 0u64..1000) {
        let topo = Shape { pbs: 128, dbs: 128, dtp: 8, dcp: 8, pattern: "M", layers: 4, ..Default::default() }.topology();
        let tokens = 8192u64;
        let producer = ProducerLayout {
            rank: PrefillRank { pp: 0, tp: 0 },
            blocks: shuffled(64, 4 * 64, seed),
            slot: 0,
            layout: place_rank(&topo, RankId::Prefill(PrefillRank { pp: 0, tp: 0 }), 4 * 64, 1),
        };
        for tp in 0..8 {
            let rank = DecodeRank { tp };
            let consumer = ConsumerLayout {
                rank, tp: 8, dcp: 8, interleave: 1,
                blocks: shuffled(8, 64, seed ^ tp as u64),
                slot: 0,
                layout: place_rank(&topo, RankId::Decode(rank), 64, 1),
            };
            let plan = plan_pair(&producer, &consumer, tokens, share(1, 8, 0, tp)).unwrap();
            let rows = plan.uncoalesced;
            prop_assert_eq!(rows, 1024 * 4);
            prop_assert!(rows >= 16 * plan.descriptors.len() as u64, "{} rows, {} descriptors", rows, plan.descriptors.len());
            prop_assert_eq!(plan.bytes_of(RegionKind::MlaKv), oracle::expected_bytes(&topo, rank, tokens)[&RegionKind::MlaKv]);
        }
    }
}

/// `n` distinct block ids out of `0..of`, in a seeded random order.
fn shuffled(n: usize, of: u32, seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..of).collect();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v.truncate(n);
    v
}

/// `handoff plan --json` reports, for each kind, the bytes the rules say (summed
/// over decode ranks from the oracle's rule-derived counts), on several topologies.
#[test]
fn plan_json_bytes_match_the_rules() {
    let shapes = [
        Shape { pp: 3, ptp: 2, dtp: 4, dcp: 2, interleave: 4, replay: Some(3), ..Default::default() },
        Shape { pp: 8, ptp: 1, dtp: 8, dcp: 8, ..Default::default() },
        Shape { pp: 1, ptp: 1, dtp: 1, dcp: 1, indexer: 4, ..Default::default() },
    ];
    for shape in shapes {
        let topo = shape.topology();
        let path = std::env::temp_dir().join(format!("handoff-planjson-{}-{}.toml", std::process::id(), shape.pp));
        std::fs::write(&path, shape.toml()).unwrap();
        for tokens in [1u64, 37, 64] {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_handoff"))
                .args(["plan", "--json", "--tokens", &tokens.to_string(), "--config"])
                .arg(&path)
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(v["tokens"], tokens);
            let mut want = std::collections::BTreeMap::<&str, u64>::new();
            for tp in 0..topo.decode().tp {
                for (k, b) in oracle::expected_bytes(&topo, DecodeRank { tp }, tokens) {
                    *want.entry(k.name()).or_default() += b;
                }
            }
            want.retain(|_, b| *b > 0);
            for (k, b) in &want {
                assert_eq!(v["totals"]["by_kind"][k].as_u64(), Some(*b), "{k} at {tokens} tokens");
            }
            let pair_sum: u64 = v["pairs"].as_array().unwrap().iter().map(|p| p["bytes"].as_u64().unwrap()).sum();
            assert_eq!(pair_sum, v["totals"]["bytes"].as_u64().unwrap());
            assert_eq!(v["totals"]["bytes"].as_u64().unwrap(), want.values().sum::<u64>());
            assert!(v["totals"]["plan_us"].as_f64().unwrap() > 0.0);
        }
        let _ = std::fs::remove_file(&path);
    }
}
