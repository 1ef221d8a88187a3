//! RmsNorm as the decoder families store it: Llama's `x / rms(x) * w`, or Gemma's
//! `x / rms(x) * (1 + w)` (the checkpoint holds `w`, the scale is `1 + w`). Norm weights are
//! replicated on every rank.

use candle_core::{Module, Result, Tensor};

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

/// RmsNorm `x / rms(x) · w` over the last dimension: `candle_nn::RmsNorm`'s layer, computed
/// as llama.cpp computes it on the CPU in f32 ([`crate::ops::rms_norm`]: the squares summed
/// in f64), so that a GGUF model's activations are llama.cpp's to the last bit before they
/// are quantized for the next product.
///
/// ```
/// use candle_core::{Device, Module, Tensor};
/// let w = Tensor::new(&[1f32, 2., 1., 2.], &Device::Cpu)?;
/// let norm = candle_tp::nn::RmsNorm::new(w, 0.0);
/// let y = norm.forward(&Tensor::new(&[[3f32, -3., 3., -3.]], &Device::Cpu)?)?;
/// assert_eq!(y.to_vec2::<f32>()?, [[1f32, -2., 1., -2.]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// The norm with scale `weight` (`[size]`) and `eps` added to the mean square.
    pub fn new(weight: Tensor, eps: f64) -> Self {
        Self { weight, eps }
    }

    /// The scale.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The epsilon added to the mean square.
    pub fn eps(&self) -> f64 {
        self.eps
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        crate::ops::rms_norm(x, &self.weight, self.eps)
    }
}

/// Loads `weight` (`[size]`, replicated) from `vb` as an [`RmsNorm`] whose weight is the
/// scale (`w + weight_offset`, computed once at load).
pub fn load_rms_norm(size: usize, spec: RmsNormSpec, vb: &ShardedVarBuilder) -> Result<RmsNorm> {
    let w = vb.get(size, "weight")?;
    let w = if spec.weight_offset != 0.0 {
        (w + spec.weight_offset)?
    } else {
        w
    };
    Ok(RmsNorm::new(w, spec.eps))
}
