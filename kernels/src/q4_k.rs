//! Q4_K (ggml's `block_q4_K`) against Q8_K, accumulated in f64.
//!
//! A super-block of 256 weights: 8 sub-blocks of 32, each with a 6-bit scale `sc` and a 6-bit
//! minimum `mn` (packed into 12 bytes), and f16 super-scales `d`, `dmin`:
//! `w = d · sc · q − dmin · mn` with 4-bit `q`. Against a Q8_K block `x = d' · q'`:
//! `Σ w·x = d' · (d · Σ_j sc_j Σ q·q' − dmin · Σ_j mn_j Σ q')`, two exact integers per block.

use crate::f64_dot::F64Dot;
use crate::q8_k::{quantize_row_q8k, BlockQ8K, QK_K};
use half::f16;

/// One Q4_K super-block (144 bytes, as GGUF stores it).
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ4K {
    /// Super-scale of the sub-block scales.
    pub d: f16,
    /// Super-scale of the sub-block minimums.
    pub dmin: f16,
    /// 8 scales and 8 minimums of 6 bits.
    pub scales: [u8; 12],
    /// 4-bit values: byte `32 j + l` holds value `64 j + l` (low nibble) and `64 j + 32 + l`.
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);

/// Scale and minimum of sub-block `j` (ggml's `get_scale_min_k4`; Q5_K packs them alike).
#[inline(always)]
pub(crate) fn scale_min(j: usize, q: &[u8; 12]) -> (i32, i32) {
    if j < 4 {
        ((q[j] & 63) as i32, (q[j + 4] & 63) as i32)
    } else {
        (
            ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)) as i32,
            ((q[j + 4] >> 4) | ((q[j] >> 6) << 4)) as i32,
        )
    }
}

// SAFETY: repr(C) plain data (f16 is a transparent u16), every bit pattern valid.
unsafe impl F64Dot for BlockQ4K {
    type Act = BlockQ8K;
    const BLOCK: usize = QK_K;
    const NAME: &'static str = "Q4_K";
    const ACT_ZERO: Self::Act = BlockQ8K::ZERO;

    fn quantize(xs: &[f32], ys: &mut [Self::Act]) {
        quantize_row_q8k(xs, ys)
    }

    #[inline(always)]
    fn block_dot(w: &Self, x: &Self::Act) -> f64 {
        let mut dots = 0i32;
        for j in 0..QK_K / 64 {
            let q = &w.qs[32 * j..32 * j + 32];
            let a = &x.qs[64 * j..64 * j + 64];
            let (mut lo, mut hi) = (0i32, 0i32);
            for l in 0..32 {
                lo += (q[l] & 0xF) as i32 * a[l] as i32;
                hi += (q[l] >> 4) as i32 * a[32 + l] as i32;
            }
            dots += scale_min(2 * j, &w.scales).0 * lo + scale_min(2 * j + 1, &w.scales).0 * hi;
        }
        combine(w, x, dots)
    }
}

/// The block's product from its scaled integer dot product: the minimums' term added here.
#[inline(always)]
fn combine(w: &BlockQ4K, x: &BlockQ8K, dots: i32) -> f64 {
    combine_k4((w.d, w.dmin, &w.scales), x, dots)
}

/// A Q4_K-like block's (Q4_K, Q5_K) product from its super-scales and packed scales, the
/// activation block and the scaled integer dot product: `d'·(d·dots − dmin·Σ mn·bsums)`.
#[inline(always)]
pub(crate) fn combine_k4((d, dmin, scales): (f16, f16, &[u8; 12]), x: &BlockQ8K, dots: i32) -> f64 {
    let mut mins = 0i32;
    for j in 0..QK_K / 16 {
        mins += x.bsums[j] as i32 * scale_min(j / 2, scales).1;
    }
    x.d as f64 * (d.to_f64() * dots as f64 - dmin.to_f64() * mins as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f64_dot::testing::{check_against_candle, nan_and_inf_activations_propagate};
    use candle_core::quantized::GgmlDType;

    #[test]
    fn f64_dot_is_the_dot_of_candles_dequantized_blocks() {
        check_against_candle::<BlockQ4K>(
            GgmlDType::Q4K,
            |x| x.qs.iter().map(|&q| x.d as f64 * q as f64).collect(),
            |_, _| 0.0,
            1e-12,
        );
    }

    #[test]
    fn nan_and_inf_activations_give_nan() {
        nan_and_inf_activations_propagate::<BlockQ4K>(GgmlDType::Q4K);
    }
}
