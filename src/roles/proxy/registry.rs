//! The roles' registration and heartbeats, the watchdog that marks a role down,
//! and `/health`.

use super::error::{Absence, NotReady, ServeError};
use super::state::{ALIVE, LATE, Peer, PeerState, Proxy, role_name, slot_role};
use crate::base::lock;
use crate::roles::openai::BodyError;
use crate::roles::wire::{Msg, Register};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use handoff_components::ecs::PhaseName;
use handoff_components::failure::{Cause, Failure, PeerLoss, ProcessRole};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

pub(super) async fn register(State(p): State<Arc<Proxy>>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    let auth = headers.get(crate::roles::wire::REGISTER_AUTH_HEADER).and_then(|v| v.to_str().ok());
    let at = match crate::roles::wire::check_register_auth(&p.secret, auth, &body, crate::roles::wire::unix_ms()) {
        Ok(at) => at,
        Err(why) => {
            lock(&p.metrics).unauthenticated_register += 1;
            tracing::warn!(%why, "refused an unauthenticated registration");
            return ServeError::ClusterSecret(why).into_response();
        }
    };
    let reg = match serde_json::from_slice::<Register>(&body) {
        Ok(r) => r,
        Err(e) => return ServeError::Body(BodyError::Malformed(e.to_string())).into_response(),
    };
    let pp = p.topo.prefill().pp;
    let slot = match (reg.role.as_str(), reg.stage) {
        ("decode", _) => 0,
        ("prefill", Some(s)) if s < pp => 1 + s as usize,
        _ => {
            let e = BodyError::Invalid { param: "role", message: format!("no role {:?} stage {:?} in this topology (pp {pp})", reg.role, reg.stage) };
            return ServeError::Body(e).into_response();
        }
    };
    {
        // Every registration of a slot is later than the one before, whichever
        // process sent it: one sent again is refused, so a captured heartbeat
        // cannot keep a stopped role looking alive.
        let mut roles = lock(&p.roles);
        let last = roles.last_auth[slot];
        if at <= last {
            drop(roles);
            let mut m = lock(&p.metrics);
            m.unauthenticated_register += 1;
            m.replayed_register += 1;
            drop(m);
            let why = crate::roles::wire::RegisterAuthError::Replayed { at, last };
            tracing::warn!(%why, role = %role_name(slot), "refused a replayed registration");
            return ServeError::ClusterSecret(why).into_response();
        }
        roles.last_auth[slot] = at;
    }
    let (replaced, settled) = {
        let mut roles = lock(&p.roles);
        let prev = roles.slots[slot].take();
        // A new process where a stopped one was: the old one is gone for good, so
        // what it might still have written is settled.
        let settled = prev.as_ref().filter(|old| old.reg.pid != reg.pid && old.state == PeerState::Stopped && slot > 0).map(|old| old.reg.addr);
        // A new process in an up slot: the old one died between two watchdog looks.
        let replaced = prev.as_ref().filter(|old| old.reg.pid != reg.pid && old.state == PeerState::Up).map(|old| (old.reg.pid, old.reg.addr));
        if let Some(old) = &prev
            && old.state != PeerState::Up
        {
            tracing::info!(role = %role_name(slot), pid = reg.pid, was = old.state.name(), "role is back");
        }
        roles.slots[slot] = Some(Peer { reg: reg.clone(), seen: Instant::now(), state: PeerState::Up, down: None });
        if replaced.is_some() {
            roles.downs[slot] += 1;
        }
        if replaced.is_some() || settled.is_some() {
            roles.settling[slot] += 1;
        }
        (replaced, settled)
    };
    if let Some((old, addr)) = replaced {
        went_down(&p, slot, true, format!("died (pid {old} replaced by pid {})", reg.pid), addr).await;
    } else if let Some(addr) = settled {
        went_down(&p, slot, true, format!("was replaced by pid {}", reg.pid), addr).await;
    }
    StatusCode::NO_CONTENT.into_response()
}

/// Watches every registered role's heartbeat (see the module docs).
pub(super) async fn watchdog(p: Arc<Proxy>) {
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let late: Vec<(usize, SocketAddr, Duration, u32)> = lock(&p.roles)
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref().filter(|s| s.state == PeerState::Up && s.seen.elapsed() > LATE).map(|s| (i, s.reg.addr, s.seen.elapsed(), s.reg.pid))
            })
            .collect();
        for (slot, addr, age, pid) in late {
            let probe = tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(addr)).await;
            let down = match probe {
                Ok(Err(e)) => Some((PeerState::Dead, format!("died (pid {pid}: {addr} refused: {e})"))),
                _ if age > ALIVE => Some((PeerState::Stopped, format!("stopped answering (pid {pid}: no heartbeat for {:.1} s)", age.as_secs_f64()))),
                _ => None,
            };
            let Some((state, why)) = down else { continue };
            let changed = {
                let mut roles = lock(&p.roles);
                match roles.slots[slot].as_mut() {
                    Some(peer) if peer.state == PeerState::Up && peer.reg.pid == pid => {
                        peer.state = state;
                        peer.down = Some((Instant::now(), why.clone()));
                        roles.downs[slot] += 1;
                        roles.settling[slot] += 1;
                        true
                    }
                    _ => false,
                }
            };
            if changed {
                tracing::warn!(role = %role_name(slot), %why, "role down");
                went_down(&p, slot, state == PeerState::Dead, why, addr).await;
            }
        }
    }
}

/// A role went down ([`role_down`]); then no down of `slot` is being carried
/// out any more (the caller counted it in `Roles::settling`).
async fn went_down(p: &Arc<Proxy>, slot: usize, dead: bool, why: String, addr: SocketAddr) {
    role_down(p, slot, dead, why, addr).await;
    let mut roles = lock(&p.roles);
    roles.settling[slot] = roles.settling[slot].saturating_sub(1);
}

/// A role went down: fail what depended on it (see the module docs). `addr`:
/// the control address of the process that went down. For decode, only the
/// requests on the link to that process fail: a link to a newer decode (a
/// restart registered before the old one was found dead) carries requests that
/// are fine, and the link of a dead one has failed its own as it closed.
pub(super) async fn role_down(p: &Arc<Proxy>, slot: usize, dead: bool, why: String, addr: SocketAddr) {
    if slot == 0 {
        let link = p.links.lock().await.decode.as_ref().filter(|(a, ..)| *a == addr).map(|(_, n, tx)| (*n, tx.clone()));
        let Some((link_id, link)) = link else { return };
        let routes: Vec<(u64, mpsc::UnboundedSender<Msg>, PhaseName)> = {
            let mut routes = lock(&p.routes);
            let ids: Vec<u64> = routes.iter().filter(|(_, r)| r.link == link_id).map(|(id, _)| *id).collect();
            ids.into_iter().filter_map(|id| routes.remove(&id).map(|r| (id, r.tx, r.phase))).collect()
        };
        let loss = if dead { PeerLoss::Dead } else { PeerLoss::Stopped };
        for (id, tx, phase) in routes {
            let failure = Failure::new(phase, ProcessRole::Decode, Cause::PeerDown { loss, detail: why.clone() });
            // A stopped decode reads the cancel when it resumes, and frees the request.
            // Not `unsent`: the request's task may be sending its job right
            // now; the task itself says so when it returns before sending.
            let _ = link.send(Msg::Cancel { id, failure: failure.clone(), unsent: false });
            let _ = tx.send(Msg::Error { id, failure });
        }
        if dead {
            let mut links = p.links.lock().await;
            if links.decode.as_ref().is_some_and(|(a, n, _)| *a == addr && *n == link_id) {
                links.decode = None;
            }
        }
    } else {
        let stage = (slot - 1) as u32;
        let link = p.links.lock().await.decode.as_ref().map(|(_, _, tx)| tx.clone());
        if let Some(l) = link {
            let _ = l.send(Msg::StageDown { stage, dead, message: why });
        }
        if stage == 0 && dead {
            let mut links = p.links.lock().await;
            if links.stage0.as_ref().is_some_and(|(a, ..)| *a == addr) {
                links.stage0 = None;
            }
        }
    }
}

/// A role's control port refused a connection: its process is gone. Marks it
/// dead (when `addr` is still its registered address) and says so as a 503: the
/// request had not started there, and is worth retrying once the role is back.
pub(super) async fn refused(p: &Arc<Proxy>, slot: usize, addr: SocketAddr, e: std::io::Error) -> ServeError {
    let why = format!("died ({addr} refused: {e})");
    let changed = {
        let mut roles = lock(&p.roles);
        match roles.slots[slot].as_mut() {
            Some(peer) if peer.reg.addr == addr && peer.state == PeerState::Up => {
                peer.state = PeerState::Dead;
                peer.down = Some((Instant::now(), why.clone()));
                roles.downs[slot] += 1;
                roles.settling[slot] += 1;
                true
            }
            _ => false,
        }
    };
    if changed {
        tracing::warn!(role = %role_name(slot), %why, "role down");
        went_down(p, slot, true, why.clone(), addr).await;
    }
    ServeError::NotReady(NotReady(vec![Absence::Down { role: slot_role(slot), why }]))
}

/// Decode's and every stage's control address, or which roles are down.
pub(super) fn peers(p: &Proxy) -> Result<(SocketAddr, Vec<SocketAddr>), NotReady> {
    let roles = lock(&p.roles);
    let mut missing = Vec::new();
    let mut addrs = Vec::new();
    for (i, s) in roles.slots.iter().enumerate() {
        match s {
            Some(peer) if peer.state == PeerState::Up && peer.seen.elapsed() < ALIVE => addrs.push(peer.reg.addr),
            Some(peer) => {
                let why = peer.down.as_ref().map_or_else(|| "stopped answering".to_string(), |(t, w)| format!("{w}, {:.1} s ago", t.elapsed().as_secs_f64()));
                missing.push(Absence::Down { role: slot_role(i), why });
            }
            None => missing.push(Absence::Unregistered(slot_role(i))),
        }
    }
    if missing.is_empty() { Ok((addrs[0], addrs[1..].to_vec())) } else { Err(NotReady(missing)) }
}

/// Every slot's registered process id now (0: none registered).
pub(super) fn pids(p: &Proxy) -> Vec<u32> {
    lock(&p.roles).slots.iter().map(|s| s.as_ref().map_or(0, |s| s.reg.pid)).collect()
}

/// How long after a fault the same process must have registered again to
/// count as alive: heartbeats come every 300 ms, so a live role passes within
/// about 0.7 s, and a heartbeat the dead one sent just before it died never does.
const PROVEN_ALIVE: Duration = Duration::from_millis(350);

/// Whether the role of `slot` is back for a request that lost its process `pid`
/// at `since`: every role is up (as [`peers`] sees them), no down of any role
/// is still being carried out (decode told of a dead stage, a dead decode's
/// link dropped), and the slot holds another process, or the same one proved
/// alive by a heartbeat well after `since`.
pub(super) fn back_after(p: &Proxy, slot: usize, pid: u32, since: Instant) -> bool {
    if peers(p).is_err() {
        return false;
    }
    let roles = lock(&p.roles);
    if roles.settling.iter().any(|&n| n > 0) {
        return false;
    }
    roles
        .slots
        .get(slot)
        .and_then(Option::as_ref)
        .is_some_and(|peer| peer.state == PeerState::Up && (peer.reg.pid != pid || peer.seen.checked_duration_since(since).is_some_and(|d| d > PROVEN_ALIVE)))
}

/// Whether the role of `slot` is stopped (its heartbeats stopped with its port
/// open): it may resume and still write, so it is not retried around.
pub(super) fn stopped(p: &Proxy, slot: usize) -> bool {
    lock(&p.roles).slots.get(slot).and_then(Option::as_ref).is_some_and(|peer| peer.state == PeerState::Stopped)
}

pub(super) fn roles_json(p: &Proxy) -> Value {
    let roles = lock(&p.roles);
    let list: Vec<Value> = roles
        .slots
        .iter()
        .enumerate()
        .map(|(i, s)| match s {
            Some(peer) => {
                json!({"role": role_name(i), "pid": peer.reg.pid, "addr": peer.reg.addr.to_string(), "state": peer.state.name(), "restarts": peer.reg.restarts,
                                 "heartbeat_age_s": peer.seen.elapsed().as_secs_f64(), "down": peer.down.as_ref().map(|d| d.1.clone())})
            }
            None => json!({"role": role_name(i), "state": "unregistered"}),
        })
        .collect();
    let mut list = list;
    list.insert(0, json!({"role": "proxy", "pid": std::process::id(), "state": "up", "restarts": p.restarts}));
    json!(list)
}

pub(super) async fn health(State(p): State<Arc<Proxy>>) -> Response {
    if p.draining.load(Ordering::SeqCst) {
        let m = format!("draining: {} requests in flight", p.inflight.load(Ordering::SeqCst));
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "draining", "message": m, "roles": roles_json(&p)}))).into_response();
    }
    match peers(&p) {
        Ok(_) => (StatusCode::OK, axum::Json(json!({"status": "ok", "roles": roles_json(&p)}))).into_response(),
        Err(m) => {
            (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "unavailable", "message": m.to_string(), "roles": roles_json(&p)}))).into_response()
        }
    }
}
