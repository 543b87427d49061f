//! `handoff bench soak`: a long load through a `handoff up` process, with faults
//! injected while it runs, and the bookkeeping checked afterwards.
//!
//! The faults are the ones a serving engineer meets: a prefill stage killed
//! (SIGKILL) a quarter of the way through, which `up` restarts, and decode stopped
//! (SIGSTOP) halfway through for a while and then continued. Every request must end
//! either completed or failed with a reason that names the role (and, for a request
//! that failed in flight, the phase); none may go unanswered. Afterwards every
//! role's entities, requests, plans, producer entries, free blocks and slots are
//! back at their baseline, and requests sent after the faults succeed.
//!
//! The clients honour `Retry-After` on 503 and 429, as a real client would: a
//! role that is down refuses new requests at once, so clients that retried at once
//! would only measure how fast the proxy refuses.

use super::serve::{failure_lines, load_prompt};
use crate::roles::client::{CompletionAnswer, complete, failure_reason};
use crate::roles::up::{free_port, proc_usage};
use crate::roles::wire;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// What to run and which faults to inject.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    pub requests: u32,
    pub concurrency: u32,
    /// Tokens per completion.
    pub max_tokens: u32,
    /// How long decode is watched idle after the load.
    pub idle: Duration,
    /// The prefill stage killed (SIGKILL) a quarter of the way through; None: none.
    pub kill_stage: Option<u32>,
    /// How long decode is stopped (SIGSTOP) halfway through; zero: not stopped.
    pub stop_decode: Duration,
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
            kill_stage: Some(0),
            stop_decode: Duration::from_secs(10),
            program: None,
        }
    }

    fn faults(&self) -> bool {
        self.kill_stage.is_some() || !self.stop_decode.is_zero()
    }
}

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

/// `concurrency` clients sending `requests` completions; `done` counts answers.
fn run_load(addr: &str, o: &SoakOptions, requests: u32, done: &AtomicU32) -> Vec<Result<CompletionAnswer, (u16, String)>> {
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
                    let prompt = load_prompt(i);
                    let r = complete(addr, &prompt, o.max_tokens);
                    let retry_after = matches!(r, Err((503 | 429, _)));
                    results.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                    done.fetch_add(1, Ordering::SeqCst);
                    if retry_after {
                        std::thread::sleep(Duration::from_secs(1));
                    }
                }
            });
        }
    });
    results.into_inner().unwrap_or_else(|p| p.into_inner())
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

/// Kills prefill stage `s` and waits for `up` to restart it.
fn kill_stage(up: &mut UpProcess, s: u32, report: &mut SoakReport, answered: u32) {
    let role = format!("prefill stage {s}");
    let Some(old) = up.pid(&role) else {
        report.faults.push(format!("{role}: not listed by /health; not killed"));
        return;
    };
    signal(old, libc::SIGKILL);
    let t0 = Instant::now();
    let back = loop {
        if up.wait_healthy(Duration::from_secs(60)).is_err() {
            break None;
        }
        if up.pid(&role).is_some_and(|p| p != old) {
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
    // Warm-up, then the baseline every role must come back to.
    let warm = AtomicU32::new(0);
    let _ = run_load(&up.addr, &SoakOptions { concurrency: o.concurrency.min(8), ..o.clone() }, 32, &warm);
    let before = settled(&up, Duration::from_secs(10));
    let faults = match (o.kill_stage, o.stop_decode.is_zero()) {
        (None, true) => "none".to_string(),
        (k, _) => {
            let mut f = Vec::new();
            if let Some(s) = k {
                f.push(format!("SIGKILL prefill stage {s} at 1/4"));
            }
            if !o.stop_decode.is_zero() {
                f.push(format!("SIGSTOP decode for {:.0} s at 1/2", o.stop_decode.as_secs_f64()));
            }
            f.join(", ")
        }
    };
    println!("soak: {} requests of {} tokens at concurrency {} through handoff up at {}; faults: {faults}", o.requests, o.max_tokens, o.concurrency, up.addr);
    println!("resident memory at the start: {}", rss_line(&before));
    let mut report = SoakReport { requests: o.requests, before: before.clone(), ..Default::default() };

    let done = AtomicU32::new(0);
    let finished = AtomicBool::new(false);
    let addr = up.addr.clone();
    let results = std::thread::scope(|s| {
        let load = s.spawn(|| {
            let r = run_load(&addr, o, o.requests, &done);
            finished.store(true, Ordering::SeqCst);
            r
        });
        let mut printed = 0;
        if let Some(stage) = o.kill_stage {
            wait_for(&done, o.requests / 4, &finished, &up, o.requests, &mut printed, &mut report);
            kill_stage(&mut up, stage, &mut report, done.load(Ordering::SeqCst));
        }
        if !o.stop_decode.is_zero() {
            wait_for(&done, o.requests / 2, &finished, &up, o.requests, &mut printed, &mut report);
            stop_decode(&mut up, o.stop_decode, &mut report, done.load(Ordering::SeqCst));
        }
        if o.faults() && finished.load(Ordering::SeqCst) {
            report.faults.push("NOT under load: the load ended before the last fault; use more --requests".into());
        }
        wait_for(&done, o.requests, &finished, &up, o.requests, &mut printed, &mut report);
        load.join().unwrap_or_default()
    });

    for r in &results {
        match r {
            Ok(_) => report.ok += 1,
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
    let later = run_load(&up.addr, o, n, &AtomicU32::new(0));
    report.after_faults = (later.iter().filter(|r| r.is_ok()).count() as u32, n);

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
