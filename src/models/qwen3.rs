//! Qwen3 and Qwen3-MoE: the Llama layout plus a per-head RmsNorm of queries and keys
//! (`q_norm`, `k_norm`: one replicated `[head_dim]` weight applied to each local head), and
//! for Qwen3-MoE sparse MoE layers (`mlp.gate`, `mlp.experts.N.{gate,up,down}_proj`).

use candle_core::Result;
use serde::Deserialize;

use crate::models::config_fields::Base;
use crate::models::{DecoderConfig, FeedForward, LayerConfig};
use crate::nn::{MoeConfig, RmsNormSpec};

#[derive(Debug, Deserialize)]
struct Extra {
    use_sliding_window: Option<bool>,
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
}

/// The decoder settings of a `Qwen3ForCausalLM` or `Qwen3MoeForCausalLM` `config.json`.
pub fn config(text: &str, origin: &str, architecture: &str) -> Result<DecoderConfig> {
    let base = Base::parse(text, origin, architecture)?;
    let x: Extra = serde_json::from_str(text).map_err(|e| base.error(e))?;
    if x.use_sliding_window == Some(true) {
        return Err(base.error(format!(
            "use_sliding_window = true is not supported for {architecture}"
        )));
    }
    let act = base.activation(None)?;
    let mut attention = base.attention();
    attention.o_bias = false;
    attention.qk_norm = Some(RmsNormSpec::plain(base.raw.rms_norm_eps));
    let dense = FeedForward::Gated {
        intermediate_size: base.intermediate_size()?,
        act,
        fused: false,
    };
    let moe = if architecture == "Qwen3MoeForCausalLM" {
        let need = |v: Option<usize>, key: &str| {
            v.ok_or_else(|| base.error(format!("'{key}' is not set ({architecture})")))
        };
        let step = x.decoder_sparse_step.unwrap_or(1);
        if step == 0 {
            return Err(base.error("decoder_sparse_step = 0"));
        }
        Some((
            MoeConfig {
                hidden_size: base.raw.hidden_size,
                intermediate_size: need(x.moe_intermediate_size, "moe_intermediate_size")?,
                num_experts: need(x.num_experts, "num_experts")?,
                num_experts_per_tok: need(x.num_experts_per_tok, "num_experts_per_tok")?,
                norm_topk_prob: x.norm_topk_prob.unwrap_or(false),
                act,
                router: "gate".into(),
                expert_names: ["gate_proj".into(), "up_proj".into(), "down_proj".into()],
            },
            step,
            x.mlp_only_layers.unwrap_or_default(),
        ))
    } else {
        None
    };
    let layers = (0..base.raw.num_hidden_layers)
        .map(|i| LayerConfig {
            attention: attention.clone(),
            feed_forward: match &moe {
                Some((m, step, dense_only))
                    if m.num_experts > 0 && (i + 1) % step == 0 && !dense_only.contains(&i) =>
                {
                    FeedForward::Moe(m.clone())
                }
                _ => dense.clone(),
            },
        })
        .collect();
    Ok(base.decoder(layers, RmsNormSpec::plain(base.raw.rms_norm_eps), false))
}
