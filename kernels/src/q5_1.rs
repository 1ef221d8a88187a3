//! Q5_1 (ggml's `block_q5_1`): 32 weights as unsigned 5-bit values with an f16 scale and an f16
//! offset, against Q8_1 activations (as ggml and candle quantize them for this type).
//!
//! `w[j] = d · q[j] + m`, `q[j]` in 0..32: its low four bits are nibbles (`qs`, low nibbles
//! holding values 0..16 and high nibbles 16..32, as in Q4_1) and its fifth bit is bit `j` of
//! the little-endian `u32` `qh`. Against a Q8_1 block `x[j] = d' · q'[j]` with `s' = d' · Σ q'`
//! (rounded through f16, as ggml stores it): `Σ w·x = d·d' · Σ q·q' + m · s'`.
//! - [`F64Dot`]: each block's product exact in f64, the reference of the repacked engines
//!   ([`crate::q5_1x4`]), which every product of the crate's layers runs;
//! - [`dot_rows`] / [`rows_dot`] (`candle_tp::quant::matmul_q5_1`): f32 FMA chains as ggml
//!   sums them, four weight rows sharing each activation load; the AVX2 kernel builds the 32
//!   values in one register (nibbles widened to bytes, and `0x10` where the bit of `qh` is
//!   set, see `f64_dot::avx2::bit_bytes`) and sums the products as Q4_1 does (`maddubs` of
//!   unsigned values and signed activations, pairs at most 2·31·127: no saturation; `madd` to
//!   i32). Any block count (candle 0.11's needs an even one).

use crate::f64_dot::F64Dot;
use crate::kernel::Kernel;
use crate::q8_1::{quantize_row_q8_1, BlockQ8_1, QK8_1};
use candle_core::Result;
use half::f16;

/// Values per Q5_1 block (ggml's `QK5_1`).
pub const QK5_1: usize = 32;

/// One Q5_1 block, laid out as GGUF stores it (24 bytes): for `j < 16`,
/// `w[j] = d · (qs[j] & 15 | bit j of qh << 4) + m` and
/// `w[j + 16] = d · (qs[j] >> 4 | bit j + 16 of qh << 4) + m`, `qh` read as a little-endian
/// `u32`.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ5_1 {
    /// Scale.
    pub d: f16,
    /// Offset (the block's minimum).
    pub m: f16,
    /// The values' fifth bits, bit `j` for value `j` (a little-endian `u32`).
    pub qh: [u8; 4],
    /// The values' low four bits, packed two per byte.
    pub qs: [u8; QK5_1 / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24);

impl BlockQ5_1 {
    /// The all-zero block (every weight `0 · q + 0 = 0`).
    pub const ZERO: Self = Self {
        d: f16::ZERO,
        m: f16::ZERO,
        qh: [0; 4],
        qs: [0; QK5_1 / 2],
    };

    /// Views GGUF bytes (e.g. `QTensor::data()` of a Q5_1 tensor) as blocks, without copying.
    /// Errors if the length is not a whole number of 24-byte blocks or the bytes are not
    /// 2-byte aligned (candle's CPU storage always is).
    pub fn slice_from_bytes(bytes: &[u8]) -> Result<&[Self]> {
        crate::f64_dot::blocks_from_bytes(bytes)
    }

    /// The 32 unsigned values `q` (0..32) of the block, in order.
    pub fn values(&self) -> [u8; QK5_1] {
        let qh = u32::from_le_bytes(self.qh);
        std::array::from_fn(|j| {
            let nibble = if j < QK5_1 / 2 {
                self.qs[j] & 0x0F
            } else {
                self.qs[j - QK5_1 / 2] >> 4
            };
            nibble | (((qh >> j) & 1) << 4) as u8
        })
    }
}

/// Dot products of `R` weight rows with one activation row in f32, sharing its loads (`R` = 1
/// or 4 in the matmul).
///
/// # Panics
/// If a row's length differs from `xs`'s, or `kernel` is not available on this CPU.
pub fn dot_rows<const R: usize>(
    kernel: Kernel,
    ws: [&[BlockQ5_1]; R],
    xs: &[BlockQ8_1],
    out: &mut [f32; R],
) {
    crate::row_dot::dot_rows_by(kernel, ws, xs, out)
}

/// Weight rows `row0..row0 + out.len() / m` of `w` (rows of `kb` blocks) against all `m`
/// activation rows `xq`, into `out[(row - row0) * m + i]`, four rows at a time. Non-generic,
/// so that it is compiled with this crate's optimisations even in a caller's debug build.
pub fn rows_dot(
    kernel: Kernel,
    w: &[BlockQ5_1],
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
fn int_sum(w: &BlockQ5_1, x: &BlockQ8_1) -> i32 {
    let qh = u32::from_le_bytes(w.qh);
    let mut sum = 0i32;
    for j in 0..QK8_1 / 2 {
        let lo = (w.qs[j] & 0x0F) as i32 | (((qh >> j) & 1) << 4) as i32;
        let hi = (w.qs[j] >> 4) as i32 | (((qh >> (j + 16)) & 1) << 4) as i32;
        sum += lo * x.qs[j] as i32 + hi * x.qs[j + QK8_1 / 2] as i32;
    }
    sum
}

impl crate::row_dot::RowDot for BlockQ5_1 {
    /// Scalar reference in f32 (ggml's generic `ggml_vec_dot_q5_1_q8_1`, block after block).
    fn dot_scalar(ws: &[BlockQ5_1], xs: &[BlockQ8_1]) -> f32 {
        ws.iter().zip(xs).fold(0f32, |sum, (w, x)| {
            sum + int_sum(w, x) as f32 * (w.d.to_f32() * x.d.to_f32()) + w.m.to_f32() * x.s.to_f32()
        })
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_rows_avx2<const R: usize>(ws: [&[Self]; R], xs: &[Self::Act]) -> [f32; R] {
        avx2::dot_rows(ws, xs)
    }
}

// SAFETY: repr(C) plain data (f16 is a transparent u16), every bit pattern valid.
unsafe impl F64Dot for BlockQ5_1 {
    type Act = BlockQ8_1;
    const BLOCK: usize = QK5_1;
    const NAME: &'static str = "Q5_1";
    const ACT_ZERO: Self::Act = BlockQ8_1::ZERO;

    fn quantize(xs: &[f32], ys: &mut [Self::Act]) {
        quantize_row_q8_1(xs, ys)
    }

    /// `d·d' · Σ q·q' + m · s'`, in f64 (every product of two f16 is exact).
    #[inline(always)]
    fn block_dot(w: &Self, x: &Self::Act) -> f64 {
        (w.d.to_f64() * x.d.to_f64()) * int_sum(w, x) as f64 + w.m.to_f64() * x.s.to_f64()
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BlockQ5_1, BlockQ8_1};
    use crate::f64_dot::avx2::{bit_bytes, hsum_ps, nibbles};
    use std::arch::x86_64::*;

    /// The integer sum `Σ q·q'` of one block pair, in eight i32 lanes.
    #[inline(always)]
    unsafe fn block_sums(w: &BlockQ5_1, qx: __m256i) -> __m256i {
        let fifth = _mm256_and_si256(bit_bytes(u32::from_le_bytes(w.qh)), _mm256_set1_epi8(0x10));
        let qw = _mm256_or_si256(nibbles(w.qs.as_ptr()), fifth); // 0..31
        _mm256_madd_epi16(_mm256_maddubs_epi16(qw, qx), _mm256_set1_epi16(1))
    }

    /// `R` rows at once in f32: `R` independent FMA chains hide the FMA latency, and each
    /// activation block is loaded once for all rows.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; every row must have `xs.len()` blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_rows<const R: usize>(
        ws: [&[BlockQ5_1]; R],
        xs: &[BlockQ8_1],
    ) -> [f32; R] {
        let mut acc = [_mm256_setzero_ps(); R];
        // Lane 1 of each accumulates m·s' (lane 0 collects d·d', unused).
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
                    w as *const BlockQ5_1 as *const i32,
                )));
                let prod = _mm_mul_ps(wdm, xds); // [d·d', m·s', 0, 0]
                acc_ms[r] = _mm_add_ps(acc_ms[r], prod);
                acc[r] = _mm256_fmadd_ps(
                    _mm256_broadcastss_ps(prod),
                    _mm256_cvtepi32_ps(block_sums(w, qx)),
                    acc[r],
                );
            }
        }
        std::array::from_fn(|r| {
            hsum_ps(acc[r]) + _mm_cvtss_f32(_mm_shuffle_ps(acc_ms[r], acc_ms[r], 1))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f64_dot::testing::{
        check_against_candle, nan_and_inf_activations_propagate, pseudo, pseudo_bytes,
        split_sums_round_alike,
    };
    use crate::row_dot::testing::f32_rows_match_the_f64_sum;
    use candle_core::quantized::GgmlDType;

    /// A block of pseudo-random values, scale and offset, `i` its seed.
    fn block(i: usize) -> BlockQ5_1 {
        BlockQ5_1 {
            d: f16::from_f32(0.01 + 0.02 * pseudo(i).abs()),
            m: f16::from_f32(-0.3 * pseudo(i + 7)),
            qh: pseudo_bytes(i * 7 + 3),
            qs: pseudo_bytes(i * 13 + 5),
        }
    }

    #[test]
    fn values_match_candles_dequantization() {
        use candle_core::quantized::k_quants::{BlockQ5_1 as Candle, GgmlType};
        let blocks: Vec<BlockQ5_1> = (0..5).map(block).collect();
        // SAFETY: the same repr(C) 24-byte layout (asserted by both crates).
        let theirs: &[Candle] = unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast(), 5) };
        let mut deq = vec![0f32; 5 * QK5_1];
        Candle::to_float(theirs, &mut deq);
        for (b, d) in blocks.iter().zip(deq.chunks_exact(QK5_1)) {
            for (j, (&v, &want)) in b.values().iter().zip(d).enumerate() {
                let ours = b.d.to_f64() * v as f64 + b.m.to_f64();
                assert!(
                    (ours - want as f64).abs() <= f32::EPSILON as f64 * ours.abs(),
                    "value {j} of {b:?}: {ours} vs candle's {want}"
                );
            }
        }
        assert!(blocks.iter().any(|b| b.values().contains(&0)));
        assert!(blocks.iter().any(|b| b.values().contains(&31)));
    }

    #[test]
    fn f64_dot_is_the_dot_of_candles_dequantized_blocks() {
        // As for Q4_1: the kernel uses Q8_1's f16-rounded `s` for the offset term, so the
        // reference adds `m · (s − d · Σq)`; candle's dequantized `d·q + m` is rounded to f32.
        check_against_candle::<BlockQ5_1>(
            GgmlDType::Q5_1,
            |x| x.qs.iter().map(|&q| x.d.to_f64() * q as f64).collect(),
            |w, x| {
                let sum: i32 = x.qs.iter().map(|&q| q as i32).sum();
                w.m.to_f64() * (x.s.to_f64() - x.d.to_f64() * sum as f64)
            },
            1e-6,
        );
    }

    #[test]
    fn nan_and_inf_activations_give_nan() {
        nan_and_inf_activations_propagate::<BlockQ5_1>(GgmlDType::Q5_1);
        crate::row_dot::testing::f32_kernels_propagate_nan(block(1));
    }

    /// The f32 kernels (4 rows, 1 row, `rows_dot` over 7 rows and 3 activation rows) against
    /// the exact f64 sum of the same blocks, for odd and even block counts.
    #[test]
    fn f32_rows_match_the_exact_sum() {
        f32_rows_match_the_f64_sum::<BlockQ5_1>(|r, b| block(r * 1000 + b), abs_dot, rows_dot);
    }

    /// What f32 rounds in one block pair's product: `|d·d'|·Σ|q·q'| + |m·s'|`.
    fn abs_dot(w: &BlockQ5_1, x: &BlockQ8_1) -> f64 {
        let s: i32 = w
            .values()
            .iter()
            .zip(&x.qs)
            .map(|(&v, &q)| (v as i32 * q as i32).abs())
            .sum();
        (w.d.to_f64() * x.d.to_f64()).abs() * s as f64 + (w.m.to_f64() * x.s.to_f64()).abs()
    }

    /// The tiled path of `rows_dot` (the trait's default tile, one activation row at a time)
    /// gives the one-row kernel's bits.
    #[test]
    fn tiles_are_bit_for_bit_the_one_row_kernel() {
        crate::row_dot::testing::check_rows_dot_sizes(|r, b| block(r * 1000 + b), abs_dot);
    }

    #[test]
    fn f64_sums_do_not_depend_on_the_split() {
        split_sums_round_alike::<BlockQ5_1>(block);
    }
}
