//! The OpenAI request fields the server understands, read from the JSON body with an error
//! naming the field for every wrong type or value, and OpenAI's error shape
//! (`{"error": {"message", "type", "param", "code"}}`) with its HTTP status.
//!
//! Fields the server does not know (`user`, `logprobs`, `frequency_penalty`, ...) are
//! ignored, as OpenAI-compatible servers commonly do, so that every client's defaults work.

use serde_json::{Map, Value};

use crate::serve::text::ChatMessage;

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
    /// The prompt text (`/v1/completions`).
    pub prompt: Option<String>,
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
}

fn number(o: &Map<String, Value>, key: &str) -> Result<Option<f64>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(v) => Err(ApiError::invalid(
            key,
            format!("'{key}' must be a number, got {}", kind_of(v)),
        )),
    }
}

fn integer(o: &Map<String, Value>, key: &str) -> Result<Option<i128>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Ok(Some(i as i128)),
            (_, Some(u)) => Ok(Some(u as i128)),
            _ => Err(ApiError::invalid(
                key,
                format!("'{key}' must be an integer, got {n}"),
            )),
        },
        Some(v) => Err(ApiError::invalid(
            key,
            format!("'{key}' must be an integer, got {}", kind_of(v)),
        )),
    }
}

fn boolean(o: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ApiError::invalid(
            key,
            format!("'{key}' must be a boolean, got {}", kind_of(v)),
        )),
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn in_range(key: &str, v: Option<f64>, lo: f64, hi: f64, lo_open: bool) -> Result<(), ApiError> {
    if let Some(x) = v {
        let low_ok = if lo_open { x > lo } else { x >= lo };
        if !(low_ok && x <= hi) {
            let open = if lo_open { "(" } else { "[" };
            return Err(ApiError::invalid(
                key,
                format!("'{key}' = {x} is outside {open}{lo}, {hi}]"),
            ));
        }
    }
    Ok(())
}

/// A message's `content`: a string or an array of `{"type": "text", "text": ...}` parts; for
/// an assistant message also null or absent (as OpenAI's: one that only calls tools), read as
/// empty.
fn content(v: Option<&Value>, role: &str, i: usize) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match v {
        None | Some(Value::Null) if role == "assistant" => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| match (p["type"].as_str(), p["text"].as_str()) {
                (Some("text"), Some(t)) => Ok(t.to_string()),
                _ => Err(ApiError::invalid(
                    &param,
                    format!("'{param}': only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported"),
                )),
            })
            .collect(),
        Some(v) => Err(ApiError::invalid(
            &param,
            format!("'{param}' must be a string or an array of text parts, got {}", kind_of(v)),
        )),
        None => Err(ApiError::invalid(&param, format!("'{param}' is missing"))),
    }
}

fn messages(o: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let list = match o.get("messages") {
        Some(Value::Array(l)) => l,
        None => return Err(ApiError::invalid("messages", "'messages' is required")),
        Some(v) => {
            return Err(ApiError::invalid(
                "messages",
                format!("'messages' must be an array, got {}", kind_of(v)),
            ))
        }
    };
    if list.is_empty() {
        return Err(ApiError::invalid("messages", "'messages' is empty"));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m["role"].as_str().ok_or_else(|| {
                ApiError::invalid(
                    &format!("messages[{i}].role"),
                    format!("'messages[{i}].role' must be a string"),
                )
            })?;
            if !matches!(role, "system" | "user" | "assistant" | "developer" | "tool") {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    format!("'messages[{i}].role' = {role:?} is not one of system, user, assistant, developer, tool"),
                ));
            }
            Ok(ChatMessage {
                role: role.to_string(),
                content: content(m.get("content"), role, i)?,
            })
        })
        .collect()
}

fn prompt(o: &Map<String, Value>) -> Result<String, ApiError> {
    match o.get("prompt") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Ok(a[0].as_str().unwrap_or_default().to_string())
        }
        Some(Value::Array(a)) => Err(ApiError::invalid(
            "prompt",
            format!(
                "'prompt' as an array must hold exactly one string (n = 1), got {} items",
                a.len()
            ),
        )),
        None => Err(ApiError::invalid("prompt", "'prompt' is required")),
        Some(v) => Err(ApiError::invalid(
            "prompt",
            format!("'prompt' must be a string, got {}", kind_of(v)),
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
    Ok(list)
}

impl GenRequest {
    /// Reads a body; `chat` picks `messages` (chat) or `prompt` (completions).
    pub fn parse(body: &[u8], chat: bool) -> Result<Self, ApiError> {
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
        if let Some(n) = integer(&o, "n")? {
            if n != 1 {
                return Err(ApiError::invalid(
                    "n",
                    format!("'n' = {n}: only n = 1 is supported"),
                ));
            }
        }
        let key = if o.contains_key("max_completion_tokens") {
            "max_completion_tokens"
        } else {
            "max_tokens"
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
            Some(Value::Object(so)) => boolean(so, "include_usage")?,
            _ => false,
        };
        Ok(Self {
            model,
            messages: if chat { Some(messages(&o)?) } else { None },
            prompt: if chat { None } else { Some(prompt(&o)?) },
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
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn fields_and_errors() {
        let r = GenRequest::parse(
            br#"{"prompt": "hi", "max_tokens": 5, "stop": "x", "foo": 1}"#,
            false,
        )
        .unwrap();
        assert_eq!(
            (r.prompt.as_deref(), r.max_tokens, r.stop.len()),
            (Some("hi"), Some(5), 1)
        );
        let bad = |b: &str, chat| GenRequest::parse(b.as_bytes(), chat).unwrap_err();
        assert_eq!(bad("{", false).status, 400);
        assert_eq!(
            bad(r#"{"prompt": 3}"#, false).param.as_deref(),
            Some("prompt")
        );
        assert_eq!(
            bad(r#"{"prompt": "a", "max_tokens": 0}"#, false)
                .param
                .as_deref(),
            Some("max_tokens")
        );
        assert_eq!(
            bad(r#"{"prompt": "a", "temperature": "hot"}"#, false)
                .param
                .as_deref(),
            Some("temperature")
        );
        assert_eq!(
            bad(r#"{"prompt": "a", "n": 2}"#, false).param.as_deref(),
            Some("n")
        );
        assert_eq!(
            bad(r#"{"messages": []}"#, true).param.as_deref(),
            Some("messages")
        );
        assert_eq!(
            bad(r#"{"messages": [{"role": "user"}]}"#, true)
                .param
                .as_deref(),
            Some("messages[0].content")
        );
        assert_eq!(
            bad(r#"{"messages": [{"role": "user", "content": null}]}"#, true)
                .param
                .as_deref(),
            Some("messages[0].content")
        );
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
        assert_eq!(
            bad(r#"{"prompt": "a", "return_token_ids": 1}"#, false)
                .param
                .as_deref(),
            Some("return_token_ids")
        );
        assert!(!r.return_token_ids);
        let r = GenRequest::parse(br#"{"prompt": "a", "return_token_ids": true}"#, false);
        assert!(r.unwrap().return_token_ids);
    }
}
