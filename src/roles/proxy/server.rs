//! The listeners: the public API and the roles' control listener, each with its
//! connection cap and header timeout (past the cap, monitoring is still
//! answered), the API-key gate, and the drain.

use super::error::ServeError;
use super::infer::{chat_completions, completions};
use super::metrics::metrics;
use super::registry::{health, register, watchdog};
use super::state::{Links, Metrics, Proxy, Roles, count_closed};
use crate::base::lock;
use crate::roles::host::secs;
use crate::roles::openai::BodyError;
use crate::roles::wire::Msg;
use crate::transport::auth::ClusterSecret;
use axum::Router;
use axum::extract::{Path, State};
use axum::http::{Method, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use handoff_components::Topology;
use handoff_components::ecs::PhaseName;
use handoff_components::failure::{Cause, Failure, ProcessRole};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Semaphore, mpsc};

/// Where the proxy listens: the public API and the roles' control listener.
#[derive(Debug, Clone)]
pub struct Listen {
    pub host: String,
    pub port: u16,
    /// The control listener ([`crate::roles::addr`]): its bind, and what the
    /// roles are to be told (printed when the port is picked here).
    pub control: crate::roles::addr::ListenAddr,
}

/// Serves the proxy (see [`Listen`]) until SIGINT/SIGTERM (then drains).
pub fn run_proxy(topo: &Topology, listen: &Listen, api_key: Option<String>, secret: ClusterSecret) -> anyhow::Result<()> {
    crate::roles::signals::install_signal_handlers();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let r = rt.block_on(serve(topo.clone(), listen.clone(), api_key, secret));
    // Tasks still holding a stream after the drain deadline are dropped here.
    rt.shutdown_timeout(Duration::from_millis(200));
    r
}

pub(super) async fn serve(topo: Topology, listen: Listen, api_key: Option<String>, secret: ClusterSecret) -> anyhow::Result<()> {
    let pp = topo.prefill().pp as usize;
    let places = topo.config.serve.max_requests as usize;
    // Ids differ across restarts of the proxy, so a restarted proxy never reuses an
    // id that decode may still hold from its previous life.
    let epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let max_connections = topo.config.serve.max_connections;
    let state = Arc::new(Proxy {
        topo,
        roles: Mutex::new(Roles::new(pp)),
        places: Arc::new(Semaphore::new(places)),
        queued: AtomicU32::new(0),
        next_id: AtomicU64::new(epoch << 20),
        metrics: Mutex::new(Metrics::default()),
        links: tokio::sync::Mutex::new(Links::default()),
        routes: Arc::new(Mutex::new(HashMap::new())),
        next_link: AtomicU64::new(1),
        draining: AtomicBool::new(false),
        inflight: AtomicU32::new(0),
        restarts: crate::roles::host::restarts(),
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
    // Connections past a listener's cap: monitoring stays reachable on the
    // public one (GET /health and /metrics are answered, one request a
    // connection), and everything else is told 503 at once.
    let refuse = move || async move { ServeError::TooManyConnections(max_connections).into_response() };
    let monitor = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(refuse)
        .method_not_allowed_fallback(refuse)
        .with_state(Arc::clone(&state));
    let control_full = Router::new().fallback(refuse);
    let Listen { host, port, control: control_at } = listen;
    let listener = tokio::net::TcpListener::bind((host.as_str(), port)).await.map_err(|e| anyhow::anyhow!("proxy: cannot listen on {host}:{port}: {e}"))?;
    let control_listener = tokio::net::TcpListener::bind(control_at.bind)
        .await
        .map_err(|e| anyhow::anyhow!("proxy: cannot listen for the roles on {} ({}): {e}", control_at.bind, control_at.bind_from))?;
    tracing::info!(addr = %listener.local_addr()?, control = %control_listener.local_addr()?, "proxy listening");
    let told = control_at.advertised(control_listener.local_addr()?);
    if control_at.bind.port() == 0 || control_at.advertise.is_some() {
        // Port 0 is only useful if the person starting the roles learns the port.
        eprintln!("proxy: control listener at {} (start the roles with --proxy {told})", control_listener.local_addr()?);
    }
    tokio::spawn(watchdog(Arc::clone(&state)));
    let public_slots = Arc::clone(&state.public_slots);
    let server = tokio::spawn(serve_http(listener, (app, monitor), "public", public_slots, Arc::clone(&state)));
    let control_slots = Arc::new(Semaphore::new(max_connections as usize));
    let control_server = tokio::spawn(serve_http(control_listener, (control, control_full), "control", control_slots, Arc::clone(&state)));
    while !crate::roles::signals::shutting_down() {
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

/// Connections past the cap that may be answered at once (monitoring, or their
/// 503); past this a flood's connections are closed without an answer.
pub(super) const REFUSALS_PENDING: usize = 64;

/// Serves `apps.0` on `listener` over HTTP/1.1 with the `[serve]` limits (see
/// the module docs): at most `slots` connections, `serve.header_timeout_s` for
/// each request's headers; a connection past the cap gets `apps.1` for one
/// request (monitoring, or 503). axum's own `serve` sets no header timeout and
/// no cap.
pub(super) async fn serve_http(listener: tokio::net::TcpListener, apps: (Router, Router), label: &'static str, slots: Arc<Semaphore>, p: Arc<Proxy>) {
    let (app, over_cap) = apps;
    let header_timeout = secs(p.topo.config.serve.header_timeout_s);
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
                let svc = hyper_util::service::TowerToHyperService::new(over_cap.clone());
                tokio::spawn(async move {
                    let conn = hyper::server::conn::http1::Builder::new()
                        .timer(hyper_util::rt::TokioTimer::new())
                        .header_read_timeout(header_timeout)
                        .keep_alive(false)
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
                    let _ = conn.await;
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

/// Refuses new requests, waits for those in flight up to `serve.drain_s` (or a
/// second signal), then fails what is left.
pub(super) async fn drain(p: &Arc<Proxy>) {
    p.draining.store(true, Ordering::SeqCst);
    let drain_s = p.topo.config.serve.drain_s;
    let deadline = Instant::now() + secs(drain_s.max(0.001));
    let n = p.inflight.load(Ordering::SeqCst);
    if n > 0 {
        eprintln!("proxy: draining {n} requests in flight (up to serve.drain_s = {drain_s} s; a second signal stops at once)");
    }
    while p.inflight.load(Ordering::SeqCst) > 0 && Instant::now() < deadline && crate::roles::signals::signals() < 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left: Vec<(u64, mpsc::UnboundedSender<Msg>, PhaseName)> = lock(&p.routes).iter().map(|(id, r)| (*id, r.tx.clone(), r.phase)).collect();
    if !left.is_empty() {
        let why =
            if crate::roles::signals::signals() >= 2 { "a second signal stopped the proxy".to_string() } else { format!("serve.drain_s = {drain_s} s passed") };
        eprintln!("proxy: {} requests still in flight; failing them ({why})", left.len());
        for (id, tx, phase) in left {
            let detail = format!("the proxy stopped before the request finished: {why}");
            let _ = tx.send(Msg::Error { id, failure: Failure::new(phase, ProcessRole::Proxy, Cause::Cancelled { detail }) });
        }
        // Lets the failed requests' answers reach their clients.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub(super) async fn not_found(uri: Uri) -> Response {
    ServeError::NotFound(uri.path().to_string()).into_response()
}

pub(super) async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    ServeError::MethodNotAllowed { method: method.to_string(), path: uri.path().to_string() }.into_response()
}

/// The /v1 routes' gate when the proxy has an API key: `Authorization: Bearer KEY`
/// or 401 (as vLLM's `--api-key`). Health, metrics and the roles' registration
/// are not behind it.
pub(super) async fn require_key(State(p): State<Arc<Proxy>>, req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let Some(key) = &p.api_key else { return next.run(req).await };
    let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).map(str::trim);
    if given.is_some_and(|g| crate::transport::auth::ct_eq_secret(g.as_bytes(), key.as_bytes())) {
        return next.run(req).await;
    }
    *lock(&p.metrics).refusals.entry("invalid_api_key").or_default() += 1;
    ServeError::Unauthorized.into_response()
}

pub(super) fn model_object(p: &Proxy) -> Value {
    json!({"id": p.topo.model().name, "object": "model", "created": 0, "owned_by": "handoff",
           "max_model_len": p.topo.config.serve.max_context})
}

pub(super) async fn models(State(p): State<Arc<Proxy>>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_object(&p)]})).into_response()
}

pub(super) async fn model(State(p): State<Arc<Proxy>>, Path(id): Path<String>) -> Response {
    if id == p.topo.model().name { axum::Json(model_object(&p)).into_response() } else { ServeError::Body(BodyError::ModelNotFound(id)).into_response() }
}
