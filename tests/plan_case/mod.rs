//! One request laid out on every rank of a topology, every pair's plan and the
//! oracle's memory for it: shared by the tests that drive the planner and the
//! oracle directly (staged_rows, chunked_transfer), each with its own block
//! orders.

use handoff::check::oracle::{self, Memory, OracleRequest, Placement};
use handoff_components::Topology;
use handoff_components::layout::{ConsumerLayout, ProducerLayout};
use handoff_components::plan::Plan;
use handoff_components::vocab::RankId;
use handoff_systems::splitting::{ProducerPlanner, share};

pub struct Case {
    pub topo: Topology,
    pub tokens: u64,
    pub producers: Vec<ProducerLayout>,
    pub consumers: Vec<ConsumerLayout>,
}

/// Every pair's plan (pairs that share rows or state), each producer's planner
/// set up by `setup` (staging, chunks).
pub fn plans(c: &Case, setup: impl Fn(ProducerPlanner<'_>) -> ProducerPlanner<'_>) -> Vec<Plan> {
    let mut out = Vec::new();
    for p in &c.producers {
        let planner = setup(ProducerPlanner::new(p, c.tokens));
        for k in &c.consumers {
            let sh = share(c.topo.prefill().tp, k.tp, p.rank.tp, k.rank.tp);
            if sh.rows || sh.state {
                out.push(planner.plan(k, sh).expect("plan"));
            }
        }
    }
    out
}

/// Every region of the case: canary everywhere, request `req`'s pattern on the
/// producers.
pub fn memory(c: &Case, req: u64) -> Memory {
    let request = OracleRequest { id: req, tokens: c.tokens };
    let mut mem = Memory::new();
    for p in &c.producers {
        for r in &p.layout.regions {
            let mut buf = vec![0u8; r.len as usize];
            oracle::fill_canary(RankId::Prefill(p.rank), r.kind, &mut buf);
            oracle::fill_producer(&c.topo, p.rank, r.kind, r.units, &request, &Placement { blocks: &p.blocks, slot: p.slot }, &mut buf);
            mem.insert((RankId::Prefill(p.rank), r.kind), buf);
        }
    }
    for k in &c.consumers {
        for r in &k.layout.regions {
            let mut buf = vec![0u8; r.len as usize];
            oracle::fill_canary(RankId::Decode(k.rank), r.kind, &mut buf);
            mem.insert((RankId::Decode(k.rank), r.kind), buf);
        }
    }
    mem
}
