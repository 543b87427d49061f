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
