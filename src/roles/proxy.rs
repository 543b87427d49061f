//! `handoff proxy --config F`: the HTTP front end (axum).
//!
//! - `POST /v1/completions`: OpenAI-style completions. `prompt` (text, one token
//!   per byte) or `prompt_token_ids` (0..=255), `max_tokens` (default 16), `stream`
//!   (server-sent events, ending with `data: [DONE]`). Admission rules: see the
//!   [module docs of `roles`](super).
//! - `GET /health`: 200 once decode and every prefill stage have registered and
//!   are alive (heartbeat within 2 s), 503 naming what is missing otherwise.
//! - `GET /metrics`: Prometheus text: requests by outcome, refusals by reason,
//!   per-phase timings, bytes handed off, live producer entries per stage.
//! - `POST /internal/register`: the roles' registration and heartbeat.

use super::wire::{Admitted, Msg, PrefillJob, Register};
use super::secs;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use handoff_components::Topology;
use serde::Deserialize;
use serde_json::json;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc};

/// How recent a heartbeat must be for a role to count as alive.
const ALIVE: Duration = Duration::from_secs(2);

#[derive(Clone)]
struct Peer {
    reg: Register,
    seen: Instant,
}

#[derive(Default)]
struct Metrics {
    outcomes: BTreeMap<&'static str, u64>,
    refusals: BTreeMap<&'static str, u64>,
    /// phase -> (sum of seconds, count)
    phases: BTreeMap<&'static str, (f64, u64)>,
    bytes: u64,
    tokens: u64,
}

struct Proxy {
    topo: Topology,
    decode: Mutex<Option<Peer>>,
    stages: Mutex<Vec<Option<Peer>>>,
    places: Arc<Semaphore>,
    queued: AtomicU32,
    next_id: AtomicU64,
    metrics: Mutex<Metrics>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Serves the proxy on `host:port` until SIGINT/SIGTERM.
pub fn run_proxy(topo: &Topology, host: &str, port: u16) -> anyhow::Result<()> {
    super::install_signal_handlers();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(serve(topo.clone(), host.to_string(), port))
}

async fn serve(topo: Topology, host: String, port: u16) -> anyhow::Result<()> {
    let pp = topo.prefill().pp as usize;
    let places = topo.config.serve.max_requests as usize;
    let state = Arc::new(Proxy {
        topo,
        decode: Mutex::new(None),
        stages: Mutex::new(vec![None; pp]),
        places: Arc::new(Semaphore::new(places)),
        queued: AtomicU32::new(0),
        next_id: AtomicU64::new(1),
        metrics: Mutex::new(Metrics::default()),
    });
    let app = Router::new()
        .route("/v1/completions", post(completions))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/internal/register", post(register))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind((host.as_str(), port)).await?;
    tracing::info!(addr = %listener.local_addr()?, "proxy listening");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            while !super::shutting_down() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await?;
    Ok(())
}

async fn register(State(p): State<Arc<Proxy>>, body: Bytes) -> StatusCode {
    let Ok(reg) = serde_json::from_slice::<Register>(&body) else { return StatusCode::BAD_REQUEST };
    let peer = Peer { reg: reg.clone(), seen: Instant::now() };
    match (reg.role.as_str(), reg.stage) {
        ("decode", _) => *lock(&p.decode) = Some(peer),
        ("prefill", Some(s)) => match lock(&p.stages).get_mut(s as usize) {
            Some(slot) => *slot = Some(peer),
            None => return StatusCode::BAD_REQUEST,
        },
        _ => return StatusCode::BAD_REQUEST,
    }
    StatusCode::NO_CONTENT
}

/// Decode's and every stage's control address, or what is missing.
fn peers(p: &Proxy) -> Result<(SocketAddr, Vec<SocketAddr>), String> {
    let mut missing = Vec::new();
    let decode = lock(&p.decode).clone().filter(|d| d.seen.elapsed() < ALIVE);
    if decode.is_none() {
        missing.push("decode".to_string());
    }
    let mut stages = Vec::new();
    for (i, s) in lock(&p.stages).iter().enumerate() {
        match s.as_ref().filter(|s| s.seen.elapsed() < ALIVE) {
            Some(s) => stages.push(s.reg.addr),
            None => missing.push(format!("prefill stage {i}")),
        }
    }
    match decode {
        Some(d) if missing.is_empty() => Ok((d.reg.addr, stages)),
        _ => Err(format!("not ready: waiting for {}", missing.join(", "))),
    }
}

async fn health(State(p): State<Arc<Proxy>>) -> Response {
    // A heartbeat is up to ALIVE old: probe each role too, so that a role that just
    // died (and one restarted but not yet registered) reads as not ready.
    let probed = match peers(&p) {
        Ok((decode, stages)) => {
            let mut missing = Vec::new();
            let named = std::iter::once(("decode".to_string(), decode))
                .chain(stages.into_iter().enumerate().map(|(i, a)| (format!("prefill stage {i}"), a)));
            for (name, addr) in named {
                let ok = matches!(tokio::time::timeout(Duration::from_millis(500), TcpStream::connect(addr)).await, Ok(Ok(_)));
                if !ok {
                    missing.push(format!("{name} (not answering at {addr})"));
                }
            }
            if missing.is_empty() { Ok(()) } else { Err(format!("not ready: waiting for {}", missing.join(", "))) }
        }
        Err(m) => Err(m),
    };
    match probed {
        Ok(()) => (StatusCode::OK, axum::Json(json!({"status": "ok"}))).into_response(),
        Err(m) => (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "starting", "message": m}))).into_response(),
    }
}

async fn metrics(State(p): State<Arc<Proxy>>) -> Response {
    let mut out = String::new();
    {
        let m = lock(&p.metrics);
        out += "# HELP handoff_requests_total Completion requests by outcome.\n# TYPE handoff_requests_total counter\n";
        for o in ["ok", "rejected", "overloaded", "failed"] {
            out += &format!("handoff_requests_total{{outcome=\"{o}\"}} {}\n", m.outcomes.get(o).copied().unwrap_or(0));
        }
        out += "# HELP handoff_refusals_total Requests refused at admission, by reason.\n# TYPE handoff_refusals_total counter\n";
        for (r, n) in &m.refusals {
            out += &format!("handoff_refusals_total{{reason=\"{r}\"}} {n}\n");
        }
        out += "# HELP handoff_phase_seconds Time spent per phase.\n# TYPE handoff_phase_seconds summary\n";
        for (ph, (sum, n)) in &m.phases {
            out += &format!("handoff_phase_seconds_sum{{phase=\"{ph}\"}} {sum:.6}\nhandoff_phase_seconds_count{{phase=\"{ph}\"}} {n}\n");
        }
        out += "# HELP handoff_handoff_bytes_total Bytes written from prefill into decode regions.\n# TYPE handoff_handoff_bytes_total counter\n";
        out += &format!("handoff_handoff_bytes_total {}\n", m.bytes);
        out += "# HELP handoff_generated_tokens_total Tokens generated.\n# TYPE handoff_generated_tokens_total counter\n";
        out += &format!("handoff_generated_tokens_total {}\n", m.tokens);
    }
    out += "# HELP handoff_producer_entries Live producer entries per prefill stage (as the stage reports them).\n# TYPE handoff_producer_entries gauge\n";
    let stages = lock(&p.stages).clone();
    for (i, s) in stages.iter().enumerate() {
        let n = s.as_ref().and_then(|s| s.reg.producer_entries.first().copied()).unwrap_or(0);
        out += &format!("handoff_producer_entries{{stage=\"{i}\"}} {n}\n");
    }
    out += "# HELP handoff_decode_producer_entries Live producer entries per stage in decode's engine.\n# TYPE handoff_decode_producer_entries gauge\n";
    let decode = lock(&p.decode).clone();
    for i in 0..stages.len() {
        let n = decode.as_ref().and_then(|d| d.reg.producer_entries.get(i).copied()).unwrap_or(0);
        out += &format!("handoff_decode_producer_entries{{stage=\"{i}\"}} {n}\n");
    }
    out += "# HELP handoff_live_requests Requests held by decode's engine.\n# TYPE handoff_live_requests gauge\n";
    out += &format!("handoff_live_requests {}\n", decode.map_or(0, |d| d.reg.live_requests));
    out += "# HELP handoff_queued_requests Requests waiting for a place.\n# TYPE handoff_queued_requests gauge\n";
    out += &format!("handoff_queued_requests {}\n", p.queued.load(Ordering::SeqCst));
    ([("content-type", "text/plain; version=0.0.4")], out).into_response()
}

#[derive(Deserialize)]
struct CompletionRequest {
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    prompt_token_ids: Option<Vec<u64>>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    model: Option<String>,
}

fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    (status, axum::Json(json!({"error": {"message": message, "type": kind}}))).into_response()
}

fn refuse(p: &Proxy, reason: &'static str, message: &str) -> Response {
    let mut m = lock(&p.metrics);
    *m.refusals.entry(reason).or_default() += 1;
    *m.outcomes.entry("rejected").or_default() += 1;
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}

/// Validates a request; the prompt tokens and max_tokens, or the 400 response.
#[allow(clippy::result_large_err)] // the Err is the response itself, built once per refusal
fn admit(p: &Proxy, body: &[u8]) -> Result<(Vec<u8>, u32, bool, String), Response> {
    let req: CompletionRequest =
        serde_json::from_slice(body).map_err(|e| refuse(p, "malformed_json", &format!("malformed JSON body: {e}")))?;
    let tokens: Vec<u8> = match (&req.prompt_token_ids, &req.prompt) {
        (Some(ids), _) => {
            if let Some(bad) = ids.iter().find(|&&t| t > 255) {
                return Err(refuse(p, "token_id", &format!("token id {bad} is outside the byte-level vocabulary 0..=255")));
            }
            ids.iter().map(|&t| t as u8).collect()
        }
        (None, Some(text)) => text.as_bytes().to_vec(),
        (None, None) => Vec::new(),
    };
    let topo = &p.topo;
    let max_context = topo.config.serve.max_context as u64;
    let n = tokens.len() as u64;
    if let Err(reason) = handoff_systems::admission::validate(topo, n) {
        let kind = if n == 0 {
            "empty_prompt"
        } else if n >= max_context {
            "prompt_too_long"
        } else {
            "transfer_mode"
        };
        return Err(refuse(p, kind, &reason));
    }
    let max_tokens = req.max_tokens.unwrap_or(16);
    let room = max_context - n;
    if max_tokens == 0 || max_tokens > room {
        return Err(refuse(
            p,
            "max_tokens",
            &format!(
                "max_tokens {max_tokens} is out of range: it must be between 1 and serve.max_context {max_context} minus the prompt's {n} tokens = {room}"
            ),
        ));
    }
    Ok((tokens, max_tokens as u32, req.stream, req.model.unwrap_or_else(|| topo.model().name.clone())))
}

/// What a request's task reports.
enum Ev {
    Token(u8),
    Done(Summary),
    Error { phase: String, message: String },
}

#[derive(Debug, Clone, Default, serde::Serialize)]
struct Summary {
    queue_ms: f64,
    ttft_ms: f64,
    itl_ms: Vec<f64>,
    prefill_compute_ms: f64,
    prefill_transfer_ms: f64,
    handoff_ms: f64,
    decode_ms: f64,
    bytes_handed_off: u64,
}

async fn completions(State(p): State<Arc<Proxy>>, body: Bytes) -> Response {
    let arrived = Instant::now();
    let (prompt, max_tokens, stream, model) = match admit(&p, &body) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let (decode, stages) = match peers(&p) {
        Ok(x) => x,
        Err(m) => {
            *lock(&p.metrics).outcomes.entry("failed").or_default() += 1;
            return error(StatusCode::SERVICE_UNAVAILABLE, "unavailable_error", &m);
        }
    };
    // The bounded queue: a place (blocks + slot on decode) or a queue spot, or 429.
    let permit = match Arc::clone(&p.places).try_acquire_owned() {
        Ok(permit) => permit,
        Err(_) => {
            let cap = p.topo.config.serve.queue;
            let q = p.queued.fetch_add(1, Ordering::SeqCst);
            if q >= cap {
                p.queued.fetch_sub(1, Ordering::SeqCst);
                let mut m = lock(&p.metrics);
                *m.outcomes.entry("overloaded").or_default() += 1;
                *m.refusals.entry("queue_full").or_default() += 1;
                drop(m);
                return error(
                    StatusCode::TOO_MANY_REQUESTS,
                    "overloaded_error",
                    &format!(
                        "overloaded: all {} places are taken and the queue holds {q} of serve.queue = {cap}; retry later",
                        p.topo.config.serve.max_requests
                    ),
                );
            }
            let wait = secs(p.topo.config.timeouts.admission_s);
            let got = tokio::time::timeout(wait, Arc::clone(&p.places).acquire_owned()).await;
            p.queued.fetch_sub(1, Ordering::SeqCst);
            match got {
                Ok(Ok(permit)) => permit,
                _ => {
                    *lock(&p.metrics).outcomes.entry("failed").or_default() += 1;
                    return error(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "timeout_error",
                        &format!("admission phase timed out after {} s waiting for a place", p.topo.config.timeouts.admission_s),
                    );
                }
            }
        }
    };
    let queue_ms = arrived.elapsed().as_secs_f64() * 1e3;
    let id = p.next_id.fetch_add(1, Ordering::SeqCst);
    let (tx, mut rx) = mpsc::channel::<Ev>(64);
    let task_p = Arc::clone(&p);
    let n_prompt = prompt.len();
    tokio::spawn(async move {
        let _permit = permit;
        run_request(&task_p, id, prompt, max_tokens, decode, stages, arrived, queue_ms, tx).await;
    });
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let cid = format!("cmpl-{id}");
    if stream {
        let model2 = model.clone();
        let s = futures_util::stream::unfold(Some(rx), move |rx| {
            let (cid, model) = (cid.clone(), model2.clone());
            async move {
                let mut rx = rx?;
                let ev = match rx.recv().await {
                    Some(Ev::Token(t)) => SseEvent::default().data(
                        json!({"id": cid, "object": "text_completion", "created": created, "model": model,
                               "choices": [{"index": 0, "text": String::from_utf8_lossy(&[t]), "token_ids": [t], "finish_reason": null}]})
                        .to_string(),
                    ),
                    Some(Ev::Done(sum)) => SseEvent::default().data(
                        json!({"id": cid, "object": "text_completion", "created": created, "model": model,
                               "choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}], "handoff": sum})
                        .to_string(),
                    ),
                    Some(Ev::Error { phase, message }) => SseEvent::default()
                        .event("error")
                        .data(json!({"error": {"message": format!("{phase} phase failed: {message}"), "type": "server_error", "phase": phase}}).to_string()),
                    None => return Some((Ok::<_, std::convert::Infallible>(SseEvent::default().data("[DONE]")), None)),
                };
                Some((Ok(ev), Some(rx)))
            }
        });
        return Sse::new(s).into_response();
    }
    let mut toks = Vec::new();
    loop {
        match rx.recv().await {
            Some(Ev::Token(t)) => toks.push(t),
            Some(Ev::Done(sum)) => {
                return axum::Json(json!({
                    "id": cid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": String::from_utf8_lossy(&toks), "token_ids": toks, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": n_prompt, "completion_tokens": toks.len(), "total_tokens": n_prompt + toks.len()},
                    "handoff": sum,
                }))
                .into_response();
            }
            Some(Ev::Error { phase, message }) => {
                let body = json!({"error": {"message": format!("{phase} phase failed: {message}"), "type": "server_error", "phase": phase}});
                return (StatusCode::INTERNAL_SERVER_ERROR, axum::Json(body)).into_response();
            }
            None => return error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "request task ended without an answer"),
        }
    }
}

async fn send_line(s: &mut TcpStream, m: &Msg) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(m).map_err(std::io::Error::other)?;
    line.push(b'\n');
    s.write_all(&line).await
}

async fn recv_line(r: &mut BufReader<tokio::net::tcp::OwnedReadHalf>, timeout: Duration) -> Result<Msg, String> {
    let mut line = Vec::new();
    match tokio::time::timeout(timeout, r.read_until(b'\n', &mut line)).await {
        Err(_) => Err(format!("no answer within {timeout:?}")),
        Ok(Err(e)) => Err(e.to_string()),
        Ok(Ok(0)) => Err("connection closed".into()),
        Ok(Ok(_)) => serde_json::from_slice(&line).map_err(|e| format!("bad message: {e}")),
    }
}

#[allow(clippy::too_many_arguments)]
async fn run_request(
    p: &Proxy,
    id: u64,
    prompt: Vec<u8>,
    max_tokens: u32,
    decode: SocketAddr,
    stages: Vec<SocketAddr>,
    arrived: Instant,
    queue_ms: f64,
    tx: mpsc::Sender<Ev>,
) {
    let t = p.topo.config.timeouts.clone();
    let fail = |phase: &str, message: String| {
        *lock(&p.metrics).outcomes.entry("failed").or_default() += 1;
        Ev::Error { phase: phase.into(), message }
    };
    // 1. Decode admission: blocks, slots, published layouts.
    let conn = match tokio::time::timeout(secs(t.admission_s), TcpStream::connect(decode)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return drop(tx.send(fail("admission", format!("decode at {decode}: {e}"))).await),
        Err(_) => return drop(tx.send(fail("admission", format!("decode at {decode}: connect timed out"))).await),
    };
    let _ = conn.set_nodelay(true);
    let (rd, mut wr) = conn.into_split();
    let mut rd = BufReader::new(rd);
    if let Err(e) = send_line_half(&mut wr, &Msg::Admit { id, prompt_tokens: prompt.len() as u64, max_tokens }).await {
        return drop(tx.send(fail("admission", format!("decode at {decode}: {e}"))).await);
    }
    let admitted: Admitted = match recv_line(&mut rd, secs(t.admission_s + 1.0)).await {
        Ok(Msg::Admitted(a)) => *a,
        Ok(Msg::Error { phase, message }) => return drop(tx.send(fail(&phase, message)).await),
        Ok(other) => return drop(tx.send(fail("admission", format!("decode answered {other:?}"))).await),
        Err(e) => return drop(tx.send(fail("admission", format!("decode at {decode}: {e}"))).await),
    };
    let admitted_at = Instant::now();
    // 2. Prefill: stage 0, which passes the job on stage by stage.
    let job = PrefillJob {
        admitted,
        prompt,
        stage: 0,
        stages: stages.clone(),
        hidden: None,
        bytes: 0,
        compute_ms: 0.0,
        transfer_ms: 0.0,
    };
    let prefill_budget = secs(t.compute_s + t.transfer_s + 1.0);
    let stage0 = stages[0];
    let prefill = tokio::spawn(async move {
        let mut s = match TcpStream::connect(stage0).await {
            Ok(s) => s,
            Err(e) => return Msg::Error { phase: "compute".into(), message: format!("prefill stage 0 at {stage0}: {e}") },
        };
        if let Err(e) = send_line(&mut s, &Msg::Prefill(Box::new(job))).await {
            return Msg::Error { phase: "compute".into(), message: format!("prefill stage 0 at {stage0}: {e}") };
        }
        let (r, _w) = s.into_split();
        let mut r = BufReader::new(r);
        match recv_line(&mut r, prefill_budget).await {
            Ok(m) => m,
            Err(e) => Msg::Error { phase: "compute".into(), message: format!("prefill stage 0 at {stage0}: {e}") },
        }
    });
    // 3. Decode's stream; a failed prefill aborts the request on decode.
    let mut prefill = Some(prefill);
    let mut summary = Summary { queue_ms, ..Default::default() };
    let mut last_tok: Option<Instant> = None;
    let mut n_tokens = 0u64;
    let decode_budget = secs(t.compute_s + t.transfer_s + 60.0);
    loop {
        let msg = if let Some(pf) = prefill.as_mut() {
            tokio::select! {
                r = pf => {
                    prefill = None;
                    match r {
                        Ok(Msg::PrefillDone { bytes, compute_ms, transfer_ms }) => {
                            summary.bytes_handed_off = bytes;
                            summary.prefill_compute_ms = compute_ms;
                            summary.prefill_transfer_ms = transfer_ms;
                        }
                        Ok(Msg::Error { phase, message }) => abort(decode, id, &phase, &message).await,
                        Ok(other) => abort(decode, id, "compute", &format!("prefill answered {other:?}")).await,
                        Err(e) => abort(decode, id, "compute", &format!("prefill task: {e}")).await,
                    }
                    continue;
                }
                m = recv_line(&mut rd, decode_budget) => m,
            }
        } else {
            recv_line(&mut rd, decode_budget).await
        };
        match msg {
            Ok(Msg::Token { token }) => {
                let now = Instant::now();
                match last_tok {
                    None => summary.ttft_ms = (now - arrived).as_secs_f64() * 1e3,
                    Some(prev) => summary.itl_ms.push((now - prev).as_secs_f64() * 1e3),
                }
                last_tok = Some(now);
                n_tokens += 1;
                if tx.send(Ev::Token(token)).await.is_err() {
                    // The client went away; closing the connection ends decode's loop.
                    return;
                }
            }
            Ok(Msg::Done { handoff_ms, decode_ms }) => {
                summary.handoff_ms = handoff_ms;
                summary.decode_ms = decode_ms;
                let _ = admitted_at;
                {
                    let mut m = lock(&p.metrics);
                    *m.outcomes.entry("ok").or_default() += 1;
                    m.bytes += summary.bytes_handed_off;
                    m.tokens += n_tokens;
                    for (ph, ms) in [
                        ("queue", summary.queue_ms),
                        ("prefill_compute", summary.prefill_compute_ms),
                        ("prefill_transfer", summary.prefill_transfer_ms),
                        ("handoff", summary.handoff_ms),
                        ("decode", summary.decode_ms),
                        ("ttft", summary.ttft_ms),
                    ] {
                        let e = m.phases.entry(ph).or_default();
                        e.0 += ms / 1e3;
                        e.1 += 1;
                    }
                }
                let _ = tx.send(Ev::Done(summary)).await;
                return;
            }
            Ok(Msg::Error { phase, message }) => return drop(tx.send(fail(&phase, message)).await),
            Ok(other) => return drop(tx.send(fail("decode", format!("decode sent {other:?}"))).await),
            Err(e) => return drop(tx.send(fail("decode", format!("decode at {decode}: {e}"))).await),
        }
    }
}

async fn send_line_half(w: &mut tokio::net::tcp::OwnedWriteHalf, m: &Msg) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(m).map_err(std::io::Error::other)?;
    line.push(b'\n');
    w.write_all(&line).await
}

/// Tells decode to fail and free a request whose prefill failed.
async fn abort(decode: SocketAddr, id: u64, phase: &str, message: &str) {
    tracing::warn!(request = id, phase, message, "prefill failed; aborting on decode");
    if let Ok(mut s) = TcpStream::connect(decode).await {
        let _ = send_line(&mut s, &Msg::Abort { id, phase: phase.into(), message: message.into() }).await;
        let _ = s.shutdown().await;
    }
}
