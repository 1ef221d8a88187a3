//! Log-probabilities in OpenAI's answer shapes.
//!
//! - Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
//!   "bytes"}]}]}`.
//! - Completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
//!   "text_offset"}`.
//!
//! A token's text is its id decoded alone with special tokens kept (`<|im_end|>`); `bytes`
//! are that text's UTF-8 bytes (a token holding part of a character decodes to U+FFFD, as in
//! vLLM).

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
}

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
        let token = text.token_text(lp.token)?;
        let top = lp
            .top
            .iter()
            .map(|&(id, v)| Ok((text.token_text(id)?, v)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let offset = self.offset;
        self.offset += token.chars().count();
        self.pending.push(Entry {
            token,
            logprob: lp.logprob,
            top,
            offset,
        });
        Ok(())
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
