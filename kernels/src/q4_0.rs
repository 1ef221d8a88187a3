//! Q4_0 (ggml's `block_q4_0`): 32 weights as 4-bit values around 8 with an f16 scale, against
//! Q8_0 activations, summed in f64 ([`crate::f64_dot`]).
//!
//! `w[j] = d · (q[j] − 8)`, low nibbles holding values 0..16 and high nibbles 16..32. Against a
//! Q8_0 block `x[j] = d' · q'[j]`: `Σ w·x = d·d' · Σ (q − 8)·q'`. The AVX2 kernels compute the
//! integer sum 32 lanes at a time as ggml's `ggml_vec_dot_q4_0_q8_0` does (nibbles widened to
//! bytes, 8 subtracted, then `sign`/`maddubs`/`madd`), four blocks at once, the blocks' f64
//! products added in block order ([`F64Dot`]): bit for bit the scalar sum, so a row's value
//! does not depend on how its blocks are split between ranks.
//!
//! The matmuls do not run this per-row kernel: they repack the weight four rows at a time and
//! run [`crate::q4_0x4`], which computes the same f64 sums (tested against this one) about
//! twice as fast.

use crate::f64_dot::F64Dot;
use crate::q8_0::{quantize_row_q8_0, BlockQ8_0, QK8_0};
use half::f16;

/// Values per Q4_0 block (ggml's `QK4_0`).
pub const QK4_0: usize = 32;

/// One Q4_0 block, laid out as GGUF stores it (18 bytes): `w[j] = d · ((qs[j] & 15) − 8)` and
/// `w[j + 16] = d · ((qs[j] >> 4) − 8)` for `j < 16`.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ4_0 {
    /// Scale.
    pub d: f16,
    /// Packed 4-bit values.
    pub qs: [u8; QK4_0 / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);

impl BlockQ4_0 {
    /// The all-zero block (every weight `0 · (0 − 8) = 0`).
    pub const ZERO: Self = Self {
        d: f16::ZERO,
        qs: [0; QK4_0 / 2],
    };
}

/// The integer sum `Σ (q − 8)·q'` of one block pair.
#[inline(always)]
fn int_sum(w: &BlockQ4_0, x: &BlockQ8_0) -> i32 {
    let mut sum = 0i32;
    for j in 0..QK8_0 / 2 {
        sum += ((w.qs[j] & 0x0F) as i32 - 8) * x.qs[j] as i32
            + ((w.qs[j] >> 4) as i32 - 8) * x.qs[j + QK8_0 / 2] as i32;
    }
    sum
}

// SAFETY: repr(C) plain data (f16 is a transparent u16), every bit pattern valid.
unsafe impl F64Dot for BlockQ4_0 {
    type Act = BlockQ8_0;
    const BLOCK: usize = QK4_0;
    const NAME: &'static str = "Q4_0";
    const ACT_ZERO: Self::Act = BlockQ8_0::ZERO;

    fn quantize(xs: &[f32], ys: &mut [Self::Act]) {
        quantize_row_q8_0(xs, ys)
    }

    #[inline(always)]
    fn block_dot(w: &Self, x: &Self::Act) -> f64 {
        // d·d' is exact in f64 (two 11-bit mantissas), and so is its product with the sum.
        (w.d.to_f64() * x.d.to_f64()) * int_sum(w, x) as f64
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_avx2(w: &[Self], x: &[Self::Act]) -> f64 {
        avx2::dot(w, x)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::BlockQ4_0;
    use crate::f64_dot::avx2::{deinterleave, dot_by_fours, f16_pairs, hsum4};
    use crate::q8_0::BlockQ8_0;
    use std::arch::x86_64::*;

    /// Four blocks at a time, added to the f64 total in block order.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; `w` and `x` have the same length.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(w: &[BlockQ4_0], x: &[BlockQ8_0]) -> f64 {
        dot_by_fours(w, x, BlockQ4_0::ZERO, |w, x| four(w, x))
    }

    /// The 32 values `q − 8` (−8..7) of a block, as bytes in its order.
    #[inline(always)]
    unsafe fn unpack(w: &BlockQ4_0) -> __m256i {
        let packed = _mm_loadu_si128(w.qs.as_ptr() as *const __m128i);
        let nibbles = _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
            _mm256_set1_epi8(0x0F),
        );
        _mm256_sub_epi8(nibbles, _mm256_set1_epi8(8))
    }

    /// The integer sum `Σ (q − 8)·q'` of one block pair, in eight i32 lanes.
    #[inline(always)]
    unsafe fn block_sums(w: &BlockQ4_0, qx: __m256i) -> __m256i {
        // maddubs needs an unsigned left operand: |w| times x with w's sign.
        let qw = unpack(w);
        let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qx, qw));
        _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
    }

    /// The f64 products of blocks `w[0..4]` and `x[0..4]`.
    #[inline(always)]
    unsafe fn four(w: *const BlockQ4_0, x: *const BlockQ8_0) -> __m256d {
        let mut sums = [_mm256_setzero_si256(); 4];
        for (t, s) in sums.iter_mut().enumerate() {
            let qx = _mm256_loadu_si256((*x.add(t)).qs.as_ptr() as *const __m256i);
            *s = block_sums(&*w.add(t), qx);
        }
        // Each block starts with its f16 `d` (the next two bytes are values: unused lanes).
        let dd = deinterleave(_mm256_mul_ps(f16_pairs(w), f16_pairs(x)));
        _mm256_mul_pd(
            _mm256_cvtepi32_pd(hsum4(sums)),
            _mm256_cvtps_pd(_mm256_castps256_ps128(dd)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f64_dot::testing::{check_against_candle, nan_and_inf_activations_propagate};
    use candle_core::quantized::GgmlDType;

    #[test]
    fn f64_dot_is_the_dot_of_candles_dequantized_blocks() {
        check_against_candle::<BlockQ4_0>(
            GgmlDType::Q4_0,
            |x| x.qs.iter().map(|&q| x.d.to_f64() * q as f64).collect(),
            |_, _| 0.0,
            1e-12,
        );
    }

    #[test]
    fn nan_and_inf_activations_give_nan() {
        nan_and_inf_activations_propagate::<BlockQ4_0>(GgmlDType::Q4_0);
    }
}
