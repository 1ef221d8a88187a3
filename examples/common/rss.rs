//! This process's anonymous resident memory, for the examples' reports (`rss_bytes`).

use anyhow::{Context, Result};

/// This process's anonymous resident memory (`RssAnon` of /proc/self/status), in bytes.
pub fn rss_anon_bytes() -> Result<i64> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let line = status
        .lines()
        .find(|l| l.starts_with("RssAnon:"))
        .context("no RssAnon line in /proc/self/status")?;
    let kb: i64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("cannot parse {line:?}"))?;
    Ok(kb * 1024)
}
