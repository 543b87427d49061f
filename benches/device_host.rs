//! The device hand-off's host path, without a device: one flagship pass at 32K
//! tokens (64 plans, 448 copies) through the mover and the cuda-ipc transport
//! over a device memory that splits each copy list into table launches as the
//! GPU's does (`table_launches`), queues nothing and reports every batch done
//! at once (`NullDevice`). What is timed is the host's share of a pass (plans to the worker,
//! copy lists, the table split, completions back to the caller), which on the
//! GPU comes before the first copy or after the last one.
//!
//! cargo bench --bench device_host

use criterion::{Criterion, criterion_group, criterion_main};
use handoff::bench::transfer::{planned, run_pass};
use handoff::engine::mover::{MoverOptions, TransportMover};
use handoff::transport::auth::ClusterSecret;
use handoff::transport::device::{DeviceTransport, NullDevice};
use handoff::transport::{MemoryKind, RegionHandle, RemoteRegion, Transport};
use handoff_components::Topology;
use handoff_components::plan::Descriptor;
use handoff_components::vocab::{RankId, RegionKind};
use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

const FLAGSHIP: &str = "config/k3-pp8-tp8dcp8.toml";
const TOKENS: u64 = 32768;

fn device_host(c: &mut Criterion) {
    let topo = Topology::load(FLAGSHIP).expect("flagship config");
    let (mut engine, jobs, _) = planned(&topo, TOKENS, 1).expect("the flagship's plans");
    let mem = Arc::new(NullDevice::default());
    let dir = std::env::temp_dir().join(format!("handoff-device-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("the notification socket's directory");
    let t = Arc::new(DeviceTransport::new(mem.clone(), 0, &dir, ClusterSecret::from_bytes(b"bench")).expect("transport"));
    let opts = MoverOptions { batch_timeout: Duration::from_secs(60), ..MoverOptions::from_topology(&topo) };
    let mut mover = TransportMover::new(t.clone() as Arc<dyn Transport>, opts).expect("mover");
    let mut sources: BTreeMap<(RankId, RegionKind), RegionHandle> = BTreeMap::new();
    let mut targets: BTreeMap<(RankId, RegionKind), RemoteRegion> = BTreeMap::new();
    for r in engine.regions() {
        let h = t.register_memory(r.rank, r.layout.kind, r.layout.len, MemoryKind::Device { ordinal: 0 }).expect("region");
        match r.rank {
            RankId::Prefill(_) => {
                sources.insert((r.rank, r.layout.kind), h.clone());
                mover.add_source(h);
            }
            RankId::Decode(_) => {
                targets.insert((r.rank, r.layout.kind), mover.attach_target(&h).expect("attach"));
            }
        }
    }
    // The same plans as one submission straight through the transport.
    let mut groups: Vec<(RegionHandle, RemoteRegion, Vec<Descriptor>)> = Vec::new();
    for (_, p) in &jobs {
        let mut by: BTreeMap<RegionKind, Vec<Descriptor>> = BTreeMap::new();
        for d in &p.descriptors {
            by.entry(d.kind).or_default().push(*d);
        }
        for (kind, descs) in by {
            groups.push((sources[&(RankId::Prefill(p.producer), kind)].clone(), targets[&(RankId::Decode(p.consumer), kind)], descs));
        }
    }
    let writes: Vec<(&RegionHandle, RemoteRegion, &[Descriptor])> = groups.iter().map(|(s, d, v)| (s, *d, v.as_slice())).collect();

    let mut g = c.benchmark_group("device_host");
    g.bench_function("mover_pass_flagship_32k", |b| b.iter(|| run_pass(&mut mover, black_box(&jobs)).expect("pass")));
    g.bench_function("one_submission_flagship_32k", |b| {
        b.iter(|| {
            let batches: Vec<_> = t.submit_all(black_box(&writes)).into_iter().map(|b| b.expect("queued")).collect();
            t.wait_all(&batches, Duration::from_secs(10)).into_iter().for_each(|r| r.expect("done"));
        })
    });
    // The table launches of one submission: the last list queued.
    let tables_of = |w: &[(&RegionHandle, RemoteRegion, &[Descriptor])]| {
        t.submit_all(w).into_iter().for_each(|b| t.wait(b.expect("queued"), Duration::from_secs(10)).expect("done"));
        mem.lists().last().map_or(0, |l| l.2)
    };
    println!("one flagship submission: {} plans, {} batches, {} table launch(es)", jobs.len(), writes.len(), tables_of(&writes));
    for kind in [RegionKind::MlaKv, RegionKind::KdaState, RegionKind::KdaConv, RegionKind::ReplayRecords] {
        let only: Vec<(&RegionHandle, RemoteRegion, &[Descriptor])> = writes.iter().filter(|w| w.1.kind == kind).copied().collect();
        println!("  {kind} alone: {} batches, {} table launch(es)", only.len(), tables_of(&only));
    }
    g.finish();
    // Where a mover pass's host time goes: its submissions' times from the
    // pass's start (the median of 50 passes), which on the GPU is when the
    // device can first copy and how far the host stays ahead of it.
    let (mut first, mut host, mut last, mut subs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut sizes = String::new();
    for _ in 0..50 {
        t.record_submissions();
        let start = std::time::Instant::now();
        run_pass(&mut mover, &jobs).expect("pass");
        let log = t.take_submissions();
        let us = |i: std::time::Instant| i.saturating_duration_since(start).as_secs_f64() * 1e6;
        first.push(log.iter().map(|s| us(s.called)).fold(f64::INFINITY, f64::min));
        last.push(log.iter().map(|s| us(s.queued)).fold(0.0, f64::max));
        host.push(log.iter().map(|s| (s.queued - s.called).as_secs_f64() * 1e6).sum::<f64>() / log.len().max(1) as f64);
        subs.push(log.len() as f64);
        sizes = log.iter().map(|s| s.copies.to_string()).collect::<Vec<_>>().join(" ");
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "a mover pass over the null device (median of 50): {} submissions (the last pass's copies: {sizes}), the first called at {:.1} us, {:.1} us of host time each, the last queued at {:.1} us",
        median(&mut subs),
        median(&mut first),
        median(&mut host),
        median(&mut last)
    );
    drop(mover);
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(Duration::from_secs(4));
    targets = device_host
}
criterion_main!(benches);
