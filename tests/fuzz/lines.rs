//! JSON-line control messages between roles: valid encodings of every message, and
//! byte and structure mutations of them.

use super::*;
use handoff::roles::sampling::Sampling;
use handoff::roles::wire::{self, Admitted, Msg, Notice, Register, WirePrefillJob};
use handoff::transport::{MemoryKind, PeerAddr, RegionHandle};
use handoff_components::ecs::{PhaseName, StageReport};
use handoff_components::layout::ConsumerLayout;
use handoff_components::vocab::{DecodeRank, PrefillRank, RankId, RegionKind};
use handoff_components::{Cause, Failure, PeerLoss, ProcessRole};
use handoff_systems::placement::place_rank;
use std::fmt::Debug;
use std::io::Cursor;
use std::net::SocketAddr;

// ---- control messages ----

/// Valid encodings of every message kind, each with the decoder that reads it.
pub fn valid_lines() -> Vec<(&'static str, Vec<u8>)> {
    let topo = small_topology();
    let layout = place_rank(&topo, RankId::Decode(DecodeRank { tp: 0 }), 4, 2);
    let consumer = ConsumerLayout { rank: DecodeRank { tp: 0 }, tp: 2, dcp: 2, interleave: 1, blocks: vec![0, 3], slot: 1, layout };
    let endpoint = PeerAddr::Tcp { addr: SocketAddr::from(([127, 0, 0, 1], 4000)) };
    let handle = RegionHandle {
        peer: endpoint.clone(),
        id: 7,
        rank: RankId::Decode(DecodeRank { tp: 1 }),
        kind: RegionKind::KdaConv,
        len: 4096,
        memory: MemoryKind::Host,
        ipc: None,
        remote_key: None,
    };
    let admitted = Admitted { id: 5, nonce: 9, consumers: vec![consumer], handles: vec![handle], endpoint };
    let sampling = Some(Sampling { temperature: 0.7, top_p: 0.9, seed: u64::MAX, choice: 3 });
    let job = WirePrefillJob {
        admitted: admitted.clone(),
        prompt: b"hello".to_vec(),
        stage: 1,
        stages: vec![SocketAddr::from(([127, 0, 0, 1], 4001)), SocketAddr::from(([127, 0, 0, 1], 4002))],
        hidden: Some(vec![0.5, -1.0, f32::MIN_POSITIVE, 3.0e9]),
        sampling,
    };
    let msgs = [
        Msg::Admit { id: 1, prompt_tokens: 12, max_tokens: 4, sampling: None, forced: Vec::new() },
        Msg::Admit { id: 2, prompt_tokens: 1, max_tokens: 1, sampling, forced: vec![7, 255] },
        Msg::Admitted(Box::new(admitted)),
        Msg::Token { id: 3, token: 255 },
        Msg::Done { id: 3, handoff_ms: 1.5, decode_ms: 0.25, bytes: 1 << 40, tail_ms: Some(0.75), stage_prefill_ms: Some(12.5) },
        Msg::Error {
            id: 4,
            failure: Failure::new(PhaseName::Transfer, ProcessRole::Prefill { stage: 1 }, Cause::PeerDown { loss: PeerLoss::Dead, detail: "died".into() }),
        },
        Msg::Cancel { id: 4, failure: Failure::new(PhaseName::Admission, ProcessRole::Proxy, Cause::Cancelled { detail: "client left".into() }), unsent: true },
        Msg::Prefill(Box::new(job)),
        Msg::StageDown { stage: 2, dead: true, message: "exited".into() },
    ];
    let mut out: Vec<(&'static str, Vec<u8>)> = msgs
        .iter()
        .map(|m| {
            let mut line = Vec::new();
            wire::encode_into(&mut line, m).expect("encode");
            ("msg", line)
        })
        .collect();
    let report = StageReport {
        request: 5,
        nonce: 9,
        stage: 0,
        pairs: vec![(PrefillRank { pp: 0, tp: 0 }, DecodeRank { tp: 1 })],
        first_token: Some(b'a'),
        bytes: 4096,
        tail_us: Some(1250),
        compute_us: Some(40_000),
    };
    for n in [
        Notice::Written(report),
        Notice::Failed {
            id: 5,
            nonce: None,
            stage: 1,
            failure: Failure::new(PhaseName::Compute, ProcessRole::Prefill { stage: 1 }, Cause::Compute { detail: "oom".into() }),
        },
    ] {
        out.push(("notice", serde_json::to_vec(&n).expect("encode")));
    }
    let reg = Register {
        role: "prefill".into(),
        stage: Some(1),
        addr: SocketAddr::from(([127, 0, 0, 1], 4003)),
        pid: 42,
        counts: Default::default(),
        rss_bytes: 1 << 30,
        restarts: 2,
        timings: vec![handoff::roles::prom::SystemTiming {
            system: "dispatch::run_decode".into(),
            phase: "dispatch".into(),
            cumulative: vec![1, 2],
            count: 2,
            sum_s: 1e-3,
        }],
        unauthenticated: [("tcp".to_string(), 3u64)].into_iter().collect(),
        refused_frames: [("control".to_string(), 1u64)].into_iter().collect(),
    };
    out.push(("register", serde_json::to_vec(&reg).expect("encode")));
    out
}

/// One edit of a JSON text. Indices are taken modulo what exists.
#[derive(Debug, Clone)]
pub enum JsonEdit {
    Flip {
        at: usize,
        xor: u8,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Truncate {
        at: usize,
    },
    /// The n-th number literal becomes another.
    Number {
        nth: usize,
        literal: String,
    },
    /// The n-th string literal becomes a long one.
    LongString {
        nth: usize,
        len: usize,
    },
    /// The n-th string literal becomes another JSON value (a type change).
    Retype {
        nth: usize,
        value: String,
    },
}

/// Bytes handed to a decoder.
#[derive(Debug, Clone)]
pub enum LineInput {
    Bytes(Vec<u8>),
    Mutated {
        seed: usize,
        edits: Vec<JsonEdit>,
    },
    /// `depth` nested arrays or objects.
    Nested {
        depth: usize,
        object: bool,
    },
    /// Several lines in a row, some valid, one stream.
    Stream {
        seeds: Vec<usize>,
    },
}

fn spans(text: &[u8], number: bool) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < text.len() {
        let c = text[i];
        if number && (c.is_ascii_digit() || c == b'-') && (i == 0 || !text[i - 1].is_ascii_alphanumeric()) {
            let s = i;
            while i < text.len() && (text[i].is_ascii_digit() || b"-+.eE".contains(&text[i])) {
                i += 1;
            }
            out.push((s, i));
            continue;
        }
        if !number && c == b'"' {
            let s = i;
            i += 1;
            while i < text.len() && text[i] != b'"' {
                i += if text[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(text.len());
            out.push((s, i));
            continue;
        }
        i += 1;
    }
    out
}

pub fn mutate_json(base: &[u8], edits: &[JsonEdit]) -> Vec<u8> {
    let mut t = base.to_vec();
    for e in edits {
        match e {
            JsonEdit::Flip { at, xor } => {
                if !t.is_empty() {
                    let i = at % t.len();
                    t[i] ^= xor | 1;
                }
            }
            JsonEdit::Insert { at, bytes } => {
                let i = at % (t.len() + 1);
                t.splice(i..i, bytes.iter().copied());
            }
            JsonEdit::Truncate { at } => t.truncate(at % (t.len() + 1)),
            JsonEdit::Number { nth, literal } => {
                let s = spans(&t, true);
                if !s.is_empty() {
                    let (a, b) = s[nth % s.len()];
                    t.splice(a..b, literal.bytes());
                }
            }
            JsonEdit::LongString { nth, len } => {
                let s = spans(&t, false);
                if !s.is_empty() {
                    let (a, b) = s[nth % s.len()];
                    let long = format!("\"{}\"", "x".repeat(*len));
                    t.splice(a..b, long.bytes());
                }
            }
            JsonEdit::Retype { nth, value } => {
                let s = spans(&t, false);
                if !s.is_empty() {
                    let (a, b) = s[nth % s.len()];
                    t.splice(a..b, value.bytes());
                }
            }
        }
    }
    t
}

fn json_literal() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec![
            "0", "-1", "-0", "1e999", "-1e999", "1e-999", "0.5", "255", "256", "4294967295", "4294967296",
            "18446744073709551615", "18446744073709551616", "-9223372036854775809", "NaN", "Infinity", "null",
            "true", "\"1\"", "[]", "{}", "[1,2,3]", "{\"a\":1}",
        ])
        .prop_map(str::to_string),
        1 => any::<i64>().prop_map(|x| x.to_string()),
        1 => any::<u64>().prop_map(|x| x.to_string()),
        1 => any::<f64>().prop_map(|x| format!("{x:e}")),
    ]
}

pub fn json_edit() -> impl Strategy<Value = JsonEdit> {
    prop_oneof![
        2 => (any::<usize>(), any::<u8>()).prop_map(|(at, xor)| JsonEdit::Flip { at, xor }),
        2 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..6)).prop_map(|(at, bytes)| JsonEdit::Insert { at, bytes }),
        1 => (any::<usize>(), prop::sample::select(vec![&b"\n"[..], b"{", b"}", b"\"", b"\\", b"\xff", b"\0", b",", b"]"]))
            .prop_map(|(at, b)| JsonEdit::Insert { at, bytes: b.to_vec() }),
        2 => any::<usize>().prop_map(|at| JsonEdit::Truncate { at }),
        4 => (any::<usize>(), json_literal()).prop_map(|(nth, literal)| JsonEdit::Number { nth, literal }),
        1 => (any::<usize>(), 0usize..100_000).prop_map(|(nth, len)| JsonEdit::LongString { nth, len }),
        3 => (any::<usize>(), json_literal()).prop_map(|(nth, value)| JsonEdit::Retype { nth, value }),
    ]
}

pub fn line_input() -> impl Strategy<Value = LineInput> {
    let seeds = valid_lines().len();
    prop_oneof![
        2 => prop::collection::vec(any::<u8>(), 0..256).prop_map(LineInput::Bytes),
        8 => (0..seeds, prop::collection::vec(json_edit(), 0..4)).prop_map(|(seed, edits)| LineInput::Mutated { seed, edits }),
        1 => (1usize..20_000, any::<bool>()).prop_map(|(depth, object)| LineInput::Nested { depth, object }),
        1 => prop::collection::vec(0..seeds, 1..6).prop_map(|seeds| LineInput::Stream { seeds }),
    ]
}

fn nested(depth: usize, object: bool) -> Vec<u8> {
    let (open, close): (&[u8], &[u8]) = if object { (b"{\"a\":", b"}") } else { (b"[", b"]") };
    let mut t = Vec::with_capacity(depth * (open.len() + 1) + 8);
    t.extend_from_slice(b"{\"type\":\"admit\",\"id\":");
    for _ in 0..depth {
        t.extend_from_slice(open);
    }
    t.push(b'1');
    for _ in 0..depth {
        t.extend_from_slice(close);
    }
    t.push(b'}');
    t
}

/// Reads every message of a stream as a role does; `Ok` with how many decoded.
fn read_stream(bytes: &[u8]) -> std::result::Result<(usize, usize), String> {
    let mut r = Cursor::new(bytes);
    let (mut ok, mut bad) = (0, 0);
    // Each read consumes at least one byte, so this many reads end any stream.
    for _ in 0..=bytes.len() {
        match wire::recv(&mut r) {
            Ok(None) => return Ok((ok, bad)),
            Ok(Some(_)) => ok += 1,
            // A role gives the link up at a bad line; the test reads on to cover
            // every line of the stream.
            Err(e) => {
                if e.to_string().is_empty() {
                    return Err("an error without a message".into());
                }
                bad += 1;
            }
        }
    }
    Err(format!("{} reads did not end a stream of {} bytes", bytes.len() + 1, bytes.len()))
}

/// Every decoder of what roles send one another: no panic, and a valid encoding
/// decodes (to a message that re-encodes to the same bytes).
pub fn check_line(input: &LineInput) -> Verdict {
    let seeds = valid_lines();
    let (bytes, valid) = match input {
        LineInput::Bytes(b) => (b.clone(), None),
        LineInput::Mutated { seed, edits } => {
            let (kind, line) = &seeds[seed % seeds.len()];
            (mutate_json(line, edits), edits.is_empty().then_some(*kind))
        }
        LineInput::Nested { depth, object } => (nested(*depth, *object), None),
        LineInput::Stream { seeds: picks } => {
            let msg: Vec<&Vec<u8>> = seeds.iter().filter(|(k, _)| *k == "msg").map(|(_, l)| l).collect();
            let mut b = Vec::new();
            for p in picks {
                b.extend_from_slice(msg[p % msg.len()]);
            }
            let (ok, _) = read_stream(&b)?;
            if ok != picks.len() {
                return Err(format!("a stream of {} valid lines decoded {ok}", picks.len()));
            }
            return Ok("stream decoded".into());
        }
    };
    let (ok, _) = read_stream(&bytes)?;
    let msg = serde_json::from_slice::<Msg>(&bytes);
    let notice = serde_json::from_slice::<Notice>(&bytes);
    let register = serde_json::from_slice::<Register>(&bytes);
    match valid {
        Some("msg") => {
            let m = msg.map_err(|e| format!("a valid message was refused: {e}"))?;
            let mut again = Vec::new();
            wire::encode_into(&mut again, &m).map_err(|e| e.to_string())?;
            if again != bytes {
                return Err(format!("re-encoding differs: {}", String::from_utf8_lossy(&again)));
            }
            if ok != 1 {
                return Err("recv did not decode a valid line".into());
            }
        }
        Some("notice") => {
            notice.map_err(|e| format!("a valid notice was refused: {e}"))?;
        }
        Some(_) => {
            register.map_err(|e| format!("a valid registration was refused: {e}"))?;
        }
        None => {}
    }
    Ok(if valid.is_some() {
        "valid, decoded"
    } else if ok > 0 {
        "mutated, decoded"
    } else {
        "mutated, refused"
    }
    .into())
}
