//! The request of `POST /v1/embeddings`: its JSON body read and checked field by field
//! ([`EMBEDDING_FIELDS`]: each honoured or refused), and its inputs turned into checked
//! token ids.

use serde_json::{Map, Value};
use tokenizers::Tokenizer;

use crate::serve::api::json_object;
use crate::serve::error::ApiError;
use crate::serve::fields::{kind_of, short};

/// Inputs of one request at most (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

/// The fields of OpenAI's embeddings request and what the server does with each, in the order
/// of docs/SERVE.md's embeddings table (a unit test keeps them in agreement).
pub const EMBEDDING_FIELDS: &[(&str, &str)] = &[
    ("model", "supported"),
    ("input", "supported"),
    ("encoding_format", "supported"),
    ("dimensions", "refused"),
    ("user", "accepted, no effect"),
];

/// One input as given: text, or token ids.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Input {
    Text(String),
    Ids(Vec<u32>),
}

/// A parsed embeddings request.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct EmbedRequest {
    pub model: Option<String>,
    pub inputs: Vec<Input>,
    pub base64: bool,
}

fn token_ids(v: &[Value], what: &str) -> std::result::Result<Vec<u32>, ApiError> {
    v.iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_u64()
                .filter(|&id| id <= u32::MAX as u64)
                .map(|id| id as u32)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "input",
                        format!("{what}[{i}] = {} is not a token id", short(x)),
                    )
                })
        })
        .collect()
}

/// The request in `body`; `hidden_size` is the only `dimensions` accepted.
pub(super) fn parse(
    body: &[u8],
    hidden_size: usize,
) -> std::result::Result<EmbedRequest, ApiError> {
    let o: Map<String, Value> = json_object(body)?;
    for (k, v) in &o {
        match EMBEDDING_FIELDS.iter().find(|(name, _)| name == k) {
            None => {
                return Err(ApiError {
                    code: Some("unknown_parameter"),
                    ..ApiError::invalid(
                        k,
                        format!("unknown field '{k}': /v1/embeddings does not read it (docs/SERVE.md lists the fields)"),
                    )
                })
            }
            Some(("dimensions", _))
                if !v.is_null() && v.as_u64() != Some(hidden_size as u64) =>
            {
                return Err(ApiError {
                    code: Some("unsupported_parameter"),
                    ..ApiError::invalid(
                        "dimensions",
                        format!("'dimensions' = {} is not supported: the model's embeddings have {hidden_size} dimensions and are not shortened (accepted: {hidden_size} or absent)", short(v)),
                    )
                });
            }
            _ => {}
        }
    }
    let model = match o.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(m)) => Some(m.clone()),
        Some(v) => {
            return Err(ApiError::invalid(
                "model",
                format!("'model' must be a string, got {}", kind_of(v)),
            ))
        }
    };
    let base64 = match o.get("encoding_format") {
        None | Some(Value::Null) => false,
        Some(Value::String(f)) if f == "float" => false,
        Some(Value::String(f)) if f == "base64" => true,
        Some(v) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!(
                    "'encoding_format' = {} must be \"float\" or \"base64\"",
                    short(v)
                ),
            ))
        }
    };
    let bad = |m: &str| ApiError::invalid("input", m.to_string());
    let inputs = match o.get("input") {
        None | Some(Value::Null) => return Err(bad("'input' is required")),
        Some(Value::String(t)) => vec![Input::Text(t.clone())],
        Some(Value::Array(a)) if a.is_empty() => return Err(bad("'input' is an empty array")),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => a
            .iter()
            .map(|t| Input::Text(t.as_str().unwrap_or_default().to_string()))
            .collect(),
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => {
            vec![Input::Ids(token_ids(a, "input")?)]
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_array) => a
            .iter()
            .enumerate()
            .map(|(i, x)| {
                token_ids(
                    x.as_array().map(Vec::as_slice).unwrap_or_default(),
                    &format!("input[{i}]"),
                )
                .map(Input::Ids)
            })
            .collect::<std::result::Result<_, _>>()?,
        Some(v) => {
            return Err(ApiError::invalid(
                "input",
                format!(
                    "'input' must be a string, an array of strings, an array of token ids or an array of such arrays; got {}",
                    short(v)
                ),
            ))
        }
    };
    if inputs.len() > MAX_INPUTS {
        return Err(ApiError::invalid(
            "input",
            format!("'input' has {} items, at most {MAX_INPUTS}", inputs.len()),
        ));
    }
    Ok(EmbedRequest {
        model,
        inputs,
        base64,
    })
}

/// What [`tokenize`] reads of the server: its tokenizer and limits (the embeddings server's
/// state, [`EmbedState`](super::EmbedState), holds them; it is not imported here, so that this
/// file does not import the file that declares it).
pub(super) struct Encoder<'a> {
    /// The checkpoint's tokenizer (no padding, no truncation).
    pub tokenizer: &'a Tokenizer,
    /// Tokens per input at most.
    pub max_tokens: usize,
    /// The model's vocabulary size (token ids must be below it).
    pub vocab_size: usize,
}

/// The token ids of every input (text with the tokenizer's special tokens, as
/// sentence-transformers encodes; ids as given), each checked: not empty, at most
/// `max_tokens`, inside the vocabulary.
pub(super) fn tokenize(
    s: &Encoder<'_>,
    inputs: &[Input],
) -> std::result::Result<Vec<Vec<u32>>, ApiError> {
    let many = inputs.len() > 1;
    inputs
        .iter()
        .enumerate()
        .map(|(i, input)| {
            let which = if many {
                format!("input {i}")
            } else {
                "the input".to_string()
            };
            let ids = match input {
                Input::Text(t) if t.is_empty() => {
                    return Err(ApiError::invalid("input", format!("{which} is empty")))
                }
                Input::Text(t) => s
                    .tokenizer
                    .encode(t.as_str(), true)
                    .map_err(|e| {
                        ApiError::new(500, "server_error", None, format!("tokenizing: {e}"))
                    })?
                    .get_ids()
                    .to_vec(),
                Input::Ids(ids) => ids.clone(),
            };
            if ids.is_empty() {
                return Err(ApiError::invalid("input", format!("{which} has no tokens")));
            }
            if ids.len() > s.max_tokens {
                return Err(ApiError {
                    code: Some("context_length_exceeded"),
                    ..ApiError::invalid(
                        "input",
                        format!(
                            "{which} has {} tokens; the model embeds at most {} (max_seq_length)",
                            ids.len(),
                            s.max_tokens
                        ),
                    )
                });
            }
            if let Some(id) = ids.iter().find(|&&id| id as usize >= s.vocab_size) {
                return Err(ApiError::invalid(
                    "input",
                    format!(
                        "{which} has token id {id}, outside the model's vocabulary of {} ids",
                        s.vocab_size
                    ),
                ));
            }
            Ok(ids)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn inputs_and_fields() {
        let p = |b: Value| parse(b.to_string().as_bytes(), 384);
        let r = p(json!({"input": "hi"})).unwrap();
        assert_eq!(r.inputs, vec![Input::Text("hi".into())]);
        assert!(!r.base64);
        let r = p(json!({"input": ["a", "b"], "encoding_format": "base64", "dimensions": 384, "user": "u"}))
            .unwrap();
        assert_eq!(r.inputs.len(), 2);
        assert!(r.base64);
        let r = p(json!({"input": [1, 2, 3]})).unwrap();
        assert_eq!(r.inputs, vec![Input::Ids(vec![1, 2, 3])]);
        let r = p(json!({"input": [[1, 2], [3]]})).unwrap();
        assert_eq!(r.inputs, vec![Input::Ids(vec![1, 2]), Input::Ids(vec![3])]);
        for (body, param) in [
            (json!({}), "input"),
            (json!({"input": []}), "input"),
            (json!({"input": [1, "a"]}), "input"),
            (json!({"input": [-1]}), "input"),
            (json!({"input": "a", "dimensions": 128}), "dimensions"),
            (
                json!({"input": "a", "encoding_format": "int8"}),
                "encoding_format",
            ),
            (json!({"input": "a", "truncate": true}), "truncate"),
            (json!({"input": "a", "model": 3}), "model"),
        ] {
            let e = p(body.clone()).unwrap_err();
            assert_eq!(
                (e.status, e.param.as_deref()),
                (400, Some(param)),
                "{body}: {e:?}"
            );
        }
        let many = vec!["a"; MAX_INPUTS + 1];
        assert_eq!(p(json!({"input": many})).unwrap_err().status, 400);
    }

    /// docs/SERVE.md's embeddings table has a row for every field, saying what the code does.
    #[test]
    fn the_documented_table_lists_every_field() {
        let doc = include_str!("../../../docs/SERVE.md");
        let section = doc
            .split("### Embedding request fields")
            .nth(1)
            .expect("docs/SERVE.md has a section '### Embedding request fields'");
        let rows: Vec<&str> = section
            .lines()
            .skip_while(|l| !l.starts_with('|'))
            .take_while(|l| l.starts_with('|'))
            .collect();
        let names: Vec<String> = rows
            .iter()
            .skip(2)
            .filter_map(|r| r.split('`').nth(1).map(String::from))
            .collect();
        let want: Vec<String> = EMBEDDING_FIELDS
            .iter()
            .map(|(n, _)| n.to_string())
            .collect();
        assert_eq!(names, want, "the table's fields");
        for (row, (name, what)) in rows.iter().skip(2).zip(EMBEDDING_FIELDS) {
            assert!(
                row.contains(what),
                "the row of `{name}` does not say {what}: {row}"
            );
        }
    }
}
