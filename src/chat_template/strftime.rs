//! transformers' `strftime_now(format)`: `datetime.now().strftime(format)`, the local date and
//! time (Llama 3.2's and 3.3's templates print today's date with `strftime_now("%d %b %Y")`).
//!
//! CPython formats with the C library's `strftime` after replacing the directives it handles
//! itself; this does the same: `%f` (microseconds) here, and `%z`, `%:z`, `%Z` empty, as for
//! Python's naive `datetime.now()`. The C locale is the one both see (neither calls
//! `setlocale`).

use std::ffi::CString;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::{Error, ErrorKind};

/// The local time now, formatted by `format` (C `strftime` directives).
pub(crate) fn strftime_now(format: String) -> Result<String, Error> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("strftime_now: {e}")))?;
    strftime_local(&format, now.as_secs() as libc::time_t, now.subsec_micros())
}

/// `format` applied to the local time of `secs` (since the epoch) and `micros`.
fn strftime_local(format: &str, secs: libc::time_t, micros: u32) -> Result<String, Error> {
    let fail =
        |what: &str| Error::new(ErrorKind::InvalidOperation, format!("strftime_now: {what}"));
    let c_format = CString::new(python_directives(format, micros))
        .map_err(|_| fail("the format contains a NUL character"))?;
    // SAFETY: `tm` is plain data that localtime_r fills; strftime writes at most `buf.len()`
    // bytes into `buf` and reads the NUL-terminated `c_format` and the filled `tm`.
    unsafe {
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&secs, &mut tm).is_null() {
            return Err(fail("the local time is not representable"));
        }
        // strftime returns 0 both for an empty result and for a too small buffer: grow it a
        // few times, then take the empty result as the answer (as CPython does).
        let mut size = 64 + 8 * format.len();
        for _ in 0..4 {
            let mut buf = vec![0u8; size];
            let n = libc::strftime(buf.as_mut_ptr().cast(), size, c_format.as_ptr(), &tm);
            if n > 0 {
                buf.truncate(n);
                return String::from_utf8(buf).map_err(|_| fail("the result is not UTF-8"));
            }
            size *= 8;
        }
    }
    Ok(String::new())
}

/// `format` with the directives CPython's `datetime.strftime` handles itself replaced: `%f`
/// by the microseconds, `%z`, `%:z` and `%Z` by nothing (a naive datetime has no zone);
/// `%%` and every other directive are left to the C library.
fn python_directives(format: &str, micros: u32) -> String {
    let mut out = String::with_capacity(format.len());
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.peek() {
            Some('f') => {
                chars.next();
                out.push_str(&format!("{micros:06}"));
            }
            Some('z') | Some('Z') => {
                chars.next();
            }
            Some(':') => {
                let mut ahead = chars.clone();
                ahead.next();
                if ahead.peek() == Some(&'z') {
                    chars.next();
                    chars.next();
                } else {
                    out.push('%');
                }
            }
            Some(_) => {
                out.push('%');
                out.extend(chars.next());
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_directives_are_replaced() {
        assert_eq!(
            python_directives("%d %b %Y %f%z%Z%:z %% %%f %:x %", 42),
            "%d %b %Y 000042 %% %%f %:x %"
        );
    }

    #[test]
    fn formats_with_the_c_library() {
        // 2024-07-26 12:00:00 UTC is the 26th (or its neighbours) in every zone.
        let s = strftime_local("%Y-%m %% %f", 1_721_995_200, 7).unwrap();
        assert_eq!(s, "2024-07 % 000007");
        let today = strftime_now("%d %b %Y".into()).unwrap();
        assert_eq!(today.len(), 11, "{today:?}");
        assert_eq!(strftime_local("", 0, 0).unwrap(), "");
    }
}
