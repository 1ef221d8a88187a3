//! The OpenAI request fields the server understands, read from the JSON body with an error
//! naming the field for every wrong type or value ([`ApiError`], OpenAI's error shape, lives in
//! [`error`](crate::serve::error) and is re-exported here).
//!
//! Every key of the body is first checked against [`FIELDS`](crate::serve::fields::FIELDS):
//! a field the server does not support (with a value that asks for something) or does not know
//! is a 400 naming it, never silently ignored.
//!
//! The top of the request parsers: this file imports the field readers (`fields`,
//! `messages`, `options`, `response_format`, `tools`), none of which imports it back.

use serde_json::{Map, Value};

use crate::generate::Penalties;
pub use crate::serve::error::{client_message, ApiError};
use crate::serve::fields::{boolean, check_fields, in_range, integer, kind_of, number};
use crate::serve::grammar::GrammarSpec;
use crate::serve::messages::messages;
use crate::serve::options::{choices, logprobs, penalties, prompts};
pub use crate::serve::options::{Prompt, MAX_CHOICES, MAX_PROMPTS};
use crate::serve::response_format::response_format;
use crate::serve::tools::{tools, ToolChoice, Tools};
use crate::text::{ChatMessage, MAX_STOP_BYTES};

/// What the body asks for: the prompt (chat messages or text) and the generation settings.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    /// The `model` field, if given.
    pub model: Option<String>,
    /// Chat messages (`/v1/chat/completions`).
    pub messages: Option<Vec<ChatMessage>>,
    /// The prompts (`/v1/completions`: one, or a batch).
    pub prompts: Vec<Prompt>,
    /// `n`: choices per prompt.
    pub n: usize,
    /// `max_tokens` (or `max_completion_tokens`).
    pub max_tokens: Option<usize>,
    /// `min_tokens` (vLLM's extension): end-of-sequence cannot be drawn before this many.
    pub min_tokens: usize,
    /// `temperature` (default 1, as OpenAI's).
    pub temperature: f64,
    /// `top_p`.
    pub top_p: Option<f64>,
    /// `top_k` (0: off).
    pub top_k: Option<usize>,
    /// `seed`.
    pub seed: Option<u64>,
    /// `stop`: strings that end the text (not included).
    pub stop: Vec<String>,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `return_token_ids` (vLLM's extension): each choice also carries the generated ids as
    /// `token_ids` (per chunk when streaming) and the prompt's as `prompt_token_ids`.
    pub return_token_ids: bool,
    /// Log-probabilities: `None`, or the number of top entries per token (chat: `logprobs:
    /// true` with `top_logprobs`, default 0; completions: the integer `logprobs`).
    pub logprobs: Option<usize>,
    /// `presence_penalty`, `frequency_penalty`, `repetition_penalty` and `logit_bias`
    /// (ids not yet checked against the vocabulary).
    pub penalties: Penalties,
    /// The grammar `response_format` asks for (`None`: free text).
    pub response_format: Option<GrammarSpec>,
    /// `tools`, `tool_choice` and `parallel_tool_calls` (`None`: no tools).
    pub tools: Option<Tools>,
    /// `chat_template_kwargs` (vLLM's extension): further variables of the chat template, such
    /// as Qwen3's `enable_thinking`.
    pub template_kwargs: Vec<(String, Value)>,
}

/// `chat_template_kwargs`: an object of template variables. The variables the server sets
/// itself (`messages`, `tools`, `documents`, `add_generation_prompt`) are refused, naming the
/// key, as transformers refuses them.
fn template_kwargs(o: &Map<String, Value>) -> Result<Vec<(String, Value)>, ApiError> {
    const KEY: &str = "chat_template_kwargs";
    match o.get(KEY) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| {
                if crate::chat_template::RESERVED.contains(&k.as_str()) {
                    let param = format!("{KEY}.{k}");
                    return Err(ApiError::invalid(
                        &param,
                        format!("'{param}': the server sets '{k}' itself"),
                    ));
                }
                Ok((k.clone(), v.clone()))
            })
            .collect(),
        Some(v) => Err(ApiError::invalid(
            KEY,
            format!(
                "'{KEY}' must be an object of template variables, got {}",
                kind_of(v)
            ),
        )),
    }
}

fn stop(o: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    let list = match o.get("stop") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str().map(String::from).ok_or_else(|| {
                    ApiError::invalid("stop", "'stop' must be a string or an array of strings")
                })
            })
            .collect::<Result<_, _>>()?,
        Some(v) => {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "'stop' must be a string or an array of strings, got {}",
                    kind_of(v)
                ),
            ))
        }
    };
    if list.len() > 4 {
        return Err(ApiError::invalid(
            "stop",
            format!("'stop' has {} strings, at most 4", list.len()),
        ));
    }
    // Bounded: the text held back and scanned per token grows with the longest one.
    if let Some((i, long)) = list
        .iter()
        .enumerate()
        .find(|(_, s)| s.len() > MAX_STOP_BYTES)
    {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "'stop' string {i} has {} bytes, at most {MAX_STOP_BYTES}",
                long.len()
            ),
        ));
    }
    Ok(list)
}

/// A request body as a JSON object, or a 400 saying what it is instead.
pub(crate) fn json_object(body: &[u8]) -> Result<serde_json::Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            400,
            "invalid_request_error",
            None,
            format!("the body is not valid JSON: {e}"),
        )
    })?;
    let Value::Object(o) = v else {
        return Err(ApiError::new(
            400,
            "invalid_request_error",
            None,
            format!("the body must be a JSON object, got {}", kind_of(&v)),
        ));
    };
    Ok(o)
}

impl GenRequest {
    /// Reads a body; `chat` picks `messages` (chat) or `prompt` (completions).
    pub fn parse(body: &[u8], chat: bool) -> Result<Self, ApiError> {
        let o = json_object(body)?;
        let model = match o.get("model") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(v) => {
                return Err(ApiError::invalid(
                    "model",
                    format!("'model' must be a string, got {}", kind_of(v)),
                ))
            }
        };
        check_fields(&o, chat)?;
        // `max_completion_tokens` when it has a value: a null one (what some clients send for
        // "unset") leaves `max_tokens` in force.
        let key = match o.get("max_completion_tokens") {
            None | Some(Value::Null) => "max_tokens",
            Some(_) => "max_completion_tokens",
        };
        let max_tokens = match integer(&o, key)? {
            None => None,
            Some(n) if n < 1 => {
                return Err(ApiError::invalid(
                    key,
                    format!("'{key}' = {n} must be at least 1"),
                ))
            }
            Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        };
        let min_tokens = match integer(&o, "min_tokens")? {
            None => 0,
            Some(n) if n < 0 => {
                return Err(ApiError::invalid(
                    "min_tokens",
                    format!("'min_tokens' = {n} must be at least 0"),
                ))
            }
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        };
        if let Some(max) = max_tokens.filter(|&m| min_tokens > m) {
            return Err(ApiError::invalid(
                "min_tokens",
                format!("'min_tokens' = {min_tokens} exceeds '{key}' = {max}"),
            ));
        }
        let temperature = number(&o, "temperature")?;
        in_range("temperature", temperature, 0.0, 2.0, false)?;
        let top_p = number(&o, "top_p")?;
        in_range("top_p", top_p, 0.0, 1.0, true)?;
        let top_k = match integer(&o, "top_k")? {
            None | Some(0) | Some(-1) => None,
            Some(k) if k < 0 => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("'top_k' = {k} must be at least 0"),
                ))
            }
            Some(k) => Some(usize::try_from(k).unwrap_or(usize::MAX)),
        };
        let seed = integer(&o, "seed")?.map(|s| s as u64);
        let include_usage = match o.get("stream_options") {
            None | Some(Value::Null) => false,
            Some(Value::Object(so)) => {
                if let Some(k) = so
                    .keys()
                    .find(|k| !matches!(k.as_str(), "include_usage" | "include_obfuscation"))
                {
                    return Err(ApiError::invalid(
                        "stream_options",
                        format!(
                            "unknown field 'stream_options.{k}' (the server reads include_usage)"
                        ),
                    ));
                }
                boolean(so, "include_usage").map_err(|e| ApiError {
                    param: Some("stream_options.include_usage".into()),
                    ..e
                })?
            }
            Some(v) => {
                return Err(ApiError::invalid(
                    "stream_options",
                    format!("'stream_options' must be an object, got {}", kind_of(v)),
                ))
            }
        };
        let response_format = response_format(&o)?;
        let tools = if chat { tools(&o)? } else { None };
        let forced = tools.as_ref().is_some_and(|t| t.choice != ToolChoice::None);
        if forced && response_format.is_some() {
            return Err(ApiError::invalid(
                "response_format",
                "'response_format' other than text cannot be combined with 'tools' unless 'tool_choice' is \"none\"",
            ));
        }
        Ok(Self {
            model,
            messages: if chat { Some(messages(&o)?) } else { None },
            prompts: if chat { Vec::new() } else { prompts(&o)? },
            n: choices(&o)?,
            max_tokens,
            min_tokens,
            temperature: temperature.unwrap_or(1.0),
            top_p: top_p.filter(|&p| p < 1.0),
            top_k,
            seed,
            stop: stop(&o)?,
            stream: boolean(&o, "stream")?,
            include_usage,
            return_token_ids: boolean(&o, "return_token_ids")?,
            logprobs: logprobs(&o, chat)?,
            penalties: penalties(&o)?,
            response_format,
            tools,
            template_kwargs: if chat {
                template_kwargs(&o)?
            } else {
                Vec::new()
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A stop string longer than [`MAX_STOP_BYTES`] is a 400 naming the limit and its size.
    #[test]
    fn stop_strings_are_bounded() {
        let body = |stop: Value| json!({"prompt": "hi", "stop": stop}).to_string();
        let ok = "x".repeat(MAX_STOP_BYTES);
        let r = GenRequest::parse(body(json!(["a", ok])).as_bytes(), false).unwrap();
        assert_eq!(r.stop.len(), 2);
        let long = "é".repeat(MAX_STOP_BYTES / 2 + 1);
        let e = GenRequest::parse(body(json!(["a", long])).as_bytes(), false).unwrap_err();
        assert_eq!((e.status, e.param.as_deref()), (400, Some("stop")), "{e:?}");
        let want = format!(
            "'stop' string 1 has {} bytes, at most {MAX_STOP_BYTES}",
            MAX_STOP_BYTES + 2
        );
        assert_eq!(e.message, want);
    }

    #[test]
    fn fields_and_errors() {
        let r =
            GenRequest::parse(br#"{"prompt": "hi", "max_tokens": 5, "stop": "x"}"#, false).unwrap();
        assert_eq!(
            (r.prompts.clone(), r.max_tokens, r.stop.len()),
            (vec![Prompt::Text("hi".into())], Some(5), 1)
        );
        // A null max_completion_tokens is unset: max_tokens stands (issue 44).
        let r = GenRequest::parse(
            br#"{"prompt": "hi", "max_tokens": 7, "max_completion_tokens": null}"#,
            false,
        )
        .unwrap();
        assert_eq!(r.max_tokens, Some(7));
        let r = GenRequest::parse(
            br#"{"prompt": "hi", "max_tokens": 7, "max_completion_tokens": 3}"#,
            false,
        )
        .unwrap();
        assert_eq!(r.max_tokens, Some(3));
        let bad = |b: &str, chat| GenRequest::parse(b.as_bytes(), chat).unwrap_err();
        assert_eq!(bad("{", false).status, 400);
        let e = bad(r#"{"prompt": "hi", "foo": 1}"#, false);
        assert_eq!((e.status, e.param.as_deref()), (400, Some("foo")), "{e:?}");
        assert!(e.message.contains("'foo'"), "{}", e.message);
        for (body, chat, param) in [
            (r#"{"prompt": 3}"#, false, "prompt"),
            (r#"{"prompt": "a", "max_tokens": 0}"#, false, "max_tokens"),
            (
                r#"{"prompt": "a", "temperature": "hot"}"#,
                false,
                "temperature",
            ),
            (r#"{"prompt": "a", "n": 0}"#, false, "n"),
            (
                r#"{"prompt": "a", "return_token_ids": 1}"#,
                false,
                "return_token_ids",
            ),
            (r#"{"messages": []}"#, true, "messages"),
            (
                r#"{"messages": [{"role": "user"}]}"#,
                true,
                "messages[0].content",
            ),
            (
                r#"{"messages": [{"role": "user", "content": null}]}"#,
                true,
                "messages[0].content",
            ),
        ] {
            assert_eq!(bad(body, chat).param.as_deref(), Some(param), "{body}");
        }
        let r = GenRequest::parse(
            br#"{"messages": [{"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                 "function": {"name": "add", "arguments": "{}"}}]},
                {"role": "assistant"}]}"#,
            true,
        )
        .unwrap();
        let contents: Vec<_> = r.messages.unwrap().into_iter().map(|m| m.content).collect();
        assert_eq!(contents, ["2 + 2?", "", ""]);
        assert_eq!(bad("[1]", false).status, 400);
        assert!(!r.return_token_ids);
        let r = GenRequest::parse(br#"{"prompt": "a", "return_token_ids": true}"#, false);
        assert!(r.unwrap().return_token_ids);
    }

    // Of the fields read in messages.rs: through the whole request.

    fn chat(messages: &str) -> Result<GenRequest, ApiError> {
        GenRequest::parse(format!(r#"{{"messages": {messages}}}"#).as_bytes(), true)
    }

    /// Text parts are joined with a newline (as vLLM joins them); a part with another key is
    /// a 400 naming it (issue 44, defect 14).
    #[test]
    fn text_parts_are_lines_and_unknown_keys_are_named() {
        let r = chat(
            r#"[{"role": "user", "content": [{"type": "text", "text": "one"},
                {"type": "text", "text": "two"}]}]"#,
        )
        .unwrap();
        assert_eq!(r.messages.unwrap()[0].content, "one\ntwo");
        let e = chat(
            r#"[{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": 1}]}]"#,
        )
        .unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[0].cache_control"),
            "{e:?}"
        );
        let e = chat(r#"[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]"#)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0]"), "{e:?}");
    }

    /// `tool_choice` objects take `type` and `function.name` only; `chat_template_kwargs` is
    /// an object whose keys are not the server's own variables.
    #[test]
    fn tool_choice_and_template_kwargs_are_checked() {
        let tools = r#""tools": [{"type": "function", "function": {"name": "f",
            "parameters": {"type": "object"}}}]"#;
        let body = |extra: &str| {
            format!(r#"{{"messages": [{{"role": "user", "content": "hi"}}], {tools}, {extra}}}"#)
        };
        let ok = body(r#""tool_choice": {"type": "function", "function": {"name": "f"}}"#);
        assert!(GenRequest::parse(ok.as_bytes(), true).is_ok());
        for (extra, param) in [
            (
                r#""tool_choice": {"type": "function", "function": {"name": "f"}, "x": 1}"#,
                "tool_choice.x",
            ),
            (
                r#""tool_choice": {"type": "function", "function": {"name": "f", "arguments": "{}"}}"#,
                "tool_choice.function.arguments",
            ),
            (r#""chat_template_kwargs": [1]"#, "chat_template_kwargs"),
            (
                r#""chat_template_kwargs": {"messages": []}"#,
                "chat_template_kwargs.messages",
            ),
        ] {
            let e = GenRequest::parse(body(extra).as_bytes(), true).unwrap_err();
            assert_eq!(
                (e.status, e.param.as_deref()),
                (400, Some(param)),
                "{extra}: {e:?}"
            );
        }
        let r = GenRequest::parse(
            body(r#""chat_template_kwargs": {"enable_thinking": false}"#).as_bytes(),
            true,
        )
        .unwrap();
        assert_eq!(
            r.template_kwargs,
            vec![("enable_thinking".to_string(), serde_json::json!(false))]
        );
    }

    // Of the fields read in options.rs: through the whole request.

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
