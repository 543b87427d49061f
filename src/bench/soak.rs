//! `handoff bench soak`: a long load through a `handoff up` process, with faults
//! injected while it runs, and the bookkeeping checked afterwards.
//!
//! The faults are the ones a serving engineer meets: by default prefill stage 0,
//! the last prefill stage and decode killed (SIGKILL) under load, one after the
//! other, each restarted by `up`; optionally decode stopped (SIGSTOP) for a
//! while and then continued. A killed role loses no request: the proxy sends the
//! requests it held again once it is back (`handoff_request_retries_total`), so
//! with kills alone every request must complete, and every completion must
//! equal, token for token, the same prompt's completion in an unfaulted
//! reference pass run on the same cluster before the faults. A stopped role's
//! requests may fail, each naming its role and phase. None may go unanswered.
//! Afterwards every role's entities, requests, plans, producer entries, free
//! blocks and slots are back at their baseline, and requests sent after the
//! faults succeed.
//!
//! The clients honour `Retry-After` on 503 and 429, as a real client would: a
//! role that is down refuses new requests at once, and the client sends the same
//! request again after the second it was told to wait (counted apart, up to
//! [`RESENDS`] times).

use super::serve::{failure_lines, load_prompt};
use crate::roles::client::{CompletionAnswer, complete, failure_reason};
use crate::roles::up::{free_port, proc_usage};
use crate::roles::wire;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A role the soak kills (SIGKILL) under load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Victim {
    /// Prefill stage N.
    Stage(u32),
    /// The last prefill stage, whatever the topology's PP.
    LastStage,
    Decode,
}

/// A `--kill` entry that names no role.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} names no role to kill: stageN (prefill stage N), last (the last prefill stage) or decode")]
pub struct UnknownVictim(pub String);

impl std::str::FromStr for Victim {
    type Err = UnknownVictim;
    fn from_str(s: &str) -> Result<Victim, UnknownVictim> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "decode" => Ok(Victim::Decode),
            "last" => Ok(Victim::LastStage),
            _ => t.strip_prefix("stage").and_then(|n| n.trim().parse().ok()).map(Victim::Stage).ok_or_else(|| UnknownVictim(s.to_string())),
        }
    }
}

impl Victim {
    /// The role as `/health` names it, in a topology of `pp` prefill stages.
    fn role(self, pp: u32) -> String {
        match self {
            Victim::Stage(s) => format!("prefill stage {s}"),
            Victim::LastStage => format!("prefill stage {}", pp.saturating_sub(1)),
            Victim::Decode => "decode".into(),
        }
    }
}

/// How many times a client sends one request again after a 503 or 429 (one
/// second apart, as `Retry-After` says) before it counts the refusal.
pub const RESENDS: u32 = 60;

/// What to run and which faults to inject.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    pub requests: u32,
    pub concurrency: u32,
    /// Tokens per completion.
    pub max_tokens: u32,
    /// How long decode is watched idle after the load.
    pub idle: Duration,
    /// The roles killed (SIGKILL) under load, in this order, spread evenly over
    /// it (with the stop below: at 1/(n+2), 2/(n+2), ...); `up` restarts each.
    pub kills: Vec<Victim>,
    /// How long decode is stopped (SIGSTOP) after the kills; zero: not stopped.
    pub stop_decode: Duration,
    /// Distinct prompts the load cycles through (at most 1,248: `load_prompt`
    /// repeats after that); each is run once unfaulted first, for reference.
    pub prompts: u32,
    /// The `handoff` binary `up` and the roles run (None: this executable).
    pub program: Option<PathBuf>,
}

impl SoakOptions {
    pub fn new(requests: u32, concurrency: u32) -> SoakOptions {
        SoakOptions {
            requests,
            concurrency,
            max_tokens: 16,
            idle: Duration::from_secs(10),
            kills: vec![Victim::Stage(0), Victim::LastStage, Victim::Decode],
            stop_decode: Duration::ZERO,
            prompts: PROMPT_PERIOD,
            program: None,
        }
    }

    fn faults(&self) -> bool {
        !self.kills.is_empty() || !self.stop_decode.is_zero()
    }
}

/// `load_prompt(i)` repeats with this period (lcm of its 26 letters and 96 lengths).
const PROMPT_PERIOD: u32 = 1248;

/// One role's figures in a soak, read from `/metrics`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoleFigures {
    pub entities: u64,
    pub requests: u64,
    pub plans: u64,
    pub producer_entries: u64,
    pub free_blocks: u64,
    pub free_slots: u64,
    pub sampling: u64,
    pub settled: u64,
    pub rss_bytes: u64,
}

/// What `handoff bench soak` saw.
#[derive(Debug, Clone, Default)]
pub struct SoakReport {
    pub requests: u32,
    pub ok: u32,
    /// Failures by HTTP status.
    pub failed: BTreeMap<u16, u32>,
    /// Failures by HTTP status and reason.
    pub reasons: BTreeMap<(u16, String), u32>,
    /// Failures whose answer names no role (or, failed in flight, no phase).
    pub unexplained: u32,
    /// Requests that got no answer (no response within the client's 120 s, or the
    /// connection broke).
    pub lost: u32,
    /// 503 and 429 answers the clients waited out (`Retry-After`) and sent again.
    pub resent: u32,
    /// Distinct prompts run unfaulted for reference before the faults.
    pub reference: u32,
    /// Completions (of the load and after it) whose tokens differ from their
    /// prompt's reference, and the first few of them (request index, got, want).
    pub mismatched: u32,
    pub mismatches: Vec<(u32, Vec<u8>, Vec<u8>)>,
    /// `handoff_request_retries_total` at the end, by its labels (`phase="...",role="..."`).
    pub retries: BTreeMap<String, u64>,
    /// Whether the faults were kills only (no SIGSTOP): then no request may fail.
    pub kills_only: bool,
    /// Per role ("decode", "prefill0", ...): after the warm-up, and at the end.
    pub before: BTreeMap<String, RoleFigures>,
    pub after: BTreeMap<String, RoleFigures>,
    /// Per role: resident bytes halfway through the load (the allocator's and
    /// the histograms' warm-up is over by then; from there on it must stay flat).
    pub rss_mid: BTreeMap<String, u64>,
    /// Decode while idle after the load: CPU share of one core, and RSS growth.
    pub idle_cpu: f64,
    pub idle_rss_growth: i64,
    /// Roles whose counts did not return to their baseline.
    pub leaks: Vec<String>,
    /// What was injected and how the cluster answered, in order.
    pub faults: Vec<String>,
    /// Completions sent once the faults were over and the load had finished:
    /// (ok, sent).
    pub after_faults: (u32, u32),
}

impl SoakReport {
    /// Whether the soak holds: nothing lost or unexplained, counts at baseline,
    /// the later requests served, and (without faults) no failure at all.
    pub fn problems(&self, faults: bool) -> Vec<String> {
        let mut p = Vec::new();
        let failed: u32 = self.failed.values().sum();
        if self.lost > 0 {
            p.push(format!("{} requests lost (no answer)", self.lost));
        }
        if self.unexplained > 0 {
            p.push(format!("{} failures name no role or phase", self.unexplained));
        }
        if !faults && failed > 0 {
            p.push(format!("{failed} requests failed without a fault injected"));
        }
        if faults && self.kills_only && failed > 0 {
            p.push(format!("{failed} requests failed with only kills injected (a killed role's requests are retried)"));
        }
        if self.mismatched > 0 {
            p.push(format!("{} completions differ from their prompt's unfaulted reference (first: {:?})", self.mismatched, self.mismatches.first()));
        }
        if !self.leaks.is_empty() {
            p.push(format!("counts not back at baseline: {:?}", self.leaks));
        }
        for f in self.faults.iter().filter(|f| f.contains("NOT")) {
            p.push(f.clone());
        }
        if self.after_faults.0 != self.after_faults.1 {
            p.push(format!("only {} of {} requests after the load succeeded", self.after_faults.0, self.after_faults.1));
        }
        p
    }
}

/// A `handoff up` child process; stopped (SIGTERM, then SIGKILL) when dropped.
struct UpProcess {
    child: Child,
    addr: String,
}

impl UpProcess {
    fn start(program: Option<&Path>, config: Option<&Path>) -> anyhow::Result<UpProcess> {
        let exe = match program {
            Some(p) => p.to_path_buf(),
            None => std::env::current_exe()?,
        };
        let port = free_port()?;
        let mut cmd = Command::new(exe);
        cmd.args(["up", "--port", &port.to_string(), "--max-restarts", "5", "--restart-window-s", "60"]);
        if let Some(c) = config {
            cmd.arg("--config").arg(c);
        }
        // `up`'s own lines (a role died, restarting it) stay on stderr, in order
        // with ours.
        cmd.stdout(Stdio::null()).stderr(Stdio::inherit());
        let child = cmd.spawn()?;
        let mut up = UpProcess { child, addr: format!("127.0.0.1:{port}") };
        up.wait_healthy(Duration::from_secs(90))?;
        Ok(up)
    }

    fn wait_healthy(&mut self, within: Duration) -> anyhow::Result<Duration> {
        let t0 = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                anyhow::bail!("handoff up exited ({status}) before the cluster was healthy");
            }
            if wire::http(&self.addr, "GET", "/health", None, Duration::from_secs(2)).is_ok_and(|r| r.status == 200) {
                return Ok(t0.elapsed());
            }
            anyhow::ensure!(t0.elapsed() < within, "the cluster at {} was not healthy within {within:?}", self.addr);
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// How many prefill stages `/health` lists.
    fn stages(&self) -> u32 {
        let v = wire::http(&self.addr, "GET", "/health", None, Duration::from_secs(2)).ok().and_then(|r| r.json()).unwrap_or_default();
        v["roles"].as_array().map_or(0, |roles| roles.iter().filter(|r| r["role"].as_str().is_some_and(|n| n.starts_with("prefill stage"))).count() as u32)
    }

    /// The pid of `role` ("decode", "prefill stage N") as `/health` lists it.
    fn pid(&self, role: &str) -> Option<u32> {
        let v = wire::http(&self.addr, "GET", "/health", None, Duration::from_secs(2)).ok()?.json()?;
        v["roles"].as_array()?.iter().find(|r| r["role"] == role)?["pid"].as_u64().map(|p| p as u32)
    }

    fn metrics(&self) -> String {
        wire::http(&self.addr, "GET", "/metrics", None, Duration::from_secs(5)).map(|r| r.body).unwrap_or_default()
    }
}

impl Drop for UpProcess {
    fn drop(&mut self) {
        // Two signals: `up` drains on the first and stops every role on the second.
        for _ in 0..2 {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) on a role process of the `up` this soak started.
    unsafe { libc::kill(pid as libc::pid_t, sig) };
}

pub(crate) fn role_figures(metrics: &str) -> BTreeMap<String, RoleFigures> {
    let mut out: BTreeMap<String, RoleFigures> = BTreeMap::new();
    for line in metrics.lines() {
        // Only the per-role gauges: `name{role="r"} value` (histograms carry more labels).
        let Some((name, rest)) = line.split_once("{role=\"") else { continue };
        let Some((role, value)) = rest.split_once("\"} ") else { continue };
        if role.contains('"') {
            continue;
        }
        let Ok(v) = value.trim().parse::<u64>() else { continue };
        let f = out.entry(role.to_string()).or_default();
        match name {
            "handoff_engine_entities" => f.entities = v,
            "handoff_engine_requests" => f.requests = v,
            "handoff_engine_plans" => f.plans = v,
            "handoff_producer_entries" => f.producer_entries = v,
            "handoff_engine_free_blocks" => f.free_blocks = v,
            "handoff_engine_free_slots" => f.free_slots = v,
            "handoff_sampling_entries" => f.sampling = v,
            "handoff_prefill_settled" => f.settled = v,
            "handoff_resident_memory_bytes" => f.rss_bytes = v,
            _ => {}
        }
    }
    out
}

/// Waits until every role's engine holds no request (heartbeats refresh every 300 ms).
fn settled(up: &UpProcess, timeout: Duration) -> BTreeMap<String, RoleFigures> {
    let deadline = Instant::now() + timeout;
    loop {
        let f = role_figures(&up.metrics());
        let idle = !f.is_empty() && f.values().all(|r| r.requests == 0 && r.plans == 0 && r.producer_entries == 0);
        if idle || Instant::now() >= deadline {
            // One more heartbeat period, so every role has reported its idle state.
            std::thread::sleep(Duration::from_millis(700));
            return role_figures(&up.metrics());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Whether a failure's answer says who failed it: a request failed in flight
/// (500) names the phase and the role in its error body; a refusal while a role is
/// down (503) names the role; overload (429) is its own reason.
fn explained(status: u16, body: &str) -> bool {
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    let e = &v["error"];
    let message = e["message"].as_str().unwrap_or("");
    let names_role = |s: &str| s.contains("decode") || s.contains("prefill stage");
    match status {
        500 => e["phase"].as_str().is_some_and(|p| !p.is_empty()) && e["role"].as_str().is_some_and(names_role),
        503 => names_role(message) || e["code"] == "draining",
        429 => e["code"] == "queue_full",
        _ => false,
    }
}

/// One answer of a load: the request's index and what its client finally got.
type Answer = (u32, Result<CompletionAnswer, (u16, String)>);

/// `concurrency` clients sending `requests` completions (request i asks for
/// prompt `i % o.prompts`); `done` counts answers, `resent` the 503 and 429
/// answers waited out and sent again.
fn run_load(addr: &str, o: &SoakOptions, requests: u32, done: &AtomicU32, resent: &AtomicU32) -> Vec<Answer> {
    let next = AtomicU32::new(0);
    let results = std::sync::Mutex::new(Vec::with_capacity(requests as usize));
    std::thread::scope(|s| {
        for _ in 0..o.concurrency.max(1) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= requests {
                        return;
                    }
                    let prompt = load_prompt(i % o.prompts.max(1));
                    let mut sends = 0;
                    let r = loop {
                        let r = complete(addr, &prompt, o.max_tokens);
                        if !matches!(r, Err((503 | 429, _))) || sends == RESENDS {
                            break r;
                        }
                        // Retry-After: 1, then the same request again.
                        sends += 1;
                        resent.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_secs(1));
                    };
                    results.lock().unwrap_or_else(|p| p.into_inner()).push((i, r));
                    done.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
    });
    results.into_inner().unwrap_or_else(|p| p.into_inner())
}

/// `handoff_request_retries_total` by its labels, from `/metrics`.
fn retries(metrics: &str) -> BTreeMap<String, u64> {
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("handoff_request_retries_total{"))
        .filter_map(|rest| rest.split_once("} "))
        .filter_map(|(labels, v)| v.trim().parse().ok().map(|v| (labels.to_string(), v)))
        .collect()
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / 1048576.0)
}

fn rss_line(f: &BTreeMap<String, RoleFigures>) -> String {
    f.iter().map(|(r, x)| format!("{r} {}", mib(x.rss_bytes))).collect::<Vec<_>>().join(", ")
}

/// Waits until `done` reaches `n` or the load ends; prints progress every tenth.
fn wait_for(done: &AtomicU32, n: u32, finished: &AtomicBool, up: &UpProcess, total: u32, printed: &mut u32, report: &mut SoakReport) {
    let step = (total / 10).max(1);
    while done.load(Ordering::SeqCst) < n && !finished.load(Ordering::SeqCst) {
        let d = done.load(Ordering::SeqCst);
        if d >= *printed + step {
            *printed = d - d % step;
            let now = role_figures(&up.metrics());
            if report.rss_mid.is_empty() && d >= total / 2 {
                report.rss_mid = now.iter().map(|(r, f)| (r.clone(), f.rss_bytes)).collect();
            }
            println!("  {d:>6} answered: {}", rss_line(&now));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Kills `role` ("decode", "prefill stage N") and waits for `up` to restart it.
fn kill_role(up: &mut UpProcess, role: &str, report: &mut SoakReport, answered: u32) {
    let Some(old) = up.pid(role) else {
        report.faults.push(format!("{role}: not listed by /health; not killed"));
        return;
    };
    signal(old, libc::SIGKILL);
    let t0 = Instant::now();
    let back = loop {
        if up.wait_healthy(Duration::from_secs(60)).is_err() {
            break None;
        }
        if up.pid(role).is_some_and(|p| p != old) {
            break Some(t0.elapsed());
        }
        if t0.elapsed() > Duration::from_secs(60) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let line = match back {
        Some(t) => format!("SIGKILL {role} (pid {old}) after {answered} answers; restarted by up and healthy {:.2} s later", t.as_secs_f64()),
        None => format!("SIGKILL {role} (pid {old}) after {answered} answers; NOT healthy again within 60 s"),
    };
    println!("  fault: {line}");
    report.faults.push(line);
}

/// Stops decode for `d`, continues it, and waits for the cluster to be healthy.
fn stop_decode(up: &mut UpProcess, d: Duration, report: &mut SoakReport, answered: u32) {
    let Some(pid) = up.pid("decode") else {
        report.faults.push("decode: not listed by /health; not stopped".into());
        return;
    };
    signal(pid, libc::SIGSTOP);
    let t0 = Instant::now();
    // The proxy's watchdog finds it by its missing heartbeats.
    let mut seen_down = None;
    while t0.elapsed() < d {
        if seen_down.is_none()
            && wire::http(&up.addr, "GET", "/health", None, Duration::from_secs(2)).is_ok_and(|r| r.status == 503 && r.body.contains("decode"))
        {
            seen_down = Some(t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    signal(pid, libc::SIGCONT);
    let back = up.wait_healthy(Duration::from_secs(60));
    let down = seen_down.map_or("never seen down".to_string(), |t| format!("/health named it down after {:.2} s", t.as_secs_f64()));
    let line = match back {
        Ok(t) => {
            format!("SIGSTOP decode (pid {pid}) for {:.0} s after {answered} answers; {down}; healthy {:.2} s after SIGCONT", d.as_secs_f64(), t.as_secs_f64())
        }
        Err(e) => format!("SIGSTOP decode (pid {pid}) for {:.0} s after {answered} answers; {down}; NOT healthy again: {e}", d.as_secs_f64()),
    };
    println!("  fault: {line}");
    report.faults.push(line);
}

/// `handoff bench soak`: `o.requests` completions at `o.concurrency` through a
/// `handoff up` of `config` (None: the built-in default), with the faults of `o`;
/// prints requests by outcome, each role's resident memory at the start and the
/// end, the producer entries at the end, and whether every count is back at its
/// baseline. The caller fails the run on [`SoakReport::problems`].
pub fn bench_soak(config: Option<&Path>, o: &SoakOptions) -> anyhow::Result<SoakReport> {
    let mut up = UpProcess::start(o.program.as_deref(), config)?;
    let pp = up.stages();
    // Warm-up, then the baseline every role must come back to.
    let (warm, resent) = (AtomicU32::new(0), AtomicU32::new(0));
    let _ = run_load(&up.addr, &SoakOptions { concurrency: o.concurrency.min(8), ..o.clone() }, 32, &warm, &resent);
    // The unfaulted reference: every prompt of the load once, at its concurrency.
    let prompts = o.prompts.clamp(1, PROMPT_PERIOD).min(o.requests);
    let reference: BTreeMap<u32, Vec<u8>> = {
        let t0 = Instant::now();
        let answers = run_load(&up.addr, o, prompts, &AtomicU32::new(0), &resent);
        let mut refs = BTreeMap::new();
        for (i, r) in answers {
            match r {
                Ok(a) => {
                    refs.insert(i, a.token_ids);
                }
                Err((status, body)) => anyhow::bail!("the unfaulted reference run failed prompt {i}: {status} {}", failure_reason(&body)),
            }
        }
        println!("reference: {prompts} prompts run once each without a fault in {:.1} s", t0.elapsed().as_secs_f64());
        refs
    };
    let before = settled(&up, Duration::from_secs(10));
    let mut plan: Vec<String> = Vec::new();
    let points = o.kills.len() as u32 + u32::from(!o.stop_decode.is_zero());
    let at = |k: u32| format!("{}/{}", k + 1, points + 1);
    for (k, v) in o.kills.iter().enumerate() {
        plan.push(format!("SIGKILL {} at {}", v.role(pp), at(k as u32)));
    }
    if !o.stop_decode.is_zero() {
        plan.push(format!("SIGSTOP decode for {:.0} s at {}", o.stop_decode.as_secs_f64(), at(points - 1)));
    }
    let faults = if plan.is_empty() { "none".to_string() } else { plan.join(", ") };
    println!("soak: {} requests of {} tokens at concurrency {} through handoff up at {}; faults: {faults}", o.requests, o.max_tokens, o.concurrency, up.addr);
    println!("resident memory at the start: {}", rss_line(&before));
    let mut report = SoakReport {
        requests: o.requests,
        before: before.clone(),
        reference: prompts,
        kills_only: !o.kills.is_empty() && o.stop_decode.is_zero(),
        ..Default::default()
    };
    let resent_before = resent.load(Ordering::SeqCst);

    let done = AtomicU32::new(0);
    let finished = AtomicBool::new(false);
    let addr = up.addr.clone();
    let results = std::thread::scope(|s| {
        let load = s.spawn(|| {
            let r = run_load(&addr, o, o.requests, &done, &resent);
            finished.store(true, Ordering::SeqCst);
            r
        });
        let mut printed = 0;
        let mark = |k: u32| (u64::from(o.requests) * u64::from(k + 1) / u64::from(points + 1)) as u32;
        for (k, v) in o.kills.iter().enumerate() {
            wait_for(&done, mark(k as u32), &finished, &up, o.requests, &mut printed, &mut report);
            kill_role(&mut up, &v.role(pp), &mut report, done.load(Ordering::SeqCst));
        }
        if !o.stop_decode.is_zero() {
            wait_for(&done, mark(points - 1), &finished, &up, o.requests, &mut printed, &mut report);
            stop_decode(&mut up, o.stop_decode, &mut report, done.load(Ordering::SeqCst));
        }
        if o.faults() && finished.load(Ordering::SeqCst) {
            report.faults.push("NOT under load: the load ended before the last fault; use more --requests".into());
        }
        wait_for(&done, o.requests, &finished, &up, o.requests, &mut printed, &mut report);
        load.join().unwrap_or_default()
    });
    report.resent = resent.load(Ordering::SeqCst) - resent_before;

    let compare = |report: &mut SoakReport, i: u32, got: &[u8]| {
        let want = &reference[&(i % prompts)];
        if got != want.as_slice() {
            report.mismatched += 1;
            if report.mismatches.len() < 4 {
                report.mismatches.push((i, got.to_vec(), want.clone()));
            }
        }
    };
    for (i, r) in &results {
        match r {
            Ok(a) => {
                report.ok += 1;
                compare(&mut report, *i, &a.token_ids);
            }
            Err((0, _)) => report.lost += 1,
            Err((status, body)) => {
                *report.failed.entry(*status).or_default() += 1;
                *report.reasons.entry((*status, failure_reason(body))).or_default() += 1;
                if !explained(*status, body) {
                    report.unexplained += 1;
                }
            }
        }
    }
    // Every request was answered or counted lost; a request missing from the
    // results (a client thread that died) is lost too.
    report.lost += o.requests.saturating_sub(results.len() as u32);

    let after = settled(&up, Duration::from_secs(30));
    for (role, b) in &before {
        let a = after.get(role).cloned().unwrap_or_default();
        // `settled` is left out: its entries expire 120 s after they were made,
        // not when the requests leave (the test bounds it instead).
        let counts = |x: &RoleFigures| (x.entities, x.requests, x.plans, x.producer_entries, x.free_blocks, x.free_slots, x.sampling);
        if counts(&a) != counts(b) {
            report.leaks.push(format!("{role}: before {b:?}, after {a:?}"));
        }
    }
    // Later requests: the service came back.
    let n = (2 * o.concurrency).max(16);
    let later = run_load(&up.addr, o, n, &AtomicU32::new(0), &AtomicU32::new(0));
    report.after_faults = (later.iter().filter(|(_, r)| r.is_ok()).count() as u32, n);
    for (i, r) in &later {
        if let Ok(a) = r {
            compare(&mut report, *i, &a.token_ids);
        }
    }
    report.retries = retries(&up.metrics());

    let failed: u32 = report.failed.values().sum();
    let by = |s: u16| report.failed.get(&s).copied().unwrap_or(0);
    let other = failed - by(500) - by(503) - by(429);
    println!(
        "requests by outcome: {} ok, {} failed in flight (500), {} refused while a role was down (503), {} overloaded (429), {other} other, {} lost; {} failures name no role",
        report.ok,
        by(500),
        by(503),
        by(429),
        report.lost,
        report.unexplained
    );
    if failed > 0 {
        print!("{}", failure_lines(&report.reasons, 8));
    }
    println!("503 and 429 answers waited out and sent again by the clients: {}", report.resent);
    let retried: Vec<String> = report.retries.iter().map(|(l, n)| format!("{{{l}}} {n}")).collect();
    println!(
        "requests the proxy sent again after a role died (handoff_request_retries_total): {}",
        if retried.is_empty() { "none".to_string() } else { retried.join(", ") }
    );
    let compared = report.ok + report.after_faults.0;
    println!(
        "completions equal to their prompt's unfaulted reference, token for token: {} of {compared}{}",
        compared - report.mismatched,
        report.mismatches.first().map_or(String::new(), |(i, got, want)| format!(" (first difference: request {i}, got {got:?}, want {want:?})"))
    );
    println!("after the load: {} of {} new requests ok", report.after_faults.0, report.after_faults.1);
    let entries: Vec<String> = after.iter().filter(|(r, _)| r.starts_with("prefill")).map(|(r, f)| format!("{r} {}", f.producer_entries)).collect();
    println!("producer entries at the end: {}", entries.join(", "));
    println!("resident memory at the end: {}", rss_line(&after));
    println!("counts back at baseline on every role: {}", if report.leaks.is_empty() { "yes".to_string() } else { format!("NO: {:?}", report.leaks) });
    report.after = after;
    if let Some(pid) = up.pid("decode")
        && let Some((t0, r0)) = proc_usage(pid)
    {
        std::thread::sleep(o.idle);
        if let Some((t1, r1)) = proc_usage(pid) {
            // SAFETY: sysconf has no preconditions.
            let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
            report.idle_cpu = (t1 - t0) as f64 / hz / o.idle.as_secs_f64();
            report.idle_rss_growth = r1 as i64 - r0 as i64;
        }
    }
    println!("idle decode over {:?}: {:.2}% of a core, RSS {:+} bytes", o.idle, report.idle_cpu * 100.0, report.idle_rss_growth);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::explained;

    #[test]
    fn a_failure_is_explained_only_when_it_names_its_role_and_phase() {
        assert!(explained(500, r#"{"error": {"message": "decode phase failed: x", "phase": "decode", "role": "decode"}}"#));
        assert!(explained(500, r#"{"error": {"message": "compute phase failed", "phase": "compute", "role": "prefill stage 0"}}"#));
        assert!(!explained(500, r#"{"error": {"message": "compute phase failed", "phase": "compute"}}"#));
        assert!(!explained(500, "internal error"));
        assert!(explained(503, r#"{"error": {"message": "not ready: decode is down: stopped answering"}}"#));
        assert!(!explained(503, r#"{"error": {"message": "not ready"}}"#));
        assert!(explained(429, r#"{"error": {"code": "queue_full"}}"#));
        assert!(!explained(404, r#"{"error": {"message": "decode"}}"#));
    }
}
