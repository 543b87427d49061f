//! `handoff bench serve`: a load generator against a whole deployment started as
//! child processes ([`Deployment`]), one level per concurrency, reporting tokens per
//! second, TTFT and inter-token latency percentiles, and why requests failed.

use crate::roles::client::{CompletionAnswer, complete, failure_reason, percentile};
use crate::roles::up::{Deployment, free_port};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// One level of `bench serve`.
#[derive(Debug, Clone, Default)]
pub struct ServeLevel {
    pub concurrency: u32,
    pub requests: u32,
    pub ok: u32,
    /// Failures by HTTP status (0: no answer).
    pub failed: BTreeMap<u16, u32>,
    /// Failures by HTTP status and reason (the error body's message, or why no
    /// answer came), so a sweep says what went wrong, not only how often.
    pub reasons: BTreeMap<(u16, String), u32>,
    pub tok_s: f64,
    pub ttft_p50: f64,
    pub ttft_p99: f64,
    pub itl_p50: f64,
    pub itl_p99: f64,
    /// The hand-off tail (ms): per request, the longest of its prefill stages'
    /// times from the stage's last layer computed to its write-done report.
    pub tail_p50: f64,
    pub tail_p99: f64,
    /// Requests whose answer carried a hand-off tail.
    pub tails: u32,
    /// Per request, the tail over the compute time of the stage it came from
    /// (the batch that held the request, first layer to last): the median.
    pub tail_share_p50: f64,
    /// CPU time of all role processes over the level, per completed request (ms).
    pub cpu_ms_per_request: f64,
}

/// The prompt of the `i`-th request of a load: 32 to 127 letters, different
/// per request.
pub(crate) fn load_prompt(i: u32) -> String {
    (0..32 + (i * 37) % 96).map(|j| (b'a' + ((i + j) % 26) as u8) as char).collect()
}

/// The prompt of the `i`-th request of a load of `tokens`-token prompts
/// (bytes are tokens): letters, different per request.
fn sized_prompt(i: u32, tokens: u32) -> String {
    (0..tokens).map(|j| (b'a' + ((i * 7 + j + j / 26) % 26) as u8) as char).collect()
}

/// `concurrency` clients sending `requests` completions in all to `addr`,
/// with prompts of `prompt_tokens` tokens each (None: 32 to 127).
pub fn load(addr: &str, concurrency: u32, requests: u32, max_tokens: u32, prompt_tokens: Option<u32>) -> ServeLevel {
    let next = std::sync::atomic::AtomicU32::new(0);
    let results = std::sync::Mutex::new(Vec::new());
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..concurrency.max(1) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    if i >= requests {
                        return;
                    }
                    let prompt = prompt_tokens.map_or_else(|| load_prompt(i), |n| sized_prompt(i, n));
                    let r = complete(addr, &prompt, max_tokens);
                    results.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                }
            });
        }
    });
    let wall = t0.elapsed().as_secs_f64();
    let results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    let ok: Vec<&CompletionAnswer> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    let mut failed = BTreeMap::new();
    let mut reasons = BTreeMap::new();
    for r in &results {
        if let Err((status, body)) = r {
            *failed.entry(*status).or_default() += 1;
            *reasons.entry((*status, failure_reason(body))).or_default() += 1;
        }
    }
    let tokens: usize = ok.iter().map(|r| r.token_ids.len()).sum();
    let mut ttft: Vec<f64> = ok.iter().map(|r| r.ttft_ms).collect();
    let mut itl: Vec<f64> = ok.iter().flat_map(|r| r.itl_ms.clone()).collect();
    let mut tail: Vec<f64> = ok.iter().filter_map(|r| r.tail_ms).collect();
    let mut share: Vec<f64> = ok.iter().filter_map(|r| Some(r.tail_ms? / r.stage_prefill_ms.filter(|&p| p > 0.0)?)).collect();
    ServeLevel {
        concurrency,
        requests,
        ok: ok.len() as u32,
        failed,
        reasons,
        tok_s: tokens as f64 / wall,
        ttft_p50: percentile(&mut ttft, 0.5),
        ttft_p99: percentile(&mut ttft, 0.99),
        itl_p50: percentile(&mut itl, 0.5),
        itl_p99: percentile(&mut itl, 0.99),
        tails: tail.len() as u32,
        tail_p50: percentile(&mut tail, 0.5),
        tail_p99: percentile(&mut tail, 0.99),
        tail_share_p50: percentile(&mut share, 0.5),
        cpu_ms_per_request: 0.0,
    }
}

/// `handoff bench serve`: starts the cluster of `config` (the built-in default
/// without one) and sweeps the concurrency levels, `requests` completions of 16
/// tokens per level (0: 8 x concurrency, at least 64), their prompts 32 to 127
/// tokens or `prompt_tokens` each; prints tok/s, TTFT and ITL p50/p99 per level,
/// the ratio of each level's tok/s to the first's, and the hand-off tail, also
/// as a share of the stage's prefill compute.
///
/// tok/s, TTFT and ITL count the successful requests only; a level with failures
/// says how many of its requests failed and lists them by HTTP status and reason
/// (the caller decides whether a failure fails the run: see [`failed_requests`]).
pub fn bench_serve(config: Option<&Path>, levels: &[u32], requests: u32, prompt_tokens: Option<u32>) -> anyhow::Result<Vec<ServeLevel>> {
    let port = free_port()?;
    let mut c = Deployment::start(config, "127.0.0.1", port, None)?;
    eprintln!("bench serve: {} at {}", config.map_or("the built-in default (config/trained.toml)".to_string(), |p| p.display().to_string()), c.addr);
    c.wait_healthy(Duration::from_secs(60), true)?;
    // Warm-up, so the first level does not pay for the first requests' page faults.
    let _ = load(&c.addr, 2, 4, 16, prompt_tokens);
    if let Some(n) = prompt_tokens {
        println!("prompts of {n} tokens; tail/prefill: the hand-off tail over its stage's prefill compute, per request (median)");
    }
    println!(
        "{:>11} {:>9} {:>6} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>12} {:>12}",
        "concurrency",
        "requests",
        "ok",
        "failed",
        "ok tok/s",
        "vs C1",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "tail p50",
        "tail p99",
        "tail/prefill",
        "CPU ms/req"
    );
    // SAFETY: sysconf has no preconditions.
    let tick_ms = 1000.0 / (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64);
    let mut out = Vec::new();
    for &conc in levels {
        let n = if requests == 0 { (8 * conc).max(64) } else { requests };
        let t0 = c.cpu_ticks();
        let mut l = load(&c.addr, conc, n, 16, prompt_tokens);
        l.cpu_ms_per_request = (c.cpu_ticks().saturating_sub(t0)) as f64 * tick_ms / f64::from(l.ok.max(1));
        let base = out.first().map_or(l.tok_s, |f: &ServeLevel| f.tok_s);
        let failed: u32 = l.failed.values().sum();
        println!(
            "{:>11} {:>9} {:>6} {:>7} {:>9.1} {:>8.2}x {:>7.1}ms {:>7.1}ms {:>7.2}ms {:>7.2}ms {:>7.3}ms {:>7.3}ms {:>11.4}% {:>10.2}ms",
            conc,
            l.requests,
            l.ok,
            failed,
            l.tok_s,
            l.tok_s / base.max(1e-9),
            l.ttft_p50,
            l.ttft_p99,
            l.itl_p50,
            l.itl_p99,
            l.tail_p50,
            l.tail_p99,
            100.0 * l.tail_share_p50,
            l.cpu_ms_per_request
        );
        if failed > 0 {
            println!("{:>11}   {failed} of {} requests failed; tok/s, TTFT and ITL count the {} that succeeded", "", l.requests, l.ok);
            print!("{}", failure_lines(&l.reasons, 8));
        }
        out.push(l);
    }
    c.shutdown();
    Ok(out)
}

/// The failures of `reasons`, most frequent first, one line each (at most
/// `most` lines, then how many other reasons there were).
pub fn failure_lines(reasons: &BTreeMap<(u16, String), u32>, most: usize) -> String {
    let mut rows: Vec<(&(u16, String), &u32)> = reasons.iter().collect();
    rows.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    let mut out = String::new();
    for ((status, reason), n) in rows.iter().take(most) {
        let status = if *status == 0 { "no answer".to_string() } else { format!("HTTP {status}") };
        out += &format!("{:>11}   {n:>6} x {status}: {reason}\n", "");
    }
    if rows.len() > most {
        let rest: u32 = rows[most..].iter().map(|(_, n)| **n).sum();
        out += &format!("{:>11}   {rest:>6} x ({} other reasons)\n", "", rows.len() - most);
    }
    out
}

/// The picture of a sweep (`bench serve --plot`): one point per level, the
/// same figures the table prints.
pub fn serve_chart(levels: &[ServeLevel], config: Option<&Path>) -> super::plot::ServeChart {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let config = config.map_or("the built-in default (config/trained.toml)".to_string(), |p| p.display().to_string());
    super::plot::ServeChart {
        title: "bench serve: throughput and latency per concurrency level".into(),
        subtitle: format!("{config}, 16 tokens a request, {cores} host cores; successful requests only"),
        points: levels
            .iter()
            .map(|l| super::plot::ServePoint {
                concurrency: l.concurrency,
                tok_s: l.tok_s,
                ttft_p50: l.ttft_p50,
                ttft_p99: l.ttft_p99,
                itl_p50: l.itl_p50,
                itl_p99: l.itl_p99,
            })
            .collect(),
    }
}

/// Requests that failed over every level of a sweep.
pub fn failed_requests(levels: &[ServeLevel]) -> u32 {
    levels.iter().map(|l| l.failed.values().sum::<u32>()).sum()
}
