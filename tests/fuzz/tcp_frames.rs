//! The tcp transport's binary frames, sent to a live consumer over loopback.

use super::*;
use handoff::transport::auth::{Opener, Sealer};
use handoff::transport::tcp::wire as frames;
use handoff::transport::{MemoryKind, PeerAddr, RegionHandle, TcpOptions, TcpTransport, Transport};
use handoff_components::plan::Descriptor;
use handoff_components::vocab::{DecodeRank, PrefillRank, RankId, RegionKind};
use std::fmt::Debug;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

// ---- transport frames ----

/// One descriptor as a peer may send it.
#[derive(Debug, Clone)]
pub struct DescSpec {
    /// A region kind code (the region's own, mostly).
    pub kind: u8,
    pub dst_offset: u64,
    pub len: u64,
    pub count: u32,
    pub dst_stride: u64,
}

/// One frame as a peer may send it; `None` fields take the value a correct peer sends.
#[derive(Debug, Clone)]
pub enum FrameSpec {
    Hello {
        len: Option<u32>,
        json: Option<Vec<u8>>,
    },
    Write {
        descs: Vec<DescSpec>,
        region_ok: bool,
        ndesc: Option<u32>,
        payload: Option<u64>,
    },
    Notify {
        bytes: Vec<u8>,
        len: Option<u32>,
    },
    /// A frame type no peer sends, or a bad magic.
    Junk {
        magic_ok: bool,
        ty: u8,
    },
}

/// One connection's bytes: a hello, frames, and maybe a byte-level edit of the lot.
#[derive(Debug, Clone)]
pub struct FrameCase {
    pub frames: Vec<FrameSpec>,
    pub flip: Option<(usize, u8)>,
    pub truncate: Option<usize>,
}

/// The region the fuzzed consumer holds: its kind and length.
const FRAME_REGION: (RegionKind, u64) = (RegionKind::MlaKv, 4096);
/// Most payload bytes a case sends (a claimed payload past it is cut short).
const FRAME_PAYLOAD_CAP: u64 = 64 << 10;

pub fn u64_edge() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 0u64..=4096,
        1 => prop::sample::select(vec![0, 1, 4095, 4096, 4097, u32::MAX as u64, 1 << 32, u64::MAX / 2, u64::MAX - 1, u64::MAX]),
        1 => any::<u64>(),
    ]
}

pub fn u32_edge() -> impl Strategy<Value = u32> {
    prop_oneof![
        4 => 0u32..=8,
        1 => prop::sample::select(vec![0, 1, 2, 1 << 16, frames::MAX_DESCRIPTORS, frames::MAX_DESCRIPTORS + 1, frames::MAX_NOTIFY, u32::MAX - 1, u32::MAX]),
        1 => any::<u32>(),
    ]
}

fn desc_spec() -> impl Strategy<Value = DescSpec> {
    let kind = prop_oneof![6 => Just(frames::kind_code(FRAME_REGION.0)), 1 => any::<u8>()];
    // Mostly small and in bounds, so that valid batches are common.
    let small = (0u64..4096, 0u64..=256, 1u32..=4, 0u64..=512).prop_map(|(o, l, c, s)| (o, l, c, s));
    let edge = (u64_edge(), u64_edge(), u32_edge(), u64_edge());
    // Stride 0 repeats one range (it passes the bounds check whatever the count):
    // the shape that reaches the payload reader with a peer-chosen piece count.
    let repeat = (0u64..4096, prop_oneof![Just(0u64), 1u64..=64], u32_edge()).prop_map(|(o, l, c)| (o, l, c, 0));
    (kind, prop_oneof![3 => small, 1 => edge, 1 => repeat]).prop_map(|(kind, (dst_offset, len, count, dst_stride))| DescSpec {
        kind,
        dst_offset,
        len,
        count,
        dst_stride,
    })
}

fn frame_spec() -> impl Strategy<Value = FrameSpec> {
    let opt_u32 = || prop_oneof![4 => Just(None), 1 => u32_edge().prop_map(Some)];
    prop_oneof![
        1 => (opt_u32(), prop_oneof![4 => Just(None), 1 => prop::collection::vec(any::<u8>(), 0..24).prop_map(Some)])
            .prop_map(|(len, json)| FrameSpec::Hello { len, json }),
        5 => (
            prop::collection::vec(desc_spec(), 0..5),
            prop_oneof![6 => Just(true), 1 => Just(false)],
            opt_u32(),
            prop_oneof![5 => Just(None), 1 => u64_edge().prop_map(Some)],
        )
            .prop_map(|(descs, region_ok, ndesc, payload)| FrameSpec::Write { descs, region_ok, ndesc, payload }),
        2 => (prop::collection::vec(any::<u8>(), 0..64), opt_u32()).prop_map(|(bytes, len)| FrameSpec::Notify { bytes, len }),
        1 => (any::<bool>(), any::<u8>()).prop_map(|(magic_ok, ty)| FrameSpec::Junk { magic_ok, ty }),
    ]
}

pub fn frame_case() -> impl Strategy<Value = FrameCase> {
    (
        prop::collection::vec(frame_spec(), 1..5),
        prop_oneof![5 => Just(None), 1 => (any::<usize>(), 1u8..=255).prop_map(Some)],
        prop_oneof![5 => Just(None), 1 => any::<usize>().prop_map(Some)],
    )
        .prop_map(|(frames, flip, truncate)| FrameCase { frames, flip, truncate })
}

/// What a correct consumer does with a case's bytes.
#[derive(Debug, Default, PartialEq)]
struct Expected {
    /// One entry per WRITE it acks before the first malformed frame: whether the
    /// ack is a success.
    acks: Vec<bool>,
    notices: Vec<Vec<u8>>,
    /// Every frame is well-formed: no incident may be recorded.
    clean: bool,
    /// The first malformed frame is one the consumer must refuse where it stands
    /// (bad magic or type, a count past its limit, a payload that disagrees with
    /// its descriptors or ends early): an incident, and nothing read past it. A
    /// wrong length field makes what follows ambiguous, so it predicts less.
    definite: bool,
}

/// A live tcp consumer with one registered region, fed one connection per case.
pub struct FrameConsumer {
    transport: TcpTransport,
    region: RegionHandle,
}

/// The endpoint the fuzzed producer says it is.
const FRAME_PEER: PeerAddr = PeerAddr::Tcp { addr: SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 1)), 1) };

impl FrameConsumer {
    pub fn new() -> handoff::transport::Result<FrameConsumer> {
        // A short idle timeout: a case that leaves a frame half-sent is ended by
        // the consumer, not by the case's deadline.
        let opts = TcpOptions { idle_timeout: Duration::from_secs(1), io_chunk: 256 << 10, ..TcpOptions::default() };
        let transport = TcpTransport::bind(opts)?;
        let region = transport.register_memory(RankId::Decode(DecodeRank { tp: 0 }), FRAME_REGION.0, FRAME_REGION.1, MemoryKind::Host)?;
        Ok(FrameConsumer { transport, region })
    }

    pub fn transport(&self) -> &TcpTransport {
        &self.transport
    }

    pub fn region(&self) -> &RegionHandle {
        &self.region
    }

    /// The bytes of a case, each frame sealed as a member seals it (after the
    /// fuzz's edits of its fields, so the parser behind the MAC check is what
    /// the case reaches), and what a correct consumer answers when they are
    /// sent unedited (`None` when they were edited: anything clean goes).
    fn encode(&self, case: &FrameCase, sealer: &mut Sealer) -> (Vec<u8>, Option<Expected>) {
        // The handshake goes first ([`Self::check`]).
        let mut out = Vec::new();
        let me = FRAME_PEER;
        let mut exp = Expected { clean: true, ..Default::default() };
        for (batch, f) in case.frames.iter().enumerate() {
            if !exp.clean {
                // Past a malformed frame the consumer reads nothing more.
                break;
            }
            match f {
                FrameSpec::Hello { len, json } => {
                    let body = json.clone().unwrap_or_else(|| serde_json::to_vec(&me).expect("json"));
                    out.extend_from_slice(&frames::MAGIC.to_le_bytes());
                    out.push(frames::HELLO);
                    let n = len.unwrap_or(body.len() as u32);
                    out.extend_from_slice(&n.to_le_bytes());
                    out.extend_from_slice(&body);
                    // Past the handshake a HELLO is no frame of the stream: the
                    // consumer refuses it where it stands, whatever its length.
                    let _ = n;
                    (exp.clean, exp.definite) = (false, true);
                }
                FrameSpec::Notify { bytes, len } => {
                    let n = len.unwrap_or(bytes.len() as u32);
                    let mut body = n.to_le_bytes().to_vec();
                    body.extend_from_slice(bytes);
                    frames::write_sealed(&mut out, sealer, frames::NOTIFY, &body).expect("notify");
                    if n > frames::MAX_NOTIFY {
                        (exp.clean, exp.definite) = (false, true);
                    } else if n as usize == bytes.len() {
                        exp.notices.push(bytes.clone());
                    } else {
                        exp.clean = false;
                    }
                }
                FrameSpec::Junk { magic_ok, ty } => {
                    let magic = if *magic_ok { frames::MAGIC } else { frames::MAGIC ^ 0x0101 };
                    out.extend_from_slice(&magic.to_le_bytes());
                    out.push(*ty);
                    exp.clean = false;
                    // A WRITE or NOTIFY type after a good magic is a frame like the
                    // others; any other type (HELLO and CHALLENGE only open a
                    // connection, ACK goes the other way) is refused where it stands.
                    exp.definite = !*magic_ok || !(*ty == frames::WRITE || *ty == frames::NOTIFY);
                    if !exp.definite {
                        continue;
                    }
                }
                FrameSpec::Write { descs, region_ok, ndesc, payload } => {
                    let region = if *region_ok { self.region.id } else { self.region.id + 1000 };
                    let real: Vec<Descriptor> = descs
                        .iter()
                        .map(|d| Descriptor {
                            kind: frames::kind_from_code(d.kind).unwrap_or(RegionKind::MlaKv),
                            src_offset: 0,
                            src_stride: 0,
                            dst_offset: d.dst_offset,
                            len: d.len,
                            count: d.count,
                            dst_stride: d.dst_stride,
                        })
                        .collect();
                    let covered = real.iter().try_fold(0u64, |a, d| a.checked_add(d.len.checked_mul(u64::from(d.count))?));
                    let claimed = payload.or(covered).unwrap_or(u64::MAX);
                    // The header as the wire spells it, with the spec's kind codes
                    // and descriptor count (the real encoder writes only real ones).
                    let mut body = Vec::new();
                    body.extend_from_slice(&(batch as u64 + 1).to_le_bytes());
                    body.extend_from_slice(&region.to_le_bytes());
                    body.extend_from_slice(&ndesc.unwrap_or(descs.len() as u32).to_le_bytes());
                    body.extend_from_slice(&claimed.to_le_bytes());
                    for d in descs {
                        body.push(d.kind);
                        body.extend_from_slice(&d.dst_offset.to_le_bytes());
                        body.extend_from_slice(&d.len.to_le_bytes());
                        body.extend_from_slice(&d.count.to_le_bytes());
                        body.extend_from_slice(&d.dst_stride.to_le_bytes());
                    }
                    frames::write_sealed(&mut out, sealer, frames::WRITE, &body).expect("header");
                    let sent = claimed.min(FRAME_PAYLOAD_CAP);
                    out.extend((0..sent).map(|i| (i as u8).wrapping_mul(31).wrapping_add(batch as u8)));
                    if ndesc.is_some_and(|n| n > frames::MAX_DESCRIPTORS) {
                        (exp.clean, exp.definite) = (false, true);
                        continue;
                    }
                    if ndesc.is_some_and(|n| n as usize != descs.len()) {
                        exp.clean = false;
                        continue;
                    }
                    let well_formed = descs.iter().all(|d| frames::kind_from_code(d.kind).is_some()) && covered == Some(claimed) && sent == claimed;
                    if !well_formed {
                        (exp.clean, exp.definite) = (false, true);
                        continue;
                    }
                    let fits = real.iter().all(|d| {
                        let end = if d.len == 0 || d.count == 0 {
                            Some(d.dst_offset)
                        } else {
                            (u64::from(d.count) - 1).checked_mul(d.dst_stride).and_then(|x| x.checked_add(d.dst_offset)?.checked_add(d.len))
                        };
                        d.kind == FRAME_REGION.0 && end.is_some_and(|end| end <= FRAME_REGION.1)
                    });
                    exp.acks.push(*region_ok && fits);
                }
            }
        }
        let edited = case.flip.is_some() || case.truncate.is_some();
        if let Some((at, xor)) = case.flip {
            let i = at % out.len();
            out[i] ^= xor;
        }
        if let Some(at) = case.truncate {
            out.truncate(at % (out.len() + 1));
        }
        (out, (!edited).then_some(exp))
    }

    /// Sends one case on a fresh connection, closes the sending side, and reads
    /// the consumer's acks until it closes the connection.
    pub fn check(&self, case: &FrameCase) -> Verdict {
        let _ = self.transport.take_incidents();
        let _ = self.transport.recv_notifications();
        let mut s = TcpStream::connect(self.transport.addr()).map_err(|e| format!("connect: {e}"))?;
        // The handshake of a member (it proves the cluster secret): the fuzzed
        // frames are a member's, past the handshake (a stranger's are refused
        // before any frame is read; tests/cluster_secret.rs shows that).
        s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
        let mut session =
            frames::connect_handshake(&mut s, &FRAME_PEER, &handoff::transport::auth::ClusterSecret::process()).map_err(|e| format!("handshake: {e}"))?;
        let (bytes, expected) = self.encode(case, &mut session.sealer);
        s.set_read_timeout(Some(Duration::from_millis(50))).map_err(|e| e.to_string())?;
        // The consumer may close first (a malformed frame): a failed write is fine.
        let _ = s.write_all(&bytes);
        let _ = s.shutdown(Shutdown::Write);
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                // A reset: the consumer closed with our bytes unread.
                Err(_) => break,
            }
            if Instant::now() > deadline {
                return Err(format!("the consumer kept the connection open 5 s after the peer's end ({} B of acks)", got.len()));
            }
        }
        let acks = parse_acks(&got, &mut session.opener)?;
        let incidents = self.transport.take_incidents();
        let notices: Vec<Vec<u8>> = self.transport.recv_notifications().into_iter().map(|n| n.bytes).collect();
        if let Some(exp) = expected {
            let ok: Vec<bool> = acks.iter().map(|a| a.0).collect();
            let exact = exp.clean || exp.definite;
            if (exact && ok != exp.acks) || !ok.starts_with(&exp.acks) {
                return Err(format!("acks {ok:?} (reasons {:?}), a correct consumer sends {:?}", acks.iter().map(|a| &a.1).collect::<Vec<_>>(), exp.acks));
            }
            if (exact && notices != exp.notices) || !notices.starts_with(&exp.notices) {
                return Err(format!("delivered {} notifications, sent {} well-formed", notices.len(), exp.notices.len()));
            }
            if exp.clean && !incidents.is_empty() {
                return Err(format!("a well-formed connection recorded incidents: {incidents:?}"));
            }
            if exp.definite && incidents.is_empty() {
                return Err("a malformed frame recorded no incident".into());
            }
        }
        let class = match (acks.iter().any(|a| a.0), acks.iter().any(|a| !a.0), incidents.is_empty()) {
            (_, _, false) => "dropped (incident)",
            (true, _, true) => "acked",
            (false, true, true) => "rejected",
            (false, false, true) => "closed clean",
        };
        Ok(class.into())
    }

    /// A correct producer can still write the whole region, byte exact.
    pub fn healthy(&self) -> std::result::Result<(), String> {
        let producer = TcpTransport::loopback().map_err(|e| e.to_string())?;
        let (kind, len) = FRAME_REGION;
        let src = producer.register_memory(RankId::Prefill(PrefillRank { pp: 0, tp: 0 }), kind, len, MemoryKind::Host).map_err(|e| e.to_string())?;
        let pattern: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        producer.with_region_mut(&src, &mut |b| b.copy_from_slice(&pattern)).map_err(|e| e.to_string())?;
        let dst = producer.attach(&self.region).map_err(|e| e.to_string())?;
        let batch = producer.submit(&src, dst, &[Descriptor::copy(kind, 0, 0, len)]).map_err(|e| e.to_string())?;
        producer.wait(batch, Duration::from_secs(10)).map_err(|e| e.to_string())?;
        let mut same = false;
        self.transport.with_region(&self.region, &mut |b| same = b == &pattern[..]).map_err(|e| e.to_string())?;
        if !same {
            return Err("the region does not hold the bytes a correct producer wrote".into());
        }
        Ok(())
    }
}

/// The ACK frames of a byte stream: (success, reason); each must carry its MAC.
fn parse_acks(mut b: &[u8], opener: &mut Opener) -> std::result::Result<Vec<(bool, String)>, String> {
    let mut out = Vec::new();
    while !b.is_empty() {
        if b.len() < 18 {
            return Err(format!("{} stray bytes after {} acks", b.len(), out.len()));
        }
        if b[..4] != frames::MAGIC.to_le_bytes() || b[4] != frames::ACK {
            return Err(format!("the consumer sent a non-ack frame {:?}", &b[..5]));
        }
        let status = b[13];
        let n = u32::from_le_bytes([b[14], b[15], b[16], b[17]]) as usize;
        let Some(reason) = b.get(18..18 + n) else { return Err("a truncated ack".into()) };
        let Some(mac) = b.get(18 + n..18 + n + frames::MAC_BYTES) else { return Err("an ack without its MAC".into()) };
        opener.open(&[&[frames::ACK], &b[5..18 + n]], mac).map_err(|e| format!("ack {}: {e}", out.len()))?;
        out.push((status == 0, String::from_utf8_lossy(reason).into_owned()));
        b = &b[18 + n + frames::MAC_BYTES..];
    }
    Ok(out)
}
