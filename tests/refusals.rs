//! Every startup refusal: the typed error, its message naming the values, and the CLI
//! printing `error: <message>` with exit status 2.

mod common;
use common::Shape;
use handoff_components::Topology;
use handoff_components::config::ConfigError;
use std::process::Command;

fn refuse(toml: &str) -> ConfigError {
    Topology::parse(toml).expect_err("must be refused")
}

/// Runs `handoff check` on the text; returns (status, stderr).
fn cli_check(toml: &str) -> (i32, String) {
    let dir = std::env::temp_dir().join(format!("handoff-refusal-{}-{}", std::process::id(), rand_suffix(toml)));
    std::fs::write(&dir, toml).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_handoff")).args(["check", "--config"]).arg(&dir).output().unwrap();
    let _ = std::fs::remove_file(&dir);
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn rand_suffix(s: &str) -> u64 {
    s.bytes().fold(1469598103934665603u64, |h, b| (h ^ b as u64).wrapping_mul(1099511628211))
}

fn assert_cli(toml: &str, needles: &[&str]) {
    let (code, err) = cli_check(toml);
    assert_eq!(code, 2, "exit status for:\n{err}");
    assert!(err.starts_with("error: "), "{err}");
    for n in needles {
        assert!(err.contains(n), "stderr lacks {n:?}: {err}");
    }
}

#[test]
fn decode_tp_not_a_multiple_of_prefill_tp_names_both() {
    let t = Shape { ptp: 4, dtp: 2, ..Default::default() }.toml();
    assert_eq!(refuse(&t), ConfigError::DecodeTpNotMultiple { decode_tp: 2, prefill_tp: 4 });
    assert_cli(&t, &["decode tp 2", "prefill tp 4"]);
    let (_, err) = cli_check(&t);
    assert!(!err.contains("slot size"), "{err}");
}

#[test]
fn heads_that_cannot_split_over_decode_tp_name_region_heads_and_tp() {
    let t = Shape { kda_heads: 6, dtp: 4, ..Default::default() }.toml();
    assert!(matches!(refuse(&t), ConfigError::HeadsNotSplit { region: "kda.state", heads: 6, tp: 4, .. }));
    assert_cli(&t, &["kda.state", "6 heads", "decode tp 4"]);
}

#[test]
fn indexer_under_pp_is_refused_by_name() {
    let t = Shape { indexer: 16, pp: 2, ..Default::default() }.toml();
    assert_eq!(refuse(&t), ConfigError::IndexerUnderPp { indexer_dim: 16, pp: 2 });
    assert_cli(&t, &["mla.indexer", "pp 2"]);
}

#[test]
fn dcp_not_dividing_decode_tp_is_refused() {
    let t = Shape { dtp: 4, dcp: 3, ..Default::default() }.toml();
    assert_eq!(refuse(&t), ConfigError::DcpNotDividingTp { dcp: 3, tp: 4 });
    assert_cli(&t, &["dcp 3", "tp 4"]);
}

#[test]
fn interleave_not_dividing_block_size_is_refused() {
    let t = Shape { interleave: 3, dbs: 4, ..Default::default() }.toml();
    assert_eq!(refuse(&t), ConfigError::InterleaveNotDividingBlock { interleave: 3, block_size: 4 });
    assert_cli(&t, &["interleave 3", "block_size 4"]);
}

#[test]
fn layer_splits_that_do_not_fit_are_refused() {
    let t = Shape { pp: 2, split: vec![3, 3], ..Default::default() }.toml();
    assert!(matches!(refuse(&t), ConfigError::SplitSum { sum: 6, num_layers: 8, .. }));
    assert_cli(&t, &["[3, 3]", "sums to 6", "num_layers is 8"]);
    let t = Shape { pp: 3, split: vec![4, 4], ..Default::default() }.toml();
    assert!(matches!(refuse(&t), ConfigError::SplitLen { len: 2, pp: 3, .. }));
    let t = Shape { pp: 2, split: vec![8, 0], ..Default::default() }.toml();
    assert!(matches!(refuse(&t), ConfigError::SplitEmptyStage { stage: 1, .. }));
    let t = Shape { pp: 9, ..Default::default() }.toml();
    assert_eq!(refuse(&t), ConfigError::PpExceedsLayers { pp: 9, num_layers: 8 });
}

#[test]
fn zero_sizes_and_bad_patterns_are_refused() {
    let t = Shape { dcp: 0, ..Default::default() }.toml();
    assert_eq!(refuse(&t), ConfigError::Zero { field: "decode.dcp" });
    assert_cli(&t, &["decode.dcp"]);
    let t = Shape { pattern: "KXM", ..Default::default() }.toml();
    assert!(matches!(refuse(&t), ConfigError::Pattern { .. }));
}

/// `[transport.rdma]` values verbs cannot take are refused at startup, naming
/// the field and the value.
#[test]
fn bad_rdma_port_gid_index_and_device_are_refused_by_name() {
    let base = Shape::default().toml();
    for (table, field, value) in [("port = 0", "port", "0"), ("gid_index = 256", "gid_index", "256"), ("device = \"mlx5 0\"", "device", "\"mlx5 0\"")] {
        let t = format!("{base}\n[transport.rdma]\n{table}\n");
        assert!(matches!(refuse(&t), ConfigError::Rdma { field: f, .. } if f == field), "{table}");
        assert_cli(&t, &[&format!("[transport.rdma] {field} = {value}")]);
    }
    let ok = format!("{base}\n[transport.rdma]\ndevice = \"mlx5_0\"\nport = 2\ngid_index = 3\n");
    let topo = Topology::parse(&ok).expect("good rdma settings");
    assert_eq!((topo.config.transport.rdma.port(), topo.config.transport.rdma.gid_index()), (Ok(2), Ok(3)));
}

#[test]
fn malformed_files_name_the_field_line_and_expectation() {
    let good = Shape::default().toml();
    // Unknown field.
    let t = good.replace("interleave = 1", "interleave = 1\nspeed = 3");
    assert_cli(&t, &["unknown field `speed`", "line"]);
    // Wrong type.
    let t = good.replace("tp = 1\ndcp", "tp = \"one\"\ndcp");
    assert_cli(&t, &["line", "tp", "u32"]);
    // Missing table.
    let t = good.replace("[decode]", "[decoder]");
    let (code, err) = cli_check(&t);
    assert_eq!(code, 2);
    assert!(err.contains("decode"), "{err}");
    // Missing file.
    let out = Command::new(env!("CARGO_BIN_EXE_handoff")).args(["check", "--config", "/nonexistent/x.toml"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/x.toml"));
}

/// Chunked transfer of a stateful model to a DCP decode is served (issue 21,
/// item 4): admission takes it, and the plans carry the rows in chunks with the
/// state in the last (tests/chunked_transfer.rs, tests/serve_e2e.rs). A chunk of
/// zero tokens is refused at startup, naming the field.
#[test]
fn chunked_stateful_transfer_to_dcp_is_admitted_and_a_zero_chunk_is_refused() {
    let t = Shape { dtp: 2, dcp: 2, ..Default::default() }.toml().replace("layer_split = []", "layer_split = []\nchunked = true\nchunk_tokens = 8");
    let topo = Topology::parse(&t).expect("startup accepts it");
    assert_eq!(topo.admits_transfer_mode(), Ok(()));
    assert!(handoff_systems::admission::validate(&topo, 40).is_ok());
    let zero = t.replace("chunk_tokens = 8", "chunk_tokens = 0");
    let e = Topology::parse(&zero).expect_err("a chunk of no token").to_string();
    assert!(e.contains("prefill.chunk_tokens"), "{e}");
}

#[test]
fn shipped_configs_pass_check() {
    for f in std::fs::read_dir("config").unwrap() {
        let p = f.unwrap().path();
        // Topology files only: config/trained/ holds the checkpoint they name.
        if p.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let out = Command::new(env!("CARGO_BIN_EXE_handoff")).args(["check", "--config"]).arg(&p).output().unwrap();
        assert!(out.status.success(), "{}: {}", p.display(), String::from_utf8_lossy(&out.stderr));
    }
}

#[test]
fn the_mps_setting_is_read_printed_and_a_misspelling_refused() {
    let gpu = std::fs::read_to_string("config/gpu.toml").unwrap();
    assert!(Topology::parse(&gpu).unwrap().config.device.mps, "config/gpu.toml sets [device] mps = true");
    let off = gpu.replace("mps = true", "");
    assert!(!Topology::parse(&off).unwrap().config.device.mps, "off unless asked");
    check_names("config/gpu.toml", "MPS server");
    assert_cli(&gpu.replace("mps = true", "mpss = true"), &["mpss"]);
}

#[test]
fn dependent_launches_are_on_unless_turned_off_and_check_says_which() {
    let gpu = std::fs::read_to_string("config/gpu.toml").unwrap();
    assert!(!gpu.contains("dependent_launch"), "config/gpu.toml leaves the default");
    assert!(Topology::parse(&gpu).unwrap().config.device.dependent_launch, "on by default");
    let off = gpu.replace("[device]", "[device]\ndependent_launch = false");
    assert!(!Topology::parse(&off).unwrap().config.device.dependent_launch, "turned off");
    check_names("config/gpu.toml", "dependent_launch = true");
    assert_cli(&gpu.replace("[device]", "[device]\ndependent_lanch = false"), &["dependent_lanch"]);
}

/// `handoff check` on `config` succeeds and its report names `setting`.
fn check_names(config: &str, setting: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_handoff")).args(["check", "--config", config]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains(setting), "check names {setting:?}: {text}");
}
