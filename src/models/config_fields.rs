//! The fields every family's `config.json` shares, read and checked once ([`Base`], by a
//! family's [`Rules`]): missing values that would change the results (`rope_theta`,
//! `head_dim` where it cannot be derived) are errors naming the file and key, never silent
//! defaults. The families build on it; the registry that picks one ([`super::family`]) is
//! above them.

use std::path::Path;

use candle_core::Result;
use candle_nn::Activation;
use serde::Deserialize;

use crate::models::DecoderConfig;
use crate::nn::{AttentionConfig, Llama3RopeScaling};

/// Most values one RoPE table may hold (`max_position_embeddings` x `head_dim`): 2^30, so
/// 4 GiB in f32; Llama 3.1's 131072 positions x 128 need 2^24.
pub(crate) const MAX_ROPE_ELEMENTS: usize = 1 << 30;

/// `eos_token_id`: one id or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(crate) enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    /// The ids, none when the key is absent.
    pub(crate) fn to_vec(ids: Option<&Self>) -> Vec<u32> {
        match ids {
            None => Vec::new(),
            Some(Self::One(t)) => vec![*t],
            Some(Self::Many(v)) => v.clone(),
        }
    }
}

/// The KV heads and the head width of a `config.json` (`num_key_value_heads` defaults to the
/// query heads, `head_dim` to `hidden_size / num_attention_heads`), checked; the error is
/// the message, without the file.
pub(crate) fn heads_and_dim(
    hidden_size: usize,
    heads: usize,
    num_kv_heads: Option<usize>,
    head_dim: Option<usize>,
) -> std::result::Result<(usize, usize), String> {
    let num_kv_heads = num_kv_heads.unwrap_or(heads);
    if heads == 0 || num_kv_heads == 0 || !heads.is_multiple_of(num_kv_heads) {
        return Err(format!(
            "num_attention_heads = {heads} must be a positive multiple of num_key_value_heads = {num_kv_heads}"
        ));
    }
    let head_dim = match head_dim {
        Some(d) => d,
        None if hidden_size.is_multiple_of(heads) => hidden_size / heads,
        None => {
            return Err(format!(
                "hidden_size = {hidden_size} is not a multiple of num_attention_heads = {heads} and there is no head_dim"
            ))
        }
    };
    Ok((num_kv_heads, head_dim))
}

/// Bounds the RoPE tables (`max_position_embeddings` x `head_dim` values each, built before
/// any forward pass), so that a hostile config cannot ask for terabytes.
pub(crate) fn check_rope_tables(
    max_position_embeddings: usize,
    head_dim: usize,
) -> std::result::Result<(), String> {
    let rope_elems = max_position_embeddings.checked_mul(head_dim);
    if max_position_embeddings == 0 || rope_elems.is_none_or(|n| n > MAX_ROPE_ELEMENTS) {
        return Err(format!(
            "max_position_embeddings = {max_position_embeddings} with head_dim = {head_dim} is \
             out of range: the RoPE tables would hold more than {MAX_ROPE_ELEMENTS} values each"
        ));
    }
    Ok(())
}

/// The text of the `config.json` at `path`, and the name errors give it.
pub(crate) fn read_config(path: &Path) -> Result<(String, String)> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        candle_core::Error::msg(format!("cannot read model config {}: {e}", path.display()))
    })?;
    Ok((text, path.display().to_string()))
}

/// The `config.json` fields the families share.
#[derive(Debug, Deserialize)]
pub(crate) struct Common {
    pub hidden_size: usize,
    pub intermediate_size: Option<usize>,
    pub vocab_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<serde_json::Value>,
    pub rope_parameters: Option<serde_json::Value>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: Option<bool>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<TokenIds>,
    pub hidden_act: Option<serde_json::Value>,
    pub hidden_activation: Option<serde_json::Value>,
    pub sliding_window: Option<usize>,
}

/// How a family reads RoPE's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rope {
    /// `rope_theta` at the top level, and no `rope_scaling`.
    Plain,
    /// Llama's: `rope_theta` at the top level or in `rope_parameters` (transformers 5; both
    /// set must agree), and Llama 3 frequency scaling from `rope_scaling` or
    /// `rope_parameters` (`rope_type` `llama3`; `default` or none for no scaling).
    Llama3,
}

/// A family's rules for the shared fields: what [`Base::parse_with`] reads and checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rules {
    /// How RoPE is read.
    pub rope: Rope,
    /// Whether `sliding_window = 0` is refused here. The Llama family reads the window for
    /// Mistral alone (and checks it there); Llama and Qwen2 ignore the key, whatever it holds.
    pub check_window: bool,
}

impl Rules {
    /// Every family's but Llama's.
    pub const PLAIN: Self = Self {
        rope: Rope::Plain,
        check_window: true,
    };
    /// The Llama family's (Llama, Mistral, Qwen2).
    pub const LLAMA: Self = Self {
        rope: Rope::Llama3,
        check_window: false,
    };
}

/// `rope_scaling` or `rope_parameters` as Llama reads them.
#[derive(Debug, Deserialize)]
struct RawRope {
    rope_theta: Option<f64>,
    #[serde(alias = "type")]
    rope_type: Option<String>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
}

/// The RoPE base and scaling of `raw` under `rope`; the error is the message, without the
/// file.
fn read_rope(
    raw: &Common,
    rope: Rope,
    architecture: &str,
) -> std::result::Result<(f64, Option<Llama3RopeScaling>), String> {
    let present = |v: &Option<serde_json::Value>| v.as_ref().filter(|v| !v.is_null()).cloned();
    if rope == Rope::Plain {
        let theta = raw
            .rope_theta
            .ok_or("'rope_theta' is not set (no default is assumed)")?;
        if let Some(s) = present(&raw.rope_scaling) {
            return Err(format!(
                "rope_scaling {s} is not supported for {architecture} (only none)"
            ));
        }
        return Ok((theta, None));
    }
    let mut tables = Vec::new();
    for (key, value) in [
        ("rope_scaling", present(&raw.rope_scaling)),
        ("rope_parameters", present(&raw.rope_parameters)),
    ] {
        if let Some(v) = value {
            let r: RawRope = serde_json::from_value(v).map_err(|e| format!("{key}: {e}"))?;
            tables.push((key, r));
        }
    }
    let nested = tables
        .iter()
        .find(|(key, _)| *key == "rope_parameters")
        .and_then(|(_, r)| r.rope_theta);
    let theta = match (raw.rope_theta, nested) {
        (Some(a), Some(b)) if a != b => {
            return Err(format!(
                "rope_theta = {a} and rope_parameters.rope_theta = {b} disagree"
            ))
        }
        (Some(t), _) | (None, Some(t)) => t,
        (None, None) => return Err(
            "neither 'rope_theta' nor 'rope_parameters.rope_theta' is set (no default is assumed)"
                .into(),
        ),
    };
    let mut scaling = None;
    for (key, r) in tables {
        match r.rope_type.as_deref() {
            None | Some("default") => {}
            Some("llama3") => {
                let (Some(f), Some(lo), Some(hi), Some(orig)) = (
                    r.factor,
                    r.low_freq_factor,
                    r.high_freq_factor,
                    r.original_max_position_embeddings,
                ) else {
                    return Err(format!(
                        "{key} of type llama3 needs factor, low_freq_factor, high_freq_factor and original_max_position_embeddings"
                    ));
                };
                scaling = Some(Llama3RopeScaling {
                    factor: f as f32,
                    low_freq_factor: lo as f32,
                    high_freq_factor: hi as f32,
                    original_max_position_embeddings: orig,
                });
            }
            Some(other) => {
                return Err(format!(
                    "{key}.rope_type '{other}' is not supported (default or llama3)"
                ))
            }
        }
    }
    Ok((theta, scaling))
}

/// The shared fields, checked.
#[derive(Debug)]
pub(crate) struct Base {
    pub raw: Common,
    pub origin: String,
    pub architecture: String,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    /// Llama 3 RoPE scaling ([`Rope::Llama3`] only).
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub eos_token_ids: Vec<u32>,
}

impl Base {
    /// Parses and checks the shared fields of `text` by the rules of every family but Llama's
    /// ([`Rules::PLAIN`]).
    pub fn parse(text: &str, origin: &str, architecture: &str) -> Result<Self> {
        Self::parse_with(text, origin, architecture, Rules::PLAIN)
    }

    /// Parses and checks the shared fields of `text` by a family's `rules`.
    pub fn parse_with(text: &str, origin: &str, architecture: &str, rules: Rules) -> Result<Self> {
        let raw: Common = serde_json::from_str(text)
            .map_err(|e| candle_core::Error::msg(format!("{origin}: invalid config: {e}")))?;
        let err = |m: String| candle_core::Error::msg(format!("{origin}: {m}"));
        let (num_kv_heads, head_dim) = heads_and_dim(
            raw.hidden_size,
            raw.num_attention_heads,
            raw.num_key_value_heads,
            raw.head_dim,
        )
        .map_err(err)?;
        let (rope_theta, rope_scaling) = read_rope(&raw, rules.rope, architecture).map_err(err)?;
        check_rope_tables(raw.max_position_embeddings, head_dim).map_err(err)?;
        if rules.check_window && raw.sliding_window == Some(0) {
            return Err(err(
                "sliding_window = 0: a query must see at least itself".into()
            ));
        }
        let eos_token_ids = TokenIds::to_vec(raw.eos_token_id.as_ref());
        Ok(Self {
            raw,
            origin: origin.to_string(),
            architecture: architecture.to_string(),
            num_kv_heads,
            head_dim,
            rope_theta,
            rope_scaling,
            eos_token_ids,
        })
    }

    /// An error about this config.
    pub fn error(&self, msg: impl std::fmt::Display) -> candle_core::Error {
        candle_core::Error::msg(format!("{}: {msg}", self.origin))
    }

    /// `intermediate_size`, required.
    pub fn intermediate_size(&self) -> Result<usize> {
        self.raw
            .intermediate_size
            .ok_or_else(|| self.error("'intermediate_size' is not set"))
    }

    /// The activation named by `hidden_activation` or `hidden_act` (candle-nn's names);
    /// `default` when neither is set.
    pub fn activation(&self, default: Option<Activation>) -> Result<Activation> {
        let (key, v) = match (&self.raw.hidden_activation, &self.raw.hidden_act) {
            (Some(v), _) if !v.is_null() => ("hidden_activation", v),
            (_, Some(v)) if !v.is_null() => ("hidden_act", v),
            _ => return default.ok_or_else(|| self.error("'hidden_act' is not set")),
        };
        serde_json::from_value(v.clone())
            .map_err(|e| self.error(format!("{key} {v} is not supported: {e}")))
    }

    /// Attention settings common to the families: no bias unless `attention_bias`, full
    /// RoPE with `rope_theta` (and Llama 3 scaling if read), no window; families set their
    /// hooks on top.
    pub fn attention(&self) -> AttentionConfig {
        let bias = self.raw.attention_bias.unwrap_or(false);
        AttentionConfig {
            qkv_bias: bias,
            o_bias: bias,
            rope_scaling: self.rope_scaling,
            ..AttentionConfig::new(
                self.raw.hidden_size,
                self.raw.num_attention_heads,
                self.num_kv_heads,
                self.head_dim,
                self.rope_theta as f32,
                self.raw.max_position_embeddings,
            )
        }
    }

    /// A decoder config with these shared values and the given layers and norm; families
    /// adjust the rest.
    pub fn decoder(
        &self,
        layers: Vec<crate::models::LayerConfig>,
        norm: crate::nn::RmsNormSpec,
        tie_default: bool,
    ) -> DecoderConfig {
        DecoderConfig {
            tie_word_embeddings: self.raw.tie_word_embeddings.unwrap_or(tie_default),
            bos_token_id: self.raw.bos_token_id,
            eos_token_ids: self.eos_token_ids.clone(),
            ..DecoderConfig::new(
                self.architecture.clone(),
                self.raw.hidden_size,
                self.raw.vocab_size,
                self.raw.max_position_embeddings,
                norm,
                layers,
            )
        }
    }
}
