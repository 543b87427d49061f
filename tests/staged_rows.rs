//! Scattered blocks through staging (issue 21, item 2): when producer and consumer
//! blocks do not line up, the planner emits staged groups (one write per staging
//! buffer) instead of one descriptor per block piece; the oracle runs them from
//! the DCP rule and checks every consumer byte; the local, shm and tcp transports
//! land them byte for byte; a write that cannot get a buffer waits.

mod common;
mod plan_case;
#[allow(dead_code)]
mod transport_util;

use common::Shape;
use handoff::check::oracle::{self, ExecError, Memory, OracleRequest, Placement};
use handoff::transport::staging::{RetryPolicy, Stager, StagingPool};
use handoff::transport::{LocalTransport, RegionHandle, RemoteRegion, ShmTransport, TcpTransport, Transport, TransportError, TransportExt};
use handoff_components::Topology;
use handoff_components::layout::{ConsumerLayout, ProducerLayout};
use handoff_components::plan::{Plan, StagedError};
use handoff_components::vocab::{DecodeRank, Distribution, PrefillRank, RankId, RegionKind};
use handoff_systems::placement::{blocks_for, owned_tokens, place_rank};
use plan_case::Case;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use transport_util::{Rng, WAIT};

const REQ: u64 = 77;
const SLOTS: u32 = 2;
const SLOT: u32 = 1;

/// One request's layouts on every rank: producer blocks every other block of a
/// region twice the size, in shuffled order; consumer blocks shuffled.
/// A permutation of `0..n`, from `seed` (reversed for seed 0).
fn shuffled(n: u32, seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    if seed == 0 {
        v.reverse();
        return v;
    }
    let mut rng = Rng(seed);
    for i in (1..v.len()).rev() {
        v.swap(i, rng.below(i as u64 + 1) as usize);
    }
    v
}

fn case(topo: Topology, tokens: u64, seed: u64) -> Case {
    let (p, d) = (topo.prefill(), topo.decode());
    let pn = blocks_for(tokens, p.block_size) as u32;
    let producers = (0..p.pp)
        .flat_map(|pp| (0..p.tp).map(move |tp| PrefillRank { pp, tp }))
        .map(|rank| {
            let blocks = shuffled(pn, seed ^ u64::from(rank.pp * 31 + rank.tp)).into_iter().map(|b| 2 * b + 1).collect();
            ProducerLayout { rank, blocks, slot: SLOT, layout: place_rank(&topo, RankId::Prefill(rank), 2 * pn + 2, SLOTS) }
        })
        .collect();
    let consumers = (0..d.tp)
        .map(|tp| {
            let rank = DecodeRank { tp };
            let n = blocks_for(owned_tokens(tokens, d.dcp, rank.dcp_rank(d.dcp), d.interleave), d.block_size) as u32;
            // One spare block, so that a free block must stay canary.
            let blocks = shuffled(n + 1, seed.wrapping_mul(7) ^ u64::from(tp))[..n as usize].to_vec();
            ConsumerLayout {
                rank,
                tp: d.tp,
                dcp: d.dcp,
                interleave: d.interleave,
                blocks,
                slot: SLOT,
                layout: place_rank(&topo, RankId::Decode(rank), n + 1, SLOTS),
            }
        })
        .collect();
    Case { topo, tokens, producers, consumers }
}

/// Every pair's plan, staging with buffers of `staging` bytes (`None`: descriptors only).
fn plans(c: &Case, staging: Option<u64>) -> Vec<Plan> {
    plan_case::plans(c, |p| p.staging(staging))
}

/// Every region of the case: canary everywhere, the request's pattern on the producers.
fn memory(c: &Case) -> Memory {
    plan_case::memory(c, REQ)
}

/// The oracle's verdict on every consumer region: the rules' bytes where the
/// request lives, canary elsewhere.
fn check(c: &Case, region: impl Fn(DecodeRank, RegionKind) -> Vec<u8>) -> Result<oracle::OracleStats, oracle::OracleError> {
    let mut total = oracle::OracleStats::default();
    for k in &c.consumers {
        for r in &k.layout.regions {
            let req = (OracleRequest { id: REQ, tokens: c.tokens }, Placement { blocks: &k.blocks, slot: k.slot });
            total = total + oracle::check_consumer(&c.topo, k.rank, r.kind, r.units, &[req], &region(k.rank, r.kind))?;
        }
    }
    Ok(total)
}

fn staged_writes(plans: &[Plan]) -> usize {
    plans.iter().map(|p| p.writes() - p.descriptors.len()).sum()
}

fn shapes() -> impl Strategy<Value = (Shape, u64, u64, u64)> {
    (1u32..=2, 0usize..2, 0usize..3, 0usize..3, 0usize..3, 0usize..3, 0usize..3, 1u64..160, 1u64..24, 0u64..50, any::<bool>()).prop_filter_map(
        "valid shape",
        |(pp, ptp_i, dtp_i, dcp_i, pbs_i, dbs_i, il_i, tokens, rows_per_buffer, seed, indexer)| {
            let (ptp, dtp, dcp) = ([1, 2][ptp_i], [1, 2, 4][dtp_i], [1, 2, 4][dcp_i]);
            let (pbs, dbs, interleave) = ([2, 4, 8][pbs_i], [2, 4, 8][dbs_i], [1, 2, 4][il_i]);
            if dtp % ptp != 0 || dtp % dcp != 0 || dbs % interleave != 0 {
                return None;
            }
            // The sparse-MLA indexer (a second paged kind) only under PP1.
            let indexer = if indexer && pp == 1 { 4 } else { 0 };
            let shape = Shape { pp, ptp, dtp, dcp, pbs, dbs, interleave, indexer, replay: Some(2), ..Default::default() };
            Some((shape, tokens, rows_per_buffer, seed))
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Invariant: for any valid topology, prompt length, scattered block tables and
    /// staging buffer (down to one token row, and sizes that are no multiple of a
    /// row), the staged plans write every byte the rules give each decode rank,
    /// once, and nothing else; and no staged write exceeds its buffer.
    #[test]
    fn staged_plans_are_byte_exact_under_the_oracle((shape, tokens, rows_per_buffer, seed) in shapes()) {
        let c = case(shape.topology(), tokens, seed);
        let tb = c.topo.token_bytes(RegionKind::MlaKv);
        let staging = rows_per_buffer * tb + seed % 3;
        let staged = plans(&c, Some(staging));
        for g in staged.iter().flat_map(|p| &p.staged) {
            prop_assert!(g.writes.iter().all(|w| (w.end - w.start) * g.token_bytes <= staging), "{g:?}");
        }
        let mut mem = memory(&c);
        let exec = oracle::execute_counted(&staged, &mut mem);
        prop_assert!(exec.is_ok(), "{}", exec.unwrap_err());
        let exec = exec.unwrap();
        prop_assert_eq!(exec.staged_writes as usize, staged_writes(&staged));
        let ok = check(&c, |r, k| mem[&(RankId::Decode(r), k)].clone());
        prop_assert!(ok.is_ok(), "{}", ok.unwrap_err());
        prop_assert_eq!(ok.unwrap().pattern_bytes, exec.bytes);
    }
}

/// A fixed shape where both sides' blocks are scattered: the planner stages, and
/// the groups are what the oracle judges (not a case the planner declined).
fn scattered_case() -> Case {
    let shape = Shape { pp: 2, ptp: 1, dtp: 4, dcp: 2, pbs: 4, dbs: 4, interleave: 2, replay: Some(2), ..Default::default() };
    case(shape.topology(), 150, 5)
}

#[test]
fn scattered_blocks_are_staged_and_land_byte_exact() {
    let c = scattered_case();
    let tb = c.topo.token_bytes(RegionKind::MlaKv);
    let staged = plans(&c, Some(8 * tb));
    let direct = plans(&c, None);
    assert!(staged.iter().all(|p| p.staged.len() == 1 && p.descriptors.iter().all(|d| d.kind.distribution() != Distribution::TokenSharded)));
    // 76 or 74 owned positions a consumer, 8 a buffer: 10 writes for each of the
    // 8 pairs (a stage holds one MLA layer), where the descriptors need one a
    // block piece.
    let (w, d) = (staged_writes(&staged), direct.iter().map(Plan::writes).sum::<usize>() - staged.iter().map(|p| p.descriptors.len()).sum::<usize>());
    assert_eq!(w, 8 * 10, "8 pairs x 10 writes");
    assert!(d > 2 * w, "descriptors-only: {d} row descriptors, staged: {w} writes");
    let mut mem = memory(&c);
    oracle::execute_counted(&staged, &mut mem).expect("exec");
    check(&c, |r, k| mem[&(RankId::Decode(r), k)].clone()).expect("byte exact");
}

/// The oracle reads a group from the rules, so a group that names the wrong
/// positions or blocks is caught on the consumer's bytes, and a malformed one
/// before any copy.
#[test]
fn the_oracle_catches_a_wrong_staged_group() {
    let c = scattered_case();
    let tb = c.topo.token_bytes(RegionKind::MlaKv);
    let run = |tamper: &dyn Fn(&mut Vec<Plan>)| -> Result<(), String> {
        let mut p = plans(&c, Some(8 * tb));
        tamper(&mut p);
        let mut mem = memory(&c);
        oracle::execute_counted(&p, &mut mem).map_err(|e| format!("exec: {e}"))?;
        check(&c, |r, k| mem[&(RankId::Decode(r), k)].clone()).map(|_| ()).map_err(|e| format!("bytes: {e}"))
    };
    run(&|_| {}).expect("untouched plans pass");
    // Two consumer blocks swapped in a group's table: rows land in the wrong block.
    let e = run(&|p| {
        let g = &mut p[0].staged[0];
        let mut t = g.dst.blocks.to_vec();
        t.swap(0, 1);
        g.dst.blocks = t.into();
    })
    .unwrap_err();
    assert!(e.starts_with("bytes: ") && e.contains("mla.kv"), "{e}");
    // The other dcp rank's tokens (decode tp1 owns 74 positions, tp0 76).
    let e = run(&|p| {
        let g = &mut p[1].staged[0];
        assert_eq!(g.dcp_rank, 1);
        g.dcp_rank = 0;
    })
    .unwrap_err();
    assert!(e.starts_with("bytes: "), "{e}");
    // A write dropped: its rows stay canary.
    let e = run(&|p| {
        p[1].staged[0].writes.remove(2);
    })
    .unwrap_err();
    assert!(e.contains("canary: untouched"), "{e}");
    // A write doubled, a write past its buffer, a position past the request.
    let mut p = plans(&c, Some(8 * tb));
    let w = p[0].staged[0].writes[0];
    p[0].staged[0].writes.push(w);
    let n = p[0].descriptors.len() + p[0].staged[0].writes.len() - 1;
    assert!(
        matches!(oracle::execute_counted(&p, &mut memory(&c)), Err(ExecError::DoubleWrite { first: (0, f), second: (0, s), .. }) if f == p[0].descriptors.len() && s == n)
    );
    let mut p = plans(&c, Some(8 * tb));
    p[0].staged[0].staging_bytes = 8 * tb - 1;
    assert!(matches!(oracle::execute_counted(&p, &mut memory(&c)), Err(ExecError::StagedTooLarge { plan: 0, group: 0, write: 0, .. })));
    let mut p = plans(&c, Some(8 * tb));
    let g = &mut p[0].staged[0];
    g.writes.last_mut().unwrap().end += 1;
    let e = oracle::execute_counted(&p, &mut memory(&c)).unwrap_err();
    assert!(matches!(e, ExecError::StagedPosition { plan: 0, group: 0, .. }), "{e}");
    let mut p = plans(&c, Some(8 * tb));
    let g = &mut p[0].staged[0];
    g.dst.block_stride *= 64;
    let e = oracle::execute_counted(&p, &mut memory(&c)).unwrap_err();
    assert!(matches!(e, ExecError::StagedOutOfBounds { side: "destination", .. }), "{e}");
}

/// Regions of every rank of `c` registered in `p` (producers) and `c` (consumers),
/// filled as [`memory`] fills them; the consumers' attached from `p`.
struct Registered {
    sources: BTreeMap<(PrefillRank, RegionKind), RegionHandle>,
    targets: BTreeMap<(DecodeRank, RegionKind), (RegionHandle, RemoteRegion)>,
}

fn register(c: &Case, p: &dyn Transport, k: &dyn Transport) -> Registered {
    let mem = memory(c);
    let mut out = Registered { sources: BTreeMap::new(), targets: BTreeMap::new() };
    for ((rank, kind), bytes) in &mem {
        match rank {
            RankId::Prefill(pr) => {
                let h = p.register(*rank, *kind, bytes.len() as u64).expect("register");
                p.write_region(&h, |b| b.copy_from_slice(bytes)).expect("fill");
                out.sources.insert((*pr, *kind), h);
            }
            RankId::Decode(dr) => {
                let h = k.register(*rank, *kind, bytes.len() as u64).expect("register");
                k.write_region(&h, |b| b.copy_from_slice(bytes)).expect("fill");
                let remote = p.attach(&h).expect("attach");
                out.targets.insert((*dr, *kind), (h, remote));
            }
        }
    }
    out
}

/// The staging pool a test lands through: `buffers` x `bytes`, and batches of at
/// most `max_batch` descriptors.
struct Pool {
    buffers: u32,
    bytes: u64,
    max_batch: u32,
}

/// Runs the staged plans of `c`, cut for buffers of `planned_for` bytes, over a
/// producer / consumer transport pair through `pool`, and checks every consumer
/// byte with the oracle.
fn land_on(p: Arc<dyn Transport>, k: Arc<dyn Transport>, c: &Case, planned_for: u64, pool: Pool, what: &str) {
    let Pool { buffers, bytes, max_batch } = pool;
    let regions = register(c, &*p, &*k);
    let pool = StagingPool::new(Arc::clone(&p), RankId::Prefill(PrefillRank { pp: 0, tp: 0 }), RegionKind::MlaKv, buffers, bytes).expect("pool");
    let stager = Stager::new(Arc::clone(&p), pool, max_batch, RetryPolicy::default(), WAIT);
    let (mut writes, mut buffers_written) = (0, 0);
    for plan in plans(c, Some(planned_for)) {
        for d in &plan.descriptors {
            let (_, remote) = regions.targets[&(plan.consumer, d.kind)];
            p.transfer(&regions.sources[&(plan.producer, d.kind)], remote, std::slice::from_ref(d), WAIT).expect("descriptor");
        }
        for g in &plan.staged {
            let (_, remote) = regions.targets[&(plan.consumer, g.kind)];
            let st = stager.transfer_staged(&regions.sources[&(plan.producer, g.kind)], remote, g).expect("staged group");
            assert_eq!(st.bytes, g.bytes(), "{what}");
            assert!(st.landing_descriptors >= st.buffers as u64 && st.batches >= st.buffers, "{what}: {st:?}");
            writes += st.writes;
            buffers_written += st.buffers;
        }
    }
    assert!(writes > 0, "{what}: nothing was staged");
    // A pool of smaller buffers than the plans were cut for writes more of them.
    if bytes < planned_for {
        assert!(buffers_written > writes, "{what}: {buffers_written} buffers for {writes} writes");
    } else {
        assert_eq!(buffers_written, writes, "{what}");
    }
    assert_eq!(stager.pool().available(), buffers as usize, "{what}: every buffer back");
    check(c, |r, kind| k.region_bytes(&regions.targets[&(r, kind)].0).expect("read")).unwrap_or_else(|e| panic!("{what}: {e}"));
}

#[test]
fn staged_groups_land_byte_exact_on_local_shm_and_tcp() {
    let c = scattered_case();
    let tb = c.topo.token_bytes(RegionKind::MlaKv);
    let local = || -> Arc<dyn Transport> { Arc::new(LocalTransport::new()) };
    let shm = || -> Arc<dyn Transport> { Arc::new(ShmTransport::new().expect("shm")) };
    let tcp = || -> Arc<dyn Transport> { Arc::new(TcpTransport::loopback().expect("tcp")) };
    let roomy = || Pool { buffers: 2, bytes: 8 * tb, max_batch: 1024 };
    land_on(local(), local(), &c, 8 * tb, roomy(), "local");
    land_on(shm(), shm(), &c, 8 * tb, roomy(), "shm");
    land_on(tcp(), tcp(), &c, 8 * tb, roomy(), "tcp");
    // One buffer of 3 rows for writes cut at 8, and landing batches of one
    // descriptor: every write is cut, every buffer waits for the one before.
    land_on(local(), local(), &c, 8 * tb, Pool { buffers: 1, bytes: 3 * tb, max_batch: 1 }, "local, small pool");
    land_on(shm(), shm(), &c, 8 * tb, Pool { buffers: 1, bytes: 3 * tb + 5, max_batch: 1 }, "shm, small pool");
}

/// A group the transport cannot run is refused before any byte moves: a table
/// reaching past a region, a buffer smaller than one row.
#[test]
fn a_bad_staged_group_moves_nothing() {
    let c = scattered_case();
    let tb = c.topo.token_bytes(RegionKind::MlaKv);
    let t: Arc<dyn Transport> = Arc::new(LocalTransport::new());
    let regions = register(&c, &*t, &*t);
    let plan = plans(&c, Some(8 * tb)).remove(0);
    let (h, remote) = regions.targets[&(plan.consumer, RegionKind::MlaKv)].clone();
    let before = t.region_bytes(&h).expect("read");
    let src = &regions.sources[&(plan.producer, RegionKind::MlaKv)];
    let pool = StagingPool::new(Arc::clone(&t), RankId::Prefill(plan.producer), RegionKind::MlaKv, 1, 8 * tb).expect("pool");
    let stager = Stager::new(Arc::clone(&t), pool, 64, RetryPolicy::default(), WAIT);
    let mut far = plan.staged[0].clone();
    far.dst.blocks = far.dst.blocks.iter().map(|b| b + 1000).collect::<Vec<_>>().into();
    assert!(matches!(stager.transfer_staged(src, remote, &far), Err(TransportError::StagedOutOfBounds { kind: RegionKind::MlaKv, .. })));
    let mut zero = plan.staged[0].clone();
    zero.interleave = 0;
    assert!(matches!(stager.transfer_staged(src, remote, &zero), Err(TransportError::Staged(StagedError::Zero { what: "interleave", .. }))));
    let tiny = Stager::new(
        Arc::clone(&t),
        StagingPool::new(Arc::clone(&t), RankId::Prefill(plan.producer), RegionKind::MlaKv, 1, tb - 1).expect("pool"),
        64,
        RetryPolicy::default(),
        WAIT,
    );
    assert!(matches!(tiny.transfer_staged(src, remote, &plan.staged[0]), Err(TransportError::Staged(StagedError::TooLarge { .. }))));
    assert_eq!(t.region_bytes(&h).expect("read"), before, "nothing moved");
}

/// The pool is bounded and a staged write that finds it empty waits for a
/// buffer, past the batch timeout, instead of failing (issue 21: a request that
/// cannot get staging waits; it is never refused for it). The descriptor stager
/// in the same spot gives up with `PoolExhausted`.
#[test]
fn a_staged_write_waits_for_a_buffer_and_is_never_refused() {
    let c = scattered_case();
    let tb = c.topo.token_bytes(RegionKind::MlaKv);
    let t: Arc<dyn Transport> = Arc::new(LocalTransport::new());
    let regions = register(&c, &*t, &*t);
    let plan = plans(&c, Some(8 * tb)).remove(0);
    let (h, remote) = regions.targets[&(plan.consumer, RegionKind::MlaKv)].clone();
    let src = &regions.sources[&(plan.producer, RegionKind::MlaKv)];
    let pool = StagingPool::new(Arc::clone(&t), RankId::Prefill(plan.producer), RegionKind::MlaKv, 1, 8 * tb).expect("pool");
    let timeout = Duration::from_millis(20);
    let stager = Stager::new(Arc::clone(&t), pool, 64, RetryPolicy { attempts: 1, ..RetryPolicy::default() }, timeout);
    let held = Duration::from_millis(300);
    std::thread::scope(|s| {
        let buf = stager.pool().try_acquire().expect("the only buffer");
        let (tx, rx) = std::sync::mpsc::channel();
        s.spawn(move || {
            std::thread::sleep(held);
            tx.send(()).expect("send");
            drop(buf);
        });
        // The descriptor path gives up after its timeout.
        let rows: Vec<_> = (0..4).map(|i| handoff_components::plan::Descriptor::copy(RegionKind::MlaKv, 2 * i * tb, i * tb, tb)).collect();
        assert!(matches!(stager.transfer(src, remote, &rows), Err(TransportError::PoolExhausted { buffers: 1, .. })));
        let t0 = Instant::now();
        let st = stager.transfer_staged(src, remote, &plan.staged[0]).expect("waits, then writes");
        // The holder says so before it lets the buffer go.
        assert!(rx.try_recv().is_ok(), "it wrote only after the buffer came back, {:?} later", t0.elapsed());
        assert!(st.waits >= 1, "{st:?}");
    });
    assert_eq!(stager.pool().available(), 1);
    let k = c.consumers.iter().find(|k| k.rank == plan.consumer).expect("consumer");
    let buf = t.region_bytes(&h).expect("read");
    let req = (OracleRequest { id: REQ, tokens: c.tokens }, Placement { blocks: &k.blocks, slot: k.slot });
    let units = k.layout.region(RegionKind::MlaKv).expect("mla").units;
    // Only stage 0 has landed: the first wrong byte, in offset order, is in stage
    // 1's layer 7, still canary; every row of layer 3, before it, is the pattern.
    let e = oracle::check_consumer(&c.topo, k.rank, RegionKind::MlaKv, units, &[req], &buf).unwrap_err().to_string();
    assert!(e.contains("canary: untouched") && e.contains("layer 7 "), "{e}");
}

/// The figure at full size, planning only: the flagship with scattered
/// blocks at 1M tokens takes fewer than 20,000 writes, and every staged write
/// fits the flagship's staging buffer.
#[test]
fn flagship_scattered_at_1m_tokens_takes_fewer_than_20000_writes() {
    let topo = Topology::load(concat!(env!("CARGO_MANIFEST_DIR"), "/config/k3-pp8-tp8dcp8.toml")).expect("flagship");
    let staging = topo.config.transport.staging_bytes;
    let c = case(topo, 1 << 20, 0);
    let p = plans(&c, Some(staging));
    let writes: usize = p.iter().map(Plan::writes).sum();
    assert!(writes < 20_000, "{writes} writes");
    assert!(p.iter().flat_map(|p| &p.staged).flat_map(|g| g.writes.iter().map(move |w| (w.end - w.start) * g.token_bytes)).all(|b| b <= staging));
    let rows: u64 = p.iter().flat_map(|p| &p.staged).map(|g| g.bytes()).sum();
    assert_eq!(rows, (1u64 << 20) * c.topo.token_bytes(RegionKind::MlaKv) * 23, "every MLA row of the 23 layers, once over the 8 dcp ranks");
}

/// Staged groups copy the same token rows as the descriptors-only plan of the same
/// request, row for row (the pieces the transports cut them into, expanded):
/// the flagship at 128K tokens with scattered blocks.
#[test]
fn staged_pieces_copy_the_rows_the_descriptors_copy() {
    let topo = Topology::load(concat!(env!("CARGO_MANIFEST_DIR"), "/config/k3-pp8-tp8dcp8.toml")).expect("flagship");
    let staging = topo.config.transport.staging_bytes;
    let c = case(topo, 1 << 17, 3);
    let tb = c.topo.token_bytes(RegionKind::MlaKv);
    for (s, d) in plans(&c, Some(staging)).iter().zip(plans(&c, None)) {
        assert_eq!(
            s.descriptors.iter().filter(|x| x.kind.distribution() != Distribution::TokenSharded).collect::<Vec<_>>(),
            d.descriptors.iter().filter(|x| x.kind.distribution() != Distribution::TokenSharded).collect::<Vec<_>>()
        );
        let mut want: Vec<(u64, u64)> = Vec::new();
        for x in d.descriptors.iter().filter(|x| x.kind == RegionKind::MlaKv) {
            for (so, dof) in x.pieces() {
                want.extend((0..x.len / tb).map(|j| (dof + j * tb, so + j * tb)));
            }
        }
        let mut got: Vec<(u64, u64)> = Vec::new();
        for g in &s.staged {
            for &w in &g.writes {
                for piece in g.pieces(w) {
                    got.extend((0..piece.len / tb).map(|j| (piece.dst + j * tb, piece.src + j * tb)));
                }
            }
        }
        want.sort_unstable();
        got.sort_unstable();
        assert_eq!(got.len(), want.len(), "{:?} -> {:?}", s.producer, s.consumer);
        assert!(got == want, "{:?} -> {:?}: staged rows differ from the descriptors' rows", s.producer, s.consumer);
    }
}

/// A mover that completes every plan at once and keeps it, staging with buffers of
/// `staging` bytes while that is non-zero.
#[derive(Clone, Default)]
struct KeepingMover {
    staging: Arc<std::sync::atomic::AtomicU64>,
    plans: Arc<std::sync::Mutex<Vec<(u64, Plan)>>>,
    done: Arc<std::sync::Mutex<Vec<handoff_systems::transfer::PlanCompletion>>>,
}

impl handoff_systems::transfer::Mover for KeepingMover {
    fn submit(&mut self, ticket: handoff_systems::transfer::Ticket, plan: &Plan) -> Result<(), handoff_systems::transfer::MoveError> {
        self.plans.lock().unwrap().push((ticket.request, plan.clone()));
        self.done.lock().unwrap().push(handoff_systems::transfer::PlanCompletion { ticket, result: Ok(()) });
        Ok(())
    }
    fn poll(&mut self, out: &mut Vec<handoff_systems::transfer::PlanCompletion>) {
        out.append(&mut self.done.lock().unwrap());
    }
    fn staging_bytes(&self) -> Option<u64> {
        Some(self.staging.load(std::sync::atomic::Ordering::Relaxed)).filter(|&b| b > 0)
    }
}

/// An engine whose decode block pool is fragmented: requests 1 and 3 of three came
/// and went while 2 decodes, so request 4, twice their size, gets two runs of
/// decode blocks (prefill freed 2's blocks once they were handed off).
/// Returns the engine after request 4 was placed and planned.
fn fragmented(mover: &KeepingMover) -> handoff::engine::Engine {
    let topo = Shape { pp: 1, ptp: 1, dtp: 1, dcp: 1, pbs: 4, dbs: 4, ..Default::default() }.topology();
    let cap = handoff_systems::placement::Capacity::for_requests(&topo, 3, 8);
    let mut e = handoff::engine::Engine::new(topo, cap, Box::new(mover.clone()));
    for id in 1..=3 {
        e.submit(id, 8);
    }
    e.tick();
    for id in 1..=3 {
        e.mark_computed(id, 0);
    }
    e.tick();
    e.tick();
    for id in [1, 3] {
        e.finish(id);
    }
    e.tick();
    e.take_outcomes();
    mover.plans.lock().unwrap().clear();
    e.submit(4, 16);
    e.tick();
    let blocks: Vec<Vec<u32>> = e.leases(4).into_iter().map(|l| l.blocks).collect();
    assert!(blocks.iter().any(|b| b.len() == 4 && b.windows(2).any(|w| w[1] != w[0] + 1)), "blocks not fragmented: {blocks:?}");
    e
}

/// The engine's planner stages scattered rows only for a mover that says it runs
/// staged groups, and a staged plan is never handed to one that does not.
#[test]
fn the_engine_stages_only_for_a_mover_that_runs_staged_groups() {
    // A staging mover gets one staged group for the MLA rows.
    let mover = KeepingMover::default();
    mover.staging.store(1 << 20, std::sync::atomic::Ordering::Relaxed);
    let mut e = fragmented(&mover);
    e.mark_computed(4, 0);
    e.tick();
    // One plan, submitted a part a layer (layer-wise streaming): one staged
    // group for each MLA layer's rows, and no row as a descriptor.
    let plans = mover.plans.lock().unwrap().clone();
    assert!(plans.iter().all(|(id, p)| *id == 4 && (p.producer, p.consumer) == (plans[0].1.producer, plans[0].1.consumer)), "one plan");
    let mla = e.topology().all_layers_of(handoff_components::vocab::LayerKind::Mla).len();
    assert_eq!(plans.iter().map(|(_, p)| p.staged.len()).sum::<usize>(), mla, "{plans:?}");
    assert!(plans.iter().all(|(_, p)| p.staged.len() <= 1), "a staged group a layer part");
    assert!(plans.iter().flat_map(|(_, p)| &p.descriptors).all(|d| d.kind.distribution() != Distribution::TokenSharded));
    let bytes = |ps: &[(u64, Plan)]| ps.iter().map(|(_, p)| p.bytes()).sum::<u64>();

    // A mover that runs descriptors only gets the rows as descriptors.
    let plain = KeepingMover::default();
    let mut e = fragmented(&plain);
    e.mark_computed(4, 0);
    e.tick();
    let got = plain.plans.lock().unwrap().clone();
    assert!(got.iter().all(|(_, p)| p.staged.is_empty()));
    assert_eq!(bytes(&got), bytes(&plans));

    // A plan staged for a mover that stops staging before it is submitted fails the
    // request, naming why, rather than leaving its rows unwritten.
    let fickle = KeepingMover::default();
    fickle.staging.store(1 << 20, std::sync::atomic::Ordering::Relaxed);
    let mut e = fragmented(&fickle);
    fickle.staging.store(0, std::sync::atomic::Ordering::Relaxed);
    e.mark_computed(4, 0);
    e.tick();
    assert!(fickle.plans.lock().unwrap().is_empty(), "nothing submitted");
    let out = e.take_outcomes();
    let failed = out.iter().find(|o| o.request == 4).and_then(|o| o.result.as_ref().err()).expect("request 4 failed");
    assert!(matches!(&failed.cause, handoff_components::Cause::Transfer { detail } if detail.contains("staged row groups")), "{failed:?}");
}

/// The engine's own transport mover runs staged groups (issue 21, item 2): it
/// says so to the planner with the topology's staging buffer on local, shm and
/// tcp, and a request whose decode blocks are scattered (`verify --fragmented`)
/// lands byte for byte through its stager on each, checked by the oracle, with
/// every staged write run.
#[test]
fn the_engines_mover_lands_scattered_blocks_through_staging_on_local_shm_and_tcp() {
    use handoff::check::verify::{VerifyOptions, verify_with};
    use handoff::engine::mover::{MoverOptions, TransportMover};
    use handoff_components::config::TransportKind;
    use handoff_systems::transfer::Mover;
    let topo = Topology::load(concat!(env!("CARGO_MANIFEST_DIR"), "/config/pp3-tp2-to-tp4dcp2.toml")).expect("config");
    let staging = topo.config.transport.staging_bytes;
    for kind in [TransportKind::Local, TransportKind::Shm, TransportKind::Tcp] {
        let t = handoff::transport::open(kind, None).expect("transport");
        let mover = TransportMover::new(t, MoverOptions::from_topology(&topo)).expect("mover");
        assert_eq!(mover.staging_bytes(), Some(staging), "{kind:?}");
        let r = verify_with(&topo, 300, 2, VerifyOptions { fragmented: true, transport: Some(kind) }, |_| {}).unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        assert!(r.staged_groups > 0, "{kind:?}: nothing staged: {r:?}");
        assert_eq!(r.staged_writes_run, r.staged_writes, "{kind:?}");
        assert!(r.pattern_bytes > 0 && r.pattern_bytes == r.bytes_written, "{kind:?}: {r:?}");
    }
    // A pool of no buffer: the mover runs descriptors only, and the planner gives it those.
    let t = handoff::transport::open(TransportKind::Local, None).expect("transport");
    let none = TransportMover::new(t, MoverOptions { staging_buffers: 0, ..MoverOptions::from_topology(&topo) }).expect("mover");
    assert_eq!(none.staging_bytes(), None);
}

/// Tampered staged groups fail `verify --fragmented` on the consumer's bytes,
/// through the engine's mover and through the oracle's copy alike: a group's
/// consumer blocks swapped (rows land in the wrong block), a write dropped (its
/// rows stay canary), one token row of a write shifted by one byte in the
/// producer (every byte of it wrong).
#[test]
fn tampered_staged_groups_fail_fragmented_verify() {
    use handoff::check::CheckError;
    use handoff::check::verify::{VerifyOptions, verify_with};
    use handoff_components::config::TransportKind;
    let topo = Topology::load(concat!(env!("CARGO_MANIFEST_DIR"), "/config/small.toml")).expect("config");
    type Tamper = fn(&mut Vec<Plan>);
    let swap: Tamper = |p| {
        let g = p.iter_mut().flat_map(|p| &mut p.staged).find(|g| g.dst.blocks.len() > 1).expect("a staged group over two blocks");
        let mut t = g.dst.blocks.to_vec();
        t.swap(0, 1);
        g.dst.blocks = t.into();
    };
    let drop_write: Tamper = |p| {
        let g = p.iter_mut().flat_map(|p| &mut p.staged).next().expect("a staged group");
        let w = g.writes[0];
        g.writes[0].end = w.end - 1;
    };
    let shift: Tamper = |p| {
        let g = p.iter_mut().flat_map(|p| &mut p.staged).next().expect("a staged group");
        g.rows[0].0 += 1;
    };
    for transport in [None, Some(TransportKind::Local), Some(TransportKind::Tcp)] {
        let opts = VerifyOptions { fragmented: true, transport };
        verify_with(&topo, 256, 2, opts, |_| {}).unwrap_or_else(|e| panic!("{transport:?} untouched: {e}"));
        for (what, tamper, want) in
            [(("swapped blocks"), swap, "mla.kv"), ("a row dropped", drop_write, "canary: untouched"), ("a row one byte off", shift, "mla.kv")]
        {
            let e = verify_with(&topo, 256, 2, opts, tamper).expect_err(what);
            assert!(matches!(e.root(), CheckError::Oracle(_)), "{transport:?} {what}: {e}");
            assert!(e.to_string().contains(want), "{transport:?} {what}: {e}");
        }
    }
}
