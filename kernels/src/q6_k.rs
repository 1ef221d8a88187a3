//! Q6_K (ggml's `block_q6_K`) against Q8_K, accumulated in f64.
//!
//! A super-block of 256 weights: 6-bit values (low 4 bits in `ql`, high 2 in `qh`) offset by
//! 32, an i8 scale per 16 values and an f16 super-scale: `w = d · sc · (q − 32)`. Against a
//! Q8_K block `x = d' · q'`: `Σ w·x = d · d' · Σ_j sc_j Σ (q − 32)·q'`, one exact integer.

use crate::f64_dot::F64Dot;
use crate::q8_k::{quantize_row_q8k, BlockQ8K, QK_K};
use half::f16;

/// One Q6_K super-block (210 bytes, as GGUF stores it).
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ6K {
    /// Low 4 bits of the values.
    pub ql: [u8; QK_K / 2],
    /// High 2 bits of the values.
    pub qh: [u8; QK_K / 4],
    /// A scale per 16 values.
    pub scales: [i8; QK_K / 16],
    /// Super-scale.
    pub d: f16,
}
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);

// SAFETY: repr(C) plain data (f16 is a transparent u16), every bit pattern valid.
unsafe impl F64Dot for BlockQ6K {
    type Act = BlockQ8K;
    const BLOCK: usize = QK_K;
    const NAME: &'static str = "Q6_K";
    const ACT_ZERO: Self::Act = BlockQ8K::ZERO;

    fn quantize(xs: &[f32], ys: &mut [Self::Act]) {
        quantize_row_q8k(xs, ys)
    }

    #[inline(always)]
    fn block_dot(w: &Self, x: &Self::Act) -> f64 {
        let mut dots = 0i32;
        // Two halves of 128 values; byte l of a half's ql / qh feeds values l, l + 32,
        // l + 64 and l + 96, and value p takes scale p / 16.
        for half in 0..2 {
            let ql = &w.ql[64 * half..64 * half + 64];
            let qh = &w.qh[32 * half..32 * half + 32];
            let a = &x.qs[128 * half..128 * half + 128];
            let sc = &w.scales[8 * half..8 * half + 8];
            for g in 0..2 {
                let (mut s0, mut s1, mut s2, mut s3) = (0i32, 0i32, 0i32, 0i32);
                for l in 16 * g..16 * g + 16 {
                    let q0 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q1 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    s0 += q0 * a[l] as i32;
                    s1 += q1 * a[l + 32] as i32;
                    s2 += q2 * a[l + 64] as i32;
                    s3 += q3 * a[l + 96] as i32;
                }
                dots += sc[g] as i32 * s0
                    + sc[g + 2] as i32 * s1
                    + sc[g + 4] as i32 * s2
                    + sc[g + 6] as i32 * s3;
            }
        }
        (w.d.to_f64() * x.d as f64) * dots as f64
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_avx2(w: &[Self], x: &[Self::Act]) -> f64 {
        avx2::dot(w, x)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BlockQ6K, BlockQ8K};
    use crate::f64_dot::avx2::hsum;
    use std::arch::x86_64::*;

    /// Per super-block: the unsigned 6-bit values (0..64) times the Q8_K bytes by `maddubs`,
    /// each 16 values scaled by their scale in `madd`; the offset 32 comes off at the end as
    /// `32 · Σ_j sc_j · bsums_j` (the same integer the scalar code sums).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(w: &[BlockQ6K], x: &[BlockQ8K]) -> f64 {
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(3);
        let mut acc = 0f64;
        for (w, x) in w.iter().zip(x) {
            let mut sums = _mm256_setzero_si256();
            for half in 0..2 {
                let ql0 = _mm256_loadu_si256(w.ql.as_ptr().add(64 * half) as *const __m256i);
                let ql1 = _mm256_loadu_si256(w.ql.as_ptr().add(64 * half + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(w.qh.as_ptr().add(32 * half) as *const __m256i);
                let high = |shift: i32| match shift {
                    0 => _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4),
                    2 => _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4),
                    4 => _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4),
                    _ => _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4),
                };
                let q = [
                    _mm256_or_si256(_mm256_and_si256(ql0, m4), high(0)),
                    _mm256_or_si256(_mm256_and_si256(ql1, m4), high(2)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), high(4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), high(6)),
                ];
                for (t, q) in q.into_iter().enumerate() {
                    let a = _mm256_loadu_si256(
                        x.qs.as_ptr().add(128 * half + 32 * t) as *const __m256i
                    );
                    let s = 8 * half + 2 * t;
                    let sc = _mm256_set_m128i(
                        _mm_set1_epi16(w.scales[s + 1] as i16),
                        _mm_set1_epi16(w.scales[s] as i16),
                    );
                    sums =
                        _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), sc));
                }
            }
            let mut offset = 0i32;
            for j in 0..16 {
                offset += w.scales[j] as i32 * x.bsums[j] as i32;
            }
            let dots = hsum(sums) - 32 * offset;
            acc += (w.d.to_f64() * x.d as f64) * dots as f64;
        }
        acc
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f64_dot::testing::{check_against_candle, nan_and_inf_activations_propagate};
    use candle_core::quantized::GgmlDType;

    #[test]
    fn f64_dot_is_the_dot_of_candles_dequantized_blocks() {
        check_against_candle::<BlockQ6K>(
            GgmlDType::Q6K,
            |x| x.qs.iter().map(|&q| x.d as f64 * q as f64).collect(),
            |_, _| 0.0,
            1e-12,
        );
    }

    #[test]
    fn nan_and_inf_activations_give_nan() {
        nan_and_inf_activations_propagate::<BlockQ6K>(GgmlDType::Q6K);
    }
}
