//! The cluster secret: how the roles of one deployment prove to each other that
//! they belong to it.
//!
//! `handoff up` generates 32 random bytes (the system's random source, through
//! `getrandom`) and hands them to
//! every role it starts through a file of mode 0600 named by
//! [`SECRET_FILE_ENV`]; roles started by hand read [`SECRET_FILE_ENV`] or
//! [`SECRET_ENV`] (64 hex digits) and refuse to start when neither is set
//! ([`ClusterSecret::from_env`]), so a cluster is never open by accident.
//!
//! Every role-to-role connection proves the secret without sending it: the side
//! that accepts sends a fresh random nonce, the side that connects answers with
//! HMAC-SHA256(secret, context || nonce || ...), and the acceptor compares the
//! answer in constant time before it reads anything else. The register heartbeat
//! (one HTTP request, no round trip to spare) carries an HMAC of its body and a
//! timestamp instead, accepted within [`REGISTER_WINDOW`]. Each use has its own
//! context string, so an answer for one kind of connection is worth nothing on
//! another.
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

    /// HMAC-SHA256 of the concatenated `parts` under this secret, after `context`.
    pub fn mac(&self, context: &[u8], parts: &[&[u8]]) -> [u8; 32] {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        m.update(context);
        for p in parts {
            m.update(p);
        }
        m.finalize().into_bytes().into()
    }

    /// Whether `given` is the MAC of `parts`, compared in constant time.
    pub fn verify(&self, context: &[u8], parts: &[&[u8]], given: &[u8]) -> bool {
        ct_eq(&self.mac(context, parts), given)
    }
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

    /// The MAC is HMAC-SHA256 keyed by the secret over context || parts: RFC
    /// 4231's test case 2 ("Jefe"), its message cut into a context and parts
    /// anywhere. (The primitives' own vectors are the library's to test.)
    #[test]
    fn the_mac_is_hmac_sha256_of_the_context_and_parts() {
        let s = ClusterSecret::from_bytes(b"Jefe");
        let want = "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843";
        assert_eq!(to_hex(&s.mac(b"what do ya", &[b" want ", b"for nothing?"])), want);
        assert_eq!(to_hex(&s.mac(b"", &[b"what do ya want for nothing?"])), want);
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
