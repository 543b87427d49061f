//! The role subcommands as a clap `Subcommand`, for `main.rs` to flatten into its
//! own command enum, and how `up` starts role processes.

use anyhow::Context;
use clap::Subcommand;
use handoff_components::Topology;
use std::path::PathBuf;
use std::process::Command;

/// `handoff prefill|decode|proxy|up`.
#[derive(Subcommand, Debug, Clone)]
pub enum RoleCommand {
    /// Run one prefill PP stage (all of its TP ranks).
    Prefill {
        #[arg(long)]
        config: String,
        #[arg(long)]
        stage: u32,
        /// The proxy to register with (host:port).
        #[arg(long, default_value = "127.0.0.1:8000")]
        proxy: String,
        /// Compute backend: cpu, cuda[:N] or hip[:N] (default: the topology's [device], else cpu).
        #[arg(long, env = "HANDOFF_DEVICE")]
        device: Option<String>,
    },
    /// Run the decode instance (all of its TP x DCP ranks).
    Decode {
        #[arg(long)]
        config: String,
        #[arg(long, default_value = "127.0.0.1:8000")]
        proxy: String,
        /// Compute backend: cpu, cuda[:N] or hip[:N] (default: the topology's [device], else cpu).
        #[arg(long, env = "HANDOFF_DEVICE")]
        device: Option<String>,
    },
    /// Run the HTTP proxy (OpenAI-style /v1/completions, /health, /metrics).
    Proxy {
        #[arg(long)]
        config: String,
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        #[arg(long, default_value_t = 8000)]
        port: u16,
    },
    /// Start proxy, every prefill stage and decode; stop them all on Ctrl-C or
    /// when one dies.
    Up {
        /// Topology file; the built-in default (config/small.toml) when omitted.
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
    },
}

fn load(path: &str) -> anyhow::Result<Topology> {
    Topology::load(path).map_err(|e| anyhow::anyhow!("{e}"))
}

/// The topology of `path` with `--device` (when given) in force.
fn load_on(path: &str, device: Option<&str>) -> anyhow::Result<Topology> {
    let mut topo = load(path)?;
    topo.config.device = crate::device::resolve(&topo, device)?;
    Ok(topo)
}

/// Runs one role subcommand.
pub fn dispatch(cmd: RoleCommand) -> anyhow::Result<()> {
    super::init_logging();
    match cmd {
        RoleCommand::Prefill { config, stage, proxy, device } => super::run_prefill(&load_on(&config, device.as_deref())?, stage, &proxy),
        RoleCommand::Decode { config, proxy, device } => super::run_decode(&load_on(&config, device.as_deref())?, &proxy),
        RoleCommand::Proxy { config, host, port } => super::run_proxy(&load(&config)?, &host, port),
        RoleCommand::Up { config, host, port, device } => {
            if let Some(d) = &device {
                handoff_components::config::DeviceConfig::parse(d).map_err(|e| anyhow::anyhow!("--device: {e}"))?;
            }
            super::run_up(config.as_deref(), &host, port, device.as_deref())
        }
    }
}

/// The command that starts a role process: `program` (the `handoff` binary; None =
/// this executable) with the role's arguments.
pub fn role_command(program: Option<&std::path::Path>, args: &[String]) -> anyhow::Result<Command> {
    let exe = match program {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe().context("locate the handoff executable")?,
    };
    let mut c = Command::new(exe);
    c.args(args);
    Ok(c)
}
