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
        /// --control-host/--control-port, not its public port).
        #[arg(long, default_value = "127.0.0.1:8001")]
        proxy: String,
        /// Compute backend: cpu, cuda[:N] or hip[:N] (default: the topology's [device], else cpu).
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
        /// --control-host/--control-port, not its public port).
        #[arg(long, default_value = "127.0.0.1:8001")]
        proxy: String,
        /// Compute backend: cpu, cuda[:N] or hip[:N] (default: the topology's [device], else cpu).
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
        /// the port the proxy logs).
        #[arg(long, default_value = "127.0.0.1")]
        control_host: String,
        #[arg(long, default_value_t = 8001)]
        control_port: u16,
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
        /// Compute backend of every stage and of decode: cpu, cuda[:N] or hip[:N]
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
        RoleCommand::Prefill { config, stage, proxy, device, .. } => {
            let secret = crate::roles::role_secret()?;
            crate::roles::run_prefill(&load_on(&config, device.as_deref())?, stage, &proxy, &secret)
        }
        RoleCommand::Decode { config, proxy, device, .. } => {
            let secret = crate::roles::role_secret()?;
            crate::roles::run_decode(&load_on(&config, device.as_deref())?, &proxy, &secret)
        }
        RoleCommand::Proxy { config, host, port, control_host, control_port, api_key, .. } => {
            let secret = crate::roles::role_secret()?;
            let listen = crate::roles::proxy::Listen { host, port, control_host, control_port };
            crate::roles::run_proxy(&load(&config)?, &listen, api_key.filter(|k| !k.is_empty()), secret)
        }
        RoleCommand::Up { config, host, port, device, max_restarts, restart_window_s, api_key, trace_dir } => {
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
            crate::roles::run_up(config.as_deref(), &host, port, device.as_deref(), policy, api_key.as_deref(), trace_dir.as_deref())
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
