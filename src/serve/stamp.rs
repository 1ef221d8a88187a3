//! What stamps an answer: an id unique to it (`chatcmpl-...`, `cmpl-...`, `call-...`) and
//! the Unix time it was created at (`created`, also in the model cards).
//!
//! Below the routes: [`http`](super::http), [`endpoints`](super::endpoints),
//! [`job`](super::job) and [`embeddings`](super::embeddings) import it; it imports nothing of
//! the crate.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// An id (`<kind>-...`) unique in this process and unlikely to repeat across processes: a
/// random 64-bit prefix drawn once and a counter (`seed` and time play no part, so equal
/// seeds in the same second still get different ids).
pub(crate) fn unique_id(kind: &str) -> String {
    static PREFIX: OnceLock<u64> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let prefix = *PREFIX.get_or_init(|| {
        // std's hash keys are random per process; mix in the time and pid for good measure.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.write_u32(std::process::id());
        h.finish()
    });
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{kind}-{prefix:016x}{n:08x}")
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
