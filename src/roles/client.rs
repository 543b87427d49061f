//! A client of a running proxy: one non-streaming completion and the reason of a
//! failed one. The demo, `bench serve`, the soak and the tests talk to a cluster
//! through it, so that they all read an answer the same way.

use super::wire;
use std::time::Duration;

/// One completion's answer, as the demo and bench read it.
#[derive(Debug, Clone, Default)]
pub struct CompletionAnswer {
    pub text: String,
    pub token_ids: Vec<u8>,
    pub ttft_ms: f64,
    pub itl_ms: Vec<f64>,
    pub bytes: u64,
    pub queue_ms: f64,
    pub handoff_ms: f64,
    /// The hand-off tail (the longest of the stages' last layer to write-done),
    /// when the answer carries one.
    pub tail_ms: Option<f64>,
    /// The compute time of the stage with that tail, when the answer carries it.
    pub stage_prefill_ms: Option<f64>,
    pub decode_ms: f64,
}

/// Sends one non-streaming completion; Err carries status and body.
pub fn complete(addr: &str, prompt: &str, max_tokens: u32) -> Result<CompletionAnswer, (u16, String)> {
    let body = serde_json::json!({"prompt": prompt, "max_tokens": max_tokens}).to_string();
    let r = wire::http(addr, "POST", "/v1/completions", Some(&body), Duration::from_secs(120)).map_err(|e| (0, e.to_string()))?;
    if r.status != 200 {
        return Err((r.status, r.body));
    }
    let v = r.json().ok_or((r.status, r.body.clone()))?;
    let c = &v["choices"][0];
    let h = &v["handoff"];
    let f = |k: &str| h[k].as_f64().unwrap_or(0.0);
    Ok(CompletionAnswer {
        text: c["text"].as_str().unwrap_or("").to_string(),
        token_ids: c["token_ids"].as_array().map(|a| a.iter().filter_map(|x| x.as_u64()).map(|x| x as u8).collect()).unwrap_or_default(),
        ttft_ms: f("ttft_ms"),
        itl_ms: h["itl_ms"].as_array().map(|a| a.iter().filter_map(|x| x.as_f64()).collect()).unwrap_or_default(),
        bytes: h["bytes_handed_off"].as_u64().unwrap_or(0),
        queue_ms: f("queue_ms"),
        handoff_ms: f("handoff_ms"),
        tail_ms: h["tail_ms"].as_f64(),
        stage_prefill_ms: h["stage_prefill_ms"].as_f64(),
        decode_ms: f("decode_ms"),
    })
}

/// The reason of a failed completion: the message of an OpenAI-style error body,
/// else the body (or the I/O error) itself, cut to one line.
pub fn failure_reason(body: &str) -> String {
    let v: Option<serde_json::Value> = serde_json::from_str(body).ok();
    let msg = v.as_ref().and_then(|v| v["error"]["message"].as_str()).map(str::to_string).unwrap_or_else(|| body.to_string());
    let line = msg.lines().next().unwrap_or("").trim();
    let mut out: String = line.chars().take(160).collect();
    if out.is_empty() {
        out = "(empty body)".into();
    } else if line.chars().count() > 160 {
        out.push_str("...");
    }
    out
}

/// The `q` quantile of `xs` (sorted in place), 0 for none: the demo and the
/// benches summarise latencies with it.
pub fn percentile(xs: &mut [f64], q: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(|a, b| a.total_cmp(b));
    let i = ((xs.len() as f64 - 1.0) * q).round() as usize;
    xs[i.min(xs.len() - 1)]
}
