//! Staging for the DCP relayout: gathered runs write exactly what the descriptors
//! write, with far fewer descriptors; the pool is bounded; retries are bounded.

#[allow(dead_code)]
mod transport_util;

use handoff::transport::staging::{RetryPolicy, Stager, StagingPool, gather_runs};
use handoff::transport::{LocalTransport, TcpTransport, Transport, TransportError, TransportExt};
use handoff_components::plan::Descriptor;
use handoff_components::vocab::RegionKind;
use std::cell::Cell;
use std::sync::Arc;
use std::time::Duration;
use transport_util::*;

const ROW: u64 = 1152; // one MLA KV row (576 bf16)

/// Per-token descriptors of a token-interleaved DCP hand-off: decode dcp rank `d`
/// owns token p when (p / s) % dcp == d, at local position (p / (s*dcp)) * s + p % s.
fn dcp_rows(tokens: u64, dcp: u64, s: u64, d: u64) -> Vec<Descriptor> {
    (0..tokens).filter(|p| (p / s) % dcp == d).map(|p| Descriptor::copy(RegionKind::MlaKv, p * ROW, ((p / (s * dcp)) * s + p % s) * ROW, ROW)).collect()
}

/// Invariant: the runs cover exactly the descriptors' bytes, source order kept, and
/// for interleaved DCP rows they are at least 16x fewer than the rows.
#[test]
fn gather_turns_interleaved_dcp_rows_into_few_contiguous_runs() {
    let descs = dcp_rows(4096, 8, 1, 3);
    let runs = gather_runs(&descs, 4 << 20);
    assert_eq!(runs.iter().map(|r| r.len).sum::<u64>(), descs.len() as u64 * ROW);
    assert!(descs.len() >= 16 * runs.len(), "{} rows -> {} runs", descs.len(), runs.len());
    // Sources of the runs, concatenated, are the rows' sources in order.
    let sources: Vec<(u64, u64)> = runs.iter().flat_map(|r| r.sources.clone()).collect();
    assert_eq!(sources, descs.iter().map(|d| (d.src_offset, d.len)).collect::<Vec<_>>());
    // With S = 4, runs of the source merge 4 rows at a time.
    let runs4 = gather_runs(&dcp_rows(4096, 8, 4, 0), 1 << 20);
    assert!(runs4.iter().all(|r| r.sources.iter().all(|&(_, n)| n == 4 * ROW)));
    // A run never exceeds the staging buffer.
    assert!(gather_runs(&descs, 10_000).iter().all(|r| r.len <= 10_000));
}

fn staged_transfer_matches_reference(p: Arc<dyn Transport>, c: Arc<dyn Transport>, name: &str) {
    let tokens = 2048u64;
    let src_len = tokens * ROW;
    let dst_len = src_len / 8 + 4096;
    let mut descs = dcp_rows(tokens, 8, 2, 5);
    let rows = descs.len();
    // Add some random strided descriptors after the rows, in the unused tail.
    let mut rng = Rng(77);
    let tail = random_batch(&mut rng, RegionKind::MlaKv, 20, 64, src_len, 4096);
    descs.extend(tail.into_iter().map(|d| Descriptor { dst_offset: d.dst_offset + src_len / 8, ..d }));
    // Small pool, small batches: buffers are recycled and batches capped.
    let pool = StagingPool::new(Arc::clone(&p), producer_rank(), RegionKind::MlaKv, 2, 64 << 10).expect("pool");
    let stager = Stager::new(Arc::clone(&p), pool, 8, RetryPolicy::default(), WAIT);

    let src = p.register(producer_rank(), RegionKind::MlaKv, src_len).expect("src");
    let dst = c.register(consumer_rank(), RegionKind::MlaKv, dst_len).expect("dst");
    let src_bytes = rng.bytes(src_len as usize);
    p.write_region(&src, |b| b.copy_from_slice(&src_bytes)).expect("fill");
    let mut want = vec![0u8; dst_len as usize];
    naive_copy(&src_bytes, &mut want, &descs);
    let remote = p.attach(&dst).expect("attach");
    let stats = stager.transfer(&src, remote, &descs).expect("staged transfer");
    assert_bytes_eq(name, &c.region_bytes(&dst).expect("read"), &want, &descs);
    assert!(stats.staged_runs > 0 && stats.staged_bytes > 0, "{stats:?}");
    // The DCP rows went out as staged runs, at least 16x fewer than rows.
    assert!(stats.staged_runs * 16 <= rows, "{rows} rows: {stats:?}");
    assert_eq!(stats.bytes, descs.iter().map(Descriptor::bytes).sum::<u64>());
    assert_eq!(stager.pool().available(), 2, "every buffer returned");
}

#[test]
fn staged_dcp_transfer_is_byte_exact_on_local() {
    staged_transfer_matches_reference(Arc::new(LocalTransport::new()), Arc::new(LocalTransport::new()), "local staged");
}

#[test]
fn staged_dcp_transfer_is_byte_exact_on_tcp() {
    let p: Arc<dyn Transport> = Arc::new(TcpTransport::loopback().expect("tcp"));
    let c: Arc<dyn Transport> = Arc::new(TcpTransport::loopback().expect("tcp"));
    staged_transfer_matches_reference(p, c, "tcp staged");
}

#[test]
fn staged_transfer_rejects_out_of_bounds_before_moving_bytes() {
    let t: Arc<dyn Transport> = Arc::new(LocalTransport::new());
    let pool = StagingPool::new(Arc::clone(&t), producer_rank(), RegionKind::MlaKv, 1, 4096).expect("pool");
    let stager = Stager::new(Arc::clone(&t), pool, 4, RetryPolicy::default(), WAIT);
    let src = t.register(producer_rank(), RegionKind::MlaKv, 8192).expect("src");
    let dst = t.register(consumer_rank(), RegionKind::MlaKv, 1024).expect("dst");
    t.write_region(&src, |b| b.fill(9)).expect("fill");
    let r = t.attach(&dst).expect("attach");
    let descs = [Descriptor::copy(RegionKind::MlaKv, 0, 0, 100), Descriptor::copy(RegionKind::MlaKv, 200, 1000, 100)];
    assert!(matches!(stager.transfer(&src, r, &descs), Err(TransportError::OutOfBounds { index: 1, .. })));
    assert!(t.region_bytes(&dst).expect("read").iter().all(|&b| b == 0));
}

/// The pool never grows: with every buffer out, acquire fails with a clear error
/// after its wait, and succeeds again once a buffer is returned.
#[test]
fn staging_pool_is_bounded_and_reports_exhaustion() {
    let t: Arc<dyn Transport> = Arc::new(LocalTransport::new());
    let pool = StagingPool::new(t, producer_rank(), RegionKind::MlaKv, 2, 1024).expect("pool");
    let a = pool.acquire(WAIT).expect("first");
    let b = pool.try_acquire().expect("second");
    assert!(pool.try_acquire().is_none());
    let err = pool.acquire(Duration::from_millis(20)).err().expect("exhausted");
    assert!(matches!(err, TransportError::PoolExhausted { buffers: 2, bytes: 1024, .. }), "{err}");
    assert!(err.is_transient());
    drop(a);
    assert_eq!(pool.available(), 1);
    let c = pool.acquire(WAIT).expect("after return");
    assert_ne!(c.handle().id, b.handle().id);
    // A waiter is woken by a return from another thread.
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(20));
            drop(c);
        });
        pool.acquire(WAIT).expect("woken by return");
    });
}

#[test]
fn retry_policy_retries_transient_errors_only_and_gives_up() {
    let policy = RetryPolicy { attempts: 3, initial_backoff: Duration::from_millis(1), max_backoff: Duration::from_millis(2) };
    let transient = || TransportError::Disconnected { peer: "p".into(), reason: "reset".into() };
    let calls = Cell::new(0);
    let ok = policy.run(|_| {
        calls.set(calls.get() + 1);
        if calls.get() < 3 { Err(transient()) } else { Ok(7) }
    });
    assert_eq!((ok, calls.get()), (Ok(7), 3));

    calls.set(0);
    let err = policy.run(|_| -> Result<(), _> {
        calls.set(calls.get() + 1);
        Err(transient())
    });
    assert!(matches!(err, Err(TransportError::RetriesExhausted { attempts: 3, .. })));
    assert_eq!(calls.get(), 3);

    calls.set(0);
    let err = policy.run(|_| -> Result<(), _> {
        calls.set(calls.get() + 1);
        Err(TransportError::UnknownRegion("x".into()))
    });
    assert!(matches!(err, Err(TransportError::UnknownRegion(_))));
    assert_eq!(calls.get(), 1, "a wrong request is not retried");
}
