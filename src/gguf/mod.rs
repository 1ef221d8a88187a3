//! Reading llama.cpp's GGUF files: what the loader ([`crate::loader::GgufSource`]) and the
//! converter ([`crate::convert`]) share.
//!
//! - [`header`]: a bounds-checked walk over the header and tensor table ([`header::scan`]),
//!   before Candle's own reader sees the file.
//! - [`Metadata`]: typed access to the metadata, with errors that name the file and the key.
//! - [`GgufFamily`]: the families read (`llama`, Mixtral in `llama`, `qwen3`, `qwen3moe`).
//! - [`LlamaGgufConfig`]: the model configuration of the metadata, and its Hugging Face
//!   `config.json`.
//! - [`GgufTokenizer`]: the byte-level BPE vocabulary, and its Hugging Face `tokenizer.json`.
//! - [`hf_target`], [`checked_hf_target`], [`rotary_heads`]: llama.cpp tensor names and
//!   their Hugging Face equivalents (a 3-D tensor of experts stands for one matrix per expert).
//!
//! Nothing here depends on the loader, the converter or the models.
pub mod config;
pub mod family;
pub mod header;
pub mod metadata;
pub mod names;
pub mod tokenizer;

pub use config::LlamaGgufConfig;
pub use family::{GgufExperts, GgufFamily};
pub use header::{scan, GgufHeader, GgufTensorEntry};
pub use metadata::Metadata;
pub use names::{
    checked_hf_target, hf_target, hf_tensor_name, layer_index, rotary_heads, rotary_heads_of,
    HfTarget,
};
pub use tokenizer::GgufTokenizer;
