//! `handoff proxy --config F`: the HTTP front end (axum).
//!
//! - `POST /v1/completions` and `POST /v1/chat/completions`: the OpenAI API (fields,
//!   chat template and refusals: [`super::openai`]; sampling: [`super::sampling`]).
//!   A body must be `application/json` (415 otherwise) and at most
//!   1 MiB + 16 bytes per token of `serve.max_context` (413 otherwise).
//! - `GET /v1/models` (and `/v1/models/{id}`): the served model, `model.name`.
//! - `GET /health`: 200 once decode and every prefill stage have registered and
//!   are alive; 503 naming what is missing, stopped or dead otherwise (and while
//!   draining). The body lists every role with its pid, state and restarts.
//! - `GET /metrics`: Prometheus text: requests by outcome, refusals by reason,
//!   failures and timeouts by phase, latency histograms (TTFT, inter-token,
//!   end-to-end, per phase), bytes handed off, and every role's engine counts,
//!   per-system and per-phase timing histograms, state, restarts and deaths.
//!
//! # Two listeners
//!
//! The routes above are the **public** listener (`--host`/`--port`). The roles'
//! registration and heartbeat (`POST /internal/register`, every 300 ms) is served
//! only on the **control** listener (`--control-host`/`--control-port`, loopback
//! and 8001 by default; `handoff up` picks a free port and hands it to the roles
//! as their `--proxy`). On the public port every `/internal/*` path is a 404 like
//! any unknown route.
//!
//! A register request must carry `X-Handoff-Auth: <unix ms>.<HMAC-SHA256 of the
//! timestamp and body under the cluster secret>` ([`super::wire::register_auth`];
//! the timestamp within 30 s of the proxy's clock); otherwise 401
//! (`invalid_cluster_secret`), counted in
//! `handoff_unauthenticated_connections_total{role="proxy",listener="register"}`.
//! The proxy in turn answers each role's control-listener challenge with the
//! same secret ([`super::wire`]). Every role reports its own refusals (control
//! listener, transport) in its heartbeat, so `/metrics` shows those of the whole
//! cluster.
//!
//! # Slow clients and the connection cap
//!
//! Each listener holds at most `serve.max_connections` connections; one more is
//! answered at once with 503 `too_many_connections` (JSON, `Connection: close`)
//! and closed, or, when more than 64 such answers are pending, closed without
//! one. A connection whose next request's headers do not arrive within
//! `serve.header_timeout_s` (from its first byte, or from the end of the previous
//! response on a kept-alive connection) is closed without an answer: no request
//! was read to answer. A body that does not arrive whole within
//! `serve.body_timeout_s` of its headers gets 408 `body_timeout` and the
//! connection is closed. Both are counted in `handoff_connections_closed_total`.
//!
//! Every error body is OpenAI's `{"error": {"message", "type", "param", "code"}}`
//! (plus `phase` and `role` when a request failed after admission), for every
//! status: 400, 401, 404, 405, 408, 413, 415, 429, 500 and 503.
//!
//! # Liveness
//!
//! A watchdog reads the heartbeats: a role whose last heartbeat is late is probed
//! on its control port; a refused connection means its process is gone (dead), a
//! heartbeat older than 2 s with the port still open means it stopped answering
//! (stopped, hung or partitioned). Either way the role is down at once: `/health`
//! and new requests (503) name it; when decode is down every request on it fails
//! naming decode and the phase it was in (and is cancelled there, for when decode
//! resumes); when prefill stage s is down, decode fails every request still
//! waiting for that stage's writes, naming the stage. A role that registers again
//! (a restart has a new pid) is up again.
//!
//! # Drain
//!
//! On SIGINT or SIGTERM the proxy refuses new requests with 503 (`draining`),
//! lets those in flight finish for up to `serve.drain_s`, fails what is left, and
//! stops. A second signal stops it at once.

use super::host::secs;
use super::openai::{self, BodyError, Endpoint, Generation, StopMatcher, StopStep, Utf8Stream};
use super::prom::{self, Histogram, REQUEST_BUCKETS_S, SYSTEM_BUCKETS_S};
use super::wire::{Admitted, Msg, PrefillJob, Register};
use crate::transport::auth::ClusterSecret;
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use handoff_components::Topology;
use handoff_components::ecs::PhaseName;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc};

/// Every way a request ends badly, and the one place that maps each to its HTTP
/// status, OpenAI error type, code (also the metrics label) and parameter.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Body(#[from] BodyError),
    #[error("no route for {0}")]
    NotFound(String),
    #[error("method {method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },
    #[error("the body is larger than the limit of {limit} bytes")]
    TooLarge { limit: usize },
    #[error("content type {0:?} is not supported: send application/json")]
    MediaType(String),
    #[error("overloaded: all {places} places are taken and the queue holds {queued} of serve.queue = {queue}; retry later")]
    Overloaded { places: u32, queued: u32, queue: u32 },
    #[error("{0}")]
    NotReady(String),
    #[error("draining: the server is shutting down and takes no new requests")]
    Draining,
    #[error("admission phase timed out after {0} s waiting for a place")]
    AdmissionTimeout(f64),
    #[error("{phase} phase failed: {message}")]
    Failed { phase: PhaseName, role: String, message: String },
    #[error("missing or wrong API key: send Authorization: Bearer <key>")]
    Unauthorized,
    #[error("refused: {0}; every role must hold the proxy's cluster secret (HANDOFF_CLUSTER_SECRET_FILE or HANDOFF_CLUSTER_SECRET)")]
    ClusterSecret(String),
    #[error("the request body did not arrive within serve.body_timeout_s = {0} s")]
    BodyTimeout(f64),
    #[error("too many connections: this listener holds serve.max_connections = {0} already; retry later")]
    TooManyConnections(u32),
}

impl ServeError {
    pub fn status(&self) -> StatusCode {
        match self {
            ServeError::Body(BodyError::ModelNotFound(_)) | ServeError::NotFound(_) => StatusCode::NOT_FOUND,
            ServeError::Body(_) => StatusCode::BAD_REQUEST,
            ServeError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ServeError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ServeError::MediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ServeError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            ServeError::NotReady(_) | ServeError::Draining | ServeError::AdmissionTimeout(_) => StatusCode::SERVICE_UNAVAILABLE,
            ServeError::Failed { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            ServeError::Unauthorized | ServeError::ClusterSecret(_) => StatusCode::UNAUTHORIZED,
            ServeError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ServeError::TooManyConnections(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// OpenAI's error `type`.
    pub fn kind(&self) -> &'static str {
        match self {
            ServeError::Body(_)
            | ServeError::NotFound(_)
            | ServeError::MethodNotAllowed { .. }
            | ServeError::TooLarge { .. }
            | ServeError::MediaType(_)
            | ServeError::Unauthorized
            | ServeError::ClusterSecret(_) => "invalid_request_error",
            ServeError::Overloaded { .. } => "overloaded_error",
            ServeError::NotReady(_) | ServeError::Draining | ServeError::TooManyConnections(_) => "unavailable_error",
            ServeError::AdmissionTimeout(_) | ServeError::BodyTimeout(_) => "timeout_error",
            ServeError::Failed { .. } => "server_error",
        }
    }

    /// OpenAI's error `code`, and the `reason` label of `handoff_refusals_total`.
    pub fn code(&self) -> &'static str {
        match self {
            ServeError::Body(e) => match e {
                BodyError::Malformed(_) => "malformed_json",
                BodyError::Invalid { .. } => "invalid_value",
                BodyError::Unsupported { .. } => "unsupported_parameter",
                BodyError::TokenId(_) => "token_id",
                BodyError::ModelNotFound(_) => "model_not_found",
                BodyError::Admission(a) => a.label(),
            },
            ServeError::NotFound(_) => "not_found",
            ServeError::MethodNotAllowed { .. } => "method_not_allowed",
            ServeError::TooLarge { .. } => "payload_too_large",
            ServeError::MediaType(_) => "unsupported_media_type",
            ServeError::Overloaded { .. } => "queue_full",
            ServeError::NotReady(_) => "not_ready",
            ServeError::Draining => "draining",
            ServeError::AdmissionTimeout(_) => "admission_timeout",
            ServeError::Failed { phase, .. } => phase.name(),
            ServeError::Unauthorized => "invalid_api_key",
            ServeError::ClusterSecret(_) => "invalid_cluster_secret",
            ServeError::BodyTimeout(_) => "body_timeout",
            ServeError::TooManyConnections(_) => "too_many_connections",
        }
    }

    /// The outcome this error counts as in `handoff_requests_total`.
    fn outcome(&self) -> &'static str {
        match self.status() {
            StatusCode::TOO_MANY_REQUESTS => "overloaded",
            StatusCode::SERVICE_UNAVAILABLE => "unavailable",
            StatusCode::INTERNAL_SERVER_ERROR => "failed",
            _ => "rejected",
        }
    }

    /// The OpenAI error object (`{"error": {...}}`).
    pub fn body(&self) -> Value {
        let param = match self {
            ServeError::Body(e) => e.param(),
            _ => None,
        };
        let mut body = json!({"error": {"message": self.to_string(), "type": self.kind(), "param": param, "code": self.code()}});
        if let ServeError::Failed { phase, role, .. } = self {
            body["error"]["phase"] = json!(phase.name());
            body["error"]["role"] = json!(role);
        }
        body
    }
}

impl IntoResponse for ServeError {
    fn into_response(self) -> Response {
        if matches!(self, ServeError::Unauthorized) {
            return (self.status(), [(header::WWW_AUTHENTICATE, "Bearer")], axum::Json(self.body())).into_response();
        }
        if matches!(self, ServeError::BodyTimeout(_)) {
            // The rest of the body may still be on its way: the connection is done.
            return (self.status(), [(header::CONNECTION, "close")], axum::Json(self.body())).into_response();
        }
        if matches!(self.status(), StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS) {
            // Overload and a role that is down (restarting, stopped) pass: a client
            // that honours Retry-After comes back when the service may be again.
            return (self.status(), [(header::RETRY_AFTER, "1")], axum::Json(self.body())).into_response();
        }
        (self.status(), axum::Json(self.body())).into_response()
    }
}

/// The /v1 routes' gate when the proxy has an API key: `Authorization: Bearer KEY`
/// or 401 (as vLLM's `--api-key`). Health, metrics and the roles' registration
/// are not behind it.
async fn require_key(State(p): State<Arc<Proxy>>, req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let Some(key) = &p.api_key else { return next.run(req).await };
    let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).map(str::trim);
    if given.is_some_and(|g| crate::transport::auth::ct_eq(g.as_bytes(), key.as_bytes())) {
        return next.run(req).await;
    }
    *lock(&p.metrics).refusals.entry("invalid_api_key").or_default() += 1;
    ServeError::Unauthorized.into_response()
}

/// A heartbeat older than this with the port still open: the role stopped answering.
const ALIVE: Duration = Duration::from_secs(2);
/// A heartbeat this late gets the role's port probed (heartbeats come every 300 ms).
const LATE: Duration = Duration::from_millis(700);

/// Where a registered role stands, as the watchdog sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PeerState {
    Up,
    /// Heartbeats stopped, port open: stopped, hung or partitioned.
    Stopped,
    /// Port refused (or replaced by a new process): gone.
    Dead,
}

impl PeerState {
    fn name(self) -> &'static str {
        match self {
            PeerState::Up => "up",
            PeerState::Stopped => "stopped",
            PeerState::Dead => "dead",
        }
    }
}

#[derive(Clone)]
struct Peer {
    reg: Register,
    seen: Instant,
    state: PeerState,
    /// When it went down, and why.
    down: Option<(Instant, String)>,
}

/// One slot per role: 0 is decode, 1 + s is prefill stage s.
#[derive(Default)]
struct Roles {
    slots: Vec<Option<Peer>>,
    /// Deaths (and stops) the watchdog saw, per slot.
    downs: Vec<u64>,
}

fn role_name(slot: usize) -> String {
    if slot == 0 { "decode".into() } else { format!("prefill stage {}", slot - 1) }
}

/// The role's label in `/metrics`.
fn role_label(slot: usize) -> String {
    if slot == 0 { "decode".into() } else { format!("prefill{}", slot - 1) }
}

struct Metrics {
    outcomes: BTreeMap<&'static str, u64>,
    refusals: BTreeMap<&'static str, u64>,
    /// Seconds per phase of each completed choice.
    phases: BTreeMap<&'static str, Histogram>,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    /// Requests failed after admission, by (phase, role).
    failures: BTreeMap<(&'static str, String), u64>,
    /// Requests failed because a phase ran out of time, by phase.
    timeouts: BTreeMap<&'static str, u64>,
    bytes: u64,
    tokens: u64,
    /// Register requests refused for not proving the cluster secret.
    unauthenticated_register: u64,
    /// Connections closed by a listener's limits: (listener, reason) -> count.
    closed: BTreeMap<(&'static str, &'static str), u64>,
}

impl Default for Metrics {
    fn default() -> Metrics {
        let phases = ["queue", "handoff", "decode"].into_iter().map(|p| (p, Histogram::new(REQUEST_BUCKETS_S))).collect();
        Metrics {
            outcomes: BTreeMap::new(),
            refusals: BTreeMap::new(),
            phases,
            ttft: Histogram::new(REQUEST_BUCKETS_S),
            itl: Histogram::new(REQUEST_BUCKETS_S),
            e2e: Histogram::new(REQUEST_BUCKETS_S),
            failures: BTreeMap::new(),
            timeouts: BTreeMap::new(),
            bytes: 0,
            tokens: 0,
            unauthenticated_register: 0,
            closed: BTreeMap::new(),
        }
    }
}

/// Whether a failure's message says a phase ran out of time: the engines'
/// deadlines ("... phase timed out after ..."), the proxy's own waits ("no answer
/// in time", "no token in time", "connect timed out") and a peer found stopped
/// by its heartbeat ("stopped answering").
fn is_timeout(message: &str) -> bool {
    message.contains("timed out") || message.contains(" in time") || message.contains("stopped answering")
}

/// A choice in flight on the decode link: where decode's messages for it go, the
/// phase it is in (named when decode dies) and which link carries it.
struct Route {
    tx: mpsc::UnboundedSender<Msg>,
    phase: PhaseName,
    link: u64,
}

struct Proxy {
    topo: Topology,
    roles: Mutex<Roles>,
    places: Arc<Semaphore>,
    queued: AtomicU32,
    next_id: AtomicU64,
    metrics: Mutex<Metrics>,
    /// One link to decode and one to stage 0, shared by every request.
    links: tokio::sync::Mutex<Links>,
    routes: Arc<Mutex<HashMap<u64, Route>>>,
    next_link: AtomicU64,
    draining: AtomicBool,
    /// HTTP generation requests being served now.
    inflight: AtomicU32,
    /// This proxy's own restarts (from `up`).
    restarts: u32,
    /// When set, the /v1 routes require `Authorization: Bearer` with it.
    api_key: Option<String>,
    /// What the roles' registrations prove and what the proxy proves to them.
    secret: ClusterSecret,
    /// The public listener's connection places (`serve.max_connections`).
    public_slots: Arc<Semaphore>,
}

#[derive(Default)]
struct Links {
    decode: Option<(SocketAddr, u64, mpsc::UnboundedSender<Msg>)>,
    stage0: Option<(SocketAddr, tokio::net::tcp::OwnedWriteHalf)>,
}

use crate::base::lock;

/// Where the proxy listens: the public API and the roles' control listener.
#[derive(Debug, Clone)]
pub struct Listen {
    pub host: String,
    pub port: u16,
    pub control_host: String,
    pub control_port: u16,
}

/// Serves the proxy (see [`Listen`]) until SIGINT/SIGTERM (then drains).
pub fn run_proxy(topo: &Topology, listen: &Listen, api_key: Option<String>, secret: ClusterSecret) -> anyhow::Result<()> {
    super::signals::install_signal_handlers();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let r = rt.block_on(serve(topo.clone(), listen.clone(), api_key, secret));
    // Tasks still holding a stream after the drain deadline are dropped here.
    rt.shutdown_timeout(Duration::from_millis(200));
    r
}

/// The largest body accepted: room for a prompt of `serve.max_context` tokens as
/// JSON token ids, and a chat of the same length, with headroom.
fn body_limit(topo: &Topology) -> usize {
    (1 << 20) + 16 * topo.config.serve.max_context as usize
}

async fn serve(topo: Topology, listen: Listen, api_key: Option<String>, secret: ClusterSecret) -> anyhow::Result<()> {
    let pp = topo.prefill().pp as usize;
    let places = topo.config.serve.max_requests as usize;
    // Ids differ across restarts of the proxy, so a restarted proxy never reuses an
    // id that decode may still hold from its previous life.
    let epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let max_connections = topo.config.serve.max_connections;
    let state = Arc::new(Proxy {
        topo,
        roles: Mutex::new(Roles { slots: vec![None; pp + 1], downs: vec![0; pp + 1] }),
        places: Arc::new(Semaphore::new(places)),
        queued: AtomicU32::new(0),
        next_id: AtomicU64::new(epoch << 20),
        metrics: Mutex::new(Metrics::default()),
        links: tokio::sync::Mutex::new(Links::default()),
        routes: Arc::new(Mutex::new(HashMap::new())),
        next_link: AtomicU64::new(1),
        draining: AtomicBool::new(false),
        inflight: AtomicU32::new(0),
        restarts: super::host::restarts(),
        api_key,
        secret,
        public_slots: Arc::new(Semaphore::new(max_connections as usize)),
    });
    let v1 = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route_layer(axum::middleware::from_fn_with_state(Arc::clone(&state), require_key));
    let app = Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(Arc::clone(&state));
    // The roles' routes, on their own listener: a client of the public API cannot
    // reach them at all, and what reaches them must prove the cluster secret.
    let control = Router::new()
        .route("/internal/register", post(register))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(Arc::clone(&state));
    let Listen { host, port, control_host, control_port } = listen;
    let listener = tokio::net::TcpListener::bind((host.as_str(), port)).await.map_err(|e| anyhow::anyhow!("proxy: cannot listen on {host}:{port}: {e}"))?;
    let control_listener = tokio::net::TcpListener::bind((control_host.as_str(), control_port))
        .await
        .map_err(|e| anyhow::anyhow!("proxy: cannot listen on --control-host {control_host} --control-port {control_port}: {e}"))?;
    tracing::info!(addr = %listener.local_addr()?, control = %control_listener.local_addr()?, "proxy listening");
    if control_port == 0 {
        // Port 0 is only useful if the person starting the roles learns the port.
        eprintln!("proxy: control listener at {} (start the roles with --proxy {0})", control_listener.local_addr()?);
    }
    tokio::spawn(watchdog(Arc::clone(&state)));
    let public_slots = Arc::clone(&state.public_slots);
    let server = tokio::spawn(serve_http(listener, app, "public", public_slots, Arc::clone(&state)));
    let control_slots = Arc::new(Semaphore::new(max_connections as usize));
    let control_server = tokio::spawn(serve_http(control_listener, control, "control", control_slots, Arc::clone(&state)));
    while !super::signals::shutting_down() {
        if server.is_finished() || control_server.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drain(&state).await;
    server.abort();
    control_server.abort();
    Ok(())
}

/// Connections past the cap that may wait for their 503 at once; past this a
/// flood's connections are closed without an answer.
const REFUSALS_PENDING: usize = 64;

fn count_closed(p: &Proxy, listener: &'static str, reason: &'static str) {
    *lock(&p.metrics).closed.entry((listener, reason)).or_default() += 1;
}

/// Serves `app` on `listener` over HTTP/1.1 with the `[serve]` limits (see the
/// module docs): at most `slots` connections, `serve.header_timeout_s` for each
/// request's headers. axum's own `serve` sets no header timeout and no cap.
async fn serve_http(listener: tokio::net::TcpListener, app: Router, label: &'static str, slots: Arc<Semaphore>, p: Arc<Proxy>) {
    let header_timeout = secs(p.topo.config.serve.header_timeout_s);
    let max = p.topo.config.serve.max_connections;
    let refusing = Arc::new(Semaphore::new(REFUSALS_PENDING));
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of descriptors, most likely: wait for some to be released.
                tracing::warn!(listener = label, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(place) = Arc::clone(&slots).try_acquire_owned() else {
            count_closed(&p, label, "max_connections");
            if let Ok(permit) = Arc::clone(&refusing).try_acquire_owned() {
                tokio::spawn(async move {
                    refuse_connection(stream, max).await;
                    drop(permit);
                });
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        let p = Arc::clone(&p);
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
            if let Err(e) = conn.await
                && e.is_timeout()
            {
                count_closed(&p, label, "header_timeout");
            }
            drop(place);
        });
    }
}

/// Answers a connection past the cap with 503 and closes it. It reads what the
/// client sent, briefly, so that the close is a FIN after the answer rather than
/// a reset that could discard it.
async fn refuse_connection(mut stream: TcpStream, max: u32) {
    use tokio::io::AsyncReadExt;
    let body = ServeError::TooManyConnections(max).body().to_string();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    if tokio::time::timeout(Duration::from_secs(1), stream.write_all(answer.as_bytes())).await.is_err() {
        return;
    }
    let _ = stream.shutdown().await;
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_millis(500), async {
        while let Ok(n) = stream.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
}

/// Refuses new requests, waits for those in flight up to `serve.drain_s` (or a
/// second signal), then fails what is left.
async fn drain(p: &Arc<Proxy>) {
    p.draining.store(true, Ordering::SeqCst);
    let drain_s = p.topo.config.serve.drain_s;
    let deadline = Instant::now() + secs(drain_s.max(0.001));
    let n = p.inflight.load(Ordering::SeqCst);
    if n > 0 {
        eprintln!("proxy: draining {n} requests in flight (up to serve.drain_s = {drain_s} s; a second signal stops at once)");
    }
    while p.inflight.load(Ordering::SeqCst) > 0 && Instant::now() < deadline && super::signals::signals() < 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left: Vec<(u64, mpsc::UnboundedSender<Msg>, PhaseName)> = lock(&p.routes).iter().map(|(id, r)| (*id, r.tx.clone(), r.phase)).collect();
    if !left.is_empty() {
        let why = if super::signals::signals() >= 2 { "a second signal stopped the proxy".to_string() } else { format!("serve.drain_s = {drain_s} s passed") };
        eprintln!("proxy: {} requests still in flight; failing them ({why})", left.len());
        for (id, tx, phase) in left {
            let _ = tx.send(Msg::Error { id, phase, message: format!("the proxy stopped before the request finished: {why}") });
        }
        // Lets the failed requests' answers reach their clients.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn not_found(uri: Uri) -> Response {
    ServeError::NotFound(uri.path().to_string()).into_response()
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    ServeError::MethodNotAllowed { method: method.to_string(), path: uri.path().to_string() }.into_response()
}

fn model_object(p: &Proxy) -> Value {
    json!({"id": p.topo.model().name, "object": "model", "created": 0, "owned_by": "handoff",
           "max_model_len": p.topo.config.serve.max_context})
}

async fn models(State(p): State<Arc<Proxy>>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_object(&p)]})).into_response()
}

async fn model(State(p): State<Arc<Proxy>>, Path(id): Path<String>) -> Response {
    if id == p.topo.model().name { axum::Json(model_object(&p)).into_response() } else { ServeError::Body(BodyError::ModelNotFound(id)).into_response() }
}

async fn register(State(p): State<Arc<Proxy>>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    let auth = headers.get(super::wire::REGISTER_AUTH_HEADER).and_then(|v| v.to_str().ok());
    if let Err(why) = super::wire::check_register_auth(&p.secret, auth, &body, super::wire::unix_ms()) {
        lock(&p.metrics).unauthenticated_register += 1;
        tracing::warn!(%why, "refused an unauthenticated registration");
        return ServeError::ClusterSecret(why).into_response();
    }
    let reg = match serde_json::from_slice::<Register>(&body) {
        Ok(r) => r,
        Err(e) => return ServeError::Body(BodyError::Malformed(e.to_string())).into_response(),
    };
    let pp = p.topo.prefill().pp;
    let slot = match (reg.role.as_str(), reg.stage) {
        ("decode", _) => 0,
        ("prefill", Some(s)) if s < pp => 1 + s as usize,
        _ => {
            let e = BodyError::Invalid { param: "role", message: format!("no role {:?} stage {:?} in this topology (pp {pp})", reg.role, reg.stage) };
            return ServeError::Body(e).into_response();
        }
    };
    let (replaced, settled) = {
        let mut roles = lock(&p.roles);
        let prev = roles.slots[slot].take();
        // A new process where a stopped one was: the old one is gone for good, so
        // what it might still have written is settled.
        let settled = prev.as_ref().is_some_and(|old| old.reg.pid != reg.pid && old.state == PeerState::Stopped);
        // A new process in an up slot: the old one died between two watchdog looks.
        let replaced = prev.as_ref().filter(|old| old.reg.pid != reg.pid && old.state == PeerState::Up).map(|old| old.reg.pid);
        if let Some(old) = &prev
            && old.state != PeerState::Up
        {
            tracing::info!(role = %role_name(slot), pid = reg.pid, was = old.state.name(), "role is back");
        }
        roles.slots[slot] = Some(Peer { reg: reg.clone(), seen: Instant::now(), state: PeerState::Up, down: None });
        if replaced.is_some() {
            roles.downs[slot] += 1;
        }
        (replaced, settled)
    };
    if let Some(old) = replaced {
        role_down(&p, slot, true, format!("died (pid {old} replaced by pid {})", reg.pid)).await;
    } else if settled && slot > 0 {
        role_down(&p, slot, true, format!("was replaced by pid {}", reg.pid)).await;
    }
    StatusCode::NO_CONTENT.into_response()
}

/// Watches every registered role's heartbeat (see the module docs).
async fn watchdog(p: Arc<Proxy>) {
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let late: Vec<(usize, SocketAddr, Duration, u32)> = lock(&p.roles)
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref().filter(|s| s.state == PeerState::Up && s.seen.elapsed() > LATE).map(|s| (i, s.reg.addr, s.seen.elapsed(), s.reg.pid))
            })
            .collect();
        for (slot, addr, age, pid) in late {
            let probe = tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(addr)).await;
            let down = match probe {
                Ok(Err(e)) => Some((PeerState::Dead, format!("died (pid {pid}: {addr} refused: {e})"))),
                _ if age > ALIVE => Some((PeerState::Stopped, format!("stopped answering (pid {pid}: no heartbeat for {:.1} s)", age.as_secs_f64()))),
                _ => None,
            };
            let Some((state, why)) = down else { continue };
            let changed = {
                let mut roles = lock(&p.roles);
                match roles.slots[slot].as_mut() {
                    Some(peer) if peer.state == PeerState::Up && peer.reg.pid == pid => {
                        peer.state = state;
                        peer.down = Some((Instant::now(), why.clone()));
                        roles.downs[slot] += 1;
                        true
                    }
                    _ => false,
                }
            };
            if changed {
                tracing::warn!(role = %role_name(slot), %why, "role down");
                role_down(&p, slot, state == PeerState::Dead, why).await;
            }
        }
    }
}

/// A role went down: fail what depended on it (see the module docs).
async fn role_down(p: &Arc<Proxy>, slot: usize, dead: bool, why: String) {
    if slot == 0 {
        let link = p.links.lock().await.decode.as_ref().map(|(_, _, tx)| tx.clone());
        let routes: Vec<(u64, mpsc::UnboundedSender<Msg>, PhaseName)> = lock(&p.routes).drain().map(|(id, r)| (id, r.tx, r.phase)).collect();
        for (id, tx, phase) in routes {
            let message = format!("decode {why}");
            // A stopped decode reads the cancel when it resumes, and frees the request.
            if let Some(l) = &link {
                // Not `unsent`: the request's task may be sending its job right
                // now; the task itself says so when it returns before sending.
                let _ = l.send(Msg::Cancel { id, phase, message: message.clone(), unsent: false });
            }
            let _ = tx.send(Msg::Error { id, phase, message });
        }
        if dead {
            p.links.lock().await.decode = None;
        }
    } else {
        let stage = (slot - 1) as u32;
        let link = p.links.lock().await.decode.as_ref().map(|(_, _, tx)| tx.clone());
        if let Some(l) = link {
            let _ = l.send(Msg::StageDown { stage, dead, message: why });
        }
        if stage == 0 && dead {
            p.links.lock().await.stage0 = None;
        }
    }
}

/// A role's control port refused a connection: its process is gone. Marks it
/// dead (when `addr` is still its registered address) and says so as a 503: the
/// request had not started there, and is worth retrying once the role is back.
async fn refused(p: &Arc<Proxy>, slot: usize, addr: SocketAddr, e: std::io::Error) -> ServeError {
    let why = format!("died ({addr} refused: {e})");
    let changed = {
        let mut roles = lock(&p.roles);
        match roles.slots[slot].as_mut() {
            Some(peer) if peer.reg.addr == addr && peer.state == PeerState::Up => {
                peer.state = PeerState::Dead;
                peer.down = Some((Instant::now(), why.clone()));
                roles.downs[slot] += 1;
                true
            }
            _ => false,
        }
    };
    if changed {
        tracing::warn!(role = %role_name(slot), %why, "role down");
        role_down(p, slot, true, why.clone()).await;
    }
    ServeError::NotReady(format!("not ready: {} is down: {why}", role_name(slot)))
}

/// Decode's and every stage's control address, or which roles are down.
fn peers(p: &Proxy) -> Result<(SocketAddr, Vec<SocketAddr>), String> {
    let roles = lock(&p.roles);
    let mut missing = Vec::new();
    let mut addrs = Vec::new();
    for (i, s) in roles.slots.iter().enumerate() {
        match s {
            Some(peer) if peer.state == PeerState::Up && peer.seen.elapsed() < ALIVE => addrs.push(peer.reg.addr),
            Some(peer) => {
                let why = peer.down.as_ref().map_or_else(|| "stopped answering".to_string(), |(t, w)| format!("{w}, {:.1} s ago", t.elapsed().as_secs_f64()));
                missing.push(format!("{} is down: {why}", role_name(i)));
            }
            None => missing.push(format!("waiting for {} to register", role_name(i))),
        }
    }
    if missing.is_empty() { Ok((addrs[0], addrs[1..].to_vec())) } else { Err(format!("not ready: {}", missing.join("; "))) }
}

fn roles_json(p: &Proxy) -> Value {
    let roles = lock(&p.roles);
    let list: Vec<Value> = roles
        .slots
        .iter()
        .enumerate()
        .map(|(i, s)| match s {
            Some(peer) => json!({"role": role_name(i), "pid": peer.reg.pid, "state": peer.state.name(), "restarts": peer.reg.restarts,
                                 "heartbeat_age_s": peer.seen.elapsed().as_secs_f64(), "down": peer.down.as_ref().map(|d| d.1.clone())}),
            None => json!({"role": role_name(i), "state": "unregistered"}),
        })
        .collect();
    let mut list = list;
    list.insert(0, json!({"role": "proxy", "pid": std::process::id(), "state": "up", "restarts": p.restarts}));
    json!(list)
}

async fn health(State(p): State<Arc<Proxy>>) -> Response {
    if p.draining.load(Ordering::SeqCst) {
        let m = format!("draining: {} requests in flight", p.inflight.load(Ordering::SeqCst));
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "draining", "message": m, "roles": roles_json(&p)}))).into_response();
    }
    match peers(&p) {
        Ok(_) => (StatusCode::OK, axum::Json(json!({"status": "ok", "roles": roles_json(&p)}))).into_response(),
        Err(m) => (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "unavailable", "message": m, "roles": roles_json(&p)}))).into_response(),
    }
}

async fn metrics(State(p): State<Arc<Proxy>>) -> Response {
    let mut out = String::new();
    {
        let m = lock(&p.metrics);
        out += "# HELP handoff_requests_total Generation requests by outcome (cancelled: the client went away).\n# TYPE handoff_requests_total counter\n";
        for o in ["ok", "rejected", "overloaded", "unavailable", "failed", "cancelled"] {
            out += &format!("handoff_requests_total{{outcome=\"{o}\"}} {}\n", m.outcomes.get(o).copied().unwrap_or(0));
        }
        out += "# HELP handoff_refusals_total Requests refused before generation, by reason.\n# TYPE handoff_refusals_total counter\n";
        for (r, n) in &m.refusals {
            out += &format!("handoff_refusals_total{{reason=\"{r}\"}} {n}\n");
        }
        prom::family(&mut out, "handoff_request_failures_total", "counter", "Requests failed after admission, by the phase and the role that failed them.");
        for ((phase, role), n) in &m.failures {
            out += &format!("handoff_request_failures_total{{phase=\"{phase}\",role=\"{}\"}} {n}\n", prom::escape(role));
        }
        prom::family(
            &mut out,
            "handoff_request_timeouts_total",
            "counter",
            "Requests failed because a phase ran out of time (its deadline, or a peer found stopped), by phase.",
        );
        for ph in ["admission", "compute", "transfer", "decode"] {
            out += &format!("handoff_request_timeouts_total{{phase=\"{ph}\"}} {}\n", m.timeouts.get(ph).copied().unwrap_or(0));
        }
        prom::family(&mut out, "handoff_time_to_first_token_seconds", "histogram", "From the request's arrival to its first token, per choice.");
        prom::write_histogram(&mut out, "handoff_time_to_first_token_seconds", "", &m.ttft);
        prom::family(&mut out, "handoff_inter_token_latency_seconds", "histogram", "Between two tokens of one choice.");
        prom::write_histogram(&mut out, "handoff_inter_token_latency_seconds", "", &m.itl);
        prom::family(&mut out, "handoff_e2e_request_latency_seconds", "histogram", "From the request's arrival to its last token, per completed choice.");
        prom::write_histogram(&mut out, "handoff_e2e_request_latency_seconds", "", &m.e2e);
        prom::family(
            &mut out,
            "handoff_phase_seconds",
            "histogram",
            "Seconds per phase of each completed choice: queue (waiting for a place), handoff (admission to the last write-done), decode.",
        );
        for (ph, h) in &m.phases {
            prom::write_histogram(&mut out, "handoff_phase_seconds", &format!("phase=\"{ph}\""), h);
        }
        out += "# HELP handoff_handoff_bytes_total Bytes written from prefill into decode regions.\n# TYPE handoff_handoff_bytes_total counter\n";
        out += &format!("handoff_handoff_bytes_total {}\n", m.bytes);
        out += "# HELP handoff_generated_tokens_total Tokens generated.\n# TYPE handoff_generated_tokens_total counter\n";
        out += &format!("handoff_generated_tokens_total {}\n", m.tokens);
        out += "# HELP handoff_connections_closed_total Connections a listener refused past serve.max_connections (max_connections) or closed because a request's headers did not arrive within serve.header_timeout_s (header_timeout).\n# TYPE handoff_connections_closed_total counter\n";
        for l in ["public", "control"] {
            for r in ["max_connections", "header_timeout"] {
                out += &format!("handoff_connections_closed_total{{listener=\"{l}\",reason=\"{r}\"}} {}\n", m.closed.get(&(l, r)).copied().unwrap_or(0));
            }
        }
    }
    out += "# HELP handoff_open_connections Connections the public listener holds now.\n# TYPE handoff_open_connections gauge\n";
    out += &format!("handoff_open_connections {}\n", (p.topo.config.serve.max_connections as usize).saturating_sub(p.public_slots.available_permits()));
    let (slots, downs) = {
        let r = lock(&p.roles);
        (r.slots.clone(), r.downs.clone())
    };
    out += "# HELP handoff_role_up Whether the role is registered and answering (1) or not (0).\n# TYPE handoff_role_up gauge\n";
    for (i, s) in slots.iter().enumerate() {
        out += &format!("handoff_role_up{{role=\"{}\"}} {}\n", role_label(i), u8::from(s.as_ref().is_some_and(|s| s.state == PeerState::Up)));
    }
    out += "# HELP handoff_role_restarts_total Times `up` restarted the role.\n# TYPE handoff_role_restarts_total counter\n";
    out += &format!("handoff_role_restarts_total{{role=\"proxy\"}} {}\n", p.restarts);
    for (i, s) in slots.iter().enumerate() {
        out += &format!("handoff_role_restarts_total{{role=\"{}\"}} {}\n", role_label(i), s.as_ref().map_or(0, |s| s.reg.restarts));
    }
    out += "# HELP handoff_role_down_total Times the proxy saw the role die or stop answering.\n# TYPE handoff_role_down_total counter\n";
    for (i, n) in downs.iter().enumerate() {
        out += &format!("handoff_role_down_total{{role=\"{}\"}} {n}\n", role_label(i));
    }
    // What every role's engine holds now (from its last heartbeat): these return to
    // their baseline once every request has left. A role that is down holds
    // nothing (its process is gone, or its requests were failed and are freed when
    // it resumes), so its gauges read 0 until it registers again.
    let live: Vec<(String, &Peer)> = slots.iter().enumerate().filter_map(|(i, s)| s.as_ref().map(|s| (role_label(i), s))).collect();
    let zero = crate::engine::Counts::default();
    let counts = |peer: &Peer| if peer.state == PeerState::Up { peer.reg.counts.clone() } else { zero.clone() };
    for (name, help, get) in [
        ("handoff_engine_entities", "Entities in the role's World.", (|c: &crate::engine::Counts| c.entities as u64) as fn(&crate::engine::Counts) -> u64),
        ("handoff_engine_requests", "Requests the role's engine holds.", |c| c.requests as u64),
        ("handoff_engine_plans", "Plans the role's engine holds.", |c| c.plans as u64),
        ("handoff_producer_entries", "Live producer entries of the role's stage.", |c| c.producer_entries.iter().map(|&(_, n)| n as u64).sum()),
        ("handoff_engine_free_blocks", "Free blocks over the role's ranks.", |c| c.free_blocks),
        ("handoff_engine_free_slots", "Free slots over the role's ranks.", |c| c.free_slots),
    ] {
        out += &format!("# HELP {name} {help}\n# TYPE {name} gauge\n");
        for (role, peer) in &live {
            out += &format!("{name}{{role=\"{role}\"}} {}\n", get(&counts(peer)));
        }
    }
    // Every role's refusals, from its last heartbeat (a counter of that process:
    // it restarts from 0 with the process, as Prometheus counters may).
    out += "# HELP handoff_unauthenticated_connections_total Connections (shm: notification datagrams) refused for not proving the cluster secret, by role and listener.\n# TYPE handoff_unauthenticated_connections_total counter\n";
    out += &format!("handoff_unauthenticated_connections_total{{role=\"proxy\",listener=\"register\"}} {}\n", lock(&p.metrics).unauthenticated_register);
    for (i, s) in slots.iter().enumerate() {
        for (listener, n) in s.as_ref().map(|s| s.reg.unauthenticated.clone()).unwrap_or_default() {
            out += &format!("handoff_unauthenticated_connections_total{{role=\"{}\",listener=\"{listener}\"}} {n}\n", role_label(i));
        }
    }
    out += "# HELP handoff_resident_memory_bytes Resident memory of each role process.\n# TYPE handoff_resident_memory_bytes gauge\n";
    out += &format!("handoff_resident_memory_bytes{{role=\"proxy\"}} {}\n", super::host::rss_bytes());
    for (role, peer) in &live {
        let rss = if peer.state == PeerState::Up { peer.reg.rss_bytes } else { 0 };
        out += &format!("handoff_resident_memory_bytes{{role=\"{role}\"}} {rss}\n");
    }
    // Every role's engine timings since its process started (a restarted role
    // starts again from zero, as a Prometheus counter does after a restart).
    prom::family(
        &mut out,
        "handoff_engine_system_seconds",
        "histogram",
        "Run time of each system of the role's engine schedule, per run (the spans `plan --timings` reads).",
    );
    for (role, peer) in &live {
        for t in &peer.reg.timings {
            let labels = format!("role=\"{role}\",phase=\"{}\",system=\"{}\"", prom::escape(&t.phase), prom::escape(&t.system));
            prom::histogram_series(&mut out, "handoff_engine_system_seconds", &labels, SYSTEM_BUCKETS_S, &t.cumulative, t.count, t.sum_s);
        }
    }
    prom::family(&mut out, "handoff_engine_phase_seconds", "histogram", "Run time of the systems of each phase of the role's engine schedule, per system run.");
    for (role, peer) in &live {
        for (phase, cumulative, count, sum) in prom::per_phase(&peer.reg.timings) {
            prom::histogram_series(
                &mut out,
                "handoff_engine_phase_seconds",
                &format!("role=\"{role}\",phase=\"{phase}\""),
                SYSTEM_BUCKETS_S,
                &cumulative,
                count,
                sum,
            );
        }
    }
    let decode_live = slots[0].as_ref().filter(|s| s.state == PeerState::Up).map_or(0, |d| d.reg.counts.requests);
    out += "# HELP handoff_live_requests Requests held by decode's engine (0 while decode is down).\n# TYPE handoff_live_requests gauge\n";
    out += &format!("handoff_live_requests {decode_live}\n");
    out += "# HELP handoff_queued_requests Requests waiting for a place.\n# TYPE handoff_queued_requests gauge\n";
    out += &format!("handoff_queued_requests {}\n", p.queued.load(Ordering::SeqCst));
    out += "# HELP handoff_inflight_requests Generation requests being served.\n# TYPE handoff_inflight_requests gauge\n";
    out += &format!("handoff_inflight_requests {}\n", p.inflight.load(Ordering::SeqCst));
    ([("content-type", "text/plain; version=0.0.4")], out).into_response()
}

/// One generation request from arrival to its last byte: counts it in flight
/// (the drain waits for it) and, when dropped, counts its outcome once; dropped
/// without one, the client went away (`cancelled`).
struct Served {
    p: Arc<Proxy>,
    outcome: Option<&'static str>,
}

impl Served {
    fn new(p: &Arc<Proxy>) -> Served {
        p.inflight.fetch_add(1, Ordering::SeqCst);
        Served { p: Arc::clone(p), outcome: None }
    }

    /// The request failed: counts its refusal reason and returns its response.
    fn fail(&mut self, e: ServeError) -> Response {
        self.note(&e);
        e.into_response()
    }

    fn note(&mut self, e: &ServeError) {
        if self.outcome.is_none() {
            self.outcome = Some(e.outcome());
            let mut m = lock(&self.p.metrics);
            match e {
                ServeError::Failed { phase, role, message } => {
                    *m.failures.entry((phase.name(), role.clone())).or_default() += 1;
                    if is_timeout(message) {
                        *m.timeouts.entry(phase.name()).or_default() += 1;
                    }
                }
                _ => {
                    if let ServeError::AdmissionTimeout(_) = e {
                        *m.timeouts.entry(PhaseName::Admission.name()).or_default() += 1;
                    }
                    *m.refusals.entry(e.code()).or_default() += 1;
                }
            }
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        *lock(&self.p.metrics).outcomes.entry(self.outcome.unwrap_or("cancelled")).or_default() += 1;
        self.p.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The body as JSON bytes: 415 for another content type (a missing one is read as
/// JSON), 413 past the limit. The body is read chunk by chunk, so an oversized one
/// is never held; one up to 4 times the limit is read to its end (and dropped)
/// before the 413, so that a client that sends it whole, without waiting for
/// `100 Continue`, still reads the answer instead of a reset connection.
async fn read_body(p: &Proxy, headers: &HeaderMap, body: Body) -> Result<Vec<u8>, ServeError> {
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let ct = String::from_utf8_lossy(ct.as_bytes()).to_string();
        let mime = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
        if mime != "application/json" {
            return Err(ServeError::MediaType(ct));
        }
    }
    let limit = body_limit(&p.topo);
    let drain_cap = 4 * limit as u64;
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > drain_cap) {
        return Err(ServeError::TooLarge { limit });
    }
    let mut out = Vec::new();
    let mut seen = 0u64;
    let mut stream = body.into_data_stream();
    let body_timeout = p.topo.config.serve.body_timeout_s;
    let deadline = tokio::time::Instant::now() + secs(body_timeout);
    loop {
        let Ok(next) = tokio::time::timeout_at(deadline, stream.next()).await else {
            return Err(ServeError::BodyTimeout(body_timeout));
        };
        let Some(chunk) = next else { break };
        let chunk = chunk.map_err(|e| ServeError::Body(BodyError::Malformed(format!("reading the body: {e}"))))?;
        seen += chunk.len() as u64;
        if seen > drain_cap {
            break;
        }
        if seen <= limit as u64 {
            out.extend_from_slice(&chunk);
        }
    }
    if seen > limit as u64 {
        return Err(ServeError::TooLarge { limit });
    }
    Ok(out)
}

async fn completions(State(p): State<Arc<Proxy>>, headers: HeaderMap, body: Body) -> Response {
    generate(p, Endpoint::Completions, headers, body).await
}

async fn chat_completions(State(p): State<Arc<Proxy>>, headers: HeaderMap, body: Body) -> Response {
    generate(p, Endpoint::Chat, headers, body).await
}

/// What a choice's task reports.
enum Ev {
    /// Generated bytes that are final (no stop sequence can claim them).
    Piece(Vec<u8>),
    Done {
        finish: &'static str,
        tokens: u32,
        summary: Summary,
    },
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

/// Waits for `k` of the `serve.max_requests` places (one per choice), in the
/// bounded queue.
async fn place(p: &Arc<Proxy>, k: u32) -> Result<tokio::sync::OwnedSemaphorePermit, ServeError> {
    if let Ok(permit) = Arc::clone(&p.places).try_acquire_many_owned(k) {
        return Ok(permit);
    }
    let cap = p.topo.config.serve.queue;
    let q = p.queued.fetch_add(1, Ordering::SeqCst);
    if q >= cap {
        p.queued.fetch_sub(1, Ordering::SeqCst);
        return Err(ServeError::Overloaded { places: p.topo.config.serve.max_requests, queued: q, queue: cap });
    }
    let wait = secs(p.topo.config.timeouts.admission_s);
    let got = tokio::time::timeout(wait, Arc::clone(&p.places).acquire_many_owned(k)).await;
    p.queued.fetch_sub(1, Ordering::SeqCst);
    match got {
        Ok(Ok(permit)) => Ok(permit),
        _ => Err(ServeError::AdmissionTimeout(p.topo.config.timeouts.admission_s)),
    }
}

fn now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

async fn generate(p: Arc<Proxy>, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let arrived = Instant::now();
    let mut served = Served::new(&p);
    if p.draining.load(Ordering::SeqCst) {
        return served.fail(ServeError::Draining);
    }
    let bytes = match read_body(&p, &headers, body).await {
        Ok(b) => b,
        Err(e) => return served.fail(e),
    };
    // A sampled request without a seed gets one no other request shares.
    let clock = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let fresh_seed = super::sampling::uniform(clock, p.inflight.load(Ordering::SeqCst), 0).to_bits() ^ clock;
    let req = match openai::parse(&p.topo, endpoint, &bytes, fresh_seed) {
        Ok(g) => g,
        Err(e) => return served.fail(ServeError::Body(e)),
    };
    if let Err(m) = peers(&p) {
        return served.fail(ServeError::NotReady(m));
    }
    let choices = req.choices();
    let mut permit = match place(&p, choices.len() as u32).await {
        Ok(permit) => permit,
        Err(e) => return served.fail(e),
    };
    // A role may have gone down while the request waited for its place.
    if let Err(m) = peers(&p) {
        return served.fail(ServeError::NotReady(m));
    }
    if p.draining.load(Ordering::SeqCst) {
        return served.fail(ServeError::Draining);
    }
    let queue_ms = arrived.elapsed().as_secs_f64() * 1e3;
    // One id per choice: decode and the stages know each choice as a request.
    let id = p.next_id.fetch_add(choices.len() as u64, Ordering::SeqCst);
    let (tx, rx) = mpsc::channel::<(u32, Ev)>(256);
    for c in &choices {
        // Each choice holds its own place and frees it when it ends.
        let mine = permit.split(1);
        let (task_p, tx) = (Arc::clone(&p), tx.clone());
        let cid = id + u64::from(c.index);
        let prompt = req.prompts[c.prompt].clone();
        let (index, max_tokens, sampling, stops) = (c.index, c.max_tokens, c.sampling, req.stop.clone());
        tokio::spawn(async move {
            let _place = mine;
            run_choice(&task_p, cid, prompt, max_tokens, sampling, stops, arrived, queue_ms, index, tx).await;
            lock(&task_p.routes).remove(&cid);
        });
    }
    drop(tx);
    let created = now_s();
    let prefix = if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" };
    let rid = format!("{prefix}-{id}");
    let prompt_tokens: usize = req.prompts.iter().map(Vec::len).sum();
    if req.stream {
        return stream_response(req, rx, served, rid, created, prompt_tokens);
    }
    collect_response(req, rx, served, rid, created, prompt_tokens).await
}

/// What a choice produced, for a whole (non-streamed) answer.
#[derive(Default)]
struct ChoiceOut {
    bytes: Vec<u8>,
    finish: Option<&'static str>,
    tokens: u32,
    summary: Option<Summary>,
}

fn usage(prompt_tokens: usize, completion: u32) -> Value {
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens as u64 + u64::from(completion)})
}

async fn collect_response(req: Generation, mut rx: mpsc::Receiver<(u32, Ev)>, mut served: Served, rid: String, created: u64, prompt_tokens: usize) -> Response {
    let k = req.prompts.len() * req.n as usize;
    let mut outs: Vec<ChoiceOut> = (0..k).map(|_| ChoiceOut::default()).collect();
    while let Some((i, ev)) = rx.recv().await {
        let Some(o) = outs.get_mut(i as usize) else { continue };
        match ev {
            Ev::Piece(b) => o.bytes.extend(b),
            Ev::Done { finish, tokens, summary } => {
                o.finish = Some(finish);
                o.tokens = tokens;
                o.summary = Some(summary);
            }
            Ev::Error(e) => return served.fail(e),
        }
    }
    if let Some(i) = outs.iter().position(|o| o.finish.is_none()) {
        let e = ServeError::Failed { phase: PhaseName::Decode, role: "proxy".into(), message: format!("choice {i} ended without an answer") };
        return served.fail(e);
    }
    served.outcome = Some("ok");
    let completion: u32 = outs.iter().map(|o| o.tokens).sum();
    let choices: Vec<Value> = outs
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let text = String::from_utf8_lossy(&o.bytes);
            match req.endpoint {
                Endpoint::Completions => json!({"index": i, "text": text, "token_ids": o.bytes, "logprobs": null, "finish_reason": o.finish}),
                Endpoint::Chat => json!({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": o.finish}),
            }
        })
        .collect();
    let object = if req.endpoint == Endpoint::Chat { "chat.completion" } else { "text_completion" };
    axum::Json(json!({
        "id": rid, "object": object, "created": created, "model": req.model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion),
        "handoff": outs.first().and_then(|o| o.summary.clone()),
    }))
    .into_response()
}

/// The state of one streamed answer.
struct Streaming {
    req: Generation,
    rx: mpsc::Receiver<(u32, Ev)>,
    served: Served,
    rid: String,
    created: u64,
    prompt_tokens: usize,
    text: Vec<Utf8Stream>,
    /// Chat: whether the choice's first chunk (the assistant role) went out.
    opened: Vec<bool>,
    completion: u32,
    ready: VecDeque<SseEvent>,
    ended: bool,
}

impl Streaming {
    fn chunk(&self, choice: Value) -> SseEvent {
        let object = if self.req.endpoint == Endpoint::Chat { "chat.completion.chunk" } else { "text_completion" };
        let mut v = json!({"id": self.rid, "object": object, "created": self.created, "model": self.req.model, "choices": [choice]});
        if self.req.include_usage {
            v["usage"] = Value::Null;
        }
        SseEvent::default().data(v.to_string())
    }

    fn piece(&mut self, i: u32, bytes: &[u8], finish: Option<&'static str>) {
        let Some(dec) = self.text.get_mut(i as usize) else { return };
        let mut text = dec.push(bytes);
        if finish.is_some() {
            text += &dec.finish();
        }
        match self.req.endpoint {
            Endpoint::Completions => {
                if !bytes.is_empty() || !text.is_empty() || finish.is_some() {
                    let c = json!({"index": i, "text": text, "token_ids": bytes, "logprobs": null, "finish_reason": finish});
                    let ev = self.chunk(c);
                    self.ready.push_back(ev);
                }
            }
            Endpoint::Chat => {
                if !self.opened[i as usize] {
                    self.opened[i as usize] = true;
                    let ev = self.chunk(json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}));
                    self.ready.push_back(ev);
                }
                if !text.is_empty() {
                    let ev = self.chunk(json!({"index": i, "delta": {"content": text}, "logprobs": null, "finish_reason": null}));
                    self.ready.push_back(ev);
                }
                if finish.is_some() {
                    let ev = self.chunk(json!({"index": i, "delta": {}, "logprobs": null, "finish_reason": finish}));
                    self.ready.push_back(ev);
                }
            }
        }
    }

    /// The next events of the stream, or None at its end.
    async fn next(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(ev) = self.ready.pop_front() {
                return Some(ev);
            }
            if self.ended {
                return None;
            }
            match self.rx.recv().await {
                Some((i, Ev::Piece(b))) => self.piece(i, &b, None),
                Some((i, Ev::Done { finish, tokens, .. })) => {
                    self.completion += tokens;
                    self.piece(i, &[], Some(finish));
                }
                Some((_, Ev::Error(e))) => {
                    // The stream has begun with 200: the error travels as an event,
                    // and the other choices are cancelled when the receiver goes.
                    self.served.note(&e);
                    self.ready.push_back(SseEvent::default().event("error").data(e.body().to_string()));
                    self.ready.push_back(SseEvent::default().data("[DONE]"));
                    self.ended = true;
                    self.rx.close();
                }
                None => {
                    if self.served.outcome.is_none() {
                        self.served.outcome = Some("ok");
                    }
                    if self.req.include_usage {
                        let object = if self.req.endpoint == Endpoint::Chat { "chat.completion.chunk" } else { "text_completion" };
                        let v = json!({"id": self.rid, "object": object, "created": self.created, "model": self.req.model, "choices": [],
                                       "usage": usage(self.prompt_tokens, self.completion)});
                        self.ready.push_back(SseEvent::default().data(v.to_string()));
                    }
                    self.ready.push_back(SseEvent::default().data("[DONE]"));
                    self.ended = true;
                }
            }
        }
    }
}

fn stream_response(req: Generation, rx: mpsc::Receiver<(u32, Ev)>, served: Served, rid: String, created: u64, prompt_tokens: usize) -> Response {
    let k = req.prompts.len() * req.n as usize;
    let st = Streaming {
        req,
        rx,
        served,
        rid,
        created,
        prompt_tokens,
        text: (0..k).map(|_| Utf8Stream::default()).collect(),
        opened: vec![false; k],
        completion: 0,
        ready: VecDeque::new(),
        ended: false,
    };
    let s = futures_util::stream::unfold(st, |mut st| async move {
        let ev = st.next().await?;
        Some((Ok::<_, std::convert::Infallible>(ev), st))
    });
    Sse::new(s).into_response()
}

/// The connecting side of a control handshake ([`super::wire::answer_control`]),
/// each step within [`super::wire::HANDSHAKE_TIMEOUT`].
async fn answer_challenge(r: &mut (impl AsyncBufRead + Unpin), w: &mut (impl AsyncWrite + Unpin), secret: &ClusterSecret) -> std::io::Result<()> {
    let t = super::wire::HANDSHAKE_TIMEOUT;
    let late = |what: &str| std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no {what} within {t:?}"));
    let mut line = Vec::new();
    let n = tokio::time::timeout(t, (&mut *r).take(1024).read_until(b'\n', &mut line)).await.map_err(|_| late("challenge"))??;
    if n == 0 {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the listener closed before its challenge"));
    }
    let answer = super::wire::answer_line(secret, &line)?;
    tokio::time::timeout(t, w.write_all(&answer)).await.map_err(|_| late("room for the answer"))?
}

async fn send_line(s: &mut tokio::net::tcp::OwnedWriteHalf, m: &Msg) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(m).map_err(std::io::Error::other)?;
    line.push(b'\n');
    s.write_all(&line).await
}

/// The link to decode at `addr`: opened on first use, one reader task routing
/// decode's messages by request id; a lost link fails every request it carried.
async fn decode_link(p: &Arc<Proxy>, addr: SocketAddr) -> Result<(u64, mpsc::UnboundedSender<Msg>), ServeError> {
    let mut links = p.links.lock().await;
    if let Some((a, n, tx)) = &links.decode
        && *a == addr
        && !tx.is_closed()
    {
        return Ok((*n, tx.clone()));
    }
    let conn = match tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            drop(links);
            return Err(refused(p, 0, addr, e).await);
        }
        Err(_) => {
            let message = format!("decode at {addr}: connect timed out");
            return Err(ServeError::Failed { phase: PhaseName::Admission, role: "decode".into(), message });
        }
    };
    let _ = conn.set_nodelay(true);
    let (rd, mut wr) = conn.into_split();
    let mut rd = BufReader::new(rd);
    if let Err(e) = answer_challenge(&mut rd, &mut wr, &p.secret).await {
        let message = format!("decode at {addr}: control handshake: {e}");
        return Err(ServeError::Failed { phase: PhaseName::Admission, role: "decode".into(), message });
    }
    let (tx, mut out) = mpsc::unbounded_channel::<Msg>();
    let routes = Arc::clone(&p.routes);
    let proxy = Arc::clone(p);
    let link = p.next_link.fetch_add(1, Ordering::SeqCst);
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
        let mut line = Vec::new();
        loop {
            // Bounded like every control line: a line without end breaks the link
            // instead of growing the buffer without bound.
            match super::wire::read_line_async(&mut rd, &mut line, super::wire::MAX_LINE).await {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "proxy: the link from decode failed");
                    break;
                }
            }
            let Ok(m) = serde_json::from_slice::<Msg>(&line) else {
                tracing::warn!("proxy: malformed message from decode");
                continue;
            };
            let id = match &m {
                Msg::Admitted(a) => a.id,
                Msg::Token { id, .. } | Msg::Done { id, .. } | Msg::Error { id, .. } => *id,
                Msg::Orphaned { stage, requests, endpoint, message } => {
                    settle(&proxy, *stage, requests.clone(), endpoint.clone(), message.clone());
                    continue;
                }
                _ => continue,
            };
            if let Some(r) = lock(&routes).get(&id) {
                let _ = r.tx.send(m);
            }
        }
        writer.abort();
        // The link is gone: every request it carried fails, naming decode and the
        // phase each was in.
        let lost: Vec<(u64, Route)> = {
            let mut routes = lock(&routes);
            let ids: Vec<u64> = routes.iter().filter(|(_, r)| r.link == link).map(|(id, _)| *id).collect();
            ids.into_iter().filter_map(|id| routes.remove(&id).map(|r| (id, r))).collect()
        };
        for (id, r) in lost {
            let _ = r.tx.send(Msg::Error { id, phase: r.phase, message: format!("decode died (its link at {addr} closed)") });
        }
    });
    links.decode = Some((addr, link, tx.clone()));
    Ok((link, tx))
}

/// Asks prefill stage `stage` to settle requests that an earlier stage's death
/// left waiting for it (see [`Msg::Settle`]). Best effort, on its own connection:
/// a stage that is down has its own StageDown, and a stage that cannot be reached
/// leaves the requests to their phase deadline, as before.
fn settle(p: &Arc<Proxy>, stage: u32, requests: Vec<(u64, u64)>, endpoint: crate::transport::PeerAddr, message: String) {
    let addr = lock(&p.roles).slots.get(stage as usize + 1).and_then(|s| s.as_ref().filter(|s| s.state == PeerState::Up).map(|s| s.reg.addr));
    let Some(addr) = addr else { return };
    let n = requests.len();
    let secret = p.secret.clone();
    tokio::spawn(async move {
        let sent = async {
            let conn = TcpStream::connect(addr).await?;
            let (rd, mut wr) = conn.into_split();
            answer_challenge(&mut BufReader::new(rd), &mut wr, &secret).await?;
            send_line(&mut wr, &Msg::Settle { requests, endpoint, message }).await?;
            wr.shutdown().await
        };
        match tokio::time::timeout(Duration::from_secs(2), sent).await {
            Ok(Ok(())) => tracing::info!(stage, requests = n, "asked the stage to settle requests an earlier stage's death left waiting"),
            Ok(Err(e)) => tracing::warn!(stage, error = %e, "settle: stage unreachable"),
            Err(_) => tracing::warn!(stage, "settle: stage did not take the message in time"),
        }
    });
}

/// Sends a job to stage 0 over its link (reopened when it broke). A write that
/// does not complete within 2 s fails (a stopped stage 0 must not hold the link).
/// An error says whether the job may have reached the stage: not when the stage
/// could not be connected to, maybe when a write on the link failed or stalled.
async fn send_stage0(p: &Arc<Proxy>, addr: SocketAddr, msg: &Msg) -> Result<(), (ServeError, Reached)> {
    let failed = |message: String| ServeError::Failed { phase: PhaseName::Compute, role: "prefill stage 0".into(), message };
    let unsent = |e: ServeError| (e, Reached::No);
    let maybe = |e: ServeError| (e, Reached::Maybe);
    let mut links = p.links.lock().await;
    for attempt in 0..2 {
        if links.stage0.as_ref().is_none_or(|(a, _)| *a != addr) {
            let conn = match tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr)).await {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    drop(links);
                    return Err(unsent(refused(p, 1, addr, e).await));
                }
                Err(_) => return Err(unsent(failed(format!("prefill stage 0 at {addr}: connect timed out")))),
            };
            let _ = conn.set_nodelay(true);
            let (rd, mut wr) = conn.into_split();
            if let Err(e) = answer_challenge(&mut BufReader::new(rd), &mut wr, &p.secret).await {
                return Err(unsent(failed(format!("prefill stage 0 at {addr}: control handshake: {e}"))));
            }
            links.stage0 = Some((addr, wr));
        }
        let Some((_, w)) = links.stage0.as_mut() else { continue };
        match tokio::time::timeout(Duration::from_secs(2), send_line(w, msg)).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => {
                links.stage0 = None;
                if attempt == 1 {
                    return Err(maybe(failed(format!("prefill stage 0 at {addr}: {e}"))));
                }
            }
            Err(_) => {
                links.stage0 = None;
                return Err(maybe(failed(format!("prefill stage 0 at {addr}: the write did not complete in 2 s"))));
            }
        }
    }
    Err(maybe(failed(format!("prefill stage 0 at {addr}: not reachable"))))
}

/// Whether a job that failed to send may have reached its stage.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reached {
    No,
    Maybe,
}

/// The role a failure names: a stage's own messages start with `prefill stage N`.
fn role_of(message: &str) -> String {
    if let Some(rest) = message.strip_prefix("prefill stage ") {
        let n: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if !n.is_empty() {
            return format!("prefill stage {n}");
        }
    }
    "decode".into()
}

fn set_phase(p: &Proxy, id: u64, phase: PhaseName) {
    if let Some(r) = lock(&p.routes).get_mut(&id) {
        r.phase = phase;
    }
}

/// One choice through the cluster: decode's admission, prefill, decode's stream,
/// with its stop sequences applied.
#[allow(clippy::too_many_arguments)]
async fn run_choice(
    p: &Arc<Proxy>,
    id: u64,
    prompt: Vec<u8>,
    max_tokens: u32,
    sampling: super::sampling::Sampling,
    stops: Vec<Vec<u8>>,
    arrived: Instant,
    queue_ms: f64,
    index: u32,
    tx: mpsc::Sender<(u32, Ev)>,
) {
    let t = p.topo.config.timeouts.clone();
    let fail = |phase: PhaseName, message: String| {
        let role = role_of(&message);
        (index, Ev::Error(ServeError::Failed { phase, role, message }))
    };
    let decode = match peers(p) {
        Ok((d, _)) => d,
        Err(m) => return drop(tx.send((index, Ev::Error(ServeError::NotReady(m)))).await),
    };
    // 1. Decode admission: blocks, slots, published layouts.
    let (link_id, link) = match decode_link(p, decode).await {
        Ok(l) => l,
        Err(e) => return drop(tx.send((index, Ev::Error(e))).await),
    };
    let (rtx, mut rrx) = mpsc::unbounded_channel();
    lock(&p.routes).insert(id, Route { tx: rtx, phase: PhaseName::Admission, link: link_id });
    // `unsent`: this task returns without having sent the prefill job, so no
    // stage has the request and decode frees it at once.
    let cancel_as = |phase: PhaseName, message: String, unsent: bool| {
        let _ = link.send(Msg::Cancel { id, phase, message, unsent });
    };
    let cancel = |phase: PhaseName, message: String| cancel_as(phase, message, false);
    let cancel_unsent = |phase: PhaseName, message: String| cancel_as(phase, message, true);
    let sampled = (!sampling.is_greedy()).then_some(sampling);
    if link.send(Msg::Admit { id, prompt_tokens: prompt.len() as u64, max_tokens, sampling: sampled }).is_err() {
        return drop(tx.send(fail(PhaseName::Admission, format!("decode at {decode}: link closed"))).await);
    }
    let admitted: Admitted = match tokio::time::timeout(secs(t.admission_s + 1.0), rrx.recv()).await {
        Ok(Some(Msg::Admitted(a))) => *a,
        // The error may be the proxy's own (decode went down while this request
        // was being admitted), whose cancel can have reached decode before the
        // Admit did; a cancel sent now follows the Admit on the link, so decode
        // frees what it admitted (it ignores a cancel of a request it never had).
        Ok(Some(Msg::Error { phase, message, .. })) => {
            cancel_unsent(phase, message.clone());
            return drop(tx.send(fail(phase, message)).await);
        }
        Ok(other) => {
            cancel_unsent(PhaseName::Admission, "unexpected answer to the admission".into());
            return drop(tx.send(fail(PhaseName::Admission, format!("decode answered {other:?}"))).await);
        }
        Err(_) => {
            cancel_unsent(PhaseName::Admission, "no answer from decode in time".into());
            return drop(tx.send(fail(PhaseName::Admission, format!("decode at {decode}: no answer in time"))).await);
        }
    };
    // 2. Prefill: stage 0, which passes the job on stage by stage; stages report to
    // decode. The stages as they are now: one may have restarted meanwhile.
    let stages = match peers(p) {
        Ok((_, s)) => s,
        Err(m) => {
            cancel_unsent(PhaseName::Compute, m.clone());
            return drop(tx.send((index, Ev::Error(ServeError::NotReady(m)))).await);
        }
    };
    set_phase(p, id, PhaseName::Compute);
    let job = PrefillJob { admitted, prompt, stage: 0, stages: stages.clone(), hidden: None, sampling: sampled };
    if let Err((e, reached)) = send_stage0(p, stages[0], &Msg::Prefill(Box::new(job))).await {
        // A job that never reached stage 0 reaches no stage: decode frees at once.
        cancel_as(PhaseName::Compute, e.to_string(), reached == Reached::No);
        return drop(tx.send((index, Ev::Error(e))).await);
    }
    // 3. Decode's stream.
    let mut summary = Summary { queue_ms, ..Default::default() };
    let mut last_tok: Option<Instant> = None;
    let mut n_tokens = 0u32;
    let mut stop = StopMatcher::new(stops);
    let budget = secs(t.compute_s + t.transfer_s + 60.0);
    let finish = loop {
        let msg = match tokio::time::timeout(budget, rrx.recv()).await {
            Ok(Some(m)) => m,
            Ok(None) => return drop(tx.send(fail(PhaseName::Decode, "decode's link closed".into())).await),
            Err(_) => {
                cancel(PhaseName::Decode, "no token from decode in time".into());
                return drop(tx.send(fail(PhaseName::Decode, format!("decode at {decode}: no token in time (within {budget:?})"))).await);
            }
        };
        match msg {
            Msg::Token { token, .. } => {
                let now = Instant::now();
                match last_tok {
                    None => {
                        summary.ttft_ms = (now - arrived).as_secs_f64() * 1e3;
                        lock(&p.metrics).ttft.observe((now - arrived).as_secs_f64());
                        set_phase(p, id, PhaseName::Decode);
                    }
                    Some(prev) => {
                        summary.itl_ms.push((now - prev).as_secs_f64() * 1e3);
                        lock(&p.metrics).itl.observe((now - prev).as_secs_f64());
                    }
                }
                last_tok = Some(now);
                n_tokens += 1;
                let (piece, stopped) = match stop.push(token) {
                    StopStep::Release(b) => (b, false),
                    StopStep::Stopped(b) => (b, true),
                };
                if (!piece.is_empty() || stopped) && tx.send((index, Ev::Piece(piece))).await.is_err() {
                    // The client went away: decode frees the request.
                    cancel(PhaseName::Decode, "the client went away".into());
                    return;
                }
                if stopped {
                    // Decode still generates: it frees the request at the cancel.
                    cancel(PhaseName::Decode, "a stop sequence ended the generation".into());
                    break "stop";
                }
            }
            Msg::Done { handoff_ms, decode_ms, bytes, .. } => {
                summary.handoff_ms = handoff_ms;
                summary.decode_ms = decode_ms;
                summary.bytes_handed_off = bytes;
                let rest = stop.finish();
                if !rest.is_empty() {
                    let _ = tx.send((index, Ev::Piece(rest))).await;
                }
                break "length";
            }
            Msg::Error { phase, message, .. } => return drop(tx.send(fail(phase, message)).await),
            other => return drop(tx.send(fail(PhaseName::Decode, format!("decode sent {other:?}"))).await),
        }
    };
    {
        let mut m = lock(&p.metrics);
        m.bytes += summary.bytes_handed_off;
        m.tokens += u64::from(n_tokens);
        for (ph, ms) in [("queue", summary.queue_ms), ("handoff", summary.handoff_ms), ("decode", summary.decode_ms)] {
            m.phases.entry(ph).or_insert_with(|| Histogram::new(REQUEST_BUCKETS_S)).observe(ms / 1e3);
        }
        m.e2e.observe(arrived.elapsed().as_secs_f64());
    }
    let _ = tx.send((index, Ev::Done { finish, tokens: n_tokens, summary })).await;
}

#[cfg(test)]
mod tests {
    use super::is_timeout;

    #[test]
    fn timeouts_are_told_from_other_failures_by_the_messages_that_make_them() {
        // The engines' deadline (systems/src/release.rs::expire_requests).
        assert!(is_timeout("transfer phase timed out after 300 s waiting for prefill stage 1"));
        // The proxy's own waits and the watchdog.
        assert!(is_timeout("decode at 127.0.0.1:9: no answer in time"));
        assert!(is_timeout("decode at 127.0.0.1:9: no token in time (within 420s)"));
        assert!(is_timeout("prefill stage 0 at 127.0.0.1:9: connect timed out"));
        assert!(is_timeout("decode stopped answering (pid 7: no heartbeat for 2.1 s)"));
        // A death or a refusal is not a timeout.
        assert!(!is_timeout("prefill stage 0: died (127.0.0.1:9 refused: Connection refused)"));
        assert!(!is_timeout("decode died (its link at 127.0.0.1:9 closed)"));
    }
}
