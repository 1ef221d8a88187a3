//! Driving `candle-tp-serve` under `tprun` from the tests: start a server (killed with its whole
//! job when dropped), find its ranks' processes, and talk HTTP/1.1 to it over TCP with nothing
//! but the standard library (so the client is not the server's own code).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

/// One server at a time per test binary (two cores; the /dev/shm checks must not see another
/// job of the same binary).
pub static SERIAL: Mutex<()> = Mutex::new(());

/// The converted SmolLM2-135M-Instruct directory (`scripts/fetch-models.sh`).
pub fn model_dir() -> PathBuf {
    super::smollm2_dir()
}

/// The key the tests that need one give `--api-key`.
pub const KEY: &str = "sk-test-7f3a";

/// `method path` with `body` (none when null) and the Bearer [`KEY`]: the status and the
/// answer as JSON (or as a JSON string when it is not JSON).
pub fn call_with_key(port: u16, method: &str, path: &str, body: &Value) -> (u16, Value) {
    let body = if body.is_null() {
        String::new()
    } else {
        body.to_string()
    };
    let auth = format!("Bearer {KEY}");
    let (status, text) = http_with(port, method, path, &body, &[("Authorization", &auth)]);
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, v)
}

/// [`call_with_key`] with POST.
pub fn post_with_key(port: u16, path: &str, body: &Value) -> (u16, Value) {
    call_with_key(port, "POST", path, body)
}

/// The `messages` of one user message.
pub fn chat(content: &str) -> Value {
    serde_json::json!([{"role": "user", "content": content}])
}

/// The binary that cargo built as `cargo_path`, or `$var` when that is set: worktrees that
/// share one `CARGO_TARGET_DIR` overwrite each other's `target/debug/<bin>`, and the variable
/// points a run at its own build (`target/debug/deps/<bin>-<hash>`).
fn binary(var: &str, cargo_path: &str) -> PathBuf {
    std::env::var_os(var).map_or_else(|| PathBuf::from(cargo_path), PathBuf::from)
}

/// A server under tprun; killed (the whole job) when dropped.
pub struct Server {
    /// The tprun process.
    pub child: Child,
    /// The port rank 0 listens on.
    pub port: u16,
}

impl Server {
    /// `nproc` ranks on SmolLM2 with `extra` server arguments.
    pub fn start(nproc: usize, extra: &[&str]) -> Self {
        Self::start_model(nproc, &model_dir(), extra)
    }

    /// `nproc` ranks on `model` (a directory or a `.gguf` file).
    pub fn start_model(nproc: usize, model: &Path, extra: &[&str]) -> Self {
        Self::start_with(nproc, model, extra, &[])
    }

    /// `nproc` ranks on SmolLM2 with `extra` arguments and `env` in the job's environment.
    pub fn start_env(nproc: usize, extra: &[&str], env: &[(&str, &str)]) -> Self {
        Self::start_with(nproc, &model_dir(), extra, env)
    }

    fn start_with(nproc: usize, model: &Path, extra: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = Command::new(binary("CANDLE_TP_TPRUN", env!("CARGO_BIN_EXE_tprun")))
            .envs(env.iter().copied())
            .args(["--standalone", "--grace-period", "3", "--nproc-per-node"])
            .arg(nproc.to_string())
            .arg(binary(
                "CANDLE_TP_SERVE",
                env!("CARGO_BIN_EXE_candle-tp-serve"),
            ))
            .arg("--model")
            .arg(model)
            .args(["--port", "0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start tprun");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(i) = line
                    .find("{\"listening\"")
                    .or_else(|| line.find("\"listening\""))
                {
                    let start = line[..i + 1].rfind('{').unwrap_or(i);
                    let _ = tx.send(line[start..].to_string());
                }
                eprintln!("{line}");
            }
        });
        let line = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("the server did not print its address within 120 s");
        let v: Value = serde_json::from_str(&line).expect("listening JSON");
        let url = v["listening"].as_str().expect("listening").to_string();
        let port = url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("port");
        Self { child, port }
    }

    /// The process id of each rank (tprun's children, by the `RANK` of their environment).
    pub fn rank_pids(&self) -> HashMap<usize, i32> {
        let parent = self.child.id() as i32;
        let mut out = HashMap::new();
        for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<i32>().ok())
            else {
                continue;
            };
            if parent_of(pid) != Some(parent) {
                continue;
            }
            let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
                continue;
            };
            let rank = env
                .split(|&b| b == 0)
                .filter_map(|kv| std::str::from_utf8(kv).ok())
                .find_map(|kv| kv.strip_prefix("RANK="))
                .and_then(|r| r.parse().ok());
            if let Some(rank) = rank {
                out.insert(rank, pid);
            }
        }
        out
    }
}

/// The parent of `pid` from /proc/PID/stat (fields after the command name, which is in
/// parentheses and may itself hold spaces).
pub fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Whether `pid` is still running (present and not a zombie awaiting its parent's wait).
pub fn is_running(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next());
    !matches!(state, None | Some("Z") | Some("X"))
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            // SAFETY: signalling our own child process.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(10) {
                if self.child.try_wait().ok().flatten().is_some() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One HTTP/1.1 exchange (`Connection: close`): status and body (chunked decoded).
pub fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    http_with(port, method, path, body, &[])
}

/// [`http`] with extra request headers.
pub fn http_with(
    port: u16,
    method: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read response");
    parse_response(&raw)
}

/// Status and body of a raw HTTP/1.1 response (chunked transfer decoded).
pub fn parse_response(raw: &[u8]) -> (u16, String) {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").expect("headers");
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    if !chunked {
        return (status, body.to_string());
    }
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&after[..n]);
        rest = &after[n + 2..];
    }
    (status, out)
}

/// A JSON POST: status and the JSON answer.
pub fn post(port: u16, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(port, "POST", path, &body.to_string());
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{status} {text}: {e}"));
    (status, v)
}

/// The `data:` payloads of an SSE body.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(String::from)
        .collect()
}

/// `GET /health`, which must answer 200.
pub fn health(port: u16) -> Value {
    let (status, text) = http(port, "GET", "/health", "");
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).expect("health JSON")
}

/// Waits until the server reports `n` active sequences (at most `within`).
pub fn wait_active(port: u16, n: u64, within: Duration) {
    let t0 = Instant::now();
    while health(port)["active"] != n {
        assert!(
            t0.elapsed() < within,
            "the server never had {n} active sequences within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs every named check (each may panic) and returns the names of those that failed, so that
/// one server serves several checks and a failure does not hide the ones after it.
pub fn failed_checks<'a>(checks: &[(&'a str, &dyn Fn())]) -> Vec<&'a str> {
    checks
        .iter()
        .filter(|(_, check)| std::panic::catch_unwind(std::panic::AssertUnwindSafe(check)).is_err())
        .map(|(name, _)| *name)
        .collect()
}

/// The loop of examples/generate.rs on one model, greedy: the prompt, then one token at a
/// time (the reference the in-process scheduler tests compare a request's ids with).
pub fn alone(model: &mut candle_tp::models::CausalLm, prompt: &[u32], max_new: usize) -> Vec<u32> {
    use candle_core::{Device, Tensor};
    use candle_tp::generate::{DistributedSampler, SamplingParams};
    model.clear_kv_cache();
    let mut sampler = DistributedSampler::new(SamplingParams::greedy());
    let x = Tensor::new(prompt, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let mut logits = model.forward(&x, 0).unwrap().squeeze(0).unwrap();
    let mut out = Vec::new();
    loop {
        let next = sampler.sample_stage(Some(&logits), model).unwrap();
        out.push(next);
        if out.len() == max_new {
            return out;
        }
        let x = Tensor::new(&[next], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let pos = prompt.len() + out.len() - 1;
        logits = model.forward(&x, pos).unwrap().squeeze(0).unwrap();
    }
}

/// Everything a request submitted to the scheduler got: its tokens and how it ended (an error
/// message or a finish).
pub fn collect(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<candle_tp::serve::Event>,
) -> (Vec<u32>, Result<candle_tp::generate::FinishReason, String>) {
    use candle_tp::serve::Event;
    let mut tokens = Vec::new();
    while let Some(e) = rx.blocking_recv() {
        match e {
            Event::Token { token, finish, .. } => {
                tokens.push(token);
                if let Some(f) = finish {
                    return (tokens, Ok(f));
                }
            }
            Event::Error(m) => return (tokens, Err(m)),
        }
    }
    (tokens, Err("the channel closed".into()))
}

/// A connection to `port` whose receive buffer is set to `bytes` before it connects (the
/// kernel doubles it and keeps it there: no autotuning), so that a client that stops reading
/// closes its TCP window after a few kilobytes.
pub fn connect_with_receive_buffer(port: u16, bytes: i32) -> TcpStream {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket calls on a descriptor this function owns until it hands it to
    // TcpStream (which closes it); the option and address are live locals of the sizes given.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let rc = libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&bytes as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        );
        assert_eq!(rc, 0, "SO_RCVBUF: {}", std::io::Error::last_os_error());
        let addr = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
            },
            sin_zero: [0; 8],
        };
        let rc = libc::connect(
            fd,
            (&addr as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        assert_eq!(rc, 0, "connect: {}", std::io::Error::last_os_error());
        TcpStream::from_raw_fd(fd)
    }
}

/// The sum of the samples of `metric` (every label) in the server's `/metrics`.
pub fn metric(port: u16, metric: &str) -> f64 {
    let (status, text) = http(port, "GET", "/metrics", "");
    assert_eq!(status, 200, "{text}");
    text.lines()
        .filter(|l| {
            l.strip_prefix(metric)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The sample of `metric` whose labels hold `label` (`reason="queue_full"`): 0 when there is
/// none (a counter not yet rendered by an older server is a failed comparison, not a panic).
pub fn labelled_metric(port: u16, metric: &str, label: &str) -> f64 {
    let (status, text) = http(port, "GET", "/metrics", "");
    assert_eq!(status, 200, "{text}");
    text.lines()
        .filter(|l| {
            l.strip_prefix(metric).is_some_and(|rest| {
                rest.starts_with('{') && rest.split('}').next().is_some_and(|ls| ls.contains(label))
            })
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// How often the server refused a request with error code `reason` (its
/// `candle_tp:requests_rejected_total`).
pub fn rejected(port: u16, reason: &str) -> f64 {
    labelled_metric(
        port,
        "candle_tp:requests_rejected_total",
        &format!("reason=\"{reason}\""),
    )
}

/// How often the server closed a connection for `reason` (`header_timeout`, `send_timeout`:
/// its `candle_tp:connections_closed_total`).
pub fn closed_for(port: u16, reason: &str) -> f64 {
    labelled_metric(
        port,
        "candle_tp:connections_closed_total",
        &format!("reason=\"{reason}\""),
    )
}

/// `bytes` (or a few more) of made-up seven-letter words, space-separated, from a fixed
/// generator: a prompt that the tokenizer's word cache cannot shortcut, so tokenizing it takes
/// time in proportion to its length on any host.
pub fn made_up_words(bytes: usize) -> String {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut prompt = String::with_capacity(bytes + 10);
    while prompt.len() < bytes {
        for _ in 0..7 {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            prompt.push((b'a' + ((state >> 33) % 26) as u8) as char);
        }
        prompt.push(' ');
    }
    prompt
}
