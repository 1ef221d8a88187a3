//! Tensor-parallel models built from the parallel layers, read from Hugging Face checkpoints.
//!
//! Decoder-only families share one decoder ([`CausalLm`]); a family is a config parser that
//! sets the decoder's hooks, picked by `config.json` `architectures` ([`family`]).
mod architectures;
pub mod bert;
pub mod checkpoint;
mod config_fields;
pub mod decoder;
pub mod family;
pub mod gemma;
pub mod llama;
pub mod llama_config;
pub mod mixtral;
pub mod phi3;
pub mod qwen3;

pub use architectures::SUPPORTED_ARCHITECTURES;
pub use checkpoint::{FromCheckpoint, LoadOptions};
pub use decoder::{CausalLm, DecoderConfig, FeedForward, LayerConfig, SeqStep};
pub use llama::Llama;
pub use llama_config::{LlamaConfig, LLAMA_ARCHITECTURES};

/// Where the project keeps its demo models: `$CANDLE_TP_HOME/models`, by default
/// `~/.cache/candle-tp/models` (filled by `scripts/fetch-models.sh`).
pub fn models_dir() -> candle_core::Result<std::path::PathBuf> {
    let home = match std::env::var_os("CANDLE_TP_HOME") {
        Some(h) => std::path::PathBuf::from(h),
        None => std::path::PathBuf::from(
            std::env::var_os("HOME")
                .ok_or_else(|| candle_core::Error::msg("neither CANDLE_TP_HOME nor HOME is set"))?,
        )
        .join(".cache/candle-tp"),
    };
    Ok(home.join("models"))
}
