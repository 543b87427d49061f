//! The role subcommands as a clap `Subcommand`, for `main.rs` to flatten into its
//! own command enum, and the launcher that `up` uses to start role processes.

use anyhow::Context;
use clap::{Parser, Subcommand};
use handoff_components::Topology;
use std::path::PathBuf;
use std::process::Command;

/// `handoff prefill|decode|proxy|up|bench`.
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
    /// Start the default cluster and measure serving throughput and latency.
    Bench {
        #[arg(long, default_value_t = 8)]
        concurrency: u32,
        #[arg(long, default_value_t = 64)]
        requests: u32,
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
        RoleCommand::Bench { concurrency, requests } => super::bench_serve(concurrency, requests),
    }
}

#[derive(Parser)]
#[command(name = "handoff")]
struct RolesOnly {
    #[command(subcommand)]
    cmd: RoleCommand,
}

/// Environment variable naming how to start a role process, as JSON
/// `{"program": ..., "args": [...]}`; the role's own arguments then go in
/// [`ROLE_ARGS_ENV`]. Unset: the current executable with the role's arguments.
/// (Tests set it to re-run their own binary as a role.)
pub const LAUNCHER_ENV: &str = "HANDOFF_LAUNCHER";
/// The role arguments (JSON array) of a process started through [`LAUNCHER_ENV`].
pub const ROLE_ARGS_ENV: &str = "HANDOFF_ROLE_ARGS";

#[derive(serde::Serialize, serde::Deserialize)]
struct Launcher {
    program: PathBuf,
    args: Vec<String>,
}

/// The command that starts a role process with arguments `args` (e.g.
/// `["prefill", "--config", F, "--stage", "0"]`).
pub fn role_command(args: &[String]) -> anyhow::Result<Command> {
    role_command_with(std::env::var(LAUNCHER_ENV).ok().as_deref(), args)
}

/// [`role_command`] with an explicit launcher spec (None: this executable).
pub fn role_command_with(launcher: Option<&str>, args: &[String]) -> anyhow::Result<Command> {
    if let Some(spec) = launcher {
        let l: Launcher = serde_json::from_str(spec).with_context(|| format!("{LAUNCHER_ENV} = {spec}"))?;
        let mut c = Command::new(&l.program);
        c.args(&l.args).env(ROLE_ARGS_ENV, serde_json::to_string(args)?).env(LAUNCHER_ENV, spec);
        return Ok(c);
    }
    let exe = std::env::current_exe().context("locate the handoff executable")?;
    let mut c = Command::new(exe);
    c.args(args);
    Ok(c)
}

/// In a process started through [`LAUNCHER_ENV`]: parses [`ROLE_ARGS_ENV`] and runs
/// the role. `None` when the variable is unset (not a role process).
pub fn run_role_from_env() -> Option<anyhow::Result<()>> {
    let args = std::env::var(ROLE_ARGS_ENV).ok()?;
    let run = || -> anyhow::Result<()> {
        let mut argv: Vec<String> = vec!["handoff".into()];
        argv.extend(serde_json::from_str::<Vec<String>>(&args)?);
        let cli = RolesOnly::try_parse_from(argv).map_err(|e| anyhow::anyhow!("{e}"))?;
        dispatch(cli.cmd)
    };
    Some(run())
}

/// A launcher spec (for [`LAUNCHER_ENV`]) that runs `program` with `args` first.
pub fn launcher_spec(program: PathBuf, args: Vec<String>) -> String {
    serde_json::to_string(&Launcher { program, args }).unwrap_or_default()
}
