//! Stop signals: a role process asks itself to stop through these, and every
//! loop of its threads checks them, so that a stop drains and cleans up instead
//! of killing threads that hold the transport.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// Stop signals (SIGINT, SIGTERM) received: the first asks for a stop (the proxy
/// and `up` drain first), a second for an immediate one.
static SIGNALS: AtomicU32 = AtomicU32::new(0);

extern "C" fn on_signal(_: libc::c_int) {
    SIGNALS.fetch_add(1, Ordering::SeqCst);
}

/// Installs SIGINT/SIGTERM handlers that ask the role to stop (so it drops its
/// transport and removes its shared-memory files).
pub fn install_signal_handlers() {
    // SAFETY: the handler only adds to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
}

/// Whether a stop was asked for.
pub fn shutting_down() -> bool {
    SIGNALS.load(Ordering::SeqCst) > 0
}

/// Stop signals received so far.
pub fn signals() -> u32 {
    SIGNALS.load(Ordering::SeqCst)
}

/// Asks the role (this process) to stop.
pub fn request_shutdown() {
    let _ = SIGNALS.compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst);
}

/// Sleeps up to `d`, waking early when a stop was asked for.
pub(crate) fn sleep_unless_stopping(d: Duration) {
    let until = std::time::Instant::now() + d;
    while !shutting_down() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20).min(d));
    }
}
