//! Dispatch: the compute. Prefill stages run their layers for each planned request,
//! in stage order, each marking its rows readable; decode runs a handed-off request
//! from the regions the transfer wrote. The model lives behind `Compute`, so the
//! phase stays plain scheduling.

use bevy_ecs::prelude::*;
use handoff_components::ecs::*;
use handoff_components::vocab::RankId;

/// Where a request lives on one rank: (rank, blocks, slot).
pub type Lease = (RankId, Vec<u32>, u32);

/// The compute of the prefill stages and the decode ranks.
pub trait Compute: Send + Sync + 'static {
    /// Runs PP stage `stage` of a request (every TP rank of the stage), writing the
    /// stage's KV rows and state into its producer regions.
    fn prefill(&mut self, request: u64, tokens: u64, stage: u32, leases: &[Lease]) -> Result<(), String>;
    /// Decodes a handed-off request from its decode regions. Blocks for generated
    /// tokens come from `pools` and go back there before it returns.
    fn decode(&mut self, request: u64, tokens: u64, leases: &[Lease], pools: &mut Pools) -> Result<(), String>;
}

/// The engine's compute, when it has one.
#[derive(Resource)]
pub struct Dispatcher(pub Box<dyn Compute>);

fn leases_of(holdings: &Holdings, leases: &Query<(&BlockTable, &Slot)>) -> Vec<Lease> {
    holdings
        .leases
        .iter()
        .filter_map(|&l| leases.get(l).ok().map(|(t, s)| (t.rank, t.blocks.clone(), s.index)))
        .collect()
}

/// Runs the uncomputed stages of each planned request, in stage order (stage s
/// takes the hidden states of stage s - 1).
pub fn run_prefill(
    dispatcher: Option<ResMut<Dispatcher>>,
    mut requests: Query<(&Request, &mut Status, &mut StagesComputed, &Holdings)>,
    leases: Query<(&BlockTable, &Slot)>,
) {
    let Some(mut dispatcher) = dispatcher else { return };
    for (req, mut status, mut computed, holdings) in requests.iter_mut() {
        if *status != Status::Planned || computed.0.iter().all(|&c| c) {
            continue;
        }
        let held = leases_of(holdings, &leases);
        for stage in 0..computed.0.len() {
            if computed.0[stage] {
                continue;
            }
            match dispatcher.0.prefill(req.id, req.tokens, stage as u32, &held) {
                Ok(()) => computed.0[stage] = true,
                Err(reason) => {
                    *status = Status::Failed { phase: PhaseName::Compute, reason: format!("prefill stage {stage}: {reason}") };
                    break;
                }
            }
        }
    }
}

/// Decodes each handed-off request; it is then finished and released.
pub fn run_decode(
    dispatcher: Option<ResMut<Dispatcher>>,
    mut requests: Query<(&Request, &mut Status, &Holdings)>,
    leases: Query<(&BlockTable, &Slot)>,
    mut pools: ResMut<Pools>,
) {
    let Some(mut dispatcher) = dispatcher else { return };
    for (req, mut status, holdings) in requests.iter_mut() {
        if *status != Status::HandedOff {
            continue;
        }
        let held = leases_of(holdings, &leases);
        *status = match dispatcher.0.decode(req.id, req.tokens, &held, &mut pools) {
            Ok(()) => Status::Finished,
            Err(reason) => Status::Failed { phase: PhaseName::Decode, reason },
        };
    }
}
