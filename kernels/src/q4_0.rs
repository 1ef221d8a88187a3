//! Q4_0 (ggml's `block_q4_0`): 32 weights as 4-bit values around 8 with an f16 scale, against
//! Q8_0 activations, summed in f64 ([`crate::f64_dot`]).
//!
//! `w[j] = d · (q[j] − 8)`, low nibbles holding values 0..16 and high nibbles 16..32. Against a
//! Q8_0 block `x[j] = d' · q'[j]`: `Σ w·x = d·d' · Σ (q − 8)·q'`, each block's product exact
//! in f64 and the blocks added in order ([`F64Dot`]), so a row's value does not depend on how
//! its blocks are split between ranks. The matmuls repack the weight four rows at a time and
//! run the engines of [`crate::repack`] ([`crate::q4_0x4`] describes the type to them), which
//! give these sums bit for bit (tested).

use crate::f64_dot::F64Dot;
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
}
