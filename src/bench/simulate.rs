//! `handoff simulate`: a model of the hand-off's network at cluster scale, not a
//! measurement.
//!
//! It plans one real request with the engine (the same placement and splitting
//! the roles run, whole-request plans as `bench transfer` moves them:
//! [`super::transfer::planned`]), checks the plans' bytes against the oracle's
//! count for every decode rank (written from the rules, not from the planner),
//! and then models the links: each rank's bytes onto its node's NICs, each NIC
//! at `--nic-gbps` times `--efficiency`. From that it predicts the transfer time
//! of a request, the occupancy of the busiest link at `--rate`, and the largest
//! request rate the links sustain, for 1 to 64 decode nodes, beside Mooncake's
//! published transfer-engine bandwidth and the seed PR's prefill figure.
//!
//! The model (printed with every run, [`ASSUMPTIONS`]):
//! - one node per prefill instance (its PP x TP ranks) and one per decode
//!   instance (its TP ranks), each with `nics` NICs;
//! - a rank's bytes leave or enter only through its own NICs: with at least as
//!   many NICs as ranks, rank i stripes evenly over NICs i, i + ranks, ...; with
//!   fewer, NIC j carries ranks j, j + nics, ... (GPU-NIC affinity);
//! - a non-blocking fabric: only the NICs limit (prefill egress, decode ingress);
//! - a request's bytes move at once, at the NICs' rate, with no per-descriptor
//!   cost, latency or protocol overhead beyond `efficiency`;
//! - load spread evenly: rate / P per prefill instance, rate / D per decode node;
//!   a node's NICs serve one request's bytes together, so a side is one server of
//!   service time `busiest link bytes / link rate`; the wait at a rate is that of
//!   an M/D/1 queue (Poisson arrivals).

use super::transfer::planned;
use crate::check::oracle;
use handoff_components::Topology;
use handoff_components::vocab::{DecodeRank, PrefillRank, RegionKind};
use std::collections::BTreeMap;
use std::fmt;

/// Mooncake's published transfer-engine bandwidth (the Mooncake paper and its
/// transfer-engine blog): 190 GB/s over 8 x 400 Gb/s RoCE NICs.
pub const MOONCAKE_GBS: f64 = 190.0;
/// The NICs of Mooncake's figure: 8 of 400 Gb/s, 400 GB/s of line rate.
pub const MOONCAKE_NICS: (u32, f64) = (8, 400.0);
/// The seed PR's (#3069) fastest prefill for AgentX 1M P/D at C32: PP8 x TP1
/// feeding a TP8 x DCP8 decode, in tokens per second per GPU.
pub const SEED_TOK_S_PER_GPU: f64 = 10_409.0;
/// The seed PR's TP8EP8 prefill at the same point, for comparison.
pub const SEED_TP8EP8_TOK_S_PER_GPU: f64 = 9_196.0;
/// The decode-node counts of the scaling table.
pub const SWEEP: [u32; 7] = [1, 2, 4, 8, 16, 32, 64];

/// What the model assumes, printed with every run.
pub const ASSUMPTIONS: &[&str] = &[
    "one node per prefill instance (its PP x TP ranks) and per decode instance (its TP ranks), each with --nics NICs",
    "a rank's bytes use its own NICs only: with NICs >= ranks, rank i stripes evenly over NICs i, i + ranks, ...; with fewer, NIC j carries ranks j, j + nics, ...",
    "a non-blocking fabric: only the NICs limit (prefill egress, decode ingress; full duplex)",
    "a request's bytes (whole-request plans, layer streaming off) move at once at --nic-gbps x --efficiency per NIC: no per-descriptor cost, latency or protocol overhead",
    "load spread evenly: rate / P per prefill instance, rate / D per decode node; a side's NICs serve one request together (one server, service time = busiest link bytes / link rate); waiting as an M/D/1 queue (Poisson arrivals)",
    "the decode step, prefill compute and HBM are not modelled (the seed's prefill figure is set beside the links instead)",
];

/// The command's inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct SimOptions {
    /// NICs per node (prefill and decode alike).
    pub nics: u32,
    /// Line rate of one NIC, Gb/s.
    pub nic_gbps: f64,
    /// Fraction of line rate a NIC moves (1: line rate).
    pub efficiency: f64,
    /// Requests per second offered to the whole cluster.
    pub rate: f64,
    /// Prompt tokens of each request (all handed off).
    pub prompt_tokens: u64,
    /// Decode nodes of the headline figures (the table sweeps 1 to 64 as well).
    pub decode_nodes: u32,
    /// Prefill instances; `None`: one per decode node.
    pub prefill_instances: Option<u32>,
}

/// Why the simulation cannot run: a bad value (naming the flag), or a plan the
/// engine or the oracle refuses.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("--{flag} {value}: must be at least 1 and at most {max}")]
    Count { flag: &'static str, value: u64, max: u64 },
    #[error("--{flag} {value}: must be a finite number above 0 and at most {max}")]
    Positive { flag: &'static str, value: f64, max: f64 },
    #[error("--prompt-tokens {tokens}: the topology serves prompts of 1 to {max} tokens (serve.max_context {context} less one generated token)")]
    Prompt { tokens: u64, max: u64, context: u32 },
    #[error("the engine could not plan a request of {tokens} tokens: {detail}")]
    Plan { tokens: u64, detail: String },
    #[error("decode rank {rank}: the planner's plans move {planner} bytes of {kind}, the oracle's rules {oracle}")]
    Oracle { rank: u32, kind: RegionKind, planner: u64, oracle: u64 },
}

impl SimOptions {
    /// Refuses values the model cannot mean, naming the flag.
    pub fn validate(&self, topo: &Topology) -> Result<(), SimError> {
        for (flag, value, max) in [
            ("nics", u64::from(self.nics), 1024),
            ("decode-nodes", u64::from(self.decode_nodes), 65_536),
            ("prefill-instances", u64::from(self.prefill_instances.unwrap_or(1)), 65_536),
        ] {
            if value == 0 || value > max {
                return Err(SimError::Count { flag, value, max });
            }
        }
        for (flag, value, max) in [("nic-gbps", self.nic_gbps, 1e6), ("efficiency", self.efficiency, 1.0), ("rate", self.rate, 1e9)] {
            if !(value.is_finite() && value > 0.0 && value <= max) {
                return Err(SimError::Positive { flag, value, max });
            }
        }
        let context = topo.config.serve.max_context;
        let max = u64::from(context).saturating_sub(1);
        if self.prompt_tokens == 0 || self.prompt_tokens > max {
            return Err(SimError::Prompt { tokens: self.prompt_tokens, max, context });
        }
        Ok(())
    }

    /// Bytes per second one NIC moves.
    pub fn link_bytes_per_s(&self) -> f64 {
        self.nic_gbps * 1e9 / 8.0 * self.efficiency
    }
}

/// One request's hand-off as the engine plans it.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestBytes {
    pub tokens: u64,
    /// Bytes each prefill rank sends, in (pp, tp) order.
    pub producers: BTreeMap<PrefillRank, u64>,
    /// Bytes each decode rank receives, in tp order.
    pub consumers: BTreeMap<DecodeRank, u64>,
    pub by_kind: BTreeMap<RegionKind, u64>,
    pub plans: usize,
    pub descriptors: u64,
}

impl RequestBytes {
    pub fn total(&self) -> u64 {
        self.consumers.values().sum()
    }
}

/// Plans one request of `tokens` tokens with the engine and checks every decode
/// rank's bytes, kind by kind, against the oracle's rules.
pub fn plan_request(topo: &Topology, tokens: u64) -> Result<RequestBytes, SimError> {
    let (_engine, jobs, _ids) = planned(topo, tokens, 1).map_err(|e| SimError::Plan { tokens, detail: format!("{e:#}") })?;
    let mut r = RequestBytes { tokens, producers: BTreeMap::new(), consumers: BTreeMap::new(), by_kind: BTreeMap::new(), plans: jobs.len(), descriptors: 0 };
    let mut per_rank_kind: BTreeMap<(DecodeRank, RegionKind), u64> = BTreeMap::new();
    for (_, p) in &jobs {
        let b = p.bytes();
        *r.producers.entry(p.producer).or_default() += b;
        *r.consumers.entry(p.consumer).or_default() += b;
        r.descriptors += p.descriptors.len() as u64;
        for kind in topo.region_kinds() {
            let k = p.bytes_of(kind);
            *r.by_kind.entry(kind).or_default() += k;
            *per_rank_kind.entry((p.consumer, kind)).or_default() += k;
        }
    }
    for tp in 0..topo.decode().tp {
        let rank = DecodeRank { tp };
        for (kind, want) in oracle::expected_bytes(topo, rank, tokens) {
            let got = per_rank_kind.get(&(rank, kind)).copied().unwrap_or(0);
            if got != want {
                return Err(SimError::Oracle { rank: tp, kind, planner: got, oracle: want });
            }
        }
    }
    Ok(r)
}

/// Bytes each of a node's `nics` NICs carries when its ranks (in order) move
/// `rank_bytes`: see [`ASSUMPTIONS`] for the mapping.
pub fn nic_loads(rank_bytes: &[u64], nics: u32) -> Vec<f64> {
    let (n, r) = (nics.max(1) as usize, rank_bytes.len());
    let mut load = vec![0.0; n];
    if r == 0 {
        return load;
    }
    if n <= r {
        for (i, &b) in rank_bytes.iter().enumerate() {
            load[i % n] += b as f64;
        }
    } else {
        for (j, l) in load.iter_mut().enumerate() {
            let i = j % r;
            // NICs of rank i: j = i, i + r, ... below n.
            let share = (n - i).div_ceil(r);
            *l = rank_bytes[i] as f64 / share as f64;
        }
    }
    load
}

/// One side's busiest link per request and what follows from it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkSide {
    /// Bytes on the busiest NIC of one node, per request.
    pub busiest_link_bytes: f64,
    /// Nodes (instances) of this side sharing the load.
    pub nodes: u32,
}

impl LinkSide {
    /// Seconds one request keeps this side's busiest link busy.
    pub fn service_s(&self, link: f64) -> f64 {
        self.busiest_link_bytes / link
    }
    /// Fraction of the busiest link's time in use at `rate` requests/s.
    pub fn occupancy(&self, rate: f64, link: f64) -> f64 {
        rate / f64::from(self.nodes) * self.service_s(link)
    }
    /// Requests/s at which the busiest link is busy all the time.
    pub fn max_rate(&self, link: f64) -> f64 {
        f64::from(self.nodes) / self.service_s(link)
    }
}

/// The model's predictions for one cluster shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    pub decode_nodes: u32,
    pub prefill_instances: u32,
    pub prefill: LinkSide,
    pub decode: LinkSide,
    /// Seconds one request's hand-off takes alone: the slower side's busiest link.
    pub transfer_s: f64,
    /// Occupancy of the busiest link at the offered rate, prefill and decode side.
    pub occupancy: (f64, f64),
    /// The largest request rate the links sustain (the lower side's).
    pub max_rate: f64,
    /// The mean hand-off time at the offered rate (transfer plus the M/D/1 wait at
    /// the busier side); `None` when the rate is at or past the links' maximum.
    pub loaded_transfer_s: Option<f64>,
}

/// Predicts a cluster of `decode_nodes` decode nodes and `prefill_instances`
/// prefill instances, each request moving `req`'s bytes.
pub fn predict(req: &RequestBytes, o: &SimOptions, decode_nodes: u32, prefill_instances: u32) -> Prediction {
    let link = o.link_bytes_per_s();
    let busiest = |bytes: Vec<u64>| nic_loads(&bytes, o.nics).into_iter().fold(0.0, f64::max);
    let prefill = LinkSide { busiest_link_bytes: busiest(req.producers.values().copied().collect()), nodes: prefill_instances };
    let decode = LinkSide { busiest_link_bytes: busiest(req.consumers.values().copied().collect()), nodes: decode_nodes };
    let transfer_s = prefill.service_s(link).max(decode.service_s(link));
    let occupancy = (prefill.occupancy(o.rate, link), decode.occupancy(o.rate, link));
    let max_rate = prefill.max_rate(link).min(decode.max_rate(link));
    let (rho, service) = if occupancy.0 >= occupancy.1 { (occupancy.0, prefill.service_s(link)) } else { (occupancy.1, decode.service_s(link)) };
    let loaded_transfer_s = (rho < 1.0).then(|| transfer_s + rho * service / (2.0 * (1.0 - rho)));
    Prediction { decode_nodes, prefill_instances, prefill, decode, transfer_s, occupancy, max_rate, loaded_transfer_s }
}

/// A whole run: the request's bytes, the headline prediction and the sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct SimReport {
    pub config_path: String,
    pub shape: (u32, u32, u32, u32),
    pub options: SimOptions,
    pub request: RequestBytes,
    pub headline: Prediction,
    pub sweep: Vec<Prediction>,
    /// The same request at Mooncake's measured efficiency (190 of 400 GB/s).
    pub at_mooncake: Prediction,
}

/// Runs the model.
pub fn simulate(topo: &Topology, config_path: &str, o: &SimOptions) -> Result<SimReport, SimError> {
    o.validate(topo)?;
    let request = plan_request(topo, o.prompt_tokens)?;
    let instances = |d: u32| o.prefill_instances.unwrap_or(d);
    let headline = predict(&request, o, o.decode_nodes, instances(o.decode_nodes));
    let sweep = SWEEP.iter().map(|&d| predict(&request, o, d, instances(d))).collect();
    let mooncake = SimOptions { efficiency: mooncake_efficiency(), ..o.clone() };
    let at_mooncake = predict(&request, &mooncake, o.decode_nodes, instances(o.decode_nodes));
    let (p, d) = (topo.prefill(), topo.decode());
    Ok(SimReport { config_path: config_path.to_string(), shape: (p.pp, p.tp, d.tp, d.dcp), options: o.clone(), request, headline, sweep, at_mooncake })
}

/// Mooncake's measured fraction of line rate: 190 GB/s of 8 x 400 Gb/s.
pub fn mooncake_efficiency() -> f64 {
    MOONCAKE_GBS / (f64::from(MOONCAKE_NICS.0) * MOONCAKE_NICS.1 / 8.0)
}

fn gb(bytes: f64) -> String {
    format!("{:.3} GB", bytes / 1e9)
}

fn ms(s: f64) -> String {
    format!("{:.2} ms", s * 1e3)
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

impl fmt::Display for SimReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (o, r, h) = (&self.options, &self.request, &self.headline);
        let (pp, ptp, dtp, dcp) = self.shape;
        let link = o.link_bytes_per_s();
        writeln!(f, "simulate (a model, not a measurement): {}, prefill PP{pp} x TP{ptp} -> decode TP{dtp} x DCP{dcp}", self.config_path)?;
        writeln!(
            f,
            "links: {} NICs a node x {} Gb/s x efficiency {} = {:.2} GB/s a NIC, {:.1} GB/s a node",
            o.nics,
            o.nic_gbps,
            o.efficiency,
            link / 1e9,
            link * f64::from(o.nics) / 1e9
        )?;
        writeln!(f, "model assumptions:")?;
        for a in ASSUMPTIONS {
            writeln!(f, "  - {a}")?;
        }
        writeln!(
            f,
            "request: {} prompt tokens, planned by the engine: {} plans, {} descriptors, {} ({} bytes)",
            r.tokens,
            r.plans,
            r.descriptors,
            gb(r.total() as f64),
            r.total()
        )?;
        let kinds: Vec<String> = r.by_kind.iter().filter(|(_, b)| **b > 0).map(|(k, b)| format!("{k} {}", gb(*b as f64))).collect();
        writeln!(f, "  by kind: {}; every decode rank's bytes equal the oracle's count from the rules", kinds.join(", "))?;
        let pl: Vec<String> = r.producers.iter().map(|(p, b)| format!("pp{} tp{} {}", p.pp, p.tp, gb(*b as f64))).collect();
        writeln!(f, "  each prefill rank sends: {}", pl.join(", "))?;
        let dl: Vec<String> = r.consumers.iter().map(|(d, b)| format!("tp{} {}", d.tp, gb(*b as f64))).collect();
        writeln!(f, "  each decode rank receives: {}", dl.join(", "))?;
        writeln!(
            f,
            "  busiest link per request: prefill NIC {} ({}), decode NIC {} ({})",
            gb(h.prefill.busiest_link_bytes),
            ms(h.prefill.service_s(link)),
            gb(h.decode.busiest_link_bytes),
            ms(h.decode.service_s(link))
        )?;
        writeln!(f, "prediction, {} decode node(s), {} prefill instance(s), {} requests/s offered:", h.decode_nodes, h.prefill_instances, o.rate)?;
        writeln!(f, "  transfer time per request (alone): {}", ms(h.transfer_s))?;
        writeln!(f, "  link occupancy at {} requests/s: prefill {}, decode {}", o.rate, pct(h.occupancy.0), pct(h.occupancy.1))?;
        match h.loaded_transfer_s {
            Some(t) => writeln!(f, "  mean transfer time at that rate (M/D/1 wait at the busier side): {}", ms(t))?,
            None => writeln!(f, "  mean transfer time at that rate: unbounded (the links cannot sustain {} requests/s)", o.rate)?,
        }
        writeln!(
            f,
            "  largest request rate the links sustain: {:.3} requests/s ({:.1} GB/s into each decode node)",
            h.max_rate,
            h.max_rate / f64::from(h.decode_nodes) * r.total() as f64 / 1e9
        )?;
        let m = &self.at_mooncake;
        writeln!(
            f,
            "beside Mooncake (published: {MOONCAKE_GBS} GB/s over {} x {} Gb/s, {} of line rate): at that efficiency, transfer {} per request, at most {:.3} requests/s",
            MOONCAKE_NICS.0,
            MOONCAKE_NICS.1,
            pct(mooncake_efficiency()),
            ms(m.transfer_s),
            m.max_rate
        )?;
        let gpus = f64::from(pp * ptp);
        let seed_rate = SEED_TOK_S_PER_GPU * gpus / r.tokens as f64;
        let per_instance = h.max_rate / f64::from(h.prefill_instances);
        writeln!(
            f,
            "beside the seed PR (#3069): its PP8 x TP1 prefill ran {SEED_TOK_S_PER_GPU} tok/s/GPU at C32 (TP8EP8: {SEED_TP8EP8_TOK_S_PER_GPU}); read as prompt tokens a prefill GPU, one {}-GPU instance prefills {:.4} requests/s of {} tokens, {:.2} GB/s of hand-off: {} of its busiest link; the links sustain {:.1}x that rate",
            gpus,
            seed_rate,
            r.tokens,
            seed_rate * r.total() as f64 / 1e9,
            pct(seed_rate * h.prefill.service_s(link)),
            per_instance / seed_rate
        )?;
        writeln!(f, "scaling (prefill instances: {}):", o.prefill_instances.map_or("one per decode node".to_string(), |p| p.to_string()))?;
        writeln!(
            f,
            "  {:>6} {:>8} {:>12} {:>12} {:>16} {:>14} {:>16} {:>18}",
            "decode", "prefill", "occupancy", "occupancy", "max rate (req/s)", "max rate at", "prefill compute", "mean transfer at"
        )?;
        writeln!(
            f,
            "  {:>6} {:>8} {:>12} {:>12} {:>16} {:>14} {:>16} {:>18}",
            "nodes", "inst.", "prefill", "decode", "links", "Mooncake's", "(seed, req/s)", "the rate (M/D/1)"
        )?;
        for (p, mooncake) in self.sweep.iter().map(|p| (p, p.max_rate * mooncake_efficiency() / o.efficiency)) {
            writeln!(
                f,
                "  {:>6} {:>8} {:>12} {:>12} {:>16.3} {:>14.3} {:>16.4} {:>18}",
                p.decode_nodes,
                p.prefill_instances,
                pct(p.occupancy.0),
                pct(p.occupancy.1),
                p.max_rate,
                mooncake,
                seed_rate * f64::from(p.prefill_instances),
                p.loaded_transfer_s.map_or("unbounded".to_string(), ms)
            )?;
        }
        write!(f, "largest request rate the links sustain: {:.3} requests/s", h.max_rate)
    }
}
