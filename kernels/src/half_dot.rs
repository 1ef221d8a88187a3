//! Dot products of f32 activations with bf16 or f16 weights, widened in registers.
//!
//! A bf16 is the top half of an f32 (a 16-bit shift widens it); an f16 is widened by F16C's
//! `vcvtph2ps`. Eight weights per step, four FMA chains, f32 accumulation. AVX2 + FMA + F16C
//! where the CPU has them (checked at run time), a scalar loop otherwise.

use half::{bf16, f16};

/// `Σ x[i] · w[i]` over the shorter of the two slices, with bf16 weights.
///
/// ```
/// use half::bf16;
/// let w: Vec<bf16> = [1.0f32, 2.0, 3.0].iter().map(|&v| bf16::from_f32(v)).collect();
/// assert_eq!(candle_tp_kernels::half_dot::dot_bf16(&[1.0, 1.0, 1.0], &w), 6.0);
/// ```
pub fn dot_bf16(x: &[f32], w: &[bf16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd::available() {
        // SAFETY: AVX2, FMA and F16C are present (checked).
        return unsafe { simd::dot_bf16(x, w) };
    }
    dot_scalar(x, w)
}

/// `Σ x[i] · w[i]` over the shorter of the two slices, with f16 weights.
pub fn dot_f16(x: &[f32], w: &[f16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd::available() {
        // SAFETY: AVX2, FMA and F16C are present (checked).
        return unsafe { simd::dot_f16(x, w) };
    }
    dot_scalar(x, w)
}

/// The portable dot product (and the reference of the SIMD one's test).
pub fn dot_scalar<T: Copy + Into<f32>>(x: &[f32], w: &[T]) -> f32 {
    x.iter().zip(w).map(|(a, b)| a * (*b).into()).sum()
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }

    /// `x · w` with 8 halves widened per step by `widen`.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c.
    #[inline(always)]
    unsafe fn dot<T: Copy + Into<f32>>(
        x: &[f32],
        w: &[T],
        widen: impl Fn(__m128i) -> __m256,
    ) -> f32 {
        debug_assert_eq!(std::mem::size_of::<T>(), 2);
        let k = x.len().min(w.len());
        let (xp, wp) = (x.as_ptr(), w.as_ptr() as *const __m128i);
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY (all loads): i + 8 <= k for both slices, unaligned loads; a T is 2 bytes, so
        // eight of them are one __m128i.
        while i + 32 <= k {
            for (a, accj) in acc.iter_mut().enumerate() {
                let o = i + 8 * a;
                let wf = widen(_mm_loadu_si128(wp.byte_add(2 * o)));
                *accj = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(o)), wf, *accj);
            }
            i += 32;
        }
        while i + 8 <= k {
            let wf = widen(_mm_loadu_si128(wp.byte_add(2 * i)));
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(i)), wf, acc[0]);
            i += 8;
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let h = _mm_add_ps(_mm256_extractf128_ps(s, 1), _mm256_castps256_ps128(s));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
        let mut total = _mm_cvtss_f32(h);
        for j in i..k {
            total += x[j] * w[j].into();
        }
        total
    }

    /// # Safety
    /// The CPU must support avx2, fma and f16c.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_bf16(x: &[f32], w: &[bf16]) -> f32 {
        dot(x, w, |v| {
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16))
        })
    }

    /// # Safety
    /// The CPU must support avx2, fma and f16c.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_f16(x: &[f32], w: &[f16]) -> f32 {
        dot(x, w, |v| _mm256_cvtph_ps(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo(i: usize) -> f32 {
        ((i * 2654435761) % 1000) as f32 / 250.0 - 2.0
    }

    fn simd_matches_scalar<T: Copy + Into<f32>>(from: fn(f32) -> T, dot: fn(&[f32], &[T]) -> f32) {
        for k in [0, 1, 7, 8, 9, 31, 32, 33, 64, 100, 576] {
            let x: Vec<f32> = (0..k).map(pseudo).collect();
            let w: Vec<T> = (0..k).map(|i| from(pseudo(i + 7))).collect();
            let (a, b) = (dot(&x, &w), dot_scalar(&x, &w));
            assert!(a.is_finite() && b.is_finite());
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "k={k}: {a} vs {b}");
        }
    }

    #[test]
    fn simd_dot_matches_scalar_for_every_tail() {
        simd_matches_scalar(bf16::from_f32, dot_bf16);
        simd_matches_scalar(f16::from_f32, dot_f16);
    }
}
