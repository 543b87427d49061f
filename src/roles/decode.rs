//! `handoff decode --config F`: the decode instance, all of its TP x DCP ranks.
//!
//! One engine thread owns decode's [`Engine`] (a World of the decode ranks only).
//! The proxy's link carries commands in (admit, cancel, a stage down); transport
//! notifications carry the stages' reports in, polled by the engine's transfer
//! phase through `TransportNotices` as a stage polls its mover; the engine's
//! events go out on the link (published layouts, tokens, done, errors, orphans).
//! Every tick's dispatch runs one batched decode step for every handed-off
//! request, in place in the registered decode regions. The role keeps no table
//! of requests: per-request state (its sampling included) lives in the World,
//! and every message names its request.
//!
//! The control listener lets in only connections that prove the cluster secret
//! ([`wire::accept_control`]), and the transport only producers whose hello
//! proves it, so a stranger can neither admit requests nor write into decode's
//! regions.

use super::sampling::Sampling;
use super::wire::{self, Admitted, Msg, Notice};
use crate::engine::compute::{TransportRegions, layouts_of};
use crate::engine::{Counts, Engine, EngineRole, NoMover};
use crate::transport::auth::{ClusterSecret, Sealer};
use crate::transport::{PeerAddr, RegionHandle, Transport};
use anyhow::Context;
use handoff_components::Topology;
use handoff_components::ecs::{Cancel, EngineEvent, StageDown, StageNotice, Submit};
use handoff_components::failure::Failure;
use handoff_systems::placement::Capacity;
use handoff_systems::transfer::NoticeSource;
use std::collections::BTreeMap;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A command from the proxy's link.
enum Cmd {
    Admit { id: u64, tokens: u64, max_tokens: u32, sampling: Option<Sampling>, forced: Vec<u8> },
    Cancel { id: u64, failure: Failure, unsent: bool },
    StageDown { stage: u32, dead: bool, message: String },
}

/// Runs decode until SIGINT/SIGTERM. `proxy` is the proxy's control address
/// (`host:port`); `secret` is what every connection of the cluster proves.
/// `addrs` are decode's listeners ([`super::addr`]): the control listener binds
/// `addrs.control.bind` and registers its advertised address; the tcp transport
/// binds `addrs.transport` and its region handles carry the advertised one.
pub fn run_decode(topo: &Topology, proxy: &str, addrs: &super::addr::RoleListeners, secret: &ClusterSecret) -> anyhow::Result<()> {
    super::signals::install_signal_handlers();
    let super::host::RoleTransport { transport, memory } = super::host::open_transport(topo, secret, addrs.transport.as_ref())?;
    let refused = super::host::Refused::new(&transport);
    let mut engine = Engine::for_role(topo.clone(), EngineRole::Decode, Capacity::serving(topo), Box::new(NoMover));
    let regions = engine.regions();
    let mut handles = BTreeMap::new();
    for r in &regions {
        let h = transport.register_memory(r.rank, r.layout.kind, r.layout.len, memory).with_context(|| format!("register {} of {}", r.layout.kind, r.rank))?;
        handles.insert((r.rank, r.layout.kind), h);
    }
    let published: Vec<RegionHandle> = handles.values().cloned().collect();
    let view = Arc::new(TransportRegions { transport: Arc::clone(&transport), handles });
    engine.set_compute(crate::engine::device::model_compute(topo.config.device, topo, layouts_of(&regions), view)?);
    engine.set_notices(Box::new(TransportNotices { transport: Arc::clone(&transport) }));
    let listener = TcpListener::bind(addrs.control.bind).with_context(|| format!("decode: listen on {} ({})", addrs.control.bind, addrs.control.bind_from))?;
    let bound = listener.local_addr()?;
    let addr = addrs.control.advertised(bound);
    let (tx, rx) = mpsc::channel();
    let link: Link = Arc::new(Mutex::new(None));
    let counts = Arc::new(Mutex::new(engine.counts()));
    {
        let (link, tx, refused, secret) = (Arc::clone(&link), tx.clone(), Arc::clone(&refused), secret.clone());
        std::thread::Builder::new().name("decode-accept".into()).spawn(move || accept(listener, link, tx, &refused, &secret))?;
    }
    {
        let (link, counts, pool) = (Arc::clone(&link), Arc::clone(&counts), super::host::compute_pool(topo)?);
        let endpoint = transport.endpoint();
        std::thread::Builder::new()
            .name("decode-engine".into())
            .spawn(move || pool.install(move || engine_loop(engine, &endpoint, &published, &link, &counts, &rx)))?;
    }
    drop(tx);
    tracing::info!(%bound, advertised = %addr, "decode listening");
    super::host::heartbeat_until_stopped(proxy, "decode", None, addr, &counts, &refused, secret);
    tracing::info!("decode stopping");
    super::host::remove_own_shm_files(topo);
    Ok(())
}

/// The stages' notices as the transport received them: decoded here, taken by
/// the engine's transfer phase every tick.
struct TransportNotices {
    transport: Arc<dyn Transport>,
}

impl NoticeSource for TransportNotices {
    fn poll(&mut self, out: &mut Vec<StageNotice>) {
        for n in self.transport.recv_notifications() {
            match serde_json::from_slice::<Notice>(&n.bytes) {
                Ok(Notice::Written(r)) => out.push(StageNotice::Written(r)),
                Ok(Notice::Failed { id, nonce, stage, failure }) => out.push(StageNotice::Failed { request: id, nonce, stage, failure }),
                Err(e) => tracing::warn!(error = %e, "decode: dropped a malformed notification"),
            }
        }
    }
}

/// The proxy's link: where decode's messages go (the latest connection), and
/// what seals them for it.
type Link = Arc<Mutex<Option<(TcpStream, Sealer)>>>;

/// Seals a tick's messages and writes them to the proxy's link in one go.
fn flush(link: &Link, msgs: &[Msg]) {
    if msgs.is_empty() {
        return;
    }
    let mut l = crate::base::lock(link);
    let Some((w, sealer)) = l.as_mut() else { return };
    let mut buf = Vec::new();
    for m in msgs {
        if let Err(e) = wire::seal_into(&mut buf, sealer, m) {
            tracing::warn!(error = %e, "decode: message not encodable");
        }
    }
    if let Err(e) = w.write_all(&buf).and_then(|()| w.flush()) {
        tracing::warn!(error = %e, "decode: the proxy's link failed");
        *l = None;
    }
}

/// Accepts the proxy's links that prove the cluster secret; each one's commands
/// go to the engine thread.
fn accept(listener: TcpListener, link: Link, tx: Sender<Cmd>, refused: &Arc<super::host::Refused>, secret: &ClusterSecret) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let _ = conn.set_nodelay(true);
        let Ok(w) = conn.try_clone() else { continue };
        let (tx, link, refused, secret) = (tx.clone(), Arc::clone(&link), Arc::clone(refused), secret.clone());
        let _ = std::thread::Builder::new().name("decode-link".into()).spawn(move || {
            let peer = conn.peer_addr().map_or_else(|_| "unknown".to_string(), |a| a.to_string());
            let (mut r, wire::ControlSession { sealer, mut opener }) = match wire::accept_control(conn, &secret) {
                Ok(r) => r,
                Err(wire::Admission::Closed) => return,
                Err(wire::Admission::Refused(why)) => return refused.control_refused("decode", &peer, &why),
            };
            // A connection becomes the link with its first command (a health probe
            // connects and sends nothing).
            let mut w = Some((w, sealer));
            loop {
                let cmd = match wire::recv_sealed(&mut r, &mut opener) {
                    Ok(Some(Msg::Admit { id, prompt_tokens, max_tokens, sampling, forced })) => {
                        Cmd::Admit { id, tokens: prompt_tokens, max_tokens, sampling, forced }
                    }
                    Ok(Some(Msg::Cancel { id, failure, unsent })) => Cmd::Cancel { id, failure, unsent },
                    Ok(Some(Msg::StageDown { stage, dead, message })) => Cmd::StageDown { stage, dead, message },
                    Ok(Some(other)) => {
                        tracing::warn!(?other, "decode: unexpected message on the proxy's link");
                        continue;
                    }
                    Ok(None) => return,
                    Err(wire::RecvError::Refused(e)) => {
                        // Closed for the link's writer too (it holds a clone of the stream).
                        let _ = r.get_ref().shutdown(std::net::Shutdown::Both);
                        return refused.message_refused("decode", &peer, &e);
                    }
                    Err(wire::RecvError::Io(e)) => {
                        tracing::warn!(error = %e, "decode: the proxy's link failed");
                        return;
                    }
                };
                if let Some(w) = w.take() {
                    *crate::base::lock(&link) = Some(w);
                }
                if tx.send(cmd).is_err() {
                    return;
                }
            }
        });
    }
}

/// The engine thread: commands in, one tick (which takes the stages' reports),
/// events out. It waits for work only when no request is decoding, and blocks
/// outright when it holds none, so an idle decode neither spins nor grows.
fn engine_loop(mut engine: Engine, endpoint: &PeerAddr, handles: &[RegionHandle], link: &Link, counts: &Mutex<Counts>, rx: &Receiver<Cmd>) {
    // One tick's messages to the proxy, written at once.
    let mut out: Vec<Msg> = Vec::new();
    loop {
        out.clear();
        let wait = if engine.decoding() {
            None
        } else if engine.live_requests() > 0 {
            Some(Duration::from_micros(200))
        } else {
            Some(Duration::from_millis(100))
        };
        if let Some(wait) = wait {
            match rx.recv_timeout(wait) {
                Ok(cmd) => apply(&mut engine, cmd),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            apply(&mut engine, cmd);
        }
        let t0 = Instant::now();
        engine.tick();
        tracing::trace!(us = t0.elapsed().as_micros() as u64, "decode tick");
        for ev in engine.take_events() {
            match ev {
                EngineEvent::Published { request, nonce, consumers } => {
                    let a = Admitted { id: request, nonce, consumers, handles: handles.to_vec(), endpoint: endpoint.clone() };
                    out.push(Msg::Admitted(Box::new(a)));
                }
                EngineEvent::Token { request, token, .. } => out.push(Msg::Token { id: request, token }),
                EngineEvent::Finished { request, handoff_ms, decode_ms, bytes, tail_ms, stage_prefill_ms } => {
                    tracing::debug!(request, "decode: finished");
                    out.push(Msg::Done { id: request, handoff_ms, decode_ms, bytes, tail_ms, stage_prefill_ms });
                }
                // A stage went down: the proxy asks the later stage to settle these.
                EngineEvent::Orphaned { stage, requests, failure } => out.push(Msg::Orphaned { stage, requests, endpoint: endpoint.clone(), failure }),
                EngineEvent::Failing { request, failure } => out.push(Msg::Error { id: request, failure }),
                EngineEvent::Computed { .. } | EngineEvent::Written(_) | EngineEvent::Settled { .. } => {}
            }
        }
        for o in engine.take_outcomes() {
            if let Err(failure) = o.result {
                tracing::debug!(request = o.request, %failure, "decode: released a failed request");
                out.push(Msg::Error { id: o.request, failure });
            }
        }
        flush(link, &out);
        *crate::base::lock(counts) = engine.counts();
    }
}

/// Applies one command: the engine's phases do the rest.
fn apply(engine: &mut Engine, cmd: Cmd) {
    match cmd {
        Cmd::Admit { id, tokens, max_tokens, sampling, forced } => {
            tracing::debug!(request = id, tokens, replayed = forced.len(), "decode: admit");
            engine.submit_request(Submit { id, tokens, max_tokens, sampling, forced, ..Default::default() })
        }
        Cmd::Cancel { id, failure, unsent } => engine.cancel({
            tracing::debug!(request = id, phase = failure.phase.name(), unsent, %failure, "decode: cancel");
            Cancel { request: id, failure, stage: None, nonce: None, unsent }
        }),
        // The release phase fails what waits for the stage, and names the
        // later stages' orphans (`EngineEvent::Failing`, `Orphaned`).
        Cmd::StageDown { stage, dead, message } => engine.stage_down(StageDown { stage, dead, detail: message }),
    }
}
