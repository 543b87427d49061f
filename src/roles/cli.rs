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
    },
    /// Run the decode instance (all of its TP x DCP ranks).
    Decode {
        #[arg(long)]
        config: String,
        #[arg(long, default_value = "127.0.0.1:8000")]
        proxy: String,
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
    },
}

fn load(path: &str) -> anyhow::Result<Topology> {
    Topology::load(path).map_err(|e| anyhow::anyhow!("{e}"))
}

/// Runs one role subcommand.
pub fn dispatch(cmd: RoleCommand) -> anyhow::Result<()> {
    super::init_logging();
    match cmd {
        RoleCommand::Prefill { config, stage, proxy } => super::run_prefill(&load(&config)?, stage, &proxy),
        RoleCommand::Decode { config, proxy } => super::run_decode(&load(&config)?, &proxy),
        RoleCommand::Proxy { config, host, port } => super::run_proxy(&load(&config)?, &host, port),
        RoleCommand::Up { config, host, port } => super::run_up(config.as_deref(), &host, port),
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
