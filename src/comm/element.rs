//! Element types that collectives move and reduce.
//!
//! Floating-point types reduce in their own precision except `f16` and `bf16`, which are
//! widened to `f32`, summed, and rounded once. Integers reduce with wrapping sums. Every rank
//! reduces in rank order 0, 1, …, so all ranks end with bit-identical results.

use candle_core::DType;
use half::{bf16, f16};

/// How values are combined by `all_reduce` and `reduce_scatter`. Floating-point `Max`
/// propagates NaN (like PyTorch and NCCL): a NaN on any rank gives NaN on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise maximum; NaN if any rank holds NaN.
    Max,
}

impl ReduceOp {
    pub(crate) fn code(self) -> u32 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Max => 2,
        }
    }
}

macro_rules! nan_max {
    ($name:ident, $t:ty) => {
        /// The maximum that propagates NaN, as PyTorch's `torch.maximum` and NCCL's `ncclMax`
        /// do (`max` returns the other operand, so a NaN on one rank would vanish).
        #[inline]
        fn $name(a: $t, b: $t) -> $t {
            if a.is_nan() || b.is_nan() {
                <$t>::NAN
            } else {
                a.max(b)
            }
        }
    };
}
nan_max!(nan_max_f32, f32);
nan_max!(nan_max_f64, f64);

/// Number of elements reduced at a time through the stack accumulator.
const BLOCK: usize = 512;

/// A type that collectives can carry (`broadcast`, `all_gather`) and reduce.
pub trait Element: Copy + Default + Send + Sync + 'static + private::Sealed {
    /// The matching Candle dtype.
    const DTYPE: DType;
    /// A code used to check that every rank passed the same type.
    const CODE: u32;
    /// The type reductions are computed in.
    type Acc: Copy + Default + Send;
    /// Widens a block into the accumulator type.
    fn load(src: &[Self], acc: &mut [Self::Acc]);
    /// Combines a block into the accumulator.
    fn combine(op: ReduceOp, src: &[Self], acc: &mut [Self::Acc]);
    /// Narrows the accumulator back.
    fn store(acc: &[Self::Acc], dst: &mut [Self]);
}

mod private {
    pub trait Sealed {}
}

macro_rules! native_element {
    // Integers: sums wrap, as the reduction of every backend does.
    ($t:ty, $dtype:expr, $code:expr, int) => {
        native_element!(
            $t,
            $dtype,
            $code,
            |a: $t, b| a.wrapping_add(b),
            |a: $t, b| a.max(b)
        );
    };
    ($t:ty, $dtype:expr, $code:expr, $add:expr, $max:expr) => {
        impl private::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $dtype;
            const CODE: u32 = $code;
            type Acc = $t;
            #[inline]
            fn load(src: &[Self], acc: &mut [Self::Acc]) {
                acc.copy_from_slice(src);
            }
            #[inline]
            fn combine(op: ReduceOp, src: &[Self], acc: &mut [Self::Acc]) {
                let add: fn($t, $t) -> $t = $add;
                let max: fn($t, $t) -> $t = $max;
                match op {
                    ReduceOp::Sum => acc.iter_mut().zip(src).for_each(|(a, &s)| *a = add(*a, s)),
                    ReduceOp::Max => acc.iter_mut().zip(src).for_each(|(a, &s)| *a = max(*a, s)),
                }
            }
            #[inline]
            fn store(acc: &[Self::Acc], dst: &mut [Self]) {
                dst.copy_from_slice(acc);
            }
        }
    };
}

native_element!(f32, DType::F32, 1, |a, b| a + b, nan_max_f32);
native_element!(f64, DType::F64, 2, |a, b| a + b, nan_max_f64);
native_element!(u8, DType::U8, 5, int);
native_element!(u32, DType::U32, 6, int);
native_element!(i16, DType::I16, 7, int);
native_element!(i32, DType::I32, 8, int);
native_element!(i64, DType::I64, 9, int);

macro_rules! half_element {
    ($t:ty, $dtype:expr, $code:expr) => {
        impl private::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $dtype;
            const CODE: u32 = $code;
            type Acc = f32;
            #[inline]
            fn load(src: &[Self], acc: &mut [f32]) {
                use half::slice::HalfFloatSliceExt;
                src.convert_to_f32_slice(acc);
            }
            #[inline]
            fn combine(op: ReduceOp, src: &[Self], acc: &mut [f32]) {
                let mut wide = [0f32; BLOCK];
                let wide = &mut wide[..src.len()];
                Self::load(src, wide);
                <f32 as Element>::combine(op, wide, acc);
            }
            #[inline]
            fn store(acc: &[f32], dst: &mut [Self]) {
                use half::slice::HalfFloatSliceExt;
                dst.convert_from_f32_slice(acc);
            }
        }
    };
}

half_element!(f16, DType::F16, 3);
half_element!(bf16, DType::BF16, 4);

/// Reduces `n` elements from `srcs` (in rank order) into `dst`, block by block.
///
/// # Safety
/// Every pointer must be valid for `n` elements. `dst` may be equal to one of the sources (an
/// in-place reduction), because each block is read completely before it is written; it must
/// not otherwise overlap them.
pub(crate) unsafe fn reduce_into<T: Element>(
    op: ReduceOp,
    srcs: &[*const T],
    dst: *mut T,
    n: usize,
) {
    let mut acc = [T::Acc::default(); BLOCK];
    let mut done = 0;
    while done < n {
        let len = BLOCK.min(n - done);
        let acc = &mut acc[..len];
        T::load(std::slice::from_raw_parts(srcs[0].add(done), len), acc);
        for s in &srcs[1..] {
            T::combine(op, std::slice::from_raw_parts(s.add(done), len), acc);
        }
        T::store(acc, std::slice::from_raw_parts_mut(dst.add(done), len));
        done += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_types_reduce_in_f32_and_round_once() {
        // 2048 + 1 + 1 in f16 step by step gives 2048 (1 is below half an ulp); in f32 then
        // rounded once it gives 2050.
        let a = [f16::from_f32(2048.0); 3];
        let b = [f16::from_f32(1.0); 3];
        let c = [f16::from_f32(1.0); 3];
        let mut out = [f16::ZERO; 3];
        unsafe {
            reduce_into(
                ReduceOp::Sum,
                &[a.as_ptr(), b.as_ptr(), c.as_ptr()],
                out.as_mut_ptr(),
                3,
            )
        };
        assert_eq!(out[0].to_f32(), 2050.0);
        let a = [bf16::from_f32(1.0); 1000];
        let b = [bf16::from_f32(-3.0); 1000];
        let mut out = [bf16::ZERO; 1000];
        unsafe {
            reduce_into(
                ReduceOp::Max,
                &[a.as_ptr(), b.as_ptr()],
                out.as_mut_ptr(),
                1000,
            )
        };
        assert!(out.iter().all(|v| v.to_f32() == 1.0));
    }

    #[test]
    fn in_place_reduction_over_many_blocks() {
        let n = 3 * BLOCK + 17;
        let mut a: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..n).map(|i| 2.0 * i as f32).collect();
        let pa = a.as_mut_ptr();
        unsafe { reduce_into(ReduceOp::Sum, &[pa as *const f32, b.as_ptr()], pa, n) };
        assert!(a.iter().enumerate().all(|(i, &v)| v == 3.0 * i as f32));
        let mut x = vec![i64::MAX, 5];
        let y = [1i64, 7];
        let px = x.as_mut_ptr();
        unsafe { reduce_into(ReduceOp::Sum, &[px as *const i64, y.as_ptr()], px, 2) };
        assert_eq!(x, vec![i64::MIN, 12]);
    }
}
