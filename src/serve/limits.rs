//! What bounds rank 0's HTTP side (issue 44, defects 12 and 15): connections, the time a
//! client has to send its request, the time an answer may stay unread, and the text work
//! (tokenizing, chat templates, grammars, large answers) that runs off the async thread.
//!
//! - [`serve`] runs a router behind a [`LimitedListener`]: at most `--max-connections`
//!   connections are served at once; one more is answered a 503 `too_many_connections` in
//!   OpenAI's error shape and closed. Each served connection is a [`LimitedStream`], which
//!   closes it when a request's headers do not arrive within `--header-timeout` of its
//!   opening or of its last answer (an idle keep-alive connection, a slowloris client), and
//!   when the client has read nothing of its answer for `--send-timeout` (its TCP window is
//!   full): the handler and its answer are dropped, and with them a streamed request's
//!   sequence, whose decode slot the scheduler frees at its next step.
//! - [`read_body`] gives a request's body `--body-timeout` to arrive, else 408.
//! - [`TextJobs`] holds the work that runs on tokio's blocking threads to `--max-tokenize-jobs`
//!   jobs at once; a request waits for one at most `--tokenize-wait`, then gets a 503
//!   `tokenizer_busy`.
//!
//! Each refusal and each closed connection is counted in the [`Rejections`] that [`serve`] is
//! given (`candle_tp:requests_rejected_total{reason}` and
//! `candle_tp:connections_closed_total{reason}` in `/metrics`): the listener counts the
//! connections past the limit, a connection its own closing, and a middleware every answer
//! whose error code is a [`Limit`]'s (a 408 of [`read_body`], a 503 of [`TextJobs`] or of
//! the queue).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::connect_info::Connected;
use axum::extract::{ConnectInfo, Request};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::Response;
use axum::serve::{IncomingStream, Listener};
use axum::Router;
use futures_util::{Stream, StreamExt};
use tokio::io::AsyncWrite;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::serve::connection::Busy;
pub use crate::serve::connection::{seconds, Conn, LimitedStream};
use crate::serve::error::ApiError;
use crate::serve::metrics::{Limit, Rejections};
use crate::serve::reply::ErrorCode;

/// `--max-connections`'s default: connections served at once (below the usual 1024 open
/// files of a process).
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;
/// `--header-timeout`'s default (hyper's own header timeout).
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// `--body-timeout`'s default: 2 MiB in 30 s is 70 kB/s.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// `--send-timeout`'s default.
pub const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// `--tokenize-wait`'s default.
pub const DEFAULT_TOKENIZE_WAIT: Duration = Duration::from_secs(30);
/// `--sse-keep-alive`'s default (axum's, and what proxies with a 60 s idle timeout need).
pub const DEFAULT_SSE_KEEP_ALIVE: Duration = Duration::from_secs(15);

/// `--max-tokenize-jobs`'s default: the machine's cores, at least 2.
pub fn default_tokenize_jobs() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().max(2))
}

/// The limits of one connection, for [`serve`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections served at once (`--max-connections`); one more is answered 503 and closed.
    pub max_connections: usize,
    /// The time a connection has to send a request's headers, from its opening or the end of
    /// its last answer (`--header-timeout`); then it is closed without an answer.
    pub header_timeout: Duration,
    /// How long an answer may wait for the client to read any of it (`--send-timeout`); then
    /// the connection is closed and its request dropped.
    pub send_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            send_timeout: DEFAULT_SEND_TIMEOUT,
        }
    }
}

/// The limits the handlers apply to each request (both servers' states hold one).
#[derive(Debug, Clone)]
pub struct RequestLimits {
    /// The time a request's body has to arrive once its headers have (`--body-timeout`);
    /// then 408 `request_timeout`.
    pub body_timeout: Duration,
    /// The text work off the async thread (`--max-tokenize-jobs`, `--tokenize-wait`).
    pub text_jobs: TextJobs,
    /// A comment line this often on a server-sent event stream with nothing else to send
    /// (`--sse-keep-alive`; `None`: never), so that a request queued behind others keeps its
    /// connection through proxies and clients with idle timeouts.
    pub sse_keep_alive: Option<Duration>,
}

impl Default for RequestLimits {
    fn default() -> Self {
        Self {
            body_timeout: DEFAULT_BODY_TIMEOUT,
            text_jobs: TextJobs::new(default_tokenize_jobs(), DEFAULT_TOKENIZE_WAIT),
            sse_keep_alive: Some(DEFAULT_SSE_KEEP_ALIVE),
        }
    }
}

/// The work that runs on tokio's blocking threads (rendering chat templates, tokenizing,
/// compiling grammars, building large answers), at most `jobs` at once: without a bound, a
/// burst of large prompts took up to tokio's 512 blocking threads. Cheap to clone.
#[derive(Debug, Clone)]
pub struct TextJobs {
    permits: Arc<Semaphore>,
    jobs: usize,
    wait: Duration,
}

impl TextJobs {
    /// At most `jobs` (at least 1) at once; a request waits for one at most `wait`.
    pub fn new(jobs: usize, wait: Duration) -> Self {
        let jobs = jobs.max(1);
        Self {
            permits: Arc::new(Semaphore::new(jobs)),
            jobs,
            wait,
        }
    }

    /// Runs `work` on a blocking thread once one of the `jobs` places is free, waiting at most
    /// `wait` for it: then a 503 `tokenizer_busy` naming both limits.
    pub async fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        let permit = tokio::time::timeout(self.wait, self.permits.clone().acquire_owned())
            .await
            .map_err(|_| {
                ApiError::new(
                    503,
                    "server_error",
                    Some("tokenizer_busy"),
                    format!(
                        "the server is busy: {} tokenizing jobs are running (--max-tokenize-jobs) and none ended within {} (--tokenize-wait); retry later",
                        self.jobs,
                        seconds(self.wait)
                    ),
                )
            })?
            .map_err(|_| closed())?;
        on_a_blocking_thread(permit, work).await
    }

    /// Runs `work` on a blocking thread once a place is free, however long that takes: for
    /// work whose request was already paid for (an answer generated, to be built).
    pub async fn run_waiting<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| closed())?;
        on_a_blocking_thread(permit, work).await
    }
}

fn closed() -> ApiError {
    ApiError::new(
        503,
        "server_error",
        Some("shutting_down"),
        "the server is shutting down",
    )
}

async fn on_a_blocking_thread<T: Send + 'static>(
    permit: OwnedSemaphorePermit,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(move || {
        // Held until the work ends, also when the request that asked for it is gone.
        let _permit = permit;
        work()
    })
    .await
    .map_err(|e| ApiError::new(500, "server_error", None, format!("text work failed: {e}")))
}

/// The request body, at most `limit` bytes of it, within `timeout`: a larger one (by its
/// `Content-Length`, or as read) is a 400 `request_too_large` naming the limit and the size;
/// one that has not all arrived `timeout` after the handler began reading it (a client that
/// sends it byte by byte) is a 408 `request_timeout` naming the deadline, and the connection
/// is closed (the rest of the body is never read).
pub async fn read_body(
    limit: usize,
    timeout: Duration,
    headers: &HeaderMap,
    body: Body,
) -> Result<Bytes, ApiError> {
    let too_large = |size: String| {
        ApiError::new(
            400,
            "invalid_request_error",
            Some("request_too_large"),
            format!("the request body has {size} bytes; this server reads at most {limit} (--max-body-bytes)"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(n) = declared.filter(|&n| n > limit as u64) {
        return Err(too_large(n.to_string()));
    }
    let deadline = tokio::time::Instant::now() + timeout;
    let mut stream = body.into_data_stream();
    let mut out = Vec::new();
    loop {
        let Ok(next) = tokio::time::timeout_at(deadline, stream.next()).await else {
            let of = declared.map_or(String::new(), |n| format!(" of {n}"));
            return Err(ApiError::new(
                408,
                "invalid_request_error",
                Some("request_timeout"),
                format!(
                    "request body not received within {} (--body-timeout): {}{of} bytes arrived",
                    seconds(timeout),
                    out.len()
                ),
            ));
        };
        let Some(chunk) = next else { break };
        let chunk = chunk.map_err(|e| {
            ApiError::new(
                400,
                "invalid_request_error",
                None,
                format!("reading the body: {e}"),
            )
        })?;
        if out.len() + chunk.len() > limit {
            return Err(too_large(format!("more than {limit}")));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(out))
}

/// Serves `app` on `listener` within `limits` until `shutdown` completes (then as axum's
/// graceful shutdown: open connections end their answers), counting what the limits refuse
/// and close in `rejected`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    rejected: Arc<Rejections>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let app = app.layer(axum::middleware::from_fn_with_state(
        rejected.clone(),
        track,
    ));
    axum::serve(
        LimitedListener::new(listener, limits, rejected),
        app.into_make_service_with_connect_info::<Conn>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}

/// Connections answered 503 at once at most; more are closed without an answer.
const REFUSING_AT_ONCE: usize = 64;
/// How long a refused connection is given to send its request and to read the 503.
const REFUSAL_GRACE: Duration = Duration::from_secs(1);

/// A TCP listener that serves at most [`ConnLimits::max_connections`] connections at once.
/// Beyond, a connection gets a 503 `too_many_connections` (OpenAI's error shape, after its
/// request head is read, for at most 1 s) and is closed.
#[derive(Debug)]
pub struct LimitedListener {
    inner: TcpListener,
    limits: ConnLimits,
    open: Arc<Semaphore>,
    refusing: Arc<Semaphore>,
    rejected: Arc<Rejections>,
    /// Whether an accept error was reported (once: a full file table repeats it).
    reported: bool,
}

impl LimitedListener {
    /// `inner` within `limits`, counting refused and closed connections in `rejected`.
    pub fn new(inner: TcpListener, limits: ConnLimits, rejected: Arc<Rejections>) -> Self {
        Self {
            inner,
            limits,
            open: Arc::new(Semaphore::new(limits.max_connections.max(1))),
            refusing: Arc::new(Semaphore::new(REFUSING_AT_ONCE)),
            rejected,
            reported: false,
        }
    }
}

impl Listener for LimitedListener {
    type Io = LimitedStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (LimitedStream, SocketAddr) {
        loop {
            let (stream, addr) = match self.inner.accept().await {
                Ok(x) => x,
                Err(e) => {
                    use io::ErrorKind::*;
                    if !matches!(
                        e.kind(),
                        ConnectionRefused | ConnectionAborted | ConnectionReset
                    ) {
                        // Out of file descriptors, most likely: wait for some to close.
                        if !self.reported {
                            eprintln!("http: accepting a connection: {e} (retrying every second; lower --max-connections?)");
                            self.reported = true;
                        }
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            match self.open.clone().try_acquire_owned() {
                Ok(permit) => {
                    let stream = LimitedStream::new(
                        stream,
                        permit,
                        (self.limits.header_timeout, self.limits.send_timeout),
                        self.rejected.clone(),
                    );
                    return (stream, addr);
                }
                Err(_) => {
                    // Counted also when it is closed without an answer (more than
                    // `REFUSING_AT_ONCE` being refused).
                    self.rejected.count(Limit::TooManyConnections);
                    if let Ok(refusing) = self.refusing.clone().try_acquire_owned() {
                        let max = self.limits.max_connections;
                        tokio::spawn(async move {
                            let _refusing = refusing;
                            refuse(stream, max).await;
                        });
                    }
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// Answers a connection beyond `--max-connections` with a 503 and closes it: its request
/// head is read first (so that the client reads the answer rather than a reset), and what it
/// sends after the answer is drained for a moment.
async fn refuse(mut stream: TcpStream, max: usize) {
    let body = ApiError::new(
        503,
        "server_error",
        Some("too_many_connections"),
        format!(
            "the server has {max} connections open, its limit (--max-connections); retry later"
        ),
    )
    .body()
    .to_string();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(REFUSAL_GRACE, async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 << 10 {
            match read_some(&mut stream, &mut buf).await {
                Ok(n) if n > 0 => head.extend_from_slice(&buf[..n]),
                _ => break,
            }
        }
    })
    .await;
    let _ = tokio::time::timeout(REFUSAL_GRACE, async {
        write_all(&mut stream, answer.as_bytes()).await?;
        std::future::poll_fn(|cx| Pin::new(&mut stream).poll_shutdown(cx)).await
    })
    .await;
    let _ = tokio::time::timeout(REFUSAL_GRACE, async {
        while matches!(read_some(&mut stream, &mut buf).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// Reads what `stream` has (0 at its end).
async fn read_some(stream: &mut TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        stream.readable().await?;
        match stream.try_read(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            r => return r,
        }
    }
}

/// Writes all of `data` to `stream`.
async fn write_all(stream: &mut TcpStream, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        stream.writable().await?;
        match stream.try_write(data) {
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Connected<IncomingStream<'_, LimitedListener>> for Conn {
    fn connect_info(stream: IncomingStream<'_, LimitedListener>) -> Self {
        stream.io().conn().clone()
    }
}

/// Marks the connection busy while its request is handled and, for a streamed answer (no
/// length known: server-sent events), until the answer ends; an answer of known length is
/// written at once, and its writes count as activity.
///
/// Counts in `rejected` every answer that carries the error code of a [`Limit`].
async fn track(
    axum::extract::State(rejected): axum::extract::State<Arc<Rejections>>,
    req: Request,
    next: Next,
) -> Response {
    let count = |res: &Response| {
        if let Some(limit) = res
            .extensions()
            .get::<ErrorCode>()
            .and_then(|c| Limit::of_code(c.0))
        {
            rejected.count(limit);
        }
    };
    let Some(ConnectInfo(conn)) = req.extensions().get::<ConnectInfo<Conn>>().cloned() else {
        let res = next.run(req).await;
        count(&res);
        return res;
    };
    let busy = conn.begin();
    let res = next.run(req).await;
    count(&res);
    if res.body().size_hint().exact().is_some() {
        return res;
    }
    res.map(|body| {
        Body::from_stream(Tracked {
            inner: body.into_data_stream(),
            _busy: busy,
        })
    })
}

/// A streamed answer that keeps its connection busy until it ends (or is dropped).
struct Tracked {
    inner: axum::body::BodyDataStream,
    _busy: Busy,
}

impl Stream for Tracked {
    type Item = Result<Bytes, axum::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.inner).poll_next(cx)
    }
}
