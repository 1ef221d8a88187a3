//! Tensor-parallel models built from the parallel layers, read from Hugging Face checkpoints.
pub mod bert;
pub mod llama;
pub mod llama_config;

pub use llama::Llama;
pub use llama_config::{LlamaConfig, SUPPORTED_ARCHITECTURES};

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
