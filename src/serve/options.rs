//! The request fields that shape what is generated besides sampling: the prompts of
//! `/v1/completions` (text, token ids, a batch), `n`, `logprobs` / `top_logprobs`, and the
//! penalties; each read with a 400 naming the field and the value.

use serde_json::{Map, Value};

use crate::generate::{Penalties, MAX_TOP_LOGPROBS};
use crate::serve::error::ApiError;
use crate::serve::fields::{boolean, in_range, integer, kind_of, number, short};

/// A completions prompt: text (tokenized by the server) or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Text, tokenized with the tokenizer's special tokens (BOS...).
    Text(String),
    /// Token ids, used as they are.
    Ids(Vec<u32>),
}

/// The most prompts one request may batch (`prompt` as an array).
pub const MAX_PROMPTS: usize = 64;

/// A JSON array of token ids (`at`: the field's name in messages).
fn token_ids(a: &[Value], at: &str) -> Result<Vec<u32>, ApiError> {
    a.iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| {
                    ApiError::invalid(
                        "prompt",
                        format!(
                            "'{at}[{i}]' = {} is not a token id (an integer from 0 to 2^32 - 1)",
                            short(v)
                        ),
                    )
                })
        })
        .collect()
}

/// `prompt`: a string, an array of strings (a batch), an array of token ids, or an array of
/// arrays of token ids (a batch), as OpenAI's.
pub(crate) fn prompts(o: &Map<String, Value>) -> Result<Vec<Prompt>, ApiError> {
    let list = match o.get("prompt") {
        Some(Value::String(s)) => return Ok(vec![Prompt::Text(s.clone())]),
        Some(Value::Array(a)) if a.first().is_some_and(Value::is_number) => {
            return Ok(vec![Prompt::Ids(token_ids(a, "prompt")?)])
        }
        Some(Value::Array(a)) => a,
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("prompt", "'prompt' is required"))
        }
        Some(v) => {
            return Err(ApiError::invalid(
                "prompt",
                format!(
                    "'prompt' must be a string, an array of strings, or token ids, got {}",
                    kind_of(v)
                ),
            ))
        }
    };
    if list.is_empty() {
        return Err(ApiError::invalid("prompt", "'prompt' is an empty array"));
    }
    if list.len() > MAX_PROMPTS {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "'prompt' holds {} prompts, at most {MAX_PROMPTS}",
                list.len()
            ),
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, p)| match p {
            Value::String(s) => Ok(Prompt::Text(s.clone())),
            Value::Array(ids) => Ok(Prompt::Ids(token_ids(ids, &format!("prompt[{i}]"))?)),
            v => Err(ApiError::invalid(
                "prompt",
                format!(
                    "'prompt[{i}]' must be a string or an array of token ids, got {}",
                    kind_of(v)
                ),
            )),
        })
        .collect()
}

/// The most choices one request may ask for (`n` times the prompts).
pub const MAX_CHOICES: usize = 64;

/// `n`: choices per prompt, 1 to [`MAX_CHOICES`].
pub(crate) fn choices(o: &Map<String, Value>) -> Result<usize, ApiError> {
    match integer(o, "n")? {
        None => Ok(1),
        Some(n) if (1..=MAX_CHOICES as i128).contains(&n) => Ok(n as usize),
        Some(n) => Err(ApiError::invalid(
            "n",
            format!("'n' = {n} is outside [1, {MAX_CHOICES}]"),
        )),
    }
}

/// `logprobs` (and `top_logprobs` for chat): `None` or the top entries per token.
pub(crate) fn logprobs(o: &Map<String, Value>, chat: bool) -> Result<Option<usize>, ApiError> {
    let top = |key: &str| -> Result<Option<usize>, ApiError> {
        match integer(o, key)? {
            None => Ok(None),
            Some(n) if (0..=MAX_TOP_LOGPROBS as i128).contains(&n) => Ok(Some(n as usize)),
            Some(n) => Err(ApiError::invalid(
                key,
                format!("'{key}' = {n} is outside [0, {MAX_TOP_LOGPROBS}]"),
            )),
        }
    };
    if !chat {
        return top("logprobs");
    }
    let on = boolean(o, "logprobs")?;
    let n = top("top_logprobs")?;
    match (on, n) {
        (false, Some(n)) => Err(ApiError::invalid(
            "top_logprobs",
            format!("'top_logprobs' = {n} needs 'logprobs': true"),
        )),
        (false, None) => Ok(None),
        (true, n) => Ok(Some(n.unwrap_or(0))),
    }
}

/// The penalties: OpenAI's presence and frequency penalties in [-2, 2], vLLM's repetition
/// penalty in (0, 100], `logit_bias` as OpenAI's (token id strings to biases in [-100, 100]).
pub(crate) fn penalties(o: &Map<String, Value>) -> Result<Penalties, ApiError> {
    let presence = number(o, "presence_penalty")?;
    in_range("presence_penalty", presence, -2.0, 2.0, false)?;
    let frequency = number(o, "frequency_penalty")?;
    in_range("frequency_penalty", frequency, -2.0, 2.0, false)?;
    let repetition = number(o, "repetition_penalty")?;
    in_range("repetition_penalty", repetition, 0.0, 100.0, true)?;
    // The penalty is applied in f32: a value that rounds to 0 there is 0.
    if let Some(r) = repetition.filter(|&r| r as f32 <= 0.0) {
        return Err(ApiError::invalid(
            "repetition_penalty",
            format!("'repetition_penalty' = {r:e} is 0 in single precision; it must be above 0"),
        ));
    }
    let mut logit_bias = Vec::new();
    match o.get("logit_bias") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) => {
            for (k, v) in m {
                let id: u32 = k.trim().parse().map_err(|_| {
                    ApiError::invalid(
                        "logit_bias",
                        format!(
                            "'logit_bias' key {k:?} is not a token id (a non-negative integer)"
                        ),
                    )
                })?;
                let bias = match v.as_f64() {
                    Some(b) if (-100.0..=100.0).contains(&b) => b,
                    _ => {
                        return Err(ApiError::invalid(
                            "logit_bias",
                            format!(
                                "'logit_bias' of token {id} = {} must be a number in [-100, 100]",
                                short(v)
                            ),
                        ))
                    }
                };
                logit_bias.push((id, bias as f32));
            }
            logit_bias.sort_by_key(|e| e.0);
            if let Some(w) = logit_bias.windows(2).find(|w| w[0].0 == w[1].0) {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!("'logit_bias' names token {} twice", w[0].0),
                ));
            }
        }
        Some(v) => {
            return Err(ApiError::invalid(
                "logit_bias",
                format!(
                    "'logit_bias' must be an object of token ids to biases, got {}",
                    kind_of(v)
                ),
            ))
        }
    }
    Ok(Penalties {
        presence: presence.unwrap_or(0.0) as f32,
        frequency: frequency.unwrap_or(0.0) as f32,
        repetition: repetition.unwrap_or(1.0) as f32,
        logit_bias,
    })
}
