//! The role processes of a deployment: `proxy` (HTTP front end), one `prefill`
//! process per PP stage, `decode`, and `up`, which starts them all.
//!
//! Each prefill stage and decode runs one [`Engine`] for its own ranks on one
//! engine thread; the role's other threads only carry bytes between sockets, the
//! transport and that thread (commands in, events out). Per-request state lives in
//! the engine's World; every control message names its request, so one link
//! between two roles carries all of them.
//!
//! # The flow of one request
//!
//! 1. The proxy validates the request (below), then waits in the bounded queue for
//!    one of `serve.max_requests` places.
//! 2. Decode admits it: its engine allocates blocks and slots on every decode rank
//!    and publishes each rank's [`ConsumerLayout`] plus its region handles.
//! 3. The proxy sends the request and the published layouts to prefill stage 0.
//!    Stage s's engine plans its own copies from the published layouts, computes
//!    its layers into its source regions (dispatch phase) and hands the hidden
//!    states to stage s + 1 at once; its transfer phase writes the stage's KV and
//!    KDA state into decode's regions while it computes the next request; when the
//!    writes complete it drops its producer entry and sends decode its write-done
//!    report over the transport (or a failure notice naming the stage and phase).
//! 4. Once every stage has reported for every decode rank, the request joins
//!    decode's batch: each tick decodes every live request in one step from the
//!    registered decode regions, and tokens stream back over the proxy's link.
//!
//! [`Engine`]: crate::engine::Engine
//!
//! # Who may connect
//!
//! Every role refuses to start without the cluster secret ([`crate::transport::auth`];
//! `up` hands its children one). The proxy serves the API on its public listener
//! and the roles' registration on a separate control listener; each role-to-role
//! connection (register, control links, transport hello and notifications) proves
//! the secret before anything it carries is read, and every refusal is counted
//! and reported in the heartbeat ([`proxy`]'s module docs list them).
//!
//! # Admission (HTTP status and reason)
//!
//! `POST /v1/completions` refuses a request **before it is enqueued** with HTTP 400
//! and `{"error": {"message": <reason>, "type": "invalid_request_error"}}` when:
//! the body is not valid JSON (or has the wrong field types); the prompt is empty
//! (`prompt` and `prompt_token_ids` both missing or empty); a token id is outside
//! the byte-level vocabulary 0..=255; the prompt does not fit `serve.max_context`
//! (prompt plus at least one generated token); `max_tokens` is 0 or larger than
//! `serve.max_context` minus the prompt; or decode cannot serve the configured
//! transfer mode (for example chunked transfer of a stateful model to a DCP decode).
//!
//! Overload is not an error of the request: while all `serve.max_requests` places
//! (decode blocks and slots) are taken, a request waits in a queue of at most
//! `serve.queue` requests, for at most `timeouts.admission_s`. Past the queue the
//! proxy answers HTTP 429 with `"type": "overloaded_error"`; a request that waited
//! past the admission timeout gets HTTP 503 naming the admission phase.
//!
//! A request that fails after admission (a prefill stage died, a phase timed out)
//! gets HTTP 500 (or an SSE `error` event) whose message names the phase
//! (`compute`, `transfer`, `decode`); everything it held is freed.
//!
//! [`ConsumerLayout`]: handoff_components::layout::ConsumerLayout

pub mod addr;
pub mod client;
pub mod decode;
pub mod host;
pub mod mps;
pub mod openai;
pub mod prefill;
pub mod prom;
pub mod proxy;
pub mod sampling;
pub mod signals;
pub mod telemetry;
pub mod up;
pub mod wire;

pub use decode::run_decode;
pub use host::{RESTARTS_ENV, restarts, role_secret, rss_bytes};
pub use prefill::run_prefill;
pub use proxy::run_proxy;
pub use signals::{install_signal_handlers, request_shutdown, shutting_down, signals};
pub use telemetry::{Telemetry, init_telemetry, profiler};
pub use up::{run_demo, run_up};
