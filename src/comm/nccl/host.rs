//! Host-slice collectives on an NCCL group (`all_reduce_slice`, …: a few values for the
//! sampler, `split`, `all_gather`'s size exchange): staged through device memory on the
//! communicator's stream, then synchronised, since the caller reads the host buffer at once.

use candle_core::DType;
use cudarc::driver::{CudaView, CudaViewMut, DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};

use super::{driver_err, NcclGroup};
use crate::comm::backend::BlockSizes;
use crate::comm::element::{Element, ReduceOp};
use crate::comm::error::{CommError, CommResult};

/// Views a host slice of `T` as one of `U`, which must be the same type (checked).
fn cast<T: Element, U: 'static>(s: &[T]) -> CommResult<&[U]> {
    same_type::<T, U>()?;
    // SAFETY: `T` and `U` are the same type (checked above).
    Ok(unsafe { std::slice::from_raw_parts(s.as_ptr() as *const U, s.len()) })
}

fn cast_mut<T: Element, U: 'static>(s: &mut [T]) -> CommResult<&mut [U]> {
    same_type::<T, U>()?;
    // SAFETY: as in `cast`.
    Ok(unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut U, s.len()) })
}

fn same_type<T: 'static, U: 'static>() -> CommResult<()> {
    if std::any::TypeId::of::<T>() != std::any::TypeId::of::<U>() {
        return Err(CommError::invalid(
            "nccl host staging",
            format!(
                "element type {} is not {}",
                std::any::type_name::<T>(),
                std::any::type_name::<U>()
            ),
        ));
    }
    Ok(())
}

/// Runs `$body` with `$u` the NCCL element type matching `$t::DTYPE`.
#[rustfmt::skip]
macro_rules! with_nccl_type {
    ($self:ident, $op:expr, $t:ty, |$u:ident| $body:block) => {
        match <$t as Element>::DTYPE {
            DType::F32 => { type $u = f32; $body }
            DType::F64 => { type $u = f64; $body }
            DType::F16 => { type $u = f16; $body }
            DType::BF16 => { type $u = bf16; $body }
            DType::U8 => { type $u = u8; $body }
            DType::U32 => { type $u = u32; $body }
            DType::I32 => { type $u = i32; $body }
            DType::I64 => { type $u = i64; $body }
            other => Err(CommError::invalid(
                $self.who($op),
                format!("NCCL cannot reduce dtype {other:?}"),
            )),
        }
    };
}

impl NcclGroup {
    fn stage<U: DeviceRepr + ValidAsZeroBits>(
        &self,
        op: &str,
        src: &[U],
        dst: &mut [U],
        f: impl FnOnce(&CudaView<'_, U>, &mut CudaViewMut<'_, U>) -> CommResult<()>,
    ) -> CommResult<()> {
        let stream = self.device.cuda_stream();
        let what = || self.who(&format!("{op} (staging a host buffer through the GPU)"));
        let d_src = stream.clone_htod(src).map_err(driver_err(what()))?;
        let mut d_dst = stream
            .alloc_zeros::<U>(dst.len())
            .map_err(driver_err(what()))?;
        f(&d_src.as_view(), &mut d_dst.as_view_mut())?;
        stream
            .memcpy_dtoh(&d_dst, dst)
            .map_err(driver_err(what()))?;
        stream.synchronize().map_err(driver_err(what()))
    }

    /// In place (`src` none) through a copy of `dst`.
    pub(crate) fn typed_all_reduce<T: Element>(
        &self,
        src: Option<&[T]>,
        dst: &mut [T],
        op: ReduceOp,
    ) -> CommResult<()> {
        let copy;
        let src = match src {
            Some(s) => s,
            None => {
                copy = dst.to_vec();
                &copy
            }
        };
        with_nccl_type!(self, "all_reduce", T, |U| {
            self.stage::<U>("all_reduce", cast(src)?, cast_mut(dst)?, |s, d| {
                self.all_reduce(s, d, op)
            })
        })
    }

    pub(crate) fn typed_reduce_scatter<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> CommResult<()> {
        with_nccl_type!(self, "reduce_scatter", T, |U| {
            self.stage::<U>("reduce_scatter", cast(src)?, cast_mut(dst)?, |s, d| {
                self.reduce_scatter_v(s, d, counts, op)
            })
        })
    }

    /// Bytes, whatever the element type (gathers do not compute).
    pub(crate) fn typed_all_gather<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        counts: &[usize],
    ) -> CommResult<()> {
        let sz = std::mem::size_of::<T>();
        let bytes: Vec<usize> = counts.iter().map(|c| c * sz).collect();
        self.stage::<u8>("all_gather", as_bytes(src), as_bytes_mut(dst), |s, d| {
            self.all_gather_v(s, d, &bytes)
        })
    }

    pub(crate) fn typed_broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> CommResult<()> {
        let src = as_bytes(buf).to_vec();
        self.stage::<u8>("broadcast", &src, as_bytes_mut(buf), |s, d| {
            self.broadcast(s, d, root)
        })
    }

    /// Bytes, whatever the element type (an all-to-all does not compute): the block sizes in
    /// bytes.
    pub(crate) fn typed_all_to_all<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        sizes: &BlockSizes<'_>,
    ) -> CommResult<()> {
        let sz = std::mem::size_of::<T>();
        let bytes: Vec<usize> = sizes.counts().iter().map(|c| c * sz).collect();
        let who = self.who("all_to_all");
        let bytes = BlockSizes::new(&who, sizes.rank(), sizes.size(), &bytes)?;
        self.stage::<u8>("all_to_all", as_bytes(src), as_bytes_mut(dst), |s, d| {
            self.all_to_all_v(s, d, &bytes)
        })
    }

    /// An all-reduce of one value, then a stream synchronisation.
    pub(crate) fn barrier(&self) -> CommResult<()> {
        let mut one = [0f32];
        self.typed_all_reduce(Some(&[1f32]), &mut one, ReduceOp::Sum)
    }
}

fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: `Element` types are plain numbers without padding; any byte view of them is valid.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) }
}

fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; every byte pattern is a valid value of these number types.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut u8, std::mem::size_of_val(s)) }
}
