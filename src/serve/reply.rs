//! The answers both servers' routers write: JSON bodies, [`ApiError`] as a response (its
//! status and OpenAI's error object), and the 405 of a wrong method.
//!
//! Below the routes: [`http`](super::http), [`endpoints`](super::endpoints),
//! [`job`](super::job) and [`embeddings`](super::embeddings) import it; it imports only the
//! error type.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use crate::serve::error::ApiError;

/// The `code` of the [`ApiError`] an answer was made from, in the answer's extensions: what
/// the connection middleware (`limits::serve`) counts refusals by.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ErrorCode(pub &'static str);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut res = json_response(status, &self.body());
        if let Some(code) = self.code {
            res.extensions_mut().insert(ErrorCode(code));
        }
        res
    }
}

/// A JSON answer.
pub(crate) fn json_response(status: StatusCode, v: &Value) -> Response {
    json_text_response(status, v.to_string())
}

/// A JSON answer already serialised.
pub(crate) fn json_text_response(status: StatusCode, json: String) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], json).into_response()
}

/// 405 `method_not_allowed` (both servers' routers).
pub(crate) async fn method_not_allowed() -> ApiError {
    ApiError::new(
        405,
        "invalid_request_error",
        Some("method_not_allowed"),
        "method not allowed on this endpoint",
    )
}
