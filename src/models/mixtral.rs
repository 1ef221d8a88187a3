//! Mixtral: Mistral's attention (with its sliding window, if set) and a sparse MoE layer
//! `block_sparse_moe` (router `gate`, experts `experts.N.{w1,w3,w2}`), top-k weights
//! renormalised.

use candle_core::Result;
use serde::Deserialize;

use crate::models::config_fields::Base;
use crate::models::{DecoderConfig, FeedForward, LayerConfig};
use crate::nn::{MoeConfig, RmsNormSpec};

#[derive(Debug, Deserialize)]
struct Extra {
    num_local_experts: usize,
    num_experts_per_tok: usize,
}

/// The decoder settings of a `MixtralForCausalLM` `config.json`.
pub fn config(text: &str, origin: &str) -> Result<DecoderConfig> {
    let base = Base::parse(text, origin, "MixtralForCausalLM")?;
    let x: Extra = serde_json::from_str(text).map_err(|e| base.error(e))?;
    let mut attention = base.attention();
    attention.sliding_window = base.raw.sliding_window;
    let moe = MoeConfig {
        hidden_size: base.raw.hidden_size,
        intermediate_size: base.intermediate_size()?,
        num_experts: x.num_local_experts,
        num_experts_per_tok: x.num_experts_per_tok,
        norm_topk_prob: true,
        act: base.activation(None)?,
        router: "gate".into(),
        expert_names: ["w1".into(), "w3".into(), "w2".into()],
    };
    let layer = LayerConfig {
        attention,
        feed_forward: FeedForward::Moe(moe),
    };
    let layers = vec![layer; base.raw.num_hidden_layers];
    let mut cfg = base.decoder(layers, RmsNormSpec::plain(base.raw.rms_norm_eps), false);
    cfg.feed_forward_name = "block_sparse_moe".into();
    Ok(cfg)
}
