//! Every field of OpenAI's chat and completions requests, and what the server does with it:
//! honours it, accepts it because it cannot change the answer, or refuses it (400 naming the
//! field) unless its value asks for nothing the server lacks (`functions: []`, `echo: false`,
//! `store: false`...). A field in no list (a typo, another server's
//! extension) is refused too: a request is never answered as if a field it relies on had
//! been read. docs/SERVE.md's table lists the same fields (a test checks it).
//!
//! The supported fields are read elsewhere: sampling and limits in [`api`](super::api),
//! prompts, `n`, log-probabilities and penalties in `options`, `messages` in `messages`,
//! `response_format` in `response_format`, `tools`, `tool_choice` and `parallel_tool_calls`
//! in [`tools`](super::tools).
//!
//! Also the typed readers of a JSON body's fields, each with an error naming the field.

use serde_json::{Map, Value};

use crate::serve::error::ApiError;

/// What the server does with a field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Treatment {
    /// Read and honoured.
    Supported,
    /// Accepted without effect: it cannot change the generated answer (an end-user id, a
    /// cache hint, metadata for storage the server does not have).
    NoEffect,
    /// Refused with a 400 unless the value is the neutral one described.
    Refused(&'static str),
}

/// Which endpoints take a field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoints {
    /// `/v1/chat/completions` only.
    Chat,
    /// `/v1/completions` only.
    Completions,
    /// Both.
    Both,
}

/// One request field.
#[derive(Debug, Clone, Copy)]
pub struct Field {
    /// The JSON key.
    pub name: &'static str,
    /// Where it is read.
    pub endpoints: Endpoints,
    /// What the server does with it.
    pub treatment: Treatment,
}

const fn f(name: &'static str, endpoints: Endpoints, treatment: Treatment) -> Field {
    Field {
        name,
        endpoints,
        treatment,
    }
}

use Endpoints::{Both, Chat, Completions};
use Treatment::{NoEffect, Refused, Supported};

/// The fields of OpenAI's chat and completions requests and the vLLM extensions the server
/// reads, in the order of docs/SERVE.md's table.
pub const FIELDS: &[Field] = &[
    f("model", Both, Supported),
    f("messages", Chat, Supported),
    f("prompt", Completions, Supported),
    f("max_tokens", Both, Supported),
    f("max_completion_tokens", Both, Supported),
    f("temperature", Both, Supported),
    f("top_p", Both, Supported),
    f("seed", Both, Supported),
    f("stop", Both, Supported),
    f("stream", Both, Supported),
    f("stream_options", Both, Supported),
    f("n", Both, Supported),
    f("logprobs", Both, Supported),
    f("top_logprobs", Chat, Supported),
    f("presence_penalty", Both, Supported),
    f("frequency_penalty", Both, Supported),
    f("logit_bias", Both, Supported),
    f("user", Both, NoEffect),
    f("safety_identifier", Chat, NoEffect),
    f("prompt_cache_key", Chat, NoEffect),
    f("metadata", Chat, NoEffect),
    f("parallel_tool_calls", Chat, Supported),
    f("store", Chat, Refused("false")),
    f("service_tier", Chat, Refused("\"auto\" or \"default\"")),
    f("modalities", Chat, Refused("[\"text\"]")),
    f("response_format", Both, Supported),
    f("tools", Chat, Supported),
    f("tool_choice", Chat, Supported),
    f("functions", Chat, Refused("[]")),
    f("function_call", Chat, Refused("\"none\"")),
    f("audio", Chat, Refused("null")),
    f("prediction", Chat, Refused("null")),
    f("reasoning_effort", Chat, Refused("null")),
    f("verbosity", Chat, Refused("null")),
    f("web_search_options", Chat, Refused("null")),
    f("echo", Completions, Refused("false")),
    f("best_of", Completions, Refused("1")),
    f("suffix", Completions, Refused("\"\"")),
    // llama.cpp's name (over its last 64 tokens): only the neutral value, so that one request
    // serves both servers (scripts/bench-serve.sh); `repetition_penalty` is the supported one.
    f("repeat_penalty", Both, Refused("1")),
    // vLLM's extensions.
    f("top_k", Both, Supported),
    f("min_tokens", Both, Supported),
    f("repetition_penalty", Both, Supported),
    f("return_token_ids", Both, Supported),
    f("chat_template_kwargs", Chat, Supported),
];

/// Whether `v` is the neutral value of the refused field `name` (or null, which is absent).
fn neutral(name: &str, v: &Value) -> bool {
    match (name, v) {
        (_, Value::Null) => true,
        ("store" | "echo", Value::Bool(b)) => !b,
        ("service_tier", Value::String(s)) => s == "auto" || s == "default",
        ("modalities", Value::Array(a)) => a.iter().all(|m| m == "text"),
        ("functions", Value::Array(a)) => a.is_empty(),
        ("function_call", Value::String(s)) => s == "none",
        ("best_of", Value::Number(n)) => n.as_u64() == Some(1),
        ("repeat_penalty", Value::Number(n)) => n.as_f64() == Some(1.0),
        ("suffix", Value::String(s)) => s.is_empty(),
        _ => false,
    }
}

/// Why a refused field is refused, for its error message.
fn why_refused(name: &str) -> &'static str {
    match name {
        "functions" | "function_call" => "deprecated: use tools and tool_choice",
        "store" => "the server stores no completions",
        "service_tier" => "the server has one service tier",
        "modalities" | "audio" => "the server generates text only",
        "prediction" => "predicted outputs are not implemented",
        "reasoning_effort" | "verbosity" => "the model has no such setting",
        "web_search_options" => "the server has no web search",
        "echo" => "echoing the prompt is not implemented",
        "best_of" => "best-of sampling is not implemented",
        "suffix" => "insertion (a suffix) is not implemented",
        "repeat_penalty" => "it is llama.cpp's windowed penalty; use repetition_penalty",
        _ => "not implemented",
    }
}

/// Checks every key of the body against [`FIELDS`] for the endpoint (`chat` or
/// completions): a refused field with a value other than its neutral one, a field of the other
/// endpoint and a field in no list are a 400 naming the field.
pub fn check_fields(o: &Map<String, Value>, chat: bool) -> Result<(), ApiError> {
    let endpoint = if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    for (key, v) in o {
        let Some(field) = FIELDS.iter().find(|f| f.name == key) else {
            return Err(ApiError {
                code: Some("unknown_parameter"),
                ..ApiError::invalid(
                    key,
                    format!("unknown field '{key}': {endpoint} does not read it (docs/SERVE.md lists the fields)"),
                )
            });
        };
        let here = match field.endpoints {
            Both => true,
            Chat => chat,
            Completions => !chat,
        };
        if !here && !v.is_null() {
            return Err(ApiError {
                code: Some("unknown_parameter"),
                ..ApiError::invalid(key, format!("'{key}' is not a field of {endpoint}"))
            });
        }
        if let Refused(accepted) = field.treatment {
            if !neutral(key, v) {
                return Err(ApiError {
                    code: Some("unsupported_parameter"),
                    ..ApiError::invalid(
                        key,
                        format!(
                            "'{key}' = {} is not supported: {} (accepted: {accepted} or absent)",
                            short(v),
                            why_refused(key)
                        ),
                    )
                });
            }
        }
    }
    Ok(())
}

/// `v` as JSON, cut to 80 characters for a message.
pub fn short(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}

/// A number field (`None` when absent or null).
pub fn number(o: &Map<String, Value>, key: &str) -> Result<Option<f64>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(v) => Err(ApiError::invalid(
            key,
            format!("'{key}' must be a number, got {}", kind_of(v)),
        )),
    }
}

/// An integer field (`None` when absent or null).
pub fn integer(o: &Map<String, Value>, key: &str) -> Result<Option<i128>, ApiError> {
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

/// A boolean field (false when absent or null).
pub fn boolean(o: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ApiError::invalid(
            key,
            format!("'{key}' must be a boolean, got {}", kind_of(v)),
        )),
    }
}

/// "a string", "an array"... for messages.
pub fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Checks `lo <= v <= hi` (`lo < v` when `lo_open`), naming the field and the value.
pub fn in_range(
    key: &str,
    v: Option<f64>,
    lo: f64,
    hi: f64,
    lo_open: bool,
) -> Result<(), ApiError> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn check(body: Value, chat: bool) -> Result<(), ApiError> {
        check_fields(body.as_object().expect("object"), chat)
    }

    #[test]
    fn refused_fields_name_themselves_unless_neutral() {
        for (body, chat, param) in [
            (
                serde_json::json!({"functions": [{"name": "f"}]}),
                true,
                "functions",
            ),
            (
                serde_json::json!({"function_call": "auto"}),
                true,
                "function_call",
            ),
            (
                serde_json::json!({"tools": [{"type": "function"}]}),
                false,
                "tools",
            ),
            (serde_json::json!({"echo": true}), false, "echo"),
            (serde_json::json!({"best_of": 3}), false, "best_of"),
            (serde_json::json!({"suffix": "end"}), false, "suffix"),
            (serde_json::json!({"min_p": 0.1}), false, "min_p"),
            (
                serde_json::json!({"top_logprobs": 2}),
                false,
                "top_logprobs",
            ),
            (serde_json::json!({"suffix": "x"}), true, "suffix"),
            (
                serde_json::json!({"repeat_penalty": 1.1}),
                false,
                "repeat_penalty",
            ),
        ] {
            let e = check(body.clone(), chat).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
            assert!(e.message.contains(param), "{}", e.message);
        }
        check(
            serde_json::json!({"function_call": "none", "response_format": {"type": "text"},
                               "store": false, "user": "u", "metadata": {"a": "b"}, "audio": null,
                               "service_tier": "auto", "modalities": ["text"], "functions": []}),
            true,
        )
        .unwrap();
        check(
            serde_json::json!({"echo": false, "best_of": 1, "suffix": "", "user": "u", "repeat_penalty": 1.0}),
            false,
        )
        .unwrap();
    }

    /// docs/SERVE.md's table has a row for every field, and the row says what the code does.
    #[test]
    fn the_documented_table_lists_every_field() {
        let doc = include_str!("../../docs/SERVE.md");
        for field in FIELDS {
            let row = doc
                .lines()
                .find(|l| l.starts_with(&format!("| `{}` |", field.name)))
                .unwrap_or_else(|| panic!("docs/SERVE.md has no table row for `{}`", field.name));
            let word = match field.treatment {
                Supported => "supported",
                NoEffect => "accepted, no effect",
                Refused(_) => "refused",
            };
            assert!(
                row.contains(word),
                "the row of `{}` does not say {word}: {row}",
                field.name
            );
        }
    }
}
