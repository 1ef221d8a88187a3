//! What jinja2 does the Python way and minijinja otherwise.
//!
//! - Python's methods on strings, lists and dicts (`content.startswith(...)`,
//!   `content.split(...)`, `message.items()`, ...): minijinja-contrib's `pycompat`, except
//!   `str.find` and `str.rfind`, which pycompat answers in bytes where Python answers in
//!   characters (and minijinja slices in characters: `s[s.find('</think>'):]` must cut where
//!   Python cuts, whatever precedes it), and `str.count`, which in pycompat never returns for
//!   `''` (Python: the length + 1); all three with Python's optional `start` and `end`.
//! - The `sequence` and `iterable` tests, which in jinja2 ask Python (`len` and `[]`, `iter`):
//!   a string is a sequence there (Llama 3.1 tests `content is iterable` to choose between
//!   printing and `tojson`), and `none` is not iterable.

use minijinja::value::{from_args, ValueKind};
use minijinja::{Error, State, Value};

/// The unknown-method callback of the chat-template environment.
pub(crate) fn unknown_method(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    match (value.kind(), method, value.as_str()) {
        (ValueKind::String, "find" | "rfind" | "count", Some(s)) => {
            let (sub, start, end): (&str, Option<i64>, Option<i64>) = from_args(args)?;
            let Some(hay) = Slice::new(s, start, end) else {
                return Ok(Value::from(if method == "count" { 0 } else { -1 }));
            };
            Ok(Value::from(match method {
                "count" => hay.count(sub),
                m => hay.find(sub, m == "rfind"),
            }))
        }
        _ => minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args),
    }
}

/// `s[start:end]` with Python's bounds (CPython's `ADJUST_INDICES`): negative from the end,
/// at least 0, `end` at most the length; `None` when `start` is past `end` (where Python finds
/// nothing, not even `''`).
struct Slice<'a> {
    text: &'a str,
    /// The character index of `text` in the whole string.
    start: i64,
}

impl<'a> Slice<'a> {
    fn new(s: &'a str, start: Option<i64>, end: Option<i64>) -> Option<Self> {
        let n = s.chars().count() as i64;
        let bound = |i: Option<i64>, default: i64| {
            let i = i.unwrap_or(default);
            (if i < 0 { i + n } else { i }).max(0)
        };
        let (start, end) = (bound(start, 0), bound(end, n).min(n));
        if start > end {
            return None;
        }
        let byte = |ci: i64| {
            s.char_indices()
                .nth(ci as usize)
                .map_or(s.len(), |(b, _)| b)
        };
        Some(Self {
            text: &s[byte(start)..byte(end)],
            start,
        })
    }

    /// `s.find(sub, start, end)` (`s.rfind` with `reverse`): the character index of the first
    /// (last) `sub`, or -1.
    fn find(&self, sub: &str, reverse: bool) -> i64 {
        let found = if reverse {
            self.text.rfind(sub)
        } else {
            self.text.find(sub)
        };
        found.map_or(-1, |b| self.start + self.text[..b].chars().count() as i64)
    }

    /// `s.count(sub, start, end)`: the non-overlapping occurrences of `sub`; `''` occurs
    /// before every character and at the end.
    fn count(&self, sub: &str) -> i64 {
        if sub.is_empty() {
            self.text.chars().count() as i64 + 1
        } else {
            self.text.matches(sub).count() as i64
        }
    }
}

/// jinja2's `sequence` test: whatever has a length and `[]` (strings and maps too, and the
/// undefined value); minijinja's is true for lists only.
pub(crate) fn is_sequence(value: &Value) -> bool {
    matches!(
        value.kind(),
        ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Seq
            | ValueKind::Map
            | ValueKind::Undefined
    )
}

/// jinja2's `iterable` test: what Python's `iter()` accepts (not `none`, which minijinja
/// iterates as empty).
pub(crate) fn is_iterable(value: &Value) -> bool {
    is_sequence(value) || value.kind() == ValueKind::Iterable
}

#[cfg(test)]
mod tests {
    use super::*;

    fn find(s: &str, sub: &str, start: Option<i64>, end: Option<i64>, reverse: bool) -> i64 {
        Slice::new(s, start, end).map_or(-1, |h| h.find(sub, reverse))
    }

    fn count(s: &str, sub: &str, start: Option<i64>, end: Option<i64>) -> i64 {
        Slice::new(s, start, end).map_or(0, |h| h.count(sub))
    }

    #[test]
    fn find_counts_characters_like_python() {
        // Python: "Ça va, ça va".find("a") == 1; .rfind("a") == 11; .find("ç") == 7
        let s = "Ça va, ça va";
        assert_eq!(find(s, "a", None, None, false), 1);
        assert_eq!(find(s, "a", None, None, true), 11);
        assert_eq!(find(s, "ç", None, None, false), 7);
        assert_eq!(find(s, "x", None, None, false), -1);
        // .find("a", 2) == 4; .find("a", -3) == 11; .find("a", 2, 4) == -1; .rfind("a", 0, -1) == 8
        assert_eq!(find(s, "a", Some(2), None, false), 4);
        assert_eq!(find(s, "a", Some(-3), None, false), 11);
        assert_eq!(find(s, "a", Some(2), Some(4), false), -1);
        assert_eq!(find(s, "a", Some(0), Some(-1), true), 8);
        // "".find("") == 0; "abc".find("", 5) == -1; "abc".rfind("") == 3; "abc".find("", 3) == 3
        assert_eq!(find("", "", None, None, false), 0);
        assert_eq!(find("abc", "", Some(5), None, false), -1);
        assert_eq!(find("abc", "", None, None, true), 3);
        assert_eq!(find("abc", "", Some(3), None, false), 3);
    }

    #[test]
    fn count_is_pythons() {
        // "aaaa".count("aa") == 2; "abc".count("") == 4; "Ça va ça".count("a", 2) == 2;
        // "abc".count("", 5) == 0; "".count("") == 1; "abc".count("", 3) == 1;
        // "abcabc".count("c", -4, -1) == 1
        assert_eq!(count("aaaa", "aa", None, None), 2);
        assert_eq!(count("abc", "", None, None), 4);
        assert_eq!(count("Ça va ça", "a", Some(2), None), 2);
        assert_eq!(count("abc", "", Some(5), None), 0);
        assert_eq!(count("", "", None, None), 1);
        assert_eq!(count("abc", "", Some(3), None), 1);
        assert_eq!(count("abcabc", "c", Some(-4), Some(-1)), 1);
    }
}
