//! Python's `json.dumps`, the `tojson` filter of transformers' chat templates
//! (`json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`).
//!
//! minijinja's own `tojson` writes compact JSON with HTML-safe escapes (`{"a":1}`,
//! `\u003c`); Python writes `{"a": 1}`, keeps `<` and, with `ensure_ascii=False`, every
//! non-ASCII character, and prints floats as `repr` does (`2.0`, `1e+16`, `1.5e-07`). Templates
//! put the output in the prompt (Qwen3's tool list, Llama 3.1's `tojson(indent=4)`), so it must
//! be Python's to the byte.

use minijinja::value::{from_args, Kwargs, Rest, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// The options of `json.dumps` a template can set.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// Escape every non-ASCII character as `\uXXXX` (transformers' default: false).
    pub ensure_ascii: bool,
    /// Pretty-print: `None` on one line; else a newline before each item, indented by this
    /// string per level (Python's `indent=4` is four spaces).
    pub indent: Option<String>,
    /// Between items; Python's default is `", "` on one line, `","` when indenting.
    pub item_separator: String,
    /// Between a key and its value, `": "` by default.
    pub key_separator: String,
    /// Maps in key order rather than their own.
    pub sort_keys: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            ensure_ascii: false,
            indent: None,
            item_separator: ", ".into(),
            key_separator: ": ".into(),
            sort_keys: false,
        }
    }
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

impl Options {
    /// The options from the filter's arguments (none or undefined: the default), read as
    /// Python reads them: `indent` an integer (that many spaces) or a string, `separators` a
    /// pair of strings.
    pub fn from_values(
        ensure_ascii: &Value,
        indent: &Value,
        separators: &Value,
        sort_keys: &Value,
    ) -> Result<Self, Error> {
        let unset = |v: &Value| v.is_none() || v.is_undefined();
        let mut o = Options {
            ensure_ascii: !unset(ensure_ascii) && ensure_ascii.is_true(),
            sort_keys: !unset(sort_keys) && sort_keys.is_true(),
            ..Options::default()
        };
        if !unset(indent) {
            o.indent = Some(match indent.kind() {
                ValueKind::String => indent.to_string(),
                ValueKind::Number if indent.is_integer() => {
                    let n = i64::try_from(indent.clone()).unwrap_or(0);
                    " ".repeat(n.clamp(0, 1 << 16) as usize)
                }
                _ => {
                    return Err(invalid(format!(
                        "tojson: indent must be an integer or a string, not {}",
                        indent.kind()
                    )))
                }
            });
            o.item_separator = ",".into();
        }
        if !unset(separators) {
            let pair: Vec<Value> = separators
                .try_iter()
                .map_err(|_| invalid("tojson: separators must be a pair of strings"))?
                .collect();
            match pair.as_slice() {
                [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                    o.item_separator = item.to_string();
                    o.key_separator = key.to_string();
                }
                _ => return Err(invalid("tojson: separators must be a pair of strings")),
            }
        }
        Ok(o)
    }
}

/// `value` as Python's `json.dumps` writes it with `options`. Undefined values, namespaces,
/// functions and other objects are errors, as they are not JSON serializable in Python.
pub fn dumps(value: &Value, options: &Options) -> Result<String, Error> {
    let mut out = String::new();
    write_value(&mut out, value, options, 0)?;
    Ok(out)
}

/// `tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// positionally or by keyword, as transformers' filter.
pub(crate) fn filter(value: &Value, args: Rest<Value>) -> Result<String, Error> {
    type Args = (
        Option<Value>,
        Option<Value>,
        Option<Value>,
        Option<Value>,
        Kwargs,
    );
    let (ensure_ascii, indent, separators, sort_keys, kwargs): Args = from_args(&args)?;
    let arg = |pos: Option<Value>, key: &str| -> Result<Value, Error> {
        match (pos, kwargs.get::<Option<Value>>(key)?) {
            (Some(_), Some(_)) => Err(Error::new(
                ErrorKind::TooManyArguments,
                format!("tojson() got multiple values for argument '{key}'"),
            )),
            (Some(v), None) | (None, Some(v)) => Ok(v),
            (None, None) => Ok(Value::from(())),
        }
    };
    let options = Options::from_values(
        &arg(ensure_ascii, "ensure_ascii")?,
        &arg(indent, "indent")?,
        &arg(separators, "separators")?,
        &arg(sort_keys, "sort_keys")?,
    )?;
    kwargs.assert_all_used()?;
    dumps(value, &options)
}

fn newline(out: &mut String, options: &Options, level: usize) {
    if let Some(indent) = &options.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

fn write_value(out: &mut String, value: &Value, o: &Options, level: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => out.push_str(&float_repr(f64::try_from(value.clone())?)),
        ValueKind::String => write_string(out, value.as_str().unwrap_or_default(), o.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_items(out, ('[', ']'), items.len(), o, level, |out, i| {
                write_value(out, &items[i], o, level + 1)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if o.sort_keys {
                keys.sort();
            }
            write_items(out, ('{', '}'), keys.len(), o, level, |out, i| {
                write_string(out, &key_string(&keys[i])?, o.ensure_ascii);
                out.push_str(&o.key_separator);
                write_value(out, &value.get_item(&keys[i])?, o, level + 1)
            })?;
        }
        kind => {
            return Err(invalid(format!(
                "tojson: a value of kind {kind} is not JSON serializable"
            )))
        }
    }
    Ok(())
}

/// `open`, the `n` items `item` writes separated as Python separates them, `close`.
fn write_items(
    out: &mut String,
    (open, close): (char, char),
    n: usize,
    o: &Options,
    level: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    for i in 0..n {
        if i > 0 {
            out.push_str(&o.item_separator);
        }
        newline(out, o, level + 1);
        item(out, i)?;
    }
    if n > 0 {
        newline(out, o, level);
    }
    out.push(close);
    Ok(())
}

/// A map key as Python's JSON encoder converts it: strings as they are, numbers as they print,
/// `true`/`false`/`null`; anything else is a `TypeError` there.
fn key_string(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::Number if key.is_integer() => key.to_string(),
        ValueKind::Number => float_repr(f64::try_from(key.clone())?),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).into(),
        ValueKind::None => "null".into(),
        kind => {
            return Err(invalid(format!(
                "tojson: keys must be str, int, float, bool or None, not {kind}"
            )))
        }
    })
}

/// A JSON string as Python's encoder writes it: `"`, `\` and the control characters escaped
/// (`\n`, `\r`, `\t`, `\b`, `\f`, else `\u00xx`), with `ensure_ascii` also everything outside
/// printable ASCII (`\uxxxx`, UTF-16 surrogate pairs above U+FFFF).
fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A float as Python's `repr` (and so `json.dumps`) writes it: the shortest digits that read
/// back as the same float, positionally when the decimal exponent is in -5..16 (with `.0` on
/// whole numbers), else as `d.ddde+XX`; `NaN`, `Infinity`, `-Infinity`.
pub fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-7".
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let n = digits.len() as i32;
    let decpt = exp + 1; // the value is 0.DIGITS × 10^decpt
    let body = if decpt <= -4 || decpt > 16 {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{first}{frac}e{esign}{:02}", exp.abs())
    } else if decpt <= 0 {
        format!("0.{}{digits}", "0".repeat((-decpt) as usize))
    } else if decpt < n {
        let (int, frac) = digits.split_at(decpt as usize);
        format!("{int}.{frac}")
    } else {
        format!("{digits}{}.0", "0".repeat((decpt - n) as usize))
    };
    format!("{sign}{body}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_repr() {
        // The values of Python 3's repr().
        let cases = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (2.5, "2.5"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789012345680.0, "1.2345678901234568e+17"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-123.456, "-123.456"),
            (1e300, "1e+300"),
            (5e-324, "5e-324"),
            (f64::MAX, "1.7976931348623157e+308"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for (x, want) in cases {
            assert_eq!(float_repr(x), want, "{x:e}");
        }
    }

    #[test]
    fn strings_escape_as_python() {
        let v = Value::from("a\"b\\c\nd\u{1}\u{7f}é😀");
        assert_eq!(
            dumps(&v, &Options::default()).unwrap(),
            "\"a\\\"b\\\\c\\nd\\u0001\u{7f}é😀\""
        );
        let ascii = Options {
            ensure_ascii: true,
            ..Options::default()
        };
        assert_eq!(
            dumps(&v, &ascii).unwrap(),
            "\"a\\\"b\\\\c\\nd\\u0001\\u007f\\u00e9\\ud83d\\ude00\""
        );
    }

    #[test]
    fn undefined_is_not_serializable() {
        assert!(dumps(&Value::UNDEFINED, &Options::default()).is_err());
    }
}
