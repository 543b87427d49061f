//! `handoff prefill --config F --stage S`: one PP stage, all of its TP ranks.
//!
//! The stage registers its producer regions in its own transport, computes its
//! layers of each request it receives, writes its layers' caches into decode's
//! regions (planned from what decode published, never from global knowledge),
//! reports write-done to decode, and passes the hidden states on to the next stage.
//! Its producer entry for a request lives from the start of its writes until they
//! have all completed, and is dropped then, whatever the other stages do.

use super::wire::{self, Msg, PrefillJob, Register, StageReport};
use super::{heartbeat, secs, shutting_down};
use crate::model::forward;
use crate::model::ranks::{self, Layouts};
use crate::model::ShardGroup;
use crate::oracle::Memory;
use crate::transport::mover::{MoverOptions, TransportMover};
use crate::transport::{RegionHandle, Transport, TransportExt};
use anyhow::Context;
use handoff_components::Topology;
use handoff_components::ecs::{Lease, RankPool};
use handoff_components::layout::{ProducerLayout, RankLayout};
use handoff_components::vocab::{PrefillRank, RankId, RegionKind};
use handoff_kernels::{Backend, CpuBackend};
use handoff_systems::placement::{Capacity, alloc_blocks, blocks_for, free_blocks, place_rank};
use handoff_systems::splitting::{ProducerPlanner, share};
use handoff_systems::transfer::{Completion, Mover, Ticket};
use std::collections::{BTreeMap, HashMap};
use std::io::BufReader;
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Test hook: sleep this many milliseconds in the middle of each compute (a test
/// kills the stage during it).
pub const DELAY_ENV: &str = "HANDOFF_TEST_STAGE_DELAY_MS";

struct Stage {
    topo: Topology,
    stage: u32,
    group: ShardGroup<CpuBackend>,
    transport: Arc<dyn Transport>,
    /// Everything below is touched by one request at a time.
    state: Mutex<StageState>,
    /// Live producer entries: request id -> plans not yet completed.
    entries: Mutex<HashMap<u64, u32>>,
    mover: Mutex<TransportMover>,
    delay: Option<Duration>,
}

struct StageState {
    mem: Memory,
    layouts: Layouts,
    rank_layouts: BTreeMap<u32, RankLayout>,
    sources: BTreeMap<(RankId, RegionKind), RegionHandle>,
    pool: RankPool,
    attached: HashMap<(RankId, RegionKind), RegionHandle>,
}

/// Runs prefill stage `stage` until SIGINT/SIGTERM. `proxy` is the proxy's
/// `host:port`, where the stage registers its control address.
pub fn run_prefill(topo: &Topology, stage: u32, proxy: &str) -> anyhow::Result<()> {
    let p = topo.prefill();
    anyhow::ensure!(stage < p.pp, "--stage {stage} is outside prefill pp {} (stages 0..{})", p.pp, p.pp);
    super::install_signal_handlers();
    let transport = super::open_transport(topo)?;
    let s = &topo.config.serve;
    let cap = Capacity::for_requests(topo, s.max_requests, s.max_context as u64);
    let mover = TransportMover::new(Arc::clone(&transport), MoverOptions::from_topology(topo))?;
    let mut st = StageState {
        mem: Memory::new(),
        layouts: Layouts::new(),
        rank_layouts: BTreeMap::new(),
        sources: BTreeMap::new(),
        pool: RankPool::new(cap.prefill_blocks, cap.slots),
        attached: HashMap::new(),
    };
    for tp in 0..p.tp {
        let rank = RankId::Prefill(PrefillRank { pp: stage, tp });
        let layout = place_rank(topo, rank, cap.prefill_blocks, cap.slots);
        for r in &layout.regions {
            let h = transport.register(rank, r.kind, r.len).with_context(|| format!("register {} of {rank}", r.kind))?;
            mover.add_source(h.clone());
            st.sources.insert((rank, r.kind), h);
            st.mem.insert((rank, r.kind), vec![0u8; r.len as usize]);
            st.layouts.insert((rank, r.kind), r.clone());
        }
        st.rank_layouts.insert(tp, layout);
    }
    let group = crate::model::Model::new(topo)?.upload_group(&CpuBackend::new(), p.tp as usize)?;
    let delay = std::env::var(DELAY_ENV).ok().and_then(|v| v.parse::<u64>().ok()).map(Duration::from_millis);
    let me = Arc::new(Stage {
        topo: topo.clone(),
        stage,
        group,
        transport,
        state: Mutex::new(st),
        entries: Mutex::new(HashMap::new()),
        mover: Mutex::new(mover),
        delay,
    });
    let listener = TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    tracing::info!(stage, %addr, "prefill stage listening");
    let mut last_beat = Instant::now() - Duration::from_secs(10);
    while !shutting_down() {
        if last_beat.elapsed() >= Duration::from_millis(300) {
            let entries = lock(&me.entries).len() as u32;
            let reg = Register {
                role: "prefill".into(),
                stage: Some(stage),
                addr,
                pid: std::process::id(),
                producer_entries: vec![entries],
                live_requests: entries,
            };
            heartbeat(proxy, &reg);
            last_beat = Instant::now();
        }
        match listener.accept() {
            Ok((conn, _)) => {
                let me = Arc::clone(&me);
                std::thread::spawn(move || {
                    if let Err(e) = serve_conn(&me, conn) {
                        tracing::warn!(stage = me.stage, error = %e, "prefill connection");
                    }
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(e.into()),
        }
    }
    tracing::info!(stage, "prefill stage stopping");
    super::remove_own_shm_files(topo);
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn serve_conn(me: &Stage, conn: TcpStream) -> std::io::Result<()> {
    conn.set_nonblocking(false)?;
    let t = &me.topo.config.timeouts;
    let budget = secs(t.compute_s + t.transfer_s);
    conn.set_read_timeout(Some(budget))?;
    let mut w = conn.try_clone()?;
    let mut r = BufReader::new(conn);
    let reply = match wire::recv(&mut r)? {
        Some(Msg::Prefill(job)) => handle(me, *job),
        Some(other) => Msg::Error { phase: "compute".into(), message: format!("prefill stage {}: unexpected {other:?}", me.stage) },
        None => return Ok(()),
    };
    wire::send(&mut w, &reply)
}

/// Computes this stage, writes and reports, then hands the job to the next stage
/// and relays its answer.
fn handle(me: &Stage, mut job: PrefillJob) -> Msg {
    let s = me.stage;
    let id = job.admitted.id;
    let (hidden, bytes, compute_ms, transfer_ms) = match compute_and_write(me, &job) {
        Ok(x) => x,
        Err((phase, message)) => {
            tracing::warn!(stage = s, request = id, phase, %message, "prefill failed");
            return Msg::Error { phase: phase.into(), message };
        }
    };
    job.bytes += bytes;
    job.compute_ms += compute_ms;
    job.transfer_ms += transfer_ms;
    let next = s + 1;
    if next >= me.topo.prefill().pp {
        return Msg::PrefillDone { bytes: job.bytes, compute_ms: job.compute_ms, transfer_ms: job.transfer_ms };
    }
    let Some(&addr) = job.stages.get(next as usize) else {
        return Msg::Error { phase: "compute".into(), message: format!("prefill stage {next}: no address known") };
    };
    job.stage = next;
    job.hidden = Some(hidden);
    let t = &me.topo.config.timeouts;
    let lost = |e: std::io::Error| Msg::Error {
        phase: "compute".into(),
        message: format!("prefill stage {next} at {addr}: {e} (stage unreachable or died mid-request)"),
    };
    let (mut w, mut r) = match wire::connect(addr, secs(t.compute_s + t.transfer_s)) {
        Ok(c) => c,
        Err(e) => return lost(e),
    };
    if let Err(e) = wire::send(&mut w, &Msg::Prefill(Box::new(job))) {
        return lost(e);
    }
    match wire::recv(&mut r) {
        Ok(Some(m)) => m,
        Ok(None) => lost(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed without an answer")),
        Err(e) => lost(e),
    }
}

type Failure = (&'static str, String);

fn compute_and_write(me: &Stage, job: &PrefillJob) -> Result<(Vec<f32>, u64, f64, f64), Failure> {
    let s = me.stage;
    let topo = &me.topo;
    let a = &job.admitted;
    let t = job.prompt.len();
    let comp = |e: String| ("compute", format!("prefill stage {s}: {e}"));
    let be = CpuBackend::new();
    let mut st = lock(&me.state);
    let st = &mut *st;
    // This stage's own blocks and slot (shared by its TP ranks).
    let nblocks = blocks_for(t as u64, topo.prefill().block_size) as u32;
    let blocks = alloc_blocks(&mut st.pool, nblocks).ok_or_else(|| comp(format!("no {nblocks} free blocks")))?;
    let Some(slot) = st.pool.free_slots.pop() else {
        free_blocks(&mut st.pool, &blocks);
        return Err(comp("no free slot".into()));
    };
    // The stage's TP ranks share it (store_prefill addresses by rank).
    let lease = Lease { rank: RankId::Prefill(PrefillRank { pp: s, tp: 0 }), blocks: blocks.clone(), slot };
    let result = (|| {
        let t0 = Instant::now();
        let mut h = match &job.hidden {
            None => forward::embed(&be, &me.group, &job.prompt).map_err(|e| comp(e.to_string()))?,
            Some(x) => be.upload(x).map_err(|e| comp(e.to_string()))?,
        };
        let layers = topo.stage_layers[s as usize].clone();
        let tail = ranks::prefill_record_tail(topo, t);
        // The model reaches regions through a RegionView: lend it the stage's memory.
        let view = Mutex::new(std::mem::take(&mut st.mem));
        let layouts = &st.layouts;
        let computed = forward::prefill_layers(&be, &me.group, layers.start as usize..layers.end as usize, &mut h, t, tail, &mut |tp, layer, cache| {
            ranks::store_prefill(topo, layouts, &view, PrefillRank { pp: s, tp: tp as u32 }, &lease, layer, cache)
        });
        st.mem = view.into_inner().unwrap_or_else(|e| e.into_inner());
        computed.map_err(|e| comp(e.to_string()))?;
        if let Some(d) = me.delay {
            std::thread::sleep(d);
        }
        let first_token = if s + 1 == topo.prefill().pp {
            Some(forward::logits_of_last(&be, &me.group, &h, t).map_err(|e| comp(e.to_string()))?.1)
        } else {
            None
        };
        let compute_ms = t0.elapsed().as_secs_f64() * 1e3;
        let t1 = Instant::now();
        let (bytes, pairs) = write(me, st, job, &lease).map_err(|e| ("transfer", format!("prefill stage {s}: {e}")))?;
        let report = StageReport { id: a.id, nonce: a.nonce, stage: s, pairs, first_token, bytes };
        let msg = serde_json::to_vec(&report).map_err(|e| ("transfer", e.to_string()))?;
        me.transport
            .notify(&a.endpoint, &msg)
            .map_err(|e| ("transfer", format!("prefill stage {s}: write-done report to decode: {e}")))?;
        Ok((be.download(&h).map_err(|e| comp(e.to_string()))?, bytes, compute_ms, t1.elapsed().as_secs_f64() * 1e3))
    })();
    // Every write of this request has completed or failed: the sources are free.
    free_blocks(&mut st.pool, &blocks);
    st.pool.free_slots.push(slot);
    result
}

/// Publishes this stage's bytes to its source regions, plans every pair from the
/// consumers' published layouts and writes them. Returns bytes and pairs written.
fn write(
    me: &Stage,
    st: &mut StageState,
    job: &PrefillJob,
    lease: &Lease,
) -> Result<(u64, Vec<(PrefillRank, handoff_components::vocab::DecodeRank)>), String> {
    let a = &job.admitted;
    let topo = &me.topo;
    for (key, h) in &st.sources {
        let src = st.mem.get(key).ok_or("no memory for a source region")?;
        me.transport.write_region(h, |b| b.copy_from_slice(src)).map_err(|e| e.to_string())?;
    }
    let mover = lock(&me.mover);
    for h in &a.handles {
        let key = (h.rank, h.kind);
        if st.attached.get(&key) != Some(h) {
            mover.attach_target(h).map_err(|e| format!("attach {h}: {e}"))?;
            st.attached.insert(key, h.clone());
        }
    }
    let ptp = topo.prefill().tp;
    let producers: Vec<ProducerLayout> = st
        .rank_layouts
        .iter()
        .map(|(&tp, l)| ProducerLayout { rank: PrefillRank { pp: me.stage, tp }, blocks: lease.blocks.clone(), slot: lease.slot, layout: l.clone() })
        .collect();
    let planners: Vec<ProducerPlanner> = producers.iter().map(|p| ProducerPlanner::new(p, job.prompt.len() as u64)).collect();
    let mut tickets = Vec::new();
    let mut bytes = 0;
    let mut mover = mover;
    for c in &a.consumers {
        for (p, pl) in planners.iter().zip(&producers) {
            let rank = pl.rank;
            let sh = share(ptp, c.tp, rank.tp, c.rank.tp);
            if !sh.rows && !sh.state {
                continue;
            }
            let plan = p.plan(c, sh).map_err(|e| e.to_string())?;
            bytes += plan.bytes();
            let ticket = Ticket { request: a.id, nonce: a.nonce, producer: rank, consumer: c.rank };
            mover.submit(ticket, &plan)?;
            tickets.push(ticket);
        }
    }
    lock(&me.entries).insert(a.id, tickets.len() as u32);
    let deadline = Instant::now() + secs(topo.config.timeouts.transfer_s);
    let mut done: Vec<Completion> = Vec::new();
    let mut failure = None;
    while done.len() < tickets.len() {
        let before = done.len();
        mover.poll(&mut done);
        for c in &done[before..] {
            if let Err(e) = &c.result {
                failure.get_or_insert_with(|| format!("write to decode tp{}: {e}", c.ticket.consumer.tp));
            }
        }
        if let Some(entry) = lock(&me.entries).get_mut(&a.id) {
            *entry = (tickets.len() - done.len()) as u32;
        }
        if Instant::now() >= deadline {
            failure.get_or_insert_with(|| format!("transfer phase timed out after {} s", topo.config.timeouts.transfer_s));
            break;
        }
        if done.len() < tickets.len() {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    // The producer entry goes as soon as this stage's own writes are complete.
    lock(&me.entries).remove(&a.id);
    if let Some(f) = failure {
        return Err(f);
    }
    Ok((bytes, tickets.iter().map(|t| (t.producer, t.consumer)).collect()))
}
