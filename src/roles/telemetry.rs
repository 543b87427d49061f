//! A role process's `tracing`: its log lines, the engine's per-system timings that
//! its heartbeat carries to `/metrics`, and an optional Perfetto trace.

/// The engine timings of this role process: every bevy `system` span, timed into
/// one histogram per system, which the heartbeat carries to the proxy's `/metrics`.
pub fn profiler() -> &'static crate::engine::profile::Profiler {
    static PROFILER: std::sync::OnceLock<crate::engine::profile::Profiler> = std::sync::OnceLock::new();
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
