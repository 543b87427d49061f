//! `handoff bench serve` is honest about failures: it lists them by HTTP status and
//! reason, counts tok/s over the successful requests only, and exits non-zero when
//! a request failed unless `--allow-failures` is given.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_handoff");
const SMALL: &str = include_str!("../config/small.toml");

/// small.toml with a context so short that the bench's longer prompts (32 to 127
/// bytes, 16 tokens each) are refused with 400 while the shorter ones are served.
fn short_context_config() -> std::path::PathBuf {
    let base = SMALL.split("[serve]").next().expect("small.toml");
    let text = format!("{base}[serve]\nmax_context = 100\nmax_requests = 8\nqueue = 16\n");
    let p = std::env::temp_dir().join(format!("handoff-bench-fail-{}.toml", std::process::id()));
    std::fs::write(&p, text).expect("write config");
    p
}

fn bench(config: &std::path::Path, extra: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(BIN)
        .args(["bench", "serve", "--config"])
        .arg(config)
        .args(["--concurrency", "2", "--requests", "8"])
        .args(extra)
        .output()
        .expect("run handoff bench serve");
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn bench_serve_lists_failures_by_status_and_reason_and_exits_nonzero_unless_allowed() {
    let config = short_context_config();
    let (code, stdout, stderr) = bench(&config, &[]);
    assert_eq!(code, Some(2), "a failed request must fail the run\nstdout:\n{stdout}\nstderr:\n{stderr}");
    // Prompts of 32 + (i * 37) % 96 bytes for i in 0..8: 32, 69, 106, 47, 84, 121, 62, 99;
    // three do not fit 100 - 16 tokens.
    assert!(stdout.contains("3 of 8 requests failed"), "{stdout}");
    assert!(stdout.contains("count the 5 that succeeded"), "{stdout}");
    // Three different reasons (two prompts too long, one leaving too little room).
    let lines: Vec<&str> = stdout.lines().filter(|l| l.contains("1 x HTTP 400:") && l.contains("serve.max_context 100")).collect();
    assert_eq!(lines.len(), 3, "reasons missing:\n{stdout}");
    assert!(stderr.contains("3 of 8 requests failed"), "{stderr}");
    let (code, stdout, stderr) = bench(&config, &["--allow-failures"]);
    assert_eq!(code, Some(0), "--allow-failures exits 0\nstdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("3 of 8 requests failed"), "{stdout}");
    let _ = std::fs::remove_file(config);
}
