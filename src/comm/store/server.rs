//! [`TcpStoreServer`]: the rendezvous store server hosted by rank 0.

use std::collections::HashMap;
use std::io::{self, ErrorKind};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::auth::{self, Side, NONCE_BYTES};
use super::mem::{Kv, Wait};
use super::wire::{
    malformed, read_frame, write_frame, Dec, Enc, HELLO_ACCEPT, HELLO_BAD_TOKEN, MAGIC,
    MAX_FRAME_BYTES, MAX_HELLO_BYTES, OP_ADD, OP_DELETE, OP_GET, OP_SET, OP_TRY_GET, R_BOOL, R_ERR,
    R_INT, R_NOT_FOUND, R_OK, R_VALUE,
};
use super::{host_port, lock, wait_until};
use crate::comm::error::{CommError, CommResult};

/// How long the server waits for a new connection's hello.
pub(super) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on live connections of one server.
const MAX_CONNECTIONS: usize = 1024;
/// How long a server write may block on a client that does not read.
const SERVER_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the accept loop checks for shutdown.
const ACCEPT_POLL_MS: i32 = 50;
/// How long `Drop` of the server waits for its connection threads.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

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
        lock(&self.conns)
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
    // The handshake of `super::auth`: the client's nonce, this server's nonce and proof, the
    // client's proof.
    let hello = read_frame(&mut stream, MAX_HELLO_BYTES)?;
    let mut d = Dec(&hello);
    let (magic, cn) = (d.bytes()?, d.bytes()?);
    d.end()?;
    if magic != MAGIC {
        return Err(malformed("bad magic"));
    }
    if cn.len() != NONCE_BYTES {
        return Err(malformed("bad nonce"));
    }
    let sn = auth::nonce()?;
    let mine = auth::proof(&shared.token, Side::Server, cn, &sn);
    write_frame(&mut stream, &Enc(Vec::new()).bytes(&sn).bytes(&mine).0)?;
    let reply = read_frame(&mut stream, MAX_HELLO_BYTES)?;
    let mut d = Dec(&reply);
    let theirs = d.bytes()?;
    d.end()?;
    if !auth::verify(&shared.token, Side::Client, cn, &sn, theirs) {
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
                         pick another port (tprun/torchrun --master-port; under mpirun or srun \
                         set MASTER_PORT, e.g. mpirun -x MASTER_PORT=PORT), or use tprun \
                         --standalone to pick a free one"
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
        while !conns.live.is_empty() && Instant::now() < deadline {
            conns = wait_until(&self.shared.conns_changed, conns, deadline);
        }
    }
}
