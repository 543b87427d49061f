//! Everything a request holds is in its engine's World, so the engine's counts
//! (the `/metrics` gauges) see it and come back to their baseline after faults:
//! a request's sampling is a component the dispatch phase reads, decode's
//! handling of a stage that went down and a prefill stage's settles are release
//! systems, and decode takes the stages' notices in its transfer phase.

mod common;
use common::Shape;
use handoff::engine::{Counts, Engine, EngineRole, NoMover, QueueMover};
use handoff_components::ecs::{Cancel, EngineEvent, Inputs, Outcome, PhaseName, Settle, StageDown, StageNotice, StageReport, Status, Submit};
use handoff_components::layout::ConsumerLayout;
use handoff_components::sampling::Sampling;
use handoff_components::vocab::{DecodeRank, PrefillRank};
use handoff_components::{Cause, Failure, PeerLoss, ProcessRole};
use handoff_systems::dispatch::{Compute, ComputeError, DecodeItem, DecodeOutput, PrefillJob, PrefillOutput};
use handoff_systems::placement::Capacity;
use handoff_systems::sampling::{argmax, pick};
use handoff_systems::transfer::NoticeSource;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The counts that must come back once every request has left.
fn held(c: &Counts) -> (u32, u32, u32, u32, u64, u64, u32, u32) {
    let entries: u32 = c.producer_entries.iter().map(|&(_, n)| n).sum();
    (c.entities, c.requests, entries, c.plans, c.free_blocks, c.free_slots, c.sampling, c.settled)
}

/// The logits a fake model gives request `r` at position `pos`.
fn logits(r: u64, pos: u64) -> Vec<f32> {
    (0..256u64).map(|i| ((i * 37 + r * 11 + pos * 5) % 101) as f32 / 25.0).collect()
}

/// A compute whose logits are [`logits`], returning them only when asked, and
/// logging who asked.
struct Fake {
    asked: Arc<Mutex<Vec<(u64, u64)>>>,
    batches: Arc<Mutex<Vec<usize>>>,
}

impl Compute for Fake {
    fn prefill(&mut self, job: PrefillJob<'_>) -> Result<PrefillOutput, ComputeError> {
        let mut v = self.prefill_batch(vec![job]);
        v.pop().unwrap_or(Err(ComputeError::MissingInput { stage: 0, what: "an output" }))
    }
    fn prefill_batch(&mut self, jobs: Vec<PrefillJob<'_>>) -> Vec<Result<PrefillOutput, ComputeError>> {
        self.batches.lock().unwrap().push(jobs.len());
        jobs.iter()
            .map(|j| {
                let l = logits(j.request, j.tokens - 1);
                if j.logits {
                    self.asked.lock().unwrap().push((j.request, j.tokens - 1));
                }
                Ok(PrefillOutput { hidden: Vec::new(), first_token: Some(argmax(&l)), logits: j.logits.then_some(l) })
            })
            .collect()
    }
    fn decode(&mut self, batch: &[DecodeItem<'_>]) -> Result<DecodeOutput, ComputeError> {
        let mut out = DecodeOutput::default();
        for i in batch {
            let l = logits(i.request, i.pos);
            out.tokens.push(argmax(&l));
            if i.logits {
                self.asked.lock().unwrap().push((i.request, i.pos));
            }
            out.logits.push(i.logits.then_some(l));
        }
        Ok(out)
    }
}

/// A sampled request's tokens are the sampler's picks from its own logits, in
/// the dispatch phase (token 0 at the prompt's last position, token k at step
/// k), in a batch with greedy requests that keep the model's pick; only the
/// sampled request's logits leave the compute, and its sampling state is
/// counted while it lives and gone with it.
#[test]
fn sampling_lives_on_the_request_and_the_dispatch_phase_picks_from_its_logits() {
    const TOKENS: u64 = 6;
    const MAX: u32 = 8;
    let topo = Shape::default().topology();
    let cap = Capacity::for_requests(&topo, 3, TOKENS + u64::from(MAX));
    let mover = QueueMover::default();
    let mut e = Engine::new(topo, cap, Box::new(mover.clone()));
    let (asked, batches) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
    e.set_compute(Box::new(Fake { asked: asked.clone(), batches: batches.clone() }));
    e.tick();
    let baseline = held(&e.counts());
    let hot = Sampling { temperature: 5.0, top_p: 0.95, seed: 17, choice: 1 };
    let sampling = |id| match id {
        2 => Some(hot),
        // Greedy parameters carry no state.
        3 => Some(Sampling { temperature: 0.0, seed: 9, ..hot }),
        _ => None,
    };
    for id in 1..=3 {
        let prompt = vec![b'a'; TOKENS as usize];
        e.submit_request(Submit { id, tokens: TOKENS, max_tokens: MAX, inputs: Inputs { prompt, hidden: None }, sampling: sampling(id), ..Default::default() });
    }
    let mut tokens: std::collections::BTreeMap<u64, Vec<u8>> = Default::default();
    let mut live_sampling = 0;
    for _ in 0..40 {
        e.tick();
        for (t, _) in mover.take_submitted() {
            mover.complete(t, Ok(()));
        }
        for ev in e.take_events() {
            if let EngineEvent::Token { request, index, token } = ev {
                let v = tokens.entry(request).or_default();
                assert_eq!(v.len() as u32, index, "request {request}: tokens in order");
                v.push(token);
            }
        }
        assert!(e.take_outcomes().iter().all(|o| o.result.is_ok()));
        live_sampling = live_sampling.max(e.counts().sampling);
    }
    assert_eq!(*batches.lock().unwrap(), vec![3], "the three prompts reached the model as one batch");
    assert_eq!(live_sampling, 1, "one request samples, and its sampling is counted while it lives");
    let greedy = |r: u64| -> Vec<u8> { (0..u64::from(MAX)).map(|k| argmax(&logits(r, TOKENS - 1 + k))).collect() };
    let sampled: Vec<u8> = (0..MAX).map(|k| pick(&logits(2, TOKENS - 1 + u64::from(k)), &hot, k)).collect();
    assert_eq!(tokens[&1], greedy(1));
    assert_eq!(tokens[&3], greedy(3));
    assert_eq!(tokens[&2], sampled, "the sampled request's tokens are the sampler's picks of each step");
    assert_ne!(tokens[&2], greedy(2), "sampling at this temperature should leave the greedy path");
    let want: Vec<(u64, u64)> = (0..u64::from(MAX)).map(|k| (2, TOKENS - 1 + k)).collect();
    assert_eq!(*asked.lock().unwrap(), want, "only the sampled request's logits were asked for, once a step");
    assert_eq!(held(&e.counts()), baseline, "counts back at baseline");
}

/// Notices as a test hands them to decode's transfer phase.
#[derive(Clone, Default)]
struct Inbox(Arc<Mutex<Vec<StageNotice>>>);

impl NoticeSource for Inbox {
    fn poll(&mut self, out: &mut Vec<StageNotice>) {
        out.append(&mut self.0.lock().unwrap());
    }
}

/// Decode's orphan handling as a release system: a dead stage fails every
/// request still waiting for its writes (but not one admitted in the same
/// tick), the client hears at once, the later stages' unreported requests are
/// named as orphans, and once those stages settle (their failure notices,
/// polled in the transfer phase) everything is freed: the counts, sampling
/// included, are back at baseline.
#[test]
fn a_dead_stage_fails_its_waiting_requests_names_the_orphans_and_counts_return_to_baseline() {
    let topo = Shape { pp: 3, dtp: 2, ..Default::default() }.topology();
    let cap = Capacity::for_requests(&topo, 3, 8);
    let mut e = Engine::for_role(topo, EngineRole::Decode, cap, Box::new(NoMover));
    let inbox = Inbox::default();
    e.set_notices(Box::new(inbox.clone()));
    e.tick();
    let baseline = held(&e.counts());
    let hot = Sampling { temperature: 0.8, ..Sampling::default() };
    for id in [1, 2] {
        e.submit_request(Submit { id, tokens: 8, max_tokens: 4, sampling: Some(hot), ..Default::default() });
    }
    e.tick();
    assert_eq!(e.counts().sampling, 2);
    let nonce = |e: &Engine, id| e.nonce(id).expect("placed");
    // Stage 2 has written request 2 into both decode ranks.
    let pairs = (0..2).map(|tp| (PrefillRank { pp: 2, tp: 0 }, DecodeRank { tp })).collect();
    inbox.0.lock().unwrap().push(StageNotice::Written(StageReport {
        request: 2,
        nonce: nonce(&e, 2),
        stage: 2,
        pairs,
        first_token: None,
        bytes: 64,
        tail_us: None,
        compute_us: None,
    }));
    e.tick();
    let _ = e.take_events();
    // Stage 0 dies as request 3 is admitted.
    e.submit_request(Submit { id: 3, tokens: 8, max_tokens: 4, ..Default::default() });
    e.stage_down(StageDown { stage: 0, dead: true, detail: "pid 7: exited".into() });
    e.tick();
    let (mut failing, mut orphans) = (Vec::new(), Vec::new());
    for ev in e.take_events() {
        match ev {
            EngineEvent::Failing { request, failure } => {
                assert_eq!(failure.role, ProcessRole::Prefill { stage: 0 });
                assert!(matches!(failure.cause, Cause::PeerDown { loss: PeerLoss::Dead, .. }), "{failure:?}");
                failing.push(request);
            }
            EngineEvent::Orphaned { stage, requests, .. } => orphans.push((stage, requests.into_iter().map(|(id, _)| id).collect::<Vec<_>>())),
            _ => {}
        }
    }
    assert_eq!(failing, vec![1, 2], "the requests waiting for stage 0 fail at once; request 3 came after the news");
    orphans.sort();
    assert_eq!(orphans, vec![(1, vec![1, 2]), (2, vec![1])], "the later stages' unreported requests are orphans");
    assert!(matches!(e.status(3), Some(Status::Placed | Status::Planned)), "{:?}", e.status(3));
    // Failed, but held while stages 1 and 2 may still write.
    assert_eq!(e.live_requests(), 3);
    assert_eq!(e.counts().sampling, 2, "sampling state goes with its request, not before");
    // The later stages settle them: their failure notices.
    let settled = |stage, request, nonce| StageNotice::Failed {
        request,
        nonce: Some(nonce),
        stage,
        failure: Failure::new(PhaseName::Compute, ProcessRole::Prefill { stage: 0 }, Cause::PeerDown { loss: PeerLoss::Dead, detail: "settled".into() }),
    };
    let (n1, n2) = (nonce(&e, 1), nonce(&e, 2));
    inbox.0.lock().unwrap().extend([settled(1, 1, n1), settled(2, 1, n1), settled(1, 2, n2)]);
    let unsent = Failure::new(PhaseName::Admission, ProcessRole::Proxy, Cause::Cancelled { detail: "client gone".into() });
    e.cancel(Cancel { request: 3, failure: unsent, stage: None, nonce: None, unsent: true });
    e.tick();
    let mut failed: Vec<u64> = e.take_outcomes().into_iter().filter(|o: &Outcome| o.result.is_err()).map(|o| o.request).collect();
    failed.sort();
    assert_eq!(failed, vec![1, 2, 3]);
    e.tick();
    assert_eq!(held(&e.counts()), baseline, "counts back at baseline");
}

/// A prefill stage's settles as a release system: a settled request the stage
/// holds fails; one it never got is remembered (counted as `settled`), decode
/// is told at once, and its job is dropped when it still comes; the memory is
/// forgotten after `Settled::keep`, and the counts are back at baseline.
#[test]
fn a_stage_settles_what_it_never_got_drops_the_late_job_and_forgets_it() {
    let topo = Shape { pp: 2, dtp: 2, ..Default::default() }.topology();
    let cap = Capacity::for_requests(&topo, 3, 8);
    // Decode's World publishes the layouts the stage plans against.
    let mut decode = Engine::for_role(topo.clone(), EngineRole::Decode, cap, Box::new(NoMover));
    for id in 1..=3 {
        decode.submit(id, 8);
    }
    decode.tick();
    let published: std::collections::BTreeMap<u64, (u64, Vec<ConsumerLayout>)> = decode
        .take_events()
        .into_iter()
        .filter_map(|ev| match ev {
            EngineEvent::Published { request, nonce, consumers } => Some((request, (nonce, consumers))),
            _ => None,
        })
        .collect();
    assert_eq!(published.len(), 3);
    let mover = QueueMover::default();
    let mut e = Engine::for_role(topo, EngineRole::Stage(1), cap, Box::new(mover));
    e.tick();
    let baseline = held(&e.counts());
    let job = |id: u64| {
        let (nonce, consumers) = published[&id].clone();
        let sampling = Some(Sampling { temperature: 1.0, ..Sampling::default() });
        Submit { id, tokens: 8, nonce: Some(nonce), consumers, inputs: Inputs { prompt: Vec::new(), hidden: None }, sampling, ..Default::default() }
    };
    e.submit_request(job(1));
    e.tick();
    assert_eq!((e.live_requests(), e.counts().sampling), (1, 1));
    let failure = Failure::new(PhaseName::Compute, ProcessRole::Prefill { stage: 0 }, Cause::PeerDown { loss: PeerLoss::Dead, detail: "pid 9: exited".into() });
    let nonce = |id: u64| published[&id].0;
    e.settle(Settle { requests: vec![(1, nonce(1)), (2, nonce(2))], failure: failure.clone() });
    e.tick();
    let settled: Vec<u64> = e
        .take_events()
        .into_iter()
        .filter_map(|ev| match ev {
            EngineEvent::Settled { request, nonce: n, failure: f } => {
                assert_eq!((n, &f), (nonce(request), &failure));
                Some(request)
            }
            _ => None,
        })
        .collect();
    assert_eq!(settled, vec![2], "decode hears at once of the request the stage never got");
    let failed: Vec<(u64, Failure)> = e.take_outcomes().into_iter().filter_map(|o| o.result.err().map(|f| (o.request, f))).collect();
    assert_eq!(failed, vec![(1, failure.clone())], "the held request fails with the earlier stage's failure");
    assert_eq!(e.counts().settled, 1);
    // The late job of the settled request is dropped; another request's is not.
    e.submit_request(job(2));
    e.submit_request(job(3));
    e.tick();
    assert_eq!(e.status(2), None, "the settled request's late job is dropped");
    assert!(e.take_outcomes().is_empty(), "dropped without a second word to decode");
    assert!(e.status(3).is_some());
    let cancel = Cancel { request: 3, failure: failure.clone(), stage: None, nonce: Some(nonce(3)), unsent: false };
    e.cancel(cancel);
    e.tick();
    // Forgotten after the keep.
    e.set_settle_keep(Duration::from_millis(30));
    std::thread::sleep(Duration::from_millis(40));
    e.tick();
    assert_eq!(held(&e.counts()), baseline, "counts back at baseline");
}
