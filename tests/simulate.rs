//! `handoff simulate` (src/bench/simulate.rs): its arithmetic checked
//! independently of its own code paths (bytes against the planner's plans and the
//! oracle's rules, the NIC mapping by hand, the rate and time relations), and the
//! command's refusal of values it cannot mean.

use handoff::bench::simulate::{self, SimOptions, SimReport, nic_loads};
use handoff::check::oracle;
use handoff_components::Topology;
use handoff_components::vocab::DecodeRank;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_handoff");
const FLAGSHIP: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/config/k3-pp8-tp8dcp8.toml");

fn options(nics: u32, tokens: u64) -> SimOptions {
    SimOptions { nics, nic_gbps: 400.0, efficiency: 1.0, rate: 2.0, prompt_tokens: tokens, decode_nodes: 1, prefill_instances: None }
}

fn run(topo: &Topology, o: &SimOptions) -> SimReport {
    simulate::simulate(topo, FLAGSHIP, o).expect("simulate")
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-300)
}

#[test]
fn bytes_per_request_equal_the_planners_plans_and_the_oracles_rules() {
    let topo = Topology::load(FLAGSHIP).expect("flagship");
    for tokens in [1, 4_097, 32_768] {
        let r = run(&topo, &options(8, tokens));
        let (_, jobs, _) = handoff::bench::transfer::planned(&topo, tokens, 1).expect("plans");
        let planner: u64 = jobs.iter().map(|(_, p)| p.bytes()).sum();
        let rules: u64 = (0..topo.decode().tp).flat_map(|tp| oracle::expected_bytes(&topo, DecodeRank { tp }, tokens).into_values()).sum();
        assert_eq!(r.request.total(), planner, "{tokens} tokens: the simulator's bytes are not the planner's");
        assert_eq!(planner, rules, "{tokens} tokens: the planner and the oracle disagree");
        assert_eq!(r.request.producers.values().sum::<u64>(), planner, "{tokens} tokens: every byte leaves some prefill rank once");
        assert_eq!(r.request.descriptors, jobs.iter().map(|(_, p)| p.descriptors.len() as u64).sum::<u64>());
    }
    // The MLA part by hand: 23 MLA layers x 1152 B a token, every token to one decode rank.
    let r = run(&topo, &options(8, 32_768));
    let mla = r.request.by_kind.iter().find(|(k, _)| k.to_string() == "mla.kv").map(|(_, b)| *b);
    assert_eq!(mla, Some(23 * 1152 * 32_768));
}

#[test]
fn nics_carry_their_ranks_bytes_as_the_model_says() {
    // Fewer NICs than ranks: NIC j carries ranks j, j + nics, ...
    assert_eq!(nic_loads(&[10, 20, 30], 2), vec![40.0, 20.0]);
    assert_eq!(nic_loads(&[10, 20, 30], 1), vec![60.0]);
    // As many: one rank each.
    assert_eq!(nic_loads(&[10, 20, 30], 3), vec![10.0, 20.0, 30.0]);
    // More: rank i over NICs i, i + ranks, ... (7 NICs, 3 ranks: 3, 2 and 2 NICs).
    assert_eq!(nic_loads(&[30, 20, 10], 6), vec![15.0, 10.0, 5.0, 15.0, 10.0, 5.0]);
    assert_eq!(nic_loads(&[30, 20, 10], 7), vec![10.0, 10.0, 5.0, 10.0, 10.0, 5.0, 10.0]);
    // No byte is lost or counted twice.
    for nics in 1..40 {
        let bytes = [7, 1_000, 33, 0, 5_000_001, 12, 9, 64];
        let sum: f64 = nic_loads(&bytes, nics).iter().sum();
        assert!(close(sum, bytes.iter().sum::<u64>() as f64), "{nics} NICs: {sum}");
    }
}

#[test]
fn doubling_the_nics_halves_the_transfer_time_where_link_bound() {
    let topo = Topology::load(FLAGSHIP).expect("flagship");
    // 8 ranks a node: 8 -> 16 -> 32 NICs stripes each rank over 1, 2, 4 NICs.
    let t8 = run(&topo, &options(8, 32_768)).headline;
    let t16 = run(&topo, &options(16, 32_768)).headline;
    let t32 = run(&topo, &options(32, 32_768)).headline;
    assert!(close(t16.transfer_s, t8.transfer_s / 2.0), "{} vs {}", t16.transfer_s, t8.transfer_s);
    assert!(close(t32.transfer_s, t8.transfer_s / 4.0));
    assert!(close(t16.max_rate, 2.0 * t8.max_rate));
    // Decode's ranks receive equal bytes, so 4 -> 8 NICs halves that side too.
    let (d4, d8) = (run(&topo, &options(4, 32_768)).headline.decode, t8.decode);
    assert!(close(d8.busiest_link_bytes, d4.busiest_link_bytes / 2.0));
    // The time is the busiest link's bytes over its rate, computed by hand.
    let r = run(&topo, &options(8, 32_768));
    let busiest = r.request.producers.values().chain(r.request.consumers.values()).copied().max().expect("ranks") as f64;
    assert!(close(r.headline.transfer_s, busiest / (400e9 / 8.0)), "{} vs {}", r.headline.transfer_s, busiest / 50e9);
    // Efficiency scales it: Mooncake's 190 of 400 GB/s.
    assert!(close(r.at_mooncake.transfer_s, r.headline.transfer_s * 400.0 / 190.0));
}

#[test]
fn the_largest_rate_is_capacity_over_bytes_and_fills_the_busiest_link() {
    let topo = Topology::load(FLAGSHIP).expect("flagship");
    let r = run(&topo, &options(8, 65_536));
    let link = 400e9 / 8.0;
    let (h, req) = (r.headline, &r.request);
    // Decode's side is balanced: its bound is the node's capacity over the request's bytes.
    assert!(close(h.decode.max_rate(link), 8.0 * link / req.total() as f64), "{} vs {}", h.decode.max_rate(link), 8.0 * link / req.total() as f64);
    // The cluster's bound is the lower side's: here the busiest prefill rank's link.
    let busiest_producer = *req.producers.values().max().expect("producers") as f64;
    assert!(close(h.max_rate, (link / busiest_producer).min(8.0 * link / req.total() as f64)));
    // At that rate the busiest link is busy all the time, and waiting is unbounded.
    let full = simulate::predict(req, &SimOptions { rate: h.max_rate, ..options(8, 65_536) }, 1, 1);
    assert!(close(full.occupancy.0.max(full.occupancy.1), 1.0), "{:?}", full.occupancy);
    assert_eq!(full.loaded_transfer_s, None);
    // Occupancy is linear in the rate and falls with the nodes sharing it.
    let half = simulate::predict(req, &SimOptions { rate: h.max_rate / 2.0, ..options(8, 65_536) }, 1, 1);
    assert!(close(half.occupancy.0, full.occupancy.0 / 2.0));
    // M/D/1 at rho = 1/2: the wait is half the service time.
    let rho = half.occupancy.0.max(half.occupancy.1);
    assert!(close(rho, 0.5));
    assert!(close(half.loaded_transfer_s.expect("bounded"), half.transfer_s + 0.5 * half.transfer_s));
    // The sweep: 1 to 64 decode nodes, a prefill instance each, linear in the nodes.
    let nodes: Vec<u32> = r.sweep.iter().map(|p| p.decode_nodes).collect();
    assert_eq!(nodes, vec![1, 2, 4, 8, 16, 32, 64]);
    for p in &r.sweep {
        assert_eq!(p.prefill_instances, p.decode_nodes);
        assert!(close(p.max_rate, f64::from(p.decode_nodes) * r.sweep[0].max_rate));
    }
    // With one prefill instance fixed, its links cap the cluster whatever the decode nodes.
    let fixed = run(&topo, &SimOptions { prefill_instances: Some(1), ..options(8, 65_536) });
    assert!(fixed.sweep.iter().all(|p| close(p.max_rate, fixed.sweep[0].max_rate)));
}

fn simulate_cli(args: &[&str]) -> (bool, String, String) {
    let mut all = vec!["simulate", "--config", FLAGSHIP];
    all.extend_from_slice(args);
    let out = Command::new(BIN).args(&all).output().expect("run simulate");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn the_command_prints_its_model_assumptions_and_comparisons() {
    let (ok, out, err) = simulate_cli(&["--nics", "8", "--nic-gbps", "400", "--rate", "2", "--prompt-tokens", "4096"]);
    assert!(ok, "{err}");
    for want in [
        "a model, not a measurement",
        "model assumptions:",
        "non-blocking fabric",
        "every decode rank's bytes equal the oracle's count",
        "transfer time per request (alone):",
        "link occupancy at 2 requests/s:",
        "largest request rate the links sustain:",
        "Mooncake (published: 190 GB/s over 8 x 400 Gb/s",
        "seed PR (#3069)",
        "      64       64",
    ] {
        assert!(out.contains(want), "{out}\ndoes not say {want:?}");
    }
}

#[test]
fn the_command_refuses_values_it_cannot_mean_naming_the_flag() {
    let base = ["--nics", "8", "--nic-gbps", "400", "--rate", "2", "--prompt-tokens", "4096"];
    let cases: &[(&str, &str, &str)] = &[
        ("--nics", "0", "--nics 0"),
        ("--nics", "5000", "--nics 5000"),
        ("--nic-gbps", "0", "--nic-gbps 0"),
        ("--nic-gbps", "-400", "--nic-gbps -400"),
        ("--nic-gbps", "NaN", "--nic-gbps NaN"),
        ("--nic-gbps", "inf", "--nic-gbps inf"),
        ("--rate", "0", "--rate 0"),
        ("--rate", "-1", "--rate -1"),
        ("--prompt-tokens", "0", "--prompt-tokens 0"),
        ("--prompt-tokens", "2000000", "--prompt-tokens 2000000"),
        ("--efficiency", "1.5", "--efficiency 1.5"),
        ("--decode-nodes", "0", "--decode-nodes 0"),
        ("--prefill-instances", "0", "--prefill-instances 0"),
    ];
    for (flag, value, want) in cases {
        let mut args: Vec<&str> = Vec::new();
        let mut i = 0;
        while i < base.len() {
            if base[i] == *flag {
                i += 2;
                continue;
            }
            args.push(base[i]);
            i += 1;
        }
        let flag_value = format!("{flag}={value}");
        args.push(&flag_value);
        let (ok, out, err) = simulate_cli(&args);
        assert!(!ok, "{flag} {value} was accepted: {out}");
        assert!(err.contains(want), "{flag} {value}: {err:?} does not say {want:?}");
    }
}
