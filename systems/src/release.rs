//! Release: the completion protocol, producer entries, cancellations, timeouts, and
//! freeing every block, slot and entity a request held; and the faults of other
//! processes: decode fails what waits for a stage that went down and names its
//! orphans, a prefill stage settles what an earlier stage's death left to it.

use crate::placement::release_lease;
use bevy_ecs::prelude::*;
use handoff_components::ecs::*;
use handoff_components::failure::{Cause, Failure, PeerLoss, ProcessRole};
use handoff_components::vocab::RankId;
use std::time::{Duration, Instant};

/// The placed requests (id, nonce) still waiting for PP stage `stage`: published
/// but not handed off, and without that stage's report. A request admitted in
/// this tick is not one of them (`fresh`): it came in with the news of the
/// stage, and the proxy sends its job only once decode has admitted it (a job
/// that cannot reach stage 0 is cancelled there as unsent).
fn awaiting<'a>(requests: impl Iterator<Item = (&'a Request, &'a Status, &'a StagesComputed, bool)>, stage: u32) -> Vec<(u64, u64)> {
    requests
        .filter(|(_, s, c, fresh)| !fresh && matches!(s, Status::Placed | Status::Planned) && !c.0.get(stage as usize).copied().unwrap_or(true))
        .map(|(r, ..)| (r.id, r.nonce))
        .collect()
}

/// Decode's orphan handling: a stage that died or stopped answering fails every
/// request still waiting for its writes, and the client hears at once
/// (`EngineEvent::Failing`: the outcome comes only when the request is released,
/// which for a stopped stage is at the phase deadline). A dead stage writes no
/// more, so its share counts as settled and the blocks can be freed at once; a
/// stopped one may still write when it resumes, so decode keeps the blocks until
/// the phase deadline. A later stage that has not reported may never have got
/// the job (the dead stage had not passed it on), and then never reports: its
/// requests leave as `EngineEvent::Orphaned`, for the stage to settle them.
pub fn fail_stage_down(
    mut downs: MessageReader<StageDown>,
    requests: Query<(Ref<Request>, &Status, &StagesComputed)>,
    topo: Res<TopologyRes>,
    mut cancels: MessageWriter<Cancel>,
    mut events: MessageWriter<EngineEvent>,
) {
    let pp = topo.0.config.prefill.pp;
    for d in downs.read() {
        let rows = || {
            requests.iter().map(|(r, s, c)| {
                let fresh = r.is_added();
                (r.into_inner(), s, c, fresh)
            })
        };
        let waiting = awaiting(rows(), d.stage);
        let loss = if d.dead { PeerLoss::Dead } else { PeerLoss::Stopped };
        let failure = Failure::new(PhaseName::Compute, ProcessRole::Prefill { stage: d.stage }, Cause::PeerDown { loss, detail: d.detail.clone() });
        if d.dead {
            for later in d.stage + 1..pp {
                let theirs = awaiting(rows(), later);
                let orphans: Vec<(u64, u64)> = waiting.iter().filter(|r| theirs.contains(r)).copied().collect();
                if !orphans.is_empty() {
                    events.write(EngineEvent::Orphaned { stage: later, requests: orphans, failure: failure.clone() });
                }
            }
        }
        for &(request, nonce) in &waiting {
            events.write(EngineEvent::Failing { request, failure: failure.clone() });
            cancels.write(Cancel { request, failure: failure.clone(), stage: d.dead.then_some(d.stage), nonce: Some(nonce), unsent: false });
        }
    }
}

/// A prefill stage's settle handling: a settled request the World holds (this
/// life of it) is cancelled, and fails once its writes in flight complete (its
/// failure tells decode); one it does not hold is remembered in [`Settled`], so
/// that admission drops its job if it still comes, and leaves as
/// `EngineEvent::Settled` (decode is told at once). Entries older than
/// `Settled::keep` are forgotten here.
pub fn settle_requests(
    mut settles: MessageReader<Settle>,
    index: Res<RequestIndex>,
    requests: Query<&Request>,
    mut settled: ResMut<Settled>,
    mut cancels: MessageWriter<Cancel>,
    mut events: MessageWriter<EngineEvent>,
) {
    let keep = settled.keep;
    if !settled.requests.is_empty() {
        settled.requests.retain(|_, (_, at)| at.elapsed() < keep);
    }
    for s in settles.read() {
        for &(request, nonce) in &s.requests {
            let held = index.0.get(&request).and_then(|&e| requests.get(e).ok()).is_some_and(|r| r.nonce == nonce);
            if held {
                cancels.write(Cancel { request, failure: s.failure.clone(), stage: None, nonce: Some(nonce), unsent: false });
            } else {
                settled.requests.insert(request, (nonce, Instant::now()));
                events.write(EngineEvent::Settled { request, nonce, failure: s.failure.clone() });
            }
        }
    }
}

/// Turns the reports of stages in other processes into write-done reports of their
/// pairs; a report marks its stage computed and may carry the first token.
pub fn receive_reports(
    mut commands: Commands,
    mut stage_reports: MessageReader<StageReport>,
    index: Res<RequestIndex>,
    mut requests: Query<(&Request, &mut StagesComputed, Option<&mut Timing>)>,
    mut reports: MessageWriter<WriteDone>,
    mut stats: ResMut<ReportStats>,
) {
    for r in stage_reports.read() {
        let Some(&e) = index.0.get(&r.request) else {
            stats.unknown += 1;
            continue;
        };
        let Ok((req, mut computed, timing)) = requests.get_mut(e) else { continue };
        if req.nonce != r.nonce {
            stats.wrong_nonce += 1;
            continue;
        }
        if let Some(c) = computed.0.get_mut(r.stage as usize) {
            *c = true;
        }
        if let Some(mut t) = timing {
            t.bytes += r.bytes;
            if r.tail_us > t.tail_us {
                t.tail_us = r.tail_us;
                t.tail_stage_compute_us = r.compute_us;
            }
        }
        if let Some(tok) = r.first_token {
            commands.entity(e).insert(FirstToken(tok));
        }
        for &(producer, consumer) in &r.pairs {
            reports.write(WriteDone { request: r.request, nonce: r.nonce, producer, consumer });
        }
    }
}

/// Fails cancelled requests, whatever phase they are in (decoding included).
pub fn apply_cancels(mut cancels: MessageReader<Cancel>, index: Res<RequestIndex>, mut requests: Query<(&Request, &mut Status, &mut StagesComputed)>) {
    for c in cancels.read() {
        let Some(Ok((req, mut s, mut computed))) = index.0.get(&c.request).map(|&e| requests.get_mut(e)) else { continue };
        if c.nonce.is_some_and(|n| n != req.nonce) {
            continue;
        }
        if let Some(done) = c.stage.and_then(|st| computed.0.get_mut(st as usize)) {
            *done = true;
        }
        if c.unsent {
            computed.0.iter_mut().for_each(|done| *done = true);
        }
        if !matches!(*s, Status::Failed { .. } | Status::Finished) {
            *s = Status::Failed(c.failure.clone());
        }
    }
}

/// Applies write-done reports. A report counts once per (pp, tp, consumer) and only
/// with the request's current nonce; duplicates, late and wrong-nonce reports are
/// ignored and counted. A stage's producer entry is dropped as soon as its own
/// writes are all reported, whatever the other stages do, and the stage's report
/// leaves the engine then (a report is sent only after the bytes are in place).
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub fn record_reports(
    mut commands: Commands,
    mut reports: MessageReader<WriteDone>,
    index: Res<RequestIndex>,
    requests: Query<(&Request, &Holdings, Option<&FirstToken>, Option<&LastLayerAt>)>,
    mut plans: Query<&mut PlanEntry>,
    mut entries: Query<&mut ProducerEntry>,
    mut progress: Query<(&Lease, &mut ConsumerProgress)>,
    mut stats: ResMut<ReportStats>,
    mut events: MessageWriter<EngineEvent>,
    topo: Res<TopologyRes>,
) {
    for r in reports.read() {
        let Some((req, holdings, first, last_layer)) = index.0.get(&r.request).and_then(|&e| requests.get(e).ok()) else {
            stats.unknown += 1;
            continue;
        };
        if req.nonce != r.nonce {
            stats.wrong_nonce += 1;
            continue;
        }
        let from = (r.producer.pp, r.producer.tp);
        // Decode side: the consumer rank's progress.
        let mut counted = false;
        for &l in &holdings.leases {
            if let Ok((lease, mut prog)) = progress.get_mut(l)
                && lease.rank == RankId::Decode(r.consumer)
            {
                if prog.reported.contains(&from) {
                    stats.duplicate += 1;
                } else {
                    prog.reported.push(from);
                    stats.accepted += 1;
                }
                counted = true;
            }
        }
        // Producer side: the plan and the stage's producer entry.
        let plan = holdings.plans.iter().copied().find(|&p| plans.get(p).is_ok_and(|e| e.plan.producer == r.producer && e.plan.consumer == r.consumer));
        let Some(plan) = plan else {
            if !counted {
                stats.unknown += 1;
            }
            continue;
        };
        let Ok(mut entry) = plans.get_mut(plan) else { continue };
        if entry.state == WriteState::Done {
            if !counted {
                stats.duplicate += 1;
            }
            continue;
        }
        entry.state = WriteState::Done;
        if !counted {
            stats.accepted += 1;
        }
        let stage = r.producer.pp;
        let Some(pe) = holdings.entries.iter().copied().find(|&pe| entries.get(pe).is_ok_and(|x| x.stage == stage)) else { continue };
        let Ok(mut pe_entry) = entries.get_mut(pe) else { continue };
        pe_entry.pending = pe_entry.pending.saturating_sub(1);
        if pe_entry.pending > 0 {
            continue;
        }
        commands.entity(pe).try_despawn();
        let mut pairs = Vec::new();
        let mut bytes = 0;
        for &p in &holdings.plans {
            if let Ok(e) = plans.get(p)
                && e.plan.producer.pp == stage
            {
                pairs.push((e.plan.producer, e.plan.consumer));
                bytes += e.plan.bytes();
            }
        }
        let last = stage + 1 == topo.0.config.prefill.pp;
        let stage_compute = last_layer.and_then(|l| l.0.get(stage as usize).copied().flatten());
        events.write(EngineEvent::Written(StageReport {
            request: req.id,
            nonce: req.nonce,
            stage,
            pairs,
            first_token: if last { first.map(|f| f.0) } else { None },
            bytes,
            // The hand-off tail: what of the stage's writes was left when its
            // last layer was computed.
            tail_us: stage_compute.map(|c| c.last_layer.elapsed().as_micros() as u64),
            compute_us: stage_compute.map(|c| c.compute_us),
        }));
    }
}

/// A request whose local plans are all written and whose every local decode rank
/// has every expected report is handed off: its source blocks and slots go back to
/// the pools. Decode then emits the first token (from the last stage); a World
/// without decode ranks is done with the request.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub fn complete_handoffs(
    mut commands: Commands,
    mut requests: Query<(&Request, &mut Status, &mut Holdings, Option<&FirstToken>, Option<&mut DecodeProgress>, Option<&mut Timing>)>,
    leases: Query<(&Lease, Option<&ConsumerProgress>)>,
    plans: Query<&PlanEntry>,
    mut pools: ResMut<Pools>,
    mut outcomes: MessageWriter<Outcome>,
    mut events: MessageWriter<EngineEvent>,
    topo: Res<TopologyRes>,
) {
    let last_stage = topo.0.config.prefill.pp.saturating_sub(1);
    for (req, mut status, mut holdings, first, generation, timing) in requests.iter_mut() {
        if *status != Status::Planned {
            continue;
        }
        let written = holdings.plans.iter().all(|&p| plans.get(p).is_ok_and(|p| p.state == WriteState::Done));
        let reported = holdings.leases.iter().all(|&l| match leases.get(l) {
            Ok((_, Some(p))) => p.reported.len() as u32 >= p.expected,
            _ => true,
        });
        if !written || !reported {
            continue;
        }
        holdings.leases.retain(|&l| {
            let Ok((lease, _)) = leases.get(l) else { return false };
            if matches!(lease.rank, RankId::Decode(_)) {
                return true;
            }
            release_lease(&mut pools, lease);
            commands.entity(l).despawn();
            false
        });
        let Some(mut generation) = generation else {
            // No tokens to generate here: a prefill stage is done with it; a byte-level
            // check finishes it itself.
            *status = if holdings.leases.is_empty() { Status::Finished } else { Status::HandedOff };
            outcomes.write(Outcome { request: req.id, nonce: Some(req.nonce), result: Ok(()) });
            continue;
        };
        let Some(FirstToken(tok)) = first.copied() else {
            // The last stage owes the first token with its report.
            let detail = "every stage reported, but the last stage sent no first token".to_string();
            *status = Status::Failed(Failure::new(PhaseName::Transfer, ProcessRole::Prefill { stage: last_stage }, Cause::Protocol { detail }));
            continue;
        };
        *status = Status::HandedOff;
        outcomes.write(Outcome { request: req.id, nonce: Some(req.nonce), result: Ok(()) });
        if let Some(mut t) = timing {
            t.handed_off = Some(Instant::now());
        }
        generation.last = Some(tok);
        generation.emitted = 1;
        events.write(EngineEvent::Token { request: req.id, index: 0, token: tok });
        if generation.emitted >= generation.max_tokens {
            *status = Status::Finished;
        }
    }
}

/// Fails every request whose current phase has run past its deadline, naming the
/// stages it still waited for.
pub fn expire_requests(mut requests: Query<(&mut Status, &Deadline, &StagesComputed)>, topo: Res<TopologyRes>, local: Res<LocalRanks>) {
    let now = Instant::now();
    let t = &topo.0.config.timeouts;
    for (mut status, deadline, computed) in requests.iter_mut() {
        let live = matches!(*status, Status::Waiting | Status::Placed | Status::Planned);
        if live && now >= deadline.at {
            let secs = match deadline.phase {
                PhaseName::Admission => t.admission_s,
                PhaseName::Compute => t.compute_s,
                _ => t.transfer_s,
            };
            // Admission waits for blocks and slots, not for stages.
            let waiting_for = match deadline.phase {
                PhaseName::Admission => Vec::new(),
                _ => computed.0.iter().enumerate().filter(|(_, c)| !**c).map(|(s, _)| s as u32).collect(),
            };
            *status = Status::Failed(Failure::deadline(deadline.phase, local.role(), Duration::from_secs_f64(secs), waiting_for));
        }
    }
}

/// Frees everything a finished or failed request held and despawns its entities.
/// A failed request waits while any of its writes is in flight, so an abort never
/// frees a source that a write may still be reading. Where the producers are other
/// processes (decode), a failed request that published its layout keeps its blocks
/// and slots until every stage has settled (reported) or its phase deadline has
/// passed: a stage still writing must not land in blocks given to a new request.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub fn retire_requests(
    mut commands: Commands,
    requests: Query<(Entity, &Request, &Status, &Holdings, Option<&Timing>, &StagesComputed, &Deadline)>,
    leases: Query<(&Lease, Option<&ConsumerProgress>)>,
    plans: Query<&PlanEntry>,
    local: Res<LocalRanks>,
    topo: Res<TopologyRes>,
    mut pools: ResMut<Pools>,
    mut index: ResMut<RequestIndex>,
    mut outcomes: MessageWriter<Outcome>,
    mut events: MessageWriter<EngineEvent>,
) {
    let remote_producers = local.decode && (local.stages.len() as u32) < topo.0.config.prefill.pp;
    let now = Instant::now();
    for (e, req, status, holdings, timing, computed, deadline) in requests.iter() {
        match status {
            Status::Finished => {}
            Status::Failed { .. } => {
                if holdings.plans.iter().any(|&p| plans.get(p).is_ok_and(|p| p.writing())) {
                    continue;
                }
                let unreported = holdings.leases.iter().any(|&l| leases.get(l).is_ok_and(|(_, p)| p.is_some_and(|p| (p.reported.len() as u32) < p.expected)));
                if remote_producers && unreported && !computed.0.iter().all(|&c| c) && now < deadline.at {
                    continue;
                }
            }
            _ => continue,
        }
        for &l in &holdings.leases {
            if let Ok((lease, _)) = leases.get(l) {
                release_lease(&mut pools, lease);
            }
            commands.entity(l).try_despawn();
        }
        for &p in holdings.plans.iter().chain(&holdings.entries) {
            commands.entity(p).try_despawn();
        }
        commands.entity(e).despawn();
        index.0.remove(&req.id);
        match status {
            Status::Failed(failure) => {
                outcomes.write(Outcome { request: req.id, nonce: Some(req.nonce), result: Err(failure.clone()) });
            }
            _ => {
                if let Some(t) = timing {
                    let handed = t.handed_off.unwrap_or(now);
                    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
                    events.write(EngineEvent::Finished {
                        request: req.id,
                        handoff_ms: ms(handed - t.admitted),
                        decode_ms: ms(now.saturating_duration_since(handed)),
                        bytes: t.bytes,
                        tail_ms: t.tail_us.map(|us| us as f64 / 1e3),
                        stage_prefill_ms: t.tail_stage_compute_us.map(|us| us as f64 / 1e3),
                    });
                }
            }
        }
    }
}
