//! Text in and out of a checkpoint, for `examples/generate` and the server alike (in every
//! build: the `server` feature adds only HTTP).
//!
//! - [`ModelText`]: its tokenizer (a model directory's `tokenizer.json`, or built from a GGUF
//!   file's metadata), its chat template (`tokenizer_config.json`'s `chat_template` or a
//!   `chat_template.jinja` beside it, compiled once at load and rendered as transformers
//!   renders it: [`crate::chat_template`]) and its end-of-sequence tokens.
//! - [`TextStream`]: generated ids to text pieces as they become decodable, decoded
//!   incrementally (each token costs a decode of a few ids, not of the whole text), with stop
//!   strings.

use std::path::Path;

use candle_core::Result;
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::chat_template::{special_token, ChatInput, ChatTemplate};

mod stream;
pub use stream::{TextStream, MAX_STOP_BYTES};

fn err(what: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::msg(what.to_string())
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| err(format!("reading {}: {e}", path.display())))?;
    serde_json::from_str(&text).map_err(|e| err(format!("parsing {}: {e}", path.display())))
}

/// One chat message (`role`: `system`, `user`, `assistant`, `developer`, `tool`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// Who speaks.
    pub role: String,
    /// What is said.
    pub content: String,
    /// Further keys passed to the chat template as they are (`name`, `tool_calls`,
    /// `tool_call_id`, `reasoning_content`).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

/// `tok` without the truncation and padding its `tokenizer.json` may carry (an encoder's
/// export often has `truncation: {max_length: 512}` and a fixed padding): a prompt for
/// generation is neither cut nor padded silently; its length is checked against the model's
/// context instead, with an error that names both.
fn for_generation(mut tok: Tokenizer, from: &Path) -> Result<Tokenizer> {
    tok.with_truncation(None)
        .map_err(|e| err(format!("{}: turning truncation off: {e}", from.display())))?;
    tok.with_padding(None);
    Ok(tok)
}

/// A checkpoint's tokenizer, chat template and special tokens.
#[derive(Debug, Clone)]
pub struct ModelText {
    tokenizer: Tokenizer,
    config: Value,
    /// The compiled chat template, or why there is none (a checkpoint without one, or one that
    /// does not compile, still serves completions; chat requests get the message).
    chat: std::result::Result<ChatTemplate, String>,
}

impl ModelText {
    /// Loads the text side of `model`: a model directory (`tokenizer.json`, optional
    /// `tokenizer_config.json` and `chat_template.jinja`) or a `.gguf` file (tokenizer and
    /// chat template from its metadata; a `.jinja` file of the same name as fallback).
    pub fn load(model: &Path) -> Result<Self> {
        if crate::models::checkpoint::is_gguf(model) {
            let src = crate::loader::GgufSource::open(model)?;
            let json = serde_json::to_vec(&src.tokenizer().tokenizer_json()?)
                .map_err(|e| err(format!("{}: tokenizer JSON: {e}", model.display())))?;
            let tokenizer = Tokenizer::from_bytes(json)
                .map_err(|e| err(format!("{}: building the tokenizer: {e}", model.display())))?;
            let tokenizer = for_generation(tokenizer, model)?;
            let config = src
                .tokenizer()
                .tokenizer_config_json(src.config().max_position_embeddings);
            let chat =
                ChatTemplate::from_tokenizer_config(&config, model, &model.with_extension("jinja"));
            return Ok(Self {
                tokenizer,
                config,
                chat: chat.map_err(|e| e.to_string()),
            });
        }
        let tok_path = model.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| err(format!("loading {}: {e}", tok_path.display())))?;
        let tokenizer = for_generation(tokenizer, &tok_path)?;
        let tc = model.join("tokenizer_config.json");
        let config = if tc.is_file() {
            read_json(&tc)?
        } else {
            Value::Null
        };
        let chat =
            ChatTemplate::from_tokenizer_config(&config, &tc, &model.join("chat_template.jinja"));
        Ok(Self {
            tokenizer,
            config,
            chat: chat.map_err(|e| e.to_string()),
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

    /// The text of one token alone, special tokens kept (for log-probabilities).
    pub fn token_text(&self, id: u32) -> Result<String> {
        self.token_texts(&[id])
    }

    /// The text of `ids`, special tokens kept (for log-probabilities).
    pub fn token_texts(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, false)
            .map_err(|e| err(format!("decoding tokens {ids:?}: {e}")))
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

    /// The compiled chat template.
    pub fn chat_template(&self) -> Result<&ChatTemplate> {
        self.chat
            .as_ref()
            .map_err(|e| candle_core::Error::msg(e.clone()))
    }

    /// The chat template applied to `messages`, with the generation prompt.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String> {
        self.render_messages(messages, None, true, &[])
    }

    /// The chat template applied to `messages` and the tool definitions `tools` (its `tools`
    /// variable, as transformers' `apply_chat_template(tools=...)`), with the generation
    /// prompt.
    pub fn render_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
    ) -> Result<String> {
        self.render_messages(messages, tools, true, &[])
    }

    /// [`ModelText::render_chat_with_tools`] with further template variables (`kwargs`, as
    /// transformers' `apply_chat_template(**kwargs)`: `enable_thinking`, ...).
    pub fn render_chat_with(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
        kwargs: &[(String, Value)],
    ) -> Result<String> {
        self.render_messages(messages, tools, true, kwargs)
    }

    /// The chat template applied to `messages` without the generation prompt (`/tokenize`
    /// with `add_generation_prompt: false`).
    pub fn render_chat_without_prompt(&self, messages: &[ChatMessage]) -> Result<String> {
        self.render_messages(messages, None, false, &[])
    }

    /// Renders `messages`. OpenAI's `developer` role (its newer name for `system`) reaches a
    /// template that never mentions it as `system`: such templates (Qwen3's, SmolLM2's) would
    /// otherwise drop the message without a word.
    fn render_messages(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
        generation_prompt: bool,
        kwargs: &[(String, Value)],
    ) -> Result<String> {
        use crate::chat_template::Value as Jinja;
        let template = self.chat_template()?;
        let knows_developer = template.source().contains("developer");
        let messages = messages
            .iter()
            .map(|m| {
                if m.role == "developer" && !knows_developer {
                    let mut m = m.clone();
                    m.role = "system".into();
                    Jinja::from_serialize(&m)
                } else {
                    Jinja::from_serialize(m)
                }
            })
            .collect();
        let input = ChatInput {
            add_generation_prompt: generation_prompt,
            tools: tools.map(|t| t.iter().map(Jinja::from_serialize).collect()),
            kwargs: kwargs
                .iter()
                .map(|(k, v)| (k.clone(), Jinja::from_serialize(v)))
                .collect(),
            ..ChatInput::new(messages)
        };
        template.render(&input)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test data folder, and a checkpoint folder holding SmolLM2's tokenizer alone (also
    /// `stream`'s tests' fixture).
    pub(super) fn checkpoint_with_tokenizer() -> (std::path::PathBuf, tempfile::TempDir) {
        let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(
            data.join("smollm2/tokenizer.json"),
            dir.path().join("tokenizer.json"),
        )
        .unwrap();
        (data, dir)
    }

    /// The SmolLM2 tokenizer with Qwen3's template, and transformers' renderings of it.
    fn qwen3_text() -> (ModelText, Value, tempfile::TempDir) {
        let (data, dir) = checkpoint_with_tokenizer();
        let template =
            std::fs::read_to_string(data.join("chat_templates/Qwen-Qwen3-0.6B.jinja")).unwrap();
        let config = serde_json::json!({"chat_template": template, "eos_token": "<|im_end|>"});
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let text = ModelText::load(dir.path()).unwrap();
        let expected: Value = serde_json::from_str(
            &std::fs::read_to_string(data.join("chat_templates/expected.json")).unwrap(),
        )
        .unwrap();
        (text, expected, dir)
    }

    fn case<'a>(expected: &'a Value, name: &str) -> &'a Value {
        expected["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no case {name}"))
    }

    /// The server renders through [`crate::chat_template`]: Qwen3's template (which calls
    /// Python string methods) gives transformers' text.
    #[test]
    fn render_chat_is_transformers_rendering() {
        let (text, expected, _dir) = qwen3_text();
        let c = case(&expected, "Qwen-Qwen3-0.6B/multi-turn");
        let messages: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
        assert_eq!(text.render_chat(&messages).unwrap(), c["output"]);
    }

    /// `chat_template_kwargs` reach the template: Qwen3 with `enable_thinking: false` gives
    /// transformers' text for the same call (issue 44, defect 14).
    #[test]
    fn template_kwargs_are_transformers_kwargs() {
        let (text, expected, _dir) = qwen3_text();
        let c = case(&expected, "Qwen-Qwen3-0.6B/enable-thinking-false");
        let messages: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
        let kwargs: Vec<(String, Value)> = c["kwargs"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert!(!kwargs.is_empty());
        let got = text.render_chat_with(&messages, None, &kwargs).unwrap();
        assert_eq!(got, c["output"]);
        assert_ne!(
            got,
            text.render_chat(&messages).unwrap(),
            "the kwarg changes nothing"
        );
    }

    /// A `developer` message reaches a template that never names the role (Qwen3's) as a
    /// `system` message: transformers' text for the system message, not a dropped message.
    #[test]
    fn the_developer_role_is_system_where_the_template_lacks_it() {
        let (text, expected, _dir) = qwen3_text();
        let c = case(&expected, "Qwen-Qwen3-0.6B/system-user");
        let mut messages: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
        let system = messages.iter_mut().find(|m| m.role == "system").unwrap();
        system.role = "developer".into();
        let got = text.render_chat(&messages).unwrap();
        assert_eq!(got, c["output"]);
    }

    /// A tokenizer.json that truncates (max_length 4) and pads does neither for generation.
    #[test]
    fn the_generation_tokenizer_neither_truncates_nor_pads() {
        let (data, dir) = checkpoint_with_tokenizer();
        let mut tok: Value = serde_json::from_str(
            &std::fs::read_to_string(data.join("smollm2/tokenizer.json")).unwrap(),
        )
        .unwrap();
        tok["truncation"] = serde_json::json!({"direction": "Right", "max_length": 4,
            "strategy": "LongestFirst", "stride": 0});
        tok["padding"] = serde_json::json!({"strategy": {"Fixed": 64}, "direction": "Right",
            "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"});
        std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).unwrap();
        let raw = Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
        let sentence = "Tensor parallelism splits every layer of a model across ranks.";
        assert_eq!(raw.encode(sentence, false).unwrap().get_ids().len(), 64);
        let want = {
            let mut t = raw.clone();
            t.with_truncation(None).unwrap();
            t.with_padding(None);
            t.encode(sentence, false).unwrap().get_ids().to_vec()
        };
        assert!(want.len() > 4 && want.len() < 64, "{}", want.len());
        let text = ModelText::load(dir.path()).unwrap();
        assert_eq!(text.encode(sentence, false).unwrap(), want);
    }

    #[test]
    fn a_checkpoint_without_template_still_loads() {
        let (_, dir) = checkpoint_with_tokenizer();
        let text = ModelText::load(dir.path()).unwrap();
        let user = ChatMessage {
            role: "user".into(),
            content: "hi".into(),
            extra: Default::default(),
        };
        let e = text.render_chat(&[user]).unwrap_err().to_string();
        assert!(e.contains("no chat template"), "{e}");
    }
}
