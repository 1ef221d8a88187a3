//! Text in and out of a checkpoint: its tokenizer (a model directory's `tokenizer.json`, or
//! built from a GGUF file's metadata), its chat template (`tokenizer_config.json`'s
//! `chat_template` or a `chat_template.jinja` beside it, rendered with minijinja) and its
//! end-of-sequence tokens; and [`TextStream`], which turns generated ids into text pieces as
//! they become decodable.

use std::path::{Path, PathBuf};

use candle_core::Result;
use serde_json::Value;
use tokenizers::Tokenizer;

fn err(what: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::msg(what.to_string())
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| err(format!("reading {}: {e}", path.display())))?;
    serde_json::from_str(&text).map_err(|e| err(format!("parsing {}: {e}", path.display())))
}

/// A special token of tokenizer_config.json: a string or `{"content": ...}`.
fn special_token(cfg: &Value, key: &str) -> Option<String> {
    match &cfg[key] {
        Value::String(s) => Some(s.clone()),
        v => v["content"].as_str().map(String::from),
    }
}

/// One chat message (`role`: `system`, `user`, `assistant`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// Who speaks.
    pub role: String,
    /// What is said.
    pub content: String,
}

/// A checkpoint's tokenizer, chat template and special tokens.
#[derive(Debug, Clone)]
pub struct ModelText {
    tokenizer: Tokenizer,
    config: Value,
    template_path: PathBuf,
    origin: PathBuf,
}

impl ModelText {
    /// Loads the text side of `model`: a model directory (`tokenizer.json`, optional
    /// `tokenizer_config.json` and `chat_template.jinja`) or a `.gguf` file (tokenizer and
    /// chat template from its metadata; a `.jinja` file of the same name as fallback).
    pub fn load(model: &Path) -> Result<Self> {
        if crate::models::decoder::is_gguf(model) {
            let src = crate::loader::GgufSource::open(model)?;
            let json = serde_json::to_vec(&src.tokenizer().tokenizer_json()?)
                .map_err(|e| err(format!("{}: tokenizer JSON: {e}", model.display())))?;
            let tokenizer = Tokenizer::from_bytes(json)
                .map_err(|e| err(format!("{}: building the tokenizer: {e}", model.display())))?;
            let config = src
                .tokenizer()
                .tokenizer_config_json(src.config().max_position_embeddings);
            return Ok(Self {
                tokenizer,
                config,
                template_path: model.with_extension("jinja"),
                origin: model.to_path_buf(),
            });
        }
        let tok_path = model.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| err(format!("loading {}: {e}", tok_path.display())))?;
        let tc = model.join("tokenizer_config.json");
        let config = if tc.is_file() {
            read_json(&tc)?
        } else {
            Value::Null
        };
        Ok(Self {
            tokenizer,
            config,
            template_path: model.join("chat_template.jinja"),
            origin: model.to_path_buf(),
        })
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The token ids of `text` (`add_special`: the tokenizer's BOS and the like, as for a raw
    /// completion prompt; not for a rendered chat, which has them already).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        Ok(self
            .tokenizer
            .encode(text, add_special)
            .map_err(|e| err(format!("tokenizing: {e}")))?
            .get_ids()
            .to_vec())
    }

    /// The text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| err(format!("decoding: {e}")))
    }

    /// End-of-sequence ids: the model's (`config_eos`) and the tokenizer config's
    /// `eos_token`.
    pub fn eos_ids(&self, config_eos: &[u32]) -> Vec<u32> {
        let mut eos = config_eos.to_vec();
        if let Some(id) =
            special_token(&self.config, "eos_token").and_then(|t| self.tokenizer.token_to_id(&t))
        {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        eos
    }

    fn template(&self) -> Result<String> {
        let cfg_path = self.origin.join("tokenizer_config.json");
        match &self.config["chat_template"] {
            Value::String(s) => Ok(s.clone()),
            Value::Array(list) => list
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .map(String::from)
                .ok_or_else(|| {
                    err(format!(
                        "{}: no 'default' chat template",
                        cfg_path.display()
                    ))
                }),
            _ => std::fs::read_to_string(&self.template_path).map_err(|_| {
                err(format!(
                    "{}: no chat template (neither tokenizer_config.json's chat_template nor {})",
                    self.origin.display(),
                    self.template_path.display()
                ))
            }),
        }
    }

    /// The chat template applied to `messages`, with the generation prompt.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String> {
        let template = self.template()?;
        let mut env = minijinja::Environment::new();
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", &template)
            .map_err(|e| err(format!("parsing the chat template: {e}")))?;
        let ctx = serde_json::json!({
            "messages": messages,
            "add_generation_prompt": true,
            "bos_token": special_token(&self.config, "bos_token").unwrap_or_default(),
            "eos_token": special_token(&self.config, "eos_token").unwrap_or_default(),
        });
        env.get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(|e| err(format!("rendering the chat template: {e}")))
    }
}

/// Generated ids to text pieces: each [`TextStream::push`] returns the text that became
/// final, holding back an incomplete UTF-8 character and anything that could still turn
/// into one of the stop strings; [`TextStream::finish`] returns the rest.
#[derive(Debug, Clone)]
pub struct TextStream {
    ids: Vec<u32>,
    /// Bytes of the decoded text already returned.
    sent: usize,
    stops: Vec<String>,
    /// Set when a stop string was found: the text ends before it.
    stopped: bool,
}

impl TextStream {
    /// A stream that ends at the first of `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            ids: Vec::new(),
            sent: 0,
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            stopped: false,
        }
    }

    /// Whether a stop string was found (the caller ends the sequence).
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Tokens pushed.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether no token was pushed.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Adds a generated token and returns the text that became final.
    pub fn push(&mut self, text: &ModelText, id: u32) -> Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        self.ids.push(id);
        let full = text.decode(&self.ids)?;
        if let Some(end) = self
            .stops
            .iter()
            .filter_map(|s| full.find(s.as_str()))
            .min()
        {
            self.stopped = true;
            return Ok(full.get(self.sent..end).unwrap_or_default().to_string());
        }
        if full.ends_with('\u{FFFD}') {
            return Ok(String::new()); // an incomplete UTF-8 sequence: wait for the next token
        }
        // Hold back a suffix that is a prefix of a stop string.
        let mut end = full.len();
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if full.ends_with(&s[..i]) {
                    end = end.min(full.len() - i);
                }
            }
        }
        let out = full.get(self.sent..end).unwrap_or_default().to_string();
        self.sent = self.sent.max(end);
        Ok(out)
    }

    /// The text held back, at the end of the sequence.
    pub fn finish(&mut self, text: &ModelText) -> Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        let full = text.decode(&self.ids)?;
        let out = full.get(self.sent..).unwrap_or_default().to_string();
        self.sent = full.len();
        Ok(out)
    }
}
