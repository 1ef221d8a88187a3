//! Q8_K (ggml's `block_q8_K`): the activation format of the k-quants, 256 signed bytes with an
//! f32 scale and the sums of each 16 values.

/// Values per k-quant super-block (ggml's `QK_K`).
pub const QK_K: usize = 256;

/// One Q8_K block: `x[i] = d * qs[i]`, `bsums[j] = Σ qs[16 j..16 j + 16]`.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ8K {
    /// Scale.
    pub d: f32,
    /// Quantized values.
    pub qs: [i8; QK_K],
    /// Sums of each group of 16 values.
    pub bsums: [i16; QK_K / 16],
}
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 292);

impl BlockQ8K {
    /// The all-zero block.
    pub const ZERO: Self = Self {
        d: 0.0,
        qs: [0; QK_K],
        bsums: [0; QK_K / 16],
    };
}

/// Quantizes `xs` into `ys` with candle 0.11's `BlockQ8K::from_float` rounding: the value of
/// largest magnitude `max` maps to -127 (`q = round(-127 / max * x)`, clamped to -128..=127),
/// `d = max / -127`.
///
/// With an AVX2 kernel ([`crate::kernel::Kernel::detect`]) the rounding runs in AVX2, the
/// same bits as the portable loop (tested).
///
/// # Panics
/// If `xs.len() != ys.len() * 256`.
pub fn quantize_row_q8k(xs: &[f32], ys: &mut [BlockQ8K]) {
    assert_eq!(
        xs.len(),
        ys.len() * QK_K,
        "quantize_row_q8k: {} values for {} blocks",
        xs.len(),
        ys.len()
    );
    #[cfg(target_arch = "x86_64")]
    if crate::kernel::Kernel::detect().has_avx2() {
        // SAFETY: the CPU has AVX2 (`detect` gives only a kernel the CPU runs); `scalar`
        // (CANDLE_TP_KERNEL) keeps the portable loop.
        return unsafe { quantize_q8k_blocks_avx2(xs, ys) };
    }
    quantize_q8k_blocks(xs, ys)
}

/// [`quantize_row_q8k`]'s loop with AVX2 for the rounding ([`crate::q8_0`]'s steps): the
/// same bits as the portable loop (tested). Blocks with a NaN, an infinity, only zeros or a
/// subnormal maximum take the portable code.
///
/// # Safety
/// The CPU must support avx2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_q8k_blocks_avx2(xs: &[f32], ys: &mut [BlockQ8K]) {
    use crate::q8_0::quantize_avx2::scale_round;
    for (x, y) in xs.chunks_exact(QK_K).zip(ys.iter_mut()) {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 || !amax.is_finite() || x.iter().any(|v| v.is_nan()) {
            quantize_q8k_blocks(x, std::slice::from_mut(y));
            continue;
        }
        let iscale = -127f32 / max;
        if !iscale.is_finite() {
            // A subnormal maximum: products of infinity, which the portable code clamps.
            quantize_q8k_blocks(x, std::slice::from_mut(y));
            continue;
        }
        for (q, x) in y.qs.chunks_exact_mut(32).zip(x.chunks_exact(32)) {
            q.copy_from_slice(&scale_round(x.try_into().expect("chunks of 32"), iscale));
        }
        for (s, q) in y.bsums.iter_mut().zip(y.qs.chunks_exact(16)) {
            *s = q.iter().map(|&v| v as i32).sum::<i32>() as i16;
        }
        y.d = 1.0 / iscale;
    }
}

/// [`quantize_row_q8k`]'s loop, after its size check.
#[inline(always)]
fn quantize_q8k_blocks(xs: &[f32], ys: &mut [BlockQ8K]) {
    for (x, y) in xs.chunks_exact(QK_K).zip(ys.iter_mut()) {
        if x.iter().any(|v| v.is_nan()) {
            // A NaN block, so that the product is NaN (a cast would round NaN to 0).
            *y = BlockQ8K {
                d: f32::NAN,
                ..BlockQ8K::ZERO
            };
            continue;
        }
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *y = BlockQ8K::ZERO;
            continue;
        }
        let iscale = -127f32 / max;
        for (q, &v) in y.qs.iter_mut().zip(x) {
            *q = (iscale * v).round().clamp(-128.0, 127.0) as i8;
        }
        for (s, q) in y.bsums.iter_mut().zip(y.qs.chunks_exact(16)) {
            *s = q.iter().map(|&v| v as i32).sum::<i32>() as i16;
        }
        y.d = 1.0 / iscale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2-compiled loop that [`quantize_row_q8k`] runs on AVX2 hosts gives the portable loop's
    /// bytes on ties, zeros, subnormals, an infinity and a NaN.
    #[test]
    fn the_avx2_loop_gives_the_portable_bytes() {
        use crate::f64_dot::testing::{bytes_of, quantizer_inputs};
        let xs = quantizer_inputs(QK_K);
        let mut portable = vec![BlockQ8K::ZERO; xs.len() / QK_K];
        quantize_q8k_blocks(&xs, &mut portable);
        let mut dispatched = portable.clone();
        dispatched.fill(BlockQ8K::ZERO);
        quantize_row_q8k(&xs, &mut dispatched);
        assert_eq!(bytes_of(&dispatched), bytes_of(&portable));
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            let mut avx2 = vec![BlockQ8K::ZERO; xs.len() / QK_K];
            // SAFETY: the CPU has AVX2.
            unsafe { quantize_q8k_blocks_avx2(&xs, &mut avx2) };
            assert_eq!(bytes_of(&avx2), bytes_of(&portable));
        } else {
            eprintln!("no AVX2 on this CPU: only the portable loop ran");
        }
    }
    use crate::f64_dot::testing::pseudo;
    use candle_core::quantized::k_quants::{BlockQ8K as CandleQ8K, GgmlType};

    /// Byte for byte what candle's own quantization writes.
    #[test]
    fn matches_candle() {
        let xs: Vec<f32> = (0..3 * QK_K)
            .map(|i| pseudo(i) * 4.0 - if i == 300 { 9.0 } else { 0.0 })
            .collect();
        let mut ours = vec![BlockQ8K::ZERO; 3];
        quantize_row_q8k(&xs, &mut ours);
        let mut theirs = vec![CandleQ8K::zeros(); 3];
        CandleQ8K::from_float(&xs, &mut theirs);
        // SAFETY: both are repr(C) arrays of the same 292-byte layout; read as bytes.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(ours.as_ptr() as *const u8, 3 * 292),
                std::slice::from_raw_parts(theirs.as_ptr() as *const u8, 3 * 292),
            )
        };
        assert_eq!(a, b);
    }
}
