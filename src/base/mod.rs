//! Small helpers that every layer of this crate shares, kept here, at the bottom,
//! so that no layer copies them and none imports them from a layer above.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Locks `m`, taking the value even when a thread panicked while holding it: the
/// guarded state here is counters, maps and queues that stay consistent between
/// statements, and one panicked request must not take the whole process down.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// SplitMix64's finalizer, shared with the sampling's draws (one copy, in the
/// components crate below every layer).
pub use handoff_components::sampling::mix;

/// How long a waiter on a device's copies re-checks its condition (yielding
/// between checks) before it sleeps ([`wait_until`]'s `spin` there). A
/// hand-off's completion crosses threads three times (device event,
/// transport, mover, engine); a sleeping thread's wake-up costs tens to
/// hundreds of microseconds on a loaded host, where a flagship pass at 32K
/// tokens is about a millisecond of copies, so a waiter that expects its
/// answer within about that long polls instead.
pub const SPIN: Duration = Duration::from_micros(2000);

/// Waits on `cv` until `ready` holds for the guarded value or `deadline`
/// passes; returns the guard and whether `ready` held. For the first `spin`
/// it drops the lock and yields between checks, then sleeps on `cv` (whoever
/// makes `ready` true must notify `cv`, as for a plain wait).
pub fn wait_until<'a, T>(m: &'a Mutex<T>, cv: &Condvar, deadline: Instant, spin: Duration, mut ready: impl FnMut(&mut T) -> bool) -> (MutexGuard<'a, T>, bool) {
    let spin_until = Instant::now() + spin;
    let mut g = lock(m);
    loop {
        if ready(&mut g) {
            return (g, true);
        }
        let now = Instant::now();
        if now >= deadline {
            return (g, false);
        }
        if now < spin_until {
            drop(g);
            std::thread::yield_now();
            g = lock(m);
            continue;
        }
        g = match cv.wait_timeout(g, deadline - now) {
            Ok((g, _)) => g,
            Err(p) => p.into_inner().0,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A change made by another thread ends the wait, whether it comes while
    /// the waiter polls or after it went to sleep on the condition variable;
    /// with no change the wait ends at the deadline, saying so.
    #[test]
    fn wait_until_sees_a_change_while_polling_or_asleep_and_stops_at_its_deadline() {
        for (spin, after) in [(Duration::ZERO, 10), (Duration::from_millis(200), 10), (Duration::from_millis(5), 40)] {
            let pair = Arc::new((Mutex::new(0u32), Condvar::new()));
            let other = Arc::clone(&pair);
            let setter = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(after));
                *lock(&other.0) = 7;
                other.1.notify_all();
            });
            let (g, ok) = wait_until(&pair.0, &pair.1, Instant::now() + Duration::from_secs(10), spin, |v| *v == 7);
            assert!(ok, "spin {spin:?}, set after {after} ms");
            assert_eq!(*g, 7);
            drop(g);
            setter.join().expect("setter");
        }
        let (m, cv) = (Mutex::new(0u32), Condvar::new());
        let t = Instant::now();
        let (g, ok) = wait_until(&m, &cv, t + Duration::from_millis(30), Duration::from_millis(10), |v| *v == 7);
        assert!(!ok);
        assert_eq!(*g, 0);
        assert!(t.elapsed() >= Duration::from_millis(30));
    }
}
