//! PLACEHOLDER until the store branch lands (replaced at merge).
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::error::{CommError, CommResult};

/// A key-value store for rendezvous.
pub trait Store: Send + Sync {
    /// Sets a key.
    fn set(&self, key: &str, value: &[u8]) -> CommResult<()>;
    /// Blocks until the key exists.
    fn get(&self, key: &str, timeout: Duration) -> CommResult<Vec<u8>>;
    /// Non-blocking get.
    fn try_get(&self, key: &str) -> CommResult<Option<Vec<u8>>>;
    /// Atomic add.
    fn add(&self, key: &str, delta: i64) -> CommResult<i64>;
    /// Delete.
    fn delete(&self, key: &str) -> CommResult<bool>;
    /// Address for messages.
    fn describe(&self) -> String;
}

/// In-process store.
#[derive(Clone, Default)]
pub struct MemStore {
    inner: Arc<(Mutex<HashMap<String, Vec<u8>>>, Condvar)>,
}

impl MemStore {
    /// New empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Store for MemStore {
    fn set(&self, key: &str, value: &[u8]) -> CommResult<()> {
        self.inner
            .0
            .lock()
            .unwrap()
            .insert(key.into(), value.to_vec());
        self.inner.1.notify_all();
        Ok(())
    }
    fn get(&self, key: &str, timeout: Duration) -> CommResult<Vec<u8>> {
        let start = Instant::now();
        let mut g = self.inner.0.lock().unwrap();
        loop {
            if let Some(v) = g.get(key) {
                return Ok(v.clone());
            }
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(CommError::Store {
                    addr: "in-process".into(),
                    detail: format!("timed out waiting for key '{key}'"),
                });
            }
            g = self.inner.1.wait_timeout(g, left).unwrap().0;
        }
    }
    fn try_get(&self, key: &str) -> CommResult<Option<Vec<u8>>> {
        Ok(self.inner.0.lock().unwrap().get(key).cloned())
    }
    fn add(&self, key: &str, delta: i64) -> CommResult<i64> {
        let mut g = self.inner.0.lock().unwrap();
        let cur = g
            .get(key)
            .map(|v| i64::from_le_bytes(v[..8].try_into().unwrap()))
            .unwrap_or(0)
            + delta;
        g.insert(key.into(), cur.to_le_bytes().to_vec());
        self.inner.1.notify_all();
        Ok(cur)
    }
    fn delete(&self, key: &str) -> CommResult<bool> {
        Ok(self.inner.0.lock().unwrap().remove(key).is_some())
    }
    fn describe(&self) -> String {
        "in-process".into()
    }
}
