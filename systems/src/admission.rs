//! Admission: validate each submitted request before anything is enqueued.

use bevy_ecs::prelude::*;
use handoff_components::ecs::*;
use std::time::{Duration, Instant};

/// Why a request cannot be served; checked before it is enqueued.
pub fn validate(topo: &handoff_components::Topology, tokens: u64) -> Result<(), String> {
    if tokens == 0 {
        return Err("empty prompt: at least one token is required".into());
    }
    let max = topo.config.serve.max_context as u64;
    if tokens >= max {
        return Err(format!("prompt of {tokens} tokens does not fit serve.max_context {max} (prompt plus at least one generated token)"));
    }
    topo.admits_transfer_mode()
}

/// Turns `Submit` messages into waiting requests, or rejects them.
pub fn admit_requests(
    mut commands: Commands,
    mut submits: MessageReader<Submit>,
    topo: Res<TopologyRes>,
    mut index: ResMut<RequestIndex>,
    mut outcomes: MessageWriter<Outcome>,
) {
    let timeout = Duration::from_secs_f64(topo.0.config.timeouts.admission_s);
    for s in submits.read() {
        let rejected = if index.0.contains_key(&s.id) {
            Err(format!("request id {} is already in flight", s.id))
        } else {
            validate(&topo.0, s.tokens)
        };
        if let Err(reason) = rejected {
            outcomes.write(Outcome { request: s.id, result: Err((PhaseName::Admission, reason)) });
            continue;
        }
        let nonce = nonce_for(s.id);
        let e = commands
            .spawn((
                Request { id: s.id, tokens: s.tokens, nonce },
                Status::Waiting,
                Deadline { phase: PhaseName::Admission, at: Instant::now() + timeout },
                StagesComputed(vec![false; topo.0.config.prefill.pp as usize]),
                Holdings::default(),
            ))
            .id();
        index.0.insert(s.id, e);
    }
}

/// A per-request nonce, distinct for each life of an id within a process.
fn nonce_for(id: u64) -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0x9e37_79b9_7f4a_7c15);
    let n = NEXT.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
    n ^ id.rotate_left(17)
}
