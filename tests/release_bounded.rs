//! Release frees every per-request entity, block and slot, and the completion
//! protocol ignores duplicate, late and wrong-nonce reports.

mod common;
use common::Shape;
use handoff::engine::{Engine, QueueMover};
use handoff_components::ecs::{Status, WriteDone};
use handoff_components::plan::Plan;
use handoff_systems::placement::Capacity;
use handoff_systems::transfer::Ticket;

fn engine(shape: &Shape, requests: u32, tokens: u64) -> (Engine, QueueMover) {
    let topo = shape.topology();
    let cap = Capacity::for_requests(&topo, requests, tokens);
    let mover = QueueMover::default();
    let mut e = Engine::new(topo, cap, Box::new(mover.clone()));
    e.tick();
    (e, mover)
}

fn free_counts(e: &Engine) -> Vec<(u64, usize)> {
    e.pools().0.values().map(|p| (p.free_block_count(), p.free_slots.len())).collect()
}

/// Runs requests to the end in waves; entity count, pools and producer entries
/// return to their baseline after each wave.
#[test]
fn release_returns_entities_blocks_and_slots_to_baseline() {
    let shape = Shape { pp: 3, ptp: 2, dtp: 4, dcp: 2, replay: Some(2), ..Default::default() };
    let (mut e, mover) = engine(&shape, 4, 20);
    let baseline = e.entity_count();
    let pools = free_counts(&e);
    let mut id = 0;
    for wave in 0..50 {
        let ids: Vec<u64> = (0..4)
            .map(|_| {
                id += 1;
                id
            })
            .collect();
        for &i in &ids {
            e.submit(i, 1 + (i * 7) % 20);
        }
        e.tick();
        for &i in &ids {
            for s in 0..3 {
                e.mark_computed(i, s);
            }
        }
        e.tick();
        assert!(e.entity_count() > baseline, "wave {wave}: requests hold entities while in flight");
        for (t, _) in mover.take_submitted() {
            mover.complete(t, Ok(()));
        }
        e.tick();
        assert_eq!(e.producer_entries(), vec![0, 0, 0], "wave {wave}: every stage dropped its entries");
        for &i in &ids {
            assert_eq!(e.status(i), Some(Status::HandedOff));
            e.finish(i);
        }
        e.tick();
        assert_eq!(e.entity_count(), baseline, "wave {wave}");
        assert_eq!(free_counts(&e), pools, "wave {wave}");
    }
}

/// A stage whose writes completed drops its producer entry even while another
/// stage is still writing (no stage waits for stage 0).
#[test]
fn each_stage_drops_its_entry_when_its_own_writes_complete() {
    let shape = Shape { pp: 2, dtp: 2, ..Default::default() };
    let (mut e, mover) = engine(&shape, 1, 8);
    e.submit(7, 8);
    e.tick();
    e.mark_computed(7, 1);
    e.tick();
    let sub = mover.take_submitted();
    assert!(sub.iter().all(|(t, _)| t.producer.pp == 1), "only stage 1 computed");
    for (t, _) in sub {
        mover.complete(t, Ok(()));
    }
    e.tick();
    assert_eq!(e.producer_entries(), vec![1, 0], "stage 1 dropped its entry, stage 0 still writing");
    assert_eq!(e.status(7), Some(Status::Planned));
    e.mark_computed(7, 0);
    e.tick();
    for (t, _) in mover.take_submitted() {
        mover.complete(t, Ok(()));
    }
    e.tick();
    assert_eq!(e.producer_entries(), vec![0, 0]);
    assert_eq!(e.status(7), Some(Status::HandedOff));
}

/// Submitted tickets grouped by plan (producer, consumer), each plan's parts in
/// order (a layered plan is submitted a part a layer).
fn by_plan(sub: Vec<(Ticket, Plan)>) -> Vec<Vec<Ticket>> {
    let mut out: Vec<Vec<Ticket>> = Vec::new();
    for (t, _) in sub {
        match out.iter_mut().find(|v| v[0].producer == t.producer && v[0].consumer == t.consumer) {
            Some(v) => v.push(t),
            None => out.push(vec![t]),
        }
    }
    out
}

/// Duplicate and wrong-nonce reports are counted and ignored; a consumer completes
/// only when every stage has reported.
#[test]
fn duplicate_and_wrong_nonce_reports_are_ignored_and_counted() {
    let shape = Shape { pp: 2, dtp: 1, ..Default::default() };
    let (mut e, mover) = engine(&shape, 1, 8);
    e.submit(9, 8);
    e.tick();
    e.mark_computed(9, 0);
    e.mark_computed(9, 1);
    e.tick();
    // One plan a stage (each in layer parts): a ticket of each.
    let sub = by_plan(mover.take_submitted());
    assert_eq!(sub.len(), 2);
    let (t0, t1) = (sub[0][0], sub[1][0]);
    // Wrong nonce for stage 0's writes.
    e.deliver_report(WriteDone { request: 9, nonce: t0.nonce ^ 1, producer: t0.producer, consumer: t0.consumer });
    e.tick();
    assert_eq!(e.report_stats().wrong_nonce, 1);
    assert_eq!(e.status(9), Some(Status::Planned));
    // Stage 0 twice: the second is a duplicate; still not complete without stage 1.
    e.deliver_report(WriteDone { request: 9, nonce: t0.nonce, producer: t0.producer, consumer: t0.consumer });
    e.deliver_report(WriteDone { request: 9, nonce: t0.nonce, producer: t0.producer, consumer: t0.consumer });
    e.tick();
    let s = e.report_stats();
    assert_eq!((s.accepted, s.duplicate), (1, 1));
    assert_eq!(e.status(9), Some(Status::Planned), "stage 1 has not reported");
    e.deliver_report(WriteDone { request: 9, nonce: t1.nonce, producer: t1.producer, consumer: t1.consumer });
    e.tick();
    assert_eq!(e.status(9), Some(Status::HandedOff));
    // A late report for a request that is gone counts as unknown.
    e.finish(9);
    e.tick();
    e.deliver_report(WriteDone { request: 9, nonce: t1.nonce, producer: t1.producer, consumer: t1.consumer });
    e.tick();
    assert_eq!(e.report_stats().unknown, 1);
    drop(mover);
}

/// An expired request fails naming its phase and frees what it held; a failed
/// request with a write in flight keeps its sources until the write ends.
#[test]
fn timeouts_fail_the_request_naming_the_phase_and_free_everything() {
    let t = Shape { pp: 2, dtp: 2, ..Default::default() }.toml() + "\n[timeouts]\ncompute_s = 0.05\ntransfer_s = 0.05\n";
    let topo = handoff_components::Topology::parse(&t).unwrap();
    let mover = QueueMover::default();
    let mut e = Engine::new(topo.clone(), Capacity::for_requests(&topo, 2, 8), Box::new(mover.clone()));
    e.tick();
    let baseline = e.entity_count();
    let pools = free_counts(&e);
    // Compute never finishes.
    e.submit(1, 8);
    e.tick();
    std::thread::sleep(std::time::Duration::from_millis(80));
    e.tick();
    let out = e.take_outcomes();
    let failure = out.iter().find(|o| o.request == 1).and_then(|o| o.result.clone().err()).expect("request 1 failed");
    assert_eq!(failure.phase.name(), "compute");
    // The deadline is told by its cause, and names the stages still owed.
    let handoff_components::Cause::Timeout { after, waiting_for, .. } = &failure.cause else { panic!("not a timeout: {failure:?}") };
    assert_eq!((*after, waiting_for.clone()), (std::time::Duration::from_millis(50), vec![0, 1]), "{failure}");
    assert!(failure.to_string().contains("compute phase timed out"), "{failure}");
    assert_eq!(e.entity_count(), baseline);
    assert_eq!(free_counts(&e), pools);
    // Transfer never completes: the request fails in transfer, but its sources stay
    // held while the write is in flight.
    e.submit(2, 8);
    e.tick();
    e.mark_computed(2, 0);
    e.mark_computed(2, 1);
    e.tick();
    let sub = mover.take_submitted();
    std::thread::sleep(std::time::Duration::from_millis(80));
    e.tick();
    assert!(matches!(e.status(2), Some(Status::Failed { .. })));
    assert_ne!(free_counts(&e), pools, "an in-flight write still reads the sources");
    for (t, _) in sub {
        mover.complete(t, Err(handoff_systems::transfer::MoveError::Transport(std::sync::Arc::new(std::io::Error::other("peer gone")))));
    }
    e.tick();
    let out = e.take_outcomes();
    let failure = out.iter().find(|o| o.request == 2).and_then(|o| o.result.clone().err()).expect("request 2 failed");
    assert_eq!(failure.phase.name(), "transfer");
    // The deadline failed it first; the write's own error later does not replace that.
    assert!(matches!(failure.cause, handoff_components::Cause::Timeout { .. }), "{failure:?}");
    assert_eq!(e.entity_count(), baseline);
    assert_eq!(free_counts(&e), pools);
}

/// Admission refuses what cannot be served before anything is enqueued.
#[test]
fn admission_rejects_empty_too_long_and_unservable_requests() {
    let shape = Shape { dtp: 2, dcp: 2, ..Default::default() };
    let (mut e, _m) = engine(&shape, 1, 8);
    let baseline = e.entity_count();
    e.submit(1, 0);
    e.submit(2, 1 << 40);
    e.tick();
    let out = e.take_outcomes();
    assert_eq!(out.len(), 2);
    assert!(out.iter().all(|o| matches!(&o.result, Err(f) if f.phase.name() == "admission" && matches!(f.cause, handoff_components::Cause::Refused { .. }))));
    assert!(format!("{out:?}").contains("empty prompt"));
    assert!(format!("{out:?}").contains("max_context"));
    assert_eq!(e.entity_count(), baseline);
}

/// The dispatch phase computes each stage in order, then decodes a handed-off
/// request and releases it; a compute failure fails the request naming the phase
/// and frees what it held.
#[test]
fn dispatch_phase_computes_stages_in_order_and_failures_name_the_phase() {
    use handoff_systems::dispatch::{Compute, ComputeError, DecodeItem, DecodeOutput, PrefillJob, PrefillOutput};
    use std::sync::{Arc, Mutex};
    struct Fake {
        log: Arc<Mutex<Vec<String>>>,
        fail_stage: Option<u32>,
    }
    impl Compute for Fake {
        fn prefill(&mut self, job: PrefillJob<'_>) -> Result<PrefillOutput, ComputeError> {
            self.log.lock().unwrap().push(format!("prefill {} stage {} ranks {}", job.request, job.stage, job.leases.len()));
            if self.fail_stage == Some(job.stage) {
                return Err(ComputeError::model(std::io::Error::other("out of memory")));
            }
            Ok(PrefillOutput { hidden: vec![0.0], first_token: Some(7), logits: None })
        }
        fn decode(&mut self, batch: &[DecodeItem<'_>]) -> Result<DecodeOutput, ComputeError> {
            for i in batch {
                self.log.lock().unwrap().push(format!("decode {} at {} over {} ranks", i.request, i.pos, i.leases.len()));
            }
            Ok(batch.iter().map(|_| 9).collect::<Vec<u8>>().into())
        }
    }
    for fail_stage in [None, Some(1)] {
        let shape = Shape { pp: 3, dtp: 2, ..Default::default() };
        // Room for the prompt and the two generated tokens.
        let (mut e, mover) = engine(&shape, 1, 16);
        let log = Arc::new(Mutex::new(Vec::new()));
        // Resources are entities too: count the baseline with the dispatcher in place.
        e.set_compute(Box::new(Fake { log: log.clone(), fail_stage }));
        e.tick();
        let baseline = e.entity_count();
        let pools = free_counts(&e);
        e.submit_request(handoff_components::ecs::Submit { id: 5, tokens: 8, max_tokens: 3, ..Default::default() });
        e.tick();
        let mut outcomes = e.take_outcomes();
        for _ in 0..8 {
            e.tick();
            for (t, _) in mover.take_submitted() {
                mover.complete(t, Ok(()));
            }
            outcomes.extend(e.take_outcomes());
        }
        let log = log.lock().unwrap().clone();
        match fail_stage {
            None => {
                // Each stage computes on its own rank, one stage per tick, in order;
                // decode steps the 2 generated positions after the first token over
                // both decode ranks.
                assert_eq!(
                    log,
                    vec![
                        "prefill 5 stage 0 ranks 1",
                        "prefill 5 stage 1 ranks 1",
                        "prefill 5 stage 2 ranks 1",
                        "decode 5 at 8 over 2 ranks",
                        "decode 5 at 9 over 2 ranks"
                    ]
                );
                assert!(outcomes.iter().any(|o| o.request == 5 && o.result.is_ok()), "{outcomes:?}");
            }
            Some(_) => {
                assert_eq!(log, vec!["prefill 5 stage 0 ranks 1", "prefill 5 stage 1 ranks 1"]);
                let failure = outcomes.iter().find_map(|o| o.result.clone().err()).expect("failed");
                assert_eq!(failure.phase.name(), "compute");
                assert_eq!(failure.role, handoff_components::ProcessRole::Prefill { stage: 1 });
                assert!(matches!(failure.cause, handoff_components::Cause::Compute { .. }), "{failure:?}");
                assert!(failure.to_string().contains("prefill stage 1: out of memory"), "{failure}");
            }
        }
        assert_eq!(e.entity_count(), baseline);
        assert_eq!(free_counts(&e), pools);
    }
}

/// Requests ready at the same stage run as one prefill batch; a batch that
/// fails (one pass) runs its jobs again alone, so the one bad request fails,
/// naming the phase, and the others complete; everything is freed.
#[test]
fn a_failed_prefill_batch_costs_only_its_bad_request() {
    use handoff_systems::dispatch::{Compute, ComputeError, DecodeItem, DecodeOutput, PrefillJob, PrefillOutput};
    use std::sync::{Arc, Mutex};
    const BAD: u64 = 2;
    struct Fake {
        log: Arc<Mutex<Vec<String>>>,
    }
    impl Compute for Fake {
        fn prefill(&mut self, job: PrefillJob<'_>) -> Result<PrefillOutput, ComputeError> {
            self.log.lock().unwrap().push(format!("alone {} stage {}", job.request, job.stage));
            if job.request == BAD {
                return Err(ComputeError::model(std::io::Error::other("bad prompt")));
            }
            Ok(PrefillOutput { hidden: vec![0.0], first_token: Some(7), logits: None })
        }
        fn prefill_batch(&mut self, jobs: Vec<PrefillJob<'_>>) -> Vec<Result<PrefillOutput, ComputeError>> {
            let ids: Vec<String> = jobs.iter().map(|j| j.request.to_string()).collect();
            self.log.lock().unwrap().push(format!("batch [{}] stage {}", ids.join(" "), jobs[0].stage));
            let bad = jobs.iter().any(|j| j.request == BAD);
            jobs.iter()
                .map(|_| {
                    if bad {
                        Err(ComputeError::model(std::io::Error::other("batch failed")))
                    } else {
                        Ok(PrefillOutput { hidden: vec![0.0], first_token: Some(7), logits: None })
                    }
                })
                .collect()
        }
        fn decode(&mut self, batch: &[DecodeItem<'_>]) -> Result<DecodeOutput, ComputeError> {
            Ok(batch.iter().map(|_| 9).collect::<Vec<u8>>().into())
        }
    }
    let (mut e, mover) = engine(&Shape::default(), 3, 16);
    let log = Arc::new(Mutex::new(Vec::new()));
    e.set_compute(Box::new(Fake { log: log.clone() }));
    e.tick();
    let baseline = e.entity_count();
    let pools = free_counts(&e);
    for id in 1..=3 {
        e.submit_request(handoff_components::ecs::Submit { id, tokens: 8, max_tokens: 2, ..Default::default() });
    }
    let mut outcomes = Vec::new();
    for _ in 0..12 {
        e.tick();
        for (t, _) in mover.take_submitted() {
            mover.complete(t, Ok(()));
        }
        outcomes.extend(e.take_outcomes());
    }
    let log = log.lock().unwrap().clone();
    assert_eq!(log[..4], ["batch [1 2 3] stage 0", "alone 1 stage 0", "alone 2 stage 0", "alone 3 stage 0"], "{log:?}");
    assert!(log[4..].iter().all(|l| !l.contains(" 2 ") && !l.contains("[2") && !l.contains(" 2]")), "the failed request ran no further: {log:?}");
    for id in [1, 3] {
        assert!(outcomes.iter().any(|o| o.request == id && o.result.is_ok()), "request {id}: {outcomes:?}");
    }
    let failure = outcomes.iter().find(|o| o.request == BAD).and_then(|o| o.result.clone().err()).expect("request 2 failed");
    assert_eq!(failure.phase.name(), "compute");
    assert!(failure.to_string().contains("bad prompt"), "{failure}");
    assert_eq!(e.entity_count(), baseline);
    assert_eq!(free_counts(&e), pools);
}

/// A cancel names the life of the id it cancels: one carrying another nonce (an
/// earlier request that reused the id) leaves the live request alone; the right
/// nonce fails it naming the phase, and everything it held is freed.
#[test]
fn cancels_of_another_life_of_the_id_are_ignored() {
    use handoff_components::ecs::{Cancel, PhaseName};
    use handoff_components::{Cause, Failure, PeerLoss, ProcessRole};
    let (mut e, _mover) = engine(&Shape::default(), 1, 8);
    let baseline = e.entity_count();
    e.submit(3, 8);
    e.tick();
    let nonce = e.nonce(3).expect("placed");
    let died =
        |detail: &str| Failure::new(PhaseName::Compute, ProcessRole::Prefill { stage: 0 }, Cause::PeerDown { loss: PeerLoss::Dead, detail: detail.into() });
    e.cancel(Cancel { request: 3, failure: died("stale"), stage: None, nonce: Some(nonce ^ 1), unsent: false });
    e.tick();
    assert_eq!(e.status(3), Some(Status::Planned));
    e.cancel(Cancel { request: 3, failure: died("died"), stage: None, nonce: Some(nonce), unsent: false });
    e.tick();
    let failed: Vec<_> = e.take_outcomes().into_iter().filter_map(|o| o.result.err()).collect();
    assert_eq!(failed, vec![died("died")]);
    assert_eq!(e.entity_count(), baseline);
}

/// A decode World whose producers are other processes keeps a failed request's
/// blocks while a stage may still write into them (until every stage settles or
/// the phase deadline), but frees them at once when the cancel says no stage was
/// ever given the job: a decode stopped while the proxy waited for its admission
/// held such requests until the compute deadline.
#[test]
fn a_decode_frees_at_once_a_request_no_stage_was_given() {
    use handoff::engine::{EngineRole, NoMover};
    use handoff_components::ecs::{Cancel, PhaseName};
    use handoff_components::{Cause, Failure, PeerLoss};
    let topo = Shape { pp: 2, dtp: 2, ..Default::default() }.topology();
    let cap = Capacity::for_requests(&topo, 2, 8);
    let mut e = Engine::for_role(topo, EngineRole::Decode, cap, Box::new(NoMover));
    e.tick();
    let (baseline, pools) = (e.entity_count(), free_counts(&e));
    e.submit(1, 8);
    e.submit(2, 8);
    e.tick();
    for id in [1, 2] {
        assert!(matches!(e.status(id), Some(Status::Placed | Status::Planned)), "request {id} placed: {:?}", e.status(id));
    }
    assert_ne!(free_counts(&e), pools);
    let stopped = Failure::new(
        PhaseName::Admission,
        handoff_components::ProcessRole::Decode,
        Cause::PeerDown { loss: PeerLoss::Stopped, detail: "stopped answering".into() },
    );
    let cancel = |request, unsent| Cancel { request, failure: stopped.clone(), stage: None, nonce: None, unsent };
    e.cancel(cancel(1, false));
    e.cancel(cancel(2, true));
    e.tick();
    let failed: Vec<u64> = e.take_outcomes().into_iter().filter(|o| o.result.is_err()).map(|o| o.request).collect();
    assert_eq!(failed, vec![2], "only the request no stage was given is released now");
    e.tick();
    assert!(matches!(e.status(1), Some(Status::Failed { .. })), "{:?}", e.status(1));
    assert_eq!(e.live_requests(), 1, "the other waits for its stages or its deadline");
    // The same request's stages settling frees it too.
    e.cancel(Cancel { stage: Some(0), ..cancel(1, false) });
    e.cancel(Cancel { stage: Some(1), ..cancel(1, false) });
    e.tick();
    assert_eq!(e.live_requests(), 0);
    assert_eq!(e.entity_count(), baseline);
    assert_eq!(free_counts(&e), pools);
}

/// A stage's writes count as outstanding from its compute (about to be
/// submitted) through the mover (in flight) until they complete; a prefill
/// stage waits on this count after a pass.
#[test]
fn writes_are_outstanding_from_compute_until_their_completion() {
    let shape = Shape { pp: 2, dtp: 2, ..Default::default() };
    let (mut e, mover) = engine(&shape, 1, 8);
    e.submit(5, 8);
    e.tick();
    assert_eq!(e.writes_outstanding(), 0, "nothing computed yet");
    e.mark_computed(5, 0);
    let pending = e.writes_outstanding();
    assert!(pending > 0, "stage 0 computed: its plans wait to be submitted");
    e.tick();
    let sub = by_plan(mover.take_submitted());
    assert_eq!(sub.len() as u32, pending, "every outstanding write was submitted");
    assert_eq!(e.writes_outstanding(), pending, "in flight until they complete");
    let (first, rest) = sub.split_first().expect("a plan");
    // A plan is written once every one of its parts completed.
    let (last, others) = first.split_last().expect("a part");
    for t in others {
        mover.complete(*t, Ok(()));
    }
    e.tick();
    assert_eq!(e.writes_outstanding(), pending, "a part of each plan still in flight");
    mover.complete(*last, Ok(()));
    e.tick();
    assert_eq!(e.writes_outstanding(), pending - 1, "one completed");
    for t in rest.iter().flatten() {
        mover.complete(*t, Ok(()));
    }
    e.tick();
    assert_eq!(e.writes_outstanding(), 0, "stage 1 has not computed: nothing of it counts");
    assert_eq!(e.status(5), Some(Status::Planned));
}
