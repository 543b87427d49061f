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
//! Every role refuses to start without the cluster secret ([`crate::auth`];
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

pub mod cli;
pub mod decode;
pub mod openai;
pub mod prefill;
pub mod prom;
pub mod proxy;
pub mod sampling;
pub mod soak;
pub mod up;
pub mod wire;

pub use cli::RoleCommand;
pub use decode::run_decode;
pub use prefill::run_prefill;
pub use proxy::run_proxy;
pub use soak::{SoakOptions, bench_soak};
pub use up::{bench_serve, run_demo, run_up};

use crate::auth::ClusterSecret;
use handoff_components::Topology;
use handoff_components::config::TransportKind;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// Stop signals (SIGINT, SIGTERM) received: the first asks for a stop (the proxy
/// and `up` drain first), a second for an immediate one.
static SIGNALS: AtomicU32 = AtomicU32::new(0);

extern "C" fn on_signal(_: libc::c_int) {
    SIGNALS.fetch_add(1, Ordering::SeqCst);
}

/// Installs SIGINT/SIGTERM handlers that ask the role to stop (so it drops its
/// transport and removes its shared-memory files).
pub fn install_signal_handlers() {
    // SAFETY: the handler only adds to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
}

/// Whether a stop was asked for.
pub fn shutting_down() -> bool {
    SIGNALS.load(Ordering::SeqCst) > 0
}

/// Stop signals received so far.
pub fn signals() -> u32 {
    SIGNALS.load(Ordering::SeqCst)
}

/// Asks the role (this process) to stop.
pub fn request_shutdown() {
    let _ = SIGNALS.compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst);
}

/// Seconds as a duration, bounded so that a huge configured timeout stays valid.
pub(crate) fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.clamp(0.001, 86_400.0))
}

/// This role's transport, and the memory its regions are registered in.
pub(crate) struct RoleTransport {
    pub transport: Arc<dyn crate::transport::Transport>,
    pub memory: crate::transport::MemoryKind,
}

/// Opens this role's transport: the roles are separate processes, so the
/// in-process `local` transport cannot connect them. The transport proves and
/// requires `secret` (the default [`ClusterSecret::process`] reads the same
/// variables, so it is passed for clarity, not for difference).
///
/// On `device = cuda` with `transport.kind = "shm"` the regions live in GPU
/// memory and the hand-off is CUDA IPC between the processes of the one GPU
/// ([`crate::transport::device`]); over tcp (hosts apart) they stay in host
/// memory and the compute uploads what it reads.
pub(crate) fn open_transport(topo: &Topology, secret: &ClusterSecret) -> anyhow::Result<RoleTransport> {
    use crate::transport::MemoryKind;
    use handoff_components::config::DeviceKind;
    let kind = topo.config.transport.kind;
    if kind == TransportKind::Local {
        anyhow::bail!(
            "transport.kind = \"local\" moves bytes within one process; the prefill and decode roles are separate processes: use \"shm\" (one host) or \"tcp\""
        );
    }
    if kind == TransportKind::Shm {
        crate::transport::shm::sweep_stale(&crate::transport::shm::default_dir());
    }
    let dev = topo.config.device;
    if dev.kind == DeviceKind::Cuda && kind == TransportKind::Shm {
        let mem = handoff_kernels::cuda_device_memory(dev.ordinal as usize).map_err(|e| anyhow::anyhow!("device cuda:{}: {e}", dev.ordinal))?;
        let t = crate::transport::device::DeviceTransport::new(mem, dev.ordinal, crate::transport::shm::default_dir(), secret.clone())?;
        tracing::info!(device = %t.device(), "regions in device memory; hand-offs through CUDA IPC");
        return Ok(RoleTransport { transport: Arc::new(t), memory: MemoryKind::Device { ordinal: dev.ordinal } });
    }
    if dev.kind != DeviceKind::Cpu {
        tracing::info!(transport = kind.name(), "regions in host memory: this transport moves host memory");
    }
    Ok(RoleTransport { transport: crate::transport::open_with(kind, None, secret.clone())?, memory: MemoryKind::Host })
}

/// Removes this process's shared-memory files (`handoff-{pid}-*`, the shm
/// transport's naming): a role stops with threads that may still hold its
/// transport, so it cleans up by name rather than by drop.
pub(crate) fn remove_own_shm_files(topo: &Topology) {
    if topo.config.transport.kind != TransportKind::Shm {
        return;
    }
    let prefix = format!("handoff-{}-", std::process::id());
    let dir = crate::transport::shm::default_dir();
    let Ok(entries) = std::fs::read_dir(&dir) else { return };
    for e in entries.flatten() {
        if e.file_name().to_str().is_some_and(|n| n.starts_with(&prefix)) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Sleeps up to `d`, waking early when a stop was asked for.
pub(crate) fn sleep_unless_stopping(d: Duration) {
    let until = std::time::Instant::now() + d;
    while !shutting_down() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20).min(d));
    }
}

/// Resident memory of this process in bytes (Linux `/proc/self/statm`; 0 elsewhere).
pub fn rss_bytes() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/statm") else { return 0 };
    let pages: u64 = s.split_whitespace().nth(1).and_then(|x| x.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * page.max(0) as u64
}

/// A compute that sleeps before each prefill (the test hook of [`prefill::DELAY_ENV`]).
pub(crate) struct Delayed {
    pub inner: Box<dyn handoff_systems::dispatch::Compute>,
    pub delay: Duration,
}

impl handoff_systems::dispatch::Compute for Delayed {
    fn prefill(
        &mut self,
        job: handoff_systems::dispatch::PrefillJob<'_>,
    ) -> Result<handoff_systems::dispatch::PrefillOutput, handoff_systems::dispatch::ComputeError> {
        std::thread::sleep(self.delay);
        self.inner.prefill(job)
    }
    fn decode(&mut self, batch: &[handoff_systems::dispatch::DecodeItem<'_>]) -> Result<Vec<u8>, handoff_systems::dispatch::ComputeError> {
        self.inner.decode(batch)
    }
}

/// The compute threads of one role process, and the pool the engine thread runs in.
///
/// The engine thread runs inside the pool, so a kernel's parallel loop runs on the
/// calling thread when it is small instead of waking a pool thread and sleeping on
/// a latch; and the processes of one host share its cores instead of each
/// spawning one thread per core. `serve.threads` sets the count; by default the
/// host's cores are shared among the role processes (PP stages and decode), at
/// least one each.
pub(crate) fn compute_pool(topo: &Topology) -> anyhow::Result<rayon::ThreadPool> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let roles = topo.prefill().pp as usize + 1;
    let n = topo.config.serve.threads.map_or((cores / roles).max(1), |t| t as usize);
    Ok(rayon::ThreadPoolBuilder::new().num_threads(n).thread_name(|i| format!("compute-{i}")).build()?)
}

/// Registers with the proxy's control listener (best effort: the proxy may not be
/// up yet), proving the cluster secret.
pub(crate) fn heartbeat(proxy: &str, reg: &wire::Register, secret: &ClusterSecret) {
    let Ok(body) = serde_json::to_string(reg) else { return };
    let auth = wire::register_auth(secret, wire::unix_ms(), body.as_bytes());
    match wire::http_with(proxy, "POST", "/internal/register", Some(&body), &[(wire::REGISTER_AUTH_HEADER, &auth)], Duration::from_secs(2)) {
        Ok(r) if r.status == 401 => tracing::warn!(proxy, body = %r.body, "the proxy refused this role's registration"),
        Ok(_) => {}
        Err(e) => tracing::debug!(proxy, error = %e, "register with the proxy"),
    }
}

/// What a role process refused for want of the cluster secret: its control
/// listener's connections, and what its transport counts.
pub(crate) struct Refused {
    pub control: std::sync::atomic::AtomicU64,
    pub transport: Arc<dyn crate::transport::Transport>,
}

impl Refused {
    pub fn new(transport: &Arc<dyn crate::transport::Transport>) -> Arc<Refused> {
        Arc::new(Refused { control: Default::default(), transport: Arc::clone(transport) })
    }

    fn by_listener(&self) -> std::collections::BTreeMap<String, u64> {
        let mut m = std::collections::BTreeMap::new();
        m.insert("control".to_string(), self.control.load(Ordering::Relaxed));
        m.insert(self.transport.name().to_string(), self.transport.unauthenticated());
        m
    }

    /// Counts and logs one refused control connection.
    pub fn control_refused(&self, role: &str, peer: &str, why: &str) {
        self.control.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(role, peer, why, "refused an unauthenticated control connection");
    }
}

/// Registers with the proxy every 300 ms, with the engine's latest counts, this
/// process's resident memory and its refusals, until a stop is asked for.
pub(crate) fn heartbeat_until_stopped(
    proxy: &str,
    role: &str,
    stage: Option<u32>,
    addr: std::net::SocketAddr,
    counts: &std::sync::Mutex<crate::engine::Counts>,
    refused: &Refused,
    secret: &ClusterSecret,
) {
    while !shutting_down() {
        let reg = wire::Register {
            role: role.into(),
            stage,
            addr,
            pid: std::process::id(),
            counts: lock(counts).clone(),
            rss_bytes: rss_bytes(),
            restarts: restarts(),
            timings: prom::system_timings(profiler()),
            unauthenticated: refused.by_listener(),
        };
        heartbeat(proxy, &reg, secret);
        sleep_unless_stopping(Duration::from_millis(300));
    }
}

/// The cluster secret a role process must have (see [`crate::auth`]): refuses to
/// start without one, naming the variables.
pub fn role_secret() -> anyhow::Result<ClusterSecret> {
    ClusterSecret::from_env().map_err(|e| anyhow::anyhow!("{e}"))
}

/// How many times `up` restarted this role process (`HANDOFF_RESTARTS`; 0 by hand).
pub fn restarts() -> u32 {
    std::env::var(RESTARTS_ENV).ok().and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// The variable through which `up` tells a restarted role how many times it was
/// restarted (the role reports it in its heartbeat, so the count survives a
/// restart of the proxy).
pub const RESTARTS_ENV: &str = "HANDOFF_RESTARTS";

/// The engine timings of this role process: every bevy `system` span, timed into
/// one histogram per system, which the heartbeat carries to the proxy's `/metrics`.
pub fn profiler() -> &'static crate::profile::Profiler {
    static PROFILER: std::sync::OnceLock<crate::profile::Profiler> = std::sync::OnceLock::new();
    PROFILER.get_or_init(Default::default)
}

/// What a role process keeps alive while it runs: the Perfetto trace's writer,
/// which finishes the file when dropped.
pub struct Telemetry {
    _trace: Option<tracing_chrome::FlushGuard>,
}

/// Sets up a role process's `tracing`, once: log lines on stderr (`HANDOFF_LOG`,
/// default `warn`), the engine's system timings ([`profiler`]), and with
/// `--trace FILE` a Chrome/Perfetto trace of every span at info level and above
/// (each system of each tick, on its thread), to open in ui.perfetto.dev.
///
/// Each output has its own filter: the log level does not turn the timings off.
pub fn init_telemetry(trace: Option<&std::path::Path>) -> anyhow::Result<Telemetry> {
    use tracing_subscriber::filter::{EnvFilter, LevelFilter, filter_fn};
    use tracing_subscriber::prelude::*;
    let log = EnvFilter::try_from_env("HANDOFF_LOG").unwrap_or_else(|_| EnvFilter::new("warn"));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_filter(log);
    let timings = profiler().clone().with_filter(filter_fn(|m| m.is_span() && m.name() == "system"));
    let (chrome, guard) = match trace {
        Some(path) => {
            // Fail at start-up, naming the file, rather than in the writer thread.
            std::fs::File::create(path).map_err(|e| anyhow::anyhow!("--trace {}: {e}", path.display()))?;
            let (layer, guard) = tracing_chrome::ChromeLayerBuilder::new().file(path).include_args(true).build();
            (Some(layer.with_filter(LevelFilter::INFO)), Some(guard))
        }
        None => (None, None),
    };
    let _ = tracing_subscriber::registry().with(fmt).with(timings).with(chrome).try_init();
    Ok(Telemetry { _trace: guard })
}
