//! Rotary position embeddings (RoPE): precomputed `cos`/`sin` tables, Llama 3 frequency
//! scaling and partial rotation.

use std::f32::consts::PI;

use candle_core::{DType, Device, Result, Tensor};

use crate::nn::AttentionConfig;

/// Precomputed rotary tables `cos`/`sin`, `[max_positions, head_dim / 2]` (shared by all
/// layers; the math of candle-transformers' `llama.rs`).
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    cos: Tensor,
    sin: Tensor,
}

impl RotaryEmbedding {
    /// Tables for `cfg` in `dtype` on `device`.
    pub fn new(cfg: &AttentionConfig, dtype: DType, device: &Device) -> Result<Self> {
        let hd = cfg.rotary_dim.unwrap_or(cfg.head_dim);
        if hd == 0 || !hd.is_multiple_of(2) || hd > cfg.head_dim {
            candle_core::bail!(
                "rotary embedding: the rotated width {hd} must be even, positive and at most head_dim = {}",
                cfg.head_dim
            );
        }
        let base: Vec<f32> = (0..hd)
            .step_by(2)
            .map(|i| 1f32 / cfg.rope_theta.powf(i as f32 / hd as f32))
            .collect();
        let inv_freq = match cfg.rope_scaling {
            None => base,
            Some(s) => {
                let orig = s.original_max_position_embeddings as f32;
                let low_freq_wavelen = orig / s.low_freq_factor;
                let high_freq_wavelen = orig / s.high_freq_factor;
                base.into_iter()
                    .map(|freq| {
                        let wavelen = 2. * PI / freq;
                        if wavelen < high_freq_wavelen {
                            freq
                        } else if wavelen > low_freq_wavelen {
                            freq / s.factor
                        } else {
                            let smooth = (orig / wavelen - s.low_freq_factor)
                                / (s.high_freq_factor - s.low_freq_factor);
                            (1. - smooth) * freq / s.factor + smooth * freq
                        }
                    })
                    .collect()
            }
        };
        let n = inv_freq.len();
        let theta = Tensor::new(inv_freq, device)?;
        let max = cfg.max_position_embeddings;
        let idx_theta = Tensor::arange(0, max as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((max, 1))?
            .matmul(&theta.reshape((1, n))?)?;
        Ok(Self {
            cos: idx_theta.cos()?.to_dtype(dtype)?,
            sin: idx_theta.sin()?.to_dtype(dtype)?,
        })
    }

    /// The device the tables live on.
    pub fn device(&self) -> &Device {
        self.cos.device()
    }

    /// Positions the tables cover.
    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// Rotates `x` `[batch, heads, seq, head_dim]` for positions `index_pos..index_pos+seq`.
    pub fn apply(&self, x: &Tensor, index_pos: usize) -> Result<Tensor> {
        let (_, _, seq_len, _) = x.dims4()?;
        if index_pos + seq_len > self.max_positions() {
            candle_core::bail!(
                "rotary embedding: positions {index_pos}..{} exceed max_position_embeddings = {}",
                index_pos + seq_len,
                self.max_positions()
            );
        }
        let cos = self.cos.narrow(0, index_pos, seq_len)?;
        let sin = self.sin.narrow(0, index_pos, seq_len)?;
        let rot = 2 * self.cos.dims()[1];
        let hd = x.dims()[3];
        if rot == hd {
            return candle_nn::rotary_emb::rope(x, &cos, &sin);
        }
        // Partial RoPE: rotate the first `rot` features, pass the rest through.
        let rotated = candle_nn::rotary_emb::rope(&x.narrow(3, 0, rot)?.contiguous()?, &cos, &sin)?;
        Tensor::cat(&[&rotated, &x.narrow(3, rot, hd - rot)?], 3)?.contiguous()
    }
}
