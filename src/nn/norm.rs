//! RmsNorm as the decoder families store it: Llama's `x / rms(x) * w`, or Gemma's
//! `x / rms(x) * (1 + w)` (the checkpoint holds `w`, the scale is `1 + w`). Norm weights are
//! replicated on every rank.

use candle_core::Result;
use candle_nn::RmsNorm;

use crate::loader::ShardedVarBuilder;

/// How an RmsNorm is parameterised.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsNormSpec {
    /// Epsilon added to the mean square.
    pub eps: f64,
    /// Added to the stored weight to get the scale: 0 (Llama, Qwen) or 1 (Gemma's `1 + w`).
    pub weight_offset: f64,
}

impl RmsNormSpec {
    /// Llama's norm: the stored weight is the scale.
    pub fn plain(eps: f64) -> Self {
        Self {
            eps,
            weight_offset: 0.0,
        }
    }

    /// Gemma's norm: the scale is `1 + w`.
    pub fn gemma(eps: f64) -> Self {
        Self {
            eps,
            weight_offset: 1.0,
        }
    }
}

/// Loads `weight` (`[size]`, replicated) from `vb` as a `candle_nn::RmsNorm` whose weight is
/// the scale (`w + weight_offset`, computed once at load).
pub fn load_rms_norm(size: usize, spec: RmsNormSpec, vb: &ShardedVarBuilder) -> Result<RmsNorm> {
    let w = vb.get(size, "weight")?;
    let w = if spec.weight_offset != 0.0 {
        (w + spec.weight_offset)?
    } else {
        w
    };
    Ok(RmsNorm::new(w, spec.eps))
}
