//! What two verbs transports say to each other over their bootstrap: the
//! queue pair and remote key exchange, and the engine's own notifications.
//!
//! The bootstrap is a tcp transport ([`crate::transport::tcp`]): every
//! connection proves the cluster secret and every message carries a MAC, so
//! these messages come from a member of the cluster, unaltered. They are still
//! a peer's word: [`decode`] refuses anything malformed, and the transport
//! refuses a reply that does not answer its request ([`Reply::answers`]).
//!
//! Little endian. Every message starts with a tag byte:
//! - [`NOTICE`]: u32 fence, then the engine's bytes. The fence is the sender's
//!   last completed write sequence number on its queue pair to the receiver
//!   (0: none); the receiver holds the notice until that write's immediate
//!   has arrived on its queue pair, so a write-done report never overtakes
//!   the bytes it reports.
//! - [`CONTROL`]: [`MAGIC`], u8 [`VERSION`], u8 type, u64 token (which request
//!   a reply answers), then the body:
//!   - CONNECT / ACCEPT: a [`QpInfo`] (u32 qpn, u32 psn, u16 lid, 16 bytes gid,
//!     u8 mtu, u8 link layer);
//!   - KEYS_REQUEST: u64 region id;
//!   - KEYS: u64 region id, u8 kind, u64 len, u32 n, then n x (u64 offset,
//!     u64 len, u64 addr, u32 rkey);
//!   - REFUSE: u32 n, n bytes of UTF-8 reason.

use super::plan::{MrChunk, check_cover};
use super::qp::{LinkLayer, QpInfo};
use handoff_components::vocab::RegionKind;

pub const NOTICE: u8 = 0;
pub const CONTROL: u8 = 1;
pub const MAGIC: [u8; 4] = *b"HRDM";
pub const VERSION: u8 = 1;

const CONNECT: u8 = 1;
const ACCEPT: u8 = 2;
const KEYS_REQUEST: u8 = 3;
const KEYS: u8 = 4;
const REFUSE: u8 = 5;

/// Most chunks a key list may carry: 64 TiB of region at 1 GiB a chunk.
pub const MAX_CHUNKS: u32 = 1 << 16;
/// Most bytes of a refusal's reason.
pub const MAX_REASON: u32 = 4096;

/// One region's memory registrations as a peer addresses them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionKeys {
    pub region: u64,
    pub kind: RegionKind,
    pub len: u64,
    /// Cover `0..len` in order; `key` is the rkey.
    pub chunks: Vec<MrChunk>,
}

/// The control messages of the exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// A producer's queue pair, in INIT, asking for a peer queue pair.
    Connect(QpInfo),
    /// The consumer's queue pair, already in RTR towards the producer's.
    Accept(QpInfo),
    KeysRequest {
        region: u64,
    },
    Keys(RegionKeys),
    /// The request cannot be served, and why.
    Refuse(String),
}

/// One message of the bootstrap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Notice { fence: u32, bytes: Vec<u8> },
    Control { token: u64, control: Control },
}

/// Why a message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("rdma exchange message refused: {0}")]
pub struct Malformed(pub String);

fn bad(s: impl Into<String>) -> Malformed {
    Malformed(s.into())
}

/// Encodes a message.
pub fn encode(m: &Message) -> Vec<u8> {
    let mut b = Vec::new();
    match m {
        Message::Notice { fence, bytes } => {
            b.push(NOTICE);
            b.extend_from_slice(&fence.to_le_bytes());
            b.extend_from_slice(bytes);
        }
        Message::Control { token, control } => {
            b.push(CONTROL);
            b.extend_from_slice(&MAGIC);
            b.push(VERSION);
            let ty = match control {
                Control::Connect(_) => CONNECT,
                Control::Accept(_) => ACCEPT,
                Control::KeysRequest { .. } => KEYS_REQUEST,
                Control::Keys(_) => KEYS,
                Control::Refuse(_) => REFUSE,
            };
            b.push(ty);
            b.extend_from_slice(&token.to_le_bytes());
            match control {
                Control::Connect(q) | Control::Accept(q) => {
                    b.extend_from_slice(&q.qpn.to_le_bytes());
                    b.extend_from_slice(&q.psn.to_le_bytes());
                    b.extend_from_slice(&q.lid.to_le_bytes());
                    b.extend_from_slice(&q.gid);
                    b.push(q.mtu);
                    b.push(q.link.code());
                }
                Control::KeysRequest { region } => b.extend_from_slice(&region.to_le_bytes()),
                Control::Keys(k) => {
                    b.extend_from_slice(&k.region.to_le_bytes());
                    b.push(k.kind.index() as u8);
                    b.extend_from_slice(&k.len.to_le_bytes());
                    b.extend_from_slice(&(k.chunks.len() as u32).to_le_bytes());
                    for c in &k.chunks {
                        b.extend_from_slice(&c.offset.to_le_bytes());
                        b.extend_from_slice(&c.len.to_le_bytes());
                        b.extend_from_slice(&c.addr.to_le_bytes());
                        b.extend_from_slice(&c.key.to_le_bytes());
                    }
                }
                Control::Refuse(why) => {
                    let why = &why.as_bytes()[..why.len().min(MAX_REASON as usize)];
                    // Cut on a character boundary: the reason stays UTF-8.
                    let cut = (0..=why.len()).rev().find(|&n| std::str::from_utf8(&why[..n]).is_ok()).unwrap_or(0);
                    b.extend_from_slice(&(cut as u32).to_le_bytes());
                    b.extend_from_slice(&why[..cut]);
                }
            }
        }
    }
    b
}

struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], Malformed> {
        if self.b.len() < n {
            return Err(bad(format!("truncated: {what} needs {n} bytes, {} left", self.b.len())));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self, what: &str) -> Result<u8, Malformed> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, Malformed> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().map_err(|_| bad(what))?))
    }
    fn u32(&mut self, what: &str) -> Result<u32, Malformed> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().map_err(|_| bad(what))?))
    }
    fn u64(&mut self, what: &str) -> Result<u64, Malformed> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().map_err(|_| bad(what))?))
    }
    fn end(&self) -> Result<(), Malformed> {
        if self.b.is_empty() { Ok(()) } else { Err(bad(format!("{} trailing bytes", self.b.len()))) }
    }
}

fn qp_info(r: &mut Reader<'_>) -> Result<QpInfo, Malformed> {
    let qpn = r.u32("qpn")?;
    let psn = r.u32("psn")?;
    let lid = r.u16("lid")?;
    let gid: [u8; 16] = r.take(16, "gid")?.try_into().map_err(|_| bad("gid"))?;
    let mtu = r.u8("mtu")?;
    let code = r.u8("link layer")?;
    let link = match code {
        1 => LinkLayer::InfiniBand,
        2 => LinkLayer::Ethernet,
        c => return Err(bad(format!("link layer code {c} (1 InfiniBand, 2 Ethernet)"))),
    };
    let q = QpInfo { qpn, psn, lid, gid, mtu, link };
    q.check().map_err(|e| bad(e.to_string()))?;
    Ok(q)
}

/// Decodes and checks a message: every length within its bounds, every field
/// in its range, a key list that covers its region, nothing after the end.
pub fn decode(b: &[u8]) -> Result<Message, Malformed> {
    let mut r = Reader { b };
    match r.u8("tag")? {
        NOTICE => {
            let fence = r.u32("fence")?;
            Ok(Message::Notice { fence, bytes: r.b.to_vec() })
        }
        CONTROL => {
            if r.take(4, "magic")? != MAGIC {
                return Err(bad("not an rdma exchange message (magic)"));
            }
            let v = r.u8("version")?;
            if v != VERSION {
                return Err(bad(format!("version {v}, this build speaks {VERSION}")));
            }
            let ty = r.u8("type")?;
            let token = r.u64("token")?;
            let control = match ty {
                CONNECT => Control::Connect(qp_info(&mut r)?),
                ACCEPT => Control::Accept(qp_info(&mut r)?),
                KEYS_REQUEST => Control::KeysRequest { region: r.u64("region")? },
                KEYS => {
                    let region = r.u64("region")?;
                    let code = r.u8("kind")?;
                    let kind = *RegionKind::ALL.get(code as usize).ok_or_else(|| bad(format!("region kind code {code}")))?;
                    let len = r.u64("len")?;
                    let n = r.u32("chunk count")?;
                    if n > MAX_CHUNKS {
                        return Err(bad(format!("{n} chunks (at most {MAX_CHUNKS})")));
                    }
                    let mut chunks = Vec::with_capacity((n as usize).min(r.b.len() / 28));
                    for _ in 0..n {
                        chunks.push(MrChunk { offset: r.u64("chunk offset")?, len: r.u64("chunk len")?, addr: r.u64("chunk addr")?, key: r.u32("rkey")? });
                    }
                    check_cover(&chunks, len).map_err(|e| bad(format!("keys of region {region}: {e}")))?;
                    Control::Keys(RegionKeys { region, kind, len, chunks })
                }
                REFUSE => {
                    let n = r.u32("reason length")?;
                    if n > MAX_REASON {
                        return Err(bad(format!("a reason of {n} bytes (at most {MAX_REASON})")));
                    }
                    let why = std::str::from_utf8(r.take(n as usize, "reason")?).map_err(|_| bad("reason is not UTF-8"))?;
                    Control::Refuse(why.to_string())
                }
                t => return Err(bad(format!("control type {t}"))),
            };
            r.end()?;
            Ok(Message::Control { token, control })
        }
        t => Err(bad(format!("tag {t} (0 notice, 1 control)"))),
    }
}

/// A request this end sent and waits on: what a reply must answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ask {
    Connect,
    /// Keys of the region a handle names, with the kind and length it claims.
    Keys {
        region: u64,
        kind: RegionKind,
        len: u64,
    },
}

/// Why a reply does not answer the request it names: the peer's refusal, or a
/// reply of the wrong type or for another region.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplyError {
    #[error("the peer refused: {reason}")]
    Refused { reason: String },
    #[error("asked for the keys of region {asked}, got region {got}'s")]
    OtherRegion { asked: u64, got: u64 },
    #[error("region {region}: the handle says {kind} of {len} B, its keys {got_kind} of {got_len} B")]
    OtherShape { region: u64, kind: RegionKind, len: u64, got_kind: RegionKind, got_len: u64 },
    #[error("a {reply} does not answer a {request:?} request")]
    Unanswered { reply: &'static str, request: Ask },
}

/// What a reply yields once it answers its request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Accept(QpInfo),
    Keys(RegionKeys),
}

impl Reply {
    /// Checks `control` against `request`: an ACCEPT answers a CONNECT, KEYS a
    /// KEYS_REQUEST for the same region of the same kind and length as the
    /// handle said; a REFUSE is the peer's reason; anything else is refused.
    pub fn answers(request: Ask, control: Control) -> Result<Reply, ReplyError> {
        match (request, control) {
            (_, Control::Refuse(reason)) => Err(ReplyError::Refused { reason }),
            (Ask::Connect, Control::Accept(q)) => Ok(Reply::Accept(q)),
            (Ask::Keys { region, kind, len }, Control::Keys(k)) => {
                if k.region != region {
                    return Err(ReplyError::OtherRegion { asked: region, got: k.region });
                }
                if k.kind != kind || k.len != len {
                    return Err(ReplyError::OtherShape { region, kind, len, got_kind: k.kind, got_len: k.len });
                }
                Ok(Reply::Keys(k))
            }
            (request, c) => Err(ReplyError::Unanswered { reply: name(&c), request }),
        }
    }
}

fn name(c: &Control) -> &'static str {
    match c {
        Control::Connect(_) => "CONNECT",
        Control::Accept(_) => "ACCEPT",
        Control::KeysRequest { .. } => "KEYS_REQUEST",
        Control::Keys(_) => "KEYS",
        Control::Refuse(_) => "REFUSE",
    }
}

/// Whether write sequence number `landed` has reached `fence` (numbers wrap;
/// 0 is never a write's number, so a fence of 0 is always reached).
pub fn reached(landed: u32, fence: u32) -> bool {
    fence == 0 || (landed != 0 && landed.wrapping_sub(fence) as i32 >= 0)
}

/// The write sequence number after `n` (wrapping past 0, which means "none").
pub fn next_seq(n: u32) -> u32 {
    match n.wrapping_add(1) {
        0 => 1,
        s => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> QpInfo {
        QpInfo { qpn: 0x11, psn: 0x22, lid: 3, gid: [4; 16], mtu: 5, link: LinkLayer::InfiniBand }
    }

    fn keys() -> RegionKeys {
        RegionKeys {
            region: 9,
            kind: RegionKind::KdaState,
            len: 10_000,
            chunks: vec![MrChunk { offset: 0, len: 8192, addr: 0x7f00_0000_0000, key: 5 }, MrChunk { offset: 8192, len: 1808, addr: 0x7f00_0000_2000, key: 6 }],
        }
    }

    fn all() -> Vec<Message> {
        let c = |token, control| Message::Control { token, control };
        vec![
            Message::Notice { fence: 0, bytes: vec![] },
            Message::Notice { fence: 77, bytes: b"{\"done\":1}".to_vec() },
            c(1, Control::Connect(info())),
            c(2, Control::Accept(QpInfo { link: LinkLayer::Ethernet, lid: 0, ..info() })),
            c(3, Control::KeysRequest { region: 9 }),
            c(u64::MAX, Control::Keys(keys())),
            c(5, Control::Refuse("no region 9 here".into())),
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for m in all() {
            assert_eq!(decode(&encode(&m)), Ok(m.clone()), "{m:?}");
        }
    }

    #[test]
    fn every_truncation_and_every_extension_of_a_control_message_is_refused() {
        for m in all().into_iter().filter(|m| matches!(m, Message::Control { .. })) {
            let b = encode(&m);
            for n in 0..b.len() {
                assert!(decode(&b[..n]).is_err(), "{m:?} cut at {n}");
            }
            let mut long = b.clone();
            long.push(0);
            assert!(decode(&long).unwrap_err().0.contains("trailing"), "{m:?}");
        }
    }

    #[test]
    fn malformed_fields_are_refused_with_their_name() {
        let b = encode(&Message::Control { token: 1, control: Control::Connect(info()) });
        let cases: Vec<(usize, u8, &str)> = vec![
            (0, 7, "tag 7"),
            (1, b'X', "magic"),
            (5, 2, "version 2"),
            (6, 9, "control type 9"),
            (b.len() - 1, 3, "link layer code 3"),
            (b.len() - 2, 0, "MTU code 0"),
        ];
        for (at, v, want) in cases {
            let mut m = b.clone();
            m[at] = v;
            let e = decode(&m).unwrap_err();
            assert!(e.0.contains(want), "{want}: {e}");
        }
        // A QPN over 24 bits.
        let mut m = b.clone();
        m[15 + 3] = 1;
        assert!(decode(&m).unwrap_err().0.contains("24-bit"));
    }

    #[test]
    fn key_lists_that_do_not_cover_their_region_are_refused() {
        let mut gap = keys();
        gap.chunks[1].offset += 8;
        assert!(decode(&encode(&Message::Control { token: 1, control: Control::Keys(gap) })).unwrap_err().0.contains("chunk 1 starts"));
        let mut short = keys();
        short.len += 1;
        assert!(decode(&encode(&Message::Control { token: 1, control: Control::Keys(short) })).unwrap_err().0.contains("cover"));
        let mut b = encode(&Message::Control { token: 1, control: Control::Keys(keys()) });
        // The chunk count field: 15 header bytes, region 8, kind 1, len 8.
        b[15 + 17..15 + 21].copy_from_slice(&(MAX_CHUNKS + 1).to_le_bytes());
        assert!(decode(&b).unwrap_err().0.contains("chunks (at most"));
        b[15 + 8] = 200;
        assert!(decode(&b).unwrap_err().0.contains("region kind code 200"));
    }

    #[test]
    fn a_refusal_reason_is_bounded_and_stays_utf8() {
        let long = "é".repeat(3000);
        let Ok(Message::Control { control: Control::Refuse(why), .. }) = decode(&encode(&Message::Control { token: 1, control: Control::Refuse(long) })) else {
            panic!("refusal decodes");
        };
        assert_eq!(why.len(), MAX_REASON as usize);
        let mut b = encode(&Message::Control { token: 1, control: Control::Refuse("ok".into()) });
        let n = b.len();
        b[n - 1] = 0xff;
        assert!(decode(&b).unwrap_err().0.contains("UTF-8"));
    }

    #[test]
    fn a_reply_must_answer_its_request() {
        let want = Ask::Keys { region: 9, kind: RegionKind::KdaState, len: 10_000 };
        assert_eq!(Reply::answers(want, Control::Keys(keys())), Ok(Reply::Keys(keys())));
        let other = RegionKeys { region: 8, ..keys() };
        assert!(Reply::answers(want, Control::Keys(other)).unwrap_err().to_string().contains("got region 8"));
        let shorter = Ask::Keys { region: 9, kind: RegionKind::KdaState, len: 9_999 };
        assert!(Reply::answers(shorter, Control::Keys(keys())).unwrap_err().to_string().contains("the handle says"));
        let kind = Ask::Keys { region: 9, kind: RegionKind::MlaKv, len: 10_000 };
        assert!(Reply::answers(kind, Control::Keys(keys())).is_err());
        assert!(Reply::answers(Ask::Connect, Control::Keys(keys())).unwrap_err().to_string().contains("does not answer"));
        assert!(Reply::answers(want, Control::Accept(info())).is_err());
        assert!(Reply::answers(Ask::Connect, Control::Refuse("full".into())).unwrap_err().to_string().contains("refused: full"));
        assert_eq!(Reply::answers(Ask::Connect, Control::Accept(info())), Ok(Reply::Accept(info())));
    }

    #[test]
    fn fences_compare_across_the_wrap() {
        assert!(reached(0, 0) && reached(5, 0));
        assert!(reached(5, 5) && reached(6, 5) && !reached(4, 5));
        assert!(!reached(0, 1));
        assert!(reached(2, u32::MAX));
        assert_eq!(next_seq(u32::MAX), 1);
        assert_eq!(next_seq(0), 1);
        assert_eq!(next_seq(41), 42);
    }
}
