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

    /// Rotates the rows of `x` `[1, rows, heads, head_dim]` (rows first, as the projections
    /// give them), row `i` for position `positions[i]`: several sequences' new tokens at their
    /// own positions in one op (a batched decode step). The same values as [`Self::apply`] on
    /// each row alone. Inference only (no backward).
    pub fn apply_rows(&self, x: &Tensor, positions: &[usize]) -> Result<Tensor> {
        let (_, rows, _, hd) = x.dims4()?;
        if positions.len() != rows {
            candle_core::bail!(
                "rotary embedding: {rows} rows but {} positions",
                positions.len()
            );
        }
        if let Some(&p) = positions.iter().find(|&&p| p >= self.max_positions()) {
            candle_core::bail!(
                "rotary embedding: position {p} exceeds max_position_embeddings = {}",
                self.max_positions()
            );
        }
        let at: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        let at = Tensor::new(at.as_slice(), self.cos.device())?;
        let cos = self.cos.index_select(&at, 0)?;
        let sin = self.sin.index_select(&at, 0)?;
        let rot = 2 * self.cos.dims()[1];
        let x = x.contiguous()?;
        if rot == hd {
            return candle_nn::rotary_emb::rope_thd(&x, &cos, &sin);
        }
        let rotated =
            candle_nn::rotary_emb::rope_thd(&x.narrow(3, 0, rot)?.contiguous()?, &cos, &sin)?;
        Tensor::cat(&[&rotated, &x.narrow(3, rot, hd - rot)?], 3)?.contiguous()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(head_dim: usize, rotary_dim: Option<usize>) -> AttentionConfig {
        AttentionConfig {
            hidden_size: 4 * head_dim,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim,
            qkv_bias: false,
            o_bias: false,
            rope_theta: 10_000.0,
            rope_scaling: None,
            max_position_embeddings: 64,
            sliding_window: None,
            qk_norm: None,
            softmax_scale: None,
            logit_softcapping: None,
            fused_qkv: false,
            rotary_dim,
        }
    }

    /// Rows at their own positions in one op give, bit for bit, each row rotated alone by
    /// `apply` (full and partial rotation); a position past the table is an error naming it.
    #[test]
    fn rows_at_their_positions_equal_each_row_alone() -> Result<()> {
        let dev = Device::Cpu;
        for rotary_dim in [None, Some(8)] {
            let rope = RotaryEmbedding::new(&config(16, rotary_dim), DType::F32, &dev)?;
            let positions = [5usize, 0, 63, 17];
            let x = Tensor::randn(0f32, 1.0, (1, 4, 3, 16), &dev)?;
            let all = rope.apply_rows(&x, &positions)?;
            for (i, &p) in positions.iter().enumerate() {
                // `apply` wants [batch, heads, seq, head_dim].
                let row = x.narrow(1, i, 1)?.transpose(1, 2)?.contiguous()?;
                let alone = rope.apply(&row, p)?.transpose(1, 2)?;
                let got = all.narrow(1, i, 1)?;
                let (a, b) = (
                    alone.flatten_all()?.to_vec1::<f32>()?,
                    got.flatten_all()?.to_vec1::<f32>()?,
                );
                assert!(a.iter().all(|v| v.is_finite()));
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&a),
                    bits(&b),
                    "row {i} at {p}, rotary_dim {rotary_dim:?}"
                );
                // The rotation moved the row (position 0 leaves it as it is).
                let x_row = x.narrow(1, i, 1)?.flatten_all()?.to_vec1::<f32>()?;
                assert_eq!(p == 0, bits(&x_row) == bits(&b), "row {i} at {p}");
            }
        }
        let rope = RotaryEmbedding::new(&config(16, None), DType::F32, &dev)?;
        let x = Tensor::zeros((1, 2, 3, 16), DType::F32, &dev)?;
        let e = rope.apply_rows(&x, &[1, 64]).unwrap_err().to_string();
        assert!(e.contains("position 64") && e.contains("64"), "{e}");
        let e = rope.apply_rows(&x, &[1]).unwrap_err().to_string();
        assert!(e.contains("2 rows but 1 positions"), "{e}");
        Ok(())
    }
}
