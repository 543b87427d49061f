//! Small helpers that every layer of this crate shares, kept here, at the bottom,
//! so that no layer copies them and none imports them from a layer above.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, taking the value even when a thread panicked while holding it: the
/// guarded state here is counters, maps and queues that stay consistent between
/// statements, and one panicked request must not take the whole process down.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// SplitMix64's finalizer: a bijection of u64 with good avalanche. The oracle's
/// fill pattern and the sampling's uniform draws are built on it; both must stay
/// bit-for-bit as they are, since tests pin their outputs.
#[inline]
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
