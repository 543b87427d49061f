//! Every way a request ends badly, and the one place that maps each to its HTTP
//! status, OpenAI error type and code; [`classify`] is the one place that reads a
//! request's [`Failure`] (its status, type, code and metrics labels).

use crate::roles::openai::BodyError;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use handoff_components::failure::{Cause, Failure, PeerLoss, ProcessRole};
use serde_json::{Value, json};

/// How the proxy answers and counts a request that failed after admission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailureClass {
    pub status: StatusCode,
    /// OpenAI's error `type`.
    pub kind: &'static str,
    /// OpenAI's error `code`: the phase it failed in.
    pub code: &'static str,
    /// The labels of `handoff_request_failures_total`: phase and role.
    pub labels: (&'static str, String),
    /// The `phase` label of `handoff_request_timeouts_total`, when it counts there.
    pub timeout: Option<&'static str>,
}

/// Everything the proxy decides from a failure, from its typed fields alone.
/// Every failure after admission is the server's (500), whatever its cause: the
/// request may have been half served. A phase that ran out of time, a role found
/// stopped by its heartbeat included, is a `timeout_error` and counts as a timeout
/// of its phase; a role that died, a compute or transfer error, a cancel are
/// `server_error`s.
pub fn classify(f: &Failure) -> FailureClass {
    // A stopped peer is found by its heartbeat's deadline: it ran out of time.
    let timeout = matches!(f.cause, Cause::Timeout { .. } | Cause::PeerDown { loss: PeerLoss::Stopped, .. });
    FailureClass {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        kind: if timeout { "timeout_error" } else { "server_error" },
        code: f.phase.name(),
        labels: (f.phase.name(), f.role.to_string()),
        timeout: timeout.then(|| f.phase.name()),
    }
}

// `Absence` and `NotReady` live here, beside the `ServeError` that carries them,
// rather than in `state`: `state` imports this module (`ServeError`, `classify`),
// so this one imports nothing from `state`.

/// Why a role cannot take requests now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Absence {
    /// It went down (`why`: what the watchdog or a refused connection saw, and when).
    Down { role: ProcessRole, why: String },
    /// It has not registered yet.
    Unregistered(ProcessRole),
}

/// The roles that are not up: the proxy takes no request until each is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not ready: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct NotReady(pub Vec<Absence>);

impl std::fmt::Display for Absence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Absence::Down { role, why } => write!(f, "{role} is down: {why}"),
            Absence::Unregistered(role) => write!(f, "waiting for {role} to register"),
        }
    }
}

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
    #[error(transparent)]
    NotReady(#[from] NotReady),
    #[error("draining: the server is shutting down and takes no new requests")]
    Draining,
    #[error("admission phase timed out after {0} s waiting for a place")]
    AdmissionTimeout(f64),
    #[error("{phase} phase failed: {0}", phase = .0.phase)]
    Failed(Failure),
    #[error("missing or wrong API key: send Authorization: Bearer <key>")]
    Unauthorized,
    #[error("refused: {0}; every role must hold the proxy's cluster secret (HANDOFF_CLUSTER_SECRET_FILE or HANDOFF_CLUSTER_SECRET)")]
    ClusterSecret(#[from] crate::roles::wire::RegisterAuthError),
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
            ServeError::Failed(f) => classify(f).status,
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
            ServeError::Failed(f) => classify(f).kind,
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
            ServeError::Failed(f) => classify(f).code,
            ServeError::Unauthorized => "invalid_api_key",
            ServeError::ClusterSecret(_) => "invalid_cluster_secret",
            ServeError::BodyTimeout(_) => "body_timeout",
            ServeError::TooManyConnections(_) => "too_many_connections",
        }
    }

    /// The outcome this error counts as in `handoff_requests_total`.
    pub(super) fn outcome(&self) -> &'static str {
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
        if let ServeError::Failed(f) = self {
            body["error"]["phase"] = json!(f.phase.name());
            body["error"]["role"] = json!(f.role.to_string());
            body["error"]["cause"] = json!(f.cause.name());
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

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_components::ecs::PhaseName;
    use handoff_components::failure::ProcessRole;
    use std::time::Duration;

    fn class(phase: PhaseName, role: ProcessRole, cause: Cause) -> (FailureClass, ServeError) {
        let f = Failure::new(phase, role, cause);
        (classify(&f), ServeError::Failed(f))
    }

    /// An engine's deadline: a 500 of type `timeout_error`, coded by its phase,
    /// counted as a failure of (phase, role) and as a timeout of its phase.
    #[test]
    fn a_deadline_is_a_500_counted_as_a_timeout_of_its_phase() {
        let f = Failure::deadline(PhaseName::Transfer, ProcessRole::Prefill { stage: 1 }, Duration::from_secs(300), vec![1]);
        let c = classify(&f);
        assert_eq!(c.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!((c.kind, c.code), ("timeout_error", "transfer"));
        assert_eq!(c.labels, ("transfer", "prefill stage 1".to_string()));
        assert_eq!(c.timeout, Some("transfer"));
        let e = ServeError::Failed(f);
        assert_eq!((e.status(), e.kind(), e.code(), e.outcome()), (StatusCode::INTERNAL_SERVER_ERROR, "timeout_error", "transfer", "failed"));
        let body = e.body();
        assert_eq!(body["error"]["phase"], "transfer");
        assert_eq!(body["error"]["role"], "prefill stage 1");
        assert_eq!(body["error"]["cause"], "timeout");
        assert_eq!(body["error"]["message"], "transfer phase failed: prefill stage 1: transfer phase timed out after 300 s waiting for prefill stage 1");
    }

    /// A role that died: a 500 `server_error` charged to that role, not a timeout;
    /// one found stopped by its heartbeat is a timeout of the phase it stopped in.
    #[test]
    fn a_dead_peer_is_a_failure_of_its_role_and_a_stopped_one_a_timeout() {
        let (dead, e) = class(PhaseName::Decode, ProcessRole::Decode, Cause::PeerDown { loss: PeerLoss::Dead, detail: "died (pid 7: refused)".into() });
        assert_eq!((dead.status, dead.kind, dead.code), (StatusCode::INTERNAL_SERVER_ERROR, "server_error", "decode"));
        assert_eq!(dead.labels, ("decode", "decode".to_string()));
        assert_eq!(dead.timeout, None);
        assert_eq!(e.body()["error"]["cause"], "peer_down");
        let (stopped, _) = class(PhaseName::Compute, ProcessRole::Prefill { stage: 0 }, Cause::PeerDown { loss: PeerLoss::Stopped, detail: "died".into() });
        assert_eq!(stopped.labels, ("compute", "prefill stage 0".to_string()));
        assert_eq!((stopped.kind, stopped.timeout), ("timeout_error", Some("compute")));
    }

    /// The typed path end to end: a decode World whose stages never report fails
    /// the request at its compute deadline with `Cause::Timeout`, charged to
    /// decode and naming the stages it waited for; that failure crosses the wire
    /// as decode's `Msg::Error` and the proxy answers and counts it as a timeout.
    #[test]
    fn a_deadline_in_the_engine_reaches_the_proxy_as_a_timeout() {
        use crate::engine::{Engine, EngineRole, NoMover};
        use crate::roles::wire::Msg;
        use handoff_components::Topology;
        use handoff_components::ecs::Submit;
        let mut topo = Topology::load(concat!(env!("CARGO_MANIFEST_DIR"), "/config/small.toml")).expect("config/small.toml");
        topo.config.timeouts.compute_s = 0.05;
        let cap = handoff_systems::placement::Capacity::serving(&topo);
        let mut engine = Engine::for_role(topo.clone(), EngineRole::Decode, cap, Box::new(NoMover));
        engine.submit_request(Submit { id: 7, tokens: 8, max_tokens: 4, ..Default::default() });
        engine.tick();
        std::thread::sleep(Duration::from_millis(80));
        engine.tick();
        let failure = engine.take_outcomes().into_iter().find_map(|o| o.result.err()).expect("the request failed at its deadline");
        let stages: Vec<u32> = (0..topo.prefill().pp).collect();
        assert_eq!(failure, Failure::deadline(PhaseName::Compute, ProcessRole::Decode, Duration::from_millis(50), stages));
        let line = serde_json::to_string(&Msg::Error { id: 7, failure }).expect("encode");
        let Ok(Msg::Error { failure, .. }) = serde_json::from_str::<Msg>(&line) else { panic!("decode {line}") };
        let c = classify(&failure);
        assert_eq!((c.status, c.kind, c.timeout), (StatusCode::INTERNAL_SERVER_ERROR, "timeout_error", Some("compute")));
        assert_eq!(c.labels, ("compute", "decode".to_string()));
    }

    /// The words of a detail decide nothing: a compute error that says "timed
    /// out" is no timeout, and a detail that names another role charges no one else.
    #[test]
    fn the_text_of_a_failure_decides_nothing() {
        let (c, _) = class(
            PhaseName::Compute,
            ProcessRole::Decode,
            Cause::Compute { detail: "prefill stage 3: timed out, stopped answering, no answer in time".into() },
        );
        assert_eq!((c.kind, c.timeout), ("server_error", None));
        assert_eq!(c.labels, ("compute", "decode".to_string()));
        let (c, _) =
            class(PhaseName::Admission, ProcessRole::Proxy, Cause::Timeout { after: Duration::from_secs(1), waiting_for: vec![], detail: String::new() });
        assert_eq!((c.kind, c.timeout, c.labels.1.as_str()), ("timeout_error", Some("admission"), "proxy"));
    }
}
