//! Q8_1: the activation format Q4_1 (and Q5_1) weights are multiplied with.
//!
//! A block holds 32 signed bytes `q`, a scale `d` and `s = d * sum(q)`, both as f16: ggml's
//! `block_q8_1`, byte for byte (36 bytes). `s` lets a Q4_1 dot product add the weight block's
//! offset `m` with one multiply (`m * s`) instead of summing the activations again.

use half::f16;

/// Values per Q8_1 block (ggml's `QK8_1`).
pub const QK8_1: usize = 32;

/// One Q8_1 block: `x[i] ≈ d * qs[i]`, and `s = d * Σ qs[i]` (ggml's `block_q8_1`).
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ8_1 {
    /// Scale: `max |x| / 127`.
    pub d: f16,
    /// `d * Σ qs`, for the offset term of asymmetric weight types.
    pub s: f16,
    /// Quantized values, `round(x / d)`, in `-127..=127`.
    pub qs: [i8; QK8_1],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_1>() == 36);

impl BlockQ8_1 {
    /// The all-zero block (`d = s = 0`).
    pub const ZERO: Self = Self {
        d: f16::ZERO,
        s: f16::ZERO,
        qs: [0; QK8_1],
    };
}

/// Quantizes `xs` into `ys` (ggml's `quantize_row_q8_1`), with exactly the rounding candle
/// 0.11's `BlockQ8_1::from_float` uses (round half away from zero, `s` rounded through f16 as
/// `f16(Σq) * f16(d)`), so products against it match candle's `QMatMul` up to summation order.
///
/// With an AVX2 kernel ([`crate::kernel::Kernel::detect`]) the rounding runs in AVX2, the
/// same bits as the portable loop (tested).
///
/// # Panics
/// If `xs.len() != ys.len() * 32` (callers size the buffers; see [`quantize_row_q8_1_into`]).
pub fn quantize_row_q8_1(xs: &[f32], ys: &mut [BlockQ8_1]) {
    assert_eq!(
        xs.len(),
        ys.len() * QK8_1,
        "quantize_row_q8_1: {} values for {} blocks of {QK8_1}",
        xs.len(),
        ys.len()
    );
    #[cfg(target_arch = "x86_64")]
    if crate::kernel::Kernel::detect().has_avx2() {
        // SAFETY: the CPU has AVX2 (`detect` gives only a kernel the CPU runs); `scalar`
        // (CANDLE_TP_KERNEL) keeps the portable loop.
        return unsafe { quantize_q8_1_blocks_avx2(xs, ys) };
    }
    quantize_q8_1_blocks(xs, ys)
}

/// One block by the portable loop, out of line (as [`crate::q8_0`]'s): the rare blocks the
/// AVX2 loop hands over.
#[cfg(target_arch = "x86_64")]
#[cold]
#[inline(never)]
fn portable_block(x: &[f32], y: &mut BlockQ8_1) {
    quantize_q8_1_blocks(x, std::slice::from_mut(y))
}

/// [`quantize_row_q8_1`]'s loop with AVX2 ([`crate::q8_0`]'s steps): the same bits as the
/// portable loop (tested). Blocks with a NaN, an infinity or a scale whose inverse overflows
/// take the portable code.
///
/// # Safety
/// The CPU must support avx2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_q8_1_blocks_avx2(xs: &[f32], ys: &mut [BlockQ8_1]) {
    use crate::q8_0::quantize_avx2::{finite_amax, scale_round};
    for (x, y) in xs.chunks_exact(QK8_1).zip(ys.iter_mut()) {
        let x: &[f32; QK8_1] = x.try_into().expect("chunks of 32");
        let Some(amax) = finite_amax(x) else {
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
        y.qs = scale_round(x, id);
        let sum: i32 = y.qs.iter().map(|&q| q as i32).sum();
        y.d = f16::from_f32(d);
        y.s = f16::from_f32(sum as f32) * y.d;
    }
}

/// [`quantize_row_q8_1`]'s loop, after its size check.
#[inline(always)]
fn quantize_q8_1_blocks(xs: &[f32], ys: &mut [BlockQ8_1]) {
    for (x, y) in xs.chunks_exact(QK8_1).zip(ys.iter_mut()) {
        if x.iter().any(|v| v.is_nan()) {
            // A NaN block, so that the product is NaN (a cast would round NaN to 0).
            *y = BlockQ8_1 {
                d: f16::NAN,
                s: f16::NAN,
                qs: [0; QK8_1],
            };
            continue;
        }
        let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in y.qs.iter_mut().zip(x) {
            *q = (v * id).round() as i8;
            sum += *q as i32;
        }
        y.d = f16::from_f32(d);
        y.s = f16::from_f32(sum as f32) * y.d;
    }
}

/// Quantizes `m` rows of `k` values each (`xs.len() == m * k`, `k` a multiple of 32) into a
/// reused buffer of `m * k / 32` blocks, row after row.
pub fn quantize_row_q8_1_into(xs: &[f32], k: usize, out: &mut Vec<BlockQ8_1>) {
    debug_assert!(k.is_multiple_of(QK8_1) && xs.len().is_multiple_of(k.max(1)));
    out.clear();
    out.resize(xs.len() / QK8_1, BlockQ8_1::ZERO);
    quantize_row_q8_1(xs, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2-compiled loop that [`quantize_row_q8_1`] runs on AVX2 hosts gives the portable loop's
    /// bytes on ties, zeros, subnormals, an infinity and a NaN.
    #[test]
    fn the_avx2_loop_gives_the_portable_bytes() {
        use crate::f64_dot::testing::{bytes_of, quantizer_inputs};
        let xs = quantizer_inputs(QK8_1);
        let mut portable = vec![BlockQ8_1::ZERO; xs.len() / QK8_1];
        quantize_q8_1_blocks(&xs, &mut portable);
        let mut dispatched = portable.clone();
        dispatched.fill(BlockQ8_1::ZERO);
        quantize_row_q8_1(&xs, &mut dispatched);
        assert_eq!(bytes_of(&dispatched), bytes_of(&portable));
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            let mut avx2 = vec![BlockQ8_1::ZERO; xs.len() / QK8_1];
            // SAFETY: the CPU has AVX2.
            unsafe { quantize_q8_1_blocks_avx2(&xs, &mut avx2) };
            assert_eq!(bytes_of(&avx2), bytes_of(&portable));
        } else {
            eprintln!("no AVX2 on this CPU: only the portable loop ran");
        }
    }

    #[test]
    fn roundtrip_within_half_a_step() {
        let xs: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.3)
            .collect();
        let mut ys = vec![BlockQ8_1::ZERO; 2];
        quantize_row_q8_1(&xs, &mut ys);
        for (x, y) in xs.chunks(32).zip(&ys) {
            let d = y.d.to_f32();
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            assert!(d > 0.0 && (d - amax / 127.0).abs() <= 1e-3 * d);
            let sum: i32 = y.qs.iter().map(|&q| q as i32).sum();
            assert!((y.s.to_f32() - d * sum as f32).abs() <= 2e-3 * d * sum.abs() as f32 + 1e-6);
            for (&v, &q) in x.iter().zip(&y.qs) {
                assert!(
                    (v - d * q as f32).abs() <= 0.51 * d + 1e-3 * amax,
                    "{v} {q} {d}"
                );
            }
        }
    }

    #[test]
    fn zero_block_has_zero_scale() {
        let mut ys = vec![BlockQ8_1::ZERO; 1];
        quantize_row_q8_1(&[0.0; 32], &mut ys);
        assert_eq!(ys[0], BlockQ8_1::ZERO);
    }
}
