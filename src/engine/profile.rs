//! Per-system timings: a tracing layer that times every entry of bevy's `system`
//! spans (enabled by bevy_ecs's `trace` feature) into one histogram per system.

use hdrhistogram::Histogram;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tracing::Subscriber;
use tracing::span::{Attributes, Id};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::LookupSpan;

/// Histograms of system run times (nanoseconds), by system name.
#[derive(Clone, Default)]
pub struct Profiler {
    pub runs: Arc<Mutex<BTreeMap<String, Histogram<u64>>>>,
}

struct Label(String);
struct Entered(Instant);

struct NameVisitor(Option<String>);
impl tracing::field::Visit for NameVisitor {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "name" {
            self.0 = Some(value.to_string());
        }
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "name" {
            self.0 = Some(format!("{value:?}").trim_matches('"').to_string());
        }
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Profiler {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if attrs.metadata().name() != "system" {
            return;
        }
        let mut v = NameVisitor(None);
        attrs.record(&mut v);
        if let (Some(name), Some(span)) = (v.0, ctx.span(id)) {
            span.extensions_mut().insert(Label(name));
        }
    }
    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && span.extensions().get::<Label>().is_some()
        {
            span.extensions_mut().replace(Entered(Instant::now()));
        }
    }
    fn on_exit(&self, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let ext = span.extensions();
        let (Some(Label(name)), Some(Entered(t))) = (ext.get::<Label>(), ext.get::<Entered>()) else { return };
        let ns = t.elapsed().as_nanos() as u64;
        if let Ok(mut runs) = self.runs.lock() {
            // A role records every system of every tick: look up before inserting,
            // so that a run allocates nothing once its system is known.
            if let Some(h) = runs.get_mut(name.as_str()) {
                h.saturating_record(ns.max(1));
            } else {
                let mut h = new_histogram();
                h.saturating_record(ns.max(1));
                runs.insert(name.clone(), h);
            }
        }
    }
}

/// A histogram of 1 ns to 60 s at two significant digits (1%), allocated whole
/// up front (about 30 KiB): a role records every system of every tick for as long
/// as it runs, and an auto-resizing one would grow each time a slower run came.
fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 2).expect("histogram bounds")
}

/// The phase a system belongs to, from its module path.
pub fn phase_of(system: &str) -> &'static str {
    for p in ["admission", "placement", "splitting", "transfer", "release", "dispatch"] {
        if system.contains(&format!("::{p}::")) {
            return p;
        }
    }
    "engine"
}

/// One row of the timings table.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TimingRow {
    pub system: String,
    pub phase: &'static str,
    pub runs: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub total_us: f64,
}

impl Profiler {
    pub fn rows(&self) -> Vec<TimingRow> {
        let runs = self.runs.lock().map(|r| r.clone()).unwrap_or_default();
        runs.iter()
            .map(|(name, h)| TimingRow {
                system: short(name),
                phase: phase_of(name),
                runs: h.len(),
                p50_us: h.value_at_quantile(0.5) as f64 / 1e3,
                p99_us: h.value_at_quantile(0.99) as f64 / 1e3,
                total_us: h.mean() * h.len() as f64 / 1e3,
            })
            .collect()
    }

    /// The table `--timings` prints: per system, then per phase.
    pub fn table(&self) -> String {
        let rows = self.rows();
        let mut s = format!("{:<40} {:<10} {:>7} {:>10} {:>10} {:>12}\n", "system", "phase", "runs", "p50 us", "p99 us", "total us");
        for r in &rows {
            s += &format!("{:<40} {:<10} {:>7} {:>10.1} {:>10.1} {:>12.1}\n", r.system, r.phase, r.runs, r.p50_us, r.p99_us, r.total_us);
        }
        let mut phases: BTreeMap<&str, (u64, f64)> = BTreeMap::new();
        for r in &rows {
            let e = phases.entry(r.phase).or_default();
            e.0 += r.runs;
            e.1 += r.total_us;
        }
        s += &format!("\n{:<40} {:>7} {:>12}\n", "phase", "runs", "total us");
        for (p, (n, t)) in phases {
            s += &format!("{p:<40} {n:>7} {t:>12.1}\n");
        }
        s
    }

    /// Total microseconds spent in the systems of one phase.
    pub fn phase_us(&self, phase: &str) -> f64 {
        self.rows().iter().filter(|r| r.phase == phase).map(|r| r.total_us).sum()
    }
}

fn short(name: &str) -> String {
    name.trim_start_matches("handoff_systems::").to_string()
}
