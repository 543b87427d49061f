//! The cluster secret: how the roles of one deployment prove to each other that
//! they belong to it.
//!
//! `handoff up` generates 32 random bytes (from `/dev/urandom`) and hands them to
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
//! Why HMAC-SHA256 written here is enough: the machine builds offline and no
//! crypto crate is vendored; SHA-256 is short to write from FIPS 180-4 and is
//! checked below against the standard's and RFC 4231's test vectors. The scheme
//! authenticates, it does not encrypt: run roles on different hosts over a
//! private network (or a tunnel) when the bytes themselves must stay private.

use std::fmt;
use std::io::Read;
use std::path::Path;

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
                    // /dev/urandom is absent only on a broken host; a time-based
                    // secret still keeps other processes out of this one's transports.
                    ClusterSecret::generate().unwrap_or_else(|_| ClusterSecret(fallback_bytes().to_vec()))
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
        let mut msg = Vec::with_capacity(context.len() + parts.iter().map(|p| p.len()).sum::<usize>());
        msg.extend_from_slice(context);
        for p in parts {
            msg.extend_from_slice(p);
        }
        hmac_sha256(&self.0, &msg)
    }

    /// Whether `given` is the MAC of `parts`, compared in constant time.
    pub fn verify(&self, context: &[u8], parts: &[&[u8]], given: &[u8]) -> bool {
        ct_eq(&self.mac(context, parts), given)
    }
}

/// `N` random bytes from `/dev/urandom`.
pub fn random_bytes<const N: usize>() -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b)
}

/// A nonce for one challenge: random, or (only where /dev/urandom cannot be
/// read) derived from the time and a counter, which still never repeats.
pub fn nonce() -> [u8; SECRET_BYTES] {
    random_bytes().unwrap_or_else(|_| fallback_bytes())
}

fn fallback_bytes() -> [u8; 32] {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let seed = format!("{t}-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
    sha256(seed.as_bytes())
}

/// Equality that takes as long for any two inputs of one length, so the time of
/// a refusal does not tell how much of a guess was right.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
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

// SHA-256 (FIPS 180-4, section 6.2) and HMAC (RFC 2104).

const K: [u32; 64] = [
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74,
    0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d,
    0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e,
    0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5,
    0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
];

const H0: [u32; 8] = [0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19];

fn compress(h: &mut [u32; 8], block: &[u8]) {
    let mut w = [0u32; 64];
    for (i, c) in block.chunks_exact(4).enumerate() {
        w[i] = u32::from_be_bytes([c[0], c[1], c[2], c[3]]);
    }
    for t in 16..64 {
        let s0 = w[t - 15].rotate_right(7) ^ w[t - 15].rotate_right(18) ^ (w[t - 15] >> 3);
        let s1 = w[t - 2].rotate_right(17) ^ w[t - 2].rotate_right(19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16].wrapping_add(s0).wrapping_add(w[t - 7]).wrapping_add(s1);
    }
    let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = *h;
    for t in 0..64 {
        let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
        let ch = (e & f) ^ (!e & g);
        let t1 = hh.wrapping_add(s1).wrapping_add(ch).wrapping_add(K[t]).wrapping_add(w[t]);
        let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
        let maj = (a & b) ^ (a & c) ^ (b & c);
        let t2 = s0.wrapping_add(maj);
        hh = g;
        g = f;
        f = e;
        e = d.wrapping_add(t1);
        d = c;
        c = b;
        b = a;
        a = t1.wrapping_add(t2);
    }
    for (x, y) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
        *x = x.wrapping_add(y);
    }
}

/// SHA-256 of `data`.
pub fn sha256(data: &[u8]) -> [u8; 32] {
    let mut h = H0;
    let mut blocks = data.chunks_exact(64);
    for b in &mut blocks {
        compress(&mut h, b);
    }
    // Padding: 0x80, zeros, then the bit length as a big-endian u64.
    let rest = blocks.remainder();
    let mut tail = [0u8; 128];
    tail[..rest.len()].copy_from_slice(rest);
    tail[rest.len()] = 0x80;
    let n = if rest.len() < 56 { 64 } else { 128 };
    tail[n - 8..n].copy_from_slice(&((data.len() as u64).wrapping_mul(8)).to_be_bytes());
    for b in tail[..n].chunks_exact(64) {
        compress(&mut h, b);
    }
    let mut out = [0u8; 32];
    for (o, x) in out.chunks_exact_mut(4).zip(h) {
        o.copy_from_slice(&x.to_be_bytes());
    }
    out
}

/// HMAC-SHA256 (RFC 2104): H((K ^ opad) || H((K ^ ipad) || msg)).
pub fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&sha256(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let mut inner = Vec::with_capacity(64 + msg.len());
    inner.extend(k.iter().map(|b| b ^ 0x36));
    inner.extend_from_slice(msg);
    let ih = sha256(&inner);
    let mut outer = Vec::with_capacity(96);
    outer.extend(k.iter().map(|b| b ^ 0x5c));
    outer.extend_from_slice(&ih);
    sha256(&outer)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FIPS 180-4 example digests, plus lengths around the padding boundary
    /// (55 to 120 bytes of 'a') as coreutils' sha256sum computes them.
    #[test]
    fn sha256_matches_the_standard_vectors() {
        assert_eq!(to_hex(&sha256(b"")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        assert_eq!(to_hex(&sha256(b"abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert_eq!(
            to_hex(&sha256(b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
        let million = vec![b'a'; 1_000_000];
        assert_eq!(to_hex(&sha256(&million)), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
        for (n, want) in [
            (55, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318"),
            (56, "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a"),
            (63, "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34"),
            (64, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb"),
            (119, "31eba51c313a5c08226adf18d4a359cfdfd8d2e816b13f4af952f7ea6584dcfb"),
            (120, "2f3d335432c70b580af0e8e1b3674a7c020d683aa5f73aaaedfdc55af904c21c"),
        ] {
            assert_eq!(to_hex(&sha256(&vec![b'a'; n])), want, "{n} bytes of 'a'");
        }
    }

    /// RFC 4231 test cases 1, 2 and 6 (a key longer than the block is hashed first).
    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        assert_eq!(to_hex(&hmac_sha256(&[0x0b; 20], b"Hi There")), "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
        assert_eq!(to_hex(&hmac_sha256(b"Jefe", b"what do ya want for nothing?")), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
        assert_eq!(
            to_hex(&hmac_sha256(&[0xaa; 131], b"Test Using Larger Than Block-Size Key - Hash Key First")),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
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
        let g = ClusterSecret::generate().expect("urandom");
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
