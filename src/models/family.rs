//! The family registry: which family parses a checkpoint's `config.json` (by its
//! `architectures`, or a known `model_type`), and the decoder's entry points that go through
//! it ([`DecoderConfig::from_file`], [`CausalLm`]'s [`FromCheckpoint`]). It imports the
//! families; none imports it. The fields every family shares are read in
//! `config_fields.rs`, the architecture names in `architectures.rs`.

use std::path::Path;

use candle_core::Result;

use crate::loader::ShardedVarBuilder;
use crate::models::architectures::Architectures;
use crate::models::config_fields::read_config;
use crate::models::{
    gemma, llama_config, mixtral, phi3, qwen3, CausalLm, DecoderConfig, FromCheckpoint,
};

pub use crate::models::architectures::SUPPORTED_ARCHITECTURES;

/// Reads `path` (a `config.json`) with its family's parser.
pub fn config_from_file(path: impl AsRef<Path>) -> Result<DecoderConfig> {
    let (text, origin) = read_config(path.as_ref())?;
    config_from_json(&text, &origin)
}

/// Parses the JSON text of a `config.json` with the family its `architectures` (or, without
/// it, `model_type`) names; `origin` names the file in errors.
pub fn config_from_json(text: &str, origin: &str) -> Result<DecoderConfig> {
    let a = Architectures::parse(text, origin)?;
    let arch = a.resolve().unwrap_or_else(|| match a.model_type() {
        Some(t) => format!("model_type '{t}'"),
        None => String::from("<none>"),
    });
    match arch.as_str() {
        "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM" => {
            llama_config::config(text, origin, &arch)
        }
        "Qwen3ForCausalLM" | "Qwen3MoeForCausalLM" => qwen3::config(text, origin, &arch),
        "Gemma2ForCausalLM" | "Gemma3ForCausalLM" => gemma::config(text, origin, &arch),
        "Phi3ForCausalLM" => phi3::config(text, origin),
        "MixtralForCausalLM" => mixtral::config(text, origin),
        other => Err(candle_core::Error::msg(format!(
            "{origin}: unsupported architecture '{other}' (supported: {})",
            SUPPORTED_ARCHITECTURES.join(", ")
        ))),
    }
}

impl DecoderConfig {
    /// Reads `path` (a `config.json`) with the family its `architectures` names.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        config_from_file(path)
    }
}

impl FromCheckpoint for CausalLm {
    fn from_config_json(text: &str, origin: &str, vb: ShardedVarBuilder) -> Result<Self> {
        Self::load(&config_from_json(text, origin)?, vb)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::llama_config::tests::{cfg, BASE};
    use candle_core::Result;

    /// The family dispatch (`CausalLm`'s path) gives Llama's own decoder settings.
    #[test]
    fn family_dispatch_gives_the_same_decoder() -> Result<()> {
        for extra in [
            r#", "architectures": ["LlamaForCausalLM"], "rope_theta": 1e4, "attention_bias": true"#,
            r#", "model_type": "llama", "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 2.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}"#,
            r#", "architectures": ["MistralForCausalLM"], "rope_theta": 1e6, "sliding_window": 32"#,
            r#", "model_type": "qwen2", "rope_theta": 1e6, "tie_word_embeddings": true, "eos_token_id": 7"#,
        ] {
            let text = format!("{{{BASE}{extra}}}");
            let via_family = config_from_json(&text, "config.json")?;
            assert_eq!(via_family, cfg(extra)?.decoder(), "{extra}");
        }
        Ok(())
    }
}
