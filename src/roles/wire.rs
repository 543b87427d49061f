//! What travels between the role processes, and the small clients that carry it.
//!
//! Control messages are JSON, one per line, over a TCP connection on loopback (or
//! any host the roles can reach): the proxy opens one connection per request to
//! decode and one to prefill stage 0; stage s opens one to stage s + 1. Region
//! bytes never travel here: they move through the configured [`Transport`] from
//! the prefill stages straight into decode's registered regions, and each stage's
//! write-done report travels as a transport notification ([`StageReport`]), so a
//! report is received only after the bytes it reports are in place.
//!
//! Every control connection starts with a mutual handshake ([`accept_control`],
//! [`answer_control`]; see [`crate::transport::auth`]): the accepting role sends
//! `{"challenge": Na}` (64 hex digits, fresh for each connection), the connecting
//! one answers `{"nonce": Nc, "auth": proof(connector, Na, Nc)}`, and the
//! acceptor, once that proved the cluster secret, answers `{"auth": proof(acceptor,
//! Na, Nc)}`. The acceptor reads nothing else until the connector proved the
//! secret and closes the connection (counting it) when it does not; the connector
//! sends nothing until the acceptor proved it, and gives the connection up
//! ([`AcceptorUnproven`]) when it does not.
//!
//! After the handshake every line, in both directions, is `<MAC> <JSON>\n`: 64
//! hex digits of the MAC under the connection's session key over the JSON's
//! bytes and the line's number in its direction ([`seal_into`], [`open_line`]).
//! A prefix rather than a field, so the MAC covers the exact bytes that are
//! parsed (no canonical re-encoding). A line that does not open (altered,
//! replayed, reordered, from another connection, or bare) is refused
//! ([`RecvError::Refused`]): the reader closes the connection and counts it
//! (`handoff_refused_frames_total{kind="control"}`).
//!
//! [`http`] is a minimal HTTP/1.1 client (one request per connection) that the
//! roles use to register with the proxy and that tests, `demo` and `bench` use to
//! talk to the proxy.
//!
//! [`Transport`]: crate::transport::Transport

use super::sampling::Sampling;
use crate::engine::Counts;
use crate::transport::auth::{ClusterSecret, End, MessageRefused, Opener, Sealer, SessionKey, context};
use crate::transport::{PeerAddr, RegionHandle};
use handoff_components::ecs::StageReport;
use handoff_components::failure::Failure;
use handoff_components::layout::ConsumerLayout;
use serde::{Deserialize, Serialize};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Longest control line accepted by default (a prefill job carries the hidden
/// states; a stage's link takes [`stage_line_limit`] of its topology).
pub const MAX_LINE: u64 = 256 << 20;

/// Longest line a prefill stage's link must take for `topo`: a job of
/// `serve.max_context` tokens with the previous stage's hidden states (base64
/// of `max_context x hidden` f32s, 4 characters per 3 bytes) and its prompt,
/// with headroom; never below [`MAX_LINE`]. A 32K-token prompt of a
/// 2,048-wide model is 358 MB of base64, past the default.
pub fn stage_line_limit(topo: &handoff_components::Topology) -> u64 {
    let tokens = u64::from(topo.config.serve.max_context);
    let hidden_bytes = tokens * u64::from(topo.model().hidden_size) * 4;
    (hidden_bytes.div_ceil(3) * 4 + 16 * tokens + (1 << 20)).max(MAX_LINE)
}

/// One control message. Every message names its request, so one connection carries
/// every request between two roles.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Msg {
    /// proxy -> decode: admit a request (allocate blocks and slots, publish layouts).
    /// `sampling`: how decode picks tokens 1.. (None: greedy). `forced`: the
    /// tokens a retried request already streamed, which decode feeds back in
    /// place of its own picks (`forced[k]` at position prompt + k, the steps of
    /// the first run again) before it generates on; empty for a first run.
    Admit {
        id: u64,
        prompt_tokens: u64,
        max_tokens: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sampling: Option<Sampling>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        forced: Vec<u8>,
    },
    /// decode -> proxy: the request is placed; what every decode rank published.
    Admitted(Box<Admitted>),
    /// decode -> proxy: one generated token.
    Token { id: u64, token: u8 },
    /// decode -> proxy: the request finished; decode's own figures, and the
    /// longest of the stages' hand-off tails (last layer computed to write-done).
    Done {
        id: u64,
        handoff_ms: f64,
        decode_ms: f64,
        bytes: u64,
        #[serde(default)]
        tail_ms: Option<f64>,
        /// The compute time of the stage with that tail (its batch, first
        /// layer to last): what the tail is set against.
        #[serde(default)]
        stage_prefill_ms: Option<f64>,
    },
    /// decode -> proxy (and the proxy's own links to a request's task): the
    /// request failed; the failure names the phase, the role and the cause.
    Error { id: u64, failure: Failure },
    /// proxy -> decode: fail a request (its prefill could not start, its client
    /// went away); decode frees it. `unsent`: the proxy never sent its prefill
    /// job to a stage, so no stage will write (see `ecs::Cancel::unsent`).
    Cancel {
        id: u64,
        failure: Failure,
        #[serde(default)]
        unsent: bool,
    },
    /// proxy -> stage 0, stage s -> stage s + 1: compute and hand off.
    Prefill(Box<WirePrefillJob>),
    /// proxy -> decode: prefill stage `stage` died (`dead`: its process is gone, so
    /// it writes no more) or stopped answering; decode fails every request still
    /// waiting for that stage's writes, naming it.
    StageDown { stage: u32, dead: bool, message: String },
    /// decode -> proxy: these requests (id, nonce) wait for prefill stage `stage`,
    /// which may never receive them (an earlier stage died before passing them
    /// on); the proxy asks the stage to settle them. `endpoint`: decode's transport
    /// address, where the stage sends its answer; `failure`: the earlier stage's.
    Orphaned { stage: u32, requests: Vec<(u64, u64)>, endpoint: PeerAddr, failure: Failure },
    /// proxy -> prefill stage: settle these requests (id, nonce): one the stage
    /// holds fails (after its writes in flight complete) with `failure`; one it
    /// does not hold it will never take. Either way it tells decode it writes no
    /// more for them.
    Settle { requests: Vec<(u64, u64)>, endpoint: PeerAddr, failure: Failure },
}

/// What decode publishes for one admitted request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Admitted {
    pub id: u64,
    pub nonce: u64,
    /// One per decode rank, in rank order.
    pub consumers: Vec<ConsumerLayout>,
    /// Every decode region, for producers to attach.
    pub handles: Vec<RegionHandle>,
    /// Where write-done reports go.
    pub endpoint: PeerAddr,
}

/// A request as a prefill stage receives it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WirePrefillJob {
    pub admitted: Admitted,
    /// Byte-level prompt tokens.
    pub prompt: Vec<u8>,
    /// The stage this job is addressed to.
    pub stage: u32,
    /// Control address of every stage, in order.
    pub stages: Vec<SocketAddr>,
    /// Hidden states `[tokens, hidden]` from the previous stage (none for stage 0),
    /// as base64 of the little-endian f32 bytes: a JSON array of decimal floats
    /// cost the next stage a tenth of its CPU to parse.
    #[serde(with = "f32_base64")]
    pub hidden: Option<Vec<f32>>,
    /// How the last stage picks token 0 (None: greedy); each stage passes it on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling: Option<Sampling>,
}

/// `Option<Vec<f32>>` as a base64 string of little-endian f32 bytes.
mod f32_base64 {
    use base64::Engine as _;
    use base64::engine::general_purpose::STANDARD;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<Vec<f32>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            None => s.serialize_none(),
            Some(xs) => {
                let bytes: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
                s.serialize_some(&STANDARD.encode(bytes))
            }
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<f32>>, D::Error> {
        let Some(text) = Option::<String>::deserialize(d)? else { return Ok(None) };
        let bytes = STANDARD.decode(text.as_bytes()).map_err(serde::de::Error::custom)?;
        if bytes.len() % 4 != 0 {
            return Err(serde::de::Error::custom(format!("hidden states of {} bytes are not whole f32s", bytes.len())));
        }
        Ok(Some(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()))
    }
}

/// What a stage tells decode over the transport (after its writes completed, so a
/// report is received only after the bytes it reports are in place).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Notice {
    /// Every write of the stage for the request completed.
    Written(StageReport),
    /// Stage `stage` failed the request (and writes no more for it); `failure`
    /// says in which phase, charged to which role, why. `nonce` is the request's
    /// life when the stage knew it.
    Failed { id: u64, nonce: Option<u64>, stage: u32, failure: Failure },
}

/// What a role tells the proxy about itself (POST /internal/register, repeated as
/// a heartbeat).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Register {
    /// `"decode"` or `"prefill"`.
    pub role: String,
    pub stage: Option<u32>,
    pub addr: SocketAddr,
    pub pid: u32,
    /// What the role's engine holds now.
    pub counts: Counts,
    /// Resident memory of the role process, bytes.
    pub rss_bytes: u64,
    /// How many times `up` restarted this role (its `HANDOFF_RESTARTS`).
    #[serde(default)]
    pub restarts: u32,
    /// The engine's run times per system, since the process started.
    #[serde(default)]
    pub timings: Vec<super::prom::SystemTiming>,
    /// Connections (or shm datagrams) this process refused for not proving the
    /// cluster secret, by listener: `control`, `tcp`, `shm`.
    #[serde(default)]
    pub unauthenticated: std::collections::BTreeMap<String, u64>,
    /// Messages this process refused after a handshake (altered, replayed,
    /// reordered, from another connection), by kind: `control`, `tcp`, `shm`.
    #[serde(default)]
    pub refused_frames: std::collections::BTreeMap<String, u64>,
}

impl Register {
    /// A registration of `role` (stage `stage`) at `addr` by process `pid`,
    /// with nothing held, counted or refused yet.
    pub fn new(role: &str, stage: Option<u32>, addr: SocketAddr, pid: u32) -> Register {
        Register {
            role: role.to_string(),
            stage,
            addr,
            pid,
            counts: Counts::default(),
            rss_bytes: 0,
            restarts: 0,
            timings: Vec::new(),
            unauthenticated: Default::default(),
            refused_frames: Default::default(),
        }
    }
}

/// The header that proves a register request: `<unix ms>.<hex MAC>`.
pub const REGISTER_AUTH_HEADER: &str = "x-handoff-auth";

/// The [`REGISTER_AUTH_HEADER`] value for `body`, sent at `unix_ms`.
pub fn register_auth(secret: &ClusterSecret, unix_ms: u64, body: &[u8]) -> String {
    let ts = unix_ms.to_string();
    format!("{ts}.{}", crate::transport::auth::to_hex(&secret.mac(context::REGISTER, &[ts.as_bytes(), b"\n", body])))
}

/// Why a register request's [`REGISTER_AUTH_HEADER`] does not prove it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterAuthError {
    #[error("no {REGISTER_AUTH_HEADER} header")]
    Missing,
    #[error("{REGISTER_AUTH_HEADER} is not <unix ms>.<hex MAC>")]
    Malformed,
    #[error("{REGISTER_AUTH_HEADER} timestamp {0:?} is not a number")]
    Timestamp(String),
    #[error("the MAC does not prove the cluster secret")]
    Mac,
    #[error("timestamp {at} ms is more than {window} ms before or {ahead} ms after the proxy's clock {now} ms")]
    Stale { at: u64, window: u64, ahead: u64, now: u64 },
    #[error("timestamp {at} ms is not after this role's last accepted one, {last} ms: a replay")]
    Replayed { at: u64, last: u64 },
}

/// How far ahead of the proxy's clock a register timestamp may be (the roles of
/// one `up` share a host, and so a clock).
pub const REGISTER_AHEAD: Duration = Duration::from_secs(2);

/// Checks a [`REGISTER_AUTH_HEADER`] value against `body` at `now_ms`: its
/// timestamp when it proves the body, why not otherwise. (The proxy refuses a
/// timestamp that is not after the role's last accepted one: a replay.)
pub fn check_register_auth(secret: &ClusterSecret, header: Option<&str>, body: &[u8], now_ms: u64) -> Result<u64, RegisterAuthError> {
    let h = header.ok_or(RegisterAuthError::Missing)?;
    let (ts, mac) = h.split_once('.').ok_or(RegisterAuthError::Malformed)?;
    let t = ts.parse::<u64>().map_err(|_| RegisterAuthError::Timestamp(ts.to_string()))?;
    let mac = crate::transport::auth::from_hex(mac).unwrap_or_default();
    if !secret.verify(context::REGISTER, &[ts.as_bytes(), b"\n", body], &mac) {
        return Err(RegisterAuthError::Mac);
    }
    let window = crate::transport::auth::REGISTER_WINDOW.as_millis() as u64;
    let ahead = REGISTER_AHEAD.as_millis() as u64;
    if t + window < now_ms || t > now_ms + ahead {
        return Err(RegisterAuthError::Stale { at: t, window, ahead, now: now_ms });
    }
    Ok(t)
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// How long each side of a control handshake waits for the other's line.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Serialize, Deserialize)]
struct Challenge {
    challenge: String,
}

/// The connector's answer: its nonce and its proof.
#[derive(Serialize, Deserialize)]
struct Answer {
    nonce: String,
    auth: String,
}

/// The acceptor's proof, its last handshake line.
#[derive(Serialize, Deserialize)]
struct Proof {
    auth: String,
}

/// The sealing and checking halves of one control connection, for the side
/// that holds them.
#[derive(Debug)]
pub struct ControlSession {
    /// Seals what this side sends.
    pub sealer: Sealer,
    /// Checks what the other side sends.
    pub opener: Opener,
}

impl ControlSession {
    fn new(key: &SessionKey, me: End) -> ControlSession {
        let peer = if me == End::Acceptor { End::Connector } else { End::Acceptor };
        ControlSession { sealer: key.sealer(me), opener: key.opener(peer) }
    }
}

/// A control listener that did not prove the cluster secret in the handshake:
/// the connector sends it nothing.
#[derive(Debug, thiserror::Error)]
#[error("the control listener did not prove the cluster secret ({0}): nothing sent to it")]
pub struct AcceptorUnproven(pub String);

fn unproven(why: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, AcceptorUnproven(why.into()))
}

fn hex32(text: &str) -> Option<Vec<u8>> {
    crate::transport::auth::from_hex(text).filter(|n| n.len() == 32)
}

/// The line an acceptor sends first, for `nonce`.
pub fn challenge_line(nonce: &[u8; 32]) -> Vec<u8> {
    let mut line = serde_json::to_vec(&Challenge { challenge: crate::transport::auth::to_hex(nonce) }).unwrap_or_default();
    line.push(b'\n');
    line
}

/// The connector's half-done handshake: the two nonces, until the acceptor's
/// proof comes.
#[derive(Debug)]
pub struct Answered {
    na: Vec<u8>,
    nc: [u8; 32],
}

/// The answer line to an acceptor's challenge line, with a fresh nonce of the
/// connector's, and what [`check_acceptor`] needs next.
pub fn answer_line(secret: &ClusterSecret, challenge: &[u8]) -> io::Result<(Vec<u8>, Answered)> {
    let nc = crate::transport::auth::nonce()?;
    let bad = |m: String| io::Error::new(io::ErrorKind::InvalidData, m);
    let c: Challenge = serde_json::from_slice(challenge).map_err(|e| bad(format!("expected a control challenge line: {e}")))?;
    let na = hex32(&c.challenge).ok_or_else(|| bad(format!("challenge {:?} is not 64 hex digits", c.challenge)))?;
    let auth = secret.proof(context::CONTROL, End::Connector, &na, &nc, b"");
    let answer = Answer { nonce: crate::transport::auth::to_hex(&nc), auth: crate::transport::auth::to_hex(&auth) };
    let mut line = serde_json::to_vec(&answer).map_err(io::Error::other)?;
    line.push(b'\n');
    Ok((line, Answered { na, nc }))
}

/// Checks the acceptor's proof line: the connector's session when it proves the
/// secret over both nonces, [`AcceptorUnproven`] (as `PermissionDenied`) when not.
pub fn check_acceptor(secret: &ClusterSecret, answered: &Answered, line: &[u8]) -> io::Result<ControlSession> {
    let given = serde_json::from_slice::<Proof>(line).ok().and_then(|p| crate::transport::auth::from_hex(&p.auth)).unwrap_or_default();
    let want = secret.proof(context::CONTROL, End::Acceptor, &answered.na, &answered.nc, b"");
    if !crate::transport::auth::ct_eq(&want, &given) {
        return Err(unproven("its proof line does not prove it"));
    }
    Ok(ControlSession::new(&secret.session(context::CONTROL, &answered.na, &answered.nc), End::Connector))
}

/// The connecting side's handshake: reads the challenge from `r`, answers on
/// `w`, and checks the acceptor's proof; this side's session when it holds.
pub fn answer_control(w: &mut impl Write, r: &mut impl BufRead, secret: &ClusterSecret) -> io::Result<ControlSession> {
    let mut line = Vec::new();
    if r.take(1024).read_until(b'\n', &mut line)? == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the control listener closed before its challenge"));
    }
    let (answer, answered) = answer_line(secret, &line)?;
    w.write_all(&answer)?;
    w.flush()?;
    line.clear();
    if r.take(1024).read_until(b'\n', &mut line)? == 0 {
        return Err(unproven("it closed the connection instead (does it share this cluster secret?)"));
    }
    check_acceptor(secret, &answered, &line)
}

/// Why [`accept_control`] let a connection in or not.
#[derive(Debug)]
pub enum Admission {
    /// The peer closed before it answered anything (a liveness probe): not a refusal.
    Closed,
    /// The peer did not prove the secret.
    Refused(String),
}

/// The accepting side's handshake on a new control connection: the reader to
/// read its messages from and this side's session, once the peer proved
/// `secret` (and was sent this side's proof).
pub fn accept_control(conn: TcpStream, secret: &ClusterSecret) -> Result<(BufReader<TcpStream>, ControlSession), Admission> {
    let io = |e: io::Error| Admission::Refused(format!("handshake: {e}"));
    let na = crate::transport::auth::nonce().map_err(io)?;
    (&conn).write_all(&challenge_line(&na)).map_err(|_| Admission::Closed)?;
    conn.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(io)?;
    let mut r = BufReader::new(conn);
    let mut line = Vec::new();
    match r.by_ref().take(1024).read_until(b'\n', &mut line) {
        Ok(0) => return Err(Admission::Closed),
        Ok(_) => {}
        Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionReset) => return Err(Admission::Closed),
        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
            return Err(Admission::Refused(format!("no answer to the challenge within {HANDSHAKE_TIMEOUT:?}")));
        }
        Err(e) => return Err(io(e)),
    }
    let answer = serde_json::from_slice::<Answer>(&line).ok();
    let nc = answer.as_ref().and_then(|a| hex32(&a.nonce)).unwrap_or_default();
    let given = answer.and_then(|a| crate::transport::auth::from_hex(&a.auth)).unwrap_or_default();
    if !crate::transport::auth::ct_eq(&secret.proof(context::CONTROL, End::Connector, &na, &nc, b""), &given) {
        return Err(Admission::Refused("the first line does not prove the cluster secret".into()));
    }
    let proof = Proof { auth: crate::transport::auth::to_hex(&secret.proof(context::CONTROL, End::Acceptor, &na, &nc, b"")) };
    let mut out = serde_json::to_vec(&proof).map_err(|e| io(io::Error::other(e)))?;
    out.push(b'\n');
    r.get_ref().write_all(&out).map_err(io)?;
    r.get_ref().set_read_timeout(None).map_err(io)?;
    Ok((r, ControlSession::new(&secret.session(context::CONTROL, &na, &nc), End::Acceptor)))
}

/// Why a sealed control line was not read.
#[derive(Debug, thiserror::Error)]
pub enum RecvError {
    /// The connection failed, or the line was too long or not a message.
    #[error(transparent)]
    Io(#[from] io::Error),
    /// The line does not carry its MAC: the reader closes the connection.
    #[error(transparent)]
    Refused(#[from] MessageRefused),
}

/// Appends `msg` as one sealed line (`<MAC> <JSON>\n`) to `buf`, so that a
/// caller can send the messages of one engine tick with one write (one syscall,
/// not one a token).
pub fn seal_into(buf: &mut Vec<u8>, sealer: &mut Sealer, msg: &Msg) -> io::Result<()> {
    let json = serde_json::to_vec(msg).map_err(io::Error::other)?;
    buf.extend_from_slice(crate::transport::auth::to_hex(&sealer.seal(&[&json])).as_bytes());
    buf.push(b' ');
    buf.extend_from_slice(&json);
    buf.push(b'\n');
    Ok(())
}

/// Writes one sealed message.
pub fn send_sealed(w: &mut impl Write, sealer: &mut Sealer, msg: &Msg) -> io::Result<()> {
    let mut line = Vec::new();
    seal_into(&mut line, sealer, msg)?;
    w.write_all(&line)?;
    w.flush()
}

/// The message of one sealed line (its newline included or not) when it opens
/// under `opener`.
pub fn open_line(opener: &mut Opener, line: &[u8]) -> Result<Msg, RecvError> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let (tag, json) = match line.iter().position(|&b| b == b' ') {
        Some(64) => (crate::transport::auth::from_hex(std::str::from_utf8(&line[..64]).unwrap_or("")).unwrap_or_default(), &line[65..]),
        // No MAC where it belongs: refused as any forgery is (empty tag).
        _ => (Vec::new(), line),
    };
    opener.open(&[json], &tag)?;
    serde_json::from_slice(json).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("bad control message: {e}")).into())
}

/// Reads one sealed line; `Ok(None)` at a clean end of stream.
pub fn recv_sealed(r: &mut impl BufRead, opener: &mut Opener) -> Result<Option<Msg>, RecvError> {
    recv_sealed_within(r, opener, MAX_LINE)
}

/// [`recv_sealed`] with a line limit of `max_line` bytes (a stage's link:
/// [`stage_line_limit`]).
pub fn recv_sealed_within(r: &mut impl BufRead, opener: &mut Opener, max_line: u64) -> Result<Option<Msg>, RecvError> {
    let mut line = Vec::new();
    let n = r.take(max_line).read_until(b'\n', &mut line)?;
    if n == 0 {
        return Ok(None);
    }
    if too_long(&line, max_line) {
        return Err(line_too_long(max_line).into());
    }
    open_line(opener, &line).map(Some)
}

/// Appends `msg` as one bare JSON line to `buf`: what a sealed line carries
/// after its MAC, and what the fuzz tests decode. Roles never put a bare line
/// on a connection ([`seal_into`]).
pub fn encode_into(buf: &mut Vec<u8>, msg: &Msg) -> io::Result<()> {
    serde_json::to_writer(&mut *buf, msg).map_err(io::Error::other)?;
    buf.push(b'\n');
    Ok(())
}

/// Reads one bare JSON line ([`encode_into`]); `Ok(None)` at a clean end of stream.
pub fn recv(r: &mut impl BufRead) -> io::Result<Option<Msg>> {
    recv_within(r, MAX_LINE)
}

/// [`recv`] with a line limit of `max_line` bytes (tests use a small one).
pub fn recv_within(r: &mut impl BufRead, max_line: u64) -> io::Result<Option<Msg>> {
    let mut line = Vec::new();
    let n = r.take(max_line).read_until(b'\n', &mut line)?;
    if n == 0 {
        return Ok(None);
    }
    if too_long(&line, max_line) {
        return Err(line_too_long(max_line));
    }
    serde_json::from_slice(&line).map(Some).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("bad control message: {e}")))
}

/// Whether a line read under a limit of `max_line` stopped at the limit, not at its
/// end. Past the limit the rest of the line is still in the stream and the link
/// cannot be resynchronised, so the reader must give the link up.
fn too_long(line: &[u8], max_line: u64) -> bool {
    line.len() as u64 >= max_line && line.last() != Some(&b'\n')
}

fn line_too_long(max_line: u64) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("control line longer than {max_line} B"))
}

/// Reads one line of at most `max_line` bytes into `line` (cleared first), for the
/// proxy's async links; `Ok(false)` at a clean end of stream, an error for a line
/// past the limit, so a peer cannot make the reader grow without bound.
pub async fn read_line_async<R: tokio::io::AsyncBufRead + Unpin>(r: &mut R, line: &mut Vec<u8>, max_line: u64) -> io::Result<bool> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt};
    line.clear();
    let n = r.take(max_line).read_until(b'\n', line).await?;
    if n == 0 {
        return Ok(false);
    }
    if too_long(line, max_line) {
        return Err(line_too_long(max_line));
    }
    Ok(true)
}

/// Connects to a role's control listener with a timeout, sets both I/O timeouts
/// and runs the handshake with `secret`.
pub fn connect(addr: SocketAddr, timeout: Duration, secret: &ClusterSecret) -> io::Result<(TcpStream, BufReader<TcpStream>, ControlSession)> {
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let mut r = BufReader::new(s.try_clone()?);
    let session = answer_control(&mut s, &mut r, secret)?;
    Ok((s, r, session))
}

/// An HTTP response: status and body (de-chunked).
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_str(&self.body).ok()
    }
}

/// One HTTP/1.1 request on a fresh connection (`Connection: close`); reads the
/// whole response. `addr` is `host:port`.
pub fn http(addr: &str, method: &str, path: &str, body: Option<&str>, timeout: Duration) -> io::Result<HttpResponse> {
    http_with(addr, method, path, body, &[], timeout)
}

/// [`http`] with extra request headers (`("Authorization", "Bearer ...")`).
pub fn http_with(addr: &str, method: &str, path: &str, body: Option<&str>, headers: &[(&str, &str)], timeout: Duration) -> io::Result<HttpResponse> {
    let sa = addr.to_socket_addrs()?.next().ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no address for {addr}")))?;
    let mut s = TcpStream::connect_timeout(&sa, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let body = body.unwrap_or("");
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> io::Result<HttpResponse> {
    let bad = |m: &str| io::Error::new(io::ErrorKind::InvalidData, m.to_string());
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| bad("no end of headers"))?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut lines = head.split("\r\n");
    let status = lines.next().and_then(|l| l.split_whitespace().nth(1)).and_then(|s| s.parse::<u16>().ok()).ok_or_else(|| bad("bad status line"))?;
    let headers: Vec<(String, String)> = lines.filter_map(|l| l.split_once(':').map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))).collect();
    let mut body = raw[split + 4..].to_vec();
    if headers.iter().any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked")) {
        body = dechunk(&body).ok_or_else(|| bad("bad chunked body"))?;
    }
    Ok(HttpResponse { status, headers, body: String::from_utf8_lossy(&body).to_string() })
}

fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n")?;
        let size_txt = std::str::from_utf8(&b[..eol]).ok()?;
        let size = usize::from_str_radix(size_txt.split(';').next()?.trim(), 16).ok()?;
        b = &b[eol + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(..size)?);
        b = b.get(size + 2..)?;
    }
}

/// The `data:` payloads of a server-sent-events body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data:")).map(|d| d.trim().to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A register proof holds for its own body and secret within the window only:
    /// another body, another secret, a stale or future timestamp, a missing or
    /// malformed header are each refused, naming why.
    #[test]
    fn a_register_proof_holds_only_for_its_body_secret_and_time() {
        let s = ClusterSecret::from_bytes(&[9; 32]);
        let now = 1_000_000_000;
        let h = register_auth(&s, now, b"body");
        assert_eq!(check_register_auth(&s, Some(&h), b"body", now + 29_000), Ok(now));
        assert_eq!(check_register_auth(&s, Some(&h), b"body", now - 1_900), Ok(now));
        let refused =
            |secret: &ClusterSecret, header: Option<&str>, body: &[u8], at: u64| check_register_auth(secret, header, body, at).unwrap_err().to_string();
        assert!(refused(&s, Some(&h), b"bodz", now).contains("does not prove"));
        assert!(refused(&ClusterSecret::from_bytes(&[8; 32]), Some(&h), b"body", now).contains("does not prove"));
        assert!(refused(&s, Some(&h), b"body", now + 31_000).contains("more than 30000 ms"));
        assert!(refused(&s, Some(&h), b"body", now - 2_100).contains("2000 ms after"), "a timestamp ahead of the clock");
        assert!(refused(&s, None, b"body", now).contains("no x-handoff-auth"));
        assert!(refused(&s, Some("nodot"), b"body", now).contains("not <unix ms>"));
        // The timestamp is inside the MAC: moving it breaks the proof.
        let moved = h.replacen(&now.to_string(), &(now + 1).to_string(), 1);
        assert!(refused(&s, Some(&moved), b"body", now).contains("does not prove"));
    }

    /// The control handshake over a real socket: a peer that proves the secret
    /// is let in, proved to in turn, and its next (sealed) line is read; a wrong
    /// secret, a message instead of an answer, and an answer to another nonce
    /// are refused; a peer that closes at once is `Closed`, not a refusal.
    #[test]
    fn the_control_handshake_lets_in_only_a_peer_that_proves_the_secret() {
        let secret = ClusterSecret::from_bytes(&[4; 32]);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let client = |f: Box<dyn FnOnce(TcpStream) + Send>| std::thread::spawn(move || f(TcpStream::connect(addr).expect("connect")));
        let accept = |listener: &std::net::TcpListener, secret: &ClusterSecret| accept_control(listener.accept().expect("accept").0, secret);

        let s2 = secret.clone();
        let t = client(Box::new(move |mut s| {
            let mut r = BufReader::new(s.try_clone().expect("clone"));
            let mut session = answer_control(&mut s, &mut r, &s2).expect("answer");
            send_sealed(&mut s, &mut session.sealer, &Msg::Token { id: 7, token: 1 }).expect("send");
        }));
        let (mut r, mut session) = accept(&listener, &secret).expect("a member is let in");
        assert!(matches!(recv_sealed(&mut r, &mut session.opener), Ok(Some(Msg::Token { id: 7, .. }))));
        t.join().expect("client");

        // Each stranger reads until the listener closes, so that its own close
        // (with the challenge unread) cannot reset the connection first.
        let t = client(Box::new(|mut s| {
            let mut r = BufReader::new(s.try_clone().expect("clone"));
            let e = answer_control(&mut s, &mut r, &ClusterSecret::from_bytes(&[5; 32])).expect_err("the listener closes on a stranger");
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
            let _ = r.read_to_end(&mut Vec::new());
        }));
        assert!(matches!(accept(&listener, &secret), Err(Admission::Refused(_))), "a wrong secret");
        t.join().expect("client");

        let t = client(Box::new(|mut s| {
            let mut line = Vec::new();
            seal_into(
                &mut line,
                &mut ClusterSecret::from_bytes(&[4; 32]).session(context::CONTROL, b"a", b"b").sealer(End::Connector),
                &Msg::Token { id: 1, token: 1 },
            )
            .expect("seal");
            let _ = s.write_all(&line);
            let _ = s.read_to_end(&mut Vec::new());
        }));
        assert!(matches!(accept(&listener, &secret), Err(Admission::Refused(_))), "a message before the answer");
        t.join().expect("client");

        let s2 = secret.clone();
        let t = client(Box::new(move |mut s| {
            let _ = s.write_all(&answer_line(&s2, &challenge_line(&[0; 32])).expect("answer").0);
            let _ = s.read_to_end(&mut Vec::new());
        }));
        assert!(matches!(accept(&listener, &secret), Err(Admission::Refused(_))), "an answer to another nonce");
        t.join().expect("client");

        let t = client(Box::new(drop));
        assert!(matches!(accept(&listener, &secret), Err(Admission::Closed)), "a probe");
        t.join().expect("client");
    }

    /// A listener on the port that does not hold the secret (it challenges, then
    /// answers with a proof under another secret, or with bytes) is refused by
    /// the connector, which sends it no message.
    #[test]
    fn a_connector_refuses_a_listener_without_the_secret() {
        let secret = ClusterSecret::from_bytes(&[4; 32]);
        for impostor in [Some(ClusterSecret::from_bytes(&[6; 32])), None] {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            let addr = listener.local_addr().expect("addr");
            let t = std::thread::spawn(move || {
                let (conn, _) = listener.accept().expect("accept");
                let na = [1u8; 32];
                let mut w = conn.try_clone().expect("clone");
                w.write_all(&challenge_line(&na)).expect("challenge");
                let mut r = BufReader::new(conn.try_clone().expect("clone"));
                let mut answer = Vec::new();
                r.read_until(b'\n', &mut answer).expect("answer");
                let proof = match &impostor {
                    // An impostor that knows another secret proves that one, over
                    // the right nonces.
                    Some(other) => {
                        let a: serde_json::Value = serde_json::from_slice(&answer).expect("answer json");
                        let nc = crate::transport::auth::from_hex(a["nonce"].as_str().expect("nonce")).expect("hex");
                        crate::transport::auth::to_hex(&other.proof(context::CONTROL, End::Acceptor, &na, &nc, b""))
                    }
                    // One that sends any bytes where the proof belongs.
                    None => "00".to_string(),
                };
                w.write_all(format!("{{\"auth\":\"{proof}\"}}\n").as_bytes()).expect("proof");
                // Whatever else the connector sends, it is read here.
                let mut rest = Vec::new();
                conn.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
                let _ = r.read_to_end(&mut rest);
                rest
            });
            let e = connect(addr, Duration::from_secs(5), &secret).map(drop).expect_err("an impostor listener is refused");
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
            assert!(e.get_ref().is_some_and(|i| i.is::<AcceptorUnproven>()), "typed: {e:?}");
            let rest = t.join().expect("impostor");
            assert!(rest.is_empty(), "the connector sent its answer and nothing more: {}", String::from_utf8_lossy(&rest));
        }
    }

    /// A connected pair of control sessions over a real socket: the connector's
    /// writer and session, the acceptor's reader and session.
    fn pair(secret: &ClusterSecret) -> (TcpStream, ControlSession, BufReader<TcpStream>, ControlSession) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let s2 = secret.clone();
        let t = std::thread::spawn(move || accept_control(listener.accept().expect("accept").0, &s2).expect("a member"));
        let (w, _r, session) = connect(addr, Duration::from_secs(5), secret).expect("connect");
        let (r, accepted) = t.join().expect("acceptor");
        (w, session, r, accepted)
    }

    fn refused(got: Result<Option<Msg>, RecvError>) -> bool {
        matches!(got, Err(RecvError::Refused(_)))
    }

    /// After the handshake every line proves itself, once: a line replayed on its
    /// connection, a line with one byte altered, and a line sealed on another
    /// connection (another session key) are each refused, typed; and lines the
    /// acceptor sends back open at the connector in their own sequence.
    #[test]
    fn a_replayed_altered_or_foreign_control_line_is_refused() {
        let secret = ClusterSecret::from_bytes(&[4; 32]);
        let token = |id| Msg::Token { id, token: 1 };

        // Replayed: the first line, captured and sent again.
        let (mut w, mut tx, mut r, mut rx) = pair(&secret);
        let mut captured = Vec::new();
        seal_into(&mut captured, &mut tx.sealer, &token(1)).expect("seal");
        w.write_all(&captured).expect("send");
        assert!(matches!(recv_sealed(&mut r, &mut rx.opener), Ok(Some(Msg::Token { id: 1, .. }))));
        // Both ways: the acceptor's own lines open at the connector.
        let mut back = BufReader::new(w.try_clone().expect("clone"));
        send_sealed(r.get_mut(), &mut rx.sealer, &token(9)).expect("send back");
        assert!(matches!(recv_sealed(&mut back, &mut tx.opener), Ok(Some(Msg::Token { id: 9, .. }))));
        w.write_all(&captured).expect("replay");
        let got = recv_sealed(&mut r, &mut rx.opener);
        assert!(refused(got), "a replayed line");

        // Altered: one byte of the JSON (the id) changed.
        let (mut w, mut tx, mut r, mut rx) = pair(&secret);
        let mut line = Vec::new();
        seal_into(&mut line, &mut tx.sealer, &token(1)).expect("seal");
        let at = line.iter().rposition(|&b| b == b'1').expect("the id");
        line[at] = b'2';
        w.write_all(&line).expect("send");
        let got = recv_sealed(&mut r, &mut rx.opener);
        assert!(refused(got), "an altered line");

        // Foreign: a line sealed on one connection sent on another (same secret).
        let (_w1, mut tx1, _r1, _rx1) = pair(&secret);
        let (mut w2, _tx2, mut r2, mut rx2) = pair(&secret);
        let mut line = Vec::new();
        seal_into(&mut line, &mut tx1.sealer, &token(1)).expect("seal");
        w2.write_all(&line).expect("send");
        let got = recv_sealed(&mut r2, &mut rx2.opener);
        assert!(refused(got), "another connection's line");

        // Bare: a JSON line without its MAC.
        let (mut w, _tx, mut r, mut rx) = pair(&secret);
        let mut line = Vec::new();
        encode_into(&mut line, &token(1)).expect("encode");
        w.write_all(&line).expect("send");
        let got = recv_sealed(&mut r, &mut rx.opener);
        assert!(matches!(&got, Err(RecvError::Refused(e)) if e.to_string().contains("replayed")), "a bare line: {got:?}");
    }

    /// A stage's link takes a job as long as the topology's longest prompt
    /// makes it: the limit covers the base64 hidden states of
    /// `serve.max_context` tokens (past the default for config/gpu-32k.toml's
    /// 32K x 2,048), and a sealed job one byte past a given limit is refused
    /// while the same job within it arrives whole.
    #[test]
    fn a_stage_link_takes_the_longest_job_its_topology_can_send() {
        let topo = handoff_components::Topology::load(concat!(env!("CARGO_MANIFEST_DIR"), "/config/gpu-32k.toml")).expect("config");
        let (t, h) = (u64::from(topo.config.serve.max_context), u64::from(topo.model().hidden_size));
        let base64 = (t * h * 4).div_ceil(3) * 4;
        assert!(base64 > MAX_LINE && stage_line_limit(&topo) > base64 + 16 * t, "limit {} for {base64} B of hidden states", stage_line_limit(&topo));

        let secret = ClusterSecret::from_bytes(&[7; 32]);
        let xs: Vec<f32> = (0..5000).map(|i| i as f32 * 0.5).collect();
        let a = Admitted { id: 1, nonce: 2, consumers: vec![], handles: vec![], endpoint: PeerAddr::Local { instance: 3 } };
        let job =
            Msg::Prefill(Box::new(WirePrefillJob { admitted: a, prompt: vec![1, 2], stage: 1, stages: vec![], hidden: Some(xs.clone()), sampling: None }));
        let (mut w, mut tx, mut r, mut rx) = pair(&secret);
        let mut line = Vec::new();
        seal_into(&mut line, &mut tx.sealer, &job).expect("seal");
        let len = line.len() as u64;
        w.write_all(&line).expect("send");
        match recv_sealed_within(&mut r, &mut rx.opener, len) {
            Ok(Some(Msg::Prefill(j))) => assert_eq!(j.hidden.as_deref(), Some(&xs[..])),
            other => panic!("a job within the limit: {other:?}"),
        }
        let (mut w, mut tx, mut r, mut rx) = pair(&secret);
        let mut line = Vec::new();
        seal_into(&mut line, &mut tx.sealer, &job).expect("seal");
        w.write_all(&line).expect("send");
        let got = recv_sealed_within(&mut r, &mut rx.opener, len - 1);
        assert!(matches!(&got, Err(RecvError::Io(e)) if e.to_string().contains("longer than")), "a job past the limit: {got:?}");
    }

    /// Hidden states cross the wire bit for bit (NaN payloads, -0.0, subnormals
    /// included), and a body of stray bytes is refused, not truncated.
    #[test]
    fn hidden_states_round_trip_bit_for_bit_and_bad_lengths_are_refused() {
        let xs = vec![0.0f32, -0.0, 1.5, f32::MIN_POSITIVE / 4.0, f32::from_bits(0x7fc0_1234), -3.25e7];
        let a = Admitted { id: 1, nonce: 2, consumers: vec![], handles: vec![], endpoint: PeerAddr::Local { instance: 3 } };
        let job = WirePrefillJob { admitted: a, prompt: vec![1, 2], stage: 1, stages: vec![], hidden: Some(xs.clone()), sampling: None };
        let line = serde_json::to_vec(&Msg::Prefill(Box::new(job))).expect("encode");
        let Ok(Msg::Prefill(back)) = serde_json::from_slice::<Msg>(&line) else { panic!("decode") };
        let got: Vec<u32> = back.hidden.expect("hidden").iter().map(|x| x.to_bits()).collect();
        assert_eq!(got, xs.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        let text = String::from_utf8(line).expect("utf8");
        let bad = text.replacen("\"hidden\":\"", "\"hidden\":\"AAA", 1);
        assert!(serde_json::from_str::<Msg>(&bad).is_err(), "{bad}");
    }
}
