//! The OpenAI request fields the server understands, read from the JSON body with an error
//! naming the field for every wrong type or value, and OpenAI's error shape
//! (`{"error": {"message", "type", "param", "code"}}`) with its HTTP status.
//!
//! Every key of the body is first checked against [`FIELDS`](crate::serve::fields::FIELDS):
//! a field the server does not support (with a value that asks for something) or does not know
//! is a 400 naming it, never silently ignored.

use serde_json::{Map, Value};

use crate::generate::Penalties;
use crate::serve::fields::{boolean, check_fields, in_range, integer, kind_of, number};
use crate::serve::grammar::GrammarSpec;
use crate::serve::messages::messages;
use crate::serve::options::{choices, logprobs, penalties, prompts};
pub use crate::serve::options::{Prompt, MAX_CHOICES, MAX_PROMPTS};
use crate::serve::response_format::response_format;
use crate::serve::tools::{tools, ToolChoice, Tools};
use crate::text::{ChatMessage, MAX_STOP_BYTES};

/// An error answer: HTTP status and OpenAI's error object.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status code.
    pub status: u16,
    /// Human-readable message.
    pub message: String,
    /// OpenAI's `type` (`invalid_request_error`, `server_error`, ...).
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code (`model_not_found`, `context_length_exceeded`, ...).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 `invalid_request_error` about `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
        }
    }

    /// An error with `status`, `kind` and `code`.
    pub fn new(
        status: u16,
        kind: &'static str,
        code: Option<&'static str>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

/// Checks that `e` is a 400 about `param` whose message says `says` (`what`: the input, for
/// the failure message).
#[cfg(test)]
pub(crate) fn assert_refused(e: &ApiError, param: &str, says: &str, what: &dyn std::fmt::Display) {
    assert_eq!(e.status, 400, "{what}");
    assert_eq!(e.param.as_deref(), Some(param), "{what}: {e:?}");
    assert!(e.message.contains(says), "{what}: {}", e.message);
}

/// The text of `e` for an API client: candle's message and contexts without the Rust
/// backtrace that `RUST_BACKTRACE` attaches (frames and source paths are for the server's log,
/// not for clients).
pub fn client_message(e: &candle_core::Error) -> String {
    use candle_core::Error;
    match e {
        Error::WithBacktrace { inner, .. } => client_message(inner),
        Error::Context { inner, context } => format!("{context}: {}", client_message(inner)),
        Error::WithPath { inner, path } => format!("{}: {}", path.display(), client_message(inner)),
        e => e.to_string(),
    }
}

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

    #[test]
    fn client_messages_carry_no_backtrace() {
        let traced = candle_core::Error::WithBacktrace {
            inner: Box::new(candle_core::Error::Msg("peer rank 1 is gone".into())),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        };
        let e = traced.context("the model step failed");
        assert!(e.to_string().contains("peer rank 1 is gone\n"), "{e}");
        assert_eq!(
            client_message(&e),
            "the model step failed: peer rank 1 is gone"
        );
    }

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
}
