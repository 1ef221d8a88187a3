//! The blocking in-memory map behind both stores, and [`MemStore`] for the threads backend.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{get_timeout_err, lock, store_err, wait_until, Store, MAX_WAIT};
use crate::comm::error::CommResult;

/// What [`MemStore::describe`] returns.
const IN_PROCESS: &str = "in-process";

/// The map behind both stores: entries plus a condition variable for blocking `get`.
#[derive(Default)]
pub(super) struct Kv {
    state: Mutex<KvState>,
    changed: Condvar,
}

#[derive(Default)]
struct KvState {
    entries: HashMap<String, Vec<u8>>,
    /// Set when the server shuts down: blocked waiters return [`Wait::Closed`].
    closed: bool,
}

pub(super) enum Wait {
    Found(Vec<u8>),
    Expired,
    Closed,
}

impl Kv {
    fn lock(&self) -> MutexGuard<'_, KvState> {
        lock(&self.state)
    }

    pub(super) fn set(&self, key: &str, value: &[u8]) {
        self.lock().entries.insert(key.to_owned(), value.to_vec());
        self.changed.notify_all();
    }

    pub(super) fn wait_get(&self, key: &str, timeout: Duration) -> Wait {
        let deadline = Instant::now() + timeout.min(MAX_WAIT);
        let mut st = self.lock();
        loop {
            if let Some(v) = st.entries.get(key) {
                return Wait::Found(v.clone());
            }
            if st.closed {
                return Wait::Closed;
            }
            if Instant::now() >= deadline {
                return Wait::Expired;
            }
            st = wait_until(&self.changed, st, deadline);
        }
    }

    pub(super) fn try_get(&self, key: &str) -> Option<Vec<u8>> {
        self.lock().entries.get(key).cloned()
    }

    pub(super) fn add(&self, key: &str, delta: i64) -> Result<i64, String> {
        let mut st = self.lock();
        let current = match st.entries.get(key) {
            None => 0,
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
                .ok_or_else(|| {
                    format!(
                        "add on key '{key}': its value ({} bytes) is not a decimal integer",
                        v.len()
                    )
                })?,
        };
        let new = current
            .checked_add(delta)
            .ok_or_else(|| format!("add on key '{key}': {current} + {delta} overflows i64"))?;
        st.entries
            .insert(key.to_owned(), new.to_string().into_bytes());
        drop(st);
        self.changed.notify_all();
        Ok(new)
    }

    pub(super) fn delete(&self, key: &str) -> bool {
        self.lock().entries.remove(key).is_some()
    }

    pub(super) fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_all();
    }
}

/// In-process store for the threads backend: a `Mutex<HashMap>` and a `Condvar`. Clones share
/// the same map.
#[derive(Clone, Default)]
pub struct MemStore {
    kv: Arc<Kv>,
}

impl MemStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Store for MemStore {
    fn set(&self, key: &str, value: &[u8]) -> CommResult<()> {
        self.kv.set(key, value);
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> CommResult<Vec<u8>> {
        let start = Instant::now();
        match self.kv.wait_get(key, timeout) {
            Wait::Found(v) => Ok(v),
            Wait::Expired | Wait::Closed => Err(get_timeout_err(IN_PROCESS, key, start.elapsed())),
        }
    }

    fn try_get(&self, key: &str) -> CommResult<Option<Vec<u8>>> {
        Ok(self.kv.try_get(key))
    }

    fn add(&self, key: &str, delta: i64) -> CommResult<i64> {
        self.kv
            .add(key, delta)
            .map_err(|e| store_err(IN_PROCESS, e))
    }

    fn delete(&self, key: &str) -> CommResult<bool> {
        Ok(self.kv.delete(key))
    }

    fn describe(&self) -> String {
        IN_PROCESS.to_owned()
    }
}
