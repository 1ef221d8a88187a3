//! The one trait every communication backend implements, the type-erased host buffers it
//! takes, and what a backend hands up: the [`World`] its join returns (which
//! [`ProcessGroup`](super::ProcessGroup) wraps; no backend builds a group) and the
//! [`Registration`] that puts it in `init_from_env`'s table (`comm/join.rs`).
//!
//! [`ProcessGroup`](super::ProcessGroup) holds an `Arc<dyn Backend>` and never asks which
//! backend it is: the shared-memory engine (processes or threads of one host,
//! `comm/shm.rs`), NCCL (`comm/nccl.rs`, feature `nccl`), MPI (`comm/mpi/`), the hierarchical
//! backend (`comm/hierarchical/`) and the one-rank group (`comm/single.rs`) each live in their
//! own files. A new backend is one more file implementing [`Backend`] and a [`Registration`],
//! plus its line in `join::BACKENDS`. A capability only some backends have is a trait method
//! with a default (NCCL's collectives on device memory: `device_collectives`), never a
//! downcast.
//!
//! Collectives are generic over [`Element`] in the group's API; a trait object cannot have
//! generic methods, so buffers cross the trait as [`HostBuf`] / [`HostBufMut`] (a slice with
//! its element type), and a backend gets its typed slice back with [`HostBuf::get`] inside
//! [`for_element!`], which expands its body once per element type.

use std::any::TypeId;
use std::marker::PhantomData;
use std::sync::Arc;

use candle_core::DType;

pub(crate) use super::block_sizes::BlockSizes;
use super::context::{Context, GroupOptions};
use super::element::{Element, ReduceOp};
use super::error::{CommError, CommResult};
use super::launcher::Launch;
use super::stats::{CommStats, SharedStats};

/// A host slice of some [`Element`] type, for [`Backend`] methods.
#[derive(Clone, Copy)]
pub(crate) struct HostBuf<'a> {
    ptr: *const u8,
    len: usize,
    ty: TypeId,
    dtype: DType,
    _borrow: PhantomData<&'a [u8]>,
}

/// A mutable host slice of some [`Element`] type, for [`Backend`] methods.
pub(crate) struct HostBufMut<'a> {
    ptr: *mut u8,
    len: usize,
    ty: TypeId,
    dtype: DType,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a> HostBuf<'a> {
    /// Erases the element type of `s`.
    pub(crate) fn new<T: Element>(s: &'a [T]) -> Self {
        Self {
            ptr: s.as_ptr() as *const u8,
            len: s.len(),
            ty: TypeId::of::<T>(),
            dtype: T::DTYPE,
            _borrow: PhantomData,
        }
    }

    /// The slice as `&[T]`, or `None` if it holds another type.
    pub(crate) fn get<T: Element>(self) -> Option<&'a [T]> {
        // SAFETY: built by `new::<T>` from a live `&'a [T]` (same TypeId).
        (self.ty == TypeId::of::<T>())
            .then(|| unsafe { std::slice::from_raw_parts(self.ptr as *const T, self.len) })
    }

    /// The element type.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }
}

impl<'a> HostBufMut<'a> {
    /// Erases the element type of `s`.
    pub(crate) fn new<T: Element>(s: &'a mut [T]) -> Self {
        Self {
            ptr: s.as_mut_ptr() as *mut u8,
            len: s.len(),
            ty: TypeId::of::<T>(),
            dtype: T::DTYPE,
            _borrow: PhantomData,
        }
    }

    /// The slice as `&mut [T]`, or `None` if it holds another type.
    pub(crate) fn get<T: Element>(self) -> Option<&'a mut [T]> {
        // SAFETY: built by `new::<T>` from a live `&'a mut [T]` (same TypeId), consumed here.
        (self.ty == TypeId::of::<T>())
            .then(|| unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, self.len) })
    }

    /// The element type.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }
}

/// The typed slice of `buf`, or an error naming the call (`who()`) when it holds another
/// element type (the erased collectives take `T` from the destination's dtype and the group
/// checked that every buffer has it, so this is a defensive check).
pub(crate) fn typed<'a, T: Element>(
    buf: HostBuf<'a>,
    who: impl FnOnce() -> String,
) -> CommResult<&'a [T]> {
    let dtype = buf.dtype();
    buf.get::<T>().ok_or_else(|| mismatch::<T>(who(), dtype))
}

/// As [`typed`], mutable.
pub(crate) fn typed_mut<'a, T: Element>(
    buf: HostBufMut<'a>,
    who: impl FnOnce() -> String,
) -> CommResult<&'a mut [T]> {
    let dtype = buf.dtype();
    buf.get::<T>().ok_or_else(|| mismatch::<T>(who(), dtype))
}

fn mismatch<T: Element>(who: String, dtype: DType) -> CommError {
    CommError::invalid(
        who,
        format!("a {dtype:?} buffer where {:?} was expected", T::DTYPE),
    )
}

/// Runs `$body` with `$t` the [`Element`] type of `$dtype` (a [`HostBuf::dtype`]); an error
/// naming `$what` (evaluated only then) for a dtype no `Element` has.
macro_rules! for_element {
    ($dtype:expr, $what:expr, |$t:ident| $body:expr) => {
        $crate::comm::backend::for_element!(@each $dtype, $what, $t, $body,
            F32 f32, F64 f64, F16 half::f16, BF16 half::bf16, U8 u8, U32 u32, I16 i16,
            I32 i32, I64 i64)
    };
    (@each $dtype:expr, $what:expr, $t:ident, $body:expr, $($d:ident $ty:ty),+) => {
        match $dtype {
            $(candle_core::DType::$d => {
                type $t = $ty;
                $body
            })+
            other => Err($crate::comm::error::CommError::invalid(
                $what,
                format!("no collective carries dtype {other:?}"),
            )),
        }
    };
}
pub(crate) use for_element;

/// The four collectives of [`Backend`] on erased buffers, written once for every backend:
/// inside an `impl Backend` block, each finds the element type of its buffers and calls the
/// backend's inherent method of the same collective, generic over the element type, on the
/// typed slices: `typed_all_reduce(src: Option<&[T]>, dst: &mut [T], op)`,
/// `typed_all_gather(src: &[T], dst: &mut [T], counts)`,
/// `typed_reduce_scatter(src: &[T], dst: &mut [T], counts, op)` and
/// `typed_broadcast(buf: &mut [T], root)`. Errors name the call with the backend's
/// `who(op: &str) -> String`, which runs only on an error.
macro_rules! erased_collectives {
    () => {
        fn all_reduce(
            &self,
            src: Option<$crate::comm::backend::HostBuf<'_>>,
            dst: $crate::comm::backend::HostBufMut<'_>,
            op: $crate::comm::element::ReduceOp,
        ) -> $crate::comm::error::CommResult<()> {
            use $crate::comm::backend::{for_element, typed, typed_mut};
            let who = || self.who("all_reduce");
            for_element!(dst.dtype(), who(), |T| {
                let src = src.map(|s| typed::<T>(s, who)).transpose()?;
                self.typed_all_reduce(src, typed_mut::<T>(dst, who)?, op)
            })
        }

        fn all_gather_v(
            &self,
            src: $crate::comm::backend::HostBuf<'_>,
            dst: $crate::comm::backend::HostBufMut<'_>,
            counts: &[usize],
        ) -> $crate::comm::error::CommResult<()> {
            use $crate::comm::backend::{for_element, typed, typed_mut};
            let who = || self.who("all_gather");
            for_element!(dst.dtype(), who(), |T| self.typed_all_gather(
                typed::<T>(src, who)?,
                typed_mut::<T>(dst, who)?,
                counts
            ))
        }

        fn reduce_scatter_v(
            &self,
            src: $crate::comm::backend::HostBuf<'_>,
            dst: $crate::comm::backend::HostBufMut<'_>,
            counts: &[usize],
            op: $crate::comm::element::ReduceOp,
        ) -> $crate::comm::error::CommResult<()> {
            use $crate::comm::backend::{for_element, typed, typed_mut};
            let who = || self.who("reduce_scatter");
            for_element!(dst.dtype(), who(), |T| self.typed_reduce_scatter(
                typed::<T>(src, who)?,
                typed_mut::<T>(dst, who)?,
                counts,
                op
            ))
        }

        fn broadcast(
            &self,
            buf: $crate::comm::backend::HostBufMut<'_>,
            root: usize,
        ) -> $crate::comm::error::CommResult<()> {
            use $crate::comm::backend::{for_element, typed_mut};
            let who = || self.who("broadcast");
            for_element!(buf.dtype(), who(), |T| self
                .typed_broadcast(typed_mut::<T>(buf, who)?, root))
        }
    };
}
pub(crate) use erased_collectives;

/// [`Backend::all_to_all_v`] on erased buffers, for a backend with its own all-to-all: inside
/// its `impl Backend` block (beside [`erased_collectives!`]), it calls the backend's inherent
/// `typed_all_to_all(src: &[T], dst: &mut [T], sizes: &BlockSizes)`.
macro_rules! erased_all_to_all {
    () => {
        fn all_to_all_v(
            &self,
            src: $crate::comm::backend::HostBuf<'_>,
            dst: $crate::comm::backend::HostBufMut<'_>,
            sizes: &$crate::comm::backend::BlockSizes<'_>,
        ) -> $crate::comm::error::CommResult<()> {
            use $crate::comm::backend::{for_element, typed, typed_mut};
            let who = || self.who("all_to_all");
            for_element!(dst.dtype(), who(), |T| self.typed_all_to_all(
                typed::<T>(src, who)?,
                typed_mut::<T>(dst, who)?,
                sizes
            ))
        }
    };
}
pub(crate) use erased_all_to_all;

/// The all-to-all of a backend without its own ([`Backend::all_to_all_v`]'s default): an
/// all-gather of every rank's whole send buffer, from which each rank keeps its blocks. It
/// moves every send buffer to every rank, `p − 1` times what a native all-to-all moves; kept
/// callable (`ProcessGroup::all_to_all_v_slice_via_all_gather`) so that the benchmark and the
/// tests compare the two.
pub(crate) fn all_to_all_by_all_gather<B: Backend + ?Sized>(
    backend: &B,
    src: HostBuf<'_>,
    dst: HostBufMut<'_>,
    sizes: &BlockSizes<'_>,
) -> CommResult<()> {
    let (p, me) = (sizes.size(), sizes.rank());
    let who = || format!("all_to_all (through an all-gather; rank {me} of {p})");
    for_element!(dst.dtype(), who(), |T| {
        let src = typed::<T>(src, who)?;
        let dst = typed_mut::<T>(dst, who)?;
        sizes.check(&who(), src.len(), dst.len())?;
        let totals: Vec<usize> = (0..p).map(|s| sizes.sends(s).iter().sum()).collect();
        let mut gathered = vec![T::default(); totals.iter().sum()];
        backend.all_gather_v(HostBuf::new(src), HostBufMut::new(&mut gathered), &totals)?;
        let (starts, out) = (offsets(&totals), offsets(&sizes.recv_counts()));
        for s in 0..p {
            let (at, n) = (starts[s] + sizes.offset(s, me), sizes.count(s, me));
            dst[out[s]..out[s] + n].copy_from_slice(&gathered[at..at + n]);
        }
        Ok(())
    })
}

/// A communication backend: the collectives of one group of ranks on host buffers, its abort,
/// its statistics and how it makes sub-groups.
///
/// Every method is called by all the group's ranks in the same order, with consistent sizes
/// (the group checks what it can before calling). `rank()` of the group is the caller's.
///
/// Implementors write the collectives generic over the element type and let
/// [`erased_collectives!`] write the erased methods (and `as_any`).
pub(crate) trait Backend: Send + Sync + 'static {
    /// Element-wise reduction into `dst`, from `src` (same length) or in place (`None`).
    fn all_reduce(
        &self,
        src: Option<HostBuf<'_>>,
        dst: HostBufMut<'_>,
        op: ReduceOp,
    ) -> CommResult<()>;

    /// Concatenates every rank's `src` into `dst`; rank `r` sends `counts[r]` elements.
    fn all_gather_v(
        &self,
        src: HostBuf<'_>,
        dst: HostBufMut<'_>,
        counts: &[usize],
    ) -> CommResult<()>;

    /// Reduces `src` (blocks of `counts[r]` elements) and leaves block `rank` in `dst`.
    fn reduce_scatter_v(
        &self,
        src: HostBuf<'_>,
        dst: HostBufMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> CommResult<()>;

    /// Copies `root`'s `buf` into every rank's `buf`.
    fn broadcast(&self, buf: HostBufMut<'_>, root: usize) -> CommResult<()>;

    /// All-to-all (`MPI_Alltoallv`): `src` holds this rank's blocks for every rank in rank
    /// order, `dst` receives every rank's block for this one, in rank order; `sizes` is the
    /// matrix of block sizes every rank agreed on (the group checked it, and the buffers
    /// against it). The default is [`all_to_all_by_all_gather`] (every send buffer to every
    /// rank, `p − 1` times the data a native all-to-all moves): a backend with its own
    /// exchange overrides it ([`erased_all_to_all!`]).
    fn all_to_all_v(
        &self,
        src: HostBuf<'_>,
        dst: HostBufMut<'_>,
        sizes: &BlockSizes<'_>,
    ) -> CommResult<()> {
        all_to_all_by_all_gather(self, src, dst, sizes)
    }

    /// Waits until every rank of the group has called it.
    fn barrier(&self) -> CommResult<()>;

    /// Fails this group's pending and later collectives, on every rank where the backend can
    /// reach them, with `reason`. Must not block on a collective in progress.
    fn abort(&self, reason: &str);

    /// The counters the backend's collectives record into, when it keeps them in a
    /// [`SharedStats`] (what [`Backend::stats`] and [`Backend::reset_stats`] read by default);
    /// `None`: nothing counted, or counted elsewhere (then those two are the backend's own).
    fn shared_stats(&self) -> Option<&SharedStats> {
        None
    }

    /// What this rank's collectives moved so far.
    fn stats(&self) -> CommStats {
        self.shared_stats()
            .map(SharedStats::get)
            .unwrap_or_default()
    }

    /// Zeroes the statistics.
    fn reset_stats(&self) {
        if let Some(s) = self.shared_stats() {
            s.reset();
        }
    }

    /// The backend of a sub-group named `name` whose members (world ranks) are `members`, this
    /// rank being `rank` of them. Called by the members only, in the same order.
    fn subgroup(
        &self,
        ctx: &Arc<Context>,
        name: String,
        rank: usize,
        members: &[usize],
    ) -> CommResult<Arc<dyn Backend>>;

    /// The backend's name as `CANDLE_TP_BACKEND` spells it (`shm`, `mpi`, `hierarchical`,
    /// `nccl`), or `single` for a group of one rank.
    fn kind(&self) -> &'static str;

    /// The backend's collectives on device memory, when it has them (NCCL): the capability
    /// the CUDA paths of `ops` use, so that they never name a backend.
    #[cfg(feature = "nccl")]
    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        None
    }
}

/// Collectives on CUDA memory, run on the tensors' own stream (no host copy): what a backend
/// whose collectives live on the device (NCCL) offers through
/// [`Backend::device_collectives`]. `src` is the input's elements `range` of a storage,
/// `dst` a whole storage of the same element type; `name` names the call in errors.
#[cfg(feature = "nccl")]
pub(crate) trait DeviceCollectives {
    /// Checks that `dev` is the group's device and stream; the error names `op`.
    fn check_device(&self, dev: &candle_core::cuda_backend::CudaDevice, op: &str)
        -> CommResult<()>;

    /// Element-wise reduction of `src` into `dst` (same length) across ranks.
    fn all_reduce(
        &self,
        name: &str,
        src: DeviceSrc<'_>,
        dst: &mut DeviceDst,
        op: ReduceOp,
    ) -> candle_core::Result<()>;

    /// Copies `root`'s `src` into every rank's `dst` (same length).
    fn broadcast(
        &self,
        name: &str,
        src: DeviceSrc<'_>,
        dst: &mut DeviceDst,
        root: usize,
    ) -> candle_core::Result<()>;

    /// Concatenates every rank's `src` into `dst`; rank `r` contributes `counts[r]` elements.
    fn all_gather_v(
        &self,
        name: &str,
        src: DeviceSrc<'_>,
        dst: &mut DeviceDst,
        counts: &[usize],
    ) -> candle_core::Result<()>;

    /// Reduces `src` (blocks of `counts[r]` elements) and leaves block `rank` in `dst`.
    fn reduce_scatter_v(
        &self,
        name: &str,
        src: DeviceSrc<'_>,
        dst: &mut DeviceDst,
        counts: &[usize],
        op: ReduceOp,
    ) -> candle_core::Result<()>;

    /// All-to-all with the agreed block sizes `sizes` (see [`Backend::all_to_all_v`]): `src`
    /// holds this rank's block for every rank, `dst` receives every rank's block for it.
    fn all_to_all_v(
        &self,
        name: &str,
        src: DeviceSrc<'_>,
        dst: &mut DeviceDst,
        sizes: &BlockSizes<'_>,
    ) -> candle_core::Result<()>;
}

/// The input of a [`DeviceCollectives`] call: elements `range` of a CUDA storage.
#[cfg(feature = "nccl")]
#[derive(Clone)]
pub(crate) struct DeviceSrc<'a> {
    /// The storage.
    pub(crate) storage: &'a candle_core::cuda_backend::CudaStorage,
    /// The elements of it the collective reads.
    pub(crate) range: std::ops::Range<usize>,
}

/// The output of a [`DeviceCollectives`] call: a whole CUDA storage.
#[cfg(feature = "nccl")]
pub(crate) type DeviceDst = candle_core::cuda_backend::CudaStorage;

/// A group as a backend's join returns it (the world of a job, on this rank), for
/// [`ProcessGroup`](super::ProcessGroup) to wrap: the backends sit below the group and never
/// build one themselves.
pub(crate) struct World {
    /// The group's name, as errors print it (`world`, or `single` for a job of one rank).
    pub(crate) name: String,
    /// This rank's index among `members`.
    pub(crate) rank: usize,
    /// World rank of each member, in group order.
    pub(crate) members: Vec<usize>,
    /// The collectives.
    pub(crate) backend: Arc<dyn Backend>,
    /// What the group's sub-groups share (`None`: a group of one rank, whose sub-groups are
    /// single too).
    pub(crate) ctx: Option<Arc<Context>>,
}

impl World {
    /// The world of rank `rank` of `size` ranks on `backend`, named `world`.
    pub(crate) fn new(
        rank: usize,
        size: usize,
        backend: Arc<dyn Backend>,
        ctx: Option<Arc<Context>>,
    ) -> Self {
        Self {
            name: "world".into(),
            rank,
            members: (0..size).collect(),
            backend,
            ctx,
        }
    }
}

/// A backend as [`init_from_env`](crate::init_from_env) sees it: one line of the table in
/// `comm/env.rs`, defined by the backend's own file (or by `comm/join.rs` for a backend made of
/// others). `env.rs` names no backend: it reads `CANDLE_TP_BACKEND`, picks the entry, joins.
pub(crate) struct Registration {
    /// The name `CANDLE_TP_BACKEND` gives it.
    pub(crate) name: &'static str,
    /// The devices it runs on, for messages (`CPUs`, `CUDA devices`).
    pub(crate) devices: &'static str,
    /// Whether it runs on `device`.
    pub(crate) serves: fn(&candle_core::Device) -> bool,
    /// Whether `auto` takes it for this job (the table is tried in order).
    pub(crate) auto: fn(&candle_core::Device, &Launch) -> bool,
    /// Joins the job; `Err` when this build lacks the backend: what builds it.
    pub(crate) join: Result<JoinFn, &'static str>,
}

/// How a registered backend joins the job this process was started in.
pub(crate) type JoinFn = fn(&candle_core::Device, &Launch, GroupOptions) -> CommResult<World>;

/// Checks the per-rank sizes of a `*_v` collective on a group of `size` ranks where this rank
/// is `rank`: one count per rank, this rank's count equal to its buffer's `mine` elements, and
/// the counts summing to the whole buffer's `total` (`gather`: the input is this rank's part;
/// else the output is). The error names `who`.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))] // the MPI and hierarchical backends
pub(crate) fn check_counts(
    who: &str,
    counts: &[usize],
    size: usize,
    rank: usize,
    mine: usize,
    total: usize,
    gather: bool,
) -> CommResult<()> {
    let sum: usize = counts.iter().sum();
    if counts.len() != size || counts[rank] != mine || sum != total {
        return Err(CommError::invalid(
            who,
            format!(
                "sizes {counts:?} for {size} ranks: this rank's {} has {mine} elements, the {} \
                 {total}",
                if gather { "input" } else { "output" },
                if gather { "output" } else { "input" },
            ),
        ));
    }
    Ok(())
}

/// Offsets of consecutive blocks of `counts` elements (where each block starts).
pub(crate) fn offsets(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |at, &c| {
            let o = *at;
            *at += c;
            Some(o)
        })
        .collect()
}
