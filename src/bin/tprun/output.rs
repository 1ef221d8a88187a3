//! Forwarding of the workers' output: one thread per stream copies it line by
//! line to tprun's console with a `[rank N] ` prefix, to an optional log file,
//! and (for stderr) into a [`Tail`] of the last lines.
//!
//! Each console line is written with one `write_all` while holding the lock of
//! tprun's stdout or stderr, so lines of different ranks never interleave.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;

/// Longest line kept whole; a longer one is forwarded in pieces of this size.
pub const MAX_LINE: u64 = 64 * 1024;

/// How many stderr lines of each rank are kept for the failure report.
pub const TAIL_LINES: usize = 20;

/// Which of a worker's output streams a pump forwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// The worker's stdout, forwarded to tprun's stdout.
    Stdout,
    /// The worker's stderr, forwarded to tprun's stderr.
    Stderr,
}

impl Stream {
    /// File-name extension of this stream's log file (`stdout` / `stderr`).
    pub fn name(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// The last lines of a stream, oldest first, bounded in count.
#[derive(Debug)]
pub struct Tail {
    lines: VecDeque<String>,
    capacity: usize,
}

impl Tail {
    /// An empty tail keeping at most `capacity` lines.
    pub fn new(capacity: usize) -> Tail {
        Tail {
            lines: VecDeque::with_capacity(capacity),
            capacity,
        }
    }

    /// Appends a line, dropping the oldest one when full.
    pub fn push(&mut self, line: String) {
        if self.capacity == 0 {
            return;
        }
        if self.lines.len() == self.capacity {
            self.lines.pop_front();
        }
        self.lines.push_back(line);
    }

    /// The kept lines, oldest first.
    pub fn lines(&self) -> Vec<String> {
        self.lines.iter().cloned().collect()
    }
}

/// A tail shared between a pump thread and the supervisor.
pub type SharedTail = Arc<Mutex<Tail>>;

/// Reads the lines kept in a shared tail (even if a pump panicked holding it).
pub fn tail_lines(tail: &SharedTail) -> Vec<String> {
    tail.lock().unwrap_or_else(PoisonError::into_inner).lines()
}

/// Where one worker stream goes.
#[derive(Debug)]
pub struct Pump {
    /// Global rank used in the `[rank N] ` prefix.
    pub rank: usize,
    /// Which stream this is.
    pub stream: Stream,
    /// Whether lines reach tprun's console (`--local-ranks-filter`).
    pub console: bool,
    /// Log file receiving the raw bytes, if `--log-dir` was given.
    pub log: Option<File>,
    /// Tail receiving every line, if kept.
    pub tail: Option<SharedTail>,
}

impl Pump {
    /// Starts a thread copying `reader` until end of file; it sends `()` on
    /// `done` when it finishes.
    pub fn spawn<R: Read + Send + 'static>(
        self,
        reader: R,
        done: Sender<()>,
    ) -> io::Result<thread::JoinHandle<()>> {
        let name = format!("tprun-rank{}-{}", self.rank, self.stream.name());
        thread::Builder::new().name(name).spawn(move || {
            self.run(reader);
            let _ = done.send(());
        })
    }

    /// Copies `reader` line by line until end of file or a read error.
    fn run<R: Read>(mut self, reader: R) {
        let prefix = format!("[rank {}] ", self.rank);
        let mut reader = BufReader::with_capacity(MAX_LINE as usize, reader);
        let mut line = Vec::new();
        let mut out = Vec::new();
        loop {
            line.clear();
            match (&mut reader).take(MAX_LINE).read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            self.log_bytes(&line);
            let text = String::from_utf8_lossy(trim_newline(&line));
            if self.console {
                out.clear();
                out.extend_from_slice(prefix.as_bytes());
                out.extend_from_slice(text.as_bytes());
                out.push(b'\n');
                // A closed console (e.g. `tprun ... | head`) is not an error of the
                // job: keep draining the pipe so the worker never blocks on it.
                let _ = match self.stream {
                    Stream::Stdout => io::stdout().lock().write_all(&out),
                    Stream::Stderr => io::stderr().lock().write_all(&out),
                };
            }
            if let Some(tail) = &self.tail {
                tail.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(text.into_owned());
            }
        }
        if let Some(log) = &mut self.log {
            let _ = log.flush();
        }
    }

    /// Appends raw bytes to the log file; on the first error, warns once and stops logging.
    fn log_bytes(&mut self, bytes: &[u8]) {
        if let Some(log) = &mut self.log {
            if let Err(e) = log.write_all(bytes) {
                let _ = writeln!(
                    io::stderr().lock(),
                    "tprun: warning: cannot write the {} log of rank {}: {e}; logging of it stops",
                    self.stream.name(),
                    self.rank
                );
                self.log = None;
            }
        }
    }
}

/// `line` without its trailing `\n` or `\r\n`.
fn trim_newline(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// Writes a message of tprun's own to its stderr, in one piece, ignoring errors
/// (a closed stderr must not turn into a panic). Used through the `say!` macro.
pub fn say(message: std::fmt::Arguments) {
    let _ = io::stderr().lock().write_fmt(message);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_lines_in_order() {
        let mut tail = Tail::new(3);
        for i in 0..5 {
            tail.push(i.to_string());
        }
        assert_eq!(tail.lines(), ["2", "3", "4"]);
        let mut none = Tail::new(0);
        none.push("x".to_string());
        assert!(none.lines().is_empty());
    }

    #[test]
    fn newline_and_crlf_are_trimmed_once() {
        assert_eq!(trim_newline(b"a\n"), b"a");
        assert_eq!(trim_newline(b"a\r\n"), b"a");
        assert_eq!(trim_newline(b"a"), b"a");
        assert_eq!(trim_newline(b"a\n\n"), b"a\n");
    }
}
