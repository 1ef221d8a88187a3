//! The `threads` backend: N ranks as threads of one process.
//!
//! It runs the very same engine and rendezvous as the `shm` backend, over anonymous shared
//! memory and an in-process store, so tests on threads exercise the code that processes run.

use std::sync::Arc;
use std::time::Instant;

use super::context::{Context, GroupOptions};
use super::group::ProcessGroup;
use super::region::{random_hex, RegionKind};
use super::shm::rendezvous;
use super::store::MemStore;

/// Runs `f` on `world_size` ranks, each a thread with its own [`ProcessGroup`] of the same
/// world, and returns their results in rank order.
///
/// If a rank returns an error or panics, the world group and its sub-groups are aborted so the
/// other ranks stop at their next collective instead of waiting for the timeout, and the
/// error of the rank that failed first is returned, naming it.
///
/// ```
/// use candle_tp::comm::{run_threads, ReduceOp};
/// let out = run_threads(2, |pg| {
///     let mut v = [pg.rank() as f64 + 1.0];
///     pg.all_reduce_slice(&mut v, ReduceOp::Max)?;
///     Ok(v[0])
/// })
/// .unwrap();
/// assert_eq!(out, vec![2.0, 2.0]);
/// ```
pub fn run_threads<T, F>(world_size: usize, f: F) -> candle_core::Result<Vec<T>>
where
    T: Send,
    F: Fn(ProcessGroup) -> candle_core::Result<T> + Sync,
{
    run_threads_with(world_size, GroupOptions::default(), f)
}

/// [`run_threads`] with explicit settings (a short timeout, small slots to exercise chunking).
pub fn run_threads_with<T, F>(
    world_size: usize,
    options: GroupOptions,
    f: F,
) -> candle_core::Result<Vec<T>>
where
    T: Send,
    F: Fn(ProcessGroup) -> candle_core::Result<T> + Sync,
{
    if world_size == 0 {
        candle_core::bail!("run_threads: the world size must be at least 1");
    }
    let store = Arc::new(MemStore::new());
    let job = random_hex();
    let results: Vec<Result<T, (Instant, String)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let (store, job, f) = (store.clone(), job.clone(), &f);
                std::thread::Builder::new()
                    .name(format!("candle-tp-rank-{rank}"))
                    .spawn_scoped(s, move || {
                        let ctx = Context::new(
                            store,
                            RegionKind::InProcess,
                            job,
                            &options,
                            world_size,
                            Vec::new(),
                        );
                        let members: Vec<usize> = (0..world_size).collect();
                        let backend = rendezvous(&ctx, "world".into(), rank, &members, None)
                            .map_err(|e| (Instant::now(), e.to_string()))?;
                        let pg = ProcessGroup::new(
                            "world".into(),
                            rank,
                            members,
                            backend,
                            Some(ctx.clone()),
                        );
                        let out =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(
                                || f(pg.clone()),
                            ));
                        let err = match out {
                            Ok(Ok(v)) => return Ok(v),
                            Ok(Err(e)) => e.to_string(),
                            Err(p) => {
                                let msg = p
                                    .downcast_ref::<&str>()
                                    .map(|s| s.to_string())
                                    .or_else(|| p.downcast_ref::<String>().cloned())
                                    .unwrap_or_else(|| "unknown panic".into());
                                format!("panicked: {msg}")
                            }
                        };
                        let when = Instant::now();
                        pg.abort(&format!("rank {rank} failed: {err}"));
                        Err((when, err))
                    })
                    .map_err(|e| e.to_string())
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Ok(h) => h.join().unwrap_or_else(|_| {
                    Err((
                        Instant::now(),
                        format!("rank {rank} thread could not be joined"),
                    ))
                }),
                Err(e) => Err((
                    Instant::now(),
                    format!("could not spawn the thread of rank {rank}: {e}"),
                )),
            })
            .collect()
    });
    let first = results
        .iter()
        .enumerate()
        .filter_map(|(r, x)| x.as_ref().err().map(|(t, e)| (*t, r, e)))
        .min_by_key(|(t, _, _)| *t);
    if let Some((_, rank, err)) = first {
        candle_core::bail!("rank {rank} of {world_size} (threads backend) failed first: {err}");
    }
    Ok(results.into_iter().filter_map(Result::ok).collect())
}
