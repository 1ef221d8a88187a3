//! The `nccl` backend (cargo feature `nccl`): one process per GPU, collectives through NCCL
//! (cudarc's `nccl::safe::Comm`).
//!
//! - Meeting: the same rendezvous store as the `shm` backend (rank 0 hosts it at
//!   `MASTER_ADDR:MASTER_PORT`). Rank 0 of each group draws the NCCL unique id and publishes it
//!   under `<group>/nccl-id`; the others read it. Every member then checks in under
//!   `<group>/nccl-ready/<rank>` and waits (with the group's deadline) for all the others
//!   before `ncclCommInitRank`, which itself waits without a deadline.
//! - Device: the CUDA device given to [`init_nccl`](crate::comm::init_nccl) (`LOCAL_RANK` under `tprun`/`torchrun`,
//!   see [`crate::device_from_arg`]). Its context is made current on the calling thread before
//!   `ncclCommInitRank` (cudarc's `Comm::from_rank` does not do it) and before every call.
//! - Sub-groups: a new communicator per group, its id exchanged through the store the same way.
//! - Streams: the communicator is created on the candle device's stream, so collectives are
//!   enqueued on the stream the tensors' kernels run on: no host copy, no synchronisation.
//!   Candle's default device stream is CUDA's per-thread stream, so "the same stream" holds for
//!   the thread that runs the op (the thread that also enqueued the producer kernels).
//! - Host slices (`all_reduce_slice`, …; a few values in the sampler, `split`) are staged through
//!   device memory and synchronise the stream: they are meant for small messages.
//!
//! Reductions of `f16`/`bf16` are NCCL's (accumulated in the element type), unlike the CPU
//! engine which widens to `f32`.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use candle_core::cuda_backend::CudaDevice;
use cudarc::driver::{CudaView, CudaViewMut, DeviceRepr};
use cudarc::nccl::result::{group_end, group_start, NcclError};
use cudarc::nccl::safe::{Comm, NcclType, ReduceOp as NcclOp};

use super::backend::{
    erased_all_to_all, erased_collectives, Backend, BlockSizes, DeviceCollectives,
};
use super::context::Context;
use super::element::ReduceOp;
use super::error::{CommError, CommResult};
use super::stats::{CollectiveKind, SharedStats};

mod device;
mod host;
mod setup;

pub(crate) use setup::{join, rendezvous};
// Only a job that mpirun launched meets over MPI's store (comm/env.rs).
#[cfg(feature = "mpi")]
pub(crate) use setup::join_on;

/// An NCCL communicator that may move between threads.
///
/// `cudarc::nccl::safe::Comm` holds a raw `ncclComm_t`, so it is neither `Send` nor `Sync`
/// (cudarc PR #585 discusses adding them; mistral.rs and candle's `llama_multiprocess` example
/// use it from one thread and leave the question open). NCCL allows a communicator to be used
/// from any thread, but not from two threads at once, and calls on it must be issued in the
/// same order on every rank. What guarantees that here:
///
/// - `NcclComm` is `Send` but deliberately **not** `Sync`: the only place that holds one is the
///   `Mutex<Option<NcclComm>>` of an [`NcclGroup`], so every call on a communicator (a
///   collective, a grouped `ncclGroupStart…End` sequence, the abort in `Drop`) runs under that
///   lock, by one thread at a time. The lock is held only while operations are *enqueued*
///   (NCCL is asynchronous), never across a wait for peers.
/// - The CUDA context is bound to the calling thread before each call (see
///   [`NcclGroup::lock`]), so a communicator used from another thread than the one that
///   created it still targets its own device.
/// - The stream it enqueues on is the candle device's stream; buffers come from that device
///   (checked by [`NcclGroup::check_device`]), so stream ordering, not host synchronisation,
///   orders collectives with the kernels that produce and consume their tensors.
pub(crate) struct NcclComm(Comm);

// SAFETY: see the type's documentation: an NCCL communicator may be used from any thread as
// long as calls are not concurrent; the `Mutex` owning every `NcclComm` serialises them, and
// `NcclComm` is not `Sync`, so no `&NcclComm` escapes that lock.
unsafe impl Send for NcclComm {}

/// The NCCL side of a [`ProcessGroup`](crate::ProcessGroup).
pub(crate) struct NcclGroup {
    /// `None` once the group was aborted (dropping the `Comm` calls `ncclCommAbort`).
    comm: Mutex<Option<NcclComm>>,
    /// Set by [`NcclGroup::abort`] without the lock: a thread that holds the lock while abort
    /// runs drops the communicator the next time it takes the lock, so no abort is lost.
    abort_requested: std::sync::atomic::AtomicBool,
    device: CudaDevice,
    stats: SharedStats,
    name: String,
    rank: usize,
    size: usize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn nccl_err(what: String) -> impl FnOnce(NcclError) -> CommError {
    move |e| CommError::Io {
        context: what,
        source: format!("NCCL error {:?}", e.0),
    }
}

fn driver_err(what: String) -> impl FnOnce(cudarc::driver::DriverError) -> CommError {
    move |e| CommError::Io {
        context: what,
        source: format!("CUDA driver error {e:?}"),
    }
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Max => NcclOp::Max,
    }
}

/// Ordinal of a candle CUDA device.
pub(crate) fn ordinal(device: &CudaDevice) -> usize {
    device.cuda_stream().context().ordinal()
}

/// Host buffers go through device memory (`nccl/host.rs`); tensors on the GPU take the
/// device collectives directly (`ops/cuda.rs`, through
/// [`ProcessGroup::device_collectives`](crate::ProcessGroup::device_collectives)).
impl Backend for NcclGroup {
    erased_collectives!();
    erased_all_to_all!();

    fn barrier(&self) -> CommResult<()> {
        NcclGroup::barrier(self)
    }

    fn abort(&self, _reason: &str) {
        // NCCL has no abort word to carry `reason`: ncclCommAbort stops this rank's pending
        // work; peers see their own NCCL error (or timeout) instead.
        NcclGroup::abort(self)
    }

    fn shared_stats(&self) -> Option<&SharedStats> {
        Some(&self.stats)
    }

    fn subgroup(
        &self,
        ctx: &Arc<Context>,
        name: String,
        rank: usize,
        members: &[usize],
    ) -> CommResult<Arc<dyn Backend>> {
        Ok(Arc::new(rendezvous(
            ctx,
            name,
            rank,
            members.len(),
            &self.device,
        )?))
    }

    fn kind(&self) -> &'static str {
        "nccl"
    }

    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        Some(self)
    }
}

impl NcclGroup {
    pub(crate) fn who(&self, op: &str) -> String {
        format!(
            "{op} on NCCL group '{}' (rank {} of {}, cuda:{})",
            self.name,
            self.rank,
            self.size,
            ordinal(&self.device)
        )
    }

    /// Destroys the communicator with `ncclCommAbort` (pending operations stop); every later
    /// collective of this group fails.
    ///
    /// Callable from a watchdog thread while another thread is inside a collective: the
    /// request is recorded first (an atomic, no lock), then the lock is tried for up to
    /// 100 ms (it is held only while operations are enqueued). If the other thread still
    /// holds it, that thread drops the communicator when it next takes the lock, and every
    /// later call fails with `Aborted`. (Calling `ncclCommAbort` without the lock would need
    /// the raw communicator, which cudarc 0.19's `Comm` does not expose.)
    pub(crate) fn abort(&self) {
        self.abort_requested
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let deadline = Instant::now() + std::time::Duration::from_millis(100);
        loop {
            match self.comm.try_lock() {
                Ok(mut c) => {
                    c.take();
                    return;
                }
                Err(std::sync::TryLockError::Poisoned(e)) => {
                    e.into_inner().take();
                    return;
                }
                Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(1))
                }
                Err(std::sync::TryLockError::WouldBlock) => return,
            }
        }
    }

    /// Checks that a tensor's device is this communicator's (same GPU, same stream).
    pub(crate) fn check_device(&self, dev: &CudaDevice, op: &str) -> CommResult<()> {
        let (mine, theirs) = (self.device.cuda_stream(), dev.cuda_stream());
        if ordinal(dev) != ordinal(&self.device) || mine.cu_stream() != theirs.cu_stream() {
            return Err(CommError::invalid(
                self.who(op),
                format!(
                    "the tensor is on cuda:{} (stream {:?}) but the group's communicator is on \
                     cuda:{} (stream {:?}); build the group with this tensor's device",
                    ordinal(dev),
                    theirs.cu_stream(),
                    ordinal(&self.device),
                    mine.cu_stream()
                ),
            ));
        }
        Ok(())
    }

    /// Locks the communicator and makes its CUDA context current on this thread.
    fn lock(&self, op: &str) -> CommResult<MutexGuard<'_, Option<NcclComm>>> {
        let mut guard = lock(&self.comm);
        if self
            .abort_requested
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            guard.take();
        }
        if guard.is_none() {
            return Err(CommError::Aborted {
                group: self.name.clone(),
                op: op.into(),
                rank: self.rank,
                reason: "the group's NCCL communicator was aborted".into(),
            });
        }
        self.device
            .cuda_stream()
            .context()
            .bind_to_thread()
            .map_err(driver_err(self.who(op)))?;
        Ok(guard)
    }

    fn record(&self, kind: CollectiveKind, payload: usize, start: Instant) {
        let p = self.size.max(1);
        let moved = payload * (p - 1) / p;
        self.stats
            .lock()
            .record(kind, payload, moved, moved, start.elapsed());
    }

    fn check_len(&self, op: &str, what: &str, got: usize, want: usize) -> CommResult<()> {
        if got != want {
            return Err(CommError::invalid(
                self.who(op),
                format!("{what} has {got} elements, expected {want}"),
            ));
        }
        Ok(())
    }

    fn check_counts(&self, op: &str, counts: &[usize]) -> CommResult<()> {
        if counts.len() != self.size {
            return Err(CommError::invalid(
                self.who(op),
                format!("{} per-rank counts for {} ranks", counts.len(), self.size),
            ));
        }
        Ok(())
    }

    /// All-reduce of `src` into `dst` (same length) on the device, asynchronously.
    pub(crate) fn all_reduce<T: NcclType + DeviceRepr>(
        &self,
        src: &CudaView<'_, T>,
        dst: &mut CudaViewMut<'_, T>,
        op: ReduceOp,
    ) -> CommResult<()> {
        let name = "all_reduce";
        self.check_len(name, "output", dst.len(), src.len())?;
        let t = Instant::now();
        let guard = self.lock(name)?;
        if let Some(c) = guard.as_ref() {
            c.0.all_reduce(src, dst, &nccl_op(op))
                .map_err(nccl_err(self.who("ncclAllReduce")))?;
        }
        self.record(
            CollectiveKind::AllReduce,
            src.len() * std::mem::size_of::<T>(),
            t,
        );
        Ok(())
    }

    /// Copies `root`'s `src` into every rank's `dst` (same length), asynchronously.
    pub(crate) fn broadcast<T: NcclType + DeviceRepr>(
        &self,
        src: &CudaView<'_, T>,
        dst: &mut CudaViewMut<'_, T>,
        root: usize,
    ) -> CommResult<()> {
        let name = "broadcast";
        self.check_len(name, "output", dst.len(), src.len())?;
        if root >= self.size {
            return Err(CommError::invalid(
                self.who(name),
                format!("root {root} is not a rank of this group of {}", self.size),
            ));
        }
        let t = Instant::now();
        let guard = self.lock(name)?;
        if let Some(c) = guard.as_ref() {
            c.0.broadcast(Some(src), dst, root as i32)
                .map_err(nccl_err(self.who("ncclBroadcast")))?;
        }
        self.record(
            CollectiveKind::Broadcast,
            src.len() * std::mem::size_of::<T>(),
            t,
        );
        Ok(())
    }

    /// Concatenates every rank's `src` into `dst`, rank `r` contributing `counts[r]` elements.
    /// Equal counts: `ncclAllGather`; unequal: one `ncclBroadcast` per rank in an NCCL group.
    pub(crate) fn all_gather_v<T: NcclType + DeviceRepr>(
        &self,
        src: &CudaView<'_, T>,
        dst: &mut CudaViewMut<'_, T>,
        counts: &[usize],
    ) -> CommResult<()> {
        let name = "all_gather";
        self.check_counts(name, counts)?;
        self.check_len(name, "this rank's input", src.len(), counts[self.rank])?;
        let total: usize = counts.iter().sum();
        self.check_len(name, "output", dst.len(), total)?;
        let t = Instant::now();
        let guard = self.lock(name)?;
        let Some(c) = guard.as_ref() else {
            return Ok(());
        };
        if counts.iter().all(|&n| n == counts[0]) {
            c.0.all_gather(src, dst)
                .map_err(nccl_err(self.who("ncclAllGather")))?;
        } else {
            grouped(&self.who("ncclGroupStart/End (all_gather_v)"), || {
                let mut off = 0;
                for (r, &n) in counts.iter().enumerate() {
                    let mut part = dst.try_slice_mut(off..off + n).ok_or_else(|| {
                        CommError::invalid(self.who(name), format!("block {r} out of range"))
                    })?;
                    let send = (r == self.rank).then_some(src);
                    c.0.broadcast(send, &mut part, r as i32)
                        .map_err(nccl_err(self.who("ncclBroadcast (all_gather_v)")))?;
                    off += n;
                }
                Ok(())
            })?;
        }
        self.record(
            CollectiveKind::AllGather,
            total * std::mem::size_of::<T>(),
            t,
        );
        Ok(())
    }

    /// Reduces `src` (blocks of `counts[r]` elements) across ranks and leaves block `rank` in
    /// `dst`. Equal counts: `ncclReduceScatter`; unequal: one `ncclReduce` per rank, grouped.
    pub(crate) fn reduce_scatter_v<T: NcclType + DeviceRepr>(
        &self,
        src: &CudaView<'_, T>,
        dst: &mut CudaViewMut<'_, T>,
        counts: &[usize],
        op: ReduceOp,
    ) -> CommResult<()> {
        let name = "reduce_scatter";
        self.check_counts(name, counts)?;
        let total: usize = counts.iter().sum();
        self.check_len(name, "input", src.len(), total)?;
        self.check_len(name, "output", dst.len(), counts[self.rank])?;
        let t = Instant::now();
        let guard = self.lock(name)?;
        let Some(c) = guard.as_ref() else {
            return Ok(());
        };
        if counts.iter().all(|&n| n == counts[0]) {
            c.0.reduce_scatter(src, dst, &nccl_op(op))
                .map_err(nccl_err(self.who("ncclReduceScatter")))?;
        } else {
            grouped(&self.who("ncclGroupStart/End (reduce_scatter_v)"), || {
                let mut off = 0;
                for (r, &n) in counts.iter().enumerate() {
                    let part = src.try_slice(off..off + n).ok_or_else(|| {
                        CommError::invalid(self.who(name), format!("block {r} out of range"))
                    })?;
                    let recv = if r == self.rank {
                        Some(&mut *dst)
                    } else {
                        None
                    };
                    c.0.reduce(&part, recv, &nccl_op(op), r as i32)
                        .map_err(nccl_err(self.who("ncclReduce (reduce_scatter_v)")))?;
                    off += n;
                }
                Ok(())
            })?;
        }
        self.record(
            CollectiveKind::ReduceScatter,
            total * std::mem::size_of::<T>(),
            t,
        );
        Ok(())
    }
}

impl NcclGroup {
    /// All-to-all with the agreed block sizes `sizes`, asynchronously: one `ncclSend` and one
    /// `ncclRecv` per rank with a non-empty block (this rank's own included: NCCL copies it),
    /// in one NCCL group. Counted: the blocks for and from other ranks.
    pub(crate) fn all_to_all_v<T: NcclType + DeviceRepr>(
        &self,
        src: &CudaView<'_, T>,
        dst: &mut CudaViewMut<'_, T>,
        sizes: &BlockSizes<'_>,
    ) -> CommResult<()> {
        let name = "all_to_all";
        if sizes.size() != self.size || sizes.rank() != self.rank {
            return Err(CommError::invalid(
                self.who(name),
                format!(
                    "block sizes for rank {} of {} ranks",
                    sizes.rank(),
                    sizes.size()
                ),
            ));
        }
        sizes.check(&self.who(name), src.len(), dst.len())?;
        let t = Instant::now();
        let guard = self.lock(name)?;
        let Some(c) = guard.as_ref() else {
            return Ok(());
        };
        let me = self.rank;
        let recv = sizes.recv_counts();
        grouped(&self.who("ncclGroupStart/End (all_to_all)"), || {
            let mut at = 0;
            for (r, &n) in recv.iter().enumerate() {
                let (from, to) = (sizes.offset(me, r), sizes.count(me, r));
                if to > 0 {
                    let part = src.try_slice(from..from + to).ok_or_else(|| {
                        CommError::invalid(
                            self.who(name),
                            format!("block for rank {r} out of range"),
                        )
                    })?;
                    c.0.send(&part, r as i32)
                        .map_err(nccl_err(self.who("ncclSend (all_to_all)")))?;
                }
                if n > 0 {
                    let mut part = dst.try_slice_mut(at..at + n).ok_or_else(|| {
                        CommError::invalid(
                            self.who(name),
                            format!("block from rank {r} out of range"),
                        )
                    })?;
                    c.0.recv(&mut part, r as i32)
                        .map_err(nccl_err(self.who("ncclRecv (all_to_all)")))?;
                }
                at += n;
            }
            Ok(())
        })?;
        drop(guard);
        let esz = std::mem::size_of::<T>();
        let own = sizes.count(me, me);
        let (sent, got) = ((src.len() - own) * esz, (dst.len() - own) * esz);
        self.stats.lock().record(
            CollectiveKind::AllToAll,
            sent.max(got),
            sent,
            got,
            t.elapsed(),
        );
        Ok(())
    }
}

/// Runs `f` between `ncclGroupStart` and `ncclGroupEnd` (ending the group on errors too).
///
/// cudarc's `Group` guard panics when `ncclGroupEnd` fails; this returns the error instead.
/// The event records of cudarc's per-call `SyncOnDrop` happen before `ncclGroupEnd` enqueues
/// the work, which only matters for buffers used on another stream: every buffer here lives on
/// the communicator's stream (see `check_device`).
fn grouped(what: &str, f: impl FnOnce() -> CommResult<()>) -> CommResult<()> {
    group_start().map_err(nccl_err(what.to_string()))?;
    let r = f();
    let end = group_end().map_err(nccl_err(what.to_string()));
    r.and(end.map(|_| ()))
}
