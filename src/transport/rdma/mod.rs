//! RDMA (ibverbs) backend, behind the `rdma` cargo feature.
//!
//! Built with the feature, [`RdmaTransport`] moves bytes with one-sided RDMA
//! WRITEs over reliable-connected (RC) queue pairs:
//!
//! - **Regions** live in anonymous mappings registered as memory regions in
//!   chunks of at most [`plan::MAX_MR_CHUNK`] (1 GiB, under the 2 GiB at which
//!   providers refuse `ibv_reg_mr`); a region is as many MRs as it has chunks.
//! - **Handles** carry [`PeerAddr::Rdma`](crate::transport::PeerAddr::Rdma): the owner's bootstrap address. The
//!   bootstrap is a [`crate::transport::tcp`] transport, so its connections prove
//!   the cluster secret and its messages carry MACs, like every other
//!   connection between roles. Over it a producer's [`Transport::attach`](crate::transport::Transport::attach)
//!   connects a queue pair (CONNECT with its QPN, LID, GID and PSN; the consumer
//!   brings its own queue pair to RTR and answers ACCEPT with its own; the
//!   producer goes to RTR and RTS) and fetches the region's chunk addresses and
//!   rkeys ([`wire`]). One queue pair per (producer, consumer) pair.
//! - **Batches** ([`Transport::submit`](crate::transport::Transport::submit)) become work requests (`plan::work_requests`):
//!   a piece that crosses an MR chunk on either side is split, pieces that
//!   continue one remote run are gathered into one request (up to
//!   [`RdmaOptions::max_sge`] entries), and the last request is an RDMA WRITE
//!   WITH IMMEDIATE carrying the batch's write sequence number. They are
//!   posted in rounds of at most the send queue's depth, each round's last
//!   signaled; the batch completes when its last round's completion arrives.
//! - **Write-done**: the immediate completes a receive on the consumer's queue
//!   pair, so the consumer learns from its own completion queue which writes
//!   landed. [`Transport::notify`](crate::transport::Transport::notify) travels over the bootstrap with a fence (the
//!   last write completed on the queue pair to that peer), and the consumer
//!   holds the notice until that write's immediate has arrived: a write-done
//!   report never overtakes its bytes.
//!
//! libibverbs is loaded at run time (`ffi`): the feature needs no library to
//! build, and a machine without rdma-core, or without a device, gets a typed
//! [`RdmaError`] when the transport is opened.
//!
//! **Not run on hardware.** No machine this was written on has an RDMA device
//! (nor soft-RoCE). CI builds the backend and runs the unit tests of the pure
//! parts ([`plan`], [`qp`], [`wire`], the struct layouts of `ffi`) and the
//! refusal without a device; the loopback test that moves bytes is `#[ignore]`d
//! and runs only where `ibv_get_device_list` lists a device.
//!
//! Built without the feature, [`RdmaTransport::open`] returns
//! [`RdmaError::NotBuilt`]: the rest of the engine compiles against the same
//! API (a disabled backend is a stub that returns a clear error).

pub mod plan;
pub mod qp;
pub mod wire;

#[cfg(feature = "rdma")]
pub mod ffi;
#[cfg(feature = "rdma")]
mod live;
#[cfg(feature = "rdma")]
mod verbs;

mod options;
pub use options::{DeviceNames, RdmaError, RdmaOptions};

use super::TransportError;

/// The names of the RDMA devices this machine lists (`ibv_get_device_list`),
/// or why it lists none.
pub fn devices() -> Result<DeviceNames, RdmaError> {
    #[cfg(feature = "rdma")]
    {
        verbs::device_names()
    }
    #[cfg(not(feature = "rdma"))]
    {
        Err(RdmaError::NotBuilt)
    }
}

#[cfg(feature = "rdma")]
pub use live::RdmaTransport;

#[cfg(not(feature = "rdma"))]
pub use stub::RdmaTransport;

#[cfg(not(feature = "rdma"))]
mod stub;

impl RdmaTransport {
    /// Opens verbs device `device` (e.g. `mlx5_0`) with the default options
    /// (bootstrap on 127.0.0.1, any port).
    pub fn open(device: &str) -> Result<Self, TransportError> {
        Ok(Self::open_with(RdmaOptions { device: Some(device.to_string()), ..RdmaOptions::default() })?)
    }
}

#[cfg(all(test, feature = "rdma"))]
mod device_tests {
    use super::*;
    use crate::transport::{Transport, TransportExt};
    use handoff_components::plan::Descriptor;
    use handoff_components::vocab::{DecodeRank, RankId, RegionKind};
    use std::time::Duration;

    /// Behaviour on every machine, never a skip: where `ibv_get_device_list`
    /// lists no device, opening the transport is the typed `NoDevice` error
    /// naming the missing device; where it lists one, opening succeeds.
    /// Under CI (`CI=true`) libibverbs must be installed, so `NoLibrary` fails.
    #[test]
    fn opening_without_a_device_is_the_typed_no_device_error() {
        let listed = devices();
        let opened = RdmaTransport::open_with(RdmaOptions::default());
        match (&listed, &opened) {
            (Ok(names), Ok(t)) if !names.is_empty() => assert!(names.iter().any(|n| n == t.device())),
            (Ok(_) | Err(RdmaError::NoDevice { .. }), Err(RdmaError::NoDevice { .. })) => {
                assert!(listed.clone().unwrap_or_default().is_empty(), "{listed:?}");
                let e = TransportError::from(opened.err().expect("error"));
                assert!(e.to_string().contains("no RDMA device"), "{e}");
            }
            (Err(RdmaError::NoLibrary { .. }), Err(RdmaError::NoLibrary { .. })) => {
                assert!(std::env::var("CI").as_deref() != Ok("true"), "under CI the rdma feature's tests need libibverbs1: {listed:?}");
            }
            _ => panic!("devices() {listed:?} and open disagree: {:?}", opened.as_ref().err()),
        }
        let named = RdmaTransport::open_with(RdmaOptions { device: Some("handoff-no-such-device".into()), ..RdmaOptions::default() });
        assert!(matches!(named, Err(RdmaError::UnknownDevice { .. } | RdmaError::NoDevice { .. } | RdmaError::NoLibrary { .. })), "{:?}", named.err());
    }

    /// Two transports on the first device, in this process: a batch whose
    /// pieces cross MR chunks (64 KiB chunks) lands byte for byte, completes,
    /// and a notice sent after it arrives after its immediate.
    #[test]
    #[ignore = "needs an RDMA device (ibv_get_device_list non-empty): cargo test --features rdma --lib transport::rdma -- --ignored"]
    fn loopback_writes_cross_mr_chunks_and_complete_with_immediate() {
        let opts = RdmaOptions { mr_chunk: 64 << 10, sq_depth: 8, max_sge: 2, ..RdmaOptions::default() };
        let a = RdmaTransport::open_with(opts.clone()).expect("producer");
        let b = RdmaTransport::open_with(opts).expect("consumer");
        let rank = RankId::Decode(DecodeRank { tp: 0 });
        let len = 1u64 << 20;
        let src = a.register(rank, RegionKind::KdaState, len).expect("src");
        let dst = b.register(rank, RegionKind::KdaState, len).expect("dst");
        a.write_region(&src, |m| m.iter_mut().enumerate().for_each(|(i, x)| *x = (i * 7 % 251) as u8)).expect("fill");
        let remote = a.attach(&dst).expect("attach");
        let descs: Vec<Descriptor> = (0..40u64)
            .map(|i| Descriptor {
                kind: RegionKind::KdaState,
                src_offset: i * 24_000,
                dst_offset: 5_000 + i * 25_000,
                len: 20_000,
                count: 1,
                src_stride: 0,
                dst_stride: 0,
            })
            .collect();
        a.transfer(&src, remote, &descs, Duration::from_secs(10)).expect("transfer");
        a.notify(&b.endpoint(), b"done").expect("notify");
        let notes = b.wait_notifications(Duration::from_secs(5));
        assert_eq!(notes.len(), 1);
        assert_eq!(notes[0].bytes, b"done");
        let (s, d) = (a.region_bytes(&src).expect("src"), b.region_bytes(&dst).expect("dst"));
        for x in &descs {
            let (so, dof, l) = (x.src_offset as usize, x.dst_offset as usize, x.len as usize);
            assert!(s[so..so + l] == d[dof..dof + l], "descriptor at dst {dof}: first wrong byte {:?}", (0..l).find(|&i| s[so + i] != d[dof + i]));
        }
    }
}
