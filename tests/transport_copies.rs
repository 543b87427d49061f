//! Every backend writes exactly what a naive copy loop writes, and refuses what it
//! must refuse (out-of-range descriptors, kind mix-ups, device memory) without
//! moving a byte.

#[allow(dead_code)]
mod transport_util;

use handoff::engine::mover::{MoverOptions, TransportMover};
use handoff::transport::rdma::RdmaTransport;
use handoff::transport::{LocalTransport, MemoryKind, ShmTransport, Side, TcpTransport, Transport, TransportError, TransportExt};
use handoff_components::plan::{Descriptor, Plan};
use handoff_components::vocab::{DecodeRank, PrefillRank, RegionKind};
use handoff_systems::transfer::{Mover, Ticket};
use std::sync::Arc;
use transport_util::*;

type Pair = (Arc<dyn Transport>, Arc<dyn Transport>);
type Check = Box<dyn Fn(&TransportError) -> bool>;

fn local_pair() -> Pair {
    (Arc::new(LocalTransport::new()), Arc::new(LocalTransport::new()))
}
fn shm_pair() -> Pair {
    (Arc::new(ShmTransport::new().expect("shm")), Arc::new(ShmTransport::new().expect("shm")))
}
fn tcp_pair() -> Pair {
    (Arc::new(TcpTransport::loopback().expect("tcp")), Arc::new(TcpTransport::loopback().expect("tcp")))
}
/// The cuda-ipc transport's descriptor-to-copy path and bookkeeping over a
/// host stand-in for device memory (the CUDA memory itself is checked on the
/// GPU by `cuda_check`); copies report done after 3 queries.
fn device_pair() -> Pair {
    (host_device_transport(3), host_device_transport(3))
}

/// Random strided batches, small and large (the large one crosses the parallel
/// threshold of the in-host copy engine), byte-exact against the reference.
fn random_batches_match_reference(pair: Pair, name: &str) {
    let (p, c) = pair;
    for seed in 1..=6u64 {
        let mut rng = Rng(seed * 7919);
        let (src_len, dst_len, n, piece) = if seed % 3 == 0 { (6 << 20, 8 << 20, 400, 16 << 10) } else { (64 << 10, 96 << 10, 200, 300) };
        let descs = random_batch(&mut rng, RegionKind::KdaState, n, piece, src_len, dst_len);
        assert!(descs.len() > n / 4, "generator produced a meaningful batch ({})", descs.len());
        assert!(!dst_overlap(&descs));
        check_transfer(p.as_ref(), c.as_ref(), seed, src_len, dst_len, &descs, &format!("{name} seed {seed}"));
    }
}

#[test]
fn local_random_strided_batches_are_byte_exact() {
    random_batches_match_reference(local_pair(), "local");
}

#[test]
fn shm_random_strided_batches_are_byte_exact() {
    random_batches_match_reference(shm_pair(), "shm");
}

#[test]
fn tcp_loopback_random_strided_batches_are_byte_exact() {
    random_batches_match_reference(tcp_pair(), "tcp");
}

#[test]
fn device_random_strided_batches_are_byte_exact() {
    random_batches_match_reference(device_pair(), "cuda-ipc");
}

/// Overlapping destinations within one batch: later descriptors win, as in the loop.
#[test]
fn overlapping_destinations_follow_descriptor_order_on_every_backend() {
    for (name, pair) in [("local", local_pair()), ("shm", shm_pair()), ("tcp", tcp_pair()), ("cuda-ipc", device_pair())] {
        let k = RegionKind::MlaKv;
        let descs = vec![
            Descriptor { kind: k, src_offset: 0, dst_offset: 0, len: 1 << 20, count: 2, src_stride: 1 << 20, dst_stride: 1 << 19 },
            Descriptor::copy(k, 100, 700_000, 500_000),
            Descriptor { kind: k, src_offset: 3, dst_offset: 5, len: 7, count: 1000, src_stride: 11, dst_stride: 5 },
        ];
        assert!(dst_overlap(&descs));
        check_transfer(pair.0.as_ref(), pair.1.as_ref(), 99, 3 << 20, 2 << 20, &descs, &format!("{name} overlapping"));
    }
}

/// A copy into one's own region (attach of a local handle) with memmove semantics.
#[test]
fn copy_within_one_region_matches_reference() {
    for t in [Arc::new(LocalTransport::new()) as Arc<dyn Transport>, Arc::new(ShmTransport::new().expect("shm")), host_device_transport(1)] {
        let mut rng = Rng(5);
        let h = register(t.as_ref(), producer_rank(), RegionKind::KdaConv, 4096).expect("register");
        let before = rng.bytes(4096);
        t.write_region(&h, |b| b.copy_from_slice(&before)).expect("fill");
        let descs = [Descriptor::copy(RegionKind::KdaConv, 0, 100, 1000), Descriptor::copy(RegionKind::KdaConv, 2000, 1900, 300)];
        let mut want = before.clone();
        for d in &descs {
            let (s, t, n) = (d.src_offset as usize, d.dst_offset as usize, d.len as usize);
            want.copy_within(s..s + n, t);
        }
        let own = t.attach(&h).expect("attach own region");
        t.transfer(&h, own, &descs, WAIT).expect("transfer");
        assert_bytes_eq(&format!("{} within", t.name()), &t.region_bytes(&h).expect("read"), &want, &descs);
    }
}

/// Out-of-range descriptors, overflowing strides and kind mix-ups are rejected at
/// submit, naming the descriptor and side, and the destination keeps its bytes.
#[test]
fn out_of_bounds_and_mismatched_descriptors_are_rejected_without_writes() {
    for (name, (p, c)) in [("local", local_pair()), ("shm", shm_pair()), ("tcp", tcp_pair()), ("cuda-ipc", device_pair())] {
        let k = RegionKind::KdaState;
        let src = register(p.as_ref(), producer_rank(), k, 1000).expect("src");
        let dst = register(c.as_ref(), consumer_rank(), k, 500).expect("dst");
        p.write_region(&src, |b| b.fill(0xab)).expect("fill");
        let remote = p.attach(&dst).expect("attach");
        let ok = Descriptor::copy(k, 0, 0, 10);
        let cases: Vec<(Vec<Descriptor>, Check)> = vec![
            (
                vec![ok, Descriptor::copy(k, 0, 491, 10)],
                Box::new(|e| matches!(e, TransportError::OutOfBounds { index: 1, side: Side::Dst, end: 501, len: 500, .. })),
            ),
            (vec![Descriptor::copy(k, 995, 0, 10)], Box::new(|e| matches!(e, TransportError::OutOfBounds { index: 0, side: Side::Src, .. }))),
            (
                vec![Descriptor { kind: k, src_offset: 0, dst_offset: 0, len: 10, count: 60, src_stride: 10, dst_stride: 10 }],
                Box::new(|e| matches!(e, TransportError::OutOfBounds { side: Side::Dst, end: 600, .. })),
            ),
            (
                vec![Descriptor { kind: k, src_offset: 0, dst_offset: 0, len: 1, count: 3, src_stride: 0, dst_stride: u64::MAX / 2 }],
                Box::new(|e| matches!(e, TransportError::OutOfBounds { side: Side::Dst, end: u64::MAX, .. })),
            ),
            (vec![Descriptor::copy(k, u64::MAX - 2, 0, 10)], Box::new(|e| matches!(e, TransportError::OutOfBounds { side: Side::Src, .. }))),
            (vec![Descriptor::copy(RegionKind::KdaConv, 0, 0, 10)], Box::new(|e| matches!(e, TransportError::KindMismatch { index: 0, .. }))),
        ];
        for (i, (descs, expect)) in cases.into_iter().enumerate() {
            let err = p.submit(&src, remote, &descs).expect_err(&format!("{name} case {i} must be rejected"));
            assert!(expect(&err), "{name} case {i}: unexpected error {err}");
            assert!(!err.is_transient(), "{name} case {i}: a wrong descriptor is not worth retrying");
        }
        assert!(c.region_bytes(&dst).expect("read").iter().all(|&b| b == 0), "{name}: a rejected batch wrote bytes");
        // The transport still works after the rejections.
        p.transfer(&src, remote, &[ok], WAIT).expect("valid batch after rejections");
        assert_eq!(&c.region_bytes(&dst).expect("read")[..11], &[0xab; 10].iter().copied().chain([0]).collect::<Vec<_>>()[..]);
    }
}

/// Handles name their owner: a transport refuses to treat another's region as its own.
#[test]
fn foreign_and_unknown_handles_are_refused() {
    let (a, b) = local_pair();
    let h = b.register(consumer_rank(), RegionKind::MlaKv, 64).expect("register");
    assert!(matches!(a.with_region(&h, &mut |_| {}), Err(TransportError::ForeignHandle { .. })));
    b.unregister(&h).expect("unregister");
    assert!(matches!(b.with_region(&h, &mut |_| {}), Err(TransportError::UnknownRegion(_))));
    assert!(a.attach(&h).is_err(), "attaching an unregistered region fails");
}

#[test]
fn device_memory_and_rdma_are_refused_with_a_reason_in_this_build() {
    for t in
        [Arc::new(LocalTransport::new()) as Arc<dyn Transport>, Arc::new(ShmTransport::new().expect("shm")), Arc::new(TcpTransport::loopback().expect("tcp"))]
    {
        let err = t.register_memory(producer_rank(), RegionKind::MlaKv, 64, MemoryKind::Device { ordinal: 0 }).expect_err("device memory");
        assert!(matches!(err, TransportError::Unavailable { .. }), "{err}");
        assert!(err.to_string().contains("device"), "{err}");
    }
    let err = RdmaTransport::open("mlx5_0").err().expect("rdma stub refuses");
    assert!(matches!(err, TransportError::Unavailable { .. }));
    assert!(err.to_string().contains("rdma"), "{err}");
}

/// The cuda-ipc transport keeps device memory only, on its own device, opens
/// device handles only through their IPC handle, and hands the model its own
/// regions in place.
#[test]
fn cuda_ipc_refuses_host_memory_and_foreign_devices_and_exposes_its_regions() {
    let t = host_device_transport(0);
    let err = t.register(producer_rank(), RegionKind::MlaKv, 64).expect_err("host memory");
    assert!(err.to_string().contains("host memory on the cuda-ipc transport"), "{err}");
    let err = t.register_memory(producer_rank(), RegionKind::MlaKv, 64, MemoryKind::Device { ordinal: 1 }).expect_err("other GPU");
    assert!(err.to_string().contains("device 1"), "{err}");
    let h = register(t.as_ref(), consumer_rank(), RegionKind::MlaKv, 256).expect("device region");
    let ipc = h.ipc.clone().expect("a device handle carries its IPC handle");
    assert_eq!(ipc.pid, std::process::id());
    assert_eq!(ipc.handle.len(), 128, "64 bytes, hex");
    let reg = t.device_region(&h).expect("own device region");
    assert_eq!((reg.addr, reg.len), (ipc.addr, 256));
    let other = host_device_transport(0);
    assert!(other.device_region(&h).is_none(), "another transport's region is not local");
    let mut bare = h.clone();
    bare.ipc = None;
    let err = other.attach(&bare).expect_err("no IPC handle");
    assert!(err.to_string().contains("without an IPC handle"), "{err}");
    let mut far = h.clone();
    far.memory = MemoryKind::Device { ordinal: 3 };
    assert!(other.attach(&far).expect_err("other GPU").to_string().contains("cuda:3"));
    let mut foreign = h.clone();
    foreign.ipc.as_mut().unwrap().pid = std::process::id().wrapping_add(1);
    let err = other.attach(&foreign).expect_err("the stand-in opens no other process's memory");
    assert!(err.to_string().contains("ipc open"), "{err}");
    // Host access copies through: what is written reads back.
    t.write_region(&h, |b| b[..4].copy_from_slice(b"kv!!")).expect("write");
    assert_eq!(&t.region_bytes(&h).expect("read")[..4], b"kv!!");
    t.unregister(&h).expect("unregister");
    assert!(t.device_region(&h).is_none());
}

/// Completions: `poll` reports every batch once, `wait` takes one, a taken batch is unknown.
#[test]
fn completions_are_reported_once() {
    for (name, (p, c)) in [("local", local_pair()), ("shm", shm_pair()), ("tcp", tcp_pair()), ("cuda-ipc", device_pair())] {
        let src = register(p.as_ref(), producer_rank(), RegionKind::MlaKv, 4096).expect("src");
        let dst = register(c.as_ref(), consumer_rank(), RegionKind::MlaKv, 4096).expect("dst");
        let r = p.attach(&dst).expect("attach");
        let ids: Vec<_> = (0..4u64).map(|i| p.submit(&src, r, &[Descriptor::copy(RegionKind::MlaKv, i * 8, i * 8, 8)]).expect("submit")).collect();
        p.wait(ids[1], WAIT).expect("wait one");
        let mut seen = Vec::new();
        let deadline = std::time::Instant::now() + WAIT;
        while seen.len() < 3 && std::time::Instant::now() < deadline {
            seen.extend(p.poll());
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let mut got: Vec<_> = seen.iter().map(|c| c.batch).collect();
        got.sort();
        assert_eq!(got, vec![ids[0], ids[2], ids[3]], "{name}");
        assert!(seen.iter().all(|c| c.result.is_ok()), "{name}");
        assert!(matches!(p.wait(ids[1], WAIT), Err(TransportError::UnknownBatch(_))), "{name}");
    }
}

/// Notifications arrive with their bytes and, where known, the sender.
#[test]
fn notifications_carry_bytes_and_sender() {
    for (name, (p, c)) in [("local", local_pair()), ("shm", shm_pair()), ("tcp", tcp_pair()), ("cuda-ipc", device_pair())] {
        p.notify(&c.endpoint(), b"write-done 42").expect("notify");
        p.notify(&c.endpoint(), &[]).expect("empty notify");
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + WAIT;
        while got.len() < 2 && std::time::Instant::now() < deadline {
            got.extend(c.wait_notifications(std::time::Duration::from_millis(200)));
        }
        assert_eq!(got.len(), 2, "{name}");
        assert_eq!(got[0].bytes, b"write-done 42", "{name}");
        assert!(got[1].bytes.is_empty(), "{name}");
        assert_eq!(got[0].from.as_ref(), Some(&p.endpoint()), "{name}");
    }
}

/// An shm transport removes its files when dropped.
#[test]
fn shm_files_are_removed_on_drop() {
    let t = ShmTransport::new().expect("shm");
    let h = t.register(producer_rank(), RegionKind::MlaKv, 4096).expect("register");
    let handoff::transport::PeerAddr::Shm { dir, prefix } = h.peer.clone() else { panic!("shm handle") };
    let ours = || std::fs::read_dir(&dir).expect("read dir").flatten().filter(|e| e.file_name().to_string_lossy().starts_with(&prefix)).count();
    assert_eq!(ours(), 2, "one region file and one socket");
    drop(t);
    assert_eq!(ours(), 0, "files left behind after drop");
}

/// On a transport that queues plans (cuda-ipc), a mover hands the device the
/// plans waiting in its queue in few submissions: the first alone (the
/// device starts on it while the host prepares the rest), then groups that
/// double; a plan whose batch is refused fails alone and the others land
/// byte for byte.
#[test]
fn a_queueing_transport_takes_waiting_plans_in_doubling_groups_and_a_bad_plan_fails_alone() {
    // Each submission completes after 5,000 queries (the completion thread
    // polls every 20 us: a tenth of a second or more), so the plans
    // submitted while plan 0 is in flight all wait in the queue when the
    // worker next looks.
    let mem = HostDeviceMemory::new(5_000);
    let t = host_device_transport_on(Arc::clone(&mem));
    let len = 64 * 1024;
    let src = register(&*t, producer_rank(), RegionKind::MlaKv, len).expect("src");
    let dst = register(&*t, consumer_rank(), RegionKind::MlaKv, len).expect("dst");
    let pattern: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    t.write_region(&src, |b| b.copy_from_slice(&pattern)).expect("fill");
    let mut mover = TransportMover::new(t.clone(), MoverOptions { workers: 1, ..MoverOptions::default() }).expect("mover");
    mover.add_source(src.clone());
    mover.attach_target(&dst).expect("attach");
    let (producer, consumer) = (PrefillRank { pp: 0, tp: 0 }, DecodeRank { tp: 0 });
    let plans = 10u64;
    for i in 0..plans {
        // Plan i copies 1 KiB at 4 KiB * i; plan 5 also writes past the end.
        let mut descriptors = vec![Descriptor::copy(RegionKind::MlaKv, i * 4096, i * 4096, 1024)];
        if i == 5 {
            descriptors.push(Descriptor::copy(RegionKind::MlaKv, 0, len - 512, 1024));
        }
        let plan = Plan { producer, consumer, descriptors, staged: vec![], uncoalesced: 1, chunks: vec![], layers: vec![] };
        mover.submit(Ticket { request: i, nonce: 0, producer, consumer, part: 0 }, &plan).expect("submit");
        if i == 0 {
            // The worker has queued plan 0 and waits for it.
            std::thread::sleep(std::time::Duration::from_millis(30));
        }
    }
    assert!(mover.handle().wait_idle(std::time::Duration::from_secs(60)), "plans did not complete");
    let mut done = Vec::new();
    mover.poll(&mut done);
    assert_eq!(done.len(), plans as usize);
    for c in &done {
        assert_eq!(c.result.is_err(), c.ticket.request == 5, "request {}: {:?}", c.ticket.request, c.result);
    }
    // Plan 0, then the nine that waited: 1, 2, 4 and 2 plans.
    let n = mem.submissions.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(n, 5, "plan 0 alone, then the waiting plans in doubling groups (one a plan: {plans} submissions)");
    let mut got = vec![0u8; len as usize];
    t.read_region(&dst, |b| got.copy_from_slice(b)).expect("read");
    for i in 0..plans {
        let at = (i * 4096) as usize;
        let moved = i != 5;
        assert_eq!(got[at..at + 1024] == pattern[at..at + 1024], moved, "plan {i}'s bytes");
    }
}
