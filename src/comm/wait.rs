//! Waiting for a peer's sequence word: spin briefly, then yield while the peer is running,
//! then sleep on a futex.
//!
//! A pure spin answers in well under a microsecond when every rank has a core, and collapses
//! when ranks outnumber cores (3 ranks on 2 cores): a spinning rank eats the time slice its
//! peer needs. So the spin budget shrinks when the group is larger than the machine.
//!
//! After the spin the wait is adaptive: while the peer is itself running (computing its part,
//! or descheduled by another process on a busy machine) the waiter keeps yielding, for up to
//! [`WaitPolicy::patience`], because the peer will publish soon and a futex wake-up costs tens
//! of microseconds on a loaded machine; a peer that is itself asleep in a wait (an idle
//! server's ranks, all waiting on rank 0's next request) sends the waiter straight to the
//! futex, so long waits cost ~0 % CPU. Every futex sleep has a short timeout so the caller can
//! check deadlines, aborts and dead peers.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How long a waiter spins and yields before it sleeps.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WaitPolicy {
    /// How long to spin (each probe a load and a `spin_loop` hint).
    pub spin: Duration,
    /// `sched_yield` calls after the spin, so a peer sharing this core can run.
    pub yields: u32,
    /// How long to keep polling after the spin while the awaited peer is running (not asleep
    /// in a wait of its own) before sleeping on the futex.
    pub patience: Duration,
    /// Whether that polling yields the core between probes (ranks outnumber cores: the peer
    /// may need this very core) or spins (each rank can have a core of its own; yielding on a
    /// busy machine hands the core to another process for a whole scheduler slice).
    pub patience_yields: bool,
    /// Longest single futex sleep, so deadlines and dead peers are noticed.
    pub sleep_slice: Duration,
}

impl WaitPolicy {
    /// Picks a policy for `ranks` ranks sharing this machine: `CANDLE_TP_SPIN_US`
    /// microseconds of spinning (default 20, or 2 when ranks outnumber cores), then up to
    /// `CANDLE_TP_PATIENCE_US` microseconds (default 5000) of yielding while the peer runs.
    pub(crate) fn for_ranks(ranks: usize) -> Self {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        let oversubscribed = ranks > cores;
        let spin_us = env_u32("CANDLE_TP_SPIN_US").unwrap_or(if oversubscribed { 2 } else { 20 });
        Self {
            spin: Duration::from_micros(spin_us as u64),
            yields: if oversubscribed { 4 } else { 8 },
            patience: Duration::from_micros(env_u32("CANDLE_TP_PATIENCE_US").unwrap_or(5000) as u64),
            patience_yields: match std::env::var("CANDLE_TP_PATIENCE_YIELD").ok().as_deref() {
                Some("1") => true,
                Some("0") => false,
                _ => oversubscribed,
            },
            sleep_slice: Duration::from_millis(50),
        }
    }
}

fn env_u32(name: &str) -> Option<u32> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// Whether sequence value `seen` has reached `target` (wrapping comparison).
#[inline]
pub(crate) fn reached(seen: u32, target: u32) -> bool {
    (seen.wrapping_sub(target) as i32) >= 0
}

/// Spins for the policy's time budget, then yields a few times, until `word` reaches
/// `target`. Returns whether it did; the caller then falls back to [`futex_wait`] in a loop of
/// its own. The budget is in time, not iterations: a `pause` costs from 10 to 140 cycles
/// depending on the CPU.
#[inline]
pub(crate) fn spin_then_yield(word: &AtomicU32, target: u32, policy: &WaitPolicy) -> bool {
    if reached(word.load(Ordering::Acquire), target) {
        return true;
    }
    let start = Instant::now();
    loop {
        for _ in 0..32 {
            if reached(word.load(Ordering::Acquire), target) {
                return true;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= policy.spin {
            break;
        }
    }
    for _ in 0..policy.yields {
        if reached(word.load(Ordering::Acquire), target) {
            return true;
        }
        std::thread::yield_now();
    }
    reached(word.load(Ordering::Acquire), target)
}

/// After [`spin_then_yield`] failed: keeps yielding until `word` reaches `target`, as long as
/// `peer_running()` says the peer that will publish it is running and the policy's patience
/// lasts. Returns whether the word was reached; if not, the caller sleeps on the futex.
pub(crate) fn yield_while_running(
    word: &AtomicU32,
    target: u32,
    policy: &WaitPolicy,
    peer_running: impl Fn() -> bool,
) -> bool {
    let start = Instant::now();
    loop {
        if reached(word.load(Ordering::Acquire), target) {
            return true;
        }
        if !peer_running() || start.elapsed() >= policy.patience {
            return false;
        }
        if policy.patience_yields {
            std::thread::yield_now();
        } else {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
        }
    }
}

/// Sleeps while `word` still holds `expected`, at most `timeout`. Spurious wake-ups are fine.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: the word is a valid, aligned u32 in (possibly shared) memory; FUTEX_WAIT without
    // the private flag works across processes mapping the same pages.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

/// Wakes every waiter sleeping on `word`.
pub(crate) fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: as in futex_wait.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// A deadline that remembers when it started, for error messages.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline {
    start: Instant,
    limit: Duration,
}

impl Deadline {
    pub(crate) fn after(limit: Duration) -> Self {
        Self {
            start: Instant::now(),
            limit,
        }
    }

    pub(crate) fn expired(&self) -> bool {
        self.start.elapsed() >= self.limit
    }

    pub(crate) fn waited(&self) -> Duration {
        self.start.elapsed()
    }

    pub(crate) fn remaining(&self) -> Duration {
        self.limit.saturating_sub(self.start.elapsed())
    }
}

/// The collective deadline: `CANDLE_TP_TIMEOUT` seconds (fractions allowed), default 300.
pub fn default_timeout() -> Duration {
    std::env::var("CANDLE_TP_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64)
        .unwrap_or(Duration::from_secs(300))
}
