//! The server's signals: SIGTERM and Ctrl-C on rank 0 (the HTTP side's shutdown), and the
//! deferred signal of a rank other than 0, which waits for rank 0's shutdown plan before it
//! leaves by the signal itself.

use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use candle_tp::serve;

/// How long a rank other than 0 waits at least, after SIGTERM or SIGINT, for rank 0's shutdown
/// plan (which comes within a step when tprun signalled the whole job) before it leaves by
/// the signal itself (when the signal was for it alone); twice the longest step so far is
/// added ([`follower_grace`]).
const FOLLOWER_GRACE: Duration = Duration::from_secs(2);

/// The wait of [`FOLLOWER_GRACE`] plus twice the longest step run so far: a step of a long
/// prompt can take longer than the fixed grace, and rank 0 sends its shutdown plan only after
/// the step it is in.
fn follower_grace() -> Duration {
    FOLLOWER_GRACE + 2 * serve::longest_step()
}

/// The signal a rank other than 0 received (0: none yet).
static SIGNAL: AtomicI32 = AtomicI32::new(0);
/// The write end of the pipe that wakes the watcher thread (-1 until it runs).
static WAKE: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_signal(sig: libc::c_int) {
    let _ = SIGNAL.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
    let fd = WAKE.load(Ordering::SeqCst);
    if fd >= 0 {
        let byte = 1u8;
        // SAFETY: write(2) on a pipe is async-signal-safe; the buffer is a live local.
        unsafe { libc::write(fd, (&byte as *const u8).cast(), 1) };
    }
}

/// Ranks other than 0 do not stop at once on SIGTERM/SIGINT: rank 0 gets the same signal from
/// tprun and broadcasts the shutdown, so that every rank leaves at the same step. A watcher
/// thread makes sure the rank still ends if that plan does not come within [`FOLLOWER_GRACE`]
/// (the signal was sent to this rank alone): it restores the signal's default action and
/// raises it again.
pub(crate) fn defer_signals(rank: usize) -> Result<()> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe(2) writes two descriptors into the array it is given.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        bail!(
            "rank {rank}: creating the signal pipe: {}",
            std::io::Error::last_os_error()
        );
    }
    let [read_fd, write_fd] = fds;
    WAKE.store(write_fd, Ordering::SeqCst);
    std::thread::Builder::new()
        .name("signal-watch".into())
        .spawn(move || {
            let mut byte = 0u8;
            loop {
                // SAFETY: read(2) into a live one-byte buffer.
                let n = unsafe { libc::read(read_fd, (&mut byte as *mut u8).cast(), 1) };
                if n == 1 {
                    break;
                }
                if n < 0
                    && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
                {
                    continue;
                }
                return; // the pipe failed: leave the signals to rank 0's plan
            }
            let grace = follower_grace();
            std::thread::sleep(grace);
            let sig = SIGNAL.load(Ordering::SeqCst);
            let name = if sig == libc::SIGINT {
                "SIGINT"
            } else {
                "SIGTERM"
            };
            eprintln!(
                "rank {rank}: no shutdown from rank 0 within {:.1} s of {name}: leaving",
                grace.as_secs_f64()
            );
            // SAFETY: restoring the default action and raising the signal ends the process
            // (the default action of SIGTERM and SIGINT), as if the handler had never been set.
            unsafe {
                libc::signal(sig, libc::SIG_DFL);
                libc::raise(sig);
            }
            std::process::exit(128 + sig);
        })
        .with_context(|| format!("rank {rank}: starting the signal watcher"))?;
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to atomics and writes to a pipe, both async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, handler);
        libc::signal(libc::SIGINT, handler);
    }
    Ok(())
}

/// Until SIGTERM or Ctrl-C (Ctrl-C alone when SIGTERM cannot be watched).
pub(crate) async fn wait_for_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cannot watch SIGTERM: {e}");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
