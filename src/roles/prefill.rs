//! `handoff prefill --config F --stage S`: one PP stage, all of its TP ranks.
//!
//! One engine thread owns the stage's [`Engine`] (a World of this stage's TP ranks,
//! their blocks and slots, and the requests, producer entries and plans in flight).
//! Jobs come in on the control listener (from the proxy or the previous stage) and
//! are submitted with decode's published layouts; the dispatch phase computes each
//! request straight into the stage's registered source regions, the transfer phase
//! writes them into decode's regions while the next request computes, and the
//! release phase drops the producer entry when the stage's writes complete. The
//! role carries the engine's events out: hidden states to the next stage, the
//! write-done report (or a failure) to decode over the transport. What a request
//! holds lives in the World, its sampling and the requests settled for an
//! earlier stage's death included; the role keeps only where its messages go.
//!
//! The control listener lets in only connections that prove the cluster secret
//! ([`wire::accept_control`]); the stage proves it in turn to the next stage, to
//! the proxy's control listener (its heartbeat) and in its transport's hello.

use super::wire::{self, Admitted, Msg, Notice, WirePrefillJob};
use crate::engine::compute::{TransportRegions, layouts_of};
use crate::engine::mover::{MoverHandle, MoverOptions, TransportMover};
use crate::engine::{Counts, Engine, EngineRole};
use crate::transport::auth::{ClusterSecret, Sealer};
use crate::transport::{PeerAddr, RegionHandle, Transport};
use anyhow::Context;
use handoff_components::Topology;
use handoff_components::ecs::{EngineEvent, Inputs, PhaseName, Settle, Submit};
use handoff_components::failure::{Cause, Failure, PeerLoss, ProcessRole};
use handoff_systems::placement::Capacity;
use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Test hook: sleep this many milliseconds before each compute (a test kills the
/// stage while it holds a request).
pub const DELAY_ENV: &str = "HANDOFF_TEST_STAGE_DELAY_MS";

/// Where this stage's messages go: the deployment's decode and stages, as the
/// latest job named them (the same for every request of one deployment).
#[derive(Default)]
struct StageRoute {
    endpoint: Option<PeerAddr>,
    handles: Vec<RegionHandle>,
    stages: Vec<SocketAddr>,
}

/// Runs prefill stage `stage` until SIGINT/SIGTERM. `proxy` is the proxy's
/// control address (`host:port`), where the stage registers its own control
/// address; `secret` is what every connection of the cluster proves.
///
/// `addrs` are the stage's listeners ([`super::addr`]): its control listener
/// binds `addrs.control.bind` and registers its advertised address; the tcp
/// transport binds and advertises `addrs.transport`.
pub fn run_prefill(topo: &Topology, stage: u32, proxy: &str, addrs: &super::addr::RoleListeners, secret: &ClusterSecret) -> anyhow::Result<()> {
    let p = topo.prefill();
    anyhow::ensure!(stage < p.pp, "--stage {stage} is outside prefill pp {} (stages 0..{})", p.pp, p.pp);
    super::signals::install_signal_handlers();
    let super::host::RoleTransport { transport, memory } = super::host::open_transport(topo, secret, addrs.transport.as_ref())?;
    let refused = super::host::Refused::new(&transport);
    let mover = TransportMover::new(Arc::clone(&transport), MoverOptions::from_topology(topo))?;
    let handle = mover.handle();
    let mut engine = Engine::for_role(topo.clone(), EngineRole::Stage(stage), Capacity::serving(topo), Box::new(mover));
    let regions = engine.regions();
    let mut handles = BTreeMap::new();
    for r in &regions {
        let h = transport.register_memory(r.rank, r.layout.kind, r.layout.len, memory).with_context(|| format!("register {} of {}", r.layout.kind, r.rank))?;
        handle.add_source(h.clone());
        handles.insert((r.rank, r.layout.kind), h);
    }
    let view = Arc::new(TransportRegions { transport: Arc::clone(&transport), handles });
    let delay = std::env::var(DELAY_ENV).ok().and_then(|v| v.parse::<u64>().ok()).map(Duration::from_millis);
    let compute = crate::engine::device::model_compute(topo.config.device, topo, layouts_of(&regions), view)?;
    engine.set_compute(match delay {
        Some(d) => Box::new(super::host::Delayed { inner: compute, delay: d }),
        None => compute,
    });
    let listener = TcpListener::bind(addrs.control.bind)
        .with_context(|| format!("prefill stage {stage}: listen on {} ({})", addrs.control.bind, addrs.control.bind_from))?;
    let bound = listener.local_addr()?;
    let addr = addrs.control.advertised(bound);
    let (tx, rx) = mpsc::channel();
    let counts = Arc::new(Mutex::new(engine.counts()));
    {
        let (tx, refused, secret) = (tx.clone(), Arc::clone(&refused), secret.clone());
        let max_line = wire::stage_line_limit(topo);
        std::thread::Builder::new().name("prefill-accept".into()).spawn(move || accept(listener, tx, &refused, &secret, max_line))?;
    }
    let (notices, pending) = mpsc::channel();
    {
        let transport = Arc::clone(&transport);
        let max_age = Duration::from_secs_f64(topo.config.timeouts.transfer_s.max(topo.config.timeouts.compute_s));
        std::thread::Builder::new().name("prefill-notices".into()).spawn(move || send_notices(transport.as_ref(), &pending, max_age))?;
    }
    let (next, handed) = mpsc::channel();
    {
        let (notices, next) = (notices.clone(), NextStage { addr: None, conn: None, secret: secret.clone() });
        std::thread::Builder::new().name("prefill-next".into()).spawn(move || send_next(next, &handed, &notices))?;
    }
    {
        let (counts, pool) = (Arc::clone(&counts), super::host::compute_pool(topo)?);
        std::thread::Builder::new()
            .name("prefill-engine".into())
            .spawn(move || pool.install(move || engine_loop(engine, stage, &notices, &handle, &counts, &rx, &next)))?;
    }
    drop(tx);
    tracing::info!(stage, %bound, advertised = %addr, "prefill stage listening");
    super::host::heartbeat_until_stopped(proxy, "prefill", Some(stage), addr, &counts, &refused, secret);
    tracing::info!(stage, "prefill stage stopping");
    super::host::remove_own_shm_files(topo);
    Ok(())
}

/// What the links bring the engine thread.
enum StageCmd {
    Job(Box<WirePrefillJob>),
    /// See [`Msg::Settle`].
    Settle {
        requests: Vec<(u64, u64)>,
        endpoint: PeerAddr,
        failure: Failure,
    },
}

/// Accepts links from the proxy and the previous stage that prove the cluster
/// secret; their jobs go to the engine.
fn accept(listener: TcpListener, tx: Sender<StageCmd>, refused: &Arc<super::host::Refused>, secret: &ClusterSecret, max_line: u64) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let (tx, refused, secret) = (tx.clone(), Arc::clone(refused), secret.clone());
        let _ = std::thread::Builder::new().name("prefill-link".into()).spawn(move || {
            let peer = conn.peer_addr().map_or_else(|_| "unknown".to_string(), |a| a.to_string());
            // The sealer goes unused: a stage sends nothing back on a control link.
            let (mut r, wire::ControlSession { mut opener, .. }) = match wire::accept_control(conn, &secret) {
                Ok(r) => r,
                Err(wire::Admission::Closed) => return,
                Err(wire::Admission::Refused(why)) => return refused.control_refused("prefill", &peer, &why),
            };
            loop {
                match wire::recv_sealed_within(&mut r, &mut opener, max_line) {
                    Ok(Some(Msg::Prefill(job))) => {
                        if tx.send(StageCmd::Job(job)).is_err() {
                            return;
                        }
                    }
                    Ok(Some(Msg::Settle { requests, endpoint, failure })) => {
                        if tx.send(StageCmd::Settle { requests, endpoint, failure }).is_err() {
                            return;
                        }
                    }
                    Ok(Some(other)) => tracing::warn!(?other, "prefill: unexpected message"),
                    Ok(None) => return,
                    Err(wire::RecvError::Refused(e)) => return refused.message_refused("prefill", &peer, &e),
                    Err(wire::RecvError::Io(e)) => {
                        tracing::warn!(error = %e, "prefill: link failed");
                        return;
                    }
                }
            }
        });
    }
}

/// The next stage's link, reconnected when it breaks.
struct NextStage {
    addr: Option<SocketAddr>,
    conn: Option<(TcpStream, Sealer)>,
    secret: ClusterSecret,
}

/// Whether the next stage has closed its end of `w` (it died or restarted:
/// its kernel sent FIN or RST), seen without blocking. A job written into such
/// a connection is lost without an error (the write lands in the socket
/// buffer; only a later write sees the reset), and when the stage is already
/// back at the same address, nothing else would fail the request: decode's
/// news of the stage's death came before the request. So the link is checked
/// before each job and, if closed, made again to the stage's new process.
fn closed_by_peer(w: &TcpStream) -> bool {
    if w.set_nonblocking(true).is_err() {
        return true;
    }
    let mut b = [0u8; 1];
    let closed = match w.peek(&mut b) {
        Ok(0) => true,                                                 // FIN: the peer is gone
        Ok(_) => false,                                                // bytes from it: alive
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false, // nothing to read: alive
        Err(_) => true,                                                // reset or another error
    };
    closed || w.set_nonblocking(false).is_err()
}

impl NextStage {
    fn send(&mut self, addr: SocketAddr, msg: &Msg) -> std::io::Result<()> {
        if self.conn.as_ref().is_some_and(|(w, _)| closed_by_peer(w)) {
            tracing::debug!(%addr, "prefill: the next stage closed its link; connecting again");
            self.conn = None;
        }
        if self.addr != Some(addr) || self.conn.is_none() {
            let (w, _r, session) = wire::connect(addr, Duration::from_secs(5), &self.secret)?;
            w.set_read_timeout(None)?;
            self.conn = Some((w, session.sealer));
            self.addr = Some(addr);
        }
        let r = self.conn.as_mut().map(|(w, sealer)| wire::send_sealed(w, sealer, msg));
        match r {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => {
                self.conn = None;
                Err(e)
            }
            None => Err(std::io::Error::other("no connection")),
        }
    }
}

/// A computed request's job for the next stage (its address, the job, where
/// decode hears of a failure), sent by its own thread ([`send_next`]): encoding
/// and writing a job's hidden states takes a millisecond or two, which the
/// engine thread would otherwise spend, job after job, between passes.
type NextJobs = Sender<(SocketAddr, Box<WirePrefillJob>, StageRoute)>;

/// Sends computed requests' jobs to the next stage, in order. A job the next
/// stage cannot be sent fails its request there (the next stage is charged
/// with it, as a peer this stage could not reach), and decode is told.
fn send_next(mut next: NextStage, rx: &Receiver<(SocketAddr, Box<WirePrefillJob>, StageRoute)>, notices: &Notices) {
    for (addr, job, route) in rx.iter() {
        let (request, nonce, stage) = (job.admitted.id, job.admitted.nonce, job.stage);
        if let Err(e) = next.send(addr, &Msg::Prefill(job)) {
            let cause = Cause::PeerDown { loss: PeerLoss::Dead, detail: format!("unreachable at {addr}: {e}") };
            let failure = Failure::new(PhaseName::Compute, ProcessRole::Prefill { stage }, cause);
            notify(notices, &route, &Notice::Failed { id: request, nonce: Some(nonce), stage, failure });
        }
    }
}

/// Notices to decode (write-done reports, failures), sent in order by their own
/// thread ([`send_notices`]) so that the engine never waits on decode.
type Notices = Sender<(PeerAddr, Vec<u8>, Instant)>;

fn notify(notices: &Notices, route: &StageRoute, notice: &Notice) {
    let Some(endpoint) = &route.endpoint else { return };
    match serde_json::to_vec(notice) {
        Ok(bytes) => {
            let _ = notices.send((endpoint.clone(), bytes, Instant::now()));
        }
        Err(e) => tracing::warn!(error = %e, "prefill: notice not encodable"),
    }
}

/// Sends the stage's notices to decode in order. A decode that is stopped or
/// slow (its socket buffer full, a write that times out) loses nothing: the notice
/// is retried until it goes or is older than `max_age` (decode fails the request
/// itself by then), and the notices behind it wait, so a report is never passed
/// by a later one. A decode that is gone (its socket refuses) is not waited for.
fn send_notices(transport: &dyn Transport, rx: &Receiver<(PeerAddr, Vec<u8>, Instant)>, max_age: Duration) {
    let mut pending: std::collections::VecDeque<(PeerAddr, Vec<u8>, Instant)> = std::collections::VecDeque::new();
    loop {
        if pending.is_empty() {
            match rx.recv() {
                Ok(n) => pending.push_back(n),
                Err(_) => return,
            }
        }
        pending.extend(rx.try_iter());
        while let Some((peer, bytes, at)) = pending.front() {
            match transport.notify(peer, bytes) {
                Ok(()) => {}
                Err(e @ crate::transport::TransportError::Disconnected { .. }) => tracing::warn!(error = %e, "prefill: decode is gone; notice dropped"),
                Err(e) if at.elapsed() > max_age => tracing::warn!(error = %e, "prefill: notice to decode dropped after {max_age:?}"),
                Err(e) => {
                    tracing::debug!(error = %e, queued = pending.len(), "prefill: notice to decode not taken; retrying");
                    std::thread::sleep(Duration::from_millis(20));
                    break;
                }
            }
            pending.pop_front();
        }
    }
}

/// The engine thread: jobs in, one tick, events out. It blocks while it holds no
/// request.
fn engine_loop(mut engine: Engine, stage: u32, notices: &Notices, mover: &MoverHandle, counts: &Mutex<Counts>, rx: &Receiver<StageCmd>, next: &NextJobs) {
    let mut route = StageRoute::default();
    loop {
        let wait = if engine.live_requests() > 0 { Duration::from_micros(200) } else { Duration::from_millis(100) };
        let mut jobs = Vec::new();
        match rx.recv_timeout(wait) {
            Ok(job) => jobs.push(job),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        jobs.extend(rx.try_iter());
        for cmd in jobs {
            match cmd {
                StageCmd::Job(job) => {
                    tracing::debug!(stage, request = job.admitted.id, "prefill: job in");
                    submit(&mut engine, stage, notices, mover, &mut route, *job);
                }
                // The release phase settles them; decode hears from carry_out.
                StageCmd::Settle { requests, endpoint, failure } => {
                    route.endpoint = Some(endpoint);
                    engine.settle(Settle { requests, failure });
                }
            }
        }
        let pass = Instant::now();
        engine.tick();
        carry_out(&mut engine, stage, notices, &route, next);
        // The pass's writes are reported before the next pass starts: they take
        // well under a millisecond on the device, while the next pass (jobs are
        // usually waiting) would hold their report back for the whole of it.
        // The wait is bounded by an eighth of the pass, so a slow transport
        // costs the compute little.
        let until = Instant::now() + (pass.elapsed() / 8).min(MAX_WRITE_WAIT);
        while engine.writes_outstanding() > 0 && Instant::now() < until {
            // The first round submits them; later ones sleep until one completes.
            mover.wait_completion(until.saturating_duration_since(Instant::now()));
            engine.tick();
            carry_out(&mut engine, stage, notices, &route, next);
        }
        *crate::base::lock(counts) = engine.counts();
    }
}

/// The longest a stage waits after a pass for its writes to be reported.
const MAX_WRITE_WAIT: Duration = Duration::from_millis(5);

/// Carries out a tick's events and outcomes: computed requests' jobs to the
/// next stage (with their sampling), write-done reports, settles and failures
/// to decode.
fn carry_out(engine: &mut Engine, stage: u32, notices: &Notices, route: &StageRoute, next: &NextJobs) {
    {
        for ev in engine.take_events() {
            match ev {
                EngineEvent::Computed { request, nonce, stage: s, hidden, consumers, sampling, .. } => {
                    tracing::debug!(stage, request, "prefill: computed; hidden states to the next stage");
                    let Some(&addr) = route.stages.get(s as usize + 1) else { continue };
                    let job = WirePrefillJob {
                        admitted: Admitted {
                            id: request,
                            nonce,
                            consumers,
                            handles: route.handles.clone(),
                            endpoint: route.endpoint.clone().unwrap_or(PeerAddr::Local { instance: 0 }),
                        },
                        prompt: Vec::new(),
                        stage: s + 1,
                        stages: route.stages.clone(),
                        hidden: Some(hidden),
                        sampling,
                    };
                    // The sender thread is gone only when the stage stops.
                    let _ = next.send((addr, Box::new(job), StageRoute { endpoint: route.endpoint.clone(), ..Default::default() }));
                }
                EngineEvent::Written(report) => {
                    tracing::debug!(stage, request = report.request, "prefill: written; telling decode");
                    notify(notices, route, &Notice::Written(report))
                }
                EngineEvent::Settled { request, nonce, failure } => {
                    tracing::info!(stage, request, "prefill: settled a request this stage never got");
                    notify(notices, route, &Notice::Failed { id: request, nonce: Some(nonce), stage, failure })
                }
                _ => {}
            }
        }
        for o in engine.take_outcomes() {
            if let Err(failure) = o.result {
                tracing::warn!(stage, request = o.request, phase = %failure.phase, %failure, "prefill failed");
                notify(notices, route, &Notice::Failed { id: o.request, nonce: o.nonce, stage, failure });
            }
        }
    }
}

/// Attaches decode's regions (once per published handle) and submits the job
/// (with its sampling); when it could not, decode is told why.
fn submit(engine: &mut Engine, stage: u32, notices: &Notices, mover: &MoverHandle, route: &mut StageRoute, job: WirePrefillJob) {
    let a = job.admitted;
    route.endpoint = Some(a.endpoint.clone());
    route.stages = job.stages;
    if route.handles != a.handles {
        route.handles = a.handles.clone();
    }
    for h in &a.handles {
        if !mover.attached(h)
            && let Err(e) = mover.attach_target(h)
        {
            let failure = Failure::new(PhaseName::Transfer, ProcessRole::Prefill { stage }, Cause::Transfer { detail: format!("attach {h}: {e}") });
            notify(notices, route, &Notice::Failed { id: a.id, nonce: Some(a.nonce), stage, failure });
            return;
        }
    }
    let tokens = job.hidden.as_ref().map_or(job.prompt.len() as u64, |h| {
        let d = engine.topology().model().hidden_size as u64;
        h.len() as u64 / d.max(1)
    });
    engine.submit_request(Submit {
        id: a.id,
        tokens,
        nonce: Some(a.nonce),
        consumers: a.consumers,
        inputs: Inputs { prompt: job.prompt, hidden: job.hidden },
        sampling: job.sampling,
        ..Default::default()
    });
}
