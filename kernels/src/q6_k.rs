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
