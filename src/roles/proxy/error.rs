//! Every way a request ends badly, and the one place that maps each to its HTTP
//! status, OpenAI error type and code.

use crate::roles::openai::BodyError;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use handoff_components::ecs::PhaseName;
use serde_json::{Value, json};

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

/// Whether a failure's message says a phase ran out of time: the engines'
/// deadlines ("... phase timed out after ..."), the proxy's own waits ("no answer
/// in time", "no token in time", "connect timed out") and a peer found stopped
/// by its heartbeat ("stopped answering").
pub(super) fn is_timeout(message: &str) -> bool {
    message.contains("timed out") || message.contains(" in time") || message.contains("stopped answering")
}

/// The role a failure names: a stage's own messages start with `prefill stage N`.
pub(super) fn role_of(message: &str) -> String {
    if let Some(rest) = message.strip_prefix("prefill stage ") {
        let n: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if !n.is_empty() {
            return format!("prefill stage {n}");
        }
    }
    "decode".into()
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
