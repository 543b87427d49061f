//! `handoff decode --config F`: the decode instance, all of its TP x DCP ranks.
//!
//! Its engine (admission -> placement -> splitting -> transfer -> release) runs on
//! one thread and owns every block and slot. Decode regions are registered in the
//! transport; the prefill stages write into them and report write-done by transport
//! notifications, which the engine thread delivers (the engine's mover is an
//! [`AwaitedWrites`]: the bytes arrive by the producers' own writes). Once every
//! stage has reported for every decode rank, the request is handed off and a
//! worker thread runs the decode loop from the decode ranks' own region bytes.

use super::wire::{self, Admitted, Msg, Register, StageReport};
use super::{heartbeat, secs, shutting_down};
use crate::engine::Engine;
use crate::model::forward;
use crate::model::ranks::{DecodeRanks, Layouts};
use crate::model::ShardGroup;
use crate::oracle::Memory;
use crate::transport::mover::AwaitedWrites;
use crate::transport::{PeerAddr, RegionHandle, Transport, TransportExt};
use anyhow::Context;
use handoff_components::Topology;
use handoff_components::ecs::{BlockTable, Lease, PhaseName, Pools, Published, Region, Request, Slot, Status, WriteDone};
use handoff_components::vocab::{DecodeRank, RankId, RegionKind};
use handoff_kernels::CpuBackend;
use handoff_systems::placement::{Capacity, alloc_blocks, blocks_for, free_blocks, owned_tokens};
use std::collections::{BTreeMap, HashMap};
use std::io::BufReader;
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a request's connection thread hears from the engine thread.
enum Event {
    Admitted(Box<Admitted>),
    /// Handed off: the first token and every decode rank's lease (grown to hold the
    /// generated tokens).
    HandedOff { first_token: u8, leases: Vec<Lease> },
    Failed { phase: PhaseName, reason: String },
}

enum Cmd {
    Admit { id: u64, tokens: u64, max_tokens: u32, events: Sender<Event> },
    Abort { id: u64, phase: PhaseName, reason: String },
    Finish { id: u64 },
}

struct Live {
    events: Sender<Event>,
    max_tokens: u32,
    admitted: bool,
    first_token: Option<u8>,
    /// Blocks allocated past the prompt for generated tokens, per decode rank.
    grown: Vec<(RankId, Vec<u32>)>,
}

struct Shared {
    topo: Topology,
    group: ShardGroup<CpuBackend>,
    transport: Arc<dyn Transport>,
    handles: BTreeMap<(RankId, RegionKind), RegionHandle>,
    layouts: Layouts,
    cmds: Mutex<Sender<Cmd>>,
    stats: Mutex<(Vec<u32>, u32)>,
}

/// Runs decode until SIGINT/SIGTERM. `proxy` is the proxy's `host:port`.
pub fn run_decode(topo: &Topology, proxy: &str) -> anyhow::Result<()> {
    super::install_signal_handlers();
    let transport = super::open_transport(topo)?;
    let s = &topo.config.serve;
    let t = &topo.config.timeouts;
    let cap = Capacity::for_requests(topo, s.max_requests, s.max_context as u64);
    let awaited = AwaitedWrites::new(secs(t.compute_s + t.transfer_s));
    let mut engine = Engine::new(topo.clone(), cap, Box::new(awaited.clone()));
    engine.tick();
    let mut handles = BTreeMap::new();
    let mut layouts = Layouts::new();
    let mut q = engine.world.query::<&Region>();
    let decode_regions: Vec<Region> = q.iter(&engine.world).filter(|r| matches!(r.rank, RankId::Decode(_))).cloned().collect();
    for r in decode_regions {
        let h = transport.register(r.rank, r.layout.kind, r.layout.len).with_context(|| format!("register {} of {}", r.layout.kind, r.rank))?;
        handles.insert((r.rank, r.layout.kind), h);
        layouts.insert((r.rank, r.layout.kind), r.layout);
    }
    let group = crate::model::Model::new(topo)?.upload_group(&CpuBackend::new(), topo.decode().tp as usize)?;
    let (tx, rx) = mpsc::channel();
    let shared = Arc::new(Shared {
        topo: topo.clone(),
        group,
        transport: Arc::clone(&transport),
        handles,
        layouts,
        cmds: Mutex::new(tx),
        stats: Mutex::new((vec![0; topo.prefill().pp as usize], 0)),
    });
    let listener = TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    {
        let shared = Arc::clone(&shared);
        std::thread::Builder::new().name("decode-engine".into()).spawn(move || engine_loop(&shared, engine, awaited, rx))?;
    }
    tracing::info!(%addr, "decode listening");
    let mut last_beat = Instant::now() - Duration::from_secs(10);
    while !shutting_down() {
        if last_beat.elapsed() >= Duration::from_millis(300) {
            let (entries, live) = lock(&shared.stats).clone();
            let reg = Register { role: "decode".into(), stage: None, addr, pid: std::process::id(), producer_entries: entries, live_requests: live };
            heartbeat(proxy, &reg);
            last_beat = Instant::now();
        }
        match listener.accept() {
            Ok((conn, _)) => {
                let shared = Arc::clone(&shared);
                std::thread::spawn(move || {
                    if let Err(e) = serve_conn(&shared, conn) {
                        tracing::warn!(error = %e, "decode connection");
                    }
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(e.into()),
        }
    }
    tracing::info!("decode stopping");
    super::remove_own_shm_files(topo);
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn send_cmd(shared: &Shared, cmd: Cmd) {
    let _ = lock(&shared.cmds).send(cmd);
}

/// The engine thread: commands, reports, ticks, outcomes.
fn engine_loop(shared: &Shared, mut engine: Engine, awaited: AwaitedWrites, rx: Receiver<Cmd>) {
    let mut live: HashMap<u64, Live> = HashMap::new();
    let endpoint: PeerAddr = shared.transport.endpoint();
    loop {
        match rx.recv_timeout(Duration::from_millis(1)) {
            Ok(cmd) => apply(shared, &mut engine, &mut live, cmd),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        while let Ok(cmd) = rx.try_recv() {
            apply(shared, &mut engine, &mut live, cmd);
        }
        for n in shared.transport.recv_notifications() {
            let Ok(r) = serde_json::from_slice::<StageReport>(&n.bytes) else {
                tracing::warn!("decode: dropped a malformed notification");
                continue;
            };
            if let Some(l) = live.get_mut(&r.id)
                && let Some(tok) = r.first_token
            {
                l.first_token = Some(tok);
            }
            engine.mark_computed(r.id, r.stage);
            for (producer, consumer) in r.pairs {
                let wd = WriteDone { request: r.id, nonce: r.nonce, producer, consumer };
                awaited.settle(&wd);
                engine.deliver_report(wd);
            }
        }
        engine.tick();
        // Newly placed requests: publish.
        let waiting: Vec<u64> = live.iter().filter(|(_, l)| !l.admitted).map(|(&id, _)| id).collect();
        for id in waiting {
            if let Some(Status::Planned) = engine.status(id)
                && let Some(a) = published(&engine, id, shared, &endpoint)
                && let Some(l) = live.get_mut(&id)
            {
                l.admitted = true;
                let _ = l.events.send(Event::Admitted(Box::new(a)));
            }
        }
        for o in engine.take_outcomes() {
            match o.result {
                Ok(()) => handed_off(shared, &mut engine, &mut live, o.request),
                Err((phase, reason)) => {
                    if let Some(l) = live.remove(&o.request) {
                        release_grown(&mut engine, &l.grown);
                        let _ = l.events.send(Event::Failed { phase, reason });
                    }
                }
            }
        }
        let entries = engine.producer_entries();
        *lock(&shared.stats) = (entries, engine.world.resource::<handoff_components::ecs::RequestIndex>().0.len() as u32);
    }
}

fn apply(shared: &Shared, engine: &mut Engine, live: &mut HashMap<u64, Live>, cmd: Cmd) {
    match cmd {
        Cmd::Admit { id, tokens, max_tokens, events } => {
            if live.contains_key(&id) {
                let _ = events.send(Event::Failed { phase: PhaseName::Admission, reason: format!("request id {id} is already in flight") });
                return;
            }
            engine.submit(id, tokens);
            live.insert(id, Live { events, max_tokens, admitted: false, first_token: None, grown: Vec::new() });
        }
        Cmd::Abort { id, phase, reason } => fail(engine, id, phase, reason),
        Cmd::Finish { id } => {
            if let Some(l) = live.remove(&id) {
                release_grown(engine, &l.grown);
            }
            engine.finish(id);
        }
    }
    let _ = shared;
}

fn fail(engine: &mut Engine, id: u64, phase: PhaseName, reason: String) {
    if let Some(e) = engine.entity_of(id)
        && let Some(mut s) = engine.world.get_mut::<Status>(e)
        && matches!(*s, Status::Waiting | Status::Placed | Status::Planned)
    {
        *s = Status::Failed { phase, reason };
    }
}

fn release_grown(engine: &mut Engine, grown: &[(RankId, Vec<u32>)]) {
    let mut pools = engine.world.resource_mut::<Pools>();
    for (rank, blocks) in grown {
        if let Some(pool) = pools.0.get_mut(rank) {
            free_blocks(pool, blocks);
        }
    }
}

/// What every decode rank published for a placed request.
fn published(engine: &Engine, id: u64, shared: &Shared, endpoint: &PeerAddr) -> Option<Admitted> {
    let e = engine.entity_of(id)?;
    let nonce = engine.world.get::<Request>(e)?.nonce;
    let holdings = engine.world.get::<handoff_components::ecs::Holdings>(e)?;
    let mut consumers: Vec<_> = holdings
        .leases
        .iter()
        .filter_map(|&l| engine.world.get::<Published>(l).map(|p| p.0.clone()))
        .collect();
    consumers.sort_by_key(|c| c.rank.tp);
    Some(Admitted { id, nonce, consumers, handles: shared.handles.values().cloned().collect(), endpoint: endpoint.clone() })
}

/// Grows each decode rank's block table to hold the generated tokens and tells the
/// request's thread to decode.
fn handed_off(shared: &Shared, engine: &mut Engine, live: &mut HashMap<u64, Live>, id: u64) {
    let Some(l) = live.get_mut(&id) else { return };
    let Some(first_token) = l.first_token else {
        let reason = "every stage reported, but the last stage sent no first token".to_string();
        let _ = l.events.send(Event::Failed { phase: PhaseName::Transfer, reason });
        live.remove(&id);
        engine.finish(id);
        return;
    };
    let Some(e) = engine.entity_of(id) else { return };
    let Some(tokens) = engine.world.get::<Request>(e).map(|r| r.tokens) else { return };
    let d = shared.topo.decode();
    let total = tokens + l.max_tokens as u64;
    let mut leases: BTreeMap<u32, Lease> = BTreeMap::new();
    let lease_entities = engine.world.get::<handoff_components::ecs::Holdings>(e).map(|h| h.leases.clone()).unwrap_or_default();
    for le in lease_entities {
        if let (Some(t), Some(s)) = (engine.world.get::<BlockTable>(le), engine.world.get::<Slot>(le))
            && let RankId::Decode(r) = t.rank
        {
            leases.insert(r.tp, Lease { rank: t.rank, blocks: t.blocks.clone(), slot: s.index });
        }
    }
    let mut failure = None;
    for (&tp, lease) in leases.iter_mut() {
        let rank = DecodeRank { tp };
        let need = blocks_for(owned_tokens(total, d.dcp, rank.dcp_rank(d.dcp), d.interleave), d.block_size) as usize;
        if need > lease.blocks.len() {
            let mut pools = engine.world.resource_mut::<Pools>();
            let more = pools.0.get_mut(&RankId::Decode(rank)).and_then(|p| alloc_blocks(p, (need - lease.blocks.len()) as u32));
            match more {
                Some(more) => {
                    lease.blocks.extend_from_slice(&more);
                    l.grown.push((RankId::Decode(rank), more));
                }
                None => {
                    failure = Some(format!("decode tp{tp}: no free blocks for {total} tokens"));
                    break;
                }
            }
        }
    }
    if let Some(reason) = failure {
        let _ = l.events.send(Event::Failed { phase: PhaseName::Decode, reason });
        let l = live.remove(&id);
        if let Some(l) = l {
            release_grown(engine, &l.grown);
        }
        engine.finish(id);
        return;
    }
    let _ = l.events.send(Event::HandedOff { first_token, leases: leases.into_values().collect() });
}

fn serve_conn(shared: &Shared, conn: TcpStream) -> std::io::Result<()> {
    conn.set_nonblocking(false)?;
    let t = &shared.topo.config.timeouts;
    conn.set_read_timeout(Some(secs(t.admission_s)))?;
    let mut w = conn.try_clone()?;
    let mut r = BufReader::new(conn);
    let (id, tokens, max_tokens) = match wire::recv(&mut r)? {
        Some(Msg::Admit { id, prompt_tokens, max_tokens }) => (id, prompt_tokens, max_tokens),
        Some(Msg::Abort { id, phase, message }) => {
            let phase = match phase.as_str() {
                "transfer" => PhaseName::Transfer,
                "admission" => PhaseName::Admission,
                _ => PhaseName::Compute,
            };
            send_cmd(shared, Cmd::Abort { id, phase, reason: message });
            return Ok(());
        }
        _ => return Ok(()),
    };
    let (etx, erx) = mpsc::channel();
    send_cmd(shared, Cmd::Admit { id, tokens, max_tokens, events: etx });
    let wait = secs(t.admission_s + t.compute_s + t.transfer_s + 5.0);
    let err = |w: &mut TcpStream, phase: PhaseName, message: String| wire::send(w, &Msg::Error { phase: phase.name().into(), message });
    let t0 = Instant::now();
    match erx.recv_timeout(wait) {
        Ok(Event::Admitted(a)) => wire::send(&mut w, &Msg::Admitted(a))?,
        Ok(Event::Failed { phase, reason }) => return err(&mut w, phase, reason),
        Ok(Event::HandedOff { .. }) | Err(_) => {
            send_cmd(shared, Cmd::Abort { id, phase: PhaseName::Admission, reason: "admission phase: no answer from the engine".into() });
            return err(&mut w, PhaseName::Admission, "no answer from decode's engine".into());
        }
    }
    let (first, leases) = match erx.recv_timeout(wait) {
        Ok(Event::HandedOff { first_token, leases }) => (first_token, leases),
        Ok(Event::Failed { phase, reason }) => return err(&mut w, phase, reason),
        Ok(Event::Admitted(_)) | Err(_) => {
            send_cmd(shared, Cmd::Abort { id, phase: PhaseName::Transfer, reason: "transfer phase: no hand-off in time".into() });
            return err(&mut w, PhaseName::Transfer, "no hand-off in time".into());
        }
    };
    let handoff_ms = t0.elapsed().as_secs_f64() * 1e3;
    let t1 = Instant::now();
    let result = decode_loop(shared, &mut w, tokens as usize, first, max_tokens, leases);
    send_cmd(shared, Cmd::Finish { id });
    match result {
        Ok(()) => wire::send(&mut w, &Msg::Done { handoff_ms, decode_ms: t1.elapsed().as_secs_f64() * 1e3 }),
        Err(reason) => err(&mut w, PhaseName::Decode, reason),
    }
}

/// Streams the first token, then runs `max_tokens - 1` greedy steps from the decode
/// ranks' own region bytes (a private copy: the request's bytes are final once
/// handed off, and other requests' writes may still land in the shared regions).
fn decode_loop(shared: &Shared, w: &mut TcpStream, prompt: usize, first: u8, max_tokens: u32, leases: Vec<Lease>) -> Result<(), String> {
    wire::send(w, &Msg::Token { token: first }).map_err(|e| format!("client went away: {e}"))?;
    if max_tokens <= 1 {
        return Ok(());
    }
    let mut mem = Memory::new();
    for (key, h) in &shared.handles {
        let bytes = shared.transport.region_bytes(h).map_err(|e| format!("read {h}: {e}"))?;
        mem.insert(*key, bytes);
    }
    let mem = Mutex::new(mem);
    let be = CpuBackend::new();
    let mut caches = DecodeRanks::new(&shared.topo, &shared.layouts, &mem, vec![leases]);
    let mut prev = first;
    for i in 0..(max_tokens - 1) as usize {
        let (_, tok) = forward::decode_batch(&be, &shared.group, &[prev], &[prompt + i], &mut caches)
            .map_err(|e| format!("decode step {}: {e}", i + 1))?
            .pop()
            .ok_or_else(|| format!("decode step {}: no result", i + 1))?;
        wire::send(w, &Msg::Token { token: tok }).map_err(|e| format!("client went away: {e}"))?;
        prev = tok;
    }
    Ok(())
}
