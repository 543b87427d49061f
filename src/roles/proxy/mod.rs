//! `handoff proxy --config F`: the HTTP front end (axum).
//!
//! - `POST /v1/completions` and `POST /v1/chat/completions`: the OpenAI API (fields,
//!   chat template and refusals: [`super::openai`]; sampling: [`super::sampling`]).
//!   A body must be `application/json` (415 otherwise) and at most
//!   1 MiB + 16 bytes per token of `serve.max_context` (413 otherwise).
//! - `GET /v1/models` (and `/v1/models/{id}`): the served model, `model.name`.
//! - `GET /health`: 200 once decode and every prefill stage have registered and
//!   are alive; 503 naming what is missing, stopped or dead otherwise (and while
//!   draining). The body lists every role with its pid, its advertised control
//!   address (`addr`), state and restarts.
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
//! same secret, checks the role's proof back, and seals every line it sends and
//! checks every line decode sends ([`super::wire`]); a line of decode's that
//! does not open closes the link and is counted in
//! `handoff_refused_frames_total{role="proxy",kind="control"}`. Every role
//! reports its own refusals (control listener, transport) in its heartbeat, so
//! `/metrics` shows those of the whole cluster.
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
//! (a restart has a new pid) is up again. A request whose role died (not merely
//! stopped) is sent again once the role is back, once per fault, replaying the
//! tokens already streamed (`retry`), and counted in
//! `handoff_request_retries_total{phase,role}`.
//!
//! # Drain
//!
//! On SIGINT or SIGTERM the proxy refuses new requests with 503 (`draining`),
//! lets those in flight finish for up to `serve.drain_s`, fails what is left, and
//! stops. A second signal stops it at once.
//!
//! # The files
//!
//! `server` (listeners, limits, drain), `registry` (registration, watchdog,
//! `/health`), `metrics`, `infer` (one request and its choices), `retry`
//! (a choice sent again after a role died under it), `stream`
//! (whole or SSE answers), `links` (to decode and stage 0), over `state` and
//! `error`.

mod error;
mod infer;
mod links;
mod metrics;
mod registry;
mod retry;
mod server;
mod state;
mod stream;

pub use error::ServeError;
pub use server::{Listen, run_proxy};
