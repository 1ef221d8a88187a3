//! `silu(gate) · up`, the gated MLP's activation (Llama's SwiGLU), in one pass over f32 values,
//! with an AVX2 + FMA exponential.
//!
//! Candle computes `silu` as a unary op (`x / (1 + exp(−x))`, libm's `expf` per value) and the
//! product as a second op over the same values: on a SmolLM2 prefill, 6 % of a rank's time
//! (`expf`, and the thread pool that candle hands the op to). Here one pass computes
//! `g / (1 + e^(−g)) · u` with an exponential of eight lanes (Cephes' `expf`: `2^n · p(r)`,
//! `r = x − n·ln 2` in two steps, a degree-5 polynomial), within 2 ulp of libm's `expf`
//! (tested against it over the range that matters and at the edges: NaN, infinities, overflow
//! and underflow), so `silu` moves by about an ulp against candle's.
//!
//! ```
//! let (gate, up) = ([-1.0f32, 0.0, 2.0], [3.0f32, 5.0, 0.5]);
//! let mut out = [0f32; 3];
//! candle_tp_kernels::swiglu::silu_mul(&gate, &up, &mut out);
//! let silu = |g: f32| g / (1.0 + (-g).exp());
//! for i in 0..3 {
//!     assert!((out[i] - silu(gate[i]) * up[i]).abs() <= 1e-6 * out[i].abs().max(1e-30));
//! }
//! ```

use crate::kernel::Kernel;
use rayon::prelude::*;

/// Values per rayon task at least (below this a task costs more than its work).
const MIN_PER_TASK: usize = 1 << 15;

/// `out[i] = silu(gate[i]) · up[i]` with `silu(g) = g / (1 + e^(−g))`, over the current rayon
/// pool for long inputs, with the AVX2 exponential where the CPU has AVX2 and FMA.
///
/// # Panics
/// If the three slices differ in length.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == up.len() && up.len() == out.len(),
        "silu_mul: gate of {} values, up of {}, out of {}",
        gate.len(),
        up.len(),
        out.len()
    );
    let kernel = Kernel::detect();
    let run = |(g, (u, o)): (&[f32], (&[f32], &mut [f32]))| {
        crate::kernel::by_kernel!(kernel,
            scalar => silu_mul_scalar(g, u, o),
            avx2 => avx2::silu_mul(g, u, o))
    };
    let threads = rayon::current_num_threads();
    if threads == 1 || out.len() < 2 * MIN_PER_TASK {
        return run((gate, (up, out)));
    }
    let chunk = out
        .len()
        .div_ceil(threads)
        .max(MIN_PER_TASK)
        .next_multiple_of(8);
    gate.par_chunks(chunk)
        .zip(up.par_chunks(chunk).zip(out.par_chunks_mut(chunk)))
        .for_each(run);
}

/// The reference: libm's `expf`, as candle's `silu`.
fn silu_mul_scalar(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// `e^x` in eight lanes: `x = n·ln 2 + r`, `|r| ≤ ln 2 / 2`, `e^r` by Cephes' degree-5
    /// polynomial, times `2^n` built in the exponent bits. `+∞` above 88.72 (where `expf`
    /// overflows), `0` below −103.97 (past its subnormals; between −87.3 and −103.97 the
    /// result is scaled in two steps, so subnormals come out too), NaN for NaN.
    ///
    /// # Safety
    /// The CPU must support avx2 and fma (inline this into a function that enables them).
    #[inline(always)]
    pub unsafe fn exp(x: __m256) -> __m256 {
        let c = |v: f32| _mm256_set1_ps(v);
        // Clamped into the range where n fits the two-step scaling; NaN stays NaN (max and
        // min return their second operand when one is NaN).
        let xc = _mm256_max_ps(_mm256_min_ps(x, c(88.75)), c(-104.0));
        let xc = _mm256_blendv_ps(xc, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        let n = _mm256_round_ps(
            _mm256_mul_ps(xc, c(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        // r = x − n·ln 2, ln 2 in two parts (Cephes' C1, C2).
        let r = _mm256_fnmadd_ps(n, c(0.693_359_4), xc);
        let r = _mm256_fnmadd_ps(n, c(-2.121_944_4e-4), r);
        let mut p = c(1.987_569_1e-4);
        p = _mm256_fmadd_ps(p, r, c(1.398_199_9e-3));
        p = _mm256_fmadd_ps(p, r, c(8.333_452e-3));
        p = _mm256_fmadd_ps(p, r, c(4.166_579_6e-2));
        p = _mm256_fmadd_ps(p, r, c(1.666_666_5e-1));
        p = _mm256_fmadd_ps(p, r, c(0.5));
        let er = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), c(1.0));
        // 2^n as 2^(n − h) · 2^h, h = n / 2 rounded down, each a valid exponent for n in
        // [−150, 128].
        let ni = _mm256_cvtps_epi32(n);
        let h = _mm256_srai_epi32(ni, 1);
        let pow2 = |k: __m256i| {
            _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_add_epi32(k, _mm256_set1_epi32(127)),
                23,
            ))
        };
        let y = _mm256_mul_ps(_mm256_mul_ps(er, pow2(h)), pow2(_mm256_sub_epi32(ni, h)));
        // Past expf's overflow: +∞ (the clamped product may still be finite).
        _mm256_blendv_ps(
            y,
            c(f32::INFINITY),
            _mm256_cmp_ps(x, c(88.722_84), _CMP_GT_OQ),
        )
    }

    /// [`super::silu_mul`] eight values at a time (the tail through the same lanes).
    ///
    /// # Safety
    /// The CPU must support avx2 and fma; the three slices have the same length.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let one = _mm256_set1_ps(1.0);
        let lanes = |g: __m256, u: __m256| {
            let e = exp(_mm256_sub_ps(_mm256_setzero_ps(), g));
            _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u)
        };
        let whole = out.len() / 8 * 8;
        for i in (0..whole).step_by(8) {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let u = _mm256_loadu_ps(up.as_ptr().add(i));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), lanes(g, u));
        }
        if whole < out.len() {
            let (mut g, mut u, mut o) = ([0f32; 8], [0f32; 8], [0f32; 8]);
            let rest = out.len() - whole;
            g[..rest].copy_from_slice(&gate[whole..]);
            u[..rest].copy_from_slice(&up[whole..]);
            _mm256_storeu_ps(
                o.as_mut_ptr(),
                lanes(_mm256_loadu_ps(g.as_ptr()), _mm256_loadu_ps(u.as_ptr())),
            );
            out[whole..].copy_from_slice(&o[..rest]);
        }
    }

    /// The exponential alone, for the tests.
    #[cfg(test)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp8(x: [f32; 8]) -> [f32; 8] {
        let mut y = [0f32; 8];
        _mm256_storeu_ps(y.as_mut_ptr(), exp(_mm256_loadu_ps(x.as_ptr())));
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in ulps between two finite f32 of the same sign.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_exponential_is_within_2_ulp_of_libm() {
        if !Kernel::Avx2.is_available() {
            eprintln!("no AVX2 + FMA: the AVX2 exponential is not tested here");
            return;
        }
        let mut worst = (0u32, 0f32);
        // Every 97th f32 between −103 and 88.7 (about 10^7 values), subnormal results included.
        let xs: Vec<f32> = (0..=u32::MAX / 97)
            .map(|i| f32::from_bits(i * 97))
            .filter(|x| (-103.0..=88.7).contains(x))
            .chain([0.0, -0.0, 88.72, -87.33, -103.0, 88.7])
            .collect();
        for chunk in xs.chunks(8) {
            let mut x = [0f32; 8];
            x[..chunk.len()].copy_from_slice(chunk);
            // SAFETY: checked above.
            let y = unsafe { avx2::exp8(x) };
            for (&x, &y) in x.iter().zip(&y).take(chunk.len()) {
                let want = x.exp();
                assert!(y.is_finite() && y >= 0.0, "exp({x}) = {y}");
                let d = ulps(y, want);
                if d > worst.0 {
                    worst = (d, x);
                }
            }
        }
        assert!(worst.0 <= 2, "worst: {} ulp at x = {}", worst.0, worst.1);
        // The edges: overflow, underflow, infinities, NaN.
        let x = [
            88.73,
            1e30,
            f32::INFINITY,
            -104.5,
            -1e30,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
        ];
        // SAFETY: checked above.
        let y = unsafe { avx2::exp8(x) };
        assert_eq!(&y[..3], &[f32::INFINITY; 3], "{y:?}");
        assert_eq!(&y[3..6], &[0.0; 3], "{y:?}");
        assert!(y[6].is_nan() && y[7].is_nan(), "{y:?}");
    }

    /// Every kernel this CPU runs gives `silu(g) · u` within a few ulp of the libm reference,
    /// at every length (the tail lanes), with NaN and infinities where candle's `silu` gives
    /// them.
    #[test]
    fn silu_mul_is_the_libm_reference_within_a_few_ulp() {
        let n = 1000;
        let gate: Vec<f32> = (0..n)
            .map(|i| {
                let t = i as f32 / n as f32;
                match i % 4 {
                    0 => 40.0 * (t - 0.5),
                    1 => 200.0 * (t - 0.5),
                    2 => (t - 0.5) * 1e-3,
                    _ => 8.0 * (t - 0.5),
                }
            })
            .collect();
        let up: Vec<f32> = (0..n).map(|i| 1.0 + (i % 7) as f32 * 0.37).collect();
        let mut want = vec![0f32; n];
        silu_mul_scalar(&gate, &up, &mut want);
        for len in [0, 1, 7, 8, 9, 31, n] {
            let mut out = vec![f32::NAN; len];
            silu_mul(&gate[..len], &up[..len], &mut out);
            for i in 0..len {
                let (o, w) = (out[i], want[i]);
                assert!(o.is_finite(), "silu_mul({}, {}) = {o}", gate[i], up[i]);
                assert!(
                    w == o || (o.signum() == w.signum() && ulps(o, w) <= 4),
                    "silu_mul({}, {}) = {o}, libm: {w}",
                    gate[i],
                    up[i]
                );
            }
        }
        let gate = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            100.0,
            -100.0,
            0.0,
            -0.0,
            1.0,
        ];
        let mut out = [0f32; 8];
        silu_mul(&gate, &[2.0; 8], &mut out);
        let mut want = [0f32; 8];
        silu_mul_scalar(&gate, &[2.0; 8], &mut want);
        assert!(out[0].is_nan() && want[0].is_nan());
        for i in 1..8 {
            assert!(
                out[i].to_bits() == want[i].to_bits() || ulps(out[i], want[i]) <= 4,
                "silu_mul({}) = {}, libm: {}",
                gate[i],
                out[i],
                want[i]
            );
        }
    }

    #[test]
    #[should_panic(expected = "gate of 3 values, up of 2")]
    fn lengths_must_agree() {
        silu_mul(&[0.0; 3], &[0.0; 2], &mut [0.0; 3]);
    }
}
