//! The `shm` backend: ranks are processes on one host.
//!
//! Rank 0 hosts the rendezvous store at `MASTER_ADDR:MASTER_PORT`; every rank connects to it
//! with the job token (under torchrun, every rank joins the agent's store there instead). Rank 0 draws a random job id that names the job's shared-memory
//! segments (`/dev/shm/candle-tp-<job>-<group>`), created with `O_EXCL` and mode 0600 and
//! unlinked as soon as every rank has mapped them. Tensors never go through the socket.

use std::sync::{Arc, Mutex, MutexGuard};

use super::backend::{
    erased_all_to_all, erased_collectives, Backend, BlockSizes, Registration, World,
};
use super::context::{Context, GroupOptions};
use super::element::{Element, ReduceOp};
use super::engine::{check_slot_bytes, region_layout, sweep_dev_shm_once, AbortHandle, Engine};
use super::error::{CommError, CommResult};
use super::job_token::token_for_launch;
use super::launcher::Launch;
use super::region::{self, random_hex, RegionKind};
use super::rendezvous::{rendezvous_from_env, Rendezvous};
use super::single::Single;
use super::stats::CommStats;
use super::store::{connect_job_store, Keep, Store};

/// Environment variable with a tag that `tprun` puts at the start of the job id (so of every
/// segment name, `/dev/shm/candle-tp-<tag>…`): after the job, tprun removes what a rank killed
/// in the middle of a rendezvous could not.
pub const SHM_TAG_VAR: &str = "CANDLE_TP_SHM_TAG";

/// The job id drawn by rank 0: `CANDLE_TP_SHM_TAG` (1 to 32 lowercase ASCII letters or digits)
/// followed by 16 random hex characters, or the random part alone when the tag is unset.
fn job_id() -> CommResult<String> {
    match std::env::var(SHM_TAG_VAR) {
        Err(std::env::VarError::NotPresent) => Ok(random_hex()),
        Ok(tag)
            if (1..=32).contains(&tag.len())
                && tag
                    .bytes()
                    .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase()) =>
        {
            Ok(format!("{tag}{}", random_hex()))
        }
        _ => Err(CommError::env(
            SHM_TAG_VAR,
            "must be 1 to 32 lowercase ASCII letters or digits",
        )),
    }
}

/// The `shm` backend in `init_from_env`'s table: CPUs of one host, what `auto` takes there.
pub(crate) const REGISTRATION: Registration = Registration {
    name: "shm",
    devices: "CPUs",
    serves: candle_core::Device::is_cpu,
    auto: |device, _| device.is_cpu(),
    join: Ok(join_from_env),
};

/// Joins the job this process was started in (tprun, torchrun, or an MPI launcher on one
/// host): the rendezvous from the environment; a job that spans hosts is refused, naming the
/// launcher's variable and what crosses hosts instead.
fn join_from_env(
    _device: &candle_core::Device,
    launch: &Launch,
    options: GroupOptions,
) -> CommResult<World> {
    let mut rv = rendezvous_from_env()?;
    if rv.world_size == 1 {
        return Ok(Single::world());
    }
    if !launch.is_single_host() {
        return Err(CommError::env(
            launch.launcher.local_size_var(),
            format!(
                "the job spans hosts ({} processes, {} on this host, started by {}), but \
                 the shared-memory backend serves one host. On CPUs, cross hosts with MPI: \
                 build with `--features mpi` (scripts/setup-mpi.sh installs Open MPI) and \
                 launch with `mpirun -np 4 --host a:2,b:2 PROGRAM` or `srun -N 2 \
                 --ntasks-per-node 2 PROGRAM` instead of tprun --nnodes (docs/MULTIHOST.md); \
                 tprun --nnodes serves GPU jobs (the nccl feature)",
                launch.world_size,
                launch.local_world_size,
                launch.launcher.name()
            ),
        ));
    }
    // An MPI launcher gave no token (this build has no MPI to send one with): rank 0's token
    // file, kept until the ranks have met (issue 44, defect 4).
    let _token_file = token_for_launch(launch, rv.rank, &mut rv.token, options.timeout)?;
    join(&rv, options)
}

/// Joins the job described by `rv` as one process of the `shm` backend (what
/// [`init_shm`](crate::comm::init_shm) wraps); a job of one rank is [`Single::world`].
pub(crate) fn join(rv: &Rendezvous, options: GroupOptions) -> CommResult<World> {
    if rv.world_size == 1 {
        return Ok(Single::world());
    }
    let (store, keep) = connect_job_store(rv, options.timeout)?;
    join_on(Arc::from(store), keep, rv.rank, rv.world_size, options)
}

/// Joins a job of `size` processes of one host as rank `rank` of the `shm` backend, meeting at
/// `store` (`keep`: what must live as long as the job, rank 0's server).
pub(crate) fn join_on(
    store: Arc<dyn Store>,
    keep: Keep,
    rank: usize,
    size: usize,
    options: GroupOptions,
) -> CommResult<World> {
    if rank == 0 {
        store.set("job", job_id()?.as_bytes())?;
    }
    let job = String::from_utf8_lossy(&store.get("job", options.timeout)?).into_owned();
    let ctx = Context::new(store, RegionKind::Shm, job, &options, size, keep);
    let members: Vec<usize> = (0..size).collect();
    let backend = rendezvous(&ctx, "world".into(), rank, &members, None)?;
    Ok(World::new(rank, size, backend, Some(ctx)))
}

/// The shared-memory engine of one group on this rank: a mapped region and the protocol on it
/// (`comm/engine/`), for processes of one host (`/dev/shm`) or threads of one process.
pub(crate) struct ShmBackend {
    name: String,
    engine: Mutex<Engine>,
    /// Aborts without the engine's lock (a collective stuck on a peer may hold it).
    abort: AbortHandle,
}

impl ShmBackend {
    fn engine(&self) -> MutexGuard<'_, Engine> {
        self.engine.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn who(&self, op: &str) -> String {
        format!("{op} (shm, group '{}')", self.name)
    }

    fn typed_all_reduce<T: Element>(
        &self,
        src: Option<&[T]>,
        dst: &mut [T],
        op: ReduceOp,
    ) -> CommResult<()> {
        let n = dst.len();
        let p = dst.as_mut_ptr();
        let s = src.map_or(p as *const T, <[T]>::as_ptr);
        // SAFETY: `s` is either `p` (in place) or a distinct live buffer of `n` elements
        // (the group checked the lengths; Rust borrows forbid partial overlap).
        unsafe { self.engine().all_reduce(s, p, n, op) }
    }

    fn typed_all_gather<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        counts: &[usize],
    ) -> CommResult<()> {
        self.engine().all_gather(src, dst, counts)
    }

    fn typed_reduce_scatter<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> CommResult<()> {
        self.engine().reduce_scatter(src, dst, counts, op)
    }

    fn typed_broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> CommResult<()> {
        self.engine().broadcast(buf, root)
    }

    fn typed_all_to_all<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        sizes: &BlockSizes<'_>,
    ) -> CommResult<()> {
        self.engine().all_to_all(src, dst, sizes)
    }
}

impl Backend for ShmBackend {
    erased_collectives!();
    erased_all_to_all!();

    fn barrier(&self) -> CommResult<()> {
        self.engine().barrier("barrier")
    }

    fn abort(&self, reason: &str) {
        // The abort word lives in shared memory; a stuck wait of any rank sees it at once.
        self.abort.abort(reason);
    }

    fn stats(&self) -> CommStats {
        self.engine().stats()
    }

    fn reset_stats(&self) {
        self.engine().reset_stats();
    }

    fn subgroup(
        &self,
        ctx: &Arc<Context>,
        name: String,
        rank: usize,
        members: &[usize],
    ) -> CommResult<Arc<dyn Backend>> {
        rendezvous(ctx, name, rank, members, Some((&self.name, &self.abort)))
    }

    fn kind(&self) -> &'static str {
        "shm"
    }
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Removes a segment name when dropped (success or error), so nothing is left in /dev/shm.
struct Unlink(RegionKind, String);

impl Drop for Unlink {
    fn drop(&mut self) {
        region::unlink(self.0, &self.1);
    }
}

/// Meets the other members of group `name` through the store and maps the group's region.
/// Member 0 creates the region; it is unlinked once every member has attached.
///
/// `parent` (the group this one is made from: its name and abort handle) is watched while
/// waiting: a peer that failed before reaching this rendezvous aborted only the parent.
/// What a rank writes in the store, before the reason, where a peer waits for its region's
/// name or for its word that it mapped the region.
const FAILED: &str = "\0failed: ";

pub(crate) fn rendezvous(
    ctx: &Arc<Context>,
    name: String,
    rank: usize,
    members: &[usize],
    parent: Option<(&str, &AbortHandle)>,
) -> CommResult<Arc<dyn Backend>> {
    if members.len() == 1 {
        return Ok(Arc::new(Single::new(name)));
    }
    // Every member knows the segment's name (the job id and the group's): each removes it on
    // any error here (the group failed; no one maps it any more), and every rank of the job
    // removes the job's segments on its host if stopped by SIGTERM (a launcher stopping the
    // job because a rank died, perhaps the one that made a segment). So nothing is left in
    // /dev/shm under any launcher while one rank of the job on a host survives.
    let seg = format!("candle-tp-{}-{:016x}", ctx.job, fnv(&name));
    let shm = ctx.region == RegionKind::Shm;
    if shm {
        region::sweep_on_sigterm(&ctx.job);
        // What jobs that ended without a survivor on this host left (engine/stale.rs).
        sweep_dev_shm_once();
    }
    let met = meet(ctx, name, rank, members, parent, seg.clone());
    if met.is_err() && shm {
        region::unlink(ctx.region, &seg);
    }
    met
}

/// [`rendezvous`] of a group of two or more, whose region is named `seg`.
fn meet(
    ctx: &Arc<Context>,
    name: String,
    rank: usize,
    members: &[usize],
    parent: Option<(&str, &AbortHandle)>,
    seg: String,
) -> CommResult<Arc<dyn Backend>> {
    let size = members.len();
    let key = format!("{name}/region");
    check_slot_bytes(&name, ctx.slot_bytes)?;
    let (_, len) = region_layout(size, ctx.slot_bytes)?;
    let attached = |r: usize| format!("{name}/attached/{r}");
    let mut engine = if rank == 0 {
        let created = (|| {
            let map = region::create(ctx.region, &seg, len)?;
            let unlink = Unlink(ctx.region, seg.clone());
            let mut engine = Engine::attach(
                map,
                name.clone(),
                0,
                size,
                ctx.slot_bytes,
                ctx.timeout,
                true,
                ctx.local_ranks,
            )?;
            if let Some((pname, h)) = parent {
                engine.set_parent(pname.to_string(), h.clone());
            }
            Ok((engine, seg, unlink))
        })();
        let (mut engine, seg, _unlink) = match created {
            Ok(c) => c,
            Err(e) => {
                // The others wait for the region's name: give them the reason instead.
                let _ = ctx.store.set(&key, format!("{FAILED}{e}").as_bytes());
                linger_until_read(ctx, size, &attached);
                return Err(e);
            }
        };
        ctx.store.set(&key, seg.as_bytes())?;
        // Every other rank says whether it mapped the region; one that could not (a
        // different slot size, no memory) fails the group at once, naming it.
        for r in 1..size {
            let word = wait_for_key(ctx, &attached(r), parent).map_err(|e| match e {
                e @ CommError::Aborted { .. } => e,
                _ => CommError::Timeout {
                    group: name.clone(),
                    op: "rendezvous (waiting for every rank to map the group's shared memory)"
                        .into(),
                    missing: (r..size)
                        .filter(|&q| !matches!(ctx.store.try_get(&attached(q)), Ok(Some(_))))
                        .collect(),
                    waited: ctx.timeout,
                },
            })?;
            if let Some(reason) = word.strip_prefix(FAILED.as_bytes()) {
                let reason = format!(
                    "rank {r} could not map the group's shared memory: {}",
                    String::from_utf8_lossy(reason)
                );
                engine.abort(&reason);
                return Err(CommError::Aborted {
                    group: name,
                    op: "rendezvous".into(),
                    rank: r,
                    reason,
                });
            }
        }
        engine.barrier("rendezvous (waiting for every rank to map the group's shared memory)")?;
        engine
    } else {
        let published = wait_for_key(ctx, &key, parent).map_err(|e| match e {
            e @ CommError::Aborted { .. } => e,
            e => CommError::Timeout {
                group: name.clone(),
                op: format!(
                    "rendezvous (waiting for rank 0 to create the group's shared memory: {e})"
                ),
                missing: vec![0],
                waited: ctx.timeout,
            },
        })?;
        if let Some(reason) = published.strip_prefix(FAILED.as_bytes()) {
            // Rank 0 waits for this word before it ends (its store may end with it).
            let _ = ctx.store.set(&attached(rank), FAILED.as_bytes());
            return Err(CommError::Aborted {
                group: name,
                op: "rendezvous".into(),
                rank: 0,
                reason: format!(
                    "rank 0 could not create the group's shared memory: {}",
                    String::from_utf8_lossy(reason)
                ),
            });
        }
        let seg = String::from_utf8_lossy(&published).into_owned();
        let mapped = (|| {
            let map = region::open(ctx.region, &seg, len)?;
            let mut engine = Engine::attach(
                map,
                name.clone(),
                rank,
                size,
                ctx.slot_bytes,
                ctx.timeout,
                false,
                ctx.local_ranks,
            )?;
            if let Some((pname, h)) = parent {
                engine.set_parent(pname.to_string(), h.clone());
            }
            Ok(engine)
        })();
        let mut engine = match mapped {
            Ok(engine) => {
                ctx.store.set(&attached(rank), b"ok")?;
                engine
            }
            Err(e) => {
                let e = with_member_ranks(e, &name, members);
                let _ = ctx
                    .store
                    .set(&attached(rank), format!("{FAILED}{e}").as_bytes());
                return Err(e);
            }
        };
        engine.barrier("rendezvous (waiting for every rank to map the group's shared memory)")?;
        engine
    };
    engine.reset_stats();
    Ok(Arc::new(ShmBackend {
        name,
        abort: engine.abort_handle(),
        engine: Mutex::new(engine),
    }))
}

/// `e` (an argument error of group `group`, which names ranks in the group's own numbering)
/// with the ranks those are in the group it was made from, `members`, when they differ: a
/// host's group numbers its ranks 0, 1, ... where the job knows them as, say, 1 and 3, and a
/// message that says "rank 0" would send the reader to the job's rank 0 (issue 44).
fn with_member_ranks(e: CommError, group: &str, members: &[usize]) -> CommError {
    if members.iter().enumerate().all(|(i, &m)| i == m) {
        return e;
    }
    match e {
        CommError::InvalidArgument { context, detail } => {
            let list = |v: Vec<String>| v.join(", ");
            CommError::InvalidArgument {
                context,
                detail: format!(
                    "{detail} (group '{group}' ranks {} are ranks {} of the group it was made \
                     from, the job's for a host's group)",
                    list((0..members.len()).map(|i| i.to_string()).collect()),
                    list(members.iter().map(|m| m.to_string()).collect()),
                ),
            }
        }
        e => e,
    }
}

/// `ctx.store.get(key)` within the deadline, polled every 20 ms, checking the parent group's
/// abort between polls.
/// How long at most member 0, having failed to create the region, keeps waiting for the
/// others to read why.
const LINGER: std::time::Duration = std::time::Duration::from_secs(10);

/// Member 0 failed to create the region and published why: it waits (up to [`LINGER`], or the
/// group's timeout if shorter) until every other member has answered under `attached(r)`
/// that it read the reason. The store may be this rank's (the job's rank 0): a peer that
/// connected after this rank returned would learn only that the store had closed (CI failed
/// once so).
fn linger_until_read(ctx: &Context, size: usize, attached: &dyn Fn(usize) -> String) {
    let until = std::time::Instant::now() + ctx.timeout.min(LINGER);
    for r in 1..size {
        while matches!(ctx.store.try_get(&attached(r)), Ok(None))
            && std::time::Instant::now() < until
        {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}

fn wait_for_key(
    ctx: &Context,
    key: &str,
    parent: Option<(&str, &AbortHandle)>,
) -> CommResult<Vec<u8>> {
    let Some((pname, h)) = parent else {
        return ctx.store.get(key, ctx.timeout);
    };
    let deadline = std::time::Instant::now() + ctx.timeout;
    loop {
        if let Some((group, rank, reason)) = h.aborted(pname) {
            return Err(CommError::Aborted {
                group,
                op: format!("rendezvous of a sub-group (waiting for '{key}')"),
                rank,
                reason,
            });
        }
        if let Some(v) = ctx.store.try_get(key)? {
            return Ok(v);
        }
        if std::time::Instant::now() >= deadline {
            // The store's own timeout error, which names the key.
            return ctx.store.get(key, std::time::Duration::ZERO);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host's group (world ranks 1 and 3 of the job, ranks 0 and 1 among themselves) names
    /// both numberings in an argument error; a group numbered as its parent is left alone, and
    /// other errors are not touched.
    #[test]
    fn a_host_groups_error_names_the_jobs_ranks() {
        let e = || CommError::invalid("group 'world/host' rank 1", "made by rank 0: 2 ranks");
        let named = with_member_ranks(e(), "world/host", &[1, 3]).to_string();
        for part in [
            "made by rank 0",
            "ranks 0, 1 are ranks 1, 3",
            "'world/host'",
        ] {
            assert!(named.contains(part), "{named:?} lacks {part:?}");
        }
        assert_eq!(
            with_member_ranks(e(), "world", &[0, 1]).to_string(),
            e().to_string()
        );
        let t = CommError::Timeout {
            group: "g".into(),
            op: "x".into(),
            missing: vec![1],
            waited: std::time::Duration::from_secs(1),
        };
        let text = t.to_string();
        assert_eq!(with_member_ranks(t, "g", &[2, 5]).to_string(), text);
    }
}
