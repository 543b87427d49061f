//! Why a check did not pass: refused before it ran, failed to run, or found the
//! hand-off or the compute wrong. Each kind is its own variant, so a caller (a
//! test, the CLI) tells a finding from a refusal without reading the words.

use super::oracle::{ExecError, OracleError};
use handoff_components::config::{ConfigError, TransferModeError};
use handoff_components::failure::Failure;
/// An error of the layers the checks drive (the model, a backend, device memory):
/// the same shared error the phases carry, not a second definition.
pub use handoff_systems::ErrorSource;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The topology refuses its transfer mode at admission.
    #[error("refused at admission: {0}")]
    Admission(#[source] TransferModeError),
    /// A topology the check derives from the one given does not validate.
    #[error("{what}: {source}")]
    Config {
        what: &'static str,
        #[source]
        source: ConfigError,
    },
    /// The model, a backend or device memory refused.
    #[error("{what}: {source}")]
    Model {
        what: &'static str,
        #[source]
        source: ErrorSource,
    },
    /// The engine failed a request the check submitted.
    #[error("request {request} failed in {phase}: {failure}", phase = failure.phase)]
    Failed { request: u64, failure: Failure },
    /// The oracle found a byte the rules do not put there.
    #[error(transparent)]
    Oracle(#[from] OracleError),
    /// The plans were refused as copies (a byte written twice, out of a region).
    #[error("plan execution refused: {0}")]
    Plans(#[from] ExecError),
    /// The disaggregated run does not compute what the reference does; the
    /// finding (steps, tokens, errors) in words.
    #[error("{0}")]
    Diverged(String),
    /// The engine did not do what the check drove it to (plan, finish, release,
    /// size a region as the layout says); what it did instead.
    #[error("{0}")]
    Engine(String),
    /// Inputs the check cannot run on.
    #[error("{0}")]
    Input(String),
    #[error("{0}'s lock is poisoned")]
    Poisoned(&'static str),
    /// An error of one request of a check, named.
    #[error("{context}: {source}")]
    In {
        context: String,
        #[source]
        source: Box<CheckError>,
    },
}

impl CheckError {
    /// The model's (or a backend's) error, with what the check was doing.
    pub fn model(what: &'static str, e: impl std::error::Error + Send + Sync + 'static) -> CheckError {
        CheckError::Model { what, source: Arc::new(e) }
    }

    /// This error, named as that of `context` (one request, one run).
    pub fn within(self, context: impl Into<String>) -> CheckError {
        CheckError::In { context: context.into(), source: Box::new(self) }
    }

    /// The error under any [`CheckError::In`] context.
    pub fn root(&self) -> &CheckError {
        match self {
            CheckError::In { source, .. } => source.root(),
            other => other,
        }
    }
}
