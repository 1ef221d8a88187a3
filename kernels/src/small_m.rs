//! `y = x · Wᵀ` for a few activation rows (a decode step of a continuous batch), reading each
//! weight row once for all of them.
//!
//! Candle 0.11's CPU matmul sends one activation row to a gemv (fast, memory-bound) but two or
//! more to the `gemm` crate, which packs the whole weight panel on every call: at 2-16 rows
//! an f32 product costs 5-9× the one-row product (`[m, 576] × [576, 768]`: 36 µs at m = 1,
//! 200 µs at m = 2, 325 µs at m = 16 on one EPYC core), so batching decode streams gained
//! almost nothing. Here a tile of 4 weight rows × 3 activation rows keeps 12 accumulators in
//! registers: every weight vector loaded is used by 3 FMAs and every activation vector by 4.
//!
//! **Batch invariance.** Every output `y[i, j] = x_j · w_i` is computed by one accumulator
//! chain over `k` in steps of 8, the same horizontal sum and the same scalar tail, whatever
//! the tile it falls in: a row's result does not depend on how many other rows are in the
//! batch. (A sequence decoded alone and decoded among 15 others gets bit-identical logits.)
//!
//! Weights may be f32, bf16 or f16 (widened in registers); activations and accumulation are
//! f32. AVX2 + FMA + F16C where the CPU has them (checked at run time), a scalar loop
//! otherwise (also batch-invariant).

use crate::kernel::Kernel;
use half::{bf16, f16};

/// A weight element the kernel reads: f32, or a 16-bit float it widens.
///
/// Sealed: `KIND` tells the SIMD code how to read the weight's bits, so only the three types
/// below implement it (a foreign type claiming `Kind::F32` would be read as f32 by unsafe
/// code).
pub trait WeightElem: sealed::Sealed + Copy + Into<f32> + Send + Sync + 'static {
    #[doc(hidden)]
    const KIND: Kind;
}

mod sealed {
    /// Implemented for f32, bf16 and f16 only.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    F32,
    Bf16,
    F16,
}

impl WeightElem for f32 {
    const KIND: Kind = Kind::F32;
}
impl WeightElem for bf16 {
    const KIND: Kind = Kind::Bf16;
}
impl WeightElem for f16 {
    const KIND: Kind = Kind::F16;
}

/// `y[i * m + j] = Σ_t x[j * k + t] · w[i * k + t]`: `x` is `m` rows of `k` activations, `w`
/// is `n = w.len() / k` weight rows, `y` is weight-row major (`n × m`, so a caller splitting
/// the weight rows between threads gives each a contiguous slice of `y`).
///
/// # Panics
/// When `x.len() != m * k`, `w.len()` is not a multiple of `k` (for `k > 0`) or
/// `y.len() != n * m`.
///
/// ```
/// // Two activation rows, three weight rows, k = 2.
/// let x = [1.0f32, 2.0, 3.0, 4.0];
/// let w = [1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0];
/// let mut y = [0f32; 6];
/// candle_tp_kernels::small_m::matmul_rows(&x, 2, 2, &w, &mut y);
/// assert_eq!(y, [1.0, 3.0, 2.0, 4.0, 3.0, 7.0]);
/// ```
pub fn matmul_rows<T: WeightElem>(x: &[f32], m: usize, k: usize, w: &[T], y: &mut [f32]) {
    matmul_rows_with(Kernel::detect(), x, m, k, w, y)
}

/// As [`matmul_rows`] with a given kernel (to test or benchmark one path).
///
/// # Panics
/// As [`matmul_rows`], and when this CPU cannot run `kernel`.
pub fn matmul_rows_with<T: WeightElem>(
    kernel: Kernel,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[T],
    y: &mut [f32],
) {
    assert_eq!(
        x.len(),
        m * k,
        "small-m matmul: x has {} values, not {m} × {k}",
        x.len()
    );
    let n = w.len().checked_div(k).unwrap_or(y.len() / m.max(1));
    assert!(
        k == 0 || w.len() == n * k,
        "small-m matmul: w has {} values, not a multiple of k = {k}",
        w.len()
    );
    assert_eq!(
        y.len(),
        n * m,
        "small-m matmul: y has {} values, not {n} × {m}",
        y.len()
    );
    assert!(
        kernel.is_available(),
        "small-m matmul: the {} kernel cannot run on this CPU",
        kernel.name()
    );
    #[cfg(target_arch = "x86_64")]
    if kernel.has_avx2() {
        // SAFETY: AVX2, FMA and F16C are present (checked); the sizes were checked above.
        unsafe {
            match T::KIND {
                Kind::F32 => simd::run_f32(x, m, k, w.as_ptr() as *const f32, n, y),
                Kind::Bf16 => simd::run_bf16(x, m, k, w.as_ptr() as *const u16, n, y),
                Kind::F16 => simd::run_f16(x, m, k, w.as_ptr() as *const u16, n, y),
            }
        }
        return;
    }
    matmul_rows_scalar(x, m, k, w, y)
}

/// The portable loop (and the reference of the SIMD one's test).
pub fn matmul_rows_scalar<T: WeightElem>(x: &[f32], m: usize, k: usize, w: &[T], y: &mut [f32]) {
    for (i, yi) in y.chunks_mut(m.max(1)).enumerate() {
        for (j, v) in yi.iter_mut().enumerate() {
            let (xr, wr) = (&x[j * k..][..k], &w[i * k..][..k]);
            *v = xr.iter().zip(wr).map(|(a, b)| a * (*b).into()).sum();
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// Weight rows per tile.
    const NW: usize = 4;
    /// Activation rows per tile (at most).
    const NX: usize = 3;

    /// The sum of the 8 lanes, in a fixed order.
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let h = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)))
    }

    /// One tile: `A` weight rows from `w` × `B` activation rows from `x`, written to
    /// `y[a * m + b]`.
    ///
    /// # Safety
    /// `w` holds `A` rows of `k`, `x` `B` rows of `k`; `y` has room for `(A - 1) * m + B`.
    #[inline(always)]
    unsafe fn tile<const A: usize, const B: usize, T: Copy>(
        x: *const f32,
        w: *const T,
        k: usize,
        m: usize,
        y: *mut f32,
        widen: &impl Fn(*const T) -> __m256,
        scalar: &impl Fn(*const T) -> f32,
    ) {
        let mut acc = [[_mm256_setzero_ps(); B]; A];
        let k8 = k / 8 * 8;
        let mut t = 0;
        while t < k8 {
            let mut xv = [_mm256_setzero_ps(); B];
            for (b, v) in xv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(x.add(b * k + t));
            }
            if (t * std::mem::size_of::<T>()).is_multiple_of(64) {
                // The next tile's rows, one cache line of each per 64 bytes read here (a hint:
                // past the end of `w` it reads nothing and cannot fault).
                for a in 0..A {
                    let p = w.wrapping_add((a + A) * k + t);
                    _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
                }
            }
            for (a, row) in acc.iter_mut().enumerate() {
                let wv = widen(w.add(a * k + t));
                for (b, c) in row.iter_mut().enumerate() {
                    *c = _mm256_fmadd_ps(xv[b], wv, *c);
                }
            }
            t += 8;
        }
        for (a, row) in acc.iter().enumerate() {
            for (b, c) in row.iter().enumerate() {
                let mut s = hsum(*c);
                for u in k8..k {
                    s += *x.add(b * k + u) * scalar(w.add(a * k + u));
                }
                *y.add(a * m + b) = s;
            }
        }
    }

    /// Every tile of the product: weight rows by `NW` (then one by one), activation rows by
    /// `NX` (then the 1 or 2 left).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)] // sizes, pointers and the two widening closures
    unsafe fn run<T: Copy>(
        x: &[f32],
        m: usize,
        k: usize,
        w: *const T,
        n: usize,
        y: &mut [f32],
        widen: impl Fn(*const T) -> __m256,
        scalar: impl Fn(*const T) -> f32,
    ) {
        let (xp, yp) = (x.as_ptr(), y.as_mut_ptr());
        let mut i = 0;
        while i < n {
            // One activation row: 8 weight rows a tile (8 chains in flight, memory-bound).
            let rows = if m == 1 && n - i >= 2 * NW {
                2 * NW
            } else if n - i >= NW {
                NW
            } else {
                1
            };
            let mut j = 0;
            while j < m {
                let (xs, ws, ys) = (xp.add(j * k), w.add(i * k), yp.add(i * m + j));
                match (rows, (m - j).min(NX)) {
                    (8, _) => tile::<8, 1, T>(xs, ws, k, m, ys, &widen, &scalar),
                    (NW, 3) => tile::<NW, 3, T>(xs, ws, k, m, ys, &widen, &scalar),
                    (NW, 2) => tile::<NW, 2, T>(xs, ws, k, m, ys, &widen, &scalar),
                    (NW, _) => tile::<NW, 1, T>(xs, ws, k, m, ys, &widen, &scalar),
                    (_, 3) => tile::<1, 3, T>(xs, ws, k, m, ys, &widen, &scalar),
                    (_, 2) => tile::<1, 2, T>(xs, ws, k, m, ys, &widen, &scalar),
                    _ => tile::<1, 1, T>(xs, ws, k, m, ys, &widen, &scalar),
                }
                j += NX;
            }
            i += rows;
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C; `w` holds `n * k` values, `x` `m * k`, `y` `n * m`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn run_f32(
        x: &[f32],
        m: usize,
        k: usize,
        w: *const f32,
        n: usize,
        y: &mut [f32],
    ) {
        run(x, m, k, w, n, y, |p| _mm256_loadu_ps(p), |p| *p)
    }

    /// # Safety
    /// As [`run_f32`], with `w` pointing at bf16 bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn run_bf16(
        x: &[f32],
        m: usize,
        k: usize,
        w: *const u16,
        n: usize,
        y: &mut [f32],
    ) {
        run(
            x,
            m,
            k,
            w,
            n,
            y,
            |p| {
                let v = _mm_loadu_si128(p as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16))
            },
            |p| f32::from_bits((*p as u32) << 16),
        )
    }

    /// # Safety
    /// As [`run_f32`], with `w` pointing at f16 bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn run_f16(
        x: &[f32],
        m: usize,
        k: usize,
        w: *const u16,
        n: usize,
        y: &mut [f32],
    ) {
        run(
            x,
            m,
            k,
            w,
            n,
            y,
            |p| _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
            |p| half::f16::from_bits(*p).to_f32(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo(i: usize) -> f32 {
        ((i * 2654435761) % 1000) as f32 / 250.0 - 2.0
    }

    fn check<T: WeightElem>(kernels: &[Kernel], from: fn(f32) -> T) {
        for k in [0, 1, 7, 8, 9, 33, 576] {
            for m in [1, 2, 3, 4, 5, 7, 16] {
                for n in [1, 3, 4, 5, 9] {
                    let x: Vec<f32> = (0..m * k).map(pseudo).collect();
                    let w: Vec<T> = (0..n * k).map(|i| from(pseudo(i + 11))).collect();
                    // The reference: each output's dot product summed in f64.
                    let want: Vec<f64> = (0..n * m)
                        .map(|o| {
                            let (i, j) = (o / m, o % m);
                            (0..k)
                                .map(|t| x[j * k + t] as f64 * w[i * k + t].into() as f64)
                                .sum()
                        })
                        .collect();
                    for &kernel in kernels {
                        let mut a = vec![f32::NAN; n * m];
                        matmul_rows_with(kernel, &x, m, k, &w, &mut a);
                        for (p, q) in a.iter().zip(&want) {
                            assert!(p.is_finite(), "{kernel:?} k={k} m={m} n={n}");
                            assert!(
                                (*p as f64 - q).abs() <= 1e-5 * (1.0 + q.abs()),
                                "{kernel:?} k={k} m={m} n={n}: {p} vs {q}"
                            );
                        }
                        // Batch invariance: each activation row alone gives the same bits.
                        for j in 0..m {
                            let mut one = vec![f32::NAN; n];
                            matmul_rows_with(kernel, &x[j * k..][..k], 1, k, &w, &mut one);
                            for i in 0..n {
                                assert_eq!(
                                    one[i].to_bits(),
                                    a[i * m + j].to_bits(),
                                    "{kernel:?} k={k} m={m} n={n} row {j}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_kernel_matches_the_f64_product_and_is_batch_invariant() {
        let kernels = Kernel::under_test();
        check::<f32>(&kernels, |v| v);
        check::<bf16>(&kernels, bf16::from_f32);
        check::<f16>(&kernels, f16::from_f32);
    }

    #[test]
    fn matmul_rows_runs_the_detected_kernel() {
        // The dispatching entry gives the bits of the kernel Kernel::detect names.
        let (m, k, n) = (3, 37, 5);
        let x: Vec<f32> = (0..m * k).map(pseudo).collect();
        let w: Vec<f32> = (0..n * k).map(|i| pseudo(i + 3)).collect();
        let (mut a, mut b) = (vec![0f32; n * m], vec![0f32; n * m]);
        matmul_rows(&x, m, k, &w, &mut a);
        matmul_rows_with(Kernel::detect(), &x, m, k, &w, &mut b);
        assert_eq!(a, b);
    }
}
