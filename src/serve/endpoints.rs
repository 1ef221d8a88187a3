//! The endpoints besides the completions: `GET /health`, `GET /metrics` (Prometheus),
//! `GET /v1/models` and `/v1/models/{id}`, vLLM's `POST /tokenize` and `POST /detokenize`,
//! and the API key check (`Authorization: Bearer KEY`) in front of `/v1/*`, `/tokenize` and
//! `/detokenize`.

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use crate::serve::error::{client_message, ApiError};
use crate::serve::fields::{boolean, kind_of};
use crate::serve::limits::read_body;
use crate::serve::reply::json_response;
use crate::serve::stamp::unix_now;
use crate::serve::state::AppState;

/// 401 unless the request carries `Authorization: Bearer <the key>` (when the server has
/// one). `/health` and `/metrics` stay open, as vLLM's; the router runs this on its routes
/// only, so that a path it does not have is a 404 with or without the key.
pub async fn require_key(State(s): State<AppState>, req: Request, next: Next) -> Response {
    match key_refusal(s.api_key.as_deref(), &req) {
        Some(refused) => refused,
        None => next.run(req).await,
    }
}

/// The 401 for `req` when the server has `key` and the request does not carry it (`/health`
/// and `/metrics` stay open).
pub(crate) fn key_refusal(key: Option<&str>, req: &Request) -> Option<Response> {
    let key = key?;
    let path = req.uri().path();
    if path == "/health" || path == "/metrics" {
        return None;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token);
    match given {
        Some(g) if constant_time_eq(g.as_bytes(), key.as_bytes()) => None,
        _ => Some(
            ApiError::new(
                401,
                "invalid_request_error",
                Some("invalid_api_key"),
                if given.is_none() {
                    "missing API key: send 'Authorization: Bearer <key>'"
                } else {
                    "incorrect API key"
                },
            )
            .into_response(),
        ),
    }
}

/// The token of an `Authorization: Bearer <token>` value: the scheme's name is
/// case-insensitive (RFC 9110 section 11.1: `bearer`, `BEARER` are the same scheme).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Equality whose time depends on the lengths only, not on where the bytes differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `GET /health`: `{"status": "ok", "active": N}`, 503 while shutting down.
pub async fn health(State(s): State<AppState>) -> Response {
    if s.queue.is_shutting_down() {
        return ApiError::new(
            503,
            "server_error",
            Some("shutting_down"),
            "the server is shutting down",
        )
        .into_response();
    }
    json_response(
        StatusCode::OK,
        &json!({"status": "ok", "active": s.queue.active()}),
    )
}

/// `GET /metrics`.
pub async fn metrics(State(s): State<AppState>) -> Response {
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.queue.metrics().render(&s.model_name),
    )
        .into_response()
}

fn model_card(s: &AppState) -> Value {
    json!({"id": s.model_name, "object": "model", "created": unix_now(), "owned_by": "candle-tp",
           "max_model_len": s.max_seq_len})
}

/// `GET /v1/models`.
pub async fn models(State(s): State<AppState>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": [model_card(&s)]}),
    )
}

/// `GET /v1/models/{id}`: the model, or 404 `model_not_found` (`id` may hold slashes).
pub async fn model(State(s): State<AppState>, Path(id): Path<String>) -> Response {
    if id != s.model_name {
        return model_not_found(&s, &id).into_response();
    }
    json_response(StatusCode::OK, &model_card(&s))
}

/// 404 for a model this server does not serve.
pub fn model_not_found(s: &AppState, m: &str) -> ApiError {
    ApiError {
        param: Some("model".into()),
        ..ApiError::new(
            404,
            "invalid_request_error",
            Some("model_not_found"),
            format!(
                "the model '{m}' does not exist: this server serves '{}'",
                s.model_name
            ),
        )
    }
}

/// The body as a JSON object whose keys are all in `known`.
fn object(body: &Bytes, known: &[&str], s: &AppState) -> Result<Map<String, Value>, ApiError> {
    let o = super::api::json_object(body)?;
    if let Some(k) = o.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(ApiError {
            code: Some("unknown_parameter"),
            ..ApiError::invalid(
                k,
                format!("unknown field '{k}' (known: {})", known.join(", ")),
            )
        });
    }
    match o.get("model") {
        None | Some(Value::Null) => {}
        Some(Value::String(m)) if *m == s.model_name => {}
        Some(Value::String(m)) => return Err(model_not_found(s, m)),
        Some(v) => {
            return Err(ApiError::invalid(
                "model",
                format!("'model' must be a string, got {}", kind_of(v)),
            ))
        }
    }
    Ok(o)
}

/// `POST /tokenize` (vLLM's): `{"prompt": text}` (`add_special_tokens`, default true) or
/// `{"messages": [...]}` rendered by the chat template (`add_generation_prompt`, default
/// true); answers `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` with
/// `return_token_strs: true`, else null).
pub async fn tokenize(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    blocking(s, headers, body, tokenize_body).await
}

/// `work` on the body, off the async thread (tokenizing a large body takes a while), at most
/// `--max-tokenize-jobs` at once.
async fn blocking(
    s: AppState,
    headers: HeaderMap,
    body: Body,
    work: fn(&AppState, &Bytes) -> Result<Response, ApiError>,
) -> Response {
    let answer = match read_body(s.max_body_bytes, s.limits.body_timeout, &headers, body).await {
        Ok(body) => {
            let jobs = s.limits.text_jobs.clone();
            jobs.run(move || work(&s, &body)).await.and_then(|r| r)
        }
        Err(e) => Err(e),
    };
    answer.unwrap_or_else(IntoResponse::into_response)
}

fn tokenize_body(s: &AppState, body: &Bytes) -> Result<Response, ApiError> {
    let o = object(
        body,
        &[
            "model",
            "prompt",
            "messages",
            "add_special_tokens",
            "add_generation_prompt",
            "return_token_strs",
        ],
        s,
    )?;
    let flag = |k: &str, default: bool| -> Result<bool, ApiError> {
        Ok(match o.get(k) {
            None | Some(Value::Null) => default,
            _ => boolean(&o, k)?,
        })
    };
    let ids = match (o.get("prompt"), o.get("messages")) {
        (Some(Value::String(p)), None) => s
            .text
            .encode(p, flag("add_special_tokens", true)?)
            .map_err(|e| ApiError::invalid("prompt", client_message(&e)))?,
        (None, Some(_)) => {
            let msgs = crate::serve::messages::messages(&o)?;
            let text = if flag("add_generation_prompt", true)? {
                s.text.render_chat(&msgs)
            } else {
                s.text.render_chat_without_prompt(&msgs)
            }
            .map_err(|e| ApiError::invalid("messages", client_message(&e)))?;
            s.text
                .encode(&text, flag("add_special_tokens", false)?)
                .map_err(|e| ApiError::invalid("messages", client_message(&e)))?
        }
        (Some(v), None) => {
            return Err(ApiError::invalid(
                "prompt",
                format!("'prompt' must be a string, got {}", kind_of(v)),
            ))
        }
        _ => {
            return Err(ApiError::invalid(
                "prompt",
                "give exactly one of 'prompt' and 'messages'",
            ))
        }
    };
    let strs = if flag("return_token_strs", false)? {
        let t = s.text.tokenizer();
        json!(ids
            .iter()
            .map(|&i| t.id_to_token(i).unwrap_or_default())
            .collect::<Vec<_>>())
    } else {
        Value::Null
    };
    Ok(json_response(
        StatusCode::OK,
        &json!({"count": ids.len(), "max_model_len": s.max_seq_len, "tokens": ids, "token_strs": strs}),
    ))
}

/// `POST /detokenize` (vLLM's): `{"tokens": [ids]}` answers `{"prompt": text}` (special tokens
/// kept, as vLLM's).
pub async fn detokenize(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    blocking(s, headers, body, detokenize_body).await
}

fn detokenize_body(s: &AppState, body: &Bytes) -> Result<Response, ApiError> {
    let o = object(body, &["model", "tokens"], s)?;
    let bad = |m: String| ApiError::invalid("tokens", m);
    let Some(Value::Array(list)) = o.get("tokens") else {
        return Err(bad("'tokens' must be an array of token ids".into()));
    };
    let vocab = s.text.tokenizer().get_vocab_size(true);
    let ids = list
        .iter()
        .enumerate()
        .map(|(i, v)| match v.as_u64() {
            Some(id) if (id as usize) < vocab => Ok(id as u32),
            _ => Err(bad(format!(
                "'tokens[{i}]' = {v} is not a token id of the tokenizer's {vocab}"
            ))),
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let text = s
        .text
        .tokenizer()
        .decode(&ids, false)
        .map_err(|e| bad(format!("decoding: {e}")))?;
    Ok(json_response(StatusCode::OK, &json!({"prompt": text})))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        for v in ["Bearer k1", "bearer k1", "BEARER  k1 ", " BeArEr k1"] {
            assert_eq!(bearer_token(v), Some("k1"), "{v:?}");
        }
        for v in ["Basic k1", "Bearerk1", "k1", ""] {
            assert_eq!(bearer_token(v), None, "{v:?}");
        }
    }
}
