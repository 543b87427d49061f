//! The error type the phases share for the layers below them. It lives apart
//! from the crate root (which re-exports it) so that `dispatch` and `transfer`
//! import it without importing the root that wires their systems into the
//! schedule.

/// The error of a layer below the systems (the model, its kernels, a transport),
/// kept whole: the systems know it only as an error, and a failure's text is
/// built from it where the request fails.
pub type ErrorSource = std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>;
