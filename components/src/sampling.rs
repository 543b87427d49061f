//! How one choice of a request picks its tokens: a component on the request
//! entity (absent for greedy requests), read by the dispatch phase wherever the
//! logits are (the last prefill stage samples token 0, decode the rest).
//!
//! The pick itself (`handoff_systems::sampling::pick`) is a pure function of a
//! step's logits, these four numbers and the step's index, so a seeded request
//! gives the same tokens disaggregated and colocated.

use bevy_ecs::prelude::*;
use serde::{Deserialize, Serialize};

/// Temperature and nucleus (top-p) sampling with a seeded draw per step.
#[derive(Component, Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    /// 0: greedy (the model's own pick).
    pub temperature: f32,
    /// Nucleus: sample among the most likely tokens whose mass reaches `top_p`.
    pub top_p: f32,
    pub seed: u64,
    /// The choice's index in the response (keys the draws, so `n` choices differ).
    pub choice: u32,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling { temperature: 0.0, top_p: 1.0, seed: 0, choice: 0 }
    }
}

impl Sampling {
    pub fn is_greedy(&self) -> bool {
        // NaN counts as greedy too.
        self.temperature.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
    }
}

/// SplitMix64's finalizer: a bijection of u64 with good avalanche. The sampling's
/// uniform draws and the oracle's fill pattern are built on it; both must stay
/// bit for bit as they are, since tests pin their outputs. It lives here, in the
/// lowest crate, so that every layer shares one copy.
#[inline]
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
