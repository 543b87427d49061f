//! The wire format, public so that tests can play a misbehaving peer.
//!
//! Little endian. Every frame starts with [`MAGIC`] and a type byte.
//! CHALLENGE (acceptor to connector, first): 32 bytes of nonce Na.
//! HELLO (connector's first frame): u32 n, n bytes of JSON [`PeerAddr`] (the
//! sender's endpoint), 32 bytes of nonce Nc, 32 bytes of the connector's proof
//! ([`ClusterSecret::proof`] over Na, Nc and the JSON).
//! WELCOME (acceptor's answer to a good HELLO): 32 bytes of the acceptor's proof
//! over the same. Both ends then hold the session key [`ClusterSecret::session`]`(Na, Nc)`.
//! WRITE: u64 batch, u64 region, u32 ndesc, u64 payload bytes, then ndesc x
//! (u8 kind, u64 dst_offset, u64 len, u32 count, u64 dst_stride), then the MAC
//! (32 bytes), then the payload: every piece of every descriptor, in order.
//! NOTIFY: u32 n, n bytes, MAC. ACK: u64 batch, u8 status (0 ok), u32 n, n bytes
//! of reason, MAC (the ACK of batch 0 that refuses a handshake has none: there
//! is no session yet).
//!
//! Each MAC is under the session key, over the frame's number in its direction,
//! its type byte and every byte after the type up to the MAC ([`seal_frame`]).
//! A WRITE's MAC covers its header and descriptors (which region, which
//! offsets, lengths, counts and strides, how many payload bytes) but not its
//! payload: the consumer scatters the payload into the region as it arrives,
//! so a MAC after it would be checked only once the bytes had landed, and
//! HMAC-SHA256 over the hand-off's GB/s would cost a core per stream. So a
//! forger on the path could change payload bytes but not where they go, nor
//! shift the frame boundaries (the length is covered). The scheme authenticates
//! peers; the payload's integrity in transit is the network's (run roles on a
//! private network or a tunnel across hosts).

use crate::transport::PeerAddr;
use crate::transport::auth::{ClusterSecret, End, Opener, Sealer, context};
use handoff_components::plan::Descriptor;
use handoff_components::vocab::RegionKind;
use std::io::{self, Read, Write};

pub const MAGIC: u32 = 0x484f_4646;
pub const HELLO: u8 = 1;
pub const WRITE: u8 = 2;
pub const NOTIFY: u8 = 3;
pub const ACK: u8 = 4;
pub const CHALLENGE: u8 = 5;
pub const WELCOME: u8 = 6;
/// The batch id of the ACK that tells a refused connector why (batch ids
/// start at 1).
pub const REFUSAL_BATCH: u64 = 0;
/// Bytes of one descriptor on the wire.
pub const DESC_BYTES: usize = 1 + 8 + 8 + 4 + 8;
/// Bytes of a frame's MAC.
pub const MAC_BYTES: usize = 32;
/// Most descriptors one frame may carry (bounds what a peer makes us allocate).
pub const MAX_DESCRIPTORS: u32 = 1 << 22;
/// Most bytes one notification may carry.
pub const MAX_NOTIFY: u32 = 16 << 20;

/// The MAC of the next frame of type `ty` whose bytes after the type (up to
/// the MAC) are `body`.
pub fn seal_frame(sealer: &mut Sealer, ty: u8, body: &[u8]) -> [u8; 32] {
    sealer.seal(&[&[ty], body])
}

/// The sealing and checking halves of one tcp connection, for the side that
/// holds them.
#[derive(Debug)]
pub struct Session {
    /// Seals the frames this side sends.
    pub sealer: Sealer,
    /// Checks the frames the other side sends.
    pub opener: Opener,
}

impl Session {
    pub(super) fn new(secret: &ClusterSecret, na: &[u8], nc: &[u8], me: End) -> Session {
        let key = secret.session(context::TCP_HELLO, na, nc);
        let peer = if me == End::Acceptor { End::Connector } else { End::Acceptor };
        Session { sealer: key.sealer(me), opener: key.opener(peer) }
    }
}

pub fn kind_code(kind: RegionKind) -> u8 {
    kind.index() as u8
}

pub fn kind_from_code(code: u8) -> Option<RegionKind> {
    RegionKind::ALL.get(code as usize).copied()
}

fn head(w: &mut impl Write, ty: u8) -> io::Result<()> {
    w.write_all(&MAGIC.to_le_bytes())?;
    w.write_all(&[ty])
}

pub fn write_challenge(w: &mut impl Write, nonce: &[u8; 32]) -> io::Result<()> {
    head(w, CHALLENGE)?;
    w.write_all(nonce)
}

/// Reads the acceptor's CHALLENGE: its nonce.
pub fn read_challenge(r: &mut impl io::Read) -> io::Result<[u8; 32]> {
    let mut h = [0u8; 5];
    r.read_exact(&mut h)?;
    if h[..4] != MAGIC.to_le_bytes() || h[4] != CHALLENGE {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("expected a CHALLENGE frame, got magic {:02x?} type {}", &h[..4], h[4])));
    }
    let mut nonce = [0u8; 32];
    r.read_exact(&mut nonce)?;
    Ok(nonce)
}

/// The HELLO that answers the challenge `na` with the connector's nonce
/// `nc`: `me`, proved with `secret`.
pub fn write_hello(w: &mut impl Write, me: &PeerAddr, secret: &ClusterSecret, na: &[u8; 32], nc: &[u8; 32]) -> io::Result<()> {
    let json = serde_json::to_vec(me).map_err(io::Error::other)?;
    let proof = secret.proof(context::TCP_HELLO, End::Connector, na, nc, &json);
    head(w, HELLO)?;
    w.write_all(&(json.len() as u32).to_le_bytes())?;
    w.write_all(&json)?;
    w.write_all(nc)?;
    w.write_all(&proof)
}

/// The acceptor's answer to a good HELLO: its proof.
pub fn write_welcome(w: &mut impl Write, proof: &[u8; 32]) -> io::Result<()> {
    head(w, WELCOME)?;
    w.write_all(proof)
}

/// Why a connector's handshake let it send nothing.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The acceptor refused this side's HELLO, saying why.
    #[error("{0}")]
    RefusedByPeer(String),
    /// The acceptor's WELCOME does not prove the cluster secret.
    #[error("the endpoint's WELCOME does not prove the cluster secret: nothing sent to it")]
    AcceptorUnproven,
}

/// The connector's side of the handshake on `s`: reads the CHALLENGE, says
/// HELLO as `me`, and checks the acceptor's WELCOME; the session once it holds.
pub fn connect_handshake<S: Read + Write>(s: &mut S, me: &PeerAddr, secret: &ClusterSecret) -> Result<Session, HandshakeError> {
    let na = read_challenge(s)?;
    let nc = crate::transport::auth::nonce()?;
    let mut hello = Vec::new();
    write_hello(&mut hello, me, secret, &na, &nc)?;
    s.write_all(&hello)?;
    s.flush()?;
    let mut h = [0u8; 5];
    s.read_exact(&mut h)?;
    if h[..4] != MAGIC.to_le_bytes() {
        return Err(HandshakeError::AcceptorUnproven);
    }
    match h[4] {
        WELCOME => {
            let mut proof = [0u8; 32];
            s.read_exact(&mut proof)?;
            let json = serde_json::to_vec(me).map_err(io::Error::other)?;
            let want = secret.proof(context::TCP_HELLO, End::Acceptor, &na, &nc, &json);
            if !crate::transport::auth::ct_eq(&want, &proof) {
                return Err(HandshakeError::AcceptorUnproven);
            }
            Ok(Session::new(secret, &na, &nc, End::Connector))
        }
        ACK => {
            let mut a = [0u8; 13];
            s.read_exact(&mut a)?;
            let n = u32::from_le_bytes([a[9], a[10], a[11], a[12]]).min(1 << 16) as usize;
            let mut reason = vec![0u8; n];
            s.read_exact(&mut reason)?;
            Err(HandshakeError::RefusedByPeer(String::from_utf8_lossy(&reason).into_owned()))
        }
        _ => Err(HandshakeError::AcceptorUnproven),
    }
}

/// The bytes of a WRITE frame's header and descriptors after its type.
fn batch_header(batch: u64, region: u64, descriptors: &[Descriptor], payload: u64) -> Vec<u8> {
    let mut buf = Vec::with_capacity(28 + descriptors.len() * DESC_BYTES);
    buf.extend_from_slice(&batch.to_le_bytes());
    buf.extend_from_slice(&region.to_le_bytes());
    buf.extend_from_slice(&(descriptors.len() as u32).to_le_bytes());
    buf.extend_from_slice(&payload.to_le_bytes());
    for d in descriptors {
        buf.push(kind_code(d.kind));
        buf.extend_from_slice(&d.dst_offset.to_le_bytes());
        buf.extend_from_slice(&d.len.to_le_bytes());
        buf.extend_from_slice(&d.count.to_le_bytes());
        buf.extend_from_slice(&d.dst_stride.to_le_bytes());
    }
    buf
}

/// A frame of type `ty`: `body`, sealed.
pub fn write_sealed(w: &mut impl Write, sealer: &mut Sealer, ty: u8, body: &[u8]) -> io::Result<()> {
    let mac = seal_frame(sealer, ty, body);
    head(w, ty)?;
    w.write_all(body)?;
    w.write_all(&mac)
}

/// The header, descriptors and MAC of a WRITE frame; the payload follows.
pub fn write_batch_header(w: &mut impl Write, sealer: &mut Sealer, batch: u64, region: u64, descriptors: &[Descriptor], payload: u64) -> io::Result<()> {
    write_sealed(w, sealer, WRITE, &batch_header(batch, region, descriptors, payload))
}

pub fn write_notify(w: &mut impl Write, sealer: &mut Sealer, bytes: &[u8]) -> io::Result<()> {
    let mut body = Vec::with_capacity(4 + bytes.len());
    body.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    body.extend_from_slice(bytes);
    write_sealed(w, sealer, NOTIFY, &body)
}

fn ack_body(batch: u64, error: Option<&str>) -> Vec<u8> {
    let msg = error.unwrap_or("").as_bytes();
    let mut buf = Vec::with_capacity(13 + msg.len());
    buf.extend_from_slice(&batch.to_le_bytes());
    buf.push(u8::from(error.is_some()));
    buf.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    buf.extend_from_slice(msg);
    buf
}

/// An ACK within a session.
pub fn write_ack(w: &mut impl Write, sealer: &mut Sealer, batch: u64, error: Option<&str>) -> io::Result<()> {
    write_sealed(w, sealer, ACK, &ack_body(batch, error))
}

/// The ACK of batch 0 that refuses a handshake, saying why (no session, no MAC).
pub fn write_refusal(w: &mut impl Write, reason: &str) -> io::Result<()> {
    head(w, ACK)?;
    w.write_all(&ack_body(REFUSAL_BATCH, Some(reason)))
}
