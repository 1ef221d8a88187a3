//! [`ProcessGroup`]: a set of ranks that run collectives together, on any backend.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

#[cfg(feature = "nccl")]
use super::backend::DeviceCollectives;
use super::backend::{Backend, HostBuf, HostBufMut, World};
use super::context::Context;
use super::element::{Element, ReduceOp};
use super::error::{CommError, CommResult};
use super::single::Single;
use super::stats::CommStats;

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
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    name: String,
    rank: usize,
    size: usize,
    /// World rank of each member, in group order.
    members: Vec<usize>,
    /// The collectives: shared memory, NCCL, one rank... (`comm/backend.rs`).
    backend: Arc<dyn Backend>,
    ctx: Option<Arc<Context>>,
    children: Mutex<Vec<Weak<Inner>>>,
    /// The two-rank groups of this rank with each peer it sent to or received from
    /// (`comm/p2p.rs`), by peer.
    pub(super) pairs: Mutex<HashMap<usize, ProcessGroup>>,
}

/// Groups up to this size pass their per-rank sizes in a stack array.
const INLINE_COUNTS: usize = 64;

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ProcessGroup {
    /// A group on `backend`: this rank is `rank` of `members` (world ranks, group order).
    pub(crate) fn new(
        name: String,
        rank: usize,
        members: Vec<usize>,
        backend: Arc<dyn Backend>,
        ctx: Option<Arc<Context>>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                name,
                rank,
                size: members.len(),
                members,
                backend,
                ctx,
                children: Mutex::new(Vec::new()),
                pairs: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The group of a backend's joined world.
    pub(crate) fn from_world(w: World) -> Self {
        Self::new(w.name, w.rank, w.members, w.backend, w.ctx)
    }

    /// The backend the group hands its collectives to (for the collectives written in files of
    /// their own beside this one, `all_to_all.rs`).
    pub(super) fn host_backend(&self) -> &dyn Backend {
        self.inner.backend.as_ref()
    }

    /// The group's collectives on device memory, when its backend has them (NCCL), for the
    /// CUDA tensor paths of `ops`.
    #[cfg(feature = "nccl")]
    pub(crate) fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        self.inner.backend.device_collectives()
    }

    /// A group of one rank: every collective is a copy. What a program gets when it runs
    /// without a launcher; layers built on it behave exactly like candle-nn's.
    pub fn single() -> Self {
        Self::from_world(Single::world())
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

    /// The backend that carries this group's collectives, as `CANDLE_TP_BACKEND` names it:
    /// `shm` (shared memory: processes of one host, or threads), `mpi`, `hierarchical` (shm
    /// inside each host, MPI between hosts), `nccl`, or `single` for a group of one rank.
    ///
    /// ```
    /// assert_eq!(candle_tp::comm::ProcessGroup::single().backend(), "single");
    /// ```
    pub fn backend(&self) -> &'static str {
        self.inner.backend.kind()
    }

    /// World rank of each member, in group order.
    pub fn members(&self) -> &[usize] {
        &self.inner.members
    }

    /// What this rank's collectives on this group moved so far, its point-to-point transfers
    /// ([`send_slice`](Self::send_slice) / [`recv_slice`](Self::recv_slice): broadcasts on a
    /// two-rank group) included.
    pub fn stats(&self) -> CommStats {
        let mut s = self.inner.backend.stats();
        for pair in lock(&self.inner.pairs).values() {
            s.add(&pair.stats());
        }
        s
    }

    /// Zeroes this rank's counters of this group (its point-to-point transfers' too).
    pub fn reset_stats(&self) {
        self.inner.backend.reset_stats();
        for pair in lock(&self.inner.pairs).values() {
            pair.reset_stats();
        }
    }

    /// Marks this group and every sub-group created from it as failed, so that peers waiting
    /// in a collective stop at once with an error carrying `reason` (instead of waiting for
    /// the timeout).
    pub fn abort(&self, reason: &str) {
        // Without waiting for a collective of this rank that may be stuck on a peer.
        self.inner.backend.abort(reason);
        for child in lock(&self.inner.children).iter().filter_map(Weak::upgrade) {
            ProcessGroup { inner: child }.abort(reason);
        }
    }

    /// An argument error on this rank alone (a wrong length, a bad root) returns before the
    /// collective's first phase, so the peers would wait for it until the deadline: abort the
    /// group with the error, so they fail at once with this reason. Errors every rank sees at
    /// the same phase (a mismatch) leave the group usable and pass through.
    pub(super) fn abort_if_invalid<R>(&self, r: CommResult<R>) -> CommResult<R> {
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
            None => ProcessGroup::new(base.clone(), 0, members, Arc::new(Single::new(base)), None),
            Some(c) => {
                let name = c.unique_name(base);
                let backend = self.inner.backend.subgroup(c, name.clone(), my, &members)?;
                ProcessGroup::new(name, my, members, backend, Some(c.clone()))
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
        self.inner
            .backend
            .all_reduce(None, HostBufMut::new(buf), op)
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
        self.inner
            .backend
            .all_reduce(Some(HostBuf::new(src)), HostBufMut::new(dst), op)
    }

    /// Concatenates every rank's `src` (all the same length) into `dst`, in rank order.
    pub fn all_gather_slice<T: Element>(&self, src: &[T], dst: &mut [T]) -> CommResult<()> {
        // The sizes on the stack for groups of up to INLINE_COUNTS ranks, in a Vec beyond.
        if self.size() <= INLINE_COUNTS {
            let counts = [src.len(); INLINE_COUNTS];
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
        let r = self
            .inner
            .backend
            .all_gather_v(HostBuf::new(src), HostBufMut::new(dst), counts);
        self.abort_if_invalid(r)
    }

    /// Reduces `src` (the same length on every rank, a multiple of the group size) across
    /// ranks and leaves this rank's equal block of the result in `dst`.
    pub fn reduce_scatter_slice<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        op: ReduceOp,
    ) -> CommResult<()> {
        if self.size() <= INLINE_COUNTS {
            let counts = [dst.len(); INLINE_COUNTS];
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
        let r = self.inner.backend.reduce_scatter_v(
            HostBuf::new(src),
            HostBufMut::new(dst),
            counts,
            op,
        );
        self.abort_if_invalid(r)
    }

    /// Copies `root`'s `buf` into every rank's `buf` (all of the same length).
    pub fn broadcast_slice<T: Element>(&self, buf: &mut [T], root: usize) -> CommResult<()> {
        let r = self.inner.backend.broadcast(HostBufMut::new(buf), root);
        self.abort_if_invalid(r)
    }

    /// Waits until every rank of the group has called `barrier`.
    pub fn barrier(&self) -> CommResult<()> {
        self.inner.backend.barrier()
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
