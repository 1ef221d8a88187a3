//! The architecture a `config.json` names (its first `architectures` entry, or the one a
//! known `model_type` stands for) and every architecture [`crate::models::CausalLm`] loads.
//! The families read it (Llama's typed config checks its architecture against it); the
//! registry that dispatches on it ([`super::family`]) is above them.

use candle_core::Result;
use serde::Deserialize;

/// Every architecture (`config.json` `architectures`) [`crate::models::CausalLm`] loads.
pub const SUPPORTED_ARCHITECTURES: [&str; 9] = [
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
];

/// The `model_type`s that stand in for a missing `architectures`, and the architecture each
/// names.
const MODEL_TYPES: [(&str, &str); 3] = [
    ("llama", "LlamaForCausalLM"),
    ("mistral", "MistralForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
];

/// The keys of a `config.json` that name its family.
#[derive(Deserialize)]
pub(crate) struct Architectures {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
}

impl Architectures {
    /// Reads the keys of `text`; `origin` names the file in errors.
    pub(crate) fn parse(text: &str, origin: &str) -> Result<Self> {
        serde_json::from_str(text)
            .map_err(|e| candle_core::Error::msg(format!("{origin}: invalid config: {e}")))
    }

    /// The first `architectures` entry, or without one the architecture a known
    /// `model_type` ([`MODEL_TYPES`]) names.
    pub(crate) fn resolve(&self) -> Option<String> {
        match (self.architectures.as_deref(), self.model_type.as_deref()) {
            (Some([first, ..]), _) => Some(first.clone()),
            (_, Some(t)) => MODEL_TYPES
                .iter()
                .find(|(name, _)| *name == t)
                .map(|(_, arch)| arch.to_string()),
            _ => None,
        }
    }

    /// `model_type`, as the config has it.
    pub(crate) fn model_type(&self) -> Option<&str> {
        self.model_type.as_deref()
    }
}
