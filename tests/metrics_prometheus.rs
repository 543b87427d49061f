//! `/metrics` read as Prometheus would read it: the exposition is parsed by the
//! official client's text parser (`prometheus_client`, tests/prom_parse.py), and
//! the figures it holds are checked against what the test did:
//! - counters end in `_total`, units are in the names;
//! - TTFT, inter-token and end-to-end latency are histograms counting every choice
//!   and every token gap the test asked for;
//! - every role's engine reports each system's run times (per system and per
//!   phase) as histograms;
//! - gauges of a role go to zero when it stops answering;
//! - with `HANDOFF_TRACE_DIR` every role writes a Perfetto trace holding its
//!   engine's system spans.
//!
//! Under CI (`CI=true`) a missing python3 or `prometheus_client` fails the test; on
//! a developer's machine without them it says so and passes.

use handoff::roles::up::{Deployment, free_port};
use serde_json::Value;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_handoff");
const SMALL: &str = include_str!("../config/small.toml");

fn python_with_prometheus_client() -> bool {
    Command::new("python3").args(["-c", "import prometheus_client.parser"]).output().is_ok_and(|o| o.status.success())
}

/// The families of `/metrics`, as the official parser reads them.
fn scrape(c: &Deployment) -> Vec<Value> {
    let text = c.http("GET", "/metrics", None).expect("GET /metrics").body;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/prom_parse.py");
    let mut child = Command::new("python3").arg(script).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("python3");
    child.stdin.take().expect("stdin").write_all(text.as_bytes()).expect("write metrics");
    let out = child.wait_with_output().expect("parser");
    assert!(out.status.success(), "the Prometheus parser refused /metrics: {}\n{text}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("parser output")
}

fn family<'a>(fams: &'a [Value], name: &str) -> &'a Value {
    fams.iter().find(|f| f["name"] == name).unwrap_or_else(|| panic!("no family {name} in /metrics"))
}

/// The value of the sample `name` whose labels include every pair of `labels`.
fn sample(fam: &Value, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    fam["samples"].as_array()?.iter().find(|s| s["name"] == name && labels.iter().all(|(k, v)| s["labels"][*k] == *v))?["value"].as_f64()
}

/// Checks one histogram series: buckets never decrease and `+Inf` equals `_count`.
fn check_buckets(fam: &Value, base: &str, labels: &[(&str, &str)]) -> f64 {
    let samples = fam["samples"].as_array().expect("samples");
    let mut last = 0.0;
    let mut inf = None;
    for s in samples.iter().filter(|s| s["name"] == format!("{base}_bucket") && labels.iter().all(|(k, v)| s["labels"][*k] == *v)) {
        if s["labels"]["le"] == "+Inf" {
            inf = s["value"].as_f64();
        } else {
            let v = s["value"].as_f64().expect("bucket value");
            assert!(v >= last, "{base} {labels:?}: bucket le={} holds {v} < {last}", s["labels"]["le"]);
            last = v;
        }
    }
    let count = sample(fam, &format!("{base}_count"), labels).unwrap_or_else(|| panic!("{base}_count {labels:?}"));
    assert_eq!(inf, Some(count), "{base} {labels:?}: +Inf bucket against _count");
    assert!(last <= count, "{base} {labels:?}");
    count
}

#[test]
fn metrics_parse_as_prometheus_and_count_what_was_served() {
    if !python_with_prometheus_client() {
        let msg = "python3 with the `prometheus_client` package is needed (pip install prometheus_client)";
        assert!(std::env::var("CI").map_or(true, |v| v != "true"), "{msg}");
        eprintln!("skipped: {msg}");
        return;
    }
    let base = SMALL.split("[serve]").next().expect("small.toml");
    let path = std::env::temp_dir().join(format!("handoff-metrics-{}.toml", std::process::id()));
    std::fs::write(&path, format!("{base}[serve]\nmax_context = 4096\nmax_requests = 8\nqueue = 32\n")).expect("write config");
    let traces = std::env::temp_dir().join(format!("handoff-metrics-traces-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&traces);
    std::fs::create_dir_all(&traces).expect("trace dir");
    let envs = vec![(handoff::roles::up::TRACE_DIR_ENV.to_string(), traces.to_string_lossy().into_owned())];
    let mut c = Deployment::start_with(Some(&path), "127.0.0.1", free_port().expect("port"), Some(PathBuf::from(BIN)), envs).expect("start cluster");
    c.wait_healthy(Duration::from_secs(60), false).expect("healthy");

    // 5 completions of 6 tokens, one of them with n = 2: 6 choices, 6 x 5 token gaps.
    let (max_tokens, requests) = (6u32, 5u32);
    for i in 0..requests {
        let n = if i == 0 { 2 } else { 1 };
        let body = serde_json::json!({"prompt": format!("metrics {i}"), "max_tokens": max_tokens, "n": n}).to_string();
        let r = c.http("POST", "/v1/completions", Some(&body)).expect("completion");
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let choices = f64::from(requests + 1);
    // And one refused before it is enqueued.
    let r = c.http("POST", "/v1/completions", Some(r#"{"prompt": "x", "max_tokens": 0}"#)).expect("refusal");
    assert_eq!(r.status, 400, "{}", r.body);

    // The roles' heartbeats carry their engines' counts and timings every 300 ms.
    std::thread::sleep(Duration::from_millis(800));
    let fams = scrape(&c);
    for f in &fams {
        if f["type"] == "counter" {
            for s in f["samples"].as_array().expect("samples") {
                let n = s["name"].as_str().expect("name");
                assert!(n.ends_with("_total") || n.ends_with("_created"), "counter sample {n} without _total");
            }
        }
    }
    assert_eq!(sample(family(&fams, "handoff_requests"), "handoff_requests_total", &[("outcome", "ok")]), Some(f64::from(requests)));
    assert_eq!(sample(family(&fams, "handoff_refusals"), "handoff_refusals_total", &[]), Some(1.0));
    assert_eq!(sample(family(&fams, "handoff_generated_tokens"), "handoff_generated_tokens_total", &[]), Some(choices * f64::from(max_tokens)));

    for (name, expect) in [
        ("handoff_time_to_first_token_seconds", choices),
        ("handoff_inter_token_latency_seconds", choices * f64::from(max_tokens - 1)),
        ("handoff_e2e_request_latency_seconds", choices),
    ] {
        let f = family(&fams, name);
        assert_eq!(f["type"], "histogram", "{name}");
        assert_eq!(check_buckets(f, name, &[]), expect, "{name}_count");
        assert!(sample(f, &format!("{name}_sum"), &[]).expect("sum") > 0.0, "{name}_sum");
    }
    let phases = family(&fams, "handoff_phase_seconds");
    assert_eq!(phases["type"], "histogram");
    for ph in ["queue", "handoff", "decode"] {
        assert_eq!(check_buckets(phases, "handoff_phase_seconds", &[("phase", ph)]), choices, "phase {ph}");
    }

    // Every role's engine: each phase of its schedule ran, and its systems are timed.
    let sys = family(&fams, "handoff_engine_system_seconds");
    let per_phase = family(&fams, "handoff_engine_phase_seconds");
    assert_eq!((sys["type"].as_str(), per_phase["type"].as_str()), (Some("histogram"), Some("histogram")));
    for role in ["decode", "prefill0", "prefill1"] {
        let systems: Vec<&Value> = sys["samples"]
            .as_array()
            .expect("samples")
            .iter()
            .filter(|s| s["labels"]["role"] == role && s["name"] == "handoff_engine_system_seconds_count")
            .collect();
        assert!(systems.len() >= 6, "{role}: {} systems timed", systems.len());
        for s in &systems {
            let system = s["labels"]["system"].as_str().expect("system");
            let phase = s["labels"]["phase"].as_str().expect("phase");
            check_buckets(sys, "handoff_engine_system_seconds", &[("role", role), ("system", system), ("phase", phase)]);
        }
        for ph in ["admission", "placement", "splitting", "transfer", "release", "dispatch"] {
            let runs = check_buckets(per_phase, "handoff_engine_phase_seconds", &[("role", role), ("phase", ph)]);
            assert!(runs > 0.0, "{role}: no run of phase {ph}");
        }
        assert_eq!(sample(family(&fams, "handoff_engine_requests"), "handoff_engine_requests", &[("role", role)]), Some(0.0), "{role} still holds requests");
        assert_eq!(
            sample(family(&fams, "handoff_sampling_entries"), "handoff_sampling_entries", &[("role", role)]),
            Some(0.0),
            "{role} still holds sampling state"
        );
        assert_eq!(sample(family(&fams, "handoff_prefill_settled"), "handoff_prefill_settled", &[("role", role)]), Some(0.0), "{role} settled without a fault");
        assert!(sample(family(&fams, "handoff_resident_memory_bytes"), "handoff_resident_memory_bytes", &[("role", role)]).expect("rss") > 0.0);
    }

    // A stopped decode: found by its heartbeat, and its gauges read 0 while it is down.
    let decode = c.pid("decode").expect("decode pid") as libc::pid_t;
    let body = serde_json::json!({"prompt": "held while stopped", "max_tokens": 4000}).to_string();
    let addr = c.addr.clone();
    let client = std::thread::spawn(move || handoff::roles::wire::http(&addr, "POST", "/v1/completions", Some(&body), Duration::from_secs(60)));
    let t0 = Instant::now();
    while sample(family(&scrape(&c), "handoff_engine_requests"), "handoff_engine_requests", &[("role", "decode")]) != Some(1.0) {
        assert!(t0.elapsed() < Duration::from_secs(20), "decode never held the request");
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: kill(2) on the cluster's own decode process.
    unsafe { libc::kill(decode, libc::SIGSTOP) };
    let t0 = Instant::now();
    let down = loop {
        let f = scrape(&c);
        if sample(family(&f, "handoff_role_up"), "handoff_role_up", &[("role", "decode")]) == Some(0.0) {
            break f;
        }
        assert!(t0.elapsed() < Duration::from_secs(15), "a stopped decode was not found down");
        std::thread::sleep(Duration::from_millis(100));
    };
    for gauge in ["handoff_engine_requests", "handoff_engine_entities", "handoff_engine_plans", "handoff_resident_memory_bytes"] {
        assert_eq!(sample(family(&down, gauge), gauge, &[("role", "decode")]), Some(0.0), "{gauge} of a stopped decode");
    }
    assert_eq!(sample(family(&down, "handoff_live_requests"), "handoff_live_requests", &[]), Some(0.0));
    // SAFETY: as above.
    unsafe { libc::kill(decode, libc::SIGCONT) };
    let r = client.join().expect("client thread").expect("answer");
    assert_eq!(r.status, 500, "the request decode held while stopped: {}", r.body);
    assert!(r.body.contains("decode"), "{}", r.body);
    c.wait_healthy(Duration::from_secs(30), false).expect("decode back");
    let after = scrape(&c);
    assert!(sample(family(&after, "handoff_request_failures"), "handoff_request_failures_total", &[("role", "decode")]).unwrap_or(0.0) >= 1.0);
    assert!(
        sample(family(&after, "handoff_request_timeouts"), "handoff_request_timeouts_total", &[("phase", "decode")]).unwrap_or(0.0) >= 1.0,
        "a stopped decode counts as a timeout"
    );

    // The traces: each role wrote one, finished when it stopped, with its systems.
    c.shutdown();
    for role in ["proxy", "decode", "prefill-0", "prefill-1"] {
        let f = traces.join(format!("{role}.json"));
        let text = std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: not a finished JSON trace: {e}", f.display()));
        let events = v.as_array().or_else(|| v["traceEvents"].as_array()).expect("trace events");
        if role != "proxy" {
            let systems = events.iter().filter(|e| e["name"] == "system").count();
            assert!(systems > 100, "{role}: {systems} system spans in its trace");
            assert!(events.iter().any(|e| e["args"]["name"].as_str().is_some_and(|n| n.contains("dispatch"))), "{role}: no dispatch system in its trace");
        }
    }
    let _ = std::fs::remove_dir_all(&traces);
}
