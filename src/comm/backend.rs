//! The one trait every communication backend implements, and the type-erased host buffers
//! it takes.
//!
//! [`ProcessGroup`](super::ProcessGroup) holds an `Arc<dyn Backend>` and never asks which
//! backend it is: the shared-memory engine (processes or threads of one host,
//! `comm/shm.rs`), NCCL (`comm/nccl.rs`, feature `nccl`) and the one-rank group
//! (`comm/single.rs`) each live in their own file. A new backend is one more file implementing
//! [`Backend`] plus the line in `comm/env.rs` (or its own `init_*`) that chooses it.
//!
//! Collectives are generic over [`Element`] in the group's API; a trait object cannot have
//! generic methods, so buffers cross the trait as [`HostBuf`] / [`HostBufMut`] (a slice with
//! its element type), and a backend gets its typed slice back with [`HostBuf::get`] inside
//! [`for_element!`], which expands its body once per element type.

use std::any::{Any, TypeId};
use std::marker::PhantomData;
use std::sync::Arc;

use candle_core::DType;

use super::context::Context;
use super::element::{Element, ReduceOp};
use super::error::{CommError, CommResult};
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

        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    };
}
pub(crate) use erased_collectives;

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

    /// For the code that needs one backend's own API (NCCL's device collectives).
    #[allow(dead_code)] // used with the nccl feature
    fn as_any(&self) -> &dyn Any;
}
