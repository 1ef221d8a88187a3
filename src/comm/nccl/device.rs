//! NCCL's collectives on candle's CUDA storage: the [`DeviceCollectives`] capability of an
//! [`NcclGroup`], which the CUDA paths of `ops` reach through
//! [`Backend::device_collectives`](crate::comm::backend::Backend::device_collectives).

use candle_core::backend::BackendStorage;
use candle_core::Result;

use super::NcclGroup;
use crate::comm::backend::{BlockSizes, DeviceCollectives, DeviceDst, DeviceSrc};
use crate::comm::element::ReduceOp;
use crate::comm::error::CommResult;

/// Runs `$call` with `$src: &CudaView<T>` (the input's elements `range`) and
/// `$dst: &mut CudaViewMut<T>` (all of the output) for the storage's element type.
macro_rules! typed {
    ($name:expr, $src_in:expr, $out:expr, |$src:ident, $dst:ident| $call:expr) => {{
        use candle_core::cuda_backend::CudaStorageSlice as S;
        let range = $src_in.range.clone();
        let bad = || {
            candle_core::Error::Msg(format!(
                "{}: input range {:?} out of bounds",
                $name, $src_in.range
            ))
        };
        match (&$src_in.storage.slice, &mut $out.slice) {
            (S::F32(a), S::F32(b)) => { let $src = &a.try_slice(range).ok_or_else(bad)?; let $dst = &mut b.as_view_mut(); $call }
            (S::F16(a), S::F16(b)) => { let $src = &a.try_slice(range).ok_or_else(bad)?; let $dst = &mut b.as_view_mut(); $call }
            (S::BF16(a), S::BF16(b)) => { let $src = &a.try_slice(range).ok_or_else(bad)?; let $dst = &mut b.as_view_mut(); $call }
            (S::F64(a), S::F64(b)) => { let $src = &a.try_slice(range).ok_or_else(bad)?; let $dst = &mut b.as_view_mut(); $call }
            (S::U8(a), S::U8(b)) => { let $src = &a.try_slice(range).ok_or_else(bad)?; let $dst = &mut b.as_view_mut(); $call }
            (S::U32(a), S::U32(b)) => { let $src = &a.try_slice(range).ok_or_else(bad)?; let $dst = &mut b.as_view_mut(); $call }
            (S::I32(a), S::I32(b)) => { let $src = &a.try_slice(range).ok_or_else(bad)?; let $dst = &mut b.as_view_mut(); $call }
            (S::I64(a), S::I64(b)) => { let $src = &a.try_slice(range).ok_or_else(bad)?; let $dst = &mut b.as_view_mut(); $call }
            _ => candle_core::bail!(
                "{}: dtype {:?} is not supported by NCCL collectives (use f32, f16, bf16, f64, u8, u32, i32, i64)",
                $name, $src_in.storage.dtype()
            ),
        }
    }};
}

impl DeviceCollectives for NcclGroup {
    fn check_device(
        &self,
        dev: &candle_core::cuda_backend::CudaDevice,
        op: &str,
    ) -> CommResult<()> {
        NcclGroup::check_device(self, dev, op)
    }

    fn all_reduce(
        &self,
        name: &str,
        src: DeviceSrc<'_>,
        dst: &mut DeviceDst,
        op: ReduceOp,
    ) -> Result<()> {
        typed!(name, src, dst, |s, d| Ok(NcclGroup::all_reduce(
            self, s, d, op
        )?))
    }

    fn broadcast(
        &self,
        name: &str,
        src: DeviceSrc<'_>,
        dst: &mut DeviceDst,
        root: usize,
    ) -> Result<()> {
        typed!(name, src, dst, |s, d| Ok(NcclGroup::broadcast(
            self, s, d, root
        )?))
    }

    fn all_gather_v(
        &self,
        name: &str,
        src: DeviceSrc<'_>,
        dst: &mut DeviceDst,
        counts: &[usize],
    ) -> Result<()> {
        typed!(name, src, dst, |s, d| Ok(NcclGroup::all_gather_v(
            self, s, d, counts
        )?))
    }

    fn reduce_scatter_v(
        &self,
        name: &str,
        src: DeviceSrc<'_>,
        dst: &mut DeviceDst,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        typed!(name, src, dst, |s, d| Ok(NcclGroup::reduce_scatter_v(
            self, s, d, counts, op
        )?))
    }

    fn all_to_all_v(
        &self,
        name: &str,
        src: DeviceSrc<'_>,
        dst: &mut DeviceDst,
        sizes: &BlockSizes<'_>,
    ) -> Result<()> {
        typed!(name, src, dst, |s, d| Ok(NcclGroup::all_to_all_v(
            self, s, d, sizes
        )?))
    }
}
