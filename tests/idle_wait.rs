//! A rank that waits a long time in a collective sleeps: it spins and yields only briefly
//! (the wait policy's spin and patience, microseconds to a few milliseconds), then sleeps on a
//! futex, so an idle job (a server between requests) costs ~0 % CPU. Measured with the
//! waiting thread's own CPU clock, over a one-second wait, for a peer that sleeps (idle) and
//! for a peer that computes (busy: the waiter may yield for its patience, then sleeps too).

use std::time::{Duration, Instant};

use candle_tp::run_threads;

/// CPU time consumed by the calling thread so far.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec out-pointer and a clock id every Linux has.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

const LATE: Duration = Duration::from_millis(1000);

/// Rank 0 arrives at a barrier `LATE` after rank 1, spending the time as `rank0_work` says;
/// returns rank 1's (wall, cpu) for its barrier.
fn waiter_cost(busy: bool) -> (Duration, Duration) {
    let out = run_threads(2, move |pg| {
        pg.barrier()?; // both started
        if pg.rank() == 0 {
            let t0 = Instant::now();
            if busy {
                let mut x = 0u64;
                while t0.elapsed() < LATE {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
            } else {
                std::thread::sleep(LATE);
            }
            pg.barrier()?;
            Ok(None)
        } else {
            let (t0, c0) = (Instant::now(), thread_cpu());
            pg.barrier()?;
            Ok(Some((t0.elapsed(), thread_cpu() - c0)))
        }
    })
    .expect("run_threads");
    out[1].expect("rank 1 measured")
}

#[test]
fn a_long_wait_sleeps_instead_of_spinning() {
    for busy in [false, true] {
        let (wall, cpu) = waiter_cost(busy);
        eprintln!("peer busy={busy}: waited {wall:?}, used {cpu:?} of CPU");
        assert!(
            wall >= LATE / 2,
            "the barrier returned after {wall:?}: the wait under test did not happen"
        );
        // The policy spins 20 µs and yields at most 5 ms (CANDLE_TP_PATIENCE_US) before
        // sleeping; the futex wakes every 50 ms to check deadlines. 2 % of the wait is a
        // tenfold margin over that, and a fiftieth of what a spinning waiter uses.
        assert!(
            cpu < wall / 50,
            "peer busy={busy}: the waiter used {cpu:?} of CPU over a {wall:?} wait (a spin?)"
        );
    }
}
