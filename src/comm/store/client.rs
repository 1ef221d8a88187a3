//! [`TcpStore`]: a client of the rendezvous store server.

use std::io::{self, ErrorKind};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use super::auth::{self, Side, NONCE_BYTES};
use super::wire::{
    malformed, read_frame, write_frame, Dec, Enc, HELLO_ACCEPT, HELLO_BAD_TOKEN, MAGIC,
    MAX_FRAME_BYTES, MAX_HELLO_BYTES, MAX_TOKEN_BYTES, OP_ADD, OP_DELETE, OP_GET, OP_SET,
    OP_TRY_GET, R_BOOL, R_ERR, R_INT, R_NOT_FOUND, R_OK, R_VALUE,
};
use super::{get_timeout_err, host_port, lock, store_err, Store, MAX_WAIT};
use crate::comm::error::{CommError, CommResult};

/// Client read timeout on `get` beyond the requested wait, so a dead server gives an error.
const CLIENT_MARGIN: Duration = Duration::from_secs(2);

/// A client of a [`TcpStoreServer`](super::TcpStoreServer). One connection, used under a
/// mutex; after an I/O failure the connection is marked broken and every later call errors
/// with the original reason.
pub struct TcpStore {
    addr: String,
    io_timeout: Duration,
    conn: Mutex<Conn>,
}

/// A store connection, or why it can no longer be used.
pub(super) enum Conn {
    Ready(TcpStream),
    Broken(String),
}

impl Conn {
    /// The stream, or the error of an `op` on `key` at `addr` after an earlier failure.
    pub(super) fn stream(&mut self, addr: &str, op: &str, key: &str) -> CommResult<&mut TcpStream> {
        match self {
            Conn::Ready(s) => Ok(s),
            Conn::Broken(why) => Err(store_err(
                addr,
                format!("{op} of key '{key}': connection unusable after an earlier failure: {why}"),
            )),
        }
    }
}

/// Why an I/O operation on a store connection failed, in words.
pub(super) fn io_reason(e: &io::Error, waited: Duration) -> String {
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

/// Connects to the first address `addr:port` resolves to that accepts within `within`.
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

/// Connects to `addr:port` as [`connect_retrying`] does, within `timeout` (at most a year),
/// with Nagle's algorithm off and every read and write bounded by the I/O timeout it returns
/// (`timeout`, at least 1 s).
pub(super) fn open_stream(
    addr: &str,
    port: u16,
    timeout: Duration,
    hint: &str,
) -> CommResult<(TcpStream, Duration)> {
    let timeout = timeout.min(MAX_WAIT);
    let stream = connect_retrying(addr, port, timeout, hint)?;
    let io_timeout = timeout.max(Duration::from_secs(1));
    stream
        .set_nodelay(true)
        .and_then(|_| stream.set_read_timeout(Some(io_timeout)))
        .and_then(|_| stream.set_write_timeout(Some(io_timeout)))
        .map_err(|e| {
            store_err(
                &host_port(addr, port),
                format!("setting up the connection: {}", io_reason(&e, io_timeout)),
            )
        })?;
    Ok((stream, io_timeout))
}

/// Connects to `addr:port`, retrying with a short backoff while nothing listens yet (the
/// store's host may not have started), until `timeout`; `hint` ends the error message.
fn connect_retrying(addr: &str, port: u16, timeout: Duration, hint: &str) -> CommResult<TcpStream> {
    let start = Instant::now();
    let deadline = start + timeout;
    let mut backoff = Duration::from_millis(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let err = match connect_any(addr, port, left) {
            Ok(s) => return Ok(s),
            Err(e) => e,
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(store_err(
                &host_port(addr, port),
                format!(
                    "could not connect within {:.1} s: {err} ({hint})",
                    start.elapsed().as_secs_f64()
                ),
            ));
        }
        thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// Fault injection (`examples/chaos_worker.rs`, `scripts/chaos.sh --hosts`): when this
/// variable is set in a process, every [`TcpStore::connect`] of it presents a token that is
/// not the job's, as a rank with a wrong `CANDLE_TP_TOKEN` would. It can only make a join
/// fail.
pub const FAULT_WRONG_TOKEN_VAR: &str = "CANDLE_TP_FAULT_WRONG_TOKEN";

impl TcpStore {
    /// Connects to the store at `addr:port` and presents `token`. Retries with a short backoff
    /// while nothing listens yet (rank 0 may not have started), until `timeout`. `timeout` also
    /// bounds every later reply (besides `get`, which waits its own timeout).
    pub fn connect(addr: &str, port: u16, token: &str, timeout: Duration) -> CommResult<Self> {
        let desc = host_port(addr, port);
        let wrong;
        let token = if std::env::var_os(FAULT_WRONG_TOKEN_VAR).is_some() {
            wrong = format!("{token}-wrong");
            wrong.as_str()
        } else {
            token
        };
        if token.len() > MAX_TOKEN_BYTES {
            return Err(CommError::invalid(
                format!("connecting to the rendezvous store at {desc}"),
                format!(
                    "job token of {} bytes exceeds {MAX_TOKEN_BYTES}",
                    token.len()
                ),
            ));
        }
        let (mut stream, io_timeout) = open_stream(
            addr,
            port,
            timeout,
            "is rank 0 running and listening on this address?",
        )?;
        // The handshake of `super::auth`: this rank's nonce; the server's nonce and proof,
        // checked before anything that depends on the token leaves this process; this rank's
        // proof; the server's verdict.
        let refused = |why: &str| {
            store_err(
                &desc,
                format!(
                    "{why}: the store and this rank hold different job tokens (a wrong \
                     CANDLE_TP_TOKEN here, another job on this port: check MASTER_PORT, or use \
                     --standalone; or another program listening there)"
                ),
            )
        };
        let handshake_err = |e: std::io::Error| {
            store_err(
                &desc,
                format!(
                    "handshake failed: {} (not a candle-tp store at this address, another \
                     protocol version, or too many connections)",
                    io_reason(&e, io_timeout)
                ),
            )
        };
        let cn = auth::nonce().map_err(handshake_err)?;
        let hello = Enc(Vec::new()).bytes(MAGIC).bytes(&cn).0;
        let reply = write_frame(&mut stream, &hello)
            .and_then(|_| read_frame(&mut stream, MAX_HELLO_BYTES))
            .map_err(handshake_err)?;
        let mut d = Dec(&reply);
        let parsed = (|| -> std::io::Result<_> {
            let (sn, proof) = (d.bytes()?, d.bytes()?);
            d.end()?;
            Ok((sn.to_vec(), proof.to_vec()))
        })();
        let (sn, server_proof) = parsed.map_err(|_| {
            store_err(
                &desc,
                format!(
                    "unexpected handshake reply of {} bytes (not a candle-tp store?)",
                    reply.len()
                ),
            )
        })?;
        if sn.len() != NONCE_BYTES
            || !auth::verify(token.as_bytes(), Side::Server, &cn, &sn, &server_proof)
        {
            return Err(refused(
                "the store could not prove that it holds this rank's job token",
            ));
        }
        let mine = auth::proof(token.as_bytes(), Side::Client, &cn, &sn);
        let verdict = write_frame(&mut stream, &Enc(Vec::new()).bytes(&mine).0)
            .and_then(|_| read_frame(&mut stream, 16))
            .map_err(handshake_err)?;
        match verdict.as_slice() {
            [HELLO_ACCEPT] => Ok(Self {
                addr: desc,
                io_timeout,
                conn: Mutex::new(Conn::Ready(stream)),
            }),
            [HELLO_BAD_TOKEN] => Err(refused("the store refused this rank's proof")),
            _ => Err(store_err(
                &desc,
                format!("unexpected handshake reply {verdict:?} (not a candle-tp store?)"),
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
        let mut conn = lock(&self.conn);
        let stream = conn.stream(&self.addr, op, key)?;
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
        let mut conn = lock(&self.conn);
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
