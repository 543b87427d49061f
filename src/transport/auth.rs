//! The cluster secret: how the roles of one deployment prove to each other that
//! they belong to it, and how every message between them proves itself, once.
//!
//! `handoff up` generates 32 random bytes (the system's random source, through
//! `getrandom`) and hands them to
//! every role it starts through a file of mode 0600 named by
//! [`SECRET_FILE_ENV`]; roles started by hand read [`SECRET_FILE_ENV`] or
//! [`SECRET_ENV`] (64 hex digits) and refuse to start when neither is set
//! ([`ClusterSecret::from_env`]), so a cluster is never open by accident.
//!
//! Every role-to-role connection (control lines, the tcp transport) opens with a
//! mutual handshake that proves the secret without sending it:
//!
//! 1. the acceptor sends a fresh random nonce `Na`;
//! 2. the connector answers with its own fresh nonce `Nc` and
//!    [`ClusterSecret::proof`]`(Connector, Na, Nc)`; the acceptor checks it (in
//!    constant time) before it reads anything else;
//! 3. the acceptor answers with `proof(Acceptor, Na, Nc)`, and the connector
//!    checks it before it sends anything else: a listener without the secret
//!    (an impostor on the port) is refused too.
//!
//! Both then hold the connection's [`SessionKey`], HMAC(secret, context ||
//! "session" || Na || Nc), fresh because both nonces are. Every message after the
//! handshake carries a MAC under that key over its direction, its sequence
//! number in that direction (0, 1, 2, ...; each side counts, the number is not
//! sent) and its bytes ([`Sealer`], [`Opener`]). So a message replayed on its
//! connection, reordered, altered, reflected back to its sender, or copied from
//! another connection fails its check ([`MessageRefused`]), and the connection
//! is closed. The shm transport's datagrams have no connection: each carries a
//! MAC under the secret itself over its sender, its receiver and a counter of its
//! sender's that must grow (see `transport::shm`). The register heartbeat (one
//! HTTP request, no round trip to spare) carries an HMAC of its body and a
//! timestamp instead, accepted within [`REGISTER_WINDOW`] and only after the
//! role's last accepted one.
//!
//! Every MAC is over length-prefixed parts (each part's length as a u64 LE
//! before it), so bytes cannot move from one part to the next, and after a
//! context string, one per use, so a MAC for one kind of message is worth
//! nothing as another.
//!
//! The primitives are RustCrypto's: `hmac` over `sha2`'s SHA-256, and `subtle`
//! for the constant-time compares. Where the system's random source fails there
//! is no substitute: a secret or nonce that could be predicted would open the
//! cluster, so the caller refuses to start (or to answer) and says why. The
//! scheme authenticates, it does not encrypt: run roles on different hosts over
//! a private network (or a tunnel) when the bytes themselves must stay private.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::fmt;
use std::path::Path;
use subtle::ConstantTimeEq;

/// The variable holding the secret itself (64 hex digits). Prefer the file: a
/// process's environment is visible to its user in `/proc/PID/environ`, and a
/// file can be shared by roles started from different shells.
pub const SECRET_ENV: &str = "HANDOFF_CLUSTER_SECRET";
/// The variable naming a file that holds the secret (64 hex digits; mode 0600,
/// refused when group or others may read it).
pub const SECRET_FILE_ENV: &str = "HANDOFF_CLUSTER_SECRET_FILE";
/// How far a register request's timestamp may be from the proxy's clock.
pub const REGISTER_WINDOW: std::time::Duration = std::time::Duration::from_secs(30);

/// Domain-separation contexts, one per kind of connection.
pub mod context {
    /// A role's register/heartbeat request to the proxy's control listener.
    pub const REGISTER: &[u8] = b"handoff register v1\n";
    /// A control connection (JSON lines) to a prefill stage or decode.
    pub const CONTROL: &[u8] = b"handoff control v1\n";
    /// The HELLO of a tcp transport connection.
    pub const TCP_HELLO: &[u8] = b"handoff tcp hello v1\n";
    /// A notification datagram of the shm transport.
    pub const SHM_NOTIFY: &[u8] = b"handoff shm notify v1\n";
}

/// Why no secret could be had.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error(
        "no cluster secret: set {SECRET_FILE_ENV} to a file of mode 0600 holding 64 hex digits (or {SECRET_ENV} to the digits); `handoff up` does this for the roles it starts. Make one with: head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n' > secret && chmod 600 secret"
    )]
    Missing,
    #[error("{source_name}: {message}")]
    Invalid { source_name: String, message: String },
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
}

/// The shared secret of one deployment. Its `Debug` never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(Vec<u8>);

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClusterSecret({} bytes)", self.0.len())
    }
}

/// Bytes of a generated secret and of a nonce.
pub const SECRET_BYTES: usize = 32;
/// Shortest secret accepted: 16 bytes (32 hex digits).
pub const MIN_SECRET_BYTES: usize = 16;

impl ClusterSecret {
    /// The secret as bytes (tests build wrong ones).
    pub fn from_bytes(bytes: &[u8]) -> ClusterSecret {
        ClusterSecret(bytes.to_vec())
    }

    /// 32 fresh random bytes.
    pub fn generate() -> std::io::Result<ClusterSecret> {
        Ok(ClusterSecret(random_bytes::<SECRET_BYTES>()?.to_vec()))
    }

    /// Parses hex digits (surrounding whitespace ignored); `source_name` names
    /// where they came from in the error.
    pub fn from_hex(text: &str, source_name: &str) -> Result<ClusterSecret, SecretError> {
        let t = text.trim();
        let invalid = |message: String| SecretError::Invalid { source_name: source_name.to_string(), message };
        let bytes = from_hex(t).ok_or_else(|| invalid(format!("expected hex digits, got {} characters that are not an even run of hex digits", t.len())))?;
        if bytes.len() < MIN_SECRET_BYTES {
            return Err(invalid(format!(
                "a secret of {} bytes is too short (at least {MIN_SECRET_BYTES} bytes, {} hex digits)",
                bytes.len(),
                2 * MIN_SECRET_BYTES
            )));
        }
        Ok(ClusterSecret(bytes))
    }

    /// Reads the secret from a file, refusing one that group or others may read.
    pub fn from_file(path: &Path) -> Result<ClusterSecret, SecretError> {
        use std::os::unix::fs::PermissionsExt;
        let name = format!("{SECRET_FILE_ENV}={}", path.display());
        let meta = std::fs::metadata(path).map_err(|e| SecretError::Io(name.clone(), e))?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(SecretError::Invalid { source_name: name, message: format!("mode {mode:o} lets group or others read the secret; chmod 600 it") });
        }
        let text = std::fs::read_to_string(path).map_err(|e| SecretError::Io(name.clone(), e))?;
        ClusterSecret::from_hex(&text, &name)
    }

    /// The secret this process was given: [`SECRET_FILE_ENV`] first, then
    /// [`SECRET_ENV`]; [`SecretError::Missing`] when neither is set.
    pub fn from_env() -> Result<ClusterSecret, SecretError> {
        if let Some(path) = std::env::var_os(SECRET_FILE_ENV).filter(|p| !p.is_empty()) {
            return ClusterSecret::from_file(Path::new(&path));
        }
        match std::env::var(SECRET_ENV) {
            Ok(v) if !v.trim().is_empty() => ClusterSecret::from_hex(&v, SECRET_ENV),
            _ => Err(SecretError::Missing),
        }
    }

    /// The secret transports use when none is given: this process's configured
    /// one ([`ClusterSecret::from_env`]), else one random secret per process.
    /// So transports in one process (tests, benches) trust each other, and a
    /// transport never accepts strangers for want of configuration. Roles check
    /// [`ClusterSecret::from_env`] at startup, so they never fall back.
    pub fn process() -> ClusterSecret {
        static SECRET: std::sync::OnceLock<ClusterSecret> = std::sync::OnceLock::new();
        SECRET
            .get_or_init(|| match ClusterSecret::from_env() {
                Ok(s) => s,
                Err(e) => {
                    if !matches!(e, SecretError::Missing) {
                        tracing::warn!(error = %e, "cluster secret unusable; this process's transports use a random one");
                    }
                    // No substitute for the system's random source: a guessable
                    // secret would let other processes into this one's transports.
                    ClusterSecret::generate().unwrap_or_else(|e| panic!("cannot make this process's cluster secret: {e}"))
                }
            })
            .clone()
    }

    /// 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        to_hex(&self.0)
    }

    /// HMAC-SHA256 under this secret of `context`, then each of `parts` after
    /// its length (u64 LE): `["ab", "c"]` and `["a", "bc"]` differ.
    pub fn mac(&self, context: &[u8], parts: &[&[u8]]) -> [u8; 32] {
        hmac_parts(&self.0, context, parts)
    }

    /// Whether `given` is the MAC of `parts`, compared in constant time.
    pub fn verify(&self, context: &[u8], parts: &[&[u8]], given: &[u8]) -> bool {
        ct_eq(&self.mac(context, parts), given)
    }

    /// What `side` of a handshake under `context` sends to prove the secret,
    /// for the acceptor's nonce `na` and the connector's `nc`; `bound`: what
    /// else the proof vouches for (the tcp HELLO's endpoint). Each side's proof
    /// names the side, so neither can be reflected back as the other's.
    pub fn proof(&self, context: &[u8], side: End, na: &[u8], nc: &[u8], bound: &[u8]) -> [u8; 32] {
        self.mac(context, &[side.label().as_bytes(), na, nc, bound])
    }

    /// The session key of the connection whose handshake under `context` used
    /// the nonces `na` (acceptor's) and `nc` (connector's).
    pub fn session(&self, context: &[u8], na: &[u8], nc: &[u8]) -> SessionKey {
        SessionKey(self.mac(context, &[b"session", na, nc]))
    }
}

/// HMAC-SHA256 keyed by `key` over `context || (len || part)...`.
fn hmac_parts(key: &[u8], context: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes a key of any length");
    m.update(context);
    for p in parts {
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// Which end of a connection: the one that accepted it or the one that connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    Acceptor,
    Connector,
}

impl End {
    /// The end's name: what its proofs and MACs are bound to (as bytes) and what
    /// it displays as.
    fn label(self) -> &'static str {
        match self {
            End::Acceptor => "acceptor",
            End::Connector => "connector",
        }
    }
}

impl fmt::Display for End {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// The key of one connection, known to its two ends only ([`ClusterSecret::session`]).
/// Its `Debug` never shows the bytes.
#[derive(Clone)]
pub struct SessionKey([u8; 32]);

impl fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionKey(..)")
    }
}

impl SessionKey {
    /// The MAC of message `seq` sent by `from`.
    fn tag(&self, from: End, seq: u64, parts: &[&[u8]]) -> [u8; 32] {
        let mut all: Vec<&[u8]> = Vec::with_capacity(parts.len() + 1);
        let seq = seq.to_le_bytes();
        all.push(&seq);
        all.extend_from_slice(parts);
        hmac_parts(&self.0, from.label().as_bytes(), &all)
    }

    /// What `me` seals its messages with.
    pub fn sealer(&self, me: End) -> Sealer {
        Sealer { key: self.clone(), from: me, seq: 0 }
    }

    /// What checks the messages `peer` sends.
    pub fn opener(&self, peer: End) -> Opener {
        Opener { key: self.clone(), from: peer, seq: 0 }
    }
}

/// Seals the messages one side sends on one connection, numbering them.
#[derive(Debug)]
pub struct Sealer {
    key: SessionKey,
    from: End,
    seq: u64,
}

impl Sealer {
    /// The MAC of the next message, made of `parts`.
    pub fn seal(&mut self, parts: &[&[u8]]) -> [u8; 32] {
        let t = self.key.tag(self.from, self.seq, parts);
        self.seq += 1;
        t
    }
}

/// Checks the messages one side receives on one connection, in order.
#[derive(Debug)]
pub struct Opener {
    key: SessionKey,
    from: End,
    seq: u64,
}

impl Opener {
    /// Whether `tag` seals the next message, made of `parts`; the number moves
    /// on only for a message that does (a refused one ends the connection).
    pub fn open(&mut self, parts: &[&[u8]], tag: &[u8]) -> Result<(), MessageRefused> {
        if !ct_eq(&self.key.tag(self.from, self.seq, parts), tag) {
            return Err(MessageRefused { from: self.from, seq: self.seq });
        }
        self.seq += 1;
        Ok(())
    }

    /// A copy at the same place, for tests that try a message and go on.
    #[cfg(test)]
    fn clone_state(&self) -> Opener {
        Opener { key: self.key.clone(), from: self.from, seq: self.seq }
    }
}

/// A message after the handshake that does not carry its MAC under the
/// connection's session key, at its place in the sequence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "message {seq} from the {from} does not carry its MAC under this connection's session key (altered, replayed, reordered or from another connection): refused, connection closed"
)]
pub struct MessageRefused {
    pub from: End,
    pub seq: u64,
}

/// `N` bytes from the system's random source, or why it failed.
pub fn random_bytes<const N: usize>() -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(|e| std::io::Error::other(format!("the system's random source failed: {e}")))?;
    Ok(b)
}

/// A fresh nonce for one challenge; an error where the system's random source
/// fails (a challenge with a predictable nonce could be answered by replay).
pub fn nonce() -> std::io::Result<[u8; SECRET_BYTES]> {
    random_bytes()
}

/// Equality that takes as long for any two inputs of one length, so the time of
/// a refusal does not tell how much of a guess was right (`subtle`). Inputs of
/// different lengths are unequal at once: use it for values of public length
/// (MACs); [`ct_eq_secret`] hides the length too.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.ct_eq(b).into()
}

/// Equality of a guess and a secret of any length that takes as long whatever
/// either holds or how long the secret is: the SHA-256 digests of the two are
/// compared in constant time (an API key's length is part of the secret).
pub fn ct_eq_secret(guess: &[u8], secret: &[u8]) -> bool {
    Sha256::digest(guess).ct_eq(&Sha256::digest(secret)).into()
}

pub fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Bytes of an even run of hex digits; None otherwise.
pub fn from_hex(t: &str) -> Option<Vec<u8>> {
    if !t.len().is_multiple_of(2) || !t.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    (0..t.len()).step_by(2).map(|i| u8::from_str_radix(&t[i..i + 2], 16).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The primitive is HMAC-SHA256: RFC 4231's test case 2 ("Jefe").
    /// (The primitives' own vectors are the library's to test.)
    #[test]
    fn the_primitive_is_hmac_sha256() {
        let want = "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843";
        assert_eq!(to_hex(&hmac_parts(b"Jefe", b"what do ya want for nothing?", &[])), want);
    }

    /// The MAC is HMAC-SHA256 of the context and then each part after its
    /// length, so moving a byte across a part boundary changes it.
    #[test]
    fn the_mac_length_prefixes_its_parts() {
        let s = ClusterSecret::from_bytes(b"Jefe");
        let mut msg = b"ctx".to_vec();
        for p in [&b"ab"[..], b"c"] {
            msg.extend_from_slice(&(p.len() as u64).to_le_bytes());
            msg.extend_from_slice(p);
        }
        assert_eq!(s.mac(b"ctx", &[b"ab", b"c"]), hmac_parts(b"Jefe", &msg, &[]));
        assert_ne!(s.mac(b"ctx", &[b"ab", b"c"]), s.mac(b"ctx", &[b"a", b"bc"]));
        assert_ne!(s.mac(b"ctx", &[b"abc"]), s.mac(b"ctx", &[b"abc", b""]));
    }

    /// A session's messages open in order, once, in their direction, under
    /// their connection's key only: a replay, a reorder, an altered byte, a
    /// reflection to the sender and another session's message are refused.
    #[test]
    fn sealed_messages_open_once_in_order_and_only_on_their_connection() {
        let s = ClusterSecret::from_bytes(&[7; 32]);
        let key = s.session(context::CONTROL, b"na", b"nc");
        let mut tx = key.sealer(End::Connector);
        let (m0, m1) = (tx.seal(&[b"zero"]), tx.seal(&[b"one"]));
        let mut rx = key.opener(End::Connector);
        assert_eq!(rx.clone_state().open(&[b"one"], &m1), Err(MessageRefused { from: End::Connector, seq: 0 }), "reordered");
        assert_eq!(rx.clone_state().open(&[b"zerp"], &m0), Err(MessageRefused { from: End::Connector, seq: 0 }), "altered");
        assert_eq!(key.opener(End::Acceptor).open(&[b"zero"], &m0), Err(MessageRefused { from: End::Acceptor, seq: 0 }), "reflected");
        let other = s.session(context::CONTROL, b"na", b"nd");
        assert!(other.opener(End::Connector).open(&[b"zero"], &m0).is_err(), "another connection's");
        assert_ne!(s.session(context::TCP_HELLO, b"na", b"nc").0, key.0, "another context's");
        rx.open(&[b"zero"], &m0).expect("in order");
        assert_eq!(rx.clone_state().open(&[b"zero"], &m0), Err(MessageRefused { from: End::Connector, seq: 1 }), "replayed");
        rx.open(&[b"one"], &m1).expect("in order");
        // The two sides' proofs differ, and neither is the other's.
        let p = |side| s.proof(context::CONTROL, side, b"na", b"nc", b"");
        assert_ne!(p(End::Acceptor), p(End::Connector));
        assert!(format!("{key:?}").len() < 20, "Debug shows no key bytes");
    }

    /// The secret compare is equal for equal bytes only, at any length.
    #[test]
    fn secrets_compare_by_value_at_any_length() {
        assert!(ct_eq_secret(b"key-123", b"key-123"));
        assert!(!ct_eq_secret(b"key-12", b"key-123"));
        assert!(!ct_eq_secret(b"key-124", b"key-123"));
        assert!(!ct_eq_secret(b"", b"k"));
        assert!(ct_eq(b"ab", b"ab") && !ct_eq(b"ab", b"ac") && !ct_eq(b"ab", b"abc"));
        assert_ne!(nonce().expect("random source"), nonce().expect("random source"));
    }

    /// A MAC verifies under its own secret and context only, and a one-bit change
    /// of the answer is refused.
    #[test]
    fn a_mac_verifies_only_under_its_secret_and_context() {
        let s = ClusterSecret::from_bytes(&[7; 32]);
        let other = ClusterSecret::from_bytes(&[8; 32]);
        let m = s.mac(context::CONTROL, &[b"nonce"]);
        assert!(!s.verify(context::CONTROL, &[b"non", b"ce"], &m), "parts are length-prefixed");
        assert!(s.verify(context::CONTROL, &[b"nonce"], &m));
        assert!(!other.verify(context::CONTROL, &[b"nonce"], &m));
        assert!(!s.verify(context::TCP_HELLO, &[b"nonce"], &m));
        let mut flipped = m;
        flipped[31] ^= 1;
        assert!(!s.verify(context::CONTROL, &[b"nonce"], &flipped));
        assert!(!s.verify(context::CONTROL, &[b"nonce"], &m[..31]));
    }

    /// Bad hex and short secrets are refused naming where they came from; a file
    /// that others may read is refused naming its mode.
    #[test]
    fn bad_secrets_are_refused_by_name() {
        let e = ClusterSecret::from_hex("xyz", "HANDOFF_CLUSTER_SECRET").unwrap_err().to_string();
        assert!(e.contains("HANDOFF_CLUSTER_SECRET") && e.contains("hex"), "{e}");
        let e = ClusterSecret::from_hex("abcd", "S").unwrap_err().to_string();
        assert!(e.contains("2 bytes is too short"), "{e}");
        let g = ClusterSecret::generate().expect("random source");
        assert_eq!(ClusterSecret::from_hex(&format!(" {}\n", g.to_hex()), "S").expect("round trip"), g);
        assert!(!format!("{g:?}").contains(&g.to_hex()[..8]), "Debug shows no secret bytes");

        use std::os::unix::fs::PermissionsExt;
        let path = std::env::temp_dir().join(format!("handoff-auth-test-{}", std::process::id()));
        std::fs::write(&path, g.to_hex()).expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let e = ClusterSecret::from_file(&path).unwrap_err().to_string();
        assert!(e.contains("mode 644") && e.contains(&path.display().to_string()), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert_eq!(ClusterSecret::from_file(&path).expect("0600 file"), g);
        let _ = std::fs::remove_file(&path);
    }
}
