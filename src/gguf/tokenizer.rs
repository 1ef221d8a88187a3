//! GGUF vocabulary → Hugging Face `tokenizer.json` and `tokenizer_config.json`.
//!
//! A GGUF with `tokenizer.ggml.model = "gpt2"` carries a byte-level BPE vocabulary: its tokens
//! are already written in the GPT-2 byte-to-unicode alphabet (`"Ġthe"`), and its merges are
//! `"left right"` strings in rank order. The tokenizer written here is the one Hugging Face
//! transformers builds from such a file: a BPE model over that vocabulary and those merges,
//! the GPT-2 `ByteLevel` pre-tokenizer and decoder, a `TemplateProcessing` post-processor that
//! adds BOS / EOS only when the GGUF says so (`tokenizer.ggml.add_bos_token`,
//! `add_eos_token`), and the control tokens (`token_type` 3, plus unknown and the named
//! special ids) as special added tokens, user-defined ones (`token_type` 4) as plain added
//! tokens.
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
//! tokenizer matches Hugging Face (the ids Hugging Face users get, and the reference data the
//! tests check), so on such inputs its ids differ from llama.cpp's.

use std::collections::{HashMap, HashSet};

use candle_core::{Error, Result};
use serde_json::{json, Map, Value};

use super::Metadata;

/// llama.cpp token types (`tokenizer.ggml.token_type`).
const TOKEN_TYPE_UNKNOWN: i64 = 2;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Values of `tokenizer.ggml.pre` whose llama.cpp pre-tokenizer Hugging Face renders as the
/// plain GPT-2 `ByteLevel` split (for `smollm`, see the digit note in the module docs).
pub const SUPPORTED_PRE: &[&str] = &["default", "gpt2", "smollm"];

/// The tokenizer data of a GGUF file.
#[derive(Debug, Clone)]
pub struct GgufTokenizer {
    /// `tokenizer.ggml.tokens`, indexed by id (byte-level encoded).
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type` (1 normal, 2 unknown, 3 control, 4 user defined, ...);
    /// all 1 when absent.
    pub token_types: Vec<i64>,
    /// `tokenizer.ggml.merges`, split into (left, right), in rank order.
    pub merges: Vec<(String, String)>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_token_id: Option<u32>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unk_token_id: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad_token_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token` (default false).
    pub add_bos_token: bool,
    /// `tokenizer.ggml.add_eos_token` (default false).
    pub add_eos_token: bool,
    /// `tokenizer.ggml.add_space_prefix` (default false).
    pub add_space_prefix: bool,
    /// `tokenizer.ggml.pre` (default `"default"`).
    pub pre: String,
    /// `tokenizer.chat_template`, if present.
    pub chat_template: Option<String>,
}

impl GgufTokenizer {
    /// Reads and validates the tokenizer metadata: a `gpt2` model, a supported `pre`, unique
    /// byte-level tokens, merges of known tokens, special ids in range.
    pub fn from_metadata(meta: &Metadata) -> Result<Self> {
        let file = meta.path().display();
        let model = meta.str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            candle_core::bail!(
                "{file}: tokenizer.ggml.model is {model:?}; only \"gpt2\" (byte-level BPE) \
                 vocabularies can be converted"
            );
        }
        let pre = meta.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
        if !SUPPORTED_PRE.contains(&pre) {
            candle_core::bail!(
                "{file}: tokenizer.ggml.pre is {pre:?}; supported: {SUPPORTED_PRE:?}"
            );
        }
        let tokens: Vec<String> = meta
            .str_array("tokenizer.ggml.tokens")?
            .into_iter()
            .map(str::to_string)
            .collect();
        let mut ids: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
        for (id, t) in tokens.iter().enumerate() {
            if let Some(prev) = ids.insert(t.as_str(), id) {
                candle_core::bail!(
                    "{file}: tokenizer.ggml.tokens has {t:?} twice (ids {prev} and {id})"
                );
            }
        }
        // Byte-level vocabularies write the space as 'Ġ' (U+0120); some lack a few rare
        // byte symbols, so only this one is required.
        if !ids.contains_key("Ġ") {
            candle_core::bail!(
                "{file}: tokenizer.ggml.tokens has no \"Ġ\" (the byte-level space); not a \
                 byte-level BPE vocabulary"
            );
        }
        let token_types = match meta.opt_i64_array("tokenizer.ggml.token_type")? {
            Some(tt) if tt.len() != tokens.len() => candle_core::bail!(
                "{file}: tokenizer.ggml.token_type has {} entries for {} tokens",
                tt.len(),
                tokens.len()
            ),
            Some(tt) => tt,
            None => vec![1; tokens.len()],
        };
        let raw_merges = meta.str_array("tokenizer.ggml.merges")?;
        let mut merges = Vec::with_capacity(raw_merges.len());
        for (i, m) in raw_merges.into_iter().enumerate() {
            let pair = m
                .split_once(' ')
                .filter(|(a, b)| !a.is_empty() && !b.is_empty() && !b.contains(' '));
            let Some((a, b)) = pair else {
                candle_core::bail!(
                    "{file}: tokenizer.ggml.merges[{i}] = {m:?} is not \"left right\""
                );
            };
            for part in [a, b, &format!("{a}{b}")] {
                if !ids.contains_key(part) {
                    candle_core::bail!(
                        "{file}: tokenizer.ggml.merges[{i}] = {m:?} uses {part:?}, which is not \
                         in tokenizer.ggml.tokens"
                    );
                }
            }
            merges.push((a.to_string(), b.to_string()));
        }
        let n = tokens.len();
        let id = |key: &str| -> Result<Option<u32>> {
            match meta.opt_u32(key)? {
                Some(i) if i as usize >= n => Err(Error::Msg(format!(
                    "{file}: {key} = {i} is out of range for {n} tokens"
                ))),
                other => Ok(other),
            }
        };
        Ok(Self {
            bos_token_id: id("tokenizer.ggml.bos_token_id")?,
            eos_token_id: id("tokenizer.ggml.eos_token_id")?,
            unk_token_id: id("tokenizer.ggml.unknown_token_id")?,
            pad_token_id: id("tokenizer.ggml.padding_token_id")?,
            add_bos_token: meta
                .opt_bool("tokenizer.ggml.add_bos_token")?
                .unwrap_or(false),
            add_eos_token: meta
                .opt_bool("tokenizer.ggml.add_eos_token")?
                .unwrap_or(false),
            add_space_prefix: meta
                .opt_bool("tokenizer.ggml.add_space_prefix")?
                .unwrap_or(false),
            pre: pre.to_string(),
            chat_template: meta.opt_str("tokenizer.chat_template")?.map(str::to_string),
            tokens,
            token_types,
            merges,
        })
    }

    fn token(&self, id: Option<u32>) -> Option<&str> {
        id.and_then(|i| self.tokens.get(i as usize))
            .map(String::as_str)
    }

    /// The Hugging Face `tokenizer.json` (format version 1.0).
    pub fn tokenizer_json(&self) -> Result<Value> {
        let special_ids: HashSet<u32> = [
            self.bos_token_id,
            self.eos_token_id,
            self.unk_token_id,
            self.pad_token_id,
        ]
        .into_iter()
        .flatten()
        .collect();
        let mut added = Vec::new();
        for (id, (tok, ty)) in self.tokens.iter().zip(&self.token_types).enumerate() {
            let named = u32::try_from(id).is_ok_and(|i| special_ids.contains(&i));
            let special = match *ty {
                TOKEN_TYPE_CONTROL | TOKEN_TYPE_UNKNOWN => true,
                TOKEN_TYPE_USER_DEFINED => named,
                _ if named => true,
                _ => continue,
            };
            added.push(json!({
                "id": id,
                "content": tok,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": special,
            }));
        }

        let mut special_tokens = Map::new();
        let bos = self.token(self.bos_token_id).filter(|_| self.add_bos_token);
        let eos = self.token(self.eos_token_id).filter(|_| self.add_eos_token);
        if self.add_bos_token && bos.is_none() {
            candle_core::bail!("tokenizer.ggml.add_bos_token is set but there is no bos_token_id");
        }
        if self.add_eos_token && eos.is_none() {
            candle_core::bail!("tokenizer.ggml.add_eos_token is set but there is no eos_token_id");
        }
        for (tok, id) in [(bos, self.bos_token_id), (eos, self.eos_token_id)] {
            if let (Some(tok), Some(id)) = (tok, id) {
                special_tokens.insert(
                    tok.to_string(),
                    json!({ "id": tok, "ids": [id], "tokens": [tok] }),
                );
            }
        }
        let piece = |seq: &str, type_id: u32| -> Vec<Value> {
            let mut out = Vec::new();
            if let Some(b) = bos {
                out.push(json!({ "SpecialToken": { "id": b, "type_id": type_id } }));
            }
            out.push(json!({ "Sequence": { "id": seq, "type_id": type_id } }));
            if let Some(e) = eos {
                out.push(json!({ "SpecialToken": { "id": e, "type_id": type_id } }));
            }
            out
        };
        let single = piece("A", 0);
        let mut pair = piece("A", 0);
        pair.extend(piece("B", 1));

        let vocab: Map<String, Value> = self
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), json!(i)))
            .collect();
        let merges: Vec<[&str; 2]> = self
            .merges
            .iter()
            .map(|(a, b)| [a.as_str(), b.as_str()])
            .collect();
        Ok(json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {
                "type": "ByteLevel",
                "add_prefix_space": self.add_space_prefix,
                "trim_offsets": true,
                "use_regex": true,
            },
            "post_processor": {
                "type": "TemplateProcessing",
                "single": single,
                "pair": pair,
                "special_tokens": special_tokens,
            },
            "decoder": {
                "type": "ByteLevel",
                "add_prefix_space": true,
                "trim_offsets": true,
                "use_regex": true,
            },
            "model": {
                "type": "BPE",
                "dropout": null,
                "unk_token": null,
                "continuing_subword_prefix": "",
                "end_of_word_suffix": "",
                "fuse_unk": false,
                "byte_fallback": false,
                "ignore_merges": false,
                "vocab": vocab,
                "merges": merges,
            },
        }))
    }

    /// The Hugging Face `tokenizer_config.json`: special token strings, whether BOS / EOS are
    /// added, the chat template, and `model_max_length`.
    pub fn tokenizer_config_json(&self, model_max_length: usize) -> Value {
        let mut c = Map::new();
        c.insert("add_bos_token".into(), json!(self.add_bos_token));
        c.insert("add_eos_token".into(), json!(self.add_eos_token));
        for (key, id) in [
            ("bos_token", self.bos_token_id),
            ("eos_token", self.eos_token_id),
            ("unk_token", self.unk_token_id),
            ("pad_token", self.pad_token_id),
        ] {
            if let Some(t) = self.token(id) {
                c.insert(key.into(), json!(t));
            }
        }
        if let Some(t) = &self.chat_template {
            c.insert("chat_template".into(), json!(t));
        }
        c.insert("clean_up_tokenization_spaces".into(), json!(false));
        c.insert("model_max_length".into(), json!(model_max_length));
        c.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
        Value::Object(c)
    }
}
