//! Reading the model's tool calls out of its text, whole or as it streams: [`ToolStream`]
//! passes the text on as content until a call begins (`<tool_call>` in the Hermes format; a
//! `{` opening the answer in Llama 3's JSON format), holds the rest, and at the end parses
//! the calls ([`parse_calls`]). What does not parse as calls is content after all, as vLLM's
//! parsers do.

use serde_json::{json, Value};

use crate::serve::tools::ToolFormat;

/// One call, as OpenAI's `tool_calls` entry carries it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// The arguments: a JSON object, as text.
    pub arguments: String,
}

impl ToolCall {
    /// OpenAI's `{"id", "type": "function", "function": {"name", "arguments"}}` (with
    /// `index` when streamed).
    pub fn to_json(&self, id: &str, index: Option<usize>) -> Value {
        let mut v = json!({"id": id, "type": "function",
                           "function": {"name": self.name, "arguments": self.arguments}});
        if let Some(i) = index {
            v["index"] = json!(i);
        }
        v
    }
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";

/// `v` with whole numbers written as integers: `-0` and `1e3`, which the JSON grammar allows
/// for an integer and serde_json reads as floats, are `0` and `1000` (as Python's `json`
/// gives them), not `-0.0` and `1000.0`.
fn whole_numbers(v: Value) -> Value {
    match v {
        Value::Number(n) if n.is_f64() => match n.as_f64() {
            Some(x) if x.fract() == 0.0 && x.abs() < 9.007_199_254_740_992e15 => json!(x as i64),
            _ => Value::Number(n),
        },
        Value::Array(a) => Value::Array(a.into_iter().map(whole_numbers).collect()),
        Value::Object(o) => {
            Value::Object(o.into_iter().map(|(k, x)| (k, whole_numbers(x))).collect())
        }
        v => v,
    }
}

/// A call from a JSON object with `name` and `arguments` (or `parameters`): an object, or a
/// string holding one.
fn call_of(v: &Value) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments").or_else(|| v.get("parameters"));
    let args = match args {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(a @ Value::Object(_)) => a.clone(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(a @ Value::Object(_)) => a,
            _ => return None,
        },
        Some(_) => return None,
    };
    Some(ToolCall {
        name,
        arguments: whole_numbers(args).to_string(),
    })
}

/// The calls of `text` (which starts where the calls start) in `format`, or `None` when it
/// does not parse as calls.
pub fn parse_calls(format: ToolFormat, text: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    match format {
        ToolFormat::Hermes => {
            let mut rest = text.trim();
            while !rest.is_empty() {
                let body = rest.strip_prefix(HERMES_OPEN)?;
                let (inner, after) = match body.find(HERMES_CLOSE) {
                    Some(end) => (&body[..end], &body[end + HERMES_CLOSE.len()..]),
                    None => (body, ""), // the answer ended inside the last call
                };
                let v: Value = serde_json::from_str(inner.trim()).ok()?;
                calls.push(call_of(&v)?);
                rest = after.trim_start();
            }
        }
        ToolFormat::Llama3Json => {
            let text = text.trim_start();
            let text = text.strip_prefix("<|python_tag|>").unwrap_or(text);
            // Calls one after the other, separated by whitespace or ';'.
            let mut rest = text.trim();
            while !rest.is_empty() {
                let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
                let v = values.next()?.ok()?;
                calls.push(call_of(&v)?);
                rest = rest[values.byte_offset()..].trim_start();
                rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
            }
        }
    }
    (!calls.is_empty()).then_some(calls)
}

/// The content and calls of one choice, as its text streams in.
#[derive(Debug)]
pub struct ToolStream {
    format: ToolFormat,
    parallel: bool,
    /// Text not passed on yet: a possible start of a call, or the call(s).
    held: String,
    /// Whether a call has begun (the rest of the text is held).
    in_call: bool,
    /// Whether content was passed on (Llama 3 JSON: a call only opens the answer).
    sent: bool,
}

impl ToolStream {
    /// A stream reading calls in `format`; without `parallel` only the first call is kept.
    pub fn new(format: ToolFormat, parallel: bool) -> Self {
        Self {
            format,
            parallel,
            held: String::new(),
            in_call: false,
            sent: false,
        }
    }

    /// The content of `piece` that can be passed on now.
    pub fn push(&mut self, piece: &str) -> String {
        self.held.push_str(piece);
        if self.in_call {
            return String::new();
        }
        let out = match self.format {
            ToolFormat::Hermes => match self.held.find(HERMES_OPEN) {
                Some(at) => {
                    self.in_call = true;
                    let content: String = self.held.drain(..at).collect();
                    content
                }
                None => {
                    // Hold back what could be the start of the marker.
                    let keep = (1..HERMES_OPEN.len())
                        .rev()
                        .find(|&n| {
                            self.held.len() >= n
                                && self.held.is_char_boundary(self.held.len() - n)
                                && HERMES_OPEN.starts_with(&self.held[self.held.len() - n..])
                        })
                        .unwrap_or(0);
                    self.held.drain(..self.held.len() - keep).collect()
                }
            },
            ToolFormat::Llama3Json => {
                let start = self.held.trim_start();
                if self.sent {
                    std::mem::take(&mut self.held)
                } else if start.is_empty() {
                    String::new()
                } else if start.starts_with('{') || start.starts_with("<|python_tag|>") {
                    self.in_call = true;
                    String::new()
                } else {
                    std::mem::take(&mut self.held)
                }
            }
        };
        if !out.is_empty() {
            self.sent = true;
        }
        out
    }

    /// At the end: the content still held (text that turned out not to be calls) and the
    /// calls.
    pub fn finish(&mut self) -> (String, Vec<ToolCall>) {
        let held = std::mem::take(&mut self.held);
        if !self.in_call {
            return (held, Vec::new());
        }
        match parse_calls(self.format, &held) {
            Some(mut calls) => {
                if !self.parallel {
                    calls.truncate(1);
                }
                (String::new(), calls)
            }
            None => (held, Vec::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, args: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: args.into(),
        }
    }

    /// Whole and in pieces of every size: the same content and calls.
    fn run(format: ToolFormat, text: &str) -> (String, Vec<ToolCall>) {
        let mut whole = ToolStream::new(format, true);
        let mut content = whole.push(text);
        let (rest, calls) = whole.finish();
        content.push_str(&rest);
        for size in 1..6 {
            let mut s = ToolStream::new(format, true);
            let mut c = String::new();
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(size) {
                c.push_str(&s.push(&piece.iter().collect::<String>()));
            }
            let (rest, got) = s.finish();
            c.push_str(&rest);
            assert_eq!((&c, &got), (&content, &calls), "pieces of {size}: {text:?}");
        }
        (content, calls)
    }

    #[test]
    fn hermes_calls() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": \"{}\"}\n</tool_call>";
        assert_eq!(
            run(ToolFormat::Hermes, text),
            (
                "Let me look.\n".to_string(),
                vec![
                    call("get_weather", r#"{"city":"Paris"}"#),
                    call("now", "{}")
                ]
            )
        );
        // Ended inside the call (a stop at the closing tag's first token).
        let (_, calls) = run(
            ToolFormat::Hermes,
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": -0, \"b\": [1e3, 0.5]}}",
        );
        assert_eq!(calls, [call("f", r#"{"a":0,"b":[1000,0.5]}"#)]);
        // Text with a '<' that is no call, and a broken call: content.
        let plain = "1 < 2 and <tool_ is not a call";
        assert_eq!(run(ToolFormat::Hermes, plain), (plain.to_string(), vec![]));
        let broken = "<tool_call>{\"name\": 3}</tool_call>";
        assert_eq!(
            run(ToolFormat::Hermes, broken),
            (broken.to_string(), vec![])
        );
        let mut one = ToolStream::new(ToolFormat::Hermes, false);
        one.push(text);
        assert_eq!(
            one.finish().1.len(),
            1,
            "parallel_tool_calls false keeps the first call"
        );
    }

    #[test]
    fn llama3_json_calls() {
        let text = " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"now\", \"parameters\": {}}";
        assert_eq!(
            run(ToolFormat::Llama3Json, text),
            (
                String::new(),
                vec![
                    call("get_weather", r#"{"city":"Paris"}"#),
                    call("now", "{}")
                ]
            )
        );
        let plain = "The weather is {fine}.";
        assert_eq!(
            run(ToolFormat::Llama3Json, plain),
            (plain.to_string(), vec![])
        );
        let not_call = "{\"answer\": 4}";
        assert_eq!(
            run(ToolFormat::Llama3Json, not_call),
            (not_call.to_string(), vec![])
        );
    }
}
