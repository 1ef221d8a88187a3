//! The `response_format` field (structured outputs): `{"type": "text"}` (nothing),
//! `{"type": "json_object"}` (any JSON object) and `{"type": "json_schema", "json_schema":
//! {"name", "description", "schema", "strict"}}` (JSON valid against the schema, strict or not:
//! the grammar always holds), read into the [`GrammarSpec`] the tokens are generated under.

use serde_json::{json, Map, Value};

use crate::serve::error::ApiError;
use crate::serve::fields::{kind_of, short};
use crate::serve::grammar::GrammarSpec;

/// The grammar `response_format` asks for (`None`: free text).
pub(crate) fn response_format(o: &Map<String, Value>) -> Result<Option<GrammarSpec>, ApiError> {
    let f = match o.get("response_format") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(f)) => f,
        Some(v) => {
            return Err(ApiError::invalid(
                "response_format",
                format!("'response_format' must be an object, got {}", kind_of(v)),
            ))
        }
    };
    let kind = match f.get("type") {
        Some(Value::String(t)) => t.as_str(),
        v => {
            return Err(ApiError::invalid(
                "response_format.type",
                format!(
                    "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", got {}",
                    v.map_or("nothing".into(), short)
                ),
            ))
        }
    };
    let allowed: &[&str] = match kind {
        "text" | "json_object" => &["type"],
        "json_schema" => &["type", "json_schema"],
        other => {
            return Err(ApiError {
                code: Some("unsupported_parameter"),
                ..ApiError::invalid(
                    "response_format.type",
                    format!(
                        "'response_format.type' = {other:?} is not supported (accepted: \"text\", \"json_object\", \"json_schema\")"
                    ),
                )
            })
        }
    };
    if let Some(k) = f.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(ApiError {
            code: Some("unknown_parameter"),
            ..ApiError::invalid(
                &format!("response_format.{k}"),
                format!("unknown field 'response_format.{k}' for type {kind:?}"),
            )
        });
    }
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(GrammarSpec::JsonSchema(json!({"type": "object"})))),
        _ => json_schema(f.get("json_schema")).map(Some),
    }
}

/// `response_format.json_schema`: `name` (a string, as OpenAI requires), `description`,
/// `schema` (an object; absent: any JSON object) and `strict` (a boolean; the schema is
/// enforced either way).
fn json_schema(v: Option<&Value>) -> Result<GrammarSpec, ApiError> {
    const AT: &str = "response_format.json_schema";
    let Some(Value::Object(js)) = v else {
        return Err(ApiError::invalid(
            AT,
            format!(
                "'{AT}' must be an object with 'name' and 'schema', got {}",
                v.map_or("nothing", kind_of)
            ),
        ));
    };
    for (k, v) in js {
        let ok = match k.as_str() {
            "name" => v.is_string(),
            "description" => v.is_string() || v.is_null(),
            "strict" => v.is_boolean() || v.is_null(),
            "schema" => v.is_object() || v.is_null(),
            _ => {
                return Err(ApiError {
                    code: Some("unknown_parameter"),
                    ..ApiError::invalid(&format!("{AT}.{k}"), format!("unknown field '{AT}.{k}'"))
                })
            }
        };
        if !ok {
            let want = match k.as_str() {
                "name" | "description" => "a string",
                "strict" => "a boolean",
                _ => "an object (a JSON schema)",
            };
            return Err(ApiError::invalid(
                &format!("{AT}.{k}"),
                format!("'{AT}.{k}' must be {want}, got {}", short(v)),
            ));
        }
    }
    if !js.contains_key("name") {
        return Err(ApiError::invalid(
            &format!("{AT}.name"),
            format!("'{AT}.name' is required"),
        ));
    }
    Ok(GrammarSpec::JsonSchema(match js.get("schema") {
        Some(s @ Value::Object(_)) => s.clone(),
        _ => json!({"type": "object"}),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(v: Value) -> Result<Option<GrammarSpec>, ApiError> {
        response_format(json!({ "response_format": v }).as_object().unwrap())
    }

    #[test]
    fn formats_and_refusals() {
        assert_eq!(read(json!({"type": "text"})).unwrap(), None);
        assert_eq!(read(Value::Null).unwrap(), None);
        assert_eq!(
            read(json!({"type": "json_object"})).unwrap(),
            Some(GrammarSpec::JsonSchema(json!({"type": "object"})))
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            read(json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}))
                .unwrap(),
            Some(GrammarSpec::JsonSchema(schema))
        );
        for (v, param, says) in [
            (json!("json"), "response_format", "object"),
            (json!({"type": "xml"}), "response_format.type", "\"xml\""),
            (json!({}), "response_format.type", "nothing"),
            (
                json!({"type": "text", "x": 1}),
                "response_format.x",
                "unknown",
            ),
            (
                json!({"type": "json_schema"}),
                "response_format.json_schema",
                "nothing",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {}}}),
                "response_format.json_schema.name",
                "required",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}),
                "response_format.json_schema.schema",
                "3",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}),
                "response_format.json_schema.strict",
                "yes",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x", "foo": 1}}),
                "response_format.json_schema.foo",
                "unknown",
            ),
        ] {
            crate::serve::error::assert_refused(&read(v.clone()).unwrap_err(), param, says, &v);
        }
    }
}
