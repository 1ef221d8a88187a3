//! Tool calling: the `tools`, `tool_choice` and `parallel_tool_calls` fields, the model's
//! tool-call format, and the grammar that forces a call (`tool_choice` `required` or a named
//! function).
//!
//! The tools go to the chat template as its `tools` variable, as transformers'
//! `apply_chat_template(tools=...)` passes them (the `{"type": "function", "function": ...}`
//! objects as given). A template that does not read `tools` renders none: the model then only
//! calls a tool when the grammar forces it. The model's calls are read back by
//! [`tool_calls`](crate::serve::tool_calls) in its format: Hermes / Qwen (`<tool_call>` JSON
//! `</tool_call>`, the default) or Llama 3's JSON (`{"name": ..., "parameters": ...}`), told
//! apart by the chat template's source.

use serde_json::{json, Map, Value};

use crate::serve::error::ApiError;
use crate::serve::fields::{boolean, kind_of, short};
use crate::serve::grammar::{with_json_options, GrammarSpec};

/// How the model writes its tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call
    /// (Hermes 2 Pro, Qwen 2.5, Qwen 3).
    Hermes,
    /// The answer is `{"name": ..., "parameters": {...}}` (Llama 3.1-3.3's JSON tool calling);
    /// one call.
    Llama3Json,
}

impl ToolFormat {
    /// The format of a model whose chat template is `source`: Hermes where it writes
    /// `<tool_call>`, Llama 3's JSON where it describes `"parameters"` calls (Llama 3.1's
    /// template), Hermes otherwise.
    pub fn of_template(source: &str) -> Self {
        if source.contains("<tool_call>") {
            ToolFormat::Hermes
        } else if source.contains("\"parameters\"") && source.contains("<|eot_id|>") {
            ToolFormat::Llama3Json
        } else {
            ToolFormat::Hermes
        }
    }
}

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    /// Its name.
    pub name: String,
    /// The JSON schema of its arguments.
    pub parameters: Value,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// The model does not call tools (its text is the answer, not read for calls).
    None,
    /// The model decides; its calls are read from its text.
    Auto,
    /// The model calls at least one tool (forced by the grammar).
    Required,
    /// The model calls this function (forced by the grammar).
    Named(String),
}

/// What a chat request says about tools.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// `tools` as given (what the chat template renders).
    pub definitions: Vec<Value>,
    /// The functions, in order.
    pub functions: Vec<Function>,
    /// `tool_choice` (default `auto` with tools, else `none`).
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): several calls in one answer.
    pub parallel: bool,
}

/// A function name as OpenAI accepts it: 1-64 of `a-zA-Z0-9_-`.
fn valid_name(n: &str) -> bool {
    (1..=64).contains(&n.len())
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls` (`None`: no tools, choice none).
pub(crate) fn tools(o: &Map<String, Value>) -> Result<Option<Tools>, ApiError> {
    let list = match o.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(v) => {
            return Err(ApiError::invalid(
                "tools",
                format!("'tools' must be an array, got {}", kind_of(v)),
            ))
        }
    };
    let mut functions: Vec<Function> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let at = format!("tools[{i}]");
        let Some(t) = t.as_object() else {
            return Err(ApiError::invalid(&at, format!("'{at}' must be an object")));
        };
        if let Some(k) = t
            .keys()
            .find(|k| !matches!(k.as_str(), "type" | "function"))
        {
            return Err(ApiError::invalid(
                &format!("{at}.{k}"),
                format!("unknown field '{at}.{k}'"),
            ));
        }
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError {
                code: Some("unsupported_parameter"),
                ..ApiError::invalid(
                    &format!("{at}.type"),
                    format!(
                        "'{at}.type' = {} is not supported (accepted: \"function\")",
                        t.get("type").map_or("nothing".into(), short)
                    ),
                )
            });
        }
        let f = function(t.get("function"), &format!("{at}.function"))?;
        if functions.iter().any(|g| g.name == f.name) {
            return Err(ApiError::invalid(
                &format!("{at}.function.name"),
                format!("'{at}.function.name' = {:?} names a function twice", f.name),
            ));
        }
        functions.push(f);
    }
    let choice = match o.get("tool_choice") {
        None | Some(Value::Null) if functions.is_empty() => ToolChoice::None,
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("'tool_choice' = {s:?} is not \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
                ))
            }
        },
        Some(Value::Object(c)) => {
            // OpenAI's object has `type` and `function: {name}`, nothing else: another key is
            // a client's mistake that would otherwise pass unnoticed.
            let unknown = c
                .keys()
                .find(|k| !matches!(k.as_str(), "type" | "function"))
                .map(|k| format!("tool_choice.{k}"))
                .or_else(|| match c.get("function") {
                    Some(Value::Object(f)) => f
                        .keys()
                        .find(|k| k.as_str() != "name")
                        .map(|k| format!("tool_choice.function.{k}")),
                    _ => None,
                });
            if let Some(param) = unknown {
                return Err(ApiError {
                    code: Some("unknown_parameter"),
                    ..ApiError::invalid(&param, format!("unknown field '{param}'"))
                });
            }
            let name = c
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            match (c.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(n)) => ToolChoice::Named(n.to_string()),
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!(
                            "'tool_choice' = {} is not {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                            short(&Value::Object(c.clone()))
                        ),
                    ))
                }
            }
        }
        Some(v) => {
            return Err(ApiError::invalid(
                "tool_choice",
                format!(
                    "'tool_choice' must be a string or an object, got {}",
                    kind_of(v)
                ),
            ))
        }
    };
    match &choice {
        ToolChoice::Required if functions.is_empty() => {
            return Err(ApiError::invalid(
                "tool_choice",
                "'tool_choice' = \"required\" needs 'tools'",
            ))
        }
        ToolChoice::Named(n) if !functions.iter().any(|f| &f.name == n) => {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("'tool_choice' names the function {n:?}, which is not in 'tools'"),
            ))
        }
        _ => {}
    }
    let parallel = match o.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        _ => boolean(o, "parallel_tool_calls")?,
    };
    if functions.is_empty() {
        return Ok(None);
    }
    Ok(Some(Tools {
        definitions: list,
        functions,
        choice,
        parallel,
    }))
}

/// `tools[i].function`: `name`, `description`, `parameters` (a JSON schema; absent: no
/// arguments), `strict`.
fn function(v: Option<&Value>, at: &str) -> Result<Function, ApiError> {
    let Some(Value::Object(f)) = v else {
        return Err(ApiError::invalid(
            at,
            format!("'{at}' must be an object with a 'name'"),
        ));
    };
    if let Some(k) = f
        .keys()
        .find(|k| !matches!(k.as_str(), "name" | "description" | "parameters" | "strict"))
    {
        return Err(ApiError::invalid(
            &format!("{at}.{k}"),
            format!("unknown field '{at}.{k}'"),
        ));
    }
    let name = match f.get("name") {
        Some(Value::String(n)) if valid_name(n) => n.clone(),
        v => {
            return Err(ApiError::invalid(
                &format!("{at}.name"),
                format!(
                    "'{at}.name' = {} must be 1 to 64 letters, digits, '_' or '-'",
                    v.map_or("nothing".into(), short)
                ),
            ))
        }
    };
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(v) => {
            return Err(ApiError::invalid(
                &format!("{at}.parameters"),
                format!(
                    "'{at}.parameters' must be a JSON schema (an object), got {}",
                    kind_of(v)
                ),
            ))
        }
    };
    for (k, want) in [("description", "a string"), ("strict", "a boolean")] {
        match f.get(k) {
            None | Some(Value::Null) => {}
            Some(Value::String(_)) if k == "description" => {}
            Some(Value::Bool(_)) if k == "strict" => {}
            Some(v) => {
                return Err(ApiError::invalid(
                    &format!("{at}.{k}"),
                    format!("'{at}.{k}' must be {want}, got {}", short(v)),
                ))
            }
        }
    }
    Ok(Function { name, parameters })
}

impl Tools {
    /// The grammar that forces the calls `tool_choice` asks for (`None` for `auto` and
    /// `none`): one call of the named function, or (`required`) one call of any, several
    /// with `parallel_tool_calls` in the Hermes format; the arguments valid against the
    /// function's schema.
    pub fn forcing_grammar(&self, format: ToolFormat) -> Option<GrammarSpec> {
        let functions: Vec<&Function> = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => self.functions.iter().collect(),
            ToolChoice::Named(n) => self.functions.iter().filter(|f| &f.name == n).collect(),
        };
        let args_key = match format {
            ToolFormat::Hermes => "arguments",
            ToolFormat::Llama3Json => "parameters",
        };
        let calls: Vec<Value> = functions
            .iter()
            .map(|f| {
                let mut props = Map::new();
                props.insert("name".into(), json!({"const": f.name}));
                props.insert(args_key.into(), f.parameters.clone());
                json!({"type": "object", "properties": props,
                       "required": ["name", args_key], "additionalProperties": false})
            })
            .collect();
        let schema = with_json_options(&json!({"anyOf": calls}));
        let lark = match format {
            ToolFormat::Hermes => {
                let many = self.parallel && self.choice == ToolChoice::Required;
                format!(
                    "start: {}\ncall: \"<tool_call>\\n\" %json {schema} \"\\n</tool_call>\"\n",
                    if many { "call (\"\\n\" call)*" } else { "call" }
                )
            }
            ToolFormat::Llama3Json => format!("start: %json {schema}\n"),
        };
        Some(GrammarSpec::Lark(lark))
    }

    /// Whether the answer is read for tool calls (`tool_choice` other than `none`).
    pub fn reads_calls(&self) -> bool {
        self.choice != ToolChoice::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(v: Value) -> Result<Option<Tools>, ApiError> {
        tools(v.as_object().unwrap())
    }

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "description": "d",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
    }

    #[test]
    fn choices_and_refusals() {
        assert_eq!(read(json!({})).unwrap(), None);
        assert_eq!(
            read(json!({"tools": [], "tool_choice": "none"})).unwrap(),
            None
        );
        let t = read(json!({"tools": weather()})).unwrap().unwrap();
        assert_eq!(
            (t.choice.clone(), t.parallel, t.functions[0].name.as_str()),
            (ToolChoice::Auto, true, "get_weather")
        );
        let t = read(json!({"tools": weather(), "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                            "parallel_tool_calls": false}))
        .unwrap()
        .unwrap();
        assert_eq!(
            (t.choice, t.parallel),
            (ToolChoice::Named("get_weather".into()), false)
        );
        for (v, param, says) in [
            (json!({"tools": {}}), "tools", "array"),
            (
                json!({"tools": [{"type": "retrieval"}]}),
                "tools[0].type",
                "retrieval",
            ),
            (
                json!({"tools": [{"type": "function"}]}),
                "tools[0].function",
                "name",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
                "tools[0].function.name",
                "a b",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
                "tools[0].function.parameters",
                "schema",
            ),
            (
                json!({"tools": weather(), "tool_choice": "any"}),
                "tool_choice",
                "any",
            ),
            (json!({"tool_choice": "required"}), "tool_choice", "needs"),
            (
                json!({"tools": weather(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
                "tool_choice",
                "nope",
            ),
            (
                json!({"tools": weather(), "parallel_tool_calls": 1}),
                "parallel_tool_calls",
                "boolean",
            ),
        ] {
            crate::serve::error::assert_refused(&read(v.clone()).unwrap_err(), param, says, &v);
        }
    }

    #[test]
    fn formats_of_templates() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat_templates");
        let of = |f: &str| ToolFormat::of_template(&std::fs::read_to_string(dir.join(f)).unwrap());
        assert_eq!(of("Qwen-Qwen3-0.6B.jinja"), ToolFormat::Hermes);
        assert_eq!(
            of("meta-llama-Llama-3.1-8B-Instruct.jinja"),
            ToolFormat::Llama3Json
        );
        assert_eq!(of("google-gemma-2-2b-it.jinja"), ToolFormat::Hermes);
    }
}
