//! Q4_0 (ggml's `block_q4_0`): 32 weights as 4-bit values around 8 with an f16 scale, against
//! Q8_0 activations, summed in f64 ([`crate::f64_dot`]).
//!
//! `w[j] = d · (q[j] − 8)`, low nibbles holding values 0..16 and high nibbles 16..32. Against a
//! Q8_0 block `x[j] = d' · q'[j]`: `Σ w·x = d·d' · Σ (q − 8)·q'`. The AVX2 kernels compute the
//! integer sum 32 lanes at a time as ggml's `ggml_vec_dot_q4_0_q8_0` does (nibbles widened to
//! bytes, 8 subtracted, then `sign`/`maddubs`/`madd`). Two kernels:
//! - [`F64Dot`] (row-parallel layers): four blocks at once, the blocks' f64 products added in
//!   block order, bit for bit the scalar sum, so a row's value does not depend on how its
//!   blocks are split between ranks;
//! - [`dot_rows`] / [`rows_dot`] (whole rows: column-parallel layers, one rank): f32 FMA
//!   chains, four weight rows sharing each activation load, as fast as ggml's; for several
//!   activation rows (prefill) [`rows_dot`] takes tiles of four weight rows × four activation
//!   rows that unpack each weight block once for all four, every value bit for bit what one
//!   activation row at a time gives.

use crate::f64_dot::F64Dot;
use crate::kernel::Kernel;
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

/// Dot products of `R` weight rows with one activation row in f32, sharing its loads (`R` = 1
/// or 4 in the matmul).
///
/// # Panics
/// If a row's length differs from `xs`'s, or `kernel` is not available on this CPU.
pub fn dot_rows<const R: usize>(
    kernel: Kernel,
    ws: [&[BlockQ4_0]; R],
    xs: &[BlockQ8_0],
    out: &mut [f32; R],
) {
    crate::kernel::dot_rows_by(kernel, ws, xs, out)
}

/// Weight rows `row0..row0 + out.len() / m` of `w` (rows of `kb` blocks) against all `m`
/// activation rows `xq`, into `out[(row - row0) * m + i]`, four rows at a time against four
/// activation rows at a time (each value bit for bit [`dot_rows`]'s). Non-generic,
/// so that it is compiled with this crate's optimisations even in a caller's debug build.
pub fn rows_dot(
    kernel: Kernel,
    w: &[BlockQ4_0],
    kb: usize,
    xq: &[BlockQ8_0],
    m: usize,
    row0: usize,
    out: &mut [f32],
) {
    crate::kernel::rows_dot_by(kernel, (w, kb), (xq, m), row0, out)
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

impl crate::kernel::RowDot for BlockQ4_0 {
    /// Scalar reference in f32 (ggml's generic `ggml_vec_dot_q4_0_q8_0`, block after block).
    fn dot_scalar(ws: &[BlockQ4_0], xs: &[BlockQ8_0]) -> f32 {
        ws.iter().zip(xs).fold(0f32, |sum, (w, x)| {
            sum + int_sum(w, x) as f32 * (w.d.to_f32() * x.d.to_f32())
        })
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_rows_avx2<const R: usize>(ws: [&[Self]; R], xs: &[Self::Act]) -> [f32; R] {
        avx2::dot_rows(ws, xs)
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_tile_avx2<const R: usize, const M: usize>(
        ws: [&[Self]; R],
        xs: [&[Self::Act]; M],
    ) -> [[f32; R]; M] {
        avx2::dot_tile(ws, xs)
    }
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

    /// The integer sum `Σ (q − 8)·q'` of one block pair in eight i32 lanes, from the unpacked
    /// weights `qw` and their magnitudes `aw` (`|qw|`): maddubs needs an unsigned left
    /// operand, so `|w|` times `x` with `w`'s sign.
    #[inline(always)]
    unsafe fn unpacked_sums(qw: __m256i, aw: __m256i, qx: __m256i) -> __m256i {
        let pairs = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(qx, qw));
        _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
    }

    /// The integer sum `Σ (q − 8)·q'` of one block pair, in eight i32 lanes.
    #[inline(always)]
    unsafe fn block_sums(w: &BlockQ4_0, qx: __m256i) -> __m256i {
        let qw = unpack(w);
        unpacked_sums(qw, _mm256_sign_epi8(qw, qw), qx)
    }

    /// The sum of the eight lanes, in the order every f32 kernel here adds them.
    #[inline(always)]
    unsafe fn hsum(a: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// A block's f16 scale as f32, in lane 0.
    #[inline(always)]
    unsafe fn scale(d: half::f16) -> __m128 {
        _mm_cvtph_ps(_mm_cvtsi32_si128(d.to_bits() as i32))
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

    /// `R` rows at once in f32: `R` independent FMA chains hide the FMA latency, and each
    /// activation block is loaded once for all rows.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; every row must have `xs.len()` blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_rows<const R: usize>(
        ws: [&[BlockQ4_0]; R],
        xs: &[BlockQ8_0],
    ) -> [f32; R] {
        let mut acc = [_mm256_setzero_ps(); R];
        for (b, x) in xs.iter().enumerate() {
            let xd = scale(x.d);
            let qx = _mm256_loadu_si256(x.qs.as_ptr() as *const __m256i);
            for r in 0..R {
                let w = ws[r].get_unchecked(b);
                let dd = _mm256_broadcastss_ps(_mm_mul_ss(scale(w.d), xd));
                acc[r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(block_sums(w, qx)), acc[r]);
            }
        }
        let mut out = [0f32; R];
        for r in 0..R {
            out[r] = hsum(acc[r]);
        }
        out
    }

    /// `R` weight rows against `M` activation rows: each weight block is unpacked once (and
    /// its scale converted once) for all `M` activation rows. Every accumulator takes the
    /// same operations in the same order as in [`dot_rows`] (`d·d'` rounded to f32, one FMA
    /// per block in block order, the same horizontal sum), so each value is bit for bit that
    /// of the one-activation-row kernel.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; every row of `ws` and `xs` has `xs[0].len()`
    /// blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_tile<const R: usize, const M: usize>(
        ws: [&[BlockQ4_0]; R],
        xs: [&[BlockQ8_0]; M],
    ) -> [[f32; R]; M] {
        let mut acc = [[_mm256_setzero_ps(); R]; M];
        let nb = if M == 0 { 0 } else { xs[0].len() };
        for b in 0..nb {
            // The activation blocks' scales, broadcast: `wd · xd` lane by lane is the same
            // f32 product as `_mm_mul_ss` in `dot_rows`.
            let mut xd = [_mm256_setzero_ps(); M];
            for i in 0..M {
                xd[i] = _mm256_broadcastss_ps(scale(xs[i].get_unchecked(b).d));
            }
            for r in 0..R {
                let w = ws[r].get_unchecked(b);
                let wd = _mm256_broadcastss_ps(scale(w.d));
                let qw = unpack(w);
                let aw = _mm256_sign_epi8(qw, qw);
                for i in 0..M {
                    let x = xs[i].get_unchecked(b);
                    let qx = _mm256_loadu_si256(x.qs.as_ptr() as *const __m256i);
                    let sums = _mm256_cvtepi32_ps(unpacked_sums(qw, aw, qx));
                    acc[i][r] = _mm256_fmadd_ps(_mm256_mul_ps(wd, xd[i]), sums, acc[i][r]);
                }
            }
        }
        // Loops, not `map`: a closure would not inherit the target features, and `hsum`
        // would become a call.
        let mut out = [[0f32; R]; M];
        for i in 0..M {
            for r in 0..R {
                out[i][r] = hsum(acc[i][r]);
            }
        }
        out
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

    /// Block `b` of weight row `r` of the f32 kernels' tests.
    fn block(r: usize, b: usize) -> BlockQ4_0 {
        use crate::f64_dot::testing::pseudo;
        BlockQ4_0 {
            d: f16::from_f32(0.01 + 0.02 * pseudo(r * 97 + b).abs()),
            qs: std::array::from_fn(|j| {
                (pseudo(r * 1000 + b * 16 + j + 99).to_bits() & 0xFF) as u8
            }),
        }
    }

    /// `|d·d'| · Σ |(q − 8)·q'|`: what f32 rounds in one block pair's product.
    fn abs_dot(w: &BlockQ4_0, x: &BlockQ8_0) -> f64 {
        let sum: i32 = (0..QK4_0 / 2)
            .map(|j| {
                ((w.qs[j] & 15) as i32 - 8).abs() * (x.qs[j] as i32).abs()
                    + ((w.qs[j] >> 4) as i32 - 8).abs() * (x.qs[j + 16] as i32).abs()
            })
            .sum();
        (w.d.to_f64() * x.d.to_f64()).abs() * sum as f64
    }

    /// The f32 kernels (4 rows, 1 row, `rows_dot`) against the exact f64 sum of the same
    /// blocks, for odd and even block counts.
    #[test]
    fn f32_rows_match_the_f64_sum() {
        crate::f64_dot::testing::f32_rows_match_the_f64_sum::<BlockQ4_0>(block, abs_dot, rows_dot);
        crate::kernel::testing::f32_kernels_propagate_nan(block(1, 2));
    }

    /// The tiled product (four weight rows × several activation rows, each weight block
    /// unpacked once) gives every value bit for bit as the one-row kernel, through
    /// `rows_dot` for m = 1..9 too (prefill must not change the output a batch of one
    /// gives: tests/batch_invariance.rs).
    #[test]
    fn tiles_are_bit_for_bit_the_one_row_kernel() {
        crate::kernel::testing::check_rows_dot_sizes(block, abs_dot);
    }
}
