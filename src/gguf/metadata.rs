//! Typed access to a GGUF file's metadata, with errors that name the file and the key.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use candle_core::{Error, Result};

/// Typed access to GGUF metadata whose errors name the file, the key and what was found.
#[derive(Debug, Clone, Copy)]
pub struct Metadata<'a> {
    map: &'a HashMap<String, Value>,
    path: &'a Path,
}

impl<'a> Metadata<'a> {
    /// Wraps the metadata `map` read from the file at `path` (used in error messages).
    pub fn new(map: &'a HashMap<String, Value>, path: &'a Path) -> Self {
        Self { map, path }
    }

    /// The file the metadata came from.
    pub fn path(&self) -> &'a Path {
        self.path
    }

    /// The raw value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key)
    }

    fn missing(&self, key: &str) -> Error {
        Error::Msg(format!(
            "{}: GGUF metadata key {key} is missing",
            self.path.display()
        ))
    }

    fn wrong_type(&self, key: &str, want: &str, v: &Value) -> Error {
        Error::Msg(format!(
            "{}: GGUF metadata key {key} should be {want}, found {:?}",
            self.path.display(),
            v.value_type()
        ))
    }

    /// A non-negative integer (any integer type), if present.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        value_as_i64(v)
            .and_then(|x| u64::try_from(x).ok())
            .map(Some)
            .ok_or_else(|| self.wrong_type(key, "a non-negative integer", v))
    }

    /// A required non-negative integer that fits in `usize`.
    pub fn usize(&self, key: &str) -> Result<usize> {
        let v = self.opt_u64(key)?.ok_or_else(|| self.missing(key))?;
        usize::try_from(v).map_err(|_| {
            Error::Msg(format!(
                "{}: GGUF metadata key {key} = {v} does not fit in usize",
                self.path.display()
            ))
        })
    }

    /// An optional non-negative integer that fits in `u32` (token ids).
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>> {
        match self.opt_u64(key)? {
            None => Ok(None),
            Some(v) => u32::try_from(v).map(Some).map_err(|_| {
                Error::Msg(format!(
                    "{}: GGUF metadata key {key} = {v} does not fit in u32",
                    self.path.display()
                ))
            }),
        }
    }

    /// A floating-point value (f32 or f64), if present.
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(*x)),
            Some(Value::F64(x)) => Ok(Some(*x as f32)),
            Some(v) => Err(self.wrong_type(key, "a float", v)),
        }
    }

    /// A required floating-point value.
    pub fn f32(&self, key: &str) -> Result<f32> {
        self.opt_f32(key)?.ok_or_else(|| self.missing(key))
    }

    /// A boolean, if present.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong_type(key, "a bool", v)),
        }
    }

    /// A string, if present.
    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(v) => Err(self.wrong_type(key, "a string", v)),
        }
    }

    /// A required string.
    pub fn str(&self, key: &str) -> Result<&'a str> {
        self.opt_str(key)?.ok_or_else(|| self.missing(key))
    }

    /// A required array of strings.
    pub fn str_array(&self, key: &str) -> Result<Vec<&'a str>> {
        let v = self.get(key).ok_or_else(|| self.missing(key))?;
        let Value::Array(items) = v else {
            return Err(self.wrong_type(key, "an array of strings", v));
        };
        items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => Ok(s.as_str()),
                other => Err(Error::Msg(format!(
                    "{}: GGUF metadata key {key}[{i}] should be a string, found {:?}",
                    self.path.display(),
                    other.value_type()
                ))),
            })
            .collect()
    }

    /// An array of integers (any integer type), if present.
    pub fn opt_i64_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let Value::Array(items) = v else {
            return Err(self.wrong_type(key, "an array of integers", v));
        };
        items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                value_as_i64(item).ok_or_else(|| {
                    Error::Msg(format!(
                        "{}: GGUF metadata key {key}[{i}] should be an integer, found {:?}",
                        self.path.display(),
                        item.value_type()
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

fn value_as_i64(v: &Value) -> Option<i64> {
    match v {
        Value::U8(x) => Some(i64::from(*x)),
        Value::I8(x) => Some(i64::from(*x)),
        Value::U16(x) => Some(i64::from(*x)),
        Value::I16(x) => Some(i64::from(*x)),
        Value::U32(x) => Some(i64::from(*x)),
        Value::I32(x) => Some(i64::from(*x)),
        Value::U64(x) => i64::try_from(*x).ok(),
        Value::I64(x) => Some(*x),
        _ => None,
    }
}
