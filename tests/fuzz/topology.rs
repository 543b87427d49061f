//! Topology files: structured mutations of the shipped ones, and what `Topology::parse`
//! and `handoff check` make of them.

use super::*;
use handoff_components::Topology;
use handoff_components::config::ConfigError;
use handoff_components::vocab::{DecodeRank, PrefillRank, RankId};
use handoff_systems::placement::{Capacity, place_rank};
use std::fmt::Debug;

// ---- topology files ----

/// The shipped topology files, the seeds of the structured mutations.
pub const SHIPPED_CONFIGS: [(&str, &str); 6] = [
    ("k3-pp8-tp8dcp8.toml", include_str!("../../config/k3-pp8-tp8dcp8.toml")),
    ("medium.toml", include_str!("../../config/medium.toml")),
    ("pp3-tp2-to-tp4dcp2.toml", include_str!("../../config/pp3-tp2-to-tp4dcp2.toml")),
    ("small.toml", include_str!("../../config/small.toml")),
    ("trained.toml", include_str!("../../config/trained.toml")),
    ("trained-pp4-tp4dcp4.toml", include_str!("../../config/trained-pp4-tp4dcp4.toml")),
];

/// One edit of a topology file's lines. Indices are taken modulo what exists.
#[derive(Debug, Clone)]
pub enum TomlEdit {
    /// The value of the n-th `key = value` line.
    Set {
        line: usize,
        value: String,
    },
    Drop {
        line: usize,
    },
    Duplicate {
        line: usize,
    },
    /// A key the schema does not have, or one of another table, after a line.
    AddKey {
        line: usize,
        key: String,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Truncate {
        at: usize,
    },
}

/// A topology file to parse.
#[derive(Debug, Clone)]
pub enum TomlInput {
    Bytes(Vec<u8>),
    Mutated { base: usize, edits: Vec<TomlEdit> },
}

impl TomlInput {
    pub fn text(&self) -> String {
        match self {
            TomlInput::Bytes(b) => String::from_utf8_lossy(b).into_owned(),
            TomlInput::Mutated { base, edits } => mutate_toml(SHIPPED_CONFIGS[base % SHIPPED_CONFIGS.len()].1, edits),
        }
    }
}

fn is_assignment(l: &str) -> bool {
    let t = l.trim_start();
    !t.starts_with('#') && !t.starts_with('[') && t.contains('=')
}

/// Applies the edits to a file's text, in order.
pub fn mutate_toml(base: &str, edits: &[TomlEdit]) -> String {
    let mut lines: Vec<String> = base.lines().map(str::to_string).collect();
    let assignment = |lines: &[String], n: usize| -> Option<usize> {
        let idx: Vec<usize> = (0..lines.len()).filter(|&i| is_assignment(&lines[i])).collect();
        (!idx.is_empty()).then(|| idx[n % idx.len()])
    };
    let mut text = None::<String>;
    for e in edits {
        // Byte-level edits work on the joined text; line edits after one see its lines.
        if let Some(t) = text.take() {
            lines = t.lines().map(str::to_string).collect();
        }
        match e {
            TomlEdit::Set { line, value } => {
                if let Some(i) = assignment(&lines, *line) {
                    let key = lines[i].split('=').next().unwrap_or("").to_string();
                    lines[i] = format!("{key}= {value}");
                }
            }
            TomlEdit::Drop { line } => {
                if let Some(i) = assignment(&lines, *line) {
                    lines.remove(i);
                }
            }
            TomlEdit::Duplicate { line } => {
                if let Some(i) = assignment(&lines, *line) {
                    let l = lines[i].clone();
                    lines.insert(i + 1, l);
                }
            }
            TomlEdit::AddKey { line, key } => {
                let i = if lines.is_empty() { 0 } else { line % lines.len() + 1 };
                lines.insert(i.min(lines.len()), format!("{key} = 1"));
            }
            TomlEdit::Insert { at, bytes } => {
                let mut t = lines.join("\n").into_bytes();
                let at = at % (t.len() + 1);
                t.splice(at..at, bytes.iter().copied());
                text = Some(String::from_utf8_lossy(&t).into_owned());
            }
            TomlEdit::Truncate { at } => {
                let t = lines.join("\n");
                let mut at = at % (t.len() + 1);
                while !t.is_char_boundary(at) {
                    at -= 1;
                }
                text = Some(t[..at].to_string());
            }
        }
    }
    text.unwrap_or_else(|| lines.join("\n"))
}

/// Values a field of a topology file may be set to: edges of every integer type,
/// floats where integers go, other TOML types, and ordinary small numbers.
fn toml_value() -> impl Strategy<Value = String> {
    // Most fields are counts: integer edges reach validation, the rest the parser.
    let counts = prop::sample::select(vec![
        "0",
        "1",
        "2",
        "3",
        "4",
        "5",
        "7",
        "8",
        "16",
        "64",
        "4096",
        "4097",
        "65537",
        "1000000",
        "4294967295",
        "1e300",
        "0.001",
        "-1",
    ])
    .prop_map(str::to_string);
    let fixed = prop::sample::select(vec![
        "-1",
        "4294967296",
        "2147483648",
        "9223372036854775807",
        "-9223372036854775808",
        "99999999999999999999",
        "-1e300",
        "1.5",
        "-0.0",
        "nan",
        "inf",
        "-inf",
        "true",
        "\"\"",
        "\"K\"",
        "\"M\"",
        "\"KKKM\"",
        "\"MX\"",
        "\"tcp\"",
        "\"shm\"",
        "\"cuda:99999999999\"",
        "[]",
        "[0]",
        "[1, 1]",
        "[4294967295, 4294967295]",
        "{}",
        "{ a = 1 }",
        "1979-05-27",
        "'''\nx'''",
    ])
    .prop_map(str::to_string);
    prop_oneof![
        6 => counts,
        2 => fixed,
        1 => any::<u32>().prop_map(|x| x.to_string()),
        1 => any::<i64>().prop_map(|x| x.to_string()),
        1 => (1u32..=9).prop_map(|k| (1u64 << (k * 4)).to_string()),
        1 => prop::collection::vec(prop::sample::select(vec!['K', 'M', 'x']), 0..12).prop_map(|v| format!("\"{}\"", v.into_iter().collect::<String>())),
        1 => prop::collection::vec(0u32..80, 0..10).prop_map(|v| format!("{v:?}")),
    ]
}

fn toml_edit() -> impl Strategy<Value = TomlEdit> {
    prop_oneof![
        // Other edits mostly make a file TOML or the schema refuses; values reach validation.
        16 => (any::<usize>(), toml_value()).prop_map(|(line, value)| TomlEdit::Set { line, value }),
        1 => any::<usize>().prop_map(|line| TomlEdit::Drop { line }),
        1 => any::<usize>().prop_map(|line| TomlEdit::Duplicate { line }),
        1 => (any::<usize>(), prop::sample::select(vec!["bogus", "pp", "[model]", "[prefill]\npp", "model.mla.heads", "\"q\""]))
            .prop_map(|(line, key)| TomlEdit::AddKey { line, key: key.to_string() }),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..8)).prop_map(|(at, bytes)| TomlEdit::Insert { at, bytes }),
        1 => any::<usize>().prop_map(|at| TomlEdit::Truncate { at }),
    ]
}

pub fn topology_input() -> impl Strategy<Value = TomlInput> {
    prop_oneof![
        1 => prop::collection::vec(any::<u8>(), 0..256).prop_map(TomlInput::Bytes),
        8 => (0..SHIPPED_CONFIGS.len(), prop::collection::vec(toml_edit(), 0..3)).prop_map(|(base, edits)| TomlInput::Mutated { base, edits }),
    ]
}

/// A topology text: refused with a message, or valid and every figure `handoff
/// check` prints and every serving-capacity layout derivable without overflow.
pub fn check_topology(text: &str) -> Verdict {
    let topo = match Topology::parse(text) {
        Err(e) => {
            let msg = e.to_string();
            if msg.trim().is_empty() {
                return Err(format!("refusal without a message: {e:?}"));
            }
            let class = match e {
                ConfigError::Parse { .. } => "refused: parse",
                ConfigError::Zero { .. } => "refused: zero",
                ConfigError::TooLarge { .. } | ConfigError::TimeoutTooLong { .. } | ConfigError::Footprint { .. } => "refused: too large",
                _ => "refused: inconsistent",
            };
            return Ok(class.into());
        }
        Ok(t) => t,
    };
    let m = topo.model();
    if topo.layer_kinds.len() != m.num_layers as usize {
        return Err(format!("{} layer kinds for {} layers", topo.layer_kinds.len(), m.num_layers));
    }
    let mut next = 0;
    for r in &topo.stage_layers {
        if r.start != next || r.end <= r.start {
            return Err(format!("stage layers {:?} do not tile 0..{}", topo.stage_layers, m.num_layers));
        }
        next = r.end;
    }
    if next != m.num_layers || topo.stage_layers.len() != topo.prefill().pp as usize {
        return Err(format!("stage layers {:?} do not tile 0..{} in {} stages", topo.stage_layers, m.num_layers, topo.prefill().pp));
    }
    let summary = handoff::cli::summary(&topo, "<fuzz>");
    if !summary.contains(": ok") {
        return Err(format!("summary of an accepted topology does not say ok: {summary}"));
    }
    let cap = Capacity::serving(&topo);
    for rank in [RankId::Prefill(PrefillRank { pp: topo.prefill().pp - 1, tp: 0 }), RankId::Decode(DecodeRank { tp: topo.decode().tp - 1 })] {
        let blocks = if matches!(rank, RankId::Prefill(_)) { cap.prefill_blocks } else { cap.decode_blocks };
        for r in place_rank(&topo, rank, blocks, cap.slots).regions {
            // A paged region's length, recomputed in u128: a wrapped u64 differs.
            let per_row = u128::from(r.units) * u128::from(r.unit_bytes);
            if r.kind.is_paged() && u128::from(r.len) != r.rows.len() as u128 * per_row {
                return Err(format!("{rank:?} {}: len {} but {} rows of {per_row} B", r.kind.name(), r.len, r.rows.len()));
            }
        }
    }
    Ok("accepted".into())
}
