//! Q4_0 (ggml's `block_q4_0`): 32 weights as 4-bit values around 8 with an f16 scale, against
//! Q8_0 activations, summed in f64 ([`crate::f64_dot`]).
//!
//! `w[j] = d · (q[j] − 8)`, low nibbles holding values 0..16 and high nibbles 16..32. Against a
//! Q8_0 block `x[j] = d' · q'[j]`: `Σ w·x = d·d' · Σ (q − 8)·q'`. The AVX2 kernel computes the
//! integer sum 32 lanes at a time as ggml's `ggml_vec_dot_q4_0_q8_0` does (nibbles widened to
//! bytes, 8 subtracted, then `sign`/`maddubs`/`madd`), four blocks at once, and adds the blocks'
//! f64 products in block order: bit for bit the scalar sum. Candle 0.11 multiplies Q4_0 with
//! f32 sums whose order depends on how a row is split between ranks; this one does not.

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
        let mut sum = 0i32;
        for j in 0..QK8_0 / 2 {
            sum += ((w.qs[j] & 0x0F) as i32 - 8) * x.qs[j] as i32
                + ((w.qs[j] >> 4) as i32 - 8) * x.qs[j + QK8_0 / 2] as i32;
        }
        // d·d' is exact in f64 (two 11-bit mantissas), and so is its product with the sum.
        (w.d.to_f64() * x.d.to_f64()) * sum as f64
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_avx2(w: &[Self], x: &[Self::Act]) -> f64 {
        avx2::dot(w, x)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::BlockQ4_0;
    use crate::f64_dot::avx2::{add_in_order, deinterleave, f16_pairs, hsum4};
    use crate::q8_0::BlockQ8_0;
    use std::arch::x86_64::*;

    /// Four blocks at a time, added to the f64 total in block order.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; `w` and `x` have the same length.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(w: &[BlockQ4_0], x: &[BlockQ8_0]) -> f64 {
        let quads = w.len() / 4 * 4;
        let mut acc = 0f64;
        for b in (0..quads).step_by(4) {
            acc = add_in_order(acc, four(w.as_ptr().add(b), x.as_ptr().add(b)), 4);
        }
        let n = w.len() - quads;
        if n > 0 {
            // Copies padded with zero blocks, whose lanes are not added.
            let (mut wt, mut xt) = ([BlockQ4_0::ZERO; 4], [BlockQ8_0::ZERO; 4]);
            wt[..n].copy_from_slice(&w[quads..]);
            xt[..n].copy_from_slice(&x[quads..]);
            acc = add_in_order(acc, four(wt.as_ptr(), xt.as_ptr()), n);
        }
        acc
    }

    /// The f64 products of blocks `w[0..4]` and `x[0..4]`.
    #[inline(always)]
    unsafe fn four(w: *const BlockQ4_0, x: *const BlockQ8_0) -> __m256d {
        let low = _mm256_set1_epi8(0x0F);
        let eight = _mm256_set1_epi8(8);
        let ones = _mm256_set1_epi16(1);
        let mut sums = [_mm256_setzero_si256(); 4];
        for (t, s) in sums.iter_mut().enumerate() {
            let packed = _mm_loadu_si128((*w.add(t)).qs.as_ptr() as *const __m128i);
            let nibbles =
                _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
            let qw = _mm256_sub_epi8(nibbles, eight); // -8..7
            let qx = _mm256_loadu_si256((*x.add(t)).qs.as_ptr() as *const __m256i);
            // |w| times x with w's sign: maddubs needs an unsigned left operand.
            let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qx, qw));
            *s = _mm256_madd_epi16(pairs, ones);
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
