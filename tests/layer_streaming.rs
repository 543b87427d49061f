//! Layer-wise streaming (issue 21, item 3): with `[prefill] layer_streaming`
//! (on by default) each pair's plan is cut by module layer, and a stage issues a
//! layer's writes as soon as that layer is computed, while the next layers
//! compute; the write-done report still waits for every layer.
//!
//! What is shown here, without timing anything:
//! - the planner: a layered plan's part k writes exactly the bytes of its layer,
//!   so that every prefix of layers lands exactly those layers' rows and state,
//!   and the whole layered plan lands every byte of the hand-off under the oracle
//!   and writes what the plain plan writes;
//! - the engine: while a stage computes, the mover already holds the parts of
//!   every layer the compute has finished (seen from inside the compute's layer
//!   hook, through the mover's queue), and the stage's write-done report leaves
//!   only after its last part completed.

mod common;
mod plan_case;

use common::Shape;
use handoff::check::oracle::{self, Memory, OracleRequest, Placement};
use handoff::engine::compute::{ModelCompute, layouts_of};
use handoff::engine::{Engine, QueueMover};
use handoff_components::Topology;
use handoff_components::ecs::{EngineEvent, Inputs, Submit};
use handoff_components::layout::{ConsumerLayout, ProducerLayout, RegionLayout};
use handoff_components::plan::Plan;
use handoff_components::vocab::{DecodeRank, LayerMark, ModuleLayer, PrefillRank, RankId, RegionKind};
use handoff_kernels::CpuBackend;
use handoff_systems::dispatch::{Compute, ComputeError, DecodeItem, DecodeOutput, LayerHook, PrefillJob, PrefillOutput};
use handoff_systems::placement::{Capacity, blocks_for, owned_tokens, place_rank};
use plan_case::Case;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

const REQ: u64 = 7;

/// One request's layouts on every rank; `scatter` reverses the consumers'
/// blocks (so that token rows go through staged groups) and shifts the
/// producers'.
fn case(topo: Topology, tokens: u64, scatter: bool) -> Case {
    let (p, d) = (topo.prefill(), topo.decode());
    let pn = blocks_for(tokens, p.block_size) as u32;
    let producers = (0..p.pp)
        .flat_map(|pp| (0..p.tp).map(move |tp| PrefillRank { pp, tp }))
        .map(|rank| ProducerLayout {
            rank,
            blocks: if scatter { (0..pn).map(|b| 2 * b + 1).collect() } else { (0..pn).collect() },
            slot: 1,
            layout: place_rank(&topo, RankId::Prefill(rank), 2 * pn + 2, 2),
        })
        .collect();
    let consumers = (0..d.tp)
        .map(|tp| {
            let rank = DecodeRank { tp };
            let n = blocks_for(owned_tokens(tokens, d.dcp, rank.dcp_rank(d.dcp), d.interleave), d.block_size) as u32;
            ConsumerLayout {
                rank,
                tp: d.tp,
                dcp: d.dcp,
                interleave: d.interleave,
                blocks: if scatter { (0..n).rev().collect() } else { (0..n).collect() },
                slot: 0,
                layout: place_rank(&topo, RankId::Decode(rank), n + 1, 2),
            }
        })
        .collect();
    Case { topo, tokens, producers, consumers }
}

/// The module layer a consumer byte belongs to: the row whose unit (block or
/// slot) holds it.
fn layer_of(r: &RegionLayout, x: u64) -> Option<ModuleLayer> {
    r.rows.iter().find_map(|row| {
        let d = x.checked_sub(row.offset)?;
        (d / r.unit_stride < u64::from(r.units) && d % r.unit_stride < r.unit_bytes).then_some(row.layer)
    })
}

/// The parts of `plans` whose layer is at most `upto`, as plans of their own.
fn parts_upto(plans: &[Plan], upto: ModuleLayer) -> Vec<Plan> {
    plans.iter().flat_map(|p| (0..p.parts()).filter(|&i| p.part_layer(i).is_some_and(|l| l <= upto)).map(|i| p.part(i))).collect()
}

/// Checks the layered plans of `c`: the parts' layers rise; every prefix of
/// layers lands exactly those layers' bytes of the whole hand-off (the rest
/// stays canary); the whole plans land every byte under the oracle and write
/// what the plain plans write. Returns the number of parts.
fn check_layered(c: &Case, staging: Option<u64>) -> Result<usize, String> {
    let layered = plan_case::plans(c, |p| p.layered(true).staging(staging));
    let plain = plan_case::plans(c, |p| p.staging(staging));
    let mut parts = 0;
    for p in &layered {
        if p.layers.is_empty() && p.bytes() > 0 {
            return Err(format!("{:?} -> {:?}: a plan of {} bytes has no layer parts", p.producer, p.consumer, p.bytes()));
        }
        if p.layers.windows(2).any(|w| w[0].layer >= w[1].layer) {
            return Err(format!("{:?} -> {:?}: parts not in rising layer order: {:?}", p.producer, p.consumer, p.layers));
        }
        let total: u64 = (0..p.parts()).map(|i| p.part(i).bytes()).sum();
        // A plan with nothing for its consumer (a DCP rank that owns no token
        // of a short prompt, rows only) is one empty part, as a plain plan is.
        if total != p.bytes() || (!p.layers.is_empty() && (0..p.parts()).any(|i| p.part(i).writes() == 0)) {
            return Err(format!("{:?} -> {:?}: parts write {total} of {} bytes, or a part is empty", p.producer, p.consumer, p.bytes()));
        }
        parts += p.parts();
    }
    let (got, want): (u64, u64) = (layered.iter().map(Plan::bytes).sum(), plain.iter().map(Plan::bytes).sum());
    if got != want {
        return Err(format!("layered plans write {got} bytes, the plain ones {want}"));
    }
    // The whole layered hand-off, judged by the oracle from the rules alone.
    let mut full = plan_case::memory(c, REQ);
    oracle::execute_counted(&layered, &mut full).map_err(|e| format!("all parts: {e}"))?;
    for con in &c.consumers {
        for r in &con.layout.regions {
            let at = Placement { blocks: &con.blocks, slot: con.slot };
            let reqs = vec![(OracleRequest { id: REQ, tokens: c.tokens }, at)];
            oracle::check_consumer(&c.topo, con.rank, r.kind, r.units, &reqs, &full[&(RankId::Decode(con.rank), r.kind)])
                .map_err(|e| format!("all parts: {e}"))?;
        }
    }
    // Every prefix of layers: exactly those layers' bytes, the rest untouched.
    let fresh = plan_case::memory(c, REQ);
    for upto in 0..c.topo.config.model.num_layers {
        let upto = ModuleLayer(upto);
        let mut mem: Memory = plan_case::memory(c, REQ);
        oracle::execute_counted(&parts_upto(&layered, upto), &mut mem).map_err(|e| format!("parts to {upto}: {e}"))?;
        for con in &c.consumers {
            for r in &con.layout.regions {
                let key = (RankId::Decode(con.rank), r.kind);
                let (got, whole, canary) = (&mem[&key], &full[&key], &fresh[&key]);
                for x in 0..r.len {
                    let done = layer_of(r, x).is_some_and(|l| l <= upto);
                    let want = if done { whole[x as usize] } else { canary[x as usize] };
                    if got[x as usize] != want {
                        return Err(format!(
                            "parts to {upto}: decode tp{} {} byte {x} ({:?}) is {:#04x}, want {:#04x} ({})",
                            con.rank.tp,
                            r.kind,
                            layer_of(r, x),
                            got[x as usize],
                            want,
                            if done { "its layer is written" } else { "its layer is not, so canary" }
                        ));
                    }
                }
            }
        }
    }
    Ok(parts)
}

#[test]
fn a_layered_plan_lands_layer_by_layer_and_every_byte_under_the_oracle() {
    // The served default's shape (PP2 -> TP2 x DCP2, replay), and a PP2 x TP2 ->
    // TP4 x DCP2 one with interleave 2 and other block sizes.
    for shape in [
        Shape { pp: 2, dtp: 2, dcp: 2, pbs: 16, dbs: 16, replay: Some(8), ..Default::default() },
        Shape { pp: 2, ptp: 2, dtp: 4, dcp: 2, interleave: 2, pbs: 4, dbs: 8, replay: Some(2), ..Default::default() },
    ] {
        for (scatter, staging) in [(false, None), (true, None), (true, Some(256))] {
            let c = case(shape.topology(), 77, scatter);
            let n = check_layered(&c, staging).unwrap_or_else(|e| panic!("{shape:?} scatter {scatter} staging {staging:?}: {e}"));
            // Every layer of the 8 is a part of some plan.
            assert!(n >= 8, "{n} parts");
            if staging.is_some() {
                let staged: usize = plan_case::plans(&c, |p| p.layered(true).staging(staging)).iter().map(|p| p.staged.len()).sum();
                assert!(staged > 0, "scattered blocks with staging planned no staged group");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Invariant: for any valid topology and prompt length, blocks in order or
    /// scattered, with or without staging, every prefix of a layered plan's
    /// layers lands exactly those layers' bytes of the hand-off, and the whole
    /// plan every byte, written once, as much as the plain plan writes.
    #[test]
    fn every_prefix_of_layers_is_exact(pp in 1u32..=2, ptp_i in 0usize..2, dtp_i in 0usize..3, dcp_i in 0usize..3, il_i in 0usize..3, tokens in 1u64..100, scatter in any::<bool>(), staged in any::<bool>()) {
        let (ptp, dtp, dcp, interleave) = ([1, 2][ptp_i], [1, 2, 4][dtp_i], [1, 2, 4][dcp_i], [1, 2, 4][il_i]);
        prop_assume!(dtp % ptp == 0 && dtp % dcp == 0);
        let shape = Shape { pp, ptp, dtp, dcp, interleave, pbs: 4, dbs: 8, replay: Some(2), ..Default::default() };
        let r = check_layered(&case(shape.topology(), tokens, scatter), staged.then_some(128));
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

/// Each layer the compute finished, with the parts the mover held then.
type Seen = Arc<Mutex<Vec<(ModuleLayer, usize)>>>;

/// A model compute that, each time a layer is done and before the engine hears
/// of it, notes the layer and how many parts the mover holds then.
struct Watching {
    inner: Box<dyn Compute>,
    queue: QueueMover,
    seen: Seen,
}

impl Compute for Watching {
    fn prefill(&mut self, job: PrefillJob<'_>) -> Result<PrefillOutput, ComputeError> {
        self.inner.prefill(job)
    }
    fn prefill_batch(&mut self, jobs: Vec<PrefillJob<'_>>) -> Vec<Result<PrefillOutput, ComputeError>> {
        self.inner.prefill_batch(jobs)
    }
    fn prefill_streamed(&mut self, jobs: Vec<PrefillJob<'_>>, on_layer: &mut LayerHook<'_>) -> Vec<Result<PrefillOutput, ComputeError>> {
        let (queue, seen) = (self.queue.clone(), Arc::clone(&self.seen));
        let takes_marks = on_layer.takes_marks;
        let mut hook = |layer: ModuleLayer, mark: Option<LayerMark>| {
            let held = queue.inner.lock().unwrap().submitted.len();
            seen.lock().unwrap().push((layer, held));
            on_layer.layer_done(layer, mark);
        };
        self.inner.prefill_streamed(jobs, &mut LayerHook { takes_marks, on_layer: &mut hook })
    }
    fn decode(&mut self, batch: &[DecodeItem<'_>]) -> Result<DecodeOutput, ComputeError> {
        self.inner.decode(batch)
    }
}

/// An engine of every rank of `topo` with the CPU model over host regions, its
/// mover a queue the test completes, and what the compute saw.
fn engine(topo: &Topology, prompts: u32, tokens: u64) -> (Engine, QueueMover, Seen) {
    let queue = QueueMover::default();
    let mut engine = Engine::new(topo.clone(), Capacity::for_requests(topo, prompts, tokens + 8), Box::new(queue.clone()));
    let regions = engine.regions();
    let host: BTreeMap<(RankId, RegionKind), Vec<u8>> = regions.iter().map(|r| ((r.rank, r.layout.kind), vec![0u8; r.layout.len as usize])).collect();
    let model = ModelCompute::new(topo, CpuBackend::new(), layouts_of(&regions), Arc::new(Mutex::new(host))).expect("model");
    let seen = Arc::default();
    engine.set_compute(Box::new(Watching { inner: Box::new(model), queue: queue.clone(), seen: Arc::clone(&seen) }));
    (engine, queue, seen)
}

fn small(extra: &str) -> Topology {
    let text = include_str!("../config/small.toml").replace("[prefill]\n", &format!("[prefill]\n{extra}"));
    Topology::parse(&text).expect("small")
}

fn submit(engine: &mut Engine, id: u64, prompt: &[u8]) {
    engine.submit_request(Submit {
        id,
        tokens: prompt.len() as u64,
        inputs: Inputs { prompt: prompt.to_vec(), hidden: None },
        max_tokens: 4,
        ..Default::default()
    });
}

/// The stage's parts whose layer lies below `layer`, over `plans`.
fn parts_below(plans: &[Plan], stage: u32, layer: ModuleLayer) -> usize {
    plans.iter().filter(|p| p.producer.pp == stage).map(|p| (0..p.parts()).filter(|&i| p.part_layer(i).is_some_and(|l| l < layer)).count()).sum()
}

#[test]
fn a_stage_issues_each_layers_writes_before_its_next_layers_compute() {
    let topo = small("");
    assert!(topo.prefill().streams_layers(), "streaming is on by default");
    let (mut engine, queue, seen) = engine(&topo, 2, 64);
    submit(&mut engine, 1, b"layer by layer, the rows leave while the rest computes");
    submit(&mut engine, 2, b"a second prompt in the same batch");
    // One tick admits, places, plans and runs stage 0 (its 4 layers).
    engine.tick();
    let plans: Vec<Plan> = [1, 2].iter().flat_map(|&id| engine.plans(id)).collect();
    assert!(plans.iter().all(|p| !p.layers.is_empty()), "the plans are layered");
    let stage0 = topo.stage_layers[0].clone();
    let log = seen.lock().unwrap().clone();
    let layers: Vec<ModuleLayer> = log.iter().map(|&(l, _)| l).collect();
    assert_eq!(layers, stage0.clone().map(ModuleLayer).collect::<Vec<_>>(), "the compute called the hook once a layer, in order");
    // When layer L was done (before the engine heard of it), the mover held the
    // parts of every earlier layer of both requests: issued while layers
    // computed, not after the stage.
    for &(layer, held) in &log {
        assert_eq!(held, parts_below(&plans, 0, layer), "parts with the mover when {layer} was done");
    }
    let last = ModuleLayer(stage0.end - 1);
    assert!(parts_below(&plans, 0, last) > 0, "the plans have parts before the last layer");
    // After the tick every part of stage 0 is with the mover, and nothing of stage 1.
    let submitted = queue.take_submitted();
    let stage0_parts: usize = plans.iter().filter(|p| p.producer.pp == 0).map(Plan::parts).sum();
    assert_eq!(submitted.len(), stage0_parts);
    assert!(submitted.iter().all(|(t, _)| t.producer.pp == 0));

    // The write-done report waits for every part: complete all but one part of
    // one plan, and stage 0 reports nothing.
    let first = engine.plans(1).into_iter().find(|p| p.producer.pp == 0).expect("a plan of stage 0");
    let (held_back, rest): (Vec<_>, Vec<_>) = submitted
        .into_iter()
        .partition(|(t, _)| t.request == 1 && t.producer == first.producer && t.consumer == first.consumer && t.part as usize + 1 == first.parts());
    assert_eq!(held_back.len(), 1, "the last part of request 1's first plan of stage 0");
    for (t, _) in &rest {
        queue.complete(*t, Ok(()));
    }
    engine.tick();
    let written = |evs: &[EngineEvent], id: u64| evs.iter().any(|e| matches!(e, EngineEvent::Written(r) if r.request == id && r.stage == 0));
    let evs = engine.take_events();
    assert!(!written(&evs, 1), "stage 0 reported request 1 with a part still in flight");
    assert!(written(&evs, 2), "stage 0 reported request 2, all of whose parts completed");
    queue.complete(held_back[0].0, Ok(()));
    engine.tick();
    let evs = engine.take_events();
    let report = evs.iter().find_map(|e| match e {
        EngineEvent::Written(r) if r.request == 1 && r.stage == 0 => Some(r.clone()),
        _ => None,
    });
    let report = report.expect("stage 0's report once its last part completed");
    assert!(report.tail_us.is_some(), "the report carries the stage's hand-off tail");
    assert!(report.compute_us.is_some(), "and the stage's compute time, which the tail is set against");
}

#[test]
fn without_streaming_a_stage_writes_after_its_last_layer() {
    let topo = small("layer_streaming = false\n");
    assert!(!topo.prefill().streams_layers());
    let (mut engine, queue, seen) = engine(&topo, 1, 64);
    submit(&mut engine, 1, b"the whole stage first, then its writes");
    engine.tick();
    // The compute was run without a hook, and the plans are whole.
    assert!(seen.lock().unwrap().is_empty(), "no layer hook without streaming");
    let plans = engine.plans(1);
    assert!(plans.iter().all(|p| p.layers.is_empty()));
    assert!(queue.take_submitted().is_empty(), "nothing is written during the pass");
    engine.tick();
    assert_eq!(queue.take_submitted().len(), plans.iter().filter(|p| p.producer.pp == 0).count(), "the next tick writes stage 0's plans whole");
}
