//! [`TorchTcpStore`]: a client of PyTorch's `TCPStore`, the store that `torchrun`'s agent
//! hosts at `MASTER_ADDR:MASTER_PORT` and announces to its workers with
//! `TORCHELASTIC_USE_AGENT_STORE=True`.
//!
//! The wire protocol is c10d's (`torch/csrc/distributed/c10d/TCPStore.cpp`, served by
//! `TCPStoreBackend.cpp` or `TCPStoreLibUvBackend.cpp`): no framing, native (little-endian)
//! integers, a request is a one-byte query type followed by its fields; strings and byte
//! values are a `u64` length then the bytes. The handshake is what torch's own client sends:
//! `VALIDATE` with the magic number `0x3C85F7CE` (no reply; a server that rejects it closes the
//! connection), then `PING` with a nonce that the server echoes. The queries used:
//!
//! | query | request | reply |
//! |---|---|---|
//! | `SET` (1) | key, value | none |
//! | `GET` (3) | key | value (only once the key exists: `WAIT` first) |
//! | `ADD` (4) | key, `i64` delta | `i64` new value (stored as a decimal string) |
//! | `CHECK` (5) | `u64` count, keys | `u8`: 0 ready, 1 not ready |
//! | `WAIT` (6) | `u64` count, keys | `u8` 0 (stop waiting) once all exist |
//! | `DELETE_KEY` (8) | key | `i64` number deleted |
//! | `CANCEL_WAIT` (12) | nothing | `u8` 1 (wait canceled), maybe after a late 0 |
//! | `PING` (13) | `u32` nonce | the nonce |
//!
//! Every key is put under a prefix (`candle-tp/<run id>/<restart count>/`), as torch's workers
//! put theirs under `/worker/attempt_<n>/`, so jobs and restarts sharing the agent's store do
//! not see each other's keys. The store has no job token: torchrun's store is as open as it is
//! for torch's own workers.

use std::io::{self, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::client::{io_reason, open_stream, Conn};
use super::{get_timeout_err, host_port, lock, store_err, Store, MAX_FRAME_BYTES, MAX_WAIT};
use crate::comm::error::{CommError, CommResult};

/// c10d's `validationMagicNumber`.
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

// c10d's `QueryType` values (an enum of `uint8_t`, in declaration order).
const Q_VALIDATE: u8 = 0;
const Q_SET: u8 = 1;
const Q_GET: u8 = 3;
const Q_ADD: u8 = 4;
const Q_CHECK: u8 = 5;
const Q_WAIT: u8 = 6;
const Q_DELETE_KEY: u8 = 8;
const Q_CANCEL_WAIT: u8 = 12;
const Q_PING: u8 = 13;

// c10d's `CheckResponseType` and `WaitResponseType`.
const CHECK_READY: u8 = 0;
const CHECK_NOT_READY: u8 = 1;
const WAIT_STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;

/// A client of PyTorch's `TCPStore` (torchrun's agent store), with every key under a prefix.
/// One connection, used under a mutex; after an I/O failure or a reply it cannot understand
/// the connection is marked broken and every later call errors with the original reason.
pub struct TorchTcpStore {
    addr: String,
    prefix: String,
    io_timeout: Duration,
    conn: Mutex<Conn>,
}

/// Builds one request: the query type, then its fields.
struct Request(Vec<u8>);

impl Request {
    fn new(query: u8) -> Self {
        Request(vec![query])
    }
    fn bytes(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(&(b.len() as u64).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
}

fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// Reads a length-prefixed value; a length over [`MAX_FRAME_BYTES`] is refused before any
/// allocation (a hostile or confused server cannot make us allocate its length).
fn read_value(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let len = read_u64(r)?;
    if len > MAX_FRAME_BYTES as u64 {
        return Err(io::Error::new(
            ErrorKind::InvalidData,
            format!("value of {len} bytes exceeds the limit of {MAX_FRAME_BYTES} bytes"),
        ));
    }
    let mut buf = vec![0u8; len as usize];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// What went wrong inside one exchange.
enum Failure {
    /// The socket failed (or timed out): the connection is unusable.
    Io(io::Error),
    /// The server answered something the protocol does not allow.
    Protocol(String),
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Self {
        if e.kind() == ErrorKind::InvalidData {
            Failure::Protocol(e.to_string())
        } else {
            Failure::Io(e)
        }
    }
}

impl TorchTcpStore {
    /// Connects to PyTorch's `TCPStore` at `addr:port`, retrying while nothing listens yet
    /// until `timeout`, and performs torch's handshake (`VALIDATE`, then a `PING` whose nonce
    /// must come back). Every key is put under `prefix`. `timeout` also bounds every later
    /// reply (besides `get`, which waits its own timeout).
    pub fn connect(addr: &str, port: u16, prefix: &str, timeout: Duration) -> CommResult<Self> {
        let desc = host_port(addr, port);
        let (mut stream, io_timeout) = open_stream(
            addr,
            port,
            timeout,
            "is torchrun's agent running? it hosts the store at MASTER_ADDR:MASTER_PORT",
        )?;
        let nonce = std::process::id();
        let hello = [
            Request::new(Q_VALIDATE).u32(VALIDATION_MAGIC).0,
            Request::new(Q_PING).u32(nonce).0,
        ]
        .concat();
        let mut echoed = [0u8; 4];
        stream
            .write_all(&hello)
            .and_then(|_| stream.read_exact(&mut echoed))
            .map_err(|e| {
                store_err(
                    &desc,
                    format!(
                        "PyTorch TCPStore handshake failed: {} (is this torchrun's store? \
                         TORCHELASTIC_USE_AGENT_STORE=True says it is)",
                        io_reason(&e, io_timeout)
                    ),
                )
            })?;
        if u32::from_le_bytes(echoed) != nonce {
            return Err(store_err(
                &desc,
                format!(
                    "PyTorch TCPStore handshake: ping nonce {nonce} came back as {} (not a \
                     TCPStore, or another protocol version)",
                    u32::from_le_bytes(echoed)
                ),
            ));
        }
        Ok(Self {
            addr: desc,
            prefix: prefix.to_owned(),
            io_timeout,
            conn: Mutex::new(Conn::Ready(stream)),
        })
    }

    /// The prefix every key is put under.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn full_key(&self, key: &str) -> Vec<u8> {
        format!("{}{key}", self.prefix).into_bytes()
    }

    /// Runs one exchange on the connection; any failure marks it broken.
    fn exchange<T>(
        &self,
        op: &str,
        key: &str,
        f: impl FnOnce(&mut TcpStream) -> Result<T, Failure>,
    ) -> CommResult<T> {
        let mut conn = lock(&self.conn);
        let stream = conn.stream(&self.addr, op, key)?;
        let start = Instant::now();
        match f(stream) {
            Ok(v) => Ok(v),
            Err(failure) => {
                let why = match failure {
                    Failure::Io(e) => io_reason(&e, start.elapsed()),
                    Failure::Protocol(what) => {
                        format!("unexpected reply from the PyTorch TCPStore: {what}")
                    }
                };
                *conn = Conn::Broken(why.clone());
                Err(store_err(&self.addr, format!("{op} of key '{key}': {why}")))
            }
        }
    }

    fn check_size(&self, op: &str, key: &str, len: usize) -> CommResult<()> {
        if len > MAX_FRAME_BYTES {
            return Err(CommError::invalid(
                format!("store {op} of key '{key}' at {}", self.addr),
                format!("request of {len} bytes exceeds the limit of {MAX_FRAME_BYTES} bytes"),
            ));
        }
        Ok(())
    }
}

/// Sends `WAIT` for `key` and waits up to `timeout` for the server's go; on expiry cancels the
/// wait as torch's client does (`CANCEL_WAIT`, then the server's `WAIT_CANCELED`, possibly
/// after a `STOP_WAITING` that crossed it). Returns whether the key exists.
fn wait_for(
    s: &mut TcpStream,
    key: &[u8],
    timeout: Duration,
    io_timeout: Duration,
) -> Result<bool, Failure> {
    s.set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
    s.write_all(&Request::new(Q_WAIT).u64(1).bytes(key).0)?;
    let first = read_u8(s);
    s.set_read_timeout(Some(io_timeout))?;
    match first {
        Ok(WAIT_STOP_WAITING) => return Ok(true),
        Ok(other) => return Err(Failure::Protocol(format!("wait answered {other}"))),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
        Err(e) => return Err(Failure::Io(e)),
    }
    s.write_all(&[Q_CANCEL_WAIT])?;
    match read_u8(s)? {
        WAIT_CANCELED => Ok(false),
        WAIT_STOP_WAITING => match read_u8(s)? {
            // The key arrived just as we gave up: the wait is over either way.
            WAIT_CANCELED => Ok(false),
            other => Err(Failure::Protocol(format!("cancel_wait answered {other}"))),
        },
        other => Err(Failure::Protocol(format!("cancel_wait answered {other}"))),
    }
}

impl Store for TorchTcpStore {
    fn set(&self, key: &str, value: &[u8]) -> CommResult<()> {
        let req = Request::new(Q_SET)
            .bytes(&self.full_key(key))
            .bytes(value)
            .0;
        self.check_size("set", key, req.len())?;
        // SET has no reply; the next query's reply orders it.
        self.exchange("set", key, |s| {
            s.set_read_timeout(Some(self.io_timeout))?;
            Ok(s.write_all(&req)?)
        })
    }

    fn get(&self, key: &str, timeout: Duration) -> CommResult<Vec<u8>> {
        let timeout = timeout.min(MAX_WAIT);
        let full = self.full_key(key);
        self.check_size("get", key, full.len() + 32)?;
        let start = Instant::now();
        let found = self.exchange("get", key, |s| {
            if !wait_for(s, &full, timeout, self.io_timeout)? {
                return Ok(None);
            }
            s.write_all(&Request::new(Q_GET).bytes(&full).0)?;
            Ok(Some(read_value(s)?))
        })?;
        found.ok_or_else(|| get_timeout_err(&self.addr, key, start.elapsed()))
    }

    fn try_get(&self, key: &str) -> CommResult<Option<Vec<u8>>> {
        let full = self.full_key(key);
        self.check_size("try_get", key, full.len() + 32)?;
        self.exchange("try_get", key, |s| {
            s.set_read_timeout(Some(self.io_timeout))?;
            s.write_all(&Request::new(Q_CHECK).u64(1).bytes(&full).0)?;
            match read_u8(s)? {
                CHECK_NOT_READY => Ok(None),
                CHECK_READY => {
                    s.write_all(&Request::new(Q_GET).bytes(&full).0)?;
                    Ok(Some(read_value(s)?))
                }
                other => Err(Failure::Protocol(format!("check answered {other}"))),
            }
        })
    }

    fn add(&self, key: &str, delta: i64) -> CommResult<i64> {
        let req = Request::new(Q_ADD)
            .bytes(&self.full_key(key))
            .u64(delta as u64)
            .0;
        self.check_size("add", key, req.len())?;
        self.exchange("add", key, |s| {
            s.set_read_timeout(Some(self.io_timeout))?;
            s.write_all(&req)?;
            Ok(read_u64(s)? as i64)
        })
    }

    fn delete(&self, key: &str) -> CommResult<bool> {
        let req = Request::new(Q_DELETE_KEY).bytes(&self.full_key(key)).0;
        self.check_size("delete", key, req.len())?;
        self.exchange("delete", key, |s| {
            s.set_read_timeout(Some(self.io_timeout))?;
            s.write_all(&req)?;
            match read_u64(s)? as i64 {
                0 => Ok(false),
                1 => Ok(true),
                n => Err(Failure::Protocol(format!("delete_key answered {n}"))),
            }
        })
    }

    fn describe(&self) -> String {
        format!(
            "{} (PyTorch TCPStore, keys under '{}')",
            self.addr, self.prefix
        )
    }
}
