//! Phi-3: the Llama layout with fused projections. `qkv_proj` holds q, k and v rows and
//! `gate_up_proj` the gate then the up rows; each rank reads its q, k, v and gate, up row
//! ranges out of the one tensor, so no rank loads another's rows. Phi-4-mini (same
//! architecture) adds partial RoPE (`partial_rotary_factor`) and a tied head.

use candle_core::Result;
use serde::Deserialize;

use crate::models::config_fields::Base;
use crate::models::{DecoderConfig, FeedForward, LayerConfig};
use crate::nn::RmsNormSpec;

#[derive(Debug, Deserialize)]
struct Extra {
    partial_rotary_factor: Option<f64>,
}

/// The decoder settings of a `Phi3ForCausalLM` `config.json`.
pub fn config(text: &str, origin: &str) -> Result<DecoderConfig> {
    let base = Base::parse(text, origin, "Phi3ForCausalLM")?;
    let x: Extra = serde_json::from_str(text).map_err(|e| base.error(e))?;
    let mut attention = base.attention();
    attention.fused_qkv = true;
    attention.sliding_window = base.raw.sliding_window;
    if let Some(f) = x.partial_rotary_factor.filter(|f| *f != 1.0) {
        // As Hugging Face: the rotated width is int(head_dim * factor).
        let rot = (base.head_dim as f64 * f) as usize;
        if !(f > 0.0 && f < 1.0) || rot == 0 || !rot.is_multiple_of(2) {
            return Err(base.error(format!(
                "partial_rotary_factor = {f} with head_dim = {} gives a rotated width of {rot}: it must be even and positive",
                base.head_dim
            )));
        }
        attention.rotary_dim = Some(rot);
    }
    let layer = LayerConfig {
        attention,
        feed_forward: FeedForward::Gated {
            intermediate_size: base.intermediate_size()?,
            act: base.activation(None)?,
            fused: true,
        },
    };
    let layers = vec![layer; base.raw.num_hidden_layers];
    Ok(base.decoder(layers, RmsNormSpec::plain(base.raw.rms_norm_eps), false))
}
