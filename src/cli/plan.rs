//! The CLI's commands over the engine: check, plan, verify. Output formatting lives
//! here; the engine and phases know nothing of it.

use crate::check::CheckError;
use crate::engine::profile::Profiler;
use crate::engine::{Engine, QueueMover};
use handoff_components::Topology;
use handoff_components::plan::Plan;
use handoff_components::vocab::{LayerKind, RankId, RegionKind};
use handoff_systems::placement::{Capacity, owned_tokens, place_rank};
use serde_json::json;
use std::collections::BTreeMap;

/// A one-screen summary of a validated topology.
pub fn summary(topo: &Topology, path: &str) -> String {
    let m = topo.model();
    let (p, d) = (topo.prefill(), topo.decode());
    let mut s = format!("config {path}: ok\n");
    s += &format!(
        "model {}: {} layers ({} KDA, {} MLA), pattern {}, hidden {}, dtype {}, weights {}{}\n",
        m.name,
        m.num_layers,
        topo.all_layers_of(LayerKind::Kda).len(),
        topo.all_layers_of(LayerKind::Mla).len(),
        m.pattern,
        m.hidden_size,
        m.dtype.name(),
        m.weight_dtype.name(),
        m.replay.as_ref().map_or(String::new(), |r| format!(", replay ring {}", r.capacity)),
    );
    s += &format!(
        "prefill: pp {} x tp {} = {} ranks, block {}, {} transfer\n",
        p.pp,
        p.tp,
        u64::from(p.pp) * u64::from(p.tp),
        p.block_size,
        if p.chunked {
            format!("chunked ({} tokens a chunk, rounded to whole interleave x dcp groups; the KDA state with the last chunk)", p.chunk_tokens)
        } else {
            "whole-request".to_string()
        }
    );
    s += &format!(
        "  layer-wise streaming: {}\n",
        match (p.layer_streaming, p.chunked) {
            (true, false) => "on (each layer's writes leave as soon as the layer is computed; the write-done report waits for every layer)",
            (true, true) => "off: a chunked transfer keeps its token order (layer_streaming = true, chunked = true)",
            (false, _) => "off (layer_streaming = false: a stage's writes leave once it has computed every layer)",
        }
    );
    for (i, r) in topo.stage_layers.iter().enumerate() {
        let k = topo.layers_of(LayerKind::Kda, r.clone()).len();
        let mm = topo.layers_of(LayerKind::Mla, r.clone()).len();
        s += &format!("  stage {i}: layers {}..{} ({} KDA, {} MLA)\n", r.start, r.end, k, mm);
    }
    s += &format!(
        "decode: tp {} x dcp {} (groups of {} ranks), interleave {}, block {}; {} KDA heads per rank\n",
        d.tp,
        d.dcp,
        d.dcp,
        d.interleave,
        d.block_size,
        topo.decode_heads()
    );
    s += &format!("transport: {}\n", topo.config.transport.kind.name());
    let dev = topo.config.device;
    s += &format!(
        "device: {dev}{}\n",
        if dev.kind == handoff_components::config::DeviceKind::Cpu {
            String::new()
        } else {
            format!(
                ", decode step {}, {}{}",
                if dev.graphs { "captured as a CUDA graph per batch bucket (graphs = true)" } else { "launched kernel by kernel (graphs = false)" },
                if dev.dependent_launch {
                    "each kernel launched as a programmatic dependent of the one before where the GPU has it, sm_90 on (dependent_launch = true)"
                } else {
                    "in plain stream order (dependent_launch = false)"
                },
                if dev.mps && dev.kind == handoff_components::config::DeviceKind::Cuda {
                    "; `up` runs the roles under an MPS server of its own (mps = true)"
                } else {
                    ""
                }
            )
        }
    );
    s += "bytes moved into one decode rank (tp0):\n";
    let layout = place_rank(topo, RankId::Decode(handoff_components::DecodeRank { tp: 0 }), 0, 0);
    for kind in topo.region_kinds() {
        let r = layout.region(kind).expect("placed");
        let rows = r.rows.len() as u64;
        if kind.is_paged() {
            s += &format!("  {:<15} {:>12} B per owned token ({} layers x {} B)\n", kind.name(), rows * r.token_bytes, rows, r.token_bytes);
        } else {
            s += &format!("  {:<15} {:>12} B per request ({} layers x {} B)\n", kind.name(), rows * r.unit_bytes, rows, r.unit_bytes);
        }
    }
    if let Err(reason) = topo.admits_transfer_mode() {
        s += &format!("note: every request will be rejected at admission: {reason}\n");
    }
    s
}

/// The plans of one request of `tokens` tokens, and the time the splitting phase took.
pub struct PlanRun {
    pub plans: Vec<Plan>,
    pub plan_us: f64,
    pub profiler: Profiler,
}

/// Places and splits one request through the engine (no bytes move).
pub fn plan_request(topo: &Topology, tokens: u64, profiler: Profiler) -> Result<PlanRun, CheckError> {
    let cap = Capacity::for_requests(topo, 1, tokens);
    let mut engine = Engine::new(topo.clone(), cap, Box::new(QueueMover::default()));
    engine.tick();
    profiler.runs.lock().map_err(|_| CheckError::Poisoned("the profiler"))?.clear();
    engine.submit(1, tokens);
    engine.tick();
    for o in engine.take_outcomes() {
        if let Err(failure) = o.result {
            return Err(CheckError::Failed { request: o.request, failure });
        }
    }
    let plans = engine.plans(1);
    if plans.is_empty() {
        return Err(CheckError::Engine(format!("no plans were made: {:?}", engine.status(1))));
    }
    let plan_us = profiler.phase_us("splitting");
    Ok(PlanRun { plans, plan_us, profiler })
}

fn by_kind(plans: &[&Plan]) -> BTreeMap<&'static str, u64> {
    let mut m = BTreeMap::new();
    for p in plans {
        for d in &p.descriptors {
            *m.entry(d.kind.name()).or_default() += d.bytes();
        }
    }
    m
}

/// `plan --json`.
pub fn plan_json(topo: &Topology, tokens: u64, run: &PlanRun) -> serde_json::Value {
    let dcp = topo.decode().dcp;
    let pairs: Vec<_> = run
        .plans
        .iter()
        .map(|p| {
            json!({
                "producer": {"pp": p.producer.pp, "tp": p.producer.tp},
                "consumer": {"tp": p.consumer.tp, "dcp": p.consumer.dcp_rank(dcp)},
                "descriptors": p.descriptors.len(),
                "uncoalesced": p.uncoalesced,
                "bytes": p.bytes(),
                "by_kind": by_kind(&[p]),
            })
        })
        .collect();
    let all: Vec<&Plan> = run.plans.iter().collect();
    json!({
        "tokens": tokens,
        "pairs": pairs,
        "totals": {
            "descriptors": run.plans.iter().map(|p| p.descriptors.len()).sum::<usize>(),
            "uncoalesced": run.plans.iter().map(|p| p.uncoalesced).sum::<u64>(),
            "bytes": run.plans.iter().map(Plan::bytes).sum::<u64>(),
            "by_kind": by_kind(&all),
            "plan_us": run.plan_us,
        }
    })
}

/// `plan` as a table.
pub fn plan_table(topo: &Topology, tokens: u64, run: &PlanRun) -> String {
    let dcp = topo.decode().dcp;
    let mut s = format!("{tokens} tokens, {} producer/consumer pairs\n", run.plans.len());
    s += &format!("{:<12} {:<12} {:>14} {:>12} {:>14}  by kind\n", "producer", "consumer", "pieces before", "descriptors", "bytes");
    for p in &run.plans {
        let kinds: Vec<String> = by_kind(&[p]).iter().map(|(k, b)| format!("{k} {b}")).collect();
        s += &format!(
            "{:<12} {:<12} {:>14} {:>12} {:>14}  {}\n",
            format!("pp{} tp{}", p.producer.pp, p.producer.tp),
            format!("tp{} dcp{}", p.consumer.tp, p.consumer.dcp_rank(dcp)),
            p.uncoalesced,
            p.descriptors.len(),
            p.bytes(),
            kinds.join(", ")
        );
    }
    let desc: usize = run.plans.iter().map(|p| p.descriptors.len()).sum();
    let unc: u64 = run.plans.iter().map(|p| p.uncoalesced).sum();
    let bytes: u64 = run.plans.iter().map(Plan::bytes).sum();
    s += &format!(
        "totals: {unc} pieces before coalescing, {desc} descriptors after ({:.1}x fewer), {bytes} bytes, planned in {:.1} us\n",
        unc as f64 / desc.max(1) as f64,
        run.plan_us
    );
    for (k, b) in by_kind(&run.plans.iter().collect::<Vec<_>>()) {
        s += &format!("  {k:<15} {b:>14} B\n");
    }
    s
}

/// Bytes the rules say one request moves into every decode rank together, by kind.
pub fn rule_bytes(topo: &Topology, tokens: u64) -> BTreeMap<RegionKind, u64> {
    let d = topo.decode();
    let layout = place_rank(topo, RankId::Decode(handoff_components::DecodeRank { tp: 0 }), 0, 0);
    let mut m = BTreeMap::new();
    for kind in topo.region_kinds() {
        let r = layout.region(kind).expect("placed");
        let rows = r.rows.len() as u64;
        let total = if kind.is_paged() {
            (0..d.tp).map(|tp| owned_tokens(tokens, d.dcp, tp % d.dcp, d.interleave) * r.token_bytes * rows).sum()
        } else {
            d.tp as u64 * r.unit_bytes * rows
        };
        m.insert(kind, total);
    }
    m
}
