//! [`ProcessGroup`]: a set of ranks that run collectives together.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use super::element::{Element, ReduceOp};
use super::engine::{default_slot_bytes, region_layout, AbortHandle, Engine, MAX_RANKS};
use super::error::{CommError, CommResult};
use super::region::{self, RegionKind};
use super::stats::CommStats;
use super::store::Store;
use super::wait::default_timeout;

/// A set of ranks that run collectives together: the whole job (`world`), or a sub-group
/// (a tensor-parallel group, a row of a 2D mesh, …).
///
/// Cloning is cheap (an `Arc`). Collectives on one group must be called by all its ranks in
/// the same order; calls from two threads of one rank on the same group are serialised, not
/// interleaved. Every wait has a deadline (`CANDLE_TP_TIMEOUT` seconds, default 300) and a
/// dead or stuck peer gives an error that names it.
///
/// ```
/// use candle_tp::comm::{run_threads, ReduceOp};
/// let sums = run_threads(3, |pg| {
///     let mut v = vec![pg.rank() as f32; 4];
///     pg.all_reduce_slice(&mut v, ReduceOp::Sum)?;
///     Ok(v[0])
/// })
/// .unwrap();
/// assert_eq!(sums, vec![3.0, 3.0, 3.0]);
/// ```
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    rank: usize,
    size: usize,
    /// World rank of each member, in group order.
    members: Vec<usize>,
    engine: Option<Mutex<Engine>>,
    /// Aborts the engine's group without its lock (a collective may hold it, stuck).
    abort_handle: Option<AbortHandle>,
    /// The NCCL backend, when the group was built on a CUDA device (then `engine` is `None`).
    #[cfg(feature = "nccl")]
    nccl: Option<super::nccl::NcclGroup>,
    ctx: Option<Arc<Context>>,
    children: Mutex<Vec<Weak<Inner>>>,
}

/// What every group of one rank shares: the rendezvous store and naming state.
pub(crate) struct Context {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) region: RegionKind,
    pub(crate) job: String,
    pub(crate) timeout: Duration,
    pub(crate) slot_bytes: usize,
    /// Ranks of the job on this host: a sub-group of 2 on a 4-rank host still shares the
    /// cores with the other ranks, so its wait policy looks at this, not its own size.
    pub(crate) local_ranks: usize,
    /// How many groups of each name this rank created (sub-group keys stay unique).
    created: Mutex<HashMap<String, usize>>,
    /// Things that must live as long as the groups (the store server on rank 0).
    _keep: Mutex<Vec<Box<dyn std::any::Any + Send + Sync>>>,
}

impl Context {
    pub(crate) fn new(
        store: Arc<dyn Store>,
        region: RegionKind,
        job: String,
        options: &GroupOptions,
        local_ranks: usize,
        keep: Vec<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            store,
            region,
            job,
            timeout: options.timeout,
            slot_bytes: options.slot_bytes,
            local_ranks,
            created: Mutex::new(HashMap::new()),
            _keep: Mutex::new(keep),
        })
    }
}

/// Settings of a job's groups. `Default` reads `CANDLE_TP_TIMEOUT` (seconds, default 300)
/// and `CANDLE_TP_SLOT_BYTES` (default 4 MiB).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupOptions {
    /// Deadline of every wait (collectives and rendezvous).
    pub timeout: Duration,
    /// Bytes of one shared data slot per rank (two per rank per group); larger messages are
    /// cut into chunks of this size.
    pub slot_bytes: usize,
}

impl Default for GroupOptions {
    fn default() -> Self {
        Self {
            timeout: default_timeout(),
            slot_bytes: default_slot_bytes(),
        }
    }
}

/// Returns `$body` from the enclosing function when the group is NCCL-backed (feature `nccl`).
macro_rules! on_nccl {
    ($self:ident, |$n:ident| $body:expr) => {
        #[cfg(feature = "nccl")]
        if let Some($n) = &$self.inner.nccl {
            return $body;
        }
    };
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
pub(crate) fn rendezvous(
    ctx: &Arc<Context>,
    name: String,
    rank: usize,
    members: Vec<usize>,
) -> CommResult<ProcessGroup> {
    let size = members.len();
    if size == 1 {
        return Ok(ProcessGroup::from_parts(
            name,
            0,
            members,
            None,
            Some(ctx.clone()),
        ));
    }
    let key = format!("{name}/region");
    let (_, len) = region_layout(size, ctx.slot_bytes)?;
    let mut engine = if rank == 0 {
        let seg = format!("candle-tp-{}-{:016x}", ctx.job, fnv(&name));
        let map = region::create(ctx.region, &seg, len)?;
        let _unlink = Unlink(ctx.region, seg.clone());
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
        ctx.store.set(&key, seg.as_bytes())?;
        engine.barrier("rendezvous (waiting for every rank to map the group's shared memory)")?;
        engine
    } else {
        let seg = ctx
            .store
            .get(&key, ctx.timeout)
            .map_err(|e| CommError::Timeout {
                group: name.clone(),
                op: format!(
                    "rendezvous (waiting for rank 0 to create the group's shared memory: {e})"
                ),
                missing: vec![0],
                waited: ctx.timeout,
            })?;
        let seg = String::from_utf8_lossy(&seg).into_owned();
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
        engine.barrier("rendezvous (waiting for every rank to map the group's shared memory)")?;
        engine
    };
    engine.reset_stats();
    Ok(ProcessGroup::from_parts(
        name,
        rank,
        members,
        Some(engine),
        Some(ctx.clone()),
    ))
}

impl ProcessGroup {
    fn from_parts(
        name: String,
        rank: usize,
        members: Vec<usize>,
        engine: Option<Engine>,
        ctx: Option<Arc<Context>>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                name,
                rank,
                size: members.len(),
                members,
                abort_handle: engine.as_ref().map(Engine::abort_handle),
                engine: engine.map(Mutex::new),
                #[cfg(feature = "nccl")]
                nccl: None,
                ctx,
                children: Mutex::new(Vec::new()),
            }),
        }
    }

    /// A group whose collectives run through NCCL.
    #[cfg(feature = "nccl")]
    pub(crate) fn from_nccl(
        name: String,
        rank: usize,
        members: Vec<usize>,
        nccl: super::nccl::NcclGroup,
        ctx: Arc<Context>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                name,
                rank,
                size: members.len(),
                members,
                engine: None,
                abort_handle: None,
                nccl: Some(nccl),
                ctx: Some(ctx),
                children: Mutex::new(Vec::new()),
            }),
        }
    }

    /// The group's NCCL backend, if it has one.
    #[cfg(feature = "nccl")]
    pub(crate) fn nccl(&self) -> Option<&super::nccl::NcclGroup> {
        self.inner.nccl.as_ref()
    }

    /// A group of one rank: every collective is a copy. What a program gets when it runs
    /// without a launcher; layers built on it behave exactly like candle-nn's.
    pub fn single() -> Self {
        Self::from_parts("single".into(), 0, vec![0], None, None)
    }

    /// This rank's index in the group, `0..size()`.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// The group's name, as errors print it (`world`, `world/tp[0,1]`, …).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// World rank of each member, in group order.
    pub fn members(&self) -> &[usize] {
        &self.inner.members
    }

    /// What this rank's collectives on this group moved so far.
    pub fn stats(&self) -> CommStats {
        on_nccl!(self, |n| n.stats());
        match &self.inner.engine {
            Some(e) => lock(e).stats(),
            None => CommStats::default(),
        }
    }

    /// Zeroes this rank's counters of this group.
    pub fn reset_stats(&self) {
        on_nccl!(self, |n| n.reset_stats());
        if let Some(e) = &self.inner.engine {
            lock(e).reset_stats();
        }
    }

    /// Marks this group and every sub-group created from it as failed, so that peers waiting
    /// in a collective stop at once with an error carrying `reason` (instead of waiting for
    /// the timeout).
    pub fn abort(&self, reason: &str) {
        #[cfg(feature = "nccl")]
        if let Some(n) = &self.inner.nccl {
            // NCCL has no abort word to carry `reason`: ncclCommAbort stops this rank's
            // pending work; peers see their own NCCL error (or timeout) instead.
            n.abort();
        }
        if let Some(h) = &self.inner.abort_handle {
            // Without the group's lock: a collective of this rank, stuck on a peer, may hold
            // it. The abort word lives in shared memory; the stuck wait sees it at once.
            h.abort(reason);
        }
        for child in lock(&self.inner.children).iter().filter_map(Weak::upgrade) {
            ProcessGroup { inner: child }.abort(reason);
        }
    }

    /// An argument error on this rank alone (a wrong length, a bad root) returns before the
    /// collective's first phase, so the peers would wait for it until the deadline: abort the
    /// group with the error, so they fail at once with this reason. Errors every rank sees at
    /// the same phase (a mismatch) leave the group usable and pass through.
    fn abort_if_invalid<R>(&self, r: CommResult<R>) -> CommResult<R> {
        if let Err(e @ CommError::InvalidArgument { .. }) = &r {
            self.abort_with(&e.to_string());
        }
        r
    }

    /// Aborts the group (when it has peers) with `reason` prefixed by this rank's number and
    /// returns `reason` as an error: for argument errors found above the slice API (tensor
    /// shapes that do not match a partition).
    pub(crate) fn refuse(&self, reason: String) -> candle_core::Error {
        self.abort_with(&reason);
        candle_core::Error::Msg(reason)
    }

    fn abort_with(&self, reason: &str) {
        if self.size() > 1 {
            self.abort(&format!("rank {}: {reason}", self.rank()));
        }
    }

    fn engine(&self) -> Option<MutexGuard<'_, Engine>> {
        self.inner.engine.as_ref().map(lock)
    }

    fn ctx_name(&self, op: &str) -> String {
        format!(
            "{op} on group '{}' (rank {} of {})",
            self.name(),
            self.rank(),
            self.size()
        )
    }

    /// Creates the sub-group of the given ranks (numbered in this group). Only members need
    /// to call it (others may, and get `None` without communicating); members must call it
    /// in the same order as each other. Ranks are taken in the order given: the first is rank
    /// 0 of the new group.
    pub fn new_group(&self, ranks: &[usize]) -> CommResult<Option<ProcessGroup>> {
        self.new_group_named(ranks, "")
    }

    /// Like [`new_group`](Self::new_group), with a label that shows in the group's name and
    /// in error messages (`tp`, `dp`, `row`, …).
    pub fn new_group_named(
        &self,
        ranks: &[usize],
        label: &str,
    ) -> CommResult<Option<ProcessGroup>> {
        let ctx = || self.ctx_name("new_group");
        if ranks.is_empty() {
            return Err(CommError::invalid(ctx(), "the rank list is empty"));
        }
        for (i, &r) in ranks.iter().enumerate() {
            if r >= self.size() {
                return Err(CommError::invalid(
                    ctx(),
                    format!("rank {r} is not in this group of {} ranks", self.size()),
                ));
            }
            if ranks[..i].contains(&r) {
                return Err(CommError::invalid(
                    ctx(),
                    format!("rank {r} is listed twice in {ranks:?}"),
                ));
            }
        }
        let Some(my) = ranks.iter().position(|&r| r == self.rank()) else {
            return Ok(None);
        };
        let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
        let base = format!("{}/{label}[{}]", self.name(), list.join(","));
        let members: Vec<usize> = ranks.iter().map(|&r| self.inner.members[r]).collect();
        let group = match &self.inner.ctx {
            None => ProcessGroup::from_parts(base, 0, members, None, None),
            Some(c) => {
                let n = {
                    let mut created = lock(&c.created);
                    let n = created.entry(base.clone()).or_insert(0);
                    *n += 1;
                    *n
                };
                let name = if n == 1 { base } else { format!("{base}#{n}") };
                #[cfg(feature = "nccl")]
                if let Some(nc) = &self.inner.nccl {
                    let g = super::nccl::rendezvous(c, name, my, members, nc.device())?;
                    lock(&self.inner.children).push(Arc::downgrade(&g.inner));
                    return Ok(Some(g));
                }
                rendezvous(c, name, my, members)?
            }
        };
        lock(&self.inner.children).push(Arc::downgrade(&group.inner));
        Ok(Some(group))
    }

    /// Splits the group like `MPI_Comm_split`: every rank calls it; ranks that pass the same
    /// `color` form a group, ordered by their rank here. `None` joins no group.
    pub fn split(&self, color: Option<u32>) -> CommResult<Option<ProcessGroup>> {
        let mine = color.map(|c| c as i64).unwrap_or(-1);
        let mut colors = vec![0i64; self.size()];
        self.all_gather_slice(&[mine], &mut colors)?;
        if mine < 0 {
            return Ok(None);
        }
        let ranks: Vec<usize> = (0..self.size()).filter(|&r| colors[r] == mine).collect();
        self.new_group_named(&ranks, &format!("color{mine}"))
    }

    /// Element-wise reduction of `buf` across ranks, in place: afterwards every rank holds
    /// the same values.
    pub fn all_reduce_slice<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> CommResult<()> {
        on_nccl!(self, |n| {
            let src = buf.to_vec();
            n.host_all_reduce(&src, buf, op)
        });
        match self.engine() {
            None => Ok(()),
            Some(mut e) => {
                // Both pointers from as_mut_ptr: a shared pointer from as_ptr would be
                // invalidated by the later mutable borrow (Stacked Borrows).
                let p = buf.as_mut_ptr();
                // SAFETY: src and dst are the same valid buffer of buf.len() elements.
                unsafe { e.all_reduce(p as *const T, p, buf.len(), op) }
            }
        }
    }

    /// Element-wise reduction of `src` across ranks into `dst` (same length).
    pub fn all_reduce_slice_into<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        op: ReduceOp,
    ) -> CommResult<()> {
        if src.len() != dst.len() {
            return self.abort_if_invalid(Err(CommError::invalid(
                self.ctx_name("all_reduce"),
                format!(
                    "input has {} elements but output has {}",
                    src.len(),
                    dst.len()
                ),
            )));
        }
        on_nccl!(self, |n| n.host_all_reduce(src, dst, op));
        match self.engine() {
            None => {
                dst.copy_from_slice(src);
                Ok(())
            }
            // SAFETY: distinct valid buffers of equal length (Rust borrows forbid overlap).
            Some(mut e) => unsafe { e.all_reduce(src.as_ptr(), dst.as_mut_ptr(), src.len(), op) },
        }
    }

    /// Concatenates every rank's `src` (all the same length) into `dst`, in rank order.
    pub fn all_gather_slice<T: Element>(&self, src: &[T], dst: &mut [T]) -> CommResult<()> {
        // The shared-memory engine serves at most MAX_RANKS (stack scratch, no allocation);
        // an NCCL group may be larger, so its sizes are a Vec of the group's size.
        if self.size() <= MAX_RANKS {
            let counts = [src.len(); MAX_RANKS];
            self.all_gather_v_slice(src, dst, &counts[..self.size()])
        } else {
            self.all_gather_v_slice(src, dst, &vec![src.len(); self.size()])
        }
    }

    /// Concatenates every rank's `src` into `dst`, where rank `r` contributes `counts[r]`
    /// elements (sizes may differ; every rank passes the same `counts`).
    pub fn all_gather_v_slice<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        counts: &[usize],
    ) -> CommResult<()> {
        on_nccl!(self, |n| self
            .abort_if_invalid(n.host_all_gather_v(src, dst, counts)));
        match self.engine() {
            Some(mut e) => {
                let r = e.all_gather(src, dst, counts);
                drop(e);
                self.abort_if_invalid(r)
            }
            None => {
                if counts != [src.len()] || dst.len() != src.len() {
                    return Err(CommError::invalid(
                        self.ctx_name("all_gather"),
                        format!(
                            "sizes {counts:?}, input {} and output {} elements",
                            src.len(),
                            dst.len()
                        ),
                    ));
                }
                dst.copy_from_slice(src);
                Ok(())
            }
        }
    }

    /// Reduces `src` (the same length on every rank, a multiple of the group size) across
    /// ranks and leaves this rank's equal block of the result in `dst`.
    pub fn reduce_scatter_slice<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        op: ReduceOp,
    ) -> CommResult<()> {
        if self.size() <= MAX_RANKS {
            let counts = [dst.len(); MAX_RANKS];
            self.reduce_scatter_v_slice(src, dst, &counts[..self.size()], op)
        } else {
            self.reduce_scatter_v_slice(src, dst, &vec![dst.len(); self.size()], op)
        }
    }

    /// Reduces `src` (blocks of `counts[r]` elements, concatenated) across ranks and leaves
    /// block `rank()` of the result in `dst`.
    pub fn reduce_scatter_v_slice<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> CommResult<()> {
        on_nccl!(self, |n| self
            .abort_if_invalid(n.host_reduce_scatter_v(src, dst, counts, op)));
        match self.engine() {
            Some(mut e) => {
                let r = e.reduce_scatter(src, dst, counts, op);
                drop(e);
                self.abort_if_invalid(r)
            }
            None => {
                if counts != [dst.len()] || dst.len() != src.len() {
                    return Err(CommError::invalid(
                        self.ctx_name("reduce_scatter"),
                        format!(
                            "sizes {counts:?}, input {} and output {} elements",
                            src.len(),
                            dst.len()
                        ),
                    ));
                }
                dst.copy_from_slice(src);
                Ok(())
            }
        }
    }

    /// Copies `root`'s `buf` into every rank's `buf` (all of the same length).
    pub fn broadcast_slice<T: Element>(&self, buf: &mut [T], root: usize) -> CommResult<()> {
        on_nccl!(self, |n| self.abort_if_invalid(n.host_broadcast(buf, root)));
        match self.engine() {
            Some(mut e) => {
                let r = e.broadcast(buf, root);
                drop(e);
                self.abort_if_invalid(r)
            }
            None if root == 0 => Ok(()),
            None => Err(CommError::invalid(
                self.ctx_name("broadcast"),
                format!("root {root} is not a rank of a 1-rank group"),
            )),
        }
    }

    /// Waits until every rank of the group has called `barrier`.
    pub fn barrier(&self) -> CommResult<()> {
        on_nccl!(self, |n| n.barrier());
        match self.engine() {
            Some(mut e) => e.barrier("barrier"),
            None => Ok(()),
        }
    }
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("name", &self.inner.name)
            .field("rank", &self.inner.rank)
            .field("size", &self.inner.size)
            .finish()
    }
}
