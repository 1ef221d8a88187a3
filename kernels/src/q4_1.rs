//! Q4_1 × Q8_1 dot products: a scalar reference and an AVX2 + FMA + F16C kernel.
//!
//! A Q4_1 block (ggml's `block_q4_1`, 20 bytes) stores 32 weights as 4-bit `q` with a scale
//! `d` and an offset `m`: `w[i] = d * q[i] + m`, low nibbles holding values 0..16 and high
//! nibbles 16..32. Against a Q8_1 block `x[i] = d' * q'[i]`:
//! `Σ w·x = d·d' · Σ q·q' + m · (d' · Σ q') = d·d' · Σ q·q' + m · s'`.
//! The integer sum is what the SIMD kernel computes 32 lanes at a time, as ggml's
//! `ggml_vec_dot_q4_1_q8_1` does: `maddubs` (unsigned nibbles × signed bytes, pairs summed to
//! i16, at most 2·15·127 so no saturation), `madd` with ones to i32, convert, FMA with the
//! block's `d·d'`. Unlike candle 0.11's version any block count works (a row-parallel shard
//! may hold an odd number of blocks per row).

use crate::q8_1::{BlockQ8_1, QK8_1};
use candle_core::Result;
use half::f16;

/// Values per Q4_1 block (ggml's `QK4_1`).
pub const QK4_1: usize = 32;

/// One Q4_1 block, laid out as GGUF stores it: `w[j] = d * (qs[j] & 15) + m` and
/// `w[j + 16] = d * (qs[j] >> 4) + m` for `j < 16`.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ4_1 {
    /// Scale.
    pub d: f16,
    /// Offset (the block's minimum).
    pub m: f16,
    /// Packed 4-bit values.
    pub qs: [u8; QK4_1 / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);

impl BlockQ4_1 {
    /// The all-zero block (every weight `0 · q + 0 = 0`).
    pub const ZERO: Self = Self {
        d: f16::ZERO,
        m: f16::ZERO,
        qs: [0; QK4_1 / 2],
    };

    /// Views GGUF bytes (e.g. `QTensor::data()` of a Q4_1 tensor) as blocks, without copying.
    /// Errors if the length is not a whole number of 20-byte blocks or the bytes are not
    /// 2-byte aligned (candle's CPU storage always is).
    pub fn slice_from_bytes(bytes: &[u8]) -> Result<&[Self]> {
        crate::f64_dot::blocks_from_bytes(bytes)
    }
}

pub use crate::kernel::Kernel;

/// `Σ_b dot(ws[b], xs[b])` over blocks, with the chosen kernel; any number of blocks.
///
/// # Panics
/// If the slices differ in length, or `kernel` is not available on this CPU (a programming
/// error: pick it with [`Kernel::detect`] or check [`Kernel::is_available`]).
pub fn vec_dot_q4_1_q8_1(kernel: Kernel, ws: &[BlockQ4_1], xs: &[BlockQ8_1]) -> f32 {
    let mut out = [0f32];
    dot_rows(kernel, [ws], xs, &mut out);
    out[0]
}

/// Dot products of `R` weight rows with one activation row, sharing its loads (`R` = 1 or 4
/// in the matmul). Panics as [`vec_dot_q4_1_q8_1`] does.
pub fn dot_rows<const R: usize>(
    kernel: Kernel,
    ws: [&[BlockQ4_1]; R],
    xs: &[BlockQ8_1],
    out: &mut [f32; R],
) {
    crate::row_dot::dot_rows_by(kernel, ws, xs, out)
}

/// Weight rows `row0..row0 + out.len() / m` of `w` (rows of `kb` blocks) against all `m`
/// activation rows `xq` (rows of `kb` blocks), into `out[(row - row0) * m + i]`: four weight
/// rows at a time share each activation load, and against four activation rows at a time
/// (prefill) each weight block is unpacked once for the four; every value is bit for bit
/// what [`dot_rows`] gives for its pair. Non-generic, so that it is compiled with this
/// crate's optimisations even in a caller's debug build.
pub fn rows_dot(
    kernel: Kernel,
    w: &[BlockQ4_1],
    kb: usize,
    xq: &[BlockQ8_1],
    m: usize,
    row0: usize,
    out: &mut [f32],
) {
    crate::row_dot::rows_dot_by(kernel, (w, kb), (xq, m), row0, out)
}

/// The integer sum `Σ q·q'` of one block pair.
#[inline(always)]
fn int_sum(w: &BlockQ4_1, x: &BlockQ8_1) -> i32 {
    let mut sum = 0i32;
    for j in 0..QK8_1 / 2 {
        sum += (w.qs[j] & 0x0F) as i32 * x.qs[j] as i32
            + (w.qs[j] >> 4) as i32 * x.qs[j + QK8_1 / 2] as i32;
    }
    sum
}

impl crate::row_dot::RowDot for BlockQ4_1 {
    /// Scalar reference (ggml's generic `ggml_vec_dot_q4_1_q8_1`, block after block).
    fn dot_scalar(ws: &[BlockQ4_1], xs: &[BlockQ8_1]) -> f32 {
        let mut sum = 0f32;
        for (w, x) in ws.iter().zip(xs) {
            sum += int_sum(w, x) as f32 * w.d.to_f32() * x.d.to_f32() + w.m.to_f32() * x.s.to_f32();
        }
        sum
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
unsafe impl crate::f64_dot::F64Dot for BlockQ4_1 {
    type Act = BlockQ8_1;
    const BLOCK: usize = QK4_1;
    const NAME: &'static str = "Q4_1";
    const ACT_ZERO: Self::Act = BlockQ8_1::ZERO;

    fn quantize(xs: &[f32], ys: &mut [Self::Act]) {
        crate::q8_1::quantize_row_q8_1(xs, ys)
    }

    /// `d·d' · Σ q·q' + m · s'`, in f64 (every product of two f16 is exact).
    #[inline(always)]
    fn block_dot(w: &Self, x: &Self::Act) -> f64 {
        (w.d.to_f64() * x.d.to_f64()) * int_sum(w, x) as f64 + w.m.to_f64() * x.s.to_f64()
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BlockQ4_1, BlockQ8_1};
    use std::arch::x86_64::*;

    /// `R` rows at once: `R` independent FMA chains hide the FMA latency, and each activation
    /// block is loaded and widened once for all rows.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; every row must have `xs.len()` blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_rows<const R: usize>(
        ws: [&[BlockQ4_1]; R],
        xs: &[BlockQ8_1],
    ) -> [f32; R] {
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); R];
        // Lane 1 of each accumulates m·s (lane 0 collects d·d', unused).
        let mut acc_ms = [_mm_setzero_ps(); R];
        for (b, x) in xs.iter().enumerate() {
            // [d', s'] of the activation block as f32.
            let xds = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(
                x as *const BlockQ8_1 as *const i32,
            )));
            let qx = _mm256_loadu_si256(x.qs.as_ptr() as *const __m256i);
            for r in 0..R {
                let w = ws[r].get_unchecked(b);
                let wdm = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(
                    w as *const BlockQ4_1 as *const i32,
                )));
                let prod = _mm_mul_ps(wdm, xds); // [d·d', m·s', 0, 0]
                acc_ms[r] = _mm_add_ps(acc_ms[r], prod);
                let packed = _mm_loadu_si128(w.qs.as_ptr() as *const __m128i);
                let qw = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
                let pairs = _mm256_maddubs_epi16(qw, qx);
                let quads = _mm256_madd_epi16(pairs, ones);
                acc[r] = _mm256_fmadd_ps(
                    _mm256_broadcastss_ps(prod),
                    _mm256_cvtepi32_ps(quads),
                    acc[r],
                );
            }
        }
        let mut out = [0f32; R];
        for r in 0..R {
            let a = acc[r];
            let s = _mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            let ms = _mm_cvtss_f32(_mm_shuffle_ps(acc_ms[r], acc_ms[r], 1));
            out[r] = _mm_cvtss_f32(s) + ms;
        }
        out
    }

    /// `R` (at most 4) weight rows against `M` activation rows: each weight block is
    /// unpacked once (and its scale converted once) for all `M` activation rows. Every value
    /// takes the same operations in the same order as in [`dot_rows`] (`d·d'` rounded to f32,
    /// one FMA per block in block order, the same horizontal sum; `m·s'` rounded to f32 and
    /// added in block order, here in lane `r` of one vector per activation row), so each is
    /// bit for bit that of the one-activation-row kernel.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; every row of `ws` and `xs` has `xs[0].len()`
    /// blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_tile<const R: usize, const M: usize>(
        ws: [&[BlockQ4_1]; R],
        xs: [&[BlockQ8_1]; M],
    ) -> [[f32; R]; M] {
        const {
            assert!(
                R <= 4 && M <= 8,
                "the m·s' sums of 4 × 8 pairs at most in 4 vectors"
            )
        };
        let mut acc = [[_mm256_setzero_ps(); R]; M];
        // Lane 4·(i % 2) + r of acc_ms[i / 2]: Σ m·s' of weight row r and activation row i.
        let mut acc_ms = [_mm256_setzero_ps(); 4];
        let nb = if M == 0 { 0 } else { xs[0].len() };
        for b in 0..nb {
            // The weight blocks' offsets m, one row per lane, twice.
            let mut m = [0u16; 4];
            for r in 0..R {
                m[r] = ws[r].get_unchecked(b).m.to_bits();
            }
            let m = _mm_cvtph_ps(_mm_loadl_epi64(m.as_ptr() as *const __m128i));
            let m = _mm256_set_m128(m, m);
            let mut xd = [_mm256_setzero_ps(); M];
            let mut s = [_mm_setzero_ps(); M];
            for i in 0..M {
                let x = xs[i].get_unchecked(b);
                let xds = f16_pair(x as *const BlockQ8_1 as *const u8);
                // `wd · xd` and `m · s'` lane by lane are the f32 products of `dot_rows`.
                xd[i] = _mm256_broadcastss_ps(xds);
                s[i] = _mm_shuffle_ps(xds, xds, 0b01_01_01_01);
            }
            for j in 0..M.div_ceil(2) {
                let s = _mm256_set_m128(s[(2 * j + 1).min(M - 1)], s[2 * j]);
                acc_ms[j] = _mm256_add_ps(acc_ms[j], _mm256_mul_ps(m, s));
            }
            for r in 0..R {
                let w = ws[r].get_unchecked(b);
                let wd = _mm256_broadcastss_ps(f16_pair(w as *const BlockQ4_1 as *const u8));
                let qw = unpack(w);
                for i in 0..M {
                    let x = xs[i].get_unchecked(b);
                    let qx = _mm256_loadu_si256(x.qs.as_ptr() as *const __m256i);
                    let sums = _mm256_cvtepi32_ps(unpacked_sums(qw, qx));
                    acc[i][r] = _mm256_fmadd_ps(_mm256_mul_ps(wd, xd[i]), sums, acc[i][r]);
                }
            }
        }
        let mut ms = [0f32; 32];
        for (j, a) in acc_ms.into_iter().enumerate() {
            _mm256_storeu_ps(ms.as_mut_ptr().add(8 * j), a);
        }
        let mut out = [[0f32; R]; M];
        for i in 0..M {
            for r in 0..R {
                out[i][r] = hsum(acc[i][r]) + ms[4 * i + r];
            }
        }
        out
    }

    /// The two f16 at `p` (`[d, m]` of a weight block, `[d', s']` of an activation block) as
    /// f32 in lanes 0 and 1.
    #[inline(always)]
    unsafe fn f16_pair(p: *const u8) -> __m128 {
        _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32)))
    }

    /// The block's 32 values `q` (0..15), as bytes in its order.
    #[inline(always)]
    unsafe fn unpack(w: &BlockQ4_1) -> __m256i {
        let packed = _mm_loadu_si128(w.qs.as_ptr() as *const __m128i);
        _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
            _mm256_set1_epi8(0x0F),
        )
    }

    /// The integer sum `Σ q·q'` of one block pair in eight i32 lanes (`maddubs`: unsigned
    /// nibbles times signed bytes, pairs to i16 without saturation, then `madd` to i32).
    #[inline(always)]
    unsafe fn unpacked_sums(qw: __m256i, qx: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(qw, qx), _mm256_set1_epi16(1))
    }

    /// The sum of the eight lanes, in the order every f32 kernel here adds them.
    #[inline(always)]
    unsafe fn hsum(a: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::q8_1::quantize_row_q8_1;

    fn pseudo(i: usize) -> f32 {
        let x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
        (x as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn f64_dot_is_the_dot_of_candles_dequantized_blocks() {
        // Q8_1's `s` is `d · Σq` rounded through f16, and the kernel uses it for the offset:
        // the reference adds `m · (s − d · Σq)`; candle's dequantized `d·q + m` is rounded
        // to f32.
        crate::f64_dot::testing::check_against_candle::<BlockQ4_1>(
            candle_core::quantized::GgmlDType::Q4_1,
            |x| x.qs.iter().map(|&q| x.d.to_f64() * q as f64).collect(),
            |w, x| {
                let sum: i32 = x.qs.iter().map(|&q| q as i32).sum();
                w.m.to_f64() * (x.s.to_f64() - x.d.to_f64() * sum as f64)
            },
            1e-6,
        );
    }

    #[test]
    fn avx2_matches_scalar_for_every_block_count() {
        // Fails on an x86-64 CPU without AVX2 unless CANDLE_TP_KERNEL=scalar says that only
        // the scalar kernel is meant (then there is nothing to compare).
        if !Kernel::under_test().contains(&Kernel::Avx2) {
            return;
        }
        for nb in [1usize, 2, 3, 5, 18, 19] {
            let ws: Vec<BlockQ4_1> = (0..nb)
                .map(|b| BlockQ4_1 {
                    d: f16::from_f32(0.01 + 0.02 * pseudo(b).abs()),
                    m: f16::from_f32(-0.1 * pseudo(b + 7)),
                    qs: std::array::from_fn(|j| (pseudo(b * 16 + j + 99).to_bits() & 0xFF) as u8),
                })
                .collect();
            let x: Vec<f32> = (0..nb * 32).map(|i| pseudo(i + 1000) * 3.0).collect();
            let mut xs = vec![BlockQ8_1::ZERO; nb];
            quantize_row_q8_1(&x, &mut xs);
            let s = vec_dot_q4_1_q8_1(Kernel::Scalar, &ws, &xs);
            let a = vec_dot_q4_1_q8_1(Kernel::Avx2, &ws, &xs);
            assert!(s.is_finite() && a.is_finite());
            assert!(
                (s - a).abs() <= 1e-5 * (1.0 + s.abs()),
                "nb={nb}: scalar {s} avx2 {a}"
            );
        }
    }

    #[test]
    fn nan_and_inf_activations_give_nan() {
        crate::f64_dot::testing::nan_and_inf_activations_propagate::<BlockQ4_1>(
            candle_core::quantized::GgmlDType::Q4_1,
        );
        // The f32 kernel too.
        let ws = [BlockQ4_1 {
            d: f16::from_f32(0.02),
            m: f16::from_f32(-0.1),
            qs: [0x5A; 16],
        }];
        for bad in [f32::NAN, f32::INFINITY] {
            let mut x = vec![0.5f32; 32];
            x[3] = bad;
            let mut xs = vec![BlockQ8_1::ZERO; 1];
            quantize_row_q8_1(&x, &mut xs);
            for kernel in Kernel::under_test() {
                let y = vec_dot_q4_1_q8_1(kernel, &ws, &xs);
                assert!(y.is_nan(), "{kernel:?}: activation {bad} gave {y}");
            }
        }
    }

    /// The tiled product (four weight rows × several activation rows, each weight block
    /// unpacked once) gives every value bit for bit as the one-row kernel, through
    /// `rows_dot` for m = 1..9 too (prefill must not change the output a batch of one
    /// gives: tests/batch_invariance.rs).
    #[test]
    fn tiles_are_bit_for_bit_the_one_row_kernel() {
        let block = |r: usize, b: usize| BlockQ4_1 {
            d: f16::from_f32(0.01 + 0.02 * pseudo(r * 97 + b).abs()),
            m: f16::from_f32(-0.1 * pseudo(r * 31 + b + 7)),
            qs: std::array::from_fn(|j| {
                (pseudo(r * 1000 + b * 16 + j + 99).to_bits() & 0xFF) as u8
            }),
        };
        let abs_dot = |w: &BlockQ4_1, x: &BlockQ8_1| {
            let sum: i32 = (0..QK4_1 / 2)
                .map(|j| {
                    (w.qs[j] & 15) as i32 * (x.qs[j] as i32).abs()
                        + (w.qs[j] >> 4) as i32 * (x.qs[j + 16] as i32).abs()
                })
                .sum();
            (w.d.to_f64() * x.d.to_f64()).abs() * sum as f64 + (w.m.to_f64() * x.s.to_f64()).abs()
        };
        crate::row_dot::testing::check_rows_dot_sizes(block, abs_dot);
    }
}
