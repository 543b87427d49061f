//! Real P/D hand-offs between processes: a decode side (an engine whose decode
//! regions live in a transport) and one producer process per PP stage, each of which
//! knows only its own rank, the blocks and slot it was assigned, and what the
//! consumer published (its layouts and region handles). Producers plan their own
//! copies with `plan_pair`, write them through a `TransportMover` and report
//! write-done by `notify`; the decode side delivers the reports to its engine, and
//! checks every consumer byte with the oracle.
//!
//! Children are this test binary again (`current_exe`) running only `child_entry`,
//! with `HANDOFF_PD_CHILD` naming the role; their input is JSON on stdin, their
//! output `PD:<key>=<value>` lines on stdout.

#[allow(dead_code)]
mod transport_util;

use handoff::check::oracle::{self, OracleRequest, Placement};
use handoff::engine::Engine;
use handoff::engine::mover::{MoverOptions, TransportMover};
use handoff::engine::{EngineRole, NoMover};
use handoff::transport::{PeerAddr, RegionHandle, ShmTransport, TcpOptions, TcpTransport, Transport, TransportExt};
use handoff_components::Topology;
use handoff_components::config::Config;
use handoff_components::ecs::WriteDone;
use handoff_components::layout::{ConsumerLayout, ProducerLayout};
use handoff_components::vocab::{DecodeRank, PrefillRank, RankId, RegionKind};
use handoff_systems::placement::blocks_for;
use handoff_systems::placement::{Capacity, place_rank};
use handoff_systems::splitting::{plan_pair, share};
use handoff_systems::transfer::{Mover, PlanCompletion, Ticket};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

const ROLE: &str = "HANDOFF_PD_CHILD";
const WAIT: Duration = Duration::from_secs(30);
const MAX_TOKENS: u64 = 45;

// ---------------------------------------------------------------------------
// What travels between the processes.

/// The capacity every rank was placed with (producers size their regions from it).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Cap {
    prefill_blocks: u32,
    decode_blocks: u32,
    slots: u32,
}

/// One request as a producer stage sees it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Assignment {
    id: u64,
    nonce: u64,
    tokens: u64,
    /// (producer tp, blocks, slot) on this stage's ranks.
    producers: Vec<(u32, Vec<u32>, u32)>,
    /// What every decode rank published for the request.
    consumers: Vec<ConsumerLayout>,
}

/// Everything one producer process is told.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Publish {
    config: Config,
    cap: Cap,
    stage: u32,
    /// The consumer's registered regions.
    handles: Vec<RegionHandle>,
    request: Assignment,
    /// Write half of the first plan, say so, then stall (until killed).
    stall: bool,
}

/// Producer to consumer, over `Transport::notify`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
enum Note {
    Computed { request: u64, nonce: u64, pp: u32 },
    WriteDone { request: u64, nonce: u64, pp: u32, tp: u32, consumer_tp: u32 },
}

// ---------------------------------------------------------------------------
// Processes.

fn child(prefix: &[&str], role: &str) -> Command {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = match prefix.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    cmd.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        // The child's transports must prove this process's cluster secret.
        .env(handoff::transport::auth::SECRET_ENV, handoff::transport::auth::ClusterSecret::process().to_hex())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    cmd
}

/// Starts a child and writes its JSON input to its stdin.
fn spawn_with(mut cmd: Command, input: &impl Serialize) -> (Child, Receiver<String>) {
    let mut c = cmd.spawn().expect("spawn child");
    let mut stdin = c.stdin.take().expect("stdin");
    serde_json::to_writer(&mut stdin, input).expect("child input");
    drop(stdin);
    let out = c.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            // libtest may print "test child_entry ... " in front of the first line.
            if let Some(at) = line.find("PD:") {
                let _ = tx.send(line[at + 3..].to_string());
            }
        }
    });
    (c, rx)
}

fn expect_line(rx: &Receiver<String>, key: &str) -> Result<String, String> {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(line) => {
                if let Some(v) = line.strip_prefix(&format!("{key}=")) {
                    return Ok(v.to_string());
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    Err(format!("child never printed PD:{key}="))
}

fn say(key: &str, value: impl std::fmt::Display) {
    println!("PD:{key}={value}");
    let _ = std::io::stdout().flush();
}

fn read_stdin<T: for<'de> Deserialize<'de>>() -> T {
    serde_json::from_reader(std::io::stdin().lock()).expect("child input json")
}

// ---------------------------------------------------------------------------
// The producer role: one PP stage, from the published layouts alone.

fn produce(t: std::sync::Arc<dyn Transport>, p: Publish) {
    let topo = Topology::new(p.config.clone()).expect("topology");
    let opts = MoverOptions { batch_timeout: WAIT, ..MoverOptions::from_topology(&topo) };
    let mut mover = TransportMover::new(t.clone(), opts).expect("mover");
    let ptp = topo.prefill().tp;
    let decode = p.handles.first().map(|h| h.peer.clone()).expect("consumer handles");
    for h in &p.handles {
        mover.attach_target(h).expect("attach consumer region");
    }
    let r = &p.request;
    let mut plans = Vec::new();
    for (tp, blocks, slot) in &r.producers {
        let rank = PrefillRank { pp: p.stage, tp: *tp };
        let layout = place_rank(&topo, RankId::Prefill(rank), p.cap.prefill_blocks, p.cap.slots);
        for region in &layout.regions {
            let h = t.register(RankId::Prefill(rank), region.kind, region.len).expect("register");
            let req = OracleRequest { id: r.id, tokens: r.tokens };
            let at = Placement { blocks, slot: *slot };
            t.write_region(&h, |b| oracle::fill_producer(&topo, rank, region.kind, region.units, &req, &at, b)).expect("fill");
            mover.add_source(h);
        }
        let me = ProducerLayout { rank, blocks: blocks.clone(), slot: *slot, layout };
        for c in &r.consumers {
            let sh = share(ptp, c.tp, rank.tp, c.rank.tp);
            if sh.rows || sh.state {
                plans.push(plan_pair(&me, c, r.tokens, sh).expect("plan from the published layout"));
            }
        }
    }
    let note = |n: Note| t.notify(&decode, &serde_json::to_vec(&n).expect("note")).expect("notify");
    note(Note::Computed { request: r.id, nonce: r.nonce, pp: p.stage });
    if p.stall {
        let mut first = plans.swap_remove(0);
        first.descriptors.truncate(first.descriptors.len().div_ceil(2));
        let ticket = Ticket { request: r.id, nonce: r.nonce, producer: first.producer, consumer: first.consumer, part: 0 };
        mover.submit(ticket, &first).expect("submit");
        assert!(mover.handle().wait_idle(WAIT));
        say("partial", first.descriptors.len());
        std::thread::sleep(WAIT * 4);
        return;
    }
    for plan in &plans {
        let ticket = Ticket { request: r.id, nonce: r.nonce, producer: plan.producer, consumer: plan.consumer, part: 0 };
        mover.submit(ticket, plan).expect("submit");
    }
    let mut done = Vec::new();
    let deadline = Instant::now() + WAIT;
    while done.len() < plans.len() && Instant::now() < deadline {
        mover.handle().wait_idle(Duration::from_millis(100));
        let mut got: Vec<PlanCompletion> = Vec::new();
        mover.poll(&mut got);
        for c in got {
            c.result.as_ref().unwrap_or_else(|e| panic!("write failed: {e}"));
            let k = c.ticket;
            note(Note::WriteDone { request: k.request, nonce: k.nonce, pp: k.producer.pp, tp: k.producer.tp, consumer_tp: k.consumer.tp });
            done.push(k);
        }
    }
    assert_eq!(done.len(), plans.len(), "every plan completed");
    say("done", plans.len());
}

// ---------------------------------------------------------------------------
// The decode side.

/// A decode engine with its regions in `t`, and what the oracle needs to check them.
struct DecodeSide {
    topo: Topology,
    cap: Capacity,
    engine: Engine,
    t: std::sync::Arc<dyn Transport>,
    handles: BTreeMap<(RankId, RegionKind), RegionHandle>,
    units: BTreeMap<(RankId, RegionKind), u32>,
    baseline: u32,
}

/// How a request ended on the decode side.
#[derive(Debug)]
enum Ended {
    /// Handed off; pattern bytes the oracle checked.
    Verified(u64),
    Failed {
        phase: &'static str,
        reason: String,
    },
}

impl DecodeSide {
    fn new(cfg: Config, t: std::sync::Arc<dyn Transport>) -> DecodeSide {
        let topo = cfg.validate().expect("topology");
        let cap = Capacity::for_requests(&topo, 2, MAX_TOKENS);
        // Decode's World holds the decode ranks only; the producers are the children.
        let mut engine = Engine::for_role(topo.clone(), EngineRole::Decode, cap, Box::new(NoMover));
        let mut handles = BTreeMap::new();
        let mut units = BTreeMap::new();
        for r in engine.regions() {
            units.insert((r.rank, r.layout.kind), r.layout.units);
            if let RankId::Decode(_) = r.rank {
                let h = t.register(r.rank, r.layout.kind, r.layout.len).expect("register decode region");
                handles.insert((r.rank, r.layout.kind), h);
            }
        }
        engine.tick();
        let baseline = engine.entity_count();
        let side = DecodeSide { topo, cap, engine, t, handles, units, baseline };
        side.reset_canary();
        side
    }

    /// Freed memory holds whatever was written last; the oracle checks every byte
    /// of a region, so give it a clean canary before each checked request.
    fn reset_canary(&self) {
        for ((rank, kind), h) in &self.handles {
            self.t.write_region(h, |b| oracle::fill_canary(*rank, *kind, b)).expect("canary");
        }
    }

    /// Admits and places a request, and returns what each PP stage is told.
    fn publish(&mut self, id: u64, tokens: u64, stall_stage: Option<u32>) -> Vec<Publish> {
        self.engine.submit(id, tokens);
        self.engine.tick();
        assert!(self.engine.take_outcomes().is_empty(), "request {id} refused at admission");
        let nonce = self.engine.nonce(id).expect("request");
        let consumers: Vec<ConsumerLayout> = self.engine.published(id);
        assert_eq!(consumers.len() as u32, self.topo.decode().tp);
        // Each producer process lays the request out in its own blocks and slot.
        let blocks: Vec<u32> = (0..blocks_for(tokens, self.topo.prefill().block_size) as u32).collect();
        let cap = Cap { prefill_blocks: self.cap.prefill_blocks, decode_blocks: self.cap.decode_blocks, slots: self.cap.slots };
        (0..self.topo.prefill().pp)
            .map(|stage| Publish {
                config: self.topo.config.clone(),
                cap,
                stage,
                handles: self.handles.values().cloned().collect(),
                request: Assignment {
                    id,
                    nonce,
                    tokens,
                    producers: (0..self.topo.prefill().tp).map(|tp| (tp, blocks.clone(), 0)).collect(),
                    consumers: consumers.clone(),
                },
                stall: stall_stage == Some(stage),
            })
            .collect()
    }

    /// Delivers the producers' notes to the engine until the request ends; checks
    /// every consumer byte when it was handed off, then finishes it.
    fn serve(&mut self, id: u64, tokens: u64) -> Ended {
        let deadline = Instant::now() + WAIT;
        let nonce = self.engine.nonce(id);
        let ended = loop {
            assert!(Instant::now() < deadline, "request {id} neither handed off nor failed: {:?}", self.engine.status(id));
            for n in self.t.wait_notifications(Duration::from_millis(20)) {
                match serde_json::from_slice::<Note>(&n.bytes) {
                    Ok(Note::Computed { request, nonce: got, pp }) if Some(got) == nonce && request == id => self.engine.mark_computed(request, pp),
                    // A stage of an earlier request (already failed or finished).
                    Ok(Note::Computed { .. }) => {}
                    Ok(Note::WriteDone { request, nonce, pp, tp, consumer_tp }) => {
                        let r = WriteDone { request, nonce, producer: PrefillRank { pp, tp }, consumer: DecodeRank { tp: consumer_tp } };
                        self.engine.deliver_report(r);
                    }
                    Err(e) => panic!("undecodable note from {:?}: {e}", n.from),
                }
            }
            self.engine.tick();
            if let Some(o) = self.engine.take_outcomes().into_iter().find(|o| o.request == id) {
                break o.result;
            }
        };
        match ended {
            Ok(()) => {
                let pattern = self.check(id, tokens);
                self.engine.finish(id);
                self.engine.tick();
                Ended::Verified(pattern)
            }
            Err(failure) => Ended::Failed { phase: failure.phase.name(), reason: failure.to_string() },
        }
    }

    fn check(&self, id: u64, tokens: u64) -> u64 {
        let leases: BTreeMap<RankId, (Vec<u32>, u32)> = self.engine.leases(id).into_iter().map(|l| (l.rank, (l.blocks, l.slot))).collect();
        let mut pattern = 0;
        for ((rank, kind), h) in &self.handles {
            let RankId::Decode(d) = *rank else { continue };
            let (blocks, slot) = &leases[rank];
            let reqs = [(OracleRequest { id, tokens }, Placement { blocks, slot: *slot })];
            let stats = self
                .t
                .read_region(h, |b| oracle::check_consumer(&self.topo, d, *kind, self.units[&(*rank, *kind)], &reqs, b))
                .expect("read consumer region")
                .unwrap_or_else(|e| panic!("request {id}: {e}"));
            pattern += stats.pattern_bytes;
        }
        pattern
    }

    /// Entities, producer entries, pools and the awaited writes are back to baseline.
    fn assert_released(&mut self) {
        assert_eq!(self.engine.entity_count(), self.baseline, "entities left behind");
        assert!(self.engine.producer_entries().iter().all(|&n| n == 0), "producer entries {:?}", self.engine.producer_entries());
        for (rank, pool) in &self.engine.pools().0 {
            assert_eq!(pool.free_block_count(), pool.blocks as u64, "{rank}: blocks not all free");
            assert_eq!(pool.free_slots.len(), pool.slots as usize, "{rank}: slots not all free");
        }
    }
}

fn small_config(transfer_s: f64) -> Config {
    let mut cfg = Config::load(concat!(env!("CARGO_MANIFEST_DIR"), "/config/small.toml")).expect("config");
    cfg.timeouts.transfer_s = transfer_s;
    cfg
}

// ---------------------------------------------------------------------------
// Child entry.

/// Input of the decode-side child of the netns test.
#[derive(Serialize, Deserialize)]
struct DecodeJob {
    config: Config,
    bind: SocketAddr,
    id: u64,
    tokens: u64,
}

/// Not a test of its own: the entry point of the child processes. Without the role
/// variable (a normal test run) it does nothing.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE) else { return };
    match role.as_str() {
        "shm-producer" => produce(std::sync::Arc::new(ShmTransport::new().expect("shm")), read_stdin()),
        "tcp-producer" => produce(std::sync::Arc::new(TcpTransport::loopback().expect("tcp")), read_stdin()),
        "tcp-decode" => {
            let job: DecodeJob = read_stdin();
            let t = TcpTransport::bind(TcpOptions { bind: job.bind, ..TcpOptions::default() }).expect("tcp bind");
            let mut side = DecodeSide::new(job.config, std::sync::Arc::new(t));
            let publish = side.publish(job.id, job.tokens, None);
            say("publish", serde_json::to_string(&publish).expect("publish json"));
            match side.serve(job.id, job.tokens) {
                Ended::Verified(bytes) => {
                    side.assert_released();
                    say("verified", bytes);
                }
                Ended::Failed { phase, reason } => panic!("failed in {phase}: {reason}"),
            }
        }
        other => panic!("unknown child role {other}"),
    }
}

/// Spawns one producer process per PP stage for the published request.
fn spawn_producers(prefix: &[&str], role: &str, publish: &[Publish]) -> Vec<(Child, Receiver<String>, bool)> {
    publish
        .iter()
        .map(|p| {
            let (c, rx) = spawn_with(child(prefix, role), p);
            (c, rx, p.stall)
        })
        .collect()
}

fn reap(children: Vec<(Child, Receiver<String>, bool)>) {
    for (mut c, rx, _) in children {
        expect_line(&rx, "done").unwrap_or_else(|e| panic!("{e}"));
        assert!(transport_util::wait_child(&mut c, "producer", WAIT).success(), "producer exited with an error");
    }
}

// ---------------------------------------------------------------------------
// Tests.

/// PP2 x TP1 -> TP2 x DCP2 over shared memory: two producer processes (one per
/// stage) write into the test process's decode regions from the published handles
/// alone; every consumer byte matches the oracle and everything is released.
#[test]
fn shm_producer_processes_hand_off_to_decode_byte_exact() {
    let mut side = DecodeSide::new(small_config(20.0), std::sync::Arc::new(ShmTransport::new().expect("shm")));
    for (id, tokens) in [(7u64, 45u64), (8, 17)] {
        side.reset_canary();
        let publish = side.publish(id, tokens, None);
        let children = spawn_producers(&[], "shm-producer", &publish);
        let ended = side.serve(id, tokens);
        reap(children);
        match ended {
            Ended::Verified(bytes) => assert!(bytes > 0),
            Ended::Failed { phase, reason } => panic!("request {id} failed in {phase}: {reason}"),
        }
        side.assert_released();
    }
}

/// A stage-0 producer writes half of one plan and stalls; the test kills it
/// (SIGKILL). The decode side fails the request after the transfer timeout, naming
/// the transfer phase, frees everything it held, and then serves the next request,
/// with fresh producers, byte-exact.
#[test]
fn producer_killed_mid_transfer_fails_request_in_transfer_phase_then_next_is_byte_exact() {
    let mut side = DecodeSide::new(small_config(0.5), std::sync::Arc::new(ShmTransport::new().expect("shm")));
    let publish = side.publish(21, 40, Some(0));
    let mut children = spawn_producers(&[], "shm-producer", &publish);
    let (mut stalled, srx, _) = children.remove(0);
    let killer = std::thread::spawn(move || {
        let partial = expect_line(&srx, "partial");
        stalled.kill().expect("SIGKILL the stalled producer");
        let _ = stalled.wait();
        partial
    });
    let started = Instant::now();
    let ended = side.serve(21, 40);
    let waited = started.elapsed();
    killer.join().expect("killer thread").expect("the producer wrote part of a plan before it was killed");
    reap(children);
    match ended {
        Ended::Failed { phase, reason } => {
            assert_eq!(phase, "transfer", "reason: {reason}");
            assert!(reason.contains("transfer") || reason.contains("write-done"), "{reason}");
            eprintln!("killed producer: request failed after {waited:?} in {phase}: {reason}");
        }
        Ended::Verified(_) => panic!("a request whose producer was killed mid-transfer was handed off"),
    }
    assert!(waited >= Duration::from_millis(450), "failed before the transfer timeout: {waited:?}");
    // The failure was retired in the tick that reported it.
    side.assert_released();

    side.reset_canary();
    let publish = side.publish(22, 33, None);
    let children = spawn_producers(&[], "shm-producer", &publish);
    let ended = side.serve(22, 33);
    reap(children);
    assert!(matches!(ended, Ended::Verified(b) if b > 0), "{ended:?}");
    side.assert_released();
}

/// Two network namespaces joined by a veth pair, link-local addresses only;
/// removed on drop.
struct Namespaces {
    names: [String; 2],
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() { Ok(()) } else { Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim())) }
}

impl Namespaces {
    fn new() -> Result<Namespaces, String> {
        let pid = std::process::id();
        let ns = Namespaces { names: [format!("pdD{pid}"), format!("pdP{pid}")] };
        let (d, p) = (&ns.names[0], &ns.names[1]);
        let (vd, vp) = (format!("pvd{pid}"), format!("pvp{pid}"));
        ip(&["netns", "add", d])?;
        ip(&["netns", "add", p])?;
        ip(&["link", "add", &vd, "type", "veth", "peer", "name", &vp])?;
        ip(&["link", "set", &vd, "netns", d])?;
        ip(&["link", "set", &vp, "netns", p])?;
        ip(&["-n", d, "addr", "add", "169.254.88.1/30", "dev", &vd])?;
        ip(&["-n", p, "addr", "add", "169.254.88.2/30", "dev", &vp])?;
        for (n, v) in [(d, &vd), (p, &vp)] {
            ip(&["-n", n, "link", "set", "lo", "up"])?;
            ip(&["-n", n, "link", "set", v, "up"])?;
        }
        Ok(ns)
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

/// The same hand-off over TCP: the decode side in one network namespace, the two
/// producer processes in another, over a veth pair; the decode side checks every
/// byte itself. Skips, printing why, where network namespaces are refused.
#[test]
fn tcp_producers_in_another_network_namespace_hand_off_byte_exact() {
    let ns = match Namespaces::new() {
        Ok(ns) => ns,
        Err(reason) => {
            // Under CI (root, CI=true) network namespaces must work: fail, never skip.
            assert!(
                std::env::var_os("CI").is_none(),
                "tcp_producers_in_another_network_namespace_hand_off_byte_exact: network namespaces unavailable under CI: {reason}"
            );
            eprintln!("SKIPPED tcp_producers_in_another_network_namespace_hand_off_byte_exact (not under CI): {reason}");
            return;
        }
    };
    let job = DecodeJob { config: small_config(20.0), bind: "169.254.88.1:0".parse().expect("addr"), id: 31, tokens: 45 };
    let (mut decode, drx) = spawn_with(child(&["ip", "netns", "exec", &ns.names[0]], "tcp-decode"), &job);
    let publish: Vec<Publish> = serde_json::from_str(&expect_line(&drx, "publish").expect("decode side published")).expect("publish json");
    for h in &publish[0].handles {
        assert!(matches!(&h.peer, PeerAddr::Tcp { addr } if addr.ip().to_string() == "169.254.88.1"), "{}", h.peer);
    }
    let children = spawn_producers(&["ip", "netns", "exec", &ns.names[1]], "tcp-producer", &publish);
    reap(children);
    let verified: u64 = expect_line(&drx, "verified").expect("decode side verified").parse().expect("bytes");
    assert!(verified > 0);
    assert!(transport_util::wait_child(&mut decode, "decode side", WAIT).success());
    eprintln!("tcp across namespaces {} -> {}: {verified} pattern bytes verified", ns.names[1], ns.names[0]);
}
