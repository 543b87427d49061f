//! Prometheus histograms and their text exposition, for `/metrics`.
//!
//! Two kinds of histogram reach the proxy's `/metrics`:
//! - the proxy's own request latencies (time to first token, inter-token latency,
//!   end-to-end latency, per-phase time), observed as requests finish;
//! - every role's engine timings: one histogram per bevy system (the `system` spans
//!   that `handoff plan --timings` reads), carried in the role's heartbeat as
//!   cumulative bucket counts ([`SystemTiming`]), plus the same runs merged per
//!   phase.
//!
//! Bucket bounds are fixed per kind, so that the histograms of every role and
//! every restart of a role can be summed by a Prometheus query.

use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// Bounds of the hand-off tail's histogram (seconds): a streamed stage's tail
/// is one layer's writes, often well under a millisecond.
pub const TAIL_BUCKETS_S: &[f64] = &[0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 10.0];

/// Bucket bounds (seconds) of request latencies: 1 ms to 2 min.
pub const REQUEST_BUCKETS_S: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

/// Bucket bounds (seconds) of one system run: 1 us to 1 s (a decode tick's
/// systems run in microseconds; the dispatch phase's compute in milliseconds).
pub const SYSTEM_BUCKETS_S: &[f64] = &[1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0];

/// A histogram over fixed bounds: `counts[i]` observations at most `bounds[i]`
/// and above `bounds[i - 1]`; `counts[bounds.len()]` those above every bound.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram { bounds, counts: vec![0; bounds.len() + 1], sum: 0.0 }
    }

    pub fn observe(&mut self, value: f64) {
        let v = if value.is_finite() { value.max(0.0) } else { 0.0 };
        let i = self.bounds.partition_point(|&b| b < v);
        self.counts[i] += 1;
        self.sum += v;
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Cumulative counts at each bound (the `_bucket` series, `+Inf` excluded).
    pub fn cumulative(&self) -> Vec<u64> {
        self.counts[..self.bounds.len()]
            .iter()
            .scan(0u64, |acc, &c| {
                *acc += c;
                Some(*acc)
            })
            .collect()
    }

    pub fn sum(&self) -> f64 {
        self.sum
    }
}

/// One system's run times on one role, as its heartbeat carries them: cumulative
/// counts at [`SYSTEM_BUCKETS_S`], the number of runs and their total seconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SystemTiming {
    /// The system's path, without the `handoff_systems::` prefix.
    pub system: String,
    /// The phase of the schedule it runs in (`admission` ... `dispatch`).
    pub phase: String,
    pub cumulative: Vec<u64>,
    pub count: u64,
    pub sum_s: f64,
}

/// The `# HELP` and `# TYPE` lines of one family.
pub fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// One histogram's series: `_bucket` at every bound and `+Inf`, `_sum`, `_count`.
/// `labels` is empty or `key="value",...` without braces.
pub fn histogram_series(out: &mut String, name: &str, labels: &str, bounds: &[f64], cumulative: &[u64], count: u64, sum: f64) {
    let sep = if labels.is_empty() { "" } else { "," };
    for (b, c) in bounds.iter().zip(cumulative) {
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {c}");
    }
    let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
    let braces = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
    let _ = writeln!(out, "{name}_sum{braces} {sum}\n{name}_count{braces} {count}");
}

/// A [`Histogram`]'s series.
pub fn write_histogram(out: &mut String, name: &str, labels: &str, h: &Histogram) {
    histogram_series(out, name, labels, h.bounds, &h.cumulative(), h.count(), h.sum);
}

/// The timings of this process's engine, from its profiler, as [`SystemTiming`]s.
pub fn system_timings(profiler: &crate::engine::profile::Profiler) -> Vec<SystemTiming> {
    let Ok(runs) = profiler.runs.lock() else { return Vec::new() };
    runs.iter()
        .map(|(name, h)| SystemTiming {
            system: name.trim_start_matches("handoff_systems::").to_string(),
            phase: crate::engine::profile::phase_of(name).to_string(),
            // The profiler records nanoseconds.
            cumulative: SYSTEM_BUCKETS_S.iter().map(|b| h.count_between(0, (b * 1e9) as u64)).collect(),
            count: h.len(),
            sum_s: h.mean() * h.len() as f64 / 1e9,
        })
        .collect()
}

/// The same runs merged per phase: (phase, cumulative, count, sum).
pub fn per_phase(timings: &[SystemTiming]) -> Vec<(String, Vec<u64>, u64, f64)> {
    let mut phases: std::collections::BTreeMap<&str, (Vec<u64>, u64, f64)> = std::collections::BTreeMap::new();
    for t in timings {
        let e = phases.entry(&t.phase).or_insert_with(|| (vec![0; SYSTEM_BUCKETS_S.len()], 0, 0.0));
        for (a, b) in e.0.iter_mut().zip(&t.cumulative) {
            *a += b;
        }
        e.1 += t.count;
        e.2 += t.sum_s;
    }
    phases.into_iter().map(|(p, (c, n, s))| (p.to_string(), c, n, s)).collect()
}

/// A label value with `\`, `"` and newlines escaped (the text format's rule).
pub fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_the_first_bucket_at_or_above_them() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.1, 0.5, 1.0, 7.0, f64::NAN] {
            h.observe(v);
        }
        // 0.05, 0.1 and NaN (counted as 0) are <= 0.1; 0.5 and 1.0 are <= 1; 7 only in +Inf.
        assert_eq!(h.cumulative(), vec![3, 5]);
        assert_eq!(h.count(), 6);
        assert!((h.sum() - 8.65).abs() < 1e-12);
        let mut out = String::new();
        write_histogram(&mut out, "x_seconds", "role=\"a\"", &h);
        assert!(out.contains("x_seconds_bucket{role=\"a\",le=\"0.1\"} 3\n"), "{out}");
        assert!(out.contains("x_seconds_bucket{role=\"a\",le=\"+Inf\"} 6\n"), "{out}");
        assert!(out.contains("x_seconds_count{role=\"a\"} 6\n"), "{out}");
    }

    #[test]
    fn phases_merge_the_runs_of_their_systems() {
        let t = |s: &str, p: &str, n: u64| SystemTiming {
            system: s.into(),
            phase: p.into(),
            cumulative: vec![n; SYSTEM_BUCKETS_S.len()],
            count: n,
            sum_s: n as f64,
        };
        let merged = per_phase(&[t("a", "dispatch", 2), t("b", "dispatch", 3), t("c", "release", 1)]);
        assert_eq!(merged.len(), 2);
        assert_eq!((merged[0].0.as_str(), merged[0].2, merged[0].3), ("dispatch", 5, 5.0));
        assert_eq!(merged[0].1[0], 5);
        assert_eq!((merged[1].0.as_str(), merged[1].2), ("release", 1));
    }
}
