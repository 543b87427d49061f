//! Robust input: property drivers that feed arbitrary bytes and structured mutations
//! of valid encodings to every reader of what a user or a peer wrote: the topology
//! file, the JSON-line control messages between roles, the tcp transport's binary
//! frames, and the OpenAI request bodies.
//!
//! Each case must end in a clean outcome (accepted or refused with a message), within
//! a time budget, without a panic; valid encodings must be accepted. The same drivers
//! serve the CI test (`tests/robust_input.rs`, a bounded number of cases, asserting)
//! and `handoff bench fuzz` (many cases, printing).
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

use crate::roles::openai::{self, BodyError, Endpoint};
use crate::roles::sampling::Sampling;
use crate::roles::wire::{self, Admitted, Msg, Notice, PrefillJob, Register};
use crate::transport::tcp::wire as frames;
use crate::transport::{MemoryKind, PeerAddr, RegionHandle, TcpOptions, TcpTransport, Transport};
use handoff_components::Topology;
use handoff_components::config::ConfigError;
use handoff_components::ecs::{PhaseName, StageReport};
use handoff_components::layout::ConsumerLayout;
use handoff_components::plan::Descriptor;
use handoff_components::vocab::{DecodeRank, PrefillRank, RankId, RegionKind};
use handoff_systems::placement::{Capacity, place_rank};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};
use serde_json::{Value, json};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::io::{Cursor, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    pub const ALL: [Target; 5] = [Target::Topology, Target::Wire, Target::Frames, Target::Http, Target::Layouts];

    pub const fn name(self) -> &'static str {
        match self {
            Target::Topology => "topology",
            Target::Wire => "wire",
            Target::Frames => "frames",
            Target::Http => "http",
            Target::Layouts => "layouts",
        }
    }

    pub fn from_name(s: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name() == s)
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
            let topo = Topology::parse(crate::roles::up::DEFAULT_CONFIG).expect("the built-in topology is valid");
            (body_input(), move |i: &BodyInput| check_body(&topo, i))
        }),
    }
}

// ---- topology files ----

/// The shipped topology files, the seeds of the structured mutations.
pub const SHIPPED_CONFIGS: [(&str, &str); 6] = [
    ("k3-pp8-tp8dcp8.toml", include_str!("../config/k3-pp8-tp8dcp8.toml")),
    ("medium.toml", include_str!("../config/medium.toml")),
    ("pp3-tp2-to-tp4dcp2.toml", include_str!("../config/pp3-tp2-to-tp4dcp2.toml")),
    ("small.toml", include_str!("../config/small.toml")),
    ("trained.toml", include_str!("../config/trained.toml")),
    ("trained-pp4-tp4dcp4.toml", include_str!("../config/trained-pp4-tp4dcp4.toml")),
];

/// One edit of a topology file's lines. Indices are taken modulo what exists.
#[derive(Debug, Clone)]
pub enum TomlEdit {
    /// The value of the n-th `key = value` line.
    Set {
        line: usize,
        value: String,
    },
    Drop {
        line: usize,
    },
    Duplicate {
        line: usize,
    },
    /// A key the schema does not have, or one of another table, after a line.
    AddKey {
        line: usize,
        key: String,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Truncate {
        at: usize,
    },
}

/// A topology file to parse.
#[derive(Debug, Clone)]
pub enum TomlInput {
    Bytes(Vec<u8>),
    Mutated { base: usize, edits: Vec<TomlEdit> },
}

impl TomlInput {
    pub fn text(&self) -> String {
        match self {
            TomlInput::Bytes(b) => String::from_utf8_lossy(b).into_owned(),
            TomlInput::Mutated { base, edits } => mutate_toml(SHIPPED_CONFIGS[base % SHIPPED_CONFIGS.len()].1, edits),
        }
    }
}

fn is_assignment(l: &str) -> bool {
    let t = l.trim_start();
    !t.starts_with('#') && !t.starts_with('[') && t.contains('=')
}

/// Applies the edits to a file's text, in order.
pub fn mutate_toml(base: &str, edits: &[TomlEdit]) -> String {
    let mut lines: Vec<String> = base.lines().map(str::to_string).collect();
    let assignment = |lines: &[String], n: usize| -> Option<usize> {
        let idx: Vec<usize> = (0..lines.len()).filter(|&i| is_assignment(&lines[i])).collect();
        (!idx.is_empty()).then(|| idx[n % idx.len()])
    };
    let mut text = None::<String>;
    for e in edits {
        // Byte-level edits work on the joined text; line edits after one see its lines.
        if let Some(t) = text.take() {
            lines = t.lines().map(str::to_string).collect();
        }
        match e {
            TomlEdit::Set { line, value } => {
                if let Some(i) = assignment(&lines, *line) {
                    let key = lines[i].split('=').next().unwrap_or("").to_string();
                    lines[i] = format!("{key}= {value}");
                }
            }
            TomlEdit::Drop { line } => {
                if let Some(i) = assignment(&lines, *line) {
                    lines.remove(i);
                }
            }
            TomlEdit::Duplicate { line } => {
                if let Some(i) = assignment(&lines, *line) {
                    let l = lines[i].clone();
                    lines.insert(i + 1, l);
                }
            }
            TomlEdit::AddKey { line, key } => {
                let i = if lines.is_empty() { 0 } else { line % lines.len() + 1 };
                lines.insert(i.min(lines.len()), format!("{key} = 1"));
            }
            TomlEdit::Insert { at, bytes } => {
                let mut t = lines.join("\n").into_bytes();
                let at = at % (t.len() + 1);
                t.splice(at..at, bytes.iter().copied());
                text = Some(String::from_utf8_lossy(&t).into_owned());
            }
            TomlEdit::Truncate { at } => {
                let t = lines.join("\n");
                let mut at = at % (t.len() + 1);
                while !t.is_char_boundary(at) {
                    at -= 1;
                }
                text = Some(t[..at].to_string());
            }
        }
    }
    text.unwrap_or_else(|| lines.join("\n"))
}

/// Values a field of a topology file may be set to: edges of every integer type,
/// floats where integers go, other TOML types, and ordinary small numbers.
fn toml_value() -> impl Strategy<Value = String> {
    // Most fields are counts: integer edges reach validation, the rest the parser.
    let counts = prop::sample::select(vec![
        "0",
        "1",
        "2",
        "3",
        "4",
        "5",
        "7",
        "8",
        "16",
        "64",
        "4096",
        "4097",
        "65537",
        "1000000",
        "4294967295",
        "1e300",
        "0.001",
        "-1",
    ])
    .prop_map(str::to_string);
    let fixed = prop::sample::select(vec![
        "-1",
        "4294967296",
        "2147483648",
        "9223372036854775807",
        "-9223372036854775808",
        "99999999999999999999",
        "-1e300",
        "1.5",
        "-0.0",
        "nan",
        "inf",
        "-inf",
        "true",
        "\"\"",
        "\"K\"",
        "\"M\"",
        "\"KKKM\"",
        "\"MX\"",
        "\"tcp\"",
        "\"shm\"",
        "\"cuda:99999999999\"",
        "[]",
        "[0]",
        "[1, 1]",
        "[4294967295, 4294967295]",
        "{}",
        "{ a = 1 }",
        "1979-05-27",
        "'''\nx'''",
    ])
    .prop_map(str::to_string);
    prop_oneof![
        6 => counts,
        2 => fixed,
        1 => any::<u32>().prop_map(|x| x.to_string()),
        1 => any::<i64>().prop_map(|x| x.to_string()),
        1 => (1u32..=9).prop_map(|k| (1u64 << (k * 4)).to_string()),
        1 => prop::collection::vec(prop::sample::select(vec!['K', 'M', 'x']), 0..12).prop_map(|v| format!("\"{}\"", v.into_iter().collect::<String>())),
        1 => prop::collection::vec(0u32..80, 0..10).prop_map(|v| format!("{v:?}")),
    ]
}

fn toml_edit() -> impl Strategy<Value = TomlEdit> {
    prop_oneof![
        // Other edits mostly make a file TOML or the schema refuses; values reach validation.
        16 => (any::<usize>(), toml_value()).prop_map(|(line, value)| TomlEdit::Set { line, value }),
        1 => any::<usize>().prop_map(|line| TomlEdit::Drop { line }),
        1 => any::<usize>().prop_map(|line| TomlEdit::Duplicate { line }),
        1 => (any::<usize>(), prop::sample::select(vec!["bogus", "pp", "[model]", "[prefill]\npp", "model.mla.heads", "\"q\""]))
            .prop_map(|(line, key)| TomlEdit::AddKey { line, key: key.to_string() }),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..8)).prop_map(|(at, bytes)| TomlEdit::Insert { at, bytes }),
        1 => any::<usize>().prop_map(|at| TomlEdit::Truncate { at }),
    ]
}

pub fn topology_input() -> impl Strategy<Value = TomlInput> {
    prop_oneof![
        1 => prop::collection::vec(any::<u8>(), 0..256).prop_map(TomlInput::Bytes),
        8 => (0..SHIPPED_CONFIGS.len(), prop::collection::vec(toml_edit(), 0..3)).prop_map(|(base, edits)| TomlInput::Mutated { base, edits }),
    ]
}

/// A topology text: refused with a message, or valid and every figure `handoff
/// check` prints and every serving-capacity layout derivable without overflow.
pub fn check_topology(text: &str) -> Verdict {
    let topo = match Topology::parse(text) {
        Err(e) => {
            let msg = e.to_string();
            if msg.trim().is_empty() {
                return Err(format!("refusal without a message: {e:?}"));
            }
            let class = match e {
                ConfigError::Parse { .. } => "refused: parse",
                ConfigError::Zero { .. } => "refused: zero",
                ConfigError::TooLarge { .. } | ConfigError::TimeoutTooLong { .. } | ConfigError::Footprint { .. } => "refused: too large",
                _ => "refused: inconsistent",
            };
            return Ok(class.into());
        }
        Ok(t) => t,
    };
    let m = topo.model();
    if topo.layer_kinds.len() != m.num_layers as usize {
        return Err(format!("{} layer kinds for {} layers", topo.layer_kinds.len(), m.num_layers));
    }
    let mut next = 0;
    for r in &topo.stage_layers {
        if r.start != next || r.end <= r.start {
            return Err(format!("stage layers {:?} do not tile 0..{}", topo.stage_layers, m.num_layers));
        }
        next = r.end;
    }
    if next != m.num_layers || topo.stage_layers.len() != topo.prefill().pp as usize {
        return Err(format!("stage layers {:?} do not tile 0..{} in {} stages", topo.stage_layers, m.num_layers, topo.prefill().pp));
    }
    let summary = crate::cli::summary(&topo, "<fuzz>");
    if !summary.contains(": ok") {
        return Err(format!("summary of an accepted topology does not say ok: {summary}"));
    }
    let cap = Capacity::serving(&topo);
    for rank in [RankId::Prefill(PrefillRank { pp: topo.prefill().pp - 1, tp: 0 }), RankId::Decode(DecodeRank { tp: topo.decode().tp - 1 })] {
        let blocks = if matches!(rank, RankId::Prefill(_)) { cap.prefill_blocks } else { cap.decode_blocks };
        for r in place_rank(&topo, rank, blocks, cap.slots).regions {
            // A paged region's length, recomputed in u128: a wrapped u64 differs.
            let per_row = u128::from(r.units) * u128::from(r.unit_bytes);
            if r.kind.is_paged() && u128::from(r.len) != r.rows.len() as u128 * per_row {
                return Err(format!("{rank:?} {}: len {} but {} rows of {per_row} B", r.kind.name(), r.len, r.rows.len()));
            }
        }
    }
    Ok("accepted".into())
}

// ---- control messages ----

/// Valid encodings of every message kind, each with the decoder that reads it.
pub fn valid_lines() -> Vec<(&'static str, Vec<u8>)> {
    let topo = small_topology();
    let layout = place_rank(&topo, RankId::Decode(DecodeRank { tp: 0 }), 4, 2);
    let consumer = ConsumerLayout { rank: DecodeRank { tp: 0 }, tp: 2, dcp: 2, interleave: 1, blocks: vec![0, 3], slot: 1, layout };
    let endpoint = PeerAddr::Tcp { addr: SocketAddr::from(([127, 0, 0, 1], 4000)) };
    let handle = RegionHandle {
        peer: endpoint.clone(),
        id: 7,
        rank: RankId::Decode(DecodeRank { tp: 1 }),
        kind: RegionKind::KdaConv,
        len: 4096,
        memory: MemoryKind::Host,
        ipc: None,
    };
    let admitted = Admitted { id: 5, nonce: 9, consumers: vec![consumer], handles: vec![handle], endpoint };
    let sampling = Some(Sampling { temperature: 0.7, top_p: 0.9, seed: u64::MAX, choice: 3 });
    let job = PrefillJob {
        admitted: admitted.clone(),
        prompt: b"hello".to_vec(),
        stage: 1,
        stages: vec![SocketAddr::from(([127, 0, 0, 1], 4001)), SocketAddr::from(([127, 0, 0, 1], 4002))],
        hidden: Some(vec![0.5, -1.0, f32::MIN_POSITIVE, 3.0e9]),
        sampling,
    };
    let msgs = [
        Msg::Admit { id: 1, prompt_tokens: 12, max_tokens: 4, sampling: None },
        Msg::Admit { id: 2, prompt_tokens: 1, max_tokens: 1, sampling },
        Msg::Admitted(Box::new(admitted)),
        Msg::Token { id: 3, token: 255 },
        Msg::Done { id: 3, handoff_ms: 1.5, decode_ms: 0.25, bytes: 1 << 40 },
        Msg::Error { id: 4, phase: PhaseName::Transfer, message: "stage 1 died".into() },
        Msg::Cancel { id: 4, phase: PhaseName::Admission, message: "client left".into(), unsent: true },
        Msg::Prefill(Box::new(job)),
        Msg::StageDown { stage: 2, dead: true, message: "exited".into() },
    ];
    let mut out: Vec<(&'static str, Vec<u8>)> = msgs
        .iter()
        .map(|m| {
            let mut line = Vec::new();
            wire::encode_into(&mut line, m).expect("encode");
            ("msg", line)
        })
        .collect();
    let report =
        StageReport { request: 5, nonce: 9, stage: 0, pairs: vec![(PrefillRank { pp: 0, tp: 0 }, DecodeRank { tp: 1 })], first_token: Some(b'a'), bytes: 4096 };
    for n in [Notice::Written(report), Notice::Failed { id: 5, nonce: None, stage: 1, phase: PhaseName::Compute, message: "oom".into() }] {
        out.push(("notice", serde_json::to_vec(&n).expect("encode")));
    }
    let reg = Register {
        role: "prefill".into(),
        stage: Some(1),
        addr: SocketAddr::from(([127, 0, 0, 1], 4003)),
        pid: 42,
        counts: Default::default(),
        rss_bytes: 1 << 30,
        restarts: 2,
        timings: vec![crate::roles::prom::SystemTiming {
            system: "dispatch::run_decode".into(),
            phase: "dispatch".into(),
            cumulative: vec![1, 2],
            count: 2,
            sum_s: 1e-3,
        }],
        unauthenticated: [("tcp".to_string(), 3u64)].into_iter().collect(),
    };
    out.push(("register", serde_json::to_vec(&reg).expect("encode")));
    out
}

/// One edit of a JSON text. Indices are taken modulo what exists.
#[derive(Debug, Clone)]
pub enum JsonEdit {
    Flip {
        at: usize,
        xor: u8,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Truncate {
        at: usize,
    },
    /// The n-th number literal becomes another.
    Number {
        nth: usize,
        literal: String,
    },
    /// The n-th string literal becomes a long one.
    LongString {
        nth: usize,
        len: usize,
    },
    /// The n-th string literal becomes another JSON value (a type change).
    Retype {
        nth: usize,
        value: String,
    },
}

/// Bytes handed to a decoder.
#[derive(Debug, Clone)]
pub enum LineInput {
    Bytes(Vec<u8>),
    Mutated {
        seed: usize,
        edits: Vec<JsonEdit>,
    },
    /// `depth` nested arrays or objects.
    Nested {
        depth: usize,
        object: bool,
    },
    /// Several lines in a row, some valid, one stream.
    Stream {
        seeds: Vec<usize>,
    },
}

fn spans(text: &[u8], number: bool) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < text.len() {
        let c = text[i];
        if number && (c.is_ascii_digit() || c == b'-') && (i == 0 || !text[i - 1].is_ascii_alphanumeric()) {
            let s = i;
            while i < text.len() && (text[i].is_ascii_digit() || b"-+.eE".contains(&text[i])) {
                i += 1;
            }
            out.push((s, i));
            continue;
        }
        if !number && c == b'"' {
            let s = i;
            i += 1;
            while i < text.len() && text[i] != b'"' {
                i += if text[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(text.len());
            out.push((s, i));
            continue;
        }
        i += 1;
    }
    out
}

pub fn mutate_json(base: &[u8], edits: &[JsonEdit]) -> Vec<u8> {
    let mut t = base.to_vec();
    for e in edits {
        match e {
            JsonEdit::Flip { at, xor } => {
                if !t.is_empty() {
                    let i = at % t.len();
                    t[i] ^= xor | 1;
                }
            }
            JsonEdit::Insert { at, bytes } => {
                let i = at % (t.len() + 1);
                t.splice(i..i, bytes.iter().copied());
            }
            JsonEdit::Truncate { at } => t.truncate(at % (t.len() + 1)),
            JsonEdit::Number { nth, literal } => {
                let s = spans(&t, true);
                if !s.is_empty() {
                    let (a, b) = s[nth % s.len()];
                    t.splice(a..b, literal.bytes());
                }
            }
            JsonEdit::LongString { nth, len } => {
                let s = spans(&t, false);
                if !s.is_empty() {
                    let (a, b) = s[nth % s.len()];
                    let long = format!("\"{}\"", "x".repeat(*len));
                    t.splice(a..b, long.bytes());
                }
            }
            JsonEdit::Retype { nth, value } => {
                let s = spans(&t, false);
                if !s.is_empty() {
                    let (a, b) = s[nth % s.len()];
                    t.splice(a..b, value.bytes());
                }
            }
        }
    }
    t
}

fn json_literal() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec![
            "0", "-1", "-0", "1e999", "-1e999", "1e-999", "0.5", "255", "256", "4294967295", "4294967296",
            "18446744073709551615", "18446744073709551616", "-9223372036854775809", "NaN", "Infinity", "null",
            "true", "\"1\"", "[]", "{}", "[1,2,3]", "{\"a\":1}",
        ])
        .prop_map(str::to_string),
        1 => any::<i64>().prop_map(|x| x.to_string()),
        1 => any::<u64>().prop_map(|x| x.to_string()),
        1 => any::<f64>().prop_map(|x| format!("{x:e}")),
    ]
}

fn json_edit() -> impl Strategy<Value = JsonEdit> {
    prop_oneof![
        2 => (any::<usize>(), any::<u8>()).prop_map(|(at, xor)| JsonEdit::Flip { at, xor }),
        2 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..6)).prop_map(|(at, bytes)| JsonEdit::Insert { at, bytes }),
        1 => (any::<usize>(), prop::sample::select(vec![&b"\n"[..], b"{", b"}", b"\"", b"\\", b"\xff", b"\0", b",", b"]"]))
            .prop_map(|(at, b)| JsonEdit::Insert { at, bytes: b.to_vec() }),
        2 => any::<usize>().prop_map(|at| JsonEdit::Truncate { at }),
        4 => (any::<usize>(), json_literal()).prop_map(|(nth, literal)| JsonEdit::Number { nth, literal }),
        1 => (any::<usize>(), 0usize..100_000).prop_map(|(nth, len)| JsonEdit::LongString { nth, len }),
        3 => (any::<usize>(), json_literal()).prop_map(|(nth, value)| JsonEdit::Retype { nth, value }),
    ]
}

pub fn line_input() -> impl Strategy<Value = LineInput> {
    let seeds = valid_lines().len();
    prop_oneof![
        2 => prop::collection::vec(any::<u8>(), 0..256).prop_map(LineInput::Bytes),
        8 => (0..seeds, prop::collection::vec(json_edit(), 0..4)).prop_map(|(seed, edits)| LineInput::Mutated { seed, edits }),
        1 => (1usize..20_000, any::<bool>()).prop_map(|(depth, object)| LineInput::Nested { depth, object }),
        1 => prop::collection::vec(0..seeds, 1..6).prop_map(|seeds| LineInput::Stream { seeds }),
    ]
}

fn nested(depth: usize, object: bool) -> Vec<u8> {
    let (open, close): (&[u8], &[u8]) = if object { (b"{\"a\":", b"}") } else { (b"[", b"]") };
    let mut t = Vec::with_capacity(depth * (open.len() + 1) + 8);
    t.extend_from_slice(b"{\"type\":\"admit\",\"id\":");
    for _ in 0..depth {
        t.extend_from_slice(open);
    }
    t.push(b'1');
    for _ in 0..depth {
        t.extend_from_slice(close);
    }
    t.push(b'}');
    t
}

/// Reads every message of a stream as a role does; `Ok` with how many decoded.
fn read_stream(bytes: &[u8]) -> std::result::Result<(usize, usize), String> {
    let mut r = Cursor::new(bytes);
    let (mut ok, mut bad) = (0, 0);
    // Each read consumes at least one byte, so this many reads end any stream.
    for _ in 0..=bytes.len() {
        match wire::recv(&mut r) {
            Ok(None) => return Ok((ok, bad)),
            Ok(Some(_)) => ok += 1,
            // A role gives the link up at a bad line; the test reads on to cover
            // every line of the stream.
            Err(e) => {
                if e.to_string().is_empty() {
                    return Err("an error without a message".into());
                }
                bad += 1;
            }
        }
    }
    Err(format!("{} reads did not end a stream of {} bytes", bytes.len() + 1, bytes.len()))
}

/// Every decoder of what roles send one another: no panic, and a valid encoding
/// decodes (to a message that re-encodes to the same bytes).
pub fn check_line(input: &LineInput) -> Verdict {
    let seeds = valid_lines();
    let (bytes, valid) = match input {
        LineInput::Bytes(b) => (b.clone(), None),
        LineInput::Mutated { seed, edits } => {
            let (kind, line) = &seeds[seed % seeds.len()];
            (mutate_json(line, edits), edits.is_empty().then_some(*kind))
        }
        LineInput::Nested { depth, object } => (nested(*depth, *object), None),
        LineInput::Stream { seeds: picks } => {
            let msg: Vec<&Vec<u8>> = seeds.iter().filter(|(k, _)| *k == "msg").map(|(_, l)| l).collect();
            let mut b = Vec::new();
            for p in picks {
                b.extend_from_slice(msg[p % msg.len()]);
            }
            let (ok, _) = read_stream(&b)?;
            if ok != picks.len() {
                return Err(format!("a stream of {} valid lines decoded {ok}", picks.len()));
            }
            return Ok("stream decoded".into());
        }
    };
    let (ok, _) = read_stream(&bytes)?;
    let msg = serde_json::from_slice::<Msg>(&bytes);
    let notice = serde_json::from_slice::<Notice>(&bytes);
    let register = serde_json::from_slice::<Register>(&bytes);
    match valid {
        Some("msg") => {
            let m = msg.map_err(|e| format!("a valid message was refused: {e}"))?;
            let mut again = Vec::new();
            wire::encode_into(&mut again, &m).map_err(|e| e.to_string())?;
            if again != bytes {
                return Err(format!("re-encoding differs: {}", String::from_utf8_lossy(&again)));
            }
            if ok != 1 {
                return Err("recv did not decode a valid line".into());
            }
        }
        Some("notice") => {
            notice.map_err(|e| format!("a valid notice was refused: {e}"))?;
        }
        Some(_) => {
            register.map_err(|e| format!("a valid registration was refused: {e}"))?;
        }
        None => {}
    }
    Ok(if valid.is_some() {
        "valid, decoded"
    } else if ok > 0 {
        "mutated, decoded"
    } else {
        "mutated, refused"
    }
    .into())
}

// ---- transport frames ----

/// One descriptor as a peer may send it.
#[derive(Debug, Clone)]
pub struct DescSpec {
    /// A region kind code (the region's own, mostly).
    pub kind: u8,
    pub dst_offset: u64,
    pub len: u64,
    pub count: u32,
    pub dst_stride: u64,
}

/// One frame as a peer may send it; `None` fields take the value a correct peer sends.
#[derive(Debug, Clone)]
pub enum FrameSpec {
    Hello {
        len: Option<u32>,
        json: Option<Vec<u8>>,
    },
    Write {
        descs: Vec<DescSpec>,
        region_ok: bool,
        ndesc: Option<u32>,
        payload: Option<u64>,
    },
    Notify {
        bytes: Vec<u8>,
        len: Option<u32>,
    },
    /// A frame type no peer sends, or a bad magic.
    Junk {
        magic_ok: bool,
        ty: u8,
    },
}

/// One connection's bytes: a hello, frames, and maybe a byte-level edit of the lot.
#[derive(Debug, Clone)]
pub struct FrameCase {
    pub frames: Vec<FrameSpec>,
    pub flip: Option<(usize, u8)>,
    pub truncate: Option<usize>,
}

/// The region the fuzzed consumer holds: its kind and length.
const FRAME_REGION: (RegionKind, u64) = (RegionKind::MlaKv, 4096);
/// Most payload bytes a case sends (a claimed payload past it is cut short).
const FRAME_PAYLOAD_CAP: u64 = 64 << 10;

fn u64_edge() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 0u64..=4096,
        1 => prop::sample::select(vec![0, 1, 4095, 4096, 4097, u32::MAX as u64, 1 << 32, u64::MAX / 2, u64::MAX - 1, u64::MAX]),
        1 => any::<u64>(),
    ]
}

fn u32_edge() -> impl Strategy<Value = u32> {
    prop_oneof![
        4 => 0u32..=8,
        1 => prop::sample::select(vec![0, 1, 2, 1 << 16, frames::MAX_DESCRIPTORS, frames::MAX_DESCRIPTORS + 1, frames::MAX_NOTIFY, u32::MAX - 1, u32::MAX]),
        1 => any::<u32>(),
    ]
}

fn desc_spec() -> impl Strategy<Value = DescSpec> {
    let kind = prop_oneof![6 => Just(frames::kind_code(FRAME_REGION.0)), 1 => any::<u8>()];
    // Mostly small and in bounds, so that valid batches are common.
    let small = (0u64..4096, 0u64..=256, 1u32..=4, 0u64..=512).prop_map(|(o, l, c, s)| (o, l, c, s));
    let edge = (u64_edge(), u64_edge(), u32_edge(), u64_edge());
    // Stride 0 repeats one range (it passes the bounds check whatever the count):
    // the shape that reaches the payload reader with a peer-chosen piece count.
    let repeat = (0u64..4096, prop_oneof![Just(0u64), 1u64..=64], u32_edge()).prop_map(|(o, l, c)| (o, l, c, 0));
    (kind, prop_oneof![3 => small, 1 => edge, 1 => repeat]).prop_map(|(kind, (dst_offset, len, count, dst_stride))| DescSpec {
        kind,
        dst_offset,
        len,
        count,
        dst_stride,
    })
}

fn frame_spec() -> impl Strategy<Value = FrameSpec> {
    let opt_u32 = || prop_oneof![4 => Just(None), 1 => u32_edge().prop_map(Some)];
    prop_oneof![
        1 => (opt_u32(), prop_oneof![4 => Just(None), 1 => prop::collection::vec(any::<u8>(), 0..24).prop_map(Some)])
            .prop_map(|(len, json)| FrameSpec::Hello { len, json }),
        5 => (
            prop::collection::vec(desc_spec(), 0..5),
            prop_oneof![6 => Just(true), 1 => Just(false)],
            opt_u32(),
            prop_oneof![5 => Just(None), 1 => u64_edge().prop_map(Some)],
        )
            .prop_map(|(descs, region_ok, ndesc, payload)| FrameSpec::Write { descs, region_ok, ndesc, payload }),
        2 => (prop::collection::vec(any::<u8>(), 0..64), opt_u32()).prop_map(|(bytes, len)| FrameSpec::Notify { bytes, len }),
        1 => (any::<bool>(), any::<u8>()).prop_map(|(magic_ok, ty)| FrameSpec::Junk { magic_ok, ty }),
    ]
}

pub fn frame_case() -> impl Strategy<Value = FrameCase> {
    (
        prop::collection::vec(frame_spec(), 1..5),
        prop_oneof![5 => Just(None), 1 => (any::<usize>(), 1u8..=255).prop_map(Some)],
        prop_oneof![5 => Just(None), 1 => any::<usize>().prop_map(Some)],
    )
        .prop_map(|(frames, flip, truncate)| FrameCase { frames, flip, truncate })
}

/// What a correct consumer does with a case's bytes.
#[derive(Debug, Default, PartialEq)]
struct Expected {
    /// One entry per WRITE it acks before the first malformed frame: whether the
    /// ack is a success.
    acks: Vec<bool>,
    notices: Vec<Vec<u8>>,
    /// Every frame is well-formed: no incident may be recorded.
    clean: bool,
    /// The first malformed frame is one the consumer must refuse where it stands
    /// (bad magic or type, a count past its limit, a payload that disagrees with
    /// its descriptors or ends early): an incident, and nothing read past it. A
    /// wrong length field makes what follows ambiguous, so it predicts less.
    definite: bool,
}

/// A live tcp consumer with one registered region, fed one connection per case.
pub struct FrameConsumer {
    transport: TcpTransport,
    region: RegionHandle,
}

/// The endpoint the fuzzed producer says it is.
const FRAME_PEER: PeerAddr = PeerAddr::Tcp { addr: SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 1)), 1) };

impl FrameConsumer {
    pub fn new() -> crate::transport::Result<FrameConsumer> {
        // A short idle timeout: a case that leaves a frame half-sent is ended by
        // the consumer, not by the case's deadline.
        let opts = TcpOptions { idle_timeout: Duration::from_secs(1), io_chunk: 256 << 10, ..TcpOptions::default() };
        let transport = TcpTransport::bind(opts)?;
        let region = transport.register_memory(RankId::Decode(DecodeRank { tp: 0 }), FRAME_REGION.0, FRAME_REGION.1, MemoryKind::Host)?;
        Ok(FrameConsumer { transport, region })
    }

    pub fn transport(&self) -> &TcpTransport {
        &self.transport
    }

    pub fn region(&self) -> &RegionHandle {
        &self.region
    }

    /// The bytes of a case, and what a correct consumer answers when they are sent
    /// unedited (`None` when they were edited: anything clean goes).
    fn encode(&self, case: &FrameCase) -> (Vec<u8>, Option<Expected>) {
        // The HELLO that answers the consumer's challenge goes first ([`Self::check`]).
        let mut out = Vec::new();
        let me = FRAME_PEER;
        let mut exp = Expected { clean: true, ..Default::default() };
        for (batch, f) in case.frames.iter().enumerate() {
            if !exp.clean {
                // Past a malformed frame the consumer reads nothing more.
                break;
            }
            match f {
                FrameSpec::Hello { len, json } => {
                    let body = json.clone().unwrap_or_else(|| serde_json::to_vec(&me).expect("json"));
                    out.extend_from_slice(&frames::MAGIC.to_le_bytes());
                    out.push(frames::HELLO);
                    let n = len.unwrap_or(body.len() as u32);
                    out.extend_from_slice(&n.to_le_bytes());
                    out.extend_from_slice(&body);
                    // Past the handshake a HELLO is no frame of the stream: the
                    // consumer refuses it where it stands, whatever its length.
                    let _ = n;
                    (exp.clean, exp.definite) = (false, true);
                }
                FrameSpec::Notify { bytes, len } => {
                    out.extend_from_slice(&frames::MAGIC.to_le_bytes());
                    out.push(frames::NOTIFY);
                    let n = len.unwrap_or(bytes.len() as u32);
                    out.extend_from_slice(&n.to_le_bytes());
                    out.extend_from_slice(bytes);
                    if n > frames::MAX_NOTIFY {
                        (exp.clean, exp.definite) = (false, true);
                    } else if n as usize == bytes.len() {
                        exp.notices.push(bytes.clone());
                    } else {
                        exp.clean = false;
                    }
                }
                FrameSpec::Junk { magic_ok, ty } => {
                    let magic = if *magic_ok { frames::MAGIC } else { frames::MAGIC ^ 0x0101 };
                    out.extend_from_slice(&magic.to_le_bytes());
                    out.push(*ty);
                    exp.clean = false;
                    // A WRITE or NOTIFY type after a good magic is a frame like the
                    // others; any other type (HELLO and CHALLENGE only open a
                    // connection, ACK goes the other way) is refused where it stands.
                    exp.definite = !*magic_ok || !(*ty == frames::WRITE || *ty == frames::NOTIFY);
                    if !exp.definite {
                        continue;
                    }
                }
                FrameSpec::Write { descs, region_ok, ndesc, payload } => {
                    let region = if *region_ok { self.region.id } else { self.region.id + 1000 };
                    let real: Vec<Descriptor> = descs
                        .iter()
                        .map(|d| Descriptor {
                            kind: frames::kind_from_code(d.kind).unwrap_or(RegionKind::MlaKv),
                            src_offset: 0,
                            src_stride: 0,
                            dst_offset: d.dst_offset,
                            len: d.len,
                            count: d.count,
                            dst_stride: d.dst_stride,
                        })
                        .collect();
                    let covered = real.iter().try_fold(0u64, |a, d| a.checked_add(d.len.checked_mul(u64::from(d.count))?));
                    let claimed = payload.or(covered).unwrap_or(u64::MAX);
                    let at = out.len();
                    frames::write_batch_header(&mut out, batch as u64 + 1, region, &real, claimed).expect("header");
                    // The real encoder writes kind codes of real kinds; put the spec's back.
                    for (i, d) in descs.iter().enumerate() {
                        out[at + 5 + 28 + i * frames::DESC_BYTES] = d.kind;
                    }
                    if let Some(n) = ndesc {
                        out[at + 5 + 16..at + 5 + 20].copy_from_slice(&n.to_le_bytes());
                    }
                    let sent = claimed.min(FRAME_PAYLOAD_CAP);
                    out.extend((0..sent).map(|i| (i as u8).wrapping_mul(31).wrapping_add(batch as u8)));
                    if ndesc.is_some_and(|n| n > frames::MAX_DESCRIPTORS) {
                        (exp.clean, exp.definite) = (false, true);
                        continue;
                    }
                    if ndesc.is_some_and(|n| n as usize != descs.len()) {
                        exp.clean = false;
                        continue;
                    }
                    let well_formed = descs.iter().all(|d| frames::kind_from_code(d.kind).is_some()) && covered == Some(claimed) && sent == claimed;
                    if !well_formed {
                        (exp.clean, exp.definite) = (false, true);
                        continue;
                    }
                    let fits = real.iter().all(|d| {
                        let end = if d.len == 0 || d.count == 0 {
                            Some(d.dst_offset)
                        } else {
                            (u64::from(d.count) - 1).checked_mul(d.dst_stride).and_then(|x| x.checked_add(d.dst_offset)?.checked_add(d.len))
                        };
                        d.kind == FRAME_REGION.0 && end.is_some_and(|end| end <= FRAME_REGION.1)
                    });
                    exp.acks.push(*region_ok && fits);
                }
            }
        }
        let edited = case.flip.is_some() || case.truncate.is_some();
        if let Some((at, xor)) = case.flip {
            let i = at % out.len();
            out[i] ^= xor;
        }
        if let Some(at) = case.truncate {
            out.truncate(at % (out.len() + 1));
        }
        (out, (!edited).then_some(exp))
    }

    /// Sends one case on a fresh connection, closes the sending side, and reads
    /// the consumer's acks until it closes the connection.
    pub fn check(&self, case: &FrameCase) -> Verdict {
        let _ = self.transport.take_incidents();
        let _ = self.transport.recv_notifications();
        let (bytes, expected) = self.encode(case);
        let mut s = TcpStream::connect(self.transport.addr()).map_err(|e| format!("connect: {e}"))?;
        // The consumer's challenge, and a HELLO that proves the cluster secret: the
        // fuzzed frames are a member's, past the handshake (a stranger's are
        // refused before any frame is read; tests/cluster_secret.rs shows that).
        s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
        let nonce = frames::read_challenge(&mut s).map_err(|e| format!("challenge: {e}"))?;
        let mut hello = Vec::new();
        frames::write_hello(&mut hello, &FRAME_PEER, &crate::auth::ClusterSecret::process(), &nonce).map_err(|e| e.to_string())?;
        s.write_all(&hello).map_err(|e| format!("hello: {e}"))?;
        s.set_read_timeout(Some(Duration::from_millis(50))).map_err(|e| e.to_string())?;
        // The consumer may close first (a malformed frame): a failed write is fine.
        let _ = s.write_all(&bytes);
        let _ = s.shutdown(Shutdown::Write);
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                // A reset: the consumer closed with our bytes unread.
                Err(_) => break,
            }
            if Instant::now() > deadline {
                return Err(format!("the consumer kept the connection open 5 s after the peer's end ({} B of acks)", got.len()));
            }
        }
        let acks = parse_acks(&got)?;
        let incidents = self.transport.take_incidents();
        let notices: Vec<Vec<u8>> = self.transport.recv_notifications().into_iter().map(|n| n.bytes).collect();
        if let Some(exp) = expected {
            let ok: Vec<bool> = acks.iter().map(|a| a.0).collect();
            let exact = exp.clean || exp.definite;
            if (exact && ok != exp.acks) || !ok.starts_with(&exp.acks) {
                return Err(format!("acks {ok:?} (reasons {:?}), a correct consumer sends {:?}", acks.iter().map(|a| &a.1).collect::<Vec<_>>(), exp.acks));
            }
            if (exact && notices != exp.notices) || !notices.starts_with(&exp.notices) {
                return Err(format!("delivered {} notifications, sent {} well-formed", notices.len(), exp.notices.len()));
            }
            if exp.clean && !incidents.is_empty() {
                return Err(format!("a well-formed connection recorded incidents: {incidents:?}"));
            }
            if exp.definite && incidents.is_empty() {
                return Err("a malformed frame recorded no incident".into());
            }
        }
        let class = match (acks.iter().any(|a| a.0), acks.iter().any(|a| !a.0), incidents.is_empty()) {
            (_, _, false) => "dropped (incident)",
            (true, _, true) => "acked",
            (false, true, true) => "rejected",
            (false, false, true) => "closed clean",
        };
        Ok(class.into())
    }

    /// A correct producer can still write the whole region, byte exact.
    pub fn healthy(&self) -> std::result::Result<(), String> {
        let producer = TcpTransport::loopback().map_err(|e| e.to_string())?;
        let (kind, len) = FRAME_REGION;
        let src = producer.register_memory(RankId::Prefill(PrefillRank { pp: 0, tp: 0 }), kind, len, MemoryKind::Host).map_err(|e| e.to_string())?;
        let pattern: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        producer.with_region_mut(&src, &mut |b| b.copy_from_slice(&pattern)).map_err(|e| e.to_string())?;
        let dst = producer.attach(&self.region).map_err(|e| e.to_string())?;
        let batch = producer.submit(&src, dst, &[Descriptor::copy(kind, 0, 0, len)]).map_err(|e| e.to_string())?;
        producer.wait(batch, Duration::from_secs(10)).map_err(|e| e.to_string())?;
        let mut same = false;
        self.transport.with_region(&self.region, &mut |b| same = b == &pattern[..]).map_err(|e| e.to_string())?;
        if !same {
            return Err("the region does not hold the bytes a correct producer wrote".into());
        }
        Ok(())
    }
}

/// The ACK frames of a byte stream: (success, reason).
fn parse_acks(mut b: &[u8]) -> std::result::Result<Vec<(bool, String)>, String> {
    let mut out = Vec::new();
    while !b.is_empty() {
        if b.len() < 18 {
            return Err(format!("{} stray bytes after {} acks", b.len(), out.len()));
        }
        if b[..4] != frames::MAGIC.to_le_bytes() || b[4] != frames::ACK {
            return Err(format!("the consumer sent a non-ack frame {:?}", &b[..5]));
        }
        let status = b[13];
        let n = u32::from_le_bytes([b[14], b[15], b[16], b[17]]) as usize;
        let Some(reason) = b.get(18..18 + n) else { return Err("a truncated ack".into()) };
        out.push((status == 0, String::from_utf8_lossy(reason).into_owned()));
        b = &b[18 + n..];
    }
    Ok(out)
}

// ---- HTTP bodies ----

/// The fields a body may carry (and a few it may not).
const BODY_FIELDS: [&str; 24] = [
    "model",
    "prompt",
    "prompt_token_ids",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stop",
    "temperature",
    "top_p",
    "seed",
    "stream",
    "stream_options",
    "user",
    "logprobs",
    "top_logprobs",
    "echo",
    "best_of",
    "suffix",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "tools",
    "response_format",
];

/// A valid body, before mutation.
#[derive(Debug, Clone)]
pub struct ValidBody {
    pub chat: bool,
    pub prompt: Result<String, Vec<u8>>,
    pub max_tokens: Option<u32>,
    pub n: Option<u32>,
    pub stop: Vec<String>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<i64>,
    pub stream: Option<bool>,
}

impl ValidBody {
    pub fn json(&self) -> Value {
        let mut o = serde_json::Map::new();
        match (&self.prompt, self.chat) {
            (Ok(s), true) => {
                o.insert("messages".into(), json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": s}]));
            }
            (Err(ids), true) => {
                o.insert("messages".into(), json!([{"role": "user", "content": [{"type": "text", "text": String::from_utf8_lossy(ids)}]}]));
            }
            (Ok(s), false) => {
                o.insert("prompt".into(), json!(s));
            }
            (Err(ids), false) => {
                o.insert("prompt_token_ids".into(), json!(ids));
            }
        }
        let mut put = |k: &str, v: Option<Value>| {
            if let Some(v) = v {
                o.insert(k.into(), v);
            }
        };
        put("max_tokens", self.max_tokens.map(Value::from));
        put("n", self.n.map(Value::from));
        put("stop", (!self.stop.is_empty()).then(|| json!(self.stop)));
        put("temperature", self.temperature.map(Value::from));
        put("top_p", self.top_p.map(Value::from));
        put("seed", self.seed.map(Value::from));
        put("stream", self.stream.map(Value::from));
        Value::Object(o)
    }
}

fn valid_body() -> impl Strategy<Value = ValidBody> {
    let text =
        prop::collection::vec(prop::sample::select(vec!['a', 'b', ' ', 'é', '\n', '"', '\\', '世']), 1..40).prop_map(|v| v.into_iter().collect::<String>());
    let prompt = prop_oneof![text.clone().prop_map(Ok), prop::collection::vec(any::<u8>(), 1..40).prop_map(Err)];
    (
        any::<bool>(),
        prompt,
        prop::option::of(1u32..=16),
        prop::option::of(1u32..=2),
        prop::collection::vec(text, 0..=4),
        prop::option::of(0.0f64..=2.0),
        prop::option::of(0.01f64..=1.0),
        prop::option::of(any::<i64>()),
        prop::option::of(any::<bool>()),
    )
        .prop_map(|(chat, prompt, max_tokens, n, stop, temperature, top_p, seed, stream)| ValidBody {
            chat,
            prompt,
            max_tokens,
            n,
            stop,
            temperature,
            top_p,
            seed,
            stream,
        })
}

/// Values a field may be set to: wrong types, edges, huge and nested ones.
fn weird_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => prop::sample::select(vec![
            json!(null), json!(true), json!(false), json!(0), json!(-1), json!(1), json!(2), json!(129), json!(256),
            json!(u32::MAX), json!(u64::MAX), json!(i64::MIN), json!(0.5), json!(-0.0), json!(1e300), json!(-1e300),
            json!(f64::MIN_POSITIVE), json!(""), json!("x"), json!("NaN"), json!("Infinity"), json!([]), json!({}),
            json!([""]), json!(["a", "b", "c", "d", "e"]), json!([1, 2, 300]), json!([-1]), json!([[1], [2, 256]]),
            json!({"type": "json_object"}), json!({"include_usage": "yes"}), json!([{"role": "user"}]),
            json!([{"role": "user", "content": [{"type": "image_url"}]}]), json!([{"role": 5, "content": "x"}]),
        ]),
        1 => any::<i64>().prop_map(Value::from),
        1 => any::<u64>().prop_map(Value::from),
        1 => any::<f64>().prop_map(|x| json!(x)),
        1 => (0usize..50_000).prop_map(|n| Value::String("y".repeat(n))),
        1 => (0usize..2_000, 0u64..1000).prop_map(|(n, base)| Value::Array((0..n as u64).map(|i| Value::from(base + i)).collect())),
        1 => (0usize..100).prop_map(|d| (0..d).fold(json!(1), |v, _| json!([v]))),
    ]
}

/// One edit of a valid body.
#[derive(Debug, Clone)]
pub enum BodyEdit {
    Set { field: usize, value: Value },
    Remove { field: usize },
}

/// One edit of a body's JSON text.
#[derive(Debug, Clone)]
pub enum TextEdit {
    Json(JsonEdit),
    /// The body inside `depth` arrays.
    Nest {
        depth: usize,
    },
}

/// A request body.
#[derive(Debug, Clone)]
pub enum BodyInput {
    Bytes { chat: bool, bytes: Vec<u8> },
    Json { chat: bool, value: Value },
    Mutated { base: ValidBody, edits: Vec<BodyEdit>, text: Vec<TextEdit> },
}

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(|x| json!(x)),
        prop::collection::vec(any::<char>(), 0..8).prop_map(|v| Value::String(v.into_iter().collect())),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(BODY_FIELDS.to_vec()).prop_map(str::to_string), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

pub fn body_input() -> impl Strategy<Value = BodyInput> {
    let body_edit = prop_oneof![
        4 => (0..BODY_FIELDS.len(), weird_value()).prop_map(|(field, value)| BodyEdit::Set { field, value }),
        1 => (0..BODY_FIELDS.len()).prop_map(|field| BodyEdit::Remove { field }),
    ];
    let text_edit = prop_oneof![4 => json_edit().prop_map(TextEdit::Json), 1 => (1usize..5000).prop_map(|depth| TextEdit::Nest { depth })];
    prop_oneof![
        1 => (any::<bool>(), prop::collection::vec(any::<u8>(), 0..128)).prop_map(|(chat, bytes)| BodyInput::Bytes { chat, bytes }),
        2 => (any::<bool>(), any_json()).prop_map(|(chat, value)| BodyInput::Json { chat, value }),
        8 => (valid_body(), prop::collection::vec(body_edit, 0..4), prop::collection::vec(text_edit, 0..2))
            .prop_map(|(base, edits, text)| BodyInput::Mutated { base, edits, text }),
    ]
}

impl BodyInput {
    /// The endpoint, the body's bytes, and whether it is a valid body left unedited.
    pub fn encode(&self) -> (Endpoint, Vec<u8>, bool) {
        let ep = |chat: bool| if chat { Endpoint::Chat } else { Endpoint::Completions };
        match self {
            BodyInput::Bytes { chat, bytes } => (ep(*chat), bytes.clone(), false),
            BodyInput::Json { chat, value } => (ep(*chat), serde_json::to_vec(value).unwrap_or_default(), false),
            BodyInput::Mutated { base, edits, text } => {
                let mut v = base.json();
                if let Value::Object(o) = &mut v {
                    for e in edits {
                        match e {
                            BodyEdit::Set { field, value } => {
                                o.insert(BODY_FIELDS[field % BODY_FIELDS.len()].into(), value.clone());
                            }
                            BodyEdit::Remove { field } => {
                                o.remove(BODY_FIELDS[field % BODY_FIELDS.len()]);
                            }
                        }
                    }
                }
                let mut bytes = serde_json::to_vec(&v).unwrap_or_default();
                for t in text {
                    match t {
                        TextEdit::Json(e) => bytes = mutate_json(&bytes, std::slice::from_ref(e)),
                        TextEdit::Nest { depth } => {
                            let mut b = "[".repeat(*depth).into_bytes();
                            b.extend_from_slice(&bytes);
                            b.extend(std::iter::repeat_n(b']', *depth));
                            bytes = b;
                        }
                    }
                }
                (ep(base.chat), bytes, edits.is_empty() && text.is_empty())
            }
        }
    }
}

/// A body: refused with a reason, or accepted as a generation the served topology
/// can run (every choice fits the context and the places).
pub fn check_body(topo: &Topology, input: &BodyInput) -> Verdict {
    let (endpoint, bytes, valid) = input.encode();
    match openai::parse(topo, endpoint, &bytes, 7) {
        Err(e) => {
            if valid {
                return Err(format!("a valid body was refused: {e}"));
            }
            if e.to_string().trim().is_empty() {
                return Err(format!("a refusal without a message: {e:?}"));
            }
            let _ = e.param();
            let class = match e {
                BodyError::Malformed(_) => "refused: malformed",
                BodyError::Invalid { .. } => "refused: invalid",
                BodyError::Unsupported { .. } => "refused: unsupported",
                BodyError::TokenId(_) => "refused: token id",
                BodyError::ModelNotFound(_) => "refused: model",
                BodyError::Admission(_) => "refused: admission",
            };
            Ok(class.into())
        }
        Ok(g) => {
            let s = &topo.config.serve;
            if g.prompts.is_empty() || g.prompts.len() != g.max_tokens.len() {
                return Err(format!("{} prompts, {} max_tokens", g.prompts.len(), g.max_tokens.len()));
            }
            for (p, &m) in g.prompts.iter().zip(&g.max_tokens) {
                if p.is_empty() || m == 0 || p.len() as u64 + u64::from(m) > u64::from(s.max_context) {
                    return Err(format!("accepted a prompt of {} tokens with max_tokens {m} under max_context {}", p.len(), s.max_context));
                }
            }
            let choices = g.choices();
            if !(1..=128).contains(&g.n) || choices.len() as u64 > u64::from(s.max_requests) || choices.len() != g.prompts.len() * g.n as usize {
                return Err(format!("accepted n {} with {} choices (max_requests {})", g.n, choices.len(), s.max_requests));
            }
            if !((0.0..=2.0).contains(&g.temperature) && g.top_p > 0.0 && g.top_p <= 1.0) {
                return Err(format!("accepted temperature {} top_p {}", g.temperature, g.top_p));
            }
            if g.stop.len() > 4 || g.stop.iter().any(Vec::is_empty) {
                return Err(format!("accepted stops {:?}", g.stop));
            }
            Ok(if valid { "valid, accepted" } else { "mutated, accepted" }.into())
        }
    }
}

// ---- published consumer layouts ----

/// One edit of a consumer layout as decode publishes it (indices modulo what exists).
#[derive(Debug, Clone)]
pub enum LayoutEdit {
    /// tp, dcp, interleave, rank, slot.
    Instance {
        field: usize,
        value: u32,
    },
    /// A block id, or the block list's length.
    Block {
        at: usize,
        value: u32,
    },
    Blocks {
        len: usize,
    },
    /// A numeric field of a region: unit_stride, units, block_size, token_bytes, unit_bytes, len.
    Region {
        region: usize,
        field: usize,
        value: u64,
    },
    /// A row's layer or offset, or a row dropped.
    Row {
        region: usize,
        row: usize,
        layer: Option<u32>,
        offset: Option<u64>,
    },
    DropRow {
        region: usize,
        row: usize,
    },
    /// A segment's head range, or one of its groups' fields.
    Heads {
        region: usize,
        start: u32,
        end: u32,
    },
    Group {
        region: usize,
        group: usize,
        field: usize,
        value: u64,
    },
    DropRegion {
        region: usize,
    },
}

/// A request to plan: its tokens, the consumer rank, and the edits of its layout.
#[derive(Debug, Clone)]
pub struct LayoutCase {
    pub tokens: u64,
    pub consumer: u32,
    pub edits: Vec<LayoutEdit>,
}

fn small_topology() -> Topology {
    Topology::parse(SHIPPED_CONFIGS[3].1).expect("small.toml is valid")
}

/// Blocks and slots of the fuzzed pools: room for the longest case.
const LAYOUT_BLOCKS: u32 = 8;
const LAYOUT_SLOTS: u32 = 4;

fn layout_edit() -> impl Strategy<Value = LayoutEdit> {
    prop_oneof![
        2 => (0usize..5, u32_edge()).prop_map(|(field, value)| LayoutEdit::Instance { field, value }),
        2 => (any::<usize>(), u32_edge()).prop_map(|(at, value)| LayoutEdit::Block { at, value }),
        1 => (0usize..12).prop_map(|len| LayoutEdit::Blocks { len }),
        4 => (any::<usize>(), 0usize..6, u64_edge()).prop_map(|(region, field, value)| LayoutEdit::Region { region, field, value }),
        2 => (any::<usize>(), any::<usize>(), prop::option::of(u32_edge()), prop::option::of(u64_edge()))
            .prop_map(|(region, row, layer, offset)| LayoutEdit::Row { region, row, layer, offset }),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(region, row)| LayoutEdit::DropRow { region, row }),
        2 => (any::<usize>(), u32_edge(), u32_edge()).prop_map(|(region, start, end)| LayoutEdit::Heads { region, start, end }),
        3 => (any::<usize>(), any::<usize>(), 0usize..4, u64_edge()).prop_map(|(region, group, field, value)| LayoutEdit::Group { region, group, field, value }),
        1 => any::<usize>().prop_map(|region| LayoutEdit::DropRegion { region }),
    ]
}

pub fn layout_case() -> impl Strategy<Value = LayoutCase> {
    (1u64..=LAYOUT_BLOCKS as u64 * 16, 0u32..2, prop::collection::vec(layout_edit(), 0..4)).prop_map(|(tokens, consumer, edits)| LayoutCase {
        tokens,
        consumer,
        edits,
    })
}

fn apply_layout_edit(c: &mut ConsumerLayout, e: &LayoutEdit) {
    let regions = c.layout.regions.len();
    match e {
        LayoutEdit::Instance { field, value } => match field {
            0 => c.tp = *value,
            1 => c.dcp = *value,
            2 => c.interleave = *value,
            3 => c.rank.tp = *value,
            _ => c.slot = *value,
        },
        LayoutEdit::Block { at, value } => {
            if !c.blocks.is_empty() {
                let n = c.blocks.len();
                c.blocks[at % n] = *value;
            }
        }
        LayoutEdit::Blocks { len } => c.blocks.resize(*len, 0),
        LayoutEdit::DropRegion { region } if regions > 0 => {
            c.layout.regions.remove(region % regions);
        }
        _ if regions == 0 => {}
        LayoutEdit::Region { region, field, value } => {
            let r = &mut c.layout.regions[region % regions];
            let v32 = u32::try_from(*value).unwrap_or(u32::MAX);
            match field {
                0 => r.unit_stride = *value,
                1 => r.units = v32,
                2 => r.block_size = v32,
                3 => r.token_bytes = *value,
                4 => r.unit_bytes = *value,
                _ => r.len = *value,
            }
        }
        LayoutEdit::Row { region, row, layer, offset } => {
            let r = &mut c.layout.regions[region % regions];
            if !r.rows.is_empty() {
                let n = r.rows.len();
                let row = &mut r.rows[row % n];
                if let Some(l) = layer {
                    row.layer = handoff_components::vocab::ModuleLayer(*l);
                }
                if let Some(o) = offset {
                    row.offset = *o;
                }
            }
        }
        LayoutEdit::DropRow { region, row } => {
            let r = &mut c.layout.regions[region % regions];
            if !r.rows.is_empty() {
                let n = r.rows.len();
                r.rows.remove(row % n);
            }
        }
        LayoutEdit::Heads { region, start, end } => {
            if let Some(seg) = &mut c.layout.regions[region % regions].segment {
                seg.heads = *start..*end;
            }
        }
        LayoutEdit::Group { region, group, field, value } => {
            if let Some(seg) = &mut c.layout.regions[region % regions].segment
                && !seg.groups.is_empty()
            {
                let n = seg.groups.len();
                let g = &mut seg.groups[group % n];
                match field {
                    0 => g.offset = *value,
                    1 => g.head_bytes = *value,
                    2 => g.stride = *value,
                    _ => g.repeat = u32::try_from(*value).unwrap_or(u32::MAX),
                }
            }
        }
        LayoutEdit::DropRegion { .. } => {}
    }
}

/// What a prefill stage does with a published layout: decode it from the job's
/// line and plan its copies. A plan is refused with a reason, or every copy lies
/// inside the region the consumer published (the transport then checks the real one).
pub fn check_layout(topo: &Topology, case: &LayoutCase) -> Verdict {
    use handoff_systems::splitting::{ProducerPlanner, share};
    let d = DecodeRank { tp: case.consumer % topo.decode().tp };
    let blocks_for = |bs: u32| (0..(case.tokens.div_ceil(u64::from(bs)) as u32)).collect::<Vec<u32>>();
    let mut consumer = ConsumerLayout {
        rank: d,
        tp: topo.decode().tp,
        dcp: topo.decode().dcp,
        interleave: topo.decode().interleave,
        // The blocks in reverse: not one contiguous run.
        blocks: blocks_for(topo.decode().block_size).into_iter().rev().collect(),
        slot: LAYOUT_SLOTS - 1,
        layout: place_rank(topo, RankId::Decode(d), LAYOUT_BLOCKS, LAYOUT_SLOTS),
    };
    for e in &case.edits {
        apply_layout_edit(&mut consumer, e);
    }
    let admitted = Admitted { id: 1, nonce: 1, consumers: vec![consumer], handles: vec![], endpoint: PeerAddr::Local { instance: 1 } };
    let job = PrefillJob { admitted, prompt: vec![b'x'; case.tokens as usize], stage: 0, stages: vec![], hidden: None, sampling: None };
    let mut line = Vec::new();
    wire::encode_into(&mut line, &Msg::Prefill(Box::new(job))).map_err(|e| format!("encode: {e}"))?;
    let Ok(Some(Msg::Prefill(job))) = wire::recv(&mut Cursor::new(&line)) else {
        return Err("a job line did not decode".into());
    };
    let consumer = &job.admitted.consumers[0];
    let p = topo.prefill();
    let mut outcome = "planned";
    for stage in 0..p.pp {
        for tp in 0..p.tp {
            let rank = PrefillRank { pp: stage, tp };
            let producer = handoff_components::layout::ProducerLayout {
                rank,
                blocks: blocks_for(p.block_size),
                slot: 0,
                layout: place_rank(topo, RankId::Prefill(rank), LAYOUT_BLOCKS, LAYOUT_SLOTS),
            };
            let sh = share(p.tp, consumer.tp, tp, consumer.rank.tp);
            if !sh.rows && !sh.state {
                continue;
            }
            match ProducerPlanner::new(&producer, case.tokens).plan(consumer, sh) {
                Err(e) if case.edits.is_empty() => return Err(format!("the layout placement publishes was refused: {e}")),
                Err(e) => {
                    if e.to_string().trim().is_empty() {
                        return Err(format!("a refusal without a message: {e:?}"));
                    }
                    outcome = "refused";
                }
                Ok(plan) => {
                    for (i, d) in plan.descriptors.iter().enumerate() {
                        let Some(r) = consumer.layout.region(d.kind) else {
                            return Err(format!("descriptor {i} writes {} that the consumer did not publish", d.kind.name()));
                        };
                        let end = if d.count == 0 || d.len == 0 {
                            Some(d.dst_offset)
                        } else {
                            u64::from(d.count - 1).checked_mul(d.dst_stride).and_then(|x| x.checked_add(d.dst_offset)?.checked_add(d.len))
                        };
                        if end.is_none_or(|e| e > r.len) {
                            return Err(format!("descriptor {i} {d:?} ends past the published {} B of {}", r.len, d.kind.name()));
                        }
                    }
                }
            }
        }
    }
    Ok(if case.edits.is_empty() { "valid, planned".into() } else { format!("edited, {outcome}") })
}
