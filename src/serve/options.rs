//! The request fields that shape what is generated besides sampling: the prompts of
//! `/v1/completions` (text, token ids, a batch), `n`, `logprobs` / `top_logprobs`, and the
//! penalties; each read with a 400 naming the field and the value.

use serde_json::{Map, Value};

use crate::generate::{Penalties, MAX_TOP_LOGPROBS};
use crate::serve::api::ApiError;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::api::GenRequest;

    #[test]
    fn logprobs_and_penalties() {
        let parse = |b: &str, chat| GenRequest::parse(b.as_bytes(), chat);
        let chat = |extra: &str| {
            parse(
                &format!(r#"{{"messages": [{{"role": "user", "content": "hi"}}]{extra}}}"#),
                true,
            )
        };
        assert_eq!(chat("").unwrap().logprobs, None);
        assert_eq!(chat(r#", "logprobs": true"#).unwrap().logprobs, Some(0));
        assert_eq!(
            chat(r#", "logprobs": true, "top_logprobs": 20"#)
                .unwrap()
                .logprobs,
            Some(20)
        );
        assert_eq!(chat(r#", "logprobs": false"#).unwrap().logprobs, None);
        for (extra, param, says) in [
            (
                r#", "logprobs": true, "top_logprobs": 21"#,
                "top_logprobs",
                "21",
            ),
            (r#", "top_logprobs": 2"#, "top_logprobs", "logprobs"),
            (r#", "logprobs": 3"#, "logprobs", "boolean"),
            (r#", "presence_penalty": 2.5"#, "presence_penalty", "2.5"),
            (
                r#", "frequency_penalty": "x""#,
                "frequency_penalty",
                "number",
            ),
            (r#", "repetition_penalty": 0"#, "repetition_penalty", "0"),
            // Above 0, but 0 once in f32 (issue 44: it failed in the queue, a 503).
            (
                r#", "repetition_penalty": 1e-50"#,
                "repetition_penalty",
                "single precision",
            ),
            (r#", "logit_bias": {"abc": 1}"#, "logit_bias", "abc"),
            (r#", "logit_bias": {"5": 101}"#, "logit_bias", "101"),
            (
                r#", "logit_bias": {"5": 1, "05": 2}"#,
                "logit_bias",
                "twice",
            ),
            (r#", "logit_bias": [1]"#, "logit_bias", "object"),
            (
                r#", "stream_options": {"foo": true}"#,
                "stream_options",
                "foo",
            ),
            (r#", "tools": {"a": 1}"#, "tools", "array"),
            (r#", "messages2": 1"#, "messages2", "unknown"),
        ] {
            let e = chat(extra).unwrap_err();
            assert_eq!(e.status, 400, "{extra}");
            assert_eq!(e.param.as_deref(), Some(param), "{extra}: {e:?}");
            assert!(e.message.contains(says), "{extra}: {}", e.message);
        }
        let e = parse(
            r#"{"messages": [{"role": "user", "content": "hi", "image": 1}]}"#,
            true,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].image"), "{e:?}");
        let r = parse(
            r#"{"messages": [{"role": "user", "content": "hi", "name": "ann", "refusal": null}]}"#,
            true,
        )
        .unwrap();
        assert_eq!(r.messages.unwrap()[0].extra["name"], "ann");
        let r = parse(
            r#"{"prompt": "a", "logprobs": 3, "presence_penalty": -1, "frequency_penalty": 0.5,
                "repetition_penalty": 1.2, "logit_bias": {"7": -100, "3": 2.5}}"#,
            false,
        )
        .unwrap();
        assert_eq!(r.logprobs, Some(3));
        let ps = |b: &str| parse(b, false).map(|r| (r.prompts, r.n));
        assert_eq!(
            ps(r#"{"prompt": [1, 2, 3], "n": 3}"#).unwrap(),
            (vec![Prompt::Ids(vec![1, 2, 3])], 3)
        );
        assert_eq!(
            ps(r#"{"prompt": ["a", [4, 5]]}"#).unwrap(),
            (vec![Prompt::Text("a".into()), Prompt::Ids(vec![4, 5])], 1)
        );
        for b in [
            r#"{"prompt": []}"#,
            r#"{"prompt": [1, -2]}"#,
            r#"{"prompt": [1, "a"]}"#,
            r#"{"prompt": [[1], {}]}"#,
            r#"{"prompt": [1.5]}"#,
        ] {
            let e = ps(b).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("prompt"), "{b}: {e:?}");
        }
        assert_eq!(
            ps(r#"{"prompt": "a", "n": 65}"#)
                .unwrap_err()
                .param
                .as_deref(),
            Some("n")
        );
        assert_eq!(
            r.penalties,
            Penalties {
                presence: -1.0,
                frequency: 0.5,
                repetition: 1.2,
                logit_bias: vec![(3, 2.5), (7, -100.0)],
            }
        );
        assert_eq!(
            parse(r#"{"prompt": "a", "logprobs": -1}"#, false)
                .unwrap_err()
                .param
                .as_deref(),
            Some("logprobs")
        );
    }
}
