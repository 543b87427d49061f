//! UCX transport: one-sided puts into a peer's registered regions.
//!
//! Built with the `ucx` feature, [`UcxTransport`] drives UCX's `ucp` API, loaded
//! at run time from `libucp.so.0` (`sys`): the build needs no UCX, a run
//! needs Debian's `libucx0` (1.13). Built without it, [`UcxTransport::open`]
//! says so, as the rdma stub does.
//!
//! - **Regions** are allocated and registered by UCX (`ucp_mem_map` with
//!   `UCP_MEM_MAP_ALLOCATE`, as `ucx_perftest` does, so that UCX may place them
//!   in memory its shared-memory transports can map), zeroed, and their remote
//!   keys packed (`ucp_rkey_pack`). A [`RegionHandle`](crate::transport::RegionHandle) carries the region's
//!   address and key ([`super::RemoteKey`]) and its [`PeerAddr::Ucx`](crate::transport::PeerAddr::Ucx) the
//!   worker's address: the handle travels over the roles' authenticated links
//!   like every other transport's, so the remote keys are exchanged there.
//! - **attach** opens one UCX endpoint per peer worker (`ucp_ep_create`, peer
//!   error handling so that a dead peer fails a batch instead of the process)
//!   and unpacks the key on it.
//! - **submit** checks every descriptor against both regions, then issues one
//!   `ucp_put_nbx` per contiguous piece and an endpoint flush
//!   (`ucp_ep_flush_nbx`): the batch completes when the flush does, that is when
//!   every put of it is in the peer's memory. The mover stages the narrow MLA
//!   rows into runs first (`StagingMode::Auto`), as on tcp.
//! - **Mapped peers**: where UCX reaches the peer through shared memory, it
//!   maps the peer's region into this process when the key is unpacked, and
//!   `ucp_rkey_ptr` returns that mapping. A put over those lanes is a memcpy
//!   into it in the calling thread, so with [`UcxOptions::direct`] (the
//!   default) submit stores the pieces itself, with the shm transport's copy
//!   (rayon and streaming stores for a large batch), and the mover sends the
//!   narrow rows unstaged ([`crate::transport::Transport::writes_in_place`]):
//!   one copy of each byte instead of a gather and a put. Measured on the
//!   flagship at 32K tokens, 2 cores: benches/runs/cpu-2026-12-06-s19-ucx.txt.
//!   UCX checks no bounds there (`ucp_rkey_ptr` answers for any address, and
//!   its shared-memory put is a memcpy at key + offset), so attach refuses a
//!   handle whose length reaches past the mapping (`/proc/self/maps`), stores
//!   on or off.
//! - **A dead peer**: UCX's network lanes report it through the endpoint's
//!   error handling (asked for where `tls` names network lanes alone); its
//!   shared-memory lanes (and stores into a mapping) do not, so every
//!   attachment holds the notice connection to its peer (the tcp transport's
//!   `link`), consulted wherever UCX will not report: once that connection
//!   closed, the peer's process is taken as gone, and a batch to it fails with
//!   [`TransportError::Disconnected`](crate::transport::TransportError::Disconnected) (checked before and after the stores, and
//!   on each pending flush, which is then released rather than waited for).
//!   Where UCX reports, the link is not consulted: across a network it may
//!   drop while the peer lives.
//! - **Write-done**: after the flush, the existing notice, which travels over
//!   an embedded [`TcpTransport`](crate::transport::tcp::TcpTransport) (the cluster secret's handshake and MACs),
//!   so a notice sent after a batch completed arrives after its bytes.
//! - A **progress thread** calls `ucp_worker_progress` (spinning while a flush
//!   is pending, backing off to sleeps of at most 500 us when idle); a peer's
//!   puts over UCX's tcp lanes need the receiving worker progressed.
//!
//! Which UCX transports carry the puts is the topology's `[transport.ucx]`
//! (`tls`, `net_devices`), applied with `ucp_config_modify`. UCX still reads its
//! own `UCX_*` environment first, as every UCX program does; the topology's
//! settings override it.
//!
//! Who may write: the UCX data path itself has no cluster secret. A peer needs
//! the worker address and a region's remote key, which only travel inside
//! handles over the authenticated links, but UCX's listeners accept
//! connections from the network: keep a cluster on a private network.

#[cfg(feature = "ucx")]
mod imp;
#[cfg(feature = "ucx")]
pub mod sys;

#[cfg(feature = "ucx")]
pub use imp::UcxTransport;

use super::TcpOptions;
use handoff_components::config::UcxConfig;

/// Settings of a [`UcxTransport`].
#[derive(Debug, Clone)]
pub struct UcxOptions {
    /// UCX's transports and devices (`[transport.ucx]`).
    pub ucx: UcxConfig,
    /// The notice listener (tcp): where it binds and what it advertises, and the
    /// cluster secret its peers prove.
    pub notify: TcpOptions,
    /// Store into a peer's region directly where UCX maps it into this process
    /// (its shared-memory lanes, `ucp_rkey_ptr`), instead of one put per piece.
    /// On by default: a put over those lanes is itself a memcpy into that
    /// mapping, so storing directly moves the same bytes without a call per
    /// piece, and lets the mover leave narrow rows unstaged (one copy, not
    /// two). Off, every byte goes through `ucp_put_nbx`, as over the network.
    pub direct: bool,
}

impl Default for UcxOptions {
    fn default() -> Self {
        UcxOptions { ucx: UcxConfig::default(), notify: TcpOptions::default(), direct: true }
    }
}

/// Why a UCX transport cannot be opened in this build.
#[cfg(not(feature = "ucx"))]
fn unavailable(what: &str) -> super::TransportError {
    super::TransportError::Unavailable { what: format!("ucx {what}"), reason: "built without the `ucx` feature (cargo build --features ucx)".into() }
}

#[cfg(not(feature = "ucx"))]
pub use stub::UcxTransport;

#[cfg(not(feature = "ucx"))]
mod stub;

/// Hex of bytes (worker addresses and remote keys in handles).
pub fn to_hex(bytes: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(D[(b >> 4) as usize] as char);
        s.push(D[(b & 15) as usize] as char);
    }
    s
}

/// Bytes of hex; `None` for an odd length or a non-hex digit (a peer's word).
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    if !b.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    b.chunks_exact(2).map(|p| Some((digit(p[0])? << 4) | digit(p[1])?)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_refuses_what_is_not_hex() {
        let b: Vec<u8> = (0..=255).collect();
        assert_eq!(from_hex(&to_hex(&b)).as_deref(), Some(&b[..]));
        assert_eq!(from_hex("abc"), None);
        assert_eq!(from_hex("zz"), None);
    }

    #[cfg(not(feature = "ucx"))]
    #[test]
    fn without_the_feature_opening_says_how_to_build_it() {
        let Err(e) = UcxTransport::open(UcxOptions::default()) else { panic!("opened") };
        assert!(e.to_string().contains("--features ucx"), "{e}");
    }
}
