//! What every role process (prefill stage, decode) does around its engine: open
//! its transport, size its compute pool, prove the cluster secret, register and
//! heartbeat with the proxy, and clean up its shared memory when it stops.

use super::prom;
use super::signals::{shutting_down, sleep_unless_stopping};
use super::telemetry::profiler;
use super::wire;
use crate::base::lock;
use crate::transport::auth::ClusterSecret;
use handoff_components::Topology;
use handoff_components::config::TransportKind;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

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
/// On `device = cuda` or `hip` with `transport.kind = "shm"` the regions live
/// in GPU memory and the hand-off is CUDA or HIP IPC between the processes of
/// the one GPU ([`crate::transport::device`]; HIP's has never run on AMD
/// hardware); over tcp (hosts apart) they stay in host memory and the compute
/// uploads what it reads.
///
/// `tcp` is the transport's listener ([`super::addr`]): where a tcp transport
/// binds and what its handles advertise.
pub(crate) fn open_transport(topo: &Topology, secret: &ClusterSecret, tcp: Option<&super::addr::ListenAddr>) -> anyhow::Result<RoleTransport> {
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
    // The same device memory on both GPU platforms (handoff-kernels'
    // DeviceMem over cudarc or hip-sys); HIP's has never run on AMD hardware.
    let device_memory = match dev.kind {
        DeviceKind::Cuda => Some(handoff_kernels::cuda_device_memory as fn(usize) -> handoff_kernels::Result<Arc<dyn handoff_kernels::DeviceMemory>>),
        DeviceKind::Hip => Some(handoff_kernels::hip_device_memory as fn(usize) -> handoff_kernels::Result<Arc<dyn handoff_kernels::DeviceMemory>>),
        DeviceKind::Cpu => None,
    };
    if let Some(open) = device_memory
        && kind == TransportKind::Shm
    {
        let mem = open(dev.ordinal as usize).map_err(|e| anyhow::anyhow!("device {dev}: {e}"))?;
        let t = crate::transport::device::DeviceTransport::new(mem, dev.ordinal, crate::transport::shm::default_dir(), secret.clone())?;
        tracing::info!(device = %t.device(), transport = crate::transport::Transport::name(&t), "regions in device memory; hand-offs through device IPC");
        return Ok(RoleTransport { transport: Arc::new(t), memory: MemoryKind::Device { ordinal: dev.ordinal } });
    }
    if dev.kind != DeviceKind::Cpu {
        tracing::info!(transport = kind.name(), "regions in host memory: this transport moves host memory");
    }
    let transport = crate::transport::open_config(&topo.config.transport, tcp.map(|l| l.bind), tcp.and_then(|l| l.advertise), secret.clone())?;
    if let Some(l) = tcp {
        tracing::info!(bind = %l.bind, endpoint = %transport.endpoint(), transport = kind.name(), "transport listening");
    }
    Ok(RoleTransport { transport, memory: MemoryKind::Host })
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

/// Resident memory of this process in bytes (Linux `/proc/self/statm`; 0 elsewhere).
pub fn rss_bytes() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/statm") else { return 0 };
    let pages: u64 = s.split_whitespace().nth(1).and_then(|x| x.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * page.max(0) as u64
}

/// A compute that sleeps before each prefill (the test hook of [`super::prefill::DELAY_ENV`]).
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
    fn decode(
        &mut self,
        batch: &[handoff_systems::dispatch::DecodeItem<'_>],
    ) -> Result<handoff_systems::dispatch::DecodeOutput, handoff_systems::dispatch::ComputeError> {
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
/// listener's connections and messages, and what its transport counts.
pub(crate) struct Refused {
    pub control: std::sync::atomic::AtomicU64,
    /// Control lines refused after a handshake ([`wire::RecvError::Refused`]).
    pub control_messages: std::sync::atomic::AtomicU64,
    pub transport: Arc<dyn crate::transport::Transport>,
}

impl Refused {
    pub fn new(transport: &Arc<dyn crate::transport::Transport>) -> Arc<Refused> {
        Arc::new(Refused { control: Default::default(), control_messages: Default::default(), transport: Arc::clone(transport) })
    }

    fn frames_by_kind(&self) -> std::collections::BTreeMap<String, u64> {
        let mut m = std::collections::BTreeMap::new();
        m.insert("control".to_string(), self.control_messages.load(Ordering::Relaxed));
        m.insert(self.transport.name().to_string(), self.transport.refused_frames());
        m
    }

    /// Counts and logs one control line refused after the handshake (the
    /// caller closes its connection).
    pub fn message_refused(&self, role: &str, peer: &str, why: &crate::transport::auth::MessageRefused) {
        self.control_messages.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(role, peer, %why, "refused a control message; connection closed");
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
            refused_frames: refused.frames_by_kind(),
        };
        heartbeat(proxy, &reg, secret);
        sleep_unless_stopping(Duration::from_millis(300));
    }
}

/// The cluster secret a role process must have (see [`crate::transport::auth`]): refuses to
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
