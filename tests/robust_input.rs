//! Robust input (issue 11, point 7): no topology file, control message, tcp frame or
//! HTTP body makes handoff panic, hang or allocate by an untrusted length. The
//! property drivers live in `tests/fuzz/`; here they run a bounded number of cases
//! (`PROPTEST_CASES`, default 1024, from the seed `PROPTEST_RNG_SEED` when set) and
//! every verdict is asserted, with the regression tests of the bugs they found. A
//! long run: `PROPTEST_CASES=100000 cargo test --release --test robust_input`.

mod fuzz;

use fuzz::{DescSpec, FrameCase, FrameConsumer, FrameSpec, Options, PeakAlloc, Report, Target};
use handoff::roles::openai::{self, BodyError, Endpoint};
use handoff::roles::up::{Deployment, free_port};
use handoff::roles::wire;
use handoff::transport::tcp::wire as frames;
use handoff::transport::{PeerAddr, Transport};
use handoff_components::Topology;
use handoff_components::config::ConfigError;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use std::io::{Cursor, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The largest single allocation is the figure that exposes a buffer sized by a
/// peer's length field; this binary records it.
#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

/// One test at a time: the allocation peak is process-wide, so a test that builds a
/// large input on purpose must not run beside one that measures the peak.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1024)
}

/// No reader needs more than this in one allocation for the inputs fuzzed here
/// (the largest legitimate one is a producer's 4 MiB write buffer).
const ALLOC_BOUND: usize = 8 << 20;

fn run_asserting(target: Target) -> Report {
    let mut opts = Options::new(cases());
    // proptest's own seed setting (PROPTEST_RNG_SEED), read by its Config.
    if let proptest::test_runner::RngSeed::Fixed(seed) = proptest::test_runner::Config::default().rng_seed {
        opts.seed = seed;
    }
    let r = fuzz::run(target, &opts);
    eprint!("{r}");
    assert!(r.failure.is_none(), "{r}");
    let peak = r.largest_alloc.expect("PeakAlloc is this binary's allocator");
    assert!(peak <= ALLOC_BOUND, "{}: a single allocation of {peak} B (bound {ALLOC_BOUND} B)\n{r}", target.name());
    r
}

/// The fuzzed inputs must reach both sides of every decoder: a run where every
/// case is accepted (or every one refused) proves nothing.
fn assert_reached(r: &Report, outcomes: &[&str]) {
    for o in outcomes {
        assert!(r.count(o) > 0, "no case of {} ended in {o:?}:\n{r}", r.name);
    }
}

// ---- the harness itself ----

/// The driver catches a panic and shrinks to the minimal input, counts outcomes,
/// reports a case over its budget, and reports a hang instead of waiting for it.
#[test]
fn the_harness_catches_panics_slow_cases_and_hangs() {
    let _g = serial();
    let opts = Options::new(200);
    let r = fuzz::drive("panics", &opts, || {
        (0u32..100_000, |x: &u32| {
            assert!(*x < 1234, "deliberate panic at {x}");
            Ok(if (*x).is_multiple_of(2) { "even" } else { "odd" }.to_string())
        })
    });
    let f = r.failure.as_ref().expect("the panic is reported");
    assert!(f.reason.contains("panic") && f.reason.contains("deliberate"), "{r}");
    assert_eq!(f.input, "1234", "shrunk to the smallest panicking input: {r}");

    let r = fuzz::drive("counts", &Options::new(64), || (0u32..10, |x: &u32| Ok(if *x < 5 { "low" } else { "high" }.to_string())));
    assert!(r.failure.is_none(), "{r}");
    assert_eq!(r.count("low") + r.count("high"), 64, "{r}");

    let slow = Options { case_budget: Duration::from_millis(20), ..Options::new(8) };
    let r = fuzz::drive("slow", &slow, || {
        (0u32..4, |x: &u32| {
            if *x == 3 {
                std::thread::sleep(Duration::from_millis(60));
            }
            Ok("ok".to_string())
        })
    });
    assert!(r.failure.as_ref().is_some_and(|f| f.reason.contains("budget")), "{r}");

    let hang = Options { deadline: Duration::from_millis(500), ..Options::new(4) };
    let t = Instant::now();
    let r = fuzz::drive("hang", &hang, || {
        (Just(0u8), |_: &u8| {
            std::thread::sleep(Duration::from_secs(3));
            Ok("never".to_string())
        })
    });
    assert!(r.failure.as_ref().is_some_and(|f| f.reason.starts_with("hang")), "{r}");
    assert!(t.elapsed() < Duration::from_secs(2), "the driver waited for the hung case");
}

// ---- the four targets ----

#[test]
fn topology_files_never_panic_and_every_mutation_is_accepted_or_refused_by_name() {
    let _g = serial();
    let r = run_asserting(Target::Topology);
    assert_reached(&r, &["accepted", "refused: parse", "refused: zero", "refused: too large", "refused: inconsistent"]);
}

#[test]
fn control_messages_never_panic_and_valid_encodings_decode() {
    let _g = serial();
    let r = run_asserting(Target::Wire);
    assert_reached(&r, &["valid, decoded", "mutated, refused", "mutated, decoded", "stream decoded"]);
}

#[test]
fn tcp_frames_never_panic_hang_or_allocate_by_a_length_field() {
    let _g = serial();
    let r = run_asserting(Target::Frames);
    assert_reached(&r, &["acked", "rejected", "dropped (incident)", "healthy after the run"]);
}

#[test]
fn http_bodies_never_panic_and_accepted_ones_fit_the_topology() {
    let _g = serial();
    let r = run_asserting(Target::Http);
    assert_reached(&r, &["valid, accepted", "mutated, accepted", "refused: malformed", "refused: invalid", "refused: unsupported", "refused: admission"]);
}

#[test]
fn published_layouts_never_make_a_prefill_stage_panic_or_plan_outside_them() {
    let _g = serial();
    let r = run_asserting(Target::Layouts);
    assert_reached(&r, &["valid, planned", "edited, planned", "edited, refused"]);
}

/// Before: a published layout with dcp 0 or interleave 0 divided by zero in the
/// planner, a block size of 0 likewise, and a reversed head range underflowed,
/// so a bad job line panicked the prefill stage's engine thread. Each is refused
/// now, naming the consumer.
#[test]
fn a_published_layout_with_zero_dcp_interleave_or_block_size_is_refused_not_a_panic() {
    let _g = serial();
    let topo = Topology::parse(SMALL).expect("small");
    let region = |kind: &str| topo.region_kinds().iter().position(|k| k.name() == kind).expect("region");
    for edits in [
        vec![fuzz::LayoutEdit::Instance { field: 1, value: 0 }],
        vec![fuzz::LayoutEdit::Instance { field: 2, value: 0 }],
        vec![fuzz::LayoutEdit::Region { region: region("mla.kv"), field: 2, value: 0 }],
        vec![fuzz::LayoutEdit::Heads { region: region("kda.state"), start: 1, end: 0 }],
        vec![fuzz::LayoutEdit::Region { region: region("kda.conv"), field: 0, value: u64::MAX }],
    ] {
        let case = fuzz::LayoutCase { tokens: 20, consumer: 1, edits };
        assert_eq!(fuzz::check_layout(&topo, &case), Ok("edited, refused".to_string()), "{case:?}");
    }
}

// ---- regressions: topology ----

const SMALL: &str = include_str!("../config/small.toml");

fn small_with(from: &str, to: &str) -> String {
    assert!(SMALL.contains(from), "small.toml has no {from:?}");
    SMALL.replacen(from, to, 1)
}

/// Before: `num_layers = 4e9` allocated a 4 GB layer-kind table, `kv_lora_rank =
/// u32::MAX` overflowed the row width, `admission_s = 1e300` passed validation and
/// panicked in `Duration::from_secs_f64` at the first admission, and a context of
/// 2^26 x 2^16 requests counted more blocks than a pool's u32. Each is refused now,
/// naming the field, at once.
#[test]
fn huge_counts_and_timeouts_are_refused_by_name_before_anything_is_sized() {
    let _g = serial();
    let t = Instant::now();
    let cases = [
        (small_with("num_layers = 8", "num_layers = 4000000000"), "model.num_layers"),
        (small_with("kv_lora_rank = 32", "kv_lora_rank = 4294967295"), "model.mla.kv_lora_rank"),
        (small_with("pp = 2\ntp = 1", "pp = 1000\ntp = 2"), "prefill.pp x prefill.tp"),
        (small_with("capacity = 8", "capacity = 4294967295"), "model.replay.capacity"),
        (small_with("max_requests = 96", "max_requests = 4000000000"), "serve.max_requests"),
        (format!("{SMALL}\n[timeouts]\nadmission_s = 1e300\n"), "timeouts.admission_s"),
        (small_with("kind = \"shm\"", "kind = \"shm\"\nstaging_bytes = 68719476737"), "transport.staging_bytes"),
    ];
    for (text, field) in &cases {
        let err = Topology::parse(text).expect_err(field);
        assert!(err.to_string().contains(field.trim_start_matches("timeouts.")), "{field}: {err}");
    }
    // Counts each within its limit whose product is not.
    let blocks = small_with("max_context = 512", "max_context = 67108864").replacen("max_requests = 96", "max_requests = 65536", 1);
    assert!(matches!(Topology::parse(&blocks), Err(ConfigError::Footprint { what: "prefill blocks per rank", .. })), "{:?}", Topology::parse(&blocks));
    let big = small_with("heads = 4\nhead_k_dim = 16\nhead_v_dim = 16", "heads = 4096\nhead_k_dim = 65536\nhead_v_dim = 65536");
    assert!(matches!(Topology::parse(&big), Err(ConfigError::Footprint { what: "bytes of one rank's regions", .. })), "{:?}", Topology::parse(&big));
    let staging = small_with("kind = \"shm\"", "kind = \"shm\"\nstaging_bytes = 68719476736\nstaging_buffers = 4096");
    assert!(
        matches!(Topology::parse(&staging), Err(ConfigError::Footprint { what: "bytes of one rank's staging pool", .. })),
        "{:?}",
        Topology::parse(&staging)
    );
    assert!(t.elapsed() < Duration::from_secs(2), "refusals took {:?}", t.elapsed());
    // Every shipped topology is within the limits.
    for (name, text) in fuzz::SHIPPED_CONFIGS {
        Topology::parse(text).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// `handoff check` on such a file exits 2 with the message, promptly.
#[test]
fn handoff_check_refuses_a_huge_layer_count_quickly() {
    let _g = serial();
    let path = std::env::temp_dir().join(format!("handoff-robust-{}.toml", std::process::id()));
    std::fs::write(&path, small_with("num_layers = 8", "num_layers = 4294967295")).expect("write");
    let t = Instant::now();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_handoff")).args(["check", "--config"]).arg(&path).output().expect("run");
    let _ = std::fs::remove_file(&path);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("model.num_layers = 4294967295") && err.contains("4096"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(10), "took {:?}", t.elapsed());
}

// ---- regressions: tcp frames ----

fn desc(dst_offset: u64, len: u64, count: u32, dst_stride: u64) -> DescSpec {
    DescSpec { kind: frames::kind_code(handoff_components::vocab::RegionKind::MlaKv), dst_offset, len, count, dst_stride }
}

/// Before: the consumer collected every piece of a batch before reading its
/// payload, sized by the descriptors' counts: one descriptor of u32::MAX
/// zero-length pieces (no payload, in bounds) asked for ~100 GB and aborted the
/// process. It is acked at once now, and a strided one of u32::MAX pieces whose
/// payload never comes is dropped without allocating by its count.
#[test]
fn a_descriptor_of_u32_max_pieces_allocates_nothing_by_its_count() {
    let _g = serial();
    let c = FrameConsumer::new().expect("consumer");
    PeakAlloc::reset();
    let case =
        |d: DescSpec| FrameCase { frames: vec![FrameSpec::Write { descs: vec![d], region_ok: true, ndesc: None, payload: None }], flip: None, truncate: None };
    assert_eq!(c.check(&case(desc(0, 0, u32::MAX, 0))), Ok("acked".to_string()));
    assert_eq!(c.check(&case(desc(0, 1, u32::MAX, 0))), Ok("dropped (incident)".to_string()));
    let peak = PeakAlloc::peak().expect("installed");
    assert!(peak < 1 << 20, "largest allocation {peak} B");
    c.healthy().expect("healthy");
}

/// Connects, runs the handshake as a member, sends `bytes` (a frame's start:
/// the consumer reads it before any MAC could be checked), and holds the
/// connection open.
fn hold_open(c: &FrameConsumer, bytes: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(c.transport().addr()).expect("connect");
    let me = PeerAddr::Tcp { addr: SocketAddr::from(([127, 0, 0, 1], 1)) };
    frames::connect_handshake(&mut s, &me, &handoff::transport::auth::ClusterSecret::process()).expect("handshake");
    s.write_all(bytes).expect("send");
    s
}

/// Before: a NOTIFY header announcing 16 MiB, or a WRITE header announcing the
/// most descriptors (121 MiB of them), made the consumer allocate all of it before
/// one byte arrived, for as long as the peer kept the connection open. Now the
/// buffer grows with the bytes that came.
#[test]
fn a_header_announcing_megabytes_allocates_only_what_arrived() {
    let _g = serial();
    let c = FrameConsumer::new().expect("consumer");
    let mut notify = frames::MAGIC.to_le_bytes().to_vec();
    notify.push(frames::NOTIFY);
    notify.extend_from_slice(&frames::MAX_NOTIFY.to_le_bytes());
    notify.extend_from_slice(b"only these bytes");
    let mut write = frames::MAGIC.to_le_bytes().to_vec();
    write.push(frames::WRITE);
    write.extend_from_slice(&1u64.to_le_bytes());
    write.extend_from_slice(&c.region().id.to_le_bytes());
    write.extend_from_slice(&frames::MAX_DESCRIPTORS.to_le_bytes());
    write.extend_from_slice(&0u64.to_le_bytes());
    write.extend_from_slice(&[0u8; 3 * frames::DESC_BYTES]);
    for bytes in [notify, write] {
        PeakAlloc::reset();
        let s = hold_open(&c, &bytes);
        std::thread::sleep(Duration::from_millis(300));
        let peak = PeakAlloc::peak().expect("installed");
        drop(s);
        assert!(peak < 1 << 20, "largest allocation {peak} B while the peer held a {}-type header open", bytes[4]);
    }
    c.healthy().expect("healthy");
}

/// Before: a consumer that gave a connection up (a malformed frame) kept its
/// socket open through the accept loop's clone, so the peer never saw the end.
#[test]
fn a_consumer_closes_the_connection_it_gives_up() {
    let _g = serial();
    let c = FrameConsumer::new().expect("consumer");
    let mut s = hold_open(&c, b"\x00\x01\x02\x03\x04 not a frame");
    s.set_read_timeout(Some(Duration::from_secs(3))).expect("timeout");
    let t = Instant::now();
    let mut buf = [0u8; 64];
    match s.read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("expected the connection closed, got {other:?} after {:?}", t.elapsed()),
    }
    let incidents = c.transport().take_incidents();
    assert!(incidents.iter().any(|i| i.error.to_string().contains("bad frame magic")), "{incidents:?}");
}

// ---- regressions: control lines ----

/// A line past the limit is refused as too long (the reader cannot resynchronise
/// inside it); the proxy's async reader of decode's link refuses it the same way
/// (before, that reader had no limit at all).
#[test]
fn a_control_line_past_the_limit_is_refused_as_too_long() {
    let _g = serial();
    let mut line = Vec::new();
    wire::encode_into(&mut line, &wire::Msg::Token { id: 1, token: 7 }).expect("encode");
    let limit = line.len() as u64;
    assert!(matches!(wire::recv_within(&mut Cursor::new(&line), limit), Ok(Some(wire::Msg::Token { id: 1, token: 7 }))));
    let long = vec![b' '; 4 * line.len()];
    let err = wire::recv_within(&mut Cursor::new(&long), limit).expect_err("too long");
    assert!(err.to_string().contains(&format!("longer than {limit} B")), "{err}");

    let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    rt.block_on(async {
        let mut buf = Vec::new();
        let mut r = tokio::io::BufReader::new(&line[..]);
        assert!(wire::read_line_async(&mut r, &mut buf, limit).await.expect("line"));
        assert_eq!(buf, line);
        assert!(!wire::read_line_async(&mut r, &mut buf, limit).await.expect("end"));
        let mut r = tokio::io::BufReader::new(&long[..]);
        let err = wire::read_line_async(&mut r, &mut buf, limit).await.expect_err("too long");
        assert!(err.to_string().contains("longer than"), "{err}");
        assert!(buf.len() as u64 <= limit, "read {} B past a {limit} B limit", buf.len());
    });
}

// ---- single large bodies ----

/// Bodies far past what a case generates: each refused cleanly, in bounded time.
#[test]
fn huge_bodies_are_refused_cleanly() {
    let _g = serial();
    let topo = Topology::parse(handoff::roles::up::DEFAULT_CONFIG).expect("default topology");
    let parse = |body: String| openai::parse(&topo, Endpoint::Completions, body.as_bytes(), 1);
    let t = Instant::now();
    let stops = format!(r#"{{"prompt": "a", "stop": [{}]}}"#, vec!["\"s\""; 1_000_000].join(","));
    assert_eq!(parse(stops).expect_err("stops").param(), Some("stop"));
    let ids = format!(r#"{{"prompt_token_ids": [{}]}}"#, vec!["300"; 1_000_000].join(","));
    assert_eq!(parse(ids).expect_err("ids"), BodyError::TokenId(300));
    let deep = format!("{}{}", "[".repeat(1_000_000), "]".repeat(1_000_000));
    assert!(matches!(parse(deep), Err(BodyError::Malformed(_))));
    let long = format!(r#"{{"prompt": "{}"}}"#, "x".repeat(10 << 20));
    assert!(matches!(parse(long), Err(BodyError::Admission(_))));
    for (body, param) in [
        (r#"{"prompt": "a", "n": 1e30}"#, "n"),
        (r#"{"prompt": "a", "max_tokens": 18446744073709551616}"#, "max_tokens"),
        (r#"{"prompt": "a", "max_tokens": 4294967296}"#, "max_tokens"),
        (r#"{"prompt": "a", "temperature": -0.0001}"#, "temperature"),
        (r#"{"prompt": "a", "top_p": 1e-400}"#, "top_p"),
    ] {
        assert_eq!(parse(body.to_string()).expect_err(body).param(), Some(param), "{body}");
    }
    assert!(t.elapsed() < Duration::from_secs(30), "took {:?}", t.elapsed());
}

/// Found by a long run of these drivers: a top_p of 2e-308 is in (0, 1] as the f64 the
/// body carries but rounded to 0 as the f32 the request kept, outside the range
/// validation promised. It is kept positive now.
#[test]
fn a_tiny_top_p_stays_positive() {
    let _g = serial();
    let topo = Topology::parse(handoff::roles::up::DEFAULT_CONFIG).expect("default topology");
    let g = openai::parse(&topo, Endpoint::Completions, br#"{"prompt": "a", "temperature": 1, "top_p": 2.07e-308}"#, 1).expect("in range");
    assert!(g.top_p > 0.0 && g.top_p <= 1.0, "top_p {}", g.top_p);
}

// ---- through a running proxy ----

/// A few hundred fuzzed bodies posted to a real cluster: every answer is a JSON
/// success or a JSON error with a 4xx status (never a 5xx, a reset or a hang),
/// and the cluster serves a plain request afterwards with nothing left live.
#[test]
fn fuzzed_bodies_through_a_running_proxy_get_json_answers_and_leave_it_healthy() {
    let _g = serial();
    let base = SMALL.split("[serve]").next().expect("small.toml");
    let text = format!("{base}[serve]\nmax_context = 96\nmax_requests = 8\nqueue = 64\n");
    let path = std::env::temp_dir().join(format!("handoff-robust-serve-{}.toml", std::process::id()));
    std::fs::write(&path, &text).expect("write config");
    let port = free_port().expect("port");
    let mut cluster = Deployment::start(Some(&path), "127.0.0.1", port, Some(PathBuf::from(env!("CARGO_BIN_EXE_handoff")))).expect("start");
    cluster.wait_healthy(Duration::from_secs(60), false).expect("healthy");
    let addr = cluster.addr.clone();

    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = fuzz::body_input();
    let bodies: Vec<(Endpoint, Vec<u8>)> = (0..300)
        .map(|_| {
            let (ep, bytes, _) = strategy.new_tree(&mut runner).expect("case").current().encode();
            (ep, bytes)
        })
        .collect();
    let t = Instant::now();
    let (mut ok, mut refused) = (0, 0);
    for chunk in bodies.chunks(bodies.len().div_ceil(4)) {
        let answers: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = chunk
                .iter()
                .map(|(ep, body)| {
                    let addr = addr.clone();
                    s.spawn(move || {
                        let path = if *ep == Endpoint::Chat { "/v1/chat/completions" } else { "/v1/completions" };
                        let body = String::from_utf8_lossy(body).into_owned();
                        (body.clone(), wire::http(&addr, "POST", path, Some(&body), Duration::from_secs(30)))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("client thread")).collect()
        });
        for (body, answer) in answers {
            let r = answer.unwrap_or_else(|e| panic!("no answer ({e}) to {body:.300}"));
            let streamed = r.headers.iter().any(|(k, v)| k == "content-type" && v.starts_with("text/event-stream"));
            let json_ok = if streamed {
                let data = wire::sse_data(&r.body);
                data.last().is_some_and(|d| d == "[DONE]") && data[..data.len() - 1].iter().all(|d| serde_json::from_str::<serde_json::Value>(d).is_ok())
            } else {
                r.json().is_some()
            };
            assert!(json_ok, "status {} with a body that is not JSON: {:.300} (request {body:.300})", r.status, r.body);
            match r.status {
                200 => ok += 1,
                400..=499 => {
                    let v = r.json().unwrap_or_default();
                    assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "an error without a message: {}", r.body);
                    refused += 1;
                }
                s => panic!("status {s}: {:.300} (request {body:.300})", r.body),
            }
        }
    }
    eprintln!("300 fuzzed bodies through the proxy in {:.1} s: {ok} served, {refused} refused", t.elapsed().as_secs_f64());
    assert!(ok > 0 && refused > 0, "{ok} served, {refused} refused");
    let r = wire::http(&addr, "POST", "/v1/completions", Some(r#"{"prompt": "still here", "max_tokens": 4}"#), Duration::from_secs(30)).expect("answer");
    assert_eq!(r.status, 200, "{}", r.body);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let m = wire::http(&addr, "GET", "/metrics", None, Duration::from_secs(10)).expect("metrics").body;
        let live: f64 = m.lines().filter(|l| l.starts_with("handoff_engine_requests{")).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum();
        if live == 0.0 {
            break;
        }
        assert!(Instant::now() < deadline, "requests still live after the fuzzed load:\n{m}");
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(cluster);
    let _ = std::fs::remove_file(&path);
}
