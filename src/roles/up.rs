//! `handoff up` and the demo (`cargo run --release`): a whole deployment as child
//! processes of this one (the benches in [`crate::bench`] start theirs here too).
//!
//! A [`Deployment`] gives its roles one cluster secret ([`crate::transport::auth`]): the one
//! this process was given (`HANDOFF_CLUSTER_SECRET_FILE` or
//! `HANDOFF_CLUSTER_SECRET`), else 32 fresh random bytes. It hands the secret to
//! each child in that child's own environment (`HANDOFF_CLUSTER_SECRET`, which
//! only the user's processes can read, in `/proc/PID/environ`): no file holds
//! it, so nothing of it stays on disk when `up` is killed, however it is killed,
//! and the secret never appears in an argument. The built-in default's topology
//! and weights go to a private directory, `{tmp}/handoff-up-{pid}-{port}/`
//! (mode 0700), removed at shutdown; a SIGKILLed `up` leaves that directory (no
//! secret in it), and the next `up` removes it. The proxy's control listener
//! gets `--control-port` (else the topology's `[cluster.proxy]` port, else a
//! free port) on loopback (or the `[cluster.proxy]` bind's host), and every other
//! role receives its address as `--proxy`; each role reads its own listeners from
//! the topology's `[cluster]` table ([`super::addr`]). A secret drawn here is
//! known to no other host, so `up` refuses a topology that would listen beyond
//! loopback unless it was given one.

use super::client::{complete, percentile};
use super::wire::{self, HttpResponse};
use anyhow::Context;
use handoff_components::Topology;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

/// The built-in default topology (config/trained.toml): the trained byte-level
/// checkpoint, PP2 x TP1 -> TP2 x DCP2 over shm.
pub const DEFAULT_CONFIG: &str = include_str!("../../config/trained.toml");
/// The checkpoint it names, built into the binary so that `handoff up` works
/// from any directory (written beside the temporary topology file).
pub const DEFAULT_WEIGHTS: &[u8] = include_bytes!("../../config/trained/byte-kkkm.safetensors");
/// The weights line of [`DEFAULT_CONFIG`], replaced by the written file's path.
const DEFAULT_WEIGHTS_LINE: &str = "weights = \"trained/byte-kkkm.safetensors\"";

struct SupervisedRole {
    name: String,
    args: Vec<String>,
    child: Option<Child>,
    /// Times this role was restarted (handed to it as `HANDOFF_RESTARTS`).
    restarts: u32,
    /// When it died recently (the restart window).
    deaths: std::collections::VecDeque<Instant>,
    /// When it is due to start again, after a death.
    restart_at: Option<Instant>,
}

impl SupervisedRole {
    fn new(name: String, args: Vec<String>) -> SupervisedRole {
        SupervisedRole { name, args, child: None, restarts: 0, deaths: Default::default(), restart_at: None }
    }
}

/// When `up` restarts a role that died, and when it gives up.
#[derive(Debug, Clone, Copy)]
pub struct RestartPolicy {
    /// Most restarts of one role within `window`; one more death and `up` stops
    /// every role and exits. 0: never restart (the first death stops the cluster).
    pub max_restarts: u32,
    pub window: Duration,
    /// The wait before the first restart; it doubles with each death in the
    /// window, up to `backoff_max`.
    pub backoff: Duration,
    pub backoff_max: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy { max_restarts: 5, window: Duration::from_secs(60), backoff: Duration::from_millis(250), backoff_max: Duration::from_secs(8) }
    }
}

/// What [`Deployment::supervise`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Supervision {
    /// A role died; it starts again after the backoff.
    Died {
        role: String,
        status: String,
        restart_in: Duration,
        restarts: u32,
    },
    Restarted {
        role: String,
        pid: u32,
        restarts: u32,
    },
    /// A role died more often than the policy allows: nothing was restarted.
    GaveUp {
        role: String,
        status: String,
        deaths: usize,
        window: Duration,
    },
}

/// A running deployment: proxy, decode and one process per prefill stage.
/// Dropping it stops every process.
pub struct Deployment {
    roles: Vec<SupervisedRole>,
    /// `host:port` of the proxy.
    pub addr: String,
    /// `host:port` of the proxy's control listener (where the roles register).
    pub control_addr: String,
    secret: crate::transport::auth::ClusterSecret,
    /// Whether the secret was drawn here (no role outside this deployment knows it).
    secret_drawn: bool,
    pub topo: Topology,
    program: Option<PathBuf>,
    envs: Vec<(String, String)>,
    /// The private directory of the built-in default's files (mode 0700).
    tmp_dir: Option<PathBuf>,
    /// The cluster's MPS server (`[device] mps = true` on CUDA); dropped after
    /// the roles have stopped.
    mps: Option<super::mps::MpsServer>,
}

/// Where `up`'s proxy listens: the public API (`--host`, `--port`) and the
/// roles' control listener (`--control-port`; `None`: the topology's, else a free port).
#[derive(Debug, Clone)]
pub struct UpListen {
    pub host: String,
    pub port: u16,
    pub control_port: Option<u16>,
}

/// A port that was free a moment ago on 127.0.0.1, for a role to bind later.
///
/// Picked at random below the kernel's ephemeral range (Linux's
/// `ip_local_port_range`, 32768 and up by default), not by binding port 0:
/// an ephemeral port can be handed to any other socket between this pick and
/// the role's bind (another listener on port 0, or the local end of an
/// outgoing connection, which every HTTP client in a test makes), and that
/// race was the flake of the cluster tests. A port below the range goes only
/// to a caller that names it. Port 0's pick where 64 random tries find none.
pub fn free_port() -> std::io::Result<u16> {
    let low = ephemeral_low();
    // The window under the range: [low / 2, low), at least 1024 ports, never privileged.
    let (from, to) = (u32::from(low / 2).max(1024), u32::from(low));
    if to > from + 1024 {
        for _ in 0..64 {
            let port = (from + u32::from_le_bytes(crate::transport::auth::random_bytes()?) % (to - from)) as u16;
            if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
                return Ok(l.local_addr()?.port());
            }
        }
    }
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The first port of the kernel's ephemeral range (32768 where it cannot be read).
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok().and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok()).unwrap_or(32768)
}

impl Deployment {
    /// Starts every role of the topology in `config` (None: the built-in default).
    /// `program`: the `handoff` binary the roles run; None starts this executable.
    pub fn start(config: Option<&Path>, host: &str, port: u16, program: Option<PathBuf>) -> anyhow::Result<Deployment> {
        Self::start_with(config, host, port, program, Vec::new())
    }

    /// [`Deployment::start`] with extra environment variables for every role.
    pub fn start_with(config: Option<&Path>, host: &str, port: u16, program: Option<PathBuf>, envs: Vec<(String, String)>) -> anyhow::Result<Deployment> {
        Self::start_on(config, &UpListen { host: host.to_string(), port, control_port: None }, program, envs)
    }

    /// [`Deployment::start_with`] with the proxy's control port chosen (`listen.control_port`).
    pub fn start_on(config: Option<&Path>, listen: &UpListen, program: Option<PathBuf>, envs: Vec<(String, String)>) -> anyhow::Result<Deployment> {
        let (host, port) = (listen.host.as_str(), listen.port);
        sweep_stale_configs();
        let (path, tmp) = match config {
            Some(p) => (p.to_path_buf(), None),
            None => {
                let dir = std::env::temp_dir().join(format!("handoff-up-{}-{port}", std::process::id()));
                make_private_dir(&dir)?;
                let p = dir.join("config.toml");
                let w = dir.join("weights.safetensors");
                std::fs::write(&w, DEFAULT_WEIGHTS).with_context(|| format!("write {}", w.display()))?;
                anyhow::ensure!(DEFAULT_CONFIG.contains(DEFAULT_WEIGHTS_LINE), "the built-in topology names no weights file");
                let text = DEFAULT_CONFIG.replace(DEFAULT_WEIGHTS_LINE, &format!("weights = {:?}", w.to_string_lossy()));
                std::fs::write(&p, text).with_context(|| format!("write {}", p.display()))?;
                (p, Some(dir))
            }
        };
        let path_s = path.to_string_lossy().to_string();
        let topo = Topology::load(&path_s).map_err(|e| anyhow::anyhow!("{e}"))?;
        let addr = format!("{host}:{port}");
        let (secret, secret_drawn) = match crate::transport::auth::ClusterSecret::from_env() {
            Ok(s) => (s, false),
            Err(crate::transport::auth::SecretError::Missing) => {
                (crate::transport::auth::ClusterSecret::generate().context("draw 32 random bytes for the cluster secret")?, true)
            }
            Err(e) => anyhow::bail!("{e}"),
        };
        let (control_bind, control_addr) = control_listener(&topo, listen)?;
        if secret_drawn {
            // A secret drawn here is known to no other host: nothing may listen
            // beyond loopback on it.
            let mut roles = super::addr::every_role(&topo)?;
            roles[0].control.bind = control_bind;
            for r in &roles {
                super::addr::require_secret(r, false)?;
            }
        }
        let mut roles = vec![SupervisedRole::new(
            "proxy".into(),
            vec![
                "proxy".into(),
                "--config".into(),
                path_s.clone(),
                "--host".into(),
                host.into(),
                "--port".into(),
                port.to_string(),
                "--bind".into(),
                control_bind.to_string(),
            ],
        )];
        roles.push(SupervisedRole::new("decode".into(), vec!["decode".into(), "--config".into(), path_s.clone(), "--proxy".into(), control_addr.clone()]));
        for s in 0..topo.prefill().pp {
            roles.push(SupervisedRole::new(
                format!("prefill stage {s}"),
                vec!["prefill".into(), "--config".into(), path_s.clone(), "--stage".into(), s.to_string(), "--proxy".into(), control_addr.clone()],
            ));
        }
        let mut envs = envs;
        envs.push((crate::transport::auth::SECRET_ENV.to_string(), secret.to_hex()));
        // The device the roles will open: HANDOFF_DEVICE (given to them, or in
        // this environment) names it over the topology's table.
        let device = envs.iter().find(|(k, _)| k == "HANDOFF_DEVICE").map(|(_, v)| v.clone()).or_else(|| std::env::var("HANDOFF_DEVICE").ok());
        let device = crate::engine::device::resolve(&topo, device.as_deref())?;
        let mps = if device.mps && device.kind == handoff_components::config::DeviceKind::Cuda {
            let m = super::mps::MpsServer::start(&format!("{}-{port}", std::process::id()))?;
            envs.extend(m.envs());
            Some(m)
        } else {
            None
        };
        let mut c = Deployment { roles, addr, control_addr, secret, secret_drawn, topo, program, envs, tmp_dir: tmp, mps };
        for i in 0..c.roles.len() {
            c.spawn(i)?;
        }
        Ok(c)
    }

    fn spawn(&mut self, i: usize) -> anyhow::Result<()> {
        let role = &mut self.roles[i];
        let mut cmd = role_command(self.program.as_deref(), &role.args)?;
        // The child's environment is the one source (`envs` holds the secret): a
        // file named in this process's environment must not reach it.
        cmd.env_remove(crate::transport::auth::SECRET_FILE_ENV);
        cmd.envs(self.envs.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        cmd.env(super::host::RESTARTS_ENV, role.restarts.to_string());
        // SAFETY: prctl and setpgid are async-signal-safe. A role dies with its
        // parent, so a killed `up` leaves nothing running; and it has its own
        // process group, so a terminal's Ctrl-C reaches `up` alone, which drains
        // the proxy before it stops the other roles.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                libc::setpgid(0, 0);
                Ok(())
            });
        }
        let child = cmd.spawn().with_context(|| format!("start {}", role.name))?;
        role.child = Some(child);
        Ok(())
    }

    /// The cluster secret its roles share (tests play a role with it).
    pub fn secret(&self) -> &crate::transport::auth::ClusterSecret {
        &self.secret
    }

    /// Whether the secret was drawn by this deployment (rather than given to
    /// it): then no process outside it can join.
    pub fn secret_drawn(&self) -> bool {
        self.secret_drawn
    }

    /// The private directory of the built-in default's files, while it exists.
    pub fn private_dir(&self) -> Option<&Path> {
        self.tmp_dir.as_deref()
    }

    fn remove_files(&mut self) {
        if let Some(d) = self.tmp_dir.take() {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    /// CPU time (user + system, clock ticks) summed over every role process.
    pub fn cpu_ticks(&self) -> u64 {
        self.roles.iter().filter_map(|r| r.child.as_ref()).filter_map(|c| proc_usage(c.id())).map(|(t, _)| t).sum()
    }

    /// Process id of a role (`"proxy"`, `"decode"`, `"prefill stage 1"`).
    pub fn pid(&self, name: &str) -> Option<u32> {
        self.roles.iter().find(|r| r.name == name)?.child.as_ref().map(Child::id)
    }

    /// SIGKILLs a role and reaps it.
    pub fn kill(&mut self, name: &str) -> anyhow::Result<()> {
        let r = self.roles.iter_mut().find(|r| r.name == name).context("no such role")?;
        if let Some(mut c) = r.child.take() {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }

    /// Starts a role again (after [`Deployment::kill`] or its death).
    pub fn restart(&mut self, name: &str) -> anyhow::Result<()> {
        let i = self.roles.iter().position(|r| r.name == name).context("no such role")?;
        if let Some(mut c) = self.roles[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.spawn(i)
    }

    /// Restarts of a role so far.
    pub fn restarts(&self, name: &str) -> u32 {
        self.roles.iter().find(|r| r.name == name).map_or(0, |r| r.restarts)
    }

    /// Reaps roles that died and starts them again once their backoff passed
    /// (see [`RestartPolicy`]); what happened, in order.
    pub fn supervise(&mut self, policy: &RestartPolicy) -> Vec<Supervision> {
        let mut out = Vec::new();
        let now = Instant::now();
        for i in 0..self.roles.len() {
            let r = &mut self.roles[i];
            if let Some(c) = r.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                r.child = None;
                while r.deaths.front().is_some_and(|t| now.duration_since(*t) > policy.window) {
                    r.deaths.pop_front();
                }
                r.deaths.push_back(now);
                if r.deaths.len() as u32 > policy.max_restarts {
                    out.push(Supervision::GaveUp { role: r.name.clone(), status: status.to_string(), deaths: r.deaths.len(), window: policy.window });
                    continue;
                }
                let doublings = (r.deaths.len() as u32 - 1).min(16);
                let wait = policy.backoff.saturating_mul(1 << doublings).min(policy.backoff_max);
                r.restart_at = Some(now + wait);
                out.push(Supervision::Died { role: r.name.clone(), status: status.to_string(), restart_in: wait, restarts: r.restarts + 1 });
            }
            let r = &mut self.roles[i];
            if r.child.is_none() && r.restart_at.is_some_and(|t| now >= t) {
                r.restart_at = None;
                r.restarts += 1;
                let (name, restarts) = (r.name.clone(), r.restarts);
                match self.spawn(i) {
                    Ok(()) => out.push(Supervision::Restarted { role: name, pid: self.pid_of(i), restarts }),
                    Err(e) => {
                        // Starting failed (no process at all): try again after the backoff.
                        tracing::warn!(role = %name, error = %e, "restart failed");
                        self.roles[i].restart_at = Some(now + policy.backoff_max);
                    }
                }
            }
        }
        out
    }

    fn pid_of(&self, i: usize) -> u32 {
        self.roles[i].child.as_ref().map_or(0, Child::id)
    }

    /// Sends `signal` to a role's process (a test stops and continues roles).
    pub fn signal(&self, name: &str, signal: libc::c_int) -> anyhow::Result<()> {
        let pid = self.pid(name).context("no such running role")?;
        // SAFETY: kill(2) on our own child's pid.
        if unsafe { libc::kill(pid as libc::pid_t, signal) } != 0 {
            anyhow::bail!("kill {pid}: {}", std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Waits up to `timeout` for the proxy to exit (it drains first); true if it did.
    fn wait_proxy_exit(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let Some(c) = self.roles[0].child.as_mut() else { return true };
            if let Ok(Some(_)) = c.try_wait() {
                self.roles[0].child = None;
                return true;
            }
            if Instant::now() >= deadline || super::signals::signals() >= 2 {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILLs every role at once (a second stop signal).
    pub fn kill_all(&mut self) {
        for r in &mut self.roles {
            if let Some(mut c) = r.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        self.remove_files();
    }

    /// A role that exited, with its status.
    pub fn dead_role(&mut self) -> Option<String> {
        for r in &mut self.roles {
            if let Some(c) = r.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                r.child = None;
                return Some(format!("{} exited ({status})", r.name));
            }
        }
        None
    }

    /// Waits until the proxy reports every role healthy. `progress` prints what it
    /// is waiting for on stderr.
    pub fn wait_healthy(&mut self, timeout: Duration, progress: bool) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let mut last = String::new();
        loop {
            if let Some(dead) = self.dead_role() {
                anyhow::bail!("{dead} while starting");
            }
            let msg = match wire::http(&self.addr, "GET", "/health", None, Duration::from_secs(2)) {
                Ok(r) if r.status == 200 => return Ok(()),
                Ok(r) => r.json().and_then(|v| v["message"].as_str().map(str::to_string)).unwrap_or(r.body),
                Err(_) => "waiting for the proxy".into(),
            };
            if progress && msg != last {
                eprintln!("  {msg}");
                last = msg;
            }
            if Instant::now() >= deadline {
                anyhow::bail!("not healthy after {timeout:?}: {last}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// One HTTP request to the proxy.
    pub fn http(&self, method: &str, path: &str, body: Option<&str>) -> std::io::Result<HttpResponse> {
        wire::http(&self.addr, method, path, body, Duration::from_secs(120))
    }

    /// Stops every role: SIGTERM, then SIGKILL after 3 s.
    pub fn shutdown(&mut self) {
        for r in &mut self.roles {
            if let Some(c) = r.child.as_ref() {
                // SAFETY: plain kill(2) on our own child's pid.
                unsafe {
                    libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
                }
            }
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        for r in &mut self.roles {
            if let Some(mut c) = r.child.take() {
                loop {
                    match c.try_wait() {
                        Ok(Some(_)) => break,
                        Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                        _ => {
                            let _ = c.kill();
                            let _ = c.wait();
                            break;
                        }
                    }
                }
            }
        }
        self.remove_files();
        self.mps = None;
    }
}

/// The proxy's control listener under `up` (its bind) and the address the
/// roles register at: port `--control-port`, else the topology's
/// `[cluster.proxy]` bind port, else one free now (not the public port); host
/// the `[cluster.proxy]` bind's, else loopback.
fn control_listener(topo: &Topology, listen: &UpListen) -> anyhow::Result<(std::net::SocketAddr, String)> {
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};
    let proxy = super::addr::resolve(topo, handoff_components::failure::ProcessRole::Proxy, &super::addr::AddrFlags::default())?;
    let named = topo.config.cluster.proxy.bind.is_some() && proxy.control.bind.port() != 0;
    let control_port = match listen.control_port {
        Some(0) => anyhow::bail!("--control-port 0: the roles must be told the proxy's control port before it listens; pick a free port"),
        Some(p) if p == listen.port => anyhow::bail!("--control-port {p} is the public --port too: the roles' control listener needs a port of its own"),
        Some(p) => p,
        None if named => proxy.control.bind.port(),
        None => {
            // A port free now and not the public one (which the caller may have
            // picked the same way and released).
            let mut p = free_port().context("pick a port for the proxy's control listener")?;
            for _ in 0..8 {
                if p != listen.port {
                    break;
                }
                p = free_port().context("pick a port for the proxy's control listener")?;
            }
            p
        }
    };
    let bind = SocketAddr::new(proxy.control.bind.ip(), control_port);
    // The roles of one `up` share its host: an every-interface bind is reached on loopback.
    let reach = if bind.ip().is_unspecified() { SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), control_port) } else { bind };
    Ok((bind, proxy.control.advertised(reach).to_string()))
}

/// Creates `dir` with mode 0700 (replacing a stale one of the same name: the
/// name holds this process's pid).
fn make_private_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::DirBuilder::new().mode(0o700).create(dir).with_context(|| format!("create the private directory {}", dir.display()))
}

impl Drop for Deployment {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// `handoff up`: starts proxy, decode and every prefill stage, waits for health,
/// prints the URL, and supervises them: a role that dies is restarted after a
/// backoff (see [`RestartPolicy`]), and `up` gives up, stopping every role, only
/// when one dies more often than the policy allows. The first SIGINT/SIGTERM
/// drains: the proxy refuses new requests and finishes those in flight (up to
/// `serve.drain_s`), then every role stops; a second signal stops them at once.
/// `config` None: the built-in default (config/trained.toml).
pub fn run_up(
    config: Option<&Path>,
    listen: &UpListen,
    device: Option<&str>,
    policy: RestartPolicy,
    api_key: Option<&str>,
    trace_dir: Option<&Path>,
) -> anyhow::Result<()> {
    super::signals::install_signal_handlers();
    let (host, port) = (listen.host.as_str(), listen.port);
    if port == 0 {
        anyhow::bail!("--port 0: the roles must be told the proxy's port before it listens; pick a free port");
    }
    // The port must be free before any role starts: a proxy that cannot listen
    // would only be restarted until `up` gives up.
    std::net::TcpListener::bind((host, port)).map_err(|e| anyhow::anyhow!("cannot listen on {host}:{port}: {e}"))?;
    let mut envs = device.map(|d| vec![("HANDOFF_DEVICE".to_string(), d.to_string())]).unwrap_or_default();
    if let Some(k) = api_key {
        // Through the environment, not argv: `ps` shows every process's arguments.
        envs.push(("HANDOFF_API_KEY".to_string(), k.to_string()));
    }
    if let Some(dir) = trace_dir {
        // Absolute: each role opens its file wherever it runs.
        let abs = std::fs::canonicalize(dir).map_err(|e| anyhow::anyhow!("--trace-dir {}: {e}", dir.display()))?;
        envs.push((TRACE_DIR_ENV.to_string(), abs.to_string_lossy().into_owned()));
    }
    let mut c = Deployment::start_on(config, listen, None, envs)?;
    let p = c.topo.prefill();
    let d = c.topo.decode();
    let on = match device {
        Some(d) => d.to_string(),
        None => c.topo.config.device.to_string(),
    };
    eprintln!(
        "handoff up: {} — prefill PP{} x TP{} -> decode TP{} x DCP{} over {}, compute on {on}; starting {} processes",
        c.topo.model().name,
        p.pp,
        p.tp,
        d.tp,
        d.dcp,
        c.topo.config.transport.kind.name(),
        p.pp + 2
    );
    c.wait_healthy(Duration::from_secs(60), true)?;
    // What a role started by hand needs to join this cluster.
    if c.secret_drawn() {
        eprintln!(
            "handoff up: roles register at {}; the cluster secret was drawn here and lives only in the roles' environments (to start roles by hand too, give up a secret in {})",
            c.control_addr,
            crate::transport::auth::SECRET_FILE_ENV
        );
    } else {
        eprintln!("handoff up: roles register at {} with the cluster secret up was given", c.control_addr);
    }
    println!("handoff serving at http://{}  (POST /v1/completions, /v1/chat/completions; GET /v1/models, /health, /metrics; Ctrl-C drains and stops)", c.addr);
    loop {
        if super::signals::signals() >= 2 {
            eprintln!("handoff up: second signal; stopping every role now");
            c.kill_all();
            return Ok(());
        }
        if super::signals::shutting_down() {
            let drain_s = c.topo.config.serve.drain_s;
            eprintln!("handoff up: draining (new requests get 503; those in flight have up to serve.drain_s = {drain_s} s); a second Ctrl-C stops at once");
            if let Err(e) = c.signal("proxy", libc::SIGTERM) {
                tracing::debug!(error = %e, "proxy already gone");
            }
            // The proxy exits once its requests finished or drain_s passed.
            let drained = c.wait_proxy_exit(Duration::from_secs_f64(drain_s.min(86_400.0)) + Duration::from_secs(5));
            if super::signals::signals() >= 2 {
                eprintln!("handoff up: second signal; stopping every role now");
                c.kill_all();
                return Ok(());
            }
            eprintln!("handoff up: {}; stopping every role", if drained { "drained" } else { "the proxy did not stop in time" });
            c.shutdown();
            return Ok(());
        }
        for ev in c.supervise(&policy) {
            match ev {
                Supervision::Died { role, status, restart_in, restarts } => {
                    eprintln!("handoff up: {role} exited ({status}); restart {restarts} in {:.2} s", restart_in.as_secs_f64());
                }
                Supervision::Restarted { role, pid, restarts } => eprintln!("handoff up: {role} restarted (pid {pid}, restart {restarts})"),
                Supervision::GaveUp { role, status, deaths, window } => {
                    let msg = format!(
                        "{role} exited ({status}): {deaths} deaths within {:.0} s is more than --max-restarts {}; giving up",
                        window.as_secs_f64(),
                        policy.max_restarts
                    );
                    eprintln!("handoff up: {msg}; stopping every role");
                    c.shutdown();
                    anyhow::bail!("{msg}");
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Removes what earlier `up` processes left behind when they were killed: the
/// private directories `handoff-up-{pid}-{port}/` (and the files of older
/// versions, `handoff-up-{pid}-{port}.toml`, `.safetensors` and `.secret`), for
/// a pid that is gone.
fn sweep_stale_configs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix("handoff-up-") else { continue };
        let rest = rest.strip_suffix(".toml").or_else(|| rest.strip_suffix(".safetensors")).or_else(|| rest.strip_suffix(".secret")).unwrap_or(rest);
        let mut parts = rest.split('-');
        let (Some(pid), Some(_port), None) = (parts.next().and_then(|p| p.parse::<i32>().ok()), parts.next().and_then(|p| p.parse::<u16>().ok()), parts.next())
        else {
            continue;
        };
        // SAFETY: kill with signal 0 only checks whether the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let p = e.path();
            let _ = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
        }
    }
}

fn start_default() -> anyhow::Result<Deployment> {
    let port = free_port()?;
    let mut c = Deployment::start(None, "127.0.0.1", port, None)?;
    eprintln!("starting the built-in default cluster (config/trained.toml, the trained checkpoint) at {}", c.addr);
    c.wait_healthy(Duration::from_secs(60), true)?;
    Ok(c)
}

/// `cargo run --release`: the default cluster, a short workload, each completion
/// (checked against the colocated single-rank reference) and a summary table.
pub fn run_demo() -> anyhow::Result<()> {
    let mut c = start_default()?;
    let model = crate::model::Model::new(&c.topo)?;
    // The checkpoint learned English from Debian's fortunes: prompts in that style.
    let prompts = ["The best way to predict the future is", "A friend in need is", "Never put off until tomorrow what", "Computers are"];
    let max_tokens = 40;
    println!("\n{:<38} {:>9} {:>9} {:>10} {:>11} {:>9} {:>9}  reference", "prompt", "TTFT ms", "ITL ms", "bytes", "handoff ms", "tail ms", "decode ms");
    let mut all = Vec::new();
    for p in prompts {
        let r = complete(&c.addr, p, max_tokens).map_err(|(s, b)| anyhow::anyhow!("HTTP {s}: {b}"))?;
        let want = crate::model::run_colocated(&model, p.as_bytes(), max_tokens - 1)?;
        let ok = if want.tokens == r.token_ids { "equal" } else { "DIFFERENT" };
        let itl = r.itl_ms.iter().sum::<f64>() / r.itl_ms.len().max(1) as f64;
        let tail = r.tail_ms.map_or("-".to_string(), |t| format!("{t:.3}"));
        println!("{:<38} {:>9.2} {:>9.2} {:>10} {:>11.2} {:>9} {:>9.2}  {ok}", format!("{p:?}"), r.ttft_ms, itl, r.bytes, r.handoff_ms, tail, r.decode_ms);
        println!("  -> {:?} (token ids {:?})", r.text, r.token_ids);
        if ok != "equal" {
            anyhow::bail!("completion of {p:?} differs from the colocated reference: {:?} vs {:?}", r.token_ids, want.tokens);
        }
        all.push(r);
    }
    let mut ttft: Vec<f64> = all.iter().map(|r| r.ttft_ms).collect();
    let mut itl: Vec<f64> = all.iter().flat_map(|r| r.itl_ms.clone()).collect();
    println!(
        "\n{} requests: TTFT p50 {:.2} ms, inter-token p50 {:.2} ms, {} bytes handed off; every completion equals the colocated reference",
        all.len(),
        percentile(&mut ttft, 0.5),
        percentile(&mut itl, 0.5),
        all.iter().map(|r| r.bytes).sum::<u64>()
    );
    c.shutdown();
    Ok(())
}

/// Set by `up --trace-dir DIR` for its children: each role traces into DIR.
pub const TRACE_DIR_ENV: &str = "HANDOFF_TRACE_DIR";

/// The command that starts a role process: `program` (the `handoff` binary; None =
/// this executable) with the role's arguments.
pub fn role_command(program: Option<&std::path::Path>, args: &[String]) -> anyhow::Result<std::process::Command> {
    let exe = match program {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe().context("locate the handoff executable")?,
    };
    let mut c = std::process::Command::new(exe);
    c.args(args);
    Ok(c)
}

/// CPU time (user + system, clock ticks) and resident bytes of a process.
pub fn proc_usage(pid: u32) -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start after ") ".
    let rest = stat.rsplit_once(") ")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(0) as u64;
    Some((ticks, pages * page))
}

#[cfg(test)]
mod port_tests {
    use super::{ephemeral_low, free_port};

    /// The ports picked lie under the ephemeral range (where no port-0 bind or
    /// outgoing connection takes them) and can be bound.
    #[test]
    fn a_free_port_lies_below_the_ephemeral_range_and_binds() {
        let low = ephemeral_low();
        assert!(low > 2048 + 1024, "this machine's ephemeral range starts at {low}");
        let mut seen = std::collections::HashSet::new();
        for _ in 0..32 {
            let p = free_port().expect("a free port");
            assert!((low / 2..low).contains(&p), "{p} is not in [{}, {low})", low / 2);
            std::net::TcpListener::bind(("127.0.0.1", p)).expect("the port binds");
            seen.insert(p);
        }
        assert!(seen.len() > 16, "the picks are not spread: {seen:?}");
    }
}
