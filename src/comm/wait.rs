//! Waiting for a peer's sequence word: spin briefly, then poll while the peer is running,
//! then sleep on a futex.
//!
//! A pure spin answers in well under a microsecond when every rank has a core, and collapses
//! when ranks outnumber cores (3 ranks on 2 cores): a spinning rank eats the time slice its
//! peer needs. So the spin budget shrinks when the group is larger than the machine, and a
//! waiter yields its core only then or when the machine is busy.
//!
//! After the spin the wait is adaptive: while the peer is itself running (computing its
//! part) the waiter keeps polling, for up to [`WaitPolicy::patience`], because the peer will
//! publish soon and a futex wake-up costs tens of microseconds; a peer that is itself asleep
//! in a wait (an idle server's ranks, all waiting on rank 0's next request) sends the waiter
//! straight to the futex, so long waits cost ~0 % CPU. On a busy machine the waiter yields
//! while yields come back quickly and sleeps once one did not ([`spin_then_yield`]). Every
//! futex sleep has a short timeout so the caller can check deadlines, aborts and dead peers.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How long a waiter spins and yields before it sleeps.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WaitPolicy {
    /// How long to spin (each probe a load and a `spin_loop` hint).
    pub spin: Duration,
    /// `sched_yield` calls after the spin, so a peer sharing this core can run: only when ranks
    /// outnumber cores (and on a busy machine, see [`spin_then_yield`]). With a core per rank
    /// on a quiet machine a yield helps no peer.
    pub yields: u32,
    /// How long to keep polling after the spin while the awaited peer is running (not asleep
    /// in a wait of its own) before sleeping on the futex.
    pub patience: Duration,
    /// Whether that polling yields the core between probes (ranks outnumber cores: the peer
    /// may need this very core) or spins (each rank can have a core of its own).
    pub patience_yields: bool,
    /// Longest single futex sleep, so deadlines and dead peers are noticed.
    pub sleep_slice: Duration,
}

impl WaitPolicy {
    /// Picks a policy for `ranks` ranks sharing this machine: `CANDLE_TP_SPIN_US`
    /// microseconds of spinning (default 20, or 2 when ranks outnumber cores), a few yields
    /// when ranks outnumber cores, then up to `CANDLE_TP_PATIENCE_US` microseconds (default
    /// 5000) of polling while the peer runs.
    pub(crate) fn for_ranks(ranks: usize) -> Self {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        Self::for_ranks_on(ranks, cores)
    }

    /// [`Self::for_ranks`] for a machine of `cores` cores.
    fn for_ranks_on(ranks: usize, cores: usize) -> Self {
        let oversubscribed = ranks > cores;
        let spin_us = env_u32("CANDLE_TP_SPIN_US").unwrap_or(if oversubscribed { 2 } else { 20 });
        Self {
            spin: Duration::from_micros(spin_us as u64),
            yields: if oversubscribed { 4 } else { 0 },
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

/// How [`spin_then_yield`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Spun {
    /// The word reached its target.
    Reached,
    /// Not reached, and a yield is known to be costly: sleep on the futex now.
    Sleep,
    /// Not reached: poll while the peer runs ([`yield_while_running`]), yielding between
    /// probes if `yielding`, which saves a futex wake-up per wait.
    Poll {
        /// Yield the core between probes (ranks outnumber cores, or the machine is busy).
        yielding: bool,
    },
}

/// A `sched_yield` that took longer than this gave the core to a process that kept it for a
/// scheduler slice: the other load on this core does not give way.
const COSTLY_YIELD: Duration = Duration::from_millis(1);
/// How long a costly yield sends this thread's waits straight to the futex.
const COSTLY_MEMORY: Duration = Duration::from_millis(100);
/// Yields a waiter tries when the machine is busy (see [`spin_then_yield`]).
const BUSY_YIELDS: u32 = 4;

thread_local! {
    static YIELDS_COSTLY_UNTIL: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// Whether a yield of this thread recently kept it off its core for a scheduler slice.
fn yields_costly() -> bool {
    YIELDS_COSTLY_UNTIL.with(|u| u.get().is_some_and(|t| Instant::now() < t))
}

/// Yields the core; returns whether it came back quickly (else remembers that yields are
/// costly for [`COSTLY_MEMORY`]).
fn timed_yield() -> bool {
    let t = Instant::now();
    std::thread::yield_now();
    let now = Instant::now();
    let cheap = now - t < COSTLY_YIELD;
    if !cheap {
        YIELDS_COSTLY_UNTIL.with(|u| u.set(Some(now + COSTLY_MEMORY)));
    }
    cheap
}

/// Spins for the policy's time budget, then yields a few times, until `word` reaches
/// `target`; the caller goes on as [`Spun`] says. The budget is in time, not iterations: a
/// `pause` costs from 10 to 140 cycles depending on the CPU.
///
/// A waiter yields when ranks outnumber cores (the peer may need this very core), and when
/// the machine is busy: this thread was preempted since its previous long wait
/// ([`preempted_since_last_check`]), so the peer may be waiting for a core too. A yield on a
/// busy machine is only worth it while the other processes give the core back soon (other
/// ranks of the job, which wait and yield in turn: emulated hosts on one machine). Where a
/// yield hands the core to a process that keeps it until the next scheduler tick (a compile,
/// a busy loop: 4 ms at HZ=250) the waiter sleeps on the futex instead, for
/// [`COSTLY_MEMORY`]: under `bench-collectives.sh --load` a 1 MiB all-reduce took 8 ms while
/// its two phases yielded, 0.1 ms sleeping.
#[inline]
pub(crate) fn spin_then_yield(word: &AtomicU32, target: u32, policy: &WaitPolicy) -> Spun {
    let done = || reached(word.load(Ordering::Acquire), target);
    if done() {
        return Spun::Reached;
    }
    let start = Instant::now();
    loop {
        for _ in 0..32 {
            if done() {
                return Spun::Reached;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= policy.spin {
            break;
        }
    }
    let busy = preempted_since_last_check();
    let yields = if busy {
        policy.yields.max(BUSY_YIELDS)
    } else {
        policy.yields
    };
    if yields > 0 && yields_costly() {
        return if done() { Spun::Reached } else { Spun::Sleep };
    }
    for _ in 0..yields {
        if done() {
            return Spun::Reached;
        }
        if !timed_yield() {
            return if done() { Spun::Reached } else { Spun::Sleep };
        }
    }
    if done() {
        Spun::Reached
    } else {
        Spun::Poll {
            yielding: policy.patience_yields || busy,
        }
    }
}

/// After [`spin_then_yield`] said [`Spun::Poll`]: polls until `word` reaches `target`, as
/// long as `peer_running()` says the peer that will publish it is running and the policy's
/// patience lasts, yielding between probes if `yielding` (and giving up at a costly yield).
/// Returns whether the word was reached; if not, the caller sleeps on the futex.
pub(crate) fn yield_while_running(
    word: &AtomicU32,
    target: u32,
    policy: &WaitPolicy,
    yielding: bool,
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
        if yielding {
            if !timed_yield() {
                return reached(word.load(Ordering::Acquire), target);
            }
        } else {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
        }
    }
}

/// Whether the calling thread was preempted (an involuntary context switch, as
/// `getrusage(RUSAGE_THREAD)` counts them) since its previous call: what tells a waiter that
/// the machine has more runnable work than cores. One system call; made only by waits that
/// outlasted the spin.
pub(crate) fn preempted_since_last_check() -> bool {
    thread_local! {
        static LAST: std::cell::Cell<i64> = const { std::cell::Cell::new(-1) };
    }
    // SAFETY: getrusage writes the struct it is given; zeroed is a valid rusage.
    let now = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_THREAD, &mut u) != 0 {
            return false;
        }
        u.ru_nivcsw as i64
    };
    LAST.with(|last| {
        let before = last.replace(now);
        before >= 0 && now > before
    })
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

/// The variable that sets every wait's deadline, in seconds.
pub const TIMEOUT_VAR: &str = "CANDLE_TP_TIMEOUT";

/// The deadline when [`TIMEOUT_VAR`] is unset.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Reads a [`TIMEOUT_VAR`] value: a positive, finite number of seconds (fractions allowed,
/// blanks around it ignored). Anything else (`abc`, `0`, `30s`, `-1`, `inf`) is an error that
/// says what was given and what is wanted.
///
/// ```
/// use candle_tp::comm::parse_timeout;
/// use std::time::Duration;
/// assert_eq!(parse_timeout(" 2.5 "), Ok(Duration::from_millis(2500)));
/// assert!(parse_timeout("30s").unwrap_err().contains("30s"));
/// assert!(parse_timeout("0").is_err());
/// ```
pub fn parse_timeout(value: &str) -> Result<Duration, String> {
    let v = value.trim();
    match v.parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 && s <= 1e9 => Ok(Duration::from_secs_f64(s)),
        Ok(_) => Err(format!(
            "{TIMEOUT_VAR}={v:?} must be a number of seconds above 0 (and at most 1e9)"
        )),
        Err(_) => Err(format!(
            "{TIMEOUT_VAR}={v:?} is not a number of seconds (write e.g. 30, not 30s)"
        )),
    }
}

/// The deadline [`TIMEOUT_VAR`] sets ([`DEFAULT_TIMEOUT`] when unset or empty), or an error
/// naming a value that is not a positive number of seconds. `init_from_env` checks it before
/// anything else, so a job with a bad value ends at once instead of running on a deadline
/// that nobody asked for.
pub fn timeout_from_env() -> Result<Duration, String> {
    match std::env::var(TIMEOUT_VAR) {
        Ok(v) if !v.trim().is_empty() => parse_timeout(&v),
        _ => Ok(DEFAULT_TIMEOUT),
    }
}

/// The collective deadline: [`timeout_from_env`], or [`DEFAULT_TIMEOUT`] where its value is
/// invalid (only for groups made outside `init_from_env`, such as `run_threads`, which is
/// where the error would otherwise have nowhere to go; the value is reported on stderr once).
pub fn default_timeout() -> Duration {
    timeout_from_env().unwrap_or_else(|e| {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| eprintln!("candle-tp: {e}; using {} s", DEFAULT_TIMEOUT.as_secs()));
        DEFAULT_TIMEOUT
    })
}

#[cfg(test)]
mod tests {
    use super::{parse_timeout, WaitPolicy};
    use std::time::Duration;

    #[test]
    fn timeouts_are_positive_numbers_of_seconds() {
        assert_eq!(parse_timeout("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_timeout("0.25"), Ok(Duration::from_millis(250)));
        for bad in ["abc", "0", "30s", "-1", "inf", "NaN", "", "1e30"] {
            let e = parse_timeout(bad).unwrap_err();
            assert!(
                e.contains("CANDLE_TP_TIMEOUT") && e.contains(bad),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn yields_only_when_ranks_outnumber_cores() {
        for (ranks, cores) in [(1, 1), (2, 2), (2, 16), (4, 4)] {
            let p = WaitPolicy::for_ranks_on(ranks, cores);
            assert_eq!(p.yields, 0, "{ranks} ranks on {cores} cores");
            assert!(!p.patience_yields, "{ranks} ranks on {cores} cores");
        }
        for (ranks, cores) in [(3, 2), (2, 1), (8, 4)] {
            let p = WaitPolicy::for_ranks_on(ranks, cores);
            assert!(p.yields > 0, "{ranks} ranks on {cores} cores");
        }
    }
}
