//! Log-probabilities in OpenAI's answer shapes.
//!
//! - Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
//!   "bytes"}]}]}`.
//! - Completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
//!   "text_offset"}`.
//!
//! A token's text is what it adds to the decoded text, special tokens kept (`<|im_end|>`):
//! the decoding of the few tokens before it and of it, less the decoding of those before it
//! (vLLM's incremental detokenization). Decoded alone, a SentencePiece piece (`▁world`) would
//! lose its leading space, and the completions' `tokens` would not add up to the text nor
//! `text_offset` point into it. The first token, or one that leaves a character unfinished
//! (U+FFFD), is decoded alone. `bytes` are the text's UTF-8 bytes.

use serde_json::{json, Map, Value};

use crate::generate::TokenLogprobs;
use crate::text::ModelText;

/// The log-probabilities of an answer's tokens, formatted as they arrive.
#[derive(Debug, Clone, Default)]
pub struct LogprobsOut {
    /// Entries not yet sent (chat: content entries; completions: (token, logprob, top)).
    pending: Vec<Entry>,
    /// Characters of the completion text before the next token (completions' `text_offset`).
    offset: usize,
    /// The last tokens pushed: the context a token's text is cut from.
    context: Vec<u32>,
}

/// Tokens of context before the one whose text is cut (vLLM uses 5 as well).
const CONTEXT: usize = 5;

#[derive(Debug, Clone)]
struct Entry {
    token: String,
    logprob: f64,
    top: Vec<(String, f64)>,
    offset: usize,
}

/// A log-probability for JSON: `-9999.0` for minus infinity (as vLLM), JSON has no infinity.
fn finite(lp: f64) -> Value {
    if lp == f64::NEG_INFINITY {
        json!(-9999.0)
    } else {
        json!(lp)
    }
}

impl LogprobsOut {
    /// Notes one generated token's log-probabilities.
    pub fn push(&mut self, text: &ModelText, lp: &TokenLogprobs) -> candle_core::Result<()> {
        // The context's text, decoded once for the token and every alternative.
        let before = text.token_texts(&self.context)?;
        let token = self.piece(text, &before, lp.token)?;
        let top = lp
            .top
            .iter()
            .map(|&(id, v)| Ok((self.piece(text, &before, id)?, v)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let offset = self.offset;
        self.offset += token.chars().count();
        if self.context.len() == CONTEXT {
            self.context.remove(0);
        }
        self.context.push(lp.token);
        self.pending.push(Entry {
            token,
            logprob: lp.logprob,
            top,
            offset,
        });
        Ok(())
    }

    /// What `id` adds to the text after the tokens pushed so far, whose text is `before`.
    fn piece(&self, text: &ModelText, before: &str, id: u32) -> candle_core::Result<String> {
        if self.context.is_empty() {
            return text.token_text(id);
        }
        let mut ids = self.context.clone();
        ids.push(id);
        let after = text.token_texts(&ids)?;
        match after.strip_prefix(before) {
            Some(piece) if !after.ends_with('\u{FFFD}') => Ok(piece.to_string()),
            _ => text.token_text(id),
        }
    }

    /// The pending entries as a choice's `logprobs` (chat or completions shape); they are
    /// taken.
    pub fn take(&mut self, chat: bool) -> Value {
        let entries = std::mem::take(&mut self.pending);
        if chat {
            let content: Vec<Value> = entries
                .iter()
                .map(|e| {
                    let top: Vec<Value> = e
                        .top
                        .iter()
                        .map(|(t, v)| json!({"token": t, "logprob": finite(*v), "bytes": t.as_bytes()}))
                        .collect();
                    json!({"token": e.token, "logprob": finite(e.logprob),
                           "bytes": e.token.as_bytes(), "top_logprobs": top})
                })
                .collect();
            return json!({"content": content});
        }
        let top: Vec<Value> = entries
            .iter()
            .map(|e| {
                // Tokens of equal text share a key: the most likely one's value stays.
                let mut m = Map::new();
                for (t, v) in &e.top {
                    m.entry(t.clone()).or_insert_with(|| finite(*v));
                }
                Value::Object(m)
            })
            .collect();
        json!({
            "tokens": entries.iter().map(|e| e.token.clone()).collect::<Vec<_>>(),
            "token_logprobs": entries.iter().map(|e| finite(e.logprob)).collect::<Vec<_>>(),
            "top_logprobs": top,
            "text_offset": entries.iter().map(|e| e.offset).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SentencePiece-style tokenizer (Unigram pieces with `▁` for the space, the Metaspace
    /// decoder): a piece decoded alone loses its leading space, so pieces must be cut from
    /// the decoded text, not decoded one by one.
    fn sentencepiece_text() -> (ModelText, tempfile::TempDir) {
        let tokenizer = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "post_processor": null,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true},
            "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true},
            "model": {"type": "Unigram", "unk_id": 0, "byte_fallback": false, "vocab": [
                ["<unk>", 0.0], ["▁Hello", -1.0], ["▁world", -1.0], ["!", -2.0], ["▁", -3.0],
                ["é", -2.0]
            ]}
        });
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
        (ModelText::load(dir.path()).unwrap(), dir)
    }

    fn push_all(text: &ModelText, ids: &[u32]) -> Value {
        let mut out = LogprobsOut::default();
        for &id in ids {
            let lp = TokenLogprobs {
                token: id,
                logprob: -0.5,
                top: vec![(id, -0.5)],
            };
            out.push(text, &lp).unwrap();
        }
        out.take(false)
    }

    #[test]
    fn completion_tokens_and_offsets_follow_the_text_for_sentencepiece() {
        let (text, _dir) = sentencepiece_text();
        // "▁Hello ▁world ! ▁world é": the text is "Hello world! worldé".
        let ids = [1, 2, 3, 2, 5];
        let whole = text.decode(&ids).unwrap();
        assert_eq!(whole, "Hello world! worldé");
        let v = push_all(&text, &ids);
        let tokens: Vec<String> = serde_json::from_value(v["tokens"].clone()).unwrap();
        assert_eq!(tokens, ["Hello", " world", "!", " world", "é"]);
        assert_eq!(tokens.concat(), whole);
        let offsets: Vec<usize> = serde_json::from_value(v["text_offset"].clone()).unwrap();
        assert_eq!(offsets, [0, 5, 11, 12, 18]);
    }
}
