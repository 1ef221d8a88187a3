//! Rendezvous key-value store: how the ranks of a job meet.
//!
//! Rank 0 hosts a [`TcpStoreServer`] at `MASTER_ADDR:MASTER_PORT` and every rank (rank 0
//! included) talks to it through a [`TcpStore`]; the threads backend uses a [`MemStore`]
//! shared by its rank threads. The store carries only small rendezvous data (segment names,
//! pids, ids), never tensors. Semantics follow PyTorch's `TCPStore`: `get` blocks until the key
//! is set, `add` is an atomic counter stored as a decimal string.
//!
//! Wire format: every frame is a little-endian `u32` length then the payload, at most
//! [`MAX_FRAME_BYTES`]. The first frame of a client is a hello carrying [`MAGIC`] and the job
//! token; the server answers accept, token-refused, or closes the connection. A bad client
//! (wrong token, garbage, oversized length, silence) only loses its own connection.

use std::collections::HashMap;
use std::io::{self, ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::error::{CommError, CommResult};

/// Bound on any frame (request or reply), in bytes; a longer length prefix closes the
/// connection without allocating it.
pub const MAX_FRAME_BYTES: usize = 16 << 20;
/// Protocol identifier sent in the hello frame.
const MAGIC: &[u8] = b"candle-tp-store/1";
/// Bound on the hello frame (magic + token).
const MAX_HELLO_BYTES: usize = 64 << 10;
/// Bound on the job token, checked by the client before it says hello.
const MAX_TOKEN_BYTES: usize = 4096;
/// How long the server waits for a new connection's hello.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on live connections of one server.
const MAX_CONNECTIONS: usize = 1024;
/// How long a server write may block on a client that does not read.
const SERVER_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the accept loop checks for shutdown.
const ACCEPT_POLL_MS: i32 = 50;
/// How long `Drop` of the server waits for its connection threads.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);
/// Client read timeout on `get` beyond the requested wait, so a dead server gives an error.
const CLIENT_MARGIN: Duration = Duration::from_secs(2);
/// Cap on any wait, so that deadlines never overflow `Instant`.
const MAX_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);
/// What [`MemStore::describe`] returns.
const IN_PROCESS: &str = "in-process";

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_TRY_GET: u8 = 3;
const OP_ADD: u8 = 4;
const OP_DELETE: u8 = 5;
const R_OK: u8 = 0;
const R_VALUE: u8 = 1;
const R_NOT_FOUND: u8 = 2;
const R_INT: u8 = 3;
const R_BOOL: u8 = 4;
const R_ERR: u8 = 5;
const HELLO_ACCEPT: u8 = 1;
const HELLO_BAD_TOKEN: u8 = 2;

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

/// The map behind both stores: entries plus a condition variable for blocking `get`.
#[derive(Default)]
struct Kv {
    state: Mutex<KvState>,
    changed: Condvar,
}

#[derive(Default)]
struct KvState {
    entries: HashMap<String, Vec<u8>>,
    /// Set when the server shuts down: blocked waiters return [`Wait::Closed`].
    closed: bool,
}

enum Wait {
    Found(Vec<u8>),
    Expired,
    Closed,
}

impl Kv {
    fn lock(&self) -> MutexGuard<'_, KvState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set(&self, key: &str, value: &[u8]) {
        self.lock().entries.insert(key.to_owned(), value.to_vec());
        self.changed.notify_all();
    }

    fn wait_get(&self, key: &str, timeout: Duration) -> Wait {
        let deadline = Instant::now() + timeout.min(MAX_WAIT);
        let mut st = self.lock();
        loop {
            if let Some(v) = st.entries.get(key) {
                return Wait::Found(v.clone());
            }
            if st.closed {
                return Wait::Closed;
            }
            let now = Instant::now();
            if now >= deadline {
                return Wait::Expired;
            }
            st = match self.changed.wait_timeout(st, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }

    fn try_get(&self, key: &str) -> Option<Vec<u8>> {
        self.lock().entries.get(key).cloned()
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, String> {
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

    fn delete(&self, key: &str) -> bool {
        self.lock().entries.remove(key).is_some()
    }

    fn close(&self) {
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

// ---------------------------------------------------------------------------------------------
// Framing and encoding

fn write_frame(w: &mut impl Write, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len())
        .map_err(|_| io::Error::new(ErrorKind::InvalidInput, "frame longer than u32"))?;
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(payload);
    w.write_all(&buf)?;
    w.flush()
}

/// Reads one frame; a length over `max` is an `InvalidData` error and nothing is allocated.
fn read_frame(r: &mut impl Read, max: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(
            ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {max} bytes"),
        ));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// Builds a payload: fixed-size little-endian integers and `u32`-length-prefixed byte strings.
struct Enc(Vec<u8>);

impl Enc {
    fn op(op: u8) -> Self {
        Enc(vec![op])
    }
    fn bytes(mut self, b: &[u8]) -> Self {
        // Lengths over u32 are caught by the frame size check before sending.
        self.0
            .extend_from_slice(&(b.len().min(u32::MAX as usize) as u32).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
}

/// Reads a payload built by [`Enc`]; every read is bounds-checked.
struct Dec<'a>(&'a [u8]);

fn malformed(what: &str) -> io::Error {
    io::Error::new(ErrorKind::InvalidData, format!("malformed frame: {what}"))
}

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(malformed("truncated"));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u64(&mut self) -> io::Result<u64> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
    fn bytes(&mut self) -> io::Result<&'a [u8]> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        self.take(u32::from_le_bytes(b) as usize)
    }
    fn key(&mut self) -> io::Result<&'a str> {
        std::str::from_utf8(self.bytes()?).map_err(|_| malformed("key is not UTF-8"))
    }
    fn end(&self) -> io::Result<()> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(malformed("trailing bytes"))
        }
    }
}

/// Compares tokens without an early exit on the first differing byte.
fn same_token(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

// ---------------------------------------------------------------------------------------------
// Server

/// The TCP server hosted by rank 0. Dropping it stops the accept thread and closes every
/// connection (blocked `get`s included) promptly.
pub struct TcpStoreServer {
    shared: Arc<Shared>,
    port: u16,
    accept: Option<JoinHandle<()>>,
}

struct Shared {
    kv: Kv,
    token: Vec<u8>,
    conns: Mutex<Conns>,
    conns_changed: Condvar,
}

#[derive(Default)]
struct Conns {
    /// A clone of each live connection's socket, so that shutdown can wake its thread.
    live: HashMap<u64, TcpStream>,
    next_id: u64,
    stopping: bool,
}

impl Shared {
    fn conns(&self) -> MutexGuard<'_, Conns> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `stream` and starts its thread, unless stopping or at the connection bound
    /// (then the stream is dropped, which closes it).
    fn admit(self: &Arc<Self>, stream: TcpStream) {
        let mut conns = self.conns();
        if conns.stopping || conns.live.len() >= MAX_CONNECTIONS {
            return;
        }
        let Ok(clone) = stream.try_clone() else {
            return;
        };
        let id = conns.next_id;
        conns.next_id += 1;
        conns.live.insert(id, clone);
        drop(conns);
        let shared = Arc::clone(self);
        let spawned = thread::Builder::new()
            .name("candle-tp-store-conn".into())
            .spawn(move || {
                // Any error only ends this connection.
                let _ = serve(&shared, stream);
                shared.forget(id);
            });
        if spawned.is_err() {
            self.forget(id);
        }
    }

    fn forget(&self, id: u64) {
        let removed = self.conns().live.remove(&id);
        if let Some(s) = removed {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        self.conns_changed.notify_all();
    }
}

/// Handshake, then answers requests until the client leaves, errs, or the server stops.
fn serve(shared: &Shared, mut stream: TcpStream) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(SERVER_WRITE_TIMEOUT))?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let hello = read_frame(&mut stream, MAX_HELLO_BYTES)?;
    let mut d = Dec(&hello);
    let (magic, token) = (d.bytes()?, d.bytes()?);
    d.end()?;
    if magic != MAGIC {
        return Err(malformed("bad magic"));
    }
    if !same_token(token, &shared.token) {
        return write_frame(&mut stream, &[HELLO_BAD_TOKEN]);
    }
    write_frame(&mut stream, &[HELLO_ACCEPT])?;
    // Ranks may stay idle for long between rendezvous steps; shutdown wakes this read.
    stream.set_read_timeout(None)?;
    loop {
        let req = match read_frame(&mut stream, MAX_FRAME_BYTES) {
            Ok(r) => r,
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        match answer(&shared.kv, &req)? {
            Some(reply) => write_frame(&mut stream, &reply)?,
            None => return Ok(()),
        }
    }
}

/// The reply to one request; `None` when the server is stopping (the connection closes).
fn answer(kv: &Kv, req: &[u8]) -> io::Result<Option<Vec<u8>>> {
    let mut d = Dec(req);
    let op = d.u8()?;
    let key = d.key()?;
    let reply = match op {
        OP_SET => {
            let value = d.bytes()?;
            d.end()?;
            kv.set(key, value);
            vec![R_OK]
        }
        OP_GET => {
            let wait = Duration::from_millis(d.u64()?);
            d.end()?;
            match kv.wait_get(key, wait) {
                Wait::Found(v) => Enc::op(R_VALUE).bytes(&v).0,
                Wait::Expired => vec![R_NOT_FOUND],
                Wait::Closed => return Ok(None),
            }
        }
        OP_TRY_GET => {
            d.end()?;
            match kv.try_get(key) {
                Some(v) => Enc::op(R_VALUE).bytes(&v).0,
                None => vec![R_NOT_FOUND],
            }
        }
        OP_ADD => {
            let delta = d.u64()? as i64;
            d.end()?;
            match kv.add(key, delta) {
                Ok(n) => Enc::op(R_INT).u64(n as u64).0,
                Err(e) => Enc::op(R_ERR).bytes(e.as_bytes()).0,
            }
        }
        OP_DELETE => {
            d.end()?;
            vec![R_BOOL, kv.delete(key) as u8]
        }
        _ => return Err(malformed("unknown operation")),
    };
    Ok(Some(reply))
}

/// Waits up to `ms` for the listener to have a pending connection.
fn wait_readable(listener: &TcpListener, ms: i32) -> bool {
    let mut pfd = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `pfd` is a valid pollfd for the duration of the call and nfds is 1.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    n > 0
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.conns().stopping {
        if !wait_readable(&listener, ACCEPT_POLL_MS) {
            continue;
        }
        match listener.accept() {
            Ok((stream, _)) => shared.admit(stream),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
            // E.g. out of file descriptors: back off and keep serving the live connections.
            Err(_) => thread::sleep(Duration::from_millis(ACCEPT_POLL_MS as u64)),
        }
    }
}

impl TcpStoreServer {
    /// Listens on `addr:port` (only that address; `0.0.0.0` for all interfaces) and serves
    /// clients that present `token`. Port 0 picks a free port (see [`TcpStoreServer::port`]).
    pub fn bind(addr: &str, port: u16, token: &str) -> CommResult<Self> {
        let desc = host_port(addr, port);
        let context = format!("binding the rendezvous store on {desc}");
        let listener = TcpListener::bind((addr, port)).map_err(|e| {
            if e.kind() == ErrorKind::AddrInUse {
                CommError::Io {
                    context: context.clone(),
                    source: format!(
                        "{desc} is already in use (another job or process listens there): \
                         pick another port with --master-port, or use --standalone to pick a free one"
                    ),
                }
            } else {
                CommError::io(context.clone(), e)
            }
        })?;
        let port = listener
            .local_addr()
            .map_err(|e| CommError::io(context.clone(), e))?
            .port();
        listener
            .set_nonblocking(true)
            .map_err(|e| CommError::io(context.clone(), e))?;
        let shared = Arc::new(Shared {
            kv: Kv::default(),
            token: token.as_bytes().to_vec(),
            conns: Mutex::new(Conns::default()),
            conns_changed: Condvar::new(),
        });
        let for_thread = Arc::clone(&shared);
        let accept = thread::Builder::new()
            .name("candle-tp-store-accept".into())
            .spawn(move || accept_loop(listener, for_thread))
            .map_err(|e| CommError::io(format!("{context}: starting the accept thread"), e))?;
        Ok(Self {
            shared,
            port,
            accept: Some(accept),
        })
    }

    /// The port the server listens on (the chosen one when bound with port 0).
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shared.kv.close();
        {
            let mut conns = self.shared.conns();
            conns.stopping = true;
            for s in conns.live.values() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        // Connection threads end once their socket is shut down; wait for them, bounded.
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        let mut conns = self.shared.conns();
        while !conns.live.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            conns = match self
                .shared
                .conns_changed
                .wait_timeout(conns, deadline - now)
            {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Client

/// A client of a [`TcpStoreServer`]. One connection, used under a mutex; after an I/O failure
/// the connection is marked broken and every later call errors with the original reason.
pub struct TcpStore {
    addr: String,
    io_timeout: Duration,
    conn: Mutex<Conn>,
}

enum Conn {
    Ready(TcpStream),
    Broken(String),
}

fn io_reason(e: &io::Error, waited: Duration) -> String {
    match e.kind() {
        ErrorKind::UnexpectedEof
        | ErrorKind::ConnectionReset
        | ErrorKind::ConnectionAborted
        | ErrorKind::BrokenPipe => "the store closed the connection (did rank 0 exit?)".into(),
        ErrorKind::WouldBlock | ErrorKind::TimedOut => format!(
            "no reply within {:.1} s (is the store host alive?)",
            waited.as_secs_f64()
        ),
        _ => e.to_string(),
    }
}

fn connect_any(addr: &str, port: u16, within: Duration) -> io::Result<TcpStream> {
    let mut last = io::Error::new(ErrorKind::NotFound, "the address resolves to nothing");
    for sa in (addr, port).to_socket_addrs()? {
        match TcpStream::connect_timeout(&sa, within.max(Duration::from_millis(1))) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

impl TcpStore {
    /// Connects to the store at `addr:port` and presents `token`. Retries with a short backoff
    /// while nothing listens yet (rank 0 may not have started), until `timeout`. `timeout` also
    /// bounds every later reply (besides `get`, which waits its own timeout).
    pub fn connect(addr: &str, port: u16, token: &str, timeout: Duration) -> CommResult<Self> {
        let desc = host_port(addr, port);
        if token.len() > MAX_TOKEN_BYTES {
            return Err(CommError::invalid(
                format!("connecting to the rendezvous store at {desc}"),
                format!(
                    "job token of {} bytes exceeds {MAX_TOKEN_BYTES}",
                    token.len()
                ),
            ));
        }
        let timeout = timeout.min(MAX_WAIT);
        let start = Instant::now();
        let deadline = start + timeout;
        let mut backoff = Duration::from_millis(10);
        let mut stream = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let err = match connect_any(addr, port, left) {
                Ok(s) => break s,
                Err(e) => e,
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(store_err(
                    &desc,
                    format!(
                        "could not connect within {:.1} s: {err} (is rank 0 running and \
                         listening on this address?)",
                        start.elapsed().as_secs_f64()
                    ),
                ));
            }
            thread::sleep(backoff.min(left));
            backoff = (backoff * 2).min(Duration::from_millis(500));
        };
        let io_timeout = timeout.max(Duration::from_secs(1));
        let hello = Enc(Vec::new()).bytes(MAGIC).bytes(token.as_bytes()).0;
        let reply = stream
            .set_nodelay(true)
            .and_then(|_| stream.set_read_timeout(Some(io_timeout)))
            .and_then(|_| stream.set_write_timeout(Some(io_timeout)))
            .and_then(|_| write_frame(&mut stream, &hello))
            .and_then(|_| read_frame(&mut stream, 16))
            .map_err(|e| {
                store_err(
                    &desc,
                    format!(
                        "handshake failed: {} (not a candle-tp store at this address, another \
                         protocol version, or too many connections)",
                        io_reason(&e, io_timeout)
                    ),
                )
            })?;
        match reply.as_slice() {
            [HELLO_ACCEPT] => Ok(Self {
                addr: desc,
                io_timeout,
                conn: Mutex::new(Conn::Ready(stream)),
            }),
            [HELLO_BAD_TOKEN] => Err(store_err(
                &desc,
                "the store refused the job token (another job on this port? check \
                 MASTER_PORT, or use --standalone)",
            )),
            _ => Err(store_err(
                &desc,
                format!("unexpected handshake reply {reply:?} (not a candle-tp store?)"),
            )),
        }
    }

    /// Sends one request and returns the reply payload (status byte first).
    fn call(&self, op: &str, key: &str, req: Vec<u8>, wait: Duration) -> CommResult<Vec<u8>> {
        if req.len() > MAX_FRAME_BYTES {
            return Err(CommError::invalid(
                format!("store {op} of key '{key}' at {}", self.addr),
                format!(
                    "request of {} bytes exceeds the frame limit of {MAX_FRAME_BYTES} bytes",
                    req.len()
                ),
            ));
        }
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let stream = match &mut *conn {
            Conn::Ready(s) => s,
            Conn::Broken(why) => {
                return Err(store_err(
                    &self.addr,
                    format!(
                        "{op} of key '{key}': connection unusable after an earlier failure: {why}"
                    ),
                ))
            }
        };
        let start = Instant::now();
        let result = stream
            .set_read_timeout(Some(wait))
            .and_then(|_| write_frame(stream, &req))
            .and_then(|_| read_frame(stream, MAX_FRAME_BYTES));
        match result {
            Ok(reply) if !reply.is_empty() => Ok(reply),
            Ok(_) => Err(self.protocol(&mut conn, op, key)),
            Err(e) => {
                let why = io_reason(&e, start.elapsed());
                *conn = Conn::Broken(why.clone());
                Err(store_err(&self.addr, format!("{op} of key '{key}': {why}")))
            }
        }
    }

    /// Marks the connection broken after a reply it cannot understand.
    fn protocol(&self, conn: &mut Conn, op: &str, key: &str) -> CommError {
        let why = "malformed reply from the store (protocol mismatch?)".to_string();
        *conn = Conn::Broken(why.clone());
        store_err(&self.addr, format!("{op} of key '{key}': {why}"))
    }

    fn bad_reply(&self, op: &str, key: &str) -> CommError {
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        self.protocol(&mut conn, op, key)
    }

    fn value_or_missing(&self, op: &str, key: &str, reply: &[u8]) -> CommResult<Option<Vec<u8>>> {
        let mut d = Dec(reply);
        let parsed = match d.u8() {
            Ok(R_VALUE) => d.bytes().map(|v| Some(v.to_vec())),
            Ok(R_NOT_FOUND) => Ok(None),
            _ => Err(malformed("status")),
        };
        match parsed.and_then(|v| d.end().map(|_| v)) {
            Ok(v) => Ok(v),
            Err(_) => Err(self.bad_reply(op, key)),
        }
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> CommResult<()> {
        let req = Enc::op(OP_SET).bytes(key.as_bytes()).bytes(value).0;
        match self.call("set", key, req, self.io_timeout)?.as_slice() {
            [R_OK] => Ok(()),
            _ => Err(self.bad_reply("set", key)),
        }
    }

    fn get(&self, key: &str, timeout: Duration) -> CommResult<Vec<u8>> {
        let timeout = timeout.min(MAX_WAIT);
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let req = Enc::op(OP_GET).bytes(key.as_bytes()).u64(ms).0;
        let start = Instant::now();
        let reply = self.call("get", key, req, timeout + CLIENT_MARGIN)?;
        match self.value_or_missing("get", key, &reply)? {
            Some(v) => Ok(v),
            None => Err(get_timeout_err(&self.addr, key, start.elapsed())),
        }
    }

    fn try_get(&self, key: &str) -> CommResult<Option<Vec<u8>>> {
        let req = Enc::op(OP_TRY_GET).bytes(key.as_bytes()).0;
        let reply = self.call("try_get", key, req, self.io_timeout)?;
        self.value_or_missing("try_get", key, &reply)
    }

    fn add(&self, key: &str, delta: i64) -> CommResult<i64> {
        let req = Enc::op(OP_ADD).bytes(key.as_bytes()).u64(delta as u64).0;
        let reply = self.call("add", key, req, self.io_timeout)?;
        let mut d = Dec(&reply);
        match d.u8() {
            Ok(R_INT) => match (d.u64(), d.end()) {
                (Ok(n), Ok(())) => Ok(n as i64),
                _ => Err(self.bad_reply("add", key)),
            },
            Ok(R_ERR) => match d.bytes() {
                Ok(msg) => Err(store_err(&self.addr, String::from_utf8_lossy(msg))),
                Err(_) => Err(self.bad_reply("add", key)),
            },
            _ => Err(self.bad_reply("add", key)),
        }
    }

    fn delete(&self, key: &str) -> CommResult<bool> {
        let req = Enc::op(OP_DELETE).bytes(key.as_bytes()).0;
        match self.call("delete", key, req, self.io_timeout)?.as_slice() {
            [R_BOOL, b] if *b <= 1 => Ok(*b == 1),
            _ => Err(self.bad_reply("delete", key)),
        }
    }

    fn describe(&self) -> String {
        self.addr.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Shutdown;

    const TOKEN: &str = "job-1234";
    const T: Duration = Duration::from_secs(5);

    fn server() -> TcpStoreServer {
        TcpStoreServer::bind("127.0.0.1", 0, TOKEN).expect("bind on a free port")
    }

    fn client(srv: &TcpStoreServer) -> TcpStore {
        TcpStore::connect("127.0.0.1", srv.port(), TOKEN, T).expect("connect")
    }

    fn assert_send_sync<S: Send + Sync>() {}

    /// One body for both stores: every operation against a `HashMap` model.
    fn round_trip(s: &dyn Store) {
        let mut model: HashMap<&str, Vec<u8>> = HashMap::new();
        assert_eq!(s.try_get("a").unwrap(), None);
        for (k, v) in [
            ("a", &b"1"[..]),
            ("b", b""),
            ("a", b"second"),
            ("c/d", &[0, 255, 7]),
        ] {
            s.set(k, v).unwrap();
            model.insert(k, v.to_vec());
        }
        for (k, v) in &model {
            assert_eq!(&s.get(k, T).unwrap(), v, "get {k}");
            assert_eq!(s.try_get(k).unwrap().as_ref(), Some(v), "try_get {k}");
        }
        assert!(s.delete("a").unwrap());
        assert!(!s.delete("a").unwrap());
        assert_eq!(s.try_get("a").unwrap(), None);
        assert_eq!(s.add("n", 5).unwrap(), 5);
        assert_eq!(s.add("n", -7).unwrap(), -2);
        assert_eq!(s.get("n", T).unwrap(), b"-2");
        let err = s.add("c/d", 1).unwrap_err().to_string();
        assert!(
            err.contains("c/d") && err.contains("not a decimal integer"),
            "{err}"
        );
        s.set("big", &[1]).unwrap();
        assert_eq!(s.add("max", i64::MAX).unwrap(), i64::MAX);
        assert!(s
            .add("max", 1)
            .unwrap_err()
            .to_string()
            .contains("overflows"));
        let value: Vec<u8> = (0..100_000u32).map(|i| (i * 31) as u8).collect();
        s.set("large", &value).unwrap();
        assert_eq!(s.get("large", T).unwrap(), value);
    }

    #[test]
    fn round_trip_mem_and_tcp() {
        assert_send_sync::<MemStore>();
        assert_send_sync::<TcpStore>();
        assert_send_sync::<TcpStoreServer>();
        let mem = MemStore::new();
        round_trip(&mem);
        assert_eq!(mem.describe(), "in-process");
        let srv = server();
        let tcp = client(&srv);
        round_trip(&tcp);
        assert_eq!(tcp.describe(), format!("127.0.0.1:{}", srv.port()));
        // A second client sees what the first wrote.
        assert_eq!(client(&srv).get("b", T).unwrap(), b"");
    }

    fn get_blocks_until_set(reader: &dyn Store, writer: Arc<dyn Store>) {
        let start = Instant::now();
        let h = thread::spawn(move || {
            thread::sleep(Duration::from_millis(150));
            writer.set("late", b"here").unwrap();
        });
        assert_eq!(reader.get("late", T).unwrap(), b"here");
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(140), "{waited:?}");
        assert!(waited < Duration::from_secs(2), "{waited:?}");
        h.join().unwrap();
    }

    #[test]
    fn get_blocks_until_another_thread_sets() {
        let mem = MemStore::new();
        get_blocks_until_set(&mem, Arc::new(mem.clone()));
        let srv = server();
        get_blocks_until_set(&client(&srv), Arc::new(client(&srv)));
    }

    /// 8 threads x 100 increments: the final value is 800 and the returned values are exactly
    /// 1..=800 (each increment saw a distinct state).
    fn concurrent_add(stores: Vec<Arc<dyn Store>>) {
        let handles: Vec<_> = stores
            .into_iter()
            .map(|s| {
                thread::spawn(move || {
                    (0..100)
                        .map(|_| s.add("ctr", 1).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut seen: Vec<i64> = handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (1..=800).collect::<Vec<i64>>());
    }

    #[test]
    fn concurrent_add_is_atomic() {
        let mem = MemStore::new();
        concurrent_add(
            (0..8)
                .map(|_| Arc::new(mem.clone()) as Arc<dyn Store>)
                .collect(),
        );
        assert_eq!(mem.get("ctr", T).unwrap(), b"800");
        let srv = server();
        concurrent_add(
            (0..8)
                .map(|_| Arc::new(client(&srv)) as Arc<dyn Store>)
                .collect(),
        );
        // One client shared by threads (the mutex around the connection).
        let shared: Arc<dyn Store> = Arc::new(client(&srv));
        shared.delete("ctr").unwrap();
        concurrent_add((0..8).map(|_| Arc::clone(&shared)).collect());
    }

    #[test]
    fn get_timeout_names_key_address_and_time() {
        let srv = server();
        let stores: Vec<Box<dyn Store>> = vec![Box::new(MemStore::new()), Box::new(client(&srv))];
        for s in stores {
            let start = Instant::now();
            let err = s.get("never/set", Duration::from_millis(300)).unwrap_err();
            let waited = start.elapsed();
            assert!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(2));
            assert!(matches!(err, CommError::Store { .. }), "{err:?}");
            let text = err.to_string();
            for part in ["never/set", &s.describe(), "0.3 s"] {
                assert!(text.contains(part), "{text:?} lacks {part:?}");
            }
            // The connection is still usable after a timeout.
            s.set("k", b"v").unwrap();
        }
    }

    #[test]
    fn wrong_token_rejected_good_client_unaffected() {
        let srv = server();
        let good = client(&srv);
        good.set("x", b"1").unwrap();
        let err = TcpStore::connect("127.0.0.1", srv.port(), "other-job", T)
            .err()
            .expect("wrong token must be refused");
        let text = err.to_string();
        assert!(text.contains("refused the job token"), "{text}");
        assert!(
            text.contains(&format!("127.0.0.1:{}", srv.port())),
            "{text}"
        );
        assert_eq!(good.get("x", T).unwrap(), b"1");
    }

    /// Reads until EOF or error; true when the server closed the connection in time.
    fn closed_by_server(mut s: TcpStream, within: Duration) -> bool {
        s.set_read_timeout(Some(within)).unwrap();
        let mut buf = [0u8; 64];
        loop {
            match s.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) => return e.kind() == ErrorKind::ConnectionReset,
            }
        }
    }

    #[test]
    fn bad_clients_only_lose_their_own_connection() {
        let srv = server();
        let good = client(&srv);
        let addr = ("127.0.0.1", srv.port());
        let mut garbage = TcpStream::connect(addr).unwrap();
        garbage
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut huge = TcpStream::connect(addr).unwrap();
        huge.write_all(&u32::MAX.to_le_bytes()).unwrap();
        let mut bad_magic = TcpStream::connect(addr).unwrap();
        write_frame(
            &mut bad_magic,
            &Enc(Vec::new()).bytes(b"nope/9").bytes(TOKEN.as_bytes()).0,
        )
        .unwrap();
        let silent = TcpStream::connect(addr).unwrap();
        // An authenticated client sending an oversized request loses its connection only.
        let mut rude = TcpStream::connect(addr).unwrap();
        write_frame(
            &mut rude,
            &Enc(Vec::new()).bytes(MAGIC).bytes(TOKEN.as_bytes()).0,
        )
        .unwrap();
        assert_eq!(read_frame(&mut rude, 16).unwrap(), [HELLO_ACCEPT]);
        rude.write_all(&((MAX_FRAME_BYTES + 1) as u32).to_le_bytes())
            .unwrap();

        let start = Instant::now();
        good.set("k", b"v").unwrap();
        assert_eq!(good.get("k", T).unwrap(), b"v");
        assert_eq!(good.add("c", 2).unwrap(), 2);
        let fresh = client(&srv);
        assert_eq!(fresh.try_get("k").unwrap().unwrap(), b"v");
        let took = start.elapsed();
        assert!(
            took < Duration::from_secs(1),
            "good client slowed down: {took:?}"
        );

        for (name, s) in [
            ("garbage", garbage),
            ("oversized", huge),
            ("bad magic", bad_magic),
            ("oversized request", rude),
        ] {
            assert!(
                closed_by_server(s, Duration::from_secs(2)),
                "{name} connection not closed"
            );
        }
        silent.shutdown(Shutdown::Both).unwrap();
    }

    #[test]
    fn silent_client_is_dropped_after_handshake_timeout() {
        let srv = server();
        let silent = TcpStream::connect(("127.0.0.1", srv.port())).unwrap();
        let start = Instant::now();
        assert!(closed_by_server(
            silent,
            HANDSHAKE_TIMEOUT + Duration::from_secs(3)
        ));
        assert!(start.elapsed() >= HANDSHAKE_TIMEOUT - Duration::from_millis(100));
    }

    #[test]
    fn port_in_use_gives_clear_error() {
        let srv = server();
        let err = TcpStoreServer::bind("127.0.0.1", srv.port(), TOKEN)
            .err()
            .expect("port is taken");
        assert!(matches!(err, CommError::Io { .. }), "{err:?}");
        let text = err.to_string();
        for part in [
            &format!("127.0.0.1:{}", srv.port())[..],
            "already in use",
            "--master-port",
            "--standalone",
        ] {
            assert!(text.contains(part), "{text:?} lacks {part:?}");
        }
    }

    #[test]
    fn oversized_request_refused_client_side() {
        let srv = server();
        let c = client(&srv);
        let err = c.set("blob", &vec![0u8; MAX_FRAME_BYTES]).unwrap_err();
        assert!(matches!(err, CommError::InvalidArgument { .. }), "{err:?}");
        assert!(err.to_string().contains("blob"));
        c.set("after", b"ok").unwrap();
    }

    #[test]
    fn server_dropped_client_errors_promptly() {
        let srv = server();
        let port = srv.port();
        let c = Arc::new(client(&srv));
        let blocked = Arc::new(client(&srv));
        c.set("k", b"v").unwrap();
        let waiter = {
            let blocked = Arc::clone(&blocked);
            thread::spawn(move || {
                let start = Instant::now();
                (
                    blocked.get("never", Duration::from_secs(30)),
                    start.elapsed(),
                )
            })
        };
        thread::sleep(Duration::from_millis(100));
        let start = Instant::now();
        drop(srv);
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "drop took {:?}",
            start.elapsed()
        );
        let (res, waited) = waiter.join().unwrap();
        let err = res.unwrap_err();
        assert!(
            waited < Duration::from_secs(2),
            "blocked get hung for {waited:?}"
        );
        assert!(err.to_string().contains("closed the connection"), "{err}");
        let addr = format!("127.0.0.1:{port}");
        for r in [
            c.set("k", b"w").err(),
            c.try_get("k").err(),
            c.add("n", 1).err(),
            c.delete("k").err(),
        ] {
            let e = r.expect("call after server death must fail");
            assert!(
                matches!(e, CommError::Store { .. }) && e.to_string().contains(&addr),
                "{e}"
            );
        }
        assert!(start.elapsed() < T);
    }

    #[test]
    fn connect_retries_until_server_listens_then_times_out() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let h = thread::spawn(move || TcpStore::connect("127.0.0.1", port, TOKEN, T));
        thread::sleep(Duration::from_millis(200));
        let srv = TcpStoreServer::bind("127.0.0.1", port, TOKEN).unwrap();
        let c = h.join().unwrap().expect("connect after a late bind");
        c.set("k", b"v").unwrap();
        drop(c);
        drop(srv);
        let start = Instant::now();
        let err = TcpStore::connect("127.0.0.1", port, TOKEN, Duration::from_millis(300))
            .err()
            .unwrap();
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_millis(300) && waited < Duration::from_secs(2),
            "{waited:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains(&format!("127.0.0.1:{port}")) && text.contains("0.3 s"),
            "{text}"
        );
    }
}
