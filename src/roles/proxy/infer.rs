//! One generation request: its body, its place in the bounded queue, and each of
//! its choices through decode's admission, prefill and decode's stream.

use super::error::ServeError;
use super::links::{Reached, decode_link, send_stage0};
use super::registry::{peers, pids};
use super::retry;
use super::state::{ChoiceRoute, Ev, Proxy, Served, Summary, body_limit, set_phase};
use super::stream::{collect_response, stream_response};
use crate::base::lock;
use crate::roles::host::secs;
use crate::roles::openai::{self, BodyError, Endpoint, StopMatcher, StopStep};
use crate::roles::prom::{Histogram, REQUEST_BUCKETS_S};
use crate::roles::sampling::Sampling;
use crate::roles::wire::{Admitted, Msg, WirePrefillJob};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::Response;
use futures_util::StreamExt;
use handoff_components::ecs::PhaseName;
use handoff_components::failure::{Cause, Failure, PeerLoss, ProcessRole};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;
use tokio::sync::mpsc;

/// The body as JSON bytes: 415 for another content type (a missing one is read as
/// JSON), 413 past the limit. The body is read chunk by chunk, so an oversized one
/// is never held; one up to 4 times the limit is read to its end (and dropped)
/// before the 413, so that a client that sends it whole, without waiting for
/// `100 Continue`, still reads the answer instead of a reset connection.
pub(super) async fn read_body(p: &Proxy, headers: &HeaderMap, body: Body) -> Result<Vec<u8>, ServeError> {
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let ct = String::from_utf8_lossy(ct.as_bytes()).to_string();
        let mime = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
        if mime != "application/json" {
            return Err(ServeError::MediaType(ct));
        }
    }
    let limit = body_limit(&p.topo);
    let drain_cap = 4 * limit as u64;
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > drain_cap) {
        return Err(ServeError::TooLarge { limit });
    }
    let mut out = Vec::new();
    let mut seen = 0u64;
    let mut stream = body.into_data_stream();
    let body_timeout = p.topo.config.serve.body_timeout_s;
    let deadline = tokio::time::Instant::now() + secs(body_timeout);
    loop {
        let Ok(next) = tokio::time::timeout_at(deadline, stream.next()).await else {
            return Err(ServeError::BodyTimeout(body_timeout));
        };
        let Some(chunk) = next else { break };
        let chunk = chunk.map_err(|e| ServeError::Body(BodyError::Malformed(format!("reading the body: {e}"))))?;
        seen += chunk.len() as u64;
        if seen > drain_cap {
            break;
        }
        if seen <= limit as u64 {
            out.extend_from_slice(&chunk);
        }
    }
    if seen > limit as u64 {
        return Err(ServeError::TooLarge { limit });
    }
    Ok(out)
}

pub(super) async fn completions(State(p): State<Arc<Proxy>>, headers: HeaderMap, body: Body) -> Response {
    generate(p, Endpoint::Completions, headers, body).await
}

pub(super) async fn chat_completions(State(p): State<Arc<Proxy>>, headers: HeaderMap, body: Body) -> Response {
    generate(p, Endpoint::Chat, headers, body).await
}

/// Waits for `k` of the `serve.max_requests` places (one per choice), in the
/// bounded queue.
pub(super) async fn place(p: &Arc<Proxy>, k: u32) -> Result<tokio::sync::OwnedSemaphorePermit, ServeError> {
    if let Ok(permit) = Arc::clone(&p.places).try_acquire_many_owned(k) {
        return Ok(permit);
    }
    let cap = p.topo.config.serve.queue;
    let q = p.queued.fetch_add(1, Ordering::SeqCst);
    if q >= cap {
        p.queued.fetch_sub(1, Ordering::SeqCst);
        return Err(ServeError::Overloaded { places: p.topo.config.serve.max_requests, queued: q, queue: cap });
    }
    let wait = secs(p.topo.config.timeouts.admission_s);
    let got = tokio::time::timeout(wait, Arc::clone(&p.places).acquire_many_owned(k)).await;
    p.queued.fetch_sub(1, Ordering::SeqCst);
    match got {
        Ok(Ok(permit)) => Ok(permit),
        _ => Err(ServeError::AdmissionTimeout(p.topo.config.timeouts.admission_s)),
    }
}

pub(super) fn now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

pub(super) async fn generate(p: Arc<Proxy>, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let arrived = Instant::now();
    let mut served = Served::new(&p);
    if p.draining.load(Ordering::SeqCst) {
        return served.fail(ServeError::Draining);
    }
    let bytes = match read_body(&p, &headers, body).await {
        Ok(b) => b,
        Err(e) => return served.fail(e),
    };
    // A sampled request without a seed gets one no other request shares.
    let clock = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let fresh_seed = crate::roles::sampling::uniform(clock, p.inflight.load(Ordering::SeqCst), 0).to_bits() ^ clock;
    let req = match openai::parse(&p.topo, endpoint, &bytes, fresh_seed) {
        Ok(g) => g,
        Err(e) => return served.fail(ServeError::Body(e)),
    };
    if let Err(m) = peers(&p) {
        return served.fail(ServeError::NotReady(m));
    }
    let choices = req.choices();
    let mut permit = match place(&p, choices.len() as u32).await {
        Ok(permit) => permit,
        Err(e) => return served.fail(e),
    };
    // A role may have gone down while the request waited for its place.
    if let Err(m) = peers(&p) {
        return served.fail(ServeError::NotReady(m));
    }
    if p.draining.load(Ordering::SeqCst) {
        return served.fail(ServeError::Draining);
    }
    let queue_ms = arrived.elapsed().as_secs_f64() * 1e3;
    // One id per choice: decode and the stages know each choice as a request.
    let id = p.next_id.fetch_add(choices.len() as u64, Ordering::SeqCst);
    let (tx, rx) = mpsc::channel::<(u32, Ev)>(256);
    for c in &choices {
        // Each choice holds its own place and frees it when it ends.
        let mine = permit.split(1);
        let (task_p, tx) = (Arc::clone(&p), tx.clone());
        let cid = id + u64::from(c.index);
        let prompt = req.prompts[c.prompt].clone();
        let choice = ChoiceTask { id: cid, index: c.index, prompt, max_tokens: c.max_tokens, sampling: c.sampling, stops: req.stop.clone(), arrived, queue_ms };
        tokio::spawn(async move {
            let _place = mine;
            run_choice(&task_p, choice, tx).await;
            lock(&task_p.routes).remove(&cid);
        });
    }
    drop(tx);
    let created = now_s();
    let prefix = if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" };
    let rid = format!("{prefix}-{id}");
    let prompt_tokens: usize = req.prompts.iter().map(Vec::len).sum();
    if req.stream {
        return stream_response(req, rx, served, rid, created, prompt_tokens);
    }
    collect_response(req, rx, served, rid, created, prompt_tokens).await
}

/// One choice of a generation request, as its task runs it.
pub(super) struct ChoiceTask {
    /// The choice's request id (decode and the stages know it by this).
    pub id: u64,
    /// Its index among the request's choices (`choices[index]` of the answer).
    pub index: u32,
    pub prompt: Vec<u8>,
    pub max_tokens: u32,
    pub sampling: Sampling,
    pub stops: Vec<Vec<u8>>,
    /// When the HTTP request arrived (TTFT and end-to-end are measured from it).
    pub arrived: Instant,
    /// How long it waited for its place.
    pub queue_ms: f64,
}

/// What a choice has produced so far, kept across its attempts.
struct Progress {
    /// Every token decode streamed for the choice (each went into the stop
    /// matcher): what a retry replays.
    streamed: Vec<u8>,
    stop: StopMatcher,
    summary: Summary,
    /// When the last token came.
    last_tok: Option<Instant>,
    /// Every role's process as the current attempt found them (0: none).
    pids: Vec<u32>,
}

/// How an attempt ended short of its answer.
enum Halt {
    /// It failed with the error its client gets unless a retry saves it; the
    /// attempt was in the phase named.
    Failed(ServeError, PhaseName),
    /// Nothing more to answer: the client went away (decode frees the request).
    Quiet,
}

/// Removes an attempt's route when the attempt ends, however it ends.
struct RouteGuard<'a> {
    p: &'a Proxy,
    id: u64,
}

impl Drop for RouteGuard<'_> {
    fn drop(&mut self) {
        lock(&self.p.routes).remove(&self.id);
    }
}

/// One choice through the cluster: decode's admission, prefill, decode's stream,
/// with its stop sequences applied; sent again once for each fault that kills a
/// role under it, while its deadline allows ([`super::retry`]). What it produces
/// goes to `tx`, tagged with the choice's index.
pub(super) async fn run_choice(p: &Arc<Proxy>, choice: ChoiceTask, tx: mpsc::Sender<(u32, Ev)>) {
    let mut prog = Progress {
        streamed: Vec::new(),
        stop: StopMatcher::new(choice.stops.clone()),
        summary: Summary { queue_ms: choice.queue_ms, ..Default::default() },
        last_tok: None,
        pids: Vec::new(),
    };
    let mut retried = Vec::new();
    let mut id = choice.id;
    let finish = loop {
        let (e, phase) = match attempt(p, &choice, id, &mut prog, &tx).await {
            Ok(finish) => break finish,
            Err(Halt::Quiet) => return,
            Err(Halt::Failed(e, phase)) => (e, phase),
        };
        // Every token came and only decode's last word was lost: the choice is whole.
        if prog.streamed.len() as u32 >= choice.max_tokens {
            let rest = prog.stop.finish();
            if !rest.is_empty() {
                let _ = tx.send((choice.index, Ev::Piece(rest))).await;
            }
            break "length";
        }
        match retry::after(p, &e, phase, &prog.pids, &mut retried, || tx.is_closed()).await {
            retry::Verdict::Retry => id = p.next_id.fetch_add(1, Ordering::SeqCst),
            retry::Verdict::Fail => return drop(tx.send((choice.index, Ev::Error(e))).await),
            retry::Verdict::Gone => return,
        }
    };
    let n_tokens = prog.streamed.len() as u32;
    let summary = prog.summary;
    {
        let mut m = lock(&p.metrics);
        m.bytes += summary.bytes_handed_off;
        m.tokens += u64::from(n_tokens);
        for (ph, ms) in [("queue", summary.queue_ms), ("handoff", summary.handoff_ms), ("decode", summary.decode_ms)] {
            m.phases.entry(ph).or_insert_with(|| Histogram::new(REQUEST_BUCKETS_S)).observe(ms / 1e3);
        }
        m.e2e.observe(choice.arrived.elapsed().as_secs_f64());
        if let Some(tail) = summary.tail_ms {
            m.tail.observe(tail / 1e3);
        }
    }
    let _ = tx.send((choice.index, Ev::Done { finish, tokens: n_tokens, summary })).await;
}

/// One attempt of a choice under request id `id`: decode's admission (with the
/// tokens already streamed to replay), prefill, and decode's stream from the
/// first token not yet streamed. Ok: the choice ended (`length` or `stop`).
async fn attempt(p: &Arc<Proxy>, choice: &ChoiceTask, id: u64, prog: &mut Progress, tx: &mpsc::Sender<(u32, Ev)>) -> Result<&'static str, Halt> {
    let (index, max_tokens, arrived) = (choice.index, choice.max_tokens, choice.arrived);
    let t = p.topo.config.timeouts.clone();
    let failed = |failure: Failure| {
        let phase = failure.phase;
        Halt::Failed(ServeError::Failed(failure), phase)
    };
    // The failures the proxy itself finds: decode's silence, its link, its answers.
    let decode_failed = |phase: PhaseName, cause: Cause| Failure::new(phase, ProcessRole::Decode, cause);
    let late = |phase: PhaseName, after: std::time::Duration, detail: String| decode_failed(phase, Cause::Timeout { after, waiting_for: Vec::new(), detail });
    // What the proxy gives up on itself (no role failed it).
    let ended = |phase: PhaseName, detail: &str| Failure::new(phase, ProcessRole::Proxy, Cause::Cancelled { detail: detail.to_string() });
    let decode = match peers(p) {
        Ok((d, _)) => d,
        Err(m) => return Err(Halt::Failed(ServeError::NotReady(m), PhaseName::Admission)),
    };
    prog.pids = pids(p);
    let link_closed = |phase: PhaseName| decode_failed(phase, Cause::PeerDown { loss: PeerLoss::Dead, detail: format!("died (its link at {decode} closed)") });
    // 1. Decode admission: blocks, slots, published layouts.
    let (link_id, link) = match decode_link(p, decode).await {
        Ok(l) => l,
        Err(e) => return Err(Halt::Failed(e, PhaseName::Admission)),
    };
    let (rtx, mut rrx) = mpsc::unbounded_channel();
    lock(&p.routes).insert(id, ChoiceRoute { tx: rtx, phase: PhaseName::Admission, link: link_id });
    let _route = RouteGuard { p, id };
    // `unsent`: this attempt ends without having sent the prefill job, so no
    // stage has the request and decode frees it at once.
    let cancel_as = |failure: Failure, unsent: bool| {
        let _ = link.send(Msg::Cancel { id, failure, unsent });
    };
    let cancel = |failure: Failure| cancel_as(failure, false);
    let cancel_unsent = |failure: Failure| cancel_as(failure, true);
    let sampled = (!choice.sampling.is_greedy()).then_some(choice.sampling);
    let prompt_tokens = choice.prompt.len() as u64;
    // A retry replays what was streamed: decode feeds those tokens back in place
    // of its own picks, and the proxy passes on only the tokens after them.
    let replay = prog.streamed.len();
    if link.send(Msg::Admit { id, prompt_tokens, max_tokens, sampling: sampled, forced: prog.streamed.clone() }).is_err() {
        return Err(failed(link_closed(PhaseName::Admission)));
    }
    let admission_wait = secs(t.admission_s + 1.0);
    let admitted: Admitted = match tokio::time::timeout(admission_wait, rrx.recv()).await {
        Ok(Some(Msg::Admitted(a))) => *a,
        // The error may be the proxy's own (decode went down while this request
        // was being admitted), whose cancel can have reached decode before the
        // Admit did; a cancel sent now follows the Admit on the link, so decode
        // frees what it admitted (it ignores a cancel of a request it never had).
        Ok(Some(Msg::Error { failure, .. })) => {
            cancel_unsent(failure.clone());
            return Err(failed(failure));
        }
        // The route went with the link (decode's link closed): decode is gone.
        Ok(None) => return Err(failed(link_closed(PhaseName::Admission))),
        Ok(Some(other)) => {
            let failure = decode_failed(PhaseName::Admission, Cause::Protocol { detail: format!("answered the admission with {other:?}") });
            cancel_unsent(failure.clone());
            return Err(failed(failure));
        }
        Err(_) => {
            let failure = late(PhaseName::Admission, admission_wait, format!("no answer from decode at {decode}"));
            cancel_unsent(failure.clone());
            return Err(failed(failure));
        }
    };
    // 2. Prefill: stage 0, which passes the job on stage by stage; stages report to
    // decode. The stages as they are now: one may have restarted meanwhile.
    let stages = match peers(p) {
        Ok((_, s)) => s,
        Err(m) => {
            cancel_unsent(ended(PhaseName::Compute, &m.to_string()));
            return Err(Halt::Failed(ServeError::NotReady(m), PhaseName::Compute));
        }
    };
    // The stages' processes this attempt sends to (decode's stays as it was found).
    let now = pids(p);
    prog.pids.truncate(1);
    prog.pids.extend(now.iter().skip(1));
    set_phase(p, id, PhaseName::Compute);
    let job = WirePrefillJob { admitted, prompt: choice.prompt.clone(), stage: 0, stages: stages.clone(), hidden: None, sampling: sampled };
    if let Err((e, reached)) = send_stage0(p, stages[0], &Msg::Prefill(Box::new(job))).await {
        // Decode frees the request with the stage's failure; a refused connection
        // (the 503 of a stage 0 found dead) is that stage gone.
        let failure = match &e {
            ServeError::Failed(f) => f.clone(),
            other => Failure::new(PhaseName::Compute, ProcessRole::Prefill { stage: 0 }, Cause::PeerDown { loss: PeerLoss::Dead, detail: other.to_string() }),
        };
        // A job that never reached stage 0 reaches no stage: decode frees at once.
        cancel_as(failure, reached == Reached::No);
        return Err(Halt::Failed(e, PhaseName::Compute));
    }
    // 3. Decode's stream.
    let mut seen = 0usize;
    let budget = secs(t.compute_s + t.transfer_s + 60.0);
    loop {
        let msg = match tokio::time::timeout(budget, rrx.recv()).await {
            Ok(Some(m)) => m,
            Ok(None) => return Err(failed(link_closed(PhaseName::Decode))),
            Err(_) => {
                let failure = late(PhaseName::Decode, budget, format!("no token from decode at {decode}"));
                cancel(failure.clone());
                return Err(failed(failure));
            }
        };
        match msg {
            Msg::Token { token, .. } => {
                seen += 1;
                if seen == 1 {
                    set_phase(p, id, PhaseName::Decode);
                }
                if seen <= replay {
                    // Decode was fed the streamed token here; its own pick, the
                    // same bits as the first time, is not passed on again.
                    if prog.streamed[seen - 1] != token {
                        tracing::warn!(request = id, index = seen - 1, "proxy: a replayed step picked another token than the first run streamed");
                    }
                    continue;
                }
                let now = Instant::now();
                match prog.last_tok {
                    None => {
                        prog.summary.ttft_ms = (now - arrived).as_secs_f64() * 1e3;
                        lock(&p.metrics).ttft.observe((now - arrived).as_secs_f64());
                    }
                    Some(prev) => {
                        prog.summary.itl_ms.push((now - prev).as_secs_f64() * 1e3);
                        lock(&p.metrics).itl.observe((now - prev).as_secs_f64());
                    }
                }
                prog.last_tok = Some(now);
                prog.streamed.push(token);
                let (piece, stopped) = match prog.stop.push(token) {
                    StopStep::Release(b) => (b, false),
                    StopStep::Stopped(b) => (b, true),
                };
                if (!piece.is_empty() || stopped) && tx.send((index, Ev::Piece(piece))).await.is_err() {
                    // The client went away: decode frees the request.
                    cancel(ended(PhaseName::Decode, "the client went away"));
                    return Err(Halt::Quiet);
                }
                if stopped {
                    // Decode still generates: it frees the request at the cancel.
                    cancel(ended(PhaseName::Decode, "a stop sequence ended the generation"));
                    return Ok("stop");
                }
            }
            Msg::Done { handoff_ms, decode_ms, bytes, tail_ms, stage_prefill_ms, .. } => {
                prog.summary.tail_ms = tail_ms;
                prog.summary.stage_prefill_ms = stage_prefill_ms;
                prog.summary.handoff_ms = handoff_ms;
                prog.summary.decode_ms = decode_ms;
                prog.summary.bytes_handed_off = bytes;
                let rest = prog.stop.finish();
                if !rest.is_empty() {
                    let _ = tx.send((index, Ev::Piece(rest))).await;
                }
                return Ok("length");
            }
            Msg::Error { failure, .. } => return Err(failed(failure)),
            other => return Err(failed(decode_failed(PhaseName::Decode, Cause::Protocol { detail: format!("sent {other:?}") }))),
        }
    }
}
