//! The `handoff` command.

use anyhow::Result;
use clap::{Parser, Subcommand};
use handoff::engine::profile::Profiler;
use handoff_components::Topology;
use std::process::ExitCode;
use tracing_subscriber::prelude::*;

#[derive(Parser)]
#[command(name = "handoff", version, about = "Prefill/decode disaggregated serving of hybrid MLA + KDA models")]
struct Cli {
    /// Without a command: the built-in default topology, end to end.
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a topology file and print a summary (with the address each role
    /// will bind and advertise), or the refusal.
    Check {
        #[arg(long)]
        config: String,
    },
    /// Write the topology's model weights (seeded or its checkpoint, rounded as
    /// `[model] weight_dtype` multiplies) as a safetensors file of F32 tensors
    /// (docs/weights.md): what the PyTorch peer loads.
    Weights {
        #[arg(long)]
        config: String,
        #[arg(long)]
        out: String,
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
        /// Prompt tokens per request (default: 4096, or half of serve.max_context when that is less).
        #[arg(long)]
        tokens: Option<u64>,
        /// Requests handed off together (with --compute: decoded as one batch).
        #[arg(long, default_value_t = 2)]
        requests: u32,
        /// Also run the model: disaggregated decode must equal colocated decode.
        #[arg(long)]
        compute: bool,
        /// Decode steps compared with --compute.
        #[arg(long, default_value_t = 32)]
        steps: u32,
        /// Prompt text for --compute (byte-level tokens).
        #[arg(long, default_value = "handoff moves every byte of the hand-off, checked.")]
        prompt: String,
        /// Backend of --compute: cpu, cuda[:N] or hip[:N] (default: the topology's [device], else cpu).
        #[arg(long)]
        device: Option<String>,
        /// Check the topology at N layers instead of its `[model] num_layers` (same
        /// ranks, widths and heads; N must still split over the prefill stages).
        #[arg(long, value_name = "N")]
        layers: Option<u32>,
        /// Fragment the decode block pool before the checked requests are placed
        /// (holes between live requests), so that their decode blocks are scattered
        /// and their rows go out as staged groups; fails if none was staged.
        #[arg(long)]
        fragmented: bool,
        /// Move the bytes through the engine's mover over this transport (local,
        /// shm, tcp) instead of the oracle's counting copy; the oracle still checks
        /// every copy and every byte.
        #[arg(long)]
        transport: Option<String>,
    },
    /// Teacher-forced bits per byte and next-byte accuracy of held-out text through the
    /// disaggregated path, next to the colocated run.
    Eval {
        #[arg(long)]
        config: String,
        /// Text file (bytes are the tokens).
        #[arg(long)]
        data: String,
        /// Windows scored, spread evenly over the file (decoded together as one batch).
        #[arg(long, default_value_t = 16)]
        samples: usize,
        /// Prompt bytes of each window (prefilled, then handed off).
        #[arg(long, default_value_t = 64)]
        prefix: usize,
        /// Bytes scored after the prompt (decode is fed the true bytes).
        #[arg(long, default_value_t = 64)]
        continuation: usize,
        /// Drop one region kind from the hand-off (decode starts from zeroed memory):
        /// kda.state, kda.conv, replay.records, replay.cursor, mla.kv.
        #[arg(long)]
        drop: Option<String>,
        /// Backend: cpu, cuda[:N] or hip[:N] (default: the topology's [device], else cpu).
        #[arg(long)]
        device: Option<String>,
    },
    /// A model (not a measurement) of the hand-off's network at cluster scale: plans
    /// one request with the engine, checks its bytes against the oracle, and
    /// predicts the transfer time, link occupancy and the largest request rate the
    /// NICs sustain for 1 to 64 decode nodes, printing its assumptions.
    Simulate {
        #[arg(long)]
        config: String,
        /// NICs per node (prefill and decode nodes alike).
        #[arg(long, default_value_t = 8)]
        nics: u32,
        /// Line rate of one NIC in Gb/s.
        #[arg(long, default_value_t = 400.0)]
        nic_gbps: f64,
        /// Fraction of line rate a NIC moves (1: line rate).
        #[arg(long, default_value_t = 1.0)]
        efficiency: f64,
        /// Requests per second offered to the whole cluster.
        #[arg(long)]
        rate: f64,
        /// Prompt tokens of each request (all handed off).
        #[arg(long)]
        prompt_tokens: u64,
        /// Decode nodes of the headline prediction (the table sweeps 1 to 64).
        #[arg(long, default_value_t = 1)]
        decode_nodes: u32,
        /// Prefill instances (default: one per decode node).
        #[arg(long)]
        prefill_instances: Option<u32>,
    },
    #[command(flatten)]
    Role(handoff::cli::RoleCommand),
    /// Benchmarks: transfer bandwidth against memcpy, CPU compute against a roofline, serving load.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Start the default cluster and load it: tok/s, TTFT and inter-token latency p50/p99.
    Serve {
        /// Topology file (default: the built-in default cluster).
        #[arg(long)]
        config: Option<String>,
        /// Concurrency levels, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1,8,32,88")]
        concurrency: Vec<u32>,
        /// Completions per level (default: 8 x concurrency, at least 64).
        #[arg(long, default_value_t = 0)]
        requests: u32,
        /// Exit 0 even when requests failed (they are still listed by status and reason).
        #[arg(long)]
        allow_failures: bool,
        /// Also draw tok/s, TTFT and ITL (p50, p99) per level into this SVG file.
        #[arg(long)]
        plot: Option<std::path::PathBuf>,
        /// Prompts of exactly this many tokens (default: 32 to 127), e.g. 32768
        /// for the hand-off tail of long prompts (the config's serve.max_context
        /// must hold them).
        #[arg(long)]
        prompt_tokens: Option<u32>,
    },
    /// A long load through `handoff up` with faults injected: prefill stage 0, the
    /// last stage and decode killed (SIGKILL) one after the other, each restarted by
    /// up (optionally decode stopped with SIGSTOP too); then requests by outcome
    /// (with kills alone: 0 failed, 0 lost, every completion equal to its unfaulted
    /// reference), the proxy's retries, every role's counts back at baseline,
    /// resident memory at the start and the end, producer entries at 0, and decode
    /// idle afterwards.
    Soak {
        #[arg(long)]
        config: Option<String>,
        #[arg(long, default_value_t = 10_000)]
        requests: u32,
        #[arg(long, default_value_t = 88)]
        concurrency: u32,
        /// Seconds decode is watched idle after the load.
        #[arg(long, default_value_t = 10.0)]
        idle_s: f64,
        /// The roles killed (SIGKILL) under load, in order, spread evenly over it:
        /// stageN, last (the last prefill stage), decode.
        #[arg(long, value_delimiter = ',', default_value = "stage0,last,decode")]
        kill: Vec<handoff::bench::soak::Victim>,
        /// Seconds decode is stopped (SIGSTOP) after the kills (0: not stopped).
        #[arg(long, default_value_t = 0.0)]
        stop_decode_s: f64,
        /// Distinct prompts the load cycles through (each run unfaulted first, for
        /// reference; at most 1248).
        #[arg(long, default_value_t = 1248)]
        prompts: u32,
        /// No faults: a plain long load, where any failure fails the run.
        #[arg(long)]
        no_faults: bool,
    },
    /// Hand-off bandwidth over a transport, with this machine's memcpy measured in the same run
    /// (cuda-ipc: between two processes on one GPU, against the device copy and the IPC copy).
    Transfer {
        #[arg(long)]
        config: String,
        #[arg(long, value_parser = ["local", "shm", "tcp", "rdma", "ucx", "cuda-ipc"], default_value = "local")]
        transport: String,
        /// UCX's transports for `--transport ucx` (UCX's TLS: tcp, sm, ...),
        /// overriding the topology's `[transport.ucx] tls`.
        #[arg(long)]
        ucx_tls: Option<String>,
        /// UCX's network devices for `--transport ucx`, overriding `[transport.ucx] net_devices`.
        #[arg(long)]
        ucx_net_devices: Option<String>,
        /// The GPU of the cuda-ipc transport: cuda or cuda:N.
        #[arg(long, default_value = "cuda:0")]
        device: String,
        #[arg(long, default_value_t = 32768)]
        tokens: u64,
        #[arg(long, default_value_t = 1)]
        requests: u32,
    },
    /// The consumer process of `bench transfer --transport cuda-ipc` (started by it).
    #[command(hide = true)]
    TransferConsumer,
    /// Prefill and decode tokens/s of the small model, and decode kernels against the memcpy roofline.
    Compute {
        #[arg(long, default_value = "config/small.toml")]
        config: String,
        #[arg(long, default_value_t = 512)]
        prompt: usize,
        #[arg(long, default_value_t = 64)]
        steps: u32,
        /// Backend: cpu, cuda[:N] or hip[:N] (default: the topology's [device], else cpu).
        #[arg(long)]
        device: Option<String>,
        /// Also draw each op's fraction of its roofline into this SVG file.
        #[arg(long)]
        plot: Option<std::path::PathBuf>,
    },
    /// Prefill a batch of prompts through the whole model at TP1 as one pass, as
    /// a prefill stage runs the requests ready in one tick.
    Prefill {
        #[arg(long, default_value = "config/small.toml")]
        config: String,
        /// Prompts in the batch.
        #[arg(long, default_value_t = 32)]
        prompts: usize,
        /// Tokens of each prompt.
        #[arg(long, default_value_t = 80)]
        tokens: usize,
        /// Timed passes (after one warm-up); the best is printed.
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Backend: cpu, cuda[:N] or hip[:N] (default: the topology's [device], else cpu).
        #[arg(long)]
        device: Option<String>,
    },
}

/// Refusals and bad input exit with status 2.
struct Refusal(String);

/// Keeps the compute path's large scratch buffers on the heap. By default glibc
/// serves a buffer over its mmap threshold with a fresh mapping and unmaps it
/// on free, so a prefill that allocates its activations anew for every request
/// paid a page fault per 4 KiB touched (about a tenth of a stage's time). A
/// fixed threshold of 64 MiB and a matching trim threshold let freed buffers be
/// reused; the heap then stays at the working set, which the soak test watches.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; it is called before any
    // other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 128 << 20);
    }
}

fn main() -> ExitCode {
    tune_allocator();
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
    let Some(command) = cli.command else {
        return handoff::roles::run_demo();
    };
    match command {
        Command::Check { config } => {
            let topo = load(&config)?;
            print!("{}", handoff::cli::summary(&topo, &config));
            // Where each role will listen and what it will advertise (no flags:
            // the topology's [cluster] table, else loopback).
            let addrs = handoff::roles::addr::summary(&topo).map_err(|e| Refusal(e.to_string()))?;
            print!("{addrs}");
        }
        Command::Simulate { config, nics, nic_gbps, efficiency, rate, prompt_tokens, decode_nodes, prefill_instances } => {
            let topo = load(&config)?;
            let o = handoff::bench::simulate::SimOptions { nics, nic_gbps, efficiency, rate, prompt_tokens, decode_nodes, prefill_instances };
            let report = handoff::bench::simulate::simulate(&topo, &config, &o).map_err(|e| Refusal(e.to_string()))?;
            println!("{report}");
        }
        Command::Weights { config, out } => {
            let topo = load(&config)?;
            let model = handoff::model::Model::new(&topo).map_err(|e| Refusal(e.to_string()))?;
            let bytes = handoff::model::checkpoint::to_bytes(&model).map_err(|e| Refusal(e.to_string()))?;
            std::fs::write(&out, &bytes).map_err(|e| Refusal(format!("cannot write {out}: {e}")))?;
            println!("wrote {out}: {} bytes, the weights of {config}", bytes.len());
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
            let _sub = tracing::subscriber::set_default(tracing_subscriber::registry().with(profiler.clone()).with(chrome));
            let run = handoff::cli::plan_request(&topo, tokens, profiler).map_err(|e| Refusal(e.to_string()))?;
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
        Command::Verify { config, tokens, requests, compute, steps, prompt, device, layers, fragmented, transport } => {
            let mut topo = load(&config)?;
            // Said on the first line of the report (and of a failure), so a run at
            // reduced depth is never read as the full model's.
            let mut depth = String::new();
            if let Some(n) = layers {
                let full = topo.num_layers();
                if compute && n != full && topo.model().weights.is_some() {
                    return Err(Refusal(format!(
                        "--layers {n} with --compute: {config} runs a trained checkpoint of {full} layers, which cannot be cut; drop --layers, or use a config of seeded weights"
                    ))
                    .into());
                }
                topo = handoff::check::verify::at_depth(&topo, &config, n).map_err(|e| Refusal(e.to_string()))?;
                depth = format!(" at {n} of its {full} layers (--layers)");
            }
            if requests == 0 {
                return Err(Refusal("--requests 0 checks nothing: give at least 1".into()).into());
            }
            if compute && (fragmented || transport.is_some()) {
                return Err(Refusal("--fragmented and --transport check the byte hand-off only: drop them with --compute".into()).into());
            }
            let transport = match transport.as_deref() {
                None => None,
                Some("local") => Some(handoff_components::config::TransportKind::Local),
                Some("shm") => Some(handoff_components::config::TransportKind::Shm),
                Some("tcp") => Some(handoff_components::config::TransportKind::Tcp),
                Some("rdma") => Some(handoff_components::config::TransportKind::Rdma),
                Some(other) => return Err(Refusal(format!("--transport {other}: verify moves bytes over local, shm, tcp or rdma")).into()),
            };
            if compute {
                if prompt.is_empty() {
                    return Err(Refusal("--prompt must not be empty".into()).into());
                }
                if steps == 0 {
                    return Err(Refusal("--steps 0 checks no decode step: give at least 1".into()).into());
                }
                let dev = handoff::engine::device::resolve(&topo, device.as_deref())?;
                let prompts = handoff::check::compute_verify::batch_prompts(prompt.as_bytes(), requests);
                let r =
                    handoff::with_backend!(dev, |be| handoff::check::compute_verify::verify_compute_on(&topo, &prompts, steps, Default::default(), be, |_| {}))
                        .map_err(|e| anyhow::anyhow!("verify --compute {config}{depth} failed: {e}"))?;
                println!(
                    "verify --compute {config}{depth} on {dev}: ok: {} requests decoded as one batch ({} prompt tokens for the first) + {} decode steps, greedy tokens equal to the colocated run, max logit relative error {:.2e} (limit {:.0e}) at step {}",
                    r.requests,
                    r.prompt_tokens,
                    r.steps,
                    r.max_rel_err,
                    handoff::check::compute_verify::LOGIT_TOLERANCE,
                    r.worst_step
                );
                if dev.kind != handoff_components::config::DeviceKind::Cpu {
                    println!(
                        "  regions in {}; disaggregated decode: {}; colocated decode (PP1 x TP1 -> TP1 x DCP1, CUDA graphs off): {}",
                        r.regions, r.decode_path, r.colocated_decode_path
                    );
                    println!(
                        "  disaggregated {} the colocated run on the same device",
                        if r.bit_equal { "equals bit for bit" } else { "is within the tolerance of (not bit-equal to)" }
                    );
                    let per: Vec<String> = r.device_steps.iter().map(|e| format!("{e:.1e}")).collect();
                    println!(
                        "  against the CPU, step by step (each step re-run on the CPU from the device's caches and token): max logit relative error {:.2e} (limit {:.1e}); per step (0 = prefill): {}",
                        r.device_rel_err,
                        handoff::check::compute_verify::device_tolerance(&topo),
                        per.join(" ")
                    );
                    for (req, step) in &r.near_ties {
                        println!("  request {req}: at step {step} the CPU's top two logits are within the tolerance and the device picked the CPU's runner-up");
                    }
                    println!(
                        "  free-running against the CPU reference (rounding compounds; for information): max logit relative error {:.2e}",
                        r.free_running_err
                    );
                }
                println!("  handed off {} bytes in {} descriptors; generated: {:?}", r.bytes_transferred, r.descriptors, String::from_utf8_lossy(&r.tokens));
                return Ok(());
            }
            let max_context = topo.config.serve.max_context as u64;
            let tokens = tokens.unwrap_or((max_context / 2).clamp(1, 4096));
            if tokens == 0 || tokens >= max_context {
                return Err(Refusal(format!("--tokens {tokens} must be between 1 and serve.max_context {max_context} - 1")).into());
            }
            let t = std::time::Instant::now();
            let opts = handoff::check::verify::VerifyOptions { fragmented, transport };
            let r = handoff::check::verify::verify_with(&topo, tokens, requests, opts, |_| {})
                .map_err(|e| anyhow::anyhow!("verify {config}{depth} failed: {e}"))?;
            let staged = if r.staged_groups > 0 { format!(" and {} staged groups of {} writes", r.staged_groups, r.staged_writes) } else { String::new() };
            println!(
                "verify {config}{depth}: ok: {} requests x {} tokens; {} descriptors ({} pieces before coalescing){staged} wrote {} bytes, each exactly once",
                r.requests, r.tokens, r.descriptors, r.uncoalesced, r.bytes_written
            );
            if r.chunks > 0 {
                println!(
                    "chunked transfer: {} chunks over the {} plans, token rows chunk by chunk, the KDA state, conv, replay and cursor with each plan's last",
                    r.chunks, r.chunks_plans
                );
            }
            if fragmented {
                println!(
                    "fragmented decode pool: scattered decode blocks, staged groups {} ({} staged writes ran); bytes moved by {}",
                    r.staged_groups,
                    r.staged_writes_run,
                    transport.map_or("the oracle's counting copy", |t| t.name())
                );
            } else if let Some(t) = transport {
                println!("bytes moved by the engine's mover over {}", t.name());
            }
            println!(
                "oracle: {} bytes equal the rules, {} bytes outside the requests untouched; entities back to baseline ({}) ",
                r.pattern_bytes, r.canary_bytes, r.entities_after
            );
            for (k, b) in &r.by_kind {
                println!("  {:<15} {b:>14} B", k.name());
            }
            println!("checked in {:.2} s", t.elapsed().as_secs_f64());
        }
        Command::Bench { what: BenchCommand::TransferConsumer } => handoff::bench::ipc::transfer_consumer()?,
        Command::Bench { what: BenchCommand::Transfer { config, transport, tokens, requests, device, .. } } if transport == "cuda-ipc" => {
            load(&config)?;
            let dev = handoff_components::config::DeviceConfig::parse(&device).map_err(|e| Refusal(format!("--device: {e}")))?;
            if dev.kind != handoff_components::config::DeviceKind::Cuda {
                return Err(Refusal(format!("--transport cuda-ipc needs --device cuda[:N], not {device:?}")).into());
            }
            let o = handoff::bench::transfer::BenchCmdOptions::default();
            println!("{}", handoff::bench::ipc::bench_transfer_ipc(&config, dev.ordinal, tokens, requests, &o)?);
        }
        Command::Bench { what: BenchCommand::Transfer { config, transport, tokens, requests, ucx_tls, ucx_net_devices, .. } } if transport == "ucx" => {
            load(&config)?;
            let ucx = handoff_components::config::UcxConfig { tls: ucx_tls, net_devices: ucx_net_devices };
            let o = handoff::bench::transfer::BenchCmdOptions::default();
            println!("{}", handoff::bench::ucx::bench_transfer_ucx(&config, tokens, requests, &ucx, &o)?);
        }
        Command::Bench { what: BenchCommand::Transfer { config, transport, tokens, requests, .. } } => {
            load(&config)?;
            let kind = match transport.as_str() {
                "shm" => handoff_components::config::TransportKind::Shm,
                "tcp" => handoff_components::config::TransportKind::Tcp,
                "rdma" => handoff_components::config::TransportKind::Rdma,
                _ => handoff_components::config::TransportKind::Local,
            };
            println!("{}", handoff::bench::transfer::bench_transfer_cmd(&config, kind, tokens, requests)?);
        }
        Command::Eval { config, data, samples, prefix, continuation, drop, device } => {
            let topo = load(&config)?;
            let dropped = match &drop {
                Some(k) => Some(
                    handoff_components::vocab::RegionKind::from_name(k)
                        .ok_or_else(|| Refusal(format!("--drop {k:?}: expected kda.state, kda.conv, replay.records, replay.cursor or mla.kv")))?,
                ),
                None => None,
            };
            let text = std::fs::read(&data).map_err(|e| Refusal(format!("--data {data}: {e}")))?;
            let max_context = topo.config.serve.max_context as usize;
            if prefix + continuation >= max_context {
                return Err(Refusal(format!("--prefix {prefix} + --continuation {continuation} must be under serve.max_context {max_context}")).into());
            }
            let dev = handoff::engine::device::resolve(&topo, device.as_deref())?;
            let r = handoff::with_backend!(dev, |be| handoff::check::eval::eval_on(&topo, &text, samples, prefix, continuation, dropped, be))
                .map_err(|e| anyhow::anyhow!("eval: {e}"))?;
            println!(
                "eval {config} on {data}: {} windows of {} + {} bytes ({} bytes scored){}",
                r.samples,
                r.prefix,
                r.continuation,
                r.disaggregated.bytes,
                drop.as_ref().map_or(String::new(), |k| format!(", hand-off without {k}"))
            );
            println!("  {:<14} {:>14} {:>10}", "run", "bits per byte", "accuracy");
            println!("  {:<14} {:>14.4} {:>9.2}%", "disaggregated", r.disaggregated.bits_per_byte, 100.0 * r.disaggregated.accuracy);
            println!("  {:<14} {:>14.4} {:>9.2}%", "colocated", r.colocated.bits_per_byte, 100.0 * r.colocated.accuracy);
            println!(
                "  max logit relative error between them: {:.2e} (equivalence limit {:.0e})",
                r.max_rel_err,
                handoff::check::compute_verify::LOGIT_TOLERANCE
            );
            if drop.is_none() && !r.equal() {
                anyhow::bail!("eval: the disaggregated run differs from the colocated run beyond the equivalence tolerance");
            }
        }
        Command::Role(r) => handoff::cli::roles::dispatch(r)?,
        Command::Bench { what: BenchCommand::Serve { config, concurrency, requests, allow_failures, plot, prompt_tokens } } => {
            if concurrency.is_empty() || concurrency.contains(&0) {
                return Err(Refusal("--concurrency needs levels of at least 1".into()).into());
            }
            if let Some(c) = &config {
                load(c)?;
            }
            if prompt_tokens == Some(0) {
                return Err(Refusal("--prompt-tokens needs at least 1 token".into()).into());
            }
            let levels = handoff::bench::bench_serve(config.as_deref().map(std::path::Path::new), &concurrency, requests, prompt_tokens)?;
            if let Some(p) = &plot {
                // Drawn before the failure check, so a sweep with failures still has its picture.
                handoff::bench::plot::draw_serve(&handoff::bench::serve::serve_chart(&levels, config.as_deref().map(std::path::Path::new)), p)?;
                println!("plot: {}", p.display());
            }
            let failed = handoff::bench::serve::failed_requests(&levels);
            if failed > 0 && !allow_failures {
                let total: u32 = levels.iter().map(|l| l.requests).sum();
                anyhow::bail!("bench serve: {failed} of {total} requests failed (listed above by status and reason); --allow-failures exits 0 anyway");
            }
        }
        Command::Bench { what: BenchCommand::Soak { config, requests, concurrency, idle_s, kill, stop_decode_s, prompts, no_faults } } => {
            if requests == 0 || concurrency == 0 || !(idle_s > 0.0 && idle_s < 3600.0) || !(0.0..3600.0).contains(&stop_decode_s) {
                return Err(Refusal(format!(
                    "--requests {requests} and --concurrency {concurrency} must be at least 1, --idle-s {idle_s} and --stop-decode-s {stop_decode_s} between 0 and 3600"
                ))
                .into());
            }
            let pp = match &config {
                Some(c) => load(c)?.prefill().pp,
                None => Topology::parse(handoff::roles::up::DEFAULT_CONFIG).map_err(|e| Refusal(e.to_string()))?.prefill().pp,
            };
            if let Some(s) = kill.iter().find_map(|v| match v {
                handoff::bench::soak::Victim::Stage(s) if *s >= pp => Some(*s),
                _ => None,
            }) && !no_faults
            {
                return Err(Refusal(format!("--kill stage{s}: the topology has prefill stages 0..{pp}")).into());
            }
            if prompts == 0 {
                return Err(Refusal("--prompts 0: the load needs at least one prompt".into()).into());
            }
            let mut o = handoff::bench::SoakOptions::new(requests, concurrency);
            o.idle = std::time::Duration::from_secs_f64(idle_s);
            o.prompts = prompts;
            o.kills = if no_faults { Vec::new() } else { kill };
            o.stop_decode = if no_faults { std::time::Duration::ZERO } else { std::time::Duration::from_secs_f64(stop_decode_s) };
            let r = handoff::bench::bench_soak(config.as_deref().map(std::path::Path::new), &o)?;
            let problems = r.problems(!no_faults);
            if !problems.is_empty() {
                anyhow::bail!("soak: {}", problems.join("; "));
            }
        }
        Command::Bench { what: BenchCommand::Prefill { config, prompts, tokens, reps, device } } => {
            let topo = load(&config)?;
            let dev = handoff::engine::device::resolve(&topo, device.as_deref())?;
            let f = handoff::with_backend!(dev, |be| handoff::model::bench_prefill(&be, &topo, prompts, tokens, reps)).map_err(|e| anyhow::anyhow!("{e}"))?;
            let all = (f.prompts * f.tokens) as f64;
            println!(
                "bench prefill on {dev}, {config}: {} prompts x {} tokens as one pass: {:.1} us, {:.0} tokens/s",
                f.prompts,
                f.tokens,
                f.batched_us,
                all / (f.batched_us * 1e-6)
            );
        }
        Command::Bench { what: BenchCommand::Compute { config, prompt, steps, device, plot } } => {
            let topo = load(&config)?;
            let dev = handoff::engine::device::resolve(&topo, device.as_deref())?;
            let f = handoff::with_backend!(dev, |be| handoff::model::bench_compute(&be, &topo, prompt, steps)).map_err(|e| anyhow::anyhow!("{e}"))?;
            println!("bench compute on {dev}");
            print!("{f}");
            let chart = handoff::bench::compute::compute_chart(&f, &topo, &dev, &config);
            print!("{chart}");
            if let Some(p) = &plot {
                handoff::bench::plot::draw_compute(&chart, p)?;
                println!("plot: {}", p.display());
            }
        }
    }
    Ok(())
}
