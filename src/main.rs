//! The `handoff` command.

use anyhow::Result;
use clap::{Parser, Subcommand};
use handoff::profile::Profiler;
use handoff_components::Topology;
use std::process::ExitCode;
use tracing_subscriber::prelude::*;

#[derive(Parser)]
#[command(name = "handoff", version, about = "Prefill/decode disaggregated serving of hybrid MLA + KDA models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a topology file and print a summary, or the refusal.
    Check {
        #[arg(long)]
        config: String,
    },
    /// Show the descriptors of one request's hand-off for every producer/consumer pair.
    Plan {
        #[arg(long)]
        config: String,
        #[arg(long)]
        tokens: u64,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Print p50/p99/total per system and per phase.
        #[arg(long)]
        timings: bool,
        /// Write a Chrome/Perfetto trace to this file.
        #[arg(long)]
        trace: Option<String>,
    },
    /// Run placement, splitting and an in-process transfer, and check every byte
    /// with the oracle.
    Verify {
        #[arg(long)]
        config: String,
        #[arg(long, default_value_t = 4096)]
        tokens: u64,
        #[arg(long, default_value_t = 2)]
        requests: u32,
    },
}

/// Refusals and bad input exit with status 2.
struct Refusal(String);

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            match e.downcast_ref::<Refusal>() {
                Some(Refusal(msg)) => eprintln!("error: {msg}"),
                None => eprintln!("error: {e:#}"),
            }
            ExitCode::from(2)
        }
    }
}

impl std::fmt::Debug for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for Refusal {}

fn load(path: &str) -> Result<Topology> {
    Topology::load(path).map_err(|e| Refusal(e.to_string()).into())
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Check { config } => {
            let topo = load(&config)?;
            print!("{}", handoff::cli::summary(&topo, &config));
        }
        Command::Plan { config, tokens, json, timings, trace } => {
            let topo = load(&config)?;
            if tokens == 0 {
                return Err(Refusal("--tokens must be at least 1".into()).into());
            }
            let profiler = Profiler::default();
            let (chrome, _guard) = match &trace {
                Some(f) => {
                    let (layer, guard) = tracing_chrome::ChromeLayerBuilder::new().file(f).include_args(true).build();
                    (Some(layer), Some(guard))
                }
                None => (None, None),
            };
            tracing_subscriber::registry().with(profiler.clone()).with(chrome).init();
            let run = handoff::cli::plan_request(&topo, tokens, profiler).map_err(Refusal)?;
            if json {
                println!("{}", handoff::cli::plan_json(&topo, tokens, &run));
            } else {
                print!("{}", handoff::cli::plan_table(&topo, tokens, &run));
            }
            if timings {
                eprint!("{}", run.profiler.table());
            }
            if let Some(f) = trace {
                eprintln!("trace written to {f}");
            }
        }
        Command::Verify { config, tokens, requests } => {
            let topo = load(&config)?;
            let t = std::time::Instant::now();
            let r = handoff::verify::verify(&topo, tokens, requests, |_| {}).map_err(|e| anyhow::anyhow!("verify failed: {e}"))?;
            println!(
                "verify {config}: ok: {} requests x {} tokens; {} descriptors ({} pieces before coalescing) wrote {} bytes, each exactly once",
                r.requests, r.tokens, r.descriptors, r.uncoalesced, r.bytes_written
            );
            println!(
                "oracle: {} bytes equal the rules, {} bytes outside the requests untouched; entities back to baseline ({}) ",
                r.pattern_bytes, r.canary_bytes, r.entities_after
            );
            for (k, b) in &r.by_kind {
                println!("  {:<15} {b:>14} B", k.name());
            }
            println!("checked in {:.2} s", t.elapsed().as_secs_f64());
        }
    }
    Ok(())
}
