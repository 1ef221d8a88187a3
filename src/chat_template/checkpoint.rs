//! A checkpoint's chat template and special tokens: `tokenizer_config.json`'s `chat_template`
//! (a string, or a list of named templates of which `default` is taken), else a
//! `chat_template.jinja` file; the special tokens transformers passes to the template
//! (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`,
//! `mask_token`, those that are set).

use std::path::Path;

use candle_core::Result;
use serde_json::Value as Json;

use super::{err, ChatTemplate};

/// The special tokens transformers' `special_tokens_map` holds (`SPECIAL_TOKENS_ATTRIBUTES`).
pub const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A special token of a `tokenizer_config.json`: a string or `{"content": ...}`.
pub fn special_token(config: &Json, key: &str) -> Option<String> {
    match &config[key] {
        Json::String(s) => Some(s.clone()),
        v => v["content"].as_str().map(String::from),
    }
}

impl ChatTemplate {
    /// The chat template of a checkpoint, compiled, with its special tokens: `config` is its
    /// `tokenizer_config.json` (or what a GGUF file's metadata gives in its place; `Null` when
    /// there is none) read from `origin`; `fallback` the `.jinja` file to read when `config`
    /// has no `chat_template`.
    pub fn from_tokenizer_config(config: &Json, origin: &Path, fallback: &Path) -> Result<Self> {
        let (name, source) = match &config["chat_template"] {
            Json::String(s) => (format!("{} (chat_template)", origin.display()), s.clone()),
            Json::Array(list) => {
                let source = list
                    .iter()
                    .find(|t| t["name"] == "default")
                    .and_then(|t| t["template"].as_str())
                    .ok_or_else(|| {
                        err(format!(
                            "{}: no chat template named 'default' in chat_template",
                            origin.display()
                        ))
                    })?;
                let name = format!("{} (chat_template 'default')", origin.display());
                (name, source.to_string())
            }
            _ => {
                let source = std::fs::read_to_string(fallback).map_err(|e| {
                    err(format!(
                        "{}: no chat template (no chat_template in its tokenizer config, and {}: {e})",
                        origin.display(),
                        fallback.display()
                    ))
                })?;
                (fallback.display().to_string(), source)
            }
        };
        let tokens = SPECIAL_TOKENS
            .iter()
            .filter_map(|k| special_token(config, k).map(|t| (k.to_string(), t)));
        Ok(Self::new(name, &source)?.with_special_tokens(tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat_template::ChatInput;
    use minijinja::Value;
    use serde_json::json;

    fn render(t: &ChatTemplate) -> String {
        let user = Value::from_serialize(json!({"role": "user", "content": "hi"}));
        t.render(&ChatInput::new(vec![user])).unwrap()
    }

    #[test]
    fn template_and_special_tokens_from_the_config() {
        let cfg = json!({
            "chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}{{ pad_token is defined }}",
            "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>",
        });
        let t =
            ChatTemplate::from_tokenizer_config(&cfg, Path::new("m"), Path::new("none")).unwrap();
        assert_eq!(render(&t), "<s>hi</s>False"); // Python prints False

        let cfg = json!({"chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "default {{ messages | length }}"},
        ]});
        let t =
            ChatTemplate::from_tokenizer_config(&cfg, Path::new("m"), Path::new("none")).unwrap();
        assert_eq!(render(&t), "default 1");
    }

    #[test]
    fn the_jinja_file_is_the_fallback() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chat_template.jinja");
        std::fs::write(&path, "{{ messages[0].role }}\n").unwrap();
        let t = ChatTemplate::from_tokenizer_config(&Json::Null, dir.path(), &path).unwrap();
        assert_eq!(render(&t), "user");
        let missing = dir.path().join("missing.jinja");
        let e = ChatTemplate::from_tokenizer_config(&Json::Null, dir.path(), &missing)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no chat template") && e.contains("missing.jinja"),
            "{e}"
        );
    }
}
