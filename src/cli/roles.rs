//! The role subcommands as a clap `Subcommand`, for `main.rs` to flatten into its
//! own command enum, and their dispatch to the roles.

use clap::Subcommand;
use handoff_components::Topology;
use std::path::PathBuf;

/// `handoff prefill|decode|proxy|up`.
#[derive(Subcommand, Debug, Clone)]
pub enum RoleCommand {
    /// Run one prefill PP stage (all of its TP ranks).
    Prefill {
        #[arg(long)]
        config: String,
        #[arg(long)]
        stage: u32,
        /// The proxy's control address to register with (host:port; the proxy's
        /// control listener, not its public port). Default: the topology's
        /// `[cluster.proxy]` advertise, else 127.0.0.1:8001.
        #[arg(long)]
        proxy: Option<String>,
        #[command(flatten)]
        addrs: RoleAddrArgs,

        /// Compute backend: cpu, cuda, cuda:N, hip or hip:N (default: the topology's `[device]` table, else cpu).
        #[arg(long, env = "HANDOFF_DEVICE")]
        device: Option<String>,
        /// Write a Chrome/Perfetto trace of this process's spans (every engine
        /// system of every tick) to FILE; finished when the role stops.
        #[arg(long)]
        trace: Option<PathBuf>,
    },
    /// Run the decode instance (all of its TP x DCP ranks).
    Decode {
        #[arg(long)]
        config: String,
        /// The proxy's control address to register with (host:port; the proxy's
        /// control listener, not its public port). Default: the topology's
        /// `[cluster.proxy]` advertise, else 127.0.0.1:8001.
        #[arg(long)]
        proxy: Option<String>,
        #[command(flatten)]
        addrs: RoleAddrArgs,

        /// Compute backend: cpu, cuda, cuda:N, hip or hip:N (default: the topology's `[device]` table, else cpu).
        #[arg(long, env = "HANDOFF_DEVICE")]
        device: Option<String>,
        /// Write a Chrome/Perfetto trace of this process's spans (every engine
        /// system of every tick) to FILE; finished when the role stops.
        #[arg(long)]
        trace: Option<PathBuf>,
    },
    /// Run the HTTP proxy (OpenAI-style /v1/completions, /health, /metrics).
    Proxy {
        #[arg(long)]
        config: String,
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        #[arg(long, default_value_t = 8000)]
        port: u16,
        /// Where the roles register (`POST /internal/register`); keep it off any
        /// network clients reach. 0 picks a free port (then start the roles with
        /// the port the proxy logs). Default: the topology's `[cluster.proxy]`
        /// bind, else 127.0.0.1:8001.
        #[arg(long, conflicts_with = "bind")]
        control_host: Option<String>,
        #[arg(long, conflicts_with = "bind")]
        control_port: Option<u16>,
        /// The control listener as one address (HOST:PORT), instead of
        /// --control-host and --control-port.
        #[arg(long)]
        bind: Option<String>,
        /// The control address the roles are told to register at (printed at
        /// startup; HOST or HOST:PORT).
        #[arg(long)]
        advertise: Option<String>,
        /// Require `Authorization: Bearer KEY` on the /v1 routes (401 otherwise).
        /// Prefer the variable: an argument is visible to every user in `ps`.
        #[arg(long, env = "HANDOFF_API_KEY", hide_env_values = true)]
        api_key: Option<String>,
        /// Write a Chrome/Perfetto trace of this process's spans (every engine
        /// system of every tick) to FILE; finished when the role stops.
        #[arg(long)]
        trace: Option<PathBuf>,
    },
    /// Start proxy, every prefill stage and decode; restart a role that dies;
    /// drain and stop them all on Ctrl-C (a second Ctrl-C stops at once).
    Up {
        /// Topology file; the built-in default (config/trained.toml) when omitted.
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        #[arg(long, default_value_t = 8000)]
        port: u16,
        /// The proxy's control listener port, where the roles register (default:
        /// the topology's `[cluster.proxy]` bind port, else a free port).
        #[arg(long)]
        control_port: Option<u16>,
        /// Compute backend of every stage and of decode: cpu, cuda, cuda:N, hip or hip:N
        /// (handed to the roles as HANDOFF_DEVICE).
        #[arg(long)]
        device: Option<String>,
        /// Restarts of one role allowed within --restart-window-s; one more death
        /// and `up` stops every role and exits (0: never restart).
        #[arg(long, default_value_t = 5)]
        max_restarts: u32,
        #[arg(long, default_value_t = 60.0)]
        restart_window_s: f64,
        /// The proxy requires `Authorization: Bearer KEY` on the /v1 routes (handed
        /// to it as HANDOFF_API_KEY).
        #[arg(long, env = "HANDOFF_API_KEY", hide_env_values = true)]
        api_key: Option<String>,
        /// Every role process writes a Perfetto trace into DIR: proxy.json,
        /// decode.json, prefill-S.json (a restarted role: NAME.restart-N.json).
        #[arg(long)]
        trace_dir: Option<PathBuf>,
    },
}

/// Where a prefill stage or decode listens and what it tells the cluster
/// (`src/roles/addr.rs`): each overrides the topology's `[cluster]` table.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct RoleAddrArgs {
    /// Where the control listener listens: HOST:PORT, or HOST for any free port
    /// (default 127.0.0.1). Beyond loopback needs a cluster secret.
    #[arg(long)]
    pub bind: Option<String>,
    /// The control address the proxy and the other roles are told: HOST:PORT,
    /// or HOST for the bound port (default: the bound address).
    #[arg(long)]
    pub advertise: Option<String>,
    /// Where the tcp transport listens (transport.kind = "tcp" only).
    #[arg(long)]
    pub transport_bind: Option<String>,
    /// The tcp transport address written into this role's region handles.
    #[arg(long)]
    pub transport_advertise: Option<String>,
}

impl RoleAddrArgs {
    fn flags(self) -> crate::roles::addr::AddrFlags {
        crate::roles::addr::AddrFlags {
            bind: self.bind,
            bind_label: None,
            advertise: self.advertise,
            transport_bind: self.transport_bind,
            transport_advertise: self.transport_advertise,
        }
    }
}

/// The role's addresses, refused (naming the address) when a listener would
/// bind beyond loopback and no cluster secret was given; then the secret.
fn addresses_and_secret(
    topo: &Topology,
    role: handoff_components::failure::ProcessRole,
    flags: &crate::roles::addr::AddrFlags,
) -> anyhow::Result<(crate::roles::addr::RoleListeners, crate::transport::auth::ClusterSecret)> {
    let addrs = crate::roles::addr::resolve(topo, role, flags)?;
    let given = !matches!(crate::transport::auth::ClusterSecret::from_env(), Err(crate::transport::auth::SecretError::Missing));
    crate::roles::addr::require_secret(&addrs, given)?;
    Ok((addrs, crate::roles::role_secret()?))
}

fn load(path: &str) -> anyhow::Result<Topology> {
    Topology::load(path).map_err(|e| anyhow::anyhow!("{e}"))
}

/// The topology of `path` with `--device` (when given) in force.
fn load_on(path: &str, device: Option<&str>) -> anyhow::Result<Topology> {
    let mut topo = load(path)?;
    topo.config.device = crate::engine::device::resolve(&topo, device)?;
    Ok(topo)
}

/// Runs one role subcommand. The roles (not `up`) refuse to start without a
/// cluster secret ([`crate::transport::auth`]).
pub fn dispatch(cmd: RoleCommand) -> anyhow::Result<()> {
    let trace = match &cmd {
        RoleCommand::Prefill { trace, stage, .. } => trace_file(trace.as_deref(), &format!("prefill-{stage}")),
        RoleCommand::Decode { trace, .. } => trace_file(trace.as_deref(), "decode"),
        RoleCommand::Proxy { trace, .. } => trace_file(trace.as_deref(), "proxy"),
        RoleCommand::Up { .. } => None,
    };
    let _telemetry = crate::roles::init_telemetry(trace.as_deref())?;
    match cmd {
        RoleCommand::Prefill { config, stage, proxy, addrs, device, .. } => {
            let topo = load_on(&config, device.as_deref())?;
            let (addrs, secret) = addresses_and_secret(&topo, handoff_components::failure::ProcessRole::Prefill { stage }, &addrs.flags())?;
            let proxy = crate::roles::addr::proxy_address(&topo, proxy.as_deref())?.to_string();
            crate::roles::run_prefill(&topo, stage, &proxy, &addrs, &secret)
        }
        RoleCommand::Decode { config, proxy, addrs, device, .. } => {
            let topo = load_on(&config, device.as_deref())?;
            let (addrs, secret) = addresses_and_secret(&topo, handoff_components::failure::ProcessRole::Decode, &addrs.flags())?;
            let proxy = crate::roles::addr::proxy_address(&topo, proxy.as_deref())?.to_string();
            crate::roles::run_decode(&topo, &proxy, &addrs, &secret)
        }
        RoleCommand::Proxy { config, host, port, control_host, control_port, bind, advertise, api_key, .. } => {
            let topo = load(&config)?;
            let mut flags = crate::roles::addr::AddrFlags { bind, advertise, ..Default::default() };
            if flags.bind.is_none() && (control_host.is_some() || control_port.is_some()) {
                let h = control_host.unwrap_or_else(|| "127.0.0.1".to_string());
                let h = if h.contains(':') && !h.starts_with('[') { format!("[{h}]") } else { h };
                flags.bind = Some(format!("{h}:{}", control_port.unwrap_or(crate::roles::addr::PROXY_CONTROL_PORT)));
                flags.bind_label = Some("--control-host/--control-port");
            }
            let (addrs, secret) = addresses_and_secret(&topo, handoff_components::failure::ProcessRole::Proxy, &flags)?;
            let listen = crate::roles::proxy::Listen { host, port, control: addrs.control };
            crate::roles::run_proxy(&topo, &listen, api_key.filter(|k| !k.is_empty()), secret)
        }
        RoleCommand::Up { config, host, port, control_port, device, max_restarts, restart_window_s, api_key, trace_dir } => {
            if let Some(dir) = &trace_dir {
                std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("--trace-dir {}: {e}", dir.display()))?;
            }
            if let Some(d) = &device {
                handoff_components::config::DeviceConfig::parse(d).map_err(|e| anyhow::anyhow!("--device: {e}"))?;
            }
            if !(restart_window_s > 0.0 && restart_window_s <= 86_400.0) {
                anyhow::bail!("--restart-window-s {restart_window_s} must be between 0 and 86400 seconds");
            }
            let policy = crate::roles::up::RestartPolicy { max_restarts, window: std::time::Duration::from_secs_f64(restart_window_s), ..Default::default() };
            let listen = crate::roles::up::UpListen { host, port, control_port };
            crate::roles::run_up(config.as_deref(), &listen, device.as_deref(), policy, api_key.as_deref(), trace_dir.as_deref())
        }
    }
}

/// The trace file of a role: `--trace FILE`, else `NAME.json` in the directory of
/// [`TRACE_DIR_ENV`](crate::roles::up::TRACE_DIR_ENV); a restarted role writes `NAME.restart-N.json`, so that the
/// trace of the run that died is kept.
fn trace_file(flag: Option<&std::path::Path>, name: &str) -> Option<PathBuf> {
    if let Some(f) = flag {
        return Some(f.to_path_buf());
    }
    let dir = std::env::var_os(crate::roles::up::TRACE_DIR_ENV).filter(|d| !d.is_empty())?;
    let n = crate::roles::restarts();
    let file = if n == 0 { format!("{name}.json") } else { format!("{name}.restart-{n}.json") };
    Some(PathBuf::from(dir).join(file))
}
