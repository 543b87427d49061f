//! The answer to a generation request: whole, or as server-sent events.

use super::error::ServeError;
use super::state::{Ev, Served, Summary};
use crate::roles::openai::{CompletionRequest, Endpoint, Utf8Stream};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use handoff_components::ecs::PhaseName;
use handoff_components::failure::{Cause, Failure, ProcessRole};
use serde_json::{Value, json};
use std::collections::VecDeque;
use tokio::sync::mpsc;

/// What a choice produced, for a whole (non-streamed) answer.
#[derive(Default)]
pub(super) struct ChoiceOut {
    pub(super) bytes: Vec<u8>,
    pub(super) finish: Option<&'static str>,
    pub(super) tokens: u32,
    pub(super) summary: Option<Summary>,
}

pub(super) fn usage(prompt_tokens: usize, completion: u32) -> Value {
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens as u64 + u64::from(completion)})
}

pub(super) async fn collect_response(
    req: CompletionRequest,
    mut rx: mpsc::Receiver<(u32, Ev)>,
    mut served: Served,
    rid: String,
    created: u64,
    prompt_tokens: usize,
) -> Response {
    let k = req.prompts.len() * req.n as usize;
    let mut outs: Vec<ChoiceOut> = (0..k).map(|_| ChoiceOut::default()).collect();
    while let Some((i, ev)) = rx.recv().await {
        let Some(o) = outs.get_mut(i as usize) else { continue };
        match ev {
            Ev::Piece(b) => o.bytes.extend(b),
            Ev::Done { finish, tokens, summary } => {
                o.finish = Some(finish);
                o.tokens = tokens;
                o.summary = Some(summary);
            }
            Ev::Error(e) => return served.fail(e),
        }
    }
    if let Some(i) = outs.iter().position(|o| o.finish.is_none()) {
        let detail = format!("choice {i} ended without an answer");
        let e = ServeError::Failed(Failure::new(PhaseName::Decode, ProcessRole::Proxy, Cause::Protocol { detail }));
        return served.fail(e);
    }
    served.outcome = Some("ok");
    let completion: u32 = outs.iter().map(|o| o.tokens).sum();
    let choices: Vec<Value> = outs
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let text = String::from_utf8_lossy(&o.bytes);
            match req.endpoint {
                Endpoint::Completions => json!({"index": i, "text": text, "token_ids": o.bytes, "logprobs": null, "finish_reason": o.finish}),
                Endpoint::Chat => json!({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": o.finish}),
            }
        })
        .collect();
    let object = if req.endpoint == Endpoint::Chat { "chat.completion" } else { "text_completion" };
    axum::Json(json!({
        "id": rid, "object": object, "created": created, "model": req.model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion),
        "handoff": outs.first().and_then(|o| o.summary.clone()),
    }))
    .into_response()
}

/// The state of one streamed answer.
pub(super) struct Streaming {
    pub(super) req: CompletionRequest,
    pub(super) rx: mpsc::Receiver<(u32, Ev)>,
    pub(super) served: Served,
    pub(super) rid: String,
    pub(super) created: u64,
    pub(super) prompt_tokens: usize,
    pub(super) text: Vec<Utf8Stream>,
    /// Chat: whether the choice's first chunk (the assistant role) went out.
    pub(super) opened: Vec<bool>,
    pub(super) completion: u32,
    pub(super) ready: VecDeque<SseEvent>,
    pub(super) ended: bool,
}

impl Streaming {
    fn chunk(&self, choice: Value) -> SseEvent {
        let object = if self.req.endpoint == Endpoint::Chat { "chat.completion.chunk" } else { "text_completion" };
        let mut v = json!({"id": self.rid, "object": object, "created": self.created, "model": self.req.model, "choices": [choice]});
        if self.req.include_usage {
            v["usage"] = Value::Null;
        }
        SseEvent::default().data(v.to_string())
    }

    fn piece(&mut self, i: u32, bytes: &[u8], finish: Option<&'static str>) {
        let Some(dec) = self.text.get_mut(i as usize) else { return };
        let mut text = dec.push(bytes);
        if finish.is_some() {
            text += &dec.finish();
        }
        match self.req.endpoint {
            Endpoint::Completions => {
                if !bytes.is_empty() || !text.is_empty() || finish.is_some() {
                    let c = json!({"index": i, "text": text, "token_ids": bytes, "logprobs": null, "finish_reason": finish});
                    let ev = self.chunk(c);
                    self.ready.push_back(ev);
                }
            }
            Endpoint::Chat => {
                if !self.opened[i as usize] {
                    self.opened[i as usize] = true;
                    let ev = self.chunk(json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}));
                    self.ready.push_back(ev);
                }
                if !text.is_empty() {
                    let ev = self.chunk(json!({"index": i, "delta": {"content": text}, "logprobs": null, "finish_reason": null}));
                    self.ready.push_back(ev);
                }
                if finish.is_some() {
                    let ev = self.chunk(json!({"index": i, "delta": {}, "logprobs": null, "finish_reason": finish}));
                    self.ready.push_back(ev);
                }
            }
        }
    }

    /// The next events of the stream, or None at its end.
    async fn next(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(ev) = self.ready.pop_front() {
                return Some(ev);
            }
            if self.ended {
                return None;
            }
            match self.rx.recv().await {
                Some((i, Ev::Piece(b))) => self.piece(i, &b, None),
                Some((i, Ev::Done { finish, tokens, .. })) => {
                    self.completion += tokens;
                    self.piece(i, &[], Some(finish));
                }
                Some((_, Ev::Error(e))) => {
                    // The stream has begun with 200: the error travels as an event,
                    // and the other choices are cancelled when the receiver goes.
                    self.served.note(&e);
                    self.ready.push_back(SseEvent::default().event("error").data(e.body().to_string()));
                    self.ready.push_back(SseEvent::default().data("[DONE]"));
                    self.ended = true;
                    self.rx.close();
                }
                None => {
                    if self.served.outcome.is_none() {
                        self.served.outcome = Some("ok");
                    }
                    if self.req.include_usage {
                        let object = if self.req.endpoint == Endpoint::Chat { "chat.completion.chunk" } else { "text_completion" };
                        let v = json!({"id": self.rid, "object": object, "created": self.created, "model": self.req.model, "choices": [],
                                       "usage": usage(self.prompt_tokens, self.completion)});
                        self.ready.push_back(SseEvent::default().data(v.to_string()));
                    }
                    self.ready.push_back(SseEvent::default().data("[DONE]"));
                    self.ended = true;
                }
            }
        }
    }
}

pub(super) fn stream_response(
    req: CompletionRequest,
    rx: mpsc::Receiver<(u32, Ev)>,
    served: Served,
    rid: String,
    created: u64,
    prompt_tokens: usize,
) -> Response {
    let k = req.prompts.len() * req.n as usize;
    let st = Streaming {
        req,
        rx,
        served,
        rid,
        created,
        prompt_tokens,
        text: (0..k).map(|_| Utf8Stream::default()).collect(),
        opened: vec![false; k],
        completion: 0,
        ready: VecDeque::new(),
        ended: false,
    };
    let s = futures_util::stream::unfold(st, |mut st| async move {
        let ev = st.next().await?;
        Some((Ok::<_, std::convert::Infallible>(ev), st))
    });
    Sse::new(s).into_response()
}
