//! The proxy's links to decode and to prefill stage 0: the control handshake,
//! one shared connection each, and the routing of decode's messages by request.

use super::error::ServeError;
use super::registry::refused;
use super::state::{ChoiceRoute, PeerState, Proxy};
use crate::base::lock;
use crate::roles::wire::{ControlSession, Msg, RecvError};
use crate::transport::auth::{ClusterSecret, Sealer};
use handoff_components::ecs::PhaseName;
use handoff_components::failure::{Cause, Failure, PeerLoss, ProcessRole};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// The connecting side of a control handshake ([`crate::roles::wire::answer_control`]),
/// each step within [`crate::roles::wire::HANDSHAKE_TIMEOUT`]: the proxy's
/// session once the listener proved the secret in turn.
pub(super) async fn answer_challenge(
    r: &mut (impl AsyncBufRead + Unpin),
    w: &mut (impl AsyncWrite + Unpin),
    secret: &ClusterSecret,
) -> std::io::Result<ControlSession> {
    let t = crate::roles::wire::HANDSHAKE_TIMEOUT;
    let late = |what: &str| std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no {what} within {t:?}"));
    let mut line = Vec::new();
    let n = tokio::time::timeout(t, (&mut *r).take(1024).read_until(b'\n', &mut line)).await.map_err(|_| late("challenge"))??;
    if n == 0 {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the listener closed before its challenge"));
    }
    let (answer, answered) = crate::roles::wire::answer_line(secret, &line)?;
    tokio::time::timeout(t, w.write_all(&answer)).await.map_err(|_| late("room for the answer"))??;
    line.clear();
    let n = tokio::time::timeout(t, (&mut *r).take(1024).read_until(b'\n', &mut line)).await.map_err(|_| late("proof from the listener"))??;
    if n == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "the listener closed instead of proving the cluster secret (does it share this one?)",
        ));
    }
    crate::roles::wire::check_acceptor(secret, &answered, &line)
}

/// What a failed control handshake with `role` at `addr` fails a request with: a
/// step that ran past its wait is a timeout, anything else a broken protocol.
fn handshake_failure(phase: PhaseName, role: ProcessRole, addr: SocketAddr, e: &std::io::Error) -> Failure {
    let detail = format!("control handshake with {addr}: {e}");
    let cause = match e.kind() {
        std::io::ErrorKind::TimedOut => Cause::Timeout { after: crate::roles::wire::HANDSHAKE_TIMEOUT, waiting_for: Vec::new(), detail },
        _ => Cause::Protocol { detail },
    };
    Failure::new(phase, role, cause)
}

/// Writes one sealed control line.
pub(super) async fn send_line(s: &mut tokio::net::tcp::OwnedWriteHalf, sealer: &mut Sealer, m: &Msg) -> std::io::Result<()> {
    let mut line = Vec::new();
    crate::roles::wire::seal_into(&mut line, sealer, m)?;
    s.write_all(&line).await
}

/// The link to decode at `addr`: opened on first use, one reader task routing
/// decode's messages by request id; a lost link fails every request it carried.
pub(super) async fn decode_link(p: &Arc<Proxy>, addr: SocketAddr) -> Result<(u64, mpsc::UnboundedSender<Msg>), ServeError> {
    let mut links = p.links.lock().await;
    if let Some((a, n, tx)) = &links.decode
        && *a == addr
        && !tx.is_closed()
    {
        return Ok((*n, tx.clone()));
    }
    let connect_wait = Duration::from_secs(5);
    let conn = match tokio::time::timeout(connect_wait, TcpStream::connect(addr)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            drop(links);
            return Err(refused(p, 0, addr, e).await);
        }
        Err(_) => {
            let cause = Cause::Timeout { after: connect_wait, waiting_for: Vec::new(), detail: format!("connect to {addr}") };
            return Err(ServeError::Failed(Failure::new(PhaseName::Admission, ProcessRole::Decode, cause)));
        }
    };
    let _ = conn.set_nodelay(true);
    let (rd, mut wr) = conn.into_split();
    let mut rd = BufReader::new(rd);
    let ControlSession { mut sealer, mut opener } = match answer_challenge(&mut rd, &mut wr, &p.secret).await {
        Ok(s) => s,
        Err(e) => return Err(ServeError::Failed(handshake_failure(PhaseName::Admission, ProcessRole::Decode, addr, &e))),
    };
    let (tx, mut out) = mpsc::unbounded_channel::<Msg>();
    let routes = Arc::clone(&p.routes);
    let proxy = Arc::clone(p);
    let link = p.next_link.fetch_add(1, Ordering::SeqCst);
    tokio::spawn(async move {
        // The writer is its own task: a read cancelled half-way by a select would
        // lose the bytes of a partly read line.
        let writer = tokio::spawn(async move {
            while let Some(m) = out.recv().await {
                if send_line(&mut wr, &mut sealer, &m).await.is_err() {
                    break;
                }
            }
        });
        let mut line = Vec::new();
        loop {
            // Bounded like every control line: a line without end breaks the link
            // instead of growing the buffer without bound.
            match crate::roles::wire::read_line_async(&mut rd, &mut line, crate::roles::wire::MAX_LINE).await {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "proxy: the link from decode failed");
                    break;
                }
            }
            let m = match crate::roles::wire::open_line(&mut opener, &line) {
                Ok(m) => m,
                // Not this link's next line: nothing after it can be trusted.
                Err(RecvError::Refused(e)) => {
                    lock(&proxy.metrics).refused_control_messages += 1;
                    tracing::warn!(error = %e, "proxy: refused a message from decode; link closed");
                    break;
                }
                Err(RecvError::Io(e)) => {
                    tracing::warn!(error = %e, "proxy: malformed message from decode");
                    continue;
                }
            };
            let id = match &m {
                Msg::Admitted(a) => a.id,
                Msg::Token { id, .. } | Msg::Done { id, .. } | Msg::Error { id, .. } => *id,
                Msg::Orphaned { stage, requests, endpoint, failure } => {
                    settle(&proxy, *stage, requests.clone(), endpoint.clone(), failure.clone());
                    continue;
                }
                _ => continue,
            };
            if let Some(r) = lock(&routes).get(&id) {
                let _ = r.tx.send(m);
            }
        }
        writer.abort();
        // The link is gone: every request it carried fails, naming decode and the
        // phase each was in.
        let lost: Vec<(u64, ChoiceRoute)> = {
            let mut routes = lock(&routes);
            let ids: Vec<u64> = routes.iter().filter(|(_, r)| r.link == link).map(|(id, _)| *id).collect();
            ids.into_iter().filter_map(|id| routes.remove(&id).map(|r| (id, r))).collect()
        };
        for (id, r) in lost {
            let cause = Cause::PeerDown { loss: PeerLoss::Dead, detail: format!("died (its link at {addr} closed)") };
            let _ = r.tx.send(Msg::Error { id, failure: Failure::new(r.phase, ProcessRole::Decode, cause) });
        }
    });
    links.decode = Some((addr, link, tx.clone()));
    Ok((link, tx))
}

/// Asks prefill stage `stage` to settle requests that an earlier stage's death
/// left waiting for it (see [`Msg::Settle`]). Best effort, on its own connection:
/// a stage that is down has its own StageDown, and a stage that cannot be reached
/// leaves the requests to their phase deadline, as before.
pub(super) fn settle(p: &Arc<Proxy>, stage: u32, requests: Vec<(u64, u64)>, endpoint: crate::transport::PeerAddr, failure: Failure) {
    let addr = lock(&p.roles).slots.get(stage as usize + 1).and_then(|s| s.as_ref().filter(|s| s.state == PeerState::Up).map(|s| s.reg.addr));
    let Some(addr) = addr else { return };
    let n = requests.len();
    let secret = p.secret.clone();
    tokio::spawn(async move {
        let sent = async {
            let conn = TcpStream::connect(addr).await?;
            let (rd, mut wr) = conn.into_split();
            let mut session = answer_challenge(&mut BufReader::new(rd), &mut wr, &secret).await?;
            send_line(&mut wr, &mut session.sealer, &Msg::Settle { requests, endpoint, failure }).await?;
            wr.shutdown().await
        };
        match tokio::time::timeout(Duration::from_secs(2), sent).await {
            Ok(Ok(())) => tracing::info!(stage, requests = n, "asked the stage to settle requests an earlier stage's death left waiting"),
            Ok(Err(e)) => tracing::warn!(stage, error = %e, "settle: stage unreachable"),
            Err(_) => tracing::warn!(stage, "settle: stage did not take the message in time"),
        }
    });
}

/// Sends a job to stage 0 over its link (reopened when it broke). A write that
/// does not complete within 2 s fails (a stopped stage 0 must not hold the link).
/// An error says whether the job may have reached the stage: not when the stage
/// could not be connected to, maybe when a write on the link failed or stalled.
pub(super) async fn send_stage0(p: &Arc<Proxy>, addr: SocketAddr, msg: &Msg) -> Result<(), (ServeError, Reached)> {
    let failed = |cause: Cause| ServeError::Failed(Failure::new(PhaseName::Compute, ProcessRole::Prefill { stage: 0 }, cause));
    let late = |after: Duration, detail: String| failed(Cause::Timeout { after, waiting_for: Vec::new(), detail });
    let gone = |detail: String| failed(Cause::PeerDown { loss: PeerLoss::Dead, detail });
    let unsent = |e: ServeError| (e, Reached::No);
    let maybe = |e: ServeError| (e, Reached::Maybe);
    let wait = Duration::from_secs(2);
    let mut links = p.links.lock().await;
    for attempt in 0..2 {
        if links.stage0.as_ref().is_none_or(|(a, _, _)| *a != addr) {
            let conn = match tokio::time::timeout(wait, TcpStream::connect(addr)).await {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    drop(links);
                    return Err(unsent(refused(p, 1, addr, e).await));
                }
                Err(_) => return Err(unsent(late(wait, format!("connect to {addr}")))),
            };
            let _ = conn.set_nodelay(true);
            let (rd, mut wr) = conn.into_split();
            let session = match answer_challenge(&mut BufReader::new(rd), &mut wr, &p.secret).await {
                Ok(s) => s,
                Err(e) => return Err(unsent(ServeError::Failed(handshake_failure(PhaseName::Compute, ProcessRole::Prefill { stage: 0 }, addr, &e)))),
            };
            links.stage0 = Some((addr, wr, session.sealer));
        }
        let Some((_, w, sealer)) = links.stage0.as_mut() else { continue };
        match tokio::time::timeout(wait, send_line(w, sealer, msg)).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => {
                links.stage0 = None;
                if attempt == 1 {
                    return Err(maybe(gone(format!("the link at {addr} failed: {e}"))));
                }
            }
            Err(_) => {
                links.stage0 = None;
                return Err(maybe(late(wait, format!("the job's write to {addr} did not complete"))));
            }
        }
    }
    Err(maybe(gone(format!("not reachable at {addr}"))))
}

/// Whether a job that failed to send may have reached its stage.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Reached {
    No,
    Maybe,
}
