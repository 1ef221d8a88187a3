//! Grammars over the model's tokens with llguidance (the library behind llama.cpp's, vLLM's
//! and SGLang's structured outputs): JSON schemas for `response_format`, Lark grammars for
//! forced tool calls. [`Grammars`] is built once at start-up on rank 0 from the tokenizer; each
//! constrained choice gets a [`GrammarFilter`], the batch decoder's
//! [`TokenFilter`].
//!
//! The token trie is built from the tokenizer's own JSON (`tokenizer.json`, or the one built
//! from a GGUF file) by llguidance's `token_bytes_from_tokenizer_json` (byte-level BPE and
//! SentencePiece byte-fallback vocabularies): `toktrie_hf_tokenizers` would want the
//! `tokenizers` crate 0.21, this crate has 0.23. Special tokens can only be written by a
//! grammar that names them; the model's end-of-sequence ids are the trie's, so a grammar
//! allows them exactly where it is complete.
//!
//! JSON is generated with fixed separators (`", "` and `": "`, no other whitespace): flexible
//! whitespace would let a sampled sequence spend its tokens on blank lines. A schema's own
//! `x-guidance` options win.

use std::sync::Arc;

use candle_core::Result;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use crate::generate::TokenFilter;
use crate::text::ModelText;

fn err(what: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::msg(what.to_string())
}

/// A grammar to compile: a JSON schema (structured outputs) or a Lark grammar (tool calls).
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON value the schema validates.
    JsonSchema(Value),
    /// llguidance's Lark dialect (`%json {...}` embeds a schema).
    Lark(String),
}

/// The JSON options the server generates with (see the module documentation), as a schema's
/// `x-guidance` member.
pub fn json_options() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// `schema` with the server's JSON options unless it sets its own.
pub fn with_json_options(schema: &Value) -> Value {
    let mut s = schema.clone();
    if let Some(o) = s.as_object_mut() {
        o.entry("x-guidance").or_insert_with(json_options);
    }
    s
}

/// The tokenizer as llguidance sees it: the trie of every id's bytes, and the tokenizer itself
/// for the text llguidance tokenizes (literals of a grammar).
struct TokenizerBytes {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for TokenizerBytes {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| {
            self.tokenizer
                .encode(s, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

/// The grammar compiler for one model's tokenizer (rank 0; cheap to clone).
#[derive(Clone)]
pub struct Grammars {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab", &self.factory.tok_env().tok_trie().vocab_size())
            .finish()
    }
}

impl Grammars {
    /// The compiler for `text`'s tokenizer over a model of `vocab_size` ids (ids the tokenizer
    /// lacks are never allowed) whose sequences end at the `eos` ids.
    pub fn new(text: &ModelText, vocab_size: usize, eos: &[u32]) -> Result<Self> {
        let tokenizer = text.tokenizer().clone();
        let json: Value = serde_json::from_str(
            &tokenizer
                .to_string(false)
                .map_err(|e| err(format!("grammars: serializing the tokenizer: {e}")))?,
        )
        .map_err(|e| err(format!("grammars: the tokenizer's JSON: {e}")))?;
        let mut bytes = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| err(format!("grammars: the tokens' bytes: {e}")))?;
        let n = bytes.len().max(vocab_size);
        // Ids without bytes (holes, the model's padding past the tokenizer) as special tokens
        // no grammar names: never allowed.
        bytes.resize(n, Vec::new());
        for (id, b) in bytes.iter_mut().enumerate() {
            if b.is_empty() {
                *b = format!(".<[{id}]>").into_bytes();
                b[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            }
        }
        let Some(&first) = eos.first() else {
            candle_core::bail!("grammars: the model has no end-of-sequence token");
        };
        if let Some(&bad) = eos.iter().find(|&&e| e as usize >= n) {
            candle_core::bail!("grammars: end-of-sequence id {bad} is outside the {n} tokens");
        }
        let info = TokRxInfo::new(n as u32, first);
        let trie = TokTrie::from(&info, &bytes).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(TokenizerBytes { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| err(format!("grammars: building the parser factory: {e}")))?;
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
        })
    }

    /// Compiles `spec`; the error is llguidance's message (a schema or grammar it cannot
    /// compile: the request's fault).
    pub fn compile(&self, spec: &GrammarSpec) -> std::result::Result<GrammarFilter, String> {
        let grammar = match spec {
            GrammarSpec::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(with_json_options(schema))
            }
            GrammarSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(GrammarFilter { matcher })
    }

    /// The number of ids the masks cover.
    pub fn vocab_size(&self) -> usize {
        self.factory.tok_env().tok_trie().vocab_size()
    }
}

/// One sequence's grammar state.
#[derive(Clone)]
pub struct GrammarFilter {
    matcher: Matcher,
}

impl std::fmt::Debug for GrammarFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarFilter")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl TokenFilter for GrammarFilter {
    fn allowed(&mut self, allowed: &mut [u32]) -> Result<()> {
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| err(format!("grammar: {e}")))?;
        let words = mask.as_slice();
        let n = words.len().min(allowed.len());
        allowed[..n].copy_from_slice(&words[..n]);
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<()> {
        if self.matcher.is_stopped() {
            return Ok(()); // the end-of-sequence token after an accepted grammar
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| err(format!("grammar: token {token}: {e}")))
    }
}
