//! Admission: validate each submitted request before anything is enqueued.

use bevy_ecs::prelude::*;
use handoff_components::config::TransferModeError;
use handoff_components::ecs::*;
use handoff_components::failure::{Cause, Failure};
use std::time::{Duration, Instant};
use thiserror::Error;

/// Why a request cannot be served; decided before it is enqueued (HTTP 400).
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum AdmissionError {
    #[error("empty prompt: at least one token is required")]
    EmptyPrompt,
    #[error("prompt of {tokens} tokens does not fit serve.max_context {max_context} (prompt plus at least one generated token)")]
    PromptTooLong { tokens: u64, max_context: u64 },
    #[error("max_tokens {max_tokens} is out of range: it must be between 1 and serve.max_context {max_context} minus the prompt's {tokens} tokens = {room}")]
    MaxTokens { max_tokens: u64, max_context: u64, tokens: u64, room: u64 },
    #[error(transparent)]
    TransferMode(#[from] TransferModeError),
    #[error("request id {0} is already in flight")]
    Duplicate(u64),
}

impl AdmissionError {
    /// The label of this refusal in metrics.
    pub const fn label(&self) -> &'static str {
        match self {
            AdmissionError::EmptyPrompt => "empty_prompt",
            AdmissionError::PromptTooLong { .. } => "prompt_too_long",
            AdmissionError::MaxTokens { .. } => "max_tokens",
            AdmissionError::TransferMode(_) => "transfer_mode",
            AdmissionError::Duplicate(_) => "duplicate_id",
        }
    }
}

/// Why a request of `tokens` prompt tokens cannot be served.
pub fn validate(topo: &handoff_components::Topology, tokens: u64) -> Result<(), AdmissionError> {
    if tokens == 0 {
        return Err(AdmissionError::EmptyPrompt);
    }
    let max_context = topo.config.serve.max_context as u64;
    if tokens >= max_context {
        return Err(AdmissionError::PromptTooLong { tokens, max_context });
    }
    topo.admits_transfer_mode()?;
    Ok(())
}

/// [`validate`], and `max_tokens` between 1 and what the context leaves.
pub fn validate_generation(topo: &handoff_components::Topology, tokens: u64, max_tokens: u64) -> Result<(), AdmissionError> {
    validate(topo, tokens)?;
    let max_context = topo.config.serve.max_context as u64;
    let room = max_context - tokens;
    if max_tokens == 0 || max_tokens > room {
        return Err(AdmissionError::MaxTokens { max_tokens, max_context, tokens, room });
    }
    Ok(())
}

/// Turns `Submit` messages into waiting requests, or rejects them. The job of a
/// request this World settled before it came ([`Settled`]) is dropped: decode
/// already knows this stage writes nothing for it.
pub fn admit_requests(
    mut commands: Commands,
    mut submits: MessageReader<Submit>,
    topo: Res<TopologyRes>,
    local: Res<LocalRanks>,
    settled: Option<Res<Settled>>,
    mut index: ResMut<RequestIndex>,
    mut outcomes: MessageWriter<Outcome>,
) {
    let timeout = Duration::from_secs_f64(topo.0.config.timeouts.admission_s);
    let pp = topo.0.config.prefill.pp;
    for s in submits.read() {
        if let (Some(settled), Some(nonce)) = (&settled, s.nonce)
            && settled.holds(s.id, nonce)
        {
            tracing::info!(request = s.id, "dropped the job of a settled request");
            continue;
        }
        let rejected = if index.0.contains_key(&s.id) {
            Err(AdmissionError::Duplicate(s.id))
        } else if local.decode && s.max_tokens > 0 {
            validate_generation(&topo.0, s.tokens, s.max_tokens as u64)
        } else {
            validate(&topo.0, s.tokens)
        };
        if let Err(reason) = rejected {
            let failure = Failure::new(PhaseName::Admission, local.role(), Cause::Refused { detail: reason.to_string() });
            outcomes.write(Outcome { request: s.id, nonce: s.nonce, result: Err(failure) });
            continue;
        }
        let nonce = s.nonce.unwrap_or_else(|| nonce_for(s.id));
        // Stages of other Worlds count as computed here; decode learns of theirs
        // from their reports.
        let computed = (0..pp).map(|st| !local.decode && !local.has_stage(st)).collect();
        let mut e = commands.spawn((
            Request { id: s.id, tokens: s.tokens, nonce },
            Status::Waiting,
            Deadline { phase: PhaseName::Admission, at: Instant::now() + timeout },
            StagesComputed(computed),
            Holdings::default(),
        ));
        if !local.stages.is_empty() {
            e.insert((s.inputs.clone(), LastLayerAt(vec![None; pp as usize])));
        }
        if !s.consumers.is_empty() {
            e.insert(RemoteConsumers(s.consumers.clone()));
        }
        // A greedy request carries no sampling: the model's pick stands.
        if let Some(sampling) = s.sampling.filter(|x| !x.is_greedy()) {
            e.insert(sampling);
        }
        // Without tokens to generate (the byte-level checks) a handed-off request
        // waits for its owner to finish it.
        if local.decode && s.max_tokens > 0 {
            e.insert((
                DecodeProgress { max_tokens: s.max_tokens, emitted: 0, last: None, stepped: 0 },
                Timing { admitted: Instant::now(), handed_off: None, bytes: 0, tail_us: None, tail_stage_compute_us: None },
            ));
            if !s.forced.is_empty() {
                e.insert(Forced(s.forced.clone()));
            }
        }
        index.0.insert(s.id, e.id());
    }
}

/// A per-request nonce, distinct for each life of an id within a process.
fn nonce_for(id: u64) -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0x9e37_79b9_7f4a_7c15);
    let n = NEXT.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
    n ^ id.rotate_left(17)
}
