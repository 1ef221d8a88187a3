//! Running a model's forward on a rayon worker thread, in one hand-off.
//!
//! Candle's CPU ops (element-wise maps, softmax, its gemm) and the crate's kernels split
//! their work with rayon. Called from a thread outside any pool (a rank's main thread), every
//! such op hands its work to a pool and sleeps until a worker is done: two futex wake-ups and
//! context switches per op, hundreds per decoded token. With one thread per rank
//! (`RAYON_NUM_THREADS=1`, one core per rank) that was 14 % of the decode's samples and 70 %
//! of its non-matmul time on SmolLM2 at world 1 (9 ms of 22 per token). [`on_worker`] moves
//! the whole forward onto a worker once, so the ops inside run on it directly.
//!
//! The worker belongs to a pool of the calling thread's own, not to rayon's global pool: with
//! the threads backend every rank is a thread of one process, and ranks that waited in the
//! global pool's queue for a worker while the ranks on the workers waited for them in a
//! collective would never finish (tested below).

use rayon::{ThreadPool, ThreadPoolBuilder};

thread_local! {
    /// This thread's pool, as many threads as rayon's global pool (`RAYON_NUM_THREADS`, else
    /// one per core); `None` if the threads could not be started.
    static POOL: Option<ThreadPool> = ThreadPoolBuilder::new()
        .num_threads(rayon::current_num_threads())
        .thread_name(|i| format!("candle-tp-worker-{i}"))
        .build()
        .ok();
}

/// Runs `f` on a worker of the calling thread's own rayon pool (directly if the caller is
/// already a rayon worker, or if no pool could be started) and returns its result; the caller
/// blocks meanwhile.
pub fn on_worker<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    POOL.with(|pool| match pool {
        Some(pool) => pool.install(f),
        None => f(),
    })
}

#[cfg(test)]
mod tests {
    use super::on_worker;
    use std::sync::{mpsc, Arc, Barrier};
    use std::time::Duration;

    #[test]
    fn runs_on_a_worker_once_and_inline_there() {
        assert_eq!(
            rayon::current_thread_index(),
            None,
            "the test thread is no worker"
        );
        let (outer, inner, same) = on_worker(|| {
            let outer = std::thread::current().id();
            let inner = on_worker(|| std::thread::current().id());
            (rayon::current_thread_index(), inner, outer == inner)
        });
        assert!(outer.is_some(), "the body ran outside a pool");
        assert!(same, "a nested call moved to another thread ({inner:?})");
        let r: Result<u32, String> = on_worker(|| Err("bad".into()));
        assert_eq!(r.unwrap_err(), "bad");
    }

    /// More "ranks" (threads of one process, as the threads backend runs them) than rayon's
    /// global pool has workers, each waiting for all the others inside `on_worker`, as ranks
    /// do in a collective: every one must get a worker at once.
    #[test]
    fn ranks_that_wait_for_each_other_all_run() {
        let ranks = rayon::current_num_threads() + 2;
        let barrier = Arc::new(Barrier::new(ranks));
        let (tx, rx) = mpsc::channel();
        for rank in 0..ranks {
            let (barrier, tx) = (barrier.clone(), tx.clone());
            std::thread::spawn(move || {
                on_worker(|| barrier.wait());
                tx.send(rank).unwrap();
            });
        }
        for _ in 0..ranks {
            rx.recv_timeout(Duration::from_secs(20))
                .expect("a rank never got a worker: the ranks wait for each other forever");
        }
    }
}
