//! Small helpers that every layer of this crate shares, kept here, at the bottom,
//! so that no layer copies them and none imports them from a layer above.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, taking the value even when a thread panicked while holding it: the
/// guarded state here is counters, maps and queues that stay consistent between
/// statements, and one panicked request must not take the whole process down.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// SplitMix64's finalizer, shared with the sampling's draws (one copy, in the
/// components crate below every layer).
pub use handoff_components::sampling::mix;
