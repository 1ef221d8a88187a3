//! Rendezvous key-value store: how the ranks of a job meet.
//!
//! Rank 0 hosts a [`TcpStoreServer`] at `MASTER_ADDR:MASTER_PORT` and every rank (rank 0
//! included) talks to it through a [`TcpStore`]; the threads backend uses a [`MemStore`]
//! shared by its rank threads. Under PyTorch's `torchrun`, whose agent already hosts a
//! `TCPStore` there (`TORCHELASTIC_USE_AGENT_STORE=True`), every rank joins that one through a
//! [`TorchTcpStore`] instead (`connect_job_store` chooses). The store carries only small rendezvous data (segment names,
//! pids, ids), never tensors. Semantics follow PyTorch's `TCPStore`: `get` blocks until the key
//! is set, `add` is an atomic counter stored as a decimal string.
//!
//! Wire format: every frame is a little-endian `u32` length then the payload, at most
//! [`MAX_FRAME_BYTES`]. A connection starts with a handshake in which the client and the server
//! each prove that they hold the job token without sending it (`auth`: HMAC-SHA256 over both
//! sides' nonces); the server then answers accept or token-refused, and a client stops at a
//! server that cannot prove it. A bad client (wrong token, garbage, oversized length, silence)
//! only loses its own connection.
//!
//! Layout: [`Store`] and the helpers shared by the stores live here; `mem` holds the blocking
//! map and [`MemStore`], `wire` the framing and message encoding, `auth` the handshake's proofs, `server` the
//! [`TcpStoreServer`], `client` the [`TcpStore`], `torch` the [`TorchTcpStore`].

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::error::{CommError, CommResult};
use super::rendezvous::{torch_agent_store, Rendezvous};

mod auth;
mod client;
mod mem;
mod server;
#[cfg(test)]
mod tests;
mod torch;
#[cfg(test)]
mod torch_tests;
mod wire;

pub use client::{TcpStore, FAULT_WRONG_TOKEN_VAR};
pub use mem::MemStore;
pub use server::TcpStoreServer;
pub use torch::TorchTcpStore;
pub use wire::MAX_FRAME_BYTES;

/// What a process keeps alive for as long as its group lives (rank 0's store server).
pub(crate) type Keep = Vec<Box<dyn std::any::Any + Send + Sync>>;

/// Connects this rank to its job's rendezvous store: under torchrun with
/// `TORCHELASTIC_USE_AGENT_STORE=True`, the agent's PyTorch `TCPStore` at
/// `MASTER_ADDR:MASTER_PORT` (keys under a per-job, per-restart prefix); otherwise rank 0
/// hosts a [`TcpStoreServer`] there and every rank connects with the job token. Returns the
/// store and what must be kept alive with the group.
pub(crate) fn connect_job_store(
    rv: &Rendezvous,
    timeout: Duration,
) -> CommResult<(Box<dyn Store>, Keep)> {
    if let Some(prefix) = torch_agent_store()? {
        let store = TorchTcpStore::connect(&rv.master_addr, rv.master_port, &prefix, timeout)?;
        return Ok((Box::new(store), Vec::new()));
    }
    if rv.rank == 0 {
        let server = TcpStoreServer::bind(&rv.master_addr, rv.master_port, &rv.token)?;
        let client = TcpStore::connect(&rv.master_addr, server.port(), &rv.token, timeout)?;
        Ok((Box::new(client), vec![Box::new(server)]))
    } else {
        let client = TcpStore::connect(&rv.master_addr, rv.master_port, &rv.token, timeout)?;
        Ok((Box::new(client), Vec::new()))
    }
}

/// Cap on any wait, so that deadlines never overflow `Instant`.
const MAX_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);

/// A key-value store shared by the ranks of a job.
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing any previous value, and wakes waiters.
    fn set(&self, key: &str, value: &[u8]) -> CommResult<()>;
    /// Blocks until `key` exists, then returns its value; errors after `timeout` (message
    /// names the key, the store address and the time waited).
    fn get(&self, key: &str, timeout: Duration) -> CommResult<Vec<u8>>;
    /// Returns the value if present, without waiting.
    fn try_get(&self, key: &str) -> CommResult<Option<Vec<u8>>>;
    /// Atomically adds `delta` to the integer counter at `key` (absent = 0) and returns the
    /// new value. The counter is stored as a decimal string (readable with `get`).
    fn add(&self, key: &str, delta: i64) -> CommResult<i64>;
    /// Removes `key`; returns whether it existed.
    fn delete(&self, key: &str) -> CommResult<bool>;
    /// Human-readable address for error messages ("127.0.0.1:29500" or "in-process").
    fn describe(&self) -> String;
}

fn store_err(addr: &str, detail: impl Into<String>) -> CommError {
    CommError::Store {
        addr: addr.to_owned(),
        detail: detail.into(),
    }
}

fn get_timeout_err(addr: &str, key: &str, waited: Duration) -> CommError {
    store_err(
        addr,
        format!(
            "timed out after {:.1} s waiting for key '{key}' (the rank that should set it has not: \
             is it alive and part of the same job?)",
            waited.as_secs_f64()
        ),
    )
}

/// `host:port`, with brackets around IPv6 literals.
fn host_port(addr: &str, port: u16) -> String {
    if addr.contains(':') && !addr.starts_with('[') {
        format!("[{addr}]:{port}")
    } else {
        format!("{addr}:{port}")
    }
}

/// Locks `m`, ignoring poisoning: the guarded state stays consistent across a panic.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Waits on `cv` until notified or `deadline` (already in the future), ignoring poisoning.
fn wait_until<'a, T>(
    cv: &Condvar,
    guard: MutexGuard<'a, T>,
    deadline: Instant,
) -> MutexGuard<'a, T> {
    let left = deadline.saturating_duration_since(Instant::now());
    match cv.wait_timeout(guard, left) {
        Ok((g, _)) => g,
        Err(p) => p.into_inner().0,
    }
}
