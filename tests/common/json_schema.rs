//! A JSON schema validator for the keywords the structured-output tests use (independent of
//! llguidance, which generates under the schema): `type`, `properties`, `required`,
//! `additionalProperties: false`, `enum`, `const`, `items`, `minItems`, `maxItems`, `minimum`,
//! `maximum`, `minLength`, `maxLength`, `anyOf`. A keyword it does not know fails the check
//! (so that a test cannot pass by a keyword going unchecked).

use serde_json::Value;

/// `Err(why)` where `v` is not valid against `schema`.
pub fn validate(schema: &Value, v: &Value) -> Result<(), String> {
    let Some(s) = schema.as_object() else {
        return Err(format!("schema {schema} is not an object"));
    };
    for (k, want) in s {
        match k.as_str() {
            "title" | "description" | "x-guidance" => {}
            "type" => {
                let kinds: Vec<&str> = match want {
                    Value::String(t) => vec![t.as_str()],
                    Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
                    _ => return Err(format!("bad type {want}")),
                };
                let ok = kinds.iter().any(|t| match *t {
                    "object" => v.is_object(),
                    "array" => v.is_array(),
                    "string" => v.is_string(),
                    // JSON Schema: a number without a fractional part (`-0`, `1e3` too).
                    "integer" => v.as_f64().is_some_and(|x| x.fract() == 0.0),
                    "number" => v.is_number(),
                    "boolean" => v.is_boolean(),
                    "null" => v.is_null(),
                    _ => false,
                });
                if !ok {
                    return Err(format!("{v} is not of type {want}"));
                }
            }
            "properties" => {
                if let (Some(props), Some(o)) = (want.as_object(), v.as_object()) {
                    for (name, sub) in props {
                        if let Some(x) = o.get(name) {
                            validate(sub, x).map_err(|e| format!("{name}: {e}"))?;
                        }
                    }
                }
            }
            "required" => {
                if let Some(o) = v.as_object() {
                    for name in want.as_array().into_iter().flatten() {
                        let name = name.as_str().unwrap_or_default();
                        if !o.contains_key(name) {
                            return Err(format!("{v} lacks {name}"));
                        }
                    }
                }
            }
            "additionalProperties" => {
                if let (Some(false), Some(o)) = (want.as_bool(), v.as_object()) {
                    let props = s.get("properties").and_then(Value::as_object);
                    if let Some(extra) = o
                        .keys()
                        .find(|k| !props.is_some_and(|p| p.contains_key(*k)))
                    {
                        return Err(format!("{v} has the extra property {extra}"));
                    }
                }
            }
            "enum" => {
                if !want.as_array().is_some_and(|a| a.contains(v)) {
                    return Err(format!("{v} is not in {want}"));
                }
            }
            "const" => {
                if want != v {
                    return Err(format!("{v} is not {want}"));
                }
            }
            "items" => {
                for (i, x) in v.as_array().into_iter().flatten().enumerate() {
                    validate(want, x).map_err(|e| format!("[{i}]: {e}"))?;
                }
            }
            "minItems" | "maxItems" | "minLength" | "maxLength" => {
                let n = match v {
                    Value::Array(a) => a.len(),
                    Value::String(t) => t.chars().count(),
                    _ => continue,
                } as u64;
                let bound = want.as_u64().unwrap_or(0);
                if (k.starts_with("min") && n < bound) || (k.starts_with("max") && n > bound) {
                    return Err(format!("{v}: {k} {bound}"));
                }
            }
            "minimum" | "maximum" => {
                if let (Some(x), Some(b)) = (v.as_f64(), want.as_f64()) {
                    if (k == "minimum" && x < b) || (k == "maximum" && x > b) {
                        return Err(format!("{v}: {k} {b}"));
                    }
                }
            }
            "anyOf" => {
                let branches = want.as_array().cloned().unwrap_or_default();
                if !branches.iter().any(|b| validate(b, v).is_ok()) {
                    return Err(format!("{v} matches no branch of {want}"));
                }
            }
            other => return Err(format!("the test validator does not know '{other}'")),
        }
    }
    Ok(())
}
