//! One served connection of rank 0's HTTP side (see `limits.rs`): [`LimitedStream`], the TCP
//! stream that closes itself past `--header-timeout` and `--send-timeout`, and [`Conn`], the
//! handle its requests share to tell whether one is being handled.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Sleep;

use crate::serve::metrics::{Limit, Rejections};

/// A duration as the messages write it: `30 s`, `1.5 s`.
pub fn seconds(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

/// What a connection and the requests on it share: whether a request is being handled, and
/// since when the connection has waited for its next request (see [`LimitedStream`]).
#[derive(Debug)]
struct ConnState {
    opened: Instant,
    /// Requests being handled (a handler running, or a streamed answer being sent).
    busy: AtomicUsize,
    /// Microseconds from `opened` to the last activity: a request handled, bytes written.
    active_us: AtomicU64,
}

/// The handle of one served connection (axum's connect info: the `track` middleware finds
/// it in each request's extensions).
#[derive(Debug, Clone)]
pub struct Conn(Arc<ConnState>);

impl Conn {
    fn new() -> Self {
        Self(Arc::new(ConnState {
            opened: Instant::now(),
            busy: AtomicUsize::new(0),
            active_us: AtomicU64::new(0),
        }))
    }

    fn touch(&self) {
        let us = u64::try_from(self.0.opened.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.0.active_us.fetch_max(us, Ordering::Relaxed);
    }

    /// When the connection began waiting for a request, if it is waiting.
    fn waiting_since(&self) -> Option<Instant> {
        (self.0.busy.load(Ordering::SeqCst) == 0).then(|| {
            self.0.opened + Duration::from_micros(self.0.active_us.load(Ordering::Relaxed))
        })
    }

    pub(super) fn begin(&self) -> Busy {
        self.0.busy.fetch_add(1, Ordering::SeqCst);
        Busy(self.clone())
    }
}

/// A request being handled on a connection; dropped at the end of its answer.
pub(super) struct Busy(Conn);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.touch();
        self.0 .0.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One served connection: a TCP stream holding its place among `--max-connections`, closed
/// (an error to hyper, which drops the connection, its handler and its answer) when
///
/// - no request is being handled and the next request's headers have not arrived within
///   `--header-timeout` of the connection's last activity (its opening, the end of its last
///   answer, its last write): an idle keep-alive connection, or a client sending its
///   headers byte by byte;
/// - the client has read nothing of its answer for `--send-timeout`: bytes wait for it in
///   the socket and its TCP stack has acknowledged none of them for that long (it stopped
///   reading and its receive window is full), or a write has waited that long for room in the
///   send buffer. The send buffer grows to megabytes (4 MiB here), which a stream of tokens
///   would not fill before its end: the acknowledgements tell at once.
#[derive(Debug)]
pub struct LimitedStream {
    io: TcpStream,
    conn: Conn,
    /// `--header-timeout` and `--send-timeout`.
    header_timeout: Duration,
    send_timeout: Duration,
    idle: Pin<Box<Sleep>>,
    stalled: Option<Pin<Box<Sleep>>>,
    acks: AckWatch,
    rejected: Arc<Rejections>,
    _place: OwnedSemaphorePermit,
}

/// The client's acknowledgements, checked at most every [`ACK_CHECK_EVERY`] as answers are
/// written.
#[derive(Debug, Clone, Copy)]
struct AckWatch {
    /// Bytes the client had acknowledged at `since`.
    acked: u64,
    /// The last time the client acknowledged something, or had nothing waiting.
    since: Instant,
    /// The last check.
    checked: Instant,
}

/// How often a connection's acknowledgements are checked (as its answer is written).
const ACK_CHECK_EVERY: Duration = Duration::from_millis(250);

/// The bytes `stream`'s peer has acknowledged, and whether bytes wait for it (sent and not
/// acknowledged, or not sent yet), from the kernel's `TCP_INFO`.
#[cfg(target_os = "linux")]
fn tcp_progress(stream: &TcpStream) -> Option<(u64, bool)> {
    use std::os::fd::AsRawFd;
    // SAFETY: tcp_info is plain data; all zeros is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `info`, which is that large.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    // Kernels before 4.6 fill less than this.
    let needed = std::mem::offset_of!(libc::tcp_info, tcpi_notsent_bytes) + 4;
    (rc == 0 && len as usize >= needed).then_some((
        info.tcpi_bytes_acked,
        info.tcpi_notsent_bytes > 0 || info.tcpi_unacked > 0,
    ))
}

#[cfg(not(target_os = "linux"))]
fn tcp_progress(_stream: &TcpStream) -> Option<(u64, bool)> {
    None
}

impl LimitedStream {
    /// This connection's handle (axum's connect info).
    pub(super) fn conn(&self) -> &Conn {
        &self.conn
    }

    /// `io` holding `place` among `--max-connections`, closed past `(header_timeout,
    /// send_timeout)` as the type says, counting what it closes in `rejected`.
    pub(super) fn new(
        io: TcpStream,
        place: OwnedSemaphorePermit,
        (header_timeout, send_timeout): (Duration, Duration),
        rejected: Arc<Rejections>,
    ) -> Self {
        Self {
            io,
            conn: Conn::new(),
            header_timeout,
            send_timeout,
            idle: Box::pin(tokio::time::sleep(header_timeout)),
            stalled: None,
            acks: AckWatch {
                acked: 0,
                since: Instant::now(),
                checked: Instant::now(),
            },
            rejected,
            _place: place,
        }
    }

    /// Whether bytes have waited for the client for `--send-timeout` with none of them
    /// acknowledged (checked at most every [`ACK_CHECK_EVERY`]).
    fn unread_too_long(&mut self) -> bool {
        let now = Instant::now();
        if now.duration_since(self.acks.checked) < ACK_CHECK_EVERY {
            return false;
        }
        self.acks.checked = now;
        let Some((acked, waiting)) = tcp_progress(&self.io) else {
            return false;
        };
        if !waiting || acked != self.acks.acked {
            self.acks.acked = acked;
            self.acks.since = now;
            return false;
        }
        now.duration_since(self.acks.since) >= self.send_timeout
    }

    /// The error that closes the connection of a client that stopped reading (counted).
    fn unread(&self) -> io::Error {
        self.rejected.count(Limit::SendTimeout);
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the client read nothing of its answer for {} (--send-timeout)",
                seconds(self.send_timeout)
            ),
        )
    }

    /// A write's (or flush's) outcome: a write that cannot proceed starts (or continues) the
    /// `--send-timeout` wait, one that can ends it; bytes written mark the connection active
    /// (a flush does not: hyper flushes an idle connection too).
    fn written<T>(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<io::Result<T>>,
        wrote: impl Fn(&T) -> bool,
    ) -> Poll<io::Result<T>> {
        if let Poll::Ready(result) = &r {
            self.stalled = None;
            if result.as_ref().is_ok_and(wrote) {
                self.conn.touch();
            }
            return r;
        }
        let limit = self.send_timeout;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if timer.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(self.unread()));
        }
        Poll::Pending
    }
}

/// The error that closes a connection whose request headers did not come in time (counted).
fn no_request(limit: Duration, rejected: &Rejections) -> io::Error {
    rejected.count(Limit::HeaderTimeout);
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!(
            "no complete request headers within {} (--header-timeout)",
            seconds(limit)
        ),
    )
}

impl AsyncRead for LimitedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let limit = this.header_timeout;
        let deadline = this.conn.waiting_since().map(|t| t + limit);
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Poll::Ready(Err(no_request(limit, &this.rejected)));
        }
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if let (Poll::Pending, Some(d)) = (&r, deadline) {
            let d = tokio::time::Instant::from_std(d);
            if this.idle.deadline() != d {
                this.idle.as_mut().reset(d);
            }
            if this.idle.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Err(no_request(limit, &this.rejected)));
            }
        }
        r
    }
}

impl AsyncWrite for LimitedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.unread_too_long() {
            return Poll::Ready(Err(self.unread()));
        }
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.written(cx, r, |&n| n > 0)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.unread_too_long() {
            return Poll::Ready(Err(self.unread()));
        }
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.written(cx, r, |&n| n > 0)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_flush(cx);
        self.written(cx, r, |_| false)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
