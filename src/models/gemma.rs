//! Gemma 2 and Gemma 3 (text): `(1 + w)` RmsNorms, embeddings scaled by `sqrt(hidden_size)`,
//! sandwich norms around attention and MLP, scores scaled by `query_pre_attn_scalar^-1/2`,
//! attention and final-logit soft-capping (Gemma 2), per-head q/k norms (Gemma 3), and
//! alternating local (sliding-window) and global layers, which in Gemma 3 have their own RoPE
//! bases (`rope_local_base_freq`, `rope_theta`). The LM head is the tied, vocabulary-parallel
//! embedding.

use candle_core::Result;
use serde::Deserialize;

use crate::models::config_fields::Base;
use crate::models::{DecoderConfig, FeedForward, LayerConfig};
use crate::nn::RmsNormSpec;

#[derive(Debug, Deserialize)]
struct Extra {
    query_pre_attn_scalar: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    final_logit_softcapping: Option<f64>,
    rope_local_base_freq: Option<f64>,
    sliding_window_pattern: Option<usize>,
    layer_types: Option<Vec<String>>,
}

/// Whether layer `i` of a Gemma model uses local (sliding-window) attention: `layer_types`
/// when the config lists them, else Gemma 2's even layers and Gemma 3's all but every
/// `sliding_window_pattern`-th layer, as Hugging Face transformers decides.
fn is_local(base: &Base, x: &Extra, gemma3: bool, i: usize) -> Result<bool> {
    if let Some(types) = &x.layer_types {
        return match types.get(i).map(String::as_str) {
            Some("sliding_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            other => Err(base.error(format!("layer_types[{i}] = {other:?} is not supported"))),
        };
    }
    if !gemma3 {
        return Ok(i.is_multiple_of(2));
    }
    match x.sliding_window_pattern {
        Some(0) | None => Err(base
            .error("Gemma3: neither 'layer_types' nor a positive 'sliding_window_pattern' is set")),
        Some(p) => Ok(!(i + 1).is_multiple_of(p)),
    }
}

/// The decoder settings of a `Gemma2ForCausalLM` or `Gemma3ForCausalLM` `config.json`.
pub fn config(text: &str, origin: &str, architecture: &str) -> Result<DecoderConfig> {
    let base = Base::parse(text, origin, architecture)?;
    let x: Extra = serde_json::from_str(text).map_err(|e| base.error(e))?;
    let gemma3 = architecture == "Gemma3ForCausalLM";
    if let Some(t) = &x.layer_types {
        if t.len() != base.raw.num_hidden_layers {
            return Err(base.error(format!(
                "layer_types has {} entries for {} layers",
                t.len(),
                base.raw.num_hidden_layers
            )));
        }
    }
    let scalar = x
        .query_pre_attn_scalar
        .filter(|s| *s > 0.0)
        .ok_or_else(|| base.error("'query_pre_attn_scalar' is not set or not positive"))?;
    let local_theta = if gemma3 {
        x.rope_local_base_freq
            .ok_or_else(|| base.error("'rope_local_base_freq' is not set (Gemma3)"))?
    } else {
        base.rope_theta
    };
    let norm = RmsNormSpec::gemma(base.raw.rms_norm_eps);
    let mut global = base.attention();
    global.softmax_scale = Some(1.0 / scalar.sqrt());
    global.logit_softcapping = x.attn_logit_softcapping;
    global.qk_norm = gemma3.then_some(norm);
    let mut local = global.clone();
    local.sliding_window = base.raw.sliding_window;
    local.rope_theta = local_theta as f32;
    let ff = FeedForward::Gated {
        intermediate_size: base.intermediate_size()?,
        act: base.activation(None)?,
        fused: false,
    };
    let layers = (0..base.raw.num_hidden_layers)
        .map(|i| {
            Ok(LayerConfig {
                attention: if is_local(&base, &x, gemma3, i)? {
                    local.clone()
                } else {
                    global.clone()
                },
                feed_forward: ff.clone(),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut cfg = base.decoder(layers, norm, true);
    cfg.embedding_multiplier = Some((base.raw.hidden_size as f64).sqrt());
    cfg.final_logit_softcapping = x.final_logit_softcapping;
    cfg.sandwich_norms = true;
    Ok(cfg)
}
