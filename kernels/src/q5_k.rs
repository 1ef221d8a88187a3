//! Q5_K (ggml's `block_q5_K`) against Q8_K, accumulated in f64.
//!
//! A super-block of 256 weights: 8 sub-blocks of 32, each with a 6-bit scale `sc` and a 6-bit
//! minimum `mn` (packed into 12 bytes, as Q4_K), and f16 super-scales `d`, `dmin`:
//! `w = d · sc · q − dmin · mn` with 5-bit `q` (a nibble as in Q4_K plus 16 for its bit in
//! `qh`). Against a Q8_K block `x = d' · q'`:
//! `Σ w·x = d' · (d · Σ_j sc_j Σ q·q' − dmin · Σ_j mn_j Σ q')`, two exact integers per block.

use crate::f64_dot::F64Dot;
use crate::q4_k::{combine_k4, scale_min};
use crate::q8_k::{quantize_row_q8k, BlockQ8K, QK_K};
use half::f16;

/// One Q5_K super-block (176 bytes, as GGUF stores it).
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ5K {
    /// Super-scale of the sub-block scales.
    pub d: f16,
    /// Super-scale of the sub-block minimums.
    pub dmin: f16,
    /// 8 scales and 8 minimums of 6 bits.
    pub scales: [u8; 12],
    /// The values' fifth bits: bit `2 j` of byte `l` is 16 for value `64 j + l`, bit `2 j + 1`
    /// for value `64 j + 32 + l`.
    pub qh: [u8; QK_K / 8],
    /// The values' low 4 bits: byte `32 j + l` holds value `64 j + l` (low nibble) and
    /// `64 j + 32 + l`.
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);

// SAFETY: repr(C) plain data (f16 is a transparent u16), every bit pattern valid.
unsafe impl F64Dot for BlockQ5K {
    type Act = BlockQ8K;
    const BLOCK: usize = QK_K;
    const NAME: &'static str = "Q5_K";
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
                let h = w.qh[l] >> (2 * j);
                lo += ((q[l] & 0xF) | ((h & 1) << 4)) as i32 * a[l] as i32;
                hi += ((q[l] >> 4) | ((h & 2) << 3)) as i32 * a[32 + l] as i32;
            }
            dots += scale_min(2 * j, &w.scales).0 * lo + scale_min(2 * j + 1, &w.scales).0 * hi;
        }
        combine(w, x, dots)
    }
}

/// The block's product from its scaled integer dot product: the minimums' term added here.
#[inline(always)]
fn combine(w: &BlockQ5K, x: &BlockQ8K, dots: i32) -> f64 {
    combine_k4((w.d, w.dmin, &w.scales), x, dots)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f64_dot::testing::{
        check_against_candle, nan_and_inf_activations_propagate, pseudo, pseudo_bytes,
        split_sums_round_alike,
    };
    use candle_core::quantized::GgmlDType;

    #[test]
    fn f64_dot_is_the_dot_of_candles_dequantized_blocks() {
        check_against_candle::<BlockQ5K>(
            GgmlDType::Q5K,
            |x| x.qs.iter().map(|&q| x.d as f64 * q as f64).collect(),
            |_, _| 0.0,
            1e-12,
        );
    }

    /// Pseudo-random blocks (every 5-bit value and scale pattern, minimums' scales of both
    /// signs): every kernel gives the same bits, however the row is split.
    #[test]
    fn kernels_agree_on_every_bit_pattern() {
        split_sums_round_alike(|i| BlockQ5K {
            d: f16::from_f32(0.002 + 0.001 * pseudo(i)),
            dmin: f16::from_f32(0.003 * pseudo(i + 7)),
            scales: pseudo_bytes(i + 11),
            qh: pseudo_bytes(i + 3000),
            qs: pseudo_bytes(i + 5000),
        });
    }

    #[test]
    fn nan_and_inf_activations_give_nan() {
        nan_and_inf_activations_propagate::<BlockQ5K>(GgmlDType::Q5K);
    }
}
