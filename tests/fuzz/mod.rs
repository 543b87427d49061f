//! Robust input: property drivers that feed arbitrary bytes and structured mutations
//! of valid encodings to every reader of what a user or a peer wrote: the topology
//! file, the JSON-line control messages between roles, the tcp transport's binary
//! frames, and the OpenAI request bodies.
//!
//! Each case must end in a clean outcome (accepted or refused with a message), within
//! a time budget, without a panic; valid encodings must be accepted. The same drivers
//! serve the CI test (`tests/robust_input.rs`), which runs a bounded number of cases
//! and asserts; `PROPTEST_CASES` and `PROPTEST_RNG_SEED` run more or other ones.
//!
//! proptest is a normal dependency of the package for this module: its `TestRunner`
//! gives the bench command the same strategies and, above all, the shrinking to a
//! minimal failing input that a hand-written generator would have to reimplement.
//!
//! Memory: a reader that sizes a buffer by a length field before the bytes arrive
//! shows up as one large allocation. [`PeakAlloc`] records the largest single
//! allocation request; a binary that installs it as its global allocator (the test
//! does; the `handoff` binary does not, to keep serving free of the bookkeeping) gets
//! the figure in each [`Report`].

use handoff_components::Topology;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod bodies;
mod layouts;
mod lines;
mod tcp_frames;
mod topology;

pub use bodies::*;
pub use layouts::*;
pub use lines::*;
pub use tcp_frames::*;
pub use topology::*;

// ---- the allocation probe ----

static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, recording the largest single allocation it was asked for.
/// Install it with `#[global_allocator]` to have [`Report::largest_alloc`].
pub struct PeakAlloc;

impl PeakAlloc {
    fn note(size: usize) {
        if !INSTALLED.load(Ordering::Relaxed) {
            INSTALLED.store(true, Ordering::Relaxed);
        }
        PEAK.fetch_max(size, Ordering::Relaxed);
    }

    /// Forgets the peak so far.
    pub fn reset() {
        PEAK.store(0, Ordering::Relaxed);
    }

    /// The largest single allocation since the last reset; `None` when not installed.
    pub fn peak() -> Option<usize> {
        INSTALLED.load(Ordering::Relaxed).then(|| PEAK.load(Ordering::Relaxed))
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator.
unsafe impl GlobalAlloc for PeakAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::note(layout.size());
        // SAFETY: the caller's contract is passed through.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::note(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        Self::note(new_size);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

// ---- the driver ----

/// What is fuzzed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Topology files: `Topology::parse` and what `handoff check` derives.
    Topology,
    /// JSON-line control messages, transport notices and registrations.
    Wire,
    /// The tcp transport's binary frames, sent to a live consumer over loopback.
    Frames,
    /// `/v1/completions` and `/v1/chat/completions` bodies.
    Http,
    /// The consumer layouts a prefill stage plans from (they come in its job).
    Layouts,
}

impl Target {
    pub const fn name(self) -> &'static str {
        match self {
            Target::Topology => "topology",
            Target::Wire => "wire",
            Target::Frames => "frames",
            Target::Http => "http",
            Target::Layouts => "layouts",
        }
    }
}

/// How a run is bounded.
#[derive(Debug, Clone)]
pub struct Options {
    pub cases: u32,
    /// Seeds the case generator (the same seed gives the same cases).
    pub seed: u64,
    /// Longest one case may take before it counts as a failure.
    pub case_budget: Duration,
    /// Longest the whole run may take; past it the run is reported as hung.
    pub deadline: Duration,
}

impl Options {
    pub fn new(cases: u32) -> Options {
        Options { cases, seed: 0x0068_616e_646f_6666, case_budget: Duration::from_secs(3), deadline: Duration::from_secs(600) }
    }
}

/// A violated property and the input proptest shrank it to.
#[derive(Debug, Clone)]
pub struct Failure {
    pub reason: String,
    /// `Debug` of the minimal failing input.
    pub input: String,
}

/// The outcome of one run.
#[derive(Debug, Clone)]
pub struct Report {
    pub name: String,
    pub cases: u32,
    /// How many cases ended in each outcome (accepted, refused by reason, ...).
    pub outcomes: BTreeMap<String, u64>,
    pub failure: Option<Failure>,
    pub elapsed: Duration,
    pub slowest: Duration,
    /// Largest single allocation during the run (when [`PeakAlloc`] is installed).
    pub largest_alloc: Option<usize>,
}

impl Report {
    pub fn count(&self, outcome_prefix: &str) -> u64 {
        self.outcomes.iter().filter(|(k, _)| k.starts_with(outcome_prefix)).map(|(_, v)| v).sum()
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let status = if self.failure.is_some() { "FAILED" } else { "ok" };
        write!(f, "{:<9} {} cases in {:.2} s (slowest {:.1} ms)", self.name, self.cases, self.elapsed.as_secs_f64(), self.slowest.as_secs_f64() * 1e3)?;
        match self.largest_alloc {
            Some(b) => writeln!(f, ", largest allocation {:.1} KiB: {status}", b as f64 / 1024.0)?,
            None => writeln!(f, ": {status}")?,
        }
        for (k, v) in &self.outcomes {
            writeln!(f, "    {v:>8}  {k}")?;
        }
        if let Some(fl) = &self.failure {
            writeln!(f, "    failure: {}", fl.reason)?;
            let mut input = fl.input.clone();
            if input.len() > 4000 {
                input.truncate(4000);
                input += " ...";
            }
            writeln!(f, "    minimal input: {input}")?;
        }
        Ok(())
    }
}

/// What a case's check says: an outcome class, or the property it violated.
pub type Verdict = std::result::Result<String, String>;

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_else(|| "non-string panic".into())
}

/// Panics inside a case are caught and reported with the case's minimal input;
/// the default hook would also print each one (and every shrinking step's) to
/// stderr. Threads of other names keep the previous hook.
fn quiet_fuzz_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !std::thread::current().name().is_some_and(|n| n.starts_with("fuzz-")) {
                previous(info);
            }
        }));
    });
}

/// Runs `check` over `cases` inputs of `strategy`, in a thread of its own so that a
/// case that never returns is reported as a hang after `opts.deadline` (its thread
/// is left behind). Each case runs under `catch_unwind`: a panic is a failure, and
/// so is a case slower than `opts.case_budget`. proptest shrinks a failure to a
/// minimal input. `make` builds the strategy and the check inside that thread.
pub fn drive<S, C, M>(name: &str, opts: &Options, make: M) -> Report
where
    M: FnOnce() -> (S, C) + Send + 'static,
    S: Strategy,
    S::Value: Debug,
    C: Fn(&S::Value) -> Verdict,
{
    let current = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    let (o, cur, label) = (opts.clone(), Arc::clone(&current), name.to_string());
    let t0 = Instant::now();
    quiet_fuzz_panics();
    PeakAlloc::reset();
    let spawned = std::thread::Builder::new().name(format!("fuzz-{name}")).spawn(move || {
        let (strategy, check) = make();
        let _ = tx.send(run_cases(&label, &o, &strategy, &check, &cur));
    });
    let mut report = match spawned {
        Err(e) => Report::failed(name, opts.cases, format!("cannot start the fuzz thread: {e}"), String::new()),
        Ok(_) => match rx.recv_timeout(opts.deadline) {
            Ok(r) => r,
            Err(_) => {
                let input = current.lock().map(|s| s.clone()).unwrap_or_default();
                Report::failed(name, opts.cases, format!("hang: no result after {:?}", opts.deadline), input)
            }
        },
    };
    report.elapsed = t0.elapsed();
    report.largest_alloc = PeakAlloc::peak();
    report
}

impl Report {
    fn failed(name: &str, cases: u32, reason: String, input: String) -> Report {
        Report {
            name: name.into(),
            cases,
            outcomes: BTreeMap::new(),
            failure: Some(Failure { reason, input }),
            elapsed: Duration::ZERO,
            slowest: Duration::ZERO,
            largest_alloc: None,
        }
    }
}

fn run_cases<S, C>(name: &str, opts: &Options, strategy: &S, check: &C, current: &Mutex<String>) -> Report
where
    S: Strategy,
    S::Value: Debug,
    C: Fn(&S::Value) -> Verdict,
{
    let config = Config { cases: opts.cases, failure_persistence: None, max_shrink_iters: 2048, max_shrink_time: 60_000, ..Config::default() };
    let mut seed = [0u8; 32];
    seed[..8].copy_from_slice(&opts.seed.to_le_bytes());
    let mut runner = TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &seed));
    let outcomes = RefCell::new(BTreeMap::<String, u64>::new());
    let slowest = Cell::new(Duration::ZERO);
    // Shrinking re-runs cases; only those before the first failure are counted.
    let failed = Cell::new(false);
    let result = runner.run(strategy, |input| {
        if let Ok(mut c) = current.lock() {
            *c = format!("{input:?}");
        }
        let t = Instant::now();
        let verdict = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&input)));
        let took = t.elapsed();
        let verdict = match verdict {
            Err(p) => Err(format!("panic: {}", panic_text(&*p))),
            Ok(Ok(_)) if took > opts.case_budget => Err(format!("took {took:?}, over the {:?} budget of one case", opts.case_budget)),
            Ok(v) => v,
        };
        match verdict {
            Ok(class) => {
                if !failed.get() {
                    *outcomes.borrow_mut().entry(class).or_default() += 1;
                    slowest.set(slowest.get().max(took));
                }
                Ok(())
            }
            Err(reason) => {
                failed.set(true);
                Err(TestCaseError::fail(reason))
            }
        }
    });
    let failure = match result {
        Ok(()) => None,
        Err(TestError::Fail(reason, input)) => Some(Failure { reason: reason.to_string(), input: format!("{input:?}") }),
        Err(TestError::Abort(reason)) => Some(Failure { reason: format!("aborted: {reason}"), input: String::new() }),
    };
    Report {
        name: name.into(),
        cases: opts.cases,
        outcomes: outcomes.into_inner(),
        failure,
        elapsed: Duration::ZERO,
        slowest: slowest.get(),
        largest_alloc: None,
    }
}

/// Runs one target.
pub fn run(target: Target, opts: &Options) -> Report {
    match target {
        Target::Topology => drive(target.name(), opts, || (topology_input(), |i: &TomlInput| check_topology(&i.text()))),
        Target::Wire => drive(target.name(), opts, || (line_input(), |i: &LineInput| check_line(i))),
        Target::Frames => {
            let consumer = match FrameConsumer::new() {
                Ok(c) => Arc::new(c),
                Err(e) => return Report::failed(target.name(), opts.cases, format!("cannot start the consumer: {e}"), String::new()),
            };
            let c = Arc::clone(&consumer);
            let mut report = drive(target.name(), opts, move || (frame_case(), move |case: &FrameCase| c.check(case)));
            // After every case, the consumer still serves a correct producer.
            if report.failure.is_none() {
                match consumer.healthy() {
                    Ok(()) => *report.outcomes.entry("healthy after the run".into()).or_default() += 1,
                    Err(reason) => report.failure = Some(Failure { reason: format!("after the run: {reason}"), input: String::new() }),
                }
            }
            report
        }
        Target::Layouts => drive(target.name(), opts, || {
            let topo = small_topology();
            (layout_case(), move |c: &LayoutCase| check_layout(&topo, c))
        }),
        Target::Http => drive(target.name(), opts, || {
            let topo = Topology::parse(handoff::roles::up::DEFAULT_CONFIG).expect("the built-in topology is valid");
            (body_input(), move |i: &BodyInput| check_body(&topo, i))
        }),
    }
}
