use handoff::check::verify::verify;
use handoff_components::Topology;

#[test]
fn shipped_configs_verify() {
    for f in ["config/small.toml", "config/pp3-tp2-to-tp4dcp2.toml"] {
        let topo = Topology::load(f).unwrap();
        for tokens in [1, 17, 64, 100] {
            let r = verify(&topo, tokens, 2, |_| {});
            assert!(r.is_ok(), "{f} tokens {tokens}: {}", r.unwrap_err());
        }
    }
}

fn handoff(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_handoff")).args(args).output().expect("run handoff");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// `verify` with no `--tokens` checks bytes on the shipped small configs (the
/// default fits their serve.max_context), and the runs that would check nothing
/// are refused with status 2 and a reason.
#[test]
fn verify_defaults_fit_the_configs_and_empty_runs_are_refused() {
    for f in ["config/small.toml", "config/pp3-tp2-to-tp4dcp2.toml"] {
        let (code, out, err) = handoff(&["verify", "--config", f]);
        assert_eq!(code, 0, "{f}: {err}");
        assert!(out.contains(": ok:"), "{out}");
    }
    let (code, _, err) = handoff(&["verify", "--config", "config/small.toml", "--requests", "0"]);
    assert_eq!(code, 2);
    assert!(err.contains("--requests 0"), "{err}");
    let (code, _, err) = handoff(&["verify", "--compute", "--config", "config/small.toml", "--steps", "0"]);
    assert_eq!(code, 2);
    assert!(err.contains("--steps 0"), "{err}");
    let (code, out, err) = handoff(&["verify", "--compute", "--config", "config/small.toml", "--requests", "3", "--steps", "4"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("3 requests decoded as one batch"), "{out}");
}

/// `verify --layers N` checks the topology at N layers, says so on its first
/// line (so a reader never takes it for the full model), and refuses a depth
/// the topology cannot split, naming the values: 0, fewer layers than prefill
/// stages, and a `layer_split` that no longer sums.
#[test]
fn verify_at_reduced_depth_says_so_and_refuses_a_depth_that_does_not_split() {
    let (code, out, err) = handoff(&["verify", "--config", "config/medium.toml", "--layers", "6"]);
    assert_eq!(code, 0, "{err}");
    let first = out.lines().next().unwrap_or_default();
    assert!(first.starts_with("verify config/medium.toml at 6 of its 12 layers (--layers): ok:"), "{out}");
    let (code, out, err) = handoff(&["verify", "--compute", "--config", "config/medium.toml", "--layers", "3", "--requests", "1", "--steps", "2"]);
    assert_eq!(code, 0, "{err}");
    let first = out.lines().next().unwrap_or_default();
    assert!(first.starts_with("verify --compute config/medium.toml at 3 of its 12 layers (--layers) on cpu: ok: 1 requests"), "{out}");
    // Without --layers the line names no depth.
    let (code, out, err) = handoff(&["verify", "--config", "config/medium.toml"]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains("--layers"), "{out}");

    for (args, want) in [
        (
            &["--config", "config/medium.toml", "--layers", "0"][..],
            "--layers 0: config/medium.toml cannot be checked at 0 of its 12 layers: model.num_layers must be at least 1",
        ),
        (&["--config", "config/medium.toml", "--layers", "2", "--compute"][..], "prefill pp 3 exceeds model.num_layers 2"),
        (&["--config", "config/pp3-tp2-to-tp4dcp2.toml", "--layers", "8"][..], "prefill layer_split [4, 2, 4] sums to 10 but model.num_layers is 8"),
    ] {
        let (code, out, err) = handoff(&[&["verify"][..], args].concat());
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // A trained checkpoint is one model: --compute does not cut it.
    let (code, _, err) = handoff(&["verify", "--compute", "--config", "config/trained.toml", "--layers", "4"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--layers 4 with --compute") && err.contains("trained checkpoint of 8 layers"), "{err}");
}

/// `verify --fragmented` shows scattered blocks byte-exact: the decode pool is cut
/// into holes before the checked requests are placed, their rows go out as staged
/// groups (the count is printed and not zero), and every byte is checked; with
/// `--transport` the engine's own mover lands them. A request too short to
/// scatter, and the flags with `--compute`, are refused with the reason.
#[test]
fn verify_fragmented_stages_scattered_blocks_and_says_so() {
    let staged = |out: &str| -> u64 {
        let line = out.lines().find(|l| l.starts_with("fragmented decode pool:")).unwrap_or_else(|| panic!("{out}"));
        let n = line.split("staged groups ").nth(1).and_then(|s| s.split_whitespace().next()).unwrap_or_default();
        n.parse().unwrap_or_else(|_| panic!("{line}"))
    };
    for args in [
        &["--config", "config/small.toml"][..],
        &["--config", "config/small.toml", "--transport", "shm"],
        &["--config", "config/pp3-tp2-to-tp4dcp2.toml", "--transport", "tcp"],
    ] {
        let (code, out, err) = handoff(&[&["verify", "--fragmented"][..], args].concat());
        assert_eq!(code, 0, "{args:?}: {err}");
        assert!(out.contains(": ok:") && out.contains("staged groups of"), "{out}");
        assert!(staged(&out) > 0, "{out}");
    }
    // Without the flag the same config's blocks line up: nothing staged.
    let (code, out, _) = handoff(&["verify", "--config", "config/small.toml"]);
    assert_eq!(code, 0);
    assert!(!out.contains("staged"), "{out}");
    for (args, want) in [
        (&["--config", "config/small.toml", "--tokens", "20"][..], "cannot be scattered"),
        (&["--config", "config/small.toml", "--compute"], "--fragmented and --transport check the byte hand-off only"),
    ] {
        let (code, out, err) = handoff(&[&["verify", "--fragmented"][..], args].concat());
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // rdma is a transport verify takes; here (no RDMA device, or a build
    // without the feature) opening it is refused, naming what is missing.
    let (code, _, err) = handoff(&["verify", "--config", "config/small.toml", "--transport", "rdma"]);
    assert_eq!(code, 2);
    assert!(err.contains("rdma transport unavailable") && (err.contains("no RDMA device") || err.contains("built without the `rdma` feature")), "{err}");
    let (code, _, err) = handoff(&["verify", "--config", "config/small.toml", "--transport", "ucx-nope"]);
    assert_eq!(code, 2);
    assert!(err.contains("--transport ucx-nope"), "{err}");
}

/// `bench transfer --transport rdma` on a machine without an RDMA device (or
/// in a build without the `rdma` feature) exits 2 and says what is missing.
#[test]
fn bench_transfer_over_rdma_names_the_missing_device_or_feature() {
    let (code, out, err) = handoff(&["bench", "transfer", "--config", "config/small.toml", "--transport", "rdma", "--tokens", "64"]);
    if handoff::transport::rdma::devices().is_ok_and(|d| !d.is_empty()) {
        assert_eq!(code, 0, "{out}{err}");
        return;
    }
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("no RDMA device") || err.contains("built without the `rdma` feature"), "{err}");
}
