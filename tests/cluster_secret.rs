//! Only the cluster gets in: every role-to-role connection proves the cluster
//! secret (see `handoff::transport::auth`), a stranger is refused before it can register,
//! admit or write a byte, and every refusal is counted in the proxy's /metrics.
//! Also the public listener's limits: slow clients are cut off and connections
//! past `serve.max_connections` are refused (all but monitoring).

use handoff::check::oracle::fill_canary;
use handoff::roles::up::{Deployment, free_port};
use handoff::roles::wire;
use handoff::transport::auth::{ClusterSecret, End, Opener, SECRET_ENV, SECRET_FILE_ENV};
use handoff::transport::tcp::wire as tcpwire;
use handoff::transport::{MemoryKind, PeerAddr, RegionHandle, ShmTransport, TcpOptions, TcpTransport, Transport, TransportError, TransportExt};
use handoff_components::plan::Descriptor;
use handoff_components::vocab::RegionKind;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_handoff");
const SMALL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/config/small.toml");
const T: Duration = Duration::from_secs(30);

fn metric(text: &str, key: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(key).and_then(|v| v.trim().parse().ok()))
}

/// Waits until `/metrics` shows `key` at `want` (the roles report every 300 ms).
fn wait_metric(addr: &str, key: &str, want: f64) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = wire::http(addr, "GET", "/metrics", None, T).expect("metrics").body;
        if metric(&m, key) == Some(want) || Instant::now() > deadline {
            assert_eq!(metric(&m, key), Some(want), "{key} in:\n{m}");
            return m;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The TCP ports `pid` listens on (its sockets' inodes matched in /proc/net/tcp).
fn listening_ports(pid: u32) -> Vec<u16> {
    let mut inodes = std::collections::HashSet::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("fd dir").flatten() {
        if let Some(i) = std::fs::read_link(e.path()).ok().and_then(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse::<u64>().ok()) {
            inodes.insert(i);
        }
    }
    let tcp = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    tcp.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (local, state, inode) = (f.get(1)?, f.get(3)?, f.get(9)?.parse::<u64>().ok()?);
            (*state == "0A" && inodes.contains(&inode)).then(|| u16::from_str_radix(local.rsplit(':').next()?, 16).ok())?
        })
        .collect()
}

/// A forged heartbeat: decode at a port nobody listens on.
fn forged_register(stage: Option<u32>) -> String {
    let role = if stage.is_some() { "prefill" } else { "decode" };
    serde_json::json!({"role": role, "stage": stage, "addr": "127.0.0.1:9", "pid": 1, "counts": {}, "rss_bytes": 0}).to_string()
}

#[test]
fn a_strangers_register_is_refused_and_the_public_port_has_no_internal_routes() {
    let port = free_port().expect("port");
    let mut c = Deployment::start(Some(std::path::Path::new(SMALL)), "127.0.0.1", port, Some(PathBuf::from(BIN))).expect("start");
    c.wait_healthy(Duration::from_secs(60), false).expect("healthy");
    let decode_pid = c.pid("decode").expect("decode pid");

    // The public port: /internal/* is a 404 like any unknown route.
    let body = forged_register(None);
    let r = wire::http(&c.addr, "POST", "/internal/register", Some(&body), T).expect("http");
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(r.json().expect("json")["error"]["code"], "not_found", "{}", r.body);

    // The control listener: no proof, a wrong secret, a stale timestamp.
    let wrong = ClusterSecret::from_bytes(&[0x5a; 32]);
    let stale = wire::register_auth(c.secret(), wire::unix_ms() - 120_000, body.as_bytes());
    let forged = wire::register_auth(&wrong, wire::unix_ms(), body.as_bytes());
    let cases: [(&str, Vec<(&str, &str)>); 4] = [
        ("no proof", vec![]),
        ("a wrong secret", vec![(wire::REGISTER_AUTH_HEADER, &forged)]),
        ("a stale timestamp", vec![(wire::REGISTER_AUTH_HEADER, &stale)]),
        ("garbage", vec![(wire::REGISTER_AUTH_HEADER, "12.zz")]),
    ];
    for (what, headers) in &cases {
        let r = wire::http_with(&c.control_addr, "POST", "/internal/register", Some(&body), headers, T).expect("http");
        assert_eq!(r.status, 401, "{what}: {}", r.body);
        let v = r.json().unwrap_or_else(|| panic!("{what}: not JSON: {}", r.body));
        assert_eq!(v["error"]["code"], "invalid_cluster_secret", "{what}: {}", r.body);
    }
    // The right secret passes the check (and meets the ordinary validation), so
    // the refusals above were the secret's.
    let odd = forged_register(Some(99));
    let ok = wire::register_auth(c.secret(), wire::unix_ms(), odd.as_bytes());
    let r = wire::http_with(&c.control_addr, "POST", "/internal/register", Some(&odd), &[(wire::REGISTER_AUTH_HEADER, &ok)], T).expect("http");
    assert_eq!(r.status, 400, "{}", r.body);

    // The cluster still shows its real roles.
    let h = wire::http(&c.addr, "GET", "/health", None, T).expect("health");
    assert_eq!(h.status, 200, "{}", h.body);
    let roles = h.json().expect("json")["roles"].clone();
    let decode = roles.as_array().expect("roles").iter().find(|r| r["role"] == "decode").expect("decode listed").clone();
    assert_eq!(decode["pid"], decode_pid, "{roles}");
    wait_metric(&c.addr, "handoff_unauthenticated_connections_total{role=\"proxy\",listener=\"register\"}", 4.0);

    // Decode's control listener: a stranger that answers the challenge wrongly,
    // one that sends a job without answering, and a probe that only connects.
    let ports = listening_ports(decode_pid);
    assert_eq!(ports.len(), 1, "decode (over shm) listens on its control port only: {ports:?}");
    let ctl = format!("127.0.0.1:{}", ports[0]);
    for first in [r#"{"auth": "00"}"#, r#"{"type": "admit", "id": 1, "prompt_tokens": 4, "max_tokens": 2}"#] {
        let mut s = TcpStream::connect(&ctl).expect("connect");
        s.set_read_timeout(Some(T)).expect("timeout");
        writeln!(s, "{first}").expect("write");
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        let text = String::from_utf8_lossy(&rest);
        assert!(text.starts_with("{\"challenge\":"), "only the challenge came back: {text}");
        assert_eq!(text.lines().count(), 1, "nothing but the challenge: {text}");
    }
    drop(TcpStream::connect(&ctl).expect("probe"));

    // A member's control line replayed on its connection: prefill stage 0 takes
    // the first (a settle of nothing, harmless), refuses the copy, closes the
    // connection and counts it.
    let stage0 = listening_ports(c.pid("prefill stage 0").expect("stage 0 pid"));
    assert_eq!(stage0.len(), 1, "stage 0 (over shm) listens on its control port only: {stage0:?}");
    let (mut w, mut r, mut session) = wire::connect(format!("127.0.0.1:{}", stage0[0]).parse().expect("addr"), T, c.secret()).expect("a member connects");
    let failure = handoff_components::Failure::new(
        handoff_components::ecs::PhaseName::Compute,
        handoff_components::ProcessRole::Proxy,
        handoff_components::Cause::Cancelled { detail: "test".into() },
    );
    let settle = wire::Msg::Settle { requests: vec![], endpoint: PeerAddr::Local { instance: 0 }, failure };
    let mut line = Vec::new();
    wire::seal_into(&mut line, &mut session.sealer, &settle).expect("seal");
    w.write_all(&line).expect("send");
    w.write_all(&line).expect("replay");
    let _ = r.read_to_end(&mut Vec::new());
    wait_metric(&c.addr, "handoff_refused_frames_total{role=\"prefill0\",kind=\"control\"}", 1.0);

    // Decode's shm notification socket: a datagram that proves nothing.
    let sock = std::fs::read_dir(handoff::transport::shm::default_dir())
        .expect("shm dir")
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&format!("handoff-{decode_pid}-")) && n.ends_with(".sock")))
        .expect("decode's notification socket");
    let stranger = std::os::unix::net::UnixDatagram::unbound().expect("socket");
    stranger.send_to(b"\x02\x00\x00\x00{}forged written report", &sock).expect("send");

    wait_metric(&c.addr, "handoff_unauthenticated_connections_total{role=\"decode\",listener=\"control\"}", 2.0);
    let m = wait_metric(&c.addr, "handoff_unauthenticated_connections_total{role=\"decode\",listener=\"shm\"}", 1.0);
    assert_eq!(metric(&m, "handoff_unauthenticated_connections_total{role=\"prefill0\",listener=\"control\"}"), Some(0.0), "{m}");
    // And the cluster still serves.
    let r = wire::http(&c.addr, "POST", "/v1/completions", Some(r#"{"prompt": "still ours", "max_tokens": 3}"#), T).expect("http");
    assert_eq!(r.status, 200, "{}", r.body);
    c.shutdown();
}

#[allow(dead_code)]
mod transport_util;
use transport_util::{consumer_rank as rank, producer_rank};

/// Reads what the consumer sends until it closes; the frames' types.
fn frames_until_closed(s: &mut TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(T)).expect("timeout");
    let mut raw = Vec::new();
    // A reset after the refusal also ends it: the consumer closed with our WRITE unread.
    let _ = s.read_to_end(&mut raw);
    let mut types = Vec::new();
    let mut at = 0;
    while raw.len() >= at + 5 {
        types.push(raw[at + 4]);
        at += 5 + match raw[at + 4] {
            tcpwire::CHALLENGE => 32,
            tcpwire::ACK if raw.len() >= at + 18 => 13 + u32::from_le_bytes([raw[at + 14], raw[at + 15], raw[at + 16], raw[at + 17]]) as usize,
            _ => break,
        };
    }
    types
}

#[test]
fn a_strangers_tcp_write_is_refused_before_any_region_byte_moves() {
    const LEN: u64 = 64 << 10;
    let consumer = TcpTransport::loopback().expect("tcp");
    let dst = consumer.register(rank(), RegionKind::MlaKv, LEN).expect("register");
    consumer.write_region(&dst, |b| fill_canary(rank(), RegionKind::MlaKv, b)).expect("canary");
    let canary = consumer.region_bytes(&dst).expect("read");
    let desc = [Descriptor::copy(RegionKind::MlaKv, 0, 0, LEN)];
    // A stranger's WRITE may meet a socket the consumer already closed on
    // refusing it (a broken pipe): the refusal frames below and the canary are
    // what this test judges.
    // A stranger's WRITE, sealed under a session it made up (it has none).
    let write_frame = |s: &mut TcpStream| {
        let mut sealer = ClusterSecret::from_bytes(&[1; 32]).session(b"made up", b"a", b"b").sealer(End::Connector);
        let _ = tcpwire::write_batch_header(s, &mut sealer, 1, dst.id, &desc, LEN).and_then(|()| s.write_all(&vec![0x42u8; LEN as usize]));
    };

    // No HELLO at all: a WRITE as the first frame.
    let mut s = TcpStream::connect(consumer.addr()).expect("connect");
    write_frame(&mut s);
    assert_eq!(frames_until_closed(&mut s), vec![tcpwire::CHALLENGE, tcpwire::ACK], "challenged, refused, closed");
    // A HELLO under a wrong secret, then a WRITE.
    let mut s = TcpStream::connect(consumer.addr()).expect("connect");
    let nonce = tcpwire::read_challenge(&mut s).expect("challenge");
    let me = PeerAddr::Tcp { addr: s.local_addr().expect("addr") };
    tcpwire::write_hello(&mut s, &me, &ClusterSecret::from_bytes(&[1; 32]), &nonce, &[7; 32]).expect("hello");
    write_frame(&mut s);
    assert_eq!(frames_until_closed(&mut s), vec![tcpwire::ACK], "refused, closed");
    // The right secret answering another connection's nonce (a replay).
    let mut s = TcpStream::connect(consumer.addr()).expect("connect");
    let _ = tcpwire::read_challenge(&mut s).expect("challenge");
    tcpwire::write_hello(&mut s, &me, &ClusterSecret::process(), &[0u8; 32], &[7; 32]).expect("hello");
    write_frame(&mut s);
    assert_eq!(frames_until_closed(&mut s), vec![tcpwire::ACK], "refused, closed");
    assert_eq!(consumer.unauthenticated(), 3, "every stranger counted");
    // A transport configured with another secret: its transfer fails, saying why.
    let outsider = TcpTransport::bind(TcpOptions { secret: ClusterSecret::from_bytes(&[2; 32]), ..TcpOptions::default() }).expect("tcp");
    let src = outsider.register(producer_rank(), RegionKind::MlaKv, LEN).expect("src");
    outsider.write_region(&src, |b| b.fill(0x42)).expect("fill");
    let err = outsider.attach(&dst).and_then(|r| outsider.transfer(&src, r, &desc, T)).expect_err("an outsider's transfer must fail");
    assert!(err.to_string().contains("does not prove the cluster secret"), "{err}");

    assert_eq!(consumer.region_bytes(&dst).expect("read"), canary, "the region still holds its canary, byte for byte");
    let refused = consumer.unauthenticated();
    assert!(refused > 3, "the outsider counted too: {refused}");
    assert!(consumer.take_incidents().is_empty(), "a refusal is not a failed batch");

    // A member of the cluster still writes.
    let member = TcpTransport::loopback().expect("tcp");
    let src = member.register(producer_rank(), RegionKind::MlaKv, LEN).expect("src");
    member.write_region(&src, |b| b.fill(0x42)).expect("fill");
    let r = member.attach(&dst).expect("attach");
    member.transfer(&src, r, &desc, T).expect("a member's transfer");
    assert!(consumer.region_bytes(&dst).expect("read").iter().all(|&b| b == 0x42), "the member's bytes landed");
    assert_eq!(consumer.unauthenticated(), refused, "a member is not counted");
}

#[test]
fn a_strangers_shm_notification_is_dropped_and_counted() {
    use std::os::unix::fs::PermissionsExt;
    let consumer = ShmTransport::new().expect("shm");
    let h = consumer.register(rank(), RegionKind::KdaState, 4096).expect("register");
    for path in [consumer.socket_path(), consumer.region_path(&h)] {
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{} is mode {mode:o}", path.display());
    }
    let outsider = ShmTransport::with_secret(handoff::transport::shm::default_dir(), ClusterSecret::from_bytes(&[3; 32])).expect("shm");
    outsider.notify(&consumer.endpoint(), b"forged report").expect("the datagram is sent");
    let raw = std::os::unix::net::UnixDatagram::unbound().expect("socket");
    raw.send_to(b"\x00\x00\x00\x00no tag", consumer.socket_path()).expect("send");
    let member = ShmTransport::new().expect("shm");
    member.notify(&consumer.endpoint(), b"real report").expect("notify");
    let got = consumer.wait_notifications(T);
    let bytes: Vec<&[u8]> = got.iter().map(|n| n.bytes.as_slice()).collect();
    assert_eq!(bytes, vec![&b"real report"[..]], "only the member's notification is delivered");
    assert_eq!(got[0].from, Some(member.endpoint()));
    assert_eq!(consumer.unauthenticated(), 2);

    // A member's datagram (sender, counter, MAC over sender, receiver, counter
    // and bytes) is taken once: the same datagram again, and one with a lower
    // counter, are refused as replays; one sealed for another receiver fails
    // its MAC.
    let datagram = |to: &PeerAddr, counter: u64, bytes: &[u8]| {
        let from = serde_json::to_vec(&PeerAddr::Local { instance: 77 }).expect("json");
        let to = serde_json::to_vec(to).expect("json");
        let mac = ClusterSecret::process().mac(handoff::transport::auth::context::SHM_NOTIFY, &[&from, &to, &counter.to_le_bytes(), bytes]);
        let mut d = (from.len() as u32).to_le_bytes().to_vec();
        d.extend_from_slice(&from);
        d.extend_from_slice(&counter.to_le_bytes());
        d.extend_from_slice(&mac);
        d.extend_from_slice(bytes);
        d
    };
    let second = datagram(&consumer.endpoint(), 2, b"second");
    raw.send_to(&second, consumer.socket_path()).expect("send");
    raw.send_to(&second, consumer.socket_path()).expect("replay");
    raw.send_to(&datagram(&consumer.endpoint(), 1, b"first"), consumer.socket_path()).expect("send an older one");
    raw.send_to(&datagram(&member.endpoint(), 3, b"for another"), consumer.socket_path()).expect("send another's");
    raw.send_to(&datagram(&consumer.endpoint(), 3, b"third"), consumer.socket_path()).expect("send");
    // The datagrams are queued at the socket already: one receive takes them all.
    let got: Vec<Vec<u8>> = consumer.wait_notifications(T).into_iter().map(|n| n.bytes).collect();
    assert_eq!(got, vec![b"second".to_vec(), b"third".to_vec()], "each datagram once, in counter order");
    assert_eq!(consumer.refused_frames(), 2, "the replay and the older counter");
    assert_eq!(consumer.unauthenticated(), 3, "the one sealed for another receiver");
}

/// Reads one sealed ACK frame: its batch and whether it is a success; the MAC
/// must hold under `opener`.
fn read_ack(s: &mut TcpStream, opener: &mut Opener) -> std::io::Result<(u64, bool)> {
    let mut h = [0u8; 18];
    s.read_exact(&mut h)?;
    assert_eq!((&h[..4], h[4]), (&tcpwire::MAGIC.to_le_bytes()[..], tcpwire::ACK), "an ACK frame");
    let n = u32::from_le_bytes([h[14], h[15], h[16], h[17]]) as usize;
    let mut rest = vec![0u8; n + tcpwire::MAC_BYTES];
    s.read_exact(&mut rest)?;
    let mut body = h[5..].to_vec();
    body.extend_from_slice(&rest[..n]);
    opener.open(&[&[tcpwire::ACK], &body], &rest[n..]).expect("the consumer's ACK carries its MAC");
    Ok((u64::from_le_bytes(h[5..13].try_into().expect("8 bytes")), h[13] == 0))
}

/// A member's connection to `consumer` (it proves the secret) and its session.
fn member(consumer: &TcpTransport) -> (TcpStream, tcpwire::Session) {
    let mut s = TcpStream::connect(consumer.addr()).expect("connect");
    s.set_read_timeout(Some(T)).expect("timeout");
    let me = PeerAddr::Tcp { addr: s.local_addr().expect("addr") };
    let session = tcpwire::connect_handshake(&mut s, &me, &ClusterSecret::process()).expect("a member's handshake");
    (s, session)
}

/// One WRITE frame of `fill` bytes over the region's first `len` bytes, sealed
/// with `sealer`: its bytes, to send (and send again).
fn write_frame(sealer: &mut handoff::transport::auth::Sealer, batch: u64, region: u64, len: u64, fill: u8) -> Vec<u8> {
    let mut f = Vec::new();
    tcpwire::write_batch_header(&mut f, sealer, batch, region, &[Descriptor::copy(RegionKind::MlaKv, 0, 0, len)], len).expect("header");
    f.extend(std::iter::repeat_n(fill, len as usize));
    f
}

/// Waits for the consumer's incident: the refusal, typed.
fn refusal(consumer: &TcpTransport) -> String {
    let deadline = Instant::now() + T;
    loop {
        if let Some(i) = consumer.take_incidents().into_iter().next() {
            assert!(matches!(i.error, TransportError::Refused { .. }), "a typed refusal: {}", i.error);
            return i.error.to_string();
        }
        assert!(Instant::now() < deadline, "no incident for a refused frame");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// After the handshake every tcp frame proves itself, once: a WRITE replayed on
/// its connection, a WRITE with one header byte altered (its offset), and a
/// WRITE sealed on another connection are each refused before a byte of their
/// payload lands, with a typed incident, the connection closed, and counted.
#[test]
fn a_replayed_altered_or_foreign_tcp_frame_is_refused_and_counted() {
    const LEN: u64 = 4096;
    let consumer = TcpTransport::loopback().expect("tcp");
    let dst = consumer.register(rank(), RegionKind::MlaKv, 2 * LEN).expect("register");
    let closed = |s: &mut TcpStream| {
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        assert!(rest.is_empty(), "nothing after the refusal: {} B", rest.len());
    };

    // Replayed: frame 0 (0x42) lands, frame 1 (0x43) lands over it, and frame 0
    // sent again would put 0x42 back.
    let (mut s, mut session) = member(&consumer);
    let first = write_frame(&mut session.sealer, 1, dst.id, LEN, 0x42);
    s.write_all(&first).expect("send");
    assert_eq!(read_ack(&mut s, &mut session.opener).expect("ack"), (1, true));
    s.write_all(&write_frame(&mut session.sealer, 2, dst.id, LEN, 0x43)).expect("send");
    assert_eq!(read_ack(&mut s, &mut session.opener).expect("ack"), (2, true));
    let _ = s.write_all(&first);
    closed(&mut s);
    let why = refusal(&consumer);
    assert!(why.contains("message 2 from the connector") && why.contains("replayed"), "{why}");
    assert!(consumer.region_bytes(&dst).expect("read")[..LEN as usize].iter().all(|&b| b == 0x43), "the replay moved no byte");
    assert_eq!(consumer.refused_frames(), 1);

    // Altered: the descriptor's offset moved after sealing (to the second half).
    let (mut s, mut session) = member(&consumer);
    let mut frame = write_frame(&mut session.sealer, 1, dst.id, LEN, 0x44);
    let offset_at = 5 + 28 + 1;
    frame[offset_at + 1] = (LEN >> 8) as u8;
    let _ = s.write_all(&frame);
    closed(&mut s);
    assert!(refusal(&consumer).contains("message 0 from the connector"));
    assert!(consumer.region_bytes(&dst).expect("read")[LEN as usize..].iter().all(|&b| b == 0), "the altered frame moved no byte");
    assert_eq!(consumer.refused_frames(), 2);

    // Foreign: a frame sealed for one connection, sent on another (same secret).
    let (_s1, mut session1) = member(&consumer);
    let (mut s2, _session2) = member(&consumer);
    let _ = s2.write_all(&write_frame(&mut session1.sealer, 1, dst.id, LEN, 0x45));
    closed(&mut s2);
    refusal(&consumer);
    assert!(consumer.region_bytes(&dst).expect("read")[..LEN as usize].iter().all(|&b| b == 0x43), "the foreign frame moved no byte");
    assert_eq!(consumer.refused_frames(), 3);
    assert_eq!(consumer.unauthenticated(), 0, "members all: refused frames, not strangers");

    // A member's transfer still lands.
    let member = TcpTransport::loopback().expect("tcp");
    let src = member.register(producer_rank(), RegionKind::MlaKv, LEN).expect("src");
    member.write_region(&src, |b| b.fill(0x46)).expect("fill");
    let r = member.attach(&dst).expect("attach");
    member.transfer(&src, r, &[Descriptor::copy(RegionKind::MlaKv, 0, 0, LEN)], T).expect("a member's transfer");
    assert!(consumer.region_bytes(&dst).expect("read")[..LEN as usize].iter().all(|&b| b == 0x46));
}

/// An endpoint on the port that does not hold the secret (it challenges, reads
/// the HELLO and answers with a WELCOME under another secret) is refused by the
/// connecting transport: attach fails, typed, and no WRITE is sent to it.
#[test]
fn a_tcp_endpoint_without_the_secret_is_refused_by_the_connector() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let impostor = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        s.set_read_timeout(Some(T)).expect("timeout");
        tcpwire::write_challenge(&mut s, &[9; 32]).expect("challenge");
        let mut h = [0u8; 9];
        s.read_exact(&mut h).expect("hello head");
        let n = u32::from_le_bytes([h[5], h[6], h[7], h[8]]) as usize;
        let mut body = vec![0u8; n + 64];
        s.read_exact(&mut body).expect("hello body");
        let wrong = ClusterSecret::from_bytes(&[8; 32]);
        let proof = wrong.proof(handoff::transport::auth::context::TCP_HELLO, End::Acceptor, &[9; 32], &body[n..n + 32], &body[..n]);
        tcpwire::write_welcome(&mut s, &proof).expect("welcome");
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        rest
    });
    let producer = TcpTransport::loopback().expect("tcp");
    let handle = RegionHandle {
        peer: PeerAddr::Tcp { addr },
        id: 1,
        rank: rank(),
        kind: RegionKind::MlaKv,
        len: 4096,
        memory: MemoryKind::Host,
        ipc: None,
        remote_key: None,
    };
    let err = producer.attach(&handle).map(drop).expect_err("an endpoint without the secret is refused");
    assert!(matches!(&err, TransportError::Refused { reason, .. } if reason.contains("WELCOME does not prove")), "{err}");
    drop(producer);
    assert!(impostor.join().expect("impostor").is_empty(), "nothing was sent after the HELLO");
}

/// The other way too: an ACK whose MAC does not hold (here one byte of it
/// flipped, from an endpoint that did prove the secret) is refused by the
/// producer: its batch fails rather than completes, and the refusal is counted.
#[test]
fn an_altered_tcp_ack_is_refused_by_the_producer() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let endpoint = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        s.set_read_timeout(Some(T)).expect("timeout");
        let na = [9u8; 32];
        tcpwire::write_challenge(&mut s, &na).expect("challenge");
        let mut h = [0u8; 9];
        s.read_exact(&mut h).expect("hello head");
        let n = u32::from_le_bytes([h[5], h[6], h[7], h[8]]) as usize;
        let mut body = vec![0u8; n + 64];
        s.read_exact(&mut body).expect("hello body");
        let (json, nc) = (&body[..n], &body[n..n + 32]);
        let secret = ClusterSecret::process();
        let proof = secret.proof(handoff::transport::auth::context::TCP_HELLO, End::Acceptor, &na, nc, json);
        tcpwire::write_welcome(&mut s, &proof).expect("welcome");
        let mut sealer = secret.session(handoff::transport::auth::context::TCP_HELLO, &na, nc).sealer(End::Acceptor);
        // The WRITE's fixed header (its batch), then an ACK for it, its MAC flipped.
        let mut w = [0u8; 5 + 28];
        s.read_exact(&mut w).expect("write header");
        let batch = u64::from_le_bytes(w[5..13].try_into().expect("8 bytes"));
        let mut ack = Vec::new();
        tcpwire::write_ack(&mut ack, &mut sealer, batch, None).expect("ack");
        let last = ack.len() - 1;
        ack[last] ^= 1;
        s.write_all(&ack).expect("send ack");
        let _ = s.read_to_end(&mut Vec::new());
    });
    let producer = TcpTransport::loopback().expect("tcp");
    let src = producer.register(producer_rank(), RegionKind::MlaKv, 4096).expect("src");
    let handle = RegionHandle {
        peer: PeerAddr::Tcp { addr },
        id: 1,
        rank: rank(),
        kind: RegionKind::MlaKv,
        len: 4096,
        memory: MemoryKind::Host,
        ipc: None,
        remote_key: None,
    };
    let r = producer.attach(&handle).expect("the endpoint proved the secret");
    let err = producer.transfer(&src, r, &[Descriptor::copy(RegionKind::MlaKv, 0, 0, 4096)], T).expect_err("an altered ACK completes nothing");
    assert!(err.to_string().contains("message 0 from the acceptor does not carry its MAC"), "{err}");
    assert_eq!(producer.refused_frames(), 1);
    drop(producer);
    endpoint.join().expect("endpoint");
}

/// A proxy started by hand (no `up`), with `[serve]` limits of its own.
struct Proxy {
    child: Child,
    addr: String,
    control: String,
    secret: ClusterSecret,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn proxy_with(serve: &str) -> Proxy {
    let base = std::fs::read_to_string(SMALL).expect("small.toml");
    let text = base.replace("[serve]\n", &format!("[serve]\n{serve}\n"));
    let path = std::env::temp_dir().join(format!("handoff-cluster-secret-{}.toml", std::process::id()));
    std::fs::write(&path, text).expect("config");
    let (port, control) = (free_port().expect("port"), free_port().expect("port"));
    let args = ["proxy", "--config", path.to_str().expect("utf8"), "--port", &port.to_string(), "--control-port", &control.to_string()];
    let secret = ClusterSecret::generate().expect("secret");
    let child = Command::new(BIN).args(args).env(SECRET_ENV, secret.to_hex()).env_remove(SECRET_FILE_ENV).spawn().expect("proxy");
    let addr = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + T;
    while wire::http(&addr, "GET", "/metrics", None, T).is_err() {
        assert!(Instant::now() < deadline, "the proxy did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    Proxy { child, addr, control: format!("127.0.0.1:{control}"), secret }
}

/// A heartbeat (a registration) sent again, byte for byte, is refused as a
/// replay and counted; the role's next one, later, passes.
#[test]
fn a_replayed_heartbeat_is_refused_and_counted() {
    let p = proxy_with("");
    let reg = wire::Register::new("decode", None, "127.0.0.1:9".parse().expect("addr"), 1);
    let body = serde_json::to_string(&reg).expect("json");
    let send = |auth: &str| wire::http_with(&p.control, "POST", "/internal/register", Some(&body), &[(wire::REGISTER_AUTH_HEADER, auth)], T).expect("register");
    let captured = wire::register_auth(&p.secret, wire::unix_ms(), body.as_bytes());
    let first = send(&captured);
    assert_eq!(first.status, 204, "{}", first.body);
    let again = send(&captured);
    assert_eq!(again.status, 401, "{}", again.body);
    assert!(again.body.contains("replay") && again.body.contains("invalid_cluster_secret"), "{}", again.body);
    std::thread::sleep(Duration::from_millis(5));
    let next = send(&wire::register_auth(&p.secret, wire::unix_ms(), body.as_bytes()));
    assert_eq!(next.status, 204, "{}", next.body);
    // The captured one stays refused after a newer one was accepted.
    assert_eq!(send(&captured).status, 401);
    let m = wire::http(&p.addr, "GET", "/metrics", None, T).expect("metrics").body;
    assert_eq!(metric(&m, "handoff_replayed_registrations_total"), Some(2.0), "{m}");
    assert_eq!(metric(&m, "handoff_unauthenticated_connections_total{role=\"proxy\",listener=\"register\"}"), Some(2.0), "{m}");
}

#[test]
fn a_role_started_by_hand_without_a_secret_refuses_to_start_naming_the_variables() {
    for role in [vec!["proxy", "--config", SMALL], vec!["decode", "--config", SMALL], vec!["prefill", "--config", SMALL, "--stage", "0"]] {
        let out = Command::new(BIN).args(&role).env_remove(SECRET_ENV).env_remove(SECRET_FILE_ENV).stdin(Stdio::null()).output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{role:?} started without a secret");
        assert!(err.contains(SECRET_FILE_ENV) && err.contains(SECRET_ENV), "{role:?}: {err}");
    }
}

/// Sends `request` on a new connection and reads until the server closes it.
fn raw_exchange(addr: &str, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(T)).expect("timeout");
    let _ = s.write_all(request);
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    String::from_utf8_lossy(&got).into_owned()
}

#[test]
fn slow_clients_are_cut_off_and_connections_past_the_cap_get_503() {
    let p = proxy_with("header_timeout_s = 1\nbody_timeout_s = 1\nmax_connections = 4");

    // Half a request head, then silence: closed after the header timeout.
    let mut s = TcpStream::connect(&p.addr).expect("connect");
    s.set_read_timeout(Some(T)).expect("timeout");
    let t0 = Instant::now();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty").expect("half a head");
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    let took = t0.elapsed();
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(5), "closed after {took:?}");
    assert!(got.is_empty(), "no answer to a request never read: {:?}", String::from_utf8_lossy(&got));

    // A whole head and a tenth of the body: 408 after the body timeout, then closed.
    let mut s = TcpStream::connect(&p.addr).expect("connect");
    s.set_read_timeout(Some(T)).expect("timeout");
    let t0 = Instant::now();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":").expect("part");
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    let took = t0.elapsed();
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("\"code\":\"body_timeout\""), "{text}");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(5), "answered after {took:?}");

    // Once the connections above gave their places back (the /metrics request
    // itself holds one), four connections held open; a fifth asking for the
    // API is answered 503, while monitoring past the cap is still answered.
    let deadline = Instant::now() + T;
    while metric(&wire::http(&p.addr, "GET", "/metrics", None, T).expect("metrics").body, "handoff_open_connections") != Some(1.0) {
        assert!(Instant::now() < deadline, "the slow clients' places never came back");
        std::thread::sleep(Duration::from_millis(50));
    }
    let held: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(&p.addr).expect("connect")).collect();
    std::thread::sleep(Duration::from_millis(300));
    let past_cap = |request: &[u8]| raw_exchange(&p.addr, request);
    let text = past_cap(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}");
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(text.contains("\"code\":\"too_many_connections\"") && text.contains("retry-after: 1"), "{text}");
    let text = past_cap(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(text.starts_with("HTTP/1.1 200") && text.contains("handoff_open_connections 4"), "{text}");
    // /health answers for the cluster (no roles here: 503 not ready), not for the cap.
    let text = past_cap(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(text.starts_with("HTTP/1.1 ") && !text.contains("too_many_connections") && text.contains("roles"), "{text}");
    drop(held);
    // Their places come back.
    let deadline = Instant::now() + T;
    let m = loop {
        match wire::http(&p.addr, "GET", "/metrics", None, T) {
            Ok(r) if r.status == 200 => break r.body,
            _ if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            other => panic!("the cap did not release: {other:?}"),
        }
    };
    assert!(metric(&m, "handoff_connections_closed_total{listener=\"public\",reason=\"max_connections\"}").is_some_and(|n| n >= 1.0), "{m}");
    assert!(metric(&m, "handoff_connections_closed_total{listener=\"public\",reason=\"header_timeout\"}").is_some_and(|n| n >= 1.0), "{m}");
    assert!(metric(&m, "handoff_refusals_total{reason=\"body_timeout\"}").is_some_and(|n| n >= 1.0), "{m}");
}

/// `handoff up` on config/small.toml with `from` replaced by `to`, healthy;
/// the edited config's path, for the caller to remove.
fn small_cluster(name: &str, from: &str, to: &str) -> (Deployment, PathBuf) {
    let text = std::fs::read_to_string(SMALL).expect("small.toml");
    assert!(text.contains(from), "small.toml has no {from:?}");
    let path = std::env::temp_dir().join(format!("handoff-cluster-secret-{name}-{}.toml", std::process::id()));
    std::fs::write(&path, text.replace(from, to)).expect("config");
    let port = free_port().expect("port");
    let mut c = Deployment::start(Some(&path), "127.0.0.1", port, Some(PathBuf::from(BIN))).expect("start");
    c.wait_healthy(Duration::from_secs(60), false).expect("healthy");
    (c, path)
}

/// The cluster over the tcp transport: the roles' own transports prove the secret
/// to each other (the completion is served), and a stranger at decode's transport
/// port and at its control port is refused and counted under each listener.
#[test]
fn over_tcp_the_roles_hand_off_and_a_stranger_at_decodes_transport_port_is_counted() {
    let (mut c, path) = small_cluster("tcp", "[transport]\nkind = \"shm\"", "[transport]\nkind = \"tcp\"");
    let r = wire::http(&c.addr, "POST", "/v1/completions", Some(r#"{"prompt": "over tcp", "max_tokens": 3}"#), T).expect("http");
    assert_eq!(r.status, 200, "{}", r.body);

    let ports = listening_ports(c.pid("decode").expect("decode pid"));
    assert_eq!(ports.len(), 2, "decode over tcp listens on its control and transport ports: {ports:?}");
    let mut seen = Vec::new();
    for p in ports {
        let mut s = TcpStream::connect(("127.0.0.1", p)).expect("connect");
        s.set_read_timeout(Some(T)).expect("timeout");
        let mut first = [0u8; 5];
        s.read_exact(&mut first).expect("the listener speaks first");
        seen.push(if first[..4] == tcpwire::MAGIC.to_le_bytes() { "tcp" } else { "control" });
        // Garbage where the proof should be.
        let _ = s.write_all(b"not a proof at all, just bytes\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n");
        let _ = s.read_to_end(&mut Vec::new());
    }
    seen.sort();
    assert_eq!(seen, ["control", "tcp"]);
    wait_metric(&c.addr, "handoff_unauthenticated_connections_total{role=\"decode\",listener=\"tcp\"}", 1.0);
    wait_metric(&c.addr, "handoff_unauthenticated_connections_total{role=\"decode\",listener=\"control\"}", 1.0);
    let r = wire::http(&c.addr, "POST", "/v1/completions", Some(r#"{"prompt": "still over tcp", "max_tokens": 3}"#), T).expect("http");
    assert_eq!(r.status, 200, "{}", r.body);
    c.shutdown();
    let _ = std::fs::remove_file(path);
}

/// Monitoring is never locked out: with every place under
/// `serve.max_connections` held by idle clients, a served cluster still
/// answers /health 200 (ready, naming its roles) and /metrics 200, while the
/// API past the cap gets 503.
#[test]
fn a_served_cluster_answers_health_and_metrics_200_with_the_public_cap_reached() {
    let (mut c, path) = small_cluster("cap", "[serve]\n", "[serve]\nmax_connections = 3\n");
    let held: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(&c.addr).expect("connect")).collect();
    let deadline = Instant::now() + T;
    while metric(&wire::http(&c.addr, "GET", "/metrics", None, T).expect("metrics").body, "handoff_open_connections") != Some(3.0) {
        assert!(Instant::now() < deadline, "the three idle clients were never counted");
        std::thread::sleep(Duration::from_millis(50));
    }
    let past_cap = |request: &[u8]| raw_exchange(&c.addr, request);
    let api = past_cap(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}");
    assert!(api.starts_with("HTTP/1.1 503") && api.contains("too_many_connections"), "{api}");
    for _ in 0..3 {
        let health = past_cap(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(health.starts_with("HTTP/1.1 200") && health.contains("decode"), "{health}");
        let metrics = past_cap(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(metrics.starts_with("HTTP/1.1 200") && metrics.contains("handoff_open_connections 3"), "{metrics}");
    }
    drop(held);
    // Their places come back, and the API is served again.
    let deadline = Instant::now() + T;
    loop {
        let r = wire::http(&c.addr, "POST", "/v1/completions", Some(r#"{"prompt": "after the cap", "max_tokens": 3}"#), T).expect("http");
        if r.status == 200 {
            break;
        }
        assert!(r.status == 503 && Instant::now() < deadline, "{} {}", r.status, r.body);
        std::thread::sleep(Duration::from_millis(50));
    }
    c.shutdown();
    let _ = std::fs::remove_file(path);
}
