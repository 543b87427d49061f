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
use handoff_components::ecs::PhaseName;
use handoff_systems::admission::AdmissionError;
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
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc};

/// Every way a completion request ends badly, and the one place that maps each to
/// its HTTP status and its metrics label.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ServeError {
    #[error("malformed JSON body: {0}")]
    Malformed(String),
    #[error("token id {0} is outside the byte-level vocabulary 0..=255")]
    TokenId(u64),
    #[error(transparent)]
    Admission(#[from] AdmissionError),
    #[error("overloaded: all {places} places are taken and the queue holds {queued} of serve.queue = {queue}; retry later")]
    Overloaded { places: u32, queued: u32, queue: u32 },
    #[error("{0}")]
    NotReady(String),
    #[error("admission phase timed out after {0} s waiting for a place")]
    AdmissionTimeout(f64),
    #[error("{phase} phase failed: {message}")]
    Failed { phase: PhaseName, message: String },
}

impl ServeError {
    /// HTTP status, error type and metrics label.
    pub fn classify(&self) -> (StatusCode, &'static str, &'static str) {
        match self {
            ServeError::Malformed(_) => (StatusCode::BAD_REQUEST, "invalid_request_error", "malformed_json"),
            ServeError::TokenId(_) => (StatusCode::BAD_REQUEST, "invalid_request_error", "token_id"),
            ServeError::Admission(e) => (StatusCode::BAD_REQUEST, "invalid_request_error", e.label()),
            ServeError::Overloaded { .. } => (StatusCode::TOO_MANY_REQUESTS, "overloaded_error", "queue_full"),
            ServeError::NotReady(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable_error", "not_ready"),
            ServeError::AdmissionTimeout(_) => (StatusCode::SERVICE_UNAVAILABLE, "timeout_error", "admission_timeout"),
            ServeError::Failed { phase, .. } => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", phase.name()),
        }
    }

    /// The outcome this error counts as in `handoff_requests_total`.
    fn outcome(&self) -> &'static str {
        match self.classify().0 {
            StatusCode::BAD_REQUEST => "rejected",
            StatusCode::TOO_MANY_REQUESTS => "overloaded",
            _ => "failed",
        }
    }
}

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
    /// One link to decode and one to stage 0, shared by every request.
    links: tokio::sync::Mutex<Links>,
    /// Where decode's messages for each request in flight go (its HTTP task).
    routes: Arc<Mutex<HashMap<u64, mpsc::UnboundedSender<Msg>>>>,
}

#[derive(Default)]
struct Links {
    decode: Option<(SocketAddr, mpsc::UnboundedSender<Msg>)>,
    stage0: Option<(SocketAddr, tokio::net::tcp::OwnedWriteHalf)>,
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
        links: tokio::sync::Mutex::new(Links::default()),
        routes: Arc::new(Mutex::new(HashMap::new())),
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
    // What every role's engine holds now (from its last heartbeat): these return to
    // their baseline once every request has left, on every rank and stage.
    let stages = lock(&p.stages).clone();
    let decode = lock(&p.decode).clone();
    let roles: Vec<(String, Option<Peer>)> = std::iter::once(("decode".to_string(), decode))
        .chain(stages.into_iter().enumerate().map(|(i, s)| (format!("prefill{i}"), s)))
        .collect();
    for (name, help, get) in [
        ("handoff_engine_entities", "Entities in the role's World.", (|c: &crate::engine::Counts| c.entities as u64) as fn(&crate::engine::Counts) -> u64),
        ("handoff_engine_requests", "Requests the role's engine holds.", |c| c.requests as u64),
        ("handoff_engine_plans", "Plans the role's engine holds.", |c| c.plans as u64),
        ("handoff_producer_entries", "Live producer entries of the role's stage.", |c| c.producer_entries.iter().map(|&(_, n)| n as u64).sum()),
        ("handoff_engine_free_blocks", "Free blocks over the role's ranks.", |c| c.free_blocks),
        ("handoff_engine_free_slots", "Free slots over the role's ranks.", |c| c.free_slots),
    ] {
        out += &format!("# HELP {name} {help}\n# TYPE {name} gauge\n");
        for (role, peer) in &roles {
            if let Some(peer) = peer {
                out += &format!("{name}{{role=\"{role}\"}} {}\n", get(&peer.reg.counts));
            }
        }
    }
    out += "# HELP handoff_resident_memory_bytes Resident memory of each role process.\n# TYPE handoff_resident_memory_bytes gauge\n";
    for (role, peer) in &roles {
        if let Some(peer) = peer {
            out += &format!("handoff_resident_memory_bytes{{role=\"{role}\"}} {}\n", peer.reg.rss_bytes);
        }
    }
    out += "# HELP handoff_live_requests Requests held by decode's engine.\n# TYPE handoff_live_requests gauge\n";
    out += &format!("handoff_live_requests {}\n", roles[0].1.as_ref().map_or(0, |d| d.reg.counts.requests));
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

fn error_response(p: &Proxy, e: &ServeError) -> Response {
    let (status, kind, label) = e.classify();
    {
        let mut m = lock(&p.metrics);
        *m.outcomes.entry(e.outcome()).or_default() += 1;
        if status != StatusCode::INTERNAL_SERVER_ERROR {
            *m.refusals.entry(label).or_default() += 1;
        }
    }
    let mut body = json!({"error": {"message": e.to_string(), "type": kind}});
    if let ServeError::Failed { phase, .. } = e {
        body["error"]["phase"] = json!(phase.name());
    }
    (status, axum::Json(body)).into_response()
}

/// Validates a request: the prompt tokens, max_tokens, stream and model.
fn admit(p: &Proxy, body: &[u8]) -> Result<(Vec<u8>, u32, bool, String), ServeError> {
    let req: CompletionRequest = serde_json::from_slice(body).map_err(|e| ServeError::Malformed(e.to_string()))?;
    let tokens: Vec<u8> = match (&req.prompt_token_ids, &req.prompt) {
        (Some(ids), _) => {
            if let Some(&bad) = ids.iter().find(|&&t| t > 255) {
                return Err(ServeError::TokenId(bad));
            }
            ids.iter().map(|&t| t as u8).collect()
        }
        (None, Some(text)) => text.as_bytes().to_vec(),
        (None, None) => Vec::new(),
    };
    let max_tokens = req.max_tokens.unwrap_or(16);
    handoff_systems::admission::validate_generation(&p.topo, tokens.len() as u64, max_tokens)?;
    Ok((tokens, max_tokens as u32, req.stream, req.model.unwrap_or_else(|| p.topo.model().name.clone())))
}

/// What a request's task reports.
enum Ev {
    Token(u8),
    Done(Summary),
    Error(ServeError),
}

#[derive(Debug, Clone, Default, serde::Serialize)]
struct Summary {
    queue_ms: f64,
    ttft_ms: f64,
    itl_ms: Vec<f64>,
    handoff_ms: f64,
    decode_ms: f64,
    bytes_handed_off: u64,
}

/// Waits for one of `serve.max_requests` places, in the bounded queue.
async fn place(p: &Arc<Proxy>) -> Result<tokio::sync::OwnedSemaphorePermit, ServeError> {
    if let Ok(permit) = Arc::clone(&p.places).try_acquire_owned() {
        return Ok(permit);
    }
    let cap = p.topo.config.serve.queue;
    let q = p.queued.fetch_add(1, Ordering::SeqCst);
    if q >= cap {
        p.queued.fetch_sub(1, Ordering::SeqCst);
        return Err(ServeError::Overloaded { places: p.topo.config.serve.max_requests, queued: q, queue: cap });
    }
    let wait = secs(p.topo.config.timeouts.admission_s);
    let got = tokio::time::timeout(wait, Arc::clone(&p.places).acquire_owned()).await;
    p.queued.fetch_sub(1, Ordering::SeqCst);
    match got {
        Ok(Ok(permit)) => Ok(permit),
        _ => Err(ServeError::AdmissionTimeout(p.topo.config.timeouts.admission_s)),
    }
}

async fn completions(State(p): State<Arc<Proxy>>, body: Bytes) -> Response {
    let arrived = Instant::now();
    let (prompt, max_tokens, stream, model) = match admit(&p, &body) {
        Ok(x) => x,
        Err(e) => return error_response(&p, &e),
    };
    let (decode, stages) = match peers(&p) {
        Ok(x) => x,
        Err(m) => return error_response(&p, &ServeError::NotReady(m)),
    };
    let permit = match place(&p).await {
        Ok(permit) => permit,
        Err(e) => return error_response(&p, &e),
    };
    let queue_ms = arrived.elapsed().as_secs_f64() * 1e3;
    let id = p.next_id.fetch_add(1, Ordering::SeqCst);
    let (tx, mut rx) = mpsc::channel::<Ev>(64);
    let task_p = Arc::clone(&p);
    let n_prompt = prompt.len();
    tokio::spawn(async move {
        let _permit = permit;
        run_request(&task_p, id, prompt, max_tokens, decode, stages, arrived, queue_ms, tx).await;
        lock(&task_p.routes).remove(&id);
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
                    Some(Ev::Error(e)) => {
                        let phase = match &e {
                            ServeError::Failed { phase, .. } => phase.name(),
                            _ => "admission",
                        };
                        SseEvent::default()
                            .event("error")
                            .data(json!({"error": {"message": e.to_string(), "type": e.classify().1, "phase": phase}}).to_string())
                    }
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
            Some(Ev::Error(e)) => return error_response(&p, &e),
            None => {
                let e = ServeError::Failed { phase: PhaseName::Decode, message: "request task ended without an answer".into() };
                return error_response(&p, &e);
            }
        }
    }
}

async fn send_line(s: &mut tokio::net::tcp::OwnedWriteHalf, m: &Msg) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(m).map_err(std::io::Error::other)?;
    line.push(b'\n');
    s.write_all(&line).await
}

/// The link to decode at `addr`: opened on first use, one reader task routing
/// decode's messages by request id; a lost link fails every request it carried.
async fn decode_link(p: &Arc<Proxy>, addr: SocketAddr) -> Result<mpsc::UnboundedSender<Msg>, String> {
    let mut links = p.links.lock().await;
    if let Some((a, tx)) = &links.decode
        && *a == addr
        && !tx.is_closed()
    {
        return Ok(tx.clone());
    }
    let conn = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
        .await
        .map_err(|_| format!("decode at {addr}: connect timed out"))?
        .map_err(|e| format!("decode at {addr}: {e}"))?;
    let _ = conn.set_nodelay(true);
    let (rd, mut wr) = conn.into_split();
    let (tx, mut out) = mpsc::unbounded_channel::<Msg>();
    let routes = Arc::clone(&p.routes);
    tokio::spawn(async move {
        // The writer is its own task: a read cancelled half-way by a select would
        // lose the bytes of a partly read line.
        let writer = tokio::spawn(async move {
            while let Some(m) = out.recv().await {
                if send_line(&mut wr, &m).await.is_err() {
                    break;
                }
            }
        });
        let mut rd = BufReader::new(rd);
        let mut line = Vec::new();
        loop {
            line.clear();
            match rd.read_until(b'\n', &mut line).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            let Ok(m) = serde_json::from_slice::<Msg>(&line) else {
                tracing::warn!("proxy: malformed message from decode");
                continue;
            };
            let id = match &m {
                Msg::Admitted(a) => a.id,
                Msg::Token { id, .. } | Msg::Done { id, .. } | Msg::Error { id, .. } => *id,
                _ => continue,
            };
            if let Some(r) = lock(&routes).get(&id) {
                let _ = r.send(m);
            }
        }
        writer.abort();
        // The link is gone: every request it carried fails, naming decode.
        let lost: Vec<_> = lock(&routes).drain().collect();
        for (id, r) in lost {
            let _ = r.send(Msg::Error { id, phase: PhaseName::Decode, message: format!("decode at {addr}: connection lost") });
        }
    });
    links.decode = Some((addr, tx.clone()));
    Ok(tx)
}

/// Sends a job to stage 0 over its link (reopened when it broke).
async fn send_stage0(p: &Proxy, addr: SocketAddr, msg: &Msg) -> Result<(), String> {
    let mut links = p.links.lock().await;
    for attempt in 0..2 {
        if links.stage0.as_ref().is_none_or(|(a, _)| *a != addr) {
            let conn = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
                .await
                .map_err(|_| format!("prefill stage 0 at {addr}: connect timed out"))?
                .map_err(|e| format!("prefill stage 0 at {addr}: {e}"))?;
            let _ = conn.set_nodelay(true);
            links.stage0 = Some((addr, conn.into_split().1));
        }
        let Some((_, w)) = links.stage0.as_mut() else { continue };
        match send_line(w, msg).await {
            Ok(()) => return Ok(()),
            Err(e) => {
                links.stage0 = None;
                if attempt == 1 {
                    return Err(format!("prefill stage 0 at {addr}: {e}"));
                }
            }
        }
    }
    Err(format!("prefill stage 0 at {addr}: not reachable"))
}

#[allow(clippy::too_many_arguments)]
async fn run_request(
    p: &Arc<Proxy>,
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
    let fail = |phase: PhaseName, message: String| Ev::Error(ServeError::Failed { phase, message });
    // 1. Decode admission: blocks, slots, published layouts.
    let (rtx, mut rrx) = mpsc::unbounded_channel();
    lock(&p.routes).insert(id, rtx);
    let link = match decode_link(p, decode).await {
        Ok(l) => l,
        Err(m) => return drop(tx.send(fail(PhaseName::Admission, m)).await),
    };
    let cancel = |phase: PhaseName, message: String| {
        let _ = link.send(Msg::Cancel { id, phase, message });
    };
    if link.send(Msg::Admit { id, prompt_tokens: prompt.len() as u64, max_tokens }).is_err() {
        return drop(tx.send(fail(PhaseName::Admission, format!("decode at {decode}: link closed"))).await);
    }
    let admitted: Admitted = match tokio::time::timeout(secs(t.admission_s + 1.0), rrx.recv()).await {
        Ok(Some(Msg::Admitted(a))) => *a,
        Ok(Some(Msg::Error { phase, message, .. })) => return drop(tx.send(fail(phase, message)).await),
        Ok(other) => return drop(tx.send(fail(PhaseName::Admission, format!("decode answered {other:?}"))).await),
        Err(_) => {
            cancel(PhaseName::Admission, "no answer from decode in time".into());
            return drop(tx.send(fail(PhaseName::Admission, format!("decode at {decode}: no answer in time"))).await);
        }
    };
    // 2. Prefill: stage 0, which passes the job on stage by stage; stages report to decode.
    let job = PrefillJob { admitted, prompt, stage: 0, stages: stages.clone(), hidden: None };
    if let Err(m) = send_stage0(p, stages[0], &Msg::Prefill(Box::new(job))).await {
        cancel(PhaseName::Compute, m.clone());
        return drop(tx.send(fail(PhaseName::Compute, m)).await);
    }
    // 3. Decode's stream.
    let mut summary = Summary { queue_ms, ..Default::default() };
    let mut last_tok: Option<Instant> = None;
    let mut n_tokens = 0u64;
    let budget = secs(t.compute_s + t.transfer_s + 60.0);
    loop {
        let msg = match tokio::time::timeout(budget, rrx.recv()).await {
            Ok(Some(m)) => m,
            Ok(None) => return drop(tx.send(fail(PhaseName::Decode, "decode's link closed".into())).await),
            Err(_) => {
                cancel(PhaseName::Decode, "no token from decode in time".into());
                return drop(tx.send(fail(PhaseName::Decode, format!("decode at {decode}: no token within {budget:?}"))).await);
            }
        };
        match msg {
            Msg::Token { token, .. } => {
                let now = Instant::now();
                match last_tok {
                    None => summary.ttft_ms = (now - arrived).as_secs_f64() * 1e3,
                    Some(prev) => summary.itl_ms.push((now - prev).as_secs_f64() * 1e3),
                }
                last_tok = Some(now);
                n_tokens += 1;
                if tx.send(Ev::Token(token)).await.is_err() {
                    // The client went away: decode frees the request.
                    cancel(PhaseName::Decode, "the client went away".into());
                    return;
                }
            }
            Msg::Done { handoff_ms, decode_ms, bytes, .. } => {
                summary.handoff_ms = handoff_ms;
                summary.decode_ms = decode_ms;
                summary.bytes_handed_off = bytes;
                {
                    let mut m = lock(&p.metrics);
                    *m.outcomes.entry("ok").or_default() += 1;
                    m.bytes += summary.bytes_handed_off;
                    m.tokens += n_tokens;
                    for (ph, ms) in
                        [("queue", summary.queue_ms), ("handoff", summary.handoff_ms), ("decode", summary.decode_ms), ("ttft", summary.ttft_ms)]
                    {
                        let e = m.phases.entry(ph).or_default();
                        e.0 += ms / 1e3;
                        e.1 += 1;
                    }
                }
                let _ = tx.send(Ev::Done(summary)).await;
                return;
            }
            Msg::Error { phase, message, .. } => return drop(tx.send(fail(phase, message)).await),
            other => return drop(tx.send(fail(PhaseName::Decode, format!("decode sent {other:?}"))).await),
        }
    }
}
