//! Sampling of generated tokens: greedy by default, or temperature and nucleus
//! (top-p) sampling with a seeded generator.
//!
//! A request's [`Sampling`] is a component on its entity in the engine's World
//! (admission puts it there from the request's `Submit`, and it goes with the
//! request), and the dispatch phase picks each token with
//! [`handoff_systems::sampling::pick`] where the logits are: the last prefill
//! stage samples token 0 from the prompt's last position, decode samples every
//! later token. The roles only carry the parameters on the wire. This module
//! re-exports the rule and holds the colocated reference a seeded disaggregated
//! run must equal.

use crate::model::{Model, ModelError};
pub use handoff_components::sampling::Sampling;
pub use handoff_systems::sampling::{argmax, pick, uniform};

/// The colocated single-rank run of `prompt` with `s`: `max_tokens` tokens, the
/// first from the prompt's last position, each fed back as the next input (the
/// reference a seeded disaggregated run must equal).
pub fn colocated(model: &Model, prompt: &[u8], max_tokens: u32, s: &Sampling) -> Result<Vec<u8>, ModelError> {
    let be = handoff_kernels::CpuBackend::new();
    let group = model.upload_group(&be, 1)?;
    let (req, logits, _) = crate::model::reference::prefill_local(&be, &group, prompt)?;
    let mut caches = crate::model::reference::LocalCaches::new(&group.dims, group.tp(), vec![req]);
    let mut tokens = vec![pick(&logits, s, 0)];
    for step in 1..max_tokens {
        let prev = tokens[tokens.len() - 1];
        let mut out = crate::model::forward::decode_batch(&be, &group, &[prev], &[prompt.len() + step as usize - 1], &mut caches)?;
        let (logits, _) = out.pop().ok_or_else(|| ModelError::Config("decode step returned nothing".into()))?;
        tokens.push(pick(&logits, s, step));
    }
    Ok(tokens)
}
