//! Signals sent to tprun itself (Ctrl-C, `kill`): recorded by an
//! async-signal-safe handler into atomics that the supervisor polls.
//!
//! Workers run in their own process groups, so a Ctrl-C at the terminal reaches
//! only tprun, which forwards SIGTERM to them; a second signal escalates to SIGKILL.

use std::io;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

/// Signals that stop the job, as torchrun handles them.
pub const HANDLED: [libc::c_int; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];

/// Number of handled signals received so far.
static COUNT: AtomicUsize = AtomicUsize::new(0);

/// The first handled signal received (0 when none).
static FIRST: AtomicI32 = AtomicI32::new(0);

/// The handler: only lock-free atomic operations, which are async-signal-safe.
extern "C" fn on_signal(signal: libc::c_int) {
    let _ = FIRST.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
    COUNT.fetch_add(1, Ordering::SeqCst);
}

/// Installs the handler for every signal in [`HANDLED`].
pub fn install() -> io::Result<()> {
    for &signal in &HANDLED {
        // SAFETY: `action` is fully initialised (zeroed, then the fields we use
        // set) and `on_signal` only touches atomics, so it is async-signal-safe.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(signal, &action, std::ptr::null_mut()) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

/// Number of handled signals received since start.
pub fn count() -> usize {
    COUNT.load(Ordering::SeqCst)
}

/// The first handled signal received, if any.
pub fn first() -> Option<libc::c_int> {
    match FIRST.load(Ordering::SeqCst) {
        0 => None,
        signal => Some(signal),
    }
}

/// The conventional name of a signal (`SIGKILL`), or `signal N` for others.
pub fn name(signal: libc::c_int) -> String {
    let known = [
        (libc::SIGHUP, "SIGHUP"),
        (libc::SIGINT, "SIGINT"),
        (libc::SIGQUIT, "SIGQUIT"),
        (libc::SIGILL, "SIGILL"),
        (libc::SIGTRAP, "SIGTRAP"),
        (libc::SIGABRT, "SIGABRT"),
        (libc::SIGBUS, "SIGBUS"),
        (libc::SIGFPE, "SIGFPE"),
        (libc::SIGKILL, "SIGKILL"),
        (libc::SIGUSR1, "SIGUSR1"),
        (libc::SIGSEGV, "SIGSEGV"),
        (libc::SIGUSR2, "SIGUSR2"),
        (libc::SIGPIPE, "SIGPIPE"),
        (libc::SIGALRM, "SIGALRM"),
        (libc::SIGTERM, "SIGTERM"),
        (libc::SIGXCPU, "SIGXCPU"),
        (libc::SIGXFSZ, "SIGXFSZ"),
        (libc::SIGSYS, "SIGSYS"),
    ];
    known
        .iter()
        .find(|(number, _)| *number == signal)
        .map_or_else(|| format!("signal {signal}"), |(_, name)| name.to_string())
}
