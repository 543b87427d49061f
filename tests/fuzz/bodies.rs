//! `/v1/completions` and `/v1/chat/completions` bodies: valid ones and their mutations.

use super::*;
use handoff::roles::openai::{self, BodyError, Endpoint};
use handoff_components::Topology;
use serde_json::{Value, json};
use std::fmt::Debug;

// ---- HTTP bodies ----

/// The fields a body may carry (and a few it may not).
const BODY_FIELDS: [&str; 24] = [
    "model",
    "prompt",
    "prompt_token_ids",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stop",
    "temperature",
    "top_p",
    "seed",
    "stream",
    "stream_options",
    "user",
    "logprobs",
    "top_logprobs",
    "echo",
    "best_of",
    "suffix",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "tools",
    "response_format",
];

/// A valid body, before mutation.
#[derive(Debug, Clone)]
pub struct ValidBody {
    pub chat: bool,
    pub prompt: Result<String, Vec<u8>>,
    pub max_tokens: Option<u32>,
    pub n: Option<u32>,
    pub stop: Vec<String>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<i64>,
    pub stream: Option<bool>,
}

impl ValidBody {
    pub fn json(&self) -> Value {
        let mut o = serde_json::Map::new();
        match (&self.prompt, self.chat) {
            (Ok(s), true) => {
                o.insert("messages".into(), json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": s}]));
            }
            (Err(ids), true) => {
                o.insert("messages".into(), json!([{"role": "user", "content": [{"type": "text", "text": String::from_utf8_lossy(ids)}]}]));
            }
            (Ok(s), false) => {
                o.insert("prompt".into(), json!(s));
            }
            (Err(ids), false) => {
                o.insert("prompt_token_ids".into(), json!(ids));
            }
        }
        let mut put = |k: &str, v: Option<Value>| {
            if let Some(v) = v {
                o.insert(k.into(), v);
            }
        };
        put("max_tokens", self.max_tokens.map(Value::from));
        put("n", self.n.map(Value::from));
        put("stop", (!self.stop.is_empty()).then(|| json!(self.stop)));
        put("temperature", self.temperature.map(Value::from));
        put("top_p", self.top_p.map(Value::from));
        put("seed", self.seed.map(Value::from));
        put("stream", self.stream.map(Value::from));
        Value::Object(o)
    }
}

fn valid_body() -> impl Strategy<Value = ValidBody> {
    let text =
        prop::collection::vec(prop::sample::select(vec!['a', 'b', ' ', 'é', '\n', '"', '\\', '世']), 1..40).prop_map(|v| v.into_iter().collect::<String>());
    let prompt = prop_oneof![text.clone().prop_map(Ok), prop::collection::vec(any::<u8>(), 1..40).prop_map(Err)];
    (
        any::<bool>(),
        prompt,
        prop::option::of(1u32..=16),
        prop::option::of(1u32..=2),
        prop::collection::vec(text, 0..=4),
        prop::option::of(0.0f64..=2.0),
        prop::option::of(0.01f64..=1.0),
        prop::option::of(any::<i64>()),
        prop::option::of(any::<bool>()),
    )
        .prop_map(|(chat, prompt, max_tokens, n, stop, temperature, top_p, seed, stream)| ValidBody {
            chat,
            prompt,
            max_tokens,
            n,
            stop,
            temperature,
            top_p,
            seed,
            stream,
        })
}

/// Values a field may be set to: wrong types, edges, huge and nested ones.
fn weird_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => prop::sample::select(vec![
            json!(null), json!(true), json!(false), json!(0), json!(-1), json!(1), json!(2), json!(129), json!(256),
            json!(u32::MAX), json!(u64::MAX), json!(i64::MIN), json!(0.5), json!(-0.0), json!(1e300), json!(-1e300),
            json!(f64::MIN_POSITIVE), json!(""), json!("x"), json!("NaN"), json!("Infinity"), json!([]), json!({}),
            json!([""]), json!(["a", "b", "c", "d", "e"]), json!([1, 2, 300]), json!([-1]), json!([[1], [2, 256]]),
            json!({"type": "json_object"}), json!({"include_usage": "yes"}), json!([{"role": "user"}]),
            json!([{"role": "user", "content": [{"type": "image_url"}]}]), json!([{"role": 5, "content": "x"}]),
        ]),
        1 => any::<i64>().prop_map(Value::from),
        1 => any::<u64>().prop_map(Value::from),
        1 => any::<f64>().prop_map(|x| json!(x)),
        1 => (0usize..50_000).prop_map(|n| Value::String("y".repeat(n))),
        1 => (0usize..2_000, 0u64..1000).prop_map(|(n, base)| Value::Array((0..n as u64).map(|i| Value::from(base + i)).collect())),
        1 => (0usize..100).prop_map(|d| (0..d).fold(json!(1), |v, _| json!([v]))),
    ]
}

/// One edit of a valid body.
#[derive(Debug, Clone)]
pub enum BodyEdit {
    Set { field: usize, value: Value },
    Remove { field: usize },
}

/// One edit of a body's JSON text.
#[derive(Debug, Clone)]
pub enum TextEdit {
    Json(JsonEdit),
    /// The body inside `depth` arrays.
    Nest {
        depth: usize,
    },
}

/// A request body.
#[derive(Debug, Clone)]
pub enum BodyInput {
    Bytes { chat: bool, bytes: Vec<u8> },
    Json { chat: bool, value: Value },
    Mutated { base: ValidBody, edits: Vec<BodyEdit>, text: Vec<TextEdit> },
}

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(|x| json!(x)),
        prop::collection::vec(any::<char>(), 0..8).prop_map(|v| Value::String(v.into_iter().collect())),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(BODY_FIELDS.to_vec()).prop_map(str::to_string), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

pub fn body_input() -> impl Strategy<Value = BodyInput> {
    let body_edit = prop_oneof![
        4 => (0..BODY_FIELDS.len(), weird_value()).prop_map(|(field, value)| BodyEdit::Set { field, value }),
        1 => (0..BODY_FIELDS.len()).prop_map(|field| BodyEdit::Remove { field }),
    ];
    let text_edit = prop_oneof![4 => json_edit().prop_map(TextEdit::Json), 1 => (1usize..5000).prop_map(|depth| TextEdit::Nest { depth })];
    prop_oneof![
        1 => (any::<bool>(), prop::collection::vec(any::<u8>(), 0..128)).prop_map(|(chat, bytes)| BodyInput::Bytes { chat, bytes }),
        2 => (any::<bool>(), any_json()).prop_map(|(chat, value)| BodyInput::Json { chat, value }),
        8 => (valid_body(), prop::collection::vec(body_edit, 0..4), prop::collection::vec(text_edit, 0..2))
            .prop_map(|(base, edits, text)| BodyInput::Mutated { base, edits, text }),
    ]
}

impl BodyInput {
    /// The endpoint, the body's bytes, and whether it is a valid body left unedited.
    pub fn encode(&self) -> (Endpoint, Vec<u8>, bool) {
        let ep = |chat: bool| if chat { Endpoint::Chat } else { Endpoint::Completions };
        match self {
            BodyInput::Bytes { chat, bytes } => (ep(*chat), bytes.clone(), false),
            BodyInput::Json { chat, value } => (ep(*chat), serde_json::to_vec(value).unwrap_or_default(), false),
            BodyInput::Mutated { base, edits, text } => {
                let mut v = base.json();
                if let Value::Object(o) = &mut v {
                    for e in edits {
                        match e {
                            BodyEdit::Set { field, value } => {
                                o.insert(BODY_FIELDS[field % BODY_FIELDS.len()].into(), value.clone());
                            }
                            BodyEdit::Remove { field } => {
                                o.remove(BODY_FIELDS[field % BODY_FIELDS.len()]);
                            }
                        }
                    }
                }
                let mut bytes = serde_json::to_vec(&v).unwrap_or_default();
                for t in text {
                    match t {
                        TextEdit::Json(e) => bytes = mutate_json(&bytes, std::slice::from_ref(e)),
                        TextEdit::Nest { depth } => {
                            let mut b = "[".repeat(*depth).into_bytes();
                            b.extend_from_slice(&bytes);
                            b.extend(std::iter::repeat_n(b']', *depth));
                            bytes = b;
                        }
                    }
                }
                (ep(base.chat), bytes, edits.is_empty() && text.is_empty())
            }
        }
    }
}

/// A body: refused with a reason, or accepted as a generation the served topology
/// can run (every choice fits the context and the places).
pub fn check_body(topo: &Topology, input: &BodyInput) -> Verdict {
    let (endpoint, bytes, valid) = input.encode();
    match openai::parse(topo, endpoint, &bytes, 7) {
        Err(e) => {
            if valid {
                return Err(format!("a valid body was refused: {e}"));
            }
            if e.to_string().trim().is_empty() {
                return Err(format!("a refusal without a message: {e:?}"));
            }
            let _ = e.param();
            let class = match e {
                BodyError::Malformed(_) => "refused: malformed",
                BodyError::Invalid { .. } => "refused: invalid",
                BodyError::Unsupported { .. } => "refused: unsupported",
                BodyError::TokenId(_) => "refused: token id",
                BodyError::ModelNotFound(_) => "refused: model",
                BodyError::Admission(_) => "refused: admission",
            };
            Ok(class.into())
        }
        Ok(g) => {
            let s = &topo.config.serve;
            if g.prompts.is_empty() || g.prompts.len() != g.max_tokens.len() {
                return Err(format!("{} prompts, {} max_tokens", g.prompts.len(), g.max_tokens.len()));
            }
            for (p, &m) in g.prompts.iter().zip(&g.max_tokens) {
                if p.is_empty() || m == 0 || p.len() as u64 + u64::from(m) > u64::from(s.max_context) {
                    return Err(format!("accepted a prompt of {} tokens with max_tokens {m} under max_context {}", p.len(), s.max_context));
                }
            }
            let choices = g.choices();
            if !(1..=128).contains(&g.n) || choices.len() as u64 > u64::from(s.max_requests) || choices.len() != g.prompts.len() * g.n as usize {
                return Err(format!("accepted n {} with {} choices (max_requests {})", g.n, choices.len(), s.max_requests));
            }
            if !((0.0..=2.0).contains(&g.temperature) && g.top_p > 0.0 && g.top_p <= 1.0) {
                return Err(format!("accepted temperature {} top_p {}", g.temperature, g.top_p));
            }
            if g.stop.len() > 4 || g.stop.iter().any(Vec::is_empty) {
                return Err(format!("accepted stops {:?}", g.stop));
            }
            Ok(if valid { "valid, accepted" } else { "mutated, accepted" }.into())
        }
    }
}
