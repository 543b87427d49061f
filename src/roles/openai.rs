//! The OpenAI surface of the proxy: what `POST /v1/completions` and
//! `POST /v1/chat/completions` accept, validated into one [`CompletionRequest`], and the
//! pieces that turn byte tokens into the text a client reads.
//!
//! # Fields
//!
//! Both endpoints: `model` (absent, or the served `model.name`; another name is 404
//! `model_not_found`), `max_tokens` (completions: default 16; chat: also
//! `max_completion_tokens`, default the rest of `serve.max_context`), `n` (choices
//! per prompt, 1 to 128, default 1), `stop` (a string or up to 4 non-empty
//! strings; generation of a choice ends before the first one it produces, with
//! `finish_reason: "stop"`; otherwise `"length"`), `temperature` (0 to 2; absent or
//! 0 is greedy), `top_p` (in (0, 1], default 1), `seed` (an integer; the same seed
//! gives the same tokens, see [`super::sampling`]; sampling without one draws a
//! seed), `stream` and `stream_options.include_usage`, `user` (ignored).
//! Parameters handoff cannot honour (`logprobs`, `echo`, `best_of` other than `n`,
//! `suffix`, penalties, `logit_bias`, a non-empty `tools` or `functions`,
//! `response_format` other than text) are refused with 400 naming them, never
//! silently ignored (an empty `tools` list asks for nothing).
//!
//! Completions: `prompt` is a string (one token per byte), an array of token ids
//! 0..=255, or an array of several such prompts (each gets `n` choices, numbered
//! prompt-major as OpenAI does); `prompt_token_ids` is the token form of one
//! prompt. Giving both `prompt` and `prompt_token_ids` is 400.
//!
//! # The chat template
//!
//! The model's vocabulary is the 256 byte values, so the template is plain text:
//! each message becomes `<|ROLE|>\n` + its content + `\n` (ROLE is `system`,
//! `developer`, `user`, `assistant` or `tool`; content is a string or an array of
//! `{"type": "text", "text": ...}` parts, joined), and the prompt ends with
//! `<|assistant|>\n`, where the reply starts. `[{"role": "user", "content": "hi"}]`
//! is the 26 bytes `<|user|>\nhi\n<|assistant|>\n`.

use super::sampling::Sampling;
use handoff_components::Topology;
use serde_json::{Map, Value};

/// Which endpoint a generation came in on (it decides the response's shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// Why a request body is refused before anything is enqueued.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BodyError {
    #[error("malformed JSON body: {0}")]
    Malformed(String),
    #[error("{message}")]
    Invalid { param: &'static str, message: String },
    #[error("{param} is not supported by handoff: {message}")]
    Unsupported { param: &'static str, message: String },
    #[error("token id {0} is outside the byte-level vocabulary 0..=255")]
    TokenId(u64),
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    #[error(transparent)]
    Admission(#[from] handoff_systems::admission::AdmissionError),
}

impl BodyError {
    /// The request parameter the error is about, as OpenAI's `param`.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            BodyError::Malformed(_) => None,
            BodyError::Invalid { param, .. } | BodyError::Unsupported { param, .. } => Some(param),
            BodyError::TokenId(_) => Some("prompt"),
            BodyError::ModelNotFound(_) => Some("model"),
            BodyError::Admission(e) => Some(if e.label() == "max_tokens" { "max_tokens" } else { "prompt" }),
        }
    }
}

/// One validated request: every choice it runs.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    pub endpoint: Endpoint,
    /// The served model's name (what the response says).
    pub model: String,
    /// Byte-level prompt tokens, one entry per prompt.
    pub prompts: Vec<Vec<u8>>,
    /// Tokens to generate per choice of each prompt.
    pub max_tokens: Vec<u32>,
    /// Choices per prompt.
    pub n: u32,
    /// Stop sequences, as bytes.
    pub stop: Vec<Vec<u8>>,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
    pub stream: bool,
    pub include_usage: bool,
}

/// One choice of a generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// Its index in the response: prompt-major, `prompt * n + k`.
    pub index: u32,
    pub prompt: usize,
    pub max_tokens: u32,
    pub sampling: Sampling,
}

impl CompletionRequest {
    pub fn choices(&self) -> Vec<Choice> {
        let mut out = Vec::new();
        for (pi, max_tokens) in self.max_tokens.iter().enumerate() {
            for k in 0..self.n {
                let index = pi as u32 * self.n + k;
                let sampling = Sampling { temperature: self.temperature, top_p: self.top_p, seed: self.seed, choice: index };
                out.push(Choice { index, prompt: pi, max_tokens: *max_tokens, sampling });
            }
        }
        out
    }
}

/// The bytes the chat template makes of `messages` (see the module docs).
pub fn chat_prompt(messages: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (role, content) in messages {
        out.extend_from_slice(format!("<|{role}|>\n").as_bytes());
        out.extend_from_slice(content.as_bytes());
        out.push(b'\n');
    }
    out.extend_from_slice(b"<|assistant|>\n");
    out
}

fn invalid(param: &'static str, message: impl Into<String>) -> BodyError {
    BodyError::Invalid { param, message: message.into() }
}

/// A field, with JSON null read as absent (clients send null for "not given").
fn field<'a>(o: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    o.get(key).filter(|v| !v.is_null())
}

fn uint(o: &Map<String, Value>, key: &'static str) -> Result<Option<u64>, BodyError> {
    match field(o, key) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| invalid(key, format!("{key} must be a non-negative integer, got {v}"))),
    }
}

fn number(o: &Map<String, Value>, key: &'static str) -> Result<Option<f64>, BodyError> {
    match field(o, key) {
        None => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| invalid(key, format!("{key} must be a number, got {v}"))),
    }
}

fn boolean(o: &Map<String, Value>, key: &'static str) -> Result<bool, BodyError> {
    match field(o, key) {
        None => Ok(false),
        Some(v) => v.as_bool().ok_or_else(|| invalid(key, format!("{key} must be true or false, got {v}"))),
    }
}

/// Token ids of one prompt: integers 0..=255.
fn token_ids(v: &[Value], param: &'static str) -> Result<Vec<u8>, BodyError> {
    v.iter()
        .map(|t| match t.as_u64() {
            Some(x) if x <= 255 => Ok(x as u8),
            Some(x) => Err(BodyError::TokenId(x)),
            None => Err(invalid(param, format!("token ids must be integers 0..=255, got {t}"))),
        })
        .collect()
}

/// The prompts of a completion's `prompt` field.
fn prompts_of(v: &Value) -> Result<Vec<Vec<u8>>, BodyError> {
    match v {
        Value::String(s) => Ok(vec![s.as_bytes().to_vec()]),
        Value::Array(items) if items.is_empty() => Err(invalid("prompt", "prompt is an empty array")),
        Value::Array(items) if items.iter().all(Value::is_number) => Ok(vec![token_ids(items, "prompt")?]),
        Value::Array(items) => items
            .iter()
            .map(|p| match p {
                Value::String(s) => Ok(s.as_bytes().to_vec()),
                Value::Array(ids) => token_ids(ids, "prompt"),
                other => Err(invalid("prompt", format!("each prompt must be a string or an array of token ids, got {other}"))),
            })
            .collect(),
        other => Err(invalid("prompt", format!("prompt must be a string or an array, got {other}"))),
    }
}

/// A chat message's content as text.
fn content_text(v: Option<&Value>) -> Result<String, BodyError> {
    match v {
        None => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    _ => return Err(BodyError::Unsupported { param: "messages", message: format!("only text content parts are, got {part}") }),
                }
            }
            Ok(out)
        }
        Some(other) => Err(invalid("messages", format!("a message's content must be a string or an array of text parts, got {other}"))),
    }
}

fn messages_of(v: Option<&Value>) -> Result<Vec<(String, String)>, BodyError> {
    let Some(Value::Array(items)) = v else {
        return Err(invalid("messages", "messages must be a non-empty array of {role, content} objects"));
    };
    if items.is_empty() {
        return Err(invalid("messages", "messages is empty"));
    }
    items
        .iter()
        .map(|m| {
            let Some(o) = m.as_object() else { return Err(invalid("messages", format!("each message must be an object, got {m}"))) };
            let role = o.get("role").and_then(Value::as_str).unwrap_or("");
            if !["system", "developer", "user", "assistant", "tool"].contains(&role) {
                let got = o.get("role").map_or_else(|| "no role".to_string(), Value::to_string);
                return Err(invalid("messages", format!("message role must be system, developer, user, assistant or tool, got {got}")));
            }
            Ok((role.to_string(), content_text(field(o, "content"))?))
        })
        .collect()
}

fn stops_of(v: Option<&Value>) -> Result<Vec<Vec<u8>>, BodyError> {
    let list: Vec<&Value> = match v {
        None => return Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().collect(),
        Some(one) => vec![one],
    };
    if list.len() > 4 {
        return Err(invalid("stop", format!("at most 4 stop sequences, got {}", list.len())));
    }
    list.into_iter()
        .map(|s| match s.as_str() {
            Some("") => Err(invalid("stop", "a stop sequence may not be empty")),
            Some(s) => Ok(s.as_bytes().to_vec()),
            None => Err(invalid("stop", format!("stop must be a string or an array of strings, got {s}"))),
        })
        .collect()
}

/// Refuses the parameters handoff cannot honour when they ask for something.
fn refuse_unsupported(o: &Map<String, Value>, n: u64) -> Result<(), BodyError> {
    let unsupported = |param: &'static str, message: &str| Err(BodyError::Unsupported { param, message: message.to_string() });
    let truthy = |v: &Value| !(v.is_null() || v == &Value::Bool(false) || v == &Value::from(0));
    if let Some(v) = field(o, "logprobs")
        && truthy(v)
    {
        return unsupported("logprobs", "no log-probabilities are returned");
    }
    if let Some(v) = field(o, "top_logprobs")
        && truthy(v)
    {
        return unsupported("top_logprobs", "no log-probabilities are returned");
    }
    if boolean(o, "echo")? {
        return unsupported("echo", "the prompt is not echoed");
    }
    if let Some(b) = uint(o, "best_of")?
        && b != n
    {
        return unsupported("best_of", "best_of must equal n");
    }
    if field(o, "suffix").is_some() {
        return unsupported("suffix", "no insertion after a suffix");
    }
    for key in ["presence_penalty", "frequency_penalty"] {
        if number(o, key)?.is_some_and(|x| x != 0.0) {
            return unsupported(key, "penalties are not applied");
        }
    }
    if let Some(v) = field(o, "logit_bias")
        && v.as_object().is_none_or(|m| !m.is_empty())
    {
        return unsupported("logit_bias", "logits are not biased");
    }
    for key in ["tools", "functions"] {
        if let Some(v) = field(o, key)
            && v.as_array().is_none_or(|a| !a.is_empty())
        {
            return unsupported(key, "no tool calls");
        }
    }
    if let Some(v) = field(o, "response_format")
        && v.get("type").and_then(Value::as_str) != Some("text")
    {
        return unsupported("response_format", "only text responses");
    }
    Ok(())
}

/// Validates a request body of `endpoint` against the served topology.
/// `fresh_seed` is the seed a sampled request without one gets.
pub fn parse(topo: &Topology, endpoint: Endpoint, body: &[u8], fresh_seed: u64) -> Result<CompletionRequest, BodyError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| BodyError::Malformed(e.to_string()))?;
    let Value::Object(o) = v else { return Err(BodyError::Malformed("the body must be a JSON object".into())) };
    let served = &topo.model().name;
    let model = match field(&o, "model") {
        None => served.clone(),
        Some(Value::String(m)) if m == served => m.clone(),
        Some(Value::String(m)) => return Err(BodyError::ModelNotFound(m.clone())),
        Some(other) => return Err(invalid("model", format!("model must be a string, got {other}"))),
    };
    let n = uint(&o, "n")?.unwrap_or(1);
    if !(1..=128).contains(&n) {
        return Err(invalid("n", format!("n must be between 1 and 128, got {n}")));
    }
    refuse_unsupported(&o, n)?;
    let prompts = match endpoint {
        Endpoint::Completions => match (field(&o, "prompt"), field(&o, "prompt_token_ids")) {
            (Some(_), Some(_)) => return Err(invalid("prompt", "give either prompt or prompt_token_ids, not both")),
            (Some(p), None) => prompts_of(p)?,
            (None, Some(Value::Array(ids))) => vec![token_ids(ids, "prompt_token_ids")?],
            (None, Some(other)) => return Err(invalid("prompt_token_ids", format!("prompt_token_ids must be an array of token ids, got {other}"))),
            (None, None) => vec![Vec::new()],
        },
        Endpoint::Chat => {
            if field(&o, "prompt").is_some() || field(&o, "prompt_token_ids").is_some() {
                return Err(invalid("prompt", "chat completions take messages, not prompt"));
            }
            vec![chat_prompt(&messages_of(field(&o, "messages"))?)]
        }
    };
    let asked = match endpoint {
        Endpoint::Completions => uint(&o, "max_tokens")?,
        Endpoint::Chat => match (uint(&o, "max_completion_tokens")?, uint(&o, "max_tokens")?) {
            (Some(a), _) => Some(a),
            (None, b) => b,
        },
    };
    let max_context = u64::from(topo.config.serve.max_context);
    let mut max_tokens = Vec::with_capacity(prompts.len());
    for p in &prompts {
        let len = p.len() as u64;
        let m = asked.unwrap_or(match endpoint {
            Endpoint::Completions => 16,
            Endpoint::Chat => max_context.saturating_sub(len),
        });
        handoff_systems::admission::validate_generation(topo, len, m)?;
        max_tokens.push(m as u32);
    }
    let choices = prompts.len() as u64 * n;
    let places = u64::from(topo.config.serve.max_requests);
    if choices > places {
        return Err(invalid("n", format!("{choices} choices ({} prompts x n = {n}) cannot run at once: serve.max_requests is {places}", prompts.len())));
    }
    let stop = stops_of(field(&o, "stop"))?;
    let temperature = number(&o, "temperature")?.unwrap_or(0.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(invalid("temperature", format!("temperature must be between 0 and 2, got {temperature}")));
    }
    let top_p = number(&o, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(invalid("top_p", format!("top_p must be in (0, 1], got {top_p}")));
    }
    let seed = match field(&o, "seed") {
        None => fresh_seed,
        // A negative seed is as good as any: its two's-complement bits key the draws.
        Some(v) => v.as_u64().or_else(|| v.as_i64().map(|x| x as u64)).ok_or_else(|| invalid("seed", format!("seed must be an integer, got {v}")))?,
    };
    let stream = boolean(&o, "stream")?;
    let include_usage = match field(&o, "stream_options") {
        None => false,
        Some(Value::Object(so)) => boolean(so, "include_usage")?,
        Some(other) => return Err(invalid("stream_options", format!("stream_options must be an object, got {other}"))),
    };
    // A top_p in range as f64 may round to 0 as f32 (2e-308): keep it positive, the
    // nucleus of the single most likely token it asks for.
    let top_p = (top_p as f32).max(f32::MIN_POSITIVE);
    Ok(CompletionRequest { endpoint, model, prompts, max_tokens, n: n as u32, stop, temperature: temperature as f32, top_p, seed, stream, include_usage })
}

/// Where a choice's generation stands after one more token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopStep {
    /// Bytes that can no longer be part of a stop sequence (maybe none).
    Release(Vec<u8>),
    /// A stop sequence ended at this token: the bytes before it, still unreleased.
    Stopped(Vec<u8>),
}

/// Finds stop sequences in a choice's generated bytes, holding back only the
/// bytes that may still begin one, so a stream never shows part of a stop.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<Vec<u8>>,
    held: Vec<u8>,
}

impl StopMatcher {
    pub fn new(stops: Vec<Vec<u8>>) -> Self {
        StopMatcher { stops, held: Vec::new() }
    }

    pub fn push(&mut self, b: u8) -> StopStep {
        self.held.push(b);
        // Of the stops ending here, the longest starts first.
        if let Some(s) = self.stops.iter().filter(|s| self.held.ends_with(s)).max_by_key(|s| s.len()) {
            let keep = self.held.len() - s.len();
            self.held.truncate(keep);
            return StopStep::Stopped(std::mem::take(&mut self.held));
        }
        // The longest suffix that is a proper prefix of some stop may still grow
        // into one; everything before it is final.
        let hold =
            (1..=self.held.len()).rev().find(|&k| self.stops.iter().any(|s| s.len() > k && s.starts_with(&self.held[self.held.len() - k..]))).unwrap_or(0);
        let rest = self.held.split_off(self.held.len() - hold);
        StopStep::Release(std::mem::replace(&mut self.held, rest))
    }

    /// The generation ended without a stop: the held bytes are final.
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.held)
    }
}

/// Decodes a byte stream as UTF-8 across token boundaries: a character split over
/// tokens is shown once it is whole, and an invalid byte becomes U+FFFD, so the
/// concatenated pieces equal `String::from_utf8_lossy` of all the bytes.
#[derive(Debug, Clone, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    // SAFETY-free: the prefix up to valid_up_to is valid UTF-8.
                    out.push_str(std::str::from_utf8(&self.pending[..good]).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..good + bad);
                        }
                        None => {
                            // An incomplete character at the end: wait for its bytes.
                            self.pending.drain(..good);
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// The end of the stream: an incomplete character left is invalid.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn topo() -> Topology {
        Topology::parse(super::super::up::DEFAULT_CONFIG).expect("default topology")
    }

    fn parse_c(body: &str) -> Result<CompletionRequest, BodyError> {
        parse(&topo(), Endpoint::Completions, body.as_bytes(), 99)
    }

    #[test]
    fn both_prompt_forms_other_models_and_unsupported_parameters_are_refused() {
        assert_eq!(parse_c(r#"{"prompt": "a", "prompt_token_ids": [1]}"#).unwrap_err().param(), Some("prompt"));
        assert!(matches!(parse_c(r#"{"prompt": "a", "model": "gpt-4"}"#), Err(BodyError::ModelNotFound(m)) if m == "gpt-4"));
        let served = format!(r#"{{"prompt": "a", "model": {:?}}}"#, topo().model().name);
        assert!(parse_c(&served).is_ok(), "{served}");
        for (body, param) in [
            (r#"{"prompt": "a", "logprobs": 2}"#, "logprobs"),
            (r#"{"prompt": "a", "echo": true}"#, "echo"),
            (r#"{"prompt": "a", "n": 2, "best_of": 3}"#, "best_of"),
            (r#"{"prompt": "a", "presence_penalty": 0.5}"#, "presence_penalty"),
            (r#"{"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}"#, "stop"),
            (r#"{"prompt": "a", "stop": ""}"#, "stop"),
            (r#"{"prompt": "a", "temperature": 3}"#, "temperature"),
            (r#"{"prompt": "a", "top_p": 0}"#, "top_p"),
            (r#"{"prompt": "a", "n": 0}"#, "n"),
            (r#"{"prompt": "a", "n": 97}"#, "n"),
            (r#"{"prompt": "a", "seed": "x"}"#, "seed"),
        ] {
            assert_eq!(parse_c(body).unwrap_err().param(), Some(param), "{body}");
        }
        // Defaults the client leaves out (or sends as null) are not refusals.
        let g = parse_c(r#"{"prompt": "ab", "logprobs": null, "echo": false, "best_of": 1, "presence_penalty": 0}"#).expect("ok");
        assert_eq!((g.n, g.max_tokens.clone(), g.temperature, g.seed), (1, vec![16], 0.0, 99));
    }

    #[test]
    fn prompts_choices_and_the_chat_template() {
        let g = parse_c(r#"{"prompt": ["ab", [1, 2, 3]], "n": 2, "max_tokens": 4, "temperature": 0.7, "seed": -1}"#).expect("ok");
        assert_eq!(g.prompts, vec![b"ab".to_vec(), vec![1, 2, 3]]);
        let c = g.choices();
        assert_eq!(c.iter().map(|c| (c.index, c.prompt)).collect::<Vec<_>>(), vec![(0, 0), (1, 0), (2, 1), (3, 1)]);
        assert_eq!(c[3].sampling.seed, u64::MAX);
        assert!(matches!(parse_c(r#"{"prompt": [1, 256]}"#), Err(BodyError::TokenId(256))));
        let chat = parse(&topo(), Endpoint::Chat, br#"{"messages": [{"role": "user", "content": "hi"}]}"#, 0).expect("chat");
        assert_eq!(chat.prompts[0], b"<|user|>\nhi\n<|assistant|>\n".to_vec());
        assert_eq!(chat.max_tokens, vec![512 - 26]);
        let parts = parse(
            &topo(),
            Endpoint::Chat,
            br#"{"messages": [{"role": "system", "content": [{"type": "text", "text": "s"}]}, {"role": "user", "content": "u"}], "max_completion_tokens": 3}"#,
            0,
        )
        .expect("chat");
        assert_eq!(parts.prompts[0], b"<|system|>\ns\n<|user|>\nu\n<|assistant|>\n".to_vec());
        assert_eq!(parts.max_tokens, vec![3]);
        for bad in [r#"{"messages": []}"#, r#"{"messages": [{"role": "wizard", "content": "x"}]}"#, r#"{"prompt": "x"}"#] {
            assert!(parse(&topo(), Endpoint::Chat, bad.as_bytes(), 0).is_err(), "{bad}");
        }
        // A bad role is named as the client wrote it, in JSON.
        for (body, named) in
            [(r#"{"messages": [{"role": "wizard", "content": "x"}]}"#, r#"got "wizard""#), (r#"{"messages": [{"content": "x"}]}"#, "got no role")]
        {
            let e = parse(&topo(), Endpoint::Chat, body.as_bytes(), 0).unwrap_err().to_string();
            assert!(e.ends_with(named) && !e.contains("Some("), "{e}");
        }
    }

    /// `tools` and `functions` are refused when they ask for a tool, and an
    /// empty list (which asks for nothing) passes.
    #[test]
    fn an_empty_tools_list_passes_and_a_tool_is_refused() {
        for key in ["tools", "functions"] {
            let empty = format!(r#"{{"messages": [{{"role": "user", "content": "hi"}}], "{key}": []}}"#);
            assert!(parse(&topo(), Endpoint::Chat, empty.as_bytes(), 0).is_ok(), "{empty}");
            let one = format!(r#"{{"messages": [{{"role": "user", "content": "hi"}}], "{key}": [{{"type": "function", "function": {{"name": "f"}}}}]}}"#);
            let e = parse(&topo(), Endpoint::Chat, one.as_bytes(), 0).unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
    }

    #[test]
    fn a_stop_sequence_is_cut_and_never_shown_in_part() {
        let mut m = StopMatcher::new(vec![b"XYZ".to_vec(), b"YQ".to_vec()]);
        let mut shown = Vec::new();
        let mut stopped = None;
        for &b in b"abXYXYZtail" {
            match m.push(b) {
                StopStep::Release(r) => shown.extend(r),
                StopStep::Stopped(r) => {
                    shown.extend(r);
                    stopped = Some(shown.clone());
                    break;
                }
            }
        }
        assert_eq!(stopped.as_deref(), Some(&b"abXY"[..]));
        let mut m = StopMatcher::new(vec![b"zz".to_vec()]);
        let mut shown = Vec::new();
        for &b in b"az" {
            if let StopStep::Release(r) = m.push(b) {
                shown.extend(r);
            }
        }
        assert_eq!(shown, b"a");
        assert_eq!(m.finish(), b"z");
    }

    proptest! {
        /// Invariant: however the bytes are split into tokens, the streamed text
        /// equals the lossy decoding of all of them.
        #[test]
        fn streamed_text_equals_lossy_decoding(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut d = Utf8Stream::default();
            let mut s = String::new();
            for b in &bytes {
                s += &d.push(&[*b]);
            }
            s += &d.finish();
            prop_assert_eq!(s, String::from_utf8_lossy(&bytes).into_owned());
        }

        /// Invariant: with stops, released bytes plus the held tail are the
        /// generated bytes up to the first stop occurrence (all of them without one).
        #[test]
        fn stop_matcher_releases_exactly_the_bytes_before_the_first_stop(
            bytes in proptest::collection::vec(0u8..4, 0..40),
            stops in proptest::collection::vec(proptest::collection::vec(0u8..4, 1..4), 1..3),
        ) {
            let mut m = StopMatcher::new(stops.clone());
            let mut shown = Vec::new();
            let mut cut = None;
            for (i, &b) in bytes.iter().enumerate() {
                match m.push(b) {
                    StopStep::Release(r) => shown.extend(r),
                    StopStep::Stopped(r) => { shown.extend(r); cut = Some(i + 1); break; }
                }
            }
            if cut.is_none() { shown.extend(m.finish()); }
            let first_end = (1..=bytes.len()).find(|&e| stops.iter().any(|s| bytes[..e].ends_with(s)));
            prop_assert_eq!(cut, first_end);
            let want = match first_end {
                Some(e) => { let s = stops.iter().filter(|s| bytes[..e].ends_with(s)).max_by_key(|s| s.len()).unwrap(); bytes[..e - s.len()].to_vec() }
                None => bytes.clone(),
            };
            prop_assert_eq!(shown, want);
        }
    }
}
