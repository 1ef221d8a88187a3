//! Q8_0 (ggml's `block_q8_0`): 32 signed bytes and an f16 scale. A weight type, and the
//! activation format of Q8_0 (and Q4_0, Q5_0) weights.

use crate::f64_dot::F64Dot;
use half::f16;

/// Values per Q8_0 block (ggml's `QK8_0`).
pub const QK8_0: usize = 32;

/// One Q8_0 block: `x[i] = d * qs[i]` (34 bytes, as GGUF stores it).
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ8_0 {
    /// Scale.
    pub d: f16,
    /// Quantized values.
    pub qs: [i8; QK8_0],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);

impl BlockQ8_0 {
    /// The all-zero block.
    pub const ZERO: Self = Self {
        d: f16::ZERO,
        qs: [0; QK8_0],
    };
}

/// Quantizes `xs` into `ys` with candle 0.11's `BlockQ8_0::from_float` rounding: `d = max |x|
/// / 127` (stored as f16), `q = round(x / d)` with the f32 `d`.
///
/// With an AVX2 kernel ([`crate::kernel::Kernel::detect`]) the rounding runs in AVX2, the
/// same bits as the portable loop (tested).
///
/// # Panics
/// If `xs.len() != ys.len() * 32`.
pub fn quantize_row_q8_0(xs: &[f32], ys: &mut [BlockQ8_0]) {
    assert_eq!(
        xs.len(),
        ys.len() * QK8_0,
        "quantize_row_q8_0: {} values for {} blocks",
        xs.len(),
        ys.len()
    );
    #[cfg(target_arch = "x86_64")]
    if crate::kernel::Kernel::detect().has_avx2() {
        // SAFETY: the CPU has AVX2 (`detect` gives only a kernel the CPU runs); `scalar`
        // (CANDLE_TP_KERNEL) keeps the portable loop.
        return unsafe { quantize_q8_0_blocks_avx2(xs, ys) };
    }
    quantize_q8_0_blocks(xs, ys)
}

/// [`quantize_row_q8_0`]'s loop with AVX2: the same bits as the portable loop (tested), where
/// the portable one calls `roundf` once per value. Blocks with a NaN, an infinity or a scale
/// whose inverse overflows take the portable code.
///
/// # Safety
/// The CPU must support avx2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_q8_0_blocks_avx2(xs: &[f32], ys: &mut [BlockQ8_0]) {
    for (x, y) in xs.chunks_exact(QK8_0).zip(ys.iter_mut()) {
        let x: &[f32; QK8_0] = x.try_into().expect("chunks of 32");
        let Some(amax) = quantize_avx2::finite_amax(x) else {
            portable_block(x, y);
            continue;
        };
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        if !id.is_finite() {
            // A subnormal scale whose inverse overflows: products of infinity, which the
            // portable cast saturates.
            portable_block(x, y);
            continue;
        }
        y.d = f16::from_f32(d);
        y.qs = quantize_avx2::scale_round(x, id);
    }
}

/// One block by the portable loop, out of line: the rare blocks the AVX2 loop hands over
/// (inlined, its scalar loads were hoisted into the AVX2 loop's every block).
#[cfg(target_arch = "x86_64")]
#[cold]
#[inline(never)]
fn portable_block(x: &[f32], y: &mut BlockQ8_0) {
    quantize_q8_0_blocks(x, std::slice::from_mut(y))
}

/// [`quantize_row_q8_0`]'s loop, after its size check.
#[inline(always)]
fn quantize_q8_0_blocks(xs: &[f32], ys: &mut [BlockQ8_0]) {
    for (x, y) in xs.chunks_exact(QK8_0).zip(ys.iter_mut()) {
        if x.iter().any(|v| v.is_nan()) {
            // A NaN block, so that the product is NaN (a cast would round NaN to 0).
            *y = BlockQ8_0 {
                d: f16::NAN,
                qs: [0; QK8_0],
            };
            continue;
        }
        let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        y.d = f16::from_f32(d);
        for (q, &v) in y.qs.iter_mut().zip(x) {
            *q = (v * id).round() as i8;
        }
    }
}

// SAFETY: repr(C) plain data (f16 is a transparent u16), every bit pattern valid.
unsafe impl F64Dot for BlockQ8_0 {
    type Act = BlockQ8_0;
    const BLOCK: usize = QK8_0;
    const NAME: &'static str = "Q8_0";
    const ACT_ZERO: Self::Act = BlockQ8_0::ZERO;

    fn quantize(xs: &[f32], ys: &mut [Self::Act]) {
        quantize_row_q8_0(xs, ys)
    }

    #[inline(always)]
    fn block_dot(w: &Self, x: &Self::Act) -> f64 {
        let mut sum = 0i32;
        for j in 0..QK8_0 {
            sum += w.qs[j] as i32 * x.qs[j] as i32;
        }
        // d·d' is exact in f64 (two 11-bit mantissas), and so is its product with the sum.
        (w.d.to_f64() * x.d.to_f64()) * sum as f64
    }
}

/// The activation quantizers' AVX2 steps (Q8_0, Q8_1 and Q8_K blocks).
#[cfg(target_arch = "x86_64")]
pub(crate) mod quantize_avx2 {
    use std::arch::x86_64::*;

    /// The 32 values as four vectors. (Written out, as the loops below: an array's `map`
    /// with intrinsics in its closure was compiled into per-value scalar loads and spills
    /// here, `perf annotate` of a batched decode step.)
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load(x: &[f32; 32]) -> [__m256; 4] {
        let p = x.as_ptr();
        [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ]
    }

    /// The largest magnitude of the 32 values, or `None` when one is a NaN or infinite (the
    /// callers' portable code handles those blocks).
    ///
    /// # Safety
    /// The CPU must support avx2.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn finite_amax(x: &[f32; 32]) -> Option<f32> {
        let v = load(x);
        let sign = _mm256_set1_ps(-0.0);
        let m = _mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
        );
        // An infinity fails `< inf` (a NaN may not reach `m`: `nan` checks each value).
        let finite = _mm256_cmp_ps::<_CMP_LT_OQ>(m, _mm256_set1_ps(f32::INFINITY));
        let nan = _mm256_or_ps(
            _mm256_cmp_ps::<_CMP_UNORD_Q>(v[0], v[1]),
            _mm256_cmp_ps::<_CMP_UNORD_Q>(v[2], v[3]),
        );
        if _mm256_movemask_ps(nan) != 0 || _mm256_movemask_ps(finite) != 0xFF {
            return None;
        }
        let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_max_ss(h, _mm_shuffle_ps::<0b01>(h, h));
        Some(_mm_cvtss_f32(h))
    }

    /// `(v · scale).round() as i8` for the 32 values (finite, `|v · scale| <= 127.5`), as
    /// the portable loops compute it: the product, truncated, plus one away from zero where
    /// the truncation dropped half or more (both steps exact: round half away from zero).
    ///
    /// # Safety
    /// The CPU must support avx2.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn scale_round(x: &[f32; 32], scale: f32) -> [i8; 32] {
        let s = _mm256_set1_ps(scale);
        let v = load(x);
        let mut q = [_mm256_setzero_si256(); 4];
        for (q, v) in q.iter_mut().zip(v) {
            let y = _mm256_mul_ps(v, s);
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
            let frac = _mm256_andnot_ps(_mm256_set1_ps(-0.0), _mm256_sub_ps(y, t));
            let away = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, _mm256_set1_ps(0.5));
            let one = _mm256_or_ps(_mm256_set1_ps(1.0), _mm256_and_ps(y, _mm256_set1_ps(-0.0)));
            *q = _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_and_ps(away, one)));
        }
        // i32 -> i16 -> i8 (no saturation: |q| <= 128), then undo the packs' lane interleave.
        let w01 = _mm256_packs_epi32(q[0], q[1]);
        let w23 = _mm256_packs_epi32(q[2], q[3]);
        let b = _mm256_packs_epi16(w01, w23);
        let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        let mut out = [0i8; 32];
        _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, b);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2-compiled loop that [`quantize_row_q8_0`] runs on AVX2 hosts gives the portable loop's
    /// bytes on ties, zeros, subnormals, an infinity and a NaN.
    #[test]
    fn the_avx2_loop_gives_the_portable_bytes() {
        use crate::f64_dot::testing::{bytes_of, quantizer_inputs};
        let xs = quantizer_inputs(QK8_0);
        let mut portable = vec![BlockQ8_0::ZERO; xs.len() / QK8_0];
        quantize_q8_0_blocks(&xs, &mut portable);
        let mut dispatched = portable.clone();
        dispatched.fill(BlockQ8_0::ZERO);
        quantize_row_q8_0(&xs, &mut dispatched);
        assert_eq!(bytes_of(&dispatched), bytes_of(&portable));
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            let mut avx2 = vec![BlockQ8_0::ZERO; xs.len() / QK8_0];
            // SAFETY: the CPU has AVX2.
            unsafe { quantize_q8_0_blocks_avx2(&xs, &mut avx2) };
            assert_eq!(bytes_of(&avx2), bytes_of(&portable));
        } else {
            eprintln!("no AVX2 on this CPU: only the portable loop ran");
        }
    }
    use crate::f64_dot::testing::{
        check_against_candle, nan_and_inf_activations_propagate, pseudo,
    };
    use candle_core::quantized::GgmlDType;

    #[test]
    fn f64_dot_is_the_dot_of_candles_dequantized_blocks() {
        check_against_candle::<BlockQ8_0>(
            GgmlDType::Q8_0,
            |x| x.qs.iter().map(|&q| x.d.to_f64() * q as f64).collect(),
            |_, _| 0.0,
            1e-12,
        );
    }

    /// Byte for byte what candle's own quantization writes.
    #[test]
    fn quantization_matches_candle() {
        use candle_core::quantized::k_quants::{BlockQ8_0 as CandleQ8_0, GgmlType};
        let xs: Vec<f32> = (0..96).map(|i| pseudo(i + 7) * 2.5).collect();
        let mut ours = vec![BlockQ8_0::ZERO; 3];
        quantize_row_q8_0(&xs, &mut ours);
        let mut theirs = vec![CandleQ8_0::zeros(); 3];
        CandleQ8_0::from_float(&xs, &mut theirs);
        // SAFETY: both are repr(C) arrays of the same 34-byte layout; read as bytes.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(ours.as_ptr() as *const u8, 3 * 34),
                std::slice::from_raw_parts(theirs.as_ptr() as *const u8, 3 * 34),
            )
        };
        assert_eq!(a, b);
    }

    #[test]
    fn nan_and_inf_activations_give_nan() {
        nan_and_inf_activations_propagate::<BlockQ8_0>(GgmlDType::Q8_0);
    }
}
