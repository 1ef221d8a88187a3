//! The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2): its `config.json` read through the
//! shared parser of every family (`config_fields::Base`) by Llama's rules (`Rules::LLAMA`:
//! `rope_theta` also in `rope_parameters`, Llama 3 RoPE scaling), then Llama's own hooks:
//! silu only, no MLP bias, Qwen2's q/k/v bias, Mistral's sliding window. Unknown
//! architectures, a missing `rope_theta` and unsupported options are errors that name the
//! file and the key, never silent defaults. [`LlamaConfig`] is the typed result
//! ([`crate::models::Llama`] keeps it).

use std::path::Path;

use candle_core::Result;
use serde::Deserialize;

use crate::models::architectures::{Architectures, SUPPORTED_ARCHITECTURES};
use crate::models::config_fields::{read_config, Base, Rules};
use crate::models::{DecoderConfig, FeedForward, LayerConfig};
use crate::nn::{AttentionConfig, Llama3RopeScaling, RmsNormSpec};

/// Architectures (`config.json` `architectures`) of the Llama family ([`crate::models::Llama`]);
/// [`crate::models::SUPPORTED_ARCHITECTURES`] lists every family's.
pub const LLAMA_ARCHITECTURES: [&str; 3] =
    ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"];

/// The keys the Llama family reads beyond the shared ones.
#[derive(Debug, Deserialize)]
struct Extra {
    mlp_bias: Option<bool>,
    use_sliding_window: Option<bool>,
}

/// The decoder settings of a Llama-family `config.json` whose architecture is `architecture`
/// (the family dispatch's entry, as `qwen3::config` is Qwen3's).
pub(crate) fn config(text: &str, origin: &str, architecture: &str) -> Result<DecoderConfig> {
    Ok(LlamaConfig::parse(text, origin, architecture)?.decoder())
}

/// A Llama-family model's settings, resolved from `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// The `architectures` entry (e.g. `LlamaForCausalLM`).
    pub architecture: String,
    /// Model width.
    pub hidden_size: usize,
    /// Width of the gated MLP.
    pub intermediate_size: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA when fewer than the query heads).
    pub num_key_value_heads: usize,
    /// Width of one head (`head_dim`, or `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// RmsNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base, from `rope_theta` or `rope_parameters.rope_theta`.
    pub rope_theta: f32,
    /// Llama 3 RoPE scaling, if the checkpoint has it.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// Whether the LM head shares the embedding table.
    pub tie_word_embeddings: bool,
    /// Whether q/k/v have a bias (Qwen2, or Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// Whether o_proj has a bias (Llama's `attention_bias`).
    pub o_bias: bool,
    /// `bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (one or several).
    pub eos_token_ids: Vec<u32>,
    /// Mistral's `sliding_window`: each query attends to at most this many positions (its own
    /// included). `None` for Llama, Qwen2 and Mistral checkpoints whose window is null.
    pub sliding_window: Option<usize>,
}

impl LlamaConfig {
    /// Reads and checks `path` (a `config.json`).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let (text, origin) = read_config(path.as_ref())?;
        Self::from_json(&text, &origin)
    }

    /// Parses and checks the JSON text of a `config.json`; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<Self> {
        let a = Architectures::parse(text, origin)?;
        let Some(architecture) = a.resolve() else {
            return Err(candle_core::Error::msg(format!(
                "{origin}: no 'architectures' and model_type {:?} is not one of llama, mistral, qwen2",
                a.model_type()
            )));
        };
        if !LLAMA_ARCHITECTURES.contains(&architecture.as_str()) {
            return Err(candle_core::Error::msg(format!(
                "{origin}: architecture '{architecture}' is not of the Llama family ({}); every \
                 family loads with CausalLm, which supports {}",
                LLAMA_ARCHITECTURES.join(", "),
                SUPPORTED_ARCHITECTURES.join(", ")
            )));
        }
        Self::parse(text, origin, &architecture)
    }

    /// The shared fields by Llama's rules, then the family's hooks.
    fn parse(text: &str, origin: &str, architecture: &str) -> Result<Self> {
        let base = Base::parse_with(text, origin, architecture, Rules::LLAMA)?;
        let x: Extra = serde_json::from_str(text).map_err(|e| base.error(e))?;
        if let Some(act) = base.raw.hidden_act.as_ref().filter(|v| !v.is_null()) {
            if act.as_str() != Some("silu") {
                return Err(base.error(format!("hidden_act {act} is not supported (only silu)")));
            }
        }
        if x.mlp_bias == Some(true) {
            return Err(base.error("mlp_bias = true is not supported"));
        }
        let attention_bias = base.raw.attention_bias.unwrap_or(false);
        let qwen2 = architecture == "Qwen2ForCausalLM";
        // Mistral applies `sliding_window` to every layer; Qwen2 only with use_sliding_window
        // (and then to some layers, by max_window_layers), Llama not at all.
        let sliding_window = match architecture {
            "MistralForCausalLM" => base.raw.sliding_window,
            "Qwen2ForCausalLM" if x.use_sliding_window == Some(true) => {
                return Err(base.error(
                    "use_sliding_window = true is not supported for Qwen2 (per-layer windows by max_window_layers)",
                ))
            }
            _ => None,
        };
        if sliding_window == Some(0) {
            return Err(base.error("sliding_window = 0: a query must see at least itself"));
        }
        let raw = &base.raw;
        Ok(Self {
            architecture: base.architecture.clone(),
            hidden_size: raw.hidden_size,
            intermediate_size: base.intermediate_size()?,
            vocab_size: raw.vocab_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads: base.num_kv_heads,
            head_dim: base.head_dim,
            rms_norm_eps: raw.rms_norm_eps,
            rope_theta: base.rope_theta as f32,
            rope_scaling: base.rope_scaling,
            max_position_embeddings: raw.max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias: qwen2 || attention_bias,
            o_bias: !qwen2 && attention_bias,
            bos_token_id: raw.bos_token_id,
            eos_token_ids: base.eos_token_ids.clone(),
            sliding_window,
        })
    }

    /// The attention layers' settings.
    pub fn attention(&self) -> AttentionConfig {
        AttentionConfig {
            qkv_bias: self.qkv_bias,
            o_bias: self.o_bias,
            rope_scaling: self.rope_scaling,
            sliding_window: self.sliding_window,
            ..AttentionConfig::new(
                self.hidden_size,
                self.num_attention_heads,
                self.num_key_value_heads,
                self.head_dim,
                self.rope_theta,
                self.max_position_embeddings,
            )
        }
    }

    /// The shared decoder's settings: every layer alike, SiLU gated MLP, plain RmsNorm.
    pub fn decoder(&self) -> DecoderConfig {
        let layer = LayerConfig {
            attention: self.attention(),
            feed_forward: FeedForward::Gated {
                intermediate_size: self.intermediate_size,
                act: candle_nn::Activation::Silu,
                fused: false,
            },
        };
        DecoderConfig {
            tie_word_embeddings: self.tie_word_embeddings,
            bos_token_id: self.bos_token_id,
            eos_token_ids: self.eos_token_ids.clone(),
            ..DecoderConfig::new(
                self.architecture.clone(),
                self.hidden_size,
                self.vocab_size,
                self.max_position_embeddings,
                RmsNormSpec::plain(self.rms_norm_eps),
                vec![layer; self.num_hidden_layers],
            )
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// The fields every test config shares (also the family registry's tests).
    pub(in crate::models) const BASE: &str = r#""hidden_size": 64, "intermediate_size": 96, "vocab_size": 100,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 128"#;

    pub(in crate::models) fn cfg(extra: &str) -> Result<LlamaConfig> {
        LlamaConfig::from_json(&format!("{{{BASE}{extra}}}"), "config.json")
    }

    #[test]
    fn rope_theta_top_level_or_nested_never_defaulted() -> Result<()> {
        let a = cfg(r#", "architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0"#)?;
        assert_eq!(a.rope_theta, 500000.0);
        let b = cfg(
            r#", "architectures": ["LlamaForCausalLM"], "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}"#,
        )?;
        assert_eq!(b.rope_theta, 100000.0);
        assert_eq!(b.head_dim, 8);
        let e = cfg(r#", "architectures": ["LlamaForCausalLM"]"#).unwrap_err();
        assert!(e.to_string().contains("rope_theta"), "{e}");
        Ok(())
    }

    #[test]
    fn llama3_scaling_qwen2_bias_and_bad_architecture() -> Result<()> {
        let c = cfg(
            r#", "architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#,
        )?;
        assert_eq!(c.rope_scaling.map(|s| s.factor), Some(8.0));
        let q = cfg(r#", "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1e6"#)?;
        assert!(q.qkv_bias && !q.o_bias);
        let e = cfg(r#", "architectures": ["GPT2LMHeadModel"], "rope_theta": 1e4"#).unwrap_err();
        assert!(e.to_string().contains("GPT2LMHeadModel"), "{e}");
        Ok(())
    }

    /// The error of `cfg(extra)`, checked to name the file and each of `words`.
    fn err_naming(extra: &str, words: &[&str]) {
        err_naming_in(BASE, extra, words)
    }

    /// As [`err_naming`], on the fields `base` instead of [`BASE`].
    fn err_naming_in(base: &str, extra: &str, words: &[&str]) {
        let e = match LlamaConfig::from_json(&format!("{{{base}{extra}}}"), "config.json") {
            Ok(c) => panic!("{extra}: accepted as {c:?}"),
            Err(e) => e.to_string(),
        };
        for w in ["config.json"].iter().chain(words) {
            assert!(e.contains(w), "{extra}: the error should name '{w}': {e}");
        }
    }

    const LLAMA: &str = r#", "architectures": ["LlamaForCausalLM"]"#;

    #[test]
    fn bad_configs_name_the_field_and_value() {
        err_naming(
            &format!(r#"{LLAMA}, "rope_theta": 1e4, "hidden_act": "gelu""#),
            &["hidden_act", "gelu", "silu"],
        );
        err_naming(
            &format!(r#"{LLAMA}, "rope_theta": 1e4, "mlp_bias": true"#),
            &["mlp_bias"],
        );
        err_naming(
            &format!(
                r#"{LLAMA}, "rope_theta": 10000.0, "rope_parameters": {{"rope_theta": 500000.0}}"#
            ),
            &["rope_theta", "10000", "500000"],
        );
        err_naming(
            &format!(
                r#"{LLAMA}, "rope_theta": 1e4, "rope_scaling": {{"rope_type": "llama3", "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#
            ),
            &["rope_scaling", "llama3", "factor"],
        );
        err_naming(
            &format!(
                r#"{LLAMA}, "rope_parameters": {{"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}}"#
            ),
            &["rope_parameters", "yarn"],
        );
        err_naming_in(
            &BASE.replace("128", "0"),
            &format!(r#"{LLAMA}, "rope_theta": 1e4"#),
            &["max_position_embeddings = 0"],
        );
        err_naming(r#", "model_type": "gpt2", "rope_theta": 1e4"#, &["gpt2"]);
        err_naming(
            r#", "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1e6, "use_sliding_window": true"#,
            &["use_sliding_window", "Qwen2"],
        );
        err_naming(
            r#", "architectures": ["MistralForCausalLM"], "rope_theta": 1e6, "sliding_window": 0"#,
            &["sliding_window = 0"],
        );
        err_naming_in(
            &BASE.replace(r#""num_key_value_heads": 2"#, r#""num_key_value_heads": 3"#),
            &format!(r#"{LLAMA}, "rope_theta": 1e4"#),
            &["num_attention_heads = 8", "num_key_value_heads = 3"],
        );
        // intermediate_size is required.
        let e = LlamaConfig::from_json(
            &format!(
                "{{{}{LLAMA}, \"rope_theta\": 1e4}}",
                BASE.replace(r#""intermediate_size": 96,"#, "")
            ),
            "config.json",
        )
        .unwrap_err();
        assert!(e.to_string().contains("intermediate_size"), "{e}");
    }

    #[test]
    fn accepted_variants() -> Result<()> {
        // model_type stands in for a missing `architectures`.
        let m = cfg(r#", "model_type": "mistral", "rope_theta": 1e6, "sliding_window": 32"#)?;
        assert_eq!(m.architecture, "MistralForCausalLM");
        assert_eq!(m.sliding_window, Some(32));
        // Llama and Qwen2 never apply a window, whatever its value.
        for extra in [
            r#", "architectures": ["LlamaForCausalLM"], "rope_theta": 1e4, "sliding_window": 0"#,
            r#", "model_type": "qwen2", "rope_theta": 1e4, "sliding_window": 0, "use_sliding_window": false"#,
            r#", "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1e4, "sliding_window": 4096"#,
        ] {
            assert_eq!(cfg(extra)?.sliding_window, None, "{extra}");
        }
        // `type` for `rope_type`, a default-type scaling, Llama 3 scaling in rope_parameters.
        let t = cfg(&format!(
            r#"{LLAMA}, "rope_theta": 5e5, "rope_scaling": {{"type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}"#
        ))?;
        assert_eq!(
            t.rope_scaling,
            Some(Llama3RopeScaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 64
            })
        );
        let d = cfg(&format!(
            r#"{LLAMA}, "rope_theta": 5e5, "rope_scaling": {{"rope_type": "default"}}"#
        ))?;
        assert_eq!(d.rope_scaling, None);
        let n = cfg(&format!(
            r#"{LLAMA}, "rope_parameters": {{"rope_theta": 5e5, "rope_type": "llama3", "factor": 2.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}"#
        ))?;
        assert_eq!(
            (n.rope_theta, n.rope_scaling.map(|s| s.factor)),
            (5e5, Some(2.0))
        );
        // Llama's attention_bias is on q, k, v and o; silu may be named; eos ids.
        let b = cfg(&format!(
            r#"{LLAMA}, "rope_theta": 1e4, "attention_bias": true, "hidden_act": "silu",
            "eos_token_id": [1, 2], "bos_token_id": 0, "tie_word_embeddings": true, "head_dim": 16"#
        ))?;
        assert!(b.qkv_bias && b.o_bias && b.tie_word_embeddings);
        assert_eq!(
            (b.eos_token_ids.clone(), b.bos_token_id),
            (vec![1, 2], Some(0))
        );
        assert_eq!((b.head_dim, b.num_key_value_heads), (16, 2));
        let q = cfg(
            r#", "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1e6, "attention_bias": true"#,
        )?;
        assert!(q.qkv_bias && !q.o_bias && !q.tie_word_embeddings);
        Ok(())
    }
}
