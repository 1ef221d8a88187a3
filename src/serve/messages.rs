//! A chat request's `messages`: each message's role, its content (a string or text parts) and
//! the keys passed on to the chat template; anything else is a 400 naming the message's field.

use serde_json::{Map, Value};

use crate::serve::error::ApiError;
use crate::serve::fields::{kind_of, short};
use crate::text::ChatMessage;

/// A message's `content`: a string or an array of `{"type": "text", "text": ...}` parts (joined
/// with a newline, as vLLM joins them; a part with any other key is refused, naming it); for
/// an assistant message also null or absent (as OpenAI's: one that only calls tools), read as
/// empty.
fn content(v: Option<&Value>, role: &str, i: usize) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match v {
        None | Some(Value::Null) if role == "assistant" => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let texts = parts
                .iter()
                .enumerate()
                .map(|(j, p)| text_part(p, &format!("{param}[{j}]")))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(texts.join("\n"))
        }
        Some(v) => Err(ApiError::invalid(
            &param,
            format!(
                "'{param}' must be a string or an array of text parts, got {}",
                kind_of(v)
            ),
        )),
        None => Err(ApiError::invalid(&param, format!("'{param}' is missing"))),
    }
}

/// One text part's text; `param` names the part (`messages[0].content[1]`).
fn text_part<'a>(p: &'a Value, param: &str) -> Result<&'a str, ApiError> {
    let only_text = || {
        ApiError::invalid(
            param,
            format!(
                "'{param}': only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported"
            ),
        )
    };
    let o = p.as_object().ok_or_else(only_text)?;
    if o.get("type").and_then(Value::as_str) != Some("text") {
        return Err(only_text());
    }
    if let Some(k) = o.keys().find(|k| !matches!(k.as_str(), "type" | "text")) {
        let at = format!("{param}.{k}");
        return Err(ApiError {
            code: Some("unknown_parameter"),
            ..ApiError::invalid(&at, format!("unknown field '{at}'"))
        });
    }
    match (
        o.get("type").and_then(Value::as_str),
        o.get("text").and_then(Value::as_str),
    ) {
        (Some("text"), Some(t)) => Ok(t),
        _ => Err(only_text()),
    }
}

/// The `messages` of a chat request, each checked.
pub(crate) fn messages(o: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
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
                extra: message_extra(m, i)?,
            })
        })
        .collect()
}

/// A message's keys besides `role` and `content`: `name`, `tool_calls`, `tool_call_id` and
/// `reasoning_content` go to the chat template as they are (it renders them, or not, as
/// transformers would); `refusal`, `audio`, `function_call` and `annotations` are accepted
/// only as null (what a client echoes back from an answer); any other key is refused.
fn message_extra(m: &Value, i: usize) -> Result<Map<String, Value>, ApiError> {
    let mut extra = Map::new();
    let Some(o) = m.as_object() else {
        return Ok(extra);
    };
    for (k, v) in o {
        let param = format!("messages[{i}].{k}");
        let ok = match (k.as_str(), v) {
            ("role" | "content", _) | (_, Value::Null) => continue,
            ("name" | "tool_call_id" | "reasoning_content", Value::String(_)) => true,
            ("tool_calls", Value::Array(_)) => true,
            ("name" | "tool_call_id" | "reasoning_content" | "tool_calls", _) => {
                return Err(ApiError::invalid(
                    &param,
                    format!(
                        "'{param}' must be {}, got {}",
                        if k == "tool_calls" {
                            "an array"
                        } else {
                            "a string"
                        },
                        kind_of(v)
                    ),
                ))
            }
            ("refusal" | "audio" | "function_call" | "annotations", _) => false,
            _ => {
                return Err(ApiError {
                    code: Some("unknown_parameter"),
                    ..ApiError::invalid(&param, format!("unknown field '{param}'"))
                })
            }
        };
        if !ok {
            return Err(ApiError {
                code: Some("unsupported_parameter"),
                ..ApiError::invalid(
                    &param,
                    format!(
                        "'{param}' = {} is not supported (accepted: null or absent)",
                        short(v)
                    ),
                )
            });
        }
        extra.insert(k.clone(), v.clone());
    }
    Ok(extra)
}
