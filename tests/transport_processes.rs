//! Transfers between real processes: shm between two processes of one host, TCP
//! between two network namespaces joined by a veth pair, and TCP peers that die or
//! stall mid-transfer (the survivor reports an error instead of hanging).
//!
//! Children are this test binary again (`current_exe`), running only
//! `child_entry` with `HANDOFF_TRANSPORT_CHILD` naming the role and
//! `HANDOFF_TRANSPORT_ARG` carrying JSON. Children print `CHILD:<key>=<value>` lines.

#[allow(dead_code)]
mod transport_util;

use handoff::transport::tcp::wire;
use handoff::transport::{PeerAddr, RegionHandle, ShmTransport, TcpOptions, TcpTransport, Transport, TransportError, TransportExt};
use handoff_components::plan::Descriptor;
use handoff_components::vocab::RegionKind;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use transport_util::*;

const ROLE: &str = "HANDOFF_TRANSPORT_CHILD";
const ARG: &str = "HANDOFF_TRANSPORT_ARG";
const SRC_LEN: u64 = 256 << 10;
const DST_LEN: u64 = 384 << 10;

/// What a child needs to reproduce the parent's bytes: the seed and the batch.
#[derive(Serialize, Deserialize)]
struct Job {
    handle: Option<RegionHandle>,
    seed: u64,
    descriptors: Vec<Descriptor>,
    bind: Option<SocketAddr>,
}

fn job(seed: u64) -> Job {
    let mut rng = Rng(seed);
    let descriptors = random_batch(&mut rng, RegionKind::MlaKv, 300, 2000, SRC_LEN, DST_LEN);
    Job { handle: None, seed, descriptors, bind: None }
}

/// The source bytes of a job (seeded, so both processes agree).
fn source_bytes(seed: u64) -> Vec<u8> {
    Rng(seed ^ 0xfeed).bytes(SRC_LEN as usize)
}

fn expected(seed: u64, descs: &[Descriptor]) -> Vec<u8> {
    let mut want = vec![0u8; DST_LEN as usize];
    naive_copy(&source_bytes(seed), &mut want, descs);
    want
}

fn child_command(prefix: &[&str], role: &str, arg: &Job) -> Command {
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
        .env(ARG, serde_json::to_string(arg).expect("job json"))
        // The child's transports must prove this process's cluster secret.
        .env(handoff::transport::auth::SECRET_ENV, handoff::transport::auth::ClusterSecret::process().to_hex())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    cmd
}

/// Reads the child's stdout on a thread; `CHILD:` lines come back over a channel.
fn child_lines(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    let out = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            // libtest may print "test child_entry ... " before our first line.
            if let Some(at) = line.find("CHILD:") {
                let _ = tx.send(line[at + "CHILD:".len()..].to_string());
            }
        }
    });
    rx
}

fn expect_line(rx: &std::sync::mpsc::Receiver<String>, key: &str, child: &mut Child) -> String {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(line) => {
                if let Some(v) = line.strip_prefix(&format!("{key}=")) {
                    return v.to_string();
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(_) => break,
        }
    }
    let _ = child.kill();
    panic!("child never printed CHILD:{key}= (exit: {:?})", child.wait());
}

fn say(key: &str, value: impl std::fmt::Display) {
    println!("CHILD:{key}={value}");
    let _ = std::io::stdout().flush();
}

// ---------------------------------------------------------------------------
// Child roles.

/// Not a test of its own: the entry point of the child processes. Without the
/// role variable (a normal test run) it does nothing.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE) else { return };
    let arg: Job = serde_json::from_str(&std::env::var(ARG).expect("job argument")).expect("job json");
    match role.as_str() {
        "shm-producer" => {
            let t = ShmTransport::new().expect("shm");
            if let PeerAddr::Shm { prefix, .. } = t.endpoint() {
                say("prefix", prefix);
            }
            produce(&t, &arg);
        }
        "tcp-producer" => {
            let opts = TcpOptions { bind: arg.bind.expect("bind"), ..TcpOptions::default() };
            produce(&TcpTransport::bind(opts).expect("tcp bind"), &arg);
        }
        "tcp-consumer" => {
            let opts = TcpOptions { bind: arg.bind.expect("bind"), ..TcpOptions::default() };
            let t = TcpTransport::bind(opts).expect("tcp bind");
            let dst = t.register(consumer_rank(), RegionKind::MlaKv, DST_LEN).expect("register");
            say("handle", handle_json(&dst));
            let note = t.wait_notifications(WAIT);
            assert_eq!(note.first().map(|n| n.bytes.as_slice()), Some(&b"done"[..]), "write-done notification");
            let got = t.region_bytes(&dst).expect("read");
            assert_bytes_eq("netns consumer", &got, &expected(arg.seed, &arg.descriptors), &arg.descriptors);
            say("verified", got.len());
        }
        "tcp-consumer-idle" => {
            let t = TcpTransport::loopback().expect("tcp");
            let dst = t.register(consumer_rank(), RegionKind::MlaKv, 64 << 20).expect("register");
            say("handle", handle_json(&dst));
            std::thread::sleep(WAIT * 3);
        }
        "tcp-stalled-producer" => {
            // Plays a producer that announces 1 MiB, sends 64 KiB and then stops.
            let h = arg.handle.expect("handle");
            let PeerAddr::Tcp { addr } = h.peer else { panic!("tcp handle") };
            let mut s = std::net::TcpStream::connect(addr).expect("connect");
            let me = PeerAddr::Tcp { addr: s.local_addr().expect("addr") };
            let mut session = wire::connect_handshake(&mut s, &me, &handoff::transport::auth::ClusterSecret::process()).expect("handshake");
            let d = Descriptor::copy(RegionKind::MlaKv, 0, 0, 1 << 20);
            wire::write_batch_header(&mut s, &mut session.sealer, 7, h.id, &[d], 1 << 20).expect("header");
            s.write_all(&vec![0x77u8; 64 << 10]).expect("partial payload");
            s.flush().expect("flush");
            say("sent", 65536);
            std::thread::sleep(WAIT * 3);
        }
        #[cfg(feature = "ucx")]
        "ucx-consumer-idle" => {
            // UCX's default lanes: shared memory between two processes of one host.
            let t = handoff::transport::UcxTransport::open(handoff::transport::UcxOptions::default()).expect("ucx");
            let dst = t.register(consumer_rank(), RegionKind::MlaKv, 64 << 20).expect("register");
            say("handle", handle_json(&dst));
            std::thread::sleep(WAIT * 3);
        }
        other => panic!("unknown child role {other}"),
    }
}

/// Producer role: fill a source, write the batch into the handle's region, report.
fn produce(t: &dyn Transport, arg: &Job) {
    let src = t.register(producer_rank(), RegionKind::MlaKv, SRC_LEN).expect("register src");
    let bytes = source_bytes(arg.seed);
    t.write_region(&src, |b| b.copy_from_slice(&bytes)).expect("fill");
    let handle = arg.handle.as_ref().expect("handle");
    let dst = t.attach(handle).expect("attach");
    t.transfer(&src, dst, &arg.descriptors, WAIT).expect("transfer");
    t.notify(&handle.peer, b"done").expect("notify");
    say("done", arg.descriptors.len());
}

// ---------------------------------------------------------------------------
// Tests.

/// A child process maps the parent's shm region from the handle alone and writes a
/// random strided batch into it; the parent sees the reference bytes, gets the
/// child's notification, and the child's own files are gone after it exits.
#[test]
fn shm_child_process_writes_into_parent_region_from_handle() {
    let consumer = ShmTransport::new().expect("shm");
    let dst = consumer.register(consumer_rank(), RegionKind::MlaKv, DST_LEN).expect("register");
    let mut j = job(11);
    j.handle = Some(dst.clone());
    let mut child = child_command(&[], "shm-producer", &j).spawn().expect("spawn child");
    let rx = child_lines(&mut child);
    let prefix = expect_line(&rx, "prefix", &mut child);
    expect_line(&rx, "done", &mut child);
    assert!(transport_util::wait_child(&mut child, "shm producer", WAIT).success());
    let notes = consumer.wait_notifications(WAIT);
    assert_eq!(notes.len(), 1);
    assert_eq!(notes[0].bytes, b"done");
    assert!(matches!(&notes[0].from, Some(PeerAddr::Shm { prefix: p, .. }) if *p == prefix), "sender is the child");
    let got = consumer.region_bytes(&dst).expect("read");
    assert_bytes_eq("shm cross-process", &got, &expected(j.seed, &j.descriptors), &j.descriptors);
    let PeerAddr::Shm { dir, .. } = &dst.peer else { unreachable!() };
    let left = std::fs::read_dir(dir).expect("dir").flatten().filter(|e| e.file_name().to_string_lossy().starts_with(&prefix)).count();
    assert_eq!(left, 0, "the child's shm files were not cleaned up");
}

/// A producer that dies mid-batch (SIGKILL after part of the payload): the consumer
/// records an incident naming the batch, keeps serving, and accepts new producers.
#[test]
fn tcp_consumer_reports_producer_killed_mid_transfer() {
    let consumer = TcpTransport::bind(TcpOptions { idle_timeout: Duration::from_secs(60), ..TcpOptions::default() }).expect("tcp");
    let dst = consumer.register(consumer_rank(), RegionKind::MlaKv, 1 << 20).expect("register");
    let mut j = job(3);
    j.handle = Some(dst.clone());
    let mut child = child_command(&[], "tcp-stalled-producer", &j).spawn().expect("spawn");
    let rx = child_lines(&mut child);
    expect_line(&rx, "sent", &mut child);
    child.kill().expect("kill producer");
    let _ = child.wait();
    let incident = wait_incident(&consumer);
    assert!(matches!(&incident.error, TransportError::Disconnected { reason, .. } if reason.contains("batch 7")), "unexpected incident: {}", incident.error);
    // Still serving: a fresh producer's batch lands.
    let producer = TcpTransport::loopback().expect("tcp");
    let src = producer.register(producer_rank(), RegionKind::MlaKv, 4096).expect("src");
    producer.write_region(&src, |b| b.fill(0x42)).expect("fill");
    let r = producer.attach(&dst).expect("attach");
    producer.transfer(&src, r, &[Descriptor::copy(RegionKind::MlaKv, 0, 0, 4096)], WAIT).expect("transfer");
    assert!(consumer.region_bytes(&dst).expect("read")[..4096].iter().all(|&b| b == 0x42));
}

/// A producer that stops sending mid-batch without closing: the consumer gives up
/// after its idle timeout and reports a timeout instead of waiting forever.
#[test]
fn tcp_consumer_reports_stalled_producer_as_timeout() {
    let consumer = TcpTransport::bind(TcpOptions { idle_timeout: Duration::from_millis(300), ..TcpOptions::default() }).expect("tcp");
    let dst = consumer.register(consumer_rank(), RegionKind::MlaKv, 1 << 20).expect("register");
    let mut s = std::net::TcpStream::connect(consumer.addr()).expect("connect");
    // A member of the cluster (it proves the secret) that then stalls.
    let me = PeerAddr::Tcp { addr: s.local_addr().expect("addr") };
    let mut session = wire::connect_handshake(&mut s, &me, &handoff::transport::auth::ClusterSecret::process()).expect("handshake");
    wire::write_batch_header(&mut s, &mut session.sealer, 9, dst.id, &[Descriptor::copy(RegionKind::MlaKv, 0, 0, 1 << 20)], 1 << 20).expect("header");
    s.write_all(&[1u8; 1000]).expect("partial");
    let incident = wait_incident(&consumer);
    assert!(matches!(&incident.error, TransportError::Timeout { what, .. } if what.contains("batch 9")), "{}", incident.error);
    drop(s);
}

/// The consumer process dies: the producer's transfer fails (at submit or wait)
/// with an error, not a hang and not a success.
#[test]
fn tcp_producer_reports_consumer_killed() {
    let mut child = child_command(&[], "tcp-consumer-idle", &job(1)).spawn().expect("spawn");
    let rx = child_lines(&mut child);
    let handle: RegionHandle = serde_json::from_str(&expect_line(&rx, "handle", &mut child)).expect("handle json");
    let producer = TcpTransport::loopback().expect("tcp");
    let src = producer.register(producer_rank(), RegionKind::MlaKv, 64 << 20).expect("src");
    let r = producer.attach(&handle).expect("attach");
    child.kill().expect("kill consumer");
    let _ = child.wait();
    let d = [Descriptor::copy(RegionKind::MlaKv, 0, 0, 64 << 20)];
    let outcome = producer.submit(&src, r, &d).and_then(|b| producer.wait(b, WAIT));
    let err = outcome.expect_err("a transfer to a dead consumer must fail");
    assert!(err.is_transient(), "a lost peer is reported as transient: {err}");
}

fn wait_incident(t: &TcpTransport) -> handoff::transport::Incident {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if let Some(i) = t.take_incidents().into_iter().next() {
            return i;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("no incident reported within {WAIT:?}");
}

/// Two network namespaces joined by a veth pair, link-local addresses inside them
/// only. Removed on drop.
struct Netns {
    names: [String; 2],
}

impl Netns {
    fn ip(args: &[&str]) -> Result<(), String> {
        let out = Command::new("ip").args(args).output().map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
        if out.status.success() { Ok(()) } else { Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim())) }
    }

    fn create() -> Result<Netns, String> {
        let pid = std::process::id();
        let ns = Netns { names: [format!("hoffA{pid}"), format!("hoffB{pid}")] };
        let (a, b) = (ns.names[0].as_str(), ns.names[1].as_str());
        let (va, vb) = (format!("hva{pid}"), format!("hvb{pid}"));
        Self::ip(&["netns", "add", a])?;
        Self::ip(&["netns", "add", b])?;
        Self::ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        Self::ip(&["link", "set", &va, "netns", a])?;
        Self::ip(&["link", "set", &vb, "netns", b])?;
        Self::ip(&["-n", a, "addr", "add", "169.254.77.1/30", "dev", &va])?;
        Self::ip(&["-n", b, "addr", "add", "169.254.77.2/30", "dev", &vb])?;
        for (n, v) in [(a, &va), (b, &vb)] {
            Self::ip(&["-n", n, "link", "set", "lo", "up"])?;
            Self::ip(&["-n", n, "link", "set", v, "up"])?;
        }
        Ok(ns)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Self::ip(&["netns", "del", n]);
        }
    }
}

/// A consumer in one namespace and a producer in another, over a veth pair: the
/// consumer verifies the bytes itself against the reference. Skips (with the
/// reason) where network namespaces cannot be created.
#[test]
fn tcp_between_network_namespaces_over_veth_is_byte_exact() {
    let ns = match Netns::create() {
        Ok(ns) => ns,
        Err(reason) => {
            // Under CI (root, CI=true) network namespaces must work: fail, never skip.
            assert!(
                std::env::var_os("CI").is_none(),
                "tcp_between_network_namespaces_over_veth_is_byte_exact: network namespaces unavailable under CI: {reason}"
            );
            eprintln!("SKIPPED tcp_between_network_namespaces_over_veth_is_byte_exact (not under CI): {reason}");
            return;
        }
    };
    let mut j = job(21);
    j.bind = Some("169.254.77.1:0".parse().expect("addr"));
    let mut consumer = child_command(&["ip", "netns", "exec", &ns.names[0]], "tcp-consumer", &j).spawn().expect("spawn consumer");
    let crx = child_lines(&mut consumer);
    let handle: RegionHandle = serde_json::from_str(&expect_line(&crx, "handle", &mut consumer)).expect("handle");
    assert!(matches!(handle.peer, PeerAddr::Tcp { addr } if addr.ip().to_string() == "169.254.77.1"));
    j.handle = Some(handle);
    j.bind = Some("169.254.77.2:0".parse().expect("addr"));
    let mut producer = child_command(&["ip", "netns", "exec", &ns.names[1]], "tcp-producer", &j).spawn().expect("spawn producer");
    let prx = child_lines(&mut producer);
    expect_line(&prx, "done", &mut producer);
    assert!(transport_util::wait_child(&mut producer, "netns producer", WAIT).success());
    let verified = expect_line(&crx, "verified", &mut consumer);
    assert_eq!(verified, DST_LEN.to_string());
    assert!(transport_util::wait_child(&mut consumer, "netns consumer", WAIT).success());
}

/// The consumer process dies while a ucx producer writes into its region over
/// UCX's shared-memory lanes, which report no peer failure (stored into a
/// mapping, and put into): the producer's next batch fails with
/// `Disconnected` within a bound (the peer's notice link closed), not a
/// success into memory no one reads, and not a hang.
#[cfg(feature = "ucx")]
#[test]
fn ucx_producer_reports_consumer_killed_on_shm_lanes() {
    use handoff::transport::{UcxOptions, UcxTransport};
    for direct in [true, false] {
        let mut child = child_command(&[], "ucx-consumer-idle", &job(1)).spawn().expect("spawn");
        let rx = child_lines(&mut child);
        let handle: RegionHandle = serde_json::from_str(&expect_line(&rx, "handle", &mut child)).expect("handle json");
        let producer = UcxTransport::open(UcxOptions { direct, ..UcxOptions::default() }).expect("ucx");
        let src = producer.register(producer_rank(), RegionKind::MlaKv, 64 << 20).expect("src");
        let r = producer.attach(&handle).expect("attach");
        assert_eq!(producer.writes_in_place(r), direct, "UCX maps a peer of this host over its shared-memory lanes");
        let d = [Descriptor::copy(RegionKind::MlaKv, 0, 0, 64 << 20)];
        producer.transfer(&src, r, &d, WAIT).expect("a live consumer's batch");
        child.kill().expect("kill consumer");
        let _ = child.wait();
        let started = Instant::now();
        let err = loop {
            match producer.submit(&src, r, &d).and_then(|b| producer.wait(b, WAIT)) {
                Err(e) => break e,
                Ok(()) if started.elapsed() < WAIT => std::thread::sleep(Duration::from_millis(20)),
                Ok(()) => panic!("direct {direct}: batches to a consumer killed {WAIT:?} ago still succeed"),
            }
        };
        assert!(matches!(err, TransportError::Disconnected { .. }), "direct {direct}: {err}");
        eprintln!("direct {direct}: failed {:?} after the kill: {err}", started.elapsed());
    }
}
