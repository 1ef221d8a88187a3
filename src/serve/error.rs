//! OpenAI's error answer (`{"error": {"message", "type", "param", "code"}}`) with its HTTP
//! status, and the text of a candle error for an API client.
//!
//! The lowest layer of the request side: the field parsers ([`fields`](super::fields),
//! `messages`, `options`, `response_format`, [`tools`](super::tools)), the request
//! ([`api`](super::api)) and the routes all return [`ApiError`]; this file imports none of
//! them. [`api`](super::api) re-exports both items, their public path before this file.

use serde_json::Value;

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
}
