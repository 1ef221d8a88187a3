//! transformers' `{% generation %}...{% endgeneration %}` tag (its `AssistantTracker`
//! extension, which marks the assistant's tokens for `return_assistant_tokens_mask`): when
//! rendering a prompt it renders its body. minijinja has no custom tags, so the tag is
//! rewritten to `{% if true %}...{% endif %}`, a block tag like it: the `-`/`+` whitespace
//! markers and `trim_blocks`/`lstrip_blocks` apply to it exactly as they did.

use std::borrow::Cow;

/// `source` with each `generation` tag made `if true` and each `endgeneration` `endif`. Text
/// that looks like the tag inside a string literal or a `{% raw %}` block would be rewritten
/// too; no template is known to have one.
pub(crate) fn rewrite(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len() + 16);
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let (before, tag) = rest.split_at(start);
        out.push_str(before);
        // "{%", an optional whitespace marker, spaces, the keyword, then the tag's end.
        let open = 2 + tag[2..].starts_with(['-', '+']) as usize;
        let spaces = tag[open..].len() - tag[open..].trim_start().len();
        let word_at = open + spaces;
        let word_len = tag[word_at..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tag.len() - word_at);
        let replacement = match &tag[word_at..word_at + word_len] {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str(&tag[..word_at]);
                out.push_str(r);
                rest = &tag[word_at + word_len..];
            }
            None => {
                out.push_str(&tag[..2]);
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_become_if_blocks() {
        assert_eq!(
            rewrite("a{% generation %}b{%- endgeneration -%}c{%+generation%}{%endgeneration%}"),
            "a{% if true %}b{%- endif -%}c{%+if true%}{%endif%}"
        );
        assert_eq!(
            rewrite("{% if generation_x %}{{ generation }}{% endif %}"),
            "{% if generation_x %}{{ generation }}{% endif %}"
        );
        assert!(matches!(rewrite("{% if x %}{% endif %}"), Cow::Borrowed(_)));
    }
}
