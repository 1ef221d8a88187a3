//! The messages as transformers hands them to a chat template: `_normalize_chat_messages`
//! drops the keys whose value is `None` (OpenAI's `content: null` beside `tool_calls`: many
//! templates handle a missing key but print `None`), and `_alias_reasoning_fields` puts the
//! reasoning (`reasoning_content`, `thinking` or `reasoning`, the first set) under both
//! `thinking` (first) and `reasoning_content` (where it was, else last).

use minijinja::value::ValueKind;
use minijinja::Value;

/// The names of a message's reasoning, in the order transformers looks for them.
const REASONING: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// `messages` normalised as transformers normalises them; a message that is not a map is
/// passed as it is.
pub(crate) fn normalize(messages: &[Value]) -> Value {
    Value::from(messages.iter().map(normalize_one).collect::<Vec<_>>())
}

fn normalize_one(message: &Value) -> Value {
    if message.kind() != ValueKind::Map {
        return message.clone();
    }
    let Ok(keys) = message.try_iter() else {
        return message.clone();
    };
    let mut pairs: Vec<(Value, Value)> = keys
        .filter_map(|k| {
            let v = message.get_item(&k).ok()?;
            (!v.is_none() && !v.is_undefined()).then_some((k, v))
        })
        .collect();
    let reasoning = REASONING.iter().find_map(|name| {
        pairs
            .iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v.clone())
    });
    if let Some(reasoning) = reasoning {
        // {"thinking": reasoning, **message, "reasoning_content": reasoning}
        let own_thinking = take(&mut pairs, "thinking");
        pairs.insert(
            0,
            (
                Value::from("thinking"),
                own_thinking.unwrap_or_else(|| reasoning.clone()),
            ),
        );
        match pairs
            .iter_mut()
            .find(|(k, _)| k.as_str() == Some("reasoning_content"))
        {
            Some((_, v)) => *v = reasoning,
            None => pairs.push((Value::from("reasoning_content"), reasoning)),
        }
    }
    pairs.into_iter().collect()
}

/// Removes the entry `key` from `pairs`, returning its value.
fn take(pairs: &mut Vec<(Value, Value)>, key: &str) -> Option<Value> {
    let i = pairs.iter().position(|(k, _)| k.as_str() == Some(key))?;
    Some(pairs.remove(i).1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(text: &str) -> Value {
        serde_json::from_str(text).unwrap()
    }

    fn keys(v: &Value) -> Vec<String> {
        v.try_iter().unwrap().map(|k| k.to_string()).collect()
    }

    #[test]
    fn none_values_are_dropped() {
        let m = normalize(&[json(
            r#"{"role": "assistant", "content": null, "tool_calls": []}"#,
        )]);
        let m = m.get_item_by_index(0).unwrap();
        assert_eq!(keys(&m), ["role", "tool_calls"]);
    }

    #[test]
    fn reasoning_is_aliased_in_transformers_order() {
        let m = normalize(&[json(
            r#"{"role": "assistant", "reasoning": "r", "content": "c", "reasoning_content": null}"#,
        )]);
        let m = m.get_item_by_index(0).unwrap();
        assert_eq!(
            keys(&m),
            [
                "thinking",
                "role",
                "reasoning",
                "content",
                "reasoning_content"
            ]
        );
        assert_eq!(m.get_attr("thinking").unwrap().as_str(), Some("r"));
        assert_eq!(m.get_attr("reasoning_content").unwrap().as_str(), Some("r"));
        // A message's own `thinking` keeps its value and moves first.
        let m = normalize(&[json(
            r#"{"role": "assistant", "reasoning_content": "a", "thinking": "b"}"#,
        )]);
        let m = m.get_item_by_index(0).unwrap();
        assert_eq!(keys(&m), ["thinking", "role", "reasoning_content"]);
        assert_eq!(m.get_attr("thinking").unwrap().as_str(), Some("b"));
        assert_eq!(m.get_attr("reasoning_content").unwrap().as_str(), Some("a"));
    }
}
